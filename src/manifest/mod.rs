//! Manifests: multi-document YAML → validated `Environment` and `Job` values.
//!
//! This module is the only caller of the YAML crate (`serde-saphyr`; see the README's design
//! notes). Raw structs (`raw`) never leave it: once code holds a `Job`, the job is valid.

pub mod error;
pub mod paths;
pub mod policy;
pub mod quantity;
mod raw;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde_saphyr::Spanned;

pub use error::{Location, ManifestError, ManifestErrorKind, Origin};
pub use quantity::{MemoryBytes, MilliCpu, StorageBytes};

/// The only API version we read.
pub const API_VERSION: &str = "runner/v1alpha1";
/// Manifests larger than this are refused before parsing.
pub const MAX_MANIFEST_BYTES: u64 = 4 * 1024 * 1024;
/// YAML nesting deeper than this is refused (our manifests are at most ~6 levels deep).
const MAX_YAML_DEPTH: usize = 64;
/// Aliases are rare in manifests; a handful is plenty and bounds "billion laughs".
const MAX_YAML_ALIASES: usize = 64;
/// Upper bound of the scalar text of one document.
const MAX_YAML_SCALAR_BYTES: usize = 4 * 1024 * 1024;
/// Largest uid/gid accepted (CVE-2024-40635: containerd overflowed larger ids to 0).
pub const MAX_ID: u64 = (1 << 31) - 2;
/// Upper bound of a pids limit.
pub const MAX_PIDS: i64 = 4_194_304;
/// Longest timeout or deadline: one week.
pub const MAX_TIMEOUT_SECONDS: u64 = 7 * 24 * 3600;
/// Most completions one Job may ask for.
pub const MAX_COMPLETIONS: u32 = 100_000;

/// Defaults in one place: what an Environment gets when it says nothing.
pub mod defaults {
    use super::{MemoryBytes, MilliCpu, StorageBytes};
    pub const WORKDIR: &str = "/workspace";
    pub const MEMORY: MemoryBytes = MemoryBytes(2 << 30);
    pub const CPU: MilliCpu = MilliCpu(2000);
    pub const PIDS: u32 = 1024;
    pub const EPHEMERAL_STORAGE: StorageBytes = StorageBytes(10 << 30);
    /// Kubernetes waits 30 s; evaluation jobs are short, and a PID 1 that ignores SIGTERM
    /// (a plain `sleep`) would hold every stop for that long.
    pub const TERMINATION_GRACE_SECONDS: u64 = 2;
}

/// Label prefixes owned by containerd (its GC and CRI labels) and by us (ownership labels):
/// a manifest that set them could make containerd or `runner gc` act on its say-so.
const RESERVED_LABEL_PREFIXES: &[&str] = &["containerd.io/", "io.containerd.", "io.cri-containerd.", "runner.dev/"];

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Containerd,
    Host,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Containerd => "containerd",
            Backend::Host => "host",
        }
    }
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "containerd" => Ok(Backend::Containerd),
            "host" => Ok(Backend::Host),
            other => Err(format!("unknown backend {other:?} (expected containerd or host)")),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NetworkMode {
    /// A new network namespace with only `lo`.
    None,
    /// The host's network namespace.
    Host,
    /// A CNI bridge (not yet supported).
    Bridge,
}

impl NetworkMode {
    pub fn as_str(self) -> &'static str {
        match self {
            NetworkMode::None => "none",
            NetworkMode::Host => "host",
            NetworkMode::Bridge => "bridge",
        }
    }
}

/// Who the command runs as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UserSpec {
    Ids {
        uid: u32,
        gid: u32,
    },
    /// The caller's ids: `HUID`/`HGID` when set, else the runner process's own.
    Host,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Resources {
    pub memory: MemoryBytes,
    pub cpu: MilliCpu,
    pub pids: u32,
    /// What the sandbox may write to its writable layer, workspace and agent directory
    /// together (Kubernetes' `ephemeral-storage` limit); over it, it is evicted.
    pub ephemeral_storage: StorageBytes,
}

impl Default for Resources {
    fn default() -> Self {
        Resources {
            memory: defaults::MEMORY,
            cpu: defaults::CPU,
            pids: defaults::PIDS,
            ephemeral_storage: defaults::EPHEMERAL_STORAGE,
        }
    }
}

/// A bind mount as written: `source` may be relative (to the workspace).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountSpec {
    pub source: String,
    pub target: String,
    pub read_only: bool,
    pub source_origin: Origin,
    pub target_origin: Origin,
}

/// Read-only data mounted at `/static/<save_path>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StaticAsset {
    /// Absolute, or relative to the manifest's directory.
    pub source: PathBuf,
    pub save_path: String,
    pub origin: Origin,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Executed directly.
    Argv(Vec<String>),
    /// Executed by `sh -c`.
    Shell(String),
}

impl Command {
    /// The argv that runs this command.
    pub fn argv(&self) -> Vec<String> {
        match self {
            Command::Argv(argv) => argv.clone(),
            Command::Shell(script) => vec!["/bin/sh".into(), "-c".into(), script.clone()],
        }
    }
}

/// Kubernetes' `imagePullPolicy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
pub enum PullPolicy {
    IfNotPresent,
    Always,
    Never,
}

impl PullPolicy {
    /// Kubernetes' default: `Always` for `:latest` or no tag (and no digest), else `IfNotPresent`.
    pub fn default_for(image: &str) -> PullPolicy {
        let last = image.rsplit('/').next().unwrap_or(image);
        if image.contains('@') {
            return PullPolicy::IfNotPresent;
        }
        match last.split_once(':') {
            Some((_, "latest")) | None => PullPolicy::Always,
            Some(_) => PullPolicy::IfNotPresent,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            PullPolicy::IfNotPresent => "IfNotPresent",
            PullPolicy::Always => "Always",
            PullPolicy::Never => "Never",
        }
    }
}

impl std::str::FromStr for PullPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "IfNotPresent" => Ok(PullPolicy::IfNotPresent),
            "Always" => Ok(PullPolicy::Always),
            "Never" => Ok(PullPolicy::Never),
            other => Err(format!(
                "{other:?} is not an image pull policy (IfNotPresent, Always or Never)"
            )),
        }
    }
}

/// One `egress.allow` entry: an IPv4 address or CIDR, optionally with a port (TCP and UDP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EgressRule {
    pub addr: std::net::Ipv4Addr,
    pub prefix: u8,
    pub port: Option<u16>,
}

impl EgressRule {
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim();
        let (net, port) = match t.rsplit_once(':') {
            Some((net, port)) if !net.contains(':') => (
                net,
                Some(
                    port.parse::<u16>()
                        .ok()
                        .filter(|&p| p > 0)
                        .ok_or_else(|| format!("{t:?}: {port:?} is not a port (1 to 65535)"))?,
                ),
            ),
            Some(_) => return Err(format!("{t:?}: IPv6 is not supported (bridge networks are IPv4)")),
            None => (t, None),
        };
        let (addr, prefix) = match net.split_once('/') {
            Some((a, p)) => (
                a,
                p.parse::<u8>()
                    .ok()
                    .filter(|&p| p <= 32)
                    .ok_or_else(|| format!("{t:?}: /{p} is not a prefix length (0 to 32)"))?,
            ),
            None => (net, 32),
        };
        let addr: std::net::Ipv4Addr = addr
            .parse()
            .map_err(|_| format!("{t:?} is not an IPv4 address or CIDR (a.b.c.d, a.b.c.d/n, optionally :port)"))?;
        let mask = if prefix == 0 { 0 } else { u32::MAX << (32 - prefix) };
        if u32::from(addr) & !mask != 0 {
            return Err(format!("{t:?}: the address has bits set beyond /{prefix}"));
        }
        Ok(EgressRule { addr, prefix, port })
    }
}

/// One `egress.allow` entry: an address rule, or a domain name enforced by runner's resolver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EgressEntry {
    Cidr(EgressRule),
    Domain(EgressDomain),
}

/// A domain an `egress.allow` entry names (`pypi.org`, `*.example.com`, optionally `:port`):
/// the addresses runner's resolver answers for it become reachable, for the answers' TTL.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EgressDomain {
    /// Lowercase, without a trailing dot or the `*.`.
    pub name: String,
    /// `*.name`: every name under it (not `name` itself).
    pub wildcard: bool,
    pub port: Option<u16>,
}

