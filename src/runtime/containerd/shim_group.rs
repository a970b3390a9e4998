//! Shim groups: live sessions of one Environment sharing one `containerd-shim-runc-v2`.
//!
//! Every container normally gets a shim of its own, a Go process of 6–12 threads that costs
//! an idle node ~0.013 % of its CPU in timers and collections (docs/guide/capacity.md). runc's
//! shim (containerd 1.6, 1.7 and 2.x) reads the spec annotation `io.containerd.runc.v2.group`
//! in its `start` command: containers with the same value get the same shim socket address,
//! and a start that finds a shim listening there hands the new container to it instead of
//! starting another. The shim serves every container it was given and exits when the last
//! one is deleted (its `Shutdown` returns early while it holds any). The annotation changes
//! nothing else: runc, the spec, the cgroups and namespaces of each container are its own.
//!
//! A group is this server's: its name carries a tag of this process, and it holds containers
//! of one key (the Environment as bound, and the image's content) only, at most `size` of
//! them. What a shared shim costs is its fault domain: a shim that dies takes every container
//! of its group (containerd's clean-up after a dead shim kills each container's init and
//! publishes its exit).
//!
//! The one race to keep out: a container joining a group while its last member is deleted.
//! Its `shim start` finds the shim listening and hands over; if the last member's
//! `Tasks.Delete` lands before the joiner's `Tasks.Create` reaches the shim, the shim shuts
//! down under the joiner. So a group takes joiners only while it holds an established
//! member (one whose task exists), and a member's delete that would leave its group with no
//! established member while joiners are on their way waits for them (bounded) first. A group
//! with nobody left is forgotten: its name is never given again.
//!
//! A burst of creates would otherwise found a group each (none is established while its
//! first create runs): a create that finds a group of its key still being founded takes a
//! seat in it and waits (bounded) for the founder's task; when the seats are taken, the next
//! create founds another group, so a burst of K founds about K / size groups. A founder whose
//! create failed takes its group with it (its shim may be going away): its seated joiners
//! choose again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::Digest;

/// The annotation runc's shim v2 groups containers by.
pub const GROUP_ANNOTATION: &str = "io.containerd.runc.v2.group";
/// The most containers one group holds (what `--sessions-per-shim` accepts).
pub const MAX_GROUP_SIZE: usize = 256;
/// How long a last member's delete waits for joiners' creates (a create that takes longer
/// failed in all likelihood; the delete then goes on).
const JOINERS_WAIT: Duration = Duration::from_secs(60);
/// How long a create seated in a group being founded waits for its founder's task before it
/// founds a group of its own (a founder's create under load takes well under this).
const FOUNDER_WAIT: Duration = Duration::from_secs(10);

/// The groups of one server (`runner serve --sessions-per-shim N`).
#[derive(Debug)]
pub struct ShimGroups {
    size: usize,
    /// This process's part of every group name: groups of two servers on one containerd
    /// never meet.
    prefix: String,
    table: Mutex<Table>,
    changed: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct Table {
    next: u64,
    groups: HashMap<u64, Group>,
    /// Container id → its group, and whether its task exists.
    members: HashMap<String, (u64, bool)>,
}

#[derive(Debug)]
struct Group {
    key: String,
    /// Members whose task exists and whose delete has not begun.
    established: usize,
    /// Members whose task is being created.
    creating: usize,
    /// Creates seated in it while it is being founded (they join once it is established).
    seated: usize,
}

impl Group {
    fn is_empty(&self) -> bool {
        self.established == 0 && self.creating == 0
    }

    fn taken(&self) -> usize {
        self.established + self.creating + self.seated
    }
}

/// Where a create goes (see `ShimGroups::choose`).
enum Choice {
    Join(u64),
    Wait(u64),
    Found,
}

/// What a container was given: its group's name, for the annotation.
#[derive(Debug)]
pub struct Ticket {
    groups: Arc<ShimGroups>,
    container: String,
    pub group: String,
    settled: bool,
}

impl Ticket {
    /// Its task exists: the container is a member that keeps the shim.
    pub fn established(mut self) {
        self.settled = true;
        self.groups.settle(&self.container, true);
    }
}

impl Drop for Ticket {
    /// Dropped before its task was created (a create that failed): it never joined.
    fn drop(&mut self) {
        if !self.settled {
            self.groups.settle(&self.container, false);
        }
    }
}

/// A seat a waiting create holds in a group being founded, given back if the create is
/// dropped while it waits.
struct Seat<'a> {
    groups: &'a ShimGroups,
    group: Option<u64>,
}

