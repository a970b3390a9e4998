//! Live containers (sessions, pool members): an idle init, commands through Tasks.Exec or the
//! in-container agent, their output, signals and limits.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use nix::sys::signal::Signal;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::agent::{AGENT_SCRIPT, Agent};
use super::io::{Fifos, OutputPump};
use super::*;
use crate::containerd::{self as client, CtdError};
use crate::runtime::cgroupfs;
use crate::runtime::storage::StorageWatch;
use crate::runtime::{ExecRequest, ExecResult, ProcessState, Runtime, RuntimeError, RuntimeEvent, SetupResult};
use crate::spec::{self, RunPlan};

impl Engine {
    /// Start a live container: setup runs once in its init, which then idles.
    pub async fn spawn_live(&self, plan: &RunPlan) -> Result<LiveContainer, RuntimeError> {
        let t0 = Instant::now();
        let prepared = self.on_setup_snapshot(plan).await;
        let plan = prepared.as_ref().unwrap_or(plan);
        claim_phase("setup snapshot", t0);
        let mut image = None;
        if self.options.use_pools && self.options.exec_via_agent {
            let t0 = Instant::now();
            let claimed = self.claim(plan, "live").await;
            claim_phase("claim", t0);
            match claimed {
                Ok(pool::Claim::Member(member)) => {
                    // Off the session's path (the hook starts a process), and once the claims
                    // pause: a refill is a container start (shim, runc) that would take the CPU
                    // the session's first commands need (measured with `bench http` on 2
                    // cores: the pooled busybox session's first answer went from ~14 to ~11
                    // ms, the python one's from ~18 to ~16 ms), and a burst's other sessions.
                    if let Some(hook) = self.options.on_claim.clone() {
                        pool::refill_when_quiet(hook, member.pool.clone());
                    }
                    let t0 = Instant::now();
                    let live = self.live_from_member(*member, plan).await;
                    claim_phase("live from member", t0);
                    match live {
                        // Torn down already: as when the claim itself fails.
                        Err(RuntimeError::MemberLost(why)) => {
                            tracing::warn!(why, "the claimed pool member went away; starting cold")
                        }
                        live => return live,
                    }
                }
                Ok(pool::Claim::Cold(resolved, _)) => image = resolved,
                Err(e) => tracing::warn!(error = %e, "claiming a pool member failed; starting cold"),
            }
        }
        let job = plan.job();
        let env = plan.env();
        let with_agent = self.options.exec_via_agent;
        let idle = if with_agent { AGENT_SCRIPT } else { KEEPALIVE };
        let init_args = spec::entry::compose(
            &env.setup,
            job.disable_setup,
            None,
            &[spec::SHELL.to_string(), "-c".to_string(), idle.to_string()],
        );
        let mut created = self
            .create(plan, image, Some(init_args), "live", with_agent, None)
            .await?;
        match self.start_live(plan, &mut created).await {
            Ok(live) => Ok(live),
            Err(e) => {
                let _ = self.teardown(&created.id).await;
                Err(e)
            }
        }
    }

