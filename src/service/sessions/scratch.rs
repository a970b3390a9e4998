//! Sessions' scratch workspaces: a directory for a session created without a workspace of
//! its own, removed with the session.
//!
//! A server keeps its sessions' scratch workspaces in one directory of the temp directory,
//! `runner-session-<owner>-<random>` (`Scratch`), and a few made ahead there, so that a create
//! names its workspace and has it without touching the file system: making one (mkdir, chown,
//! chmod) took 0.2–0.4 ms of a pooled session's create, the first file system calls after an
//! idle moment costing most. The directory is mode 0711: the temp directory no longer lists
//! every session's workspace, and the ones made ahead have names nobody has seen. A
//! workspace given to a sandbox is as open as it was in the temp directory itself: its path
//! shows in the sandbox's mount table, which local users can read.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use super::ServiceError;

/// The host's `nobody` (and `nogroup`): owner of session scratch workspaces.
const NOBODY: u32 = 65_534;

/// What a server's directory of scratch workspaces is called in the temp directory: this
/// prefix, the server's owner id (`pid-starttime`), a random tag. `runner gc` removes those
/// of servers that are gone.
pub const SCRATCH_PREFIX: &str = "runner-session-";

/// Scratch workspaces a server keeps made ahead. A few cover one-after-another creates (a
/// harness's loop, an agent's sandboxes); a burst takes them all and makes the rest as it
/// goes, while one filler makes the stock again.
const STOCK_SIZE: usize = 4;

/// How long after a take the stock is made full again: once the session that took one has
/// had its first answers (on 2 cores the filler's file system work would take a core from
/// them).
const REFILL_AFTER: Duration = Duration::from_millis(20);

/// The oldest a workspace made ahead is given out: the temp directory's cleaners (systemd's
/// tmpfiles: 10 days) remove what sits unused, and an idle server's stock would be gone
/// under it. Older ones are removed and a fresh one made.
const READY_FOR: Duration = Duration::from_secs(3600);

/// A session's scratch workspace. Removed with the session through
/// `confined::remove_tree` (the sandbox may have made it anything: 15,000 levels deep, links
/// everywhere), on the blocking pool when there is one.
pub struct ScratchDir {
    path: PathBuf,
    /// The server's directory it is in: removed after its last workspace once the server
    /// stops (`Scratch::remove`), which waits for them (`Scratch::removed`).
    home: Arc<Scratch>,
}

impl ScratchDir {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let (path, home) = (std::mem::take(&mut self.path), self.home.clone());
        let remove = move || {
            // At the open-files limit (the scratch of a create refused there) the janitor
            // removes it: the path is all it is given.
            let dir = path.clone();
            if let Err(e) = crate::runtime::janitor::or_at_the_wall(move || crate::confined::remove_tree(&dir)) {
                tracing::warn!(dir = %path.display(), error = %e, "removing a scratch workspace (runner gc retries)");
            }
            home.remove_dir_if_closed();
            home.live.fetch_sub(1, Ordering::AcqRel);
            home.gone.notify_waiters();
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => drop(handle.spawn_blocking(remove)),
            Err(_) => remove(),
        }
    }
}

/// Whether the name of a server's directory of scratch workspaces says its server is gone.
pub fn scratch_abandoned(name: &str) -> bool {
    let Some(rest) = name.strip_prefix(SCRATCH_PREFIX) else {
        return false;
    };
    let mut parts = rest.splitn(3, '-');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(pid), Some(start), Some(_tag)) => !crate::owner::owner_alive(&format!("{pid}:{start}")),
        _ => false,
    }
}

/// Sandboxes may run as any uid: their scratch workspace is theirs to write. It belongs to
/// nobody: in a user namespace what the sandbox writes there is stored as the workspace's
/// owner, which must not be the host's root.
fn open_to_sandboxes(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::os::unix::fs::chown(dir, Some(NOBODY), Some(NOBODY))
        .and_then(|()| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)))
}

/// 64 bits from the kernel's random source, in hex: a name nobody can guess or place first.
fn random_name() -> String {
    let mut bytes = [0u8; 8];
    // SAFETY: the kernel writes at most `bytes.len()` bytes into the buffer.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != bytes.len() as isize {
        // Never short for 8 bytes once the pool is ready; a unique tag is the fallback.
        return format!("{}{}", crate::owner::unique_tag(), crate::owner::unique_tag());
    }
    hex::encode(bytes)
}

