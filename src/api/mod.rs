//! `runner serve`: live sandboxes and Jobs over an authenticated HTTP API. One route table
//! builds both the router and the OpenAPI document; handlers translate HTTP to service calls
//! and back; statuses come only from `error`. `router` is testable without a socket.

mod checkpoints;
pub mod error;
mod handoff;
mod jobs;
mod observe;
mod openapi;
mod pools;
mod sandbox;
mod sessions;
mod state;
mod swerex;
mod terminals;
pub mod types;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::handler::Handler;
use axum::http::{Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, MethodRouter, on};
use axum::{Json, Router};

pub use error::ApiError;
pub(crate) use openapi::Doc;

use crate::config::{ServeConfig, ServeEvent};
use crate::service::sessions::{SessionManager, SessionView, ShellOutput};
use crate::service::{Connect, Context, ServiceError, daemon, jobs as job_service};

/// Largest request body (manifests, code, uploads).
pub const MAX_BODY_BYTES: usize = 64 << 20;
/// Largest JSON request (everything but uploads and file writes).
const MAX_JSON_BYTES: usize = 4 << 20;
/// How often sessions are checked for their `idlePauseSeconds`.
const IDLE_PAUSE_TICK: Duration = Duration::from_secs(1);
/// Shortest bearer token accepted.
const MIN_TOKEN_LEN: usize = 16;

pub(crate) type AppResult<T> = Result<T, ApiError>;

/// What every handler sees.
pub struct AppState {
    token: Vec<u8>,
    pub ctx: Context,
    pub sessions: SessionManager,
    /// What relative paths in submitted manifests resolve against: the server's directory.
    base_dir: std::path::PathBuf,
}

impl AppState {
    /// A server's state: `ctx` should not start a daemon behind a request (`Connect::Existing`).
    pub fn new(token: Vec<u8>, ctx: Context, session_ttl: Duration) -> Self {
        AppState {
            token,
            sessions: SessionManager::new(ctx.clone(), session_ttl),
            ctx,
            base_dir: std::env::current_dir().unwrap_or_else(|_| "/".into()),
        }
    }
}

/// One route: what the document says of it, and what serves it.
pub(crate) struct Route {
    doc: Doc,
    handler: MethodRouter<Arc<AppState>>,
}

pub(crate) fn route<H, T>(doc: Doc, handler: H) -> Route
where
    H: Handler<T, Arc<AppState>>,
    T: 'static,
{
    let filter = MethodFilter::try_from(doc.method.clone()).expect("the table uses standard methods");
    Route {
        doc,
        handler: on(filter, handler),
    }
}

