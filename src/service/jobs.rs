//! Jobs: plan a manifest, submit it (detached or in the foreground), list, get, describe,
//! logs, wait, delete, adopt jobs whose supervisor died, purge expired ones. Every store call
//! runs on the blocking pool.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use tokio_util::sync::CancellationToken;

use super::reconcile::{self, adopt_if_orphaned, spawn_supervisor};
use super::{Context, ServiceError};
use crate::job::selector::Selector;
use crate::job::store::{EventRecord, JobRecord, SharedStore, StoreError};
use crate::job::supervisor::{self, JobContext};
use crate::job::{self, JobObject, JobSpecView, JobStatus, ObjectMeta};
use crate::manifest::{self, Backend, ManifestSet};
use crate::owner::owner_alive;
use crate::spec::{self, HostEnv, RunPlan};

/// How often `wait` and `logs -f` look at the store.
pub(super) const POLL: Duration = Duration::from_millis(100);
/// How long `delete` waits for a job's supervisor to stop what runs.
const DELETE_LIMIT: Duration = Duration::from_secs(60);

/// A manifest read, validated and planned: every job bound to its Environment, host paths
/// resolved, containerd specs built and checked against the hardened default.
pub struct Submission {
    /// The manifest text as read (what is stored is what was validated).
    pub text: String,
    pub base_dir: PathBuf,
    pub file: Option<PathBuf>,
    pub env_dir: Option<PathBuf>,
    /// `--backend`: run every job on this backend instead of its Environment's.
    pub backend: Option<Backend>,
    pub environments: usize,
    /// `kind: Network` documents.
    pub networks: usize,
    /// `kind: WarmPool` documents (checked against their Environments).
    pub pools: Vec<manifest::WarmPool>,
    pub plans: Vec<RunPlan>,
    /// Replace finished jobs of the same names (`--replace`); without it they are a conflict,
    /// as Kubernetes answers AlreadyExists.
    pub replace: bool,
    /// Bytes kept per output stream of each job (`--max-output-bytes`; the config's unless a
    /// CLI handed its own over).
    pub output_limit: usize,
}

impl Submission {
    /// A manifest file (`validate`, `apply`), with the config's env dir unless one is given.
    pub fn from_file(
        ctx: &Context,
        file: &Path,
        env_dir: Option<&Path>,
        backend: Option<Backend>,
    ) -> Result<Self, ServiceError> {
        let env_dir = env_dir.or(ctx.config.env_dir.as_deref());
        let (set, text) = manifest::load_file_text(file, env_dir)?;
        Self::planned(
            ctx,
            set,
            text,
            manifest::base_dir_of(file),
            Some(file),
            env_dir,
            backend,
        )
    }

    /// A manifest file another process read (a CLI's hand-off to `runner serve`): errors
    /// name it as `shown`, and it is recorded (and its relative paths resolve) as `absolute`;
    /// only the given env dir is used, as the CLI would.
    pub fn handed(
        ctx: &Context,
        text: String,
        shown: &Path,
        absolute: &Path,
        env_dir: Option<&Path>,
        backend: Option<Backend>,
    ) -> Result<Self, ServiceError> {
        let base_dir = manifest::base_dir_of(absolute);
        let set = manifest::parse_file_text(&text, shown, &base_dir, env_dir)?;
        Self::planned(ctx, set, text, base_dir, Some(absolute), env_dir, backend)
    }

    /// Manifest text (`POST /v1/jobs`): relative paths resolve against `base_dir`.
    pub fn from_text(ctx: &Context, text: &str, base_dir: &Path) -> Result<Self, ServiceError> {
        let env_dir = ctx.config.env_dir.as_deref();
        let set = with_env_dir(manifest::parse_str(text, base_dir, None)?, env_dir)?;
        Self::planned(ctx, set, text.to_string(), base_dir.to_path_buf(), None, env_dir, None)
    }

