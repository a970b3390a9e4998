//! Terminals: a command on a pseudo-terminal in a sandbox, its bytes both ways, its window
//! size, signals to its foreground process group, its exit.
//!
//! The backends differ in who holds the terminal's master: in a container runc allocates the
//! terminal inside the container (its own devpts instance) and the shim holds the master,
//! copying it to and from two FIFOs (see `containerd::pty`); on the host this process holds it
//! (`spawn_host`). Either way [`Pty`] is what the layers above see, and it bounds what the host
//! keeps for a terminal: output is read one chunk at a time into a channel of
//! [`OUTPUT_CHUNKS`] chunks, and the reader waits while the channel is full, so a client that
//! stops reading stops the terminal's program (its writes block), never grows our memory.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::{mpsc, watch};

use super::RuntimeError;
use super::tree::ProcessTree;

/// Bytes read from a terminal at a time.
pub const READ_CHUNK: usize = 16 * 1024;
/// Chunks of output held for a reader that is behind: with `READ_CHUNK`, 128 KiB a terminal.
pub const OUTPUT_CHUNKS: usize = 8;
/// The largest window accepted (rows and columns each).
pub const MAX_DIMENSION: u16 = 1000;
/// What a terminal's programs get as `TERM` unless the request names one.
pub const DEFAULT_TERM: &str = "xterm-256color";
/// After a hang-up, how long the terminal's program gets before it is killed.
pub const HANGUP_GRACE: Duration = Duration::from_secs(2);

/// A terminal's window size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PtySize {
    pub rows: u16,
    pub cols: u16,
}

impl Default for PtySize {
    fn default() -> Self {
        PtySize { rows: 24, cols: 80 }
    }
}

impl PtySize {
    /// A size of 1..=`MAX_DIMENSION` rows and columns, or why not.
    pub fn checked(rows: u16, cols: u16) -> Result<Self, String> {
        for (name, n) in [("rows", rows), ("cols", cols)] {
            if n == 0 || n > MAX_DIMENSION {
                return Err(format!("{name} must be 1 to {MAX_DIMENSION}, got {n}"));
            }
        }
        Ok(PtySize { rows, cols })
    }

    fn winsize(self) -> libc::winsize {
        libc::winsize {
            ws_row: self.rows,
            ws_col: self.cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        }
    }
}

/// A command to start on a new terminal.
#[derive(Clone, Debug)]
pub struct PtyRequest {
    pub argv: Vec<String>,
    /// Added to the sandbox's environment (`TERM` defaults to [`DEFAULT_TERM`]).
    pub env: BTreeMap<String, String>,
    /// Relative to the sandbox's working directory.
    pub cwd: Option<String>,
    pub size: PtySize,
}

/// How a terminal's command ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PtyExit {
    /// The exit status (a container reports a signal's death as 128 + the signal here).
    pub exit_code: Option<i32>,
    /// The signal that ended it, where the backend tells.
    pub signal: Option<i32>,
}

/// What a backend does for a terminal besides moving bytes.
#[async_trait]
pub trait PtyControl: Send + Sync {
    async fn resize(&self, size: PtySize) -> Result<(), RuntimeError>;
    /// Signal the terminal's foreground process group (as its line discipline would for
    /// Ctrl-C); whether a process was signalled.
    fn signal_foreground(&self, signal: Signal) -> bool;
    /// The terminal was closed (its input ended: the program got its hang-up): make sure the
    /// program ends, killing it after [`HANGUP_GRACE`].
    async fn hangup(&self);
}

type Input = Box<dyn AsyncWrite + Send + Unpin>;

/// A command running on a terminal.
pub struct Pty {
    output: tokio::sync::Mutex<mpsc::Receiver<Bytes>>,
    /// `None` once closed.
    input: tokio::sync::Mutex<Option<Input>>,
    control: Box<dyn PtyControl>,
    exit: watch::Receiver<Option<PtyExit>>,
    size: Mutex<PtySize>,
}

impl Pty {
    /// A terminal from its backend's parts: `output` is read until EOF by a task of its own,
    /// `exit` is set once when the command ends.
    pub fn new(
        output: impl AsyncRead + Send + Unpin + 'static,
        input: impl AsyncWrite + Send + Unpin + 'static,
        control: Box<dyn PtyControl>,
        exit: watch::Receiver<Option<PtyExit>>,
        size: PtySize,
    ) -> Pty {
        let (tx, rx) = mpsc::channel(OUTPUT_CHUNKS);
        tokio::spawn(pump(output, tx));
        Pty {
            output: tokio::sync::Mutex::new(rx),
            input: tokio::sync::Mutex::new(Some(Box::new(input))),
            control,
            exit,
            size: Mutex::new(size),
        }
    }

