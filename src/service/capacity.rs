//! What a node needs to hold many live sessions, checked when `runner serve` starts.
//!
//! Each live containerd session costs the host more than memory: threads (its shim is a Go
//! process; every thread takes a pid), open files in the server and in containerd, a range of
//! user ids, and on cgroup v2 an inotify instance in its shim (the OOM watch of the
//! container's `memory.events`). The kernel's defaults on many hosts stop well below what the
//! memory would hold (`kernel.pid_max` 32768 fits ~2,700 sessions), and what fails then is a
//! session create with a bare EAGAIN or EMFILE from deep inside runc or the shim. So the server
//! raises what it may raise itself (its own open-files limit, up to the hard limit; the
//! private containerd inherits it) and says at start, for everything else, what the host
//! holds, what `--expect-sessions` needs and what to set (docs/guide/capacity.md).
//!
//! The per-session figures were measured on a 2-core containerd 1.6 / runc 1.1 host with the
//! Python image (`scripts/bench-density.sh`), with some slack.

use std::path::Path;

use crate::config::Config;

/// Threads (pids) one session takes: its shim's threads (the Go runtime's; 11.4 on average
/// measured at 500 idle sessions) plus the container's init and resident shell, rounded up.
pub const THREADS_PER_SESSION: u64 = SHIM_THREADS + SANDBOX_THREADS;
/// Threads of one idle shim serving one container.
const SHIM_THREADS: u64 = 11;
/// The container's init and resident shell, and one spare.
const SANDBOX_THREADS: u64 = 3;
/// Threads of one idle shim serving a group of containers (`--sessions-per-shim`): 12.0 on
/// average measured for 32 shims serving 500 idle sessions (16 each), with slack.
const GROUPED_SHIM_THREADS: u64 = 16;

/// Threads per session when `per_shim` sessions share a shim, rounded up.
pub fn threads_per_session(per_shim: u64) -> u64 {
    if per_shim <= 1 {
        return THREADS_PER_SESSION;
    }
    SANDBOX_THREADS + GROUPED_SHIM_THREADS.div_ceil(per_shim)
}
/// Open files of the server per session: 3 measured for a session without setup (the agent's
/// control FIFO, the resident shell's input and status FIFOs), plus one. A session with setup,
/// and a restored or forked one, keeps its init's stdout and stderr FIFOs too (5), and a
/// command in flight holds four more while it runs: a count for the plainest idle session.
pub const SERVER_FDS_PER_SESSION: u64 = 4;
/// Open files of containerd per session: 4 measured (its connections to the shim, the
/// container's stdio FIFOs), plus one.
pub const CONTAINERD_FDS_PER_SESSION: u64 = 5;
/// The same with shared shims: 3.1 measured at 500 and 1,000 sessions, 16 per shim (one
/// connection less per session), plus one.
const CONTAINERD_FDS_PER_GROUPED_SESSION: u64 = 4;
/// What the rest of the host (the server, containerd, other work) needs besides, in pids and fds.
const BASE: u64 = 4096;

/// The limits of the host that bound how many sessions it holds; `None` where unknown.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostFacts {
    /// `kernel.pid_max`: every thread of every process takes one.
    pub pid_max: Option<u64>,
    /// `kernel.threads-max`.
    pub threads_max: Option<u64>,
    /// Threads the host runs now (from /proc/loadavg).
    pub threads_now: Option<u64>,
    /// The smallest `pids.max` of this process's cgroup and its ancestors (a systemd unit's
    /// TasksMax): the private containerd and its shims are started in it.
    pub own_pids_max: Option<u64>,
    /// This process's open-files limit (soft), after raising it.
    pub nofile: Option<u64>,
    /// containerd's open-files limit (soft), when its process is known.
    pub containerd_nofile: Option<u64>,
    /// Whether cgroup v2 is the only hierarchy (the shims watch OOM with inotify then).
    pub cgroup_v2: bool,
    /// `fs.inotify.max_user_instances`.
    pub inotify_instances: Option<u64>,
    /// `user.max_user_namespaces`.
    pub user_namespaces: Option<u64>,
}

