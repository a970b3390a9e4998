//! Images without a registry: `runner image import` of OCI layout tars, `docker save`
//! archives and plain rootfs tarballs, written client-side into containerd's content store
//! with the GC labels that keep them alive, recorded as images, and unpacked into the
//! overlayfs snapshotter. Also: looking an image up for a run.

pub mod archive;
pub mod commit;
pub mod layer_apply;
pub mod mtls;
pub mod registry;
pub mod remote;

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use archive::{
    Archive, DockerEntry, Format, JsonDescriptor, JsonImageConfig, JsonIndex, JsonManifest, JsonRunConfig, parse_json,
};
use containerd_client::types::Descriptor;

use crate::containerd::{Containerd, CtdError, LEASE_EXPIRE_LABEL, SNAPSHOTTER};

/// GC label: a manifest keeps its config alive.
const GC_REF_CONFIG: &str = "containerd.io/gc.ref.content.config";
/// GC label prefix: a manifest keeps its layers alive (`.l.<i>`), an index its manifests (`.m.<i>`).
const GC_REF_LAYER: &str = "containerd.io/gc.ref.content.l.";
const GC_REF_MANIFEST: &str = "containerd.io/gc.ref.content.m.";
/// GC label: a config keeps its unpacked snapshot chain alive.
const GC_REF_SNAPSHOT: &str = "containerd.io/gc.ref.snapshot.overlayfs";
/// containerd's label recording which snapshot a layer unpacked into (as `ctr` sets it).
const UNCOMPRESSED_LABEL: &str = "containerd.io/uncompressed";
/// How long an import lease may outlive a crashed import before containerd's GC drops it.
const IMPORT_LEASE_TTL: Duration = Duration::from_secs(3600);
/// What a snapshot's image name starts with (`snapshot:NAME`): made in this containerd
/// namespace by `runner snapshot create`, never pulled.
pub const SNAPSHOT_PREFIX: &str = "snapshot:";

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error(transparent)]
    Containerd(#[from] CtdError),
    #[error("{0}")]
    Format(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("image {0:?} is not present (import it with `runner image import FILE --name {0}`)")]
    NotFound(String),
    /// The whole message: the name as written and what is wrong with it.
    #[error("{0}")]
    Name(String),
    #[error("{0}")]
    Registry(String),
    #[error("layer {index} unpacked to {got}, but the image config says {expected}")]
    DiffIdMismatch {
        index: usize,
        got: String,
        expected: String,
    },
}

/// Image settings for a rootfs tarball (docker-import semantics), and where progress goes.
#[derive(Clone, Default)]
pub struct ImportOptions {
    /// Name for the image (required for rootfs tarballs and unnamed OCI archives).
    pub name: Option<String>,
    pub cmd: Option<Vec<String>>,
    pub env: Vec<String>,
    pub workdir: Option<String>,
    pub user: Option<String>,
    pub progress: Option<ProgressFn>,
}

/// What an import produced.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Imported {
    pub name: String,
    pub digest: String,
    pub layers: usize,
    pub format: &'static str,
}

/// Go's architecture names, as image configs spell them.
pub fn go_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "arm" => "arm",
        other => other,
    }
}

/// Accept `name[:tag]` with the characters of a reference; add `:latest` when no tag is given.
/// An error with every cause under it, each said once (HTTP and TLS libraries nest the
/// useful part — "certificate verify failed", "connection refused" — a few levels down).
pub(crate) fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

pub fn normalize_name(name: &str) -> Result<String, ImageError> {
    let valid = !name.is_empty()
        && name.len() <= 255
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-/:@".contains(&b) || b.is_ascii_uppercase())
        && !name.starts_with(['/', ':', '.', '-'])
        && !name.contains("//");
    if !valid {
        return Err(ImageError::Name(format!(
            "{name:?} is not a valid image name (letters, digits and . _ - / : @, not starting with / : . - and without //)"
        )));
    }
    let last = name.rsplit('/').next().unwrap_or(name);
    if last.contains(':') || last.contains('@') {
        Ok(name.to_string())
    } else {
        Ok(format!("{name}:latest"))
    }
}

