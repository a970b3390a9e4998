//! Reconciliation: what runner processes that are gone left behind. Jobs whose supervisor
//! died get a new one (adoption); what no live runner owns is reclaimed — by the backend
//! (`Engine::reclaim`, told which jobs and pools this state dir keeps), plus the session
//! servers' scratch workspaces and an unused bridge network here. `runner gc`, every
//! `apply` at start and `serve` call it.

use std::collections::HashSet;
use std::process::Stdio;

use super::{Context, ServiceError, pools};
use crate::job::store::SharedStore;
use crate::owner::{owner_alive, owner_id, process_start_time};
use crate::runtime::containerd::reclaim::Keep;

/// The prefix of a record's owner while a process claims the job to re-adopt it.
pub(super) const ADOPTING: &str = "adopting:";

/// What a collection removed, and what it kept for re-adoption.
#[derive(Debug, Default, serde::Serialize)]
pub struct GcReport {
    pub containers: Vec<String>,
    pub snapshots: Vec<String>,
    pub leases: Vec<String>,
    pub run_dirs: Vec<String>,
    /// Job attempts whose runner died, kept: their job's store re-adopts them.
    pub kept: Vec<String>,
    /// Jobs of this store given a new supervisor.
    pub adopted: Vec<String>,
    /// Cgroup directories (per hierarchy) of containers that are gone, and their parent.
    pub cgroups: Vec<String>,
    /// User-namespace ranges (host base ids) given back: their containers are gone.
    pub userns_ranges: Vec<String>,
    /// Whether the bridge network (unused) was taken down.
    pub network_removed: bool,
    /// Scratch workspaces of session servers that are gone.
    pub scratch_dirs: Vec<String>,
    /// Warm shims' seeds of session servers that are gone.
    pub warm_shims: Vec<String>,
}

impl GcReport {
    fn total(&self) -> usize {
        self.containers.len()
            + self.snapshots.len()
            + self.leases.len()
            + self.run_dirs.len()
            + self.cgroups.len()
            + self.userns_ranges.len()
            + self.scratch_dirs.len()
            + self.warm_shims.len()
    }
}

/// Start-up reconciliation: collect without cgroups, logging what happened. One at a time
/// per state dir: when another process is reconciling it now, this one does not (that one
/// started before this process and sees what any runner process that died before it left;
/// what dies later is left for the next). A burst of N applies so lists containerd's
/// containers, snapshots and leases once, not N times beside their jobs.
pub async fn reconcile(ctx: &Context) {
    let _turn = match reconcile_turn(&ctx.config.state_dir) {
        Ok(Some(turn)) => turn,
        Ok(None) => {
            tracing::debug!("another runner process is reconciling this state dir");
            return;
        }
        Err(e) => {
            tracing::warn!(error = %e, "start-up reconciliation failed");
            return;
        }
    };
    match collect(ctx, false).await {
        Ok(report) if report.total() > 0 || !report.adopted.is_empty() => {
            tracing::info!(?report, "reconciled what dead runner processes left")
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "start-up reconciliation failed"),
    }
}

/// The state dir's reconciliation lock, when no other process holds it (never waits). A
/// server's first start finds no state dir yet (its store is made later, beside this task):
/// the dir is made here, or that start would skip reconciling what an earlier state dir of
/// the same path left in containerd.
fn reconcile_turn(state_dir: &std::path::Path) -> std::io::Result<Option<nix::fcntl::Flock<std::fs::File>>> {
    std::fs::create_dir_all(state_dir)?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(state_dir.join("reconcile.lock"))?;
    match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(held) => Ok(Some(held)),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
        Err((_, e)) => Err(e.into()),
    }
}

/// Reclaim what dead runner processes left (see `Engine::reclaim`), keeping this store's
/// unfinished jobs' attempts (and giving those jobs a new supervisor) and its pools' current
/// members. With `cgroups` (an explicit `runner gc`), also runc's leftover cgroups and the
/// bridge network when no container is on it.
pub async fn collect(ctx: &Context, cgroups: bool) -> Result<GcReport, ServiceError> {
    let engine = ctx.engine(ctx.runtime_options()).await?;
    let keep = Keep {
        adoptable: adoptable(ctx).await?,
        pool_keys: {
            let ctx = ctx.clone();
            Context::blocking(move || pools::defs(&ctx))
                .await?
                .into_iter()
                .map(|def| (def.name, def.key))
                .collect()
        },
        cgroups,
        retired: cgroups,
    };
    let reclaimed = engine.reclaim(&keep).await?;
    let mut report = GcReport {
        containers: reclaimed.containers,
        snapshots: reclaimed.snapshots,
        leases: reclaimed.leases,
        run_dirs: reclaimed.run_dirs,
        kept: reclaimed.kept,
        cgroups: reclaimed.cgroups,
        userns_ranges: reclaimed.userns_ranges,
        warm_shims: reclaimed.warm_shims,
        ..GcReport::default()
    };
    // Orphaned attempts of this store get a supervisor that re-adopts them (their result is
    // recorded, their containers removed when they end).
    for job in reclaimed.orphaned_jobs {
        if adopt_if_orphaned(ctx, &job).await? {
            report.adopted.push(job);
        }
    }
    report.scratch_dirs = Context::blocking(|| Ok(remove_scratch_dirs(&std::env::temp_dir()))).await?;
    if cgroups {
        // The bridge network, when no container on the host is on it any more (only an
        // explicit gc: the start-up one would take it down under the attach that follows).
        let network = crate::net::Host::new(ctx.config.net.clone());
        report.network_removed = Context::blocking(move || {
            Ok(network.remove_if_unused().unwrap_or_else(|err| {
                tracing::warn!(error = %err, "gc could not take the unused bridge network down");
                false
            }))
        })
        .await?;
    }
    Ok(report)
}

