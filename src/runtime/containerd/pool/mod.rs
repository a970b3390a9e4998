//! Warm pool members: containers created and started ahead of time, their init our agent
//! waiting, claimed by one Job attempt or session and destroyed after it — never reused.
//!
//! What differs per job is bound late (`runtime::late`): workspace, mounts and static assets
//! by mount propagation, the hostname through the member's UTS namespace, env, cwd, stdin,
//! command, timeouts and output through the agent. Everything else is in the member's spec,
//! and a pool's *key* is a hash of that spec (with the late places as placeholders), the
//! image's layers and the tools shipped in: a job whose key has no ready member runs cold.
//! Every member offers every place of its Environment, the workspace and the static-assets
//! root included (`member_layout`), so whether a job has a workspace, assets or stdin is not
//! in the key; what a job does not use is taken out of the member at claim (`hide`).
//!
//! Parts: `claim` (taking a member, late binds), `hide` (taking unused places out), `run`
//! (a job or a session in a claimed member).
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

mod claim;
pub(super) mod hide;
mod key;
pub use key::ImageRead;
mod run;

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
    /// Its agent, once the member is readied for the claim (see `Readying`).
    agent: Readying,
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
    /// The workspace its image holds for what it serves (`seed`).
    seed: Option<Box<crate::image::WorkspaceSeed>>,
    /// The static root to put back for the job's assets (the filler took it out).
    static_back: Option<hide::StaticBack>,
}

/// A claimed member's readying — its agent's FIFOs opened, the places the job has no use for
/// taken out and its hostname set, inside its namespaces — runs beside the binding of the
/// job's workspace, mounts and assets on the host side (`bind_late`): the two touch disjoint
/// places (what is taken out is what nothing is bound at), and neither needs the other's
/// result, so a claim waits for the longer of the two instead of their sum.
enum Readying {
    Pending(tokio::sync::oneshot::Receiver<Result<Agent, RuntimeError>>),
    Ready(Agent),
}

impl Member {
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Wait until the member is readied (started at the claim); its agent is then `agent()`.
    /// Whoever holds a claimed member waits for this before it uses it or tears it down, so
    /// nothing of ours works inside the member's namespaces when it goes (the readying
    /// thread answers from there, then only ends: it may hold them some µs longer).
    async fn ready(&mut self) -> Result<(), RuntimeError> {
        if let Readying::Pending(handle) = &mut self.agent {
            let t0 = Instant::now();
            // A readying that failed or panicked: the member is lost either way.
            let agent = handle
                .await
                .map_err(|_| {
                    "the thread readying it ended without an answer (it panicked or could not start)".to_string()
                })
                .and_then(|r| r.map_err(|e| e.to_string()))
                .map_err(RuntimeError::MemberLost)?;
            super::claim_phase("member ready awaited", t0);
            self.agent = Readying::Ready(agent);
        }
        Ok(())
    }