/// Every route of the API.
fn routes() -> Vec<Route> {
    use types::*;
    let (get, post, put, delete) = (Method::GET, Method::POST, Method::PUT, Method::DELETE);
    let files = "a path relative to the workspace";
    let mut table = vec![
        route(
            Doc::new(get.clone(), "/healthz", "liveness (no token)")
                .public()
                .returns::<Health>(200),
            health,
        ),
        route(
            Doc::new(get.clone(), "/openapi.json", "this document").returns::<serde_json::Value>(200),
            openapi_document,
        ),
        route(
            Doc::new(get.clone(), "/metrics", "Prometheus metrics (text format 0.0.4)")
                .returns_raw(200, "text/plain; version=0.0.4"),
            metrics,
        ),
        route(
            Doc::new(post.clone(), "/v1/sessions", "start a session (its setup must succeed); `staticAssets` and `mounts` are a Job's entries as JSON objects of JSON types (`readOnly` a boolean)")
                .takes::<CreateSession>()
                .returns::<SessionView>(201),
            sessions::create,
        ),
        route(
            Doc::new(get.clone(), "/v1/sessions", "list sessions").returns::<Vec<SessionView>>(200),
            sessions::list,
        ),
        route(
            Doc::new(get.clone(), "/v1/sessions/{id}", "one session").returns::<SessionView>(200),
            sessions::get,
        ),
        route(
            Doc::new(
                Method::PATCH,
                "/v1/sessions/{id}",
                "change a live session: its egress (network: bridge), replaced at once; what is no longer allowed is cut",
            )
            .takes::<PatchSession>()
            .returns::<SessionView>(200),
            sessions::patch,
        ),
        route(
            Doc::new(
                delete.clone(),
                "/v1/sessions/{id}",
                "end a session and remove everything it owned",
            )
            .returns_nothing(204),
            sessions::delete,
        ),
        route(
            Doc::new(post.clone(), "/v1/sessions/{id}/exec", "run a command to its end")
                .takes::<Exec>()
                .returns::<crate::runtime::ExecResult>(200),
            sessions::exec,
        ),
        route(
            Doc::new(
                post.clone(),
                "/v1/sessions/{id}/exec/stream",
                "run a command; NDJSON events (stdout, stderr, then exit) as they happen",
            )
            .takes::<Exec>()
            .returns_raw(200, "application/x-ndjson"),
            sessions::exec_stream,
        ),
        route(
            Doc::new(
                post.clone(),
                "/v1/sessions/{id}/shell",
                "stateful shell: cwd, exports and functions persist",
            )
            .takes::<Shell>()
            .returns::<ShellOutput>(200),
            sessions::shell,
        ),
        route(
            Doc::new(
                post.clone(),
                "/v1/sessions/{id}/python",
                "run code in the persistent interpreter",
            )
            .takes::<Python>()
            .returns::<PythonOutput>(200),
            sessions::python,
        ),
        route(
            Doc::new(
                get.clone(),
                "/v1/sessions/{id}/python/vars",
                "the interpreter's variables",
            )
            .returns::<Vec<serde_json::Map<String, serde_json::Value>>>(200),
            sessions::python_vars,
        ),
        route(
            Doc::new(
                get.clone(),
                "/v1/sessions/{id}/python/vars/{name}",
                "one variable's value",
            )
            .returns::<PythonValue>(200),
            sessions::python_var,
        ),
        route(
            Doc::new(get.clone(), "/v1/sessions/{id}/files", "read a workspace file")
                .query("path", files, true)
                .returns_raw(200, "application/octet-stream"),
            sessions::read_file,
        ),
        route(
            Doc::new(
                put,
                "/v1/sessions/{id}/files",
                "write a workspace file (missing parents are made)",
            )
            .query("path", files, true)
            .takes_raw("application/octet-stream")
            .returns_nothing(204),
            sessions::write_file,
        ),
        route(
            Doc::new(
                post.clone(),
                "/v1/sessions/{id}/files/mkdir",
                "make a directory and its parents",
            )
            .query("path", files, true)
            .returns_nothing(204),
            sessions::make_dir,
        ),
        route(
            Doc::new(
                get.clone(),
                "/v1/sessions/{id}/files/list",
                "list a directory (at most 10,000 entries; x-runner-truncated: true when there were more)",
            )
            .query("path", files, false)
            .returns::<Vec<crate::confined::ListEntry>>(200),
            sessions::list_files,
        ),
        route(
            Doc::new(
                post.clone(),
                "/v1/sessions/{id}/files/upload",
                "extract a tar (plain or gzip) into a workspace directory",
            )
            .query("path", files, false)
            .takes_raw("application/x-tar")
            .returns::<crate::confined::UnpackReport>(200),
            sessions::upload,
        ),
        route(
            Doc::new(
                get.clone(),
                "/v1/sessions/{id}/files/download",
                "a tar of a workspace directory or file",
            )
            .query("path", files, false)
            .returns_raw(200, "application/x-tar"),
            sessions::download,
        ),
        route(
            Doc::new(
                post,
                "/v1/jobs",
                "submit a manifest (YAML or JSON); its jobs run detached",
            )
            .takes_raw("application/yaml")
            .returns::<CreatedJobs>(201),
            jobs::create,
        ),
        route(
            Doc::new(get.clone(), "/v1/jobs", "list jobs")
                .query("labelSelector", "a label selector, as kubectl takes it: key=value, key!=value, key, !key, key in (a,b), key notin (a,b), joined by commas", false)
                .returns::<Vec<crate::job::JobObject>>(200),
            jobs::list,
        ),
        route(
            Doc::new(get.clone(), "/v1/jobs/{name}", "one job with its status").returns::<crate::job::JobObject>(200),
            jobs::get,
        ),
        route(
            Doc::new(delete, "/v1/jobs/{name}", "stop a job and delete it with its logs").returns_nothing(204),
            jobs::delete,
        ),
        route(
            Doc::new(
                get,
                "/v1/jobs/{name}/logs",
                "a job's output: the last attempt of every index, one stream",
            )
            .query(
                "follow",
                "true: keep the response open and send output as it is written, until the job ends",
                false,
            )
            .query("index", "only this completion index", false)
            .query("attempt", "only this attempt number of each index", false)
            .query(
                "tailLines",
                "only the last N lines of each attempt (following: then what comes)",
                false,
            )
            .query("prefix", "true: begin every line with `[INDEX] `", false)
            .query("setup", "true: the setup's output instead of the command's", false)
            .query("stream", "stdout (default) or stderr", false)
            .returns_raw(200, "text/plain"),
            jobs::logs,
        ),
    ];
    table.extend(pools::routes());
    table.extend(checkpoints::routes());
    table.extend(sandbox::routes());
    table.extend(swerex::routes());
    table.extend(state::routes());
    table.extend(terminals::routes());
    table.extend(observe::routes());
    table
}

