//! The command line's arguments: the verbs, their flags, the global options (hidden from each
//! verb's help and listed by `runner options`), and the configuration they build.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::{Config, DEFAULT_NAMESPACE, DEFAULT_OUTPUT_LIMIT, DEFAULT_STATE_DIR};
use crate::manifest::Backend;

#[derive(Parser, Debug)]
#[command(
    name = "runner",
    version,
    about = "Run jobs in isolated containers through containerd, or as trusted host processes"
)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Verb,
}

#[derive(Args, Debug, Clone)]
pub struct Global {
    /// containerd's gRPC socket [default: /run/containerd/containerd.sock, else runner's own
    /// private containerd under the state dir, started on first use].
    #[arg(
        long,
        global = true,
        hide = true,
        help_heading = "Containerd",
        env = "CONTAINERD_ADDRESS"
    )]
    pub address: Option<PathBuf>,
    /// containerd namespace for everything runner creates.
    #[arg(long, global = true,
        hide = true,
        help_heading = "Containerd", env = "CONTAINERD_NAMESPACE", default_value = DEFAULT_NAMESPACE)]
    pub namespace: String,
    /// Where runner keeps its state (never mountable into a job).
    #[arg(long, global = true,
        hide = true,
        help_heading = "State and logging", env = "RUNNER_STATE_DIR", default_value = DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,
    /// Log filter (tracing syntax), e.g. `debug` or `runner=trace` [default: warn; for
    /// `serve`, warn and one line per request].
    #[arg(
        long,
        global = true,
        hide = true,
        help_heading = "State and logging",
        env = "RUNNER_LOG"
    )]
    pub log: Option<String>,
    /// Log lines as text or as JSON objects.
    #[arg(
        long,
        global = true,
        hide = true,
        help_heading = "State and logging",
        env = "RUNNER_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    pub log_format: LogFormat,
    /// Directories of containerd-style registry host configs (`HOST[:PORT]/hosts.toml`:
    /// mirrors, plain HTTP, CA files), searched in order [default: STATE_DIR/certs.d,
    /// /etc/containerd/certs.d, /etc/docker/certs.d].
    #[arg(
        long = "hosts-dir",
        global = true,
        hide = true,
        help_heading = "Registries",
        env = "RUNNER_HOSTS_DIR",
        value_delimiter = ':',
        value_name = "DIR"
    )]
    pub hosts_dirs: Vec<PathBuf>,
    /// A registry (`HOST[:PORT]`) spoken to over plain HTTP; never implied. Repeatable.
    #[arg(
        long = "insecure-registry",
        global = true,
        hide = true,
        help_heading = "Registries",
        env = "RUNNER_INSECURE_REGISTRY",
        value_delimiter = ',',
        value_name = "HOST[:PORT]"
    )]
    pub insecure_registries: Vec<String>,
    /// The resolvers runner's own resolver asks for the `egress.allow` domains of bridge
    /// containers (`IP[:PORT]`) [default: the host's, from /etc/resolv.conf].
    #[arg(
        long = "dns-upstream",
        global = true,
        hide = true,
        help_heading = "Networks",
        env = "RUNNER_DNS_UPSTREAM",
        value_delimiter = ',',
        value_name = "IP[:PORT]",
        value_parser = parse_upstream
    )]
    pub dns_upstream: Vec<std::net::SocketAddr>,
    /// After SIGTERM or Ctrl-C, how long `serve` and a foreground `apply` take at most to stop:
    /// in-flight calls and attempts get this long to end, then what is left is cut (`10s`,
    /// `500ms`).
    #[arg(
        long,
        global = true,
        hide = true,
        help_heading = "Jobs and servers",
        env = "RUNNER_SHUTDOWN_GRACE",
        value_name = "DURATION",
        default_value = "10s",
        value_parser = humantime::parse_duration
    )]
    pub shutdown_grace: std::time::Duration,
    /// Host-wide network state: the networks' name files, the published ports, runner's
    /// resolver and the network lock (a tmpfs directory shared by every runner on the host).
    #[arg(long, global = true, hide = true, help_heading = "Networks", env = "RUNNER_NET_DIR", value_name = "DIR", default_value = crate::config::DEFAULT_NET_DIR)]
    pub net_dir: PathBuf,
    /// Where the CNI plugins are looked for, in order.
    #[arg(
        long,
        global = true, hide = true, help_heading = "Networks",
        env = "RUNNER_CNI_PATH",
        value_name = "DIR[:DIR...]",
        value_delimiter = ':',
        default_value = crate::config::DEFAULT_CNI_PATH
    )]
    pub cni_path: Vec<PathBuf>,
    /// Keep the kernel's cgroup attach lock warm while runc creates containers: `auto` (where
    /// it pays: not with cgroup2's favordynmods, else measured by its first writes), `on`,
    /// `off`. Saves 5-16 ms per cold container on kernels that wait a grace period.
    #[arg(
        long,
        global = true,
        hide = true,
        help_heading = "Containerd",
        env = "RUNNER_WARM_CGROUP_ATTACH",
        value_name = "auto|on|off",
        default_value = "auto"
    )]
    pub warm_cgroup_attach: crate::config::WarmMode,
    /// Where remapped containers' rootfs directories live (host-wide; outside the state dir,
    /// which runc's init must be able to reach through).
    #[arg(long, global = true,
        hide = true,
        help_heading = "Containerd", env = "RUNNER_ROOTFS_DIR", value_name = "DIR", default_value = crate::config::DEFAULT_ROOTFS_DIR)]
    pub rootfs_dir: PathBuf,
    /// The host-wide directory of user-namespace range leases (every runner of a host must
    /// use the same one: two never hand out the same ids).
    #[arg(long, global = true,
        hide = true,
        help_heading = "Containerd", env = "RUNNER_USERNS_DIR", value_name = "DIR", default_value = crate::config::DEFAULT_USERNS_DIR)]
    pub userns_dir: PathBuf,
    /// The first retry delay of a failed attempt (doubling after, capped at 6 min).
    #[arg(
        long,
        global = true,
        hide = true,
        help_heading = "Jobs and servers",
        env = "RUNNER_BACKOFF_BASE",
        value_name = "DURATION",
        default_value = "10s",
        value_parser = humantime::parse_duration
    )]
    pub backoff_base: std::time::Duration,
    /// Docker's client config directory, for registry credentials [default: $HOME/.docker].
    #[arg(
        long,
        global = true,
        hide = true,
        help_heading = "Registries",
        env = "DOCKER_CONFIG",
        value_name = "DIR"
    )]
    pub docker_config: Option<PathBuf>,
    /// The runner binary supervisors and output loggers run (default: this one).
    #[arg(long, global = true, hide = true)]
    pub runner_exe: Option<PathBuf>,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

