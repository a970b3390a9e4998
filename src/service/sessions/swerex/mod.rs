//! SWE-ReX's remote-runtime protocol, per session: what `api/swerex.rs` answers under
//! `/v1/sessions/{id}/swerex` (so `swerex.runtime.remote.RemoteRuntime` drives a session
//! unchanged), with its state kept in the session and dropped with it.
//!
//! What runs is ours: a SWE-ReX bash session is one of the session's named shells (a fresh
//! one per `create_session`, `bash`), so a timeout kills the command and leaves the shell
//! usable, where SWE-ReX's own shell is stuck behind the running command. `execute` is
//! `subprocess.run` in the sandbox (`subprocess`). Files named by absolute paths inside the
//! workspace use the confined file operations; any other path is read or written by a command
//! in the sandbox, so what is touched is the sandbox's own view (`files`). Failures are the
//! exceptions SWE-ReX's client re-raises, with Python's classes and messages (`python`).

mod bash;
mod files;
mod interactive;
pub mod models;
mod python;
mod subprocess;

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use serde_json::{Value, json};

use crate::service::{Invalid, ServiceError};

pub use files::UploadForm;

/// Responses kept for a retried `X-Request-ID` (larger ones are not kept).
const REPLAY_LIMIT: usize = 1 << 20;

const SWEREX_EXCEPTION: &str = "swerex.exceptions.SwerexException";
const SESSION_EXISTS: &str = "swerex.exceptions.SessionExistsError";
const SESSION_MISSING: &str = "swerex.exceptions.SessionDoesNotExistError";
const NON_ZERO_EXIT: &str = "swerex.exceptions.NonZeroExitCodeError";
const COMMAND_TIMEOUT: &str = "swerex.exceptions.CommandTimeoutError";
const BAD_SYNTAX: &str = "swerex.exceptions.BashIncorrectSyntaxError";

/// How a SWE-ReX call fails, in the protocol's own terms (`api/swerex.rs` gives each its
/// status and body).
#[derive(Debug)]
pub enum SwerexError {
    /// An exception the client re-raises as the same class (SWE-ReX's exception transfer).
    Exception {
        class_path: String,
        message: String,
        extra_info: Value,
    },
    /// The request is not SWE-ReX's model: FastAPI's validation error items.
    Validation(Value),
    /// The runner session is gone (what SWE-ReX's server says of a runtime that is).
    NoSession(String),
    /// The request body is over the limit.
    TooLarge,
}

impl SwerexError {
    pub(super) fn exception(class_path: &str, message: impl Into<String>) -> Self {
        SwerexError::Exception {
            class_path: class_path.to_string(),
            message: message.into(),
            extra_info: json!({}),
        }
    }

    /// A request body that is not the model (one validation item about the body).
    pub fn invalid(message: impl std::fmt::Display) -> Self {
        SwerexError::Validation(
            json!([{"type": "value_error", "loc": ["body"], "msg": message.to_string(), "input": null}]),
        )
    }

    /// A form field the request lacks.
    pub fn missing(field: &str) -> Self {
        SwerexError::Validation(
            json!([{"type": "missing", "loc": ["body", field], "msg": "Field required", "input": null}]),
        )
    }
}

impl From<ServiceError> for SwerexError {
    /// A failure of our own service as SWE-ReX shows a failing runtime.
    fn from(e: ServiceError) -> Self {
        match e {
            ServiceError::NotFound { kind: "session", name } => SwerexError::NoSession(name),
            e @ ServiceError::Internal { .. } => {
                tracing::error!(error = %e, "SWE-ReX request failed");
                SwerexError::exception(SWEREX_EXCEPTION, "internal error")
            }
            e @ ServiceError::Invalid(Invalid::Field { .. }) => {
                SwerexError::exception("builtins.ValueError", e.to_string())
            }
            e => SwerexError::exception(SWEREX_EXCEPTION, e.to_string()),
        }
    }
}

/// A session's SWE-ReX state: its bash sessions, where the sandbox sees the workspace, and the
/// last response (SWE-ReX replays it for a retried `X-Request-ID`).
#[derive(Default)]
pub struct Swerex {
    state: Mutex<State>,
    next_shell: AtomicU64,
}

#[derive(Default)]
struct State {
    /// SWE-ReX session name → our shell.
    shells: HashMap<String, Shell>,
    /// SWE-ReX session name → its terminal, while an interactive program runs there.
    terminals: HashMap<String, std::sync::Arc<tokio::sync::Mutex<interactive::Interactive>>>,
    /// Where the sandbox sees the workspace (containerd sessions; found once).
    workdir: Option<String>,
    /// The last answer: its request id, status and body.
    last: Option<(String, u16, Bytes)>,
}

/// One SWE-ReX bash session.
#[derive(Clone)]
struct Shell {
    /// Our shell's name.
    name: String,
    /// `$?` when the next command starts.
    status: i32,
}

impl Swerex {
    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        f(&mut self.state.lock().expect("swerex lock"))
    }

    /// The answer given to `request_id` last, if it was the last one answered.
    pub fn replayed(&self, request_id: &str) -> Option<(u16, Bytes)> {
        self.with(|s| match &s.last {
            Some((rid, status, body)) if rid == request_id => Some((*status, body.clone())),
            _ => None,
        })
    }

    /// Keep an answer for a retry of `request_id` (not one over `REPLAY_LIMIT`).
    pub fn remember(&self, request_id: String, status: u16, body: Bytes) {
        if body.len() <= REPLAY_LIMIT {
            self.with(|s| s.last = Some((request_id, status, body)));
        }
    }

    fn shell(&self, session: &str) -> Result<Shell, SwerexError> {
        self.with(|s| s.shells.get(session).cloned()).ok_or_else(|| {
            SwerexError::exception(
                SESSION_MISSING,
                format!("session {} does not exist", python::py_repr(session)),
            )
        })
    }

    fn new_shell_name(&self) -> String {
        format!("swerex-{}", self.next_shell.fetch_add(1, Ordering::Relaxed))
    }
}

/// Seconds as a duration our runtime takes (at least 1 ms, at most runner's longest).
fn duration(seconds: Option<f64>) -> std::time::Duration {
    let max = crate::manifest::MAX_TIMEOUT_SECONDS as f64;
    match seconds {
        Some(s) if s.is_finite() => std::time::Duration::from_secs_f64(s.clamp(0.001, max)),
        _ => std::time::Duration::from_secs_f64(max),
    }
}
