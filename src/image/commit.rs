//! A new image made of a base image and one more layer (a sandbox's snapshot): the layer
//! blob and a config and manifest that add it to the base's, written to the content store
//! with the GC labels that keep them (and the unpacked chain) alive, the layer unpacked on
//! top of the base's chain, and an image record. As `nerdctl commit` and `docker commit` do,
//! but from a layer tar runner wrote itself (see `runtime::containerd::layer`).

use std::collections::HashMap;
use std::path::Path;

use containerd_client::types::Descriptor;

use super::archive::{self, JsonDescriptor, JsonManifest};
use super::layer_apply::{self, XattrSpace};
use super::{
    GC_REF_CONFIG, GC_REF_LAYER, GC_REF_SNAPSHOT, IMPORT_LEASE_TTL, ImageError, UNCOMPRESSED_LABEL, descriptor,
    parse_json, pick_platform, read_blob, unique,
};
use crate::containerd::{Containerd, LEASE_EXPIRE_LABEL};

/// The layer to add: an uncompressed tar in a file.
pub struct NewLayer<'a> {
    pub path: &'a Path,
    /// `sha256:…` of the tar (its digest and diffID).
    pub digest: &'a str,
    pub size: u64,
    /// What the image history says made it.
    pub created_by: String,
    /// The workspace its first part holds: the path it was mounted at and the bytes of that
    /// part (see `super::WorkspaceSeed`).
    pub workspace: Option<(String, u64)>,
}

/// containerd's Diff.Apply of the received layer onto a prepared snapshot's mounts.
async fn apply_in_containerd(
    client: &Containerd,
    layer_desc: &JsonDescriptor,
    mounts: Vec<containerd_client::types::Mount>,
    digest: &str,
    index: usize,
) -> Result<(), ImageError> {
    let applied = client.diff_apply(descriptor(layer_desc), mounts).await?;
    if applied.digest != digest {
        return Err(ImageError::DiffIdMismatch {
            index,
            got: applied.digest,
            expected: digest.to_string(),
        });
    }
    Ok(())
}

/// The image `commit` made.
#[derive(Clone, Debug)]
pub struct Committed {
    pub name: String,
    /// Its manifest's digest.
    pub digest: String,
    /// The unpacked snapshot chain a container of it starts from.
    pub top_chain: String,
    /// Bytes of the layer blob.
    pub layer_size: u64,
}

/// The base image's manifest descriptor for this platform, its manifest and its config as
/// JSON (kept whole: fields runner does not model are carried over).
async fn base_parts(
    client: &Containerd,
    base: &str,
) -> Result<(Descriptor, serde_json::Value, serde_json::Value), ImageError> {
    let image = client
        .image_get(base)
        .await?
        .ok_or_else(|| ImageError::NotFound(base.to_string()))?;
    let mut target = image
        .target
        .ok_or_else(|| ImageError::Format(format!("image {base} has no target")))?;
    if target.media_type == archive::OCI_INDEX || target.media_type == archive::DOCKER_MANIFEST_LIST {
        let index: archive::JsonIndex = parse_json("index", &read_blob(client, &target.digest).await?)?;
        let chosen = pick_platform(&index.manifests)
            .ok_or_else(|| ImageError::Format(format!("no manifest for linux/{} in {base}", super::go_arch())))?;
        target = descriptor(chosen);
    }
    let manifest_bytes = read_blob(client, &target.digest).await?;
    let manifest: serde_json::Value = parse_json("manifest", &manifest_bytes)?;
    let typed: JsonManifest = parse_json("manifest", &manifest_bytes)?;
    let config: serde_json::Value = parse_json("image config", &read_blob(client, &typed.config.digest).await?)?;
    Ok((target, manifest, config))
}

/// The lease a commit's content and snapshots are made under (it expires by itself, should
/// runner die before `release`).
pub async fn lease(client: &Containerd) -> Result<String, ImageError> {
    let lease = unique("runner-commit");
    let expire = std::time::SystemTime::now() + IMPORT_LEASE_TTL;
    client
        .lease_create(
            &lease,
            HashMap::from([(
                LEASE_EXPIRE_LABEL.to_string(),
                humantime::format_rfc3339_seconds(expire).to_string(),
            )]),
        )
        .await?;
    Ok(lease)
}

/// Delete a commit's lease: what it made is kept by the image's GC labels.
pub async fn release(client: &Containerd, lease: &str) {
    if let Err(e) = client.lease_delete(lease).await {
        tracing::warn!(lease, error = %e, "could not delete the commit lease (it expires by itself)");
    }
}

