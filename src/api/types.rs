//! Request and response bodies of the HTTP API (serde; their JSON Schemas go into the OpenAPI
//! document), and their translation into service calls.

use std::collections::BTreeMap;
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::manifest::{self, Backend};
use crate::runtime::ExecRequest;
use crate::service::ServiceError;
use crate::service::sessions::{Check, EnvironmentRef, NewSession, ShellRequest};

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateSession {
    /// A whole Environment document, its spec object, or the name of one in the server's
    /// env dir.
    #[schemars(with = "EnvironmentSchema")]
    #[serde(default)]
    pub environment: serde_json::Value,
    /// Restore the session from this checkpoint (`POST /v1/sessions/{id}/checkpoint`)
    /// instead: its Environment, files, workspace, processes and memory are the checkpoint's
    /// (give no `environment`, `workspace`, `staticAssets`, `mounts` or `backend`).
    pub from_checkpoint: Option<String>,
    /// A host directory to work in (default: a scratch directory removed with the session).
    pub workspace: Option<String>,
    /// As a Job's `staticAssets`.
    #[serde(default)]
    #[schemars(with = "Vec<serde_json::Map<String, serde_json::Value>>")]
    pub static_assets: Vec<serde_json::Value>,
    /// As a Job's `mounts`.
    #[serde(default)]
    #[schemars(with = "Vec<serde_json::Map<String, serde_json::Value>>")]
    pub mounts: Vec<serde_json::Value>,
    /// Run on this backend instead of the Environment's.
    pub backend: Option<Backend>,
    /// A call to the session while it is paused resumes it first (default: the call is
    /// answered 409).
    #[serde(default)]
    pub auto_resume: bool,
    /// Pause the session once it has been idle this long (containerd sessions).
    pub idle_pause_seconds: Option<f64>,
    /// Claim a ready member of a warm pool when one fits (default `true`). `false`: the
    /// session gets a sandbox started for it — one meant to be checkpointed or forked (a
    /// pool member's workspace was mounted after its processes started: CRIU cannot take it).
    pub pool: Option<bool>,
}

/// How `environment` may be given.
#[derive(JsonSchema)]
#[allow(dead_code)]
#[serde(untagged)]
enum EnvironmentSchema {
    Name(String),
    Document(serde_json::Map<String, serde_json::Value>),
}

/// What `POST /v1/sessions` asks for.
pub enum SessionSource {
    New(NewSession),
    /// A checkpoint's name, and how the copy pauses.
    Checkpoint(String, crate::service::sessions::PausePolicy),
}

impl CreateSession {
    pub fn into_source(self) -> Result<SessionSource, ServiceError> {
        let Some(name) = self.from_checkpoint.clone() else {
            return self.into_request().map(SessionSource::New);
        };
        let given = [
            ("environment", !self.environment.is_null()),
            ("workspace", self.workspace.is_some()),
            ("staticAssets", !self.static_assets.is_empty()),
            ("mounts", !self.mounts.is_empty()),
            ("backend", self.backend.is_some()),
            ("pool", self.pool.is_some()),
        ];
        if let Some((field, _)) = given.iter().find(|(_, set)| *set) {
            return Err(ServiceError::field(
                *field,
                "a session restored from a checkpoint has its checkpoint's (give fromCheckpoint alone)",
            ));
        }
        let pause = crate::service::sessions::PausePolicy {
            auto_resume: self.auto_resume,
            idle_pause: seconds("idlePauseSeconds", self.idle_pause_seconds)?,
        };
        Ok(SessionSource::Checkpoint(name, pause))
    }

    pub fn into_request(self) -> Result<NewSession, ServiceError> {
        Ok(NewSession {
            environment: EnvironmentRef::from_json(self.environment)?,
            workspace: self.workspace,
            static_assets: self.static_assets,
            mounts: self.mounts,
            backend: self.backend,
            use_pool: self.pool.unwrap_or(true),
            pause: crate::service::sessions::PausePolicy {
                auto_resume: self.auto_resume,
                idle_pause: seconds("idlePauseSeconds", self.idle_pause_seconds)?,
            },
        })
    }
}

