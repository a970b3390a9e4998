//! Keeping the kernel's cgroup migration lock in its fast path while runc creates containers.
//!
//! `runc create` moves the container's init into its cgroups by writing `cgroup.procs`. That
//! write takes `cgroup_threadgroup_rwsem` for writing (kernel/cgroup/cgroup.c,
//! `cgroup_attach_lock`), a percpu rwsem whose writer first waits for an RCU grace period
//! unless another writer released it less than a grace period ago (kernel/rcu/sync.c,
//! `rcu_sync_enter`). Measured on this project's machines (a 2-vCPU VM, kernel 6.18, cgroup v1
//! hybrid): the first such write took 5–16 ms, one within ~10 ms of the previous 0.1–0.3 ms;
//! with nothing else migrating processes, every cold container paid the full wait on its
//! create path (the gap between `runc init` starting and its first clone in a sched trace).
//!
//! So while a create is in flight, one thread of this process moves the process into its
//! own cgroup every few milliseconds: a migration that changes nothing but takes the same
//! lock, keeping it in its writer fast path for runc's write. Every such write also holds off
//! forks and exits host-wide for its few microseconds, so the runner processes of a host take
//! turns: a write is skipped when any of them wrote less than an interval ago (the mtime of a
//! shared mark file says when); twenty `runner apply` processes write no more than one does.
//!
//! The kernel's `favordynmods` cgroup mount option (Linux ≥ 6.0) removes the wait for
//! everybody, and with it these writes are cheap no-ops; but it is host policy, and on this
//! project's kernel (6.18) a remount without it left the fast path on until a reboot, so
//! runner does not set it itself. Best effort: the first write that fails (a read-only
//! cgroupfs in a container, a cgroup that does not accept processes) turns it off for the life
//! of the process, and nothing depends on it but time.
//!
//! The risk it takes: each write holds the lock for writing, which holds off fork, exit and
//! exec of every process on the host for its ~0.1 ms, every 4 ms while creates are in flight.
//! So it is on only where it pays (`WarmMode::Auto`, the default): off where cgroup2 is mounted
//! with `favordynmods`, and otherwise measured by its own first two writes — the first after
//! an idle moment pays the grace period if there is one, the second does not — and kept only
//! when the difference is at least `PAYS` (measured on a freshly booted host here: 7.7 ms
//! median against 0.11 ms, `scripts/attach-lock.py`). `on` and `off` force it.

use std::path::PathBuf;
use std::sync::{Arc, Condvar, LazyLock, Mutex};
use std::time::Duration;

use crate::config::WarmMode;

/// Between writes: under the shortest grace period measured (~5 ms), so the lock never falls
/// back to its slow path while a create is in flight. Each write costs ~0.1–0.3 ms of CPU.
const INTERVAL: Duration = Duration::from_millis(4);

#[derive(Default)]
struct State {
    /// Creates in flight.
    holders: usize,
    /// The writer thread was started (it then lives as long as the process, idle between creates).
    started: bool,
    /// A write failed, or there is nothing to write to: never again.
    off: bool,
    /// The writer waits for a hold (it cannot write before one comes).
    parked: bool,
    /// Measure the first writes and keep on only if they show the wait (`WarmMode::Auto`).
    calibrate: bool,
}

struct Warmer {
    /// This process's own `cgroup.procs`.
    target: Option<PathBuf>,
    /// The host-wide mark of the last write (see `MARK`).
    mark: PathBuf,
    /// Between writes (`INTERVAL`; longer in tests, which must not depend on scheduling).
    interval: Duration,
    state: Mutex<State>,
    wake: Condvar,
}

/// Touched at each write by whichever runner process made it (host-wide, as the lock is).
const MARK: &str = "/run/runner/cgroup-attach-warm";

/// What a cold write must cost more than a warm one for the warming to be kept.
const PAYS: Duration = Duration::from_millis(1);
/// A write is measured as cold only when no runner process wrote for this long (longer than
/// any grace period measured).
const QUIET: Duration = Duration::from_millis(100);

/// Set once at the edge (`configure`), before the first create; `Auto` when never set.
static MODE: std::sync::OnceLock<WarmMode> = std::sync::OnceLock::new();

/// How this process keeps the lock warm; the first call wins (the configuration is built once
/// at the edge).
pub fn configure(mode: WarmMode) {
    let _ = MODE.set(mode);
}