    async fn start_live(&self, plan: &RunPlan, created: &mut Created) -> Result<LiveContainer, RuntimeError> {
        let job = plan.job();
        let id = created.id.clone();
        let expect_marker = spec::runs_setup(job, plan.env());
        // The init's output is read only for its setup's result: without a setup its stdio
        // is /dev/null (containerd's shim gives a process with no stdio paths /dev/null,
        // opened read-only, so a write there fails with EBADF; a pool member's init has run
        // so all along). That keeps two FIFOs per live session out of the server's open
        // files (its limit is what bounds sessions per server: docs/guide/capacity.md) and
        // the shim's. Only the agent's shell loop writes there, and only its own errors (its
        // commands have their own stdio); before, the server drained them into nothing.
        let (fifos, mut pumps) = if expect_marker {
            let fifos = Fifos::create(&self.run_dir.join(&id), "init", false, true)?;
            let pumps = OutputPump::start(&fifos, true, self.options.output_limit)?;
            (Some(fifos), Some(pumps))
        } else {
            (None, None)
        };
        let stdio = fifos.as_ref().map(Fifos::stdio).unwrap_or_default();
        let started = Instant::now();
        // Its baseline is measured beside Tasks.Create and is there before the init starts.
        let agent_dir = created.agent.as_ref().map(|a| a.dir().to_path_buf());
        let (storage, baselined) =
            self.watch_storage(plan, &id, &created.cgroup, created.upper.clone(), agent_dir.as_deref());
        let (init_pid, mounts) = self.create_task(created, &stdio).await?;
        if let Some(ticket) = created.shim_group.take() {
            ticket.established();
        }
        tracing::debug!(ms = started.elapsed().as_secs_f64() * 1e3, "task created");
        let mut waiter = {
            let engine = self.clone();
            let id = id.clone();
            tokio::spawn(async move { engine.wait(&id, "").await })
        };
        baselined.wait().await?;
        self.start_task(&id, mounts).await?;
        crate::metrics::observe(OPERATION_SECONDS, &[("op", "start")], started.elapsed());
        tracing::debug!(ms = started.elapsed().as_secs_f64() * 1e3, "task started");
        let mut setup = None;
        // The waiter has answered (it must not be awaited again).
        let mut init_gone = false;
        if let Some(pumps) = &mut pumps {
            let limit = job.timeout.into_iter().chain(job.active_deadline).min();
            let timeout = async {
                match limit {
                    Some(l) => tokio::time::sleep(l).await,
                    None => std::future::pending().await,
                }
            };
            // Setup is done when its marker arrives, or failed when the init exits first.
            let outcome = tokio::select! {
                status = pumps.setup_done() => Ok(status),
                r = &mut waiter => Err(Some(join(r)?)),
                () = timeout => Err(None),
            };
            let outcome = match outcome {
                // The streams ended without the marker: the init ended during setup (killed,
                // out of memory). Its own status, not the marker's absence (-1).
                Ok(_) if !pumps.setup_marker_seen() => match tokio::time::timeout(DRAIN_LIMIT, &mut waiter).await {
                    Ok(r) => Err(Some(join(r)?)),
                    // It still runs (setup closed its stdout): a failed setup all the same.
                    Err(_) => Ok(-1),
                },
                Err(Some(exit)) => {
                    // The init's exit can beat its output's end (the shim reports the exit
                    // without waiting for the copy): what setup wrote last, often the error
                    // that explains it, is read before it is taken.
                    let _ = tokio::time::timeout(DRAIN_LIMIT, pumps.setup_done()).await;
                    Err(Some(exit))
                }
                other => other,
            };
            if matches!(outcome, Err(Some(_))) {
                init_gone = true;
            }
            let (out, err) = pumps.setup_output();
            let (exit_code, timed_out) = match outcome {
                Ok(status) => (Some(status), false),
                Err(Some(exit)) => (Some(exit.status as i32), false),
                Err(None) => (None, true),
            };
            setup = Some(SetupResult {
                exit_code,
                stdout: out.text,
                stderr: err.text,
                stdout_dropped_bytes: out.dropped_bytes,
                stderr_dropped_bytes: err.dropped_bytes,
                timed_out,
                duration_ms: started.elapsed().as_millis() as u64,
            });
        }
        if let Some(pumps) = pumps {
            pumps.discard_rest();
        }
        // The agent serves commands only while the init runs: remember when it stops.
        let init_exited = CancellationToken::new();
        if init_gone {
            init_exited.cancel();
        } else {
            let token = init_exited.clone();
            tokio::spawn(async move {
                let _ = waiter.await;
                token.cancel();
            });
        }
        let mut live = LiveContainer::new(
            self.clone(),
            created.agent.take().map(Arc::new),
            init_pid,
            init_exited,
            id,
            created.cgroup.clone(),
            created.process.clone(),
            Vec::new(),
        );
        live.network = created.network.clone();
        live.workspace = plan.workspace.clone();
        live.storage = Some(storage);
        if let Some(setup) = setup {
            live.set_setup(setup);
        }
        Ok(live)
    }
}

/// What a live container whose init exited answers every command: its processes are gone
/// (killed, or with `--sessions-per-shim`, the shim its group shared died: containerd's
/// clean-up after a dead shim kills each container it supervised).
fn ended() -> RuntimeError {
    RuntimeError::Ended(
        "its init exited (it was killed, or the containerd shim supervising it died); it runs no more commands: delete the session".into(),
    )
}

/// A command in flight in a live container.
#[derive(Clone)]
pub(super) enum Running {
    /// Through Tasks.Exec: its exec id and host PID.
    Exec(String, u32),
    /// Through the agent: when its request was sent (clock ticks since boot) and its
    /// directory, which find its process.
    Agent(u64, std::sync::Arc<std::os::fd::OwnedFd>),
}

