//! Creating a container: its user-namespace range, remapped rootfs and run directory, the
//! lease that holds its snapshot until Containers.Create, its task and host mounts.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::agent::Agent;
use super::*;
use crate::containerd::{self as client, Containerd, CtdError, LEASE_EXPIRE_LABEL};
use crate::image;
use crate::owner::owner_id;
use crate::runtime::RuntimeError;
use crate::runtime::{janitor, late};
use crate::spec::{self, RunPlan};

impl Engine {
    /// Take a user-namespace range for container `id`, recorded in its run directory.
    fn allocate_range(&self, id: &str) -> Result<spec::IdRange, RuntimeError> {
        let io = |source| RuntimeError::Io {
            what: "allocating a user-namespace range".into(),
            source,
        };
        let range = self
            .leases
            .allocate(&self.state_dir(), &self.containerd_name(), id)
            .map_err(io)?;
        if let Err(e) = std::fs::write(
            self.run_dir.join(id).join(remap::RANGE_FILE),
            range.host_base.to_string(),
        ) {
            // Unrecorded, the range would be given back by nothing but gc once this process
            // is gone: now, and at the open-files limit (where the write most likely failed)
            // by the janitor. A blocking wait on this failure path only.
            let (leases, id) = (self.leases.clone(), id.to_string());
            if let Err(e) = janitor::or_at_the_wall(move || leases.release(range, &id)) {
                tracing::warn!(error = %e, "could not give back the user-namespace range of a failed create");
            }
            return Err(io(e));
        }
        Ok(range)
    }

    /// The range `allocate_range` recorded for container `id` (`None`: it has none, or its
    /// record could not be read).
    pub(super) fn recorded_range(&self, id: &str) -> Option<spec::IdRange> {
        read_range(&self.run_dir.join(id)).ok().flatten()
    }

    /// Container `id`'s directories, as plain data for its cleanup (see `RunDir`).
    pub(super) fn run_dir_of(&self, id: &str) -> RunDir {
        RunDir {
            id: id.to_string(),
            dir: self.run_dir.join(id),
            root: self.root_dir(id),
            net: self.options.net.clone(),
            leases: self.leases.clone(),
        }
    }