impl EgressDomain {
    /// Whether a queried name (any case, trailing dot or not) is one this entry allows.
    pub fn matches(&self, query: &str) -> bool {
        let q = query.trim_end_matches('.').to_ascii_lowercase();
        if self.wildcard {
            q.len() > self.name.len() + 1
                && q.ends_with(&self.name)
                && q.as_bytes()[q.len() - self.name.len() - 1] == b'.'
        } else {
            q == self.name
        }
    }
}

impl EgressEntry {
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim();
        let host = t.rsplit_once(':').map_or(t, |(h, _)| h);
        if !host.chars().any(|c| c.is_ascii_alphabetic() || c == '*') || host.contains(':') {
            return EgressRule::parse(t).map(EgressEntry::Cidr);
        }
        let port = match t.rsplit_once(':') {
            Some((_, p)) => Some(
                p.parse::<u16>()
                    .ok()
                    .filter(|&p| p > 0)
                    .ok_or_else(|| format!("{t:?}: {p:?} is not a port (1 to 65535)"))?,
            ),
            None => None,
        };
        let lower = host.trim_end_matches('.').to_ascii_lowercase();
        let (wildcard, name) = match lower.strip_prefix("*.") {
            Some(rest) => (true, rest.to_string()),
            None => (false, lower.clone()),
        };
        let label_ok = |l: &str| {
            (1..=63).contains(&l.len())
                && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        };
        if name.len() > 253 || !name.split('.').all(label_ok) {
            let hint = if name.contains('*') {
                " ('*' only as a whole first label: *.example.com)"
            } else {
                ""
            };
            return Err(format!("{t:?} is not a domain name{hint}"));
        }
        if name
            .rsplit('.')
            .next()
            .is_some_and(|tld| tld.chars().all(|c| c.is_ascii_digit()))
        {
            return Err(format!("{t:?} is neither an IPv4 address nor a domain name"));
        }
        Ok(EgressEntry::Domain(EgressDomain { name, wildcard, port }))
    }
}

impl std::fmt::Display for EgressDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.wildcard {
            f.write_str("*.")?;
        }
        f.write_str(&self.name)?;
        if let Some(p) = self.port {
            write!(f, ":{p}")?;
        }
        Ok(())
    }
}

impl std::fmt::Display for EgressRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)?;
        if let Some(p) = self.port {
            write!(f, ":{p}")?;
        }
        Ok(())
    }
}

/// A published port's transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
pub enum Protocol {
    #[serde(rename = "TCP")]
    Tcp,
    #[serde(rename = "UDP")]
    Udp,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        }
    }

    /// The name the CNI plugins and nftables use.
    pub fn lower(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }
}

/// The address a port is published on when `hostIP` is not given: the host's loopback, so a
/// sandbox's server is not offered to the node's whole network by accident.
pub const DEFAULT_HOST_IP: std::net::Ipv4Addr = std::net::Ipv4Addr::LOCALHOST;

/// One `ports` entry: a container port published on the host (`network: bridge`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortSpec {
    pub name: Option<String>,
    pub container_port: u16,
    /// `None`: a free port, picked when the container starts.
    pub host_port: Option<u16>,
    pub host_ip: std::net::Ipv4Addr,
    pub protocol: Protocol,
}

/// A `kind: Network` document: a bridge network of its own, isolated from runner's default
/// one and from every other.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetworkDef {
    pub name: String,
    pub subnet: std::net::Ipv4Addr,
    pub prefix: u8,
    pub gateway: std::net::Ipv4Addr,
    /// The Linux bridge (`rn-<name>` unless given).
    pub bridge: String,
}

impl NetworkDef {
    pub fn cidr(&self) -> String {
        format!("{}/{}", self.subnet, self.prefix)
    }

    fn range(&self) -> (u32, u32) {
        let start = u32::from(self.subnet);
        (start, start | (u32::MAX >> self.prefix))
    }

    /// Whether two networks' subnets share an address.
    pub fn overlaps(&self, other: &NetworkDef) -> bool {
        let (a, b) = (self.range(), other.range());
        a.0 <= b.1 && b.0 <= a.1
    }
}

/// runner's default bridge network (`network: bridge`), which a Network may not overlap.
pub const DEFAULT_BRIDGE_SUBNET: (std::net::Ipv4Addr, u8) = (std::net::Ipv4Addr::new(10, 89, 0, 0), 16);

/// A Network's name: a DNS label of at most 12 characters (its bridge, `rn-<name>`, must fit
/// in Linux's 15), none of the words `network:` means itself.
fn valid_network_name(name: &str) -> bool {
    (1..=12).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && !name.ends_with('-')
        && !["none", "host", "bridge", "runner", "default"].contains(&name)
}

fn validate_network(raw: raw::NetworkDoc, first_line: u64) -> Result<NetworkDef, ManifestError> {
    let at = |s: &serde_saphyr::Location| location(s, first_line);
    let bad = |path: &str, loc: &serde_saphyr::Location, m: String| {
        ManifestError::new(Origin::new(path, at(loc)), ManifestErrorKind::Yaml(m))
    };
    let name = &raw.metadata.name;
    if !valid_network_name(&name.value) {
        return Err(bad(
            "metadata.name",
            &name.referenced,
            format!(
                "{:?} is not a Network name (a DNS label of at most 12 characters, not none, host, bridge, runner or default)",
                name.value
            ),
        ));
    }
    validate_labels(&raw.metadata.labels, "labels")?;
    validate_labels(&raw.metadata.annotations, "annotations")?;
    let spec = raw.spec;
    let rule = EgressRule::parse(&spec.subnet.value)
        .ok()
        .filter(|r| r.port.is_none() && (8..=28).contains(&r.prefix))
        .ok_or_else(|| {
            bad(
                "spec.subnet",
                &spec.subnet.referenced,
                format!(
                    "{:?} is not a subnet (an IPv4 CIDR from /8 to /28, host bits zero)",
                    spec.subnet.value
                ),
            )
        })?;
    let (start, end) = (u32::from(rule.addr), u32::from(rule.addr) | (u32::MAX >> rule.prefix));
    let gateway = match &spec.gateway {
        None => std::net::Ipv4Addr::from(start + 1),
        Some(g) => {
            let addr: std::net::Ipv4Addr = g.value.parse().map_err(|_| {
                bad(
                    "spec.gateway",
                    &g.referenced,
                    format!("{:?} is not an IPv4 address", g.value),
                )
            })?;
            if !(start < u32::from(addr) && u32::from(addr) < end) {
                return Err(bad(
                    "spec.gateway",
                    &g.referenced,
                    format!("{addr} is not a host address of {}/{}", rule.addr, rule.prefix),
                ));
            }
            addr
        }
    };
    let bridge = match &spec.bridge {
        None => format!("rn-{}", name.value),
        Some(b) => {
            let ok = (1..=15).contains(&b.value.len())
                && b.value.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
                && !["lo", "runner0", ".", ".."].contains(&b.value.as_str());
            if !ok {
                return Err(bad(
                    "spec.bridge",
                    &b.referenced,
                    format!(
                        "{:?} is not a bridge name (1 to 15 of letters, digits, '_', '.', '-'; not runner0)",
                        b.value
                    ),
                ));
            }
            b.value.clone()
        }
    };
    let def = NetworkDef {
        name: name.value.clone(),
        subnet: rule.addr,
        prefix: rule.prefix,
        gateway,
        bridge,
    };
    let default = NetworkDef {
        name: "runner".into(),
        subnet: DEFAULT_BRIDGE_SUBNET.0,
        prefix: DEFAULT_BRIDGE_SUBNET.1,
        gateway: std::net::Ipv4Addr::new(10, 89, 0, 1),
        bridge: "runner0".into(),
    };
    if def.overlaps(&default) {
        return Err(bad(
            "spec.subnet",
            &spec.subnet.referenced,
            format!(
                "{} overlaps runner's default bridge network ({})",
                def.cidr(),
                default.cidr()
            ),
        ));
    }
    Ok(def)
}

/// How many ids a container's user namespace maps (Kubernetes' per-pod range): the ids a job
/// may run as unless its Environment sets `hostUsers: true`.
pub const USERNS_IDS: u64 = 65_536;

