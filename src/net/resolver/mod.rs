//! runner's resolver for bridge networks: the only DNS server a bridge container reaches, and
//! how `egress.allow` domain entries are enforced.
//!
//! One resolver process per host (`runner resolver`, started by the first attach that finds
//! none, holding `resolver.lock` for its life) listens on every address on a port of its own;
//! the wall redirects the bridges' DNS traffic (port 53 to a gateway) to it and lets nothing
//! else reach the port. Per query it finds the asking container by source address in its
//! policies (in memory, changed over the control socket at attach, detach and PATCH) and
//! answers: the network's names itself; a name a domain entry matches by asking the upstream
//! resolvers (the container's, else the host's), putting every address the answer ends in
//! (through its CNAME chain) that no closed range holds into the container's sets for the
//! answer's TTL (at least `MIN_TTL`) before the answer goes back; everything else NXDOMAIN.
//!
//! It is shared by every sandbox of the host, so it is bounded (`limits`, `Config`'s
//! `ResolverLimits`): per source a query rate, upstream queries and TCP connections in flight;
//! globally tasks, connections, cache, elements and memory; the kernel's sets are changed
//! in-process in batches (`sets`), answers cached for their TTL (`cache`), the log capped
//! (`log`). When it cannot read the host's addresses it refuses every domain answer.

pub mod cache;
pub mod control;
pub mod limits;
pub mod log;
pub mod ranges;
mod server;
pub mod sets;
pub mod wire;

use std::net::{Ipv4Addr, SocketAddr};

use serde::{Deserialize, Serialize};

pub use control::Control;
pub use server::run;

use crate::config::NetPaths;
use crate::manifest::EgressDomain;

/// The shortest time an answer's address stays allowed: a TTL of 0 or 5 s would expire
/// before the program connects (or while it retries).
pub const MIN_TTL: u32 = 30;
/// The longest: a day, whatever a zone says.
pub const MAX_TTL: u32 = 86_400;

#[derive(Debug, thiserror::Error)]
pub enum ResolverError {
    #[error("{0}")]
    Start(String),
    #[error("its control socket {socket}: {source}")]
    Control {
        socket: String,
        #[source]
        source: std::io::Error,
    },
    #[error("it refused: {0}")]
    Refused(String),
    #[error("{what}: {source}")]
    Files {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// What the resolver knows about one container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    pub id: String,
    pub ip: Ipv4Addr,
    /// Its name on its network (its job's name; empty when not a valid name).
    #[serde(default)]
    pub name: String,
    /// Its network (the CNI network name): whose names it may ask for.
    #[serde(default)]
    pub network: String,
    pub domains: Vec<EgressDomain>,
    /// Empty: the host's resolvers (`/etc/resolv.conf`, loopback ones included).
    pub upstream: Vec<SocketAddr>,
}

fn files_err(what: String) -> impl FnOnce(std::io::Error) -> ResolverError {
    move |source| ResolverError::Files { what, source }
}

/// Keep a policy as the file a restarted resolver loads.
pub fn write_policy(paths: &NetPaths, policy: &Policy) -> Result<(), ResolverError> {
    let dir = paths.policy_dir();
    std::fs::create_dir_all(&dir).map_err(files_err(format!("creating {}", dir.display())))?;
    let path = dir.join(policy.ip.to_string());
    let tmp = path.with_extension("tmp");
    let text =
        serde_json::to_vec(policy).map_err(|e| files_err("encoding a policy".into())(std::io::Error::other(e)))?;
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(files_err(format!("writing {}", path.display())))
}

pub fn remove_policy(paths: &NetPaths, ip: Ipv4Addr) -> Result<(), ResolverError> {
    let path = paths.policy_dir().join(ip.to_string());
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(files_err(format!("removing {}", path.display()))(e)),
        _ => Ok(()),
    }
}

/// Whether any container has a policy.
pub fn any_policy(paths: &NetPaths) -> bool {
    std::fs::read_dir(paths.policy_dir()).is_ok_and(|mut d| d.next().is_some())
}

/// Every policy file (what a starting resolver loads).
pub fn load_policies(paths: &NetPaths) -> Vec<Policy> {
    let Ok(dir) = std::fs::read_dir(paths.policy_dir()) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| std::fs::read(e.path()).ok())
        .filter_map(|b| serde_json::from_slice(&b).ok())
        .collect()
}

/// The host's resolvers (`nameserver` lines of its resolv.conf), port 53.
pub fn host_resolvers(text: &str) -> Vec<SocketAddr> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("nameserver"))
                .then(|| w.next()?.parse::<std::net::IpAddr>().ok())
                .flatten()
        })
        .map(|ip| SocketAddr::new(ip, 53))
        .collect()
}
