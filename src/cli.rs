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
    /// containerd's gRPC socket.
    #[arg(long, global = true, env = "CONTAINERD_ADDRESS", default_value = DEFAULT_ADDRESS)]
    pub address: PathBuf,
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
    },
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
