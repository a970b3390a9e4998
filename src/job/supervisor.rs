//! Carries one Job to its end: feeds the controller, runs the attempts it asks for, persists
//! every transition, writes each attempt's output to log files. Runs inside `runner apply`
//! (foreground) or as a detached `runner supervise` process (`apply --detach`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::controller::{self, Action, AttemptState, Event, JobPolicy, JobState, Outcome};
use super::store::{EventRecord, SharedStore, StoreError};
use super::{AttemptStatus, AttemptView, Condition, JobStatus, Phase, Reason, rfc3339};
use crate::manifest::Job;
use crate::owner::owner_id;
use crate::runtime::containerd::pool::KIND_POOLED;
use crate::runtime::containerd::{Engine, LABEL_ATTEMPT, LABEL_INDEX, LABEL_KIND};
use crate::runtime::{ExecResult, NetworkHook, NetworkStatus, RuntimeOptions};
use crate::spec::{HostEnv, RunPlan};

/// Environment variable with the completion index of an Indexed Job's attempt.
pub const COMPLETION_INDEX_VAR: &str = "JOB_COMPLETION_INDEX";
/// Tests shorten Kubernetes' 10 s retry backoff with this (milliseconds).
/// How often a supervisor looks for a delete request.
const DELETE_POLL: Duration = Duration::from_millis(200);

/// Where an attempt's output and result are kept.
pub fn attempt_file(logs_dir: &Path, job: &str, index: u32, attempt: u32, ext: &str) -> PathBuf {
    logs_dir.join(job).join(format!("{index}-{attempt}.{ext}"))
}

/// The controller's view of a Job's spec; `backoff_base` is the first retry delay
/// (`Config::backoff_base`).
pub fn policy_of(job: &Job, backoff_base: Duration) -> JobPolicy {
    let base = backoff_base.as_millis() as u64;
    JobPolicy {
        completions: job.completions,
        parallelism: job.parallelism,
        indexed: job.indexed,
        backoff_limit: job.backoff_limit,
        active_deadline_ms: job.active_deadline.map(|d| d.as_millis() as u64),
        rules: job.failure_rules.clone(),
        backoff_base_ms: base,
        backoff_cap_ms: controller::BACKOFF_CAP.as_millis() as u64,
    }
}

/// Everything needed to run the attempts of one Job.
pub struct JobContext {
    pub plan: RunPlan,
    /// The first retry delay (`Config::backoff_base`).
    pub backoff_base: Duration,
    pub host: HostEnv,
    pub options: RuntimeOptions,
    pub engine: Option<Engine>,
    pub state_dir: PathBuf,
    pub store: SharedStore,
}

impl JobContext {
    pub fn logs_dir(&self) -> PathBuf {
        self.state_dir.join("logs")
    }
}

fn outcome_of(status: &AttemptStatus) -> Outcome {
    match (status.phase, status.reason) {
        (_, Reason::InfraError) => Outcome::Infra {
            message: status.message.clone().unwrap_or_default(),
        },
        (Phase::Succeeded, _) => Outcome::Succeeded,
        _ => Outcome::Failed {
            exit_code: status.result.as_ref().map(|r| r.status_code()).unwrap_or(1),
            reason: status.reason,
            // Where the attempt says why (the registry's answer when no command ran, a command
            // that could not start, one the seccomp filter killed, an eviction, the memory limit
            // an OOM kill reached), the Job says it too.
            message: matches!(
                status.reason,
                Reason::ErrImagePull
                    | Reason::Error
                    | Reason::Evicted
                    | Reason::CreateContainerError
                    | Reason::OomKilled
            )
            .then(|| status.message.clone())
            .flatten(),
        },
    }
}

fn now_rfc3339() -> String {
    rfc3339(SystemTime::now())
}

