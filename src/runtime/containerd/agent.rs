//! The exec agent: a live container's init (after setup) runs a small POSIX shell loop that
//! starts commands on request, so a command costs a fork in the sandbox instead of a
//! `runc exec` (which re-enters every namespace and recompiles the seccomp filter: ~25 ms).
//! Commands inherit everything from the init — user, capabilities, seccomp, cgroup,
//! namespaces — which runs with the container's hardened process spec.
//!
//! Protocol, over a directory the host shares with the container at `AGENT_MOUNT`:
//! the host makes `req-N/` holding `cmd.sh` (the command, shell-quoted), FIFOs `out`, `err`
//! and `done`, and `in` (a file) when there is stdin, then writes `req-N` to the `ctl` FIFO.
//! The agent runs `cmd.sh` in a new session (setsid when the image has it) with those stdio,
//! waits, and writes the status to `done`. The host finds the command's process (to signal
//! it) from the PID the command's subshell writes to `pid` (its own, read from
//! /proc/self/stat), believed only when the kernel confirms it (`request_pid`): a process of
//! the container, the agent's child, started since the request was sent. Without that, it is
//! the agent's child that started first after the request was sent (`request_process`), which
//! can be wrong when a process an earlier request orphaned started in the same tick. The
//! command runs in the agent's foreground, not as an
//! asynchronous list: sh starts those with SIGINT and SIGQUIT ignored, and the ignoring would
//! be inherited by everything the command starts (a resident shell's commands could then not
//! be interrupted).
//!
//! The directory is writable from the sandbox, so the host treats everything in it as
//! hostile: files are created with `O_EXCL|O_NOFOLLOW` relative to a directory fd taken at
//! `mkdir` (a swapped-in symlink can never redirect a host write or read), FIFOs are checked
//! with `fstat` after opening, and what the agent reports (a status) is parsed strictly.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{OFlag, openat};
use nix::sys::stat::{Mode, SFlag, fstat};
use nix::unistd::{Gid, Uid};
use tokio::net::unix::pipe;

use crate::runtime::{FifoEnd, RuntimeError};

/// Where the agent directory appears inside the container.
pub const AGENT_MOUNT: &str = "/.runner";

/// The agent. `fd 3` holds the control FIFO open read-write so reads block for the next
/// request instead of seeing EOF between requests. A request's `done` is opened read-write
/// too (`1<>`): such an open never waits for a reader, so neither a request whose host side
/// went away (a call cancelled) nor one the sandbox planted with a FIFO of its own can hold
/// the agent in `open(2)` for ever (it is the container's init: nothing could signal it out).
/// `out` and `err` stay write-only: a command whose host reader went away must get SIGPIPE,
/// not fill a buffer nobody reads and hang there.
pub const AGENT_SCRIPT: &str = r#"exec 3<>/.runner/ctl
if command -v setsid >/dev/null 2>&1; then runner_s=setsid; else runner_s=; fi
while read -r runner_req <&3; do
  case "$runner_req" in req-[0-9]*) ;; *) continue ;; esac
  runner_d="/.runner/$runner_req"
  [ -f "$runner_d/cmd.sh" ] || continue
  (
    read -r runner_p _ </proc/self/stat && echo "$runner_p" >"$runner_d/pid"
    if [ -f "$runner_d/in" ]; then exec <"$runner_d/in"; else exec </dev/null; fi
    exec $runner_s /bin/sh "$runner_d/cmd.sh" >"$runner_d/out" 2>"$runner_d/err" 3<&-
  )
  echo "$?" 1<>"$runner_d/done"
done"#;

fn io(what: &str) -> impl FnOnce(nix::Error) -> RuntimeError + '_ {
    move |e| RuntimeError::Io {
        what: what.to_string(),
        source: e.into(),
    }
}

/// The directory of request `n`.
pub fn request_name(n: u64) -> String {
    format!("req-{n}")
}

