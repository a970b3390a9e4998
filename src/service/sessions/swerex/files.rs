//! SWE-ReX's file calls: `read_file`, `write_file`, `upload` (a file, or a zip extracted).
//! A path inside the workspace goes through the confined file operations; any other path is
//! read or written by a command in the sandbox, so what is touched is the sandbox's own view.

use std::io::Read;
use std::time::Duration;

use bytes::Bytes;

use super::models::{ReadFileRequest, ReadFileResponse, WriteFileRequest};
use super::python::{Codec, os_error, py_repr, universal_newlines};
use super::{COMMAND_TIMEOUT, SWEREX_EXCEPTION, SwerexError};
use crate::confined::ConfinedError;
use crate::manifest::Backend;
use crate::runtime::ExecRequest;
use crate::service::sessions::Session;
use crate::service::{Invalid, ServiceError};

/// Most bytes `read_file` returns.
const READ_LIMIT: u64 = 64 << 20;
/// Most bytes an uploaded zip may expand to.
const UNZIP_LIMIT: u64 = 1 << 30;
/// Members an uploaded zip may have.
const UNZIP_MEMBERS: usize = 100_000;

const WRITE_SCRIPT: &str = r#"mkdir -p -- "$(dirname -- "$1")" && cat >"$1""#;
const UNTAR_SCRIPT: &str = r#"mkdir -p -- "$1" && tar -xzf - -C "$1""#;

/// SWE-ReX's upload form: the file, where it goes, and whether it is a zip to extract there.
pub struct UploadForm {
    pub file: Bytes,
    pub target_path: String,
    pub unzip: bool,
}

/// Where a path of the sandbox is served from.
#[derive(Debug, PartialEq, Eq)]
enum Place {
    /// Inside the workspace: this path relative to it, through the confined operations.
    Workspace(String),
    /// Anywhere else: by a command in the sandbox.
    Sandbox,
}

/// A path as the sandbox names it, served from the workspace when it lies lexically inside it
/// (no `..`: those are the sandbox's to resolve).
fn place(path: &str, workdirs: &[String]) -> Result<Place, SwerexError> {
    if path.contains('\0') {
        return Err(SwerexError::exception("builtins.ValueError", "embedded null byte"));
    }
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty() && *p != ".").collect();
    if parts.contains(&"..") {
        return Ok(Place::Sandbox);
    }
    if !path.starts_with('/') {
        return Ok(Place::Workspace(parts.join("/")));
    }
    let clean = format!("/{}", parts.join("/"));
    for dir in workdirs {
        let dir = dir.trim_end_matches('/');
        if clean == dir {
            return Ok(Place::Workspace(String::new()));
        }
        if let Some(rest) = clean.strip_prefix(dir).and_then(|r| r.strip_prefix('/')) {
            return Ok(Place::Workspace(rest.to_string()));
        }
    }
    Ok(Place::Sandbox)
}

/// A confined operation's failure as Python's, or `None` when the sandbox's own view should
/// decide (a symlink the confined operations do not follow, a kernel without openat2).
fn file_error(e: ServiceError, path: &str) -> Option<SwerexError> {
    match e {
        ServiceError::NotFound { kind: "path", .. } => Some(os_error(libc::ENOENT, path)),
        ServiceError::Invalid(Invalid::Unsupported(_)) => None,
        ServiceError::Invalid(Invalid::Path(c)) => match c {
            ConfinedError::Escapes { .. } | ConfinedError::IsSymlink { .. } => None,
            ConfinedError::NotARegularFile { kind: "directory", .. } => Some(os_error(libc::EISDIR, path)),
            ConfinedError::NotADirectory { .. } => Some(os_error(libc::ENOTDIR, path)),
            ConfinedError::InvalidPath { .. } => Some(os_error(libc::EISDIR, path)),
            c => Some(SwerexError::exception(
                "builtins.OSError",
                format!("{}: {c}", py_repr(path)),
            )),
        },
        e => Some(e.into()),
    }
}

