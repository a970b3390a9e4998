//! The containerd backend: one-shot jobs (one task: setup + command) and live containers
//! (an idle init, commands through Tasks.Exec), both on the hardened spec of `spec::build`.
//!
//! Order of operations follows docs/containerd-notes.md: a lease from Snapshots.Prepare to
//! Containers.Create; stdio FIFO read ends open before Tasks.Create; Wait issued before Start;
//! cgroup counters read before Tasks.Delete; teardown kill → wait → Tasks.Delete →
//! Snapshots.Remove → Containers.Delete, NotFound counting as done.

pub mod agent;
pub mod attach_lock;
mod io;
pub mod logger;
pub mod pool;
pub mod remap;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use nix::sys::signal::Signal;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use self::agent::{AGENT_SCRIPT, Agent};
use self::io::{Fifos, OutputPump};
use super::cgroupfs;
use super::idmap;
use super::late;
use super::storage::{StorageMonitor, StorageWatch, Tree as StorageTree};
use super::{ExecRequest, ExecResult, ProcessState, Runtime, RuntimeError, RuntimeEvent, RuntimeOptions, SetupResult};
use crate::containerd::{self as client, Containerd, CtdError, LEASE_EXPIRE_LABEL};
use crate::image;
use crate::owner::owner_id;
use crate::spec::{self, HostEnv, RunPlan};

/// Label on everything runner creates in containerd (containers, snapshots, leases).
pub const LABEL_MANAGED: &str = "runner.dev/managed";
/// Which runner process owns it: `<pid>:<process start time>`, checked by `runner gc`.
pub const LABEL_OWNER: &str = "runner.dev/owner";
/// The job (or session) it belongs to.
pub const LABEL_JOB: &str = "runner.dev/job";
/// `oneshot` or `live`.
pub const LABEL_KIND: &str = "runner.dev/kind";
/// A Job attempt's completion index and attempt number (for re-adoption).
pub const LABEL_INDEX: &str = "runner.dev/index";
pub const LABEL_ATTEMPT: &str = "runner.dev/attempt";
/// The state directory (job store) of the runner that created it: only that store can tell
/// whether a Job attempt whose runner died is waiting to be re-adopted.
pub const LABEL_STATE_DIR: &str = "runner.dev/state-dir";
/// Where live containers see the programs runner ships (read-only).
pub const TOOLS_MOUNT: &str = "/.runner-tools";
/// The metric of the containerd operations' latencies (create, start, exec).
const OPERATION_SECONDS: &str = "runner_container_operation_seconds";
/// How long after a session claims a pool member its refill starts (see `spawn_live`).
const REFILL_AFTER_SESSION_CLAIM: Duration = Duration::from_millis(300);
/// What a live container's init runs after setup when commands go through Tasks.Exec.
const KEEPALIVE: &str = "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done";
/// The file in a container's run directory naming the runner process that made it.
pub const RUN_DIR_OWNER: &str = "owner";
/// How long the container lease may outlive a crashed runner.
const CREATE_LEASE_TTL: Duration = Duration::from_secs(600);
/// After the task exited, how long its output may take to reach EOF.
const DRAIN_LIMIT: Duration = Duration::from_secs(5);
/// After an exec exited, how long its output may stay open before background processes it
/// left are assumed to hold it.
const EXEC_DRAIN_LIMIT: Duration = Duration::from_millis(200);
/// How long a Wait may keep failing with Unavailable (containerd restarting) before we give up.
const RECONNECT_LIMIT: Duration = Duration::from_secs(60);
/// How long a SIGKILLed task may take to exit during teardown.
const TEARDOWN_WAIT: Duration = Duration::from_secs(10);
/// `containerd.v1.types.Status.STOPPED`.
const STATUS_STOPPED: i32 = 3;
const SIGTERM: u32 = 15;
const SIGKILL: u32 = 9;

fn container_id(job: &str) -> String {
    format!("{job}-{}", crate::owner::unique_tag())
}

/// The containerd side of the runner: a connection plus where FIFOs live.
#[derive(Clone, Debug)]
pub struct Engine {
    pub client: Containerd,
    /// Directory for per-process FIFOs.
    pub run_dir: PathBuf,
    pub host: HostEnv,
    pub options: RuntimeOptions,
    /// The host's user-namespace ranges.
    pub leases: idmap::Leases,
    /// Measures what sandboxes write (`resources.ephemeralStorage`).
    pub storage: StorageMonitor,
}

impl Engine {
    pub fn new(client: Containerd, state_dir: &Path, host: HostEnv, options: RuntimeOptions) -> Self {
        Engine {
            run_dir: state_dir.join("run"),
            client,
            host,
            leases: idmap::Leases::at(&options.userns_dir),
            options,
            storage: StorageMonitor::default(),
        }
    }

    /// Where container `id`'s remapped rootfs is mounted: a host-wide directory per
    /// containerd (see `prepare_created` for why not the state dir).
    pub fn root_dir(&self, id: &str) -> PathBuf {
        self.roots_dir().join(id)
    }

    /// The directory of this containerd's rootfs directories.
    pub fn roots_dir(&self) -> PathBuf {
        use sha2::Digest;
        let key = hex::encode(&sha2::Sha256::digest(self.containerd_name().as_bytes())[..8]);
        self.options.rootfs_dir.join(key)
    }

