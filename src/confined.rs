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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
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
        let mut usage = DiskUsage::default();
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY;
        let top =
            open_beneath(self.fd.as_fd(), b".", flags, 0, NO_SYMLINKS).map_err(|e| errno_error("opening", ".", e))?;
        let st = fstat(top.as_fd(), ".")?;
        let mut walk = UsageWalk {
            dev: st.st_dev,
            stop_at,
            linked: std::collections::HashSet::new(),
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
        let rel = RelPath::parse(rel)?;
        validate_archive(archive, max_bytes)?;
        let dir = walk_dirs(self.fd.as_fd(), &rel.comps, Some(owner), "")?;
        extract_archive(dir, &rel.shown(), archive, owner, max_bytes)
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

/// A caller's path, split into components with `..`, NUL and empty components dealt with.
struct RelPath<'a> {
    comps: Vec<&'a [u8]>,
}

impl<'a> RelPath<'a> {
    fn parse(rel: &'a str) -> Result<Self> {
        let comps = split_components(rel.as_bytes()).map_err(|reason| ConfinedError::InvalidPath {
            path: rel.to_string(),
            reason,
        })?;
        Ok(RelPath { comps })
    }

    fn joined(&self) -> Vec<u8> {
        join(&self.comps)
    }

    fn shown(&self) -> String {
        String::from_utf8_lossy(&self.joined()).into_owned()
    }
}

/// Splits a relative name; leading, doubled and trailing `/` and `.` components vanish.
fn split_components(raw: &[u8]) -> Result<Vec<&[u8]>, &'static str> {
    if raw.contains(&0) {
        return Err("contains a NUL byte");
    }
    let mut comps = Vec::new();
    for comp in raw.split(|&b| b == b'/') {
        match comp {
            b"" | b"." => {}
            b".." => return Err("has a `..` component"),
            comp => comps.push(comp),
        }
    }
    Ok(comps)
}

/// Components joined with `/`; `.` (the starting directory) when there are none.
fn join<C: AsRef<[u8]>>(comps: &[C]) -> Vec<u8> {
    if comps.is_empty() {
        return b".".to_vec();
    }
    let mut out = Vec::new();
    for (i, comp) in comps.iter().enumerate() {
        if i > 0 {
            out.push(b'/');
        }
        out.extend_from_slice(comp.as_ref());
    }
    out
}

fn child_shown(parent: &str, name: &[u8]) -> String {
    let name = String::from_utf8_lossy(name);
    if parent.is_empty() || parent == "." {
        name.into_owned()
    } else {
        format!("{parent}/{name}")
    }
}

/// `openat2` beneath `dir`, always `O_CLOEXEC`, retrying the `EAGAIN` a concurrent rename can
/// cause (bounded).
fn open_beneath(
    dir: BorrowedFd<'_>,
    path: &[u8],
    flags: OFlag,
    mode: u32,
    resolve: ResolveFlag,
) -> nix::Result<OwnedFd> {
    let mut how = OpenHow::new().flags(flags | OFlag::O_CLOEXEC).resolve(resolve);
    // The kernel refuses a mode without O_CREAT.
    if flags.contains(OFlag::O_CREAT) {
        how = how.mode(Mode::from_bits_truncate(mode));
    }
    let mut tries = 0;
    loop {
        match nix::fcntl::openat2(dir, path, how) {
            Err(Errno::EAGAIN | Errno::EINTR) if tries < OPENAT2_RETRIES => tries += 1,
            result => return result,
        }
    }
}

/// The error for a failed syscall on `path`: the caller's faults get their own variants.
fn errno_error(op: &'static str, path: &str, e: Errno) -> ConfinedError {
    let path = path.to_string();
    match e {
        Errno::ENOENT => ConfinedError::NotFound { path },
        Errno::EXDEV => ConfinedError::Escapes { path },
        Errno::ENOTDIR => ConfinedError::NotADirectory { path },
        Errno::ELOOP => ConfinedError::IsSymlink { path },
        Errno::EISDIR => ConfinedError::NotARegularFile {
            path,
            kind: "directory",
        },
        // A FIFO without a reader opened for writing, or a socket.
        Errno::ENXIO => ConfinedError::NotARegularFile {
            path,
            kind: "FIFO or socket",
        },
        Errno::ENAMETOOLONG => ConfinedError::InvalidPath {
            path,
            reason: "a name is too long",
        },
        Errno::ENOSYS => ConfinedError::Unsupported {
            what: "openat2(2), needed to confine file access, is missing (Linux 5.6 or later has it)",
        },
        e => ConfinedError::Io {
            op,
            path,
            source: e.into(),
        },
    }
}

fn file_type(st: &FileStat) -> libc::mode_t {
    st.st_mode & libc::S_IFMT
}

fn kind_name(st: &FileStat) -> &'static str {
    match file_type(st) {
        libc::S_IFREG => "regular file",
        libc::S_IFDIR => "directory",
        libc::S_IFLNK => "symbolic link",
        libc::S_IFIFO => "FIFO",
        libc::S_IFSOCK => "socket",
        libc::S_IFCHR => "character device",
        libc::S_IFBLK => "block device",
        _ => "file of unknown type",
    }
}

/// Refuses anything but a regular file (or, with `allow_dir`, a directory).
fn check_kind(st: &FileStat, allow_dir: bool, shown: &str) -> Result<()> {
    match file_type(st) {
        libc::S_IFREG => Ok(()),
        libc::S_IFDIR if allow_dir => Ok(()),
        libc::S_IFLNK => Err(ConfinedError::IsSymlink {
            path: shown.to_string(),
        }),
        _ => Err(ConfinedError::NotARegularFile {
            path: shown.to_string(),
            kind: kind_name(st),
        }),
    }
}

fn fstat(fd: BorrowedFd<'_>, shown: &str) -> Result<FileStat> {
    nix::sys::stat::fstat(fd).map_err(|e| errno_error("inspecting", shown, e))
}

/// Opens `path` beneath `dir` for I/O only if it is a regular file (or a directory, with
/// `allow_dir`). An `O_PATH` look first, because opening is itself an action on a device
/// (a tape rewinds, a terminal becomes ours); then the real open with `O_NONBLOCK` (a FIFO
/// swapped in meanwhile cannot block it) and `fstat` on the opened descriptor, which is what
/// counts. `O_NONBLOCK` is cleared again afterwards.
fn open_checked(
    dir: BorrowedFd<'_>,
    path: &[u8],
    flags: OFlag,
    resolve: ResolveFlag,
    allow_dir: bool,
    shown: &str,
) -> Result<(File, FileStat)> {
    let probe = open_beneath(dir, path, OFlag::O_PATH | (flags & OFlag::O_NOFOLLOW), 0, resolve)
        .map_err(|e| errno_error("opening", shown, e))?;
    check_kind(&fstat(probe.as_fd(), shown)?, allow_dir, shown)?;
    drop(probe);
    let fd = open_beneath(dir, path, flags | OFlag::O_NONBLOCK | OFlag::O_NOCTTY, 0, resolve)
        .map_err(|e| errno_error("opening", shown, e))?;
    let st = fstat(fd.as_fd(), shown)?;
    check_kind(&st, allow_dir, shown)?;
    clear_nonblock(fd.as_fd(), shown)?;
    Ok((File::from(fd), st))
}

fn clear_nonblock(fd: BorrowedFd<'_>, shown: &str) -> Result<()> {
    let bits = nix::fcntl::fcntl(fd, FcntlArg::F_GETFL).map_err(|e| errno_error("configuring", shown, e))?;
    let flags = OFlag::from_bits_retain(bits) - OFlag::O_NONBLOCK;
    nix::fcntl::fcntl(fd, FcntlArg::F_SETFL(flags)).map_err(|e| errno_error("configuring", shown, e))?;
    Ok(())
}

fn chown_fd(fd: BorrowedFd<'_>, owner: Option<Owner>, shown: &str) -> Result<()> {
    if let Some(o) = owner {
        nix::unistd::fchown(fd, Some(Uid::from_raw(o.uid)), Some(Gid::from_raw(o.gid)))
            .map_err(|e| errno_error("changing the owner of", shown, e))?;
    }
    Ok(())
}

fn chmod_fd(fd: BorrowedFd<'_>, mode: u32, shown: &str) -> Result<()> {
    // Only permission bits: setuid/setgid/sticky from an upload are never honoured.
    nix::sys::stat::fchmod(fd, Mode::from_bits_truncate(mode & 0o777))
        .map_err(|e| errno_error("changing the mode of", shown, e))
}

