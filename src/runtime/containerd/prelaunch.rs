//! A session's default shell, started in a pool member before anyone claims it: a claimed
//! session's first shell call then costs one line to a shell that is already there, instead
//! of an agent command, `sh`, `setsid` and `bash -i` starting after the claim (5–13 ms).
//!
//! The filler launches it exactly as a session launches its shells (`LAUNCH`, through the
//! agent, from the container's working directory) and marks the member (`MARKER`, in its run
//! directory, which the sandbox never sees). What is bound at the claim — the Environment's
//! variables, the workspace mounted over the working directory, the hostname — the session
//! hands the shell in its hello (`Sandbox::adopt_shell`), so that the shell's state is what a
//! shell started after the claim would have. When that cannot be promised (the Environment
//! runs setup at the claim, or sets a variable a shell reads only when it starts), the shell
//! is killed at the claim and the session starts its own, as a one-shot job does before its
//! command: every process of the member but its init goes.
//!
//! Before the claim no code of a job has run in the member: the FIFOs and the processes are
//! the filler's. Once claimed, everything is checked as the resident shell checks it.

use std::time::Duration;

use super::agent::{self, AGENT_MOUNT, Agent};
use super::io::OutputPump;
use super::{Created, Engine};
use crate::runtime::{AdoptableShell, FifoEnd, RuntimeError};
use crate::spec::{self, RunPlan};

/// Starts a resident shell detached from the launching command (which the agent waits for):
/// `setsid` forks when its caller leads a group, as the agent's commands do. Without `setsid`
/// the shell is an asynchronous list, so its commands inherit SIGINT ignored: a timeout then
/// escalates.
///
/// bash reads the FIFO as its stdin. Any other `sh` reads it as a script file (`sh -i FIFO`,
/// stdin /dev/null), still interactive: busybox's ash reads an interactive stdin that is no
/// terminal with stdio's `fgets`, and a signal it catches while waiting there (SIGCHLD: a
/// background job ending between calls) fails that read with EINTR, which ash takes for the
/// end of its input, and exits. A script file it reads with `read(2)`, retried on EINTR.
///
/// Both FIFOs are opened read-write (`<>`): the opens never wait for the host, so a shell can
/// be started before any host process holds the other ends (a pool member's, by a filler that
/// exits), and bash sees no EOF between the filler and the claimant. The host still sees EOF
/// on the status FIFO when the shell is gone: the shell's is then its only other end.
pub const LAUNCH: &str = r#"runner_in=$1 runner_st=$2
if runner_i=$(command -v bash); then set -- "$runner_i" --norc --noprofile --noediting -i; runner_src=$runner_in
else set -- /bin/sh -i "$runner_in"; runner_src=/dev/null; fi
if command -v setsid >/dev/null 2>&1; then exec setsid "$@" 0<>"$runner_src" 4<>"$runner_st" >/dev/null 2>&1; fi
"$@" 0<>"$runner_src" 4<>"$runner_st" >/dev/null 2>&1 &"#;

/// The name of the shell a filler starts: the session's first.
pub const PRELAUNCHED: &str = "default";

/// The file of a resident shell's channel `what` (`in`, `st`, `N.out`) in the shared directory.
pub fn shell_file(name: &str, what: &str) -> String {
    format!("sh-{name}.{what}")
}

/// The argv that launches resident shell `name`.
pub fn launch_argv(name: &str) -> Vec<String> {
    vec![
        "/bin/sh".into(),
        "-c".into(),
        LAUNCH.into(),
        "runner".into(),
        format!("{AGENT_MOUNT}/{}", shell_file(name, "in")),
        format!("{AGENT_MOUNT}/{}", shell_file(name, "st")),
    ]
}

