//! Claiming a member: the atomic rename that makes one process its holder, the checks that
//! the PID found is the member's init, and the job's late binds.

use super::*;

/// Whether a spec gives its container a PID namespace of its own (then its init's death is
/// every process's).
fn own_pid_namespace(spec: &Spec) -> bool {
    spec.linux()
        .as_ref()
        .and_then(|l| l.namespaces().as_ref())
        .is_some_and(|ns| {
            ns.iter()
                .any(|n| n.typ() == oci_spec::runtime::LinuxNamespaceType::Pid && n.path().is_none())
        })
}

/// A pidfd for `pid` (None where the kernel has none: before 5.3).
fn pin(pid: u32) -> Option<std::os::fd::OwnedFd> {
    // SAFETY: pidfd_open returns a new descriptor we then own, or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a fresh descriptor owned by nobody else.
    Some(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd as i32) })
}

/// In a member's run directory (the host's alone: the member sees only its `agent`
/// directory): what a claim needs of its container and task records, written by the filler
/// once the member runs, so a claim reads no containerd record.
const RECORD_FILE: &str = "member.json";
/// Most bytes of a record read (a process and a few numbers).
const RECORD_LIMIT: u64 = 256 << 10;

/// What a claim needs of a member.
#[derive(serde::Serialize, serde::Deserialize)]
pub(super) struct MemberRecord {
    pub init_pid: u32,
    pub pool: Option<String>,
    /// The first host id of its user namespace's range (`None` with `hostUsers: true`).
    pub range: Option<u32>,
    /// Whether its init is the init of a PID namespace of its own.
    pub own_pid_ns: bool,
    pub process: oci_spec::runtime::Process,
}

impl MemberRecord {
    /// From a member's container record (its spec) and its init's PID.
    fn of(c: &containerd_client::services::v1::Container, init_pid: u32) -> Result<Self, RuntimeError> {
        let spec: Spec = c
            .spec
            .as_ref()
            .and_then(|s| serde_json::from_slice(&s.value).ok())
            .ok_or_else(|| RuntimeError::Internal(format!("member {} has no readable spec", c.id)))?;
        Ok(MemberRecord {
            init_pid,
            pool: c.labels.get(LABEL_POOL).cloned(),
            range: crate::runtime::containerd::remap::range_of(&spec).map(|r| r.host_base),
            own_pid_ns: own_pid_namespace(&spec),
            process: spec
                .process()
                .clone()
                .ok_or_else(|| RuntimeError::Internal("member spec without process".into()))?,
        })
    }

    /// The record in run directory `dir`, when the filler left one.
    fn read(dir: &Path) -> Option<Self> {
        use std::io::Read;
        let mut text = Vec::new();
        std::fs::File::open(dir.join(RECORD_FILE))
            .and_then(|f| f.take(RECORD_LIMIT).read_to_end(&mut text))
            .ok()?;
        serde_json::from_slice(&text).ok()
    }
}

/// A claimed member's record, or why there is none.
enum Found {
    Record(Box<MemberRecord>),
    /// No container record (or an unreadable one).
    Nothing,
    /// Its init is gone (the pool it was in, when known).
    NotRunning(Option<String>),
}

impl Engine {
    /// Keep what a claim needs of member `id` (just started, its init `init_pid`) in its run
    /// directory: one read of its container record here, on the filler's path, instead of one
    /// per claim.
    pub(super) async fn write_member_record(&self, id: &str, init_pid: u32) -> Result<(), RuntimeError> {
        let c = self
            .client
            .container(id)
            .await?
            .ok_or_else(|| RuntimeError::Internal(format!("pool member {id} has no container record")))?;
        let record = serde_json::to_vec(&MemberRecord::of(&c, init_pid)?)
            .map_err(|e| RuntimeError::Internal(format!("encoding a member's record: {e}")))?;
        let dir = self.run_dir.join(id);
        // Whole or not at all: a claim reads it without a lock.
        let part = dir.join(format!("{RECORD_FILE}.part"));
        std::fs::write(&part, record)
            .and_then(|()| std::fs::rename(&part, dir.join(RECORD_FILE)))
            .map_err(|source| RuntimeError::Io {
                what: "writing the member's record".into(),
                source,
            })
    }

