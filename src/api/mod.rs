//! `runner serve`: live sandboxes and Jobs over an authenticated HTTP API. `router` builds the
//! whole API (testable without a socket); HTTP statuses come only from `error`.

pub mod error;
mod openapi;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path as UrlPath, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;

pub use error::ApiError;

use crate::cli::Global;
use crate::manifest::{self, Backend};
use crate::runtime::containerd::agent::AGENT_MOUNT;
use crate::runtime::containerd::{Engine, LiveContainer, TOOLS_MOUNT};
use crate::runtime::host::HostRuntime;
use crate::runtime::{ExecRequest, ExecResult, Runtime, RuntimeOptions};
use crate::spec::{self, HostEnv};

/// Largest request body (manifests, code, uploads).
pub const MAX_BODY_BYTES: usize = 64 << 20;
/// Largest JSON request (everything but uploads and file writes).
const MAX_JSON_BYTES: usize = 4 << 20;
/// How long the Python driver may take to start and connect.
const PYTHON_START_LIMIT: Duration = Duration::from_secs(15);
/// After SIGINT, how long interrupted Python code may take to give up.
const PYTHON_INTERRUPT_GRACE: Duration = Duration::from_secs(3);
/// Default per-call limit when a request sets none.
const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(300);

/// Constant-time equality: the time taken does not depend on where the inputs differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        diff |= usize::from(a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0));
    }
    diff == 0
}

pub struct Session {
    pub id: String,
    runtime: Arc<dyn Runtime>,
    live: Option<Arc<LiveContainer>>,
    workspace: PathBuf,
    /// Who owns what the file API creates in the workspace: the sandbox's user.
    owner: Option<crate::confined::Owner>,
    _scratch: Option<tempfile::TempDir>,
    backend: Backend,
    last_used: Mutex<Instant>,
    created: String,
    python: tokio::sync::Mutex<Option<PythonDriver>>,
    /// One command at a time per shell name is guaranteed by the runtime's slot.
    shells: Mutex<std::collections::BTreeSet<String>>,
    /// The shell interpreter of the image (bash when present), found on first use.
    shell_bin: tokio::sync::OnceCell<String>,
}

impl Session {
    fn touch(&self) {
        *self.last_used.lock().expect("session lock") = Instant::now();
    }
}

struct PythonDriver {
    reader: BufReader<tokio::net::unix::OwnedReadHalf>,
    writer: tokio::net::unix::OwnedWriteHalf,
    /// The driver's PID inside the container.
    pid: i32,
}

pub struct AppState {
    token: Vec<u8>,
    global: Global,
    host: HostEnv,
    engine: Option<Engine>,
    env_dir: Option<PathBuf>,
    base_dir: PathBuf,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    pub idle_ttl: Duration,
}

impl AppState {
    pub fn new(
        token: Vec<u8>,
        global: Global,
        engine: Option<Engine>,
        env_dir: Option<PathBuf>,
        idle_ttl: Duration,
    ) -> Self {
        AppState {
            token,
            host: HostEnv::detect(&global.state_dir),
            global,
            engine,
            env_dir,
            base_dir: std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/")),
            sessions: Mutex::new(HashMap::new()),
            idle_ttl,
        }
    }

    fn session(&self, id: &str) -> Result<Arc<Session>, ApiError> {
        let s = self
            .sessions
            .lock()
            .expect("sessions lock")
            .get(id)
            .cloned()
            .ok_or_else(|| ApiError::NotFound(format!("session {id:?}")))?;
        s.touch();
        Ok(s)
    }

    /// End sessions idle for longer than the TTL.
    pub async fn reap_idle(&self) {
        let expired: Vec<Arc<Session>> = {
            let mut sessions = self.sessions.lock().expect("sessions lock");
            let ids: Vec<String> = sessions
                .iter()
                .filter(|(_, s)| s.last_used.lock().expect("session lock").elapsed() > self.idle_ttl)
                .map(|(id, _)| id.clone())
                .collect();
            ids.iter().filter_map(|id| sessions.remove(id)).collect()
        };
        for s in expired {
            tracing::info!(session = s.id, "idle session expired");
            let _ = s.runtime.cleanup().await;
        }
    }

    /// End every session (server shutdown).
    pub async fn close_all(&self) {
        let all: Vec<Arc<Session>> = self
            .sessions
            .lock()
            .expect("sessions lock")
            .drain()
            .map(|(_, s)| s)
            .collect();
        for s in all {
            let _ = s.runtime.cleanup().await;
        }
    }
}

type AppResult<T> = Result<T, ApiError>;

