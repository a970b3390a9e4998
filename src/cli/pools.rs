//! `runner pool create|ls|rm` (and `fill`, what a claim starts in the background).

use super::output::{age, print_value};
use super::output::{out, outln};
use super::{OutputFormat, PoolVerb};
use crate::service::{Context, ServiceError, pools};

pub async fn run(ctx: &Context, verb: PoolVerb) -> Result<i32, ServiceError> {
    match verb {
        PoolVerb::Create {
            environment,
            file,
            size,
            name,
            workspace,
            static_assets,
            snapshot,
        } => {
            let name = name.unwrap_or_else(|| environment.clone());
            let (def, report) = pools::create(
                ctx,
                &name,
                &environment,
                &file.file,
                size,
                workspace,
                static_assets,
                snapshot,
            )
            .await?;
            outln!(
                "pool {} ready: {} member{} of Environment {}{} (made {}{}; key {})",
                def.name,
                report.ready,
                if report.ready == 1 { "" } else { "s" },
                def.environment,
                def.snapshot
                    .as_ref()
                    .map(|s| format!(" from snapshot {s}"))
                    .unwrap_or_default(),
                report.created.len(),
                report
                    .removed_text()
                    .map(|r| format!(", removed {r}"))
                    .unwrap_or_default(),
                def.key
            );
            Ok(0)
        }
        PoolVerb::Fill { name, queued_fd } => {
            let queued = queued_fd.map(pools::QueueTicket::from_inherited).transpose()?;
            let report = pools::fill_queued(ctx, &name, queued).await?;
            // Whole milliseconds: a filler that did not wait says so (0 ms).
            outln!(
                "pool {name}: {} ready (made {}{}; waited {} ms for its claims to pause)",
                report.ready,
                report.created.len(),
                report
                    .removed_text()
                    .map(|r| format!(", removed {r}"))
                    .unwrap_or_default(),
                report.waited.as_millis()
            );
            Ok(0)
        }
        PoolVerb::Ls { output } => get(ctx, None, output).await,
        PoolVerb::Rm { names } => {
            if names.is_empty() {
                return Err(ServiceError::field("NAME", "runner pool rm NAME..."));
            }
            for name in names {
                let removed = pools::remove(ctx, &name).await?;
                outln!(
                    "deleted pool {name} ({} member{} removed)",
                    removed.len(),
                    if removed.len() == 1 { "" } else { "s" }
                );
            }
            Ok(0)
        }
    }
}

/// `runner get pools [NAME]` and `runner pool ls`.
pub async fn get(ctx: &Context, name: Option<&str>, output: Option<OutputFormat>) -> Result<i32, ServiceError> {
    let mut rows = pools::list(ctx).await?;
    if let Some(name) = name {
        rows.retain(|p| p.def.name == name);
        if rows.is_empty() {
            return Err(ServiceError::NotFound {
                kind: "pool",
                name: name.to_string(),
            });
        }
    }
    match output {
        Some(OutputFormat::Json) | Some(OutputFormat::Yaml) => print_value(&rows, output)?,
        Some(OutputFormat::Name) => {
            for p in &rows {
                outln!("warmpool.runner/{}", p.def.name);
            }
        }
        wide => {
            let wide = wide == Some(OutputFormat::Wide);
            out!(
                "{:<24} {:<20} {:>5} {:>6} {:>7}",
                "NAME",
                "ENVIRONMENT",
                "SIZE",
                "READY",
                "BROKEN"
            );
            if wide {
                out!(
                    " {:<9} {:<13} {:<20} {:<24}",
                    "WORKSPACE",
                    "STATIC-ASSETS",
                    "SNAPSHOT",
                    "KEY"
                );
            }
            outln!(" AGE");
            for p in &rows {
                out!(
                    "{:<24} {:<20} {:>5} {:>6} {:>7}",
                    p.def.name,
                    p.def.environment,
                    p.def.size,
                    p.ready,
                    p.broken
                );
                if wide {
                    out!(
                        " {:<9} {:<13} {:<20} {:<24}",
                        p.def.workspace,
                        p.def.static_assets,
                        p.def.snapshot.as_deref().unwrap_or("<none>"),
                        p.def.key
                    );
                }
                outln!(" {}", age(&p.def.created));
            }
        }
    }
    Ok(0)
}