/// The write side of [`Root::write_file`]: a new file with `O_EXCL` (so it is ours and
/// regular), else the existing one, which must be a regular file, truncated.
fn create_or_truncate(parent: BorrowedFd<'_>, name: &[u8], owner: Option<Owner>, shown: &str) -> Result<File> {
    let create =
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_NOCTTY;
    for _ in 0..RACE_RETRIES {
        match open_beneath(parent, name, create, 0o644, BENEATH) {
            Ok(fd) => {
                check_kind(&fstat(fd.as_fd(), shown)?, false, shown)?;
                chown_fd(fd.as_fd(), owner, shown)?;
                clear_nonblock(fd.as_fd(), shown)?;
                return Ok(File::from(fd));
            }
            Err(Errno::EEXIST) => {}
            Err(e) => return Err(errno_error("creating", shown, e)),
        }
        // Something is there (O_EXCL counts a dangling symlink too): open it without following.
        match open_checked(parent, name, OFlag::O_WRONLY | OFlag::O_NOFOLLOW, BENEATH, false, shown) {
            Ok((file, _)) => {
                // O_TRUNC only now that fstat said regular file: truncation is an action.
                file.set_len(0).map_err(|source| ConfinedError::Io {
                    op: "truncating",
                    path: shown.to_string(),
                    source,
                })?;
                return Ok(file);
            }
            // Removed since: create it after all.
            Err(ConfinedError::NotFound { .. }) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(busy("creating", shown))
}

fn busy(op: &'static str, shown: &str) -> ConfinedError {
    ConfinedError::Io {
        op,
        path: shown.to_string(),
        source: io::Error::other("the name kept changing under concurrent modification"),
    }
}

/// Walks `comps` beneath `start` one real directory at a time (`RESOLVE_NO_SYMLINKS`, a
/// single component per `openat2`, so a symlink anywhere is refused rather than followed),
/// creating what is missing when `create` is `Some(owner)`. Returns the last directory open
/// for reading. `base` prefixes the path in messages.
fn walk_dirs(start: BorrowedFd<'_>, comps: &[&[u8]], create: Option<Option<Owner>>, base: &str) -> Result<OwnedFd> {
    let mut shown = base.to_string();
    let mut cur = open_beneath(start, b".", OFlag::O_RDONLY | OFlag::O_DIRECTORY, 0, BENEATH)
        .map_err(|e| errno_error("opening", if shown.is_empty() { "." } else { &shown }, e))?;
    for comp in comps {
        shown = child_shown(&shown, comp);
        cur = step_dir(cur.as_fd(), comp, create, &shown)?;
    }
    Ok(cur)
}

/// Opens (or with `create`, makes) the real directory `name` in `cur`.
fn step_dir(cur: BorrowedFd<'_>, name: &[u8], create: Option<Option<Owner>>, shown: &str) -> Result<OwnedFd> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW;
    for _ in 0..RACE_RETRIES {
        match open_beneath(cur, name, flags, 0, NO_SYMLINKS) {
            Ok(fd) => return Ok(fd),
            Err(Errno::ENOENT) if create.is_some() => {}
            Err(e) => return Err(not_a_dir_error(cur, name, shown, e)),
        }
        match nix::sys::stat::mkdirat(cur, name, Mode::from_bits_truncate(0o755)) {
            Ok(()) => {}
            // Made by someone else meanwhile: look again.
            Err(Errno::EEXIST) => continue,
            Err(e) => return Err(errno_error("creating the directory", shown, e)),
        }
        match open_beneath(cur, name, flags, 0, NO_SYMLINKS) {
            Ok(fd) => {
                chown_fd(fd.as_fd(), create.flatten(), shown)?;
                return Ok(fd);
            }
            Err(Errno::ENOENT) => continue,
            Err(e) => return Err(not_a_dir_error(cur, name, shown, e)),
        }
    }
    Err(busy("creating the directory", shown))
}

/// The error for a failed `O_DIRECTORY | O_NOFOLLOW` open of one component. The kernel says
/// `ENOTDIR` rather than `ELOOP` for a symlink there (`O_DIRECTORY` is checked first), so a
/// look without following tells a symlink from a file.
fn not_a_dir_error(cur: BorrowedFd<'_>, name: &[u8], shown: &str, e: Errno) -> ConfinedError {
    if e == Errno::ENOTDIR
        && let Ok(st) = nix::sys::stat::fstatat(cur, name, AtFlags::AT_SYMLINK_NOFOLLOW)
        && file_type(&st) == libc::S_IFLNK
    {
        return ConfinedError::IsSymlink {
            path: shown.to_string(),
        };
    }
    errno_error("opening", shown, e)
}

// ---- tar extraction

/// A member as both passes see it.
struct Member {
    /// The name as archived, for messages.
    shown: String,
    comps: Vec<Vec<u8>>,
    kind: MemberKind,
    mode: u32,
    mtime: u64,
    size: u64,
}

enum MemberKind {
    File,
    Dir,
    Symlink(Vec<u8>),
    HardLink(Vec<Vec<u8>>),
    /// A pax global header, or `./`: nothing to create.
    Skip,
}

/// What pass one remembers of each path the archive makes, to refuse members that would go
/// through a symlink or a file member, or replace a directory.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Made {
    Dir,
    File,
    Symlink,
}

/// Reads the archive (through gzip when it starts with the gzip magic), failing once more than
/// `cap` bytes came out, and noting so in `over`: a tar error then means the cap.
struct Capped<'a> {
    inner: Box<dyn Read + 'a>,
    left: u64,
    over: Rc<Cell<bool>>,
}

impl Read for Capped<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n as u64 > self.left {
            self.over.set(true);
            return Err(io::Error::other("decompressed archive over the limit"));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

fn tar_stream(archive: &[u8], max_bytes: u64, over: Rc<Cell<bool>>) -> tar::Archive<Capped<'_>> {
    let inner: Box<dyn Read + '_> = if archive.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::read::MultiGzDecoder::new(archive))
    } else {
        Box::new(archive)
    };
    tar::Archive::new(Capped {
        inner,
        // File data plus room for headers and padding: headers alone cannot make a bomb.
        left: max_bytes.saturating_add(MAX_ARCHIVE_BYTES),
        over,
    })
}

/// A failure while reading the stream: the cap, or a corrupt archive.
fn stream_error(over: &Cell<bool>, max_bytes: u64, after: &str, e: io::Error) -> ConfinedError {
    if over.get() {
        return ConfinedError::TooLarge {
            what: "the extracted data (bytes)",
            limit: max_bytes,
        };
    }
    ConfinedError::BadArchive {
        member: after.to_string(),
        reason: format!("unreadable archive: {e}"),
    }
}

fn bad(member: &str, reason: impl Into<String>) -> ConfinedError {
    ConfinedError::BadArchive {
        member: member.to_string(),
        reason: reason.into(),
    }
}

fn read_member<R: Read>(entry: &tar::Entry<'_, R>) -> Result<Member> {
    let header = entry.header();
    let raw = entry.path_bytes();
    let shown = String::from_utf8_lossy(&raw).into_owned();
    let ty = header.entry_type();
    let mut member = Member {
        shown: shown.clone(),
        comps: Vec::new(),
        kind: MemberKind::Skip,
        mode: 0,
        mtime: header.mtime().unwrap_or(0),
        size: entry.size(),
    };
    if ty == tar::EntryType::XGlobalHeader {
        return Ok(member);
    }
    if raw.is_empty() {
        return Err(bad(&shown, "empty name"));
    }
    member.comps = split_components(&raw)
        .map_err(|reason| bad(&shown, reason))?
        .into_iter()
        .map(<[u8]>::to_vec)
        .collect();
    let link = || -> Result<Vec<u8>> {
        match entry.link_name_bytes() {
            Some(t) if !t.is_empty() && !t.contains(&0) => Ok(t.into_owned()),
            _ => Err(bad(&shown, "link without a valid target")),
        }
    };
    member.kind = match ty {
        // Old archives mark directories with a trailing slash only.
        tar::EntryType::Regular | tar::EntryType::Continuous if raw.ends_with(b"/") => MemberKind::Dir,
        tar::EntryType::Regular | tar::EntryType::Continuous => MemberKind::File,
        tar::EntryType::Directory => MemberKind::Dir,
        tar::EntryType::Symlink => MemberKind::Symlink(link()?),
        tar::EntryType::Link => {
            let target = link()?;
            let comps =
                split_components(&target).map_err(|reason| bad(&shown, format!("hard link target {reason}")))?;
            MemberKind::HardLink(comps.into_iter().map(<[u8]>::to_vec).collect())
        }
        tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo => {
            return Err(bad(&shown, "device nodes and FIFOs are not extracted"));
        }
        tar::EntryType::GNUSparse => return Err(bad(&shown, "sparse files are not supported")),
        other => {
            return Err(bad(
                &shown,
                format!("unsupported member type {:?}", char::from(other.as_byte())),
            ));
        }
    };
    // Only files and directories get a mode; links have none worth refusing an archive over.
    if matches!(member.kind, MemberKind::File | MemberKind::Dir) {
        member.mode = header.mode().map_err(|e| bad(&shown, e.to_string()))?;
    }
    if member.comps.is_empty() {
        if matches!(member.kind, MemberKind::Dir) {
            // `./`: the target directory itself, which exists already.
            member.kind = MemberKind::Skip;
        } else {
            return Err(bad(&shown, "names the target directory itself"));
        }
    }
    Ok(member)
}

/// Pass one: every header, before anything is written.
fn validate_archive(archive: &[u8], max_bytes: u64) -> Result<()> {
    let over = Rc::new(Cell::new(false));
    let mut tar = tar_stream(archive, max_bytes, over.clone());
    let entries = tar
        .entries()
        .map_err(|e| stream_error(&over, max_bytes, "(start)", e))?;
    let mut made: HashMap<Vec<u8>, Made> = HashMap::new();
    let (mut count, mut bytes) = (0u64, 0u64);
    let mut last = String::from("(start)");
    for entry in entries {
        let entry = entry.map_err(|e| stream_error(&over, max_bytes, &format!("(after {last})"), e))?;
        let m = read_member(&entry)?;
        last = m.shown.clone();
        count += 1;
        if count > MAX_MEMBERS {
            return Err(ConfinedError::TooLarge {
                what: "the number of members",
                limit: MAX_MEMBERS,
            });
        }
        if matches!(m.kind, MemberKind::Skip) {
            continue;
        }
        for depth in 1..m.comps.len() {
            let prefix = join(&m.comps[..depth]);
            match made.get(&prefix) {
                None => {
                    made.insert(prefix, Made::Dir);
                }
                Some(Made::Dir) => {}
                Some(Made::Symlink) => {
                    return Err(bad(
                        &m.shown,
                        format!(
                            "goes through the symbolic link member {:?}, which is never followed",
                            String::from_utf8_lossy(&prefix)
                        ),
                    ));
                }
                Some(Made::File) => {
                    return Err(bad(
                        &m.shown,
                        format!(
                            "goes through the file member {:?}, which is not a directory",
                            String::from_utf8_lossy(&prefix)
                        ),
                    ));
                }
            }
        }
        let path = join(&m.comps);
        let now = match &m.kind {
            MemberKind::Dir => Made::Dir,
            MemberKind::File => {
                bytes = bytes.saturating_add(m.size);
                if bytes > max_bytes {
                    return Err(ConfinedError::TooLarge {
                        what: "the extracted data (bytes)",
                        limit: max_bytes,
                    });
                }
                Made::File
            }
            MemberKind::Symlink(_) => Made::Symlink,
            MemberKind::HardLink(target) => {
                let target = join(target);
                if target == path || made.get(&target) != Some(&Made::File) {
                    return Err(bad(
                        &m.shown,
                        format!(
                            "hard link target {:?} is not an earlier regular file member",
                            String::from_utf8_lossy(&target)
                        ),
                    ));
                }
                Made::File
            }
            MemberKind::Skip => continue,
        };
        if now != Made::Dir && made.get(&path) == Some(&Made::Dir) {
            return Err(bad(&m.shown, "would replace a directory member"));
        }
        made.insert(path, now);
    }
    Ok(())
}