/// The whole API.
pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/openapi.json", get(openapi))
        .route("/v1/sessions", post(create_session).get(list_sessions))
        .route(
            "/v1/sessions/{id}",
            axum::routing::delete(delete_session).get(get_session),
        )
        .route("/v1/sessions/{id}/exec", post(exec))
        .route("/v1/sessions/{id}/exec/stream", post(exec_stream))
        .route("/v1/sessions/{id}/shell", post(shell))
        .route("/v1/sessions/{id}/python", post(python_exec))
        .route("/v1/sessions/{id}/python/vars", get(python_vars))
        .route("/v1/sessions/{id}/python/vars/{name}", get(python_var))
        .route("/v1/sessions/{id}/files", get(read_file).put(write_file))
        .route("/v1/sessions/{id}/files/list", get(list_files))
        .route("/v1/sessions/{id}/files/upload", post(upload))
        .route("/v1/sessions/{id}/files/download", get(download))
        .route("/v1/sessions/{id}/files/mkdir", post(make_dir))
        .route("/v1/jobs", post(create_job).get(list_jobs))
        .route("/v1/jobs/{name}", get(get_job).delete(delete_job))
        .route("/v1/jobs/{name}/logs", get(job_logs))
        .route_layer(middleware::from_fn_with_state(state.clone(), authenticate));
    Router::new()
        .route("/healthz", get(|| async { Json(serde_json::json!({"status": "ok"})) }))
        .merge(v1)
        .layer(middleware::from_fn(limit_body))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// 401 before anything else is looked at; the token is compared in constant time.
async fn authenticate(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if state.token.is_empty() || !same(given.as_bytes(), &state.token) {
        return ApiError::Unauthorized.into_response();
    }
    next.run(request).await
}

/// 413 for a declared length above the cap, before the body is read.
async fn limit_body(request: Request, next: Next) -> Response {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES) {
        return ApiError::TooLarge.into_response();
    }
    let response = next.run(request).await;
    if response.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return ApiError::TooLarge.into_response();
    }
    response
}

fn parse_json<T: serde::de::DeserializeOwned>(body: &Bytes) -> AppResult<T> {
    if body.len() > MAX_JSON_BYTES {
        return Err(ApiError::TooLarge);
    }
    serde_json::from_slice(body).map_err(|e| ApiError::BadRequest(format!("invalid JSON body: {e}")))
}

async fn openapi() -> Json<serde_json::Value> {
    Json(openapi::document())
}

// ---- sessions

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CreateSession {
    environment: serde_json::Value,
    workspace: Option<String>,
    #[serde(default)]
    static_assets: Vec<serde_json::Value>,
    #[serde(default)]
    mounts: Vec<serde_json::Value>,
    backend: Option<Backend>,
}

fn session_view(s: &Session) -> serde_json::Value {
    serde_json::json!({
        "id": s.id,
        "backend": s.backend,
        "workspace": s.workspace,
        "created": s.created,
        "idleSeconds": s.last_used.lock().expect("session lock").elapsed().as_secs(),
    })
}

