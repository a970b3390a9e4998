//! `resources.ephemeralStorage`: what a sandbox writes to its writable layer, its workspace and
//! its agent directory, measured the way the kubelet measures a pod without filesystem
//! quotas, and the sandbox evicted when it is over its limit.
//!
//! Why measurement: a kernel quota needs project quotas (XFS, or ext4 made with the `quota`
//! feature and mounted `prjquota`) on the filesystem containerd's snapshots live on, which
//! runner does not choose; this project's machines have plain ext4. The kernel still bounds
//! the fastest way over the limit, one file written at disk speed: every container gets
//! `RLIMIT_FSIZE` at its limit (`spec::build`).
//!
//! Host work, bounded: one monitor per process, two threads, however many sandboxes it
//! watches. Each sandbox's trees are walked through descriptors (`confined::Root::disk_usage`:
//! no link followed, no mount point crossed), each walk stopped once the sandbox is over its
//! limit (so it costs at most `limit / 4 KiB` entries), and walked again 10 ms later while
//! its usage moves, backing off to every 8 s while it does not; a walk that took `t` is not
//! repeated sooner than `20 t`. Between walks a cheap probe (the cgroup's memory usage, which
//! grows with the page cache a writer dirties) brings the next walk forward. With thousands
//! of sandboxes the process keeps to a budget (1,000 probes and 100 idle walks a second):
//! each sandbox is looked at less often instead (every 5 s and 50 s at 5,000). What is counted
//! is growth since the sandbox was first measured, which its engine makes happen before the
//! sandbox's command starts (`StorageWatch::baseline`): the workspace the user gave and the
//! image are not the sandbox's writes, and none of the sandbox's writes is taken for them.

use std::collections::{BinaryHeap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::confined::{FullFile, Root};

/// The walk cadence while a sandbox's usage moves.
const FAST: Duration = Duration::from_millis(10);
/// The longest wait between walks of a sandbox whose usage does not move.
const SLOW: Duration = Duration::from_secs(8);
/// How often the cheap probe looks at a sandbox between walks.
const PROBE: Duration = Duration::from_millis(500);
/// Probes per second across every sandbox of the process, at most: with thousands of idle
/// sessions a probe of each every 500 ms was 3,000 cgroupfs reads a second (5 % of the
/// server's 2 cores at 1,560 sessions, all of its idle CPU).
const PROBES_PER_SECOND: f64 = 1000.0;
/// Walks per second of sandboxes whose usage does not move, at most (the same reason).
const IDLE_WALKS_PER_SECOND: f64 = 100.0;

/// How often each of `watched` sandboxes is probed: `PROBE`, or less often when so many are
/// watched that the process would probe more than `PROBES_PER_SECOND`.
fn probe_every(watched: usize) -> Duration {
    PROBE.max(Duration::from_secs_f64(watched as f64 / PROBES_PER_SECOND))
}

/// The longest wait between walks of a sandbox whose usage does not move, for `watched`
/// sandboxes.
fn slow_every(watched: usize) -> Duration {
    SLOW.max(Duration::from_secs_f64(watched as f64 / IDLE_WALKS_PER_SECOND))
}

/// A change smaller than this (in usage or in the probe) does not count as movement.
const MOVED: u64 = 1 << 20;
/// A walk that took `t` is repeated no sooner than `WALK_DUTY * t` (a sandbox's walks take at
/// most 1/20 of a monitor thread).
const WALK_DUTY: u32 = 20;
/// Monitor threads per process.
const THREADS: usize = 2;

/// What a measured tree is to the sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tree {
    /// The container's writable layer (the overlay's upper directory).
    WritableLayer,
    /// Its workspace on the host.
    Workspace,
    /// The directory it shares with the host (the agent's requests, tools' FIFOs).
    AgentDir,
}

impl Tree {
    fn name(self) -> &'static str {
        match self {
            Tree::WritableLayer => "writable layer",
            Tree::Workspace => "workspace",
            Tree::AgentDir => "agent directory",
        }
    }
}

