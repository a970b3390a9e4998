//! The persistent Python interpreter of a session: `driver.py`, shipped read-only into every
//! live sandbox, started on first use and driven over a unix socket the host listens on.

use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;

use super::Session;
use super::shell::DEFAULT_CALL_TIMEOUT;
use crate::runtime::{ExecRequest, Sandbox, Tool};
use crate::service::{Invalid, ServiceError};

/// The driver, as shipped into sandboxes.
pub(super) const DRIVER: Tool = Tool {
    name: "driver.py",
    contents: include_bytes!("driver.py"),
};
/// How long the driver may take to start and connect.
const START_LIMIT: Duration = Duration::from_secs(15);
/// After SIGINT, how long interrupted code may take to give up.
const INTERRUPT_GRACE: Duration = Duration::from_secs(3);
/// The socket's name in the shared directory.
const SOCKET: &str = "py.sock";
/// What an answer may hold beyond the code's output and error streams (variable names, the
/// error's traceback, JSON's framing).
const ANSWER_OVERHEAD: usize = 1 << 20;
/// The longest hello line.
const HELLO_LIMIT: usize = 256;

/// The longest answer line the host reads from the driver: the driver keeps the head and tail
/// of each stream within `output_limit` bytes and shrinks its answer to fit; a longer line is
/// not an answer of our driver (the code wrote into its socket), and the interpreter is
/// restarted rather than the host buffering it.
fn answer_limit(output_limit: usize) -> usize {
    output_limit.saturating_mul(2).saturating_add(ANSWER_OVERHEAD)
}

/// How reading one line ended.
enum Line {
    /// The line, without its newline.
    Whole(Vec<u8>),
    /// EOF before any byte.
    Eof,
    /// More than the limit came without a newline: the rest is not read.
    TooLong,
}

/// Read one line of at most `limit` bytes, never holding more than that.
async fn read_line_capped<R: tokio::io::AsyncBufRead + Unpin>(reader: &mut R, limit: usize) -> std::io::Result<Line> {
    let mut line = Vec::new();
    loop {
        let available = reader.fill_buf().await?;
        if available.is_empty() {
            // EOF: a partial line is not an answer.
            return Ok(if line.is_empty() { Line::Eof } else { Line::TooLong });
        }
        let (take, done) = match available.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (available.len(), false),
        };
        if line.len() + take > limit.saturating_add(1) {
            return Ok(Line::TooLong);
        }
        line.extend_from_slice(&available[..take]);
        reader.consume(take);
        if done {
            line.pop();
            return Ok(Line::Whole(line));
        }
    }
}

pub(super) struct Driver {
    reader: BufReader<tokio::net::unix::OwnedReadHalf>,
    writer: tokio::net::unix::OwnedWriteHalf,
    /// The driver's PID inside the sandbox.
    pid: i32,
}

fn unsupported() -> ServiceError {
    ServiceError::Invalid(Invalid::Unsupported(
        "the Python session needs the containerd backend".into(),
    ))
}

impl Session {
    pub(super) fn sandbox(&self) -> Result<&dyn Sandbox, ServiceError> {
        self.runtime.sandbox().ok_or_else(unsupported)
    }

    /// Run code in the session's interpreter: `output`, `stderr`, `vars`, `error` (and
    /// `timedOut`, `oomKilled` when so).
    pub async fn python_exec(&self, code: &str, timeout: Option<Duration>) -> Result<Value, ServiceError> {
        self.python_call(
            serde_json::json!({"op": "exec", "code": code}),
            timeout.unwrap_or(DEFAULT_CALL_TIMEOUT),
        )
        .await
    }

    /// The interpreter's variables: name, type, summary.
    pub async fn python_vars(&self) -> Result<Value, ServiceError> {
        let v = self
            .python_call(serde_json::json!({"op": "vars"}), DEFAULT_CALL_TIMEOUT)
            .await?;
        Ok(v["vars"].clone())
    }

    /// One variable's value (JSON when serializable, else `{"repr": ...}`).
    pub async fn python_var(&self, name: &str) -> Result<Value, ServiceError> {
        let v = self
            .python_call(serde_json::json!({"op": "var", "name": name}), DEFAULT_CALL_TIMEOUT)
            .await?;
        if v.get("error").is_some() {
            return Err(ServiceError::NotFound {
                kind: "variable",
                name: name.to_string(),
            });
        }
        Ok(v["value"].clone())
    }

