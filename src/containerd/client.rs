//! A typed facade over containerd's generated gRPC clients. This module is the only place
//! that names containerd services or `tonic::Code`. Every request carries the namespace
//! header (and the lease header where one is given); every message is filled completely
//! before it is sent, because containerd 1.6 crashes on some malformed requests
//! (docs/containerd-notes.md).

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
/// Content write chunk (containerd's own clients use 1 MiB).
const WRITE_CHUNK: usize = 1 << 20;

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

fn rpc(op: &'static str) -> impl Fn(tonic::Status) -> CtdError {
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

/// A blob's bytes as they arrive.
pub type ByteStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<bytes::Bytes, std::io::Error>> + Send + 'static>>;

/// What `content_ingest` writes: a blob, under an ingest ref, in a lease.
pub struct IngestBlob<'a> {
    pub lease: &'a str,
    /// The ingest's ref: the same ref resumes (and excludes other writers).
    pub reference: &'a str,
    pub digest: &'a str,
    pub size: u64,
    /// Labels the committed blob gets.
    pub labels: HashMap<String, String>,
}

/// How a `content_ingest` ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ingest {
    /// The blob is in the store (written now, or by another writer).
    Committed,
    /// Another writer holds the ingest: wait for it, then look again.
    Locked,
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
    channel: Channel,
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

    fn request<T>(&self, msg: T) -> Request<T> {
        let mut req = Request::new(msg);
        if let Ok(v) = self.namespace.parse() {
            req.metadata_mut().insert(NAMESPACE_HEADER, v);
        }
        req
    }

    fn leased<T>(&self, msg: T, lease: Option<&str>) -> Request<T> {
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

    // ---- content

    pub async fn content_info(&self, digest: &str) -> Result<Option<svc::Info>, CtdError> {
        let mut client = svc::content_client::ContentClient::new(self.channel.clone());
        match client
            .info(self.request(svc::InfoRequest {
                digest: digest.to_string(),
            }))
            .await
        {
            Ok(r) => Ok(r.into_inner().info),
            Err(s) if s.code() == Code::NotFound => Ok(None),
            Err(s) => Err(rpc("content info")(s)),
        }
    }

    /// Write a blob from a reader, committed with `labels`. The digest is verified by
    /// containerd on commit. AlreadyExists counts as success.
    pub async fn content_write(
        &self,
        lease: &str,
        digest: &str,
        size: u64,
        mut data: impl tokio::io::AsyncRead + Unpin + Send + 'static,
        labels: HashMap<String, String>,
        mut progress: impl FnMut(u64) + Send,
    ) -> Result<(), CtdError> {
        use tokio::io::AsyncReadExt;
        let mut client = svc::content_client::ContentClient::new(self.channel.clone());
        let (tx, rx) = tokio::sync::mpsc::channel::<svc::WriteContentRequest>(4);
        // One ref per writer: concurrent imports of the same blob must not contend for a
        // ref lock; containerd dedups by digest at commit (AlreadyExists).
        let reference = format!("runner-{lease}-{digest}");
        let total = size as i64;
        let expected = digest.to_string();
        let feeder_ref = reference.clone();
        let feeder = tokio::spawn(async move {
            let mut offset: i64 = 0;
            let mut buf = vec![0u8; WRITE_CHUNK];
            loop {
                let mut filled = 0;
                while filled < buf.len() {
                    let n = data.read(&mut buf[filled..]).await?;
                    if n == 0 {
                        break;
                    }
                    filled += n;
                }
                if filled == 0 {
                    break;
                }
                let msg = svc::WriteContentRequest {
                    action: svc::WriteAction::Write as i32,
                    r#ref: feeder_ref.clone(),
                    total,
                    expected: expected.clone(),
                    offset,
                    data: buf[..filled].to_vec(),
                    labels: HashMap::new(),
                };
                offset += filled as i64;
                if tx.send(msg).await.is_err() {
                    return Ok::<i64, std::io::Error>(offset);
                }
                if filled < buf.len() {
                    break;
                }
            }
            let commit = svc::WriteContentRequest {
                action: svc::WriteAction::Commit as i32,
                r#ref: feeder_ref,
                total,
                expected,
                offset,
                data: Vec::new(),
                labels,
            };
            let _ = tx.send(commit).await;
            Ok(offset)
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        let result = client.write(self.leased(stream, Some(lease))).await;
        let mut responses = match result {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == Code::AlreadyExists => {
                feeder.abort();
                return Ok(());
            }
            Err(s) => {
                feeder.abort();
                return Err(rpc("content write")(s));
            }
        };
        loop {
            match responses.next().await {
                Some(Ok(r)) => {
                    progress(r.offset.max(0) as u64);
                    if r.action == svc::WriteAction::Commit as i32 {
                        break;
                    }
                }
                // Another writer committed the same digest first: the content is there.
                Some(Err(s)) if s.code() == Code::AlreadyExists => {
                    feeder.abort();
                    return Ok(());
                }
                Some(Err(s)) => {
                    feeder.abort();
                    return Err(rpc("content write")(s));
                }
                None => break,
            }
        }
        let fed = feeder.await;
        if !matches!(fed, Ok(Ok(written)) if written == total) && self.content_info(digest).await?.is_some() {
            // containerd ended our write because another writer committed the same blob.
            return Ok(());
        }
        match fed {
            Ok(Ok(written)) if written == total => Ok(()),
            Ok(Ok(written)) => Err(CtdError::Protocol {
                op: "content write",
                message: format!("{digest}: read {written} bytes, expected {total}"),
            }),
            Ok(Err(source)) => Err(CtdError::Io {
                what: format!("reading blob {digest}"),
                source,
            }),
            Err(e) => Err(CtdError::Protocol {
                op: "content write",
                message: e.to_string(),
            }),
        }
    }

    /// Write a blob under a fixed ingest `reference`, resumably: containerd keeps a partial
    /// ingest under its ref, and only one writer may hold a ref at a time. The first message
    /// asks for the ingest's state, which takes the ref's lock *before* `open` is called with
    /// the offset already stored; `open` returns the offset its stream really starts at (that
    /// offset, or 0 to start over) and the bytes. A ref another writer holds gives
    /// `Ingest::Locked` and `open` is never called, so two pulls of one blob download it once.
    /// containerd checks size and digest at commit; a blob that fails them is aborted, so a
    /// later write never resumes bad bytes. A stream that breaks leaves the ingest to resume.
    pub async fn content_ingest<F, Fut>(
        &self,
        blob: IngestBlob<'_>,
        open: F,
        mut progress: impl FnMut(u64) + Send,
    ) -> Result<Ingest, CtdError>
    where
        F: FnOnce(u64) -> Fut,
        Fut: std::future::Future<Output = Result<(u64, ByteStream), CtdError>>,
    {
        let IngestBlob {
            lease,
            reference,
            digest,
            size,
            labels,
        } = blob;
        let mut client = svc::content_client::ContentClient::new(self.channel.clone());
        let (tx, rx) = tokio::sync::mpsc::channel::<svc::WriteContentRequest>(4);
        let total = size as i64;
        let message = |action: svc::WriteAction, offset: i64, data: Vec<u8>, labels| svc::WriteContentRequest {
            action: action as i32,
            r#ref: reference.to_string(),
            total,
            expected: digest.to_string(),
            offset,
            data,
            labels,
        };
        let _ = tx
            .send(message(svc::WriteAction::Stat, 0, Vec::new(), HashMap::new()))
            .await;
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        let locked = |s: &tonic::Status| s.code() == Code::Unavailable && s.message().contains("locked");
        let mut responses = match client.write(self.leased(stream, Some(lease))).await {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == Code::AlreadyExists => return Ok(Ingest::Committed),
            Err(s) if locked(&s) => return Ok(Ingest::Locked),
            Err(s) => return Err(rpc("content write")(s)),
        };
        let stored = match responses.next().await {
            Some(Ok(r)) => r.offset.max(0) as u64,
            Some(Err(s)) if s.code() == Code::AlreadyExists => return Ok(Ingest::Committed),
            Some(Err(s)) if locked(&s) => return Ok(Ingest::Locked),
            Some(Err(s)) => return Err(rpc("content write")(s)),
            None => {
                return Err(CtdError::Protocol {
                    op: "content write",
                    message: format!("{reference}: no answer to the status request"),
                });
            }
        };
        let (start, mut body) = open(stored.min(size)).await?;
        progress(start);
        let commit = message(svc::WriteAction::Commit, 0, Vec::new(), labels);
        let write = message(svc::WriteAction::Write, 0, Vec::new(), HashMap::new());
        let feeder = tokio::spawn(async move {
            let mut offset = start as i64;
            let mut buf: Vec<u8> = Vec::with_capacity(WRITE_CHUNK);
            loop {
                let chunk = body.next().await.transpose()?;
                if let Some(c) = &chunk {
                    buf.extend_from_slice(c);
                }
                if buf.len() >= WRITE_CHUNK || (chunk.is_none() && !buf.is_empty()) {
                    let data = std::mem::replace(&mut buf, Vec::with_capacity(WRITE_CHUNK));
                    let n = data.len() as i64;
                    let msg = svc::WriteContentRequest {
                        offset,
                        data,
                        ..write.clone()
                    };
                    if tx.send(msg).await.is_err() {
                        return Ok::<i64, std::io::Error>(offset);
                    }
                    offset += n;
                }
                if chunk.is_none() {
                    break;
                }
            }
            let _ = tx.send(svc::WriteContentRequest { offset, ..commit }).await;
            Ok(offset)
        });
        let outcome = loop {
            match responses.next().await {
                Some(Ok(r)) => {
                    progress(r.offset.max(0) as u64);
                    if r.action == svc::WriteAction::Commit as i32 {
                        break Ok(());
                    }
                }
                Some(Err(s)) if s.code() == Code::AlreadyExists => break Ok(()),
                Some(Err(s)) => break Err(s),
                None => break Ok(()),
            }
        };
        let fed = feeder.await;
        match (outcome, fed) {
            (Ok(()), Ok(Ok(written))) if written == total => Ok(Ingest::Committed),
            (Ok(()), _) if self.content_info(digest).await?.is_some() => Ok(Ingest::Committed),
            (_, Ok(Err(source))) => Err(CtdError::Io {
                what: format!("downloading {digest}"),
                source,
            }),
            (Err(s), _) => {
                // Wrong size or digest: these bytes must never be resumed.
                if matches!(
                    s.code(),
                    Code::FailedPrecondition | Code::InvalidArgument | Code::OutOfRange
                ) {
                    self.content_abort(reference).await;
                }
                Err(rpc("content write")(s))
            }
            (Ok(()), Ok(Ok(written))) => {
                self.content_abort(reference).await;
                Err(CtdError::Protocol {
                    op: "content write",
                    message: format!("{digest}: got {written} bytes, the descriptor says {total}"),
                })
            }
            (Ok(()), Err(e)) => Err(CtdError::Protocol {
                op: "content write",
                message: e.to_string(),
            }),
        }
    }

    /// Drop an unfinished ingest (best effort: one that is gone is what we want).
    pub async fn content_abort(&self, reference: &str) {
        let mut client = svc::content_client::ContentClient::new(self.channel.clone());
        if let Err(s) = client
            .abort(self.request(svc::AbortRequest {
                r#ref: reference.to_string(),
            }))
            .await
            && s.code() != Code::NotFound
        {
            tracing::warn!(reference, error = %s, "could not abort an ingest");
        }
    }

    /// The unfinished ingests (`ctr content active`).
    pub async fn content_active(&self) -> Result<Vec<svc::Status>, CtdError> {
        let mut client = svc::content_client::ContentClient::new(self.channel.clone());
        Ok(client
            .list_statuses(self.request(svc::ListStatusesRequest { filters: Vec::new() }))
            .await
            .map_err(rpc("content statuses"))?
            .into_inner()
            .statuses)
    }

    /// Read a blob as a stream of chunks (for pushing large layers without holding them).
    pub async fn content_stream(&self, digest: &str) -> Result<ByteStream, CtdError> {
        let mut client = svc::content_client::ContentClient::new(self.channel.clone());
        let stream = client
            .read(self.request(svc::ReadContentRequest {
                digest: digest.to_string(),
                offset: 0,
                size: 0,
            }))
            .await
            .map_err(rpc("content read"))?
            .into_inner();
        Ok(Box::pin(stream.map(|chunk| {
            chunk
                .map(|c| bytes::Bytes::from(c.data))
                .map_err(|s| std::io::Error::other(s.message().to_string()))
        })))
    }

    pub async fn content_read(&self, digest: &str) -> Result<Vec<u8>, CtdError> {
        let mut client = svc::content_client::ContentClient::new(self.channel.clone());
        let mut stream = client
            .read(self.request(svc::ReadContentRequest {
                digest: digest.to_string(),
                offset: 0,
                size: 0,
            }))
            .await
            .map_err(rpc("content read"))?
            .into_inner();
        let mut out = Vec::new();
        while let Some(chunk) = stream.next().await {
            out.extend_from_slice(&chunk.map_err(rpc("content read"))?.data);
        }
        Ok(out)
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
            snapshotter: SNAPSHOTTER.into(),
            snapshot_key: id.to_string(),
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
                Some(lease),
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
                options: None,
                runtime_path: String::new(),
            }))
            .await
            .map_err(rpc("task create"))?
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
        let mut client = svc::tasks_client::TasksClient::new(self.channel.clone());
        client
            .exec(self.request(svc::ExecProcessRequest {
                container_id: id.to_string(),
                stdin: stdio.stdin.clone(),
                stdout: stdio.stdout.clone(),
                stderr: stdio.stderr.clone(),
                terminal: false,
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
