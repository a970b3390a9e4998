//! `runner export`: print the Kubernetes objects of a manifest.

use super::output::outln;
use std::io::Write;

use super::output::{print_status_line, worst};
use super::{ExportArgs, ExportFormat, FileArgs, KubeFlags, OutputFormat};
use crate::service::export::{self, ExportRequest};
use crate::service::kube::{self as kube_service, KubeTarget};
use crate::service::{Context, ServiceError};
use crate::spec::kube::{ExportOptions, Seccomp};

/// The request the flags describe (writing the seccomp profile file when asked).
fn request(
    ctx: &Context,
    file: FileArgs,
    job: Option<String>,
    sandbox: bool,
    flags: KubeFlags,
) -> Result<ExportRequest, ServiceError> {
    let seccomp = match &flags.seccomp_profile {
        None => Seccomp::RuntimeDefault,
        Some(path) => {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .ok_or_else(|| ServiceError::field("--seccomp-profile", "needs a file name"))?;
            let profile = export::seccomp_profile(ctx)?;
            let text = serde_json::to_string_pretty(&profile)
                .map_err(|e| ServiceError::internal("encoding the seccomp profile", e))?;
            std::fs::write(path, text + "\n")
                .map_err(|e| ServiceError::field("--seccomp-profile", format!("{}: {e}", path.display())))?;
            Seccomp::Localhost(name)
        }
    };
    Ok(ExportRequest {
        file: file.file,
        env_dir: file.env_dir,
        job,
        image: flags.image,
        sandbox,
        options: ExportOptions {
            workspace: flags.workspace,
            seccomp,
            namespace: flags.kube_namespace,
            node_pids_limit: flags.node_pids_limit,
        },
    })
}

pub async fn export(ctx: &Context, args: ExportArgs) -> Result<i32, ServiceError> {
    let request = request(ctx, args.file, args.job, args.sandbox, args.kube)?;
    let ctx = ctx.clone();
    let objects = Context::blocking(move || export::export(&ctx, &request)).await?;
    let text = match args.output {
        ExportFormat::Json => {
            let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": objects});
            serde_json::to_string_pretty(&list).map_err(|e| ServiceError::internal("encoding JSON", e))? + "\n"
        }
        ExportFormat::Yaml => {
            let mut text = String::new();
            for object in &objects {
                text.push_str("---\n");
                text.push_str(
                    &serde_saphyr::to_string(object).map_err(|e| ServiceError::internal("encoding YAML", e))?,
                );
            }
            text
        }
    };
    std::io::stdout()
        .lock()
        .write_all(text.as_bytes())
        .map_err(|e| ServiceError::internal("writing the output", e))?;
    Ok(0)
}

/// `runner apply --kube`: submit, follow (the pods' output on stdout as it comes, unless a
/// format is asked for), report each job as a local run does, with the same exit code.
pub async fn apply(
    ctx: &Context,
    file: FileArgs,
    format: Option<OutputFormat>,
    context: Option<String>,
    flags: KubeFlags,
) -> Result<i32, ServiceError> {
    let target = KubeTarget {
        context,
        namespace: flags.kube_namespace.clone(),
    };
    let request = request(ctx, file, None, false, flags)?;
    let applying = kube_service::apply(ctx, request, &target, |_, _, line| {
        if format.is_none() {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{line}");
        }
    });
    // Ctrl-C stops following, not the jobs: they are the cluster's now.
    let outcomes = tokio::select! {
        outcomes = applying => outcomes?,
        _ = crate::signals::shutdown() => {
            eprintln!("runner: interrupted; the jobs keep running on the cluster (`runner delete job NAME --kube` removes one)");
            return Ok(130);
        }
    };
    let mut code = 0;
    let mut objects = Vec::new();
    for outcome in &outcomes {
        code = worst(code, outcome.status.exit_code());
        match format {
            None => print_status_line(&outcome.name, &outcome.status),
            Some(_) => objects.push(serde_json::json!({
                "apiVersion": crate::job::API_VERSION,
                "kind": "Job",
                "metadata": {"name": outcome.name},
                "status": outcome.status,
            })),
        }
    }
    if let Some(format) = format {
        let value = match objects.as_slice() {
            [one] => one.clone(),
            _ => serde_json::json!({"apiVersion": "v1", "kind": "List", "items": objects}),
        };
        super::output::print_value(&value, Some(format))?;
    }
    Ok(code)
}

/// `runner delete job NAME --kube`.
pub async fn delete(name: &str, context: Option<String>, namespace: Option<String>) -> Result<i32, ServiceError> {
    let removed = kube_service::delete(name, &KubeTarget { context, namespace }).await?;
    outln!("job.runner/{name} deleted on the cluster ({removed} objects)");
    Ok(0)
}
