//! Checkpoint and restore of a live container with CRIU (runc's checkpoint/restore through
//! containerd's task API, `crate::containerd::criu`).
//!
//! A checkpoint directory holds:
//! - `criu/`: CRIU's images of every process of the sandbox (memory, files, namespaces);
//! - `rootfs/`: a copy of its writable layer (the overlay upper directory), owners as the
//!   source's range had them;
//! - `agent/`: a copy of its agent directory (the FIFOs its shells and commands hold open,
//!   which CRIU reopens by path), without the agent's control FIFO and the Python socket;
//! - `runtime.json`: what the host needs to drive the restored container (`Dumped`).
//!
//! The sandbox is frozen from before the copies until after the dump, so files and memory are
//! one moment of it (a sandbox that was paused stays paused). A restore makes a container as a
//! cold start does (its own range, cgroup, agent directory, snapshot), fills its writable layer
//! and agent directory from the copies with the owners moved to its range, rewrites CRIU's
//! user-namespace image for that range, and creates its task restoring the images: the
//! restored processes keep their PIDs (the container has its own PID namespace), memory,
//! open FIFOs and working directories.
//!
//! Refused: a sandbox without a user namespace of its own range is fine, one on a bridge
//! network is not (its address and the host's view of its connections cannot follow it).

use std::path::{Path, PathBuf};
use std::time::Instant;

use super::io::{Fifos, OutputPump};
use super::*;
use crate::containerd::CtdError;
use crate::runtime::RuntimeError;
use crate::runtime::copytree::{self, Limits, Shift};
use crate::spec::{self, RunPlan};

/// What the host keeps of a checkpoint, beside CRIU's images.
pub const RUNTIME_FILE: &str = "runtime.json";
pub const IMAGES_DIR: &str = "criu";
const WORK_DIR: &str = "work";
const ROOTFS_DIR: &str = "rootfs";
const AGENT_DIR: &str = "agent";
/// The agent's control FIFO (a restored container's agent directory has its own) and the
/// Python socket (a live object; the driver connects again).
const AGENT_SKIP: [&str; 2] = ["ctl", "py.sock"];
/// Most of CRIU's log a failure reports.
const LOG_LINES: usize = 4;

/// Most bytes read of a checkpoint's records and user-namespace images (each a few hundred).
pub const RECORD_LIMIT: u64 = 1 << 20;

/// One phase of a restore, at debug level (`scripts/restore-phases.sh` reads them).
pub fn restore_phase(phase: &'static str, since: Instant) {
    tracing::debug!(phase, ms = since.elapsed().as_secs_f64() * 1e3, "restore phase");
}

/// A file's first `limit` bytes.
pub fn read_capped(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut data = Vec::new();
    std::fs::File::open(path)?.take(limit).read_to_end(&mut data)?;
    Ok(data)
}

/// What a checkpoint says of the container it was taken of.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Dumped {
    /// The first host id of the source's user-namespace range (`None`: it had none).
    pub range_base: Option<u32>,
    /// The source's next agent request number: a restored container goes on from there, so
    /// its requests never meet the directories copied from the source.
    pub sequence: u64,
    /// A pool member's Environment variables, exported before each agent command.
    pub base_env: Vec<(String, String)>,
    /// How long the sandbox was frozen.
    pub frozen_ms: u64,
}

fn io_err(what: &str) -> impl Fn(std::io::Error) -> RuntimeError + '_ {
    move |source| RuntimeError::Io {
        what: what.to_string(),
        source,
    }
}

fn copy_err(what: &'static str) -> impl Fn(copytree::CopyError) -> RuntimeError {
    move |e| match e {
        copytree::CopyError::TooLarge { .. } => RuntimeError::Refused(format!("{what}: {e}")),
        e => RuntimeError::Internal(format!("{what}: {e}")),
    }
}

/// The last error lines of CRIU's log in `work` (`name`: dump.log or restore.log), bounded.
fn criu_errors(work: &Path, name: &str) -> String {
    use std::io::Read;
    let mut text = Vec::new();
    let read = std::fs::File::open(work.join(name)).and_then(|f| f.take(4 << 20).read_to_end(&mut text));
    if read.is_err() {
        return format!("(no {name})");
    }
    let text = String::from_utf8_lossy(&text);
    let errors: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("Error (") && !l.contains("RLIMIT_NOFILE"))
        .map(|l| l.split_once("Error (").map(|(_, rest)| rest).unwrap_or(l))
        .collect();
    let start = errors.len().saturating_sub(LOG_LINES);
    errors[start..].join("; ")
}

/// A failed RPC of a checkpoint or restore, said with CRIU's own words from its log.
fn criu_failure(what: &str, e: CtdError, work: &Path, log: &str) -> RuntimeError {
    let errors = criu_errors(work, log);
    RuntimeError::Refused(format!("{what}: CRIU refused ({errors}); containerd said: {e}"))
}

