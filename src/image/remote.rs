//! Images from registries: `runner image pull|push|tag` and pulls by `imagePullPolicy`.
//!
//! A pull resolves the reference to a manifest (through an index, for the platform asked),
//! streams every missing blob into containerd's Content store under a lease, unpacks the
//! layers by the same path `image import` uses, writes the config and manifests with the GC
//! labels that keep the whole chain alive, and records the image. Layer blobs go through
//! `Containerd::content_ingest`: the ingest ref is the blob's digest, so a second pull of
//! the same blob (in this process or another) waits for the first instead of downloading
//! it again, and a pull that was interrupted resumes where the stored bytes end. containerd
//! verifies size and digest at commit; manifests and configs are verified here before use.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use containerd_client::types::Descriptor;
use futures::StreamExt;
use oci_client::Reference;
use oci_client::client::BlobResponse;
use oci_client::errors::OciDistributionError;
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use sha2::{Digest, Sha256};

pub use crate::manifest::PullPolicy;

use super::archive::{self, JsonDescriptor, JsonImageConfig, JsonIndex, JsonManifest, parse_json};
use super::registry::{Endpoint, RegistryConfig};
use super::{
    IMPORT_LEASE_TTL, ImageError, ImageInfo, ManifestParts, Progress, descriptor, go_arch, index_labels, put_bytes,
    put_manifest, unique, unpack,
};
use crate::containerd::{ByteStream, Containerd, Ingest, IngestBlob, LEASE_EXPIRE_LABEL};

/// The manifest media types a pull accepts (schema 1 is refused: deprecated and unsigned).
const ACCEPT: &[&str] = &[
    archive::OCI_INDEX,
    archive::DOCKER_MANIFEST_LIST,
    archive::OCI_MANIFEST,
    archive::DOCKER_MANIFEST,
];
/// Manifests, indexes and configs larger than this are refused (they are a few kB).
const MAX_METADATA_BYTES: usize = 16 << 20;
/// Layers downloaded at once.
const PARALLEL_LAYERS: usize = 3;
/// How often a pull waiting for another pull's download looks again.
const LOCK_POLL: Duration = Duration::from_millis(200);

/// `os/arch[/variant]`, as `--platform` takes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Platform {
    pub os: String,
    pub architecture: String,
    pub variant: Option<String>,
}

impl Platform {
    /// This machine's.
    pub fn host() -> Self {
        Platform {
            os: "linux".into(),
            architecture: go_arch().into(),
            variant: None,
        }
    }

    fn matches(&self, p: &archive::JsonPlatform) -> bool {
        p.os == self.os
            && p.architecture == self.architecture
            && match (&self.variant, &p.variant) {
                (Some(want), Some(got)) => want == got,
                (Some(_), None) => false,
                (None, _) => true,
            }
    }
}

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

impl FromStr for Platform {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split('/').collect();
        match parts.as_slice() {
            [os, arch] if !os.is_empty() && !arch.is_empty() => Ok(Platform {
                os: os.to_string(),
                architecture: arch.to_string(),
                variant: None,
            }),
            [os, arch, variant] if !os.is_empty() && !arch.is_empty() && !variant.is_empty() => Ok(Platform {
                os: os.to_string(),
                architecture: arch.to_string(),
                variant: Some(variant.to_string()),
            }),
            _ => Err(format!("{s:?} is not a platform (OS/ARCH[/VARIANT], e.g. linux/amd64)")),
        }
    }
}

/// One step of a pull, for whoever shows progress.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PullEvent {
    pub image: String,
    /// A blob's digest; empty for image-wide steps.
    pub digest: String,
    /// `resolved`, `waiting` (another pull is downloading it), `downloading`, `exists`,
    /// `downloaded`, `unpacking`, `done`.
    pub status: &'static str,
    pub done: u64,
    pub total: u64,
}

/// Receives pull events.
pub type PullProgressFn = Arc<dyn Fn(&PullEvent) + Send + Sync>;

/// `event(digest, status, done, total)` for one image, to whoever listens (or no one).
fn emitter(sink: Option<PullProgressFn>, image: String) -> impl Fn(&str, &'static str, u64, u64) + Sync {
    move |digest, status, done, total| {
        if let Some(sink) = &sink {
            sink(&PullEvent {
                image: image.clone(),
                digest: digest.to_string(),
                status,
                done,
                total,
            });
        }
    }
}

