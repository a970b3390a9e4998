//! Reading image archives without unpacking them to disk: an index of tar members (name →
//! offset, size) lets blobs be streamed straight from the archive file. Three formats:
//! OCI image layout tars, `docker save` archives, and plain rootfs tarballs.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::ImageError;

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const OCI_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
pub const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const OCI_LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_MANIFEST_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
pub const DOCKER_LAYER_TAR: &str = "application/vnd.docker.image.rootfs.diff.tar";
pub const DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
/// Annotation containerd's own export writes with the full image name.
pub const ANNOTATION_CONTAINERD_NAME: &str = "io.containerd.image.name";
/// OCI's name annotation: a full reference or only a tag.
pub const ANNOTATION_REF_NAME: &str = "org.opencontainers.image.ref.name";
/// Largest JSON document (index, manifest, config) we read into memory.
const MAX_JSON_BYTES: u64 = 16 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Oci,
    Docker,
    Rootfs,
}

/// Where a member's bytes are inside the archive.
#[derive(Clone, Copy, Debug)]
pub struct Member {
    pub offset: u64,
    pub size: u64,
}

/// An image archive on disk with its member index.
pub struct Archive {
    pub path: PathBuf,
    pub format: Format,
    members: HashMap<String, Member>,
}

fn clean(name: &str) -> String {
    name.trim_start_matches("./").trim_end_matches('/').to_string()
}

impl Archive {
    pub fn open(path: &Path) -> Result<Self, ImageError> {
        let io = |source| ImageError::Io {
            what: format!("reading {}", path.display()),
            source,
        };
        let mut file = File::open(path).map_err(io)?;
        let mut magic = [0u8; 2];
        let n = file.read(&mut magic).map_err(io)?;
        if n == 2 && magic == [0x1f, 0x8b] {
            // A compressed archive can only be a rootfs tarball (OCI and docker archives are plain tars).
            return Ok(Archive {
                path: path.to_path_buf(),
                format: Format::Rootfs,
                members: HashMap::new(),
            });
        }
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        let mut members = HashMap::new();
        let mut tar = tar::Archive::new(file);
        let entries = tar
            .entries()
            .map_err(|e| ImageError::Format(format!("{}: not a tar archive: {e}", path.display())))?;
        for entry in entries {
            let entry = entry.map_err(|e| ImageError::Format(format!("{}: corrupt tar: {e}", path.display())))?;
            if !entry.header().entry_type().is_file() {
                continue;
            }
            let name = clean(&String::from_utf8_lossy(&entry.path_bytes()));
            members.insert(
                name,
                Member {
                    offset: entry.raw_file_position(),
                    size: entry.size(),
                },
            );
        }
        let format = if members.contains_key("oci-layout") && members.contains_key("index.json") {
            Format::Oci
        } else if members.contains_key("manifest.json") {
            Format::Docker
        } else {
            Format::Rootfs
        };
        Ok(Archive {
            path: path.to_path_buf(),
            format,
            members,
        })
    }

    pub fn member(&self, name: &str) -> Option<Member> {
        self.members.get(&clean(name)).copied()
    }

    /// A reader over one member's bytes.
    pub fn reader(&self, member: Member) -> Result<std::io::Take<File>, ImageError> {
        let mut f = File::open(&self.path).map_err(|source| ImageError::Io {
            what: format!("reading {}", self.path.display()),
            source,
        })?;
        f.seek(SeekFrom::Start(member.offset))
            .map_err(|source| ImageError::Io {
                what: format!("reading {}", self.path.display()),
                source,
            })?;
        Ok(f.take(member.size))
    }

    pub fn read_member(&self, name: &str) -> Result<Vec<u8>, ImageError> {
        let m = self
            .member(name)
            .ok_or_else(|| ImageError::Format(format!("{}: no {name} in the archive", self.path.display())))?;
        if m.size > MAX_JSON_BYTES {
            return Err(ImageError::Format(format!("{name} is {} bytes; too large", m.size)));
        }
        let mut out = Vec::with_capacity(m.size as usize);
        self.reader(m)?.read_to_end(&mut out).map_err(|source| ImageError::Io {
            what: format!("reading {name}"),
            source,
        })?;
        Ok(out)
    }

