//! Tar upload: every member checked before anything is written, then created one by one
//! beneath directory descriptors.

use super::*;

/// A member as both passes see it.
pub(super) struct Member {
    /// The name as archived, for messages.
    pub(super) shown: String,
    pub(super) comps: Vec<Vec<u8>>,
    pub(super) kind: MemberKind,
    pub(super) mode: u32,
    pub(super) mtime: u64,
    pub(super) size: u64,
}

pub(super) enum MemberKind {
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
pub(super) enum Made {
    Dir,
    File,
    Symlink,
}

/// Reads the archive (through gzip when it starts with the gzip magic), failing once more than
/// `cap` bytes came out, and noting so in `over`: a tar error then means the cap.
pub(super) struct Capped<'a> {
    pub(super) inner: Box<dyn Read + 'a>,
    pub(super) left: u64,
    pub(super) over: Rc<Cell<bool>>,
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

/// Where an archive is read from: memory (an upload), or a file the host wrote (read at
/// offsets, so each pass reads it from the start whoever else holds it).
#[derive(Clone, Copy)]
pub enum Source<'a> {
    Bytes(&'a [u8]),
    File(&'a File),
}

/// A file read from offset 0 by `pread`, leaving the descriptor's own offset alone.
struct ReadAt<'a> {
    file: &'a File,
    pos: u64,
}

impl Read for ReadAt<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = std::os::unix::fs::FileExt::read_at(self.file, buf, self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

pub(super) fn tar_stream<'a>(
    source: Source<'a>,
    max_bytes: u64,
    over: Rc<Cell<bool>>,
) -> io::Result<tar::Archive<Capped<'a>>> {
    let mut raw: io::BufReader<Box<dyn Read + 'a>> = io::BufReader::new(match source {
        Source::Bytes(b) => Box::new(b),
        Source::File(file) => Box::new(ReadAt { file, pos: 0 }),
    });
    let gzip = io::BufRead::fill_buf(&mut raw)?.starts_with(&[0x1f, 0x8b]);
    let inner: Box<dyn Read + 'a> = if gzip {
        Box::new(flate2::read::MultiGzDecoder::new(raw))
    } else {
        Box::new(raw)
    };
    Ok(tar::Archive::new(Capped {
        inner,
        // File data plus room for headers and padding: headers alone cannot make a bomb.
        left: max_bytes.saturating_add(MAX_ARCHIVE_BYTES),
        over,
    }))
}

