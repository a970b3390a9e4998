//! `runner serve`'s hand-off socket: foreground `runner apply`s of this state dir run here
//! (`service::handoff` has the protocol). The socket is the server user's alone (mode 0600, and
//! each peer's uid is checked), so a request is the server's own user asking; still, every
//! read is bounded (a 4 MiB request line, the manifest's size limit, 10 s to send them) and at
//! most `MAX_IN_FLIGHT` applies are taken at once, so no client can hold the server.

use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use crate::manifest::MAX_MANIFEST_BYTES;
use crate::service::Context;
use crate::service::handoff::{self, Control, Reply, Request};

/// Applies run at once; past it a CLI is told to run its jobs itself.
const MAX_IN_FLIGHT: u32 = 256;
/// The request line (the manifest text follows it, bounded on its own). It carries the CLI's
/// environment (`Caller`), which a CI runner can make hundreds of KiB.
const MAX_REQUEST_LINE: u64 = 4 * 1024 * 1024;
/// A control line (`{"cancel": ...}`).
const MAX_CONTROL_LINE: u64 = 1024;
/// To send the request and its text: the CLI has both in memory before it connects.
const REQUEST_TIME: Duration = Duration::from_secs(10);
/// For a CLI to take its replies once the server is stopping.
const REPLY_TIME: Duration = Duration::from_secs(2);

/// The listening socket and what it runs.
pub(crate) struct Handoff {
    path: PathBuf,
    /// The socket's inode: removed at the end only while it is still ours.
    inode: u64,
    slots: Arc<Semaphore>,
    accept: tokio::task::JoinHandle<()>,
    /// Held while this server has the socket (`listen`).
    _lock: nix::fcntl::Flock<std::fs::File>,
}

/// Take the state dir's hand-off socket, unless another server of this state dir holds it
/// (then this one takes no applies, and says so). The lock file beside the socket is held for
/// the server's life: two servers starting at once cannot both remove and bind it, and a socket
/// whose lock is free is stale (its server is gone), whatever a connect to it would say.
/// `stop` ends the accepting and stops every handed-over apply's jobs (they still end with
/// their results, sent to their CLIs).
pub(crate) fn listen(
    ctx: &Context,
    stop: CancellationToken,
    handed: Arc<AtomicBool>,
) -> std::io::Result<Option<Handoff>> {
    let path = ctx.config.handoff_socket();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(path.with_extension("sock.lock"))?;
    let lock = match nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(lock) => lock,
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
            tracing::warn!(
                socket = %path.display(),
                "another runner serve of this state dir takes the CLI's applies; this one does not"
            );
            return Ok(None);
        }
        Err((_, e)) => return Err(e.into()),
    };
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let listener = UnixListener::bind(&path)?;
    // The state dir is its owner's alone already; the mode says so of the socket itself.
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    let inode = std::fs::metadata(&path)?.ino();
    let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT as usize));
    let accept = tokio::spawn(accept_loop(listener, ctx.clone(), stop, slots.clone(), handed));
    Ok(Some(Handoff {
        path,
        inode,
        slots,
        accept,
        _lock: lock,
    }))
}

impl Handoff {
    /// Every handed-over apply has sent its last reply (after `stop`: its jobs were stopped).
    pub(crate) async fn finished(&self) {
        let _all = self.slots.acquire_many(MAX_IN_FLIGHT).await;
    }

    /// Stop accepting and take the socket away, if it is still ours.
    pub(crate) fn close(self) {
        self.accept.abort();
        remove_if_ours(&self.path, self.inode);
    }
}

fn remove_if_ours(path: &Path, inode: u64) {
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.ino() == inode)
        && let Err(e) = std::fs::remove_file(path)
    {
        tracing::warn!(socket = %path.display(), error = %e, "removing the hand-off socket");
    }
}

async fn accept_loop(
    listener: UnixListener,
    ctx: Context,
    stop: CancellationToken,
    slots: Arc<Semaphore>,
    handed: Arc<AtomicBool>,
) {
    let me = nix::unistd::geteuid().as_raw();
    loop {
        let stream = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors, most likely: the CLI's connect fails and it runs
                    // the apply itself. Pause so a full table does not spin this loop.
                    tracing::warn!(error = %e, "accepting a hand-off");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // The server's own user only (root's CLI too is another user to a server that is not
        // root's: its jobs would run with what the server may do, not what it asked for).
        match stream.peer_cred() {
            Ok(cred) if cred.uid() == me => {}
            Ok(cred) => {
                tracing::warn!(uid = cred.uid(), "a hand-off from another user, refused");
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading a hand-off's peer");
                continue;
            }
        }
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            let reason = format!("the server is running {MAX_IN_FLIGHT} applies already");
            tokio::spawn(async move {
                let mut stream = stream;
                // A CLI that does not take this runs its apply when its connection closes.
                let said =
                    tokio::time::timeout(REQUEST_TIME, write_reply(&mut stream, &Reply::Declined { reason })).await;
                if !matches!(said, Ok(Ok(()))) {
                    tracing::debug!("a CLI did not take its decline");
                }
            });
            continue;
        };
        let (ctx, stop, handed) = (ctx.clone(), stop.clone(), handed.clone());
        tokio::spawn(async move {
            serve_one(&ctx, stream, &stop, &handed).await;
            drop(slot);
        });
    }
}