/// The OpenAPI document of this API.
pub fn openapi() -> serde_json::Value {
    let docs: Vec<Doc> = routes().into_iter().map(|r| r.doc).collect();
    openapi::document(&docs)
}

/// The whole API.
pub fn router(state: Arc<AppState>) -> Router {
    let mut public = Router::new();
    let mut private = Router::new();
    for r in routes() {
        if r.doc.public {
            public = public.route(r.doc.path, r.handler);
        } else {
            private = private.route(r.doc.path, r.handler);
        }
    }
    // (The last layer runs first: the token is checked before a paused session is looked at.)
    private = private.route_layer(middleware::from_fn_with_state(state.clone(), state::ensure_running));
    private = private.route_layer(middleware::from_fn_with_state(state.clone(), authenticate));
    public
        .merge(private)
        .fallback(no_route)
        .layer(middleware::from_fn(observe_request))
        .layer(middleware::from_fn(limit_body))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// The metric of request latencies.
const REQUEST_SECONDS: &str = "runner_http_request_duration_seconds";

/// One latency observation and one structured log line (target `runner::access`) per request,
/// by route template (never the concrete path: ids would make unbounded label sets).
async fn observe_request(request: Request, next: Next) -> Response {
    let began = std::time::Instant::now();
    let method = request.method().clone();
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| "(none)".to_string(), |p| p.as_str().to_string());
    let response = next.run(request).await;
    let took = began.elapsed();
    let status = response.status().as_u16().to_string();
    crate::metrics::observe(
        REQUEST_SECONDS,
        &[("route", &route), ("method", method.as_str()), ("status", &status)],
        took,
    );
    tracing::info!(
        target: "runner::access",
        method = %method,
        route,
        status = response.status().as_u16(),
        ms = took.as_secs_f64() * 1e3,
        "request"
    );
    response
}

async fn metrics(State(state): State<Arc<AppState>>) -> AppResult<Response> {
    Ok((
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        render_metrics(&state).await?,
    )
        .into_response())
}