#[derive(Clone, Default)]
pub struct PullOptions {
    /// Default: this machine's.
    pub platform: Option<Platform>,
    pub registry: RegistryConfig,
    pub progress: Option<PullProgressFn>,
}

/// What a pull produced.
#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Pulled {
    pub name: String,
    /// The image's target (an index's digest when the reference named an index).
    pub digest: String,
    pub platform: String,
    pub layers: usize,
    /// Bytes downloaded by this pull (blobs already present or fetched by another pull are
    /// not counted).
    pub downloaded: u64,
    /// The registry host the content came from (a mirror, or the registry).
    pub from: String,
}

/// A reference as Docker users write it (`python:3.12` → `docker.io/library/python:3.12`).
pub fn parse_reference(text: &str) -> Result<Reference, ImageError> {
    Reference::from_str(text).map_err(|e| ImageError::Name(format!("{text:?} is not a valid image name: {e}")))
}

/// A reference for messages: as the user wrote it, with the full name it stands for when
/// that differs (`pyhton:3.12 (docker.io/library/pyhton:3.12)`).
fn as_written(text: &str, full: &str) -> String {
    if text == full {
        full.to_string()
    } else {
        format!("{text} ({full})")
    }
}

/// The name a reference is stored under in containerd (its full form, as ctr and nerdctl
/// store pulled images).
pub fn canonical_name(text: &str) -> Result<String, ImageError> {
    Ok(parse_reference(text)?.whole())
}

