//! The engine: the containerd connection and what it does with one-shot jobs: run one
//! (create, start, supervise its task, read its result), adopt one a dead runner left, tear
//! a container down.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tokio_util::sync::CancellationToken;

use super::io::{Fifos, OutputPump};
use super::*;
use crate::containerd::{self as client, Containerd, CtdError};
use crate::owner::owner_id;
use crate::runtime::cgroupfs;
use crate::runtime::idmap;
use crate::runtime::storage::{StorageMonitor, StorageWatch, Tree as StorageTree};
use crate::runtime::{ExecResult, RuntimeError, RuntimeOptions, SetupResult};
use crate::runtime::{janitor, late};
use crate::spec::{self, HostEnv, RunPlan};

pub(super) fn container_id(job: &str) -> String {
    format!("{job}-{}", crate::owner::unique_tag())
}

/// The containerd side of the runner: a connection plus where FIFOs live.
#[derive(Clone, Debug)]
pub struct Engine {
    pub(super) client: Containerd,
    /// Directory for per-process FIFOs.
    pub(super) run_dir: PathBuf,
    pub(super) host: HostEnv,
    pub(super) options: RuntimeOptions,
    /// The host's user-namespace ranges.
    pub(super) leases: idmap::Leases,
    /// Measures what sandboxes write (`resources.ephemeralStorage`).
    pub(super) storage: StorageMonitor,
}

impl Engine {
    pub fn new(client: Containerd, state_dir: &Path, host: HostEnv, options: RuntimeOptions) -> Self {
        Engine {
            run_dir: state_dir.join("run"),
            client,
            host,
            leases: idmap::Leases::at(&options.userns_dir),
            options,
            storage: StorageMonitor::process(),
        }
    }

    /// This engine with other runtime options (an attempt's output file, its kill grace).
    pub fn with_options(mut self, options: RuntimeOptions) -> Self {
        self.options = options;
        self
    }

    /// The runtime options its containers are made with.
    pub fn options(&self) -> &RuntimeOptions {
        &self.options
    }

    /// The containers of job (or session) `job`: every one, or one attempt's (`index`,
    /// `attempt`).
    pub async fn job_containers(
        &self,
        job: &str,
        attempt: Option<(u32, u32)>,
    ) -> Result<Vec<containerd_client::services::v1::Container>, RuntimeError> {
        let filter = match attempt {
            Some((index, number)) => format!(
                "labels.\"{LABEL_JOB}\"=={job},labels.\"{LABEL_INDEX}\"=={index},labels.\"{LABEL_ATTEMPT}\"=={number}"
            ),
            None => format!("labels.\"{LABEL_JOB}\"=={job}"),
        };
        Ok(self.client.containers(vec![filter]).await?)
    }

    /// Where container `id`'s remapped rootfs is mounted: a host-wide directory per
    /// containerd (see `prepare_created` for why not the state dir).
    pub fn root_dir(&self, id: &str) -> PathBuf {
        self.roots_dir().join(id)
    }

    /// The directory of this containerd's rootfs directories.
    pub fn roots_dir(&self) -> PathBuf {
        use sha2::Digest;
        let key = hex::encode(&sha2::Sha256::digest(self.containerd_name().as_bytes())[..8]);
        self.options.rootfs_dir.join(key)
    }

    /// Which containerd this engine's containers live in (socket#namespace).
    pub fn containerd_name(&self) -> String {
        format!("{}#{}", self.client.address().display(), self.client.namespace())
    }

    pub(super) fn labels(&self, plan: &RunPlan, kind: &str) -> HashMap<String, String> {
        let mut labels: HashMap<String, String> = plan.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        labels.extend([
            (LABEL_MANAGED.to_string(), "true".to_string()),
            (LABEL_OWNER.to_string(), owner_id()),
            (LABEL_JOB.to_string(), plan.job().name.clone()),
            (LABEL_KIND.to_string(), kind.to_string()),
            (LABEL_STATE_DIR.to_string(), self.state_dir().display().to_string()),
        ]);
        labels.extend(workspace_labels(plan));
        labels
    }