async fn create_session(State(state): State<Arc<AppState>>, body: Bytes) -> AppResult<Response> {
    let req: CreateSession = parse_json(&body)?;
    let id = format!(
        "s-{}",
        &crate::image::archive::sha256_bytes(format!("{:?}{}", Instant::now(), std::process::id()).as_bytes())[7..19]
    );
    let (env_name, env_doc) = match &req.environment {
        serde_json::Value::String(name) => (name.clone(), None),
        // A whole document, as pasted from a manifest.
        serde_json::Value::Object(doc) if doc.contains_key("kind") || doc.contains_key("apiVersion") => {
            environment_document(doc)?
        }
        serde_json::Value::Object(spec) => (
            "session-env".to_string(),
            Some(serde_json::json!({
                "apiVersion": manifest::API_VERSION, "kind": "Environment",
                "metadata": {"name": "session-env"}, "spec": spec,
            })),
        ),
        _ => {
            return Err(ApiError::BadRequest(
                "environment: an Environment (a whole document, or its spec object) or the name of one".into(),
            ));
        }
    };
    let scratch = match &req.workspace {
        Some(_) => None,
        None => Some(
            tempfile::Builder::new()
                .prefix("runner-session-")
                .tempdir()
                .map_err(ApiError::internal)?,
        ),
    };
    let workspace = match (&req.workspace, &scratch) {
        (Some(w), _) => w.clone(),
        (None, Some(t)) => t.path().to_string_lossy().into_owned(),
        (None, None) => unreachable!("a scratch workspace exists when none is given"),
    };
    if let Some(t) = &scratch {
        // Sandboxes may run as any uid: their scratch workspace is theirs to write.
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o777));
    }
    let job_doc = serde_json::json!({
        "apiVersion": manifest::API_VERSION, "kind": "Job",
        "metadata": {"name": id},
        "spec": {"environment": env_name, "workspace": workspace, "staticAssets": req.static_assets, "mounts": req.mounts, "command": "true"},
    });
    let text = match env_doc {
        Some(env) => format!("{env}\n---\n{job_doc}\n"),
        None => format!("{job_doc}\n"),
    };
    let mut set = manifest::parse_str(&text, &state.base_dir, None).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    if let Some(dir) = &state.env_dir {
        set.env_dir = manifest::load_env_dir(dir).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    }
    let job = set.jobs.first().ok_or_else(|| ApiError::internal("no job"))?.clone();
    let bound = set
        .bind(&job, req.backend)
        .map_err(|e| ApiError::BadRequest(e.to_string()))?;
    let plan = spec::resolve(&bound, &state.host).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    let backend = bound.backend;
    let owner = match (backend, spec::container_user(&bound.env, &state.host)) {
        (Backend::Containerd, (uid, gid)) if (uid, gid) != (0, 0) => Some(crate::confined::Owner { uid, gid }),
        _ => None,
    };
    let (runtime, live): (Arc<dyn Runtime>, Option<Arc<LiveContainer>>) = match backend {
        Backend::Containerd => {
            let engine = state
                .engine
                .as_ref()
                .ok_or_else(|| ApiError::NotSupported("containerd is not connected to this server".into()))?;
            let live = Arc::new(engine.spawn_live(&plan).await.map_err(|e| match e {
                crate::runtime::RuntimeError::Refused(m) => ApiError::BadRequest(m),
                crate::runtime::RuntimeError::Image(e) => ApiError::BadRequest(e.to_string()),
                other => ApiError::internal(other),
            })?);
            (live.clone(), Some(live))
        }
        Backend::Host => {
            let options = RuntimeOptions::default();
            let rt = HostRuntime::spawn(&plan, &state.host, &options)
                .await
                .map_err(ApiError::internal)?;
            (Arc::new(rt), None)
        }
    };
    if let Some(setup) = runtime.setup().filter(|s| !s.succeeded()) {
        let setup = serde_json::to_value(setup).unwrap_or_default();
        let _ = runtime.cleanup().await;
        return Err(ApiError::Unprocessable(format!("setup failed: {setup}")));
    }
    let session = Arc::new(Session {
        id: id.clone(),
        runtime,
        live,
        workspace: PathBuf::from(&workspace),
        owner,
        _scratch: scratch,
        backend,
        last_used: Mutex::new(Instant::now()),
        created: crate::job::rfc3339(std::time::SystemTime::now()),
        python: tokio::sync::Mutex::new(None),
        shells: Mutex::new(Default::default()),
        shell_bin: tokio::sync::OnceCell::new(),
    });
    state
        .sessions
        .lock()
        .expect("sessions lock")
        .insert(id.clone(), session.clone());
    Ok((StatusCode::CREATED, Json(session_view(&session))).into_response())
}

/// A whole Environment document given as a session's `environment`: checked here for what
/// the manifest parser cannot see (its kind and version), named `environment.*` in errors.
fn environment_document(
    doc: &serde_json::Map<String, serde_json::Value>,
) -> AppResult<(String, Option<serde_json::Value>)> {
    const FIELDS: [&str; 4] = ["apiVersion", "kind", "metadata", "spec"];
    if let Some(unknown) = doc.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(ApiError::BadRequest(format!(
            "environment.{unknown}: unknown field (an Environment document has apiVersion, kind, metadata, spec)"
        )));
    }
    match doc.get("apiVersion") {
        Some(serde_json::Value::String(v)) if v == manifest::API_VERSION => {}
        other => {
            return Err(ApiError::BadRequest(format!(
                "environment.apiVersion: expected {:?}, got {}",
                manifest::API_VERSION,
                other.map_or("nothing".to_string(), |v| v.to_string())
            )));
        }
    }
    match doc.get("kind") {
        Some(serde_json::Value::String(k)) if k == "Environment" => {}
        other => {
            return Err(ApiError::BadRequest(format!(
                "environment.kind: expected \"Environment\", got {}",
                other.map_or("nothing".to_string(), |v| v.to_string())
            )));
        }
    }
    if !doc.get("spec").is_some_and(serde_json::Value::is_object) {
        return Err(ApiError::BadRequest("environment.spec: an object is required".into()));
    }
    let name = match doc.get("metadata") {
        None => "session-env".to_string(),
        Some(serde_json::Value::Object(meta)) => match meta.get("name") {
            None => "session-env".to_string(),
            Some(serde_json::Value::String(n)) => n.clone(),
            Some(other) => {
                return Err(ApiError::BadRequest(format!(
                    "environment.metadata.name: a string is required, got {other}"
                )));
            }
        },
        Some(other) => {
            return Err(ApiError::BadRequest(format!(
                "environment.metadata: an object is required, got {other}"
            )));
        }
    };
    let mut doc = serde_json::Value::Object(doc.clone());
    doc["metadata"]["name"] = name.clone().into();
    Ok((name, Some(doc)))
}

