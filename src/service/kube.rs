//! `runner apply --kube` and `runner delete job --kube`: the exported objects submitted to a
//! Kubernetes cluster with the `kube` client (kubeconfig, a context, a namespace), the Job
//! followed to its end with its pods' logs, and its result mapped to runner's status
//! (`job::kube`). Everything runner creates carries `runner.dev/job` and
//! `runner.dev/managed-by: runner`, which is how `delete` finds it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams, PropagationPolicy};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::Value;
use tokio::sync::mpsc;

use super::export::{self, ExportRequest};
use super::{Context, ServiceError};
use crate::job::JobStatus;
use crate::spec::kube::{CONTAINER, JOB_LABEL, MANAGED_LABEL};

/// How often the Job and its pods are looked at.
const POLL: Duration = Duration::from_secs(1);

/// Which cluster, through the kubeconfig (`$KUBECONFIG` or `~/.kube/config`).
#[derive(Clone, Debug, Default)]
pub struct KubeTarget {
    pub context: Option<String>,
    /// Default: the context's namespace.
    pub namespace: Option<String>,
}

fn unavailable(e: impl std::fmt::Display) -> ServiceError {
    ServiceError::Unavailable {
        what: "the Kubernetes API",
        reason: e.to_string(),
    }
}

async fn client(target: &KubeTarget) -> Result<(kube::Client, String), ServiceError> {
    let options = kube::config::KubeConfigOptions {
        context: target.context.clone(),
        ..Default::default()
    };
    let config = kube::Config::from_kubeconfig(&options)
        .await
        .map_err(|e| ServiceError::field("kubeconfig", format!("cannot load it: {e}")))?;
    let namespace = target
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let client = kube::Client::try_from(config).map_err(unavailable)?;
    Ok((client, namespace))
}

fn api_for(client: &kube::Client, namespace: &str, object: &Value) -> Result<Api<DynamicObject>, ServiceError> {
    let api_version = object["apiVersion"].as_str().unwrap_or_default();
    let kind = object["kind"].as_str().unwrap_or_default();
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, kind));
    Ok(Api::namespaced_with(client.clone(), namespace, &resource))
}

/// A pod's log (following it when `follow`), requested directly: the typed Pod API would
/// compile the whole Pod model's serde code into runner for two fields it reads.
fn log_request(namespace: &str, pod: &str, follow: bool) -> Result<http::Request<Vec<u8>>, ServiceError> {
    let uri = format!(
        "/api/v1/namespaces/{namespace}/pods/{pod}/log?container={CONTAINER}{}",
        if follow { "&follow=true" } else { "" }
    );
    http::Request::get(uri)
        .body(Vec::new())
        .map_err(|e| ServiceError::internal("a log request", e))
}

/// A pod's whole log (`None` when it has none to give, e.g. it never started).
async fn read_log(client: &kube::Client, namespace: &str, pod: &str) -> Result<Option<String>, ServiceError> {
    use futures::AsyncReadExt;
    let Ok(mut stream) = client.request_stream(log_request(namespace, pod, false)?).await else {
        return Ok(None);
    };
    let mut bytes = Vec::new();
    stream
        .read_to_end(&mut bytes)
        .await
        .map_err(|e| unavailable(format!("reading the log of pod {pod}: {e}")))?;
    Ok(Some(String::from_utf8_lossy(&bytes).into_owned()))
}

/// What one Job did on the cluster.
pub struct KubeOutcome {
    pub name: String,
    pub status: JobStatus,
}

/// Submit a manifest's Jobs and follow each to its end. `on_log(job, pod, line)` gets the
/// pods' output as it comes.
pub async fn apply(
    ctx: &Context,
    request: ExportRequest,
    target: &KubeTarget,
    mut on_log: impl FnMut(&str, &str, &str),
) -> Result<Vec<KubeOutcome>, ServiceError> {
    let objects = {
        let (ctx, request) = (ctx.clone(), request.clone());
        Context::blocking(move || export::export(&ctx, &request)).await?
    };
    let (client, namespace) = client(target).await?;
    let mut jobs = Vec::new();
    for object in &objects {
        let mut object = object.clone();
        object["metadata"]["namespace"] = Value::String(namespace.clone());
        let dynamic: DynamicObject =
            serde_json::from_value(object.clone()).map_err(|e| ServiceError::internal("an exported object", e))?;
        let name = dynamic.metadata.name.clone().unwrap_or_default();
        api_for(&client, &namespace, &object)?
            .create(&PostParams::default(), &dynamic)
            .await
            .map_err(|e| match e {
                kube::Error::Api(s) if s.code == 409 => ServiceError::Conflict(format!(
                    "{} {name:?} already exists in namespace {namespace:?} (`runner delete job NAME --kube` removes a job's objects)",
                    object["kind"].as_str().unwrap_or_default()
                )),
                other => unavailable(format!("creating {} {name:?}: {other}", object["kind"].as_str().unwrap_or_default())),
            })?;
        if object["kind"] == "Job" {
            let setup = object
                .pointer("/spec/template/spec/containers/0/command/2")
                .and_then(Value::as_str)
                .is_some_and(|s| s.contains("runner:setup-done"));
            jobs.push((name, object, setup));
        }
    }
    let mut outcomes = Vec::new();
    for (name, object, setup) in jobs {
        let status = follow(&client, &namespace, &name, &object, setup, &mut on_log).await?;
        outcomes.push(KubeOutcome { name, status });
    }
    Ok(outcomes)
}

