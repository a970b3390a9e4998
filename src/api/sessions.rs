//! Session handlers: HTTP in, a service call, HTTP out.

use std::sync::Arc;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use tokio_stream::StreamExt;

use super::types::{
    CreateSession, Exec, PatchSession, PathQuery, Python, PythonOutput, PythonValue, SessionSource, Shell,
};
use super::{AppResult, AppState, parse_json};
use crate::confined::{ListEntry, UnpackReport};
use crate::runtime::ExecResult;
use crate::service::ServiceError;
use crate::service::sessions::{SessionView, ShellOutput};

type Id = UrlPath<String>;

pub async fn create(State(state): State<Arc<AppState>>, body: Bytes) -> AppResult<Response> {
    let view = match parse_json::<CreateSession>(&body)?.into_source()? {
        SessionSource::New(request) => state.sessions.create(request).await?,
        SessionSource::Checkpoint(name, pause) => state.sessions.restore(&name, pause).await?,
    };
    Ok((StatusCode::CREATED, Json(view)).into_response())
}

pub async fn list(State(state): State<Arc<AppState>>) -> Json<Vec<SessionView>> {
    Json(state.sessions.list())
}

pub async fn get(State(state): State<Arc<AppState>>, UrlPath(id): Id) -> AppResult<Json<SessionView>> {
    Ok(Json(state.sessions.get(&id)?))
}

/// Change a live session: its egress, replaced at once.
pub async fn patch(State(state): State<Arc<AppState>>, UrlPath(id): Id, body: Bytes) -> AppResult<Json<SessionView>> {
    let request = parse_json::<PatchSession>(&body)?;
    let session = state.sessions.lease(&id)?;
    Ok(Json(session.set_egress(&request.egress.allow).await?))
}

pub async fn delete(State(state): State<Arc<AppState>>, UrlPath(id): Id) -> AppResult<StatusCode> {
    state.sessions.delete(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn exec(State(state): State<Arc<AppState>>, UrlPath(id): Id, body: Bytes) -> AppResult<Json<ExecResult>> {
    let session = state.sessions.lease(&id)?;
    let request = parse_json::<Exec>(&body)?.into_request()?;
    Ok(Json(session.exec(request).await?))
}

/// NDJSON: one event object per line (`stdout`, `stderr`, then `exit`) as they happen.
pub async fn exec_stream(State(state): State<Arc<AppState>>, UrlPath(id): Id, body: Bytes) -> AppResult<Response> {
    let session = state.sessions.lease(&id)?;
    let request = parse_json::<Exec>(&body)?.into_request()?;
    let mut events = session.stream(request).await?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::spawn(async move {
        // The lease lives as long as the stream: a streaming session is in use.
        let mut ended = false;
        loop {
            tokio::select! {
                biased;
                event = events.recv() => {
                    let Some(event) = event else { break };
                    ended |= matches!(event, crate::runtime::RuntimeEvent::Exit { .. });
                    let mut line = serde_json::to_vec(&event).unwrap_or_default();
                    line.push(b'\n');
                    // A client that stops reading blocks this send (and so, through the
                    // bounded channels below it, the command's writes); one that goes away
                    // ends it: either way it is seen here as well as by `closed` below.
                    let sent = tokio::select! {
                        sent = tx.send(Ok(Bytes::from(line))) => sent.is_ok(),
                        () = tx.closed() => false,
                    };
                    if !sent {
                        if !ended {
                            stop_abandoned(&session).await;
                        }
                        break;
                    }
                }
                // The client went away: nobody reads the command's output, and the session
                // runs one command at a time, so the command is stopped rather than left to
                // hold it until its timeout.
                // (Never after its exit: what runs then is another call's command.)
                () = tx.closed(), if !ended => {
                    stop_abandoned(&session).await;
                    break;
                }
            }
        }
    });
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
        .into_response())
}

/// Stop the command of a stream whose client went away.
async fn stop_abandoned(session: &crate::service::sessions::Lease) {
    if let Err(e) = session.kill().await {
        tracing::warn!(error = %e, "stopping a command whose stream was dropped");
    }
}

pub async fn shell(State(state): State<Arc<AppState>>, UrlPath(id): Id, body: Bytes) -> AppResult<Json<ShellOutput>> {
    let session = state.sessions.lease(&id)?;
    let request = parse_json::<Shell>(&body)?.into_request()?;
    Ok(Json(session.shell(request).await?))
}

pub async fn python(State(state): State<Arc<AppState>>, UrlPath(id): Id, body: Bytes) -> AppResult<Json<PythonOutput>> {
    let session = state.sessions.lease(&id)?;
    let request: Python = parse_json(&body)?;
    match session.python_exec(&request.code, request.timeout()?).await? {
        serde_json::Value::Object(map) => Ok(Json(PythonOutput(map))),
        other => Err(ServiceError::rejected(format!("the Python driver answered {other}")).into()),
    }
}

pub async fn python_vars(State(state): State<Arc<AppState>>, UrlPath(id): Id) -> AppResult<Json<serde_json::Value>> {
    let session = state.sessions.lease(&id)?;
    Ok(Json(session.python_vars().await?))
}

pub async fn python_var(
    State(state): State<Arc<AppState>>,
    UrlPath((id, name)): UrlPath<(String, String)>,
) -> AppResult<Json<PythonValue>> {
    let session = state.sessions.lease(&id)?;
    Ok(Json(PythonValue {
        value: session.python_var(&name).await?,
    }))
}

pub async fn read_file(
    State(state): State<Arc<AppState>>,
    UrlPath(id): Id,
    Query(q): Query<PathQuery>,
) -> AppResult<Response> {
    let session = state.sessions.lease(&id)?;
    let file = session.read_file(&q.required()?).await?;
    // Streamed: a file the sandbox made may be huge (or sparse). The stream holds the lease:
    // the session is in use until the last byte is sent.
    let stream = tokio_util::io::ReaderStream::new(tokio::fs::File::from_std(file)).map(move |chunk| {
        let _in_use = &session;
        chunk
    });
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        Body::from_stream(stream),
    )
        .into_response())
}

