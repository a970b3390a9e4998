//! What a member offers and a job has no use for, taken out of the member at claim so the job
//! sees what a cold run shows: the workspace place of a job without a workspace (then the
//! workdir is the rootfs's, as runc makes a cold container's cwd) and the static-assets root
//! of a job without assets (gone, unless the image has a `/static` of its own).
//!
//! Done at claim, in the member's mount namespace, by the thread that sets its hostname
//! (`enter`). No job's code has run in the member then: only its init (runner's agent, run
//! by the image's `sh`) and the shell its filler started.
//!
//! The static root is the exception: most jobs have no assets, and taking it out (an unmount
//! and, on the rootfs's overlay, a rmdir) was the longest step of a claim's readying. The
//! filler takes it out of every new member instead (`take_static_out`), and a claim whose job
//! has assets puts it back (`put_static_back`) before they are bound.

use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use super::*;

/// In a member's run directory: present when its image has a `/static` of its own, or may
/// have (a snapshotter runner cannot read). A job without assets then finds it there, as in
/// a cold container; a job with assets starts cold (a cold start binds them into it).
pub(super) const STATIC_IN_IMAGE: &str = "static-in-image";

/// In a member's run directory: its filler took the static root out (`take_static_out`).
/// Written before the member is marked ready; absent in a member an older runner made, which
/// still has it (the claim takes it out then, as before).
pub(super) const STATIC_OUT: &str = "static-out";

/// Whether the image under a member's rootfs has `name` at its root, from the snapshot's mounts
/// before the container starts (runc has made no mount point yet). `rootfs` is empty when
/// runner mounted the (remapped) rootfs itself at `mounted`.
pub(super) fn image_has(rootfs: &[containerd_client::types::Mount], mounted: &Path, name: &str) -> bool {
    let present = |dir: &Path| -> Option<bool> {
        let m = std::fs::symlink_metadata(dir.join(name)).ok()?;
        // An overlay whiteout (a 0/0 character device) hides what the layers below have.
        Some(!(m.file_type().is_char_device() && m.rdev() == 0))
    };
    match rootfs {
        [] => std::fs::symlink_metadata(mounted.join(name)).is_ok(),
        [m] if m.r#type == "overlay" => m
            .options
            .iter()
            .find_map(|o| o.strip_prefix("lowerdir="))
            // Top layer first, as overlay lists them.
            .is_some_and(|lowers| lowers.split(':').find_map(|l| present(Path::new(l))).unwrap_or(false)),
        [m] if m.r#type == "bind" || m.r#type == "rbind" => present(Path::new(&m.source)).unwrap_or(false),
        // A snapshotter runner cannot read: keep the mount point (an empty directory is less
        // wrong than an image's directory removed).
        _ => true,
    }
}

/// What a job has no use for in a member: the places it binds nothing at (only the workspace
/// can be one: every other place is in the pool's key) and whether the static root goes, with
/// its mount point when the image has no `/static`.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Unused {
    pub targets: Vec<String>,
    pub static_root: bool,
    pub remove_static: bool,
}

impl Unused {
    /// For `plan` in a member of `layout` whose run directory is `run`.
    /// `static_out`: the filler took the static root out already (`take_static_out`).
    pub(super) fn of(layout: &Layout, plan: &RunPlan, run: &Path, static_out: bool) -> Self {
        let mut without_assets = plan.clone();
        without_assets.assets.clear();
        let bound: Vec<String> = spec::merged_binds(&without_assets)
            .into_iter()
            .map(|b| b.target)
            .collect();
        let static_root = layout.static_assets && plan.assets.is_empty() && !static_out;
        Unused {
            targets: layout
                .places
                .iter()
                .filter(|p| !bound.contains(&p.target))
                .map(|p| p.target.clone())
                .collect(),
            static_root,
            remove_static: static_root && !run.join(STATIC_IN_IMAGE).exists(),
        }
    }

    fn is_empty(&self) -> bool {
        self.targets.is_empty() && !self.static_root
    }
}

/// Ready a claimed member for its job: open its agent (`open_agent`, on the host), then from
/// inside its namespaces take out what the job has no use for (in its mount namespace) and set
/// its hostname (in its UTS namespace). setns affects only the calling thread: a thread of our
/// own does it all and ends (`on_own_thread`), so no other work ever runs in the container's
/// namespaces. The PID is only trusted once the namespaces are opened: the process must then
/// still be in the member's cgroup (a PID reused by a host process fails that), and neither
/// namespace may be ours (the host's mounts and hostname are never touched).
pub(super) fn ready<A: Send + 'static>(
    open_agent: impl FnOnce() -> Result<A, RuntimeError> + Send + 'static,
    init_pid: u32,
    cgroup: &str,
    hostname: &str,
    unused: Unused,
) -> tokio::sync::oneshot::Receiver<Result<A, RuntimeError>> {
    let cgroup = cgroup.to_string();
    let hostname = hostname.to_string();
    let t0 = std::time::Instant::now();
    on_own_thread(move || {
        let agent = open_agent()?;
        enter(init_pid, &cgroup, &hostname, unused)?;
        super::super::claim_phase("member readied", t0);
        Ok(agent)
    })
}

