//! Client certificates for registries (mutual TLS).
//!
//! oci-client 0.18 builds its own HTTP client and offers no way to present a client
//! certificate (its `ClientConfig` has CA roots but no identity, and the client inside is
//! private). For an endpoint that needs one, runner puts a bridge between them: a forward
//! proxy on loopback, owned by the pull or push that started it, which oci-client reaches over
//! plain HTTP and which opens the TLS connection to the registry itself, presenting the
//! certificate and checking the registry's own against the endpoint's CA files.
//!
//! The bridge forwards to exactly one `HOST[:PORT]` and answers only requests that carry its
//! random credential (as proxy basic auth), so another local user cannot borrow the
//! certificate through it. Bodies stream through in both directions; nothing is buffered.
//! What the registry names as an `https://HOST/` URL (upload `Location`s, the token realm of
//! `WWW-Authenticate`) is renamed `http://HOST/` on the way back so that oci-client's next
//! request comes through the bridge too; other hosts (a CDN a blob redirects to) are reached
//! directly, as before.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use futures::TryStreamExt;
use http::{HeaderMap, HeaderValue, StatusCode, header};

use super::ImageError;

/// A client certificate and its key (PEM; the same file when it holds both).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientCert {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A running bridge. Dropping it stops it.
pub struct Bridge {
    /// The proxy URL, with its credential, for oci-client's `http_proxy`.
    pub proxy_url: String,
    task: tokio::task::JoinHandle<()>,
    failure: Arc<std::sync::Mutex<Option<String>>>,
}

impl Bridge {
    /// The last request the bridge could not forward (TLS handshake, connection), if any.
    pub fn last_failure(&self) -> Option<String> {
        self.failure.lock().ok()?.clone()
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Upstream {
    host: String,
    client: reqwest::Client,
    /// `Basic …` value the proxy expects in `Proxy-Authorization`.
    expected_auth: String,
    failure: Arc<std::sync::Mutex<Option<String>>>,
}

fn read(path: &Path, what: &str) -> Result<Vec<u8>, ImageError> {
    std::fs::read(path).map_err(|source| ImageError::Io {
        what: format!("reading the {what} {}", path.display()),
        source,
    })
}

/// The HTTP client that talks TLS to `host`, presenting `cert`.
fn upstream_client(
    host: &str,
    cert: &ClientCert,
    ca: &[PathBuf],
    skip_verify: bool,
) -> Result<reqwest::Client, ImageError> {
    let mut pem = read(&cert.cert, "client certificate")?;
    if cert.key != cert.cert {
        pem.push(b'\n');
        pem.extend(read(&cert.key, "client key")?);
    }
    let identity = reqwest::Identity::from_pem(&pem).map_err(|e| {
        ImageError::Registry(format!(
            "{host}: the client certificate {} with key {} is not a usable PEM pair: {e}",
            cert.cert.display(),
            cert.key.display()
        ))
    })?;
    let mut roots = Vec::new();
    for path in ca {
        let found = reqwest::Certificate::from_pem_bundle(&read(path, "CA file")?)
            .map_err(|e| ImageError::Registry(format!("{}: not a PEM CA bundle: {e}", path.display())))?;
        roots.extend(found);
    }
    reqwest::Client::builder()
        .identity(identity)
        .tls_certs_merge(roots)
        .tls_danger_accept_invalid_certs(skip_verify)
        // Redirects go back to oci-client, which follows them (renamed when they stay on
        // this host, so that they come back through here).
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .connect_timeout(Duration::from_secs(30))
        .read_timeout(Duration::from_secs(120))
        .build()
        .map_err(|e| {
            let text = super::with_causes(&e);
            // rustls takes X.509 v3 certificates only (Go also takes v1, which `openssl x509
            // -req` makes without an extension file).
            let hint = if text.contains("UnsupportedCertVersion") {
                format!(" ({} is not an X.509 v3 certificate)", cert.cert.display())
            } else {
                String::new()
            };
            ImageError::Registry(format!("{host}: setting up the TLS client: {text}{hint}"))
        })
}

/// Start a bridge to `host` (`HOST[:PORT]`, reached over TLS) presenting `cert`.
/// Must be called inside a tokio runtime: the bridge runs on it.
pub fn start(host: &str, cert: &ClientCert, ca: &[PathBuf], skip_verify: bool) -> Result<Bridge, ImageError> {
    let client = upstream_client(host, cert, ca, skip_verify)?;
    let mut secret = [0u8; 16];
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut secret))
        .map_err(|source| ImageError::Io {
            what: "reading /dev/urandom for the bridge's credential".into(),
            source,
        })?;
    let password: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    let expected_auth = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("runner:{password}"))
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|source| ImageError::Io {
        what: "binding the client-certificate bridge on 127.0.0.1".into(),
        source,
    })?;
    let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
    listener.set_nonblocking(true).map_err(|source| ImageError::Io {
        what: "setting up the client-certificate bridge".into(),
        source,
    })?;
    let listener = tokio::net::TcpListener::from_std(listener).map_err(|source| ImageError::Io {
        what: "setting up the client-certificate bridge".into(),
        source,
    })?;
    let failure = Arc::new(std::sync::Mutex::new(None));
    let state = Arc::new(Upstream {
        host: host.to_string(),
        client,
        expected_auth,
        failure: failure.clone(),
    });
    let app = axum::Router::new().fallback(forward).with_state(state);
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!("client-certificate bridge stopped: {e}");
        }
    });
    tracing::debug!(host, port, "client-certificate bridge");
    Ok(Bridge {
        proxy_url: format!("http://runner:{password}@127.0.0.1:{port}"),
        task,
        failure,
    })
}

