//! A foreground `runner apply` handed to the `runner serve` of its state dir
//! (`service::handoff` has the protocol and why). This runs before the async runtime is built:
//! an apply the server takes costs this process a connect, a read of the manifest and the
//! printing, on one thread. Anything that keeps the server from taking it (none listening, a
//! stale socket, another configuration, binary or mount namespace, a file that makes pools)
//! leaves the apply to run here as before, with nothing done by the server.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, OnceLock};

use super::output::{self, worst};
use super::{Cli, OutputFormat, Verb};
use crate::config::Config;
use crate::service::handoff::{Caller, Control, PROTOCOL, Reply, Request, mount_namespace};
use crate::signals::Shutdown;

/// What `apply` printing needs of the verb's options.
struct Printing {
    format: Option<OutputFormat>,
    index: Option<u32>,
}

/// Run the apply through the server when one takes it: the CLI's exit code. `None`: run it in
/// this process.
pub fn apply(cli: &Cli) -> Option<i32> {
    let Verb::Apply {
        file,
        output,
        backend,
        max_output_bytes,
        detach: false,
        replace,
        index,
        kube: false,
        local: false,
        ..
    } = &cli.command
    else {
        return None;
    };
    let mut config = cli.global.config();
    config.output_limit = *max_output_bytes;
    // Only a regular file: a pipe read here could not be read again by an apply run here.
    if !std::fs::metadata(&file.file).is_ok_and(|m| m.is_file()) {
        tracing::debug!("the manifest is not a regular file; running the apply here");
        return None;
    }
    let socket = config.handoff_socket();
    // No server, or a socket left by one that is gone: connect fails at once.
    let stream = here(
        "no server of this state dir takes applies",
        UnixStream::connect(&socket),
    )?;
    // A file that cannot be read is reported by the apply run here, as always.
    let text = here("reading the manifest", crate::manifest::read_limited(&file.file))?;
    let absolute = here("the manifest's absolute path", std::path::absolute(&file.file))?;
    let env_dir = match &file.env_dir {
        Some(dir) => Some(here("the env dir's absolute path", std::path::absolute(dir))?),
        None => None,
    };
    let request = Request {
        protocol: PROTOCOL,
        fingerprint: config.handoff_fingerprint(),
        mount_ns: here("reading this process's mount namespace", mount_namespace())?,
        file: file.file.clone(),
        absolute,
        env_dir,
        backend: *backend,
        replace: *replace,
        output_limit: config.output_limit,
        text_bytes: text.len() as u64,
        caller: Caller::of(&crate::spec::HostEnv::detect(&config.state_dir)),
    };
    let printing = Printing {
        format: *output,
        index: *index,
    };
    // From the request on, Ctrl-C and SIGTERM are the server's run's to stop (taken by a
    // thread once the apply is accepted); an apply run here gets them back unblocked, and
    // one that came meanwhile ends this process as it would have.
    let signals = StopSignals::block();
    let handed = handed(&config, stream, &request, text.as_bytes(), printing, &signals);
    if handed.is_none() {
        signals.unblock();
    }
    handed
}

/// `r`'s value, or `None` (the apply runs here) with why at debug.
fn here<T, E: std::fmt::Display>(what: &str, r: Result<T, E>) -> Option<T> {
    r.map_err(|e| tracing::debug!("{what}: {e}; running the apply here"))
        .ok()
}

/// How long a server may take to accept or refuse an apply (it parses and plans the file).
const ACCEPT_TIME: std::time::Duration = std::time::Duration::from_secs(60);

fn handed(
    config: &Config,
    stream: UnixStream,
    request: &Request,
    text: &[u8],
    printing: Printing,
    signals: &StopSignals,
) -> Option<i32> {
    let mut line = here("encoding the request", serde_json::to_vec(request))?;
    line.push(b'\n');
    let mut writer = here("the connection", stream.try_clone())?;
    // A server that went away between the connect and now: the apply runs here.
    here(
        "sending the apply",
        writer.write_all(&line).and_then(|()| writer.write_all(text)),
    )?;
    here("the connection", stream.set_read_timeout(Some(ACCEPT_TIME)))?;
    let mut replies = BufReader::new(stream);
    let accepted = match next_reply(&mut replies) {
        Some(Ok(Reply::Accepted { jobs })) => {
            tracing::debug!(?jobs, "the server took the apply");
            jobs
        }
        Some(Ok(Reply::Declined { reason })) => {
            tracing::debug!(%reason, "the server declined the apply; running it here");
            return None;
        }
        Some(Ok(Reply::Failed { message })) => {
            tracing::debug!("the server refused the apply");
            return Some(super::fail_message(&message));
        }
        Some(Ok(other)) => {
            return Some(super::fail_message(&format!(
                "the server answered the apply out of turn ({other:?})"
            )));
        }
        // It may still take it: running it here too could run the jobs twice.
        Some(Err(e)) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
            return Some(super::fail_message(&format!(
                "the server ({}) did not answer the apply in {}s; `runner get` shows whether it took it, `apply --local` runs it here",
                config.handoff_socket().display(),
                ACCEPT_TIME.as_secs()
            )));
        }
        // Gone before it answered: nothing was registered, nothing ran.
        Some(Err(e)) => {
            tracing::debug!(error = %e, "the server did not answer the apply; running it here");
            return None;
        }
        None => {
            tracing::debug!("the server closed the connection; running the apply here");
            return None;
        }
    };
    if let Err(e) = replies.get_ref().set_read_timeout(None) {
        return Some(super::fail_message(&format!("the server's connection: {e}")));
    }
    // From here the jobs are the server's: this process only prints, and its stdout going
    // away must not end it (its connection closing would stop the jobs).
    output::keep_running_without_stdout();
    let stopped_by = signals.forward(writer, config.shutdown_grace);
    Some(follow(config, &mut replies, printing, &accepted, &stopped_by))
}