/// In a member's run directory: its shell was started.
const MARKER: &str = "shell";
/// The launch's agent request: far from the numbers a claimant's own requests take (from 0).
const LAUNCH_REQUEST: u64 = u64::MAX;
/// How long the launch may take (the filler's time, not a claim's).
const LAUNCH_LIMIT: Duration = Duration::from_secs(15);
/// How long the processes killed at a claim may take to be gone.
const KILL_LIMIT: Duration = Duration::from_secs(2);

/// Variables a shell reads (or sets) when it starts: one the Environment sets cannot be
/// handed to a running shell with the same effect, so a member's shell is not adopted then.
const AT_START: &[&str] = &[
    "ENV",
    "IFS",
    "PS4",
    "SHLVL",
    "PWD",
    "OLDPWD",
    "SECONDS",
    "RANDOM",
    "SRANDOM",
    "LINENO",
    "HISTCMD",
    "PPID",
    "UID",
    "EUID",
    "GROUPS",
    "POSIXLY_CORRECT",
    "SHELLOPTS",
    "_",
];

/// Why the Environment's variables cannot be handed to a running shell, if they cannot.
fn not_adoptable(env: &[(String, String)]) -> Option<String> {
    env.iter().find_map(|(k, _)| {
        let name = !k.is_empty()
            && k.bytes()
                .enumerate()
                .all(|(i, b)| b == b'_' || b.is_ascii_alphabetic() || (i > 0 && b.is_ascii_digit()));
        (!name || AT_START.contains(&k.as_str()) || k.starts_with("BASH")).then(|| format!("it sets {k}"))
    })
}

impl Engine {
    /// Start the default shell in a member the filler just started (`init_pid`: its init,
    /// host PID). A shell that does not start leaves the member as it was (nothing marked,
    /// nothing left running): its sessions start their shells after the claim.
    pub(super) async fn prelaunch_shell(&self, created: &Created, init_pid: u32) {
        let Some(agent) = &created.agent else { return };
        let launched = self.launch_in(created, agent, init_pid).await;
        if let Err(e) = launched {
            tracing::debug!(member = created.id, error = %e, "starting a shell in a pool member");
            end_processes(&created.cgroup, init_pid).await;
            for what in ["in", "st"] {
                agent.unlink(&shell_file(PRELAUNCHED, what));
            }
        }
    }

    async fn launch_in(&self, created: &Created, agent: &Agent, init_pid: u32) -> Result<(), RuntimeError> {
        for what in ["in", "st"] {
            drop(agent.fifo(&shell_file(PRELAUNCHED, what), FifoEnd::ReadWrite)?);
        }
        let cwd = created.process.cwd().to_string_lossy().into_owned();
        let name = agent::request_name(LAUNCH_REQUEST);
        let script = agent::command_script(&name, &launch_argv(PRELAUNCHED), &[], Some(&cwd));
        let req = agent.send(LAUNCH_REQUEST, &script, None)?;
        let pumps = OutputPump::capture(req.out, req.err, false, 4096);
        let status = tokio::time::timeout(LAUNCH_LIMIT, super::read_status(req.done)).await;
        let (_, err) = pumps.finish(Duration::from_millis(200), false).await;
        agent.remove(&name);
        match status {
            Ok(Some(0)) => {}
            Ok(other) => {
                return Err(RuntimeError::Internal(format!(
                    "the shell's launch ended with {other:?}: {}",
                    err.command.text.trim()
                )));
            }
            Err(_) => return Err(RuntimeError::Internal("the shell's launch did not end".into())),
        }
        // What the adopter would otherwise do after the shell's hello, on the claim's path.
        // The mark says the shell's PID once its slice is asked for (best effort, as the
        // adopter's: a kernel that refuses it now refuses it then); without it the adopter asks.
        let mark = match find_shell(&created.cgroup, init_pid, agent).and_then(|(host, ns_pid)| {
            crate::runtime::latency::request_slice(host, crate::runtime::latency::SHELL_SLICE)
                .map(|()| ns_pid)
                .map_err(|source| RuntimeError::Io {
                    what: "asking a short slice for the shell".into(),
                    source,
                })
        }) {
            Ok(ns_pid) => ns_pid.to_string(),
            Err(e) => {
                tracing::debug!(member = created.id, error = %e, "the member's shell keeps its slice until adopted");
                String::new()
            }
        };
        std::fs::write(self.run_dir.join(&created.id).join(MARKER), mark).map_err(|source| RuntimeError::Io {
            what: "marking the member's shell".into(),
            source,
        })
    }