/// A failure while reading the stream: the cap, or a corrupt archive.
pub(super) fn stream_error(over: &Cell<bool>, max_bytes: u64, after: &str, e: io::Error) -> ConfinedError {
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

pub(super) fn bad(member: &str, reason: impl Into<String>) -> ConfinedError {
    ConfinedError::BadArchive {
        member: member.to_string(),
        reason: reason.into(),
    }
}

pub(super) fn read_member<R: Read>(entry: &tar::Entry<'_, R>, strip: &[Vec<u8>]) -> Result<Member> {
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
            let comps: Vec<Vec<u8>> = split_components(&target)
                .map_err(|reason| bad(&shown, format!("hard link target {reason}")))?
                .into_iter()
                .map(<[u8]>::to_vec)
                .collect();
            match comps.strip_prefix(strip) {
                Some(rest) if !rest.is_empty() => MemberKind::HardLink(rest.to_vec()),
                _ => return Err(bad(&shown, "hard link target outside the archive's tree")),
            }
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
    if !strip.is_empty() {
        match member.comps.strip_prefix(strip) {
            Some(rest) => member.comps = rest.to_vec(),
            // The tree's own directory and those above it: the target and its parents.
            None if strip.starts_with(&member.comps) && matches!(member.kind, MemberKind::Dir) => {
                member.kind = MemberKind::Skip;
                return Ok(member);
            }
            None => {
                let under = String::from_utf8_lossy(&join(strip)).into_owned();
                return Err(bad(&shown, format!("outside {under:?}, the archive's tree")));
            }
        }
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
pub(super) fn validate_archive(source: Source<'_>, max_bytes: u64, options: &UnpackOptions) -> Result<()> {
    let over = Rc::new(Cell::new(false));
    let strip = options.strip_components()?;
    let mut tar =
        tar_stream(source, max_bytes, over.clone()).map_err(|e| stream_error(&over, max_bytes, "(start)", e))?;
    let entries = tar
        .entries()
        .map_err(|e| stream_error(&over, max_bytes, "(start)", e))?;
    let mut made: HashMap<Vec<u8>, Made> = HashMap::new();
    let (mut count, mut bytes) = (0u64, 0u64);
    let mut last = String::from("(start)");
    for entry in entries {
        let entry = entry.map_err(|e| stream_error(&over, max_bytes, &format!("(after {last})"), e))?;
        let m = read_member(&entry, &strip)?;
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
pub(super) fn extract_archive(
    dir: OwnedFd,
    base: &str,
    source: Source<'_>,
    owner: Option<Owner>,
    max_bytes: u64,
    options: &UnpackOptions,
) -> Result<UnpackReport> {
    let base = if base == "." { "" } else { base };
    let over = Rc::new(Cell::new(false));
    let strip = options.strip_components()?;
    let keep = options.keep_existing;
    let mut tar =
        tar_stream(source, max_bytes, over.clone()).map_err(|e| stream_error(&over, max_bytes, "(start)", e))?;
    let entries = tar
        .entries()
        .map_err(|e| stream_error(&over, max_bytes, "(start)", e))?;
    let mut report = UnpackReport::default();
    // Consecutive members mostly share a parent: keep its descriptor.
    let mut parent_cache: Option<(Vec<Vec<u8>>, OwnedFd)> = None;
    let mut last = String::from("(start)");
    for entry in entries {
        let mut entry = entry.map_err(|e| stream_error(&over, max_bytes, &format!("(after {last})"), e))?;
        let m = read_member(&entry, &strip)?;
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
                match walk_dirs(dir.as_fd(), &comps, Some(owner), base) {
                    Ok(fd) => fd,
                    // What is there stays: a non-directory where the member's parent would
                    // be keeps the member out.
                    Err(ConfinedError::NotADirectory { .. } | ConfinedError::IsSymlink { .. }) if keep => {
                        report.kept += 1;
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        let p = parent.as_fd();
        match &m.kind {
            MemberKind::Dir => {
                if extract_dir(p, name, &m, owner, &shown, keep)? {
                    report.dirs += 1;
                } else {
                    report.kept += 1;
                }
            }
            MemberKind::File => {
                let made = create_fresh(p, name, &m, &shown, keep, |p, name| {
                    open_beneath(
                        p,
                        name,
                        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_NOCTTY,
                        0o600,
                        NO_SYMLINKS,
                    )
                })?;
                let Some(fd) = made else {
                    report.kept += 1;
                    parent_cache = Some((parent_comps.to_vec(), parent));
                    continue;
                };
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
                let made = create_fresh(p, name, &m, &shown, keep, |p, name| {
                    nix::unistd::symlinkat(target.as_slice(), p, name)
                })?;
                if made.is_none() {
                    report.kept += 1;
                } else {
                    if owner.is_some() {
                        chown_symlink(p, name, owner, &shown)?;
                    }
                    report.symlinks += 1;
                }
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
                let made = create_fresh(p, name, &m, &shown, keep, |p, name| {
                    // No AT_SYMLINK_FOLLOW: a symlink swapped in is linked, not followed.
                    nix::unistd::linkat(tdir.as_fd(), tname.as_slice(), p, name, AtFlags::empty())
                })?;
                if made.is_some() {
                    report.hardlinks += 1;
                } else {
                    report.kept += 1;
                }
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
/// With `keep`, whatever holds the name stays and nothing is made (`None`).
pub(super) fn create_fresh<T>(
    parent: BorrowedFd<'_>,
    name: &[u8],
    m: &Member,
    shown: &str,
    keep: bool,
    mut make: impl FnMut(BorrowedFd<'_>, &[u8]) -> nix::Result<T>,
) -> Result<Option<T>> {
    for _ in 0..RACE_RETRIES {
        match make(parent, name) {
            Ok(made) => return Ok(Some(made)),
            Err(Errno::EEXIST) if keep => return Ok(None),
            Err(Errno::EEXIST) => remove_non_dir(parent, name, m, shown)?,
            Err(e) => return Err(errno_error("creating", shown, e)),
        }
    }
    Err(busy("creating", shown))
}

pub(super) fn remove_non_dir(parent: BorrowedFd<'_>, name: &[u8], m: &Member, shown: &str) -> Result<()> {
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

pub(super) fn extract_dir(
    parent: BorrowedFd<'_>,
    name: &[u8],
    m: &Member,
    owner: Option<Owner>,
    shown: &str,
    keep: bool,
) -> Result<bool> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW;
    for _ in 0..RACE_RETRIES {
        match open_beneath(parent, name, flags, 0, NO_SYMLINKS) {
            // An existing directory stays as it is.
            Ok(_) => return Ok(!keep),
            Err(Errno::ENOENT) => {}
            // A non-directory (a symlink included) is in the way: it stays with `keep` (and
            // what the archive has beneath it is kept out), else it goes.
            Err(Errno::ELOOP | Errno::ENOTDIR) if keep => return Ok(false),
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
                return chmod_fd(fd.as_fd(), m.mode, shown).map(|()| true);
            }
            Err(Errno::ENOENT) => continue,
            Err(e) => return Err(errno_error("opening", shown, e)),
        }
    }
    Err(busy("creating the directory", shown))
}

/// Gives a just-made symlink its owner through an `O_PATH` descriptor of the link itself
/// (`AT_EMPTY_PATH`), so the change never lands on whatever a link points to.
pub(super) fn chown_symlink(parent: BorrowedFd<'_>, name: &[u8], owner: Option<Owner>, shown: &str) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::confined::testing::*;

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
    fn a_tree_under_a_prefix_is_unpacked_beside_what_is_there_which_stays() {
        let fx = Fixture::new();
        fx.mkdir("ws");
        fx.put("ws/mine", b"job's own");
        fx.put("ws/blocker", b"a file where the archive has a directory");
        fx.link("ws/planted", fx.outside());
        // A layer's first part: no end-of-archive blocks (the rest of the layer follows).
        let section = [
            dir_m("home/"),
            dir_m("home/u/"),
            dir_m("home/u/work/"),
            file_m("home/u/work/mine", b"snapshot's"),
            file_m("home/u/work/new", b"from the snapshot"),
            dir_m("home/u/work/blocker/"),
            file_m("home/u/work/blocker/inner", b"kept out"),
            file_m("home/u/work/planted", b"never through the link"),
            dir_m("home/u/work/d/"),
            file_m("home/u/work/d/f", b"deep"),
            hardlink_m("home/u/work/d/g", "home/u/work/d/f"),
        ]
        .concat();
        let file = tempfile::tempfile().unwrap();
        std::os::unix::fs::FileExt::write_all_at(&file, &section, 0).unwrap();
        let options = UnpackOptions {
            strip: "home/u/work",
            keep_existing: true,
        };
        let report = fx
            .root
            .unpack_tar_from("ws", Source::File(&file), None, MIB, options)
            .unwrap();
        assert_eq!(fs::read(fx.rp().join("ws/mine")).unwrap(), b"job's own");
        assert_eq!(fs::read(fx.rp().join("ws/new")).unwrap(), b"from the snapshot");
        assert_eq!(fs::read(fx.rp().join("ws/d/f")).unwrap(), b"deep");
        assert_eq!(fs::read(fx.rp().join("ws/d/g")).unwrap(), b"deep");
        assert!(fx.rp().join("ws/blocker").is_file());
        assert!(fx.rp().join("ws/planted").is_symlink());
        assert!(!fx.rp().join("home").exists());
        // mine, blocker (a directory member), blocker/inner, planted.
        assert_eq!(report.kept, 4, "{report:?}");
        assert_eq!((report.files, report.hardlinks, report.dirs), (2, 1, 1), "{report:?}");
        fx.assert_outside_unchanged();
        // Twice: everything is kept the second time.
        let again = fx
            .root
            .unpack_tar_from("ws", Source::File(&file), None, MIB, options)
            .unwrap();
        assert_eq!((again.files, again.dirs), (0, 0), "{again:?}");

        // A member outside the prefix is refused before anything is written.
        let stray = [file_m("home/u/work/ok", b"x"), file_m("etc/passwd", b"root")].concat();
        let e = assert_err(
            fx.root
                .unpack_tar_from("other", Source::Bytes(&stray), None, MIB, options),
            "BadArchive",
        );
        assert!(e.to_string().contains("outside"), "{e}");
        assert!(!fx.rp().join("other").exists());
        let bad_link = [file_m("home/u/work/f", b"x"), hardlink_m("home/u/work/g", "etc/passwd")].concat();
        assert_err(
            fx.root
                .unpack_tar_from("other", Source::Bytes(&bad_link), None, MIB, options),
            "BadArchive",
        );
    }
}
