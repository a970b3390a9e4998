//! A session's resource use now (see `runtime::usage`), with its current CPU rate.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::Session;
use crate::runtime::usage::{self, Usage};
use crate::service::{Context, Invalid, ServiceError};

/// How long the CPU rate is measured over.
pub const RATE_WINDOW: Duration = Duration::from_millis(200);

/// What `GET /v1/sessions/{id}/metrics` answers.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxMetrics {
    #[serde(flatten)]
    pub usage: Usage,
    /// CPUs' worth of time it used over the last `rateWindowMs` (1.0: one CPU busy).
    pub cpu_cores: f64,
    pub rate_window_ms: u64,
}

impl Session {
    /// The sandbox's cgroup, or why there is none to read.
    fn cgroup_path(&self) -> Result<String, ServiceError> {
        self.runtime.cgroup().map(|c| c.path).ok_or_else(|| {
            ServiceError::Invalid(Invalid::Unsupported(
                "host sessions have no cgroup of their own to measure (containerd sessions do)".into(),
            ))
        })
    }

    /// Counters now, without a rate (for `/metrics`); `None` once the sandbox is gone.
    pub async fn usage(&self) -> Result<Option<Usage>, ServiceError> {
        let cgroup = self.cgroup_path()?;
        Context::blocking(move || Ok(usage::read(&cgroup))).await
    }

    /// Counters now, and the CPU rate over [`RATE_WINDOW`].
    pub async fn metrics(&self) -> Result<SandboxMetrics, ServiceError> {
        let gone = || ServiceError::Conflict(format!("session {}'s sandbox is gone", self.id));
        let cgroup = self.cgroup_path()?;
        let first = {
            let cgroup = cgroup.clone();
            Context::blocking(move || Ok(usage::read(&cgroup)))
                .await?
                .ok_or_else(gone)?
        };
        let began = Instant::now();
        tokio::time::sleep(RATE_WINDOW).await;
        let second = Context::blocking(move || Ok(usage::read(&cgroup)))
            .await?
            .ok_or_else(gone)?;
        let took = began.elapsed();
        Ok(SandboxMetrics {
            cpu_cores: ((second.cpu_seconds - first.cpu_seconds) / took.as_secs_f64()).max(0.0),
            rate_window_ms: took.as_millis() as u64,
            usage: second,
        })
    }
}

impl super::SessionManager {
    /// Every live session, without leasing it (reading its counters is no use of it: its idle
    /// time keeps counting).
    pub fn live(&self) -> Vec<std::sync::Arc<Session>> {
        self.sessions.lock().expect("sessions lock").values().cloned().collect()
    }
}