#[derive(Clone, Debug, PartialEq)]
pub struct Environment {
    pub name: String,
    pub backend: Backend,
    pub image: Option<String>,
    pub workdir: String,
    pub mount_workspace: bool,
    pub user: Option<UserSpec>,
    pub env: BTreeMap<String, String>,
    pub include_host_env: bool,
    /// `hostUsers: true`: no user namespace (container root is the host's root, with the
    /// hardened capabilities). Default false: each container gets a range of its own.
    pub host_users: bool,
    /// `allow32BitSyscalls: true`: the seccomp filter also admits the host's 32-bit syscall
    /// ABI (x86 on x86_64, arm on aarch64), as Docker's default profile does. Default false:
    /// a 32-bit program is killed at its first syscall (SIGSYS).
    pub allow_32bit_syscalls: bool,
    /// `imagePullPolicy`; `None`: Kubernetes' default for the image's tag.
    pub image_pull_policy: Option<PullPolicy>,
    pub setup: Vec<String>,
    pub mounts: Vec<MountSpec>,
    /// `None` when the manifest does not say: the backend picks (containerd: none, host: host).
    pub network: Option<NetworkMode>,
    /// `network: NAME`: the Network document whose bridge the container joins (with
    /// `network` Bridge).
    pub network_name: Option<String>,
    /// `egress.allow`: what a `network: bridge` container may reach off its network.
    pub egress_allow: Vec<EgressRule>,
    /// `egress.allow`'s domain entries, enforced by runner's resolver.
    pub egress_domains: Vec<EgressDomain>,
    /// `ports`: container ports published on the host (`network: bridge`).
    pub ports: Vec<PortSpec>,
    pub resources: Resources,
    pub(crate) origins: EnvOrigins,
}

impl Environment {
    /// The pull policy in force: the Environment's, else Kubernetes' default for its image.
    pub fn pull_policy(&self) -> PullPolicy {
        self.image_pull_policy.unwrap_or_else(|| {
            self.image
                .as_deref()
                .map_or(PullPolicy::IfNotPresent, PullPolicy::default_for)
        })
    }

    /// The file this Environment was read from.
    pub fn origins_file(&self) -> Option<PathBuf> {
        self.origins.file.clone()
    }

    /// Where the manifest sets `resources.pids`; `None` when it leaves the default.
    pub fn pids_origin(&self) -> Option<Origin> {
        self.origins.pids.clone()
    }

    /// Where a field of the Environment is set, for errors about it.
    pub fn origin(&self, path: &str) -> Origin {
        let location = match path {
            "spec.image" => self.origins.image,
            "spec.network" => self.origins.network,
            "spec.user" => self.origins.user,
            _ => None,
        };
        Origin::new(path, location)
    }
}

/// Positions kept for checks that can only run once the backend is known.
#[derive(Clone, Debug, PartialEq, Default)]
pub(crate) struct EnvOrigins {
    image: Option<Location>,
    include_host_env: Option<Location>,
    host_users: Option<Location>,
    network: Option<Location>,
    /// `Some` when the manifest sets `resources.pids` (the default applies otherwise).
    pids: Option<Origin>,
    user: Option<Location>,
    file: Option<PathBuf>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub environment: String,
    pub environment_origin: Origin,
    /// Absolute, or relative to the manifest's directory.
    pub workspace: Option<PathBuf>,
    pub static_assets: Vec<StaticAsset>,
    pub mounts: Vec<MountSpec>,
    pub command: Command,
    pub stdin: Option<String>,
    pub timeout: Option<Duration>,
    pub disable_setup: bool,
    pub backoff_limit: u32,
    pub backoff_limit_origin: Option<Origin>,
    pub active_deadline: Option<Duration>,
    pub completions: u32,
    pub parallelism: u32,
    /// `completionMode: Indexed`: each index must succeed; `JOB_COMPLETION_INDEX` is set.
    pub indexed: bool,
    pub ttl_after_finished: Option<Duration>,
    /// SIGTERM → this long → SIGKILL when the job is stopped (deadline, delete).
    pub termination_grace: Duration,
    pub failure_rules: Vec<policy::FailureRule>,
    /// The directory relative paths of this job resolve against.
    pub base_dir: PathBuf,
    pub file: Option<PathBuf>,
}

/// `kind: WarmPool`: an Environment's containers kept started (`runner apply` makes the
/// pool; see `runtime::containerd::pool`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WarmPool {
    pub name: String,
    pub environment: String,
    pub environment_origin: Origin,
    pub size: u32,
    pub workspace: bool,
    pub static_assets: bool,
    pub file: Option<PathBuf>,
}

/// The largest warm pool: each member is a running container.
pub const MAX_POOL_SIZE: u32 = 256;

/// Everything one manifest file (plus `--env-dir`) defines.
#[derive(Clone, Debug, Default)]
pub struct ManifestSet {
    pub environments: Vec<Environment>,
    pub jobs: Vec<Job>,
    pub pools: Vec<WarmPool>,
    /// `kind: Network` documents.
    pub networks: Vec<NetworkDef>,
    /// Environments found in `--env-dir`, consulted after the file's own.
    pub env_dir: Vec<Environment>,
    /// Networks found in `--env-dir`, consulted after the file's own.
    pub env_dir_networks: Vec<NetworkDef>,
    pub env_dir_path: Option<PathBuf>,
}

/// A Job together with the Environment it runs in, checked against each other for the
/// backend that will run it.
#[derive(Clone, Debug)]
pub struct Bound {
    pub job: Job,
    pub env: Environment,
    pub backend: Backend,
    pub network: NetworkMode,
    /// The named network a bridge container joins (`None`: runner's default one).
    pub bridge: Option<NetworkDef>,
}

impl ManifestSet {
    /// The Environment a job names: first this file's, then `--env-dir`'s.
    pub fn environment_for(&self, job: &Job) -> Result<&Environment, ManifestError> {
        self.environments
            .iter()
            .chain(self.env_dir.iter())
            .find(|e| e.name == job.environment)
            .ok_or_else(|| {
                let searched = match &self.env_dir_path {
                    Some(dir) => format!(" nor in {}", dir.display()),
                    None => " (pass --env-dir DIR to look elsewhere)".to_string(),
                };
                ManifestError::new(
                    job.environment_origin.clone(),
                    ManifestErrorKind::EnvironmentNotFound {
                        name: job.environment.clone(),
                        searched,
                    },
                )
                .in_document(format!("Job {:?}", job.name))
                .with_file(&job.file)
            })
    }

    /// The Environment a warm pool names (first this file's, then `--env-dir`'s): it must
    /// run on containerd.
    pub fn pool_environment(&self, pool: &WarmPool) -> Result<&Environment, ManifestError> {
        let err = |kind| {
            ManifestError::new(pool.environment_origin.clone(), kind)
                .in_document(format!("WarmPool {:?}", pool.name))
                .with_file(&pool.file)
        };
        let env = self
            .environments
            .iter()
            .chain(self.env_dir.iter())
            .find(|e| e.name == pool.environment)
            .ok_or_else(|| {
                err(ManifestErrorKind::EnvironmentNotFound {
                    name: pool.environment.clone(),
                    searched: match &self.env_dir_path {
                        Some(dir) => format!(" nor in {}", dir.display()),
                        None => " (pass --env-dir DIR to look elsewhere)".to_string(),
                    },
                })
            })?;
        if env.backend != Backend::Containerd {
            return Err(err(ManifestErrorKind::PoolBackend {
                environment: env.name.clone(),
            }));
        }
        Ok(env)
    }

    /// Pair a job with its environment and run the checks that need both; a named network
    /// is looked up here (this file's Networks, then `--env-dir`'s).
    pub fn bind(&self, job: &Job, backend: Option<Backend>) -> Result<Bound, ManifestError> {
        let env = self.environment_for(job)?;
        let mut bound = bind_inner(job, env, backend)?;
        if let Some(name) = &env.network_name {
            let found = self
                .networks
                .iter()
                .chain(self.env_dir_networks.iter())
                .find(|n| &n.name == name);
            let Some(def) = found else {
                let searched = match &self.env_dir_path {
                    Some(dir) => format!(" nor in {}", dir.display()),
                    None => " (pass --env-dir DIR to look elsewhere)".to_string(),
                };
                return Err(ManifestError::new(
                    env.origin("spec.network"),
                    ManifestErrorKind::Yaml(format!(
                        "no Network {name:?} among this manifest's documents{searched} (a network is none, host, bridge or the name of a Network document)"
                    )),
                )
                .in_document(format!("Environment {:?}", env.name))
                .with_file(&env.origins.file));
            };
            bound.bridge = Some(def.clone());
        }
        Ok(bound)
    }

    /// Use the Environments and Networks of `--env-dir`.
    pub fn use_env_dir(&mut self, dir: &Path) -> Result<(), ManifestError> {
        let (environments, networks) = load_env_dir_all(dir)?;
        self.env_dir = environments;
        self.env_dir_networks = networks;
        self.env_dir_path = Some(dir.to_path_buf());
        Ok(())
    }
}