async fn event(store: &SharedStore, job: &str, kind: &str, reason: &str, message: String) {
    let record = EventRecord {
        time: now_rfc3339(),
        kind: kind.into(),
        reason: reason.into(),
        message,
    };
    let job = job.to_string();
    if let Err(e) = store.call(move |s| s.add_event(&job, &record)).await {
        tracing::warn!(error = %e, "recording an event failed");
    }
}

/// Milliseconds since an RFC 3339 time.
fn ms_since(time: &str) -> Option<u64> {
    let t = humantime::parse_rfc3339(time).ok()?;
    Some(t.elapsed().ok()?.as_millis() as u64)
}

/// Rebuild the controller's state from a stored status (re-adoption).
fn state_from(status: &JobStatus) -> JobState {
    let mut state = JobState {
        started_ms: Some(0),
        ..JobState::default()
    };
    for v in &status.attempts {
        let attempt_state = match (v.phase, v.reason) {
            (Phase::Running, _) | (Phase::Pending, _) => AttemptState::Running,
            (Phase::Succeeded, _) => AttemptState::Succeeded,
            (_, Some(Reason::InfraError)) => AttemptState::Infra,
            (_, Some(Reason::Interrupted)) => AttemptState::Killed,
            _ if v.counted => AttemptState::Failed,
            _ => AttemptState::Ignored,
        };
        match attempt_state {
            AttemptState::Succeeded => {
                state.succeeded.insert(v.index);
            }
            AttemptState::Failed => state.counted_failures += 1,
            AttemptState::Infra => state.infra_failures += 1,
            _ => {}
        }
        state.attempts.push(controller::Attempt {
            index: v.index,
            number: v.attempt,
            state: attempt_state,
            started_ms: 0,
        });
    }
    state
}

