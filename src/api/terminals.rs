//! A session's terminals over WebSocket: `GET /v1/sessions/{id}/pty` (a WebSocket upgrade is
//! a GET by RFC 6455) opens a command on a pseudo-terminal in the sandbox before the upgrade is
//! accepted, so a bad request or a command that cannot start is an ordinary HTTP error.
//!
//! On the socket: binary messages carry bytes (keys in, screen out); text messages are JSON
//! control: from the client `{"type":"resize","rows":R,"cols":C}` and
//! `{"type":"signal","signal":"INT"}` (to the terminal's foreground process group), from the
//! server `{"type":"exit","exitCode":N,"signal":S}` once the command ended (then a close) and
//! `{"type":"error","message":…}` for a control message it refused. A close from the client
//! hangs the terminal up. What the host holds per terminal is bounded: output waits in a
//! channel of a few chunks while the client is behind (the program's writes then block), input
//! in a channel of [`INPUT_MESSAGES`] messages of at most [`MAX_MESSAGE`] bytes.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::Method;
use axum::response::Response;
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use serde::Deserialize;
use tokio::sync::mpsc;

use super::{AppResult, AppState, Doc, Route, route};
use crate::runtime::pty::{PtyExit, PtySize};
use crate::service::ServiceError;
use crate::service::sessions::Lease;
use crate::service::sessions::terminal::{Terminal, TerminalRequest};

/// The largest message a client may send (input or control).
pub const MAX_MESSAGE: usize = 64 << 10;
/// Input messages waiting for the terminal to take them.
pub const INPUT_MESSAGES: usize = 4;
/// After the command exited, how long output still read from the terminal may take (what a
/// background process holding the terminal writes is not waited for).
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(300);

pub(super) fn routes() -> Vec<Route> {
    vec![route(
        Doc::new(
            Method::GET,
            "/v1/sessions/{id}/pty",
            "a command on a terminal in the sandbox, over a WebSocket (binary: bytes both ways; text: JSON resize, signal, exit)",
        )
        .query("arg", "the command, one argument per `arg` (default: the image's shell)", false)
        .query("rows", "the terminal's height (default 24)", false)
        .query("cols", "the terminal's width (default 80)", false)
        .query("cwd", "the working directory, relative to the workspace", false)
        .query("env", "`NAME=VALUE` added to the environment (repeatable)", false)
        .returns_nothing(101),
        open,
    )]
}

/// The open request out of the query (repeated keys: `arg`, `env`).
fn parse_open(pairs: &[(String, String)]) -> Result<TerminalRequest, ServiceError> {
    let mut request = TerminalRequest::default();
    let (mut rows, mut cols) = (PtySize::default().rows, PtySize::default().cols);
    let number = |name: &str, v: &str| {
        v.parse::<u16>()
            .map_err(|_| ServiceError::field(name, format!("{v:?} is not a number of 1 to 1000")))
    };
    for (k, v) in pairs {
        match k.as_str() {
            "arg" => request.command.push(v.clone()),
            "rows" => rows = number("rows", v)?,
            "cols" => cols = number("cols", v)?,
            "cwd" => request.cwd = Some(v.clone()),
            "env" => {
                let (name, value) = v
                    .split_once('=')
                    .ok_or_else(|| ServiceError::field("env", format!("{v:?}: expected NAME=VALUE")))?;
                request.env.insert(name.to_string(), value.to_string());
            }
            other => {
                return Err(ServiceError::field(
                    other,
                    "unknown parameter (arg, rows, cols, cwd, env)",
                ));
            }
        }
    }
    request.size = PtySize::checked(rows, cols).map_err(|e| ServiceError::field("rows/cols", e))?;
    Ok(request)
}

async fn open(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
    Query(pairs): Query<Vec<(String, String)>>,
    upgrade: WebSocketUpgrade,
) -> AppResult<Response> {
    let session = state.sessions.lease(&id)?;
    let request = parse_open(&pairs)?;
    let terminal = session.open_terminal(request).await?;
    Ok(upgrade
        .max_message_size(MAX_MESSAGE)
        .max_frame_size(MAX_MESSAGE)
        .on_upgrade(move |socket| serve(socket, Arc::new(terminal), session)))
}

/// A control message from the client.
#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "camelCase", deny_unknown_fields)]
enum Control {
    Resize { rows: u16, cols: u16 },
    Signal { signal: SignalName },
}

#[derive(Deserialize)]
#[serde(untagged)]
enum SignalName {
    Number(i32),
    Name(String),
}

/// A signal by number or name (`INT`, `SIGINT`, `int`).
fn signal_of(name: &SignalName) -> Result<nix::sys::signal::Signal, String> {
    use std::str::FromStr;
    match name {
        SignalName::Number(n) => nix::sys::signal::Signal::try_from(*n).map_err(|_| format!("no signal {n}")),
        SignalName::Name(s) => {
            let upper = s.to_ascii_uppercase();
            let full = if upper.starts_with("SIG") {
                upper
            } else {
                format!("SIG{upper}")
            };
            nix::sys::signal::Signal::from_str(&full).map_err(|_| format!("no signal {s:?}"))
        }
    }
}

fn control(terminal: &Terminal, text: &str) -> impl Future<Output = Result<(), String>> {
    let parsed = serde_json::from_str::<Control>(text).map_err(|e| format!("a control message: {e}"));
    async move {
        match parsed? {
            Control::Resize { rows, cols } => {
                let size = PtySize::checked(rows, cols)?;
                terminal.pty.resize(size).await.map_err(|e| e.to_string())
            }
            Control::Signal { signal } => {
                let signal = signal_of(&signal)?;
                // Nothing to signal (it ended, or nothing is in the foreground yet): not an error
                // worth a message, as a terminal's Ctrl-C with nothing running is none.
                terminal.pty.signal(signal);
                Ok(())
            }
        }
    }
}