impl ManifestError {
    fn with_file(self, file: &Option<PathBuf>) -> Self {
        match file {
            Some(f) => self.in_file(f),
            None => self,
        }
    }
}

/// Checks that need both documents and the backend that will run them. An Environment on a
/// named network binds only with its manifest (`ManifestSet::bind`), which has the network.
pub fn bind(job: &Job, env: &Environment, backend: Option<Backend>) -> Result<Bound, ManifestError> {
    if let Some(name) = &env.network_name {
        return Err(ManifestError::new(
            env.origin("spec.network"),
            ManifestErrorKind::Yaml(format!(
                "network {name:?} is a Network document's: bind with its manifest"
            )),
        ));
    }
    bind_inner(job, env, backend)
}

fn bind_inner(job: &Job, env: &Environment, backend: Option<Backend>) -> Result<Bound, ManifestError> {
    let backend = backend.unwrap_or(env.backend);
    let env_err = |path: &str, loc: Option<Location>, kind| {
        ManifestError::new(Origin::new(path, loc), kind)
            .in_document(format!("Environment {:?}", env.name))
            .with_file(&env.origins.file)
    };
    let job_err = |origin: &Origin, kind| {
        ManifestError::new(origin.clone(), kind)
            .in_document(format!("Job {:?}", job.name))
            .with_file(&job.file)
    };
    let network = match (backend, env.network) {
        (Backend::Host, Some(NetworkMode::Bridge)) => {
            return Err(env_err(
                "spec.network",
                env.origins.network,
                ManifestErrorKind::HostNetwork("bridge"),
            ));
        }
        (Backend::Host, Some(NetworkMode::None)) => {
            return Err(env_err(
                "spec.network",
                env.origins.network,
                ManifestErrorKind::HostNetwork("none"),
            ));
        }
        (Backend::Host, _) => NetworkMode::Host,
        (Backend::Containerd, n) => n.unwrap_or(NetworkMode::None),
    };
    if backend == Backend::Host {
        if let Some(m) = env.mounts.first() {
            return Err(env_err(
                &m.target_origin.path,
                m.target_origin.location,
                ManifestErrorKind::HostMounts,
            ));
        }
        if let Some(m) = job.mounts.first() {
            return Err(job_err(&m.target_origin, ManifestErrorKind::HostMounts));
        }
    }
    if backend == Backend::Containerd {
        if env.image.is_none() {
            return Err(env_err("spec.image", None, ManifestErrorKind::ImageRequired));
        }
        if env.include_host_env {
            return Err(env_err(
                "spec.includeHostEnv",
                env.origins.include_host_env,
                ManifestErrorKind::HostEnvInContainer,
            ));
        }
        // The host's network namespace belongs to the host's user namespace: a container in
        // its own cannot mount /sys for it (Kubernetes refuses hostNetwork without hostUsers
        // too).
        if network == NetworkMode::Host && !env.host_users {
            return Err(env_err(
                "spec.network",
                env.origins.network,
                ManifestErrorKind::HostNetworkNeedsHostUsers,
            ));
        }
        if !env.host_users
            && let Some(UserSpec::Ids { uid, gid }) = env.user
            && let Some(id) = [uid, gid].into_iter().find(|&id| u64::from(id) >= USERNS_IDS)
        {
            return Err(env_err(
                "spec.user",
                env.origins.user,
                ManifestErrorKind::IdOutsideUserns { id, size: USERNS_IDS },
            ));
        }
    }
    if env.mount_workspace {
        let workdir = paths::normalize(&env.workdir);
        let under = |m: &MountSpec| paths::is_within(&paths::normalize(&m.target), &workdir);
        if let Some(m) = job.mounts.iter().find(|m| under(m)) {
            return Err(job_err(
                &m.target_origin,
                ManifestErrorKind::TargetUnderWorkdir {
                    target: m.target.clone(),
                    workdir: env.workdir.clone(),
                },
            ));
        }
    }
    Ok(Bound {
        job: job.clone(),
        env: env.clone(),
        backend,
        network,
        bridge: None,
    })
}

/// Read and validate one manifest file, and the Environments of `env_dir` if given.
pub fn load_file(path: &Path, env_dir: Option<&Path>) -> Result<ManifestSet, ManifestError> {
    Ok(load_file_text(path, env_dir)?.0)
}

/// The directory a manifest file's relative paths are anchored in.
pub fn base_dir_of(path: &Path) -> PathBuf {
    path.parent()
        .map(|p| if p.as_os_str().is_empty() { Path::new(".") } else { p })
        .unwrap_or(Path::new("."))
        .to_path_buf()
}

/// As `load_file`, also returning the text that was read (read once: what is stored is what
/// was validated).
pub fn load_file_text(path: &Path, env_dir: Option<&Path>) -> Result<(ManifestSet, String), ManifestError> {
    let text = read_limited(path)?;
    let base_dir = base_dir_of(path);
    let mut set = parse_str(&text, &base_dir, Some(path))?;
    if set.environments.is_empty() && set.jobs.is_empty() && set.pools.is_empty() && set.networks.is_empty() {
        return Err(ManifestError::new(Origin::new("", None), ManifestErrorKind::Empty).in_file(path));
    }
    if let Some(dir) = env_dir {
        set.use_env_dir(dir)?;
    }
    Ok((set, text))
}

/// Every Environment in the `*.yaml`/`*.yml` files of a directory (their Jobs are ignored).
pub fn load_env_dir(dir: &Path) -> Result<Vec<Environment>, ManifestError> {
    Ok(load_env_dir_all(dir)?.0)
}

/// Every Environment and Network in the `*.yaml`/`*.yml` files of a directory.
pub fn load_env_dir_all(dir: &Path) -> Result<(Vec<Environment>, Vec<NetworkDef>), ManifestError> {
    let read_err = |e| ManifestError::new(Origin::new("", None), ManifestErrorKind::Read(e)).in_file(dir);
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(read_err)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")))
        .collect();
    files.sort();
    let mut envs: Vec<Environment> = Vec::new();
    let mut networks: Vec<NetworkDef> = Vec::new();
    for file in files {
        let text = read_limited(&file)?;
        let set = parse_str(&text, dir, Some(&file))?;
        for net in set.networks {
            if let Some(other) = networks.iter().find(|n| n.name == net.name || n.overlaps(&net)) {
                return Err(ManifestError::new(
                    Origin::new("spec.subnet", None),
                    ManifestErrorKind::Yaml(format!(
                        "Network {:?} ({}) clashes with Network {:?} ({}) of the same directory",
                        net.name,
                        net.cidr(),
                        other.name,
                        other.cidr()
                    )),
                )
                .in_file(&file));
            }
            networks.push(net);
        }
        for env in set.environments {
            if envs.iter().any(|e| e.name == env.name) {
                return Err(ManifestError::new(
                    Origin::new("metadata.name", None),
                    ManifestErrorKind::Duplicate {
                        kind: "Environment",
                        name: env.name.clone(),
                    },
                )
                .in_file(&file));
            }
            envs.push(env);
        }
    }
    Ok((envs, networks))
}

