//! Where a registry is reached and how: containerd's `hosts.toml` directories (mirrors,
//! plain HTTP, CA files), `--insecure-registry`, and Docker's credentials
//! (`~/.docker/config.json` auths and credential helpers).
//!
//! A registry `HOST[:PORT]` is looked up in each hosts directory in turn, as containerd and
//! nerdctl do: `DIR/HOST[:PORT]/hosts.toml`, or Docker's layout of `*.crt` CA files in
//! `DIR/HOST[:PORT]/`. The first directory that has the host decides. Mirrors come first,
//! in file order, then the registry itself (`server`, default `https://HOST`). Plain HTTP is
//! never implied: it takes an `http://` URL in hosts.toml or `--insecure-registry`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;

pub use crate::config::RegistryConfig;

use super::ImageError;
use super::mtls::{Bridge, ClientCert};

/// Docker's name for Docker Hub in credential stores.
const DOCKER_HUB_AUTH_KEY: &str = "https://index.docker.io/v1/";

impl RegistryConfig {
    /// The endpoints to try for `registry`, mirrors first.
    pub fn endpoints(&self, registry: &str) -> Result<Vec<Endpoint>, ImageError> {
        let upstream_host = if registry == "docker.io" {
            "index.docker.io".to_string()
        } else {
            registry.to_string()
        };
        let plain = self.insecure.iter().any(|h| h == registry);
        let default = Endpoint {
            host: upstream_host.clone(),
            docker_config: self.docker_config.clone(),
            plain_http: plain,
            ca: Vec::new(),
            skip_verify: false,
            client_cert: None,
            mirror: false,
            pull: true,
            push: true,
        };
        for dir in &self.hosts_dirs {
            let host_dir = dir.join(registry);
            if !host_dir.is_dir() {
                continue;
            }
            let file = host_dir.join("hosts.toml");
            if file.is_file() {
                let mut eps = parse_hosts_toml(&file, registry, &upstream_host)?;
                // Docker-style CA files beside a hosts.toml are trusted for the registry's own
                // host too: the one host configuration serves pull and push alike.
                let docker_cas: Vec<PathBuf> = std::fs::read_dir(&host_dir)
                    .map(|entries| {
                        let mut cas: Vec<PathBuf> = entries
                            .flatten()
                            .map(|e| e.path())
                            .filter(|p| p.extension().is_some_and(|x| x == "crt"))
                            .collect();
                        cas.sort();
                        cas
                    })
                    .unwrap_or_default();
                for ep in eps.iter_mut() {
                    ep.docker_config = self.docker_config.clone();
                    if ep.host == upstream_host || ep.host == registry {
                        for ca in &docker_cas {
                            if !ep.ca.contains(ca) {
                                ep.ca.push(ca.clone());
                            }
                        }
                    }
                }
                if plain {
                    for ep in eps.iter_mut().filter(|e| !e.mirror) {
                        ep.plain_http = true;
                    }
                }
                return Ok(eps);
            }
            return Ok(vec![docker_certs_dir(&host_dir, default)?]);
        }
        Ok(vec![default])
    }
}

/// One place a registry's content can be fetched from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// `HOST[:PORT]` requests go to.
    pub host: String,
    /// Where its credentials are looked up (Docker's config directory).
    pub docker_config: Option<PathBuf>,
    pub plain_http: bool,
    /// Extra CA certificates (PEM) to trust.
    pub ca: Vec<PathBuf>,
    pub skip_verify: bool,
    /// A client certificate to present (mutual TLS).
    pub client_cert: Option<ClientCert>,
    /// A mirror (pull only) rather than the registry itself.
    pub mirror: bool,
    /// Pulls may come from here.
    pub pull: bool,
    /// Pushes may go here.
    pub push: bool,
}

