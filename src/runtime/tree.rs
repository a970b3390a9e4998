//! A process tree we can kill whole: a child cgroup (v2, on a pure-v2 host or on the unified
//! hierarchy of a hybrid one) when we may create one, else the process group the child leads.
//!
//! A cgroup catches everything: re-parented grandchildren, daemons that called setsid. A
//! process group catches backgrounded children (`sleep &`) but not a grandchild that leaves
//! its group; that is the documented limit of the fallback.

use std::fs;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

use super::cgroupfs;

static SEQUENCE: AtomicU64 = AtomicU64::new(0);

/// Prefix of the cgroups the host backend creates (one per process it starts).
pub const CGROUP_PREFIX: &str = "runner-host-";

#[derive(Debug)]
pub struct ProcessTree {
    cgroup: Option<PathBuf>,
    /// Open `cgroup.procs` of `cgroup`, written by the child before exec.
    procs_fd: Option<OwnedFd>,
    pgid: Option<i32>,
}

impl ProcessTree {
    /// Prepare tracking for one process about to be started. Never fails: without a usable
    /// cgroup it falls back to the process group.
    pub fn prepare(use_cgroup: bool) -> Self {
        let cgroup = if use_cgroup { Self::make_cgroup() } else { None };
        let procs_fd = cgroup.as_ref().and_then(|dir| {
            fs::OpenOptions::new()
                .write(true)
                .open(dir.join("cgroup.procs"))
                .ok()
                .map(OwnedFd::from)
        });
        if let (Some(dir), None) = (&cgroup, &procs_fd) {
            let _ = fs::remove_dir(dir);
        }
        ProcessTree {
            cgroup: procs_fd.as_ref().and(cgroup),
            procs_fd,
            pgid: None,
        }
    }

    fn make_cgroup() -> Option<PathBuf> {
        let mount = cgroupfs::cgroup2_mount()?;
        let parent = mount.join(cgroupfs::own_cgroup2_path()?);
        let name = format!(
            "{CGROUP_PREFIX}{}-{}",
            std::process::id(),
            SEQUENCE.fetch_add(1, Ordering::Relaxed)
        );
        let dir = parent.join(name);
        match fs::create_dir(&dir) {
            Ok(()) => Some(dir),
            Err(e) => {
                tracing::debug!(dir = %dir.display(), error = %e, "no cgroup for the process tree; using its process group");
                None
            }
        }
    }

    /// Whether the tree is tracked by a cgroup (else by a process group).
    pub fn uses_cgroup(&self) -> bool {
        self.cgroup.is_some()
    }

    /// The raw fd the child writes `0` to (joining the cgroup) between fork and exec.
    pub fn procs_fd(&self) -> Option<i32> {
        self.procs_fd.as_ref().map(|f| f.as_raw_fd())
    }

    /// Record the started child, which leads its own process group (setsid in pre_exec).
    pub fn started(&mut self, pid: u32) {
        self.pgid = i32::try_from(pid).ok();
        // The parent's copy is no longer needed once the child has joined.
        self.procs_fd = None;
    }

    fn members(&self) -> Vec<i32> {
        let Some(dir) = &self.cgroup else {
            return Vec::new();
        };
        fs::read_to_string(dir.join("cgroup.procs"))
            .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    /// Whether any process of the tree is still alive.
    pub fn is_empty(&self) -> bool {
        if self.cgroup.is_some() {
            return self.members().is_empty();
        }
        match self.pgid {
            Some(pgid) => live_group_members(pgid).is_empty(),
            None => true,
        }
    }

    /// Send `signal` to every process of the tree.
    pub fn signal(&self, signal: Signal) {
        if self.cgroup.is_some() {
            for pid in self.members() {
                let _ = kill(Pid::from_raw(pid), signal);
            }
        }
        if let Some(pgid) = self.pgid {
            let _ = killpg(Pid::from_raw(pgid), signal);
        }
    }

    /// SIGKILL every process of the tree, including ones forked while we kill.
    pub fn kill_all(&self) {
        if let Some(dir) = &self.cgroup {
            // cgroup.kill (Linux 5.14+) kills atomically, forks in flight included.
            if let Ok(mut f) = fs::OpenOptions::new().write(true).open(dir.join("cgroup.kill"))
                && f.write_all(b"1").is_ok()
            {
                return;
            }
            // Older kernels: freeze so nothing forks, kill the members, thaw so they die.
            let freeze = dir.join("cgroup.freeze");
            let _ = fs::write(&freeze, "1");
            for pid in self.members() {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            let _ = fs::write(&freeze, "0");
        }
        if let Some(pgid) = self.pgid {
            let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
        }
    }

    /// Kill until empty or `limit` passes; true when the tree is gone.
    pub async fn kill_until_empty(&self, limit: Duration) -> bool {
        let start = Instant::now();
        loop {
            self.kill_all();
            if self.is_empty() {
                return true;
            }
            if start.elapsed() > limit {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Wait (politely) for the tree to empty after a SIGTERM.
    pub async fn wait_empty(&self, limit: Duration) -> bool {
        let start = Instant::now();
        while !self.is_empty() {
            if start.elapsed() > limit {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }

    /// CPU time the tree used, from cgroup v2's `cpu.stat` (always present on v2).
    pub fn cpu_time(&self) -> Option<Duration> {
        let text = fs::read_to_string(self.cgroup.as_ref()?.join("cpu.stat")).ok()?;
        let usec: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("usage_usec "))?
            .trim()
            .parse()
            .ok()?;
        Some(Duration::from_micros(usec))
    }

    /// Peak memory of the tree, where the memory controller is enabled (`memory.peak`).
    pub fn peak_memory(&self) -> Option<u64> {
        fs::read_to_string(self.cgroup.as_ref()?.join("memory.peak"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Remove the cgroup once its processes are gone (rmdir fails while any remain).
    pub fn remove(&mut self) {
        if let Some(dir) = self.cgroup.take() {
            remove_cgroup(&dir);
        }
    }
}

/// Processes of process group `pgid` that are not zombies. kill(-pgid, 0) would count
/// zombies too: orphans killed by us stay zombies until init reaps them, which in a
/// container without a reaping init can be never.
fn live_group_members(pgid: i32) -> Vec<i32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let stat = fs::read_to_string(e.path().join("stat")).ok()?;
            // Fields after the parenthesised command name: state ppid pgrp ...
            let rest = &stat[stat.rfind(')')? + 2..];
            let mut fields = rest.split_whitespace();
            let state = fields.next()?;
            let pgrp: i32 = fields.nth(1)?.parse().ok()?;
            (pgrp == pgid && state != "Z" && state != "X").then_some(pid)
        })
        .collect()
}

fn remove_cgroup(dir: &Path) {
    for _ in 0..50 {
        match fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    tracing::warn!(dir = %dir.display(), "could not remove the process cgroup");
}

impl Drop for ProcessTree {
    /// A tree dropped early (its future was cancelled) must not outlive its handle.
    fn drop(&mut self) {
        self.kill_all();
        self.remove();
    }
}
