//! Resolving and opening beneath a directory descriptor (`openat2`), and what the operations
//! share: checks of what was opened, owners and modes set through descriptors, errors.

use super::*;

/// `openat2` beneath `dir`, always `O_CLOEXEC`, retrying the `EAGAIN` a concurrent rename can
/// cause (bounded).
pub(super) fn open_beneath(
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
pub(super) fn errno_error(op: &'static str, path: &str, e: Errno) -> ConfinedError {
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

pub(super) fn file_type(st: &FileStat) -> libc::mode_t {
    st.st_mode & libc::S_IFMT
}

pub(super) fn kind_name(st: &FileStat) -> &'static str {
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
pub(super) fn check_kind(st: &FileStat, allow_dir: bool, shown: &str) -> Result<()> {
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

pub(super) fn fstat(fd: BorrowedFd<'_>, shown: &str) -> Result<FileStat> {
    nix::sys::stat::fstat(fd).map_err(|e| errno_error("inspecting", shown, e))
}

/// Opens `path` beneath `dir` for I/O only if it is a regular file (or a directory, with
/// `allow_dir`). An `O_PATH` look first, because opening is itself an action on a device
/// (a tape rewinds, a terminal becomes ours); then the real open with `O_NONBLOCK` (a FIFO
/// swapped in meanwhile cannot block it) and `fstat` on the opened descriptor, which is what
/// counts. `O_NONBLOCK` is cleared again afterwards.
pub(super) fn open_checked(
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

pub(super) fn clear_nonblock(fd: BorrowedFd<'_>, shown: &str) -> Result<()> {
    let bits = nix::fcntl::fcntl(fd, FcntlArg::F_GETFL).map_err(|e| errno_error("configuring", shown, e))?;
    let flags = OFlag::from_bits_retain(bits) - OFlag::O_NONBLOCK;
    nix::fcntl::fcntl(fd, FcntlArg::F_SETFL(flags)).map_err(|e| errno_error("configuring", shown, e))?;
    Ok(())
}

pub(super) fn chown_fd(fd: BorrowedFd<'_>, owner: Option<Owner>, shown: &str) -> Result<()> {
    if let Some(o) = owner {
        nix::unistd::fchown(fd, Some(Uid::from_raw(o.uid)), Some(Gid::from_raw(o.gid)))
            .map_err(|e| errno_error("changing the owner of", shown, e))?;
    }
    Ok(())
}

pub(super) fn chmod_fd(fd: BorrowedFd<'_>, mode: u32, shown: &str) -> Result<()> {
    // Only permission bits: setuid/setgid/sticky from an upload are never honoured.
    nix::sys::stat::fchmod(fd, Mode::from_bits_truncate(mode & 0o777))
        .map_err(|e| errno_error("changing the mode of", shown, e))
}

/// The write side of [`Root::write_file`]: a new file with `O_EXCL` (so it is ours and
/// regular), else the existing one, which must be a regular file, truncated.
pub(super) fn create_or_truncate(
    parent: BorrowedFd<'_>,
    name: &[u8],
    owner: Option<Owner>,
    shown: &str,
) -> Result<File> {
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

pub(super) fn busy(op: &'static str, shown: &str) -> ConfinedError {
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
pub(super) fn walk_dirs(
    start: BorrowedFd<'_>,
    comps: &[&[u8]],
    create: Option<Option<Owner>>,
    base: &str,
) -> Result<OwnedFd> {
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
pub(super) fn step_dir(
    cur: BorrowedFd<'_>,
    name: &[u8],
    create: Option<Option<Owner>>,
    shown: &str,
) -> Result<OwnedFd> {
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
pub(super) fn not_a_dir_error(cur: BorrowedFd<'_>, name: &[u8], shown: &str, e: Errno) -> ConfinedError {
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

/// Errors that only mean the name became something else between the look and the open.
pub(super) fn changed_meanwhile(e: Errno) -> bool {
    matches!(
        e,
        Errno::ENOENT | Errno::ELOOP | Errno::ENOTDIR | Errno::ENXIO | Errno::EXDEV
    )
}