impl Endpoint {
    pub fn scheme(&self) -> &'static str {
        if self.plain_http { "http" } else { "https" }
    }

    /// An oci-client for this endpoint, with the bridge it goes through when the endpoint
    /// takes a client certificate (see `mtls`; the bridge stops when dropped). Must be called
    /// inside a tokio runtime.
    pub fn client(&self) -> Result<(oci_client::Client, Option<Bridge>), ImageError> {
        install_crypto_provider();
        let bridge = match &self.client_cert {
            Some(cert) if !self.plain_http => Some(super::mtls::start(&self.host, cert, &self.ca, self.skip_verify)?),
            _ => None,
        };
        let mut certs = Vec::new();
        // Through a bridge the bridge checks the registry against the CA files, not oci-client.
        for path in self.ca.iter().filter(|_| bridge.is_none()) {
            let data = std::fs::read(path).map_err(|source| ImageError::Io {
                what: format!("reading the CA file {}", path.display()),
                source,
            })?;
            certs.push(Certificate {
                encoding: CertificateEncoding::Pem,
                data,
            });
        }
        let config = ClientConfig {
            // Through a bridge, oci-client speaks plain HTTP to it; the bridge speaks TLS.
            protocol: if self.plain_http || bridge.is_some() {
                ClientProtocol::Http
            } else {
                ClientProtocol::Https
            },
            accept_invalid_certificates: self.skip_verify,
            extra_root_certificates: certs,
            connect_timeout: Some(std::time::Duration::from_secs(30)),
            read_timeout: Some(std::time::Duration::from_secs(120)),
            // Index entries are chosen by runner (with --platform); the client must never
            // pick one behind our back.
            platform_resolver: None,
            user_agent: concat!("runner/", env!("CARGO_PKG_VERSION")),
            http_proxy: bridge.as_ref().map(|b| b.proxy_url.clone()),
            ..ClientConfig::default()
        };
        let client = oci_client::Client::try_from(config)
            .map_err(|e| ImageError::Registry(format!("setting up a client for {}: {e}", self.host)))?;
        Ok((client, bridge))
    }

    /// Credentials for this endpoint from Docker's config (anonymous when it has none).
    pub fn auth(&self) -> Result<RegistryAuth, ImageError> {
        let key = if self.host == "index.docker.io" {
            DOCKER_HUB_AUTH_KEY
        } else {
            &self.host
        };
        credentials(self.docker_config.as_deref(), key)
    }
}