struct Measured {
    kind: Tree,
    path: PathBuf,
    /// The first measurement: what was there before the sandbox wrote.
    baseline: Option<u64>,
}

struct Entry {
    trees: Vec<Measured>,
    limit: u64,
    /// The cgroup whose memory usage is the probe.
    cgroup: Option<String>,
    interval: Duration,
    next_walk: Instant,
    /// When it is next looked at (a probe or a walk): its one live item in the queue.
    due: Instant,
    last_growth: Option<u64>,
    last_probe: Option<u64>,
    busy: bool,
    /// Its baseline is being measured by [`StorageWatch::baseline`]: no periodic walk yet.
    baselining: bool,
    evicted: CancellationToken,
    verdict: Arc<Mutex<Option<String>>>,
    /// When it began to be watched: before its command started.
    since: std::time::SystemTime,
}

#[derive(Default)]
struct State {
    next_id: u64,
    entries: HashMap<u64, Entry>,
    /// (when, id), earliest first; stale items (an entry gone or rescheduled) are skipped.
    queue: BinaryHeap<std::cmp::Reverse<(Instant, u64)>>,
}

struct Inner {
    state: Mutex<State>,
    wake: Condvar,
    started: std::sync::Once,
}

impl Default for Inner {
    fn default() -> Self {
        Inner {
            state: Mutex::default(),
            wake: Condvar::new(),
            started: std::sync::Once::new(),
        }
    }
}

/// The per-process monitor of sandboxes' ephemeral storage.
#[derive(Clone, Default)]
pub struct StorageMonitor {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for StorageMonitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StorageMonitor")
    }
}

/// One sandbox watched; it stops being watched when this is dropped.
pub struct StorageWatch {
    id: u64,
    inner: Arc<Inner>,
    evicted: CancellationToken,
    /// Cancelled when the watch ends (dropped): what waits for an eviction can stop.
    ended: CancellationToken,
    verdict: Arc<Mutex<Option<String>>>,
}

impl std::fmt::Debug for StorageWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StorageWatch").field("id", &self.id).finish()
    }
}

impl StorageMonitor {
    /// The process's monitor, which every engine of the process shares. Engines are made per
    /// call (a session, a job): with a monitor each, every sandbox ever started left two
    /// threads behind in the server (10,000 at 5,000 live sessions, and more with churn).
    pub fn process() -> StorageMonitor {
        static PROCESS: std::sync::OnceLock<StorageMonitor> = std::sync::OnceLock::new();
        PROCESS.get_or_init(StorageMonitor::default).clone()
    }

    /// Watch a sandbox whose limit is `limit` bytes; `cgroup` (its `cgroupsPath`) is probed
    /// between walks. Its trees are added with [`StorageWatch::add`].
    pub fn watch(&self, limit: u64, cgroup: Option<String>) -> StorageWatch {
        self.inner.started.call_once(|| {
            for i in 0..THREADS {
                let inner = self.inner.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("runner-storage-{i}"))
                    .spawn(move || worker(&inner));
                if let Err(e) = spawned {
                    tracing::error!(error = %e, "cannot start the ephemeral-storage monitor");
                }
            }
        });
        let evicted = CancellationToken::new();
        let verdict = Arc::new(Mutex::new(None));
        let mut state = self.inner.state.lock().expect("storage lock");
        state.next_id += 1;
        let id = state.next_id;
        state.entries.insert(
            id,
            Entry {
                trees: Vec::new(),
                limit,
                cgroup,
                interval: FAST,
                next_walk: Instant::now(),
                due: Instant::now(),
                last_growth: None,
                last_probe: None,
                busy: false,
                baselining: false,
                evicted: evicted.clone(),
                verdict: verdict.clone(),
                since: coarse_now(),
            },
        );
        StorageWatch {
            id,
            inner: self.inner.clone(),
            evicted,
            ended: CancellationToken::new(),
            verdict,
        }
    }

    /// Sandboxes watched now.
    pub fn watched(&self) -> usize {
        self.inner.state.lock().expect("storage lock").entries.len()
    }
}

