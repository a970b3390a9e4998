//! Pausing a live session: its sandbox's processes frozen (containerd's freezer), keeping
//! their memory and using no CPU. A call to a paused session is refused with a conflict, or
//! resumes it first when the session was made with `autoResume`; a session with
//! `idlePauseSeconds` pauses itself once idle that long. A paused session is not reaped as
//! idle: pausing is how a session is kept for later.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

use super::{Session, SessionManager, SessionView};
use crate::service::ServiceError;

/// Whether a session runs or is paused, as callers see it; or that its sandbox ended under
/// it (its init exited: killed, or the shim it shared died), when every call answers 409 and
/// only its delete is left.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum SessionState {
    Running,
    Paused,
    Ended,
}

/// How a session pauses and resumes (fixed at its creation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PausePolicy {
    /// A call to the paused session resumes it first (instead of answering a conflict).
    pub auto_resume: bool,
    /// Pause the session once it has been idle this long.
    pub idle_pause: Option<Duration>,
}

/// A session's pause state. Transitions (and the check a call makes) hold `transition`, so
/// a call either sees the session paused, or holds its lease before a pause looks for calls
/// in progress (and the pause is refused).
#[derive(Default)]
pub(super) struct PauseState {
    pub(super) policy: PausePolicy,
    paused: AtomicBool,
    /// When it was paused (RFC 3339), for the session's view.
    since: Mutex<Option<String>>,
    pub(super) transition: tokio::sync::Mutex<()>,
    /// Holds of `SessionManager::hold` (each also counts in the session's `in_use`, but is
    /// not a call of its own: the call holds a lease too).
    held: AtomicUsize,
}

impl PauseState {
    pub(super) fn new(policy: PausePolicy) -> Self {
        PauseState {
            policy,
            ..Default::default()
        }
    }

    pub(super) fn is_paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }

    pub(super) fn state(&self) -> SessionState {
        if self.is_paused() {
            SessionState::Paused
        } else {
            SessionState::Running
        }
    }

    /// Holds that are not calls of their own.
    pub(super) fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    pub(super) fn since(&self) -> Option<String> {
        self.since.lock().expect("pause lock").clone()
    }
}

impl Session {
    /// Freeze the sandbox. Refused while calls are in progress (a frozen command would hold
    /// its call until its timeout); pausing a paused session changes nothing.
    pub async fn pause(&self) -> Result<SessionView, ServiceError> {
        let _transition = self.pause.transition.lock().await;
        if !self.pause.is_paused() {
            self.pause_locked().await?;
        }
        Ok(self.view())
    }

    async fn pause_locked(&self) -> Result<(), ServiceError> {
        let calls = self.in_use.load(Ordering::SeqCst);
        if calls > 0 {
            return Err(ServiceError::Conflict(format!(
                "session {} has {calls} call(s) in progress: pause it when they have ended",
                self.id
            )));
        }
        self.runtime.pause().await?;
        self.pause.paused.store(true, Ordering::SeqCst);
        *self.pause.since.lock().expect("pause lock") = Some(crate::job::rfc3339(SystemTime::now()));
        tracing::info!(session = self.id, "paused");
        Ok(())
    }

    /// Thaw the sandbox: its processes go on where they were. Resuming a running session
    /// changes nothing.
    pub async fn resume(&self) -> Result<SessionView, ServiceError> {
        let _transition = self.pause.transition.lock().await;
        self.resume_locked().await?;
        Ok(self.view())
    }

    async fn resume_locked(&self) -> Result<(), ServiceError> {
        if !self.pause.is_paused() {
            return Ok(());
        }
        self.runtime.resume().await?;
        self.pause.paused.store(false, Ordering::SeqCst);
        *self.pause.since.lock().expect("pause lock") = None;
        // Idle time counts again from the resume (an idle pause must not follow at once).
        *self.last_used.lock().expect("session lock") = Instant::now();
        tracing::info!(session = self.id, "resumed");
        Ok(())
    }

