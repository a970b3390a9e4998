//! Terminals in sessions of `runner serve` against the private containerd of scripts/test.sh:
//! the WebSocket (`GET /v1/sessions/{id}/pty`) driving `python3 -i` and busybox `vi`, window
//! sizes seen by `stty size`, Ctrl-C reaching the foreground `sleep`, the bounds, and
//! `runner exec -it` on a real terminal (raw mode on, then restored).

mod common;

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use common::*;
use tokio_tungstenite::tungstenite::{self, Message, client::IntoClientRequest};

const WHY: &str = "needs a private containerd and the Python image: run scripts/test.sh";

type Server = ImagesServer;

fn server() -> Server {
    serve_test_images()
}

fn session(s: &Server, image: &str) -> String {
    let (status, v) = s.served.call(
        "POST",
        "/v1/sessions",
        Some(&format!(r#"{{"environment": {{"image": "{image}"}}}}"#)),
    );
    assert_eq!(status, 201, "{v}");
    v["id"].as_str().unwrap().to_string()
}

type Socket = tungstenite::WebSocket<std::net::TcpStream>;

/// One terminal's WebSocket, read with a deadline.
struct Term {
    ws: Socket,
    seen: String,
    exit: Option<serde_json::Value>,
    closed: bool,
}

fn open(s: &Server, sid: &str, query: &str) -> Result<Term, (u16, String)> {
    let addr = s.served.url.trim_start_matches("http://").to_string();
    let mut request = format!("ws://{addr}/v1/sessions/{sid}/pty?{query}")
        .into_client_request()
        .unwrap();
    request
        .headers_mut()
        .insert("authorization", format!("Bearer {SERVE_TOKEN}").parse().unwrap());
    let stream = std::net::TcpStream::connect(&addr).unwrap();
    match tungstenite::client::client(request, stream) {
        Ok((ws, _)) => {
            ws.get_ref().set_read_timeout(Some(Duration::from_millis(100))).unwrap();
            Ok(Term {
                ws,
                seen: String::new(),
                exit: None,
                closed: false,
            })
        }
        Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(r))) => Err((
            r.status().as_u16(),
            String::from_utf8_lossy(r.body().as_deref().unwrap_or_default()).into_owned(),
        )),
        Err(e) => panic!("opening a terminal: {e}"),
    }
}

impl Term {
    /// Take one message, waiting at most ~100 ms; false when none came.
    fn pump(&mut self) -> bool {
        match self.ws.read() {
            Ok(Message::Binary(b)) => self.seen.push_str(&String::from_utf8_lossy(&b)),
            Ok(Message::Text(t)) => {
                let v: serde_json::Value = serde_json::from_str(t.as_str()).unwrap();
                assert_ne!(v["type"], "error", "the server refused a control message: {v}");
                if v["type"] == "exit" {
                    self.exit = Some(v);
                }
            }
            Ok(Message::Close(_)) => self.closed = true,
            Ok(_) => {}
            Err(tungstenite::Error::Io(e))
                if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) =>
            {
                return false;
            }
            Err(tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed) => {
                self.closed = true;
                return false;
            }
            Err(e) => panic!("reading the terminal: {e}"),
        }
        true
    }

    /// Wait until the screen output so far contains `needle`; the output up to its end, taken.
    fn expect(&mut self, needle: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(i) = self.seen.find(needle) {
                let rest = self.seen.split_off(i + needle.len());
                return std::mem::replace(&mut self.seen, rest);
            }
            assert!(
                Instant::now() < deadline && !self.closed,
                "{needle:?} did not appear; the terminal showed {:?}",
                self.seen
            );
            self.pump();
        }
    }

    fn keys(&mut self, keys: &str) {
        self.ws.send(Message::Binary(keys.as_bytes().to_vec().into())).unwrap();
    }

    fn control(&mut self, v: serde_json::Value) {
        self.ws.send(Message::Text(v.to_string().into())).unwrap();
    }

    /// The exit message, then the close.
    fn exit(&mut self) -> serde_json::Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.closed {
            assert!(Instant::now() < deadline, "no close; seen {:?}", self.seen);
            self.pump();
        }
        self.exit.clone().expect("an exit message before the close")
    }
}