impl StorageWatch {
    /// Count `path` (measured from now) against the sandbox's limit.
    pub fn add(&self, kind: Tree, path: PathBuf) {
        let mut state = self.inner.state.lock().expect("storage lock");
        let now = Instant::now();
        if let Some(entry) = state.entries.get_mut(&self.id) {
            entry.trees.push(Measured {
                kind,
                path,
                baseline: None,
            });
            if entry.baselining {
                // `baseline` measures it and then schedules the walks.
                return;
            }
            entry.next_walk = now;
            entry.due = now;
            state.queue.push(std::cmp::Reverse((now, self.id)));
            self.inner.wake.notify_one();
        }
    }

    /// Hold the periodic walks until [`baseline`](Self::baseline) has measured the trees
    /// added from now on (the monitor would otherwise walk them at once beside it).
    pub fn hold_for_baseline(&self) {
        if let Some(entry) = self.inner.state.lock().expect("storage lock").entries.get_mut(&self.id) {
            entry.baselining = true;
        }
    }

    /// Measure every tree not measured yet as its baseline, now, on the calling thread (it
    /// blocks: call it off the async threads). Call it before the sandbox's command starts:
    /// then none of the command's writes is taken for what was there before it. Left to the
    /// first periodic walk, the baseline was taken whenever a monitor thread got to it, which
    /// under load was after the command had written megabytes into its workspace; a writer
    /// stopped at the limit by `RLIMIT_FSIZE` then ended below the limit by the count, its Job
    /// "Error" instead of "Evicted".
    ///
    /// The periodic walks of the sandbox wait for it and start `FAST` after it.
    pub fn baseline(&self) {
        let (todo, limit) = {
            let mut state = self.inner.state.lock().expect("storage lock");
            let Some(entry) = state.entries.get_mut(&self.id) else {
                return;
            };
            let todo: Vec<(usize, PathBuf)> = (entry.trees.iter().enumerate())
                .filter(|(_, t)| t.baseline.is_none())
                .map(|(i, t)| (i, t.path.clone()))
                .collect();
            entry.baselining = true;
            (todo, entry.limit)
        };
        let unmeasured: Vec<(PathBuf, Option<u64>)> = todo.iter().map(|(_, p)| (p.clone(), None)).collect();
        let walk = measure(&unmeasured, limit, None);
        tracing::debug!(
            ms = walk.took.as_secs_f64() * 1e3,
            trees = todo.len(),
            "storage baseline measured"
        );
        let mut state = self.inner.state.lock().expect("storage lock");
        let Some(entry) = state.entries.get_mut(&self.id) else {
            return;
        };
        for ((i, _), size) in todo.iter().zip(&walk.sizes) {
            // A walk that began before this one may have set it first: also before the start.
            if let (Some(tree), Some(size)) = (entry.trees.get_mut(*i), size) {
                tree.baseline.get_or_insert(*size);
            }
        }
        entry.baselining = false;
        entry.interval = FAST.max(walk.took * WALK_DUTY);
        let next = Instant::now() + entry.interval;
        entry.next_walk = next;
        entry.due = next;
        state.queue.push(std::cmp::Reverse((next, self.id)));
        self.inner.wake.notify_one();
    }

    /// Cancelled when the sandbox is found over its limit.
    pub fn evicted(&self) -> &CancellationToken {
        &self.evicted
    }

