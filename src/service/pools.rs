//! Warm pools: per Environment, containers started ahead of time that one-shot jobs and
//! sessions claim (see `runtime::containerd::pool`). A pool's definition is a file under the
//! state dir (`pools/NAME.json`) holding the Environment's manifest text, so any runner
//! process of that state dir can make members for it; members are in containerd, labelled
//! with the pool's name and key, and outlive every runner process.
//!
//! Refilling: after a claim, the claimant starts `runner pool fill NAME` in the background (a
//! process of its own, so a CLI that claimed can exit at once). Fillers of one pool take an
//! exclusive lock in turn, and each makes what is missing, so concurrent claims never
//! overfill a pool.

use std::os::fd::{AsRawFd, FromRawFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde::{Deserialize, Serialize};

use super::{Context, ServiceError};
use crate::manifest::{self, Backend};
use crate::runtime::containerd::Engine;
use crate::runtime::containerd::pool::{LABEL_POOL, LABEL_POOL_KEY};
use crate::runtime::{ClaimHook, Refill, RuntimeOptions};
use crate::spec::{self, RunPlan};

/// Members made at once while filling (creating a container is mostly waiting on runc).
const FILL_PARALLEL: usize = 2;
/// The niceness of background fillers (jobs run at 0).
const FILLER_NICE: libc::c_int = 10;
/// The largest pool: each member is a running container.
pub const MAX_SIZE: u32 = manifest::MAX_POOL_SIZE;

/// A pool as stored.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PoolDef {
    pub name: String,
    pub environment: String,
    pub size: u32,
    /// Members offer a workspace at the Environment's workdir (unless it has
    /// `mountWorkspace: false`): found from the Environment, whatever `--workspace` said.
    pub workspace: bool,
    /// Members offer the static-assets root (unless a mount overlaps it): likewise.
    pub static_assets: bool,
    /// Members start from this snapshot (`snapshot:NAME`) instead of the Environment's image
    /// (`spec.snapshot`, `--snapshot`): they serve what starts from it with the Environment's
    /// other settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// The manifest the Environment was read from, as read, and where its relative paths
    /// resolve.
    pub manifest: String,
    pub base_dir: PathBuf,
    pub file: Option<PathBuf>,
    /// Where Environments not in the manifest are looked for.
    #[serde(default)]
    pub env_dir: Option<PathBuf>,
    /// What members can serve (the runtime's pool key).
    pub key: String,
    pub created: String,
}

/// A pool with what its members are doing now.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolStatus {
    #[serde(flatten)]
    pub def: PoolDef,
    pub ready: usize,
    /// Members whose init is not running (removed by the next fill).
    pub broken: usize,
}

/// What `pool create` and `pool fill` did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FillReport {
    pub created: Vec<String>,
    /// Members removed, by why: used by a job, made for what the pool was before it was made
    /// again (another key), over its size, or dead (broken).
    pub used: Vec<String>,
    pub outdated: Vec<String>,
    pub surplus: Vec<String>,
    pub broken: Vec<String>,
    pub ready: usize,
    /// How long a queued filler waited for the pool's claims to pause before it began.
    pub waited: std::time::Duration,
}

impl FillReport {
    /// What was removed, said by why (`2 outdated, 1 broken`); `None` when nothing was.
    pub fn removed_text(&self) -> Option<String> {
        let parts: Vec<String> = [
            (self.used.len(), "used"),
            (self.outdated.len(), "outdated"),
            (self.surplus.len(), "surplus"),
            (self.broken.len(), "broken"),
        ]
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, what)| format!("{n} {what}"))
        .collect();
        (!parts.is_empty()).then(|| parts.join(", "))
    }
}

fn pools_dir(ctx: &Context) -> PathBuf {
    ctx.config.state_dir.join("pools")
}

fn def_path(ctx: &Context, name: &str) -> PathBuf {
    pools_dir(ctx).join(format!("{name}.json"))
}

/// Pool names are file names and label values.
fn check_name(name: &str) -> Result<(), ServiceError> {
    let ok = (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(ServiceError::field(
            "name",
            format!("{name:?} is not a pool name (lowercase letters, digits and '-', at most 63)"),
        ))
    }
}

