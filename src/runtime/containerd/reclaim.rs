//! Reclaiming what runner processes that are gone left in this containerd and on the host:
//! containers, snapshots, leases, run and rootfs directories, late binds, user-namespace
//! ranges, cgroups. The service says what to keep (`Keep`: the jobs its store re-adopts, its
//! pools' current keys); everything else the backend judges from labels and owner marks.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::pool::{CLAIMED_PREFIX, KIND_POOL, KIND_RETIRED, LABEL_POOL, LABEL_POOL_KEY};
use super::{Engine, LABEL_ATTEMPT, LABEL_JOB, LABEL_KIND, LABEL_MANAGED, LABEL_OWNER, LABEL_STATE_DIR, RUN_DIR_OWNER};
use crate::owner::owner_alive;
use crate::runtime::RuntimeError;
use crate::runtime::idmap::Leases;

/// A run directory without an owner mark (made by an older runner) counts as abandoned after this.
const UNMARKED_RUN_DIR_AGE: Duration = Duration::from_secs(600);

use crate::config::STORE_FILE;

/// What the caller keeps: decisions only the service can make.
#[derive(Debug, Default)]
pub struct Keep {
    /// Jobs of this state dir's store that are not finished: their attempts whose runner
    /// died are kept (and named in `Reclaimed::orphaned_jobs`) for re-adoption.
    pub adoptable: HashSet<String>,
    /// This state dir's pools by name, with their current key: a member of an older key, or
    /// of a pool that is gone, is reclaimed.
    pub pool_keys: HashMap<String, String>,
    /// Also the cgroups runc left (only an explicit `runner gc`: the start-up reconciliation
    /// runs beside containers being started).
    pub cgroups: bool,
    /// Also the used members of this state dir's pools. Their pool's filler removes them
    /// (every retirement starts or queues one), once the pool's claims pause; the start-up
    /// reconciliation of each CLI process in a burst would tear them down beside the jobs.
    pub retired: bool,
}

/// What a reclaim removed, and what it kept.
#[derive(Debug, Default)]
pub struct Reclaimed {
    pub containers: Vec<String>,
    pub snapshots: Vec<String>,
    pub leases: Vec<String>,
    pub run_dirs: Vec<String>,
    /// Job attempts whose runner died, kept: their job's store re-adopts them.
    pub kept: Vec<String>,
    /// The jobs of `Keep::adoptable` those kept attempts belong to.
    pub orphaned_jobs: BTreeSet<String>,
    pub cgroups: Vec<String>,
    pub userns_ranges: Vec<String>,
    /// Warm shims' seeds of servers that died (`shim_seed`): no sandbox's, so not counted
    /// with the containers.
    pub warm_shims: Vec<String>,
}

