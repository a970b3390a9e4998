//! The result of a Kubernetes Job in runner's status format (`job::kube::status`), on API
//! objects shaped as the API server returns them (`tests/kube/recorded/*.json`: the Job, its
//! pods, their logs, and what runner must report): phase, reason, exit code, OOMKilled,
//! timeouts, setup split, per-index attempts, and the CLI exit code a local run would give.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::Value;

fn phase(v: &str) -> runner::job::Phase {
    serde_json::from_value(Value::String(v.into())).unwrap()
}

#[test]
fn recorded_kubernetes_jobs_map_to_runner_statuses() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/kube/recorded");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    assert!(files.len() >= 9, "{files:?}");
    for file in files {
        let name = file.file_stem().unwrap().to_string_lossy().into_owned();
        let case: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        let logs: BTreeMap<String, String> = serde_json::from_value(case["logs"].clone()).unwrap();
        let pods = case["pods"].as_array().unwrap().clone();
        let status = runner::job::kube::status(&case["job"], &pods, &logs, "job", case["setup"] == true);
        let want = &case["expect"];
        assert_eq!(status.phase, phase(want["phase"].as_str().unwrap()), "{name}");
        let reason = status.reason.map(|r| serde_json::to_value(r).unwrap());
        assert_eq!(reason.as_ref(), want.get("reason"), "{name}: reason");
        assert_eq!(
            status.exit_code(),
            want["cli"].as_i64().unwrap() as i32,
            "{name}: CLI exit code"
        );
        let attempts: Vec<Value> = status
            .attempts
            .iter()
            .map(|a| serde_json::json!([a.index, a.attempt, serde_json::to_value(a.phase).unwrap(), a.exit_code]))
            .collect();
        assert_eq!(Value::Array(attempts), want["attempts"], "{name}: attempts");
        if let Some(counted) = want.get("counted") {
            let got: Vec<bool> = status.attempts.iter().map(|a| a.counted).collect();
            assert_eq!(serde_json::json!(got), *counted, "{name}: counted against backoffLimit");
        }
        match status.result {
            None => assert!(want.get("exit").is_none(), "{name}: no result"),
            Some(r) => {
                assert_eq!(r.exit_code.map(i64::from), want["exit"].as_i64(), "{name}: exit code");
                assert_eq!(r.oom_killed, want["oom"] == true, "{name}: oom");
                assert_eq!(r.timed_out, want["timedOut"] == true, "{name}: timed out");
                assert_eq!(r.signal.map(i64::from), want["signal"].as_i64(), "{name}: signal");
                if let Some(stdout) = want["stdout"].as_str() {
                    assert_eq!(r.stdout, stdout, "{name}: stdout");
                }
                if let Some(setup) = want["setupStdout"].as_str() {
                    assert_eq!(
                        r.setup.as_ref().map(|s| s.stdout.as_str()),
                        Some(setup),
                        "{name}: setup"
                    );
                }
            }
        }
    }
}

/// Against a live cluster only when `KUBECONFIG` names one: `apply --kube` of the Python
/// example (its image must be pullable there), its result, then `delete job --kube`. Without
/// it the test says it did not run and why; the offline tests above are the evidence.
#[test]
fn a_live_cluster_runs_an_example_when_kubeconfig_is_set() {
    let Some(config) = std::env::var_os("KUBECONFIG") else {
        eprintln!(
            "SKIPPED a_live_cluster_runs_an_example_when_kubeconfig_is_set: KUBECONFIG is not set (no cluster to talk to)"
        );
        return;
    };
    let state = tempfile::tempdir().unwrap();
    let manifest = state.path().join("job.yaml");
    std::fs::write(
        &manifest,
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: e}\nspec: {image: docker.io/library/busybox:1.36}\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: runner-live-test}\nspec:\n  environment: e\n  command: \"echo hello from the cluster; exit 3\"\n  timeoutSeconds: 120\n",
    )
    .unwrap();
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_runner"))
            .args(args)
            .env("KUBECONFIG", &config)
            .env("RUNNER_STATE_DIR", state.path())
            .output()
            .unwrap()
    };
    let out = run(&["apply", "--kube", "-f", manifest.to_str().unwrap(), "-o", "json"]);
    let _ = run(&["delete", "job", "runner-live-test", "--kube"]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"]["result"]["exitCode"], 3);
    assert_eq!(v["status"]["result"]["stdout"], "hello from the cluster\n");
}