impl Global {
    /// The configuration, built once here: nothing below `cli` sees clap.
    pub fn config(&self) -> Config {
        let mut config = Config {
            address: self.address.clone(),
            namespace: self.namespace.clone(),
            log: self.log.clone().unwrap_or_else(|| "warn".into()),
            runner_exe: self.runner_exe.clone(),
            ..Config::new(&self.state_dir)
        };
        if !self.hosts_dirs.is_empty() {
            config.registry.hosts_dirs = self.hosts_dirs.clone();
        }
        config.registry.insecure = self.insecure_registries.clone();
        config.dns_upstream = self.dns_upstream.clone();
        config.shutdown_grace = self.shutdown_grace;
        config.net.dir = self.net_dir.clone();
        config.net.cni_path = self.cni_path.clone();
        config.warm_cgroup_attach = self.warm_cgroup_attach;
        config.rootfs_dir = self.rootfs_dir.clone();
        config.userns_dir = self.userns_dir.clone();
        config.backoff_base = self.backoff_base;
        // Docker's own rule: $DOCKER_CONFIG (an empty one does not count), else ~/.docker.
        config.registry.docker_config = self
            .docker_config
            .clone()
            .filter(|d| !d.as_os_str().is_empty())
            .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".docker")));
        config
    }
}

/// `IP` or `IP:PORT` (port 53 when absent).
fn parse_upstream(text: &str) -> Result<std::net::SocketAddr, String> {
    text.parse::<std::net::SocketAddr>()
        .or_else(|_| {
            text.parse::<std::net::IpAddr>()
                .map(|ip| std::net::SocketAddr::new(ip, 53))
        })
        .map_err(|_| format!("{text:?} is not IP or IP:PORT"))
}

