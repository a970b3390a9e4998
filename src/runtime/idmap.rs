//! User namespaces for containers on runtimes that cannot remap ids themselves.
//!
//! runc 1.1 has no per-mount id mappings and containerd 1.6 no remapping snapshotter, so runner
//! does the remapping with the kernel's idmapped mounts (`open_tree` + `mount_setattr` with
//! `MOUNT_ATTR_IDMAP` + `move_mount`), which cost no copy and no chown:
//! - the image layers are seen through a mapping that shows on-disk id `n` as host id
//!   `base + n`, so root's files are root's inside the container's user namespace;
//! - a workspace is seen through a mapping that shows its owner as the job's user, so what the
//!   job writes there is stored as the owner's, never as a range id.
//!
//! Each live container has a range of 65,536 host ids no other live container of this host
//! shares. Ranges are leased host-wide (every state dir and runner process on the host takes
//! them from one directory), not per state dir: two runners on one node must never hand out
//! the same ids.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use crate::spec::IdRange;

/// Ranges start here: far above the ids of real accounts and the usual `/etc/subuid`
/// allocations (100000 onwards).
const FIRST_BASE: u32 = 1 << 30;
/// How many ranges fit below 2^31 - 2, the largest id we allow (CVE-2024-40635).
const SLOTS: u32 = ((1u32 << 31) - 2 - FIRST_BASE) / IdRange::SIZE;

/// One line of a `uid_map`: ids `inside..inside+count` of the namespace are host ids
/// `outside..`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdMap {
    pub inside: u32,
    pub outside: u32,
    pub count: u32,
}

impl IdMap {
    /// The whole range: on-disk id `n` is host id `base + n`.
    pub fn range(range: IdRange) -> Self {
        IdMap {
            inside: 0,
            outside: range.host_base,
            count: IdRange::SIZE,
        }
    }
}

/// A lease on a range, as stored in its file.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Lease {
    pub host_base: u32,
    pub state_dir: String,
    /// The containerd (socket and namespace) the container lives in: only a collection
    /// that sees that containerd can tell the container is gone.
    pub containerd: String,
    pub container: String,
    /// The process that took it (`pid:start`): a lease of a dead owner without a container is
    /// a leftover.
    pub owner: String,
}

/// The host's range leases.
#[derive(Clone, Debug)]
pub struct Leases {
    dir: PathBuf,
}

impl Leases {
    pub fn at(dir: &Path) -> Self {
        Leases { dir: dir.to_path_buf() }
    }

    fn slot_path(&self, slot: u32) -> PathBuf {
        self.dir.join(slot.to_string())
    }