async fn list_sessions(State(state): State<Arc<AppState>>) -> Json<Vec<serde_json::Value>> {
    let sessions = state.sessions.lock().expect("sessions lock");
    let mut out: Vec<serde_json::Value> = sessions.values().map(|s| session_view(s)).collect();
    out.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
    Json(out)
}

async fn get_session(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
) -> AppResult<Json<serde_json::Value>> {
    let session = state.session(&id)?;
    Ok(Json(session_view(&session)))
}

async fn delete_session(State(state): State<Arc<AppState>>, UrlPath(id): UrlPath<String>) -> AppResult<StatusCode> {
    let session = state
        .sessions
        .lock()
        .expect("sessions lock")
        .remove(&id)
        .ok_or_else(|| ApiError::NotFound(format!("session {id:?}")))?;
    session.runtime.cleanup().await.map_err(ApiError::internal)?;
    Ok(StatusCode::NO_CONTENT)
}

// ---- exec

#[derive(Deserialize)]
#[serde(untagged)]
enum CommandSpec {
    Argv(Vec<String>),
    Shell(String),
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ExecBody {
    command: CommandSpec,
    stdin: Option<String>,
    timeout_seconds: Option<f64>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    cwd: Option<String>,
}

fn seconds(v: Option<f64>) -> AppResult<Option<Duration>> {
    match v {
        None => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 && s <= manifest::MAX_TIMEOUT_SECONDS as f64 => {
            Ok(Some(Duration::from_secs_f64(s)))
        }
        Some(_) => Err(ApiError::BadRequest("timeoutSeconds must be above 0".into())),
    }
}

fn exec_request(body: ExecBody) -> AppResult<ExecRequest> {
    let argv = match body.command {
        CommandSpec::Argv(a) if !a.is_empty() => a,
        CommandSpec::Shell(s) if !s.trim().is_empty() => vec!["/bin/sh".into(), "-c".into(), s],
        _ => return Err(ApiError::BadRequest("command must not be empty".into())),
    };
    if let Some(cwd) = &body.cwd {
        manifest::paths::check_lexical(cwd).map_err(|e| ApiError::BadRequest(format!("cwd: {e}")))?;
    }
    Ok(ExecRequest {
        argv,
        stdin: body.stdin.map(String::into_bytes),
        timeout: seconds(body.timeout_seconds)?,
        env: body.env,
        cwd: body.cwd,
    })
}

fn runtime_error(e: crate::runtime::RuntimeError) -> ApiError {
    use crate::runtime::RuntimeError as E;
    match e {
        E::EmptyCommand | E::Refused(_) => ApiError::BadRequest(e.to_string()),
        E::Start { .. } => ApiError::Unprocessable(e.to_string()),
        E::CleanedUp => ApiError::NotFound("session".into()),
        other => ApiError::internal(other),
    }
}

async fn exec(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
    body: Bytes,
) -> AppResult<Json<ExecResult>> {
    let session = state.session(&id)?;
    let request = exec_request(parse_json(&body)?)?;
    Ok(Json(session.runtime.execute(request).await.map_err(runtime_error)?))
}

/// NDJSON: one event object per line (`stdout`, `stderr`, then `exit`) as they happen.
async fn exec_stream(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
    body: Bytes,
) -> AppResult<Response> {
    let session = state.session(&id)?;
    let request = exec_request(parse_json(&body)?)?;
    if request.stdin.is_some() {
        return Err(ApiError::BadRequest("streaming takes no stdin (use exec)".into()));
    }
    let mut rx = session
        .runtime
        .stream(request.argv, request.timeout)
        .await
        .map_err(runtime_error)?;
    let stream = async_stream(move |tx| async move {
        while let Some(event) = rx.recv().await {
            let mut line = serde_json::to_vec(&event).unwrap_or_default();
            line.push(b'\n');
            if tx.send(Ok(Bytes::from(line))).await.is_err() {
                break;
            }
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(Body::from_stream(stream))
        .map_err(ApiError::internal)
}

/// A body stream fed by a task.
fn async_stream<F, Fut>(f: F) -> tokio_stream::wrappers::ReceiverStream<Result<Bytes, std::io::Error>>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(f(tx));
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

// ---- stateful shell

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ShellBody {
    command: String,
    timeout_seconds: Option<f64>,
    check: Option<String>,
    /// Several named shells per session; default `default`.
    name: Option<String>,
}

/// The shell's state (cwd, exported variables, functions) lives in a file in the sandbox; each
/// call sources it, runs the command (stdin from /dev/null, stderr into the output), and saves
/// it again. A command that times out is killed with its process group and leaves the state
/// as it was: the shell stays usable. bash when the image has it (functions persist), else sh.
const SHELL_SCRIPT: &str = r#"runner_f="/tmp/.runner-shell/$RUNNER_SHELL_NAME.sh"
runner_cmd=$RUNNER_SHELL_CMD
unset RUNNER_SHELL_CMD RUNNER_SHELL_NAME
mkdir -p /tmp/.runner-shell 2>/dev/null
if [ -f "$runner_f" ]; then . "$runner_f" >/dev/null 2>&1; fi
eval "$runner_cmd" </dev/null 2>&1
runner_rc=$?
{
  export -p
  if [ -n "$BASH_VERSION" ]; then declare -f; fi
  printf 'cd %s\n' "'$(pwd | sed "s/'/'\\\\''/g")'"
} >"$runner_f.tmp" 2>/dev/null && mv "$runner_f.tmp" "$runner_f"
exit $runner_rc"#;

async fn shell(State(state): State<Arc<AppState>>, UrlPath(id): UrlPath<String>, body: Bytes) -> AppResult<Response> {
    let session = state.session(&id)?;
    let req: ShellBody = parse_json(&body)?;
    let name = req.name.unwrap_or_else(|| "default".into());
    if name.is_empty()
        || name.len() > 63
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(ApiError::BadRequest("name: letters, digits, '-' and '_'".into()));
    }
    let raise = match req.check.as_deref() {
        None | Some("ignore") => false,
        Some("raise") => true,
        Some(other) => return Err(ApiError::BadRequest(format!("check: {other:?} (ignore or raise)"))),
    };
    session.shells.lock().expect("shells lock").insert(name.clone());
    let interpreter = session
        .shell_bin
        .get_or_try_init(|| async {
            let probe = ExecRequest {
                argv: vec!["/bin/sh".into(), "-c".into(), "command -v bash || echo /bin/sh".into()],
                timeout: Some(Duration::from_secs(10)),
                ..Default::default()
            };
            let r = session.runtime.execute(probe).await.map_err(runtime_error)?;
            Ok::<String, ApiError>(r.stdout.lines().next().unwrap_or("/bin/sh").trim().to_string())
        })
        .await?
        .clone();
    let request = ExecRequest {
        argv: vec![interpreter, "-c".into(), SHELL_SCRIPT.into()],
        stdin: None,
        timeout: Some(seconds(req.timeout_seconds)?.unwrap_or(DEFAULT_CALL_TIMEOUT)),
        env: BTreeMap::from([
            ("RUNNER_SHELL_CMD".to_string(), req.command),
            ("RUNNER_SHELL_NAME".to_string(), name),
        ]),
        cwd: None,
    };
    let r = session.runtime.execute(request).await.map_err(runtime_error)?;
    let answer = serde_json::json!({
        "output": r.stdout,
        "exitCode": r.exit_code,
        "timedOut": r.timed_out,
    });
    if raise && (r.exit_code != Some(0) || r.timed_out) {
        return Ok((
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(serde_json::json!({
                "error": format!("command failed with exit code {:?}", r.exit_code),
                "output": r.stdout, "exitCode": r.exit_code, "timedOut": r.timed_out,
            })),
        )
            .into_response());
    }
    Ok(Json(answer).into_response())
}

// ---- persistent Python

async fn start_python(session: &Session) -> AppResult<PythonDriver> {
    let live = session
        .live
        .as_ref()
        .ok_or_else(|| ApiError::NotSupported("the Python session needs the containerd backend".into()))?;
    let dir = live
        .agent_dir()
        .ok_or_else(|| ApiError::internal("no agent directory"))?;
    let sock = dir.join("py.sock");
    // We listen; the driver connects: a socket path in a sandbox-writable directory is never
    // something the host connects to. The socket is made and chmod-ed in the container's
    // host-only run directory, then renamed into the shared one: a chmod by path in the
    // shared directory would follow a symlink the sandbox swapped in.
    let private = dir
        .parent()
        .ok_or_else(|| ApiError::internal("the agent directory has no parent"))?
        .join("py.sock");
    let _ = std::fs::remove_file(&private);
    let listener = UnixListener::bind(&private).map_err(ApiError::internal)?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o777)).map_err(ApiError::internal)?;
    }
    std::fs::rename(&private, &sock).map_err(|e| {
        let _ = std::fs::remove_file(&private);
        ApiError::Unprocessable(format!("cannot place the Python socket in the sandbox: {e}"))
    })?;
    let start = format!(
        "if command -v python3 >/dev/null 2>&1; then nohup python3 {TOOLS_MOUNT}/driver.py {AGENT_MOUNT}/py.sock >/dev/null 2>&1 & else echo 'python3 is not in this image' >&2; exit 127; fi"
    );
    let r = session
        .runtime
        .execute(ExecRequest {
            argv: vec!["/bin/sh".into(), "-c".into(), start],
            timeout: Some(PYTHON_START_LIMIT),
            ..Default::default()
        })
        .await
        .map_err(runtime_error)?;
    if r.exit_code != Some(0) {
        return Err(ApiError::Unprocessable(format!(
            "cannot start Python: {}",
            r.stderr.trim()
        )));
    }
    let (stream, _) = tokio::time::timeout(PYTHON_START_LIMIT, listener.accept())
        .await
        .map_err(|_| ApiError::Unprocessable("the Python driver did not start".into()))?
        .map_err(ApiError::internal)?;
    drop(listener);
    let _ = std::fs::remove_file(&sock);
    let (read, writer) = stream.into_split();
    let mut reader = BufReader::new(read);
    let mut hello = String::new();
    tokio::time::timeout(PYTHON_START_LIMIT, reader.read_line(&mut hello))
        .await
        .map_err(|_| ApiError::Unprocessable("the Python driver did not answer".into()))?
        .map_err(ApiError::internal)?;
    let pid = serde_json::from_str::<serde_json::Value>(&hello)
        .ok()
        .and_then(|v| v["hello"].as_i64())
        .ok_or_else(|| ApiError::Unprocessable("the Python driver said something unexpected".into()))?
        as i32;
    Ok(PythonDriver { reader, writer, pid })
}

