//! `runner export`: print the Kubernetes objects of a manifest.

use std::io::Write;

use super::{ExportArgs, ExportFormat};
use crate::service::export::{self, ExportRequest};
use crate::service::{Context, ServiceError};
use crate::spec::kube::{ExportOptions, Seccomp};

pub async fn export(ctx: &Context, args: ExportArgs) -> Result<i32, ServiceError> {
    let seccomp = match &args.seccomp_profile {
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
    let request = ExportRequest {
        file: args.file.file,
        env_dir: args.file.env_dir,
        job: args.job,
        image: args.image,
        sandbox: args.sandbox,
        options: ExportOptions {
            workspace: args.workspace,
            seccomp,
            namespace: args.kube_namespace,
            node_pids_limit: args.node_pids_limit,
        },
    };
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