/// A command: an argv array, or a string run by `/bin/sh -c`.
#[derive(Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum CommandSpec {
    Argv(Vec<String>),
    Shell(String),
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Exec {
    pub command: CommandSpec,
    /// Given to the command, then EOF (absent: EOF at once). Not for `exec/stream`.
    pub stdin: Option<String>,
    pub timeout_seconds: Option<f64>,
    /// Extra environment for this command. Not for `exec/stream`.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory, relative to the sandbox's. Not for `exec/stream`.
    pub cwd: Option<String>,
}

/// `PATCH /v1/sessions/{id}`: what may change on a live session.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PatchSession {
    /// Its new egress, replacing the old one whole (as an Environment's `egress`).
    pub egress: PatchEgress,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PatchEgress {
    /// `egress.allow` entries: `10.0.0.0/8`, `203.0.113.7:443`, `pypi.org:443`, `*.example.com`.
    pub allow: Vec<String>,
}

/// A time limit in seconds as a request gives it (`field` names it in the error).
pub(super) fn seconds(field: &str, v: Option<f64>) -> Result<Option<Duration>, ServiceError> {
    match v {
        None => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 && s <= manifest::MAX_TIMEOUT_SECONDS as f64 => {
            Ok(Some(Duration::from_secs_f64(s)))
        }
        Some(_) => Err(ServiceError::field(
            field,
            format!("must be above 0 and at most {}", manifest::MAX_TIMEOUT_SECONDS),
        )),
    }
}

impl Exec {
    pub fn into_request(self) -> Result<ExecRequest, ServiceError> {
        let argv = match self.command {
            CommandSpec::Argv(a) if !a.is_empty() => a,
            CommandSpec::Shell(s) if !s.trim().is_empty() => vec!["/bin/sh".into(), "-c".into(), s],
            _ => return Err(ServiceError::field("command", "must not be empty")),
        };
        Ok(ExecRequest {
            argv,
            stdin: self.stdin.map(String::into_bytes),
            timeout: seconds("timeoutSeconds", self.timeout_seconds)?,
            env: self.env,
            cwd: self.cwd,
        })
    }
}

#[derive(Deserialize, JsonSchema, Clone, Copy)]
#[serde(rename_all = "lowercase")]
pub enum CheckMode {
    /// Answer with the output and exit code.
    Ignore,
    /// Fail with 422 (the body still carries the output) when the command fails.
    Raise,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Shell {
    pub command: String,
    pub timeout_seconds: Option<f64>,
    pub check: Option<CheckMode>,
    /// Several named shells per session (letters, digits, `-`, `_`); default `default`.
    pub name: Option<String>,
}

impl Shell {
    pub fn into_request(self) -> Result<ShellRequest, ServiceError> {
        Ok(ShellRequest {
            command: self.command,
            timeout: seconds("timeoutSeconds", self.timeout_seconds)?,
            check: match self.check {
                None | Some(CheckMode::Ignore) => Check::Ignore,
                Some(CheckMode::Raise) => Check::Raise,
            },
            name: self.name,
        })
    }
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Python {
    pub code: String,
    pub timeout_seconds: Option<f64>,
}

impl Python {
    pub fn timeout(&self) -> Result<Option<Duration>, ServiceError> {
        seconds("timeoutSeconds", self.timeout_seconds)
    }
}

/// What the Python driver answers to code: `output`, `stderr`, `vars`, `error`, and
/// `timedOut` / `oomKilled` when so.
#[derive(Serialize, JsonSchema)]
pub struct PythonOutput(pub serde_json::Map<String, serde_json::Value>);

#[derive(Serialize, JsonSchema)]
pub struct PythonValue {
    /// The value as JSON, or `{"repr": "..."}` when it is not serializable.
    pub value: serde_json::Value,
}

/// `?path=` of the file routes (relative to the workspace).
#[derive(Deserialize, JsonSchema)]
pub struct PathQuery {
    pub path: Option<String>,
}

impl PathQuery {
    pub fn required(self) -> Result<String, ServiceError> {
        self.path.ok_or_else(|| ServiceError::field("path", "is required"))
    }
}

#[derive(Serialize, JsonSchema)]
pub struct CreatedJobs {
    pub created: Vec<String>,
}

#[derive(Serialize, JsonSchema)]
pub struct Health {
    pub status: String,
}

#[derive(Serialize, JsonSchema)]
pub struct ErrorBody {
    pub error: String,
}