static WARMER: LazyLock<Arc<Warmer>> = LazyLock::new(|| {
    let mode = MODE.get().copied().unwrap_or_default();
    let target = match mode {
        WarmMode::Off => None,
        WarmMode::Auto if favordynmods() => {
            crate::metrics::increment(CALIBRATIONS, &[("result", "favordynmods")]);
            tracing::debug!("cgroup2 has favordynmods: the cgroup attach lock needs no warming");
            None
        }
        WarmMode::Auto | WarmMode::On => crate::runtime::cgroupfs::own_procs_file(),
    };
    let warmer = Warmer::new(target, PathBuf::from(MARK), INTERVAL);
    warmer.state().calibrate = mode == WarmMode::Auto;
    warmer
});

/// Writes made to keep the lock warm (Prometheus counter).
pub const WRITES: &str = "runner_cgroup_attach_warm_writes_total";
/// What the first writes of a process found (`pays`, `saves-nothing`, `favordynmods`).
pub const CALIBRATIONS: &str = "runner_cgroup_attach_warm_calibrations_total";

/// Whether a cgroup2 hierarchy is mounted with `favordynmods` (its attach lock then has no
/// grace-period wait to save).
fn favordynmods() -> bool {
    std::fs::read_to_string("/proc/self/mountinfo").is_ok_and(|info| {
        info.lines().any(|line| {
            line.split_once(" - ")
                .is_some_and(|(_, post)| post.starts_with("cgroup2 ") && post.contains("favordynmods"))
        })
    })
}

/// Held while a container is being created; the lock is kept warm until the last one drops.
pub struct Hold(Arc<Warmer>);

/// Keep the migration lock warm until the returned value is dropped.
pub fn hold() -> Hold {
    WARMER.hold()
}

/// Holds taken and not yet dropped, in this process.
#[cfg(test)]
pub(super) fn holders() -> usize {
    WARMER.state().holders
}

