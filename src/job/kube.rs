//! A Kubernetes Job's result in runner's own status format: the `batch/v1` Job and its pods
//! (as the API server returns them) → `JobStatus`, the same shape, reasons and exit codes a
//! local run gives. Pure; tested on recorded API objects.
//!
//! Each pod is one attempt (`restartPolicy: Never`): its index from the completion-index
//! annotation, its number from its creation order within the index. The container's
//! terminated state gives the exit code and OOMKilled; a pod ended by its
//! `activeDeadlineSeconds` (runner's per-attempt timeout) is a Timeout; the entry's setup
//! marker in the log splits setup output from the command's and tells SetupFailed. Kubernetes
//! keeps one log per container with stdout and stderr merged: the log is the result's stdout.

use std::collections::BTreeMap;

use serde_json::Value;

use super::{AttemptView, Condition, JobStatus, Phase, Reason};
use crate::runtime::{ExecResult, SetupResult};
use crate::spec::entry::{Part, Splitter};

/// The annotation Kubernetes puts the completion index in (Indexed jobs).
const INDEX_ANNOTATION: &str = "batch.kubernetes.io/job-completion-index";

fn text(v: &Value, pointer: &str) -> Option<String> {
    v.pointer(pointer).and_then(Value::as_str).map(str::to_string)
}

fn millis_between(start: Option<&str>, end: Option<&str>) -> u64 {
    let parse = |s: &str| humantime::parse_rfc3339(s).ok();
    match (start.and_then(parse), end.and_then(parse)) {
        (Some(a), Some(b)) => b.duration_since(a).map(|d| d.as_millis() as u64).unwrap_or(0),
        _ => 0,
    }
}

/// One pod as an attempt.
struct PodAttempt {
    index: u32,
    created: String,
    name: String,
    phase: Phase,
    reason: Option<Reason>,
    message: Option<String>,
    result: Option<ExecResult>,
    start: Option<String>,
    end: Option<String>,
}

fn pod_attempt(pod: &Value, container: &str, log: Option<&str>, setup_expected: bool) -> PodAttempt {
    let index = text(
        pod,
        &format!("/metadata/annotations/{}", INDEX_ANNOTATION.replace('/', "~1")),
    )
    .and_then(|i| i.parse().ok())
    .unwrap_or(0);
    let status = &pod["status"];
    let state = status["containerStatuses"]
        .as_array()
        .and_then(|all| all.iter().find(|c| c["name"] == container))
        .map(|c| &c["state"]);
    let terminated = state.map(|s| &s["terminated"]).filter(|t| t.is_object());
    let pod_reason = text(status, "/reason");
    let phase = match status["phase"].as_str() {
        Some("Succeeded") => Phase::Succeeded,
        Some("Failed") => Phase::Failed,
        Some("Running") => Phase::Running,
        _ => Phase::Pending,
    };
    let deadline = pod_reason.as_deref() == Some("DeadlineExceeded");
    let exit = terminated.and_then(|t| t["exitCode"].as_i64()).map(|c| c as i32);
    let oom = terminated.and_then(|t| t["reason"].as_str()) == Some("OOMKilled");
    // The log, split as a local run splits its output.
    let mut setup = Vec::new();
    let mut command = Vec::new();
    let mut splitter = Splitter::new(setup_expected);
    {
        let mut emit = |part: Part, bytes: &[u8]| match part {
            Part::Setup => setup.extend_from_slice(bytes),
            Part::Command => command.extend_from_slice(bytes),
        };
        splitter.feed(log.unwrap_or_default().as_bytes(), &mut emit);
        splitter.finish(&mut emit);
    }
    // stdout and stderr are one log on Kubernetes: the marker the entry writes to stderr
    // comes right after the one on stdout.
    if splitter.marker_seen() && command.starts_with(crate::spec::entry::SETUP_MARKER) {
        let end = command
            .iter()
            .position(|b| *b == b'\n')
            .map_or(command.len(), |i| i + 1);
        command.drain(..end);
    }
    let setup_status = splitter.setup_status();
    let start = terminated
        .and_then(|t| text(t, "/startedAt"))
        .or_else(|| text(status, "/startTime"));
    let end = terminated.and_then(|t| text(t, "/finishedAt"));
    let setup_failed = setup_expected && setup_status.is_some_and(|s| s != 0);
    let reason = match phase {
        Phase::Succeeded => Some(Reason::Completed),
        Phase::Failed if deadline => Some(Reason::Timeout),
        Phase::Failed if oom => Some(Reason::OomKilled),
        Phase::Failed if setup_failed || (setup_expected && setup_status.is_none() && exit.is_some()) => {
            Some(Reason::SetupFailed)
        }
        Phase::Failed => Some(Reason::Error),
        _ => None,
    };
    let message = match (phase, &pod_reason) {
        (Phase::Failed, Some(r)) if r != "DeadlineExceeded" => {
            Some(format!("{r}: {}", text(status, "/message").unwrap_or_default()))
        }
        _ => None,
    };
    let finished = matches!(phase, Phase::Succeeded | Phase::Failed);
    let result = finished.then(|| {
        let duration_ms = millis_between(start.as_deref(), end.as_deref());
        let code = exit.unwrap_or(if deadline { 137 } else { -1 });
        let setup_result = setup_expected.then(|| SetupResult {
            exit_code: setup_status,
            stdout: String::from_utf8_lossy(&setup).into_owned(),
            stderr: String::new(),
            timed_out: deadline && setup_status.is_none(),
            ..Default::default()
        });
        ExecResult {
            exit_code: Some(code),
            signal: ((deadline || oom) && code > 128).then_some(code - 128),
            timed_out: deadline,
            oom_killed: oom,
            stdout: String::from_utf8_lossy(&command).into_owned(),
            stderr: String::new(),
            setup: setup_result,
            duration_ms,
            ..Default::default()
        }
    });
    PodAttempt {
        index,
        created: text(pod, "/metadata/creationTimestamp").unwrap_or_default(),
        name: text(pod, "/metadata/name").unwrap_or_default(),
        phase,
        reason,
        message,
        result,
        start,
        end,
    }
}

