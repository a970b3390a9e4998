//! The host-process backend (reference 001): trusted commands run as host processes in the
//! workspace. Setup runs at spawn; one process at a time; a timeout kills the whole process
//! tree (cgroup, else process group); output is capped and decoded with replacement.
//!
//! Differences from a container, by design: no filesystem isolation (mounts are refused at
//! bind time), no resource limits, static assets are symlinks under `$RUNNER_STATIC_DIR`, and
//! processes a command leaves behind are killed when it exits (as when a container's init
//! exits), so every command's output reaches EOF.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use nix::sys::signal::Signal;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use super::output::{Capture, Captured, PumpProgress, Utf8Chunker, wait_for_pump};
use super::tree::ProcessTree;
use super::{ExecRequest, ExecResult, ProcessState, Runtime, RuntimeError, RuntimeEvent, RuntimeOptions, SetupResult};
use crate::manifest::UserSpec;
use crate::spec::{DEFAULT_PATH, HostEnv, RunPlan, SHELL, entry};

/// Environment variable naming the directory that holds the static assets on the host backend.
pub const STATIC_DIR_VAR: &str = "RUNNER_STATIC_DIR";
/// Read size for process output.
const READ_CHUNK: usize = 64 * 1024;
/// How long the output pipes may stay open after the whole tree is dead (they close at once
/// unless a process escaped the tree).
const DRAIN_LIMIT: Duration = Duration::from_secs(2);
/// How long SIGKILLing the tree may take before we give up on it.
const KILL_LIMIT: Duration = Duration::from_secs(5);

pub struct HostRuntime {
    workdir: PathBuf,
    env: BTreeMap<String, String>,
    /// Ids to switch to in the child (only set when they differ from ours).
    switch_user: Option<(u32, u32)>,
    setup: Option<SetupResult>,
    options: RuntimeOptions,
    /// Held for the whole life of a process: one at a time.
    slot: Arc<tokio::sync::Mutex<()>>,
    state: Arc<Mutex<State>>,
    /// Our scratch directories (workspace when the job has none, static asset links).
    scratch: Mutex<Vec<tempfile::TempDir>>,
}

#[derive(Default)]
struct State {
    current: Option<Arc<ProcessTree>>,
    last: Option<i32>,
    cleaned: bool,
}

/// Where a process's output goes.
enum Sink {
    Capture(Capture),
    /// The consumer's channel, the decoder, whether it is stdout, and how far it got (a pump
    /// still moving output to a slow consumer is not held by an escaped process).
    Stream(mpsc::Sender<RuntimeEvent>, Utf8Chunker, bool, Arc<PumpProgress>),
}

impl Sink {
    async fn push(&mut self, data: &[u8]) {
        match self {
            Sink::Capture(c) => c.push(data),
            Sink::Stream(tx, dec, is_stdout, progress) => {
                let text = dec.decode(data);
                if !text.is_empty() {
                    let ev = if *is_stdout {
                        RuntimeEvent::Stdout { data: text }
                    } else {
                        RuntimeEvent::Stderr { data: text }
                    };
                    // A gone receiver is fine: we keep draining so the process never blocks.
                    progress.set_sending(true);
                    if tx.send(ev).await.is_ok() {
                        progress.add_forwarded(data.len());
                    }
                    progress.set_sending(false);
                }
            }
        }
    }

    fn stream(tx: &mpsc::Sender<RuntimeEvent>, is_stdout: bool) -> Self {
        Sink::Stream(tx.clone(), Utf8Chunker::default(), is_stdout, Arc::default())
    }

    /// How far the pump got forwarding (a stream's; a capture forwards nothing).
    fn progress(&self) -> Option<Arc<PumpProgress>> {
        match self {
            Sink::Capture(_) => None,
            Sink::Stream(.., progress) => Some(progress.clone()),
        }
    }

    async fn finish(self) -> Captured {
        match self {
            Sink::Capture(c) => c.finish(),
            Sink::Stream(tx, mut dec, is_stdout, _) => {
                let text = dec.flush();
                if !text.is_empty() {
                    let ev = if is_stdout {
                        RuntimeEvent::Stdout { data: text }
                    } else {
                        RuntimeEvent::Stderr { data: text }
                    };
                    let _ = tx.send(ev).await;
                }
                Captured::default()
            }
        }
    }
}

