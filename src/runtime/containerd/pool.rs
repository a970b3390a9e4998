//! Warm pool members: containers created and started ahead of time, their init our agent
//! waiting, claimed by one Job attempt or session and destroyed after it — never reused.
//!
//! What differs per job is bound late (`runtime::late`): workspace, mounts and static assets
//! by mount propagation, the hostname through the member's UTS namespace, env, cwd, stdin,
//! command, timeouts and output through the agent. Everything else is in the member's spec,
//! and a pool's *key* is a hash of that spec (with the late places as placeholders), the
//! image's layers and the tools shipped in: a job whose key has no ready member runs cold.
//!
//! A ready member has a `ready` file in its run directory. Claiming renames it to
//! `claimed-<owner>`: a rename succeeds once, so exactly one runner process gets the member,
//! and the new name says who holds it until the claimant relabels the container as its own
//! (from then on `gc` treats it as any container of that runner).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use oci_spec::runtime::{MountBuilder, Spec};
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use super::agent::{self, Agent};
use super::io::OutputPump;
use super::{
    Engine, LABEL_JOB, LABEL_KIND, LABEL_OWNER, LABEL_STATE_DIR, LiveContainer, SIGKILL, TaskEnd, cgroupfs, task_result,
};
use crate::image::ImageInfo;
use crate::owner::owner_id;
use crate::runtime::late::{self, Layout, Place};
use crate::runtime::{ExecResult, RuntimeError, SetupResult};
use crate::spec::{self, RunPlan};

/// The pool a member was made for (its name).
pub const LABEL_POOL: &str = "runner.dev/pool";
/// What a member can serve: see the module docs.
pub const LABEL_POOL_KEY: &str = "runner.dev/pool-key";
/// `runner.dev/kind` of a member nobody has claimed.
pub const KIND_POOL: &str = "pool";
/// `runner.dev/kind` of a claimed member running a Job attempt (its output is read by the
/// claimant, so a re-adopting supervisor cannot collect it).
pub const KIND_POOLED: &str = "pooled";
/// `runner.dev/kind` of a member whose job is over, its processes killed: whoever fills
/// the pool (or `gc`) removes it.
pub const KIND_RETIRED: &str = "retired";
/// The owner label of an unclaimed member: no process, the pool holds it.
pub const POOL_OWNER: &str = "pool";
/// In a member's run directory: present while it may be claimed.
pub const READY_FILE: &str = "ready";
/// In a member's run directory: `claimed-<owner>` once claimed.
pub const CLAIMED_PREFIX: &str = "claimed-";
/// The hostname of a member until a claim sets the job's.
const MEMBER_HOSTNAME: &str = "runner-pool";
/// `containerd.v1.types.Status.RUNNING`.
const STATUS_RUNNING: i32 = 2;
/// Shell variables a POSIX shell exports on its own (dash, busybox ash): the agent's shell
/// stands between the init and the command, so they are removed unless the job sets them.
const SHELL_ARTIFACTS: &[&str] = &["PWD", "OLDPWD", "SHLVL"];

/// What a member is made with besides the plan: how its spec is bent for late binds.
pub(super) struct Shape {
    pub layout: Layout,
    pub pool: String,
    pub key: String,
}

/// What `claim` found.
pub enum Claim {
    Member(Box<Member>),
    /// No member: the job starts cold, with the image the claim resolved (if it got that far),
    /// and why no member served it.
    Cold(Option<ImageInfo>, String),
}

/// A claimed member, held by this process until it is destroyed.
pub struct Member {
    pub id: String,
    pub pool: String,
    init_pid: u32,
    layout: Layout,
    agent: Agent,
    cgroup: String,
    process: oci_spec::runtime::Process,
    /// Its user namespace's range (`None` with `hostUsers: true`).
    range: Option<spec::IdRange>,
    /// The relabelling as the claimant's container, done beside the job's start (the
    /// `claimed-<owner>` file already says who holds it); awaited before it is retired.
    relabel: tokio::task::JoinHandle<Result<(), crate::containerd::CtdError>>,
    /// Its init, pinned (a PID could be reused; this cannot), when it is the init of a PID
    /// namespace of its own: killing it kills every process of the member.
    init: Option<std::os::fd::OwnedFd>,
}

impl Member {
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Kill every process of the member. Through its pinned init when it has one: the kernel
    /// kills a PID namespace with its init, and no `runc kill --all` process (a Go runtime
    /// started by the shim for every job) is spent on it; else through the shim.
    async fn kill_all(&self, client: &crate::containerd::Containerd) {
        if let Some(fd) = &self.init {
            // SAFETY: pidfd_send_signal on a pidfd we own; no siginfo.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    std::os::fd::AsRawFd::as_raw_fd(fd),
                    libc::SIGKILL,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                )
            };
            // ESRCH: it is dead already (so is its namespace).
            if r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
                return;
            }
        }
        let _ = client.task_kill(&self.id, "", SIGKILL, true).await;
    }

    /// Its range and its process's user (container ids), when it has a user namespace.
    fn userns(&self) -> Option<(spec::IdRange, (u32, u32))> {
        self.range
            .map(|r| (r, (self.process.user().uid(), self.process.user().gid())))
    }
}

