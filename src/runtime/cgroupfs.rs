//! Reading a container's cgroup counters (OOM kills, peak memory, CPU time) on cgroup v1 and
//! v2. containerd 1.6's Tasks.Metrics returns v1 metrics the Rust client cannot decode, and
//! the counters must be read before Tasks.Delete removes the cgroup.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// The root every cgroup hierarchy is mounted under.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CgroupStats {
    /// Processes the kernel OOM-killed in this cgroup.
    pub oom_kills: Option<u64>,
    pub peak_memory: Option<u64>,
    pub cpu_usage: Option<Duration>,
}

/// Which layout the host uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Controllers in separate hierarchies (`/sys/fs/cgroup/memory/...`), as on hybrid hosts.
    V1,
    /// One unified hierarchy at `/sys/fs/cgroup`.
    V2,
}

pub fn layout() -> Layout {
    if Path::new(CGROUP_ROOT).join("cgroup.controllers").exists() {
        Layout::V2
    } else {
        Layout::V1
    }
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `key N` out of a flat-keyed file (memory.events, memory.oom_control, cpu.stat).
fn keyed(path: &Path, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

fn v1_dir(controller: &str, cgroup: &str) -> PathBuf {
    Path::new(CGROUP_ROOT)
        .join(controller)
        .join(cgroup.trim_start_matches('/'))
}

/// Where a cgroup v2 hierarchy is mounted, if any (`/sys/fs/cgroup` on v2,
/// `/sys/fs/cgroup/unified` on hybrid v1 hosts).
pub fn cgroup2_mount() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mounts.lines().find_map(|line| {
        let (pre, post) = line.split_once(" - ")?;
        if post.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        pre.split_whitespace().nth(4).map(PathBuf::from)
    })
}

/// Our own cgroup v2 path (`0::/path` in /proc/self/cgroup).
pub fn own_cgroup2_path() -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim_start_matches('/').to_string())
}

/// This process's own `cgroup.procs`: in the v2 hierarchy when one is mounted, else in v1's
/// memory hierarchy.
pub fn own_procs_file() -> Option<PathBuf> {
    if let (Some(mount), Some(path)) = (cgroup2_mount(), own_cgroup2_path()) {
        return Some(mount.join(path).join("cgroup.procs"));
    }
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = text.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers.split(',').any(|c| c == "memory").then_some(path)
    })?;
    Some(v1_dir("memory", path).join("cgroup.procs"))
}

/// Host PIDs of the processes in the cgroup at `cgroup` (empty when it is gone).
pub fn procs(cgroup: &str) -> Vec<i32> {
    let file = match layout() {
        Layout::V2 => Path::new(CGROUP_ROOT).join(cgroup.trim_start_matches('/')),
        // runc puts a container in every hierarchy; memory is always among them (limits).
        Layout::V1 => v1_dir("memory", cgroup),
    }
    .join("cgroup.procs");
    std::fs::read_to_string(file)
        .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// The memory the cgroup at `cgroup` uses now (page cache included).
pub fn memory_usage(cgroup: &str) -> Option<u64> {
    match layout() {
        Layout::V2 => read_u64(
            &Path::new(CGROUP_ROOT)
                .join(cgroup.trim_start_matches('/'))
                .join("memory.current"),
        ),
        Layout::V1 => read_u64(&v1_dir("memory", cgroup).join("memory.usage_in_bytes")),
    }
}

/// Counters of the cgroup at `cgroup` (the spec's `cgroupsPath`).
pub fn read(cgroup: &str) -> CgroupStats {
    match layout() {
        Layout::V2 => {
            let dir = Path::new(CGROUP_ROOT).join(cgroup.trim_start_matches('/'));
            CgroupStats {
                oom_kills: keyed(&dir.join("memory.events"), "oom_kill"),
                peak_memory: read_u64(&dir.join("memory.peak")),
                cpu_usage: keyed(&dir.join("cpu.stat"), "usage_usec").map(Duration::from_micros),
            }
        }
        Layout::V1 => {
            let memory = v1_dir("memory", cgroup);
            let cpuacct = ["cpuacct", "cpu,cpuacct"]
                .iter()
                .map(|c| v1_dir(c, cgroup))
                .find(|d| d.exists())
                .unwrap_or_else(|| v1_dir("cpuacct", cgroup));
            CgroupStats {
                oom_kills: keyed(&memory.join("memory.oom_control"), "oom_kill"),
                peak_memory: read_u64(&memory.join("memory.max_usage_in_bytes")),
                cpu_usage: read_u64(&cpuacct.join("cpuacct.usage")).map(Duration::from_nanos),
            }
        }
    }
}

/// Mount points of every cgroup hierarchy (v1 controllers, named hierarchies, v2).
fn hierarchies() -> Vec<PathBuf> {
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    mounts
        .lines()
        .filter_map(|line| {
            let (pre, post) = line.split_once(" - ")?;
            let fstype = post.split_whitespace().next()?;
            (fstype == "cgroup" || fstype == "cgroup2")
                .then(|| pre.split_whitespace().nth(4).map(PathBuf::from))
                .flatten()
        })
        .collect()
}

/// Remove the cgroups runc leaves under `parent` (the namespace's `/runner/<ns>`): child
/// cgroups of containers not in `existing` (a dead shim leaves them), then `parent` itself
/// when no container exists — runc removes a container's own cgroup but never the parents it
/// created. `rmdir` refuses a cgroup that still has processes or children. Returns the
/// directories removed.
pub fn remove_stale(parent: &str, existing: &std::collections::HashSet<String>) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    for root in hierarchies() {
        let dir = root.join(parent.trim_start_matches('/'));
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let stale = entry.file_type().is_ok_and(|t| t.is_dir())
                && !existing.contains(entry.file_name().to_string_lossy().as_ref());
            if stale && std::fs::remove_dir(entry.path()).is_ok() {
                removed.push(entry.path());
            }
        }
        if existing.is_empty() && std::fs::remove_dir(&dir).is_ok() {
            removed.push(dir);
        }
    }
    removed
}