    /// Which containerd this engine's containers live in (socket#namespace).
    pub fn containerd_name(&self) -> String {
        format!("{}#{}", self.client.address().display(), self.client.namespace())
    }

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
            let _ = self.leases.release(range, id);
            return Err(io(e));
        }
        Ok(range)
    }

    /// What `create` needs before containerd: the user-namespace range, the stdin file of a
    /// one-shot task, the spec, and with a range, the spec's rootfs path and the idmapped
    /// views of the workspace.
    fn prepare_created(
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
    async fn create_task(
        &self,
        id: &str,
        rootfs: Vec<containerd_client::types::Mount>,
        stdio: &client::Stdio,
    ) -> Result<(u32, HostMounts), CtdError> {
        // runc moves the init into its cgroups in there (see `attach_lock`).
        let warm = attach_lock::hold();
        let created = self.client.task_create(id, rootfs, stdio).await;
        drop(warm);
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
    async fn start_task(&self, id: &str, mounts: HostMounts) -> Result<u32, CtdError> {
        let (started, ()) = tokio::join!(self.client.task_start(id, ""), mounts.wait());
        started
    }

    /// The rootfs directory itself stays: runc starts every exec's helper with the rootfs
    /// path as its working directory (empty is enough; the helper then enters the
    /// container's mount namespace).
    fn drop_host_mounts(&self, id: &str) {
        let run = self.run_dir.join(id);
        let unmounted = late::unmount_all(&self.root_dir(id).join(remap::ROOTFS_DIR))
            .and_then(|()| late::release(&run.join(remap::VIEWS_DIR)));
        if let Err(e) = unmounted {
            tracing::warn!(container = id, error = %e, "could not unmount the container's host mounts");
        }
    }

    /// Give back container `id`'s range (if it has one) and remove its run directory:
    /// everything mounted there first (its rootfs, workspace views), and never crossing a
    /// mount point that would not go.
    /// `release_range`: false when the container may still run (its task or record would not
    /// go): its range then stays leased until gc finds the container gone.
    fn discard_run_dir(&self, id: &str, release_range: bool) -> Result<(), RuntimeError> {
        let dir = self.run_dir.join(id);
        // Off the network first (CNI DEL while the netns is still pinned); a failure keeps
        // the directory, with what DEL needs, for gc to try again.
        let net = self.root_dir(id).join(crate::net::NET_DIR);
        if net.exists() {
            crate::net::Host::new(self.options.net.clone())
                .detach(&net)
                .map_err(|e| RuntimeError::Internal(format!("detaching {id} from the bridge network: {e}")))?;
        }
        let range = std::fs::read_to_string(dir.join(remap::RANGE_FILE))
            .ok()
            .and_then(|t| t.trim().parse::<u32>().ok())
            .map(|host_base| spec::IdRange { host_base });
        let removed = late::release(&self.root_dir(id))
            .and_then(|()| late::release(&dir))
            .map_err(|source| RuntimeError::Io {
                what: format!("removing {}", dir.display()),
                source,
            });
        // A range goes back only once nothing of the container is mounted any more.
        if removed.is_ok()
            && release_range
            && let Some(range) = range
            && let Err(e) = self.leases.release(range, id)
        {
            tracing::warn!(container = id, error = %e, "could not release the user-namespace range");
        }
        removed
    }

    fn labels(&self, plan: &RunPlan, kind: &str) -> HashMap<String, String> {
        let mut labels: HashMap<String, String> = plan.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        labels.extend([
            (LABEL_MANAGED.to_string(), "true".to_string()),
            (LABEL_OWNER.to_string(), owner_id()),
            (LABEL_JOB.to_string(), plan.job().name.clone()),
            (LABEL_KIND.to_string(), kind.to_string()),
            (LABEL_STATE_DIR.to_string(), self.state_dir().display().to_string()),
        ]);
        labels
    }

    /// Create a container's run directory (FIFOs, stdin, agent, logger output) marked with its
    /// owner: a runner's gc removes run directories without a container only when their owner
    /// is gone, never one a live runner is filling before its container exists.
    fn claim_run_dir(&self, id: &str) -> Result<(), RuntimeError> {
        let dir = self.run_dir.join(id);
        std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::write(dir.join(RUN_DIR_OWNER), owner_id()))
            .map_err(|source| RuntimeError::Io {
                what: format!("creating {}", dir.display()),
                source,
            })
    }

    /// The state directory this engine's run dir lives in, as absolute as it can be made.
    pub fn state_dir(&self) -> PathBuf {
        let dir = self.run_dir.parent().unwrap_or(&self.run_dir);
        std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf())
    }

    fn cgroup_path(&self, id: &str) -> String {
        format!("{}/{id}", self.cgroup_parent())
    }

    /// The cgroup every container of this namespace lives under.
    pub fn cgroup_parent(&self) -> String {
        format!("/runner/{}", self.client.namespace())
    }

    /// Build the spec for a plan against the image, create container + snapshot under a lease.
    /// `image`: already resolved (by a pool claim that found no member); `with_agent`: share
    /// an agent directory with the container (live containers).
    #[allow(clippy::too_many_arguments)]
    async fn create(
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
        let mut plan = plan.clone();
        plan.image_env = image.config.env.clone().unwrap_or_default();
        let id = container_id(&plan.job().name);
        self.claim_run_dir(&id)?;
        let mut lease = CreateLease::take(&self.client, &format!("{id}-create"), self.labels(&plan, kind));
        let created = self
            .create_in(&id, plan, &image, &mut lease, args, kind, with_agent, shape)
            .await;
        match &created {
            Ok(_) => lease.release_later(),
            Err(_) => {
                // Whatever step failed, one way out: nothing of it stays (NotFound is success).
                // A remapped rootfs may be mounted from the snapshot: off first.
                let _ = late::unmount_all(&self.root_dir(&id).join(remap::ROOTFS_DIR));
                let _ = self.client.snapshot_remove(&id).await;
                let _ = self.client.container_delete(&id).await;
                lease.release().await;
                let _ = late::release(&self.late_dir(&id));
                let _ = self.discard_run_dir(&id, true);
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
            .and_then(|a| a.map_err(|e| RuntimeError::Internal(format!("attaching to the bridge network: {e}"))));
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

    /// The `runner` binary the shim and the network run (`what` it is for, in the error).
    fn runner_exe(&self, what: &str) -> Result<PathBuf, RuntimeError> {
        match &self.options.logger_binary {
            Some(path) => Ok(path.clone()),
            None => std::env::current_exe().map_err(|source| RuntimeError::Io {
                what: format!("finding the runner binary for {what}"),
                source,
            }),
        }
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
        let process = built
            .process()
            .clone()
            .ok_or_else(|| RuntimeError::Refused("spec without process".into()))?;
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
            if let Err(source) = late::prepare(&self.late_dir(&id), &shape.layout) {
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
            if upper.is_none() {
                tracing::warn!(
                    container = id,
                    "its snapshot has no writable layer runner can measure (not an overlay or bind mount): its rootfs writes are not counted in ephemeralStorage"
                );
            }
            // With a user namespace runner mounts the rootfs itself (see `remap`); the task is
            // then created without rootfs mounts.
            let Some(range) = userns else {
                return Ok((mounts, upper));
            };
            let t0 = Instant::now();
            let mounted = remap::mount_rootfs(&mounts, &root_dir, range);
            tracing::debug!(ms = t0.elapsed().as_secs_f64() * 1e3, "remapped rootfs mounted");
            mounted.map(|_| (Vec::new(), upper)).map_err(|source| RuntimeError::Io {
                what: "mounting the remapped rootfs".into(),
                source,
            })
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
        })
    }

    /// Remove a container and everything it owns, in containerd's order. Errors are logged
    /// and returned after every step was tried.
    pub async fn teardown(&self, id: &str) -> Result<(), RuntimeError> {
        self.teardown_inner(id, false).await
    }

    /// `exited`: the task is known to have exited (we waited for it): skip the kill.
    async fn teardown_inner(&self, id: &str, exited: bool) -> Result<(), RuntimeError> {
        let c = &self.client;
        let mut first_error = None;
        if exited {
        } else if let Ok(Some(process)) = c.task_get(id).await {
            // Status 3 is STOPPED (containerd.v1.types.Status); anything else may still run.
            if process.status != STATUS_STOPPED {
                let _ = c.task_kill(id, "", SIGKILL, true).await;
                if tokio::time::timeout(TEARDOWN_WAIT, c.task_wait(id, "")).await.is_err() {
                    tracing::warn!(container = id, "task did not exit within {TEARDOWN_WAIT:?} of SIGKILL");
                }
            }
        }
        // Off the bridge network (CNI DEL, its pins) before the directory holding them goes;
        // beside the task's deletion (no process of the task is left to use the network).
        let net = self.root_dir(id).join(crate::net::NET_DIR);
        let layer = crate::net::Host::new(self.options.net.clone());
        let detaching = net
            .exists()
            .then(|| tokio::task::spawn_blocking(move || layer.detach(&net)));
        let mut gone = true;
        match c.task_delete(id).await {
            Ok(_) => {}
            Err(e) => {
                gone = false;
                first_error = first_error.or(Some(e));
            }
        }
        if let Some(detaching) = detaching {
            let detached = detaching
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r.map_err(|e| e.to_string()));
            if let Err(e) = detached {
                tracing::warn!(container = id, error = %e, "could not detach the container from the network");
                return Err(RuntimeError::Internal(format!(
                    "detaching {id} from the bridge network: {e}"
                )));
            }
        }
        // A remapped rootfs and workspace views are runner's own mounts: they go before the
        // snapshot under them, and before anything under the state dir is removed.
        let run = self.run_dir.join(id);
        for dir in [self.root_dir(id), run.join(remap::VIEWS_DIR)] {
            if dir.exists()
                && let Err(e) = late::release(&dir)
            {
                tracing::warn!(container = id, error = %e, "could not unmount the container's mounts");
                return Err(RuntimeError::Io {
                    what: format!("unmounting {}", dir.display()),
                    source: e,
                });
            }
        }
        // Independent once the task is gone: the snapshot and the container record.
        let (snapshot, container) = tokio::join!(c.snapshot_remove(id), c.container_delete(id));
        gone &= container.is_ok();
        for e in [snapshot.err(), container.err()].into_iter().flatten() {
            first_error = first_error.or(Some(e));
        }
        // A member's late binds go before anything under the state dir is removed: removal
        // must never reach into a job's workspace.
        let late = self.late_dir(id);
        if late.exists()
            && let Err(e) = late::release(&late)
        {
            tracing::warn!(container = id, error = %e, "could not release the late binds");
            return Err(RuntimeError::Io {
                what: format!("releasing {}", late.display()),
                source: e,
            });
        }
        if let Err(e) = self.discard_run_dir(id, gone) {
            tracing::warn!(container = id, error = %e, "could not remove the run directory");
        }
        match first_error {
            Some(e) => {
                tracing::warn!(container = id, error = %e, "teardown incomplete");
                Err(e.into())
            }
            None => Ok(()),
        }
    }

    /// Wait for a process, riding out a containerd restart (the shim keeps the process).
    async fn wait(&self, id: &str, exec_id: &str) -> Result<client::Exit, CtdError> {
        let start = Instant::now();
        loop {
            match self.client.task_wait(id, exec_id).await {
                // Wait is idempotent: any failure but "no such task" may be the daemon
                // restarting under us (the connection drops mid-call), so ask again.
                Err(e) if !e.is_not_found() && start.elapsed() < RECONNECT_LIMIT => {
                    tracing::debug!(error = %e, "waiting for the task failed; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => return other,
            }
        }
    }

    /// Re-adopt a one-shot container whose runner died: wait for its task (it may have
    /// ended already), take the output the shim-run logger kept, tear the container down.
    pub async fn adopt(
        &self,
        id: &str,
        expect_marker: bool,
        limit: Option<Duration>,
        cancel: &CancellationToken,
    ) -> Result<ExecResult, RuntimeError> {
        let started = Instant::now();
        let waiter = {
            let engine = self.clone();
            let id = id.to_string();
            tokio::spawn(async move { engine.wait(&id, "").await })
        };
        let outcome = self.supervise(id, "", waiter, limit, cancel, None).await;
        let stats = cgroupfs::read(&self.cgroup_path(id));
        // The shim closes the logger's pipes only when the task is deleted.
        let output = match &outcome {
            Ok(_) => match self.client.task_delete(id).await {
                Ok(_) => self.logged_output(id, started).await,
                Err(e) => Err(e.into()),
            },
            Err(_) => Ok(Default::default()),
        };
        // Torn down whatever happened above: nothing of an adopted job is left behind.
        let teardown = self.teardown_inner(id, outcome.is_ok()).await;
        let (exit, timed_out, interrupted) = outcome?;
        let (out, err) = output?;
        teardown?;
        let end = TaskEnd {
            exit,
            timed_out,
            interrupted,
            duration: started.elapsed(),
        };
        Ok(task_result(end, expect_marker, out, err, stats, started))
    }

    /// Run one job to completion in a fresh container: setup + command in one task.
    pub async fn run_oneshot(&self, plan: &RunPlan, cancel: &CancellationToken) -> Result<ExecResult, RuntimeError> {
        let result = self.run_oneshot_inner(plan, cancel).await;
        // Every process of the sandbox is dead by now (its task exited or was killed).
        sweep_setid(plan.workspace.as_deref()).await;
        result
    }

    async fn run_oneshot_inner(&self, plan: &RunPlan, cancel: &CancellationToken) -> Result<ExecResult, RuntimeError> {
        let t0 = Instant::now();
        let mut image = None;
        let mut cold = None;
        if self.options.use_pools {
            match self.claim(plan, pool::KIND_POOLED).await {
                Ok(pool::Claim::Member(member)) => return self.run_pooled(*member, plan, cancel).await,
                Ok(pool::Claim::Cold(resolved, why)) => {
                    image = resolved;
                    cold = Some(why);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "claiming a pool member failed; running cold");
                    cold = Some(format!("claiming a pool member failed: {e}"));
                }
            }
        }
        let created = self.create(plan, image, None, "oneshot", false, None).await?;
        tracing::debug!(ms = t0.elapsed().as_secs_f64() * 1e3, "container created");
        let result = self.run_created(plan, &created, cancel).await;
        tracing::debug!(ms = t0.elapsed().as_secs_f64() * 1e3, "task finished");
        // A result means we saw the task exit; an error may have left it running.
        let teardown = self.teardown_inner(&created.id, result.is_ok()).await;
        tracing::debug!(ms = t0.elapsed().as_secs_f64() * 1e3, "torn down");
        let mut result = result?;
        teardown?;
        result.cold_start = cold;
        Ok(result)
    }

    async fn run_created(
        &self,
        plan: &RunPlan,
        created: &Created,
        cancel: &CancellationToken,
    ) -> Result<ExecResult, RuntimeError> {
        let job = plan.job();
        let id = &created.id;
        let durable = self.options.durable_output;
        // stdin, when the job has one, is a file in the container (see `create`).
        let fifos = Fifos::create(&self.run_dir.join(id), "init", false, !durable)?;
        let expect_marker = spec::runs_setup(job, plan.env());
        let limit = self.options.output_limit;
        let mut stdio = fifos.stdio();
        // Durable output goes through the shim-run logger; otherwise we read the FIFOs.
        let pumps = if durable {
            let exe = self.runner_exe("the output logger")?;
            let live = self.options.live_output.as_deref();
            let uri = logger::uri(&exe, &self.output_dir(id), expect_marker, limit, live);
            stdio.stdout = uri.clone();
            stdio.stderr = uri;
            None
        } else {
            Some(OutputPump::start(&fifos, expect_marker, limit)?)
        };
        let started = Instant::now();
        let (_, mounts) = self.create_task(id, created.rootfs.clone(), &stdio).await?;
        let waiter = {
            let engine = self.clone();
            let id = id.clone();
            tokio::spawn(async move { engine.wait(&id, "").await })
        };
        let storage = self.watch_storage(plan, id, &created.cgroup, created.upper.clone(), None);
        self.start_task(id, mounts).await?;
        crate::metrics::observe(OPERATION_SECONDS, &[("op", "start")], started.elapsed());
        let deadline = job.timeout.into_iter().chain(job.active_deadline).min();
        // An eviction ends the wait as a cancel would (the watch has killed the task already).
        let stop = cancel.child_token();
        let _stop_on_eviction = stop_on(&storage, &stop);
        let (exit, timed_out, interrupted) = self
            .supervise(
                id,
                "",
                waiter,
                deadline.map(|d| d.saturating_sub(started.elapsed())),
                &stop,
                None,
            )
            .await?;
        let evicted = final_verdict(&storage, exit.status != 0).await;
        let interrupted = interrupted && evicted.is_none();
        let duration = started.elapsed();
        let stats = cgroupfs::read(&created.cgroup);
        let (out, err) = match pumps {
            Some(pumps) => pumps.finish(DRAIN_LIMIT, false).await,
            None => {
                // The shim closes the logger's pipes only when the task is deleted.
                self.client.task_delete(id).await?;
                self.logged_output(id, started).await?
            }
        };
        let end = TaskEnd {
            exit,
            timed_out,
            interrupted,
            duration,
        };
        let mut result = task_result(end, expect_marker, out, err, stats, started);
        if let (Some(_), Some(code)) = (&evicted, result.exit_code.filter(|c| *c > 128)) {
            result.signal = Some(code - 128);
        }
        result.evicted = evicted;
        Ok(result)
    }

    fn output_dir(&self, id: &str) -> PathBuf {
        self.run_dir.join(id).join("output")
    }

    /// What the shim-run logger wrote (it finishes once the task's output reaches EOF). No
    /// output record is our failure, never silently an empty output.
    async fn logged_output(&self, id: &str, started: Instant) -> Result<(io::StreamOut, io::StreamOut), RuntimeError> {
        let dir = self.output_dir(id);
        let begin = Instant::now();
        loop {
            if let Some(record) = logger::read_output(&dir) {
                let convert = |r: logger::StreamRecord| io::StreamOut {
                    setup: r.setup,
                    command: r.command,
                    setup_status: r.setup_status,
                    setup_at: r.setup_ms.map(|ms| started + Duration::from_millis(ms)),
                };
                return Ok((convert(record.stdout), convert(record.stderr)));
            }
            if begin.elapsed() > DRAIN_LIMIT {
                return Err(RuntimeError::Internal(format!(
                    "the output logger of {id} wrote nothing within {DRAIN_LIMIT:?} (is the logger binary runner?)"
                )));
            }
            // The logger writes within a few ms of the EOF that Tasks.Delete gives it: poll
            // finely at first (a 5 ms step cost 2.5 ms per job on average), then back off.
            let step = if begin.elapsed() < Duration::from_millis(50) {
                1
            } else {
                10
            };
            tokio::time::sleep(Duration::from_millis(step)).await;
        }
    }

    /// Watch a container's ephemeral storage (its writable layer, agent directory and
    /// workspace, see `runtime::storage`). When it goes over its limit every process of it is
    /// killed at once: a sandbox writing at disk speed gets no grace period to write more.
    fn watch_storage(
        &self,
        plan: &RunPlan,
        id: &str,
        cgroup: &str,
        upper: Option<PathBuf>,
        agent: Option<&Path>,
    ) -> Arc<StorageWatch> {
        let watch = Arc::new(
            self.storage
                .watch(plan.env().resources.ephemeral_storage.0, Some(cgroup.to_string())),
        );
        if let Some(upper) = upper {
            watch.add(StorageTree::WritableLayer, upper);
        }
        if let Some(agent) = agent {
            watch.add(StorageTree::AgentDir, agent.to_path_buf());
        }
        if let Some(ws) = &plan.workspace {
            watch.add(StorageTree::Workspace, ws.clone());
        }
        let (client, id) = (self.client.clone(), id.to_string());
        let (evicted, ended) = (watch.evicted().clone(), watch.ended().clone());
        tokio::spawn(async move {
            tokio::select! {
                () = evicted.cancelled() => {
                    if let Err(e) = client.task_kill(&id, "", SIGKILL, true).await {
                        tracing::warn!(container = id, error = %e, "killing an evicted sandbox");
                    }
                }
                () = ended.cancelled() => {}
            }
        });
        watch
    }

    /// Wait for the process for at most `limit` more; on timeout or cancel, SIGTERM (the whole container for the init,
    /// the process for an exec), a grace period, then SIGKILL. Returns (exit, timed out, interrupted).
    async fn supervise(
        &self,
        id: &str,
        exec_id: &str,
        mut waiter: tokio::task::JoinHandle<Result<client::Exit, CtdError>>,
        limit: Option<Duration>,
        cancel: &CancellationToken,
        group: Option<u32>,
    ) -> Result<(client::Exit, bool, bool), RuntimeError> {
        let all = exec_id.is_empty();
        let sleep = async {
            match limit {
                Some(l) => tokio::time::sleep(l).await,
                None => std::future::pending().await,
            }
        };
        let (timed_out, interrupted) = tokio::select! {
            r = &mut waiter => return Ok((join(r)?, false, false)),
            () = sleep => (true, false),
            () = cancel.cancelled() => (false, true),
        };
        let _ = self.client.task_kill(id, exec_id, SIGTERM, all).await;
        signal_group(group, Signal::SIGTERM);
        let result = match tokio::time::timeout(self.options.kill_grace, &mut waiter).await {
            Ok(r) => Ok((join(r)?, timed_out, interrupted)),
            Err(_) => {
                signal_group(group, Signal::SIGKILL);
                self.client.task_kill(id, exec_id, SIGKILL, all).await?;
                Ok((join(waiter.await)?, timed_out, interrupted))
            }
        };
        // Children of an exec that outlived it (SIGTERM ignored) die with their group.
        signal_group(group, Signal::SIGKILL);
        result
    }

    /// Start a live container: setup runs once in its init, which then idles.
    pub async fn spawn_live(&self, plan: &RunPlan) -> Result<LiveContainer, RuntimeError> {
        let mut image = None;
        if self.options.use_pools && self.options.exec_via_agent {
            match self.claim(plan, "live").await {
                Ok(pool::Claim::Member(member)) => {
                    // Off the session's path (the hook starts a process), and a moment later:
                    // a refill is a container start (shim, runc) that would take the CPU the
                    // session's first commands need (measured with `bench http` on 2 cores:
                    // the pooled busybox session's first answer went from ~14 to ~11 ms, the
                    // python one's from ~18 to ~16 ms). A long-lived server's housekeeping
                    // refills anyway, should this process exit before the delay ends.
                    if let Some(hook) = self.options.on_claim.clone() {
                        let pool = member.pool.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(REFILL_AFTER_SESSION_CLAIM).await;
                            let _ = tokio::task::spawn_blocking(move || (hook.0)(&pool)).await;
                        });
                    }
                    return self.live_from_member(*member, plan).await;
                }
                Ok(pool::Claim::Cold(resolved, _)) => image = resolved,
                Err(e) => tracing::warn!(error = %e, "claiming a pool member failed; starting cold"),
            }
        }
        let job = plan.job();
        let env = plan.env();
        let with_agent = self.options.exec_via_agent;
        let idle = if with_agent { AGENT_SCRIPT } else { KEEPALIVE };
        let init_args = spec::entry::compose(
            &env.setup,
            job.disable_setup,
            None,
            &[spec::SHELL.to_string(), "-c".to_string(), idle.to_string()],
        );
        let mut created = self
            .create(plan, image, Some(init_args), "live", with_agent, None)
            .await?;
        match self.start_live(plan, &mut created).await {
            Ok(live) => Ok(live),
            Err(e) => {
                let _ = self.teardown(&created.id).await;
                Err(e)
            }
        }
    }

    async fn start_live(&self, plan: &RunPlan, created: &mut Created) -> Result<LiveContainer, RuntimeError> {
        let job = plan.job();
        let id = created.id.clone();
        let fifos = Fifos::create(&self.run_dir.join(&id), "init", false, true)?;
        let expect_marker = spec::runs_setup(job, plan.env());
        let limit = self.options.output_limit;
        let mut pumps = OutputPump::start(&fifos, expect_marker, limit)?;
        let started = Instant::now();
        let (init_pid, mounts) = self.create_task(&id, created.rootfs.clone(), &fifos.stdio()).await?;
        tracing::debug!(ms = started.elapsed().as_secs_f64() * 1e3, "task created");
        let mut waiter = {
            let engine = self.clone();
            let id = id.clone();
            tokio::spawn(async move { engine.wait(&id, "").await })
        };
        let agent_dir = created.agent.as_ref().map(|a| a.dir().to_path_buf());
        let storage = self.watch_storage(plan, &id, &created.cgroup, created.upper.clone(), agent_dir.as_deref());
        self.start_task(&id, mounts).await?;
        crate::metrics::observe(OPERATION_SECONDS, &[("op", "start")], started.elapsed());
        tracing::debug!(ms = started.elapsed().as_secs_f64() * 1e3, "task started");
        let mut setup = None;
        if expect_marker {
            let limit = job.timeout.into_iter().chain(job.active_deadline).min();
            let timeout = async {
                match limit {
                    Some(l) => tokio::time::sleep(l).await,
                    None => std::future::pending().await,
                }
            };
            // Setup is done when its marker arrives, or failed when the init exits first.
            let outcome = tokio::select! {
                status = pumps.setup_done() => Ok(status),
                r = &mut waiter => Err(Some(join(r)?)),
                () = timeout => Err(None),
            };
            let (out, err) = pumps.setup_output();
            let (exit_code, timed_out) = match outcome {
                Ok(status) => (Some(status), false),
                Err(Some(exit)) => (Some(exit.status as i32), false),
                Err(None) => (None, true),
            };
            setup = Some(SetupResult {
                exit_code,
                stdout: out.text,
                stderr: err.text,
                stdout_dropped_bytes: out.dropped_bytes,
                stderr_dropped_bytes: err.dropped_bytes,
                timed_out,
                duration_ms: started.elapsed().as_millis() as u64,
            });
        }
        pumps.discard_rest();
        // The agent serves commands only while the init runs: remember when it stops.
        let init_exited = CancellationToken::new();
        {
            let token = init_exited.clone();
            tokio::spawn(async move {
                let _ = waiter.await;
                token.cancel();
            });
        }
        let mut live = LiveContainer::new(
            self.clone(),
            created.agent.take().map(Arc::new),
            init_pid,
            init_exited,
            id,
            created.cgroup.clone(),
            created.process.clone(),
            Vec::new(),
        );
        live.network = created.network.clone();
        live.workspace = plan.workspace.clone();
        live.storage = Some(storage);
        if let Some(setup) = setup {
            live.set_setup(setup);
        }
        Ok(live)
    }
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

