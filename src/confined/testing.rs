//! What the tests of every part share: a workspace with secrets beside it, archive builders.

use super::*;
pub(super) use std::collections::BTreeMap;
pub(super) use std::fs;
pub(super) use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
pub(super) use std::sync::Arc;
pub(super) use std::sync::atomic::{AtomicBool, Ordering};
pub(super) use std::sync::mpsc;
pub(super) use std::thread;
pub(super) use std::time::{Duration, Instant};

pub(super) const SECRET: &[u8] = b"TOP-SECRET-outside-the-workspace";

/// `tmp/ws/root` is the workspace; `tmp/ws/outside` (with secrets), `tmp/beside` and the
/// directories themselves are everything an escape could touch.
pub(super) struct Fixture {
    pub(super) tmp: tempfile::TempDir,
    pub(super) root: Arc<Root>,
    pub(super) before: BTreeMap<PathBuf, String>,
}

impl Fixture {
    pub(super) fn new() -> Fixture {
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

    pub(super) fn rp(&self) -> PathBuf {
        self.tmp.path().join("ws/root")
    }

    pub(super) fn outside(&self) -> PathBuf {
        self.tmp.path().join("ws/outside")
    }

    /// Names, kinds, sizes, modes, mtimes and link targets of everything but the root.
    pub(super) fn snapshot(&self) -> BTreeMap<PathBuf, String> {
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
    pub(super) fn assert_outside_unchanged(&self) {
        assert_eq!(self.snapshot(), self.before, "something outside the root changed");
    }

    pub(super) fn mkdir(&self, rel: &str) {
        fs::create_dir_all(self.rp().join(rel)).unwrap();
    }

    pub(super) fn put(&self, rel: &str, data: &[u8]) {
        fs::write(self.rp().join(rel), data).unwrap();
    }

    pub(super) fn link(&self, at: &str, target: impl AsRef<Path>) {
        symlink(target, self.rp().join(at)).unwrap();
    }

    pub(super) fn write(&self, rel: &str, data: &[u8], parents: bool) -> Result<u64> {
        self.root.write_file(rel, &mut &data[..], parents, None)
    }

    pub(super) fn read(&self, rel: &str) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.root.open_read(rel)?.read_to_end(&mut out).unwrap();
        assert_no_secret(&out);
        Ok(out)
    }

    pub(super) fn pack(&self, rel: &str) -> Result<(Vec<u8>, PackReport)> {
        let mut out = Vec::new();
        let report = self.root.pack_tar(rel, &mut out)?;
        assert_no_secret(&out);
        Ok((out, report))
    }
}

#[track_caller]
pub(super) fn assert_no_secret(bytes: &[u8]) {
    assert!(
        !bytes.windows(SECRET.len()).any(|w| w == SECRET),
        "the outside secret came back"
    );
}

pub(super) fn variant(e: &ConfinedError) -> &'static str {
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
pub(super) fn assert_err<T: std::fmt::Debug>(result: Result<T>, expected: &str) -> ConfinedError {
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
pub(super) fn within_5s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(5)).expect("the operation blocked")
}

// -- archives made by hand, so they can hold what well-behaved writers refuse to write

pub(super) fn member(name: &[u8], kind: tar::EntryType, mode: u32, data: &[u8], link: &[u8]) -> Vec<u8> {
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

pub(super) fn file_m(name: &str, data: &[u8]) -> Vec<u8> {
    member(name.as_bytes(), tar::EntryType::Regular, 0o644, data, b"")
}

pub(super) fn dir_m(name: &str) -> Vec<u8> {
    member(name.as_bytes(), tar::EntryType::Directory, 0o755, b"", b"")
}

pub(super) fn symlink_m(name: &str, target: &str) -> Vec<u8> {
    member(name.as_bytes(), tar::EntryType::Symlink, 0o777, b"", target.as_bytes())
}

pub(super) fn hardlink_m(name: &str, target: &str) -> Vec<u8> {
    member(name.as_bytes(), tar::EntryType::Link, 0o644, b"", target.as_bytes())
}

pub(super) fn tarball(members: &[Vec<u8>]) -> Vec<u8> {
    let mut out = members.concat();
    out.extend_from_slice(&[0; 1024]);
    out
}

pub(super) fn gzip(data: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(data).unwrap();
    enc.finish().unwrap()
}

pub(super) fn members_of(archive: &[u8]) -> Vec<(String, tar::EntryType, Vec<u8>, Option<String>)> {
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

pub(super) const MIB: u64 = 1 << 20;

// ---- paths