/// Whether this state dir has any pool (jobs only look for members then).
pub fn any(state_dir: &Path) -> bool {
    std::fs::read_dir(state_dir.join("pools"))
        .map(|d| d.flatten().any(|e| e.path().extension().is_some_and(|x| x == "json")))
        .unwrap_or(false)
}

/// How long after its last change a directory's timestamp is trusted to say that it has not
/// changed since: a change within the clock's tick of the one it records keeps the stamp.
const SETTLED: std::time::Duration = std::time::Duration::from_secs(1);

/// What changes when an entry of a directory is added, removed or renamed (every write of a
/// pool definition is a rename: `write_def`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct DirStamp {
    dev: u64,
    ino: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl DirStamp {
    /// The stamp of `dir`, and whether it is settled (last changed `SETTLED` ago or more).
    fn of(dir: &Path) -> Option<(Self, bool)> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(dir).ok()?;
        let stamp = DirStamp {
            dev: m.dev(),
            ino: m.ino(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        };
        let settled = m
            .modified()
            .ok()
            .and_then(|t| std::time::SystemTime::now().duration_since(t).ok())
            .is_some_and(|age| age >= SETTLED);
        Some((stamp, settled))
    }
}

/// The pools of a state dir as last read, kept while its pools directory is unchanged: a
/// server's every session and pooled job asks on its claim's path, and reading them (the
/// directory twice, each definition parsed) took ~0.1 ms of a pooled create's 3-4.
#[derive(Default)]
pub struct PoolCache(std::sync::Mutex<Option<(DirStamp, Pools)>>);

/// Whether any pool is defined, and those that read.
type Pools = (bool, Vec<crate::runtime::PoolInfo>);

impl PoolCache {
    fn get(&self, ctx: &Context) -> Pools {
        let stamp = DirStamp::of(&pools_dir(ctx));
        if let (Some((stamp, _)), Some((kept, pools))) = (stamp, &*self.0.lock().expect("pool cache lock"))
            && stamp == *kept
        {
            return pools.clone();
        }
        let any = any(&ctx.config.state_dir);
        let read = if any { defs(ctx) } else { Ok(Vec::new()) };
        let complete = read.is_ok();
        let pools = (
            any,
            read.unwrap_or_default()
                .into_iter()
                .map(|d| crate::runtime::PoolInfo {
                    name: d.name,
                    environment: d.environment,
                    workspace: d.workspace,
                    static_assets: d.static_assets,
                    key: d.key,
                    snapshot: d.snapshot,
                })
                .collect(),
        );
        // Kept only under a stamp taken before the read and settled: a change made since gets
        // a later time, so the stamp differs at the next look. Definitions that did not all
        // read (one removed between the two directory reads) are not kept either.
        *self.0.lock().expect("pool cache lock") = match stamp {
            Some((stamp, true)) if complete => Some((stamp, pools.clone())),
            _ => None,
        };
        pools
    }
}

/// The runtime options jobs and sessions run with when pools exist: look for a member, and
/// refill its pool after a claim.
pub fn with_pools(ctx: &Context, mut options: RuntimeOptions) -> RuntimeOptions {
    let (any, pools) = ctx.pools.get(ctx);
    if any {
        options.use_pools = true;
        options.pools = pools;
        // Members carry the session tools, and they are part of the pool key: a one-shot
        // job's engine names them too (one-shot containers never mount them).
        options.tools = super::sessions::tools();
        let ctx = ctx.clone();
        // Started before the hook returns: a CLI may exit right after its job.
        options.on_claim = Some(ClaimHook(std::sync::Arc::new(move |pool: &str, refill| {
            if let Err(e) = spawn_filler(&ctx, pool, refill) {
                tracing::warn!(pool, error = %e, "could not start refilling the pool");
            }
        })));
    }
    options
}

/// A filler's place in its pool's queue: the pool's `.queue` lock, taken by the claim that
/// starts the filler and held by the filler until it holds the fill lock. While one filler
/// waits there, later claims start none: the waiting one reads the pool under the fill lock
/// and makes up for every claim before it. A burst of N claims so starts at most two fillers
/// (one filling, one queued) instead of N processes competing with the jobs for the CPU.
pub struct QueueTicket(std::fs::File);

