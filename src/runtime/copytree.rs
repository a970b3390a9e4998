//! Copy a directory tree a sandbox wrote (its overlay upper directory, its agent directory, its
//! workspace) into a fresh one, for a checkpoint and for each sandbox restored from it.
//!
//! The source is hostile: it is walked through directory descriptors (`openat` with
//! `O_NOFOLLOW`, each open checked against the `fstatat` before it), links are copied as links
//! and never followed, only regular files are opened (non-blocking), and depth, entries and
//! bytes are bounded. What overlayfs keeps in an upper directory survives the copy: whiteouts
//! (0/0 character devices), opaque directories (`trusted.overlay.opaque` /
//! `user.overlay.opaque`), hard links, FIFOs, owners, modes and times. Other devices and
//! sockets are left out (a user namespace cannot make devices; a socket is a live object).
//!
//! Owners are shifted: a host id in `from` becomes the same offset in `to` (a sandbox's range
//! to another's), any other id is kept.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::fcntl::{AtFlags, OFlag, openat};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat, fstatat};

/// The xattrs overlayfs marks an opaque directory with (the second on `userxattr` mounts).
const OPAQUE_XATTRS: [&str; 2] = ["trusted.overlay.opaque", "user.overlay.opaque"];
/// Deepest directory nesting copied.
const DEPTH_LIMIT: usize = 512;

/// What a copy may take.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub bytes: u64,
    pub entries: u64,
}

/// How ids move: `[from, from + count)` to `[to, to + count)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shift {
    pub from: u32,
    pub to: u32,
    pub count: u32,
}

impl Shift {
    pub const NONE: Shift = Shift {
        from: 0,
        to: 0,
        count: 0,
    };

    fn id(&self, id: u32) -> u32 {
        match id.checked_sub(self.from) {
            Some(offset) if offset < self.count => self.to + offset,
            _ => id,
        }
    }
}

/// What was copied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Copied {
    pub bytes: u64,
    pub entries: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("{what}: more than {limit} {unit}")]
    TooLarge {
        what: &'static str,
        limit: u64,
        unit: &'static str,
    },
    #[error("{path}: {source}")]
    Io { path: String, source: io::Error },
}

struct Walk<'a> {
    shift: Shift,
    limits: Limits,
    skip_top: &'a [&'a str],
    copied: Copied,
    /// Hard links: (device, inode) of a source file to its first copy's path.
    links: HashMap<(u64, u64), CString>,
    dst_root: OwnedFd,
}

fn errno(path: &[u8], e: nix::Error) -> CopyError {
    CopyError::Io {
        path: String::from_utf8_lossy(path).into_owned(),
        source: io::Error::from(e),
    }
}

fn ioerr(path: &[u8], e: io::Error) -> CopyError {
    CopyError::Io {
        path: String::from_utf8_lossy(path).into_owned(),
        source: e,
    }
}

fn join(parent: &[u8], name: &[u8]) -> Vec<u8> {
    if parent.is_empty() {
        name.to_vec()
    } else {
        [parent, b"/", name].concat()
    }
}

fn cstr(b: &[u8]) -> CString {
    CString::new(b).expect("names from readdir hold no NUL")
}

/// Copy the tree at `src` into the existing empty directory `dst` (its own owner, mode and
/// opaque mark come from `src`'s root). `skip_top`: names at the top level left out.
pub fn copy(src: &Path, dst: &Path, shift: Shift, limits: Limits, skip_top: &[&str]) -> Result<Copied, CopyError> {
    let open_dir = |p: &Path| {
        nix::fcntl::open(
            p,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| errno(p.as_os_str().as_bytes(), e))
    };
    let (s, d) = (open_dir(src)?, open_dir(dst)?);
    let mut walk = Walk {
        shift,
        limits,
        skip_top,
        copied: Copied::default(),
        links: HashMap::new(),
        dst_root: open_dir(dst)?,
    };
    let st = fstat(&s).map_err(|e| errno(b".", e))?;
    walk.dir(&s, &d, b"", 0)?;
    walk.attrs(&d, &st, b".")?;
    copy_opaque(&s, &d).map_err(|e| ioerr(b".", e))?;
    Ok(walk.copied)
}