    /// Measure now, on the calling thread (it blocks: call it off the async threads), and
    /// evict if the sandbox is at or over its limit; its verdict if it was evicted, now or
    /// before. For the end of a command that failed: one that ran into the limit (a write
    /// refused with EFBIG at `RLIMIT_FSIZE`) ends before the next periodic walk would see it.
    pub fn check_now(&self) -> Option<String> {
        let (trees, limit, since) = {
            let state = self.inner.state.lock().expect("storage lock");
            let entry = state.entries.get(&self.id)?;
            let trees: Vec<(PathBuf, Option<u64>)> = entry.trees.iter().map(|t| (t.path.clone(), t.baseline)).collect();
            (trees, entry.limit, entry.since)
        };
        if trees.iter().any(|(_, baseline)| baseline.is_some()) {
            // `RLIMIT_FSIZE` is the limit: a file the command wrote to that size is where the
            // kernel stopped it. The count may be under the limit then (the file was there
            // before, counted in the baseline; or the command removed other files first), and
            // the command ran into the limit all the same.
            let full = FullFile { size: limit, since };
            let walk = measure(&trees, limit, Some(full));
            let mut state = self.inner.state.lock().expect("storage lock");
            if let Some(entry) = state.entries.get_mut(&self.id) {
                // Only trees measured before count: a first measurement now is no baseline.
                let known: Vec<Option<u64>> = entry
                    .trees
                    .iter()
                    .zip(&walk.sizes)
                    .map(|(t, s)| t.baseline.and(*s))
                    .collect();
                let (growth, parts) = growth_of(&mut entry.trees, &known);
                if growth >= entry.limit || walk.too_deep || walk.full_file.is_some() {
                    evict(entry, growth, &walk, &parts);
                    state.entries.remove(&self.id);
                }
            }
        }
        self.verdict()
    }

    /// Cancelled when this watch is dropped.
    pub fn ended(&self) -> &CancellationToken {
        &self.ended
    }

    /// Why the sandbox was evicted (Kubernetes' eviction message), once it was.
    pub fn verdict(&self) -> Option<String> {
        self.verdict.lock().expect("verdict lock").clone()
    }
}

impl Drop for StorageWatch {
    fn drop(&mut self) {
        self.ended.cancel();
        self.inner.state.lock().expect("storage lock").entries.remove(&self.id);
    }
}

/// What one walk of a sandbox's trees found.
struct Walk {
    /// Per tree: bytes now (`None`: it could not be measured, e.g. already removed).
    sizes: Vec<Option<u64>>,
    /// A walk stopped at its bound: the sizes are lower bounds.
    stopped: bool,
    /// A tree holds directories nested too deep to measure.
    too_deep: bool,
    /// The first file found that is the `FullFile` asked for: its tree's index, its path there.
    full_file: Option<(usize, String)>,
    took: Duration,
}

fn measure(trees: &[(PathBuf, Option<u64>)], limit: u64, full: Option<FullFile>) -> Walk {
    let began = Instant::now();
    let mut too_deep = false;
    let mut stopped = false;
    let mut full_file = None;
    let sizes = (trees.iter().enumerate())
        .map(|(i, (path, baseline))| {
            // Past `baseline + limit` this tree alone is over: the walk need not go on.
            let stop_at = baseline.map_or(u64::MAX, |b| b.saturating_add(limit).saturating_add(1));
            match Root::open(path).and_then(|root| root.disk_usage_noting(stop_at, full)) {
                Ok(usage) => {
                    too_deep |= usage.too_deep;
                    stopped |= usage.stopped;
                    if full_file.is_none() {
                        full_file = usage.full_file.map(|f| (i, f));
                    }
                    Some(usage.bytes)
                }
                Err(e) => {
                    tracing::debug!(path = %path.display(), error = %e, "measuring ephemeral storage");
                    None
                }
            }
        })
        .collect();
    Walk {
        sizes,
        stopped,
        too_deep,
        full_file,
        took: began.elapsed(),
    }
}

/// What the probe reads: the cgroup's memory usage (page cache a writer dirties included).
fn probe(cgroup: &str) -> Option<u64> {
    crate::runtime::cgroupfs::memory_usage(cgroup)
}