#[test]
#[ignore = "needs a private containerd and the Python image: run scripts/test.sh"]
fn python_repl_on_a_terminal_resizes_and_interrupts() {
    let _ = WHY;
    let s = server();
    let sid = session(&s, "local/python:3.11");
    let mut t = open(&s, &sid, "arg=python3&arg=-i&rows=30&cols=100").unwrap();
    t.expect(">>> ");
    t.keys("import os, sys; print(sys.stdin.isatty(), os.get_terminal_size())\r");
    t.expect("True os.terminal_size(columns=100, lines=30)");
    t.control(serde_json::json!({"type": "resize", "rows": 40, "cols": 120}));
    // The REPL's line editor answers SIGWINCH by redrawing: wait for the prompt again.
    t.keys("print(os.get_terminal_size())\r");
    t.expect("os.terminal_size(columns=120, lines=40)");
    // Ctrl-C as a key: the line discipline makes it SIGINT for the foreground group.
    t.keys("import time; time.sleep(60)\r");
    std::thread::sleep(Duration::from_millis(300));
    t.keys("\x03");
    t.expect("KeyboardInterrupt");
    // And as a signal message.
    t.keys("time.sleep(60)\r");
    std::thread::sleep(Duration::from_millis(300));
    t.control(serde_json::json!({"type": "signal", "signal": "INT"}));
    t.expect("KeyboardInterrupt");
    t.keys("exit(3)\r");
    assert_eq!(t.exit()["exitCode"], 3);
}

#[test]
#[ignore = "needs a private containerd and the Python image: run scripts/test.sh"]
fn busybox_shell_and_vi_on_a_terminal() {
    let s = server();
    let sid = session(&s, "local/busybox:1.35");
    // The default command: the image's shell.
    let mut t = open(&s, &sid, "rows=30&cols=100").unwrap();
    t.keys("stty size; echo $TERM\r");
    t.expect("30 100");
    t.expect("xterm-256color");
    t.control(serde_json::json!({"type": "resize", "rows": 12, "cols": 34}));
    t.keys("stty size\r");
    t.expect("12 34");
    // Ctrl-C reaches the foreground `sleep`, not the shell (which, as any interactive shell,
    // drops the rest of a list whose command SIGINT killed: hence two lines).
    t.keys("sleep 60\r");
    std::thread::sleep(Duration::from_millis(300));
    t.keys("\x03");
    t.keys("echo after-$?\r");
    t.expect("after-130");
    // vi: keys in, a screen out, a file written.
    t.keys("vi /workspace/note.txt\r");
    t.expect("~");
    t.keys("ihello from vi");
    t.expect("hello from vi");
    // Escape alone (followed at once, vi would read it as the start of a key's sequence).
    std::thread::sleep(Duration::from_millis(300));
    t.keys("\x1b");
    std::thread::sleep(Duration::from_millis(300));
    t.keys(":wq\r");
    t.expect("# ");
    t.keys("cat /workspace/note.txt; echo done-$?\r");
    t.expect("hello from vi");
    t.expect("done-0");
    t.keys("exit 7\r");
    assert_eq!(t.exit()["exitCode"], 7);
    let (status, body) = s
        .served
        .call("GET", &format!("/v1/sessions/{sid}/files?path=note.txt"), None);
    assert_eq!((status, body), (200, serde_json::json!("hello from vi\n")));
}

#[test]
#[ignore = "needs a private containerd and the Python image: run scripts/test.sh"]
fn terminals_are_checked_and_bounded() {
    let s = server();
    let sid = session(&s, "local/busybox:1.35");
    let refused = |query: &str| open(&s, &sid, query).err().expect("refused");
    assert_eq!(refused("rows=0").0, 400);
    assert_eq!(refused("cols=5000").0, 400);
    assert_eq!(refused("nope=1").0, 400);
    let (status, body) = refused("arg=/no/such/program");
    assert_eq!(status, 422, "{body}");
    assert!(body.contains("/no/such/program"), "{body}");
    assert_eq!(open(&s, "s-nope", "").err().unwrap().0, 404);

    // A client that reads nothing while the program writes without end: the server keeps a
    // bounded amount (the program blocks), and the terminal still hangs up on close.
    let pid = s.served.child.id();
    let rss = || {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap().to_string();
        line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap()
    };
    let mut flood = open(&s, &sid, "arg=yes&arg=0123456789012345678901234567890123456789").unwrap();
    flood.expect("0123");
    let before = rss();
    std::thread::sleep(Duration::from_secs(3));
    let grown = rss().saturating_sub(before);
    assert!(
        grown < 32 * 1024,
        "the server grew by {grown} KiB for an unread terminal"
    );

    // At most 16 terminals at once (the flood is one).
    let mut open_ones: Vec<Term> = (0..15).map(|_| open(&s, &sid, "arg=sleep&arg=600").unwrap()).collect();
    let (status, body) = refused("arg=true");
    assert_eq!(status, 409, "{body}");
    // Hanging up ends the program (SIGHUP, or a kill after the grace).
    let mut t = open_ones.pop().unwrap();
    t.ws.close(None).unwrap();
    while !t.closed {
        t.pump();
    }
    let mut again = {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            match open(&s, &sid, "arg=sh") {
                Ok(t) => break t,
                Err((409, _)) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(200)),
                Err(e) => panic!("{e:?}"),
            }
        }
    };
    again.keys("echo alive\r");
    again.expect("alive");
    drop(flood);
    let (status, _) = s.served.call("DELETE", &format!("/v1/sessions/{sid}"), None);
    assert_eq!(status, 204);
    // The session's end ends its terminals.
    again.exit();
}

