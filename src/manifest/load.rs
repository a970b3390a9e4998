//! Reading manifests: files, env dirs and text split into documents, each decoded by kind
//! with bounded YAML (depth, aliases, scalar size), and jobs bound to their Environments.

use super::*;

/// Everything one manifest file (plus `--env-dir`) defines.
#[derive(Clone, Debug, Default)]
pub struct ManifestSet {
    pub environments: Vec<Environment>,
    pub jobs: Vec<Job>,
    pub pools: Vec<WarmPool>,
    /// `kind: Network` documents.
    pub networks: Vec<NetworkDef>,
    /// Environments found in `--env-dir`, consulted after the file's own.
    pub env_dir: Vec<Environment>,
    /// Networks found in `--env-dir`, consulted after the file's own.
    pub env_dir_networks: Vec<NetworkDef>,
    pub env_dir_path: Option<PathBuf>,
}

/// A Job together with the Environment it runs in, checked against each other for the
/// backend that will run it.
#[derive(Clone, Debug)]
pub struct Bound {
    pub job: Job,
    pub env: Environment,
    pub backend: Backend,
    pub network: NetworkMode,
    /// The named network a bridge container joins (`None`: runner's default one).
    pub bridge: Option<NetworkDef>,
}

impl ManifestSet {
    /// The Environment a job names: first this file's, then `--env-dir`'s.
    pub fn environment_for(&self, job: &Job) -> Result<&Environment, ManifestError> {
        self.environments
            .iter()
            .chain(self.env_dir.iter())
            .find(|e| e.name == job.environment)
            .ok_or_else(|| {
                let searched = match &self.env_dir_path {
                    Some(dir) => format!(" nor in {}", dir.display()),
                    None => " (pass --env-dir DIR to look elsewhere)".to_string(),
                };
                ManifestError::new(
                    job.environment_origin.clone(),
                    ManifestErrorKind::EnvironmentNotFound {
                        name: job.environment.clone(),
                        searched,
                    },
                )
                .in_document(format!("Job {:?}", job.name))
                .with_file(&job.file)
            })
    }

    /// The Environment a warm pool names (first this file's, then `--env-dir`'s): it must
    /// run on containerd.
    pub fn pool_environment(&self, pool: &WarmPool) -> Result<&Environment, ManifestError> {
        let err = |kind| {
            ManifestError::new(pool.environment_origin.clone(), kind)
                .in_document(format!("WarmPool {:?}", pool.name))
                .with_file(&pool.file)
        };
        let env = self
            .environments
            .iter()
            .chain(self.env_dir.iter())
            .find(|e| e.name == pool.environment)
            .ok_or_else(|| {
                err(ManifestErrorKind::EnvironmentNotFound {
                    name: pool.environment.clone(),
                    searched: match &self.env_dir_path {
                        Some(dir) => format!(" nor in {}", dir.display()),
                        None => " (pass --env-dir DIR to look elsewhere)".to_string(),
                    },
                })
            })?;
        if env.backend != Backend::Containerd {
            return Err(err(ManifestErrorKind::PoolBackend {
                environment: env.name.clone(),
            }));
        }
        Ok(env)
    }

    /// Pair a job with its environment and run the checks that need both; a named network
    /// is looked up here (this file's Networks, then `--env-dir`'s).
    pub fn bind(&self, job: &Job, backend: Option<Backend>) -> Result<Bound, ManifestError> {
        let env = self.environment_for(job)?;
        let mut bound = bind_inner(job, env, backend)?;
        if let Some(name) = &env.network_name {
            let found = self
                .networks
                .iter()
                .chain(self.env_dir_networks.iter())
                .find(|n| &n.name == name);
            let Some(def) = found else {
                let searched = match &self.env_dir_path {
                    Some(dir) => format!(" nor in {}", dir.display()),
                    None => " (pass --env-dir DIR to look elsewhere)".to_string(),
                };
                return Err(ManifestError::new(
                    env.origin("spec.network"),
                    ManifestErrorKind::Yaml(format!(
                        "no Network {name:?} among this manifest's documents{searched} (a network is none, host, bridge or the name of a Network document)"
                    )),
                )
                .in_document(format!("Environment {:?}", env.name))
                .with_file(&env.origins.file));
            };
            bound.bridge = Some(def.clone());
        }
        Ok(bound)
    }

    /// Use the Environments and Networks of `--env-dir`.
    pub fn use_env_dir(&mut self, dir: &Path) -> Result<(), ManifestError> {
        self.use_loaded_env_dir(dir, load_env_dir_all(dir)?);
        Ok(())
    }