    /// The state directory this engine's run dir lives in, as absolute as it can be made.
    pub fn state_dir(&self) -> PathBuf {
        let dir = self.run_dir.parent().unwrap_or(&self.run_dir);
        std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf())
    }

    pub(super) fn cgroup_path(&self, id: &str) -> String {
        format!("{}/{id}", self.cgroup_parent())
    }

    /// The cgroup every container of this namespace lives under.
    pub fn cgroup_parent(&self) -> String {
        format!("/runner/{}", self.client.namespace())
    }

    /// The `runner` binary the shim and the network run (`what` it is for, in the error).
    pub(super) fn runner_exe(&self, what: &str) -> Result<PathBuf, RuntimeError> {
        match &self.options.logger_binary {
            Some(path) => Ok(path.clone()),
            None => std::env::current_exe().map_err(|source| RuntimeError::Io {
                what: format!("finding the runner binary for {what}"),
                source,
            }),
        }
    }

    fn output_dir(&self, id: &str) -> PathBuf {
        self.run_dir.join(id).join("output")
    }
}

impl Engine {
    /// Remove a container and everything it owns, in containerd's order. Errors are logged
    /// and returned after every step was tried.
    pub async fn teardown(&self, id: &str) -> Result<(), RuntimeError> {
        self.teardown_inner(id, false).await
    }

