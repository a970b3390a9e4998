//! The containers' domain elements in the wall (`dom`, `dom_port`), kept by one task: answers
//! ask it to allow addresses, attach, detach and PATCH tell it what changed. Whatever is
//! waiting when it wakes goes to the kernel as one netlink batch (no process, ever); an
//! address already allowed for long enough costs nothing; each container has a cap.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::manifest::EgressDomain;
use crate::net::firewall::plan;
use crate::net::netlink::{self, Change, Key};

/// Requests taken into one batch at most.
const BATCH: usize = 256;
/// An element with less than this left is not deleted (the kernel expires it by itself, and
/// a delete of an element it has just expired would fail the whole batch).
const DELETE_MARGIN: Duration = Duration::from_secs(2);

/// Where the changes go: the kernel (netlink), or a recorder in tests.
pub trait SetWriter: Send + Sync + 'static {
    fn apply(&self, changes: &[Change]) -> std::io::Result<()>;
}

/// The kernel's nf_tables, over netlink, in-process.
pub struct Kernel;

impl SetWriter for Kernel {
    fn apply(&self, changes: &[Change]) -> std::io::Result<()> {
        netlink::apply_set_changes(plan::TABLE, changes)
    }
}

/// Batches kept in memory (tests).
#[derive(Default)]
pub struct Recorder {
    pub batches: Mutex<Vec<Vec<Change>>>,
}

impl SetWriter for Recorder {
    fn apply(&self, changes: &[Change]) -> std::io::Result<()> {
        self.batches.lock().expect("recorder").push(changes.to_vec());
        Ok(())
    }
}

/// (address, the rule's port).
type Form = (Ipv4Addr, Option<u16>);

pub enum Request {
    /// Allow these addresses for `timeout` (an answer for `name` to container `ip`, `id`).
    Allow {
        ip: Ipv4Addr,
        id: String,
        name: String,
        forms: Vec<Form>,
        timeout: Duration,
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// A container the resolver learnt of (`complete`: from its attach, so every element of
    /// it goes through here; a policy loaded from a file at start may have elements from
    /// before).
    Attach { ip: Ipv4Addr, id: String, complete: bool },
    /// A container gone: its elements go. The reply: whether they were all known (else the
    /// caller removes what the wall has of it).
    Detach {
        ip: Ipv4Addr,
        id: String,
        reply: oneshot::Sender<bool>,
    },
    /// A container's new domains: elements no domain allows any more go, others change form.
    Patch {
        ip: Ipv4Addr,
        id: String,
        domains: Vec<EgressDomain>,
        reply: oneshot::Sender<bool>,
    },
}

struct Owner {
    id: String,
    complete: bool,
    elems: HashMap<Form, (Instant, String)>,
}

fn change_add(ip: Ipv4Addr, (addr, port): Form, timeout: Duration) -> Change {
    let set = if port.is_some() { plan::DOM_PORT } else { plan::DOM };
    Change::Add {
        set: set.into(),
        key: Key {
            container: ip,
            addr,
            port,
        },
        timeout,
    }
}

fn change_delete(ip: Ipv4Addr, (addr, port): Form) -> Change {
    let set = if port.is_some() { plan::DOM_PORT } else { plan::DOM };
    Change::Delete {
        set: set.into(),
        key: Key {
            container: ip,
            addr,
            port,
        },
    }
}

/// The element memory and its writer.
pub struct Sets {
    owners: HashMap<Ipv4Addr, Owner>,
    writer: Arc<dyn SetWriter>,
    max_per_container: usize,
}

/// What one request turned into, and how to answer it once the batch is applied.
enum Pending {
    Allow(oneshot::Sender<Result<(), String>>, Result<(), String>),
    Known(oneshot::Sender<bool>, bool),
    Nothing,
}

impl Sets {
    pub fn new(writer: Arc<dyn SetWriter>, max_per_container: usize) -> Self {
        Sets {
            owners: HashMap::new(),
            writer,
            max_per_container,
        }
    }

    /// Start the task; the sender is how answers and control messages reach it.
    pub fn spawn(self) -> mpsc::Sender<Request> {
        let (tx, rx) = mpsc::channel(1024);
        tokio::spawn(self.run(rx));
        tx
    }

