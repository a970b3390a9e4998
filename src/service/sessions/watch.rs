//! Watching a session's workspace: inotify on the host side of the workspace, as a stream of
//! create, modify, delete and move events (paths relative to the workspace, as the file
//! operations name them).
//!
//! Confined as the file operations are: every watched directory is first opened `O_PATH`
//! beneath the workspace (`confined::Root::open_path`: no symlink out, no other mount), and the
//! watch is added through that descriptor's `/proc/self/fd` link, so it is on the inode that
//! resolution found, whatever the sandbox swaps in afterwards. Directories moved out of the
//! watched tree lose their watches.
//!
//! Bounded: a stream watches at most [`MAX_DIRS`] directories, the process at most
//! [`MAX_TOTAL_WATCHES`] (a sandbox making a million directories gets an `overflow` event
//! saying the rest is not watched, never the host's inotify watches or memory); a session has
//! at most [`MAX_WATCHERS`] streams; events wait in a channel of [`EVENT_BUFFER`] and, while
//! the client is behind, in the kernel's queue, whose overflow (`IN_Q_OVERFLOW`) is reported
//! as an `overflow` event. Each stream has a thread of its own (not the blocking pool, which
//! it would hold for as long as the client watches).

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use super::Session;
use crate::confined::{EntryKind, Root};
use crate::service::ServiceError;

/// Directories one stream watches at most.
pub const MAX_DIRS: usize = 8192;
/// Watches of every stream of this process together.
pub const MAX_TOTAL_WATCHES: usize = 65_536;
/// Streams open at once per session (each is an inotify instance: the host has few).
pub const MAX_WATCHERS: usize = 4;
/// Events waiting for a slow client (then the kernel queue fills, then it overflows).
pub const EVENT_BUFFER: usize = 256;
/// Entries of a new directory reported (and searched for directories) at most.
const SCAN_LIMIT: usize = 10_000;

static TOTAL_WATCHES: AtomicUsize = AtomicUsize::new(0);

/// One change in the workspace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum WatchEvent {
    /// The watches are in place: changes from now on are reported.
    Ready {
        watches: usize,
    },
    Create {
        path: String,
        dir: bool,
    },
    Modify {
        path: String,
    },
    Delete {
        path: String,
        dir: bool,
    },
    /// A rename: `from` is null for a name moved in from outside the watched tree, `to` for
    /// one moved out.
    Move {
        from: Option<String>,
        to: Option<String>,
        dir: bool,
    },
    /// Changes were not reported: the kernel's queue overflowed, or the tree has more
    /// directories than are watched.
    Overflow {
        reason: String,
    },
}

/// A running watch; it stops when dropped.
pub struct Watch {
    pub events: mpsc::Receiver<WatchEvent>,
    _slot: Slot,
}

struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

const MASK: AddWatchFlags = AddWatchFlags::IN_CREATE
    .union(AddWatchFlags::IN_MODIFY)
    .union(AddWatchFlags::IN_DELETE)
    .union(AddWatchFlags::IN_MOVED_FROM)
    .union(AddWatchFlags::IN_MOVED_TO)
    .union(AddWatchFlags::IN_DELETE_SELF)
    // Not for names unlinked but still open (nix has no constant for it).
    .union(AddWatchFlags::from_bits_retain(libc::IN_EXCL_UNLINK));

impl Session {
    /// Watch `path` (a directory, with its subdirectories when `recursive`, or a file).
    pub async fn watch(&self, path: &str, recursive: bool) -> Result<Watch, ServiceError> {
        if !path.is_empty() {
            crate::manifest::paths::check_lexical(path).map_err(|e| ServiceError::field("path", e.to_string()))?;
        }
        if self.watchers.fetch_add(1, Ordering::SeqCst) >= MAX_WATCHERS {
            self.watchers.fetch_sub(1, Ordering::SeqCst);
            return Err(ServiceError::Conflict(format!(
                "session {} has {MAX_WATCHERS} watches open already",
                self.id
            )));
        }
        let slot = Slot(self.watchers.clone());
        let root = Root::open(&self.workspace)?;
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        let (started_tx, started_rx) = oneshot::channel();
        let rel = path.trim_matches('/').to_string();
        std::thread::Builder::new()
            .name("runner-watch".into())
            .spawn(move || {
                let mut watcher = match Watcher::start(root, &rel, recursive) {
                    Ok(w) => w,
                    Err(e) => {
                        let _ = started_tx.send(Err(e));
                        return;
                    }
                };
                let _ = started_tx.send(Ok(()));
                watcher.run(tx);
            })
            .map_err(|e| ServiceError::internal("starting a watch", e))?;
        started_rx
            .await
            .map_err(|_| ServiceError::internal("starting a watch", "its thread ended"))??;
        Ok(Watch {
            events: rx,
            _slot: slot,
        })
    }
}

