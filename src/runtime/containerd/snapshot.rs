//! A sandbox's filesystem snapshot: its writable layer (the overlay upper directory of its
//! rootfs snapshot) written as one more layer on its base image (`layer`), made an image
//! (`image::commit`). The sandbox is frozen while its layer is read, so the layer is one
//! moment of it, and thawed after (a sandbox that was paused stays paused).
//!
//! What never goes into a snapshot: everything under the container's mount points (its
//! workspace, runner's agent directory and tools, /proc, /dev, /sys, late binds: their
//! contents are other filesystems, and the empty directories runc made for them in the
//! upper directory are left out too), and nothing runner keeps outside the rootfs (the run
//! directory, FIFOs, environment and secrets, which live in the spec, not in files).

use std::collections::HashMap;
use std::time::Instant;

use containerd_client::services::v1::Container;

use super::layer::{self, IdRange, IdShift, LayerLimits, LayerReport};
use super::*;
use crate::image::commit::{self as image_commit, Committed, NewLayer};
use crate::runtime::RuntimeError;

/// Label of a snapshot's image record: the snapshot's name.
pub const LABEL_SNAPSHOT: &str = "runner.dev/snapshot";
/// What it was taken of (a session, a Job attempt's container, an Environment's setup).
/// How a snapshot's layer file (beside the run directories, while it is made) is named.
pub const LAYER_FILE_PREFIX: &str = "snapshot-";
pub const LABEL_SNAPSHOT_SOURCE: &str = "runner.dev/snapshot-source";
/// The image it was made on.
pub const LABEL_SNAPSHOT_BASE: &str = "runner.dev/snapshot-base";
/// When it was made (RFC 3339).
pub const LABEL_SNAPSHOT_CREATED: &str = "runner.dev/snapshot-created";
/// Bytes of its layer blob.
pub const LABEL_SNAPSHOT_LAYER_BYTES: &str = "runner.dev/snapshot-layer-bytes";

/// How often a failed thaw after the walk is tried again, and how long apart.
const THAW_RETRIES: u32 = 5;
const THAW_RETRY_DELAY: std::time::Duration = std::time::Duration::from_millis(200);

/// containerd's `Status.RUNNING`.
const STATUS_RUNNING: i32 = 2;

/// What to make of a sandbox.
#[derive(Clone, Debug)]
pub struct CommitRequest {
    /// The image name to record.
    pub image: String,
    /// Labels of the image record.
    pub labels: HashMap<String, String>,
    /// What the image history says made it.
    pub created_by: String,
    pub limits: LayerLimits,
    /// The sandbox's workspace, to hold too (first in the layer, under the path it is
    /// mounted at).
    pub workspace: Option<WorkspaceSource>,
}

/// A sandbox's workspace: the host directory, and where the sandbox has it.
#[derive(Clone, Debug)]
pub struct WorkspaceSource {
    pub dir: std::path::PathBuf,
    pub target: String,
}

/// A snapshot made.
#[derive(Clone, Debug)]
pub struct CommitOutcome {
    pub image: Committed,
    /// The image it was made on.
    pub base: String,
    pub layer: LayerReport,
    /// How long the sandbox was frozen for it (zero when it was paused already).
    pub frozen_ms: u64,
    pub took_ms: u64,
}

