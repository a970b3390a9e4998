//! SWE-ReX compatibility: every session also speaks SWE-ReX's remote-runtime protocol under
//! `/v1/sessions/{id}/swerex`, so `swerex.runtime.remote.RemoteRuntime(host=".../swerex",
//! port=None, auth_token=TOKEN)` drives it unchanged (its `X-API-Key` header is accepted there
//! as the bearer token, see `authenticate`).
//!
//! The bodies are SWE-ReX's models, field for field; its errors are its own shapes: a runtime
//! failure is a transferred exception (status 511, `{"swerexception": {message, class_path,
//! traceback, extra_info}}`) that the client re-raises as the same class, an unreadable
//! request is FastAPI's 422 `{"detail": [...]}`, a session that is gone is 404 `{"detail"}`.
//!
//! What runs is ours: a SWE-ReX bash session is one of the session's named shells (a fresh
//! one per `create_session`), so a timeout kills the command and leaves the shell usable,
//! where SWE-ReX's own shell is stuck behind the running command. Files named by absolute
//! paths inside the workspace use the confined file operations; any other path is read or
//! written by a command in the sandbox, so what is touched is the sandbox's own view.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{AppState, Doc, MAX_BODY_BYTES, MAX_JSON_BYTES, Route, route};
use crate::confined::ConfinedError;
use crate::manifest::{self, Backend};
use crate::runtime::ExecRequest;
use crate::service::sessions::{Check, Lease, ShellRequest};
use crate::service::{Invalid, ServiceError};

/// What SWE-ReX's bash session answers as `expect_string` when its prompt ended a command.
const PS1: &str = "SHELLPS1PREFIX";
/// Starts the output of a command that failed the syntax check (see `WRAPPER`).
const SYNTAX_MARK: &str = "\u{1e}RUNNER-SWEREX-SYNTAX ";
/// Responses kept for a retried `X-Request-ID` (larger ones are not kept).
const REPLAY_LIMIT: usize = 1 << 20;
/// Most bytes `read_file` returns.
const READ_LIMIT: u64 = 64 << 20;
/// Most bytes an uploaded zip may expand to.
const UNZIP_LIMIT: u64 = 1 << 30;

const SWEREX_EXCEPTION: &str = "swerex.exceptions.SwerexException";
const SESSION_EXISTS: &str = "swerex.exceptions.SessionExistsError";
const SESSION_MISSING: &str = "swerex.exceptions.SessionDoesNotExistError";
const NON_ZERO_EXIT: &str = "swerex.exceptions.NonZeroExitCodeError";
const COMMAND_TIMEOUT: &str = "swerex.exceptions.CommandTimeoutError";
const BAD_SYNTAX: &str = "swerex.exceptions.BashIncorrectSyntaxError";

/// Runs one SWE-ReX command in our shell, after `__rx_c='<the command>'` (and `__rx_q=N` when
/// the command should start with `$?` at N, as after a failure under `check="ignore"`, where
/// SWE-ReX does not reset it by asking for the exit code). Like SWE-ReX, it first checks the
/// syntax with `bash -n`, and runs nothing when that fails (reported after `SYNTAX_MARK`, with
/// bash's exit code and messages). A sandbox's shell is resident and keeps every shell
/// variable, as SWE-ReX's does. A host session's shell runs per call and keeps exported
/// variables, functions and the directory; there every other shell variable is kept too
/// (`declare -p`), next to the shell's state file (`$runner_f`, unset in a resident shell), and
/// restored before the command (read-only and special ones are refused or ignored by bash,
/// silently). No process is forked but the syntax check. Without bash (an image with only
/// `sh`) the command just runs; the script stays POSIX (the here-string is only parsed by bash).
/// The wrapper's own variables are unset again, so the shell shows only the user's.
const WRAPPER: &str = r#"__rx_s=${runner_f:+$runner_f.swerex}
__rx_n=0
if [ -n "${BASH_VERSION:-}" ] && command -v bash >/dev/null 2>&1; then
  __rx_t=${__rx_s:-${TMPDIR:-/tmp}/.runner-swerex-$$}.err
  eval 'bash -n 2>"$__rx_t" <<<"$__rx_c"'
  __rx_n=$?
  if [ -z "$__rx_s" ] || [ "$__rx_n" != 0 ]; then __rx_e=$(cat -- "$__rx_t"; echo x); rm -f -- "$__rx_t"; fi
fi
if [ "$__rx_n" != 0 ]; then
  printf '\036RUNNER-SWEREX-SYNTAX %s\n%s' "$__rx_n" "${__rx_e%x}"
  unset __rx_n __rx_t __rx_e __rx_s
else
  unset __rx_n __rx_t __rx_e
  if [ -n "$__rx_s" ] && [ -f "$__rx_s" ]; then . "$__rx_s" >/dev/null 2>&1; fi
  eval "unset __rx_c __rx_q __rx_s; ${__rx_q:+(exit $__rx_q); }$__rx_c
"
  __rx_r=$?
  if [ -n "${runner_f:-}" ] && [ -n "${BASH_VERSION:-}" ]; then declare -p >"$runner_f.swerex" 2>/dev/null; fi
  __rx_x() { unset -f __rx_x; unset __rx_r; return "$1"; }
  __rx_x "$__rx_r"
fi"#;

// ---------------------------------------------------------------------------------------------
// SWE-ReX's request and response models (swerex/runtime/abstract.py).

/// `Literal["bash"]`.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, JsonSchema)]
enum Bash {
    #[default]
    #[serde(rename = "bash")]
    Bash,
}

fn default_session() -> String {
    "default".into()
}

fn one_second() -> f64 {
    1.0
}

#[derive(Serialize, JsonSchema)]
struct IsAliveResponse {
    is_alive: bool,
    message: String,
}

#[derive(Deserialize, JsonSchema)]
struct CreateBashSessionRequest {
    /// Files sourced before the first command.
    #[serde(default)]
    startup_source: Vec<String>,
    #[serde(default = "default_session")]
    session: String,
    #[serde(default)]
    #[allow(dead_code)]
    session_type: Bash,
    /// Seconds the startup commands may take.
    #[serde(default = "one_second")]
    startup_timeout: f64,
}