fn read_limited(path: &Path) -> Result<String, ManifestError> {
    let err = |kind| ManifestError::new(Origin::new("", None), kind).in_file(path);
    let meta = std::fs::metadata(path).map_err(|e| err(ManifestErrorKind::Read(e)))?;
    if meta.len() > MAX_MANIFEST_BYTES {
        return Err(err(ManifestErrorKind::TooLarge {
            size: meta.len(),
            limit: MAX_MANIFEST_BYTES,
        }));
    }
    let bytes = std::fs::read(path).map_err(|e| err(ManifestErrorKind::Read(e)))?;
    String::from_utf8(bytes).map_err(|e| {
        err(ManifestErrorKind::Yaml(format!(
            "manifest is not UTF-8 (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        )))
    })
}

/// Parse and validate manifest text. `base_dir` anchors relative workspace and asset paths.
pub fn parse_str(text: &str, base_dir: &Path, file: Option<&Path>) -> Result<ManifestSet, ManifestError> {
    let mut set = ManifestSet::default();
    let attach = |e: ManifestError| match file {
        Some(f) => e.in_file(f),
        None => e,
    };
    for (index, doc) in split_documents(text).into_iter().enumerate() {
        let label = format!("document {}", index + 1);
        let header: raw::Header = decode(&doc).map_err(|e| attach(e.in_document(label.clone())))?;
        let loc = |s: &Spanned<String>| location(&s.referenced, doc.first_line);
        let Some(api) = &header.api_version else {
            return Err(attach(
                ManifestError::new(
                    Origin::new("apiVersion", None),
                    ManifestErrorKind::MissingApiVersion { expected: API_VERSION },
                )
                .in_document(label),
            ));
        };
        if api.value != API_VERSION {
            return Err(attach(
                ManifestError::new(
                    Origin::new("apiVersion", loc(api)),
                    ManifestErrorKind::ApiVersion {
                        found: api.value.clone(),
                        expected: API_VERSION,
                    },
                )
                .in_document(label),
            ));
        }
        let Some(kind) = &header.kind else {
            return Err(attach(
                ManifestError::new(Origin::new("kind", None), ManifestErrorKind::MissingKind).in_document(label),
            ));
        };
        match kind.value.as_str() {
            "Environment" => {
                let raw: raw::EnvironmentDoc = decode(&doc).map_err(|e| attach(e.in_document(label.clone())))?;
                let doc_name = format!("Environment {:?}", raw.metadata.name.value);
                let env = validate_environment(raw, doc.first_line, file)
                    .map_err(|e| attach(e.in_document(doc_name.clone())))?;
                if set.environments.iter().any(|e| e.name == env.name) {
                    return Err(attach(
                        ManifestError::new(
                            Origin::new("metadata.name", None),
                            ManifestErrorKind::Duplicate {
                                kind: "Environment",
                                name: env.name,
                            },
                        )
                        .in_document(doc_name),
                    ));
                }
                set.environments.push(env);
            }
            "Job" => {
                let raw: raw::JobDoc = decode(&doc).map_err(|e| attach(e.in_document(label.clone())))?;
                let doc_name = format!("Job {:?}", raw.metadata.name.value);
                let job = validate_job(raw, doc.first_line, base_dir, file)
                    .map_err(|e| attach(e.in_document(doc_name.clone())))?;
                if set.jobs.iter().any(|j| j.name == job.name) {
                    return Err(attach(
                        ManifestError::new(
                            Origin::new("metadata.name", None),
                            ManifestErrorKind::Duplicate {
                                kind: "Job",
                                name: job.name,
                            },
                        )
                        .in_document(doc_name),
                    ));
                }
                set.jobs.push(job);
            }
            "WarmPool" => {
                let raw: raw::WarmPoolDoc = decode(&doc).map_err(|e| attach(e.in_document(label.clone())))?;
                let doc_name = format!("WarmPool {:?}", raw.metadata.name.value);
                let pool =
                    validate_pool(raw, doc.first_line, file).map_err(|e| attach(e.in_document(doc_name.clone())))?;
                if set.pools.iter().any(|p| p.name == pool.name) {
                    return Err(attach(
                        ManifestError::new(
                            Origin::new("metadata.name", None),
                            ManifestErrorKind::Duplicate {
                                kind: "WarmPool",
                                name: pool.name,
                            },
                        )
                        .in_document(doc_name),
                    ));
                }
                set.pools.push(pool);
            }
            "Network" => {
                let raw: raw::NetworkDoc = decode(&doc).map_err(|e| attach(e.in_document(label.clone())))?;
                let doc_name = format!("Network {:?}", raw.metadata.name.value);
                let net = validate_network(raw, doc.first_line).map_err(|e| attach(e.in_document(doc_name.clone())))?;
                if let Some(other) = set.networks.iter().find(|n| n.name == net.name || n.overlaps(&net)) {
                    let why = if other.name == net.name {
                        ManifestErrorKind::Duplicate {
                            kind: "Network",
                            name: net.name,
                        }
                    } else {
                        ManifestErrorKind::Yaml(format!(
                            "subnet {} overlaps Network {:?}'s {}",
                            net.cidr(),
                            other.name,
                            other.cidr()
                        ))
                    };
                    return Err(attach(
                        ManifestError::new(Origin::new("spec.subnet", None), why).in_document(doc_name),
                    ));
                }
                set.networks.push(net);
            }
            other => {
                return Err(attach(
                    ManifestError::new(
                        Origin::new("kind", loc(kind)),
                        ManifestErrorKind::Kind(other.to_string()),
                    )
                    .in_document(label),
                ));
            }
        }
    }
    Ok(set)
}

/// One YAML document of a stream, with the line it starts on in the whole file.
struct Document {
    text: String,
    /// 0-based line of the file where `text` begins.
    first_line: u64,
}

/// Split a stream at `---` / `...` marker lines. YAML forbids these markers at column 0 inside
/// content, so a line scan is exact; splitting ourselves lets each document be parsed on its
/// own with the strict type its `kind` asks for, while positions stay those of the file.
fn split_documents(text: &str) -> Vec<Document> {
    let mut docs = Vec::new();
    let mut current = String::new();
    let mut first_line = 0u64;
    let is_marker = |line: &str, marker: &str| {
        line.strip_prefix(marker)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t', '\r']))
    };
    for (n, line) in text.split_inclusive('\n').enumerate() {
        let n = n as u64;
        let bare = line.trim_end_matches('\n');
        if is_marker(bare, "---") || is_marker(bare, "...") {
            if has_content(&current) {
                docs.push(Document {
                    text: std::mem::take(&mut current),
                    first_line,
                });
            }
            current.clear();
            first_line = n;
            if is_marker(bare, "---") {
                // Keep what follows `---` on the same line (`--- {a: 1}`), at its column.
                current.push_str("   ");
                current.push_str(&line[3..]);
            } else {
                current.push('\n');
            }
        } else {
            current.push_str(line);
        }
    }
    if has_content(&current) {
        docs.push(Document {
            text: current,
            first_line,
        });
    }
    docs
}

fn has_content(text: &str) -> bool {
    text.lines().any(|l| {
        let t = l.trim();
        !t.is_empty() && !t.starts_with('#') && !t.starts_with('%')
    })
}

fn yaml_options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_depth: MAX_YAML_DEPTH,
            max_aliases: MAX_YAML_ALIASES,
            max_total_scalar_bytes: MAX_YAML_SCALAR_BYTES,
            max_documents: 1,
        },
    }
}

fn location(loc: &serde_saphyr::Location, first_line: u64) -> Option<Location> {
    (loc.line() > 0).then(|| Location {
        line: loc.line() + first_line,
        column: loc.column(),
    })
}

/// Deserialize one document into a raw type, keeping the serde path of a failure.
fn decode<T: DeserializeOwned>(doc: &Document) -> Result<T, ManifestError> {
    let mut track = serde_path_to_error::Track::new();
    let result = serde_saphyr::with_deserializer_from_str_with_options(&doc.text, yaml_options(), |de| {
        T::deserialize(serde_path_to_error::Deserializer::new(de, &mut track))
    });
    result.map_err(|err| {
        let path = track.path().to_string();
        let path = if path == "." { String::new() } else { path };
        // `Spanned<T>` is a struct to serde: drop its inner `.value` segment from the path.
        let path = path.replace(".value.", ".").replace(".value[", "[");
        let path = path.strip_suffix(".value").map(str::to_string).unwrap_or(path);
        let loc = err.location().and_then(|l| location(&l, doc.first_line));
        ManifestError::new(Origin::new(path, loc), ManifestErrorKind::Yaml(yaml_message(&err)))
    })
}

/// The parser's message without its own position suffix (we print positions ourselves).
fn yaml_message(err: &serde_saphyr::Error) -> String {
    let text = err.without_snippet().to_string();
    let text = match text.find(" at line ") {
        Some(i) => text[..i].to_string(),
        None => text,
    };
    text.lines().next().unwrap_or_default().trim().to_string()
}

fn validate_pool(raw: raw::WarmPoolDoc, first_line: u64, file: Option<&Path>) -> Result<WarmPool, ManifestError> {
    let name = validate_name(&raw.metadata.name, first_line)?;
    validate_labels(&raw.metadata.labels, "labels")?;
    validate_labels(&raw.metadata.annotations, "annotations")?;
    let spec = raw.spec;
    let environment_origin = Origin::new("spec.environment", location(&spec.environment.referenced, first_line));
    if spec.environment.value.is_empty() {
        return Err(ManifestError::new(
            environment_origin,
            ManifestErrorKind::Name {
                name: String::new(),
                reason: "must name an Environment",
            },
        ));
    }
    if spec.size.value > MAX_POOL_SIZE {
        return Err(ManifestError::new(
            Origin::new("spec.size", location(&spec.size.referenced, first_line)),
            ManifestErrorKind::PoolSize {
                size: spec.size.value,
                max: MAX_POOL_SIZE,
            },
        ));
    }
    Ok(WarmPool {
        name,
        environment: spec.environment.value,
        environment_origin,
        size: spec.size.value,
        workspace: spec.workspace.unwrap_or(true),
        static_assets: spec.static_assets.unwrap_or(false),
        file: file.map(Path::to_path_buf),
    })
}

