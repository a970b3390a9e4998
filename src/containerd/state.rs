//! A sandbox's state through the facade: freezing and thawing a task (containerd's
//! Tasks.Pause/Resume, which runc does with the cgroup freezer on v1 and `cgroup.freeze` on
//! v2: nothing here depends on the hierarchy), and the Diff service's Compare (a snapshot's
//! changes as a layer blob in the content store).

use std::collections::HashMap;

use containerd_client::services::v1 as svc;
use containerd_client::types::{Descriptor, Mount};

use super::client::{Containerd, CtdError, rpc};

/// Media type of an uncompressed OCI layer.
pub const LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
/// Media type of a gzip-compressed OCI layer.
pub const LAYER_TAR_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

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

    /// The changes between two mounts (`lower` → `upper`) as a layer blob of `media_type`,
    /// written to the content store under `lease` with `labels`; its descriptor (digest of
    /// the blob as stored). The uncompressed digest is in the answer's
    /// `containerd.io/uncompressed` annotation when the blob is compressed.
    pub async fn diff_compare(
        &self,
        lease: &str,
        lower: Vec<Mount>,
        upper: Vec<Mount>,
        media_type: &str,
        reference: &str,
        labels: HashMap<String, String>,
    ) -> Result<Descriptor, CtdError> {
        // Like Apply, an incomplete Compare is refused here rather than sent.
        if lower.is_empty() || upper.is_empty() || media_type.is_empty() {
            return Err(CtdError::Protocol {
                op: "diff compare",
                message: "refusing to send an incomplete request".into(),
            });
        }
        let mut client = svc::diff_client::DiffClient::new(self.channel.clone());
        client
            .diff(self.leased(
                svc::DiffRequest {
                    left: lower,
                    right: upper,
                    media_type: media_type.to_string(),
                    r#ref: reference.to_string(),
                    labels,
                    source_date_epoch: None,
                },
                Some(lease),
            ))
            .await
            .map_err(rpc("diff compare"))?
            .into_inner()
            .diff
            .ok_or(CtdError::Protocol {
                op: "diff compare",
                message: "no descriptor in the answer".into(),
            })
    }
}
