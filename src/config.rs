//! The runner's configuration: plain data, built once at the edge (the CLI's flags and
//! environment, or a library user's code). Nothing below `cli` sees clap.

use std::path::PathBuf;
use std::time::Duration;

/// containerd's default socket (the system daemon's).
pub const DEFAULT_ADDRESS: &str = "/run/containerd/containerd.sock";
/// containerd namespace for everything runner creates.
pub const DEFAULT_NAMESPACE: &str = "runner";
/// Where runner keeps its state.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/runner";
/// Bytes of stdout and of stderr kept per command (head and tail).
pub const DEFAULT_OUTPUT_LIMIT: usize = 10 << 20;
/// Where remapped containers' rootfs directories live, host-wide (outside the state dir).
pub const DEFAULT_ROOTFS_DIR: &str = "/run/runner/rootfs";
/// The host-wide directory of user-namespace range leases.
pub const DEFAULT_USERNS_DIR: &str = "/run/runner/userns";
/// Idle sessions of `runner serve` end after this long.
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(30 * 60);
/// After SIGTERM or Ctrl-C, how long `serve` and a foreground `apply` take at most to stop
/// (in-flight calls finish or are cut, sandboxes are stopped), whatever their sandboxes do.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// The job store's file in a state dir (a state dir holding one judges its own attempts).
pub const STORE_FILE: &str = "runner.db";
/// Host-wide network state: per network its names and registration, the resolver's files,
/// the published ports, the network lock.
pub const DEFAULT_NET_DIR: &str = "/run/runner/net";
/// Where Debian (and most distributions) install the CNI plugins.
pub const DEFAULT_CNI_PATH: &str = "/usr/lib/cni:/opt/cni/bin";
/// Where host-local keeps its leases (CNI's default data directory), per network name.
pub const DEFAULT_IPAM_DIR: &str = "/var/lib/cni/networks";
/// The first retry delay of a failed attempt (Kubernetes' pod backoff).
pub const DEFAULT_BACKOFF_BASE: Duration = Duration::from_secs(10);
/// The longest namespace containerd accepts.
const MAX_NAMESPACE_LEN: usize = 76;

/// Whether runner keeps the kernel's cgroup attach lock warm while runc creates containers
/// (`runtime::containerd::attach_lock`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WarmMode {
    /// Where it pays: never with cgroup2's `favordynmods`, else kept only when the first
    /// writes show the grace-period wait it saves.
    #[default]
    Auto,
    On,
    Off,
}

impl std::str::FromStr for WarmMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(WarmMode::Auto),
            "on" | "1" => Ok(WarmMode::On),
            "off" | "0" => Ok(WarmMode::Off),
            other => Err(format!("{other:?} is not auto, on or off")),
        }
    }
}

impl WarmMode {
    pub fn as_str(self) -> &'static str {
        match self {
            WarmMode::Auto => "auto",
            WarmMode::On => "on",
            WarmMode::Off => "off",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Job store, logs, run directories, the private containerd: never mountable into a job.
    pub state_dir: PathBuf,
    /// containerd namespace for everything runner creates.
    pub namespace: String,
    /// containerd's socket; `None`: the system daemon at `DEFAULT_ADDRESS`, else runner's own
    /// private daemon under the state dir.
    pub address: Option<PathBuf>,
    /// Environments jobs and sessions may name besides those in their own manifest.
    pub env_dir: Option<PathBuf>,
    /// Bytes kept per output stream of a command.
    pub output_limit: usize,
    /// The `runner` binary: what detached supervisors run and what the shim runs as a job's
    /// output logger (default: this executable, which is wrong only when the library is
    /// embedded in another program).
    pub runner_exe: Option<PathBuf>,
    /// The log filter handed to the processes runner starts (supervisors).
    pub log: String,
    /// How registries are reached: hosts.toml directories and plain-HTTP hosts.
    pub registry: RegistryConfig,
    /// Where runner's resolver asks for bridge containers' allowed domains (empty: the
    /// host's resolvers).
    pub dns_upstream: Vec<std::net::SocketAddr>,
    /// After SIGTERM or Ctrl-C, how long `serve` and a foreground `apply` may take to stop.
    pub shutdown_grace: Duration,
    /// Where the network layer keeps and finds host state.
    pub net: NetPaths,
    /// The bounds of runner's resolver (used by `runner resolver`).
    pub resolver: ResolverLimits,
    /// Keep the cgroup attach lock warm while containers are created.
    pub warm_cgroup_attach: WarmMode,
    /// Remapped containers' rootfs directories (host-wide, per containerd).
    pub rootfs_dir: PathBuf,
    /// User-namespace range leases (host-wide: every runner of the host must share it).
    pub userns_dir: PathBuf,
    /// The first retry delay of a failed attempt (`backoffLimit`), doubling after: 10 s as in
    /// Kubernetes; tests shorten it.
    pub backoff_base: Duration,
}

/// The host paths of the network layer (`net`), in one place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetPaths {
    /// Host-wide network state (`/run/runner/net`, a tmpfs).
    pub dir: PathBuf,
    /// Where the CNI plugins are looked for, in order.
    pub cni_path: Vec<PathBuf>,
    /// host-local's data directory.
    pub ipam_dir: PathBuf,
    /// The host's resolv.conf (its `options` go to the networks'; its nameservers are the
    /// resolver's default upstreams).
    pub host_resolv_conf: PathBuf,
    /// Where the host's interfaces are listed (a bridge's ports: whether a network is in use).
    pub sys_class_net: PathBuf,
}