/// Signal the process group an exec leads, from the host. Only groups led by a process of
/// ours are signalled: `group` is the PID Tasks.Start returned for the exec.
fn signal_group(group: Option<u32>, signal: Signal) {
    if let Some(pgid) = group.and_then(|g| i32::try_from(g).ok()).filter(|g| *g > 1) {
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid), signal);
    }
}

fn join<T>(r: Result<Result<T, CtdError>, tokio::task::JoinError>) -> Result<T, RuntimeError> {
    match r {
        Ok(inner) => Ok(inner?),
        Err(e) => Err(RuntimeError::Internal(format!("waiting for the task: {e}"))),
    }
}

/// The unmounting of a created task's host mounts (see `Engine::create_task`).
struct HostMounts(tokio::task::JoinHandle<()>);

impl HostMounts {
    async fn wait(self) {
        if let Err(e) = self.0.await {
            tracing::warn!(error = %e, "unmounting a container's host mounts failed");
        }
    }
}

/// The lease that keeps a fresh snapshot from containerd's garbage collection until the
/// container that references it exists. It is taken beside the spec's preparation and
/// given back off the caller's path: neither wait is worth a cold start's time. Dropped
/// unreleased (a create cancelled midway), it is given back in the background.
struct CreateLease {
    name: String,
    client: Containerd,
    taking: Option<tokio::task::JoinHandle<Result<(), CtdError>>>,
    released: bool,
}