fn descriptor(d: &JsonDescriptor) -> Descriptor {
    Descriptor {
        media_type: d.media_type.clone(),
        digest: d.digest.clone(),
        size: d.size,
        annotations: HashMap::new(),
    }
}

/// How far an import is, for whoever displays progress (the CLI draws a bar on a terminal).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportProgress {
    /// The image being imported.
    pub image: String,
    /// What is being done (`layer 2/3`, `unpacking`); empty once `finished`.
    pub step: String,
    pub done: u64,
    pub total: u64,
    pub finished: bool,
}

/// Receives progress events.
pub type ProgressFn = std::sync::Arc<dyn Fn(&ImportProgress) + Send + Sync>;

struct Progress {
    image: String,
    sink: Option<ProgressFn>,
}

impl Progress {
    fn new(image: String, sink: Option<ProgressFn>) -> Self {
        Progress { image, sink }
    }
    fn update(&self, step: &str, done: u64, total: u64) {
        if let Some(sink) = &self.sink {
            sink(&ImportProgress {
                image: self.image.clone(),
                step: step.to_string(),
                done,
                total,
                finished: false,
            });
        }
    }
    fn done(&self) {
        if let Some(sink) = &self.sink {
            sink(&ImportProgress {
                image: self.image.clone(),
                step: String::new(),
                done: 0,
                total: 0,
                finished: true,
            });
        }
    }
}

