//! Freezing a sandbox's cgroup directly: cgroup v1's freezer (`freezer.state`: write
//! `FROZEN`, which reads `FREEZING` until every task has stopped, then `FROZEN`; `THAWED` to
//! thaw) and cgroup v2's `cgroup.freeze` (write `1`; done once `cgroup.events` says
//! `frozen 1`). This is what `runc pause` does, without its process start (containerd's
//! Tasks.Pause runs `runc pause` through the shim: tens of milliseconds where the files take
//! well under one).
//!
//! runc reads the same files for its state, so `runc state` (and containerd for a task that
//! is asked) sees such a sandbox paused; containerd's shim keeps its own record of the task
//! (running), which is why a sandbox runner froze is thawed by runner before it is killed
//! (`Engine::teardown`): on cgroup v1 a frozen process takes no signal until it is thawed.
//!
//! The files are the host's (the sandbox sees its cgroup read-only, if at all), but a write
//! to `freezer.state` can take as long as the kernel needs to stop the sandbox's tasks: every
//! call here is blocking and belongs on the blocking pool, and freezing is bounded in time.

use std::fs::OpenOptions;
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::runtime::cgroupfs::{self, Layout};

/// How long a freeze may take before it is given up (and the cgroup thawed): a sandbox
/// forking as fast as it can keeps a v1 freezer in `FREEZING` for a while.
pub const FREEZE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a `FREEZING` cgroup is left before it is thawed and frozen again: new tasks
/// (forks) can keep a v1 freezer from finishing, and a fresh start catches them.
const REFREEZE_AFTER: Duration = Duration::from_millis(100);

/// The longest wait between two looks at the state.
const MAX_POLL: Duration = Duration::from_millis(1);

/// A cgroup file holds a word or a few short lines: more is not a cgroup file.
const MAX_FILE: u64 = 4096;

/// Where a cgroup's freezer is, on either cgroup version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Freezer {
    /// `freezer.state` in the v1 freezer hierarchy.
    V1 { state: PathBuf },
    /// The cgroup's directory in the v2 hierarchy (`cgroup.freeze`, `cgroup.events`).
    V2 { dir: PathBuf },
}

/// A freezer's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreezeState {
    Thawed,
    /// Asked to freeze, some task still runs (v1 `FREEZING`; v2 `cgroup.freeze` 1 while
    /// `cgroup.events` still says `frozen 0`).
    Freezing,
    Frozen,
}

#[derive(Debug, thiserror::Error)]
pub enum FreezeError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("{path}: unexpected contents {text:?}")]
    Format { path: String, text: String },
    #[error("the sandbox's processes did not all stop within {0:?} (it was left running)")]
    Timeout(Duration),
}

impl Freezer {
    /// The freezer of the cgroup at `cgroup` (a spec's `cgroupsPath`) on this host.
    pub fn of(cgroup: &str) -> Freezer {
        Freezer::at(cgroupfs::layout(), Path::new(cgroupfs::CGROUP_ROOT), cgroup)
    }

    /// The freezer of `cgroup` for `layout`, the hierarchies mounted under `root`.
    pub fn at(layout: Layout, root: &Path, cgroup: &str) -> Freezer {
        let relative = cgroup.trim_start_matches('/');
        match layout {
            Layout::V1 => Freezer::V1 {
                state: root.join("freezer").join(relative).join("freezer.state"),
            },
            Layout::V2 => Freezer::V2 {
                dir: root.join(relative),
            },
        }
    }

    /// Whether the cgroup is there (it goes with the task).
    pub fn exists(&self) -> bool {
        match self {
            Freezer::V1 { state } => state.exists(),
            Freezer::V2 { dir } => dir.join("cgroup.freeze").exists(),
        }
    }

    pub fn state(&self) -> Result<FreezeState, FreezeError> {
        match self {
            Freezer::V1 { state } => match read(state)?.trim() {
                "THAWED" => Ok(FreezeState::Thawed),
                "FREEZING" => Ok(FreezeState::Freezing),
                "FROZEN" => Ok(FreezeState::Frozen),
                other => Err(format_error(state, other)),
            },
            Freezer::V2 { dir } => {
                let freeze = dir.join("cgroup.freeze");
                let asked = match read(&freeze)?.trim() {
                    "0" => false,
                    "1" => true,
                    other => return Err(format_error(&freeze, other)),
                };
                Ok(match (asked, self.v2_frozen()?) {
                    (false, _) => FreezeState::Thawed,
                    (true, false) => FreezeState::Freezing,
                    (true, true) => FreezeState::Frozen,
                })
            }
        }
    }

