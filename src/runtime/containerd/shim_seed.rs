//! Warm shims: a containerd shim started ahead for the server's next cold container.
//!
//! A cold create's Tasks.Create starts a `containerd-shim-runc-v2` (its `start` command, then
//! its daemon: ~9 ms of a 45–60 ms cold session here, docs/benchmarks.md) before runc is
//! run. runc's shim groups containers by the spec annotation `io.containerd.runc.v2.group`
//! (see `shim_group`): a container whose group names a shim that listens already is handed
//! to that shim, whose daemon is up. So a server keeps a *seed* or two: a container of its
//! own whose task is created (its shim runs, `runc init` waits for a start that never comes)
//! and never started. A cold create takes a seed and names the seed's container as its
//! group; once its own Tasks.Create is sent the seed is spent, and deleted when the server is
//! next quiet (killed first, then deleted: runc's delete of a created container sleeps 100 ms
//! inside the shim, which measured +93 ms on the session's own start when it ran beside it).
//! The shim then serves that one container and exits with it, as any container's own shim
//! does: no two sandboxes ever share a shim through a seed.
//!
//! What a seed is: no image, no snapshot, no user code. Its root is a read-only directory of
//! the state dir holding one empty file (runc 1.1's `create` checks that the command exists
//! and is executable, it never runs it), with its own mount, pid, ipc, uts and cgroup
//! namespaces and a small cgroup; it runs as nobody with no capabilities and would fail to
//! exec were it ever started. The seeds are made when the server is quiet (200 ms after the
//! last cold create), never beside one, so they take no CPU from a create on the path; at
//! most `--warm-shims` of them, and none after a failure for a while. A server's stop deletes
//! its seeds; what a dead server left is removed by `runner gc` (they carry its owner label).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Engine, LABEL_KIND, LABEL_MANAGED, LABEL_OWNER, LABEL_STATE_DIR};
use crate::containerd::Stdio;
use crate::owner::owner_id;

/// The kind label of a seed's container.
pub const KIND_SHIM_SEED: &str = "shim-seed";
/// The most seeds a server keeps (`--warm-shims`).
pub const MAX_SEEDS: usize = 8;
/// How long the server must have been without a cold create before a seed is made.
const QUIET: Duration = Duration::from_millis(200);
/// After a seed could not be made, the next attempt waits this long.
const BACKOFF: Duration = Duration::from_secs(30);
/// How long making a seed may take before it is given up (a containerd that hangs; what it
/// made is gc's once the server is gone).
const MAKE_LIMIT: Duration = Duration::from_secs(60);
/// How long a seed's deletion may take before it is left to gc (a hung shim).
const RETIRE_LIMIT: Duration = Duration::from_secs(30);
/// The seed root's one file: the command runc checks and never runs.
const SEED_FILE: &str = "seed";
/// Seeds counted by what became of them, on `/metrics`.
pub const SEEDS_TOTAL: &str = "runner_warm_shims_total";

/// The seeds of one server (`runner serve --warm-shims N`).
#[derive(Debug)]
pub struct ShimSeeds {
    target: usize,
    stock: Mutex<Stock>,
}

#[derive(Debug, Default)]
struct Stock {
    /// Seeds whose task exists, newest last.
    ready: Vec<String>,
    /// Seeds a create has taken, to delete when the server is quiet.
    spent: Vec<String>,
    /// A refill is under way (one at a time).
    refilling: bool,
    /// The refill is making or deleting a seed (not waiting): a stop waits for it.
    working: bool,
    /// When a cold create last asked for a seed: refills wait for a quiet moment after it.
    last_demand: Option<Instant>,
    /// No seed is made before this (the last attempt failed).
    backoff_until: Option<Instant>,
    /// The server is stopping: nothing is made or put back.
    closed: bool,
}

/// A seed taken by a create: its container's id is the group the create names. Once the
/// create's Tasks.Create has been sent (`sent`) the seed is spent whatever becomes of the
/// create, even one dropped mid-call (containerd may still finish it and put the container
/// in the seed's shim: the seed must never be handed to a second create); dropped before,
/// the seed goes back to the stock.
#[derive(Debug)]
pub struct SeedTicket {
    seeds: Arc<ShimSeeds>,
    engine: Engine,
    pub group: String,
    sent: bool,
}

impl SeedTicket {
    /// The create's Tasks.Create is about to be sent: from now on the seed is spent.
    pub fn sent(&mut self) {
        self.sent = true;
    }
}

