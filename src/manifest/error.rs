//! Manifest errors: every one names the field path and, where the YAML parser knows it,
//! the line and column.

use std::fmt;
use std::path::PathBuf;

use super::quantity::QuantityError;

/// A 1-based position in the manifest file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Location {
    pub line: u64,
    pub column: u64,
}

/// Where a value came from: its field path in the document and its position in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    pub path: String,
    pub location: Option<Location>,
}

impl Origin {
    pub fn new(path: impl Into<String>, location: Option<Location>) -> Self {
        Origin {
            path: path.into(),
            location,
        }
    }
}

/// One refused manifest: what is wrong, at which field, in which file and document.
/// Boxed: errors are rare and results of manifest functions stay small.
#[derive(Debug, thiserror::Error)]
pub struct ManifestError(Box<Detail>);

#[derive(Debug)]
pub struct Detail {
    pub file: Option<PathBuf>,
    /// `Job "hello"` or `document 2`: which document of a multi-document file.
    pub document: Option<String>,
    pub origin: Origin,
    pub kind: ManifestErrorKind,
}

impl std::ops::Deref for ManifestError {
    type Target = Detail;
    fn deref(&self) -> &Detail {
        &self.0
    }
}

impl ManifestError {
    pub fn new(origin: Origin, kind: ManifestErrorKind) -> Self {
        ManifestError(Box::new(Detail {
            file: None,
            document: None,
            origin,
            kind,
        }))
    }

    pub fn in_document(mut self, document: impl Into<String>) -> Self {
        self.0.document.get_or_insert(document.into());
        self
    }

    pub fn in_file(mut self, file: impl Into<PathBuf>) -> Self {
        self.0.file.get_or_insert(file.into());
        self
    }
}

