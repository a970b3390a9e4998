//! Filesystem snapshots: a running sandbox's rootfs changes made an image on top of its base
//! (`runner snapshot create SESSION|JOB[-ATTEMPT] NAME`, `POST /v1/sessions/{id}/snapshot`),
//! named `snapshot:NAME` and usable wherever an image is (`image: snapshot:NAME`, pools);
//! listed with their disk use, removed (`runner snapshot ls|rm`). containerd's GC takes a
//! removed snapshot's blobs and unpacked layer once nothing else uses them.

use std::collections::HashMap;

use serde::Serialize;

use super::{Context, ServiceError};
use crate::runtime::containerd::snapshot::{
    CommitOutcome, CommitRequest, LABEL_SNAPSHOT, LABEL_SNAPSHOT_BASE as LABEL_BASE,
    LABEL_SNAPSHOT_CREATED as LABEL_CREATED, LABEL_SNAPSHOT_LAYER_BYTES as LABEL_LAYER_BYTES,
    LABEL_SNAPSHOT_SOURCE as LABEL_SOURCE, WorkspaceSource,
};
use crate::runtime::containerd::{LABEL_ATTEMPT, LABEL_MANAGED, LABEL_WORKSPACE, LABEL_WORKSPACE_TARGET};

/// What a snapshot's image name starts with.
pub const IMAGE_PREFIX: &str = crate::image::SNAPSHOT_PREFIX;
use crate::manifest::MAX_SNAPSHOT_NAME as MAX_NAME;

/// A snapshot as callers see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotView {
    pub name: String,
    /// The image to name it by (`image: snapshot:NAME`).
    pub image: String,
    /// The image it was made on.
    pub base: String,
    /// What it was taken of.
    pub source: String,
    pub created: String,
    /// Its manifest's digest.
    pub digest: String,
    /// Bytes of its layer (the sandbox's changes, uncompressed).
    pub layer_bytes: u64,
    /// Bytes it takes on disk: the layer blob and its unpacked copy (`None`: unknown).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_bytes: Option<u64>,
    /// The path the workspace it holds was mounted at (`None`: it holds no workspace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<String>,
}

/// What `create` did, beyond the snapshot itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Created {
    #[serde(flatten)]
    pub snapshot: SnapshotView,
    /// Entries of its layer (files, directories, links, whiteouts).
    pub entries: u64,
    /// Entries and bytes (of the layer's tar) of the workspace it holds (0 without).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub workspace_entries: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub workspace_bytes: u64,
    /// How long the sandbox was frozen while its changes were read (0: it was paused).
    pub frozen_ms: u64,
    /// How long the whole snapshot took.
    pub took_ms: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The image name of snapshot `name`, which is checked.
pub fn image_name(name: &str) -> Result<String, ServiceError> {
    image_name_of("name", name)
}

/// The same, for a request whose `field` names the snapshot.
pub fn image_name_of(field: &str, name: &str) -> Result<String, ServiceError> {
    if !crate::manifest::is_snapshot_name(name) {
        return Err(ServiceError::field(
            field,
            format!(
                "{name:?} is not a snapshot name (lowercase letters, digits, . _ -, starting with a letter or digit, at most {MAX_NAME})"
            ),
        ));
    }
    Ok(format!("{IMAGE_PREFIX}{name}"))
}

