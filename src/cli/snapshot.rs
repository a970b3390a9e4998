//! `runner snapshot create|ls|rm`: filesystem snapshots of running sandboxes.

use super::output::{age, out, outln, print_value};
use super::{OutputFormat, SnapshotVerb};
use crate::service::{Context, ServiceError, snapshots};

pub async fn run(ctx: &Context, verb: SnapshotVerb) -> Result<i32, ServiceError> {
    match verb {
        SnapshotVerb::Create {
            source,
            name,
            replace,
            workspace,
            output,
        } => {
            let created = snapshots::create(ctx, &source, &name, replace, workspace).await?;
            match output {
                Some(OutputFormat::Json) | Some(OutputFormat::Yaml) => print_value(&created, output)?,
                _ => outln!(
                    "snapshot {} made of {source}: image {} on {}, {} in {} entries ({} ms, sandbox frozen {} ms)",
                    created.snapshot.name,
                    created.snapshot.image,
                    created.snapshot.base,
                    bytes(created.snapshot.layer_bytes),
                    created.entries,
                    created.took_ms,
                    created.frozen_ms
                ),
            }
            if let (None | Some(OutputFormat::Wide | OutputFormat::Name), Some(target)) =
                (output, &created.snapshot.workspace)
            {
                outln!(
                    "with its workspace ({target}): {} in {} entries",
                    bytes(created.workspace_bytes),
                    created.workspace_entries
                );
            }
            Ok(0)
        }
        SnapshotVerb::Ls { output } => {
            let rows = snapshots::list(ctx).await?;
            match output {
                Some(OutputFormat::Json) | Some(OutputFormat::Yaml) => print_value(&rows, output)?,
                Some(OutputFormat::Name) => {
                    for s in &rows {
                        outln!("snapshot/{}", s.name);
                    }
                }
                wide => {
                    let wide = wide == Some(OutputFormat::Wide);
                    out!("{:<28} {:<28} {:>10} {:>10}", "NAME", "BASE", "LAYER", "DISK");
                    if wide {
                        out!(" {:<20} {:<20}", "SOURCE", "DIGEST");
                    }
                    outln!(" AGE");
                    for s in &rows {
                        out!(
                            "{:<28} {:<28} {:>10} {:>10}",
                            s.name,
                            s.base,
                            bytes(s.layer_bytes),
                            s.disk_bytes.map(bytes).unwrap_or_else(|| "?".into())
                        );
                        if wide {
                            out!(
                                " {:<20} {:<20}",
                                s.source,
                                s.digest.chars().take(19).collect::<String>()
                            );
                        }
                        outln!(" {}", age(&s.created));
                    }
                    let total: u64 = rows.iter().filter_map(|s| s.disk_bytes).sum();
                    if !rows.is_empty() {
                        outln!("{} snapshot(s), {} on disk", rows.len(), bytes(total));
                    }
                }
            }
            Ok(0)
        }
        SnapshotVerb::Rm { names } => {
            if names.is_empty() {
                return Err(ServiceError::field("NAME", "runner snapshot rm NAME..."));
            }
            for name in names {
                snapshots::remove(ctx, &name).await?;
                outln!("deleted snapshot {name}");
            }
            Ok(0)
        }
    }
}

/// Bytes as a short human figure (1024-based).
fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}
