//! What a shell command answers: shared by the resident shell (a sandbox's) and the shell
//! that runs per call (a host session's), which both produce it.

use serde::Serialize;

/// What a shell command did: stdout and stderr interleaved as a terminal shows them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ShellOutput {
    pub output: String,
    pub exit_code: Option<i32>,
    pub timed_out: bool,
    /// Bytes cut from the middle of `output` (over `--max-output-bytes`: its head and tail
    /// are kept), as `/python`'s `outputDroppedBytes`; absent when nothing was cut.
    #[serde(skip_serializing_if = "is_zero")]
    pub output_dropped_bytes: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}
