//! The resolver's bounds: per source container a query rate (token bucket: over it the query
//! is REFUSED without work, and past twice that not even answered), a cap on its upstream
//! queries in flight and on its open TCP connections; globally a cap on queries being
//! answered. All checked before any work is done for a query.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::ResolverLimits;

/// A token bucket: `rate` tokens a second, at most `burst` kept.
#[derive(Clone, Debug)]
pub struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    pub fn new(rate: u32, burst: u32, now: Instant) -> Self {
        Bucket {
            rate: f64::from(rate),
            burst: f64::from(burst.max(1)),
            tokens: f64::from(burst.max(1)),
            at: now,
        }
    }

    /// Take a token if there is one.
    pub fn take(&mut self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// What one source may still do.
struct Source {
    queries: Bucket,
    /// Refusals sent (over the query rate): past these, nothing is sent.
    refusals: Bucket,
    upstream: Arc<Semaphore>,
    tcp: usize,
    seen: Instant,
}

/// The verdict on one query, before any work.
#[derive(Debug, PartialEq, Eq)]
pub enum Admit {
    /// Answer it.
    Yes,
    /// Over the rate: REFUSED.
    Refuse,
    /// Far over it: no answer at all (a flood must not make the resolver flood back).
    Drop,
}

/// Per-source state, for every source that sent anything recently (sources are container
/// addresses on the host's bridges: few, and forgotten after a minute of silence).
pub struct Limits {
    pub config: ResolverLimits,
    sources: Mutex<HashMap<IpAddr, Source>>,
    /// Queries being answered, all sources together.
    pub tasks: Arc<Semaphore>,
    /// TCP connections open, all sources together.
    pub tcp: Arc<Semaphore>,
}

/// Sources kept at most (an attacker on a bridge has one address; this only bounds memory).
const MAX_SOURCES: usize = 65_536;

impl Limits {
    pub fn new(config: ResolverLimits) -> Self {
        Limits {
            tasks: Arc::new(Semaphore::new(config.max_tasks)),
            tcp: Arc::new(Semaphore::new(config.max_tcp)),
            config,
            sources: Mutex::new(HashMap::new()),
        }
    }

    fn with<T>(&self, src: IpAddr, f: impl FnOnce(&mut Source) -> T) -> T {
        let now = Instant::now();
        let mut sources = self.sources.lock().expect("limits");
        if sources.len() >= MAX_SOURCES && !sources.contains_key(&src) {
            sources.retain(|_, s| now.duration_since(s.seen).as_secs() < 60 || s.tcp > 0);
        }
        let c = &self.config;
        let s = sources.entry(src).or_insert_with(|| Source {
            queries: Bucket::new(c.queries_per_second, c.query_burst, now),
            refusals: Bucket::new(c.queries_per_second.saturating_mul(2), c.query_burst, now),
            upstream: Arc::new(Semaphore::new(c.upstream_per_source)),
            tcp: 0,
            seen: now,
        });
        s.seen = now;
        f(s)
    }

    /// Whether a query from `src` is answered.
    pub fn admit(&self, src: IpAddr) -> Admit {
        let now = Instant::now();
        self.with(src, |s| {
            if s.queries.take(now) {
                Admit::Yes
            } else if s.refusals.take(now) {
                Admit::Refuse
            } else {
                Admit::Drop
            }
        })
    }

    /// A place for one upstream query of `src` (none: its cap is reached).
    pub fn upstream(&self, src: IpAddr) -> Option<OwnedSemaphorePermit> {
        self.with(src, |s| s.upstream.clone().try_acquire_owned().ok())
    }

    /// A TCP connection of `src` opens: whether it may (per source and in all).
    pub fn open_tcp(self: &Arc<Self>, src: IpAddr) -> Option<TcpSlot> {
        let global = self.tcp.clone().try_acquire_owned().ok()?;
        let per = self.config.tcp_per_source;
        let ok = self.with(src, |s| {
            if s.tcp < per {
                s.tcp += 1;
                true
            } else {
                false
            }
        });
        ok.then(|| TcpSlot {
            limits: self.clone(),
            src,
            _global: global,
        })
    }

    /// Forget old sources (called on a timer).
    pub fn sweep(&self) {
        let now = Instant::now();
        self.sources
            .lock()
            .expect("limits")
            .retain(|_, s| now.duration_since(s.seen).as_secs() < 60 || s.tcp > 0);
    }
}

/// An open TCP connection's place, given back when dropped.
pub struct TcpSlot {
    limits: Arc<Limits>,
    src: IpAddr,
    _global: OwnedSemaphorePermit,
}

impl Drop for TcpSlot {
    fn drop(&mut self) {
        self.limits.with(self.src, |s| s.tcp = s.tcp.saturating_sub(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_bucket_gives_its_burst_then_its_rate() {
        let t0 = Instant::now();
        let mut b = Bucket::new(10, 5, t0);
        assert_eq!((0..10).filter(|_| b.take(t0)).count(), 5);
        // A second later: ten more, not fifteen (the burst caps what is kept).
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!((0..20).filter(|_| b.take(t1)).count(), 5);
        let t2 = t1 + Duration::from_millis(300);
        assert_eq!((0..20).filter(|_| b.take(t2)).count(), 3);
    }

    #[test]
    fn a_flooding_source_is_refused_then_dropped_and_others_are_untouched() {
        let limits = Limits::new(ResolverLimits {
            queries_per_second: 10,
            query_burst: 10,
            ..ResolverLimits::default()
        });
        let (flood, other): (IpAddr, IpAddr) = ("10.89.0.2".parse().unwrap(), "10.89.0.3".parse().unwrap());
        let verdicts: Vec<Admit> = (0..100).map(|_| limits.admit(flood)).collect();
        assert_eq!(verdicts.iter().filter(|v| **v == Admit::Yes).count(), 10);
        assert!(verdicts.iter().filter(|v| **v == Admit::Refuse).count() >= 10);
        assert!(verdicts.iter().filter(|v| **v == Admit::Drop).count() >= 50);
        assert_eq!(limits.admit(other), Admit::Yes);
    }

    #[test]
    fn upstream_and_tcp_places_are_capped_per_source_and_given_back() {
        let limits = Arc::new(Limits::new(ResolverLimits {
            upstream_per_source: 2,
            tcp_per_source: 2,
            max_tcp: 3,
            ..ResolverLimits::default()
        }));
        let a: IpAddr = "10.89.0.2".parse().unwrap();
        let b: IpAddr = "10.89.0.3".parse().unwrap();
        let p1 = limits.upstream(a).unwrap();
        let _p2 = limits.upstream(a).unwrap();
        assert!(limits.upstream(a).is_none());
        assert!(limits.upstream(b).is_some());
        drop(p1);
        assert!(limits.upstream(a).is_some());
        let t1 = limits.open_tcp(a).unwrap();
        let _t2 = limits.open_tcp(a).unwrap();
        assert!(limits.open_tcp(a).is_none(), "per source");
        let _t3 = limits.open_tcp(b).unwrap();
        assert!(limits.open_tcp(b).is_none(), "in all");
        drop(t1);
        assert!(limits.open_tcp(a).is_some());
    }
}
