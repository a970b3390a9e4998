//! The resolver's log: a file under the network directory (`/run`, a tmpfs: memory), so it is
//! size-capped and rotated (one old file kept), and rate-limited (a sandbox that makes every
//! query fail must not make the resolver write a line per query): lines over the rate are
//! counted, and the count is written with the next line that gets through.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

use super::limits::Bucket;

pub struct Log {
    path: PathBuf,
    max_bytes: u64,
    state: Mutex<State>,
}

struct State {
    file: Option<std::fs::File>,
    size: u64,
    bucket: Bucket,
    dropped: u64,
}

impl Log {
    pub fn new(path: PathBuf, max_bytes: u64, lines_per_second: u32) -> Self {
        let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        Log {
            path,
            max_bytes,
            state: Mutex::new(State {
                file: None,
                size,
                bucket: Bucket::new(lines_per_second, lines_per_second.saturating_mul(2), Instant::now()),
                dropped: 0,
            }),
        }
    }

    /// Write one line (or count it as dropped).
    pub fn line(&self, text: &[u8]) {
        let Ok(mut st) = self.state.lock() else { return };
        if !st.bucket.take(Instant::now()) {
            st.dropped += 1;
            return;
        }
        let mut out = Vec::with_capacity(text.len() + 64);
        if st.dropped > 0 {
            out.extend_from_slice(format!("({} log lines dropped: over the rate)\n", st.dropped).as_bytes());
            st.dropped = 0;
        }
        out.extend_from_slice(text);
        if st.size + out.len() as u64 > self.max_bytes {
            // Rotate: the current file becomes `.1` (replacing the older one).
            st.file = None;
            let _ = std::fs::rename(&self.path, self.path.with_extension("log.1"));
            st.size = 0;
        }
        if st.file.is_none() {
            st.file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.path)
                .ok();
        }
        if let Some(f) = st.file.as_mut()
            && f.write_all(&out).is_ok()
        {
            st.size += out.len() as u64;
        }
    }
}

/// One event's bytes, written as a line when the event is done.
pub struct LineWriter<'a> {
    log: &'a Log,
    buf: Vec<u8>,
}

impl Write for LineWriter<'_> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        // An event's line is short; a huge one is cut.
        let room = 4096usize.saturating_sub(self.buf.len());
        self.buf.extend_from_slice(&b[..b.len().min(room)]);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LineWriter<'_> {
    fn drop(&mut self) {
        if !self.buf.is_empty() {
            if self.buf.last() != Some(&b'\n') {
                self.buf.push(b'\n');
            }
            self.log.line(&self.buf);
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Log {
    type Writer = LineWriter<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        LineWriter {
            log: self,
            buf: Vec::new(),
        }
    }
}

/// Send this process's log to the resolver's file (`filter`: the `--log` given, else warnings
/// and the resolver's own information).
pub fn init(config: &crate::config::Config, filter: Option<&str>) {
    let log = Log::new(
        config.net.resolver_log(),
        config.resolver.log_bytes,
        config.resolver.log_lines_per_second,
    );
    let filter = filter.unwrap_or("warn,runner::net::resolver=info");
    let filter =
        tracing_subscriber::EnvFilter::try_new(filter).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = std::fs::create_dir_all(&config.net.dir);
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(log)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_is_rate_limited_and_rotated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("resolver.log");
        let log = Log::new(path.clone(), 1000, 5);
        for i in 0..1000 {
            log.line(format!("line {i:04} of a flood\n").as_bytes());
        }
        let text = std::fs::read_to_string(&path).unwrap();
        // The burst (twice the rate) got through; the rest was counted, not written.
        assert_eq!(text.lines().count(), 10, "{text}");
        std::thread::sleep(std::time::Duration::from_millis(450));
        log.line(b"after\n");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.contains("(990 log lines dropped: over the rate)\nafter\n"),
            "{text}"
        );
        // Past the size, the file rotates: neither file exceeds it.
        let log = Log::new(path.clone(), 100, 1000);
        for _ in 0..50 {
            log.line(b"0123456789012345678\n");
        }
        assert!(std::fs::metadata(&path).unwrap().len() <= 100);
        assert!(std::fs::metadata(path.with_extension("log.1")).unwrap().len() <= 100);
    }
}
