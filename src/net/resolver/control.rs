//! How runner processes talk to the host's resolver: a unix socket in the network directory
//! (root only, 0600), one JSON line per message and per reply. The policies the resolver
//! answers by live in its memory, changed by these messages; the policy files are only what a
//! restarted resolver loads.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::Ipv4Addr;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Policy, ResolverError};
use crate::config::NetPaths;

/// How long a message may take (the resolver answers from memory, or after one netlink batch).
const REPLY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a starting resolver may take to listen.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest message line read (a policy with its domains).
pub const MAX_LINE: u64 = 1 << 20;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Message {
    Attach(Policy),
    Detach { ip: Ipv4Addr, id: String },
    Patch(Policy),
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    pub ok: bool,
    /// Detach and patch: whether every domain element of the container was the resolver's
    /// to change (else the caller removes what the wall has of it).
    #[serde(default)]
    pub known: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// What the network layer asks of the resolver.
pub trait Control: Send + Sync {
    /// The running resolver's DNS port, starting `exe resolver` when none runs (then `true`).
    /// Under the network lock, so two attaches never start two.
    fn ensure(&self, exe: &Path) -> Result<(u16, bool), ResolverError>;
    fn attach(&self, policy: &Policy) -> Result<(), ResolverError>;
    /// `Ok(false)`: no resolver runs, or it did not know every element of the container.
    fn detach(&self, ip: Ipv4Addr, id: &str) -> Result<bool, ResolverError>;
    fn patch(&self, policy: &Policy) -> Result<bool, ResolverError>;
    /// Stop the resolver (whether one ran).
    fn stop(&self) -> Result<bool, ResolverError>;
}

/// The real resolver, through its files and socket.
pub struct Client {
    dir: PathBuf,
    lock: PathBuf,
    pid: PathBuf,
    port: PathBuf,
    socket: PathBuf,
}

impl Client {
    pub fn new(paths: &NetPaths) -> Self {
        Client {
            dir: paths.dir.clone(),
            lock: paths.resolver_lock(),
            pid: paths.resolver_pid(),
            port: paths.resolver_port(),
            socket: paths.resolver_socket(),
        }
    }

    /// Whether a resolver holds its lock.
    fn running(&self) -> bool {
        let Ok(f) = std::fs::OpenOptions::new().write(true).open(&self.lock) else {
            return false;
        };
        match nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(free) => {
                drop(free);
                false
            }
            Err(_) => true,
        }
    }

    fn send(&self, msg: &Message) -> Result<Reply, ResolverError> {
        let fail = |e: std::io::Error| ResolverError::Control {
            socket: self.socket.display().to_string(),
            source: e,
        };
        let mut s = UnixStream::connect(&self.socket).map_err(fail)?;
        s.set_read_timeout(Some(REPLY_TIMEOUT)).map_err(fail)?;
        s.set_write_timeout(Some(REPLY_TIMEOUT)).map_err(fail)?;
        let mut line = serde_json::to_vec(msg).map_err(|e| fail(std::io::Error::other(e)))?;
        line.push(b'\n');
        s.write_all(&line).map_err(fail)?;
        let mut reply = String::new();
        BufReader::new((&s).take(MAX_LINE))
            .read_line(&mut reply)
            .map_err(fail)?;
        let reply: Reply = serde_json::from_str(&reply).map_err(|e| fail(std::io::Error::other(e)))?;
        if !reply.ok {
            return Err(ResolverError::Refused(reply.error.unwrap_or_default()));
        }
        Ok(reply)
    }
}

