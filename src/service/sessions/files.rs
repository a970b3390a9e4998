//! Files in a session's workspace. The sandbox owns every name in it and runs concurrently:
//! each operation resolves its path beneath the workspace's directory fd (`confined`), never by
//! a checked host path, and runs on the blocking pool.

use crate::confined::{ConfinedError, Listing, PackReport, Root, UnpackReport};
use crate::service::{Context, ServiceError};

use super::{Lease, Session};

/// Most entries one listing returns (a sandbox can make millions).
pub const LIST_LIMIT: usize = 10_000;
/// Most bytes one tar upload may extract (it may be gzipped).
pub const MAX_EXTRACTED_BYTES: u64 = 1 << 30;

impl Session {
    /// A confined operation on the workspace, on the blocking pool.
    async fn in_workspace<T: Send + 'static>(
        &self,
        op: impl FnOnce(&Root) -> Result<T, ConfinedError> + Send + 'static,
    ) -> Result<T, ServiceError> {
        let workspace = self.workspace.clone();
        Context::blocking(move || Ok(Root::open(&workspace).and_then(|root| op(&root))?)).await
    }

    /// Open a file to read (the caller streams it: a file the sandbox made may be huge).
    pub async fn read_file(&self, path: &str) -> Result<std::fs::File, ServiceError> {
        let rel = path.to_string();
        self.in_workspace(move |root| root.open_read(&rel)).await
    }

    /// Write a file, creating missing parent directories (each a real directory owned by the
    /// sandbox's user); existing parents are resolved beneath the workspace.
    pub async fn write_file(&self, path: &str, data: bytes::Bytes) -> Result<u64, ServiceError> {
        let (rel, owner) = (path.to_string(), self.owner);
        self.in_workspace(move |root| match root.write_file(&rel, &mut &data[..], false, owner) {
            Err(ConfinedError::NotFound { .. }) => root.write_file(&rel, &mut &data[..], true, owner),
            other => other,
        })
        .await
    }

    /// `mkdir -p`.
    pub async fn make_dir(&self, path: &str) -> Result<(), ServiceError> {
        let (rel, owner) = (path.to_string(), self.owner);
        self.in_workspace(move |root| root.create_dir_all(&rel, owner)).await
    }

    /// A directory's entries (at most `LIST_LIMIT`; `truncated` says when there were more).
    pub async fn list_files(&self, path: &str) -> Result<Listing, ServiceError> {
        let rel = path.to_string();
        self.in_workspace(move |root| root.list(&rel, LIST_LIMIT)).await
    }

    /// Extract a tar (gzip or plain) into a workspace directory.
    pub async fn upload(&self, path: &str, archive: bytes::Bytes) -> Result<UnpackReport, ServiceError> {
        let (rel, owner) = (path.to_string(), self.owner);
        self.in_workspace(move |root| root.unpack_tar(&rel, &archive, owner, MAX_EXTRACTED_BYTES))
            .await
    }
}

/// A workspace directory (or file) resolved for a tar download, written later.
pub struct Download {
    root: Root,
    rel: String,
    /// The session stays leased until the archive is written.
    _lease: Lease,
}

impl Lease {
    /// Resolve what a download will pack, so a bad path is an error before any byte is sent.
    pub async fn download(&self, path: &str) -> Result<Download, ServiceError> {
        let (rel, workspace) = (path.to_string(), self.workspace.clone());
        let checked = rel.clone();
        let root = Context::blocking(move || {
            let root = Root::open(&workspace)?;
            match root.list(&checked, 1) {
                Err(ConfinedError::NotADirectory { .. }) => root.open_read(&checked).map(|_| ()),
                other => other.map(|_| ()),
            }?;
            Ok(root)
        })
        .await?;
        Ok(Download {
            root,
            rel,
            _lease: self.clone(),
        })
    }
}

impl Download {
    /// Write the tar (blocking: run it on the blocking pool).
    pub fn write_to(self, out: &mut dyn std::io::Write) -> Result<PackReport, ServiceError> {
        Ok(self.root.pack_tar(&self.rel, out)?)
    }
}