#[derive(Serialize, JsonSchema)]
struct CreateBashSessionResponse {
    output: String,
    session_type: Bash,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
enum CheckMode {
    Silent,
    #[default]
    Raise,
    Ignore,
}

#[derive(Deserialize, JsonSchema)]
struct BashAction {
    command: String,
    #[serde(default = "default_session")]
    session: String,
    /// Seconds; none means no limit (ours: the longest timeout runner allows).
    timeout: Option<f64>,
    #[serde(default)]
    is_interactive_command: bool,
    #[serde(default)]
    is_interactive_quit: bool,
    #[serde(default)]
    check: CheckMode,
    #[serde(default)]
    error_msg: String,
    /// Ignored: our shell always runs a command to its end.
    #[serde(default)]
    #[allow(dead_code)]
    expect: Vec<String>,
}

#[derive(Deserialize, JsonSchema)]
struct BashInterruptAction {
    #[serde(default = "default_session")]
    session: String,
}

#[derive(Deserialize, JsonSchema)]
#[serde(tag = "action_type")]
enum Action {
    #[serde(rename = "bash")]
    Bash(BashAction),
    #[serde(rename = "bash_interrupt")]
    Interrupt(BashInterruptAction),
}

#[derive(Serialize, JsonSchema)]
struct BashObservation {
    output: String,
    exit_code: Option<i32>,
    failure_reason: String,
    expect_string: String,
    session_type: Bash,
}

#[derive(Deserialize, JsonSchema)]
struct CloseBashSessionRequest {
    #[serde(default = "default_session")]
    session: String,
    #[serde(default)]
    #[allow(dead_code)]
    session_type: Bash,
}

#[derive(Serialize, JsonSchema)]
struct CloseBashSessionResponse {
    session_type: Bash,
}

#[derive(Deserialize, JsonSchema, Clone)]
#[serde(untagged)]
enum CommandLine {
    Text(String),
    Argv(Vec<String>),
}

/// A command run as a subprocess (as `subprocess.run`).
#[derive(Deserialize, JsonSchema)]
struct Command {
    command: CommandLine,
    timeout: Option<f64>,
    #[serde(default)]
    shell: bool,
    #[serde(default)]
    check: bool,
    #[serde(default)]
    error_msg: String,
    /// The whole environment of the command (as `subprocess.run(env=...)`).
    env: Option<BTreeMap<String, String>>,
    cwd: Option<String>,
    #[serde(default)]
    merge_output_streams: bool,
}

#[derive(Serialize, JsonSchema)]
struct CommandResponse {
    stdout: String,
    stderr: String,
    exit_code: Option<i32>,
}

#[derive(Deserialize, JsonSchema)]
struct ReadFileRequest {
    path: String,
    encoding: Option<String>,
    errors: Option<String>,
}

#[derive(Serialize, JsonSchema)]
struct ReadFileResponse {
    content: String,
}

#[derive(Deserialize, JsonSchema)]
struct WriteFileRequest {
    content: String,
    path: String,
}

/// SWE-ReX's empty responses (`WriteFileResponse`, `UploadResponse`, `CloseResponse`).
#[derive(Serialize, JsonSchema)]
struct Empty {}

// ---------------------------------------------------------------------------------------------
// Routes.

/// How the SWE-ReX routes fail, as SWE-ReX's server does.
const FAILURES: &[(&str, &str)] = &[
    ("404", "no such runner session (`{\"detail\": ...}`)"),
    ("422", "the body is not SWE-ReX's model (FastAPI's validation `detail`)"),
    (
        "511",
        "an exception for the client to re-raise: `{\"swerexception\": {message, class_path, traceback, extra_info}}`",
    ),
];

pub(super) fn routes() -> Vec<Route> {
    let (get, post) = (Method::GET, Method::POST);
    let mut table = vec![
        route(
            Doc::new(
                get,
                "/v1/sessions/{id}/swerex/is_alive",
                "SWE-ReX: is the runtime alive",
            )
            .returns::<IsAliveResponse>(200),
            is_alive,
        ),
        route(
            Doc::new(
                post.clone(),
                "/v1/sessions/{id}/swerex/create_session",
                "SWE-ReX: start a bash session (a fresh named shell)",
            )
            .takes::<CreateBashSessionRequest>()
            .returns::<CreateBashSessionResponse>(200),
            create_session,
        ),
        route(
            Doc::new(
                post.clone(),
                "/v1/sessions/{id}/swerex/run_in_session",
                "SWE-ReX: run a command in a bash session (failures: status 511, SWE-ReX's exception transfer)",
            )
            .takes::<Action>()
            .returns::<BashObservation>(200),
            run_in_session,
        ),
        route(
            Doc::new(
                post.clone(),
                "/v1/sessions/{id}/swerex/close_session",
                "SWE-ReX: close a bash session",
            )
            .takes::<CloseBashSessionRequest>()
            .returns::<CloseBashSessionResponse>(200),
            close_session,
        ),
        route(
            Doc::new(
                post.clone(),
                "/v1/sessions/{id}/swerex/execute",
                "SWE-ReX: run a command as a subprocess",
            )
            .takes::<Command>()
            .returns::<CommandResponse>(200),
            execute,
        ),
        route(
            Doc::new(
                post.clone(),
                "/v1/sessions/{id}/swerex/read_file",
                "SWE-ReX: read a text file",
            )
            .takes::<ReadFileRequest>()
            .returns::<ReadFileResponse>(200),
            read_file,
        ),
        route(
            Doc::new(
                post.clone(),
                "/v1/sessions/{id}/swerex/write_file",
                "SWE-ReX: write a text file (missing parents are made)",
            )
            .takes::<WriteFileRequest>()
            .returns::<Empty>(200),
            write_file,
        ),
        route(
            Doc::new(
                post.clone(),
                "/v1/sessions/{id}/swerex/upload",
                "SWE-ReX: upload a file, or a zip extracted into target_path (multipart: file, target_path, unzip)",
            )
            .takes_raw("multipart/form-data")
            .returns::<Empty>(200),
            upload,
        ),
        route(
            Doc::new(
                post,
                "/v1/sessions/{id}/swerex/close",
                "SWE-ReX: close every bash session (the session itself stays)",
            )
            .returns::<Empty>(200),
            close,
        ),
    ];
    for route in &mut table {
        route.doc = route.doc.clone().fails_as::<serde_json::Map<String, Value>>(FAILURES);
    }
    table
}

/// Whether a request path is one of these routes (`/v1/sessions/{id}/swerex/...`), where
/// `authenticate` also takes the token from SWE-ReX's `X-API-Key` header.
pub(super) fn takes_api_key(path: &str) -> bool {
    let mut parts = path.split('/');
    parts.nth(1) == Some("v1") && parts.next() == Some("sessions") && parts.nth(1) == Some("swerex")
}

// ---------------------------------------------------------------------------------------------
// Errors in SWE-ReX's shapes.

#[derive(Debug)]
enum SxError {
    /// An exception the client re-raises: status 511.
    Exception {
        class_path: String,
        message: String,
        extra_info: Value,
    },
    /// An HTTP error as FastAPI answers it: `{"detail": ...}`.
    Http { status: StatusCode, detail: Value },
}

type SxResult<T> = Result<T, SxError>;

impl SxError {
    fn exception(class_path: &str, message: impl Into<String>) -> Self {
        SxError::Exception {
            class_path: class_path.to_string(),
            message: message.into(),
            extra_info: json!({}),
        }
    }

    /// A request body that is not the model: 422, as FastAPI's validation.
    fn invalid(message: impl std::fmt::Display) -> Self {
        SxError::Http {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            detail: json!([{"type": "value_error", "loc": ["body"], "msg": message.to_string(), "input": null}]),
        }
    }

