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

pub async fn logs(State(state): State<Arc<AppState>>, UrlPath(name): UrlPath<String>) -> AppResult<Response> {
    let text = jobs::output(&state.ctx, &name).await?;
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response())
}

pub async fn delete(State(state): State<Arc<AppState>>, UrlPath(name): UrlPath<String>) -> AppResult<StatusCode> {
    jobs::delete(&state.ctx, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}
