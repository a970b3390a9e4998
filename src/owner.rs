//! Which runner process owns something: `<pid>:<process start time>`, written into labels,
//! job records and run directories, and checked by `gc` and by re-adoption (a PID alone could
//! have been reused by an unrelated process). Both backends and the job store use it.

use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

/// This runner process, as written in owner labels and records.
pub fn owner_id() -> String {
    // Read once: neither changes while the process lives, and reading /proc/self/stat costs
    // the kernel a pass over every thread of the process (it sums their CPU times).
    static OWN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    OWN.get_or_init(|| {
        let pid = std::process::id();
        format!("{pid}:{}", process_start_time(pid).unwrap_or_default())
    })
    .clone()
}

/// Start time of a living process (field 22 of /proc/PID/stat), to tell a live owner from a
/// reused PID. A zombie (exited, not yet reaped by its parent) counts as gone.
pub fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut fields = stat[stat.rfind(')')? + 2..].split_whitespace();
    if matches!(fields.next(), Some("Z" | "X")) {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// Whether the runner process named by an owner label still runs.
pub fn owner_alive(owner: &str) -> bool {
    let Some((pid, start)) = owner.split_once(':') else {
        return false;
    };
    let (Ok(pid), Ok(start)) = (pid.parse::<u32>(), start.parse::<u64>()) else {
        return false;
    };
    process_start_time(pid) == Some(start)
}

/// A short tag no other call in any runner process returns (pid, time, and a counter, hashed):
/// what makes container and session ids unique.
pub fn unique_tag() -> String {
    static SEQUENCE: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let n = SEQUENCE.fetch_add(1, Ordering::Relaxed);
    let digest = Sha256::digest(format!("{}-{nanos}-{n}", std::process::id()).as_bytes());
    hex::encode(&digest[..5])
}