/// A unique id for leases and keys.
fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!(
        "{prefix}-{}-{nanos}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Import every image of an archive file.
pub async fn import(client: &Containerd, path: &Path, options: &ImportOptions) -> Result<Vec<Imported>, ImageError> {
    let archive = Archive::open(path)?;
    let lease = unique("runner-import");
    let mut labels = HashMap::new();
    let expire = std::time::SystemTime::now() + IMPORT_LEASE_TTL;
    labels.insert(
        LEASE_EXPIRE_LABEL.to_string(),
        humantime::format_rfc3339_seconds(expire).to_string(),
    );
    client.lease_create(&lease, labels).await?;
    let result = match archive.format {
        Format::Oci => import_oci(client, &lease, &archive, options).await,
        Format::Docker => import_docker(client, &lease, &archive, options).await,
        Format::Rootfs => import_rootfs(client, &lease, &archive, options).await.map(|i| vec![i]),
    };
    // The image records and GC labels now hold everything; the lease only protected the
    // pieces while they were unreferenced.
    if let Err(e) = client.lease_delete(&lease).await {
        tracing::warn!(lease, error = %e, "could not delete the import lease (it expires by itself)");
    }
    result
}

/// Write one blob from the archive unless containerd already has it.
async fn put_blob(
    client: &Containerd,
    lease: &str,
    archive: &Archive,
    member: archive::Member,
    desc: &JsonDescriptor,
    progress: &Progress,
    step: &str,
) -> Result<(), ImageError> {
    if client.content_info(&desc.digest).await?.is_some() {
        return Ok(());
    }
    use tokio::io::AsyncSeekExt;
    let io = |source| ImageError::Io {
        what: format!("reading {}", archive.path.display()),
        source,
    };
    let mut reader = tokio::fs::File::open(&archive.path).await.map_err(io)?;
    reader.seek(std::io::SeekFrom::Start(member.offset)).await.map_err(io)?;
    let limited = tokio::io::AsyncReadExt::take(reader, member.size);
    let total = member.size;
    client
        .content_write(lease, &desc.digest, desc.size as u64, limited, HashMap::new(), |done| {
            progress.update(step, done, total)
        })
        .await?;
    Ok(())
}

async fn put_bytes(
    client: &Containerd,
    lease: &str,
    digest: &str,
    data: Vec<u8>,
    labels: HashMap<String, String>,
) -> Result<(), ImageError> {
    let size = data.len() as u64;
    client
        .content_write(lease, digest, size, std::io::Cursor::new(data), labels, |_| {})
        .await?;
    Ok(())
}

/// The layers and config of one manifest are in the store: label, unpack, record.
struct ManifestParts {
    config_digest: String,
    config: JsonImageConfig,
    layers: Vec<JsonDescriptor>,
}

/// Unpack layers into the snapshotter (skipping chains already there); returns the top chain.
async fn unpack(
    client: &Containerd,
    lease: &str,
    parts: &ManifestParts,
    progress: &Progress,
) -> Result<String, ImageError> {
    let diff_ids = &parts.config.rootfs.diff_ids;
    if diff_ids.len() != parts.layers.len() {
        return Err(ImageError::Format(format!(
            "the config lists {} layers, the manifest {}",
            diff_ids.len(),
            parts.layers.len()
        )));
    }
    let chains = archive::chain_ids(diff_ids);
    for (i, layer) in parts.layers.iter().enumerate() {
        if client.snapshot_stat(&chains[i]).await?.is_some() {
            continue;
        }
        progress.update(
            &format!("unpacking layer {}/{}", i + 1, parts.layers.len()),
            i as u64,
            parts.layers.len() as u64,
        );
        let key = unique("runner-extract");
        let parent = if i == 0 { String::new() } else { chains[i - 1].clone() };
        let mounts = client.snapshot_prepare(lease, &key, &parent, HashMap::new()).await?;
        let applied = match client.diff_apply(descriptor(layer), mounts).await {
            Ok(a) => a,
            Err(e) => {
                let _ = client.snapshot_remove(&key).await;
                return Err(e.into());
            }
        };
        if applied.digest != diff_ids[i] {
            let _ = client.snapshot_remove(&key).await;
            return Err(ImageError::DiffIdMismatch {
                index: i,
                got: applied.digest,
                expected: diff_ids[i].clone(),
            });
        }
        match client.snapshot_commit(lease, &chains[i], &key, HashMap::new()).await {
            Ok(()) => {}
            // Another import committed the same chain meanwhile: same content, fine.
            Err(e) if e.is_already_exists() => {
                let _ = client.snapshot_remove(&key).await;
            }
            Err(e) => {
                let _ = client.snapshot_remove(&key).await;
                return Err(e.into());
            }
        }
    }
    chains
        .last()
        .cloned()
        .ok_or_else(|| ImageError::Format("the image has no layers".into()))
}

/// Config blob labels: the snapshot chain it unpacked to stays alive with it.
fn config_labels(top_chain: &str) -> HashMap<String, String> {
    HashMap::from([(GC_REF_SNAPSHOT.to_string(), top_chain.to_string())])
}

fn manifest_labels(parts: &ManifestParts) -> HashMap<String, String> {
    let mut labels = HashMap::from([(GC_REF_CONFIG.to_string(), parts.config_digest.clone())]);
    for (i, l) in parts.layers.iter().enumerate() {
        labels.insert(format!("{GC_REF_LAYER}{i}"), l.digest.clone());
    }
    labels
}

/// Write an unpacked manifest's config and manifest blobs with the GC labels that keep the
/// chain alive: config → snapshot, manifest → config and layers.
async fn put_manifest(
    client: &Containerd,
    lease: &str,
    parts: &ManifestParts,
    top_chain: &str,
    config_bytes: Vec<u8>,
    manifest_digest: &str,
    manifest_bytes: Vec<u8>,
) -> Result<(), ImageError> {
    put_bytes(
        client,
        lease,
        &parts.config_digest,
        config_bytes,
        config_labels(top_chain),
    )
    .await?;
    put_bytes(client, lease, manifest_digest, manifest_bytes, manifest_labels(parts)).await
}

/// An index's GC labels: it keeps the manifest it was resolved to (the only one stored).
fn index_labels(index_bytes: &[u8], chosen: &str) -> Result<HashMap<String, String>, ImageError> {
    let index: JsonIndex = parse_json("index", index_bytes)?;
    Ok(index
        .manifests
        .iter()
        .enumerate()
        .filter(|(_, m)| m.digest == chosen)
        .map(|(i, m)| (format!("{GC_REF_MANIFEST}{i}"), m.digest.clone()))
        .collect())
}

fn pick_platform(manifests: &[JsonDescriptor]) -> Option<&JsonDescriptor> {
    manifests
        .iter()
        .find(|m| {
            m.platform
                .as_ref()
                .is_some_and(|p| p.architecture == go_arch() && (p.os == "linux" || p.os.is_empty()))
        })
        .or_else(|| manifests.iter().find(|m| m.platform.is_none()))
}

async fn import_oci(
    client: &Containerd,
    lease: &str,
    archive: &Archive,
    options: &ImportOptions,
) -> Result<Vec<Imported>, ImageError> {
    let index: JsonIndex = parse_json("index.json", &archive.read_member("index.json")?)?;
    if index.manifests.is_empty() {
        return Err(ImageError::Format("index.json lists no manifests".into()));
    }
    let mut imported = Vec::new();
    for (n, top) in index.manifests.iter().enumerate() {
        let name = top
            .annotations
            .get(archive::ANNOTATION_CONTAINERD_NAME)
            .cloned()
            .or_else(|| {
                // A ref.name with a registry path is a full name; a bare tag needs --name.
                top.annotations
                    .get(archive::ANNOTATION_REF_NAME)
                    .filter(|r| r.contains('/') || r.contains(':') && !r.starts_with(':'))
                    .cloned()
            })
            .or_else(|| {
                let tag = top.annotations.get(archive::ANNOTATION_REF_NAME);
                match (&options.name, tag) {
                    (Some(base), Some(tag)) if !base.contains(':') => Some(format!("{base}:{tag}")),
                    (Some(name), _) => Some(name.clone()),
                    _ => None,
                }
            });
        let name = match (&options.name, name) {
            (Some(given), _) if index.manifests.len() == 1 => given.clone(),
            (_, Some(name)) => name,
            (None, None) => {
                return Err(ImageError::Format(format!(
                    "manifest {} of the archive has no name annotation; pass --name NAME",
                    n + 1
                )));
            }
            (Some(given), None) => given.clone(),
        };
        let name = normalize_name(&name)?;
        let progress = Progress::new(name.clone(), options.progress.clone());
        // Resolve an index to the manifest for this platform.
        let mut manifest_desc = top.clone();
        let mut index_chain: Vec<(JsonDescriptor, Vec<u8>)> = Vec::new();
        loop {
            let mt = manifest_desc.media_type.as_str();
            if mt == archive::OCI_INDEX || mt == archive::DOCKER_MANIFEST_LIST {
                let data = archive.read_member(&blob_path(&manifest_desc.digest)?)?;
                let nested: JsonIndex = parse_json("nested index", &data)?;
                let chosen = pick_platform(&nested.manifests)
                    .ok_or_else(|| ImageError::Format(format!("no manifest for linux/{} in {name}", go_arch())))?
                    .clone();
                index_chain.push((manifest_desc.clone(), data));
                manifest_desc = chosen;
            } else {
                break;
            }
        }
        let manifest_bytes = archive.read_member(&blob_path(&manifest_desc.digest)?)?;
        let manifest: JsonManifest = parse_json("manifest", &manifest_bytes)?;
        let config_bytes = archive.read_member(&blob_path(&manifest.config.digest)?)?;
        let config: JsonImageConfig = parse_json("image config", &config_bytes)?;
        for (i, layer) in manifest.layers.iter().enumerate() {
            let member = archive.blob(&layer.digest)?;
            let step = format!("layer {}/{}", i + 1, manifest.layers.len());
            put_blob(client, lease, archive, member, layer, &progress, &step).await?;
        }
        let parts = ManifestParts {
            config_digest: manifest.config.digest.clone(),
            config,
            layers: manifest.layers.clone(),
        };
        let top_chain = unpack(client, lease, &parts, &progress).await?;
        put_manifest(
            client,
            lease,
            &parts,
            &top_chain,
            config_bytes,
            &manifest_desc.digest,
            manifest_bytes,
        )
        .await?;
        // Nested indexes (multi-platform) keep the chosen manifest alive.
        let mut target = manifest_desc.clone();
        for (desc, data) in index_chain.into_iter().rev() {
            let labels = index_labels(&data, &target.digest)?;
            put_bytes(client, lease, &desc.digest, data, labels).await?;
            target = desc;
        }
        if target.media_type.is_empty() {
            target.media_type = manifest
                .media_type
                .clone()
                .unwrap_or_else(|| archive::OCI_MANIFEST.into());
        }
        client.image_put(&name, descriptor(&target), HashMap::new()).await?;
        progress.done();
        imported.push(Imported {
            name,
            digest: target.digest,
            layers: parts.layers.len(),
            format: "oci",
        });
    }
    Ok(imported)
}

fn blob_path(digest: &str) -> Result<String, ImageError> {
    let (algo, hex) = digest
        .split_once(':')
        .ok_or_else(|| ImageError::Format(format!("bad digest {digest:?}")))?;
    if algo != "sha256" || hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ImageError::Format(format!("unsupported digest {digest:?}")));
    }
    Ok(format!("blobs/{algo}/{hex}"))
}

