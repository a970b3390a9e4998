//! The wall and its changes as typed nftables objects (the `nftables` crate's schema, sent to
//! `nft -j`): pure functions, pinned by tests without root.
//!
//! The wall is fixed; containers change only set elements. What a container may reach is
//! keyed by its own address in sets shared by all containers (`allow_net`, `allow_port`:
//! its CIDR entries, intervals; `dom`, `dom_port`: what its domain entries resolved to, each
//! for the answer's TTL), so an attach, a detach and a PATCH add and delete elements, never
//! rules, and no rule or set has to be found again by scraping text. The rules match per
//! packet, both ways: a destination taken out of a container's sets stops passing at its next
//! packet (established flows included), which is how a PATCH cuts them.

use std::borrow::Cow;
use std::collections::HashSet;
use std::net::Ipv4Addr;

use nftables::expr::{
    self, Elem, Expression as E, Meta, MetaKey, NamedExpression as N, Payload, PayloadField, Prefix, SetItem,
};
use nftables::schema::{
    self, Chain, Element, FlushObject, NfCmd, NfListObject as L, NfObject, Nftables, Rule, Set, SetFlag, SetType,
    SetTypeValue, Table,
};
use nftables::stmt::{self, Match, Operator, Statement as S};
use nftables::types::{NfChainPolicy, NfChainType, NfFamily, NfHook, RejectCode};

use crate::manifest::EgressRule;
use crate::net::{Net, PortStatus};

/// The table (`inet runner`).
pub const TABLE: &str = "runner";
/// A set whose name is the wall's version: present, the wall is this one (an older wall is
/// made again whole). Found by name (netlink GETSET), not by reading rules back.
pub const WALL_MARK: &str = "wall7";
/// A container's CIDR entries without a port: `container . net` (intervals).
pub const ALLOW_NET: &str = "allow_net";
/// With a port: `container . net . port` (TCP and UDP).
pub const ALLOW_PORT: &str = "allow_port";
/// What a container's domain entries resolved to: `container . address`, with a timeout.
pub const DOM: &str = "dom";
/// The same with the entry's port: `container . address . port`.
pub const DOM_PORT: &str = "dom_port";
/// DNS packets a second from one container the kernel lets reach the resolver.
const DNS_FLOOD: u32 = 2000;
/// The chain that refuses, so a blocked connect fails at once (not after its timeout).
const REFUSE: &str = "refuse";

fn s(text: &str) -> E<'static> {
    E::String(Cow::Owned(text.to_string()))
}

fn set_ref(name: &str) -> E<'static> {
    s(&format!("@{name}"))
}

fn meta(key: MetaKey) -> E<'static> {
    E::Named(N::Meta(Meta { key }))
}

fn field(protocol: &str, name: &str) -> E<'static> {
    E::Named(N::Payload(Payload::PayloadField(PayloadField {
        protocol: Cow::Owned(protocol.into()),
        field: Cow::Owned(name.into()),
    })))
}

fn concat(items: Vec<E<'static>>) -> E<'static> {
    E::Named(N::Concat(items))
}

fn ct(key: &str) -> E<'static> {
    E::Named(N::CT(expr::CT {
        key: Cow::Owned(key.into()),
        family: None,
        dir: None,
    }))
}

fn anon(items: &[&str]) -> E<'static> {
    E::Named(N::Set(items.iter().map(|i| SetItem::Element(s(i))).collect()))
}

fn m(left: E<'static>, op: Operator, right: E<'static>) -> S<'static> {
    S::Match(Match { left, right, op })
}

fn eq(left: E<'static>, right: E<'static>) -> S<'static> {
    m(left, Operator::EQ, right)
}

fn tcp_udp() -> S<'static> {
    eq(meta(MetaKey::L4proto), anon(&["tcp", "udp"]))
}

fn accept() -> S<'static> {
    S::Accept(None)
}

fn drop_() -> S<'static> {
    S::Drop(None)
}

fn prefix(addr: Ipv4Addr, len: u8) -> E<'static> {
    E::Named(N::Prefix(Prefix {
        addr: Box::new(s(&addr.to_string())),
        len: u32::from(len),
    }))
}

fn table() -> Table<'static> {
    Table {
        family: NfFamily::INet,
        name: TABLE.into(),
        handle: None,
    }
}