/// The resolver's bounds (`ResolverLimits`; each defaults to its value there).
#[derive(Args, Debug, Clone)]
pub struct ResolverArgs {
    /// Queries per second per container (over it: REFUSED).
    #[arg(long, value_name = "N")]
    pub query_rate: Option<u32>,
    /// Queries a container may send at once above its rate.
    #[arg(long, value_name = "N")]
    pub query_burst: Option<u32>,
    /// Upstream queries in flight per container.
    #[arg(long, value_name = "N")]
    pub upstream_per_container: Option<usize>,
    /// Open TCP connections per container.
    #[arg(long, value_name = "N")]
    pub tcp_per_container: Option<usize>,
    /// A TCP connection with no complete query for this long is closed (`3s`).
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub tcp_idle: Option<std::time::Duration>,
    /// Queries being answered at once, all containers together.
    #[arg(long, value_name = "N")]
    pub max_tasks: Option<usize>,
    /// TCP connections open at once, all containers together.
    #[arg(long, value_name = "N")]
    pub max_tcp: Option<usize>,
    /// Answers kept for their TTL.
    #[arg(long, value_name = "N")]
    pub cache_entries: Option<usize>,
    /// Above this resident size (bytes) no upstream query starts until it is back under.
    #[arg(long, value_name = "BYTES")]
    pub memory_limit: Option<u64>,
}

impl ResolverArgs {
    pub(super) fn apply(&self, l: &mut crate::config::ResolverLimits) {
        let d = crate::config::ResolverLimits::default();
        l.queries_per_second = self.query_rate.unwrap_or(d.queries_per_second);
        l.query_burst = self.query_burst.unwrap_or(d.query_burst);
        l.upstream_per_source = self.upstream_per_container.unwrap_or(d.upstream_per_source);
        l.tcp_per_source = self.tcp_per_container.unwrap_or(d.tcp_per_source);
        l.tcp_idle = self.tcp_idle.unwrap_or(d.tcp_idle);
        l.max_tasks = self.max_tasks.unwrap_or(d.max_tasks);
        l.max_tcp = self.max_tcp.unwrap_or(d.max_tcp);
        l.cache_entries = self.cache_entries.unwrap_or(d.cache_entries);
        l.memory_bytes = self.memory_limit.unwrap_or(d.memory_bytes);
    }
}