    fn parts(self) -> (StatusCode, Value) {
        match self {
            SxError::Exception {
                class_path,
                message,
                extra_info,
            } => (
                StatusCode::from_u16(511).expect("a valid status"),
                json!({"swerexception": {
                    "message": message, "class_path": class_path, "traceback": "", "extra_info": extra_info,
                }}),
            ),
            SxError::Http { status, detail } => (status, json!({ "detail": detail })),
        }
    }
}

/// Python's `OSError` subclass for an errno, with its message (`[Errno 2] No such file or
/// directory: '/x'`).
fn os_error(errno: i32, path: &str) -> SxError {
    let class = match errno {
        libc::ENOENT => "FileNotFoundError",
        libc::EACCES | libc::EPERM => "PermissionError",
        libc::EEXIST => "FileExistsError",
        libc::ENOTDIR => "NotADirectoryError",
        libc::EISDIR => "IsADirectoryError",
        _ => "OSError",
    };
    let text = std::io::Error::from_raw_os_error(errno).to_string();
    let text = text.split(" (os error").next().unwrap_or_default();
    SxError::exception(
        &format!("builtins.{class}"),
        format!("[Errno {errno}] {text}: {}", py_repr(path)),
    )
}

/// A failure of our own service as SWE-ReX shows a failing runtime.
fn service(e: ServiceError) -> SxError {
    match e {
        ServiceError::NotFound { kind: "session", name } => SxError::Http {
            status: StatusCode::NOT_FOUND,
            detail: format!("session {name:?} not found").into(),
        },
        e @ ServiceError::Internal { .. } => {
            tracing::error!(error = %e, "SWE-ReX request failed");
            SxError::exception(SWEREX_EXCEPTION, "internal error")
        }
        e @ ServiceError::Invalid(Invalid::Field { .. }) => SxError::exception("builtins.ValueError", e.to_string()),
        e => SxError::exception(SWEREX_EXCEPTION, e.to_string()),
    }
}

impl From<ServiceError> for SxError {
    fn from(e: ServiceError) -> Self {
        service(e)
    }
}

// ---------------------------------------------------------------------------------------------
// Per-session SWE-ReX state: its bash sessions, where the sandbox sees the workspace, and the
// last response (SWE-ReX replays it for a retried X-Request-ID).

#[derive(Default)]
struct Runtime {
    /// SWE-ReX session name → our shell.
    shells: HashMap<String, Shell>,
    /// Where the sandbox sees the workspace (containerd sessions; found once).
    workdir: Option<String>,
    last: Option<(String, StatusCode, Bytes)>,
}

/// One SWE-ReX bash session.
#[derive(Clone)]
struct Shell {
    /// Our shell's name.
    name: String,
    /// `$?` when the next command starts.
    status: i32,
}

static RUNTIMES: LazyLock<Mutex<HashMap<String, Runtime>>> = LazyLock::new(Default::default);
static NEXT_SHELL: AtomicU64 = AtomicU64::new(1);

/// The state of a session that exists (call after a lease): entries of ended sessions are
/// dropped whenever a new one is made.
fn with_runtime<T>(state: &AppState, id: &str, f: impl FnOnce(&mut Runtime) -> T) -> T {
    let mut all = RUNTIMES.lock().expect("swerex lock");
    if !all.contains_key(id) {
        all.retain(|known, _| state.sessions.get(known).is_ok());
    }
    f(all.entry(id.to_string()).or_default())
}

fn replayed(id: &str, request_id: &str) -> Option<(StatusCode, Bytes)> {
    let all = RUNTIMES.lock().expect("swerex lock");
    match &all.get(id)?.last {
        Some((rid, status, body)) if rid == request_id => Some((*status, body.clone())),
        _ => None,
    }
}

/// Our shell for a SWE-ReX session.
fn shell_of(state: &AppState, id: &str, session: &str) -> SxResult<Shell> {
    with_runtime(state, id, |r| r.shells.get(session).cloned())
        .ok_or_else(|| SxError::exception(SESSION_MISSING, format!("session {} does not exist", py_repr(session))))
}

/// Run `work` and answer in SWE-ReX's shapes; a response to an `X-Request-ID` seen last is
/// replayed rather than redone.
async fn answer(
    state: &AppState,
    id: &str,
    headers: &HeaderMap,
    work: impl Future<Output = SxResult<Value>>,
) -> Response {
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    if let Some((status, body)) = request_id.as_deref().and_then(|rid| replayed(id, rid)) {
        return reply(status, body);
    }
    let (status, value) = match work.await {
        Ok(v) => (StatusCode::OK, v),
        Err(e) => e.parts(),
    };
    let body = Bytes::from(serde_json::to_vec(&value).unwrap_or_default());
    if let Some(rid) = request_id
        && body.len() <= REPLAY_LIMIT
        && state.sessions.get(id).is_ok()
    {
        with_runtime(state, id, |r| r.last = Some((rid, status, body.clone())));
    }
    reply(status, body)
}

fn reply(status: StatusCode, body: Bytes) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn parse<T: DeserializeOwned>(body: &Bytes, limit: usize) -> SxResult<T> {
    if body.len() > limit {
        return Err(SxError::Http {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            detail: "request body too large".into(),
        });
    }
    serde_json::from_slice(body).map_err(SxError::invalid)
}

fn to_json<T: Serialize>(value: T) -> SxResult<Value> {
    Ok(serde_json::to_value(value).unwrap_or_default())
}

fn lease(state: &AppState, id: &str) -> SxResult<Lease> {
    Ok(state.sessions.lease(id)?)
}

/// Seconds as a duration our runtime takes (at least 1 ms, at most runner's longest).
fn duration(seconds: Option<f64>) -> Duration {
    let max = manifest::MAX_TIMEOUT_SECONDS as f64;
    match seconds {
        Some(s) if s.is_finite() => Duration::from_secs_f64(s.clamp(0.001, max)),
        _ => Duration::from_secs_f64(max),
    }
}

type Id = UrlPath<String>;
type St = State<Arc<AppState>>;

// ---------------------------------------------------------------------------------------------
// Handlers.

async fn is_alive(State(state): St, UrlPath(id): Id, headers: HeaderMap) -> Response {
    answer(&state, &id, &headers, async {
        lease(&state, &id)?;
        to_json(IsAliveResponse {
            is_alive: true,
            message: String::new(),
        })
    })
    .await
}

async fn create_session(State(state): St, UrlPath(id): Id, headers: HeaderMap, body: Bytes) -> Response {
    answer(&state, &id, &headers, async {
        let session = lease(&state, &id)?;
        let request: CreateBashSessionRequest = parse(&body, MAX_JSON_BYTES)?;
        let shell = format!("swerex-{}", NEXT_SHELL.fetch_add(1, Ordering::Relaxed));
        let taken = with_runtime(&state, &id, |r| {
            if r.shells.contains_key(&request.session) {
                return true;
            }
            r.shells.insert(
                request.session.clone(),
                Shell {
                    name: shell.clone(),
                    status: 0,
                },
            );
            false
        });
        if taken {
            return Err(SxError::exception(
                SESSION_EXISTS,
                format!("session {} already exists", request.session),
            ));
        }
        let mut output = String::new();
        if !request.startup_source.is_empty() {
            let command = request
                .startup_source
                .iter()
                .map(|path| format!("source {path}"))
                .collect::<Vec<_>>()
                .join(" ; ");
            let started = session
                .shell(ShellRequest {
                    command: wrap(&command, 0),
                    timeout: Some(duration(Some(request.startup_timeout))),
                    check: Check::Ignore,
                    name: Some(shell),
                })
                .await;
            let failed = match started {
                Ok(out) if out.timed_out => Some(SxError::exception(
                    "pexpect.exceptions.TIMEOUT",
                    format!(
                        "Timeout exceeded: the startup commands took longer than {} seconds",
                        py_float(request.startup_timeout)
                    ),
                )),
                Ok(out) => {
                    output = strip_ansi(&out.output);
                    None
                }
                Err(e) => Some(service(e)),
            };
            if let Some(e) = failed {
                with_runtime(&state, &id, |r| r.shells.remove(&request.session));
                return Err(e);
            }
        }
        to_json(CreateBashSessionResponse {
            output,
            session_type: Bash::Bash,
        })
    })
    .await
}

async fn run_in_session(State(state): St, UrlPath(id): Id, headers: HeaderMap, body: Bytes) -> Response {
    answer(&state, &id, &headers, async {
        let session = lease(&state, &id)?;
        match parse::<Action>(&body, MAX_JSON_BYTES)? {
            // Nothing runs between calls in our shell: there is nothing to interrupt.
            Action::Interrupt(action) => {
                shell_of(&state, &id, &action.session)?;
                to_json(observation(String::new(), Some(0)))
            }
            Action::Bash(action) => {
                let shell = shell_of(&state, &id, &action.session)?;
                let set_status = |status: i32| {
                    with_runtime(&state, &id, |r| {
                        if let Some(s) = r.shells.values_mut().find(|s| s.name == shell.name) {
                            s.status = status;
                        }
                    })
                };
                to_json(run_bash(&session, &shell, action, set_status).await?)
            }
        }
    })
    .await
}

fn observation(output: String, exit_code: Option<i32>) -> BashObservation {
    BashObservation {
        output,
        exit_code,
        failure_reason: String::new(),
        expect_string: PS1.into(),
        session_type: Bash::Bash,
    }
}

/// The command as SWE-ReX's shell wrapper is given it, to start with `$?` at `status`.
fn wrap(command: &str, status: i32) -> String {
    match status {
        0 => format!("__rx_c={}\n{WRAPPER}", sh_quote(command)),
        n => format!("__rx_c={}\n__rx_q={n}\n{WRAPPER}", sh_quote(command)),
    }
}

/// Run a command; `set_status` is told `$?` for the next one (unless the syntax check failed
/// or the command timed out, which leave SWE-ReX's `$?` as it was).
async fn run_bash(
    session: &Lease,
    shell: &Shell,
    action: BashAction,
    set_status: impl FnOnce(i32),
) -> SxResult<BashObservation> {
    if action.is_interactive_command || action.is_interactive_quit {
        return Err(SxError::exception(
            SWEREX_EXCEPTION,
            "interactive commands are not supported: runner's shell runs each command to its end",
        ));
    }
    let out = session
        .shell(ShellRequest {
            command: wrap(&action.command, shell.status),
            timeout: Some(duration(action.timeout)),
            check: Check::Ignore,
            name: Some(shell.name.clone()),
        })
        .await?;
    if out.timed_out {
        // As SWE-ReX says it; unlike SWE-ReX's, the shell stays usable.
        return Err(SxError::exception(
            COMMAND_TIMEOUT,
            format!(
                "timeout after {} seconds while running command {}",
                action.timeout.map_or("None".to_string(), py_float),
                py_repr(action.command.trim())
            ),
        ));
    }
    if let Some(rest) = out.output.strip_prefix(SYNTAX_MARK) {
        let (code, stderr) = rest.split_once('\n').unwrap_or((rest, ""));
        let mut e = SxError::exception(
            BAD_SYNTAX,
            format!(
                "Error (exit code {code}) while checking bash command \n{}\n---- Stderr ----\n{stderr}\n---- Stdout ----\n",
                py_repr(&action.command)
            ),
        );
        if let SxError::Exception { extra_info, .. } = &mut e {
            *extra_info = json!({"bash_stdout": "", "bash_stderr": stderr});
        }
        return Err(e);
    }
    // SWE-ReX asks for the exit code with another command, which leaves `$?` at 0.
    set_status(match action.check {
        CheckMode::Ignore => out.exit_code.unwrap_or(0) & 0xff,
        _ => 0,
    });
    let output = strip_ansi(&out.output);
    if action.check == CheckMode::Raise && out.exit_code != Some(0) {
        let mut message = format!(
            "Command {} failed with exit code {}. Here is the output:\n{}",
            py_repr(&action.command),
            out.exit_code.map_or("None".to_string(), |c| c.to_string()),
            py_repr(&output)
        );
        if !action.error_msg.is_empty() {
            message = format!("{}: {message}", action.error_msg);
        }
        return Err(SxError::exception(NON_ZERO_EXIT, message));
    }
    let exit_code = match action.check {
        CheckMode::Ignore => None,
        _ => out.exit_code,
    };
    Ok(observation(output, exit_code))
}

async fn close_session(State(state): St, UrlPath(id): Id, headers: HeaderMap, body: Bytes) -> Response {
    answer(&state, &id, &headers, async {
        let session = lease(&state, &id)?;
        let request: CloseBashSessionRequest = parse(&body, MAX_JSON_BYTES)?;
        let shell = with_runtime(&state, &id, |r| r.shells.remove(&request.session)).ok_or_else(|| {
            SxError::exception(
                SESSION_MISSING,
                format!("session {} does not exist", py_repr(&request.session)),
            )
        })?;
        session.close_shell(&shell.name).await;
        to_json(CloseBashSessionResponse {
            session_type: Bash::Bash,
        })
    })
    .await
}

async fn close(State(state): St, UrlPath(id): Id, headers: HeaderMap) -> Response {
    answer(&state, &id, &headers, async {
        let session = lease(&state, &id)?;
        let shells = with_runtime(&state, &id, |r| std::mem::take(&mut r.shells));
        for shell in shells.into_values() {
            session.close_shell(&shell.name).await;
        }
        to_json(Empty {})
    })
    .await
}

async fn execute(State(state): St, UrlPath(id): Id, headers: HeaderMap, body: Bytes) -> Response {
    answer(&state, &id, &headers, async {
        let session = lease(&state, &id)?;
        let command: Command = parse(&body, MAX_JSON_BYTES)?;
        to_json(run_command(&session, command).await?)
    })
    .await
}

/// `subprocess.run` in the sandbox: a string with `shell` is `/bin/sh -c`, without it a
/// program's name; `env` replaces the environment; `merge_output_streams` sends stderr to
/// stdout.
async fn run_command(session: &Lease, command: Command) -> SxResult<CommandResponse> {
    let mut argv: Vec<String> = match (&command.command, command.shell) {
        (CommandLine::Text(s), true) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
        (CommandLine::Argv(a), true) => ["/bin/sh".to_string(), "-c".into()]
            .into_iter()
            .chain(a.clone())
            .collect(),
        (CommandLine::Text(s), false) => vec![s.clone()],
        (CommandLine::Argv(a), false) => a.clone(),
    };
    if argv.first().is_none_or(|p| p.is_empty()) {
        return Err(SxError::exception("builtins.ValueError", "the command is empty"));
    }
    let program = argv[0].clone();
    if let Some(env) = &command.env {
        let pairs = env.iter().map(|(k, v)| format!("{k}={v}"));
        argv = ["env".to_string(), "-i".into()]
            .into_iter()
            .chain(pairs)
            .chain(argv)
            .collect();
    }
    if command.merge_output_streams {
        argv = ["/bin/sh", "-c", "exec \"$@\" 2>&1", "sh"]
            .into_iter()
            .map(String::from)
            .chain(argv)
            .collect();
    }
    let request = ExecRequest {
        argv,
        stdin: None,
        timeout: command.timeout.map(|t| duration(Some(t))),
        env: BTreeMap::new(),
        cwd: command.cwd.clone(),
    };
    let result = match session.exec(request).await {
        Ok(r) => r,
        Err(ServiceError::Invalid(Invalid::Rejected(message))) => return Err(start_error(&message, &program)),
        Err(e) => return Err(e.into()),
    };
    if !command.shell && not_started(&result, &program) {
        return Err(os_error(libc::ENOENT, &program));
    }
    if result.timed_out {
        return Err(SxError::exception(
            COMMAND_TIMEOUT,
            format!(
                "Timeout ({}s) exceeded while running command",
                command.timeout.map_or("None".to_string(), py_float)
            ),
        ));
    }
    // As Python's returncode: negative for a signal.
    let exit_code = result.exit_code.or(result.signal.map(|s| -s));
    if command.check && exit_code != Some(0) {
        let shown = match &command.command {
            CommandLine::Text(s) => py_repr(s),
            CommandLine::Argv(a) => format!("[{}]", a.iter().map(|s| py_repr(s)).collect::<Vec<_>>().join(", ")),
        };
        let mut message = format!(
            "Command {shown} failed with exit code {}. Stdout:\n{}\nStderr:\n{}",
            exit_code.map_or("None".to_string(), |c| c.to_string()),
            py_repr(&result.stdout),
            py_repr(&result.stderr)
        );
        if !command.error_msg.is_empty() {
            message = format!("{}: {message}", command.error_msg);
        }
        return Err(SxError::exception(NON_ZERO_EXIT, message));
    }
    Ok(CommandResponse {
        stdout: result.stdout,
        stderr: result.stderr,
        exit_code,
    })
}

/// Whether a program was not found where a shell, not `execve`, looked for it: in a container
/// (the agent's `exec`), or behind `env -i`. `subprocess` raises `FileNotFoundError` then.
fn not_started(result: &crate::runtime::ExecResult, program: &str) -> bool {
    let said = format!("{}{}", result.stdout, result.stderr);
    let last = said.trim_end().lines().last().unwrap_or("");
    result.exit_code == Some(127)
        && ((last.contains("exec") && last.ends_with(&format!("{program}: not found")))
            || (last.starts_with("env: ") && last.contains(program) && last.ends_with("No such file or directory")))
}

/// A program that could not start, as `subprocess` raises it (`FileNotFoundError` ...).
fn start_error(message: &str, program: &str) -> SxError {
    let errno = message
        .rsplit_once("(os error ")
        .and_then(|(_, rest)| rest.trim_end_matches(')').parse::<i32>().ok());
    match errno {
        Some(errno) => os_error(errno, program),
        None => SxError::exception(SWEREX_EXCEPTION, message),
    }
}

// ---------------------------------------------------------------------------------------------
// Files.

/// Where a path of the sandbox is served from.
enum Place {
    /// Inside the workspace: this path relative to it, through the confined operations.
    Workspace(String),
    /// Anywhere else: by a command in the sandbox.
    Sandbox,
}

/// Where the sandbox sees the workspace: the host directory itself for a host session; for a
/// container, its working directory (the Environment's workdir), asked once.
async fn workdirs(state: &AppState, id: &str, session: &Lease) -> SxResult<Vec<String>> {
    if session.backend() == Backend::Host {
        let path = session.workspace().to_path_buf();
        let mut out = vec![path.to_string_lossy().into_owned()];
        if let Ok(real) = std::fs::canonicalize(&path) {
            out.push(real.to_string_lossy().into_owned());
        }
        return Ok(out);
    }
    if let Some(known) = with_runtime(state, id, |r| r.workdir.clone()) {
        return Ok(vec![known]);
    }
    let r = session
        .exec(ExecRequest {
            argv: vec!["/bin/sh".into(), "-c".into(), "pwd".into()],
            timeout: Some(Duration::from_secs(30)),
            ..Default::default()
        })
        .await?;
    let dir = r.stdout.trim_end_matches('\n').to_string();
    if r.exit_code != Some(0) || !dir.starts_with('/') {
        return Err(SxError::exception(
            SWEREX_EXCEPTION,
            "cannot tell where the sandbox sees its workspace",
        ));
    }
    with_runtime(state, id, |r| r.workdir = Some(dir.clone()));
    Ok(vec![dir])
}

/// A path as the sandbox names it, served from the workspace when it lies lexically inside it
/// (no `..`: those are the sandbox's to resolve).
fn place(path: &str, workdirs: &[String]) -> SxResult<Place> {
    if path.contains('\0') {
        return Err(SxError::exception("builtins.ValueError", "embedded null byte"));
    }
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty() && *p != ".").collect();
    if parts.contains(&"..") {
        return Ok(Place::Sandbox);
    }
    if !path.starts_with('/') {
        return Ok(Place::Workspace(parts.join("/")));
    }
    let clean = format!("/{}", parts.join("/"));
    for dir in workdirs {
        let dir = dir.trim_end_matches('/');
        if clean == dir {
            return Ok(Place::Workspace(String::new()));
        }
        if let Some(rest) = clean.strip_prefix(dir).and_then(|r| r.strip_prefix('/')) {
            return Ok(Place::Workspace(rest.to_string()));
        }
    }
    Ok(Place::Sandbox)
}