/// A limit too low for the sessions the server expects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shortfall {
    /// The setting, as the operator names it (`kernel.pid_max`).
    pub setting: &'static str,
    pub have: u64,
    pub need: u64,
    /// What to do about it.
    pub fix: String,
}

impl Shortfall {
    /// The line the server prints: what, how much, and the fix.
    pub fn message(&self, sessions: u64) -> String {
        format!(
            "{} is {}; {} live sessions need at least {}: {}",
            self.setting, self.have, sessions, self.need, self.fix
        )
    }
}

/// What the host lacks for `sessions` live sessions, `per_shim` of them sharing a shim (PURE:
/// unit-tested on made-up hosts).
pub fn shortfalls(facts: &HostFacts, sessions: u64, per_shim: u64) -> Vec<Shortfall> {
    let mut out = Vec::new();
    let threads = BASE + sessions * threads_per_session(per_shim);
    // Threads already running besides ours count against the same pid space.
    let threads_with_host = threads + facts.threads_now.unwrap_or(0);
    let mut want = |setting: &'static str, have: Option<u64>, need: u64, fix: String| {
        if let Some(have) = have
            && have < need
        {
            out.push(Shortfall {
                setting,
                have,
                need,
                fix,
            });
        }
    };
    want(
        "kernel.pid_max",
        facts.pid_max,
        threads_with_host,
        // 2^22 is the kernel's largest; more threads than that need more nodes.
        "sysctl -w kernel.pid_max=4194304 (the kernel's largest; and in /etc/sysctl.d/ to keep it)".into(),
    );
    want(
        "kernel.threads-max",
        facts.threads_max,
        threads_with_host,
        format!("sysctl -w kernel.threads-max={}", threads_with_host * 2),
    );
    want(
        "pids.max of runner's cgroup",
        facts.own_pids_max,
        threads,
        "the private containerd and its shims run in runner's cgroup: raise its pids limit (systemd: TasksMax=infinity in the unit)".into(),
    );
    let server_fds = BASE + sessions * SERVER_FDS_PER_SESSION;
    want(
        "the server's open-files limit",
        facts.nofile,
        server_fds,
        format!(
            "raise the hard limit (ulimit -Hn {server_fds}, systemd: LimitNOFILE={server_fds}); runner raises its soft limit to the hard one itself, and the hard one up to fs.nr_open when it holds CAP_SYS_RESOURCE"
        ),
    );
    let per_session = if per_shim > 1 {
        CONTAINERD_FDS_PER_GROUPED_SESSION
    } else {
        CONTAINERD_FDS_PER_SESSION
    };
    let containerd_fds = BASE + sessions * per_session;
    want(
        "containerd's open-files limit",
        facts.containerd_nofile,
        containerd_fds,
        format!(
            "start containerd with LimitNOFILE={containerd_fds} or more (runner's private containerd inherits runner's limit: restart it with `runner daemon stop`)"
        ),
    );
    if facts.cgroup_v2 {
        want(
            "fs.inotify.max_user_instances",
            facts.inotify_instances,
            sessions + 128,
            format!(
                "each shim watches its container's memory.events with an inotify instance on cgroup v2, and without one OOM kills go unreported by events: sysctl -w fs.inotify.max_user_instances={}",
                sessions + 1024
            ),
        );
    }
    want(
        "user.max_user_namespaces",
        facts.user_namespaces,
        sessions + 128,
        format!("sysctl -w user.max_user_namespaces={}", (sessions + 1024).max(65536)),
    );
    out
}

/// Raise this process's open-files limit (see `containerd::daemon::raise_open_files`): the
/// server holds files for every session, and processes it starts (the private containerd)
/// inherit the limit. Returns (before, after), soft limits.
pub fn raise_nofile() -> std::io::Result<(u64, u64)> {
    crate::containerd::daemon::raise_open_files()
}