    /// What a call makes sure of before it uses the sandbox (holding its lease): that the
    /// session runs — resumed now when its policy says so, else a conflict.
    pub async fn ensure_running(&self) -> Result<(), ServiceError> {
        if !self.pause.is_paused() {
            return Ok(());
        }
        let _transition = self.pause.transition.lock().await;
        if !self.pause.is_paused() {
            return Ok(());
        }
        if self.pause.policy.auto_resume {
            return self.resume_locked().await;
        }
        Err(ServiceError::Conflict(format!(
            "session {id} is paused: resume it first (POST /v1/sessions/{id}/resume), or create sessions with autoResume: true",
            id = self.id
        )))
    }

    /// Pause the session when its policy says it has idled long enough (checked again
    /// under the transition lock); whether it paused.
    async fn pause_if_idle(&self) -> Result<bool, ServiceError> {
        let Some(after) = self.pause.policy.idle_pause else {
            return Ok(false);
        };
        let _transition = self.pause.transition.lock().await;
        if self.pause.is_paused() || self.in_use.load(Ordering::SeqCst) > 0 || self.idle() < after {
            return Ok(false);
        }
        self.pause_locked().await?;
        Ok(true)
    }
}

/// A session held while a call checks it runs and then runs (`SessionManager::hold`): a
/// pause is refused while it lives, as while a lease does, but it is not counted as a call.
pub struct Hold(Arc<Session>);

impl Hold {
    /// The session runs (resumed now under `autoResume`), or a conflict.
    pub async fn ensure_running(&self) -> Result<(), ServiceError> {
        self.0.ensure_running().await
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        *self.0.last_used.lock().expect("session lock") = Instant::now();
        self.0.pause.held.fetch_sub(1, Ordering::SeqCst);
        self.0.in_use.fetch_sub(1, Ordering::SeqCst);
    }
}

impl SessionManager {
    /// Snapshot a session's filesystem as `name` (`POST /v1/sessions/{id}/snapshot`): no
    /// pause or resume runs meanwhile; a paused session stays paused.
    pub async fn snapshot(
        &self,
        id: &str,
        name: &str,
        replace: bool,
        workspace: bool,
    ) -> Result<crate::service::snapshots::Created, ServiceError> {
        let session = self.find(id)?;
        if session.backend == crate::manifest::Backend::Host {
            return Err(ServiceError::field(
                "id",
                format!("session {id} runs on the host backend: it has no filesystem of its own to snapshot"),
            ));
        }
        let _transition = session.pause.transition.lock().await;
        crate::service::snapshots::create(&self.ctx, id, name, replace, workspace).await
    }

    /// Hold a session for a call about to use its sandbox (see `Hold`).
    pub fn hold(&self, id: &str) -> Result<Hold, ServiceError> {
        // Under the map's lock, as a lease is taken: the reaper sees it.
        let sessions = self.sessions.lock().expect("sessions lock");
        let session = sessions.get(id).cloned().ok_or_else(|| ServiceError::NotFound {
            kind: "session",
            name: id.to_string(),
        })?;
        session.in_use.fetch_add(1, Ordering::SeqCst);
        session.pause.held.fetch_add(1, Ordering::SeqCst);
        Ok(Hold(session))
    }

    /// Pause a session (`POST /v1/sessions/{id}/pause`).
    pub async fn pause(&self, id: &str) -> Result<SessionView, ServiceError> {
        self.find(id)?.pause().await
    }

    /// Resume a session (`POST /v1/sessions/{id}/resume`).
    pub async fn resume(&self, id: &str) -> Result<SessionView, ServiceError> {
        self.find(id)?.resume().await
    }

    /// Pause the sessions whose `idlePauseSeconds` have passed; their ids.
    pub async fn pause_idle(&self) -> Vec<String> {
        let candidates: Vec<_> = self
            .sessions
            .lock()
            .expect("sessions lock")
            .values()
            .filter(|s| s.pause.policy.idle_pause.is_some() && !s.pause.is_paused())
            .cloned()
            .collect();
        let mut paused = Vec::new();
        for s in candidates {
            match s.pause_if_idle().await {
                Ok(true) => paused.push(s.id.clone()),
                Ok(false) => {}
                Err(e) => tracing::warn!(session = s.id, error = %e, "pausing an idle session"),
            }
        }
        paused
    }
}
