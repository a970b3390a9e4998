//! Bounded output capture: keeps the head and the tail of a stream, counts exactly what was
//! dropped in between, and decodes UTF-8 with replacement. Memory stays ≤ the cap whatever
//! the job prints.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// Default cap per stream (stdout and stderr each).
pub const DEFAULT_OUTPUT_LIMIT: usize = crate::config::DEFAULT_OUTPUT_LIMIT;

#[derive(Debug)]
pub struct Capture {
    head_cap: usize,
    tail_cap: usize,
    head: Vec<u8>,
    tail: VecDeque<u8>,
    /// Bytes pushed out of the tail ring (they were between head and tail).
    dropped: u64,
}

/// A finished stream: decoded text and how many bytes of the original are not in it.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Captured {
    pub text: String,
    pub dropped_bytes: u64,
}

impl Capture {
    /// `limit` bytes at most are kept: half from the start, half from the end.
    pub fn new(limit: usize) -> Self {
        let head_cap = limit / 2;
        Capture {
            head_cap,
            tail_cap: limit - head_cap,
            head: Vec::new(),
            tail: VecDeque::new(),
            dropped: 0,
        }
    }

    pub fn push(&mut self, mut data: &[u8]) {
        if self.head.len() < self.head_cap {
            let n = (self.head_cap - self.head.len()).min(data.len());
            self.head.extend_from_slice(&data[..n]);
            data = &data[n..];
        }
        if data.is_empty() {
            return;
        }
        if data.len() >= self.tail_cap {
            self.dropped += (self.tail.len() + data.len() - self.tail_cap) as u64;
            self.tail.clear();
            self.tail.extend(&data[data.len() - self.tail_cap..]);
            return;
        }
        let overflow = (self.tail.len() + data.len()).saturating_sub(self.tail_cap);
        if overflow > 0 {
            self.tail.drain(..overflow);
            self.dropped += overflow as u64;
        }
        self.tail.extend(data);
    }

    /// Decode. When bytes were dropped, head and tail are decoded apart and a character cut
    /// in two at either edge is dropped too (and counted), so no replacement character marks
    /// the seam.
    pub fn finish(self) -> Captured {
        let Capture {
            mut head,
            tail,
            mut dropped,
            ..
        } = self;
        let mut tail: Vec<u8> = tail.into();
        if dropped == 0 {
            head.extend_from_slice(&tail);
            return Captured {
                text: String::from_utf8_lossy(&head).into_owned(),
                dropped_bytes: 0,
            };
        }
        let cut_head = incomplete_suffix(&head);
        head.truncate(head.len() - cut_head);
        let cut_tail = tail.iter().take(3).take_while(|b| (**b & 0xC0) == 0x80).count();
        tail.drain(..cut_tail);
        dropped += (cut_head + cut_tail) as u64;
        let mut text = String::from_utf8_lossy(&head).into_owned();
        text.push_str(&String::from_utf8_lossy(&tail));
        Captured {
            text,
            dropped_bytes: dropped,
        }
    }
}

/// Length of a UTF-8 sequence begun but not finished at the end of `data` (0..=3).
pub fn incomplete_suffix(data: &[u8]) -> usize {
    for back in 1..=3.min(data.len()) {
        let b = data[data.len() - back];
        if b & 0xC0 == 0x80 {
            continue; // continuation byte: keep looking for the lead byte
        }
        let needed = match b {
            0xC0..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF7 => 4,
            _ => return 0,
        };
        return if needed > back { back } else { 0 };
    }
    0
}

/// Decodes a byte stream chunk by chunk without splitting characters between chunks.
#[derive(Debug, Default)]
pub struct Utf8Chunker {
    carry: Vec<u8>,
}

impl Utf8Chunker {
    pub fn decode(&mut self, chunk: &[u8]) -> String {
        self.carry.extend_from_slice(chunk);
        let keep = incomplete_suffix(&self.carry);
        let ready = self.carry.len() - keep;
        let text = String::from_utf8_lossy(&self.carry[..ready]).into_owned();
        self.carry.drain(..ready);
        text
    }

    pub fn flush(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.carry).into_owned();
        self.carry.clear();
        text
    }
}

/// How far a pump forwarding a stream to a consumer got, for deciding how long to wait for it
/// once its process ended (`wait_for_pump`).
#[derive(Default, Debug)]
pub struct PumpProgress {
    /// Waiting for the consumer to take an event.
    sending: AtomicBool,
    /// Bytes handed to the consumer.
    forwarded: AtomicU64,
}

/// Bytes a pump may still forward after its process ended before the stream counts as held
/// by something else (a background process flooding it). What the process itself wrote and
/// the pump has not forwarded yet is at most a pipe and a chunk (the shim's copy adds a
/// pipe): far less.
pub const AFTER_EXIT_BYTES: u64 = 4 << 20;

