//! `setup: {snapshot: true}`: an Environment's setup runs once, in a container of its own,
//! and what it made becomes an image (`snapshot:setup-KEY`); every later job and session of
//! the Environment starts from that image without running setup.
//!
//! The key is a hash of what the setup's result depends on: the image's unpacked layers (its
//! top chain: the same content under another tag keeps the key), the setup commands and the
//! environment, user, workdir and user-namespace mode they run with. Change any and the key
//! changes: the next use builds a new snapshot. (Not what a Job sets per attempt, such as
//! `JOB_COMPLETION_INDEX`: the setup that is run once runs without it.) One build per key at a time, across every
//! runner process of the state dir: a file lock (`STATE/snapshots/KEY.lock`) is held from the
//! check to the image record, so N concurrent first uses run setup once and the others start
//! from its snapshot. A failed build changes nothing: the job runs its setup as it would
//! without a snapshot (and reports its failure as usual).

use std::collections::HashMap;

use sha2::{Digest, Sha256};

use super::snapshot::{CommitRequest, LABEL_SNAPSHOT, LABEL_SNAPSHOT_BASE, LABEL_SNAPSHOT_SOURCE};
use super::*;
use crate::manifest::PullPolicy;
use crate::runtime::{Runtime, RuntimeError};
use crate::spec::RunPlan;

/// Label of a setup snapshot's image: its full key.
pub const LABEL_SETUP_KEY: &str = "runner.dev/setup-key";
/// Variables a Job sets per attempt (`job::supervisor::COMPLETION_INDEX_VAR`): a setup that
/// is run once for every attempt cannot see them, and they are not part of the key.
const PER_ATTEMPT_VARS: [&str; 1] = ["JOB_COMPLETION_INDEX"];
/// Where the build locks live, under the state dir.
const LOCK_DIR: &str = "snapshots";

impl Engine {
    /// The plan to run instead of `plan` when its Environment snapshots its setup: on the
    /// setup snapshot (built now if it is missing), with no setup. `None`: run `plan` as it is
    /// (no snapshot asked for, setup disabled, or the snapshot could not be made).
    pub(super) async fn on_setup_snapshot(&self, plan: &RunPlan) -> Option<RunPlan> {
        let env = plan.env();
        if !env.setup_snapshot || env.setup.is_empty() || plan.job().disable_setup {
            return None;
        }
        match self.setup_snapshot(plan).await {
            Ok(image) => {
                let mut on = plan.clone();
                on.bound.env.image = Some(image);
                on.bound.env.image_pull_policy = Some(PullPolicy::Never);
                on.bound.env.setup.clear();
                on.bound.env.setup_snapshot = false;
                Some(on)
            }
            Err(e) => {
                tracing::warn!(environment = env.name, error = %e, "no setup snapshot: running the setup");
                None
            }
        }
    }