    /// What a claim needs of member `id` (run directory `dir`; `listed`: its container record
    /// when the claim listed it): from the filler's record, checked against the kernel (its
    /// init still in its cgroup), or else, for a member an older runner made, from
    /// containerd's container and task records.
    async fn member_record(
        &self,
        id: &str,
        dir: &Path,
        listed: Option<containerd_client::services::v1::Container>,
    ) -> Found {
        if listed.is_none()
            && let Some(record) = MemberRecord::read(dir)
        {
            // A dead init's PID names another process, or none: either way not one in the
            // member's cgroup. (`hide::enter` checks again once its namespaces are open.)
            return match hide::check_in_cgroup(record.init_pid, &self.cgroup_path(id), "the pool member") {
                Ok(()) => Found::Record(Box::new(record)),
                Err(_) => Found::NotRunning(record.pool),
            };
        }
        let c = match listed {
            Some(c) => c,
            None => match self.client.container(id).await {
                Ok(Some(c)) => c,
                _ => return Found::Nothing,
            },
        };
        match self.client.task_get(id).await {
            Ok(Some(p)) if p.status == STATUS_RUNNING => match MemberRecord::of(&c, p.pid) {
                Ok(r) => Found::Record(Box::new(r)),
                Err(e) => {
                    tracing::warn!(member = id, error = %e, "reading a pool member's record");
                    Found::Nothing
                }
            },
            _ => Found::NotRunning(c.labels.get(LABEL_POOL).cloned()),
        }
    }

    /// Claim a ready member that can serve `plan`, relabelled as this process's container of
    /// kind `kind` (with the plan's labels). `Claim::Cold`: no ready member; the caller runs
    /// cold, with the image resolved here if it got that far.
    /// Broken members found on the way are torn down.
    pub async fn claim(&self, plan: &RunPlan, kind: &str) -> Result<Claim, RuntimeError> {
        if plan.env().image.is_none() {
            return Ok(Claim::Cold(None, "the Environment names no image".into()));
        }
        if let Some(why) = unpoolable(plan) {
            tracing::debug!(why, "the job cannot run in a pool member");
            return Ok(Claim::Cold(None, format!("no pool member can run it: {why}")));
        }
        let t0 = Instant::now();
        let keyed = self.pool_key_unchecked(plan).await;
        if let Some(read) = &self.options.image_read {
            read.forget();
        }
        let (key, layout, image, check) = keyed?;
        super::super::claim_phase("pool key", t0);
        let claimed = self.claim_keyed(plan, kind, &key, layout, image, t0).await;
        let Some(check) = check else { return claimed };
        // A kept key was read beside the claim; nothing of it leaves before the image record
        // is seen to name what it was computed for.
        let t1 = Instant::now();
        let confirmed = check.confirm().await;
        super::super::claim_phase("key checked", t1);
        if let Ok(true) = confirmed {
            return claimed;
        }
        // The image moved under its name: a member of the old key is not this job's.
        if let Ok(Claim::Member(mut member)) = claimed {
            // Nothing of ours stays in its namespaces while it goes.
            let _ = member.ready().await;
            let _ = self.teardown(&member.id).await;
            if let Some(hook) = &self.options.on_claim {
                (hook.0)(&member.pool, crate::runtime::Refill::WhenQuiet);
            }
        }
        confirmed?;
        let (key, layout, image, _) = self.pool_key_computed(plan).await?;
        Box::pin(self.claim_keyed(plan, kind, &key, layout, image, t0)).await
    }