fn sha256(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// A registry error as users need it: the reference, the registry's own message, and the
/// underlying cause (DNS, TLS, refused connection).
fn registry_error(what: &str, e: OciDistributionError) -> ImageError {
    let detail = match &e {
        OciDistributionError::UnauthorizedError { url } => format!(
            "401 Unauthorized from {url}: the registry refused the credentials (Docker's config.json auths or \
             credential helper for this host)"
        ),
        OciDistributionError::AuthenticationFailure(m) => format!("authentication failed: {m}"),
        OciDistributionError::RegistryError { envelope, url } => {
            let errors: Vec<String> = envelope
                .errors
                .iter()
                .map(|x| {
                    let code = serde_json::to_string(&x.code).unwrap_or_default();
                    format!("{} {}", code.trim_matches('"'), x.message)
                })
                .collect();
            format!("the registry said {} ({url})", errors.join("; "))
        }
        OciDistributionError::ServerError { code, url, message } => {
            format!("HTTP {code} from {url}: {}", message.trim())
        }
        _ => {
            let mut text = super::with_causes(&e);
            if text.contains("InvalidContentType") {
                // rustls' words for an answer that is not TLS at all.
                text.push_str(" (the registry does not speak TLS: if it serves plain HTTP, say so with --insecure-registry HOST[:PORT] or an http:// host in hosts.toml)");
            }
            text
        }
    };
    ImageError::Registry(format!("{what}: {detail}"))
}

/// A registry endpoint with its client and credentials, and the reference as it addresses it.
struct Remote {
    endpoint: Endpoint,
    client: oci_client::Client,
    auth: RegistryAuth,
    /// The client-certificate bridge the client goes through, if any: it lives as long.
    bridge: Option<super::mtls::Bridge>,
}

impl Remote {
    fn new(endpoint: Endpoint) -> Result<Self, ImageError> {
        let (client, bridge) = endpoint.client()?;
        Ok(Remote {
            client,
            auth: endpoint.auth()?,
            endpoint,
            bridge,
        })
    }

    /// A registry error, with what the client-certificate bridge saw when it is one the
    /// bridge answered (oci-client reports a 502 without its body).
    fn error(&self, what: &str, e: OciDistributionError) -> ImageError {
        let err = registry_error(what, e);
        match self.bridge.as_ref().and_then(|b| b.last_failure()) {
            Some(failure) if !err.to_string().contains(&failure) => ImageError::Registry(format!("{err} ({failure})")),
            _ => err,
        }
    }

    /// The reference as sent to this endpoint (a mirror is asked for the same repository).
    fn address(&self, reference: &Reference) -> Reference {
        let mut r = reference.clone();
        if r.resolve_registry() != self.endpoint.host {
            r.set_mirror_registry(self.endpoint.host.clone());
        }
        r
    }

    async fn manifest(&self, reference: &Reference) -> Result<(Vec<u8>, String), OciDistributionError> {
        let (bytes, digest) = self
            .client
            .pull_manifest_raw(&self.address(reference), &self.auth, ACCEPT)
            .await?;
        Ok((bytes.to_vec(), digest))
    }

    async fn small_blob(&self, reference: &Reference, desc: &JsonDescriptor) -> Result<Vec<u8>, ImageError> {
        let what = format!("fetching {} of {reference}", desc.digest);
        if desc.size < 0 || desc.size as usize > MAX_METADATA_BYTES {
            return Err(ImageError::Format(format!("{what}: {} bytes is too large", desc.size)));
        }
        let mut out = Vec::with_capacity(desc.size as usize);
        self.client
            .pull_blob(&self.address(reference), &oci_descriptor(desc), &mut out)
            .await
            .map_err(|e| self.error(&what, e))?;
        if out.len() as i64 != desc.size || sha256(&out) != desc.digest {
            return Err(ImageError::Format(format!(
                "{what}: the registry sent {} bytes with digest {}, not {} bytes with digest {}",
                out.len(),
                sha256(&out),
                desc.size,
                desc.digest
            )));
        }
        Ok(out)
    }
}

fn oci_descriptor(d: &JsonDescriptor) -> OciDescriptor {
    OciDescriptor {
        media_type: d.media_type.clone(),
        digest: d.digest.clone(),
        size: d.size,
        ..OciDescriptor::default()
    }
}

/// What kind of manifest a blob is, by its own `mediaType` or, failing that, its shape.
fn media_type_of(bytes: &[u8], told: Option<&str>) -> Result<String, ImageError> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Probe {
        schema_version: Option<i64>,
        media_type: Option<String>,
        manifests: Option<serde_json::Value>,
        config: Option<serde_json::Value>,
    }
    let probe: Probe = parse_json("manifest", bytes)?;
    if probe.schema_version == Some(1) {
        return Err(ImageError::Format(
            "Docker schema 1 manifests are not supported (deprecated since 2017; re-push the image)".into(),
        ));
    }
    let mt = probe
        .media_type
        .or_else(|| told.map(str::to_string).filter(|t| !t.is_empty()))
        .unwrap_or_else(|| {
            if probe.manifests.is_some() {
                archive::OCI_INDEX.into()
            } else if probe.config.is_some() {
                archive::OCI_MANIFEST.into()
            } else {
                String::new()
            }
        });
    if ACCEPT.contains(&mt.as_str()) {
        Ok(mt)
    } else {
        Err(ImageError::Format(format!("unsupported manifest media type {mt:?}")))
    }
}