fn validate_name(name: &Spanned<String>, first_line: u64) -> Result<String, ManifestError> {
    let err = |reason| {
        ManifestError::new(
            Origin::new("metadata.name", location(&name.referenced, first_line)),
            ManifestErrorKind::Name {
                name: name.value.clone(),
                reason,
            },
        )
    };
    let n = &name.value;
    if n.is_empty() || n.len() > 63 {
        return Err(err("must be 1 to 63 characters"));
    }
    if !n
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err(err(
            "only lowercase letters, digits and '-' are allowed (a DNS-1123 label)",
        ));
    }
    if n.starts_with('-') || n.ends_with('-') {
        return Err(err("must start and end with a letter or digit"));
    }
    Ok(n.clone())
}

fn label_part_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && s.as_bytes()[0].is_ascii_alphanumeric()
        && s.as_bytes()[s.len() - 1].is_ascii_alphanumeric()
}

fn validate_labels(labels: &BTreeMap<String, String>, field: &str) -> Result<(), ManifestError> {
    for (key, value) in labels {
        let origin = || Origin::new(format!("metadata.{field}.{key}"), None);
        if let Some(prefix) = RESERVED_LABEL_PREFIXES.iter().find(|p| key.starts_with(*p)) {
            return Err(ManifestError::new(
                origin(),
                ManifestErrorKind::ReservedLabel {
                    key: key.clone(),
                    prefix,
                },
            ));
        }
        if field == "annotations" {
            continue;
        }
        let name = key.rsplit_once('/').map_or(key.as_str(), |(prefix, name)| {
            if prefix.is_empty() || prefix.len() > 253 {
                ""
            } else {
                name
            }
        });
        if !label_part_ok(name) {
            return Err(ManifestError::new(origin(), ManifestErrorKind::LabelKey(key.clone())));
        }
        if !value.is_empty() && !label_part_ok(value) {
            return Err(ManifestError::new(
                origin(),
                ManifestErrorKind::LabelValue(value.clone()),
            ));
        }
    }
    Ok(())
}

fn parse_user(user: &Spanned<String>, first_line: u64) -> Result<UserSpec, ManifestError> {
    let origin = || Origin::new("spec.user", location(&user.referenced, first_line));
    let value = user.value.trim();
    if value == "host" {
        return Ok(UserSpec::Host);
    }
    let syntax = || {
        ManifestError::new(
            origin(),
            ManifestErrorKind::UserSyntax {
                value: user.value.clone(),
            },
        )
    };
    let (uid, gid) = value.split_once(':').ok_or_else(syntax)?;
    let id = |s: &str| -> Result<u32, ManifestError> {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(syntax());
        }
        let n: u64 = s
            .parse()
            .map_err(|_| ManifestError::new(origin(), ManifestErrorKind::IdTooLarge { id: u64::MAX }))?;
        if n > MAX_ID {
            return Err(ManifestError::new(origin(), ManifestErrorKind::IdTooLarge { id: n }));
        }
        Ok(n as u32)
    };
    Ok(UserSpec::Ids {
        uid: id(uid)?,
        gid: id(gid)?,
    })
}

/// `spec.ports`: each entry checked with its place; a (containerPort, protocol) or an explicit
/// (hostIP, hostPort, protocol) published twice is refused, as the kubelet refuses it.
fn validate_ports(raw: &[raw::Port], bridge: bool, first_line: u64) -> Result<Vec<PortSpec>, ManifestError> {
    let at = |s: &serde_saphyr::Location| location(s, first_line);
    let mut out: Vec<PortSpec> = Vec::new();
    for (i, p) in raw.iter().enumerate() {
        let field =
            |name: &str, span: &serde_saphyr::Location| Origin::new(format!("spec.ports[{i}].{name}"), at(span));
        let bad = |origin: Origin, m: String| ManifestError::new(origin, ManifestErrorKind::Yaml(m));
        let container = field("containerPort", &p.container_port.referenced);
        if !bridge {
            return Err(bad(
                container,
                "ports need network: bridge (with none nothing can reach the container; with host its ports are the host's already)".into(),
            ));
        }
        let container_port = u16::try_from(p.container_port.value)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                bad(
                    container.clone(),
                    format!("{} is not a port (1 to 65535)", p.container_port.value),
                )
            })?;
        let host_port = match &p.host_port {
            None => None,
            Some(h) => match u16::try_from(h.value) {
                Ok(0) => None,
                Ok(n) => Some(n),
                Err(_) => {
                    return Err(bad(
                        field("hostPort", &h.referenced),
                        format!("{} is not a port (1 to 65535, or 0 for a free one)", h.value),
                    ));
                }
            },
        };
        let host_ip = match &p.host_ip {
            None => DEFAULT_HOST_IP,
            Some(h) => h.value.trim().parse::<std::net::Ipv4Addr>().map_err(|_| {
                bad(
                    field("hostIP", &h.referenced),
                    format!("{:?} is not an IPv4 address (bridge networks are IPv4)", h.value),
                )
            })?,
        };
        let protocol = match p.protocol.as_ref().map(|s| s.value.as_str()) {
            None | Some("TCP") => Protocol::Tcp,
            Some("UDP") => Protocol::Udp,
            Some(other) => {
                let span = &p.protocol.as_ref().expect("matched Some").referenced;
                let hint = match other.to_ascii_uppercase().as_str() {
                    "TCP" | "UDP" => format!(" (Kubernetes spells it {})", other.to_ascii_uppercase()),
                    _ => String::new(),
                };
                return Err(bad(
                    field("protocol", span),
                    format!("{other:?} is not a protocol: TCP or UDP{hint}"),
                ));
            }
        };
        if let Some(name) = &p.name
            && !valid_port_name(&name.value)
        {
            return Err(bad(
                field("name", &name.referenced),
                format!(
                    "{:?} is not a port name (an IANA_SVC_NAME: up to 15 lowercase letters, digits and '-', with a letter)",
                    name.value
                ),
            ));
        }
        let port = PortSpec {
            name: p.name.as_ref().map(|n| n.value.clone()),
            container_port,
            host_port,
            host_ip,
            protocol,
        };
        if let Some(prev) = out
            .iter()
            .position(|q| q.container_port == port.container_port && q.protocol == port.protocol)
        {
            return Err(bad(
                container,
                format!(
                    "containerPort {}/{} is published by spec.ports[{prev}] already",
                    port.container_port,
                    port.protocol.as_str()
                ),
            ));
        }
        if let Some(h) = port.host_port
            && let Some(prev) = out.iter().position(|q| {
                q.host_port == Some(h)
                    && q.protocol == port.protocol
                    && (q.host_ip == port.host_ip || q.host_ip.is_unspecified() || port.host_ip.is_unspecified())
            })
        {
            let span = &p.host_port.as_ref().expect("host_port is set").referenced;
            return Err(bad(
                field("hostPort", span),
                format!(
                    "hostPort {h}/{} is taken by spec.ports[{prev}] already",
                    port.protocol.as_str()
                ),
            ));
        }
        out.push(port);
    }
    Ok(out)
}

/// Kubernetes' IANA_SVC_NAME: 1-15 of [a-z0-9-], at least one letter, no leading, trailing or
/// doubled '-'.
fn valid_port_name(name: &str) -> bool {
    (1..=15).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && name.chars().any(|c| c.is_ascii_lowercase())
        && !name.starts_with('-')
        && !name.ends_with('-')
        && !name.contains("--")
}

fn validate_mounts(mounts: Vec<raw::Mount>, first_line: u64) -> Result<Vec<MountSpec>, ManifestError> {
    mounts
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let source_origin = Origin::new(
                format!("spec.mounts[{i}].source"),
                location(&m.source.referenced, first_line),
            );
            let target_origin = Origin::new(
                format!("spec.mounts[{i}].target"),
                location(&m.target.referenced, first_line),
            );
            paths::check_lexical(&m.source.value).map_err(|k| ManifestError::new(source_origin.clone(), k))?;
            if m.source.value.starts_with('/')
                && let Some(reason) = paths::refused_source(&paths::normalize(&m.source.value), None)
            {
                return Err(ManifestError::new(
                    source_origin,
                    ManifestErrorKind::RefusedSource {
                        path: m.source.value.clone(),
                        reason,
                    },
                ));
            }
            paths::check_target(&m.target.value).map_err(|k| ManifestError::new(target_origin.clone(), k))?;
            Ok(MountSpec {
                source: m.source.value,
                target: paths::normalize(&m.target.value),
                read_only: m.read_only,
                source_origin,
                target_origin,
            })
        })
        .collect()
}