/// The body of `ready` on its own thread (which ends after it).
fn enter(init_pid: u32, cgroup: &str, hostname: &str, unused: Unused) -> Result<(), RuntimeError> {
    let io = |what: String, e: std::io::Error| RuntimeError::Io {
        what: format!("{what} of the claimed container"),
        source: e,
    };
    let uts = open_namespace(init_pid, "uts", "the claimed container")?;
    let mnt = if unused.is_empty() {
        None
    } else {
        Some(open_namespace(init_pid, "mnt", "the claimed container")?)
    };
    check_in_cgroup(init_pid, cgroup, "the claimed container")?;
    if let Some(mnt) = mnt {
        enter_mount_namespace(&mnt, "the claimed container")?;
        // The thread's root is now the container's: paths resolve in its rootfs. The
        // mounts are runc's binds, made in this namespace (so not locked), slaves of the
        // member's places: nothing of this reaches the host.
        let mut targets = unused.targets;
        if unused.static_root {
            targets.push(spec::STATIC_ROOT.to_string());
        }
        for target in &targets {
            nix::mount::umount2(target.as_str(), nix::mount::MntFlags::MNT_DETACH)
                .map_err(|e| io(format!("unmounting the unused {target}"), e.into()))?;
        }
        if unused.remove_static {
            std::fs::remove_dir(spec::STATIC_ROOT)
                .map_err(|e| io(format!("removing the unused {}", spec::STATIC_ROOT), e))?;
        }
    }
    nix::sched::setns(&uts, nix::sched::CloneFlags::CLONE_NEWUTS)
        .map_err(|e| io("entering the UTS namespace".into(), e.into()))?;
    nix::unistd::sethostname(hostname).map_err(|e| io("setting the hostname".into(), e.into()))
}

/// Move this thread (one of our own, which ends after its work: `on_own_thread`) into mount
/// namespace `mnt`: its root and cwd become the container's, and paths resolve in its rootfs.
fn enter_mount_namespace(mnt: &std::fs::File, whose: &str) -> Result<(), RuntimeError> {
    let io = |what: &str, e: nix::Error| RuntimeError::Io {
        what: format!("{what} of {whose}"),
        source: e.into(),
    };
    // A thread shares its process's root and cwd until it unshares them; setns into a mount
    // namespace refuses a thread that shares them.
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_FS)
        .map_err(|e| io("leaving the process's filesystem context", e))?;
    nix::sched::setns(mnt, nix::sched::CloneFlags::CLONE_NEWNS).map_err(|e| io("entering the mount namespace", e))
}

/// Take the static root out of a new member (its init `init_pid`, in `cgroup`), on a thread
/// of its own: unmounted, and its mount point removed when the image has no `/static`
/// (`remove_dir`), so that a job without assets finds what a cold run shows and its claim has
/// nothing to do for it. Before the member is listed as ready: no job's code has run in it.
pub(super) fn take_static_out(
    init_pid: u32,
    cgroup: &str,
    remove_dir: bool,
) -> tokio::sync::oneshot::Receiver<Result<(), RuntimeError>> {
    let cgroup = cgroup.to_string();
    on_own_thread(move || {
        let whose = "the new pool member";
        let io = |what: String, e: std::io::Error| RuntimeError::Io {
            what: format!("{what} of {whose}"),
            source: e,
        };
        let mnt = open_namespace(init_pid, "mnt", whose)?;
        check_in_cgroup(init_pid, &cgroup, whose)?;
        enter_mount_namespace(&mnt, whose)?;
        nix::mount::umount2(spec::STATIC_ROOT, nix::mount::MntFlags::MNT_DETACH)
            .map_err(|e| io(format!("unmounting {}", spec::STATIC_ROOT), e.into()))?;
        if remove_dir {
            std::fs::remove_dir(spec::STATIC_ROOT).map_err(|e| io(format!("removing {}", spec::STATIC_ROOT), e))?;
        }
        Ok(())
    })
}

/// The static root a claim puts back into a member whose filler took it out, for a job with
/// assets: the member's static directory on the host (`late::STATIC_DIR`), mounted where the
/// member's spec binds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct StaticBack {
    pub init_pid: u32,
    pub cgroup: String,
    /// The member's static directory on the host.
    pub source: std::path::PathBuf,
    /// The owner of `/static`, made again where the filler removed it (the image has
    /// none: a member of an image with one serves no job with assets): the host id of the
    /// container's root, as runc makes it (mode 0755).
    pub owner: u32,
}

