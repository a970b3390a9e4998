//! `runner export` (Kubernetes objects) through the CLI: every example manifest against its
//! golden file in `tests/golden/export/` (`UPDATE_GOLDEN=1 cargo test --test export` rewrites
//! them; `tests/kube/validate.sh` checks them against Kubernetes' own schemas in CI), the
//! hardening every exported pod carries, and each refusal of what Kubernetes cannot express.

mod common;

use std::path::{Path, PathBuf};

use common::*;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The flags every example is exported with: an image for host-backend Environments, the
/// workspace copied in, the node's pids limit accepted.
const EXAMPLE_FLAGS: &[&str] = &[
    "--image",
    "docker.io/library/busybox:1.36",
    "--workspace",
    "copy",
    "--node-pids-limit",
];

fn export(args: &[&str]) -> std::process::Output {
    let state = tempfile::tempdir().unwrap();
    let mut all = vec!["export"];
    all.extend_from_slice(args);
    let out = runner(&all, state.path());
    drop(state);
    out
}

fn examples() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo().join("manifests/examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 3, "{files:?}");
    files
}

#[test]
fn every_example_exports_as_its_golden_file() {
    let update = std::env::var_os("UPDATE_GOLDEN").is_some();
    let golden_dir = repo().join("tests/golden/export");
    std::fs::create_dir_all(&golden_dir).unwrap();
    for file in examples() {
        let name = file.file_stem().unwrap().to_str().unwrap();
        let mut args = vec!["-f", file.to_str().unwrap()];
        args.extend_from_slice(EXAMPLE_FLAGS);
        let out = export(&args);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let golden = golden_dir.join(format!("{name}.yaml"));
        if update {
            std::fs::write(&golden, &text).unwrap();
            continue;
        }
        let want = std::fs::read_to_string(&golden)
            .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_GOLDEN=1 writes it)", golden.display()));
        assert_eq!(text, want, "{name}: the export changed; review and UPDATE_GOLDEN=1");
        // The JSON form is the same objects in a List.
        args.extend_from_slice(&["-o", "json"]);
        let out = export(&args);
        let list = json_of(&out);
        assert_eq!(list["kind"], "List");
        let docs: Vec<serde_json::Value> = text
            .split("---\n")
            .filter(|d| !d.trim().is_empty())
            .map(|d| serde_saphyr::from_str(d).unwrap())
            .collect();
        assert_eq!(list["items"].as_array().unwrap(), &docs, "{name}");
    }
}

/// Every object of a multi-document YAML text.
fn docs_of(text: &str) -> Vec<serde_json::Value> {
    text.split("---\n")
        .filter(|d| !d.trim().is_empty())
        .map(|d| serde_saphyr::from_str::<serde_json::Value>(d).unwrap())
        .collect()
}

fn jobs_of(text: &str) -> Vec<serde_json::Value> {
    docs_of(text).into_iter().filter(|o| o["kind"] == "Job").collect()
}

