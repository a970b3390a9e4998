//! The Job verbs: validate, spec, apply, get, describe, logs, wait, delete, supervise.

use super::output::{out, outln};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::output::{self, age, one_line, print_human, print_objects, print_value, print_wide, reason_text, worst};
use super::{FileArgs, OutputFormat};
use crate::job::{JobObject, Phase};
use crate::manifest::Backend;
use crate::service::jobs::{self, Submission, Waited};
use crate::service::logs::{self, LogChunk, LogOptions, Logs, Prefixer, Stream};
use crate::service::{Context, ServiceError, pools};

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// Run blocking planning (manifest files, host paths) off the async workers.
async fn submission(ctx: &Context, file: &FileArgs, backend: Option<Backend>) -> Result<Submission, ServiceError> {
    let (ctx, path) = (ctx.clone(), file.file.clone());
    Context::blocking(move || Submission::from_file(&ctx, &path, None, backend)).await
}

pub async fn validate(ctx: &Context, file: &FileArgs) -> Result<i32, ServiceError> {
    let sub = submission(ctx, file, None).await?;
    outln!(
        "{}: valid ({} environment{}, {} job{}{}{})",
        file.file.display(),
        sub.environments,
        plural(sub.environments),
        sub.plans.len(),
        plural(sub.plans.len()),
        match sub.networks {
            0 => String::new(),
            n => format!(", {n} network{}", plural(n)),
        },
        match sub.pools.len() {
            0 => String::new(),
            n => format!(", {n} warm pool{}", plural(n)),
        }
    );
    // Valid, but maybe not runnable here: images a typo or a missing import would make the
    // apply pull (or fail), said now. Only where a containerd answers; none is started for it.
    for m in jobs::missing_images(ctx, &sub).await.unwrap_or_default() {
        let near = match m.near.as_slice() {
            [] => String::new(),
            names => format!(" (did you mean {}?)", names.join(" or ")),
        };
        let then = if m.never_pulled {
            "imagePullPolicy is Never: the job will fail"
        } else {
            "apply will try to pull it"
        };
        eprintln!(
            "runner: warning: Environment {:?}: image {:?} is not present locally{near}; {then} (see `runner image ls`)",
            m.environment, m.image
        );
    }
    Ok(0)
}

pub async fn spec(ctx: &Context, file: &FileArgs, job: Option<String>) -> Result<i32, ServiceError> {
    let (ctx, path) = (ctx.clone(), file.file.clone());
    let spec = Context::blocking(move || jobs::spec_of(&ctx, &path, None, job.as_deref())).await?;
    print_value(&spec, Some(OutputFormat::Json))?;
    Ok(0)
}

/// How `apply` runs and prints.
pub struct ApplyHow {
    pub format: Option<OutputFormat>,
    pub backend: Option<Backend>,
    pub detach: bool,
    pub replace: bool,
    /// Print only this completion index's output.
    pub index: Option<u32>,
}

pub async fn apply(ctx: &Context, file: &FileArgs, how: ApplyHow) -> Result<i32, ServiceError> {
    let ApplyHow {
        format,
        backend,
        detach,
        replace,
        index,
    } = how;
    // The jobs run in this process: a reader of its output going away stops the printing,
    // never the jobs (they end with their results recorded).
    output::keep_running_without_stdout();
    let mut sub = submission(ctx, file, backend).await?;
    sub.replace = replace;
    // Warm pools first: the file's jobs can claim their members.
    for pool in &sub.pools {
        let (def, report) = pools::create(
            ctx,
            &pool.name,
            &pool.environment,
            &file.file,
            pool.size,
            pool.workspace,
            pool.static_assets,
            pool.snapshot.clone(),
        )
        .await?;
        eprintln!(
            "warmpool.runner/{} ready: {} member{} of Environment {}{}",
            def.name,
            report.ready,
            plural(report.ready),
            def.environment,
            def.snapshot
                .as_ref()
                .map(|s| format!(" from snapshot {s}"))
                .unwrap_or_default()
        );
    }
    if sub.plans.is_empty() && !sub.pools.is_empty() {
        return Ok(0);
    }
    if detach {
        for name in jobs::start_detached(ctx, &sub).await? {
            if format == Some(OutputFormat::Name) {
                outln!("job.runner/{name}");
            } else {
                outln!("job.runner/{name} created");
            }
        }
        return Ok(0);
    }
    let cancel = CancellationToken::new();
    let stopped_by = Arc::new(OnceLock::new());
    {
        let (cancel, stopped_by) = (cancel.clone(), stopped_by.clone());
        let grace = ctx.config.shutdown_grace;
        tokio::spawn(async move {
            let signal = crate::signals::shutdown().await;
            let _ = stopped_by.set(signal);
            cancel.cancel();
            // Stopping the attempts (SIGTERM, their grace, SIGKILL, teardown) normally ends
            // well inside the grace period; a containerd that stopped answering must not
            // keep the stop waiting. What is left is the next `get`'s or `wait`'s to adopt.
            tokio::time::sleep(grace).await;
            eprintln!(
                "runner: the jobs did not stop within the {} shutdown grace period; exiting (`runner get` re-adopts what is left and records its result)",
                humantime::format_duration(grace)
            );
            std::process::exit(signal.exit_code());
        });
    }
    let mut code = 0;
    let logs_dir = ctx.config.logs_dir();
    let objects = jobs::run_foreground(ctx, &sub, cancel, |_, object: &JobObject| {
        code = worst(code, object.status.exit_code());
        if format.is_none() {
            print_ended(&logs_dir, object, index);
        }
    })
    .await?;
    print_applied(&objects, format)?;
    // Stopped by a signal: exit as a process ended by it would (130 for Ctrl-C, 143 for SIGTERM).
    Ok(stopped_by.get().map_or(code, |s| s.exit_code()))
}