/// Pull `text` into containerd; returns what was stored.
pub async fn pull(client: &Containerd, text: &str, options: &PullOptions) -> Result<Pulled, ImageError> {
    let reference = parse_reference(text)?;
    let name = reference.whole();
    let shown = as_written(text, &name);
    let platform = options.platform.clone().unwrap_or_else(Platform::host);
    let endpoints = options.registry.endpoints(reference.registry())?;
    let mut failures = Vec::new();
    // Mirrors first; the registry itself last. A mirror that cannot serve the manifest is
    // skipped (as containerd does); the registry's own error is the one reported.
    let mut found = None;
    for endpoint in endpoints.into_iter().filter(|e| e.pull) {
        let remote = Remote::new(endpoint)?;
        match remote.manifest(&reference).await {
            Ok(m) => {
                found = Some((remote, m));
                break;
            }
            Err(e) => {
                let err = remote.error(&format!("pulling {shown} from {}", remote.endpoint.host), e);
                if remote.endpoint.mirror {
                    tracing::info!(error = %err, "mirror failed; trying the next host");
                }
                failures.push(err.to_string());
            }
        }
    }
    let Some((remote, (top_bytes, _))) = found else {
        return Err(ImageError::Registry(failures.join("; then ")));
    };
    let top_digest = sha256(&top_bytes);
    if let Some(want) = reference.digest()
        && want != top_digest
    {
        return Err(ImageError::Format(format!(
            "pulling {shown}: the registry sent a manifest with digest {top_digest}, not {want}"
        )));
    }
    let top_type = media_type_of(&top_bytes, None)?;
    let event = emitter(options.progress.clone(), name.clone());
    event(&top_digest, "resolved", 0, 0);

    // An index: pick the platform's manifest and fetch it by digest.
    let mut index: Option<(JsonDescriptor, Vec<u8>, JsonDescriptor)> = None;
    let (manifest_desc, manifest_bytes) = if top_type == archive::OCI_INDEX || top_type == archive::DOCKER_MANIFEST_LIST
    {
        let parsed: JsonIndex = parse_json("index", &top_bytes)?;
        let chosen = parsed
            .manifests
            .iter()
            .find(|m| m.platform.as_ref().is_some_and(|p| platform.matches(p)))
            .cloned()
            .ok_or_else(|| {
                let offered: Vec<String> = parsed
                    .manifests
                    .iter()
                    .filter_map(|m| m.platform.as_ref())
                    .map(|p| format!("{}/{}", p.os, p.architecture))
                    .collect();
                ImageError::Format(format!(
                    "{shown} has no manifest for {platform} (it has: {})",
                    offered.join(", ")
                ))
            })?;
        let by_digest = reference.clone_with_digest(chosen.digest.clone());
        let (bytes, _) = remote
            .manifest(&by_digest)
            .await
            .map_err(|e| remote.error(&format!("pulling the {platform} manifest of {shown}"), e))?;
        if sha256(&bytes) != chosen.digest {
            return Err(ImageError::Format(format!(
                "pulling {shown}: the registry sent a {platform} manifest with digest {}, not {}",
                sha256(&bytes),
                chosen.digest
            )));
        }
        let top = JsonDescriptor {
            media_type: top_type.clone(),
            digest: top_digest.clone(),
            size: top_bytes.len() as i64,
            annotations: HashMap::new(),
            platform: None,
        };
        index = Some((top, top_bytes.clone(), chosen.clone()));
        (chosen, bytes)
    } else {
        let desc = JsonDescriptor {
            media_type: top_type.clone(),
            digest: top_digest.clone(),
            size: top_bytes.len() as i64,
            annotations: HashMap::new(),
            platform: None,
        };
        (desc, top_bytes.clone())
    };
    let manifest_type = media_type_of(&manifest_bytes, Some(&manifest_desc.media_type))?;
    if manifest_type == archive::OCI_INDEX || manifest_type == archive::DOCKER_MANIFEST_LIST {
        return Err(ImageError::Format(format!(
            "{name}: an index inside an index is not supported"
        )));
    }
    let manifest: JsonManifest = parse_json("manifest", &manifest_bytes)?;
    let config_bytes = remote.small_blob(&reference, &manifest.config).await?;
    let config: JsonImageConfig = parse_json("image config", &config_bytes)?;
    if let (Some(os), Some(arch)) = (&config.os, &config.architecture)
        && (os != &platform.os || arch != &platform.architecture)
    {
        return Err(ImageError::Format(format!(
            "{name} is an image for {os}/{arch}, not {platform} (pass --platform {os}/{arch} to pull it anyway)"
        )));
    }

    let lease = unique("runner-pull");
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
    let result = store(
        client,
        &lease,
        &remote,
        &reference,
        &name,
        manifest,
        (manifest_desc, manifest_bytes),
        (config, config_bytes),
        index,
        &event,
    )
    .await;
    if let Err(e) = client.lease_delete(&lease).await {
        tracing::warn!(lease, error = %e, "could not delete the pull lease (it expires by itself)");
    }
    let (digest, layers, downloaded) = result?;
    event("", "done", downloaded, downloaded);
    Ok(Pulled {
        name,
        digest,
        platform: platform.to_string(),
        layers,
        downloaded,
        from: remote.endpoint.host.clone(),
    })
}

