//! SWE-ReX's remote-runtime protocol over HTTP: every session also answers under
//! `/v1/sessions/{id}/swerex`, so `swerex.runtime.remote.RemoteRuntime(host=".../swerex",
//! port=None, auth_token=TOKEN)` drives it unchanged (its `X-API-Key` header is accepted there
//! as the bearer token, see `authenticate`). This file parses and answers; the protocol — its
//! bash sessions, `subprocess` emulation, files, Python's error shapes — is the session's
//! (`service::sessions::swerex`).
//!
//! The bodies are SWE-ReX's models, field for field; its errors are its own shapes: a runtime
//! failure is a transferred exception (status 511, `{"swerexception": {message, class_path,
//! traceback, extra_info}}`) that the client re-raises as the same class, an unreadable
//! request is FastAPI's 422 `{"detail": [...]}`, a session that is gone is 404 `{"detail"}`.

use std::future::Future;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Multipart, Path as UrlPath, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::{AppState, Doc, MAX_BODY_BYTES, MAX_JSON_BYTES, Route, route};
use crate::service::sessions::Lease;
use crate::service::sessions::swerex::models::{
    Action, BashObservation, CloseBashSessionRequest, CloseBashSessionResponse, Command, CommandResponse,
    CreateBashSessionRequest, CreateBashSessionResponse, Empty, IsAliveResponse, ReadFileRequest, ReadFileResponse,
    WriteFileRequest,
};
use crate::service::sessions::swerex::{SwerexError, UploadForm};

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
                get.clone(),
                "/v1/sessions/{id}/swerex/",
                "SWE-ReX: the server's root (`{\"message\": \"hello world\"}`, as SWE-ReX's own answers)",
            )
            .returns::<RootResponse>(200),
            root,
        ),
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
// Answers in SWE-ReX's shapes.

/// A protocol error's status and body.
fn parts(e: SwerexError) -> (StatusCode, Value) {
    match e {
        SwerexError::Exception {
            class_path,
            message,
            extra_info,
        } => (
            StatusCode::from_u16(511).expect("a valid status"),
            json!({"swerexception": {
                "message": message, "class_path": class_path, "traceback": "", "extra_info": extra_info,
            }}),
        ),
        SwerexError::Validation(detail) => (StatusCode::UNPROCESSABLE_ENTITY, json!({ "detail": detail })),
        SwerexError::NoSession(name) => (
            StatusCode::NOT_FOUND,
            json!({ "detail": format!("session {name:?} not found") }),
        ),
        SwerexError::TooLarge => (
            StatusCode::PAYLOAD_TOO_LARGE,
            json!({"detail": "request body too large"}),
        ),
    }
}

/// Run `work` on the session and answer; a response to an `X-Request-ID` answered last is
/// replayed rather than redone (the session keeps it).
async fn answer<T: Serialize, F: Future<Output = Result<T, SwerexError>>>(
    state: &AppState,
    id: &str,
    headers: &HeaderMap,
    work: impl FnOnce(Lease) -> F,
) -> Response {
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let session = match state.sessions.lease(id) {
        Ok(session) => session,
        Err(e) => {
            let (status, value) = parts(e.into());
            return reply(status, Bytes::from(serde_json::to_vec(&value).unwrap_or_default()));
        }
    };
    if let Some((status, body)) = request_id.as_deref().and_then(|rid| session.swerex().replayed(rid)) {
        return reply(StatusCode::from_u16(status).unwrap_or(StatusCode::OK), body);
    }
    let (status, value) = match work(session.clone()).await {
        Ok(v) => (StatusCode::OK, serde_json::to_value(v).unwrap_or_default()),
        Err(e) => parts(e),
    };
    let body = Bytes::from(serde_json::to_vec(&value).unwrap_or_default());
    if let Some(rid) = request_id {
        session.swerex().remember(rid, status.as_u16(), body.clone());
    }
    reply(status, body)
}

fn reply(status: StatusCode, body: Bytes) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn parse<T: DeserializeOwned>(body: &Bytes, limit: usize) -> Result<T, SwerexError> {
    if body.len() > limit {
        return Err(SwerexError::TooLarge);
    }
    serde_json::from_slice(body).map_err(SwerexError::invalid)
}

type Id = UrlPath<String>;
type St = State<Arc<AppState>>;

// ---------------------------------------------------------------------------------------------
// Handlers.

/// SWE-ReX's `GET /` body.
#[derive(Serialize, schemars::JsonSchema)]
pub struct RootResponse {
    message: String,
}

/// SWE-ReX's root route answers a fixed greeting (swerex/server.py, `root`); here, for a
/// session that exists.
async fn root(State(state): St, UrlPath(id): Id, headers: HeaderMap) -> Response {
    answer(&state, &id, &headers, |_| async {
        Ok(RootResponse {
            message: "hello world".into(),
        })
    })
    .await
}