impl QueueTicket {
    /// The queue's place, when no filler holds it. `refill`: whether this marks the pool's
    /// activity (a claim of a burst), which a queued filler waits to see pause; a caller that
    /// waited for its claims to pause already does not make the filler wait again.
    fn try_take(ctx: &Context, pool: &str, refill: Refill) -> Result<Option<Self>, ServiceError> {
        let path = pools_dir(ctx).join(format!("{pool}.queue"));
        let open_err = |e| ServiceError::internal("opening the pool's queue", e);
        let (file, created) = match std::fs::OpenOptions::new().write(true).open(&path) {
            Ok(file) => (file, false),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (
                std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&path)
                    .map_err(open_err)?,
                true,
            ),
            Err(e) => return Err(open_err(e)),
        };
        // Every used member passes here: its time is what a queued filler waits to see
        // pause (`wait_for_quiet`). Best effort: a filler that cannot see it fills at once.
        // A queue file made now by a caller that marks nothing is no activity either.
        let mark = match refill {
            Refill::WhenQuiet => Some(std::time::SystemTime::now()),
            Refill::Now => created.then_some(std::time::UNIX_EPOCH),
        };
        if let Some(t) = mark
            && let Err(e) = file.set_modified(t)
        {
            tracing::debug!(pool, error = %e, "marking the pool's activity");
        }
        // libc's flock, not nix's Flock: that one unlocks when dropped, which would free the
        // lock this process hands to the filler (the lock is the open file's, shared by both).
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(Some(Self(file)));
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Ok(None);
        }
        Err(ServiceError::internal("locking the pool's queue", e))
    }

    /// The ticket the claim that started this filler left on descriptor `fd`.
    pub fn from_inherited(fd: i32) -> Result<Self, ServiceError> {
        let bad = |why: &str| ServiceError::field("--queued-fd", format!("descriptor {fd}: {why}"));
        if fd < 3 {
            return Err(bad("not a descriptor a claim passes (0-2 are standard streams)"));
        }
        // SAFETY: fstat into a zeroed stat on a descriptor number; fails cleanly when closed.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(bad("not an open queue file"));
        }
        // SAFETY: the descriptor was passed to this process for this use only; nothing else
        // in it owns or closes it. Marked close-on-exec so it is not passed further.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        Ok(Self(unsafe { std::fs::File::from_raw_fd(fd) }))
    }
}

/// Start `runner pool fill NAME` in the background, in a session of its own and at a lower
/// priority than jobs (refilling must not slow the claims it refills for), unless a filler of
/// this pool is queued already.
fn spawn_filler(ctx: &Context, pool: &str, refill: Refill) -> Result<(), ServiceError> {
    let Some(ticket) = QueueTicket::try_take(ctx, pool, refill)? else {
        tracing::debug!(pool, "a filler is queued already");
        return Ok(());
    };
    let config = &ctx.config;
    let exe = config
        .runner_exe()
        .map_err(|e| ServiceError::internal("finding the runner binary", e))?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(pools_dir(ctx).join(format!("{pool}.log")))
        .map_err(|e| ServiceError::internal("opening the pool's log", e))?;
    let log2 = log
        .try_clone()
        .map_err(|e| ServiceError::internal("opening the pool's log", e))?;
    let fd = ticket.0.as_raw_fd();
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["pool", "fill", pool])
        .arg("--queued-fd")
        .arg(fd.to_string())
        .arg("--state-dir")
        .arg(&config.state_dir)
        .arg("--namespace")
        .arg(&config.namespace)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2);
    // The containerd this process is connected to, whichever way it was found.
    if let Some(client) = ctx.connected() {
        cmd.arg("--address").arg(client.address());
    } else if let Some(address) = &config.address {
        cmd.arg("--address").arg(address);
    }
    if let Some(exe) = &config.runner_exe {
        cmd.arg("--runner-exe").arg(exe);
    }
    cmd.args(config.inherited_args());
    // SAFETY: fcntl and setpriority are async-signal-safe; they run in the child only.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(move || {
            // The ticket's descriptor survives exec (the same number: no other descriptor
            // of the child is touched); the lock is the open file's, so it stays held by
            // the filler when this process closes its copy below.
            if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Best effort: a host that forbids it still gets its pool filled.
            libc::setpriority(libc::PRIO_PROCESS, 0, FILLER_NICE);
            Ok(())
        });
    }
    super::spawn_detached(cmd, "pool filler")?;
    drop(ticket);
    Ok(())
}

