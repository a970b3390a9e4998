//! Images in containerd: import local archives, list, remove.

use std::path::Path;

use serde::Serialize;

use super::{Context, ServiceError};
use crate::image::{self, ImportOptions, Imported};

/// One image as listed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageRow {
    pub name: String,
    pub digest: String,
    pub media_type: String,
    pub size: i64,
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
    let images = ctx.containerd().await?.images().await?;
    Ok(images
        .into_iter()
        .map(|i| {
            let t = i.target.unwrap_or_default();
            ImageRow {
                name: i.name,
                digest: t.digest,
                media_type: t.media_type,
                size: t.size,
            }
        })
        .collect())
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