/// A confined operation's failure as Python's, or `None` when the sandbox's own view should
/// decide (a symlink the confined operations do not follow, a kernel without openat2).
fn file_error(e: ServiceError, path: &str) -> Option<SxError> {
    match e {
        ServiceError::NotFound { kind: "path", .. } => Some(os_error(libc::ENOENT, path)),
        ServiceError::Invalid(Invalid::Unsupported(_)) => None,
        ServiceError::Invalid(Invalid::Path(c)) => match c {
            ConfinedError::Escapes { .. } | ConfinedError::IsSymlink { .. } => None,
            ConfinedError::NotARegularFile { kind: "directory", .. } => Some(os_error(libc::EISDIR, path)),
            ConfinedError::NotADirectory { .. } => Some(os_error(libc::ENOTDIR, path)),
            ConfinedError::InvalidPath { .. } => Some(os_error(libc::EISDIR, path)),
            c => Some(SxError::exception(
                "builtins.OSError",
                format!("{}: {c}", py_repr(path)),
            )),
        },
        e => Some(service(e)),
    }
}

/// A failed command of the sandbox's file access as Python's error.
fn sandbox_file_error(stderr: &str, path: &str) -> SxError {
    let known = [
        ("No such file or directory", libc::ENOENT),
        ("Is a directory", libc::EISDIR),
        ("Not a directory", libc::ENOTDIR),
        ("Permission denied", libc::EACCES),
        ("Read-only file system", libc::EROFS),
    ];
    match known.iter().find(|(text, _)| stderr.contains(text)) {
        Some((_, errno)) => os_error(*errno, path),
        None => SxError::exception("builtins.OSError", format!("{}: {}", py_repr(path), stderr.trim())),
    }
}