async fn write_reply(stream: &mut (impl AsyncWriteExt + Unpin), reply: &Reply) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(reply).map_err(std::io::Error::other)?;
    line.push(b'\n');
    stream.write_all(&line).await
}

/// The request line and the manifest text after it.
async fn read_request(reader: &mut BufReader<tokio::net::unix::OwnedReadHalf>) -> Result<(Request, String), String> {
    let mut line = Vec::new();
    (&mut *reader)
        .take(MAX_REQUEST_LINE)
        .read_until(b'\n', &mut line)
        .await
        .map_err(|e| format!("reading the request: {e}"))?;
    if line.last() != Some(&b'\n') {
        return Err(format!(
            "the request line is missing or over {MAX_REQUEST_LINE} bytes (an environment that large is not sent)"
        ));
    }
    let request: Request =
        serde_json::from_slice(&line).map_err(|e| format!("a hand-off request this server does not read: {e}"))?;
    if request.text_bytes > MAX_MANIFEST_BYTES {
        return Err(format!(
            "the manifest is {} bytes; the limit is {MAX_MANIFEST_BYTES}",
            request.text_bytes
        ));
    }
    // Read as it comes, not allocated ahead: a request's size is only its word.
    let mut text = Vec::new();
    (&mut *reader)
        .take(request.text_bytes)
        .read_to_end(&mut text)
        .await
        .map_err(|e| format!("reading the manifest: {e}"))?;
    if text.len() as u64 != request.text_bytes {
        return Err("the manifest ended early".into());
    }
    let text = String::from_utf8(text).map_err(|e| {
        format!(
            "{}: manifest is not UTF-8 (invalid byte at offset {})",
            request.file.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    Ok((request, text))
}

async fn serve_one(ctx: &Context, stream: UnixStream, stop: &CancellationToken, handed: &AtomicBool) {
    let cancel = stop.child_token();
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    let (request, text) = match tokio::time::timeout(REQUEST_TIME, read_request(&mut reader)).await {
        Ok(Ok(got)) => got,
        // What this server cannot read (another version's request, an environment past the
        // bound) the CLI runs itself; nothing was done here.
        Ok(Err(reason)) => {
            let said = tokio::time::timeout(REQUEST_TIME, write_reply(&mut write, &Reply::Declined { reason })).await;
            if !matches!(said, Ok(Ok(()))) {
                tracing::debug!("a CLI did not take its decline");
            }
            return;
        }
        Err(_) => {
            tracing::debug!("a CLI did not send its apply within {REQUEST_TIME:?}; closed");
            return;
        }
    };
    // The CLI's Ctrl-C (a control line) or its going away (end of stream) stops the jobs.
    let watch = {
        let cancel = cancel.clone();
        tokio::spawn(async move {
            let mut line = Vec::new();
            let why = match (&mut reader).take(MAX_CONTROL_LINE).read_until(b'\n', &mut line).await {
                Ok(0) => "its connection closed".to_string(),
                Err(e) => format!("its connection failed: {e}"),
                Ok(_) => match serde_json::from_slice::<Control>(&line) {
                    Ok(control) => format!("it got {}", control.cancel),
                    // Our CLI sends nothing else: whatever sent this is not following the apply.
                    Err(e) => format!("it sent an unreadable control line ({e})"),
                },
            };
            tracing::info!("a handed-over apply's jobs are stopped: {why}");
            cancel.cancel();
        })
    };
    // Unbounded by count, bounded by what it carries: the file's jobs (a 4 MiB manifest) and
    // for each its result, whose output the job's own limit caps as the server holds it anyway.
    // A bounded one could not be fed from the jobs' synchronous callback.
    let (tx, mut rx) = mpsc::unbounded_channel::<Reply>();
    let mut writer = tokio::spawn(async move {
        while let Some(reply) = rx.recv().await {
            if write_reply(&mut write, &reply).await.is_err() {
                // The CLI went away: the watcher sees it and stops the jobs; nothing is left
                // to say to anyone.
                return;
            }
        }
    });
    handoff::run(ctx, request, text, cancel, |reply| {
        if matches!(reply, Reply::Accepted { .. }) {
            handed.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        // Fails only once the writer ended, that is once the CLI went away.
        let _ = tx.send(reply);
    })
    .await;
    drop(tx);
    // A CLI that reads slowly (suspended, piped into a pager) gets every reply; only a server
    // that is stopping gives up on it, after REPLY_TIME.
    tokio::select! {
        _ = &mut writer => {}
        () = async {
            stop.cancelled().await;
            tokio::time::sleep(REPLY_TIME).await;
        } => {
            writer.abort();
            tracing::warn!("a CLI did not take its apply's replies while the server stopped; dropped");
        }
    }
    watch.abort();
}
