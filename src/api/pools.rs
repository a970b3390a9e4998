//! Warm pools over HTTP: what `runner pool create|ls|rm` does, for a harness that makes a pool
//! for one evaluation and removes it at the end (Inspect's `task_init` / `task_cleanup`).
//! A session whose Environment is the pool's (same image, resources, user, hardening: the pool
//! key) claims a member; the service owns all of it, this file parses and answers.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{AppResult, AppState, Doc, Route, parse_json, route};
use crate::service::pools;

/// The size a pool gets when the request names none (`runner pool create`'s default too).
const DEFAULT_SIZE: u32 = 2;

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreatePool {
    /// Lowercase letters, digits and '-', at most 63 characters.
    name: String,
    /// A whole Environment document, its spec object, or the name of one in the server's
    /// env dir (as a session's `environment`).
    #[schemars(with = "serde_json::Value")]
    environment: serde_json::Value,
    /// Members kept ready (default 2).
    size: Option<u32>,
    /// No longer needed (accepted for older clients): every member offers a workspace.
    workspace: Option<bool>,
    /// No longer needed (accepted for older clients): every member offers the static-assets root.
    #[serde(default)]
    static_assets: bool,
    /// Members start from this snapshot (`GET /v1/snapshots`) instead of the Environment's
    /// image: they serve the sessions that start from `snapshot:NAME` with the Environment's
    /// other settings.
    snapshot: Option<String>,
}

/// A pool and what its members are doing now.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolView {
    name: String,
    environment: String,
    size: u32,
    ready: usize,
    /// Members whose init is not running (removed by the next fill).
    broken: usize,
    /// Members offer a workspace at the Environment's workdir (unless `mountWorkspace: false`
    /// or a mount overlaps it).
    workspace: bool,
    /// Members offer the static-assets root (unless a mount overlaps `/static`).
    static_assets: bool,
    /// What members can serve: a session or job whose Environment hashes to it claims one.
    key: String,
    /// The snapshot members start from, when not the Environment's image.
    #[serde(skip_serializing_if = "Option::is_none")]
    snapshot: Option<String>,
    created: String,
}

#[derive(Serialize, JsonSchema)]
pub struct RemovedPool {
    /// The members removed (claimed ones finish their session or job first).
    removed: Vec<String>,
}

pub(super) fn routes() -> Vec<Route> {
    vec![
        route(
            Doc::new(
                Method::POST,
                "/v1/pools",
                "make a warm pool (or resize one) and fill it; sessions of its Environment claim members",
            )
            .takes::<CreatePool>()
            .returns::<PoolView>(201),
            create,
        ),
        route(
            Doc::new(
                Method::GET,
                "/v1/pools",
                "every pool of the state dir, with ready members",
            )
            .returns::<Vec<PoolView>>(200),
            list,
        ),
        route(
            Doc::new(
                Method::DELETE,
                "/v1/pools/{name}",
                "remove a pool: nothing refills it, its unclaimed members are removed",
            )
            .returns::<RemovedPool>(200),
            remove,
        ),
    ]
}

async fn create(State(state): State<Arc<AppState>>, body: Bytes) -> AppResult<Response> {
    let request: CreatePool = parse_json(&body)?;
    let (environment, source) = pools::api_source(&state.ctx, &request.name, request.environment, &state.base_dir)?;
    let (def, report) = pools::create_from(
        &state.ctx,
        &request.name,
        &environment,
        source,
        request.size.unwrap_or(DEFAULT_SIZE),
        request.workspace.unwrap_or(true),
        request.static_assets,
        request.snapshot,
    )
    .await?;
    let view = PoolView {
        ready: report.ready,
        broken: 0,
        ..view(def)
    };
    Ok((StatusCode::CREATED, Json(view)).into_response())
}

async fn list(State(state): State<Arc<AppState>>) -> AppResult<Json<Vec<PoolView>>> {
    let pools = pools::list(&state.ctx).await?;
    Ok(Json(
        pools
            .into_iter()
            .map(|p| PoolView {
                ready: p.ready,
                broken: p.broken,
                ..view(p.def)
            })
            .collect(),
    ))
}

async fn remove(State(state): State<Arc<AppState>>, UrlPath(name): UrlPath<String>) -> AppResult<Json<RemovedPool>> {
    Ok(Json(RemovedPool {
        removed: pools::remove(&state.ctx, &name).await?,
    }))
}

fn view(def: pools::PoolDef) -> PoolView {
    PoolView {
        name: def.name,
        environment: def.environment,
        size: def.size,
        ready: 0,
        broken: 0,
        workspace: def.workspace,
        static_assets: def.static_assets,
        key: def.key,
        snapshot: def.snapshot,
        created: def.created,
    }
}