/// A server's scratch workspaces: the directory they are in (made at the first session
/// that needs one) and those made ahead.
pub struct Scratch {
    dir: PathBuf,
    state: Mutex<State>,
    /// One filler at a time; a take that finds one at work leaves it the job.
    filling: AtomicBool,
    /// Workspaces given out and not yet removed, and a wake for `removed`.
    live: AtomicUsize,
    gone: tokio::sync::Notify,
}

#[derive(Default)]
struct State {
    /// The directory was made (and not removed since).
    made: bool,
    /// Workspaces made ahead, oldest first, with when they were made (the cleaners of the
    /// temp directory go by the wall clock too).
    ready: Vec<(PathBuf, SystemTime)>,
    /// Made ahead too long ago: removed by the next filler.
    stale: Vec<PathBuf>,
    /// The last filler failed (logged once until one succeeds).
    failing: bool,
    /// Set by `remove`: nothing is made ahead any more, and the directory goes with its
    /// last workspace.
    closed: bool,
}

/// A scratch workspace named for a create: one made ahead, or one `make` makes.
pub struct Reserved {
    path: PathBuf,
    ready: bool,
    home: Arc<Scratch>,
}

impl Default for Scratch {
    fn default() -> Self {
        let owner = crate::owner::owner_id().replace(':', "-");
        Scratch {
            dir: std::env::temp_dir().join(format!("{SCRATCH_PREFIX}{owner}-{}", random_name())),
            state: Mutex::default(),
            filling: AtomicBool::new(false),
            live: AtomicUsize::new(0),
            gone: tokio::sync::Notify::new(),
        }
    }
}

impl Scratch {
    /// A scratch workspace for a new session: named now, without touching the file system
    /// (it runs on the request's thread); `Reserved::make` has it.
    pub fn reserve(self: &Arc<Self>) -> Reserved {
        let ready = {
            let mut state = self.state.lock().expect("scratch workspaces");
            match state.ready.pop() {
                // A clock set back: as new.
                Some((path, made)) if made.elapsed().map_or(true, |age| age < READY_FOR) => Some(path),
                // The newest is too old, so are the rest: all are made again.
                Some((path, _)) => {
                    let older = std::mem::take(&mut state.ready).into_iter().map(|(p, _)| p);
                    state.stale.extend(older.chain([path]));
                    None
                }
                None => None,
            }
        };
        Reserved {
            ready: ready.is_some(),
            path: ready.unwrap_or_else(|| self.dir.join(random_name())),
            home: self.clone(),
        }
    }