/// The plan with everything that is bound late taken out: what a member is made from.
pub fn member_plan(plan: &RunPlan) -> RunPlan {
    let mut p = plan.clone();
    p.bound.env.env.clear();
    p.bound.env.setup.clear();
    p.bound.job.stdin = None;
    p.bound.job.disable_setup = true;
    p.bound.job.timeout = None;
    p.bound.job.active_deadline = None;
    p.bound.job.command = crate::manifest::Command::Argv(vec!["true".into()]);
    p.assets.clear();
    p.labels.clear();
    p.stdin_file = None;
    p
}

/// The late places a plan needs, in mount order (and whether it has static assets).
pub fn layout_of(plan: &RunPlan) -> Layout {
    let mut without_assets = plan.clone();
    without_assets.assets.clear();
    Layout {
        places: spec::merged_binds(&without_assets)
            .into_iter()
            .map(|b| Place {
                file: std::fs::metadata(&b.source).is_ok_and(|m| m.is_file()),
                target: b.target,
                read_only: b.read_only,
            })
            .collect(),
        static_assets: !plan.assets.is_empty(),
    }
}

/// Why a plan cannot run in a pool member, if it cannot. A late mount lands on the *root* of
/// the member's mount at its place and would hide a place mounted under it, so no place may
/// lie under another; and an asset is mounted on the host under the static root, where a
/// path through another asset (the job author's directory, maybe with symlinks) must never
/// be resolved, so no asset may lie under another.
pub fn unpoolable(plan: &RunPlan) -> Option<String> {
    if plan.bound.network == crate::manifest::NetworkMode::Bridge {
        // Its name on the network, its egress rules and its host ports are the job's own,
        // made as it is attached: a member attached for another job would carry that job's.
        return Some("a bridge-network container is attached for its own job (name, egress rules, ports)".into());
    }
    let under = |a: &str, b: &str| a == b || a.starts_with(&format!("{}/", b.trim_end_matches('/')));
    let layout = layout_of(plan);
    for p in &layout.places {
        if let Some(q) = layout
            .places
            .iter()
            .find(|q| q.target != p.target && under(&p.target, &q.target))
        {
            return Some(format!("{} lies under {}", p.target, q.target));
        }
        if layout.static_assets && (under(spec::STATIC_ROOT, &p.target) || under(&p.target, spec::STATIC_ROOT)) {
            return Some(format!("{} and the static assets overlap", p.target));
        }
    }
    for (i, a) in plan.assets.iter().enumerate() {
        if let Some(b) = plan
            .assets
            .iter()
            .enumerate()
            .find(|(j, b)| *j != i && under(&a.target, &b.target))
        {
            return Some(format!("asset {} lies under asset {}", a.target, b.1.target));
        }
    }
    None
}

/// Bend a spec built from `member_plan` into a member's: binds come from the places in
/// `late_dir`, propagating from the host (`rslave`, root included), and a neutral hostname.
fn bend(spec: &mut Spec, layout: &Layout, late_dir: &Path) -> Result<(), RuntimeError> {
    let options = |ro: bool| -> Vec<String> {
        ["rbind", "nosuid", "nodev", "rslave", if ro { "ro" } else { "rw" }]
            .iter()
            .map(|s| s.to_string())
            .collect()
    };
    let mut mounts = spec.mounts().clone().unwrap_or_default();
    for m in mounts.iter_mut().filter(|m| m.typ().as_deref() == Some("bind")) {
        let target = m.destination().to_string_lossy().into_owned();
        if let Some(i) = layout.places.iter().position(|p| p.target == target) {
            m.set_source(Some(late_dir.join(late::place_name(i))));
            m.set_options(Some(options(layout.places[i].read_only)));
        }
    }
    if layout.static_assets {
        mounts.push(
            MountBuilder::default()
                .destination(spec::STATIC_ROOT)
                .typ("bind")
                .source(late_dir.join(late::STATIC_DIR))
                // Writable as a cold container's /static is (a root-owned 0755 directory runc
                // makes in the rootfs): the assets in it are read-only mounts of their own.
                .options(options(false))
                .build()
                .map_err(|e| RuntimeError::Internal(format!("static mount: {e}")))?,
        );
    }
    spec.set_mounts(Some(mounts));
    spec.set_hostname(Some(MEMBER_HOSTNAME.into()));
    if let Some(linux) = spec.linux_mut() {
        linux.set_rootfs_propagation(Some("rslave".into()));
    }
    Ok(())
}

/// The spec a member of this plan gets, its late places in `late_dir`.
pub(super) fn member_spec(
    plan: &RunPlan,
    host: &spec::HostEnv,
    layout: &Layout,
    late_dir: &Path,
) -> Result<Spec, RuntimeError> {
    let mut built = spec::build(plan, host).map_err(|e| RuntimeError::Refused(e.to_string()))?;
    bend(&mut built, layout, late_dir)?;
    Ok(built)
}