    /// Held while a lease is taken or given back: a release reads a lease and unlinks it,
    /// and without the lock a range taken anew between the two would be unlinked instead.
    fn lock(&self) -> io::Result<nix::fcntl::Flock<std::fs::File>> {
        std::fs::create_dir_all(&self.dir)?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.dir.join(".lock"))?;
        nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive).map_err(|(_, e)| io::Error::from(e))
    }

    /// Take the lowest free range for `container`. A lease file is made whole beside its
    /// name and then linked into place: `link` fails when the name exists, so two processes
    /// never take one range, and no reader ever sees a half-written lease.
    pub fn allocate(&self, state_dir: &Path, containerd: &str, container: &str) -> io::Result<IdRange> {
        let _lock = self.lock()?;
        let reserved = reserved_ranges();
        let tmp = self.dir.join(format!(".new-{}", crate::owner::unique_tag()));
        let result = (|| {
            // The slots leased now, from one listing: probing each name with `link` cost a
            // failed link per live container, under the lock (~25 ms a create at 5,000).
            let taken: std::collections::HashSet<u32> = std::fs::read_dir(&self.dir)?
                .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect();
            for slot in (0..SLOTS).filter(|s| !taken.contains(s)) {
                let range = IdRange {
                    host_base: FIRST_BASE + slot * IdRange::SIZE,
                };
                let (start, end) = (
                    u64::from(range.host_base),
                    u64::from(range.host_base) + u64::from(IdRange::SIZE),
                );
                if reserved.iter().any(|&(s, e)| s < end && start < e) {
                    continue;
                }
                let lease = Lease {
                    host_base: range.host_base,
                    state_dir: state_dir.display().to_string(),
                    containerd: containerd.to_string(),
                    container: container.to_string(),
                    owner: crate::owner::owner_id(),
                };
                std::fs::write(&tmp, serde_json::to_vec(&lease).map_err(io::Error::other)?)?;
                match std::fs::hard_link(&tmp, self.slot_path(slot)) {
                    Ok(()) => return Ok(range),
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                    Err(e) => return Err(e),
                }
            }
            Err(io::Error::other(format!(
                "all {SLOTS} user-namespace ranges of this host are in use ({})",
                self.dir.display()
            )))
        })();
        let _ = std::fs::remove_file(&tmp);
        result
    }

    /// Give a range back, if `container` holds it.
    pub fn release(&self, range: IdRange, container: &str) -> io::Result<()> {
        let Some(slot) = range.host_base.checked_sub(FIRST_BASE).map(|o| o / IdRange::SIZE) else {
            return Ok(());
        };
        let _lock = self.lock()?;
        match self.load(slot)? {
            Some(lease) if lease.container == container => match std::fs::remove_file(self.slot_path(slot)) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            },
            _ => Ok(()),
        }
    }

    fn read(&self, slot: u32) -> Option<Lease> {
        self.load(slot).ok().flatten()
    }

    /// The lease of `slot` (`None`: no lease, or not one of ours). A lease that is there but
    /// cannot be read (no descriptor left, at the open-files limit) is an error, not "none":
    /// a release must then fail, to be tried again, not report a range given back that is
    /// still leased.
    fn load(&self, slot: u32) -> io::Result<Option<Lease>> {
        match std::fs::read(self.slot_path(slot)) {
            Ok(bytes) => Ok(serde_json::from_slice(&bytes).ok()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every lease taken for `state_dir`.
    pub fn held(&self, state_dir: &Path) -> io::Result<Vec<Lease>> {
        let state_dir = state_dir.display().to_string();
        Ok(self.all()?.into_iter().filter(|l| l.state_dir == state_dir).collect())
    }

    /// Every lease of the host.
    pub fn all(&self) -> io::Result<Vec<Lease>> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let Some(slot) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            if let Some(lease) = self.read(slot) {
                out.push(lease);
            }
        }
        out.sort_by_key(|l| l.host_base);
        Ok(out)
    }
}

