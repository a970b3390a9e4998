//! SWE-ReX's request and response models (swerex/runtime/abstract.py), field for field.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `Literal["bash"]`.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, JsonSchema)]
pub enum Bash {
    #[default]
    #[serde(rename = "bash")]
    Bash,
}

pub(super) fn default_session() -> String {
    "default".into()
}

pub(super) fn one_second() -> f64 {
    1.0
}

#[derive(Serialize, JsonSchema)]
pub struct IsAliveResponse {
    pub is_alive: bool,
    pub message: String,
}

#[derive(Deserialize, JsonSchema)]
pub struct CreateBashSessionRequest {
    /// Files sourced before the first command.
    #[serde(default)]
    pub startup_source: Vec<String>,
    #[serde(default = "default_session")]
    pub session: String,
    #[serde(default)]
    pub session_type: Bash,
    /// Seconds the startup commands may take.
    #[serde(default = "one_second")]
    pub startup_timeout: f64,
}

#[derive(Serialize, JsonSchema)]
pub struct CreateBashSessionResponse {
    pub output: String,
    pub session_type: Bash,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum CheckMode {
    Silent,
    #[default]
    Raise,
    Ignore,
}

#[derive(Deserialize, JsonSchema)]
pub struct BashAction {
    pub command: String,
    #[serde(default = "default_session")]
    pub session: String,
    /// Seconds; none means no limit (ours: the longest timeout runner allows).
    pub timeout: Option<f64>,
    #[serde(default)]
    pub is_interactive_command: bool,
    #[serde(default)]
    pub is_interactive_quit: bool,
    #[serde(default)]
    pub check: CheckMode,
    #[serde(default)]
    pub error_msg: String,
    /// For an interactive command: outputs that end it besides the prompt (matched
    /// literally). Ignored for the others: our shell runs them to their end.
    #[serde(default)]
    pub expect: Vec<String>,
}

#[derive(Deserialize, JsonSchema)]
pub struct BashInterruptAction {
    #[serde(default = "default_session")]
    pub session: String,
    /// Seconds each Ctrl-C waits for the prompt or an `expect` string.
    #[serde(default = "point_two")]
    pub timeout: f64,
    /// How many Ctrl-Cs before Ctrl-Z and `kill -9 %1`.
    #[serde(default = "three")]
    pub n_retry: u32,
    /// Outputs that end the interrupt besides the prompt (matched literally).
    #[serde(default)]
    pub expect: Vec<String>,
}

fn point_two() -> f64 {
    0.2
}

fn three() -> u32 {
    3
}

#[derive(Deserialize, JsonSchema)]
#[serde(tag = "action_type")]
pub enum Action {
    #[serde(rename = "bash")]
    Bash(BashAction),
    #[serde(rename = "bash_interrupt")]
    Interrupt(BashInterruptAction),
}

#[derive(Serialize, JsonSchema)]
pub struct BashObservation {
    pub output: String,
    pub exit_code: Option<i32>,
    pub failure_reason: String,
    pub expect_string: String,
    pub session_type: Bash,
}

#[derive(Deserialize, JsonSchema)]
pub struct CloseBashSessionRequest {
    #[serde(default = "default_session")]
    pub session: String,
    #[serde(default)]
    pub session_type: Bash,
}

#[derive(Serialize, JsonSchema)]
pub struct CloseBashSessionResponse {
    pub session_type: Bash,
}

#[derive(Deserialize, JsonSchema, Clone)]
#[serde(untagged)]
pub enum CommandLine {
    Text(String),
    Argv(Vec<String>),
}

/// A command run as a subprocess (as `subprocess.run`).
#[derive(Deserialize, JsonSchema)]
pub struct Command {
    pub command: CommandLine,
    pub timeout: Option<f64>,
    #[serde(default)]
    pub shell: bool,
    #[serde(default)]
    pub check: bool,
    #[serde(default)]
    pub error_msg: String,
    /// The whole environment of the command (as `subprocess.run(env=...)`).
    pub env: Option<BTreeMap<String, String>>,
    pub cwd: Option<String>,
    #[serde(default)]
    pub merge_output_streams: bool,
}

#[derive(Serialize, JsonSchema)]
pub struct CommandResponse {
    pub stdout: String,
    pub stderr: String,
    pub exit_code: Option<i32>,
}

#[derive(Deserialize, JsonSchema)]
pub struct ReadFileRequest {
    pub path: String,
    pub encoding: Option<String>,
    pub errors: Option<String>,
}

#[derive(Serialize, JsonSchema)]
pub struct ReadFileResponse {
    pub content: String,
}

#[derive(Deserialize, JsonSchema)]
pub struct WriteFileRequest {
    pub content: String,
    pub path: String,
}

/// SWE-ReX's empty responses (`WriteFileResponse`, `UploadResponse`, `CloseResponse`).
#[derive(Serialize, JsonSchema)]
pub struct Empty {}