/// A refused control message is answered before the output of any input sent after it: a
/// client that sends a bad resize, then a command, and waits for the command's echo must find
/// the refusal already read (the Python client's `Terminal.errors` relies on it).
#[test]
#[ignore = "needs a private containerd and the Python image: run scripts/test.sh"]
fn a_refusal_comes_before_the_output_of_later_input() {
    let s = server();
    // The host backend: its output is quickest to follow the input, so a misordered refusal
    // shows there (before the fix this failed within 5-30 rounds; in a container it did not).
    // 60 rounds: one suite run after the fix failed at round 191 of 200, which no run since
    // has repeated (see the replies drained before each chunk in `api::terminals`).
    let (status, v) = s
        .served
        .call("POST", "/v1/sessions", Some(r#"{"environment": {"backend": "host"}}"#));
    assert_eq!(status, 201, "{v}");
    let sid = v["id"].as_str().unwrap().to_string();
    for round in 0..60 {
        // A new terminal each round: the refusal then races the shell's first output too.
        let mut t = open(&s, &sid, "arg=sh").unwrap();
        let marker = format!("mark{round}x");
        // Both in one write, so the server reads them together.
        let resize = serde_json::json!({"type": "resize", "rows": 0, "cols": 10});
        t.ws.write(Message::Text(resize.to_string().into())).unwrap();
        t.ws.write(Message::Binary(format!("echo {marker}\r").into_bytes().into()))
            .unwrap();
        t.ws.flush().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut refused = false;
        let mut seen = String::new();
        loop {
            assert!(Instant::now() < deadline, "round {round}: neither came; seen {seen:?}");
            match t.ws.read() {
                Ok(Message::Text(m)) => {
                    let v: serde_json::Value = serde_json::from_str(m.as_str()).unwrap();
                    assert_eq!(v["type"], "error", "{v}");
                    assert!(v["message"].as_str().unwrap().contains("rows"), "{v}");
                    assert!(!refused, "round {round}: two refusals for one message");
                    refused = true;
                }
                Ok(Message::Binary(b)) => {
                    seen.push_str(&String::from_utf8_lossy(&b));
                    if let Some(i) = seen.find(&marker) {
                        assert!(
                            refused,
                            "round {round}: the echo of later input came before the refusal; seen {seen:?}"
                        );
                        // The echo and the command's own line: both, before the next round.
                        if seen[i + marker.len()..].contains(&marker) {
                            break;
                        }
                    }
                }
                Ok(other) => panic!("round {round}: {other:?}"),
                Err(tungstenite::Error::Io(e))
                    if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(e) => panic!("round {round}: {e}"),
            }
        }
    }
    let (status, _) = s.served.call("DELETE", &format!("/v1/sessions/{sid}"), None);
    assert_eq!(status, 204);
}

/// A terminal pair for `runner exec -it`: the master (ours) and the slave (its stdio).
fn pty(rows: u16, cols: u16) -> nix::pty::OpenptyResult {
    let ws = nix::pty::Winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    nix::pty::openpty(&ws, None).unwrap()
}

fn read_until(master: &mut std::fs::File, seen: &mut String, needle: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut buf = [0u8; 4096];
    while !seen.contains(needle) {
        assert!(Instant::now() < deadline, "{needle:?} did not appear: {seen:?}");
        let mut fds = [libc::pollfd {
            fd: master.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        // SAFETY: one pollfd, pointing at `fds`.
        if unsafe { libc::poll(fds.as_mut_ptr(), 1, 100) } <= 0 {
            continue;
        }
        match master.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => seen.push_str(&String::from_utf8_lossy(&buf[..n])),
        }
    }
    assert!(seen.contains(needle), "{needle:?} did not appear: {seen:?}");
}

#[test]
#[ignore = "needs a private containerd and the Python image: run scripts/test.sh"]
fn runner_exec_it_connects_a_real_terminal() {
    let s = server();
    let sid = session(&s, "local/busybox:1.35");
    let pair = pty(33, 99);
    let before = nix::sys::termios::tcgetattr(&pair.slave).unwrap();
    let stdio = || std::process::Stdio::from(pair.slave.try_clone().unwrap());
    let mut cmd = std::process::Command::new(runner_bin());
    cmd.args(["exec", "-it", &sid, "--", "sh"])
        .env("RUNNER_URL", &s.served.url)
        .env("RUNNER_TOKEN", SERVE_TOKEN)
        .env("TERM", "vt100")
        .stdin(stdio())
        .stdout(stdio())
        .stderr(stdio());
    // Its own session, whose controlling terminal is the pair's (as a shell's child).
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let mut master = std::fs::File::from(pair.master);
    let mut seen = String::new();
    master.write_all(b"stty size; echo $TERM\r").unwrap();
    read_until(&mut master, &mut seen, "33 99");
    read_until(&mut master, &mut seen, "vt100");
    // The local terminal is raw while connected: no local echo or line editing.
    let raw = nix::sys::termios::tcgetattr(&pair.slave).unwrap();
    assert!(!raw.local_flags.contains(nix::sys::termios::LocalFlags::ICANON));
    // A new local size goes across on SIGWINCH.
    let ws = libc::winsize {
        ws_row: 21,
        ws_col: 77,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    assert_eq!(unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &ws) }, 0);
    std::thread::sleep(Duration::from_millis(300));
    seen.clear();
    master.write_all(b"stty size\r").unwrap();
    read_until(&mut master, &mut seen, "21 77");
    // Ctrl-C goes to the sandbox's foreground process, not to the local runner.
    master.write_all(b"sleep 60\r").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    master.write_all(b"\x03").unwrap();
    master.write_all(b"echo after-$?\r").unwrap();
    read_until(&mut master, &mut seen, "after-130");
    master.write_all(b"exit 5\r").unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(5));
    let after = nix::sys::termios::tcgetattr(&pair.slave).unwrap();
    assert_eq!(
        after.local_flags, before.local_flags,
        "the terminal's mode was not restored"
    );
    assert_eq!(after.input_flags, before.input_flags);

    // A session that does not exist: a clear error, status 2.
    let out = std::process::Command::new(runner_bin())
        .args(["exec", "-it", "s-nope", "--", "sh"])
        .env("RUNNER_URL", &s.served.url)
        .env("RUNNER_TOKEN", SERVE_TOKEN)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("s-nope"), "{out:?}");
}

