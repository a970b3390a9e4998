//! A container's writable layer (its overlay upper directory) written as an OCI layer tar,
//! for a snapshot. What is read there was written by the sandbox, so it is hostile: the tree
//! is walked through directory descriptors (`openat` with `O_NOFOLLOW`, each open checked
//! against the `fstatat` before it), links are stored as links and never followed, devices,
//! sockets and FIFOs are never opened, and depth, entries and bytes are bounded.
//!
//! Overlayfs marks a deleted file with a 0/0 character device and a directory whose lower
//! contents are hidden with an `overlay.opaque` xattr; the OCI layer format says the same
//! with `.wh.NAME` and `.wh..wh..opq` entries (OCI image-spec, layer.md "Whiteouts"). In a
//! user namespace the upper directory holds the range's host ids: each is stored as the id
//! the sandbox saw, so the layer is the same whichever range ran the sandbox.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::fcntl::AtFlags;
use nix::fcntl::{OFlag, openat};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat, fstatat};
use sha2::{Digest, Sha256};

/// The OCI whiteout prefix.
const WHITEOUT: &[u8] = b".wh.";
/// The OCI opaque-directory marker.
const OPAQUE: &[u8] = b".wh..wh..opq";
/// The xattrs overlayfs marks an opaque directory with (`userxattr` mounts use the second).
const OPAQUE_XATTRS: [&[u8]; 2] = [b"trusted.overlay.opaque\0", b"user.overlay.opaque\0"];
/// The id stored for a host id outside the sandbox's mapping (the kernel's overflow id).
const OVERFLOW_ID: u32 = 65_534;

/// How far a layer may go.
#[derive(Clone, Copy, Debug)]
pub struct LayerLimits {
    /// Bytes of file contents.
    pub max_bytes: u64,
    /// Entries (files, directories, links, whiteouts).
    pub max_entries: u64,
    /// Directory depth.
    pub max_depth: usize,
}

impl Default for LayerLimits {
    fn default() -> Self {
        LayerLimits {
            // Apparent sizes: a sparse file counts whole (the layer holds its zeros), so a
            // sandbox cannot make the host write more than this however little it stores.
            max_bytes: 10 << 30,
            max_entries: 2_000_000,
            max_depth: crate::confined::MAX_PACK_DEPTH as usize,
        }
    }
}

/// One range of a user namespace's id mapping: `size` ids from `container` inside are
/// `host` on the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdRange {
    pub container: u32,
    pub host: u32,
    pub size: u32,
}

/// How host ids in the upper directory become the sandbox's ids (empty: the same).
#[derive(Clone, Debug, Default)]
pub struct IdShift {
    pub uids: Vec<IdRange>,
    pub gids: Vec<IdRange>,
}

impl IdShift {
    fn map(ranges: &[IdRange], host: u32) -> u32 {
        if ranges.is_empty() {
            return host;
        }
        ranges
            .iter()
            .find(|r| host >= r.host && u64::from(host) < u64::from(r.host) + u64::from(r.size))
            .map_or(OVERFLOW_ID, |r| r.container + (host - r.host))
    }
}

/// What `write_layer` wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerReport {
    /// `sha256:…` of the tar (uncompressed: the layer's diffID and digest both).
    pub digest: String,
    /// Bytes of the tar.
    pub size: u64,
    pub entries: u64,
    /// Bytes of file contents.
    pub file_bytes: u64,
    /// Device nodes and sockets left out (a layer cannot hold a socket, and a device node
    /// is never carried from one sandbox to another).
    pub skipped: u64,
    /// Bytes of the tar the first section (`Section`) takes, from its start: that part alone
    /// is a tar of the section (without the end-of-archive blocks). 0 without a section.
    pub section_bytes: u64,
    /// Entries of the first section (its parents included).
    pub section_entries: u64,
}

/// A tree written into the layer before the writable layer's changes, under `prefix` (a
/// relative path): a sandbox's workspace at its mount point. It is walked as it is — not an
/// overlay layer, so nothing in it is a whiteout or an opaque marker — and FIFOs are left out
/// with devices and sockets (a workspace is restored by the host, which makes none of them).
/// Its parents are written as plain directories (0755, root) so the layer unpacks on its own.
pub struct Section<'a> {
    pub dir: &'a Path,
    pub prefix: &'a str,
    pub shift: &'a IdShift,
}

