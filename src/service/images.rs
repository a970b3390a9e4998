//! Images in containerd: pull, push and tag through registries, import local archives,
//! list, remove.

use std::path::Path;

use serde::Serialize;

use super::{Context, ServiceError};
use crate::image::{self, ImportOptions, Imported, remote};

/// One image as listed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageRow {
    pub name: String,
    pub digest: String,
    pub media_type: String,
    /// Bytes of content for this platform (manifest, config, compressed layers), as
    /// `ctr image ls` counts them; absent when a blob is missing.
    pub size: Option<i64>,
    /// When the image was built (its config's `created`), if it says.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created: Option<String>,
}

/// The image's default command from `--cmd`: a JSON array, else a shell string (Docker's CMD).
pub fn parse_cmd(text: &str) -> Result<Vec<String>, ServiceError> {
    if text.trim_start().starts_with('[') {
        serde_json::from_str::<Vec<String>>(text)
            .map_err(|e| ServiceError::field("cmd", format!("not a JSON array of strings: {e}")))
    } else {
        Ok(vec!["/bin/sh".to_string(), "-c".to_string(), text.to_string()])
    }
}

/// Import an OCI layout tar, a `docker save` archive or a rootfs tarball.
pub async fn import(ctx: &Context, file: &Path, options: &ImportOptions) -> Result<Vec<Imported>, ServiceError> {
    let client = ctx.containerd().await?;
    Ok(image::import(&client, file, options).await?)
}

pub async fn list(ctx: &Context) -> Result<Vec<ImageRow>, ServiceError> {
    let client = ctx.containerd().await?;
    let mut rows = Vec::new();
    for i in client.images().await? {
        let t = i.target.unwrap_or_default();
        let (size, created) = image::summary(&client, &t).await;
        rows.push(ImageRow {
            name: i.name,
            digest: t.digest,
            media_type: t.media_type,
            size,
            created,
        });
    }
    Ok(rows)
}

fn platform(text: Option<&str>) -> Result<Option<remote::Platform>, ServiceError> {
    text.map(|p| p.parse().map_err(|e: String| ServiceError::field("--platform", e)))
        .transpose()
}

/// Pull an image from its registry (or a mirror of it).
pub async fn pull(
    ctx: &Context,
    reference: &str,
    platform_text: Option<&str>,
    progress: Option<remote::PullProgressFn>,
) -> Result<remote::Pulled, ServiceError> {
    let client = ctx.containerd().await?;
    let options = remote::PullOptions {
        platform: platform(platform_text)?,
        registry: ctx.config.registry.clone(),
        progress,
    };
    Ok(remote::pull(&client, reference, &options).await?)
}

/// Push a local image to the registry its name points at.
pub async fn push(
    ctx: &Context,
    reference: &str,
    platform_text: Option<&str>,
    progress: Option<remote::PullProgressFn>,
) -> Result<remote::Pushed, ServiceError> {
    let client = ctx.containerd().await?;
    let options = remote::PullOptions {
        platform: platform(platform_text)?,
        registry: ctx.config.registry.clone(),
        progress,
    };
    Ok(remote::push(&client, reference, &options).await?)
}

/// Another name for a local image; the new name.
pub async fn tag(ctx: &Context, source: &str, target: &str) -> Result<String, ServiceError> {
    let client = ctx.containerd().await?;
    Ok(remote::tag(&client, source, target).await?)
}

/// Remove one image; its normalized name.
pub async fn remove(ctx: &Context, name: &str) -> Result<String, ServiceError> {
    let name = image::normalize_name(name)?;
    match ctx.containerd().await?.image_delete(&name).await {
        Ok(()) => Ok(name),
        Err(e) if e.is_not_found() => Err(ServiceError::NotFound { kind: "image", name }),
        Err(e) => Err(e.into()),
    }
}