/// Scratch workspaces (`runner-session-*` in the temp directory) whose server is gone: their
/// sessions' sandboxes went with it.
fn remove_scratch_dirs(tmp: &std::path::Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if !crate::service::sessions::scratch_abandoned(&name) {
            continue;
        }
        match crate::confined::remove_tree(&e.path()) {
            Ok(()) => removed.push(name),
            Err(err) => {
                tracing::warn!(dir = %e.path().display(), error = %err, "gc could not remove a scratch workspace")
            }
        }
    }
    removed
}

/// The jobs of this store that are not finished and not being deleted, by name (gc).
async fn adoptable(ctx: &Context) -> Result<HashSet<String>, ServiceError> {
    let records = ctx.store().await?.call(|s| s.list()).await?;
    Ok(records
        .into_iter()
        .filter(|r| !r.status.is_terminal() && !r.delete_requested)
        .map(|r| r.metadata.name)
        .collect())
}

/// Give a job whose supervisor is gone a new one, which re-adopts its running containers.
/// Several processes may race: the store transaction that claims the job lets one of them
/// spawn. Whether this call adopted it.
pub async fn adopt_if_orphaned(ctx: &Context, name: &str) -> Result<bool, ServiceError> {
    let store = ctx.store().await?;
    let claim = format!("{ADOPTING}{}", owner_id());
    let claimed = {
        let (name, claim) = (name.to_string(), claim.clone());
        store
            .call(move |s| {
                let record = s.require(&name)?;
                let orphaned = !record.status.is_terminal()
                    && !record.delete_requested
                    && record.owner.as_deref().is_some_and(|o| !owner_alive(o));
                if !orphaned {
                    return Ok(false);
                }
                let updated = s.update(&name, |r| {
                    if r.owner == record.owner {
                        r.owner = Some(claim.clone());
                    }
                })?;
                Ok(updated.owner.as_deref() == Some(claim.as_str()))
            })
            .await?
    };
    if claimed {
        tracing::warn!("job {name:?} lost its supervisor; re-adopting it");
        spawn_supervisor(ctx, &store, name, true).await?;
    }
    Ok(claimed)
}

/// Give every job of this store whose supervisor died a new one (a long-lived server calls
/// this now and then; reads never do). The jobs adopted.
pub async fn adopt_orphans(ctx: &Context) -> Result<Vec<String>, ServiceError> {
    let mut adopted = Vec::new();
    for name in adoptable(ctx).await? {
        if adopt_if_orphaned(ctx, &name).await? {
            adopted.push(name);
        }
    }
    Ok(adopted)
}

/// Start `runner supervise NAME` detached (its own session, output to the job's log dir) and
/// record it as the job's owner at once: until it runs, the job would look unsupervised.
pub(super) async fn spawn_supervisor(
    ctx: &Context,
    store: &SharedStore,
    name: &str,
    adopt: bool,
) -> Result<(), ServiceError> {
    let config = ctx.config.clone();
    let job = name.to_string();
    let pid = Context::blocking(move || {
        let exe = config
            .runner_exe()
            .map_err(|e| ServiceError::internal("finding the runner binary", e))?;
        let dir = config.logs_dir().join(&job);
        std::fs::create_dir_all(&dir).map_err(|e| ServiceError::internal("creating the log directory", e))?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("supervisor.log"))
            .map_err(|e| ServiceError::internal("creating the supervisor log", e))?;
        let log2 = log
            .try_clone()
            .map_err(|e| ServiceError::internal("creating the supervisor log", e))?;
        let mut cmd = std::process::Command::new(exe);
        cmd.arg("supervise")
            .arg(&job)
            .arg("--state-dir")
            .arg(&config.state_dir)
            .arg("--namespace")
            .arg(&config.namespace)
            .arg("--log")
            .arg(&config.log)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        if let Some(address) = &config.address {
            cmd.arg("--address").arg(address);
        }
        if let Some(exe) = &config.runner_exe {
            cmd.arg("--runner-exe").arg(exe);
        }
        if adopt {
            cmd.arg("--adopt");
        }
        cmd.args(config.inherited_args());
        // Reaped by this process when it lives on: a zombie would look like a live
        // supervisor (same PID and start time), so its job would never be re-adopted.
        super::spawn_detached(cmd, "supervisor")
    })
    .await?;
    if let Some(start) = process_start_time(pid) {
        let owner = format!("{pid}:{start}");
        let name = name.to_string();
        store
            .call(move |s| {
                s.update(&name, |r| {
                    if r.owner.as_deref().is_none_or(|o| o.starts_with(ADOPTING)) {
                        r.owner = Some(owner);
                    }
                })
            })
            .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server's first start finds no state dir: it still takes its turn to reconcile (the
    /// lock's open failed with ENOENT, and the start-up reconciliation was skipped), and a
    /// second process of the state dir then does not.
    #[test]
    fn the_first_start_of_a_state_dir_reconciles() {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("new").join("state");
        let turn = reconcile_turn(&state).expect("no state dir yet");
        assert!(turn.is_some());
        assert!(
            reconcile_turn(&state).unwrap().is_none(),
            "a second turn while the first is held"
        );
    }

    #[test]
    fn one_process_reconciles_a_state_dir_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let first = reconcile_turn(dir.path()).unwrap();
        assert!(first.is_some());
        // Another open file of the same lock (another process's, as far as flock goes).
        assert!(reconcile_turn(dir.path()).unwrap().is_none());
        drop(first);
        assert!(reconcile_turn(dir.path()).unwrap().is_some());
    }
}