impl Engine {
    /// Remove every container, snapshot and lease labelled as runner's whose owning runner
    /// process is gone, and run directories of containers that no longer exist — except Job
    /// attempts, which outlive their runner on purpose: this store re-adopts its own (`keep`),
    /// other stores' are theirs to judge unless that store is gone.
    pub async fn reclaim(&self, keep: &Keep) -> Result<Reclaimed, RuntimeError> {
        let engine = self;
        let client = &self.client;
        let managed = format!("labels.\"{LABEL_MANAGED}\"==true");
        let dead = |labels: &HashMap<String, String>| labels.get(LABEL_OWNER).is_none_or(|o| !owner_alive(o));
        let ours = self.state_dir();
        let mut report = Reclaimed::default();
        for c in client.containers(vec![managed.clone()]).await? {
            let kind = c.labels.get(LABEL_KIND).map(String::as_str);
            if kind == Some(KIND_POOL) || kind == Some(KIND_RETIRED) {
                // Another state dir's members hold late binds under that dir: its runners (or a
                // gc there) remove them, unless that dir is gone.
                let theirs = c.labels.get(LABEL_STATE_DIR).map(PathBuf::from).filter(|d| *d != ours);
                if theirs.as_ref().is_some_and(|d| d.exists()) {
                    continue;
                }
                let filler_removes =
                    || theirs.is_none() && c.labels.get(LABEL_POOL).is_some_and(|p| keep.pool_keys.contains_key(p));
                if kind == Some(KIND_RETIRED) && !keep.retired && filler_removes() {
                    continue;
                }
                let removed = if kind == Some(KIND_RETIRED) {
                    engine.teardown(&c.id).await.map(|()| true)
                } else if self.member_kept(keep, &c.id, &c.labels, &ours) {
                    continue;
                } else if engine.member_ready(&c.id) {
                    // Claimed first, so a claimant racing this sees it gone, never killed under it.
                    engine.retire_member(&c.id).await
                } else {
                    engine.teardown(&c.id).await.map(|()| true)
                };
                match removed {
                    Ok(true) => report.containers.push(c.id),
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(container = c.id, error = %e, "gc could not remove a pool member completely")
                    }
                }
                continue;
            }
            if !dead(&c.labels) {
                continue;
            }
            if kind == Some(super::shim_seed::KIND_SHIM_SEED) {
                // A dead server's warm shim: its seed holds no sandbox, nothing to keep. Its
                // own state dir's gc (a server's start runs one) removes it, or any once
                // that dir is gone.
                let theirs = c.labels.get(LABEL_STATE_DIR).map(PathBuf::from).filter(|d| *d != ours);
                if theirs.is_none_or(|d| !d.exists()) && engine.retire_seed(&c.id).await {
                    report.warm_shims.push(c.id);
                }
                continue;
            }
            if c.labels.contains_key(LABEL_ATTEMPT) {
                let kept = match c.labels.get(LABEL_STATE_DIR).map(PathBuf::from) {
                    Some(dir) if dir != ours => dir.join(STORE_FILE).exists(),
                    Some(_) => match c.labels.get(LABEL_JOB) {
                        Some(job) if keep.adoptable.contains(job) => {
                            report.orphaned_jobs.insert(job.clone());
                            true
                        }
                        _ => false,
                    },
                    None => false,
                };
                if kept {
                    report.kept.push(c.id.clone());
                    continue;
                }
            }
            if let Err(e) = engine.teardown(&c.id).await {
                tracing::warn!(container = c.id, error = %e, "gc could not remove a container completely");
            }
            report.containers.push(c.id);
        }
        let live: HashSet<String> = client
            .containers(vec![managed.clone()])
            .await?
            .into_iter()
            .map(|c| c.id)
            .collect();
        for s in client.snapshots(vec![managed.clone()]).await? {
            if !live.contains(&s.name) && dead(&s.labels) {
                client.snapshot_remove(&s.name).await?;
                report.snapshots.push(s.name);
            }
        }
        for l in client.leases(vec![managed.clone()]).await? {
            if dead(&l.labels) {
                client.lease_delete(&l.id).await?;
                report.leases.push(l.id);
            }
        }
        report.run_dirs = {
            let run_dir = self.run_dir.clone();
            let late_dir = engine.late_dir("x").parent().map(std::path::Path::to_path_buf);
            // Owners first, containers after: a directory whose maker was already gone cannot get
            // a container later (a pool filler exits right after making its member, which the
            // first listing may have missed).
            let ownerless = {
                let (run_dir, late_dir) = (run_dir.clone(), late_dir.clone());
                blocking(move || ownerless_dirs(&run_dir, late_dir.as_deref())).await?
            };
            let live: HashSet<String> = client
                .containers(vec![managed.clone()])
                .await?
                .into_iter()
                .map(|c| c.id)
                .collect();
            let (leases, ours, containerd) = (engine.leases.clone(), ours.clone(), engine.containerd_name());
            let roots = engine.roots_dir();
            let network = crate::net::Host::new(self.options.net.clone());
            // What this run removed is gone for good: its directories go now, whatever their age.
            let gone: HashSet<String> = report.containers.iter().cloned().collect();
            let (removed, ranges) = blocking(move || {
                let mut removed = release_late_dirs(late_dir.as_deref(), &run_dir, &live, &ownerless);
                removed.extend(remove_run_dirs(&run_dir, &live, &ownerless));
                prune_ready_index(&run_dir);
                removed.extend(remove_orphan_layer_files(&run_dir));
                removed.extend(remove_root_dirs(&network, &roots, &live, &gone));
                (removed, release_ranges(&leases, &containerd, &ours, &run_dir, &live))
            })
            .await?;
            report.userns_ranges = ranges;
            removed
        };
        if keep.cgroups {
            // The listing is taken right before the removal: a container created after it
            // reaches runc's mkdir only after its shim starts (tens of ms later), so no cgroup
            // of a starting container is removed under it.
            let existing: HashSet<String> = client.containers(Vec::new()).await?.into_iter().map(|c| c.id).collect();
            report.cgroups = crate::runtime::cgroupfs::remove_stale(&engine.cgroup_parent(), &existing)
                .into_iter()
                .map(|p| p.display().to_string())
                .collect();
        }
        Ok(report)
    }

    /// Whether a pool member is kept: another state dir's while that state dir exists; ours
    /// while it can be claimed and its pool (with its key) exists, or while the runner process
    /// that claims or makes it lives.
    fn member_kept(&self, keep: &Keep, id: &str, labels: &HashMap<String, String>, ours: &Path) -> bool {
        match labels.get(LABEL_STATE_DIR).map(PathBuf::from) {
            Some(dir) if dir != ours => return dir.exists(),
            Some(_) => {}
            None => return false,
        }
        if self.member_ready(id) {
            let pool = labels.get(LABEL_POOL).map(String::as_str).unwrap_or_default();
            return keep
                .pool_keys
                .get(pool)
                .is_some_and(|key| labels.get(LABEL_POOL_KEY) == Some(key));
        }
        let run = self.run_dir.join(id);
        let claimant = std::fs::read_dir(&run).ok().and_then(|entries| {
            entries.flatten().find_map(|e| {
                e.file_name()
                    .to_str()
                    .and_then(|n| n.strip_prefix(CLAIMED_PREFIX))
                    .map(String::from)
            })
        });
        let holder = claimant.or_else(|| std::fs::read_to_string(run.join(RUN_DIR_OWNER)).ok());
        holder.is_some_and(|o| owner_alive(o.trim()))
    }
}

