//! Watching a session: its workspace's changes as a stream (NDJSON, or server-sent events
//! when the client accepts `text/event-stream`).

use std::sync::Arc;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{HeaderMap, Method, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::{AppResult, AppState, Doc, Route, route};
use crate::runtime::usage::Usage;
use crate::service::sessions::usage::SandboxMetrics;
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
    ),
    route(
        Doc::new(
            Method::GET,
            "/v1/sessions/{id}/metrics",
            "the sandbox's resource use from its cgroup: CPU time and current rate, memory now and at peak, pids, block I/O and network bytes (containerd sessions)",
        )
        .returns::<SandboxMetrics>(200),
        metrics,
    )]
}

async fn metrics(State(state): State<Arc<AppState>>, UrlPath(id): UrlPath<String>) -> AppResult<Json<SandboxMetrics>> {
    let session = state.sessions.lease(&id)?;
    Ok(Json(session.metrics().await?))
}

/// What each live sandbox uses, as gauges of `/metrics`: one series per live session (label
/// `session`) and per running job attempt (`job`, `index`); what ended has none, so the
/// labels' cardinality is what runs now.
pub(super) async fn sandbox_gauges(state: &AppState) -> Vec<crate::metrics::Gauge<'static>> {
    type Labels = Vec<(&'static str, String)>;
    let mut rows: Vec<(Labels, Usage)> = Vec::new();
    for session in state.sessions.live() {
        if let Ok(Some(usage)) = session.usage().await {
            rows.push((vec![("session", session.id.clone())], usage));
        }
    }
    let running = match crate::service::jobs::list(&state.ctx, &Default::default()).await {
        Ok(jobs) => jobs
            .into_iter()
            .filter(|j| j.object.status.phase == crate::job::Phase::Running)
            .map(|j| j.object.metadata.name)
            .collect(),
        Err(_) => Vec::new(),
    };
    for job in running {
        match crate::service::usage::running(&state.ctx, Some(&job), None).await {
            Ok(containers) => {
                for c in containers {
                    let index = c.index.map(|i| i.to_string()).unwrap_or_default();
                    rows.push((vec![("job", job.clone()), ("index", index)], c.usage));
                }
            }
            Err(e) => tracing::debug!(job, error = %e, "reading a running job's use"),
        }
    }
    let series = |f: &dyn Fn(&Usage) -> Option<f64>, extra: Option<(&'static str, &'static str)>| {
        rows.iter()
            .filter_map(|(labels, u)| {
                let mut labels = labels.clone();
                if let Some((k, v)) = extra {
                    labels.push((k, v.to_string()));
                }
                f(u).map(|v| (labels, v))
            })
            .collect::<Vec<_>>()
    };
    let gauge = |name, help, values| crate::metrics::Gauge { name, help, values };
    vec![
        gauge(
            "runner_sandbox_cpu_seconds",
            "CPU time a live sandbox has used",
            series(&|u| Some(u.cpu_seconds), None),
        ),
        gauge(
            "runner_sandbox_memory_bytes",
            "memory a live sandbox uses now",
            series(&|u| u.memory_bytes.map(|v| v as f64), None),
        ),
        gauge(
            "runner_sandbox_memory_peak_bytes",
            "the most memory a live sandbox used at once",
            series(&|u| u.memory_peak_bytes.map(|v| v as f64), None),
        ),
        gauge(
            "runner_sandbox_pids",
            "processes and threads of a live sandbox",
            series(&|u| u.pids.map(|v| v as f64), None),
        ),
        gauge(
            "runner_sandbox_io_bytes",
            "block I/O bytes of a live sandbox, by direction",
            [
                series(&|u| u.io_read_bytes.map(|v| v as f64), Some(("direction", "read"))),
                series(&|u| u.io_write_bytes.map(|v| v as f64), Some(("direction", "write"))),
            ]
            .concat(),
        ),
        gauge(
            "runner_sandbox_network_bytes",
            "network bytes of a live sandbox's interfaces, by direction",
            [
                series(&|u| u.net_rx_bytes.map(|v| v as f64), Some(("direction", "rx"))),
                series(&|u| u.net_tx_bytes.map(|v| v as f64), Some(("direction", "tx"))),
            ]
            .concat(),
        ),
    ]
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