/// One request to the session's interpreter (started on first use). On timeout the code
/// gets SIGINT (KeyboardInterrupt); if it does not give up, the interpreter is restarted.
async fn python_call(session: &Session, request: serde_json::Value, timeout: Duration) -> AppResult<serde_json::Value> {
    let mut guard = session.python.lock().await;
    if guard.is_none() {
        *guard = Some(start_python(session).await?);
    }
    let driver = guard.as_mut().expect("driver just started");
    let oom_before = session.live.as_ref().and_then(|l| l.oom_kills()).unwrap_or(0);
    let mut line = serde_json::to_vec(&request).map_err(ApiError::internal)?;
    line.push(b'\n');
    if driver.writer.write_all(&line).await.is_err() {
        *guard = None;
        return Err(ApiError::Unprocessable(
            "the Python interpreter died; it restarts on the next call".into(),
        ));
    }
    let mut answer = String::new();
    let read = tokio::time::timeout(timeout, driver.reader.read_line(&mut answer)).await;
    let timed_out = read.is_err();
    if timed_out {
        if let Some(live) = &session.live {
            live.signal_container_pid(driver.pid, nix::sys::signal::Signal::SIGINT);
        }
        answer.clear();
        if tokio::time::timeout(PYTHON_INTERRUPT_GRACE, driver.reader.read_line(&mut answer))
            .await
            .is_err()
        {
            if let Some(live) = &session.live {
                live.signal_container_pid(driver.pid, nix::sys::signal::Signal::SIGKILL);
            }
            *guard = None;
            return Ok(
                serde_json::json!({"output": "", "stderr": "", "error": "TimeoutError: the code ignored the interrupt; the interpreter was restarted (its state is lost)", "timedOut": true}),
            );
        }
    }
    if answer.is_empty() {
        // The interpreter died under the code (EOF): most often the memory limit.
        *guard = None;
        let oom = session
            .live
            .as_ref()
            .and_then(|l| l.oom_kills())
            .is_some_and(|n| n > oom_before);
        let error = if oom {
            "MemoryError: the interpreter was killed at the memory limit; it restarts (empty) on the next call"
        } else {
            "the interpreter died; it restarts (empty) on the next call"
        };
        return Ok(serde_json::json!({"output": "", "stderr": "", "error": error, "oomKilled": oom}));
    }
    let mut value: serde_json::Value = serde_json::from_str(&answer)
        .map_err(|_| ApiError::Unprocessable("the Python interpreter gave no answer".into()))?;
    if timed_out && let Some(obj) = value.as_object_mut() {
        obj.insert("timedOut".into(), serde_json::Value::Bool(true));
    }
    Ok(value)
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PythonBody {
    code: String,
    timeout_seconds: Option<f64>,
}

async fn python_exec(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
    body: Bytes,
) -> AppResult<Json<serde_json::Value>> {
    let session = state.session(&id)?;
    let req: PythonBody = parse_json(&body)?;
    let timeout = seconds(req.timeout_seconds)?.unwrap_or(DEFAULT_CALL_TIMEOUT);
    Ok(Json(
        python_call(&session, serde_json::json!({"op": "exec", "code": req.code}), timeout).await?,
    ))
}

async fn python_vars(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
) -> AppResult<Json<serde_json::Value>> {
    let session = state.session(&id)?;
    let v = python_call(&session, serde_json::json!({"op": "vars"}), DEFAULT_CALL_TIMEOUT).await?;
    Ok(Json(v["vars"].clone()))
}

async fn python_var(
    State(state): State<Arc<AppState>>,
    UrlPath((id, name)): UrlPath<(String, String)>,
) -> AppResult<Json<serde_json::Value>> {
    let session = state.session(&id)?;
    let v = python_call(
        &session,
        serde_json::json!({"op": "var", "name": name}),
        DEFAULT_CALL_TIMEOUT,
    )
    .await?;
    if let Some(e) = v.get("error") {
        return Err(ApiError::NotFound(e.as_str().unwrap_or("variable").to_string()));
    }
    Ok(Json(serde_json::json!({"value": v["value"]})))
}

// ---- files (host side, inside the session's workspace)
//
// The sandbox owns every name in its workspace and runs concurrently: each operation resolves
// its path beneath the workspace's directory fd (`confined`), never by a checked host path.

#[derive(Deserialize)]
struct PathQuery {
    path: Option<String>,
}

/// Most entries one listing returns (a sandbox can make millions).
const LIST_LIMIT: usize = 10_000;
/// Most bytes one tar upload may extract (it may be gzipped).
const MAX_EXTRACTED_BYTES: u64 = 1 << 30;

fn confined_error(e: crate::confined::ConfinedError) -> ApiError {
    use crate::confined::ConfinedError as E;
    match e {
        E::NotFound { .. } => ApiError::NotFound(e.to_string()),
        E::TooLarge { .. } => ApiError::BadRequest(e.to_string()),
        E::Unsupported { .. } => ApiError::NotSupported(e.to_string()),
        E::Io { .. } => ApiError::internal(e),
        _ => ApiError::BadRequest(e.to_string()),
    }
}

/// Run a confined operation on the session's workspace on the blocking pool.
async fn in_workspace<T: Send + 'static>(
    session: &Session,
    op: impl FnOnce(&crate::confined::Root) -> Result<T, crate::confined::ConfinedError> + Send + 'static,
) -> AppResult<T> {
    let workspace = session.workspace.clone();
    tokio::task::spawn_blocking(move || crate::confined::Root::open(&workspace).and_then(|root| op(&root)))
        .await
        .map_err(ApiError::internal)?
        .map_err(confined_error)
}

