//! The invalid-manifest table: each case is a manifest that must be refused, the field path
//! the error must name, and a fragment of its message. Runs the whole validation pipeline
//! (parse → validate → bind → resolve paths → build the spec), like `runner validate`.

use std::collections::BTreeMap;
use std::path::Path;

use runner::manifest;
use runner::spec::{self, HostEnv};

const ENV: &str =
    "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: env}\nspec:\n  image: local/busybox:1.35\n";
const JOB: &str = "---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: job}\nspec:\n  environment: env\n  workspace: ./ws\n  command: [\"true\"]\n";

fn host(state_dir: &Path) -> HostEnv {
    HostEnv {
        uid: 0,
        gid: 0,
        huid: None,
        hgid: None,
        state_dir: state_dir.to_path_buf(),
        arch: "x86_64".into(),
        vars: BTreeMap::new(),
        nofile_hard: 1 << 20,
    }
}

/// Run the pipeline on `yaml` in a directory holding `ws/` and `ws/link -> /etc`.
fn validate(yaml: &str) -> Result<(), String> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("ws")).unwrap();
    std::fs::create_dir(dir.path().join("state")).unwrap();
    std::os::unix::fs::symlink("/etc", dir.path().join("ws/link")).unwrap();
    let set = manifest::parse_str(yaml, dir.path(), None).map_err(|e| e.to_string())?;
    let host = host(&dir.path().join("state"));
    for job in &set.jobs {
        let bound = set.bind(job, None).map_err(|e| e.to_string())?;
        let plan = spec::resolve(&bound, &host).map_err(|e| e.to_string())?;
        spec::build(&plan, &host).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// `(case, manifest, field path named, message fragment)`.
fn cases() -> Vec<(&'static str, String, &'static str, &'static str)> {
    let env_with = |extra: &str| format!("{ENV}{extra}{JOB}");
    let job_with = |extra: &str| format!("{ENV}{JOB}{extra}");
    vec![
        (
            "unknown field in spec",
            env_with("  colour: blue\n"),
            "spec.colour",
            "unknown field `colour`",
        ),
        (
            "unknown field in metadata",
            format!("{ENV}{JOB}").replace("{name: job}", "{name: job, owner: me}"),
            "metadata.owner",
            "unknown field `owner`",
        ),
        (
            "unknown top-level field",
            format!("{ENV}status: {{}}\n{JOB}"),
            "",
            "unknown field `status`",
        ),
        (
            "memory is a word",
            env_with("  resources: {memory: lots}\n"),
            "spec.resources.memory",
            "not a quantity",
        ),
        (
            "memory in millibytes",
            env_with("  resources: {memory: 512m}\n"),
            "spec.resources.memory",
            "suffix",
        ),
        (
            "memory too small",
            env_with("  resources: {memory: 1Ki}\n"),
            "spec.resources.memory",
            "below the minimum",
        ),
        (
            "cpu is a word",
            env_with("  resources: {cpu: lots}\n"),
            "spec.resources.cpu",
            "not a quantity",
        ),
        (
            "cpu too small",
            env_with("  resources: {cpu: 1m}\n"),
            "spec.resources.cpu",
            "outside",
        ),
        (
            "pids zero",
            env_with("  resources: {pids: 0}\n"),
            "spec.resources.pids",
            "between 1 and",
        ),
        (
            "pids minus one",
            env_with("  resources: {pids: -1}\n"),
            "spec.resources.pids",
            "between 1 and",
        ),
        (
            "unknown resource",
            env_with("  resources: {gpu: 1}\n"),
            "spec.resources.gpu",
            "unknown field `gpu`",
        ),
        (
            "bad backend",
            env_with("  backend: docker\n"),
            "spec.backend",
            "unknown variant `docker`",
        ),
        (
            "bad network",
            env_with("  network: wifi\n"),
            "spec.network",
            "no Network \"wifi\" among this manifest's documents",
        ),
        (
            "network name that cannot be one",
            env_with("  network: Wi_Fi\n"),
            "spec.network",
            "\"Wi_Fi\" is not a network: none, host, bridge, or the name of a Network document",
        ),
        (
            "bridge network on the host backend",
            env_with("  backend: host\n  network: bridge\n"),
            "spec.network",
            "not supported by the host backend",
        ),
        (
            "bind of /proc",
            env_with("  mounts: [{source: /proc, target: /data}]\n"),
            "spec.mounts[0].source",
            "refusing to mount",
        ),
        (
            "bind of /etc child",
            env_with("  mounts: [{source: /etc/shadow, target: /data}]\n"),
            "spec.mounts[0].source",
            "refusing to mount",
        ),
        (
            "bind of host root",
            env_with("  mounts: [{source: /, target: /data}]\n"),
            "spec.mounts[0].source",
            "root filesystem",
        ),
        (
            "bind of /var (contains docker state)",
            env_with("  mounts: [{source: /var, target: /data}]\n"),
            "spec.mounts[0].source",
            "it contains /var/",
        ),
        (
            "bind of the containerd socket",
            env_with("  mounts: [{source: /run/containerd/containerd.sock, target: /sock}]\n"),
            "spec.mounts[0].source",
            "refusing to mount",
        ),
        (
            "target under the workdir",
            env_with("  mounts: [{source: /tmp, target: /workspace/data}]\n"),
            "spec.mounts[0].target",
            "under the workdir",
        ),
        (
            "job mount target under the workdir",
            job_with("  mounts: [{source: /tmp, target: /workspace}]\n"),
            "spec.mounts[0].target",
            "under the workdir",
        ),
        (
            "target under /proc",
            env_with("  mounts: [{source: /tmp, target: /proc/sys}]\n"),
            "spec.mounts[0].target",
            "/proc, /sys or /dev",
        ),
        (
            "relative target",
            env_with("  mounts: [{source: /tmp, target: data}]\n"),
            "spec.mounts[0].target",
            "must be absolute",
        ),
        (
            "dot-dot in source",
            env_with("  mounts: [{source: ../secrets, target: /data}]\n"),
            "spec.mounts[0].source",
            "`..`",
        ),
        (
            // A workspace-relative source is resolved beneath the workspace (as each container
            // resolves it again): a link leaving it is refused without naming where it leads.
            "symlink escaping to /etc",
            job_with("  mounts: [{source: link, target: /data}]\n"),
            "spec.mounts[0].source",
            "mount source \"link\" in the workspace: link: path leaves the workspace",
        ),
        (
            "workdir in /proc/self/fd",
            env_with("  workdir: /proc/self/fd/7\n"),
            "spec.workdir",
            "CVE-2024-21626",
        ),
        (
            "relative workdir",
            env_with("  workdir: workspace\n"),
            "spec.workdir",
            "must be absolute",
        ),
        (
            "uid too large",
            env_with("  user: \"4294967294:0\"\n"),
            "spec.user",
            "CVE-2024-40635",
        ),
        (
            "user by name",
            env_with("  user: nobody\n"),
            "spec.user",
            "expected \"uid:gid\"",
        ),
        (
            "user without gid",
            env_with("  user: \"1000\"\n"),
            "spec.user",
            "expected \"uid:gid\"",
        ),
        (
            "reserved label",
            format!("{ENV}{JOB}").replace("{name: job}", "{name: job, labels: {containerd.io/gc.root: x}}"),
            "metadata.labels.containerd.io/gc.root",
            "reserved prefix",
        ),
        (
            "our own label prefix",
            format!("{ENV}{JOB}").replace("{name: job}", "{name: job, labels: {runner.dev/owner: x}}"),
            "metadata.labels.runner.dev/owner",
            "reserved prefix",
        ),
        (
            "bad label value",
            format!("{ENV}{JOB}").replace("{name: job}", "{name: job, labels: {a: \"-x-\"}}"),
            "metadata.labels.a",
            "label value",
        ),
        (
            "uppercase name",
            format!("{ENV}{JOB}").replace("{name: job}", "{name: Job1}"),
            "metadata.name",
            "DNS-1123",
        ),
        (
            "empty command",
            format!("{ENV}{JOB}").replace("command: [\"true\"]", "command: []"),
            "spec.command",
            "must not be empty",
        ),
        (
            "command missing",
            format!("{ENV}{JOB}").replace("  command: [\"true\"]\n", ""),
            "spec",
            "missing field `command`",
        ),
        (
            "negative timeout",
            job_with("  timeoutSeconds: -1\n"),
            "spec.timeoutSeconds",
            "above 0",
        ),
        (
            "zero deadline",
            job_with("  activeDeadlineSeconds: 0\n"),
            "spec.activeDeadlineSeconds",
            "between 1",
        ),
        (
            "environment not found",
            format!("{ENV}{JOB}").replace("environment: env", "environment: other"),
            "spec.environment",
            "not defined",
        ),
        (
            "image missing for containerd",
            format!("{ENV}{JOB}").replace("  image: local/busybox:1.35\n", "  workdir: /workspace\n"),
            "spec.image",
            "required",
        ),
        (
            "includeHostEnv in a container",
            env_with("  includeHostEnv: true\n"),
            "spec.includeHostEnv",
            "leak",
        ),
        (
            "an id outside the user namespace",
            env_with("  user: \"70000:0\"\n"),
            "6:9: Environment \"env\": spec.user",
            "outside the container's user namespace",
        ),
        (
            "network: host in a user namespace",
            env_with("  network: host\n"),
            "6:12: Environment \"env\": spec.network",
            "needs hostUsers: true",
        ),
        (
            "host backend with none network",
            env_with("  backend: host\n  network: none\n"),
            "spec.network",
            "not supported by the host backend",
        ),
        (
            "host backend with mounts",
            env_with("  backend: host\n  mounts: [{source: /tmp, target: /data}]\n"),
            "spec.mounts[0].target",
            "need backend containerd",
        ),
        (
            "bad env var name",
            env_with("  env: {\"1BAD\": x}\n"),
            "spec.env.1BAD",
            "not a valid environment variable",
        ),
        (
            "save path escapes",
            job_with("  staticAssets: [{source: ./ws, savePath: ../x}]\n"),
            "spec.staticAssets[0].savePath",
            "savePath",
        ),
        (
            "missing static asset",
            job_with("  staticAssets: [{source: ./nope, savePath: x}]\n"),
            "spec.staticAssets[0].source",
            "does not exist",
        ),
        (
            "missing workspace",
            format!("{ENV}{JOB}").replace("workspace: ./ws", "workspace: ./nope"),
            "spec.workspace",
            "does not exist",
        ),
        (
            "wrong apiVersion",
            format!("{ENV}{JOB}")
                .replace("kind: Job", "kind: Job")
                .replacen("runner/v1alpha1", "v1", 1),
            "apiVersion",
            "unsupported apiVersion",
        ),
        (
            "unknown kind",
            format!("{ENV}{JOB}").replace("kind: Job", "kind: Pod"),
            "kind",
            "unknown kind",
        ),
        (
            "duplicate job",
            format!("{ENV}{JOB}{JOB}"),
            "metadata.name",
            "defined twice",
        ),
        (
            "wrong type for mountWorkspace",
            env_with("  mountWorkspace: maybe\n"),
            "spec.mountWorkspace",
            "bool",
        ),
        (
            "yaml syntax error",
            format!("{ENV}  env: {{a: [}}\n{JOB}"),
            "",
            "document 1",
        ),
        (
            "duplicate key",
            env_with("  workdir: /a\n  workdir: /b\n"),
            "",
            "duplicate",
        ),
    ]
}

#[test]
fn invalid_manifests_are_refused_naming_the_field() {
    let cases = cases();
    assert!(cases.len() >= 30);
    let mut failures = Vec::new();
    for (name, yaml, path, fragment) in cases {
        match validate(&yaml) {
            Ok(()) => failures.push(format!("{name}: accepted\n{yaml}")),
            Err(msg) => {
                let names_path = path.is_empty() || msg.contains(&format!("{path}:"));
                if !names_path || !msg.contains(fragment) {
                    failures.push(format!("{name}: expected field {path:?} and {fragment:?} in:\n  {msg}"));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} case(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn errors_give_line_and_column() {
    let yaml = format!("{ENV}  resources:\n    memory: lots\n{JOB}");
    let err = validate(&yaml).unwrap_err();
    assert!(err.starts_with("7:13: "), "{err}");
    let yaml = format!("{ENV}{JOB}  colour: blue\n");
    let err = validate(&yaml).unwrap_err();
    assert!(err.starts_with("14:3: "), "{err}");
}

#[test]
fn a_valid_manifest_passes() {
    validate(&format!("{ENV}{JOB}")).unwrap();
}

#[test]
fn yaml_bombs_are_refused_quickly() {
    // A billion-laughs style document: nested aliases that would expand exponentially.
    let mut yaml = String::from(
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: e}\nspec:\n  env: {}\n  setup:\n    commands: [x]\nbomb0: &a0 [x, x, x, x, x, x, x, x, x, x]\n",
    );
    for i in 1..10 {
        let prev = format!("*a{}", i - 1);
        yaml.push_str(&format!("bomb{i}: &a{i} [{}]\n", [prev.as_str(); 10].join(", ")));
    }
    let start = std::time::Instant::now();
    assert!(manifest::parse_str(&yaml, Path::new("."), None).is_err());
    let deep = format!(
        "apiVersion: runner/v1alpha1\nkind: Job\nx: {}{}\n",
        "[".repeat(10_000),
        "]".repeat(10_000)
    );
    assert!(manifest::parse_str(&deep, Path::new("."), None).is_err());
    assert!(
        start.elapsed() < std::time::Duration::from_secs(5),
        "took {:?}",
        start.elapsed()
    );
}