impl LiveContainer {
    /// Checkpoint the container into the empty directory `dir` (see the module's comment).
    pub async fn checkpoint_into(&self, dir: &Path, limits: Limits) -> Result<Dumped, RuntimeError> {
        let client = &self.engine.client;
        if self.network.is_some() {
            return Err(RuntimeError::Refused(
                "a sandbox on a bridge network cannot be checkpointed (its address and connections cannot move to a copy); use network: none".into(),
            ));
        }
        if let Some(pool) = &self.pool {
            // Its workspace was bound over its init's working directory after the init
            // started (`late`): CRIU takes no process whose open files lie under a mount.
            return Err(RuntimeError::Refused(format!(
                "a session claimed from warm pool {pool:?} cannot be checkpointed (its workspace was mounted after its processes started); create the session with \"pool\": false to checkpoint or fork it"
            )));
        }
        let range_base = self.engine.recorded_range(&self.id).map(|r| r.host_base);
        let mounts = client.snapshot_mounts(&self.id).await?;
        let upper = remap::writable_layer(&mounts)
            .ok_or_else(|| RuntimeError::Internal(format!("container {}: no writable layer in its mounts", self.id)))?;
        let agent = self
            .agent_dir()
            .ok_or_else(|| RuntimeError::Refused("the sandbox has no agent directory".into()))?
            .to_path_buf();
        let work = dir.join(WORK_DIR);
        for d in [IMAGES_DIR, WORK_DIR, ROOTFS_DIR, AGENT_DIR] {
            std::fs::create_dir(dir.join(d)).map_err(io_err("making the checkpoint's directories"))?;
        }
        // Through the cgroup's freezer, as a session's pause (`freezer`): CRIU finds the cgroup
        // frozen and leaves it so.
        let freeze = matches!(
            freezer::state(&self.cgroup).await,
            Ok(Some(freezer::FreezeState::Thawed))
        );
        let frozen_at = Instant::now();
        if freeze {
            freezer::freeze(&self.cgroup).await?;
        }
        let dumped = async {
            let (rootfs, agent_copy) = (dir.join(ROOTFS_DIR), dir.join(AGENT_DIR));
            tokio::task::spawn_blocking(move || {
                copytree::copy(&upper, &rootfs, Shift::NONE, limits, &[]).map_err(copy_err("the sandbox's files"))?;
                copytree::copy(&agent, &agent_copy, Shift::NONE, AGENT_LIMITS, &AGENT_SKIP)
                    .map_err(copy_err("the sandbox's agent directory"))?;
                Ok::<_, RuntimeError>(())
            })
            .await
            .map_err(|e| RuntimeError::Internal(format!("the checkpoint's copy: {e}")))??;
            client
                .task_checkpoint(&self.id, &dir.join(IMAGES_DIR), &work)
                .await
                .map_err(|e| criu_failure("checkpoint", e, &work, "dump.log"))?;
            Ok::<_, RuntimeError>(())
        }
        .await;
        let frozen_ms = frozen_at.elapsed().as_millis() as u64;
        if freeze {
            freezer::thaw(&self.cgroup).await?;
        }
        dumped?;
        skip_network_lock(&dir.join(IMAGES_DIR))?;
        // Readable for the restores that will link them (see `open_images`); the checkpoint's
        // own directory stays root's alone.
        open_images(&dir.join(IMAGES_DIR)).map_err(io_err("opening CRIU's images"))?;
        let dumped = Dumped {
            range_base,
            sequence: self.sequence.load(std::sync::atomic::Ordering::SeqCst),
            base_env: self.base_env.clone(),
            frozen_ms,
        };
        let json = serde_json::to_vec_pretty(&dumped).map_err(|e| RuntimeError::Internal(e.to_string()))?;
        std::fs::write(dir.join(RUNTIME_FILE), json).map_err(io_err("writing the checkpoint's record"))?;
        Ok(dumped)
    }
}

/// What a checkpoint directory says of its source.
pub fn read_dumped(dir: &Path) -> Result<Dumped, RuntimeError> {
    let text = read_capped(&dir.join(RUNTIME_FILE), RECORD_LIMIT).map_err(io_err("reading the checkpoint's record"))?;
    serde_json::from_slice(&text).map_err(|e| RuntimeError::Refused(format!("the checkpoint's record: {e}")))
}

/// How owners move from the checkpoint's source to a restored container.
fn shift(dumped: &Dumped, plan: &RunPlan) -> Result<Shift, RuntimeError> {
    match (dumped.range_base, plan.userns) {
        (Some(from), Some(to)) => Ok(Shift {
            from,
            to: to.host_base,
            count: spec::IdRange::SIZE,
        }),
        (None, None) => Ok(Shift::NONE),
        _ => Err(RuntimeError::Refused(
            "the checkpoint was taken with a different hostUsers setting".into(),
        )),
    }
}