fn validate_environment(
    raw: raw::EnvironmentDoc,
    first_line: u64,
    file: Option<&Path>,
) -> Result<Environment, ManifestError> {
    let name = validate_name(&raw.metadata.name, first_line)?;
    validate_labels(&raw.metadata.labels, "labels")?;
    validate_labels(&raw.metadata.annotations, "annotations")?;
    let spec = raw.spec;
    let at = |s: &serde_saphyr::Location| location(s, first_line);
    let workdir = match &spec.workdir {
        Some(w) => {
            paths::check_workdir(&w.value)
                .map_err(|k| ManifestError::new(Origin::new("spec.workdir", at(&w.referenced)), k))?;
            paths::normalize(&w.value)
        }
        None => defaults::WORKDIR.to_string(),
    };
    let user = spec.user.as_ref().map(|u| parse_user(u, first_line)).transpose()?;
    for (key, value) in &spec.env {
        let origin = || Origin::new(format!("spec.env.{key}"), None);
        let valid = key
            .bytes()
            .enumerate()
            .all(|(i, b)| b == b'_' || b.is_ascii_alphabetic() || (i > 0 && b.is_ascii_digit()));
        if key.is_empty() || !valid {
            return Err(ManifestError::new(origin(), ManifestErrorKind::EnvName(key.clone())));
        }
        if value.contains('\0') {
            return Err(ManifestError::new(
                origin(),
                ManifestErrorKind::EnvValueNul(key.clone()),
            ));
        }
    }
    let mounts = validate_mounts(spec.mounts, first_line)?;
    let mount_workspace = spec.mount_workspace.unwrap_or(true);
    if mount_workspace {
        if workdir == "/" {
            let loc = spec.workdir.as_ref().and_then(|w| at(&w.referenced));
            return Err(ManifestError::new(
                Origin::new("spec.workdir", loc),
                ManifestErrorKind::WorkspaceAtRoot,
            ));
        }
        if let Some(m) = mounts.iter().find(|m| paths::is_within(&m.target, &workdir)) {
            return Err(ManifestError::new(
                m.target_origin.clone(),
                ManifestErrorKind::TargetUnderWorkdir {
                    target: m.target.clone(),
                    workdir: workdir.clone(),
                },
            ));
        }
    }
    let backend = match spec.backend {
        Some(raw::Backend::Host) => Backend::Host,
        Some(raw::Backend::Containerd) | None => Backend::Containerd,
    };
    let pids_origin = spec
        .resources
        .as_ref()
        .and_then(|r| r.pids.as_ref())
        .map(|p| Origin::new("spec.resources.pids", at(&p.referenced)));
    let resources = validate_resources(spec.resources, first_line)?;
    if backend == Backend::Containerd && spec.image.is_none() {
        return Err(ManifestError::new(
            Origin::new("spec.image", None),
            ManifestErrorKind::ImageRequired,
        ));
    }
    let network: Option<(NetworkMode, Option<String>)> = match &spec.network {
        None => None,
        Some(n) => Some(match n.value.as_str() {
            "none" => (NetworkMode::None, None),
            "host" => (NetworkMode::Host, None),
            "bridge" => (NetworkMode::Bridge, None),
            name if valid_network_name(name) => (NetworkMode::Bridge, Some(name.to_string())),
            other => {
                return Err(ManifestError::new(
                    Origin::new("spec.network", at(&n.referenced)),
                    ManifestErrorKind::Yaml(format!(
                        "{other:?} is not a network: none, host, bridge, or the name of a Network document"
                    )),
                ));
            }
        }),
    };
    let bridge = matches!(network, Some((NetworkMode::Bridge, _)));
    let mut egress_allow = Vec::new();
    let mut egress_domains = Vec::new();
    if let Some(egress) = &spec.egress {
        for (i, entry) in egress.allow.iter().enumerate() {
            let origin = Origin::new(format!("spec.egress.allow[{i}]"), at(&entry.referenced));
            if !bridge {
                return Err(ManifestError::new(
                    origin,
                    ManifestErrorKind::Yaml(
                        "egress needs network: bridge (other networks have no way out to allow)".into(),
                    ),
                ));
            }
            match EgressEntry::parse(&entry.value)
                .map_err(|m| ManifestError::new(origin, ManifestErrorKind::Yaml(m)))?
            {
                EgressEntry::Cidr(rule) => egress_allow.push(rule),
                EgressEntry::Domain(domain) => egress_domains.push(domain),
            }
        }
    }
    let ports = validate_ports(&spec.ports, bridge, first_line)?;
    if let Some(image) = &spec.image
        && (image.value.trim().is_empty() || image.value.contains(char::is_whitespace))
    {
        return Err(ManifestError::new(
            Origin::new("spec.image", at(&image.referenced)),
            ManifestErrorKind::Yaml(format!("{:?} is not an image reference", image.value)),
        ));
    }
    Ok(Environment {
        name,
        backend,
        image: spec.image.as_ref().map(|i| i.value.clone()),
        workdir,
        mount_workspace,
        user,
        env: spec.env,
        include_host_env: spec.include_host_env.as_ref().is_some_and(|b| b.value),
        host_users: spec.host_users.as_ref().is_some_and(|b| b.value),
        allow_32bit_syscalls: spec.allow_32bit_syscalls.as_ref().is_some_and(|b| b.value),
        image_pull_policy: spec.image_pull_policy.as_ref().map(|p| p.value),
        egress_allow,
        egress_domains,
        ports,
        setup: spec.setup.map(|s| s.commands).unwrap_or_default(),
        mounts,
        network: network.as_ref().map(|(mode, _)| *mode),
        network_name: network.and_then(|(_, name)| name),
        resources,
        origins: EnvOrigins {
            image: spec.image.as_ref().and_then(|i| at(&i.referenced)),
            include_host_env: spec.include_host_env.as_ref().and_then(|b| at(&b.referenced)),
            host_users: spec.host_users.as_ref().and_then(|b| at(&b.referenced)),
            network: spec.network.as_ref().and_then(|n| at(&n.referenced)),
            pids: pids_origin,
            user: spec.user.as_ref().and_then(|u| at(&u.referenced)),
            file: file.map(Path::to_path_buf),
        },
    })
}

fn validate_resources(raw: Option<raw::Resources>, first_line: u64) -> Result<Resources, ManifestError> {
    let mut out = Resources::default();
    let Some(raw) = raw else { return Ok(out) };
    if let Some(m) = raw.memory {
        let origin = Origin::new("spec.resources.memory", location(&m.referenced, first_line));
        let bytes = MemoryBytes::parse(&m.value.0).map_err(|e| ManifestError::new(origin.clone(), e.into()))?;
        if bytes.0 < quantity::MIN_MEMORY_BYTES {
            return Err(ManifestError::new(
                origin,
                ManifestErrorKind::MemoryTooSmall {
                    bytes: bytes.0,
                    min: quantity::MIN_MEMORY_BYTES,
                },
            ));
        }
        out.memory = bytes;
    }
    if let Some(c) = raw.cpu {
        let origin = Origin::new("spec.resources.cpu", location(&c.referenced, first_line));
        let milli = MilliCpu::parse(&c.value.0).map_err(|e| ManifestError::new(origin.clone(), e.into()))?;
        if !(quantity::MIN_MILLI_CPU..=quantity::MAX_MILLI_CPU).contains(&milli.0) {
            return Err(ManifestError::new(
                origin,
                ManifestErrorKind::CpuOutOfRange {
                    milli: milli.0,
                    min: quantity::MIN_MILLI_CPU,
                    max: quantity::MAX_MILLI_CPU,
                },
            ));
        }
        out.cpu = milli;
    }
    if let Some(p) = raw.pids {
        if !(1..=MAX_PIDS).contains(&p.value) {
            return Err(ManifestError::new(
                Origin::new("spec.resources.pids", location(&p.referenced, first_line)),
                ManifestErrorKind::PidsOutOfRange(p.value),
            ));
        }
        out.pids = p.value as u32;
    }
    if let Some(e) = raw.ephemeral_storage {
        let origin = Origin::new("spec.resources.ephemeralStorage", location(&e.referenced, first_line));
        let bytes = StorageBytes::parse(&e.value.0).map_err(|err| ManifestError::new(origin.clone(), err.into()))?;
        if bytes.0 < quantity::MIN_STORAGE_BYTES {
            return Err(ManifestError::new(
                origin,
                ManifestErrorKind::StorageTooSmall {
                    bytes: bytes.0,
                    min: quantity::MIN_STORAGE_BYTES,
                },
            ));
        }
        out.ephemeral_storage = bytes;
    }
    Ok(out)
}