struct Watcher {
    root: Root,
    inotify: Inotify,
    recursive: bool,
    /// Watched directory (or file) → its path relative to the workspace.
    paths: HashMap<WatchDescriptor, String>,
    /// The watched path itself.
    top: String,
    /// Events found while adding watches, sent first.
    early: Vec<WatchEvent>,
    /// The watch limit was hit (reported once).
    limited: bool,
    last_modify: Option<String>,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        TOTAL_WATCHES.fetch_sub(self.paths.len(), Ordering::SeqCst);
    }
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

fn under(path: &str, dir: &str) -> bool {
    path == dir || path.strip_prefix(dir).is_some_and(|rest| rest.starts_with('/'))
}

impl Watcher {
    fn start(root: Root, rel: &str, recursive: bool) -> Result<Watcher, ServiceError> {
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .map_err(|e| ServiceError::internal("inotify_init", e))?;
        let mut w = Watcher {
            root,
            inotify,
            recursive,
            paths: HashMap::new(),
            top: rel.to_string(),
            early: Vec::new(),
            limited: false,
            last_modify: None,
        };
        let fd = w.root.open_path(rel)?;
        let is_dir = nix::sys::stat::fstat(&fd)
            .map(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR)
            .map_err(|e| ServiceError::internal("fstat", e))?;
        if !is_dir {
            w.add(rel, &fd, false)?;
            return Ok(w);
        }
        w.add(rel, &fd, true)?;
        if recursive {
            w.add_tree(rel, false);
        }
        Ok(w)
    }

    /// One watch, through `fd` (resolved beneath the workspace). False at a limit.
    fn add(&mut self, rel: &str, fd: &impl AsRawFd, dir: bool) -> Result<bool, ServiceError> {
        if self.paths.len() >= MAX_DIRS || TOTAL_WATCHES.fetch_add(1, Ordering::SeqCst) >= MAX_TOTAL_WATCHES {
            if self.paths.len() < MAX_DIRS {
                TOTAL_WATCHES.fetch_sub(1, Ordering::SeqCst);
            }
            if !self.limited {
                self.limited = true;
                self.early.push(WatchEvent::Overflow {
                    reason: format!(
                        "more directories than are watched ({MAX_DIRS} a stream, {MAX_TOTAL_WATCHES} a server): changes in the others are not reported"
                    ),
                });
            }
            return Ok(false);
        }
        let flags = if dir { MASK | AddWatchFlags::IN_ONLYDIR } else { MASK };
        match self
            .inotify
            .add_watch(format!("/proc/self/fd/{}", fd.as_raw_fd()).as_str(), flags)
        {
            Ok(wd) => {
                // A directory already watched (the same inode by two names) keeps one entry.
                if self.paths.insert(wd, rel.to_string()).is_some() {
                    TOTAL_WATCHES.fetch_sub(1, Ordering::SeqCst);
                }
                Ok(true)
            }
            Err(e) => {
                TOTAL_WATCHES.fetch_sub(1, Ordering::SeqCst);
                Err(ServiceError::internal(format!("watching {rel:?}"), e))
            }
        }
    }

