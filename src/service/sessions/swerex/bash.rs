//! SWE-ReX's bash sessions, each one of the session's named shells.

use serde_json::json;

use super::models::{
    Action, Bash, BashAction, BashObservation, CheckMode, CloseBashSessionRequest, CloseBashSessionResponse,
    CreateBashSessionRequest, CreateBashSessionResponse,
};
use super::python::{py_float, py_repr, sh_quote, strip_ansi};
use super::{
    BAD_SYNTAX, COMMAND_TIMEOUT, NON_ZERO_EXIT, SESSION_EXISTS, SESSION_MISSING, Shell, SwerexError, duration,
};
use crate::service::sessions::{Check, Session, ShellRequest};

/// What SWE-ReX's bash session answers as `expect_string` when its prompt ended a command.
const PS1: &str = "SHELLPS1PREFIX";
/// Starts the output of a command that failed the syntax check (see `WRAPPER`).
const SYNTAX_MARK: &str = "\u{1e}RUNNER-SWEREX-SYNTAX ";

/// Runs one SWE-ReX command in our shell, after `__rx_c='<the command>'` (and `__rx_q=N` when
/// the command should start with `$?` at N, as after a failure under `check="ignore"`, where
/// SWE-ReX does not reset it by asking for the exit code). Like SWE-ReX, it first checks the
/// syntax with `bash -n`, and runs nothing when that fails (reported after `SYNTAX_MARK`, with
/// bash's exit code and messages). A sandbox's shell is resident and keeps every shell
/// variable, as SWE-ReX's does. A host session's shell runs per call and keeps exported
/// variables, functions and the directory; there every other shell variable is kept too
/// (`declare -p`), next to the shell's state file (`$runner_f`, unset in a resident shell), and
/// restored before the command (read-only and special ones are refused or ignored by bash,
/// silently). No process is forked but the syntax check. Without bash (an image with only
/// `sh`) the command just runs; the script stays POSIX (the here-string is only parsed by bash).
/// The wrapper's own variables are unset again, so the shell shows only the user's.
const WRAPPER: &str = r#"__rx_s=${runner_f:+$runner_f.swerex}
__rx_n=0
if [ -n "${BASH_VERSION:-}" ] && command -v bash >/dev/null 2>&1; then
  __rx_t=${__rx_s:-${TMPDIR:-/tmp}/.runner-swerex-$$}.err
  eval 'bash -n 2>"$__rx_t" <<<"$__rx_c"'
  __rx_n=$?
  if [ -z "$__rx_s" ] || [ "$__rx_n" != 0 ]; then __rx_e=$(cat -- "$__rx_t"; echo x); rm -f -- "$__rx_t"; fi
fi
if [ "$__rx_n" != 0 ]; then
  printf '\036RUNNER-SWEREX-SYNTAX %s\n%s' "$__rx_n" "${__rx_e%x}"
  unset __rx_n __rx_t __rx_e __rx_s
else
  unset __rx_n __rx_t __rx_e
  if [ -n "$__rx_s" ] && [ -f "$__rx_s" ]; then . "$__rx_s" >/dev/null 2>&1; fi
  eval "unset __rx_c __rx_q __rx_s; ${__rx_q:+(exit $__rx_q); }$__rx_c
"
  __rx_r=$?
  if [ -n "${runner_f:-}" ] && [ -n "${BASH_VERSION:-}" ]; then declare -p >"$runner_f.swerex" 2>/dev/null; fi
  __rx_x() { unset -f __rx_x; unset __rx_r; return "$1"; }
  __rx_x "$__rx_r"
fi"#;

/// The command as the wrapper is given it, to start with `$?` at `status`.
fn wrap(command: &str, status: i32) -> String {
    match status {
        0 => format!("__rx_c={}\n{WRAPPER}", sh_quote(command)),
        n => format!("__rx_c={}\n__rx_q={n}\n{WRAPPER}", sh_quote(command)),
    }
}

fn observation(output: String, exit_code: Option<i32>) -> BashObservation {
    observation_with(output, exit_code, PS1)
}

/// An observation whose command ended at `expect_string`.
pub(super) fn observation_with(output: String, exit_code: Option<i32>, expect_string: &str) -> BashObservation {
    BashObservation {
        output,
        exit_code,
        failure_reason: String::new(),
        expect_string: expect_string.into(),
        session_type: Bash::Bash,
    }
}

