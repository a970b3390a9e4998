//! The Job verbs: registering jobs in the store, the detached supervisor, and
//! get / describe / logs / wait / delete (kubectl habits).

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::cli::{Global, OutputFormat};
use crate::commands::{CommandError, connect};
use crate::job::store::{JobRecord, Store, StoreError};
use crate::job::supervisor::{self, JobContext, attempt_file};
use crate::job::{self, JobObject, JobSpecView, JobStatus, ObjectMeta, Phase, Reason};
use crate::manifest::{self, Backend};
use crate::runtime::RuntimeOptions;
use crate::runtime::containerd::{self as ctd, Engine};
use crate::spec::{self, HostEnv, RunPlan};

/// How often `wait` and `logs -f` look at the store.
const POLL: Duration = Duration::from_millis(100);

pub fn reason_text(reason: Option<Reason>) -> String {
    reason
        .and_then(|r| serde_json::to_value(r).ok())
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default()
}

pub fn status_of(record: &JobRecord) -> JobStatus {
    serde_json::from_value(record.status.clone()).unwrap_or_else(|_| JobStatus::pending())
}

/// Record a job before running it. A finished job of the same name is replaced (apply runs
/// it again); a running one is refused.
pub fn register(
    store: &Store,
    plan: &RunPlan,
    manifest: &str,
    file: Option<&Path>,
    env_dir: Option<&Path>,
    backend: Option<Backend>,
) -> Result<(), CommandError> {
    let job = plan.job();
    if let Some(existing) = store.get(&job.name)? {
        let status = status_of(&existing);
        let alive = existing.owner.as_deref().is_some_and(ctd::owner_alive);
        if !status.is_terminal() && alive {
            return Err(CommandError::Usage(format!(
                "job {:?} is running (wait for it, or delete it: runner delete job {})",
                job.name, job.name
            )));
        }
        store.remove(&job.name)?;
    }
    let record = JobRecord {
        name: job.name.clone(),
        labels: job.labels.clone(),
        manifest: manifest.to_string(),
        base_dir: std::fs::canonicalize(&job.base_dir).unwrap_or_else(|_| job.base_dir.clone()),
        file: file.and_then(|f| f.canonicalize().ok()),
        env_dir: env_dir.and_then(|d| d.canonicalize().ok()),
        backend,
        status: serde_json::to_value(JobStatus::pending()).unwrap_or_default(),
        owner: None,
        delete_requested: false,
        created_at: job::rfc3339(std::time::SystemTime::now()),
        finished_at: None,
        ttl_seconds: job.ttl_after_finished.map(|d| d.as_secs()),
    };
    store.insert(&record)?;
    Ok(())
}

/// Rebuild a stored job's plan from its manifest text.
pub fn plan_of(record: &JobRecord, host: &HostEnv) -> Result<RunPlan, CommandError> {
    let mut set = manifest::parse_str(&record.manifest, &record.base_dir, record.file.as_deref())?;
    if let Some(dir) = &record.env_dir {
        set.env_dir = manifest::load_env_dir(dir)?;
        set.env_dir_path = Some(dir.clone());
    }
    let job = set
        .jobs
        .iter()
        .find(|j| j.name == record.name)
        .ok_or_else(|| CommandError::Usage(format!("the stored manifest of {} lost its Job", record.name)))?;
    let bound = set.bind(job, record.backend)?;
    Ok(spec::resolve(&bound, host)?)
}