    fn planned(
        ctx: &Context,
        set: ManifestSet,
        text: String,
        base_dir: PathBuf,
        file: Option<&Path>,
        env_dir: Option<&Path>,
        backend: Option<Backend>,
    ) -> Result<Self, ServiceError> {
        let plans = plan_all(&set, &ctx.host, backend)?;
        for pool in &set.pools {
            set.pool_environment(pool)?;
        }
        Ok(Submission {
            text,
            base_dir,
            file: file.map(Path::to_path_buf),
            env_dir: env_dir.map(Path::to_path_buf),
            backend,
            environments: set.environments.len(),
            networks: set.networks.len(),
            pools: set.pools.clone(),
            plans,
            replace: false,
            output_limit: ctx.config.output_limit,
        })
    }

    fn require_jobs(&self) -> Result<(), ServiceError> {
        if self.plans.is_empty() {
            let what = self
                .file
                .as_ref()
                .map_or("the manifest".to_string(), |f| f.display().to_string());
            return Err(ServiceError::field("kind", format!("{what} holds no Job")));
        }
        Ok(())
    }
}

fn with_env_dir(mut set: ManifestSet, env_dir: Option<&Path>) -> Result<ManifestSet, ServiceError> {
    if let Some(dir) = env_dir {
        set.use_env_dir(dir)?;
    }
    Ok(set)
}

/// Bind and resolve every job; containerd jobs also get their spec built and checked.
fn plan_all(set: &ManifestSet, host: &HostEnv, backend: Option<Backend>) -> Result<Vec<RunPlan>, ServiceError> {
    let mut out = Vec::new();
    for job in &set.jobs {
        let bound = set.bind(job, backend)?;
        let plan = spec::resolve(&bound, host)?;
        if bound.backend == Backend::Containerd {
            let built = spec::build(&plan, host)?;
            let violations = spec::hardening::violations(&built, plan.env().host_users);
            if !violations.is_empty() {
                return Err(ServiceError::internal(
                    format!("the spec for job {:?}", job.name),
                    format!("it is not hardened: {}", violations.join("; ")),
                ));
            }
        }
        out.push(plan);
    }
    Ok(out)
}

/// The OCI spec containerd would run for one job of a manifest file (`runner spec`). A host
/// Environment is shown as containerd would run it.
pub fn spec_of(
    ctx: &Context,
    file: &Path,
    env_dir: Option<&Path>,
    job_name: Option<&str>,
) -> Result<serde_json::Value, ServiceError> {
    let set = manifest::load_file(file, env_dir.or(ctx.config.env_dir.as_deref()))?;
    let job = match job_name {
        Some(name) => set
            .jobs
            .iter()
            .find(|j| j.name == name)
            .ok_or_else(|| ServiceError::field("--job", format!("no job {name:?} in {}", file.display())))?,
        None => match set.jobs.as_slice() {
            [only] => only,
            [] => return Err(ServiceError::field("kind", format!("{} holds no Job", file.display()))),
            many => {
                let names: Vec<&str> = many.iter().map(|j| j.name.as_str()).collect();
                return Err(ServiceError::field(
                    "--job",
                    format!(
                        "{} holds several jobs ({}); choose one",
                        file.display(),
                        names.join(", ")
                    ),
                ));
            }
        },
    };
    let bound = set.bind(job, Some(Backend::Containerd))?;
    let plan = spec::resolve(&bound, &ctx.host)?;
    let built = spec::build(&plan, &ctx.host)?;
    spec::to_json(&built).map_err(|e| ServiceError::internal("encoding the spec", e))
}

async fn store(ctx: &Context) -> Result<SharedStore, ServiceError> {
    ctx.store().await
}

fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or_default()
}

/// An image a submission's Environment names that is not present in containerd.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MissingImage {
    pub environment: String,
    pub image: String,
    /// Local images a few edits away (a typo's likely targets).
    pub near: Vec<String>,
    /// `imagePullPolicy: Never`: running it will fail.
    pub never_pulled: bool,
}

