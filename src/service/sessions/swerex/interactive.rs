//! SWE-ReX's interactive commands (`is_interactive_command`, `is_interactive_quit`, `expect`)
//! and interrupts, on a terminal: SWE-ReX's LocalRuntime runs its bash on a pseudo-terminal
//! and, for an interactive command, types the line and waits for one of the `expect` strings
//! or its prompt, leaving the program running for the next line (a REPL, a pager, a prompt).
//! Our shells run each command to its end without a terminal, so a bash session's first
//! interactive command starts a bash on a terminal in the sandbox (the session's terminals),
//! in the resident shell's directory with its exported variables; the following interactive
//! lines go to it, and once its prompt is back (the program quit, or an interrupt reached
//! it) the terminal is closed and the session's resident shell takes the commands again.
//!
//! As LocalRuntime: the echoed line is cut from an interactive command's output, ANSI
//! sequences are stripped and CRLF is LF, the exit code is 0, `expect_string` is what
//! matched. `expect` strings are regular expressions, as pexpect's (Rust's syntax: no
//! look-around). Output held while waiting is bounded by `MAX_HELD`.

use std::time::Duration;

use regex::Regex;
use tokio::time::Instant;

use super::bash::observation_with;
use super::models::{BashAction, BashInterruptAction, BashObservation};
use super::python::{py_float, py_repr, sh_quote, strip_ansi};
use super::{COMMAND_TIMEOUT, Shell, SwerexError};
use crate::runtime::pty::PtySize;
use crate::service::sessions::terminal::{Terminal, TerminalRequest};
use crate::service::sessions::{Check, Session, ShellRequest};

/// SWE-ReX's prompt (PS1).
const PS1: &str = "SHELLPS1PREFIX";
/// What LocalRuntime types after an interactive program quit, and waits for.
const UNIQUE: &str = "UNIQUESTRING29234";
/// Output kept while waiting for an expected string (the oldest is dropped past it).
const MAX_HELD: usize = 1 << 20;
/// After an interrupt, what follows is read for this long (as LocalRuntime does).
const FOLLOWING: Duration = Duration::from_millis(500);

/// A bash session's terminal and what it printed that was not yet answered.
pub(super) struct Interactive {
    terminal: Terminal,
    held: String,
}

impl Interactive {
    /// Read until one of `patterns` appears, within `timeout`: its index and the output
    /// before it (what follows stays held). `None` on timeout or when the terminal ended.
    async fn expect(&mut self, patterns: &[Regex], timeout: Duration) -> Option<(usize, String)> {
        let deadline = Instant::now() + timeout;
        loop {
            // The earliest match in the output; of two at one place, the first pattern.
            let found = patterns
                .iter()
                .enumerate()
                .filter_map(|(i, p)| p.find(&self.held).map(|m| (m.start(), i, m.end())))
                .min();
            if let Some((at, i, end)) = found {
                let rest = self.held.split_off(end);
                let mut before = std::mem::replace(&mut self.held, rest);
                before.truncate(at);
                return Some((i, before));
            }
            let chunk = tokio::time::timeout_at(deadline, self.terminal.pty.read())
                .await
                .ok()??;
            self.held.push_str(&String::from_utf8_lossy(&chunk));
            if self.held.len() > MAX_HELD {
                let mut cut = self.held.len() - MAX_HELD;
                while !self.held.is_char_boundary(cut) {
                    cut += 1;
                }
                self.held.drain(..cut);
            }
        }
    }

    async fn send(&mut self, text: &str) -> Result<(), SwerexError> {
        self.terminal
            .pty
            .write(text.as_bytes())
            .await
            .map_err(|e| SwerexError::exception(super::SWEREX_EXCEPTION, format!("writing to the terminal: {e}")))
    }

    /// What is printed within `wait`, held output first.
    async fn following(&mut self, wait: Duration) -> String {
        let deadline = Instant::now() + wait;
        while let Ok(Some(chunk)) = tokio::time::timeout_at(deadline, self.terminal.pty.read()).await {
            self.held.push_str(&String::from_utf8_lossy(&chunk));
        }
        std::mem::take(&mut self.held)
    }
}