    /// `claim` with the plan's pool key, its layout and image.
    async fn claim_keyed(
        &self,
        plan: &RunPlan,
        kind: &str,
        key: &str,
        layout: Layout,
        image: ImageInfo,
        t0: Instant,
    ) -> Result<Claim, RuntimeError> {
        let key = key.to_string();
        // The ready index names the candidates without reading every member's record from
        // containerd (which made concurrent claims quadratic in the pool's size); members an
        // older runner made are not in it, and are found by their labels.
        let index = self.ready_index(&key);
        let mut ids: Vec<String> = std::fs::read_dir(&index)
            .map(|d| d.flatten().filter_map(|e| e.file_name().into_string().ok()).collect())
            .unwrap_or_default();
        let mut listed: HashMap<String, containerd_client::services::v1::Container> = HashMap::new();
        if ids.is_empty() {
            listed = self
                .members(Some(&key))
                .await?
                .into_iter()
                .map(|c| (c.id.clone(), c))
                .collect();
            ids = listed.keys().cloned().collect();
            ids.sort();
        }
        if ids.is_empty() {
            return Ok(Claim::Cold(Some(image), self.no_pool_fits(plan, &key)));
        }
        tracing::debug!(key, candidates = ids.len(), "looking for a pool member");
        // Claimants start at different places, so concurrent claims rarely collide.
        let shift = std::process::id() as usize + t0.elapsed().subsec_nanos() as usize;
        let n = ids.len();
        ids.rotate_left(shift % n);
        let me = owner_id();
        for id in ids {
            let dir = self.run_dir.join(&id);
            // An image with a `/static` of its own (a directory or a link; on a snapshotter
            // runner cannot read, one that may have it): a cold run binds each asset into it,
            // beside the image's files, through the link; a member's static root, put back,
            // would hide them. The pool's members share its image.
            if !plan.assets.is_empty() && dir.join(hide::STATIC_IN_IMAGE).exists() {
                return Ok(Claim::Cold(
                    Some(image),
                    "no pool member can run it: its image has (or may have) a /static of its own, which only a cold start binds the static assets into".into(),
                ));
            }
            let won = std::fs::rename(dir.join(READY_FILE), dir.join(format!("{CLAIMED_PREFIX}{me}"))).is_ok();
            // Claimed (by this process or another) or gone: either way no longer ready.
            let _ = std::fs::remove_file(index.join(&id));
            if !won {
                continue;
            }
            let t1 = Instant::now();
            let record = match self.member_record(&id, &dir, listed.remove(&id)).await {
                Found::Record(r) => r,
                Found::Nothing => {
                    tracing::warn!(member = id, "a ready pool member has no record; removing it");
                    let _ = self.teardown(&id).await;
                    continue;
                }
                Found::NotRunning(pool) => {
                    tracing::warn!(member = id, "a pool member was not running; removing it");
                    let _ = self.teardown(&id).await;
                    if let (Some(hook), Some(pool)) = (&self.options.on_claim, pool) {
                        (hook.0)(&pool, crate::runtime::Refill::WhenQuiet);
                    }
                    continue;
                }
            };
            let init_pid = record.init_pid;
            super::super::claim_phase("member record", t1);
            let mut labels: HashMap<String, String> = plan.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            labels.extend([
                (LABEL_OWNER.to_string(), me.clone()),
                (LABEL_KIND.to_string(), kind.to_string()),
                (LABEL_JOB.to_string(), plan.job().name.clone()),
            ]);
            labels.extend(crate::runtime::containerd::engine::workspace_labels(plan));
            let relabel = {
                let (client, id) = (self.client.clone(), id.clone());
                tokio::spawn(async move { client.container_set_labels(&id, labels).await })
            };
            let member = {
                let MemberRecord {
                    pool,
                    range,
                    own_pid_ns,
                    process,
                    ..
                } = *record;
                let range = range.map(|host_base| spec::IdRange { host_base });
                let (uid, gid) = (process.user().uid(), process.user().gid());
                let (uid, gid) = match range {
                    Some(r) => (r.host_id(uid), r.host_id(gid)),
                    None => (uid, gid),
                };
                // Pinned before `hide::enter` checks that the PID is the member's init (in
                // its cgroup), so what is pinned is what was checked.
                let init = own_pid_ns.then(|| pin(init_pid)).flatten();
                let hostname: String = plan.job().name.chars().take(63).collect();
                let static_out = dir.join(hide::STATIC_OUT).exists();
                let unused = hide::Unused::of(&layout, plan, &dir, static_out);
                let cgroup = self.cgroup_path(&id);
                // Put back before the assets are bound (`bind_late`), beside the readying.
                let static_back = (static_out && !plan.assets.is_empty()).then(|| hide::StaticBack {
                    init_pid,
                    cgroup: cgroup.clone(),
                    source: self.late_dir(&id).join(late::STATIC_DIR),
                    owner: range.map_or(0, |r| r.host_id(0)),
                });
                // Off the async workers, on a thread of its own (`hide::ready`): the agent's
                // FIFO opens, and the entering of the member's namespaces (its unmounts wait on
                // the kernel's mount lock, which a burst of claims contends for) would hold one
                // of them, and every other request with it. Not awaited here: it runs beside
                // the late binds (`Readying`), and whoever takes the member waits for it.
                let readying = {
                    let agent_dir = dir.join("agent");
                    hide::ready(
                        move || Agent::open(&agent_dir, uid, gid),
                        init_pid,
                        &cgroup,
                        &hostname,
                        unused,
                    )
                };
                Member {
                    id: id.clone(),
                    pool: pool.unwrap_or_default(),
                    init_pid,
                    layout: layout.clone(),
                    agent: super::Readying::Pending(readying),
                    cgroup,
                    process,
                    range,
                    relabel,
                    init,
                    seed: image.workspace.clone(),
                    static_back,
                }
            };
            tracing::debug!(ms = t0.elapsed().as_secs_f64() * 1e3, member = member.id, "claimed");
            return Ok(Claim::Member(Box::new(member)));
        }
        let pools: std::collections::BTreeSet<&str> = self
            .options
            .pools
            .iter()
            .filter(|p| p.key == key)
            .map(|p| p.name.as_str())
            .collect();
        let names: Vec<&str> = pools.into_iter().collect();
        Ok(Claim::Cold(
            Some(image),
            format!("no ready member in pool {} (every one was taken)", names.join(", ")),
        ))
    }