impl Warmer {
    fn new(target: Option<PathBuf>, mark: PathBuf, interval: Duration) -> Arc<Self> {
        Arc::new(Warmer {
            target,
            mark,
            interval,
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn hold(self: &Arc<Self>) -> Hold {
        let mut state = self.state();
        state.holders += 1;
        if !state.off && !state.started {
            match &self.target {
                Some(_) => {
                    let me = self.clone();
                    let spawned = std::thread::Builder::new()
                        .name("cgroup-attach-warm".into())
                        .spawn(move || me.run());
                    match spawned {
                        Ok(_) => state.started = true,
                        Err(e) => {
                            tracing::debug!(error = %e, "no thread to keep the cgroup attach lock warm");
                            state.off = true;
                        }
                    }
                }
                None => {
                    tracing::debug!("no cgroup of our own found: the cgroup attach lock is not kept warm");
                    state.off = true;
                }
            }
        }
        drop(state);
        self.wake.notify_one();
        Hold(self.clone())
    }

    /// Whether some runner process wrote less than an interval ago.
    fn written_lately(&self) -> bool {
        self.mark_age().is_some_and(|age| age < self.interval)
    }

    /// How long ago some runner process wrote (`None`: no mark).
    fn mark_age(&self) -> Option<Duration> {
        std::fs::metadata(&self.mark)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
    }

    /// The writer: idle while nothing is being created.
    fn run(&self) {
        let Some(target) = &self.target else { return };
        // Before this process touches the mark: whether its first write can be measured cold.
        let mut first_quiet = Some(self.mark_age().is_none_or(|age| age >= QUIET));
        // Without a mark (no /run/runner yet) this process writes on its own schedule.
        let mark = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&self.mark)
            .ok();
        loop {
            {
                let mut state = self.state();
                state.parked = true;
                let mut state = self
                    .wake
                    .wait_while(state, |s| s.holders == 0)
                    .unwrap_or_else(|e| e.into_inner());
                state.parked = false;
            }
            if !(mark.is_some() && self.written_lately()) {
                let quiet = first_quiet
                    .take()
                    .unwrap_or_else(|| self.mark_age().is_none_or(|age| age >= QUIET));
                // "0": the writing process itself, into the cgroup it is already in.
                let began = std::time::Instant::now();
                if let Err(e) = std::fs::write(target, "0") {
                    tracing::debug!(file = %target.display(), error = %e, "the cgroup attach lock is not kept warm");
                    self.state().off = true;
                    return;
                }
                let cold = began.elapsed();
                crate::metrics::increment(WRITES, &[]);
                if let Some(mark) = &mark {
                    let _ = mark.set_modified(std::time::SystemTime::now());
                }
                // The first write since nobody wrote (this one may have waited for a grace
                // period) against one right after it: the difference is what warming saves.
                if quiet && self.state().calibrate {
                    let began = std::time::Instant::now();
                    let warm = std::fs::write(target, "0").map(|()| began.elapsed());
                    let pays = warm.as_ref().is_ok_and(|warm| cold.saturating_sub(*warm) >= PAYS);
                    crate::metrics::increment(CALIBRATIONS, &[("result", if pays { "pays" } else { "saves-nothing" })]);
                    tracing::debug!(?cold, ?warm, pays, "calibrated the cgroup attach warming");
                    let mut state = self.state();
                    state.calibrate = false;
                    if !pays {
                        state.off = true;
                        return;
                    }
                }
            }
            std::thread::sleep(self.interval);
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut state = self.0.state();
        state.holders = state.holders.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait_for(what: &str, cond: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !cond() {
            assert!(std::time::Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn writes_only_while_held_and_stops_for_good_after_a_failure() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("cgroup.procs");
        let warmer = Warmer::new(Some(file.clone()), dir.path().join("mark"), INTERVAL);
        let (a, b) = (warmer.hold(), warmer.hold());
        wait_for("a write while held", || file.exists());
        drop(a);
        std::fs::remove_file(&file).unwrap();
        wait_for("writes go on while one hold is left", || file.exists());
        drop(b);
        // Once parked, it writes nothing until the next hold.
        wait_for("the writer parks", || warmer.state().parked);
        let _ = std::fs::remove_file(&file);
        std::thread::sleep(INTERVAL * 5);
        assert!(!file.exists(), "written with nothing held");
        assert_eq!(warmer.state().holders, 0);

        let broken = Warmer::new(
            Some(dir.path().join("gone/cgroup.procs")),
            dir.path().join("mark2"),
            INTERVAL,
        );
        let held = broken.hold();
        wait_for("a failed write turns it off", || broken.state().off);
        drop(held);
        let _again = broken.hold();
        assert!(broken.state().off);
        let nothing = Warmer::new(None, dir.path().join("mark3"), INTERVAL);
        let _held = nothing.hold();
        let state = nothing.state();
        assert!(state.off && !state.started);
    }

    /// `auto` measures its first quiet write against the next: where a write costs nothing
    /// (here a plain file; on a host with favordynmods, cgroup.procs) the warming stops.
    #[test]
    fn auto_turns_itself_off_where_a_cold_write_costs_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("cgroup.procs");
        // There already, as a cgroup's file is: a first write that made the file (a new inode,
        // under a loaded suite over a millisecond) would look like a cold attach and "pay".
        std::fs::write(&file, "").unwrap();
        let warmer = Warmer::new(Some(file.clone()), dir.path().join("mark"), INTERVAL);
        warmer.state().calibrate = true;
        let held = warmer.hold();
        wait_for("off after the calibration", || warmer.state().off);
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "0", "it wrote to measure");
        drop(held);
        // Forced on (no calibration), it keeps writing.
        let forced = Warmer::new(Some(file.clone()), dir.path().join("mark2"), INTERVAL);
        let held = forced.hold();
        std::fs::remove_file(&file).unwrap();
        wait_for("writes go on", || file.exists());
        assert!(!forced.state().off);
        drop(held);
    }

    #[test]
    fn processes_take_turns_through_the_shared_mark() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("cgroup.procs");
        let mark = dir.path().join("mark");
        // Another process wrote just now, and keeps writing: this one skips its writes.
        std::fs::write(&mark, "").unwrap();
        let other = std::fs::File::options().write(true).open(&mark).unwrap();
        let interval = Duration::from_millis(300);
        let warmer = Warmer::new(Some(file.clone()), mark, interval);
        let held = warmer.hold();
        for _ in 0..20 {
            other.set_modified(std::time::SystemTime::now()).unwrap();
            std::thread::sleep(interval / 10);
        }
        assert!(!file.exists(), "wrote while another process was writing");
        // The other one stops: this one takes over.
        wait_for("taking over", || file.exists());
        drop(held);
    }
}