/// Filesystem work off the async threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, RuntimeError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| RuntimeError::Internal(format!("a reclaim task failed: {e}")))
}

/// Remove snapshot layer files (`snapshot-PID_START-*.tar` beside the run directories) whose
/// runner process is gone: it died while making the snapshot.
fn remove_orphan_layer_files(run_dir: &Path) -> Vec<String> {
    let Some(dir) = run_dir.parent() else { return Vec::new() };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name
            .strip_prefix(super::snapshot::LAYER_FILE_PREFIX)
            .filter(|_| name.ends_with(".tar"))
        else {
            continue;
        };
        // Files of an older runner carry no owner: left alone (they are rare and visible).
        let Some((owner, _)) = rest.split_once('-') else {
            continue;
        };
        if owner.contains('_') && !owner_alive(&owner.replacen('_', ":", 1)) {
            match std::fs::remove_file(e.path()) {
                Ok(()) => removed.push(name),
                Err(err) => tracing::warn!(file = name, error = %err, "gc could not remove a snapshot's layer file"),
            }
        }
    }
    removed
}

/// Drop the ready index's entries (see `Engine::ready_index`) of members whose run directory
/// is gone or no longer marked ready (claims drop the ones they meet; these are the rest),
/// and keys without entries.
fn prune_ready_index(run_dir: &Path) {
    let index = run_dir.with_file_name("ready");
    let Ok(keys) = std::fs::read_dir(&index) else { return };
    for key in keys.flatten() {
        if let Ok(entries) = std::fs::read_dir(key.path()) {
            for e in entries.flatten() {
                if !run_dir.join(e.file_name()).join(super::pool::READY_FILE).exists() {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        // Fails while it has entries, as it should.
        let _ = std::fs::remove_dir(key.path());
    }
}

/// Release the late binds of containers that are gone (a claimant died between its claim and
/// its teardown): unmounted before their run directories go, never emptied.
/// Names of run and late directories whose maker is gone (or unmarked and old).
fn ownerless_dirs(run_dir: &Path, late_dir: Option<&Path>) -> HashSet<String> {
    let names = |dir: Option<&Path>| -> Vec<String> {
        dir.and_then(|d| std::fs::read_dir(d).ok())
            .map(|entries| {
                entries
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().to_string())
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut all = names(Some(run_dir));
    all.extend(names(late_dir));
    all.into_iter()
        .filter(|name| {
            let dir = run_dir.join(name);
            match std::fs::read_to_string(dir.join(RUN_DIR_OWNER)) {
                Ok(owner) => !owner_alive(owner.trim()),
                Err(_) => std::fs::metadata(&dir)
                    .and_then(|m| m.modified())
                    .map_or(true, |t| t.elapsed().is_ok_and(|age| age > UNMARKED_RUN_DIR_AGE)),
            }
        })
        .collect()
}

fn release_late_dirs(
    late_dir: Option<&Path>,
    run_dir: &Path,
    live: &HashSet<String>,
    ownerless: &HashSet<String>,
) -> Vec<String> {
    let Some(entries) = late_dir.and_then(|d| std::fs::read_dir(d).ok()) else {
        return Vec::new();
    };
    let mut released = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if live.contains(&name) || name.starts_with(".stage-") || !ownerless.contains(&name) {
            continue;
        }
        let abandoned = std::fs::read_to_string(run_dir.join(&name).join(RUN_DIR_OWNER))
            .map(|o| !owner_alive(o.trim()))
            .unwrap_or(true);
        if abandoned {
            match crate::runtime::late::release(&e.path()) {
                Ok(()) => released.push(format!("late/{name}")),
                Err(err) => tracing::warn!(dir = %e.path().display(), error = %err, "gc could not release late binds"),
            }
        }
    }
    released
}

/// Remove the run directories of containers that do not exist and whose owner is gone: a
/// directory is filled before its container is created, so only an abandoned one is a
/// leftover.
fn remove_run_dirs(run_dir: &std::path::Path, live: &HashSet<String>, ownerless: &HashSet<String>) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(run_dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if live.contains(&name) || !ownerless.contains(&name) {
            continue;
        }
        let abandoned = match std::fs::read_to_string(e.path().join(RUN_DIR_OWNER)) {
            Ok(owner) => !owner_alive(owner.trim()),
            Err(_) => e
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > UNMARKED_RUN_DIR_AGE)),
        };
        // std's remove_dir_all does not follow symlinks (the agent directory in there was
        // writable by the sandbox).
        // Unmounted first (a remapped rootfs, a workspace view), never crossing a mount that
        // would not go: a removal must never reach into a workspace.
        if abandoned {
            match crate::runtime::late::release(&e.path()) {
                Ok(()) => removed.push(name),
                Err(err) => {
                    tracing::warn!(dir = %e.path().display(), error = %err, "gc could not remove a run directory")
                }
            }
        }
    }
    removed
}

/// Give back the user-namespace ranges of this state dir (or of a state dir that is gone)
/// whose container is gone, whose taker is gone, and whose run directory is removed (while
/// it stays, something of the container may still be mounted with the range's ids).
fn release_ranges(
    leases: &Leases,
    containerd: &str,
    ours: &Path,
    run_dir: &Path,
    live: &HashSet<String>,
) -> Vec<String> {
    let held = match leases.all() {
        Ok(h) => h,
        Err(e) => {
            tracing::warn!(error = %e, "gc could not list the user-namespace ranges");
            return Vec::new();
        }
    };
    let mut released = Vec::new();
    for lease in held {
        let theirs = Path::new(&lease.state_dir);
        // A lease of another containerd is judged by a gc that sees it, unless that
        // containerd and the state dir are both gone and no process runs with the range's
        // ids (a runner killed with a containerd of its own, as a test daemon).
        let orphaned = || {
            let socket = lease.containerd.rsplit_once('#').map(|(s, _)| s).unwrap_or("");
            !Path::new(socket).exists() && !theirs.exists() && !range_has_processes(lease.host_base)
        };
        if (lease.containerd != containerd && !orphaned())
            || (theirs != ours && theirs.exists())
            || live.contains(&lease.container)
            || owner_alive(&lease.owner)
            || run_dir.join(&lease.container).exists()
        {
            continue;
        }
        let range = crate::spec::IdRange {
            host_base: lease.host_base,
        };
        match leases.release(range, &lease.container) {
            Ok(()) => released.push(lease.host_base.to_string()),
            Err(e) => tracing::warn!(error = %e, "gc could not release a user-namespace range"),
        }
    }
    released
}

/// Whether any process of the host runs with a uid of the range starting at `base`.
fn range_has_processes(base: u32) -> bool {
    let end = u64::from(base) + crate::manifest::USERNS_IDS;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return true;
    };
    entries.flatten().any(|e| {
        let status = std::fs::read_to_string(e.path().join("status")).unwrap_or_default();
        status.lines().find(|l| l.starts_with("Uid:")).is_some_and(|l| {
            l.split_whitespace()
                .skip(1)
                .filter_map(|t| t.parse::<u64>().ok())
                .any(|uid| (u64::from(base)..end).contains(&uid))
        })
    })
}