/// Set the hostname of the UTS namespace `init_pid` is in. setns of a UTS namespace affects
/// only the calling thread: a thread of our own does it and ends, so no other work ever runs
/// in the container's namespace. The PID is only trusted once the namespace is opened: the
/// process must then still be in the member's cgroup (a PID reused by a host process fails
/// that), and the namespace must not be ours (the host's hostname is never touched).
fn set_hostname(init_pid: u32, cgroup: &str, name: &str) -> Result<(), RuntimeError> {
    use std::os::unix::fs::MetadataExt;
    let path = format!("/proc/{init_pid}/ns/uts");
    let name = name.to_string();
    let cgroup = cgroup.to_string();
    let io = |what: &str, e: std::io::Error| RuntimeError::Io {
        what: format!("{what} of the claimed container"),
        source: e,
    };
    std::thread::spawn(move || -> Result<(), RuntimeError> {
        let ns = std::fs::File::open(&path).map_err(|e| io("opening the UTS namespace", e))?;
        let in_member = std::fs::read_to_string(format!("/proc/{init_pid}/cgroup"))
            .is_ok_and(|c| c.lines().any(|l| l.ends_with(&cgroup)));
        let own = std::fs::metadata("/proc/thread-self/ns/uts").map(|m| m.ino()).ok();
        let theirs = ns.metadata().map(|m| m.ino()).ok();
        if !in_member || own.is_none() || own == theirs {
            return Err(RuntimeError::Internal(format!(
                "process {init_pid} is not the claimed container's init"
            )));
        }
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWUTS)
            .map_err(|e| io("entering the UTS namespace", e.into()))?;
        nix::unistd::sethostname(&name).map_err(|e| io("setting the hostname", e.into()))
    })
    .join()
    .map_err(|_| RuntimeError::Internal("the hostname thread panicked".into()))?
}

/// Whether a spec gives its container a PID namespace of its own (then its init's death is
/// every process's).
fn own_pid_namespace(spec: &Spec) -> bool {
    spec.linux()
        .as_ref()
        .and_then(|l| l.namespaces().as_ref())
        .is_some_and(|ns| {
            ns.iter()
                .any(|n| n.typ() == oci_spec::runtime::LinuxNamespaceType::Pid && n.path().is_none())
        })
}

/// A pidfd for `pid` (None where the kernel has none: before 5.3).
fn pin(pid: u32) -> Option<std::os::fd::OwnedFd> {
    // SAFETY: pidfd_open returns a new descriptor we then own, or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a fresh descriptor owned by nobody else.
    Some(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd as i32) })
}

/// Whether a process has a handler for a signal (`SigCgt` of /proc/PID/status).
fn catches(host_pid: i32, signal: Signal) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{host_pid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << (signal as i32 - 1)) != 0)
}

/// The script a pooled command runs through the agent: the job's directory (the agent's own
/// cwd is the place *under* the workspace mount, which arrived later), its environment
/// exactly (the shell's own exports removed), then exec.
fn pooled_script(name: &str, argv: &[String], env: &[(String, String)], cwd: &str) -> String {
    let mut unset: Vec<&str> = SHELL_ARTIFACTS
        .iter()
        .copied()
        .filter(|v| !env.iter().any(|(k, _)| k == v))
        .collect();
    unset.sort();
    let body = agent::command_script(name, argv, env, Some(cwd));
    // After the `cd` (which sets OLDPWD), before the variables.
    let (cd, rest) = body.split_once('\n').unwrap_or((body.as_str(), ""));
    format!("{cd}\nunset {}\n{rest}", unset.join(" "))
}

impl Engine {
    /// Where the ready members of pool key `key` are listed, an empty file per member (beside
    /// the run directories): what a claim reads.
    fn ready_index(&self, key: &str) -> PathBuf {
        self.run_dir.with_file_name("ready").join(key)
    }

    /// Where a member's late places live (beside the run directories).
    pub fn late_dir(&self, id: &str) -> PathBuf {
        self.run_dir.with_file_name("late").join(id)
    }

    /// The key of the pool that can serve this plan, with its layout and the image it
    /// resolved (a cold start goes on with that, instead of resolving it again).
    pub async fn pool_key(&self, plan: &RunPlan) -> Result<(String, Layout, ImageInfo), RuntimeError> {
        // An Environment that snapshots its setup: members start from that snapshot (a claim
        // gets a sandbox warm and prepared), as its cold jobs do.
        let prepared = self.on_setup_snapshot(plan).await;
        let plan = prepared.as_ref().unwrap_or(plan);
        let image_name = plan
            .env()
            .image
            .clone()
            .ok_or_else(|| RuntimeError::Refused("spec.image is required".into()))?;
        let image = crate::image::remote::ensure(
            &self.client,
            &image_name,
            plan.env().image_pull_policy,
            &self.options.registry,
        )
        .await?;
        let mut member = member_plan(plan);
        member.image_env = image.config.env.clone().unwrap_or_default();
        let layout = layout_of(plan);
        let spec = member_spec(&member, &self.host, &layout, Path::new("/late"))?;
        let json = spec::to_json(&spec).map_err(|e| RuntimeError::Internal(format!("encoding the spec: {e}")))?;
        let mut h = Sha256::new();
        h.update(json.to_string().as_bytes());
        h.update(image.top_chain.as_bytes());
        h.update(serde_json::to_vec(&layout).unwrap_or_default());
        h.update(agent::AGENT_SCRIPT.as_bytes());
        h.update(super::prelaunch::LAUNCH.as_bytes());
        for tool in &self.options.tools {
            h.update(tool.name.as_bytes());
            h.update(Sha256::digest(tool.contents));
        }
        Ok((hex::encode(&h.finalize()[..12]), layout, image))
    }