/// Pass two: members one by one beneath `dir`.
fn extract_archive(
    dir: OwnedFd,
    base: &str,
    archive: &[u8],
    owner: Option<Owner>,
    max_bytes: u64,
) -> Result<UnpackReport> {
    let base = if base == "." { "" } else { base };
    let over = Rc::new(Cell::new(false));
    let mut tar = tar_stream(archive, max_bytes, over.clone());
    let entries = tar
        .entries()
        .map_err(|e| stream_error(&over, max_bytes, "(start)", e))?;
    let mut report = UnpackReport::default();
    // Consecutive members mostly share a parent: keep its descriptor.
    let mut parent_cache: Option<(Vec<Vec<u8>>, OwnedFd)> = None;
    let mut last = String::from("(start)");
    for entry in entries {
        let mut entry = entry.map_err(|e| stream_error(&over, max_bytes, &format!("(after {last})"), e))?;
        let m = read_member(&entry)?;
        last = m.shown.clone();
        let Some((name, parent_comps)) = m.comps.split_last() else {
            continue;
        };
        if matches!(m.kind, MemberKind::Skip) {
            continue;
        }
        let shown = child_shown(base, &join(&m.comps));
        let parent = match parent_cache.take() {
            Some((comps, fd)) if comps.as_slice() == parent_comps => fd,
            _ => {
                let comps: Vec<&[u8]> = parent_comps.iter().map(Vec::as_slice).collect();
                walk_dirs(dir.as_fd(), &comps, Some(owner), base)?
            }
        };
        let p = parent.as_fd();
        match &m.kind {
            MemberKind::Dir => {
                extract_dir(p, name, &m, owner, &shown)?;
                report.dirs += 1;
            }
            MemberKind::File => {
                let fd = create_fresh(p, name, &m, &shown, |p, name| {
                    open_beneath(
                        p,
                        name,
                        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_NOCTTY,
                        0o600,
                        NO_SYMLINKS,
                    )
                })?;
                chown_fd(fd.as_fd(), owner, &shown)?;
                let mut file = File::from(fd);
                let written = io::copy(&mut (&mut entry).take(m.size), &mut file).map_err(|e| {
                    if over.get() {
                        stream_error(&over, max_bytes, &m.shown, e)
                    } else {
                        ConfinedError::Io {
                            op: "writing",
                            path: shown.clone(),
                            source: e,
                        }
                    }
                })?;
                report.bytes += written;
                // Pass one checked the declared sizes; this holds whatever the stream does.
                if report.bytes > max_bytes {
                    return Err(ConfinedError::TooLarge {
                        what: "the extracted data (bytes)",
                        limit: max_bytes,
                    });
                }
                chmod_fd(file.as_fd(), m.mode, &shown)?;
                let mtime = TimeSpec::new(i64::try_from(m.mtime).unwrap_or(i64::MAX), 0);
                nix::sys::stat::futimens(file.as_fd(), &TimeSpec::UTIME_OMIT, &mtime)
                    .map_err(|e| errno_error("setting the time of", &shown, e))?;
                report.files += 1;
            }
            MemberKind::Symlink(target) => {
                create_fresh(p, name, &m, &shown, |p, name| {
                    nix::unistd::symlinkat(target.as_slice(), p, name)
                })?;
                if owner.is_some() {
                    chown_symlink(p, name, owner, &shown)?;
                }
                report.symlinks += 1;
            }
            MemberKind::HardLink(target) => {
                let (tname, tparent) = target
                    .split_last()
                    .ok_or_else(|| bad(&m.shown, "empty hard link target"))?;
                let tshown = child_shown(base, &join(target));
                // The target was validated as an earlier file member; resolve its directory
                // without symlinks so a planted one cannot point the link elsewhere.
                let tdir = open_beneath(
                    dir.as_fd(),
                    &join(tparent),
                    OFlag::O_PATH | OFlag::O_DIRECTORY,
                    0,
                    NO_SYMLINKS,
                )
                .map_err(|e| errno_error("opening the directory of", &tshown, e))?;
                create_fresh(p, name, &m, &shown, |p, name| {
                    // No AT_SYMLINK_FOLLOW: a symlink swapped in is linked, not followed.
                    nix::unistd::linkat(tdir.as_fd(), tname.as_slice(), p, name, AtFlags::empty())
                })?;
                report.hardlinks += 1;
            }
            MemberKind::Skip => {}
        }
        parent_cache = Some((parent_comps.to_vec(), parent));
    }
    Ok(report)
}

/// Creates a non-directory member with `make`, which fails with `EEXIST` when the name is
/// taken: then whatever non-directory is there is removed (a planted symlink is unlinked,
/// never followed) and `make` runs again. An existing directory stays and is an error.
fn create_fresh<T>(
    parent: BorrowedFd<'_>,
    name: &[u8],
    m: &Member,
    shown: &str,
    mut make: impl FnMut(BorrowedFd<'_>, &[u8]) -> nix::Result<T>,
) -> Result<T> {
    for _ in 0..RACE_RETRIES {
        match make(parent, name) {
            Ok(made) => return Ok(made),
            Err(Errno::EEXIST) => remove_non_dir(parent, name, m, shown)?,
            Err(e) => return Err(errno_error("creating", shown, e)),
        }
    }
    Err(busy("creating", shown))
}

fn remove_non_dir(parent: BorrowedFd<'_>, name: &[u8], m: &Member, shown: &str) -> Result<()> {
    let in_the_way = || bad(&m.shown, "a directory exists at this path");
    match nix::sys::stat::fstatat(parent, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) if file_type(&st) == libc::S_IFDIR => return Err(in_the_way()),
        Ok(_) => {}
        Err(Errno::ENOENT) => return Ok(()),
        Err(e) => return Err(errno_error("inspecting", shown, e)),
    }
    match nix::unistd::unlinkat(parent, name, UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => Ok(()),
        Err(Errno::EISDIR) => Err(in_the_way()),
        Err(e) => Err(errno_error("removing", shown, e)),
    }
}

fn extract_dir(parent: BorrowedFd<'_>, name: &[u8], m: &Member, owner: Option<Owner>, shown: &str) -> Result<()> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW;
    for _ in 0..RACE_RETRIES {
        match open_beneath(parent, name, flags, 0, NO_SYMLINKS) {
            // An existing directory stays as it is.
            Ok(_) => return Ok(()),
            Err(Errno::ENOENT) => {}
            // A non-directory (a symlink included) is in the way: it goes.
            Err(Errno::ELOOP | Errno::ENOTDIR) => remove_non_dir(parent, name, m, shown)?,
            Err(e) => return Err(errno_error("opening", shown, e)),
        }
        match nix::sys::stat::mkdirat(parent, name, Mode::from_bits_truncate(0o700)) {
            Ok(()) => {}
            Err(Errno::EEXIST) => continue,
            Err(e) => return Err(errno_error("creating the directory", shown, e)),
        }
        match open_beneath(parent, name, flags, 0, NO_SYMLINKS) {
            Ok(fd) => {
                chown_fd(fd.as_fd(), owner, shown)?;
                return chmod_fd(fd.as_fd(), m.mode, shown);
            }
            Err(Errno::ENOENT) => continue,
            Err(e) => return Err(errno_error("opening", shown, e)),
        }
    }
    Err(busy("creating the directory", shown))
}

/// Gives a just-made symlink its owner through an `O_PATH` descriptor of the link itself
/// (`AT_EMPTY_PATH`), so the change never lands on whatever a link points to.
fn chown_symlink(parent: BorrowedFd<'_>, name: &[u8], owner: Option<Owner>, shown: &str) -> Result<()> {
    let Some(o) = owner else { return Ok(()) };
    let fd = open_beneath(parent, name, OFlag::O_PATH | OFlag::O_NOFOLLOW, 0, NO_SYMLINKS)
        .map_err(|e| errno_error("opening", shown, e))?;
    if file_type(&fstat(fd.as_fd(), shown)?) != libc::S_IFLNK {
        // Replaced since we made it: not ours to chown.
        return Ok(());
    }
    nix::unistd::fchownat(
        fd.as_fd(),
        "",
        Some(Uid::from_raw(o.uid)),
        Some(Gid::from_raw(o.gid)),
        AtFlags::AT_EMPTY_PATH | AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .map_err(|e| errno_error("changing the owner of", shown, e))
}

// ---- tar packing

type Builder<'a> = tar::Builder<&'a mut dyn Write>;

fn header(st: &FileStat, kind: tar::EntryType, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(st.st_mode & 0o777);
    h.set_uid(u64::from(st.st_uid));
    h.set_gid(u64::from(st.st_gid));
    h.set_mtime(u64::try_from(st.st_mtime).unwrap_or(0));
    h.set_size(size);
    h
}

fn archive_io(shown: &str) -> impl FnOnce(io::Error) -> ConfinedError + '_ {
    move |source| ConfinedError::Io {
        op: "archiving",
        path: shown.to_string(),
        source,
    }
}

