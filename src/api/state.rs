//! A session's state: pause and resume, and the check every other call of a session goes
//! through first (a paused session answers 409, or is resumed when it was made with
//! `autoResume`); filesystem snapshots of sessions, listed and removed.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path as UrlPath, Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::{AppResult, AppState, Doc, Route, route};
use crate::service::sessions::SessionView;
use crate::service::snapshots::{self, Created, SnapshotView};

/// What follows `/v1/sessions/{id}/` in the routes that act on the session's state rather
/// than use its sandbox (so they never resume it).
const STATE_ROUTES: [&str; 3] = ["pause", "resume", "snapshot"];

/// `POST /v1/sessions/{id}/snapshot`.
#[derive(serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TakeSnapshot {
    /// The snapshot's name: its image is `snapshot:NAME`.
    pub name: String,
    /// Replace a snapshot of that name (default: 409 when one exists).
    #[serde(default)]
    pub replace: bool,
    /// Hold the session's workspace too: what starts from the snapshot finds those files in
    /// its workspace (default: the rootfs changes only).
    #[serde(default)]
    pub workspace: bool,
}

pub(super) fn routes() -> Vec<Route> {
    vec![
        route(
            Doc::new(
                Method::POST,
                "/v1/sessions/{id}/pause",
                "freeze the session's processes (they keep their memory, use no CPU); 409 while calls are in progress",
            )
            .returns::<SessionView>(200),
            pause,
        ),
        route(
            Doc::new(
                Method::POST,
                "/v1/sessions/{id}/resume",
                "thaw a paused session: its processes go on where they were",
            )
            .returns::<SessionView>(200),
            resume,
        ),
        route(
            Doc::new(
                Method::POST,
                "/v1/sessions/{id}/snapshot",
                "make the session's filesystem changes an image, `snapshot:NAME` (and its workspace with `workspace: true`; never its mounts)",
            )
            .takes::<TakeSnapshot>()
            .returns::<Created>(201),
            snapshot,
        ),
        route(
            Doc::new(Method::GET, "/v1/snapshots", "list snapshots with their disk use").returns::<Vec<SnapshotView>>(200),
            list_snapshots,
        ),
        route(
            Doc::new(Method::DELETE, "/v1/snapshots/{name}", "remove a snapshot").returns_nothing(204),
            remove_snapshot,
        ),
    ]
}

async fn snapshot(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
    body: axum::body::Bytes,
) -> AppResult<(StatusCode, Json<Created>)> {
    let request: TakeSnapshot = super::parse_json(&body)?;
    let created = state
        .sessions
        .snapshot(&id, &request.name, request.replace, request.workspace)
        .await?;
    Ok((StatusCode::CREATED, Json(created)))
}

async fn list_snapshots(State(state): State<Arc<AppState>>) -> AppResult<Json<Vec<SnapshotView>>> {
    Ok(Json(snapshots::list(&state.ctx).await?))
}

async fn remove_snapshot(State(state): State<Arc<AppState>>, UrlPath(name): UrlPath<String>) -> AppResult<StatusCode> {
    snapshots::remove(&state.ctx, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn pause(State(state): State<Arc<AppState>>, UrlPath(id): UrlPath<String>) -> AppResult<Json<SessionView>> {
    Ok(Json(state.sessions.pause(&id).await?))
}

async fn resume(State(state): State<Arc<AppState>>, UrlPath(id): UrlPath<String>) -> AppResult<Json<SessionView>> {
    Ok(Json(state.sessions.resume(&id).await?))
}

/// The session a call uses the sandbox of: `/v1/sessions/{id}/REST`, REST not a state route.
fn sandbox_call(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/v1/sessions/")?;
    let (id, rest) = rest.split_once('/')?;
    let first = rest.split('/').next().unwrap_or("");
    (!id.is_empty() && !STATE_ROUTES.contains(&first)).then_some(id)
}

/// Before a call uses a session's sandbox: the session runs (resumed now under
/// `autoResume`), or the call is answered 409. The session is held from before the check to
/// the end of the handler, so a pause cannot slip in between (it refuses while
/// calls are in progress).
pub(super) async fn ensure_running(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Some(id) = sandbox_call(request.uri().path()) else {
        return next.run(request).await;
    };
    // An unknown session is the handler's to answer (404 in its own shape).
    let Ok(hold) = state.sessions.hold(id) else {
        return next.run(request).await;
    };
    if let Err(e) = hold.ensure_running().await {
        return super::ApiError::from(e).into_response();
    }
    let response = next.run(request).await;
    drop(hold);
    response
}

#[cfg(test)]
mod tests {
    use super::sandbox_call;

    #[test]
    fn sandbox_calls_are_those_under_a_session_but_its_state_routes() {
        assert_eq!(sandbox_call("/v1/sessions/s-1/exec"), Some("s-1"));
        assert_eq!(sandbox_call("/v1/sessions/s-1/swerex/run_in_session"), Some("s-1"));
        assert_eq!(sandbox_call("/v1/sessions/s-1/files/list"), Some("s-1"));
        assert_eq!(sandbox_call("/v1/sessions/s-1/pause"), None);
        assert_eq!(sandbox_call("/v1/sessions/s-1/resume"), None);
        assert_eq!(sandbox_call("/v1/sessions/s-1/snapshot"), None);
        assert_eq!(sandbox_call("/v1/sessions/s-1"), None);
        assert_eq!(sandbox_call("/v1/sessions"), None);
        assert_eq!(sandbox_call("/v1/jobs/x/logs"), None);
    }
}
