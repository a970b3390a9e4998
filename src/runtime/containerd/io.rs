//! stdio of containerd processes through FIFOs: created per process, read ends opened before
//! Tasks.Create/Exec (the shim opens the write ends inside the call and would hang without a
//! reader), drained continuously (a full 64 KiB pipe would block the container), split at
//! the setup marker, and capped.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::{Notify, mpsc};

use std::os::fd::AsRawFd;

use crate::containerd::{Containerd, Stdio};
use crate::runtime::output::{Capture, Captured, Utf8Chunker};
use crate::runtime::{RuntimeError, RuntimeEvent};
use crate::spec::entry::{Part, Splitter};

const READ_CHUNK: usize = 64 * 1024;
/// How long the shim may take to read what we wrote to stdin before we close it anyway
/// (a process that never reads its stdin must still get its EOF).
const STDIN_DRAIN_LIMIT: Duration = Duration::from_secs(5);

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> RuntimeError {
    let what = what.into();
    move |source| RuntimeError::Io { what, source }
}

/// The FIFOs of one process.
pub struct Fifos {
    dir: PathBuf,
    stdin: Option<PathBuf>,
    /// stdout and stderr FIFOs; none when the shim-run logger takes the output.
    output: Option<(PathBuf, PathBuf)>,
}

impl Fifos {
    /// Create `<dir>/<name>-{stdout,stderr,stdin}` as asked (mode 0600: only root reads job
    /// output).
    pub fn create(dir: &Path, name: &str, with_stdin: bool, with_output: bool) -> Result<Self, RuntimeError> {
        std::fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let make = |suffix: &str| -> Result<PathBuf, RuntimeError> {
            let path = dir.join(format!("{name}-{suffix}"));
            let _ = std::fs::remove_file(&path);
            nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600))
                .map_err(|e| io_err(format!("creating FIFO {}", path.display()))(e.into()))?;
            Ok(path)
        };
        Ok(Fifos {
            dir: dir.to_path_buf(),
            stdin: if with_stdin { Some(make("stdin")?) } else { None },
            output: if with_output {
                Some((make("stdout")?, make("stderr")?))
            } else {
                None
            },
        })
    }

    pub fn stdio(&self) -> Stdio {
        Stdio {
            stdin: self.stdin.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
            stdout: self
                .output
                .as_ref()
                .map(|o| o.0.display().to_string())
                .unwrap_or_default(),
            stderr: self
                .output
                .as_ref()
                .map(|o| o.1.display().to_string())
                .unwrap_or_default(),
        }
    }

    /// Our end of stdin, opened read-write so it never blocks and keeps the FIFO alive until
    /// the shim has opened its end.
    pub fn open_stdin(&self) -> Result<Option<pipe::Sender>, RuntimeError> {
        match &self.stdin {
            Some(path) => Ok(Some(
                pipe::OpenOptions::new()
                    .read_write(true)
                    .open_sender(path)
                    .map_err(io_err("opening stdin FIFO"))?,
            )),
            None => Ok(None),
        }
    }

    /// Open the read ends of stdout and stderr (before the shim opens the write ends).
    fn receivers(&self) -> Result<(pipe::Receiver, pipe::Receiver), RuntimeError> {
        let open = |path: &PathBuf| {
            pipe::OpenOptions::new()
                .open_receiver(path)
                .map_err(io_err("opening output FIFO"))
        };
        let (stdout, stderr) = self
            .output
            .as_ref()
            .ok_or_else(|| RuntimeError::Internal("no output FIFOs were made".into()))?;
        Ok((open(stdout)?, open(stderr)?))
    }

    pub fn remove(&self) {
        let output = self.output.as_ref();
        for p in [output.map(|o| &o.0), output.map(|o| &o.1), self.stdin.as_ref()]
            .into_iter()
            .flatten()
        {
            let _ = std::fs::remove_file(p);
        }
        // Removes the directory only once every process's FIFOs are gone.
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Write stdin in the background, then close it: the process reads EOF after the data.
/// The shim holds the FIFO open until Tasks.CloseIO, and CloseIO drops whatever the shim has
/// not read yet, so we wait until the FIFO is empty (FIONREAD) before closing.
pub fn deliver_stdin(mut stdin: pipe::Sender, data: Vec<u8>, client: Containerd, id: String, exec_id: String) {
    tokio::spawn(async move {
        if let Err(e) = stdin.write_all(&data).await {
            tracing::debug!(error = %e, "stdin not fully delivered");
        }
        let start = Instant::now();
        while unread(&stdin) > 0 && start.elapsed() < STDIN_DRAIN_LIMIT {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        drop(stdin);
        if let Err(e) = client.close_stdin(&id, &exec_id).await {
            tracing::debug!(error = %e, "closing stdin failed");
        }
    });
}

/// Bytes written to a FIFO that no reader has taken yet.
fn unread(fd: &impl AsRawFd) -> i32 {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int through the pointer, which points at `n`; the fd is
    // open for the duration of the call (borrowed from its owner).
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::FIONREAD, &mut n) };
    if rc < 0 { 0 } else { n }
}