    /// `exited`: the task is known to have exited (we waited for it): skip the kill.
    async fn teardown_inner(&self, id: &str, exited: bool) -> Result<(), RuntimeError> {
        let c = &self.client;
        let mut first_error = None;
        if exited {
        } else if let Ok(Some(process)) = c.task_get(id).await {
            // Status 3 is STOPPED (containerd.v1.types.Status); anything else may still run.
            if process.status != STATUS_STOPPED {
                // A frozen task takes no signal on cgroup v1 until it is thawed: a paused
                // sandbox is thawed to be killed — through its cgroup, as runner froze it
                // (containerd still calls the task running), and through containerd when
                // something paused it there.
                let cgroup = self.cgroup_path(id);
                if let Ok(Some(s)) = freezer::state(&cgroup).await
                    && s != freezer::FreezeState::Thawed
                    && let Err(e) = freezer::thaw(&cgroup).await
                {
                    tracing::warn!(container = id, error = %e, "could not thaw the container to kill it");
                }
                if process.status == STATUS_PAUSED {
                    let _ = c.task_resume(id).await;
                }
                let _ = c.task_kill(id, "", SIGKILL, true).await;
                if tokio::time::timeout(TEARDOWN_WAIT, c.task_wait(id, "")).await.is_err() {
                    tracing::warn!(container = id, "task did not exit within {TEARDOWN_WAIT:?} of SIGKILL");
                }
            }
        }
        // Off the bridge network (CNI DEL, its pins) before the directory holding them goes;
        // beside the task's deletion (no process of the task is left to use the network).
        let net = self.root_dir(id).join(crate::net::NET_DIR);
        let layer = crate::net::Host::new(self.options.net.clone());
        let detaching = net
            .exists()
            .then(|| tokio::task::spawn_blocking(move || layer.detach(&net)));
        let mut gone = true;
        // A grouped container's delete may end its group's shim: not under a joiner.
        if let Some(groups) = &self.options.shim_groups {
            groups.leaving(id).await;
        }
        match c.task_delete(id).await {
            Ok(_) => {}
            Err(e) => {
                gone = false;
                first_error = first_error.or(Some(e));
            }
        }
        if let Some(detaching) = detaching {
            let detached = detaching
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r.map_err(|e| e.to_string()));
            if let Err(e) = detached {
                tracing::warn!(container = id, error = %e, "could not detach the container from the network");
                return Err(RuntimeError::Internal(format!(
                    "detaching {id} from the bridge network: {e}"
                )));
            }
        }
        // A remapped rootfs and workspace views are runner's own mounts: they go before the
        // snapshot under them, and before anything under the state dir is removed.
        // On the blocking pool, and at the open-files limit on the janitor (`runtime::janitor`).
        let (root, views) = (self.root_dir(id), self.run_dir.join(id).join(remap::VIEWS_DIR));
        let unmounted = janitor::cleanup(move || {
            for dir in [&root, &views] {
                late::release(dir).map_err(janitor::context(format!("unmounting {}", dir.display())))?;
            }
            Ok(())
        })
        .await;
        if let Err(e) = unmounted {
            tracing::warn!(container = id, error = %e, "could not unmount the container's mounts");
            return Err(RuntimeError::Io {
                what: format!("unmounting the mounts of {id}"),
                source: e,
            });
        }
        // Independent once the task is gone: the snapshot and the container record.
        let (snapshot, container) = tokio::join!(c.snapshot_remove(id), c.container_delete(id));
        gone &= container.is_ok();
        for e in [snapshot.err(), container.err()].into_iter().flatten() {
            first_error = first_error.or(Some(e));
        }
        // A member's late binds go before anything under the state dir is removed: removal
        // must never reach into a job's workspace.
        let late = self.late_dir(id);
        if late.exists() {
            let dir = late.clone();
            if let Err(e) = janitor::cleanup(move || late::release(&dir)).await {
                tracing::warn!(container = id, error = %e, "could not release the late binds");
                return Err(RuntimeError::Io {
                    what: format!("releasing {}", late.display()),
                    source: e,
                });
            }
        }
        if let Err(e) = self.discard_run_dir(id, gone).await {
            tracing::warn!(container = id, error = %e, "could not remove the run directory");
        }
        match first_error {
            Some(e) => {
                tracing::warn!(container = id, error = %e, "teardown incomplete");
                Err(e.into())
            }
            None => Ok(()),
        }
    }

    /// Wait for a process, riding out a containerd restart (the shim keeps the process).
    pub(super) async fn wait(&self, id: &str, exec_id: &str) -> Result<client::Exit, CtdError> {
        let start = Instant::now();
        loop {
            match self.client.task_wait(id, exec_id).await {
                // Wait is idempotent: any failure but "no such task" may be the daemon
                // restarting under us (the connection drops mid-call), so ask again.
                Err(e) if !e.is_not_found() && start.elapsed() < RECONNECT_LIMIT => {
                    tracing::debug!(error = %e, "waiting for the task failed; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => return other,
            }
        }
    }

    /// Re-adopt a one-shot container whose runner died: wait for its task (it may have
    /// ended already), take the output the shim-run logger kept, tear the container down.
    pub async fn adopt(
        &self,
        id: &str,
        expect_marker: bool,
        limit: Option<Duration>,
        cancel: &CancellationToken,
    ) -> Result<ExecResult, RuntimeError> {
        let started = Instant::now();
        let waiter = {
            let engine = self.clone();
            let id = id.to_string();
            tokio::spawn(async move { engine.wait(&id, "").await })
        };
        let outcome = self.supervise(id, "", waiter, limit, cancel, None).await;
        let stats = cgroupfs::read(&self.cgroup_path(id));
        // The shim closes the logger's pipes only when the task is deleted.
        let output = match &outcome {
            Ok(_) => match self.client.task_delete(id).await {
                Ok(_) => self.logged_output(id, started).await,
                Err(e) => Err(e.into()),
            },
            Err(_) => Ok(Default::default()),
        };
        // Torn down whatever happened above: nothing of an adopted job is left behind.
        let teardown = self.teardown_inner(id, outcome.is_ok()).await;
        let (exit, timed_out, interrupted) = outcome?;
        let (out, err) = output?;
        teardown?;
        let end = TaskEnd {
            exit,
            timed_out,
            interrupted,
            duration: started.elapsed(),
        };
        Ok(task_result(end, expect_marker, out, err, stats, started))
    }

    /// Run one job to completion in a fresh container: setup + command in one task.
    pub async fn run_oneshot(&self, plan: &RunPlan, cancel: &CancellationToken) -> Result<ExecResult, RuntimeError> {
        let prepared = self.on_setup_snapshot(plan).await;
        let plan = prepared.as_ref().unwrap_or(plan);
        let result = self.run_oneshot_inner(plan, cancel).await;
        // Every process of the sandbox is dead by now (its task exited or was killed).
        sweep_setid(plan.workspace.as_deref()).await;
        result
    }

    async fn run_oneshot_inner(&self, plan: &RunPlan, cancel: &CancellationToken) -> Result<ExecResult, RuntimeError> {
        let t0 = Instant::now();
        let mut image = None;
        let mut cold = None;
        if self.options.use_pools {
            match self.claim(plan, pool::KIND_POOLED).await {
                Ok(pool::Claim::Member(member)) => match self.run_pooled(*member, plan, cancel).await {
                    // Torn down already, before anything of the job ran in it: as when the
                    // claim itself fails.
                    Err(RuntimeError::MemberLost(why)) => {
                        tracing::warn!(why, "the claimed pool member went away; running cold");
                        cold = Some(format!("the claimed pool member went away: {why}"));
                    }
                    result => return result,
                },
                Ok(pool::Claim::Cold(resolved, why)) => {
                    image = resolved;
                    cold = Some(why);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "claiming a pool member failed; running cold");
                    cold = Some(format!("claiming a pool member failed: {e}"));
                }
            }
        }
        let created = self.create(plan, image, None, "oneshot", false, None).await?;
        tracing::debug!(ms = t0.elapsed().as_secs_f64() * 1e3, "container created");
        let result = self.run_created(plan, &created, cancel).await;
        tracing::debug!(ms = t0.elapsed().as_secs_f64() * 1e3, "task finished");
        // A result means we saw the task exit; an error may have left it running.
        let teardown = self.teardown_inner(&created.id, result.is_ok()).await;
        tracing::debug!(ms = t0.elapsed().as_secs_f64() * 1e3, "torn down");
        let mut result = result?;
        teardown?;
        result.cold_start = cold;
        Ok(result)
    }

    async fn run_created(
        &self,
        plan: &RunPlan,
        created: &Created,
        cancel: &CancellationToken,
    ) -> Result<ExecResult, RuntimeError> {
        let job = plan.job();
        let id = &created.id;
        let durable = self.options.durable_output;
        // stdin, when the job has one, is a file in the container (see `create`).
        let fifos = Fifos::create(&self.run_dir.join(id), "init", false, !durable)?;
        let expect_marker = spec::runs_setup(job, plan.env());
        let limit = self.options.output_limit;
        let mut stdio = fifos.stdio();
        // Durable output goes through the shim-run logger; otherwise we read the FIFOs.
        let pumps = if durable {
            let exe = self.runner_exe("the output logger")?;
            let live = self.options.live_output.as_deref();
            let uri = logger::uri(&exe, &self.output_dir(id), expect_marker, limit, live);
            stdio.stdout = uri.clone();
            stdio.stderr = uri;
            None
        } else {
            Some(OutputPump::start(&fifos, expect_marker, limit)?)
        };
        let started = Instant::now();
        // Its baseline is measured beside Tasks.Create and is there before the command starts.
        let (storage, baselined) = self.watch_storage(plan, id, &created.cgroup, created.upper.clone(), None);
        let (_, mounts) = self.create_task(created, &stdio).await?;
        let waiter = {
            let engine = self.clone();
            let id = id.clone();
            tokio::spawn(async move { engine.wait(&id, "").await })
        };
        baselined.wait().await?;
        self.start_task(id, mounts).await?;
        crate::metrics::observe(OPERATION_SECONDS, &[("op", "start")], started.elapsed());
        let deadline = job.timeout.into_iter().chain(job.active_deadline).min();
        // An eviction ends the wait as a cancel would (the watch has killed the task already).
        let stop = cancel.child_token();
        let _stop_on_eviction = stop_on(&storage, &stop);
        let (exit, timed_out, interrupted) = self
            .supervise(
                id,
                "",
                waiter,
                deadline.map(|d| d.saturating_sub(started.elapsed())),
                &stop,
                None,
            )
            .await?;
        let evicted = final_verdict(&storage, exit.status != 0).await;
        let interrupted = interrupted && evicted.is_none();
        let duration = started.elapsed();
        let stats = cgroupfs::read(&created.cgroup);
        let (out, err) = match pumps {
            Some(pumps) => pumps.finish(DRAIN_LIMIT, false).await,
            None => {
                // The shim closes the logger's pipes only when the task is deleted.
                self.client.task_delete(id).await?;
                self.logged_output(id, started).await?
            }
        };
        let end = TaskEnd {
            exit,
            timed_out,
            interrupted,
            duration,
        };
        let mut result = task_result(end, expect_marker, out, err, stats, started);
        if let (Some(_), Some(code)) = (&evicted, result.exit_code.filter(|c| *c > 128)) {
            result.signal = Some(code - 128);
        }
        result.evicted = evicted;
        Ok(result)
    }

    /// What the shim-run logger wrote (it finishes once the task's output reaches EOF). No
    /// output record is our failure, never silently an empty output.
    async fn logged_output(&self, id: &str, started: Instant) -> Result<(io::StreamOut, io::StreamOut), RuntimeError> {
        let dir = self.output_dir(id);
        let begin = Instant::now();
        loop {
            if let Some(record) = logger::read_output(&dir) {
                let convert = |r: logger::StreamRecord| io::StreamOut {
                    setup: r.setup,
                    command: r.command,
                    setup_status: r.setup_status,
                    setup_at: r.setup_ms.map(|ms| started + Duration::from_millis(ms)),
                };
                return Ok((convert(record.stdout), convert(record.stderr)));
            }
            if begin.elapsed() > DRAIN_LIMIT {
                return Err(RuntimeError::Internal(format!(
                    "the output logger of {id} wrote nothing within {DRAIN_LIMIT:?} (is the logger binary runner?)"
                )));
            }
            // The logger writes within a few ms of the EOF that Tasks.Delete gives it: poll
            // finely at first (a 5 ms step cost 2.5 ms per job on average), then back off.
            let step = if begin.elapsed() < Duration::from_millis(50) {
                1
            } else {
                10
            };
            tokio::time::sleep(Duration::from_millis(step)).await;
        }
    }

    /// Watch a container's ephemeral storage (its writable layer, agent directory and
    /// workspace, see `runtime::storage`). When it goes over its limit every process of it is
    /// killed at once: a sandbox writing at disk speed gets no grace period to write more.
    /// Its baseline is being measured on the blocking pool: wait for it before the sandbox's
    /// command starts.
    pub(super) fn watch_storage(
        &self,
        plan: &RunPlan,
        id: &str,
        cgroup: &str,
        upper: Option<PathBuf>,
        agent: Option<&Path>,
    ) -> (Arc<StorageWatch>, Baselined) {
        let trees = (upper.map(|u| (StorageTree::WritableLayer, u)).into_iter())
            .chain(agent.map(|a| (StorageTree::AgentDir, a.to_path_buf())))
            .chain(plan.workspace.clone().map(|w| (StorageTree::Workspace, w)));
        self.watch_storage_trees(plan, id, cgroup, trees.collect())
    }

    /// `watch_storage` of the trees given.
    pub(super) fn watch_storage_trees(
        &self,
        plan: &RunPlan,
        id: &str,
        cgroup: &str,
        trees: Vec<(StorageTree, PathBuf)>,
    ) -> (Arc<StorageWatch>, Baselined) {
        let watch = Arc::new(
            self.storage
                .watch(plan.env().resources.ephemeral_storage.0, Some(cgroup.to_string())),
        );
        watch.hold_for_baseline();
        for (kind, path) in trees {
            watch.add(kind, path);
        }
        let baselined = baseline(&watch);
        let (client, id) = (self.client.clone(), id.to_string());
        let (evicted, ended) = (watch.evicted().clone(), watch.ended().clone());
        tokio::spawn(async move {
            tokio::select! {
                () = evicted.cancelled() => {
                    if let Err(e) = client.task_kill(&id, "", SIGKILL, true).await {
                        tracing::warn!(container = id, error = %e, "killing an evicted sandbox");
                    }
                }
                () = ended.cancelled() => {}
            }
        });
        (watch, baselined)
    }

    /// Wait for the process for at most `limit` more; on timeout or cancel, SIGTERM (the whole container for the init,
    /// the process for an exec), a grace period, then SIGKILL. Returns (exit, timed out, interrupted).
    pub(super) async fn supervise(
        &self,
        id: &str,
        exec_id: &str,
        mut waiter: tokio::task::JoinHandle<Result<client::Exit, CtdError>>,
        limit: Option<Duration>,
        cancel: &CancellationToken,
        group: Option<u32>,
    ) -> Result<(client::Exit, bool, bool), RuntimeError> {
        let all = exec_id.is_empty();
        let sleep = async {
            match limit {
                Some(l) => tokio::time::sleep(l).await,
                None => std::future::pending().await,
            }
        };
        let (timed_out, interrupted) = tokio::select! {
            r = &mut waiter => return Ok((join(r)?, false, false)),
            () = sleep => (true, false),
            () = cancel.cancelled() => (false, true),
        };
        let _ = self.client.task_kill(id, exec_id, SIGTERM, all).await;
        signal_group(group, Signal::SIGTERM);
        let result = match tokio::time::timeout(self.options.kill_grace, &mut waiter).await {
            Ok(r) => Ok((join(r)?, timed_out, interrupted)),
            Err(_) => {
                signal_group(group, Signal::SIGKILL);
                self.client.task_kill(id, exec_id, SIGKILL, all).await?;
                Ok((join(waiter.await)?, timed_out, interrupted))
            }
        };
        // Children of an exec that outlived it (SIGTERM ignored) die with their group.
        signal_group(group, Signal::SIGKILL);
        result
    }
}

