//! What a user can ask runner for — jobs, live sessions, images, gc, the private containerd —
//! with no printing and no HTTP. The CLI (`cli`) and the HTTP API (`api`) are two faces of these
//! calls; each maps `ServiceError` to its exit codes or statuses in one place.

pub mod capacity;
pub mod daemon;
mod exhausted;
pub mod export;
pub mod handoff;
pub mod images;
pub mod jobs;
pub mod kube;
pub mod logs;
pub mod pools;
pub mod reconcile;
pub mod sessions;
pub mod snapshots;
pub mod usage;

use std::sync::Arc;

use crate::config::Config;
use crate::confined::ConfinedError;
use crate::containerd::{Containerd, CtdError};
use crate::image::ImageError;
use crate::job::store::StoreError;
use crate::manifest::ManifestError;
use crate::runtime::containerd::Engine;
use crate::runtime::{RuntimeError, RuntimeOptions};
use crate::spec::{HostEnv, SpecError};

/// Why a service call failed, by whose fault and what the caller can do about it.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The request is wrong (a manifest, a field, a path): the caller can fix it.
    #[error(transparent)]
    Invalid(#[from] Invalid),
    #[error("{kind} {name:?} not found")]
    NotFound { kind: &'static str, name: String },
    /// The request contradicts the current state (a job of that name runs).
    #[error("{0}")]
    Conflict(String),
    /// Something the request needs is not reachable now (containerd): retrying may work.
    #[error("{what} is unavailable: {reason}")]
    Unavailable { what: &'static str, reason: String },
    /// The runner failed at its own work.
    #[error("{context}: {source}")]
    Internal {
        context: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// The ways a request can be wrong.
#[derive(Debug, thiserror::Error)]
pub enum Invalid {
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// One field of a request.
    #[error("{field}: {message}")]
    Field { field: String, message: String },
    /// A path in a sandbox's workspace.
    #[error(transparent)]
    Path(ConfinedError),
    /// The sandbox could not do what was asked (its setup failed, a program is missing, the
    /// command failed under `check: raise`): well-formed, but not doable as asked.
    #[error("{0}")]
    Rejected(String),
    /// A program could not be started: why, as the operating system said it (its errno,
    /// where there is one).
    #[error("cannot start {program:?}: {source}")]
    CannotStart {
        program: String,
        #[source]
        source: std::io::Error,
    },
    /// The session's backend cannot do this.
    #[error("{0}")]
    Unsupported(String),
    /// A command failed under `check: raise`: what it did, for the caller to see.
    #[error("command failed with exit code {}", .0.exit_code.map_or("none".to_string(), |c| c.to_string()))]
    Failed(Box<sessions::ShellOutput>),
}

impl ServiceError {
    /// Runner failed at its own work — unless what failed was getting a file descriptor
    /// (`EMFILE`, `ENFILE`): that is the host's capacity, and retrying may work
    /// (`Unavailable`, with the limit and how to raise it).
    pub fn internal(context: impl Into<String>, source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        let (context, source) = (context.into(), source.into());
        if let Some(errno) = exhausted::out_of_files(source.as_ref()) {
            return ServiceError::Unavailable {
                what: "a file descriptor",
                reason: exhausted::reason(&context, errno, exhausted::nofile_limits()),
            };
        }
        ServiceError::Internal { context, source }
    }

    pub fn field(field: impl Into<String>, message: impl Into<String>) -> Self {
        ServiceError::Invalid(Invalid::Field {
            field: field.into(),
            message: message.into(),
        })
    }

    pub fn rejected(message: impl Into<String>) -> Self {
        ServiceError::Invalid(Invalid::Rejected(message.into()))
    }
}

impl From<ManifestError> for ServiceError {
    fn from(e: ManifestError) -> Self {
        ServiceError::Invalid(Invalid::Manifest(e))
    }
}

impl From<SpecError> for ServiceError {
    fn from(e: SpecError) -> Self {
        ServiceError::Invalid(Invalid::Spec(e))
    }
}

impl From<StoreError> for ServiceError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound(name) => ServiceError::NotFound { kind: "job", name },
            StoreError::Exists(name) => ServiceError::Conflict(format!("job {name:?} already exists")),
            // Actionable by the caller (delete the job), so not hidden as an internal error.
            e @ StoreError::Corrupt { .. } => ServiceError::Conflict(e.to_string()),
            other => ServiceError::internal("the job store", other),
        }
    }
}

impl From<CtdError> for ServiceError {
    fn from(e: CtdError) -> Self {
        if e.is_unavailable() {
            ServiceError::Unavailable {
                what: "containerd",
                reason: e.to_string(),
            }
        } else {
            ServiceError::internal("containerd", e)
        }
    }
}

impl From<ImageError> for ServiceError {
    fn from(e: ImageError) -> Self {
        match e {
            ImageError::Containerd(e) => e.into(),
            ImageError::NotFound(name) => ServiceError::NotFound { kind: "image", name },
            e @ (ImageError::Format(_) | ImageError::Name(_) | ImageError::DiffIdMismatch { .. }) => {
                ServiceError::field("image", e.to_string())
            }
            e @ ImageError::Io { .. } => ServiceError::internal("the image", e),
            // The registry's answer (401, unknown manifest, TLS, DNS) is the caller's to act on.
            ImageError::Registry(reason) => ServiceError::Invalid(Invalid::Rejected(reason)),
        }
    }
}

impl From<RuntimeError> for ServiceError {
    fn from(e: RuntimeError) -> Self {
        match e {
            RuntimeError::EmptyCommand => ServiceError::field("command", "must not be empty"),
            RuntimeError::Refused(message) => ServiceError::field("request", message),
            RuntimeError::Start { program, source } => ServiceError::Invalid(Invalid::CannotStart { program, source }),
            RuntimeError::CleanedUp => ServiceError::NotFound {
                kind: "session",
                name: "(ended)".into(),
            },
            // Like a call to a pod that is gone: the sandbox's state says why.
            e @ (RuntimeError::Evicted(_) | RuntimeError::Ended(_) | RuntimeError::Busy(_)) => {
                ServiceError::Conflict(e.to_string())
            }
            RuntimeError::Unavailable(what) => ServiceError::Unavailable {
                what,
                reason: format!("backend {what} is not connected"),
            },
            RuntimeError::Containerd(e) => e.into(),
            // The Environment names an image that is not there: the request's to fix.
            RuntimeError::Image(ImageError::NotFound(name)) => ServiceError::field(
                "environment.image",
                format!("image {name:?} is not present (runner image import)"),
            ),
            RuntimeError::Image(e) => e.into(),
            e @ (RuntimeError::Io { .. } | RuntimeError::Internal(_) | RuntimeError::MemberLost(_)) => {
                ServiceError::internal("the runtime", e)
            }
        }
    }
}

impl From<ConfinedError> for ServiceError {
    fn from(e: ConfinedError) -> Self {
        match e {
            ConfinedError::NotFound { path } => ServiceError::NotFound {
                kind: "path",
                name: path,
            },
            e @ ConfinedError::Unsupported { .. } => ServiceError::Invalid(Invalid::Unsupported(e.to_string())),
            e if e.is_client_error() => ServiceError::Invalid(Invalid::Path(e)),
            e => ServiceError::internal("the workspace", e),
        }
    }
}

/// Start a `runner` process that outlives its caller: in a session of its own, reaped by a
/// thread of the caller (a long-lived server would otherwise pile up zombies; a CLI exits
/// first and init reaps it). `what` names it in errors. Its PID.
pub fn spawn_detached(mut cmd: std::process::Command, what: &str) -> Result<u32, ServiceError> {
    use std::os::unix::process::CommandExt;
    // SAFETY: setsid is async-signal-safe; the child only calls it before exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| ServiceError::internal(format!("starting the {what}"), e))?;
    let pid = child.id();
    std::thread::Builder::new()
        .name(format!("reap-{pid}"))
        .spawn(move || {
            let _ = child.wait();
        })
        .map_err(|e| ServiceError::internal(format!("starting the {what}'s reaper"), e))?;
    Ok(pid)
}

/// Whether a call that needs containerd may start runner's private one.
/// What `runner version` reports of containerd.
pub struct ContainerdVersion {
    pub version: String,
    pub revision: String,
    pub address: std::path::PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Connect {
    /// The CLI: the address given, else the system daemon at the default address, else the
    /// private daemon under the state dir, started when it is not running.
    StartIfNeeded,
    /// A long-lived server: connect to what runs; never start a daemon behind a request.
    Existing,
}

/// `runner_containerd_revivals_total{result}` (`Context::revive_containerd`).
pub const CONTAINERD_REVIVALS: &str = "runner_containerd_revivals_total";

/// Told when a call started runner's private containerd (the CLI says so on stderr).
pub type DaemonNotice = Arc<dyn Fn(&daemon::Started) + Send + Sync>;

/// What every service call needs: the configuration, the host's facts, and containerd once
/// connected (lazily: host-backend work never touches it).
#[derive(Clone)]
pub struct Context {
    pub config: Arc<Config>,
    pub host: HostEnv,
    connect: Connect,
    client: Arc<tokio::sync::OnceCell<Containerd>>,
    /// The job store, opened once (on first use) for every call of this context.
    store: Arc<tokio::sync::OnceCell<crate::job::store::SharedStore>>,
    on_daemon_start: Option<DaemonNotice>,
    /// Shared shims for live sessions (`with_sessions_per_shim`).
    shim_groups: Option<Arc<crate::runtime::containerd::shim_group::ShimGroups>>,
    /// Shims started ahead for cold creates (`with_warm_shims`).
    shim_seeds: Option<Arc<crate::runtime::containerd::shim_seed::ShimSeeds>>,
    /// The state dir's pools as last read (`runtime_options`).
    pools: Arc<pools::PoolCache>,
}

impl Context {
    pub fn new(config: Config, connect: Connect) -> Result<Self, ServiceError> {
        if let Some(message) = config.namespace_error() {
            return Err(ServiceError::field("namespace", message));
        }
        crate::runtime::containerd::attach_lock::configure(config.warm_cgroup_attach);
        Ok(Context {
            host: HostEnv::detect(&config.state_dir),
            config: Arc::new(config),
            connect,
            client: Arc::new(tokio::sync::OnceCell::new()),
            store: Arc::new(tokio::sync::OnceCell::new()),
            on_daemon_start: None,
            shim_groups: None,
            shim_seeds: None,
            pools: Arc::default(),
        })
    }

    /// Live sessions of one Environment share a containerd shim, up to `size` per shim (1:
    /// a shim each). The groups are this context's (a server's): its clones share them.
    pub fn with_sessions_per_shim(mut self, size: usize) -> Self {
        self.shim_groups = crate::runtime::containerd::shim_group::ShimGroups::new(size);
        self
    }

    /// Keep `count` containerd shims started ahead for this context's cold creates (0: none;
    /// see `runtime::containerd::shim_seed`). Not with shared shims: a group's own shim is
    /// already running for all but its first member.
    pub fn with_warm_shims(mut self, count: usize) -> Self {
        self.shim_seeds = if self.shim_groups.is_some() {
            None
        } else {
            crate::runtime::containerd::shim_seed::ShimSeeds::new(count)
        };
        self
    }

    /// The warm shims' stock and an engine to tend it, when this context keeps one and
    /// containerd is connected (never connects).
    pub fn warm_shims(&self) -> Option<(Arc<crate::runtime::containerd::shim_seed::ShimSeeds>, Engine)> {
        let seeds = self.shim_seeds.clone()?;
        let client = self.containerd_if_connected()?;
        let engine = Engine::new(
            client,
            &self.config.state_dir,
            self.host.clone(),
            self.runtime_options(),
        );
        Some((seeds, engine))
    }

    /// Call `notice` when a call starts the private containerd.
    pub fn on_daemon_start(mut self, notice: DaemonNotice) -> Self {
        self.on_daemon_start = Some(notice);
        self
    }

    /// containerd, connected on first use (per the connect policy).
    pub async fn containerd(&self) -> Result<Containerd, ServiceError> {
        self.client
            .get_or_try_init(|| async {
                let (client, started) = daemon::connect(&self.config, self.connect).await?;
                if let (Some(started), Some(notice)) = (&started, &self.on_daemon_start) {
                    notice(started);
                }
                Ok::<_, ServiceError>(client)
            })
            .await
            .cloned()
    }

    /// When the containerd this context is connected to is runner's private daemon of its
    /// state dir and that died (a crash, the OOM killer; not `runner daemon stop`), start it
    /// again, as a CLI does at its next apply: the sandboxes' shims outlive it and the client
    /// reconnects by itself. `None`: nothing to do.
    pub async fn revive_containerd(&self) -> Option<Result<daemon::Started, ServiceError>> {
        let client = self.containerd_if_connected()?;
        let revived = daemon::revive(&self.config, &client).await?;
        crate::metrics::increment(
            CONTAINERD_REVIVALS,
            &[("result", if revived.is_ok() { "started" } else { "failed" })],
        );
        match &revived {
            Ok(started) => tracing::warn!(
                pid = started.pid,
                "runner's private containerd had died; started it again"
            ),
            Err(e) => tracing::error!(error = %e, "runner's private containerd died and could not be started again"),
        }
        if let (Ok(started), Some(notice)) = (&revived, &self.on_daemon_start) {
            notice(started);
        }
        Some(revived)
    }

    /// Whether containerd answers within `limit` (a version call; connecting as the policy
    /// allows): a channel to a daemon that died fails at once, one that hangs by the limit.
    pub async fn containerd_answers(&self, limit: std::time::Duration) -> Result<(), String> {
        let client = self.containerd().await.map_err(|e| e.to_string())?;
        match tokio::time::timeout(limit, client.version()).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer in {limit:?}")),
        }
    }

    /// The version of the containerd this context uses (connecting as its policy allows).
    pub async fn containerd_version(&self) -> Result<ContainerdVersion, ServiceError> {
        let client = self.containerd().await?;
        let (version, revision) = client.version().await?;
        Ok(ContainerdVersion {
            version,
            revision,
            address: client.address().to_path_buf(),
        })
    }

    /// The containerd client when it is connected already (never connects).
    pub fn containerd_if_connected(&self) -> Option<Containerd> {
        self.client.get().cloned()
    }

    /// The containerd backend with these runtime options.
    pub async fn engine(&self, options: RuntimeOptions) -> Result<Engine, ServiceError> {
        Ok(Engine::new(
            self.containerd().await?,
            &self.config.state_dir,
            self.host.clone(),
            options,
        ))
    }

    /// Runtime options from the configuration (with warm pools when this state dir has any).
    pub fn runtime_options(&self) -> RuntimeOptions {
        pools::with_pools(
            self,
            RuntimeOptions {
                output_limit: self.config.output_limit,
                logger_binary: self.config.runner_exe.clone(),
                registry: self.config.registry.clone(),
                dns_upstream: self.config.dns_upstream.clone(),
                net: self.config.net.clone(),
                rootfs_dir: self.config.rootfs_dir.clone(),
                userns_dir: self.config.userns_dir.clone(),
                shim_groups: self.shim_groups.clone(),
                shim_seeds: self.shim_seeds.clone(),
                ..RuntimeOptions::default()
            },
        )
    }

    /// The job store of the state dir: opened on first use, then shared by every call.
    pub async fn store(&self) -> Result<crate::job::store::SharedStore, ServiceError> {
        let store = self
            .store
            .get_or_try_init(|| crate::job::store::SharedStore::open(&self.config.state_dir))
            .await?;
        Ok(store.clone())
    }

    /// containerd, when a call has connected already.
    pub fn connected(&self) -> Option<Containerd> {
        self.client.get().cloned()
    }

    /// Run blocking work (the filesystem, SQLite, fork/exec) off the async workers.
    pub async fn blocking<T: Send + 'static>(
        f: impl FnOnce() -> Result<T, ServiceError> + Send + 'static,
    ) -> Result<T, ServiceError> {
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| ServiceError::internal("a worker thread", e))?
    }
}