/// A failed command of the sandbox's file access as Python's error: the sandbox's own tools
/// (`cat`, `mkdir`, `tar`) say what went wrong only in words, which are matched here.
fn sandbox_file_error(stderr: &str, path: &str) -> SwerexError {
    let known = [
        ("No such file or directory", libc::ENOENT),
        ("Is a directory", libc::EISDIR),
        ("Not a directory", libc::ENOTDIR),
        ("Permission denied", libc::EACCES),
        ("Read-only file system", libc::EROFS),
    ];
    match known.iter().find(|(text, _)| stderr.contains(text)) {
        Some((_, errno)) => os_error(*errno, path),
        None => SwerexError::exception("builtins.OSError", format!("{}: {}", py_repr(path), stderr.trim())),
    }
}

impl Session {
    /// Where the sandbox sees the workspace: the host directory itself for a host session; for
    /// a container, its working directory (the Environment's workdir), asked once.
    async fn swerex_workdirs(&self) -> Result<Vec<String>, SwerexError> {
        if self.backend() == Backend::Host {
            let path = self.workspace().to_path_buf();
            let mut out = vec![path.to_string_lossy().into_owned()];
            // A trusted host path: the same directory under its resolved name too.
            if let Ok(real) = std::fs::canonicalize(&path) {
                out.push(real.to_string_lossy().into_owned());
            }
            return Ok(out);
        }
        if let Some(known) = self.swerex.with(|r| r.workdir.clone()) {
            return Ok(vec![known]);
        }
        let r = self
            .exec(ExecRequest {
                argv: vec!["/bin/sh".into(), "-c".into(), "pwd".into()],
                timeout: Some(Duration::from_secs(30)),
                ..Default::default()
            })
            .await?;
        let dir = r.stdout.trim_end_matches('\n').to_string();
        if r.exit_code != Some(0) || !dir.starts_with('/') {
            return Err(SwerexError::exception(
                SWEREX_EXCEPTION,
                "cannot tell where the sandbox sees its workspace",
            ));
        }
        self.swerex.with(|r| r.workdir = Some(dir.clone()));
        Ok(vec![dir])
    }

    /// Run a file command in the sandbox (`sh -c SCRIPT sh PATH`).
    async fn in_sandbox(&self, script: &str, path: &str, stdin: Option<Vec<u8>>) -> Result<String, SwerexError> {
        let r = self
            .exec(ExecRequest {
                argv: vec!["/bin/sh".into(), "-c".into(), script.into(), "sh".into(), path.into()],
                stdin,
                timeout: Some(Duration::from_secs(600)),
                ..Default::default()
            })
            .await?;
        if r.timed_out {
            return Err(SwerexError::exception(
                COMMAND_TIMEOUT,
                "the sandbox's file access timed out",
            ));
        }
        if r.exit_code != Some(0) {
            return Err(sandbox_file_error(&r.stderr, path));
        }
        if r.stdout_dropped_bytes > 0 {
            return Err(SwerexError::exception(
                SWEREX_EXCEPTION,
                format!("{}: too large to read through the sandbox", py_repr(path)),
            ));
        }
        Ok(r.stdout)
    }