impl CreateLease {
    fn take(client: &Containerd, name: &str, mut labels: HashMap<String, String>) -> Self {
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
    async fn held(&mut self) -> Result<(), RuntimeError> {
        match self.taking.take() {
            Some(taking) => taking
                .await
                .map_err(|e| RuntimeError::Internal(format!("taking the create lease: {e}")))?
                .map_err(RuntimeError::from),
            None => Ok(()),
        }
    }

    /// Give it back now (a create that failed: whatever it held is gone already).
    async fn release(mut self) {
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

struct Created {
    id: String,
    rootfs: Vec<containerd_client::types::Mount>,
    /// Where its rootfs writes land (its snapshot's upper directory).
    upper: Option<PathBuf>,
    cgroup: String,
    process: oci_spec::runtime::Process,
    agent: Option<Agent>,
    /// What it got on a bridge network.
    network: Option<crate::runtime::NetworkStatus>,
}

/// A command in flight in a live container.
#[derive(Clone)]
enum Running {
    /// Through Tasks.Exec: its exec id and host PID.
    Exec(String, u32),
    /// Through the agent: when its request was sent (clock ticks since boot), which finds its
    /// process.
    Agent(u64),
}

#[derive(Default)]
struct LiveState {
    /// What runs now, for `poll` and `kill`.
    running: Option<Running>,
    last: Option<i32>,
    cleaned: bool,
}

/// A long-lived container: the runtime interface over Tasks.Exec.
pub struct LiveContainer {
    engine: Engine,
    /// The exec agent in the init; commands go through it (see `agent`).
    agent: Option<Arc<Agent>>,
    /// Host PID of the init (to find an agent command's host PID for signals).
    init_pid: u32,
    init_exited: CancellationToken,
    id: String,
    cgroup: String,
    process: oci_spec::runtime::Process,
    setup: std::sync::OnceLock<SetupResult>,
    /// Exported before each agent command: a pool member's Environment variables (its init
    /// was made without them).
    base_env: Vec<(String, String)>,
    /// The pool it came from.
    pool: Option<String>,
    /// What it got on a bridge network.
    network: Option<crate::runtime::NetworkStatus>,
    /// Its workspace on the host (swept of setuid bits at cleanup).
    workspace: Option<PathBuf>,
    /// Its ephemeral storage, watched; an eviction ends it.
    storage: Option<Arc<StorageWatch>>,
    slot: Arc<tokio::sync::Mutex<()>>,
    state: Arc<Mutex<LiveState>>,
    sequence: Arc<AtomicU64>,
}

impl LiveContainer {
    #[allow(clippy::too_many_arguments)]
    fn new(
        engine: Engine,
        agent: Option<Arc<Agent>>,
        init_pid: u32,
        init_exited: CancellationToken,
        id: String,
        cgroup: String,
        process: oci_spec::runtime::Process,
        base_env: Vec<(String, String)>,
    ) -> Self {
        LiveContainer {
            engine,
            agent,
            init_pid,
            init_exited,
            id,
            cgroup,
            process,
            setup: std::sync::OnceLock::new(),
            base_env,
            pool: None,
            network: None,
            workspace: None,
            storage: None,
            slot: Arc::new(tokio::sync::Mutex::new(())),
            state: Arc::new(Mutex::new(LiveState::default())),
            sequence: Arc::new(AtomicU64::new(0)),
        }
    }

    fn set_setup(&self, setup: SetupResult) {
        let _ = self.setup.set(setup);
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Processes the kernel OOM-killed in this container so far.
    pub fn oom_kills(&self) -> Option<u64> {
        cgroupfs::read(&self.cgroup).oom_kills
    }

    /// The host directory shared with the container at `agent::AGENT_MOUNT`.
    pub fn agent_dir(&self) -> Option<&Path> {
        self.agent.as_ref().map(|a| a.dir())
    }

    /// Signal a process given by its PID inside the container (found on the host through
    /// its PID namespace; nothing outside this container can be hit).
    fn agent(&self) -> Result<&Agent, RuntimeError> {
        self.agent
            .as_deref()
            .ok_or_else(|| RuntimeError::Internal("the container has no agent".into()))
    }

    pub fn signal_container_pid(&self, ns_pid: i32, signal: Signal) -> bool {
        match agent::host_pid(&self.cgroup, self.init_pid, ns_pid) {
            Some(host) => nix::sys::signal::kill(nix::unistd::Pid::from_raw(host), signal).is_ok(),
            None => false,
        }
    }

    fn exec_process(&self, request: &ExecRequest) -> Result<Vec<u8>, RuntimeError> {
        let mut process = self.process.clone();
        process.set_args(Some(request.argv.clone()));
        if !request.env.is_empty() {
            let mut env = process.env().clone().unwrap_or_default();
            for (k, v) in &request.env {
                env.retain(|e| e.split_once('=').map(|(key, _)| key) != Some(k.as_str()));
                env.push(format!("{k}={v}"));
            }
            process.set_env(Some(env));
        }
        if let Some(cwd) = &request.cwd {
            let base = process.cwd().clone();
            crate::manifest::paths::check_lexical(cwd).map_err(|e| RuntimeError::Refused(format!("cwd: {e}")))?;
            process.set_cwd(base.join(cwd));
        }
        serde_json::to_vec(&process).map_err(|e| RuntimeError::Refused(format!("encoding the process: {e}")))
    }

    fn check_live(&self) -> Result<(), RuntimeError> {
        if self.state.lock().expect("state lock").cleaned {
            return Err(RuntimeError::CleanedUp);
        }
        if let Some(verdict) = self.eviction() {
            return Err(RuntimeError::Evicted(verdict));
        }
        Ok(())
    }

    /// Why the sandbox was evicted, if it was.
    fn eviction(&self) -> Option<String> {
        self.storage.as_ref().and_then(|s| s.verdict())
    }

    /// A command's outcome, told that the sandbox was evicted under it when it was: its
    /// result says so, and a failure to see it end (the init was killed) is the eviction.
    ///
    /// No measurement is made for it (a session's commands fail often, and a walk of a large
    /// workspace per failed command would cost every call): the periodic one finds a sandbox
    /// over its limit within its cadence, and the next call is refused.
    fn mark_eviction(&self, outcome: Result<ExecResult, RuntimeError>) -> Result<ExecResult, RuntimeError> {
        let Some(verdict) = self.eviction() else {
            return outcome;
        };
        match outcome {
            Ok(mut result) => {
                result.evicted = Some(verdict);
                Ok(result)
            }
            Err(_) => Err(RuntimeError::Evicted(verdict)),
        }
    }

    /// Start an exec; returns its id, output pumps and waiter.
    async fn start_exec(
        &self,
        request: &ExecRequest,
        stream: Option<mpsc::Sender<RuntimeEvent>>,
    ) -> Result<StartedExec, RuntimeError> {
        let exec_id = format!("exec-{}", self.sequence.fetch_add(1, Ordering::Relaxed));
        let process = self.exec_process(request)?;
        let dir = self.engine.run_dir.join(&self.id);
        let fifos = Fifos::create(&dir, &exec_id, request.stdin.is_some(), true)?;
        let pumps = match stream {
            Some(tx) => OutputPump::stream(&fifos, tx)?,
            None => OutputPump::start(&fifos, false, self.engine.options.output_limit)?,
        };
        let stdin = fifos.open_stdin()?;
        let client = &self.engine.client;
        let t0 = Instant::now();
        client.exec(&self.id, &exec_id, process, &fifos.stdio()).await?;
        tracing::debug!(ms = t0.elapsed().as_secs_f64() * 1e3, "exec registered");
        let waiter = {
            let engine = self.engine.clone();
            let id = self.id.clone();
            let exec_id = exec_id.clone();
            tokio::spawn(async move { engine.wait(&id, &exec_id).await })
        };
        let started = Instant::now();
        let started_rpc = client.task_start(&self.id, &exec_id).await;
        tracing::debug!(ms = t0.elapsed().as_secs_f64() * 1e3, "exec started");
        let pid = match started_rpc {
            Ok(pid) => pid,
            Err(e) => {
                waiter.abort();
                let _ = client.process_delete(&self.id, &exec_id).await;
                fifos.remove();
                return Err(match e {
                    CtdError::Rpc { message, .. } => RuntimeError::Start {
                        program: request.argv[0].clone(),
                        source: std::io::Error::other(message),
                    },
                    other => other.into(),
                });
            }
        };
        if let (Some(data), Some(stdin)) = (&request.stdin, stdin) {
            io::deliver_stdin(stdin, data.clone(), client.clone(), self.id.clone(), exec_id.clone());
        }
        self.state.lock().expect("state lock").running = Some(Running::Exec(exec_id.clone(), pid));
        Ok(StartedExec {
            pid,
            exec_id,
            fifos,
            pumps,
            waiter,
            started,
        })
    }

    async fn finish_exec(&self, exec: StartedExec, timeout: Option<Duration>) -> Result<ExecResult, RuntimeError> {
        let before = cgroupfs::read(&self.cgroup);
        let never = CancellationToken::new();
        let outcome = self
            .engine
            .supervise(
                &self.id,
                &exec.exec_id,
                exec.waiter,
                timeout.map(|t| t.saturating_sub(exec.started.elapsed())),
                &never,
                Some(exec.pid),
            )
            .await;
        let duration = exec.started.elapsed();
        tracing::debug!(ms = duration.as_secs_f64() * 1e3, "exec exited");
        // What the command left running in the sandbox keeps running; its output is not ours.
        let (out, err) = exec.pumps.finish(EXEC_DRAIN_LIMIT, true).await;
        tracing::debug!(ms = exec.started.elapsed().as_secs_f64() * 1e3, "exec output drained");
        // The shim's Delete of an exec waits up to 2 s for the process's output to close
        // (containerd runc shim, execProcess.delete): done in the background, so a command
        // that leaves a background process behind still answers at once.
        let client = self.engine.client.clone();
        let (id, exec_id, fifos) = (self.id.clone(), exec.exec_id.clone(), exec.fifos);
        tokio::spawn(async move {
            if let Err(e) = client.process_delete(&id, &exec_id).await {
                tracing::debug!(error = %e, "deleting the exec process");
            }
            fifos.remove();
        });
        let after = cgroupfs::read(&self.cgroup);
        let (exit, timed_out, _) = outcome?;
        Ok(self.record(command_result(
            exit.status,
            timed_out,
            out,
            err,
            duration,
            before,
            after,
        )))
    }

    /// Remember how the last command ended (for `poll`) and hand its result back.
    fn record(&self, result: ExecResult) -> ExecResult {
        let mut state = self.state.lock().expect("state lock");
        state.running = None;
        state.last = Some(result.status_code());
        result
    }
}

/// How a one-shot task ended.
struct TaskEnd {
    exit: client::Exit,
    timed_out: bool,
    interrupted: bool,
    duration: Duration,
}

/// A one-shot task's result: its exit, its output split at the setup marker, and the
/// container's cgroup counters (OOM kills decide `oomKilled`, never the exit code alone).
fn task_result(
    end: TaskEnd,
    expect_marker: bool,
    out: io::StreamOut,
    err: io::StreamOut,
    stats: cgroupfs::CgroupStats,
    started: Instant,
) -> ExecResult {
    let status = end.exit.status;
    let oom = stats.oom_kills.is_some_and(|n| n > 0);
    let setup = expect_marker.then(|| SetupResult {
        // No marker: the task ended during setup, whose status is then the task's.
        exit_code: out.setup_status.or(Some(status as i32)),
        stdout: out.setup.text.clone(),
        stderr: err.setup.text.clone(),
        stdout_dropped_bytes: out.setup.dropped_bytes,
        stderr_dropped_bytes: err.setup.dropped_bytes,
        timed_out: end.timed_out && out.setup_status.is_none(),
        duration_ms: out
            .setup_at
            .map(|t| t.saturating_duration_since(started).as_millis() as u64)
            .unwrap_or(0),
    });
    let killed = end.timed_out || end.interrupted || oom;
    ExecResult {
        exit_code: Some(status as i32),
        signal: (killed && status > 128).then(|| status as i32 - 128),
        timed_out: end.timed_out,
        oom_killed: oom,
        stdout: out.command.text,
        stderr: err.command.text,
        stdout_dropped_bytes: out.command.dropped_bytes,
        stderr_dropped_bytes: err.command.dropped_bytes,
        setup,
        duration_ms: end.duration.as_millis() as u64,
        peak_memory_bytes: stats.peak_memory,
        cpu_time_ms: stats.cpu_usage.map(|d| d.as_millis() as u64),
        pool: None,
        cold_start: None,
        evicted: None,
    }
}

/// The result of a command in a live container: the container's cgroup counters before and
/// after it give its OOM kills and CPU time; peak memory is the container's.
fn command_result(
    status: u32,
    timed_out: bool,
    out: io::StreamOut,
    err: io::StreamOut,
    duration: Duration,
    before: cgroupfs::CgroupStats,
    after: cgroupfs::CgroupStats,
) -> ExecResult {
    let oom = matches!((before.oom_kills, after.oom_kills), (Some(b), Some(a)) if a > b);
    ExecResult {
        exit_code: Some(status as i32),
        signal: ((timed_out || oom) && status > 128).then(|| status as i32 - 128),
        timed_out,
        oom_killed: oom,
        stdout: out.command.text,
        stderr: err.command.text,
        stdout_dropped_bytes: out.command.dropped_bytes,
        stderr_dropped_bytes: err.command.dropped_bytes,
        setup: None,
        duration_ms: duration.as_millis() as u64,
        peak_memory_bytes: after.peak_memory,
        cpu_time_ms: match (before.cpu_usage, after.cpu_usage) {
            (Some(b), Some(a)) => Some(a.saturating_sub(b).as_millis() as u64),
            _ => None,
        },
        pool: None,
        cold_start: None,
        evicted: None,
    }
}

impl LiveContainer {
    /// Run one command through the agent: send, wait for its status (or the timeout: the
    /// command's session gets SIGTERM, the grace, SIGKILL), collect output.
    async fn agent_run(
        &self,
        request: ExecRequest,
        stream: Option<mpsc::Sender<RuntimeEvent>>,
    ) -> Result<ExecResult, RuntimeError> {
        let agent = self
            .agent
            .clone()
            .ok_or_else(|| RuntimeError::Internal("no agent".into()))?;
        for key in request.env.keys() {
            let valid = !key.is_empty()
                && key
                    .bytes()
                    .enumerate()
                    .all(|(i, b)| b == b'_' || b.is_ascii_alphabetic() || (i > 0 && b.is_ascii_digit()));
            if !valid {
                return Err(RuntimeError::Refused(format!(
                    "env: {key:?} is not a valid variable name"
                )));
            }
        }
        if request
            .argv
            .iter()
            .chain(request.env.values())
            .any(|a| a.contains('\0'))
        {
            return Err(RuntimeError::Refused(
                "a NUL byte in the command or its environment".into(),
            ));
        }
        let cwd = match &request.cwd {
            Some(cwd) => {
                crate::manifest::paths::check_lexical(cwd).map_err(|e| RuntimeError::Refused(format!("cwd: {e}")))?;
                Some(self.process.cwd().join(cwd).to_string_lossy().into_owned())
            }
            // Always named: a pool member's init sits in the directory *under* the workspace
            // mount that arrived after it started.
            None => Some(self.process.cwd().to_string_lossy().into_owned()),
        };
        let env: Vec<(String, String)> = self
            .base_env
            .iter()
            .filter(|(k, _)| !request.env.contains_key(k))
            .cloned()
            .chain(request.env.iter().map(|(k, v)| (k.clone(), v.clone())))
            .collect();
        let n = self.sequence.fetch_add(1, Ordering::Relaxed);
        let script = agent::command_script(&format!("req-{n}"), &request.argv, &env, cwd.as_deref());
        let before = cgroupfs::read(&self.cgroup);
        let started = Instant::now();
        let req = agent.send(n, &script, request.stdin.as_deref())?;
        let pumps = match stream {
            Some(tx) => OutputPump::forward(req.out, req.err, tx),
            None => OutputPump::capture(req.out, req.err, false, self.engine.options.output_limit),
        };
        self.state.lock().expect("state lock").running = Some(Running::Agent(req.sent));
        let mut done = Box::pin(read_status(req.done));
        let sleep = async {
            match request.timeout {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending().await,
            }
        };
        let outcome = tokio::select! {
            s = &mut done => Ok((s, false)),
            () = sleep => Err(()),
            () = self.init_exited.cancelled() => {
                self.state.lock().expect("state lock").running = None;
                return Err(RuntimeError::Internal("the sandbox's init exited; it runs no more commands".into()));
            }
        };
        let (status, timed_out) = match outcome {
            Ok(r) => r,
            Err(()) => {
                self.signal_agent_command(req.sent, Signal::SIGTERM);
                match tokio::time::timeout(self.engine.options.kill_grace, &mut done).await {
                    Ok(s) => (s, true),
                    Err(_) => {
                        self.signal_agent_command(req.sent, Signal::SIGKILL);
                        let s = tokio::time::timeout(Duration::from_secs(5), &mut done)
                            .await
                            .ok()
                            .flatten();
                        (s, true)
                    }
                }
            }
        };
        let duration = started.elapsed();
        let (out, err) = pumps.finish(EXEC_DRAIN_LIMIT, true).await;
        let after = cgroupfs::read(&self.cgroup);
        {
            let agent = agent.clone();
            let name = req.name.clone();
            tokio::task::spawn_blocking(move || agent.remove(&name));
        }
        let status = status.ok_or_else(|| RuntimeError::Internal("the agent reported no status".into()))?;
        Ok(self.record(command_result(status, timed_out, out, err, duration, before, after)))
    }

    /// Signal an agent command's session (its whole process tree) from the host: the process
    /// is found in the kernel's process tree (see `agent::request_process`).
    fn signal_agent_command(&self, sent: u64, signal: Signal) {
        let Some(host) = agent::request_process(self.init_pid, sent) else {
            return;
        };
        let pid = nix::unistd::Pid::from_raw(host);
        // The agent starts commands with setsid where it can: then the PID leads its group.
        if nix::sys::signal::killpg(pid, signal).is_err() {
            let _ = nix::sys::signal::kill(pid, signal);
        }
    }
}

/// Read the status the agent writes to `done` (one line, then EOF).
async fn read_status(mut done: tokio::net::unix::pipe::Receiver) -> Option<u32> {
    use tokio::io::AsyncReadExt;
    let mut text = String::new();
    let mut limited = (&mut done).take(16);
    limited.read_to_string(&mut text).await.ok()?;
    agent::parse_status(&text)
}

struct StartedExec {
    /// Host PID of the exec'd process: runc makes it a session (and group) leader, so its
    /// group is the command's process tree.
    pid: u32,
    exec_id: String,
    fifos: Fifos,
    pumps: OutputPump,
    waiter: tokio::task::JoinHandle<Result<client::Exit, CtdError>>,
    started: Instant,
}

impl crate::runtime::Sandbox for LiveContainer {
    fn shared_dir(&self) -> &Path {
        self.agent.as_ref().map_or(Path::new(""), |a| a.dir())
    }

    fn shared_mount(&self) -> &'static str {
        agent::AGENT_MOUNT
    }

    fn tools_mount(&self) -> &'static str {
        TOOLS_MOUNT
    }

    fn signal(&self, pid: i32, signal: Signal) -> bool {
        self.signal_container_pid(pid, signal)
    }

    fn signal_group(&self, pid: i32, signal: Signal) -> bool {
        let Some(host) = agent::host_pid(&self.cgroup, self.init_pid, pid) else {
            return false;
        };
        let host = nix::unistd::Pid::from_raw(host);
        if nix::unistd::getpgid(Some(host)).ok() == Some(host) {
            nix::sys::signal::killpg(host, signal).is_ok()
        } else {
            nix::sys::signal::kill(host, signal).is_ok()
        }
    }

    fn fifo(&self, name: &str, end: crate::runtime::FifoEnd) -> Result<std::os::fd::OwnedFd, RuntimeError> {
        self.agent()?.fifo(name, end)
    }

    fn reopen_fifo(&self, name: &str, end: crate::runtime::FifoEnd) -> Result<std::os::fd::OwnedFd, RuntimeError> {
        self.agent()?.reopen(name, end)
    }

    fn unlink(&self, name: &str) {
        if let Some(agent) = &self.agent {
            agent.unlink(name);
        }
    }

    fn oom_kills(&self) -> Option<u64> {
        LiveContainer::oom_kills(self)
    }
}

#[async_trait]
impl Runtime for LiveContainer {
    /// Only with the agent: its directory is what the sandbox shares with the host.
    fn sandbox(&self) -> Option<&dyn crate::runtime::Sandbox> {
        self.agent.as_ref().map(|_| self as &dyn crate::runtime::Sandbox)
    }

    fn setup(&self) -> Option<&SetupResult> {
        self.setup.get()
    }

    fn pool(&self) -> Option<&str> {
        self.pool.as_deref()
    }

    fn network(&self) -> Option<&crate::runtime::NetworkStatus> {
        self.network.as_ref()
    }

    async fn set_egress(&self, egress: crate::net::Egress) -> Result<(), RuntimeError> {
        if self.network.is_none() {
            return Err(RuntimeError::Refused("the sandbox is on no bridge network".into()));
        }
        let dir = self.engine.root_dir(&self.id).join(crate::net::NET_DIR);
        let layer = crate::net::Host::new(self.engine.options.net.clone());
        tokio::task::spawn_blocking(move || layer.set_egress(&dir, &egress))
            .await
            .map_err(|e| RuntimeError::Internal(format!("the egress task: {e}")))?
            .map_err(|e| RuntimeError::Internal(format!("changing the egress of {}: {e}", self.id)))
    }

    async fn execute(&self, request: ExecRequest) -> Result<ExecResult, RuntimeError> {
        self.check_live()?;
        if request.argv.is_empty() {
            return Err(RuntimeError::EmptyCommand);
        }
        let _slot = self.slot.lock().await;
        let began = Instant::now();
        let result = if self.agent.is_some() {
            self.agent_run(request, None).await
        } else {
            let timeout = request.timeout;
            match self.start_exec(&request, None).await {
                Ok(exec) => self.finish_exec(exec, timeout).await,
                Err(e) => Err(e),
            }
        };
        crate::metrics::observe(OPERATION_SECONDS, &[("op", "exec")], began.elapsed());
        self.mark_eviction(result)
    }

    async fn stream(
        &self,
        argv: Vec<String>,
        timeout: Option<Duration>,
    ) -> Result<mpsc::Receiver<RuntimeEvent>, RuntimeError> {
        self.check_live()?;
        if argv.is_empty() {
            return Err(RuntimeError::EmptyCommand);
        }
        let slot = self.slot.clone().lock_owned().await;
        let (tx, rx) = mpsc::channel(64);
        let request = ExecRequest {
            argv,
            timeout,
            ..Default::default()
        };
        let this = LiveContainer {
            engine: self.engine.clone(),
            agent: self.agent.clone(),
            init_pid: self.init_pid,
            init_exited: self.init_exited.clone(),
            id: self.id.clone(),
            cgroup: self.cgroup.clone(),
            process: self.process.clone(),
            setup: std::sync::OnceLock::new(),
            base_env: self.base_env.clone(),
            pool: self.pool.clone(),
            network: self.network.clone(),
            workspace: self.workspace.clone(),
            storage: self.storage.clone(),
            slot: self.slot.clone(),
            state: self.state.clone(),
            sequence: self.sequence.clone(),
        };
        let exec = if this.agent.is_some() {
            None
        } else {
            Some(this.start_exec(&request, Some(tx.clone())).await?)
        };
        tokio::spawn(async move {
            let _slot = slot;
            let outcome = match exec {
                Some(exec) => this.finish_exec(exec, timeout).await,
                None => this.agent_run(request, Some(tx.clone())).await,
            };
            let outcome = this.mark_eviction(outcome);
            for event in RuntimeEvent::ending(outcome) {
                let _ = tx.send(event).await;
            }
        });
        Ok(rx)
    }

    fn poll(&self) -> ProcessState {
        let state = self.state.lock().expect("state lock");
        ProcessState::of(state.running.is_some(), state.last)
    }

    async fn kill(&self) -> Result<(), RuntimeError> {
        let running = self.state.lock().expect("state lock").running.clone();
        match running {
            Some(Running::Exec(exec_id, pid)) => {
                signal_group(Some(pid), Signal::SIGKILL);
                self.engine.client.task_kill(&self.id, &exec_id, SIGKILL, false).await?;
            }
            Some(Running::Agent(sent)) => self.signal_agent_command(sent, Signal::SIGKILL),
            None => {}
        }
        Ok(())
    }

    async fn cleanup(&self) -> Result<(), RuntimeError> {
        {
            let mut state = self.state.lock().expect("state lock");
            if state.cleaned {
                return Ok(());
            }
            state.cleaned = true;
        }
        let torn_down = self.engine.teardown(&self.id).await;
        sweep_setid(self.workspace.as_deref()).await;
        torn_down
    }
}

/// Whether the sandbox was evicted, once its command ended: a command that failed is measured
/// again first (one that ran into the limit ends before the next periodic walk).
async fn final_verdict(storage: &Arc<StorageWatch>, failed: bool) -> Option<String> {
    if !failed || storage.verdict().is_some() {
        return storage.verdict();
    }
    let storage = storage.clone();
    tokio::task::spawn_blocking(move || storage.check_now())
        .await
        .ok()
        .flatten()
}

/// Cancel `stop` when the watched sandbox is evicted; the task ends with the returned guard.
fn stop_on(storage: &StorageWatch, stop: &CancellationToken) -> tokio_util::sync::DropGuard {
    let (evicted, stop, done) = (storage.evicted().clone(), stop.clone(), CancellationToken::new());
    let guard = done.clone().drop_guard();
    tokio::spawn(async move {
        tokio::select! {
            () = evicted.cancelled() => stop.cancel(),
            () = done.cancelled() => {}
        }
    });
    guard
}

/// Clear the setuid and setgid bits a sandbox left in its workspace (see
/// `confined::Root::clear_setid`), once every process of the sandbox is dead: the next attempt,
/// a later reader and any local user who can reach the workspace get no file that runs as its
/// owner. On the blocking pool: the walk takes as long as the tree is large.
async fn sweep_setid(workspace: Option<&Path>) {
    let Some(ws) = workspace.map(Path::to_path_buf) else {
        return;
    };
    let shown = ws.display().to_string();
    let swept =
        tokio::task::spawn_blocking(move || crate::confined::Root::open(&ws).and_then(|root| root.clear_setid())).await;
    match swept {
        Ok(Ok(report)) if report.cleared > 0 => tracing::warn!(
            workspace = shown,
            files = report.cleared,
            "cleared the setuid/setgid bits of files the sandbox left in its workspace"
        ),
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::warn!(workspace = shown, error = %e, "clearing setuid/setgid bits in the workspace"),
        Err(e) => tracing::warn!(workspace = shown, error = %e, "clearing setuid/setgid bits in the workspace"),
    }
}

/// A workspace bind that could not be given its view: refused when the workspace no longer
/// holds what the job names (the sandbox's doing), else the host's failure.
fn view_error(e: remap::ViewError) -> RuntimeError {
    match e {
        remap::ViewError::Resolve(ref c) if c.is_client_error() => RuntimeError::Refused(e.to_string()),
        e => RuntimeError::Internal(e.to_string()),
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
