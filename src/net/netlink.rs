//! A small netlink client of our own, for the few messages the network layer sends per answer
//! or per attach, in-process: nf_tables set elements added and deleted in one batch
//! (`NFT_MSG_NEWSETELEM` / `NFT_MSG_DELSETELEM` between `NFNL_MSG_BATCH_BEGIN` and `_END`, as
//! libnftnl's `nftnl_batch` sends them), a set's existence (`NFT_MSG_GETSET`), and a link's
//! removal (`RTM_DELLINK`).
//!
//! Why not a crate: `rustables` (the maintained pure-Rust nf_tables netlink crate) is
//! GPL-3.0-or-later, and `nftnl`/`mnl` bind libnftnl through C for the same three messages.
//! What is needed is a few dozen bytes per message, so it is built here and tested: the byte
//! layout below without root, and against a real table in a namespace of the test's own in
//! tests/network.rs.
//!
//! Layout (include/uapi/linux/netlink.h, netfilter/nfnetlink.h, netfilter/nf_tables.h):
//! every message is an `nlmsghdr` (native endian), for nfnetlink followed by an `nfgenmsg`
//! (family, version, resource id in network order), then attributes (`nlattr`: length, type,
//! payload padded to 4 bytes). Set element keys are the set's key bytes: an IPv4 address in
//! network order, and for a concatenation each field rounded up to 4 bytes (nft's registers).

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

const NETLINK_ROUTE: libc::c_int = 0;
const NETLINK_NETFILTER: libc::c_int = 12;

const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_CREATE: u16 = 0x400;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLA_F_NESTED: u16 = 0x8000;

const NFNL_MSG_BATCH_BEGIN: u16 = 16;
const NFNL_MSG_BATCH_END: u16 = 17;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_GETSET: u16 = 10;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_DELSETELEM: u16 = 14;
/// `NFPROTO_INET`: the family of an `inet` table.
const NFPROTO_INET: u8 = 1;

const NFTA_SET_TABLE: u16 = 1;
const NFTA_SET_NAME: u16 = 2;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_TIMEOUT: u16 = 4;
const NFTA_DATA_VALUE: u16 = 1;

const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const RTM_NEWADDR: u16 = 20;
const RTM_NEWROUTE: u16 = 24;
const NLM_F_EXCL: u16 = 0x200;
const IFLA_IFNAME: u16 = 3;
const IFLA_MASTER: u16 = 10;
const IFLA_LINKINFO: u16 = 18;
const IFLA_NET_NS_FD: u16 = 28;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_INFO_DATA: u16 = 2;
const VETH_INFO_PEER: u16 = 1;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const IFA_BROADCAST: u16 = 4;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;

/// How long a reply may take: the kernel answers at once, so this is only a guard.
const REPLY_TIMEOUT: Duration = Duration::from_secs(2);
/// Elements per batch message: a message stays well under a page per element list.
const ELEMENTS_PER_MESSAGE: usize = 64;

/// One element of the containers' domain sets: `container . address` (set `dom`), or
/// `container . address . port` (`dom_port`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub container: Ipv4Addr,
    pub addr: Ipv4Addr,
    pub port: Option<u16>,
}

impl Key {
    fn bytes(&self) -> Vec<u8> {
        let mut b = self.container.octets().to_vec();
        b.extend_from_slice(&self.addr.octets());
        if let Some(p) = self.port {
            b.extend_from_slice(&p.to_be_bytes());
            // The port's register is 4 bytes wide.
            b.extend_from_slice(&[0, 0]);
        }
        b
    }
}

/// What one batch does to one set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Add `key` to `set`, expiring after `timeout` (an element already there gets the new
    /// timeout: it is added, deleted and added again, all in the batch).
    Add { set: String, key: Key, timeout: Duration },
    /// Delete `key` from `set` (it must be there, or the whole batch fails).
    Delete { set: String, key: Key },
}

fn align(n: usize) -> usize {
    (n + 3) & !3
}

/// Append an attribute.
fn attr(buf: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(payload);
    buf.resize(buf.len() + align(len) - len, 0);
}