struct FakeApi {
    child: std::process::Child,
    dir: tempfile::TempDir,
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl FakeApi {
    fn start(exit: i32, log: &str) -> Self {
        Self::start_with(exit, log, false)
    }

    fn start_with(exit: i32, log: &str, never: bool) -> Self {
        use std::io::BufRead;
        let dir = tempfile::tempdir().unwrap();
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/kube/fake_apiserver.py");
        let mut child = std::process::Command::new("python3")
            .arg(script)
            .env("FAKE_EXIT", exit.to_string())
            .env("FAKE_LOG", log)
            .env("FAKE_REQUESTS", dir.path().join("requests"))
            .env(if never { "FAKE_NEVER" } else { "FAKE_UNUSED" }, "1")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3 runs the fake API server");
        let mut port = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut port)
            .unwrap();
        let port: u16 = port.trim().parse().expect("the fake API server's port");
        std::fs::write(
            dir.path().join("kubeconfig"),
            format!(
                "apiVersion: v1\nkind: Config\nclusters: [{{name: c, cluster: {{server: \"http://127.0.0.1:{port}\"}}}}]\nusers: [{{name: u, user: {{token: t}}}}]\ncontexts: [{{name: fake, context: {{cluster: c, user: u, namespace: evals}}}}]\ncurrent-context: fake\n"
            ),
        )
        .unwrap();
        FakeApi { child, dir }
    }

    fn command(&self, args: &[&str]) -> std::process::Command {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_runner"));
        command
            .args(args)
            .env("KUBECONFIG", self.dir.path().join("kubeconfig"))
            .env("RUNNER_STATE_DIR", self.dir.path().join("state"));
        command
    }

    fn runner(&self, args: &[&str]) -> std::process::Output {
        self.command(args).output().unwrap()
    }

    fn requests(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("requests")).unwrap_or_default()
    }
}

const KUBE_JOB: &str = "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: e}\nspec: {image: docker.io/library/busybox:1.36}\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: kube-demo}\nspec:\n  environment: e\n  command: \"cat; exit 3\"\n  stdin: \"in\\n\"\n";

/// `apply --kube` and `delete job --kube` through the CLI against a stand-in API server
/// (`tests/kube/fake_apiserver.py`; no real API server can run here): what runner creates, the
/// requests it makes to follow the Job and read its log, the result and exit code it reports,
/// the conflict on a second apply, and the clean-up by label.
#[test]
fn apply_and_delete_on_a_cluster_through_the_cli() {
    let api = FakeApi::start(3, "in\n");
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("job.yaml");
    std::fs::write(&manifest, KUBE_JOB).unwrap();
    let out = api.runner(&["apply", "--kube", "-f", manifest.to_str().unwrap(), "-o", "json"]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"]["phase"], "Failed");
    assert_eq!(
        v["status"]["reason"], "Error",
        "backoffLimit 0: the attempt's own reason, as locally"
    );
    assert_eq!(v["status"]["result"]["exitCode"], 3);
    assert_eq!(v["status"]["result"]["stdout"], "in\n");
    assert_eq!(v["status"]["attempts"][0]["exitCode"], 3);
    let requests = api.requests();
    for want in [
        "POST /api/v1/namespaces/evals/configmaps",
        "POST /apis/networking.k8s.io/v1/namespaces/evals/networkpolicies",
        "POST /apis/batch/v1/namespaces/evals/jobs",
        "GET /apis/batch/v1/namespaces/evals/jobs/kube-demo",
        "GET /api/v1/namespaces/evals/pods?&labelSelector=runner.dev%2Fjob%3Dkube-demo%2Crunner.dev%2Fmanaged-by%3Drunner",
        "GET /api/v1/namespaces/evals/pods/kube-demo-x1y2z/log?container=job",
    ] {
        assert!(requests.contains(want), "{want}\n{requests}");
    }
    // Applying again: the objects exist; nothing is replaced.
    let again = api.runner(&["apply", "--kube", "-f", manifest.to_str().unwrap()]);
    assert_eq!(again.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists in namespace \"evals\""));
    let deleted = api.runner(&["delete", "job", "kube-demo", "--kube"]);
    assert_eq!(
        deleted.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&deleted.stderr)
    );
    assert!(String::from_utf8_lossy(&deleted.stdout).contains("deleted on the cluster (3 objects)"));
    assert_eq!(
        api.runner(&["delete", "job", "kube-demo", "--kube"]).status.code(),
        Some(2)
    );

    // A job that succeeds, with the default output: its log, then the status line.
    let api = FakeApi::start(0, "hello from the pod\n");
    let out = api.runner(&["apply", "--kube", "-f", manifest.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello from the pod\n");
    assert!(String::from_utf8_lossy(&out.stderr).contains("job/kube-demo Succeeded (Completed)"));
}

/// Ctrl-C while a cluster job runs stops following it, not the job (it is the cluster's): exit
/// 130 and how to remove it.
#[test]
fn ctrl_c_stops_following_a_cluster_job() {
    let api = FakeApi::start_with(0, "", true);
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("job.yaml");
    std::fs::write(&manifest, KUBE_JOB).unwrap();
    let child = api
        .command(&["apply", "--kube", "-f", manifest.to_str().unwrap()])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_secs(3));
    assert!(
        api.requests()
            .contains("GET /apis/batch/v1/namespaces/evals/jobs/kube-demo"),
        "{}",
        api.requests()
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130));
    assert!(String::from_utf8_lossy(&out.stderr).contains("the jobs keep running on the cluster"));
}
