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
    // No server, or a socket left by one that is gone: connect fails at once.
    let stream = UnixStream::connect(config.handoff_socket()).ok()?;
    // A file that cannot be read is reported by the apply run here, as always.
    let text = crate::manifest::read_limited(&file.file).ok()?;
    let absolute = std::path::absolute(&file.file).ok()?;
    let env_dir = match &file.env_dir {
        Some(dir) => Some(std::path::absolute(dir).ok()?),
        None => None,
    };
    let request = Request {
        protocol: PROTOCOL,
        fingerprint: config.handoff_fingerprint(),
        mount_ns: mount_namespace().ok()?,
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
    handed(&config, stream, &request, text.as_bytes(), printing)
}

fn handed(config: &Config, stream: UnixStream, request: &Request, text: &[u8], printing: Printing) -> Option<i32> {
    let mut line = serde_json::to_vec(request).ok()?;
    line.push(b'\n');
    let mut writer = stream.try_clone().ok()?;
    // A server that went away between the connect and now: the apply runs here.
    writer.write_all(&line).and_then(|()| writer.write_all(text)).ok()?;
    let mut replies = BufReader::new(stream);
    match next_reply(&mut replies) {
        Some(Ok(Reply::Accepted { jobs })) => {
            tracing::debug!(?jobs, "the server took the apply");
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
        // Nothing was accepted: nothing ran.
        Some(Err(e)) => {
            tracing::debug!(error = %e, "the server did not answer the apply; running it here");
            return None;
        }
        None => return None,
    }
    // From here the jobs are the server's: this process only prints, and its stdout going
    // away must not end it (its connection closing would stop the jobs).
    output::keep_running_without_stdout();
    let stopped_by = forward_stop_signals(writer, config.shutdown_grace);
    Some(follow(config, &mut replies, printing, &stopped_by))
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
fn follow(config: &Config, replies: &mut impl BufRead, printing: Printing, stopped_by: &OnceLock<Shutdown>) -> i32 {
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
    stopped_by.get().map_or(code, |s| s.exit_code())
}

/// Ctrl-C and SIGTERM stop the server's run of the jobs (which still report), as they stop an
/// apply run here; past the shutdown grace this process exits anyway. The signals are taken
/// by a thread of their own, so the printing never has to poll for them.
fn forward_stop_signals(mut writer: UnixStream, grace: std::time::Duration) -> Arc<OnceLock<Shutdown>> {
    use nix::sys::signal::{SigSet, Signal};
    let stopped_by = Arc::new(OnceLock::new());
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    if let Err(e) = set.thread_block() {
        // The default action (the process ends, its connection closes, the server stops the
        // jobs) stays in place.
        tracing::warn!(error = %e, "cannot take Ctrl-C and SIGTERM; they end this process at once");
        return stopped_by;
    }
    let seen = stopped_by.clone();
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
        let _ = SigSet::from_iter([Signal::SIGINT, Signal::SIGTERM]).thread_unblock();
    }
    stopped_by
}