    /// What `create` needs before containerd: the user-namespace range, the stdin file of a
    /// one-shot task, the spec, and with a range, the spec's rootfs path and the idmapped
    /// views of the workspace.
    pub(super) fn prepare_created(
        &self,
        id: &str,
        plan: &mut RunPlan,
        one_shot: bool,
        shape: Option<&pool::Shape>,
    ) -> Result<oci_spec::runtime::Spec, RuntimeError> {
        let io = |what: &str| {
            let what = what.to_string();
            move |source| RuntimeError::Io { what, source }
        };
        if !plan.env().host_users {
            plan.userns = Some(self.allocate_range(id)?);
        }
        // The run directory will hold the rootfs and workspace views while the container is
        // made: only root and the container's own root (which runc's init is while it mounts)
        // may enter it.
        let run = self.run_dir.join(id);
        let owner = plan.userns.map(|r| r.host_id(0));
        std::os::unix::fs::chown(&run, owner, owner)
            .and_then(|()| std::fs::set_permissions(&run, std::os::unix::fs::PermissionsExt::from_mode(0o700)))
            .map_err(io("closing the run directory"))?;
        let (uid, gid) = spec::container_user(plan.env(), &self.host);
        // A live container's init reads nothing (each command gets its own stdin); a one-shot
        // task reads the job's stdin from a file we mount (see `entry::compose`).
        let stdin = plan.bound.job.stdin.take();
        if let (true, Some(data)) = (one_shot, stdin) {
            let (host_uid, host_gid) = match plan.userns {
                Some(range) => (range.host_id(uid), range.host_id(gid)),
                None => (uid, gid),
            };
            plan.stdin_file = Some(write_stdin_file(
                &self.run_dir.join(id),
                data.as_bytes(),
                host_uid,
                host_gid,
            )?);
            plan.bound.job.stdin = Some(data);
        }
        let mut built = match shape {
            Some(shape) => pool::member_spec(plan, &self.host, &shape.layout, &self.late_dir(id))?,
            None => spec::build(plan, &self.host).map_err(|e| RuntimeError::Refused(e.to_string()))?,
        };
        let run = self.run_dir.join(id);
        if let Some(range) = plan.userns {
            // The rootfs lives outside the state dir: runc's init, already the container's
            // root, binds it by path, so every directory above it must be open to that id (a
            // state dir under a 0700 home or mktemp directory is not). Only its own directory
            // is closed.
            let root_dir = self.root_dir(id);
            std::fs::create_dir_all(root_dir.parent().unwrap_or(&root_dir))
                .and_then(|()| std::fs::create_dir(&root_dir))
                .and_then(|()| std::os::unix::fs::chown(&root_dir, Some(range.host_id(0)), Some(range.host_id(0))))
                .and_then(|()| std::fs::set_permissions(&root_dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)))
                .map_err(io("making the rootfs directory"))?;
            let root = oci_spec::runtime::RootBuilder::default()
                .path(root_dir.join(remap::ROOTFS_DIR))
                .readonly(false)
                .build()
                .map_err(|e| RuntimeError::Internal(format!("root: {e}")))?;
            built.set_root(Some(root));
        }
        if let Some(workspace) = &plan.workspace {
            let ids = match plan.userns {
                Some(range) => Some(remap::ViewIds {
                    owner: remap::workspace_owner(workspace).map_err(io("reading the workspace's owner"))?,
                    user: (uid, gid),
                    range,
                }),
                None => None,
            };
            let mut mounts = built.mounts().clone().unwrap_or_default();
            let binds: Vec<(usize, PathBuf, bool)> = mounts
                .iter()
                .enumerate()
                .filter(|(_, m)| m.typ().as_deref() == Some("bind"))
                .filter_map(|(i, m)| {
                    let read_only = m.options().as_ref().is_some_and(|o| o.iter().any(|x| x == "ro"));
                    Some((i, m.source().clone()?, read_only))
                })
                .collect();
            for (i, view) in remap::workspace_views(&run, workspace, &binds, ids).map_err(view_error)? {
                mounts[i].set_source(Some(view));
            }
            built.set_mounts(Some(mounts));
        }
        Ok(built)
    }

    /// Tasks.Create, then the host's copies of a remapped rootfs and of workspace views are
    /// unmounted: the container's mount namespace holds its own, and while they stay on the
    /// host anything removing the state dir would reach through them (a view is the user's
    /// workspace). The unmounts run beside Tasks.Start: `start_task` waits for them.
    pub(super) async fn create_task(
        &self,
        made: &Created,
        stdio: &client::Stdio,
    ) -> Result<(u32, HostMounts), CtdError> {
        let id = made.id.as_str();
        // runc moves the init into its cgroups in there (see `attach_lock`); the warming
        // began with the create (`Created::warm`) and ends with Tasks.Create.
        let warm = attach_lock::hold();
        // From here its warm shim's seed is spent, even should this call be dropped midway.
        if let Some(seed) = made.shim_seed.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            seed.sent();
        }
        let created = self.client.task_create(id, made.rootfs.clone(), stdio).await;
        drop(warm);
        made.warmed();
        // Spent: deleted, and a new one made, when the server is quiet.
        drop(made.shim_seed.lock().unwrap_or_else(|e| e.into_inner()).take());
        let dropping = HostMounts({
            let (engine, id) = (self.clone(), id.to_string());
            tokio::task::spawn_blocking(move || engine.drop_host_mounts(&id))
        });
        match created {
            Ok(pid) => Ok((pid, dropping)),
            Err(e) => {
                dropping.wait().await;
                Err(e)
            }
        }
    }

    /// Tasks.Start of a task `create_task` made, once its host mounts are gone too.
    pub(super) async fn start_task(&self, id: &str, mounts: HostMounts) -> Result<u32, CtdError> {
        let (started, ()) = tokio::join!(self.client.task_start(id, ""), mounts.wait());
        started
    }

    /// The rootfs directory itself stays: runc starts every exec's helper with the rootfs
    /// path as its working directory (empty is enough; the helper then enters the
    /// container's mount namespace).
    ///
    /// At the open-files limit (a create that found the last descriptors) the unmounting
    /// is done by the janitor: left mounted, the rootfs and views would stay on the host for
    /// the container's life. Blocks (the blocking pool).
    pub(super) fn drop_host_mounts(&self, id: &str) {
        let (rootfs, views) = (
            self.root_dir(id).join(remap::ROOTFS_DIR),
            self.run_dir.join(id).join(remap::VIEWS_DIR),
        );
        let unmounted =
            janitor::or_at_the_wall(move || late::unmount_all(&rootfs).and_then(|()| late::release(&views)));
        if let Err(e) = unmounted {
            tracing::warn!(container = id, error = %e, "could not unmount the container's host mounts");
        }
    }

    /// Give back container `id`'s range (if it has one) and remove its run directory:
    /// everything mounted there first (its rootfs, workspace views), and never crossing a
    /// mount point that would not go. On the blocking pool, and at the open-files limit on
    /// the janitor (`RunDir::discard`).
    /// `release_range`: false when the container may still run (its task or record would not
    /// go): its range then stays leased until gc finds the container gone.
    pub(super) async fn discard_run_dir(&self, id: &str, release_range: bool) -> Result<(), RuntimeError> {
        let dirs = self.run_dir_of(id);
        janitor::blocking(move || dirs.discard(release_range))
            .await
            .map_err(|source| RuntimeError::Io {
                what: format!("removing the run directory of {id}"),
                source,
            })
    }

    /// With shim groups (`RuntimeOptions::shim_groups`), a cold live container's group,
    /// named in its spec's annotations. Pool members and restored containers keep a shim of
    /// their own: a member outlives this server's groups, a restore is CRIU's own path.
    async fn shim_group(
        &self,
        id: &str,
        plan: &RunPlan,
        image: &image::ImageInfo,
        kind: &str,
        shape: Option<&pool::Shape>,
        built: &mut oci_spec::runtime::Spec,
    ) -> Option<shim_group::Ticket> {
        let groups = self.options.shim_groups.as_ref()?;
        if kind != "live" || shape.is_some() || plan.restore.is_some() {
            return None;
        }
        let key = shim_group::ShimGroups::key(plan.env(), &image.name, &image.top_chain);
        let ticket = groups.join(&key, id).await;
        let mut annotations = built.annotations().clone().unwrap_or_default();
        annotations.insert(shim_group::GROUP_ANNOTATION.to_string(), ticket.group.clone());
        built.set_annotations(Some(annotations));
        Some(ticket)
    }

    /// Create a container's run directory (FIFOs, stdin, agent, logger output) marked with its
    /// owner: a runner's gc removes run directories without a container only when their owner
    /// is gone, never one a live runner is filling before its container exists.
    async fn claim_run_dir(&self, id: &str) -> Result<(), RuntimeError> {
        let dir = self.run_dir.join(id);
        let made = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(dir.join(RUN_DIR_OWNER), owner_id()));
        if let Err(source) = made {
            // Made but not marked (the mark's write found no descriptor, say), the directory
            // would be kept by gc for ten minutes as one an older runner may be filling: it
            // goes now.
            let gone = dir.clone();
            if let Err(e) = janitor::cleanup(move || late::release(&gone)).await {
                tracing::warn!(dir = %dir.display(), error = %e, "could not remove the run directory of a failed create");
            }
            return Err(RuntimeError::Io {
                what: format!("creating {}", dir.display()),
                source,
            });
        }
        Ok(())
    }

    /// Build the spec for a plan against the image, create container + snapshot under a lease.
    /// `image`: already resolved (by a pool claim that found no member); `with_agent`: share
    /// an agent directory with the container (live containers).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn create(
        &self,
        plan: &RunPlan,
        image: Option<image::ImageInfo>,
        args: Option<Vec<String>>,
        kind: &str,
        with_agent: bool,
        shape: Option<&pool::Shape>,
    ) -> Result<Created, RuntimeError> {
        let env = plan.env();
        let image_name = env
            .image
            .clone()
            .ok_or_else(|| RuntimeError::Refused("spec.image is required".into()))?;
        let image = match image {
            Some(image) => image,
            None => {
                let t0 = Instant::now();
                let image =
                    image::remote::ensure(&self.client, &image_name, env.image_pull_policy, &self.options.registry)
                        .await?;
                tracing::debug!(ms = t0.elapsed().as_secs_f64() * 1e3, "image resolved");
                image
            }
        };
        self.seed_workspace(image.workspace.as_deref(), plan).await?;
        let mut plan = plan.clone();
        plan.image_env = image.config.env.clone().unwrap_or_default();
        let id = container_id(&plan.job().name);
        // runc's move of the init into its cgroups, inside Tasks.Create, finds the kernel's
        // lock warm only if the warmer's own first write after an idle moment, which pays the
        // grace period itself (5-25 ms measured here), is over by then: so the warming
        // starts here, runner's own steps ahead of Tasks.Create, not at it. A restore's
        // Tasks.Create (CRIU's) comes much later and warms for itself.
        let warm = plan.restore.is_none().then(attach_lock::hold);
        self.claim_run_dir(&id).await?;
        let mut lease = CreateLease::take(&self.client, &format!("{id}-create"), self.labels(&plan, kind));
        let created = self
            .create_in(&id, plan, &image, &mut lease, args, kind, with_agent, shape)
            .await;
        if let Ok(created) = &created {
            *created.warm.lock().unwrap_or_else(|e| e.into_inner()) = warm;
        }
        match &created {
            Ok(_) => lease.release_later(),
            Err(_) => {
                // Whatever step failed, one way out: nothing of it stays (NotFound is success).
                // The host's part runs on the blocking pool and, should it find no descriptor
                // (a create refused at the open-files limit), again on the janitor: the refused
                // create gives back everything at once, not when gc finds it.
                // A remapped rootfs may be mounted from the snapshot: off first.
                let rootfs = self.root_dir(&id).join(remap::ROOTFS_DIR);
                if let Err(e) = janitor::cleanup(move || late::unmount_all(&rootfs)).await {
                    tracing::warn!(container = id, error = %e, "could not unmount the rootfs of a failed create");
                }
                let (snapshot, container) = (
                    self.client.snapshot_remove(&id).await,
                    self.client.container_delete(&id).await,
                );
                for e in [snapshot.err(), container.err()].into_iter().flatten() {
                    if !e.is_not_found() {
                        tracing::warn!(container = id, error = %e, "could not remove what a failed create made in containerd");
                    }
                }
                lease.release().await;
                let late_dir = self.late_dir(&id);
                if let Err(e) = janitor::cleanup(move || late::release(&late_dir)).await {
                    tracing::warn!(container = id, error = %e, "could not release the late binds of a failed create");
                }
                if let Err(e) = self.discard_run_dir(&id, true).await {
                    tracing::warn!(container = id, error = %e, "could not remove the run directory of a failed create");
                }
            }
        }
        created
    }

    #[allow(clippy::too_many_arguments)]
    async fn create_in(
        &self,
        id: &str,
        mut plan: RunPlan,
        image: &image::ImageInfo,
        lease: &mut CreateLease,
        args: Option<Vec<String>>,
        kind: &str,
        with_agent: bool,
        shape: Option<&pool::Shape>,
    ) -> Result<Created, RuntimeError> {
        let id = id.to_string();
        let t0 = Instant::now();
        let mut built = self.prepare_created(&id, &mut plan, args.is_none(), shape)?;
        tracing::debug!(ms = t0.elapsed().as_secs_f64() * 1e3, "spec, range and views prepared");
        // The bridge attach (namespaces, CNI ADD, the wall) runs beside containerd's snapshot
        // and container creation: what the spec needs of it (the namespaces' pins, the
        // network's name files) has known paths. It is always awaited before this returns.
        let mut attaching = None;
        if plan.bound.network == crate::manifest::NetworkMode::Bridge {
            let t1 = Instant::now();
            // Beside the rootfs, not in the state dir: a state dir removed while the container
            // runs must not take the pins (and with them the way to DEL) along.
            let dir = self.root_dir(&id).join(crate::net::NET_DIR);
            let egress = crate::net::Egress {
                cidrs: plan.env().egress_allow.clone(),
                domains: plan.env().egress_domains.clone(),
                upstream: self.options.dns_upstream.clone(),
            };
            let (range, cid) = (plan.userns, id.clone());
            let (name, ports) = (plan.job().name.clone(), plan.env().ports.clone());
            let net = crate::net::Net::of(plan.bound.bridge.as_ref());
            let exe = self.runner_exe("the resolver")?;
            let pinned = crate::net::pin_paths(&dir, range);
            let layer = crate::net::Host::new(self.options.net.clone());
            let (hosts_file, resolv_file) = layer.files(&net);
            join_namespaces(&mut built, &pinned);
            attaching = Some((
                t1,
                tokio::task::spawn_blocking(move || {
                    let t = Instant::now();
                    let pinned = crate::net::pin_namespaces(&dir, range)?;
                    let attached = layer.attach(&crate::net::AttachRequest {
                        dir,
                        id: cid,
                        name,
                        pinned,
                        egress,
                        ports,
                        exe,
                        net,
                    });
                    tracing::debug!(ms = t.elapsed().as_secs_f64() * 1e3, "bridge attach");
                    attached
                }),
            ));
            // The network's names and resolvers, read-only (the files change as containers
            // come and go; the container sees each change).
            let mut mounts = built.mounts().clone().unwrap_or_default();
            for (source, target) in [(&hosts_file, "/etc/hosts"), (&resolv_file, "/etc/resolv.conf")] {
                mounts.push(
                    oci_spec::runtime::MountBuilder::default()
                        .destination(target)
                        .typ("bind")
                        .source(source)
                        .options(
                            ["bind", "nosuid", "nodev", "noexec", "rprivate", "ro"]
                                .iter()
                                .map(|o| o.to_string())
                                .collect::<Vec<_>>(),
                        )
                        .build()
                        .map_err(|e| RuntimeError::Internal(format!("{target} mount: {e}")))?,
                );
            }
            built.set_mounts(Some(mounts));
        }
        let made = self
            .create_rest(&id, &plan, image, lease, built, args, kind, with_agent, shape)
            .await;
        let Some((t1, attaching)) = attaching else {
            return made;
        };
        let attached = attaching
            .await
            .map_err(|e| RuntimeError::Internal(format!("the network setup task: {e}")))
            .and_then(|a| {
                a.map_err(|e| RuntimeError::Io {
                    what: "attaching to the bridge network".into(),
                    source: std::io::Error::other(e),
                })
            });
        let (mut made, attached) = (made?, attached?);
        tracing::debug!(ms = t1.elapsed().as_secs_f64() * 1e3, ip = %attached.ip, "attached to the bridge network");
        let status = crate::runtime::NetworkStatus {
            ip: attached.ip.clone(),
            ports: attached.ports.clone(),
        };
        if let Some(hook) = &self.options.on_network {
            (hook.0)(&status);
        }
        made.network = Some(status);
        Ok(made)
    }

    /// `create_in` after the network: the cgroup, the agent and tools, the snapshot and the
    /// container in containerd, the rootfs.
    #[allow(clippy::too_many_arguments)]
    async fn create_rest(
        &self,
        id: &str,
        plan: &RunPlan,
        image: &image::ImageInfo,
        lease: &mut CreateLease,
        mut built: oci_spec::runtime::Spec,
        args: Option<Vec<String>>,
        kind: &str,
        with_agent: bool,
        shape: Option<&pool::Shape>,
    ) -> Result<Created, RuntimeError> {
        let id = id.to_string();
        // The remapped rootfs's user namespace is made beside what follows (the agent's
        // files, the lease, containerd's snapshot): only its mounts need the snapshot.
        let rootfs_namespace = plan
            .userns
            .map(|range| tokio::task::spawn_blocking(move || remap::rootfs_namespace(range)));
        let cgroup = self.cgroup_path(&id);
        if let Some(linux) = built.linux_mut() {
            linux.set_cgroups_path(Some(PathBuf::from(&cgroup)));
        }
        if let (Some(args), Some(process)) = (args, built.process_mut()) {
            process.set_args(Some(args));
        }
        let agent = if with_agent {
            let user = built
                .process()
                .as_ref()
                .map(|p| (p.user().uid(), p.user().gid()))
                .unwrap_or((0, 0));
            let user = match plan.userns {
                Some(range) => (range.host_id(user.0), range.host_id(user.1)),
                None => user,
            };
            let agent = Agent::create(&self.run_dir.join(&id).join("agent"), user.0, user.1)?;
            if plan.restore.is_some() {
                let (plan, dir) = (plan.clone(), agent.dir().to_path_buf());
                tokio::task::spawn_blocking(move || checkpoint::fill_agent(&plan, &dir, checkpoint::AGENT_LIMITS))
                    .await
                    .map_err(|e| RuntimeError::Internal(format!("restoring the agent directory: {e}")))??;
            }
            let mount = oci_spec::runtime::MountBuilder::default()
                .destination(agent::AGENT_MOUNT)
                .typ("bind")
                .source(agent.dir())
                .options(
                    ["rbind", "nosuid", "nodev", "noexec", "rprivate", "rw"]
                        .iter()
                        .map(|o| o.to_string())
                        .collect::<Vec<_>>(),
                )
                .build()
                .map_err(|e| RuntimeError::Internal(format!("agent mount: {e}")))?;
            let mut mounts = built.mounts().clone().unwrap_or_default();
            mounts.push(mount);
            // Programs the caller ships into sandboxes (the session's Python driver), read-only.
            if !self.options.tools.is_empty() {
                let tools = self.run_dir.join(&id).join("tools");
                std::fs::create_dir_all(&tools)
                    .and_then(|()| {
                        self.options
                            .tools
                            .iter()
                            .try_for_each(|t| std::fs::write(tools.join(t.name), t.contents))
                    })
                    .map_err(|source| RuntimeError::Io {
                        what: "writing the sandbox tools".into(),
                        source,
                    })?;
                let tools_mount = oci_spec::runtime::MountBuilder::default()
                    .destination(TOOLS_MOUNT)
                    .typ("bind")
                    .source(&tools)
                    .options(
                        ["rbind", "nosuid", "nodev", "rprivate", "ro"]
                            .iter()
                            .map(|o| o.to_string())
                            .collect::<Vec<_>>(),
                    )
                    .build()
                    .map_err(|e| RuntimeError::Internal(format!("tools mount: {e}")))?;
                mounts.push(tools_mount);
            }
            built.set_mounts(Some(mounts));
            Some(agent)
        } else {
            None
        };
        if plan.restore.is_some() && plan.userns.is_some() {
            checkpoint::bind_sources_for_restore(&self.run_dir.join(&id), &self.root_dir(&id), &mut built)?;
        }
        let process = built
            .process()
            .clone()
            .ok_or_else(|| RuntimeError::Refused("spec without process".into()))?;
        let shim_group = self.shim_group(&id, plan, image, kind, shape, &mut built).await;
        // Without a group of its own, a cold create takes a shim started ahead (pool members
        // are made off the path; a restore is CRIU's Tasks.Create).
        let shim_seed = if shim_group.is_none() && shape.is_none() && plan.restore.is_none() {
            self.take_seed(&mut built)
        } else {
            None
        };
        let spec_json =
            serde_json::to_vec(&built).map_err(|e| RuntimeError::Refused(format!("encoding the spec: {e}")))?;
        let labels = self.labels(plan, kind);
        // A member's container belongs to its pool; its lease and snapshot stay this
        // process's while it makes them (gc must not take them from a filler at work).
        let mut container_labels = labels.clone();
        if let Some(shape) = shape {
            container_labels.extend([
                (LABEL_OWNER.to_string(), pool::POOL_OWNER.to_string()),
                (pool::LABEL_POOL.to_string(), shape.pool.clone()),
                (pool::LABEL_POOL_KEY.to_string(), shape.key.clone()),
            ]);
            if let Err(source) = late::prepare(&self.late_dir(&id), &shape.layout, plan.userns.map(|r| r.host_id(0))) {
                return Err(RuntimeError::Io {
                    what: "preparing the member's late binds".into(),
                    source,
                });
            }
        }
        lease.held().await?;
        let create_began = Instant::now();
        // The snapshot and the container's record go to containerd at once (the lease keeps
        // the snapshot until the record exists); a failure of either is undone by `create`.
        let (userns, root_dir) = (plan.userns, self.root_dir(&id));
        let prepared = async {
            let mounts = self
                .client
                .snapshot_prepare(&lease.name, &id, &image.top_chain, labels.clone())
                .await?;
            let upper = remap::writable_layer(&mounts);
            if let (Some(_), Some(upper)) = (&plan.restore, &upper) {
                let (plan, upper) = (plan.clone(), upper.clone());
                tokio::task::spawn_blocking(move || checkpoint::fill_rootfs(&plan, &upper, checkpoint::RESTORE_LIMITS))
                    .await
                    .map_err(|e| RuntimeError::Internal(format!("restoring the sandbox's files: {e}")))??;
            }
            if upper.is_none() {
                tracing::warn!(
                    container = id,
                    "its snapshot has no writable layer runner can measure (not an overlay or bind mount): its rootfs writes are not counted in ephemeralStorage"
                );
            }
            // With a user namespace runner mounts the rootfs itself (see `remap`); the task is
            // then created without rootfs mounts.
            let (Some(range), Some(namespace)) = (userns, rootfs_namespace) else {
                return Ok((mounts, upper));
            };
            let t0 = Instant::now();
            let io = |source| RuntimeError::Io {
                what: "mounting the remapped rootfs".into(),
                source,
            };
            let joined =
                |e: tokio::task::JoinError| RuntimeError::Internal(format!("mounting the remapped rootfs: {e}"));
            let namespace = namespace.await.map_err(joined)?.map_err(io)?;
            // Mounts (a process's worth of system calls, 1-3 ms) on the blocking pool, not on
            // a thread that serves every other sandbox's requests.
            let mounted =
                tokio::task::spawn_blocking(move || remap::mount_rootfs(&mounts, &root_dir, range, namespace))
                    .await
                    .map_err(joined)?;
            tracing::debug!(ms = t0.elapsed().as_secs_f64() * 1e3, "remapped rootfs mounted");
            mounted.map(|_| (Vec::new(), upper)).map_err(io)
        };
        let recorded = self
            .client
            .container_create(&lease.name, &id, &image.name, spec_json, container_labels);
        let (rootfs, recorded) = tokio::join!(prepared, recorded);
        crate::metrics::observe(OPERATION_SECONDS, &[("op", "create")], create_began.elapsed());
        tracing::debug!(
            ms = create_began.elapsed().as_secs_f64() * 1e3,
            "snapshot and container created"
        );
        let (rootfs, upper) = rootfs?;
        recorded?;
        Ok(Created {
            id,
            rootfs,
            upper,
            cgroup,
            process,
            agent,
            network: None,
            shim_group,
            shim_seed: std::sync::Mutex::new(shim_seed),
            warm: std::sync::Mutex::new(None),
        })
    }
}

