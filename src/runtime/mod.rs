//! The runtime interface (reference 000's spawn → execute/stream/poll/kill → cleanup) and its
//! backends. `host` runs trusted commands as host processes; the containerd backend
//! implements the same trait.

pub mod cgroupfs;
pub mod containerd;
pub mod copytree;
pub mod host;
pub mod idmap;
pub mod janitor;
pub mod late;
pub mod latency;
pub mod output;
pub mod pty;
pub mod storage;
pub mod tree;
pub mod usage;

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;
use tokio::sync::mpsc;

use crate::spec::RunPlan;

/// One command to run in a spawned runtime.
#[derive(Clone, Debug, Default)]
pub struct ExecRequest {
    pub argv: Vec<String>,
    /// `None` means EOF at once.
    pub stdin: Option<Vec<u8>>,
    pub timeout: Option<Duration>,
    /// Extra environment for this command only.
    pub env: BTreeMap<String, String>,
    /// Working directory for this command (default: the runtime's workdir).
    pub cwd: Option<String>,
}

/// Output and status of the setup commands run at spawn.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SetupResult {
    pub exit_code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub stdout_dropped_bytes: u64,
    pub stderr_dropped_bytes: u64,
    pub timed_out: bool,
    pub duration_ms: u64,
}

impl SetupResult {
    pub fn succeeded(&self) -> bool {
        self.exit_code == Some(0) && !self.timed_out
    }
}

/// What one command did: a Job's `result` object (docs/reference/manifest.md, Results).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExecResult {
    /// Exit status when the process exited; `None` when a signal ended it.
    pub exit_code: Option<i32>,
    /// The signal that ended the process, if one did.
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub oom_killed: bool,
    pub stdout: String,
    pub stderr: String,
    pub stdout_dropped_bytes: u64,
    pub stderr_dropped_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub setup: Option<SetupResult>,
    pub duration_ms: u64,
    pub peak_memory_bytes: Option<u64>,
    pub cpu_time_ms: Option<u64>,
    /// The warm pool whose member ran the command (absent: a container made for it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Why a container was made for it though warm pools exist (no pool member fitted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cold_start: Option<String>,
    /// Why the sandbox was evicted under the command (its processes killed), if it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evicted: Option<String>,
}

impl ExecResult {
    /// Shell convention: the exit code, or 128 + signal.
    pub fn status_code(&self) -> i32 {
        match (self.exit_code, self.signal) {
            (Some(code), _) => code,
            (None, Some(sig)) => 128 + sig,
            (None, None) => -1,
        }
    }
}

/// Live output of a streamed command.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum RuntimeEvent {
    Stdout {
        data: String,
    },
    Stderr {
        data: String,
    },
    Exit {
        #[serde(rename = "exitCode")]
        exit_code: Option<i32>,
        signal: Option<i32>,
        #[serde(rename = "timedOut")]
        timed_out: bool,
    },
}

impl RuntimeEvent {
    /// The last events of a stream: `Exit`, preceded by a message on stderr when the
    /// command could not be seen to its end (so consumers always get an `Exit`).
    pub fn ending(outcome: Result<ExecResult, RuntimeError>) -> Vec<RuntimeEvent> {
        match outcome {
            Ok(r) => {
                let mut events = Vec::new();
                if let Some(verdict) = &r.evicted {
                    events.push(RuntimeEvent::Stderr {
                        data: format!("runner: the sandbox was evicted: {verdict}\n"),
                    });
                }
                events.push(RuntimeEvent::Exit {
                    exit_code: r.exit_code,
                    signal: r.signal,
                    timed_out: r.timed_out,
                });
                events
            }
            Err(e) => vec![
                RuntimeEvent::Stderr {
                    data: format!("runner: {e}\n"),
                },
                RuntimeEvent::Exit {
                    exit_code: None,
                    signal: None,
                    timed_out: false,
                },
            ],
        }
    }
}

