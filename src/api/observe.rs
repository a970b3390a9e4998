//! Watching a session: its workspace's changes as a stream (NDJSON, or server-sent events
//! when the client accepts `text/event-stream`).

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{HeaderMap, Method, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::{AppResult, AppState, Doc, Route, route};
use crate::service::sessions::watch::WatchEvent;

pub(super) fn routes() -> Vec<Route> {
    vec![route(
        Doc::new(
            Method::GET,
            "/v1/sessions/{id}/files/watch",
            "stream the workspace's changes (create, modify, delete, move, overflow) as NDJSON, or server-sent events with Accept: text/event-stream",
        )
        .query("path", "a directory or file relative to the workspace (default: all of it)", false)
        .query("recursive", "true: the subdirectories too (default true)", false)
        .returns_raw(200, "application/x-ndjson"),
        watch,
    )]
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WatchQuery {
    #[serde(default)]
    path: String,
    recursive: Option<bool>,
}

fn line(event: &WatchEvent, sse: bool) -> Bytes {
    let json = serde_json::to_string(event).unwrap_or_default();
    if sse {
        let kind = serde_json::to_value(event)
            .ok()
            .and_then(|v| v["type"].as_str().map(String::from))
            .unwrap_or_default();
        Bytes::from(format!("event: {kind}\ndata: {json}\n\n"))
    } else {
        Bytes::from(json + "\n")
    }
}

async fn watch(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
    Query(query): Query<WatchQuery>,
    headers: HeaderMap,
) -> AppResult<Response> {
    let sse = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/event-stream"));
    let session = state.sessions.lease(&id)?;
    let mut watch = session.watch(&query.path, query.recursive.unwrap_or(true)).await?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    tokio::spawn(async move {
        // The lease lives as long as the stream: a watched session is in use.
        let _session = session;
        loop {
            tokio::select! {
                event = watch.events.recv() => {
                    let Some(event) = event else { break };
                    if tx.send(Ok(line(&event, sse))).await.is_err() {
                        break;
                    }
                }
                () = tx.closed() => break,
            }
        }
    });
    let content_type = if sse {
        "text/event-stream"
    } else {
        "application/x-ndjson"
    };
    Ok((
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
        .into_response())
}
