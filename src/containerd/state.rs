//! A sandbox's state through the facade: freezing and thawing a task (containerd's
//! Tasks.Pause/Resume, which runc does with the cgroup freezer on v1 and `cgroup.freeze` on
//! v2: nothing here depends on the hierarchy), and what a snapshot takes on disk.

use containerd_client::services::v1::{self as svc, snapshots as snap};

use super::client::{Containerd, CtdError, SNAPSHOTTER, rpc};

impl Containerd {
    /// Freeze every process of a container's task.
    pub async fn task_pause(&self, id: &str) -> Result<(), CtdError> {
        let mut client = svc::tasks_client::TasksClient::new(self.channel.clone());
        client
            .pause(self.request(svc::PauseTaskRequest {
                container_id: id.to_string(),
            }))
            .await
            .map_err(rpc("task pause"))?;
        Ok(())
    }

    /// Thaw a container's task.
    pub async fn task_resume(&self, id: &str) -> Result<(), CtdError> {
        let mut client = svc::tasks_client::TasksClient::new(self.channel.clone());
        client
            .resume(self.request(svc::ResumeTaskRequest {
                container_id: id.to_string(),
            }))
            .await
            .map_err(rpc("task resume"))?;
        Ok(())
    }

    /// Bytes a snapshot takes on disk (its own layer, not its parents').
    pub async fn snapshot_usage(&self, key: &str) -> Result<u64, CtdError> {
        let mut client = snap::snapshots_client::SnapshotsClient::new(self.channel.clone());
        let usage = client
            .usage(self.request(snap::UsageRequest {
                snapshotter: SNAPSHOTTER.into(),
                key: key.to_string(),
            }))
            .await
            .map_err(rpc("snapshot usage"))?
            .into_inner();
        Ok(u64::try_from(usage.size).unwrap_or(0))
    }
}
