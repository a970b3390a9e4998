//! DNS messages through `hickory-proto`: queries from sandboxes and answers from upstreams are
//! both hostile, so every step here returns a value or an error, never panics, and what the
//! resolver answers is built anew (never the upstream's bytes passed on).

use std::net::{IpAddr, Ipv4Addr};

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA, CNAME};
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};

/// The longest CNAME chain followed from a question to its addresses.
pub const MAX_CHAIN: usize = 8;

/// A client's question.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Question {
    pub id: u16,
    /// Lowercase, without the trailing dot.
    pub name: String,
    pub qtype: RecordType,
    pub class_in: bool,
    pub recursion_desired: bool,
    /// The question as the client wrote it (copied into the answer).
    query: Query,
}

/// Why a message is not one the resolver answers; `id` when the header could be read (then a
/// FORMERR goes back).
#[derive(Debug, PartialEq, Eq)]
pub struct Unreadable {
    pub id: Option<u16>,
}

/// Read a client's message: a standard query with exactly one question.
pub fn question(msg: &[u8]) -> Result<Question, Unreadable> {
    let id = (msg.len() >= 2).then(|| u16::from_be_bytes([msg[0], msg[1]]));
    let m = Message::from_vec(msg).map_err(|_| Unreadable { id })?;
    if m.metadata.message_type != MessageType::Query || m.metadata.op_code != OpCode::Query || m.queries.len() != 1 {
        return Err(Unreadable { id });
    }
    let q = m.queries[0].clone();
    let name = q.name().to_ascii().trim_end_matches('.').to_ascii_lowercase();
    Ok(Question {
        id: m.metadata.id,
        name,
        qtype: q.query_type(),
        class_in: q.query_class() == DNSClass::IN,
        recursion_desired: m.metadata.recursion_desired,
        query: q,
    })
}

fn encode(m: &Message) -> Vec<u8> {
    // A message of our own making (one question, a bounded number of records) always
    // encodes; should it not, an empty reply is dropped by the caller.
    m.to_vec().unwrap_or_default()
}

fn reply(q: &Question, code: ResponseCode) -> Message {
    let mut m = Message::response(q.id, OpCode::Query);
    m.metadata.response_code = code;
    m.metadata.recursion_desired = q.recursion_desired;
    m.metadata.recursion_available = true;
    m.add_query(q.query.clone());
    m
}

/// An answer with no records and `code` (REFUSED, NXDOMAIN, SERVFAIL, or NOERROR for "no
/// data").
pub fn empty(q: &Question, code: ResponseCode) -> Vec<u8> {
    encode(&reply(q, code))
}

/// An empty answer with TC set: the client asks again over TCP.
pub fn truncated(q: &Question) -> Vec<u8> {
    let mut m = reply(q, ResponseCode::NoError);
    m.metadata.truncation = true;
    encode(&m)
}

/// FORMERR for a message whose question cannot be read (nothing when not even its id can).
pub fn formerr(u: &Unreadable) -> Option<Vec<u8>> {
    let id = u.id?;
    Some(encode(&Message::error_msg(id, OpCode::Query, ResponseCode::FormErr)))
}

/// What an answer resolved a name to, as the resolver keeps it (cache) and answers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    pub code: ResponseCode,
    /// The CNAME chain from the question's name: (owner, target, ttl).
    pub chain: Vec<(Name, Name, u32)>,
    /// The final name's addresses of the asked type, with their TTLs.
    pub addrs: Vec<(IpAddr, u32)>,
}

impl Resolved {
    /// The smallest TTL of the chain and the addresses (what the whole answer may be kept).
    pub fn ttl(&self) -> u32 {
        self.chain
            .iter()
            .map(|c| c.2)
            .chain(self.addrs.iter().map(|a| a.1))
            .min()
            .unwrap_or(0)
    }
}

/// The answer to `q` from what was resolved, with TTLs of at most `ttl_cap` (what is left of
/// a cached answer's time).
pub fn answer(q: &Question, r: &Resolved, ttl_cap: u32) -> Vec<u8> {
    let mut m = reply(q, r.code);
    for (owner, target, ttl) in &r.chain {
        m.add_answer(Record::from_rdata(
            owner.clone(),
            (*ttl).min(ttl_cap),
            RData::CNAME(CNAME(target.clone())),
        ));
    }
    let last = r.chain.last().map_or_else(|| q.query.name().clone(), |c| c.1.clone());
    for (addr, ttl) in &r.addrs {
        let data = match addr {
            IpAddr::V4(a) => RData::A(A(*a)),
            IpAddr::V6(a) => RData::AAAA(AAAA(*a)),
        };
        m.add_answer(Record::from_rdata(last.clone(), (*ttl).min(ttl_cap), data));
    }
    encode(&m)
}

