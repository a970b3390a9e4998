//! Output formatting: tables, YAML, JSON, the job's own output.

use std::io::Write;

use serde::Serialize;

use super::OutputFormat;
use crate::job::{JobObject, JobStatus, Reason};
use crate::runtime::ExecResult;
use crate::service::ServiceError;

/// A reason as its API spelling (`BackoffLimitExceeded`).
pub fn reason_text(reason: Option<Reason>) -> String {
    reason
        .and_then(|r| serde_json::to_value(r).ok())
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default()
}

/// "42s", "7m", "3h" since an RFC 3339 time.
pub fn age(created: &str) -> String {
    let Ok(t) = humantime::parse_rfc3339(created) else {
        return "?".into();
    };
    match t.elapsed().map(|d| d.as_secs()).unwrap_or(0) {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

fn output_error(what: &'static str) -> impl Fn(Box<dyn std::error::Error + Send + Sync>) -> ServiceError {
    move |e| ServiceError::internal(what, e)
}

/// A value as YAML, or else pretty JSON, on stdout.
pub fn print_value(value: &impl Serialize, format: Option<OutputFormat>) -> Result<(), ServiceError> {
    let text = match format {
        Some(OutputFormat::Yaml) => {
            serde_saphyr::to_string(value).map_err(|e| output_error("encoding YAML")(e.into()))?
        }
        _ => serde_json::to_string_pretty(value).map_err(|e| output_error("encoding JSON")(e.into()))? + "\n",
    };
    write_out(format_args!("{text}"));
    Ok(())
}

/// One object as itself; several as a kubectl `List`.
pub fn print_objects(objects: &[JobObject], format: OutputFormat) -> Result<(), ServiceError> {
    match objects {
        [one] => print_value(one, Some(format)),
        many => print_value(
            &serde_json::json!({"apiVersion": "v1", "kind": "List", "items": many}),
            Some(format),
        ),
    }
}

/// `apply -o wide` and `get job NAME`: one row per job.
pub fn print_wide(objects: &[JobObject]) {
    outln!(
        "{:<24} {:<10} {:<18} {:>5} {:>10} {:<11} COMMAND",
        "NAME",
        "PHASE",
        "REASON",
        "EXIT",
        "DURATION",
        "BACKEND"
    );
    for o in objects {
        let result = o.status.result.as_ref();
        outln!(
            "{:<24} {:<10} {:<18} {:>5} {:>10} {:<11} {}",
            o.metadata.name,
            format!("{:?}", o.status.phase),
            reason_text(o.status.reason),
            result.map_or_else(|| "-".into(), |r| r.status_code().to_string()),
            result.map_or_else(|| "-".into(), |r| format!("{}ms", r.duration_ms)),
            o.spec.backend.as_str(),
            o.spec.command.join(" "),
        );
    }
}

/// Default `apply` output: the job's own stdout and stderr on ours, then one status line on
/// stderr.
pub fn print_human(name: &str, status: &JobStatus, results: &[(u32, ExecResult)], prefix: bool) {
    let mut stdout = std::io::stdout().lock();
    let mut stderr = std::io::stderr().lock();
    let text = |index: u32, text: &str| -> Vec<u8> {
        if prefix {
            crate::service::logs::prefixed(index, text.as_bytes())
        } else {
            text.as_bytes().to_vec()
        }
    };
    for (index, r) in results {
        if let Some(setup) = r.setup.as_ref().filter(|s| !s.succeeded()) {
            let _ = stdout.write_all(&text(*index, &setup.stdout));
            let _ = stderr.write_all(&text(*index, &setup.stderr));
        }
        let _ = stdout.write_all(&text(*index, &r.stdout));
        let _ = stdout.flush();
        let _ = stderr.write_all(&text(*index, &r.stderr));
        if r.stdout_dropped_bytes > 0 || r.stderr_dropped_bytes > 0 {
            let whose = if prefix {
                format!("index {index}: ")
            } else {
                String::new()
            };
            let _ = writeln!(
                stderr,
                "runner: {whose}output capped: {} stdout and {} stderr bytes dropped",
                r.stdout_dropped_bytes, r.stderr_dropped_bytes
            );
        }
    }
    print_status_line(name, status);
}

/// The one line `apply` ends a job with, on stderr.
pub fn print_status_line(name: &str, status: &JobStatus) {
    let mut stderr = std::io::stderr().lock();
    let detail = match (&status.result, &status.message) {
        (Some(r), _) => {
            let place = match (&r.pool, &r.cold_start) {
                (Some(pool), _) => format!(" pool={pool}"),
                (None, Some(why)) => format!(" cold ({why})"),
                (None, None) => String::new(),
            };
            // A message that says more than the exit code does (an OOM kill's limit, an
            // eviction, SIGSYS) ends the line.
            let said = match &status.message {
                Some(m) if *m != format!("exit code {}", r.status_code()) => format!(": {m}"),
                _ => String::new(),
            };
            format!(" exit={} {}ms{place}{said}", r.status_code(), r.duration_ms)
        }
        (None, Some(m)) => format!(" {m}"),
        (None, None) => String::new(),
    };
    let _ = writeln!(
        stderr,
        "job/{name} {:?} ({}){detail}",
        status.phase,
        reason_text(status.reason)
    );
}

/// Combine exit codes: a runner failure outranks a job failure, which outranks success.
pub fn worst(a: i32, b: i32) -> i32 {
    let rank = |c: i32| match c {
        0 => 0,
        1 => 1,
        2 => 3,
        _ => 2,
    };
    if rank(b) > rank(a) { b } else { a }
}

/// Write raw bytes to stdout (flushed: a follower's reader sees them now) or stderr.
pub fn write_stream(stdout: bool, data: &[u8]) {
    if stdout {
        let mut out = std::io::stdout().lock();
        gone_is_quiet(out.write_all(data).and_then(|()| out.flush()));
    } else {
        let _ = std::io::stderr().write_all(data);
    }
}

/// Whether a closed stdout (a reader gone: `| head -1`) ends the process (quietly, exit 0),
/// or only the printing (`apply`, whose jobs run in this process and must end with their
/// results recorded).
static KEEP_RUNNING_WITHOUT_STDOUT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// stdout was found closed: nothing more is printed.
static STDOUT_GONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// For verbs whose work goes on when nobody reads their output any more.
pub fn keep_running_without_stdout() {
    KEEP_RUNNING_WITHOUT_STDOUT.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// What the CLI prints on stdout (`outln!`, `out!`): a reader that went away is not an error
/// (Rust's `println!` panics on EPIPE; a pipe into `head` is normal use).
pub fn write_out(args: std::fmt::Arguments<'_>) {
    use std::sync::atomic::Ordering;
    if STDOUT_GONE.load(Ordering::Relaxed) {
        return;
    }
    gone_is_quiet(std::io::stdout().lock().write_fmt(args));
}

fn gone_is_quiet(written: std::io::Result<()>) {
    use std::sync::atomic::Ordering;
    if let Err(e) = written
        && e.kind() == std::io::ErrorKind::BrokenPipe
    {
        STDOUT_GONE.store(true, Ordering::Relaxed);
        if !KEEP_RUNNING_WITHOUT_STDOUT.load(Ordering::Relaxed) {
            std::process::exit(0);
        }
    }
}

/// `println!` for the CLI's stdout, quiet when the reader is gone (see `write_out`).
macro_rules! outln {
    () => { $crate::cli::output::write_out(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::cli::output::write_out(format_args!("{}\n", format_args!($($arg)*))) };
}

/// `print!` for the CLI's stdout (see `outln!`).
macro_rules! out {
    ($($arg:tt)*) => { $crate::cli::output::write_out(format_args!($($arg)*)) };
}

pub(crate) use {out, outln};