impl Session {
    /// `create_session`: a fresh shell, its startup files sourced.
    pub async fn swerex_create_session(
        &self,
        request: CreateBashSessionRequest,
    ) -> Result<CreateBashSessionResponse, SwerexError> {
        let shell = self.swerex.new_shell_name();
        let taken = self.swerex.with(|r| {
            if r.shells.contains_key(&request.session) {
                return true;
            }
            r.shells.insert(
                request.session.clone(),
                Shell {
                    name: shell.clone(),
                    status: 0,
                },
            );
            false
        });
        if taken {
            return Err(SwerexError::exception(
                SESSION_EXISTS,
                format!("session {} already exists", request.session),
            ));
        }
        let mut output = String::new();
        if !request.startup_source.is_empty() {
            let command = request
                .startup_source
                .iter()
                .map(|path| format!("source {path}"))
                .collect::<Vec<_>>()
                .join(" ; ");
            let started = self
                .shell(ShellRequest {
                    command: wrap(&command, 0),
                    timeout: Some(duration(Some(request.startup_timeout))),
                    check: Check::Ignore,
                    name: Some(shell),
                })
                .await;
            let failed = match started {
                Ok(out) if out.timed_out => Some(SwerexError::exception(
                    "pexpect.exceptions.TIMEOUT",
                    format!(
                        "Timeout exceeded: the startup commands took longer than {} seconds",
                        py_float(request.startup_timeout)
                    ),
                )),
                Ok(out) => {
                    output = strip_ansi(&out.output);
                    None
                }
                Err(e) => Some(e.into()),
            };
            if let Some(e) = failed {
                self.swerex.with(|r| r.shells.remove(&request.session));
                return Err(e);
            }
        }
        Ok(CreateBashSessionResponse {
            output,
            session_type: Bash::Bash,
        })
    }

    /// `run_in_session`: a command, or an interrupt (nothing runs between calls in our shell:
    /// there is nothing to interrupt).
    pub async fn swerex_run_in_session(&self, action: Action) -> Result<BashObservation, SwerexError> {
        match action {
            Action::Interrupt(action) => {
                self.swerex.shell(&action.session)?;
                match self.swerex_interrupt(&action).await? {
                    Some(observation) => Ok(observation),
                    None => Ok(observation(String::new(), Some(0))),
                }
            }
            Action::Bash(action) => {
                let shell = self.swerex.shell(&action.session)?;
                self.run_bash(&shell, action).await
            }
        }
    }

    /// Run a command; `$?` for the next one is kept (unless the syntax check failed or the
    /// command timed out, which leave SWE-ReX's `$?` as it was).
    async fn run_bash(&self, shell: &Shell, action: BashAction) -> Result<BashObservation, SwerexError> {
        if action.is_interactive_command || action.is_interactive_quit {
            return self.swerex_interactive(shell, action).await;
        }
        let out = self
            .shell(ShellRequest {
                command: wrap(&action.command, shell.status),
                timeout: Some(duration(action.timeout)),
                check: Check::Ignore,
                name: Some(shell.name.clone()),
            })
            .await?;
        if out.timed_out {
            // As SWE-ReX says it; unlike SWE-ReX's, the shell stays usable.
            return Err(SwerexError::exception(
                COMMAND_TIMEOUT,
                format!(
                    "timeout after {} seconds while running command {}",
                    action.timeout.map_or("None".to_string(), py_float),
                    py_repr(action.command.trim())
                ),
            ));
        }
        if let Some(rest) = out.output.strip_prefix(SYNTAX_MARK) {
            let (code, stderr) = rest.split_once('\n').unwrap_or((rest, ""));
            return Err(SwerexError::Exception {
                class_path: BAD_SYNTAX.into(),
                message: format!(
                    "Error (exit code {code}) while checking bash command \n{}\n---- Stderr ----\n{stderr}\n---- Stdout ----\n",
                    py_repr(&action.command)
                ),
                extra_info: json!({"bash_stdout": "", "bash_stderr": stderr}),
            });
        }
        // SWE-ReX asks for the exit code with another command, which leaves `$?` at 0.
        let status = match action.check {
            CheckMode::Ignore => out.exit_code.unwrap_or(0) & 0xff,
            _ => 0,
        };
        self.swerex.with(|r| {
            if let Some(s) = r.shells.values_mut().find(|s| s.name == shell.name) {
                s.status = status;
            }
        });
        let output = strip_ansi(&out.output);
        if action.check == CheckMode::Raise && out.exit_code != Some(0) {
            let mut message = format!(
                "Command {} failed with exit code {}. Here is the output:\n{}",
                py_repr(&action.command),
                out.exit_code.map_or("None".to_string(), |c| c.to_string()),
                py_repr(&output)
            );
            if !action.error_msg.is_empty() {
                message = format!("{}: {message}", action.error_msg);
            }
            return Err(SwerexError::exception(NON_ZERO_EXIT, message));
        }
        let exit_code = match action.check {
            CheckMode::Ignore => None,
            _ => out.exit_code,
        };
        Ok(observation(output, exit_code))
    }

    /// `close_session`: its shell ends.
    pub async fn swerex_close_session(
        &self,
        request: CloseBashSessionRequest,
    ) -> Result<CloseBashSessionResponse, SwerexError> {
        let shell = self.swerex.with(|r| r.shells.remove(&request.session)).ok_or_else(|| {
            SwerexError::exception(
                SESSION_MISSING,
                format!("session {} does not exist", py_repr(&request.session)),
            )
        })?;
        self.swerex_close_terminal(&request.session).await;
        self.close_shell(&shell.name).await;
        Ok(CloseBashSessionResponse {
            session_type: Bash::Bash,
        })
    }

    /// `close`: every bash session ends (the runner session itself stays).
    pub async fn swerex_close(&self) {
        let shells = self.swerex.with(|r| std::mem::take(&mut r.shells));
        for session in shells.keys() {
            self.swerex_close_terminal(session).await;
        }
        for shell in shells.into_values() {
            self.close_shell(&shell.name).await;
        }
    }
}
