//! The verbs behind the CLI. Each returns the process exit code or a `CommandError` that
//! `main` prints as one line and maps to exit 2.

use std::io::Write;

use tokio_util::sync::CancellationToken;

use crate::cli::{FileArgs, Global, OutputFormat};
use crate::job::{self, JobObject, JobStatus};
use crate::manifest::{self, Backend, ManifestError, ManifestSet};
use crate::runtime::RuntimeOptions;
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
fn plans(set: &ManifestSet, host: &HostEnv, backend: Option<Backend>) -> Result<Vec<spec::RunPlan>, CommandError> {
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
    for plan in &plans {
        let job = plan.job();
        if job.backoff_limit > 0 {
            let origin = job
                .backoff_limit_origin
                .clone()
                .unwrap_or_else(|| manifest::Origin::new("spec.backoffLimit", None));
            return Err(CommandError::Usage(format!(
                "{}: Job {:?}: {}: retries are not supported yet (only backoffLimit: 0)",
                args.file.display(),
                job.name,
                origin.path
            )));
        }
        if plan.bound.backend == Backend::Containerd {
            return Err(CommandError::Usage(format!(
                "Job {:?}: backend containerd is not available yet in this build; run trusted jobs with --backend host",
                job.name
            )));
        }
    }
    let options = RuntimeOptions {
        output_limit: max_output_bytes,
        ..RuntimeOptions::default()
    };
    let cancel = CancellationToken::new();
    let on_signal = cancel.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            on_signal.cancel();
        }
    });
    let mut objects = Vec::new();
    let mut code = 0;
    for plan in &plans {
        let status = job::run_once(plan, &host, &options, &cancel).await;
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
    Ok(code)
}

/// Combine exit codes: a runner failure outranks a job failure, which outranks success.
fn worst(a: i32, b: i32) -> i32 {
    let rank = |c: i32| match c {
        0 => 0,
        1 => 1,
        2 => 3,
        _ => 2,
    };
    if rank(b) > rank(a) { b } else { a }
}

fn print_objects(objects: &[JobObject], format: OutputFormat) -> Result<(), CommandError> {
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

fn print_wide(objects: &[JobObject]) {
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
fn print_human(plan: &spec::RunPlan, status: &JobStatus) {
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