    /// Make a scratch workspace at `path` in the server's directory (made first unless it
    /// is). Blocks; the state's lock is never held across a file system call (`reserve`
    /// takes it on an async worker).
    fn make_one(&self, path: &Path) -> std::io::Result<()> {
        let made = self.state.lock().expect("scratch workspaces").made;
        let first = if made {
            std::fs::create_dir(path)
        } else {
            Err(std::io::ErrorKind::NotFound.into())
        };
        match first {
            Ok(()) => {}
            // Not made yet, or removed since (after a stop, or by a cleaner of the temp
            // directory): made again.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.make_dir()?;
                std::fs::create_dir(path)?;
            }
            Err(e) => return Err(e),
        }
        open_to_sandboxes(path).inspect_err(|_| {
            let _ = std::fs::remove_dir(path);
        })
    }

    /// Make the server's directory: a random name, so nothing another user placed can be
    /// there; made 0700, then opened to 0711 (the host backend's commands may run as
    /// another user, and reach their workspace by its path).
    fn make_dir(&self) -> std::io::Result<()> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        match std::fs::DirBuilder::new().mode(0o700).create(&self.dir) {
            Ok(()) => std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o711))?,
            // Made by a concurrent `make_one` of this server (the name is random).
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && self.is_ours()? => {}
            Err(e) => return Err(e),
        }
        self.state.lock().expect("scratch workspaces").made = true;
        Ok(())
    }

    /// Whether the directory at our path is one this process made: a directory (never a
    /// link) of ours, mode 0700 or 0711.
    fn is_ours(&self) -> std::io::Result<bool> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(&self.dir)?;
        Ok(m.is_dir() && m.uid() == nix::unistd::geteuid().as_raw() && matches!(m.mode() & 0o7777, 0o700 | 0o711))
    }

    /// Make the stock full again, on the blocking pool, `REFILL_AFTER` from now, unless a
    /// filler is at it. Called from an async worker: the filler's start is a task there,
    /// not a blocking thread woken on a create's path.
    pub fn refill(self: &Arc<Self>) {
        if self.filling.swap(true, Ordering::AcqRel) {
            return;
        }
        let home = self.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => drop(handle.spawn(async move {
                tokio::time::sleep(REFILL_AFTER).await;
                let filler = home.clone();
                if tokio::task::spawn_blocking(move || filler.fill()).await.is_err() {
                    tracing::warn!("the filler of the scratch workspaces' stock panicked");
                }
                home.filling.store(false, Ordering::Release);
            })),
            // Without a runtime there is no thread to fill it off a caller's path.
            Err(_) => self.filling.store(false, Ordering::Release),
        }
    }

    /// Remove the stale ones, then make workspaces ahead until there are `STOCK_SIZE`.
    /// Blocks. A failure ends this round (the next create's refill tries again).
    fn fill(&self) {
        let stale = std::mem::take(&mut self.state.lock().expect("scratch workspaces").stale);
        for dir in stale {
            if let Err(e) = std::fs::remove_dir(&dir)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(dir = %dir.display(), error = %e, "removing a scratch workspace made ahead (runner gc retries)");
            }
        }
        loop {
            {
                let state = self.state.lock().expect("scratch workspaces");
                if state.closed || state.ready.len() >= STOCK_SIZE {
                    return;
                }
            }
            let one = self.dir.join(random_name());
            let made = self.make_one(&one);
            let mut state = self.state.lock().expect("scratch workspaces");
            match made {
                Ok(()) if !state.closed => {
                    state.ready.push((one, SystemTime::now()));
                    state.failing = false;
                }
                // Closed meanwhile: it goes with the directory.
                Ok(()) => {
                    drop(state);
                    let _ = std::fs::remove_dir(&one);
                    self.remove_dir_if_closed();
                    return;
                }
                Err(e) => {
                    if !std::mem::replace(&mut state.failing, true) {
                        tracing::warn!(dir = %one.display(), error = %e, "making a scratch workspace ahead (creates make their own)");
                    }
                    return;
                }
            }
        }
    }

    /// Remove the workspaces made ahead and, once the sessions' own are gone too, the
    /// server's directory; nothing is made ahead from now on. Blocks.
    pub fn remove(&self) {
        let unused: Vec<PathBuf> = {
            let mut state = self.state.lock().expect("scratch workspaces");
            state.closed = true;
            let ready = std::mem::take(&mut state.ready).into_iter().map(|(p, _)| p);
            ready.chain(std::mem::take(&mut state.stale)).collect()
        };
        for dir in unused {
            if let Err(e) = std::fs::remove_dir(&dir)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(dir = %dir.display(), error = %e, "removing a scratch workspace made ahead (runner gc retries)");
            }
        }
        self.remove_dir_if_closed();
    }

    /// Until every workspace given out is removed (their sessions' removals run on the
    /// blocking pool; a server that stops waits for them, within its deadline).
    pub async fn removed(&self) {
        loop {
            let wake = self.gone.notified();
            if self.live.load(Ordering::Acquire) == 0 {
                return;
            }
            wake.await;
        }
    }

    /// After `remove`, the server's directory goes when it is empty (its last workspace
    /// removed, by whichever removal comes last).
    fn remove_dir_if_closed(&self) {
        let mut state = self.state.lock().expect("scratch workspaces");
        if !state.closed || !state.made {
            return;
        }
        match std::fs::remove_dir(&self.dir) {
            // A create after the stop makes it again (and it goes with that workspace).
            Ok(()) => state.made = false,
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTEMPTY)) => {}
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "removing the scratch workspaces' directory (runner gc retries)")
            }
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        self.remove();
    }
}