/// What `poll` sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessState {
    /// Nothing has run yet.
    Idle,
    Running,
    /// The last process ended: its exit code, or 128 + signal.
    Exited(i32),
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("empty command")]
    EmptyCommand,
    #[error("cannot start {program:?}: {source}")]
    Start {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the runtime was cleaned up")]
    CleanedUp,
    /// The sandbox was evicted (its processes killed) for the reason given.
    #[error("the sandbox was evicted: {0}")]
    Evicted(String),
    /// The sandbox's init exited under it (killed, or the shim supervising it died): it runs
    /// no more commands.
    #[error("the sandbox ended: {0}")]
    Ended(String),
    #[error("{0}")]
    Refused(String),
    /// The sandbox's agent cannot take or did not run a command (it is held by another that
    /// has not ended, or the sandbox meddled with its directory): the sandbox's own doing.
    #[error("{0}")]
    Busy(String),
    /// A claimed pool member could not be readied for its job (it went away after its
    /// record was checked): it was torn down, and the job may run cold as when no member is
    /// ready.
    #[error("the claimed pool member could not be readied: {0}")]
    MemberLost(String),
    #[error("backend {0} is not connected")]
    Unavailable(&'static str),
    #[error(transparent)]
    Containerd(#[from] crate::containerd::CtdError),
    #[error(transparent)]
    Image(#[from] crate::image::ImageError),
    #[error("{0}")]
    Internal(String),
}

/// A spawned sandbox: one process at a time; a second command waits for the first.
#[async_trait]
pub trait Runtime: Send + Sync {
    /// Output of the setup commands run at spawn (`None`: setup disabled or empty).
    fn setup(&self) -> Option<&SetupResult>;
    /// Run a command to completion (or its timeout) and collect its output.
    async fn execute(&self, request: ExecRequest) -> Result<ExecResult, RuntimeError>;
    /// Start a command and return its output as it happens; the last event is `Exit`.
    /// Streaming takes no stdin (EOF at once), as in reference 000.
    async fn stream(
        &self,
        argv: Vec<String>,
        timeout: Option<Duration>,
    ) -> Result<mpsc::Receiver<RuntimeEvent>, RuntimeError>;
    /// Whether a command is running, or how the last one ended.
    fn poll(&self) -> ProcessState;
    /// Kill the running command's whole process tree, if one runs.
    async fn kill(&self) -> Result<(), RuntimeError>;
    /// Kill what runs and release everything the runtime holds. Idempotent.
    async fn cleanup(&self) -> Result<(), RuntimeError>;
    /// What an isolated sandbox offers beyond running commands (`None`: a host runtime).
    fn sandbox(&self) -> Option<&dyn Sandbox> {
        None
    }
    /// The warm pool whose member this runtime is.
    fn pool(&self) -> Option<&str> {
        None
    }
    /// Whether the sandbox ended under its holder (its init exited: killed, or the shim that
    /// supervised it died): it runs no more commands.
    fn ended(&self) -> bool {
        false
    }
    /// What the sandbox got on a bridge network (`None`: it is on none).
    fn network(&self) -> Option<&NetworkStatus> {
        None
    }
    /// Replace what the sandbox may reach off its bridge network (a live session's PATCH):
    /// at once, and what is no longer allowed is cut, established connections included.
    async fn set_egress(&self, _egress: crate::net::Egress) -> Result<(), RuntimeError> {
        Err(RuntimeError::Refused("the sandbox is on no bridge network".into()))
    }

    /// Freeze every process of the sandbox: they keep their memory and use no CPU until
    /// `resume` (containerd's freezer; the host backend has none).
    async fn pause(&self) -> Result<(), RuntimeError> {
        Err(RuntimeError::Refused("only containerd sandboxes can be paused".into()))
    }

    /// Checkpoint the sandbox (its processes and memory with CRIU, its files) into the empty
    /// directory `dir`; `Engine::restore_live` makes copies of it.
    async fn checkpoint(&self, _dir: &std::path::Path) -> Result<containerd::checkpoint::Dumped, RuntimeError> {
        Err(RuntimeError::Refused(
            "only containerd sandboxes can be checkpointed".into(),
        ))
    }

    /// A restored sandbox's session has taken over its FIFOs: the host's holds on them go.
    fn release_restore_holds(&self) {}

    /// Thaw what `pause` froze.
    async fn resume(&self) -> Result<(), RuntimeError> {
        Err(RuntimeError::Refused("only containerd sandboxes can be paused".into()))
    }
    /// Start a command on a new terminal in the sandbox (beside the commands of `execute`,
    /// which it does not wait for nor hold up).
    async fn open_pty(&self, _request: pty::PtyRequest) -> Result<pty::Pty, RuntimeError> {
        Err(RuntimeError::Refused("this runtime has no terminals".into()))
    }
    /// Where the sandbox's resource counters are: its cgroup and its init's host PID.
    fn cgroup(&self) -> Option<CgroupRef> {
        None
    }
}

/// A sandbox's cgroup (the spec's `cgroupsPath`) and its init's host PID (whose network
/// namespace is the sandbox's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupRef {
    pub path: String,
    pub init_pid: u32,
}

/// An isolated sandbox's extras: a directory shared with it, the tools shipped into it,
/// signals to its processes, its OOM count.
pub trait Sandbox: Send + Sync {
    /// The host directory the sandbox sees read-write at `shared_mount` (hostile: the
    /// sandbox may plant anything in it).
    fn shared_dir(&self) -> &std::path::Path;
    /// Where the sandbox sees `shared_dir`.
    fn shared_mount(&self) -> &'static str;
    /// Where the sandbox sees `RuntimeOptions::tools` (read-only).
    fn tools_mount(&self) -> &'static str;
    /// Signal a process given by its PID inside the sandbox; whether it was signalled.
    fn signal(&self, pid: i32, signal: nix::sys::signal::Signal) -> bool;
    /// Signal the process group a process given by its PID inside the sandbox leads (just
    /// the process when it leads none); whether it was signalled.
    fn signal_group(&self, pid: i32, signal: nix::sys::signal::Signal) -> bool;
    /// Ask the kernel to run a process given by its PID inside the sandbox, which the host
    /// waits on (a resident shell), with a short slice ([`latency`]), not its children;
    /// whether it was done. Best effort: the default does nothing.
    fn prefer_latency(&self, _pid: i32) -> bool {
        false
    }
    /// Make a FIFO called `name` in `shared_dir` (replacing what had that name), owned by the
    /// sandbox's user, and open it for the host. Non-blocking, checked to be the FIFO.
    fn fifo(&self, name: &str, end: FifoEnd) -> Result<std::os::fd::OwnedFd, RuntimeError>;
    /// Open again a FIFO `fifo` made, checked again.
    fn reopen_fifo(&self, name: &str, end: FifoEnd) -> Result<std::os::fd::OwnedFd, RuntimeError>;
    /// Remove a file `fifo` made.
    fn unlink(&self, name: &str);
    /// Processes the kernel OOM-killed in the sandbox so far.
    fn oom_kills(&self) -> Option<u64>;
    /// A resident shell already running in the sandbox (started in a pool member before the
    /// claim), for the session to adopt as its first; once, and `None` when there is none.
    fn adopt_shell(&self) -> Option<AdoptableShell> {
        None
    }
}

/// A resident shell started before its sandbox was claimed, and what was bound since: the
/// adopter hands it these so that its state is a shell's started now (see
/// `containerd::prelaunch`). Its FIFOs are the usual ones of shell `name`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdoptableShell {
    pub name: String,
    /// Variables to export (the Environment's).
    pub env: Vec<(String, String)>,
    /// Where a shell started now would be (the workspace mounted since).
    pub cwd: String,
    /// What a shell started now would have set HOSTNAME to (`None`: its environment has it).
    pub hostname: Option<String>,
    /// Its PID in the sandbox, when the short slice a session's shell runs with was asked for
    /// before the claim (`Sandbox::prefer_latency`); `None`: the adopter asks.
    pub pid: Option<i32>,
}

/// How the host opens a FIFO in a sandbox's shared directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FifoEnd {
    Read,
    /// Never blocks and never sees EOF (the host counts as both ends): for a FIFO the sandbox
    /// has not opened yet.
    ReadWrite,
    /// Needs a reader (ENXIO otherwise); writes fail with EPIPE once none is left.
    Write,
}