fn pack_file(
    builder: &mut Builder<'_>,
    file: File,
    st: &FileStat,
    member: &[u8],
    shown: &str,
    report: &mut PackReport,
) -> Result<()> {
    let size = u64::try_from(st.st_size).unwrap_or(0);
    let mut h = header(st, tar::EntryType::Regular, size);
    let data = Exactly {
        inner: file,
        left: size,
        ended: false,
    };
    builder
        .append_data(&mut h, Path::new(std::ffi::OsStr::from_bytes(member)), data)
        .map_err(archive_io(shown))?;
    report.files += 1;
    report.bytes += size;
    Ok(())
}

/// Stores `dir`'s entries under `prefix`, recursing into subdirectories through descriptors.
fn pack_dir(
    builder: &mut Builder<'_>,
    mut dir: Dir,
    prefix: &[u8],
    shown: &str,
    depth: u64,
    report: &mut PackReport,
) -> Result<()> {
    if depth > MAX_PACK_DEPTH {
        return Err(ConfinedError::TooLarge {
            what: "the directory depth",
            limit: MAX_PACK_DEPTH,
        });
    }
    let mut names = Vec::new();
    for entry in dir.iter() {
        let entry = entry.map_err(|e| errno_error("reading", shown, e))?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(name.to_vec());
        }
    }
    names.sort();
    let fd = dir.as_fd();
    for name in names {
        let child = child_shown(shown, &name);
        let mut member = prefix.to_vec();
        member.extend_from_slice(&name);
        // A look that opens nothing first: devices, FIFOs and sockets are never opened.
        let st = match nix::sys::stat::fstatat(fd, name.as_slice(), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::ENOENT) => continue,
            Err(e) => return Err(errno_error("inspecting", &child, e)),
        };
        match file_type(&st) {
            libc::S_IFLNK => match nix::fcntl::readlinkat(fd, name.as_slice()) {
                Ok(target) => {
                    let mut h = header(&st, tar::EntryType::Symlink, 0);
                    builder
                        .append_link(&mut h, Path::new(std::ffi::OsStr::from_bytes(&member)), target)
                        .map_err(archive_io(&child))?;
                    report.symlinks += 1;
                }
                // Removed or no longer a symlink (EINVAL) since the look.
                Err(Errno::ENOENT | Errno::EINVAL) => report.skipped += 1,
                Err(e) => return Err(errno_error("reading the link", &child, e)),
            },
            libc::S_IFDIR => {
                let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW;
                let sub = match open_beneath(fd, &name, flags, 0, NO_SYMLINKS) {
                    Ok(sub) => sub,
                    Err(e) if changed_meanwhile(e) => {
                        report.skipped += 1;
                        continue;
                    }
                    Err(e) => return Err(errno_error("opening", &child, e)),
                };
                let st = fstat(sub.as_fd(), &child)?;
                member.push(b'/');
                let mut h = header(&st, tar::EntryType::Directory, 0);
                builder
                    .append_data(&mut h, Path::new(std::ffi::OsStr::from_bytes(&member)), io::empty())
                    .map_err(archive_io(&child))?;
                report.dirs += 1;
                let sub = Dir::from_fd(sub).map_err(|e| errno_error("reading", &child, e))?;
                pack_dir(builder, sub, &member, &child, depth + 1, report)?;
            }
            libc::S_IFREG => {
                let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_NOCTTY;
                let file = match open_beneath(fd, &name, flags, 0, NO_SYMLINKS) {
                    Ok(file) => file,
                    Err(e) if changed_meanwhile(e) => {
                        report.skipped += 1;
                        continue;
                    }
                    Err(e) => return Err(errno_error("opening", &child, e)),
                };
                let st = fstat(file.as_fd(), &child)?;
                if file_type(&st) != libc::S_IFREG {
                    report.skipped += 1;
                    continue;
                }
                pack_file(builder, File::from(file), &st, &member, &child, report)?;
            }
            _ => report.skipped += 1,
        }
    }
    Ok(())
}

/// The state of one [`Root::disk_usage`] walk.
struct UsageWalk<'a> {
    dev: u64,
    stop_at: u64,
    /// Inodes with more than one link, counted once.
    linked: std::collections::HashSet<u64>,
    usage: &'a mut DiskUsage,
}

impl UsageWalk<'_> {
    fn charge(&mut self, st: &FileStat) {
        if st.st_nlink > 1 && file_type(st) != libc::S_IFDIR && !self.linked.insert(st.st_ino) {
            return;
        }
        let blocks = u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512);
        self.usage.bytes = self.usage.bytes.saturating_add(blocks.max(MIN_INODE_CHARGE));
        self.usage.entries += 1;
        if self.usage.bytes >= self.stop_at {
            self.usage.stopped = true;
        }
    }

    fn dir(&mut self, mut dir: Dir, shown: &str, depth: u64) -> Result<()> {
        let mut names = Vec::new();
        for entry in dir.iter() {
            let entry = entry.map_err(|e| errno_error("reading", shown, e))?;
            let name = entry.file_name().to_bytes();
            if name != b"." && name != b".." {
                names.push(name.to_vec());
            }
        }
        let fd = dir.as_fd();
        for name in names {
            if self.usage.stopped {
                return Ok(());
            }
            let st = match nix::sys::stat::fstatat(fd, name.as_slice(), AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                Err(e) if changed_meanwhile(e) => continue,
                Err(e) => return Err(errno_error("inspecting", &child_shown(shown, &name), e)),
            };
            if st.st_dev != self.dev {
                continue;
            }
            self.charge(&st);
            if file_type(&st) != libc::S_IFDIR {
                continue;
            }
            if depth >= MAX_PACK_DEPTH {
                self.usage.too_deep = true;
                continue;
            }
            let child = child_shown(shown, &name);
            let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW;
            let sub = match open_beneath(fd, &name, flags, 0, NO_SYMLINKS) {
                Ok(sub) => sub,
                Err(e) if changed_meanwhile(e) => continue,
                Err(e) => return Err(errno_error("opening", &child, e)),
            };
            let sub = Dir::from_fd(sub).map_err(|e| errno_error("reading", &child, e))?;
            self.dir(sub, &child, depth + 1)?;
        }
        Ok(())
    }
}

/// The most operations one [`remove_tree_at`] does: a sandbox still running could refill a
/// tree as fast as it is emptied.
const REMOVE_BUDGET: u64 = 50_000_000;

/// Removes `name` in the directory `parent` with everything under it: the removal of a tree a
/// sandbox made, which may be anything (15,000 levels deep, a million entries wide, links
/// everywhere, a name swapped meanwhile).
///
/// Iterative and through descriptors: one descriptor open at a time and a list of pending
/// names per level, whatever the depth (std's `remove_dir_all` recurses, and a deep enough
/// tree overflows the stack: a crash of the server, and of every later `runner gc`); never a
/// path longer than one name. It climbs back through `..`, checked to be the directory it came
/// from (a directory moved elsewhere meanwhile stops the removal rather than leading it out of
/// the tree). Symlinks are removed, never followed; a mount point (another filesystem, or a
/// bind) is never entered or removed: the removal then fails, leaving it (and its parents) in
/// place.
pub fn remove_tree_at(parent: BorrowedFd<'_>, name: &[u8]) -> io::Result<()> {
    let mut budget = REMOVE_BUDGET;
    // Another remover (two teardowns of one container) may take a directory from under this
    // one: it then starts again from the top, where what is left is found.
    for _ in 0..REMOVE_RESTARTS {
        match remove_once(parent, name, &mut budget)? {
            Removal::Done => return Ok(()),
            Removal::Restart => continue,
        }
    }
    Err(io::Error::other("the tree kept changing while it was removed"))
}

/// How one pass of [`remove_tree_at`] ended.
enum Removal {
    Done,
    /// The directory being emptied was removed by someone else.
    Restart,
}

/// Passes of [`remove_tree_at`] at most.
const REMOVE_RESTARTS: usize = 8;