#[derive(Default)]
pub(super) struct LiveState {
    /// What runs now, for `poll` and `kill`.
    pub(super) running: Option<Running>,
    pub(super) last: Option<i32>,
    pub(super) cleaned: bool,
}

/// A long-lived container: the runtime interface over Tasks.Exec.
pub struct LiveContainer {
    pub(super) engine: Engine,
    /// The exec agent in the init; commands go through it (see `agent`).
    pub(super) agent: Option<Arc<Agent>>,
    /// Host PID of the init (to find an agent command's host PID for signals).
    pub(super) init_pid: u32,
    pub(super) init_exited: CancellationToken,
    pub(super) id: String,
    pub(super) cgroup: String,
    pub(super) process: oci_spec::runtime::Process,
    pub(super) setup: std::sync::OnceLock<SetupResult>,
    /// Exported before each agent command: a pool member's Environment variables (its init
    /// was made without them).
    pub(super) base_env: Vec<(String, String)>,
    /// The pool it came from.
    pub(super) pool: Option<String>,
    /// What it got on a bridge network.
    pub(super) network: Option<crate::runtime::NetworkStatus>,
    /// Its workspace on the host (swept of setuid bits at cleanup).
    pub(super) workspace: Option<PathBuf>,
    /// Its ephemeral storage, watched; an eviction ends it.
    pub(super) storage: Option<Arc<StorageWatch>>,
    pub(super) slot: Arc<tokio::sync::Mutex<()>>,
    pub(super) state: Arc<Mutex<LiveState>>,
    pub(super) sequence: Arc<AtomicU64>,
    /// A restored container's agent FIFOs, held open by the host until its session has taken
    /// them over (`checkpoint::start_restored`).
    pub(super) restore_holds: Mutex<Vec<std::os::fd::OwnedFd>>,
    /// The shell a pool member's filler started, until the session adopts it.
    pub(super) prelaunched: Mutex<Option<crate::runtime::AdoptableShell>>,
}