impl Reserved {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The workspace, made unless it was made ahead. Blocks. (`Scratch::refill` after.)
    pub fn make(self) -> Result<ScratchDir, ServiceError> {
        if !self.ready {
            self.home
                .make_one(&self.path)
                .map_err(|e| ServiceError::internal("creating a scratch workspace", e))?;
        }
        self.home.live.fetch_add(1, Ordering::AcqRel);
        Ok(ScratchDir {
            path: self.path,
            home: self.home,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn entries(dir: &Path) -> usize {
        std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
    }

    fn ready(home: &Scratch) -> usize {
        home.state.lock().unwrap().ready.len()
    }

    #[test]
    fn workspaces_made_ahead_are_what_a_made_one_is_and_go_with_the_directory() {
        let home = Arc::new(Scratch::default());
        let first = home.reserve();
        assert!(!first.ready, "nothing is made before the first session");
        assert!(!home.dir.exists());
        let made = first.make().unwrap();
        // No runtime here: the test fills the stock itself.
        home.fill();
        assert_eq!(ready(&home), STOCK_SIZE);
        let m = std::fs::symlink_metadata(&home.dir).unwrap();
        assert_eq!((m.uid(), m.mode() & 0o7777), (0, 0o711), "not listed but by its server");
        assert_eq!(home.dir.parent(), Some(std::env::temp_dir().as_path()));

        let second = home.reserve();
        assert!(second.ready);
        let taken = second.make().unwrap();
        assert_eq!(ready(&home), STOCK_SIZE - 1);
        for dir in [taken.path(), made.path()] {
            let m = std::fs::symlink_metadata(dir).unwrap();
            assert!(m.is_dir());
            assert_eq!(
                (m.uid(), m.gid(), m.mode() & 0o7777),
                (NOBODY, NOBODY, 0o777),
                "{}",
                dir.display()
            );
            assert_eq!(dir.parent(), Some(home.dir.as_path()));
        }
        assert_eq!(entries(&home.dir), 2 + STOCK_SIZE - 1);
        assert_eq!(home.live.load(Ordering::Acquire), 2);

        // Stopped with sessions left: the made-ahead ones go at once, the directory with
        // the last session's workspace.
        home.remove();
        assert_eq!(entries(&home.dir), 2);
        drop(made);
        assert!(home.dir.exists());
        drop(taken);
        assert!(!home.dir.exists());
        assert_eq!(home.live.load(Ordering::Acquire), 0);
        // Nothing is made ahead any more; a late create still gets a workspace, and the
        // directory goes with it.
        home.fill();
        assert_eq!(ready(&home), 0);
        let late = home.reserve().make().unwrap();
        assert!(late.path().is_dir());
        drop(late);
        assert!(!home.dir.exists());
    }

    #[test]
    fn a_directory_removed_under_the_server_is_made_again_and_old_stock_made_anew() {
        let home = Arc::new(Scratch::default());
        home.reserve().make().unwrap();
        home.fill();
        // A cleaner of the temp directory took everything, while the stock was too old.
        std::fs::remove_dir_all(&home.dir).unwrap();
        for (_, made) in home.state.lock().unwrap().ready.iter_mut() {
            *made -= READY_FOR;
        }
        let fresh = home.reserve();
        assert!(!fresh.ready, "a workspace made an hour ago is not given out");
        let fresh = fresh.make().unwrap();
        assert!(fresh.path().is_dir());
        home.fill();
        assert_eq!(ready(&home), STOCK_SIZE);
        assert_eq!(entries(&home.dir), 1 + STOCK_SIZE);
        drop(fresh);
        drop(home);
    }

    #[test]
    fn the_directory_goes_with_its_server() {
        let dir = {
            let home = Arc::new(Scratch::default());
            let one = home.reserve().make().unwrap();
            home.fill();
            drop(one);
            assert_eq!(entries(&home.dir), STOCK_SIZE);
            home.dir.clone()
        };
        assert!(!dir.exists(), "{}", dir.display());
    }

    #[test]
    fn a_name_someone_else_made_first_is_not_taken() {
        let home = Arc::new(Scratch::default());
        std::os::unix::fs::symlink("/", &home.dir).unwrap();
        let refused = home.reserve().make();
        std::fs::remove_file(&home.dir).unwrap();
        assert!(refused.is_err());
    }

    #[test]
    fn names_are_random() {
        let names: std::collections::HashSet<String> = (0..1000).map(|_| random_name()).collect();
        assert_eq!(names.len(), 1000);
        assert!(names.iter().all(|n| n.len() == 16));
    }

    #[test]
    fn gc_knows_a_live_servers_directory_from_a_gone_ones() {
        let home = Scratch::default();
        assert!(!scratch_abandoned(home.dir.file_name().unwrap().to_str().unwrap()));
        // PID 0 never names a process.
        assert!(scratch_abandoned("runner-session-0-1-abc"));
        assert!(!scratch_abandoned("runner-session-0"));
        assert!(!scratch_abandoned("something-else-0-1-abc"));
    }
}