    /// The next output, as it comes; `None` once the terminal has no more (its program and
    /// everything that held it open are gone). One reader at a time.
    pub async fn read(&self) -> Option<Bytes> {
        self.output.lock().await.recv().await
    }

    /// Keys in. Waits while the terminal's input is full (its program is not reading).
    pub async fn write(&self, data: &[u8]) -> Result<(), RuntimeError> {
        let mut input = self.input.lock().await;
        let writer = input
            .as_mut()
            .ok_or_else(|| RuntimeError::Refused("the terminal is closed".into()))?;
        let io = |source| RuntimeError::Io {
            what: "writing to the terminal".into(),
            source,
        };
        writer.write_all(data).await.map_err(io)?;
        writer.flush().await.map_err(io)
    }

    pub async fn resize(&self, size: PtySize) -> Result<(), RuntimeError> {
        self.control.resize(size).await?;
        *self.size.lock().expect("pty size lock") = size;
        Ok(())
    }

    pub fn size(&self) -> PtySize {
        *self.size.lock().expect("pty size lock")
    }

    /// Signal the foreground process group; whether a process was signalled.
    pub fn signal(&self, signal: Signal) -> bool {
        self.exit().is_none() && self.control.signal_foreground(signal)
    }

    /// How the command ended, once it has.
    pub fn exit(&self) -> Option<PtyExit> {
        *self.exit.borrow()
    }

    /// Wait for the command to end.
    pub async fn wait(&self) -> PtyExit {
        let mut exit = self.exit.clone();
        match exit.wait_for(Option::is_some).await {
            Ok(e) => e.unwrap_or_default(),
            // The backend's waiter is gone without an answer: nothing will end it later.
            Err(_) => PtyExit::default(),
        }
    }

    /// Hang up: the input ends (the program gets SIGHUP) and it is killed after a grace.
    pub async fn close(&self) {
        let taken = self.input.lock().await.take();
        if let Some(mut input) = taken {
            let _ = input.shutdown().await;
        }
        if self.exit().is_none() {
            self.control.hangup().await;
        }
    }
}

/// Read a terminal's output into the channel, one chunk at a time, until EOF or until nobody
/// holds the terminal any more.
async fn pump(mut output: impl AsyncRead + Unpin, tx: mpsc::Sender<Bytes>) {
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        let n = tokio::select! {
            n = output.read(&mut buf) => n,
            () = tx.closed() => return,
        };
        match n {
            Ok(0) => return,
            Ok(n) => {
                if tx.send(Bytes::copy_from_slice(&buf[..n])).await.is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::debug!(error = %e, "reading a terminal");
                return;
            }
        }
    }
}

// ---- the host's terminals

/// A terminal master held by this process, non-blocking, registered with the reactor. A read
/// after every slave descriptor closed fails with EIO: that is the terminal's EOF.
struct Master(AsyncFd<OwnedFd>);