/// Headers that belong to one hop (RFC 9110 §7.6.1) and the proxy's own.
fn hop_by_hop(name: &header::HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-authorization"
            | "proxy-authenticate"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
    )
}

fn refuse(status: StatusCode, text: String) -> Response {
    (status, text).into_response()
}

async fn forward(State(up): State<Arc<Upstream>>, req: Request) -> Response {
    let authorised = req
        .headers()
        .get(header::PROXY_AUTHORIZATION)
        .is_some_and(|v| v.as_bytes() == up.expected_auth.as_bytes());
    if !authorised {
        return refuse(
            StatusCode::PROXY_AUTHENTICATION_REQUIRED,
            "runner's client-certificate bridge serves only the process that started it\n".into(),
        );
    }
    let uri = req.uri().clone();
    if uri.authority().map(|a| a.as_str()) != Some(up.host.as_str()) {
        return refuse(
            StatusCode::FORBIDDEN,
            format!(
                "runner's client-certificate bridge forwards to {} only, not {uri}\n",
                up.host
            ),
        );
    }
    let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let target = format!("https://{}{path}", up.host);
    let method = req.method().clone();
    let mut headers = HeaderMap::new();
    for (name, value) in req.headers() {
        if !hop_by_hop(name) {
            headers.append(name.clone(), value.clone());
        }
    }
    let body = reqwest::Body::wrap_stream(req.into_body().into_data_stream());
    let sent = up
        .client
        .request(method.clone(), &target)
        .headers(headers)
        .body(body)
        .send()
        .await;
    let answer = match sent {
        Ok(a) => a,
        Err(e) => {
            let text = format!(
                "{method} {target} with the client certificate: {}",
                super::with_causes(&e)
            );
            tracing::debug!("bridge: {text}");
            if let Ok(mut last) = up.failure.lock() {
                *last = Some(text.clone());
            }
            return refuse(StatusCode::BAD_GATEWAY, format!("{text}\n"));
        }
    };
    let mut response = Response::builder().status(answer.status());
    let plain_prefix = format!("http://{}/", up.host);
    let tls_prefix = format!("https://{}/", up.host);
    for (name, value) in answer.headers() {
        if hop_by_hop(name) {
            continue;
        }
        let renamed = (name == header::LOCATION || name == header::WWW_AUTHENTICATE)
            .then(|| value.to_str().ok())
            .flatten()
            .filter(|v| v.contains(&tls_prefix))
            .and_then(|v| HeaderValue::from_str(&v.replace(&tls_prefix, &plain_prefix)).ok());
        response = response.header(name, renamed.unwrap_or_else(|| value.clone()));
    }
    let stream = answer.bytes_stream().map_err(std::io::Error::other);
    response
        .body(Body::from_stream(stream))
        .unwrap_or_else(|e| refuse(StatusCode::BAD_GATEWAY, format!("bridge: {e}\n")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed v3 certificate and key, made by openssl.
    fn pair(dir: &Path) -> ClientCert {
        let (cert, key) = (dir.join("c.pem"), dir.join("k.pem"));
        let out = std::process::Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=t",
            ])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .output()
            .expect("openssl must be installed (scripts/deps.sh)");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        ClientCert { cert, key }
    }

    #[tokio::test]
    async fn the_bridge_serves_only_its_owner_and_only_its_host() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = tempfile::tempdir().unwrap();
        let bridge = start("registry.test:5000", &pair(dir.path()), &[], false).unwrap();
        let url = reqwest::Url::parse(&bridge.proxy_url).unwrap();
        let proxy = format!("127.0.0.1:{}", url.port().unwrap());
        let direct = reqwest::Client::builder().no_proxy().build().unwrap();
        // No credential (another local process): refused.
        let r = direct.get(format!("http://{proxy}/v2/")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::PROXY_AUTHENTICATION_REQUIRED);
        // The owner's credential, another host: refused.
        let owner = reqwest::Client::builder()
            .proxy(reqwest::Proxy::http(&bridge.proxy_url).unwrap())
            .build()
            .unwrap();
        let r = owner.get("http://elsewhere.test/v2/").send().await.unwrap();
        assert_eq!(r.status(), StatusCode::FORBIDDEN);
        // Its host, unreachable: 502 with the reason, remembered for the error message.
        let r = owner.get("http://registry.test:5000/v2/").send().await.unwrap();
        assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
        assert!(r.text().await.unwrap().contains("https://registry.test:5000/v2/"));
        assert!(bridge.last_failure().unwrap().contains("with the client certificate"));
        // A key without its certificate is refused when the bridge is set up.
        let garbage = ClientCert {
            cert: dir.path().join("k.pem"),
            key: dir.path().join("k.pem"),
        };
        assert!(start("r:1", &garbage, &[], false).is_err());
    }
}