/// Digest and media type of a layer file inside an archive (gzip detected by magic).
fn layer_descriptor(
    archive: &Archive,
    member: archive::Member,
    docker: bool,
) -> Result<(JsonDescriptor, bool), ImageError> {
    use std::io::Read;
    let io = |source| ImageError::Io {
        what: "reading a layer".into(),
        source,
    };
    let mut head = [0u8; 2];
    let mut r = archive.reader(member)?;
    let n = r.read(&mut head).map_err(io)?;
    let gzip = n == 2 && head == [0x1f, 0x8b];
    let (digest, size) = archive::sha256_of(archive.reader(member)?).map_err(io)?;
    let media_type = match (docker, gzip) {
        (true, false) => archive::DOCKER_LAYER_TAR,
        (true, true) => archive::DOCKER_LAYER_GZIP,
        (false, false) => archive::OCI_LAYER_TAR,
        (false, true) => archive::OCI_LAYER_GZIP,
    };
    Ok((
        JsonDescriptor {
            media_type: media_type.into(),
            digest,
            size: size as i64,
            annotations: HashMap::new(),
            platform: None,
        },
        gzip,
    ))
}

async fn import_docker(
    client: &Containerd,
    lease: &str,
    archive: &Archive,
    options: &ImportOptions,
) -> Result<Vec<Imported>, ImageError> {
    let entries: Vec<DockerEntry> = parse_json("manifest.json", &archive.read_member("manifest.json")?)?;
    let mut imported = Vec::new();
    for entry in &entries {
        let mut names: Vec<String> = entry.repo_tags.clone().unwrap_or_default();
        if let Some(n) = &options.name {
            names = vec![n.clone()];
        }
        if names.is_empty() {
            return Err(ImageError::Format(
                "an image of the docker archive has no RepoTags; pass --name NAME".into(),
            ));
        }
        let names = names.iter().map(|n| normalize_name(n)).collect::<Result<Vec<_>, _>>()?;
        let progress = Progress::new(names[0].clone(), options.progress.clone());
        let config_bytes = archive.read_member(&entry.config)?;
        let config: JsonImageConfig = parse_json("image config", &config_bytes)?;
        let config_digest = archive::sha256_bytes(&config_bytes);
        let mut layers = Vec::new();
        for (i, path) in entry.layers.iter().enumerate() {
            let member = archive
                .member(path)
                .ok_or_else(|| ImageError::Format(format!("layer {path} is missing from the archive")))?;
            let (desc, _) = layer_descriptor(archive, member, true)?;
            let step = format!("layer {}/{}", i + 1, entry.layers.len());
            put_blob(client, lease, archive, member, &desc, &progress, &step).await?;
            layers.push(desc);
        }
        let parts = ManifestParts {
            config_digest: config_digest.clone(),
            config,
            layers,
        };
        let top_chain = unpack(client, lease, &parts, &progress).await?;
        put_bytes(
            client,
            lease,
            &config_digest,
            config_bytes.clone(),
            config_labels(&top_chain),
        )
        .await?;
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": archive::DOCKER_MANIFEST,
            "config": {"mediaType": archive::DOCKER_CONFIG, "digest": config_digest, "size": config_bytes.len()},
            "layers": parts.layers,
        });
        let manifest_bytes = serde_json::to_vec(&manifest).map_err(|e| ImageError::Format(e.to_string()))?;
        let manifest_digest = archive::sha256_bytes(&manifest_bytes);
        let manifest_size = manifest_bytes.len() as i64;
        put_bytes(client, lease, &manifest_digest, manifest_bytes, manifest_labels(&parts)).await?;
        for name in &names {
            client
                .image_put(
                    name,
                    Descriptor {
                        media_type: archive::DOCKER_MANIFEST.into(),
                        digest: manifest_digest.clone(),
                        size: manifest_size,
                        annotations: HashMap::new(),
                    },
                    HashMap::new(),
                )
                .await?;
            imported.push(Imported {
                name: name.clone(),
                digest: manifest_digest.clone(),
                layers: parts.layers.len(),
                format: "docker",
            });
        }
        progress.done();
    }
    Ok(imported)
}

