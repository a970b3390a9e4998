//! Tar download: a tree walked through descriptors, links stored as links.

use super::*;

pub(super) type Builder<'a> = tar::Builder<&'a mut dyn Write>;

pub(super) fn header(st: &FileStat, kind: tar::EntryType, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(st.st_mode & 0o777);
    h.set_uid(u64::from(st.st_uid));
    h.set_gid(u64::from(st.st_gid));
    h.set_mtime(u64::try_from(st.st_mtime).unwrap_or(0));
    h.set_size(size);
    h
}

pub(super) fn archive_io(shown: &str) -> impl FnOnce(io::Error) -> ConfinedError + '_ {
    move |source| ConfinedError::Io {
        op: "archiving",
        path: shown.to_string(),
        source,
    }
}

pub(super) fn pack_file(
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
pub(super) fn pack_dir(
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
    // In the directory's order, as tar without --sort: sorting would need every name first
    // (see `walk::each_entry`).
    super::walk::each_entry(&mut dir, shown, |fd, name| {
        let child = child_shown(shown, name);
        let mut member = prefix.to_vec();
        member.extend_from_slice(name);
        // A look that opens nothing first: devices, FIFOs and sockets are never opened.
        let st = match nix::sys::stat::fstatat(fd, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::ENOENT) => return Ok(true),
            Err(e) => return Err(errno_error("inspecting", &child, e)),
        };
        match file_type(&st) {
            libc::S_IFLNK => match nix::fcntl::readlinkat(fd, name) {
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
                let Some(sub) = super::walk::open_entry(fd, name, flags, &child)? else {
                    report.skipped += 1;
                    return Ok(true);
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
                let Some(file) = super::walk::open_entry(fd, name, flags, &child)? else {
                    report.skipped += 1;
                    return Ok(true);
                };
                let st = fstat(file.as_fd(), &child)?;
                if file_type(&st) != libc::S_IFREG {
                    report.skipped += 1;
                    return Ok(true);
                }
                pack_file(builder, File::from(file), &st, &member, &child, report)?;
            }
            _ => report.skipped += 1,
        }
        Ok(true)
    })
}

/// Yields exactly `left` bytes: the file's own while it has them, then zeros, so a file that
/// shrinks or grows while it is read cannot disagree with the size already in its header.
pub(super) struct Exactly<R> {
    pub(super) inner: R,
    pub(super) left: u64,
    pub(super) ended: bool,
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
    use crate::confined::testing::*;

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
        let mut members: Vec<_> = members_of(&archive)
            .into_iter()
            .map(|(name, kind, data, link)| (name, kind, String::from_utf8(data).unwrap(), link))
            .collect();
        // In the directories' order, a directory before what it holds.
        let at = |name: &str| members.iter().position(|m| m.0 == name).unwrap();
        assert!(at("sub/") < at("sub/g") && at("sub/") < at("sub/dir"), "{members:?}");
        members.sort_by(|a, b| a.0.cmp(&b.0));
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
}
