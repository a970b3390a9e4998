//! Sessions' scratch workspaces: a directory for a session created without a workspace of
//! its own, removed with the session.
//!
//! A server keeps its sessions' scratch workspaces in one directory of the temp directory,
//! `runner-session-<owner>-<tag>` (`Scratch`), mode 0711: local users can neither list it
//! nor guess a name in it (the names are random), where each workspace used to sit in the
//! temp directory itself for anyone to list. It keeps a few made ahead, so that a create
//! names its workspace and has it without touching the file system: making one (mkdir,
//! chown, chmod) took 0.2–0.4 ms of a pooled session's create, the first file system calls
//! after an idle moment costing most.

use std::hash::{BuildHasher, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::ServiceError;

/// The host's `nobody` (and `nogroup`): owner of session scratch workspaces.
const NOBODY: u32 = 65_534;

/// What a server's directory of scratch workspaces is called in the temp directory: this
/// prefix, the server's owner id (`pid-starttime`), a unique tag. `runner gc` removes those
/// of servers that are gone.
pub const SCRATCH_PREFIX: &str = "runner-session-";

/// Scratch workspaces a server keeps made ahead. A few cover one-after-another creates (a
/// harness's loop, an agent's sandboxes); a burst takes them all and makes the rest as it
/// goes, while one filler makes the stock again.
const STOCK_SIZE: usize = 4;

/// How long after a take the stock is made full again: once the session that took one has
/// had its first answers (on 2 cores the filler's file system work would take a core from
/// them).
const REFILL_AFTER: std::time::Duration = std::time::Duration::from_millis(20);

/// A session's scratch workspace. Removed with the session through
/// `confined::remove_tree` (the sandbox may have made it anything: 15,000 levels deep, links
/// everywhere), on the blocking pool when there is one.
pub struct ScratchDir {
    path: PathBuf,
    /// The server's directory it is in: removed after its last workspace once the server
    /// stops (`Scratch::remove`).
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

/// A name no local user can guess: 64 bits from the process's random SipHash keys.
fn random_name() -> String {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(0);
    format!("{:016x}", hasher.finish())
}

/// A server's scratch workspaces: the directory they are in (made at the first session
/// that needs one) and those made ahead.
pub struct Scratch {
    dir: PathBuf,
    state: Mutex<State>,
    /// One filler at a time; a take that finds one at work leaves it the job.
    filling: AtomicBool,
}

#[derive(Default)]
struct State {
    /// The directory was made.
    made: bool,
    /// Workspaces made ahead, ready to be given out as they are.
    ready: Vec<PathBuf>,
    /// Set when making one ahead failed: creates make their own from then on (logged once).
    broken: bool,
    /// Set by `remove`: nothing is made any more, and the directory goes with its last
    /// workspace.
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
        let name = format!("{SCRATCH_PREFIX}{owner}-{}", crate::owner::unique_tag());
        Scratch {
            dir: std::env::temp_dir().join(name),
            state: Mutex::default(),
            filling: AtomicBool::new(false),
        }
    }
}

impl Scratch {
    /// A scratch workspace for a new session: named now, without touching the file system
    /// (it runs on the request's thread); `Reserved::make` has it.
    pub fn reserve(self: &Arc<Self>) -> Reserved {
        let ready = self.state.lock().expect("scratch workspaces").ready.pop();
        Reserved {
            ready: ready.is_some(),
            path: ready.unwrap_or_else(|| self.dir.join(random_name())),
            home: self.clone(),
        }
    }

    /// Make the server's directory unless it is made. Blocks.
    fn make_dir(&self, state: &mut State) -> std::io::Result<()> {
        if state.made {
            return Ok(());
        }
        // A new name (its tag is unique), made here: nothing another user placed can be
        // in it. 0711: the host backend's commands may run as another user, and reach
        // their workspace by its path.
        std::fs::create_dir(&self.dir)?;
        state.made = true;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o711))
    }

    /// Make a scratch workspace at `path` in the server's directory. Blocks.
    fn make_one(&self, path: &Path) -> std::io::Result<()> {
        self.make_dir(&mut self.state.lock().expect("scratch workspaces"))?;
        std::fs::create_dir(path)?;
        open_to_sandboxes(path).inspect_err(|_| {
            let _ = std::fs::remove_dir(path);
        })
    }

    /// Make the stock full again, on the blocking pool, `REFILL_AFTER` from now, unless a
    /// filler is at it. Called from an async worker, where starting a task wakes no thread
    /// (from the blocking pool it was a wake on the create's path).
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

    /// Make workspaces ahead until there are `STOCK_SIZE`. Blocks.
    fn fill(&self) {
        loop {
            {
                let state = self.state.lock().expect("scratch workspaces");
                if state.closed || state.broken || state.ready.len() >= STOCK_SIZE {
                    return;
                }
            }
            let one = self.dir.join(random_name());
            let made = self.make_one(&one);
            let mut state = self.state.lock().expect("scratch workspaces");
            match made {
                Ok(()) if !state.closed => state.ready.push(one),
                // Closed meanwhile: it goes with the directory.
                Ok(()) => {
                    drop(state);
                    let _ = std::fs::remove_dir(&one);
                    self.remove_dir_if_closed();
                    return;
                }
                Err(e) => {
                    state.broken = true;
                    tracing::warn!(dir = %one.display(), error = %e, "making a scratch workspace ahead (sessions make their own)");
                    return;
                }
            }
        }
    }

    /// Remove the workspaces made ahead and, once the sessions' own are gone too, the
    /// server's directory; nothing is made ahead from now on. Blocks.
    pub fn remove(&self) {
        let ready = {
            let mut state = self.state.lock().expect("scratch workspaces");
            state.closed = true;
            std::mem::take(&mut state.ready)
        };
        for dir in ready {
            if let Err(e) = std::fs::remove_dir(&dir) {
                tracing::warn!(dir = %dir.display(), error = %e, "removing a scratch workspace made ahead (runner gc retries)");
            }
        }
        self.remove_dir_if_closed();
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
        assert_eq!((m.uid(), m.mode() & 0o7777), (0, 0o711), "listed by its server only");
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

        // Stopped with sessions left: the made-ahead ones go at once, the directory with
        // the last session's workspace.
        home.remove();
        assert_eq!(entries(&home.dir), 2);
        drop(made);
        assert!(home.dir.exists());
        drop(taken);
        assert!(!home.dir.exists());
        // Nothing is made ahead any more; a late create still gets a workspace.
        home.fill();
        assert_eq!(ready(&home), 0);
        let late = home.reserve().make().unwrap();
        assert!(late.path().is_dir());
        drop(late);
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
    fn names_are_not_guessable_from_one_another() {
        let names: std::collections::HashSet<String> = (0..1000).map(|_| random_name()).collect();
        assert_eq!(names.len(), 1000);
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
