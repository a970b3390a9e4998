//! File operations confined beneath a workspace directory that a sandbox changes at will.
//!
//! The host serves a file API (read, write, list, mkdir, tar upload and download) on a
//! directory that a container runs in at the same time. Every name in that tree is the
//! sandbox's: it can plant symlinks (absolute or relative), swap a directory for a symlink
//! between any two host syscalls, plant FIFOs that would block an `open`, and so on. Checking
//! a path and then opening it by name is therefore always a race the host loses.
//!
//! So nothing here is ever opened by a host path. [`Root`] holds an `O_PATH` descriptor of the
//! workspace and every operation resolves beneath a descriptor with `openat2(2)`:
//!
//! - `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV` for the paths a caller names
//!   (read, write without parents, list, pack): relative symlinks that stay inside are followed,
//!   an absolute symlink or anything that would leave the root fails with `EXDEV`
//!   ([`ConfinedError::Escapes`]), checked by the kernel at every step, so a swap between two
//!   syscalls cannot redirect a resolution.
//! - `RESOLVE_NO_SYMLINKS` on top, one component at a time, whenever the host creates
//!   directories (mkdir -p, write with parents, tar extraction) or walks a tree (tar pack):
//!   a symlink there is refused ([`ConfinedError::IsSymlink`]), never followed.
//! - A final component the host writes is opened `O_NOFOLLOW`; new files use `O_EXCL`.
//! - Anything the host opens for I/O is first looked at through an `O_PATH` descriptor (which
//!   opens nothing) and opened only if that showed a regular file or directory; the real open
//!   uses `O_NONBLOCK | O_NOCTTY` (a FIFO swapped in between cannot block it, a terminal cannot
//!   become ours) and `fstat` on the opened descriptor decides again.
//!
//! Kernels without `openat2` (before 5.6) get [`ConfinedError::Unsupported`]: there is no
//! path-based fallback, because every such fallback is the race this module exists to close.
//!
//! Paths given to the methods are relative to the root: a leading `/` is stripped, empty or
//! `.` names the root, and NUL or any `..` component is refused before any syscall.
//! Descriptors are `O_CLOEXEC` throughout. All methods block: call them from
//! `spawn_blocking` in async code.
//!
//! The parts: [`Root`] here is the API; `path` parses names before any syscall; `resolve`
//! opens beneath a descriptor and holds the checks every operation shares; `unpack` and
//! `pack` are tar upload and download; `walk` measures a tree's disk usage and clears
//! setuid/setgid bits; `remove` removes a tree a sandbox made, whatever its shape.

use std::cell::Cell;
use std::collections::{BinaryHeap, HashMap};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{AtFlags, FcntlArg, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{FileStat, Mode};
use nix::sys::time::TimeSpec;
use nix::unistd::{Gid, Uid, UnlinkatFlags};
use serde::Serialize;

mod pack;
mod path;
mod remove;
mod resolve;
#[cfg(test)]
mod testing;
mod unpack;
mod walk;

use pack::*;
use path::*;
pub use remove::{remove_tree, remove_tree_at};
use resolve::*;
pub use unpack::Source;
use unpack::*;
use walk::*;

/// The largest archive (as uploaded, compressed or not) that [`Root::unpack_tar`] accepts.
pub const MAX_ARCHIVE_BYTES: u64 = 64 << 20;
/// The most members one archive may hold: the validation pass keeps one map entry per path.
pub const MAX_MEMBERS: u64 = 1_000_000;
/// How deep [`Root::pack_tar`] descends: it keeps one descriptor open per level, and a
/// sandbox can nest directories far deeper than a process has descriptors.
pub const MAX_PACK_DEPTH: u64 = 256;

/// `openat2` fails with `EAGAIN` when a rename or mount raced a `..` step of a
/// `RESOLVE_BENEATH` resolution; a sandbox renaming in a loop can make that happen repeatedly.
const OPENAT2_RETRIES: usize = 128;
/// Bound on create/replace loops (`EEXIST` → remove → create) that a sandbox recreating the
/// same name could otherwise keep going forever.
const RACE_RETRIES: usize = 64;

const BENEATH: ResolveFlag = ResolveFlag::RESOLVE_BENEATH
    .union(ResolveFlag::RESOLVE_NO_MAGICLINKS)
    .union(ResolveFlag::RESOLVE_NO_XDEV);
const NO_SYMLINKS: ResolveFlag = BENEATH.union(ResolveFlag::RESOLVE_NO_SYMLINKS);

/// Why a confined operation failed. Everything but [`Io`](Self::Io) and
/// [`Unsupported`](Self::Unsupported) is the caller's (or the sandbox's) doing; paths are
/// relative to the root, so messages can go back to the client without naming host paths.
#[derive(Debug, thiserror::Error)]
pub enum ConfinedError {
    #[error("invalid path {path:?}: {reason}")]
    InvalidPath { path: String, reason: &'static str },
    #[error("{path}: no such file or directory")]
    NotFound { path: String },
    #[error("{path}: path leaves the workspace (through an absolute or escaping symbolic link, or a mount point)")]
    Escapes { path: String },
    #[error("{path}: not a directory (or a parent of it is not)")]
    NotADirectory { path: String },
    #[error("{path}: not a regular file but a {kind}")]
    NotARegularFile { path: String, kind: &'static str },
    #[error("{path}: is or passes through a symbolic link, which is not followed here")]
    IsSymlink { path: String },
    #[error("bad archive member {member:?}: {reason}")]
    BadArchive { member: String, reason: String },
    #[error("{what} is over the limit of {limit}")]
    TooLarge { what: &'static str, limit: u64 },
    #[error("unsupported: {what}")]
    Unsupported { what: &'static str },
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: String,
        #[source]
        source: io::Error,
    },
}

impl ConfinedError {
    /// Whether the request (or the tree the sandbox made) is at fault rather than the host.
    pub fn is_client_error(&self) -> bool {
        !matches!(self, Self::Io { .. } | Self::Unsupported { .. })
    }
}

type Result<T, E = ConfinedError> = std::result::Result<T, E>;

/// The ids given to what the host creates, set with `fchown` on the new descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

/// What [`Root::list`] reports for one name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EntryKind {
    File,
    Directory,
    Symlink,
    /// FIFO, socket or device.
    Other,
}

/// One name of a listed directory, as `fstatat(AT_SYMLINK_NOFOLLOW)` saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct ListEntry {
    /// The name, lossily UTF-8 (a non-UTF-8 name cannot be named back through this API).
    pub name: String,
    #[serde(rename = "type")]
    pub kind: EntryKind,
    pub size: u64,
    /// Permission bits (`0o777`).
    pub mode: u32,
    /// Modification time, seconds since the epoch.
    pub mtime: i64,
    /// A symlink's target as stored (`readlinkat`, never followed), lossily UTF-8.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

/// A directory's entries, sorted by name (bytewise), at most the requested number.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct Listing {
    pub entries: Vec<ListEntry>,
    /// More names than the limit were there.
    pub truncated: bool,
}

/// What [`Root::unpack_tar`] created.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct UnpackReport {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    pub hardlinks: u64,
    /// Bytes of regular-file data written.
    pub bytes: u64,
    /// Members left out because the name was taken ([`UnpackOptions::keep_existing`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub kept: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// How [`Root::unpack_tar_from`] reads an archive and treats what is on disk.
#[derive(Debug, Clone, Copy, Default)]
pub struct UnpackOptions<'a> {
    /// The archive's members are named under this path (`workspace` for `workspace/a/b`),
    /// which is taken off their names; the path itself and its parents name the target
    /// directory, and a member elsewhere is refused.
    pub strip: &'a str,
    /// Whatever holds a member's name on disk stays and the member is left out (counted in
    /// [`UnpackReport::kept`]), where without it a non-directory there is replaced.
    pub keep_existing: bool,
}

impl UnpackOptions<'_> {
    fn strip_components(&self) -> Result<Vec<Vec<u8>>> {
        let rel = RelPath::parse(self.strip)?;
        Ok(rel.comps.iter().map(|c| c.to_vec()).collect())
    }
}

