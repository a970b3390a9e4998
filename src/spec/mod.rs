//! The OCI runtime spec a job runs with.
//!
//! `resolve` (impure: it canonicalises host paths once) turns a bound Job + Environment into
//! a `RunPlan`; `build` (pure) turns a `RunPlan` and the host's facts into a hardened
//! `oci_spec` `Spec`. Golden tests pin `build`'s output; `hardening::violations` states the
//! properties every spec must have.

pub mod entry;
pub mod hardening;
pub mod kube;
pub mod seccomp;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use oci_spec::runtime::{
    Capability, LinuxBuilder, LinuxCapabilitiesBuilder, LinuxCpuBuilder, LinuxDeviceCgroupBuilder, LinuxDeviceType,
    LinuxIdMappingBuilder, LinuxMemoryBuilder, LinuxNamespaceBuilder, LinuxNamespaceType, LinuxPidsBuilder,
    LinuxResourcesBuilder, Mount, MountBuilder, PosixRlimitBuilder, PosixRlimitType, ProcessBuilder, RootBuilder, Spec,
    SpecBuilder, UserBuilder,
};

use crate::manifest::{Bound, Command, Environment, Job, NetworkMode, Origin, Resources, UserSpec, paths};

/// OCI runtime spec version we emit (what runc 1.1 understands).
pub const OCI_VERSION: &str = "1.0.2";
/// The directory static assets are mounted under.
pub const STATIC_ROOT: &str = "/static";
/// PATH when neither the image nor the Environment sets one.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// CFS period for the cpu quota: the kernel default (100 ms).
pub const CPU_PERIOD_US: u64 = 100_000;
/// Open files per process in the container (lowered to the host's hard limit).
pub const NOFILE_LIMIT: u64 = 65_536;
/// Size of the tmpfs on /dev and /dev/shm.
const DEV_TMPFS_SIZE: &str = "size=65536k";
/// Where the default PATH's shell lives in every image we support.
pub const SHELL: &str = "/bin/sh";
/// Where a one-shot job's stdin is mounted (read-only) in the container; its command reads it
/// as stdin (see `entry::compose`).
pub const STDIN_PATH: &str = "/.runner-stdin";
/// The host file holding a job's stdin when the plan does not name it yet (`runner spec`).
const STDIN_PLACEHOLDER: &str = "run/<container-id>/stdin";

/// Capabilities a container keeps: Docker's default 14 without NET_RAW (packet forging),
/// MKNOD, AUDIT_WRITE and SETFCAP, none of which an evaluation needs.
pub const DEFAULT_CAPABILITIES: &[Capability] = &[
    Capability::Chown,
    Capability::DacOverride,
    Capability::Fsetid,
    Capability::Fowner,
    Capability::Setgid,
    Capability::Setuid,
    Capability::Setpcap,
    Capability::NetBindService,
    Capability::Kill,
    Capability::SysChroot,
];

/// containerd's and Docker's masked paths together: kernel data a container must not read.
pub const MASKED_PATHS: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/interrupts",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];

/// Kernel knobs a container may read but not write.
pub const READONLY_PATHS: &[&str] = &["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"];

/// Character devices every container may use (runc creates the nodes; these rules let the
/// cgroup allow them after the deny-all rule): null, zero, full, random, urandom, tty, ptmx,
/// and the pts range.
const ALLOWED_CHAR_DEVICES: &[(i64, Option<i64>)] = &[
    (1, Some(3)),
    (1, Some(5)),
    (1, Some(7)),
    (1, Some(8)),
    (1, Some(9)),
    (5, Some(0)),
    (5, Some(2)),
    (136, None),
];

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("{origin}: {reason}")]
    Refused { origin: String, reason: String },
    #[error("{origin}: {path}: {}", io_reason(source))]
    Path {
        origin: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{origin}: {path} is not a directory")]
    NotADirectory { origin: String, path: PathBuf },
    #[error("building the OCI spec: {0}")]
    Oci(#[from] oci_spec::OciSpecError),
}

/// What went wrong with a path, in words ("does not exist" rather than "No such file or
/// directory (os error 2)").
fn io_reason(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "does not exist".into(),
        std::io::ErrorKind::PermissionDenied => "permission denied (the runner cannot read it)".into(),
        std::io::ErrorKind::NotADirectory => "a part of it is not a directory".into(),
        _ => e.to_string(),
    }
}