/// Run the Job named `name` (already in the store) to its end. With `adopt`, pick up a job
/// whose supervisor died: its running attempts are re-adopted by label, its history kept.
pub async fn supervise(
    ctx: JobContext,
    name: &str,
    cancel: CancellationToken,
    adopt: bool,
) -> Result<JobStatus, StoreError> {
    let store = ctx.store.clone();
    let policy = policy_of(ctx.plan.job(), ctx.backoff_base);
    let record = {
        let name = name.to_string();
        store
            .call(move |s| {
                s.update(&name, |r| {
                    r.owner = Some(owner_id());
                })
            })
            .await?
    };
    let stored = record.status;
    let start_wall = match (&stored.start_time, adopt) {
        (Some(t), true) => t.clone(),
        _ => now_rfc3339(),
    };
    let verb = if adopt { "Adopted" } else { "Started" };
    event(
        &store,
        name,
        "Normal",
        verb,
        format!("supervisor pid {}", std::process::id()),
    )
    .await;
    let logs_dir = ctx.logs_dir();
    let _ = std::fs::create_dir_all(logs_dir.join(name));

    // The clock is "ms since the job started", across supervisors, so deadlines hold.
    let offset = if adopt { ms_since(&start_wall).unwrap_or(0) } else { 0 };
    let t0 = Instant::now();
    let now = || offset + t0.elapsed().as_millis() as u64;
    let mut state = if adopt {
        state_from(&stored)
    } else {
        JobState::default()
    };
    let mut views: Vec<AttemptView> = if adopt { stored.attempts.clone() } else { Vec::new() };
    let mut results: HashMap<(u32, u32), ExecResult> = HashMap::new();
    let mut tokens: HashMap<(u32, u32), CancellationToken> = HashMap::new();
    let (tx, mut rx) = mpsc::unbounded_channel::<(u32, u32, AttemptStatus)>();
    // What each attempt's container got on its network, as soon as it is attached.
    let (net_tx, mut net_rx) = mpsc::unbounded_channel::<(u32, u32, NetworkStatus)>();
    if adopt {
        for v in views.iter().filter(|v| v.phase == Phase::Running) {
            let token = CancellationToken::new();
            tokens.insert((v.index, v.attempt), token.clone());
            readopt(&ctx, name, v, token, tx.clone()).await;
        }
    }
    let mut actions = controller::step(&policy, &mut state, Event::Tick, now());
    let mut last_delete_poll = Instant::now();
    let mut deleted = false;
    loop {
        let mut done = false;
        for action in actions.drain(..) {
            match action {
                Action::Launch { index, number } => {
                    let token = CancellationToken::new();
                    tokens.insert((index, number), token.clone());
                    views.push(AttemptView {
                        index,
                        attempt: number,
                        phase: Phase::Running,
                        reason: None,
                        exit_code: None,
                        message: None,
                        start_time: Some(now_rfc3339()),
                        completion_time: None,
                        counted: false,
                        network: None,
                        pool: None,
                        cold_start: None,
                    });
                    event(
                        &store,
                        name,
                        "Normal",
                        "AttemptStarted",
                        format!("index {index}, attempt {number}"),
                    )
                    .await;
                    launch(&ctx, policy.indexed, (index, number), token, tx.clone(), net_tx.clone());
                }
                Action::KillAll => {
                    for token in tokens.values() {
                        token.cancel();
                    }
                }
                Action::Done => done = true,
            }
        }
        let status = status_of(&state, &views, &results, &start_wall, done);
        {
            let (name, status) = (name.to_string(), status.clone());
            store
                .call(move |s| {
                    s.update(&name, |r| {
                        r.status = status;
                        if done {
                            r.finished_at = SystemTime::now()
                                .duration_since(SystemTime::UNIX_EPOCH)
                                .ok()
                                .map(|d| d.as_secs() as i64);
                        }
                    })
                })
                .await?;
        }
        if done {
            if let Some((phase, reason, message)) = &state.terminal {
                let kind = if *phase == Phase::Succeeded {
                    "Normal"
                } else {
                    "Warning"
                };
                event(&store, name, kind, &format!("{reason:?}"), message.clone()).await;
            }
            return Ok(status);
        }
        let wake = state.next_wake(&policy).map(|w| w.saturating_sub(now()));
        let sleep = async {
            match wake {
                Some(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
                None => std::future::pending().await,
            }
        };
        // Biased, the network notice first: an attempt's task sends it (at its attach) before
        // its result, and a supervisor busy with the store can find both queued. Picked at
        // random, the result could come first and, for the last attempt, end the Job with the
        // notice unread (no `network` in its status, no `Attached` event).
        tokio::select! {
            biased;
            Some((index, number, network)) = net_rx.recv() => {
                if let Some(v) = views.iter_mut().find(|v| v.index == index && v.attempt == number) {
                    let ports: Vec<String> = network.ports.iter().map(ToString::to_string).collect();
                    v.network = Some(network.clone());
                    event(&store, name, "Normal", "Attached", format!("index {index}, attempt {number}: {}{}{}", network.ip, if ports.is_empty() { "" } else { ", ports " }, ports.join(", "))).await;
                }
            }
            Some((index, number, attempt)) = rx.recv() => {
                tokens.remove(&(index, number));
                let outcome = outcome_of(&attempt);
                if let Some(result) = &attempt.result {
                    write_attempt(&logs_dir, name, index, number, result);
                    results.insert((index, number), result.clone());
                }
                let was_killing = state.killing;
                actions = controller::step(&policy, &mut state, Event::Finished { index, number, outcome }, now());
                if let Some(v) = views.iter_mut().find(|v| v.index == index && v.attempt == number) {
                    let a = state.attempts.iter().find(|a| a.index == index && a.number == number);
                    v.phase = if attempt.phase == Phase::Succeeded { Phase::Succeeded } else { Phase::Failed };
                    // Stopped by the Job's end: interrupted; one that succeeded meanwhile, succeeded.
                    v.reason = Some(if was_killing && attempt.phase != Phase::Succeeded {
                        Reason::Interrupted
                    } else {
                        attempt.reason
                    });
                    v.exit_code = attempt.result.as_ref().and_then(|r| r.exit_code);
                    v.message = attempt.message.clone();
                    v.completion_time = Some(now_rfc3339());
                    v.counted = a.is_some_and(|a| a.state == AttemptState::Failed);
                    v.pool = attempt.result.as_ref().and_then(|r| r.pool.clone());
                    v.cold_start = attempt.result.as_ref().and_then(|r| r.cold_start.clone());
                }
                // Where it ran, said as the kubelet says where a pod was scheduled.
                if let Some(r) = &attempt.result {
                    match (&r.pool, &r.cold_start) {
                        (Some(pool), _) => event(&store, name, "Normal", "Pooled", format!("index {index}, attempt {number}: a member of pool {pool}")).await,
                        (None, Some(why)) => event(&store, name, "Normal", "ColdStart", format!("index {index}, attempt {number}: {why}")).await,
                        (None, None) => {}
                    }
                }
                event(&store, name, "Normal", "AttemptFinished", format!("index {index}, attempt {number}: {:?}", attempt.reason)).await;
            }
            () = sleep => actions = controller::step(&policy, &mut state, Event::Tick, now()),
            () = cancel.cancelled(), if !deleted => {
                deleted = true;
                actions = controller::step(&policy, &mut state, Event::Stop, now());
            }
            () = tokio::time::sleep(DELETE_POLL) => {
                if !deleted && last_delete_poll.elapsed() >= DELETE_POLL {
                    last_delete_poll = Instant::now();
                    let job = name.to_string();
                    if store.call(move |s| s.get(&job)).await?.is_some_and(|r| r.delete_requested) {
                        deleted = true;
                        actions = controller::step(&policy, &mut state, Event::Delete, now());
                    }
                }
            }
        }
    }
}

fn write_attempt(logs_dir: &Path, job: &str, index: u32, number: u32, result: &ExecResult) {
    let write = |ext: &str, data: &[u8]| {
        if let Err(e) = std::fs::write(attempt_file(logs_dir, job, index, number, ext), data) {
            tracing::warn!(error = %e, "writing attempt output failed");
        }
    };
    write("stdout", result.stdout.as_bytes());
    write("stderr", result.stderr.as_bytes());
    write("json", serde_json::to_string(result).unwrap_or_default().as_bytes());
}

/// Start one attempt in the background; its status comes back on `tx`.
fn launch(
    ctx: &JobContext,
    indexed: bool,
    (index, number): (u32, u32),
    token: CancellationToken,
    tx: mpsc::UnboundedSender<(u32, u32, AttemptStatus)>,
    net_tx: mpsc::UnboundedSender<(u32, u32, NetworkStatus)>,
) {
    let mut plan = ctx.plan.clone();
    if indexed {
        plan.bound
            .env
            .env
            .insert(COMPLETION_INDEX_VAR.into(), index.to_string());
    }
    plan.labels.insert(LABEL_INDEX.into(), index.to_string());
    plan.labels.insert(LABEL_ATTEMPT.into(), number.to_string());
    // The controller owns the job-wide deadline; an attempt has only its own timeout.
    plan.bound.job.active_deadline = None;
    let host = ctx.host.clone();
    let mut options = ctx.options.clone();
    options.kill_grace = ctx.plan.job().termination_grace;
    options.on_network = Some(NetworkHook(std::sync::Arc::new(move |n: &NetworkStatus| {
        let _ = net_tx.send((index, number, n.clone()));
    })));
    // The output must outlive this process: a re-adopting supervisor collects it.
    options.durable_output = true;
    options.live_output = Some(attempt_file(
        &ctx.logs_dir(),
        ctx.plan.job().name.as_str(),
        index,
        number,
        "live",
    ));
    let engine = ctx.engine.clone().map(|e| e.with_options(options.clone()));
    tokio::spawn(async move {
        let status = super::run_once(&plan, &host, &options, engine.as_ref(), &token).await;
        let _ = tx.send((index, number, status));
    });
}

/// Pick up an attempt that was running under a dead supervisor: find its container by
/// label and wait for it; a vanished container is an infrastructure failure (retried).
async fn readopt(
    ctx: &JobContext,
    job: &str,
    view: &AttemptView,
    token: CancellationToken,
    tx: mpsc::UnboundedSender<(u32, u32, AttemptStatus)>,
) {
    let (index, number) = (view.index, view.attempt);
    let infra = |message: String| AttemptStatus::failed(Reason::InfraError, message, None);
    let Some(engine) = ctx.engine.clone() else {
        let _ = tx.send((
            index,
            number,
            infra("host-backend attempts cannot be re-adopted".into()),
        ));
        return;
    };
    let found = engine
        .job_containers(job, Some((index, number)))
        .await
        .ok()
        .and_then(|c| c.into_iter().next());
    let Some(container) = found else {
        let _ = tx.send((index, number, infra("the attempt's container vanished".into())));
        return;
    };
    // A pooled attempt's output went to the process that died: nothing can collect it.
    if container.labels.get(LABEL_KIND).map(String::as_str) == Some(KIND_POOLED) {
        let _ = engine.teardown(&container.id).await;
        let _ = tx.send((
            index,
            number,
            infra("the attempt ran in a warm pool member and its supervisor died with its output".into()),
        ));
        return;
    }
    let expect_marker = crate::spec::runs_setup(ctx.plan.job(), ctx.plan.env());
    let limit = ctx.plan.job().timeout.map(|t| {
        let elapsed = view.start_time.as_deref().and_then(ms_since).unwrap_or(0);
        t.saturating_sub(Duration::from_millis(elapsed))
    });
    let mut options = engine.options().clone();
    options.kill_grace = ctx.plan.job().termination_grace;
    let engine = engine.with_options(options);
    let memory = ctx.plan.env().resources.memory;
    tokio::spawn(async move {
        let status = match engine.adopt(&container.id, expect_marker, limit, &token).await {
            Ok(result) => AttemptStatus::of(result, false, memory),
            Err(e) => infra(e.to_string()),
        };
        let _ = tx.send((index, number, status));
    });
}

/// The Job's status as the controller state and the attempts so far say.
fn status_of(
    state: &JobState,
    views: &[AttemptView],
    results: &HashMap<(u32, u32), ExecResult>,
    start: &str,
    done: bool,
) -> JobStatus {
    let mut status = JobStatus::pending();
    status.phase = Phase::Running;
    status.start_time = Some(start.to_string());
    status.active = state.active();
    status.succeeded = state.succeeded_count();
    status.failed = state.failed_count();
    status.attempts = views.to_vec();
    if let (true, Some((phase, reason, message))) = (done, &state.terminal) {
        status.phase = *phase;
        status.reason = Some(*reason);
        status.message = (!message.is_empty()).then(|| message.clone());
        let now = now_rfc3339();
        status.completion_time = Some(now.clone());
        status.conditions = vec![Condition {
            kind: if *phase == Phase::Succeeded {
                "Complete".into()
            } else {
                "Failed".into()
            },
            status: "True".into(),
            reason: serde_json::to_value(reason)
                .ok()
                .and_then(|v| v.as_str().map(String::from))
                .unwrap_or_default(),
            message: message.clone(),
            last_transition_time: now,
        }];
        // The deciding attempt: the last one to finish that matches the outcome.
        let deciding = views
            .iter()
            .rev()
            .find(|v| (v.phase == Phase::Succeeded) == (*phase == Phase::Succeeded) && v.completion_time.is_some());
        status.result = deciding.and_then(|v| results.get(&(v.index, v.attempt)).cloned());
    }
    status
}