    /// Make one member of pool `pool` for a plan (a template job of the pool's Environment)
    /// and start it; it is ready to be claimed when this returns.
    pub async fn create_member(&self, plan: &RunPlan, pool: &str) -> Result<String, RuntimeError> {
        let (key, layout, image) = self.pool_key(plan).await?;
        let mut member = member_plan(plan);
        member.bound.job.name = format!("pool-{pool}");
        let shape_key = key.clone();
        let shape = Shape {
            layout,
            pool: pool.to_string(),
            key,
        };
        let args = vec![
            spec::SHELL.to_string(),
            "-c".to_string(),
            agent::AGENT_SCRIPT.to_string(),
        ];
        let created = self
            .create(&member, Some(image), Some(args), KIND_POOL, true, Some(&shape))
            .await?;
        let id = created.id.clone();
        let started = async {
            // Nothing reads a member's own output: its init writes none, and a FIFO without
            // a reader would stop it after the runner that made it exits.
            let (init_pid, mounts) = self
                .create_task(&id, created.rootfs.clone(), &crate::containerd::Stdio::default())
                .await?;
            self.start_task(&id, mounts).await?;
            self.prelaunch_shell(&created, init_pid).await;
            std::fs::write(self.run_dir.join(&id).join(READY_FILE), pool).map_err(|source| RuntimeError::Io {
                what: "marking the member ready".into(),
                source,
            })?;
            let index = self.ready_index(&shape_key);
            std::fs::create_dir_all(&index)
                .and_then(|()| std::fs::write(index.join(&id), b""))
                .map_err(|source| RuntimeError::Io {
                    what: "listing the member as ready".into(),
                    source,
                })
        }
        .await;
        if let Err(e) = started {
            let _ = self.teardown(&id).await;
            return Err(e);
        }
        Ok(id)
    }

    /// Members of this state dir, with a pool key when given.
    pub async fn members(
        &self,
        key: Option<&str>,
    ) -> Result<Vec<containerd_client::services::v1::Container>, RuntimeError> {
        let filter = match key {
            Some(key) => format!("labels.\"{LABEL_POOL_KEY}\"=={key},labels.\"{LABEL_KIND}\"=={KIND_POOL}"),
            None => format!("labels.\"{LABEL_KIND}\"=={KIND_POOL}"),
        };
        let ours = self.state_dir().display().to_string();
        Ok(self
            .client
            .containers(vec![filter])
            .await?
            .into_iter()
            .filter(|c| c.labels.get(LABEL_STATE_DIR) == Some(&ours))
            .collect())
    }

    /// Whether a member can be claimed now (its ready mark is there).
    pub fn member_ready(&self, id: &str) -> bool {
        self.run_dir.join(id).join(READY_FILE).exists()
    }

    /// Take a member out of its pool for good (`pool rm`, a broken member): claim it so no
    /// one else can, then tear it down. False when someone else claimed it first.
    pub async fn retire_member(&self, id: &str) -> Result<bool, RuntimeError> {
        let dir = self.run_dir.join(id);
        if std::fs::rename(
            dir.join(READY_FILE),
            dir.join(format!("{CLAIMED_PREFIX}{}", owner_id())),
        )
        .is_err()
        {
            return Ok(false);
        }
        self.teardown(id).await?;
        Ok(true)
    }

    /// Whether a member's init still runs.
    pub async fn member_alive(&self, id: &str) -> bool {
        matches!(self.client.task_get(id).await, Ok(Some(p)) if p.status == STATUS_RUNNING)
    }