/// Facts about the host the spec depends on, detected once at the edge (`detect`) and passed
/// in as data so `build` stays pure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostEnv {
    /// The runner's own uid/gid.
    pub uid: u32,
    pub gid: u32,
    /// `HUID`/`HGID`: the ids of the human the runner acts for (set by wrappers using sudo).
    pub huid: Option<u32>,
    pub hgid: Option<u32>,
    /// The runner's state directory: never mountable.
    pub state_dir: PathBuf,
    /// `std::env::consts::ARCH` of the host (picks the seccomp architectures).
    pub arch: String,
    /// The runner's environment, for `includeHostEnv` on the host backend.
    pub vars: BTreeMap<String, String>,
    /// Hard RLIMIT_NOFILE of the runner (and so, usually, of the containerd it starts):
    /// runc cannot raise a container's limit above its own.
    pub nofile_hard: u64,
}

impl HostEnv {
    pub fn detect(state_dir: &Path) -> Self {
        let id = |name: &str| std::env::var(name).ok().and_then(|v| v.trim().parse::<u32>().ok());
        HostEnv {
            uid: nix::unistd::getuid().as_raw(),
            gid: nix::unistd::getgid().as_raw(),
            huid: id("HUID"),
            hgid: id("HGID"),
            state_dir: state_dir.to_path_buf(),
            arch: std::env::consts::ARCH.to_string(),
            vars: std::env::vars().collect(),
            nofile_hard: nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
                .map(|(_, hard)| hard)
                .unwrap_or(NOFILE_LIMIT),
        }
    }

    /// The ids `user: host` stands for.
    pub fn host_user(&self) -> (u32, u32) {
        (self.huid.unwrap_or(self.uid), self.hgid.unwrap_or(self.gid))
    }
}

/// A host directory or file bound into the container, source already canonical.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BindMount {
    pub source: PathBuf,
    pub target: String,
    pub read_only: bool,
}

/// Everything needed to start a job, with host paths resolved.
#[derive(Clone, Debug)]
pub struct RunPlan {
    pub bound: Bound,
    /// Canonical workspace directory, if the job has one.
    pub workspace: Option<PathBuf>,
    /// Environment mounts, then the job's (spawn-time) mounts, sources canonical.
    pub env_mounts: Vec<BindMount>,
    pub job_mounts: Vec<BindMount>,
    /// Static assets: target is `/static/<savePath>`.
    pub assets: Vec<BindMount>,
    /// `KEY=VALUE` defaults from the image config (untrusted content: defaults only, below
    /// the Environment's `env`). Empty until the containerd backend reads the image.
    pub image_env: Vec<String>,
    /// Extra labels for what the backend creates (attempt index and number of a Job).
    pub labels: BTreeMap<String, String>,
    /// The host file holding the job's stdin (written by the containerd backend before the
    /// container is created; `None` until then).
    pub stdin_file: Option<PathBuf>,
    /// The host ids the container's user namespace maps, allocated by the containerd backend
    /// when it creates the container; `None` until then (and for `hostUsers: true`).
    pub userns: Option<IdRange>,
    /// A checkpoint the containerd backend restores the container from (its rootfs changes,
    /// agent files, processes and memory; see `runtime::containerd::checkpoint`) instead of
    /// starting its init. Set by the session layer.
    pub restore: Option<PathBuf>,
}

/// The host ids a container's user namespace maps: container id `n` is host id
/// `host_base + n`, for `n` below `USERNS_IDS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IdRange {
    pub host_base: u32,
}

impl IdRange {
    /// Ids per range (Kubernetes gives each pod as many).
    pub const SIZE: u32 = crate::manifest::USERNS_IDS as u32;
    /// What a spec shows before the backend allocates a range (`runner spec`, pool keys): the
    /// first range runner hands out.
    pub const PLACEHOLDER: IdRange = IdRange { host_base: 1 << 30 };

    /// The host id of container id `id`.
    pub fn host_id(&self, id: u32) -> u32 {
        // Saturating: an id outside the range is refused by `build`, never wrapped.
        self.host_base.saturating_add(id)
    }
}

impl RunPlan {
    pub fn job(&self) -> &Job {
        &self.bound.job
    }
    pub fn env(&self) -> &Environment {
        &self.bound.env
    }
}

fn origin_text(job: &Job, origin: &Origin, file: &Option<PathBuf>) -> String {
    let mut out = String::new();
    if let Some(f) = file {
        out.push_str(&format!("{}:", f.display()));
    }
    if let Some(l) = origin.location {
        out.push_str(&format!("{}:{}:", l.line, l.column));
    }
    if !out.is_empty() {
        out.push(' ');
    }
    out.push_str(&format!("Job {:?}: {}", job.name, origin.path));
    out
}