impl LiveContainer {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        engine: Engine,
        agent: Option<Arc<Agent>>,
        init_pid: u32,
        init_exited: CancellationToken,
        id: String,
        cgroup: String,
        process: oci_spec::runtime::Process,
        base_env: Vec<(String, String)>,
    ) -> Self {
        LiveContainer {
            engine,
            agent,
            init_pid,
            init_exited,
            id,
            cgroup,
            process,
            setup: std::sync::OnceLock::new(),
            base_env,
            pool: None,
            network: None,
            workspace: None,
            storage: None,
            slot: Arc::new(tokio::sync::Mutex::new(())),
            state: Arc::new(Mutex::new(LiveState::default())),
            sequence: Arc::new(AtomicU64::new(0)),
            restore_holds: Mutex::new(Vec::new()),
            prelaunched: Mutex::new(None),
        }
    }

    pub(super) fn set_setup(&self, setup: SetupResult) {
        let _ = self.setup.set(setup);
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Processes the kernel OOM-killed in this container so far.
    pub fn oom_kills(&self) -> Option<u64> {
        cgroupfs::read(&self.cgroup).oom_kills
    }

    /// The host directory shared with the container at `agent::AGENT_MOUNT`.
    pub fn agent_dir(&self) -> Option<&Path> {
        self.agent.as_ref().map(|a| a.dir())
    }

    /// Signal a process given by its PID inside the container (found on the host through
    /// its PID namespace; nothing outside this container can be hit).
    pub(super) fn agent(&self) -> Result<&Agent, RuntimeError> {
        self.agent
            .as_deref()
            .ok_or_else(|| RuntimeError::Internal("the container has no agent".into()))
    }

    pub fn signal_container_pid(&self, ns_pid: i32, signal: Signal) -> bool {
        match agent::host_pid(&self.cgroup, self.init_pid, ns_pid) {
            Some(host) => nix::sys::signal::kill(nix::unistd::Pid::from_raw(host), signal).is_ok(),
            None => false,
        }
    }

    fn exec_process(&self, request: &ExecRequest) -> Result<Vec<u8>, RuntimeError> {
        let mut process = self.process.clone();
        process.set_args(Some(request.argv.clone()));
        if !request.env.is_empty() {
            let mut env = process.env().clone().unwrap_or_default();
            for (k, v) in &request.env {
                env.retain(|e| e.split_once('=').map(|(key, _)| key) != Some(k.as_str()));
                env.push(format!("{k}={v}"));
            }
            process.set_env(Some(env));
        }
        if let Some(cwd) = &request.cwd {
            let base = process.cwd().clone();
            crate::manifest::paths::check_lexical(cwd).map_err(|e| RuntimeError::Refused(format!("cwd: {e}")))?;
            process.set_cwd(base.join(cwd));
        }
        serde_json::to_vec(&process).map_err(|e| RuntimeError::Refused(format!("encoding the process: {e}")))
    }

    fn check_live(&self) -> Result<(), RuntimeError> {
        if self.state.lock().expect("state lock").cleaned {
            return Err(RuntimeError::CleanedUp);
        }
        if let Some(verdict) = self.eviction() {
            return Err(RuntimeError::Evicted(verdict));
        }
        if self.init_exited.is_cancelled() {
            return Err(ended());
        }
        Ok(())
    }

    /// Why the sandbox was evicted, if it was.
    pub(super) fn eviction(&self) -> Option<String> {
        self.storage.as_ref().and_then(|s| s.verdict())
    }

    /// A command's outcome, told that the sandbox was evicted under it when it was: its
    /// result says so, and a failure to see it end (the init was killed) is the eviction.
    ///
    /// No measurement is made for it (a session's commands fail often, and a walk of a large
    /// workspace per failed command would cost every call): the periodic one finds a sandbox
    /// over its limit within its cadence, and the next call is refused.
    fn mark_eviction(&self, outcome: Result<ExecResult, RuntimeError>) -> Result<ExecResult, RuntimeError> {
        let Some(verdict) = self.eviction() else {
            return outcome;
        };
        match outcome {
            Ok(mut result) => {
                result.evicted = Some(verdict);
                Ok(result)
            }
            Err(_) => Err(RuntimeError::Evicted(verdict)),
        }
    }

    /// Start an exec; returns its id, output pumps and waiter.
    async fn start_exec(
        &self,
        request: &ExecRequest,
        stream: Option<mpsc::Sender<RuntimeEvent>>,
    ) -> Result<StartedExec, RuntimeError> {
        let exec_id = format!("exec-{}", self.sequence.fetch_add(1, Ordering::Relaxed));
        let process = self.exec_process(request)?;
        let dir = self.engine.run_dir.join(&self.id);
        let fifos = Fifos::create(&dir, &exec_id, request.stdin.is_some(), true)?;
        let pumps = match stream {
            Some(tx) => OutputPump::stream(&fifos, tx)?,
            None => OutputPump::start(&fifos, false, self.engine.options.output_limit)?,
        };
        let stdin = fifos.open_stdin()?;
        let client = &self.engine.client;
        let t0 = Instant::now();
        client.exec(&self.id, &exec_id, process, &fifos.stdio()).await?;
        tracing::debug!(ms = t0.elapsed().as_secs_f64() * 1e3, "exec registered");
        let waiter = {
            let engine = self.engine.clone();
            let id = self.id.clone();
            let exec_id = exec_id.clone();
            tokio::spawn(async move { engine.wait(&id, &exec_id).await })
        };
        let started = Instant::now();
        let started_rpc = client.task_start(&self.id, &exec_id).await;
        tracing::debug!(ms = t0.elapsed().as_secs_f64() * 1e3, "exec started");
        let pid = match started_rpc {
            Ok(pid) => pid,
            Err(e) => {
                waiter.abort();
                let _ = client.process_delete(&self.id, &exec_id).await;
                fifos.remove();
                return Err(match e {
                    CtdError::Rpc { message, .. } => RuntimeError::Start {
                        program: request.argv[0].clone(),
                        source: std::io::Error::other(message),
                    },
                    other => other.into(),
                });
            }
        };
        if let (Some(data), Some(stdin)) = (&request.stdin, stdin) {
            io::deliver_stdin(stdin, data.clone(), client.clone(), self.id.clone(), exec_id.clone());
        }
        self.state.lock().expect("state lock").running = Some(Running::Exec(exec_id.clone(), pid));
        Ok(StartedExec {
            pid,
            exec_id,
            fifos,
            pumps,
            waiter,
            started,
        })
    }

    async fn finish_exec(&self, exec: StartedExec, timeout: Option<Duration>) -> Result<ExecResult, RuntimeError> {
        let before = cgroupfs::read(&self.cgroup);
        let never = CancellationToken::new();
        let outcome = self
            .engine
            .supervise(
                &self.id,
                &exec.exec_id,
                exec.waiter,
                timeout.map(|t| t.saturating_sub(exec.started.elapsed())),
                &never,
                Some(exec.pid),
            )
            .await;
        let duration = exec.started.elapsed();
        tracing::debug!(ms = duration.as_secs_f64() * 1e3, "exec exited");
        // What the command left running in the sandbox keeps running; its output is not ours.
        let (out, err) = exec.pumps.finish(EXEC_DRAIN_LIMIT, true).await;
        tracing::debug!(ms = exec.started.elapsed().as_secs_f64() * 1e3, "exec output drained");
        // The shim's Delete of an exec waits up to 2 s for the process's output to close
        // (containerd runc shim, execProcess.delete): done in the background, so a command
        // that leaves a background process behind still answers at once.
        let client = self.engine.client.clone();
        let (id, exec_id, fifos) = (self.id.clone(), exec.exec_id.clone(), exec.fifos);
        tokio::spawn(async move {
            if let Err(e) = client.process_delete(&id, &exec_id).await {
                tracing::debug!(error = %e, "deleting the exec process");
            }
            fifos.remove();
        });
        let after = cgroupfs::read(&self.cgroup);
        let (exit, timed_out, _) = outcome?;
        Ok(self.record(command_result(
            exit.status,
            timed_out,
            out,
            err,
            duration,
            before,
            after,
        )))
    }

    /// Remember how the last command ended (for `poll`) and hand its result back.
    pub(super) fn record(&self, result: ExecResult) -> ExecResult {
        let mut state = self.state.lock().expect("state lock");
        state.running = None;
        state.last = Some(result.status_code());
        result
    }
}