    /// `frozen N` of a v2 cgroup's `cgroup.events`.
    fn v2_frozen(&self) -> Result<bool, FreezeError> {
        let Freezer::V2 { dir } = self else {
            unreachable!("v2 only")
        };
        let events = dir.join("cgroup.events");
        let text = read(&events)?;
        match text.lines().find_map(|l| l.strip_prefix("frozen ")).map(str::trim) {
            Some("0") => Ok(false),
            Some("1") => Ok(true),
            _ => Err(format_error(&events, &text)),
        }
    }

    /// Stop every task of the cgroup and return once all have stopped; within `timeout`, or
    /// the cgroup is thawed again and this fails.
    pub fn freeze(&self, timeout: Duration) -> Result<(), FreezeError> {
        let began = Instant::now();
        let mut round = Instant::now();
        let mut pause = Duration::from_micros(20);
        self.ask(true)?;
        loop {
            match self.state()? {
                FreezeState::Frozen => return Ok(()),
                FreezeState::Thawed => self.ask(true)?,
                FreezeState::Freezing => {}
            }
            if began.elapsed() >= timeout {
                self.thaw()?;
                return Err(FreezeError::Timeout(timeout));
            }
            if round.elapsed() >= REFREEZE_AFTER && matches!(self, Freezer::V1 { .. }) {
                // Start over: tasks forked while the freezer walked the cgroup are caught
                // by a new pass.
                self.ask(false)?;
                self.ask(true)?;
                round = Instant::now();
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(MAX_POLL);
        }
    }

    /// Let every task of the cgroup run again.
    pub fn thaw(&self) -> Result<(), FreezeError> {
        self.ask(false)
    }

    fn ask(&self, frozen: bool) -> Result<(), FreezeError> {
        match self {
            Freezer::V1 { state } => write(state, if frozen { "FROZEN" } else { "THAWED" }),
            Freezer::V2 { dir } => write(&dir.join("cgroup.freeze"), if frozen { "1" } else { "0" }),
        }
    }
}

/// Freeze the sandbox whose cgroup is `cgroup` (on the blocking pool: the write and the
/// wait are the kernel's time, not a shared thread's).
pub async fn freeze(cgroup: &str) -> Result<(), crate::runtime::RuntimeError> {
    let freezer = Freezer::of(cgroup);
    blocking("freezing", cgroup, move || freezer.freeze(FREEZE_TIMEOUT)).await
}

/// Thaw the sandbox whose cgroup is `cgroup`.
pub async fn thaw(cgroup: &str) -> Result<(), crate::runtime::RuntimeError> {
    let freezer = Freezer::of(cgroup);
    blocking("thawing", cgroup, move || freezer.thaw()).await
}

/// The state of the sandbox whose cgroup is `cgroup`; `None` when the cgroup is gone (the
/// task with it).
pub async fn state(cgroup: &str) -> Result<Option<FreezeState>, crate::runtime::RuntimeError> {
    let freezer = Freezer::of(cgroup);
    blocking("reading the freezer of", cgroup, move || {
        if freezer.exists() {
            freezer.state().map(Some)
        } else {
            Ok(None)
        }
    })
    .await
}

async fn blocking<T: Send + 'static>(
    what: &'static str,
    cgroup: &str,
    f: impl FnOnce() -> Result<T, FreezeError> + Send + 'static,
) -> Result<T, crate::runtime::RuntimeError> {
    use crate::runtime::RuntimeError;
    let done = tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| RuntimeError::Internal(format!("{what} cgroup {cgroup}: {e}")))?;
    done.map_err(|e| match e {
        FreezeError::Timeout(_) => RuntimeError::Refused(format!("{what} cgroup {cgroup}: {e}")),
        e => RuntimeError::Internal(format!("{what} cgroup {cgroup}: {e}")),
    })
}

fn format_error(path: &Path, text: &str) -> FreezeError {
    FreezeError::Format {
        path: path.display().to_string(),
        text: text.chars().take(80).collect(),
    }
}

fn read(path: &Path) -> Result<String, FreezeError> {
    let err = |source| FreezeError::Io {
        what: "reading",
        path: path.display().to_string(),
        source,
    };
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(err)?;
    let mut text = String::new();
    file.take(MAX_FILE).read_to_string(&mut text).map_err(err)?;
    Ok(text)
}