pub async fn write_file(
    State(state): State<Arc<AppState>>,
    UrlPath(id): Id,
    Query(q): Query<PathQuery>,
    body: Bytes,
) -> AppResult<StatusCode> {
    let session = state.sessions.lease(&id)?;
    session.write_file(&q.required()?, body).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn make_dir(
    State(state): State<Arc<AppState>>,
    UrlPath(id): Id,
    Query(q): Query<PathQuery>,
) -> AppResult<StatusCode> {
    let session = state.sessions.lease(&id)?;
    session.make_dir(&q.required()?).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn list_files(
    State(state): State<Arc<AppState>>,
    UrlPath(id): Id,
    Query(q): Query<PathQuery>,
) -> AppResult<Response> {
    let session = state.sessions.lease(&id)?;
    let listing = session.list_files(&q.path.unwrap_or_default()).await?;
    let entries: Vec<ListEntry> = listing.entries;
    let mut response = Json(entries).into_response();
    if listing.truncated {
        response
            .headers_mut()
            .insert("x-runner-truncated", HeaderValue::from_static("true"));
    }
    Ok(response)
}

pub async fn upload(
    State(state): State<Arc<AppState>>,
    UrlPath(id): Id,
    Query(q): Query<PathQuery>,
    body: Bytes,
) -> AppResult<Json<UnpackReport>> {
    let session = state.sessions.lease(&id)?;
    Ok(Json(session.upload(&q.path.unwrap_or_default(), body).await?))
}

/// A tar of a workspace directory (or one file), streamed as it is written. The path is
/// resolved first, so a bad one is an error status rather than a cut stream.
pub async fn download(
    State(state): State<Arc<AppState>>,
    UrlPath(id): Id,
    Query(q): Query<PathQuery>,
) -> AppResult<Response> {
    let session = state.sessions.lease(&id)?;
    let download = session.download(&q.path.unwrap_or_default()).await?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    tokio::task::spawn_blocking(move || {
        let mut out = ChannelWriter(tx.clone());
        if let Err(e) = download.write_to(&mut out) {
            // The status is sent; the client sees a cut stream, and we say why in the log.
            tracing::warn!(error = %e, "tar download stopped");
            let _ = tx.blocking_send(Err(std::io::Error::other(e.to_string())));
        }
    });
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