/// A file a caller ships into every live sandbox (read-only, under `Sandbox::tools_mount`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tool {
    pub name: &'static str,
    pub contents: &'static [u8],
}

impl ProcessState {
    /// What `poll` answers, given whether a command runs and how the last one ended.
    pub fn of(running: bool, last: Option<i32>) -> Self {
        match (running, last) {
            (true, _) => ProcessState::Running,
            (false, Some(code)) => ProcessState::Exited(code),
            (false, None) => ProcessState::Idle,
        }
    }
}

/// Knobs that are the runner's, not the manifest's.
#[derive(Clone, Debug)]
pub struct RuntimeOptions {
    /// Bytes kept per stream (head + tail).
    pub output_limit: usize,
    /// After a timeout: how long SIGTERM may take before SIGKILL.
    pub kill_grace: Duration,
    /// Host backend: track process trees with a cgroup when possible (else the process
    /// group). Off only to exercise the fallback.
    pub use_cgroup: bool,
    /// containerd live containers: run commands through the in-container agent (a fork in
    /// the sandbox) rather than Tasks.Exec (a `runc exec` per command, ~25 ms).
    pub exec_via_agent: bool,
    /// containerd one-shot jobs: output through a logger the shim runs (it survives the
    /// runner, so a re-adopting runner still gets it) instead of FIFOs read by this process.
    pub durable_output: bool,
    /// The `runner` binary the shim runs as the output logger (default: this executable,
    /// which is right unless the library is embedded in another program).
    pub logger_binary: Option<std::path::PathBuf>,
    /// With `durable_output`: a path prefix the logger appends the command's output to as it
    /// arrives (`<prefix>.stdout`, `<prefix>.stderr`), what `runner logs -f` follows.
    pub live_output: Option<std::path::PathBuf>,
    /// Files shipped read-only into live containers (with the agent).
    pub tools: Vec<Tool>,
    /// containerd: run one-shot jobs in a warm pool member when one fits (see
    /// `containerd::pool`).
    pub use_pools: bool,
    /// The warm pools of the state dir, to say why a job ran cold next to them.
    pub pools: Vec<PoolInfo>,
    /// Told a pool's name when it needs refilling: a session claimed a member, or a one-shot
    /// job left its used member retired for whoever refills to remove (the job's result does
    /// not wait for the teardown). Without a hook the used member is torn down at once.
    pub on_claim: Option<ClaimHook>,
    /// containerd: how images are pulled when an Environment's `imagePullPolicy` says so.
    pub registry: crate::image::registry::RegistryConfig,
    /// Told what a `network: bridge` container got (its address, its published ports) once
    /// it is attached, before its command starts.
    pub on_network: Option<NetworkHook>,
    /// Where runner's resolver asks for a bridge container's allowed domains (empty: the
    /// host's resolvers).
    pub dns_upstream: Vec<std::net::SocketAddr>,
    /// The network layer's host paths.
    pub net: crate::config::NetPaths,
    /// Remapped containers' rootfs directories (`Config::rootfs_dir`).
    pub rootfs_dir: std::path::PathBuf,
    /// User-namespace range leases (`Config::userns_dir`).
    pub userns_dir: std::path::PathBuf,
    /// containerd: live sessions of one Environment share shims, this many per shim
    /// (`runner serve --sessions-per-shim`); `None`: a shim each.
    pub shim_groups: Option<std::sync::Arc<containerd::shim_group::ShimGroups>>,
    /// containerd: shims started ahead for cold creates (`runner serve --warm-shims`);
    /// `None`: each cold create starts its shim.
    pub shim_seeds: Option<std::sync::Arc<containerd::shim_seed::ShimSeeds>>,
    /// containerd: the image record a session's claim will check, read ahead (see
    /// `containerd::pool::ImageRead`).
    pub image_read: Option<containerd::pool::ImageRead>,
}

