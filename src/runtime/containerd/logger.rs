//! Durable output: the shim's binary logging. With `binary:///path/to/runner?...` as a task's
//! stdout, the shim starts `runner` itself as the task's logger — with the task's stdout on
//! fd 3, stderr on fd 4, and fd 5 to close once ready — and keeps it running beside the
//! task. The logger survives the runner process that started the job (and a containerd
//! restart), so a re-adopting runner still finds the whole output. It splits the streams at
//! the setup marker, caps them (head + tail, exact dropped counts) and writes `output.json`
//! into its directory at EOF (atomically: a temp file, then rename).
//!
//! The shim passes the URI's query as arguments in no fixed order (a Go map), so every
//! option is a `--key value` pair and `main` recognises logger mode by `LOGGER_DIR_FLAG`.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::FromRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::runtime::output::{Capture, Captured};
use crate::spec::entry::{Part, Splitter};

pub const LOGGER_DIR_FLAG: &str = "--runner-logger-dir";
const LOGGER_SETUP_FLAG: &str = "--runner-logger-setup";
const LOGGER_LIMIT_FLAG: &str = "--runner-logger-limit";
const LOGGER_LIVE_FLAG: &str = "--runner-logger-live";
/// The file the logger writes at EOF.
pub const OUTPUT_FILE: &str = "output.json";

/// One stream, split and capped.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StreamRecord {
    pub setup: Captured,
    pub command: Captured,
    pub setup_status: Option<i32>,
    /// Milliseconds from the logger's start to the setup marker.
    pub setup_ms: Option<u64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct OutputRecord {
    pub stdout: StreamRecord,
    pub stderr: StreamRecord,
}

/// The stdout URI that makes the shim run us as the task's logger. `live`: a path prefix the
/// logger appends the command's output to as it arrives (`<live>.stdout`, `<live>.stderr`, the
/// first `limit` bytes of each), for `runner logs -f`.
pub fn uri(binary: &Path, dir: &Path, expect_marker: bool, limit: usize, live: Option<&Path>) -> String {
    // The shim parses this as a URL: percent-encode what a path may hold.
    let enc = |s: &str| -> String {
        s.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'/' | b'-' | b'_' | b'.' => (b as char).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect()
    };
    let mut uri = format!(
        "binary://{}?{LOGGER_DIR_FLAG}={}&{LOGGER_SETUP_FLAG}={}&{LOGGER_LIMIT_FLAG}={limit}",
        enc(&binary.to_string_lossy()),
        enc(&dir.to_string_lossy()),
        u8::from(expect_marker)
    );
    if let Some(live) = live {
        uri.push_str(&format!("&{LOGGER_LIVE_FLAG}={}", enc(&live.to_string_lossy())));
    }
    uri
}

/// The live copy of one stream: appended as output arrives, at most `limit` bytes (disk use
/// stays bounded whatever the job prints). Failing to write it only costs the live view.
struct Live {
    file: Option<File>,
    room: usize,
}

impl Live {
    fn open(prefix: Option<&Path>, stream: &str, limit: usize) -> Self {
        let file = prefix.and_then(|p| {
            let mut name = p.as_os_str().to_owned();
            name.push(format!(".{stream}"));
            // Truncated: one logger per attempt, and an earlier run of a job of the same name
            // may have left this file.
            std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(true)
                .open(PathBuf::from(name))
                .ok()
        });
        Live { file, room: limit }
    }

    fn push(&mut self, bytes: &[u8]) {
        let n = bytes.len().min(self.room);
        if let (Some(file), true) = (&mut self.file, n > 0) {
            if file.write_all(&bytes[..n]).is_err() {
                self.file = None;
            }
            self.room -= n;
        }
    }
}

/// Read `output.json` once the logger has written it.
pub fn read_output(dir: &Path) -> Option<OutputRecord> {
    let text = std::fs::read(dir.join(OUTPUT_FILE)).ok()?;
    serde_json::from_slice(&text).ok()
}

fn pump(mut source: File, expect_marker: bool, limit: usize, started: Instant, mut live: Live) -> StreamRecord {
    let mut splitter = Splitter::new(expect_marker);
    let mut setup = Capture::new(limit);
    let mut command = Capture::new(limit);
    let mut setup_ms = None;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match source.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let seen = splitter.marker_seen();
        splitter.feed(&buf[..n], &mut |part, bytes| match part {
            Part::Setup => setup.push(bytes),
            Part::Command => {
                live.push(bytes);
                command.push(bytes);
            }
        });
        if !seen && splitter.marker_seen() {
            setup_ms = Some(started.elapsed().as_millis() as u64);
        }
    }
    splitter.finish(&mut |_, bytes| setup.push(bytes));
    StreamRecord {
        setup: setup.finish(),
        command: command.finish(),
        setup_status: splitter.setup_status(),
        setup_ms,
    }
}

/// Logger mode: `args` are the process arguments after argv[0]. Returns the exit code.
pub fn run(args: &[String]) -> i32 {
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let Some(dir) = value(LOGGER_DIR_FLAG).map(PathBuf::from) else {
        eprintln!("runner logger: {LOGGER_DIR_FLAG} missing");
        return 2;
    };
    let expect_marker = value(LOGGER_SETUP_FLAG).as_deref() == Some("1");
    let limit = value(LOGGER_LIMIT_FLAG)
        .and_then(|v| v.parse().ok())
        .unwrap_or(crate::runtime::output::DEFAULT_OUTPUT_LIMIT);
    // SAFETY: the shim starts the logger with fds 3, 4 and 5 open (stdout, stderr, ready);
    // each is taken over exactly once here and owned by its File from now on.
    let (stdout, stderr, ready) = unsafe { (File::from_raw_fd(3), File::from_raw_fd(4), File::from_raw_fd(5)) };
    if std::fs::create_dir_all(&dir).is_err() {
        eprintln!("runner logger: cannot create {}", dir.display());
        return 2;
    }
    // The shim sends SIGTERM right after closing our pipes at Tasks.Delete (and SIGKILL 12 s
    // later): ignore it, the EOF that follows ends us once the output is written.
    // SAFETY: setting a signal disposition to SIG_IGN touches no Rust state.
    unsafe {
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
    }
    // Closing fd 5 tells the shim we are ready; it starts the task after that.
    drop(ready);
    let started = Instant::now();
    let live = value(LOGGER_LIVE_FLAG).map(PathBuf::from);
    let (live_out, live_err) = (
        Live::open(live.as_deref(), "stdout", limit),
        Live::open(live.as_deref(), "stderr", limit),
    );
    let err_thread = std::thread::spawn(move || pump(stderr, expect_marker, limit, started, live_err));
    let out = pump(stdout, expect_marker, limit, started, live_out);
    let err = err_thread.join().unwrap_or_default();
    let record = OutputRecord {
        stdout: out,
        stderr: err,
    };
    let tmp = dir.join(format!("{OUTPUT_FILE}.tmp"));
    let written = serde_json::to_vec(&record)
        .ok()
        .and_then(|data| std::fs::write(&tmp, data).ok())
        .and_then(|()| std::fs::rename(&tmp, dir.join(OUTPUT_FILE)).ok());
    if written.is_none() {
        eprintln!("runner logger: cannot write {}", dir.join(OUTPUT_FILE).display());
        return 1;
    }
    0
}