/// Download the layers, unpack, write the metadata blobs with GC labels, record the image.
#[allow(clippy::too_many_arguments)]
async fn store(
    client: &Containerd,
    lease: &str,
    remote: &Remote,
    reference: &Reference,
    name: &str,
    manifest: JsonManifest,
    (manifest_desc, manifest_bytes): (JsonDescriptor, Vec<u8>),
    (config, config_bytes): (JsonImageConfig, Vec<u8>),
    index: Option<(JsonDescriptor, Vec<u8>, JsonDescriptor)>,
    event: &(dyn Fn(&str, &'static str, u64, u64) + Sync),
) -> Result<(String, usize, u64), ImageError> {
    // Built eagerly and joined (not a stream combinator over a closure): the futures borrow
    // this call's data, and a lazily mapped stream of them is not provably Send.
    let slots = tokio::sync::Semaphore::new(PARALLEL_LAYERS);
    let mut pending = Vec::new();
    for layer in &manifest.layers {
        let slots = &slots;
        pending.push(async move {
            let _slot = slots.acquire().await.map_err(|e| ImageError::Format(e.to_string()))?;
            fetch_layer(client, lease, remote, reference, layer, event).await
        });
    }
    let downloads = futures::future::join_all(pending).await;
    let mut downloaded = 0;
    for d in downloads {
        downloaded += d?;
    }
    let parts = ManifestParts {
        config_digest: manifest.config.digest.clone(),
        config,
        layers: manifest.layers.clone(),
    };
    let progress = Progress::new(name.to_string(), None);
    event("", "unpacking", 0, parts.layers.len() as u64);
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
    let target = match index {
        Some((top, bytes, chosen)) => {
            let labels = index_labels(&bytes, &chosen.digest)?;
            put_bytes(client, lease, &top.digest, bytes, labels).await?;
            top
        }
        None => manifest_desc,
    };
    client.image_put(name, descriptor(&target), HashMap::new()).await?;
    Ok((target.digest, parts.layers.len(), downloaded))
}

/// One layer into the Content store, unless it is there; the bytes this call downloaded.
async fn fetch_layer(
    client: &Containerd,
    lease: &str,
    remote: &Remote,
    reference: &Reference,
    layer: &JsonDescriptor,
    event: &(dyn Fn(&str, &'static str, u64, u64) + Sync),
) -> Result<u64, ImageError> {
    let total = layer.size.max(0) as u64;
    let ingest_ref = format!("runner-pull-{}", layer.digest);
    let mut waited = false;
    loop {
        if client.content_info(&layer.digest).await?.is_some() {
            event(&layer.digest, "exists", total, total);
            return Ok(0);
        }
        // The first report is where the stream starts (bytes an earlier pull stored).
        let (mut first, mut last) = (None::<u64>, 0u64);
        let open = |stored: u64| async move {
            if stored >= total {
                // Every byte is stored already (an interrupted pull, or content another
                // namespace shares): containerd's commit checks them.
                let empty: ByteStream = Box::pin(futures::stream::empty());
                return Ok((stored, empty));
            }
            let what = format!("downloading {} of {reference}", layer.digest);
            let desc = oci_descriptor(layer);
            let addressed = remote.address(reference);
            let response = remote
                .client
                .pull_blob_stream_partial(&addressed, &desc, stored, None)
                .await
                .map_err(|e| crate::containerd::CtdError::Protocol {
                    op: "registry",
                    message: remote.error(&what, e).to_string(),
                })?;
            Ok::<(u64, ByteStream), crate::containerd::CtdError>(match response {
                BlobResponse::Full(s) => (0, s.stream),
                BlobResponse::Partial(s) => (stored, s.stream),
            })
        };
        let outcome = client
            .content_ingest(
                IngestBlob {
                    lease,
                    reference: &ingest_ref,
                    digest: &layer.digest,
                    size: total,
                    labels: HashMap::new(),
                },
                open,
                |done| {
                    first.get_or_insert(done);
                    last = done;
                    event(&layer.digest, "downloading", done, total);
                },
            )
            .await
            .map_err(|e| match e {
                crate::containerd::CtdError::Protocol {
                    op: "registry",
                    message,
                } => ImageError::Registry(message),
                other => ImageError::Format(format!("storing layer {} of {reference}: {other}", layer.digest)),
            })?;
        match outcome {
            Ingest::Committed => {
                event(&layer.digest, "downloaded", total, total);
                return Ok(last.saturating_sub(first.unwrap_or(last)));
            }
            Ingest::Locked => {
                if !waited {
                    event(&layer.digest, "waiting", 0, total);
                    waited = true;
                }
                tokio::time::sleep(LOCK_POLL).await;
            }
        }
    }
}

/// Make sure `image` is present per `policy`, pulling when it says so; then resolve it.
/// The name is looked up as written first (local imports), then in its full form.
pub async fn ensure(
    client: &Containerd,
    image: &str,
    policy: Option<PullPolicy>,
    registry: &RegistryConfig,
) -> Result<ImageInfo, ImageError> {
    let explicit = policy.is_some();
    let resolved = policy.unwrap_or_else(|| PullPolicy::default_for(image));
    if let Some(name) = image.strip_prefix(super::SNAPSHOT_PREFIX) {
        // A snapshot is in this containerd namespace or nowhere: no registry has it, whatever
        // the pull policy says.
        return match super::resolve(client, &super::normalize_name(image)?).await {
            Err(ImageError::NotFound(_)) => Err(ImageError::Registry(format!(
                "no snapshot {name:?} in this containerd namespace (`runner snapshot ls` lists them)"
            ))),
            other => other,
        };
    }
    let local = async {
        match super::resolve(client, &super::normalize_name(image)?).await {
            Err(ImageError::NotFound(_)) => super::resolve(client, &canonical_name(image)?).await,
            other => other,
        }
    };
    match resolved {
        PullPolicy::Never => local.await.map_err(|e| match e {
            ImageError::NotFound(n) => {
                ImageError::Registry(format!("image {n:?} is not present and imagePullPolicy is Never"))
            }
            other => other,
        }),
        PullPolicy::IfNotPresent => match local.await {
            Err(ImageError::NotFound(_)) => pull_and_resolve(client, image, registry, resolved, explicit).await,
            other => other,
        },
        PullPolicy::Always => pull_and_resolve(client, image, registry, resolved, explicit).await,
    }
}

/// A name as people write it: without Docker Hub's `docker.io/library/` or `docker.io/`, and
/// without `:latest`.
fn written(name: &str) -> &str {
    let short = name
        .strip_prefix("docker.io/library/")
        .or_else(|| name.strip_prefix("docker.io/"))
        .unwrap_or(name);
    short.strip_suffix(":latest").unwrap_or(short)
}

/// The local images whose names are a few edits from `image`'s (closest first, at most three).
pub async fn near_local_names(client: &Containerd, image: &str) -> Vec<String> {
    let Ok(images) = client.images().await else {
        return Vec::new();
    };
    let want = written(image);
    let limit = (want.len() / 5).max(2);
    let mut near: Vec<(usize, String)> = images
        .iter()
        .map(|i| written(&i.name).to_string())
        .filter(|n| n != want)
        .map(|n| (edit_distance(want, &n), n))
        .filter(|(d, _)| *d <= limit)
        .collect();
    near.sort();
    near.dedup_by(|a, b| a.1 == b.1);
    near.into_iter().take(3).map(|(_, n)| n).collect()
}

/// Edits (insert, delete, substitute, swap two neighbours) from `a` to `b`.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            d[i][j] = (d[i - 1][j] + 1).min(d[i][j - 1] + 1).min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d[i][j] = d[i][j].min(d[i - 2][j - 2] + 1);
            }
        }
    }
    d[a.len()][b.len()]
}