    /// `use_env_dir` with what `load_env_dir_all` read of `dir` (maybe before this set was
    /// parsed).
    pub fn use_loaded_env_dir(&mut self, dir: &Path, (environments, networks): (Vec<Environment>, Vec<NetworkDef>)) {
        self.env_dir = environments;
        self.env_dir_networks = networks;
        self.env_dir_path = Some(dir.to_path_buf());
    }
}

impl ManifestError {
    fn with_file(self, file: &Option<PathBuf>) -> Self {
        match file {
            Some(f) => self.in_file(f),
            None => self,
        }
    }
}

/// Checks that need both documents and the backend that will run them. An Environment on a
/// named network binds only with its manifest (`ManifestSet::bind`), which has the network.
pub fn bind(job: &Job, env: &Environment, backend: Option<Backend>) -> Result<Bound, ManifestError> {
    if let Some(name) = &env.network_name {
        return Err(ManifestError::new(
            env.origin("spec.network"),
            ManifestErrorKind::Yaml(format!(
                "network {name:?} is a Network document's: bind with its manifest"
            )),
        ));
    }
    bind_inner(job, env, backend)
}

pub(super) fn bind_inner(job: &Job, env: &Environment, backend: Option<Backend>) -> Result<Bound, ManifestError> {
    let backend = backend.unwrap_or(env.backend);
    if let Some((written, origin)) = &job.backend
        && *written != backend
    {
        return Err(ManifestError::new(
            origin.clone(),
            ManifestErrorKind::BackendMismatch {
                written: *written,
                resolved: backend,
                environment: env.name.clone(),
            },
        )
        .in_document(format!("Job {:?}", job.name))
        .with_file(&job.file));
    }
    let env_err = |path: &str, loc: Option<Location>, kind| {
        ManifestError::new(Origin::new(path, loc), kind)
            .in_document(format!("Environment {:?}", env.name))
            .with_file(&env.origins.file)
    };
    let job_err = |origin: &Origin, kind| {
        ManifestError::new(origin.clone(), kind)
            .in_document(format!("Job {:?}", job.name))
            .with_file(&job.file)
    };
    let network = match (backend, env.network) {
        (Backend::Host, Some(NetworkMode::Bridge)) => {
            return Err(env_err(
                "spec.network",
                env.origins.network,
                ManifestErrorKind::HostNetwork("bridge"),
            ));
        }
        (Backend::Host, Some(NetworkMode::None)) => {
            return Err(env_err(
                "spec.network",
                env.origins.network,
                ManifestErrorKind::HostNetwork("none"),
            ));
        }
        (Backend::Host, _) => NetworkMode::Host,
        (Backend::Containerd, n) => n.unwrap_or(NetworkMode::None),
    };
    if backend == Backend::Host {
        if let Some(m) = env.mounts.first() {
            return Err(env_err(
                &m.target_origin.path,
                m.target_origin.location,
                ManifestErrorKind::HostMounts,
            ));
        }
        if let Some(m) = job.mounts.first() {
            return Err(job_err(&m.target_origin, ManifestErrorKind::HostMounts));
        }
    }
    if backend == Backend::Containerd {
        if env.image.is_none() {
            return Err(env_err("spec.image", None, ManifestErrorKind::ImageRequired));
        }
        if env.include_host_env {
            return Err(env_err(
                "spec.includeHostEnv",
                env.origins.include_host_env,
                ManifestErrorKind::HostEnvInContainer,
            ));
        }
        // The host's network namespace belongs to the host's user namespace: a container in
        // its own cannot mount /sys for it (Kubernetes refuses hostNetwork without hostUsers
        // too).
        if network == NetworkMode::Host && !env.host_users {
            return Err(env_err(
                "spec.network",
                env.origins.network,
                ManifestErrorKind::HostNetworkNeedsHostUsers,
            ));
        }
        if !env.host_users
            && let Some(UserSpec::Ids { uid, gid }) = env.user
            && let Some(id) = [uid, gid].into_iter().find(|&id| u64::from(id) >= USERNS_IDS)
        {
            return Err(env_err(
                "spec.user",
                env.origins.user,
                ManifestErrorKind::IdOutsideUserns { id, size: USERNS_IDS },
            ));
        }
    }
    if env.mount_workspace {
        let workdir = paths::normalize(&env.workdir);
        let under = |m: &MountSpec| paths::is_within(&paths::normalize(&m.target), &workdir);
        if let Some(m) = job.mounts.iter().find(|m| under(m)) {
            return Err(job_err(
                &m.target_origin,
                ManifestErrorKind::TargetUnderWorkdir {
                    target: m.target.clone(),
                    workdir: env.workdir.clone(),
                },
            ));
        }
    }
    Ok(Bound {
        job: job.clone(),
        env: env.clone(),
        backend,
        network,
        bridge: None,
    })
}

