//! Raw manifest structs exactly as written in YAML. `deny_unknown_fields` everywhere, and
//! `Spanned` on every value that a later, semantic check may refuse, so that check can name
//! the line and column. Nothing outside `manifest` sees these types.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde_saphyr::Spanned;

/// Only `apiVersion` and `kind`: read first to pick the strict type for the document.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Header {
    pub api_version: Option<Spanned<String>>,
    pub kind: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EnvironmentDoc {
    #[expect(
        dead_code,
        reason = "checked through Header; declared so deny_unknown_fields accepts it"
    )]
    pub api_version: String,
    #[expect(
        dead_code,
        reason = "checked through Header; declared so deny_unknown_fields accepts it"
    )]
    pub kind: String,
    pub metadata: Metadata,
    pub spec: EnvironmentSpec,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JobDoc {
    #[expect(
        dead_code,
        reason = "checked through Header; declared so deny_unknown_fields accepts it"
    )]
    pub api_version: String,
    #[expect(
        dead_code,
        reason = "checked through Header; declared so deny_unknown_fields accepts it"
    )]
    pub kind: String,
    pub metadata: Metadata,
    pub spec: JobSpec,
    /// What `runner get job -o yaml` printed: read back and ignored, as `kubectl apply`
    /// ignores an object's status.
    #[expect(dead_code, reason = "accepted so a Job `get` printed can be applied again")]
    pub status: Option<de::IgnoredAny>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Metadata {
    pub name: Spanned<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

#[derive(Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Containerd,
    Host,
}

/// A `kind: Network` document.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NetworkDoc {
    #[expect(
        dead_code,
        reason = "checked through Header; declared so deny_unknown_fields accepts it"
    )]
    pub api_version: String,
    #[expect(
        dead_code,
        reason = "checked through Header; declared so deny_unknown_fields accepts it"
    )]
    pub kind: String,
    pub metadata: Metadata,
    pub spec: NetworkSpec,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NetworkSpec {
    pub subnet: Spanned<String>,
    pub gateway: Option<Spanned<String>>,
    pub bridge: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EnvironmentSpec {
    pub backend: Option<Backend>,
    pub image: Option<Spanned<String>>,
    pub workdir: Option<Spanned<String>>,
    pub mount_workspace: Option<bool>,
    pub user: Option<Spanned<String>>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub include_host_env: Option<Spanned<bool>>,
    pub host_users: Option<Spanned<bool>>,
    /// Let the host's 32-bit syscall ABI through the seccomp filter (off by default).
    #[serde(rename = "allow32BitSyscalls")]
    pub allow_32bit_syscalls: Option<Spanned<bool>>,
    pub image_pull_policy: Option<Spanned<super::PullPolicy>>,
    pub setup: Option<Setup>,
    #[serde(default)]
    pub mounts: Vec<Mount>,
    /// `none`, `host`, `bridge`, or the name of a Network document.
    pub network: Option<Spanned<String>>,
    pub egress: Option<Egress>,
    #[serde(default)]
    pub ports: Vec<Port>,
    pub resources: Option<Resources>,
}

/// One `ports` entry, as a Kubernetes container port.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Port {
    pub name: Option<Spanned<String>>,
    pub container_port: Spanned<i64>,
    pub host_port: Option<Spanned<i64>>,
    #[serde(rename = "hostIP")]
    pub host_ip: Option<Spanned<String>>,
    pub protocol: Option<Spanned<String>>,
}

