//! The verbs behind the CLI. Each returns the process exit code or a `CommandError` that
//! `main` prints as one line and maps to exit 2.

use std::io::Write;

use tokio_util::sync::CancellationToken;

use std::path::Path;

use crate::cli::{DEFAULT_ADDRESS, DaemonVerb, FileArgs, Global, ImageVerb, OutputFormat};
use crate::daemon::{self, DaemonPaths};
use crate::image::{self, ImportOptions};
use crate::job::{self, JobObject, JobStatus};
use crate::manifest::{self, Backend, ManifestError, ManifestSet};
use crate::runtime::RuntimeOptions;
use crate::runtime::containerd::client::{Containerd, CtdError};
use crate::runtime::containerd::{self as ctd, Engine};
use crate::spec::{self, HostEnv, SpecError};

/// Why the runner could not do its work (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Containerd(#[from] CtdError),
    #[error(transparent)]
    Daemon(#[from] daemon::DaemonError),
    #[error(transparent)]
    Image(#[from] image::ImageError),
    #[error(transparent)]
    Store(#[from] job::store::StoreError),
    #[error("{what}: {source}")]
    Output {
        what: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

fn load(args: &FileArgs) -> Result<ManifestSet, CommandError> {
    Ok(manifest::load_file(&args.file, args.env_dir.as_deref())?)
}

/// Bind and resolve every job; containerd jobs also get their spec built (and checked).
pub fn plans(set: &ManifestSet, host: &HostEnv, backend: Option<Backend>) -> Result<Vec<spec::RunPlan>, CommandError> {
    let mut out = Vec::new();
    for job in &set.jobs {
        let bound = set.bind(job, backend)?;
        let plan = spec::resolve(&bound, host)?;
        if bound.backend == Backend::Containerd {
            let built = spec::build(&plan, host)?;
            let violations = spec::hardening::violations(&built);
            if !violations.is_empty() {
                return Err(CommandError::Usage(format!(
                    "internal error: the spec for job {:?} is not hardened: {}",
                    job.name,
                    violations.join("; ")
                )));
            }
        }
        out.push(plan);
    }
    Ok(out)
}

pub fn validate(global: &Global, args: &FileArgs) -> Result<i32, CommandError> {
    let set = load(args)?;
    let host = HostEnv::detect(&global.state_dir);
    let plans = plans(&set, &host, None)?;
    println!(
        "{}: valid ({} environment{}, {} job{})",
        args.file.display(),
        set.environments.len(),
        if set.environments.len() == 1 { "" } else { "s" },
        plans.len(),
        if plans.len() == 1 { "" } else { "s" },
    );
    Ok(0)
}

pub fn print_spec(global: &Global, args: &FileArgs, job_name: Option<&str>) -> Result<i32, CommandError> {
    let set = load(args)?;
    let host = HostEnv::detect(&global.state_dir);
    let job = match job_name {
        Some(name) => set
            .jobs
            .iter()
            .find(|j| j.name == name)
            .ok_or_else(|| CommandError::Usage(format!("no job {name:?} in {}", args.file.display())))?,
        None => match set.jobs.as_slice() {
            [only] => only,
            [] => {
                return Err(CommandError::Usage(format!("{} holds no Job", args.file.display())));
            }
            many => {
                let names: Vec<&str> = many.iter().map(|j| j.name.as_str()).collect();
                return Err(CommandError::Usage(format!(
                    "{} holds several jobs ({}); choose one with --job",
                    args.file.display(),
                    names.join(", ")
                )));
            }
        },
    };
    // The spec is containerd's by definition; a host Environment is shown as containerd would run it.
    let bound = set.bind(job, Some(Backend::Containerd))?;
    let plan = spec::resolve(&bound, &host)?;
    let built = spec::build(&plan, &host)?;
    let text = spec::to_json(&built)
        .and_then(|v| serde_json::to_string_pretty(&v))
        .map_err(|e| CommandError::Output {
            what: "encoding the spec",
            source: Box::new(e),
        })?;
    println!("{text}");
    Ok(0)
}

pub async fn apply(
    global: &Global,
    args: &FileArgs,
    output: Option<OutputFormat>,
    backend: Option<Backend>,
    max_output_bytes: usize,
    detach: bool,
) -> Result<i32, CommandError> {
    let set = load(args)?;
    if set.jobs.is_empty() {
        return Err(CommandError::Usage(format!(
            "{} holds no Job to apply",
            args.file.display()
        )));
    }
    let host = HostEnv::detect(&global.state_dir);
    let plans = plans(&set, &host, backend)?;
    let manifest = std::fs::read_to_string(&args.file).map_err(|e| CommandError::Output {
        what: "re-reading the manifest",
        source: Box::new(e),
    })?;
    let store = job::store::Store::open(&global.state_dir)?;
    crate::jobcmd::purge_expired(global, &store).await;
    for plan in &plans {
        crate::jobcmd::register(
            &store,
            plan,
            &manifest,
            Some(&args.file),
            args.env_dir.as_deref(),
            backend,
        )?;
    }
    if detach {
        for plan in &plans {
            crate::jobcmd::spawn_supervisor(global, &plan.job().name, max_output_bytes, false)?;
            println!("job.runner/{} created", plan.job().name);
        }
        return Ok(0);
    }
    let options = RuntimeOptions {
        output_limit: max_output_bytes,
        ..RuntimeOptions::default()
    };
    let engine = if plans.iter().any(|p| p.bound.backend == Backend::Containerd) {
        let client = connect(global).await?;
        // Off the job's path: it only removes what dead runner processes left, and is
        // idempotent if this process ends before it finishes.
        {
            let (client, global) = (client.clone(), global.clone());
            tokio::spawn(async move { reconcile(&client, &global).await });
        }
        Some(Engine::new(client, &global.state_dir, host.clone(), options.clone()))
    } else {
        None
    };
    let cancel = CancellationToken::new();
    let stopped_by = std::sync::Arc::new(std::sync::OnceLock::new());
    {
        let (cancel, stopped_by) = (cancel.clone(), stopped_by.clone());
        tokio::spawn(async move {
            let _ = stopped_by.set(crate::signals::shutdown().await);
            cancel.cancel();
        });
    }
    let mut objects = Vec::new();
    let mut code = 0;
    for plan in &plans {
        let ctx = job::supervisor::JobContext {
            plan: plan.clone(),
            host: host.clone(),
            options: options.clone(),
            engine: engine.clone(),
            state_dir: global.state_dir.clone(),
        };
        let status = job::supervisor::supervise(ctx, &plan.job().name, cancel.clone(), false).await?;
        code = worst(code, status.exit_code());
        if output.is_none() {
            print_human(plan, &status);
        }
        objects.push(JobObject::new(plan, status));
        if cancel.is_cancelled() {
            break;
        }
    }
    match output {
        None => {}
        Some(OutputFormat::Wide) => print_wide(&objects),
        Some(format) => print_objects(&objects, format)?,
    }
    // Stopped by a signal: exit as a process ended by it would (130 for Ctrl-C, 143 for SIGTERM).
    Ok(stopped_by.get().map_or(code, |s| s.exit_code()))
}

/// Combine exit codes: a runner failure outranks a job failure, which outranks success.
pub fn worst(a: i32, b: i32) -> i32 {
    let rank = |c: i32| match c {
        0 => 0,
        1 => 1,
        2 => 3,
        _ => 2,
    };
    if rank(b) > rank(a) { b } else { a }
}

pub fn print_objects(objects: &[JobObject], format: OutputFormat) -> Result<(), CommandError> {
    let value = match objects {
        [one] => serde_json::to_value(one),
        many => serde_json::to_value(serde_json::json!({
            "apiVersion": "v1",
            "kind": "List",
            "items": many,
        })),
    }
    .map_err(|e| CommandError::Output {
        what: "encoding the result",
        source: Box::new(e),
    })?;
    let text = match format {
        OutputFormat::Yaml => serde_saphyr::to_string(&value).map_err(|e| CommandError::Output {
            what: "encoding the result as YAML",
            source: Box::new(e),
        })?,
        _ => {
            serde_json::to_string_pretty(&value).map_err(|e| CommandError::Output {
                what: "encoding the result",
                source: Box::new(e),
            })? + "\n"
        }
    };
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes()).map_err(|e| CommandError::Output {
        what: "writing the result",
        source: Box::new(e),
    })?;
    Ok(())
}

pub fn print_wide(objects: &[JobObject]) {
    println!(
        "{:<24} {:<10} {:<18} {:>5} {:>10} {:<11} COMMAND",
        "NAME", "PHASE", "REASON", "EXIT", "DURATION", "BACKEND"
    );
    for o in objects {
        let result = o.status.result.as_ref();
        println!(
            "{:<24} {:<10} {:<18} {:>5} {:>10} {:<11} {}",
            o.metadata.name,
            format!("{:?}", o.status.phase),
            serde_json::to_value(o.status.reason)
                .ok()
                .and_then(|v| v.as_str().map(String::from))
                .unwrap_or_default(),
            result
                .map(|r| r.status_code().to_string())
                .unwrap_or_else(|| "-".into()),
            result
                .map(|r| format!("{}ms", r.duration_ms))
                .unwrap_or_else(|| "-".into()),
            o.spec.backend.as_str(),
            o.spec.command.join(" "),
        );
    }
}

/// Default output: the job's own stdout and stderr on ours, then one status line on stderr.
pub fn print_human(plan: &spec::RunPlan, status: &JobStatus) {
    let mut stdout = std::io::stdout().lock();
    let mut stderr = std::io::stderr().lock();
    if let Some(r) = &status.result {
        if let Some(setup) = r.setup.as_ref().filter(|s| !s.succeeded()) {
            let _ = stdout.write_all(setup.stdout.as_bytes());
            let _ = stderr.write_all(setup.stderr.as_bytes());
        }
        let _ = stdout.write_all(r.stdout.as_bytes());
        let _ = stdout.flush();
        let _ = stderr.write_all(r.stderr.as_bytes());
        if r.stdout_dropped_bytes > 0 || r.stderr_dropped_bytes > 0 {
            let _ = writeln!(
                stderr,
                "runner: output capped: {} stdout and {} stderr bytes dropped",
                r.stdout_dropped_bytes, r.stderr_dropped_bytes
            );
        }
    }
    let reason = serde_json::to_value(status.reason)
        .ok()
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default();
    let detail = match (&status.result, &status.message) {
        (Some(r), _) => format!(" exit={} {}ms", r.status_code(), r.duration_ms),
        (None, Some(m)) => format!(" {m}"),
        (None, None) => String::new(),
    };
    let _ = writeln!(stderr, "job/{} {:?} ({reason}){detail}", plan.job().name, status.phase);
}

/// Valid containerd namespace: alphanumeric words joined by `.`, `_` or `-`.
fn check_namespace(ns: &str) -> Result<(), CommandError> {
    let ok = !ns.is_empty()
        && ns.len() <= 76
        && ns
            .split(['.', '_', '-'])
            .all(|w| !w.is_empty() && w.bytes().all(|b| b.is_ascii_alphanumeric()));
    if ok {
        Ok(())
    } else {
        Err(CommandError::Usage(format!(
            "--namespace {ns:?} is not a valid containerd namespace (letters and digits joined by . _ -)"
        )))
    }
}

/// Connect to containerd: the address given, else the system daemon at the default
/// address, else runner's private daemon under the state dir (started on first use).
pub async fn connect(global: &Global) -> Result<Containerd, CommandError> {
    check_namespace(&global.namespace)?;
    if let Some(address) = &global.address {
        return Ok(Containerd::connect(address, &global.namespace).await?);
    }
    let default = Path::new(DEFAULT_ADDRESS);
    let system = Containerd::connect(default, &global.namespace).await;
    if let Ok(client) = system {
        return Ok(client);
    }
    let paths = DaemonPaths::new(&global.state_dir);
    if daemon::running(&paths).is_none() {
        if !daemon::installed() {
            return Err(system.unwrap_err().into());
        }
        let pid = daemon::start(&paths).await?;
        eprintln!(
            "runner: no containerd at {DEFAULT_ADDRESS}; started a private one (pid {pid}, socket {}; `runner daemon stop` stops it)",
            paths.socket.display()
        );
    }
    Ok(Containerd::connect(&paths.socket, &global.namespace).await?)
}

/// Start-up reconciliation: remove what runner processes that are gone left behind.
async fn reconcile(client: &Containerd, global: &Global) {
    match gc_orphans(client, global, false).await {
        Ok(report) if report.total() > 0 => tracing::info!(?report, "removed orphans of dead runner processes"),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "start-up reconciliation failed"),
    }
}

/// A run directory without an owner mark (made by an older runner) counts as abandoned after this.
const UNMARKED_RUN_DIR_AGE: std::time::Duration = std::time::Duration::from_secs(600);

#[derive(Debug, Default, serde::Serialize)]
pub struct GcReport {
    pub containers: Vec<String>,
    pub snapshots: Vec<String>,
    pub leases: Vec<String>,
    pub fifo_dirs: Vec<String>,
    /// Job attempts whose runner died, kept for re-adoption by their job's store.
    pub kept: Vec<String>,
    /// Cgroup directories (per hierarchy) of containers that are gone, and their parent.
    pub cgroups: Vec<String>,
}

impl GcReport {
    fn total(&self) -> usize {
        self.containers.len() + self.snapshots.len() + self.leases.len() + self.fifo_dirs.len() + self.cgroups.len()
    }
}

/// Remove every container, snapshot and lease labelled as runner's whose owning runner
/// process is gone, and FIFO directories of containers that no longer exist; with
/// `cgroups`, also the cgroups runc leaves behind.
pub async fn gc_orphans(client: &Containerd, global: &Global, cgroups: bool) -> Result<GcReport, CommandError> {
    let managed = format!("labels.\"{}\"==true", ctd::LABEL_MANAGED);
    let host = HostEnv::detect(&global.state_dir);
    let engine = Engine::new(client.clone(), &global.state_dir, host, RuntimeOptions::default());
    let dead = |labels: &std::collections::HashMap<String, String>| {
        labels.get(ctd::LABEL_OWNER).is_none_or(|o| !ctd::owner_alive(o))
    };
    let mut report = GcReport::default();
    let containers = client.containers(vec![managed.clone()]).await?;
    let ours = engine.state_dir();
    let store = job::store::Store::open(&global.state_dir)?;
    let mut orphaned_jobs = std::collections::BTreeMap::new();
    for c in &containers {
        if !dead(&c.labels) {
            continue;
        }
        // A Job attempt outlives its runner on purpose: the job's store re-adopts it (the next
        // `wait`, `logs`, `get`). Only that store may judge it; another store's attempts are
        // left alone unless that store is gone.
        if c.labels.contains_key(ctd::LABEL_ATTEMPT) {
            let adoptable = match c.labels.get(ctd::LABEL_STATE_DIR).map(std::path::PathBuf::from) {
                Some(dir) if dir != ours => dir.join(job::store::DB_FILE).exists(),
                Some(_) => match c
                    .labels
                    .get(ctd::LABEL_JOB)
                    .and_then(|name| store.get(name).ok().flatten())
                {
                    Some(record) if !record.delete_requested && !crate::jobcmd::status_of(&record).is_terminal() => {
                        orphaned_jobs.insert(record.name.clone(), record);
                        true
                    }
                    _ => false,
                },
                None => false,
            };
            if adoptable {
                report.kept.push(c.id.clone());
                continue;
            }
        }
        engine.teardown(&c.id).await.ok();
        report.containers.push(c.id.clone());
    }
    // Orphaned attempts of our store get a supervisor that re-adopts them (their result is
    // recorded, their containers removed when they end).
    for record in orphaned_jobs.values() {
        crate::jobcmd::adopt_if_orphaned(global, record)?;
    }
    let live: std::collections::HashSet<String> = client
        .containers(vec![managed.clone()])
        .await?
        .into_iter()
        .map(|c| c.id)
        .collect();
    for s in client.snapshots(vec![managed.clone()]).await? {
        if !live.contains(&s.name) && dead(&s.labels) {
            client.snapshot_remove(&s.name).await?;
            report.snapshots.push(s.name);
        }
    }
    for l in client.leases(vec![managed]).await? {
        if dead(&l.labels) {
            client.lease_delete(&l.id).await?;
            report.leases.push(l.id);
        }
    }
    if let Ok(entries) = std::fs::read_dir(global.state_dir.join("run")) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            // A directory is filled before its container is created: only one whose owner is
            // gone (or, unmarked, that is old) can be a leftover.
            let owner = std::fs::read_to_string(e.path().join(ctd::RUN_DIR_OWNER)).ok();
            let abandoned = match owner {
                Some(owner) => !ctd::owner_alive(owner.trim()),
                None => e
                    .metadata()
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > UNMARKED_RUN_DIR_AGE)),
            };
            if !live.contains(&name) && abandoned && std::fs::remove_dir_all(e.path()).is_ok() {
                report.fifo_dirs.push(name);
            }
        }
    }
    // Only on an explicit `runner gc`: start-up reconciliation runs beside other jobs of the
    // namespace. The listing is taken right before the removal: a container created after it
    // reaches runc's mkdir only after its shim starts (tens of ms later), so no cgroup of a
    // starting container is removed under it.
    if cgroups {
        let existing: std::collections::HashSet<String> =
            client.containers(Vec::new()).await?.into_iter().map(|c| c.id).collect();
        report.cgroups = crate::runtime::cgroupfs::remove_stale(&engine.cgroup_parent(), &existing)
            .into_iter()
            .map(|p| p.display().to_string())
            .collect();
    }
    Ok(report)
}