/// Ranges `/etc/subuid` and `/etc/subgid` give to users (rootless containers, Docker's
/// userns-remap): runner's ranges stay clear of them.
fn reserved_ranges() -> Vec<(u64, u64)> {
    ["/etc/subuid", "/etc/subgid"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .flat_map(|text| {
            text.lines()
                .filter_map(|line| {
                    let mut parts = line.trim().split(':');
                    let (_, start, count) = (parts.next()?, parts.next()?, parts.next()?);
                    let start: u64 = start.parse().ok()?;
                    Some((start, start + count.parse::<u64>().ok()?))
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The most namespaces `kept_user_namespace` holds (a descriptor each).
const KEPT_MAX: usize = 32;

/// A namespace `kept_user_namespace` made: its uid and gid maps, and its descriptor.
type Kept = (Vec<IdMap>, Vec<IdMap>, OwnedFd);

/// Namespaces `kept_user_namespace` made; the most recently used last.
static KEPT: std::sync::Mutex<Vec<Kept>> = std::sync::Mutex::new(Vec::new());

/// `user_namespace`, or a copy of the descriptor of one made before with the same maps. An
/// idmapped mount reads nothing of its namespace but the maps, so the two are
/// interchangeable; and the same maps come again whenever a range's lease is reused with the
/// same workspace owner and user (a claim's workspace view) or at all (a cold create's
/// rootfs). Each one made costs a cloned helper and two map writes: ~0.25 ms that a pooled
/// create waited for.
pub fn kept_user_namespace(uids: &[IdMap], gids: &[IdMap]) -> io::Result<OwnedFd> {
    {
        let mut kept = KEPT.lock().expect("kept namespaces lock");
        if let Some(i) = kept.iter().position(|(u, g, _)| u == uids && g == gids) {
            let entry = kept.remove(i);
            let copy = entry.2.try_clone();
            kept.push(entry);
            return copy;
        }
    }
    let ns = user_namespace(uids, gids)?;
    // Not kept when the copy cannot be made (at the open-files limit): the caller has its own.
    if let Ok(copy) = ns.try_clone() {
        let mut kept = KEPT.lock().expect("kept namespaces lock");
        if !kept.iter().any(|(u, g, _)| u == uids && g == gids) {
            if kept.len() >= KEPT_MAX {
                kept.remove(0);
            }
            kept.push((uids.to_vec(), gids.to_vec(), copy));
        }
    }
    Ok(ns)
}

/// A user namespace with these mappings, held by an fd. A child born in it holds it while
/// the maps are written, then is killed; the namespace lives as long as the fd and the
/// mounts idmapped with it.
pub fn user_namespace(uids: &[IdMap], gids: &[IdMap]) -> io::Result<OwnedFd> {
    let helper = NamespaceHolder::start()?;
    let pid = helper.pid;
    let text = |maps: &[IdMap]| {
        maps.iter()
            .map(|m| format!("{} {} {}\n", m.inside, m.outside, m.count))
            .collect::<String>()
    };
    std::fs::write(format!("/proc/{pid}/uid_map"), text(uids))?;
    std::fs::write(format!("/proc/{pid}/gid_map"), text(gids))?;
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/user"))?;
    Ok(OwnedFd::from(ns))
}

/// A child in a new user namespace that only waits to be killed, which dropping this does
/// (on every path out of `user_namespace`, a panic's too).
///
/// It is cloned with CLONE_VM: it shares our memory instead of getting a copy. A fork of a
/// large multithreaded server copied its page tables and tore them down again, ~1 ms for the
/// two namespaces of a cold start. Sharing memory is why the child runs with every signal
/// blocked (a handler of ours would run in it, on its small stack, beside us) and makes raw
/// system calls only, whose results it ignores; its stack is freed only once it is reaped.
/// The same reasoning is all a forked child of a threaded process may do, too (no locks, no
/// allocation): see `network::pin_namespaces`.
struct NamespaceHolder {
    pid: libc::pid_t,
    stack: Option<Vec<u8>>,
}

impl NamespaceHolder {
    const STACK: usize = 64 * 1024;

    fn start() -> io::Result<Self> {
        extern "C" fn idle(_: *mut libc::c_void) -> libc::c_int {
            loop {
                // SAFETY: a raw system call with no pointers to fill. (`libc::syscall` sets
                // errno on failure, but with every signal blocked ppoll without a timeout
                // never returns: SIGKILL ends it.)
                unsafe {
                    libc::syscall(
                        libc::SYS_ppoll,
                        std::ptr::null_mut::<libc::pollfd>(),
                        0,
                        std::ptr::null::<libc::timespec>(),
                        std::ptr::null::<libc::sigset_t>(),
                    );
                }
            }
        }
        let mut stack = vec![0u8; Self::STACK];
        let top = (stack.as_mut_ptr() as usize + stack.len()) & !15;
        // SAFETY: sigset and mask calls on locals; the old mask is restored right after.
        let pid = unsafe {
            let (mut all, mut old) = (
                std::mem::zeroed::<libc::sigset_t>(),
                std::mem::zeroed::<libc::sigset_t>(),
            );
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
            // SAFETY: the child runs `idle` on its own stack (kept until it is reaped) with
            // the full mask inherited from this thread.
            let pid = libc::clone(
                idle,
                top as *mut libc::c_void,
                libc::CLONE_VM | libc::CLONE_NEWUSER | libc::SIGCHLD,
                std::ptr::null_mut(),
            );
            let err = io::Error::last_os_error();
            libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
            if pid < 0 {
                return Err(err);
            }
            pid
        };
        Ok(NamespaceHolder {
            pid,
            stack: Some(stack),
        })
    }
}

impl Drop for NamespaceHolder {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.pid);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        let reaped = loop {
            match nix::sys::wait::waitpid(pid, None) {
                Err(nix::errno::Errno::EINTR) => continue,
                other => break other,
            }
        };
        // ECHILD: reaped already (SIGCHLD ignored, or a reaper of every child), so dead too.
        // Anything else and it may still run on its stack: that is kept (64 KiB).
        if !matches!(reaped, Ok(_) | Err(nix::errno::Errno::ECHILD)) {
            std::mem::forget(self.stack.take());
        }
    }
}

const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;

#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

fn cstring(path: &Path) -> io::Result<std::ffi::CString> {
    std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| io::Error::other("path with a NUL byte"))
}

/// Flags of an idmapped mount besides the mapping.
#[derive(Clone, Copy, Debug, Default)]
pub struct Flags {
    pub read_only: bool,
    /// `nosuid,nodev` (binds of host trees); image layers keep their setuid bits.
    pub restricted: bool,
}

/// What a detached tree is cloned from.
#[derive(Clone, Copy, Debug)]
pub enum Source<'a> {
    /// A host path the host chose (an image layer, a workspace's own directory): its last
    /// component is not followed if a symlink.
    Path(&'a Path),
    /// A descriptor (`O_PATH` will do) already resolved beneath a directory the sandbox can
    /// write: cloning from it never resolves a name again, so nothing swapped in since can
    /// redirect the mount.
    Fd(BorrowedFd<'a>),
}

impl std::fmt::Display for Source<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Path(p) => write!(f, "{}", p.display()),
            Source::Fd(fd) => write!(f, "a path resolved beneath the workspace (fd {})", fd.as_raw_fd()),
        }
    }
}

/// A detached copy of the mount at `source` (just that mount, no submounts), private, seen
/// through `userns`'s mapping when there is one.
pub fn idmapped_tree(source: Source<'_>, userns: Option<BorrowedFd<'_>>, flags: Flags) -> io::Result<OwnedFd> {
    let clone = OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint;
    // SAFETY: plain system calls with valid pointers (a NUL-terminated path, or "" with an
    // open descriptor); the fd returned is owned here.
    let fd = match source {
        Source::Path(path) => {
            let path = cstring(path)?;
            unsafe {
                libc::syscall(
                    libc::SYS_open_tree,
                    libc::AT_FDCWD,
                    path.as_ptr(),
                    clone | libc::AT_SYMLINK_NOFOLLOW as libc::c_uint,
                )
            }
        }
        Source::Fd(dir) => unsafe {
            libc::syscall(
                libc::SYS_open_tree,
                dir.as_raw_fd(),
                c"".as_ptr(),
                clone | libc::AT_EMPTY_PATH as libc::c_uint,
            )
        },
    };
    if fd < 0 {
        // Its errno stays reachable: at the open-files limit this is a 503, not a 500.
        return Err(crate::runtime::janitor::context(format!("open_tree {source}"))(
            io::Error::last_os_error(),
        ));
    }
    // SAFETY: open_tree returned a new descriptor nothing else owns.
    let tree = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut set = 0;
    if userns.is_some() {
        set |= MOUNT_ATTR_IDMAP;
    }
    if flags.read_only {
        set |= MOUNT_ATTR_RDONLY;
    }
    if flags.restricted {
        set |= MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV;
    }
    if set == 0 {
        return Ok(tree);
    }
    let attr = MountAttr {
        attr_set: set,
        attr_clr: 0,
        propagation: libc::MS_PRIVATE,
        userns_fd: userns.map_or(0, |u| u.as_raw_fd() as u64),
    };
    let empty = c"";
    // SAFETY: the attribute struct lives across the call and its size is passed with it.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc < 0 {
        let e = io::Error::last_os_error();
        let hint = if e.raw_os_error() == Some(libc::EINVAL) && userns.is_some() {
            " (the filesystem may not support idmapped mounts; hostUsers: true runs without a user namespace)"
        } else {
            ""
        };
        return Err(io::Error::new(e.kind(), format!("idmapping {source}: {e}{hint}")));
    }
    Ok(tree)
}