/// One stream's output, split into setup and command parts.
#[derive(Debug, Default)]
pub struct StreamOut {
    pub setup: Captured,
    pub command: Captured,
    pub setup_status: Option<i32>,
    pub setup_at: Option<Instant>,
}

struct Shared {
    splitter: Splitter,
    setup: Option<Capture>,
    command: Option<Capture>,
    setup_at: Option<Instant>,
    /// After a live container's setup: keep draining, store nothing.
    discard: bool,
}

/// A forwarding reader's state, shared with `finish`.
#[derive(Default)]
struct Forwarding {
    progress: crate::runtime::output::PumpProgress,
    /// Detached (`finish` gave up on the stream's end): it drops its sender at once and
    /// drains on without sending, so that nothing follows the exit event and the consumer's
    /// channel closes, while a background process that holds the stream keeps a reader.
    detached: tokio_util::sync::CancellationToken,
}

/// A reader task and, when it captures, what it captured; when it forwards, its state.
type PumpTask = (
    tokio::task::JoinHandle<()>,
    Option<Arc<Mutex<Shared>>>,
    Option<Arc<Forwarding>>,
);

/// Reader tasks for stdout and stderr of one process.
pub struct OutputPump {
    tasks: Vec<PumpTask>,
    marker: Arc<Notify>,
}

async fn read_loop(mut rx: pipe::Receiver, mut on_chunk: impl FnMut(&[u8])) {
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        match rx.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => on_chunk(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!(error = %e, "reading process output failed");
                break;
            }
        }
    }
}

/// Read one stream and send it on as events, one read at a time: the next read waits until
/// the consumer took the last event.
async fn forward_loop(mut rx: pipe::Receiver, is_stdout: bool, tx: mpsc::Sender<RuntimeEvent>, state: Arc<Forwarding>) {
    let event = |data: String| {
        if is_stdout {
            RuntimeEvent::Stdout { data }
        } else {
            RuntimeEvent::Stderr { data }
        }
    };
    let mut tx = Some(tx);
    let mut decoder = Utf8Chunker::default();
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        let read = tokio::select! {
            biased;
            () = state.detached.cancelled(), if tx.is_some() => {
                tx = None;
                continue;
            }
            read = rx.read(&mut buf) => read,
        };
        let n = match read {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!(error = %e, "reading process output failed");
                break;
            }
        };
        let Some(sender) = tx.as_ref().filter(|_| !state.detached.is_cancelled()) else {
            // Detached: drained, discarded.
            continue;
        };
        let text = decoder.decode(&buf[..n]);
        if !text.is_empty() {
            let len = text.len();
            state.progress.set_sending(true);
            // Detached while waiting for the consumer: the chunk is discarded, never sent
            // after the exit event.
            let sent = tokio::select! {
                biased;
                () = state.detached.cancelled() => {
                    state.progress.set_sending(false);
                    tx = None;
                    continue;
                }
                sent = sender.send(event(text)) => sent,
            };
            state.progress.set_sending(false);
            if sent.is_err() {
                // Nobody listens any more: dropping the read end tells the writer (EPIPE).
                return;
            }
            state.progress.add_forwarded(len);
        }
    }
    let rest = decoder.flush();
    if let Some(sender) = tx.filter(|_| !rest.is_empty() && !state.detached.is_cancelled()) {
        let _ = sender.send(event(rest)).await;
    }
}

