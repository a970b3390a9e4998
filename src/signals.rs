//! The one place the process listens for the signals that stop it: Ctrl-C (SIGINT) and SIGTERM
//! (what `timeout`, CI runners, systemd and `kill` send). `apply`, `supervise` and `serve`
//! all stop on either, the same way.

use tokio::signal::unix::{SignalKind, signal};

/// Which signal asked the process to stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shutdown {
    Interrupt,
    Terminate,
}

impl Shutdown {
    /// The shell convention for a process ended by this signal: 128 + its number.
    pub fn exit_code(self) -> i32 {
        match self {
            Shutdown::Interrupt => 128 + libc::SIGINT,
            Shutdown::Terminate => 128 + libc::SIGTERM,
        }
    }
}

/// Resolves when SIGINT or SIGTERM arrives. The handlers are installed when this is first
/// polled; a signal that cannot be listened for is logged and never resolves (the default
/// action, ending the process, stays in place for it).
pub async fn shutdown() -> Shutdown {
    let listen = |kind: SignalKind| match signal(kind) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for a stop signal");
            None
        }
    };
    let (mut int, mut term) = (listen(SignalKind::interrupt()), listen(SignalKind::terminate()));
    tokio::select! {
        () = next(int.as_mut()) => Shutdown::Interrupt,
        () = next(term.as_mut()) => Shutdown::Terminate,
    }
}

/// The next delivery of a signal we listen for; never, when we could not listen for it.
async fn next(signal: Option<&mut tokio::signal::unix::Signal>) {
    match signal {
        Some(s) => {
            s.recv().await;
        }
        None => std::future::pending::<()>().await,
    }
}
