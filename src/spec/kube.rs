//! The same manifests on Kubernetes: one pure mapping from a bound Job (Job + Environment) to
//! the Kubernetes objects that run it with the same meaning and hardening (`export_job`), and
//! from an Environment to an agent-sandbox `Sandbox` (`export_sandbox`). What the host must
//! provide (files shipped in ConfigMaps) is read at the edge into a `Payload` first.
//!
//! Choices (docs/guide/kubernetes.md):
//! - One `batch/v1` Job per runner Job, `restartPolicy: Never`, the runner Job's retry,
//!   deadline, completion and failure-policy fields as Kubernetes spells them. The per-attempt
//!   `timeoutSeconds` is the pod's `activeDeadlineSeconds` (each attempt is one pod).
//! - The entry is the one a local container runs (`entry::compose`): setup commands in front
//!   of the command in the same container (so what setup installs is there), the same marker
//!   splitting their output, stdin from a file at `/.runner-stdin`.
//! - Hardening in Kubernetes terms: not privileged, no privilege escalation, every capability
//!   dropped but our ten, seccomp `RuntimeDefault` or our own filter as a `Localhost` profile,
//!   no service-account token, no service links, requests = limits. `network: none` becomes a
//!   NetworkPolicy that denies all ingress and egress of the job's pods.
//! - stdin, static assets and a copied workspace travel in ConfigMaps (at most 1 MiB each, the
//!   API server's limit); a bigger workspace is a PersistentVolumeClaim the user names.
//! - Refused, with the field and why: host bind mounts, `user: host`, `network: host`, an
//!   explicit `resources.pids` (Kubernetes has no per-pod limit) unless the node's limit is
//!   accepted, a workspace without a choice of volume, content over the ConfigMap limit.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Value, json};

use super::{DEFAULT_CAPABILITIES, STATIC_ROOT, STDIN_PATH, entry};
use crate::manifest::{
    Bound, Command, Environment, Job, ManifestError, ManifestErrorKind, NetworkMode, Origin, UserSpec,
};

/// Largest ConfigMap the API server stores (its data, all keys together).
pub const CONFIGMAP_LIMIT: usize = 1 << 20;
/// Label on everything runner creates, with the runner Job's name.
pub const JOB_LABEL: &str = "runner.dev/job";
/// Label on everything runner creates.
pub const MANAGED_LABEL: &str = "runner.dev/managed-by";
/// The container's name in every pod (podFailurePolicy rules name it).
pub const CONTAINER: &str = "job";
/// Where a copied workspace's ConfigMap is mounted for the init container that copies it.
const WORKSPACE_SOURCE: &str = "/.runner-workspace-source";
/// Longest name Kubernetes accepts for a Job (its pods carry it in a label).
const MAX_JOB_NAME: usize = 63;

/// How the job's workspace reaches the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkspaceVolume {
    /// The files, in a ConfigMap, copied into an emptyDir by an init container.
    Copy,
    /// A PersistentVolumeClaim the user filled.
    Pvc(String),
    /// An empty directory.
    Empty,
}

impl std::str::FromStr for WorkspaceVolume {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "copy" => Ok(WorkspaceVolume::Copy),
            "empty" => Ok(WorkspaceVolume::Empty),
            _ => match s.strip_prefix("pvc:") {
                Some(claim) if valid_name(claim) => Ok(WorkspaceVolume::Pvc(claim.to_string())),
                _ => Err(format!("{s:?}: expected copy, empty or pvc:CLAIM (a DNS-1123 name)")),
            },
        }
    }
}

/// The seccomp profile the pods ask for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seccomp {
    RuntimeDefault,
    /// Our filter, installed on the nodes under the kubelet's seccomp directory at this path.
    Localhost(String),
}

#[derive(Clone, Debug)]
pub struct ExportOptions {
    pub workspace: Option<WorkspaceVolume>,
    pub seccomp: Seccomp,
    pub namespace: Option<String>,
    /// Accept an explicit `resources.pids` as the node's `podPidsLimit`'s business.
    pub node_pids_limit: bool,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            workspace: None,
            seccomp: Seccomp::RuntimeDefault,
            namespace: None,
            node_pids_limit: false,
        }
    }
}