async fn import_rootfs(
    client: &Containerd,
    lease: &str,
    archive: &Archive,
    options: &ImportOptions,
) -> Result<Imported, ImageError> {
    let name = options.name.as_deref().ok_or_else(|| {
        ImageError::Format(format!(
            "{} is a plain rootfs tarball: pass --name NAME (and optionally --cmd, --env, --workdir, --user)",
            archive.path.display()
        ))
    })?;
    let name = normalize_name(name)?;
    let progress = Progress::new(name.clone(), options.progress.clone());
    let size = std::fs::metadata(&archive.path)
        .map_err(|source| ImageError::Io {
            what: format!("reading {}", archive.path.display()),
            source,
        })?
        .len();
    let whole = archive::Member { offset: 0, size };
    let (layer, gzip) = layer_descriptor(archive, whole, false)?;
    let diff_id = archive::diff_id(archive.reader(whole)?, gzip).map_err(|source| ImageError::Io {
        what: "decompressing the layer".into(),
        source,
    })?;
    put_blob(client, lease, archive, whole, &layer, &progress, "layer 1/1").await?;
    let mut env = vec![format!("PATH={}", crate::spec::DEFAULT_PATH)];
    env.extend(options.env.iter().cloned());
    let run = JsonRunConfig {
        env: Some(env.clone()),
        cmd: options.cmd.clone(),
        working_dir: options.workdir.clone(),
        user: options.user.clone(),
        labels: None,
    };
    let config_json = serde_json::json!({
        "architecture": go_arch(),
        "os": "linux",
        "config": {"Env": run.env, "Cmd": run.cmd, "WorkingDir": run.working_dir.unwrap_or_default(), "User": run.user.unwrap_or_default()},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "runner image import"}],
    });
    let config_bytes = serde_json::to_vec(&config_json).map_err(|e| ImageError::Format(e.to_string()))?;
    let config_digest = archive::sha256_bytes(&config_bytes);
    let parts = ManifestParts {
        config_digest: config_digest.clone(),
        config: parse_json("generated config", &config_bytes)?,
        layers: vec![layer],
    };
    let top_chain = unpack(client, lease, &parts, &progress).await?;
    let mut labels = config_labels(&top_chain);
    labels.insert(UNCOMPRESSED_LABEL.into(), diff_id);
    put_bytes(client, lease, &config_digest, config_bytes.clone(), labels).await?;
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": archive::OCI_MANIFEST,
        "config": {"mediaType": archive::OCI_CONFIG, "digest": config_digest, "size": config_bytes.len()},
        "layers": parts.layers,
    });
    let manifest_bytes = serde_json::to_vec(&manifest).map_err(|e| ImageError::Format(e.to_string()))?;
    let manifest_digest = archive::sha256_bytes(&manifest_bytes);
    let manifest_size = manifest_bytes.len() as i64;
    put_bytes(client, lease, &manifest_digest, manifest_bytes, manifest_labels(&parts)).await?;
    client
        .image_put(
            &name,
            Descriptor {
                media_type: archive::OCI_MANIFEST.into(),
                digest: manifest_digest.clone(),
                size: manifest_size,
                annotations: HashMap::new(),
            },
            HashMap::new(),
        )
        .await?;
    progress.done();
    Ok(Imported {
        name,
        digest: manifest_digest,
        layers: 1,
        format: "rootfs",
    })
}