fn worker(inner: &Inner) {
    loop {
        let (id, trees, limit) = {
            let mut state = inner.state.lock().expect("storage lock");
            let id = loop {
                let now = Instant::now();
                let next = state.queue.peek().map(|r| r.0);
                match next {
                    None => state = inner.wake.wait(state).expect("storage lock"),
                    Some((due, id)) if due <= now => {
                        state.queue.pop();
                        // Only an entry's latest scheduling counts; one being walked is
                        // rescheduled by its walk.
                        match state.entries.get(&id) {
                            Some(e) if !e.busy && !e.baselining && e.due == due => break id,
                            _ => continue,
                        }
                    }
                    Some((due, _)) => {
                        state = inner.wake.wait_timeout(state, due - now).expect("storage lock").0;
                    }
                }
            };
            let watched = state.entries.len();
            let Some(entry) = state.entries.get_mut(&id) else {
                continue;
            };
            let now = Instant::now();
            if entry.next_walk > now {
                // A probe only: walk now if the sandbox's memory moved.
                let reading = entry.cgroup.as_deref().and_then(probe);
                let moved = match (reading, entry.last_probe) {
                    (Some(r), Some(last)) => r.abs_diff(last) >= MOVED,
                    _ => false,
                };
                entry.last_probe = reading.or(entry.last_probe);
                if !moved {
                    let next = (now + probe_every(watched)).min(entry.next_walk);
                    entry.due = next;
                    state.queue.push(std::cmp::Reverse((next, id)));
                    continue;
                }
            }
            entry.busy = true;
            let trees: Vec<(PathBuf, Option<u64>)> = entry.trees.iter().map(|t| (t.path.clone(), t.baseline)).collect();
            (id, trees, entry.limit)
        };
        let walk = measure(&trees, limit, None);
        let mut state = inner.state.lock().expect("storage lock");
        let watched = state.entries.len();
        let Some(entry) = state.entries.get_mut(&id) else {
            continue;
        };
        entry.busy = false;
        let (growth, parts) = growth_of(&mut entry.trees, &walk.sizes);
        entry.last_probe = entry.cgroup.as_deref().and_then(probe).or(entry.last_probe);
        if growth >= entry.limit || walk.too_deep {
            evict(entry, growth, &walk, &parts);
            state.entries.remove(&id);
            continue;
        }
        let moved = entry.last_growth.is_none_or(|last| last.abs_diff(growth) >= MOVED);
        entry.last_growth = Some(growth);
        entry.interval = if moved {
            FAST
        } else {
            (entry.interval * 2).min(slow_every(watched))
        };
        entry.interval = entry.interval.max(walk.took * WALK_DUTY);
        let now = Instant::now();
        // A tree added during this walk (its scheduling was skipped while the entry was
        // busy) gets its first measurement at once, not an interval later.
        entry.next_walk = if entry.trees.len() > walk.sizes.len() {
            now
        } else {
            now + entry.interval
        };
        let next = (now + probe_every(watched)).min(entry.next_walk);
        entry.due = next;
        state.queue.push(std::cmp::Reverse((next, id)));
    }
}

/// Evict a watched sandbox: its processes killed at once, the verdict set, the token
/// cancelled. The caller removes the entry.
fn evict(entry: &Entry, growth: u64, walk: &Walk, parts: &[String]) {
    // A walk stops as soon as the sandbox is over: the usage is then a lower bound.
    let verdict = if walk.too_deep {
        format!(
            "ephemeral local storage cannot be measured: directories nested deeper than {} levels",
            crate::confined::MAX_PACK_DEPTH
        )
    } else if let (true, Some((i, path))) = (growth < entry.limit, &walk.full_file) {
        let tree = entry.trees.get(*i).map_or("sandbox", |t| t.kind.name());
        format!(
            "ephemeral local storage limit of {} reached by the size of a file (no file may be larger): {tree} {path}; usage {}{} ({})",
            human(entry.limit),
            if walk.stopped { "of at least " } else { "" },
            human(growth),
            parts.join(", ")
        )
    } else {
        format!(
            "ephemeral local storage usage {}{} reached the limit of {} ({})",
            if walk.stopped { "of at least " } else { "" },
            human(growth),
            human(entry.limit),
            parts.join(", ")
        )
    };
    tracing::warn!(verdict, "evicting a sandbox");
    // Killed from here, at once: the token's waiters (containerd's kill, the job's result)
    // take milliseconds more, in which a writer at disk speed writes on.
    if let Some(cgroup) = &entry.cgroup {
        kill_cgroup(cgroup);
    }
    *entry.verdict.lock().expect("verdict lock") = Some(verdict);
    entry.evicted.cancel();
    crate::metrics::increment(EVICTIONS, &[("reason", "ephemeral-storage")]);
}