/// Run a file command in the sandbox (`sh -c SCRIPT sh PATH`).
async fn in_sandbox(session: &Lease, script: &str, path: &str, stdin: Option<Vec<u8>>) -> SxResult<String> {
    let r = session
        .exec(ExecRequest {
            argv: vec!["/bin/sh".into(), "-c".into(), script.into(), "sh".into(), path.into()],
            stdin,
            timeout: Some(Duration::from_secs(600)),
            ..Default::default()
        })
        .await?;
    if r.timed_out {
        return Err(SxError::exception(
            COMMAND_TIMEOUT,
            "the sandbox's file access timed out",
        ));
    }
    if r.exit_code != Some(0) {
        return Err(sandbox_file_error(&r.stderr, path));
    }
    if r.stdout_dropped_bytes > 0 {
        return Err(SxError::exception(
            SWEREX_EXCEPTION,
            format!("{}: too large to read through the sandbox", py_repr(path)),
        ));
    }
    Ok(r.stdout)
}

const WRITE_SCRIPT: &str = r#"mkdir -p -- "$(dirname -- "$1")" && cat >"$1""#;
const UNTAR_SCRIPT: &str = r#"mkdir -p -- "$1" && tar -xzf - -C "$1""#;

async fn read_file(State(state): St, UrlPath(id): Id, headers: HeaderMap, body: Bytes) -> Response {
    answer(&state, &id, &headers, async {
        let session = lease(&state, &id)?;
        let request: ReadFileRequest = parse(&body, MAX_JSON_BYTES)?;
        let codec = Codec::new(request.encoding.as_deref(), request.errors.as_deref())?;
        let dirs = workdirs(&state, &id, &session).await?;
        let bytes = match place(&request.path, &dirs)? {
            Place::Workspace(rel) => match read_workspace(&session, &rel).await {
                Ok(bytes) => Some(bytes),
                Err(e) => match file_error(e, &request.path) {
                    Some(e) => return Err(e),
                    None => None,
                },
            },
            Place::Sandbox => None,
        };
        let content = match bytes {
            Some(bytes) => codec.decode(&bytes)?,
            // The command's output is text already (lossily UTF-8).
            None => codec.decode(
                in_sandbox(&session, r#"cat -- "$1""#, &request.path, None)
                    .await?
                    .as_bytes(),
            )?,
        };
        to_json(ReadFileResponse {
            content: universal_newlines(content),
        })
    })
    .await
}

async fn read_workspace(session: &Lease, rel: &str) -> Result<Vec<u8>, ServiceError> {
    let file = session.read_file(rel).await?;
    tokio::task::spawn_blocking(move || {
        let mut bytes = Vec::new();
        file.take(READ_LIMIT + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| ServiceError::internal("reading a workspace file", e))?;
        if bytes.len() as u64 > READ_LIMIT {
            return Err(ServiceError::rejected(format!(
                "the file is larger than {READ_LIMIT} bytes"
            )));
        }
        Ok(bytes)
    })
    .await
    .map_err(|e| ServiceError::internal("reading a workspace file", e))?
}

async fn write_file(State(state): St, UrlPath(id): Id, headers: HeaderMap, body: Bytes) -> Response {
    answer(&state, &id, &headers, async {
        let session = lease(&state, &id)?;
        let request: WriteFileRequest = parse(&body, MAX_BODY_BYTES)?;
        let dirs = workdirs(&state, &id, &session).await?;
        put_file(&session, &dirs, &request.path, request.content.into_bytes()).await?;
        to_json(Empty {})
    })
    .await
}

/// Write a file (parents made), in the workspace when it is there, else in the sandbox.
async fn put_file(session: &Lease, dirs: &[String], path: &str, data: Vec<u8>) -> SxResult<()> {
    if let Place::Workspace(rel) = place(path, dirs)? {
        match session.write_file(&rel, Bytes::from(data.clone())).await {
            Ok(_) => return Ok(()),
            Err(e) => {
                if let Some(e) = file_error(e, path) {
                    return Err(e);
                }
            }
        }
    }
    in_sandbox(session, WRITE_SCRIPT, path, Some(data)).await.map(|_| ())
}

async fn upload(State(state): St, UrlPath(id): Id, headers: HeaderMap, body: Bytes) -> Response {
    answer(&state, &id, &headers, async {
        let session = lease(&state, &id)?;
        let form = Form::parse(&headers, &body)?;
        let dirs = workdirs(&state, &id, &session).await?;
        if !form.unzip {
            put_file(&session, &dirs, &form.target_path, form.file).await?;
            return to_json(Empty {});
        }
        let file = form.file;
        let archive = tokio::task::spawn_blocking(move || zip_to_tar_gz(&file))
            .await
            .map_err(|e| service(ServiceError::internal("unpacking a zip", e)))??;
        if let Place::Workspace(rel) = place(&form.target_path, &dirs)? {
            match session.upload(&rel, Bytes::from(archive.clone())).await {
                Ok(_) => return to_json(Empty {}),
                Err(e) => {
                    if let Some(e) = file_error(e, &form.target_path) {
                        return Err(e);
                    }
                }
            }
        }
        in_sandbox(&session, UNTAR_SCRIPT, &form.target_path, Some(archive)).await?;
        to_json(Empty {})
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// Text as Python's `Path.read_text(encoding, errors)` gives it.

#[derive(Clone, Copy, PartialEq, Eq)]
enum Encoding {
    Utf8,
    Latin1,
    Ascii,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Errors {
    Strict,
    Replace,
    Ignore,
    BackslashReplace,
}

struct Codec {
    encoding: Encoding,
    errors: Errors,
    name: &'static str,
}

impl Codec {
    fn new(encoding: Option<&str>, errors: Option<&str>) -> SxResult<Codec> {
        let wanted = encoding.unwrap_or("utf-8").to_ascii_lowercase().replace('_', "-");
        let (encoding, name) = match wanted.as_str() {
            "utf-8" | "utf8" | "u8" | "locale" => (Encoding::Utf8, "utf-8"),
            "latin-1" | "latin1" | "iso-8859-1" | "iso8859-1" | "l1" => (Encoding::Latin1, "latin-1"),
            "ascii" | "us-ascii" => (Encoding::Ascii, "ascii"),
            _ => {
                return Err(SxError::exception(
                    "builtins.LookupError",
                    format!(
                        "unsupported encoding: {} (runner reads utf-8, latin-1 and ascii)",
                        encoding.unwrap_or("")
                    ),
                ));
            }
        };
        let errors = match errors.unwrap_or("strict") {
            "strict" => Errors::Strict,
            "replace" => Errors::Replace,
            "ignore" => Errors::Ignore,
            "backslashreplace" => Errors::BackslashReplace,
            other => {
                return Err(SxError::exception(
                    "builtins.LookupError",
                    format!("unsupported error handler name {}", py_repr(other)),
                ));
            }
        };
        Ok(Codec { encoding, errors, name })
    }

    fn decode(&self, bytes: &[u8]) -> SxResult<String> {
        let mut out = String::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            let (text, bad) = match self.encoding {
                Encoding::Latin1 => {
                    out.extend(bytes[i..].iter().map(|&b| char::from(b)));
                    break;
                }
                Encoding::Ascii => {
                    let n = bytes[i..].iter().position(|b| !b.is_ascii()).unwrap_or(bytes.len() - i);
                    (&bytes[i..i + n], (n < bytes.len() - i).then_some(1))
                }
                Encoding::Utf8 => match std::str::from_utf8(&bytes[i..]) {
                    Ok(_) => (&bytes[i..], None),
                    Err(e) => (
                        &bytes[i..i + e.valid_up_to()],
                        Some(e.error_len().unwrap_or(bytes.len() - i - e.valid_up_to())),
                    ),
                },
            };
            out.push_str(std::str::from_utf8(text).expect("checked above"));
            i += text.len();
            let Some(len) = bad else { break };
            match self.errors {
                Errors::Strict => {
                    let reason = match self.encoding {
                        Encoding::Ascii => "ordinal not in range(128)",
                        _ if i + len == bytes.len() && utf8_start(bytes[i]) => "unexpected end of data",
                        _ if utf8_start(bytes[i]) => "invalid continuation byte",
                        _ => "invalid start byte",
                    };
                    let at = if len == 1 {
                        format!("byte 0x{:02x} in position {i}", bytes[i])
                    } else {
                        format!("bytes in position {i}-{}", i + len - 1)
                    };
                    return Err(SxError::exception(
                        "builtins.UnicodeDecodeError",
                        format!("'{}' codec can't decode {at}: {reason}", self.name),
                    ));
                }
                Errors::Replace => out.push('\u{fffd}'),
                Errors::Ignore => {}
                Errors::BackslashReplace => {
                    for b in &bytes[i..i + len] {
                        out.push_str(&format!("\\x{b:02x}"));
                    }
                }
            }
            i += len;
        }
        Ok(out)
    }
}

/// Whether a byte may start a multi-byte UTF-8 sequence.
fn utf8_start(b: u8) -> bool {
    (0xc2..=0xf4).contains(&b)
}

/// Text mode's newline translation: `\r\n` and `\r` read as `\n`.
fn universal_newlines(text: String) -> String {
    if !text.contains('\r') {
        return text;
    }
    text.replace("\r\n", "\n").replace('\r', "\n")
}

// ---------------------------------------------------------------------------------------------
// Python's spelling of values in messages.

/// `repr(str)`.
fn py_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if py_printable(c) => out.push(c),
            c if (c as u32) < 0x100 => out.push_str(&format!("\\x{:02x}", c as u32)),
            c if (c as u32) < 0x10000 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push_str(&format!("\\U{:08x}", c as u32)),
        }
    }
    out.push(quote);
    out
}

/// `str.isprintable()` for one character (control, format, separator and private-use
/// characters are not), near enough for messages.
fn py_printable(c: char) -> bool {
    let n = c as u32;
    !(n < 0x20
        || (0x7f..=0xa0).contains(&n)
        || n == 0xad
        || n == 0x1680
        || (0x2000..=0x200f).contains(&n)
        || (0x2028..=0x202f).contains(&n)
        || (0x205f..=0x206f).contains(&n)
        || n == 0x3000
        || (0xe000..=0xf8ff).contains(&n)
        || n == 0xfeff
        || (0xfff9..=0xfffb).contains(&n)
        || n >= 0xf0000)
}

/// `repr(float)`.
fn py_float(f: f64) -> String {
    if f.is_nan() {
        "nan".into()
    } else if f.is_infinite() {
        if f > 0.0 { "inf".into() } else { "-inf".into() }
    } else if f == f.trunc() && f.abs() < 1e16 {
        format!("{f:.1}")
    } else {
        format!("{f:?}")
    }
}

/// A shell word that is exactly `s`.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// SWE-ReX's `_strip_control_chars` less its `\r\n` → `\n` (a terminal's doing, which our
/// output never had): ANSI escape sequences removed.
fn strip_ansi(s: &str) -> String {
    if !s.contains('\x1b') {
        return s.to_string();
    }
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < chars.len() {
        if chars[i] == '\x1b' && i + 1 < chars.len() && ('@'..='_').contains(&chars[i + 1]) {
            let mut j = i + 2;
            while j < chars.len() && ('0'..='?').contains(&chars[j]) {
                j += 1;
            }
            while j < chars.len() && (' '..='/').contains(&chars[j]) {
                j += 1;
            }
            if j < chars.len() && ('@'..='~').contains(&chars[j]) {
                i = j + 1;
                continue;
            }
        }
        out.push(chars[i]);
        i += 1;
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The upload form and its zip.

struct Form {
    file: Vec<u8>,
    target_path: String,
    unzip: bool,
}

impl Form {
    /// `multipart/form-data` with `file`, `target_path` and `unzip` (FastAPI's `Form(False)`).
    fn parse(headers: &HeaderMap, body: &[u8]) -> SxResult<Form> {
        let content_type = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let boundary = params(content_type)
            .into_iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("boundary"))
            .map(|(_, v)| v)
            .filter(|b| !b.is_empty() && content_type.to_ascii_lowercase().starts_with("multipart/form-data"))
            .ok_or_else(|| SxError::invalid("expected multipart/form-data with a boundary"))?;
        let mut fields: HashMap<String, Vec<u8>> = HashMap::new();
        for (name, data) in parts(body, boundary.as_bytes())? {
            fields.insert(name, data);
        }
        let missing = |name: &str| SxError::Http {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            detail: json!([{"type": "missing", "loc": ["body", name], "msg": "Field required", "input": null}]),
        };
        let file = fields.remove("file").ok_or_else(|| missing("file"))?;
        let target_path = fields.remove("target_path").ok_or_else(|| missing("target_path"))?;
        let target_path = String::from_utf8(target_path).map_err(|_| SxError::invalid("target_path is not UTF-8"))?;
        let unzip = match fields.remove("unzip") {
            None => false,
            Some(v) => match String::from_utf8_lossy(&v).trim().to_ascii_lowercase().as_str() {
                "1" | "on" | "t" | "true" | "y" | "yes" => true,
                "0" | "off" | "f" | "false" | "n" | "no" => false,
                other => return Err(SxError::invalid(format!("unzip: not a boolean: {other:?}"))),
            },
        };
        Ok(Form {
            file,
            target_path,
            unzip,
        })
    }
}

/// `key=value` parameters of a header value (after its first `;`), quotes removed.
fn params(value: &str) -> Vec<(String, String)> {
    value
        .split(';')
        .skip(1)
        .filter_map(|p| p.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().trim_matches('"').to_string()))
        .collect()
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if from > hay.len() {
        return None;
    }
    hay[from..]
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|p| p + from)
}

