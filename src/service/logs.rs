//! A job's output as `runner logs` and `GET /v1/jobs/{name}/logs` read it, and as a
//! foreground `apply` prints it: each selected attempt once it ended, or — following — as
//! its logger appends it; optionally only the last lines of each (`--tail`), its setup's
//! output (`--setup`), and every line prefixed with its index (`--prefix`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use super::jobs::{POLL, record};
use super::reconcile::adopt_if_orphaned;
use super::{Context, ServiceError};
use crate::job::JobStatus;
use crate::job::supervisor::attempt_file;
use crate::owner::owner_alive;
use crate::runtime::ExecResult;

/// What to read of a job's output.
#[derive(Clone, Debug, Default)]
pub struct LogOptions {
    /// Keep reading as attempts write, until the job ends.
    pub follow: bool,
    /// Only this attempt number of each index (else each index's last).
    pub attempt: Option<u32>,
    /// Only this completion index.
    pub index: Option<u32>,
    /// Only the last this many lines of each attempt's stream (then, following, what comes).
    pub tail: Option<usize>,
    /// The setup's output instead of the command's (once each attempt ended).
    pub setup: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stream {
    Stdout,
    Stderr,
}

const STREAMS: [(Stream, &str); 2] = [(Stream::Stdout, "stdout"), (Stream::Stderr, "stderr")];

/// A piece of a job's output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LogChunk {
    Output {
        index: u32,
        stream: Stream,
        data: Vec<u8>,
    },
    /// The attempt shown for `index` ended: nothing more of it comes.
    End {
        index: u32,
    },
    /// Something to tell the reader about the output (a cap cut it, there is none).
    Notice(String),
}

/// Which attempts are shown: index I / attempt N when given, else the last attempt of
/// every index.
pub(super) fn selected(status: &JobStatus, attempt: Option<u32>, index: Option<u32>) -> Vec<(u32, u32)> {
    let mut out: BTreeMap<u32, u32> = BTreeMap::new();
    for a in &status.attempts {
        if index.is_some_and(|i| i != a.index) {
            continue;
        }
        if let Some(n) = attempt {
            if a.attempt == n {
                out.insert(a.index, n);
            }
            continue;
        }
        let e = out.entry(a.index).or_insert(a.attempt);
        *e = (*e).max(a.attempt);
    }
    out.into_iter().collect()
}

/// Reads a job's output (see the module's comment).
pub struct Logs {
    ctx: Context,
    name: String,
    options: LogOptions,
    printed: HashSet<(u32, u32)>,
    /// How far each running attempt's live output was read (stdout, stderr).
    streamed: HashMap<(u32, u32), [u64; 2]>,
    finished: bool,
}

impl Logs {
    pub fn new(ctx: &Context, name: &str, options: LogOptions) -> Self {
        Logs {
            ctx: ctx.clone(),
            name: name.to_string(),
            options,
            printed: HashSet::new(),
            streamed: HashMap::new(),
            finished: false,
        }
    }

