//! A blob written to containerd's content store while it is still being made: its chunks
//! are sent as they come, and its digest and size — known only once the last byte is made —
//! go with the commit (containerd takes `expected` and `total` on any message of a write and
//! checks them at the commit). A snapshot's layer is sent this way while runner is still
//! writing it, so containerd's receiving (hash, write, fsync) overlaps runner's walk.

use std::collections::HashMap;

use containerd_client::services::v1 as svc;
use tokio_stream::StreamExt;
use tonic::Code;

use super::client::{Containerd, CtdError, rpc};

/// How the blob ended: its digest, size and the labels to commit it with, or why it will
/// not be committed.
pub type BlobEnd = Result<(String, u64, HashMap<String, String>), String>;

impl Containerd {
    /// Write the blob whose bytes arrive on `chunks` under a fresh ingest `reference`;
    /// commit it once `end` gives its digest, size (checked by containerd) and labels, or
    /// abort the ingest when `end` says it failed. AlreadyExists (the same blob is there)
    /// counts as success.
    pub async fn content_write_following(
        &self,
        lease: &str,
        reference: &str,
        mut chunks: tokio::sync::mpsc::Receiver<Vec<u8>>,
        end: tokio::sync::oneshot::Receiver<BlobEnd>,
    ) -> Result<(), CtdError> {
        let mut client = svc::content_client::ContentClient::new(self.channel.clone());
        let (tx, rx) = tokio::sync::mpsc::channel::<svc::WriteContentRequest>(4);
        let feeder_ref = reference.to_string();
        let feeder = tokio::spawn(async move {
            let mut offset: i64 = 0;
            while let Some(data) = chunks.recv().await {
                let len = data.len() as i64;
                let msg = svc::WriteContentRequest {
                    action: svc::WriteAction::Write as i32,
                    r#ref: feeder_ref.clone(),
                    total: 0,
                    expected: String::new(),
                    offset,
                    data,
                    labels: HashMap::new(),
                };
                offset += len;
                if tx.send(msg).await.is_err() {
                    return Err("containerd ended the write".to_string());
                }
            }
            let (digest, size, labels) = end.await.map_err(|_| "the blob's maker went away".to_string())??;
            if size as i64 != offset {
                return Err(format!("{digest}: sent {offset} bytes of {size}"));
            }
            let commit = svc::WriteContentRequest {
                action: svc::WriteAction::Commit as i32,
                r#ref: feeder_ref,
                total: size as i64,
                expected: digest.clone(),
                offset,
                data: Vec::new(),
                labels,
            };
            tx.send(commit)
                .await
                .map_err(|_| "containerd ended the write".to_string())?;
            Ok(digest)
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        let failed = |message: String| CtdError::Protocol {
            op: "content write",
            message,
        };
        let mut responses = match client.write(self.leased(stream, Some(lease))).await {
            Ok(r) => r.into_inner(),
            Err(s) => {
                feeder.abort();
                self.content_abort(reference).await;
                return Err(rpc("content write")(s));
            }
        };
        let mut committed = false;
        let mut refused = None;
        while let Some(answer) = responses.next().await {
            match answer {
                Ok(r) if r.action == svc::WriteAction::Commit as i32 => {
                    committed = true;
                    break;
                }
                Ok(_) => {}
                Err(s) if s.code() == Code::AlreadyExists => {
                    committed = true;
                    break;
                }
                Err(s) => {
                    refused = Some(s);
                    break;
                }
            }
        }
        let fed = feeder.await;
        if committed {
            return Ok(());
        }
        self.content_abort(reference).await;
        if let Some(s) = refused {
            return Err(rpc("content write")(s));
        }
        match fed {
            Ok(Ok(digest)) if self.content_info(&digest).await?.is_some() => Ok(()),
            Ok(Ok(digest)) => Err(failed(format!(
                "{digest}: containerd ended the write before its commit"
            ))),
            Ok(Err(message)) => Err(failed(message)),
            Err(e) => Err(failed(e.to_string())),
        }
    }
}