/// What the layer blob's upload to the content store (running already, in `lease`) ends with.
pub type Upload = tokio::task::JoinHandle<Result<(), crate::containerd::CtdError>>;

/// The labels the layer blob is committed with (its uncompressed digest: it is its own).
pub fn layer_labels(digest: &str) -> HashMap<String, String> {
    HashMap::from([(UNCOMPRESSED_LABEL.to_string(), digest.to_string())])
}

/// Add `layer` on top of image `base` (whose unpacked top chain must be `base_chain`: the
/// chain the sandbox ran on, so a base re-tagged since is noticed) as image `name`, with
/// `labels` on its record, in `lease`; `upload` is the layer blob on its way into the
/// content store. Replaces an image of that name.
#[allow(clippy::too_many_arguments)]
pub async fn commit(
    client: &Containerd,
    lease: &str,
    base: &str,
    base_chain: &str,
    layer: &NewLayer<'_>,
    upload: Upload,
    name: &str,
    labels: HashMap<String, String>,
) -> Result<Committed, ImageError> {
    let (base_target, mut manifest, mut config) = base_parts(client, base).await?;
    let format = |what: &str| ImageError::Format(format!("image {base}: {what}"));
    let diff_ids = config
        .pointer_mut("/rootfs/diff_ids")
        .and_then(|v| v.as_array_mut())
        .ok_or_else(|| format("its config has no rootfs.diff_ids"))?;
    let base_ids: Vec<String> = diff_ids.iter().filter_map(|d| d.as_str().map(String::from)).collect();
    let base_top = archive::chain_ids(&base_ids).last().cloned().unwrap_or_default();
    if base_top != base_chain {
        return Err(ImageError::Format(format!(
            "image {base} changed since the sandbox started (its layers are no longer those the sandbox runs on): the snapshot would not be the sandbox's"
        )));
    }
    diff_ids.push(layer.digest.into());
    set_workspace_labels(&mut config, layer.workspace.as_ref());
    let mut ids = base_ids;
    ids.push(layer.digest.to_string());
    let chains = archive::chain_ids(&ids);
    let top_chain = chains.last().cloned().expect("one layer at least");
    let now = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    config["created"] = now.clone().into();
    let history = serde_json::json!({"created": now, "created_by": layer.created_by, "comment": "runner snapshot"});
    match config.get_mut("history").and_then(|h| h.as_array_mut()) {
        Some(h) => h.push(history),
        None => config["history"] = serde_json::json!([history]),
    }
    let docker = base_target.media_type == archive::DOCKER_MANIFEST;
    let layer_desc = JsonDescriptor {
        media_type: if docker {
            archive::DOCKER_LAYER_TAR
        } else {
            archive::OCI_LAYER_TAR
        }
        .into(),
        digest: layer.digest.to_string(),
        size: layer.size as i64,
        annotations: HashMap::new(),
        platform: None,
    };
    // The layer blob into the content store, and unpacked on the base's chain (the same
    // chain is content-addressed: another commit of the same changes may have made it
    // already). On an overlayfs snapshotter runner unpacks its own tar into the prepared
    // snapshot's upper directory while containerd receives the blob (the two at once);
    // on another, containerd's Diff.Apply unpacks the received blob.
    let upload = async {
        upload
            .await
            .map_err(|e| ImageError::Format(format!("the snapshot layer's upload: {e}")))??;
        tracing::debug!(bytes = layer.size, "snapshot layer in the content store");
        Ok::<(), ImageError>(())
    };
    if client.snapshot_stat(&top_chain).await?.is_some() {
        upload.await?;
    } else {
        let key = unique("runner-commit-extract");
        let mounts = client.snapshot_prepare(lease, &key, base_chain, HashMap::new()).await?;
        let direct = match mounts.as_slice() {
            [m] if m.r#type == "overlay" => m
                .options
                .iter()
                .find_map(|o| o.strip_prefix("upperdir="))
                .map(|upper| (std::path::PathBuf::from(upper), XattrSpace::of_options(&m.options))),
            _ => None,
        };
        let unpacked = match direct {
            Some((upper, space)) => {
                let path = layer.path.to_path_buf();
                let apply = async {
                    tokio::task::spawn_blocking(move || layer_apply::apply_layer(&path, &upper, space))
                        .await
                        .map_err(|e| ImageError::Format(format!("unpacking the snapshot layer: {e}")))?
                        .map_err(|e| ImageError::Format(format!("unpacking the snapshot layer: {e}")))
                };
                let (uploaded, applied) = tokio::join!(upload, apply);
                uploaded.and(applied.map(|_| ()))
            }
            None => match upload.await {
                Ok(()) => apply_in_containerd(client, &layer_desc, mounts, layer.digest, ids.len() - 1).await,
                Err(e) => Err(e),
            },
        };
        if let Err(e) = unpacked {
            let _ = client.snapshot_remove(&key).await;
            return Err(e);
        }
        match client.snapshot_commit(lease, &top_chain, &key, HashMap::new()).await {
            Ok(()) => {}
            Err(e) if e.is_already_exists() => {
                let _ = client.snapshot_remove(&key).await;
            }
            Err(e) => {
                let _ = client.snapshot_remove(&key).await;
                return Err(e.into());
            }
        }
    }
    tracing::debug!("snapshot layer unpacked");
    let config_bytes = serde_json::to_vec(&config).map_err(|e| ImageError::Format(e.to_string()))?;
    let config_digest = archive::sha256_bytes(&config_bytes);
    let config_size = config_bytes.len();
    super::put_bytes(
        client,
        lease,
        &config_digest,
        config_bytes,
        HashMap::from([(GC_REF_SNAPSHOT.to_string(), top_chain.clone())]),
    )
    .await?;
    manifest["config"]["digest"] = config_digest.clone().into();
    manifest["config"]["size"] = config_size.into();
    let layers = manifest
        .get_mut("layers")
        .and_then(|l| l.as_array_mut())
        .ok_or_else(|| format("its manifest has no layers"))?;
    layers.push(serde_json::to_value(&layer_desc).map_err(|e| ImageError::Format(e.to_string()))?);
    let mut manifest_labels = HashMap::from([(GC_REF_CONFIG.to_string(), config_digest)]);
    for (i, l) in layers.iter().enumerate() {
        if let Some(d) = l.get("digest").and_then(|d| d.as_str()) {
            manifest_labels.insert(format!("{GC_REF_LAYER}{i}"), d.to_string());
        }
    }
    let manifest_bytes = serde_json::to_vec(&manifest).map_err(|e| ImageError::Format(e.to_string()))?;
    let manifest_digest = archive::sha256_bytes(&manifest_bytes);
    let manifest_size = manifest_bytes.len() as i64;
    super::put_bytes(client, lease, &manifest_digest, manifest_bytes, manifest_labels).await?;
    client
        .image_put(
            name,
            Descriptor {
                media_type: base_target.media_type.clone(),
                digest: manifest_digest.clone(),
                size: manifest_size,
                annotations: HashMap::new(),
            },
            labels,
        )
        .await?;
    Ok(Committed {
        name: name.to_string(),
        digest: manifest_digest,
        top_chain,
        layer_size: layer.size,
    })
}