/// A container's run and rootfs directories and what gives back its range, as plain data:
/// removing them may be done on the janitor's thread, which must be given no descriptor
/// (`runtime::janitor`), so not an `Engine` (its client holds connections).
#[derive(Clone, Debug)]
pub(super) struct RunDir {
    id: String,
    dir: PathBuf,
    root: PathBuf,
    net: crate::config::NetPaths,
    leases: crate::runtime::idmap::Leases,
}

impl RunDir {
    /// Off the bridge network, the rootfs and run directories removed (mounts first), then
    /// the range given back (`release_range`) once nothing with its ids is mounted. Blocks.
    ///
    /// Each step is done again by the janitor should it find no descriptor (see
    /// `runtime::janitor`), so each must be one that can be repeated: the range is read
    /// once, in a step of its own, before the directory holding its record goes (a removal
    /// done again after that would find no record and keep the range leased).
    pub(super) fn discard(&self, release_range: bool) -> std::io::Result<()> {
        let range = match release_range {
            true => {
                let dir = self.dir.clone();
                janitor::or_at_the_wall(move || read_range(&dir))
                    .map_err(janitor::context("reading the user-namespace range"))?
            }
            false => None,
        };
        let dirs = self.clone();
        janitor::or_at_the_wall(move || dirs.remove())?;
        if let Some(range) = range {
            let (leases, id) = (self.leases.clone(), self.id.clone());
            janitor::or_at_the_wall(move || leases.release(range, &id))
                .map_err(janitor::context("giving back the user-namespace range"))?;
        }
        Ok(())
    }

