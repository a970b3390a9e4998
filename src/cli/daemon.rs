//! `runner daemon start|stop|status` and `runner gc`.

use super::DaemonVerb;
use super::output::outln;
use crate::config::Config;
use crate::service::{Context, ServiceError, daemon, gc};

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
                outln!("stopped");
                Ok(1)
            }
        },
    }
}

pub async fn gc(ctx: &Context) -> Result<i32, ServiceError> {
    let report = gc::collect(ctx, true).await?;
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
    for c in &report.kept {
        outln!("kept container/{c}: a job attempt whose runner died, re-adopted by its job's store");
    }
    for j in &report.adopted {
        outln!("job/{j}: its supervisor died; a new one re-adopts it");
    }
    Ok(0)
}