    async fn run(mut self, mut rx: mpsc::Receiver<Request>) {
        while let Some(first) = rx.recv().await {
            let mut requests = vec![first];
            while requests.len() < BATCH {
                match rx.try_recv() {
                    Ok(r) => requests.push(r),
                    Err(_) => break,
                }
            }
            let writer = self.writer.clone();
            let planned: Vec<(Vec<Change>, Pending)> =
                requests.into_iter().map(|r| self.plan(r, Instant::now())).collect();
            let all: Vec<Change> = planned.iter().flat_map(|(c, _)| c.clone()).collect();
            let ok = all.is_empty() || {
                let w = writer.clone();
                tokio::task::spawn_blocking(move || w.apply(&all))
                    .await
                    .is_ok_and(|r| r.is_ok())
            };
            for (changes, pending) in planned {
                // A failed batch is tried again request by request, so one bad request (an
                // element the kernel lost) does not fail the others.
                let this_ok = ok || changes.is_empty() || {
                    let w = writer.clone();
                    tokio::task::spawn_blocking(move || w.apply(&changes))
                        .await
                        .is_ok_and(|r| r.is_ok())
                };
                match pending {
                    Pending::Allow(reply, result) => {
                        let _ = reply.send(if this_ok {
                            result
                        } else {
                            Err("the kernel refused the set update".into())
                        });
                    }
                    Pending::Known(reply, known) => {
                        let _ = reply.send(this_ok && known);
                    }
                    Pending::Nothing => {}
                }
            }
        }
    }

