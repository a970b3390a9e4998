//! runner's resolver for bridge networks: the only DNS server a bridge container can reach,
//! and how `egress.allow` domain entries are enforced.
//!
//! One resolver process per host (`runner resolver`, started by the first attach that finds
//! none, holding `resolver.lock` for its life) listens on the bridge's gateway address, on a
//! port of its own (nothing else on the host has to give up port 53): the wall redirects the
//! bridge's DNS traffic (UDP and TCP port 53 to the gateway) to it. A container's
//! `/etc/resolv.conf` names the gateway.
//!
//! Per query it finds the asking container by source address (its policy file, written at
//! attach and removed at detach) and answers:
//! - names of the network (the network's hosts file: job names and container ids) itself;
//! - names an `egress.allow` domain entry matches (`pypi.org`, `*.example.com`) by asking the
//!   upstream resolvers (the runner's `--dns-upstream`, else the host's), adding each IPv4
//!   address of the answer to the container's nftables sets for the answer's TTL (at least
//!   `MIN_TTL`), before the answer goes back — so the connect that follows passes the wall;
//! - anything else NXDOMAIN.
//!
//! An address the host must keep to itself never enters a set, whatever a domain answers
//! (a name may resolve anywhere — DNS rebinding): loopback, link-local (cloud metadata),
//! multicast and reserved ranges, the host's own addresses, and the subnets of the host's
//! bridges (other containers' networks, runner's own included).
//!
//! Parsing: queries come from the sandbox and answers from the network; both are read with
//! bounds checks only, and anything malformed gets FORMERR or SERVFAIL, never a panic.

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::manifest::EgressDomain;

/// One policy file per container, named by its address.
pub const POLICY_DIR: &str = "/run/runner/net/dns";
/// Held (flock) by the live resolver.
pub const RESOLVER_LOCK: &str = "/run/runner/net/resolver.lock";
/// The live resolver's PID and port (written once it listens).
pub const RESOLVER_PID: &str = "/run/runner/net/resolver.pid";
pub const RESOLVER_PORT: &str = "/run/runner/net/resolver.port";
/// The shortest time an answer's address stays allowed: a TTL of 0 or 5 s would expire
/// before the program connects (or while it retries).
pub const MIN_TTL: u32 = 30;
/// The longest: a day, whatever a zone says.
pub const MAX_TTL: u32 = 86_400;
/// How long the resolver lives with no container to serve.
const IDLE_EXIT: Duration = Duration::from_secs(60);
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);

/// What the resolver knows about one container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    pub id: String,
    pub ip: Ipv4Addr,
    pub domains: Vec<EgressDomain>,
    /// Empty: the host's resolvers (`/etc/resolv.conf`, loopback ones included).
    pub upstream: Vec<SocketAddr>,
    /// The nftables sets answers go to: addresses (any port), and address . port pairs.
    pub set: String,
    pub port_set: String,
    /// Its network's hosts file: the names the resolver answers itself.
    pub hosts_file: PathBuf,
}

pub fn policy_path(ip: Ipv4Addr) -> PathBuf {
    Path::new(POLICY_DIR).join(ip.to_string())
}

// ---- The wire format (RFC 1035), as much as the resolver needs ----

pub const TYPE_A: u16 = 1;
const CLASS_IN: u16 = 1;
pub const RCODE_FORMERR: u8 = 1;
pub const RCODE_SERVFAIL: u8 = 2;
pub const RCODE_NXDOMAIN: u8 = 3;
pub const RCODE_REFUSED: u8 = 5;

/// A query's one question.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Query {
    pub id: u16,
    /// Lowercase, without the trailing dot.
    pub name: String,
    pub qtype: u16,
    pub qclass: u16,
    /// Where the question ends (what a response copies).
    pub end: usize,
}

fn u16_at(msg: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*msg.get(at)?, *msg.get(at + 1)?]))
}

fn u32_at(msg: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(msg.get(at..at + 4)?.try_into().ok()?))
}