/// Remove the rootfs directories (host-wide, per containerd) of containers that are gone,
/// a bridge container's network with it. One is made just before its container: only one
/// older than a create can take is a leftover, or one of a container this gc run removed
/// (`gone`).
fn remove_root_dirs(
    network: &crate::net::Host,
    roots: &Path,
    live: &HashSet<String>,
    gone: &HashSet<String>,
) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(roots) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > UNMARKED_RUN_DIR_AGE));
        if live.contains(&name) || !(old || gone.contains(&name)) {
            continue;
        }
        // Off the bridge network first (CNI DEL with the cached result): its veth, IPAM
        // lease, firewall rules and name go with it.
        let net = e.path().join(crate::net::NET_DIR);
        if net.exists()
            && let Err(err) = network.detach(&net)
        {
            tracing::warn!(dir = %net.display(), error = %err, "gc could not detach a container from the network");
            continue;
        }
        match crate::runtime::late::release(&e.path()) {
            Ok(()) => removed.push(format!("rootfs/{name}")),
            Err(err) => {
                tracing::warn!(dir = %e.path().display(), error = %err, "gc could not remove a rootfs directory")
            }
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_files_of_dead_runners_go_and_others_stay() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        std::fs::create_dir(&run).unwrap();
        let me = crate::owner::owner_id().replace(':', "_");
        let names = [
            "snapshot-1_1-dead.tar".to_string(),
            format!("snapshot-{me}-mine.tar"),
            "snapshot-old.tar".to_string(),
            "snapshot-1_1-other.txt".to_string(),
        ];
        for n in &names {
            std::fs::write(dir.path().join(n), b"x").unwrap();
        }
        assert_eq!(
            remove_orphan_layer_files(&run),
            vec!["snapshot-1_1-dead.tar".to_string()]
        );
        for n in &names[1..] {
            assert!(dir.path().join(n).exists(), "{n}");
        }
    }
}