/// Read the host's facts (small procfs and cgroupfs files, each read bounded; a missing one
/// is `None`). `containerd_pid`: the daemon's process, when known.
pub fn read_facts(containerd_pid: Option<u32>) -> HostFacts {
    let number = |path: &str| read_small(Path::new(path)).and_then(|s| s.trim().parse::<u64>().ok());
    let threads_now = read_small(Path::new("/proc/loadavg"))
        .and_then(|s| s.split_whitespace().nth(3)?.split('/').nth(1)?.parse().ok());
    let nofile = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .ok()
        .map(|(soft, _)| soft);
    let containerd_nofile = containerd_pid
        .and_then(|pid| read_small(Path::new(&format!("/proc/{pid}/limits"))))
        .and_then(|limits| soft_limit(&limits, "Max open files"));
    let cgroup_v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    HostFacts {
        pid_max: number("/proc/sys/kernel/pid_max"),
        threads_max: number("/proc/sys/kernel/threads-max"),
        threads_now,
        own_pids_max: read_small(Path::new("/proc/self/cgroup")).and_then(|c| own_pids_max(&c, cgroup_v2)),
        nofile,
        containerd_nofile,
        cgroup_v2,
        inotify_instances: number("/proc/sys/fs/inotify/max_user_instances"),
        user_namespaces: number("/proc/sys/user/max_user_namespaces"),
    }
}

/// The soft limit of a `/proc/PID/limits` row ("Max open files  1024  4096  files").
fn soft_limit(limits: &str, row: &str) -> Option<u64> {
    let rest = limits.lines().find_map(|l| l.strip_prefix(row))?;
    match rest.split_whitespace().next()? {
        "unlimited" => Some(u64::MAX),
        n => n.parse().ok(),
    }
}

/// The smallest `pids.max` on the way from this process's pids cgroup up to the root.
fn own_pids_max(proc_cgroup: &str, v2: bool) -> Option<u64> {
    let (root, path) = proc_cgroup.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        if v2 && controllers.is_empty() {
            Some(("/sys/fs/cgroup".to_string(), path))
        } else if !v2 && controllers.split(',').any(|c| c == "pids") {
            Some((format!("/sys/fs/cgroup/{controllers}"), path))
        } else {
            None
        }
    })?;
    let mut dir = Path::new(&root).join(path.trim_start_matches('/'));
    let mut least: Option<u64> = None;
    while dir.starts_with(&root) && dir.as_os_str().len() > root.len() {
        if let Some(max) = read_small(&dir.join("pids.max")).and_then(|s| s.trim().parse::<u64>().ok()) {
            least = Some(least.map_or(max, |l| l.min(max)));
        }
        if !dir.pop() {
            break;
        }
    }
    least
}

/// A procfs/cgroupfs file of at most 16 KiB (these never block and are never larger).
fn read_small(path: &Path) -> Option<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)
        .ok()?
        .take(16 * 1024)
        .read_to_string(&mut text)
        .ok()?;
    Some(text)
}

/// What the host lacks for `sessions` live sessions of the containerd `config` names, with
/// `per_shim` sessions per shim, as the lines the server prints (blocking: a few procfs reads
/// and a connect to a unix socket).
pub fn check(config: &Config, sessions: u64, per_shim: usize) -> Vec<String> {
    let private = crate::containerd::daemon::DaemonPaths::new(&config.state_dir).socket;
    let candidates = match &config.address {
        Some(address) => vec![address.clone()],
        // The order `service::daemon::connect` tries them in.
        None => vec![crate::config::DEFAULT_ADDRESS.into(), private],
    };
    let pid = candidates.iter().find_map(|s| socket_peer_pid(s));
    shortfalls(&read_facts(pid), sessions, per_shim as u64)
        .iter()
        .map(|s| s.message(sessions))
        .collect()
}

