//! Published ports: each host port a container asks for (or a free one) is recorded
//! host-wide (`<protocol> <hostIP> <hostPort> <container id>` per line in the network
//! directory's `ports`, under the network lock), refused when another container or a host
//! process holds it, and released with the container after portmap's DEL.

use std::io;
use std::path::Path;

use super::{NetError, PortStatus, io_err};
use crate::manifest::{PortSpec, Protocol};

/// How many free-port picks may land on a port another container holds before giving up.
const PICK_TRIES: usize = 64;

fn recorded_ports(file: &Path) -> Result<Vec<(Protocol, std::net::Ipv4Addr, u16, String)>, NetError> {
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(io_err(format!("reading {}", file.display()))(e)),
    };
    Ok(text
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let proto = match w.next()? {
                "tcp" => Protocol::Tcp,
                "udp" => Protocol::Udp,
                _ => return None,
            };
            Some((
                proto,
                w.next()?.parse().ok()?,
                w.next()?.parse().ok()?,
                w.next()?.to_string(),
            ))
        })
        .collect())
}

/// Whether two bindings of one protocol and port collide (a wildcard address takes them all).
fn overlaps(a: std::net::Ipv4Addr, b: std::net::Ipv4Addr) -> bool {
    a == b || a.is_unspecified() || b.is_unspecified()
}

/// Bind the host's `ip:port` for a moment: the port it got (0 asks the kernel for a free
/// one), or why it cannot be had.
fn probe(protocol: Protocol, ip: std::net::Ipv4Addr, port: u16) -> io::Result<u16> {
    let addr = std::net::SocketAddr::from((ip, port));
    match protocol {
        Protocol::Tcp => std::net::TcpListener::bind(addr)?.local_addr().map(|a| a.port()),
        Protocol::Udp => std::net::UdpSocket::bind(addr)?.local_addr().map(|a| a.port()),
    }
}

/// The host port of each published port: the one asked for (refused when another container
/// or a host process has it) or a free one.
pub fn pick(file: &Path, ports: &[PortSpec]) -> Result<Vec<PortStatus>, NetError> {
    let mut taken = recorded_ports(file)?;
    let mut out = Vec::new();
    for p in ports {
        let held = |taken: &[(Protocol, std::net::Ipv4Addr, u16, String)], port: u16| {
            taken
                .iter()
                .find(|(proto, ip, n, _)| *proto == p.protocol && *n == port && overlaps(*ip, p.host_ip))
                .map(|(_, _, _, id)| id.clone())
        };
        let unavailable = |port: u16, e: io::Error| {
            NetError::Ports(match e.kind() {
                io::ErrorKind::AddrNotAvailable => format!("hostIP {} is not an address of this host", p.host_ip),
                io::ErrorKind::AddrInUse => format!(
                    "hostPort {port}/{} on {} is in use by a process of this host",
                    p.protocol.as_str(),
                    p.host_ip
                ),
                _ => format!("binding {}:{port}/{}: {e}", p.host_ip, p.protocol.as_str()),
            })
        };
        let host_port = match p.host_port {
            Some(port) => {
                if let Some(other) = held(&taken, port) {
                    return Err(NetError::Ports(format!(
                        "hostPort {port}/{} on {} is published by container {other} already",
                        p.protocol.as_str(),
                        p.host_ip
                    )));
                }
                probe(p.protocol, p.host_ip, port).map_err(|e| unavailable(port, e))?
            }
            None => {
                let mut got = None;
                for _ in 0..PICK_TRIES {
                    let port = probe(p.protocol, p.host_ip, 0).map_err(|e| unavailable(0, e))?;
                    if held(&taken, port).is_none() {
                        got = Some(port);
                        break;
                    }
                }
                got.ok_or_else(|| NetError::Ports("no free host port found".into()))?
            }
        };
        // Later entries of this container see the earlier ones as taken.
        taken.push((p.protocol, p.host_ip, host_port, String::new()));
        out.push(PortStatus {
            name: p.name.clone(),
            container_port: p.container_port,
            protocol: p.protocol,
            host_ip: p.host_ip.to_string(),
            host_port,
        });
    }
    Ok(out)
}

fn write_ports(file: &Path, lines: &[(Protocol, std::net::Ipv4Addr, u16, String)]) -> Result<(), NetError> {
    let text: String = lines
        .iter()
        .map(|(proto, ip, port, id)| format!("{} {ip} {port} {id}\n", proto.lower()))
        .collect();
    let tmp = file.with_extension("tmp");
    if let Some(parent) = file.parent() {
        std::fs::create_dir_all(parent).map_err(io_err(format!("creating {}", parent.display())))?;
    }
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, file))
        .map_err(io_err(format!("writing {}", file.display())))
}

pub fn record(file: &Path, id: &str, published: &[PortStatus]) -> Result<(), NetError> {
    if published.is_empty() {
        return Ok(());
    }
    let mut lines = recorded_ports(file)?;
    for p in published {
        let ip = p.host_ip.parse().unwrap_or(std::net::Ipv4Addr::UNSPECIFIED);
        lines.push((p.protocol, ip, p.host_port, id.to_string()));
    }
    write_ports(file, &lines)
}

/// Forget container `id`'s ports (none is success).
pub fn release(file: &Path, id: &str) -> Result<(), NetError> {
    let lines = recorded_ports(file)?;
    if !lines.iter().any(|l| l.3 == id) {
        return Ok(());
    }
    let kept: Vec<_> = lines.into_iter().filter(|l| l.3 != id).collect();
    write_ports(file, &kept)
}

/// Whether any port is recorded.
pub fn any(file: &Path) -> bool {
    std::fs::read_to_string(file).is_ok_and(|t| !t.trim().is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(port: Option<u16>) -> PortSpec {
        PortSpec {
            name: None,
            container_port: 80,
            host_port: port,
            host_ip: std::net::Ipv4Addr::LOCALHOST,
            protocol: Protocol::Tcp,
        }
    }

    #[test]
    fn a_port_is_handed_out_once_and_released_with_its_container() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ports");
        let got = pick(&file, &[spec(None)]).unwrap();
        record(&file, "c1", &got).unwrap();
        let port = got[0].host_port;
        let err = pick(&file, &[spec(Some(port))]).unwrap_err().to_string();
        assert!(err.contains("published by container c1"), "{err}");
        // A free pick never lands on a recorded port.
        for _ in 0..20 {
            assert_ne!(pick(&file, &[spec(None)]).unwrap()[0].host_port, port);
        }
        release(&file, "c1").unwrap();
        assert!(!any(&file));
        assert_eq!(pick(&file, &[spec(Some(port))]).unwrap()[0].host_port, port);
    }
}
