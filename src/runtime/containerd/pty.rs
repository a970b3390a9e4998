//! Terminals in a live container: Tasks.Exec with `process.terminal` set. runc allocates the
//! terminal inside the container — `/dev/ptmx` of the container's own devpts instance
//! (`newinstance`, mounted by the spec), opened in its user namespace by the container's user —
//! and sends the master over a console socket to the shim, which copies it to and from the
//! exec's stdin and stdout FIFOs; the window size goes through Tasks.ResizePty.
//!
//! Why not the in-container agent (a fork, ~2 ms, where an exec costs ~25 ms): the agent runs
//! one command at a time in its foreground, and a shell starting a command in the background
//! starts it with SIGINT ignored, which everything it runs inherits (Ctrl-C could never
//! interrupt a `sleep` there). A terminal would also have to be allocated by the host in the
//! sandbox's mount namespace and handed across its user-namespace mapping. docs/guide/terminals.md
//! has the measurements.
//!
//! The host never opens anything the sandbox can name here: the FIFOs are in the runner's run
//! directory, and the foreground process group a signal goes to is read from the kernel
//! (`/proc/PID/stat` of the exec's process) and checked to be a group of this container's.

use std::sync::atomic::Ordering;

use async_trait::async_trait;
use nix::sys::signal::Signal;
use tokio::net::unix::pipe;
use tokio::sync::watch;

use super::io::Fifos;
use super::live::LiveContainer;
use crate::containerd::Containerd;
use crate::runtime::cgroupfs;
use crate::runtime::pty::{DEFAULT_TERM, HANGUP_GRACE, Pty, PtyControl, PtyExit, PtyRequest, PtySize};
use crate::runtime::{CgroupRef, RuntimeError};

impl LiveContainer {
    /// Start `request` on a new terminal (see the module's comment).
    pub(super) async fn start_pty(&self, request: PtyRequest) -> Result<Pty, RuntimeError> {
        if request.argv.is_empty() {
            return Err(RuntimeError::EmptyCommand);
        }
        let exec_id = format!("pty-{}", self.sequence.fetch_add(1, Ordering::Relaxed));
        let process = self.pty_process(&request)?;
        let dir = self.engine.run_dir.join(&self.id);
        let fifos = Fifos::create(&dir, &exec_id, true, true)?;
        let mut stdio = fifos.stdio();
        // The terminal merges the streams; the shim copies the console to stdout only.
        stdio.stderr = String::new();
        let io = |what: &'static str| {
            move |source| RuntimeError::Io {
                what: what.into(),
                source,
            }
        };
        // Opened before the exec: the shim opens the other ends inside it (and would hang
        // without a reader). Our stdin end is read-write, so opening never blocks.
        let output = pipe::OpenOptions::new()
            .open_receiver(&stdio.stdout)
            .map_err(io("opening a terminal's output FIFO"))?;
        let input = fifos
            .open_stdin()?
            .ok_or_else(|| RuntimeError::Internal("no stdin FIFO was made".into()))?;
        let client = self.engine.client.clone();
        let started = async {
            client.exec_terminal(&self.id, &exec_id, process, &stdio).await?;
            client.task_start(&self.id, &exec_id).await
        };
        let pid = match started.await {
            Ok(pid) => pid,
            Err(e) => {
                let _ = client.process_delete(&self.id, &exec_id).await;
                fifos.remove();
                return Err(RuntimeError::Start {
                    program: request.argv[0].clone(),
                    source: std::io::Error::other(e.to_string()),
                });
            }
        };
        let (exit_tx, exit_rx) = watch::channel(None);
        {
            let engine = self.engine.clone();
            let (id, exec_id) = (self.id.clone(), exec_id.clone());
            tokio::spawn(async move {
                let exit = match engine.wait(&id, &exec_id).await {
                    Ok(exit) => PtyExit {
                        exit_code: i32::try_from(exit.status).ok(),
                        signal: None,
                    },
                    Err(e) => {
                        tracing::debug!(error = %e, "waiting for a terminal's command");
                        PtyExit::default()
                    }
                };
                let _ = exit_tx.send(Some(exit));
                if let Err(e) = engine.client.process_delete(&id, &exec_id).await {
                    tracing::debug!(error = %e, "deleting a terminal's exec process");
                }
                fifos.remove();
            });
        }
        let control = ExecControl {
            client,
            id: self.id.clone(),
            exec_id,
            pid,
            started: crate::owner::process_start_time(pid),
            cgroup: CgroupRef {
                path: self.cgroup.clone(),
                init_pid: self.init_pid,
            },
            exit: exit_rx.clone(),
        };
        Ok(Pty::new(output, input, Box::new(control), exit_rx, request.size))
    }

    /// The exec's process: the container's own (user, capabilities, seccomp, rlimits), with
    /// the request's command, environment and directory, on a terminal of the asked size.
    fn pty_process(&self, request: &PtyRequest) -> Result<Vec<u8>, RuntimeError> {
        let mut process = self.process.clone();
        process.set_args(Some(request.argv.clone()));
        let mut env = process.env().clone().unwrap_or_default();
        let mut set = |k: &str, v: &str| {
            env.retain(|e| e.split_once('=').map(|(key, _)| key) != Some(k));
            env.push(format!("{k}={v}"));
        };
        set("TERM", DEFAULT_TERM);
        // A pool member's init was made without its Environment's variables.
        for (k, v) in &self.base_env {
            set(k, v);
        }
        for (k, v) in &request.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(RuntimeError::Refused(format!("env: {k:?} is not a valid variable")));
            }
            set(k, v);
        }
        process.set_env(Some(env));
        if let Some(cwd) = &request.cwd {
            crate::manifest::paths::check_lexical(cwd).map_err(|e| RuntimeError::Refused(format!("cwd: {e}")))?;
            let base = process.cwd().clone();
            process.set_cwd(base.join(cwd));
        }
        process.set_terminal(Some(true));
        process.set_console_size(Some(
            oci_spec::runtime::BoxBuilder::default()
                .height(u64::from(request.size.rows))
                .width(u64::from(request.size.cols))
                .build()
                .map_err(|e| RuntimeError::Internal(format!("a console size: {e}")))?,
        ));
        serde_json::to_vec(&process).map_err(|e| RuntimeError::Refused(format!("encoding the process: {e}")))
    }
}