/// The images of a submission's containerd Environments that are not present locally, where
/// their pull policy would use a local one (`IfNotPresent`, `Never`). `None` when no containerd
/// answers (none is started for this: checking is only worth a warning).
pub async fn missing_images(ctx: &Context, sub: &Submission) -> Option<Vec<MissingImage>> {
    let (client, _) = super::daemon::connect(&ctx.config, super::Connect::Existing)
        .await
        .ok()?;
    let mut missing: Vec<MissingImage> = Vec::new();
    for plan in sub.plans.iter().filter(|p| p.bound.backend == Backend::Containerd) {
        let env = plan.env();
        let Some(image) = &env.image else { continue };
        let policy = env
            .image_pull_policy
            .unwrap_or_else(|| manifest::PullPolicy::default_for(image));
        if policy == manifest::PullPolicy::Always || missing.iter().any(|m| &m.image == image) {
            continue;
        }
        // As `image::remote::ensure` looks: the name as written, then its canonical form.
        let mut present = false;
        for name in [
            crate::image::normalize_name(image),
            crate::image::remote::canonical_name(image),
        ]
        .into_iter()
        .flatten()
        {
            present |= crate::image::resolve(&client, &name).await.is_ok();
        }
        if !present {
            missing.push(MissingImage {
                environment: env.name.clone(),
                image: image.clone(),
                near: crate::image::remote::near_local_names(&client, image).await,
                never_pulled: policy == manifest::PullPolicy::Never,
            });
        }
    }
    Some(missing)
}

/// Why a submission's job cannot be recorded.
enum Clash {
    Running(String),
    Exists(String, job::Phase),
}

/// Record the jobs of a submission before running them, all or none. A job of the same name is
/// a conflict (Kubernetes' AlreadyExists): its record and logs stay until it is deleted, or
/// until a submission with `replace` (then a finished one is replaced); a running one is a
/// conflict either way.
async fn register(ctx: &Context, store: &SharedStore, sub: &Submission) -> Result<(), ServiceError> {
    let records: Vec<JobRecord> = sub
        .plans
        .iter()
        .map(|plan| {
            let job = plan.job();
            JobRecord {
                metadata: ObjectMeta::of(job),
                manifest: sub.text.clone(),
                base_dir: std::fs::canonicalize(&job.base_dir).unwrap_or_else(|_| job.base_dir.clone()),
                file: sub.file.as_ref().and_then(|f| f.canonicalize().ok()),
                env_dir: sub.env_dir.as_ref().and_then(|d| d.canonicalize().ok()),
                backend: sub.backend,
                view: JobSpecView::of(plan),
                status: JobStatus::pending(),
                output_limit: sub.output_limit,
                owner: None,
                delete_requested: false,
                created_at: job::rfc3339(SystemTime::now()),
                finished_at: None,
                ttl_seconds: job.ttl_after_finished.map(|d| d.as_secs()),
            }
        })
        .collect();
    let replace = sub.replace;
    let logs = ctx.config.logs_dir();
    let conflict = store
        .call(move |s| {
            // Every name first: a submission is recorded whole or not at all.
            let mut replaced = Vec::new();
            for record in &records {
                match s.get(record.name()) {
                    Ok(Some(existing)) => {
                        let alive = existing.owner.as_deref().is_some_and(owner_alive);
                        if !existing.status.is_terminal() && alive {
                            return Ok(Some(Clash::Running(record.name().to_string())));
                        }
                        if !replace {
                            return Ok(Some(Clash::Exists(record.name().to_string(), existing.status.phase)));
                        }
                        replaced.push(record.name().to_string());
                    }
                    // An unreadable record of that name is replaced, as a finished one is.
                    Err(StoreError::Corrupt { .. }) => replaced.push(record.name().to_string()),
                    Ok(None) => {}
                    Err(e) => return Err(e),
                }
            }
            for name in &replaced {
                s.remove(name)?;
                // The old run's output goes with its record (as `delete` removes it).
                let _ = std::fs::remove_dir_all(logs.join(name));
            }
            for record in &records {
                s.insert(record)?;
            }
            Ok(None)
        })
        .await?;
    match conflict {
        Some(Clash::Running(name)) => Err(ServiceError::Conflict(format!(
            "job {name:?} is running (wait for it, or delete it: runner delete job {name})"
        ))),
        Some(Clash::Exists(name, phase)) => Err(ServiceError::Conflict(format!(
            "job {name:?} already exists ({phase:?}): delete it first (runner delete job {name}) or apply again with --replace"
        ))),
        None => Ok(()),
    }
}

