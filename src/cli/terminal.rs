//! `runner exec -it SESSION -- CMD` and `runner attach SESSION`: the user's terminal connected
//! to a terminal in a session of a `runner serve` (its WebSocket, `GET /v1/sessions/{id}/pty`).
//! The local terminal is put in raw mode (every key goes to the sandbox's line discipline:
//! Ctrl-C reaches its foreground process group) and restored however this ends; SIGWINCH
//! sends the new size.

use std::io::{IsTerminal, Read, Write};
use std::os::fd::AsFd;

use futures::{SinkExt, StreamExt};
use nix::sys::termios::{self, SetArg, Termios};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::{self, Message, client::IntoClientRequest};

use super::args::ServerArgs;
use crate::service::ServiceError;

/// Exit status when the command's end was never reported (the connection broke).
const LOST: i32 = 255;

/// What to open.
pub struct Open {
    pub session: String,
    pub command: Vec<String>,
    pub interactive: bool,
}

/// The local terminal's settings, put back when dropped.
struct RawMode {
    saved: Termios,
}

impl RawMode {
    fn enter() -> Result<RawMode, ServiceError> {
        let stdin = std::io::stdin();
        let saved =
            termios::tcgetattr(stdin.as_fd()).map_err(|e| ServiceError::internal("reading the terminal's mode", e))?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw)
            .map_err(|e| ServiceError::internal("setting the terminal's mode", e))?;
        Ok(RawMode { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = termios::tcsetattr(std::io::stdin().as_fd(), SetArg::TCSAFLUSH, &self.saved);
    }
}

/// The local terminal's size (rows, cols), when stdout is one.
fn local_size() -> Option<(u16, u16)> {
    let mut ws = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one winsize through the pointer, which points at `ws`.
    let rc = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut ws) };
    (rc == 0 && ws.ws_row > 0 && ws.ws_col > 0).then_some((ws.ws_row, ws.ws_col))
}