/// A foreground apply's job as it ends (without `-o`): every index's output (the last attempt
/// of each), prefixed when there are several, and its status line.
pub(super) fn print_ended(logs_dir: &std::path::Path, object: &JobObject, index: Option<u32>) {
    let name = &object.metadata.name;
    match logs::results(logs_dir, name, &object.status, index) {
        Ok(results) => {
            let prefix = index.is_none() && object.spec.completions > 1;
            print_human(name, &object.status, &results, prefix)
        }
        Err(e) => {
            eprintln!("runner: {e}");
            print_human(name, &object.status, &[], false)
        }
    }
}

/// A foreground apply's jobs once all ended, in the `-o` format asked for.
pub(super) fn print_applied(objects: &[JobObject], format: Option<OutputFormat>) -> Result<(), ServiceError> {
    match format {
        None => {}
        Some(OutputFormat::Wide) => print_wide(objects, true),
        Some(OutputFormat::Name) => {
            for o in objects {
                outln!("job.runner/{}", o.metadata.name);
            }
        }
        Some(format) => print_objects(objects, format)?,
    }
    Ok(())
}

/// What `get jobs` shows.
pub struct GetHow {
    pub name: Option<String>,
    pub selector: Option<String>,
    pub format: Option<OutputFormat>,
    pub watch: bool,
}

/// How often `get -w` looks at the store.
const WATCH_POLL: Duration = Duration::from_millis(250);

pub async fn get(ctx: &Context, how: GetHow) -> Result<i32, ServiceError> {
    let selector = jobs::parse_selector(how.selector.as_deref())?;
    let fetch = || async {
        match &how.name {
            Some(name) => Ok::<_, ServiceError>(vec![jobs::Listed {
                object: jobs::get(ctx, name).await?,
                created_at: String::new(),
            }]),
            None => {
                jobs::purge(ctx).await?;
                jobs::list(ctx, &selector).await
            }
        }
    };
    let rows = fetch().await?;
    let table = Table {
        single: how.name.is_some(),
        format: how.format,
    };
    table.print(&rows, true)?;
    if !how.watch {
        return Ok(0);
    }
    // kubectl's watch: each job again whenever its state changes, until interrupted.
    let mut seen: std::collections::HashMap<String, String> = rows
        .iter()
        .map(|r| (r.object.metadata.name.clone(), watch_key(&r.object)))
        .collect();
    let stop = crate::signals::shutdown();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => return Ok(0),
            () = tokio::time::sleep(WATCH_POLL) => {}
        }
        let rows = match fetch().await {
            Ok(rows) => rows,
            // The one job watched was deleted: nothing more will change.
            Err(ServiceError::NotFound { .. }) if how.name.is_some() => return Ok(0),
            Err(e) => return Err(e),
        };
        let changed: Vec<jobs::Listed> = rows
            .into_iter()
            .filter(|r| {
                let key = watch_key(&r.object);
                seen.insert(r.object.metadata.name.clone(), key.clone()).as_ref() != Some(&key)
            })
            .collect();
        table.print(&changed, false)?;
    }
}

