//! `runner daemon start|stop|status` and `runner gc`.

use super::output::{outln, print_value};
use super::{DaemonVerb, OutputFormat};
use crate::config::Config;
use crate::service::{Context, ServiceError, daemon, reconcile};

pub async fn run(config: &Config, verb: DaemonVerb) -> Result<i32, ServiceError> {
    match verb {
        DaemonVerb::Start => {
            let started = daemon::start(config).await?;
            outln!(
                "containerd running (pid {}) at {}",
                started.pid,
                started.socket.display()
            );
            Ok(0)
        }
        DaemonVerb::Stop => {
            match daemon::stop(config).await? {
                Some(pid) => outln!("stopped containerd (pid {pid})"),
                None => outln!("no private containerd was running"),
            }
            Ok(0)
        }
        DaemonVerb::Status => match daemon::status(config) {
            Some(started) => {
                outln!("running (pid {}) at {}", started.pid, started.socket.display());
                Ok(0)
            }
            None => {
                match daemon::died(config) {
                    // Said apart from a stop: a `runner serve` using it starts it again, a
                    // CLI at its next apply, and its log may say why it died.
                    Some((pid, log)) => outln!(
                        "stopped: pid {pid} died without `runner daemon stop` (see {})",
                        log.display()
                    ),
                    None => outln!("stopped"),
                }
                Ok(1)
            }
        },
    }
}

pub async fn gc(ctx: &Context) -> Result<i32, ServiceError> {
    let report = reconcile::collect(ctx, true).await?;
    outln!(
        "removed {} containers, {} snapshots, {} leases, {} run directories, {} cgroups, {} user-namespace ranges",
        report.containers.len(),
        report.snapshots.len(),
        report.leases.len(),
        report.run_dirs.len(),
        report.cgroups.len(),
        report.userns_ranges.len()
    );
    for c in &report.containers {
        outln!("container/{c}");
    }
    if report.network_removed {
        outln!("network/runner: no container on it; its bridge, rules and resolver are gone");
    }
    for c in &report.warm_shims {
        outln!("warm-shim/{c}: the seed of a server that died, deleted");
    }
    for c in &report.kept {
        outln!("kept container/{c}: a job attempt whose runner died, re-adopted by its job's store");
    }
    for j in &report.adopted {
        outln!("job/{j}: its supervisor died; a new one re-adopts it");
    }
    let snapshots = crate::service::snapshots::collect(ctx).await?;
    outln!(
        "snapshots: {} kept ({} MiB on disk; runner snapshot ls, runner snapshot rm NAME), {} superseded setup snapshots removed",
        snapshots.kept,
        snapshots.kept_disk_bytes >> 20,
        snapshots.removed.len()
    );
    for s in &snapshots.removed {
        outln!("snapshot/{} ({})", s.name, s.source);
    }
    let state_dir = ctx.config.state_dir.clone();
    let checkpoints = tokio::task::spawn_blocking(move || crate::service::sessions::collect_checkpoints(&state_dir))
        .await
        .map_err(|e| ServiceError::internal("counting checkpoints", e))?;
    outln!(
        "checkpoints: {} kept ({} MiB on disk; GET /v1/checkpoints, DELETE /v1/checkpoints/NAME), {} partial ones of dead runners removed",
        checkpoints.kept,
        checkpoints.kept_bytes >> 20,
        checkpoints.removed.len()
    );
    Ok(0)
}

/// `runner version`: this binary (version, commit, target) and the containerd it would use
/// (its version and revision), without starting a private one to ask.
pub async fn version(config: &Config, output: Option<OutputFormat>) -> Result<i32, ServiceError> {
    let ctx = Context::new(config.clone(), crate::service::Connect::Existing)?;
    let server = ctx.containerd_version().await;
    let value = serde_json::json!({
        "runner": {
            "version": env!("CARGO_PKG_VERSION"),
            "commit": env!("RUNNER_COMMIT"),
            "target": format!("{}-{}", std::env::consts::ARCH, std::env::consts::OS),
        },
        "containerd": match &server {
            Ok(v) => serde_json::json!({"version": v.version, "revision": v.revision, "address": v.address}),
            Err(e) => serde_json::json!({"error": e.to_string()}),
        },
    });
    match output {
        Some(OutputFormat::Json) | Some(OutputFormat::Yaml) => print_value(&value, output)?,
        _ => {
            outln!(
                "runner {} (commit {}, {}-{})",
                env!("CARGO_PKG_VERSION"),
                env!("RUNNER_COMMIT"),
                std::env::consts::ARCH,
                std::env::consts::OS
            );
            match &server {
                Ok(v) => outln!(
                    "containerd {} (revision {}) at {}",
                    v.version,
                    v.revision,
                    v.address.display()
                ),
                Err(e) => outln!("containerd: not reachable: {e}"),
            }
        }
    }
    Ok(0)
}