pub async fn gc(global: &Global) -> Result<i32, CommandError> {
    let client = connect(global).await?;
    let report = gc_orphans(&client, global, true).await?;
    println!(
        "removed {} containers, {} snapshots, {} leases, {} FIFO directories, {} cgroups",
        report.containers.len(),
        report.snapshots.len(),
        report.leases.len(),
        report.fifo_dirs.len(),
        report.cgroups.len()
    );
    for c in &report.containers {
        println!("container/{c}");
    }
    for c in &report.kept {
        println!("kept container/{c}: a job attempt whose runner died, re-adopted by its job's store");
    }
    Ok(0)
}

pub async fn image_cmd(global: &Global, verb: &ImageVerb) -> Result<i32, CommandError> {
    let client = connect(global).await?;
    match verb {
        ImageVerb::Import {
            file,
            name,
            cmd,
            env,
            workdir,
            user,
        } => {
            let cmd = match cmd {
                Some(text) if text.trim_start().starts_with('[') => Some(
                    serde_json::from_str::<Vec<String>>(text)
                        .map_err(|e| CommandError::Usage(format!("--cmd: not a JSON array of strings: {e}")))?,
                ),
                Some(text) => Some(vec!["/bin/sh".to_string(), "-c".to_string(), text.clone()]),
                None => None,
            };
            let options = ImportOptions {
                name: name.clone(),
                cmd,
                env: env.clone(),
                workdir: workdir.clone(),
                user: user.clone(),
            };
            for imported in image::import(&client, file, &options).await? {
                println!(
                    "imported {} ({} archive, {} layer{}, {})",
                    imported.name,
                    imported.format,
                    imported.layers,
                    if imported.layers == 1 { "" } else { "s" },
                    imported.digest
                );
            }
            Ok(0)
        }
        ImageVerb::Ls { output } => {
            let images = client.images().await?;
            let rows: Vec<serde_json::Value> = images
                .iter()
                .map(|i| {
                    let t = i.target.clone().unwrap_or_default();
                    serde_json::json!({"name": i.name, "digest": t.digest, "mediaType": t.media_type, "size": t.size})
                })
                .collect();
            match output {
                Some(OutputFormat::Json) => println!("{}", serde_json::to_string_pretty(&rows).unwrap_or_default()),
                Some(OutputFormat::Yaml) => print!("{}", serde_saphyr::to_string(&rows).unwrap_or_default()),
                _ => {
                    println!("{:<40} {:<20} MEDIA TYPE", "NAME", "DIGEST");
                    for i in &images {
                        let t = i.target.clone().unwrap_or_default();
                        let short = t.digest.get(7..19).unwrap_or(&t.digest);
                        println!("{:<40} {:<20} {}", i.name, short, t.media_type);
                    }
                }
            }
            Ok(0)
        }
        ImageVerb::Rm { names } => {
            if names.is_empty() {
                return Err(CommandError::Usage("runner image rm NAME...".into()));
            }
            for name in names {
                let name = image::normalize_name(name)?;
                match client.image_delete(&name).await {
                    Ok(()) => println!("deleted {name}"),
                    Err(e) if e.is_not_found() => {
                        return Err(CommandError::Usage(format!("image {name} is not present")));
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            Ok(0)
        }
    }
}

pub async fn daemon_cmd(global: &Global, verb: &DaemonVerb) -> Result<i32, CommandError> {
    let paths = DaemonPaths::new(&global.state_dir);
    match verb {
        DaemonVerb::Start => {
            let pid = daemon::start(&paths).await?;
            println!("containerd running (pid {pid}) at {}", paths.socket.display());
            Ok(0)
        }
        DaemonVerb::Stop => {
            match daemon::stop(&paths).await? {
                Some(pid) => println!("stopped containerd (pid {pid})"),
                None => println!("no private containerd was running"),
            }
            Ok(0)
        }
        DaemonVerb::Status => match daemon::running(&paths) {
            Some(pid) => {
                println!("running (pid {pid}) at {}", paths.socket.display());
                Ok(0)
            }
            None => {
                println!("stopped");
                Ok(1)
            }
        },
    }
}

/// `runner serve`.
pub async fn serve(
    global: &Global,
    listen: Option<std::net::SocketAddr>,
    socket: Option<&Path>,
    token_file: &Path,
    env_dir: Option<&Path>,
    session_ttl: std::time::Duration,
) -> Result<i32, CommandError> {
    let token = std::fs::read_to_string(token_file)
        .map_err(|e| CommandError::Usage(format!("--token-file {}: {e}", token_file.display())))?;
    let token = token.trim().as_bytes().to_vec();
    if token.len() < 16 {
        return Err(CommandError::Usage("the token must be at least 16 characters".into()));
    }
    let engine = match connect(global).await {
        Ok(client) => {
            let host = HostEnv::detect(&global.state_dir);
            Some(Engine::new(client, &global.state_dir, host, RuntimeOptions::default()))
        }
        Err(e) => {
            eprintln!("runner: containerd is not available ({e}); only host-backend sessions will work");
            None
        }
    };
    let state = std::sync::Arc::new(crate::api::AppState::new(
        token,
        global.clone(),
        engine,
        env_dir.map(Path::to_path_buf),
        session_ttl,
    ));
    let app = crate::api::router(state.clone());
    {
        let state = state.clone();
        let every = (session_ttl / 4).clamp(std::time::Duration::from_secs(1), std::time::Duration::from_secs(30));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                state.reap_idle().await;
            }
        });
    }
    let shutdown = async {
        crate::signals::shutdown().await;
    };
    let io = |what: &'static str| {
        move |e: std::io::Error| CommandError::Output {
            what,
            source: Box::new(e),
        }
    };
    match (listen, socket) {
        (_, Some(path)) => {
            let _ = std::fs::remove_file(path);
            let listener = tokio::net::UnixListener::bind(path).map_err(io("binding the socket"))?;
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                .map_err(io("chmod of the socket"))?;
            println!("listening on unix:{}", path.display());
            let _ = std::io::Write::flush(&mut std::io::stdout());
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
                .map_err(io("serving"))?;
        }
        (listen, None) => {
            let addr = listen.unwrap_or_else(|| "127.0.0.1:8080".parse().expect("valid address"));
            if !addr.ip().is_loopback() {
                return Err(CommandError::Usage(format!(
                    "--listen {addr}: only loopback addresses (use --socket, or a proxy with TLS, for more)"
                )));
            }
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(io("binding the address"))?;
            println!(
                "listening on http://{}",
                listener.local_addr().map_err(io("reading the address"))?
            );
            let _ = std::io::Write::flush(&mut std::io::stdout());
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
                .map_err(io("serving"))?;
        }
    }
    state.close_all().await;
    Ok(0)
}