/// What [`Root::pack_tar`] stored and left out.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PackReport {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    /// FIFOs, sockets, devices, and names that changed kind while the walk looked at them.
    pub skipped: u64,
    /// Bytes of regular-file data stored.
    pub bytes: u64,
}

/// What [`Root::clear_setid`] found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SetidReport {
    /// Regular files whose setuid or setgid bit was cleared.
    pub cleared: u64,
    /// Entries looked at.
    pub entries: u64,
    /// Directories deeper than [`MAX_PACK_DEPTH`], mount points and names that changed kind
    /// while the walk looked at them: not entered.
    pub skipped: u64,
}

/// What [`Root::disk_usage`] measured.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DiskUsage {
    /// Bytes charged: each inode's allocated blocks, at least [`MIN_INODE_CHARGE`], a hard
    /// link's inode once.
    pub bytes: u64,
    /// Inodes counted.
    pub entries: u64,
    /// The walk stopped early: `bytes` reached the caller's `stop_at`.
    pub stopped: bool,
    /// Directories nested deeper than [`MAX_PACK_DEPTH`] were found (and not measured).
    pub too_deep: bool,
    /// The first regular file found that is a [`FullFile`] (the walk asked for one), by its
    /// path beneath the root.
    pub full_file: Option<String>,
}

/// A regular file a [`Root::disk_usage_noting`] walk looks out for: of at least `size` bytes,
/// and changed after `since` (its ctime, which a write sets and no one can set back; the
/// kernel stamps it from the coarse clock, `CLOCK_REALTIME_COARSE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FullFile {
    pub size: u64,
    pub since: std::time::SystemTime,
}

/// The least an inode is charged by [`Root::disk_usage`]: one block of a common filesystem,
/// so that a million empty files (a million inodes of the host's filesystem) count.
pub const MIN_INODE_CHARGE: u64 = 4096;

/// A workspace directory, held open; every operation stays beneath it.
pub struct Root {
    fd: OwnedFd,
    path: PathBuf,
}

impl std::fmt::Debug for Root {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Root").field("path", &self.path).finish()
    }
}

impl Root {
    /// Opens the workspace directory `path` (a host path the host chose, so resolved normally,
    /// except that its last component must not be a symlink) and checks that the kernel has
    /// `openat2`.
    pub fn open(path: &Path) -> Result<Root> {
        let shown = path.display().to_string();
        let flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let fd = nix::fcntl::open(path, flags, Mode::empty()).map_err(|e| match e {
            // O_PATH|O_NOFOLLOW opens a symlink itself, which O_DIRECTORY then refuses.
            Errno::ENOTDIR | Errno::ELOOP => ConfinedError::NotADirectory { path: shown.clone() },
            e => errno_error("opening the workspace", &shown, e),
        })?;
        open_beneath(fd.as_fd(), b".", OFlag::O_PATH | OFlag::O_DIRECTORY, 0, BENEATH).map_err(|e| match e {
            // What a seccomp profile that predates openat2 answers for it (older container
            // runtimes' defaults): on "." beneath an open directory nothing else can say EPERM.
            Errno::EPERM => ConfinedError::Unsupported {
                what: "openat2(2), needed to confine file access, is blocked (a seccomp filter?)",
            },
            e => errno_error("opening the workspace", &shown, e),
        })?;
        Ok(Root {
            fd,
            path: path.to_path_buf(),
        })
    }