/// Put the static root back (see `StaticBack`), on a thread of its own; the assets are bound
/// on the host once this has answered, and reach the member through the mount's propagation
/// (a mount made while the copy was still detached would not).
pub(super) fn put_static_back(back: StaticBack) -> tokio::sync::oneshot::Receiver<Result<(), RuntimeError>> {
    on_own_thread(move || {
        let whose = "the claimed container";
        let io = |what: String, e: std::io::Error| RuntimeError::Io {
            what: format!("{what} of {whose}"),
            source: e,
        };
        // On the host, before the thread leaves its mount namespace: the source is a host path.
        let tree =
            crate::runtime::idmap::slave_tree(&back.source).map_err(|e| io("copying the static root".into(), e))?;
        let mnt = open_namespace(back.init_pid, "mnt", whose)?;
        check_in_cgroup(back.init_pid, &back.cgroup, whose)?;
        enter_mount_namespace(&mnt, whose)?;
        // As the container's root (this thread's own file ids; it ends after this): the
        // rootfs's upper directory records the creator's ids.
        let owner = nix::unistd::Uid::from_raw(back.owner);
        nix::unistd::setfsgid(nix::unistd::Gid::from_raw(back.owner));
        nix::unistd::setfsuid(owner);
        // Its mode set through the directory itself (never a link put in its place), and
        // whatever the process's umask.
        std::fs::DirBuilder::new()
            .mode(0o755)
            .create(spec::STATIC_ROOT)
            .and_then(|()| {
                std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
                    .open(spec::STATIC_ROOT)
            })
            .and_then(|dir| dir.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o755)))
            .map_err(|e| io(format!("making {}", spec::STATIC_ROOT), e))?;
        crate::runtime::idmap::attach(tree, Path::new(spec::STATIC_ROOT))
            .map_err(|e| io(format!("mounting {}", spec::STATIC_ROOT), e))
    })
}

type OwnThreadWork = Box<dyn FnOnce() + Send>;

/// A thread started ahead for `on_own_thread`, waiting for its one piece of work.
static SPARE_THREAD: std::sync::Mutex<Option<std::sync::mpsc::SyncSender<OwnThreadWork>>> = std::sync::Mutex::new(None);

/// Run `work` on a thread that runs nothing else and ends after it (work that enters a
/// container's namespaces leaves its thread there), from an async worker without waiting.
/// A thread started ahead takes it when there is one: starting a thread was 0.13 ms of a
/// pooled session's claim. That thread starts the next spare before `work` (still in the
/// host's namespaces then; the readying has time to spare beside the late binds, and the
/// blocking pool they use is not asked for a thread). A thread that cannot be started drops
/// `work`, which its receiver reports; a spare that cannot be is only not there next time.
fn on_own_thread<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, RuntimeError> + Send + 'static,
) -> tokio::sync::oneshot::Receiver<Result<T, RuntimeError>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let work: OwnThreadWork = Box::new(move || {
        start_spare_thread();
        let _ = tx.send(work());
    });
    let spare = spare_slot().take();
    let left = match spare {
        Some(spare) => spare.send(work).err().map(|e| e.0),
        None => Some(work),
    };
    if let Some(work) = left {
        // No spare (the first call, or one that could not be started): a thread now. A
        // failure drops `work` and with it the sender: the receiver reports it.
        if let Err(e) = std::thread::Builder::new().name("runner-enter".into()).spawn(work) {
            tracing::warn!(error = %e, "starting a thread to ready a claimed container");
        }
    }
    rx
}

/// The spare's slot. Nothing that can panic runs under its lock; a poisoned one is used as is.
fn spare_slot() -> std::sync::MutexGuard<'static, Option<std::sync::mpsc::SyncSender<OwnThreadWork>>> {
    SPARE_THREAD.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Start a spare for `on_own_thread`, unless one waits already. The thread is started
/// without the slot's lock (an async worker takes it); of two started at once, the one
/// that finds the slot taken ends at once (its sender dropped).
fn start_spare_thread() {
    if spare_slot().is_some() {
        return;
    }
    let (tx, rx) = std::sync::mpsc::sync_channel::<OwnThreadWork>(1);
    // The spare ends with the process or when its sender is dropped unused.
    let started = std::thread::Builder::new().name("runner-enter".into()).spawn(move || {
        if let Ok(work) = rx.recv() {
            work();
        }
    });
    match started {
        Ok(_) => {
            let mut slot = spare_slot();
            if slot.is_none() {
                *slot = Some(tx);
            }
        }
        Err(e) => tracing::warn!(error = %e, "starting a spare thread to ready claimed containers"),
    }
}

/// Most bytes of `/proc/PID/cgroup` read (a line per hierarchy, each at most a path).
const CGROUP_FILE_LIMIT: u64 = 64 << 10;