impl PumpProgress {
    pub fn set_sending(&self, sending: bool) {
        self.sending.store(sending, Ordering::Release);
    }

    pub fn add_forwarded(&self, bytes: usize) {
        self.forwarded.fetch_add(bytes as u64, Ordering::Release);
    }

    fn forwarded(&self) -> u64 {
        self.forwarded.load(Ordering::Acquire)
    }

    fn sending(&self) -> bool {
        self.sending.load(Ordering::Acquire)
    }
}

/// Wait for an output pump after its process ended: `limit` for its stream to end, and on,
/// `limit` at a time, while it makes progress for a consumer (it is sending, or it forwarded
/// more in the last `limit`: a slow client, not a held stream) and has forwarded less than
/// `AFTER_EXIT_BYTES` since the exit. `None`: it did not end (a background process holds the
/// stream, or floods it).
pub async fn wait_for_pump<T>(
    task: &mut tokio::task::JoinHandle<T>,
    limit: Duration,
    progress: Option<&PumpProgress>,
) -> Option<Result<T, tokio::task::JoinError>> {
    // Counted from before the first wait, so that a pump that forwarded during it (a client
    // reading between two looks at `sending`) counts as moving.
    let start = progress.map_or(0, PumpProgress::forwarded);
    let mut seen = start;
    loop {
        if let Ok(done) = tokio::time::timeout(limit, &mut *task).await {
            return Some(done);
        }
        let progress = progress?;
        let now = progress.forwarded();
        let moving = progress.sending() || now > seen;
        if !moving || now - start >= AFTER_EXIT_BYTES {
            return None;
        }
        seen = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pump that keeps forwarding to a slow consumer, though never caught waiting on it, is
    /// waited for past the limit; one that forwards nothing (a held stream) is not; a flood
    /// is cut at `AFTER_EXIT_BYTES`.
    #[tokio::test]
    async fn a_pump_is_waited_for_while_it_moves_and_no_further() {
        let limit = Duration::from_millis(500);
        let moving = std::sync::Arc::new(PumpProgress::default());
        let mut task = tokio::spawn({
            let p = moving.clone();
            async move {
                // Three limits long, forwarding ten times in each.
                for _ in 0..30 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    p.add_forwarded(1000);
                }
            }
        });
        assert!(wait_for_pump(&mut task, limit, Some(&moving)).await.is_some());

        let held = PumpProgress::default();
        let mut task = tokio::spawn(std::future::pending::<()>());
        assert!(wait_for_pump(&mut task, limit, Some(&held)).await.is_none());
        assert!(wait_for_pump(&mut task, limit, None).await.is_none());

        let flood = std::sync::Arc::new(PumpProgress::default());
        let mut task = tokio::spawn({
            let p = flood.clone();
            async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    p.add_forwarded(64 << 10);
                }
            }
        });
        assert!(wait_for_pump(&mut task, limit, Some(&flood)).await.is_none());
        assert!(flood.forwarded() >= AFTER_EXIT_BYTES);
    }

    #[test]
    fn small_output_is_kept_whole() {
        let mut c = Capture::new(16);
        c.push(b"hello ");
        c.push(b"world");
        assert_eq!(
            c.finish(),
            Captured {
                text: "hello world".into(),
                dropped_bytes: 0
            }
        );
    }

    #[test]
    fn large_output_keeps_head_and_tail_and_counts_the_rest() {
        let mut c = Capture::new(10);
        let data: Vec<u8> = (0..100u8).map(|i| b'a' + i % 26).collect();
        for chunk in data.chunks(7) {
            c.push(chunk);
        }
        let out = c.finish();
        assert_eq!(out.dropped_bytes, 90);
        assert_eq!(out.text.as_bytes()[..5], data[..5]);
        assert_eq!(out.text.as_bytes()[5..], data[95..]);
    }

    #[test]
    fn a_character_cut_at_the_seam_is_dropped_and_counted() {
        let mut c = Capture::new(4);
        c.push("aé".as_bytes()); // 3 bytes: head keeps "a" + first byte of é
        c.push(b"xxxxxx");
        c.push("€z".as_bytes()); // tail keeps the last 2 bytes of € and "z"
        let out = c.finish();
        assert_eq!(out.text, "az");
        assert_eq!(out.dropped_bytes, 3 + 6 + 4 - 2);
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let mut c = Capture::new(100);
        c.push(b"ok\xff\xfe!");
        assert_eq!(c.finish().text, "ok\u{fffd}\u{fffd}!");
    }

    #[test]
    fn chunker_never_splits_a_character() {
        let mut d = Utf8Chunker::default();
        let bytes = "héllo€".as_bytes();
        let mut text = String::new();
        for b in bytes {
            text.push_str(&d.decode(std::slice::from_ref(b)));
        }
        text.push_str(&d.flush());
        assert_eq!(text, "héllo€");
    }
}