/// How a one-shot task ended.
pub(super) struct TaskEnd {
    pub(super) exit: client::Exit,
    pub(super) timed_out: bool,
    pub(super) interrupted: bool,
    pub(super) duration: Duration,
}

/// A one-shot task's result: its exit, its output split at the setup marker, and the
/// container's cgroup counters (OOM kills decide `oomKilled`, never the exit code alone).
pub(super) fn task_result(
    end: TaskEnd,
    expect_marker: bool,
    out: io::StreamOut,
    err: io::StreamOut,
    stats: cgroupfs::CgroupStats,
    started: Instant,
) -> ExecResult {
    let status = end.exit.status;
    let oom = stats.oom_kills.is_some_and(|n| n > 0);
    let setup = expect_marker.then(|| SetupResult {
        // No marker: the task ended during setup, whose status is then the task's.
        exit_code: out.setup_status.or(Some(status as i32)),
        stdout: out.setup.text.clone(),
        stderr: err.setup.text.clone(),
        stdout_dropped_bytes: out.setup.dropped_bytes,
        stderr_dropped_bytes: err.setup.dropped_bytes,
        timed_out: end.timed_out && out.setup_status.is_none(),
        duration_ms: out
            .setup_at
            .map(|t| t.saturating_duration_since(started).as_millis() as u64)
            .unwrap_or(0),
    });
    let killed = end.timed_out || end.interrupted || oom;
    ExecResult {
        exit_code: Some(status as i32),
        signal: (killed && status > 128).then(|| status as i32 - 128),
        timed_out: end.timed_out,
        oom_killed: oom,
        stdout: out.command.text,
        stderr: err.command.text,
        stdout_dropped_bytes: out.command.dropped_bytes,
        stderr_dropped_bytes: err.command.dropped_bytes,
        setup,
        duration_ms: end.duration.as_millis() as u64,
        peak_memory_bytes: stats.peak_memory,
        cpu_time_ms: stats.cpu_usage.map(|d| d.as_millis() as u64),
        pool: None,
        cold_start: None,
        evicted: None,
    }
}