/// The recorded metrics and the gauges of this moment (sessions, jobs by phase).
async fn render_metrics(state: &AppState) -> Result<String, ServiceError> {
    let sessions = state.sessions.list();
    let mut by_backend: std::collections::BTreeMap<&'static str, f64> = Default::default();
    for s in &sessions {
        *by_backend.entry(s.backend.as_str()).or_default() += 1.0;
    }
    let mut phases: std::collections::BTreeMap<String, f64> = ["Pending", "Running", "Succeeded", "Failed"]
        .into_iter()
        .map(|p| (p.to_string(), 0.0))
        .collect();
    for job in job_service::list(&state.ctx, &Default::default()).await? {
        *phases.entry(format!("{:?}", job.object.status.phase)).or_default() += 1.0;
    }
    let mut gauges = vec![
        crate::metrics::Gauge {
            name: "runner_sessions_live",
            help: "sessions open now, by backend",
            values: by_backend
                .into_iter()
                .map(|(b, n)| (vec![("backend", b.to_string())], n))
                .collect(),
        },
        crate::metrics::Gauge {
            name: "runner_jobs",
            help: "jobs in the store, by phase",
            values: phases.into_iter().map(|(p, n)| (vec![("phase", p)], n)).collect(),
        },
    ];
    gauges.extend(observe::sandbox_gauges(state).await);
    Ok(crate::metrics::render(&gauges))
}

async fn no_route(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::NoRoute {
        method: method.to_string(),
        path: uri.path().to_string(),
    }
}

async fn health() -> Json<types::Health> {
    Json(types::Health { status: "ok".into() })
}

async fn openapi_document() -> Json<serde_json::Value> {
    Json(openapi())
}

/// Constant-time equality: the time taken does not depend on where the inputs differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        diff |= usize::from(a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0));
    }
    diff == 0
}

/// 401 before anything else is looked at; the token is compared in constant time. The
/// SWE-ReX routes also take it as SWE-ReX's client sends it, in `X-API-Key`.
async fn authenticate(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let headers = request.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        // The scheme is case-insensitive (RFC 9110, 11.1): `bearer` and `BEARER` too.
        .and_then(|v| {
            v.split_once(' ')
                .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        })
        .map(|(_, token)| token.trim_start());
    let api_key = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .filter(|_| swerex::takes_api_key(request.uri().path()));
    let given = bearer.or(api_key).unwrap_or("");
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
    json_error(response).await
}

/// Longest text of a non-JSON error kept in its JSON form.
const ERROR_TEXT_LIMIT: usize = 16 * 1024;

/// Every error answers `{"error": "..."}` (docs/reference/api.md). Ours are JSON already;
/// axum's own rejections are text (a query string that does not parse, a WebSocket request
/// without its upgrade headers) or empty (a method the route lacks): made JSON here, the
/// status and the other headers (`Allow`) kept.
async fn json_error(response: Response) -> Response {
    let status = response.status();
    let json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = match axum::body::to_bytes(body, ERROR_TEXT_LIMIT).await {
        Ok(bytes) => String::from_utf8_lossy(&bytes).trim().to_string(),
        Err(_) => String::new(),
    };
    let message = match text.is_empty() {
        true => status.canonical_reason().unwrap_or("error").to_lowercase(),
        false => text,
    };
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    let body = serde_json::json!({ "error": message }).to_string();
    Response::from_parts(parts, axum::body::Body::from(body))
}

/// A JSON body, within the JSON size cap.
pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(body: &Bytes) -> AppResult<T> {
    if body.len() > MAX_JSON_BYTES {
        return Err(ApiError::TooLarge);
    }
    serde_json::from_slice(body).map_err(|e| ApiError::BadRequest(format!("invalid JSON body: {e}")))
}

/// Of the shutdown grace period, what is kept for ending the sessions at most (half of it when
/// it is shorter).
const SHUTDOWN_TEARDOWN_RESERVE: Duration = Duration::from_secs(5);