/// A name at `at`, following compression pointers (a bounded number of them): the name and
/// where the name's own bytes end.
fn read_name(msg: &[u8], mut at: usize) -> Option<(String, usize)> {
    let mut name = String::new();
    let mut end = None;
    let mut jumps = 0;
    loop {
        let len = *msg.get(at)? as usize;
        match len & 0xC0 {
            0x00 if len == 0 => {
                return Some((name, end.unwrap_or(at + 1)));
            }
            0x00 => {
                let label = msg.get(at + 1..at + 1 + len)?;
                if !name.is_empty() {
                    name.push('.');
                }
                // Labels are bytes; anything outside printable ASCII cannot match a rule.
                name.extend(label.iter().map(|&b| {
                    if b.is_ascii_graphic() {
                        b.to_ascii_lowercase() as char
                    } else {
                        '?'
                    }
                }));
                if name.len() > 255 {
                    return None;
                }
                at += 1 + len;
            }
            0xC0 => {
                jumps += 1;
                if jumps > 32 {
                    return None;
                }
                end.get_or_insert(at + 2);
                at = (u16_at(msg, at)? & 0x3FFF) as usize;
            }
            _ => return None,
        }
    }
}

/// A standard query with exactly one question; `None` for anything else.
pub fn parse_query(msg: &[u8]) -> Option<Query> {
    let id = u16_at(msg, 0)?;
    let flags = u16_at(msg, 2)?;
    // QR must be 0 (a query) and the opcode 0 (QUERY).
    if flags & 0x8000 != 0 || (flags >> 11) & 0xF != 0 || u16_at(msg, 4)? != 1 {
        return None;
    }
    let (name, at) = read_name(msg, 12)?;
    let qtype = u16_at(msg, at)?;
    let qclass = u16_at(msg, at + 2)?;
    Some(Query {
        id,
        name,
        qtype,
        qclass,
        end: at + 4,
    })
}

/// The IPv4 addresses of an answer's A records with their TTLs (`None`: not a response one
/// can read).
pub fn a_records(msg: &[u8]) -> Option<Vec<(Ipv4Addr, u32)>> {
    let flags = u16_at(msg, 2)?;
    if flags & 0x8000 == 0 {
        return None;
    }
    let questions = u16_at(msg, 4)?;
    let answers = u16_at(msg, 6)?;
    let mut at = 12;
    for _ in 0..questions {
        at = read_name(msg, at)?.1 + 4;
    }
    let mut out = Vec::new();
    for _ in 0..answers {
        let (_, next) = read_name(msg, at)?;
        let rtype = u16_at(msg, next)?;
        let class = u16_at(msg, next + 2)?;
        let ttl = u32_at(msg, next + 4)?;
        let len = u16_at(msg, next + 8)? as usize;
        let data = msg.get(next + 10..next + 10 + len)?;
        if rtype == TYPE_A && class == CLASS_IN && len == 4 {
            out.push((Ipv4Addr::new(data[0], data[1], data[2], data[3]), ttl));
        }
        at = next + 10 + len;
    }
    Some(out)
}