fn next_reply(replies: &mut impl BufRead) -> Option<std::io::Result<Reply>> {
    let mut line = Vec::new();
    match replies.read_until(b'\n', &mut line) {
        Ok(0) => None,
        Ok(_) => Some(serde_json::from_slice(&line).map_err(std::io::Error::other)),
        Err(e) => Some(Err(e)),
    }
}

/// Print each job as it ends, as an apply run here does; the exit code.
fn follow(
    config: &Config,
    replies: &mut impl BufRead,
    printing: Printing,
    accepted: &[String],
    stopped_by: &OnceLock<Shutdown>,
) -> i32 {
    let logs_dir = config.logs_dir();
    let mut objects = Vec::new();
    let mut code = 0;
    loop {
        match next_reply(replies) {
            Some(Ok(Reply::Done { object })) => {
                let object = object.into_object();
                code = worst(code, object.status.exit_code());
                if printing.format.is_none() {
                    super::jobs::print_ended(&logs_dir, &object, printing.index);
                }
                objects.push(object);
            }
            Some(Ok(Reply::End)) => break,
            Some(Ok(Reply::Failed { message })) => return super::fail_message(&message),
            Some(Ok(other)) => {
                return super::fail_message(&format!("the server answered the apply out of turn ({other:?})"));
            }
            Some(Err(e)) => return super::fail_message(&format!("reading the server's answer: {e}")),
            None => {
                return super::fail_message(&format!(
                    "the server ({}) stopped before the jobs ended; `runner get` shows what is left of them",
                    config.handoff_socket().display()
                ));
            }
        }
    }
    if let Err(e) = super::jobs::print_applied(&objects, printing.format) {
        return super::fail(&e);
    }
    // A run cut short (the server stopped, or this CLI did) leaves the rest unrun, as an apply
    // run here does; unless this CLI was stopped, that is the runner's failure to say.
    let unrun: Vec<&str> = accepted
        .iter()
        .filter(|name| !objects.iter().any(|o| &o.metadata.name == *name))
        .map(String::as_str)
        .collect();
    // Jobs the server stopped while this CLI was not: its stop, not a Ctrl-C here (130).
    let stopped: Vec<&str> = objects
        .iter()
        .filter(|o| o.status.message.as_deref() == Some(crate::job::controller::STOPPED))
        .map(|o| o.metadata.name.as_str())
        .collect();
    if stopped_by.get().is_none() {
        match (unrun.is_empty(), stopped.is_empty()) {
            (true, true) => {}
            (false, _) => {
                return super::fail_message(&format!("the server stopped before job/{} ran", unrun.join(", job/")));
            }
            (true, false) => {
                return super::fail_message(&format!(
                    "the server stopped, and job/{} with it",
                    stopped.join(", job/")
                ));
            }
        }
    }
    stopped_by.get().map_or(code, |s| s.exit_code())
}

/// Ctrl-C and SIGTERM, blocked in this process from the request on (`block`): once the apply
/// is accepted a thread takes them (`forward`) and stops the server's run of the jobs (which
/// still report), as they stop an apply run here; past the shutdown grace this process exits
/// anyway. A thread of their own, so the printing never polls for them.
struct StopSignals {
    set: nix::sys::signal::SigSet,
    blocked: bool,
}

impl StopSignals {
    fn block() -> Self {
        use nix::sys::signal::{SigSet, Signal};
        let set = SigSet::from_iter([Signal::SIGINT, Signal::SIGTERM]);
        let blocked = match set.thread_block() {
            Ok(()) => true,
            Err(e) => {
                // The default action (the process ends, its connection closes, the server
                // stops the jobs) stays in place.
                tracing::warn!(error = %e, "cannot take Ctrl-C and SIGTERM; they end this process at once");
                false
            }
        };
        StopSignals { set, blocked }
    }

    /// For an apply run here: its runtime listens for them itself.
    fn unblock(&self) {
        if self.blocked
            && let Err(e) = self.set.thread_unblock()
        {
            tracing::warn!(error = %e, "cannot unblock Ctrl-C and SIGTERM");
        }
    }

    fn forward(&self, mut writer: UnixStream, grace: std::time::Duration) -> Arc<OnceLock<Shutdown>> {
        use nix::sys::signal::Signal;
        let stopped_by = Arc::new(OnceLock::new());
        if !self.blocked {
            return stopped_by;
        }
        let (seen, set) = (stopped_by.clone(), self.set);
        let spawned = std::thread::Builder::new().name("stop-signals".into()).spawn(move || {
            let signal = match set.wait() {
                Ok(Signal::SIGTERM) => Shutdown::Terminate,
                Ok(_) => Shutdown::Interrupt,
                Err(e) => {
                    tracing::warn!(error = %e, "waiting for a stop signal");
                    return;
                }
            };
            let _ = seen.set(signal);
            let name = match signal {
                Shutdown::Interrupt => "SIGINT",
                Shutdown::Terminate => "SIGTERM",
            };
            let mut line = serde_json::to_vec(&Control { cancel: name.into() }).unwrap_or_default();
            line.push(b'\n');
            if let Err(e) = writer.write_all(&line) {
                tracing::warn!(error = %e, "telling the server to stop the jobs");
            }
            std::thread::sleep(grace);
            eprintln!(
                "runner: the jobs did not stop within the {} shutdown grace period; exiting (the server goes on stopping them; `runner get` shows their results)",
                humantime::format_duration(grace)
            );
            std::process::exit(signal.exit_code());
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the signal thread; Ctrl-C and SIGTERM end this process at once");
            self.unblock();
        }
        stopped_by
    }
}