impl Drop for SeedTicket {
    /// Spent (see `sent`): deleted, and a new one made, once the server is quiet, neither on
    /// the create's path; at a stop, deleted now. Unspent: back to the stock.
    fn drop(&mut self) {
        match self.seeds.settle(&self.group, self.sent) {
            Settled::Stocked => {}
            Settled::Spent => {
                if tokio::runtime::Handle::try_current().is_ok() {
                    self.engine.refill_seeds(self.seeds.clone());
                }
            }
            Settled::Closed => {
                let (engine, id) = (self.engine.clone(), self.group.clone());
                match tokio::runtime::Handle::try_current() {
                    Ok(runtime) => drop(runtime.spawn(async move { engine.retire_seed(&id).await })),
                    Err(_) => tracing::warn!(seed = id, "a warm shim's seed is left to gc"),
                }
            }
        }
    }
}

/// Where a ticket's seed went when the ticket was dropped (`ShimSeeds::settle`).
#[derive(Debug, PartialEq, Eq)]
enum Settled {
    /// Back to the ready ones: its create never sent its Tasks.Create.
    Stocked,
    /// Spent, for the refill to delete when the server is quiet.
    Spent,
    /// The server stops: to delete now.
    Closed,
}

impl ShimSeeds {
    /// A stock of at most `target` seeds; `None` for 0 (no warm shims).
    pub fn new(target: usize) -> Option<Arc<ShimSeeds>> {
        (target > 0).then(|| {
            Arc::new(ShimSeeds {
                target: target.min(MAX_SEEDS),
                stock: Mutex::default(),
            })
        })
    }

    /// A seed for a cold create, if one is ready. Either way the create counts as demand:
    /// no seed is made until the server has been quiet for a moment.
    fn take(&self) -> Option<String> {
        let mut stock = self.stock.lock().expect("shim seeds");
        stock.last_demand = Some(Instant::now());
        if stock.closed {
            return None;
        }
        let seed = stock.ready.pop();
        if seed.is_none() {
            crate::metrics::increment(SEEDS_TOTAL, &[("result", "missed")]);
        }
        seed
    }

    /// A ticket's seed comes back: spent once its create's Tasks.Create was `sent` (the
    /// quiet moment then counts from now too: the create's own work goes on), else ready
    /// again; at a stop, neither.
    fn settle(&self, group: &str, sent: bool) -> Settled {
        let mut stock = self.stock.lock().expect("shim seeds");
        if sent {
            crate::metrics::increment(SEEDS_TOTAL, &[("result", "used")]);
            stock.last_demand = Some(Instant::now());
        }
        if stock.closed {
            Settled::Closed
        } else if sent {
            stock.spent.push(group.to_string());
            Settled::Spent
        } else {
            stock.ready.push(group.to_string());
            Settled::Stocked
        }
    }

    /// Seeds ready now.
    pub fn ready(&self) -> usize {
        self.stock.lock().expect("shim seeds").ready.len()
    }

    /// What the refill does next (see `Step`). Spent seeds go before new ones are made,
    /// both only once the server is quiet.
    fn next_step(&self, now: Instant) -> Step {
        let mut stock = self.stock.lock().expect("shim seeds");
        let step = if stock.closed || !self.has_work(&stock) {
            stock.refilling = false;
            Step::Stop
        } else if let Some(t) = stock.last_demand.map(|t| t + QUIET).filter(|t| *t > now) {
            Step::Wait(t - now)
        } else if let Some(id) = stock.spent.pop() {
            Step::Retire(id)
        } else {
            match stock.backoff_until {
                Some(t) if t > now => Step::Wait(t - now),
                _ => Step::Make,
            }
        };
        stock.working = matches!(step, Step::Make | Step::Retire(_));
        step
    }

    fn has_work(&self, stock: &Stock) -> bool {
        !stock.spent.is_empty() || stock.ready.len() < self.target
    }

    /// The refill may start (none is running): sets the flag.
    fn begin_refill(&self) -> bool {
        let mut stock = self.stock.lock().expect("shim seeds");
        if stock.refilling || stock.closed || !self.has_work(&stock) {
            return false;
        }
        stock.refilling = true;
        true
    }