/// Append a nested attribute made by `inner`.
fn nested(buf: &mut Vec<u8>, kind: u16, inner: impl FnOnce(&mut Vec<u8>)) {
    let start = buf.len();
    buf.extend_from_slice(&[0, 0]);
    buf.extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
    inner(buf);
    let len = (buf.len() - start) as u16;
    buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
}

fn cstr(s: &str) -> Vec<u8> {
    let mut b = s.as_bytes().to_vec();
    b.push(0);
    b
}

/// One netlink message: header, then `body` (for nfnetlink, the nfgenmsg and attributes).
fn message(buf: &mut Vec<u8>, kind: u16, flags: u16, seq: u32, body: &[u8]) {
    let len = 16 + body.len();
    buf.extend_from_slice(&(len as u32).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(&flags.to_ne_bytes());
    buf.extend_from_slice(&seq.to_ne_bytes());
    buf.extend_from_slice(&0u32.to_ne_bytes());
    buf.extend_from_slice(body);
}

fn nfgenmsg(family: u8, res_id: u16) -> Vec<u8> {
    let mut b = vec![family, 0];
    b.extend_from_slice(&res_id.to_be_bytes());
    b
}

/// The bytes of one batch applying `changes` to sets of the `inet` table `table`, and the
/// sequence numbers whose acknowledgement the kernel sends (one per element message).
///
/// Per set and key the last change wins. The batch is three phases, each a few messages of up
/// to `ELEMENTS_PER_MESSAGE` elements: every added key without a timeout (so it exists), every
/// added or deleted key deleted, every added key with its timeout (so one already there gets
/// the new one). A key appears once per message, and messages stay few (each is acknowledged:
/// one per element overflowed the socket's buffer).
pub fn batch(table: &str, changes: &[Change], first_seq: u32) -> (Vec<u8>, Vec<u32>) {
    let mut last: Vec<(&str, Key, Option<Duration>)> = Vec::new();
    for change in changes {
        let (set, key, timeout) = match change {
            Change::Add { set, key, timeout } => (set.as_str(), *key, Some(*timeout)),
            Change::Delete { set, key } => (set.as_str(), *key, None),
        };
        last.retain(|(s, k, _)| !(*s == set && *k == key));
        last.push((set, key, timeout));
    }
    let mut sets: Vec<&str> = last.iter().map(|(s, _, _)| *s).collect();
    sets.sort_unstable();
    sets.dedup();
    type Op<'a> = (u16, &'a str, Vec<(Key, Option<Duration>)>);
    let mut ops: Vec<Op<'_>> = Vec::new();
    let mut phase = |op: u16, pick: &dyn Fn(&Option<Duration>) -> Option<Option<Duration>>| {
        for set in &sets {
            let keys: Vec<(Key, Option<Duration>)> = last
                .iter()
                .filter(|(s, _, _)| s == set)
                .filter_map(|(_, k, t)| pick(t).map(|t| (*k, t)))
                .collect();
            for chunk in keys.chunks(ELEMENTS_PER_MESSAGE) {
                ops.push((op, set, chunk.to_vec()));
            }
        }
    };
    phase(NFT_MSG_NEWSETELEM, &|t| t.map(|_| None));
    phase(NFT_MSG_DELSETELEM, &|_| Some(None));
    phase(NFT_MSG_NEWSETELEM, &|t| t.map(Some));
    let mut buf = Vec::new();
    let mut seq = first_seq;
    message(
        &mut buf,
        NFNL_MSG_BATCH_BEGIN,
        NLM_F_REQUEST,
        seq,
        &nfgenmsg(libc::AF_UNSPEC as u8, NFNL_SUBSYS_NFTABLES),
    );
    let mut acked = Vec::new();
    for (op, set, keys) in &ops {
        seq += 1;
        let mut body = nfgenmsg(NFPROTO_INET, 0);
        attr(&mut body, NFTA_SET_ELEM_LIST_TABLE, &cstr(table));
        attr(&mut body, NFTA_SET_ELEM_LIST_SET, &cstr(set));
        nested(&mut body, NFTA_SET_ELEM_LIST_ELEMENTS, |b| {
            for (key, timeout) in keys {
                nested(b, NFTA_LIST_ELEM, |b| {
                    nested(b, NFTA_SET_ELEM_KEY, |b| attr(b, NFTA_DATA_VALUE, &key.bytes()));
                    if let Some(t) = timeout {
                        attr(b, NFTA_SET_ELEM_TIMEOUT, &(t.as_millis() as u64).to_be_bytes());
                    }
                });
            }
        });
        let flags = if *op == NFT_MSG_NEWSETELEM {
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE
        } else {
            NLM_F_REQUEST | NLM_F_ACK
        };
        message(&mut buf, (NFNL_SUBSYS_NFTABLES << 8) | op, flags, seq, &body);
        acked.push(seq);
    }
    seq += 1;
    message(
        &mut buf,
        NFNL_MSG_BATCH_END,
        NLM_F_REQUEST,
        seq,
        &nfgenmsg(libc::AF_UNSPEC as u8, NFNL_SUBSYS_NFTABLES),
    );
    (buf, acked)
}