/// A response to `query` (its question copied) with `rcode` and A records for `answers`.
pub fn response(msg: &[u8], query: &Query, rcode: u8, answers: &[(Ipv4Addr, u32)]) -> Vec<u8> {
    let rd = u16_at(msg, 2).unwrap_or(0) & 0x0100;
    // QR, RD as asked, RA, AA for what the resolver answers itself.
    let flags: u16 = 0x8000 | 0x0400 | rd | 0x0080 | u16::from(rcode & 0xF);
    let mut out = Vec::with_capacity(query.end + answers.len() * 16);
    out.extend_from_slice(&query.id.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&1u16.to_be_bytes());
    out.extend_from_slice(&(answers.len() as u16).to_be_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(&msg[12..query.end]);
    for (addr, ttl) in answers {
        // The name: a pointer to the question's.
        out.extend_from_slice(&[0xC0, 12]);
        out.extend_from_slice(&TYPE_A.to_be_bytes());
        out.extend_from_slice(&CLASS_IN.to_be_bytes());
        out.extend_from_slice(&ttl.to_be_bytes());
        out.extend_from_slice(&4u16.to_be_bytes());
        out.extend_from_slice(&addr.octets());
    }
    out
}

/// An error response when even the question cannot be read: the header's id, FORMERR.
fn formerr(msg: &[u8]) -> Option<Vec<u8>> {
    let id = u16_at(msg, 0)?;
    let mut out = id.to_be_bytes().to_vec();
    out.extend_from_slice(&(0x8000u16 | u16::from(RCODE_FORMERR)).to_be_bytes());
    out.extend_from_slice(&[0; 8]);
    Some(out)
}

// ---- What must never become reachable ----

/// The host's addresses and its bridges' subnets.
#[derive(Clone, Debug, Default)]
pub struct HostNets {
    pub own: Vec<Ipv4Addr>,
    pub bridges: Vec<(Ipv4Addr, u8)>,
}

impl HostNets {
    pub fn read() -> Self {
        let mut nets = HostNets::default();
        let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
            return nets;
        };
        for a in addrs {
            let Some(addr) = a.address.as_ref().and_then(|s| s.as_sockaddr_in()).map(|s| s.ip()) else {
                continue;
            };
            nets.own.push(addr);
            let bridge = Path::new("/sys/class/net")
                .join(&a.interface_name)
                .join("bridge")
                .exists();
            if let (true, Some(mask)) = (bridge, a.netmask.as_ref().and_then(|s| s.as_sockaddr_in())) {
                nets.bridges.push((addr, u32::from(mask.ip()).count_ones() as u8));
            }
        }
        nets
    }
}

fn within(addr: Ipv4Addr, net: Ipv4Addr, prefix: u8) -> bool {
    let mask = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - prefix.min(32))
    };
    u32::from(addr) & mask == u32::from(net) & mask
}

/// Why an answer's address stays out of a container's sets (`None`: it may go in).
pub fn forbidden(addr: Ipv4Addr, host: &HostNets) -> Option<&'static str> {
    let fixed: [(Ipv4Addr, u8, &'static str); 6] = [
        (Ipv4Addr::new(0, 0, 0, 0), 8, "\"this\" network"),
        (Ipv4Addr::new(127, 0, 0, 0), 8, "loopback"),
        (Ipv4Addr::new(169, 254, 0, 0), 16, "link-local (cloud metadata)"),
        (Ipv4Addr::new(224, 0, 0, 0), 4, "multicast"),
        (Ipv4Addr::new(240, 0, 0, 0), 4, "reserved"),
        (Ipv4Addr::new(10, 89, 0, 0), 16, "runner's bridge network"),
    ];
    if let Some((_, _, why)) = fixed.iter().find(|(net, p, _)| within(addr, *net, *p)) {
        return Some(why);
    }
    if host.own.contains(&addr) {
        return Some("an address of the host");
    }
    if host.bridges.iter().any(|(net, p)| within(addr, *net, *p)) {
        return Some("a container network of the host");
    }
    None
}

// ---- The server ----

/// The host's resolvers (`nameserver` lines of `/etc/resolv.conf`), port 53.
fn host_resolvers() -> Vec<SocketAddr> {
    std::fs::read_to_string("/etc/resolv.conf")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("nameserver"))
                .then(|| w.next()?.parse::<IpAddr>().ok())
                .flatten()
        })
        .map(|ip| SocketAddr::new(ip, 53))
        .collect()
}

/// The network's names (the hosts file the containers see): the address of `name`.
fn network_name(hosts_file: &Path, name: &str) -> Option<Ipv4Addr> {
    let text = std::fs::read_to_string(hosts_file).ok()?;
    text.lines().filter(|l| l.contains("\t# ")).find_map(|l| {
        let mut fields = l.split('\t');
        let ip = fields.next()?.parse().ok()?;
        fields
            .next()?
            .split_whitespace()
            .any(|n| n.eq_ignore_ascii_case(name))
            .then_some(ip)
    })
}

async fn exchange_udp(server: SocketAddr, msg: &[u8]) -> io::Result<Vec<u8>> {
    let bind: SocketAddr = if server.is_ipv4() {
        "0.0.0.0:0".parse().expect("literal")
    } else {
        "[::]:0".parse().expect("literal")
    };
    let sock = tokio::net::UdpSocket::bind(bind).await?;
    sock.connect(server).await?;
    sock.send(msg).await?;
    let mut buf = vec![0u8; 65_535];
    loop {
        let n = tokio::time::timeout(UPSTREAM_TIMEOUT, sock.recv(&mut buf))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no answer"))??;
        // An answer to another id is not ours (a late one, or a spoof): wait on.
        if n >= 2 && buf[..2] == msg[..2] {
            return Ok(buf[..n].to_vec());
        }
    }
}

