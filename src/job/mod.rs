//! Jobs with Kubernetes batch/v1 semantics: `controller` decides (pure), `supervisor` acts
//! and persists in `store`; this module runs single attempts and defines the statuses.

use std::time::{Duration, Instant, SystemTime};

pub mod controller;
pub mod kube;
pub mod selector;
pub mod store;
pub mod supervisor;

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::manifest::{Backend, Job};
use crate::runtime::containerd::Engine;
use crate::runtime::{self, ExecRequest, ExecResult, Runtime, RuntimeError, RuntimeOptions};
use crate::spec::{HostEnv, RunPlan};

/// `apiVersion` we print.
pub const API_VERSION: &str = crate::manifest::API_VERSION;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum Phase {
    Pending,
    Running,
    Succeeded,
    Failed,
}

/// Why a job ended as it did: a closed set (docs/reference/manifest.md, Results).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum Reason {
    Completed,
    Error,
    #[serde(rename = "OOMKilled")]
    OomKilled,
    Timeout,
    DeadlineExceeded,
    SetupFailed,
    BackoffLimitExceeded,
    /// Our fault, never the submission's.
    InfraError,
    /// The image is not present and could not be pulled (the registry's answer is the
    /// message), or `imagePullPolicy: Never` found none: Kubernetes' `ErrImagePull`.
    ErrImagePull,
    /// Stopped by the user (Ctrl-C, delete).
    Interrupted,
    /// A `podFailurePolicy` rule with action FailJob matched.
    PodFailurePolicy,
    /// The sandbox went over `resources.ephemeralStorage` and was killed (the kubelet's word).
    Evicted,
    /// The container could not be made from what the job asks for as things are now (a mount
    /// source in the workspace that an earlier attempt replaced with a link leaving it):
    /// the submission's doing, counted like a failed attempt (Kubernetes' word).
    CreateContainerError,
}

/// 128 + SIGSYS: how a process the seccomp filter killed ends.
const SIGSYS_STATUS: i32 = 128 + 31;

/// How one attempt ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AttemptStatus {
    pub phase: Phase,
    pub reason: Reason,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<ExecResult>,
}

impl AttemptStatus {
    /// The status a finished command gives its attempt; `memory` is its memory limit (an
    /// OOM kill names it).
    pub fn of(result: ExecResult, deadline_bound: bool, memory: crate::manifest::MemoryBytes) -> Self {
        let (phase, reason) = status_of(result.clone(), deadline_bound);
        // Our seccomp filter answers a refused syscall with EPERM; it kills (SIGSYS) only a
        // syscall of an ABI it does not admit: almost always a 32-bit program.
        let message = if reason == Reason::Evicted {
            result.evicted.clone()
        } else if reason == Reason::OomKilled {
            Some(format!(
                "killed: memory limit {memory} reached (exit code {}); raise resources.memory of its Environment",
                result.status_code()
            ))
        } else {
            (reason == Reason::Error && result.status_code() == SIGSYS_STATUS).then(|| {
                format!(
                    "exit code {SIGSYS_STATUS} (SIGSYS): in a container, a system call of an ABI the seccomp \
                     filter does not admit; a 32-bit program needs allow32BitSyscalls: true in its Environment"
                )
            })
        };
        AttemptStatus {
            phase,
            reason,
            message,
            result: Some(result),
        }
    }

    /// An attempt that failed before or without a command's own end.
    pub fn failed(reason: Reason, message: String, result: Option<ExecResult>) -> Self {
        AttemptStatus {
            phase: Phase::Failed,
            reason,
            message: Some(message),
            result,
        }
    }
}

/// A Job's condition (Kubernetes: Complete or Failed, with reason and message).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub kind: String,
    pub status: String,
    pub reason: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    pub last_transition_time: String,
}

/// One attempt as the Job's status lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AttemptView {
    pub index: u32,
    pub attempt: u32,
    pub phase: Phase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Why the attempt failed when its command's own end does not say (an infrastructure
    /// error, an interruption).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<String>,
    /// Whether this failure counted against backoffLimit.
    #[serde(default)]
    pub counted: bool,
    /// Its container's address and published ports (`network: bridge`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<crate::runtime::NetworkStatus>,
    /// The warm pool whose member ran it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Why a container was made for it though warm pools exist.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cold_start: Option<String>,
}

/// A Job's status: phase, reason and conditions, counts, times, its attempts, and the
/// `result` of the attempt that decided it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JobStatus {
    pub phase: Phase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default)]
    pub active: u32,
    #[serde(default)]
    pub succeeded: u32,
    #[serde(default)]
    pub failed: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attempts: Vec<AttemptView>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<ExecResult>,
}