/// Quote for POSIX sh: single quotes, with `'` written as `'\''`.
pub fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The script that runs one command of request `name`: its cwd, environment, then exec of
/// the argv.
pub fn command_script(_name: &str, argv: &[String], env: &[(String, String)], cwd: Option<&str>) -> String {
    let mut script = String::new();
    if let Some(cwd) = cwd {
        script.push_str(&format!("cd {} || exit 126\n", quote(cwd)));
    }
    for (k, v) in env {
        script.push_str(&format!("{k}={}; export {k}\n", quote(v)));
    }
    script.push_str("exec");
    for arg in argv {
        script.push(' ');
        script.push_str(&quote(arg));
    }
    script.push('\n');
    script
}

/// The host side of one container's agent. It holds the control FIFO only: the directory is
/// opened for each use (`open_dir`), not held, since the server's open files are what bound
/// its live sessions (docs/guide/capacity.md). Opening it by path again is as safe as
/// holding it: the path is the host's run directory, which the sandbox never sees, and the
/// sandbox cannot move the directory itself (a mount point in its view).
pub struct Agent {
    dir: PathBuf,
    ctl: File,
    uid: u32,
    gid: u32,
}

/// One request in flight.
pub struct Request {
    pub name: String,
    /// When it was sent (clock ticks since boot): what finds its process.
    pub sent: u64,
    pub dir_fd: std::sync::Arc<OwnedFd>,
    pub out: pipe::Receiver,
    pub err: pipe::Receiver,
    pub done: pipe::Receiver,
}