    /// Why no pool has a member of this job's shape (`key`): the pools of its Environment and
    /// what they serve instead. Workspace, assets, stdin, env and user never make a shape of
    /// their own (`member_layout`); the job's own mounts and a changed Environment or image do.
    fn no_pool_fits(&self, plan: &RunPlan, key: &str) -> String {
        let env = &plan.env().name;
        let theirs: Vec<&crate::runtime::PoolInfo> =
            self.options.pools.iter().filter(|p| &p.environment == env).collect();
        if theirs.is_empty() {
            return format!("no warm pool of Environment {env:?}");
        }
        if let Some(p) = theirs.iter().find(|p| p.key == key) {
            return format!("pool {} has no members (a filler may be making them)", p.name);
        }
        let why: Vec<String> = theirs
            .iter()
            .map(|p| {
                if let Some(snapshot) = &p.snapshot {
                    return format!(
                        "pool {} serves what starts from snapshot {snapshot} (image: snapshot:{snapshot})",
                        p.name
                    );
                }
                let mismatch = if !plan.job_mounts.is_empty() {
                    "serves jobs without mounts of their own (a Job's spec.mounts are bound where no member has a place)"
                } else {
                    "was made for another spec of it (its image, user, resources or mounts changed: `pool create` it again)"
                };
                format!("pool {} {mismatch}", p.name)
            })
            .collect();
        why.join("; ")
    }

