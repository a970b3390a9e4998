//! What running containers use (jobs' attempts, sessions' sandboxes): `runner describe job`,
//! `runner top` and the server's `/metrics` read their cgroups here (`runtime::usage`).

use std::time::{Duration, Instant};

use serde::Serialize;

use super::{Context, ServiceError};
use crate::runtime::containerd::{LABEL_ATTEMPT, LABEL_INDEX, LABEL_JOB, LABEL_KIND};
use crate::runtime::usage::{self, Usage};

/// One running container's use.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerUsage {
    pub container: String,
    /// The job (or session) it belongs to.
    pub job: String,
    /// `job`, `session`, `pool`... (the container's kind label).
    pub kind: String,
    pub index: Option<u32>,
    pub attempt: Option<u32>,
    #[serde(flatten)]
    pub usage: Usage,
    /// CPUs' worth of time used over the sampling window (only when sampled twice).
    pub cpu_cores: Option<f64>,
}

/// The running containers of `job` (every runner container with a job label when `None`)
/// and what each uses now; with `window`, sampled twice that far apart for a CPU rate.
pub async fn running(
    ctx: &Context,
    job: Option<&str>,
    window: Option<Duration>,
) -> Result<Vec<ContainerUsage>, ServiceError> {
    let engine = ctx.engine(ctx.runtime_options()).await?;
    let containers = match job {
        Some(job) => engine.job_containers(job, None).await?,
        None => ctx
            .containerd()
            .await?
            .containers(vec![format!("labels.\"{LABEL_JOB}\"")])
            .await
            .map_err(|e| ServiceError::Unavailable {
                what: "containerd",
                reason: e.to_string(),
            })?,
    };
    let parent = engine.cgroup_parent();
    let found: Vec<(ContainerUsage, String)> = containers
        .into_iter()
        .map(|c| {
            let label = |k: &str| c.labels.get(k).cloned();
            (
                ContainerUsage {
                    job: label(LABEL_JOB).unwrap_or_default(),
                    kind: label(LABEL_KIND).unwrap_or_default(),
                    index: label(LABEL_INDEX).and_then(|v| v.parse().ok()),
                    attempt: label(LABEL_ATTEMPT).and_then(|v| v.parse().ok()),
                    container: c.id.clone(),
                    usage: Usage::default(),
                    cpu_cores: None,
                },
                format!("{parent}/{}", c.id),
            )
        })
        .collect();
    sample(found, window).await
}

async fn sample(
    found: Vec<(ContainerUsage, String)>,
    window: Option<Duration>,
) -> Result<Vec<ContainerUsage>, ServiceError> {
    // Each read keeps the containers whose cgroup is still there; `prior` is the CPU time of
    // the read before, for the rate.
    let read_all = |found: Vec<(ContainerUsage, String)>, elapsed: Option<f64>| {
        Context::blocking(move || {
            Ok(found
                .into_iter()
                .filter_map(|(mut c, cgroup)| {
                    let prior = c.usage.cpu_seconds;
                    c.usage = usage::read(&cgroup)?;
                    if let Some(took) = elapsed {
                        c.cpu_cores = Some(((c.usage.cpu_seconds - prior) / took).max(0.0));
                    }
                    Some((c, cgroup))
                })
                .collect::<Vec<_>>())
        })
    };
    let first = read_all(found, None).await?;
    let Some(window) = window else {
        return Ok(first.into_iter().map(|(c, _)| c).collect());
    };
    let began = Instant::now();
    tokio::time::sleep(window).await;
    let took = began.elapsed().as_secs_f64();
    Ok(read_all(first, Some(took)).await?.into_iter().map(|(c, _)| c).collect())
}