    /// The next output; `None` once there is nothing more. Following, a job whose supervisor
    /// died is re-adopted, as `wait` does. The files are read on the blocking pool.
    pub async fn next(&mut self) -> Result<Option<Vec<LogChunk>>, ServiceError> {
        loop {
            if self.finished {
                return Ok(None);
            }
            let record = record(&self.ctx, &self.name).await?;
            if !self.finished && self.printed.is_empty() && self.streamed.is_empty() {
                self.check_wanted(&record.view, &record.status)?;
            }
            if self.options.follow && !record.status.is_terminal() && adopt_if_orphaned(&self.ctx, &self.name).await? {
                // A new supervisor owns it now: look again rather than end with the dead one.
                continue;
            }
            let done = record.status.is_terminal() || !record.owner.as_deref().is_some_and(owner_alive);
            let chunks = self.collect_blocking(record.status).await?;
            if !self.options.follow || done {
                self.finished = true;
            }
            if !chunks.is_empty() || self.finished {
                return Ok(Some(chunks));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// An index the job does not have, or an attempt it did not make (and, unless followed
    /// while the job runs, will not): said, as kubectl says a container the pod lacks, rather
    /// than printing nothing.
    fn check_wanted(&self, spec: &crate::job::JobSpecView, status: &JobStatus) -> Result<(), ServiceError> {
        let name = &self.name;
        if let Some(index) = self.options.index
            && index >= spec.completions
        {
            let last = spec.completions.saturating_sub(1);
            return Err(ServiceError::field(
                "index",
                format!("job {name} has completion indexes 0 to {last}: there is no index {index}"),
            ));
        }
        let Some(attempt) = self.options.attempt else {
            return Ok(());
        };
        let may_come = self.options.follow && !status.is_terminal();
        let made = status
            .attempts
            .iter()
            .any(|a| a.attempt == attempt && self.options.index.is_none_or(|i| i == a.index));
        if made || may_come {
            return Ok(());
        }
        let last = status
            .attempts
            .iter()
            .filter(|a| self.options.index.is_none_or(|i| i == a.index))
            .map(|a| a.attempt)
            .max();
        let made = match last {
            Some(last) => format!("attempts 0 to {last}"),
            None => "no attempt yet".into(),
        };
        let of = self.options.index.map_or(String::new(), |i| format!(" index {i}"));
        Err(ServiceError::field(
            "attempt",
            format!("job {name}{of} made {made}: there is no attempt {attempt}"),
        ))
    }

    async fn collect_blocking(&mut self, status: JobStatus) -> Result<Vec<LogChunk>, ServiceError> {
        // The reader's state travels to the blocking pool and back with the chunks.
        let mut state = Reader {
            logs_dir: self.ctx.config.logs_dir(),
            name: self.name.clone(),
            options: self.options.clone(),
            printed: std::mem::take(&mut self.printed),
            streamed: std::mem::take(&mut self.streamed),
        };
        let (state, chunks) = Context::blocking(move || {
            let chunks = state.collect(&status);
            Ok((state, chunks))
        })
        .await?;
        self.printed = state.printed;
        self.streamed = state.streamed;
        chunks
    }
}

struct Reader {
    logs_dir: std::path::PathBuf,
    name: String,
    options: LogOptions,
    printed: HashSet<(u32, u32)>,
    streamed: HashMap<(u32, u32), [u64; 2]>,
}

impl Reader {
    fn collect(&mut self, status: &JobStatus) -> Result<Vec<LogChunk>, ServiceError> {
        let mut out = Vec::new();
        for (i, n) in selected(status, self.options.attempt, self.options.index) {
            if self.printed.contains(&(i, n)) {
                continue;
            }
            let finished = status
                .attempts
                .iter()
                .any(|a| a.index == i && a.attempt == n && a.completion_time.is_some());
            let file = |ext: &str| attempt_file(&self.logs_dir, &self.name, i, n, ext);
            if !finished {
                if self.options.follow && !self.options.setup {
                    // Running: what its logger appended since the last look (at the first
                    // look, only its last lines when a tail is asked for).
                    let first = !self.streamed.contains_key(&(i, n));
                    let offsets = self.streamed.entry((i, n)).or_default();
                    for (k, (stream, ext)) in STREAMS.into_iter().enumerate() {
                        let path = file(&format!("live.{ext}"));
                        if first && let Some(lines) = self.options.tail {
                            offsets[k] = tail_offset(&path, lines)?;
                        }
                        read_new(&path, &mut offsets[k], i, stream, &mut out)?;
                    }
                }
                continue;
            }
            let stored: Option<ExecResult> = std::fs::read(file("json"))
                .ok()
                .and_then(|j| serde_json::from_slice(&j).ok());
            if self.options.setup {
                match stored.as_ref().and_then(|r| r.setup.as_ref()) {
                    Some(setup) => {
                        for (stream, text) in [(Stream::Stdout, &setup.stdout), (Stream::Stderr, &setup.stderr)] {
                            let text = tail_text(text, self.options.tail);
                            if !text.is_empty() {
                                out.push(LogChunk::Output {
                                    index: i,
                                    stream,
                                    data: text.as_bytes().to_vec(),
                                });
                            }
                        }
                    }
                    None => out.push(LogChunk::Notice(format!(
                        "attempt {i}-{n} ran no setup (its Environment has none, or disableSetup)"
                    ))),
                }
                out.push(LogChunk::End { index: i });
                self.printed.insert((i, n));
                continue;
            }
            // Ended. Followed while it ran: the rest of its live copy (the host backend has
            // none: then the stored output). Otherwise the stored output, exactly.
            let followed = self.streamed.remove(&(i, n));
            let mut offsets = followed.unwrap_or_default();
            for (k, (stream, ext)) in STREAMS.into_iter().enumerate() {
                let copy = file(&format!("live.{ext}"));
                let source = if followed.is_some() && (copy.exists() || offsets[k] > 0) {
                    copy
                } else {
                    file(ext)
                };
                if followed.is_none()
                    && let Some(lines) = self.options.tail
                {
                    offsets[k] = tail_offset(&source, lines)?;
                }
                read_new(&source, &mut offsets[k], i, stream, &mut out)?;
            }
            if let Some(r) =
                stored.filter(|r| followed.is_some() && r.stdout_dropped_bytes + r.stderr_dropped_bytes > 0)
            {
                out.push(LogChunk::Notice(format!(
                    "attempt {i}-{n} printed more than the output cap; {} stdout and {} stderr bytes are not kept (`runner logs {}` shows the head and tail)",
                    r.stdout_dropped_bytes, r.stderr_dropped_bytes, self.name
                )));
            }
            out.push(LogChunk::End { index: i });
            self.printed.insert((i, n));
        }
        Ok(out)
    }
}

fn read_error(path: &Path, e: std::io::Error) -> ServiceError {
    ServiceError::internal(format!("reading {}", path.display()), e)
}

/// What `path` holds past `*offset`, as a chunk of `stream`; a missing file holds nothing yet.
fn read_new(
    path: &Path,
    offset: &mut u64,
    index: u32,
    stream: Stream,
    out: &mut Vec<LogChunk>,
) -> Result<(), ServiceError> {
    let mut file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(read_error(path, e)),
    };
    let mut data = Vec::new();
    file.seek(SeekFrom::Start(*offset))
        .and_then(|_| file.read_to_end(&mut data))
        .map_err(|e| read_error(path, e))?;
    if !data.is_empty() {
        *offset += data.len() as u64;
        out.push(LogChunk::Output { index, stream, data });
    }
    Ok(())
}

/// Where the last `lines` lines of `path` begin, read backwards in blocks (a long log is
/// not read whole for its tail). A last line without its newline counts as a line.
fn tail_offset(path: &Path, lines: usize) -> Result<u64, ServiceError> {
    let mut file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(read_error(path, e)),
    };
    let len = file.metadata().map_err(|e| read_error(path, e))?.len();
    if lines == 0 {
        return Ok(len);
    }
    let mut block = vec![0u8; 64 * 1024];
    let (mut end, mut seen) = (len, 0usize);
    while end > 0 {
        let start = end.saturating_sub(block.len() as u64);
        let chunk = &mut block[..(end - start) as usize];
        file.seek(SeekFrom::Start(start))
            .and_then(|_| file.read_exact(chunk))
            .map_err(|e| read_error(path, e))?;
        for (i, &b) in chunk.iter().enumerate().rev() {
            let at = start + i as u64;
            // The file's last byte ends the last line; it does not start another.
            if b == b'\n' && at + 1 != len {
                seen += 1;
                if seen == lines {
                    return Ok(at + 1);
                }
            }
        }
        end = start;
    }
    Ok(0)
}

/// The last `lines` lines of `text` (all of it without a tail).
pub fn tail_text(text: &str, lines: Option<usize>) -> &str {
    let Some(lines) = lines else { return text };
    if lines == 0 {
        return "";
    }
    let body = text.strip_suffix('\n').unwrap_or(text);
    match body.rmatch_indices('\n').nth(lines - 1) {
        Some((at, _)) => &text[at + 1..],
        None => text,
    }
}

/// A partial line longer than this is printed as a line of its own: a command that never
/// prints a newline cannot make the reader buffer without end.
const MAX_PARTIAL: usize = 64 * 1024;

/// Puts `[INDEX] ` before every line, per index and stream, keeping a line whose end has not
/// come yet until it comes (or its attempt ends), so indexes read together never interleave
/// inside a line.
#[derive(Default)]
pub struct Prefixer {
    partial: BTreeMap<(u32, Stream), Vec<u8>>,
}

impl Prefixer {
    /// The whole lines `data` completes, prefixed.
    pub fn push(&mut self, index: u32, stream: Stream, data: &[u8]) -> Vec<u8> {
        let buf = self.partial.entry((index, stream)).or_default();
        buf.extend_from_slice(data);
        let mut cut = buf.iter().rposition(|&b| b == b'\n').map_or(0, |p| p + 1);
        if buf.len() - cut >= MAX_PARTIAL {
            cut = buf.len();
        }
        let whole: Vec<u8> = buf.drain(..cut).collect();
        prefixed(index, &whole)
    }