/// `runner export` of `manifest` with `--seccomp-profile runner-seccomp.json` and `extra`
/// flags: what it printed, and the profile it wrote.
fn export_with_profile(dir: &Path, manifest: &str, extra: &[&str]) -> (String, serde_json::Value) {
    let file = write_manifest(dir, "job.yaml", manifest);
    let profile = dir.join("runner-seccomp.json");
    let mut args = vec![
        "-f",
        file.to_str().unwrap(),
        "--seccomp-profile",
        profile.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let out = export(&args);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let written = serde_json::from_str(&std::fs::read_to_string(&profile).unwrap()).unwrap();
    (String::from_utf8(out.stdout).unwrap(), written)
}

#[test]
fn exported_pods_carry_the_hardening_and_the_job_fields() {
    let dir = tempfile::tempdir().unwrap();
    let (text, profile) = export_with_profile(
        dir.path(),
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: e}\nspec:\n  image: reg.example/app:1\n  user: \"1000:1000\"\n  workdir: /work\n  env: {A: \"1\", B: \"$(HOME) $$\"}\n  setup: {commands: [\"echo set up\"]}\n  resources: {memory: 300Mi, cpu: 250m}\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: many, labels: {team: x}, annotations: {note: hi}}\nspec:\n  environment: e\n  command: \"exit 3\"\n  timeoutSeconds: 7\n  activeDeadlineSeconds: 100\n  backoffLimit: 2\n  completions: 4\n  parallelism: 2\n  completionMode: Indexed\n  ttlSecondsAfterFinished: 60\n  podFailurePolicy:\n    rules:\n      - {action: FailJob, onExitCodes: {operator: In, values: [42, 3]}}\n      - {action: Ignore, onExitCodes: {operator: In, values: [137]}}\n",
        &["--kube-namespace", "evals"],
    );
    let jobs = jobs_of(&text);
    let job = &jobs[0];
    let spec = &job["spec"];
    assert_eq!(job["metadata"]["namespace"], "evals");
    assert_eq!(job["metadata"]["annotations"]["note"], "hi");
    assert_eq!(job["metadata"]["labels"]["runner.dev/job"], "many");
    assert_eq!(
        (&spec["backoffLimit"], &spec["completions"], &spec["parallelism"]),
        (&serde_json::json!(2), &serde_json::json!(4), &serde_json::json!(2))
    );
    assert_eq!(spec["completionMode"], "Indexed");
    assert_eq!(spec["activeDeadlineSeconds"], 100);
    assert_eq!(spec["ttlSecondsAfterFinished"], 60);
    assert_eq!(
        spec["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"],
        serde_json::json!([3, 42])
    );
    assert_eq!(spec["podFailurePolicy"]["rules"][1]["action"], "Ignore");
    let pod = &spec["template"]["spec"];
    assert_eq!(pod["restartPolicy"], "Never");
    assert_eq!(pod["automountServiceAccountToken"], false);
    assert_eq!(pod["enableServiceLinks"], false);
    assert_eq!(
        pod["activeDeadlineSeconds"], 7,
        "timeoutSeconds is per attempt: the pod's deadline"
    );
    assert_eq!(spec["template"]["metadata"]["labels"]["team"], "x");
    let c = &pod["containers"][0];
    let sc = &c["securityContext"];
    assert_eq!(sc["privileged"], false);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
    let added: Vec<&str> = sc["capabilities"]["add"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(added.len(), 10);
    for forbidden in ["SYS_ADMIN", "NET_RAW", "SYS_PTRACE", "NET_ADMIN", "MKNOD"] {
        assert!(!added.contains(&forbidden), "{forbidden}");
    }
    assert_eq!(
        sc["seccompProfile"],
        serde_json::json!({"type": "Localhost", "localhostProfile": "runner-seccomp.json"})
    );
    assert_eq!(
        (sc["runAsUser"].as_u64(), sc["runAsGroup"].as_u64()),
        (Some(1000), Some(1000))
    );
    assert_eq!(
        c["resources"]["requests"],
        serde_json::json!({"cpu": "250m", "memory": "300Mi"})
    );
    // The ephemeral-storage limit is enforced (evicted over it), never requested: a request
    // would reserve the default 10Gi on a node for every pod.
    assert_eq!(
        c["resources"]["limits"],
        serde_json::json!({"cpu": "250m", "memory": "300Mi", "ephemeral-storage": "10Gi"})
    );
    assert_eq!(c["workingDir"], "/work");
    // The kubelet's `$(VAR)` expansion is escaped: the value reaches the job as written.
    assert_eq!(
        c["env"],
        serde_json::json!([{"name": "A", "value": "1"}, {"name": "B", "value": "$$(HOME) $$$$"}])
    );
    // Setup runs in the job's own container, in front of the command, as locally.
    let argv: Vec<&str> = c["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(argv[..2], ["/bin/sh", "-c"]);
    assert!(argv[2].contains("echo set up") && argv[2].contains("runner:setup-done"));
    assert_eq!(argv[3..], ["runner-entry", "/bin/sh", "-c", "exit 3"]);
    // network: none (the default) is a deny-all NetworkPolicy on the job's pods.
    assert!(text.contains("kind: NetworkPolicy"), "{text}");
    // The profile written is our filter: default errno, the dangerous calls absent.
    assert_eq!(profile["defaultAction"], "SCMP_ACT_ERRNO");
    let names = profile["syscalls"].to_string();
    for refused in ["\"mount\"", "\"unshare\"", "\"bpf\"", "\"keyctl\"", "\"init_module\""] {
        assert!(!names.contains(refused), "{refused}");
    }
}

/// Our Localhost profile admits the native syscall ABI only: an Environment that allows the
/// 32-bit one gets the runtime's default profile instead (which admits it), the others ours.
#[test]
fn an_environment_that_allows_32bit_syscalls_exports_with_the_runtime_default_profile() {
    let dir = tempfile::tempdir().unwrap();
    let (text, written) = export_with_profile(
        dir.path(),
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: compat}\nspec:\n  image: reg.example/app:1\n  allow32BitSyscalls: true\n---\napiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: native}\nspec:\n  image: reg.example/app:1\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: old-binary}\nspec:\n  environment: compat\n  command: \"./a.out\"\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: new-binary}\nspec:\n  environment: native\n  command: \"./a.out\"\n",
        &[],
    );
    let jobs = jobs_of(&text);
    let profile_of = |name: &str| {
        let job = jobs.iter().find(|j| j["metadata"]["name"] == name).unwrap();
        job["spec"]["template"]["spec"]["containers"][0]["securityContext"]["seccompProfile"].clone()
    };
    assert_eq!(profile_of("old-binary"), serde_json::json!({"type": "RuntimeDefault"}));
    assert_eq!(
        profile_of("new-binary"),
        serde_json::json!({"type": "Localhost", "localhostProfile": "runner-seccomp.json"})
    );
    assert_eq!(written["architectures"].as_array().map(Vec::len), Some(1), "{written}");
}