/// What a watch compares: the status without the times that move on their own.
fn watch_key(o: &JobObject) -> String {
    let s = &o.status;
    format!(
        "{:?} {:?} {} {} {} {}",
        s.phase,
        s.reason,
        s.active,
        s.succeeded,
        s.failed,
        s.attempts.len()
    )
}

/// The shapes `get jobs` prints.
struct Table {
    /// `get job NAME`: the wide single-job row.
    single: bool,
    format: Option<OutputFormat>,
}

impl Table {
    fn print(&self, rows: &[jobs::Listed], first: bool) -> Result<(), ServiceError> {
        match self.format {
            Some(OutputFormat::Name) => {
                for r in rows {
                    outln!("job.runner/{}", r.object.metadata.name);
                }
            }
            Some(OutputFormat::Json) | Some(OutputFormat::Yaml) => {
                if self.single || !first {
                    // One object (a watch prints each change as one, as kubectl does).
                    for r in rows {
                        if self.format == Some(OutputFormat::Yaml) && !first {
                            outln!("---");
                        }
                        print_value(&r.object, self.format)?;
                    }
                } else {
                    let objects: Vec<&JobObject> = rows.iter().map(|r| &r.object).collect();
                    print_value(
                        &serde_json::json!({"apiVersion": "v1", "kind": "List", "items": objects}),
                        self.format,
                    )?;
                }
            }
            _ if self.single => {
                let objects: Vec<JobObject> = rows.iter().map(|r| r.object.clone()).collect();
                print_wide(&objects, first);
            }
            _ => {
                let wide = self.format == Some(OutputFormat::Wide);
                if first {
                    out!(
                        "{:<28} {:<10} {:<22} {:<12} {:<6}",
                        "NAME",
                        "PHASE",
                        "REASON",
                        "COMPLETIONS",
                        "AGE"
                    );
                    outln!("{}", if wide { " ACTIVE FAILED COMMAND" } else { "" });
                }
                for row in rows {
                    let (o, s) = (&row.object, &row.object.status);
                    out!(
                        "{:<28} {:<10} {:<22} {:<12} {:<6}",
                        o.metadata.name,
                        format!("{:?}", s.phase),
                        reason_text(s.reason),
                        format!("{}/{}", s.succeeded, o.spec.completions),
                        age(&row.created_at)
                    );
                    if wide {
                        out!(
                            " {:<6} {:<6} {}",
                            s.active,
                            s.failed,
                            one_line(&o.spec.command.join(" "))
                        );
                    }
                    outln!();
                }
            }
        }
        Ok(())
    }
}

pub async fn describe(ctx: &Context, name: &str) -> Result<i32, ServiceError> {
    let d = jobs::describe(ctx, name).await?;
    let (o, s) = (&d.object, &d.object.status);
    outln!("Name:         {}", o.metadata.name);
    let labels: Vec<String> = o.metadata.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    outln!(
        "Labels:       {}",
        if labels.is_empty() {
            "<none>".into()
        } else {
            labels.join(",")
        }
    );
    outln!("Environment:  {}", o.spec.environment);
    outln!("Backend:      {}", o.spec.backend.as_str());
    outln!("Command:      {}", o.spec.command.join(" "));
    outln!("Created:      {}", d.created_at);
    outln!("Start Time:   {}", s.start_time.as_deref().unwrap_or("-"));
    outln!("Completed At: {}", s.completion_time.as_deref().unwrap_or("-"));
    outln!("Phase:        {:?}", s.phase);
    outln!("Reason:       {}", reason_text(s.reason));
    if let Some(m) = &s.message {
        outln!("Message:      {m}");
    }
    outln!(
        "Attempts:     {} active / {} succeeded / {} failed",
        s.active,
        s.succeeded,
        s.failed
    );
    if let Some((owner, alive)) = &d.supervisor {
        outln!("Supervisor:   {owner} ({})", if *alive { "running" } else { "gone" });
    }
    outln!("Conditions:");
    if s.conditions.is_empty() {
        outln!("  <none>");
    }
    for c in &s.conditions {
        outln!(
            "  {:<9} {:<6} {:<22} {} {}",
            c.kind,
            c.status,
            c.reason,
            c.last_transition_time,
            c.message
        );
    }
    outln!("Attempt list:");
    outln!(
        "  {:<6} {:<8} {:<10} {:<20} {:<6} STARTED",
        "INDEX",
        "ATTEMPT",
        "PHASE",
        "REASON",
        "EXIT"
    );
    for a in &s.attempts {
        outln!(
            "  {:<6} {:<8} {:<10} {:<20} {:<6} {}",
            a.index,
            a.attempt,
            format!("{:?}", a.phase),
            reason_text(a.reason),
            a.exit_code.map_or_else(|| "-".into(), |c| c.to_string()),
            a.start_time.as_deref().unwrap_or("-")
        );
        match (&a.pool, &a.cold_start) {
            (Some(pool), _) => outln!("         Pool: {pool}"),
            (None, Some(why)) => outln!("         Pool: none, cold ({why})"),
            (None, None) => {}
        }
        // kubectl shows a pod's IP; `docker port` its mappings.
        if let Some(n) = &a.network {
            outln!("         IP: {}", n.ip);
            for p in &n.ports {
                outln!("         Port: {p}");
            }
        }
    }
    if s.phase == crate::job::Phase::Running {
        super::top::describe_usage(ctx, &o.metadata.name).await;
    }
    outln!("Events:");
    for e in &d.events {
        outln!("  {:<24} {:<8} {:<16} {}", e.time, e.kind, e.reason, e.message);
    }
    Ok(0)
}