fn create_fifo(dir: &impl AsFd, name: &str, uid: u32, gid: u32) -> Result<(), RuntimeError> {
    nix::unistd::mkfifoat(dir, name, Mode::from_bits_truncate(0o600)).map_err(io("creating an agent FIFO"))?;
    nix::unistd::fchownat(
        dir,
        name,
        Some(Uid::from_raw(uid)),
        Some(Gid::from_raw(gid)),
        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .map_err(io("handing an agent FIFO to the container user"))
}

/// Open a FIFO we created (non-blocking; read-only, or read-write), refusing anything the
/// sandbox swapped in for it.
fn open_fifo_fd(dir: &impl AsFd, name: &str, access: OFlag) -> Result<OwnedFd, RuntimeError> {
    let fd = openat(
        dir,
        name,
        access | OFlag::O_NONBLOCK | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(io("opening an agent FIFO"))?;
    let st = fstat(&fd).map_err(io("checking an agent FIFO"))?;
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFIFO {
        return Err(RuntimeError::Refused(format!("agent file {name} is not a FIFO")));
    }
    Ok(fd)
}

fn open_fifo(dir: &impl AsFd, name: &str) -> Result<pipe::Receiver, RuntimeError> {
    pipe::Receiver::from_owned_fd(open_fifo_fd(dir, name, OFlag::O_RDONLY)?).map_err(|source| RuntimeError::Io {
        what: "opening an agent FIFO".into(),
        source,
    })
}

fn create_file(dir: &impl AsFd, name: &str, data: &[u8], uid: u32, gid: u32) -> Result<(), RuntimeError> {
    let fd = openat(
        dir,
        name,
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o600),
    )
    .map_err(io("creating an agent file"))?;
    nix::unistd::fchown(&fd, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
        .map_err(io("handing an agent file to the container user"))?;
    let mut f = File::from(fd);
    f.write_all(data).map_err(|source| RuntimeError::Io {
        what: "writing an agent file".into(),
        source,
    })
}

impl Agent {
    /// Make the directory (owned by the container user, 0700) and its control FIFO.
    pub fn create(dir: &Path, uid: u32, gid: u32) -> Result<Self, RuntimeError> {
        let ioe = |what: &str| {
            let what = what.to_string();
            move |source| RuntimeError::Io { what, source }
        };
        std::fs::create_dir_all(dir).map_err(ioe("creating the agent directory"))?;
        std::os::unix::fs::chown(dir, Some(uid), Some(gid)).map_err(ioe("chown of the agent directory"))?;
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(ioe("chmod of the agent directory"))?;
        let dir_fd = open_dir(dir)?;
        create_fifo(&dir_fd, "ctl", uid, gid)?;
        // Read-write: the open never waits, and the FIFO is usable before the agent opens it.
        // Non-blocking: see `send`.
        let ctl = openat(
            &dir_fd,
            "ctl",
            OFlag::O_RDWR | OFlag::O_NONBLOCK | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(io("opening the agent control FIFO"))?;
        Ok(Agent {
            dir: dir.to_path_buf(),
            ctl: File::from(ctl),
            uid,
            gid,
        })
    }

    /// The agent of a container made earlier (a pool member being claimed): the directory
    /// and control FIFO `create` made, checked to be what they were (a directory we own, a
    /// FIFO) and opened the same way.
    pub fn open(dir: &Path, uid: u32, gid: u32) -> Result<Self, RuntimeError> {
        let dir_fd = open_dir(dir)?;
        // Non-blocking, as `create` opens it (see `send`).
        let ctl = open_fifo_fd(&dir_fd, "ctl", OFlag::O_RDWR)?;
        Ok(Agent {
            dir: dir.to_path_buf(),
            ctl: File::from(ctl),
            uid,
            gid,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn open_dir(&self) -> Result<OwnedFd, RuntimeError> {
        open_dir(&self.dir)
    }

    /// Prepare request `n` and send it.
    pub fn send(&self, n: u64, script: &str, stdin: Option<&[u8]>) -> Result<Request, RuntimeError> {
        let name = request_name(n);
        let top = self.open_dir()?;
        nix::sys::stat::mkdirat(&top, name.as_str(), Mode::from_bits_truncate(0o700))
            .map_err(io("creating an agent request"))?;
        let dir_fd = openat(
            &top,
            name.as_str(),
            OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_RDONLY,
            Mode::empty(),
        )
        .map_err(io("opening an agent request"))?;
        nix::unistd::fchown(&dir_fd, Some(Uid::from_raw(self.uid)), Some(Gid::from_raw(self.gid)))
            .map_err(io("handing an agent request to the container user"))?;
        for fifo in ["out", "err", "done"] {
            create_fifo(&dir_fd, fifo, self.uid, self.gid)?;
        }
        let out = open_fifo(&dir_fd, "out")?;
        let err = open_fifo(&dir_fd, "err")?;
        let done = open_fifo(&dir_fd, "done")?;
        if let Some(data) = stdin {
            create_file(&dir_fd, "in", data, self.uid, self.gid)?;
        }
        // Written last: the agent only looks at a request whose cmd.sh exists.
        create_file(&dir_fd, "cmd.sh", script.as_bytes(), self.uid, self.gid)?;
        let sent = boot_ticks();
        // Never a blocking write: the sandbox can fill the FIFO (it may write it too) while
        // its agent runs a command that never ends, and a write that waited would hold one of
        // the server's threads for ever. A line is far shorter than PIPE_BUF, so it goes in
        // whole or not at all.
        let line = format!("{name}\n");
        match nix::unistd::write(&self.ctl, line.as_bytes()) {
            Ok(n) if n == line.len() => {}
            Ok(_) | Err(nix::errno::Errno::EAGAIN) => {
                // Never to run: a line of its name may still reach the agent (the sandbox
                // could drain the queue), and the stdin file is the server's to take back.
                withdraw(&dir_fd);
                return Err(RuntimeError::Busy(format!(
                    "the sandbox's agent takes no more commands: its request queue ({AGENT_MOUNT}/ctl) is full (a command that has not ended holds the agent, and the queue was filled)"
                )));
            }
            Err(e) => return Err(io("sending a request to the agent")(e)),
        }
        Ok(Request {
            name,
            sent,
            dir_fd: std::sync::Arc::new(dir_fd),
            out,
            err,
            done,
        })
    }
}

/// Take back a request the agent must not run: without `cmd.sh` the agent skips it, and its
/// stdin file goes now (two unlinks of our own names; the rest of the directory is removed
/// on the blocking pool, or with the container).
pub fn withdraw(request: &impl AsFd) {
    for name in ["cmd.sh", "in"] {
        let _ = nix::unistd::unlinkat(request, name, nix::unistd::UnlinkatFlags::NoRemoveDir);
    }
}

impl Agent {
    /// Remove a finished request's directory, whatever the sandbox made of it (any depth or
    /// width, links: see `confined::remove_tree_at`). It may take a while: call it on the
    /// blocking pool, never on an async thread.
    pub fn remove(&self, name: &str) {
        let removed = self
            .open_dir()
            .map_err(|e| e.to_string())
            .and_then(|top| crate::confined::remove_tree_at(top.as_fd(), name.as_bytes()).map_err(|e| e.to_string()));
        if let Err(e) = removed {
            tracing::debug!(request = name, error = %e, "removing an agent request (its container's teardown removes the rest)");
        }
    }

    /// Make a FIFO at the top of the directory for a long-lived tool (replacing whatever has
    /// that name) and open it: see `Sandbox::fifo`.
    pub fn fifo(&self, name: &str, end: FifoEnd) -> Result<OwnedFd, RuntimeError> {
        check_tool_name(name)?;
        // Whatever the sandbox put there goes, an empty directory too; a directory with
        // something in it is the sandbox's to remove (emptying it here would be work on an
        // async thread as large as the sandbox makes it).
        use nix::unistd::UnlinkatFlags;
        let top = self.open_dir()?;
        if let Err(nix::errno::Errno::EISDIR) = nix::unistd::unlinkat(&top, name, UnlinkatFlags::NoRemoveDir) {
            match nix::unistd::unlinkat(&top, name, UnlinkatFlags::RemoveDir) {
                Ok(()) | Err(nix::errno::Errno::ENOENT) => {}
                Err(e) => {
                    return Err(RuntimeError::Refused(format!(
                        "{name} in the sandbox's shared directory ({AGENT_MOUNT}) is a directory the sandbox made: {e}"
                    )));
                }
            }
        }
        create_fifo(&top, name, self.uid, self.gid)?;
        open_fifo_fd(&top, name, access(end))
    }

    /// Open again a FIFO `fifo` made (it may since have been replaced: it is checked again).
    pub fn reopen(&self, name: &str, end: FifoEnd) -> Result<OwnedFd, RuntimeError> {
        check_tool_name(name)?;
        open_fifo_fd(&self.open_dir()?, name, access(end))
    }

    /// Unlink a top-level entry a tool made (never a directory, never through a symlink).
    pub fn unlink(&self, name: &str) {
        if check_tool_name(name).is_ok()
            && let Ok(top) = self.open_dir()
        {
            let _ = nix::unistd::unlinkat(&top, name, nix::unistd::UnlinkatFlags::NoRemoveDir);
        }
    }
}

/// The agent directory (never through a symbolic link at its last component; the rest of
/// the path is the host's).
fn open_dir(dir: &Path) -> Result<OwnedFd, RuntimeError> {
    openat(
        nix::fcntl::AT_FDCWD,
        dir,
        OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_RDONLY,
        Mode::empty(),
    )
    .map_err(io("opening the agent directory"))
}

fn access(end: FifoEnd) -> OFlag {
    match end {
        FifoEnd::Read => OFlag::O_RDONLY,
        FifoEnd::ReadWrite => OFlag::O_RDWR,
        FifoEnd::Write => OFlag::O_WRONLY,
    }
}

/// A tool's file names stay out of the agent's own (`ctl`, `req-N`).
fn check_tool_name(name: &str) -> Result<(), RuntimeError> {
    let ok = !name.starts_with("req-")
        && !name.starts_with('.')
        && name != "ctl"
        && (1..=100).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(RuntimeError::Refused(format!("{name:?} is not a tool file name")))
    }
}

/// Clock ticks since boot, as `/proc/PID/stat` counts a process's start time.
pub fn boot_ticks() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec through the pointer, which points at `now`.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut now) };
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|hz| *hz > 0)
        .unwrap_or(100) as u64;
    let nanos = (now.tv_sec as u64).saturating_mul(1_000_000_000) + now.tv_nsec as u64;
    nanos / (1_000_000_000 / hz)
}

/// A process's start time in clock ticks since boot (field 22 of `/proc/PID/stat`); `None`
/// for one gone or a zombie.
fn start_ticks(pid: i32) -> Option<u64> {
    crate::owner::process_start_time(u32::try_from(pid).ok()?)
}

/// The host PID of the process the agent started for a request sent at `sent` (clock ticks
/// since boot, `boot_ticks`): the child of the agent (`init_host_pid`) that started first at
/// or after it (one tick of slack: the clock is coarse), lowest PID first among equals.
///
/// Facts from the kernel only. The agent forks the request's process as soon as it reads the
/// request; its other children are processes orphaned in the sandbox (reparented to its init),
/// which either started before the request or are daemons the command itself made, after it.
/// A file the sandbox wrote (a PID it claims) is never asked: a FIFO there would block the
/// host's open, and a forged PID would point the host's signal elsewhere.
pub fn request_process(init_host_pid: u32, sent: u64) -> Option<i32> {
    let since = sent.saturating_sub(1);
    let tasks = std::fs::read_dir(format!("/proc/{init_host_pid}/task")).ok()?;
    let mut best: Option<(u64, i32)> = None;
    for task in tasks.flatten() {
        let Ok(children) = std::fs::read_to_string(task.path().join("children")) else {
            continue;
        };
        for pid in children.split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
            let Some(started) = start_ticks(pid) else { continue };
            if started >= since && best.is_none_or(|b| (started, pid) < b) {
                best = Some((started, pid));
            }
        }
    }
    best.map(|(_, pid)| pid)
}

