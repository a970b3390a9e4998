//! Job handlers: HTTP in, a service call, HTTP out. Reads change nothing.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::types::CreatedJobs;
use super::{ApiError, AppResult, AppState};
use crate::job::JobObject;
use crate::service::jobs;
use crate::service::logs::{LogChunk, LogOptions, Logs, Prefixer, Stream};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateQuery {
    /// Replace finished jobs of the same names (else 409, as Kubernetes' AlreadyExists).
    #[serde(default)]
    replace: bool,
}

pub async fn create(
    State(state): State<Arc<AppState>>,
    Query(q): Query<CreateQuery>,
    body: Bytes,
) -> AppResult<Response> {
    let text = std::str::from_utf8(&body).map_err(|_| ApiError::BadRequest("the manifest is not UTF-8".into()))?;
    let created = jobs::submit(&state.ctx, text, &state.base_dir, q.replace).await?;
    Ok((StatusCode::CREATED, Json(CreatedJobs { created })).into_response())
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListQuery {
    label_selector: Option<String>,
}

pub async fn list(State(state): State<Arc<AppState>>, Query(q): Query<ListQuery>) -> AppResult<Json<Vec<JobObject>>> {
    let selector = jobs::parse_selector(q.label_selector.as_deref())?;
    jobs::purge(&state.ctx).await?;
    let listed = jobs::list(&state.ctx, &selector).await?;
    Ok(Json(listed.into_iter().map(|l| l.object).collect()))
}

pub async fn get(State(state): State<Arc<AppState>>, UrlPath(name): UrlPath<String>) -> AppResult<Json<JobObject>> {
    Ok(Json(jobs::get(&state.ctx, &name).await?))
}

/// `GET /v1/jobs/{name}/logs`: what `runner logs` prints, one stream at a time (kubectl's
/// `tailLines` and `follow`).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LogsQuery {
    #[serde(default)]
    follow: bool,
    index: Option<u32>,
    attempt: Option<u32>,
    tail_lines: Option<usize>,
    #[serde(default)]
    prefix: bool,
    #[serde(default)]
    setup: bool,
    #[serde(default)]
    stream: LogStream,
}

#[derive(Deserialize, Default, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogStream {
    #[default]
    Stdout,
    Stderr,
}

pub async fn logs(
    State(state): State<Arc<AppState>>,
    UrlPath(name): UrlPath<String>,
    Query(q): Query<LogsQuery>,
) -> AppResult<Response> {
    let options = LogOptions {
        follow: q.follow,
        attempt: q.attempt,
        index: q.index,
        tail: q.tail_lines,
        setup: q.setup,
    };
    let wanted = match q.stream {
        LogStream::Stdout => Stream::Stdout,
        LogStream::Stderr => Stream::Stderr,
    };
    // A job that is not there is a 404 now, not an empty stream.
    jobs::get(&state.ctx, &name).await?;
    let mut logs = Logs::new(&state.ctx, &name, options);
    let mut prefixer = Prefixer::default();
    let mut pick = move |chunks: Vec<LogChunk>| -> Vec<u8> {
        let mut out = Vec::new();
        for chunk in chunks {
            match chunk {
                LogChunk::Output { index, stream, data } if stream == wanted => {
                    if q.prefix {
                        out.extend(prefixer.push(index, stream, &data));
                    } else {
                        out.extend(data);
                    }
                }
                LogChunk::End { index } => {
                    for (stream, rest) in prefixer.end(index) {
                        if stream == wanted {
                            out.extend(rest);
                        }
                    }
                }
                LogChunk::Output { .. } | LogChunk::Notice(_) => {}
            }
        }
        out
    };
    let headers = [(header::CONTENT_TYPE, "text/plain; charset=utf-8")];
    if !q.follow {
        let mut body = Vec::new();
        while let Some(chunks) = logs.next().await? {
            body.extend(pick(chunks));
        }
        return Ok((headers, body).into_response());
    }
    // Following: each piece as it is read, until the job ends or the client goes away
    // (the stream is dropped with the connection).
    let stream = futures::stream::unfold((logs, pick), |(mut logs, mut pick)| async move {
        match logs.next().await {
            Ok(Some(chunks)) => Some((Ok::<_, std::io::Error>(Bytes::from(pick(chunks))), (logs, pick))),
            Ok(None) => None,
            Err(e) => Some((Err(std::io::Error::other(e.to_string())), (logs, pick))),
        }
    });
    Ok((headers, axum::body::Body::from_stream(stream)).into_response())
}

pub async fn delete(State(state): State<Arc<AppState>>, UrlPath(name): UrlPath<String>) -> AppResult<StatusCode> {
    jobs::delete(&state.ctx, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}
