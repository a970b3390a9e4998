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
    let shift = shift(&read_dumped(dir)?, plan)?;
    // runc and the snapshotter made nothing in a fresh upper directory: the copy lands in an
    // empty one.
    copytree::copy(&dir.join(ROOTFS_DIR), upper, shift, limits, &[])
        .map_err(copy_err("restoring the sandbox's files"))?;
    Ok(())
}

/// Fill a restored container's agent directory from the checkpoint (its control FIFO is its
/// own already).
pub(super) fn fill_agent(plan: &RunPlan, agent: &Path, limits: Limits) -> Result<(), RuntimeError> {
    let Some(dir) = &plan.restore else { return Ok(()) };
    let shift = shift(&read_dumped(dir)?, plan)?;
    copytree::copy(&dir.join(AGENT_DIR), agent, shift, limits, &AGENT_SKIP)
        .map_err(copy_err("restoring the sandbox's agent directory"))?;
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
        let mut created = self.create(plan, None, Some(args), "live", true, None).await?;
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
        let fifos = Fifos::create(&run, "init", false, true)?;
        let pumps = OutputPump::start(&fifos, false, self.options.output_limit)?;
        let started = Instant::now();
        let warm = attach_lock::hold();
        let made = self
            .client
            .task_create_restoring(&id, created.rootfs.clone(), &fifos.stdio(), &images, &work)
            .await;
        drop(warm);
        let restored = match made {
            Ok(_) => self.client.task_start(&id, "").await,
            Err(e) => Err(e),
        };
        // The container's mount namespace holds what it needs now (see `drop_host_mounts`).
        {
            let (engine, id, alias) = (self.clone(), id.clone(), self.root_dir(&id).join(RUN_ALIAS));
            let _ = tokio::task::spawn_blocking(move || {
                engine.drop_host_mounts(&id);
                if let Err(e) = crate::runtime::late::release(&alias) {
                    tracing::warn!(container = id, error = %e, "could not release the restore's view of the run directory");
                }
            })
            .await;
        }
        let init_pid = restored.map_err(|e| criu_failure("restore", e, &work, "restore.log"))?;
        let _ = std::fs::remove_dir_all(&images);
        tracing::debug!(ms = started.elapsed().as_secs_f64() * 1e3, "task restored");
        crate::metrics::observe(OPERATION_SECONDS, &[("op", "restore")], started.elapsed());
        let waiter = {
            let engine = self.clone();
            let id = id.clone();
            tokio::spawn(async move { engine.wait(&id, "").await })
        };
        let agent_dir = created.agent.as_ref().map(|a| a.dir().to_path_buf());
        let storage = self.watch_storage(plan, &id, &created.cgroup, created.upper.clone(), agent_dir.as_deref());
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

    #[cfg(test)]
    mod tests {
        use super::*;

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
