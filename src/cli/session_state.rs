//! `runner pause SESSION` and `runner resume SESSION` (alias `unpause`, as docker and
//! nerdctl name it): a live session of a `runner serve` frozen and thawed through its HTTP
//! API (`POST /v1/sessions/{id}/pause|resume`), found as `runner exec -it` and `runner
//! attach` find it (`--url`, the token). One HTTP/1.1 request over TCP or the unix socket.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::args::{OutputFormat, ServerArgs};
use super::output::outln;
use crate::service::ServiceError;

/// The most of an answer read (a session's view is well under a kilobyte).
const MAX_ANSWER: u64 = 1 << 20;

/// How long the server has to answer: a freeze is bounded by seconds on the server.
const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// `verb` is `pause` or `resume`; prints the session's state (or its view with `-o`).
pub async fn run(
    server: &ServerArgs,
    session: &str,
    verb: &str,
    output: Option<OutputFormat>,
) -> Result<i32, ServiceError> {
    let path = format!("/v1/sessions/{}/{verb}", percent(session));
    let (status, body) = tokio::time::timeout(ANSWER_TIMEOUT, post(server, &path))
        .await
        .map_err(|_| ServiceError::Unavailable {
            what: "the server",
            reason: format!("no answer to {verb} within {ANSWER_TIMEOUT:?}"),
        })??;
    let view: serde_json::Value = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    if status != 200 {
        let message = view
            .get("error")
            .and_then(|e| e.as_str())
            .map(String::from)
            .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
        return Err(match status {
            404 => ServiceError::NotFound {
                kind: "session",
                name: session.to_string(),
            },
            409 => ServiceError::Conflict(message),
            400..=499 => ServiceError::rejected(message),
            _ => ServiceError::Unavailable {
                what: "the server",
                reason: format!("{status}: {message}"),
            },
        });
    }
    match output {
        Some(format @ (OutputFormat::Json | OutputFormat::Yaml)) => super::output::print_value(&view, Some(format))?,
        Some(OutputFormat::Name) => outln!("session/{session}"),
        Some(OutputFormat::Wide) | None => {
            let state = view.get("state").and_then(|s| s.as_str()).unwrap_or("unknown");
            outln!("{session} {state}")
        }
    }
    Ok(0)
}

/// POST `path` with an empty body; the status and the body.
async fn post(server: &ServerArgs, path: &str) -> Result<(u16, Vec<u8>), ServiceError> {
    let (mut stream, host, prefix) = super::terminal::open_stream(server).await?;
    let mut request =
        format!("POST {prefix}{path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n");
    if let Some(token) = server.token()? {
        if token.contains(['\r', '\n']) {
            return Err(ServiceError::field("token", "not a valid header value"));
        }
        request.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    request.push_str("\r\n");
    let lost = |e: std::io::Error| ServiceError::Unavailable {
        what: "the server",
        reason: e.to_string(),
    };
    stream.write_all(request.as_bytes()).await.map_err(lost)?;
    let mut answer = Vec::new();
    stream.take(MAX_ANSWER).read_to_end(&mut answer).await.map_err(lost)?;
    parse(&answer).ok_or_else(|| ServiceError::Unavailable {
        what: "the server",
        reason: format!(
            "not an HTTP answer: {:?}",
            String::from_utf8_lossy(&answer[..answer.len().min(200)])
        ),
    })
}

/// An HTTP/1.1 answer read to its end: its status and body (chunked or not).
fn parse(answer: &[u8]) -> Option<(u16, Vec<u8>)> {
    let end = answer.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&answer[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let chunked = lines.any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("transfer-encoding") && v.trim().eq_ignore_ascii_case("chunked")
        })
    });
    let mut body = &answer[end + 4..];
    if !chunked {
        return Some((status, body.to_vec()));
    }
    let mut out = Vec::new();
    loop {
        let line_end = body.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&body[..line_end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        body = &body[line_end + 2..];
        if size == 0 {
            return Some((status, out));
        }
        out.extend_from_slice(body.get(..size)?);
        body = body.get(size + 2..)?;
    }
}

/// Percent-encoding of a path segment (everything but unreserved characters).
fn percent(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_parsed_plain_and_chunked() {
        let plain = b"HTTP/1.1 200 OK\r\ncontent-length: 17\r\n\r\n{\"state\":\"paused\"}";
        assert_eq!(parse(plain), Some((200, b"{\"state\":\"paused\"}".to_vec())));
        let chunked =
            b"HTTP/1.1 409 Conflict\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\n\r\n";
        assert_eq!(parse(chunked), Some((409, b"{\"a\":1}".to_vec())));
        assert_eq!(parse(b"garbage"), None);
        assert_eq!(
            parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
            None
        );
    }

    #[test]
    fn a_session_id_is_one_path_segment() {
        assert_eq!(percent("s-1a2b"), "s-1a2b");
        assert_eq!(percent("../x y"), "..%2Fx%20y");
    }
}