    /// Listen on the Python socket in the sandbox's shared directory.
    fn python_listen(&self) -> Result<(UnixListener, std::path::PathBuf), ServiceError> {
        let sandbox = self.sandbox()?;
        let shared = sandbox.shared_dir();
        let sock = shared.join(SOCKET);
        // We listen; the driver connects: a socket path in a sandbox-writable directory is never
        // something the host connects to. The socket is made and chmod-ed in the sandbox's
        // host-only directory, then renamed into the shared one: a chmod by path in the shared
        // directory would follow a symlink the sandbox swapped in.
        let private = shared
            .parent()
            .ok_or_else(|| ServiceError::internal("the Python socket", "the shared directory has no parent"))?
            .join(SOCKET);
        let _ = std::fs::remove_file(&private);
        let listener =
            UnixListener::bind(&private).map_err(|e| ServiceError::internal("binding the Python socket", e))?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o777))
                .map_err(|e| ServiceError::internal("opening the Python socket", e))?;
        }
        std::fs::rename(&private, &sock).map_err(|e| {
            let _ = std::fs::remove_file(&private);
            ServiceError::rejected(format!("cannot place the Python socket in the sandbox: {e}"))
        })?;
        Ok((listener, sock))
    }

    async fn start_python(&self) -> Result<Driver, ServiceError> {
        let sandbox = self.sandbox()?;
        let (listener, sock) = self.python_listen()?;
        let start = format!(
            "if command -v python3 >/dev/null 2>&1; then nohup python3 {}/{} {}/{SOCKET} {} >/dev/null 2>&1 & else echo 'python3 is not in this image' >&2; exit 127; fi",
            sandbox.tools_mount(),
            DRIVER.name,
            sandbox.shared_mount(),
            self.output_limit,
        );
        let r = self
            .runtime
            .execute(ExecRequest {
                argv: vec!["/bin/sh".into(), "-c".into(), start],
                timeout: Some(START_LIMIT),
                ..Default::default()
            })
            .await?;
        if r.exit_code != Some(0) {
            return Err(ServiceError::rejected(format!(
                "cannot start Python: {}",
                r.stderr.trim()
            )));
        }
        python_accept(listener, &sock).await
    }

    /// Take the interpreter off its socket for a checkpoint: the driver closes its connection
    /// and waits for the socket to be there again (`python_reattach`), so no connection to the
    /// host is in what CRIU dumps. Held: the session's interpreter slot (no call runs). Whether
    /// an interpreter was detached.
    pub(super) async fn python_detach(&self, slot: &mut Option<Driver>) -> Result<bool, ServiceError> {
        let Some(mut driver) = slot.take() else {
            return Ok(false);
        };
        let line = b"{\"op\": \"detach\"}\n";
        let answer = async {
            driver.writer.write_all(line).await.ok()?;
            read_line_capped(&mut driver.reader, HELLO_LIMIT).await.ok()
        };
        match tokio::time::timeout(START_LIMIT, answer).await {
            Ok(Some(Line::Whole(l))) if serde_json::from_slice::<Value>(&l).is_ok_and(|v| v["detached"] == true) => {
                Ok(true)
            }
            _ => Err(ServiceError::rejected(
                "the Python interpreter did not let go of its connection (is it running code?)",
            )),
        }
    }

    /// Connect the interpreter `python_detach` let go of (after a checkpoint, or in a sandbox
    /// restored from one).
    pub(super) async fn python_reattach(&self) -> Result<Driver, ServiceError> {
        let (listener, sock) = self.python_listen()?;
        python_accept(listener, &sock).await
    }
}