/// Serve until Ctrl-C or SIGTERM, then end every session.
pub async fn serve(serve: ServeConfig, on_event: impl Fn(ServeEvent)) -> Result<(), ServiceError> {
    let token = std::fs::read_to_string(&serve.token_file)
        .map_err(|e| ServiceError::field("--token-file", format!("{}: {e}", serve.token_file.display())))?;
    let token = token.trim().as_bytes().to_vec();
    if token.len() < MIN_TOKEN_LEN {
        return Err(ServiceError::field(
            "--token-file",
            format!("the token must be at least {MIN_TOKEN_LEN} characters"),
        ));
    }
    let listen = match (&serve.socket, serve.listen) {
        (Some(_), _) => None,
        (None, listen) => {
            let addr = listen.unwrap_or_else(|| "127.0.0.1:8080".parse().expect("valid address"));
            if !addr.ip().is_loopback() {
                return Err(ServiceError::field(
                    "--listen",
                    format!("{addr}: only loopback addresses (use --socket, or a proxy with TLS, for more)"),
                ));
            }
            Some(addr)
        }
    };
    // Every session holds files of the server; a private containerd started below inherits
    // the raised limit too.
    match crate::service::capacity::raise_nofile() {
        Ok((before, now)) => on_event(ServeEvent::OpenFiles { before, now }),
        Err(e) => tracing::warn!(error = %e, "raising the open-files limit"),
    }
    // The private containerd may be started now, at start-up; never behind a request.
    match daemon::connect(&serve.config, Connect::StartIfNeeded).await {
        Ok((_, Some(started))) => on_event(ServeEvent::StartedContainerd {
            pid: started.pid,
            socket: started.socket,
        }),
        Ok((_, None)) => {}
        Err(e) => on_event(ServeEvent::ContainerdUnavailable(e.to_string())),
    }
    let config = serve.config.clone();
    let (expect, per_shim) = (serve.expect_sessions, serve.sessions_per_shim);
    match tokio::task::spawn_blocking(move || crate::service::capacity::check(&config, expect, per_shim)).await {
        Ok(found) => found.into_iter().for_each(|m| on_event(ServeEvent::HostLimit(m))),
        Err(e) => tracing::warn!(error = %e, "checking the host's limits"),
    }
    let ctx = Context::new(serve.config.clone(), Connect::Existing)?
        .with_sessions_per_shim(serve.sessions_per_shim)
        .with_warm_shims(serve.warm_shims);
    let pools = serve
        .pools
        .iter()
        .map(|p| crate::service::pools::parse_pool_arg(p))
        .collect::<Result<Vec<_>, _>>()?;
    for (env, size) in &pools {
        let file = crate::service::pools::env_dir_file(&ctx, env)?;
        let (def, report) = crate::service::pools::create(&ctx, env, env, &file, *size, true, false, None).await?;
        tracing::info!(pool = def.name, ready = report.ready, "warm pool ready");
    }
    let state = Arc::new(AppState::new(token, ctx.clone(), serve.session_ttl));
    let app = router(state.clone());
    let idle_pauses = {
        let state = state.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(IDLE_PAUSE_TICK).await;
                state.sessions.pause_idle().await;
            }
        })
    };
    // Set when a handed-over apply is accepted: the reconciliation those applies skip is done
    // on the next housekeeping tick, and only then (it lists everything in containerd).
    let handed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let housekeeping = {
        let (state, handed) = (state.clone(), handed.clone());
        let every = (serve.session_ttl / 4).clamp(Duration::from_secs(1), Duration::from_secs(30));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                state.sessions.reap_idle().await;
                // The pools this server keeps: broken members (a containerd restart) replaced.
                for (env, _) in &pools {
                    if let Err(e) = crate::service::pools::fill(&state.ctx, env).await {
                        tracing::warn!(pool = env, error = %e, "refilling the pool");
                    }
                }
                // What dead runner processes left (a CLI apply reconciles at its start; the
                // applies handed to this server do not, so it is done here for them).
                if handed.swap(false, std::sync::atomic::Ordering::Relaxed) && state.ctx.containerd().await.is_ok() {
                    crate::service::reconcile::reconcile(&state.ctx).await;
                }
                // Warm shims: a refill that failed is tried again (after its back-off), and a
                // containerd that came late gets its seeds.
                refill_warm_shims(&state.ctx);
                // Jobs whose supervisor died get a new one here, explicitly: reads never adopt.
                match crate::service::reconcile::adopt_orphans(&state.ctx).await {
                    Ok(adopted) if !adopted.is_empty() => tracing::info!(?adopted, "re-adopted jobs"),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "re-adopting orphaned jobs"),
                }
            }
        })
    };
    let watchdog = tokio::spawn(watch_containerd(ctx.clone()));
    if ctx.containerd().await.is_ok() {
        let ctx = ctx.clone();
        tokio::spawn(async move { crate::service::reconcile::reconcile(&ctx).await });
    }
    refill_warm_shims(&ctx);
    let metrics_server = match serve.metrics_listen {
        Some(addr) => Some(serve_metrics(addr, state.clone(), &on_event).await?),
        None => None,
    };
    // Stopping: at SIGTERM or Ctrl-C the listener closes and in-flight calls get the grace
    // period but a reserve; then every session is ended (which ends the calls still waiting
    // on one) within the reserve, and the server returns whatever is left: a sandbox can hold
    // a call (a command that never ends, a client that never reads) but never the stop.
    let stop = tokio_util::sync::CancellationToken::new();
    {
        let stop = stop.clone();
        tokio::spawn(async move {
            crate::signals::shutdown().await;
            stop.cancel();
        });
    }
    // Foreground applies of this state dir's CLI run here (`service::handoff`); a server that
    // cannot take them still serves HTTP, and the CLI runs its jobs itself.
    let handoff = match handoff::listen(&ctx, stop.clone(), handed) {
        Ok(handoff) => handoff,
        Err(e) => {
            tracing::warn!(socket = %ctx.config.handoff_socket().display(), error = %e, "the CLI's applies will run in their own processes");
            None
        }
    };
    let grace = serve.config.shutdown_grace;
    let reserve = (grace / 2).min(SHUTDOWN_TEARDOWN_RESERVE);
    let io = |what: &'static str| move |e: std::io::Error| ServiceError::internal(what, e);
    let server = async {
        match (&serve.socket, listen) {
            (Some(path), _) => {
                let listener = bind_unix(path)?;
                on_event(ServeEvent::Listening(format!("unix:{}", path.display())));
                axum::serve(listener, app)
                    .with_graceful_shutdown(stop.clone().cancelled_owned())
                    .await
                    .map_err(io("serving"))
            }
            (None, addr) => {
                let addr = addr.expect("a listen address when there is no socket");
                let listener = bind_tcp(addr).map_err(io("binding the address"))?;
                let local = listener.local_addr().map_err(io("reading the address"))?;
                on_event(ServeEvent::Listening(format!("http://{local}")));
                axum::serve(listener, app)
                    .with_graceful_shutdown(stop.clone().cancelled_owned())
                    .await
                    .map_err(io("serving"))
            }
        }
    };
    // Stopping waits for the handed-over applies too: their jobs are stopped (as a signalled
    // CLI apply's are) and their results sent to their CLIs.
    let server = async {
        let served = server.await;
        // An HTTP face that failed ends the server too: the applies it was handed are stopped.
        stop.cancel();
        if let Some(handoff) = &handoff {
            handoff.finished().await;
        }
        served
    };
    let served = tokio::select! {
        served = server => served,
        () = async {
            stop.cancelled().await;
            tokio::time::sleep(grace.saturating_sub(reserve)).await;
        } => {
            tracing::warn!(?grace, "calls still in flight at the end of the shutdown grace period: their sessions are ended");
            Ok(())
        }
    };
    if let Some(handoff) = handoff {
        handoff.close();
    }
    housekeeping.abort();
    // Never between a daemon's spawn and its PID file: those are one synchronous step.
    watchdog.abort();
    idle_pauses.abort();
    if let Some(task) = metrics_server {
        task.abort();
    }
    let seeds = async {
        if let Some((seeds, engine)) = ctx.warm_shims() {
            engine.drain_seeds(&seeds).await;
        }
    };
    let closed = tokio::time::timeout(reserve, async { tokio::join!(state.sessions.close_all(), seeds) }).await;
    if closed.is_err() {
        tracing::warn!(
            "sessions still being torn down at the end of the shutdown grace period; `runner gc` removes what is left"
        );
    }
    served
}