    /// Claim a ready member that can serve `plan`, relabelled as this process's container of
    /// kind `kind` (with the plan's labels). `Claim::Cold`: no ready member; the caller runs
    /// cold, with the image resolved here if it got that far.
    /// Broken members found on the way are torn down.
    pub async fn claim(&self, plan: &RunPlan, kind: &str) -> Result<Claim, RuntimeError> {
        if plan.env().image.is_none() {
            return Ok(Claim::Cold(None, "the Environment names no image".into()));
        }
        if let Some(why) = unpoolable(plan) {
            tracing::debug!(why, "the job cannot run in a pool member");
            return Ok(Claim::Cold(None, format!("no pool member can run it: {why}")));
        }
        let t0 = Instant::now();
        let (key, layout, image) = self.pool_key(plan).await?;
        super::claim_phase("pool key", t0);
        // The ready index names the candidates without reading every member's record from
        // containerd (which made concurrent claims quadratic in the pool's size); members an
        // older runner made are not in it, and are found by their labels.
        let index = self.ready_index(&key);
        let mut ids: Vec<String> = std::fs::read_dir(&index)
            .map(|d| d.flatten().filter_map(|e| e.file_name().into_string().ok()).collect())
            .unwrap_or_default();
        let mut listed: HashMap<String, containerd_client::services::v1::Container> = HashMap::new();
        if ids.is_empty() {
            listed = self
                .members(Some(&key))
                .await?
                .into_iter()
                .map(|c| (c.id.clone(), c))
                .collect();
            ids = listed.keys().cloned().collect();
            ids.sort();
        }
        if ids.is_empty() {
            return Ok(Claim::Cold(Some(image), self.no_pool_fits(plan, &key)));
        }
        tracing::debug!(key, candidates = ids.len(), "looking for a pool member");
        // Claimants start at different places, so concurrent claims rarely collide.
        let shift = std::process::id() as usize + t0.elapsed().subsec_nanos() as usize;
        let n = ids.len();
        ids.rotate_left(shift % n);
        let me = owner_id();
        for id in ids {
            let dir = self.run_dir.join(&id);
            let won = std::fs::rename(dir.join(READY_FILE), dir.join(format!("{CLAIMED_PREFIX}{me}"))).is_ok();
            // Claimed (by this process or another) or gone: either way no longer ready.
            let _ = std::fs::remove_file(index.join(&id));
            if !won {
                continue;
            }
            let c = match listed.remove(&id) {
                Some(c) => c,
                None => match self.client.container(&id).await {
                    Ok(Some(c)) => c,
                    other => {
                        tracing::warn!(member = id, result = ?other.map(|_| ()), "a ready pool member has no record; removing it");
                        let _ = self.teardown(&id).await;
                        continue;
                    }
                },
            };
            let task = self.client.task_get(&c.id).await;
            let init_pid = match task {
                Ok(Some(p)) if p.status == STATUS_RUNNING => p.pid,
                _ => {
                    tracing::warn!(member = c.id, "a pool member was not running; removing it");
                    let _ = self.teardown(&c.id).await;
                    if let (Some(hook), Some(pool)) = (&self.options.on_claim, c.labels.get(LABEL_POOL)) {
                        (hook.0)(pool);
                    }
                    continue;
                }
            };
            let mut labels: HashMap<String, String> = plan.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            labels.extend([
                (LABEL_OWNER.to_string(), me.clone()),
                (LABEL_KIND.to_string(), kind.to_string()),
                (LABEL_JOB.to_string(), plan.job().name.clone()),
            ]);
            let relabel = {
                let (client, id) = (self.client.clone(), c.id.clone());
                tokio::spawn(async move { client.container_set_labels(&id, labels).await })
            };
            let claimed = async {
                let spec: Spec = c
                    .spec
                    .as_ref()
                    .and_then(|s| serde_json::from_slice(&s.value).ok())
                    .ok_or_else(|| RuntimeError::Internal(format!("member {} has no readable spec", c.id)))?;
                let process = spec
                    .process()
                    .clone()
                    .ok_or_else(|| RuntimeError::Internal("member spec without process".into()))?;
                let range = super::remap::range_of(&spec);
                let (uid, gid) = (process.user().uid(), process.user().gid());
                let (uid, gid) = match range {
                    Some(r) => (r.host_id(uid), r.host_id(gid)),
                    None => (uid, gid),
                };
                let agent = Agent::open(&dir.join("agent"), uid, gid)?;
                // Pinned before `set_hostname` checks that the PID is the member's init (in
                // its cgroup), so what is pinned is what was checked.
                let init = own_pid_namespace(&spec).then(|| pin(init_pid)).flatten();
                let hostname: String = plan.job().name.chars().take(63).collect();
                set_hostname(init_pid, &self.cgroup_path(&c.id), &hostname)?;
                Ok::<_, RuntimeError>(Member {
                    id: c.id.clone(),
                    pool: c.labels.get(LABEL_POOL).cloned().unwrap_or_default(),
                    init_pid,
                    layout: layout.clone(),
                    agent,
                    cgroup: self.cgroup_path(&c.id),
                    process,
                    range,
                    relabel,
                    init,
                })
            }
            .await;
            match claimed {
                Ok(member) => {
                    tracing::debug!(ms = t0.elapsed().as_secs_f64() * 1e3, member = member.id, "claimed");
                    return Ok(Claim::Member(Box::new(member)));
                }
                Err(e) => {
                    let _ = self.teardown(&c.id).await;
                    return Err(e);
                }
            }
        }
        let pools: std::collections::BTreeSet<&str> = self
            .options
            .pools
            .iter()
            .filter(|p| p.key == key)
            .map(|p| p.name.as_str())
            .collect();
        let names: Vec<&str> = pools.into_iter().collect();
        Ok(Claim::Cold(
            Some(image),
            format!("no ready member in pool {} (every one was taken)", names.join(", ")),
        ))
    }