/// A warm pool as a claim sees it: what its members serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolInfo {
    pub name: String,
    pub environment: String,
    pub workspace: bool,
    pub static_assets: bool,
    pub key: String,
    /// The snapshot its members start from instead of the Environment's image.
    pub snapshot: Option<String>,
}

/// What a container got on a bridge network: reported in a Job attempt's and a session's
/// status.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkStatus {
    /// The container's address on the network.
    pub ip: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<PortStatus>,
}

/// A published port as it was bound (the network layer's).
pub use crate::net::PortStatus;

/// What runs when a container is attached to a bridge network.
#[derive(Clone)]
pub struct NetworkHook(pub std::sync::Arc<dyn Fn(&NetworkStatus) + Send + Sync>);

impl std::fmt::Debug for NetworkHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NetworkHook")
    }
}

/// What runs when a pool member is claimed: given the pool's name, and when its refill may
/// start.
#[derive(Clone)]
pub struct ClaimHook(pub std::sync::Arc<ClaimFn>);

/// A claim hook's function: the pool's name, and when its refill may start.
pub type ClaimFn = dyn Fn(&str, Refill) + Send + Sync;

/// When a claim's refill may start, by what the hook's caller already waited for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refill {
    /// Once the pool's claims pause: the caller is one claim of a burst it cannot see (a CLI
    /// process among others).
    WhenQuiet,
    /// At once: the caller waited for its own claims to pause first (a server's sessions).
    Now,
}