fn remove_once(parent: BorrowedFd<'_>, name: &[u8], budget: &mut u64) -> io::Result<Removal> {
    let not_found_is_done = |r: nix::Result<()>| match r {
        Ok(()) | Err(Errno::ENOENT) => Ok(Removal::Done),
        Err(e) => Err(io::Error::from(e)),
    };
    let st = match nix::sys::stat::fstatat(parent, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(Errno::ENOENT) => return Ok(Removal::Done),
        Err(e) => return Err(e.into()),
    };
    if file_type(&st) != libc::S_IFDIR {
        return not_found_is_done(nix::unistd::unlinkat(parent, name, UnlinkatFlags::NoRemoveDir));
    }
    struct Level {
        ino: u64,
        pending: Vec<Vec<u8>>,
        rescans: u32,
    }
    let mut first_error: Option<io::Error> = None;
    let mut cur = match open_subdir(parent, name) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Ok(Removal::Done),
        Err(e) => return Err(e.into()),
    };
    let top = nix::sys::stat::fstat(cur.as_fd())?;
    let pending = empty_level(cur.as_fd(), budget, &mut first_error)?;
    let mut stack = vec![Level {
        ino: top.st_ino,
        pending,
        rescans: 0,
    }];
    let dev = top.st_dev;
    loop {
        let level = stack.last_mut().expect("a level");
        if let Some(sub) = level.pending.pop() {
            match open_subdir(cur.as_fd(), &sub) {
                Ok(child) => {
                    let st = nix::sys::stat::fstat(child.as_fd())?;
                    if st.st_dev != dev {
                        first_error.get_or_insert_with(|| io::Error::other("a mount point in the tree"));
                        continue;
                    }
                    let pending = empty_level(child.as_fd(), budget, &mut first_error)?;
                    stack.push(Level {
                        ino: st.st_ino,
                        pending,
                        rescans: 0,
                    });
                    cur = child;
                }
                Err(Errno::ENOENT) => {}
                // Swapped for a link or a file since the look: removed as what it is now.
                Err(Errno::ELOOP | Errno::ENOTDIR) => {
                    not_found_is_done(nix::unistd::unlinkat(
                        cur.as_fd(),
                        sub.as_slice(),
                        UnlinkatFlags::NoRemoveDir,
                    ))?;
                }
                Err(Errno::EXDEV) => {
                    first_error.get_or_insert_with(|| io::Error::other("a mount point in the tree"));
                }
                Err(e) => return Err(e.into()),
            }
            continue;
        }
        // Everything listed is gone or failed; what was added meanwhile (and the emptied
        // subdirectories) is found by looking again, a few times at most.
        if level.rescans < 3 {
            level.rescans += 1;
            let again = empty_level(cur.as_fd(), budget, &mut first_error)?;
            if !again.is_empty() {
                stack.last_mut().expect("a level").pending = again;
                continue;
            }
        }
        if stack.len() == 1 {
            drop(cur);
            if let Some(e) = first_error {
                return Err(e);
            }
            return not_found_is_done(nix::unistd::unlinkat(parent, name, UnlinkatFlags::RemoveDir));
        }
        let up = match nix::fcntl::openat(
            cur.as_fd(),
            "..",
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        ) {
            Ok(up) => up,
            // A removed directory has no `..` any more.
            Err(Errno::ENOENT) => return Ok(Removal::Restart),
            Err(e) => return Err(e.into()),
        };
        let st = nix::sys::stat::fstat(up.as_fd())?;
        stack.pop();
        let expected = stack.last().expect("a parent level").ino;
        if st.st_ino != expected || st.st_dev != dev {
            return Err(io::Error::other("the tree was moved while it was being removed"));
        }
        cur = up;
        // The directory just emptied is removed by this level's next look.
        stack.last_mut().expect("a level").rescans = 0;
    }
}

/// [`remove_tree_at`] for a host path the host chose (its parent is resolved normally; its
/// last component is not followed).
pub fn remove_tree(path: &Path) -> io::Result<()> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "no parent or name to remove",
        ));
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let dir = match nix::fcntl::open(
        parent,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    remove_tree_at(dir.as_fd(), name.as_bytes())
}

/// A subdirectory opened without following a link or crossing a mount point.
fn open_subdir(dir: BorrowedFd<'_>, name: &[u8]) -> nix::Result<OwnedFd> {
    open_beneath(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW,
        0,
        NO_SYMLINKS,
    )
}

/// One look at a directory during [`remove_tree_at`]: what is not a directory is unlinked,
/// empty directories are removed; the names of the others are returned.
fn empty_level(dir: BorrowedFd<'_>, budget: &mut u64, first_error: &mut Option<io::Error>) -> io::Result<Vec<Vec<u8>>> {
    let dup = nix::unistd::dup(dir)?;
    let mut listing = Dir::from_fd(dup)?;
    let mut names = Vec::new();
    for entry in listing.iter() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(name.to_vec());
        }
    }
    drop(listing);
    let mut pending = Vec::new();
    for name in names {
        *budget = budget.checked_sub(1).ok_or_else(|| {
            io::Error::other("the tree keeps changing while it is removed (is its sandbox still running?)")
        })?;
        let st = match nix::sys::stat::fstatat(dir, name.as_slice(), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::ENOENT) => continue,
            Err(e) => return Err(e.into()),
        };
        if file_type(&st) != libc::S_IFDIR {
            match nix::unistd::unlinkat(dir, name.as_slice(), UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => {}
                // Became a directory since the look.
                Err(Errno::EISDIR) => pending.push(name),
                Err(e) => return Err(e.into()),
            }
            continue;
        }
        match nix::unistd::unlinkat(dir, name.as_slice(), UnlinkatFlags::RemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => {}
            Err(Errno::ENOTEMPTY | Errno::EEXIST) => pending.push(name),
            // A mount point: never removed from here.
            Err(Errno::EBUSY) => {
                first_error.get_or_insert_with(|| io::Error::other("a mount point in the tree"));
            }
            Err(Errno::ENOTDIR) => {
                nix::unistd::unlinkat(dir, name.as_slice(), UnlinkatFlags::NoRemoveDir).ok();
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(pending)
}

/// [`Root::clear_setid`] for one directory, recursing through descriptors.
fn clear_setid_in(mut dir: Dir, shown: &str, depth: u64, report: &mut SetidReport) -> Result<()> {
    let mut names = Vec::new();
    for entry in dir.iter() {
        let entry = entry.map_err(|e| errno_error("reading", shown, e))?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(name.to_vec());
        }
    }
    let mut subdirs = Vec::new();
    let mut setid = Vec::new();
    for name in names {
        report.entries += 1;
        let st = match nix::sys::stat::fstatat(dir.as_fd(), name.as_slice(), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(e) if changed_meanwhile(e) => continue,
            Err(e) => return Err(errno_error("inspecting", &child_shown(shown, &name), e)),
        };
        match file_type(&st) {
            libc::S_IFDIR => subdirs.push(name),
            libc::S_IFREG if st.st_mode & (libc::S_ISUID | libc::S_ISGID) != 0 => setid.push(name),
            _ => {}
        }
    }
    let fd = dir.as_fd();
    for name in setid {
        let child = child_shown(shown, &name);
        let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_NOCTTY;
        let file = match open_beneath(fd, &name, flags, 0, NO_SYMLINKS) {
            Ok(file) => file,
            Err(e) if changed_meanwhile(e) => {
                report.skipped += 1;
                continue;
            }
            Err(e) => return Err(errno_error("opening", &child, e)),
        };
        let st = fstat(file.as_fd(), &child)?;
        if file_type(&st) == libc::S_IFREG && st.st_mode & (libc::S_ISUID | libc::S_ISGID) != 0 {
            chmod_fd(file.as_fd(), st.st_mode & 0o1777, &child)?;
            report.cleared += 1;
        }
    }
    for name in subdirs {
        let child = child_shown(shown, &name);
        if depth >= MAX_PACK_DEPTH {
            report.skipped += 1;
            continue;
        }
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW;
        let sub = match open_beneath(fd, &name, flags, 0, NO_SYMLINKS) {
            Ok(sub) => sub,
            // A mount point (EXDEV) is another filesystem's, not the workspace's.
            Err(e) if changed_meanwhile(e) => {
                report.skipped += 1;
                continue;
            }
            Err(e) => return Err(errno_error("opening", &child, e)),
        };
        let sub = Dir::from_fd(sub).map_err(|e| errno_error("reading", &child, e))?;
        clear_setid_in(sub, &child, depth + 1, report)?;
    }
    Ok(())
}

/// Errors that only mean the name became something else between the look and the open.
fn changed_meanwhile(e: Errno) -> bool {
    matches!(
        e,
        Errno::ENOENT | Errno::ELOOP | Errno::ENOTDIR | Errno::ENXIO | Errno::EXDEV
    )
}

/// Yields exactly `left` bytes: the file's own while it has them, then zeros, so a file that
/// shrinks or grows while it is read cannot disagree with the size already in its header.
struct Exactly<R> {
    inner: R,
    left: u64,
    ended: bool,
}

