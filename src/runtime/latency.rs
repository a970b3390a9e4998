//! A latency hint for the processes the host waits on inside a sandbox (a session's resident
//! shell): a short EEVDF request ("slice") set with `sched_setattr(2)`, so that when such a
//! process wakes on a CPU that busy sandboxes keep full, the kernel may preempt the busy one at
//! once instead of at its next tick.
//!
//! Why a slice and not a weight: on Linux ≥ 6.6 (EEVDF) a waking task of weight `w` and slice
//! `r` gets the virtual deadline `v + r/w`; the eligible entity with the earliest deadline
//! runs, and a wakeup preempts the running task only when the woken one would be picked
//! (`check_preempt_wakeup_fair`, kernel/sched/fair.c; `PREEMPT_SHORT` lets a shorter slice
//! cut the current one's slice protection). With the default slice (0.7 ms × (1 + log2 CPUs),
//! 1.4 ms on 2 cores) and a 4 ms tick (HZ=250), ten busy sandboxes on two cores kept an idle
//! session's shell waiting 4–12 ms per wakeup (`perf sched timehist`, docs/guide/capacity.md).
//! A slice changes when a task runs, never how much: its weight (the cgroup's `cpu.shares`
//! / `cpu.weight`, the `cpu` limit's quota) is untouched, and any process may set its own
//! slice (the default seccomp profile allows `sched_setattr`), so this grants a sandbox
//! nothing it could not take itself.
//!
//! `SCHED_FLAG_RESET_ON_FORK` keeps the hint to the shell itself: the commands it forks start
//! with the kernel's default slice (tested here and in `tests/shell_latency.rs`), so a heavy command run
//! from the shell is not preempted every 0.1 ms. Kernels before 6.12 ignore `sched_runtime`
//! for normal tasks: the call succeeds and changes nothing.

use std::io;
use std::time::Duration;

/// The slice asked for: the kernel's smallest (it clamps to 0.1–100 ms). The shell's work per
/// call is a read of one line and a `printf`, far below it.
pub const SHELL_SLICE: Duration = Duration::from_micros(100);

/// `SCHED_NORMAL` and `SCHED_BATCH` (include/uapi/linux/sched.h): the policies a slice means
/// something for.
const SCHED_NORMAL: u32 = 0;
const SCHED_BATCH: u32 = 3;
/// Children start with the default policy, nice 0 if it was negative, and the default slice.
const SCHED_FLAG_RESET_ON_FORK: u64 = 0x01;

/// `struct sched_attr` as of `SCHED_ATTR_SIZE_VER0` (48 bytes, Linux 3.14): enough for
/// `sched_runtime`; the kernel takes the size from the first field.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct SchedAttr {
    size: u32,
    policy: u32,
    flags: u64,
    nice: i32,
    priority: u32,
    runtime: u64,
    deadline: u64,
    period: u64,
}

const ATTR_SIZE: u32 = std::mem::size_of::<SchedAttr>() as u32;

fn get(pid: i32) -> io::Result<SchedAttr> {
    let mut attr = SchedAttr::default();
    // SAFETY: `attr` is a valid, writable `sched_attr` of `ATTR_SIZE` bytes that outlives the
    // call; the kernel writes at most that many.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sched_getattr,
            pid,
            &mut attr as *mut SchedAttr,
            ATTR_SIZE,
            0u32,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(attr)
}

/// What `request` writes, given the task's current attributes: its policy and nice kept (the
/// call sets both), the slice and the reset-on-fork flag added. `None` for a policy a slice
/// means nothing to (real-time, deadline, idle).
fn with_slice(current: SchedAttr, slice: Duration) -> Option<SchedAttr> {
    if current.policy != SCHED_NORMAL && current.policy != SCHED_BATCH {
        return None;
    }
    Some(SchedAttr {
        size: ATTR_SIZE,
        policy: current.policy,
        flags: SCHED_FLAG_RESET_ON_FORK,
        nice: current.nice,
        priority: 0,
        runtime: u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX),
        deadline: 0,
        period: 0,
    })
}

/// Ask the kernel to run task `pid` (a host PID) with `slice` as its request, its children
/// with the default. Best effort by design: a caller logs the error and goes on.
pub fn request_slice(pid: i32, slice: Duration) -> io::Result<()> {
    let Some(attr) = with_slice(get(pid)?, slice) else {
        return Ok(());
    };
    // SAFETY: `attr` is a valid `sched_attr` whose `size` field says how much the kernel reads.
    let r = unsafe { libc::syscall(libc::SYS_sched_setattr, pid, &attr as *const SchedAttr, 0u32) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// How the kernel runs a task: its slice (`None` where the kernel does not say: before 6.12,
/// `sched_getattr` reports no slice for normal tasks) and whether its children start afresh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduling {
    pub slice: Option<Duration>,
    pub resets_on_fork: bool,
}

/// The scheduling of task `pid` (a host PID), as `sched_getattr(2)` reports it.
pub fn scheduling(pid: i32) -> io::Result<Scheduling> {
    let attr = get(pid)?;
    Ok(Scheduling {
        slice: (attr.runtime != 0).then(|| Duration::from_nanos(attr.runtime)),
        resets_on_fork: attr.flags & SCHED_FLAG_RESET_ON_FORK != 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_attribute_keeps_policy_and_nice_and_resets_children() {
        let current = SchedAttr {
            size: ATTR_SIZE,
            policy: SCHED_BATCH,
            nice: 5,
            ..Default::default()
        };
        let set = with_slice(current, SHELL_SLICE).expect("batch takes a slice");
        assert_eq!((set.policy, set.nice, set.runtime), (SCHED_BATCH, 5, 100_000));
        assert_eq!(set.flags, SCHED_FLAG_RESET_ON_FORK);
        assert_eq!(set.size, 48);
        // SCHED_FIFO (1), SCHED_RR (2), SCHED_IDLE (5), SCHED_DEADLINE (6): left alone.
        for policy in [1, 2, 5, 6] {
            assert!(
                with_slice(SchedAttr { policy, ..current }, SHELL_SLICE).is_none(),
                "{policy}"
            );
        }
    }

    #[test]
    fn a_process_gets_the_slice_and_its_children_the_default() {
        // A shell that waits for a line, then forks a child that sleeps.
        let mut shell = std::process::Command::new("sh")
            .args(["-c", "read x; sleep 30 & echo $!; wait"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("sh");
        let pid = shell.id() as i32;
        let before = scheduling(pid).expect("sched_getattr");
        assert!(!before.resets_on_fork);
        request_slice(pid, SHELL_SLICE).expect("sched_setattr on our own child");
        let after = scheduling(pid).expect("sched_getattr");
        assert!(after.resets_on_fork, "{after:?}");
        use std::io::{BufRead, Write};
        shell.stdin.take().expect("stdin").write_all(b"go\n").expect("write");
        let mut line = String::new();
        std::io::BufReader::new(shell.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("child pid");
        let child: i32 = line.trim().parse().expect("a pid");
        let forked = scheduling(child).expect("sched_getattr of the child");
        assert!(!forked.resets_on_fork, "{forked:?}");
        // Where the kernel reports slices (6.12+), they are what was asked, and the default.
        if before.slice.is_some() {
            assert_eq!(after.slice, Some(SHELL_SLICE));
            assert_eq!(forked.slice, before.slice, "the child has the default slice");
        }
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(child), nix::sys::signal::Signal::SIGKILL);
        let _ = shell.wait();
    }
}
