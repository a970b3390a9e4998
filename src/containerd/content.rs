//! containerd's content store through the facade: blob info, resumable ingests (the same
//! ref resumes; another writer's ref is waited for), reads, labels, deletion.

use std::collections::HashMap;

use containerd_client::services::v1 as svc;
use tokio_stream::StreamExt;
use tonic::Code;

use super::client::{Containerd, CtdError, rpc};

/// Content write chunk (containerd's own clients use 1 MiB).
const WRITE_CHUNK: usize = 1 << 20;

/// A blob's bytes as they arrive.
pub type ByteStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<bytes::Bytes, std::io::Error>> + Send + 'static>>;

/// What `content_ingest` writes: a blob, under an ingest ref, in a lease.
pub struct IngestBlob<'a> {
    pub lease: &'a str,
    /// The ingest's ref: the same ref resumes (and excludes other writers).
    pub reference: &'a str,
    pub digest: &'a str,
    pub size: u64,
    /// Labels the committed blob gets.
    pub labels: HashMap<String, String>,
}

/// How a `content_ingest` ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ingest {
    /// The blob is in the store (written now, or by another writer).
    Committed,
    /// Another writer holds the ingest: wait for it, then look again.
    Locked,
}

impl Containerd {
    pub async fn content_info(&self, digest: &str) -> Result<Option<svc::Info>, CtdError> {
        let mut client = svc::content_client::ContentClient::new(self.channel.clone());
        match client
            .info(self.request(svc::InfoRequest {
                digest: digest.to_string(),
            }))
            .await
        {
            Ok(r) => Ok(r.into_inner().info),
            Err(s) if s.code() == Code::NotFound => Ok(None),
            Err(s) => Err(rpc("content info")(s)),
        }
    }