/// Say in the image config where the new layer's workspace is, or that it has none: a
/// workspace the base's labels named is in a lower layer now, and no longer what a sandbox of
/// this image is given.
fn set_workspace_labels(config: &mut serde_json::Value, workspace: Option<&(String, u64)>) {
    if !config.get("config").is_some_and(|c| c.is_object()) {
        config["config"] = serde_json::json!({});
    }
    let run = &mut config["config"];
    if !run.get("Labels").is_some_and(|l| l.is_object()) {
        run["Labels"] = serde_json::json!({});
    }
    if let Some(labels) = run["Labels"].as_object_mut() {
        labels.remove(super::WORKSPACE_LABEL);
        labels.remove(super::WORKSPACE_BYTES_LABEL);
        if let Some((target, bytes)) = workspace {
            labels.insert(super::WORKSPACE_LABEL.into(), target.clone().into());
            labels.insert(super::WORKSPACE_BYTES_LABEL.into(), bytes.to_string().into());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_layer_says_where_its_workspace_is_and_never_keeps_the_base_s() {
        let mut config = serde_json::json!({"config": {"Env": ["A=1"], "Labels": {
            "keep": "me", "dev.runner.snapshot.workspace": "/old", "dev.runner.snapshot.workspace-bytes": "10"}}});
        set_workspace_labels(&mut config, None);
        assert_eq!(config["config"]["Labels"], serde_json::json!({"keep": "me"}));
        set_workspace_labels(&mut config, Some(&("/workspace".to_string(), 2048)));
        assert_eq!(config["config"]["Labels"][super::super::WORKSPACE_LABEL], "/workspace");
        assert_eq!(config["config"]["Labels"][super::super::WORKSPACE_BYTES_LABEL], "2048");
        assert_eq!(config["config"]["Env"][0], "A=1");
        let mut bare = serde_json::json!({"rootfs": {}});
        set_workspace_labels(&mut bare, Some(&("/w".to_string(), 1)));
        assert_eq!(bare["config"]["Labels"][super::super::WORKSPACE_LABEL], "/w");
    }
}
