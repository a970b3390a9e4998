//! `runner image pull|push|tag|import|ls|rm`.

use super::output::outln;
use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::{Arc, Mutex};

use super::output::print_value;
use super::{ImageVerb, OutputFormat};
use crate::image::remote::PullEvent;
use crate::image::{ImportOptions, ImportProgress};
use crate::service::{Context, ServiceError, images};

/// Where progress goes: bars on a terminal, plain lines otherwise, JSON events with `-o json`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Bars,
    Lines,
    Json,
}

fn mode(output: Option<OutputFormat>) -> Mode {
    match output {
        Some(OutputFormat::Json) => Mode::Json,
        _ if std::io::stderr().is_terminal() => Mode::Bars,
        _ => Mode::Lines,
    }
}

fn short(digest: &str) -> &str {
    digest.get(7..19).unwrap_or(digest)
}

fn bytes(n: u64) -> String {
    indicatif::HumanBytes(n).to_string()
}

/// Per-blob progress of a pull or push: an indicatif bar per blob on a terminal (bytes, rate,
/// ETA), one line per state change when not on one, every event as JSON with `-o json`.
fn blob_progress(mode: Mode) -> crate::image::remote::PullProgressFn {
    let bars = indicatif::MultiProgress::new();
    let style = indicatif::ProgressStyle::with_template(
        "{prefix:.bold} {msg:<11} [{bar:30}] {bytes:>10}/{total_bytes:<10} {bytes_per_sec:>12} eta {eta}",
    )
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
    .progress_chars("=> ");
    let open: Mutex<HashMap<String, indicatif::ProgressBar>> = Mutex::new(HashMap::new());
    let seen: Mutex<HashMap<String, &'static str>> = Mutex::new(HashMap::new());
    Arc::new(move |e: &PullEvent| match mode {
        Mode::Json => {
            if let Ok(line) = serde_json::to_string(e) {
                outln!("{line}");
            }
        }
        Mode::Lines => {
            let mut seen = seen.lock().expect("progress");
            if seen.get(&e.digest) == Some(&e.status) {
                return;
            }
            seen.insert(e.digest.clone(), e.status);
            match e.status {
                "resolved" => eprintln!("{}: resolved to {}", e.image, e.digest),
                "unpacking" => eprintln!("{}: unpacking {} layers", e.image, e.total),
                "done" => eprintln!("{}: done ({} transferred)", e.image, bytes(e.done)),
                "downloading" | "uploading" => eprintln!("{}: {} of {}", short(&e.digest), e.status, bytes(e.total)),
                "waiting" => eprintln!("{}: waiting for another pull of it", short(&e.digest)),
                status => eprintln!("{}: {status}", short(&e.digest)),
            }
        }
        Mode::Bars => {
            if e.digest.is_empty() || e.status == "resolved" {
                if e.status == "unpacking" {
                    let _ = bars.println(format!("unpacking {} layers", e.total));
                }
                return;
            }
            let mut open = open.lock().expect("progress");
            let bar = open
                .entry(e.digest.clone())
                .or_insert_with(|| {
                    let b = bars.add(indicatif::ProgressBar::new(e.total));
                    b.set_style(style.clone());
                    b.set_prefix(short(&e.digest).to_string());
                    b
                })
                .clone();
            bar.set_length(e.total);
            bar.set_position(e.done);
            match e.status {
                "downloaded" | "uploaded" | "exists" => bar.finish_with_message(e.status),
                status => bar.set_message(status),
            }
        }
    })
}

/// The import's progress: one bar on a terminal (nothing otherwise: imports are local).
fn import_progress() -> crate::image::ProgressFn {
    let bar: Mutex<Option<indicatif::ProgressBar>> = Mutex::new(None);
    Arc::new(move |p: &ImportProgress| {
        let mut bar = bar.lock().expect("progress");
        if p.finished {
            if let Some(b) = bar.take() {
                b.finish_and_clear();
            }
            return;
        }
        let b = bar.get_or_insert_with(|| {
            let b = indicatif::ProgressBar::new(p.total);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "importing {prefix}: {msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            b.set_prefix(p.image.clone());
            b
        });
        b.set_length(p.total);
        b.set_position(p.done);
        b.set_message(p.step.clone());
    })
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
                progress: std::io::stderr().is_terminal().then(import_progress),
            };
            for imported in images::import(ctx, &file, &options).await? {
                outln!(
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
        ImageVerb::Pull {
            reference,
            platform,
            output,
        } => {
            let mode = mode(output);
            let pulled = images::pull(ctx, &reference, platform.as_deref(), Some(blob_progress(mode))).await?;
            if mode == Mode::Json {
                outln!("{}", serde_json::to_string(&pulled).unwrap_or_default());
            } else {
                outln!(
                    "pulled {} ({}, {}, {} layer{}, {} downloaded from {})",
                    pulled.name,
                    pulled.platform,
                    pulled.digest,
                    pulled.layers,
                    if pulled.layers == 1 { "" } else { "s" },
                    bytes(pulled.downloaded),
                    pulled.from
                );
            }
            Ok(0)
        }
        ImageVerb::Push {
            reference,
            platform,
            output,
        } => {
            let mode = mode(output);
            let pushed = images::push(ctx, &reference, platform.as_deref(), Some(blob_progress(mode))).await?;
            if mode == Mode::Json {
                outln!("{}", serde_json::to_string(&pushed).unwrap_or_default());
            } else {
                outln!(
                    "pushed {} ({}; {} blob{} uploaded, {} already there)",
                    pushed.name,
                    pushed.digest,
                    pushed.uploaded,
                    if pushed.uploaded == 1 { "" } else { "s" },
                    pushed.skipped
                );
            }
            Ok(0)
        }
        ImageVerb::Tag { source, target } => {
            outln!("tagged {}", images::tag(ctx, &source, &target).await?);
            Ok(0)
        }
        ImageVerb::Ls { output } => {
            let rows = images::list(ctx).await?;
            match output {
                Some(OutputFormat::Json) | Some(OutputFormat::Yaml) => print_value(&rows, output)?,
                _ => {
                    outln!(
                        "{:<48} {:<14} {:>10} {:<9} MEDIA TYPE",
                        "NAME",
                        "DIGEST",
                        "SIZE",
                        "CREATED"
                    );
                    for i in &rows {
                        let size = i.size.map_or("-".into(), |n| bytes(n.max(0) as u64));
                        let created = i.created.as_deref().map_or("-".into(), super::output::age);
                        outln!(
                            "{:<48} {:<14} {:>10} {:<9} {}",
                            i.name,
                            short(&i.digest),
                            size,
                            created,
                            i.media_type
                        );
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
                outln!("deleted {}", images::remove(ctx, &name).await?);
            }
            Ok(0)
        }
    }
}