/// `expect` strings and then the prompt, as patterns.
fn patterns(expect: &[String]) -> Result<Vec<Regex>, SwerexError> {
    let mut out = Vec::with_capacity(expect.len() + 1);
    for e in expect {
        out.push(
            Regex::new(e).map_err(|err| {
                SwerexError::exception(super::SWEREX_EXCEPTION, format!("expect {}: {err}", py_repr(e)))
            })?,
        );
    }
    out.push(literal(PS1));
    Ok(out)
}

fn literal(s: &str) -> Regex {
    Regex::new(&regex::escape(s)).expect("an escaped literal is a valid pattern")
}

fn clean(s: &str) -> String {
    strip_ansi(s).replace("\r\n", "\n")
}

/// The `expect` string (or the prompt) at `index`.
fn expect_string(expect: &[String], index: usize) -> &str {
    expect.get(index).map_or(PS1, String::as_str)
}

impl Session {
    /// The bash session's terminal, started (as the module says) when it has none.
    async fn swerex_terminal(
        &self,
        session: &str,
        shell: &Shell,
    ) -> Result<std::sync::Arc<tokio::sync::Mutex<Interactive>>, SwerexError> {
        if let Some(t) = self.swerex.with(|s| s.terminals.get(session).cloned()) {
            return Ok(t);
        }
        // The resident shell's directory and exported variables, for the terminal's bash: they
        // go in its environment (nothing is written in the sandbox, nothing typed but one line).
        let saved = self
            .shell(ShellRequest {
                command: "pwd && export -p".into(),
                timeout: Some(Duration::from_secs(10)),
                check: Check::Ignore,
                name: Some(shell.name.clone()),
            })
            .await?;
        let (pwd, exports) = saved.output.split_once('\n').unwrap_or((saved.output.as_str(), ""));
        if saved.exit_code != Some(0) || !pwd.starts_with('/') {
            return Err(SwerexError::exception(
                super::SWEREX_EXCEPTION,
                format!("reading the shell's state for a terminal: {}", saved.output),
            ));
        }
        let rc = format!("{exports}\ncd -- {}\n", sh_quote(pwd));
        let mut terminal = Interactive {
            terminal: self
                .open_terminal(TerminalRequest {
                    command: vec![
                        "/bin/sh".into(),
                        "-c".into(),
                        // Echo off, as pexpect's `echo=False` spawns LocalRuntime's bash: its
                        // readline echoes the lines it reads; the programs it runs do not.
                        "stty -echo 2>/dev/null; if command -v bash >/dev/null 2>&1; then exec bash --norc --noprofile; else exec sh; fi".into(),
                    ],
                    // TERM as SWE-ReX's server has it in a container (unset: readline takes
                    // it as dumb), so no bracketed-paste or colour sequences.
                    env: [
                        ("PS1", PS1),
                        ("PS2", ""),
                        ("PS0", ""),
                        ("TERM", "dumb"),
                        ("RUNNER_SWEREX_RC", &rc),
                    ]
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                    cwd: None,
                    size: PtySize::default(),
                })
                .await?,
            held: String::new(),
        };
        // One line sets it up; `READY` is printed by it (the echoed line shows `REA""DY`).
        terminal
            .send(&format!(
                "eval \"$RUNNER_SWEREX_RC\"; unset RUNNER_SWEREX_RC; export PS1='{PS1}' PS2='' PS0=''; echo REA\"\"DY\n"
            ))
            .await?;
        let ready = [literal("READY")];
        let prompt = [literal(PS1)];
        if terminal.expect(&ready, Duration::from_secs(10)).await.is_none()
            || terminal.expect(&prompt, Duration::from_secs(10)).await.is_none()
        {
            terminal.terminal.pty.close().await;
            return Err(SwerexError::exception(
                super::SWEREX_EXCEPTION,
                "the terminal's shell did not start",
            ));
        }
        let terminal = std::sync::Arc::new(tokio::sync::Mutex::new(terminal));
        self.swerex
            .with(|s| s.terminals.insert(session.to_string(), terminal.clone()));
        Ok(terminal)
    }