/// One file shipped in a ConfigMap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileEntry {
    /// Relative, `/`-separated.
    pub path: String,
    pub data: Vec<u8>,
    /// Permission bits.
    pub mode: u32,
}

/// What the objects carry from the host.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Payload {
    /// The workspace's files (with `WorkspaceVolume::Copy`).
    pub workspace: Option<Vec<FileEntry>>,
    /// Each static asset's files, in the job's order.
    pub assets: Vec<Vec<FileEntry>>,
}

fn refuse(bound: &Bound, origin: Origin, from_env: bool, reason: impl Into<String>) -> ManifestError {
    if from_env {
        return refuse_env(&bound.env, origin, reason);
    }
    let e = ManifestError::new(origin, ManifestErrorKind::NotExportable(reason.into()))
        .in_document(format!("Job {:?}", bound.job.name));
    match &bound.job.file {
        Some(f) => e.in_file(f),
        None => e,
    }
}

fn refuse_env(env: &Environment, origin: Origin, reason: impl Into<String>) -> ManifestError {
    let e = ManifestError::new(origin, ManifestErrorKind::NotExportable(reason.into()))
        .in_document(format!("Environment {:?}", env.name));
    match env.origins_file() {
        Some(f) => e.in_file(f),
        None => e,
    }
}

/// What an Environment asks for that a pod cannot have (Jobs and Sandboxes alike), given the
/// network it runs with.
fn check_environment(env: &Environment, network: NetworkMode, options: &ExportOptions) -> Result<(), ManifestError> {
    if let Some(m) = env.mounts.first() {
        return Err(refuse_env(env, m.target_origin.clone(), HOST_MOUNTS));
    }
    if env.user == Some(UserSpec::Host) {
        return Err(refuse_env(
            env,
            env.origin("spec.user"),
            "`host` means the ids of whoever runs runner on this machine; give numeric ids",
        ));
    }
    if network == NetworkMode::Host {
        return Err(refuse_env(
            env,
            env.origin("spec.network"),
            "hostNetwork would put the job on the node's own network; use none",
        ));
    }
    if let Some(d) = env.egress_domains.first() {
        return Err(refuse_env(
            env,
            env.origin("spec.egress.allow"),
            format!(
                "{d}: NetworkPolicies have no domain names (runner enforces them with its own resolver); allow addresses or CIDRs"
            ),
        ));
    }
    if let Some(origin) = env.pids_origin()
        && !options.node_pids_limit
    {
        return Err(refuse_env(
            env,
            origin,
            "Kubernetes has no per-pod pids limit (the kubelet's podPidsLimit applies to every pod of a node); pass --node-pids-limit to rely on it",
        ));
    }
    Ok(())
}

/// The label naming a bridge pod's network (`runner`, or a Network document's name).
pub const NETWORK_LABEL: &str = "runner.dev/network";

/// What a bridge container may reach, as NetworkPolicy egress rules: the pods of its network
/// (locally: the other containers on its bridge) and each `egress.allow` entry (TCP and
/// UDP to its port, when it has one). Everything else is denied, as the local wall does.
fn bridge_egress(env: &Environment, network: &str) -> Value {
    let mut rules = vec![json!({"to": [{"podSelector": {"matchLabels": {NETWORK_LABEL: network}}}]})];
    for rule in &env.egress_allow {
        let mut r = json!({"to": [{"ipBlock": {"cidr": format!("{}/{}", rule.addr, rule.prefix)}}]});
        if let Some(port) = rule.port {
            r["ports"] = json!([{"protocol": "TCP", "port": port}, {"protocol": "UDP", "port": port}]);
        }
        rules.push(r);
    }
    json!(rules)
}

fn network_of(bound: &crate::manifest::Bound) -> String {
    bound
        .bridge
        .as_ref()
        .map_or_else(|| "runner".to_string(), |n| n.name.clone())
}