impl<R: Read> Read for Exactly<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let want = usize::try_from(self.left).unwrap_or(usize::MAX).min(buf.len());
        if want == 0 {
            return Ok(0);
        }
        if !self.ended {
            let n = self.inner.read(&mut buf[..want])?;
            if n > 0 {
                self.left -= n as u64;
                return Ok(n);
            }
            self.ended = true;
        }
        buf[..want].fill(0);
        self.left -= want as u64;
        Ok(want)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::fs;
    use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc;
    use std::thread;
    use std::time::{Duration, Instant};

    const SECRET: &[u8] = b"TOP-SECRET-outside-the-workspace";

    /// `tmp/ws/root` is the workspace; `tmp/ws/outside` (with secrets), `tmp/beside` and the
    /// directories themselves are everything an escape could touch.
    struct Fixture {
        tmp: tempfile::TempDir,
        root: Arc<Root>,
        before: BTreeMap<PathBuf, String>,
    }

    impl Fixture {
        fn new() -> Fixture {
            let tmp = tempfile::tempdir().unwrap();
            let ws = tmp.path().join("ws");
            fs::create_dir_all(ws.join("root")).unwrap();
            fs::create_dir_all(ws.join("outside/sub")).unwrap();
            for name in ["secret", "x", "only-outside", "sub/secret"] {
                fs::write(ws.join("outside").join(name), SECRET).unwrap();
            }
            fs::write(tmp.path().join("beside"), SECRET).unwrap();
            let root = Arc::new(Root::open(&ws.join("root")).unwrap());
            let mut fx = Fixture {
                tmp,
                root,
                before: BTreeMap::new(),
            };
            fx.before = fx.snapshot();
            fx
        }

        fn rp(&self) -> PathBuf {
            self.tmp.path().join("ws/root")
        }

        fn outside(&self) -> PathBuf {
            self.tmp.path().join("ws/outside")
        }

        /// Names, kinds, sizes, modes, mtimes and link targets of everything but the root.
        fn snapshot(&self) -> BTreeMap<PathBuf, String> {
            fn walk(dir: &Path, skip: &Path, out: &mut BTreeMap<PathBuf, String>) {
                for entry in fs::read_dir(dir).unwrap() {
                    let path = entry.unwrap().path();
                    if path == skip {
                        continue;
                    }
                    let m = fs::symlink_metadata(&path).unwrap();
                    let link = fs::read_link(&path).ok();
                    out.insert(
                        path.clone(),
                        format!("{:o} {} {}.{} {:?}", m.mode(), m.len(), m.mtime(), m.mtime_nsec(), link),
                    );
                    if m.is_dir() {
                        walk(&path, skip, out);
                    }
                }
            }
            let mut out = BTreeMap::new();
            let top = fs::symlink_metadata(self.tmp.path()).unwrap();
            out.insert(
                self.tmp.path().to_path_buf(),
                format!("{} {}", top.mtime(), top.mtime_nsec()),
            );
            walk(self.tmp.path(), &self.rp(), &mut out);
            out
        }

        #[track_caller]
        fn assert_outside_unchanged(&self) {
            assert_eq!(self.snapshot(), self.before, "something outside the root changed");
        }

        fn mkdir(&self, rel: &str) {
            fs::create_dir_all(self.rp().join(rel)).unwrap();
        }

        fn put(&self, rel: &str, data: &[u8]) {
            fs::write(self.rp().join(rel), data).unwrap();
        }

        fn link(&self, at: &str, target: impl AsRef<Path>) {
            symlink(target, self.rp().join(at)).unwrap();
        }

        fn write(&self, rel: &str, data: &[u8], parents: bool) -> Result<u64> {
            self.root.write_file(rel, &mut &data[..], parents, None)
        }

        fn read(&self, rel: &str) -> Result<Vec<u8>> {
            let mut out = Vec::new();
            self.root.open_read(rel)?.read_to_end(&mut out).unwrap();
            assert_no_secret(&out);
            Ok(out)
        }

        fn pack(&self, rel: &str) -> Result<(Vec<u8>, PackReport)> {
            let mut out = Vec::new();
            let report = self.root.pack_tar(rel, &mut out)?;
            assert_no_secret(&out);
            Ok((out, report))
        }
    }

    #[track_caller]
    fn assert_no_secret(bytes: &[u8]) {
        assert!(
            !bytes.windows(SECRET.len()).any(|w| w == SECRET),
            "the outside secret came back"
        );
    }

    fn variant(e: &ConfinedError) -> &'static str {
        match e {
            ConfinedError::InvalidPath { .. } => "InvalidPath",
            ConfinedError::NotFound { .. } => "NotFound",
            ConfinedError::Escapes { .. } => "Escapes",
            ConfinedError::NotADirectory { .. } => "NotADirectory",
            ConfinedError::NotARegularFile { .. } => "NotARegularFile",
            ConfinedError::IsSymlink { .. } => "IsSymlink",
            ConfinedError::BadArchive { .. } => "BadArchive",
            ConfinedError::TooLarge { .. } => "TooLarge",
            ConfinedError::Unsupported { .. } => "Unsupported",
            ConfinedError::Io { .. } => "Io",
        }
    }

    #[track_caller]
    fn assert_err<T: std::fmt::Debug>(result: Result<T>, expected: &str) -> ConfinedError {
        match result {
            Ok(v) => panic!("expected {expected}, got Ok({v:?})"),
            Err(e) => {
                assert_eq!(variant(&e), expected, "{e}");
                e
            }
        }
    }

    /// Runs `f` on another thread and fails if it has not finished within 5 s (a blocked
    /// `open` on a FIFO would never finish).
    fn within_5s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(Duration::from_secs(5)).expect("the operation blocked")
    }

    // -- archives made by hand, so they can hold what well-behaved writers refuse to write

    fn member(name: &[u8], kind: tar::EntryType, mode: u32, data: &[u8], link: &[u8]) -> Vec<u8> {
        let mut h = tar::Header::new_ustar();
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(data.len() as u64);
        h.set_mtime(1_000_000_000);
        h.set_link_name_literal(link).unwrap();
        h.set_cksum();
        let mut out = h.as_bytes().to_vec();
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(512) * 512, 0);
        out
    }

    fn file_m(name: &str, data: &[u8]) -> Vec<u8> {
        member(name.as_bytes(), tar::EntryType::Regular, 0o644, data, b"")
    }

    fn dir_m(name: &str) -> Vec<u8> {
        member(name.as_bytes(), tar::EntryType::Directory, 0o755, b"", b"")
    }

    fn symlink_m(name: &str, target: &str) -> Vec<u8> {
        member(name.as_bytes(), tar::EntryType::Symlink, 0o777, b"", target.as_bytes())
    }

    fn hardlink_m(name: &str, target: &str) -> Vec<u8> {
        member(name.as_bytes(), tar::EntryType::Link, 0o644, b"", target.as_bytes())
    }

    fn tarball(members: &[Vec<u8>]) -> Vec<u8> {
        let mut out = members.concat();
        out.extend_from_slice(&[0; 1024]);
        out
    }

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(data).unwrap();
        enc.finish().unwrap()
    }

    fn members_of(archive: &[u8]) -> Vec<(String, tar::EntryType, Vec<u8>, Option<String>)> {
        let mut ar = tar::Archive::new(archive);
        ar.entries()
            .unwrap()
            .map(|e| {
                let mut e = e.unwrap();
                let name = String::from_utf8_lossy(&e.path_bytes()).into_owned();
                let link = e.link_name_bytes().map(|l| String::from_utf8_lossy(&l).into_owned());
                let kind = e.header().entry_type();
                let mut data = Vec::new();
                e.read_to_end(&mut data).unwrap();
                (name, kind, data, link)
            })
            .collect()
    }

    const MIB: u64 = 1 << 20;

    // ---- paths

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
    fn unpack_refuses_a_dotdot_member_and_extracts_nothing() {
        let fx = Fixture::new();
        for name in ["../outside/pwned", "a/../../pwned", ".."] {
            let archive = tarball(&[file_m("fine", b"x"), file_m(name, b"pwned")]);
            let e = assert_err(fx.root.unpack_tar("dest", &archive, None, MIB), "BadArchive");
            assert!(e.to_string().contains(name), "{e}");
            assert!(!fx.rp().join("dest").exists());
        }
        let nul = tarball(&[member(b"", tar::EntryType::Regular, 0o644, b"", b"")]);
        assert!(
            assert_err(fx.root.unpack_tar("dest", &nul, None, MIB), "BadArchive")
                .to_string()
                .contains("empty")
        );
        fx.assert_outside_unchanged();
    }

    #[test]
    fn unpack_strips_leading_slashes_and_extracts_inside() {
        let fx = Fixture::new();
        let abs = format!("{}/pwned", fx.outside().display());
        let archive = tarball(&[dir_m("./"), file_m(&abs, b"inside"), file_m("//etc/passwd", b"root")]);
        let report = fx.root.unpack_tar("dest", &archive, None, MIB).unwrap();
        assert_eq!(report.files, 2);
        let inside = fx.rp().join("dest").join(abs.trim_start_matches('/'));
        assert_eq!(fs::read(inside).unwrap(), b"inside");
        assert_eq!(fs::read(fx.rp().join("dest/etc/passwd")).unwrap(), b"root");
        fx.assert_outside_unchanged();
    }

    #[test]
    fn unpack_refuses_a_member_through_a_symlink_member_before_writing_anything() {
        let fx = Fixture::new();
        for target in [fx.outside().display().to_string(), "../../outside".into(), "sub".into()] {
            let archive = tarball(&[
                dir_m("sub/"),
                file_m("first", b"x"),
                symlink_m("l", &target),
                file_m("l/pwned", b"pwned"),
            ]);
            let e = assert_err(fx.root.unpack_tar("dest", &archive, None, MIB), "BadArchive");
            assert!(e.to_string().contains("symbolic link member"), "{e}");
            assert!(!fx.rp().join("dest").exists());
        }
        // A file member used as a directory is refused the same way.
        let archive = tarball(&[file_m("f", b"x"), file_m("f/g", b"y")]);
        assert_err(fx.root.unpack_tar("dest", &archive, None, MIB), "BadArchive");
        fx.assert_outside_unchanged();
    }

    #[test]
    fn unpack_refuses_hard_links_to_anything_but_an_earlier_file_member() {
        let fx = Fixture::new();
        let abs = fx.outside().join("secret").display().to_string();
        for (target, before) in [
            (abs.as_str(), vec![]),
            ("../outside/secret", vec![]),
            ("later", vec![]),
            ("d", vec![dir_m("d")]),
            ("s", vec![symlink_m("s", "/etc/passwd")]),
        ] {
            let mut members = before;
            members.push(hardlink_m("h", target));
            members.push(file_m("later", b"x"));
            let e = assert_err(fx.root.unpack_tar("dest", &tarball(&members), None, MIB), "BadArchive");
            assert!(e.to_string().contains("\"h\""), "{e}");
            assert!(!fx.rp().join("dest").exists());
        }
        fx.assert_outside_unchanged();
    }

    #[test]
    fn unpack_hard_link_to_an_earlier_member_shares_its_inode() {
        let fx = Fixture::new();
        let archive = tarball(&[file_m("d/f", b"data"), hardlink_m("e/h", "/d/f")]);
        let report = fx.root.unpack_tar("", &archive, None, MIB).unwrap();
        assert_eq!((report.files, report.hardlinks), (1, 1));
        let (f, h) = (fx.rp().join("d/f"), fx.rp().join("e/h"));
        assert_eq!(fs::metadata(f).unwrap().ino(), fs::metadata(&h).unwrap().ino());
        assert_eq!(fs::read(h).unwrap(), b"data");
    }

    #[test]
    fn unpack_refuses_device_and_fifo_members() {
        let fx = Fixture::new();
        for kind in [tar::EntryType::Char, tar::EntryType::Block, tar::EntryType::Fifo] {
            let archive = tarball(&[file_m("ok", b"x"), member(b"dev", kind, 0o666, b"", b"")]);
            let e = assert_err(fx.root.unpack_tar("dest", &archive, None, MIB), "BadArchive");
            assert!(e.to_string().contains("\"dev\""), "{e}");
            assert!(!fx.rp().join("dest").exists());
        }
    }

    #[test]
    fn unpack_keeps_only_permission_bits() {
        let fx = Fixture::new();
        let archive = tarball(&[
            member(b"suid", tar::EntryType::Regular, 0o4755, b"#!", b""),
            member(b"sgid", tar::EntryType::Regular, 0o2640, b"", b""),
            member(b"sticky/", tar::EntryType::Directory, 0o1777, b"", b""),
        ]);
        fx.root.unpack_tar("", &archive, None, MIB).unwrap();
        let mode = |rel: &str| fs::metadata(fx.rp().join(rel)).unwrap().mode() & 0o7777;
        assert_eq!(mode("suid"), 0o755);
        assert_eq!(mode("sgid"), 0o640);
        assert_eq!(mode("sticky"), 0o777);
        assert_eq!(fs::metadata(fx.rp().join("suid")).unwrap().mtime(), 1_000_000_000);
    }

    #[test]
    fn unpack_accepts_gzip_and_refuses_a_gzip_bomb() {
        let fx = Fixture::new();
        let plain = tarball(&[file_m("a/b", b"compressed")]);
        let report = fx.root.unpack_tar("z", &gzip(&plain), None, MIB).unwrap();
        assert_eq!((report.files, report.bytes), (1, 10));
        assert_eq!(fs::read(fx.rp().join("z/a/b")).unwrap(), b"compressed");

        // 64 MiB of zeros in one member, a few tens of KiB compressed.
        let mut big = tar::Header::new_gnu();
        big.set_size(64 * MIB);
        big.set_mode(0o644);
        big.set_cksum();
        let mut ar = tar::Builder::new(Vec::new());
        ar.append_data(&mut big, "bomb", io::repeat(0).take(64 * MIB)).unwrap();
        let bomb = gzip(&ar.into_inner().unwrap());
        assert!(bomb.len() < 1 << 20);
        let e = assert_err(fx.root.unpack_tar("bomb", &bomb, None, MIB), "TooLarge");
        assert!(e.is_client_error());
        assert!(!fx.rp().join("bomb").exists());

        // Many small members that add up over the limit are refused as well.
        let many: Vec<_> = (0..20).map(|i| file_m(&format!("f{i}"), &[7; 100_000])).collect();
        assert_err(
            fx.root.unpack_tar("many", &gzip(&tarball(&many)), None, MIB),
            "TooLarge",
        );
        assert!(!fx.rp().join("many").exists());
    }

    #[test]
    fn unpack_caps_decompression_even_for_data_that_is_never_extracted() {
        let fx = Fixture::new();
        // A symlink member whose header claims 80 MiB of data: not file bytes, so only the
        // cap on the decompressed stream (max_bytes + 64 MiB) stops it.
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_path("l").unwrap();
        h.set_link_name("target").unwrap();
        h.set_size(80 * MIB);
        h.set_cksum();
        let mut raw = h.as_bytes().to_vec();
        raw.resize(raw.len() + (80 * MIB) as usize, 0);
        raw.extend_from_slice(&[0; 1024]);
        let e = assert_err(fx.root.unpack_tar("bomb", &gzip(&raw), None, MIB), "TooLarge");
        assert!(e.is_client_error());
        assert!(!fx.rp().join("bomb").exists());
    }

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
    fn unpack_refuses_an_archive_over_64_mib() {
        let fx = Fixture::new();
        let huge = vec![0u8; MAX_ARCHIVE_BYTES as usize + 1];
        assert_err(fx.root.unpack_tar("", &huge, None, u64::MAX), "TooLarge");
    }

    #[test]
    fn unpack_replaces_a_planted_symlink_at_a_member_path_without_following_it() {
        let fx = Fixture::new();
        fx.mkdir("t/keepdir");
        fx.put("t/keepdir/old", b"old");
        fx.link("t/l", fx.outside().join("secret"));
        fx.link("t/m", "../../outside/x");
        fx.link("t/n", fx.outside());
        fx.put("t/plain", b"old");
        let archive = tarball(&[
            file_m("l", b"new"),
            symlink_m("m", "elsewhere"),
            dir_m("n"),
            file_m("n/inside", b"in"),
            dir_m("keepdir"),
            file_m("plain", b"new"),
        ]);
        fx.root.unpack_tar("t", &archive, None, MIB).unwrap();
        assert_eq!(fs::read(fx.rp().join("t/l")).unwrap(), b"new");
        assert!(fs::symlink_metadata(fx.rp().join("t/l")).unwrap().is_file());
        assert_eq!(fs::read_link(fx.rp().join("t/m")).unwrap(), Path::new("elsewhere"));
        assert!(fs::symlink_metadata(fx.rp().join("t/n")).unwrap().is_dir());
        assert_eq!(fs::read(fx.rp().join("t/n/inside")).unwrap(), b"in");
        assert_eq!(fs::read(fx.rp().join("t/keepdir/old")).unwrap(), b"old");
        assert_eq!(fs::read(fx.rp().join("t/plain")).unwrap(), b"new");
        fx.assert_outside_unchanged();
    }

    #[test]
    fn unpack_refuses_a_symlink_on_disk_where_a_parent_directory_should_be() {
        let fx = Fixture::new();
        fx.mkdir("t");
        fx.link("t/p", fx.outside());
        fx.link("t/q", "..");
        for name in ["p/pwned", "q/pwned"] {
            let archive = tarball(&[file_m(name, b"pwned")]);
            assert_err(fx.root.unpack_tar("t", &archive, None, MIB), "IsSymlink");
        }
        assert!(!fx.rp().join("pwned").exists());
        fx.assert_outside_unchanged();
    }

    #[test]
    fn unpack_refuses_a_file_member_over_an_existing_directory() {
        let fx = Fixture::new();
        fx.mkdir("t/d/inner");
        let e = assert_err(
            fx.root.unpack_tar("t", &tarball(&[file_m("d", b"x")]), None, MIB),
            "BadArchive",
        );
        assert!(e.to_string().contains("directory exists"), "{e}");
        assert!(fx.rp().join("t/d/inner").is_dir());
        let archive = tarball(&[dir_m("d"), file_m("d", b"x")]);
        assert_err(fx.root.unpack_tar("t", &archive, None, MIB), "BadArchive");
    }

    #[test]
    fn unpack_gives_everything_it_creates_the_owner() {
        let fx = Fixture::new();
        let archive = tarball(&[file_m("a/f", b"x"), dir_m("d"), symlink_m("a/s", "/nowhere")]);
        let owner = Owner { uid: 1111, gid: 2222 };
        fx.root.unpack_tar("u/v", &archive, Some(owner), MIB).unwrap();
        for rel in ["u", "u/v", "u/v/a", "u/v/a/f", "u/v/d", "u/v/a/s"] {
            let m = fs::symlink_metadata(fx.rp().join(rel)).unwrap();
            assert_eq!((m.uid(), m.gid()), (1111, 2222), "{rel}");
        }
    }

    #[test]
    fn unpack_reads_long_names_and_skips_pax_global_headers() {
        let fx = Fixture::new();
        let long = format!("{}/{}", "d".repeat(120), "f".repeat(150));
        let mut ar = tar::Builder::new(Vec::new());
        let mut global = tar::Header::new_ustar();
        let records = b"20 comment=ignored!\n";
        global.set_entry_type(tar::EntryType::XGlobalHeader);
        global.set_size(records.len() as u64);
        global.set_mode(0o644);
        global.set_cksum();
        ar.append_data(&mut global, "pax_global_header", &records[..]).unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_size(4);
        h.set_mode(0o600);
        ar.append_data(&mut h, &long, &b"long"[..]).unwrap();
        let mut l = tar::Header::new_gnu();
        l.set_entry_type(tar::EntryType::Symlink);
        l.set_size(0);
        ar.append_link(&mut l, "link", "t".repeat(300)).unwrap();
        let archive = ar.into_inner().unwrap();
        let report = fx.root.unpack_tar("", &archive, None, MIB).unwrap();
        assert_eq!((report.files, report.symlinks), (1, 1));
        assert_eq!(fs::read(fx.rp().join(&long)).unwrap(), b"long");
        assert_eq!(
            fs::read_link(fx.rp().join("link")).unwrap(),
            Path::new(&"t".repeat(300))
        );
        assert!(!fx.rp().join("pax_global_header").exists());
    }

    #[test]
    fn unpack_refuses_a_corrupt_archive() {
        let fx = Fixture::new();
        let mut archive = tarball(&[file_m("a", b"x")]);
        archive[0] ^= 0xff;
        assert_err(fx.root.unpack_tar("", &archive, None, MIB), "BadArchive");
        assert_err(
            fx.root.unpack_tar("", b"\x1f\x8bnot gzip at all", None, MIB),
            "BadArchive",
        );
    }

    // ---- pack

    #[test]
    fn pack_stores_symlinks_as_symlinks_and_skips_fifos_without_blocking() {
        let fx = Fixture::new();
        fx.mkdir("p/sub");
        fx.put("p/f", b"file data");
        fx.put("p/sub/g", b"more");
        fx.link("p/abs", fx.outside().join("secret"));
        fx.link("p/rel", "../../outside/secret");
        fx.link("p/sub/dir", fx.outside());
        nix::unistd::mkfifo(&fx.rp().join("p/fifo"), Mode::from_bits_truncate(0o666)).unwrap();
        let root = fx.root.clone();
        let (archive, report) = within_5s(move || {
            let mut out = Vec::new();
            let report = root.pack_tar("p", &mut out).unwrap();
            (out, report)
        });
        assert_no_secret(&archive);
        assert_eq!(
            report,
            PackReport {
                files: 2,
                dirs: 1,
                symlinks: 3,
                skipped: 1,
                bytes: 13
            }
        );
        let members: Vec<_> = members_of(&archive)
            .into_iter()
            .map(|(name, kind, data, link)| (name, kind, String::from_utf8(data).unwrap(), link))
            .collect();
        let secret = fx.outside().join("secret").display().to_string();
        let outside = fx.outside().display().to_string();
        use tar::EntryType as T;
        assert_eq!(
            members,
            [
                ("abs".into(), T::Symlink, "".into(), Some(secret)),
                ("f".into(), T::Regular, "file data".into(), None),
                ("rel".into(), T::Symlink, "".into(), Some("../../outside/secret".into())),
                ("sub/".into(), T::Directory, "".into(), None),
                ("sub/dir".into(), T::Symlink, "".into(), Some(outside)),
                ("sub/g".into(), T::Regular, "more".into(), None),
            ]
        );
        fx.assert_outside_unchanged();
    }

    #[test]
    fn setid_bits_are_cleared_in_the_tree_and_never_through_a_link() {
        let mut fx = Fixture::new();
        fs::set_permissions(fx.outside().join("secret"), fs::Permissions::from_mode(0o4755)).unwrap();
        fx.before = fx.snapshot();
        let rp = fx.rp();
        fs::create_dir_all(rp.join("d/e")).unwrap();
        for (name, mode) in [
            ("suid", 0o4755),
            ("sgid", 0o2711),
            ("d/e/both", 0o6750),
            ("plain", 0o755),
        ] {
            fs::write(rp.join(name), b"x").unwrap();
            fs::set_permissions(rp.join(name), fs::Permissions::from_mode(mode)).unwrap();
        }
        // A setgid directory keeps its bit (group inheritance, nothing runs as anyone).
        fs::set_permissions(rp.join("d"), fs::Permissions::from_mode(0o2775)).unwrap();
        symlink(fx.outside().join("secret"), rp.join("link")).unwrap();
        symlink(fx.outside(), rp.join("dirlink")).unwrap();
        let report = fx.root.clear_setid().unwrap();
        assert_eq!(report.cleared, 3, "{report:?}");
        let mode = |name: &str| fs::symlink_metadata(rp.join(name)).unwrap().mode() & 0o7777;
        assert_eq!(
            [mode("suid"), mode("sgid"), mode("d/e/both"), mode("plain"), mode("d")],
            [0o755, 0o711, 0o750, 0o755, 0o2775]
        );
        fx.assert_outside_unchanged();
        assert_eq!(fx.root.clear_setid().unwrap().cleared, 0);
    }

    #[test]
    fn disk_usage_counts_blocks_and_inodes_once_and_never_follows_links() {
        let fx = Fixture::new();
        let rp = fx.rp();
        let empty = fx.root.disk_usage(u64::MAX).unwrap();
        assert_eq!((empty.entries, empty.stopped, empty.too_deep), (1, false, false));
        fs::create_dir(rp.join("d")).unwrap();
        fs::write(rp.join("d/big"), vec![7u8; 1 << 20]).unwrap();
        fs::hard_link(rp.join("d/big"), rp.join("again")).unwrap();
        for i in 0..100 {
            fs::write(rp.join(format!("d/e{i}")), b"").unwrap();
        }
        // A sparse file counts what it holds.
        let sparse = File::create(rp.join("sparse")).unwrap();
        sparse.set_len(1 << 30).unwrap();
        symlink(fx.outside(), rp.join("out")).unwrap();
        let u = fx.root.disk_usage(u64::MAX).unwrap();
        // root, d, big (once), 100 empty files, sparse, the link itself.
        assert_eq!(u.entries, 105, "{u:?}");
        let min = (1 << 20) + 103 * MIN_INODE_CHARGE;
        assert!(u.bytes >= min && u.bytes < min + (64 << 10), "{u:?}");
        // It stops once the caller's bound is reached.
        let stopped = fx.root.disk_usage(10 * MIN_INODE_CHARGE).unwrap();
        assert!(stopped.stopped && stopped.entries <= 12, "{stopped:?}");
    }

    #[test]
    fn remove_tree_takes_deep_and_wide_trees_and_never_follows_a_link() {
        let fx = Fixture::new();
        let rp = fx.rp();
        // 20,000 levels: std's recursive removal overflows a thread's stack on far less.
        let top = File::open(&rp).unwrap();
        nix::sys::stat::mkdirat(&top, "deep", Mode::from_bits_truncate(0o755)).unwrap();
        let mut cur = nix::fcntl::openat(&top, "deep", OFlag::O_RDONLY | OFlag::O_DIRECTORY, Mode::empty()).unwrap();
        for i in 0..20_000 {
            nix::sys::stat::mkdirat(&cur, "d", Mode::from_bits_truncate(0o755)).unwrap();
            if i % 1000 == 0 {
                let f = nix::fcntl::openat(
                    &cur,
                    "f",
                    OFlag::O_CREAT | OFlag::O_WRONLY,
                    Mode::from_bits_truncate(0o644),
                )
                .unwrap();
                drop(f);
                nix::unistd::symlinkat(fx.outside().as_path(), &cur, "escape").unwrap();
            }
            cur = nix::fcntl::openat(&cur, "d", OFlag::O_RDONLY | OFlag::O_DIRECTORY, Mode::empty()).unwrap();
        }
        drop(cur);
        fs::create_dir(rp.join("wide")).unwrap();
        for i in 0..3000 {
            fs::create_dir(rp.join(format!("wide/{i}"))).unwrap();
            fs::write(rp.join(format!("wide/{i}/f")), b"x").unwrap();
        }
        symlink(fx.outside(), rp.join("wide/out")).unwrap();
        let started = Instant::now();
        let removed = thread::Builder::new()
            .stack_size(256 << 10)
            .spawn({
                let top = top.try_clone().unwrap();
                move || {
                    remove_tree_at(top.as_fd(), b"deep").unwrap();
                    remove_tree_at(top.as_fd(), b"wide").unwrap();
                }
            })
            .unwrap()
            .join();
        assert!(removed.is_ok(), "the removal panicked");
        eprintln!("removed 20,000 levels and 3,000 directories in {:?}", started.elapsed());
        assert!(!rp.join("deep").exists() && !rp.join("wide").exists());
        fx.assert_outside_unchanged();
        // Gone already, or a plain file: both fine.
        remove_tree_at(top.as_fd(), b"deep").unwrap();
        fs::write(rp.join("file"), b"x").unwrap();
        remove_tree_at(top.as_fd(), b"file").unwrap();
        assert!(!rp.join("file").exists());
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

    #[test]
    fn pack_of_a_single_file_names_it_by_its_last_component() {
        let fx = Fixture::new();
        fx.mkdir("a/b");
        fx.put("a/b/c.txt", b"abc");
        let (archive, report) = fx.pack("/a/b/c.txt").unwrap();
        assert_eq!(report.files, 1);
        let members = members_of(&archive);
        assert_eq!(members.len(), 1);
        assert_eq!((members[0].0.as_str(), members[0].2.as_slice()), ("c.txt", &b"abc"[..]));
    }

    #[test]
    fn pack_then_unpack_reproduces_the_tree() {
        let fx = Fixture::new();
        fx.mkdir("src/x/y");
        fx.put("src/x/y/z", b"deep");
        fx.put("src/top", b"top");
        fs::set_permissions(fx.rp().join("src/top"), fs::Permissions::from_mode(0o750)).unwrap();
        fx.link("src/x/l", "y/z");
        let (archive, _) = fx.pack("src").unwrap();
        let report = fx.root.unpack_tar("dst", &archive, None, MIB).unwrap();
        assert_eq!((report.files, report.dirs, report.symlinks), (2, 2, 1));
        assert_eq!(fx.read("dst/x/l").unwrap(), b"deep");
        assert_eq!(fs::metadata(fx.rp().join("dst/top")).unwrap().mode() & 0o777, 0o750);
    }

    #[test]
    fn pack_refuses_trees_deeper_than_the_limit() {
        let fx = Fixture::new();
        let deep = vec!["d"; MAX_PACK_DEPTH as usize + 1].join("/");
        fx.mkdir(&deep);
        let e = assert_err(fx.pack(""), "TooLarge");
        assert!(e.to_string().contains("depth"), "{e}");
        assert_err(fx.pack("d"), "TooLarge");
        // From the second level down, the deepest contents are exactly at the limit.
        assert_eq!(fx.pack("d/d").unwrap().1.dirs, MAX_PACK_DEPTH - 1);
    }

    #[test]
    fn exactly_pads_a_shrunk_file_with_zeros_and_cuts_a_grown_one() {
        let mut out = Vec::new();
        let mut shrunk = Exactly {
            inner: &b"abc"[..],
            left: 6,
            ended: false,
        };
        shrunk.read_to_end(&mut out).unwrap();
        assert_eq!(out, b"abc\0\0\0");
        out.clear();
        let mut grown = Exactly {
            inner: &b"abcdefgh"[..],
            left: 3,
            ended: false,
        };
        grown.read_to_end(&mut out).unwrap();
        assert_eq!(out, b"abc");
    }

    // ---- the race

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