impl Default for NetPaths {
    fn default() -> Self {
        NetPaths {
            dir: PathBuf::from(DEFAULT_NET_DIR),
            cni_path: std::env::split_paths(DEFAULT_CNI_PATH).collect(),
            ipam_dir: PathBuf::from(DEFAULT_IPAM_DIR),
            host_resolv_conf: PathBuf::from("/etc/resolv.conf"),
            sys_class_net: PathBuf::from("/sys/class/net"),
        }
    }
}

/// What runner's resolver allows each container, and itself (see `net::resolver`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolverLimits {
    /// Queries per second per source container (a token bucket's rate); over it, REFUSED.
    pub queries_per_second: u32,
    /// The bucket's size (a burst).
    pub query_burst: u32,
    /// Upstream queries in flight per source container.
    pub upstream_per_source: usize,
    /// Open TCP connections per source container.
    pub tcp_per_source: usize,
    /// A TCP connection with no complete query for this long is closed.
    pub tcp_idle: Duration,
    /// Queries being answered at once, for every container together.
    pub max_tasks: usize,
    /// TCP connections open at once, for every container together.
    pub max_tcp: usize,
    /// Answers kept for their TTL (names . types).
    pub cache_entries: usize,
    /// Addresses a container's domains may have in the wall at once.
    pub elements_per_container: usize,
    /// Above this resident size the resolver sheds work (no upstream query, cache emptied).
    pub memory_bytes: u64,
    /// How long an upstream resolver may take.
    pub upstream_timeout: Duration,
    /// The log file's size before it is rotated (one old file is kept).
    pub log_bytes: u64,
    /// Log lines per second (more are counted and dropped).
    pub log_lines_per_second: u32,
}

impl Default for ResolverLimits {
    fn default() -> Self {
        ResolverLimits {
            queries_per_second: 50,
            query_burst: 100,
            upstream_per_source: 8,
            tcp_per_source: 8,
            tcp_idle: Duration::from_secs(3),
            max_tasks: 256,
            max_tcp: 128,
            cache_entries: 4096,
            elements_per_container: 4096,
            memory_bytes: 48 << 20,
            upstream_timeout: Duration::from_secs(2),
            log_bytes: 1 << 20,
            log_lines_per_second: 20,
        }
    }
}

impl Config {
    /// The defaults, with a state directory.
    pub fn new(state_dir: impl Into<PathBuf>) -> Self {
        let state_dir = state_dir.into();
        Config {
            registry: RegistryConfig::with_defaults(&state_dir),
            state_dir,
            namespace: DEFAULT_NAMESPACE.to_string(),
            address: None,
            env_dir: None,
            output_limit: DEFAULT_OUTPUT_LIMIT,
            runner_exe: None,
            log: "warn".to_string(),
            dns_upstream: Vec::new(),
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            net: NetPaths::default(),
            resolver: ResolverLimits::default(),
            warm_cgroup_attach: WarmMode::default(),
            rootfs_dir: PathBuf::from(DEFAULT_ROOTFS_DIR),
            userns_dir: PathBuf::from(DEFAULT_USERNS_DIR),
            backoff_base: DEFAULT_BACKOFF_BASE,
        }
    }