/// The job a pool's members are made for: the Environment's. Every member offers the
/// workspace and the static-assets root whatever the template (see
/// `pool::member_layout`); `placeholder` is where the template's relative paths resolve.
fn template(ctx: &Context, def: &PoolDef, placeholder: &Path) -> Result<RunPlan, ServiceError> {
    let set = manifest::parse_str(&def.manifest, &def.base_dir, def.file.as_deref())?;
    let set = match &def.env_dir {
        Some(dir) if !set.environments.iter().any(|e| e.name == def.environment) => {
            let mut set = set;
            set.use_env_dir(dir)?;
            set
        }
        _ => set,
    };
    let env = set
        .environments
        .iter()
        .chain(set.env_dir.iter())
        .find(|e| e.name == def.environment)
        .ok_or_else(|| ServiceError::field("environment", format!("no Environment {:?}", def.environment)))?;
    if env.backend != Backend::Containerd {
        return Err(ServiceError::field(
            "environment",
            format!(
                "Environment {:?} runs on the {} backend: only containerd Environments have pools",
                env.name,
                env.backend.as_str()
            ),
        ));
    }
    let job = format!(
        "apiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: pool-{}}}\nspec:\n  environment: {}\n  command: [\"true\"]\n",
        def.name,
        serde_json::to_string(&def.environment).unwrap_or_default()
    );
    let jobs = manifest::parse_str(&job, placeholder, None)?;
    let job = jobs
        .jobs
        .first()
        .ok_or_else(|| ServiceError::internal("the pool's template job", "no job parsed"))?;
    let mut bound = manifest::bind(job, env, None)?;
    if let Some(snapshot) = &def.snapshot {
        bound.env.image = Some(super::snapshots::image_name_of("snapshot", snapshot)?);
        // A snapshot is in this containerd or nowhere.
        bound.env.image_pull_policy = Some(manifest::PullPolicy::Never);
    }
    Ok(spec::resolve(&bound, &ctx.host)?)
}

/// The options pool members are made with: the tools sessions ship (so a session can claim
/// one), nothing job-specific.
fn member_options(ctx: &Context) -> RuntimeOptions {
    RuntimeOptions {
        tools: super::sessions::tools(),
        ..ctx.runtime_options()
    }
}

async fn member_engine(ctx: &Context) -> Result<Engine, ServiceError> {
    ctx.engine(member_options(ctx)).await
}

/// Create (or resize) a pool from an Environment of a manifest, and fill it.
#[allow(clippy::too_many_arguments)]
pub async fn create(
    ctx: &Context,
    name: &str,
    environment: &str,
    file: &Path,
    size: u32,
    workspace: bool,
    static_assets: bool,
    snapshot: Option<String>,
) -> Result<(PoolDef, FillReport), ServiceError> {
    check_request(name, size)?;
    let text =
        std::fs::read_to_string(file).map_err(|e| ServiceError::field("file", format!("{}: {e}", file.display())))?;
    let file = std::fs::canonicalize(file).unwrap_or_else(|_| file.to_path_buf());
    let source = ManifestSource {
        text,
        base_dir: manifest::base_dir_of(&file),
        file: Some(file),
    };
    create_from(ctx, name, environment, source, size, workspace, static_assets, snapshot).await
}

/// A pool's name and size, checked before anything is read or made.
fn check_request(name: &str, size: u32) -> Result<(), ServiceError> {
    check_name(name)?;
    if size > MAX_SIZE {
        return Err(ServiceError::field(
            "size",
            format!("{size} is above the limit of {MAX_SIZE}"),
        ));
    }
    Ok(())
}

/// Where a pool's Environment is read from: a manifest's text, where its relative paths
/// resolve, and its file when it has one (`runner pool create -f`; the HTTP API sends text).
pub struct ManifestSource {
    pub text: String,
    pub base_dir: PathBuf,
    pub file: Option<PathBuf>,
}