/// Submit the jobs of a manifest to run detached: each gets a supervisor process. Their names.
pub async fn start_detached(ctx: &Context, sub: &Submission) -> Result<Vec<String>, ServiceError> {
    sub.require_jobs()?;
    if sub.plans.iter().any(|p| p.bound.backend == Backend::Containerd) {
        // Refused now (503 over HTTP) rather than accepted into a job that can never start.
        ctx.containerd().await?;
    }
    let store = store(ctx).await?;
    purge_expired(ctx, &store).await;
    register(ctx, &store, sub).await?;
    let mut names = Vec::new();
    for plan in &sub.plans {
        let name = plan.job().name.clone();
        spawn_supervisor(ctx, &store, &name, false).await?;
        names.push(name);
    }
    Ok(names)
}

/// Submit manifest text to run detached (`POST /v1/jobs`); `replace`: as `apply --replace`.
pub async fn submit(ctx: &Context, text: &str, base_dir: &Path, replace: bool) -> Result<Vec<String>, ServiceError> {
    let mut sub = {
        let (ctx, text, base_dir) = (ctx.clone(), text.to_string(), base_dir.to_path_buf());
        Context::blocking(move || Submission::from_text(&ctx, &text, &base_dir)).await?
    };
    sub.replace = replace;
    if let Some(pool) = sub.pools.first() {
        return Err(ServiceError::field(
            "kind",
            format!(
                "WarmPool {:?}: pools are made by `runner apply` or kept by `runner serve --pool`, not submitted as jobs",
                pool.name
            ),
        ));
    }
    start_detached(ctx, &sub).await
}

/// Run the jobs of a submission in this process, one after another, each to its end (or
/// until `cancel`); `on_done` sees each as it ends. The last status of each.
pub async fn run_foreground(
    ctx: &Context,
    sub: &Submission,
    cancel: CancellationToken,
    on_done: impl FnMut(&RunPlan, &JobObject),
) -> Result<Vec<JobObject>, ServiceError> {
    run_in_process(ctx, sub, cancel, on_done, Reconcile::Now).await
}

/// Whether a foreground run first tidies what dead runner processes left.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reconcile {
    /// A CLI's own run: nothing else of this state dir may be running to do it.
    Now,
    /// Inside `runner serve`, which reconciles at start-up and on the housekeeping tick after
    /// it took applies: once per handed-over apply would be 20 listings of containerd for a
    /// burst of 20.
    Left,
}

pub(crate) async fn run_in_process(
    ctx: &Context,
    sub: &Submission,
    cancel: CancellationToken,
    mut on_done: impl FnMut(&RunPlan, &JobObject),
    reconcile: Reconcile,
) -> Result<Vec<JobObject>, ServiceError> {
    sub.require_jobs()?;
    let store = store(ctx).await?;
    purge_expired(ctx, &store).await;
    register(ctx, &store, sub).await?;
    if sub.plans.iter().any(|p| p.bound.backend == Backend::Containerd) {
        // Connect now (a missing containerd fails before anything runs) and reconcile off the
        // job's path: it only removes what dead runner processes left, idempotently.
        ctx.containerd().await?;
        if reconcile == Reconcile::Now {
            let ctx = ctx.clone();
            tokio::spawn(async move { reconcile::reconcile(&ctx).await });
        }
    }
    let mut objects = Vec::new();
    for plan in &sub.plans {
        let name = plan.job().name.clone();
        let status = supervise_plan(ctx, &store, plan.clone(), &name, cancel.clone(), false).await?;
        let object = JobObject::new(ObjectMeta::of(plan.job()), JobSpecView::of(plan), status);
        on_done(plan, &object);
        objects.push(object);
        if cancel.is_cancelled() {
            break;
        }
    }
    Ok(objects)
}