/// Canonicalise every host path of a bound job once (symlinks resolved, then re-checked
/// against the refuse list), so what is checked is what gets mounted.
pub fn resolve(bound: &Bound, host: &HostEnv) -> Result<RunPlan, SpecError> {
    let job = &bound.job;
    let env = &bound.env;
    let state_dir = host.state_dir.to_string_lossy().to_string();
    let canonical = |path: &Path, origin: String| -> Result<PathBuf, SpecError> {
        let resolved = std::fs::canonicalize(path).map_err(|source| SpecError::Path {
            origin: origin.clone(),
            path: path.to_path_buf(),
            source,
        })?;
        if let Some(reason) = paths::refused_source(&resolved.to_string_lossy(), Some(&state_dir)) {
            return Err(SpecError::Refused {
                origin,
                reason: format!(
                    "refusing to mount {} (resolved from {}): {reason}",
                    resolved.display(),
                    path.display()
                ),
            });
        }
        Ok(resolved)
    };
    let workspace = match &job.workspace {
        Some(w) => {
            let written = Origin::new("spec.workspace", None);
            let origin = origin_text(job, job.workspace_origin.as_ref().unwrap_or(&written), &job.file);
            let dir = canonical(w, origin.clone())?;
            if !dir.is_dir() {
                return Err(SpecError::NotADirectory { origin, path: dir });
            }
            Some(dir)
        }
        None => None,
    };
    let mount = |m: &crate::manifest::MountSpec, file: &Option<PathBuf>| -> Result<BindMount, SpecError> {
        let origin = origin_text(job, &m.source_origin, file);
        let source = Path::new(&m.source);
        let source = if source.is_absolute() {
            source.to_path_buf()
        } else {
            // Relative sources live in the workspace and must stay inside it. The workspace
            // is the sandbox's to change (a previous attempt, a parallel index, a session on
            // it), so the source is kept as written, beneath the workspace: it is checked here
            // beneath the workspace's descriptor, and resolved that way again when each
            // container is made (see `runtime::containerd::remap::workspace_view`), never
            // followed by path.
            let Some(ws) = &workspace else {
                return Err(SpecError::Refused {
                    origin,
                    reason: format!("relative source {:?} needs spec.workspace", m.source),
                });
            };
            check_beneath(ws, &m.source, &origin)?;
            return Ok(BindMount {
                source: ws.join(relative_source(&m.source)),
                target: m.target.clone(),
                read_only: m.read_only,
            });
        };
        let source = canonical(&source, origin.clone())?;
        // An absolute source inside the workspace is the workspace's like a relative one.
        if let Some(ws) = &workspace
            && let Ok(rel) = source.strip_prefix(ws)
            && !rel.as_os_str().is_empty()
        {
            let rel = rel.to_string_lossy().into_owned();
            check_beneath(ws, &rel, &origin)?;
            return Ok(BindMount {
                source: ws.join(rel),
                target: m.target.clone(),
                read_only: m.read_only,
            });
        }
        Ok(BindMount {
            source,
            target: m.target.clone(),
            read_only: m.read_only,
        })
    };
    let env_file = env.origins_file();
    let env_mounts = env
        .mounts
        .iter()
        .map(|m| mount(m, &env_file))
        .collect::<Result<Vec<_>, _>>()?;
    let job_mounts = job
        .mounts
        .iter()
        .map(|m| mount(m, &job.file))
        .collect::<Result<Vec<_>, _>>()?;
    let assets = job
        .static_assets
        .iter()
        .map(|a| {
            Ok(BindMount {
                source: canonical(&a.source, origin_text(job, &a.origin, &job.file))?,
                target: format!("{STATIC_ROOT}/{}", a.save_path),
                read_only: true,
            })
        })
        .collect::<Result<Vec<_>, SpecError>>()?;
    Ok(RunPlan {
        bound: bound.clone(),
        workspace,
        env_mounts,
        job_mounts,
        assets,
        image_env: Vec::new(),
        labels: BTreeMap::new(),
        stdin_file: None,
        userns: None,
        restore: None,
    })
}

/// A workspace-relative source as it is joined to the workspace: `.` and empty components
/// dropped (`..` was refused with the manifest).
fn relative_source(source: &str) -> PathBuf {
    source
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect::<Vec<_>>()
        .join("/")
        .into()
}