/// Create (or resize) a pool from an Environment of a manifest's text, and fill it.
#[allow(clippy::too_many_arguments)]
pub async fn create_from(
    ctx: &Context,
    name: &str,
    environment: &str,
    source: ManifestSource,
    size: u32,
    workspace: bool,
    static_assets: bool,
    snapshot: Option<String>,
) -> Result<(PoolDef, FillReport), ServiceError> {
    check_request(name, size)?;
    if let Some(s) = &snapshot {
        super::snapshots::image_name_of("snapshot", s)?;
    }
    let mut def = PoolDef {
        name: name.to_string(),
        environment: environment.to_string(),
        size,
        workspace,
        static_assets,
        snapshot,
        manifest: source.text,
        base_dir: source.base_dir,
        file: source.file,
        env_dir: ctx.config.env_dir.clone(),
        key: String::new(),
        created: crate::job::rfc3339(std::time::SystemTime::now()),
    };
    let placeholder = tempfile::tempdir().map_err(|e| ServiceError::internal("a placeholder directory", e))?;
    let plan = template(ctx, &def, placeholder.path())?;
    if let Some(why) = crate::runtime::containerd::pool::unpoolable(&plan) {
        return Err(ServiceError::field(
            "environment",
            format!("Environment {environment:?} cannot have a warm pool: {why} (a late mount would hide it)"),
        ));
    }
    let engine = member_engine(ctx).await?;
    let (key, layout, _) = engine.pool_key(&plan).await?;
    def.key = key;
    // What members offer, whatever was asked: a pool serves jobs with and without either.
    def.workspace = layout.places.iter().any(|p| p.target == plan.env().workdir);
    def.static_assets = layout.static_assets;
    std::fs::create_dir_all(pools_dir(ctx)).map_err(|e| ServiceError::internal("creating the pools directory", e))?;
    write_def(ctx, &def)?;
    let report = fill(ctx, name).await?;
    Ok((def, report))
}

/// A pool's Environment as the HTTP API names it: the name of one in the server's env dir,
/// a whole Environment document, or its `spec` object (named after the pool). Its name and
/// where it is read from; relative paths resolve against `base_dir` (the server's).
pub fn api_source(
    ctx: &Context,
    pool: &str,
    environment: serde_json::Value,
    base_dir: &Path,
) -> Result<(String, ManifestSource), ServiceError> {
    let document = match environment {
        serde_json::Value::String(name) => {
            let dir = ctx.config.env_dir.as_deref().ok_or_else(|| {
                ServiceError::field(
                    "environment",
                    format!("{name:?} names an Environment of the server's --env-dir, and this server has none"),
                )
            })?;
            let file = manifest::load_env_dir(dir)?
                .into_iter()
                .find(|e| e.name == name)
                .and_then(|e| e.origins_file())
                .ok_or_else(|| {
                    ServiceError::field("environment", format!("no Environment {name:?} in {}", dir.display()))
                })?;
            let text = std::fs::read_to_string(&file)
                .map_err(|e| ServiceError::internal(format!("reading {}", file.display()), e))?;
            let source = ManifestSource {
                text,
                base_dir: manifest::base_dir_of(&file),
                file: Some(file),
            };
            return Ok((name, source));
        }
        serde_json::Value::Object(doc) if doc.contains_key("kind") || doc.contains_key("apiVersion") => doc,
        serde_json::Value::Object(spec) => {
            let mut doc = serde_json::Map::new();
            doc.insert("apiVersion".into(), manifest::API_VERSION.into());
            doc.insert("kind".into(), "Environment".into());
            doc.insert("metadata".into(), serde_json::json!({ "name": pool }));
            doc.insert("spec".into(), serde_json::Value::Object(spec));
            doc
        }
        _ => {
            return Err(ServiceError::field(
                "environment",
                "an Environment (a whole document, or its spec object) or the name of one",
            ));
        }
    };
    let mut doc = document;
    let metadata = match doc.remove("metadata") {
        None => serde_json::Map::new(),
        Some(serde_json::Value::Object(m)) => m,
        Some(other) => {
            return Err(ServiceError::field(
                "environment.metadata",
                format!("an object is required, got {other}"),
            ));
        }
    };
    let name = match metadata.get("name") {
        Some(serde_json::Value::String(n)) => n.clone(),
        Some(other) => {
            return Err(ServiceError::field(
                "environment.metadata.name",
                format!("a string is required, got {other}"),
            ));
        }
        None => pool.to_string(),
    };
    let mut metadata = metadata;
    metadata.insert("name".into(), name.clone().into());
    doc.insert("metadata".into(), serde_json::Value::Object(metadata));
    let doc = serde_json::Value::Object(doc);
    // JSON is YAML: the manifest parser reads the document as it reads a file's, so every
    // check (kind, version, unknown fields) and error is the same.
    let source = ManifestSource {
        text: format!("{doc}\n"),
        base_dir: base_dir.to_path_buf(),
        file: None,
    };
    Ok((name, source))
}