/// The driver's connection on `listener`, and its hello.
async fn python_accept(listener: UnixListener, sock: &std::path::Path) -> Result<Driver, ServiceError> {
    {
        let (stream, _) = tokio::time::timeout(START_LIMIT, listener.accept())
            .await
            .map_err(|_| ServiceError::rejected("the Python driver did not start"))?
            .map_err(|e| ServiceError::internal("accepting the Python driver", e))?;
        drop(listener);
        let _ = std::fs::remove_file(sock);
        let (read, writer) = stream.into_split();
        let mut reader = BufReader::new(read);
        let hello = tokio::time::timeout(START_LIMIT, read_line_capped(&mut reader, HELLO_LIMIT))
            .await
            .map_err(|_| ServiceError::rejected("the Python driver did not answer"))?
            .map_err(|e| ServiceError::internal("reading the Python driver", e))?;
        let pid = match hello {
            Line::Whole(line) => serde_json::from_slice::<Value>(&line)
                .ok()
                .and_then(|v| v["hello"].as_i64())
                .and_then(|p| i32::try_from(p).ok()),
            Line::Eof | Line::TooLong => None,
        }
        .ok_or_else(|| ServiceError::rejected("the Python driver said something unexpected"))?;
        Ok(Driver { reader, writer, pid })
    }
}

impl Session {
    /// One request to the interpreter (started on first use). On timeout the code gets
    /// SIGINT (KeyboardInterrupt); if it does not give up, the interpreter is restarted.
    async fn python_call(&self, request: Value, timeout: Duration) -> Result<Value, ServiceError> {
        let sandbox = self.sandbox()?;
        let mut guard = self.python.lock().await;
        if guard.is_none() {
            *guard = Some(self.start_python().await?);
        }
        let driver = guard.as_mut().expect("driver just started");
        let oom_before = sandbox.oom_kills().unwrap_or(0);
        let mut line = serde_json::to_vec(&request).map_err(|e| ServiceError::internal("encoding a request", e))?;
        line.push(b'\n');
        if driver.writer.write_all(&line).await.is_err() {
            *guard = None;
            return Err(ServiceError::rejected(
                "the Python interpreter died; it restarts on the next call",
            ));
        }
        let limit = answer_limit(self.output_limit);
        let read = tokio::time::timeout(timeout, read_line_capped(&mut driver.reader, limit)).await;
        let timed_out = read.is_err();
        let answer = match read {
            Ok(answer) => answer,
            Err(_) => {
                sandbox.signal(driver.pid, nix::sys::signal::Signal::SIGINT);
                match tokio::time::timeout(INTERRUPT_GRACE, read_line_capped(&mut driver.reader, limit)).await {
                    Ok(answer) => answer,
                    Err(_) => {
                        sandbox.signal(driver.pid, nix::sys::signal::Signal::SIGKILL);
                        *guard = None;
                        return Ok(serde_json::json!({
                            "output": "", "stderr": "", "timedOut": true,
                            "error": "TimeoutError: the code ignored the interrupt; the interpreter was restarted (its state is lost)",
                        }));
                    }
                }
            }
        };
        let answer = match answer {
            Ok(Line::Whole(line)) => line,
            Ok(Line::TooLong) => {
                // Not our driver's answer: the code wrote into the driver's socket. What it
                // wrote is not read further (the socket goes with the driver).
                sandbox.signal(driver.pid, nix::sys::signal::Signal::SIGKILL);
                *guard = None;
                return Ok(serde_json::json!({
                    "output": "", "stderr": "",
                    "error": format!("the interpreter's answer exceeded {limit} bytes (the code wrote to the driver's socket?); the interpreter was restarted (its state is lost)"),
                }));
            }
            Ok(Line::Eof) | Err(_) => {
                // The interpreter died under the code (EOF): most often the memory limit.
                *guard = None;
                let oom = sandbox.oom_kills().is_some_and(|n| n > oom_before);
                let error = if oom {
                    "MemoryError: the interpreter was killed at the memory limit; it restarts (empty) on the next call"
                } else {
                    "the interpreter died; it restarts (empty) on the next call"
                };
                return Ok(serde_json::json!({"output": "", "stderr": "", "error": error, "oomKilled": oom}));
            }
        };
        let mut value: Value = match serde_json::from_slice(&answer) {
            Ok(value) => value,
            Err(_) => {
                sandbox.signal(driver.pid, nix::sys::signal::Signal::SIGKILL);
                *guard = None;
                return Err(ServiceError::rejected(
                    "the Python interpreter gave no answer; it restarts (empty) on the next call",
                ));
            }
        };
        if timed_out && let Some(obj) = value.as_object_mut() {
            obj.insert("timedOut".into(), Value::Bool(true));
        }
        Ok(value)
    }
}
