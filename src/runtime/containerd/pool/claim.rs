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

impl Engine {
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
        let (key, layout, image) = self.pool_key(plan).await?;
        super::super::claim_phase("pool key", t0);
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
            let won = std::fs::rename(dir.join(READY_FILE), dir.join(format!("{CLAIMED_PREFIX}{me}"))).is_ok();
            // Claimed (by this process or another) or gone: either way no longer ready.
            let _ = std::fs::remove_file(index.join(&id));
            if !won {
                continue;
            }
            let c = match listed.remove(&id) {
                Some(c) => c,
                None => match self.client.container(&id).await {
                    Ok(Some(c)) => c,
                    other => {
                        tracing::warn!(member = id, result = ?other.map(|_| ()), "a ready pool member has no record; removing it");
                        let _ = self.teardown(&id).await;
                        continue;
                    }
                },
            };
            let task = self.client.task_get(&c.id).await;
            let init_pid = match task {
                Ok(Some(p)) if p.status == STATUS_RUNNING => p.pid,
                _ => {
                    tracing::warn!(member = c.id, "a pool member was not running; removing it");
                    let _ = self.teardown(&c.id).await;
                    if let (Some(hook), Some(pool)) = (&self.options.on_claim, c.labels.get(LABEL_POOL)) {
                        (hook.0)(pool);
                    }
                    continue;
                }
            };
            let mut labels: HashMap<String, String> = plan.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            labels.extend([
                (LABEL_OWNER.to_string(), me.clone()),
                (LABEL_KIND.to_string(), kind.to_string()),
                (LABEL_JOB.to_string(), plan.job().name.clone()),
            ]);
            labels.extend(crate::runtime::containerd::engine::workspace_labels(plan));
            let relabel = {
                let (client, id) = (self.client.clone(), c.id.clone());
                tokio::spawn(async move { client.container_set_labels(&id, labels).await })
            };
            let claimed = async {
                let spec: Spec = c
                    .spec
                    .as_ref()
                    .and_then(|s| serde_json::from_slice(&s.value).ok())
                    .ok_or_else(|| RuntimeError::Internal(format!("member {} has no readable spec", c.id)))?;
                let process = spec
                    .process()
                    .clone()
                    .ok_or_else(|| RuntimeError::Internal("member spec without process".into()))?;
                let range = crate::runtime::containerd::remap::range_of(&spec);
                let (uid, gid) = (process.user().uid(), process.user().gid());
                let (uid, gid) = match range {
                    Some(r) => (r.host_id(uid), r.host_id(gid)),
                    None => (uid, gid),
                };
                let agent = Agent::open(&dir.join("agent"), uid, gid)?;
                // Pinned before `hide::enter` checks that the PID is the member's init (in
                // its cgroup), so what is pinned is what was checked.
                let init = own_pid_namespace(&spec).then(|| pin(init_pid)).flatten();
                let hostname: String = plan.job().name.chars().take(63).collect();
                let unused = hide::Unused::of(&layout, plan, &dir);
                let t1 = Instant::now();
                hide::enter(init_pid, &self.cgroup_path(&c.id), &hostname, unused)?;
                tracing::debug!(
                    ms = t1.elapsed().as_secs_f64() * 1e3,
                    "hostname set, unused places taken out"
                );
                Ok::<_, RuntimeError>(Member {
                    id: c.id.clone(),
                    pool: c.labels.get(LABEL_POOL).cloned().unwrap_or_default(),
                    init_pid,
                    layout: layout.clone(),
                    agent,
                    cgroup: self.cgroup_path(&c.id),
                    process,
                    range,
                    relabel,
                    init,
                    seed: image.workspace.clone(),
                })
            }
            .await;
            match claimed {
                Ok(member) => {
                    tracing::debug!(ms = t0.elapsed().as_secs_f64() * 1e3, member = member.id, "claimed");
                    return Ok(Claim::Member(Box::new(member)));
                }
                Err(e) => {
                    let _ = self.teardown(&c.id).await;
                    return Err(e);
                }
            }
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

    /// Bind the plan's workspace, mounts and static assets into a claimed member (what it has
    /// no use for was taken out at claim: `hide`).
    pub(super) fn bind_late(
        &self,
        id: &str,
        layout: &Layout,
        userns: Option<(spec::IdRange, (u32, u32))>,
        plan: &RunPlan,
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
        // workspace resolved now, beneath its descriptor.
        let mut sources: Vec<PathBuf> = binds.iter().map(|b| b.source.clone()).collect();
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
            for (i, view) in crate::runtime::containerd::remap::workspace_views(&self.run_dir.join(id), ws, &list, ids)
                .map_err(crate::runtime::containerd::view_error)?
            {
                sources[i] = view;
            }
        }
        for ((b, source), &i) in binds.iter().zip(&sources).zip(&places) {
            late::bind_place(&dir, i, source, b.read_only).map_err(io(format!("binding {}", b.target)))?;
        }
        for a in &plan.assets {
            let save_path = a
                .target
                .strip_prefix(&format!("{}/", spec::STATIC_ROOT))
                .unwrap_or(&a.target);
            late::bind_asset(&dir, save_path, &a.source, userns.map(|(range, _)| range.host_id(0)))
                .map_err(io(format!("binding {}", a.target)))?;
        }
        // The places hold their own copies of the views (see `Engine::create_task`). Dropped
        // off the claim's path: its mountinfo reads and unmounts took 2-3 ms of each claim.
        let (engine, id) = (self.clone(), id.to_string());
        tokio::task::spawn_blocking(move || engine.drop_host_mounts(&id));
        Ok(())
    }
}
