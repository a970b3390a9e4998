//! The Job state machine (Kubernetes batch/v1 semantics), pure: events in, actions out, time
//! passed in as milliseconds. The supervisor performs the actions; tests drive it with a fake
//! clock.

use std::collections::BTreeSet;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Phase, Reason};
pub use crate::manifest::policy::{ExitOperator, FailureRule, RuleAction};

/// Kubernetes' pod backoff: 10 s doubling per failure, capped at 6 min.
pub const BACKOFF_BASE: Duration = Duration::from_secs(10);
pub const BACKOFF_CAP: Duration = Duration::from_secs(360);
/// Infrastructure failures are retried without counting, but not forever.
pub const MAX_INFRA_RETRIES: u32 = 3;
/// First delay before retrying after an infrastructure failure (doubles each time).
pub const INFRA_BACKOFF_MS: u64 = 1_000;

/// What the controller needs of a Job's spec.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobPolicy {
    pub completions: u32,
    pub parallelism: u32,
    pub indexed: bool,
    pub backoff_limit: u32,
    pub active_deadline_ms: Option<u64>,
    pub rules: Vec<FailureRule>,
    pub backoff_base_ms: u64,
    pub backoff_cap_ms: u64,
}

impl Default for JobPolicy {
    fn default() -> Self {
        JobPolicy {
            completions: 1,
            parallelism: 1,
            indexed: false,
            backoff_limit: 0,
            active_deadline_ms: None,
            rules: Vec::new(),
            backoff_base_ms: BACKOFF_BASE.as_millis() as u64,
            backoff_cap_ms: BACKOFF_CAP.as_millis() as u64,
        }
    }
}