/// The runner status of a Kubernetes Job. `logs`: each pod's log by pod name; `setup`: whether
/// the job's entry runs setup commands (its log then carries the marker).
pub fn status(job: &Value, pods: &[Value], logs: &BTreeMap<String, String>, container: &str, setup: bool) -> JobStatus {
    let mut attempts: Vec<PodAttempt> = pods
        .iter()
        .map(|p| {
            let name = text(p, "/metadata/name").unwrap_or_default();
            pod_attempt(p, container, logs.get(&name).map(String::as_str), setup)
        })
        .collect();
    attempts.sort_by(|a, b| (a.index, &a.created, &a.name).cmp(&(b.index, &b.created, &b.name)));
    // A failure an `Ignore` rule matched does not count against backoffLimit.
    let ignored = |exit: Option<i32>| {
        let Some(code) = exit else { return false };
        job.pointer("/spec/podFailurePolicy/rules")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .find(|rule| {
                let values = rule.pointer("/onExitCodes/values").and_then(Value::as_array);
                let hit = values.is_some_and(|v| v.iter().any(|x| x.as_i64() == Some(i64::from(code))));
                match rule.pointer("/onExitCodes/operator").and_then(Value::as_str) {
                    Some("In") => hit,
                    Some("NotIn") => values.is_some() && !hit,
                    _ => false,
                }
            })
            .is_some_and(|rule| rule["action"] == "Ignore")
    };
    let mut views = Vec::new();
    let mut number: BTreeMap<u32, u32> = BTreeMap::new();
    for a in &attempts {
        let n = number.entry(a.index).or_default();
        views.push(AttemptView {
            index: a.index,
            attempt: *n,
            phase: a.phase,
            reason: a.reason,
            exit_code: a.result.as_ref().and_then(|r| r.exit_code),
            message: a.message.clone(),
            start_time: a.start.clone(),
            completion_time: a.end.clone(),
            counted: a.phase == Phase::Failed && !ignored(a.result.as_ref().and_then(|r| r.exit_code)),
            network: None,
            pool: None,
            cold_start: None,
        });
        *n += 1;
    }
    let s = &job["status"];
    let count = |k: &str| s[k].as_u64().unwrap_or(0) as u32;
    let conditions: Vec<&Value> = s["conditions"]
        .as_array()
        .map(|c| c.iter().collect())
        .unwrap_or_default();
    let terminal = conditions
        .iter()
        .find(|c| (c["type"] == "Complete" || c["type"] == "Failed") && c["status"] == "True");
    // The attempt that decided: the last to fail for a failure, else the last to succeed.
    let deciding = |phase: Phase| {
        attempts
            .iter()
            .filter(|a| a.phase == phase)
            .max_by(|a, b| a.end.cmp(&b.end))
    };
    let (phase, reason, message, result) = match terminal {
        Some(c) if c["type"] == "Complete" => (
            Phase::Succeeded,
            Some(Reason::Completed),
            None,
            deciding(Phase::Succeeded).and_then(|a| a.result.clone()),
        ),
        Some(c) => {
            let last = deciding(Phase::Failed);
            let backoff_limit = job.pointer("/spec/backoffLimit").and_then(Value::as_u64).unwrap_or(6);
            let reason = match c["reason"].as_str() {
                Some("DeadlineExceeded") => Reason::DeadlineExceeded,
                Some("PodFailurePolicy") => Reason::PodFailurePolicy,
                // No retries were asked for: the attempt's own reason says more (as locally).
                Some("BackoffLimitExceeded") if backoff_limit == 0 => {
                    last.and_then(|a| a.reason).unwrap_or(Reason::Error)
                }
                Some("BackoffLimitExceeded") => Reason::BackoffLimitExceeded,
                _ => Reason::Error,
            };
            (
                Phase::Failed,
                Some(reason),
                text(c, "/message"),
                last.and_then(|a| a.result.clone()),
            )
        }
        None if count("active") > 0 || s["startTime"].is_string() => (Phase::Running, None, None, None),
        None => (Phase::Pending, None, None, None),
    };
    JobStatus {
        phase,
        reason,
        message,
        active: count("active"),
        succeeded: count("succeeded"),
        failed: count("failed"),
        start_time: text(s, "/startTime"),
        completion_time: text(s, "/completionTime").or_else(|| terminal.and_then(|c| text(c, "/lastTransitionTime"))),
        conditions: terminal
            .map(|c| Condition {
                kind: text(c, "/type").unwrap_or_default(),
                status: "True".into(),
                reason: reason
                    .and_then(|r| serde_json::to_value(r).ok())
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default(),
                message: text(c, "/message").unwrap_or_default(),
                last_transition_time: text(c, "/lastTransitionTime").unwrap_or_default(),
            })
            .into_iter()
            .collect(),
        attempts: views,
        result,
    }
}