    /// Watch the directories beneath `rel` (breadth first, within the limits); with `report`,
    /// what is found there is reported as created (it may have come before the watch).
    fn add_tree(&mut self, rel: &str, report: bool) {
        let mut queue = std::collections::VecDeque::from([rel.to_string()]);
        while let Some(dir) = queue.pop_front() {
            let Ok(listing) = self.root.list(&dir, SCAN_LIMIT) else {
                continue;
            };
            for entry in listing.entries {
                let path = join(&dir, &entry.name);
                let is_dir = entry.kind == EntryKind::Directory;
                if report {
                    self.early.push(WatchEvent::Create {
                        path: path.clone(),
                        dir: is_dir,
                    });
                }
                if !is_dir || self.limited {
                    continue;
                }
                // Gone or swapped meanwhile: nothing to watch there.
                let Ok(fd) = self.root.open_path(&path) else { continue };
                let still_dir = nix::sys::stat::fstat(&fd).is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR);
                if still_dir && matches!(self.add(&path, &fd, true), Ok(true)) {
                    queue.push_back(path);
                }
            }
        }
    }

    /// Stop watching `dir` and what is beneath it (moved out of the tree).
    fn forget(&mut self, dir: &str) {
        let gone: Vec<WatchDescriptor> = self
            .paths
            .iter()
            .filter(|(_, p)| under(p, dir))
            .map(|(wd, _)| *wd)
            .collect();
        for wd in gone {
            let _ = self.inotify.rm_watch(wd);
            self.paths.remove(&wd);
            TOTAL_WATCHES.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn send(&mut self, tx: &mpsc::Sender<WatchEvent>, event: WatchEvent) -> bool {
        if let WatchEvent::Modify { path } = &event {
            // A write loop is one change until something else happens.
            if self.last_modify.as_ref() == Some(path) {
                return true;
            }
            self.last_modify = Some(path.clone());
        } else {
            self.last_modify = None;
        }
        tx.blocking_send(event).is_ok()
    }

    fn flush_early(&mut self, tx: &mpsc::Sender<WatchEvent>) -> bool {
        let early = std::mem::take(&mut self.early);
        early.into_iter().all(|e| self.send(tx, e))
    }

    fn run(&mut self, tx: mpsc::Sender<WatchEvent>) {
        let ready = WatchEvent::Ready {
            watches: self.paths.len(),
        };
        if !self.send(&tx, ready) || !self.flush_early(&tx) {
            return;
        }
        // A MOVED_FROM waiting for its MOVED_TO (they come together, or not at all).
        let mut pending: Option<(u32, String, bool)> = None;
        loop {
            let wait = if pending.is_some() { 20 } else { 500 };
            let mut fds = [libc::pollfd {
                fd: self.inotify.as_fd().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            // SAFETY: one pollfd, pointing at `fds`, whose descriptor we own.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, wait) };
            if tx.is_closed() {
                return;
            }
            if n <= 0 {
                if let Some((_, from, dir)) = pending.take() {
                    if dir {
                        self.forget(&from);
                    }
                    let moved_out = WatchEvent::Move {
                        from: Some(from),
                        to: None,
                        dir,
                    };
                    if !self.send(&tx, moved_out) {
                        return;
                    }
                }
                continue;
            }
            let events = match self.inotify.read_events() {
                Ok(events) => events,
                Err(nix::errno::Errno::EAGAIN) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "reading inotify events");
                    return;
                }
            };
            for event in events {
                for out in self.translate(event, &mut pending) {
                    if !self.send(&tx, out) {
                        return;
                    }
                }
                if !self.flush_early(&tx) {
                    return;
                }
            }
        }
    }

    /// What one inotify event means for the client.
    fn translate(&mut self, event: InotifyEvent, pending: &mut Option<(u32, String, bool)>) -> Vec<WatchEvent> {
        let mask = event.mask;
        if mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
            return vec![WatchEvent::Overflow {
                reason: "the kernel's event queue overflowed: events were lost".into(),
            }];
        }
        if mask.contains(AddWatchFlags::IN_IGNORED) {
            if self.paths.remove(&event.wd).is_some() {
                TOTAL_WATCHES.fetch_sub(1, Ordering::SeqCst);
            }
            return Vec::new();
        }
        let Some(base) = self.paths.get(&event.wd).cloned() else {
            return Vec::new();
        };
        let dir = mask.contains(AddWatchFlags::IN_ISDIR);
        let path = match &event.name {
            Some(name) => join(&base, &name.to_string_lossy()),
            None => base.clone(),
        };
        let mut out = Vec::new();
        // A MOVED_FROM not followed by its MOVED_TO went out of the tree.
        if let Some((cookie, from, from_dir)) = pending.take() {
            if !(mask.contains(AddWatchFlags::IN_MOVED_TO) && event.cookie == cookie) {
                if from_dir {
                    self.forget(&from);
                }
                out.push(WatchEvent::Move {
                    from: Some(from),
                    to: None,
                    dir: from_dir,
                });
            } else {
                // Renamed within the tree: the watches beneath it keep going, under the new name.
                if from_dir {
                    for p in self.paths.values_mut() {
                        if under(p, &from) {
                            *p = format!("{path}{}", &p[from.len()..]);
                        }
                    }
                }
                out.push(WatchEvent::Move {
                    from: Some(from),
                    to: Some(path),
                    dir: from_dir,
                });
                return out;
            }
        }
        if mask.contains(AddWatchFlags::IN_CREATE) {
            out.push(WatchEvent::Create {
                path: path.clone(),
                dir,
            });
            if dir && self.recursive {
                self.add_new_dir(&path);
            }
        } else if mask.contains(AddWatchFlags::IN_MODIFY) {
            out.push(WatchEvent::Modify { path });
        } else if mask.contains(AddWatchFlags::IN_DELETE) {
            out.push(WatchEvent::Delete { path, dir });
        } else if mask.contains(AddWatchFlags::IN_MOVED_FROM) {
            *pending = Some((event.cookie, path, dir));
        } else if mask.contains(AddWatchFlags::IN_MOVED_TO) {
            out.push(WatchEvent::Move {
                from: None,
                to: Some(path.clone()),
                dir,
            });
            if dir && self.recursive {
                self.add_new_dir(&path);
            }
        } else if mask.contains(AddWatchFlags::IN_DELETE_SELF) && path == self.top {
            out.push(WatchEvent::Delete { path, dir: true });
        }
        out
    }

    /// A directory that appeared: watched, with what is already in it reported.
    fn add_new_dir(&mut self, path: &str) {
        let Ok(fd) = self.root.open_path(path) else { return };
        if matches!(self.add(path, &fd, true), Ok(true)) {
            self.add_tree(path, true);
        }
    }
}