    /// Why no pool has a member of this job's shape (`key`): the pools of its Environment and
    /// what they serve instead.
    fn no_pool_fits(&self, plan: &RunPlan, key: &str) -> String {
        let env = &plan.env().name;
        let (workspace, assets) = (plan.workspace.is_some(), !plan.assets.is_empty());
        let theirs: Vec<&crate::runtime::PoolInfo> =
            self.options.pools.iter().filter(|p| &p.environment == env).collect();
        if theirs.is_empty() {
            return format!("no warm pool of Environment {env:?}");
        }
        if let Some(p) = theirs.iter().find(|p| p.key == key) {
            return format!("pool {} has no members (a filler may be making them)", p.name);
        }
        let why: Vec<String> = theirs
            .iter()
            .map(|p| {
                let mismatch = if workspace && !p.workspace {
                    "serves jobs without a workspace (`pool create --workspace` serves them)".to_string()
                } else if !workspace && p.workspace {
                    "serves jobs with a workspace; this one has none".to_string()
                } else if assets && !p.static_assets {
                    "serves jobs without static assets (`pool create --static-assets` serves them)".to_string()
                } else if !assets && p.static_assets {
                    "serves jobs with static assets; this one has none".to_string()
                } else {
                    "was made for another spec of it (its image, user, resources or mounts changed: `pool create` it again)"
                        .to_string()
                };
                format!("pool {} {mismatch}", p.name)
            })
            .collect();
        why.join("; ")
    }

    /// Bind the plan's workspace, mounts and static assets into a claimed member.
    fn bind_late(
        &self,
        id: &str,
        layout: &Layout,
        userns: Option<(spec::IdRange, (u32, u32))>,
        plan: &RunPlan,
    ) -> Result<(), RuntimeError> {
        let dir = self.late_dir(id);
        let io = |what: String| move |source| RuntimeError::Io { what, source };
        let mut without_assets = plan.clone();
        without_assets.assets.clear();
        let binds = spec::merged_binds(&without_assets);
        if binds.len() != layout.places.len() {
            return Err(RuntimeError::Internal(
                "the member's layout does not fit the job".into(),
            ));
        }
        // The workspace's binds go through views, as in a cold container (see
        // `remap::workspace_views`): idmapped in a user namespace, and every path beneath the
        // workspace resolved now, beneath its descriptor.
        let mut sources: Vec<PathBuf> = binds.iter().map(|b| b.source.clone()).collect();
        if let Some(ws) = &plan.workspace {
            let ids = match userns {
                Some((range, user)) => Some(super::remap::ViewIds {
                    owner: super::remap::workspace_owner(ws).map_err(io("reading the workspace's owner".into()))?,
                    user,
                    range,
                }),
                None => None,
            };
            let list: Vec<(usize, PathBuf, bool)> = binds
                .iter()
                .enumerate()
                .map(|(i, b)| (i, b.source.clone(), b.read_only))
                .collect();
            for (i, view) in
                super::remap::workspace_views(&self.run_dir.join(id), ws, &list, ids).map_err(super::view_error)?
            {
                sources[i] = view;
            }
        }
        for (i, (b, source)) in binds.iter().zip(&sources).enumerate() {
            late::bind_place(&dir, i, source, b.read_only).map_err(io(format!("binding {}", b.target)))?;
        }
        for a in &plan.assets {
            let save_path = a
                .target
                .strip_prefix(&format!("{}/", spec::STATIC_ROOT))
                .unwrap_or(&a.target);
            late::bind_asset(&dir, save_path, &a.source).map_err(io(format!("binding {}", a.target)))?;
        }
        // The places hold their own copies of the views (see `Engine::create_task`). Dropped
        // off the claim's path: its mountinfo reads and unmounts took 2-3 ms of each claim.
        let (engine, id) = (self.clone(), id.to_string());
        tokio::task::spawn_blocking(move || engine.drop_host_mounts(&id));
        Ok(())
    }

