//! Checkpoint and restore of a task through containerd (runc's `checkpoint`/`restore`, which
//! run CRIU). Both go through files, never the content store: Tasks.Checkpoint writes CRIU's
//! images into a directory runner names (`CheckpointOptions.image_path`), and Tasks.Create
//! with `Options.criu_image_path` makes a task that Tasks.Start restores from one. Both
//! fields exist in containerd 1.6, 1.7 and 2.x for the runc shim (`io.containerd.runc.v2`).
//!
//! containerd-client does not compile runc's options, so the two messages are declared here
//! with their field numbers from `api/types/runc/options/oci.proto`; the type URL is the bare
//! message name, which containerd's typeurl resolves on 1.6 (gogo registry) and 2.x
//! (`FindMessageByURL`) alike.

use std::path::Path;

use containerd_client::services::v1 as svc;
use prost::Message;
use prost_types::Any;

use super::client::{Containerd, CtdError, Stdio, rpc};

/// `containerd.runc.v1.Options`, the fields restore needs.
#[derive(Clone, PartialEq, Message)]
struct RuncOptions {
    #[prost(string, tag = "10")]
    criu_image_path: String,
    #[prost(string, tag = "11")]
    criu_work_path: String,
}

/// `containerd.runc.v1.CheckpointOptions`, the fields runner sets.
#[derive(Clone, PartialEq, Message)]
struct CheckpointOptions {
    /// Stop the task after the dump (runner keeps it running: a fork's source lives on).
    #[prost(bool, tag = "1")]
    exit: bool,
    #[prost(string, tag = "8")]
    image_path: String,
    #[prost(string, tag = "9")]
    work_path: String,
}

fn any<M: Message>(name: &str, message: &M) -> Any {
    Any {
        type_url: name.to_string(),
        value: message.encode_to_vec(),
    }
}

fn path(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

impl Containerd {
    /// Dump task `id`'s processes and memory into `images` (CRIU's images; its log goes to
    /// `work`). The task keeps running — or stays frozen, when it was frozen before.
    pub async fn task_checkpoint(&self, id: &str, images: &Path, work: &Path) -> Result<(), CtdError> {
        let mut client = svc::tasks_client::TasksClient::new(self.channel.clone());
        let options = CheckpointOptions {
            exit: false,
            image_path: path(images),
            work_path: path(work),
        };
        client
            .checkpoint(self.request(svc::CheckpointTaskRequest {
                container_id: id.to_string(),
                parent_checkpoint: String::new(),
                options: Some(any("containerd.runc.v1.CheckpointOptions", &options)),
            }))
            .await
            .map_err(rpc("task checkpoint"))?;
        Ok(())
    }

    /// Tasks.Create for container `id` restoring CRIU's `images` at Tasks.Start (its log goes
    /// to `work`). The container's spec must name a rootfs (runner's remapped one) or be given
    /// `rootfs` mounts, as for a plain create.
    pub async fn task_create_restoring(
        &self,
        id: &str,
        rootfs: Vec<containerd_client::types::Mount>,
        stdio: &Stdio,
        images: &Path,
        work: &Path,
    ) -> Result<u32, CtdError> {
        let options = RuncOptions {
            criu_image_path: path(images),
            criu_work_path: path(work),
        };
        let options = any("containerd.runc.v1.Options", &options);
        self.task_create_with(id, rootfs, stdio, Some(options), "task create (restoring)")
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wire form of the fields runner sets, as runc's options proto numbers them.
    #[test]
    fn options_encode_with_runc_field_numbers() {
        let o = RuncOptions {
            criu_image_path: "/i".into(),
            criu_work_path: "/w".into(),
        };
        // field 10, wire type 2 = (10 << 3) | 2 = 82; field 11 = 90.
        assert_eq!(o.encode_to_vec(), vec![82, 2, b'/', b'i', 90, 2, b'/', b'w']);
        let c = CheckpointOptions {
            exit: false,
            image_path: "/i".into(),
            work_path: "/w".into(),
        };
        // field 8 = 66, field 9 = 74; `exit: false` is not sent (proto3 default).
        assert_eq!(c.encode_to_vec(), vec![66, 2, b'/', b'i', 74, 2, b'/', b'w']);
    }
}