    /// The registry and DNS settings as command-line flags, for the runner processes this one
    /// starts (supervisors and pool fillers pull images and attach containers too).
    pub fn inherited_args(&self) -> Vec<std::ffi::OsString> {
        let mut args = vec![
            "--shutdown-grace".into(),
            humantime::format_duration(self.shutdown_grace).to_string().into(),
            "--warm-cgroup-attach".into(),
            self.warm_cgroup_attach.as_str().into(),
            "--rootfs-dir".into(),
            self.rootfs_dir.clone().into_os_string(),
            "--userns-dir".into(),
            self.userns_dir.clone().into_os_string(),
            "--backoff-base".into(),
            humantime::format_duration(self.backoff_base).to_string().into(),
        ];
        if let Some(dir) = &self.registry.docker_config {
            args.push("--docker-config".into());
            args.push(dir.clone().into_os_string());
        }
        for server in &self.dns_upstream {
            args.push("--dns-upstream".into());
            args.push(server.to_string().into());
        }
        let net = NetPaths::default();
        if self.net.dir != net.dir {
            args.push("--net-dir".into());
            args.push(self.net.dir.clone().into_os_string());
        }
        if self.net.cni_path != net.cni_path
            && let Ok(path) = std::env::join_paths(&self.net.cni_path)
        {
            args.push("--cni-path".into());
            args.push(path);
        }
        for dir in &self.registry.hosts_dirs {
            args.push("--hosts-dir".into());
            args.push(dir.clone().into_os_string());
        }
        for host in &self.registry.insecure {
            args.push("--insecure-registry".into());
            args.push(host.into());
        }
        args
    }

    /// Per-job output and results.
    pub fn logs_dir(&self) -> PathBuf {
        self.state_dir.join("logs")
    }

    /// Per-container directories (FIFOs, stdin, the agent's, the logger's output).
    pub fn run_dir(&self) -> PathBuf {
        self.state_dir.join("run")
    }

    /// Where a `runner serve` of this state dir takes foreground applies from the CLI
    /// (`service::handoff`): one per state dir, as dockerd's socket is one per host.
    pub fn handoff_socket(&self) -> PathBuf {
        self.state_dir.join("serve.sock")
    }

    /// What must be the same for a server to run a CLI's jobs as the CLI itself would: the
    /// containerd it talks to and everything that changes how a job is run or pulled. The
    /// binary's version is part of it (another build may run jobs differently). Not the log
    /// filter or the shutdown grace, which are each process's own; not the env dir or the
    /// output limit, which the hand-off carries. The executable is resolved: a server started from
    /// another binary runs nothing for this one.
    pub fn handoff_fingerprint(&self) -> String {
        format!(
            "{} {:?}",
            env!("CARGO_PKG_VERSION"),
            (
                &self.namespace,
                &self.address,
                self.runner_exe().ok(),
                &self.registry,
                &self.dns_upstream,
                &self.net,
                self.warm_cgroup_attach,
                &self.rootfs_dir,
                &self.userns_dir,
                self.backoff_base,
            )
        )
    }

    /// The `runner` binary to start (supervisors, output loggers).
    pub fn runner_exe(&self) -> std::io::Result<PathBuf> {
        match &self.runner_exe {
            Some(path) => Ok(path.clone()),
            None => std::env::current_exe(),
        }
    }

    /// Why the namespace is not one containerd accepts: alphanumeric words joined by `.`, `_`
    /// or `-`.
    pub fn namespace_error(&self) -> Option<String> {
        let ns = &self.namespace;
        let ok = !ns.is_empty()
            && ns.len() <= MAX_NAMESPACE_LEN
            && ns
                .split(['.', '_', '-'])
                .all(|w| !w.is_empty() && w.bytes().all(|b| b.is_ascii_alphanumeric()));
        (!ok).then(|| {
            format!("namespace {ns:?} is not a valid containerd namespace (letters and digits joined by . _ -)")
        })
    }
}