/// The manifest file of the env dir that defines an Environment.
pub fn env_dir_file(ctx: &Context, environment: &str) -> Result<PathBuf, ServiceError> {
    let dir = ctx
        .config
        .env_dir
        .as_deref()
        .ok_or_else(|| ServiceError::field("--pool", "pools of `serve` name Environments of its --env-dir"))?;
    manifest::load_env_dir(dir)?
        .into_iter()
        .find(|e| e.name == environment)
        .and_then(|e| e.origins_file())
        .ok_or_else(|| ServiceError::field("--pool", format!("no Environment {environment:?} in {}", dir.display())))
}

/// `serve --pool ENV=SIZE`: parsed.
pub fn parse_pool_arg(arg: &str) -> Result<(String, u32), ServiceError> {
    let (env, size) = arg.split_once('=').unwrap_or((arg, "2"));
    let size = size
        .parse()
        .map_err(|_| ServiceError::field("--pool", format!("{arg:?}: the size after '=' must be a number")))?;
    check_name(env)?;
    Ok((env.to_string(), size))
}

fn write_def(ctx: &Context, def: &PoolDef) -> Result<(), ServiceError> {
    let path = def_path(ctx, &def.name);
    let tmp = path.with_extension("json.tmp");
    let text = serde_json::to_vec_pretty(def).map_err(|e| ServiceError::internal("encoding the pool", e))?;
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| ServiceError::internal("writing the pool", e))
}

pub fn read_def(ctx: &Context, name: &str) -> Result<PoolDef, ServiceError> {
    let path = def_path(ctx, name);
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ServiceError::NotFound {
                kind: "pool",
                name: name.to_string(),
            });
        }
        Err(e) => return Err(ServiceError::internal(format!("reading {}", path.display()), e)),
    };
    serde_json::from_slice(&text).map_err(|e| ServiceError::internal(format!("reading {}", path.display()), e))
}