/// `ports` as the container's: a hostPort (and its hostIP) only where one was asked for (the
/// kubelet has no "any free port").
fn container_ports(env: &Environment) -> Value {
    let ports: Vec<Value> = env
        .ports
        .iter()
        .map(|p| {
            let mut v = json!({"containerPort": p.container_port, "protocol": p.protocol.as_str()});
            if let Some(name) = &p.name {
                v["name"] = json!(name);
            }
            if let Some(host) = p.host_port {
                v["hostPort"] = json!(host);
                v["hostIP"] = json!(p.host_ip.to_string());
            }
            v
        })
        .collect();
    json!(ports)
}

/// Why host bind mounts are refused.
const HOST_MOUNTS: &str = "host bind mounts are not exported: a node's paths are not this machine's, and hostPath volumes are a way out of a pod";

/// The kubelet expands `$(VAR)` in a container's command and env values and turns `$$` into
/// `$`: doubling every `$` makes it pass the text through as written.
fn literal(text: &str) -> String {
    text.replace('$', "$$")
}

fn literal_argv(argv: Vec<String>) -> Vec<String> {
    argv.iter().map(|a| literal(a)).collect()
}

fn env_list(env: &Environment) -> Vec<Value> {
    env.env
        .iter()
        .map(|(k, v)| json!({"name": k, "value": literal(v)}))
        .collect()
}

/// A DNS-1123 label: what names of Jobs, ConfigMaps and claims must be.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_JOB_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// A name for a derived object: the job's name and a suffix, cut to fit.
fn child_name(job: &str, suffix: &str) -> String {
    let keep = MAX_JOB_NAME.saturating_sub(suffix.len() + 1);
    let base: String = job.chars().take(keep).collect();
    format!("{}-{suffix}", base.trim_end_matches('-'))
}

fn quantity_memory(bytes: u64) -> String {
    const MI: u64 = 1 << 20;
    if bytes.is_multiple_of(1 << 30) {
        format!("{}Gi", bytes >> 30)
    } else if bytes.is_multiple_of(MI) {
        format!("{}Mi", bytes >> 20)
    } else {
        bytes.to_string()
    }
}

fn quantity_cpu(milli: u32) -> String {
    if milli.is_multiple_of(1000) {
        (milli / 1000).to_string()
    } else {
        format!("{milli}m")
    }
}

fn metadata(name: &str, job: &Job, options: &ExportOptions) -> Value {
    let mut labels: BTreeMap<String, String> = job.labels.clone();
    labels.insert(JOB_LABEL.into(), job.name.clone());
    labels.insert(MANAGED_LABEL.into(), "runner".into());
    let mut meta = json!({"name": name, "labels": labels});
    if let Some(ns) = &options.namespace {
        meta["namespace"] = json!(ns);
    }
    meta
}

/// A ConfigMap of files: keys `f0`, `f1`, … (file names need not be valid keys) and the items
/// that put each back at its path with its mode.
fn files_config_map(
    name: &str,
    files: &[FileEntry],
    job: &Job,
    options: &ExportOptions,
) -> Result<(Value, Vec<Value>), String> {
    use base64::Engine;
    let mut data = serde_json::Map::new();
    let mut binary = serde_json::Map::new();
    let mut items = Vec::new();
    let mut size = 0usize;
    for (i, f) in files.iter().enumerate() {
        let key = format!("f{i}");
        match std::str::from_utf8(&f.data) {
            Ok(text) => {
                size += text.len();
                data.insert(key.clone(), json!(text));
            }
            Err(_) => {
                let encoded = base64::engine::general_purpose::STANDARD.encode(&f.data);
                size += encoded.len();
                binary.insert(key.clone(), json!(encoded));
            }
        }
        // ConfigMap files belong to root: readable by all, so that a job (or the init
        // container copying a workspace) running as another user can read them.
        items.push(json!({"key": key, "path": f.path, "mode": (f.mode & 0o777) | 0o444}));
    }
    if size > CONFIGMAP_LIMIT {
        return Err(format!(
            "{size} bytes do not fit in a ConfigMap (at most {CONFIGMAP_LIMIT})"
        ));
    }
    let mut cm = json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(name, job, options),
        "immutable": true,
    });
    if !data.is_empty() {
        cm["data"] = Value::Object(data);
    }
    if !binary.is_empty() {
        cm["binaryData"] = Value::Object(binary);
    }
    Ok((cm, items))
}