    /// End a bash session's terminal, if it has one.
    pub(super) async fn swerex_close_terminal(&self, session: &str) {
        if let Some(t) = self.swerex.with(|s| s.terminals.remove(session)) {
            t.lock().await.terminal.pty.close().await;
        }
    }

    /// An interactive command or quit, as LocalRuntime's `_run_interactive`.
    pub(super) async fn swerex_interactive(
        &self,
        shell: &Shell,
        action: BashAction,
    ) -> Result<BashObservation, SwerexError> {
        let terminal = self.swerex_terminal(&action.session, shell).await?;
        let mut t = terminal.lock().await;
        t.send(&format!("{}\n", action.command)).await?;
        let patterns = patterns(&action.expect)?;
        let timeout = super::duration(action.timeout);
        let Some((index, before)) = t.expect(&patterns, timeout).await else {
            return Err(SwerexError::exception(
                COMMAND_TIMEOUT,
                format!(
                    "timeout after {} seconds while running command {}",
                    action.timeout.map_or("None".to_string(), py_float),
                    py_repr(&action.command)
                ),
            ));
        };
        let mut output = clean(&before);
        let prompt_back = index == patterns.len() - 1;
        if action.is_interactive_quit {
            t.send(&format!("stty -echo; echo '{UNIQUE}'\n")).await?;
            let unique = [literal(UNIQUE)];
            let _ = t.expect(&unique, Duration::from_secs(1)).await;
            let _ = t.expect(&unique, Duration::from_secs(1)).await;
        } else {
            output = output
                .trim_start()
                .strip_prefix(action.command.as_str())
                .unwrap_or(output.trim_start())
                .trim()
                .to_string();
        }
        drop(t);
        if prompt_back {
            // The shell is at its prompt: the resident shell takes the next commands.
            self.swerex_close_terminal(&action.session).await;
        }
        Ok(observation_with(output, Some(0), expect_string(&action.expect, index)))
    }

    /// An interrupt of a bash session with a terminal, as LocalRuntime's: Ctrl-C until an
    /// `expect` string or the prompt shows (`n_retry` times), else Ctrl-Z and `kill -9 %1`.
    /// `None` when the session has no terminal (nothing runs between calls in our shells).
    pub(super) async fn swerex_interrupt(
        &self,
        action: &BashInterruptAction,
    ) -> Result<Option<BashObservation>, SwerexError> {
        let Some(terminal) = self.swerex.with(|s| s.terminals.get(&action.session).cloned()) else {
            return Ok(None);
        };
        let mut t = terminal.lock().await;
        let patterns = patterns(&action.expect)?;
        let timeout = super::duration(Some(action.timeout));
        let mut output = String::new();
        let mut matched = None;
        for _ in 0..action.n_retry {
            t.send("\x03").await?;
            if let Some((i, before)) = t.expect(&patterns, timeout).await {
                output.push_str(&clean(&before));
                matched = Some(i);
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if matched.is_none() {
            t.send("\x1a").await?;
            if let Some((_, before)) = t.expect(&patterns, timeout).await {
                output.push_str(&before);
            }
            t.send("kill -9 %1\n").await?;
            let Some((i, before)) = t.expect(&patterns, timeout).await else {
                return Err(SwerexError::exception(
                    "pexpect.exceptions.TIMEOUT",
                    "Failed to interrupt session",
                ));
            };
            output.push_str(&before);
            matched = Some(i);
        }
        let index = matched.unwrap_or(patterns.len() - 1);
        output.push_str(&clean(&t.following(FOLLOWING).await));
        drop(t);
        if index == patterns.len() - 1 {
            self.swerex_close_terminal(&action.session).await;
        }
        Ok(Some(observation_with(
            output.trim().to_string(),
            Some(0),
            expect_string(&action.expect, index),
        )))
    }
}