async fn pump<R: AsyncRead + Unpin>(mut reader: R, mut sink: Sink) -> Captured {
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        match reader.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => sink.push(&buf[..n]).await,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!(error = %e, "reading process output failed");
                break;
            }
        }
    }
    sink.finish().await
}

/// A started process, its tree and its output pumps.
struct Running {
    tree: Arc<ProcessTree>,
    started: Instant,
    timeout: Option<Duration>,
    out: Pumping,
    err: Pumping,
    wait: tokio::task::JoinHandle<std::io::Result<std::process::ExitStatus>>,
    state: Arc<Mutex<State>>,
    grace: Duration,
}

/// An output pump's progress (a stream's) and its task.
type Pumping = (Option<Arc<PumpProgress>>, tokio::task::JoinHandle<Captured>);

/// Wait for an output pump; a pipe still open after the tree died means a process escaped.
/// A pump still moving output to a slow consumer is waited for (every byte comes before the
/// exit event), up to `AFTER_EXIT_BYTES` (`wait_for_pump`).
async fn drain((progress, mut task): Pumping, name: &str) -> Captured {
    match wait_for_pump(&mut task, DRAIN_LIMIT, progress.as_deref()).await {
        Some(captured) => captured.unwrap_or_default(),
        None => {
            tracing::warn!("{name} still open after the process tree died; a process escaped its group");
            task.abort();
            Captured::default()
        }
    }
}

impl Running {
    /// See the process to its end (or its timeout) and the whole tree dead.
    async fn finish(mut self) -> Result<(ExecResult, Captured, Captured), RuntimeError> {
        let tree = &self.tree;
        let mut timed_out = false;
        let status = match self.timeout {
            Some(limit) => match tokio::time::timeout(limit, &mut self.wait).await {
                Ok(status) => status,
                Err(_) => {
                    timed_out = true;
                    tree.signal(Signal::SIGTERM);
                    let polite = tokio::time::timeout(self.grace, &mut self.wait).await;
                    if polite.is_err() || !tree.wait_empty(self.grace).await {
                        tree.kill_until_empty(KILL_LIMIT).await;
                    }
                    match polite {
                        Ok(status) => status,
                        Err(_) => (&mut self.wait).await,
                    }
                }
            },
            None => (&mut self.wait).await,
        };
        let elapsed = self.started.elapsed();
        let wait_error = |source| RuntimeError::Io {
            what: "waiting for the process".into(),
            source,
        };
        let status = status
            .map_err(|e| wait_error(std::io::Error::other(e)))?
            .map_err(wait_error)?;
        // What the command left running dies with it, so the pipes reach EOF.
        if !tree.kill_until_empty(KILL_LIMIT).await {
            tracing::warn!("a process of the tree survived SIGKILL for {KILL_LIMIT:?}");
        }
        let stdout = drain(self.out, "stdout").await;
        let stderr = drain(self.err, "stderr").await;
        let result = ExecResult {
            exit_code: status.code(),
            signal: status.signal(),
            timed_out,
            duration_ms: elapsed.as_millis() as u64,
            peak_memory_bytes: tree.peak_memory(),
            cpu_time_ms: tree.cpu_time().map(|d| d.as_millis() as u64),
            ..Default::default()
        };
        let mut state = self.state.lock().expect("state lock");
        state.current = None;
        state.last = Some(result.status_code());
        Ok((result, stdout, stderr))
    }
}

/// The ids the child must switch to, if any, or why it cannot.
fn user_switch(user: Option<UserSpec>, host: &HostEnv) -> Result<Option<(u32, u32)>, RuntimeError> {
    let wanted = match user {
        None => return Ok(None),
        Some(UserSpec::Host) => host.host_user(),
        Some(UserSpec::Ids { uid, gid }) => (uid, gid),
    };
    if wanted == (host.uid, host.gid) {
        return Ok(None);
    }
    if host.uid != 0 {
        return Err(RuntimeError::Refused(format!(
            "spec.user: running as {}:{} needs the runner to run as root (it runs as {}:{})",
            wanted.0, wanted.1, host.uid, host.gid
        )));
    }
    Ok(Some(wanted))
}