/// How an attempt ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    Succeeded,
    /// The submission failed: exit code (or 128+signal) and why (Error, Timeout, OOMKilled,
    /// SetupFailed).
    Failed {
        exit_code: i32,
        reason: Reason,
        /// What the attempt said when no command ran (ErrImagePull: the registry's answer).
        message: Option<String>,
    },
    /// Our fault (a dead shim, containerd unreachable): never counted against the job.
    Infra {
        message: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AttemptState {
    Running,
    Succeeded,
    /// Failed and counted against backoffLimit.
    Failed,
    /// Failed but a rule said Ignore.
    Ignored,
    Infra,
    /// Killed by the controller (deadline, FailJob, delete).
    Killed,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attempt {
    pub index: u32,
    /// 0-based attempt number within its index.
    pub number: u32,
    pub state: AttemptState,
    pub started_ms: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct JobState {
    pub started_ms: Option<u64>,
    pub attempts: Vec<Attempt>,
    pub succeeded: BTreeSet<u32>,
    /// Counted failures (what backoffLimit is compared with).
    pub counted_failures: u32,
    pub infra_failures: u32,
    /// No launch before this time (backoff after a failure).
    pub not_before_ms: u64,
    pub terminal: Option<(Phase, Reason, String)>,
    /// Set once a terminal decision killed the running attempts.
    pub killing: bool,
}

/// The message of a job ended by `Event::Stop`.
pub const STOPPED: &str = "stopped with the runner that ran it (a signal, or its server stopping)";

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The job begins (or the supervisor re-adopts it).
    Tick,
    Finished {
        index: u32,
        number: u32,
        outcome: Outcome,
    },
    /// The user deleted the job.
    Delete,
    /// The process running the job was stopped (a signalled apply, a CLI gone from a handed
    /// apply, a server stopping): the job ends as a deleted one does, said apart.
    Stop,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    Launch {
        index: u32,
        number: u32,
    },
    /// Stop every running attempt (SIGTERM, grace, SIGKILL).
    KillAll,
    /// The job reached its terminal state; no attempt runs any more.
    Done,
}

impl JobState {
    pub fn active(&self) -> u32 {
        self.attempts
            .iter()
            .filter(|a| a.state == AttemptState::Running)
            .count() as u32
    }

    pub fn succeeded_count(&self) -> u32 {
        self.attempts
            .iter()
            .filter(|a| a.state == AttemptState::Succeeded)
            .count() as u32
    }

    /// Failed attempts as `status.failed` counts them (Ignored ones included, infra not).
    pub fn failed_count(&self) -> u32 {
        self.attempts
            .iter()
            .filter(|a| matches!(a.state, AttemptState::Failed | AttemptState::Ignored))
            .count() as u32
    }

    /// When the supervisor should wake up next without an event (backoff end or deadline).
    pub fn next_wake(&self, policy: &JobPolicy) -> Option<u64> {
        if self.terminal.is_some() {
            return None;
        }
        let deadline = match (self.started_ms, policy.active_deadline_ms) {
            (Some(s), Some(d)) => Some(s + d),
            _ => None,
        };
        let backoff = (self.not_before_ms > 0).then_some(self.not_before_ms);
        match (deadline, backoff) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn finish(&mut self, phase: Phase, reason: Reason, message: String) -> Vec<Action> {
        self.terminal = Some((phase, reason, message));
        if self.active() > 0 {
            self.killing = true;
            vec![Action::KillAll]
        } else {
            vec![Action::Done]
        }
    }
}

fn backoff_ms(policy: &JobPolicy, failures: u32) -> u64 {
    let shift = failures.saturating_sub(1).min(20);
    policy
        .backoff_base_ms
        .saturating_mul(1 << shift)
        .min(policy.backoff_cap_ms)
}

/// Advance the job by one event at time `now_ms`.
pub fn step(policy: &JobPolicy, state: &mut JobState, event: Event, now_ms: u64) -> Vec<Action> {
    let mut actions = Vec::new();
    if state.started_ms.is_none() {
        state.started_ms = Some(now_ms);
    }
    match event {
        Event::Tick => {}
        Event::Delete | Event::Stop => {
            if state.terminal.is_none() {
                let why = match event {
                    Event::Delete => "deleted",
                    _ => STOPPED,
                };
                return state.finish(Phase::Failed, Reason::Interrupted, why.into());
            }
        }
        Event::Finished { index, number, outcome } => {
            // Duplicate or unknown exits are ignored: each attempt ends once.
            let Some(attempt) = state
                .attempts
                .iter_mut()
                .find(|a| a.index == index && a.number == number && a.state == AttemptState::Running)
            else {
                return actions;
            };
            if state.killing {
                // An attempt that ended on its own with success before the kill reached it
                // succeeded (Kubernetes counts it in `succeeded`); only what was stopped was
                // interrupted.
                if matches!(outcome, Outcome::Succeeded) {
                    attempt.state = AttemptState::Succeeded;
                    state.succeeded.insert(index);
                } else {
                    attempt.state = AttemptState::Killed;
                }
                if state.active() == 0 {
                    actions.push(Action::Done);
                }
                return actions;
            }
            match outcome {
                Outcome::Succeeded => {
                    attempt.state = AttemptState::Succeeded;
                    state.succeeded.insert(index);
                }
                Outcome::Infra { message } => {
                    attempt.state = AttemptState::Infra;
                    state.infra_failures += 1;
                    if state.infra_failures > MAX_INFRA_RETRIES {
                        return state.finish(Phase::Failed, Reason::InfraError, message);
                    }
                    // Give the infrastructure (a restarting containerd) time to come back.
                    let shift = state.infra_failures.saturating_sub(1).min(10);
                    state.not_before_ms = now_ms + INFRA_BACKOFF_MS.saturating_mul(1 << shift);
                }
                Outcome::Failed {
                    exit_code,
                    reason,
                    message,
                } => {
                    let rule = policy.rules.iter().find(|r| r.matches(exit_code));
                    match rule.map(|r| r.action) {
                        Some(RuleAction::FailJob) => {
                            attempt.state = AttemptState::Failed;
                            state.counted_failures += 1;
                            return state.finish(
                                Phase::Failed,
                                Reason::PodFailurePolicy,
                                format!("exit code {exit_code} matched a FailJob rule"),
                            );
                        }
                        Some(RuleAction::Ignore) => attempt.state = AttemptState::Ignored,
                        Some(RuleAction::Count) | None => {
                            attempt.state = AttemptState::Failed;
                            state.counted_failures += 1;
                            if state.counted_failures > policy.backoff_limit {
                                // No retries were asked for: the attempt's own reason says
                                // more than "limit exceeded".
                                if policy.backoff_limit == 0 {
                                    let message = message.unwrap_or_else(|| format!("exit code {exit_code}"));
                                    return state.finish(Phase::Failed, reason, message);
                                }
                                return state.finish(
                                    Phase::Failed,
                                    Reason::BackoffLimitExceeded,
                                    format!(
                                        "{} failed attempts (backoffLimit {})",
                                        state.counted_failures, policy.backoff_limit
                                    ),
                                );
                            }
                            state.not_before_ms = now_ms + backoff_ms(policy, state.counted_failures);
                        }
                    }
                }
            }
        }
    }
    if state.terminal.is_some() {
        return actions;
    }
    // activeDeadlineSeconds wins over everything else, backoff included.
    if let (Some(start), Some(deadline)) = (state.started_ms, policy.active_deadline_ms)
        && now_ms >= start + deadline
    {
        return state.finish(
            Phase::Failed,
            Reason::DeadlineExceeded,
            format!("active deadline of {} s passed", deadline / 1000),
        );
    }
    if state.succeeded.len() as u32 >= policy.completions {
        return state.finish(Phase::Succeeded, Reason::Completed, String::new());
    }
    if now_ms < state.not_before_ms {
        return actions;
    }
    state.not_before_ms = 0;
    for index in 0..policy.completions {
        if state.active() >= policy.parallelism {
            break;
        }
        let busy = state.succeeded.contains(&index)
            || state
                .attempts
                .iter()
                .any(|a| a.index == index && a.state == AttemptState::Running);
        if busy {
            continue;
        }
        let number = state.attempts.iter().filter(|a| a.index == index).count() as u32;
        state.attempts.push(Attempt {
            index,
            number,
            state: AttemptState::Running,
            started_ms: now_ms,
        });
        actions.push(Action::Launch { index, number });
    }
    actions
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fail(index: u32, number: u32, code: i32) -> Event {
        Event::Finished {
            index,
            number,
            outcome: Outcome::Failed {
                exit_code: code,
                reason: Reason::Error,
                message: None,
            },
        }
    }

    fn ok(index: u32, number: u32) -> Event {
        Event::Finished {
            index,
            number,
            outcome: Outcome::Succeeded,
        }
    }

    #[test]
    fn a_single_success_completes() {
        let p = JobPolicy::default();
        let mut s = JobState::default();
        assert_eq!(
            step(&p, &mut s, Event::Tick, 0),
            vec![Action::Launch { index: 0, number: 0 }]
        );
        assert_eq!(step(&p, &mut s, ok(0, 0), 50), vec![Action::Done]);
        assert_eq!(s.terminal.as_ref().unwrap().1, Reason::Completed);
    }

    #[test]
    fn retries_wait_ten_seconds_doubling_then_hit_the_backoff_limit() {
        let p = JobPolicy {
            backoff_limit: 2,
            ..JobPolicy::default()
        };
        let mut s = JobState::default();
        step(&p, &mut s, Event::Tick, 0);
        assert!(
            step(&p, &mut s, fail(0, 0, 1), 1_000).is_empty(),
            "no retry before 10 s"
        );
        assert_eq!(s.next_wake(&p), Some(11_000));
        assert!(step(&p, &mut s, Event::Tick, 10_999).is_empty());
        assert_eq!(
            step(&p, &mut s, Event::Tick, 11_000),
            vec![Action::Launch { index: 0, number: 1 }]
        );
        step(&p, &mut s, fail(0, 1, 1), 12_000);
        assert_eq!(s.next_wake(&p), Some(32_000), "20 s after the second failure");
        assert_eq!(
            step(&p, &mut s, Event::Tick, 32_000),
            vec![Action::Launch { index: 0, number: 2 }]
        );
        assert_eq!(step(&p, &mut s, fail(0, 2, 1), 33_000), vec![Action::Done]);
        assert_eq!(s.terminal.as_ref().unwrap().1, Reason::BackoffLimitExceeded);
        assert_eq!(s.failed_count(), 3);
    }

    #[test]
    fn without_retries_the_attempt_reason_is_the_job_reason() {
        let p = JobPolicy::default();
        let mut s = JobState::default();
        step(&p, &mut s, Event::Tick, 0);
        let timeout = Event::Finished {
            index: 0,
            number: 0,
            outcome: Outcome::Failed {
                exit_code: 143,
                reason: Reason::Timeout,
                message: None,
            },
        };
        assert_eq!(step(&p, &mut s, timeout, 10), vec![Action::Done]);
        assert_eq!(s.terminal.as_ref().unwrap().1, Reason::Timeout);
    }

    /// Indexed, three at once: index 2 fails and the Job fails; indexes 0 and 1 end with exit 0
    /// before the kill reaches them. They succeeded (Kubernetes counts them), not interrupted.
    #[test]
    fn attempts_that_succeed_while_the_job_fails_count_as_succeeded() {
        let p = JobPolicy {
            completions: 3,
            parallelism: 3,
            indexed: true,
            ..JobPolicy::default()
        };
        let mut s = JobState::default();
        assert_eq!(step(&p, &mut s, Event::Tick, 0).len(), 3);
        assert_eq!(step(&p, &mut s, fail(2, 0, 1), 10), vec![Action::KillAll]);
        assert!(step(&p, &mut s, ok(0, 0), 11).is_empty());
        assert_eq!(step(&p, &mut s, ok(1, 0), 12), vec![Action::Done]);
        assert_eq!(s.terminal.as_ref().unwrap().1, Reason::Error);
        assert_eq!(s.succeeded.len(), 2);
        assert_eq!(s.failed_count(), 1);
        let states: Vec<AttemptState> = s.attempts.iter().map(|a| a.state).collect();
        assert_eq!(
            states,
            [AttemptState::Succeeded, AttemptState::Succeeded, AttemptState::Failed]
        );
    }

    #[test]
    fn backoff_is_capped_at_six_minutes() {
        let p = JobPolicy::default();
        assert_eq!(backoff_ms(&p, 1), 10_000);
        assert_eq!(backoff_ms(&p, 2), 20_000);
        assert_eq!(backoff_ms(&p, 6), 320_000);
        assert_eq!(backoff_ms(&p, 7), 360_000);
        assert_eq!(backoff_ms(&p, 30), 360_000);
    }

    #[test]
    fn the_deadline_wins_over_retries_even_mid_backoff() {
        let p = JobPolicy {
            backoff_limit: 5,
            active_deadline_ms: Some(15_000),
            ..JobPolicy::default()
        };
        let mut s = JobState::default();
        step(&p, &mut s, Event::Tick, 0);
        step(&p, &mut s, fail(0, 0, 1), 8_000);
        // Backoff would relaunch at 18 s; the deadline at 15 s comes first.
        assert_eq!(s.next_wake(&p), Some(15_000));
        assert_eq!(step(&p, &mut s, Event::Tick, 15_000), vec![Action::Done]);
        assert_eq!(s.terminal.as_ref().unwrap().1, Reason::DeadlineExceeded);
    }

    #[test]
    fn the_deadline_kills_running_attempts_and_waits_for_them() {
        let p = JobPolicy {
            active_deadline_ms: Some(2_000),
            ..JobPolicy::default()
        };
        let mut s = JobState::default();
        step(&p, &mut s, Event::Tick, 0);
        assert_eq!(step(&p, &mut s, Event::Tick, 2_000), vec![Action::KillAll]);
        // The killed attempt's exit (137) is not a failure of its own.
        assert_eq!(step(&p, &mut s, fail(0, 0, 137), 2_600), vec![Action::Done]);
        assert_eq!(s.terminal.as_ref().unwrap().1, Reason::DeadlineExceeded);
        assert_eq!(s.failed_count(), 0);
    }

    #[test]
    fn indexed_completions_run_n_at_a_time() {
        let p = JobPolicy {
            completions: 4,
            parallelism: 2,
            indexed: true,
            ..JobPolicy::default()
        };
        let mut s = JobState::default();
        assert_eq!(
            step(&p, &mut s, Event::Tick, 0),
            vec![
                Action::Launch { index: 0, number: 0 },
                Action::Launch { index: 1, number: 0 }
            ]
        );
        assert_eq!(
            step(&p, &mut s, ok(1, 0), 10),
            vec![Action::Launch { index: 2, number: 0 }]
        );
        assert_eq!(
            step(&p, &mut s, ok(0, 0), 20),
            vec![Action::Launch { index: 3, number: 0 }]
        );
        assert!(step(&p, &mut s, ok(2, 0), 30).is_empty());
        assert_eq!(step(&p, &mut s, ok(3, 0), 40), vec![Action::Done]);
        assert_eq!(s.succeeded_count(), 4);
    }

    #[test]
    fn failure_rules_fail_the_job_ignore_or_count() {
        let rules = vec![
            FailureRule {
                action: RuleAction::FailJob,
                operator: ExitOperator::In,
                values: vec![42],
            },
            FailureRule {
                action: RuleAction::Ignore,
                operator: ExitOperator::In,
                values: vec![3],
            },
        ];
        let p = JobPolicy {
            backoff_limit: 0,
            rules,
            backoff_base_ms: 0,
            ..JobPolicy::default()
        };
        let mut s = JobState::default();
        step(&p, &mut s, Event::Tick, 0);
        // Ignored: retried, not counted.
        assert_eq!(
            step(&p, &mut s, fail(0, 0, 3), 10),
            vec![Action::Launch { index: 0, number: 1 }]
        );
        assert_eq!(s.counted_failures, 0);
        assert_eq!(step(&p, &mut s, fail(0, 1, 42), 20), vec![Action::Done]);
        assert_eq!(s.terminal.as_ref().unwrap().1, Reason::PodFailurePolicy);
    }

    #[test]
    fn infrastructure_failures_are_retried_without_counting() {
        let p = JobPolicy::default();
        let mut s = JobState::default();
        step(&p, &mut s, Event::Tick, 0);
        let infra = |n| Event::Finished {
            index: 0,
            number: n,
            outcome: Outcome::Infra {
                message: "shim died".into(),
            },
        };
        assert!(step(&p, &mut s, infra(0), 10).is_empty(), "waits a second first");
        assert_eq!(
            step(&p, &mut s, Event::Tick, 1_010),
            vec![Action::Launch { index: 0, number: 1 }]
        );
        assert_eq!(s.counted_failures, 0);
        step(&p, &mut s, infra(1), 2_000);
        assert_eq!(s.next_wake(&p), Some(4_000), "then two");
        step(&p, &mut s, Event::Tick, 4_000);
        step(&p, &mut s, infra(2), 5_000);
        step(&p, &mut s, Event::Tick, 9_000);
        assert_eq!(step(&p, &mut s, infra(3), 9_500), vec![Action::Done]);
        assert_eq!(s.terminal.as_ref().unwrap().1, Reason::InfraError);
    }

    #[test]
    fn duplicate_and_unknown_exits_are_ignored() {
        let p = JobPolicy {
            backoff_limit: 3,
            ..JobPolicy::default()
        };
        let mut s = JobState::default();
        step(&p, &mut s, Event::Tick, 0);
        step(&p, &mut s, fail(0, 0, 1), 10);
        assert!(step(&p, &mut s, fail(0, 0, 1), 11).is_empty(), "duplicate");
        assert!(step(&p, &mut s, ok(5, 9), 12).is_empty(), "unknown attempt");
        assert_eq!(s.counted_failures, 1);
        assert!(s.terminal.is_none());
    }

    #[test]
    fn delete_stops_running_attempts() {
        let p = JobPolicy::default();
        let mut s = JobState::default();
        step(&p, &mut s, Event::Tick, 0);
        assert_eq!(step(&p, &mut s, Event::Delete, 5), vec![Action::KillAll]);
        assert_eq!(step(&p, &mut s, fail(0, 0, 143), 6), vec![Action::Done]);
        assert_eq!(s.terminal.as_ref().map(|t| t.2.as_str()), Some("deleted"));
        // A stopped runner ends its jobs the same way, and says so.
        let mut s = JobState::default();
        step(&p, &mut s, Event::Tick, 0);
        assert_eq!(step(&p, &mut s, Event::Stop, 5), vec![Action::KillAll]);
        let (_, reason, message) = s.terminal.clone().unwrap();
        assert_eq!(reason, Reason::Interrupted);
        assert_eq!(message, STOPPED);
    }
}