pub async fn logs(ctx: &Context, name: &str, options: LogOptions, prefix: bool) -> Result<i32, ServiceError> {
    let mut logs = Logs::new(ctx, name, options);
    let mut prefixer = Prefixer::default();
    let write = |stream: Stream, data: &[u8]| output::write_stream(stream == Stream::Stdout, data);
    while let Some(chunks) = logs.next().await? {
        for chunk in chunks {
            match chunk {
                LogChunk::Output { index, stream, data } if prefix => {
                    write(stream, &prefixer.push(index, stream, &data))
                }
                LogChunk::Output { stream, data, .. } => write(stream, &data),
                LogChunk::End { index } => {
                    for (stream, rest) in prefixer.end(index) {
                        write(stream, &rest);
                    }
                }
                LogChunk::Notice(text) => eprintln!("runner: {text}"),
            }
        }
    }
    Ok(0)
}

pub async fn wait(ctx: &Context, name: &str, timeout: Option<Duration>) -> Result<i32, ServiceError> {
    match jobs::wait(ctx, name, timeout).await? {
        Waited::Finished(status) => {
            eprintln!("job/{name} {:?} ({})", status.phase, reason_text(status.reason));
            Ok(if status.phase == Phase::Succeeded { 0 } else { 1 })
        }
        Waited::TimedOut(status) => {
            eprintln!(
                "job/{name}: still {:?} after {:?}",
                status.phase,
                timeout.unwrap_or_default()
            );
            Ok(2)
        }
    }
}

/// Which jobs `delete job` removes.
pub enum Which {
    Name(String),
    All,
    Selector(String),
}

pub async fn delete(ctx: &Context, which: Which) -> Result<i32, ServiceError> {
    let names = match which {
        Which::Name(name) => vec![name],
        Which::All => jobs::list(ctx, &Default::default())
            .await?
            .into_iter()
            .map(|r| r.object.metadata.name)
            .collect(),
        Which::Selector(text) => {
            let selector = jobs::parse_selector(Some(&text))?;
            if selector.is_empty() {
                return Err(ServiceError::field(
                    "selector",
                    "-l needs a requirement such as key=value (--all deletes every job)",
                ));
            }
            jobs::list(ctx, &selector)
                .await?
                .into_iter()
                .map(|r| r.object.metadata.name)
                .collect()
        }
    };
    // Each stop waits for its job's grace period: all of them at once, reported in order.
    let results = futures::future::join_all(names.iter().map(|name| jobs::delete(ctx, name))).await;
    let mut failed = None;
    for (name, result) in names.iter().zip(results) {
        match result {
            Ok(()) => outln!("job.runner/{name} deleted"),
            Err(e) if names.len() == 1 => return Err(e),
            Err(e) => {
                eprintln!("runner: deleting job {name}: {e}");
                failed = Some(2);
            }
        }
    }
    if names.is_empty() {
        eprintln!("No jobs found.");
    }
    Ok(failed.unwrap_or(0))
}

/// `runner supervise NAME` (what `apply --detach` starts): carry the job to its end; Ctrl-C
/// or SIGTERM cancels it as it cancels `apply`.
pub async fn supervise(ctx: &Context, name: &str, adopt: bool) -> Result<i32, ServiceError> {
    let cancel = CancellationToken::new();
    {
        let cancel = cancel.clone();
        tokio::spawn(async move {
            crate::signals::shutdown().await;
            cancel.cancel();
        });
    }
    let status = jobs::supervise(ctx, name, adopt, cancel).await?;
    Ok(status.exit_code())
}