/// A detached copy of the mount tree at `source` (a host path the host chose), `nosuid` and
/// `nodev` (read-only where it is), and a slave of `source`'s peer group: mounts made there once the copy
/// is attached reach it, none made in it go back. What is mounted at `source` while the copy
/// is detached does not reach it (measured on 6.18), so its mounts come after `attach`.
pub fn slave_tree(source: &Path) -> io::Result<OwnedFd> {
    let path = cstring(source)?;
    let flags = OPEN_TREE_CLONE | (libc::O_CLOEXEC | libc::AT_RECURSIVE | libc::AT_SYMLINK_NOFOLLOW) as libc::c_uint;
    // SAFETY: a plain system call with a NUL-terminated path; the fd returned is owned here.
    let fd = unsafe { libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, path.as_ptr(), flags) };
    if fd < 0 {
        return Err(crate::runtime::janitor::context(format!(
            "open_tree {}",
            source.display()
        ))(io::Error::last_os_error()));
    }
    // SAFETY: open_tree returned a new descriptor nothing else owns.
    let tree = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
        attr_clr: 0,
        propagation: libc::MS_SLAVE,
        userns_fd: 0,
    };
    // SAFETY: the attribute struct lives across the call and its size is passed with it.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(
            e.kind(),
            format!("making a slave copy of {}: {e}", source.display()),
        ));
    }
    Ok(tree)
}

