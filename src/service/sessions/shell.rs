//! The stateful shell: named shells whose cwd, exported variables and (with bash) functions
//! persist between calls.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use super::Session;
use super::output::ShellOutput;
use super::resident::{Resident, Unanswered};
use crate::runtime::ExecRequest;
use crate::service::{Invalid, ServiceError};

/// Default per-call limit when a request sets none.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(300);

/// Where a sandbox keeps its shells' state (a host session gets a private directory instead:
/// host sessions share the host's /tmp).
pub(super) const SANDBOX_SHELL_DIR: &str = "/tmp/.runner-shell";

/// `$runner_f` (the state file's path) is visible to the command: the SWE-ReX face
/// (`api/swerex.rs`) keeps its plain variables beside it.
///
/// The shell's state lives in a file in the sandbox; each call sources it, runs the command
/// (stdin from /dev/null, stderr into the output), and saves it again. A command that times
/// out is killed with its process group and leaves the state as it was: the shell stays
/// usable. bash when the image has it (functions persist), else sh. The common path forks
/// only `mv` (the state file is replaced atomically): no mkdir, no sed.
const SHELL_SCRIPT: &str = r#"runner_f="$RUNNER_SHELL_DIR/$RUNNER_SHELL_NAME.sh"
runner_cmd=$RUNNER_SHELL_CMD
[ -d "$RUNNER_SHELL_DIR" ] || mkdir -p "$RUNNER_SHELL_DIR" 2>/dev/null
unset RUNNER_SHELL_CMD RUNNER_SHELL_NAME RUNNER_SHELL_DIR
if [ -f "$runner_f" ]; then . "$runner_f" >/dev/null 2>&1; fi
eval "$runner_cmd" </dev/null 2>&1
runner_rc=$?
{
  export -p
  if [ -n "$BASH_VERSION" ]; then declare -f; fi
  runner_p=${PWD:-$(pwd)}
  case $runner_p in
    *\'*) printf 'cd %s\n' "'$(printf '%s' "$runner_p" | sed "s/'/'\\\\''/g")'" ;;
    *) printf "cd '%s'\n" "$runner_p" ;;
  esac
} >"$runner_f.tmp" 2>/dev/null && mv "$runner_f.tmp" "$runner_f"
exit $runner_rc"#;

/// What to do when the command fails.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Check {
    /// Answer with its output and exit code.
    #[default]
    Ignore,
    /// Fail the call (`Invalid::Failed`, carrying the output).
    Raise,
}

impl std::str::FromStr for Check {
    type Err = ServiceError;
    fn from_str(s: &str) -> Result<Self, ServiceError> {
        match s {
            "ignore" => Ok(Check::Ignore),
            "raise" => Ok(Check::Raise),
            other => Err(ServiceError::field("check", format!("{other:?} (ignore or raise)"))),
        }
    }
}

#[derive(Clone, Debug)]
pub struct ShellRequest {
    pub command: String,
    pub timeout: Option<Duration>,
    pub check: Check,
    /// Several named shells per session; default `default`.
    pub name: Option<String>,
}

/// How long an adopted shell's hello waits for a first call to read its answer (one that
/// comes sooner sends its command first); later calls find it read.
const HELLO_READ_AFTER: Duration = Duration::from_millis(10);

/// Said first when a call found its shell gone and ran in a new one.
pub const SHELL_GONE: &str =
    "runner: the shell had exited since the last call; this command ran in a new one (its state is lost)\n";