impl Walk<'_> {
    fn count(&mut self, bytes: u64) -> Result<(), CopyError> {
        self.copied.entries += 1;
        self.copied.bytes += bytes;
        if self.copied.entries > self.limits.entries {
            return Err(CopyError::TooLarge {
                what: "the tree",
                limit: self.limits.entries,
                unit: "entries",
            });
        }
        if self.copied.bytes > self.limits.bytes {
            return Err(CopyError::TooLarge {
                what: "the tree",
                limit: self.limits.bytes,
                unit: "bytes",
            });
        }
        Ok(())
    }

    /// Owner, mode and times of a copied entry (through its descriptor).
    fn attrs(&self, fd: &impl AsFd, st: &FileStat, path: &[u8]) -> Result<(), CopyError> {
        let (uid, gid) = (self.shift.id(st.st_uid), self.shift.id(st.st_gid));
        nix::unistd::fchown(
            fd,
            Some(nix::unistd::Uid::from_raw(uid)),
            Some(nix::unistd::Gid::from_raw(gid)),
        )
        .map_err(|e| errno(path, e))?;
        // After the chown, which clears set-id bits.
        nix::sys::stat::fchmod(fd, Mode::from_bits_truncate(st.st_mode & 0o7777)).map_err(|e| errno(path, e))?;
        let times = [
            nix::sys::time::TimeSpec::new(st.st_atime, st.st_atime_nsec),
            nix::sys::time::TimeSpec::new(st.st_mtime, st.st_mtime_nsec),
        ];
        nix::sys::stat::futimens(fd, &times[0], &times[1]).map_err(|e| errno(path, e))
    }

    /// Owner and times of an entry that cannot be opened (a link, a FIFO, a whiteout).
    fn attrs_at(&self, dir: &OwnedFd, name: &CString, st: &FileStat, path: &[u8], mode: bool) -> Result<(), CopyError> {
        let (uid, gid) = (self.shift.id(st.st_uid), self.shift.id(st.st_gid));
        nix::unistd::fchownat(
            dir,
            name.as_c_str(),
            Some(nix::unistd::Uid::from_raw(uid)),
            Some(nix::unistd::Gid::from_raw(gid)),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| errno(path, e))?;
        if mode {
            nix::sys::stat::fchmodat(
                dir,
                name.as_c_str(),
                Mode::from_bits_truncate(st.st_mode & 0o7777),
                nix::sys::stat::FchmodatFlags::FollowSymlink,
            )
            .map_err(|e| errno(path, e))?;
        }
        let times = [
            nix::sys::time::TimeSpec::new(st.st_atime, st.st_atime_nsec),
            nix::sys::time::TimeSpec::new(st.st_mtime, st.st_mtime_nsec),
        ];
        nix::sys::stat::utimensat(
            dir,
            name.as_c_str(),
            &times[0],
            &times[1],
            nix::sys::stat::UtimensatFlags::NoFollowSymlink,
        )
        .map_err(|e| errno(path, e))
    }

    fn dir(&mut self, src: &OwnedFd, dst: &OwnedFd, path: &[u8], depth: usize) -> Result<(), CopyError> {
        if depth > DEPTH_LIMIT {
            return Err(CopyError::TooLarge {
                what: "the tree's depth",
                limit: DEPTH_LIMIT as u64,
                unit: "levels",
            });
        }
        let dup = nix::unistd::dup(src).map_err(|e| errno(path, e))?;
        let mut listing = nix::dir::Dir::from_fd(dup).map_err(|e| errno(path, e))?;
        let mut names = Vec::new();
        for entry in listing.iter() {
            let entry = entry.map_err(|e| errno(path, e))?;
            let name = entry.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            if depth == 0 && self.skip_top.iter().any(|s| s.as_bytes() == name) {
                continue;
            }
            names.push(entry.file_name().to_owned());
            // Counted as listed: a directory of a million names is refused before it is held.
            self.count(0)?;
        }
        drop(listing);
        for name in names {
            let child = join(path, name.as_bytes());
            self.entry(src, dst, &name, &child, depth)?;
        }
        Ok(())
    }

    fn entry(
        &mut self,
        src: &OwnedFd,
        dst: &OwnedFd,
        name: &CString,
        path: &[u8],
        depth: usize,
    ) -> Result<(), CopyError> {
        let st = match fstatat(src, name.as_c_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            // Gone since it was listed (the host removes a finished call's FIFO on its own
            // time): the copy is of a moment after.
            Err(nix::errno::Errno::ENOENT) => return Ok(()),
            Err(e) => return Err(errno(path, e)),
        };
        let kind = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
        let perm = Mode::from_bits_truncate(0o700);
        match kind {
            SFlag::S_IFDIR => {
                let s = open_checked(src, name, OFlag::O_DIRECTORY, &st).map_err(|e| ioerr(path, e))?;
                nix::sys::stat::mkdirat(dst, name.as_c_str(), perm).map_err(|e| errno(path, e))?;
                let d = openat(
                    dst,
                    name.as_c_str(),
                    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| errno(path, e))?;
                self.dir(&s, &d, path, depth + 1)?;
                copy_opaque(&s, &d).map_err(|e| ioerr(path, e))?;
                // Last: a read-only directory still took its entries.
                self.attrs(&d, &st, path)
            }
            SFlag::S_IFREG => {
                if st.st_nlink > 1
                    && let Some(first) = self.links.get(&(st.st_dev, st.st_ino))
                {
                    nix::unistd::linkat(&self.dst_root, first.as_c_str(), dst, name.as_c_str(), AtFlags::empty())
                        .map_err(|e| errno(path, e))?;
                    return self.count(0);
                }
                self.count(st.st_size as u64)?;
                let s = open_checked(src, name, OFlag::empty(), &st).map_err(|e| ioerr(path, e))?;
                let d = openat(
                    dst,
                    name.as_c_str(),
                    OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    perm,
                )
                .map_err(|e| errno(path, e))?;
                let (mut from, mut to) = (File::from(s), File::from(d));
                // Bounded by the size seen: a file that grows meanwhile is cut there.
                let n =
                    io::copy(&mut io::Read::take(&mut from, st.st_size as u64), &mut to).map_err(|e| ioerr(path, e))?;
                if n != st.st_size as u64 {
                    return Err(ioerr(path, io::Error::other("the file shrank while it was copied")));
                }
                self.attrs(&to, &st, path)?;
                if st.st_nlink > 1 {
                    self.links.insert((st.st_dev, st.st_ino), cstr(path));
                }
                Ok(())
            }
            SFlag::S_IFLNK => {
                self.count(0)?;
                let target = nix::fcntl::readlinkat(src, name.as_c_str()).map_err(|e| errno(path, e))?;
                nix::unistd::symlinkat(target.as_os_str(), dst, name.as_c_str()).map_err(|e| errno(path, e))?;
                self.attrs_at(dst, name, &st, path, false)
            }
            SFlag::S_IFIFO => {
                self.count(0)?;
                nix::unistd::mkfifoat(dst, name.as_c_str(), perm).map_err(|e| errno(path, e))?;
                self.attrs_at(dst, name, &st, path, true)
            }
            // overlayfs' whiteout.
            SFlag::S_IFCHR if st.st_rdev == 0 => {
                self.count(0)?;
                nix::sys::stat::mknodat(dst, name.as_c_str(), SFlag::S_IFCHR, perm, 0).map_err(|e| errno(path, e))?;
                self.attrs_at(dst, name, &st, path, true)
            }
            _ => Ok(()),
        }
    }
}