/// Start `runner supervise NAME` detached: its own session, output to the job's log dir.
pub fn spawn_supervisor(global: &Global, name: &str, max_output_bytes: usize, adopt: bool) -> Result<(), CommandError> {
    let exe = std::env::current_exe().map_err(|e| CommandError::Output {
        what: "finding the runner binary",
        source: Box::new(e),
    })?;
    let dir = global.state_dir.join("logs").join(name);
    std::fs::create_dir_all(&dir).map_err(|e| CommandError::Output {
        what: "creating the log directory",
        source: Box::new(e),
    })?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("supervisor.log"))
        .map_err(|e| CommandError::Output {
            what: "creating the supervisor log",
            source: Box::new(e),
        })?;
    let log2 = log.try_clone().map_err(|e| CommandError::Output {
        what: "creating the supervisor log",
        source: Box::new(e),
    })?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("supervise")
        .arg(name)
        .arg("--max-output-bytes")
        .arg(max_output_bytes.to_string())
        .arg("--state-dir")
        .arg(&global.state_dir)
        .arg("--namespace")
        .arg(&global.namespace)
        .arg("--log")
        .arg(&global.log)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2);
    if let Some(address) = &global.address {
        cmd.arg("--address").arg(address);
    }
    if adopt {
        cmd.arg("--adopt");
    }
    // SAFETY: setsid is async-signal-safe; the child only calls it before exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().map_err(|e| CommandError::Output {
        what: "starting the supervisor",
        source: Box::new(e),
    })?;
    // Record the supervisor as the owner now (it records the same itself once running): until
    // then the job would look unsupervised, and `logs -f` or `describe` right after `apply
    // --detach` would take it for a job whose supervisor is gone.
    let pid = child.id();
    if let Some(start) = ctd::process_start_time(pid) {
        let owner = format!("{pid}:{start}");
        Store::open(&global.state_dir)?.update(name, |r| {
            if r.owner.as_deref().is_none_or(|o| o.starts_with("adopting:")) {
                r.owner = Some(owner.clone());
            }
        })?;
    }
    // Not waited for: it outlives this process on purpose.
    drop(child);
    Ok(())
}

/// `runner supervise NAME`: carry a stored job to its end (what `apply --detach` starts).
pub async fn supervise_cmd(
    global: &Global,
    name: &str,
    max_output_bytes: usize,
    adopt: bool,
) -> Result<i32, CommandError> {
    let store = Store::open(&global.state_dir)?;
    let record = store.require(name)?;
    drop(store);
    let host = HostEnv::detect(&global.state_dir);
    let plan = plan_of(&record, &host)?;
    let options = RuntimeOptions {
        output_limit: max_output_bytes,
        ..RuntimeOptions::default()
    };
    let engine = if plan.bound.backend == Backend::Containerd {
        Some(Engine::new(
            connect(global).await?,
            &global.state_dir,
            host.clone(),
            options.clone(),
        ))
    } else {
        None
    };
    let ctx = JobContext {
        plan,
        host,
        options,
        engine,
        state_dir: global.state_dir.clone(),
    };
    let cancel = CancellationToken::new();
    let on_signal = cancel.clone();
    tokio::spawn(async move {
        crate::signals::shutdown().await;
        on_signal.cancel();
    });
    let status = supervisor::supervise(ctx, name, cancel, adopt).await?;
    Ok(status.exit_code())
}

/// Drop finished jobs whose ttlSecondsAfterFinished has passed (records and logs).
pub async fn purge_expired(global: &Global, store: &Store) {
    let Ok(records) = store.list() else { return };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or_default();
    for r in records {
        if let (Some(done), Some(ttl)) = (r.finished_at, r.ttl_seconds)
            && done + ttl as i64 <= now
        {
            let _ = store.remove(&r.name);
            let _ = std::fs::remove_dir_all(global.state_dir.join("logs").join(&r.name));
        }
    }
}

/// The Job a stored record runs (its manifest re-parsed) and the backend it runs on: the
/// override given at apply, else its Environment's when that is in the same manifest.
fn stored_job(record: &JobRecord) -> Option<(manifest::Job, Backend)> {
    let set = manifest::parse_str(&record.manifest, &record.base_dir, None).ok()?;
    let job = set.jobs.iter().find(|j| j.name == record.name)?.clone();
    let backend = record
        .backend
        .or_else(|| {
            set.environments
                .iter()
                .find(|e| e.name == job.environment)
                .map(|e| e.backend)
        })
        .unwrap_or(Backend::Containerd);
    Some((job, backend))
}

pub fn object_of(record: &JobRecord) -> JobObject {
    object_with(record, stored_job(record).as_ref())
}