fn write(path: &Path, word: &str) -> Result<(), FreezeError> {
    let err = |source| FreezeError::Io {
        what: "writing",
        path: path.display().to_string(),
        source,
    };
    let mut file = OpenOptions::new()
        .write(true)
        .truncate(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(err)?;
    file.write_all(word.as_bytes()).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A v2 cgroup directory whose "kernel" is the test: it says `frozen 1` when told.
    fn v2(dir: &Path, freeze: &str, frozen: &str) {
        std::fs::write(dir.join("cgroup.freeze"), freeze).unwrap();
        std::fs::write(dir.join("cgroup.events"), format!("populated 1\nfrozen {frozen}\n")).unwrap();
    }

    #[test]
    fn paths_follow_the_layout() {
        let root = Path::new("/sys/fs/cgroup");
        assert_eq!(
            Freezer::at(Layout::V1, root, "/runner/ns/c1"),
            Freezer::V1 {
                state: PathBuf::from("/sys/fs/cgroup/freezer/runner/ns/c1/freezer.state")
            }
        );
        assert_eq!(
            Freezer::at(Layout::V2, root, "/runner/ns/c1"),
            Freezer::V2 {
                dir: PathBuf::from("/sys/fs/cgroup/runner/ns/c1")
            }
        );
    }

    #[test]
    fn v2_state_is_the_request_and_the_kernel_event() {
        let dir = tempfile::tempdir().unwrap();
        let f = Freezer::at(Layout::V2, dir.path(), "/");
        v2(dir.path(), "0\n", "0");
        assert_eq!(f.state().unwrap(), FreezeState::Thawed);
        v2(dir.path(), "1\n", "0");
        assert_eq!(f.state().unwrap(), FreezeState::Freezing);
        v2(dir.path(), "1\n", "1");
        assert_eq!(f.state().unwrap(), FreezeState::Frozen);
        // Frozen already: freezing writes the request and returns at once.
        f.freeze(Duration::from_millis(50)).unwrap();
        assert_eq!(std::fs::read_to_string(dir.path().join("cgroup.freeze")).unwrap(), "1");
        f.thaw().unwrap();
        assert_eq!(std::fs::read_to_string(dir.path().join("cgroup.freeze")).unwrap(), "0");
    }

    #[test]
    fn a_v2_freeze_the_kernel_never_finishes_times_out_and_thaws() {
        let dir = tempfile::tempdir().unwrap();
        let f = Freezer::at(Layout::V2, dir.path(), "/");
        v2(dir.path(), "0", "0");
        let began = Instant::now();
        let e = f.freeze(Duration::from_millis(30)).unwrap_err();
        assert!(matches!(e, FreezeError::Timeout(_)), "{e}");
        assert!(began.elapsed() >= Duration::from_millis(30));
        assert_eq!(std::fs::read_to_string(dir.path().join("cgroup.freeze")).unwrap(), "0");
    }

    #[test]
    fn a_v2_freeze_waits_for_the_event() {
        let dir = tempfile::tempdir().unwrap();
        let f = Freezer::at(Layout::V2, dir.path(), "/");
        v2(dir.path(), "0", "0");
        let kernel = {
            let dir = dir.path().to_path_buf();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                std::fs::write(dir.join("cgroup.events"), "populated 1\nfrozen 1\n").unwrap();
            })
        };
        f.freeze(Duration::from_secs(5)).unwrap();
        kernel.join().unwrap();
        assert_eq!(f.state().unwrap(), FreezeState::Frozen);
    }

    #[test]
    fn bad_contents_and_missing_files_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let f = Freezer::at(Layout::V2, dir.path(), "/");
        assert!(!f.exists());
        assert!(matches!(f.state(), Err(FreezeError::Io { .. })));
        v2(dir.path(), "1", "x");
        assert!(matches!(f.state(), Err(FreezeError::Format { .. })));
        let v1 = Freezer::at(Layout::V1, dir.path(), "/");
        std::fs::create_dir(dir.path().join("freezer")).unwrap();
        std::fs::write(dir.path().join("freezer/freezer.state"), "SLEEPY\n").unwrap();
        assert!(matches!(v1.state(), Err(FreezeError::Format { .. })));
        std::fs::write(dir.path().join("freezer/freezer.state"), "FROZEN\n").unwrap();
        assert_eq!(v1.state().unwrap(), FreezeState::Frozen);
    }
}