    /// A request's changes (memory updated as if they apply), and its answer.
    fn plan(&mut self, r: Request, now: Instant) -> (Vec<Change>, Pending) {
        match r {
            Request::Attach { ip, id, complete } => {
                match self.owners.get_mut(&ip) {
                    Some(o) if o.id == id => o.complete &= complete,
                    _ => {
                        self.owners.insert(
                            ip,
                            Owner {
                                id,
                                complete,
                                elems: HashMap::new(),
                            },
                        );
                    }
                }
                (Vec::new(), Pending::Nothing)
            }
            Request::Detach { ip, id, reply } => match self.owners.remove(&ip) {
                Some(o) if o.id == id => {
                    let changes = o
                        .elems
                        .iter()
                        .filter(|(_, (until, _))| *until > now + DELETE_MARGIN)
                        .map(|(form, _)| change_delete(ip, *form))
                        .collect();
                    (changes, Pending::Known(reply, o.complete))
                }
                Some(o) => {
                    self.owners.insert(ip, o);
                    (Vec::new(), Pending::Known(reply, false))
                }
                None => (Vec::new(), Pending::Known(reply, false)),
            },
            Request::Patch { ip, id, domains, reply } => {
                let Some(o) = self.owners.get_mut(&ip).filter(|o| o.id == id) else {
                    return (Vec::new(), Pending::Known(reply, false));
                };
                let mut changes = Vec::new();
                let mut next: HashMap<Form, (Instant, String)> = HashMap::new();
                for ((addr, port), (until, name)) in o.elems.drain() {
                    if until <= now {
                        continue;
                    }
                    let forms: Vec<Option<u16>> = domains.iter().filter(|d| d.matches(&name)).map(|d| d.port).collect();
                    if !forms.contains(&port) && until > now + DELETE_MARGIN {
                        changes.push(change_delete(ip, (addr, port)));
                    }
                    for f in forms {
                        if let std::collections::hash_map::Entry::Vacant(slot) = next.entry((addr, f)) {
                            if f != port {
                                changes.push(change_add(ip, (addr, f), until - now));
                            }
                            slot.insert((until, name.clone()));
                        }
                    }
                }
                // An add in `next` may meet a delete of the same element above (a port form
                // kept): the kernel applies both in order, add last wins.
                o.elems = next;
                (changes, Pending::Known(reply, o.complete))
            }
            Request::Allow {
                ip,
                id,
                name,
                forms,
                timeout,
                reply,
            } => {
                let max = self.max_per_container;
                let Some(o) = self.owners.get_mut(&ip).filter(|o| o.id == id) else {
                    return (Vec::new(), Pending::Allow(reply, Err("the container is gone".into())));
                };
                let new = |o: &Owner| forms.iter().filter(|f| !o.elems.contains_key(f)).count();
                if o.elems.len() + new(o) > max {
                    o.elems.retain(|_, (until, _)| *until > now);
                    if o.elems.len() + new(o) > max {
                        return (
                            Vec::new(),
                            Pending::Allow(reply, Err(format!("the container has {max} addresses allowed already"))),
                        );
                    }
                }
                let mut changes = Vec::new();
                for form in forms {
                    let fresh = o.elems.get(&form).is_some_and(|(until, _)| *until > now + timeout / 2);
                    if !fresh {
                        changes.push(change_add(ip, form, timeout));
                        o.elems.insert(form, (now + timeout, name.clone()));
                    }
                }
                (changes, Pending::Allow(reply, Ok(())))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn domain(t: &str) -> EgressDomain {
        match crate::manifest::EgressEntry::parse(t).unwrap() {
            crate::manifest::EgressEntry::Domain(d) => d,
            _ => panic!("{t}"),
        }
    }

    async fn allow(tx: &mpsc::Sender<Request>, ip: Ipv4Addr, name: &str, forms: Vec<Form>) -> Result<(), String> {
        let (reply, rx) = oneshot::channel();
        tx.send(Request::Allow {
            ip,
            id: "c1".into(),
            name: name.into(),
            forms,
            timeout: Duration::from_secs(60),
            reply,
        })
        .await
        .unwrap();
        rx.await.unwrap()
    }

    #[tokio::test]
    async fn a_repeated_answer_costs_no_kernel_work_and_a_patch_cuts_what_it_removes() {
        let rec = Arc::new(Recorder::default());
        let tx = Sets::new(rec.clone(), 3).spawn();
        let ip = Ipv4Addr::new(10, 89, 0, 2);
        let a = Ipv4Addr::new(198, 51, 100, 7);
        let b = Ipv4Addr::new(198, 51, 100, 8);
        // Unknown container: refused, nothing written.
        assert!(allow(&tx, ip, "a.test", vec![(a, None)]).await.is_err());
        tx.send(Request::Attach {
            ip,
            id: "c1".into(),
            complete: true,
        })
        .await
        .unwrap();
        allow(&tx, ip, "a.test", vec![(a, None), (a, Some(443))]).await.unwrap();
        allow(&tx, ip, "a.test", vec![(a, None), (a, Some(443))]).await.unwrap();
        assert_eq!(rec.batches.lock().unwrap().len(), 1, "the repeat wrote nothing");
        // The cap.
        assert!(allow(&tx, ip, "b.test", vec![(b, None), (b, Some(1))]).await.is_err());
        allow(&tx, ip, "b.test", vec![(b, None)]).await.unwrap();
        // PATCH: a.test only on 443 now, b.test gone.
        let (reply, rx) = oneshot::channel();
        tx.send(Request::Patch {
            ip,
            id: "c1".into(),
            domains: vec![domain("a.test:443")],
            reply,
        })
        .await
        .unwrap();
        assert!(rx.await.unwrap());
        let last = rec.batches.lock().unwrap().last().unwrap().clone();
        let deleted: Vec<Key> = last
            .iter()
            .filter_map(|c| match c {
                Change::Delete { key, .. } => Some(*key),
                _ => None,
            })
            .collect();
        assert_eq!(deleted.len(), 2, "{last:?}");
        assert!(deleted.contains(&Key {
            container: ip,
            addr: a,
            port: None
        }));
        assert!(deleted.contains(&Key {
            container: ip,
            addr: b,
            port: None
        }));
        // Detach removes what is left (a . 443) and says it knew everything.
        let (reply, rx) = oneshot::channel();
        tx.send(Request::Detach {
            ip,
            id: "c1".into(),
            reply,
        })
        .await
        .unwrap();
        assert!(rx.await.unwrap());
        let last = rec.batches.lock().unwrap().last().unwrap().clone();
        assert_eq!(
            last,
            vec![Change::Delete {
                set: plan::DOM_PORT.into(),
                key: Key {
                    container: ip,
                    addr: a,
                    port: Some(443)
                }
            }]
        );
    }

    #[tokio::test]
    async fn a_container_loaded_at_start_is_not_known_completely() {
        let tx = Sets::new(Arc::new(Recorder::default()), 10).spawn();
        let ip = Ipv4Addr::new(10, 89, 0, 9);
        tx.send(Request::Attach {
            ip,
            id: "c1".into(),
            complete: false,
        })
        .await
        .unwrap();
        let (reply, rx) = oneshot::channel();
        tx.send(Request::Detach {
            ip,
            id: "c1".into(),
            reply,
        })
        .await
        .unwrap();
        assert!(!rx.await.unwrap());
    }
}