/// The pid of the process listening on a unix socket (SO_PEERCRED of a connection to it).
pub fn socket_peer_pid(socket: &Path) -> Option<u32> {
    use std::os::fd::AsFd;
    let stream = std::os::unix::net::UnixStream::connect(socket).ok()?;
    let cred = nix::sys::socket::getsockopt(&stream.as_fd(), nix::sys::socket::sockopt::PeerCredentials).ok()?;
    u32::try_from(cred.pid()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roomy() -> HostFacts {
        HostFacts {
            pid_max: Some(4_194_304),
            threads_max: Some(1_000_000),
            threads_now: Some(500),
            own_pids_max: None,
            nofile: Some(1_048_576),
            containerd_nofile: Some(1_048_576),
            cgroup_v2: true,
            inotify_instances: Some(65536),
            user_namespaces: Some(100_000),
        }
    }

    #[test]
    fn a_roomy_host_holds_five_thousand() {
        assert_eq!(shortfalls(&roomy(), 5000, 1), vec![]);
    }

    #[test]
    fn the_default_pid_max_stops_five_thousand_sessions_and_says_what_to_set() {
        let facts = HostFacts {
            pid_max: Some(32768),
            ..roomy()
        };
        let found = shortfalls(&facts, 5000, 1);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].setting, "kernel.pid_max");
        assert_eq!(found[0].need, BASE + 5000 * THREADS_PER_SESSION + 500);
        assert!(
            found[0].fix.contains("sysctl -w kernel.pid_max=4194304"),
            "{}",
            found[0].fix
        );
        // A thousand fit.
        assert_eq!(shortfalls(&facts, 1000, 1), vec![]);
    }

    #[test]
    fn low_open_file_limits_of_the_server_and_containerd_are_named_apart() {
        let facts = HostFacts {
            nofile: Some(1024),
            containerd_nofile: Some(20000),
            ..roomy()
        };
        let found = shortfalls(&facts, 5000, 1);
        let settings: Vec<_> = found.iter().map(|s| s.setting).collect();
        assert_eq!(
            settings,
            ["the server's open-files limit", "containerd's open-files limit"]
        );
        assert!(
            found[0].message(5000).contains("LimitNOFILE=24096"),
            "{}",
            found[0].message(5000)
        );
    }

    #[test]
    fn inotify_instances_count_only_on_cgroup_v2() {
        let mut facts = HostFacts {
            inotify_instances: Some(128),
            ..roomy()
        };
        assert_eq!(shortfalls(&facts, 5000, 1)[0].setting, "fs.inotify.max_user_instances");
        facts.cgroup_v2 = false;
        assert_eq!(shortfalls(&facts, 5000, 1), vec![]);
    }

    #[test]
    fn a_systemd_tasks_max_on_runner_is_found() {
        let facts = HostFacts {
            own_pids_max: Some(4915),
            ..roomy()
        };
        let found = shortfalls(&facts, 1000, 1);
        assert_eq!(found[0].setting, "pids.max of runner's cgroup");
        assert!(found[0].fix.contains("TasksMax"));
    }

    #[test]
    fn shared_shims_take_fewer_threads() {
        let facts = HostFacts {
            pid_max: Some(32768),
            ..roomy()
        };
        // 5,000 sessions with a shim each need ~74,000 pids; 16 to a shim, 5 each.
        assert_eq!(shortfalls(&facts, 5000, 1)[0].setting, "kernel.pid_max");
        assert_eq!(threads_per_session(16), SANDBOX_THREADS + 1);
        assert_eq!(shortfalls(&facts, 5000, 16), vec![]);
        assert_eq!(threads_per_session(1), THREADS_PER_SESSION);
        assert!(threads_per_session(2) < THREADS_PER_SESSION);
    }

    #[test]
    fn unknown_limits_are_not_guessed() {
        assert_eq!(shortfalls(&HostFacts::default(), 100_000, 1), vec![]);
    }

    #[test]
    fn limits_rows_are_read() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \nMax processes             96365                96365                processes \nMax open files            1024                 524288               files     \n";
        assert_eq!(soft_limit(limits, "Max open files"), Some(1024));
        assert_eq!(
            soft_limit(
                "Max open files            unlimited            unlimited            files",
                "Max open files"
            ),
            Some(u64::MAX)
        );
        assert_eq!(soft_limit(limits, "Max locked memory"), None);
    }

    #[test]
    fn this_process_reads_its_own_facts_and_raises_its_file_limit() {
        let (_, after) = raise_nofile().unwrap();
        let facts = read_facts(Some(std::process::id()));
        assert_eq!(facts.nofile, Some(after));
        assert_eq!(facts.containerd_nofile, Some(after));
        assert!(facts.pid_max.unwrap() >= 301);
        assert!(facts.threads_now.unwrap() >= 1);
    }
}