impl LiveContainer {
    /// Run one command through the agent: send, wait for its status (or the timeout: the
    /// command's session gets SIGTERM, the grace, SIGKILL), collect output.
    pub(super) async fn agent_run(
        &self,
        request: ExecRequest,
        stream: Option<mpsc::Sender<RuntimeEvent>>,
    ) -> Result<ExecResult, RuntimeError> {
        let agent = self
            .agent
            .clone()
            .ok_or_else(|| RuntimeError::Internal("no agent".into()))?;
        for key in request.env.keys() {
            let valid = !key.is_empty()
                && key
                    .bytes()
                    .enumerate()
                    .all(|(i, b)| b == b'_' || b.is_ascii_alphabetic() || (i > 0 && b.is_ascii_digit()));
            if !valid {
                return Err(RuntimeError::Refused(format!(
                    "env: {key:?} is not a valid variable name"
                )));
            }
        }
        if request
            .argv
            .iter()
            .chain(request.env.values())
            .any(|a| a.contains('\0'))
        {
            return Err(RuntimeError::Refused(
                "a NUL byte in the command or its environment".into(),
            ));
        }
        let cwd = match &request.cwd {
            Some(cwd) => {
                crate::manifest::paths::check_lexical(cwd).map_err(|e| RuntimeError::Refused(format!("cwd: {e}")))?;
                Some(self.process.cwd().join(cwd).to_string_lossy().into_owned())
            }
            // Always named: a pool member's init sits in the directory *under* the workspace
            // mount that arrived after it started.
            None => Some(self.process.cwd().to_string_lossy().into_owned()),
        };
        let env: Vec<(String, String)> = self
            .base_env
            .iter()
            .filter(|(k, _)| !request.env.contains_key(k))
            .cloned()
            .chain(request.env.iter().map(|(k, v)| (k.clone(), v.clone())))
            .collect();
        let n = self.sequence.fetch_add(1, Ordering::Relaxed);
        let script = agent::command_script(&format!("req-{n}"), &request.argv, &env, cwd.as_deref());
        let before = cgroupfs::read(&self.cgroup);
        let started = Instant::now();
        let req = agent.send(n, &script, request.stdin.as_deref())?;
        let pumps = match stream {
            Some(tx) => OutputPump::forward(req.out, req.err, tx),
            None => OutputPump::capture(req.out, req.err, false, self.engine.options.output_limit),
        };
        self.state.lock().expect("state lock").running = Some(Running::Agent(req.sent, req.dir_fd.clone()));
        let mut done = Box::pin(read_status(req.done));
        let sleep = async {
            match request.timeout {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending().await,
            }
        };
        let outcome = tokio::select! {
            s = &mut done => Ok((s, false)),
            () = sleep => Err(()),
            () = self.init_exited.cancelled() => {
                self.state.lock().expect("state lock").running = None;
                // An agent that never opened the output FIFOs would leave their readers
                // waiting for ever.
                pumps.abort();
                return Err(ended());
            }
        };
        let (status, timed_out) = match outcome {
            Ok(r) => r,
            Err(()) => {
                self.signal_agent_command(&req.dir_fd, req.sent, Signal::SIGTERM);
                match tokio::time::timeout(self.engine.options.kill_grace, &mut done).await {
                    Ok(s) => (s, true),
                    Err(_) => {
                        self.signal_agent_command(&req.dir_fd, req.sent, Signal::SIGKILL);
                        let s = tokio::time::timeout(Duration::from_secs(5), &mut done)
                            .await
                            .ok()
                            .flatten();
                        (s, true)
                    }
                }
            }
        };
        let duration = started.elapsed();
        if status.is_none() {
            // Still queued, perhaps: it must not run after its caller was told it did not.
            agent::withdraw(req.dir_fd.as_ref());
        }
        {
            let agent = agent.clone();
            let name = req.name.clone();
            tokio::task::spawn_blocking(move || agent.remove(&name));
        }
        let Some(status) = status else {
            // The agent never ran it (or never said): its output FIFOs may never have had a
            // writer, and a reader that never had one gets no hang-up, so the readers would
            // wait for ever, past the session's end.
            pumps.abort();
            return Err(RuntimeError::Busy(
                "the sandbox's agent did not run the command: another command that has not ended holds it, or the sandbox meddled with its directory (/.runner)".into(),
            ));
        };
        let (out, err) = pumps.finish(EXEC_DRAIN_LIMIT, true).await;
        let after = cgroupfs::read(&self.cgroup);
        Ok(self.record(command_result(status, timed_out, out, err, duration, before, after)))
    }