const BRIDGE_MANIFEST: &str = "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: e}\nspec:\n  image: reg.example/app:1\n  network: bridge\n  egress:\n    allow: [\"10.0.0.0/8\", \"203.0.113.7:443\"]\n  ports:\n  - {containerPort: 8080, name: web}\n  - {containerPort: 53, protocol: UDP, hostPort: 1053, hostIP: 0.0.0.0}\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: web}\nspec:\n  environment: e\n  command: \"true\"\n";

/// A bridge Job keeps its wall on a cluster: egress only to runner's other pods and the
/// allowed blocks; its ports are the container's.
#[test]
fn bridge_networks_export_their_egress_policy_and_ports() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_manifest(dir.path(), "bridge.yaml", BRIDGE_MANIFEST);
    let out = export(&["-f", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let docs = docs_of(&text);
    let policy = docs
        .iter()
        .find(|d| d["kind"] == "NetworkPolicy")
        .unwrap_or_else(|| panic!("no NetworkPolicy in {text}"));
    assert_eq!(policy["metadata"]["name"], "web-egress");
    assert_eq!(policy["spec"]["policyTypes"], serde_json::json!(["Egress"]));
    let egress = &policy["spec"]["egress"];
    // The pods of its network (the Job's pods carry the label), then the allowed blocks.
    assert_eq!(
        egress[0]["to"][0]["podSelector"]["matchLabels"]["runner.dev/network"], "runner",
        "{egress}"
    );
    assert_eq!(egress[1]["to"][0]["ipBlock"]["cidr"], "10.0.0.0/8", "{egress}");
    assert!(egress[1].get("ports").is_none(), "{egress}");
    assert_eq!(egress[2]["to"][0]["ipBlock"]["cidr"], "203.0.113.7/32", "{egress}");
    assert_eq!(
        egress[2]["ports"][0],
        serde_json::json!({"protocol": "TCP", "port": 443})
    );
    let job = docs.iter().find(|d| d["kind"] == "Job").unwrap();
    assert_eq!(
        job["spec"]["template"]["metadata"]["labels"]["runner.dev/network"],
        "runner"
    );
    let ports = &job["spec"]["template"]["spec"]["containers"][0]["ports"];
    assert_eq!(
        ports,
        &serde_json::json!([
            {"containerPort": 8080, "protocol": "TCP", "name": "web"},
            {"containerPort": 53, "protocol": "UDP", "hostPort": 1053, "hostIP": "0.0.0.0"},
        ])
    );
}

fn refused(dir: &Path, env_spec: &str, job_spec: &str, args: &[&str]) -> String {
    let file = write_manifest(
        dir,
        "bad.yaml",
        &format!(
            "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: e}}\nspec:\n  image: reg.example/app:1\n{env_spec}---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: j}}\nspec:\n  environment: e\n  command: [\"true\"]\n{job_spec}"
        ),
    );
    let mut all = vec!["-f", file.to_str().unwrap()];
    all.extend_from_slice(args);
    let out = export(&all);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{env_spec}{job_spec}: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(out.stdout.is_empty(), "nothing printed when refused");
    String::from_utf8(out.stderr).unwrap()
}

#[test]
fn what_kubernetes_cannot_express_is_refused_with_the_field_and_why() {
    let dir = tempfile::tempdir().unwrap();
    let host = dir.path().join("data");
    std::fs::create_dir(&host).unwrap();
    let ws = dir.path().join("ws");
    std::fs::create_dir(&ws).unwrap();
    let cases: Vec<(String, String, Vec<&str>, &str)> = vec![
        (
            format!("  mounts: [{{source: {}, target: /data}}]\n", host.display()),
            String::new(),
            vec![],
            "host bind mounts are not exported",
        ),
        (
            String::new(),
            format!("  mounts: [{{source: {}, target: /data}}]\n", host.display()),
            vec![],
            "host bind mounts are not exported",
        ),
        (
            "  network: host\n  hostUsers: true\n".into(),
            String::new(),
            vec![],
            "spec.network: cannot be exported to Kubernetes: hostNetwork",
        ),
        ("  user: host\n".into(), String::new(), vec![], "spec.user"),
        (
            "  network: bridge\n  egress: {allow: [\"10.0.0.0/8\", \"pypi.org:443\"]}\n".into(),
            String::new(),
            vec![],
            "spec.egress.allow: cannot be exported to Kubernetes: pypi.org:443: NetworkPolicies have no domain names",
        ),
        (
            "  resources: {pids: 50}\n".into(),
            String::new(),
            vec![],
            "bad.yaml:6:21: Environment \"e\": spec.resources.pids: cannot be exported to Kubernetes: Kubernetes has no per-pod pids limit",
        ),
        (
            String::new(),
            format!("  workspace: {}\n", ws.display()),
            vec![],
            "spec.workspace: cannot be exported to Kubernetes: a directory of this machine does not exist on a cluster",
        ),
        (
            String::new(),
            format!("  stdin: \"{}\"\n", "x".repeat((1 << 20) + 1)),
            vec![],
            "spec.stdin: cannot be exported to Kubernetes:",
        ),
    ];
    for (env_spec, job_spec, args, want) in cases {
        let err = refused(dir.path(), &env_spec, &job_spec, &args);
        assert!(err.contains(want), "{env_spec}{job_spec}\nwant: {want}\ngot: {err}");
    }
    // A workspace over the ConfigMap limit is refused for copy, and fine as a claim.
    std::fs::write(ws.join("big.bin"), vec![7u8; (1 << 20) + 10]).unwrap();
    let job = format!("  workspace: {}\n", ws.display());
    let err = refused(dir.path(), "", &job, &["--workspace", "copy"]);
    assert!(err.contains("too large for a ConfigMap"), "{err}");
    let file = dir.path().join("bad.yaml");
    let out = export(&["-f", file.to_str().unwrap(), "--workspace", "pvc:evals-ws"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("claimName: evals-ws"), "{text}");
    // A link in a copied workspace is refused, never followed.
    std::fs::remove_file(ws.join("big.bin")).unwrap();
    std::os::unix::fs::symlink("/etc/shadow", ws.join("link")).unwrap();
    let err = refused(dir.path(), "", &job, &["--workspace", "copy"]);
    assert!(
        err.contains("link: only regular files and directories are exported"),
        "{err}"
    );
}

#[test]
fn environments_export_as_agent_sandboxes_on_request() {
    let out = export(&["-f", "manifests/examples/python.yaml", "--sandbox", "--node-pids-limit"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let docs = docs_of(&text);
    assert_eq!(docs[0]["apiVersion"], "agents.x-k8s.io/v1beta1");
    assert_eq!(docs[0]["kind"], "Sandbox");
    let c = &docs[0]["spec"]["podTemplate"]["spec"]["containers"][0];
    assert_eq!(c["image"], "local/python:3.11");
    assert_eq!(c["securityContext"]["runAsUser"], 1000);
    assert_eq!(docs[1]["kind"], "NetworkPolicy");
    // Refused as for Jobs (the shared checks), and what binding a Job would refuse.
    let dir = tempfile::tempdir().unwrap();
    for (spec, want) in [
        (
            "  image: a:1\n  resources: {pids: 9}\n",
            "spec.resources.pids: cannot be exported to Kubernetes",
        ),
        (
            "  image: a:1\n  network: host\n  hostUsers: true\n",
            "spec.network: cannot be exported to Kubernetes: hostNetwork",
        ),
        (
            "  backend: host\n  includeHostEnv: true\n",
            "spec.includeHostEnv: cannot be exported",
        ),
    ] {
        let file = write_manifest(
            dir.path(),
            "env.yaml",
            &format!("apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: e}}\nspec:\n{spec}"),
        );
        let out = export(&["-f", file.to_str().unwrap(), "--sandbox", "--image", "a:1"]);
        assert_eq!(out.status.code(), Some(2), "{spec}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{spec}\nwant: {want}\ngot: {err}");
    }
}

/// Everything `runner export` prints validates against the official Kubernetes OpenAPI
/// schemas of two versions, strictly (`tests/kube/validate.sh`: the `kubernetes-validate`
/// package from PyPI, cached after its first install): the golden files, the variants above
/// (Localhost seccomp, Indexed jobs with failure rules, a PVC workspace), and the pod of an
/// exported Sandbox (the Sandbox is a custom resource the package has no schema for; its
/// `podTemplate` is validated as a Pod).
#[test]
fn exports_validate_against_the_kubernetes_schemas() {
    let dir = tempfile::tempdir().unwrap();
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo().join("tests/golden/export"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let manifest = write_manifest(
        dir.path(),
        "variant.yaml",
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: e}\nspec:\n  image: reg.example/app:1\n  user: \"1000:1000\"\n  resources: {memory: 300Mi, cpu: 250m}\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: many, annotations: {note: hi}}\nspec:\n  environment: e\n  workspace: .\n  command: \"exit 3\"\n  stdin: \"\"\n  timeoutSeconds: 7\n  activeDeadlineSeconds: 100\n  completions: 4\n  parallelism: 2\n  completionMode: Indexed\n  ttlSecondsAfterFinished: 60\n  podFailurePolicy:\n    rules:\n      - {action: FailJob, onExitCodes: {operator: In, values: [42, 3]}}\n      - {action: Count, onExitCodes: {operator: NotIn, values: [0, 1]}}\n",
    );
    let out = export(&[
        "-f",
        manifest.to_str().unwrap(),
        "--workspace",
        "pvc:evals-ws",
        "--seccomp-profile",
        dir.path().join("p.json").to_str().unwrap(),
        "--kube-namespace",
        "evals",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    files.push(dir.path().join("variant-out.yaml"));
    std::fs::write(files.last().unwrap(), &out.stdout).unwrap();
    let bridge = write_manifest(dir.path(), "bridge.yaml", BRIDGE_MANIFEST);
    let out = export(&["-f", bridge.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    files.push(dir.path().join("bridge-out.yaml"));
    std::fs::write(files.last().unwrap(), &out.stdout).unwrap();
    let out = export(&["-f", "manifests/examples/python.yaml", "--sandbox", "--node-pids-limit"]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8(out.stdout).unwrap();
    let mut pods = String::new();
    for doc in text.split("---\n").filter(|d| !d.trim().is_empty()) {
        let v: serde_json::Value = serde_saphyr::from_str(doc).unwrap();
        let object = if v["kind"] == "Sandbox" {
            serde_json::json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": v["metadata"]["name"], "labels": v["spec"]["podTemplate"]["metadata"]["labels"]},
                "spec": v["spec"]["podTemplate"]["spec"],
            })
        } else {
            v
        };
        pods.push_str("---\n");
        pods.push_str(&serde_saphyr::to_string(&object).unwrap());
    }
    files.push(dir.path().join("sandbox-pod.yaml"));
    std::fs::write(files.last().unwrap(), pods).unwrap();
    let out = std::process::Command::new(repo().join("tests/kube/validate.sh"))
        .args(&files)
        .output()
        .expect("run tests/kube/validate.sh");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(0), "{report}");
    assert_eq!(report.matches("ok ").count(), files.len() * 2, "{report}");
}
