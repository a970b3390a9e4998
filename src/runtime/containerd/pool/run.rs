//! Running a job or a session in a claimed member, with the results of a cold run.

use super::*;

/// Whether a process has a handler for a signal (`SigCgt` of /proc/PID/status).
fn catches(host_pid: i32, signal: Signal) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{host_pid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << (signal as i32 - 1)) != 0)
}

/// The script a pooled command runs through the agent: the job's directory (the agent's own
/// cwd is the place *under* the workspace mount, which arrived later), its environment
/// exactly (the shell's own exports removed), then exec.
fn pooled_script(name: &str, argv: &[String], env: &[(String, String)], cwd: &str) -> String {
    let mut unset: Vec<&str> = SHELL_ARTIFACTS
        .iter()
        .copied()
        .filter(|v| !env.iter().any(|(k, _)| k == v))
        .collect();
    unset.sort();
    let body = agent::command_script(name, argv, env, Some(cwd));
    // After the `cd` (which sets OLDPWD), before the variables.
    let (cd, rest) = body.split_once('\n').unwrap_or((body.as_str(), ""));
    format!("{cd}\nunset {}\n{rest}", unset.join(" "))
}

impl Engine {
    /// Run a one-shot job in a claimed member, then destroy it. The same result as a cold
    /// run: setup and command composed as in `entry`, stdin from the job, the container's
    /// cgroup counters, the whole container killed when the command ends (as a PID 1's exit
    /// does). On a timeout the command's main process gets SIGTERM only when it handles it,
    /// as a PID 1 would, and everything else in the container does.
    pub async fn run_pooled(
        &self,
        mut member: Member,
        plan: &RunPlan,
        cancel: &CancellationToken,
    ) -> Result<ExecResult, RuntimeError> {
        let result = self.run_in_member(&mut member, plan, cancel).await.map(|mut r| {
            r.pool = Some(member.pool.clone());
            r
        });
        // Every process of the member is dead (`run_in_member` ends with SIGKILL to all):
        // what is left is containerd's records, the snapshot and the late binds, which the
        // pool's filler removes off the job's path.
        // The claim's relabelling lands first: retiring after it is what leaves `retired`.
        let relabelled = match member.relabel.await {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                tracing::warn!(member = member.id, error = %e, "relabelling the claimed member");
                false
            }
            Err(e) => {
                tracing::warn!(member = member.id, error = %e, "relabelling the claimed member");
                false
            }
        };
        if let (Ok(_), Some(hook), true) = (&result, &self.options.on_claim, relabelled) {
            let labels = HashMap::from([
                (LABEL_KIND.to_string(), KIND_RETIRED.to_string()),
                (LABEL_OWNER.to_string(), POOL_OWNER.to_string()),
            ]);
            if self.client.container_set_labels(&member.id, labels).await.is_ok() {
                (hook.0)(&member.pool, crate::runtime::Refill::WhenQuiet);
                return result;
            }
        }
        let teardown = self.teardown(&member.id).await;
        // The pool is one member short whatever happened.
        if let Some(hook) = &self.options.on_claim {
            (hook.0)(&member.pool, crate::runtime::Refill::WhenQuiet);
        }
        let result = result?;
        teardown?;
        Ok(result)
    }

    async fn run_in_member(
        &self,
        member: &mut Member,
        plan: &RunPlan,
        cancel: &CancellationToken,
    ) -> Result<ExecResult, RuntimeError> {
        let job = plan.job();
        let env = plan.env();
        let upper = self.find_upper(&member.id);
        // Beside the member's readying (`Readying`); both are waited for, whatever fails.
        let static_back = member.static_back.take();
        let bound = async {
            self.seed_workspace(member.seed.as_deref(), plan).await?;
            self.bind_late_blocking(&member.id, &member.layout, member.userns(), plan, static_back)
                .await
        }
        .await;
        let readied = member.ready().await;
        bound?;
        readied?;
        let member = &*member;
        let agent = member.agent()?;
        let argv = crate::spec::entry::compose(&env.setup, job.disable_setup, None, &job.command.argv());
        let vars: Vec<(String, String)> = env.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let cwd = member.process.cwd().to_string_lossy().into_owned();
        let script = pooled_script(&agent::request_name(0), &argv, &vars, &cwd);
        let expect_marker = spec::runs_setup(job, env);
        let (storage, baselined) = (self.watch_member_storage(plan, &member.id, &member.cgroup, None, upper)).await;
        let started = Instant::now();
        (self.end_prelaunched(&member.id, &member.cgroup, member.init_pid, agent)).await;
        baselined.wait().await?;
        let req = agent.send(0, &script, job.stdin.as_deref().map(str::as_bytes))?;
        let pumps = OutputPump::capture(req.out, req.err, expect_marker, self.options.output_limit);
        let limit = job.timeout.into_iter().chain(job.active_deadline).min();
        let mut done = Box::pin(crate::runtime::containerd::read_status(req.done));
        let sleep = async {
            match limit {
                Some(l) => tokio::time::sleep(l).await,
                None => std::future::pending().await,
            }
        };
        let (status, timed_out, interrupted) = tokio::select! {
            s = &mut done => (s, false, false),
            () = sleep => (None, true, false),
            () = cancel.cancelled() => (None, false, true),
            // The watch killed every process of the member: `done` ends without a status.
            () = storage.evicted().cancelled() => (None, false, false),
        };
        let mut evicted = storage.verdict();
        let status = if evicted.is_some() {
            None
        } else if timed_out || interrupted {
            // After a SIGKILL to all the agent is dead too: `done` ends at once, without a status.
            let killed = self.stop_member(member, &req.dir_fd, req.sent).await;
            let wait = if killed {
                Duration::from_millis(200)
            } else {
                self.options.kill_grace
            };
            tokio::time::timeout(wait, &mut done).await.unwrap_or_default()
        } else {
            status
        };
        // The command's end is the container's, as when it is PID 1.
        member.kill_all(&self.client).await;
        let duration = started.elapsed();
        let (out, err) = pumps.finish(crate::runtime::containerd::DRAIN_LIMIT, false).await;
        let stats = cgroupfs::read(&member.cgroup);
        // No status: the grace ran out and the container was killed (SIGKILL, as a cold
        // container's init then reports).
        let status = status.unwrap_or(128 + SIGKILL);
        if evicted.is_none() {
            evicted = crate::runtime::containerd::final_verdict(&storage, status != 0).await;
        }
        let end = TaskEnd {
            exit: crate::containerd::Exit { status },
            timed_out,
            interrupted,
            duration,
        };
        let mut result = task_result(end, expect_marker, out, err, stats, started);
        if evicted.is_some() {
            result.signal = Some(SIGKILL as i32);
        }
        result.evicted = evicted;
        Ok(result)
    }

    /// A claimed member's writable layer, looked up in containerd (one RPC, started beside
    /// the claim's readying so that it is not on the claim's path).
    fn find_upper(&self, id: &str) -> tokio::task::JoinHandle<Option<std::path::PathBuf>> {
        let (client, id) = (self.client.clone(), id.to_string());
        tokio::spawn(async move {
            match client.snapshot_mounts(&id).await {
                Ok(mounts) => crate::runtime::containerd::remap::writable_layer(&mounts),
                Err(e) => {
                    tracing::warn!(container = id, error = %e, "finding the member's writable layer");
                    None
                }
            }
        })
    }

    /// `watch_storage` for a claimed member. Its writable layer (`find_upper`) is in the
    /// baseline when it is known by now, and added when known otherwise: the command is not
    /// held for the RPC, and what it writes to its rootfs before the answer then counts as
    /// the baseline's.
    async fn watch_member_storage(
        &self,
        plan: &RunPlan,
        id: &str,
        cgroup: &str,
        agent: Option<&std::path::Path>,
        upper: tokio::task::JoinHandle<Option<std::path::PathBuf>>,
    ) -> (
        std::sync::Arc<crate::runtime::storage::StorageWatch>,
        crate::runtime::containerd::Baselined,
    ) {
        use crate::runtime::storage::Tree;
        let mut trees = Vec::new();
        let upper = if upper.is_finished() {
            trees.extend(upper.await.ok().flatten().map(|u| (Tree::WritableLayer, u)));
            None
        } else {
            Some(upper)
        };
        trees.extend(agent.map(|a| (Tree::AgentDir, a.to_path_buf())));
        trees.extend(plan.workspace.clone().map(|w| (Tree::Workspace, w)));
        // The static root is the container root's to write in, as a cold container's `/static`
        // in its rootfs is; here it is a host directory, counted as the rootfs would be (the
        // walk crosses no mount point: the assets bound in it are not counted).
        if !plan.assets.is_empty() {
            trees.push((Tree::WritableLayer, self.late_dir(id).join(late::STATIC_DIR)));
        }
        let (storage, baselined) = self.watch_storage_trees(plan, id, cgroup, trees);
        if let Some(upper) = upper {
            let watch = std::sync::Arc::downgrade(&storage);
            tokio::spawn(async move {
                if let (Ok(Some(upper)), Some(watch)) = (upper.await, watch.upgrade()) {
                    watch.add(Tree::WritableLayer, upper);
                }
            });
        }
        (storage, baselined)
    }

    /// A timeout or an interrupt: SIGTERM to every process of the member but its agent,
    /// and to the command's main process only when it handles SIGTERM (a cold container's
    /// init, PID 1, ignores signals it has no handler for), then SIGKILL after the grace.
    async fn stop_member(&self, member: &Member, dir: &std::os::fd::OwnedFd, sent: u64) -> bool {
        let main = agent::request_pid(dir, sent, member.init_pid, &member.cgroup);
        let spare_main = main.is_some_and(|pid| !catches(pid, Signal::SIGTERM));
        for pid in cgroupfs::procs(&member.cgroup) {
            if pid as u32 == member.init_pid || (spare_main && Some(pid) == main) {
                continue;
            }
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGTERM);
        }
        let grace = self.options.kill_grace;
        let waited = Instant::now();
        // The main process's end is what the grace waits for; the caller reads its status.
        while waited.elapsed() < grace {
            if main.is_none_or(|pid| nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_err()) {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        member.kill_all(&self.client).await;
        true
    }

    /// A live container (a session's sandbox) on a claimed member: setup runs first through
    /// the agent, as it runs in a cold container's init.
    pub async fn live_from_member(&self, mut member: Member, plan: &RunPlan) -> Result<LiveContainer, RuntimeError> {
        let id = member.id.clone();
        let userns = member.userns();
        let t0 = Instant::now();
        let upper = self.find_upper(&id);
        // Beside the member's readying (`Readying`); both are waited for, whatever fails.
        let static_back = member.static_back.take();
        let bound = async {
            self.seed_workspace(member.seed.as_deref(), plan).await?;
            self.bind_late_blocking(&member.id, &member.layout, userns, plan, static_back)
                .await
        }
        .await;
        super::super::claim_phase("bind late", t0);
        let readied = member.ready().await;
        let relabel = member.relabel;
        tokio::spawn(async move {
            if let Ok(Err(e)) = relabel.await {
                tracing::warn!(error = %e, "relabelling the claimed member");
            }
        });
        let built = async {
            bound?;
            readied?;
            let Readying::Ready(agent) = member.agent else {
                return Err(RuntimeError::Internal("the claimed member was not readied".into()));
            };
            let init_exited = CancellationToken::new();
            {
                let engine = self.clone();
                let id = id.clone();
                let token = init_exited.clone();
                tokio::spawn(async move {
                    let _ = engine.wait(&id, "").await;
                    token.cancel();
                });
            }
            let env = plan.env();
            let pool = member.pool.clone();
            let mut live = LiveContainer::new(
                self.clone(),
                Some(std::sync::Arc::new(agent)),
                member.init_pid,
                init_exited,
                id.clone(),
                member.cgroup.clone(),
                member.process.clone(),
                env.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            );
            live.pool = Some(pool);
            live.workspace = plan.workspace.clone();
            let agent_dir = live.agent_dir().map(std::path::Path::to_path_buf);
            let (storage, baselined) =
                (self.watch_member_storage(plan, &id, &live.cgroup, agent_dir.as_deref(), upper)).await;
            live.storage = Some(storage);
            *live.prelaunched.get_mut().expect("prelaunched lock") = self.adopt_prelaunched(&live, plan).await;
            // Measured beside the adoption; there before the session's first command.
            baselined.wait().await?;
            if spec::runs_setup(plan.job(), env) {
                let job = plan.job();
                let started = Instant::now();
                let request = crate::runtime::ExecRequest {
                    argv: vec![
                        spec::SHELL.to_string(),
                        "-c".to_string(),
                        spec::entry::setup_script(&env.setup),
                    ],
                    timeout: job.timeout.into_iter().chain(job.active_deadline).min(),
                    ..Default::default()
                };
                let r = live.agent_run(request, None).await?;
                live.set_setup(SetupResult {
                    exit_code: r.exit_code,
                    stdout: r.stdout,
                    stderr: r.stderr,
                    stdout_dropped_bytes: r.stdout_dropped_bytes,
                    stderr_dropped_bytes: r.stderr_dropped_bytes,
                    timed_out: r.timed_out,
                    duration_ms: started.elapsed().as_millis() as u64,
                });
            }
            Ok::<_, RuntimeError>(live)
        }
        .await;
        match built {
            Ok(live) => Ok(live),
            Err(e) => {
                let _ = self.teardown(&id).await;
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pooled_script_removes_shell_exports_the_job_does_not_set() {
        let s = pooled_script("req-0", &["env".into()], &[("SHLVL".into(), "5".into())], "/work");
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "cd '/work' || exit 126");
        assert_eq!(lines[1], "unset OLDPWD PWD");
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(s.replace(lines[0], "cd /"))
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("SHLVL=5"), "{text}");
        assert!(!text.contains("PWD="), "{text}");
    }

    #[test]
    fn signal_handlers_are_read_from_proc() {
        // This test process (Rust's runtime) installs no SIGTERM handler.
        assert!(!catches(std::process::id() as i32, Signal::SIGTERM));
        assert!(!catches(-1, Signal::SIGTERM));
    }
}