impl OutputPump {
    /// Stop reading, dropping what was read: for output nobody will take (its writer may
    /// never come: a FIFO reader opened before any writer sees no hang-up until one has).
    pub fn abort(self) {
        for (task, _, _) in self.tasks {
            task.abort();
        }
    }

    /// Capture both streams (split at the setup marker when `expect_marker`).
    pub fn start(fifos: &Fifos, expect_marker: bool, limit: usize) -> Result<Self, RuntimeError> {
        let (out, err) = fifos.receivers()?;
        Ok(Self::capture(out, err, expect_marker, limit))
    }

    /// Capture two already-open streams.
    pub fn capture(out: pipe::Receiver, err: pipe::Receiver, expect_marker: bool, limit: usize) -> Self {
        let marker = Arc::new(Notify::new());
        let mut tasks = Vec::new();
        for rx in [out, err] {
            let shared = Arc::new(Mutex::new(Shared {
                splitter: Splitter::new(expect_marker),
                setup: Some(Capture::new(limit)),
                command: Some(Capture::new(limit)),
                setup_at: None,
                discard: false,
            }));
            let state = shared.clone();
            let notify = marker.clone();
            let task = tokio::spawn(async move {
                read_loop(rx, |chunk| {
                    let mut guard = state.lock().expect("pump lock");
                    let s = &mut *guard;
                    let seen_before = s.splitter.marker_seen();
                    let (setup, command, discard) = (&mut s.setup, &mut s.command, s.discard);
                    s.splitter.feed(chunk, &mut |part, bytes| {
                        if discard {
                            return;
                        }
                        match part {
                            Part::Setup => setup.as_mut().map(|c| c.push(bytes)),
                            Part::Command => command.as_mut().map(|c| c.push(bytes)),
                        };
                    });
                    if !seen_before && s.splitter.marker_seen() {
                        s.setup_at = Some(Instant::now());
                        notify.notify_waiters();
                    }
                })
                .await;
                let mut guard = state.lock().expect("pump lock");
                let s = &mut *guard;
                let setup = &mut s.setup;
                s.splitter.finish(&mut |_, bytes| {
                    if let Some(c) = setup.as_mut() {
                        c.push(bytes)
                    }
                });
                notify.notify_waiters();
            });
            tasks.push((task, Some(shared), None));
        }
        OutputPump { tasks, marker }
    }

    /// Forward both streams as events (no split, no cap: the consumer decides). Nothing is
    /// buffered beyond the consumer's channel: a stream is read only while the consumer takes
    /// events, so a slow consumer (an HTTP client reading slowly) fills the pipe and blocks the
    /// sandbox's writes, as a pipe to a slow reader would. When the consumer is gone the read
    /// end is closed: the writer gets EPIPE.
    pub fn stream(fifos: &Fifos, tx: mpsc::Sender<RuntimeEvent>) -> Result<Self, RuntimeError> {
        let (out, err) = fifos.receivers()?;
        Ok(Self::forward(out, err, tx))
    }