/// Signal the process group an exec leads, from the host. Only groups led by a process of
/// ours are signalled: `group` is the PID Tasks.Start returned for the exec.
pub(super) fn signal_group(group: Option<u32>, signal: Signal) {
    if let Some(pgid) = group.and_then(|g| i32::try_from(g).ok()).filter(|g| *g > 1) {
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid), signal);
    }
}

/// Whether the sandbox was evicted, once its command ended: a command that failed is measured
/// again first (one that ran into the limit ends before the next periodic walk).
pub(super) async fn final_verdict(storage: &Arc<StorageWatch>, failed: bool) -> Option<String> {
    if !failed || storage.verdict().is_some() {
        return storage.verdict();
    }
    let storage = storage.clone();
    tokio::task::spawn_blocking(move || storage.check_now())
        .await
        .ok()
        .flatten()
}

/// A watched sandbox's baseline being measured (`StorageWatch::baseline`), on the blocking
/// pool: started before Tasks.Create, waited for before Tasks.Start.
pub(super) struct Baselined(tokio::task::JoinHandle<()>);

fn baseline(storage: &Arc<StorageWatch>) -> Baselined {
    let storage = storage.clone();
    Baselined(tokio::task::spawn_blocking(move || storage.baseline()))
}

impl Baselined {
    pub(super) async fn wait(self) -> Result<(), RuntimeError> {
        self.0
            .await
            .map_err(|e| RuntimeError::Internal(format!("measuring the sandbox's storage baseline: {e}")))
    }
}