    /// Signal an agent command's session (its whole process tree) from the host: the process
    /// is the one the kernel confirms (see `agent::request_pid`).
    fn signal_agent_command(&self, dir: &std::os::fd::OwnedFd, sent: u64, signal: Signal) {
        let Some(host) = agent::request_pid(dir, sent, self.init_pid, &self.cgroup) else {
            return;
        };
        let pid = nix::unistd::Pid::from_raw(host);
        // The agent starts commands with setsid where it can: then the PID leads its group.
        if nix::sys::signal::killpg(pid, signal).is_err() {
            let _ = nix::sys::signal::kill(pid, signal);
        }
    }
}

/// One phase of a session's claim, for `scripts/claim-phases.sh` (with `RUNNER_LOG=runner=debug`).
pub(super) fn claim_phase(phase: &'static str, since: Instant) {
    tracing::debug!(phase, ms = since.elapsed().as_secs_f64() * 1e3, "claim phase");
}

/// The result of a command in a live container: the container's cgroup counters before and
/// after it give its OOM kills and CPU time; peak memory is the container's.
fn command_result(
    status: u32,
    timed_out: bool,
    out: io::StreamOut,
    err: io::StreamOut,
    duration: Duration,
    before: cgroupfs::CgroupStats,
    after: cgroupfs::CgroupStats,
) -> ExecResult {
    let oom = matches!((before.oom_kills, after.oom_kills), (Some(b), Some(a)) if a > b);
    ExecResult {
        exit_code: Some(status as i32),
        signal: ((timed_out || oom) && status > 128).then(|| status as i32 - 128),
        timed_out,
        oom_killed: oom,
        stdout: out.command.text,
        stderr: err.command.text,
        stdout_dropped_bytes: out.command.dropped_bytes,
        stderr_dropped_bytes: err.command.dropped_bytes,
        setup: None,
        duration_ms: duration.as_millis() as u64,
        peak_memory_bytes: after.peak_memory,
        cpu_time_ms: match (before.cpu_usage, after.cpu_usage) {
            (Some(b), Some(a)) => Some(a.saturating_sub(b).as_millis() as u64),
            _ => None,
        },
        pool: None,
        cold_start: None,
        evicted: None,
    }
}

/// Read the status the agent writes to `done` (one line, then EOF).
pub(super) async fn read_status(mut done: tokio::net::unix::pipe::Receiver) -> Option<u32> {
    use tokio::io::AsyncReadExt;
    let mut text = String::new();
    let mut limited = (&mut done).take(16);
    limited.read_to_string(&mut text).await.ok()?;
    agent::parse_status(&text)
}