fn chain(name: &str, hook: Option<(NfChainType, NfHook, i32)>) -> Chain<'static> {
    Chain {
        family: NfFamily::INet,
        table: TABLE.into(),
        name: Cow::Owned(name.into()),
        newname: None,
        handle: None,
        _type: hook.map(|h| h.0),
        hook: hook.map(|h| h.1),
        prio: hook.map(|h| h.2),
        dev: None,
        policy: hook.map(|_| NfChainPolicy::Accept),
    }
}

fn rule(chain: &str, expr: Vec<S<'static>>) -> L<'static> {
    L::Rule(Rule {
        family: NfFamily::INet,
        table: TABLE.into(),
        chain: Cow::Owned(chain.into()),
        expr: expr.into(),
        handle: None,
        index: None,
        comment: None,
    })
}

fn set(name: &str, kind: Vec<SetType>, flags: &[SetFlag]) -> L<'static> {
    let set_type = if kind.len() == 1 {
        SetTypeValue::Single(kind[0])
    } else {
        SetTypeValue::Concatenated(kind.into())
    };
    L::Set(Box::new(Set {
        family: NfFamily::INet,
        table: TABLE.into(),
        name: Cow::Owned(name.into()),
        handle: None,
        set_type,
        policy: None,
        flags: (!flags.is_empty()).then(|| flags.iter().copied().collect::<HashSet<_>>()),
        elem: None,
        timeout: None,
        gc_interval: None,
        size: None,
        comment: None,
    }))
}

