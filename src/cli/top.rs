//! `runner top` and the usage lines of `runner describe job`: what running containers use,
//! read from their cgroups (`service::usage`).

use std::time::Duration;

use super::args::OutputFormat;
use super::output::outln;
use crate::service::usage::{self, ContainerUsage};
use crate::service::{Context, ServiceError};

/// How far apart the two reads of `top` are (for the CPU rate).
const WINDOW: Duration = Duration::from_millis(500);

fn bytes(n: Option<u64>) -> String {
    n.map_or_else(|| "-".into(), |n| indicatif::HumanBytes(n).to_string())
}

fn pair(a: Option<u64>, b: Option<u64>) -> String {
    match (a, b) {
        (None, None) => "-".into(),
        _ => format!("{} / {}", bytes(a), bytes(b)),
    }
}

fn row(c: &ContainerUsage) -> String {
    let u = &c.usage;
    format!(
        "{:<24} {:<6} {:<8} {:>6} {:>9} {:>10} {:>10} {:>5} {:>21} {:>21}",
        if c.job.is_empty() { "-" } else { &c.job },
        c.index.map_or_else(|| "-".into(), |i| i.to_string()),
        if c.kind.is_empty() { "-" } else { &c.kind },
        c.cpu_cores.map_or_else(|| "-".into(), |r| format!("{:.0}%", r * 100.0)),
        format!("{:.2}s", u.cpu_seconds),
        bytes(u.memory_bytes),
        bytes(u.memory_peak_bytes),
        u.pids.map_or_else(|| "-".into(), |p| p.to_string()),
        pair(u.io_read_bytes, u.io_write_bytes),
        pair(u.net_rx_bytes, u.net_tx_bytes),
    )
}

const HEADER: &str = "JOB                      INDEX  KIND        CPU  CPU TIME     MEMORY       PEAK  PIDS        IO (READ/WRITE)          NET (RX/TX)";

/// `runner top [JOB]`: every running container of runner's namespace (jobs' attempts,
/// sessions' sandboxes, pool members), or one job's.
pub async fn top(ctx: &Context, job: Option<&str>, output: Option<OutputFormat>) -> Result<i32, ServiceError> {
    let rows = usage::running(ctx, job, Some(WINDOW)).await?;
    match output {
        Some(OutputFormat::Json) => outln!("{}", serde_json::to_string_pretty(&rows).unwrap_or_default()),
        Some(OutputFormat::Yaml) => outln!("{}", serde_saphyr::to_string(&rows).unwrap_or_default()),
        _ => {
            if rows.is_empty() {
                outln!("nothing runs");
                return Ok(0);
            }
            outln!("{HEADER}");
            for r in &rows {
                outln!("{}", row(r));
            }
        }
    }
    Ok(0)
}

/// The usage lines of a running job's `describe` (nothing when none of its containers runs).
pub async fn describe_usage(ctx: &Context, job: &str) {
    let Ok(rows) = usage::running(ctx, Some(job), None).await else {
        return;
    };
    if rows.is_empty() {
        return;
    }
    outln!("Usage (running containers):");
    outln!("  {HEADER}");
    for r in &rows {
        outln!("  {}", row(r));
    }
}