impl Drop for Seat<'_> {
    fn drop(&mut self) {
        if let Some(n) = self.group {
            let mut table = self.groups.table.lock().expect("shim groups");
            if let Some(g) = table.groups.get_mut(&n) {
                g.seated -= 1;
            }
        }
    }
}

impl ShimGroups {
    /// Groups of at most `size` containers; `None` for a size of 1 (a shim each).
    pub fn new(size: usize) -> Option<Arc<ShimGroups>> {
        (size > 1).then(|| {
            Arc::new(ShimGroups {
                size: size.min(MAX_GROUP_SIZE),
                prefix: format!("runner-{}", crate::owner::unique_tag()),
                table: Mutex::default(),
                changed: tokio::sync::Notify::new(),
            })
        })
    }

    /// At most this many containers per shim.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The key of what may share a shim: the Environment as bound (image, user, resources,
    /// network, setup, ...) and the image's content.
    pub fn key(env: &crate::manifest::Environment, image: &str, top_chain: &str) -> String {
        let digest = sha2::Sha256::digest(format!("{env:?}\n{image}\n{top_chain}").as_bytes());
        hex::encode(&digest[..16])
    }

    fn name(&self, group: u64) -> String {
        format!("{}-{group}", self.prefix)
    }

    /// A group for container `container` of key `key`: the fullest with room that holds an
    /// established member; else a seat in one being founded, waiting (bounded) for its
    /// founder's task; else a new one.
    pub async fn join(self: &Arc<Self>, key: &str, container: &str) -> Ticket {
        self.join_within(key, container, FOUNDER_WAIT).await
    }

