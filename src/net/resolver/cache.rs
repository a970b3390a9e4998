//! Answers kept for their TTL, keyed by (upstream servers, name, type): a name asked again
//! costs no upstream query (and, once its addresses are in the asking container's sets, no
//! kernel work). The servers are part of the key because one resolver serves the containers
//! of every runner on the host, and runners may be configured with different upstreams: one
//! upstream's answer must never be handed to a container whose policy names another.
//! Bounded: at most `capacity` entries; when full, expired ones go, then the oldest.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use hickory_proto::rr::RecordType;

use super::wire::Resolved;

/// The shortest time an answer is kept (a TTL of 0 would send every repeat upstream).
pub const MIN_CACHE: Duration = Duration::from_secs(5);

type Key = (Vec<SocketAddr>, String, RecordType);

pub struct Cache {
    capacity: usize,
    entries: HashMap<Key, (Resolved, Instant)>,
    order: VecDeque<Key>,
}

impl Cache {
    pub fn new(capacity: usize) -> Self {
        Cache {
            capacity: capacity.max(1),
            entries: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// A live answer and the seconds it has left.
    pub fn get(&self, servers: &[SocketAddr], name: &str, qtype: RecordType, now: Instant) -> Option<(Resolved, u32)> {
        let (r, until) = self.entries.get(&(servers.to_vec(), name.to_string(), qtype))?;
        let left = until.checked_duration_since(now)?;
        Some((r.clone(), left.as_secs().max(1) as u32))
    }

    pub fn put(&mut self, servers: &[SocketAddr], name: &str, qtype: RecordType, r: Resolved, now: Instant) {
        let keep = Duration::from_secs(u64::from(r.ttl())).max(MIN_CACHE);
        let key = (servers.to_vec(), name.to_string(), qtype);
        if self.entries.len() >= self.capacity && !self.entries.contains_key(&key) {
            self.entries.retain(|_, (_, until)| *until > now);
            self.order.retain(|k| self.entries.contains_key(k));
            while self.entries.len() >= self.capacity {
                let Some(old) = self.order.pop_front() else { break };
                self.entries.remove(&old);
            }
        }
        if self.entries.insert(key.clone(), (r, now + keep)).is_none() {
            self.order.push_back(key);
        }
    }

    /// Drop everything (memory pressure).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::ResponseCode;

    fn resolved(ttl: u32) -> Resolved {
        Resolved {
            code: ResponseCode::NoError,
            chain: Vec::new(),
            addrs: vec![("198.51.100.1".parse().unwrap(), ttl)],
        }
    }

    const UP: [SocketAddr; 1] = [SocketAddr::V4(std::net::SocketAddrV4::new(
        std::net::Ipv4Addr::new(192, 0, 2, 1),
        53,
    ))];

    #[test]
    fn answers_live_for_their_ttl_and_the_cache_stays_bounded() {
        let t0 = Instant::now();
        let mut c = Cache::new(3);
        c.put(&UP, "a.test", RecordType::A, resolved(60), t0);
        assert_eq!(
            c.get(&UP, "a.test", RecordType::A, t0 + Duration::from_secs(20))
                .unwrap()
                .1,
            40
        );
        assert!(
            c.get(&UP, "a.test", RecordType::A, t0 + Duration::from_secs(61))
                .is_none()
        );
        assert!(c.get(&UP, "a.test", RecordType::AAAA, t0).is_none());
        // A TTL of 0 is kept for MIN_CACHE.
        c.put(&UP, "zero.test", RecordType::A, resolved(0), t0);
        assert!(
            c.get(&UP, "zero.test", RecordType::A, t0 + Duration::from_secs(4))
                .is_some()
        );
        for i in 0..10 {
            c.put(&UP, &format!("n{i}.test"), RecordType::A, resolved(60), t0);
        }
        assert_eq!(c.len(), 3);
        assert!(c.get(&UP, "n9.test", RecordType::A, t0).is_some());
    }

    #[test]
    fn one_upstreams_answer_is_never_given_for_another() {
        let t0 = Instant::now();
        let other: [SocketAddr; 1] = ["192.0.2.2:53".parse().unwrap()];
        let mut c = Cache::new(8);
        c.put(&UP, "a.test", RecordType::A, resolved(60), t0);
        assert!(c.get(&other, "a.test", RecordType::A, t0).is_none());
        assert!(c.get(&[], "a.test", RecordType::A, t0).is_none());
        assert!(c.get(&UP, "a.test", RecordType::A, t0).is_some());
    }
}
