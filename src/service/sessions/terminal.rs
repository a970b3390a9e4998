//! Terminals of a session: a command on a pseudo-terminal in the sandbox (the image's shell
//! unless one is named), beside the session's other calls. What holds a terminal open (the
//! API's WebSocket) holds a lease, so a session with an open terminal is never idle.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::Session;
use crate::runtime::pty::{Pty, PtyRequest, PtySize};
use crate::service::ServiceError;

/// Terminals open at once in one session: each holds an exec process (a shim's copy loops)
/// and two FIFOs on the host.
pub const MAX_TERMINALS: usize = 16;

/// What runs when no command is named: bash when the image has it, else `sh`, as a login
/// shell would be (interactive, on the terminal).
pub const DEFAULT_SHELL: &[&str] = &[
    "/bin/sh",
    "-c",
    "if command -v bash >/dev/null 2>&1; then exec bash -i; else exec sh -i; fi",
];

/// A terminal to open.
#[derive(Clone, Debug, Default)]
pub struct TerminalRequest {
    /// Empty: [`DEFAULT_SHELL`].
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub size: PtySize,
}

/// An open terminal; the session's count of open terminals drops with it.
pub struct Terminal {
    pub pty: Pty,
    _slot: Slot,
}

struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Session {
    /// Start a command on a new terminal in the sandbox (at most [`MAX_TERMINALS`] at once).
    pub async fn open_terminal(&self, request: TerminalRequest) -> Result<Terminal, ServiceError> {
        let argv = if request.command.is_empty() {
            DEFAULT_SHELL.iter().map(|s| s.to_string()).collect()
        } else {
            request.command
        };
        if argv[0].is_empty() {
            return Err(ServiceError::field("command", "must not be empty"));
        }
        if let Some(cwd) = &request.cwd {
            crate::manifest::paths::check_lexical(cwd).map_err(|e| ServiceError::field("cwd", e.to_string()))?;
        }
        for k in request.env.keys() {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(ServiceError::field(
                    "env",
                    format!("{k:?} is not a valid variable name"),
                ));
            }
        }
        if self.terminals.fetch_add(1, Ordering::SeqCst) >= MAX_TERMINALS {
            self.terminals.fetch_sub(1, Ordering::SeqCst);
            return Err(ServiceError::Conflict(format!(
                "session {} has {MAX_TERMINALS} terminals open already (close one first)",
                self.id
            )));
        }
        let slot = Slot(self.terminals.clone());
        let pty = self
            .runtime
            .open_pty(PtyRequest {
                argv,
                env: request.env,
                cwd: request.cwd,
                size: request.size,
            })
            .await?;
        Ok(Terminal { pty, _slot: slot })
    }

    /// Terminals open now.
    pub fn open_terminals(&self) -> usize {
        self.terminals.load(Ordering::SeqCst)
    }
}
