//! Checkpoints of live sessions over HTTP (CRIU: processes, memory and files), restores and
//! forks; the service owns all of it (`service::sessions::checkpoint`), this file parses and
//! answers. A restore is `POST /v1/sessions` with `fromCheckpoint` (`sessions::create`).

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::http::{Method, StatusCode};
use schemars::JsonSchema;
use serde::Deserialize;

use super::{AppResult, AppState, Doc, Route, parse_json, route};
use crate::service::sessions::{CheckpointView, Forked};

/// `POST /v1/sessions/{id}/checkpoint`.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TakeCheckpoint {
    /// The checkpoint's name (lowercase letters, digits, '-', '.'; at most 63).
    name: String,
    /// Replace a checkpoint of that name (default: 409 when one exists).
    #[serde(default)]
    replace: bool,
}

/// `POST /v1/sessions/{id}/fork`.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Fork {
    /// How many copies (1 to 100).
    count: usize,
}

pub(super) fn routes() -> Vec<Route> {
    vec![
        route(
            Doc::new(
                Method::POST,
                "/v1/sessions/{id}/checkpoint",
                "checkpoint the session (CRIU): its processes, memory, files and workspace, restorable as new sessions (`fromCheckpoint`); 409 while calls are in progress",
            )
            .takes::<TakeCheckpoint>()
            .returns::<CheckpointView>(201),
            checkpoint,
        ),
        route(
            Doc::new(
                Method::POST,
                "/v1/sessions/{id}/fork",
                "N new sessions, each a copy of this one as it is now (shell and Python variables, running processes, files)",
            )
            .takes::<Fork>()
            .returns::<Forked>(201),
            fork,
        ),
        route(
            Doc::new(Method::GET, "/v1/checkpoints", "list checkpoints with their disk use")
                .returns::<Vec<CheckpointView>>(200),
            list,
        ),
        route(
            Doc::new(Method::DELETE, "/v1/checkpoints/{name}", "remove a checkpoint").returns_nothing(204),
            remove,
        ),
    ]
}

async fn checkpoint(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
    body: Bytes,
) -> AppResult<(StatusCode, Json<CheckpointView>)> {
    let request: TakeCheckpoint = parse_json(&body)?;
    let view = state.sessions.checkpoint(&id, &request.name, request.replace).await?;
    Ok((StatusCode::CREATED, Json(view)))
}

async fn fork(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
    body: Bytes,
) -> AppResult<(StatusCode, Json<Forked>)> {
    let request: Fork = parse_json(&body)?;
    Ok((
        StatusCode::CREATED,
        Json(state.sessions.fork(&id, request.count).await?),
    ))
}

async fn list(State(state): State<Arc<AppState>>) -> AppResult<Json<Vec<CheckpointView>>> {
    Ok(Json(state.sessions.checkpoints().await?))
}

async fn remove(State(state): State<Arc<AppState>>, UrlPath(name): UrlPath<String>) -> AppResult<StatusCode> {
    state.sessions.remove_checkpoint(&name).await?;
    Ok(StatusCode::NO_CONTENT)
}