/// The host PID of a request's process: the PID its subshell wrote to `pid` in the request's
/// directory (`dir`, opened at send), read without blocking from a regular file of a few bytes,
/// and believed only when the kernel confirms it — a process of the container's cgroup, in its
/// PID namespace, whose parent is the agent, started since the request was sent — else
/// `request_process`'s guess. A forged PID can so point the host's signal only at another
/// child of the agent: the sandbox's own.
pub fn request_pid(dir: &impl AsFd, sent: u64, init_host_pid: u32, cgroup: &str) -> Option<i32> {
    let since = sent.saturating_sub(1);
    written_pid(dir)
        .and_then(|ns_pid| host_pid(cgroup, init_host_pid, ns_pid))
        .filter(|&pid| {
            parent_of(pid) == Some(init_host_pid as i32) && start_ticks(pid).is_some_and(|started| started >= since)
        })
        .or_else(|| request_process(init_host_pid, sent))
}

/// The PID a request's subshell wrote (in the container's PID namespace).
fn written_pid(dir: &impl AsFd) -> Option<i32> {
    let fd = openat(
        dir,
        "pid",
        OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .ok()?;
    let st = fstat(&fd).ok()?;
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
        return None;
    }
    let mut buf = [0u8; 16];
    let n = nix::unistd::read(&fd, &mut buf).ok()?;
    std::str::from_utf8(&buf[..n])
        .ok()?
        .trim()
        .parse()
        .ok()
        .filter(|p| *p > 1)
}