struct ExecControl {
    client: Containerd,
    id: String,
    exec_id: String,
    /// The exec's host PID (runc makes it the leader of a new session, whose controlling
    /// terminal is the new one) and when it started, to never mistake a reused PID for it.
    pid: u32,
    started: Option<u64>,
    cgroup: CgroupRef,
    exit: watch::Receiver<Option<PtyExit>>,
}

impl ExecControl {
    /// The terminal's foreground process group, as host PID: field 8 (`tpgid`) of the exec's
    /// `/proc/PID/stat`, which the kernel gives in the reader's PID namespace. Only while the
    /// exec runs (checked by its start time) and only a group with a process in this
    /// container's cgroup.
    fn foreground_group(&self) -> Option<i32> {
        if self.exit.borrow().is_some() || crate::owner::process_start_time(self.pid) != self.started {
            return None;
        }
        let tpgid = stat_field(self.pid as i32, 8)?;
        if tpgid <= 0 {
            return None;
        }
        let ours = cgroupfs::procs(&self.cgroup.path)
            .into_iter()
            .any(|p| stat_field(p, 5) == Some(tpgid));
        ours.then_some(tpgid)
    }
}

/// Field `n` (1-based, as proc(5) counts) of `/proc/PID/stat`, a number. The command name
/// (field 2) may hold spaces and parentheses: fields are counted after its last `)`.
fn stat_field(pid: i32, n: usize) -> Option<i32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &text[text.rfind(')')? + 1..];
    rest.split_whitespace().nth(n.checked_sub(3)?)?.parse().ok()
}

#[async_trait]
impl PtyControl for ExecControl {
    async fn resize(&self, size: PtySize) -> Result<(), RuntimeError> {
        Ok(self
            .client
            .resize_pty(&self.id, &self.exec_id, u32::from(size.cols), u32::from(size.rows))
            .await?)
    }

    fn signal_foreground(&self, signal: Signal) -> bool {
        match self.foreground_group() {
            Some(group) => nix::sys::signal::killpg(nix::unistd::Pid::from_raw(group), signal).is_ok(),
            None => false,
        }
    }

    async fn hangup(&self) {
        // Our end of stdin is closed: the shim closes the console, and the session gets its
        // SIGHUP from the kernel. A program that ignores it is killed after the grace.
        let mut exit = self.exit.clone();
        if tokio::time::timeout(HANGUP_GRACE, exit.wait_for(Option::is_some))
            .await
            .is_err()
        {
            let _ = self
                .client
                .task_kill(&self.id, &self.exec_id, Signal::SIGKILL as u32, false)
                .await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_command_name() {
        let me = std::process::id() as i32;
        assert_eq!(stat_field(me, 5), Some(nix::unistd::getpgrp().as_raw()));
        assert_eq!(stat_field(me, 1), None);
    }
}