/// Growth per tree since its baseline, summed, and its parts for the verdict. Trees never
/// measured count nothing yet.
fn growth_of(trees: &mut [Measured], sizes: &[Option<u64>]) -> (u64, Vec<String>) {
    let mut growth = 0u64;
    let mut parts = Vec::new();
    for (tree, size) in trees.iter_mut().zip(sizes) {
        let Some(size) = *size else { continue };
        let base = *tree.baseline.get_or_insert(size);
        let grew = size.saturating_sub(base);
        growth = growth.saturating_add(grew);
        parts.push(format!("{} +{}", tree.kind.name(), human(grew)));
    }
    (growth, parts)
}

/// SIGKILL every process of a container's cgroup (a few rounds: a fork may land between the
/// read of the list and the kills). The cgroup is the container's own, so every PID in it is
/// one of the sandbox's processes.
fn kill_cgroup(cgroup: &str) {
    for _ in 0..4 {
        let pids = crate::runtime::cgroupfs::procs(cgroup);
        if pids.is_empty() {
            return;
        }
        for pid in pids {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// Now by the clock the kernel stamps files' times with (`CLOCK_REALTIME_COARSE`, one tick
/// behind at most), plus one tick: a file changed after it, by its ctime, was changed after
/// this call. The tick is there because a file may be stamped finer than that clock (Linux
/// 6.13's multigrain timestamps use the fine clock for a ctime that was just read): a file
/// written just before the watch began was seen stamped past its coarse start (a flaky unit
/// test). A command's own writes to its limit come far later than a tick after its start.
fn coarse_now() -> std::time::SystemTime {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec through the pointer, which points at `now`.
    if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut now) } != 0 {
        return std::time::SystemTime::now() + STAMP_TICK;
    }
    std::time::UNIX_EPOCH + Duration::new(now.tv_sec as u64, now.tv_nsec as u32) + STAMP_TICK
}

/// The coarse clock's tick at its longest (HZ=100).
const STAMP_TICK: Duration = Duration::from_millis(10);

/// Sandboxes evicted, by reason (Prometheus counter).
pub const EVICTIONS: &str = "runner_evictions_total";

/// Bytes as the eviction message shows them (`64Mi`, `70.2Mi`).
fn human(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)];
    for (suffix, unit) in UNITS {
        if bytes >= unit {
            let whole = bytes / unit;
            let tenth = (bytes % unit) * 10 / unit;
            return if tenth == 0 {
                format!("{whole}{suffix}")
            } else {
                format!("{whole}.{tenth}{suffix}")
            };
        }
    }
    format!("{bytes}")
}

#[cfg(test)]
mod tests {

    #[test]
    fn probes_and_idle_walks_slow_down_past_their_budget_only() {
        assert_eq!(probe_every(1), PROBE);
        assert_eq!(probe_every(500), PROBE);
        assert_eq!(probe_every(5000), Duration::from_secs(5));
        assert_eq!(slow_every(100), SLOW);
        assert_eq!(slow_every(5000), Duration::from_secs(50));
    }

    #[test]
    fn engines_share_the_process_monitor() {
        let (a, b) = (StorageMonitor::process(), StorageMonitor::process());
        assert!(Arc::ptr_eq(&a.inner, &b.inner));
        let watches: Vec<_> = (0..10).map(|_| a.watch(1 << 30, None)).collect();
        let _more = b.watch(1 << 30, None);
        assert_eq!(b.watched(), 11);
        drop(watches);
        assert_eq!(a.watched(), 1);
    }
    use super::*;

    #[test]
    fn sizes_read_like_quantities() {
        assert_eq!(human(64 << 20), "64Mi");
        assert_eq!(human((70 << 20) + (1 << 19)), "70.5Mi");
        assert_eq!(human(512), "512");
        assert_eq!(human(10 << 30), "10Gi");
    }