/// rustls needs one process-wide crypto provider; reqwest is built without one so that the
/// same `ring` the Kubernetes client uses serves both.
fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Err means another part of the process installed one first: that one serves.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// Docker's credentials for `key` (a host, or Docker Hub's URL): its `auths`, `credsStore`
/// or `credHelpers`. No config file, or no entry for the host, is anonymous access.
pub fn credentials(docker_config: Option<&Path>, key: &str) -> Result<RegistryAuth, ImageError> {
    use docker_credential::{CredentialRetrievalError as E, DockerCredential};
    let Some(file) = docker_config.map(|d| d.join("config.json")).filter(|f| f.exists()) else {
        return Ok(RegistryAuth::Anonymous);
    };
    let read = |key: &str| {
        let f = std::fs::File::open(&file).map_err(|_| E::ConfigReadError)?;
        docker_credential::get_credential_from_reader(std::io::BufReader::new(f), key)
    };
    // Docker's config keeps some hosts under a URL (`https://host`): try that spelling too.
    let found = read(key).or_else(|e| match e {
        E::NoCredentialConfigured if !key.contains("://") => read(&format!("https://{key}")),
        other => Err(other),
    });
    match found {
        Ok(DockerCredential::UsernamePassword(user, password)) => Ok(RegistryAuth::Basic(user, password)),
        Ok(DockerCredential::IdentityToken(token)) => Ok(RegistryAuth::Bearer(token)),
        Err(E::NoCredentialConfigured) => Ok(RegistryAuth::Anonymous),
        Err(e) => Err(ImageError::Registry(format!(
            "reading the credentials for {key} from {}: {e:?}",
            file.display()
        ))),
    }
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct HostsFile {
    server: Option<String>,
    ca: Option<OneOrMany>,
    skip_verify: Option<bool>,
    client: Option<toml::Value>,
    capabilities: Option<Vec<String>>,
    override_path: Option<bool>,
    header: Option<toml::Value>,
    #[serde(default)]
    host: toml::Table,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct HostEntry {
    capabilities: Option<Vec<String>>,
    ca: Option<OneOrMany>,
    skip_verify: Option<bool>,
    client: Option<toml::Value>,
    override_path: Option<bool>,
    header: Option<toml::Value>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn paths(&self, base: &Path) -> Vec<PathBuf> {
        let list = match self {
            OneOrMany::One(p) => vec![p.clone()],
            OneOrMany::Many(ps) => ps.clone(),
        };
        list.into_iter().map(|p| base.join(p)).collect()
    }
}

/// `scheme://host[:port][/path]` → (plain HTTP?, `host[:port]`).
fn split_url(url: &str, file: &Path) -> Result<(bool, String), ImageError> {
    let bad = || {
        ImageError::Registry(format!(
            "{}: {url:?} is not a registry URL (http://HOST[:PORT] or https://HOST[:PORT])",
            file.display()
        ))
    };
    let (scheme, rest) = url.split_once("://").ok_or_else(bad)?;
    let plain = match scheme {
        "http" => true,
        "https" => false,
        _ => return Err(bad()),
    };
    let host = rest.trim_end_matches('/');
    // A path is how containerd reaches registries under a prefix (`override_path`); the
    // distribution API is always at `/v2/`, so a path other than it is refused.
    let host = host.strip_suffix("/v2").unwrap_or(host);
    if host.is_empty() || host.contains('/') {
        return Err(bad());
    }
    Ok((plain, host.to_string()))
}

fn unsupported(file: &Path, what: &str, header: &Option<toml::Value>, over: Option<bool>) -> Result<(), ImageError> {
    if header.is_some() {
        return Err(ImageError::Registry(format!(
            "{}: {what}: extra request headers (`header`) are not supported",
            file.display()
        )));
    }
    if over == Some(true) {
        return Err(ImageError::Registry(format!(
            "{}: {what}: `override_path` is not supported (the registry must serve /v2/)",
            file.display()
        )));
    }
    Ok(())
}

fn parse_hosts_toml(file: &Path, registry: &str, upstream_host: &str) -> Result<Vec<Endpoint>, ImageError> {
    let text = std::fs::read_to_string(file).map_err(|source| ImageError::Io {
        what: format!("reading {}", file.display()),
        source,
    })?;
    let parsed: HostsFile =
        toml::from_str(&text).map_err(|e| ImageError::Registry(format!("{}: {e}", file.display())))?;
    let base = file.parent().unwrap_or(Path::new("/"));
    unsupported(file, "server", &parsed.header, parsed.override_path)?;
    let mut out = Vec::new();
    // toml::Table keeps keys sorted unless `preserve_order`; containerd tries hosts in file
    // order, so recover that order from the text.
    let mut keys: Vec<(usize, &String)> = parsed
        .host
        .keys()
        .map(|k| (text.find(&format!("\"{k}\"")).unwrap_or(usize::MAX), k))
        .collect();
    keys.sort();
    for (_, key) in keys {
        let entry: HostEntry = parsed.host[key]
            .clone()
            .try_into()
            .map_err(|e| ImageError::Registry(format!("{}: host {key:?}: {e}", file.display())))?;
        unsupported(file, &format!("host {key:?}"), &entry.header, entry.override_path)?;
        let (plain_http, host) = split_url(key, file)?;
        let caps = entry
            .capabilities
            .unwrap_or_else(|| vec!["pull".into(), "resolve".into(), "push".into()]);
        if !caps.iter().any(|c| c == "pull") && !caps.iter().any(|c| c == "push") {
            continue;
        }
        out.push(Endpoint {
            host,
            docker_config: None,
            plain_http,
            ca: entry.ca.map(|c| c.paths(base)).unwrap_or_default(),
            skip_verify: entry.skip_verify.unwrap_or(false),
            client_cert: client_cert(file, &format!("host {key:?}"), entry.client.as_ref(), base)?,
            mirror: !caps.iter().any(|c| c == "push"),
            pull: caps.iter().any(|c| c == "pull"),
            push: caps.iter().any(|c| c == "push"),
        });
    }
    let (plain_http, host) = match &parsed.server {
        Some(url) => split_url(url, file)?,
        None => (false, upstream_host.to_string()),
    };
    let server_caps = parsed
        .capabilities
        .unwrap_or_else(|| vec!["pull".into(), "resolve".into(), "push".into()]);
    out.push(Endpoint {
        host,
        docker_config: None,
        plain_http,
        ca: parsed.ca.map(|c| c.paths(base)).unwrap_or_default(),
        skip_verify: parsed.skip_verify.unwrap_or(false),
        client_cert: client_cert(file, "server", parsed.client.as_ref(), base)?,
        mirror: false,
        pull: server_caps.iter().any(|c| c == "pull"),
        push: server_caps.iter().any(|c| c == "push"),
    });
    tracing::debug!(registry, file = %file.display(), endpoints = ?out, "registry hosts");
    Ok(out)
}

/// containerd's `client`: a file holding certificate and key, a list of such files, or a
/// list of `[certificate, key]` pairs (a key of `""` is in the certificate's file). One TLS
/// connection presents one certificate, so more than one is refused rather than silently
/// ignored.
fn client_cert(
    file: &Path,
    what: &str,
    value: Option<&toml::Value>,
    base: &Path,
) -> Result<Option<ClientCert>, ImageError> {
    use toml::Value;
    let Some(value) = value else { return Ok(None) };
    let bad = || {
        ImageError::Registry(format!(
            "{}: {what}: `client` must be a file, a list of files, or a list of [certificate, key] pairs",
            file.display()
        ))
    };
    let one = |v: &Value| -> Result<ClientCert, ImageError> {
        match v {
            Value::String(both) => Ok(ClientCert {
                cert: base.join(both),
                key: base.join(both),
            }),
            Value::Array(pair) => match pair.as_slice() {
                [Value::String(cert)] => Ok(ClientCert {
                    cert: base.join(cert),
                    key: base.join(cert),
                }),
                [Value::String(cert), Value::String(key)] => Ok(ClientCert {
                    cert: base.join(cert),
                    key: base.join(if key.is_empty() { cert } else { key }),
                }),
                _ => Err(bad()),
            },
            _ => Err(bad()),
        }
    };
    let certs = match value {
        Value::Array(list) => list.iter().map(one).collect::<Result<Vec<_>, _>>()?,
        other => vec![one(other)?],
    };
    match certs.len() {
        0 => Ok(None),
        1 => Ok(certs.into_iter().next()),
        n => Err(ImageError::Registry(format!(
            "{}: {what}: {n} client certificates: runner presents one per registry host",
            file.display()
        ))),
    }
}

/// Docker's `certs.d/HOST/` layout: `*.crt` are CA roots; `*.cert` + `*.key` a client pair.
fn docker_certs_dir(dir: &Path, mut endpoint: Endpoint) -> Result<Endpoint, ImageError> {
    let entries = std::fs::read_dir(dir).map_err(|source| ImageError::Io {
        what: format!("reading {}", dir.display()),
        source,
    })?;
    let mut names: BTreeMap<String, PathBuf> = BTreeMap::new();
    for e in entries.flatten() {
        names.insert(e.file_name().to_string_lossy().into_owned(), e.path());
    }
    for (name, path) in names {
        if name.ends_with(".crt") {
            endpoint.ca.push(path);
        } else if let Some(stem) = name.strip_suffix(".cert") {
            // Docker: every `NAME.cert` needs its `NAME.key`.
            let key = dir.join(format!("{stem}.key"));
            if !key.is_file() {
                return Err(ImageError::Registry(format!(
                    "{}: the client certificate has no key ({} is missing)",
                    path.display(),
                    key.display()
                )));
            }
            if endpoint.client_cert.is_some() {
                return Err(ImageError::Registry(format!(
                    "{}: more than one client certificate: runner presents one per registry host",
                    dir.display()
                )));
            }
            endpoint.client_cert = Some(ClientCert { cert: path, key });
        } else if let Some(stem) = name.strip_suffix(".key")
            && !dir.join(format!("{stem}.cert")).is_file()
        {
            return Err(ImageError::Registry(format!(
                "{}: a client key without its certificate ({stem}.cert is missing)",
                path.display()
            )));
        }
    }
    Ok(endpoint)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_with(host: &str, toml: &str) -> (tempfile::TempDir, RegistryConfig) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(host)).unwrap();
        std::fs::write(dir.path().join(host).join("hosts.toml"), toml).unwrap();
        let config = RegistryConfig {
            hosts_dirs: vec![dir.path().to_path_buf()],
            insecure: Vec::new(),
            docker_config: None,
        };
        (dir, config)
    }

    #[test]
    fn mirrors_come_first_in_file_order_then_the_server() {
        let (dir, config) = config_with(
            "docker.io",
            r#"
server = "https://registry-1.docker.io"
[host."http://zmirror:5000"]
  capabilities = ["pull", "resolve"]
[host."https://amirror:5001"]
  capabilities = ["pull", "resolve"]
  ca = "ca.pem"
"#,
        );
        let eps = config.endpoints("docker.io").unwrap();
        let hosts: Vec<_> = eps.iter().map(|e| (e.host.as_str(), e.plain_http, e.mirror)).collect();
        assert_eq!(
            hosts,
            [
                ("zmirror:5000", true, true),
                ("amirror:5001", false, true),
                ("registry-1.docker.io", false, false)
            ]
        );
        assert_eq!(eps[1].ca, [dir.path().join("docker.io/ca.pem")]);
    }

    #[test]
    fn plain_http_is_never_implied_and_unknown_registries_use_https() {
        let config = RegistryConfig::default();
        let eps = config.endpoints("localhost:5000").unwrap();
        assert_eq!(eps.len(), 1);
        assert!(!eps[0].plain_http);
        let insecure = RegistryConfig {
            insecure: vec!["localhost:5000".into()],
            ..RegistryConfig::default()
        };
        assert!(insecure.endpoints("localhost:5000").unwrap()[0].plain_http);
        assert!(!insecure.endpoints("localhost:5001").unwrap()[0].plain_http);
        assert_eq!(config.endpoints("docker.io").unwrap()[0].host, "index.docker.io");
    }

    #[test]
    fn client_certificates_are_read_as_containerd_and_docker_spell_them() {
        let (dir, config) = config_with(
            "r:1",
            "server = \"https://r:1\"\nclient = [[\"c.cert\", \"c.key\"]]\n[host.\"https://m:2\"]\n  client = \"both.pem\"\n",
        );
        let eps = config.endpoints("r:1").unwrap();
        let base = dir.path().join("r:1");
        assert_eq!(
            eps[0].client_cert,
            Some(ClientCert {
                cert: base.join("both.pem"),
                key: base.join("both.pem")
            })
        );
        assert_eq!(
            eps[1].client_cert,
            Some(ClientCert {
                cert: base.join("c.cert"),
                key: base.join("c.key")
            })
        );
        // Docker's certs.d: NAME.cert with NAME.key; a certificate without its key is refused.
        let docker = tempfile::tempdir().unwrap();
        let host = docker.path().join("r:1");
        std::fs::create_dir_all(&host).unwrap();
        std::fs::write(host.join("ca.crt"), "").unwrap();
        std::fs::write(host.join("client.cert"), "").unwrap();
        let config = RegistryConfig {
            hosts_dirs: vec![docker.path().to_path_buf()],
            insecure: Vec::new(),
            docker_config: None,
        };
        let e = config.endpoints("r:1").unwrap_err().to_string();
        assert!(e.contains("client.key is missing"), "{e}");
        std::fs::write(host.join("client.key"), "").unwrap();
        let ep = &config.endpoints("r:1").unwrap()[0];
        assert_eq!(ep.ca, [host.join("ca.crt")]);
        assert_eq!(
            ep.client_cert,
            Some(ClientCert {
                cert: host.join("client.cert"),
                key: host.join("client.key")
            })
        );
    }

    #[test]
    fn what_the_client_cannot_do_is_refused_by_name() {
        let (_d, config) = config_with(
            "r:1",
            "server = \"https://r:1\"\nclient = [[\"a.cert\", \"a.key\"], [\"b.pem\", \"\"]]\n",
        );
        let e = config.endpoints("r:1").unwrap_err().to_string();
        assert!(e.contains("2 client certificates"), "{e}");
        let (_d, config) = config_with("r:1", "server = \"https://r:1\"\nclient = 3\n");
        let e = config.endpoints("r:1").unwrap_err().to_string();
        assert!(e.contains("[certificate, key] pairs"), "{e}");
        let (_d, config) = config_with("r:1", "server = \"ftp://r:1\"\n");
        assert!(
            config
                .endpoints("r:1")
                .unwrap_err()
                .to_string()
                .contains("not a registry URL")
        );
        let (_d, config) = config_with("r:1", "servr = \"https://r:1\"\n");
        assert!(config.endpoints("r:1").unwrap_err().to_string().contains("servr"));
    }
}