/// The container's securityContext: runner's hardening in Kubernetes' terms.
fn security_context(env: &Environment, options: &ExportOptions) -> Value {
    let mut caps: Vec<String> = DEFAULT_CAPABILITIES
        .iter()
        .map(|c| c.to_string().trim_start_matches("CAP_").to_string())
        .collect();
    caps.sort();
    // Our profile admits only the native syscall ABI; an Environment that needs the 32-bit one
    // gets the runtime's default profile (Docker's and containerd's admit it) instead.
    let seccomp = match &options.seccomp {
        Seccomp::Localhost(path) if !env.allow_32bit_syscalls => {
            json!({"type": "Localhost", "localhostProfile": path})
        }
        Seccomp::Localhost(_) | Seccomp::RuntimeDefault => json!({"type": "RuntimeDefault"}),
    };
    let mut sc = json!({
        "privileged": false,
        "allowPrivilegeEscalation": false,
        "capabilities": {"drop": ["ALL"], "add": caps},
        "seccompProfile": seccomp,
        "procMount": "Default",
    });
    // Unset is root locally, whatever the image's USER says: the same here.
    let (uid, gid) = match env.user {
        Some(UserSpec::Ids { uid, gid }) => (uid, gid),
        _ => (0, 0),
    };
    sc["runAsUser"] = json!(uid);
    sc["runAsGroup"] = json!(gid);
    sc
}

/// Check what cannot be expressed; the refusals name the field.
fn check_exportable(bound: &Bound, options: &ExportOptions) -> Result<(), ManifestError> {
    let (job, env) = (&bound.job, &bound.env);
    if !valid_name(&job.name) {
        return Err(refuse(
            bound,
            Origin::new("metadata.name", None),
            false,
            format!(
                "{:?} is not a Kubernetes Job name (at most {MAX_JOB_NAME} lowercase letters, digits and '-')",
                job.name
            ),
        ));
    }
    check_environment(env, bound.network, options)?;
    if let Some(m) = job.mounts.first() {
        return Err(refuse(bound, m.target_origin.clone(), false, HOST_MOUNTS));
    }
    if job.workspace.is_some() && options.workspace.is_none() {
        return Err(refuse(
            bound,
            Origin::new("spec.workspace", None),
            false,
            "a directory of this machine does not exist on a cluster: choose --workspace copy (at most 1 MiB, copied into an emptyDir), --workspace pvc:CLAIM or --workspace empty",
        ));
    }
    Ok(())
}

