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