    /// A seed was made: into the stock, or (the server stops) back out.
    fn made(&self, id: String) -> Option<String> {
        let mut stock = self.stock.lock().expect("shim seeds");
        if stock.closed {
            return Some(id);
        }
        stock.ready.push(id);
        None
    }

    fn failed(&self) {
        self.stock.lock().expect("shim seeds").backoff_until = Some(Instant::now() + BACKOFF);
    }

    /// The server stops: no seed is made or handed out any more; the ready and spent ones
    /// are returned for deletion.
    fn close(&self) -> Vec<String> {
        let mut stock = self.stock.lock().expect("shim seeds");
        stock.closed = true;
        let mut ids = std::mem::take(&mut stock.ready);
        ids.append(&mut stock.spent);
        ids
    }
}

/// What a refill does next.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    /// Make a seed.
    Make,
    /// Delete this spent seed.
    Retire(String),
    /// Wait this long (a create was asked for a seed lately, or the last make failed).
    Wait(Duration),
    /// Nothing to do (the stock is full and nothing is spent, or the server stops); the
    /// refill flag is down.
    Stop,
}

impl Engine {
    /// A ready seed for a cold create of this server (`RuntimeOptions::shim_seeds`), named as
    /// its shim group in `spec`'s annotations.
    pub(super) fn take_seed(&self, spec: &mut oci_spec::runtime::Spec) -> Option<SeedTicket> {
        let seeds = self.options.shim_seeds.as_ref()?;
        let group = seeds.take()?;
        let mut annotations = spec.annotations().clone().unwrap_or_default();
        annotations.insert(super::shim_group::GROUP_ANNOTATION.to_string(), group.clone());
        spec.set_annotations(Some(annotations));
        Some(SeedTicket {
            seeds: seeds.clone(),
            engine: self.clone(),
            group,
            sent: false,
        })
    }

    /// Fill the stock up to its size in the background, a seed at a time, each once the
    /// server has been quiet for `QUIET`. No-op when a refill is already running.
    pub fn refill_seeds(&self, seeds: Arc<ShimSeeds>) {
        if !seeds.begin_refill() {
            return;
        }
        let engine = self.clone();
        tokio::spawn(async move {
            loop {
                match seeds.next_step(Instant::now()) {
                    Step::Stop => return,
                    Step::Wait(wait) => tokio::time::sleep(wait).await,
                    Step::Retire(id) => {
                        engine.retire_seed(&id).await;
                    }
                    Step::Make => match tokio::time::timeout(MAKE_LIMIT, engine.make_seed())
                        .await
                        .unwrap_or_else(|_| Err(format!("no task within {MAKE_LIMIT:?}")))
                    {
                        Ok(id) => {
                            crate::metrics::increment(SEEDS_TOTAL, &[("result", "made")]);
                            if let Some(id) = seeds.made(id) {
                                engine.retire_seed(&id).await;
                            }
                        }
                        Err(e) => {
                            crate::metrics::increment(SEEDS_TOTAL, &[("result", "failed")]);
                            tracing::warn!(error = %e, "could not start a warm shim (retrying in 30 s)");
                            seeds.failed();
                        }
                    },
                }
            }
        });
    }