/// `runner serve`: the configuration and where to listen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServeConfig {
    pub config: Config,
    /// A loopback address (default 127.0.0.1:8080; port 0 picks one).
    pub listen: Option<std::net::SocketAddr>,
    /// A unix socket instead (created with mode 0600).
    pub socket: Option<PathBuf>,
    /// The file holding the bearer token.
    pub token_file: PathBuf,
    /// Idle sessions end after this long.
    pub session_ttl: Duration,
    /// Also serve the metrics, without the token, on this loopback address.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Warm pools kept for sessions: Environment names of the env dir, with their sizes.
    pub pools: Vec<String>,
    /// How many live sessions the host's limits are checked for at start.
    pub expect_sessions: u64,
    /// Live sessions of one Environment per containerd shim (1: a shim each).
    pub sessions_per_shim: usize,
    /// containerd shims kept started ahead for cold creates (0: none).
    pub warm_shims: usize,
}

/// What a server tells its operator (the CLI prints it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServeEvent {
    /// Where it listens: `http://127.0.0.1:PORT` or `unix:PATH`.
    Listening(String),
    /// Where the token-free metrics are served (`--metrics-listen`).
    Metrics(String),
    /// runner's private containerd was started (no other was reachable): its PID and socket.
    StartedContainerd { pid: u32, socket: PathBuf },
    /// containerd could not be reached at start: only host-backend sessions and jobs work
    /// until it can.
    ContainerdUnavailable(String),
    /// The open-files limit the server runs with (raised from `before` to its hard limit).
    OpenFiles { before: u64, now: u64 },
    /// A host limit too low for the sessions expected (`--expect-sessions`): what to set.
    HostLimit(String),
}

/// How registries are reached (built at the edge from flags, environment and the state dir;
/// `image::registry` reads it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegistryConfig {
    /// hosts.toml directories, searched in order.
    pub hosts_dirs: Vec<PathBuf>,
    /// `HOST[:PORT]`s spoken to over plain HTTP (`--insecure-registry`).
    pub insecure: Vec<String>,
    /// Docker's client config directory, whose `config.json` holds registry credentials
    /// (`--docker-config`, `$DOCKER_CONFIG`, else `~/.docker`); `None`: anonymous only.
    pub docker_config: Option<PathBuf>,
}

impl RegistryConfig {
    /// The default search path: the state dir's own `certs.d`, then containerd's and
    /// Docker's system directories (as nerdctl reads them).
    pub fn with_defaults(state_dir: &std::path::Path) -> Self {
        RegistryConfig {
            hosts_dirs: vec![
                state_dir.join("certs.d"),
                PathBuf::from("/etc/containerd/certs.d"),
                PathBuf::from("/etc/docker/certs.d"),
            ],
            insecure: Vec::new(),
            docker_config: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_runner_starts_get_its_network_paths() {
        let mut c = Config::new("/tmp/x");
        assert!(!c.inherited_args().iter().any(|a| a == "--net-dir" || a == "--cni-path"));
        c.net.dir = "/tmp/net".into();
        c.net.cni_path = vec!["/opt/a".into(), "/opt/b".into()];
        let args: Vec<String> = c
            .inherited_args()
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let after = |flag: &str| args.iter().position(|a| a == flag).map(|i| args[i + 1].clone());
        assert_eq!(after("--net-dir").as_deref(), Some("/tmp/net"));
        assert_eq!(after("--cni-path").as_deref(), Some("/opt/a:/opt/b"));
    }

    #[test]
    fn namespaces_are_checked_like_containerd_does() {
        let mut c = Config::new("/tmp/x");
        for ok in ["runner", "runner-test-12", "a.b_c"] {
            c.namespace = ok.into();
            assert_eq!(c.namespace_error(), None, "{ok}");
        }
        for bad in ["", "a..b", "-a", "a b", "ünï"] {
            c.namespace = bad.into();
            assert!(c.namespace_error().is_some(), "{bad}");
        }
    }
}
