//! `runner image import|ls|rm`.

use std::io::IsTerminal;
use std::sync::Arc;

use super::output::print_value;
use super::{ImageVerb, OutputFormat};
use crate::image::{ImportOptions, ImportProgress};
use crate::service::{Context, ServiceError, images};

/// Progress on a terminal: one line rewritten in place (nothing when stderr is not one).
fn progress_bar(p: &ImportProgress) {
    if p.finished {
        eprintln!();
    } else if let Some(pct) = (p.done * 100).checked_div(p.total) {
        let bar = "#".repeat((pct / 4) as usize);
        eprint!(
            "\rimporting {}: {} [{bar:<25}] {pct:>3}% {:.1}/{:.1} MiB",
            p.image,
            p.step,
            p.done as f64 / 1048576.0,
            p.total as f64 / 1048576.0
        );
    }
}

pub async fn run(ctx: &Context, verb: ImageVerb) -> Result<i32, ServiceError> {
    match verb {
        ImageVerb::Import {
            file,
            name,
            cmd,
            env,
            workdir,
            user,
        } => {
            let options = ImportOptions {
                name,
                cmd: cmd.as_deref().map(images::parse_cmd).transpose()?,
                env,
                workdir,
                user,
                progress: std::io::stderr()
                    .is_terminal()
                    .then(|| Arc::new(progress_bar) as crate::image::ProgressFn),
            };
            for imported in images::import(ctx, &file, &options).await? {
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
            let rows = images::list(ctx).await?;
            match output {
                Some(OutputFormat::Json) | Some(OutputFormat::Yaml) => print_value(&rows, output)?,
                _ => {
                    println!("{:<40} {:<20} MEDIA TYPE", "NAME", "DIGEST");
                    for i in &rows {
                        let short = i.digest.get(7..19).unwrap_or(&i.digest);
                        println!("{:<40} {:<20} {}", i.name, short, i.media_type);
                    }
                }
            }
            Ok(0)
        }
        ImageVerb::Rm { names } => {
            if names.is_empty() {
                return Err(ServiceError::field("NAME", "runner image rm NAME..."));
            }
            for name in names {
                println!("deleted {}", images::remove(ctx, &name).await?);
            }
            Ok(0)
        }
    }
}
