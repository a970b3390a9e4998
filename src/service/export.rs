//! `runner export`: a manifest's Jobs (or Environments) as Kubernetes objects. The mapping is
//! `spec::kube`'s; this loads the file, binds each Job as the containerd backend would run it
//! and reads the files the objects carry.

use std::path::PathBuf;

use serde_json::Value;

use super::{Context, ServiceError};
use crate::manifest::{self, Backend};
use crate::spec::kube::{self, ExportOptions};

#[derive(Clone, Debug, Default)]
pub struct ExportRequest {
    pub file: PathBuf,
    pub env_dir: Option<PathBuf>,
    /// Only this Job.
    pub job: Option<String>,
    /// The image for Environments that name none (host-backend ones).
    pub image: Option<String>,
    /// Export the file's Environments as agent-sandbox Sandboxes instead of its Jobs.
    pub sandbox: bool,
    pub options: ExportOptions,
}

/// The objects, in the order they are created.
pub fn export(ctx: &Context, request: &ExportRequest) -> Result<Vec<Value>, ServiceError> {
    let mut set = manifest::load_file(
        &request.file,
        request.env_dir.as_deref().or(ctx.config.env_dir.as_deref()),
    )?;
    for env in set.environments.iter_mut().chain(set.env_dir.iter_mut()) {
        if env.image.is_none() {
            env.image = request.image.clone();
        }
    }
    // Said on stderr (the objects are stdout): a cluster keeps warm pods its own way
    // (agent-sandbox's SandboxWarmPool); the file's Jobs export as they are.
    for pool in &set.pools {
        tracing::warn!(
            "{}: WarmPool {:?} is runner's own and is not exported",
            request.file.display(),
            pool.name
        );
    }
    let mut objects = Vec::new();
    if request.sandbox {
        if set.environments.is_empty() {
            return Err(ServiceError::field(
                "--sandbox",
                format!("{} holds no Environment", request.file.display()),
            ));
        }
        for env in &set.environments {
            objects.extend(kube::export_sandbox(env, &request.options)?);
        }
        return Ok(objects);
    }
    if set.jobs.is_empty() {
        return Err(ServiceError::field(
            "kind",
            format!(
                "{} holds no Job (pass --sandbox to export its Environments as Sandboxes)",
                request.file.display()
            ),
        ));
    }
    let mut found = false;
    for job in set
        .jobs
        .iter()
        .filter(|j| request.job.as_ref().is_none_or(|n| &j.name == n))
    {
        found = true;
        if let Ok(env) = set.environment_for(job)
            && env.image.is_none()
        {
            return Err(ServiceError::field(
                "--image",
                format!(
                    "Environment {:?} names no image (backend {}): pass --image IMAGE, the container its commands run in on a cluster",
                    env.name,
                    env.backend.as_str()
                ),
            ));
        }
        let bound = set.bind(job, Some(Backend::Containerd))?;
        let payload = kube::read_payload(&bound, &request.options)?;
        objects.extend(kube::export_job(&bound, &payload, &request.options)?);
    }
    if !found {
        return Err(ServiceError::field(
            "--job",
            format!(
                "no job {:?} in {}",
                request.job.as_deref().unwrap_or_default(),
                request.file.display()
            ),
        ));
    }
    Ok(objects)
}

/// Our seccomp filter as a Kubernetes `Localhost` profile for this machine's architecture.
pub fn seccomp_profile(ctx: &Context) -> Result<Value, ServiceError> {
    Ok(kube::seccomp_profile(&ctx.host.arch)?)
}
