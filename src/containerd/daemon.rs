//! The embedded containerd: when no containerd answers at the default address, runner starts
//! a private one under its state directory (own root, state, sockets), detached from the CLI
//! so it outlives it, and stops only the PID it started.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use sha2::{Digest, Sha256};

use super::Containerd;

/// The binary we start.
pub const CONTAINERD_BIN: &str = "containerd";
/// How long a fresh daemon may take to answer.
const START_LIMIT: Duration = Duration::from_secs(15);
/// How long SIGTERM may take before SIGKILL on stop.
const STOP_LIMIT: Duration = Duration::from_secs(10);
/// Unix socket paths are limited to 108 bytes; stay well below.
const MAX_SOCKET_PATH: usize = 100;

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("the containerd binary is not installed (apt-get install containerd)")]
    NotInstalled,
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("containerd (pid {pid}) did not answer at {socket} within {limit:?}; see {log}")]
    NoAnswer {
        pid: u32,
        socket: PathBuf,
        limit: Duration,
        log: PathBuf,
    },
}

/// Where the embedded daemon keeps everything.
#[derive(Clone, Debug)]
pub struct DaemonPaths {
    pub dir: PathBuf,
    pub config: PathBuf,
    pub socket: PathBuf,
    pub pid_file: PathBuf,
    pub log: PathBuf,
}

impl DaemonPaths {
    pub fn new(state_dir: &Path) -> Self {
        let dir = state_dir.join("containerd");
        let mut socket = dir.join("containerd.sock");
        if socket.as_os_str().len() > MAX_SOCKET_PATH {
            // A deep state dir: keep the socket short in /run, named after the state dir.
            let digest = hex::encode(Sha256::digest(state_dir.as_os_str().as_encoded_bytes()));
            socket = PathBuf::from(format!("/run/runner-{}/containerd.sock", &digest[..12]));
        }
        DaemonPaths {
            config: dir.join("config.toml"),
            pid_file: dir.join("containerd.pid"),
            log: dir.join("containerd.log"),
            socket,
            dir,
        }
    }

    fn config_text(&self) -> String {
        let root = self.dir.join("root");
        let state = self.dir.join("state");
        format!(
            "# Written by runner: a private containerd (runner daemon start).\nversion = 2\nroot = {root:?}\nstate = {state:?}\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\", \"io.containerd.snapshotter.v1.aufs\", \"io.containerd.snapshotter.v1.btrfs\", \"io.containerd.snapshotter.v1.zfs\", \"io.containerd.snapshotter.v1.devmapper\"]\n\n[grpc]\n  address = {sock:?}\n\n[ttrpc]\n  address = {ttrpc:?}\n\n[debug]\n  address = \"\"\n\n[metrics]\n  address = \"\"\n",
            root = root.display().to_string(),
            state = state.display().to_string(),
            sock = self.socket.display().to_string(),
            ttrpc = format!("{}.ttrpc", self.socket.display()),
        )
    }
}

/// Whether the daemon we started is running: its PID, if so. A PID file whose process is
/// gone, or is not our containerd, counts as stopped.
pub fn running(paths: &DaemonPaths) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(&paths.pid_file).ok()?.trim().parse().ok()?;
    is_ours(paths, pid).then_some(pid)
}

/// Whether `pid` is our containerd (a PID reused by another process is not).
fn is_ours(paths: &DaemonPaths, pid: u32) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let cmdline = String::from_utf8_lossy(&cmdline);
    cmdline.contains(CONTAINERD_BIN) && cmdline.contains(&*paths.config.to_string_lossy())
}

fn find_binary() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(CONTAINERD_BIN))
        .find(|p| p.is_file())
}

pub fn installed() -> bool {
    find_binary().is_some()
}

/// The PID of the daemon we started if it died without `stop`: its PID file is there, its
/// process is not (a crash, the OOM killer, a SIGKILL). `stop` removes the file first, so a
/// daemon stopped on purpose is never taken for a dead one.
pub fn died(paths: &DaemonPaths) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(&paths.pid_file).ok()?.trim().parse().ok()?;
    (!is_ours(paths, pid)).then_some(pid)
}

/// Start the private daemon (or find it running) and wait until it answers.
pub async fn start(paths: &DaemonPaths) -> Result<u32, DaemonError> {
    if let Some(pid) = answering(paths).await {
        return Ok(pid);
    }
    let binary = find_binary().ok_or(DaemonError::NotInstalled)?;
    std::fs::create_dir_all(&paths.dir).map_err(io("creating the daemon directory"))?;
    // Two processes that find no daemon at once (two CLIs, or a CLI and a server reviving it)
    // would start two on one root: the second blocks on the first's metadata lock and
    // overwrites its PID file. One starts; the other waits here and finds it running.
    let _lock = start_lock(paths).await.map_err(io("locking the daemon's start"))?;
    if let Some(pid) = answering(paths).await {
        return Ok(pid);
    }
    spawn(paths, binary).await
}

/// Start the daemon we started again if it died (`died`), once however many ask at once:
/// the new one's PID, or `None` when it had not died (or another process started it since).
pub async fn revive(paths: &DaemonPaths) -> Result<Option<u32>, DaemonError> {
    if died(paths).is_none() {
        return Ok(None);
    }
    let binary = find_binary().ok_or(DaemonError::NotInstalled)?;
    let _lock = start_lock(paths).await.map_err(io("locking the daemon's start"))?;
    if died(paths).is_none() {
        return Ok(None);
    }
    spawn(paths, binary).await.map(Some)
}