    /// The server stops: its seeds are deleted, and the refill's own step (a seed being made
    /// or deleted) is waited for. The caller bounds it: what is left then is gc's.
    pub async fn drain_seeds(&self, seeds: &ShimSeeds) {
        let ids = seeds.close();
        futures::future::join_all(ids.iter().map(|id| self.retire_seed(id))).await;
        while seeds.stock.lock().expect("shim seeds").working {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The directory a seed's root is (made once per state dir; its content never changes).
    fn seed_root(&self) -> PathBuf {
        self.state_dir().join("shim-seed")
    }

    /// A seed: its container record and its created task (its shim and `runc init`).
    async fn make_seed(&self) -> Result<String, String> {
        let root = self.seed_root();
        let made = {
            let root = root.clone();
            tokio::task::spawn_blocking(move || prepare_root(&root)).await
        };
        made.map_err(|e| e.to_string())?
            .map_err(|e| format!("preparing {}: {e}", root.display()))?;
        let id = format!("shim-seed-{}", crate::owner::unique_tag());
        let spec = seed_spec(&root, &self.cgroup_path(&id));
        let labels = HashMap::from([
            (LABEL_MANAGED.to_string(), "true".to_string()),
            (LABEL_OWNER.to_string(), owner_id()),
            (LABEL_KIND.to_string(), KIND_SHIM_SEED.to_string()),
            (LABEL_STATE_DIR.to_string(), self.state_dir().display().to_string()),
        ]);
        let t0 = Instant::now();
        self.client
            .container_create_bare(&id, spec.to_string().into_bytes(), labels)
            .await
            .map_err(|e| e.to_string())?;
        if let Err(e) = self.client.task_create(&id, Vec::new(), &Stdio::default()).await {
            self.retire_seed(&id).await;
            return Err(e.to_string());
        }
        tracing::debug!(seed = id, ms = t0.elapsed().as_secs_f64() * 1e3, "warm shim started");
        Ok(id)
    }

    /// Delete a seed: its waiting init killed, its task and its record deleted. (A delete of
    /// the created task would have runc kill it and sleep 100 ms before it looks again, with
    /// the shim's lock held.) Bounded; what does not go is left to gc, with a warning.
    pub(super) async fn retire_seed(&self, id: &str) -> bool {
        let client = self.client.clone();
        let gone = tokio::time::timeout(RETIRE_LIMIT, async {
            if client.task_get(id).await?.is_some() {
                // Waiting on the exit first, so the kill's exit is not missed.
                let waiter = {
                    let (client, id) = (client.clone(), id.to_string());
                    tokio::spawn(async move { client.task_wait(&id, "").await })
                };
                client.task_kill(id, "", libc::SIGKILL as u32, false).await?;
                let _ = tokio::time::timeout(Duration::from_secs(5), waiter).await;
                client.task_delete(id).await?;
            }
            client.container_delete(id).await
        })
        .await;
        match gone {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                tracing::warn!(seed = id, error = %e, "could not delete a warm shim's seed (gc will)");
                false
            }
            Err(_) => {
                tracing::warn!(seed = id, "deleting a warm shim's seed timed out (gc will)");
                false
            }
        }
    }
}

/// The seed's root: a directory with the mount points runc needs and the one empty file.
fn prepare_root(root: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let file = root.join(SEED_FILE);
    if file.exists() {
        return Ok(());
    }
    for dir in ["proc", "dev"] {
        std::fs::create_dir_all(root.join(dir))?;
    }
    let staged = root.join(format!(".{SEED_FILE}.{}", std::process::id()));
    std::fs::write(&staged, b"")?;
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o555))?;
    std::fs::rename(&staged, &file)
}

