//! Job policy types the manifest declares and the Job controller applies: Kubernetes'
//! `podFailurePolicy` rules on exit codes.

use serde::{Deserialize, Serialize};

/// What a matching rule does with a failed attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RuleAction {
    FailJob,
    Ignore,
    Count,
}

/// How a rule's values are compared with the exit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExitOperator {
    In,
    NotIn,
}

/// One `podFailurePolicy` rule on exit codes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureRule {
    pub action: RuleAction,
    pub operator: ExitOperator,
    pub values: Vec<i32>,
}

impl FailureRule {
    /// Whether an attempt's exit code is one this rule is about.
    pub fn matches(&self, exit: i32) -> bool {
        let hit = self.values.contains(&exit);
        match self.operator {
            ExitOperator::In => hit,
            ExitOperator::NotIn => !hit,
        }
    }
}