async fn read_file(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
    Query(q): Query<PathQuery>,
) -> AppResult<Response> {
    let session = state.session(&id)?;
    let rel = q.path.ok_or_else(|| ApiError::BadRequest("path is required".into()))?;
    let file = in_workspace(&session, move |root| root.open_read(&rel)).await?;
    // Streamed: a file the sandbox made may be huge (or sparse).
    let stream = tokio_util::io::ReaderStream::new(tokio::fs::File::from_std(file));
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        Body::from_stream(stream),
    )
        .into_response())
}

async fn write_file(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
    Query(q): Query<PathQuery>,
    body: Bytes,
) -> AppResult<StatusCode> {
    let session = state.session(&id)?;
    let rel = q.path.ok_or_else(|| ApiError::BadRequest("path is required".into()))?;
    let owner = session.owner;
    in_workspace(&session, move |root| {
        // Existing parents are resolved beneath the root (relative links inside it followed);
        // only missing ones are created, each a real directory.
        match root.write_file(&rel, &mut &body[..], false, owner) {
            Err(crate::confined::ConfinedError::NotFound { .. }) => root.write_file(&rel, &mut &body[..], true, owner),
            other => other,
        }
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn make_dir(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
    Query(q): Query<PathQuery>,
) -> AppResult<StatusCode> {
    let session = state.session(&id)?;
    let rel = q.path.ok_or_else(|| ApiError::BadRequest("path is required".into()))?;
    let owner = session.owner;
    in_workspace(&session, move |root| root.create_dir_all(&rel, owner)).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn list_files(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
    Query(q): Query<PathQuery>,
) -> AppResult<Response> {
    let session = state.session(&id)?;
    let rel = q.path.unwrap_or_default();
    let listing = in_workspace(&session, move |root| root.list(&rel, LIST_LIMIT)).await?;
    let entries: Vec<serde_json::Value> = listing
        .entries
        .iter()
        .map(|e| {
            let mut v = serde_json::json!({
                "name": e.name, "type": e.kind, "size": e.size, "mode": e.mode, "mtime": e.mtime,
            });
            if let Some(t) = &e.target {
                v["target"] = t.clone().into();
            }
            v
        })
        .collect();
    let mut response = Json(entries).into_response();
    if listing.truncated {
        response
            .headers_mut()
            .insert("x-runner-truncated", axum::http::HeaderValue::from_static("true"));
    }
    Ok(response)
}

async fn upload(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
    Query(q): Query<PathQuery>,
    body: Bytes,
) -> AppResult<Json<crate::confined::UnpackReport>> {
    let session = state.session(&id)?;
    let rel = q.path.unwrap_or_default();
    let owner = session.owner;
    Ok(Json(
        in_workspace(&session, move |root| {
            root.unpack_tar(&rel, &body, owner, MAX_EXTRACTED_BYTES)
        })
        .await?,
    ))
}

/// A tar of a workspace directory (or one file), streamed as it is written.
async fn download(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
    Query(q): Query<PathQuery>,
) -> AppResult<Response> {
    let session = state.session(&id)?;
    let rel = q.path.unwrap_or_default();
    let workspace = session.workspace.clone();
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    tokio::task::spawn_blocking(move || {
        use crate::confined::{ConfinedError, Root};
        // Resolve first, so a bad path is an error status rather than a cut stream.
        let opened = Root::open(&workspace).and_then(|root| {
            let exists = match root.list(&rel, 1) {
                Err(ConfinedError::NotADirectory { .. }) => root.open_read(&rel).map(|_| ()),
                other => other.map(|_| ()),
            };
            exists.map(|()| root)
        });
        let root = match opened {
            Ok(root) => {
                let _ = ready_tx.send(Ok(()));
                root
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e));
                return;
            }
        };
        let mut out = ChannelWriter(tx.clone());
        if let Err(e) = root.pack_tar(&rel, &mut out) {
            // The status is sent; the client sees a cut stream, and we say why in the log.
            tracing::warn!(error = %e, "tar download stopped");
            let _ = tx.blocking_send(Err(std::io::Error::other(e.to_string())));
        }
    });
    ready_rx.await.map_err(ApiError::internal)?.map_err(confined_error)?;
    Ok((
        [(header::CONTENT_TYPE, "application/x-tar")],
        Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
        .into_response())
}

/// A blocking writer feeding a response body.
struct ChannelWriter(tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>);

impl std::io::Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .blocking_send(Ok(Bytes::copy_from_slice(buf)))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the client went away"))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

// ---- jobs (the CLI's code paths)

async fn create_job(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> AppResult<Response> {
    let text = std::str::from_utf8(&body).map_err(|_| ApiError::BadRequest("the manifest is not UTF-8".into()))?;
    let _ = headers;
    let names = crate::jobcmd::submit(&state.global, text, &state.base_dir, state.env_dir.as_deref())
        .map_err(|e| ApiError::BadRequest(e.to_string()))?;
    Ok((StatusCode::CREATED, Json(serde_json::json!({"created": names}))).into_response())
}

async fn list_jobs(State(state): State<Arc<AppState>>) -> AppResult<Json<Vec<crate::job::JobObject>>> {
    crate::jobcmd::job_objects(&state.global)
        .map(Json)
        .map_err(ApiError::internal)
}

async fn get_job(
    State(state): State<Arc<AppState>>,
    UrlPath(name): UrlPath<String>,
) -> AppResult<Json<crate::job::JobObject>> {
    crate::jobcmd::job_object(&state.global, &name)
        .map_err(|_| ApiError::NotFound(format!("job {name:?}")))
        .map(Json)
}

async fn job_logs(State(state): State<Arc<AppState>>, UrlPath(name): UrlPath<String>) -> AppResult<Response> {
    let text =
        crate::jobcmd::job_output(&state.global, &name).map_err(|_| ApiError::NotFound(format!("job {name:?}")))?;
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response())
}

async fn delete_job(State(state): State<Arc<AppState>>, UrlPath(name): UrlPath<String>) -> AppResult<StatusCode> {
    crate::jobcmd::delete(&state.global, &name)
        .await
        .map_err(|e| ApiError::NotFound(e.to_string()))?;
    Ok(StatusCode::NO_CONTENT)
}