    /// The member's agent, once `ready` succeeded.
    fn agent(&self) -> Result<&Agent, RuntimeError> {
        match &self.agent {
            Readying::Ready(agent) => Ok(agent),
            Readying::Pending(_) => Err(RuntimeError::Internal(
                "the claimed member's agent was used before the member was readied".into(),
            )),
        }
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

/// How long a pool's claims must pause before a refill starts (a session's in its server, a
/// queued filler's for the CLI's claims).
pub const REFILL_QUIET: Duration = Duration::from_millis(300);
/// The longest a refill waits for the claims to pause (a steady stream of claims refills too).
pub const REFILL_WAIT_MOST: Duration = Duration::from_secs(2);

/// When this process last claimed a member for a session (ms since `claims_epoch`).
static LAST_CLAIM_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn claims_epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Refill `pool` after a session's claim, once this process's claims pause (`REFILL_QUIET`
/// without one, at most `REFILL_WAIT_MOST`). A refill is container starts (runc, the shim,
/// containerd's records): started inside a burst of claims they take the CPU the burst's
/// sessions need (`serve --pool bb=256` answering 256 creates at once, 2 cores), and the burst
/// ends no sooner. The hook starts a process: on the blocking pool. A long-lived server's
/// housekeeping refills anyway, should this process exit first.
pub fn refill_when_quiet(hook: crate::runtime::ClaimHook, pool: String) {
    let claimed = note_claim();
    tokio::spawn(async move {
        quiet(claimed + REFILL_WAIT_MOST).await;
        let _ = tokio::task::spawn_blocking(move || (hook.0)(&pool, crate::runtime::Refill::Now)).await;
    });
}

/// A claim now, for `quiet`.
fn note_claim() -> Instant {
    let now = Instant::now();
    let ms = now.saturating_duration_since(claims_epoch()).as_millis() as u64;
    LAST_CLAIM_MS.fetch_max(ms, std::sync::atomic::Ordering::Relaxed);
    now
}

/// Until this process's claims pause (`REFILL_QUIET` without one), or `most`.
async fn quiet(most: Instant) {
    loop {
        let last = claims_epoch() + Duration::from_millis(LAST_CLAIM_MS.load(std::sync::atomic::Ordering::Relaxed));
        let until = (last + REFILL_QUIET).min(most);
        let now = Instant::now();
        if now >= until {
            return;
        }
        tokio::time::sleep(until - now).await;
    }
}

/// The longest a claimed member's host mounts wait for the claims to pause.
const DROP_WAIT_MOST: Duration = Duration::from_secs(5);

/// Claimed members whose host mounts are still to be dropped, and whether a task drops them.
static DROPS: std::sync::Mutex<(Vec<(Engine, String)>, bool)> = std::sync::Mutex::new((Vec::new(), false));

/// Drop a claimed member's host mounts (`Engine::drop_host_mounts`) once the claims pause, at
/// most `DROP_WAIT_MOST` later, one member after another on one blocking thread. Each drop
/// reads the whole mount table (every member's rootfs and views: thousands of lines with a
/// pool of 256) and unmounts: in a burst of 256 claims those reads were a third of both
/// cores' time (`perf record`), and the unmounts contend for the kernel's mount lock with
/// the claims' own mounts. The member needs none of them (its places hold their own copies,
/// and a claim's workspace views are attached at the places themselves);
/// its teardown removes whatever is left.
fn drop_host_mounts_when_quiet(engine: Engine, id: String) {
    let claimed = note_claim();
    let mut drops = DROPS.lock().expect("host mount drops");
    drops.0.push((engine, id));
    if std::mem::replace(&mut drops.1, true) {
        return;
    }
    drop(drops);
    tokio::spawn(async move {
        quiet(claimed + DROP_WAIT_MOST).await;
        loop {
            let batch = {
                let mut drops = DROPS.lock().expect("host mount drops");
                if drops.0.is_empty() {
                    drops.1 = false;
                    return;
                }
                std::mem::take(&mut drops.0)
            };
            let dropped = tokio::task::spawn_blocking(move || {
                for (engine, id) in batch {
                    engine.drop_host_mounts(&id);
                }
            })
            .await;
            if let Err(e) = dropped {
                tracing::warn!(error = %e, "dropping claimed members' host mounts");
            }
        }
    });
}

/// The plan with everything that is bound late taken out: what a member is made from. The
/// workspace goes too: a member's workspace place is added by `bend` whether the template job
/// has one or not (see `member_layout`).
pub fn member_plan(plan: &RunPlan) -> RunPlan {
    let mut p = plan.clone();
    p.bound.env.env.clear();
    p.bound.env.setup.clear();
    p.bound.job.stdin = None;
    p.bound.job.disable_setup = true;
    p.bound.job.timeout = None;
    p.bound.job.active_deadline = None;
    p.bound.job.command = crate::manifest::Command::Argv(vec!["true".into()]);
    p.workspace = None;
    p.assets.clear();
    p.labels.clear();
    p.stdin_file = None;
    p
}

/// Whether two container paths are the same or one lies under the other.
fn overlap(a: &str, b: &str) -> bool {
    let under = |a: &str, b: &str| a == b || a.starts_with(&format!("{}/", b.trim_end_matches('/')));
    under(a, b) || under(b, a)
}

/// The late places a plan's own binds need, in mount order (and whether it has static assets).
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

/// The places every member of a plan's Environment offers, whatever the job that claims it:
/// the mounts, the workspace at the workdir (unless `mountWorkspace: false`) and the
/// static-assets root (unless a mount overlaps it). A job binds what it has; a place it has no
/// use for is taken out of the member at claim (`claim::hide_unused`), so that one pool serves
/// jobs with and without a workspace or assets, and each sees what a cold run shows. Only
/// the job's own `mounts` still make a shape of their own (they are bound at their targets,
/// which a member cannot know ahead).
pub fn member_layout(plan: &RunPlan) -> Layout {
    let env = plan.env();
    let mut without_workspace = plan.clone();
    without_workspace.workspace = None;
    let mut layout = layout_of(&without_workspace);
    // Not where a mount lies above or below the workdir: a late mount would hide the other
    // (`unpoolable` then refuses jobs with a workspace, and the others keep their pool).
    if env.mount_workspace && !layout.places.iter().any(|p| overlap(&p.target, &env.workdir)) {
        layout.places.push(Place {
            target: env.workdir.clone(),
            read_only: false,
            file: false,
        });
        // Mount order, as `spec::merged_binds` sorts (stable: the rest keep theirs).
        layout.places.sort_by_key(|p| p.target.matches('/').count());
    }
    layout.static_assets = !layout.places.iter().any(|p| overlap(&p.target, spec::STATIC_ROOT));
    layout
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
    let layout = member_layout(plan);
    for p in &layout.places {
        if let Some(q) = layout
            .places
            .iter()
            .find(|q| q.target != p.target && under(&p.target, &q.target))
        {
            return Some(format!("{} lies under {}", p.target, q.target));
        }
    }
    let env = plan.env();
    if plan.workspace.is_some() && env.mount_workspace && !layout.places.iter().any(|p| p.target == env.workdir) {
        let mount = layout.places.iter().find(|p| overlap(&p.target, &env.workdir));
        return Some(format!(
            "the workspace at {} and the mount at {} overlap",
            env.workdir,
            mount.map_or("?", |m| m.target.as_str())
        ));
    }
    if !plan.assets.is_empty() && !layout.static_assets {
        let mount = layout.places.iter().find(|p| overlap(&p.target, spec::STATIC_ROOT));
        return Some(format!(
            "{} and the static assets overlap",
            mount.map_or("?", |m| m.target.as_str())
        ));
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
/// `late_dir`, propagating from the host (`rslave`, root included), a place the plan has no
/// bind for (the workspace) is added, and a neutral hostname.
fn bend(spec: &mut Spec, layout: &Layout, late_dir: &Path) -> Result<(), RuntimeError> {
    let options = |ro: bool| -> Vec<String> {
        ["rbind", "nosuid", "nodev", "rslave", if ro { "ro" } else { "rw" }]
            .iter()
            .map(|s| s.to_string())
            .collect()
    };
    let mut mounts = spec.mounts().clone().unwrap_or_default();
    let mut bent = vec![false; layout.places.len()];
    for m in mounts.iter_mut().filter(|m| m.typ().as_deref() == Some("bind")) {
        let target = m.destination().to_string_lossy().into_owned();
        if let Some(i) = layout.places.iter().position(|p| p.target == target) {
            m.set_source(Some(late_dir.join(late::place_name(i))));
            m.set_options(Some(options(layout.places[i].read_only)));
            bent[i] = true;
        }
    }
    // After the plan's binds, as a cold container's workspace comes after the base mounts;
    // places never lie under one another (`unpoolable`), so their order among themselves is free.
    for (i, place) in layout.places.iter().enumerate().filter(|(i, _)| !bent[*i]) {
        mounts.push(
            MountBuilder::default()
                .destination(&place.target)
                .typ("bind")
                .source(late_dir.join(late::place_name(i)))
                .options(options(place.read_only))
                .build()
                .map_err(|e| RuntimeError::Internal(format!("{} mount: {e}", place.target)))?,
        );
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

impl Engine {
    /// Where the ready members of pool key `key` are listed, an empty file per member (beside
    /// the run directories): what a claim reads.
    fn ready_index(&self, key: &str) -> PathBuf {
        self.run_dir.with_file_name("ready").join(key)
    }

    /// When a member of pool key `key` was last claimed (or made): each claim takes its entry
    /// out of the key's ready index, which any process of the state dir can see.
    pub fn last_claim(&self, key: &str) -> Option<std::time::SystemTime> {
        std::fs::metadata(self.ready_index(key)).and_then(|m| m.modified()).ok()
    }

    /// Where a member's late places live (beside the run directories).
    pub fn late_dir(&self, id: &str) -> PathBuf {
        self.run_dir.with_file_name("late").join(id)
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
        let static_root = shape.layout.static_assets;
        let started = async {
            // Before runc makes its mount points: whether `/static` is the image's own.
            let rootfs_dir = self.root_dir(&id).join(super::remap::ROOTFS_DIR);
            let image_static =
                static_root && hide::image_has(&created.rootfs, &rootfs_dir, spec::STATIC_ROOT.trim_start_matches('/'));
            if image_static {
                self.mark_member(&id, hide::STATIC_IN_IMAGE, "noting the image's /static")?;
            }
            // Nothing reads a member's own output: its init writes none, and a FIFO without
            // a reader would stop it after the runner that made it exits.
            let (init_pid, mounts) = self.create_task(&created, &crate::containerd::Stdio::default()).await?;
            self.start_task(&id, mounts).await?;
            // The static root goes now rather than at each claim (`hide::take_static_out`),
            // beside the shell's launch: they touch nothing of each other's.
            let static_out = async {
                if !static_root {
                    return Ok(false);
                }
                hide::take_static_out(init_pid, &created.cgroup, !image_static)
                    .await
                    .map_err(|_| {
                        RuntimeError::Internal("the thread taking the static root out ended without an answer".into())
                    })?
                    .map(|()| true)
            };
            let (static_out, ()) = tokio::join!(static_out, self.prelaunch_shell(&created, init_pid));
            if static_out? {
                self.mark_member(&id, hide::STATIC_OUT, "noting the static root taken out")?;
            }
            self.write_member_record(&id, init_pid).await?;
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

    /// Leave an empty file `name` in member `id`'s run directory (`what` names the step).
    fn mark_member(&self, id: &str, name: &str, what: &str) -> Result<(), RuntimeError> {
        std::fs::write(self.run_dir.join(id).join(name), b"").map_err(|source| RuntimeError::Io {
            what: what.into(),
            source,
        })
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plan of a job of Environment `env` (of `ENVS`) with the extra job fields, paths
    /// under `dir`.
    fn plan(dir: &Path, env: &str, extra: &str) -> RunPlan {
        let envs = "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: plain}\nspec:\n  image: x\n  workdir: /workspace\n  user: \"1000:1000\"\n---\napiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: static-mount}\nspec:\n  image: x\n  mounts: [{source: MOUNT, target: /static}]\n---\napiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: above-workdir}\nspec:\n  image: x\n  workdir: /data/work\n  mounts: [{source: MOUNT, target: /data}]\n"
            .replace("MOUNT", &dir.join("m").display().to_string());
        for d in ["m", "ws", "assets"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        let text = format!(
            "{envs}---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: j}}\nspec:\n  environment: {env}\n  command: [\"true\"]\n{extra}"
        );
        let set = crate::manifest::parse_str(&text, dir, None).unwrap();
        let bound = set.bind(&set.jobs[0], None).unwrap();
        let host = spec::HostEnv::detect(Path::new("/var/lib/runner-unit-state"));
        spec::resolve(&bound, &host).unwrap()
    }

    const SHAPES: &[&str] = &[
        "",
        "  workspace: ./ws\n",
        "  staticAssets: [{source: ./assets, savePath: data}]\n  stdin: \"x\"\n",
        "  workspace: ./ws\n  staticAssets: [{source: ./assets, savePath: a/b}]\n  stdin: \"x\"\n  timeoutSeconds: 5\n",
    ];

    /// A member's static root is taken out at claim for a job without assets, unless its
    /// filler took it out already; its mount point goes only when the image has none.
    #[test]
    fn the_static_root_is_taken_out_once() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        std::fs::create_dir(&run).unwrap();
        let bare = plan(dir.path(), "plain", "");
        let layout = member_layout(&bare);
        assert!(layout.static_assets);
        let of = |p: &RunPlan, static_out| {
            let u = hide::Unused::of(&layout, p, &run, static_out);
            (u.static_root, u.remove_static)
        };
        assert_eq!(of(&bare, false), (true, true), "an older runner's member: at claim");
        assert_eq!(of(&bare, true), (false, false), "taken out by the filler");
        let assets = plan(dir.path(), "plain", SHAPES[2]);
        assert_eq!(of(&assets, false), (false, false));
        assert_eq!(of(&assets, true), (false, false));
        std::fs::write(run.join(hide::STATIC_IN_IMAGE), b"").unwrap();
        assert_eq!(of(&bare, false), (true, false), "the image's own /static stays");
    }

    #[test]
    fn jobs_of_every_shape_make_the_same_member() {
        let dir = tempfile::tempdir().unwrap();
        let host = spec::HostEnv::detect(Path::new("/var/lib/runner-unit-state"));
        let made: Vec<(Layout, String)> = SHAPES
            .iter()
            .map(|extra| {
                let p = plan(dir.path(), "plain", extra);
                assert_eq!(unpoolable(&p), None, "{extra}");
                let layout = member_layout(&p);
                let spec = member_spec(&member_plan(&p), &host, &layout, Path::new("/late")).unwrap();
                (layout, spec::to_json(&spec).unwrap().to_string())
            })
            .collect();
        for m in &made[1..] {
            assert_eq!(m, &made[0]);
        }
        let layout = &made[0].0;
        assert!(layout.static_assets);
        assert_eq!(layout.places.len(), 1);
        assert_eq!(
            (layout.places[0].target.as_str(), layout.places[0].read_only),
            ("/workspace", false)
        );
        // The workspace place is in the spec, from the late directory, though no job's plan
        // had to have one.
        assert!(made[0].1.contains("\"destination\":\"/workspace\""), "{}", made[0].1);
        assert!(made[0].1.contains("\"source\":\"/late/m0\""), "{}", made[0].1);
    }

    #[test]
    fn the_key_cache_serves_every_job_of_a_shape_and_no_other() {
        let dir = tempfile::tempdir().unwrap();
        let of = |env: &str, extra: &str, name: &str| {
            let mut p = plan(dir.path(), env, extra);
            p.bound.job.name = name.into();
            key::inputs(&p, &member_layout(&p), "docker.io/local/x:1", "engine")
        };
        // Sessions are jobs of their own names, with and without what is bound late.
        let first = of("plain", "", "s-1");
        for (i, extra) in SHAPES.iter().enumerate() {
            assert_eq!(of("plain", extra, &format!("s-{i}x")), first, "{extra}");
        }
        // Another Environment, user namespace, image or engine: another entry.
        assert_ne!(of("static-mount", "", "s-1"), first);
        let mut p = plan(dir.path(), "plain", "");
        p.bound.env.host_users = !p.bound.env.host_users;
        assert_ne!(
            key::inputs(&p, &member_layout(&p), "docker.io/local/x:1", "engine"),
            first
        );
        let p = plan(dir.path(), "plain", "");
        assert_ne!(
            key::inputs(&p, &member_layout(&p), "docker.io/local/y:1", "engine"),
            first
        );
        assert_ne!(
            key::inputs(&p, &member_layout(&p), "docker.io/local/x:1", "other"),
            first
        );
    }

    #[test]
    fn a_mount_over_a_late_place_keeps_the_jobs_it_does_not_touch_poolable() {
        let dir = tempfile::tempdir().unwrap();
        // A mount at /static: no static root; jobs without assets still pool.
        let p = plan(dir.path(), "static-mount", "");
        assert!(!member_layout(&p).static_assets);
        assert_eq!(unpoolable(&p), None);
        let p = plan(dir.path(), "static-mount", SHAPES[2]);
        assert_eq!(unpoolable(&p).as_deref(), Some("/static and the static assets overlap"));
        // A mount above the workdir: no workspace place; jobs without a workspace still pool.
        let p = plan(dir.path(), "above-workdir", "");
        assert_eq!(member_layout(&p).places.len(), 1);
        assert_eq!(unpoolable(&p), None);
        let p = plan(dir.path(), "above-workdir", SHAPES[1]);
        assert_eq!(
            unpoolable(&p).as_deref(),
            Some("the workspace at /data/work and the mount at /data overlap")
        );
    }
}