/// Open `name` in `dir` without following links or blocking, and check it is what `fstatat`
/// saw (nothing swapped it between).
fn open_checked(dir: &OwnedFd, name: &CString, flags: OFlag, seen: &FileStat) -> io::Result<OwnedFd> {
    let fd = openat(
        dir,
        name.as_c_str(),
        flags | OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let st = fstat(&fd)?;
    if (st.st_dev, st.st_ino) != (seen.st_dev, seen.st_ino) {
        return Err(io::Error::other("replaced while it was copied"));
    }
    Ok(fd)
}

/// Carry overlayfs' opaque mark of a directory over.
fn copy_opaque(src: &OwnedFd, dst: &OwnedFd) -> io::Result<()> {
    for name in OPAQUE_XATTRS {
        let cname = CString::new(name).expect("constant");
        let mut value = [0u8; 8];
        // SAFETY: valid fd, NUL-terminated name, buffer of the given length.
        let n = unsafe { libc::fgetxattr(src.as_raw_fd(), cname.as_ptr(), value.as_mut_ptr().cast(), value.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ENODATA) | Some(libc::ENOTSUP) | Some(libc::ERANGE) => continue,
                _ => return Err(e),
            }
        }
        // SAFETY: as above; `n` bytes of `value` were filled.
        let r = unsafe { libc::fsetxattr(dst.as_raw_fd(), cname.as_ptr(), value.as_ptr().cast(), n as usize, 0) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Remove a tree this module made (never following links).
pub fn remove(path: &Path) -> io::Result<()> {
    match std::fs::remove_dir_all(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    const BIG: Limits = Limits {
        bytes: 1 << 30,
        entries: 1 << 20,
    };

    #[test]
    fn copies_files_links_fifos_modes_and_hard_links() {
        let (src, dst) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let s = src.path();
        std::fs::create_dir_all(s.join("a/b")).unwrap();
        std::fs::write(s.join("a/b/f"), b"hello").unwrap();
        std::fs::set_permissions(s.join("a/b/f"), std::fs::Permissions::from_mode(0o4755)).unwrap();
        std::fs::hard_link(s.join("a/b/f"), s.join("a/g")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", s.join("a/l")).unwrap();
        nix::unistd::mkfifo(&s.join("p"), Mode::from_bits_truncate(0o600)).unwrap();
        nix::sys::stat::mknod(&s.join("wh"), SFlag::S_IFCHR, Mode::from_bits_truncate(0o600), 0).unwrap();
        std::fs::write(s.join("skip"), b"x").unwrap();
        let copied = copy(s, dst.path(), Shift::NONE, BIG, &["skip"]).unwrap();
        let d = dst.path();
        assert_eq!(std::fs::read(d.join("a/b/f")).unwrap(), b"hello");
        assert_eq!(std::fs::metadata(d.join("a/b/f")).unwrap().mode() & 0o7777, 0o4755);
        assert_eq!(
            std::fs::metadata(d.join("a/g")).unwrap().ino(),
            std::fs::metadata(d.join("a/b/f")).unwrap().ino()
        );
        assert_eq!(std::fs::read_link(d.join("a/l")).unwrap(), Path::new("/etc/passwd"));
        assert!(
            std::fs::symlink_metadata(d.join("p"))
                .unwrap()
                .file_type()
                .is_fifo_like()
        );
        assert_eq!(std::fs::symlink_metadata(d.join("wh")).unwrap().rdev(), 0);
        assert!(!d.join("skip").exists());
        assert_eq!(copied.bytes, 5);
    }

    trait FifoLike {
        fn is_fifo_like(&self) -> bool;
    }
    impl FifoLike for std::fs::FileType {
        fn is_fifo_like(&self) -> bool {
            std::os::unix::fs::FileTypeExt::is_fifo(self)
        }
    }

    #[test]
    fn shifts_owners_of_the_range_only() {
        let (src, dst) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let s = src.path();
        std::fs::write(s.join("in"), b"").unwrap();
        std::fs::write(s.join("out"), b"").unwrap();
        std::os::unix::fs::chown(s.join("in"), Some(1_000_005), Some(1_000_007)).unwrap();
        std::os::unix::fs::chown(s.join("out"), Some(42), Some(43)).unwrap();
        let shift = Shift {
            from: 1_000_000,
            to: 2_000_000,
            count: 65536,
        };
        copy(s, dst.path(), shift, BIG, &[]).unwrap();
        let m = std::fs::metadata(dst.path().join("in")).unwrap();
        assert_eq!((m.uid(), m.gid()), (2_000_005, 2_000_007));
        let m = std::fs::metadata(dst.path().join("out")).unwrap();
        assert_eq!((m.uid(), m.gid()), (42, 43));
    }

    #[test]
    fn bounds_bytes_and_entries() {
        let (src, dst) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        std::fs::write(src.path().join("f"), vec![0u8; 1000]).unwrap();
        let e = copy(
            src.path(),
            dst.path(),
            Shift::NONE,
            Limits {
                bytes: 999,
                entries: 10,
            },
            &[],
        )
        .unwrap_err();
        assert!(matches!(e, CopyError::TooLarge { unit: "bytes", .. }), "{e}");
        for i in 0..20 {
            std::fs::write(src.path().join(format!("g{i}")), b"").unwrap();
        }
        let dst = tempfile::tempdir().unwrap();
        let e = copy(
            src.path(),
            dst.path(),
            Shift::NONE,
            Limits {
                bytes: 1 << 20,
                entries: 10,
            },
            &[],
        )
        .unwrap_err();
        assert!(matches!(e, CopyError::TooLarge { unit: "entries", .. }), "{e}");
    }
}