/// A netlink socket of one protocol, in the calling thread's network namespace.
struct Socket(OwnedFd);

impl Socket {
    fn open(protocol: libc::c_int) -> io::Result<Socket> {
        // SAFETY: a plain socket(2) call; the descriptor is owned at once.
        let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, protocol) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a descriptor this call just opened and nothing else owns.
        let sock = Socket(unsafe { OwnedFd::from_raw_fd(fd) });
        let tv = libc::timeval {
            tv_sec: REPLY_TIMEOUT.as_secs() as libc::time_t,
            tv_usec: 0,
        };
        // SAFETY: setsockopt with a valid timeval of the size given.
        let rc = unsafe {
            libc::setsockopt(
                sock.0.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(sock)
    }

    fn send(&self, buf: &[u8]) -> io::Result<()> {
        // SAFETY: an all-zero sockaddr_nl is the kernel's address (pid 0, no groups).
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: buf and addr are valid for the lengths given.
        let n = unsafe {
            libc::sendto(
                self.0.as_raw_fd(),
                buf.as_ptr().cast(),
                buf.len(),
                0,
                (&addr as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n as usize != buf.len() {
            return Err(io::Error::other("netlink: a short send"));
        }
        Ok(())
    }

    /// The messages of one datagram: (type, seq, payload).
    fn recv(&self, buf: &mut [u8]) -> io::Result<Vec<(u16, u32, Vec<u8>)>> {
        // SAFETY: buf is valid for its length.
        let n = unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(parse_messages(&buf[..n as usize]))
    }

    /// Wait for the acknowledgement (or error) of each of `seqs`; the first error is returned.
    fn acks(&self, seqs: &[u32]) -> io::Result<()> {
        let mut pending: std::collections::BTreeSet<u32> = seqs.iter().copied().collect();
        let mut buf = vec![0u8; 32 * 1024];
        while !pending.is_empty() {
            for (kind, seq, payload) in self.recv(&mut buf)? {
                if kind == NLMSG_ERROR {
                    let code = payload
                        .get(..4)
                        .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                        .unwrap_or(-libc::EPROTO);
                    if code != 0 {
                        return Err(io::Error::from_raw_os_error(-code));
                    }
                    pending.remove(&seq);
                }
            }
        }
        Ok(())
    }
}

/// Split a datagram into messages (malformed lengths end the walk).
fn parse_messages(mut data: &[u8]) -> Vec<(u16, u32, Vec<u8>)> {
    let mut out = Vec::new();
    while data.len() >= 16 {
        let len = u32::from_ne_bytes([data[0], data[1], data[2], data[3]]) as usize;
        if len < 16 || len > data.len() {
            break;
        }
        let kind = u16::from_ne_bytes([data[4], data[5]]);
        let seq = u32::from_ne_bytes([data[8], data[9], data[10], data[11]]);
        out.push((kind, seq, data[16..len].to_vec()));
        if kind == NLMSG_DONE {
            break;
        }
        data = &data[align(len).min(data.len())..];
    }
    out
}

/// Apply `changes` to sets of the `inet` table `table` in one transaction: all or nothing.
pub fn apply_set_changes(table: &str, changes: &[Change]) -> io::Result<()> {
    if changes.is_empty() {
        return Ok(());
    }
    let sock = Socket::open(NETLINK_NETFILTER)?;
    let (buf, seqs) = batch(table, changes, 1);
    sock.send(&buf)?;
    sock.acks(&seqs)
}

/// Whether the `inet` table `table` has a set `name` (`false` for no table either).
pub fn set_exists(table: &str, name: &str) -> io::Result<bool> {
    let sock = Socket::open(NETLINK_NETFILTER)?;
    let mut body = nfgenmsg(NFPROTO_INET, 0);
    attr(&mut body, NFTA_SET_TABLE, &cstr(table));
    attr(&mut body, NFTA_SET_NAME, &cstr(name));
    let mut buf = Vec::new();
    message(
        &mut buf,
        (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETSET,
        NLM_F_REQUEST | NLM_F_ACK,
        1,
        &body,
    );
    sock.send(&buf)?;
    let mut reply = vec![0u8; 16 * 1024];
    let Some((kind, _, payload)) = sock.recv(&mut reply)?.into_iter().next() else {
        return Err(io::Error::other("netlink: no answer to GETSET"));
    };
    if kind != NLMSG_ERROR {
        // The set itself came back: it exists.
        return Ok(true);
    }
    let code = payload
        .get(..4)
        .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        .unwrap_or(-libc::EPROTO);
    match -code {
        0 => Ok(true),
        libc::ENOENT => Ok(false),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

/// Delete the network interface `name` (none by that name is success).
pub fn delete_link(name: &str) -> io::Result<()> {
    let sock = Socket::open(NETLINK_ROUTE)?;
    // struct ifinfomsg: family, pad, type, index, flags, change (16 bytes), all zero: by name.
    let mut body = vec![0u8; 16];
    attr(&mut body, IFLA_IFNAME, &cstr(name));
    let mut buf = Vec::new();
    message(&mut buf, RTM_DELLINK, NLM_F_REQUEST | NLM_F_ACK, 1, &body);
    sock.send(&buf)?;
    match sock.acks(&[1]) {
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(()),
        other => other,
    }
}

/// `struct ifinfomsg` (16 bytes): family, pad, type, index, flags, change.
fn ifinfomsg(index: i32, up: bool) -> Vec<u8> {
    let mut b = vec![libc::AF_UNSPEC as u8, 0, 0, 0];
    b.extend_from_slice(&index.to_ne_bytes());
    let flags = if up { libc::IFF_UP as u32 } else { 0 };
    b.extend_from_slice(&flags.to_ne_bytes());
    b.extend_from_slice(&flags.to_ne_bytes());
    b
}

/// Send one rtnetlink request and wait for its acknowledgement; `EEXIST` is success when
/// `exists_ok`.
fn route_request(sock: &Socket, kind: u16, flags: u16, body: &[u8], exists_ok: bool) -> io::Result<()> {
    let mut buf = Vec::new();
    message(&mut buf, kind, NLM_F_REQUEST | NLM_F_ACK | flags, 1, body);
    sock.send(&buf)?;
    match sock.acks(&[1]) {
        Err(e) if exists_ok && e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
        other => other,
    }
}

fn index_of(name: &str) -> io::Result<i32> {
    let c = std::ffi::CString::new(name).map_err(io::Error::other)?;
    // SAFETY: a NUL-terminated name; if_nametoindex only reads it.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(i as i32)
}

/// An IPv4 address on an interface (`RTM_NEWADDR`).
fn add_address(sock: &Socket, index: i32, addr: Ipv4Addr, prefix: u8) -> io::Result<()> {
    let mut body = vec![libc::AF_INET as u8, prefix, 0, 0];
    body.extend_from_slice(&(index as u32).to_ne_bytes());
    attr(&mut body, IFA_LOCAL, &addr.octets());
    attr(&mut body, IFA_ADDRESS, &addr.octets());
    let host_bits = u32::MAX.checked_shr(u32::from(prefix)).unwrap_or(0);
    attr(
        &mut body,
        IFA_BROADCAST,
        &Ipv4Addr::from(u32::from(addr) | host_bits).octets(),
    );
    route_request(sock, RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, &body, true)
}

/// The Linux bridge `name`, up, with `gateway/prefix` on it (made when missing; as the CNI
/// bridge plugin's `isGateway`).
pub fn ensure_bridge(name: &str, gateway: Ipv4Addr, prefix: u8) -> io::Result<()> {
    let sock = Socket::open(NETLINK_ROUTE)?;
    let mut body = ifinfomsg(0, true);
    attr(&mut body, IFLA_IFNAME, &cstr(name));
    nested(&mut body, IFLA_LINKINFO, |b| attr(b, IFLA_INFO_KIND, b"bridge"));
    // Without EXCL: an existing bridge is only set up again.
    route_request(&sock, RTM_NEWLINK, NLM_F_CREATE, &body, true)?;
    add_address(&sock, index_of(name)?, gateway, prefix)
}

/// Set a link up (`RTM_NEWLINK` on an existing index changes its flags).
fn set_up(sock: &Socket, index: i32) -> io::Result<()> {
    route_request(sock, RTM_NEWLINK, 0, &ifinfomsg(index, true), false)
}

/// A veth pair: `host` on the bridge `bridge`, up; its peer `peer` in the network namespace
/// open at `netns` (one `RTM_NEWLINK`, as `ip link add … netns …` sends it; the peer is set up
/// from inside, `configure_in`: a veth brought up in the message that makes it fails with
/// ENOTCONN, its peer not linked yet).
pub fn add_veth(host: &str, bridge: &str, peer: &str, netns: &std::fs::File) -> io::Result<()> {
    let sock = Socket::open(NETLINK_ROUTE)?;
    let mut body = ifinfomsg(0, false);
    attr(&mut body, IFLA_IFNAME, &cstr(host));
    attr(&mut body, IFLA_MASTER, &(index_of(bridge)? as u32).to_ne_bytes());
    nested(&mut body, IFLA_LINKINFO, |b| {
        attr(b, IFLA_INFO_KIND, b"veth");
        nested(b, IFLA_INFO_DATA, |b| {
            nested(b, VETH_INFO_PEER, |b| {
                b.extend_from_slice(&ifinfomsg(0, false));
                attr(b, IFLA_IFNAME, &cstr(peer));
                attr(b, IFLA_NET_NS_FD, &(netns.as_raw_fd() as u32).to_ne_bytes());
            })
        })
    });
    route_request(&sock, RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, &body, false)?;
    set_up(&sock, index_of(host)?)
}

/// Inside the network namespace open at `netns`: `addr/prefix` on `ifname` and the default
/// route via `gateway` (on a thread of its own that enters the namespace and ends).
pub fn configure_in(
    netns: std::fs::File,
    ifname: &str,
    addr: Ipv4Addr,
    prefix: u8,
    gateway: Ipv4Addr,
) -> io::Result<()> {
    let ifname = ifname.to_string();
    std::thread::spawn(move || -> io::Result<()> {
        // SAFETY: setns on this thread only (a network namespace is per thread), with a
        // descriptor of a namespace file this function owns.
        if unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let sock = Socket::open(NETLINK_ROUTE)?;
        let index = index_of(&ifname)?;
        set_up(&sock, index)?;
        add_address(&sock, index, addr, prefix)?;
        // struct rtmsg: family, dst_len, src_len, tos, table (main), protocol (boot), scope
        // (universe), type (unicast), flags.
        let mut body = vec![
            libc::AF_INET as u8,
            0,
            0,
            0,
            libc::RT_TABLE_MAIN,
            libc::RTPROT_BOOT,
            libc::RT_SCOPE_UNIVERSE,
            libc::RTN_UNICAST,
        ];
        body.extend_from_slice(&0u32.to_ne_bytes());
        attr(&mut body, RTA_GATEWAY, &gateway.octets());
        attr(&mut body, RTA_OIF, &(index as u32).to_ne_bytes());
        route_request(&sock, RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, &body, false)
    })
    .join()
    .map_err(|_| io::Error::other("the namespace thread panicked"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_the_sets_register_layout() {
        let (c, a) = (Ipv4Addr::new(10, 89, 0, 2), Ipv4Addr::new(203, 0, 113, 7));
        let key = |port| Key {
            container: c,
            addr: a,
            port,
        };
        assert_eq!(key(None).bytes(), vec![10, 89, 0, 2, 203, 0, 113, 7]);
        assert_eq!(key(Some(443)).bytes(), vec![10, 89, 0, 2, 203, 0, 113, 7, 1, 187, 0, 0]);
    }

    #[test]
    fn a_batch_is_begin_element_messages_end_with_acks_for_the_elements() {
        let a = Ipv4Addr::new(203, 0, 113, 7);
        let c = Ipv4Addr::new(10, 89, 0, 2);
        let changes = [
            Change::Add {
                set: "dabc".into(),
                key: Key {
                    container: c,
                    addr: a,
                    port: None,
                },
                timeout: Duration::from_secs(30),
            },
            Change::Delete {
                set: "pabc".into(),
                key: Key {
                    container: c,
                    addr: a,
                    port: Some(443),
                },
            },
        ];
        let (buf, acks) = batch("runner", &changes, 7);
        let msgs = parse_messages(&buf);
        let kinds: Vec<u16> = msgs.iter().map(|m| m.0).collect();
        let el = |op| (NFNL_SUBSYS_NFTABLES << 8) | op;
        assert_eq!(
            kinds,
            vec![
                NFNL_MSG_BATCH_BEGIN,
                el(NFT_MSG_NEWSETELEM),
                el(NFT_MSG_DELSETELEM),
                el(NFT_MSG_DELSETELEM),
                el(NFT_MSG_NEWSETELEM),
                NFNL_MSG_BATCH_END
            ]
        );
        assert_eq!(acks, vec![8, 9, 10, 11]);
        // Phases: dabc's add, both deletes (per set), dabc's timed add.
        // The begin message names the nftables subsystem in network order.
        assert_eq!(&msgs[0].2[..4], &[0, 0, 0, 10]);
        // The timed add carries the timeout in milliseconds, big-endian, and the key.
        let timed = &msgs[4].2;
        assert_eq!(timed[0], NFPROTO_INET);
        let find = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).any(|w| w == needle);
        assert!(find(timed, &30_000u64.to_be_bytes()));
        assert!(find(timed, &[203, 0, 113, 7]));
        assert!(find(timed, b"runner\0") && find(timed, b"dabc\0"));
        assert!(!find(&msgs[1].2, &30_000u64.to_be_bytes()));
        // Every message's length is what its header says, 4-byte aligned.
        let mut at = 0;
        while at < buf.len() {
            let len = u32::from_ne_bytes(buf[at..at + 4].try_into().unwrap()) as usize;
            assert_eq!(len % 4, 0);
            at += len;
        }
        assert_eq!(at, buf.len());
    }

    #[test]
    fn many_elements_share_messages_and_the_last_change_of_a_key_wins() {
        let key = |i| Key {
            container: Ipv4Addr::new(10, 89, 0, 2),
            addr: Ipv4Addr::new(198, 51, 100, i),
            port: None,
        };
        let adds: Vec<Change> = (0..200u8)
            .map(|i| Change::Add {
                set: "d".into(),
                key: key(i),
                timeout: Duration::from_secs(60),
            })
            .collect();
        let (_, acks) = batch("runner", &adds, 0);
        assert_eq!(acks.len(), 3 * 200usize.div_ceil(ELEMENTS_PER_MESSAGE));
        // Added then deleted: only the delete goes; the same delete twice: once.
        let del = Change::Delete {
            set: "d".into(),
            key: key(0),
        };
        let (buf, acks) = batch("runner", &[adds[0].clone(), del.clone(), del], 0);
        assert_eq!(acks.len(), 1);
        assert_eq!(
            parse_messages(&buf)[1].0,
            (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_DELSETELEM
        );
    }

    #[test]
    fn truncated_replies_end_the_walk() {
        let mut buf = Vec::new();
        message(&mut buf, NLMSG_ERROR, 0, 3, &[0, 0, 0, 0]);
        for n in 0..buf.len() {
            assert!(parse_messages(&buf[..n]).is_empty());
        }
        assert_eq!(parse_messages(&buf).len(), 1);
    }
}
