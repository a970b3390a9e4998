//! A snapshot's layer tar (as runtime's layer writer wrote it) unpacked straight into the
//! upper directory of an overlayfs snapshot prepared on the base image's chain: what
//! containerd's Diff.Apply does, without sending the layer through containerd twice (once
//! to its content store, once more read back from there to unpack). The commit runs this
//! beside the content store's write of the same tar, so the two take the time of one.
//!
//! Only runner's own layer files are unpacked here: their paths are clean (every component
//! a name read from a directory, never `.` or `..`, directories before what is in them, a
//! link only ever a last component, a hard link only to a regular file before it), and that
//! is checked as each entry is read, so a name cannot lead out of the upper directory.
//! Whiteouts become what overlayfs reads: a `.wh.NAME` entry a 0/0 character device NAME,
//! the opaque marker the `overlay.opaque` xattr of its directory.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

/// What overlayfs reads an opaque directory's xattr as: `trusted.` normally, `user.` on a
/// mount with `userxattr` (an overlay mounted in a user namespace).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XattrSpace {
    Trusted,
    User,
}

impl XattrSpace {
    /// The space a snapshot's overlay mount options say.
    pub fn of_options(options: &[String]) -> XattrSpace {
        if options.iter().any(|o| o == "userxattr") {
            XattrSpace::User
        } else {
            XattrSpace::Trusted
        }
    }

    fn opaque(self) -> &'static [u8] {
        match self {
            XattrSpace::Trusted => b"trusted.overlay.opaque\0",
            XattrSpace::User => b"user.overlay.opaque\0",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("{what} {path:?}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the layer's entry {0:?} is not a clean relative path")]
    Path(PathBuf),
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> ApplyError + 'a {
    move |source| ApplyError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// A clean relative path (only normal components), or an error.
fn clean(path: &Path) -> Result<PathBuf, ApplyError> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            _ => return Err(ApplyError::Path(path.to_path_buf())),
        }
    }
    if out.as_os_str().is_empty() {
        return Err(ApplyError::Path(path.to_path_buf()));
    }
    Ok(out)
}

/// No component of `rel` but the last is anything but a directory made here: no entry goes
/// through a link (the layer never has one as a parent; this says so).
fn parents_are_dirs(upper: &Path, rel: &Path) -> Result<(), ApplyError> {
    let mut at = upper.to_path_buf();
    let parts: Vec<_> = rel.components().collect();
    for part in &parts[..parts.len().saturating_sub(1)] {
        at.push(part);
        let meta = std::fs::symlink_metadata(&at).map_err(io_err("reading", &at))?;
        if !meta.is_dir() {
            return Err(ApplyError::Path(rel.to_path_buf()));
        }
    }
    Ok(())
}

/// Unpack the layer tar at `layer` into `upper` (an empty overlay upper directory). Blocking.
pub fn apply_layer(layer: &Path, upper: &Path, space: XattrSpace) -> Result<u64, ApplyError> {
    let file = File::open(layer).map_err(io_err("opening", layer))?;
    let mut archive = tar::Archive::new(io::BufReader::with_capacity(1 << 20, file));
    archive.set_preserve_permissions(true);
    archive.set_preserve_ownerships(true);
    archive.set_preserve_mtime(true);
    archive.set_unpack_xattrs(false);
    archive.set_overwrite(false);
    let mut entries = 0u64;
    let mut dirs = Vec::new();
    for entry in archive.entries().map_err(io_err("reading", layer))? {
        let mut entry = entry.map_err(io_err("reading", layer))?;
        entries += 1;
        let raw = entry.path().map_err(io_err("reading", layer))?.into_owned();
        let rel = clean(&raw)?;
        parents_are_dirs(upper, &rel)?;
        let target = upper.join(&rel);
        let name = rel.file_name().map(|n| n.as_bytes()).unwrap_or_default();
        let parent = target.parent().unwrap_or(upper).to_path_buf();
        if name == b".wh..wh..opq" {
            set_opaque(&parent, space)?;
            continue;
        }
        if let Some(hidden) = name.strip_prefix(b".wh.") {
            let node = parent.join(OsStr::from_bytes(hidden));
            nix::sys::stat::mknod(&node, nix::sys::stat::SFlag::S_IFCHR, nix::sys::stat::Mode::empty(), 0)
                .map_err(|e| io_err("making the whiteout", &node)(e.into()))?;
            continue;
        }
        match entry.header().entry_type() {
            tar::EntryType::Link => {
                let link = entry
                    .link_name()
                    .map_err(io_err("reading", layer))?
                    .ok_or_else(|| ApplyError::Path(rel.clone()))?;
                let source = upper.join(clean(&link)?);
                parents_are_dirs(upper, &clean(&link)?)?;
                std::fs::hard_link(&source, &target).map_err(io_err("linking", &target))?;
            }
            kind => {
                if kind == tar::EntryType::Directory {
                    dirs.push((target.clone(), entry.header().mtime().unwrap_or(0)));
                }
                entry.unpack(&target).map_err(io_err("unpacking", &target))?;
            }
        }
    }
    // A directory's time as the layer says, once what is in it is made (which changed it).
    for (dir, mtime) in dirs.iter().rev() {
        let t = nix::sys::time::TimeSpec::new(*mtime as i64, 0);
        let _ = nix::sys::stat::utimensat(
            nix::fcntl::AT_FDCWD,
            dir,
            &t,
            &t,
            nix::sys::stat::UtimensatFlags::NoFollowSymlink,
        );
    }
    Ok(entries)
}

fn set_opaque(dir: &Path, space: XattrSpace) -> Result<(), ApplyError> {
    let path = CString::new(dir.as_os_str().as_bytes()).map_err(|_| ApplyError::Path(dir.to_path_buf()))?;
    // SAFETY: both strings are NUL-terminated, the value is one byte long as given.
    let rc = unsafe {
        libc::lsetxattr(
            path.as_ptr(),
            space.opaque().as_ptr().cast(),
            b"y".as_ptr().cast(),
            1,
            0,
        )
    };
    if rc != 0 {
        return Err(io_err("marking opaque", dir)(io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_out_of_the_directory_are_refused() {
        assert!(clean(Path::new("../etc/passwd")).is_err());
        assert!(clean(Path::new("/etc/passwd")).is_err());
        assert!(clean(Path::new("")).is_err());
        assert_eq!(clean(Path::new("./a/b")).unwrap(), PathBuf::from("a/b"));
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/etc", dir.path().join("l")).unwrap();
        assert!(matches!(
            parents_are_dirs(dir.path(), Path::new("l/passwd")),
            Err(ApplyError::Path(_))
        ));
    }
}
