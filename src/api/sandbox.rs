//! Reference 003's sandbox API on every session, with its exact shapes, so a client of that
//! reference only changes its base URL: `POST …/sandbox/exec {code, timeout}` →
//! `{output, stderr, vars}` (plus `error` when the code raised or ran out of time; timeout in
//! seconds, default 30), `GET …/sandbox/vars` → `[{name, type, summary}]`, `GET
//! …/sandbox/var/{name}` → `{value}`.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::http::Method;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::types::PythonValue;
use super::{AppResult, AppState, Doc, Route, parse_json, route};

/// The reference's default per-call limit.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Deserialize, JsonSchema)]
pub struct ExecRequest {
    code: String,
    /// Seconds.
    timeout: Option<f64>,
}

#[derive(Serialize, JsonSchema)]
pub struct ExecResponse {
    output: String,
    stderr: String,
    vars: Vec<String>,
    /// Only when the code raised or was stopped at its time limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

pub(super) fn routes() -> Vec<Route> {
    vec![
        route(
            Doc::new(
                Method::POST,
                "/v1/sessions/{id}/sandbox/exec",
                "reference 003: run code in the persistent interpreter",
            )
            .takes::<ExecRequest>()
            .returns::<ExecResponse>(200),
            exec,
        ),
        route(
            Doc::new(
                Method::GET,
                "/v1/sessions/{id}/sandbox/vars",
                "reference 003: the variables",
            )
            .returns::<Vec<serde_json::Map<String, serde_json::Value>>>(200),
            vars,
        ),
        route(
            Doc::new(
                Method::GET,
                "/v1/sessions/{id}/sandbox/var/{name}",
                "reference 003: one variable's value",
            )
            .returns::<PythonValue>(200),
            var,
        ),
    ]
}

async fn exec(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
    body: Bytes,
) -> AppResult<Json<ExecResponse>> {
    let session = state.sessions.lease(&id)?;
    let request: ExecRequest = parse_json(&body)?;
    let timeout = super::types::seconds("timeout", request.timeout)?.unwrap_or(DEFAULT_TIMEOUT);
    let answer = session.python_exec(&request.code, Some(timeout)).await?;
    let text = |key: &str| answer.get(key).and_then(|v| v.as_str()).unwrap_or_default().to_string();
    Ok(Json(ExecResponse {
        output: text("output"),
        stderr: text("stderr"),
        vars: answer
            .get("vars")
            .and_then(|v| v.as_array())
            .map(|names| names.iter().filter_map(|n| n.as_str().map(String::from)).collect())
            .unwrap_or_default(),
        error: answer.get("error").and_then(|e| e.as_str()).map(String::from),
    }))
}

async fn vars(State(state): State<Arc<AppState>>, UrlPath(id): UrlPath<String>) -> AppResult<Json<serde_json::Value>> {
    let session = state.sessions.lease(&id)?;
    Ok(Json(session.python_vars().await?))
}

async fn var(
    State(state): State<Arc<AppState>>,
    UrlPath((id, name)): UrlPath<(String, String)>,
) -> AppResult<Json<PythonValue>> {
    let session = state.sessions.lease(&id)?;
    Ok(Json(PythonValue {
        value: session.python_var(&name).await?,
    }))
}