async fn exchange_tcp(server: SocketAddr, msg: &[u8]) -> io::Result<Vec<u8>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let work = async {
        let mut s = tokio::net::TcpStream::connect(server).await?;
        let mut framed = (msg.len() as u16).to_be_bytes().to_vec();
        framed.extend_from_slice(msg);
        s.write_all(&framed).await?;
        let len = s.read_u16().await? as usize;
        let mut buf = vec![0u8; len];
        s.read_exact(&mut buf).await?;
        Ok(buf)
    };
    tokio::time::timeout(UPSTREAM_TIMEOUT, work)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no answer"))?
}

/// Add answers to a container's sets, each for its TTL: add, delete, add again in one
/// transaction, so an address already there gets the new timeout.
fn allow_answers(policy: &Policy, rules: &[EgressDomain], answers: &[(Ipv4Addr, u32)]) -> io::Result<()> {
    let mut script = String::new();
    for (addr, ttl) in answers {
        let t = (*ttl).clamp(MIN_TTL, MAX_TTL);
        for rule in rules {
            let (set, elem) = match rule.port {
                None => (&policy.set, addr.to_string()),
                Some(p) => (&policy.port_set, format!("{addr} . {p}")),
            };
            for line in [
                format!("add element inet runner {set} {{ {elem} }}"),
                format!("delete element inet runner {set} {{ {elem} }}"),
                format!("add element inet runner {set} {{ {elem} timeout {t}s }}"),
            ] {
                script.push_str(&line);
                script.push('\n');
            }
        }
    }
    if script.is_empty() {
        return Ok(());
    }
    let mut child = std::process::Command::new("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    io::Write::write_all(&mut child.stdin.take().expect("piped"), script.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        return Err(io::Error::other(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    Ok(())
}

/// What the resolver answers one message from `from` (over TCP when `tcp`); `None`: drop it.
pub async fn answer(msg: &[u8], from: IpAddr, tcp: bool) -> Option<Vec<u8>> {
    let Some(query) = parse_query(msg) else {
        return formerr(msg);
    };
    let IpAddr::V4(from) = from else {
        return Some(response(msg, &query, RCODE_REFUSED, &[]));
    };
    let policy: Option<Policy> = std::fs::read(policy_path(from))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    let Some(policy) = policy else {
        return Some(response(msg, &query, RCODE_REFUSED, &[]));
    };
    if query.qclass == CLASS_IN
        && let Some(ip) = network_name(&policy.hosts_file, &query.name)
    {
        let answers = if query.qtype == TYPE_A {
            vec![(ip, 5)]
        } else {
            Vec::new()
        };
        return Some(response(msg, &query, 0, &answers));
    }
    let rules: Vec<EgressDomain> = policy
        .domains
        .iter()
        .filter(|d| d.matches(&query.name))
        .cloned()
        .collect();
    if rules.is_empty() {
        tracing::info!(
            container = policy.id,
            name = query.name,
            "refused: no egress rule names it"
        );
        return Some(response(msg, &query, RCODE_NXDOMAIN, &[]));
    }
    let upstream = if policy.upstream.is_empty() {
        host_resolvers()
    } else {
        policy.upstream.clone()
    };
    let mut reply = None;
    for server in &upstream {
        let got = if tcp {
            exchange_tcp(*server, msg).await
        } else {
            exchange_udp(*server, msg).await
        };
        match got {
            Ok(r) => {
                reply = Some(r);
                break;
            }
            Err(e) => tracing::warn!(%server, error = %e, "upstream resolver failed"),
        }
    }
    let Some(reply) = reply else {
        return Some(response(msg, &query, RCODE_SERVFAIL, &[]));
    };
    let Some(records) = a_records(&reply) else {
        return Some(response(msg, &query, RCODE_SERVFAIL, &[]));
    };
    let host = HostNets::read();
    let allowed: Vec<(Ipv4Addr, u32)> = records
        .into_iter()
        .filter(|(addr, _)| match forbidden(*addr, &host) {
            Some(why) => {
                tracing::warn!(container = policy.id, name = query.name, %addr, why, "an answer's address stays blocked");
                false
            }
            None => true,
        })
        .collect();
    let added = tokio::task::spawn_blocking(move || allow_answers(&policy, &rules, &allowed)).await;
    match added {
        Ok(Ok(())) => Some(reply),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "adding answers to the container's sets failed");
            Some(response(msg, &query, RCODE_SERVFAIL, &[]))
        }
        Err(_) => Some(response(msg, &query, RCODE_SERVFAIL, &[])),
    }
}

