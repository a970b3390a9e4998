//! Answers kept for their TTL, keyed by (name, type): a name asked again costs no upstream
//! query (and, once its addresses are in the asking container's sets, no kernel work).
//! Bounded: at most `capacity` entries; when full, expired ones go, then the oldest.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use hickory_proto::rr::RecordType;

use super::wire::Resolved;

/// The shortest time an answer is kept (a TTL of 0 would send every repeat upstream).
pub const MIN_CACHE: Duration = Duration::from_secs(5);

pub struct Cache {
    capacity: usize,
    entries: HashMap<(String, RecordType), (Resolved, Instant)>,
    order: VecDeque<(String, RecordType)>,
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
    pub fn get(&self, name: &str, qtype: RecordType, now: Instant) -> Option<(Resolved, u32)> {
        let (r, until) = self.entries.get(&(name.to_string(), qtype))?;
        let left = until.checked_duration_since(now)?;
        Some((r.clone(), left.as_secs().max(1) as u32))
    }

    pub fn put(&mut self, name: &str, qtype: RecordType, r: Resolved, now: Instant) {
        let keep = Duration::from_secs(u64::from(r.ttl())).max(MIN_CACHE);
        let key = (name.to_string(), qtype);
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

    #[test]
    fn answers_live_for_their_ttl_and_the_cache_stays_bounded() {
        let t0 = Instant::now();
        let mut c = Cache::new(3);
        c.put("a.test", RecordType::A, resolved(60), t0);
        assert_eq!(
            c.get("a.test", RecordType::A, t0 + Duration::from_secs(20)).unwrap().1,
            40
        );
        assert!(c.get("a.test", RecordType::A, t0 + Duration::from_secs(61)).is_none());
        assert!(c.get("a.test", RecordType::AAAA, t0).is_none());
        // A TTL of 0 is kept for MIN_CACHE.
        c.put("zero.test", RecordType::A, resolved(0), t0);
        assert!(c.get("zero.test", RecordType::A, t0 + Duration::from_secs(4)).is_some());
        for i in 0..10 {
            c.put(&format!("n{i}.test"), RecordType::A, resolved(60), t0);
        }
        assert_eq!(c.len(), 3);
        assert!(c.get("n9.test", RecordType::A, t0).is_some());
    }
}