#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("{what} {path:?}: {source}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("the sandbox's changes are over the limit of {limit} {what}")]
    TooLarge { what: &'static str, limit: u64 },
    #[error("{path:?} changed while it was read")]
    Changed { path: String },
}

fn io_err<'a>(what: &'static str, path: &'a [u8]) -> impl FnOnce(io::Error) -> LayerError + 'a {
    move |source| LayerError::Io {
        what,
        path: String::from_utf8_lossy(path).into_owned(),
        source,
    }
}

fn errno<'a>(what: &'static str, path: &'a [u8]) -> impl FnOnce(nix::Error) -> LayerError + 'a {
    move |e| io_err(what, path)(io::Error::from(e))
}

/// Counts and hashes what goes to the file.
struct Hashing<W: Write> {
    inner: W,
    hasher: Sha256,
    written: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

struct Walk<'a, W: Write> {
    tar: tar::Builder<Hashing<W>>,
    shift: &'a IdShift,
    /// A plain tree (a `Section`), not an overlay upper directory.
    plain: bool,
    /// Paths (relative, no leading `/`) left out with everything under them.
    exclude: &'a [Vec<u8>],
    limits: LayerLimits,
    /// The first path of each multiply-linked file, by (device, inode).
    links: HashMap<(u64, u64), Vec<u8>>,
    entries: u64,
    file_bytes: u64,
    skipped: u64,
}