    /// The member holding blob `digest` of an OCI layout.
    pub fn blob(&self, digest: &str) -> Result<Member, ImageError> {
        let (algo, hex) = digest
            .split_once(':')
            .ok_or_else(|| ImageError::Format(format!("bad digest {digest:?}")))?;
        self.member(&format!("blobs/{algo}/{hex}"))
            .ok_or_else(|| ImageError::Format(format!("blob {digest} is missing from the archive")))
    }
}

/// `sha256:<hex>` of a reader's bytes, and how many there were.
pub fn sha256_of(mut reader: impl Read) -> std::io::Result<(String, u64)> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        total += n as u64;
    }
    Ok((format!("sha256:{}", hex::encode(hasher.finalize())), total))
}

pub fn sha256_bytes(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// The layer's digest after decompression (its diffID).
pub fn diff_id(reader: impl Read, gzip: bool) -> std::io::Result<String> {
    if gzip {
        Ok(sha256_of(flate2::read::MultiGzDecoder::new(reader))?.0)
    } else {
        Ok(sha256_of(reader)?.0)
    }
}

/// chainID(L0) = diffID(L0); chainID(Ln) = sha256(chainID(Ln-1) + " " + diffID(Ln)).
pub fn chain_ids(diff_ids: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(diff_ids.len());
    for d in diff_ids {
        let next = match out.last() {
            None => d.clone(),
            Some(prev) => sha256_bytes(format!("{prev} {d}").as_bytes()),
        };
        out.push(next);
    }
    out
}

// ---- JSON documents (only the fields we use; others are ignored on purpose: image content
// is untrusted and only these fields steer what we do)

#[derive(Deserialize, serde::Serialize, Clone, Debug)]
#[serde(rename_all = "camelCase")]
pub struct JsonDescriptor {
    #[serde(default)]
    pub media_type: String,
    pub digest: String,
    pub size: i64,
    #[serde(default, skip_serializing_if = "HashMap::is_empty")]
    pub annotations: HashMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<JsonPlatform>,
}

#[derive(Deserialize, serde::Serialize, Clone, Debug, Default)]
pub struct JsonPlatform {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
}

#[derive(Deserialize, Debug)]
#[serde(rename_all = "camelCase")]
pub struct JsonIndex {
    #[serde(default)]
    pub media_type: Option<String>,
    pub manifests: Vec<JsonDescriptor>,
    #[serde(default)]
    pub annotations: HashMap<String, String>,
}

#[derive(Deserialize, Debug)]
#[serde(rename_all = "camelCase")]
pub struct JsonManifest {
    #[serde(default)]
    pub media_type: Option<String>,
    pub config: JsonDescriptor,
    pub layers: Vec<JsonDescriptor>,
}

#[derive(Deserialize, Debug, Default)]
pub struct JsonImageConfig {
    #[serde(default)]
    pub config: Option<JsonRunConfig>,
    #[serde(default)]
    pub os: Option<String>,
    #[serde(default)]
    pub architecture: Option<String>,
    /// When the image was built (RFC 3339), for `image ls`.
    #[serde(default)]
    pub created: Option<String>,
    pub rootfs: JsonRootfs,
}

#[derive(Deserialize, Debug, Default, Clone)]
#[serde(rename_all = "PascalCase")]
pub struct JsonRunConfig {
    #[serde(default)]
    pub env: Option<Vec<String>>,
    #[serde(default)]
    /// Boxed: this config travels in every claim's result, and few images have labels.
    pub labels: Option<Box<HashMap<String, String>>>,
    #[serde(default)]
    pub cmd: Option<Vec<String>>,
    #[serde(default)]
    pub working_dir: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
}

#[derive(Deserialize, Debug, Default)]
pub struct JsonRootfs {
    #[serde(default)]
    pub diff_ids: Vec<String>,
}

/// One entry of a `docker save` manifest.json.
#[derive(Deserialize, Debug)]
#[serde(rename_all = "PascalCase")]
pub struct DockerEntry {
    pub config: String,
    #[serde(default)]
    pub repo_tags: Option<Vec<String>>,
    pub layers: Vec<String>,
}

pub fn parse_json<T: serde::de::DeserializeOwned>(what: &str, data: &[u8]) -> Result<T, ImageError> {
    serde_json::from_slice(data).map_err(|e| ImageError::Format(format!("{what}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_ids_follow_the_oci_definition() {
        let d = vec!["sha256:a".to_string(), "sha256:b".to_string()];
        let c = chain_ids(&d);
        assert_eq!(c[0], "sha256:a");
        assert_eq!(c[1], sha256_bytes(b"sha256:a sha256:b"));
    }
}