/// Read and validate one manifest file, and the Environments of `env_dir` if given.
pub fn load_file(path: &Path, env_dir: Option<&Path>) -> Result<ManifestSet, ManifestError> {
    Ok(load_file_text(path, env_dir)?.0)
}

/// The directory a manifest file's relative paths are anchored in.
pub fn base_dir_of(path: &Path) -> PathBuf {
    path.parent()
        .map(|p| if p.as_os_str().is_empty() { Path::new(".") } else { p })
        .unwrap_or(Path::new("."))
        .to_path_buf()
}

/// As `load_file`, also returning the text that was read (read once: what is stored is what
/// was validated).
pub fn load_file_text(path: &Path, env_dir: Option<&Path>) -> Result<(ManifestSet, String), ManifestError> {
    let text = read_limited(path)?;
    let set = parse_file_text(&text, path, &base_dir_of(path), env_dir)?;
    Ok((set, text))
}

/// A manifest file's text as another process read it (`read_limited`): errors name the file
/// as `shown`, relative paths resolve against `base_dir`.
pub fn parse_file_text(
    text: &str,
    shown: &Path,
    base_dir: &Path,
    env_dir: Option<&Path>,
) -> Result<ManifestSet, ManifestError> {
    let mut set = parse_str(text, base_dir, Some(shown))?;
    if set.environments.is_empty() && set.jobs.is_empty() && set.pools.is_empty() && set.networks.is_empty() {
        return Err(ManifestError::new(Origin::new("", None), ManifestErrorKind::Empty).in_file(shown));
    }
    if let Some(dir) = env_dir {
        set.use_env_dir(dir)?;
    }
    Ok(set)
}

/// Every Environment in the `*.yaml`/`*.yml` files of a directory (their Jobs are ignored).
pub fn load_env_dir(dir: &Path) -> Result<Vec<Environment>, ManifestError> {
    Ok(load_env_dir_all(dir)?.0)
}

/// What an env dir defined, by directory, with the stamps of the files it was parsed from: a
/// server reads its env dir for every session and job it is asked for, and parsing every file
/// each time was most of a pooled session's manifest phase. A file added, removed, replaced or
/// written (its inode, size, modification or change time) is parsed again; an env dir is the
/// operator's, never a sandbox's to write.
type EnvDirContents = std::sync::Arc<(Vec<Environment>, Vec<NetworkDef>)>;
static ENV_DIRS: std::sync::Mutex<Vec<(PathBuf, Vec<FileStamp>, EnvDirContents)>> = std::sync::Mutex::new(Vec::new());
/// Env dirs kept at once (a process has one or two).
const ENV_DIRS_KEPT: usize = 8;