fn query(open: &Open, size: Option<(u16, u16)>) -> String {
    let mut parts: Vec<(&str, String)> = open.command.iter().map(|a| ("arg", a.clone())).collect();
    if let Some((rows, cols)) = size {
        parts.push(("rows", rows.to_string()));
        parts.push(("cols", cols.to_string()));
    }
    if let Ok(term) = std::env::var("TERM") {
        parts.push(("env", format!("TERM={term}")));
    }
    parts
        .iter()
        .map(|(k, v)| format!("{k}={}", percent(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// Percent-encoding of a query value (everything but unreserved characters).
fn percent(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

pub(super) trait Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Stream for T {}

/// A connection to the server `--url` names (`http://HOST:PORT[/PREFIX]` or `unix:PATH`), the
/// Host header to send and the path prefix of its routes.
pub(super) async fn open_stream(server: &ServerArgs) -> Result<(Box<dyn Stream>, String, String), ServiceError> {
    let url = server.url.trim_end_matches('/');
    let bad = |m: String| ServiceError::field("--url", m);
    if let Some(path) = url.strip_prefix("unix:") {
        let s = tokio::net::UnixStream::connect(path)
            .await
            .map_err(|e| bad(format!("{url}: {e}")))?;
        Ok((Box::new(s), "localhost".into(), String::new()))
    } else if let Some(rest) = url.strip_prefix("http://") {
        let (authority, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].to_string()),
            None => (rest, String::new()),
        };
        let s = tokio::net::TcpStream::connect(authority)
            .await
            .map_err(|e| bad(format!("{url}: {e}")))?;
        Ok((Box::new(s), authority.to_string(), prefix))
    } else {
        Err(bad(format!("{url}: expected http://HOST:PORT or unix:PATH")))
    }
}

/// Connect to the server and open the terminal; its socket.
async fn connect(
    server: &ServerArgs,
    path_and_query: &str,
) -> Result<tokio_tungstenite::WebSocketStream<Box<dyn Stream>>, ServiceError> {
    let (stream, host, prefix) = open_stream(server).await?;
    let mut request = format!("ws://{host}{prefix}{path_and_query}")
        .into_client_request()
        .map_err(|e| ServiceError::internal("building the request", e))?;
    if let Some(token) = server.token()? {
        let value = format!("Bearer {token}")
            .parse()
            .map_err(|_| ServiceError::field("token", "not a valid header value"))?;
        request.headers_mut().insert("authorization", value);
    }
    match tokio_tungstenite::client_async(request, stream).await {
        Ok((socket, _)) => Ok(socket),
        Err(tungstenite::Error::Http(response)) => {
            let status = response.status();
            let body = response.body().clone().unwrap_or_default();
            let message = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(String::from))
                .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
            Err(match status.as_u16() {
                409 => ServiceError::Conflict(message),
                400..=499 => ServiceError::rejected(message),
                _ => ServiceError::Unavailable {
                    what: "the server",
                    reason: format!("{status}: {message}"),
                },
            })
        }
        Err(e) => Err(ServiceError::Unavailable {
            what: "the server",
            reason: e.to_string(),
        }),
    }
}

/// Run it; the command's exit status (128 + a signal's number when one ended it).
pub async fn run(server: &ServerArgs, open: Open) -> Result<i32, ServiceError> {
    let tty = std::io::stdin().is_terminal();
    let size = local_size();
    let path = format!("/v1/sessions/{}/pty?{}", percent(&open.session), query(&open, size));
    let socket = connect(server, &path).await?;
    let raw = if tty && open.interactive {
        Some(RawMode::enter()?)
    } else {
        None
    };
    let code = pump(socket, open.interactive).await;
    drop(raw);
    code
}

async fn pump(
    socket: tokio_tungstenite::WebSocketStream<Box<dyn Stream>>,
    interactive: bool,
) -> Result<i32, ServiceError> {
    let (mut sink, mut stream) = socket.split();
    // Keys: read on a thread of their own (a blocking read of the terminal cannot be
    // cancelled; the process exits without waiting for it).
    let (keys_tx, mut keys_rx) = mpsc::channel::<Vec<u8>>(4);
    if interactive {
        std::thread::spawn(move || {
            let mut stdin = std::io::stdin().lock();
            let mut buf = [0u8; 4096];
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) | Err(_) => {
                        // Not a terminal and its input ended: as a terminal's Ctrl-D.
                        let _ = keys_tx.blocking_send(vec![4]);
                        return;
                    }
                    Ok(n) => {
                        if keys_tx.blocking_send(buf[..n].to_vec()).is_err() {
                            return;
                        }
                    }
                }
            }
        });
    } else {
        drop(keys_tx);
    }
    let mut winch = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())
        .map_err(|e| ServiceError::internal("watching the window size", e))?;
    let mut keys_open = interactive;
    let mut exit: Option<i32> = None;
    let mut stdout = std::io::stdout();
    let lost = |e: tungstenite::Error| ServiceError::Unavailable {
        what: "the server",
        reason: format!("the terminal's connection broke: {e}"),
    };
    loop {
        tokio::select! {
            keys = keys_rx.recv(), if keys_open => match keys {
                Some(keys) => sink.send(Message::Binary(keys.into())).await.map_err(lost)?,
                None => keys_open = false,
            },
            _ = winch.recv() => {
                if let Some((rows, cols)) = local_size() {
                    let resize = serde_json::json!({"type": "resize", "rows": rows, "cols": cols});
                    sink.send(Message::Text(resize.to_string().into())).await.map_err(lost)?;
                }
            }
            message = stream.next() => match message {
                Some(Ok(Message::Binary(data))) => {
                    stdout.write_all(&data).and_then(|()| stdout.flush()).map_err(|e| ServiceError::internal("writing to stdout", e))?;
                }
                Some(Ok(Message::Text(text))) => {
                    let value: serde_json::Value = serde_json::from_str(text.as_str()).unwrap_or_default();
                    match value["type"].as_str() {
                        Some("exit") => {
                            exit = Some(match (value["exitCode"].as_i64(), value["signal"].as_i64()) {
                                (Some(code), _) => code as i32,
                                (None, Some(signal)) => 128 + signal as i32,
                                _ => LOST,
                            });
                        }
                        Some("error") => eprint!("runner: {}\r\n", value["message"].as_str().unwrap_or("?")),
                        _ => {}
                    }
                }
                Some(Ok(Message::Close(_))) | None => break,
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(lost(e)),
            },
        }
    }
    Ok(exit.unwrap_or(LOST))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_carries_the_command_and_size() {
        let open = Open {
            session: "s".into(),
            command: vec!["sh".into(), "-c".into(), "echo a&b".into()],
            interactive: true,
        };
        let q = query(&open, Some((30, 100)));
        assert!(q.starts_with("arg=sh&arg=-c&arg=echo%20a%26b&rows=30&cols=100"), "{q}");
    }
}