/// How often a server looks whether its private containerd died.
const CONTAINERD_WATCH: Duration = Duration::from_secs(1);
/// The longest wait between failed attempts to start it again.
const CONTAINERD_RETRY_MAX: Duration = Duration::from_secs(60);

/// A server outlives the containerd under it: when that is runner's private daemon and it
/// died, the server starts it again (`Context::revive_containerd`) instead of failing every
/// create until someone does. Its sandboxes' shims live on meanwhile. Looking is two small
/// reads (the PID file, the process's command line) a second.
async fn watch_containerd(ctx: Context) {
    let mut wait = CONTAINERD_WATCH;
    loop {
        tokio::time::sleep(wait).await;
        wait = match ctx.revive_containerd().await {
            Some(Err(_)) => (wait * 2).min(CONTAINERD_RETRY_MAX),
            Some(Ok(_)) => {
                // Seeds made before are still there (their shims outlived it); a refill
                // that failed meanwhile is tried now rather than at the next tick.
                refill_warm_shims(&ctx);
                CONTAINERD_WATCH
            }
            None => CONTAINERD_WATCH,
        };
    }
}

/// Start filling the server's warm shims (no-op without them, or while containerd is not
/// connected: the housekeeping tick tries again).
fn refill_warm_shims(ctx: &Context) {
    if let Some((seeds, engine)) = ctx.warm_shims() {
        engine.refill_seeds(seeds);
    }
}