#[derive(Debug, PartialEq, Eq)]
struct FileStamp {
    path: PathBuf,
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

/// How old every file of an env dir must be before what it defines is kept (see below).
const ENV_DIR_SETTLED: Duration = Duration::from_secs(2);

/// Every Environment and Network in the `*.yaml`/`*.yml` files of a directory.
pub fn load_env_dir_all(dir: &Path) -> Result<(Vec<Environment>, Vec<NetworkDef>), ManifestError> {
    load_env_dir_kept(dir, ENV_DIR_SETTLED)
}

fn load_env_dir_kept(dir: &Path, settle: Duration) -> Result<(Vec<Environment>, Vec<NetworkDef>), ManifestError> {
    use std::os::unix::fs::MetadataExt;
    let read_err = |e| ManifestError::new(Origin::new("", None), ManifestErrorKind::Read(e)).in_file(dir);
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(read_err)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")))
        .collect();
    files.sort();
    // Stamped before they are read: a file written in between is parsed again next time.
    let stamps: Option<Vec<FileStamp>> = files
        .iter()
        .map(|f| {
            let m = std::fs::metadata(f).ok()?;
            Some(FileStamp {
                path: f.clone(),
                dev: m.dev(),
                ino: m.ino(),
                len: m.len(),
                mtime: (m.mtime(), m.mtime_nsec()),
                ctime: (m.ctime(), m.ctime_nsec()),
            })
        })
        .collect();
    let kept = ENV_DIRS.lock().expect("env dir cache lock");
    if let Some((_, _, contents)) = kept.iter().find(|(d, s, _)| d == dir && stamps.as_ref() == Some(s)) {
        return Ok(contents.as_ref().clone());
    }
    drop(kept);
    let contents = parse_env_dir(dir, files)?;
    // As git's racily clean index entries: a file changed within the clock's granularity
    // (a coarse tick, milliseconds) of its stamp could change again, at the same size, under
    // the same stamp; such a directory is parsed every time until its files are older.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i128);
    let settled =
        |(sec, nsec): (i64, i64)| (sec as i128) * 1_000_000_000 + nsec as i128 + (settle.as_nanos() as i128) < now;
    if let Some(stamps) = stamps.filter(|s| s.iter().all(|f| settled(f.mtime) && settled(f.ctime))) {
        let mut kept = ENV_DIRS.lock().expect("env dir cache lock");
        kept.retain(|(d, _, _)| d != dir);
        if kept.len() >= ENV_DIRS_KEPT {
            kept.remove(0);
        }
        kept.push((dir.to_path_buf(), stamps, std::sync::Arc::new(contents.clone())));
    }
    Ok(contents)
}

#[cfg(test)]
thread_local! {
    /// Env dirs parsed by this thread (tests run on threads of their own): what shows a
    /// kept directory is not parsed again.
    static ENV_DIRS_PARSED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn parse_env_dir(dir: &Path, files: Vec<PathBuf>) -> Result<(Vec<Environment>, Vec<NetworkDef>), ManifestError> {
    #[cfg(test)]
    ENV_DIRS_PARSED.with(|n| n.set(n.get() + 1));
    let mut envs: Vec<Environment> = Vec::new();
    let mut networks: Vec<NetworkDef> = Vec::new();
    for file in files {
        let text = read_limited(&file)?;
        let set = parse_str(&text, dir, Some(&file))?;
        for net in set.networks {
            if let Some(other) = networks.iter().find(|n| n.name == net.name || n.overlaps(&net)) {
                return Err(ManifestError::new(
                    Origin::new("spec.subnet", None),
                    ManifestErrorKind::Yaml(format!(
                        "Network {:?} ({}) clashes with Network {:?} ({}) of the same directory",
                        net.name,
                        net.cidr(),
                        other.name,
                        other.cidr()
                    )),
                )
                .in_file(&file));
            }
            networks.push(net);
        }
        for env in set.environments {
            if envs.iter().any(|e| e.name == env.name) {
                return Err(ManifestError::new(
                    Origin::new("metadata.name", None),
                    ManifestErrorKind::Duplicate {
                        kind: "Environment",
                        name: env.name.clone(),
                    },
                )
                .in_file(&file));
            }
            envs.push(env);
        }
    }
    Ok((envs, networks))
}

/// A manifest file's text, refused past `MAX_MANIFEST_BYTES` or when not UTF-8.
pub fn read_limited(path: &Path) -> Result<String, ManifestError> {
    let err = |kind| ManifestError::new(Origin::new("", None), kind).in_file(path);
    let meta = std::fs::metadata(path).map_err(|e| err(ManifestErrorKind::Read(e)))?;
    if meta.len() > MAX_MANIFEST_BYTES {
        return Err(err(ManifestErrorKind::TooLarge {
            size: meta.len(),
            limit: MAX_MANIFEST_BYTES,
        }));
    }
    let bytes = std::fs::read(path).map_err(|e| err(ManifestErrorKind::Read(e)))?;
    String::from_utf8(bytes).map_err(|e| {
        err(ManifestErrorKind::Yaml(format!(
            "manifest is not UTF-8 (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        )))
    })
}

/// Parse and validate manifest text. `base_dir` anchors relative workspace and asset paths.
pub fn parse_str(text: &str, base_dir: &Path, file: Option<&Path>) -> Result<ManifestSet, ManifestError> {
    let mut set = ManifestSet::default();
    let attach = |e: ManifestError| match file {
        Some(f) => e.in_file(f),
        None => e,
    };
    for (index, doc) in split_documents(text).into_iter().enumerate() {
        let label = format!("document {}", index + 1);
        let header: raw::Header = decode(&doc).map_err(|e| attach(e.in_document(label.clone())))?;
        let loc = |s: &Spanned<String>| location(&s.referenced, doc.first_line);
        let Some(api) = &header.api_version else {
            return Err(attach(
                ManifestError::new(
                    Origin::new("apiVersion", None),
                    ManifestErrorKind::MissingApiVersion { expected: API_VERSION },
                )
                .in_document(label),
            ));
        };
        if api.value != API_VERSION {
            return Err(attach(
                ManifestError::new(
                    Origin::new("apiVersion", loc(api)),
                    ManifestErrorKind::ApiVersion {
                        found: api.value.clone(),
                        expected: API_VERSION,
                    },
                )
                .in_document(label),
            ));
        }
        let Some(kind) = &header.kind else {
            return Err(attach(
                ManifestError::new(Origin::new("kind", None), ManifestErrorKind::MissingKind).in_document(label),
            ));
        };
        match kind.value.as_str() {
            "Environment" => {
                let raw: raw::EnvironmentDoc = decode(&doc).map_err(|e| attach(e.in_document(label.clone())))?;
                let doc_name = format!("Environment {:?}", raw.metadata.name.value);
                let env = validate_environment(raw, doc.first_line, file)
                    .map_err(|e| attach(e.in_document(doc_name.clone())))?;
                if set.environments.iter().any(|e| e.name == env.name) {
                    return Err(attach(
                        ManifestError::new(
                            Origin::new("metadata.name", None),
                            ManifestErrorKind::Duplicate {
                                kind: "Environment",
                                name: env.name,
                            },
                        )
                        .in_document(doc_name),
                    ));
                }
                set.environments.push(env);
            }
            "Job" => {
                let raw: raw::JobDoc = decode(&doc).map_err(|e| attach(e.in_document(label.clone())))?;
                let doc_name = format!("Job {:?}", raw.metadata.name.value);
                let job = validate_job(raw, doc.first_line, base_dir, file)
                    .map_err(|e| attach(e.in_document(doc_name.clone())))?;
                if set.jobs.iter().any(|j| j.name == job.name) {
                    return Err(attach(
                        ManifestError::new(
                            Origin::new("metadata.name", None),
                            ManifestErrorKind::Duplicate {
                                kind: "Job",
                                name: job.name,
                            },
                        )
                        .in_document(doc_name),
                    ));
                }
                set.jobs.push(job);
            }
            "WarmPool" => {
                let raw: raw::WarmPoolDoc = decode(&doc).map_err(|e| attach(e.in_document(label.clone())))?;
                let doc_name = format!("WarmPool {:?}", raw.metadata.name.value);
                let pool =
                    validate_pool(raw, doc.first_line, file).map_err(|e| attach(e.in_document(doc_name.clone())))?;
                if set.pools.iter().any(|p| p.name == pool.name) {
                    return Err(attach(
                        ManifestError::new(
                            Origin::new("metadata.name", None),
                            ManifestErrorKind::Duplicate {
                                kind: "WarmPool",
                                name: pool.name,
                            },
                        )
                        .in_document(doc_name),
                    ));
                }
                set.pools.push(pool);
            }
            "Network" => {
                let raw: raw::NetworkDoc = decode(&doc).map_err(|e| attach(e.in_document(label.clone())))?;
                let doc_name = format!("Network {:?}", raw.metadata.name.value);
                let net = validate_network(raw, doc.first_line).map_err(|e| attach(e.in_document(doc_name.clone())))?;
                if let Some(other) = set.networks.iter().find(|n| n.name == net.name || n.overlaps(&net)) {
                    let why = if other.name == net.name {
                        ManifestErrorKind::Duplicate {
                            kind: "Network",
                            name: net.name,
                        }
                    } else {
                        ManifestErrorKind::Yaml(format!(
                            "subnet {} overlaps Network {:?}'s {}",
                            net.cidr(),
                            other.name,
                            other.cidr()
                        ))
                    };
                    return Err(attach(
                        ManifestError::new(Origin::new("spec.subnet", None), why).in_document(doc_name),
                    ));
                }
                set.networks.push(net);
            }
            other => {
                return Err(attach(
                    ManifestError::new(
                        Origin::new("kind", loc(kind)),
                        ManifestErrorKind::Kind(other.to_string()),
                    )
                    .in_document(label),
                ));
            }
        }
    }
    Ok(set)
}

/// A Job document that is already a JSON value (the one a session's request makes): decoded
/// from the value and validated as `parse_str` would, without printing it as text for the YAML
/// parser (that round trip was 0.45 ms of a pooled session's 5 ms create).
pub fn parse_job_value(doc: &serde_json::Value, base_dir: &Path) -> Result<Job, ManifestError> {
    use serde::Deserialize;
    let label = "document 1".to_string();
    match (doc.get("apiVersion"), doc.get("kind")) {
        (Some(serde_json::Value::String(api)), Some(serde_json::Value::String(kind)))
            if api == API_VERSION && kind == "Job" => {}
        _ => {
            return Err(ManifestError::new(
                Origin::new("kind", None),
                ManifestErrorKind::Yaml(format!("a {API_VERSION} Job document was expected")),
            )
            .in_document(label));
        }
    }
    check_value_shape(doc, "").map_err(|e| e.in_document(label.clone()))?;
    let mut track = serde_path_to_error::Track::new();
    let raw = raw::JobDoc::deserialize(serde_path_to_error::Deserializer::new(doc, &mut track)).map_err(|err| {
        ManifestError::new(
            Origin::new(field_path(track), None),
            ManifestErrorKind::Yaml(err.to_string()),
        )
        .in_document(label.clone())
    })?;
    let doc_name = format!("Job {:?}", raw.metadata.name.value);
    validate_job(raw, 0, base_dir, None).map_err(|e| e.in_document(doc_name))
}

/// What a JSON value may not hold where the YAML parser would have refused it: serde_json
/// reads an array as a struct (its fields in order, unknown ones unchecked), and
/// serde-saphyr's `Spanned` takes a mapping with its private marker key as a span it made.
/// Every struct of a Job document is a mapping, and no key is that marker.
fn check_value_shape(value: &serde_json::Value, path: &str) -> Result<(), ManifestError> {
    use serde_json::Value;
    let refuse = |path: &str, why: String| {
        Err(ManifestError::new(
            Origin::new(path, None),
            ManifestErrorKind::Yaml(why),
        ))
    };
    match value {
        Value::Object(map) => {
            for (key, item) in map {
                let at = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                if key.starts_with("__serde_saphyr") {
                    return refuse(&at, format!("unknown field `{key}`"));
                }
                check_value_shape(item, &at)?;
            }
        }
        Value::Array(items) => {
            // The lists of a Job document whose entries are mappings.
            let of_maps = ["spec.staticAssets", "spec.mounts"].contains(&path);
            for (i, item) in items.iter().enumerate() {
                let at = format!("{path}[{i}]");
                if of_maps && !item.is_object() {
                    return refuse(&at, format!("invalid type: {}, expected a mapping", value_kind(item)));
                }
                check_value_shape(item, &at)?;
            }
        }
        _ => {}
    }
    Ok(())
}

fn value_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a sequence",
        serde_json::Value::Object(_) => "a mapping",
    }
}

/// One YAML document of a stream, with the line it starts on in the whole file.
pub(super) struct Document {
    text: String,
    /// 0-based line of the file where `text` begins.
    first_line: u64,
}

/// Split a stream at `---` / `...` marker lines. YAML forbids these markers at column 0 inside
/// content, so a line scan is exact; splitting ourselves lets each document be parsed on its
/// own with the strict type its `kind` asks for, while positions stay those of the file.
pub(super) fn split_documents(text: &str) -> Vec<Document> {
    let mut docs = Vec::new();
    let mut current = String::new();
    let mut first_line = 0u64;
    let is_marker = |line: &str, marker: &str| {
        line.strip_prefix(marker)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t', '\r']))
    };
    for (n, line) in text.split_inclusive('\n').enumerate() {
        let n = n as u64;
        let bare = line.trim_end_matches('\n');
        if is_marker(bare, "---") || is_marker(bare, "...") {
            if has_content(&current) {
                docs.push(Document {
                    text: std::mem::take(&mut current),
                    first_line,
                });
            }
            current.clear();
            first_line = n;
            if is_marker(bare, "---") {
                // Keep what follows `---` on the same line (`--- {a: 1}`), at its column.
                current.push_str("   ");
                current.push_str(&line[3..]);
            } else {
                current.push('\n');
            }
        } else {
            current.push_str(line);
        }
    }
    if has_content(&current) {
        docs.push(Document {
            text: current,
            first_line,
        });
    }
    docs
}

pub(super) fn has_content(text: &str) -> bool {
    text.lines().any(|l| {
        let t = l.trim();
        !t.is_empty() && !t.starts_with('#') && !t.starts_with('%')
    })
}

pub(super) fn yaml_options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_depth: MAX_YAML_DEPTH,
            max_aliases: MAX_YAML_ALIASES,
            max_total_scalar_bytes: MAX_YAML_SCALAR_BYTES,
            max_documents: 1,
        },
    }
}