    /// The host path the root was opened at (for the host's own messages).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// An `O_PATH` descriptor of `rel` (a file or directory), resolved now like a read:
    /// relative symlinks that stay inside are followed, anything leaving the root (an absolute
    /// or escaping link, a mount point) is [`ConfinedError::Escapes`]. What the host mounts
    /// from a workspace is mounted from such a descriptor (`open_tree` on it), never by path:
    /// the sandbox may swap any component for a link between a check and a path-based use.
    pub fn open_path(&self, rel: &str) -> Result<OwnedFd> {
        let rel = RelPath::parse(rel)?;
        open_beneath(self.fd.as_fd(), &rel.joined(), OFlag::O_PATH, 0, BENEATH)
            .map_err(|e| errno_error("resolving", &rel.shown(), e))
    }

    /// Clears the setuid and setgid bits of every regular file in the tree. A sandbox's root
    /// writes a workspace as the workspace's owner (host root for a root-owned one): a
    /// `chmod 4755` there would leave the host a root shell for any local user who can reach
    /// the path. The walk goes through descriptors (`O_NOFOLLOW`, never leaving the
    /// filesystem), and a file's mode is changed through a descriptor of the file itself, so
    /// a name swapped for a link meanwhile cannot turn this onto a host file.
    pub fn clear_setid(&self) -> Result<SetidReport> {
        let mut report = SetidReport::default();
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY;
        let top =
            open_beneath(self.fd.as_fd(), b".", flags, 0, NO_SYMLINKS).map_err(|e| errno_error("opening", ".", e))?;
        let top = Dir::from_fd(top).map_err(|e| errno_error("reading", ".", e))?;
        clear_setid_in(top, "", 0, &mut report)?;
        Ok(report)
    }

    /// The disk space the tree takes, as `du` counts it (allocated blocks, so a sparse file
    /// costs what it holds), but every inode at least [`MIN_INODE_CHARGE`]. Mount points and
    /// what is under them are another filesystem's and not counted. The walk goes through
    /// descriptors and never follows a link; it stops as soon as `stop_at` bytes are counted,
    /// so its cost is bounded by what the caller allows (`stop_at / MIN_INODE_CHARGE`
    /// entries).
    pub fn disk_usage(&self, stop_at: u64) -> Result<DiskUsage> {
        self.disk_usage_noting(stop_at, None)
    }

    /// [`disk_usage`](Self::disk_usage), noting the first regular file that is `full`
    /// ([`DiskUsage::full_file`]).
    pub fn disk_usage_noting(&self, stop_at: u64, full: Option<FullFile>) -> Result<DiskUsage> {
        let mut usage = DiskUsage::default();
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY;
        let top =
            open_beneath(self.fd.as_fd(), b".", flags, 0, NO_SYMLINKS).map_err(|e| errno_error("opening", ".", e))?;
        let st = fstat(top.as_fd(), ".")?;
        let mut walk = UsageWalk {
            dev: st.st_dev,
            stop_at,
            linked: std::collections::HashSet::new(),
            full: full.map(|f| {
                let since = f.since.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
                (f.size, (since.as_secs() as i64, i64::from(since.subsec_nanos())))
            }),
            usage: &mut usage,
        };
        walk.charge(&st);
        let top = Dir::from_fd(top).map_err(|e| errno_error("reading", ".", e))?;
        walk.dir(top, "", 0)?;
        Ok(usage)
    }

    /// Opens a regular file for reading. Relative symlinks that stay inside are followed (the
    /// last component too); anything but a regular file is refused without blocking.
    pub fn open_read(&self, rel: &str) -> Result<File> {
        let rel = RelPath::parse(rel)?;
        let (file, _) = open_checked(
            self.fd.as_fd(),
            &rel.joined(),
            OFlag::O_RDONLY,
            BENEATH,
            false,
            &rel.shown(),
        )?;
        Ok(file)
    }

    /// Creates or truncates the regular file `rel` and writes all of `data` to it; returns the
    /// bytes written.
    ///
    /// With `parents`, missing parent directories are created one by one and every parent must
    /// be a real directory (mkdir -p semantics, as [`create_dir_all`](Self::create_dir_all):
    /// a symlinked parent is [`ConfinedError::IsSymlink`]). Without, the parent is resolved like
    /// a read, following relative symlinks that stay inside. The last component is never
    /// followed: a symlink there is [`ConfinedError::IsSymlink`], a FIFO or device is
    /// [`ConfinedError::NotARegularFile`]. A new file is mode 0644 (less the umask) and gets
    /// `owner`; an existing one keeps its owner and mode.
    pub fn write_file(&self, rel: &str, data: &mut dyn Read, parents: bool, owner: Option<Owner>) -> Result<u64> {
        let rel = RelPath::parse(rel)?;
        let shown = rel.shown();
        let Some((name, parent)) = rel.comps.split_last() else {
            return Err(ConfinedError::InvalidPath {
                path: shown,
                reason: "names the workspace itself, not a file",
            });
        };
        let parent_fd = if parents {
            walk_dirs(self.fd.as_fd(), parent, Some(owner), "")?
        } else {
            open_beneath(
                self.fd.as_fd(),
                &join(parent),
                OFlag::O_PATH | OFlag::O_DIRECTORY,
                0,
                BENEATH,
            )
            .map_err(|e| errno_error("opening the directory of", &shown, e))?
        };
        let mut file = create_or_truncate(parent_fd.as_fd(), name, owner, &shown)?;
        io::copy(data, &mut file).map_err(|source| ConfinedError::Io {
            op: "writing",
            path: shown,
            source,
        })
    }