/// Fill a restored container's writable layer from the checkpoint (before its rootfs is
/// mounted).
pub(super) fn fill_rootfs(plan: &RunPlan, upper: &Path, limits: Limits) -> Result<(), RuntimeError> {
    let Some(dir) = &plan.restore else { return Ok(()) };
    let t0 = Instant::now();
    let shift = shift(&read_dumped(dir)?, plan)?;
    // runc and the snapshotter made nothing in a fresh upper directory: the copy lands in an
    // empty one.
    let copied = copytree::copy(&dir.join(ROOTFS_DIR), upper, shift, limits, &[])
        .map_err(copy_err("restoring the sandbox's files"))?;
    tracing::debug!(bytes = copied.bytes, entries = copied.entries, "restored files");
    restore_phase("rootfs filled", t0);
    Ok(())
}

/// Fill a restored container's agent directory from the checkpoint (its control FIFO is its
/// own already).
pub(super) fn fill_agent(plan: &RunPlan, agent: &Path, limits: Limits) -> Result<(), RuntimeError> {
    let Some(dir) = &plan.restore else { return Ok(()) };
    let t0 = Instant::now();
    let shift = shift(&read_dumped(dir)?, plan)?;
    copytree::copy(&dir.join(AGENT_DIR), agent, shift, limits, &AGENT_SKIP)
        .map_err(copy_err("restoring the sandbox's agent directory"))?;
    restore_phase("agent filled", t0);
    Ok(())
}

/// The checkpoint's images in this restore's own directory: hard links (nothing of a
/// checkpoint is written by a restore, and a fork's ten restores then read one copy of the
/// memory), a copy across filesystems; the user-namespace images are rewritten
/// (`rewrite_userns`), so they are copies.
fn link_images(src: &Path, dst: &Path) -> Result<(), RuntimeError> {
    for entry in std::fs::read_dir(src).map_err(io_err("reading CRIU's images"))? {
        let entry = entry.map_err(io_err("reading CRIU's images"))?;
        if !entry.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        let name = entry.file_name();
        let to = dst.join(&name);
        let copy_only = name.to_string_lossy().starts_with("userns-");
        if copy_only || std::fs::hard_link(entry.path(), &to).is_err() {
            std::fs::copy(entry.path(), &to).map_err(io_err("copying CRIU's images"))?;
        }
    }
    Ok(())
}

/// Have the restores of a checkpoint skip CRIU's network lock.
///
/// A restore locks the network of the namespace it makes (iptables-restore and
/// ip6tables-restore in it, so no packet resets a TCP connection CRIU is bringing back) and
/// unlocks it at the end, by the method its dump recorded in `inventory.img`: about 100 ms of
/// each restore's path to its first answer here, seven process starts, and CPU the restores
/// of a fork share. runner's checkpoints hold no TCP connection to protect: runc is not asked
/// for `tcp-established`, so CRIU refuses to dump an established one, and a sandbox has no
/// network but its own loopback (a bridge one is refused). runc 1.1 passes no lock method,
/// and CRIU 4.1.1 crashes on `network-lock` in the configuration file runc names
/// (`org.criu.config`; its check of the restore verb reads the absent argv), so the method is
/// changed in the image, once per checkpoint: CRIU's "skip".
fn skip_network_lock(images: &Path) -> Result<(), RuntimeError> {
    let path = images.join("inventory.img");
    let data = read_capped(&path, RECORD_LIMIT).map_err(io_err("reading CRIU's inventory image"))?;
    let out = criu_image::skip_network_lock(&data)
        .map_err(|e| RuntimeError::Internal(format!("CRIU's inventory image: {e}")))?;
    std::fs::write(&path, out).map_err(io_err("writing CRIU's inventory image"))
}

/// CRIU's user-namespace images say which host ids the source's namespace mapped; a restored
/// container maps its own range. Rewrites every `userns-*.img` of `images` (copied for this
/// restore) from the source's base to `to`.
fn rewrite_userns(images: &Path, from: u32, to: u32) -> Result<(), RuntimeError> {
    for entry in std::fs::read_dir(images).map_err(io_err("reading CRIU's images"))? {
        let entry = entry.map_err(io_err("reading CRIU's images"))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !(name.starts_with("userns-") && name.ends_with(".img")) {
            continue;
        }
        let data = read_capped(&entry.path(), RECORD_LIMIT).map_err(io_err("reading CRIU's user-namespace image"))?;
        let out = criu_image::shift_userns(&data, from, to)
            .map_err(|e| RuntimeError::Refused(format!("CRIU's image {name}: {e}")))?;
        std::fs::write(entry.path(), out).map_err(io_err("writing CRIU's user-namespace image"))?;
    }
    Ok(())
}