impl fmt::Display for ManifestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(file) = &self.file {
            write!(f, "{}:", file.display())?;
        }
        if let Some(loc) = self.origin.location {
            write!(f, "{}:{}:", loc.line, loc.column)?;
        }
        if self.file.is_some() || self.origin.location.is_some() {
            f.write_str(" ")?;
        }
        if let Some(doc) = &self.document {
            write!(f, "{doc}: ")?;
        }
        if !self.origin.path.is_empty() {
            write!(f, "{}: ", self.origin.path)?;
        }
        write!(f, "{}", self.kind)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ManifestErrorKind {
    #[error("cannot read manifest: {0}")]
    Read(#[source] std::io::Error),
    #[error("manifest is {size} bytes; the limit is {limit}")]
    TooLarge { size: u64, limit: u64 },
    #[error("{0}")]
    Yaml(String),
    #[error("missing field apiVersion (expected {expected})")]
    MissingApiVersion { expected: &'static str },
    #[error("unsupported apiVersion {found:?} (expected {expected})")]
    ApiVersion { found: String, expected: &'static str },
    #[error("missing field kind (expected Environment, Job, Network or WarmPool)")]
    MissingKind,
    #[error("unknown kind {0:?} (expected Environment, Job, Network or WarmPool)")]
    Kind(String),
    #[error("the file holds no Environment, Job, Network or WarmPool")]
    Empty,
    #[error("a pool of {size} members is above the limit of {max}")]
    PoolSize { size: u32, max: u32 },
    #[error("Environment {environment:?} runs on the host backend: only containerd Environments have warm pools")]
    PoolBackend { environment: String },
    #[error("{0}")]
    Quantity(#[from] QuantityError),
    #[error("memory limit {bytes} bytes is below the minimum of {min} bytes")]
    MemoryTooSmall { bytes: u64, min: u64 },
    #[error("ephemeral storage of {bytes} bytes is below the minimum of {min} bytes")]
    StorageTooSmall { bytes: u64, min: u64 },
    #[error("cpu {milli}m is outside {min}m..={max}m")]
    CpuOutOfRange { milli: u32, min: u32, max: u32 },
    #[error("pids limit {0} must be between 1 and {max} (runc reads 0 as 1 and -1 as unlimited)", max = super::MAX_PIDS)]
    PidsOutOfRange(i64),
    #[error("{name:?} is not a valid name: {reason}")]
    Name { name: String, reason: &'static str },
    #[error("label key {0:?} is not valid (expected [prefix/]name, name of at most 63 characters [A-Za-z0-9._-])")]
    LabelKey(String),
    #[error("label value {0:?} is not valid (at most 63 characters [A-Za-z0-9._-], starting and ending alphanumeric)")]
    LabelValue(String),
    #[error("label key {key:?} uses the reserved prefix {prefix:?}")]
    ReservedLabel { key: String, prefix: &'static str },
    #[error("{value:?} is not a user: expected \"uid:gid\" (numbers) or \"host\"")]
    UserSyntax { value: String },
    #[error("id {id} is above the limit {max} (CVE-2024-40635: larger ids overflow to root)", max = super::MAX_ID)]
    IdTooLarge { id: u64 },
    #[error("id {id} is outside the container's user namespace (ids 0 to {}); set hostUsers: true to run without one", size - 1)]
    IdOutsideUserns { id: u32, size: u64 },
    #[error(
        "network: host needs hostUsers: true (the host's network belongs to the host's users; a container in its own user namespace cannot use it)"
    )]
    HostNetworkNeedsHostUsers,
    #[error("{0:?} is not a valid environment variable name")]
    EnvName(String),
    #[error("environment variable {0} contains a NUL byte")]
    EnvValueNul(String),
    #[error("path {0:?} must be absolute")]
    NotAbsolute(String),
    #[error("path {0:?} must not contain `..` segments")]
    DotDot(String),
    #[error("path contains a NUL byte")]
    Nul,
    #[error("path must not be empty")]
    EmptyPath,
    #[error("refusing to mount {path:?}: {reason}")]
    RefusedSource { path: String, reason: String },
    #[error("refusing mount target {0:?}: targets under /proc, /sys or /dev (or / itself) are not allowed")]
    RefusedTarget(String),
    #[error("mount target {target:?} is under the workdir {workdir:?} and would shadow the workspace")]
    TargetUnderWorkdir { target: String, workdir: String },
    #[error("workdir {0:?} is not allowed (under /proc, /sys or /dev; CVE-2024-21626)")]
    RefusedWorkdir(String),
    #[error("workdir / cannot hold the workspace: set mountWorkspace: false or choose another workdir")]
    WorkspaceAtRoot,
    #[error("savePath {0:?} must be a relative path without `..` (it is mounted at /static/<savePath>)")]
    SavePath(String),
    #[error("image is required for backend containerd")]
    ImageRequired,
    #[error(
        "includeHostEnv is only allowed with backend host (it would leak the host's environment into an untrusted container)"
    )]
    HostEnvInContainer,
    #[error("network {0} is not supported by the host backend (use backend containerd for isolation)")]
    HostNetwork(&'static str),
    #[error("mounts need backend containerd (the host backend runs in the host's own filesystem)")]
    HostMounts,
    #[error("this Job says backend {written}, but it resolves to {resolved} (Environment {environment:?}'s, or --backend's): spec.backend records where a Job ran and never chooses; pass --backend {written} or remove spec.backend", written = written.as_str(), resolved = resolved.as_str())]
    BackendMismatch {
        written: super::Backend,
        resolved: super::Backend,
        environment: String,
    },
    #[error("command must not be empty")]
    EmptyCommand,
    #[error("timeoutSeconds must be a number of seconds above 0 and at most {max}", max = super::MAX_TIMEOUT_SECONDS)]
    Timeout,
    #[error("activeDeadlineSeconds must be between 1 and {max}", max = super::MAX_TIMEOUT_SECONDS)]
    Deadline,
    #[error("must be between 1 and {max}")]
    Count { max: u32 },
    #[error("{kind} {name:?} is defined twice")]
    Duplicate { kind: &'static str, name: String },
    #[error("environment {name:?} is not defined in this file{searched}")]
    EnvironmentNotFound { name: String, searched: String },
    /// `runner export`: what Kubernetes cannot express faithfully, and why.
    #[error("cannot be exported to Kubernetes: {0}")]
    NotExportable(String),
}