impl Control for Client {
    fn ensure(&self, exe: &Path) -> Result<(u16, bool), ResolverError> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| ResolverError::Start(format!("creating {}: {e}", self.dir.display())))?;
        if self.running() {
            // It wrote its port before whoever started it let go of the network lock.
            return std::fs::read_to_string(&self.port)
                .ok()
                .and_then(|p| p.trim().parse().ok())
                .map(|port| (port, false))
                .ok_or_else(|| {
                    ResolverError::Start(format!("a resolver holds {} but left no port", self.lock.display()))
                });
        }
        let mut cmd = Command::new(exe);
        cmd.arg("--net-dir")
            .arg(&self.dir)
            .arg("resolver")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        // Its own session: a Ctrl-C of the runner that started it is not for it.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        // It outlives whoever started it: it must not hold that process's descriptors (a CI
        // script's lock, a build's jobserver pipe, a harness's sockets — found holding a test
        // suite's flock). Everything above stderr is marked close-on-exec after the fork (not
        // closed: std reports a failed exec through such a descriptor). Kernels before 5.11
        // have no close_range: there it inherits what it did before.
        // SAFETY: only an async-signal-safe system call between fork and exec.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, libc::CLOSE_RANGE_CLOEXEC);
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| ResolverError::Start(format!("starting {} resolver: {e}", exe.display())))?;
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout.take(256)).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(START_TIMEOUT).unwrap_or_default();
        // Reaped here while this process lives (a zombie would hold nothing, but looks alive).
        std::thread::spawn(move || child.wait());
        let mut words = line.split_whitespace();
        match (words.next(), words.next().and_then(|p| p.parse::<u16>().ok())) {
            (Some("ready"), Some(port)) => Ok((port, true)),
            (Some("running"), Some(port)) => Ok((port, false)),
            _ => Err(ResolverError::Start(format!(
                "the resolver did not start ({:?}; see {}/resolver.log)",
                line.trim(),
                self.dir.display()
            ))),
        }
    }

    fn attach(&self, policy: &Policy) -> Result<(), ResolverError> {
        self.send(&Message::Attach(policy.clone())).map(drop)
    }

    fn detach(&self, ip: Ipv4Addr, id: &str) -> Result<bool, ResolverError> {
        if !self.running() {
            return Ok(false);
        }
        self.send(&Message::Detach { ip, id: id.into() }).map(|r| r.known)
    }

    fn patch(&self, policy: &Policy) -> Result<bool, ResolverError> {
        if !self.running() {
            return Ok(false);
        }
        self.send(&Message::Patch(policy.clone())).map(|r| r.known)
    }

    fn stop(&self) -> Result<bool, ResolverError> {
        if !self.running() {
            return Ok(false);
        }
        // The lock is held, so the PID the resolver wrote is the resolver.
        let Some(pid) = std::fs::read_to_string(&self.pid)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        else {
            return Ok(false);
        };
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM);
        // Gone before the caller lets go of the network lock: the next attach starts a new one.
        for _ in 0..100 {
            if !self.running() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        for f in [&self.pid, &self.port, &self.socket] {
            let _ = std::fs::remove_file(f);
        }
        Ok(true)
    }
}

/// A resolver in memory (tests): what it was told.
#[derive(Debug, Default)]
pub struct Fake {
    pub messages: Mutex<Vec<Message>>,
    pub running: Mutex<bool>,
}

impl Control for Fake {
    fn ensure(&self, _exe: &Path) -> Result<(u16, bool), ResolverError> {
        let mut running = self.running.lock().expect("fake resolver");
        let started = !*running;
        *running = true;
        Ok((40053, started))
    }

    fn attach(&self, policy: &Policy) -> Result<(), ResolverError> {
        self.messages
            .lock()
            .expect("fake resolver")
            .push(Message::Attach(policy.clone()));
        Ok(())
    }

    fn detach(&self, ip: Ipv4Addr, id: &str) -> Result<bool, ResolverError> {
        self.messages
            .lock()
            .expect("fake resolver")
            .push(Message::Detach { ip, id: id.into() });
        Ok(*self.running.lock().expect("fake resolver"))
    }

    fn patch(&self, policy: &Policy) -> Result<bool, ResolverError> {
        self.messages
            .lock()
            .expect("fake resolver")
            .push(Message::Patch(policy.clone()));
        Ok(*self.running.lock().expect("fake resolver"))
    }

    fn stop(&self) -> Result<bool, ResolverError> {
        let mut running = self.running.lock().expect("fake resolver");
        let was = *running;
        *running = false;
        Ok(was)
    }
}