/// The Kubernetes objects for one bound Job: ConfigMaps, the NetworkPolicy, then the Job.
pub fn export_job(bound: &Bound, payload: &Payload, options: &ExportOptions) -> Result<Vec<Value>, ManifestError> {
    check_exportable(bound, options)?;
    let (job, env) = (&bound.job, &bound.env);
    let mut objects = Vec::new();
    let mut volumes: Vec<Value> = Vec::new();
    let mut mounts: Vec<Value> = Vec::new();
    let mut init: Vec<Value> = Vec::new();
    let security = security_context(env, options);
    let image = env.image.clone().unwrap_or_default();

    if let Some(stdin) = &job.stdin {
        let name = child_name(&job.name, "stdin");
        if stdin.len() > CONFIGMAP_LIMIT {
            return Err(refuse(
                bound,
                Origin::new("spec.stdin", None),
                false,
                format!(
                    "{} bytes do not fit in a ConfigMap (at most {CONFIGMAP_LIMIT})",
                    stdin.len()
                ),
            ));
        }
        let mut cm = json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": metadata(&name, job, options),
            "immutable": true,
            "data": {"stdin": stdin},
        });
        if stdin.is_empty() {
            cm["data"] = json!({"stdin": ""});
        }
        objects.push(cm);
        volumes.push(json!({"name": "stdin", "configMap": {"name": name}}));
        mounts.push(json!({"name": "stdin", "mountPath": STDIN_PATH, "subPath": "stdin", "readOnly": true}));
    }

    if let Some(choice) = options
        .workspace
        .as_ref()
        .filter(|_| job.workspace.is_some() && env.mount_workspace)
    {
        match choice {
            WorkspaceVolume::Pvc(claim) => {
                volumes.push(json!({"name": "workspace", "persistentVolumeClaim": {"claimName": claim}}));
            }
            WorkspaceVolume::Empty => volumes.push(json!({"name": "workspace", "emptyDir": {}})),
            WorkspaceVolume::Copy => {
                let name = child_name(&job.name, "workspace");
                let files = payload.workspace.as_deref().unwrap_or_default();
                let (cm, items) = files_config_map(&name, files, job, options).map_err(|e| {
                    refuse(
                        bound,
                        Origin::new("spec.workspace", None),
                        false,
                        format!("{e}: use --workspace pvc:CLAIM"),
                    )
                })?;
                objects.push(cm);
                volumes.push(json!({"name": "workspace", "emptyDir": {}}));
                volumes.push(json!({"name": "workspace-source", "configMap": {"name": name, "items": items}}));
                // ConfigMap volumes are read-only links; the workspace is writable: copy with
                // links followed (as the job's user, so it owns its files).
                init.push(json!({
                    "name": "workspace",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    // Only the items: a ConfigMap volume also holds `..data` and a dated
                    // directory of its own (names starting with `..` are refused as items).
                    "command": literal_argv(vec![
                        "/bin/sh".into(),
                        "-c".into(),
                        "cd \"$0\" && for f in * .[!.]*; do if [ -e \"$f\" ]; then cp -RL \"$f\" \"$1/\" || exit; fi; done".into(),
                        WORKSPACE_SOURCE.into(),
                        env.workdir.clone(),
                    ]),
                    "volumeMounts": [
                        {"name": "workspace", "mountPath": env.workdir},
                        {"name": "workspace-source", "mountPath": WORKSPACE_SOURCE, "readOnly": true},
                    ],
                    "securityContext": security,
                    "resources": resources(env),
                }));
            }
        }
        mounts.push(json!({"name": "workspace", "mountPath": env.workdir}));
    }

    for (i, asset) in job.static_assets.iter().enumerate() {
        let name = child_name(&job.name, &format!("asset-{i}"));
        let files = payload.assets.get(i).map(Vec::as_slice).unwrap_or_default();
        let (cm, items) = files_config_map(&name, files, job, options).map_err(|e| {
            refuse(
                bound,
                asset.origin.clone(),
                false,
                format!("{e}: put large assets in the image"),
            )
        })?;
        objects.push(cm);
        let volume = format!("asset-{i}");
        volumes.push(json!({"name": volume, "configMap": {"name": name, "items": items}}));
        mounts.push(json!({
            "name": volume,
            "mountPath": format!("{STATIC_ROOT}/{}", asset.save_path.trim_matches('/')),
            "readOnly": true,
        }));
    }

    // none: nothing in or out; bridge: out only to its network's pods and what egress allows.
    let policy = match bound.network {
        NetworkMode::None => Some(("no-network", json!({"policyTypes": ["Ingress", "Egress"]}))),
        NetworkMode::Bridge => Some((
            "egress",
            json!({"policyTypes": ["Egress"], "egress": bridge_egress(env, &network_of(bound))}),
        )),
        NetworkMode::Host => None,
    };
    if let Some((suffix, mut spec)) = policy {
        spec["podSelector"] = json!({"matchLabels": {JOB_LABEL: job.name}});
        objects.push(json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": metadata(&child_name(&job.name, suffix), job, options),
            "spec": spec,
        }));
    }

    let stdin = job.stdin.as_ref().map(|_| STDIN_PATH);
    let argv = entry::compose(&env.setup, job.disable_setup, stdin, &job.command.argv());
    let env_vars = env_list(env);
    let mut container = json!({
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": env.pull_policy().as_str(),
        "command": literal_argv(argv),
        "workingDir": env.workdir,
        "securityContext": security,
        "resources": resources(env),
    });
    if !env_vars.is_empty() {
        container["env"] = json!(env_vars);
    }
    if !mounts.is_empty() {
        container["volumeMounts"] = json!(mounts);
    }
    if !env.ports.is_empty() {
        container["ports"] = container_ports(env);
    }
    let mut pod_labels: BTreeMap<String, String> = job.labels.clone();
    pod_labels.insert(JOB_LABEL.into(), job.name.clone());
    pod_labels.insert(MANAGED_LABEL.into(), "runner".into());
    if bound.network == NetworkMode::Bridge {
        pod_labels.insert(NETWORK_LABEL.into(), network_of(bound));
    }
    let mut pod = json!({
        "restartPolicy": "Never",
        "automountServiceAccountToken": false,
        // Each pod in a user namespace of its own, as runner's containers are.
        "hostUsers": env.host_users,
        "enableServiceLinks": false,
        "terminationGracePeriodSeconds": job.termination_grace.as_secs(),
        "containers": [container],
    });
    if let Some(timeout) = job.timeout {
        pod["activeDeadlineSeconds"] = json!(timeout.as_secs_f64().ceil() as u64);
    }
    if !init.is_empty() {
        pod["initContainers"] = json!(init);
    }
    if !volumes.is_empty() {
        pod["volumes"] = json!(volumes);
    }
    let mut spec = json!({
        "backoffLimit": job.backoff_limit,
        "completions": job.completions,
        "parallelism": job.parallelism,
        "template": {"metadata": {"labels": pod_labels}, "spec": pod},
    });
    if job.indexed {
        spec["completionMode"] = json!("Indexed");
    }
    if let Some(d) = job.active_deadline {
        spec["activeDeadlineSeconds"] = json!(d.as_secs_f64().ceil() as u64);
    }
    if let Some(ttl) = job.ttl_after_finished {
        spec["ttlSecondsAfterFinished"] = json!(ttl.as_secs());
    }
    if !job.failure_rules.is_empty() {
        let mut rules = Vec::new();
        for rule in &job.failure_rules {
            let mut values = rule.values.clone();
            values.sort_unstable();
            values.dedup();
            let operator = match rule.operator {
                crate::manifest::policy::ExitOperator::In => "In",
                crate::manifest::policy::ExitOperator::NotIn => "NotIn",
            };
            if operator == "In" && values.contains(&0) {
                return Err(refuse(
                    bound,
                    Origin::new("spec.podFailurePolicy", None),
                    false,
                    "Kubernetes forbids exit code 0 in an `In` rule",
                ));
            }
            let action = match rule.action {
                crate::manifest::policy::RuleAction::FailJob => "FailJob",
                crate::manifest::policy::RuleAction::Ignore => "Ignore",
                crate::manifest::policy::RuleAction::Count => "Count",
            };
            rules.push(json!({
                "action": action,
                "onExitCodes": {"containerName": CONTAINER, "operator": operator, "values": values},
            }));
        }
        spec["podFailurePolicy"] = json!({"rules": rules});
    }
    let mut meta = metadata(&job.name, job, options);
    if !job.annotations.is_empty() {
        meta["annotations"] = json!(job.annotations);
    }
    objects.push(json!({"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": spec}));
    Ok(objects)
}