    /// Forward two already-open streams as events (see `stream`).
    pub fn forward(out: pipe::Receiver, err: pipe::Receiver, tx: mpsc::Sender<RuntimeEvent>) -> Self {
        let mut tasks = Vec::new();
        for (rx, is_stdout) in [(out, true), (err, false)] {
            let state = Arc::new(Forwarding::default());
            tasks.push((
                tokio::spawn(forward_loop(rx, is_stdout, tx.clone(), state.clone())),
                None,
                Some(state),
            ));
        }
        OutputPump {
            tasks,
            marker: Arc::new(Notify::new()),
        }
    }

    fn shared(&self, i: usize) -> Option<&Arc<Mutex<Shared>>> {
        self.tasks.get(i).and_then(|(_, s, _)| s.as_ref())
    }

    /// Wait until both streams passed the setup marker (or ended); the status stdout carried.
    pub async fn setup_done(&mut self) -> i32 {
        loop {
            let notified = self.marker.notified();
            let done = |i: usize| {
                let ended = self.tasks[i].0.is_finished();
                self.shared(i)
                    .is_none_or(|s| s.lock().expect("pump lock").splitter.marker_seen() || ended)
            };
            if done(0) && done(1) {
                break;
            }
            notified.await;
        }
        self.shared(0)
            .and_then(|s| s.lock().expect("pump lock").splitter.setup_status())
            .unwrap_or(-1)
    }

    /// Whether stdout carried the setup marker (it says setup's status).
    pub fn setup_marker_seen(&self) -> bool {
        self.shared(0)
            .is_some_and(|s| s.lock().expect("pump lock").splitter.marker_seen())
    }

    /// Take the setup output captured so far (stdout, stderr).
    pub fn setup_output(&self) -> (Captured, Captured) {
        let take = |i: usize| {
            self.shared(i)
                .and_then(|s| s.lock().expect("pump lock").setup.take())
                .map(Capture::finish)
                .unwrap_or_default()
        };
        (take(0), take(1))
    }

    /// Keep draining but store nothing more (a live container's init after setup).
    pub fn discard_rest(self) {
        for (_, shared, _) in &self.tasks {
            if let Some(s) = shared {
                let mut s = s.lock().expect("pump lock");
                s.discard = true;
                s.command = None;
            }
        }
        // The tasks run on until the init's FIFOs close at teardown.
    }

    /// Wait for both streams to reach EOF (bounded) and return what they carried. When
    /// `detach`, a stream still open at the limit (a background process of a live
    /// container's command holds it) keeps being drained, discarded, instead of being cut:
    /// a writer to a FIFO without a reader would die of SIGPIPE.
    pub async fn finish(self, limit: Duration, detach: bool) -> (StreamOut, StreamOut) {
        let mut outs = Vec::new();
        for (mut task, shared, forwarding) in self.tasks {
            // A forwarder still handing output to a slow consumer is not held by a background
            // process: it is waited for while it makes progress, so that every byte comes
            // before the exit event (up to `AFTER_EXIT_BYTES`: past that, something else
            // floods the stream).
            let progress = forwarding.as_ref().map(|f| &f.progress);
            let ended = crate::runtime::output::wait_for_pump(&mut task, limit, progress)
                .await
                .is_some();
            if !ended {
                if detach {
                    if let Some(s) = &shared {
                        s.lock().expect("pump lock").discard = true;
                    }
                    if let Some(f) = &forwarding {
                        f.detached.cancel();
                    }
                } else {
                    tracing::warn!("process output still open {limit:?} after exit; a process holds it");
                    task.abort();
                }
            }
            let out = match shared {
                Some(s) => {
                    let mut s = s.lock().expect("pump lock");
                    StreamOut {
                        setup: s.setup.take().map(Capture::finish).unwrap_or_default(),
                        command: s.command.take().map(Capture::finish).unwrap_or_default(),
                        setup_status: s.splitter.setup_status(),
                        setup_at: s.setup_at,
                    }
                }
                None => StreamOut::default(),
            };
            outs.push(out);
        }
        let err = outs.pop().unwrap_or_default();
        let out = outs.pop().unwrap_or_default();
        (out, err)
    }
}