/// Carry one stored job to its end in this process.
async fn supervise_plan(
    ctx: &Context,
    store: &SharedStore,
    plan: RunPlan,
    name: &str,
    cancel: CancellationToken,
    adopt: bool,
) -> Result<JobStatus, ServiceError> {
    let output_limit = {
        let name = name.to_string();
        store.call(move |s| s.require(&name)).await?.output_limit
    };
    let mut options = ctx.runtime_options();
    options.output_limit = output_limit;
    let engine = match plan.bound.backend {
        Backend::Containerd => Some(ctx.engine(options.clone()).await?),
        Backend::Host => None,
    };
    let job_ctx = JobContext {
        backoff_base: ctx.config.backoff_base,
        plan,
        host: ctx.host.clone(),
        options,
        engine,
        state_dir: ctx.config.state_dir.clone(),
        store: store.clone(),
    };
    Ok(supervisor::supervise(job_ctx, name, cancel, adopt).await?)
}

/// `runner supervise NAME`: carry a stored job to its end (what `apply --detach` and
/// re-adoption start). With `adopt`, pick up the attempts a dead supervisor left running.
pub async fn supervise(
    ctx: &Context,
    name: &str,
    adopt: bool,
    cancel: CancellationToken,
) -> Result<JobStatus, ServiceError> {
    let store = store(ctx).await?;
    let record = {
        let name = name.to_string();
        store.call(move |s| s.require(&name)).await?
    };
    let plan = {
        let host = ctx.host.clone();
        Context::blocking(move || plan_of(&record, &host)).await?
    };
    supervise_plan(ctx, &store, plan, name, cancel, adopt).await
}

/// Rebuild a stored job's plan from its manifest text, env dir and backend override.
fn plan_of(record: &JobRecord, host: &HostEnv) -> Result<RunPlan, ServiceError> {
    let set = with_env_dir(
        manifest::parse_str(&record.manifest, &record.base_dir, record.file.as_deref())?,
        record.env_dir.as_deref(),
    )?;
    let job = set.jobs.iter().find(|j| j.name == record.name()).ok_or_else(|| {
        ServiceError::internal(
            format!("job {:?}", record.name()),
            "its stored manifest no longer holds it",
        )
    })?;
    let bound = set.bind(job, record.backend)?;
    Ok(spec::resolve(&bound, host)?)
}

/// Drop finished jobs whose ttlSecondsAfterFinished has passed (records and logs). Failing to
/// purge never fails the caller: it is housekeeping, logged.
async fn purge_expired(ctx: &Context, store: &SharedStore) {
    let logs = ctx.config.logs_dir();
    let purged = store
        .call(move |s| {
            let now = now_secs();
            let mut gone = Vec::new();
            for (name, finished, ttl) in s.expiry()? {
                if let (Some(done), Some(ttl)) = (finished, ttl)
                    && done + ttl as i64 <= now
                {
                    s.remove(&name)?;
                    let _ = std::fs::remove_dir_all(logs.join(&name));
                    gone.push(name);
                }
            }
            Ok(gone)
        })
        .await;
    match purged {
        Ok(gone) if !gone.is_empty() => tracing::info!(?gone, "removed jobs past ttlSecondsAfterFinished"),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "purging expired jobs failed"),
    }
}

/// Drop finished jobs whose ttlSecondsAfterFinished has passed.
pub async fn purge(ctx: &Context) -> Result<(), ServiceError> {
    purge_expired(ctx, &store(ctx).await?).await;
    Ok(())
}

/// One job as `get jobs` lists it.
pub struct Listed {
    pub object: JobObject,
    pub created_at: String,
}

/// A label selector as kubectl takes them (`job::selector`); none selects every job.
pub fn parse_selector(text: Option<&str>) -> Result<Selector, ServiceError> {
    let Some(text) = text else {
        return Ok(Selector::default());
    };
    Selector::parse(text).map_err(|why| ServiceError::field("selector", why))
}

/// Every job whose labels match the selector. A read: it changes nothing (`purge` drops
/// expired jobs; `get jobs` and `GET /v1/jobs` call it first, as every submit does).
pub async fn list(ctx: &Context, selector: &Selector) -> Result<Vec<Listed>, ServiceError> {
    let store = store(ctx).await?;
    let records = store.call(|s| s.list()).await?;
    Ok(records
        .into_iter()
        .filter(|r| selector.matches(&r.metadata.labels))
        .map(|r| Listed {
            object: r.object(),
            created_at: r.created_at,
        })
        .collect())
}