fn resources(env: &Environment) -> Value {
    let r = json!({
        "cpu": quantity_cpu(env.resources.cpu.0),
        "memory": quantity_memory(env.resources.memory.0),
    });
    let mut limits = r.clone();
    // A limit only, as runner enforces it: a request would make the scheduler reserve the
    // whole default (10Gi) on a node for every pod.
    limits["ephemeral-storage"] = json!(quantity_memory(env.resources.ephemeral_storage.0));
    json!({"requests": r, "limits": limits})
}

/// An Environment as an agent-sandbox `Sandbox` (agents.x-k8s.io/v1beta1; v1alpha1 is deprecated): one long-lived
/// pod with the Environment's image, user, env, limits and hardening, idling until used.
pub fn export_sandbox(env: &Environment, options: &ExportOptions) -> Result<Vec<Value>, ManifestError> {
    let refused = |path: &str, reason: &str| refuse_env(env, env.origin(path), reason);
    if !valid_name(&env.name) {
        return Err(refused("metadata.name", "not a DNS-1123 name"));
    }
    if env.image.is_none() {
        return Err(refused("spec.image", "a Sandbox needs an image (pass --image)"));
    }
    // What binding a Job refuses for the containerd backend, a Sandbox refuses here.
    if env.network == Some(NetworkMode::Bridge) {
        return Err(refused(
            "spec.network",
            "bridge networks are not supported yet (locally either)",
        ));
    }
    if env.include_host_env {
        return Err(refused(
            "spec.includeHostEnv",
            "this machine's environment is not the cluster's (and would leak into the sandbox)",
        ));
    }
    check_environment(env, env.network.unwrap_or(NetworkMode::None), options)?;
    let mut labels = BTreeMap::new();
    labels.insert("runner.dev/environment".to_string(), env.name.clone());
    labels.insert(MANAGED_LABEL.to_string(), "runner".to_string());
    let mut meta = json!({"name": env.name, "labels": labels});
    if let Some(ns) = &options.namespace {
        meta["namespace"] = json!(ns);
    }
    let mut container = json!({
        "name": "sandbox",
        "image": env.image,
        "imagePullPolicy": env.pull_policy().as_str(),
        // Setup, then idle: commands arrive with exec.
        "command": literal_argv(entry::compose(&env.setup, false, None, &Command::Shell("trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done".into()).argv())),
        "workingDir": env.workdir,
        "securityContext": security_context(env, options),
        "resources": resources(env),
    });
    if !env.env.is_empty() {
        container["env"] = json!(env_list(env));
    }
    let mut objects = vec![json!({
        "apiVersion": "agents.x-k8s.io/v1beta1",
        "kind": "Sandbox",
        "metadata": meta,
        "spec": {"podTemplate": {"metadata": {"labels": labels}, "spec": {
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "hostUsers": env.host_users,
            "containers": [container],
        }}},
    })];
    if env.network.unwrap_or(NetworkMode::None) == NetworkMode::None {
        let mut meta = json!({"name": format!("{}-no-network", env.name), "labels": labels});
        if let Some(ns) = &options.namespace {
            meta["namespace"] = json!(ns);
        }
        objects.push(json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": meta,
            "spec": {
                "podSelector": {"matchLabels": {"runner.dev/environment": env.name}},
                "policyTypes": ["Ingress", "Egress"],
            },
        }));
    }
    Ok(objects)
}