    /// A tree of 20,000 empty files in 20 directories under `root`: its walk takes a while.
    fn twenty_thousand_files(root: &std::path::Path) {
        for d in 0..20 {
            let dir = root.join(format!("d{d}"));
            std::fs::create_dir_all(&dir).unwrap();
            for f in 0..1000 {
                std::fs::File::create(dir.join(format!("f{f}"))).unwrap();
            }
        }
    }

    /// The baseline is what was there before the command: a writer stopped by `RLIMIT_FSIZE`
    /// exactly at the limit, whose command then fails, is evicted by the check at its end,
    /// however slow the first walk of a large workspace is. The trees are measured by
    /// `baseline`, which the periodic walks wait for; before it, the first walk ran on a
    /// monitor thread beside the command, and took part of its writes for the baseline.
    #[test]
    fn a_writer_stopped_at_the_limit_is_evicted_whatever_the_first_walk_took() {
        let monitor = StorageMonitor::default();
        let tmp = tempfile::tempdir().unwrap();
        let (ws, upper) = (tmp.path().join("ws"), tmp.path().join("upper"));
        std::fs::create_dir(&upper).unwrap();
        // A large workspace.
        twenty_thousand_files(&ws);
        std::fs::write(ws.join("before"), vec![1u8; 8 << 20]).unwrap();
        let limit = 4 << 20;
        let watch = monitor.watch(limit, None);
        watch.hold_for_baseline();
        watch.add(Tree::WritableLayer, upper.clone());
        watch.add(Tree::Workspace, ws.clone());
        let began = Instant::now();
        watch.baseline();
        eprintln!("baseline of 20,000 files: {:?}", began.elapsed());
        // The command: a file written to exactly the limit (where RLIMIT_FSIZE stops it),
        // then it fails, before any periodic walk could see it.
        std::fs::write(ws.join("fill"), vec![2u8; limit as usize]).unwrap();
        let verdict = watch.check_now().expect("a writer at its limit was not evicted");
        assert!(verdict.contains("reached the limit of 4Mi"), "{verdict}");
        assert!(verdict.contains("workspace +4Mi"), "{verdict}");
        assert!(watch.evicted().is_cancelled());
    }