/// A process's parent (host PIDs), from /proc/PID/stat.
fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 2..].split(' ').nth(1)?.parse().ok()
}

/// Parse the status the agent wrote ("0".."255").
pub fn parse_status(text: &str) -> Option<u32> {
    text.trim().parse::<u32>().ok().filter(|s| *s <= 255)
}

/// Host PID of the process with PID `ns_pid` in the PID namespace of `init_host_pid`, looked
/// for among the processes of the container's cgroup (`cgroup`, the spec's `cgroupsPath`):
/// the kernel's list, as long as the container's pids limit at most, where a scan of all of
/// `/proc` would cost time in proportion to every process on the host.
pub fn host_pid(cgroup: &str, init_host_pid: u32, ns_pid: i32) -> Option<i32> {
    let ns = std::fs::metadata(format!("/proc/{init_host_pid}/ns/pid")).ok()?.ino();
    for pid in crate::runtime::cgroupfs::procs(cgroup) {
        if pid_in_namespace(pid) != Some(ns_pid) {
            continue;
        }
        if std::fs::metadata(format!("/proc/{pid}/ns/pid")).map(|m| m.ino()).ok() == Some(ns) {
            return Some(pid);
        }
    }
    None
}

/// Most bytes of `/proc/PID/status` read: the kernel makes it, ~1.5 KiB.
const STATUS_FILE_LIMIT: u64 = 16 << 10;