    /// Creates the directory `rel` and its missing parents (mkdir -p). Existing directories are
    /// fine; an existing non-directory is [`ConfinedError::NotADirectory`] and a symlink
    /// anywhere on the way is [`ConfinedError::IsSymlink`] (never followed). New directories
    /// are mode 0755 (less the umask) and get `owner`.
    pub fn create_dir_all(&self, rel: &str, owner: Option<Owner>) -> Result<()> {
        let rel = RelPath::parse(rel)?;
        walk_dirs(self.fd.as_fd(), &rel.comps, Some(owner), "")?;
        Ok(())
    }

    /// Lists the directory `rel` (relative symlinks that stay inside are followed to reach
    /// it): the `limit` bytewise-smallest names, sorted; `truncated` when there were more.
    /// Memory stays proportional to `limit` however many names the directory holds.
    pub fn list(&self, rel: &str, limit: usize) -> Result<Listing> {
        let rel = RelPath::parse(rel)?;
        let shown = rel.shown();
        let fd = open_beneath(
            self.fd.as_fd(),
            &rel.joined(),
            OFlag::O_RDONLY | OFlag::O_DIRECTORY,
            0,
            BENEATH,
        )
        .map_err(|e| errno_error("opening", &shown, e))?;
        let mut dir = Dir::from_fd(fd).map_err(|e| errno_error("reading", &shown, e))?;
        // A max-heap of the smallest names so far: a sandbox can make millions of names.
        let mut smallest: BinaryHeap<Vec<u8>> = BinaryHeap::new();
        let mut total = 0usize;
        for entry in dir.iter() {
            let entry = entry.map_err(|e| errno_error("reading", &shown, e))?;
            let name = entry.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            total += 1;
            if smallest.len() < limit {
                smallest.push(name.to_vec());
            } else if let Some(largest) = smallest.peek()
                && name < largest.as_slice()
            {
                smallest.pop();
                smallest.push(name.to_vec());
            }
        }
        let mut entries = Vec::with_capacity(smallest.len());
        for name in smallest.into_sorted_vec() {
            let st = match nix::sys::stat::fstatat(dir.as_fd(), name.as_slice(), AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                // Removed since readdir saw it: it is not there to report.
                Err(Errno::ENOENT) => continue,
                Err(e) => return Err(errno_error("inspecting", &child_shown(&shown, &name), e)),
            };
            let kind = match file_type(&st) {
                libc::S_IFREG => EntryKind::File,
                libc::S_IFDIR => EntryKind::Directory,
                libc::S_IFLNK => EntryKind::Symlink,
                _ => EntryKind::Other,
            };
            let target = if kind == EntryKind::Symlink {
                nix::fcntl::readlinkat(dir.as_fd(), name.as_slice())
                    .ok()
                    .map(|t| t.to_string_lossy().into_owned())
            } else {
                None
            };
            entries.push(ListEntry {
                name: String::from_utf8_lossy(&name).into_owned(),
                kind,
                size: u64::try_from(st.st_size).unwrap_or(0),
                mode: st.st_mode & 0o777,
                mtime: st.st_mtime,
                target,
            });
        }
        Ok(Listing {
            entries,
            truncated: total > limit,
        })
    }

    /// Extracts a tar archive (gzip-compressed or not, at most [`MAX_ARCHIVE_BYTES`]) into the
    /// directory `rel`, which is created with its parents if missing.
    ///
    /// A first pass reads every header and refuses the whole archive, before anything is
    /// written, for: a `..` component, a NUL or an empty name; a device or FIFO member;
    /// a sparse or unknown member type; a member beneath an earlier symlink or file member; a
    /// non-directory member over an earlier directory; a hard link whose target is not an
    /// earlier regular-file member; more than `max_bytes` of file data (so a gzip bomb is
    /// refused after decompressing at most `max_bytes` + [`MAX_ARCHIVE_BYTES`]) or more than
    /// [`MAX_MEMBERS`] members. A leading `/` is stripped from names (as GNU tar does); pax
    /// global headers are skipped; `./` is the target directory itself.
    ///
    /// The second pass creates members one by one beneath the target's descriptor: parents
    /// must be real directories (a symlink on disk where a parent should be is refused, never
    /// followed); an existing non-directory at a member's path is removed first (a planted
    /// symlink is replaced, not followed) while an existing directory stays as it is. Modes
    /// keep only the 0777 bits; files get their archived mtime; everything created gets
    /// `owner`. What the disk holds is only known in this pass, so a conflict with it (a
    /// directory where a file member goes, a symlink where a parent should be) stops the
    /// extraction with the members before it already in place.
    pub fn unpack_tar(&self, rel: &str, archive: &[u8], owner: Option<Owner>, max_bytes: u64) -> Result<UnpackReport> {
        if archive.len() as u64 > MAX_ARCHIVE_BYTES {
            return Err(ConfinedError::TooLarge {
                what: "the archive (bytes)",
                limit: MAX_ARCHIVE_BYTES,
            });
        }
        self.unpack_tar_from(rel, Source::Bytes(archive), owner, max_bytes, UnpackOptions::default())
    }

