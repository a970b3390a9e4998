//! The containerd backend: one-shot jobs (one task: setup + command) and live containers
//! (an idle init, commands through Tasks.Exec), both on the hardened spec of `spec::build`.
//!
//! Order of operations follows docs/design/containerd.md ("What containerd does..."): a lease from Snapshots.Prepare to
//! Containers.Create; stdio FIFO read ends open before Tasks.Create; Wait issued before Start;
//! cgroup counters read before Tasks.Delete; teardown kill → wait → Tasks.Delete →
//! Snapshots.Remove → Containers.Delete, NotFound counting as done.

pub mod agent;
pub mod attach_lock;
pub mod checkpoint;
pub mod freezer;
mod io;
pub mod layer;
pub mod logger;
pub mod pool;
pub mod prelaunch;
pub mod reclaim;
pub mod remap;
mod seed;
mod setup_snapshot;
pub mod shim_group;
pub mod shim_seed;
pub mod snapshot;

use std::time::Duration;

/// Label on everything runner creates in containerd (containers, snapshots, leases).
pub const LABEL_MANAGED: &str = "runner.dev/managed";
/// Which runner process owns it: `<pid>:<process start time>`, checked by `runner gc`.
pub const LABEL_OWNER: &str = "runner.dev/owner";
/// The job (or session) it belongs to.
pub const LABEL_JOB: &str = "runner.dev/job";
/// `oneshot` or `live`.
pub const LABEL_KIND: &str = "runner.dev/kind";
/// A Job attempt's completion index and attempt number (for re-adoption).
pub const LABEL_INDEX: &str = "runner.dev/index";
pub const LABEL_ATTEMPT: &str = "runner.dev/attempt";
/// The state directory (job store) of the runner that created it: only that store can tell
/// whether a Job attempt whose runner died is waiting to be re-adopted.
pub const LABEL_STATE_DIR: &str = "runner.dev/state-dir";
/// The host directory a container has as its workspace, and the path it has it at (what a
/// snapshot with its workspace reads).
pub const LABEL_WORKSPACE: &str = "runner.dev/workspace";
pub const LABEL_WORKSPACE_TARGET: &str = "runner.dev/workspace-target";
/// Where live containers see the programs runner ships (read-only).
pub const TOOLS_MOUNT: &str = "/.runner-tools";
/// The metric of the containerd operations' latencies (create, start, exec).
const OPERATION_SECONDS: &str = "runner_container_operation_seconds";
/// What a live container's init runs after setup when commands go through Tasks.Exec.
const KEEPALIVE: &str = "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done";
/// The file in a container's run directory naming the runner process that made it.
pub const RUN_DIR_OWNER: &str = "owner";
/// How long the container lease may outlive a crashed runner.
const CREATE_LEASE_TTL: Duration = Duration::from_secs(600);
/// After the task exited, how long its output may take to reach EOF.
const DRAIN_LIMIT: Duration = Duration::from_secs(5);
/// After an exec exited, how long its output may stay open before background processes it
/// left are assumed to hold it.
const EXEC_DRAIN_LIMIT: Duration = Duration::from_millis(200);
/// How long a Wait may keep failing with Unavailable (containerd restarting) before we give up.
const RECONNECT_LIMIT: Duration = Duration::from_secs(60);
/// How long a SIGKILLed task may take to exit during teardown.
const TEARDOWN_WAIT: Duration = Duration::from_secs(10);
/// `containerd.v1.types.Status.STOPPED`.
const STATUS_STOPPED: i32 = 3;
/// containerd.v1.types.Status PAUSED: the task's processes are frozen.
const STATUS_PAUSED: i32 = 4;
const SIGTERM: u32 = 15;
const SIGKILL: u32 = 9;

mod create;
mod engine;
mod live;
mod pty;

pub use engine::Engine;
pub use live::LiveContainer;
// The parts the other files of this backend (pool, agent, io) share.
use super::cgroupfs;
use create::*;
use engine::*;
use live::*;