#[derive(Subcommand, Debug)]
pub enum Verb {
    /// Check a manifest file: syntax, fields, paths and the spec each job would get.
    Validate(FileArgs),
    /// Print the OCI runtime spec a job would run with (no containerd needed).
    Spec {
        #[command(flatten)]
        file: FileArgs,
        /// Which job of the file (default: the only one).
        #[arg(long)]
        job: Option<String>,
    },
    /// Print the Kubernetes objects that run a manifest's Jobs on a cluster (or its
    /// Environments as agent-sandbox Sandboxes).
    Export(Box<ExportArgs>),
    /// Run the jobs of a manifest file in the foreground and print their results.
    Apply {
        #[command(flatten)]
        file: FileArgs,
        /// Output format.
        #[arg(short = 'o', long = "output", value_enum)]
        output: Option<OutputFormat>,
        /// Run on this backend instead of the Environment's.
        #[arg(long)]
        backend: Option<Backend>,
        /// Bytes of stdout and of stderr kept per job (head and tail; the rest is counted).
        #[arg(long, default_value_t = DEFAULT_OUTPUT_LIMIT)]
        max_output_bytes: usize,
        /// Return at once; a supervisor process carries the jobs to their end.
        #[arg(short = 'd', long)]
        detach: bool,
        /// Replace finished jobs of the same names (their records and logs go); without it a
        /// name that exists is refused, as Kubernetes answers AlreadyExists.
        #[arg(long)]
        replace: bool,
        /// Print only this completion index's output (default: every index's, each line
        /// prefixed `[INDEX] ` when a job has more than one).
        #[arg(long, conflicts_with = "detach")]
        index: Option<u32>,
        /// Run the jobs on a Kubernetes cluster (the objects `runner export` prints), follow
        /// them and report their results as a local run does.
        #[arg(long, conflicts_with_all = ["detach", "backend"])]
        kube: bool,
        /// The kubeconfig context (default: its current one).
        #[arg(long, requires = "kube")]
        kube_context: Option<String>,
        #[command(flatten)]
        kube_flags: KubeFlags,
        /// Run the jobs in this process even when a `runner serve` of this state dir is
        /// running (by default a foreground apply is handed to it, and only printed here).
        #[arg(long, conflicts_with_all = ["detach", "kube"])]
        local: bool,
    },
    /// List jobs, or show one.
    Get {
        #[command(subcommand)]
        what: GetWhat,
    },
    /// Show a job in detail: conditions, attempts, events.
    Describe {
        #[command(subcommand)]
        what: OneJob,
    },
    /// Print a job's output: the last attempt of every index (stdout on stdout, stderr on
    /// stderr).
    Logs {
        /// The job.
        name: String,
        /// Keep printing as the attempts write, until the job ends.
        #[arg(short = 'f', long)]
        follow: bool,
        /// Only this attempt number (0-based, per index).
        #[arg(long)]
        attempt: Option<u32>,
        /// Only this completion index.
        #[arg(long)]
        index: Option<u32>,
        /// Begin every line with its completion index: `[INDEX] `.
        #[arg(long)]
        prefix: bool,
        /// Only the last N lines of each attempt's stdout and stderr (following: then what
        /// comes).
        #[arg(long, value_name = "N")]
        tail: Option<usize>,
        /// The setup's output (its Environment's setup script) instead of the command's.
        #[arg(long)]
        setup: bool,
    },
    /// Wait until a job ends; exit 0 when it succeeded, 1 when it failed, 2 on timeout.
    Wait {
        /// The job.
        name: String,
        /// Give up after this long (e.g. 60s, 5m).
        #[arg(long, value_parser = humantime::parse_duration)]
        timeout: Option<std::time::Duration>,
    },
    /// Delete a job: stop what runs, remove its containers, its record and its logs.
    Delete {
        #[command(subcommand)]
        what: DeleteWhat,
    },
    /// Serve DNS to bridge-network containers (what the first bridge container starts; not
    /// for direct use).
    #[command(hide = true)]
    Resolver(ResolverArgs),
    /// Carry a stored job to its end (what `apply --detach` starts; not for direct use).
    #[command(hide = true)]
    Supervise {
        name: String,
        /// Pick up a job whose supervisor died (re-adopt its containers).
        #[arg(long)]
        adopt: bool,
    },
    /// Serve live sandboxes and Jobs over HTTP (bearer token; loopback or a unix socket).
    Serve {
        /// Loopback address to listen on, e.g. 127.0.0.1:8080 (port 0 picks one).
        #[arg(long, conflicts_with = "socket")]
        listen: Option<std::net::SocketAddr>,
        /// Unix socket to listen on (created with mode 0600).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// File holding the bearer token.
        #[arg(long)]
        token_file: PathBuf,
        /// Environments sessions and jobs may name.
        #[arg(long)]
        env_dir: Option<PathBuf>,
        /// Also serve GET /metrics without the token on this loopback address.
        #[arg(long)]
        metrics_listen: Option<std::net::SocketAddr>,
        /// Keep a warm pool of this Environment of --env-dir for sessions: ENV=SIZE
        /// (repeatable; the pool has the Environment's name).
        #[arg(long = "pool", value_name = "ENV=SIZE")]
        pools: Vec<String>,
        /// Idle sessions are ended after this long.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "30m")]
        session_ttl: std::time::Duration,
        /// Check at start that the host's limits (kernel.pid_max, open files, ...) hold this
        /// many live sessions, and say what to set when they do not.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
        expect_sessions: u64,
        /// Live sessions of one Environment share a containerd shim, up to this many per shim
        /// (1: a shim each). Fewer shims: less idle CPU and fewer threads per session; a shim
        /// that dies ends every session of its group.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=256))]
        sessions_per_shim: u64,
        /// Keep this many containerd shims started ahead, so a cold session or job skips
        /// the shim's start (each is an idle shim and a waiting `runc init`, made when the
        /// server is quiet; 0: none; unused with --sessions-per-shim over 1).
        #[arg(long, env = "RUNNER_WARM_SHIMS", default_value_t = 1, value_parser = clap::value_parser!(u64).range(0..=8))]
        warm_shims: u64,
    },
    /// Run a command on a terminal in a session of a `runner serve` (`-it`: your terminal,
    /// in raw mode, is connected to it; exits with the command's status).
    Exec {
        /// Keep stdin open and send it (keys) to the command.
        #[arg(short = 'i', long)]
        interactive: bool,
        /// Allocate a terminal in the sandbox (required: commands without one go through the
        /// HTTP API's /exec).
        #[arg(short = 't', long)]
        tty: bool,
        #[command(flatten)]
        server: ServerArgs,
        /// The session's id.
        session: String,
        /// The command and its arguments (after `--`).
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Open the image's shell on a terminal in a session of a `runner serve` and connect your
    /// terminal to it (as `exec -it SESSION` with the default shell).
    Attach {
        #[command(flatten)]
        server: ServerArgs,
        /// The session's id.
        session: String,
    },
    /// Pause a session of a `runner serve`: its processes frozen, their memory kept
    /// (`POST /v1/sessions/{id}/pause`).
    Pause {
        #[command(flatten)]
        server: ServerArgs,
        /// The session's id.
        session: String,
        #[arg(short = 'o', long = "output", value_enum)]
        output: Option<OutputFormat>,
    },
    /// Resume a paused session of a `runner serve`: the same processes go on.
    #[command(visible_alias = "unpause")]
    Resume {
        #[command(flatten)]
        server: ServerArgs,
        /// The session's id.
        session: String,
        #[arg(short = 'o', long = "output", value_enum)]
        output: Option<OutputFormat>,
    },
    /// What running containers use now: CPU (rate and time), memory (now and peak), pids, block
    /// I/O and network bytes, from their cgroups (jobs' attempts, sessions, pool members).
    Top {
        /// Only this job's (or session's) containers.
        job: Option<String>,
        #[arg(short = 'o', long = "output", value_enum)]
        output: Option<OutputFormat>,
    },
    /// Manage images in containerd.
    Image {
        #[command(subcommand)]
        verb: ImageVerb,
    },
    /// Manage warm pools: containers started ahead of time that jobs and sessions claim.
    Pool {
        #[command(subcommand)]
        verb: PoolVerb,
    },
    /// Filesystem snapshots of running sandboxes, usable as images (`snapshot:NAME`).
    Snapshot {
        #[command(subcommand)]
        verb: SnapshotVerb,
    },
    /// Manage runner's private containerd.
    Daemon {
        #[command(subcommand)]
        verb: DaemonVerb,
    },
    /// Remove containers, snapshots and leases runner created that no live job owns.
    Gc,
    /// Print runner's version and commit, and containerd's version where one answers.
    Version {
        #[arg(short = 'o', long = "output", value_enum)]
        output: Option<OutputFormat>,
    },
    /// Print the options every verb takes (containerd, registries, networks, state, logging).
    Options,
    /// Print a shell completion script: `source <(runner completion bash)`, or for zsh and
    /// fish the same into their completion directories.
    Completion {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

#[derive(Subcommand, Debug)]
pub enum GetWhat {
    /// List jobs.
    #[command(alias = "job")]
    Jobs {
        /// One job by name.
        name: Option<String>,
        /// Label selector, as kubectl takes it: key=value, key!=value, key, !key, key in (a,b), key notin (a,b), joined by commas.
        #[arg(short = 'l', long = "selector")]
        selector: Option<String>,
        #[arg(short = 'o', long = "output", value_enum)]
        output: Option<OutputFormat>,
        /// After the list, print each job again whenever it changes (until interrupted).
        #[arg(short = 'w', long)]
        watch: bool,
    },
    /// List warm pools (as `pool ls`), or show one.
    #[command(alias = "pool")]
    Pools {
        /// One pool by name.
        name: Option<String>,
        #[arg(short = 'o', long = "output", value_enum)]
        output: Option<OutputFormat>,
    },
}

#[derive(Subcommand, Debug)]
pub enum OneJob {
    /// A job by name.
    Job { name: String },
}

#[derive(Subcommand, Debug)]
pub enum DeleteWhat {
    /// Jobs: one by name, every one (--all), or those with labels (-l): each is stopped
    /// (SIGTERM, its grace, SIGKILL), its containers, record and logs removed.
    #[command(alias = "jobs")]
    Job {
        name: Option<String>,
        /// Every job of this state dir.
        #[arg(long, conflicts_with_all = ["name", "selector"])]
        all: bool,
        /// Label selector, as kubectl takes it: key=value, key!=value, key, !key, key in (a,b), key notin (a,b), joined by commas.
        #[arg(short = 'l', long = "selector", conflicts_with = "name")]
        selector: Option<String>,
        /// The job `apply --kube` ran on a cluster: remove its objects there.
        #[arg(long)]
        kube: bool,
        /// The kubeconfig context (default: its current one).
        #[arg(long, requires = "kube")]
        kube_context: Option<String>,
        /// The Kubernetes namespace (default: the context's).
        #[arg(long, requires = "kube")]
        kube_namespace: Option<String>,
    },
}

#[derive(Subcommand, Debug)]
pub enum ImageVerb {
    /// Import an OCI layout tar, a `docker save` archive, or a plain rootfs tarball.
    Import {
        /// The archive.
        file: PathBuf,
        /// Image name (required for rootfs tarballs and unnamed archives; overrides others).
        #[arg(long)]
        name: Option<String>,
        /// Rootfs tarballs: the image's default command, as a JSON array (`'["sh","-c","x"]'`)
        /// or a shell string (run by /bin/sh -c), as Docker's CMD.
        #[arg(long = "cmd", allow_hyphen_values = true)]
        cmd: Option<String>,
        /// Rootfs tarballs: an environment variable KEY=VALUE (repeatable).
        #[arg(long = "env")]
        env: Vec<String>,
        /// Rootfs tarballs: the image's working directory.
        #[arg(long)]
        workdir: Option<String>,
        /// Rootfs tarballs: the image's user.
        #[arg(long)]
        user: Option<String>,
    },
    /// Pull an image from a registry (`python:3.12` is `docker.io/library/python:3.12`).
    Pull {
        /// The reference: `[HOST[:PORT]/]NAME[:TAG|@DIGEST]`.
        reference: String,
        /// The platform to pull from a multi-platform index [default: this machine's].
        #[arg(long)]
        platform: Option<String>,
        /// `json`: one JSON event per line on stdout, then the result.
        #[arg(short = 'o', long = "output", value_enum)]
        output: Option<OutputFormat>,
    },
    /// Push a local image to the registry its name points at.
    Push {
        /// The image (`HOST[:PORT]/NAME:TAG`; tag a local image first with `runner image tag`).
        reference: String,
        /// The platform's manifest to push when the image is a multi-platform index.
        #[arg(long)]
        platform: Option<String>,
        #[arg(short = 'o', long = "output", value_enum)]
        output: Option<OutputFormat>,
    },
    /// Give a local image another name.
    Tag { source: String, target: String },
    /// List images.
    #[command(alias = "list")]
    Ls {
        #[arg(short = 'o', long = "output", value_enum)]
        output: Option<OutputFormat>,
    },
    /// Remove images.
    #[command(alias = "remove")]
    Rm { names: Vec<String> },
}

#[derive(Subcommand, Debug)]
pub enum PoolVerb {
    /// Create (or resize) the warm pool of an Environment and fill it.
    Create {
        /// The Environment (from the manifest file, else --env-dir).
        environment: String,
        #[command(flatten)]
        file: FileArgs,
        /// Members kept ready.
        #[arg(long, default_value_t = 2)]
        size: u32,
        /// The pool's name [default: the Environment's].
        #[arg(long)]
        name: Option<String>,
        /// No longer needed (kept for older scripts): every pool serves jobs with and without a workspace.
        #[arg(long)]
        workspace: bool,
        /// No longer needed (kept for older scripts): every pool serves jobs with and without static assets.
        #[arg(long)]
        static_assets: bool,
        /// Members start from this snapshot (`runner snapshot ls`) instead of the
        /// Environment's image: they serve the jobs and sessions that start from
        /// `snapshot:NAME` with the Environment's other settings.
        #[arg(long, value_name = "NAME")]
        snapshot: Option<String>,
    },
    /// List pools: size, ready and broken members.
    #[command(alias = "list")]
    Ls {
        #[arg(short = 'o', long = "output", value_enum)]
        output: Option<OutputFormat>,
    },
    /// Remove pools and their unclaimed members.
    #[command(alias = "remove")]
    Rm { names: Vec<String> },
    /// Bring a pool to its size (what a claim starts in the background).
    #[command(hide = true)]
    Fill {
        name: String,
        /// A descriptor holding the pool's queue lock (given by the claim that started this
        /// filler): released once this filler holds the fill lock.
        #[arg(long, hide = true)]
        queued_fd: Option<i32>,
    },
}

#[derive(Subcommand, Debug)]
pub enum SnapshotVerb {
    /// Make a running sandbox's filesystem changes an image, `snapshot:NAME` (its mounts are
    /// not part of it, its workspace only with --workspace; it is frozen while they are read).
    Create {
        /// A session id, a Job's name (its running container), or JOB-ATTEMPT.
        source: String,
        /// The snapshot's name.
        name: String,
        /// Replace a snapshot of that name.
        #[arg(long)]
        replace: bool,
        /// Hold the sandbox's workspace too: what starts from the snapshot finds those files
        /// in its own workspace (where it has none of that name).
        #[arg(long)]
        workspace: bool,
        #[arg(short = 'o', long = "output", value_enum)]
        output: Option<OutputFormat>,
    },
    /// List snapshots: base image, layer size, disk use.
    #[command(alias = "list")]
    Ls {
        #[arg(short = 'o', long = "output", value_enum)]
        output: Option<OutputFormat>,
    },
    /// Remove snapshots (their disk space is freed once no container runs on them).
    #[command(alias = "remove")]
    Rm { names: Vec<String> },
}

#[derive(Subcommand, Debug)]
pub enum DaemonVerb {
    /// Start runner's private containerd under the state dir (no-op when it runs).
    Start,
    /// Stop the private containerd runner started (only that process).
    Stop,
    /// Say whether it runs, its PID and socket.
    Status,
}

#[derive(Args, Debug)]
pub struct ExportArgs {
    #[command(flatten)]
    pub file: FileArgs,
    /// Only this job.
    #[arg(long)]
    pub job: Option<String>,
    /// Output format (a YAML stream, or a JSON List).
    #[arg(short = 'o', long = "output", value_enum, default_value = "yaml")]
    pub output: ExportFormat,
    #[command(flatten)]
    pub kube: KubeFlags,
    /// Export the file's Environments as agent-sandbox Sandboxes (agents.x-k8s.io).
    #[arg(long)]
    pub sandbox: bool,
}

/// How a manifest becomes Kubernetes objects (`export`, `apply --kube`).
#[derive(Args, Debug, Clone)]
pub struct KubeFlags {
    /// The image for Environments that name none (host-backend ones run in it).
    #[arg(long)]
    pub image: Option<String>,
    /// Where a job's workspace comes from: copy (its files, at most 1 MiB, copied into an
    /// emptyDir), empty, or pvc:CLAIM.
    #[arg(long, value_parser = |s: &str| s.parse::<crate::spec::kube::WorkspaceVolume>())]
    pub workspace: Option<crate::spec::kube::WorkspaceVolume>,
    /// Write runner's seccomp filter to this file and make the pods use it as a Localhost
    /// profile named after the file (install it in the kubelet's seccomp directory).
    #[arg(long)]
    pub seccomp_profile: Option<PathBuf>,
    /// The Kubernetes namespace of every object (`--namespace` is containerd's).
    #[arg(long)]
    pub kube_namespace: Option<String>,
    /// Accept the node's podPidsLimit in place of an Environment's resources.pids.
    #[arg(long)]
    pub node_pids_limit: bool,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportFormat {
    Yaml,
    Json,
}

#[derive(Args, Debug)]
pub struct FileArgs {
    /// The manifest file (multi-document YAML).
    #[arg(short = 'f', long = "filename")]
    pub file: PathBuf,
    /// A directory of manifests whose Environments jobs may name.
    #[arg(long)]
    pub env_dir: Option<PathBuf>,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    Json,
    Yaml,
    Wide,
    /// `KIND/NAME` per line, as kubectl's `-o name`.
    Name,
}

/// Which `runner serve` a client verb talks to, and with what token.
#[derive(Args, Debug, Clone)]
pub struct ServerArgs {
    /// The server: http://HOST:PORT or unix:PATH (as `runner serve` prints it).
    #[arg(long, env = "RUNNER_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// File holding the bearer token [default: the token in $RUNNER_TOKEN].
    #[arg(long, env = "RUNNER_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
}

impl ServerArgs {
    /// The token: the file's first line, else $RUNNER_TOKEN.
    pub fn token(&self) -> Result<Option<String>, crate::service::ServiceError> {
        let text = match &self.token_file {
            Some(file) => std::fs::read_to_string(file)
                .map_err(|e| crate::service::ServiceError::field("--token-file", format!("{}: {e}", file.display())))?,
            None => std::env::var("RUNNER_TOKEN").unwrap_or_default(),
        };
        let token = text.trim();
        Ok((!token.is_empty()).then(|| token.to_string()))
    }
}