/// The named parts of a multipart body.
fn parts(body: &[u8], boundary: &[u8]) -> SxResult<Vec<(String, Vec<u8>)>> {
    let bad = || SxError::invalid("malformed multipart body");
    let delimiter = [b"--", boundary].concat();
    let next = [b"\r\n--", boundary].concat();
    let mut at = find(body, &delimiter, 0).ok_or_else(bad)? + delimiter.len();
    let mut out = Vec::new();
    loop {
        if body[at..].starts_with(b"--") {
            return Ok(out);
        }
        let head_start = find(body, b"\r\n", at).ok_or_else(bad)? + 2;
        let head_end = find(body, b"\r\n\r\n", head_start.saturating_sub(2)).ok_or_else(bad)?;
        let head = String::from_utf8_lossy(&body[head_start.min(head_end)..head_end]).into_owned();
        let data_start = head_end + 4;
        let data_end = find(body, &next, data_start).ok_or_else(bad)?;
        let name = head
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with("content-disposition:"))
            .and_then(|l| params(l).into_iter().find(|(k, _)| k.eq_ignore_ascii_case("name")))
            .map(|(_, v)| v);
        if let Some(name) = name {
            out.push((name, body[data_start..data_end].to_vec()));
        }
        at = data_end + next.len();
    }
}