/// One job with its status. A read: it changes nothing.
pub async fn get(ctx: &Context, name: &str) -> Result<JobObject, ServiceError> {
    Ok(record(ctx, name).await?.object())
}

pub(super) async fn record(ctx: &Context, name: &str) -> Result<JobRecord, ServiceError> {
    let name = name.to_string();
    Ok(store(ctx).await?.call(move |s| s.require(&name)).await?)
}

/// A job in detail.
pub struct Described {
    pub object: JobObject,
    pub created_at: String,
    /// The supervising process's owner id, and whether it runs.
    pub supervisor: Option<(String, bool)>,
    pub events: Vec<EventRecord>,
}

pub async fn describe(ctx: &Context, name: &str) -> Result<Described, ServiceError> {
    let job = name.to_string();
    let (record, events) = store(ctx)
        .await?
        .call(move |s| Ok((s.require(&job)?, s.events(&job)?)))
        .await?;
    Ok(Described {
        object: record.object(),
        supervisor: record.owner.clone().map(|o| {
            let alive = owner_alive(&o);
            (o, alive)
        }),
        created_at: record.created_at,
        events,
    })
}

/// How a wait ended.
pub enum Waited {
    Finished(JobStatus),
    /// Still running when the timeout passed.
    TimedOut(JobStatus),
}

/// Wait until a job ends. A job whose supervisor died is re-adopted (explicitly: waiting for it
/// is what needs it to end).
pub async fn wait(ctx: &Context, name: &str, timeout: Option<Duration>) -> Result<Waited, ServiceError> {
    let start = Instant::now();
    loop {
        let record = record(ctx, name).await?;
        if record.status.is_terminal() {
            return Ok(Waited::Finished(record.status));
        }
        adopt_if_orphaned(ctx, name).await?;
        if timeout.is_some_and(|t| start.elapsed() >= t) {
            return Ok(Waited::TimedOut(record.status));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Stop a job and remove its containers, record and logs.
pub async fn delete(ctx: &Context, name: &str) -> Result<(), ServiceError> {
    let store = store(ctx).await?;
    let requested = {
        let name = name.to_string();
        store
            .call(move |s| s.update(&name, |r| r.delete_requested = true))
            .await
    };
    // A record too damaged to read is still deleted: its backend is then unknown.
    let (owner, backend, ran) = match requested {
        Ok(record) => (
            record.owner,
            Some(record.view.backend),
            !record.status.attempts.is_empty(),
        ),
        Err(StoreError::Corrupt { .. }) => (None, None, true),
        Err(e) => return Err(e.into()),
    };
    // The supervisor sees the request, stops the attempts (SIGTERM, grace, SIGKILL) and ends.
    if let Some(owner) = &owner {
        let start = Instant::now();
        while owner_alive(owner) && start.elapsed() < DELETE_LIMIT {
            tokio::time::sleep(POLL).await;
        }
    }
    // Whatever is left (a supervisor that died): the job's containers, removed directly.
    if backend != Some(Backend::Host) {
        let engine = match ctx.engine(ctx.runtime_options()).await {
            Ok(engine) => engine,
            // No containerd, and the job never started an attempt (or its backend is
            // unknown): nothing of it can be there to remove.
            Err(ServiceError::Unavailable { .. }) if backend.is_none() || !ran => {
                return remove_record(&store, ctx, name).await;
            }
            Err(e) => return Err(e),
        };
        for c in engine.job_containers(name, None).await? {
            if let Err(e) = engine.teardown(&c.id).await {
                tracing::warn!(container = c.id, error = %e, "removing a container of the deleted job");
            }
        }
    }
    remove_record(&store, ctx, name).await
}

async fn remove_record(store: &SharedStore, ctx: &Context, name: &str) -> Result<(), ServiceError> {
    let (job, logs) = (name.to_string(), ctx.config.logs_dir().join(name));
    store
        .call(move |s| {
            s.remove(&job)?;
            match std::fs::remove_dir_all(&logs) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(StoreError::Io { path: logs, source: e }),
                _ => Ok(()),
            }
        })
        .await?;
    Ok(())
}