/// The daemon's PID when it runs and answers (within 2 s).
async fn answering(paths: &DaemonPaths) -> Option<u32> {
    let pid = running(paths)?;
    wait_answer(&paths.socket, Duration::from_secs(2)).await.then_some(pid)
}

fn io(what: &str) -> impl FnOnce(std::io::Error) -> DaemonError {
    let what = what.to_string();
    move |source| DaemonError::Io { what, source }
}

/// Start the daemon (the caller holds the start lock) and wait until it answers.
async fn spawn(paths: &DaemonPaths, binary: PathBuf) -> Result<u32, DaemonError> {
    if let Some(parent) = paths.socket.parent() {
        std::fs::create_dir_all(parent).map_err(io("creating the socket directory"))?;
    }
    // A stale socket from a dead daemon would make containerd refuse to listen.
    let _ = std::fs::remove_file(&paths.socket);
    std::fs::write(&paths.config, paths.config_text()).map_err(io("writing the daemon config"))?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&paths.log)
        .map_err(io("opening the daemon log"))?;
    let log2 = log.try_clone().map_err(io("opening the daemon log"))?;
    // containerd holds ~4 files for every live container: it starts with the raised limit
    // (a containerd built with Go >= 1.19 raises soft to hard itself; older builds kept a
    // shell's soft 1024, ~250 containers).
    let _ = raise_open_files();
    let child = std::process::Command::new(binary)
        .arg("--config")
        .arg(&paths.config)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        // Its own process group: Ctrl-C in the terminal that started it must not stop it.
        .process_group(0)
        .spawn()
        .map_err(io("starting containerd"))?;
    let pid = child.id();
    // The daemon outlives a CLI (init reaps it then); a server that started it reaps it when
    // it dies, or each death it survives would leave a zombie.
    let mut child = child;
    let _ = std::thread::Builder::new()
        .name("containerd-reaper".into())
        .spawn(move || child.wait());
    std::fs::write(&paths.pid_file, format!("{pid}\n")).map_err(io("writing the daemon pid file"))?;
    if wait_answer(&paths.socket, START_LIMIT).await {
        Ok(pid)
    } else {
        Err(DaemonError::NoAnswer {
            pid,
            socket: paths.socket.clone(),
            limit: START_LIMIT,
            log: paths.log.clone(),
        })
    }
}

/// The daemon directory's start lock (`start.lock`), waited for up to the start's own limit
/// and a little more (the holder may be starting a daemon that takes all of it).
async fn start_lock(paths: &DaemonPaths) -> std::io::Result<nix::fcntl::Flock<std::fs::File>> {
    use nix::fcntl::{Flock, FlockArg};
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(paths.dir.join("start.lock"))?;
    let start = Instant::now();
    loop {
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => return Ok(lock),
            Err((back, nix::errno::Errno::EWOULDBLOCK)) if start.elapsed() < START_LIMIT + STOP_LIMIT => {
                file = back;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err((_, e)) => return Err(e.into()),
        }
    }
}

async fn wait_answer(socket: &Path, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if Containerd::connect(socket, "default").await.is_ok() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// Stop the daemon we started (only that PID): SIGTERM, then SIGKILL after a while.
/// Running containers survive (their shims are separate processes). The PID file goes
/// first, so a server watching the daemon (`died`) never takes this stop for a death.
pub async fn stop(paths: &DaemonPaths) -> Result<Option<u32>, DaemonError> {
    // Held to the end: a start meanwhile waits, then finds the daemon gone and starts anew
    // (the lock's wait outlasts this stop's limit). Without the directory there is no daemon.
    let _lock = match paths.dir.is_dir() {
        true => start_lock(paths).await.ok(),
        false => None,
    };
    let found = running(paths);
    let _ = std::fs::remove_file(&paths.pid_file);
    let Some(pid) = found else {
        return Ok(None);
    };
    let target = Pid::from_raw(pid as i32);
    let _ = kill(target, Signal::SIGTERM);
    let start = Instant::now();
    while is_ours(paths, pid) && start.elapsed() < STOP_LIMIT {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if is_ours(paths, pid) {
        let _ = kill(target, Signal::SIGKILL);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(Some(pid))
}

/// Raise this process's open-files limit: with the privilege to (CAP_SYS_RESOURCE, which a
/// container usually drops) the hard limit too, up to the kernel's `fs.nr_open` (a hard limit
/// of 20,000, or systemd's 524,288, stops a server at ~3,000 or ~75,000 live sessions); else
/// the soft limit up to the hard one. Processes started after inherit it. Returns (before,
/// after), soft limits.
pub fn raise_open_files() -> std::io::Result<(u64, u64)> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(std::io::Error::from)?;
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    if let Some(target) = nofile_target(hard, nr_open)
        && setrlimit(Resource::RLIMIT_NOFILE, target, target).is_ok()
    {
        return Ok((soft, target));
    }
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).map_err(std::io::Error::from)?;
    }
    Ok((soft, hard.max(soft)))
}

/// The hard open-files limit worth asking for (PURE): the kernel's `fs.nr_open`, capped at
/// 2^20 (programs that walk every possible fd get slow past that), when above `hard`.
fn nofile_target(hard: u64, nr_open: Option<u64>) -> Option<u64> {
    let target = nr_open?.min(1 << 20);
    (target > hard).then_some(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hard_file_limit_is_raised_to_nr_open_at_most_a_million() {
        assert_eq!(nofile_target(20_000, Some(1_048_576)), Some(1_048_576));
        assert_eq!(nofile_target(524_288, Some(1 << 30)), Some(1 << 20));
        assert_eq!(nofile_target(1 << 20, Some(1 << 20)), None);
        assert_eq!(nofile_target(20_000, None), None);
    }
}
