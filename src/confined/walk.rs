//! Walks of a whole tree for the host's own bookkeeping: its disk usage (ephemeral storage)
//! and clearing setuid/setgid bits.

use super::*;

/// The state of one [`Root::disk_usage`] walk.
pub(super) struct UsageWalk<'a> {
    pub(super) dev: u64,
    pub(super) stop_at: u64,
    /// Inodes with more than one link, counted once.
    pub(super) linked: std::collections::HashSet<u64>,
    /// The `FullFile` looked out for: its size, and its time as (seconds, nanoseconds).
    pub(super) full: Option<(u64, (i64, i64))>,
    pub(super) usage: &'a mut DiskUsage,
}

impl UsageWalk<'_> {
    pub(super) fn charge(&mut self, st: &FileStat) {
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

    fn note_full(&mut self, st: &FileStat, shown: &str, name: &[u8]) {
        let Some((size, since)) = self.full else { return };
        if self.usage.full_file.is_none()
            && file_type(st) == libc::S_IFREG
            && u64::try_from(st.st_size).unwrap_or(0) >= size
            && (st.st_ctime, st.st_ctime_nsec) > since
        {
            self.usage.full_file = Some(child_shown(shown, name));
        }
    }

    pub(super) fn dir(&mut self, mut dir: Dir, shown: &str, depth: u64) -> Result<()> {
        each_entry(&mut dir, shown, |fd, name| {
            if self.usage.stopped {
                return Ok(false);
            }
            let st = match nix::sys::stat::fstatat(fd, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                Err(e) if changed_meanwhile(e) => return Ok(true),
                Err(e) => return Err(errno_error("inspecting", &child_shown(shown, name), e)),
            };
            if st.st_dev != self.dev {
                return Ok(true);
            }
            self.charge(&st);
            if file_type(&st) != libc::S_IFDIR {
                self.note_full(&st, shown, name);
                return Ok(true);
            }
            if depth >= MAX_PACK_DEPTH {
                self.usage.too_deep = true;
                return Ok(true);
            }
            let child = child_shown(shown, name);
            let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW;
            let Some(sub) = open_entry(fd, name, flags, &child)? else {
                return Ok(true);
            };
            let sub = Dir::from_fd(sub).map_err(|e| errno_error("reading", &child, e))?;
            self.dir(sub, &child, depth + 1)?;
            Ok(true)
        })
    }
}

/// Entry `name` of the directory `fd` opened with `flags`, never through a link; `None` when
/// it changed since it was looked at (removed, replaced, or a mount point: EXDEV, another
/// filesystem's, not the tree's). `shown` names it in errors.
pub(super) fn open_entry(
    fd: std::os::fd::BorrowedFd<'_>,
    name: &[u8],
    flags: OFlag,
    shown: &str,
) -> Result<Option<std::os::fd::OwnedFd>> {
    match open_beneath(fd, name, flags, 0, NO_SYMLINKS) {
        Ok(opened) => Ok(Some(opened)),
        Err(e) if changed_meanwhile(e) => Ok(None),
        Err(e) => Err(errno_error("opening", shown, e)),
    }
}

/// Each entry of `dir` but `.` and `..`, handed to `f` as it is read, never collected first:
/// a sandbox can put a million names in one directory (hard links cost it no disk), and a
/// list of them cost the host ~1.7 times the directory's size, at every level of a walk. So a
/// walk holds one directory stream per level of depth. `f` answers whether to read on.
pub(super) fn each_entry(
    dir: &mut Dir,
    shown: &str,
    mut f: impl FnMut(std::os::fd::BorrowedFd<'_>, &[u8]) -> Result<bool>,
) -> Result<()> {
    use std::os::fd::{AsRawFd, BorrowedFd};
    // The stream is borrowed mutably while it is read, so `f` gets its descriptor by number:
    // `dir` outlives the loop, and `fstatat`/`openat` beneath it never move its position.
    let raw = dir.as_raw_fd();
    for entry in dir.iter() {
        let entry = entry.map_err(|e| errno_error("reading", shown, e))?;
        let name = entry.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        // SAFETY: `raw` is `dir`'s open descriptor, which lives (unclosed) until `dir` drops,
        // after this loop.
        let at = unsafe { BorrowedFd::borrow_raw(raw) };
        if !f(at, name)? {
            break;
        }
    }
    Ok(())
}

/// [`Root::clear_setid`] for one directory, recursing through descriptors.
pub(super) fn clear_setid_in(mut dir: Dir, shown: &str, depth: u64, report: &mut SetidReport) -> Result<()> {
    each_entry(&mut dir, shown, |fd, name| {
        report.entries += 1;
        let st = match nix::sys::stat::fstatat(fd, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(e) if changed_meanwhile(e) => return Ok(true),
            Err(e) => return Err(errno_error("inspecting", &child_shown(shown, name), e)),
        };
        let child = || child_shown(shown, name);
        match file_type(&st) {
            libc::S_IFREG if st.st_mode & (libc::S_ISUID | libc::S_ISGID) != 0 => {
                let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_NOCTTY;
                let Some(file) = open_entry(fd, name, flags, &child())? else {
                    report.skipped += 1;
                    return Ok(true);
                };
                let st = fstat(file.as_fd(), &child())?;
                if file_type(&st) == libc::S_IFREG && st.st_mode & (libc::S_ISUID | libc::S_ISGID) != 0 {
                    chmod_fd(file.as_fd(), st.st_mode & 0o1777, &child())?;
                    report.cleared += 1;
                }
            }
            libc::S_IFDIR if depth >= MAX_PACK_DEPTH => report.skipped += 1,
            libc::S_IFDIR => {
                let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW;
                let Some(sub) = open_entry(fd, name, flags, &child())? else {
                    report.skipped += 1;
                    return Ok(true);
                };
                let sub = Dir::from_fd(sub).map_err(|e| errno_error("reading", &child(), e))?;
                clear_setid_in(sub, &child(), depth + 1, report)?;
            }
            _ => {}
        }
        Ok(true)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::confined::testing::*;

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
}