impl Engine {
    /// A live container restored from `plan.restore` (a checkpoint directory).
    pub async fn restore_live(&self, plan: &RunPlan) -> Result<LiveContainer, RuntimeError> {
        let dir = plan
            .restore
            .clone()
            .ok_or_else(|| RuntimeError::Internal("restore without a checkpoint".into()))?;
        let dumped = read_dumped(&dir)?;
        if plan.bound.network == crate::manifest::NetworkMode::Bridge {
            return Err(RuntimeError::Refused(
                "a checkpoint cannot be restored on a bridge network; use network: none".into(),
            ));
        }
        // The spec's process is never started (CRIU brings the source's back), but a spec
        // needs one.
        let args = vec![
            spec::SHELL.to_string(),
            "-c".to_string(),
            agent::AGENT_SCRIPT.to_string(),
        ];
        let t0 = Instant::now();
        let mut created = self.create(plan, None, Some(args), "live", true, None).await?;
        restore_phase("container created", t0);
        match self.start_restored(plan, &mut created, &dir, &dumped).await {
            Ok(live) => Ok(live),
            Err(e) => {
                let _ = self.teardown(&created.id).await;
                Err(e)
            }
        }
    }

    async fn start_restored(
        &self,
        plan: &RunPlan,
        created: &mut Created,
        dir: &Path,
        dumped: &Dumped,
    ) -> Result<LiveContainer, RuntimeError> {
        let id = created.id.clone();
        let run = self.run_dir.join(&id);
        // CRIU reads the images inside the new user namespace (as the container's root): a
        // copy of its own, which only that root and the host's may read, with the namespace's
        // mapping rewritten to this container's range.
        let images = run.join("criu-images");
        let work = run.join("criu-work");
        // (`plan` is the caller's: the range `create` took is in the run directory.)
        let range = self.recorded_range(&id);
        if range.is_some() != dumped.range_base.is_some() {
            return Err(RuntimeError::Refused(
                "the checkpoint was taken with a different hostUsers setting".into(),
            ));
        }
        let t0 = Instant::now();
        {
            let (src, images, work) = (dir.join(IMAGES_DIR), images.clone(), work.clone());
            let from = dumped.range_base;
            tokio::task::spawn_blocking(move || {
                std::fs::create_dir(&images)
                    .and_then(|()| std::fs::create_dir(&work))
                    .map_err(io_err("making the restore's directories"))?;
                link_images(&src, &images)?;
                if let (Some(from), Some(to)) = (from, range) {
                    rewrite_userns(&images, from, to.host_base)?;
                }
                open_images(&images).map_err(io_err("handing CRIU's images to the restore"))
            })
            .await
            .map_err(|e| RuntimeError::Internal(format!("preparing the images: {e}")))??;
        }
        restore_phase("images linked", t0);
        let t0 = Instant::now();
        // A restored shell reading its FIFO would see EOF (and exit) if no writer held it
        // between the restore and the session's taking it over: the host holds every FIFO of
        // the agent directory open until then (`Runtime::release_restore_holds`).
        let holds = match created.agent.as_ref() {
            Some(agent) => {
                let dir = agent.dir().to_path_buf();
                tokio::task::spawn_blocking(move || hold_fifos(&dir))
                    .await
                    .map_err(|e| RuntimeError::Internal(format!("holding the shells' FIFOs: {e}")))??
            }
            None => Vec::new(),
        };
        restore_phase("fifos held", t0);
        let fifos = Fifos::create(&run, "init", false, true)?;
        let pumps = OutputPump::start(&fifos, false, self.options.output_limit)?;
        let started = Instant::now();
        let warm = attach_lock::hold();
        let made = self
            .client
            .task_create_restoring(&id, created.rootfs.clone(), &fifos.stdio(), &images, &work)
            .await;
        drop(warm);
        restore_phase("task create", started);
        let t0 = Instant::now();
        let restored = match made {
            Ok(_) => self.client.task_start(&id, "").await,
            Err(e) => Err(e),
        };
        restore_phase("task start (criu restore)", t0);
        if restored.is_ok() && tracing::enabled!(tracing::Level::DEBUG) {
            let work = work.clone();
            let _ = tokio::task::spawn_blocking(move || criu_image::log_restore_phases(&work)).await;
        }
        // The container's mount namespace holds what it needs now (see `drop_host_mounts`),
        // and CRIU is done with this restore's images. Off the restore's path when it
        // succeeded (as a claim's); awaited when it failed, the teardown following.
        let dropping = {
            let (engine, id, alias) = (self.clone(), id.clone(), self.root_dir(&id).join(RUN_ALIAS));
            let images = images.clone();
            tokio::task::spawn_blocking(move || {
                let t0 = Instant::now();
                engine.drop_host_mounts(&id);
                if let Err(e) = crate::runtime::late::release(&alias) {
                    tracing::warn!(container = id, error = %e, "could not release the restore's view of the run directory");
                }
                let _ = std::fs::remove_dir_all(&images);
                restore_phase("host mounts dropped (off the path)", t0);
            })
        };
        if restored.is_err() {
            let _ = dropping.await;
        }
        let init_pid = restored.map_err(|e| criu_failure("restore", e, &work, "restore.log"))?;
        let t0 = Instant::now();
        {
            let cgroup = created.cgroup.clone();
            tokio::task::spawn_blocking(move || loopback_up(init_pid, &cgroup))
                .await
                .map_err(|e| RuntimeError::Internal(format!("bringing up the loopback: {e}")))??;
        }
        restore_phase("loopback up", t0);
        tracing::debug!(ms = started.elapsed().as_secs_f64() * 1e3, "task restored");
        crate::metrics::observe(OPERATION_SECONDS, &[("op", "restore")], started.elapsed());
        let waiter = {
            let engine = self.clone();
            let id = id.clone();
            tokio::spawn(async move { engine.wait(&id, "").await })
        };
        let agent_dir = created.agent.as_ref().map(|a| a.dir().to_path_buf());
        // The restored processes run already: its baseline is measured beside them, as soon as
        // it can be (the restored files are there; what they write meanwhile may count as
        // the baseline's).
        let (storage, _baselined) =
            self.watch_storage(plan, &id, &created.cgroup, created.upper.clone(), agent_dir.as_deref());
        pumps.discard_rest();
        let init_exited = tokio_util::sync::CancellationToken::new();
        {
            let token = init_exited.clone();
            tokio::spawn(async move {
                let _ = waiter.await;
                token.cancel();
            });
        }
        let mut live = LiveContainer::new(
            self.clone(),
            created.agent.take().map(std::sync::Arc::new),
            init_pid,
            init_exited,
            id,
            created.cgroup.clone(),
            created.process.clone(),
            dumped.base_env.clone(),
        );
        live.sequence
            .store(dumped.sequence, std::sync::atomic::Ordering::SeqCst);
        live.workspace = plan.workspace.clone();
        live.storage = Some(storage);
        *live.restore_holds.lock().expect("holds lock") = holds;
        Ok(live)
    }
}