/// The PID host process `pid` has in its own (innermost) PID namespace: the last of its
/// status's `NSpid`.
pub fn pid_in_namespace(pid: i32) -> Option<i32> {
    let status = super::checkpoint::read_capped(Path::new(&format!("/proc/{pid}/status")), STATUS_FILE_LIMIT).ok()?;
    String::from_utf8_lossy(&status)
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process of the host's PID namespace (this test) is its own PID there; a PID that is
    /// no process has none.
    #[test]
    fn a_process_pid_in_its_namespace_is_read_from_its_status() {
        let me = std::process::id() as i32;
        assert_eq!(pid_in_namespace(me), Some(me));
        assert_eq!(pid_in_namespace(i32::MAX), None);
    }

    #[test]
    fn quoting_survives_every_character() {
        assert_eq!(quote("it's"), r"'it'\''s'");
        let script = command_script(
            "req-7",
            &["printf".into(), "%s|".into(), "a b".into(), "'\"$HOME`x`".into()],
            &[("K".into(), "v'v".into())],
            Some("/work space"),
        );
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(script.replace("cd '/work space' || exit 126\n", ""))
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "a b|'\"$HOME`x`|");
        assert!(script.starts_with("cd '/work space' || exit 126\nK='v'\\''v'; export K\n"));
    }

    /// The process a request started is found among the agent's children by when it started,
    /// whatever else the agent has as children (here: one started before the request).
    #[test]
    fn a_request_s_process_is_the_agent_s_first_child_after_it_was_sent() {
        use std::os::unix::process::CommandExt;
        let mut agent = std::process::Command::new("sh")
            .arg("-c")
            .arg("sleep 30 & read line; sleep 31 & sleep 32 & wait")
            .stdin(std::process::Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        let agent_pid = agent.id();
        let mut stdin = agent.stdin.take().unwrap();
        // The child running `name`, once there is one (a loaded machine forks late).
        let child = |name: &str| {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                let found = std::fs::read_to_string(format!("/proc/{agent_pid}/task/{agent_pid}/children"))
                    .unwrap_or_default()
                    .split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok())
                    .find(|p| {
                        std::fs::read_to_string(format!("/proc/{p}/cmdline"))
                            .is_ok_and(|c| c.replace('\0', " ").trim() == name)
                    });
                if let Some(pid) = found {
                    return pid;
                }
                assert!(std::time::Instant::now() < deadline, "no {name} child");
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        };
        child("sleep 30");
        // Clock ticks are coarse (10 ms): the request goes out a few ticks after the older child.
        std::thread::sleep(std::time::Duration::from_millis(50));
        let sent = boot_ticks();
        stdin.write_all(b"go\n").unwrap();
        let first = child("sleep 31");
        child("sleep 32");
        let found = request_process(agent_pid, sent);
        let after = request_process(agent_pid, boot_ticks() + 10);
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(agent.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = agent.wait();
        assert_eq!(found, Some(first));
        assert_eq!(after, None);
    }

    #[test]
    fn statuses_are_parsed_strictly() {
        assert_eq!(parse_status("0\n"), Some(0));
        assert_eq!(parse_status("137\n"), Some(137));
        assert_eq!(parse_status("999"), None);
        assert_eq!(parse_status("x"), None);
    }
}