/// Namespace `kind` of a container's init, opened for `setns` from a thread of our own (`whose`
/// names the container in errors). Refused when it is the calling thread's own: a PID that is
/// no longer the container's may be a host process. Pair it with `check_in_cgroup` after
/// opening, which pins the process the namespace was taken from.
pub(in crate::runtime::containerd) fn open_namespace(
    init_pid: u32,
    kind: &str,
    whose: &str,
) -> Result<std::fs::File, RuntimeError> {
    let ns = std::fs::File::open(format!("/proc/{init_pid}/ns/{kind}")).map_err(|e| RuntimeError::Io {
        what: format!("opening the {kind} namespace of {whose}"),
        source: e,
    })?;
    let own = std::fs::metadata(format!("/proc/thread-self/ns/{kind}"))
        .map(|m| m.ino())
        .ok();
    if own.is_none() || own == ns.metadata().map(|m| m.ino()).ok() {
        return Err(RuntimeError::Internal(format!(
            "process {init_pid} shares our {kind} namespace: it is not the init of {whose}"
        )));
    }
    Ok(ns)
}

/// That `init_pid` is (still) in the container's cgroup `cgroup`, read bounded.
pub(in crate::runtime::containerd) fn check_in_cgroup(
    init_pid: u32,
    cgroup: &str,
    whose: &str,
) -> Result<(), RuntimeError> {
    use std::io::Read;
    let mut text = String::new();
    let read = std::fs::File::open(format!("/proc/{init_pid}/cgroup"))
        .and_then(|f| f.take(CGROUP_FILE_LIMIT).read_to_string(&mut text));
    if read.is_ok() && text.lines().any(|l| l.ends_with(cgroup)) {
        Ok(())
    } else {
        Err(RuntimeError::Internal(format!(
            "process {init_pid} is not the init of {whose}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use containerd_client::types::Mount;

    /// Each piece of work gets a thread of its own, neither the caller's nor an earlier
    /// work's, which ends after it; a spare is waiting again afterwards; a work that panics
    /// is reported, not lost.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn work_runs_on_a_thread_of_its_own_that_ends() {
        let caller = nix::unistd::gettid();
        let mut seen = Vec::new();
        for _ in 0..3 {
            let tid = on_own_thread(|| Ok(nix::unistd::gettid())).await.unwrap().unwrap();
            assert_ne!(tid, caller);
            assert!(!seen.contains(&tid), "{tid} ran two works");
            seen.push(tid);
        }
        let gone = |tid: nix::unistd::Pid| !Path::new(&format!("/proc/self/task/{tid}")).exists();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !(seen.iter().all(|t| gone(*t)) && spare_slot().is_some()) {
            assert!(std::time::Instant::now() < deadline, "threads left: {seen:?}");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let failed = on_own_thread::<()>(|| panic!("a work that panics")).await;
        assert!(failed.is_err());
        let refused = on_own_thread::<()>(|| Err(RuntimeError::Internal("no".into()))).await;
        assert!(matches!(refused, Ok(Err(RuntimeError::Internal(_)))));
    }

    fn overlay(lowers: &[&Path]) -> Vec<Mount> {
        let lowers: Vec<String> = lowers.iter().map(|l| l.display().to_string()).collect();
        vec![Mount {
            r#type: "overlay".into(),
            source: "overlay".into(),
            options: vec![format!("lowerdir={}", lowers.join(":")), "upperdir=/nowhere".into()],
            ..Default::default()
        }]
    }

    #[test]
    fn the_image_has_a_path_when_its_topmost_layer_naming_it_is_no_whiteout() {
        let dir = tempfile::tempdir().unwrap();
        let (top, bottom) = (dir.path().join("top"), dir.path().join("bottom"));
        std::fs::create_dir_all(&top).unwrap();
        std::fs::create_dir_all(bottom.join("static")).unwrap();
        let nowhere = Path::new("/nonexistent");
        assert!(image_has(&overlay(&[&top, &bottom]), nowhere, "static"));
        assert!(!image_has(&overlay(&[&top]), nowhere, "static"));
        // A whiteout in an upper layer removes what the lower one has.
        nix::sys::stat::mknod(
            &top.join("static"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o600),
            0,
        )
        .expect("mknod of a whiteout (the suite runs as root)");
        assert!(!image_has(&overlay(&[&top, &bottom]), nowhere, "static"));
        // A bind (a snapshot without parents) and a rootfs runner mounted itself.
        let bind = vec![Mount {
            r#type: "bind".into(),
            source: bottom.display().to_string(),
            ..Default::default()
        }];
        assert!(image_has(&bind, nowhere, "static"));
        assert!(image_has(&[], &bottom, "static"));
        assert!(!image_has(&[], &top.join("missing"), "static"));
    }
}
