//! A typed facade over containerd's generated gRPC clients. This module is the only place
//! that names containerd services or `tonic::Code`. Every request carries the namespace
//! header (and the lease header where one is given); every message is filled completely
//! before it is sent, because containerd 1.6 crashes on some malformed requests
//! (docs/design/containerd.md, "What containerd does that this code relies on").

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use containerd_client::services::v1::{
    self as svc, Container, container::Runtime as ContainerRuntime, snapshots as snap,
};
use containerd_client::types::{Descriptor, Mount};
use prost_types::Any;
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tonic::{Code, Request};

/// Metadata key of the namespace every request is scoped to.
const NAMESPACE_HEADER: &str = "containerd-namespace";
/// Metadata key that adds what a request creates to a lease.
const LEASE_HEADER: &str = "containerd-lease";
/// The snapshotter images are unpacked into and containers run on.
pub const SNAPSHOTTER: &str = "overlayfs";
/// The runtime shim.
pub const RUNTIME: &str = "io.containerd.runc.v2";
/// Type URL of a runtime spec inside an `Any` (containerd's typeurl registration).
pub const SPEC_TYPE_URL: &str = "types.containerd.io/opencontainers/runtime-spec/1/Spec";
/// Type URL of an exec process spec.
pub const PROCESS_TYPE_URL: &str = "types.containerd.io/opencontainers/runtime-spec/1/Process";
/// Lease label that lets containerd's GC drop a lease we failed to delete.
pub const LEASE_EXPIRE_LABEL: &str = "containerd.io/gc.expire";

#[derive(Debug, thiserror::Error)]
pub enum CtdError {
    #[error(
        "cannot reach containerd at {address}: {reason}. Start one (`runner daemon start`, or `systemctl start containerd`) or pass --address"
    )]
    Unreachable { address: PathBuf, reason: String },
    #[error("containerd {op}: {message} ({code:?})")]
    Rpc {
        op: &'static str,
        code: Code,
        message: String,
    },
    #[error("{op}: {message}")]
    Protocol { op: &'static str, message: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

impl CtdError {
    pub fn is_not_found(&self) -> bool {
        matches!(
            self,
            CtdError::Rpc {
                code: Code::NotFound,
                ..
            }
        )
    }
    pub fn is_already_exists(&self) -> bool {
        matches!(
            self,
            CtdError::Rpc {
                code: Code::AlreadyExists,
                ..
            }
        )
    }
    /// The daemon went away or restarted mid-call: worth retrying once reconnected.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            CtdError::Rpc {
                code: Code::Unavailable,
                ..
            } | CtdError::Unreachable { .. }
        )
    }
}

pub(super) fn rpc(op: &'static str) -> impl Fn(tonic::Status) -> CtdError {
    move |s| CtdError::Rpc {
        op,
        code: s.code(),
        message: s.message().to_string(),
    }
}

/// Treat NotFound as success (teardown of something already gone).
pub fn ignore_not_found(r: Result<(), CtdError>) -> Result<(), CtdError> {
    match r {
        Err(e) if e.is_not_found() => Ok(()),
        other => other,
    }
}

/// Exit of a task or exec process as containerd reports it (signals as 128 + n).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exit {
    pub status: u32,
}

/// stdio paths of a process (empty = not connected).
#[derive(Clone, Debug, Default)]
pub struct Stdio {
    pub stdin: String,
    pub stdout: String,
    pub stderr: String,
}

#[derive(Clone)]
pub struct Containerd {
    pub(super) channel: Channel,
    namespace: String,
    address: PathBuf,
}

impl std::fmt::Debug for Containerd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Containerd")
            .field("address", &self.address)
            .field("namespace", &self.namespace)
            .finish()
    }
}