/// Every pool of this state dir.
pub fn defs(ctx: &Context) -> Result<Vec<PoolDef>, ServiceError> {
    let mut names: Vec<String> = match std::fs::read_dir(pools_dir(ctx)) {
        Ok(d) => d
            .flatten()
            .filter_map(|e| {
                let p = e.path();
                (p.extension().is_some_and(|x| x == "json")).then(|| p.file_stem()?.to_str().map(String::from))?
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    names.sort();
    names.iter().map(|n| read_def(ctx, n)).collect()
}

/// Hold the pool's fill lock (blocking: fillers take turns).
fn lock(ctx: &Context, name: &str) -> Result<std::fs::File, ServiceError> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(pools_dir(ctx).join(format!("{name}.lock")))
        .map_err(|e| ServiceError::internal("opening the pool's lock", e))?;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&file), libc::LOCK_EX) } != 0 {
        return Err(ServiceError::internal(
            "locking the pool",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(file)
}

/// Bring a pool to its size: remove broken members, make missing ones. Fillers of one pool
/// take turns.
pub async fn fill(ctx: &Context, name: &str) -> Result<FillReport, ServiceError> {
    fill_queued(ctx, name, None).await
}

/// `fill` by a filler a claim started: its queue ticket is given up once it holds the fill
/// lock, so a claim from then on queues the next filler.
pub async fn fill_queued(ctx: &Context, name: &str, ticket: Option<QueueTicket>) -> Result<FillReport, ServiceError> {
    let engine = member_engine(ctx).await?;
    if let Err(e) = read_def(ctx, name) {
        // The pool is gone; its used members still go (they hold late binds).
        remove_retired(&engine).await?;
        return Err(e);
    }
    let lock = {
        let ctx = ctx.clone();
        let name = name.to_string();
        Context::blocking(move || lock(&ctx, &name)).await?
    };
    let queued = ticket.is_some();
    drop(ticket);
    let waiting = std::time::Instant::now();
    if queued && let Ok(def) = read_def(ctx, name) {
        wait_for_quiet(ctx, &engine, &def).await;
    }
    let waited = waiting.elapsed();
    // Used members first, whatever became of their pool (their jobs are over and reported).
    // After the ticket is given up: a member retired before then started no filler of its
    // own (this one was queued) and must be seen here.
    let mut report = FillReport {
        used: remove_retired(&engine).await?,
        waited,
        ..FillReport::default()
    };
    // Read again under the lock: the pool may have been removed or resized meanwhile.
    let def = read_def(ctx, name)?;
    let mut ready = 0usize;
    for c in engine.members(None).await? {
        if c.labels.get(LABEL_POOL) != Some(&def.name) || !engine.member_ready(&c.id) {
            continue;
        }
        // Kept: alive, made for what the pool is now (its Environment or image may have
        // changed since), and within its size.
        let current = c.labels.get(LABEL_POOL_KEY) == Some(&def.key);
        let why = if !current {
            &mut report.outdated
        } else if ready >= def.size as usize {
            &mut report.surplus
        } else if !engine.member_alive(&c.id).await {
            &mut report.broken
        } else {
            ready += 1;
            continue;
        };
        if engine.retire_member(&c.id).await? {
            why.push(c.id);
        }
    }
    let missing = (def.size as usize).saturating_sub(ready);
    let placeholder = tempfile::tempdir().map_err(|e| ServiceError::internal("a placeholder directory", e))?;
    let plan = template(ctx, &def, placeholder.path())?;
    if engine.pool_key(&plan).await?.0 != def.key {
        return Err(ServiceError::Conflict(format!(
            "pool {name:?}: its Environment or image changed since it was made; `runner pool create` it again"
        )));
    }
    let mut made = 0;
    while made < missing {
        let batch = (missing - made).min(FILL_PARALLEL);
        let results = futures::future::join_all((0..batch).map(|_| engine.create_member(&plan, &def.name))).await;
        for r in results {
            report.created.push(r?);
        }
        made += batch;
    }
    report.ready = ready + made;
    drop(lock);
    Ok(report)
}

/// Until the pool's claims and used members pause (`REFILL_QUIET` without either), at most
/// `REFILL_WAIT_MOST`. A claim started this filler: its claims usually come in bursts (a CI
/// matrix, a harness's batch of `runner apply`), and the teardowns and container starts of a
/// refill inside one take the CPU its jobs need, on a small node most of it. The next burst is
/// served by whatever is ready; an explicit `runner pool fill` does not wait.
async fn wait_for_quiet(ctx: &Context, engine: &Engine, def: &PoolDef) {
    use crate::runtime::containerd::pool::{REFILL_QUIET, REFILL_WAIT_MOST};
    let queue = pools_dir(ctx).join(format!("{}.queue", def.name));
    let most = std::time::Instant::now() + REFILL_WAIT_MOST;
    loop {
        let used = std::fs::metadata(&queue).and_then(|m| m.modified()).ok();
        let last = used.max(engine.last_claim(&def.key));
        let since = last.and_then(|t| t.elapsed().ok()).unwrap_or(REFILL_QUIET);
        let now = std::time::Instant::now();
        if since >= REFILL_QUIET || now >= most {
            return;
        }
        tokio::time::sleep((REFILL_QUIET - since).min(most - now)).await;
    }
}

/// Tear down the used members of this state dir.
async fn remove_retired(engine: &Engine) -> Result<Vec<String>, ServiceError> {
    let retired = engine.retired().await?;
    for r in futures::future::join_all(retired.iter().map(|id| engine.teardown(id))).await {
        if let Err(e) = r {
            tracing::warn!(error = %e, "removing a used pool member");
        }
    }
    Ok(retired)
}

/// Every pool with its members now.
pub async fn list(ctx: &Context) -> Result<Vec<PoolStatus>, ServiceError> {
    let defs = defs(ctx)?;
    if defs.is_empty() {
        return Ok(Vec::new());
    }
    let engine = member_engine(ctx).await?;
    let members = engine.members(None).await?;
    let mut out = Vec::new();
    for def in defs {
        let (mut ready, mut broken) = (0, 0);
        for c in members
            .iter()
            .filter(|c| c.labels.get(LABEL_POOL) == Some(&def.name) && c.labels.get(LABEL_POOL_KEY) == Some(&def.key))
        {
            if !engine.member_ready(&c.id) {
                continue;
            }
            if engine.member_alive(&c.id).await {
                ready += 1;
            } else {
                broken += 1;
            }
        }
        out.push(PoolStatus { def, ready, broken });
    }
    Ok(out)
}

/// Remove a pool: its definition first (nothing refills it), then its unclaimed members.
/// Claimed members finish their job as they would have.
pub async fn remove(ctx: &Context, name: &str) -> Result<Vec<String>, ServiceError> {
    read_def(ctx, name)?;
    // After the filler at work (if any) is done; fillers after it find no pool.
    let lock = {
        let ctx = ctx.clone();
        let name = name.to_string();
        Context::blocking(move || lock(&ctx, &name)).await?
    };
    std::fs::remove_file(def_path(ctx, name)).map_err(|e| ServiceError::internal("removing the pool", e))?;
    drop(lock);
    let engine = member_engine(ctx).await?;
    let mut removed = remove_retired(&engine).await?;
    for c in engine.members(None).await? {
        if c.labels.get(LABEL_POOL) == Some(&name.to_string()) && engine.retire_member(&c.id).await? {
            removed.push(c.id);
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool as a test needs it: its name and key.
    fn def(name: &str, key: &str) -> PoolDef {
        PoolDef {
            name: name.into(),
            environment: "e".into(),
            size: 1,
            workspace: false,
            static_assets: false,
            snapshot: None,
            manifest: String::new(),
            base_dir: PathBuf::new(),
            file: None,
            env_dir: None,
            key: key.into(),
            created: String::new(),
        }
    }

    /// The pools directory as if last changed a while ago.
    fn settle(ctx: &Context) {
        let dir = std::fs::File::open(pools_dir(ctx)).unwrap();
        let then = std::time::SystemTime::now() - std::time::Duration::from_secs(10);
        dir.set_times(std::fs::FileTimes::new().set_modified(then)).unwrap();
    }

    #[test]
    fn the_pools_are_read_again_once_their_directory_changed() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = Context::new(crate::config::Config::new(dir.path()), super::super::Connect::Existing).unwrap();
        let keys = |ctx: &Context| {
            let (any, pools) = ctx.pools.get(ctx);
            (
                any,
                pools
                    .into_iter()
                    .map(|p| format!("{}={}", p.name, p.key))
                    .collect::<Vec<_>>(),
            )
        };
        assert_eq!(keys(&ctx), (false, vec![]));
        std::fs::create_dir_all(pools_dir(&ctx)).unwrap();
        write_def(&ctx, &def("a", "k1")).unwrap();
        settle(&ctx);
        assert_eq!(keys(&ctx), (true, vec!["a=k1".to_string()]));
        // Kept: a definition rewritten in place (runner never does: `write_def` renames) is
        // not read again while the directory is unchanged.
        std::fs::write(def_path(&ctx, "a"), serde_json::to_vec(&def("a", "in-place")).unwrap()).unwrap();
        assert_eq!(keys(&ctx), (true, vec!["a=k1".to_string()]));
        // A rename changes the directory: read again, and not kept while the change is recent.
        write_def(&ctx, &def("a", "k2")).unwrap();
        write_def(&ctx, &def("b", "k3")).unwrap();
        assert_eq!(keys(&ctx), (true, vec!["a=k2".to_string(), "b=k3".to_string()]));
        std::fs::write(def_path(&ctx, "b"), serde_json::to_vec(&def("b", "k4")).unwrap()).unwrap();
        assert_eq!(keys(&ctx), (true, vec!["a=k2".to_string(), "b=k4".to_string()]));
        std::fs::remove_file(def_path(&ctx, "a")).unwrap();
        std::fs::remove_file(def_path(&ctx, "b")).unwrap();
        assert_eq!(keys(&ctx), (false, vec![]));
    }

    #[test]
    fn pool_names_are_checked() {
        assert!(check_name("python-3").is_ok());
        for bad in ["", "Py", "a/b", "-a", "a-", "a.b", &"x".repeat(64)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }
}
