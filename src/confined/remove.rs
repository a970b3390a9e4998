//! Removing a tree a sandbox made, whatever its shape.

use super::*;

/// The most operations one [`remove_tree_at`] does: a sandbox still running could refill a
/// tree as fast as it is emptied.
pub(super) const REMOVE_BUDGET: u64 = 50_000_000;

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
pub(super) enum Removal {
    Done,
    /// The directory being emptied was removed by someone else.
    Restart,
}

/// Passes of [`remove_tree_at`] at most.
pub(super) const REMOVE_RESTARTS: usize = 8;

pub(super) fn remove_once(parent: BorrowedFd<'_>, name: &[u8], budget: &mut u64) -> io::Result<Removal> {
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
pub(super) fn open_subdir(dir: BorrowedFd<'_>, name: &[u8]) -> nix::Result<OwnedFd> {
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
pub(super) fn empty_level(
    dir: BorrowedFd<'_>,
    budget: &mut u64,
    first_error: &mut Option<io::Error>,
) -> io::Result<Vec<Vec<u8>>> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::confined::testing::*;

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
}