pub(super) struct StartedExec {
    /// Host PID of the exec'd process: runc makes it a session (and group) leader, so its
    /// group is the command's process tree.
    pub(super) pid: u32,
    pub(super) exec_id: String,
    pub(super) fifos: Fifos,
    pub(super) pumps: OutputPump,
    pub(super) waiter: tokio::task::JoinHandle<Result<client::Exit, CtdError>>,
    pub(super) started: Instant,
}

impl crate::runtime::Sandbox for LiveContainer {
    fn shared_dir(&self) -> &Path {
        self.agent.as_ref().map_or(Path::new(""), |a| a.dir())
    }

    fn shared_mount(&self) -> &'static str {
        agent::AGENT_MOUNT
    }

    fn tools_mount(&self) -> &'static str {
        TOOLS_MOUNT
    }

    fn signal(&self, pid: i32, signal: Signal) -> bool {
        self.signal_container_pid(pid, signal)
    }

    fn signal_group(&self, pid: i32, signal: Signal) -> bool {
        let Some(host) = agent::host_pid(&self.cgroup, self.init_pid, pid) else {
            return false;
        };
        let host = nix::unistd::Pid::from_raw(host);
        if nix::unistd::getpgid(Some(host)).ok() == Some(host) {
            nix::sys::signal::killpg(host, signal).is_ok()
        } else {
            nix::sys::signal::kill(host, signal).is_ok()
        }
    }

    fn prefer_latency(&self, pid: i32) -> bool {
        let Some(host) = agent::host_pid(&self.cgroup, self.init_pid, pid) else {
            return false;
        };
        match crate::runtime::latency::request_slice(host, crate::runtime::latency::SHELL_SLICE) {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(pid = host, error = %e, "could not ask for a short scheduling slice");
                false
            }
        }
    }

    fn fifo(&self, name: &str, end: crate::runtime::FifoEnd) -> Result<std::os::fd::OwnedFd, RuntimeError> {
        self.agent()?.fifo(name, end)
    }

    fn reopen_fifo(&self, name: &str, end: crate::runtime::FifoEnd) -> Result<std::os::fd::OwnedFd, RuntimeError> {
        self.agent()?.reopen(name, end)
    }

    fn unlink(&self, name: &str) {
        if let Some(agent) = &self.agent {
            agent.unlink(name);
        }
    }

    fn oom_kills(&self) -> Option<u64> {
        LiveContainer::oom_kills(self)
    }

    fn adopt_shell(&self) -> Option<crate::runtime::AdoptableShell> {
        self.prelaunched.lock().expect("prelaunched lock").take()
    }
}

#[async_trait]
impl Runtime for LiveContainer {
    /// Only with the agent: its directory is what the sandbox shares with the host.
    fn sandbox(&self) -> Option<&dyn crate::runtime::Sandbox> {
        self.agent.as_ref().map(|_| self as &dyn crate::runtime::Sandbox)
    }

    fn setup(&self) -> Option<&SetupResult> {
        self.setup.get()
    }

    fn ended(&self) -> bool {
        self.init_exited.is_cancelled()
    }

    fn pool(&self) -> Option<&str> {
        self.pool.as_deref()
    }

    fn network(&self) -> Option<&crate::runtime::NetworkStatus> {
        self.network.as_ref()
    }

    async fn open_pty(
        &self,
        request: crate::runtime::pty::PtyRequest,
    ) -> Result<crate::runtime::pty::Pty, RuntimeError> {
        self.check_live()?;
        self.start_pty(request).await
    }

    fn cgroup(&self) -> Option<crate::runtime::CgroupRef> {
        Some(crate::runtime::CgroupRef {
            path: self.cgroup.clone(),
            init_pid: self.init_pid,
        })
    }

    async fn set_egress(&self, egress: crate::net::Egress) -> Result<(), RuntimeError> {
        if self.network.is_none() {
            return Err(RuntimeError::Refused("the sandbox is on no bridge network".into()));
        }
        let dir = self.engine.root_dir(&self.id).join(crate::net::NET_DIR);
        let layer = crate::net::Host::new(self.engine.options.net.clone());
        tokio::task::spawn_blocking(move || layer.set_egress(&dir, &egress))
            .await
            .map_err(|e| RuntimeError::Internal(format!("the egress task: {e}")))?
            .map_err(|e| RuntimeError::Internal(format!("changing the egress of {}: {e}", self.id)))
    }