fn element(set: &str, elem: Vec<E<'static>>) -> L<'static> {
    L::Element(Element {
        family: NfFamily::INet,
        table: TABLE.into(),
        name: Cow::Owned(set.into()),
        elem: elem.into(),
    })
}

fn add(obj: L<'static>) -> NfObject<'static> {
    NfObject::CmdObject(NfCmd::Add(obj))
}

fn delete(obj: L<'static>) -> NfObject<'static> {
    NfObject::CmdObject(NfCmd::Delete(obj))
}

/// A batch of commands (one transaction).
pub fn batch(objects: Vec<NfObject<'static>>) -> Nftables<'static> {
    Nftables {
        objects: objects.into(),
    }
}

/// The whole wall, replacing any table of the name (older walls included), with the networks
/// registered on the host and the resolver's port.
///
/// forward: within one network anything; from a network, only what the sender's own elements
/// allow (refused otherwise: TCP reset, ICMP admin-prohibited); to a network, the published
/// ports (DNATed by portmap), and answers only from what the receiver may reach — checked per
/// packet, so taking an allowance away cuts its flows. input: a network reaches the host with
/// answers to the host's connections, DNS for the resolver, and what a container's CIDR
/// entries say; the resolver's port is for the networks alone (from anywhere else it is
/// dropped, not refused: a refusal would tell a scanner outside that it is there).
pub fn wall(resolver_port: Option<u16>, nets: &[Net]) -> Nftables<'static> {
    use SetType::{Ifname, InetService, Ipv4Addr as A};
    let mut out = vec![
        // Add first: the delete that follows then works on a host without the table.
        add(L::Table(table())),
        delete(L::Table(table())),
        add(L::Table(table())),
        add(set(WALL_MARK, vec![InetService], &[])),
        add(set("bridges", vec![Ifname], &[])),
        add(set("same", vec![Ifname, Ifname], &[])),
        add(set("gateways", vec![A], &[])),
        add(set("subnets", vec![A], &[SetFlag::Interval])),
        add(set("resolver", vec![InetService], &[])),
        add(set(ALLOW_NET, vec![A, A], &[SetFlag::Interval])),
        add(set(ALLOW_PORT, vec![A, A, InetService], &[SetFlag::Interval])),
        add(set(DOM, vec![A, A], &[SetFlag::Timeout])),
        add(set(DOM_PORT, vec![A, A, InetService], &[SetFlag::Timeout])),
        add(L::Chain(chain(REFUSE, None))),
        add(L::Chain(chain(
            "forward",
            Some((NfChainType::Filter, NfHook::Forward, -10)),
        ))),
        add(L::Chain(chain(
            "input",
            Some((NfChainType::Filter, NfHook::Input, -10)),
        ))),
        add(L::Chain(chain(
            "dns",
            Some((NfChainType::NAT, NfHook::Prerouting, -100)),
        ))),
        add(L::Chain(chain(
            "postrouting",
            Some((NfChainType::NAT, NfHook::Postrouting, 100)),
        ))),
    ];
    let iif = || meta(MetaKey::Iifname);
    let oif = || meta(MetaKey::Oifname);
    let saddr = || field("ip", "saddr");
    let daddr = || field("ip", "daddr");
    let from_bridge = || eq(iif(), set_ref("bridges"));
    let to_bridge = || eq(oif(), set_ref("bridges"));
    // The sender's allowances, keyed by its address (in forward and input alike).
    let allowed = |chain: &str| -> Vec<L<'static>> {
        vec![
            rule(
                chain,
                vec![
                    from_bridge(),
                    eq(concat(vec![saddr(), daddr()]), set_ref(ALLOW_NET)),
                    accept(),
                ],
            ),
            rule(
                chain,
                vec![
                    from_bridge(),
                    tcp_udp(),
                    eq(
                        concat(vec![saddr(), daddr(), field("th", "dport")]),
                        set_ref(ALLOW_PORT),
                    ),
                    accept(),
                ],
            ),
            rule(
                chain,
                vec![
                    from_bridge(),
                    eq(concat(vec![saddr(), daddr()]), set_ref(DOM)),
                    accept(),
                ],
            ),
            rule(
                chain,
                vec![
                    from_bridge(),
                    tcp_udp(),
                    eq(concat(vec![saddr(), daddr(), field("th", "dport")]), set_ref(DOM_PORT)),
                    accept(),
                ],
            ),
        ]
    };
    let mut rules = vec![
        rule(
            REFUSE,
            vec![
                eq(meta(MetaKey::L4proto), s("tcp")),
                S::Reject(Some(stmt::Reject::new(Some(stmt::RejectType::TCPReset), None))),
            ],
        ),
        rule(
            REFUSE,
            vec![S::Reject(Some(stmt::Reject::new(
                Some(stmt::RejectType::ICMPX),
                Some(RejectCode::AdminProhibited),
            )))],
        ),
        rule(
            "forward",
            vec![eq(concat(vec![iif(), oif()]), set_ref("same")), accept()],
        ),
        // Both ways of a published port's connections (portmap's DNAT marks them). A flag:
        // `in` tests the bit (`==` would compare the whole status word).
        rule("forward", vec![m(ct("status"), Operator::IN, s("dnat")), accept()]),
    ];
    rules.extend(allowed("forward"));
    rules.push(rule(
        "forward",
        vec![from_bridge(), S::Jump(stmt::JumpTarget { target: REFUSE.into() })],
    ));
    let established = || m(ct("state"), Operator::IN, E::List(vec![s("established"), s("related")]));
    // Answers to a container: from what it may reach, per packet (receiver . sender).
    rules.extend([
        rule(
            "forward",
            vec![
                to_bridge(),
                established(),
                eq(concat(vec![daddr(), saddr()]), set_ref(ALLOW_NET)),
                accept(),
            ],
        ),
        rule(
            "forward",
            vec![
                to_bridge(),
                established(),
                tcp_udp(),
                eq(
                    concat(vec![daddr(), saddr(), field("th", "sport")]),
                    set_ref(ALLOW_PORT),
                ),
                accept(),
            ],
        ),
        rule(
            "forward",
            vec![
                to_bridge(),
                established(),
                eq(concat(vec![daddr(), saddr()]), set_ref(DOM)),
                accept(),
            ],
        ),
        rule(
            "forward",
            vec![
                to_bridge(),
                established(),
                tcp_udp(),
                eq(concat(vec![daddr(), saddr(), field("th", "sport")]), set_ref(DOM_PORT)),
                accept(),
            ],
        ),
        // ICMP errors about a container's flows (path MTU among them).
        rule(
            "forward",
            vec![
                to_bridge(),
                eq(ct("state"), s("related")),
                eq(meta(MetaKey::L4proto), s("icmp")),
                accept(),
            ],
        ),
        // From outside to a network: dropped (a refusal would answer a scan).
        rule("forward", vec![to_bridge(), drop_()]),
        rule(
            "input",
            vec![
                tcp_udp(),
                eq(field("th", "dport"), set_ref("resolver")),
                m(iif(), Operator::NEQ, set_ref("bridges")),
                m(iif(), Operator::NEQ, s("lo")),
                drop_(),
            ],
        ),
        // Answers to the host's own connections into a network.
        rule(
            "input",
            vec![
                from_bridge(),
                eq(ct("state"), s("established")),
                eq(
                    E::Named(N::CT(expr::CT {
                        key: "direction".into(),
                        family: None,
                        dir: None,
                    })),
                    s("reply"),
                ),
                accept(),
            ],
        ),
        rule("input", vec![from_bridge(), eq(ct("state"), s("related")), accept()]),
        // A container's DNS beyond `DNS_FLOOD` packets a second is dropped in the kernel:
        // the resolver's own per-source limits answer REFUSED below it, and above it a flood
        // would only push other containers' queries out of the socket's buffer.
        rule(
            "input",
            vec![
                from_bridge(),
                tcp_udp(),
                eq(field("th", "dport"), set_ref("resolver")),
                S::Meter(stmt::Meter {
                    name: "dns_flood".into(),
                    key: saddr(),
                    stmt: Box::new(S::Limit(stmt::Limit {
                        rate: DNS_FLOOD,
                        rate_unit: None,
                        per: Some("second".into()),
                        burst: Some(DNS_FLOOD),
                        burst_unit: None,
                        inv: Some(true),
                    })),
                }),
                drop_(),
            ],
        ),
        rule(
            "input",
            vec![
                from_bridge(),
                eq(daddr(), set_ref("gateways")),
                tcp_udp(),
                eq(field("th", "dport"), set_ref("resolver")),
                accept(),
            ],
        ),
    ]);
    rules.extend(allowed("input"));
    rules.push(rule(
        "input",
        vec![from_bridge(), S::Jump(stmt::JumpTarget { target: REFUSE.into() })],
    ));
    rules.push(rule(
        "postrouting",
        vec![
            eq(saddr(), set_ref("subnets")),
            m(oif(), Operator::NEQ, set_ref("bridges")),
            S::Masquerade(None),
        ],
    ));
    out.extend(rules.into_iter().map(add));
    for net in nets {
        out.extend(net_elements(net, true));
    }
    if let Some(port) = resolver_port {
        out.extend(resolver(port));
    }
    batch(out)
}

/// A network's elements of the wall's sets (`add` or delete).
pub fn net_elements(net: &Net, add_them: bool) -> Vec<NfObject<'static>> {
    let b = &net.bridge;
    let (addr, len) = net.cidr();
    let objs = vec![
        element("bridges", vec![s(b)]),
        element("same", vec![concat(vec![s(b), s(b)])]),
        element("gateways", vec![s(&net.gateway.to_string())]),
        element("subnets", vec![prefix(addr, len)]),
    ];
    objs.into_iter().map(if add_them { add } else { delete }).collect()
}

/// Point the bridges' DNS (port 53 on a gateway) at the resolver's port.
pub fn resolver(port: u16) -> Vec<NfObject<'static>> {
    let redirect = |proto: &str| {
        rule(
            "dns",
            vec![
                eq(meta(MetaKey::Iifname), set_ref("bridges")),
                eq(field("ip", "daddr"), set_ref("gateways")),
                eq(field(proto, "dport"), E::Number(53)),
                S::Redirect(Some(stmt::NAT {
                    addr: None,
                    family: None,
                    port: Some(E::Number(u32::from(port))),
                    flags: None,
                })),
            ],
        )
    };
    let resolver_set = match set("resolver", vec![SetType::InetService], &[]) {
        L::Set(s) => s,
        _ => unreachable!("set() makes sets"),
    };
    vec![
        NfObject::CmdObject(NfCmd::Flush(FlushObject::Chain(chain("dns", None)))),
        add(redirect("udp")),
        add(redirect("tcp")),
        NfObject::CmdObject(NfCmd::Flush(FlushObject::Set(resolver_set))),
        add(element("resolver", vec![E::Number(u32::from(port))])),
    ]
}