    /// At a claim: whether member `id` holds a shell a filler started (the mark is taken, so
    /// this says it once), and the shell's PID in the sandbox when its slice was asked for.
    fn take_mark(&self, id: &str) -> Option<Option<i32>> {
        let path = self.run_dir.join(id).join(MARKER);
        // The filler's file, in the run directory the sandbox never sees: a PID or nothing
        // (read no further than a PID can be long).
        let pid = super::checkpoint::read_capped(&path, 16)
            .ok()
            .and_then(|text| String::from_utf8_lossy(&text).trim().parse().ok());
        std::fs::remove_file(&path).is_ok().then_some(pid)
    }

    /// At a one-shot job's claim, before its command: the member's shell goes (with every
    /// process of the member but its init), so the job finds what a cold container has.
    pub(super) async fn end_prelaunched(&self, id: &str, cgroup: &str, init_pid: u32, agent: &Agent) {
        if self.take_mark(id).is_some() {
            end_processes(cgroup, init_pid).await;
            for what in ["in", "st"] {
                agent.unlink(&shell_file(PRELAUNCHED, what));
            }
        }
    }

    /// At a session's claim: the member's shell as the session may adopt it, or `None` (no
    /// shell, or one that cannot be adopted: it is killed, as for a one-shot job). Before any
    /// setup runs: setup must not see it.
    pub(super) async fn adopt_prelaunched(
        &self,
        live: &super::LiveContainer,
        plan: &RunPlan,
    ) -> Option<AdoptableShell> {
        let t0 = std::time::Instant::now();
        let pid = self.take_mark(&live.id)?;
        let adoptable = self.adoptable(live, plan, pid).await;
        super::claim_phase("member's shell", t0);
        adoptable
    }

    async fn adoptable(&self, live: &super::LiveContainer, plan: &RunPlan, pid: Option<i32>) -> Option<AdoptableShell> {
        let env = &live.base_env;
        let why = if spec::runs_setup(plan.job(), plan.env()) {
            Some("its Environment runs setup at the claim".to_string())
        } else {
            not_adoptable(env)
        };
        if let Some(why) = why {
            tracing::debug!(member = live.id, why, "the pool member's shell is not adopted");
            end_processes(&live.cgroup, live.init_pid).await;
            if let Ok(agent) = live.agent() {
                for what in ["in", "st"] {
                    agent.unlink(&shell_file(PRELAUNCHED, what));
                }
            }
            return None;
        }
        // A shell sets HOSTNAME when it starts, unless its environment has one: then it was the
        // member's name, and the claim renamed the host.
        let inherited = |k: &str| {
            env.iter().any(|(n, _)| n == k)
                || live
                    .process
                    .env()
                    .iter()
                    .flatten()
                    .any(|e| e.starts_with(&format!("{k}=")))
        };
        Some(AdoptableShell {
            name: PRELAUNCHED.to_string(),
            env: env.clone(),
            cwd: live.process.cwd().to_string_lossy().into_owned(),
            hostname: (!inherited("HOSTNAME")).then(|| plan.job().name.chars().take(63).collect()),
            pid,
        })
    }
}