    async fn execute(&self, request: ExecRequest) -> Result<ExecResult, RuntimeError> {
        self.check_live()?;
        if request.argv.is_empty() {
            return Err(RuntimeError::EmptyCommand);
        }
        let _slot = self.slot.lock().await;
        let began = Instant::now();
        let result = if self.agent.is_some() {
            self.agent_run(request, None).await
        } else {
            let timeout = request.timeout;
            match self.start_exec(&request, None).await {
                Ok(exec) => self.finish_exec(exec, timeout).await,
                Err(e) => Err(e),
            }
        };
        crate::metrics::observe(OPERATION_SECONDS, &[("op", "exec")], began.elapsed());
        self.mark_eviction(result)
    }

    async fn stream(
        &self,
        argv: Vec<String>,
        timeout: Option<Duration>,
    ) -> Result<mpsc::Receiver<RuntimeEvent>, RuntimeError> {
        self.check_live()?;
        if argv.is_empty() {
            return Err(RuntimeError::EmptyCommand);
        }
        let slot = self.slot.clone().lock_owned().await;
        let (tx, rx) = mpsc::channel(64);
        let request = ExecRequest {
            argv,
            timeout,
            ..Default::default()
        };
        let this = LiveContainer {
            engine: self.engine.clone(),
            agent: self.agent.clone(),
            init_pid: self.init_pid,
            init_exited: self.init_exited.clone(),
            id: self.id.clone(),
            cgroup: self.cgroup.clone(),
            process: self.process.clone(),
            setup: std::sync::OnceLock::new(),
            base_env: self.base_env.clone(),
            pool: self.pool.clone(),
            network: self.network.clone(),
            workspace: self.workspace.clone(),
            storage: self.storage.clone(),
            slot: self.slot.clone(),
            state: self.state.clone(),
            sequence: self.sequence.clone(),
            restore_holds: Mutex::new(Vec::new()),
            prelaunched: Mutex::new(None),
        };
        let exec = if this.agent.is_some() {
            None
        } else {
            Some(this.start_exec(&request, Some(tx.clone())).await?)
        };
        tokio::spawn(async move {
            let _slot = slot;
            let outcome = match exec {
                Some(exec) => this.finish_exec(exec, timeout).await,
                None => this.agent_run(request, Some(tx.clone())).await,
            };
            let outcome = this.mark_eviction(outcome);
            for event in RuntimeEvent::ending(outcome) {
                let _ = tx.send(event).await;
            }
        });
        Ok(rx)
    }

    async fn pause(&self) -> Result<(), RuntimeError> {
        self.check_live()?;
        let began = Instant::now();
        // The cgroup's freezer itself, as `runc pause` would write it, without a runc process
        // (see `freezer`).
        freezer::freeze(&self.cgroup).await?;
        crate::metrics::observe(OPERATION_SECONDS, &[("op", "pause")], began.elapsed());
        Ok(())
    }

    fn release_restore_holds(&self) {
        self.restore_holds.lock().expect("holds lock").clear();
    }

    async fn checkpoint(&self, dir: &Path) -> Result<checkpoint::Dumped, RuntimeError> {
        self.check_live()?;
        self.checkpoint_into(dir, checkpoint::FILES_LIMITS).await
    }

    async fn resume(&self) -> Result<(), RuntimeError> {
        self.check_live()?;
        let began = Instant::now();
        freezer::thaw(&self.cgroup).await?;
        crate::metrics::observe(OPERATION_SECONDS, &[("op", "resume")], began.elapsed());
        Ok(())
    }

    fn poll(&self) -> ProcessState {
        let state = self.state.lock().expect("state lock");
        ProcessState::of(state.running.is_some(), state.last)
    }

    async fn kill(&self) -> Result<(), RuntimeError> {
        let running = self.state.lock().expect("state lock").running.clone();
        match running {
            Some(Running::Exec(exec_id, pid)) => {
                signal_group(Some(pid), Signal::SIGKILL);
                self.engine.client.task_kill(&self.id, &exec_id, SIGKILL, false).await?;
            }
            Some(Running::Agent(sent, dir)) => self.signal_agent_command(&dir, sent, Signal::SIGKILL),
            None => {}
        }
        Ok(())
    }

    async fn cleanup(&self) -> Result<(), RuntimeError> {
        {
            let mut state = self.state.lock().expect("state lock");
            if state.cleaned {
                return Ok(());
            }
            state.cleaned = true;
        }
        let torn_down = self.engine.teardown(&self.id).await;
        sweep_setid(self.workspace.as_deref()).await;
        torn_down
    }
}