    /// Run a one-shot job in a claimed member, then destroy it. The same result as a cold
    /// run: setup and command composed as in `entry`, stdin from the job, the container's
    /// cgroup counters, the whole container killed when the command ends (as a PID 1's exit
    /// does). On a timeout the command's main process gets SIGTERM only when it handles it,
    /// as a PID 1 would, and everything else in the container does.
    pub async fn run_pooled(
        &self,
        member: Member,
        plan: &RunPlan,
        cancel: &CancellationToken,
    ) -> Result<ExecResult, RuntimeError> {
        let result = self.run_in_member(&member, plan, cancel).await.map(|mut r| {
            r.pool = Some(member.pool.clone());
            r
        });
        // Every process of the member is dead (`run_in_member` ends with SIGKILL to all):
        // what is left is containerd's records, the snapshot and the late binds, which the
        // pool's filler removes off the job's path.
        // The claim's relabelling lands first: retiring after it is what leaves `retired`.
        let relabelled = match member.relabel.await {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                tracing::warn!(member = member.id, error = %e, "relabelling the claimed member");
                false
            }
            Err(e) => {
                tracing::warn!(member = member.id, error = %e, "relabelling the claimed member");
                false
            }
        };
        if let (Ok(_), Some(hook), true) = (&result, &self.options.on_claim, relabelled) {
            let labels = HashMap::from([
                (LABEL_KIND.to_string(), KIND_RETIRED.to_string()),
                (LABEL_OWNER.to_string(), POOL_OWNER.to_string()),
            ]);
            if self.client.container_set_labels(&member.id, labels).await.is_ok() {
                (hook.0)(&member.pool);
                return result;
            }
        }
        let teardown = self.teardown(&member.id).await;
        // The pool is one member short whatever happened.
        if let Some(hook) = &self.options.on_claim {
            (hook.0)(&member.pool);
        }
        let result = result?;
        teardown?;
        Ok(result)
    }

    /// Members of this state dir whose job is over, for the filler to remove.
    pub async fn retired(&self) -> Result<Vec<String>, RuntimeError> {
        let ours = self.state_dir().display().to_string();
        Ok(self
            .client
            .containers(vec![format!("labels.\"{LABEL_KIND}\"=={KIND_RETIRED}")])
            .await?
            .into_iter()
            .filter(|c| c.labels.get(LABEL_STATE_DIR) == Some(&ours))
            .map(|c| c.id)
            .collect())
    }

    async fn run_in_member(
        &self,
        member: &Member,
        plan: &RunPlan,
        cancel: &CancellationToken,
    ) -> Result<ExecResult, RuntimeError> {
        let job = plan.job();
        let env = plan.env();
        self.bind_late(&member.id, &member.layout, member.userns(), plan)?;
        let argv = crate::spec::entry::compose(&env.setup, job.disable_setup, None, &job.command.argv());
        let vars: Vec<(String, String)> = env.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let cwd = member.process.cwd().to_string_lossy().into_owned();
        let script = pooled_script(&agent::request_name(0), &argv, &vars, &cwd);
        let expect_marker = spec::runs_setup(job, env);
        let storage = self.watch_member_storage(plan, &member.id, &member.cgroup, None);
        (self.end_prelaunched(&member.id, &member.cgroup, member.init_pid, &member.agent)).await;
        let started = Instant::now();
        let req = member.agent.send(0, &script, job.stdin.as_deref().map(str::as_bytes))?;
        let pumps = OutputPump::capture(req.out, req.err, expect_marker, self.options.output_limit);
        let limit = job.timeout.into_iter().chain(job.active_deadline).min();
        let mut done = Box::pin(super::read_status(req.done));
        let sleep = async {
            match limit {
                Some(l) => tokio::time::sleep(l).await,
                None => std::future::pending().await,
            }
        };
        let (status, timed_out, interrupted) = tokio::select! {
            s = &mut done => (s, false, false),
            () = sleep => (None, true, false),
            () = cancel.cancelled() => (None, false, true),
            // The watch killed every process of the member: `done` ends without a status.
            () = storage.evicted().cancelled() => (None, false, false),
        };
        let mut evicted = storage.verdict();
        let status = if evicted.is_some() {
            None
        } else if timed_out || interrupted {
            // After a SIGKILL to all the agent is dead too: `done` ends at once, without a status.
            let killed = self.stop_member(member, &req.dir_fd, req.sent).await;
            let wait = if killed {
                Duration::from_millis(200)
            } else {
                self.options.kill_grace
            };
            tokio::time::timeout(wait, &mut done).await.unwrap_or_default()
        } else {
            status
        };
        // The command's end is the container's, as when it is PID 1.
        member.kill_all(&self.client).await;
        let duration = started.elapsed();
        let (out, err) = pumps.finish(super::DRAIN_LIMIT, false).await;
        let stats = cgroupfs::read(&member.cgroup);
        // No status: the grace ran out and the container was killed (SIGKILL, as a cold
        // container's init then reports).
        let status = status.unwrap_or(128 + SIGKILL);
        if evicted.is_none() {
            evicted = super::final_verdict(&storage, status != 0).await;
        }
        let end = TaskEnd {
            exit: crate::containerd::Exit { status },
            timed_out,
            interrupted,
            duration,
        };
        let mut result = task_result(end, expect_marker, out, err, stats, started);
        if evicted.is_some() {
            result.signal = Some(SIGKILL as i32);
        }
        result.evicted = evicted;
        Ok(result)
    }

    /// `watch_storage` for a claimed member: its writable layer is found in containerd
    /// beside the job's start (one RPC not on the claim's path) and added when known.
    fn watch_member_storage(
        &self,
        plan: &RunPlan,
        id: &str,
        cgroup: &str,
        agent: Option<&std::path::Path>,
    ) -> std::sync::Arc<crate::runtime::storage::StorageWatch> {
        let storage = self.watch_storage(plan, id, cgroup, None, agent);
        let (client, id, watch) = (self.client.clone(), id.to_string(), std::sync::Arc::downgrade(&storage));
        tokio::spawn(async move {
            let upper = match client.snapshot_mounts(&id).await {
                Ok(mounts) => super::remap::writable_layer(&mounts),
                Err(e) => {
                    tracing::warn!(container = id, error = %e, "finding the member's writable layer");
                    None
                }
            };
            if let (Some(upper), Some(watch)) = (upper, watch.upgrade()) {
                watch.add(crate::runtime::storage::Tree::WritableLayer, upper);
            }
        });
        storage
    }

    /// A timeout or an interrupt: SIGTERM to every process of the member but its agent,
    /// and to the command's main process only when it handles SIGTERM (a cold container's
    /// init, PID 1, ignores signals it has no handler for), then SIGKILL after the grace.
    async fn stop_member(&self, member: &Member, dir: &std::os::fd::OwnedFd, sent: u64) -> bool {
        let main = agent::request_pid(dir, sent, member.init_pid, &member.cgroup);
        let spare_main = main.is_some_and(|pid| !catches(pid, Signal::SIGTERM));
        for pid in cgroupfs::procs(&member.cgroup) {
            if pid as u32 == member.init_pid || (spare_main && Some(pid) == main) {
                continue;
            }
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGTERM);
        }
        let grace = self.options.kill_grace;
        let waited = Instant::now();
        // The main process's end is what the grace waits for; the caller reads its status.
        while waited.elapsed() < grace {
            if main.is_none_or(|pid| nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_err()) {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        member.kill_all(&self.client).await;
        true
    }

    /// A live container (a session's sandbox) on a claimed member: setup runs first through
    /// the agent, as it runs in a cold container's init.
    pub async fn live_from_member(&self, member: Member, plan: &RunPlan) -> Result<LiveContainer, RuntimeError> {
        let id = member.id.clone();
        let userns = member.userns();
        let relabel = member.relabel;
        tokio::spawn(async move {
            if let Ok(Err(e)) = relabel.await {
                tracing::warn!(error = %e, "relabelling the claimed member");
            }
        });
        let built = async {
            let t0 = Instant::now();
            self.bind_late(&member.id, &member.layout, userns, plan)?;
            super::claim_phase("bind late", t0);
            let init_exited = CancellationToken::new();
            {
                let engine = self.clone();
                let id = id.clone();
                let token = init_exited.clone();
                tokio::spawn(async move {
                    let _ = engine.wait(&id, "").await;
                    token.cancel();
                });
            }
            let env = plan.env();
            let pool = member.pool.clone();
            let mut live = LiveContainer::new(
                self.clone(),
                Some(std::sync::Arc::new(member.agent)),
                member.init_pid,
                init_exited,
                id.clone(),
                member.cgroup.clone(),
                member.process.clone(),
                env.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            );
            live.pool = Some(pool);
            live.workspace = plan.workspace.clone();
            let agent_dir = live.agent_dir().map(std::path::Path::to_path_buf);
            live.storage = Some(self.watch_member_storage(plan, &id, &live.cgroup, agent_dir.as_deref()));
            *live.prelaunched.get_mut().expect("prelaunched lock") = self.adopt_prelaunched(&live, plan).await;
            if spec::runs_setup(plan.job(), env) {
                let job = plan.job();
                let started = Instant::now();
                let request = crate::runtime::ExecRequest {
                    argv: vec![
                        spec::SHELL.to_string(),
                        "-c".to_string(),
                        spec::entry::setup_script(&env.setup),
                    ],
                    timeout: job.timeout.into_iter().chain(job.active_deadline).min(),
                    ..Default::default()
                };
                let r = live.agent_run(request, None).await?;
                live.set_setup(SetupResult {
                    exit_code: r.exit_code,
                    stdout: r.stdout,
                    stderr: r.stderr,
                    stdout_dropped_bytes: r.stdout_dropped_bytes,
                    stderr_dropped_bytes: r.stderr_dropped_bytes,
                    timed_out: r.timed_out,
                    duration_ms: started.elapsed().as_millis() as u64,
                });
            }
            Ok::<_, RuntimeError>(live)
        }
        .await;
        match built {
            Ok(live) => Ok(live),
            Err(e) => {
                let _ = self.teardown(&id).await;
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pooled_script_removes_shell_exports_the_job_does_not_set() {
        let s = pooled_script("req-0", &["env".into()], &[("SHLVL".into(), "5".into())], "/work");
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "cd '/work' || exit 126");
        assert_eq!(lines[1], "unset OLDPWD PWD");
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(s.replace(lines[0], "cd /"))
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("SHLVL=5"), "{text}");
        assert!(!text.contains("PWD="), "{text}");
    }

    #[test]
    fn signal_handlers_are_read_from_proc() {
        // This test process (Rust's runtime) installs no SIGTERM handler.
        assert!(!catches(std::process::id() as i32, Signal::SIGTERM));
        assert!(!catches(-1, Signal::SIGTERM));
    }
}