/// `egress`: what a bridge-network container may reach beyond its network.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Egress {
    #[serde(default)]
    pub allow: Vec<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Setup {
    #[serde(default)]
    pub commands: Vec<String>,
    /// Run the commands once, snapshot the result and start later jobs and sessions from it.
    #[serde(default)]
    pub snapshot: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Mount {
    pub source: Spanned<String>,
    pub target: Spanned<String>,
    #[serde(default)]
    pub read_only: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Resources {
    pub memory: Option<Spanned<Quantity>>,
    pub cpu: Option<Spanned<Quantity>>,
    pub pids: Option<Spanned<i64>>,
    pub ephemeral_storage: Option<Spanned<Quantity>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StaticAsset {
    pub source: Spanned<String>,
    pub save_path: Spanned<String>,
}

/// `kind: WarmPool`: containers of an Environment kept started for jobs and sessions.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WarmPoolDoc {
    #[expect(
        dead_code,
        reason = "checked through Header; declared so deny_unknown_fields accepts it"
    )]
    pub api_version: String,
    #[expect(
        dead_code,
        reason = "checked through Header; declared so deny_unknown_fields accepts it"
    )]
    pub kind: String,
    pub metadata: Metadata,
    pub spec: WarmPoolSpec,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WarmPoolSpec {
    pub environment: Spanned<String>,
    pub size: Spanned<u32>,
    /// No longer needed (accepted for older manifests): every pool serves jobs with and
    /// without a workspace.
    pub workspace: Option<bool>,
    /// No longer needed (accepted for older manifests): every pool serves jobs with and
    /// without static assets.
    pub static_assets: Option<bool>,
    /// Members start from this snapshot (`snapshot:NAME`) instead of the Environment's image.
    pub snapshot: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JobSpec {
    pub environment: Spanned<String>,
    /// The backend the Job was resolved to, as `get` prints it: checked, never a choice.
    pub backend: Option<Spanned<Backend>>,
    pub workspace: Option<Spanned<String>>,
    #[serde(default)]
    pub static_assets: Vec<StaticAsset>,
    #[serde(default)]
    pub mounts: Vec<Mount>,
    pub command: Spanned<Command>,
    pub stdin: Option<String>,
    pub timeout_seconds: Option<Spanned<Seconds<f64>>>,
    #[serde(default)]
    pub disable_setup: bool,
    pub backoff_limit: Option<Spanned<u32>>,
    pub active_deadline_seconds: Option<Spanned<Seconds<u64>>>,
    pub completions: Option<Spanned<u32>>,
    pub parallelism: Option<Spanned<u32>>,
    pub completion_mode: Option<CompletionMode>,
    pub ttl_seconds_after_finished: Option<Seconds<u64>>,
    pub termination_grace_period_seconds: Option<Spanned<Seconds<u64>>>,
    pub pod_failure_policy: Option<PodFailurePolicy>,
}

#[derive(Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompletionMode {
    NonIndexed,
    Indexed,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PodFailurePolicy {
    pub rules: Vec<PodFailureRule>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PodFailureRule {
    pub action: super::policy::RuleAction,
    pub on_exit_codes: OnExitCodes,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OnExitCodes {
    pub operator: super::policy::ExitOperator,
    pub values: Vec<i32>,
}

/// A quantity may be written as a string (`512Mi`), an integer (`2`) or a float (`0.5`);
/// all three are kept as text and parsed by `quantity`.
pub struct Quantity(pub String);

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Quantity;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a quantity such as 512Mi, 2Gi, 500m or 2")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Quantity, E> {
                Ok(Quantity(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Quantity, E> {
                Ok(Quantity(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Quantity, E> {
                Ok(Quantity(v.to_string()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Quantity, E> {
                Ok(Quantity(v.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

/// A `...Seconds` field: a number, as Kubernetes writes it. A string is refused with the
/// number to write instead (`"10s"` → `10`), not with the parser's "invalid floating point".
pub struct Seconds<T>(pub T);

/// The numbers a `Seconds` field holds.
pub trait SecondsValue: Sized {
    const WHAT: &'static str;
    fn from_u64(v: u64) -> Option<Self>;
    fn from_i64(v: i64) -> Option<Self>;
    fn from_f64(v: f64) -> Option<Self>;
}

impl SecondsValue for u64 {
    const WHAT: &'static str = "a whole number of seconds";
    fn from_u64(v: u64) -> Option<Self> {
        Some(v)
    }
    fn from_i64(v: i64) -> Option<Self> {
        u64::try_from(v).ok()
    }
    fn from_f64(v: f64) -> Option<Self> {
        (v.fract() == 0.0 && v >= 0.0 && v <= u64::MAX as f64).then_some(v as u64)
    }
}

impl SecondsValue for f64 {
    const WHAT: &'static str = "a number of seconds";
    fn from_u64(v: u64) -> Option<Self> {
        Some(v as f64)
    }
    fn from_i64(v: i64) -> Option<Self> {
        Some(v as f64)
    }
    fn from_f64(v: f64) -> Option<Self> {
        Some(v)
    }
}

impl<'de, T: SecondsValue> Deserialize<'de> for Seconds<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<T: SecondsValue> V<T> {
            fn number<E: de::Error>(v: Option<T>, shown: &dyn fmt::Display) -> Result<Seconds<T>, E> {
                v.map(Seconds)
                    .ok_or_else(|| E::custom(format!("{shown} is not {}", T::WHAT)))
            }
        }
        impl<'de, T: SecondsValue> Visitor<'de> for V<T> {
            type Value = Seconds<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(T::WHAT)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Self::number(T::from_u64(v), &v)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Self::number(T::from_i64(v), &v)
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                Self::number(T::from_f64(v), &v)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                // A number in quotes is still a number (YAML quoted it, Kubernetes would not).
                if let Ok(n) = v.trim().parse::<f64>() {
                    return Self::number(T::from_f64(n), &v);
                }
                let hint = match humantime::parse_duration(v.trim()) {
                    Ok(d) => format!(": write {} (seconds, no unit)", d.as_secs_f64()),
                    Err(_) => ": write a number such as 30 or 0.5".to_string(),
                };
                Err(E::custom(format!("{v:?} is not {}{hint}", T::WHAT)))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// `command: ["python3", "main.py"]` (argv, no shell) or `command: "make test"` (run by `sh -c`).
pub enum Command {
    Argv(Vec<String>),
    Shell(String),
}

impl<'de> Deserialize<'de> for Command {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Command;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of arguments or a shell command string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Command, E> {
                Ok(Command::Shell(v.to_string()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Command, A::Error> {
                let mut argv = Vec::new();
                while let Some(arg) = seq.next_element::<String>()? {
                    argv.push(arg);
                }
                Ok(Command::Argv(argv))
            }
        }
        d.deserialize_any(V)
    }
}