impl Engine {
    /// Snapshot container `c` (a live one, or a running Job attempt's) as `request` says.
    pub async fn commit(&self, c: &Container, request: &CommitRequest) -> Result<CommitOutcome, RuntimeError> {
        let began = Instant::now();
        let spec: oci_spec::runtime::Spec = c
            .spec
            .as_ref()
            .ok_or_else(|| RuntimeError::Internal(format!("container {} has no spec", c.id)))
            .and_then(|any| {
                serde_json::from_slice(&any.value)
                    .map_err(|e| RuntimeError::Internal(format!("the spec of container {}: {e}", c.id)))
            })?;
        if c.snapshot_key.is_empty() || c.image.is_empty() {
            return Err(RuntimeError::Refused(format!(
                "container {} has no image snapshot to take",
                c.id
            )));
        }
        let info = self
            .client
            .snapshot_stat(&c.snapshot_key)
            .await?
            .ok_or_else(|| RuntimeError::Refused(format!("the rootfs of container {} is gone", c.id)))?;
        let mounts = self.client.snapshot_mounts(&c.snapshot_key).await?;
        let upper = remap::writable_layer(&mounts)
            .ok_or_else(|| RuntimeError::Internal(format!("container {}: no writable layer in its mounts", c.id)))?;
        let exclude: Vec<String> = spec
            .mounts()
            .iter()
            .flatten()
            .map(|m| m.destination().to_string_lossy().into_owned())
            .collect();
        let shift = id_shift(&spec);
        let section = match &request.workspace {
            Some(ws) => Some((ws.dir.clone(), ws.target.clone(), workspace_shift(&spec, &ws.dir)?)),
            None => None,
        };
        let file = tempfile::Builder::new()
            // Named by this process (see `reclaim::remove_orphan_layer_files`): a runner
            // that dies mid-snapshot leaves a file gc can tell is no one's.
            .prefix(&format!(
                "{LAYER_FILE_PREFIX}{}-",
                crate::owner::owner_id().replace(':', "_")
            ))
            .suffix(".tar")
            .tempfile_in(self.run_dir.parent().unwrap_or(&self.run_dir))
            .map_err(|source| RuntimeError::Io {
                what: "creating the snapshot's layer file".into(),
                source,
            })?;
        let reopen = || {
            file.reopen().map_err(|source| RuntimeError::Io {
                what: "opening the snapshot's layer file".into(),
                source,
            })
        };
        let (out, follower_file) = (reopen()?, reopen()?);
        let lease = image_commit::lease(&self.client).await?;
        // The layer goes to containerd's content store while it is written: a follower
        // reads the file behind the walk (which never waits for it) and the upload sends
        // what it reads; the digest and size go with the commit, once the walk has them.
        let growth = layer::Growth::default();
        let (chunks_tx, chunks_rx) = tokio::sync::mpsc::channel(4);
        let (end_tx, end_rx) = tokio::sync::oneshot::channel::<crate::containerd::BlobEnd>();
        let follower = {
            let growth = growth.clone();
            tokio::task::spawn_blocking(move || layer::follow(follower_file, &growth, FOLLOW_CHUNK, &chunks_tx))
        };
        let upload: image_commit::Upload = {
            let client = self.client.clone();
            let lease = lease.clone();
            let reference = format!("{lease}-layer");
            tokio::spawn(async move {
                client
                    .content_write_following(&lease, &reference, chunks_rx, end_rx)
                    .await
            })
        };
        let walk = Walk {
            upper,
            shift,
            section,
            exclude,
            out,
            growth,
            end: end_tx,
            upload,
        };
        let result = self
            .commit_walked(c, request, &info.parent, walk, &lease, file.path())
            .await;
        image_commit::release(&self.client, &lease).await;
        if let (Err(_), Ok(Err(e))) = (&result, follower.await) {
            tracing::warn!(error = %e, "reading the snapshot's layer file for its upload");
        }
        drop(file);
        let (image, report, frozen_ms) = result?;
        let took = began.elapsed();
        crate::metrics::observe(OPERATION_SECONDS, &[("op", "snapshot")], took);
        Ok(CommitOutcome {
            image,
            base: c.image.clone(),
            layer: report,
            frozen_ms,
            took_ms: took.as_millis() as u64,
        })
    }
}

/// Bytes of the layer sent to containerd per message (as its own clients send).
const FOLLOW_CHUNK: usize = 1 << 20;

/// A walk of a sandbox's writable layer into the layer file, and where the file goes.
struct Walk {
    upper: std::path::PathBuf,
    shift: IdShift,
    /// The workspace: its directory, its path in the container, how its ids are stored.
    section: Option<(std::path::PathBuf, String, IdShift)>,
    exclude: Vec<String>,
    out: std::fs::File,
    growth: layer::Growth,
    /// Tells the upload how the layer ended.
    end: tokio::sync::oneshot::Sender<crate::containerd::BlobEnd>,
    upload: image_commit::Upload,
}