fn le16(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?)))
}

fn le32(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?)))
}

/// A zip as a gzipped tar that extracts as Python's `ZipFile.extractall` would: names lose
/// empty, `.` and `..` parts; every member is a plain file or directory (0644, 0755); CRCs are
/// checked. Errors are `zipfile.BadZipFile`.
fn zip_to_tar_gz(zip: &[u8]) -> SxResult<Vec<u8>> {
    let bad = |why: &str| SxError::exception("zipfile.BadZipFile", why.to_string());
    let truncated = || bad("truncated zip file");
    let search_from = zip.len().saturating_sub(22 + 65_535);
    let eocd = (search_from..zip.len().saturating_sub(21))
        .rev()
        .find(|&i| zip[i..].starts_with(b"PK\x05\x06"))
        .ok_or_else(|| bad("File is not a zip file"))?;
    let count = le16(zip, eocd + 10).ok_or_else(truncated)?;
    let mut at = le32(zip, eocd + 16).ok_or_else(truncated)? as usize;
    if count == 0xffff || at == 0xffff_ffff {
        return Err(bad("zip64 archives are not supported"));
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut tar = tar::Builder::new(encoder);
    let mut made_dirs: BTreeSet<String> = BTreeSet::new();
    let mut total = 0u64;
    let io = |e: std::io::Error| SxError::exception(SWEREX_EXCEPTION, format!("building the archive: {e}"));
    let add_dir = |tar: &mut tar::Builder<_>, path: &str| -> SxResult<()> {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Directory);
        header.set_size(0);
        header.set_mode(0o755);
        header.set_mtime(now);
        tar.append_data(&mut header, path, std::io::empty()).map_err(io)
    };
    for _ in 0..count {
        if le32(zip, at) != Some(0x0201_4b50) {
            return Err(bad("bad magic number for central directory"));
        }
        let flags = le16(zip, at + 8).ok_or_else(truncated)?;
        let method = le16(zip, at + 10).ok_or_else(truncated)?;
        let crc = le32(zip, at + 16).ok_or_else(truncated)?;
        let packed = le32(zip, at + 20).ok_or_else(truncated)?;
        let size = le32(zip, at + 24).ok_or_else(truncated)?;
        let name_len = le16(zip, at + 28).ok_or_else(truncated)? as usize;
        let extra_len = le16(zip, at + 30).ok_or_else(truncated)? as usize;
        let comment_len = le16(zip, at + 32).ok_or_else(truncated)? as usize;
        let local = le32(zip, at + 42).ok_or_else(truncated)? as usize;
        let raw_name = zip.get(at + 46..at + 46 + name_len).ok_or_else(truncated)?;
        at += 46 + name_len + extra_len + comment_len;
        if flags & 1 != 0 {
            return Err(bad("encrypted members are not supported"));
        }
        if packed == 0xffff_ffff || size == 0xffff_ffff || local == 0xffff_ffff {
            return Err(bad("zip64 archives are not supported"));
        }
        let name = String::from_utf8_lossy(raw_name).replace('\\', "/");
        let is_dir = name.ends_with('/');
        let clean: Vec<&str> = name.split('/').filter(|p| !matches!(*p, "" | "." | "..")).collect();
        if clean.is_empty() {
            continue;
        }
        for depth in 1..clean.len() + usize::from(is_dir) {
            let dir = clean[..depth].join("/");
            if made_dirs.insert(dir.clone()) {
                add_dir(&mut tar, &dir)?;
            }
        }
        if is_dir {
            continue;
        }
        total += size;
        if total > UNZIP_LIMIT {
            return Err(bad(&format!("the zip expands to more than {UNZIP_LIMIT} bytes")));
        }
        if le32(zip, local) != Some(0x0403_4b50) {
            return Err(bad("Bad magic number for file header"));
        }
        let local_name = le16(zip, local + 26).ok_or_else(truncated)? as usize;
        let local_extra = le16(zip, local + 28).ok_or_else(truncated)? as usize;
        let start = local + 30 + local_name + local_extra;
        let data = zip.get(start..start + packed as usize).ok_or_else(truncated)?;
        let mut contents = Vec::with_capacity(size as usize);
        let read = match method {
            0 => data.take(size + 1).read_to_end(&mut contents),
            8 => flate2::read::DeflateDecoder::new(data)
                .take(size + 1)
                .read_to_end(&mut contents),
            _ => return Err(bad(&format!("compression method {method} is not supported"))),
        };
        read.map_err(|e| bad(&format!("Error -3 while decompressing data: {e}")))?;
        if contents.len() as u64 != size {
            return Err(bad(&format!("member {name:?} has the wrong size")));
        }
        let mut check = flate2::Crc::new();
        check.update(&contents);
        if u64::from(check.sum()) != crc {
            return Err(bad(&format!("Bad CRC-32 for file {name:?}")));
        }
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Regular);
        header.set_size(size);
        header.set_mode(0o644);
        header.set_mtime(now);
        tar.append_data(&mut header, clean.join("/"), &contents[..])
            .map_err(io)?;
    }
    let encoder = tar.into_inner().map_err(io)?;
    encoder.finish().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_reprs() {
        assert_eq!(py_repr("echo hi"), "'echo hi'");
        assert_eq!(py_repr("it's"), "\"it's\"");
        assert_eq!(py_repr("a'b\"c"), "'a\\'b\"c'");
        assert_eq!(py_repr("a\nb\t\\\x01"), "'a\\nb\\t\\\\\\x01'");
        assert_eq!(py_repr("é\u{a0}"), "'é\\xa0'");
        assert_eq!(py_float(1.0), "1.0");
        assert_eq!(py_float(0.5), "0.5");
        assert_eq!(py_float(0.1), "0.1");
    }

    #[test]
    fn the_api_key_is_taken_on_these_routes_only() {
        assert!(takes_api_key("/v1/sessions/s-1/swerex/is_alive"));
        assert!(!takes_api_key("/v1/sessions/swerex/exec"));
        assert!(!takes_api_key("/v1/sessions"));
        assert!(!takes_api_key("/v1/jobs/x/swerex/y"));
    }

    #[test]
    fn ansi_sequences_go() {
        assert_eq!(strip_ansi("\x1b[31mred\x1b[0m\n"), "red\n");
        assert_eq!(strip_ansi("a\x1b"), "a\x1b");
    }

    #[test]
    fn paths_in_the_workspace_are_served_from_it() {
        let dirs = vec!["/work/ws".to_string()];
        let rel = |p: &str| match place(p, &dirs).unwrap() {
            Place::Workspace(r) => Some(r),
            Place::Sandbox => None,
        };
        assert_eq!(rel("/work/ws/a/./b"), Some("a/b".into()));
        assert_eq!(rel("/work/ws"), Some(String::new()));
        assert_eq!(rel("a/b"), Some("a/b".into()));
        assert_eq!(rel("/work/wsx/a"), None);
        assert_eq!(rel("/work/ws/../ws/a"), None);
        assert_eq!(rel("/etc/passwd"), None);
    }

    #[test]
    fn text_decodes_as_python_does() {
        let utf8 = Codec::new(None, None).unwrap();
        assert_eq!(utf8.decode("é".as_bytes()).unwrap(), "é");
        assert!(matches!(
            utf8.decode(b"a\xffb"),
            Err(SxError::Exception { ref class_path, .. }) if class_path == "builtins.UnicodeDecodeError"
        ));
        let lenient = Codec::new(Some("utf-8"), Some("backslashreplace")).unwrap();
        assert_eq!(lenient.decode(b"a\xffb").unwrap(), "a\\xffb");
        let latin = Codec::new(Some("latin-1"), None).unwrap();
        assert_eq!(latin.decode(b"\xe9").unwrap(), "é");
        assert_eq!(universal_newlines("a\r\nb\rc".into()), "a\nb\nc");
    }

    #[test]
    fn multipart_fields_are_read() {
        let body = b"--XX\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\nContent-Type: application/octet-stream\r\n\r\nab\r\ncd\r\n--XX\r\nContent-Disposition: form-data; name=\"target_path\"\r\n\r\n/t/x\r\n--XX\r\nContent-Disposition: form-data; name=\"unzip\"\r\n\r\nfalse\r\n--XX--\r\n";
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            "multipart/form-data; boundary=XX".parse().unwrap(),
        );
        let form = Form::parse(&headers, body).unwrap();
        assert_eq!(form.file, b"ab\r\ncd");
        assert_eq!(form.target_path, "/t/x");
        assert!(!form.unzip);
    }
}