impl AsyncRead for Master {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        loop {
            let mut guard = ready!(self.0.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|fd| match nix::unistd::read(fd.get_ref(), unfilled) {
                Ok(n) => Ok(n),
                Err(nix::errno::Errno::EIO) => Ok(0),
                Err(e) => Err(std::io::Error::from(e)),
            }) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for Master {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        loop {
            let mut guard = ready!(self.0.poll_write_ready(cx))?;
            match guard.try_io(|fd| nix::unistd::write(fd.get_ref(), data).map_err(std::io::Error::from)) {
                Ok(result) => return Poll::Ready(result),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Set a terminal's window size (the kernel sends SIGWINCH to its foreground group).
fn set_winsize(fd: &impl AsRawFd, size: PtySize) -> std::io::Result<()> {
    let ws = size.winsize();
    // SAFETY: TIOCSWINSZ reads one winsize through the pointer, which points at `ws`; the fd
    // is open for the duration of the call (borrowed from its owner).
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

struct HostControl {
    /// The master, for ioctls (its own descriptor: the reactor's one is split into halves).
    master: OwnedFd,
    tree: Arc<ProcessTree>,
    exit: watch::Receiver<Option<PtyExit>>,
}

#[async_trait]
impl PtyControl for HostControl {
    async fn resize(&self, size: PtySize) -> Result<(), RuntimeError> {
        set_winsize(&self.master, size).map_err(|source| RuntimeError::Io {
            what: "resizing the terminal".into(),
            source,
        })
    }

    fn signal_foreground(&self, signal: Signal) -> bool {
        match nix::unistd::tcgetpgrp(&self.master) {
            Ok(pgrp) if pgrp.as_raw() > 0 => nix::sys::signal::killpg(pgrp, signal).is_ok(),
            _ => false,
        }
    }

    async fn hangup(&self) {
        // The master stays open while we hold it: the hang-up is ours to send.
        self.tree.signal(Signal::SIGHUP);
        let mut exit = self.exit.clone();
        if tokio::time::timeout(HANGUP_GRACE, exit.wait_for(Option::is_some))
            .await
            .is_err()
        {
            self.tree.kill_until_empty(HANGUP_GRACE).await;
        }
    }
}

fn cloexec(fd: &impl AsFd) -> nix::Result<()> {
    use nix::fcntl::{FcntlArg, FdFlag, fcntl};
    fcntl(fd, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC)).map(|_| ())
}

/// Start `request` on a new host terminal: the command leads a new session whose controlling
/// terminal it is, in `tree` (a cgroup, else its process group); `ids` are switched to in the
/// child. What it leaves behind is killed when it exits, as the host backend does for every
/// command.
pub fn spawn_host(
    request: &PtyRequest,
    workdir: &Path,
    env: &BTreeMap<String, String>,
    ids: Option<(u32, u32)>,
    use_cgroup: bool,
) -> Result<Pty, RuntimeError> {
    let program = request.argv.first().ok_or(RuntimeError::EmptyCommand)?;
    let io = |what: &'static str| {
        move |e: nix::Error| RuntimeError::Io {
            what: what.into(),
            source: e.into(),
        }
    };
    let ws = request.size.winsize();
    let pair = nix::pty::openpty(&ws, None).map_err(io("opening a terminal"))?;
    cloexec(&pair.master).map_err(io("opening a terminal"))?;
    cloexec(&pair.slave).map_err(io("opening a terminal"))?;
    let stdio = |fd: &OwnedFd| -> Result<std::process::Stdio, RuntimeError> {
        Ok(fd
            .try_clone()
            .map_err(|source| RuntimeError::Io {
                what: "opening a terminal".into(),
                source,
            })?
            .into())
    };
    let mut tree = ProcessTree::prepare(use_cgroup);
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(&request.argv[1..])
        .current_dir(match &request.cwd {
            Some(cwd) => workdir.join(cwd),
            None => workdir.to_path_buf(),
        })
        .env_clear()
        .envs(env)
        .env("TERM", DEFAULT_TERM)
        .envs(&request.env)
        .stdin(stdio(&pair.slave)?)
        .stdout(stdio(&pair.slave)?)
        .stderr(stdio(&pair.slave)?);
    let procs_fd = tree.procs_fd();
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe system calls (setsid, ioctl, write, setgroups, setgid, setuid); it
    // allocates nothing and touches no lock.
    unsafe {
        cmd.pre_exec(move || {
            // A new session, whose controlling terminal is the one on stdin: Ctrl-C there
            // reaches the command's foreground group and nothing of ours.
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(fd) = procs_fd
                && libc::write(fd, b"0".as_ptr().cast(), 1) < 0
            {
                return Err(std::io::Error::last_os_error());
            }
            if let Some((uid, gid)) = ids
                && (libc::setgroups(0, std::ptr::null()) < 0 || libc::setgid(gid) < 0 || libc::setuid(uid) < 0)
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|source| RuntimeError::Start {
        program: program.clone(),
        source,
    })?;
    // Ours closes now: the terminal's EOF comes when the last process holding it is gone.
    drop(pair.slave);
    tree.started(child.id().unwrap_or_default());
    let tree = Arc::new(tree);
    let (exit_tx, exit_rx) = watch::channel(None);
    {
        let tree = tree.clone();
        tokio::spawn(async move {
            use std::os::unix::process::ExitStatusExt;
            let exit = match child.wait().await {
                Ok(status) => PtyExit {
                    exit_code: status.code(),
                    signal: status.signal(),
                },
                Err(e) => {
                    tracing::warn!(error = %e, "waiting for a terminal's command");
                    PtyExit::default()
                }
            };
            // What it left running goes with it, so the terminal reaches EOF.
            tree.kill_until_empty(HANGUP_GRACE).await;
            let _ = exit_tx.send(Some(exit));
        });
    }
    let control_fd = pair.master.try_clone().map_err(|source| RuntimeError::Io {
        what: "opening a terminal".into(),
        source,
    })?;
    nix::fcntl::fcntl(
        &pair.master,
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_RDWR | nix::fcntl::OFlag::O_NONBLOCK),
    )
    .map_err(io("opening a terminal"))?;
    // SAFETY: an OwnedFd is an open descriptor that `as_raw_fd` returns unchanged for its
    // life, and only the AsyncFd (which owns it) closes it.
    let registered = unsafe { AsyncFd::register(pair.master) }.map_err(|e| RuntimeError::Io {
        what: "registering a terminal".into(),
        source: e.into_parts().1,
    })?;
    let master = Master(registered);
    let (reader, writer) = tokio::io::split(master);
    let control = HostControl {
        master: control_fd,
        tree,
        exit: exit_rx.clone(),
    };
    Ok(Pty::new(reader, writer, Box::new(control), exit_rx, request.size))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(argv: &[&str]) -> PtyRequest {
        PtyRequest {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            env: BTreeMap::from([("PATH".to_string(), "/usr/bin:/bin".to_string())]),
            cwd: None,
            size: PtySize { rows: 30, cols: 100 },
        }
    }

    /// Everything the terminal says until `needle` appears (or it ends, or 30 s pass).
    async fn read_until(pty: &Pty, needle: &str) -> String {
        let mut seen = String::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !seen.contains(needle) {
            match tokio::time::timeout_at(deadline, pty.read()).await {
                Ok(Some(chunk)) => seen.push_str(&String::from_utf8_lossy(&chunk)),
                Ok(None) | Err(_) => break,
            }
        }
        seen
    }

    #[tokio::test]
    async fn a_host_terminal_has_its_size_echoes_and_interrupts() {
        let dir = tempfile::tempdir().unwrap();
        let pty = spawn_host(&request(&["sh"]), dir.path(), &BTreeMap::new(), None, false).unwrap();
        pty.write(b"stty size; tty\n").await.unwrap();
        let seen = read_until(&pty, "/dev/pts/").await;
        assert!(seen.contains("30 100"), "{seen:?}");
        pty.resize(PtySize { rows: 12, cols: 34 }).await.unwrap();
        pty.write(b"stty size\n").await.unwrap();
        let seen = read_until(&pty, "12 34").await;
        assert!(seen.contains("12 34"), "{seen:?}");
        // Ctrl-C through the line discipline ends the foreground `sleep`, not the shell (which
        // drops the rest of a list whose command SIGINT killed, as interactive shells do: two
        // lines).
        pty.write(b"sleep 30\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        pty.write(b"\x03").await.unwrap();
        pty.write(b"echo after-$?\n").await.unwrap();
        let seen = read_until(&pty, "after-130").await;
        assert!(seen.contains("after-130"), "{seen:?}");
        pty.write(b"exit 7\n").await.unwrap();
        assert_eq!(pty.wait().await.exit_code, Some(7));
        while pty.read().await.is_some() {}
    }

    #[tokio::test]
    async fn closing_a_host_terminal_hangs_its_program_up() {
        let dir = tempfile::tempdir().unwrap();
        let pty = spawn_host(&request(&["sleep", "60"]), dir.path(), &BTreeMap::new(), None, false).unwrap();
        pty.close().await;
        let exit = pty.wait().await;
        assert_eq!(exit.signal, Some(libc::SIGHUP), "{exit:?}");
        assert!(pty.write(b"x").await.is_err());
    }

    #[tokio::test]
    async fn a_foreground_signal_reaches_the_group() {
        let dir = tempfile::tempdir().unwrap();
        let pty = spawn_host(&request(&["sleep", "60"]), dir.path(), &BTreeMap::new(), None, false).unwrap();
        // The foreground group exists once the child has run setsid; until then, no target.
        while !pty.signal(Signal::SIGTERM) {
            tokio::task::yield_now().await;
        }
        assert_eq!(pty.wait().await.signal, Some(libc::SIGTERM));
    }

    #[test]
    fn sizes_are_checked() {
        assert!(PtySize::checked(0, 80).is_err());
        assert!(PtySize::checked(24, MAX_DIMENSION + 1).is_err());
        assert_eq!(PtySize::checked(24, 80), Ok(PtySize { rows: 24, cols: 80 }));
    }
}