    /// The image of `plan`'s setup snapshot, made if it is missing.
    async fn setup_snapshot(&self, plan: &RunPlan) -> Result<String, RuntimeError> {
        let env = plan.env();
        let base = env
            .image
            .clone()
            .ok_or_else(|| RuntimeError::Refused("spec.image is required".into()))?;
        let info =
            crate::image::remote::ensure(&self.client, &base, env.image_pull_policy, &self.options.registry).await?;
        let key = setup_key(plan, &info.top_chain);
        let name = format!("setup-{}", &key[..16]);
        let image = format!("snapshot:{name}");
        if self.client.image_get(&image).await?.is_some() {
            return Ok(image);
        }
        let dir = self.run_dir.parent().unwrap_or(&self.run_dir).join(LOCK_DIR);
        let lock_path = dir.join(format!("{key}.lock"));
        let _lock = tokio::task::spawn_blocking(move || -> std::io::Result<_> {
            std::fs::create_dir_all(&dir)?;
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&lock_path)?;
            nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive).map_err(|(_, e)| e.into())
        })
        .await
        .map_err(|e| RuntimeError::Internal(format!("the snapshot lock task: {e}")))?
        .map_err(|source| RuntimeError::Io {
            what: "taking the setup snapshot's lock".into(),
            source,
        })?;
        // Another runner may have made it while this one waited.
        if self.client.image_get(&image).await?.is_some() {
            return Ok(image);
        }
        self.build_setup_snapshot(plan, &base, &name, &image, &key).await?;
        Ok(image)
    }

    /// Run the setup in a container of its own and snapshot it.
    async fn build_setup_snapshot(
        &self,
        plan: &RunPlan,
        base: &str,
        name: &str,
        image: &str,
        key: &str,
    ) -> Result<(), RuntimeError> {
        let began = std::time::Instant::now();
        // Not from a pool (a member has not run this setup), with the init running it.
        let mut options = self.options.clone();
        options.use_pools = false;
        options.exec_via_agent = false;
        options.tools.clear();
        let engine = self.clone().with_options(options);
        let mut build = plan.clone();
        build.bound.env.setup_snapshot = false;
        for var in PER_ATTEMPT_VARS {
            build.bound.env.env.remove(var);
        }
        // (Boxed: spawn_live asks this module first, so the future would contain itself.)
        let live = Box::pin(engine.spawn_live(&build)).await?;
        let made = async {
            match live.setup() {
                Some(s) if s.succeeded() => {}
                Some(s) => {
                    return Err(RuntimeError::Refused(format!(
                        "the setup failed (exit {:?}{}): {}",
                        s.exit_code,
                        if s.timed_out { ", timed out" } else { "" },
                        s.stderr.trim()
                    )));
                }
                None => return Err(RuntimeError::Internal("the setup did not run".into())),
            }
            let container = self
                .client
                .containers(vec![format!("id=={}", live.id)])
                .await?
                .pop()
                .ok_or_else(|| RuntimeError::Internal(format!("container {} vanished", live.id)))?;
            let labels = HashMap::from([
                (LABEL_MANAGED.to_string(), "true".to_string()),
                (LABEL_SNAPSHOT.to_string(), name.to_string()),
                (
                    LABEL_SNAPSHOT_SOURCE.to_string(),
                    format!("setup of Environment {}", plan.env().name),
                ),
                (LABEL_SNAPSHOT_BASE.to_string(), base.to_string()),
                (LABEL_SETUP_KEY.to_string(), key.to_string()),
                (
                    super::snapshot::LABEL_SNAPSHOT_CREATED.to_string(),
                    humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
                ),
            ]);
            let request = CommitRequest {
                image: image.to_string(),
                labels,
                created_by: format!("setup of Environment {}", plan.env().name),
                limits: Default::default(),
                workspace: None,
            };
            self.commit(&container, &request).await
        }
        .await;
        if let Err(e) = live.cleanup().await {
            tracing::warn!(error = %e, "removing the setup snapshot's container");
        }
        let outcome = made?;
        tracing::info!(
            environment = plan.env().name,
            image,
            bytes = outcome.layer.size,
            ms = began.elapsed().as_millis() as u64,
            "setup snapshot made"
        );
        Ok(())
    }
}

/// What a setup's result depends on, hashed (hex).
fn setup_key(plan: &RunPlan, top_chain: &str) -> String {
    let env = plan.env();
    let mut h = Sha256::new();
    let mut part = |label: &str, value: &str| {
        h.update(label.as_bytes());
        h.update([0]);
        h.update(value.len().to_le_bytes());
        h.update(value.as_bytes());
    };
    part("layers", top_chain);
    for command in &env.setup {
        part("setup", command);
    }
    for (k, v) in env.env.iter().filter(|(k, _)| !PER_ATTEMPT_VARS.contains(&k.as_str())) {
        part("env", &format!("{k}={v}"));
    }
    part("user", &format!("{:?}", env.user));
    part("workdir", &env.workdir);
    part("hostUsers", if env.host_users { "true" } else { "false" });
    hex::encode(h.finalize())
}