/// Run the resolver until it has had nobody to serve for `IDLE_EXIT`: prints `ready <port>`
/// on stdout once it listens. Exits at once (Ok) when another one runs. It listens on every
/// address (each network's gateway is one); the wall lets only the networks reach the port.
pub async fn serve(network_lock: &'static str) -> io::Result<()> {
    let listen = Ipv4Addr::UNSPECIFIED;
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    std::fs::create_dir_all(POLICY_DIR)?;
    let lock_file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(RESOLVER_LOCK)?;
    let _held = match nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(l) => l,
        Err(_) => {
            println!(
                "running {}",
                std::fs::read_to_string(RESOLVER_PORT).unwrap_or_default().trim()
            );
            return Ok(());
        }
    };
    let (udp, tcp) = {
        let mut tries = 0;
        loop {
            let udp = tokio::net::UdpSocket::bind((listen, 0)).await?;
            let port = udp.local_addr()?.port();
            match tokio::net::TcpListener::bind((listen, port)).await {
                Ok(tcp) => break (udp, tcp),
                Err(e) if tries < 16 => {
                    tries += 1;
                    tracing::debug!(port, error = %e, "the TCP side of a port is taken; another port");
                }
                Err(e) => return Err(e),
            }
        }
    };
    let port = udp.local_addr()?.port();
    std::fs::write(RESOLVER_PID, std::process::id().to_string())?;
    std::fs::write(RESOLVER_PORT, port.to_string())?;
    println!("ready {port}");
    use std::io::Write;
    let _ = std::io::stdout().flush();
    // Whoever started it stops reading: nothing more goes to that pipe.
    if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
        let _ = nix::unistd::dup2_stdout(&null);
    }
    let udp = Arc::new(udp);
    {
        let udp = udp.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            loop {
                let Ok((n, peer)) = udp.recv_from(&mut buf).await else {
                    continue;
                };
                let msg = buf[..n].to_vec();
                let udp = udp.clone();
                tokio::spawn(async move {
                    if let Some(out) = answer(&msg, peer.ip(), false).await {
                        let _ = udp.send_to(&out, peer).await;
                    }
                });
            }
        });
    }
    {
        tokio::spawn(async move {
            loop {
                let Ok((mut stream, peer)) = tcp.accept().await else {
                    continue;
                };
                tokio::spawn(async move {
                    let work = async {
                        loop {
                            let len = stream.read_u16().await? as usize;
                            let mut msg = vec![0u8; len];
                            stream.read_exact(&mut msg).await?;
                            if let Some(out) = answer(&msg, peer.ip(), true).await {
                                let mut framed = (out.len() as u16).to_be_bytes().to_vec();
                                framed.extend_from_slice(&out);
                                stream.write_all(&framed).await?;
                            }
                        }
                        #[allow(unreachable_code)]
                        Ok::<(), io::Error>(())
                    };
                    // A silent client is dropped after a while.
                    let _ = tokio::time::timeout(Duration::from_secs(30), work).await;
                });
            }
        });
    }
    // Exit when no container has had a policy for IDLE_EXIT. The decision is taken under
    // the network lock: an attach (which holds it) either sees this resolver gone, or its
    // policy file is seen here.
    let mut idle_since: Option<std::time::Instant> = None;
    loop {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let empty = std::fs::read_dir(POLICY_DIR)
            .map(|mut d| d.next().is_none())
            .unwrap_or(true);
        if !empty {
            idle_since = None;
            continue;
        }
        let since = *idle_since.get_or_insert_with(std::time::Instant::now);
        if since.elapsed() < IDLE_EXIT {
            continue;
        }
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(network_lock)?;
        let _network =
            nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive).map_err(|(_, e)| io::Error::from(e))?;
        if std::fs::read_dir(POLICY_DIR)
            .map(|mut d| d.next().is_none())
            .unwrap_or(true)
        {
            let _ = std::fs::remove_file(RESOLVER_PID);
            let _ = std::fs::remove_file(RESOLVER_PORT);
            tracing::info!("no container to serve; exiting");
            return Ok(());
        }
        idle_since = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut m = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for label in name.split('.') {
            m.push(label.len() as u8);
            m.extend_from_slice(label.as_bytes());
        }
        m.push(0);
        m.extend_from_slice(&qtype.to_be_bytes());
        m.extend_from_slice(&1u16.to_be_bytes());
        m
    }

    #[test]
    fn a_query_is_read_and_answered_with_its_question() {
        let m = query("PyPI.org", TYPE_A);
        let q = parse_query(&m).unwrap();
        assert_eq!(
            (q.id, q.name.as_str(), q.qtype, q.end),
            (0x1234, "pypi.org", TYPE_A, m.len())
        );
        let r = response(
            &m,
            &q,
            0,
            &[(Ipv4Addr::new(1, 2, 3, 4), 60), (Ipv4Addr::new(5, 6, 7, 8), 10)],
        );
        assert_eq!(
            a_records(&r).unwrap(),
            vec![(Ipv4Addr::new(1, 2, 3, 4), 60), (Ipv4Addr::new(5, 6, 7, 8), 10)]
        );
        assert_eq!(r[3] & 0xF, 0);
        let nx = response(&m, &q, RCODE_NXDOMAIN, &[]);
        assert_eq!((nx[3] & 0xF, a_records(&nx).unwrap().len()), (RCODE_NXDOMAIN, 0));
    }

    #[test]
    fn hostile_messages_are_refused_without_panicking() {
        let good = query("a.example", TYPE_A);
        // Every truncation, and every single-byte corruption, of a query and of an answer.
        let answer = response(
            &good,
            &parse_query(&good).unwrap(),
            0,
            &[(Ipv4Addr::new(9, 9, 9, 9), 1)],
        );
        for msg in [&good, &answer] {
            for n in 0..msg.len() {
                let _ = parse_query(&msg[..n]);
                let _ = a_records(&msg[..n]);
            }
            for i in 0..msg.len() {
                for b in [0x00, 0x3F, 0xC0, 0xFF] {
                    let mut m = msg.to_vec();
                    m[i] = b;
                    let _ = parse_query(&m);
                    let _ = a_records(&m);
                }
            }
        }
        // A pointer loop ends.
        let mut looped = good[..12].to_vec();
        looped.extend_from_slice(&[0xC0, 12]);
        assert!(parse_query(&looped).is_none());
        // A response is not a query.
        assert!(parse_query(&answer).is_none());
        assert_eq!(formerr(&[0xAB, 0xCD]).unwrap()[..4], [0xAB, 0xCD, 0x80, RCODE_FORMERR]);
    }

    #[test]
    fn addresses_the_host_keeps_to_itself_never_become_reachable() {
        let host = HostNets {
            own: vec![Ipv4Addr::new(192, 0, 2, 10)],
            bridges: vec![(Ipv4Addr::new(172, 17, 0, 1), 16)],
        };
        for a in [
            "169.254.169.254",
            "127.0.0.53",
            "10.89.3.4",
            "192.0.2.10",
            "172.17.5.5",
            "224.0.0.1",
            "0.0.0.0",
            "255.255.255.255",
        ] {
            assert!(forbidden(a.parse().unwrap(), &host).is_some(), "{a}");
        }
        for a in ["203.0.113.7", "10.199.1.2", "172.18.0.2", "192.0.2.11"] {
            assert!(forbidden(a.parse().unwrap(), &host).is_none(), "{a}");
        }
    }
}