    /// `bind_late` on the blocking pool: its mounts (the workspace's idmapped view among them)
    /// wait on the kernel's mount lock, which a burst of claims contends for, and must not
    /// hold an async worker meanwhile.
    pub(super) async fn bind_late_blocking(
        &self,
        id: &str,
        layout: &Layout,
        userns: Option<(spec::IdRange, (u32, u32))>,
        plan: &RunPlan,
        static_back: Option<hide::StaticBack>,
    ) -> Result<(), RuntimeError> {
        let (id, layout, plan) = (id.to_string(), layout.clone(), plan.clone());
        // Started before the late binds: the workspace is bound meanwhile, the assets once it
        // has answered.
        let static_back = static_back.map(hide::put_static_back);
        let bound = {
            let (engine, id) = (self.clone(), id.clone());
            tokio::task::spawn_blocking(move || engine.bind_late(&id, &layout, userns, &plan, static_back))
                .await
                .map_err(|e| RuntimeError::Internal(format!("binding into the claimed member: {e}")))?
        };
        // The views are at the places themselves; the member's rootfs on the host is not
        // needed any more (see `Engine::create_task`).
        super::drop_host_mounts_when_quiet(self.clone(), id);
        bound
    }

    /// Bind the plan's workspace, mounts and static assets into a claimed member (what it has
    /// no use for was taken out at claim: `hide`).
    fn bind_late(
        &self,
        id: &str,
        layout: &Layout,
        userns: Option<(spec::IdRange, (u32, u32))>,
        plan: &RunPlan,
        static_back: Option<tokio::sync::oneshot::Receiver<Result<(), RuntimeError>>>,
    ) -> Result<(), RuntimeError> {
        let dir = self.late_dir(id);
        let io = |what: String| move |source| RuntimeError::Io { what, source };
        let mut without_assets = plan.clone();
        without_assets.assets.clear();
        let binds = spec::merged_binds(&without_assets);
        // Each bind's place in the member, by target.
        let places = binds
            .iter()
            .map(|b| {
                layout.places.iter().position(|p| p.target == b.target).ok_or_else(|| {
                    RuntimeError::Internal(format!(
                        "the member has no place for {} (its layout does not fit the job)",
                        b.target
                    ))
                })
            })
            .collect::<Result<Vec<usize>, _>>()?;
        if !plan.assets.is_empty() && !layout.static_assets {
            return Err(RuntimeError::Internal("the member has no static-assets root".into()));
        }
        // The workspace's binds go through views, as in a cold container (see
        // `remap::workspace_views`): idmapped in a user namespace, and every path beneath the
        // workspace resolved now, beneath its descriptor. Each view is a detached tree with
        // its final flags, attached straight at its place (`remap::workspace_trees`).
        let mut trees: Vec<Option<std::os::fd::OwnedFd>> = binds.iter().map(|_| None).collect();
        if let Some(ws) = &plan.workspace {
            let ids = match userns {
                Some((range, user)) => Some(crate::runtime::containerd::remap::ViewIds {
                    owner: crate::runtime::containerd::remap::workspace_owner(ws)
                        .map_err(io("reading the workspace's owner".into()))?,
                    user,
                    range,
                }),
                None => None,
            };
            let list: Vec<(usize, PathBuf, bool)> = binds
                .iter()
                .enumerate()
                .map(|(i, b)| (i, b.source.clone(), b.read_only))
                .collect();
            for (i, tree) in crate::runtime::containerd::remap::workspace_trees(ws, &list, ids)
                .map_err(crate::runtime::containerd::view_error)?
            {
                trees[i] = Some(tree);
            }
        }
        for ((b, tree), &i) in binds.iter().zip(trees).zip(&places) {
            match tree {
                Some(tree) => crate::runtime::idmap::attach(tree, &dir.join(late::place_name(i))),
                None => late::bind_place(&dir, i, &b.source, b.read_only),
            }
            .map_err(io(format!("binding {}", b.target)))?;
        }
        if let Some(back) = static_back {
            // On the blocking pool: waiting here holds no async worker.
            let t0 = Instant::now();
            back.blocking_recv().map_err(|_| {
                RuntimeError::Internal("the thread putting the static root back ended without an answer".into())
            })??;
            super::super::claim_phase("static root back", t0);
        }
        for a in &plan.assets {
            let save_path = a
                .target
                .strip_prefix(&format!("{}/", spec::STATIC_ROOT))
                .unwrap_or(&a.target);
            late::bind_asset(&dir, save_path, &a.source, userns.map(|(range, _)| range.host_id(0)))
                .map_err(io(format!("binding {}", a.target)))?;
        }
        Ok(())
    }
}