/// Attach a detached mount at `target` (an existing directory or file).
pub fn attach(tree: OwnedFd, target: &Path) -> io::Result<()> {
    let path = cstring(target)?;
    let empty = c"";
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_fd().as_raw_fd(),
            empty.as_ptr(),
            libc::AT_FDCWD,
            path.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if rc < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(
            e.kind(),
            format!("attaching at {}: {e}", target.display()),
        ));
    }
    Ok(())
}

/// Mount `source` at `target` (made here: a file or a directory like the source) seen
/// through `userns` (none: ids as they are).
pub fn bind_idmapped(
    source: Source<'_>,
    target: &Path,
    userns: Option<BorrowedFd<'_>>,
    flags: Flags,
) -> io::Result<()> {
    let tree = idmapped_tree(source, userns, flags)?;
    let is_dir = match source {
        Source::Path(path) => std::fs::symlink_metadata(path)?.is_dir(),
        Source::Fd(fd) => nix::sys::stat::fstat(fd).map_err(io::Error::from)?.st_mode & libc::S_IFMT == libc::S_IFDIR,
    };
    if is_dir {
        std::fs::create_dir_all(target)?;
    } else {
        std::fs::File::create(target)?;
    }
    attach(tree, target)
}

/// The mappings that show a host tree owned by `owner` (uid, gid) as owned by the
/// container's `user` (uid, gid inside its range): only that one id each way is mapped, so
/// what the job writes is stored as the owner's and nothing else can be written.
pub fn owner_maps(owner: (u32, u32), user: (u32, u32), range: IdRange) -> (IdMap, IdMap) {
    (
        IdMap {
            inside: owner.0,
            outside: range.host_id(user.0),
            count: 1,
        },
        IdMap {
            inside: owner.1,
            outside: range.host_id(user.1),
            count: 1,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::process::CommandExt;

    #[test]
    fn leases_are_exclusive_and_released_by_their_holder_only() {
        let dir = tempfile::tempdir().unwrap();
        let leases = Leases::at(dir.path());
        let state = Path::new("/state");
        let a = leases.allocate(state, "ctd", "a").unwrap();
        let b = leases.allocate(state, "ctd", "b").unwrap();
        assert_ne!(a, b);
        assert!(a.host_base >= FIRST_BASE && b.host_base >= FIRST_BASE);
        assert_eq!(leases.held(state).unwrap().len(), 2);
        assert!(leases.held(Path::new("/other")).unwrap().is_empty());
        leases.release(a, "b").unwrap();
        assert_eq!(leases.held(state).unwrap().len(), 2, "only the holder releases");
        leases.release(a, "a").unwrap();
        let held = leases.held(state).unwrap();
        assert_eq!(held.len(), 1);
        assert_eq!(held[0].container, "b");
        // The freed range is the lowest free one again.
        assert_eq!(leases.allocate(state, "ctd", "c").unwrap(), a);
        let last = FIRST_BASE as u64 + SLOTS as u64 * IdRange::SIZE as u64 - 1;
        assert!(last <= crate::manifest::MAX_ID);
    }

    /// A release that cannot read its lease (no descriptor left) fails and the lease stays,
    /// rather than answering "given back" for a range still leased; the janitor then does it.
    #[test]
    fn a_release_at_the_open_files_limit_fails_until_the_janitor_does_it() {
        let dir = tempfile::tempdir().unwrap();
        let leases = Leases::at(dir.path());
        let range = leases.allocate(Path::new("/state"), "ctd", "a").unwrap();
        let (inline, at_the_wall) = std::thread::spawn({
            let leases = leases.clone();
            move || {
                let held = crate::runtime::janitor::testing::fill_own_table();
                let inline = leases.release(range, "a");
                let still = leases.clone();
                let at_the_wall = crate::runtime::janitor::or_at_the_wall(move || still.release(range, "a"));
                drop(held);
                (inline, at_the_wall)
            }
        })
        .join()
        .unwrap();
        let inline = inline.expect_err("a release with no descriptor to read the lease");
        assert_eq!(inline.raw_os_error(), Some(libc::EMFILE), "{inline}");
        at_the_wall.expect("the janitor's release");
        assert!(leases.held(Path::new("/state")).unwrap().is_empty());
    }

    /// Every helper that held a namespace is gone once its fd is returned (killed and reaped,
    /// from several threads at once): no child of ours is left in another user namespace.
    #[test]
    fn namespace_helpers_are_reaped() {
        let range = IdRange { host_base: FIRST_BASE };
        let map = IdMap::range(range);
        let ours = std::fs::read_link("/proc/self/ns/user").unwrap();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(move || {
                    for _ in 0..25 {
                        let ns = user_namespace(&[map], &[map]).expect("a user namespace (the suite runs as root)");
                        assert_ne!(
                            std::fs::read_link(format!("/proc/self/fd/{}", ns.as_raw_fd())).ok(),
                            None
                        );
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        // Alive in another namespace, or a zombie (other tests' children are reaped within
        // moments: a stray is one seen twice, 200 ms apart).
        let strays = || -> std::collections::HashSet<String> {
            std::fs::read_dir("/proc/self/task")
                .unwrap()
                .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("children")).ok())
                .flat_map(|c| c.split_whitespace().map(str::to_string).collect::<Vec<_>>())
                .filter(|pid| {
                    let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                        s.rsplit(')')
                            .next()
                            .is_some_and(|rest| rest.trim_start().starts_with('Z'))
                    });
                    zombie || std::fs::read_link(format!("/proc/{pid}/ns/user")).is_ok_and(|ns| ns != ours)
                })
                .collect()
        };
        let first = strays();
        std::thread::sleep(std::time::Duration::from_millis(200));
        let left: Vec<_> = first.intersection(&strays()).cloned().collect();
        assert!(left.is_empty(), "namespace helpers left behind: {left:?}");
    }

    /// The same maps get the same namespace again, other maps another one, and the kept ones
    /// stay within their number.
    #[test]
    fn a_namespace_is_kept_for_its_maps() {
        use std::os::unix::fs::MetadataExt;
        let ino = |fd: &OwnedFd| {
            std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                .unwrap()
                .ino()
        };
        // Bases far from other tests' ranges: the kept list is the process's.
        let map = |i: u32| {
            IdMap::range(IdRange {
                host_base: 3_000_000_000 + i * 65536,
            })
        };
        let first = kept_user_namespace(&[map(0)], &[map(0)]).unwrap();
        let again = kept_user_namespace(&[map(0)], &[map(0)]).unwrap();
        assert_eq!(ino(&first), ino(&again), "the same maps");
        let other = kept_user_namespace(&[map(1)], &[map(1)]).unwrap();
        assert_ne!(ino(&first), ino(&other), "other maps");
        for i in 2..(KEPT_MAX as u32 + 10) {
            kept_user_namespace(&[map(i)], &[map(i)]).unwrap();
        }
        assert!(KEPT.lock().unwrap().len() <= KEPT_MAX);
    }

    /// An idmapped bind shows the owner as the mapped id and stores writes as the owner's.
    /// Needs root, as the suite runs.
    #[test]
    fn an_idmapped_bind_stores_writes_as_the_owner() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        std::fs::create_dir(&src).unwrap();
        std::os::unix::fs::chown(&src, Some(1234), Some(1235)).unwrap();
        let range = IdRange { host_base: FIRST_BASE };
        let (u, g) = owner_maps((1234, 1235), (0, 0), range);
        let ns = user_namespace(&[u], &[g]).expect("a user namespace (the suite runs as root)");
        let target = tmp.path().join("view");
        bind_idmapped(
            Source::Path(&src),
            &target,
            Some(ns.as_fd()),
            Flags {
                read_only: false,
                restricted: true,
            },
        )
        .unwrap();
        let seen = std::fs::metadata(&target).unwrap();
        assert_eq!((seen.uid(), seen.gid()), (FIRST_BASE, FIRST_BASE));
        // Host root is not mapped: it cannot write there.
        assert!(std::fs::write(target.join("root"), "x").is_err());
        // A file made by the mapped id lands as the owner's on disk.
        let status = std::process::Command::new("/bin/sh")
            .args(["-c", "echo x > \"$0\"/f"])
            .arg(&target)
            .uid(FIRST_BASE)
            .gid(FIRST_BASE)
            .status()
            .unwrap();
        assert!(status.success());
        let disk = std::fs::metadata(src.join("f")).unwrap();
        assert_eq!((disk.uid(), disk.gid()), (1234, 1235));
        nix::mount::umount2(&target, nix::mount::MntFlags::MNT_DETACH).unwrap();
    }
}