/// An answer for a name the resolver knows itself (the network's names): an A record.
pub fn local(q: &Question, addr: Option<Ipv4Addr>, ttl: u32) -> Vec<u8> {
    let mut m = reply(q, ResponseCode::NoError);
    m.metadata.authoritative = true;
    if let Some(a) = addr {
        m.add_answer(Record::from_rdata(q.query.name().clone(), ttl, RData::A(A(a))));
    }
    encode(&m)
}

/// A query of our own for `name` and `qtype` (a fresh random id), for the upstreams.
pub fn upstream_query(name: &str, qtype: RecordType) -> Option<(u16, Vec<u8>)> {
    let n = Name::from_ascii(format!("{name}.")).ok()?;
    let mut m = Message::query();
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(n, qtype));
    Some((m.metadata.id, m.to_vec().ok()?))
}

/// Why an upstream's answer is not used.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadAnswer {
    #[error("unreadable")]
    Unreadable,
    #[error("not an answer to our question")]
    NotOurs,
    #[error("truncated")]
    Truncated,
}

/// Read an upstream's answer to our query (`id`, `name`, `qtype`): the CNAME chain from the
/// name (at most `MAX_CHAIN` links, each link's owner the previous target), and the
/// addresses of the asked type the chain ends in. Records for other names are ignored: an
/// upstream cannot make a name resolve to anything by adding records beside the chain.
pub fn resolved(msg: &[u8], id: u16, name: &str, qtype: RecordType) -> Result<Resolved, BadAnswer> {
    let m = Message::from_vec(msg).map_err(|_| BadAnswer::Unreadable)?;
    if m.metadata.id != id || m.metadata.message_type != MessageType::Response || m.queries.len() != 1 {
        return Err(BadAnswer::NotOurs);
    }
    let asked = m.queries[0]
        .name()
        .to_ascii()
        .trim_end_matches('.')
        .to_ascii_lowercase();
    if asked != name || m.queries[0].query_type() != qtype {
        return Err(BadAnswer::NotOurs);
    }
    if m.metadata.truncation {
        return Err(BadAnswer::Truncated);
    }
    let code = m.metadata.response_code;
    let mut current = m.queries[0].name().clone();
    let mut chain = Vec::new();
    loop {
        let next = m.answers.iter().find_map(|r| match &r.data {
            RData::CNAME(CNAME(target)) if r.name == current && r.dns_class == DNSClass::IN => {
                Some((target.clone(), r.ttl))
            }
            _ => None,
        });
        let Some((target, ttl)) = next else { break };
        if chain.len() == MAX_CHAIN || chain.iter().any(|(o, _, _): &(Name, Name, u32)| *o == target) {
            // Too long, or a loop: nothing it ends in is trusted.
            return Ok(Resolved {
                code: ResponseCode::ServFail,
                chain: Vec::new(),
                addrs: Vec::new(),
            });
        }
        chain.push((current.clone(), target.clone(), ttl));
        current = target;
    }
    let addrs = m
        .answers
        .iter()
        .filter(|r| r.name == current && r.dns_class == DNSClass::IN)
        .filter_map(|r| match (&r.data, qtype) {
            (RData::A(A(a)), RecordType::A) => Some((IpAddr::V4(*a), r.ttl)),
            (RData::AAAA(AAAA(a)), RecordType::AAAA) => Some((IpAddr::V6(*a), r.ttl)),
            _ => None,
        })
        .collect();
    Ok(Resolved { code, chain, addrs })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query_bytes(name: &str, qtype: RecordType) -> Vec<u8> {
        upstream_query(name, qtype).unwrap().1
    }

    fn upstream_answer(id: u16, name: &str, records: Vec<Record>) -> Vec<u8> {
        let mut m = Message::response(id, OpCode::Query);
        m.add_query(Query::query(
            Name::from_ascii(format!("{name}.")).unwrap(),
            RecordType::A,
        ));
        for r in records {
            m.add_answer(r);
        }
        m.to_vec().unwrap()
    }

    fn n(s: &str) -> Name {
        Name::from_ascii(s).unwrap()
    }

    #[test]
    fn a_query_is_read_and_answered_with_its_question() {
        let q = question(&query_bytes("PyPI.org", RecordType::A)).unwrap();
        assert_eq!(
            (q.name.as_str(), q.qtype, q.class_in),
            ("pypi.org", RecordType::A, true)
        );
        let r = Resolved {
            code: ResponseCode::NoError,
            chain: vec![(n("pypi.org."), n("cdn.example."), 300)],
            addrs: vec![("203.0.113.7".parse().unwrap(), 60)],
        };
        let bytes = answer(&q, &r, 30);
        let m = Message::from_vec(&bytes).unwrap();
        assert_eq!(m.metadata.id, q.id);
        assert_eq!(m.answers.len(), 2);
        // TTLs are what is left of the cached answer.
        assert!(m.answers.iter().all(|a| a.ttl == 30));
        assert_eq!(empty(&q, ResponseCode::Refused)[3] & 0xF, 5);
    }

    #[test]
    fn cname_chains_are_judged_by_where_they_end() {
        let (id, _) = upstream_query("a.example", RecordType::A).unwrap();
        let rec = |owner: &str, data: RData| Record::from_rdata(n(owner), 60, data);
        let bytes = upstream_answer(
            id,
            "a.example",
            vec![
                rec("a.example.", RData::CNAME(CNAME(n("b.example.")))),
                rec("b.example.", RData::CNAME(CNAME(n("c.example.")))),
                rec("c.example.", RData::A(A("198.51.100.9".parse().unwrap()))),
                // Beside the chain: ignored.
                rec("a.example.", RData::A(A("10.0.0.1".parse().unwrap()))),
                rec("other.example.", RData::A(A("169.254.169.254".parse().unwrap()))),
            ],
        );
        let r = resolved(&bytes, id, "a.example", RecordType::A).unwrap();
        assert_eq!(r.chain.len(), 2);
        assert_eq!(r.addrs, vec![("198.51.100.9".parse().unwrap(), 60)]);
        // A loop is nothing.
        let looped = upstream_answer(
            id,
            "a.example",
            vec![
                rec("a.example.", RData::CNAME(CNAME(n("b.example.")))),
                rec("b.example.", RData::CNAME(CNAME(n("a.example.")))),
            ],
        );
        let r = resolved(&looped, id, "a.example", RecordType::A).unwrap();
        assert_eq!((r.code, r.addrs.len()), (ResponseCode::ServFail, 0));
        // Another id, or another question, is not our answer.
        assert_eq!(
            resolved(&bytes, id.wrapping_add(1), "a.example", RecordType::A),
            Err(BadAnswer::NotOurs)
        );
        assert_eq!(
            resolved(&bytes, id, "b.example", RecordType::A),
            Err(BadAnswer::NotOurs)
        );
    }

    #[test]
    fn hostile_messages_are_refused_without_panicking() {
        let good = query_bytes("a.example", RecordType::A);
        let (id, _) = upstream_query("a.example", RecordType::A).unwrap();
        let ans = upstream_answer(
            id,
            "a.example",
            vec![Record::from_rdata(
                n("a.example."),
                1,
                RData::A(A(Ipv4Addr::new(9, 9, 9, 9))),
            )],
        );
        for msg in [&good, &ans] {
            for len in 0..msg.len() {
                let _ = question(&msg[..len]);
                let _ = resolved(&msg[..len], id, "a.example", RecordType::A);
            }
            for i in 0..msg.len() {
                for b in [0x00, 0x3F, 0xC0, 0xFF] {
                    let mut m = msg.to_vec();
                    m[i] = b;
                    let _ = question(&m);
                    let _ = resolved(&m, id, "a.example", RecordType::A);
                }
            }
        }
        // A pointer loop ends; a response is not a query; a header alone gets FORMERR.
        let mut looped = good[..12].to_vec();
        looped.extend_from_slice(&[0xC0, 12, 0, 1, 0, 1]);
        assert!(question(&looped).is_err());
        assert!(question(&ans).is_err());
        let f = formerr(&question(&[0xAB, 0xCD, 0, 0]).unwrap_err()).unwrap();
        assert_eq!(&f[..2], &[0xAB, 0xCD]);
        assert_eq!(f[3] & 0xF, 1);
        assert!(formerr(&question(&[1]).unwrap_err()).is_none());
    }
}