/// A seed's OCI spec: no user code ever runs in it (see the module's comment).
fn seed_spec(root: &Path, cgroup: &str) -> serde_json::Value {
    serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 65534, "gid": 65534},
            "args": [format!("/{SEED_FILE}")],
            "env": [],
            "cwd": "/",
            "capabilities": {"bounding": [], "effective": [], "permitted": [], "inheritable": [], "ambient": []},
            "noNewPrivileges": true
        },
        "root": {"path": root, "readonly": true},
        "hostname": "shim-seed",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "noexec", "mode=755", "size=64k"]}
        ],
        "linux": {
            "cgroupsPath": cgroup,
            "resources": {
                "devices": [{"allow": false, "access": "rwm"}],
                "memory": {"limit": 128u64 << 20},
                "pids": {"limit": 64}
            },
            "namespaces": [
                {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "cgroup"}
            ],
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/sys/firmware"],
            "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger", "/proc/bus", "/proc/fs", "/proc/irq"]
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_is_off_and_the_size_is_bounded() {
        assert!(ShimSeeds::new(0).is_none());
        assert_eq!(ShimSeeds::new(1000).expect("on").target, MAX_SEEDS);
    }

    #[test]
    fn a_refill_waits_for_a_quiet_moment_after_the_last_cold_create() {
        let seeds = ShimSeeds::new(2).expect("on");
        assert!(seeds.begin_refill());
        assert!(!seeds.begin_refill(), "one refill at a time");
        assert_eq!(
            seeds.next_step(Instant::now()),
            Step::Make,
            "no demand yet: make one now"
        );
        assert_eq!(seeds.take(), None, "none ready");
        let Step::Wait(wait) = seeds.next_step(Instant::now()) else {
            panic!("a create just asked: wait")
        };
        assert!(wait > QUIET / 2 && wait <= QUIET, "{wait:?}");
        assert_eq!(seeds.next_step(Instant::now() + QUIET), Step::Make);
    }

    #[test]
    fn a_full_stock_ends_the_refill_and_a_spent_seed_goes_first_when_quiet() {
        let seeds = ShimSeeds::new(2).expect("on");
        assert!(seeds.begin_refill());
        assert_eq!(seeds.made("a".into()), None);
        assert_eq!(seeds.made("b".into()), None);
        assert_eq!(seeds.next_step(Instant::now()), Step::Stop);
        assert!(!seeds.begin_refill(), "full: nothing to do");
        assert_eq!(seeds.take().as_deref(), Some("b"), "the newest first");
        assert_eq!(seeds.ready(), 1);
        seeds.stock.lock().expect("lock").spent.push("b".into());
        assert!(seeds.begin_refill(), "the flag went down with the full stock");
        assert!(
            matches!(seeds.next_step(Instant::now()), Step::Wait(_)),
            "not beside the create"
        );
        let later = Instant::now() + QUIET;
        assert_eq!(seeds.next_step(later), Step::Retire("b".into()));
        assert_eq!(seeds.next_step(later), Step::Make);
        assert_eq!(seeds.made("c".into()), None);
        assert_eq!(seeds.next_step(later), Step::Stop);
    }

    #[test]
    fn a_seed_whose_create_sent_its_task_is_never_handed_out_again() {
        let seeds = ShimSeeds::new(2).expect("on");
        assert_eq!(seeds.made("a".into()), None);
        assert_eq!(seeds.made("b".into()), None);
        // A create that failed before its Tasks.Create gives its seed back...
        let b = seeds.take().expect("ready");
        assert_eq!(seeds.settle(&b, false), Settled::Stocked);
        assert_eq!(seeds.ready(), 2);
        // ...one that sent it (finished, failed or dropped midway) spends it.
        let b = seeds.take().expect("ready");
        let later = Instant::now() + QUIET / 2;
        assert_eq!(seeds.settle(&b, true), Settled::Spent);
        assert_eq!(seeds.take().as_deref(), Some("a"), "b is not handed out again");
        assert_eq!(seeds.take(), None);
        assert!(seeds.begin_refill());
        let Step::Wait(_) = seeds.next_step(later) else {
            panic!("the quiet moment counts from the spend too")
        };
        assert_eq!(seeds.next_step(Instant::now() + QUIET), Step::Retire(b));
        // At a stop a returning seed is deleted, never stocked.
        seeds.close();
        assert_eq!(seeds.settle("a", false), Settled::Closed);
        assert_eq!(seeds.settle("c", true), Settled::Closed);
        assert_eq!(seeds.ready(), 0);
    }

    #[test]
    fn a_failure_backs_off_and_a_closed_stock_hands_out_nothing() {
        let seeds = ShimSeeds::new(1).expect("on");
        assert!(seeds.begin_refill());
        seeds.failed();
        let Step::Wait(wait) = seeds.next_step(Instant::now()) else {
            panic!("backing off")
        };
        assert!(wait > BACKOFF - Duration::from_secs(1), "{wait:?}");
        seeds.stock.lock().expect("lock").backoff_until = None;
        assert_eq!(seeds.made("a".into()), None);
        seeds.stock.lock().expect("lock").spent.push("s".into());
        assert_eq!(
            seeds.close(),
            vec!["a".to_string(), "s".to_string()],
            "ready and spent go"
        );
        assert_eq!(seeds.take(), None);
        assert_eq!(
            seeds.made("b".into()).as_deref(),
            Some("b"),
            "made after the close: deleted"
        );
        assert_eq!(seeds.next_step(Instant::now()), Step::Stop);
        assert!(!seeds.begin_refill());
    }

    #[test]
    fn the_seed_root_holds_the_command_runc_checks() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("seed-root");
        prepare_root(&root).expect("made");
        prepare_root(&root).expect("made again: nothing to do");
        let meta = std::fs::metadata(root.join(SEED_FILE)).expect("the file");
        assert_eq!(meta.len(), 0);
        assert_eq!(meta.permissions().mode() & 0o777, 0o555);
        assert!(root.join("proc").is_dir() && root.join("dev").is_dir());
        let spec = seed_spec(&root, "/runner/ns/shim-seed-x");
        assert_eq!(spec["process"]["args"][0], "/seed");
        assert_eq!(spec["root"]["readonly"], true);
        assert_eq!(spec["process"]["user"]["uid"], 65534);
        assert!(spec["linux"]["namespaces"].as_array().expect("list").len() >= 5);
    }
}