/// What a run needs from an image: its unpacked snapshot chain and its environment.
#[derive(Clone, Debug)]
pub struct ImageInfo {
    pub name: String,
    pub top_chain: String,
    pub config: JsonRunConfig,
    /// The workspace a snapshot made with its workspace carries (`None`: none). Boxed: most
    /// images have none, and this travels in every claim's result.
    pub workspace: Option<Box<WorkspaceSeed>>,
}

/// Label of a snapshot image's config: the path its workspace was mounted at, under which
/// its top layer holds the workspace's files, first.
pub const WORKSPACE_LABEL: &str = "dev.runner.snapshot.workspace";
/// Label of the same config: bytes of the top layer's tar, from its start, that hold them
/// (that part alone reads as a tar of the workspace).
pub const WORKSPACE_BYTES_LABEL: &str = "dev.runner.snapshot.workspace-bytes";

/// Where a snapshot's workspace is: the first `bytes` of the uncompressed tar of layer
/// `layer_digest`, its members under `target` (without the leading `/`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkspaceSeed {
    /// The path in the container (`/workspace`).
    pub target: String,
    pub layer_digest: String,
    pub layer_media_type: String,
    pub bytes: u64,
}

impl WorkspaceSeed {
    /// The seed an image's config labels and top layer describe; `None` when the labels say
    /// none (or are not runner's to read).
    fn of(config: &JsonRunConfig, manifest: &JsonManifest) -> Option<Box<WorkspaceSeed>> {
        let labels = config.labels.as_ref()?;
        let target = labels.get(WORKSPACE_LABEL)?;
        let bytes = labels.get(WORKSPACE_BYTES_LABEL)?.parse().ok()?;
        let top = manifest.layers.last()?;
        Some(Box::new(WorkspaceSeed {
            target: target.clone(),
            layer_digest: top.digest.clone(),
            layer_media_type: top.media_type.clone(),
            bytes,
        }))
    }
}