impl HostRuntime {
    /// Prepare the workspace, environment and user, then run the setup commands (unless
    /// disabled). A failed setup is reported in `setup()`, not as an error.
    pub async fn spawn(plan: &RunPlan, host: &HostEnv, options: &RuntimeOptions) -> Result<Self, RuntimeError> {
        let env_spec = plan.env();
        let job = plan.job();
        let mut scratch = Vec::new();
        let io = |what: &str| {
            let what = what.to_string();
            move |source| RuntimeError::Io { what, source }
        };
        let workdir = match &plan.workspace {
            Some(ws) => ws.clone(),
            None => {
                let dir = tempfile::Builder::new()
                    .prefix("runner-ws-")
                    .tempdir()
                    .map_err(io("creating a scratch workspace"))?;
                let path = dir.path().to_path_buf();
                scratch.push(dir);
                path
            }
        };
        let mut env: BTreeMap<String, String> = BTreeMap::new();
        if env_spec.include_host_env {
            env.extend(host.vars.clone());
        } else {
            for key in ["PATH", "HOME", "LANG", "TERM", "USER", "LOGNAME", "TMPDIR"] {
                if let Some(v) = host.vars.get(key) {
                    env.insert(key.to_string(), v.clone());
                }
            }
            env.entry("PATH".into()).or_insert_with(|| DEFAULT_PATH.into());
        }
        if !plan.assets.is_empty() {
            let dir = tempfile::Builder::new()
                .prefix("runner-static-")
                .tempdir()
                .map_err(io("creating the static asset directory"))?;
            for asset in &plan.assets {
                let rel = asset
                    .target
                    .trim_start_matches(crate::spec::STATIC_ROOT)
                    .trim_start_matches('/');
                let link = dir.path().join(rel);
                if let Some(parent) = link.parent() {
                    std::fs::create_dir_all(parent).map_err(io("creating the static asset directory"))?;
                }
                std::os::unix::fs::symlink(&asset.source, &link).map_err(io("linking a static asset"))?;
            }
            env.insert(STATIC_DIR_VAR.into(), dir.path().to_string_lossy().into_owned());
            scratch.push(dir);
        }
        env.extend(env_spec.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        let mut runtime = HostRuntime {
            workdir,
            env,
            switch_user: user_switch(env_spec.user, host)?,
            setup: None,
            options: options.clone(),
            slot: Arc::new(tokio::sync::Mutex::new(())),
            state: Arc::new(Mutex::new(State::default())),
            scratch: Mutex::new(scratch),
        };
        if !crate::spec::runs_setup(job, env_spec) {
            return Ok(runtime);
        }
        let request = ExecRequest {
            argv: vec![SHELL.into(), "-c".into(), entry::setup_script(&env_spec.setup)],
            stdin: None,
            timeout: job.timeout,
            ..Default::default()
        };
        let result = runtime.execute(request).await?;
        runtime.setup = Some(SetupResult {
            exit_code: Some(result.status_code()),
            stdout: result.stdout,
            stderr: result.stderr,
            stdout_dropped_bytes: result.stdout_dropped_bytes,
            stderr_dropped_bytes: result.stderr_dropped_bytes,
            timed_out: result.timed_out,
            duration_ms: result.duration_ms,
        });
        Ok(runtime)
    }

    fn command(&self, request: &ExecRequest, tree: &ProcessTree) -> Result<tokio::process::Command, RuntimeError> {
        let program = request.argv.first().ok_or(RuntimeError::EmptyCommand)?;
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(&request.argv[1..])
            .current_dir(match &request.cwd {
                Some(cwd) => self.workdir.join(cwd),
                None => self.workdir.clone(),
            })
            .env_clear()
            .envs(&self.env)
            .envs(&request.env)
            .stdin(if request.stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let procs_fd = tree.procs_fd();
        let ids = self.switch_user;
        // SAFETY: the closure runs in the forked child before exec and only makes
        // async-signal-safe system calls (setsid, write, setgroups, setgid, setuid); it
        // allocates nothing and touches no lock.
        unsafe {
            cmd.pre_exec(move || {
                // Lead a new session and process group: the fallback handle on the tree, and
                // no terminal signals from the runner's terminal.
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(fd) = procs_fd {
                    // Writing "0" moves the writer into the cgroup, before it can fork.
                    if libc::write(fd, b"0".as_ptr().cast(), 1) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if let Some((uid, gid)) = ids
                    && (libc::setgroups(0, std::ptr::null()) < 0 || libc::setgid(gid) < 0 || libc::setuid(uid) < 0)
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(cmd)
    }

    /// Start one process; output goes to the two sinks.
    fn start(&self, request: ExecRequest, out: Sink, err: Sink) -> Result<Running, RuntimeError> {
        let mut tree = ProcessTree::prepare(self.options.use_cgroup);
        let mut cmd = self.command(&request, &tree)?;
        let started = Instant::now();
        let mut child = cmd.spawn().map_err(|source| RuntimeError::Start {
            program: request.argv[0].clone(),
            source,
        })?;
        tree.started(child.id().unwrap_or_default());
        let tree = Arc::new(tree);
        self.state.lock().expect("state lock").current = Some(tree.clone());
        if let (Some(data), Some(mut stdin)) = (request.stdin, child.stdin.take()) {
            tokio::spawn(async move {
                if let Err(e) = stdin.write_all(&data).await {
                    // EPIPE: the process exited or closed stdin without reading it all.
                    tracing::debug!(error = %e, "stdin not fully delivered");
                }
                // Dropping `stdin` closes it: the process sees EOF.
            });
        }
        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = child.stderr.take().expect("stderr is piped");
        Ok(Running {
            tree,
            started,
            timeout: request.timeout,
            out: (out.progress(), tokio::spawn(pump(stdout, out))),
            err: (err.progress(), tokio::spawn(pump(stderr, err))),
            wait: tokio::spawn(async move { child.wait().await }),
            state: self.state.clone(),
            grace: self.options.kill_grace,
        })
    }

    fn check_live(&self) -> Result<(), RuntimeError> {
        if self.state.lock().expect("state lock").cleaned {
            return Err(RuntimeError::CleanedUp);
        }
        Ok(())
    }
}

#[async_trait]
impl Runtime for HostRuntime {
    fn setup(&self) -> Option<&SetupResult> {
        self.setup.as_ref()
    }

    async fn execute(&self, request: ExecRequest) -> Result<ExecResult, RuntimeError> {
        self.check_live()?;
        if request.argv.is_empty() {
            return Err(RuntimeError::EmptyCommand);
        }
        let _slot = self.slot.lock().await;
        let limit = self.options.output_limit;
        let (mut result, out, err) = self
            .start(
                request,
                Sink::Capture(Capture::new(limit)),
                Sink::Capture(Capture::new(limit)),
            )?
            .finish()
            .await?;
        result.stdout = out.text;
        result.stdout_dropped_bytes = out.dropped_bytes;
        result.stderr = err.text;
        result.stderr_dropped_bytes = err.dropped_bytes;
        Ok(result)
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
        let out = Sink::stream(&tx, true);
        let err = Sink::stream(&tx, false);
        let running = self.start(request, out, err)?;
        tokio::spawn(async move {
            let _slot = slot;
            for event in RuntimeEvent::ending(running.finish().await.map(|(r, _, _)| r)) {
                let _ = tx.send(event).await;
            }
        });
        Ok(rx)
    }

    async fn open_pty(&self, request: super::pty::PtyRequest) -> Result<super::pty::Pty, RuntimeError> {
        self.check_live()?;
        super::pty::spawn_host(
            &request,
            &self.workdir,
            &self.env,
            self.switch_user,
            self.options.use_cgroup,
        )
    }

    fn poll(&self) -> ProcessState {
        let state = self.state.lock().expect("state lock");
        ProcessState::of(state.current.is_some(), state.last)
    }

    async fn kill(&self) -> Result<(), RuntimeError> {
        let current = self.state.lock().expect("state lock").current.clone();
        if let Some(tree) = current {
            tree.kill_until_empty(KILL_LIMIT).await;
        }
        Ok(())
    }

    async fn cleanup(&self) -> Result<(), RuntimeError> {
        self.kill().await?;
        // Wait for a running command to wind down before removing its directories.
        let _slot = self.slot.lock().await;
        self.state.lock().expect("state lock").cleaned = true;
        let dirs: Vec<tempfile::TempDir> = std::mem::take(&mut *self.scratch.lock().expect("scratch lock"));
        for dir in dirs {
            let path = dir.path().to_path_buf();
            dir.close().map_err(|source| RuntimeError::Io {
                what: format!("removing {}", path.display()),
                source,
            })?;
        }
        Ok(())
    }
}