pub(super) fn location(loc: &serde_saphyr::Location, first_line: u64) -> Option<Location> {
    (loc.line() > 0).then(|| Location {
        line: loc.line() + first_line,
        column: loc.column(),
    })
}

/// Deserialize one document into a raw type, keeping the serde path of a failure.
pub(super) fn decode<T: DeserializeOwned>(doc: &Document) -> Result<T, ManifestError> {
    let mut track = serde_path_to_error::Track::new();
    let result = serde_saphyr::with_deserializer_from_str_with_options(&doc.text, yaml_options(), |de| {
        T::deserialize(serde_path_to_error::Deserializer::new(de, &mut track))
    });
    result.map_err(|err| {
        let loc = err.location().and_then(|l| location(&l, doc.first_line));
        ManifestError::new(
            Origin::new(field_path(track), loc),
            ManifestErrorKind::Yaml(yaml_message(&err)),
        )
    })
}

/// The field a failed decode stopped at, as our errors name fields.
fn field_path(track: serde_path_to_error::Track) -> String {
    let path = track.path().to_string();
    let path = if path == "." { String::new() } else { path };
    // `Spanned<T>` is a struct to serde: drop its inner `.value` segment from the path.
    let path = path.replace(".value.", ".").replace(".value[", "[");
    let path = path.strip_suffix(".value").map(str::to_string).unwrap_or(path);
    // `?` is a segment the parser could not name (a syntax error inside a mapping).
    path.split('.')
        .filter(|segment| *segment != "?")
        .collect::<Vec<_>>()
        .join(".")
}