fn seconds(value: f64) -> Option<Duration> {
    (value.is_finite() && value > 0.0 && value <= MAX_TIMEOUT_SECONDS as f64).then(|| Duration::from_secs_f64(value))
}

fn validate_job(raw: raw::JobDoc, first_line: u64, base_dir: &Path, file: Option<&Path>) -> Result<Job, ManifestError> {
    let name = validate_name(&raw.metadata.name, first_line)?;
    validate_labels(&raw.metadata.labels, "labels")?;
    validate_labels(&raw.metadata.annotations, "annotations")?;
    let spec = raw.spec;
    let at = |s: &serde_saphyr::Location| location(s, first_line);
    let environment_origin = Origin::new("spec.environment", at(&spec.environment.referenced));
    if spec.environment.value.is_empty() {
        return Err(ManifestError::new(
            environment_origin,
            ManifestErrorKind::Name {
                name: String::new(),
                reason: "must name an Environment",
            },
        ));
    }
    let workspace = match &spec.workspace {
        Some(w) => {
            paths::check_lexical(&w.value)
                .map_err(|k| ManifestError::new(Origin::new("spec.workspace", at(&w.referenced)), k))?;
            Some(base_dir.join(&w.value))
        }
        None => None,
    };
    let static_assets = spec
        .static_assets
        .into_iter()
        .enumerate()
        .map(|(i, a)| {
            let origin = Origin::new(format!("spec.staticAssets[{i}].source"), at(&a.source.referenced));
            paths::check_lexical(&a.source.value).map_err(|k| ManifestError::new(origin.clone(), k))?;
            paths::check_save_path(&a.save_path.value).map_err(|k| {
                ManifestError::new(
                    Origin::new(format!("spec.staticAssets[{i}].savePath"), at(&a.save_path.referenced)),
                    k,
                )
            })?;
            Ok(StaticAsset {
                source: base_dir.join(&a.source.value),
                save_path: paths::normalize(&a.save_path.value).trim_start_matches('/').to_string(),
                origin,
            })
        })
        .collect::<Result<Vec<_>, ManifestError>>()?;
    let mounts = validate_mounts(spec.mounts, first_line)?;
    let command_origin = || Origin::new("spec.command", at(&spec.command.referenced));
    let command = match spec.command.value {
        raw::Command::Argv(argv) => {
            if argv.is_empty() || argv[0].is_empty() {
                return Err(ManifestError::new(command_origin(), ManifestErrorKind::EmptyCommand));
            }
            if argv.iter().any(|a| a.contains('\0')) {
                return Err(ManifestError::new(command_origin(), ManifestErrorKind::Nul));
            }
            Command::Argv(argv)
        }
        raw::Command::Shell(script) => {
            if script.trim().is_empty() {
                return Err(ManifestError::new(command_origin(), ManifestErrorKind::EmptyCommand));
            }
            if script.contains('\0') {
                return Err(ManifestError::new(command_origin(), ManifestErrorKind::Nul));
            }
            Command::Shell(script)
        }
    };
    let timeout = match &spec.timeout_seconds {
        Some(t) => Some(seconds(t.value).ok_or_else(|| {
            ManifestError::new(
                Origin::new("spec.timeoutSeconds", at(&t.referenced)),
                ManifestErrorKind::Timeout,
            )
        })?),
        None => None,
    };
    let active_deadline = match &spec.active_deadline_seconds {
        Some(d) if d.value == 0 || d.value > MAX_TIMEOUT_SECONDS => {
            return Err(ManifestError::new(
                Origin::new("spec.activeDeadlineSeconds", at(&d.referenced)),
                ManifestErrorKind::Deadline,
            ));
        }
        Some(d) => Some(Duration::from_secs(d.value)),
        None => None,
    };
    let count = |v: &Option<Spanned<u32>>, field: &str| -> Result<u32, ManifestError> {
        match v {
            Some(c) if c.value == 0 || c.value > MAX_COMPLETIONS => Err(ManifestError::new(
                Origin::new(field, at(&c.referenced)),
                ManifestErrorKind::Count { max: MAX_COMPLETIONS },
            )),
            Some(c) => Ok(c.value),
            None => Ok(1),
        }
    };
    let completions = count(&spec.completions, "spec.completions")?;
    let parallelism = count(&spec.parallelism, "spec.parallelism")?;
    let grace = match &spec.termination_grace_period_seconds {
        Some(g) if g.value > MAX_TIMEOUT_SECONDS => {
            return Err(ManifestError::new(
                Origin::new("spec.terminationGracePeriodSeconds", at(&g.referenced)),
                ManifestErrorKind::Deadline,
            ));
        }
        Some(g) => g.value,
        None => defaults::TERMINATION_GRACE_SECONDS,
    };
    let failure_rules = spec
        .pod_failure_policy
        .map(|p| {
            p.rules
                .into_iter()
                .map(|r| policy::FailureRule {
                    action: r.action,
                    operator: r.on_exit_codes.operator,
                    values: r.on_exit_codes.values,
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(Job {
        completions,
        parallelism,
        indexed: spec.completion_mode == Some(raw::CompletionMode::Indexed),
        ttl_after_finished: spec.ttl_seconds_after_finished.map(Duration::from_secs),
        termination_grace: Duration::from_secs(grace),
        failure_rules,
        name,
        labels: raw.metadata.labels,
        annotations: raw.metadata.annotations,
        environment: spec.environment.value.clone(),
        environment_origin,
        workspace,
        static_assets,
        mounts,
        command,
        stdin: spec.stdin,
        timeout,
        disable_setup: spec.disable_setup,
        backoff_limit: spec.backoff_limit.as_ref().map_or(0, |b| b.value),
        backoff_limit_origin: spec
            .backoff_limit
            .as_ref()
            .map(|b| Origin::new("spec.backoffLimit", at(&b.referenced))),
        active_deadline,
        base_dir: base_dir.to_path_buf(),
        file: file.map(Path::to_path_buf),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn egress_entries_are_addresses_or_domains_and_domains_match_as_written() {
        let domain = |t: &str| match EgressEntry::parse(t).unwrap() {
            EgressEntry::Domain(d) => d,
            other => panic!("{t}: {other:?}"),
        };
        assert!(matches!(EgressEntry::parse("10.0.0.0/8:443"), Ok(EgressEntry::Cidr(_))));
        let exact = domain("PyPI.org.");
        assert_eq!(
            (exact.name.as_str(), exact.wildcard, exact.port),
            ("pypi.org", false, None)
        );
        assert!(exact.matches("pypi.org") && exact.matches("PYPI.ORG.") && !exact.matches("x.pypi.org"));
        let wild = domain("*.example.com:443");
        assert_eq!(
            (wild.wildcard, wild.port, wild.to_string().as_str()),
            (true, Some(443), "*.example.com:443")
        );
        assert!(wild.matches("a.example.com") && wild.matches("a.b.example.com"));
        assert!(!wild.matches("example.com") && !wild.matches("badexample.com"));
        for bad in [
            "exa_mple.com",
            "*foo.com",
            "a.*.com",
            "-a.com",
            "example.com:0",
            "example.com:x",
            "1.2.3.4.5",
            "a..com",
        ] {
            assert!(EgressEntry::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn splits_documents_and_keeps_file_line_numbers() {
        let docs = split_documents("a: 1\n---\nb: 2\n--- {c: 3}\n...\n# only a comment\n");
        assert_eq!(docs.len(), 3);
        assert_eq!(docs[0].first_line, 0);
        assert_eq!(docs[1].first_line, 1);
        assert!(docs[1].text.contains("b: 2"));
        assert_eq!(docs[2].first_line, 3);
        assert!(docs[2].text.starts_with("    {c: 3}"));
    }

    #[test]
    fn errors_carry_path_and_line_column() {
        let text = "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: e}\nspec:\n  resources:\n    memory: lots\n";
        let err = parse_str(text, Path::new("."), None).unwrap_err();
        assert_eq!(err.origin.path, "spec.resources.memory");
        assert_eq!(err.origin.location, Some(Location { line: 6, column: 13 }));
        assert!(err.to_string().contains("6:13"), "{err}");
    }
}