/// `--metrics-listen`: GET /metrics alone, without the token, on a loopback address.
async fn serve_metrics(
    addr: std::net::SocketAddr,
    state: Arc<AppState>,
    on_event: &impl Fn(ServeEvent),
) -> Result<tokio::task::JoinHandle<()>, ServiceError> {
    if !addr.ip().is_loopback() {
        return Err(ServiceError::field(
            "--metrics-listen",
            format!("{addr}: only loopback addresses"),
        ));
    }
    let listener = bind_tcp(addr).map_err(|e| ServiceError::field("--metrics-listen", format!("{addr}: {e}")))?;
    let local = listener
        .local_addr()
        .map_err(|e| ServiceError::internal("reading the metrics address", e))?;
    on_event(ServeEvent::Metrics(format!("http://{local}/metrics")));
    let app = Router::new()
        .route("/metrics", axum::routing::get(metrics))
        .fallback(no_route)
        .with_state(state);
    Ok(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "the metrics listener stopped");
        }
    }))
}

/// A unix socket only its owner can connect to. Connecting needs write permission, which
/// the default umask already withholds from others until the chmod.
fn bind_unix(path: &Path) -> Result<tokio::net::UnixListener, ServiceError> {
    let bad = |e: std::io::Error| ServiceError::field("--socket", format!("{}: {e}", path.display()));
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(bad(e)),
        _ => {}
    }
    let listener = tokio::net::UnixListener::bind(path).map_err(bad)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| ServiceError::internal("chmod of the socket", e))?;
    Ok(listener)
}

/// Connections the kernel queues for `accept` on a listening socket. std's and tokio's `bind`
/// ask for 128: a burst of 256 session creates (issue 36's 300 a second) overflowed it, and
/// each client whose SYN was dropped retried a second later (then 3 s), so the burst took
/// 1–4 s instead of under one. The kernel caps it at `net.core.somaxconn`.
pub const LISTEN_BACKLOG: u32 = 4096;

/// A TCP listener on `addr` with `LISTEN_BACKLOG`, address reuse set as std's `bind` sets it.
fn bind_tcp(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}