    async fn join_within(self: &Arc<Self>, key: &str, container: &str, limit: Duration) -> Ticket {
        let deadline = tokio::time::Instant::now() + limit;
        let mut seat = Seat {
            groups: self,
            group: None,
        };
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut table = self.table.lock().expect("shim groups");
                let late = tokio::time::Instant::now() >= deadline;
                if let Some(n) = seat.group {
                    match table.groups.get_mut(&n) {
                        Some(g) if g.established > 0 || late => {
                            g.seated -= 1;
                            seat.group = None;
                            if g.established > 0 {
                                return self.enter(&mut table, n, container);
                            }
                            return self.found(&mut table, key, container);
                        }
                        Some(_) => {}
                        // Its founder failed: choose again.
                        None => seat.group = None,
                    }
                }
                if seat.group.is_none() {
                    match self.choose(&table, key) {
                        Choice::Join(n) => return self.enter(&mut table, n, container),
                        Choice::Wait(n) if !late => {
                            if let Some(g) = table.groups.get_mut(&n) {
                                g.seated += 1;
                            }
                            seat.group = Some(n);
                        }
                        Choice::Wait(_) | Choice::Found => return self.found(&mut table, key, container),
                    }
                }
            }
            let _ = tokio::time::timeout_at(deadline, notified).await;
        }
    }

    /// The fullest group of `key` with room holding an established member; else the fullest
    /// being founded with a free seat.
    fn choose(&self, table: &Table, key: &str) -> Choice {
        let open = |founded: bool| {
            table
                .groups
                .iter()
                .filter(|(_, g)| g.key == key && (g.established > 0) == founded && g.taken() < self.size)
                .filter(|(_, g)| founded || g.creating > 0)
                .max_by_key(|(n, g)| (g.taken(), std::cmp::Reverse(**n)))
                .map(|(n, _)| *n)
        };
        match (open(true), open(false)) {
            (Some(n), _) => Choice::Join(n),
            (None, Some(n)) => Choice::Wait(n),
            (None, None) => Choice::Found,
        }
    }

    /// A new group of `key`, founded by `container`.
    fn found(self: &Arc<Self>, table: &mut Table, key: &str, container: &str) -> Ticket {
        table.next += 1;
        let n = table.next;
        table.groups.insert(
            n,
            Group {
                key: key.to_string(),
                established: 0,
                creating: 0,
                seated: 0,
            },
        );
        self.enter(table, n, container)
    }

    /// `container` joins group `n` (its task is yet to be created).
    fn enter(self: &Arc<Self>, table: &mut Table, n: u64, container: &str) -> Ticket {
        if let Some(group) = table.groups.get_mut(&n) {
            group.creating += 1;
        }
        table.members.insert(container.to_string(), (n, false));
        Ticket {
            groups: self.clone(),
            container: container.to_string(),
            group: self.name(n),
            settled: false,
        }
    }

    /// A joiner's create is over: `ok`, its task exists.
    fn settle(&self, container: &str, ok: bool) {
        let mut table = self.table.lock().expect("shim groups");
        Self::settle_in(&mut table, container, ok);
        drop(table);
        self.changed.notify_waiters();
    }

    fn settle_in(table: &mut Table, container: &str, ok: bool) {
        let Some((n, false)) = table.members.get(container).copied() else {
            return;
        };
        let mut gone = false;
        if let Some(group) = table.groups.get_mut(&n) {
            group.creating = group.creating.saturating_sub(1);
            if ok {
                group.established += 1;
            }
            gone = group.is_empty();
        }
        if ok {
            table.members.insert(container.to_string(), (n, true));
        } else {
            table.members.remove(container);
        }
        if gone {
            table.groups.remove(&n);
        }
    }

    /// Container `container`'s task is about to be deleted: it stops counting as a member
    /// that keeps its shim. When it is the last such member and others are joining, wait
    /// (bounded) until their tasks exist, so the shim outlives their handover. No-op for a
    /// container of no group.
    pub async fn leaving(&self, container: &str) {
        self.leaving_within(container, JOINERS_WAIT).await
    }

    async fn leaving_within(&self, container: &str, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut table = self.table.lock().expect("shim groups");
                let Some((n, established)) = table.members.get(container).copied() else {
                    return;
                };
                if !established {
                    // Torn down before its task was made (its create failed).
                    Self::settle_in(&mut table, container, false);
                    drop(table);
                    self.changed.notify_waiters();
                    return;
                }
                let Some(group) = table.groups.get_mut(&n) else {
                    table.members.remove(container);
                    return;
                };
                let last_with_joiners = group.established <= 1 && group.creating > 0;
                if !last_with_joiners || tokio::time::Instant::now() >= deadline {
                    if last_with_joiners {
                        tracing::warn!(
                            container,
                            "deleting the last member of a shim group while others still join it"
                        );
                    }
                    group.established = group.established.saturating_sub(1);
                    let gone = group.is_empty();
                    table.members.remove(container);
                    if gone {
                        table.groups.remove(&n);
                        // Creates seated in it (a founder that left at once) choose again.
                        self.changed.notify_waiters();
                    }
                    return;
                }
            }
            let _ = tokio::time::timeout_at(deadline, notified).await;
        }
    }

    /// (groups, members) held now.
    pub fn counts(&self) -> (usize, usize) {
        let table = self.table.lock().expect("shim groups");
        (table.groups.len(), table.members.len())
    }

    /// The group name a container has, if any (for tests and diagnostics).
    pub fn group_of(&self, container: &str) -> Option<String> {
        let table = self.table.lock().expect("shim groups");
        table.members.get(container).map(|(n, _)| self.name(*n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn groups(size: usize) -> Arc<ShimGroups> {
        ShimGroups::new(size).expect("a size over 1")
    }

    #[test]
    fn size_one_is_no_grouping() {
        assert!(ShimGroups::new(1).is_none());
        assert!(ShimGroups::new(0).is_none());
        assert_eq!(groups(100_000).size(), MAX_GROUP_SIZE);
    }

    #[tokio::test]
    async fn a_group_fills_to_its_size_then_another_begins() {
        let g = groups(3);
        let first = g.join("k", "c1").await;
        let name = first.group.clone();
        first.established();
        let mut names = Vec::new();
        for c in ["c2", "c3"] {
            let t = g.join("k", c).await;
            names.push(t.group.clone());
            t.established();
        }
        assert_eq!(names, vec![name.clone(), name.clone()]);
        let fourth = g.join("k", "c4").await;
        assert_ne!(fourth.group, name);
        fourth.established();
        assert_eq!(g.counts(), (2, 4));
    }

    #[tokio::test]
    async fn keys_never_share_a_group() {
        let g = groups(8);
        let a = g.join("env-a", "a1").await;
        let a_name = a.group.clone();
        a.established();
        let b = g.join("env-b", "b1").await;
        assert_ne!(b.group, a_name);
        b.established();
        let a2 = g.join("env-a", "a2").await;
        assert_eq!(a2.group, a_name);
    }

    #[tokio::test]
    async fn nobody_joins_a_group_before_its_first_member_is_created() {
        // Its shim may not exist yet, and its founder's create may fail: a second create
        // waits in a seat until the founder's task exists.
        let g = groups(8);
        let founder = g.join("k", "c1").await;
        let name = founder.group.clone();
        let second = {
            let g = g.clone();
            tokio::spawn(async move { g.join("k", "c2").await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!second.is_finished(), "c2 must wait for c1's task");
        assert_eq!(g.group_of("c2"), None);
        founder.established();
        let second = second.await.expect("join");
        assert_eq!(second.group, name);
        second.established();
        assert_eq!(g.counts(), (1, 2));
    }

    #[tokio::test]
    async fn a_burst_founds_a_group_per_size_not_per_create() {
        let g = groups(4);
        // 12 creates at once: 3 founders, 9 seated.
        let joins: Vec<_> = (0..12)
            .map(|i| {
                let g = g.clone();
                tokio::spawn(async move { g.join("k", &format!("c{i}")).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let founders: Vec<String> = (0..12).filter_map(|i| g.group_of(&format!("c{i}"))).collect();
        assert_eq!(founders.len(), 3, "{founders:?}");
        // Each founder's task comes to exist: the creates seated in its group join it.
        for j in joins {
            let t = tokio::time::timeout(Duration::from_secs(1), j)
                .await
                .expect("a seated create joins once its founder's task exists")
                .expect("join");
            t.established();
        }
        let mut sizes: HashMap<String, usize> = HashMap::new();
        for i in 0..12 {
            *sizes
                .entry(g.group_of(&format!("c{i}")).expect("a member"))
                .or_default() += 1;
        }
        assert_eq!(sizes.len(), 3, "{sizes:?}");
        assert!(sizes.values().all(|n| *n == 4), "{sizes:?}");
    }

    #[tokio::test]
    async fn seated_creates_choose_again_when_their_founder_fails() {
        let g = groups(4);
        let founder = g.join("k", "f").await;
        let failed = founder.group.clone();
        let join = |c: &'static str| {
            let g = g.clone();
            tokio::spawn(async move { g.join("k", c).await })
        };
        let (a, b) = (join("a"), join("b"));
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(founder); // its create failed
        tokio::time::sleep(Duration::from_millis(50)).await;
        // One of them founds a new group (never the failed one's name); the other sits in it.
        let founded: Vec<String> = ["a", "b"].iter().filter_map(|c| g.group_of(c)).collect();
        assert_eq!(founded.len(), 1, "{founded:?}");
        assert_ne!(founded[0], failed);
        assert!(a.is_finished() != b.is_finished(), "one founds, one waits");
        let (new_founder, seated) = if a.is_finished() { (a, b) } else { (b, a) };
        new_founder.await.expect("join").established();
        let seated = seated.await.expect("join");
        assert_eq!(seated.group, founded[0]);
        seated.established();
        assert_eq!(g.counts(), (1, 2));
    }

    #[tokio::test]
    async fn a_seat_waits_its_bound_then_founds_and_a_dropped_wait_gives_its_seat_back() {
        let g = groups(2);
        let _founder = g.join("k", "f").await;
        // Size 2: one seat. A create dropped while seated gives it back...
        let dropped = {
            let g = g.clone();
            tokio::spawn(async move { g.join("k", "d").await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        dropped.abort();
        let _ = dropped.await;
        // ...so the next one sits in it (and founds its own after its bound).
        let t0 = tokio::time::Instant::now();
        let waited = g.join_within("k", "w", Duration::from_millis(200)).await;
        assert!(t0.elapsed() >= Duration::from_millis(200));
        assert_ne!(Some(waited.group.clone()), g.group_of("f"));
        assert_eq!(g.counts(), (2, 2));
    }

    #[tokio::test]
    async fn a_failed_create_leaves_no_member_and_an_empty_group_is_forgotten() {
        let g = groups(4);
        let t = g.join("k", "c1").await;
        let name = t.group.clone();
        drop(t); // its create failed
        assert_eq!(g.counts(), (0, 0));
        let again = g.join("k", "c2").await;
        assert_ne!(again.group, name, "a group's name is never given again");
    }

    #[tokio::test]
    async fn a_teardown_before_the_task_existed_does_not_wait_for_itself() {
        let g = groups(4);
        let a = g.join("k", "a").await;
        a.established();
        let t = g.join("k", "b").await;
        g.leaving("b").await;
        drop(t);
        assert_eq!(g.counts(), (1, 1));
    }

    #[tokio::test]
    async fn a_group_whose_members_all_left_is_gone() {
        let g = groups(4);
        let t = g.join("k", "c1").await;
        let name = t.group.clone();
        t.established();
        g.leaving("c1").await;
        assert_eq!(g.counts(), (0, 0));
        let next = g.join("k", "c2").await;
        assert_ne!(next.group, name);
        // Leaving twice, or a container of no group: nothing happens.
        g.leaving("c1").await;
        g.leaving("never-grouped").await;
    }

    #[tokio::test]
    async fn a_left_place_is_taken_again() {
        let g = groups(2);
        let a = g.join("k", "a").await;
        let name = a.group.clone();
        a.established();
        let b = g.join("k", "b").await;
        assert_eq!(b.group, name);
        b.established();
        g.leaving("a").await;
        let c = g.join("k", "c").await;
        assert_eq!(c.group, name, "b still holds the shim: its place is free");
    }

    #[tokio::test]
    async fn the_last_member_waits_for_joiners_before_its_delete() {
        let g = groups(4);
        let a = g.join("k", "a").await;
        a.established();
        let joiner = g.join("k", "j").await;
        let leaving = {
            let g = g.clone();
            tokio::spawn(async move { g.leaving("a").await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!leaving.is_finished(), "the delete must wait while j's task is created");
        joiner.established();
        leaving.await.expect("leaving");
        assert_eq!(g.counts(), (1, 1));
    }

    #[tokio::test]
    async fn a_waiting_delete_goes_on_after_a_failed_join_and_after_its_bound() {
        let g = groups(4);
        let a = g.join("k", "a").await;
        a.established();
        let joiner = g.join("k", "j").await;
        let leaving = {
            let g = g.clone();
            tokio::spawn(async move { g.leaving("a").await })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(joiner);
        leaving.await.expect("leaving");
        assert_eq!(g.counts(), (0, 0));
        // A joiner that never ends: the delete waits its bound, then goes on.
        let b = g.join("k", "b").await;
        b.established();
        let _stuck = g.join("k", "stuck").await;
        let t0 = tokio::time::Instant::now();
        g.leaving_within("b", Duration::from_millis(200)).await;
        assert!(t0.elapsed() >= Duration::from_millis(200));
        assert_eq!(g.counts(), (1, 1), "only the stuck joiner is left");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_joins_never_overfill() {
        let g = groups(5);
        let joins: Vec<_> = (0..40)
            .map(|i| {
                let g = g.clone();
                tokio::spawn(async move {
                    let t = g.join("k", &format!("c{i}")).await;
                    let group = t.group.clone();
                    t.established();
                    group
                })
            })
            .collect();
        let mut sizes: HashMap<String, usize> = HashMap::new();
        for j in joins {
            *sizes.entry(j.await.expect("join")).or_default() += 1;
        }
        assert!(sizes.values().all(|n| *n <= 5), "{sizes:?}");
        assert_eq!(sizes.len(), 8, "40 creates in groups of 5: {sizes:?}");
    }
}