/// Check that `rel` resolves beneath the workspace `ws` (relative links that stay inside
/// followed, anything leaving it refused), as each container's mount will resolve it.
fn check_beneath(ws: &Path, rel: &str, origin: &str) -> Result<(), SpecError> {
    let refused = |reason: String| SpecError::Refused {
        origin: origin.to_string(),
        reason,
    };
    let root = crate::confined::Root::open(ws).map_err(|e| refused(format!("the workspace {}: {e}", ws.display())))?;
    root.open_path(rel)
        .map(drop)
        .map_err(|e| refused(format!("mount source {rel:?} in the workspace: {e}")))
}

/// The bind mounts in the manifest's merge order (docs/reference/manifest.md) — workspace → environment mounts → spawn
/// mounts → static assets — where a later source replaces an earlier one at the same target,
/// ordered parents first (runc mounts in list order).
pub fn merged_binds(plan: &RunPlan) -> Vec<BindMount> {
    let env = plan.env();
    let mut by_target: Vec<BindMount> = Vec::new();
    let workspace = plan
        .workspace
        .iter()
        .filter(|_| env.mount_workspace)
        .map(|ws| BindMount {
            source: ws.clone(),
            target: env.workdir.clone(),
            read_only: false,
        });
    let all = workspace
        .chain(plan.env_mounts.iter().cloned())
        .chain(plan.job_mounts.iter().cloned())
        .chain(plan.assets.iter().cloned());
    for m in all {
        by_target.retain(|existing| existing.target != m.target);
        by_target.push(m);
    }
    by_target.sort_by_key(|m| m.target.matches('/').count());
    by_target
}

/// uid/gid the job's processes run as in a container: root unless the manifest says.
pub fn container_user(env: &Environment, host: &HostEnv) -> (u32, u32) {
    match env.user {
        Some(UserSpec::Ids { uid, gid }) => (uid, gid),
        Some(UserSpec::Host) => host.host_user(),
        None => (0, 0),
    }
}

/// The job's command in a container: setup composed in front, stdin from its file (see
/// `entry`).
pub fn process_args(job: &Job, env: &Environment) -> Vec<String> {
    let stdin = job.stdin.as_ref().map(|_| STDIN_PATH);
    entry::compose(&env.setup, job.disable_setup, stdin, &job.command.argv())
}

/// Whether output carries the setup marker (and must be split).
pub fn runs_setup(job: &Job, env: &Environment) -> bool {
    !job.disable_setup && !env.setup.is_empty()
}