/// CIDR entries as the sets hold them: one element per distinct range, none inside another of
/// the same kind (the kernel refuses overlapping intervals in one set).
pub fn normalize(rules: &[EgressRule]) -> Vec<EgressRule> {
    let mut out: Vec<EgressRule> = Vec::new();
    let network = |r: &EgressRule| {
        let mask = u32::MAX.checked_shl(32 - u32::from(r.prefix)).unwrap_or(0);
        u32::from(r.addr) & mask
    };
    let covers = |outer: &EgressRule, inner: &EgressRule| {
        outer.prefix <= inner.prefix && (outer.port.is_none() || outer.port == inner.port) && {
            let mask = u32::MAX.checked_shl(32 - u32::from(outer.prefix)).unwrap_or(0);
            u32::from(inner.addr) & mask == network(outer)
        }
    };
    for r in rules {
        let r = EgressRule {
            addr: Ipv4Addr::from(network(r)),
            prefix: r.prefix,
            port: r.port,
        };
        // A rule without a port covers the same range's port rules; each set is checked on
        // its own, so only same-kind overlaps matter, but a covered rule is redundant anyway.
        if out.iter().any(|o| covers(o, &r)) {
            continue;
        }
        out.retain(|o| !covers(&r, o));
        out.push(r);
    }
    out
}