/// Read the files a job's objects carry (impure: the edge of `export_job`). Regular files and
/// directories only: a link or a device in an asset is refused rather than followed.
pub fn read_payload(bound: &Bound, options: &ExportOptions) -> Result<Payload, ManifestError> {
    let job = &bound.job;
    let mut payload = Payload::default();
    if options.workspace == Some(WorkspaceVolume::Copy)
        && let Some(ws) = &job.workspace
    {
        let dir = ws.clone();
        payload.workspace =
            Some(read_tree(&dir).map_err(|e| refuse(bound, Origin::new("spec.workspace", None), false, e))?);
    }
    for asset in &job.static_assets {
        let dir = asset.source.clone();
        let meta = std::fs::symlink_metadata(&dir)
            .map_err(|e| refuse(bound, asset.origin.clone(), false, format!("{}: {e}", dir.display())))?;
        let files = if !meta.is_dir() {
            let name = dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            vec![read_file(&dir, &name, &mut 0).map_err(|e| refuse(bound, asset.origin.clone(), false, e))?]
        } else {
            read_tree(&dir).map_err(|e| refuse(bound, asset.origin.clone(), false, e))?
        };
        payload.assets.push(files);
    }
    Ok(payload)
}

/// One regular file (never through a link), counted into `total` against the ConfigMap
/// limit while it is read.
fn read_file(path: &Path, rel: &str, total: &mut usize) -> Result<FileEntry, String> {
    use std::io::Read;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let not_regular = || format!("{rel}: only regular files and directories are exported (a link or a device is not)");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => not_regular(),
            _ => format!("{rel}: {e}"),
        })?;
    let meta = file.metadata().map_err(|e| format!("{rel}: {e}"))?;
    if !meta.is_file() {
        return Err(not_regular());
    }
    let too_large = || format!("more than {CONFIGMAP_LIMIT} bytes: too large for a ConfigMap");
    let room = CONFIGMAP_LIMIT.checked_sub(*total).ok_or_else(too_large)?;
    let mut data = Vec::new();
    file.take(room as u64 + 1)
        .read_to_end(&mut data)
        .map_err(|e| format!("{rel}: {e}"))?;
    if data.len() > room {
        return Err(too_large());
    }
    *total += data.len();
    Ok(FileEntry {
        path: rel.to_string(),
        data,
        mode: meta.permissions().mode() & 0o777,
    })
}