/// A sandbox's writable layer in a checkpoint (apparent sizes, as a snapshot's layer).
pub(super) const FILES_LIMITS: Limits = Limits {
    bytes: 10 << 30,
    entries: 2_000_000,
};
/// An agent directory holds FIFOs and small files; a sandbox that filled its own is refused.
pub(super) const AGENT_LIMITS: Limits = Limits {
    bytes: 64 << 20,
    entries: 10_000,
};
/// A restored writable layer: what its checkpoint's copy took (bounded then).
pub(super) const RESTORE_LIMITS: Limits = Limits {
    bytes: u64::MAX,
    entries: u64::MAX,
};

/// Where a restored container's run directory is seen by CRIU (see `bind_sources_for_restore`).
const RUN_ALIAS: &str = "run";

/// CRIU mounts a restored container's binds from inside its new user namespace, by path
/// (mount-v2's `open_tree`), unlike runc at a create: every directory above a source must be
/// searchable by the container's root. The run directory's (agent, tools, workspace views) lie
/// in the state dir, whose parents may be closed (a state dir under a 0700 directory); its
/// rootfs directory's parents are open (`prepare_created`). So the run directory is bound
/// (recursively, with the views mounted in it) into the rootfs directory, and the spec's
/// sources in it are named through there; the host's copy goes after the restore.
pub(super) fn bind_sources_for_restore(
    run: &Path,
    root_dir: &Path,
    spec: &mut oci_spec::runtime::Spec,
) -> Result<(), RuntimeError> {
    use nix::mount::MsFlags;
    let alias = root_dir.join(RUN_ALIAS);
    std::fs::create_dir(&alias).map_err(io_err("making the restore's view of the run directory"))?;
    nix::mount::mount(
        Some(run),
        &alias,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(|e| RuntimeError::Internal(format!("binding the run directory for a restore: {e}")))?;
    let mut mounts = spec.mounts().clone().unwrap_or_default();
    for m in mounts.iter_mut() {
        let rel = m
            .source()
            .as_ref()
            .and_then(|s| s.strip_prefix(run).ok())
            .map(Path::to_path_buf);
        if let Some(rel) = rel {
            m.set_source(Some(alias.join(rel)));
        }
    }
    spec.set_mounts(Some(mounts));
    Ok(())
}

/// Bring up `lo` in a restored container's network namespace. runc brings it up in the
/// namespaces it makes for a create; for a restore it has CRIU make an empty one (runc's
/// checkpoints leave the network namespace out: `--empty-ns network`), whose `lo` is down:
/// without this, nothing in a restored sandbox reaches 127.0.0.1 ("Network is unreachable").
/// On a thread of its own that enters the namespace and ends (a namespace is per thread), as
/// `pool::hide::enter`: the PID is trusted once the namespace is open — its process must then
/// be in the container's cgroup, and the namespace must not be ours.
fn loopback_up(init_pid: u32, cgroup: &str) -> Result<(), RuntimeError> {
    use super::pool::hide::{check_in_cgroup, open_namespace};
    const WHOSE: &str = "the restored container";
    let cgroup = cgroup.to_string();
    std::thread::spawn(move || -> Result<(), RuntimeError> {
        let ns = open_namespace(init_pid, "net", WHOSE)?;
        check_in_cgroup(init_pid, &cgroup, WHOSE)?;
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| RuntimeError::Io {
            what: format!("entering the network namespace of {WHOSE}"),
            source: e.into(),
        })?;
        // SAFETY: raw socket and ioctl calls on a socket the call opens and closes; this
        // thread is in the container's network namespace and nothing else runs on it.
        if unsafe { crate::net::ns::loopback_up() } {
            Ok(())
        } else {
            Err(RuntimeError::Io {
                what: format!("bringing up lo of {WHOSE}"),
                source: std::io::Error::last_os_error(),
            })
        }
    })
    .join()
    .map_err(|_| RuntimeError::Internal("the thread bringing up the restored loopback panicked".into()))?
}