/// Process environment inside the container: our defaults, then the image's, then the
/// Environment's `env`.
pub fn container_env(env: &Environment, image_env: &[String], uid: u32) -> Vec<String> {
    let mut vars: BTreeMap<String, String> = BTreeMap::new();
    vars.insert("PATH".into(), DEFAULT_PATH.into());
    vars.insert("HOME".into(), if uid == 0 { "/root".into() } else { "/tmp".into() });
    for entry in image_env {
        if let Some((k, v)) = entry.split_once('=')
            && !k.is_empty()
            && !entry.contains('\0')
        {
            vars.insert(k.to_string(), v.to_string());
        }
    }
    vars.extend(env.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    vars.into_iter().map(|(k, v)| format!("{k}={v}")).collect()
}

fn bind_options(read_only: bool) -> Vec<String> {
    let mode = if read_only { "ro" } else { "rw" };
    ["rbind", "nosuid", "nodev", "rprivate", mode]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

fn kernel_mount(dest: &str, typ: &str, source: &str, options: &[&str]) -> Result<Mount, SpecError> {
    Ok(MountBuilder::default()
        .destination(dest)
        .typ(typ)
        .source(source)
        .options(options.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .build()?)
}

/// The filesystems every container gets before any bind mount.
fn base_mounts() -> Result<Vec<Mount>, SpecError> {
    Ok(vec![
        kernel_mount("/proc", "proc", "proc", &["nosuid", "noexec", "nodev"])?,
        kernel_mount(
            "/dev",
            "tmpfs",
            "tmpfs",
            &["nosuid", "strictatime", "mode=755", DEV_TMPFS_SIZE],
        )?,
        kernel_mount(
            "/dev/pts",
            "devpts",
            "devpts",
            &["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
        )?,
        kernel_mount(
            "/dev/shm",
            "tmpfs",
            "shm",
            &["nosuid", "noexec", "nodev", "mode=1777", DEV_TMPFS_SIZE],
        )?,
        kernel_mount("/dev/mqueue", "mqueue", "mqueue", &["nosuid", "noexec", "nodev"])?,
        kernel_mount("/sys", "sysfs", "sysfs", &["nosuid", "noexec", "nodev", "ro"])?,
        kernel_mount(
            "/sys/fs/cgroup",
            "cgroup",
            "cgroup",
            &["nosuid", "noexec", "nodev", "relatime", "ro"],
        )?,
    ])
}

fn resources(r: &Resources) -> Result<oci_spec::runtime::LinuxResources, SpecError> {
    let memory = i64::try_from(r.memory.0).unwrap_or(i64::MAX);
    let mut devices = vec![LinuxDeviceCgroupBuilder::default().allow(false).access("rwm").build()?];
    for &(major, minor) in ALLOWED_CHAR_DEVICES {
        let mut rule = LinuxDeviceCgroupBuilder::default()
            .allow(true)
            .typ(LinuxDeviceType::C)
            .major(major)
            .access("rwm");
        if let Some(minor) = minor {
            rule = rule.minor(minor);
        }
        devices.push(rule.build()?);
    }
    Ok(LinuxResourcesBuilder::default()
        .devices(devices)
        // swap == limit: no swap at all (cgroup v1 memsw; runc maps it to swap.max 0 on v2).
        .memory(LinuxMemoryBuilder::default().limit(memory).swap(memory).build()?)
        .cpu(
            LinuxCpuBuilder::default()
                .quota(i64::from(r.cpu.0) * (CPU_PERIOD_US as i64) / 1000)
                .period(CPU_PERIOD_US)
                .build()?,
        )
        .pids(LinuxPidsBuilder::default().limit(i64::from(r.pids)).build()?)
        .build()?)
}

/// Build the hardened spec for a plan. Pure: the same plan and host give the same spec.
pub fn build(plan: &RunPlan, host: &HostEnv) -> Result<Spec, SpecError> {
    let job = plan.job();
    let env = plan.env();
    // Defence in depth: the manifest layer checked these; a RunPlan built by other code
    // (the HTTP API, later) must not bypass them.
    let refuse = |origin: &str, reason: String| SpecError::Refused {
        origin: format!("Job {:?}: {origin}", job.name),
        reason,
    };
    paths::check_workdir(&env.workdir).map_err(|e| refuse("spec.workdir", e.to_string()))?;
    let state_dir = host.state_dir.to_string_lossy().to_string();
    let binds = merged_binds(plan);
    for m in &binds {
        paths::check_target(&m.target).map_err(|e| refuse("mount target", e.to_string()))?;
        if let Some(reason) = paths::refused_source(&m.source.to_string_lossy(), Some(&state_dir)) {
            return Err(refuse("mount source", format!("{}: {reason}", m.source.display())));
        }
    }
    let (uid, gid) = container_user(env, host);
    if u64::from(uid) > crate::manifest::MAX_ID || u64::from(gid) > crate::manifest::MAX_ID {
        return Err(refuse(
            "spec.user",
            format!("{uid}:{gid} is above {}", crate::manifest::MAX_ID),
        ));
    }
    let userns = (!env.host_users).then(|| plan.userns.unwrap_or(IdRange::PLACEHOLDER));
    if userns.is_some() && (uid >= IdRange::SIZE || gid >= IdRange::SIZE) {
        // `user: host` lands here (the manifest checks numeric ids): HUID is only known now.
        return Err(refuse(
            "spec.user",
            format!(
                "{uid}:{gid} is outside the container's user namespace (ids 0 to {}); set hostUsers: true to run without one",
                IdRange::SIZE - 1
            ),
        ));
    }

    let caps: std::collections::HashSet<Capability> = DEFAULT_CAPABILITIES.iter().copied().collect();
    let process = ProcessBuilder::default()
        .terminal(false)
        .user(UserBuilder::default().uid(uid).gid(gid).build()?)
        .args(process_args(job, env))
        .env(container_env(env, &plan.image_env, uid))
        .cwd(&env.workdir)
        .capabilities(
            LinuxCapabilitiesBuilder::default()
                .bounding(caps.clone())
                .effective(caps.clone())
                .permitted(caps)
                .inheritable(std::collections::HashSet::new())
                .ambient(std::collections::HashSet::new())
                .build()?,
        )
        .rlimits(vec![
            PosixRlimitBuilder::default()
                .typ(PosixRlimitType::RlimitNofile)
                .soft(NOFILE_LIMIT.min(host.nofile_hard))
                .hard(NOFILE_LIMIT.min(host.nofile_hard))
                .build()?,
            // No core dumps: they would fill the workspace and leak memory contents.
            PosixRlimitBuilder::default()
                .typ(PosixRlimitType::RlimitCore)
                .soft(0u64)
                .hard(0u64)
                .build()?,
            // No file larger than the whole ephemeral-storage limit: the kernel stops the
            // fastest way over it (one file at disk speed) at once, before the measurement
            // that evicts the sandbox would see it (SIGXFSZ, or EFBIG where it is handled).
            PosixRlimitBuilder::default()
                .typ(PosixRlimitType::RlimitFsize)
                .soft(env.resources.ephemeral_storage.0)
                .hard(env.resources.ephemeral_storage.0)
                .build()?,
        ])
        .no_new_privileges(true)
        .oom_score_adj(0)
        .build()?;

    let mut mounts = base_mounts()?;
    mounts.extend(
        binds
            .iter()
            .map(|m| {
                MountBuilder::default()
                    .destination(&m.target)
                    .typ("bind")
                    .source(&m.source)
                    .options(bind_options(m.read_only))
                    .build()
            })
            .collect::<Result<Vec<_>, _>>()?,
    );
    if job.stdin.is_some() {
        // Our own file under the state dir (written before the container exists): not subject
        // to the refuse list that protects the state dir from manifests.
        let source = plan
            .stdin_file
            .clone()
            .unwrap_or_else(|| host.state_dir.join(STDIN_PLACEHOLDER));
        mounts.push(
            MountBuilder::default()
                .destination(STDIN_PATH)
                .typ("bind")
                .source(source)
                .options(bind_options(true))
                .build()?,
        );
    }

    let mut namespaces = vec![
        LinuxNamespaceType::Pid,
        LinuxNamespaceType::Ipc,
        LinuxNamespaceType::Uts,
        LinuxNamespaceType::Mount,
        LinuxNamespaceType::Cgroup,
    ];
    if plan.bound.network != NetworkMode::Host {
        namespaces.push(LinuxNamespaceType::Network);
    }
    if userns.is_some() {
        namespaces.push(LinuxNamespaceType::User);
    }
    let namespaces = namespaces
        .into_iter()
        .map(|t| LinuxNamespaceBuilder::default().typ(t).build())
        .collect::<Result<Vec<_>, _>>()?;

    let mut linux = LinuxBuilder::default();
    if let Some(range) = userns {
        let map = vec![
            LinuxIdMappingBuilder::default()
                .container_id(0u32)
                .host_id(range.host_base)
                .size(IdRange::SIZE)
                .build()?,
        ];
        linux = linux.uid_mappings(map.clone()).gid_mappings(map);
    }
    let linux = linux
        .resources(resources(&env.resources)?)
        .namespaces(namespaces)
        .masked_paths(MASKED_PATHS.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .readonly_paths(READONLY_PATHS.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .seccomp(seccomp::default_profile(&host.arch, env.allow_32bit_syscalls)?)
        .rootfs_propagation("rprivate")
        .devices(Vec::new())
        .build()?;

    let hostname: String = job.name.chars().take(63).collect();
    Ok(SpecBuilder::default()
        .version(OCI_VERSION)
        .root(RootBuilder::default().path("rootfs").readonly(false).build()?)
        .hostname(hostname)
        .process(process)
        .mounts(mounts)
        .linux(linux)
        .build()?)
}

/// The argv of a command for display (`runner get -o wide`, errors).
pub fn command_text(command: &Command) -> String {
    match command {
        Command::Shell(s) => s.clone(),
        Command::Argv(a) => a.join(" "),
    }
}

/// The spec as JSON with a stable order: `oci_spec` keeps capabilities in hash sets, whose
/// order changes between runs; sorted, `runner spec` prints the same bytes every time.
pub fn to_json(spec: &Spec) -> Result<serde_json::Value, serde_json::Error> {
    let mut value = serde_json::to_value(spec)?;
    if let Some(caps) = value
        .pointer_mut("/process/capabilities")
        .and_then(|c| c.as_object_mut())
    {
        for set in caps.values_mut() {
            if let Some(list) = set.as_array_mut() {
                list.sort_by(|a, b| a.as_str().cmp(&b.as_str()));
            }
        }
    }
    Ok(value)
}