    /// `read_file`: text as Python's `Path.read_text(encoding, errors)` gives it.
    pub async fn swerex_read_file(&self, request: ReadFileRequest) -> Result<ReadFileResponse, SwerexError> {
        let codec = Codec::new(request.encoding.as_deref(), request.errors.as_deref())?;
        let dirs = self.swerex_workdirs().await?;
        let bytes = match place(&request.path, &dirs)? {
            Place::Workspace(rel) => match self.read_workspace(&rel).await {
                Ok(bytes) => Some(bytes),
                Err(e) => match file_error(e, &request.path) {
                    Some(e) => return Err(e),
                    None => None,
                },
            },
            Place::Sandbox => None,
        };
        let content = match bytes {
            Some(bytes) => codec.decode(&bytes)?,
            // The command's output is text already (lossily UTF-8).
            None => codec.decode(self.in_sandbox(r#"cat -- "$1""#, &request.path, None).await?.as_bytes())?,
        };
        Ok(ReadFileResponse {
            content: universal_newlines(content),
        })
    }

    async fn read_workspace(&self, rel: &str) -> Result<Vec<u8>, ServiceError> {
        let file = self.read_file(rel).await?;
        tokio::task::spawn_blocking(move || {
            let mut bytes = Vec::new();
            file.take(READ_LIMIT + 1)
                .read_to_end(&mut bytes)
                .map_err(|e| ServiceError::internal("reading a workspace file", e))?;
            if bytes.len() as u64 > READ_LIMIT {
                return Err(ServiceError::rejected(format!(
                    "the file is larger than {READ_LIMIT} bytes"
                )));
            }
            Ok(bytes)
        })
        .await
        .map_err(|e| ServiceError::internal("reading a workspace file", e))?
    }

    /// `write_file` (missing parents are made).
    pub async fn swerex_write_file(&self, request: WriteFileRequest) -> Result<(), SwerexError> {
        let dirs = self.swerex_workdirs().await?;
        self.put_file(&dirs, &request.path, request.content.into_bytes()).await
    }

    /// Write a file (parents made), in the workspace when it is there, else in the sandbox.
    async fn put_file(&self, dirs: &[String], path: &str, data: Vec<u8>) -> Result<(), SwerexError> {
        if let Place::Workspace(rel) = place(path, dirs)? {
            match self.write_file(&rel, Bytes::from(data.clone())).await {
                Ok(_) => return Ok(()),
                Err(e) => {
                    if let Some(e) = file_error(e, path) {
                        return Err(e);
                    }
                }
            }
        }
        self.in_sandbox(WRITE_SCRIPT, path, Some(data)).await.map(|_| ())
    }

    /// `upload`: a file, or a zip extracted into `target_path` as `ZipFile.extractall` would.
    pub async fn swerex_upload(&self, form: UploadForm) -> Result<(), SwerexError> {
        let dirs = self.swerex_workdirs().await?;
        if !form.unzip {
            return self.put_file(&dirs, &form.target_path, form.file.to_vec()).await;
        }
        let file = form.file;
        let archive = tokio::task::spawn_blocking(move || zip_to_tar_gz(&file))
            .await
            .map_err(|e| SwerexError::from(ServiceError::internal("unpacking a zip", e)))??;
        if let Place::Workspace(rel) = place(&form.target_path, &dirs)? {
            match self.upload(&rel, Bytes::from(archive.clone())).await {
                Ok(_) => return Ok(()),
                Err(e) => {
                    if let Some(e) = file_error(e, &form.target_path) {
                        return Err(e);
                    }
                }
            }
        }
        self.in_sandbox(UNTAR_SCRIPT, &form.target_path, Some(archive)).await?;
        Ok(())
    }
}

/// A zip as a gzipped tar that extracts as Python's `ZipFile.extractall` would: names lose
/// empty, `.` and `..` parts; every member is a plain file or directory (0644, 0755); sizes and
/// CRCs are checked (the `zip` crate), the whole is bounded (`UNZIP_LIMIT` bytes,
/// `UNZIP_MEMBERS` members). Errors are `zipfile.BadZipFile`.
fn zip_to_tar_gz(zip: &[u8]) -> Result<Vec<u8>, SwerexError> {
    let bad = |why: String| SwerexError::exception("zipfile.BadZipFile", why);
    let mut archive = zip::ZipArchive::new(std::io::Cursor::new(zip)).map_err(|e| bad(zip_message(&e)))?;
    if archive.len() > UNZIP_MEMBERS {
        return Err(bad(format!("the zip has more than {UNZIP_MEMBERS} members")));
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut tar = tar::Builder::new(encoder);
    let mut made_dirs = std::collections::BTreeSet::new();
    let mut total = 0u64;
    let io = |e: std::io::Error| SwerexError::exception(SWEREX_EXCEPTION, format!("building the archive: {e}"));
    let add_dir = |tar: &mut tar::Builder<_>, path: &str| -> Result<(), SwerexError> {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Directory);
        header.set_size(0);
        header.set_mode(0o755);
        header.set_mtime(now);
        tar.append_data(&mut header, path, std::io::empty()).map_err(io)
    };
    for i in 0..archive.len() {
        let mut member = archive.by_index(i).map_err(|e| bad(zip_message(&e)))?;
        let name = String::from_utf8_lossy(member.name_raw()).replace('\\', "/");
        let is_dir = name.ends_with('/');
        let clean: Vec<&str> = name.split('/').filter(|p| !matches!(*p, "" | "." | "..")).collect();
        if clean.is_empty() {
            continue;
        }
        for depth in 1..clean.len() + usize::from(is_dir) {
            let dir = clean[..depth].join("/");
            if made_dirs.insert(dir.clone()) {
                add_dir(&mut tar, &dir)?;
            }
        }
        if is_dir {
            continue;
        }
        let size = member.size();
        total = total.saturating_add(size);
        if total > UNZIP_LIMIT {
            return Err(bad(format!("the zip expands to more than {UNZIP_LIMIT} bytes")));
        }
        // The declared size is the sandbox-independent bound; reading past it is refused too
        // (a member that inflates to more than it says).
        let mut contents = Vec::with_capacity(size.min(UNZIP_LIMIT) as usize);
        (&mut member)
            .take(size + 1)
            .read_to_end(&mut contents)
            .map_err(|e| bad(format!("Error -3 while decompressing data: {e}")))?;
        if contents.len() as u64 != size {
            return Err(bad(format!("member {name:?} has the wrong size")));
        }
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Regular);
        header.set_size(size);
        header.set_mode(0o644);
        header.set_mtime(now);
        tar.append_data(&mut header, clean.join("/"), &contents[..])
            .map_err(io)?;
    }
    let encoder = tar.into_inner().map_err(io)?;
    encoder.finish().map_err(io)
}

/// What Python's `zipfile` says for the failures SWE-ReX's tests look at.
fn zip_message(e: &zip::result::ZipError) -> String {
    match e {
        zip::result::ZipError::InvalidArchive(_) => "File is not a zip file".to_string(),
        zip::result::ZipError::UnsupportedArchive(what) => format!("{what} is not supported"),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_in_the_workspace_are_served_from_it() {
        let dirs = vec!["/work/ws".to_string()];
        let rel = |p: &str| match place(p, &dirs).unwrap() {
            Place::Workspace(r) => Some(r),
            Place::Sandbox => None,
        };
        assert_eq!(rel("/work/ws/a/./b"), Some("a/b".into()));
        assert_eq!(rel("/work/ws"), Some(String::new()));
        assert_eq!(rel("a/b"), Some("a/b".into()));
        assert_eq!(rel("/work/wsx/a"), None);
        assert_eq!(rel("/work/ws/../ws/a"), None);
        assert_eq!(rel("/etc/passwd"), None);
    }

    /// A zip made by Python's own `zipfile` conventions extracts as `extractall` would.
    #[test]
    fn a_zip_becomes_a_tar_of_plain_files_and_directories() {
        let mut buf = std::io::Cursor::new(Vec::new());
        {
            let mut w = zip::ZipWriter::new(&mut buf);
            let opts = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
            w.add_directory("d/", opts).unwrap();
            w.start_file("d/a.txt", opts).unwrap();
            std::io::Write::write_all(&mut w, b"hello").unwrap();
            w.start_file("../evil", opts).unwrap();
            std::io::Write::write_all(&mut w, b"x").unwrap();
            w.finish().unwrap();
        }
        let gz = zip_to_tar_gz(buf.get_ref()).unwrap();
        let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(&gz[..]));
        let names: Vec<(String, u32)> = tar
            .entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (e.path().unwrap().display().to_string(), e.header().mode().unwrap())
            })
            .collect();
        assert_eq!(
            names,
            [("d".into(), 0o755), ("d/a.txt".into(), 0o644), ("evil".into(), 0o644)]
        );
        let e = zip_to_tar_gz(b"not a zip").unwrap_err();
        assert!(
            matches!(e, SwerexError::Exception { ref class_path, ref message, .. }
            if class_path == "zipfile.BadZipFile" && message == "File is not a zip file"),
            "{e:?}"
        );
    }
}