/// Wait for a Job's end, forwarding its pods' logs, and map its result.
async fn follow(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    object: &Value,
    setup: bool,
    on_log: &mut impl FnMut(&str, &str, &str),
) -> Result<JobStatus, ServiceError> {
    let jobs = api_for(
        client,
        namespace,
        &serde_json::json!({"apiVersion": "batch/v1", "kind": "Job"}),
    )?;
    let pods = api_for(
        client,
        namespace,
        &serde_json::json!({"apiVersion": "v1", "kind": "Pod"}),
    )?;
    let selector = ListParams::default().labels(&format!("{JOB_LABEL}={name},{MANAGED_LABEL}=runner"));
    let (tx, mut rx) = mpsc::unbounded_channel::<(String, String)>();
    let mut followed: BTreeSet<String> = BTreeSet::new();
    let mut streams = tokio::task::JoinSet::new();
    loop {
        let job = jobs.get(name).await.map_err(unavailable)?;
        let job_value = serde_json::to_value(&job).map_err(|e| ServiceError::internal("a Job", e))?;
        let listed = pods.list(&selector).await.map_err(unavailable)?;
        let values: Vec<Value> = listed
            .items
            .iter()
            .filter_map(|p| serde_json::to_value(p).ok())
            .collect();
        for pod in &values {
            let pod_name = pod["metadata"]["name"].as_str().unwrap_or_default().to_string();
            if pod["status"]["phase"] == "Running" && followed.insert(pod_name.clone()) {
                let (client, tx) = (client.clone(), tx.clone());
                let request = log_request(namespace, &pod_name, true)?;
                streams.spawn(async move {
                    use futures::{AsyncBufReadExt, TryStreamExt};
                    if let Ok(stream) = client.request_stream(request).await {
                        let mut lines = stream.lines();
                        while let Ok(Some(line)) = lines.try_next().await {
                            let _ = tx.send((pod_name.clone(), line));
                        }
                    }
                });
            }
        }
        while let Ok((pod, line)) = rx.try_recv() {
            on_log(name, &pod, &line);
        }
        let terminal = job_value["status"]["conditions"].as_array().is_some_and(|c| {
            c.iter()
                .any(|c| (c["type"] == "Complete" || c["type"] == "Failed") && c["status"] == "True")
        });
        if terminal {
            // Streams end with their pods.
            while streams.join_next().await.is_some() {}
            while let Ok((pod, line)) = rx.try_recv() {
                on_log(name, &pod, &line);
            }
            // The followed streams were for the eye. The record is every pod's whole log, read
            // again as bytes: a stream may have ended early (a reset connection, output that is
            // not UTF-8), and a pod too brief to be followed is shown from it.
            let mut logs: BTreeMap<String, String> = BTreeMap::new();
            for pod in &values {
                let pod_name = pod["metadata"]["name"].as_str().unwrap_or_default().to_string();
                let Some(text) = read_log(client, namespace, &pod_name).await? else {
                    continue;
                };
                if !followed.contains(&pod_name) {
                    for line in text.lines() {
                        on_log(name, &pod_name, line);
                    }
                }
                logs.insert(pod_name, text);
            }
            let mut job_value = job_value;
            if job_value.pointer("/spec/backoffLimit").is_none() {
                job_value["spec"]["backoffLimit"] = object["spec"]["backoffLimit"].clone();
            }
            return Ok(crate::job::kube::status(&job_value, &values, &logs, CONTAINER, setup));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Remove everything `apply --kube` created for a job (pods go with their Job).
pub async fn delete(name: &str, target: &KubeTarget) -> Result<usize, ServiceError> {
    let (client, namespace) = client(target).await?;
    let selector = ListParams::default().labels(&format!("{JOB_LABEL}={name},{MANAGED_LABEL}=runner"));
    let params = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Background),
        ..Default::default()
    };
    let mut removed = 0;
    for (api_version, kind) in [
        ("batch/v1", "Job"),
        ("v1", "ConfigMap"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
    ] {
        let api = api_for(
            &client,
            &namespace,
            &serde_json::json!({"apiVersion": api_version, "kind": kind}),
        )?;
        let listed = api.list(&selector).await.map_err(unavailable)?;
        for object in listed.items {
            let object_name = object.metadata.name.clone().unwrap_or_default();
            api.delete(&object_name, &params).await.map_err(unavailable)?;
            removed += 1;
        }
    }
    if removed == 0 {
        return Err(ServiceError::NotFound {
            kind: "job (on the cluster)",
            name: name.to_string(),
        });
    }
    Ok(removed)
}