/// Shells' input FIFOs held per restore: more than a session makes (its shells are named by
/// its calls) is not held (a shell past it may see EOF and the session start it again).
const HELD_FIFOS: usize = 64;

/// The shells' input FIFOs (`sh-NAME.in`) at the top of `dir` (a restored container's agent
/// directory, filled from its checkpoint before the container runs), opened read-write without
/// blocking, at most `HELD_FIFOS` of them: a `sh` reads its FIFO as a script file, which it
/// opens read-only itself, and would see EOF without a writer (bash holds its own read-write).
fn hold_fifos(dir: &Path) -> Result<Vec<std::os::fd::OwnedFd>, RuntimeError> {
    use nix::fcntl::{OFlag, openat};
    use nix::sys::stat::{Mode, SFlag, fstat};
    let dir_fd = nix::fcntl::open(
        dir,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| RuntimeError::Internal(format!("opening the agent directory: {e}")))?;
    let mut holds = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err("reading the agent directory"))? {
        let entry = entry.map_err(io_err("reading the agent directory"))?;
        let name = entry.file_name();
        let shell_input = name
            .to_str()
            .is_some_and(|n| n.starts_with("sh-") && n.ends_with(".in"));
        if !shell_input
            || !entry
                .file_type()
                .is_ok_and(|t| std::os::unix::fs::FileTypeExt::is_fifo(&t))
        {
            continue;
        }
        if holds.len() == HELD_FIFOS {
            tracing::warn!(dir = %dir.display(), "more shells than are held at a restore");
            break;
        }
        let Ok(fd) = openat(
            &dir_fd,
            entry.file_name().as_os_str(),
            OFlag::O_RDWR | OFlag::O_NONBLOCK | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        ) else {
            continue;
        };
        if fstat(&fd).is_ok_and(|st| SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFIFO) {
            holds.push(fd);
        }
    }
    Ok(holds)
}

/// Let CRIU's restoring processes read the images: they open them through the directory's
/// descriptor from inside the new user namespace, where the host's root is nobody. The
/// directory is searchable and its files readable by anyone who has a descriptor of it or can
/// reach it — only root can: it lies in the container's run directory (0700, its root's).
fn open_images(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    for entry in std::fs::read_dir(dir)? {
        let path: PathBuf = entry?.path();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))?;
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
}

/// CRIU's image files: a magic header, then entries each a 32-bit length and a protobuf
/// message (criu/include/magic.h, images/userns.proto).
mod criu_image {
    use prost::Message;

    const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
    const USERNS_MAGIC: u32 = 0x5547_4906;

    #[derive(Clone, PartialEq, Message)]
    pub struct Extent {
        #[prost(uint32, required, tag = "1")]
        pub first: u32,
        #[prost(uint32, required, tag = "2")]
        pub lower_first: u32,
        #[prost(uint32, required, tag = "3")]
        pub count: u32,
    }

    #[derive(Clone, PartialEq, Message)]
    pub struct UsernsEntry {
        #[prost(message, repeated, tag = "1")]
        pub uid_map: Vec<Extent>,
        #[prost(message, repeated, tag = "2")]
        pub gid_map: Vec<Extent>,
    }

    fn u32_at(data: &[u8], at: usize) -> Result<u32, String> {
        data.get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .ok_or_else(|| "truncated".to_string())
    }

    /// The image with every extent whose host ids start at `from` moved to `to`.
    pub fn shift_userns(data: &[u8], from: u32, to: u32) -> Result<Vec<u8>, String> {
        if u32_at(data, 0)? != IMG_COMMON_MAGIC || u32_at(data, 4)? != USERNS_MAGIC {
            return Err("not a user-namespace image".into());
        }
        let mut out = data[..8].to_vec();
        let mut at = 8;
        while at < data.len() {
            let len = u32_at(data, at)? as usize;
            let body = data.get(at + 4..at + 4 + len).ok_or("truncated entry")?;
            let mut entry = UsernsEntry::decode(body).map_err(|e| e.to_string())?;
            for extent in entry.uid_map.iter_mut().chain(entry.gid_map.iter_mut()) {
                if extent.lower_first >= from && extent.lower_first - from < super::spec::IdRange::SIZE {
                    extent.lower_first = extent.lower_first - from + to;
                } else {
                    return Err(format!(
                        "an extent at host id {} outside the source's range",
                        extent.lower_first
                    ));
                }
            }
            let encoded = entry.encode_to_vec();
            out.extend_from_slice(&(encoded.len() as u32).to_le_bytes());
            out.extend_from_slice(&encoded);
            at += 4 + len;
        }
        Ok(out)
    }