/// Write the changes in `upper` (a container's overlay upper directory) to `out` as an
/// uncompressed layer tar, leaving out `exclude` (rootfs paths such as mount points, with or
/// without a leading `/`). Blocking: call it on the blocking pool, with the sandbox frozen
/// (its files then hold still).
pub fn write_layer<W: Write>(
    upper: &Path,
    out: W,
    shift: &IdShift,
    exclude: &[String],
    limits: LayerLimits,
    first: Option<&Section<'_>>,
) -> Result<LayerReport, LayerError> {
    let shown = upper.as_os_str().as_bytes();
    let root = nix::dir::Dir::open(
        upper,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(errno("opening", shown))?;
    let exclude: Vec<Vec<u8>> = exclude
        .iter()
        .map(|p| p.trim_matches('/').as_bytes().to_vec())
        .filter(|p| !p.is_empty())
        .collect();
    let mut tar = tar::Builder::new(Hashing {
        inner: io::BufWriter::with_capacity(1 << 20, out),
        hasher: Sha256::new(),
        written: 0,
    });
    tar.mode(tar::HeaderMode::Complete);
    let no_exclude: Vec<Vec<u8>> = Vec::new();
    let mut walk = Walk {
        tar,
        shift,
        plain: true,
        exclude: &no_exclude,
        limits,
        links: HashMap::new(),
        entries: 0,
        file_bytes: 0,
        skipped: 0,
    };
    let (mut section_bytes, mut section_entries) = (0, 0);
    if let Some(section) = first {
        walk.shift = section.shift;
        walk.section(section)?;
        section_bytes = walk.tar.get_ref().written;
        section_entries = walk.entries;
        // A hard link never joins the two trees (they are different filesystems).
        walk.links.clear();
    }
    walk.shift = shift;
    walk.plain = false;
    walk.exclude = &exclude;
    walk.dir(root, b"", 0)?;
    let mut hashing = walk.tar.into_inner().map_err(io_err("finishing the layer", shown))?;
    hashing.flush().map_err(io_err("writing the layer", shown))?;
    Ok(LayerReport {
        digest: format!("sha256:{}", hex::encode(hashing.hasher.finalize())),
        size: hashing.written,
        entries: walk.entries,
        file_bytes: walk.file_bytes,
        skipped: walk.skipped,
        section_bytes,
        section_entries,
    })
}

/// How far a layer file has been written, for a reader that follows it (`follow`) while
/// the walk goes on: the walk never waits for the reader.
#[derive(Clone, Default)]
pub struct Growth(std::sync::Arc<(std::sync::Mutex<Grown>, std::sync::Condvar)>);

#[derive(Default)]
struct Grown {
    written: u64,
    /// The walk ended: `written` is the whole file (or it failed: nothing more is wanted).
    done: bool,
    failed: bool,
}

impl Growth {
    fn add(&self, n: u64) {
        let (state, cv) = &*self.0;
        state.lock().expect("growth lock").written += n;
        cv.notify_all();
    }

    /// The walk ended (`ok`: the file is whole).
    pub fn finish(&self, ok: bool) {
        let (state, cv) = &*self.0;
        let mut g = state.lock().expect("growth lock");
        g.done = true;
        g.failed = !ok;
        cv.notify_all();
    }

    /// A writer to the file that says how far it has got.
    pub fn counting<W: Write>(&self, inner: W) -> Counting<W> {
        Counting {
            inner,
            growth: self.clone(),
        }
    }
}

/// The layer file's writer, counted (`Growth`).
pub struct Counting<W: Write> {
    inner: W,
    growth: Growth,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.growth.add(n as u64);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Read the layer file `file` as it grows, in chunks of at most `chunk` bytes sent on
/// `out`, until the walk says it is done; blocking (the blocking pool). Stops early, sending
/// nothing more, when the walk failed or the receiver went away.
pub fn follow(
    mut file: File,
    growth: &Growth,
    chunk: usize,
    out: &tokio::sync::mpsc::Sender<Vec<u8>>,
) -> io::Result<()> {
    let (state, cv) = &*growth.0;
    let mut offset = 0u64;
    loop {
        let available = {
            let mut g = state.lock().expect("growth lock");
            while g.written == offset && !g.done {
                g = cv.wait(g).expect("growth lock");
            }
            if g.failed || (g.done && g.written == offset) {
                return Ok(());
            }
            g.written - offset
        };
        let mut buf = vec![0u8; available.min(chunk as u64) as usize];
        file.read_exact(&mut buf)?;
        offset += buf.len() as u64;
        if out.blocking_send(buf).is_err() {
            return Ok(());
        }
    }
}

impl<W: Write> Walk<'_, W> {
    fn count(&mut self) -> Result<(), LayerError> {
        self.entries += 1;
        if self.entries > self.limits.max_entries {
            return Err(LayerError::TooLarge {
                what: "entries",
                limit: self.limits.max_entries,
            });
        }
        Ok(())
    }

    fn header(&self, st: &FileStat, kind: tar::EntryType) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(st.st_mode & 0o7777);
        h.set_uid(u64::from(IdShift::map(&self.shift.uids, st.st_uid)));
        h.set_gid(u64::from(IdShift::map(&self.shift.gids, st.st_gid)));
        h.set_mtime(u64::try_from(st.st_mtime).unwrap_or(0));
        h.set_size(0);
        h
    }

    /// `section`'s parents, its root and its tree.
    fn section(&mut self, section: &Section<'_>) -> Result<(), LayerError> {
        let shown = section.dir.as_os_str().as_bytes();
        let root = nix::dir::Dir::open(
            section.dir,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(errno("opening", shown))?;
        let st = fstat(&root).map_err(errno("reading", shown))?;
        let comps: Vec<&str> = section.prefix.split('/').filter(|c| !c.is_empty()).collect();
        let mut path = Vec::new();
        for (i, comp) in comps.iter().enumerate() {
            path.extend_from_slice(comp.as_bytes());
            path.push(b'/');
            self.count()?;
            let mut h = if i + 1 == comps.len() {
                self.header(&st, tar::EntryType::Directory)
            } else {
                root_header(tar::EntryType::Directory, 0o755)
            };
            self.tar
                .append_data(&mut h, Path::new(OsStr::from_bytes(&path)), io::empty())
                .map_err(io_err("archiving", &path))?;
        }
        self.dir(root, &path, comps.len())
    }

    /// An empty marker entry (a whiteout or the opaque marker).
    fn marker(&mut self, path: &[u8]) -> Result<(), LayerError> {
        self.count()?;
        let mut h = root_header(tar::EntryType::Regular, 0o600);
        self.tar
            .append_data(&mut h, Path::new(OsStr::from_bytes(path)), io::empty())
            .map_err(io_err("archiving", path))
    }

    fn dir(&mut self, dir: nix::dir::Dir, prefix: &[u8], depth: usize) -> Result<(), LayerError> {
        if depth > self.limits.max_depth {
            return Err(LayerError::TooLarge {
                what: "directory levels",
                limit: self.limits.max_depth as u64,
            });
        }
        let mut dir = dir;
        let mut names = Vec::new();
        for entry in dir.iter() {
            let entry = entry.map_err(errno("reading", prefix))?;
            let name = entry.file_name().to_bytes();
            if name != b"." && name != b".." {
                names.push(name.to_vec());
            }
        }
        names.sort();
        let fd = dir.as_raw_fd();
        // SAFETY: `fd` is `dir`'s open descriptor and `dir` outlives every use of `parent`
        // below; `ManuallyDrop` keeps this second owner from closing it.
        let parent = std::mem::ManuallyDrop::new(unsafe { OwnedFd::from_raw_fd(fd) });
        for name in names {
            let mut member = prefix.to_vec();
            member.extend_from_slice(&name);
            if self.exclude.contains(&member) {
                continue;
            }
            let st =
                fstatat(&*parent, name.as_slice(), AtFlags::AT_SYMLINK_NOFOLLOW).map_err(errno("reading", &member))?;
            let kind = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
            match kind {
                SFlag::S_IFCHR if st.st_rdev == 0 && !self.plain => {
                    let mut path = prefix.to_vec();
                    path.extend_from_slice(WHITEOUT);
                    path.extend_from_slice(&name);
                    self.marker(&path)?;
                }
                SFlag::S_IFDIR => {
                    self.count()?;
                    let mut h = self.header(&st, tar::EntryType::Directory);
                    let mut path = member.clone();
                    path.push(b'/');
                    self.tar
                        .append_data(&mut h, Path::new(OsStr::from_bytes(&path)), io::empty())
                        .map_err(io_err("archiving", &member))?;
                    let child = openat(
                        &*parent,
                        name.as_slice(),
                        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                        Mode::empty(),
                    )
                    .map_err(errno("opening", &member))?;
                    same_file(&child, &st, &member)?;
                    if !self.plain && opaque(&child) {
                        let mut marker = path.clone();
                        marker.extend_from_slice(OPAQUE);
                        self.marker(&marker)?;
                    }
                    let child = nix::dir::Dir::from_fd(child).map_err(errno("opening", &member))?;
                    self.dir(child, &path, depth + 1)?;
                }
                SFlag::S_IFREG => self.file(&parent, &name, &member, &st)?,
                SFlag::S_IFLNK => {
                    self.count()?;
                    let target = nix::fcntl::readlinkat(&*parent, name.as_slice())
                        .map_err(errno("reading the link", &member))?;
                    let mut h = self.header(&st, tar::EntryType::Symlink);
                    self.tar
                        .append_link(&mut h, Path::new(OsStr::from_bytes(&member)), &target)
                        .map_err(io_err("archiving", &member))?;
                }
                SFlag::S_IFIFO if !self.plain => {
                    self.count()?;
                    let mut h = self.header(&st, tar::EntryType::Fifo);
                    self.tar
                        .append_data(&mut h, Path::new(OsStr::from_bytes(&member)), io::empty())
                        .map_err(io_err("archiving", &member))?;
                }
                _ => self.skipped += 1,
            }
        }
        drop(dir);
        Ok(())
    }

    fn file(&mut self, parent: &OwnedFd, name: &[u8], member: &[u8], st: &FileStat) -> Result<(), LayerError> {
        self.count()?;
        if st.st_nlink > 1 {
            let key = (st.st_dev, st.st_ino);
            if let Some(first) = self.links.get(&key).cloned() {
                let mut h = self.header(st, tar::EntryType::Link);
                return self
                    .tar
                    .append_link(
                        &mut h,
                        Path::new(OsStr::from_bytes(member)),
                        Path::new(OsStr::from_bytes(&first)),
                    )
                    .map_err(io_err("archiving", member));
            }
            self.links.insert(key, member.to_vec());
        }
        let size = u64::try_from(st.st_size).unwrap_or(0);
        self.file_bytes += size;
        if self.file_bytes > self.limits.max_bytes {
            return Err(LayerError::TooLarge {
                what: "bytes",
                limit: self.limits.max_bytes,
            });
        }
        // Non-blocking and checked: what was stat'ed is what is read.
        let fd = openat(
            parent,
            name,
            OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC | OFlag::O_NOCTTY,
            Mode::empty(),
        )
        .map_err(errno("opening", member))?;
        same_file(&fd, st, member)?;
        let mut h = self.header(st, tar::EntryType::Regular);
        h.set_size(size);
        let file = File::from(fd);
        // Exactly `size` bytes: a file that shrank under us is an error, not a corrupt tar.
        let mut data = Exact {
            inner: file.take(size),
            left: size,
        };
        self.tar
            .append_data(&mut h, Path::new(OsStr::from_bytes(member)), &mut data)
            .map_err(|e| match e.kind() {
                io::ErrorKind::UnexpectedEof => LayerError::Changed {
                    path: String::from_utf8_lossy(member).into_owned(),
                },
                _ => io_err("archiving", member)(e),
            })
    }
}

/// An empty entry's header of `kind` owned by root, of no time: what the layer adds of its
/// own (markers, a section's parents), not what it read.
fn root_header(kind: tar::EntryType, mode: u32) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_size(0);
    h
}