/// Index, manifest and config blobs read by `resolve`, by digest: content-addressed (the
/// Content store verifies the digest), so a blob read once is the blob forever. Every job and
/// session resolves its image; this keeps that to the image record and the snapshot check.
fn read_cache() -> &'static std::sync::Mutex<std::collections::HashMap<String, std::sync::Arc<Vec<u8>>>> {
    static CACHE: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<String, std::sync::Arc<Vec<u8>>>>> =
        std::sync::OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// Blobs larger than this are read every time (configs and manifests are a few kB).
const CACHED_BLOB_LIMIT: usize = 1 << 20;
/// Entries kept before the cache starts over.
const CACHED_BLOBS: usize = 512;

async fn read_blob(client: &Containerd, digest: &str) -> Result<std::sync::Arc<Vec<u8>>, ImageError> {
    if let Some(hit) = read_cache().lock().expect("blob cache").get(digest) {
        return Ok(hit.clone());
    }
    let blob = std::sync::Arc::new(client.content_read(digest).await?);
    if blob.len() <= CACHED_BLOB_LIMIT {
        let mut cache = read_cache().lock().expect("blob cache");
        if cache.len() >= CACHED_BLOBS {
            cache.clear();
        }
        cache.insert(digest.to_string(), blob.clone());
    }
    Ok(blob)
}