impl Engine {
    /// Freeze the sandbox (unless paused or stopped), walk its layer into the file, thaw it,
    /// and make the image (on `base_chain`, in `lease`); the image, the layer and how long
    /// the sandbox was frozen.
    async fn commit_walked(
        &self,
        c: &Container,
        request: &CommitRequest,
        base_chain: &str,
        walk: Walk,
        lease: &str,
        layer_path: &std::path::Path,
    ) -> Result<(Committed, LayerReport, u64), RuntimeError> {
        let Walk {
            upper,
            shift,
            section,
            exclude,
            out,
            growth,
            end,
            upload,
        } = walk;
        let fail = |end: tokio::sync::oneshot::Sender<_>, growth: &layer::Growth, why: String| {
            growth.finish(false);
            let _ = end.send(Err(why));
        };
        // Frozen while its layer is read: one moment of the sandbox, and nothing it does can
        // race the walk. A paused sandbox stays paused (runner pauses through the cgroup's
        // freezer, which containerd does not see: the freezer is asked, not the task); a
        // stopped task has nothing to freeze.
        let cgroup = self.cgroup_path(&c.id);
        let running = matches!(self.client.task_get(&c.id).await, Ok(Some(p)) if p.status == STATUS_RUNNING);
        let freeze = running && matches!(freezer::state(&cgroup).await, Ok(Some(freezer::FreezeState::Thawed)));
        let frozen_at = Instant::now();
        if freeze && let Err(e) = freezer::freeze(&cgroup).await {
            fail(end, &growth, e.to_string());
            let _ = upload.await;
            return Err(e);
        }
        let limits = request.limits;
        let counting = growth.counting(out);
        let target = section.as_ref().map(|(_, target, _)| target.clone());
        let walked = tokio::task::spawn_blocking(move || {
            let section = section
                .as_ref()
                .map(|(dir, prefix, shift)| layer::Section { dir, prefix, shift });
            layer::write_layer(&upper, counting, &shift, &exclude, limits, section.as_ref())
        })
        .await;
        growth.finish(matches!(walked, Ok(Ok(_))));
        let frozen_ms = if freeze {
            // A sandbox left frozen would hold every later call: a failed thaw is tried again
            // before the snapshot gives up.
            let mut thawed = freezer::thaw(&cgroup).await;
            for _ in 0..THAW_RETRIES {
                if thawed.is_ok() {
                    break;
                }
                tokio::time::sleep(THAW_RETRY_DELAY).await;
                thawed = freezer::thaw(&cgroup).await;
            }
            let ms = frozen_at.elapsed().as_millis() as u64;
            if let Err(e) = thawed {
                fail(end, &growth, e.to_string());
                let _ = upload.await;
                return Err(e);
            }
            ms
        } else {
            0
        };
        let report = walked
            .map_err(|e| RuntimeError::Internal(format!("the snapshot task: {e}")))
            .and_then(|r| {
                r.map_err(|e| match e {
                    layer::LayerError::TooLarge { .. } | layer::LayerError::Changed { .. } => {
                        RuntimeError::Refused(format!("snapshot of {}: {e}", c.id))
                    }
                    e => RuntimeError::Internal(format!("snapshot of {}: {e}", c.id)),
                })
            });
        let report = match report {
            Ok(r) => r,
            Err(e) => {
                fail(end, &growth, e.to_string());
                let _ = upload.await;
                return Err(e);
            }
        };
        tracing::debug!(frozen_ms, bytes = report.size, "snapshot layer written");
        let _ = end.send(Ok((
            report.digest.clone(),
            report.size,
            image_commit::layer_labels(&report.digest),
        )));
        let new_layer = NewLayer {
            path: layer_path,
            digest: &report.digest,
            size: report.size,
            created_by: request.created_by.clone(),
            workspace: target.map(|t| (t, report.section_bytes)),
        };
        let mut labels = request.labels.clone();
        labels.insert(LABEL_SNAPSHOT_LAYER_BYTES.into(), report.size.to_string());
        let image = image_commit::commit(
            &self.client,
            lease,
            &c.image,
            base_chain,
            &new_layer,
            upload,
            &request.image,
            labels,
        )
        .await?;
        Ok((image, report, frozen_ms))
    }
}

/// How the host ids in the workspace map to the sandbox's: in a user namespace the sandbox
/// sees the workspace through an idmapped view that shows its owner as the sandbox's user
/// (`remap::workspace_view`), and the range's ids as themselves; without one, as they are.
fn workspace_shift(spec: &oci_spec::runtime::Spec, dir: &std::path::Path) -> Result<IdShift, RuntimeError> {
    let mut shift = id_shift(spec);
    if shift.uids.is_empty() {
        return Ok(shift);
    }
    let (owner_uid, owner_gid) = remap::workspace_owner(dir).map_err(|source| RuntimeError::Io {
        what: format!("reading the owner of the workspace {}", dir.display()),
        source,
    })?;
    let (uid, gid) = spec
        .process()
        .as_ref()
        .map(|p| (p.user().uid(), p.user().gid()))
        .unwrap_or((0, 0));
    let one = |container, host| IdRange {
        container,
        host,
        size: 1,
    };
    shift.uids.insert(0, one(uid, owner_uid));
    shift.gids.insert(0, one(gid, owner_gid));
    Ok(shift)
}

/// How the host ids in the container's upper directory map back to the sandbox's.
fn id_shift(spec: &oci_spec::runtime::Spec) -> IdShift {
    let ranges = |maps: Option<&Vec<oci_spec::runtime::LinuxIdMapping>>| -> Vec<IdRange> {
        maps.into_iter()
            .flatten()
            .map(|m| IdRange {
                container: m.container_id(),
                host: m.host_id(),
                size: m.size(),
            })
            .collect()
    };
    match spec.linux() {
        Some(linux) => IdShift {
            uids: ranges(linux.uid_mappings().as_ref()),
            gids: ranges(linux.gid_mappings().as_ref()),
        },
        None => IdShift::default(),
    }
}
