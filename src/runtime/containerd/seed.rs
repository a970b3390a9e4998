//! A snapshot made with its workspace (`runner snapshot create --workspace`) gives those files
//! to every sandbox that starts from it. The snapshot's top layer holds them first, under the
//! path the workspace was mounted at (`image::WorkspaceSeed`), so the image is whole on its
//! own (`ctr run` sees them there); but a sandbox that mounts a workspace at that path would
//! hide them. So before its command runs, its workspace gets them: the layer's first part is
//! read from containerd's content store into an unnamed file of the host's and unpacked into
//! the workspace beneath its descriptor (`confined`), leaving alone whatever the workspace
//! has already — a job's own files win over the snapshot's.
//!
//! The workspace may be shared with a live sandbox (a parallel index, a session given the same
//! directory): everything written there is confined (no link it plants is followed), bounded
//! (the part's bytes, the confined extractor's member limit) and on the blocking pool.

use std::time::Instant;

use futures::StreamExt;
use tokio::io::AsyncWriteExt;

use super::*;
use crate::confined::{Owner, Root, Source, UnpackOptions};
use crate::image::WorkspaceSeed;
use crate::runtime::RuntimeError;
use crate::spec::RunPlan;

/// The most a snapshot's workspace may hold to be given out (as its layer may: 10 GiB).
const SEED_LIMIT: u64 = 10 << 30;

impl Engine {
    /// Give `plan`'s workspace the files its image holds for it (`seed`, from the image's
    /// resolution), if it holds any for the path
    /// the plan mounts its workspace at. A restore never gets them (its checkpoint has the
    /// workspace as it was), nor does a sandbox without a workspace there (it sees them in
    /// the image).
    pub(super) async fn seed_workspace(
        &self,
        seed: Option<&WorkspaceSeed>,
        plan: &RunPlan,
    ) -> Result<(), RuntimeError> {
        let (Some(seed), Some(workspace)) = (seed, &plan.workspace) else {
            return Ok(());
        };
        let env = plan.env();
        if plan.restore.is_some() || !env.mount_workspace || env.workdir != seed.target {
            return Ok(());
        }
        let t0 = Instant::now();
        let image = env.image.as_deref().unwrap_or("the image");
        let refused = |why: String| RuntimeError::Refused(format!("the workspace of {image}: {why}"));
        if seed.bytes > SEED_LIMIT {
            return Err(refused(format!("{} bytes, over the limit of {SEED_LIMIT}", seed.bytes)));
        }
        if !is_plain_tar(&seed.layer_media_type) {
            return Err(refused(format!(
                "its layer is {} (a snapshot's workspace is read from an uncompressed layer)",
                seed.layer_media_type
            )));
        }
        let file = self.fetch_seed(seed).await?;
        tracing::debug!(
            ms = t0.elapsed().as_secs_f64() * 1e3,
            bytes = seed.bytes,
            "snapshot's workspace read from containerd"
        );
        let (dir, target) = (workspace.clone(), seed.target.clone());
        let report = tokio::task::spawn_blocking(move || {
            let root = Root::open(&dir)?;
            let owner = super::remap::workspace_owner(&dir)
                .map(|(uid, gid)| Owner { uid, gid })
                .map_err(|source| crate::confined::ConfinedError::Io {
                    op: "reading the owner of",
                    path: dir.display().to_string(),
                    source,
                })?;
            let options = UnpackOptions {
                strip: target.trim_start_matches('/'),
                keep_existing: true,
            };
            root.unpack_tar_from("", Source::File(&file), Some(owner), SEED_LIMIT, options)
        })
        .await
        .map_err(|e| RuntimeError::Internal(format!("the workspace seeding task: {e}")))?
        .map_err(|e| refused(format!("giving it to the workspace: {e}")))?;
        tracing::debug!(
            ms = t0.elapsed().as_secs_f64() * 1e3,
            files = report.files,
            kept = report.kept,
            bytes = report.bytes,
            "workspace given the snapshot's files"
        );
        Ok(())
    }

    /// The first `seed.bytes` of its layer, in an unnamed file of the host's (gone when
    /// dropped, whatever happens to this process).
    async fn fetch_seed(&self, seed: &WorkspaceSeed) -> Result<std::fs::File, RuntimeError> {
        let io = |what: &'static str| {
            move |source| RuntimeError::Io {
                what: what.into(),
                source,
            }
        };
        let state = self.run_dir.parent().unwrap_or(&self.run_dir).to_path_buf();
        let file = tokio::task::spawn_blocking(move || tempfile::tempfile_in(state))
            .await
            .map_err(|e| RuntimeError::Internal(format!("the workspace file task: {e}")))?
            .map_err(io("making a file for a snapshot's workspace"))?;
        let reader = file.try_clone().map_err(io("opening a snapshot's workspace file"))?;
        let mut out = tokio::fs::File::from_std(file);
        let mut stream = self
            .client
            .content_stream_range(&seed.layer_digest, 0, seed.bytes)
            .await?;
        let mut got = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(io("reading a snapshot's workspace from containerd"))?;
            let take = chunk.len().min((seed.bytes - got) as usize);
            out.write_all(&chunk[..take])
                .await
                .map_err(io("writing a snapshot's workspace file"))?;
            got += take as u64;
            if got == seed.bytes {
                break;
            }
        }
        out.flush().await.map_err(io("writing a snapshot's workspace file"))?;
        if got != seed.bytes {
            return Err(RuntimeError::Internal(format!(
                "layer {} ended after {got} of the workspace's {} bytes",
                seed.layer_digest, seed.bytes
            )));
        }
        Ok(reader)
    }
}

/// An uncompressed tar layer's media type (OCI's or Docker's).
fn is_plain_tar(media_type: &str) -> bool {
    media_type == crate::image::archive::OCI_LAYER_TAR || media_type == crate::image::archive::DOCKER_LAYER_TAR
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_an_uncompressed_layer_is_read() {
        assert!(super::is_plain_tar(crate::image::archive::OCI_LAYER_TAR));
        assert!(super::is_plain_tar(crate::image::archive::DOCKER_LAYER_TAR));
        assert!(!super::is_plain_tar("application/vnd.oci.image.layer.v1.tar+gzip"));
    }
}