impl JobStatus {
    pub fn pending() -> Self {
        JobStatus {
            phase: Phase::Pending,
            reason: None,
            message: None,
            active: 0,
            succeeded: 0,
            failed: 0,
            start_time: None,
            completion_time: None,
            conditions: Vec::new(),
            attempts: Vec::new(),
            result: None,
        }
    }

    pub fn is_terminal(&self) -> bool {
        matches!(self.phase, Phase::Succeeded | Phase::Failed)
    }

    /// CLI exit code: 0 succeeded, 1 the submission failed, 2 the runner could not do its
    /// work, 130 interrupted.
    pub fn exit_code(&self) -> i32 {
        match (self.phase, self.reason) {
            (Phase::Succeeded, _) => 0,
            (_, Some(Reason::InfraError)) => 2,
            (_, Some(Reason::Interrupted)) => 130,
            _ => 1,
        }
    }
}

/// The Job as printed by `apply -o json|yaml`.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JobObject {
    pub api_version: &'static str,
    pub kind: &'static str,
    pub metadata: ObjectMeta,
    pub spec: JobSpecView,
    pub status: JobStatus,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ObjectMeta {
    pub name: String,
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: std::collections::BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub annotations: std::collections::BTreeMap<String, String>,
}

/// The whole Job, resolved when it was submitted (its Environment may have come from an
/// env dir, its backend from `--backend`, its paths from the manifest's directory): what
/// `get` shows without re-reading anything, written so `runner apply` takes it back (a
/// Job's `status` is ignored there and `spec.backend` must match). Fields after
/// `completions` are absent from records written before they were kept.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JobSpecView {
    pub environment: String,
    pub backend: crate::manifest::Backend,
    pub command: Vec<String>,
    #[serde(default = "one")]
    pub completions: u32,
    /// Absolute: relative paths resolved against the manifest's directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<std::path::PathBuf>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub static_assets: Vec<StaticAssetView>,
    /// As written: a relative source is in the workspace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<MountView>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub disable_setup: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallelism: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_mode: Option<CompletionMode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff_limit: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_deadline_seconds: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds_after_finished: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub termination_grace_period_seconds: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_failure_policy: Option<PodFailurePolicyView>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StaticAssetView {
    pub source: std::path::PathBuf,
    pub save_path: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MountView {
    pub source: String,
    pub target: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum CompletionMode {
    NonIndexed,
    Indexed,
}

/// Kubernetes' shape of `podFailurePolicy`, as the manifest takes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodFailurePolicyView {
    pub rules: Vec<PodFailureRuleView>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodFailureRuleView {
    #[schemars(with = "String")]
    pub action: crate::manifest::policy::RuleAction,
    pub on_exit_codes: OnExitCodesView,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OnExitCodesView {
    #[schemars(with = "String")]
    pub operator: crate::manifest::policy::ExitOperator,
    pub values: Vec<i32>,
}

fn one() -> u32 {
    1
}

/// A manifest's path made absolute against the directory the Job was submitted from (as
/// written otherwise: no link is followed), so what `get` prints applies from anywhere.
fn absolute(path: &std::path::Path) -> std::path::PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

impl JobSpecView {
    pub fn of(plan: &RunPlan) -> Self {
        Self::of_job(plan.job(), plan.bound.backend)
    }

    /// `job` as it resolved to `backend`.
    pub fn of_job(job: &Job, backend: Backend) -> Self {
        JobSpecView {
            environment: job.environment.clone(),
            backend,
            command: job.command.argv(),
            completions: job.completions,
            workspace: job.workspace.as_deref().map(absolute),
            static_assets: job
                .static_assets
                .iter()
                .map(|a| StaticAssetView {
                    source: absolute(&a.source),
                    save_path: a.save_path.clone(),
                })
                .collect(),
            mounts: job
                .mounts
                .iter()
                .map(|m| MountView {
                    source: m.source.clone(),
                    target: m.target.clone(),
                    read_only: m.read_only,
                })
                .collect(),
            stdin: job.stdin.clone(),
            timeout_seconds: job.timeout.map(|t| t.as_secs_f64()),
            disable_setup: job.disable_setup,
            parallelism: Some(job.parallelism),
            completion_mode: Some(if job.indexed {
                CompletionMode::Indexed
            } else {
                CompletionMode::NonIndexed
            }),
            backoff_limit: Some(job.backoff_limit),
            active_deadline_seconds: job.active_deadline.map(|d| d.as_secs()),
            ttl_seconds_after_finished: job.ttl_after_finished.map(|d| d.as_secs()),
            termination_grace_period_seconds: Some(job.termination_grace.as_secs()),
            pod_failure_policy: (!job.failure_rules.is_empty()).then(|| PodFailurePolicyView {
                rules: job
                    .failure_rules
                    .iter()
                    .map(|r| PodFailureRuleView {
                        action: r.action,
                        on_exit_codes: OnExitCodesView {
                            operator: r.operator,
                            values: r.values.clone(),
                        },
                    })
                    .collect(),
            }),
        }
    }
}

impl ObjectMeta {
    pub fn of(job: &Job) -> Self {
        ObjectMeta {
            name: job.name.clone(),
            labels: job.labels.clone(),
            annotations: job.annotations.clone(),
        }
    }
}

impl JobObject {
    pub fn new(metadata: ObjectMeta, spec: JobSpecView, status: JobStatus) -> Self {
        JobObject {
            api_version: API_VERSION,
            kind: "Job",
            metadata,
            spec,
            status,
        }
    }
}

pub fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

/// Classify a finished command.
pub fn status_of(result: ExecResult, deadline_bound: bool) -> (Phase, Reason) {
    // Before setup: a sandbox evicted during its setup was evicted all the same.
    if result.evicted.is_some() {
        return (Phase::Failed, Reason::Evicted);
    }
    if result.setup.as_ref().is_some_and(|s| !s.succeeded()) {
        return (Phase::Failed, Reason::SetupFailed);
    }
    if result.oom_killed {
        return (Phase::Failed, Reason::OomKilled);
    }
    if result.timed_out {
        return (
            Phase::Failed,
            if deadline_bound {
                Reason::DeadlineExceeded
            } else {
                Reason::Timeout
            },
        );
    }
    if result.exit_code == Some(0) {
        (Phase::Succeeded, Reason::Completed)
    } else {
        (Phase::Failed, Reason::Error)
    }
}

/// The limit on the command: the smaller of its timeout and what remains of the deadline;
/// the flag says whether the deadline is the binding one.
fn command_limit(job: &Job, started: Instant) -> (Option<Duration>, bool) {
    let remaining = job.active_deadline.map(|d| d.saturating_sub(started.elapsed()));
    match (job.timeout, remaining) {
        (Some(t), Some(r)) if r < t => (Some(r), true),
        (Some(t), _) => (Some(t), false),
        (None, Some(r)) => (Some(r), true),
        (None, None) => (None, false),
    }
}

/// Run one attempt of a job to its end: spawn (setup), execute, clean up. Always returns a
/// status: a runner failure becomes `InfraError`, never a lost result.
/// `cancel` stops the job (Ctrl-C): its process tree is killed and the status says so.
/// `engine` is the containerd connection, needed for `backend: containerd`.
pub async fn run_once(
    plan: &RunPlan,
    host: &HostEnv,
    options: &RuntimeOptions,
    engine: Option<&Engine>,
    cancel: &CancellationToken,
) -> AttemptStatus {
    match plan.bound.backend {
        Backend::Host => run_host(plan, host, options, cancel, Instant::now()).await,
        Backend::Containerd => match engine {
            Some(engine) => run_container(plan, engine, cancel).await,
            None => infra_error(&RuntimeError::Unavailable("containerd")),
        },
    }
}

async fn run_container(plan: &RunPlan, engine: &Engine, cancel: &CancellationToken) -> AttemptStatus {
    match engine.run_oneshot(plan, cancel).await {
        Ok(result) => {
            // A command that exited 0 succeeded, even if the stop came right after: only one the
            // stop ended is interrupted.
            let succeeded = result.exit_code == Some(0) && !result.timed_out && result.evicted.is_none();
            if cancel.is_cancelled() && !succeeded {
                return interrupted(Some(result));
            }
            let deadline_bound = match (plan.job().timeout, plan.job().active_deadline) {
                (Some(t), Some(d)) => d < t,
                (None, Some(_)) => true,
                _ => false,
            };
            AttemptStatus::of(result, deadline_bound, plan.env().resources.memory)
        }
        Err(e) => infra_error(&e),
    }
}

fn interrupted(result: Option<ExecResult>) -> AttemptStatus {
    AttemptStatus::failed(
        Reason::Interrupted,
        "interrupted; every process of the job was killed".into(),
        result,
    )
}

async fn run_host(
    plan: &RunPlan,
    host: &HostEnv,
    options: &RuntimeOptions,
    cancel: &CancellationToken,
    started: Instant,
) -> AttemptStatus {
    let spawned = tokio::select! {
        spawned = runtime::spawn(plan, host, options) => spawned,
        () = cancel.cancelled() => return interrupted(None),
    };
    match spawned {
        Ok(rt) => {
            let status = tokio::select! {
                status = attempt(rt.as_ref(), plan, started) => status,
                () = cancel.cancelled() => {
                    if let Err(e) = rt.kill().await {
                        tracing::warn!(error = %e, "killing the interrupted job failed");
                    }
                    interrupted(None)
                }
            };
            if let Err(e) = rt.cleanup().await {
                tracing::warn!(error = %e, "cleanup after the job failed");
            }
            status
        }
        Err(e) => infra_error(&e),
    }
}

fn infra_error(e: &RuntimeError) -> AttemptStatus {
    use crate::image::ImageError;
    let reason = match e {
        RuntimeError::Image(ImageError::Registry(_) | ImageError::NotFound(_)) => Reason::ErrImagePull,
        RuntimeError::Refused(_) => Reason::CreateContainerError,
        _ => Reason::InfraError,
    };
    AttemptStatus::failed(reason, e.to_string(), None)
}

async fn attempt(rt: &dyn Runtime, plan: &RunPlan, started: Instant) -> AttemptStatus {
    let job = plan.job();
    if let Some(setup) = rt.setup()
        && !setup.succeeded()
    {
        let result = ExecResult {
            exit_code: setup.exit_code,
            timed_out: setup.timed_out,
            setup: Some(setup.clone()),
            duration_ms: setup.duration_ms,
            ..Default::default()
        };
        return AttemptStatus::failed(
            Reason::SetupFailed,
            format!("setup exited with {}", setup.exit_code.unwrap_or(-1)),
            Some(result),
        );
    }
    let (timeout, deadline_bound) = command_limit(job, started);
    let request = ExecRequest {
        argv: job.command.argv(),
        stdin: job.stdin.as_ref().map(|s| s.as_bytes().to_vec()),
        timeout,
        ..Default::default()
    };
    match rt.execute(request).await {
        Ok(mut result) => {
            result.setup = rt.setup().cloned();
            AttemptStatus::of(result, deadline_bound, plan.env().resources.memory)
        }
        // A command that cannot start (missing binary) is the submission's failure, as a
        // container's exit 127 would be; anything else is ours.
        Err(RuntimeError::Start { program, source }) => AttemptStatus::failed(
            Reason::Error,
            format!("cannot start {program:?}: {source}"),
            Some(ExecResult {
                exit_code: Some(127),
                stderr: format!("runner: cannot start {program:?}: {source}\n"),
                setup: rt.setup().cloned(),
                ..Default::default()
            }),
        ),
        Err(e) => infra_error(&e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification_follows_product_reasons() {
        let ok = ExecResult {
            exit_code: Some(0),
            ..Default::default()
        };
        assert_eq!(status_of(ok.clone(), false), (Phase::Succeeded, Reason::Completed));
        let failed = ExecResult {
            exit_code: Some(3),
            ..Default::default()
        };
        assert_eq!(status_of(failed, false), (Phase::Failed, Reason::Error));
        let timed_out = ExecResult {
            signal: Some(15),
            timed_out: true,
            ..Default::default()
        };
        assert_eq!(status_of(timed_out.clone(), false), (Phase::Failed, Reason::Timeout));
        assert_eq!(status_of(timed_out, true), (Phase::Failed, Reason::DeadlineExceeded));
        let oom = ExecResult {
            signal: Some(9),
            oom_killed: true,
            ..Default::default()
        };
        assert_eq!(status_of(oom.clone(), false), (Phase::Failed, Reason::OomKilled));
        assert_eq!(
            AttemptStatus::of(oom, false, MEMORY).message.as_deref(),
            Some("killed: memory limit 64Mi reached (exit code 137); raise resources.memory of its Environment")
        );
    }

    const MEMORY: crate::manifest::MemoryBytes = crate::manifest::MemoryBytes(64 << 20);

    #[test]
    fn a_command_the_seccomp_filter_killed_is_explained() {
        let killed = ExecResult {
            exit_code: Some(159),
            ..Default::default()
        };
        let status = AttemptStatus::of(killed, false, MEMORY);
        assert_eq!(status.reason, Reason::Error);
        assert!(status.message.unwrap().contains("allow32BitSyscalls"));
        let plain = ExecResult {
            exit_code: Some(3),
            ..Default::default()
        };
        assert_eq!(AttemptStatus::of(plain, false, MEMORY).message, None);
    }

    #[test]
    fn exit_codes_separate_submission_failures_from_ours() {
        let mut s = JobStatus::pending();
        s.phase = Phase::Succeeded;
        s.reason = Some(Reason::Completed);
        assert_eq!(s.exit_code(), 0);
        s.phase = Phase::Failed;
        s.reason = Some(Reason::Error);
        assert_eq!(s.exit_code(), 1);
        s.reason = Some(Reason::InfraError);
        assert_eq!(s.exit_code(), 2);
        s.reason = Some(Reason::Interrupted);
        assert_eq!(s.exit_code(), 130);
    }
}