    /// `RLIMIT_FSIZE` is the limit: a file the command appended to until the kernel stopped
    /// it is evicted by the check at its end, though the count is under the limit by what the
    /// file was before (here one inode's charge, an empty file the workspace had). A file at
    /// that size the command did not write (the workspace's own) evicts nothing.
    #[test]
    fn a_file_written_to_the_limit_is_an_eviction_and_one_that_was_there_is_not() {
        let monitor = StorageMonitor::default();
        let limit = 4 << 20;
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("dataset"), vec![1u8; limit as usize + 1]).unwrap();
        std::fs::File::create(tmp.path().join("fill")).unwrap();
        let watch = monitor.watch(limit, None);
        watch.hold_for_baseline();
        watch.add(Tree::Workspace, tmp.path().to_path_buf());
        watch.baseline();
        // A failed command that wrote nothing: the large file it found evicts nothing.
        assert_eq!(watch.check_now(), None);
        // A command's writes come ticks of the coarse clock after its watch began.
        std::thread::sleep(Duration::from_millis(20));
        let mut fill = std::fs::OpenOptions::new()
            .append(true)
            .open(tmp.path().join("fill"))
            .unwrap();
        std::io::Write::write_all(&mut fill, &vec![2u8; limit as usize]).unwrap();
        let verdict = watch
            .check_now()
            .expect("a file written to the limit was not an eviction");
        assert!(
            verdict.contains("limit of 4Mi reached by the size of a file") && verdict.contains("workspace fill;"),
            "{verdict}"
        );
        assert!(watch.evicted().is_cancelled());
    }

    /// A command that stays under its limit is not evicted by the check at its end, and the
    /// trees' own contents (measured by `baseline`) never count.
    #[test]
    fn a_command_under_its_limit_is_not_evicted_at_its_end() {
        let monitor = StorageMonitor::default();
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("before"), vec![1u8; 8 << 20]).unwrap();
        let watch = monitor.watch(4 << 20, None);
        watch.hold_for_baseline();
        watch.add(Tree::Workspace, tmp.path().to_path_buf());
        watch.baseline();
        std::fs::write(tmp.path().join("small"), vec![2u8; 3 << 20]).unwrap();
        assert_eq!(watch.check_now(), None);
        assert!(!watch.evicted().is_cancelled());
        // The periodic walks run after the baseline: they find the growth, and no eviction.
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(watch.verdict(), None);
        assert_eq!(monitor.watched(), 1);
    }

    /// A tree added while the first walk is running is measured right after it, not one
    /// interval later (`WALK_DUTY` times the walk: a second after a 50 ms walk).
    #[test]
    fn a_tree_added_during_a_walk_is_measured_next() {
        let monitor = StorageMonitor::default();
        let tmp = tempfile::tempdir().unwrap();
        let (big, small) = (tmp.path().join("big"), tmp.path().join("small"));
        std::fs::create_dir(&small).unwrap();
        twenty_thousand_files(&big);
        let watch = monitor.watch(1 << 30, None);
        watch.add(Tree::WritableLayer, big);
        // Wait until a monitor thread walks it.
        let began = Instant::now();
        while !monitor.inner.state.lock().unwrap().entries.values().any(|e| e.busy) {
            assert!(began.elapsed() < Duration::from_secs(10), "the first walk never began");
            std::thread::yield_now();
        }
        watch.add(Tree::Workspace, small);
        // Once that walk is over, the next one (which measures the tree added) is due at once.
        loop {
            assert!(began.elapsed() < Duration::from_secs(30), "the first walk never ended");
            let state = monitor.inner.state.lock().unwrap();
            let entry = state.entries.values().next().unwrap();
            if entry.busy {
                drop(state);
                std::thread::yield_now();
                continue;
            }
            let (measured, next) = (entry.trees[1].baseline.is_some(), entry.next_walk);
            drop(state);
            assert!(
                measured || next <= Instant::now(),
                "the tree added is not measured, its next walk in {:?}",
                next.saturating_duration_since(Instant::now())
            );
            break;
        }
    }

    /// A sandbox writing past its limit is evicted within a few walks, one that stays under
    /// it is not, and what was there first (the baseline) is never counted.
    #[test]
    fn growth_past_the_limit_evicts_and_the_baseline_is_not_counted() {
        let monitor = StorageMonitor::default();
        let tmp = tempfile::tempdir().unwrap();
        let (over, under) = (tmp.path().join("over"), tmp.path().join("under"));
        for dir in [&over, &under] {
            std::fs::create_dir(dir).unwrap();
            // 8 MiB there before the watch: the baseline.
            std::fs::write(dir.join("before"), vec![1u8; 8 << 20]).unwrap();
        }
        let limit = 4 << 20;
        let (a, b) = (monitor.watch(limit, None), monitor.watch(limit, None));
        a.add(Tree::Workspace, over.clone());
        b.add(Tree::Workspace, under.clone());
        std::thread::sleep(Duration::from_millis(100));
        std::fs::write(under.join("small"), vec![2u8; 1 << 20]).unwrap();
        for i in 0..8 {
            std::fs::write(over.join(format!("f{i}")), vec![3u8; 1 << 20]).unwrap();
        }
        let began = Instant::now();
        while !a.evicted().is_cancelled() && began.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(a.evicted().is_cancelled(), "not evicted");
        let verdict = a.verdict().unwrap();
        assert!(verdict.contains("reached the limit of 4Mi (workspace +"), "{verdict}");
        std::thread::sleep(Duration::from_millis(600));
        assert!(!b.evicted().is_cancelled(), "{:?}", b.verdict());
        assert_eq!(monitor.watched(), 1);
        drop(b);
        assert_eq!(monitor.watched(), 0);
    }
}