#[test]
#[ignore = "needs a private containerd and the Python image: run scripts/test.sh"]
fn swerex_interactive_commands_run_on_a_terminal_in_the_container() {
    let s = server();
    let sid = session(&s, "local/python:3.11");
    let run = |body: serde_json::Value| {
        let (status, v) = s.served.call(
            "POST",
            &format!("/v1/sessions/{sid}/swerex/run_in_session"),
            Some(&body.to_string()),
        );
        (status, v)
    };
    let (status, v) = s
        .served
        .call("POST", &format!("/v1/sessions/{sid}/swerex/create_session"), Some("{}"));
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        run(serde_json::json!({"action_type": "bash", "command": "cd /tmp && export FOO='a b'"})).0,
        200
    );
    let interactive = |command: &str, expect: &str| serde_json::json!({"action_type": "bash", "command": command, "is_interactive_command": true, "expect": [expect], "timeout": 20});
    let (_, v) = run(interactive("python3 -q", ">>> "));
    assert_eq!(v["expect_string"], ">>> ", "{v}");
    // The terminal's bash started where the session's shell was, with its exports.
    let (_, v) = run(interactive("import os; print(os.getcwd(), os.environ['FOO'])", ">>> "));
    assert_eq!(v["output"], "/tmp a b", "{v}");
    let (status, v) = run(
        serde_json::json!({"action_type": "bash", "command": "import time; time.sleep(60)", "is_interactive_command": true, "expect": [">>> "], "timeout": 1}),
    );
    assert_eq!(status, 511, "{v}");
    assert_eq!(
        v["swerexception"]["class_path"],
        "swerex.exceptions.CommandTimeoutError"
    );
    let (_, v) = run(serde_json::json!({"action_type": "bash_interrupt", "expect": [">>> "]}));
    assert!(v["output"].as_str().unwrap().contains("KeyboardInterrupt"), "{v}");
    let (_, v) = run(
        serde_json::json!({"action_type": "bash", "command": "exit()", "is_interactive_quit": true, "timeout": 20}),
    );
    assert_eq!(v["expect_string"], "SHELLPS1PREFIX", "{v}");
    let (_, v) = run(serde_json::json!({"action_type": "bash", "command": "echo $FOO; pwd"}));
    assert_eq!(v["output"], "a b\n/tmp\n", "{v}");
}