/// The elements of container `ip`'s CIDR entries (normalized first).
fn cidr_elements(ip: Ipv4Addr, rules: &[EgressRule]) -> Vec<(&'static str, E<'static>)> {
    normalize(rules)
        .iter()
        .map(|r| {
            let who = s(&ip.to_string());
            match r.port {
                None => (ALLOW_NET, concat(vec![who, prefix(r.addr, r.prefix)])),
                Some(p) => (
                    ALLOW_PORT,
                    concat(vec![who, prefix(r.addr, r.prefix), E::Number(u32::from(p))]),
                ),
            }
        })
        .collect()
}

/// Add (`true`) or delete container `ip`'s CIDR elements.
pub fn cidrs(ip: Ipv4Addr, rules: &[EgressRule], add_them: bool) -> Vec<NfObject<'static>> {
    cidr_elements(ip, rules)
        .into_iter()
        .map(|(set, e)| {
            let obj = element(set, vec![e]);
            if add_them { add(obj) } else { delete(obj) }
        })
        .collect()
}

/// A domain element as nft writes it (`container . address [. port]`, with its timeout in
/// seconds when added).
pub fn domain_element(
    ip: Ipv4Addr,
    addr: Ipv4Addr,
    port: Option<u16>,
    timeout: Option<u32>,
) -> (&'static str, E<'static>) {
    let mut items = vec![s(&ip.to_string()), s(&addr.to_string())];
    if let Some(p) = port {
        items.push(E::Number(u32::from(p)));
    }
    let val = concat(items);
    let e = match timeout {
        Some(t) => E::Named(N::Elem(Elem {
            val: Box::new(val),
            timeout: Some(t),
            expires: None,
            comment: None,
            counter: None,
        })),
        None => val,
    };
    (if port.is_some() { DOM_PORT } else { DOM }, e)
}