async fn pull_and_resolve(
    client: &Containerd,
    image: &str,
    registry: &RegistryConfig,
    policy: PullPolicy,
    explicit: bool,
) -> Result<ImageInfo, ImageError> {
    let options = PullOptions {
        registry: registry.clone(),
        ..PullOptions::default()
    };
    match pull(client, image, &options).await {
        Ok(pulled) => super::resolve(client, &pulled.name).await,
        // Not here, and not to be had: say so first, with the local images it may have meant
        // (a typo of a local image's name otherwise reads as a registry's DNS error).
        Err(e) if policy == PullPolicy::IfNotPresent => {
            let near = near_local_names(client, image).await;
            let hint = match near.as_slice() {
                [] => " (see `runner image ls`)".to_string(),
                names => format!(" (did you mean {}? see `runner image ls`)", names.join(" or ")),
            };
            Err(ImageError::Registry(format!(
                "image {image:?} is not present locally{hint}, and pulling it failed: {e}"
            )))
        }
        Err(e) => {
            let hint = if policy == PullPolicy::Always
                && super::resolve(client, &super::normalize_name(image)?).await.is_ok()
            {
                format!(
                    " (imagePullPolicy is Always{}; a local image {image:?} exists: set imagePullPolicy: \
                     IfNotPresent to run it)",
                    if explicit {
                        ""
                    } else {
                        ", Kubernetes' default for :latest or untagged images"
                    }
                )
            } else {
                String::new()
            };
            Err(ImageError::Registry(format!("{e}{hint}")))
        }
    }
}