impl Containerd {
    /// Connect and prove the daemon answers (Version).
    pub async fn connect(address: &Path, namespace: &str) -> Result<Self, CtdError> {
        let unreachable = |reason: String| CtdError::Unreachable {
            address: address.to_path_buf(),
            reason,
        };
        if !address.exists() {
            return Err(unreachable("no socket there".into()));
        }
        let channel = tokio::time::timeout(Duration::from_secs(5), containerd_client::connect(address))
            .await
            .map_err(|_| unreachable("timed out connecting".into()))?
            .map_err(|e| unreachable(e.to_string()))?;
        let client = Containerd {
            channel,
            namespace: namespace.to_string(),
            address: address.to_path_buf(),
        };
        client.version().await.map_err(|e| unreachable(e.to_string()))?;
        Ok(client)
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    pub fn address(&self) -> &Path {
        &self.address
    }

    pub(super) fn request<T>(&self, msg: T) -> Request<T> {
        let mut req = Request::new(msg);
        if let Ok(v) = self.namespace.parse() {
            req.metadata_mut().insert(NAMESPACE_HEADER, v);
        }
        req
    }

    pub(super) fn leased<T>(&self, msg: T, lease: Option<&str>) -> Request<T> {
        let mut req = self.request(msg);
        if let Some(v) = lease.and_then(|l| l.parse().ok()) {
            req.metadata_mut().insert(LEASE_HEADER, v);
        }
        req
    }

    /// containerd's version and the commit it was built from.
    pub async fn version(&self) -> Result<(String, String), CtdError> {
        let mut client = svc::version_client::VersionClient::new(self.channel.clone());
        let v = client.version(()).await.map_err(rpc("version"))?.into_inner();
        Ok((v.version, v.revision))
    }

    // ---- leases

    pub async fn lease_create(&self, id: &str, labels: HashMap<String, String>) -> Result<(), CtdError> {
        let mut client = svc::leases_client::LeasesClient::new(self.channel.clone());
        client
            .create(self.request(svc::CreateRequest {
                id: id.to_string(),
                labels,
            }))
            .await
            .map_err(rpc("lease create"))?;
        Ok(())
    }

    pub async fn lease_delete(&self, id: &str) -> Result<(), CtdError> {
        let mut client = svc::leases_client::LeasesClient::new(self.channel.clone());
        let r = client
            .delete(self.request(svc::DeleteRequest {
                id: id.to_string(),
                sync: false,
            }))
            .await
            .map_err(rpc("lease delete"));
        ignore_not_found(r.map(|_| ()))
    }

    /// Delete a lease and wait for the garbage collection it triggers.
    pub async fn lease_delete_sync(&self, id: &str) -> Result<(), CtdError> {
        let mut client = svc::leases_client::LeasesClient::new(self.channel.clone());
        client
            .delete(self.request(svc::DeleteRequest {
                id: id.to_string(),
                sync: true,
            }))
            .await
            .map_err(rpc("lease delete"))?;
        Ok(())
    }

    pub async fn leases(&self, filters: Vec<String>) -> Result<Vec<svc::Lease>, CtdError> {
        let mut client = svc::leases_client::LeasesClient::new(self.channel.clone());
        Ok(client
            .list(self.request(svc::ListRequest { filters }))
            .await
            .map_err(rpc("lease list"))?
            .into_inner()
            .leases)
    }

    // ---- images

    /// Create or update the image record `name` → `target`.
    pub async fn image_put(
        &self,
        name: &str,
        target: Descriptor,
        labels: HashMap<String, String>,
    ) -> Result<(), CtdError> {
        let mut client = svc::images_client::ImagesClient::new(self.channel.clone());
        let image = svc::Image {
            name: name.to_string(),
            labels,
            target: Some(target),
            created_at: None,
            updated_at: None,
        };
        let created = client
            .create(self.request(svc::CreateImageRequest {
                image: Some(image.clone()),
                source_date_epoch: None,
            }))
            .await;
        match created {
            Ok(_) => Ok(()),
            Err(s) if s.code() == Code::AlreadyExists => {
                client
                    .update(self.request(svc::UpdateImageRequest {
                        image: Some(image),
                        update_mask: None,
                        source_date_epoch: None,
                    }))
                    .await
                    .map_err(rpc("image update"))?;
                Ok(())
            }
            Err(s) => Err(rpc("image create")(s)),
        }
    }

    pub async fn image_get(&self, name: &str) -> Result<Option<svc::Image>, CtdError> {
        let mut client = svc::images_client::ImagesClient::new(self.channel.clone());
        match client
            .get(self.request(svc::GetImageRequest { name: name.to_string() }))
            .await
        {
            Ok(r) => Ok(r.into_inner().image),
            Err(s) if s.code() == Code::NotFound => Ok(None),
            Err(s) => Err(rpc("image get")(s)),
        }
    }

    pub async fn images(&self) -> Result<Vec<svc::Image>, CtdError> {
        let mut client = svc::images_client::ImagesClient::new(self.channel.clone());
        Ok(client
            .list(self.request(svc::ListImagesRequest { filters: vec![] }))
            .await
            .map_err(rpc("image list"))?
            .into_inner()
            .images)
    }

    pub async fn image_delete(&self, name: &str) -> Result<(), CtdError> {
        let mut client = svc::images_client::ImagesClient::new(self.channel.clone());
        client
            .delete(self.request(svc::DeleteImageRequest {
                name: name.to_string(),
                sync: true,
                target: None,
            }))
            .await
            .map_err(rpc("image delete"))?;
        Ok(())
    }

    // ---- snapshots

    pub async fn snapshot_stat(&self, key: &str) -> Result<Option<snap::Info>, CtdError> {
        let mut client = snap::snapshots_client::SnapshotsClient::new(self.channel.clone());
        match client
            .stat(self.request(snap::StatSnapshotRequest {
                snapshotter: SNAPSHOTTER.into(),
                key: key.to_string(),
            }))
            .await
        {
            Ok(r) => Ok(r.into_inner().info),
            Err(s) if s.code() == Code::NotFound => Ok(None),
            Err(s) => Err(rpc("snapshot stat")(s)),
        }
    }

    pub async fn snapshot_prepare(
        &self,
        lease: &str,
        key: &str,
        parent: &str,
        labels: HashMap<String, String>,
    ) -> Result<Vec<Mount>, CtdError> {
        let mut client = snap::snapshots_client::SnapshotsClient::new(self.channel.clone());
        Ok(client
            .prepare(self.leased(
                snap::PrepareSnapshotRequest {
                    snapshotter: SNAPSHOTTER.into(),
                    key: key.to_string(),
                    parent: parent.to_string(),
                    labels,
                },
                Some(lease),
            ))
            .await
            .map_err(rpc("snapshot prepare"))?
            .into_inner()
            .mounts)
    }

    pub async fn snapshot_mounts(&self, key: &str) -> Result<Vec<Mount>, CtdError> {
        let mut client = snap::snapshots_client::SnapshotsClient::new(self.channel.clone());
        Ok(client
            .mounts(self.request(snap::MountsRequest {
                snapshotter: SNAPSHOTTER.into(),
                key: key.to_string(),
            }))
            .await
            .map_err(rpc("snapshot mounts"))?
            .into_inner()
            .mounts)
    }

    pub async fn snapshot_commit(
        &self,
        lease: &str,
        name: &str,
        key: &str,
        labels: HashMap<String, String>,
    ) -> Result<(), CtdError> {
        let mut client = snap::snapshots_client::SnapshotsClient::new(self.channel.clone());
        client
            .commit(self.leased(
                snap::CommitSnapshotRequest {
                    snapshotter: SNAPSHOTTER.into(),
                    name: name.to_string(),
                    key: key.to_string(),
                    labels,
                },
                Some(lease),
            ))
            .await
            .map_err(rpc("snapshot commit"))?;
        Ok(())
    }

    pub async fn snapshot_remove(&self, key: &str) -> Result<(), CtdError> {
        let mut client = snap::snapshots_client::SnapshotsClient::new(self.channel.clone());
        let r = client
            .remove(self.request(snap::RemoveSnapshotRequest {
                snapshotter: SNAPSHOTTER.into(),
                key: key.to_string(),
            }))
            .await
            .map(|_| ())
            .map_err(rpc("snapshot remove"));
        ignore_not_found(r)
    }

    pub async fn snapshots(&self, filters: Vec<String>) -> Result<Vec<snap::Info>, CtdError> {
        let mut client = snap::snapshots_client::SnapshotsClient::new(self.channel.clone());
        let mut stream = client
            .list(self.request(snap::ListSnapshotsRequest {
                snapshotter: SNAPSHOTTER.into(),
                filters,
            }))
            .await
            .map_err(rpc("snapshot list"))?
            .into_inner();
        let mut out = Vec::new();
        while let Some(page) = stream.next().await {
            out.extend(page.map_err(rpc("snapshot list"))?.info);
        }
        Ok(out)
    }

    // ---- diff

    /// Apply a layer blob onto prepared mounts; returns the applied (uncompressed) descriptor.
    pub async fn diff_apply(&self, layer: Descriptor, mounts: Vec<Mount>) -> Result<Descriptor, CtdError> {
        // containerd 1.6 dies on an Apply without a descriptor or mounts: never send one.
        if layer.digest.is_empty() || layer.media_type.is_empty() || mounts.is_empty() {
            return Err(CtdError::Protocol {
                op: "diff apply",
                message: "refusing to send an incomplete request".into(),
            });
        }
        let mut client = svc::diff_client::DiffClient::new(self.channel.clone());
        client
            .apply(self.request(svc::ApplyRequest {
                diff: Some(layer),
                mounts,
                payloads: HashMap::new(),
                sync_fs: false,
            }))
            .await
            .map_err(rpc("diff apply"))?
            .into_inner()
            .applied
            .ok_or(CtdError::Protocol {
                op: "diff apply",
                message: "no applied descriptor in the answer".into(),
            })
    }

    // ---- containers

    pub async fn container_create(
        &self,
        lease: &str,
        id: &str,
        image: &str,
        spec_json: Vec<u8>,
        labels: HashMap<String, String>,
    ) -> Result<(), CtdError> {
        self.create_record(Some(lease), id, image, true, spec_json, labels)
            .await
    }

    /// A container record with no image, snapshot or lease: its spec's root is a host
    /// directory (a warm shim's seed, `runtime::containerd::shim_seed`).
    pub async fn container_create_bare(
        &self,
        id: &str,
        spec_json: Vec<u8>,
        labels: HashMap<String, String>,
    ) -> Result<(), CtdError> {
        self.create_record(None, id, "", false, spec_json, labels).await
    }

    /// Containers.Create of runc's runtime; `snapshot`: its rootfs is the snapshot named
    /// after it.
    async fn create_record(
        &self,
        lease: Option<&str>,
        id: &str,
        image: &str,
        snapshot: bool,
        spec_json: Vec<u8>,
        labels: HashMap<String, String>,
    ) -> Result<(), CtdError> {
        let mut client = svc::containers_client::ContainersClient::new(self.channel.clone());
        let container = Container {
            id: id.to_string(),
            labels,
            image: image.to_string(),
            runtime: Some(ContainerRuntime {
                name: RUNTIME.into(),
                options: None,
            }),
            spec: Some(Any {
                type_url: SPEC_TYPE_URL.into(),
                value: spec_json,
            }),
            snapshotter: if snapshot { SNAPSHOTTER.into() } else { String::new() },
            snapshot_key: if snapshot { id.to_string() } else { String::new() },
            created_at: None,
            updated_at: None,
            extensions: HashMap::new(),
            sandbox: String::new(),
        };
        client
            .create(self.leased(
                svc::CreateContainerRequest {
                    container: Some(container),
                },
                lease,
            ))
            .await
            .map_err(rpc("container create"))?;
        Ok(())
    }

    pub async fn container_delete(&self, id: &str) -> Result<(), CtdError> {
        let mut client = svc::containers_client::ContainersClient::new(self.channel.clone());
        let r = client
            .delete(self.request(svc::DeleteContainerRequest { id: id.to_string() }))
            .await
            .map(|_| ())
            .map_err(rpc("container delete"));
        ignore_not_found(r)
    }

    /// Set some labels of a container (others are kept): one `labels.KEY` path per label.
    pub async fn container_set_labels(&self, id: &str, labels: HashMap<String, String>) -> Result<(), CtdError> {
        let mut client = svc::containers_client::ContainersClient::new(self.channel.clone());
        let paths = labels.keys().map(|k| format!("labels.{k}")).collect();
        let container = Container {
            id: id.to_string(),
            labels,
            ..Default::default()
        };
        client
            .update(self.request(svc::UpdateContainerRequest {
                container: Some(container),
                update_mask: Some(prost_types::FieldMask { paths }),
            }))
            .await
            .map_err(rpc("container update"))?;
        Ok(())
    }

    /// One container's record, or None when there is none of that id.
    pub async fn container(&self, id: &str) -> Result<Option<Container>, CtdError> {
        let mut client = svc::containers_client::ContainersClient::new(self.channel.clone());
        match client
            .get(self.request(svc::GetContainerRequest { id: id.to_string() }))
            .await
        {
            Ok(r) => Ok(r.into_inner().container),
            Err(e) if e.code() == tonic::Code::NotFound => Ok(None),
            Err(e) => Err(rpc("container get")(e)),
        }
    }

    pub async fn containers(&self, filters: Vec<String>) -> Result<Vec<Container>, CtdError> {
        let mut client = svc::containers_client::ContainersClient::new(self.channel.clone());
        Ok(client
            .list(self.request(svc::ListContainersRequest { filters }))
            .await
            .map_err(rpc("container list"))?
            .into_inner()
            .containers)
    }

    // ---- tasks

    pub async fn task_create(&self, id: &str, rootfs: Vec<Mount>, stdio: &Stdio) -> Result<u32, CtdError> {
        self.task_create_with(id, rootfs, stdio, None, "task create").await
    }

    /// Tasks.Create with runtime `options` (runc's, for a restore: `criu`).
    pub(super) async fn task_create_with(
        &self,
        id: &str,
        rootfs: Vec<Mount>,
        stdio: &Stdio,
        options: Option<Any>,
        op: &'static str,
    ) -> Result<u32, CtdError> {
        let mut client = svc::tasks_client::TasksClient::new(self.channel.clone());
        Ok(client
            .create(self.request(svc::CreateTaskRequest {
                container_id: id.to_string(),
                rootfs,
                stdin: stdio.stdin.clone(),
                stdout: stdio.stdout.clone(),
                stderr: stdio.stderr.clone(),
                terminal: false,
                checkpoint: None,
                options,
                runtime_path: String::new(),
            }))
            .await
            .map_err(rpc(op))?
            .into_inner()
            .pid)
    }

    pub async fn task_start(&self, id: &str, exec_id: &str) -> Result<u32, CtdError> {
        let mut client = svc::tasks_client::TasksClient::new(self.channel.clone());
        Ok(client
            .start(self.request(svc::StartRequest {
                container_id: id.to_string(),
                exec_id: exec_id.to_string(),
            }))
            .await
            .map_err(rpc("task start"))?
            .into_inner()
            .pid)
    }

    /// Block until the task (or exec process) exits.
    pub async fn task_wait(&self, id: &str, exec_id: &str) -> Result<Exit, CtdError> {
        let mut client = svc::tasks_client::TasksClient::new(self.channel.clone());
        let r = client
            .wait(self.request(svc::WaitRequest {
                container_id: id.to_string(),
                exec_id: exec_id.to_string(),
            }))
            .await
            .map_err(rpc("task wait"))?
            .into_inner();
        Ok(Exit { status: r.exit_status })
    }

    pub async fn task_kill(&self, id: &str, exec_id: &str, signal: u32, all: bool) -> Result<(), CtdError> {
        let mut client = svc::tasks_client::TasksClient::new(self.channel.clone());
        let r = client
            .kill(self.request(svc::KillRequest {
                container_id: id.to_string(),
                exec_id: exec_id.to_string(),
                signal,
                all,
            }))
            .await
            .map(|_| ())
            .map_err(rpc("task kill"));
        ignore_not_found(r)
    }

    pub async fn task_delete(&self, id: &str) -> Result<Option<Exit>, CtdError> {
        let mut client = svc::tasks_client::TasksClient::new(self.channel.clone());
        match client
            .delete(self.request(svc::DeleteTaskRequest {
                container_id: id.to_string(),
            }))
            .await
        {
            Ok(r) => Ok(Some(Exit {
                status: r.into_inner().exit_status,
            })),
            Err(s) if s.code() == Code::NotFound => Ok(None),
            Err(s) => Err(rpc("task delete")(s)),
        }
    }

    /// The task's state, or None when the container has no task.
    pub async fn task_get(&self, id: &str) -> Result<Option<containerd_client::types::v1::Process>, CtdError> {
        let mut client = svc::tasks_client::TasksClient::new(self.channel.clone());
        match client
            .get(self.request(svc::GetRequest {
                container_id: id.to_string(),
                exec_id: String::new(),
            }))
            .await
        {
            Ok(r) => Ok(r.into_inner().process),
            Err(s) if s.code() == Code::NotFound => Ok(None),
            Err(s) => Err(rpc("task get")(s)),
        }
    }

    pub async fn exec(&self, id: &str, exec_id: &str, process_json: Vec<u8>, stdio: &Stdio) -> Result<(), CtdError> {
        self.exec_process(id, exec_id, process_json, stdio, false).await
    }

    /// An exec process on a pseudo-terminal: runc allocates it inside the container (its own
    /// devpts) and hands the master to the shim, which copies between it and `stdio.stdin` /
    /// `stdio.stdout` (the spec's `process.terminal` must be true; stderr is unused).
    pub async fn exec_terminal(
        &self,
        id: &str,
        exec_id: &str,
        process_json: Vec<u8>,
        stdio: &Stdio,
    ) -> Result<(), CtdError> {
        self.exec_process(id, exec_id, process_json, stdio, true).await
    }

    /// Change the window size of an exec process's terminal.
    pub async fn resize_pty(&self, id: &str, exec_id: &str, cols: u32, rows: u32) -> Result<(), CtdError> {
        let mut client = svc::tasks_client::TasksClient::new(self.channel.clone());
        client
            .resize_pty(self.request(svc::ResizePtyRequest {
                container_id: id.to_string(),
                exec_id: exec_id.to_string(),
                width: cols,
                height: rows,
            }))
            .await
            .map_err(rpc("resize pty"))?;
        Ok(())
    }

    async fn exec_process(
        &self,
        id: &str,
        exec_id: &str,
        process_json: Vec<u8>,
        stdio: &Stdio,
        terminal: bool,
    ) -> Result<(), CtdError> {
        let mut client = svc::tasks_client::TasksClient::new(self.channel.clone());
        client
            .exec(self.request(svc::ExecProcessRequest {
                container_id: id.to_string(),
                stdin: stdio.stdin.clone(),
                stdout: stdio.stdout.clone(),
                stderr: stdio.stderr.clone(),
                terminal,
                spec: Some(Any {
                    type_url: PROCESS_TYPE_URL.into(),
                    value: process_json,
                }),
                exec_id: exec_id.to_string(),
            }))
            .await
            .map_err(rpc("task exec"))?;
        Ok(())
    }

    /// Close a process's stdin (the shim keeps it open until told).
    pub async fn close_stdin(&self, id: &str, exec_id: &str) -> Result<(), CtdError> {
        let mut client = svc::tasks_client::TasksClient::new(self.channel.clone());
        let r = client
            .close_io(self.request(svc::CloseIoRequest {
                container_id: id.to_string(),
                exec_id: exec_id.to_string(),
                stdin: true,
            }))
            .await
            .map(|_| ())
            .map_err(rpc("close io"));
        ignore_not_found(r)
    }

    pub async fn process_delete(&self, id: &str, exec_id: &str) -> Result<(), CtdError> {
        let mut client = svc::tasks_client::TasksClient::new(self.channel.clone());
        let r = client
            .delete_process(self.request(svc::DeleteProcessRequest {
                container_id: id.to_string(),
                exec_id: exec_id.to_string(),
            }))
            .await
            .map(|_| ())
            .map_err(rpc("process delete"));
        ignore_not_found(r)
    }
}