/// Snapshot the running container of `source`: a session id, a Job's name (its one running
/// container), or `JOB-ATTEMPT` (that attempt's). A name that exists is refused unless
/// `replace`.
pub async fn create(
    ctx: &Context,
    source: &str,
    name: &str,
    replace: bool,
    workspace: bool,
) -> Result<Created, ServiceError> {
    let image = image_name(name)?;
    let engine = ctx.engine(ctx.runtime_options()).await?;
    let client = ctx.containerd().await?;
    if !replace && client.image_get(&image).await.map_err(ServiceError::from)?.is_some() {
        return Err(ServiceError::Conflict(format!(
            "snapshot {name} exists: remove it first (runner snapshot rm {name}) or replace it"
        )));
    }
    let container = find_container(&engine, source).await?;
    let workspace = match workspace {
        true => Some(workspace_of(&container, source)?),
        false => None,
    };
    let now = crate::job::rfc3339(std::time::SystemTime::now());
    let labels = HashMap::from([
        (LABEL_MANAGED.to_string(), "true".to_string()),
        (LABEL_SNAPSHOT.to_string(), name.to_string()),
        (LABEL_SOURCE.to_string(), source.to_string()),
        (LABEL_BASE.to_string(), container.image.clone()),
        (LABEL_CREATED.to_string(), now.clone()),
    ]);
    let request = CommitRequest {
        image: image.clone(),
        labels,
        created_by: format!(
            "runner snapshot create {source} {name}{}",
            if workspace.is_some() { " --workspace" } else { "" }
        ),
        limits: Default::default(),
        workspace: workspace.clone(),
    };
    let outcome: CommitOutcome = engine.commit(&container, &request).await?;
    tracing::info!(
        snapshot = name,
        source,
        bytes = outcome.layer.size,
        ms = outcome.took_ms,
        "snapshot made"
    );
    Ok(Created {
        snapshot: SnapshotView {
            name: name.to_string(),
            image,
            base: outcome.base,
            source: source.to_string(),
            created: now,
            digest: outcome.image.digest,
            layer_bytes: outcome.layer.size,
            disk_bytes: client
                .snapshot_usage(&outcome.image.top_chain)
                .await
                .ok()
                .map(|u| u + outcome.layer.size),
            workspace: workspace.map(|w| w.target),
        },
        entries: outcome.layer.entries,
        workspace_entries: outcome.layer.section_entries,
        workspace_bytes: outcome.layer.section_bytes,
        frozen_ms: outcome.frozen_ms,
        took_ms: outcome.took_ms,
    })
}

/// Where `container` has its workspace, which a snapshot `--workspace` holds.
fn workspace_of(
    container: &containerd_client::services::v1::Container,
    source: &str,
) -> Result<WorkspaceSource, ServiceError> {
    match (
        container.labels.get(LABEL_WORKSPACE),
        container.labels.get(LABEL_WORKSPACE_TARGET),
    ) {
        (Some(dir), Some(target)) => Ok(WorkspaceSource {
            dir: dir.into(),
            target: target.clone(),
        }),
        _ => Err(ServiceError::field(
            "workspace",
            format!(
                "{source} has no workspace mounted (its Job has none, or its Environment says mountWorkspace: false)"
            ),
        )),
    }
}

/// The running container of a session, Job or Job attempt.
async fn find_container(
    engine: &crate::runtime::containerd::Engine,
    source: &str,
) -> Result<containerd_client::services::v1::Container, ServiceError> {
    let mut found = engine.job_containers(source, None).await?;
    if found.is_empty()
        && let Some((job, attempt)) = source.rsplit_once('-')
        && attempt.parse::<u32>().is_ok()
    {
        found = engine
            .job_containers(job, None)
            .await?
            .into_iter()
            .filter(|c| c.labels.get(LABEL_ATTEMPT).map(String::as_str) == Some(attempt))
            .collect();
    }
    // Jobs are named per state dir: another state dir's on the same containerd namespace
    // (another user's runner, a test's) is not this one's source.
    let ours = engine.state_dir();
    found.retain(|c| {
        c.labels
            .get(crate::runtime::containerd::LABEL_STATE_DIR)
            .is_none_or(|d| std::path::Path::new(d) == ours)
    });
    match found.len() {
        0 => Err(ServiceError::NotFound {
            kind: "running session or job attempt",
            name: source.to_string(),
        }),
        1 => Ok(found.remove(0)),
        n => Err(ServiceError::field(
            "source",
            format!("{source} has {n} containers: name one attempt (JOB-ATTEMPT) of one index"),
        )),
    }
}