impl std::fmt::Debug for ClaimHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClaimHook")
    }
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        RuntimeOptions {
            output_limit: crate::config::DEFAULT_OUTPUT_LIMIT,
            kill_grace: Duration::from_millis(500),
            use_cgroup: true,
            exec_via_agent: true,
            durable_output: false,
            logger_binary: None,
            live_output: None,
            tools: Vec::new(),
            use_pools: false,
            pools: Vec::new(),
            on_claim: None,
            registry: crate::image::registry::RegistryConfig::default(),
            on_network: None,
            dns_upstream: Vec::new(),
            net: crate::config::NetPaths::default(),
            rootfs_dir: crate::config::DEFAULT_ROOTFS_DIR.into(),
            userns_dir: crate::config::DEFAULT_USERNS_DIR.into(),
            shim_groups: None,
            shim_seeds: None,
            image_read: None,
        }
    }
}

/// Start a live runtime for a plan on its backend.
pub async fn spawn(
    plan: &RunPlan,
    host: &crate::spec::HostEnv,
    options: &RuntimeOptions,
) -> Result<Box<dyn Runtime>, RuntimeError> {
    spawn_with(plan, host, options, None).await
}

/// As `spawn`, with the containerd engine for `backend: containerd`.
pub async fn spawn_with(
    plan: &RunPlan,
    host: &crate::spec::HostEnv,
    options: &RuntimeOptions,
    engine: Option<&containerd::Engine>,
) -> Result<Box<dyn Runtime>, RuntimeError> {
    match plan.bound.backend {
        crate::manifest::Backend::Host => Ok(Box::new(host::HostRuntime::spawn(plan, host, options).await?)),
        crate::manifest::Backend::Containerd => match engine {
            Some(engine) => Ok(Box::new(engine.spawn_live(plan).await?)),
            None => Err(RuntimeError::Unavailable("containerd")),
        },
    }
}