    /// The attempt of `index` ended: its unfinished lines, prefixed and ended.
    pub fn end(&mut self, index: u32) -> Vec<(Stream, Vec<u8>)> {
        let mut out = Vec::new();
        for stream in [Stream::Stdout, Stream::Stderr] {
            if let Some(rest) = self.partial.remove(&(index, stream))
                && !rest.is_empty()
            {
                out.push((stream, prefixed(index, &rest)));
            }
        }
        out
    }
}

/// Every line of `data` with `[index] ` before it; each line ends with a newline.
pub fn prefixed(index: u32, data: &[u8]) -> Vec<u8> {
    let tag = format!("[{index}] ");
    let mut out = Vec::with_capacity(data.len() + tag.len());
    for line in data.split_inclusive(|&b| b == b'\n') {
        out.extend_from_slice(tag.as_bytes());
        out.extend_from_slice(line);
        if !line.ends_with(b"\n") {
            out.push(b'\n');
        }
    }
    out
}

/// Each selected index's last attempt's stored result, in index order: what a foreground
/// `apply` prints once the job ended (the files are small: capped output).
pub fn results(
    logs_dir: &Path,
    name: &str,
    status: &JobStatus,
    index: Option<u32>,
) -> Result<Vec<(u32, ExecResult)>, ServiceError> {
    let mut out = Vec::new();
    for (i, n) in selected(status, None, index) {
        let path = attempt_file(logs_dir, name, i, n, "json");
        match std::fs::read(&path) {
            Ok(data) => out.push((
                i,
                serde_json::from_slice(&data)
                    .map_err(|e| ServiceError::internal(format!("reading {}", path.display()), e))?,
            )),
            // An attempt that never ran (deleted before it started) has no result.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(read_error(&path, e)),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tail_counts_lines_from_the_end_with_or_without_the_last_newline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let at = |text: &str, n: usize| {
            std::fs::write(&path, text).unwrap();
            let off = tail_offset(&path, n).unwrap() as usize;
            assert_eq!(&text[off..], tail_text(text, Some(n)), "{text:?} {n}");
            text[off..].to_string()
        };
        assert_eq!(at("a\nb\nc\n", 2), "b\nc\n");
        assert_eq!(at("a\nb\nc", 2), "b\nc");
        assert_eq!(at("a\nb\nc\n", 5), "a\nb\nc\n");
        assert_eq!(at("a\nb\nc\n", 0), "");
        assert_eq!(at("", 3), "");
        assert_eq!(at("\n\n\n", 1), "\n");
        // Longer than one block read backwards.
        let long: String = (0..40_000).map(|i| format!("line {i}\n")).collect();
        assert_eq!(at(&long, 3), "line 39997\nline 39998\nline 39999\n");
        assert_eq!(tail_text("x\ny\n", None), "x\ny\n");
        assert_eq!(tail_offset(&dir.path().join("missing"), 3).unwrap(), 0);
    }

    #[test]
    fn prefixed_lines_never_mix_indexes_inside_a_line() {
        let mut p = Prefixer::default();
        assert_eq!(p.push(0, Stream::Stdout, b"hel"), b"");
        assert_eq!(p.push(1, Stream::Stdout, b"one\ntw"), b"[1] one\n");
        assert_eq!(p.push(0, Stream::Stdout, b"lo\nwor"), b"[0] hello\n");
        assert_eq!(p.push(0, Stream::Stderr, b"err\n"), b"[0] err\n");
        assert_eq!(p.end(0), vec![(Stream::Stdout, b"[0] wor\n".to_vec())]);
        assert_eq!(p.end(1), vec![(Stream::Stdout, b"[1] tw\n".to_vec())]);
        // A line without end is let out in pieces, not kept whole.
        let big = vec![b'x'; MAX_PARTIAL];
        assert_eq!(p.push(2, Stream::Stdout, &big).len(), MAX_PARTIAL + 5);
        assert!(p.end(2).is_empty());
    }
}