fn text(value: serde_json::Value) -> Message {
    Message::Text(value.to_string().into())
}

fn exit_message(exit: PtyExit) -> Message {
    text(serde_json::json!({"type": "exit", "exitCode": exit.exit_code, "signal": exit.signal}))
}

async fn serve(socket: WebSocket, terminal: Arc<Terminal>, lease: Lease) {
    let (mut sink, mut stream) = socket.split();
    let (input_tx, mut input_rx) = mpsc::channel::<Bytes>(INPUT_MESSAGES);
    // Replies to control messages go out with the output: before any output taken after
    // they were queued (a refusal may so pass output that was waiting to be sent).
    let (reply_tx, mut reply_rx) = mpsc::channel::<Message>(INPUT_MESSAGES);
    let writer = {
        let terminal = terminal.clone();
        tokio::spawn(async move {
            while let Some(data) = input_rx.recv().await {
                if let Err(e) = terminal.pty.write(&data).await {
                    tracing::debug!(error = %e, "writing to a terminal");
                    break;
                }
            }
            // The client closed (or the terminal refuses input): hang up.
            terminal.pty.close().await;
        })
    };
    let output = {
        let terminal = terminal.clone();
        tokio::spawn(async move {
            let _lease = lease;
            let mut exited: Option<PtyExit> = None;
            loop {
                // Biased, replies first: a reply is queued before any later input reaches the
                // terminal, so it must go out before the output that input causes (a client
                // that waits for its echo then finds the refusal already read). Unbiased, a
                // reply and a ready chunk were sent in random order.
                let next = tokio::select! {
                    biased;
                    // (Closed, it answers `None`: the pattern fails and the branch sits out
                    // this select, so a biased select does not spin on it.)
                    Some(reply) = reply_rx.recv() => Some(reply),
                    chunk = terminal.pty.read(), if exited.is_none() => chunk.map(Message::Binary),
                    chunk = tokio::time::timeout(DRAIN_AFTER_EXIT, terminal.pty.read()), if exited.is_some() => {
                        chunk.ok().flatten().map(Message::Binary)
                    }
                    exit = terminal.pty.wait(), if exited.is_none() => {
                        exited = Some(exit);
                        continue;
                    }
                };
                let Some(message) = next else { break };
                // A chunk read now may hold the output of input written after a reply was
                // queued: replies waiting go first (the select above prefers them when it is
                // polled, but a chunk it took may have been read after the reply came).
                if matches!(message, Message::Binary(_)) {
                    while let Ok(reply) = reply_rx.try_recv() {
                        if matches!(reply, Message::Close(_)) {
                            let _ = sink.close().await;
                            return;
                        }
                        if sink.send(reply).await.is_err() {
                            return;
                        }
                    }
                }
                if matches!(message, Message::Close(_)) {
                    // Answers the client's close (a send would be refused after it).
                    let _ = sink.close().await;
                    return;
                }
                if sink.send(message).await.is_err() {
                    return;
                }
            }
            let exit = match exited {
                Some(exit) => exit,
                None => terminal.pty.wait().await,
            };
            let _ = sink.send(exit_message(exit)).await;
            let _ = sink.close().await;
        })
    };
    let input = async {
        while let Some(message) = stream.next().await {
            match message {
                Ok(Message::Binary(data)) => {
                    if input_tx.send(data).await.is_err() {
                        break;
                    }
                }
                Ok(Message::Text(t)) => {
                    if let Err(message) = control(&terminal, t.as_str()).await {
                        let _ = reply_tx
                            .send(text(serde_json::json!({"type": "error", "message": message})))
                            .await;
                    }
                }
                Ok(Message::Ping(_) | Message::Pong(_)) => {}
                Ok(Message::Close(_)) => {
                    // The client ends it: our close answers its close at once (the
                    // terminal's end is not waited for, nor reported).
                    let _ = reply_tx.send(Message::Close(None)).await;
                    break;
                }
                Err(_) => break,
            }
        }
    };
    let mut output = output;
    let output_done = tokio::select! {
        () = input => false,
        _ = &mut output => true,
    };
    drop(input_tx);
    let _ = writer.await;
    // The output side ends at the terminal's EOF (at the latest after the hang-up's grace).
    if !output_done {
        let _ = output.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn the_open_request_comes_from_the_query() {
        let r = parse_open(&pairs(&[
            ("arg", "python3"),
            ("arg", "-i"),
            ("rows", "30"),
            ("cols", "100"),
            ("env", "A=b=c"),
        ]))
        .unwrap();
        assert_eq!(r.command, ["python3", "-i"]);
        assert_eq!(r.size, PtySize { rows: 30, cols: 100 });
        assert_eq!(r.env["A"], "b=c");
        assert!(parse_open(&pairs(&[("rows", "0")])).is_err());
        assert!(parse_open(&pairs(&[("cols", "x")])).is_err());
        assert!(parse_open(&pairs(&[("env", "novalue")])).is_err());
        assert!(parse_open(&pairs(&[("what", "x")])).is_err());
        assert!(parse_open(&[]).unwrap().command.is_empty());
    }

    #[test]
    fn signals_by_name_or_number() {
        use nix::sys::signal::Signal;
        assert_eq!(signal_of(&SignalName::Name("int".into())), Ok(Signal::SIGINT));
        assert_eq!(signal_of(&SignalName::Name("SIGTERM".into())), Ok(Signal::SIGTERM));
        assert_eq!(signal_of(&SignalName::Number(9)), Ok(Signal::SIGKILL));
        assert!(signal_of(&SignalName::Name("NOPE".into())).is_err());
        assert!(signal_of(&SignalName::Number(999)).is_err());
    }
}
