//! The validated domain types: what code holds once a manifest was read (an `Environment`,
//! a `Job`, a `WarmPool`, a `NetworkDef`), their parts, defaults and limits.

use super::*;

/// The only API version we read.
pub const API_VERSION: &str = "runner/v1alpha1";
/// Manifests larger than this are refused before parsing.
pub const MAX_MANIFEST_BYTES: u64 = 4 * 1024 * 1024;
/// YAML nesting deeper than this is refused (our manifests are at most ~6 levels deep).
pub(super) const MAX_YAML_DEPTH: usize = 64;
/// Aliases are rare in manifests; a handful is plenty and bounds "billion laughs".
pub(super) const MAX_YAML_ALIASES: usize = 64;
/// Upper bound of the scalar text of one document.
pub(super) const MAX_YAML_SCALAR_BYTES: usize = 4 * 1024 * 1024;
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
pub(super) const RESERVED_LABEL_PREFIXES: &[&str] =
    &["containerd.io/", "io.containerd.", "io.cri-containerd.", "runner.dev/"];

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

    pub(super) fn range(&self) -> (u32, u32) {
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
    /// `setup.snapshot: true`: the setup runs once (per image and setup text) on the
    /// containerd backend; jobs and sessions start from a snapshot of what it made.
    pub setup_snapshot: bool,
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
    pub(super) image: Option<Location>,
    pub(super) include_host_env: Option<Location>,
    pub(super) host_users: Option<Location>,
    pub(super) network: Option<Location>,
    /// `Some` when the manifest sets `resources.pids` (the default applies otherwise).
    pub(super) pids: Option<Origin>,
    pub(super) user: Option<Location>,
    pub(super) file: Option<PathBuf>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub environment: String,
    pub environment_origin: Origin,
    /// `spec.backend` as `runner get` prints it: the backend this Job must resolve to (its
    /// Environment's, or `--backend`'s); a Job never picks its own backend.
    pub backend: Option<(Backend, Origin)>,
    /// Absolute, or relative to the manifest's directory.
    pub workspace: Option<PathBuf>,
    pub workspace_origin: Option<Origin>,
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
    /// `spec.snapshot`: members start from snapshot NAME (the image `snapshot:NAME`) with the
    /// Environment's other settings, and serve the jobs and sessions that start from it.
    pub snapshot: Option<String>,
    pub file: Option<PathBuf>,
}

/// The largest warm pool: each member is a running container.
pub const MAX_POOL_SIZE: u32 = 256;

/// The longest snapshot name.
pub const MAX_SNAPSHOT_NAME: usize = 128;

/// Whether `name` can name a snapshot (its image is `snapshot:NAME`): lowercase letters,
/// digits, `.`, `_` and `-`, starting with a letter or digit, at most `MAX_SNAPSHOT_NAME`.
pub fn is_snapshot_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_SNAPSHOT_NAME
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
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
}