/// Every snapshot, by name.
pub async fn list(ctx: &Context) -> Result<Vec<SnapshotView>, ServiceError> {
    let client = ctx.containerd().await?;
    let mut out = Vec::new();
    for image in client.images().await? {
        let Some(name) = image.labels.get(LABEL_SNAPSHOT) else {
            continue;
        };
        let label = |k: &str| image.labels.get(k).cloned().unwrap_or_default();
        let layer_bytes = label(LABEL_LAYER_BYTES).parse().unwrap_or(0);
        // The workspace it holds is what its config says (what a job starting from it reads).
        let (disk_bytes, workspace) = match crate::image::resolve(&client, &image.name).await {
            Ok(info) => (
                client
                    .snapshot_usage(&info.top_chain)
                    .await
                    .ok()
                    .map(|u| u + layer_bytes),
                info.workspace.map(|w| w.target),
            ),
            Err(_) => (None, None),
        };
        out.push(SnapshotView {
            name: name.clone(),
            image: image.name.clone(),
            base: label(LABEL_BASE),
            source: label(LABEL_SOURCE),
            created: label(LABEL_CREATED),
            digest: image.target.map(|t| t.digest).unwrap_or_default(),
            layer_bytes,
            disk_bytes,
            workspace,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Remove a snapshot: its image record now, its blobs and layer with containerd's GC (not
/// while a container runs on it).
pub async fn remove(ctx: &Context, name: &str) -> Result<(), ServiceError> {
    let image = image_name(name)?;
    let client = ctx.containerd().await?;
    match client.image_get(&image).await? {
        Some(i) if i.labels.contains_key(LABEL_SNAPSHOT) => {}
        _ => {
            return Err(ServiceError::NotFound {
                kind: "snapshot",
                name: name.to_string(),
            });
        }
    }
    client.image_delete(&image).await?;
    Ok(())
}

/// What `collect` (part of `runner gc`) did.
#[derive(Clone, Debug, Default)]
pub struct Collected {
    /// Setup snapshots an Environment's newer one replaced, removed.
    pub removed: Vec<SnapshotView>,
    /// Snapshots left, and what they take on disk (those whose use is known).
    pub kept: usize,
    pub kept_disk_bytes: u64,
}

/// What a setup snapshot's source says (`runtime::containerd::setup_snapshot`).
const SETUP_SOURCE: &str = "setup of Environment ";

/// Remove the setup snapshots a newer one of the same Environment superseded (its setup or
/// image changed since): no job starts from them any more, unless the old Environment comes
/// back (then its next use builds again). Named snapshots are the user's: kept.
pub async fn collect(ctx: &Context) -> Result<Collected, ServiceError> {
    let all = list(ctx).await?;
    let mut newest: HashMap<&str, &str> = HashMap::new();
    for s in all.iter().filter(|s| s.source.starts_with(SETUP_SOURCE)) {
        let entry = newest.entry(s.source.as_str()).or_insert(s.created.as_str());
        if s.created.as_str() > *entry {
            *entry = s.created.as_str();
        }
    }
    let mut out = Collected::default();
    for s in &all {
        let superseded = newest.get(s.source.as_str()).is_some_and(|n| s.created.as_str() < *n);
        if superseded {
            remove(ctx, &s.name).await?;
            out.removed.push(s.clone());
        } else {
            out.kept += 1;
            out.kept_disk_bytes += s.disk_bytes.unwrap_or(0);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_names_are_checked() {
        assert_eq!(image_name("py-deps.1").unwrap(), "snapshot:py-deps.1");
        for bad in ["", "-x", "A", "a/b", "a:b", &"x".repeat(129)] {
            assert!(image_name(bad).is_err(), "{bad:?}");
        }
    }
}