impl Session {
    /// Run a command in one of the session's shells.
    pub async fn shell(&self, request: ShellRequest) -> Result<ShellOutput, ServiceError> {
        let name = request.name.unwrap_or_else(|| "default".into());
        if name.is_empty()
            || name.len() > 63
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(ServiceError::field("name", "letters, digits, '-' and '_' (at most 63)"));
        }
        if request.command.contains('\0') {
            return Err(ServiceError::field("command", "a NUL byte (a shell cannot run it)"));
        }
        if self.runtime.sandbox().is_some() {
            let slot = self.shell_slot(&name);
            let (runtime, limit) = (self.runtime.clone(), self.output_limit);
            let timeout = request.timeout.unwrap_or(DEFAULT_CALL_TIMEOUT);
            // The call owns the shell in a task of its own: a caller that goes away (an HTTP
            // client disconnecting) cannot leave the shell in the middle of a call.
            let call = tokio::spawn(async move {
                let sandbox = runtime.sandbox().expect("a sandbox runtime");
                let mut shell = slot.lock().await;
                if shell.is_none() {
                    match Resident::start(runtime.as_ref(), sandbox, &name).await {
                        Ok(started) => *shell = Some(started),
                        Err(e) => {
                            Resident::remove_files(sandbox, &name);
                            return Err(e);
                        }
                    }
                }
                let resident = shell.as_mut().expect("the shell just started");
                let ran = resident.run(sandbox, &request.command, timeout, limit).await;
                let (output, alive) = match ran {
                    // An adopted shell that did not answer its hello (the call's command
                    // was sent behind it): killed, and the command runs in a new shell when
                    // it cannot have started in that one (its state was a new shell's).
                    Err(e) if resident.hello_failed().is_some() => {
                        let failed = resident.hello_failed();
                        if let Some(dead) = shell.take() {
                            dead.stop(sandbox);
                        }
                        // Said to the caller (503: the next call starts a new shell).
                        if failed == Some(Unanswered::Late) {
                            return Err(ServiceError::Unavailable {
                                what: "the session's shell",
                                reason: format!(
                                    "{e}: it did not answer its start in time and was killed; the command may have started, and the next call starts a new shell (its state is lost)"
                                ),
                            });
                        }
                        let mut fresh = match Resident::start(runtime.as_ref(), sandbox, &name).await {
                            Ok(fresh) => fresh,
                            Err(e) => {
                                Resident::remove_files(sandbox, &name);
                                return Err(e);
                            }
                        };
                        match fresh.run(sandbox, &request.command, timeout, limit).await {
                            Ok(ran) => {
                                *shell = Some(fresh);
                                ran
                            }
                            Err(e) => {
                                fresh.stop(sandbox);
                                return Err(e);
                            }
                        }
                    }
                    // The shell exited after its last answer: the command runs in a new one,
                    // and the answer says the state is lost (never a 500, never silence).
                    Err(_) if resident.gone() => {
                        if let Some(dead) = shell.take() {
                            dead.stop(sandbox);
                        }
                        let mut fresh = Resident::start(runtime.as_ref(), sandbox, &name).await?;
                        let (mut output, alive) = fresh.run(sandbox, &request.command, timeout, limit).await?;
                        output.output = format!("{SHELL_GONE}{}", output.output);
                        *shell = Some(fresh);
                        (output, alive)
                    }
                    other => other?,
                };
                if !alive && let Some(dead) = shell.take() {
                    // What it left running (an orphaned command, background jobs) goes too.
                    dead.stop(sandbox);
                }
                Ok(output)
            });
            let output = call.await.map_err(|e| ServiceError::internal("a shell call", e))??;
            return checked(output, request.check);
        }
        let interpreter = self
            .shell_bin
            .get_or_try_init(|| async {
                let probe = ExecRequest {
                    argv: vec!["/bin/sh".into(), "-c".into(), "command -v bash || echo /bin/sh".into()],
                    timeout: Some(Duration::from_secs(10)),
                    ..Default::default()
                };
                let r = self.runtime.execute(probe).await?;
                Ok::<String, ServiceError>(r.stdout.lines().next().unwrap_or("/bin/sh").trim().to_string())
            })
            .await?
            .clone();
        let r = self
            .runtime
            .execute(ExecRequest {
                argv: vec![interpreter, "-c".into(), SHELL_SCRIPT.into()],
                stdin: None,
                timeout: Some(request.timeout.unwrap_or(DEFAULT_CALL_TIMEOUT)),
                env: BTreeMap::from([
                    ("RUNNER_SHELL_CMD".to_string(), request.command),
                    ("RUNNER_SHELL_NAME".to_string(), name),
                    ("RUNNER_SHELL_DIR".to_string(), self.shell_dir()),
                ]),
                cwd: None,
            })
            .await?;
        checked(
            ShellOutput {
                output: r.stdout,
                exit_code: r.exit_code,
                timed_out: r.timed_out,
                output_dropped_bytes: r.stdout_dropped_bytes,
            },
            request.check,
        )
    }
}

impl Session {
    pub(super) fn shell_slot(&self, name: &str) -> Arc<tokio::sync::Mutex<Option<Resident>>> {
        self.shells
            .lock()
            .expect("shells lock")
            .entry(name.to_string())
            .or_default()
            .clone()
    }