    /// Write a blob from a reader, committed with `labels`. The digest is verified by
    /// containerd on commit. AlreadyExists counts as success.
    pub async fn content_write(
        &self,
        lease: &str,
        digest: &str,
        size: u64,
        mut data: impl tokio::io::AsyncRead + Unpin + Send + 'static,
        labels: HashMap<String, String>,
        mut progress: impl FnMut(u64) + Send,
    ) -> Result<(), CtdError> {
        use tokio::io::AsyncReadExt;
        let mut client = svc::content_client::ContentClient::new(self.channel.clone());
        let (tx, rx) = tokio::sync::mpsc::channel::<svc::WriteContentRequest>(4);
        // One ref per writer: concurrent imports of the same blob must not contend for a
        // ref lock; containerd dedups by digest at commit (AlreadyExists).
        let reference = format!("runner-{lease}-{digest}");
        let total = size as i64;
        let expected = digest.to_string();
        let feeder_ref = reference.clone();
        let feeder = tokio::spawn(async move {
            let mut offset: i64 = 0;
            let mut buf = vec![0u8; WRITE_CHUNK];
            loop {
                let mut filled = 0;
                while filled < buf.len() {
                    let n = data.read(&mut buf[filled..]).await?;
                    if n == 0 {
                        break;
                    }
                    filled += n;
                }
                if filled == 0 {
                    break;
                }
                let msg = svc::WriteContentRequest {
                    action: svc::WriteAction::Write as i32,
                    r#ref: feeder_ref.clone(),
                    total,
                    expected: expected.clone(),
                    offset,
                    data: buf[..filled].to_vec(),
                    labels: HashMap::new(),
                };
                offset += filled as i64;
                if tx.send(msg).await.is_err() {
                    return Ok::<i64, std::io::Error>(offset);
                }
                if filled < buf.len() {
                    break;
                }
            }
            let commit = svc::WriteContentRequest {
                action: svc::WriteAction::Commit as i32,
                r#ref: feeder_ref,
                total,
                expected,
                offset,
                data: Vec::new(),
                labels,
            };
            let _ = tx.send(commit).await;
            Ok(offset)
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        let result = client.write(self.leased(stream, Some(lease))).await;
        let mut responses = match result {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == Code::AlreadyExists => {
                feeder.abort();
                return Ok(());
            }
            Err(s) => {
                feeder.abort();
                return Err(rpc("content write")(s));
            }
        };
        loop {
            match responses.next().await {
                Some(Ok(r)) => {
                    progress(r.offset.max(0) as u64);
                    if r.action == svc::WriteAction::Commit as i32 {
                        break;
                    }
                }
                // Another writer committed the same digest first: the content is there.
                Some(Err(s)) if s.code() == Code::AlreadyExists => {
                    feeder.abort();
                    return Ok(());
                }
                Some(Err(s)) => {
                    feeder.abort();
                    return Err(rpc("content write")(s));
                }
                None => break,
            }
        }
        let fed = feeder.await;
        if !matches!(fed, Ok(Ok(written)) if written == total) && self.content_info(digest).await?.is_some() {
            // containerd ended our write because another writer committed the same blob.
            return Ok(());
        }
        match fed {
            Ok(Ok(written)) if written == total => Ok(()),
            Ok(Ok(written)) => Err(CtdError::Protocol {
                op: "content write",
                message: format!("{digest}: read {written} bytes, expected {total}"),
            }),
            Ok(Err(source)) => Err(CtdError::Io {
                what: format!("reading blob {digest}"),
                source,
            }),
            Err(e) => Err(CtdError::Protocol {
                op: "content write",
                message: e.to_string(),
            }),
        }
    }

    /// Write a blob under a fixed ingest `reference`, resumably: containerd keeps a partial
    /// ingest under its ref, and only one writer may hold a ref at a time. The first message
    /// asks for the ingest's state, which takes the ref's lock *before* `open` is called with
    /// the offset already stored; `open` returns the offset its stream really starts at (that
    /// offset, or 0 to start over) and the bytes. A ref another writer holds gives
    /// `Ingest::Locked` and `open` is never called, so two pulls of one blob download it once.
    /// containerd checks size and digest at commit; a blob that fails them is aborted, so a
    /// later write never resumes bad bytes. A stream that breaks leaves the ingest to resume.
    pub async fn content_ingest<F, Fut>(
        &self,
        blob: IngestBlob<'_>,
        open: F,
        mut progress: impl FnMut(u64) + Send,
    ) -> Result<Ingest, CtdError>
    where
        F: FnOnce(u64) -> Fut,
        Fut: std::future::Future<Output = Result<(u64, ByteStream), CtdError>>,
    {
        let IngestBlob {
            lease,
            reference,
            digest,
            size,
            labels,
        } = blob;
        let mut client = svc::content_client::ContentClient::new(self.channel.clone());
        let (tx, rx) = tokio::sync::mpsc::channel::<svc::WriteContentRequest>(4);
        let total = size as i64;
        let message = |action: svc::WriteAction, offset: i64, data: Vec<u8>, labels| svc::WriteContentRequest {
            action: action as i32,
            r#ref: reference.to_string(),
            total,
            expected: digest.to_string(),
            offset,
            data,
            labels,
        };
        let _ = tx
            .send(message(svc::WriteAction::Stat, 0, Vec::new(), HashMap::new()))
            .await;
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        let locked = |s: &tonic::Status| s.code() == Code::Unavailable && s.message().contains("locked");
        let mut responses = match client.write(self.leased(stream, Some(lease))).await {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == Code::AlreadyExists => return Ok(Ingest::Committed),
            Err(s) if locked(&s) => return Ok(Ingest::Locked),
            Err(s) => return Err(rpc("content write")(s)),
        };
        let stored = match responses.next().await {
            Some(Ok(r)) => r.offset.max(0) as u64,
            Some(Err(s)) if s.code() == Code::AlreadyExists => return Ok(Ingest::Committed),
            Some(Err(s)) if locked(&s) => return Ok(Ingest::Locked),
            Some(Err(s)) => return Err(rpc("content write")(s)),
            None => {
                return Err(CtdError::Protocol {
                    op: "content write",
                    message: format!("{reference}: no answer to the status request"),
                });
            }
        };
        let (start, mut body) = open(stored.min(size)).await?;
        progress(start);
        let commit = message(svc::WriteAction::Commit, 0, Vec::new(), labels);
        let write = message(svc::WriteAction::Write, 0, Vec::new(), HashMap::new());
        let feeder = tokio::spawn(async move {
            let mut offset = start as i64;
            let mut buf: Vec<u8> = Vec::with_capacity(WRITE_CHUNK);
            loop {
                let chunk = body.next().await.transpose()?;
                if let Some(c) = &chunk {
                    buf.extend_from_slice(c);
                }
                if buf.len() >= WRITE_CHUNK || (chunk.is_none() && !buf.is_empty()) {
                    let data = std::mem::replace(&mut buf, Vec::with_capacity(WRITE_CHUNK));
                    let n = data.len() as i64;
                    let msg = svc::WriteContentRequest {
                        offset,
                        data,
                        ..write.clone()
                    };
                    if tx.send(msg).await.is_err() {
                        return Ok::<i64, std::io::Error>(offset);
                    }
                    offset += n;
                }
                if chunk.is_none() {
                    break;
                }
            }
            let _ = tx.send(svc::WriteContentRequest { offset, ..commit }).await;
            Ok(offset)
        });
        let outcome = loop {
            match responses.next().await {
                Some(Ok(r)) => {
                    progress(r.offset.max(0) as u64);
                    if r.action == svc::WriteAction::Commit as i32 {
                        break Ok(());
                    }
                }
                Some(Err(s)) if s.code() == Code::AlreadyExists => break Ok(()),
                Some(Err(s)) => break Err(s),
                None => break Ok(()),
            }
        };
        let fed = feeder.await;
        match (outcome, fed) {
            (Ok(()), Ok(Ok(written))) if written == total => Ok(Ingest::Committed),
            (Ok(()), _) if self.content_info(digest).await?.is_some() => Ok(Ingest::Committed),
            (_, Ok(Err(source))) => Err(CtdError::Io {
                what: format!("downloading {digest}"),
                source,
            }),
            (Err(s), _) => {
                // Wrong size or digest: these bytes must never be resumed.
                if matches!(
                    s.code(),
                    Code::FailedPrecondition | Code::InvalidArgument | Code::OutOfRange
                ) {
                    self.content_abort(reference).await;
                }
                Err(rpc("content write")(s))
            }
            (Ok(()), Ok(Ok(written))) => {
                self.content_abort(reference).await;
                Err(CtdError::Protocol {
                    op: "content write",
                    message: format!("{digest}: got {written} bytes, the descriptor says {total}"),
                })
            }
            (Ok(()), Err(e)) => Err(CtdError::Protocol {
                op: "content write",
                message: e.to_string(),
            }),
        }
    }

    /// Drop an unfinished ingest (best effort: one that is gone is what we want).
    pub async fn content_abort(&self, reference: &str) {
        let mut client = svc::content_client::ContentClient::new(self.channel.clone());
        if let Err(s) = client
            .abort(self.request(svc::AbortRequest {
                r#ref: reference.to_string(),
            }))
            .await
            && s.code() != Code::NotFound
        {
            tracing::warn!(reference, error = %s, "could not abort an ingest");
        }
    }

    /// The unfinished ingests (`ctr content active`).
    pub async fn content_active(&self) -> Result<Vec<svc::Status>, CtdError> {
        let mut client = svc::content_client::ContentClient::new(self.channel.clone());
        Ok(client
            .list_statuses(self.request(svc::ListStatusesRequest { filters: Vec::new() }))
            .await
            .map_err(rpc("content statuses"))?
            .into_inner()
            .statuses)
    }

    /// Read a blob as a stream of chunks (for pushing large layers without holding them).
    pub async fn content_stream(&self, digest: &str) -> Result<ByteStream, CtdError> {
        self.content_stream_range(digest, 0, 0).await
    }

    /// Read `size` bytes of a blob from `offset` (`size` 0: to its end) as a stream of chunks.
    pub async fn content_stream_range(&self, digest: &str, offset: u64, size: u64) -> Result<ByteStream, CtdError> {
        let mut client = svc::content_client::ContentClient::new(self.channel.clone());
        let stream = client
            .read(self.request(svc::ReadContentRequest {
                digest: digest.to_string(),
                offset: offset as i64,
                size: size as i64,
            }))
            .await
            .map_err(rpc("content read"))?
            .into_inner();
        Ok(Box::pin(stream.map(|chunk| {
            chunk
                .map(|c| bytes::Bytes::from(c.data))
                .map_err(|s| std::io::Error::other(s.message().to_string()))
        })))
    }

    pub async fn content_read(&self, digest: &str) -> Result<Vec<u8>, CtdError> {
        let mut client = svc::content_client::ContentClient::new(self.channel.clone());
        let mut stream = client
            .read(self.request(svc::ReadContentRequest {
                digest: digest.to_string(),
                offset: 0,
                size: 0,
            }))
            .await
            .map_err(rpc("content read"))?
            .into_inner();
        let mut out = Vec::new();
        while let Some(chunk) = stream.next().await {
            out.extend_from_slice(&chunk.map_err(rpc("content read"))?.data);
        }
        Ok(out)
    }
}
