//! A live sandbox's resource use, read from its cgroup (v1 and v2) and its network namespace:
//! CPU time, memory now and at peak, processes, block I/O bytes, network bytes. containerd
//! 1.6's Tasks.Metrics answers v1 metrics the Rust client cannot decode (see cgroupfs), so the
//! files are read directly; they are the kernel's, small, and nothing the sandbox can shape.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::cgroupfs::{self, Layout};

const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// The most read of one counter file (io.stat lists every device; net/dev every interface).
const MAX_FILE: u64 = 256 << 10;

/// Counters of one sandbox at one moment.
#[derive(Clone, Debug, Default, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    /// CPU time used since the sandbox started (user and system).
    pub cpu_seconds: f64,
    pub memory_bytes: Option<u64>,
    /// The most memory it used at once.
    pub memory_peak_bytes: Option<u64>,
    /// Processes (and threads) now.
    pub pids: Option<u64>,
    pub io_read_bytes: Option<u64>,
    pub io_write_bytes: Option<u64>,
    /// Bytes received and sent on its network interfaces (loopback not counted); absent when
    /// it shares the host's network or no process is there to look through.
    pub net_rx_bytes: Option<u64>,
    pub net_tx_bytes: Option<u64>,
}

fn read_small(path: &Path) -> Option<String> {
    let mut text = String::new();
    std::fs::File::open(path)
        .ok()?
        .take(MAX_FILE)
        .read_to_string(&mut text)
        .ok()?;
    Some(text)
}

fn read_u64(path: &Path) -> Option<u64> {
    read_small(path)?.trim().parse().ok()
}

fn v1_dir(controllers: &[&str], cgroup: &str) -> Option<PathBuf> {
    controllers
        .iter()
        .map(|c| Path::new(CGROUP_ROOT).join(c).join(cgroup.trim_start_matches('/')))
        .find(|d| d.exists())
}

/// Read and write bytes of io.stat (`MAJ:MIN rbytes=N wbytes=N ...` per device).
fn io_stat_v2(text: &str) -> (u64, u64) {
    let (mut r, mut w) = (0, 0);
    for field in text.split_whitespace() {
        if let Some(n) = field.strip_prefix("rbytes=") {
            r += n.parse::<u64>().unwrap_or(0);
        } else if let Some(n) = field.strip_prefix("wbytes=") {
            w += n.parse::<u64>().unwrap_or(0);
        }
    }
    (r, w)
}

/// Read and write bytes of blkio's `io_service_bytes` (`MAJ:MIN Read N` lines).
fn io_service_bytes_v1(text: &str) -> (u64, u64) {
    let (mut r, mut w) = (0, 0);
    for line in text.lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        if let [_, op, n] = parts[..] {
            let n = n.parse::<u64>().unwrap_or(0);
            match op {
                "Read" => r += n,
                "Write" => w += n,
                _ => {}
            }
        }
    }
    (r, w)
}

/// Received and sent bytes of every interface but `lo` in /proc/net/dev's format.
fn net_dev(text: &str) -> (u64, u64) {
    let (mut rx, mut tx) = (0, 0);
    for line in text.lines().skip(2) {
        let Some((name, counters)) = line.split_once(':') else {
            continue;
        };
        if name.trim() == "lo" {
            continue;
        }
        let n: Vec<u64> = counters.split_whitespace().filter_map(|v| v.parse().ok()).collect();
        if n.len() >= 9 {
            rx += n[0];
            tx += n[8];
        }
    }
    (rx, tx)
}

/// The sandbox's counters, `None` when its cgroup is gone.
pub fn read(cgroup: &str) -> Option<Usage> {
    let procs = cgroupfs::procs(cgroup);
    let mut usage = match cgroupfs::layout() {
        Layout::V2 => {
            let dir = Path::new(CGROUP_ROOT).join(cgroup.trim_start_matches('/'));
            if !dir.exists() {
                return None;
            }
            let cpu = read_small(&dir.join("cpu.stat"))
                .and_then(|t| {
                    t.lines()
                        .find_map(|l| l.strip_prefix("usage_usec ").and_then(|v| v.trim().parse::<u64>().ok()))
                })
                .unwrap_or(0);
            let (r, w) = read_small(&dir.join("io.stat")).map_or((0, 0), |t| io_stat_v2(&t));
            Usage {
                cpu_seconds: cpu as f64 / 1e6,
                memory_bytes: read_u64(&dir.join("memory.current")),
                memory_peak_bytes: read_u64(&dir.join("memory.peak")),
                pids: read_u64(&dir.join("pids.current")),
                io_read_bytes: Some(r),
                io_write_bytes: Some(w),
                ..Usage::default()
            }
        }
        Layout::V1 => {
            let memory = v1_dir(&["memory"], cgroup)?;
            let cpu = v1_dir(&["cpuacct", "cpu,cpuacct", "cpuacct,cpu"], cgroup)
                .and_then(|d| read_u64(&d.join("cpuacct.usage")))
                .unwrap_or(0);
            let io = v1_dir(&["blkio"], cgroup).and_then(|d| {
                read_small(&d.join("blkio.throttle.io_service_bytes_recursive"))
                    .or_else(|| read_small(&d.join("blkio.throttle.io_service_bytes")))
            });
            let (r, w) = io.map_or((0, 0), |t| io_service_bytes_v1(&t));
            Usage {
                cpu_seconds: cpu as f64 / 1e9,
                memory_bytes: read_u64(&memory.join("memory.usage_in_bytes")),
                memory_peak_bytes: read_u64(&memory.join("memory.max_usage_in_bytes")),
                pids: v1_dir(&["pids"], cgroup).and_then(|d| read_u64(&d.join("pids.current"))),
                io_read_bytes: Some(r),
                io_write_bytes: Some(w),
                ..Usage::default()
            }
        }
    };
    // Any of its processes shows its namespace's interfaces (none of its own: the host's, not
    // reported); a PID reused meanwhile by another process would show another's, so the PID
    // must still be in the cgroup afterwards.
    let host_netns = std::fs::read_link("/proc/self/ns/net").ok();
    for pid in procs.iter().take(4) {
        if std::fs::read_link(format!("/proc/{pid}/ns/net")).ok() == host_netns {
            continue;
        }
        let Some(text) = read_small(Path::new(&format!("/proc/{pid}/net/dev"))) else {
            continue;
        };
        if cgroupfs::procs(cgroup).contains(pid) {
            let (rx, tx) = net_dev(&text);
            usage.net_rx_bytes = Some(rx);
            usage.net_tx_bytes = Some(tx);
            break;
        }
    }
    Some(usage)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_files_are_parsed() {
        assert_eq!(
            io_stat_v2("8:0 rbytes=100 wbytes=20 rios=1 wios=2\n8:16 rbytes=5 wbytes=1 dbytes=0\n"),
            (105, 21)
        );
        assert_eq!(
            io_service_bytes_v1("8:0 Read 4096\n8:0 Write 512\n8:0 Sync 0\n8:0 Total 4608\nTotal 4608\n"),
            (4096, 512)
        );
        let dev = "Inter-|   Receive                                                |  Transmit\n face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n    lo:     100       1    0    0    0     0          0         0      100       1    0    0    0     0       0          0\n  eth0:    2000      10    0    0    0     0          0         0      300       3    0    0    0     0       0          0\n";
        assert_eq!(net_dev(dev), (2000, 300));
    }

    #[test]
    fn a_missing_cgroup_reads_as_gone() {
        assert_eq!(read("/runner/no-such-namespace/no-such-container"), None);
    }
}