fn read_tree(root: &Path) -> Result<Vec<FileEntry>, String> {
    let mut out = Vec::new();
    let mut total = 0usize;
    let mut stack = vec![(root.to_path_buf(), String::new())];
    while let Some((dir, prefix)) = stack.pop() {
        let mut entries: Vec<_> = std::fs::read_dir(&dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            let name = entry.file_name().to_string_lossy().into_owned();
            let rel = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}/{name}")
            };
            if name.starts_with("..") {
                return Err(format!(
                    "{rel}: Kubernetes refuses names starting with `..` in a ConfigMap volume"
                ));
            }
            let meta = std::fs::symlink_metadata(entry.path()).map_err(|e| format!("{rel}: {e}"))?;
            if meta.is_dir() {
                stack.push((entry.path(), rel));
            } else {
                out.push(read_file(&entry.path(), &rel, &mut total)?);
            }
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

/// Our seccomp filter as a file for the kubelet's seccomp directory (`Localhost` profiles use
/// the same JSON as an OCI spec's `linux.seccomp`): the native ABI only, as runner's default.
pub fn seccomp_profile(arch: &str) -> Result<Value, super::SpecError> {
    serde_json::to_value(super::seccomp::default_profile(arch, false)?).map_err(|e| super::SpecError::Refused {
        origin: "seccomp".into(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_are_kubernetes_spellings() {
        assert_eq!(quantity_memory(256 << 20), "256Mi");
        assert_eq!(quantity_memory(2 << 30), "2Gi");
        assert_eq!(quantity_memory(1000), "1000");
        assert_eq!(quantity_cpu(500), "500m");
        assert_eq!(quantity_cpu(2000), "2");
    }

    #[test]
    fn derived_names_fit() {
        let long = "a".repeat(63);
        let name = child_name(&long, "workspace");
        assert!(name.len() <= 63 && valid_name(&name), "{name}");
        assert!(valid_name("eval-sum") && !valid_name("Eval") && !valid_name("-a") && !valid_name(""));
    }

    #[test]
    fn workspace_choices_parse() {
        assert_eq!("copy".parse(), Ok(WorkspaceVolume::Copy));
        assert_eq!("pvc:data-1".parse(), Ok(WorkspaceVolume::Pvc("data-1".into())));
        assert!("pvc:Bad_Name".parse::<WorkspaceVolume>().is_err());
        assert!("tmp".parse::<WorkspaceVolume>().is_err());
    }
}