/// A reader that fails rather than end before `left` bytes.
struct Exact<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Read for Exact<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            return Ok(0);
        }
        let n = self.inner.read(buf)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the file shrank"));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

fn same_file(fd: &OwnedFd, st: &FileStat, member: &[u8]) -> Result<(), LayerError> {
    let now = fstat(fd).map_err(errno("reading", member))?;
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) || (now.st_mode ^ st.st_mode) & SFlag::S_IFMT.bits() != 0 {
        return Err(LayerError::Changed {
            path: String::from_utf8_lossy(member).into_owned(),
        });
    }
    Ok(())
}

/// Whether overlayfs marked the directory opaque.
fn opaque(dir: &OwnedFd) -> bool {
    OPAQUE_XATTRS.iter().any(|name| {
        let mut value = [0u8; 2];
        // SAFETY: `name` is NUL-terminated, `value` is a writable buffer of the length
        // given, and `dir` is an open descriptor for the duration of the call.
        let n = unsafe {
            libc::fgetxattr(
                dir.as_raw_fd(),
                name.as_ptr().cast(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        n == 1 && value[0] == b'y'
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(tar_file: &Path) -> Vec<(String, tar::EntryType, u64, u64, Vec<u8>)> {
        let mut archive = tar::Archive::new(File::open(tar_file).unwrap());
        archive
            .entries()
            .unwrap()
            .map(|e| {
                let mut e = e.unwrap();
                let path = e.path().unwrap().to_string_lossy().into_owned();
                let kind = e.header().entry_type();
                let (uid, gid) = (e.header().uid().unwrap(), e.header().gid().unwrap());
                let mut data = Vec::new();
                if kind == tar::EntryType::Symlink || kind == tar::EntryType::Link {
                    data = e.link_name_bytes().unwrap().into_owned();
                } else {
                    e.read_to_end(&mut data).unwrap();
                }
                (path, kind, uid, gid, data)
            })
            .collect()
    }

    fn xattr_set(path: &Path, name: &[u8]) {
        let p = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: NUL-terminated strings, a one-byte value.
        let rc = unsafe { libc::lsetxattr(p.as_ptr(), name.as_ptr().cast(), b"y".as_ptr().cast(), 1, 0) };
        assert_eq!(rc, 0, "{}", io::Error::last_os_error());
    }

    fn xattr_get(path: &Path, name: &[u8]) -> Option<u8> {
        let p = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
        let mut v = [0u8; 4];
        // SAFETY: NUL-terminated strings, a writable buffer of the length given.
        let n = unsafe { libc::lgetxattr(p.as_ptr(), name.as_ptr().cast(), v.as_mut_ptr().cast(), v.len()) };
        (n == 1).then_some(v[0])
    }

    #[test]
    fn a_written_layer_unpacks_to_the_same_tree_with_whiteouts() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        use std::path::PathBuf;
        let src = tempfile::tempdir().unwrap();
        let s = src.path();
        std::fs::create_dir_all(s.join("opt/d")).unwrap();
        std::fs::write(s.join("opt/d/blob"), vec![7u8; 100_000]).unwrap();
        std::fs::set_permissions(s.join("opt/d/blob"), std::fs::Permissions::from_mode(0o4750)).unwrap();
        std::fs::hard_link(s.join("opt/d/blob"), s.join("opt/hard")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", s.join("opt/link")).unwrap();
        // A deletion, as overlayfs records it.
        nix::sys::stat::mknod(
            &s.join("gone"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::empty(),
            0,
        )
        .unwrap();
        // A directory whose lower contents are hidden (overlayfs's opaque mark).
        std::fs::create_dir(s.join("fresh")).unwrap();
        xattr_set(&s.join("fresh"), b"user.overlay.opaque\0");
        let tar = tempfile::NamedTempFile::new().unwrap();
        write_layer(
            s,
            tar.reopen().unwrap(),
            &IdShift::default(),
            &[],
            LayerLimits::default(),
            None,
        )
        .unwrap();

        let dst = tempfile::tempdir().unwrap();
        let d = dst.path();
        crate::image::layer_apply::apply_layer(tar.path(), d, crate::image::layer_apply::XattrSpace::User).unwrap();
        assert_eq!(std::fs::read(d.join("opt/d/blob")).unwrap(), vec![7u8; 100_000]);
        let blob = std::fs::metadata(d.join("opt/d/blob")).unwrap();
        assert_eq!(blob.mode() & 0o7777, 0o4750);
        assert_eq!(std::fs::metadata(d.join("opt/hard")).unwrap().ino(), blob.ino());
        assert_eq!(
            std::fs::read_link(d.join("opt/link")).unwrap(),
            PathBuf::from("/etc/passwd")
        );
        assert_eq!(xattr_get(&d.join("fresh"), b"user.overlay.opaque\0"), Some(b'y'));
        assert!(!d.join("fresh/.wh..wh..opq").exists());
        let gone = std::fs::symlink_metadata(d.join("gone")).unwrap();
        use std::os::unix::fs::FileTypeExt;
        assert!(gone.file_type().is_char_device() && gone.rdev() == 0);
    }

    #[test]
    fn a_follower_reads_the_whole_file_as_it_grows_and_stops_when_the_walk_fails() {
        for ok in [true, false] {
            let file = tempfile::NamedTempFile::new().unwrap();
            let growth = Growth::default();
            let (tx, mut rx) = tokio::sync::mpsc::channel(2);
            let follower = {
                let (growth, reader) = (growth.clone(), file.reopen().unwrap());
                std::thread::spawn(move || follow(reader, &growth, 1000, &tx))
            };
            let mut out = growth.counting(file.reopen().unwrap());
            let mut written = Vec::new();
            for i in 0..50u8 {
                let part = vec![i; 777];
                out.write_all(&part).unwrap();
                written.extend_from_slice(&part);
            }
            // The walk ends before the follower has read it all (the channel holds two).
            growth.finish(ok);
            let mut read = Vec::new();
            while let Some(chunk) = rx.blocking_recv() {
                assert!(chunk.len() <= 1000);
                read.extend_from_slice(&chunk);
            }
            follower.join().unwrap().unwrap();
            if ok {
                assert_eq!(read, written);
            } else {
                assert!(read.len() < written.len(), "a failed walk's file is not sent whole");
            }
        }
    }

    #[test]
    fn a_layer_holds_changes_whiteouts_and_shifted_ids_but_not_what_is_excluded() {
        let dir = tempfile::tempdir().unwrap();
        let upper = dir.path().join("upper");
        std::fs::create_dir_all(upper.join("etc")).unwrap();
        std::fs::write(upper.join("etc/x"), b"hello").unwrap();
        std::fs::hard_link(upper.join("etc/x"), upper.join("etc/y")).unwrap();
        std::os::unix::fs::symlink("/etc/shadow", upper.join("etc/link")).unwrap();
        std::fs::create_dir_all(upper.join(".runner/agent")).unwrap();
        std::fs::write(upper.join(".runner/agent/secret"), b"no").unwrap();
        // A whiteout as overlayfs makes it (root may mknod a 0/0 char device).
        nix::sys::stat::mknod(&upper.join("etc/gone"), SFlag::S_IFCHR, Mode::from_bits_truncate(0), 0).unwrap();
        let out = dir.path().join("layer.tar");
        let report = write_layer(
            &upper,
            File::create(&out).unwrap(),
            &IdShift::default(),
            &["/.runner".to_string()],
            LayerLimits::default(),
            None,
        )
        .unwrap();
        let got = entries(&out);
        let names: Vec<&str> = got.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(names, ["etc/", "etc/.wh.gone", "etc/link", "etc/x", "etc/y"]);
        assert_eq!(got[2].4, b"/etc/shadow", "a link is stored, not followed");
        assert_eq!(got[3].4, b"hello");
        assert_eq!((got[4].1, got[4].4.as_slice()), (tar::EntryType::Link, &b"etc/x"[..]));
        let bytes = std::fs::read(&out).unwrap();
        assert_eq!(report.digest, crate::image::archive::sha256_bytes(&bytes));
        assert_eq!(report.size, bytes.len() as u64);
        assert_eq!(report.file_bytes, 5);
    }

    #[test]
    fn host_ids_of_a_range_become_the_sandbox_ids() {
        let dir = tempfile::tempdir().unwrap();
        let upper = dir.path().join("upper");
        std::fs::create_dir(&upper).unwrap();
        std::fs::write(upper.join("f"), b"").unwrap();
        let base = 1 << 30;
        std::os::unix::fs::lchown(upper.join("f"), Some(base + 1000), Some(base + 100)).unwrap();
        let range = |host| IdRange {
            container: 0,
            host,
            size: 65_536,
        };
        let shift = IdShift {
            uids: vec![range(base)],
            gids: vec![range(base)],
        };
        let out = dir.path().join("layer.tar");
        write_layer(
            &upper,
            File::create(&out).unwrap(),
            &shift,
            &[],
            LayerLimits::default(),
            None,
        )
        .unwrap();
        let got = entries(&out);
        assert_eq!((got[0].2, got[0].3), (1000, 100));
        assert_eq!(IdShift::map(&shift.uids, 7), OVERFLOW_ID, "an id outside the range");
    }

    #[test]
    fn limits_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let upper = dir.path().join("upper");
        std::fs::create_dir_all(upper.join("a/b/c")).unwrap();
        std::fs::write(upper.join("big"), vec![0u8; 100]).unwrap();
        let write = |limits| {
            write_layer(
                &upper,
                File::create(dir.path().join("l")).unwrap(),
                &IdShift::default(),
                &[],
                limits,
                None,
            )
        };
        let deep = LayerLimits {
            max_depth: 1,
            ..Default::default()
        };
        assert!(matches!(
            write(deep),
            Err(LayerError::TooLarge {
                what: "directory levels",
                ..
            })
        ));
        let small = LayerLimits {
            max_bytes: 10,
            ..Default::default()
        };
        assert!(matches!(write(small), Err(LayerError::TooLarge { what: "bytes", .. })));
    }

    #[test]
    fn a_section_comes_first_under_its_prefix_and_its_bytes_are_a_tar_of_it_alone() {
        let dir = tempfile::tempdir().unwrap();
        let upper = dir.path().join("upper");
        std::fs::create_dir_all(upper.join("opt")).unwrap();
        std::fs::write(upper.join("opt/tool"), b"rootfs change").unwrap();
        let ws = dir.path().join("ws");
        std::fs::create_dir_all(ws.join("src")).unwrap();
        std::fs::write(ws.join("src/main.py"), b"print(1)").unwrap();
        std::fs::hard_link(ws.join("src/main.py"), ws.join("copy.py")).unwrap();
        nix::unistd::mkfifo(&ws.join("fifo"), Mode::from_bits_truncate(0o600)).unwrap();
        // Not a whiteout in a plain tree: a device, left out.
        nix::sys::stat::mknod(&ws.join("dev0"), SFlag::S_IFCHR, Mode::from_bits_truncate(0), 0).unwrap();
        let me = nix::unistd::geteuid().as_raw();
        let shift = IdShift {
            uids: vec![IdRange {
                container: 1000,
                host: me,
                size: 1,
            }],
            gids: vec![],
        };
        let section = Section {
            dir: &ws,
            prefix: "/home/u/work",
            shift: &shift,
        };
        let out = dir.path().join("layer.tar");
        let report = write_layer(
            &upper,
            File::create(&out).unwrap(),
            &IdShift::default(),
            &[],
            LayerLimits::default(),
            Some(&section),
        )
        .unwrap();
        let names: Vec<String> = entries(&out).into_iter().map(|e| e.0).collect();
        assert_eq!(
            names,
            [
                "home/",
                "home/u/",
                "home/u/work/",
                "home/u/work/copy.py",
                "home/u/work/src/",
                "home/u/work/src/main.py",
                "opt/",
                "opt/tool"
            ]
        );
        assert_eq!(report.section_entries, 6);
        assert_eq!(report.skipped, 2, "the FIFO and the device");
        // The section's bytes alone read as a tar of the section.
        let bytes = std::fs::read(&out).unwrap();
        let prefix = &bytes[..report.section_bytes as usize];
        let mut archive = tar::Archive::new(prefix);
        let mut seen = Vec::new();
        for e in archive.entries().unwrap() {
            let e = e.unwrap();
            seen.push((e.path().unwrap().display().to_string(), e.header().uid().unwrap()));
        }
        assert_eq!(seen.len(), 6);
        assert_eq!(
            seen[3],
            ("home/u/work/copy.py".to_string(), 1000),
            "the owner as the sandbox saw it"
        );
        assert_eq!(seen[0].1, 0);
    }
}