/// Delete these elements (as read back from a set) in one batch.
pub fn delete_elements(set: &str, elems: Vec<E<'static>>) -> Vec<NfObject<'static>> {
    if elems.is_empty() {
        return Vec::new();
    }
    vec![delete(element(set, elems))]
}

/// The container (first field) of an element read back from one of the containers' sets:
/// `{"concat": ["10.89.0.5", …]}`, possibly wrapped in `{"elem": {"val": …}}`.
pub fn element_owner(e: &E<'_>) -> Option<Ipv4Addr> {
    let val = match e {
        E::Named(N::Elem(el)) => el.val.as_ref(),
        other => other,
    };
    match val {
        E::Named(N::Concat(items)) => match items.first()? {
            E::String(t) => t.parse().ok(),
            _ => None,
        },
        _ => None,
    }
}

/// The element itself without its timeout or expiry (what a delete names).
pub fn element_key(e: &E<'static>) -> E<'static> {
    match e {
        E::Named(N::Elem(el)) => (*el.val).clone(),
        other => other.clone(),
    }
}

/// Inside a container's namespace (an `ip` table of its own): a connection arriving on `eth0`
/// for a published port that no socket bound to eth0's address (or to every address) would
/// take is DNATed to 127.0.0.1 (reference 000's runtime rewrites loopback binds for this;
/// runner does not touch the program's arguments). `route_localnet` on eth0 goes with it.
pub fn loopback_redirect(ifname: &str, ports: &[PortStatus]) -> Nftables<'static> {
    let t = || schema::Table {
        family: NfFamily::IP,
        name: TABLE.into(),
        handle: None,
    };
    let c = Chain {
        family: NfFamily::IP,
        table: TABLE.into(),
        name: "prerouting".into(),
        newname: None,
        handle: None,
        _type: Some(NfChainType::NAT),
        hook: Some(NfHook::Prerouting),
        prio: Some(-100),
        dev: None,
        policy: Some(NfChainPolicy::Accept),
    };
    let mut out = vec![add(L::Table(t())), add(L::Chain(c))];
    for p in ports {
        let proto = p.protocol.lower();
        let base = || {
            vec![
                eq(meta(MetaKey::Iifname), s(ifname)),
                eq(field(proto, "dport"), E::Number(u32::from(p.container_port))),
            ]
        };
        let r = |expr: Vec<S<'static>>| {
            L::Rule(Rule {
                family: NfFamily::IP,
                table: TABLE.into(),
                chain: "prerouting".into(),
                expr: expr.into(),
                handle: None,
                index: None,
                comment: None,
            })
        };
        let mut kept = base();
        kept.push(eq(
            E::Named(N::Socket(expr::Socket {
                key: Cow::Owned(expr::SocketAttr::Transparent),
            })),
            E::Number(0),
        ));
        kept.push(accept());
        let mut moved = base();
        moved.push(S::DNAT(Some(stmt::NAT {
            addr: Some(s("127.0.0.1")),
            family: None,
            port: None,
            flags: None,
        })));
        out.push(add(r(kept)));
        out.push(add(r(moved)));
    }
    batch(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule_of(text: &str) -> EgressRule {
        crate::manifest::EgressRule::parse(text).unwrap()
    }

    #[test]
    fn overlapping_cidrs_become_one_element_each() {
        let rules: Vec<EgressRule> = [
            "10.1.0.0/16",
            "10.0.0.0/8",
            "10.2.3.4:443",
            "203.0.113.9",
            "203.0.113.9",
            "10.0.0.0/8:443",
            "192.0.2.0/24:80",
            "192.0.2.0/24:443",
        ]
        .iter()
        .map(|t| rule_of(t))
        .collect();
        let got: Vec<String> = normalize(&rules).iter().map(|r| r.to_string()).collect();
        assert_eq!(
            got,
            vec!["10.0.0.0/8", "203.0.113.9/32", "192.0.2.0/24:80", "192.0.2.0/24:443"]
        );
    }

    #[test]
    fn the_wall_refuses_from_containers_and_drops_from_outside() {
        let json = serde_json::to_string(&wall(Some(40053), &[Net::default_net()])).unwrap();
        // From a container: a reset or admin-prohibited (fail fast).
        assert!(json.contains(r#"{"reject":{"type":"tcp reset"}}"#), "{json}");
        assert!(json.contains(r#""type":"icmpx","expr":"admin-prohibited""#), "{json}");
        // The networks and the resolver's port are elements, and the mark names the version.
        assert!(json.contains(r#""elem":["runner0"]"#), "{json}");
        assert!(json.contains(WALL_MARK));
        assert!(json.contains(r#"{"redirect":{"port":40053}}"#), "{json}");
        // The old table goes in the same transaction (add, delete, add).
        let objs = wall(None, &[]).objects;
        assert!(matches!(&objs[1], NfObject::CmdObject(NfCmd::Delete(L::Table(_)))));
    }

    #[test]
    fn a_containers_elements_are_keyed_by_its_address() {
        let ip: Ipv4Addr = "10.89.0.7".parse().unwrap();
        let objs = cidrs(ip, &[rule_of("10.0.0.0/8"), rule_of("203.0.113.7:443")], true);
        let json = serde_json::to_string(&batch(objs)).unwrap();
        assert_eq!(
            json,
            r#"{"nftables":[{"add":{"element":{"family":"inet","table":"runner","name":"allow_net","elem":[{"concat":["10.89.0.7",{"prefix":{"addr":"10.0.0.0","len":8}}]}]}}},{"add":{"element":{"family":"inet","table":"runner","name":"allow_port","elem":[{"concat":["10.89.0.7",{"prefix":{"addr":"203.0.113.7","len":32}},443]}]}}}]}"#
        );
        let (set, e) = domain_element(ip, "198.51.100.1".parse().unwrap(), Some(443), Some(60));
        assert_eq!(set, DOM_PORT);
        assert_eq!(element_owner(&e), Some(ip));
        assert_eq!(
            serde_json::to_string(&element_key(&e)).unwrap(),
            r#"{"concat":["10.89.0.7","198.51.100.1",443]}"#
        );
    }
}
