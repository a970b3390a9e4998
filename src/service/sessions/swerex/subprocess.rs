//! `execute`: `subprocess.run` in the sandbox, as SWE-ReX's runtime runs it.

use std::collections::BTreeMap;

use super::models::{Command, CommandLine, CommandResponse};
use super::python::{os_error, py_float, py_repr};
use super::{COMMAND_TIMEOUT, NON_ZERO_EXIT, SWEREX_EXCEPTION, SwerexError, duration};
use crate::runtime::{ExecRequest, ExecResult};
use crate::service::sessions::Session;
use crate::service::{Invalid, ServiceError};

impl Session {
    /// A string with `shell` is `/bin/sh -c`, without it a program's name; `env` replaces the
    /// environment; `merge_output_streams` sends stderr to stdout.
    pub async fn swerex_execute(&self, command: Command) -> Result<CommandResponse, SwerexError> {
        let mut argv: Vec<String> = match (&command.command, command.shell) {
            (CommandLine::Text(s), true) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
            (CommandLine::Argv(a), true) => ["/bin/sh".to_string(), "-c".into()]
                .into_iter()
                .chain(a.clone())
                .collect(),
            (CommandLine::Text(s), false) => vec![s.clone()],
            (CommandLine::Argv(a), false) => a.clone(),
        };
        if argv.first().is_none_or(|p| p.is_empty()) {
            return Err(SwerexError::exception("builtins.ValueError", "the command is empty"));
        }
        let program = argv[0].clone();
        if let Some(env) = &command.env {
            let pairs = env.iter().map(|(k, v)| format!("{k}={v}"));
            argv = ["env".to_string(), "-i".into()]
                .into_iter()
                .chain(pairs)
                .chain(argv)
                .collect();
        }
        if command.merge_output_streams {
            argv = ["/bin/sh", "-c", "exec \"$@\" 2>&1", "sh"]
                .into_iter()
                .map(String::from)
                .chain(argv)
                .collect();
        }
        let request = ExecRequest {
            argv,
            stdin: None,
            timeout: command.timeout.map(|t| duration(Some(t))),
            env: BTreeMap::new(),
            cwd: command.cwd.clone(),
        };
        let result = match self.exec(request).await {
            Ok(r) => r,
            // A program the host could not start (the host backend's own spawn): its errno.
            Err(ServiceError::Invalid(Invalid::CannotStart { source, .. })) => {
                return Err(match source.raw_os_error() {
                    Some(errno) => os_error(errno, &program),
                    None => SwerexError::exception(SWEREX_EXCEPTION, source.to_string()),
                });
            }
            Err(e) => return Err(e.into()),
        };
        if !command.shell && not_started(&result, &program) {
            return Err(os_error(libc::ENOENT, &program));
        }
        if result.timed_out {
            return Err(SwerexError::exception(
                COMMAND_TIMEOUT,
                format!(
                    "Timeout ({}s) exceeded while running command",
                    command.timeout.map_or("None".to_string(), py_float)
                ),
            ));
        }
        // As Python's returncode: negative for a signal.
        let exit_code = result.exit_code.or(result.signal.map(|s| -s));
        if command.check && exit_code != Some(0) {
            let shown = match &command.command {
                CommandLine::Text(s) => py_repr(s),
                CommandLine::Argv(a) => format!("[{}]", a.iter().map(|s| py_repr(s)).collect::<Vec<_>>().join(", ")),
            };
            let mut message = format!(
                "Command {shown} failed with exit code {}. Stdout:\n{}\nStderr:\n{}",
                exit_code.map_or("None".to_string(), |c| c.to_string()),
                py_repr(&result.stdout),
                py_repr(&result.stderr)
            );
            if !command.error_msg.is_empty() {
                message = format!("{}: {message}", command.error_msg);
            }
            return Err(SwerexError::exception(NON_ZERO_EXIT, message));
        }
        Ok(CommandResponse {
            stdout: result.stdout,
            stderr: result.stderr,
            exit_code,
        })
    }
}

/// Whether a program was not found where a shell, not `execve`, looked for it: in a container
/// (the agent's `exec`), or behind `env -i`. `subprocess` raises `FileNotFoundError` then.
/// (The shell's own words are all there is: the sandbox's `exec` fails inside the sandbox.)
fn not_started(result: &ExecResult, program: &str) -> bool {
    let said = format!("{}{}", result.stdout, result.stderr);
    let last = said.trim_end().lines().last().unwrap_or("");
    result.exit_code == Some(127)
        && ((last.contains("exec") && last.ends_with(&format!("{program}: not found")))
            || (last.starts_with("env: ") && last.contains(program) && last.ends_with("No such file or directory")))
}
