//! What a domain's answer can never open, whatever the name resolves to (DNS rebinding), as
//! Stripe's smokescreen closes it: private and special-purpose ranges, the host's own
//! addresses and its bridges' subnets. Only a CIDR entry in `egress.allow` opens these (the
//! wall's `allow_net`, which the resolver never touches).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;

/// IPv4 ranges closed to domain answers, with why.
const CLOSED_V4: &[(Ipv4Addr, u8, &str)] = &[
    (Ipv4Addr::new(0, 0, 0, 0), 8, "\"this\" network"),
    (Ipv4Addr::new(10, 0, 0, 0), 8, "private (RFC 1918)"),
    (
        Ipv4Addr::new(100, 64, 0, 0),
        10,
        "shared address space (CGNAT, some clouds' metadata)",
    ),
    (Ipv4Addr::new(127, 0, 0, 0), 8, "loopback"),
    (Ipv4Addr::new(168, 63, 129, 16), 32, "Azure's host endpoint"),
    (Ipv4Addr::new(169, 254, 0, 0), 16, "link-local (cloud metadata)"),
    (Ipv4Addr::new(172, 16, 0, 0), 12, "private (RFC 1918)"),
    (Ipv4Addr::new(192, 0, 0, 0), 24, "IETF protocol assignments"),
    (Ipv4Addr::new(192, 168, 0, 0), 16, "private (RFC 1918)"),
    (Ipv4Addr::new(198, 18, 0, 0), 15, "benchmarking"),
    (Ipv4Addr::new(224, 0, 0, 0), 4, "multicast"),
    (Ipv4Addr::new(240, 0, 0, 0), 4, "reserved"),
];

/// The host's addresses and its bridges' subnets, read at the resolver's start and again on
/// a timer; `None` (unreadable) closes every domain answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostNets {
    pub own: Vec<IpAddr>,
    pub bridges: Vec<(Ipv4Addr, u8)>,
}

impl HostNets {
    /// Read the host's interfaces (`sys_class_net` tells bridges apart).
    pub fn read(sys_class_net: &Path) -> std::io::Result<Self> {
        let mut nets = HostNets::default();
        for a in nix::ifaddrs::getifaddrs().map_err(std::io::Error::from)? {
            let Some(sa) = a.address.as_ref() else { continue };
            if let Some(v6) = sa.as_sockaddr_in6() {
                nets.own.push(IpAddr::V6(v6.ip()));
                continue;
            }
            let Some(addr) = sa.as_sockaddr_in().map(|s| s.ip()) else {
                continue;
            };
            nets.own.push(IpAddr::V4(addr));
            let bridge = sys_class_net.join(&a.interface_name).join("bridge").exists();
            if let (true, Some(mask)) = (bridge, a.netmask.as_ref().and_then(|s| s.as_sockaddr_in())) {
                nets.bridges.push((addr, u32::from(mask.ip()).count_ones() as u8));
            }
        }
        if nets.own.is_empty() {
            // Not even loopback: this is not a reading of the host.
            return Err(std::io::Error::other("no address read"));
        }
        Ok(nets)
    }
}

fn within(addr: Ipv4Addr, net: Ipv4Addr, prefix: u8) -> bool {
    let mask = u32::MAX.checked_shl(32 - u32::from(prefix.min(32))).unwrap_or(0);
    u32::from(addr) & mask == u32::from(net) & mask
}

/// The IPv4 address an IPv6 one stands for, where it embeds one: IPv4-mapped
/// (`::ffff:a.b.c.d`), IPv4-compatible (`::a.b.c.d`), NAT64 (`64:ff9b::a.b.c.d`), 6to4
/// (`2002:AABB:CCDD::`).
fn embedded_v4(a: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = a.segments();
    let o = a.octets();
    let tail = Ipv4Addr::new(o[12], o[13], o[14], o[15]);
    if s[..5] == [0, 0, 0, 0, 0] && (s[5] == 0xffff || s[5] == 0) {
        return Some(tail);
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return Some(tail);
    }
    if s[0] == 0x2002 {
        return Some(Ipv4Addr::new(o[2], o[3], o[4], o[5]));
    }
    None
}

/// Why an answer's address stays out of a container's sets (`None`: it may go in).
pub fn closed(addr: IpAddr, host: &HostNets) -> Option<&'static str> {
    if host.own.contains(&addr) {
        return Some("an address of the host");
    }
    match addr {
        IpAddr::V4(a) => {
            if let Some((_, _, why)) = CLOSED_V4.iter().find(|(net, p, _)| within(a, *net, *p)) {
                return Some(why);
            }
            if host.bridges.iter().any(|(net, p)| within(a, *net, *p)) {
                return Some("a container network of the host");
            }
            None
        }
        IpAddr::V6(a) => {
            if let Some(v4) = embedded_v4(a) {
                return closed(IpAddr::V4(v4), host).or(if a.segments()[..6] == [0; 6] {
                    Some("IPv4-compatible")
                } else {
                    None
                });
            }
            let s0 = a.segments()[0];
            match () {
                _ if a.is_unspecified() || a.is_loopback() => Some("loopback"),
                _ if s0 & 0xfe00 == 0xfc00 => Some("unique local (fc00::/7)"),
                _ if s0 & 0xffc0 == 0xfe80 => Some("link-local"),
                _ if s0 & 0xff00 == 0xff00 => Some("multicast"),
                _ if a.segments()[..3] == [0x64, 0xff9b, 1] => Some("local NAT64"),
                _ if a.segments()[..2] == [0x2001, 0] => Some("Teredo"),
                _ => None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host() -> HostNets {
        HostNets {
            own: vec!["203.0.113.10".parse().unwrap()],
            bridges: vec![(Ipv4Addr::new(203, 0, 113, 129), 25)],
        }
    }

    #[test]
    fn private_and_special_ranges_stay_closed_to_domain_answers() {
        for a in [
            "10.1.2.3",
            "10.89.3.4",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "100.64.0.1",
            "100.127.255.254",
            "192.0.0.8",
            "198.18.0.1",
            "198.19.255.255",
            "168.63.129.16",
            "169.254.169.254",
            "127.0.0.53",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "203.0.113.10",
            "203.0.113.200",
            // IPv6 forms of closed IPv4 addresses, and IPv6's own.
            "::ffff:10.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
            "2002:a9fe:a9fe::1",
            "::a00:1",
            "::1",
            "fd00:ec2::254",
            "fe80::1",
            "ff02::1",
            "64:ff9b:1::1",
            "2001:0::1",
        ] {
            assert!(closed(a.parse().unwrap(), &host()).is_some(), "{a}");
        }
        for a in [
            "203.0.113.7",
            "198.51.100.1",
            "172.32.0.1",
            "100.128.0.1",
            "8.8.8.8",
            "2001:db8::1",
            "::ffff:8.8.8.8",
        ] {
            assert!(closed(a.parse().unwrap(), &host()).is_none(), "{a}");
        }
    }

    #[test]
    fn the_host_is_read_with_loopback_at_least() {
        let nets = HostNets::read(Path::new("/sys/class/net")).unwrap();
        assert!(nets.own.contains(&IpAddr::V4(Ipv4Addr::LOCALHOST)), "{nets:?}");
    }
}