    /// Off the network, then the rootfs and run directories, mounts first: can be repeated
    /// (what is gone counts as done).
    fn remove(&self) -> std::io::Result<()> {
        // Off the network first (CNI DEL while the netns is still pinned); a failure keeps
        // the directory, with what DEL needs, for gc to try again.
        let net = self.root.join(crate::net::NET_DIR);
        if net.exists() {
            crate::net::Host::new(self.net.clone())
                .detach(&net)
                .map_err(janitor::context(format!(
                    "detaching {} from the bridge network",
                    self.id
                )))?;
        }
        late::release(&self.root).map_err(janitor::context(format!("removing {}", self.root.display())))?;
        late::release(&self.dir).map_err(janitor::context(format!("removing {}", self.dir.display())))
    }
}

/// The range recorded in run directory `dir` (`None`: it has none). The file is the host's;
/// read bounded all the same.
fn read_range(dir: &Path) -> std::io::Result<Option<spec::IdRange>> {
    use std::io::Read;
    let mut text = String::new();
    match std::fs::File::open(dir.join(remap::RANGE_FILE)) {
        Ok(f) => f.take(32).read_to_string(&mut text)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    Ok(text
        .trim()
        .parse::<u32>()
        .ok()
        .map(|host_base| spec::IdRange { host_base }))
}

/// Write a one-shot job's stdin to `<dir>/stdin`, readable only by root and the job's user
/// (the container sees it read-only). Written before the container exists: nothing in the
/// sandbox can have planted anything there.
fn write_stdin_file(dir: &Path, data: &[u8], uid: u32, gid: u32) -> Result<PathBuf, RuntimeError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let io = |source| RuntimeError::Io {
        what: "writing the job's stdin".into(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let path = dir.join("stdin");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o400)
        .open(&path)
        .map_err(io)?;
    file.write_all(data).map_err(io)?;
    std::os::unix::fs::fchown(&file, Some(uid), Some(gid)).map_err(io)?;
    Ok(path)
}

pub(super) fn join<T>(r: Result<Result<T, CtdError>, tokio::task::JoinError>) -> Result<T, RuntimeError> {
    match r {
        Ok(inner) => Ok(inner?),
        Err(e) => Err(RuntimeError::Internal(format!("waiting for the task: {e}"))),
    }
}

/// The unmounting of a created task's host mounts (see `Engine::create_task`).
pub(super) struct HostMounts(pub(super) tokio::task::JoinHandle<()>);

impl HostMounts {
    pub(super) async fn wait(self) {
        if let Err(e) = self.0.await {
            tracing::warn!(error = %e, "unmounting a container's host mounts failed");
        }
    }
}

/// The lease that keeps a fresh snapshot from containerd's garbage collection until the
/// container that references it exists. It is taken beside the spec's preparation and
/// given back off the caller's path: neither wait is worth a cold start's time. Dropped
/// unreleased (a create cancelled midway), it is given back in the background.
pub(super) struct CreateLease {
    pub(super) name: String,
    pub(super) client: Containerd,
    pub(super) taking: Option<tokio::task::JoinHandle<Result<(), CtdError>>>,
    pub(super) released: bool,
}

impl CreateLease {
    pub(super) fn take(client: &Containerd, name: &str, mut labels: HashMap<String, String>) -> Self {
        // Should this process die before giving it back, the lease goes by itself.
        let expire = std::time::SystemTime::now() + CREATE_LEASE_TTL;
        labels.insert(
            LEASE_EXPIRE_LABEL.into(),
            humantime::format_rfc3339_seconds(expire).to_string(),
        );
        let taking = {
            let (client, name) = (client.clone(), name.to_string());
            tokio::spawn(async move { client.lease_create(&name, labels).await })
        };
        CreateLease {
            name: name.to_string(),
            client: client.clone(),
            taking: Some(taking),
            released: false,
        }
    }

    /// Wait until containerd holds it.
    pub(super) async fn held(&mut self) -> Result<(), RuntimeError> {
        match self.taking.take() {
            Some(taking) => taking
                .await
                .map_err(|e| RuntimeError::Internal(format!("taking the create lease: {e}")))?
                .map_err(RuntimeError::from),
            None => Ok(()),
        }
    }

    /// Give it back now (a create that failed: whatever it held is gone already).
    pub(super) async fn release(mut self) {
        self.released = true;
        let taking = self.taking.take();
        give_back(self.client.clone(), self.name.clone(), taking).await;
    }

    /// Give it back in the background (the container now references its snapshot).
    fn release_later(self) {
        drop(self);
    }
}

impl Drop for CreateLease {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        // Without a runtime (the process is ending) the lease expires by itself.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let taking = self.taking.take();
            runtime.spawn(give_back(self.client.clone(), self.name.clone(), taking));
        }
    }
}