    const INVENTORY_MAGIC: u32 = 0x5831_3116;
    /// `inventory_entry.network_lock_method` (images/inventory.proto) and CRIU's
    /// `NETWORK_LOCK_SKIP` (criu/include/cr_options.h: iptables 0, nftables 1, skip 2).
    const NETWORK_LOCK_FIELD: u64 = 11;
    const NETWORK_LOCK_SKIP: u64 = 2;

    fn varint(data: &[u8], at: &mut usize) -> Result<u64, String> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let b = *data.get(*at).ok_or("truncated varint")?;
            *at += 1;
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err("varint too long".into())
    }

    fn put_varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    /// The inventory image (its magic, then one entry) with its network lock method set to
    /// "skip"; every other field kept as it is, byte for byte (read at the wire level: the
    /// entry has fields this code need not know).
    pub fn skip_network_lock(data: &[u8]) -> Result<Vec<u8>, String> {
        if u32_at(data, 0)? != INVENTORY_MAGIC {
            return Err("not an inventory image".into());
        }
        let len = u32_at(data, 4)? as usize;
        let body = data.get(8..8 + len).ok_or("truncated entry")?;
        let mut entry = Vec::with_capacity(body.len() + 2);
        let mut at = 0;
        while at < body.len() {
            let start = at;
            let key = varint(body, &mut at)?;
            match key & 7 {
                0 => {
                    varint(body, &mut at)?;
                }
                1 => at += 8,
                2 => {
                    let n = varint(body, &mut at)? as usize;
                    at += n;
                }
                5 => at += 4,
                t => return Err(format!("wire type {t} in the inventory")),
            }
            if at > body.len() {
                return Err("truncated field".into());
            }
            if key >> 3 != NETWORK_LOCK_FIELD {
                entry.extend_from_slice(&body[start..at]);
            }
        }
        put_varint(&mut entry, NETWORK_LOCK_FIELD << 3);
        put_varint(&mut entry, NETWORK_LOCK_SKIP);
        let mut out = data[..4].to_vec();
        out.extend_from_slice(&(entry.len() as u32).to_le_bytes());
        out.extend_from_slice(&entry);
        out.extend_from_slice(&data[8 + len..]);
        Ok(out)
    }

    /// `images/stats.proto`: what `criu restore` says of itself in `stats-restore`.
    #[derive(Clone, PartialEq, Message)]
    pub struct RestoreStats {
        #[prost(uint64, optional, tag = "3")]
        pub forking_time: Option<u64>,
        #[prost(uint64, optional, tag = "4")]
        pub restore_time: Option<u64>,
        #[prost(uint64, optional, tag = "5")]
        pub pages_restored: Option<u64>,
    }

    #[derive(Clone, PartialEq, Message)]
    pub struct StatsEntry {
        #[prost(message, optional, tag = "2")]
        pub restore: Option<RestoreStats>,
    }

    /// The restore stats of a `stats-restore` file (two magic words, then one entry).
    pub fn restore_stats(data: &[u8]) -> Result<RestoreStats, String> {
        let len = u32_at(data, 8)? as usize;
        let body = data.get(12..12 + len).ok_or("truncated entry")?;
        let entry = StatsEntry::decode(body).map_err(|e| e.to_string())?;
        entry.restore.ok_or_else(|| "no restore stats".to_string())
    }

    /// The seconds of a CRIU log line's `(SS.UUUUUU)` stamp.
    pub fn stamp(line: &str) -> Option<f64> {
        let rest = line.strip_prefix('(')?;
        let (t, _) = rest.split_once(')')?;
        t.parse().ok()
    }

    /// Where `criu restore` spent its time, at debug level ("criu phase" events), from its
    /// stats (`stats-restore`) and its log's time stamps (`restore.log`) in `work`: each
    /// milestone's time since CRIU started. Blocking; both files read bounded.
    pub fn log_restore_phases(work: &std::path::Path) {
        let phase = |phase: &str, ms: f64| tracing::debug!(phase, ms, "criu phase");
        if let Ok(data) = super::read_capped(&work.join("stats-restore"), 4096)
            && let Ok(stats) = restore_stats(&data)
        {
            phase("forking (stats)", stats.forking_time.unwrap_or(0) as f64 / 1e3);
            phase("restore (stats)", stats.restore_time.unwrap_or(0) as f64 / 1e3);
            tracing::debug!(pages = stats.pages_restored.unwrap_or(0), "criu restored pages");
        }
        let Ok(log) = super::read_capped(&work.join("restore.log"), LOG_LIMIT) else {
            return;
        };
        let log = String::from_utf8_lossy(&log);
        let mut seen = [false; MILESTONES.len()];
        let mut last = None;
        for line in log.lines() {
            let Some(t) = stamp(line) else { continue };
            last = Some(t);
            for (i, (name, needle)) in MILESTONES.iter().enumerate() {
                if !seen[i] && line.contains(needle) {
                    seen[i] = true;
                    phase(name, t * 1e3);
                }
            }
        }
        if let Some(t) = last {
            phase("h. last line", t * 1e3);
        }
    }

    /// Most of a restore log read for its phases.
    const LOG_LIMIT: u64 = 16 << 20;
    /// Lines of CRIU's restore log that mark its phases (their first occurrence): its start
    /// (kernel features, cgroups) done, the namespaces made, the mount tree restored, the
    /// processes forked and their files opened, their memory read, the network unlocked, the
    /// end.
    const MILESTONES: [(&str, &str); 7] = [
        ("a. pre-restore", "Running pre-restore scripts"),
        ("b. namespaces", "Running setup-namespaces scripts"),
        ("c. mounts", "Running post-setup-namespaces scripts"),
        ("d. forked, files", "Restore via sigreturn"),
        ("e. memory", "Running post-restore scripts"),
        ("f. network unlock", "Running network-unlock scripts"),
        ("g. finished", "Restore finished successfully"),
    ];

    #[cfg(test)]
    mod tests {
        use super::*;

        /// A CRIU 4.1.1 dump's inventory (iptables lock, a plugins entry, a run id).
        const INVENTORY: &str = "163131584e000000080210011a18080110011801200128013002380340044806500758086005200128013000580062006a2433663439366361662d643638302d346666352d626133662d653433366461633434336335";

        fn hex(s: &str) -> Vec<u8> {
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect()
        }

        #[test]
        fn sets_the_network_lock_to_skip_keeping_the_rest() {
            let data = hex(INVENTORY);
            let out = skip_network_lock(&data).unwrap();
            let body = &out[8..];
            assert_eq!(u32_at(&out, 4).unwrap() as usize, body.len());
            // The same length: field 11's value 0 became 2; it moved to the end.
            assert_eq!(out.len(), data.len());
            assert!(body.ends_with(&[0x58, 0x02]), "{body:02x?}");
            assert!(!body[..body.len() - 2].windows(2).any(|w| w == [0x58, 0x00]));
            // Everything else, in order: the run id still last before the lock.
            let id = b"3f496caf-d680-4ff5-ba3f-e436dac443c5";
            assert!(body[..body.len() - 2].ends_with(id));
            // Idempotent, and an entry without the field gets it.
            assert_eq!(skip_network_lock(&out).unwrap(), out);
            let mut bare = INVENTORY_MAGIC.to_le_bytes().to_vec();
            bare.extend_from_slice(&2u32.to_le_bytes());
            bare.extend_from_slice(&[0x08, 0x02]);
            let out = skip_network_lock(&bare).unwrap();
            assert_eq!(&out[4..], &[4, 0, 0, 0, 0x08, 0x02, 0x58, 0x02]);
            assert!(skip_network_lock(&data[..20]).is_err());
            assert!(skip_network_lock(&hex(&INVENTORY.replace("16313158", "19435654"))).is_err());
        }

        #[test]
        fn reads_restore_stats_and_stamps() {
            let stats = StatsEntry {
                restore: Some(RestoreStats {
                    forking_time: Some(1500),
                    restore_time: Some(42_000),
                    pages_restored: Some(25_600),
                }),
            };
            let body = stats.encode_to_vec();
            let mut data = 0x5510_5940u32.to_le_bytes().to_vec();
            data.extend_from_slice(&0x5709_3306u32.to_le_bytes());
            data.extend_from_slice(&(body.len() as u32).to_le_bytes());
            data.extend_from_slice(&body);
            let back = restore_stats(&data).unwrap();
            assert_eq!((back.forking_time, back.restore_time), (Some(1500), Some(42_000)));
            assert!(restore_stats(&data[..10]).is_err());
            assert_eq!(stamp("(00.433996) Writing stats"), Some(0.433996));
            assert_eq!(stamp("no stamp"), None);
        }

        #[test]
        fn moves_the_mapping_to_the_new_range() {
            let entry = UsernsEntry {
                uid_map: vec![Extent {
                    first: 0,
                    lower_first: 1 << 30,
                    count: 65536,
                }],
                gid_map: vec![Extent {
                    first: 0,
                    lower_first: 1 << 30,
                    count: 65536,
                }],
            };
            let body = entry.encode_to_vec();
            let mut data = IMG_COMMON_MAGIC.to_le_bytes().to_vec();
            data.extend_from_slice(&USERNS_MAGIC.to_le_bytes());
            data.extend_from_slice(&(body.len() as u32).to_le_bytes());
            data.extend_from_slice(&body);
            let out = shift_userns(&data, 1 << 30, (1 << 30) + 65536).unwrap();
            let back = UsernsEntry::decode(&out[12..]).unwrap();
            assert_eq!(back.uid_map[0].lower_first, (1 << 30) + 65536);
            assert_eq!(back.gid_map[0].count, 65536);
            assert!(shift_userns(&data, 5, 7).is_err());
            assert!(shift_userns(&data[..6], 0, 0).is_err());
        }
    }
}