    /// [`Root::unpack_tar`] of an archive of any size read from `source` (twice: the check,
    /// then the extraction), with `options`. A file source is one the host wrote (a snapshot's
    /// workspace read from containerd), never one a sandbox can change.
    pub fn unpack_tar_from(
        &self,
        rel: &str,
        source: Source<'_>,
        owner: Option<Owner>,
        max_bytes: u64,
        options: UnpackOptions<'_>,
    ) -> Result<UnpackReport> {
        let rel = RelPath::parse(rel)?;
        validate_archive(source, max_bytes, &options)?;
        let dir = walk_dirs(self.fd.as_fd(), &rel.comps, Some(owner), "")?;
        extract_archive(dir, &rel.shown(), source, owner, max_bytes, &options)
    }

    /// Writes a tar (GNU format) of `rel` to `out`: a directory's contents recursively, named
    /// relative to it (sorted by name, the directory itself not included), or a single
    /// regular file under its own name. `rel` itself is resolved like a read.
    ///
    /// The walk is descriptor-relative and never follows a symlink: symlinks are stored as
    /// symlinks; FIFOs, sockets and devices are left out (counted in
    /// [`PackReport::skipped`]) without being opened. A file's header carries its size when
    /// it was opened and exactly that many bytes follow (zeros if it shrank, cut if it grew).
    /// Deeper than [`MAX_PACK_DEPTH`] directories is an error. On an error the output holds a
    /// partial archive.
    pub fn pack_tar(&self, rel: &str, out: &mut dyn Write) -> Result<PackReport> {
        let rel = RelPath::parse(rel)?;
        let shown = rel.shown();
        let (file, st) = open_checked(self.fd.as_fd(), &rel.joined(), OFlag::O_RDONLY, BENEATH, true, &shown)?;
        let mut builder = tar::Builder::new(out);
        let mut report = PackReport::default();
        if file_type(&st) == libc::S_IFDIR {
            let dir = Dir::from_fd(file.into()).map_err(|e| errno_error("reading", &shown, e))?;
            pack_dir(&mut builder, dir, b"", &shown, 1, &mut report)?;
        } else {
            // A regular file is never the root, so it has a last component.
            let name = rel.comps.last().copied().unwrap_or(b"file");
            pack_file(&mut builder, file, &st, name, &shown, &mut report)?;
        }
        builder.into_inner().map_err(|source| ConfinedError::Io {
            op: "writing the archive of",
            path: shown,
            source,
        })?;
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::confined::testing::*;

    #[test]
    fn dotdot_and_nul_in_a_path_are_refused_by_every_operation() {
        let fx = Fixture::new();
        fx.mkdir("a");
        for bad in ["..", "../outside/secret", "a/../../outside", "a/..", "a\0b"] {
            assert_err(fx.read(bad), "InvalidPath");
            assert_err(fx.write(bad, b"x", true), "InvalidPath");
            assert_err(fx.root.list(bad, 10), "InvalidPath");
            assert_err(fx.root.create_dir_all(bad, None), "InvalidPath");
            assert_err(fx.root.unpack_tar(bad, &tarball(&[]), None, MIB), "InvalidPath");
            assert_err(fx.pack(bad), "InvalidPath");
            fx.assert_outside_unchanged();
        }
    }

    #[test]
    fn empty_slash_and_dot_all_name_the_root() {
        let fx = Fixture::new();
        fx.put("f", b"1");
        for rel in ["", "/", ".", "./", "//./"] {
            let listing = fx.root.list(rel, 10).unwrap();
            assert_eq!(listing.entries.len(), 1, "{rel:?}");
        }
        let e = assert_err(fx.write("/", b"x", false), "InvalidPath");
        assert!(e.is_client_error());
        assert_eq!(fx.read("//f").unwrap(), b"1");
    }

    #[test]
    fn root_open_refuses_a_symlink_or_a_file() {
        let fx = Fixture::new();
        symlink(fx.rp(), fx.tmp.path().join("rootlink")).unwrap();
        assert_err(Root::open(&fx.tmp.path().join("rootlink")), "NotADirectory");
        assert_err(Root::open(&fx.tmp.path().join("beside")), "NotADirectory");
        assert_err(Root::open(&fx.tmp.path().join("missing")), "NotFound");
    }

    // ---- planted symlinks

    #[test]
    fn planted_symlinks_never_lead_outside_at_any_position() {
        // Where the symlink sits (first, middle or last component of the paths used) and how
        // many directories deep its parent is.
        for (at, depth) in [("L", 0), ("a/L", 1), ("a/b/L", 2)] {
            let up = |n: usize| "../".repeat(n);
            let fx = Fixture::new();
            let dir_targets = [
                // (target, the secret's path relative to it)
                (fx.outside().display().to_string(), "secret"),
                (format!("{}outside", up(depth + 1)), "secret"),
                (up(depth + 2), "ws/outside/secret"),
                (format!("{}outside/", up(depth + 1)), "sub/secret"),
            ];
            for (target, secret) in dir_targets {
                let fx = Fixture::new();
                fx.mkdir("a/b");
                fx.link(at, &target);
                let through = format!("{at}/{secret}");
                let new = format!("{at}/new/deeper");
                let case = format!("{at} -> {target}");
                let check = |result: Result<()>, expected: &str| {
                    let e = result.expect_err(&case);
                    assert_eq!(variant(&e), expected, "{case}: {e}");
                    assert!(e.is_client_error());
                    fx.assert_outside_unchanged();
                };
                check(fx.read(&through).map(drop), "Escapes");
                check(fx.read(at).map(drop), "Escapes");
                check(fx.write(&through, b"pwned", false).map(drop), "Escapes");
                check(fx.write(&through, b"pwned", true).map(drop), "IsSymlink");
                check(fx.write(&format!("{at}/new"), b"pwned", false).map(drop), "Escapes");
                check(fx.write(&new, b"pwned", true).map(drop), "IsSymlink");
                check(fx.write(at, b"pwned", false).map(drop), "IsSymlink");
                check(fx.write(at, b"pwned", true).map(drop), "IsSymlink");
                check(fx.root.list(at, 100).map(drop), "Escapes");
                check(fx.root.list(&format!("{at}/sub"), 100).map(drop), "Escapes");
                check(fx.root.create_dir_all(at, None), "IsSymlink");
                check(fx.root.create_dir_all(&new, None), "IsSymlink");
                let archive = tarball(&[file_m("secret", b"pwned"), file_m("only-outside", b"pwned")]);
                check(fx.root.unpack_tar(at, &archive, None, MIB).map(drop), "IsSymlink");
                check(fx.root.unpack_tar(&new, &archive, None, MIB).map(drop), "IsSymlink");
                check(fx.pack(at).map(drop), "Escapes");
                check(fx.pack(&through).map(drop), "Escapes");
                // Packing what holds the symlink stores the link, never what it points to.
                let (archive, report) = fx.pack("").unwrap();
                assert_eq!(report.symlinks, 1, "{case}");
                let link = members_of(&archive)
                    .into_iter()
                    .find(|m| m.1 == tar::EntryType::Symlink);
                assert_eq!(link.unwrap().3.as_deref(), Some(target.as_str()), "{case}");
                fx.assert_outside_unchanged();
            }
            // A symlink to the secret file itself, as the last component.
            for target in [
                fx.outside().join("secret").display().to_string(),
                format!("{}outside/secret", up(depth + 1)),
            ] {
                let fx = Fixture::new();
                fx.mkdir("a/b");
                fx.link(at, &target);
                assert_err(fx.read(at), "Escapes");
                assert_err(fx.write(at, b"pwned", false), "IsSymlink");
                assert_err(fx.write(at, b"pwned", true), "IsSymlink");
                assert_err(fx.root.list(at, 10), "Escapes");
                assert_err(fx.root.create_dir_all(at, None), "IsSymlink");
                assert_err(fx.root.unpack_tar(at, &tarball(&[]), None, MIB), "IsSymlink");
                assert_err(fx.pack(at), "Escapes");
                fx.assert_outside_unchanged();
            }
        }
    }

    #[test]
    fn in_root_relative_symlinks_are_followed_for_read_write_and_list() {
        let fx = Fixture::new();
        fx.mkdir("sub");
        fx.mkdir("a");
        fx.put("sub/f", b"hello");
        fx.link("link", "sub");
        // Up and back down, staying inside: RESOLVE_BENEATH allows `..` that does not leave.
        fx.link("a/up", "../sub");
        fx.link("a/f", "../sub/f");
        assert_eq!(fx.read("link/f").unwrap(), b"hello");
        assert_eq!(fx.read("a/up/f").unwrap(), b"hello");
        assert_eq!(fx.read("a/f").unwrap(), b"hello");
        assert_eq!(fx.write("link/g", b"world", false).unwrap(), 5);
        assert_eq!(fs::read(fx.rp().join("sub/g")).unwrap(), b"world");
        assert_eq!(fx.write("a/up/h", b"!", false).unwrap(), 1);
        assert_eq!(fs::read(fx.rp().join("sub/h")).unwrap(), b"!");
        let names: Vec<_> = fx
            .root
            .list("link", 10)
            .unwrap()
            .entries
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert_eq!(names, ["f", "g", "h"]);
        let (archive, _) = fx.pack("a/up").unwrap();
        assert_eq!(members_of(&archive).len(), 3);
        fx.assert_outside_unchanged();
    }

    #[test]
    fn creating_parents_never_goes_through_a_symlink_even_one_that_stays_inside() {
        let fx = Fixture::new();
        fx.mkdir("sub");
        fx.link("link", "sub");
        assert_err(fx.write("link/g", b"x", true), "IsSymlink");
        assert_err(fx.root.create_dir_all("link/d", None), "IsSymlink");
        assert_err(
            fx.root.unpack_tar("link", &tarball(&[file_m("f", b"x")]), None, MIB),
            "IsSymlink",
        );
        assert!(fs::read_dir(fx.rp().join("sub")).unwrap().next().is_none());
    }

    #[test]
    fn a_symlink_as_the_last_component_is_never_written_through() {
        let fx = Fixture::new();
        fx.put("target", b"keep");
        fx.link("in", "target");
        fx.link("dangling", "nowhere");
        assert_err(fx.write("in", b"changed", false), "IsSymlink");
        assert_err(fx.write("dangling", b"changed", false), "IsSymlink");
        assert_eq!(fs::read(fx.rp().join("target")).unwrap(), b"keep");
        assert!(!fx.rp().join("nowhere").exists());
    }

    // ---- write, read, mkdir, list

    #[test]
    fn write_creates_or_truncates_and_gives_only_new_files_and_dirs_the_owner() {
        let fx = Fixture::new();
        let owner = Some(Owner { uid: 4321, gid: 8765 });
        let n = fx
            .root
            .write_file("p/q/f", &mut &b"long content"[..], true, owner)
            .unwrap();
        assert_eq!(n, 12);
        for rel in ["p", "p/q", "p/q/f"] {
            let m = fs::metadata(fx.rp().join(rel)).unwrap();
            assert_eq!((m.uid(), m.gid()), (4321, 8765), "{rel}");
        }
        fx.put("old", b"a much longer old content");
        fx.root.write_file("old", &mut &b"short"[..], false, owner).unwrap();
        assert_eq!(fs::read(fx.rp().join("old")).unwrap(), b"short");
        assert_eq!(fs::metadata(fx.rp().join("old")).unwrap().uid(), 0);
        assert_err(fx.write("missing/f", b"x", false), "NotFound");
        assert_err(fx.write("old/f", b"x", false), "NotADirectory");
        assert_err(fx.write("old/f", b"x", true), "NotADirectory");
        assert_err(fx.write("p", b"x", false), "NotARegularFile");
    }

    #[test]
    fn a_fifo_where_a_write_or_read_goes_is_refused_without_blocking() {
        let fx = Fixture::new();
        nix::unistd::mkfifo(&fx.rp().join("fifo"), Mode::from_bits_truncate(0o666)).unwrap();
        let root = fx.root.clone();
        let results = within_5s(move || {
            let w = root.write_file("fifo", &mut &b"x"[..], false, None).map(drop);
            let wp = root.write_file("fifo", &mut &b"x"[..], true, None).map(drop);
            let r = root.open_read("fifo").map(drop);
            let l = root.list("fifo", 1).map(drop);
            let p = root.pack_tar("fifo", &mut Vec::new()).map(drop);
            [w, wp, r, l, p]
        });
        let [w, wp, r, l, p] = results;
        assert_err(w, "NotARegularFile");
        assert_err(wp, "NotARegularFile");
        assert_err(r, "NotARegularFile");
        assert_err(l, "NotADirectory");
        let e = assert_err(p, "NotARegularFile");
        assert!(e.to_string().contains("FIFO"), "{e}");
    }

    #[test]
    fn a_fifo_with_a_reader_attached_is_still_refused_for_writing() {
        let fx = Fixture::new();
        let path = fx.rp().join("fifo");
        nix::unistd::mkfifo(&path, Mode::from_bits_truncate(0o666)).unwrap();
        // The sandbox holds the read end open: the non-blocking open then succeeds.
        let _reader = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
            .unwrap();
        let root = fx.root.clone();
        let w = within_5s(move || root.write_file("fifo", &mut &b"x"[..], false, None));
        assert_err(w, "NotARegularFile");
    }

    use std::os::unix::fs::OpenOptionsExt;

    #[test]
    fn create_dir_all_makes_missing_parents_with_the_owner_and_refuses_files_in_the_way() {
        let fx = Fixture::new();
        fx.mkdir("have");
        fx.root
            .create_dir_all("have/new/deeper", Some(Owner { uid: 7, gid: 9 }))
            .unwrap();
        assert_eq!(fs::metadata(fx.rp().join("have")).unwrap().uid(), 0);
        let m = fs::metadata(fx.rp().join("have/new/deeper")).unwrap();
        assert!(m.is_dir());
        assert_eq!((m.uid(), m.gid()), (7, 9));
        fx.root.create_dir_all("have/new/deeper", None).unwrap();
        fx.root.create_dir_all("", None).unwrap();
        fx.put("file", b"");
        assert_err(fx.root.create_dir_all("file", None), "NotADirectory");
        assert_err(fx.root.create_dir_all("file/sub", None), "NotADirectory");
    }

    #[test]
    fn list_is_sorted_limited_and_reports_kinds_sizes_modes_and_link_targets() {
        let fx = Fixture::new();
        fx.mkdir("d/sub");
        fx.put("d/b", b"12345");
        fs::set_permissions(fx.rp().join("d/b"), fs::Permissions::from_mode(0o4751)).unwrap();
        fx.link("d/a", fx.outside());
        nix::unistd::mkfifo(&fx.rp().join("d/c"), Mode::from_bits_truncate(0o600)).unwrap();
        let all = fx.root.list("d", 10).unwrap();
        assert!(!all.truncated);
        let summary: Vec<_> = all.entries.iter().map(|e| (e.name.as_str(), e.kind)).collect();
        assert_eq!(
            summary,
            [
                ("a", EntryKind::Symlink),
                ("b", EntryKind::File),
                ("c", EntryKind::Other),
                ("sub", EntryKind::Directory)
            ]
        );
        assert_eq!(all.entries[0].target.as_deref(), Some(fx.outside().to_str().unwrap()));
        assert_eq!((all.entries[1].size, all.entries[1].mode), (5, 0o751));
        assert!(all.entries[1].mtime > 1_600_000_000);
        let two = fx.root.list("d", 2).unwrap();
        assert!(two.truncated);
        assert_eq!(two.entries, all.entries[..2]);
        let none = fx.root.list("d", 0).unwrap();
        assert!(none.truncated && none.entries.is_empty());
        assert_err(fx.root.list("d/b", 10), "NotADirectory");
        assert_err(fx.root.list("missing", 10), "NotFound");
    }

    #[test]
    fn read_refuses_directories() {
        let fx = Fixture::new();
        fx.mkdir("d");
        let e = assert_err(fx.read("d"), "NotARegularFile");
        assert!(e.to_string().contains("directory"), "{e}");
        assert_err(fx.read(""), "NotARegularFile");
    }

    // ---- unpack

    #[test]
    fn only_io_and_unsupported_are_the_hosts_fault() {
        let io = ConfinedError::Io {
            op: "reading",
            path: "f".into(),
            source: io::Error::other("disk on fire"),
        };
        assert!(!io.is_client_error());
        assert!(!ConfinedError::Unsupported { what: "openat2" }.is_client_error());
        assert!(ConfinedError::Escapes { path: "l".into() }.is_client_error());
        assert_eq!(
            ConfinedError::Escapes { path: "l/x".into() }.to_string(),
            "l/x: path leaves the workspace (through an absolute or escaping symbolic link, or a mount point)"
        );
    }

    #[test]
    fn open_path_follows_links_inside_and_refuses_ones_leaving() {
        let fx = Fixture::new();
        let rp = fx.rp();
        fs::create_dir_all(rp.join("data/sub")).unwrap();
        symlink("data", rp.join("alias")).unwrap();
        symlink(fx.outside(), rp.join("abs")).unwrap();
        symlink("../outside", rp.join("rel")).unwrap();
        let inode = |fd: OwnedFd| nix::sys::stat::fstat(fd.as_fd()).unwrap().st_ino;
        let sub = fs::metadata(rp.join("data/sub")).unwrap().ino();
        assert_eq!(inode(fx.root.open_path("data/sub").unwrap()), sub);
        assert_eq!(inode(fx.root.open_path("alias/sub").unwrap()), sub);
        for bad in ["abs", "abs/sub", "rel/sub"] {
            let e = fx.root.open_path(bad).unwrap_err();
            assert!(matches!(e, ConfinedError::Escapes { .. }), "{bad}: {e}");
        }
        assert!(matches!(
            fx.root.open_path("data/none").unwrap_err(),
            ConfinedError::NotFound { .. }
        ));
    }

    /// A thread swaps `root/d` between a real directory and symlinks leaving the root
    /// (absolute and relative) with `RENAME_EXCHANGE`, as fast as it can, while every
    /// operation runs against `d` a thousand times. Whatever each one sees, nothing outside
    /// may change and no outside content may come back.
    #[test]
    fn racing_swaps_of_a_directory_for_an_escaping_symlink_never_let_an_operation_out() {
        let mut fx = Fixture::new();
        // Setuid files outside: a sweep that followed a swapped link would clear their bits.
        for name in ["secret", "x", "only-outside"] {
            fs::set_permissions(fx.outside().join(name), fs::Permissions::from_mode(0o4755)).unwrap();
        }
        fx.before = fx.snapshot();
        let rp = fx.rp();
        fs::create_dir(rp.join("d")).unwrap();
        fs::write(rp.join("d/x"), b"inside").unwrap();
        symlink(fx.outside(), rp.join("dabs")).unwrap();
        symlink("../outside", rp.join("drel")).unwrap();

        let stop = Arc::new(AtomicBool::new(false));
        let flipper = {
            let stop = stop.clone();
            let dir = File::open(&rp).unwrap();
            thread::spawn(move || {
                let mut flips = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    // Four exchanges bring `d` back to the directory.
                    for other in ["dabs", "dabs", "drel", "drel"] {
                        nix::fcntl::renameat2(&dir, "d", &dir, other, nix::fcntl::RenameFlags::RENAME_EXCHANGE)
                            .unwrap();
                        flips += 1;
                    }
                }
                flips
            })
        };

        let archive = tarball(&[dir_m("u"), file_m("u/f", b"unpacked")]);
        let ops = ["write", "read", "list", "mkdir", "unpack", "pack", "setid", "path"];
        let mut tally: BTreeMap<&str, (u64, BTreeMap<&'static str, u64>)> = BTreeMap::new();
        let started = Instant::now();
        for _ in 0..1000 {
            for op in ops {
                let result: Result<()> = match op {
                    "write" => fx.write("d/x", b"inside-data", true).map(drop),
                    "read" => fx.read("d/x").map(drop),
                    "list" => fx.root.list("d", 100).map(|l| {
                        for e in l.entries {
                            assert!(e.name != "secret" && e.name != "only-outside", "listed outside");
                        }
                    }),
                    "mkdir" => fx.root.create_dir_all("d/a/b", None),
                    "unpack" => fx.root.unpack_tar("d", &archive, None, MIB).map(drop),
                    "setid" => fx.root.clear_setid().map(drop),
                    "path" => fx.root.open_path("d/x").map(drop),
                    _ => fx.pack("d").map(|(bytes, _)| {
                        assert!(!bytes.windows(12).any(|w| w == b"only-outside"), "packed outside");
                    }),
                };
                let entry = tally.entry(op).or_default();
                match result {
                    Ok(()) => entry.0 += 1,
                    Err(e) => {
                        assert!(e.is_client_error(), "{op}: {e}");
                        *entry.1.entry(variant(&e)).or_default() += 1;
                    }
                }
            }
            fx.assert_outside_unchanged();
        }
        stop.store(true, Ordering::Relaxed);
        let flips = flipper.join().unwrap();
        let elapsed = started.elapsed();
        eprintln!("race: {flips} swaps in {elapsed:?}");
        for (op, (ok, refused)) in &tally {
            eprintln!("race: {op:>6}: {ok:>4} succeeded, refused {refused:?}");
        }
        fx.assert_outside_unchanged();
        let succeeded: u64 = tally.values().map(|t| t.0).sum();
        let refused: u64 = tally.values().flat_map(|t| t.1.values()).sum();
        assert!(flips > 0 && succeeded > 0 && refused > 0, "the race was not exercised");
    }
}
