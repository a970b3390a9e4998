//! Command-line surface (kubectl habits). Global flags work before or after the verb.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::manifest::Backend;

/// Default containerd socket (the system daemon's).
pub const DEFAULT_ADDRESS: &str = "/run/containerd/containerd.sock";
/// Default containerd namespace for everything runner creates.
pub const DEFAULT_NAMESPACE: &str = "runner";
/// Default state directory.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/runner";

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
    #[arg(long, global = true, env = "CONTAINERD_ADDRESS")]
    pub address: Option<PathBuf>,
    /// containerd namespace for everything runner creates.
    #[arg(long, global = true, env = "CONTAINERD_NAMESPACE", default_value = DEFAULT_NAMESPACE)]
    pub namespace: String,
    /// Where runner keeps its state (never mountable into a job).
    #[arg(long, global = true, env = "RUNNER_STATE_DIR", default_value = DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,
    /// Log filter (tracing syntax), e.g. `debug` or `runner=trace`.
    #[arg(long, global = true, env = "RUNNER_LOG", default_value = "warn")]
    pub log: String,
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
        #[arg(long, default_value_t = crate::runtime::output::DEFAULT_OUTPUT_LIMIT)]
        max_output_bytes: usize,
        /// Return at once; a supervisor process carries the jobs to their end.
        #[arg(short = 'd', long)]
        detach: bool,
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
    /// Print a job's output (stdout on stdout, stderr on stderr).
    Logs {
        name: String,
        /// Keep printing attempts as they finish, until the job ends.
        #[arg(short = 'f', long)]
        follow: bool,
        /// Only this attempt number (0-based, per index).
        #[arg(long)]
        attempt: Option<u32>,
        /// Only this completion index.
        #[arg(long)]
        index: Option<u32>,
    },
    /// Wait until a job ends; exit 0 when it succeeded, 1 when it failed, 2 on timeout.
    Wait {
        name: String,
        /// Give up after this long (e.g. 60s, 5m).
        #[arg(long, value_parser = humantime::parse_duration)]
        timeout: Option<std::time::Duration>,
    },
    /// Delete a job: stop what runs, remove its containers, its record and its logs.
    Delete {
        #[command(subcommand)]
        what: OneJob,
    },
    /// Carry a stored job to its end (what `apply --detach` starts; not for direct use).
    #[command(hide = true)]
    Supervise {
        name: String,
        #[arg(long, default_value_t = crate::runtime::output::DEFAULT_OUTPUT_LIMIT)]
        max_output_bytes: usize,
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
        /// Idle sessions are ended after this long.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "30m")]
        session_ttl: std::time::Duration,
    },
    /// Manage images in containerd.
    Image {
        #[command(subcommand)]
        verb: ImageVerb,
    },
    /// Manage runner's private containerd.
    Daemon {
        #[command(subcommand)]
        verb: DaemonVerb,
    },
    /// Remove containers, snapshots and leases runner created that no live job owns.
    Gc,
}

#[derive(Subcommand, Debug)]
pub enum GetWhat {
    /// List jobs.
    #[command(alias = "job")]
    Jobs {
        /// One job by name.
        name: Option<String>,
        /// Label selector: key=value[,key=value].
        #[arg(short = 'l', long = "selector")]
        selector: Option<String>,
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
pub enum DaemonVerb {
    /// Start runner's private containerd under the state dir (no-op when it runs).
    Start,
    /// Stop the private containerd runner started (only that process).
    Stop,
    /// Say whether it runs, its PID and socket.
    Status,
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
}