fn object_with(record: &JobRecord, job: Option<&(manifest::Job, Backend)>) -> JobObject {
    let command = job
        .map(|(j, _)| (j.command.argv(), j.environment.clone()))
        .unwrap_or_default();
    let backend = job.map_or(Backend::Containerd, |(_, b)| *b);
    JobObject {
        api_version: job::API_VERSION,
        kind: "Job",
        metadata: ObjectMeta {
            name: record.name.clone(),
            labels: record.labels.clone(),
            annotations: BTreeMap::new(),
        },
        spec: JobSpecView {
            environment: command.1,
            backend,
            command: command.0,
        },
        status: status_of(record),
    }
}

fn matches_selector(labels: &BTreeMap<String, String>, selector: &[(String, String)]) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

pub fn parse_selector(text: Option<&str>) -> Result<Vec<(String, String)>, CommandError> {
    let Some(text) = text else { return Ok(Vec::new()) };
    text.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .ok_or_else(|| CommandError::Usage(format!("-l {text:?}: expected key=value[,key=value]")))
        })
        .collect()
}

fn age(created: &str) -> String {
    let Ok(t) = humantime::parse_rfc3339(created) else {
        return "?".into();
    };
    let secs = t.elapsed().map(|d| d.as_secs()).unwrap_or(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s => format!("{}h", s / 3600),
    }
}

pub async fn get_jobs(
    global: &Global,
    selector: Option<&str>,
    output: Option<OutputFormat>,
) -> Result<i32, CommandError> {
    let store = Store::open(&global.state_dir)?;
    purge_expired(global, &store).await;
    let selector = parse_selector(selector)?;
    // One pass over the store: each record's manifest is parsed once.
    let rows: Vec<(JobObject, u32, String)> = store
        .list()?
        .iter()
        .filter(|r| matches_selector(&r.labels, &selector))
        .map(|r| {
            let job = stored_job(r);
            let completions = job.as_ref().map_or(1, |(j, _)| j.completions);
            (object_with(r, job.as_ref()), completions, age(&r.created_at))
        })
        .collect();
    match output {
        Some(OutputFormat::Json) | Some(OutputFormat::Yaml) => {
            let objects: Vec<&JobObject> = rows.iter().map(|(o, _, _)| o).collect();
            let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": objects});
            print_value(&list, output)?;
        }
        _ => {
            let wide = output == Some(OutputFormat::Wide);
            print!(
                "{:<28} {:<10} {:<22} {:<12} {:<6}",
                "NAME", "STATUS", "REASON", "COMPLETIONS", "AGE"
            );
            println!("{}", if wide { " ACTIVE FAILED COMMAND" } else { "" });
            for (o, completions, created) in &rows {
                let s = &o.status;
                print!(
                    "{:<28} {:<10} {:<22} {:<12} {:<6}",
                    o.metadata.name,
                    format!("{:?}", s.phase),
                    reason_text(s.reason),
                    format!("{}/{}", s.succeeded, completions),
                    created
                );
                if wide {
                    print!(" {:<6} {:<6} {}", s.active, s.failed, o.spec.command.join(" "));
                }
                println!();
            }
        }
    }
    Ok(0)
}

fn print_value(value: &serde_json::Value, output: Option<OutputFormat>) -> Result<(), CommandError> {
    let text = match output {
        Some(OutputFormat::Yaml) => serde_saphyr::to_string(value).map_err(|e| CommandError::Output {
            what: "encoding YAML",
            source: Box::new(e),
        })?,
        _ => {
            serde_json::to_string_pretty(value).map_err(|e| CommandError::Output {
                what: "encoding JSON",
                source: Box::new(e),
            })? + "\n"
        }
    };
    std::io::stdout()
        .write_all(text.as_bytes())
        .map_err(|e| CommandError::Output {
            what: "writing output",
            source: Box::new(e),
        })
}

pub async fn get_job(global: &Global, name: &str, output: Option<OutputFormat>) -> Result<i32, CommandError> {
    let store = Store::open(&global.state_dir)?;
    let record = store.require(name)?;
    let object = object_of(&record);
    match output {
        Some(OutputFormat::Json) | Some(OutputFormat::Yaml) => {
            print_value(&serde_json::to_value(&object).unwrap_or_default(), output)?
        }
        _ => crate::commands::print_wide(&[object]),
    }
    Ok(0)
}