async fn is_alive(State(state): St, UrlPath(id): Id, headers: HeaderMap) -> Response {
    answer(&state, &id, &headers, |_| async {
        Ok(IsAliveResponse {
            is_alive: true,
            message: String::new(),
        })
    })
    .await
}

async fn create_session(State(state): St, UrlPath(id): Id, headers: HeaderMap, body: Bytes) -> Response {
    answer(&state, &id, &headers, |s| async move {
        let request: CreateBashSessionRequest = parse(&body, MAX_JSON_BYTES)?;
        s.swerex_create_session(request).await
    })
    .await
}

async fn run_in_session(State(state): St, UrlPath(id): Id, headers: HeaderMap, body: Bytes) -> Response {
    answer(&state, &id, &headers, |s| async move {
        let action: Action = parse(&body, MAX_JSON_BYTES)?;
        s.swerex_run_in_session(action).await
    })
    .await
}

async fn close_session(State(state): St, UrlPath(id): Id, headers: HeaderMap, body: Bytes) -> Response {
    answer(&state, &id, &headers, |s| async move {
        let request: CloseBashSessionRequest = parse(&body, MAX_JSON_BYTES)?;
        s.swerex_close_session(request).await
    })
    .await
}

async fn close(State(state): St, UrlPath(id): Id, headers: HeaderMap) -> Response {
    answer(&state, &id, &headers, |s| async move {
        s.swerex_close().await;
        Ok(Empty {})
    })
    .await
}

async fn execute(State(state): St, UrlPath(id): Id, headers: HeaderMap, body: Bytes) -> Response {
    answer(&state, &id, &headers, |s| async move {
        let command: Command = parse(&body, MAX_JSON_BYTES)?;
        s.swerex_execute(command).await
    })
    .await
}

async fn read_file(State(state): St, UrlPath(id): Id, headers: HeaderMap, body: Bytes) -> Response {
    answer(&state, &id, &headers, |s| async move {
        let request: ReadFileRequest = parse(&body, MAX_JSON_BYTES)?;
        s.swerex_read_file(request).await
    })
    .await
}

async fn write_file(State(state): St, UrlPath(id): Id, headers: HeaderMap, body: Bytes) -> Response {
    answer(&state, &id, &headers, |s| async move {
        let request: WriteFileRequest = parse(&body, MAX_BODY_BYTES)?;
        s.swerex_write_file(request).await.map(|()| Empty {})
    })
    .await
}

async fn upload(State(state): St, UrlPath(id): Id, headers: HeaderMap, multipart: Multipart) -> Response {
    answer(&state, &id, &headers, |s| async move {
        let form = upload_form(multipart).await?;
        s.swerex_upload(form).await.map(|()| Empty {})
    })
    .await
}

/// SWE-ReX's upload form (`multipart/form-data`: `file`, `target_path`, `unzip` as FastAPI's
/// `Form(False)`), through axum's multipart reader (the body limit applies).
async fn upload_form(mut multipart: Multipart) -> Result<UploadForm, SwerexError> {
    let (mut file, mut target_path, mut unzip) = (None, None, None);
    let bad =
        |e: axum::extract::multipart::MultipartError| SwerexError::invalid(format!("malformed multipart body: {e}"));
    while let Some(field) = multipart.next_field().await.map_err(bad)? {
        match field.name() {
            Some("file") => file = Some(field.bytes().await.map_err(bad)?),
            Some("target_path") => target_path = Some(field.text().await.map_err(bad)?),
            Some("unzip") => unzip = Some(field.text().await.map_err(bad)?),
            _ => {}
        }
    }
    let unzip = match unzip.as_deref().map(|v| v.trim().to_ascii_lowercase()) {
        None => false,
        Some(v) => match v.as_str() {
            "1" | "on" | "t" | "true" | "y" | "yes" => true,
            "0" | "off" | "f" | "false" | "n" | "no" => false,
            other => return Err(SwerexError::invalid(format!("unzip: not a boolean: {other:?}"))),
        },
    };
    Ok(UploadForm {
        file: file.ok_or_else(|| SwerexError::missing("file"))?,
        target_path: target_path.ok_or_else(|| SwerexError::missing("target_path"))?,
        unzip,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_api_key_is_taken_on_these_routes_only() {
        assert!(takes_api_key("/v1/sessions/s-1/swerex/is_alive"));
        assert!(takes_api_key("/v1/sessions/s-1/swerex/"));
        assert!(!takes_api_key("/v1/sessions/swerex/exec"));
        assert!(!takes_api_key("/v1/sessions"));
        assert!(!takes_api_key("/v1/jobs/x/swerex/y"));
    }
}