/// The record of a local image, looked up as written (local imports) then in full form.
pub async fn local_image(client: &Containerd, text: &str) -> Result<(String, Descriptor), ImageError> {
    let mut names = vec![super::normalize_name(text)?];
    if let Ok(full) = canonical_name(text) {
        names.push(full);
    }
    for name in &names {
        if let Some(image) = client.image_get(name).await? {
            let target = image
                .target
                .ok_or_else(|| ImageError::Format(format!("image {name} has no target")))?;
            return Ok((name.clone(), target));
        }
    }
    Err(ImageError::NotFound(names[0].clone()))
}

/// `runner image tag SOURCE TARGET`: a second name for the same content.
pub async fn tag(client: &Containerd, source: &str, target: &str) -> Result<String, ImageError> {
    let (_, desc) = local_image(client, source).await?;
    let target = super::normalize_name(target)?;
    client.image_put(&target, desc, HashMap::new()).await?;
    Ok(target)
}

/// What a push sent.
#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Pushed {
    pub name: String,
    pub digest: String,
    /// Blobs uploaded (the others were in the registry already).
    pub uploaded: usize,
    pub skipped: usize,
}

/// `runner image push NAME`: the image's manifest for this platform (an index is pushed as
/// the manifest of the platform it was pulled or imported for), its config and layers, to
/// the registry the name points at. The manifest's bytes are sent unchanged, so its digest
/// in the registry is the local one.
pub async fn push(client: &Containerd, text: &str, options: &PullOptions) -> Result<Pushed, ImageError> {
    let (local_name, mut target) = local_image(client, text).await?;
    let platform = options.platform.clone().unwrap_or_else(Platform::host);
    if target.media_type == archive::OCI_INDEX || target.media_type == archive::DOCKER_MANIFEST_LIST {
        let index: JsonIndex = parse_json("index", &client.content_read(&target.digest).await?)?;
        let chosen = index
            .manifests
            .iter()
            .find(|m| m.platform.as_ref().is_some_and(|p| platform.matches(p)))
            .ok_or_else(|| ImageError::Format(format!("{local_name} has no manifest for {platform}")))?;
        target = descriptor(chosen);
    }
    let manifest_bytes = client.content_read(&target.digest).await?;
    let manifest: JsonManifest = parse_json("manifest", &manifest_bytes)?;
    let media_type = media_type_of(&manifest_bytes, Some(&target.media_type))?;
    let reference = parse_reference(&local_name)?;
    let endpoint = options
        .registry
        .endpoints(reference.registry())?
        .into_iter()
        // containerd's order: the first host that takes pushes (a `[host]` entry before the
        // `server`, as for pulls), so both read one configuration (its CA, its certificate).
        .find(|e| e.push)
        .ok_or_else(|| {
            ImageError::Registry(format!(
                "no host of {} takes pushes (hosts.toml capabilities)",
                reference.registry()
            ))
        })?;
    let remote = Remote::new(endpoint)?;
    let name = reference.whole();
    remote
        .client
        .store_auth_if_needed(remote.address(&reference).resolve_registry(), &remote.auth)
        .await;
    let addressed = remote.address(&reference);
    let what = format!("pushing {} to {}", as_written(text, &name), remote.endpoint.host);
    let event = emitter(options.progress.clone(), name.clone());
    let (mut uploaded, mut skipped, mut sent_bytes) = (0, 0, 0);
    for blob in manifest.layers.iter().chain(std::iter::once(&manifest.config)) {
        let total = blob.size.max(0) as u64;
        if remote
            .client
            .blob_exists(&addressed, &blob.digest)
            .await
            .map_err(|e| remote.error(&what, e))?
        {
            event(&blob.digest, "exists", total, total);
            skipped += 1;
            continue;
        }
        event(&blob.digest, "uploading", 0, total);
        let stream = client.content_stream(&blob.digest).await?;
        let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counter = sent.clone();
        let counted = stream.map(move |chunk| {
            chunk
                .inspect(|c| {
                    counter.fetch_add(c.len() as u64, std::sync::atomic::Ordering::Relaxed);
                })
                .map_err(OciDistributionError::IoError)
        });
        remote
            .client
            .push_blob_stream(&addressed, counted, &blob.digest, Some(total))
            .await
            .map_err(|e| remote.error(&format!("{what}: blob {}", blob.digest), e))?;
        let n = sent.load(std::sync::atomic::Ordering::Relaxed);
        sent_bytes += n;
        event(&blob.digest, "uploaded", n, total);
        uploaded += 1;
    }
    let content_type = http::HeaderValue::from_str(&media_type)
        .map_err(|e| ImageError::Format(format!("media type {media_type:?}: {e}")))?;
    remote
        .client
        .push_manifest_raw(&addressed, manifest_bytes.clone(), content_type)
        .await
        .map_err(|e| remote.error(&format!("{what}: the manifest"), e))?;
    event("", "done", sent_bytes, sent_bytes);
    Ok(Pushed {
        name,
        digest: sha256(&manifest_bytes),
        uploaded,
        skipped,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn typos_are_a_few_edits_from_what_was_meant() {
        assert_eq!(edit_distance("local/pyhton:3.11", "local/python:3.11"), 1);
        assert_eq!(edit_distance("busybox", "busybx"), 1);
        assert_eq!(edit_distance("a", "xyz"), 3);
        assert_eq!(written("docker.io/library/python:latest"), "python");
        assert_eq!(written("local/python:3.11"), "local/python:3.11");
    }

    use super::*;

    #[test]
    fn references_normalise_as_docker_users_write_them() {
        assert_eq!(canonical_name("python:3.12").unwrap(), "docker.io/library/python:3.12");
        assert_eq!(canonical_name("busybox").unwrap(), "docker.io/library/busybox:latest");
        assert_eq!(canonical_name("localhost:5000/a/b:1").unwrap(), "localhost:5000/a/b:1");
        let d = format!("sha256:{}", "a".repeat(64));
        assert_eq!(
            canonical_name(&format!("quay.io/x/y@{d}")).unwrap(),
            format!("quay.io/x/y@{d}")
        );
        assert!(canonical_name("bad name").is_err());
        assert!(canonical_name("a//b").is_err());
    }

    #[test]
    fn pull_policy_defaults_are_kubernetes_ones() {
        assert_eq!(PullPolicy::default_for("python"), PullPolicy::Always);
        assert_eq!(PullPolicy::default_for("python:latest"), PullPolicy::Always);
        assert_eq!(PullPolicy::default_for("localhost:5000/python"), PullPolicy::Always);
        assert_eq!(
            PullPolicy::default_for("localhost:5000/python:3"),
            PullPolicy::IfNotPresent
        );
        let d = format!("sha256:{}", "a".repeat(64));
        assert_eq!(
            PullPolicy::default_for(&format!("python@{d}")),
            PullPolicy::IfNotPresent
        );
        assert!("Sometimes".parse::<PullPolicy>().is_err());
    }

    #[test]
    fn platforms_parse_and_match() {
        let p: Platform = "linux/arm64/v8".parse().unwrap();
        assert_eq!(p.to_string(), "linux/arm64/v8");
        assert!("linux".parse::<Platform>().is_err());
        let host = Platform::host();
        let entry = archive::JsonPlatform {
            os: "linux".into(),
            architecture: go_arch().into(),
            variant: None,
        };
        assert!(host.matches(&entry));
    }

    #[test]
    fn manifest_kinds_are_told_apart_and_schema1_is_refused() {
        assert_eq!(
            media_type_of(br#"{"schemaVersion":2,"manifests":[]}"#, None).unwrap(),
            archive::OCI_INDEX
        );
        assert_eq!(
            media_type_of(br#"{"schemaVersion":2,"config":{}}"#, None).unwrap(),
            archive::OCI_MANIFEST
        );
        assert!(
            media_type_of(br#"{"schemaVersion":1}"#, None)
                .unwrap_err()
                .to_string()
                .contains("schema 1")
        );
    }
}