/// Cancel `stop` when the watched sandbox is evicted; the task ends with the returned guard.
fn stop_on(storage: &StorageWatch, stop: &CancellationToken) -> tokio_util::sync::DropGuard {
    let (evicted, stop, done) = (storage.evicted().clone(), stop.clone(), CancellationToken::new());
    let guard = done.clone().drop_guard();
    tokio::spawn(async move {
        tokio::select! {
            () = evicted.cancelled() => stop.cancel(),
            () = done.cancelled() => {}
        }
    });
    guard
}

/// Clear the setuid and setgid bits a sandbox left in its workspace (see
/// `confined::Root::clear_setid`), once every process of the sandbox is dead: the next attempt,
/// a later reader and any local user who can reach the workspace get no file that runs as its
/// owner. On the blocking pool: the walk takes as long as the tree is large.
pub(super) async fn sweep_setid(workspace: Option<&Path>) {
    let Some(ws) = workspace.map(Path::to_path_buf) else {
        return;
    };
    let shown = ws.display().to_string();
    let swept =
        tokio::task::spawn_blocking(move || crate::confined::Root::open(&ws).and_then(|root| root.clear_setid())).await;
    match swept {
        Ok(Ok(report)) if report.cleared > 0 => tracing::warn!(
            workspace = shown,
            files = report.cleared,
            "cleared the setuid/setgid bits of files the sandbox left in its workspace"
        ),
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::warn!(workspace = shown, error = %e, "clearing setuid/setgid bits in the workspace"),
        Err(e) => tracing::warn!(workspace = shown, error = %e, "clearing setuid/setgid bits in the workspace"),
    }
}

/// The labels that say where a container's workspace is (none when it mounts none).
pub(super) fn workspace_labels(plan: &RunPlan) -> Vec<(String, String)> {
    match &plan.workspace {
        Some(ws) if plan.env().mount_workspace => vec![
            (LABEL_WORKSPACE.to_string(), ws.display().to_string()),
            (LABEL_WORKSPACE_TARGET.to_string(), plan.env().workdir.clone()),
        ],
        _ => Vec::new(),
    }
}