pub async fn describe_job(global: &Global, name: &str) -> Result<i32, CommandError> {
    let store = Store::open(&global.state_dir)?;
    let record = store.require(name)?;
    let o = object_of(&record);
    let s = &o.status;
    println!("Name:         {}", o.metadata.name);
    let labels: Vec<String> = o.metadata.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!(
        "Labels:       {}",
        if labels.is_empty() {
            "<none>".into()
        } else {
            labels.join(",")
        }
    );
    println!("Environment:  {}", o.spec.environment);
    println!("Backend:      {}", o.spec.backend.as_str());
    println!("Command:      {}", o.spec.command.join(" "));
    println!("Created:      {}", record.created_at);
    println!("Start Time:   {}", s.start_time.as_deref().unwrap_or("-"));
    println!("Completed At: {}", s.completion_time.as_deref().unwrap_or("-"));
    println!("Phase:        {:?}", s.phase);
    println!("Reason:       {}", reason_text(s.reason));
    if let Some(m) = &s.message {
        println!("Message:      {m}");
    }
    println!(
        "Attempts:     {} active / {} succeeded / {} failed",
        s.active, s.succeeded, s.failed
    );
    if let Some(owner) = &record.owner {
        let alive = ctd::owner_alive(owner);
        println!("Supervisor:   {owner} ({})", if alive { "running" } else { "gone" });
    }
    println!("Conditions:");
    if s.conditions.is_empty() {
        println!("  <none>");
    }
    for c in &s.conditions {
        println!(
            "  {:<9} {:<6} {:<22} {} {}",
            c.kind, c.status, c.reason, c.last_transition_time, c.message
        );
    }
    println!("Attempt list:");
    println!(
        "  {:<6} {:<8} {:<10} {:<20} {:<6} STARTED",
        "INDEX", "ATTEMPT", "PHASE", "REASON", "EXIT"
    );
    for a in &s.attempts {
        println!(
            "  {:<6} {:<8} {:<10} {:<20} {:<6} {}",
            a.index,
            a.attempt,
            format!("{:?}", a.phase),
            reason_text(a.reason),
            a.exit_code.map(|c| c.to_string()).unwrap_or_else(|| "-".into()),
            a.start_time.as_deref().unwrap_or("-")
        );
    }
    println!("Events:");
    for e in store.events(name)? {
        println!("  {:<24} {:<8} {:<16} {}", e.time, e.kind, e.reason, e.message);
    }
    Ok(0)
}

/// Which attempts `logs` prints: all of index I / attempt N when given, else the last
/// attempt of every index.
fn selected(status: &JobStatus, attempt: Option<u32>, index: Option<u32>) -> Vec<(u32, u32)> {
    let mut out: BTreeMap<u32, u32> = BTreeMap::new();
    for a in &status.attempts {
        if index.is_some_and(|i| i != a.index) {
            continue;
        }
        if let Some(n) = attempt {
            if a.attempt == n {
                out.insert(a.index, n);
            }
            continue;
        }
        let e = out.entry(a.index).or_insert(a.attempt);
        *e = (*e).max(a.attempt);
    }
    out.into_iter().collect()
}