/// Delete a create lease once its creation (if still in flight) is over: a delete that
/// overtook the create would leave the lease behind.
async fn give_back(client: Containerd, name: String, taking: Option<tokio::task::JoinHandle<Result<(), CtdError>>>) {
    if let Some(taking) = taking {
        let _ = taking.await;
    }
    if let Err(e) = client.lease_delete(&name).await {
        tracing::warn!(lease = name, error = %e, "could not delete the create lease (it expires by itself)");
    }
}

pub(super) struct Created {
    pub(super) id: String,
    pub(super) rootfs: Vec<containerd_client::types::Mount>,
    /// Where its rootfs writes land (its snapshot's upper directory).
    pub(super) upper: Option<PathBuf>,
    pub(super) cgroup: String,
    pub(super) process: oci_spec::runtime::Process,
    pub(super) agent: Option<Agent>,
    /// What it got on a bridge network.
    pub(super) network: Option<crate::runtime::NetworkStatus>,
    /// The shim group it joins with its task (`None`: a shim of its own).
    pub(super) shim_group: Option<shim_group::Ticket>,
    /// The warm shim it was given (`shim_seed`): spent once its Tasks.Create was tried.
    pub(super) shim_seed: std::sync::Mutex<Option<super::shim_seed::SeedTicket>>,
    /// The cgroup attach warming held from the create's start until its Tasks.Create is
    /// over (`Engine::create_task`); should the task never be created, until this goes.
    pub(super) warm: std::sync::Mutex<Option<attach_lock::Hold>>,
}