    /// Start a sandbox's `default` shell now, in the background, so that the first call finds
    /// it ready (a shell takes 3–7 ms to start, more than the call it precedes). The slot is
    /// taken before this returns: a call that comes first waits for this start instead of
    /// making a second shell. A start that fails is retried by the first call, which reports
    /// its error.
    pub(super) fn prestart_shell(&self) {
        if self.runtime.sandbox().is_none() {
            return;
        }
        let slot = self.shell_slot("default");
        let Ok(mut shell) = slot.clone().try_lock_owned() else {
            return;
        };
        let (runtime, id) = (self.runtime.clone(), self.id.clone());
        tokio::spawn(async move {
            let sandbox = runtime.sandbox().expect("a sandbox runtime");
            // A pool member's shell, started before the claim, is taken over: the first
            // call then finds the shell at once.
            let t0 = std::time::Instant::now();
            if let Some(adoptable) = sandbox.adopt_shell() {
                match Resident::adopt(sandbox, &adoptable).await {
                    Ok(adopted) => {
                        // Its answer is read by the first call, which sends its command
                        // behind the hello, or, when none comes soon, here.
                        *shell = Some(adopted);
                        claim_phase("shell hello sent", t0);
                        drop(shell);
                        tokio::time::sleep(HELLO_READ_AFTER).await;
                        // A call (or a checkpoint) holding the shell reads the answer itself.
                        let Ok(held) = slot.try_lock_owned() else { return };
                        shell = held;
                        let greeted = match shell.as_mut() {
                            Some(adopted) if adopted.hello_pending() => adopted.greeted(sandbox).await,
                            _ => return,
                        };
                        match greeted {
                            Ok(()) => {
                                claim_phase("shell adopted", t0);
                                return;
                            }
                            Err(e) => {
                                if let Some(dead) = shell.take() {
                                    dead.stop(sandbox);
                                }
                                tracing::warn!(session = id, error = %e, "the pool member's shell did not answer its hello; starting one");
                            }
                        }
                    }
                    Err(e) => {
                        // Gone first: a shell left running could open the new shell's input
                        // (busybox's sh opens it by name) and take its lines.
                        if let Some(pid) = adoptable.pid {
                            sandbox.signal_group(pid, nix::sys::signal::Signal::SIGKILL);
                        }
                        Resident::remove_files(sandbox, &adoptable.name);
                        tracing::warn!(session = id, error = %e, "adopting the pool member's shell; starting one");
                    }
                }
            }
            if shell.is_none() {
                match Resident::start(runtime.as_ref(), sandbox, "default").await {
                    Ok(started) => {
                        *shell = Some(started);
                        claim_phase("shell started", t0);
                    }
                    Err(e) => {
                        Resident::remove_files(sandbox, "default");
                        tracing::debug!(session = id, error = %e, "starting the default shell ahead of its first call");
                    }
                }
            }
        });
    }

    /// End a named shell: a resident one is killed with what it started (a later call with the
    /// name starts a new one); a per-call one forgets its state.
    pub async fn close_shell(&self, name: &str) {
        if let Some(sandbox) = self.runtime.sandbox() {
            let slot = self.shells.lock().expect("shells lock").remove(name);
            if let Some(slot) = slot
                && let Some(shell) = slot.lock().await.take()
            {
                shell.stop(sandbox);
            }
        } else if let Some(dir) = &self.host_shell_dir {
            let _ = std::fs::remove_file(dir.path().join(format!("{name}.sh")));
            let _ = std::fs::remove_file(dir.path().join(format!("{name}.sh.swerex")));
        }
    }
}

/// One phase of a session's creation, for `scripts/claim-phases.sh` (with
/// `RUNNER_LOG=runner=debug`).
pub(super) fn claim_phase(phase: &'static str, since: std::time::Instant) {
    tracing::debug!(phase, ms = since.elapsed().as_secs_f64() * 1e3, "claim phase");
}

fn checked(output: ShellOutput, check: Check) -> Result<ShellOutput, ServiceError> {
    if check == Check::Raise && (output.exit_code != Some(0) || output.timed_out) {
        return Err(ServiceError::Invalid(Invalid::Failed(Box::new(output))));
    }
    Ok(output)
}