pub async fn logs(
    global: &Global,
    name: &str,
    follow: bool,
    attempt: Option<u32>,
    index: Option<u32>,
) -> Result<i32, CommandError> {
    let store = Store::open(&global.state_dir)?;
    let logs_dir = global.state_dir.join("logs");
    let mut printed: std::collections::HashSet<(u32, u32)> = Default::default();
    // With -f: how far each running attempt's live output was printed (stdout, stderr).
    let mut streamed: std::collections::HashMap<(u32, u32), [u64; 2]> = Default::default();
    loop {
        let record = store.require(name)?;
        let status = status_of(&record);
        let done = status.is_terminal() || !record.owner.as_deref().is_some_and(ctd::owner_alive);
        for (i, n) in selected(&status, attempt, index) {
            if printed.contains(&(i, n)) {
                continue;
            }
            let finished = status
                .attempts
                .iter()
                .any(|a| a.index == i && a.attempt == n && a.completion_time.is_some());
            let file = |ext: &str| attempt_file(&logs_dir, name, i, n, ext);
            if !finished {
                if follow {
                    // Running: print what its logger has appended since the last look.
                    let offsets = streamed.entry((i, n)).or_default();
                    for (k, stream) in STREAMS.into_iter().enumerate() {
                        print_new(&file(&format!("live.{stream}")), &mut offsets[k], k);
                    }
                }
                continue;
            }
            // Ended. Followed while it ran: the rest of its live copy (the host backend has
            // none: then the stored output). Otherwise the stored output, exactly.
            let followed = streamed.remove(&(i, n));
            let mut offsets = followed.unwrap_or_default();
            for (k, stream) in STREAMS.into_iter().enumerate() {
                let copy = file(&format!("live.{stream}"));
                let source = if followed.is_some() && (copy.exists() || offsets[k] > 0) {
                    copy
                } else {
                    file(stream)
                };
                print_new(&source, &mut offsets[k], k);
            }
            let stored: Option<crate::runtime::ExecResult> = std::fs::read(file("json"))
                .ok()
                .and_then(|j| serde_json::from_slice(&j).ok());
            if let Some(r) =
                stored.filter(|r| followed.is_some() && r.stdout_dropped_bytes + r.stderr_dropped_bytes > 0)
            {
                eprintln!(
                    "runner: attempt {i}-{n} printed more than the output cap; {} stdout and {} stderr bytes are not kept (`runner logs {name}` shows the head and tail)",
                    r.stdout_dropped_bytes, r.stderr_dropped_bytes
                );
            }
            printed.insert((i, n));
        }
        if !follow || done {
            return Ok(0);
        }
        tokio::time::sleep(POLL).await;
    }
}

const STREAMS: [&str; 2] = ["stdout", "stderr"];

/// Print what `path` holds past `*offset` to stdout (`stream` 0) or stderr (1) and advance
/// the offset; a missing file prints nothing.
fn print_new(path: &Path, offset: &mut u64, stream: usize) {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut file) = std::fs::File::open(path) else {
        return;
    };
    let mut data = Vec::new();
    if file.seek(SeekFrom::Start(*offset)).is_err() || file.read_to_end(&mut data).is_err() || data.is_empty() {
        return;
    }
    *offset += data.len() as u64;
    let _ = if stream == 0 {
        let mut out = std::io::stdout().lock();
        out.write_all(&data).and_then(|()| out.flush())
    } else {
        std::io::stderr().write_all(&data)
    };
}

/// A job that is not finished and whose supervisor is gone gets a new supervisor, which
/// re-adopts its running containers. Several callers may race: the store transaction that
/// claims the job lets only one of them spawn.
pub fn adopt_if_orphaned(global: &Global, record: &JobRecord) -> Result<(), CommandError> {
    let status = status_of(record);
    let orphaned = !status.is_terminal()
        && !record.delete_requested
        && record.owner.as_deref().is_some_and(|o| !ctd::owner_alive(o));
    if !orphaned {
        return Ok(());
    }
    let claim = format!("adopting:{}", ctd::owner_id());
    let mut store = Store::open(&global.state_dir)?;
    let claimed = store.update(&record.name, |r| {
        if r.owner == record.owner {
            r.owner = Some(claim.clone());
        }
    })?;
    drop(store);
    if claimed.owner.as_deref() == Some(claim.as_str()) {
        eprintln!("runner: job {} lost its supervisor; re-adopting it", record.name);
        spawn_supervisor(global, &record.name, crate::runtime::output::DEFAULT_OUTPUT_LIMIT, true)?;
    }
    Ok(())
}

pub async fn wait(global: &Global, name: &str, timeout: Option<Duration>) -> Result<i32, CommandError> {
    let store = Store::open(&global.state_dir)?;
    let start = Instant::now();
    loop {
        let record = store.require(name)?;
        let status = status_of(&record);
        if status.is_terminal() {
            eprintln!("job/{name} {:?} ({})", status.phase, reason_text(status.reason));
            return Ok(if status.phase == Phase::Succeeded { 0 } else { 1 });
        }
        adopt_if_orphaned(global, &record)?;
        if timeout.is_some_and(|t| start.elapsed() >= t) {
            eprintln!(
                "job/{name}: still {:?} after {:?}",
                status.phase,
                timeout.unwrap_or_default()
            );
            return Ok(2);
        }
        tokio::time::sleep(POLL).await;
    }
}