impl Created {
    /// Its Tasks.Create is over: the warming it held may stop.
    pub(super) fn warmed(&self) {
        self.warm.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

/// A workspace bind that could not be given its view: refused when the workspace no longer
/// holds what the job names (the sandbox's doing), else the host's failure — with its
/// `io::Error` kept as the source, so an `EMFILE` on the way answers 503 with the limit, not
/// 500 (the CI run of 643f202 failed on an `open_tree` at the wall flattened to a string).
pub(super) fn view_error(e: remap::ViewError) -> RuntimeError {
    match e {
        remap::ViewError::Resolve(ref c) if c.is_client_error() => RuntimeError::Refused(e.to_string()),
        remap::ViewError::Resolve(c) => RuntimeError::Io {
            what: "mount source in the workspace".into(),
            source: std::io::Error::other(c),
        },
        remap::ViewError::Mount { what, source } => RuntimeError::Io {
            what: format!("mounting {what}"),
            source,
        },
    }
}

/// Name the pinned namespaces in the spec: runc joins them instead of making its own.
fn join_namespaces(spec: &mut oci_spec::runtime::Spec, pinned: &crate::net::Pinned) {
    use oci_spec::runtime::LinuxNamespaceType;
    let Some(linux) = spec.linux_mut() else {
        return;
    };
    let mut namespaces = linux.namespaces().clone().unwrap_or_default();
    for ns in namespaces.iter_mut() {
        match ns.typ() {
            LinuxNamespaceType::Network => {
                ns.set_path(Some(pinned.netns.clone()));
            }
            LinuxNamespaceType::User if pinned.userns.is_some() => {
                ns.set_path(pinned.userns.clone());
            }
            _ => {}
        }
    }
    linux.set_namespaces(Some(namespaces));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A workspace view that fails for want of a descriptor (its `open_tree`, or opening
    /// the workspace to resolve beneath it) is the host's capacity: 503 with the limit, as
    /// every other `EMFILE` on the create path; a source the sandbox moved away is refused.
    #[test]
    fn a_view_refused_at_the_open_files_wall_keeps_its_errno() {
        let emfile = || std::io::Error::from_raw_os_error(libc::EMFILE);
        let mount = view_error(remap::ViewError::Mount {
            what: "workspace path ".into(),
            source: emfile(),
        });
        let resolve = view_error(remap::ViewError::Resolve(crate::confined::ConfinedError::Io {
            op: "open",
            path: "/w".into(),
            source: emfile(),
        }));
        // What the service looks for to answer 503 (`ServiceError::internal`).
        for e in [mount, resolve] {
            assert_eq!(
                crate::runtime::janitor::out_of_files(&e),
                Some(nix::errno::Errno::EMFILE),
                "{e}"
            );
        }
        let moved = view_error(remap::ViewError::Resolve(crate::confined::ConfinedError::NotFound {
            path: "a".into(),
        }));
        assert!(matches!(moved, RuntimeError::Refused(_)), "{moved}");
    }

    /// A container's run and rootfs directories are removed and its range given back by a
    /// thread with no descriptor left (the cleanup of a create refused at the open-files
    /// limit): each step is done again by the janitor, the range read once before its record
    /// goes.
    #[test]
    fn a_run_dir_is_discarded_at_the_open_files_limit() {
        let tmp = tempfile::tempdir().unwrap();
        let leases = crate::runtime::idmap::Leases::at(&tmp.path().join("userns"));
        let range = leases.allocate(Path::new("/state"), "ctd", "c1").unwrap();
        let dir = tmp.path().join("run/c1");
        std::fs::create_dir_all(dir.join("agent/req-0")).unwrap();
        std::fs::write(dir.join("agent/req-0/out"), "x").unwrap();
        std::fs::write(dir.join(remap::RANGE_FILE), range.host_base.to_string()).unwrap();
        std::fs::write(dir.join(RUN_DIR_OWNER), owner_id()).unwrap();
        let root = tmp.path().join("rootfs/c1");
        std::fs::create_dir_all(root.join(remap::ROOTFS_DIR)).unwrap();
        let run_dir = RunDir {
            id: "c1".into(),
            dir: dir.clone(),
            root: root.clone(),
            net: crate::config::NetPaths::default(),
            leases: leases.clone(),
        };
        let discarded = std::thread::spawn(move || {
            let held = crate::runtime::janitor::testing::fill_own_table();
            // Nothing works on this thread itself.
            assert!(std::fs::File::open("/dev/null").is_err());
            let discarded = run_dir.discard(true);
            drop(held);
            discarded
        })
        .join()
        .unwrap();
        discarded.expect("discarded at the open-files limit");
        assert!(!dir.exists(), "the run directory is left");
        assert!(!root.exists(), "the rootfs directory is left");
        assert!(
            leases.held(Path::new("/state")).unwrap().is_empty(),
            "the range is still leased"
        );
    }

    /// The warming a create takes at its start ends with its Tasks.Create (`warmed`), not
    /// with the container: a one-shot job's `Created` lives as long as the job, and each
    /// warming write holds off forks host-wide.
    #[test]
    fn a_created_containers_warming_ends_with_its_task_create() {
        attach_lock::configure(crate::config::WarmMode::Off);
        let before = attach_lock::holders();
        let created = Created {
            id: "c".into(),
            rootfs: Vec::new(),
            upper: None,
            cgroup: String::new(),
            process: oci_spec::runtime::Process::default(),
            agent: None,
            network: None,
            shim_group: None,
            shim_seed: std::sync::Mutex::new(None),
            warm: std::sync::Mutex::new(Some(attach_lock::hold())),
        };
        assert_eq!(attach_lock::holders(), before + 1);
        created.warmed();
        assert_eq!(attach_lock::holders(), before, "still warming after Tasks.Create");
        created.warmed();
        assert_eq!(attach_lock::holders(), before);
        drop(created);
        assert_eq!(attach_lock::holders(), before);
    }
}