/// Look an image up: manifest (through an index if needed) → config → top snapshot chain,
/// which must be unpacked.
pub async fn resolve(client: &Containerd, name: &str) -> Result<ImageInfo, ImageError> {
    let image = client
        .image_get(name)
        .await?
        .ok_or_else(|| ImageError::NotFound(name.to_string()))?;
    let mut target = image
        .target
        .ok_or_else(|| ImageError::Format(format!("image {name} has no target")))?;
    for _ in 0..4 {
        if target.media_type == archive::OCI_INDEX || target.media_type == archive::DOCKER_MANIFEST_LIST {
            let index: JsonIndex = parse_json("index", &read_blob(client, &target.digest).await?)?;
            let chosen = pick_platform(&index.manifests)
                .ok_or_else(|| ImageError::Format(format!("no manifest for linux/{} in {name}", go_arch())))?;
            target = descriptor(chosen);
        } else {
            break;
        }
    }
    let manifest: JsonManifest = parse_json("manifest", &read_blob(client, &target.digest).await?)?;
    let config: JsonImageConfig = parse_json("image config", &read_blob(client, &manifest.config.digest).await?)?;
    let chains = archive::chain_ids(&config.rootfs.diff_ids);
    let top_chain = chains
        .last()
        .cloned()
        .ok_or_else(|| ImageError::Format(format!("image {name} has no layers")))?;
    if client.snapshot_stat(&top_chain).await?.is_none() {
        return Err(ImageError::Format(format!(
            "image {name} is not unpacked into {SNAPSHOTTER}; re-import it"
        )));
    }
    let run = config.config.unwrap_or_default();
    Ok(ImageInfo {
        name: name.to_string(),
        top_chain,
        workspace: WorkspaceSeed::of(&run, &manifest),
        config: run,
    })
}

/// Size of an image's content for this platform (manifest, config, compressed layers) and
/// when it was built, for `image ls`; `None` where a blob is missing.
pub async fn summary(client: &Containerd, target: &Descriptor) -> (Option<i64>, Option<String>) {
    let mut target = target.clone();
    let mut size = 0;
    if target.media_type == archive::OCI_INDEX || target.media_type == archive::DOCKER_MANIFEST_LIST {
        let Ok(blob) = read_blob(client, &target.digest).await else {
            return (None, None);
        };
        let Ok(index) = parse_json::<JsonIndex>("index", &blob) else {
            return (None, None);
        };
        let Some(chosen) = pick_platform(&index.manifests) else {
            return (None, None);
        };
        size += target.size;
        target = descriptor(chosen);
    }
    let Ok(blob) = read_blob(client, &target.digest).await else {
        return (None, None);
    };
    let Ok(manifest) = parse_json::<JsonManifest>("manifest", &blob) else {
        return (None, None);
    };
    size += target.size + manifest.config.size + manifest.layers.iter().map(|l| l.size).sum::<i64>();
    let created = match read_blob(client, &manifest.config.digest).await {
        Ok(c) => parse_json::<JsonImageConfig>("image config", &c)
            .ok()
            .and_then(|c| c.created),
        Err(_) => None,
    };
    (Some(size), created)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_get_a_default_tag_and_bad_names_are_refused() {
        assert_eq!(normalize_name("local/bbx").unwrap(), "local/bbx:latest");
        assert_eq!(normalize_name("local/bbx:1").unwrap(), "local/bbx:1");
        assert_eq!(normalize_name("localhost:5000/x").unwrap(), "localhost:5000/x:latest");
        assert!(normalize_name("bad name").is_err());
        assert!(normalize_name("").is_err());
        assert!(normalize_name("/abs").is_err());
    }
}