pub async fn delete_job(global: &Global, name: &str) -> Result<i32, CommandError> {
    delete(global, name).await?;
    println!("job.runner/{name} deleted");
    Ok(0)
}

/// Stop a job and remove its containers, record and logs.
pub async fn delete(global: &Global, name: &str) -> Result<(), CommandError> {
    let mut store = Store::open(&global.state_dir)?;
    let record = match store.update(name, |r| r.delete_requested = true) {
        Ok(r) => r,
        Err(StoreError::NotFound(_)) => return Err(CommandError::Usage(format!("job {name:?} not found"))),
        Err(e) => return Err(e.into()),
    };
    // The supervisor sees the request, stops the attempts (SIGTERM, grace, SIGKILL) and ends.
    if let Some(owner) = &record.owner {
        let start = Instant::now();
        while ctd::owner_alive(owner) && start.elapsed() < Duration::from_secs(60) {
            let status = status_of(&store.require(name)?);
            if status.is_terminal() {
                break;
            }
            tokio::time::sleep(POLL).await;
        }
        while ctd::owner_alive(owner) && start.elapsed() < Duration::from_secs(60) {
            tokio::time::sleep(POLL).await;
        }
    }
    // Whatever is left (a supervisor that died): remove the job's containers directly.
    let host = HostEnv::detect(&global.state_dir);
    if plan_of(&record, &host).is_ok_and(|p| p.bound.backend == Backend::Containerd) {
        let client = connect(global).await?;
        let filter = format!("labels.\"{}\"=={name}", ctd::LABEL_JOB);
        let engine = Engine::new(client.clone(), &global.state_dir, host, RuntimeOptions::default());
        for c in client.containers(vec![filter]).await? {
            engine.teardown(&c.id).await.ok();
        }
    }
    store.remove(name)?;
    let _ = std::fs::remove_dir_all(global.state_dir.join("logs").join(name));
    Ok(())
}

/// Submit a manifest's jobs to run detached (the HTTP API's POST /v1/jobs).
pub fn submit(
    global: &Global,
    text: &str,
    base_dir: &Path,
    env_dir: Option<&Path>,
) -> Result<Vec<String>, CommandError> {
    let mut set = manifest::parse_str(text, base_dir, None)?;
    if let Some(dir) = env_dir {
        set.env_dir = manifest::load_env_dir(dir)?;
        set.env_dir_path = Some(dir.to_path_buf());
    }
    if set.jobs.is_empty() {
        return Err(CommandError::Usage("the manifest holds no Job".into()));
    }
    let host = HostEnv::detect(&global.state_dir);
    let plans = crate::commands::plans(&set, &host, None)?;
    let store = Store::open(&global.state_dir)?;
    let mut names = Vec::new();
    for plan in &plans {
        register(&store, plan, text, None, env_dir, None)?;
        spawn_supervisor(
            global,
            &plan.job().name,
            crate::runtime::output::DEFAULT_OUTPUT_LIMIT,
            false,
        )?;
        names.push(plan.job().name.clone());
    }
    Ok(names)
}

/// Every job as an object (GET /v1/jobs).
pub fn job_objects(global: &Global) -> Result<Vec<JobObject>, CommandError> {
    Ok(Store::open(&global.state_dir)?.list()?.iter().map(object_of).collect())
}

/// One job as an object.
pub fn job_object(global: &Global, name: &str) -> Result<JobObject, CommandError> {
    let store = Store::open(&global.state_dir)?;
    let record = store.require(name)?;
    adopt_if_orphaned(global, &record)?;
    Ok(object_of(&record))
}

/// A job's stdout: the last attempt of every index, in index order.
pub fn job_output(global: &Global, name: &str) -> Result<String, CommandError> {
    let store = Store::open(&global.state_dir)?;
    let status = status_of(&store.require(name)?);
    let logs_dir = global.state_dir.join("logs");
    let mut out = String::new();
    for (i, n) in selected(&status, None, None) {
        out.push_str(&String::from_utf8_lossy(
            &std::fs::read(attempt_file(&logs_dir, name, i, n, "stdout")).unwrap_or_default(),
        ));
    }
    Ok(out)
}