/// A member's new shell, found before the claim (every process there is the filler's): the
/// process of its cgroup, other than its init, whose fd 4 is the shell's status FIFO. Its
/// host PID and its PID in the sandbox.
fn find_shell(cgroup: &str, init_pid: u32, agent: &Agent) -> Result<(i32, i32), RuntimeError> {
    use std::os::unix::fs::MetadataExt;
    let status = agent.reopen(&shell_file(PRELAUNCHED, "st"), FifoEnd::Read)?;
    let fifo = nix::sys::stat::fstat(&status).map_err(|e| RuntimeError::Io {
        what: "checking the shell's status FIFO".into(),
        source: e.into(),
    })?;
    for pid in crate::runtime::cgroupfs::procs(cgroup) {
        if pid == init_pid as i32 {
            continue;
        }
        let Ok(fd4) = std::fs::metadata(format!("/proc/{pid}/fd/4")) else {
            continue;
        };
        if (fd4.dev(), fd4.ino()) != (fifo.st_dev, fifo.st_ino) {
            continue;
        }
        if let Some(ns_pid) = agent::pid_in_namespace(pid) {
            return Ok((pid, ns_pid));
        }
    }
    Err(RuntimeError::Internal(
        "no process of the member holds the shell's status FIFO".into(),
    ))
}

/// SIGKILL every process of a member's cgroup but its init, and wait (bounded) until they are
/// gone. Each is pinned with a pidfd and checked to be in the cgroup before it is signalled:
/// a PID reused meanwhile is never hit. On the blocking pool (it reads /proc and waits).
async fn end_processes(cgroup: &str, init_pid: u32) {
    let cgroup = cgroup.to_string();
    let ended = tokio::task::spawn_blocking(move || {
        let mut pinned = Vec::new();
        for pid in crate::runtime::cgroupfs::procs(&cgroup) {
            if pid == init_pid as i32 {
                continue;
            }
            let Some(fd) = pidfd(pid) else { continue };
            if crate::runtime::cgroupfs::procs(&cgroup).contains(&pid) {
                // SAFETY: pidfd_send_signal on a pidfd we own; no siginfo.
                let r = unsafe {
                    libc::syscall(
                        libc::SYS_pidfd_send_signal,
                        std::os::fd::AsRawFd::as_raw_fd(&fd),
                        libc::SIGKILL,
                        std::ptr::null::<libc::siginfo_t>(),
                        0,
                    )
                };
                if r == 0 {
                    pinned.push(fd);
                }
            }
        }
        // A pidfd is readable once its process has exited.
        let deadline = std::time::Instant::now() + KILL_LIMIT;
        for fd in &pinned {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let mut poll = libc::pollfd {
                fd: std::os::fd::AsRawFd::as_raw_fd(fd),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = i32::try_from(left.as_millis()).unwrap_or(i32::MAX);
            // SAFETY: one pollfd, which lives across the call.
            unsafe { libc::poll(&mut poll, 1, ms) };
        }
    })
    .await;
    if let Err(e) = ended {
        tracing::warn!(error = %e, "ending a pool member's shell");
    }
}

fn pidfd(pid: i32) -> Option<std::os::fd::OwnedFd> {
    // SAFETY: pidfd_open takes a PID and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Some(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_a_shell_reads_at_start_are_not_handed_to_a_running_one() {
        let env = |k: &str| {
            vec![
                ("PATH".to_string(), "/bin".to_string()),
                (k.to_string(), "x".to_string()),
            ]
        };
        assert_eq!(not_adoptable(&env("HOME")), None);
        assert_eq!(not_adoptable(&env("PYTHONPATH")), None);
        for k in [
            "IFS", "SHLVL", "BASH_ENV", "BASHOPTS", "ENV", "PWD", "_", "1x", "a-b", "",
        ] {
            assert!(not_adoptable(&env(k)).is_some(), "{k}");
        }
    }

    #[test]
    fn the_launch_names_the_shell_files_in_the_shared_directory() {
        let argv = launch_argv("default");
        assert_eq!(argv[4], "/.runner/sh-default.in");
        assert_eq!(argv[5], "/.runner/sh-default.st");
        assert_eq!(shell_file("x", "3.out"), "sh-x.3.out");
    }
}