/// The parser's message without its own position suffix (we print positions ourselves).
pub(super) fn yaml_message(err: &serde_saphyr::Error) -> String {
    let text = err.without_snippet().to_string();
    let text = match text.find(" at line ") {
        Some(i) => text[..i].to_string(),
        None => text,
    };
    let text = text.lines().next().unwrap_or_default().trim().to_string();
    match syntax_hint(&text) {
        Some(hint) => format!("{text}; {hint}"),
        None => text,
    }
}

/// What to change for the YAML syntax errors people make most (the parser's words say what
/// it found, not what to write).
fn syntax_hint(message: &str) -> Option<&'static str> {
    let hints: [(&str, &str); 9] = [
        (
            "mapping values are not allowed",
            "a value holding `: ` must be quoted (command: \"echo a: b\"), or the line is indented deeper than its siblings",
        ),
        ("illegal placement of ':'", "a value holding `:` must be quoted"),
        ("found a tab", "YAML indents with spaces, never tabs"),
        (
            "found character that cannot start any token",
            "YAML indents with spaces, never tabs",
        ),
        (
            "did not find expected key",
            "this line's indentation matches no key above it: align it with its siblings",
        ),
        (
            "multiline quoted scalar",
            "a quoted value is not closed: add its closing quote",
        ),
        ("unexpected character", "`@` and `` ` `` cannot start a value: quote it"),
        ("unclosed bracket", "close the list with `]` (or the mapping with `}`)"),
        (
            "mismatched bracket",
            "brackets pair up: a list is [a, b], a mapping {key: value}",
        ),
    ];
    hints
        .iter()
        .find(|(found, _)| message.contains(found))
        .map(|(_, hint)| *hint)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A session's Job decoded from its JSON value is the Job its text gives, and what the
    /// text refuses the value refuses, naming the same field.
    #[test]
    fn a_job_value_is_the_job_its_text_gives() {
        let base = Path::new("/base");
        let doc = serde_json::json!({
            "apiVersion": API_VERSION, "kind": "Job", "metadata": {"name": "s-1"},
            "spec": {
                "environment": "e", "workspace": "/tmp/w", "command": "true",
                "staticAssets": [{"source": "assets/a", "savePath": "a"}],
                "mounts": [{"source": "/srv/data", "target": "/data", "readOnly": true}],
            },
        });
        let from_text = parse_str(&format!("{doc}\n"), base, None).unwrap().jobs.remove(0);
        let from_value = parse_job_value(&doc, base).unwrap();
        assert_eq!(
            strip_positions(format!("{from_text:?}")),
            strip_positions(format!("{from_value:?}"))
        );
        let mut bad = doc.clone();
        bad["spec"]["mounts"][0]["target"] = "../up".into();
        let (text_err, value_err) = (
            parse_str(&format!("{bad}\n"), base, None).unwrap_err(),
            parse_job_value(&bad, base).unwrap_err(),
        );
        assert_eq!(text_err.origin.path, "spec.mounts[0].target");
        assert_eq!(value_err.origin.path, text_err.origin.path);
        assert_eq!(value_err.kind.to_string(), text_err.kind.to_string());
        bad["spec"]["mounts"][0] = serde_json::json!({"source": "/srv", "target": "/x", "bogus": 1});
        assert_eq!(
            parse_job_value(&bad, base).unwrap_err().origin.path,
            "spec.mounts[0].bogus"
        );
        let mut other = doc.clone();
        other["kind"] = "Environment".into();
        assert!(parse_job_value(&other, base).is_err());
        // What serde_json alone would take and the YAML parser refused: an entry given as a
        // list (read as the struct's fields in order), a span forged with the parser's key.
        let mut listed = doc.clone();
        listed["spec"]["mounts"][0] = serde_json::json!(["/srv", "/data"]);
        let e = parse_job_value(&listed, base).unwrap_err();
        assert_eq!(e.origin.path, "spec.mounts[0]");
        assert!(e.kind.to_string().contains("expected a mapping"), "{e}");
        assert!(parse_str(&format!("{listed}\n"), base, None).is_err());
        let mut forged = doc.clone();
        forged["spec"]["staticAssets"][0]["source"] =
            serde_json::json!({"__serde_saphyr_private_spanned": 0, "value": "/etc", "junk": 1});
        let e = parse_job_value(&forged, base).unwrap_err();
        assert_eq!(
            e.origin.path,
            "spec.staticAssets[0].source.__serde_saphyr_private_spanned"
        );
    }

    /// A debug print without its `line: N, column: M` positions (text has them, a value not).
    fn strip_positions(text: String) -> String {
        let mut out = text;
        while let Some(at) = out.find("Some(Location {") {
            let end = out[at..].find("})").map_or(out.len(), |e| at + e + 2);
            out.replace_range(at..end, "None");
        }
        out
    }

    fn env_names(dir: &Path, settle: Duration) -> Vec<String> {
        let (envs, _) = load_env_dir_kept(dir, settle).unwrap();
        envs.into_iter()
            .map(|e| format!("{}={}", e.name, e.image.unwrap_or_default()))
            .collect()
    }

    fn env_file(name: &str, image: &str) -> String {
        format!("apiVersion: {API_VERSION}\nkind: Environment\nmetadata: {{name: {name}}}\nspec:\n  image: {image}\n")
    }

    #[test]
    fn a_kept_env_dir_follows_every_change_to_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.yaml");
        std::fs::write(&a, env_file("one", "img:1")).unwrap();
        // Settled at once: kept from the first read.
        let kept = Duration::ZERO;
        let parsed = || ENV_DIRS_PARSED.with(std::cell::Cell::get);
        let before = parsed();
        assert_eq!(env_names(dir.path(), kept), ["one=img:1"]);
        assert_eq!(env_names(dir.path(), kept), ["one=img:1"]);
        assert_eq!(env_names(dir.path(), kept), ["one=img:1"]);
        assert_eq!(parsed() - before, 1, "a kept env dir is parsed again");
        std::fs::write(&a, env_file("two", "image:2")).unwrap();
        assert_eq!(env_names(dir.path(), kept), ["two=image:2"]);
        assert_eq!(parsed() - before, 2);
        std::fs::write(dir.path().join("b.yml"), env_file("three", "img:3")).unwrap();
        assert_eq!(env_names(dir.path(), kept), ["two=image:2", "three=img:3"]);
        std::fs::remove_file(&a).unwrap();
        assert_eq!(env_names(dir.path(), kept), ["three=img:3"]);
        // The same size, written a clock tick later.
        std::thread::sleep(Duration::from_millis(20));
        std::fs::write(dir.path().join("b.yml"), env_file("three", "img:4")).unwrap();
        assert_eq!(env_names(dir.path(), kept), ["three=img:4"]);
        // Replaced by another file (a new inode) of the same size and times.
        let c = dir.path().join("c.tmp");
        std::fs::write(&c, env_file("three", "img:5")).unwrap();
        std::fs::rename(&c, dir.path().join("b.yml")).unwrap();
        assert_eq!(env_names(dir.path(), kept), ["three=img:5"]);
    }

    #[test]
    fn a_file_written_within_the_settling_time_is_read_every_time() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.yaml");
        // Rewritten at once, at the same size: its stamp may not change (a coarse clock tick),
        // so only not keeping fresh files makes the second read right.
        let before = ENV_DIRS_PARSED.with(std::cell::Cell::get);
        for image in ["img:1", "img:2", "img:3", "img:4"] {
            std::fs::write(&a, env_file("one", image)).unwrap();
            assert_eq!(env_names(dir.path(), ENV_DIR_SETTLED), [format!("one={image}")]);
            assert_eq!(env_names(dir.path(), ENV_DIR_SETTLED), [format!("one={image}")]);
        }
        assert_eq!(
            ENV_DIRS_PARSED.with(std::cell::Cell::get) - before,
            8,
            "a fresh file was kept"
        );
    }

    #[test]
    fn splits_documents_and_keeps_file_line_numbers() {
        let docs = split_documents("a: 1\n---\nb: 2\n--- {c: 3}\n...\n# only a comment\n");
        assert_eq!(docs.len(), 3);
        assert_eq!(docs[0].first_line, 0);
        assert_eq!(docs[1].first_line, 1);
        assert!(docs[1].text.contains("b: 2"));
        assert_eq!(docs[2].first_line, 3);
        assert!(docs[2].text.starts_with("    {c: 3}"));
    }

    #[test]
    fn errors_carry_path_and_line_column() {
        let text = "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: e}\nspec:\n  resources:\n    memory: lots\n";
        let err = parse_str(text, Path::new("."), None).unwrap_err();
        assert_eq!(err.origin.path, "spec.resources.memory");
        assert_eq!(err.origin.location, Some(Location { line: 6, column: 13 }));
        assert!(err.to_string().contains("6:13"), "{err}");
    }
}
