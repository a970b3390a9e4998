//! Every manifest under `manifests/examples/` runs through the CLI exactly as the README and
//! `scripts/quickstart.sh` run it — `runner validate -f`, `runner apply -f` with the default
//! output, and `runner apply -f ... -o json` — from the checkout's root, against the private
//! containerd of scripts/test.sh, and its result is asserted against `<name>.expected.json`
//! beside it. An example without an expectation fails: a new example joins by itself.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use serde::Deserialize;

/// What running an example must give.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Expected {
    /// The CLI's exit code for the whole file.
    exit_code: i32,
    /// By job name: every job of the file.
    jobs: std::collections::BTreeMap<String, ExpectedJob>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ExpectedJob {
    phase: String,
    reason: String,
    exit_code: i32,
    stdout: Option<String>,
    #[serde(default)]
    stdout_contains: Vec<String>,
    stderr: Option<String>,
    #[serde(default)]
    stderr_contains: Vec<String>,
    setup_stdout: Option<String>,
    /// The warm pool whose member ran it (none: a container made for it).
    pool: Option<String>,
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn examples() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(repo().join("manifests/examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no examples found");
    out
}

/// `runner ARGS` from the checkout's root (as the README runs it) against the test containerd.
fn cli(args: &[&str], state: &Path) -> std::process::Output {
    runner_ctd_command(args, state).current_dir(repo()).output().unwrap()
}

fn import_images(state: &Path) {
    for image in ["busybox-oci.tar", "python-oci.tar"] {
        let path = image_dir().join(image);
        let out = cli(&["image", "import", path.to_str().unwrap()], state);
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    }
}

fn check_job(example: &str, job: &serde_json::Value, want: &ExpectedJob) {
    let name = job["metadata"]["name"].as_str().unwrap_or("?");
    let status = &job["status"];
    let result = &status["result"];
    let at = format!("{example}: job {name}: {job}");
    assert_eq!(status["phase"], want.phase.as_str(), "{at}");
    assert_eq!(status["reason"], want.reason.as_str(), "{at}");
    assert_eq!(result["exitCode"], want.exit_code, "{at}");
    let text = |field: &str| result[field].as_str().unwrap_or_default().to_string();
    if let Some(stdout) = &want.stdout {
        assert_eq!(&text("stdout"), stdout, "{at}");
    }
    for part in &want.stdout_contains {
        assert!(text("stdout").contains(part), "stdout lacks {part:?}: {at}");
    }
    if let Some(stderr) = &want.stderr {
        assert_eq!(&text("stderr"), stderr, "{at}");
    }
    for part in &want.stderr_contains {
        assert!(text("stderr").contains(part), "stderr lacks {part:?}: {at}");
    }
    if let Some(setup) = &want.setup_stdout {
        assert_eq!(result["setup"]["stdout"], setup.as_str(), "{at}");
    }
    assert_eq!(result["pool"].as_str(), want.pool.as_deref(), "{at}");
}

#[test]
#[ignore = "needs a private containerd and the Python image: run scripts/test.sh"]
fn every_example_runs_through_the_cli_with_its_expected_result() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_images(&state);
    for file in examples() {
        let rel = file.strip_prefix(repo()).unwrap().to_str().unwrap().to_string();
        let expectation = file.with_extension("expected.json");
        let text = std::fs::read_to_string(&expectation).unwrap_or_else(|_| {
            panic!(
                "{rel} has no {}: every example states what running it gives",
                expectation.file_name().unwrap().to_string_lossy()
            )
        });
        let want: Expected = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", expectation.display()));

        let out = cli(&["validate", "-f", &rel], &state);
        assert_eq!(
            out.status.code(),
            Some(0),
            "validate {rel}: {}",
            String::from_utf8_lossy(&out.stderr)
        );

        // As the README and the quickstart show it: job output on ours, a status line last.
        let out = cli(&["apply", "-f", &rel], &state);
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(want.exit_code), "apply {rel}: {stderr}");
        for (name, job) in &want.jobs {
            assert!(
                stderr.contains(&format!("job/{name} {} ({})", job.phase, job.reason)),
                "apply {rel}: {stderr}"
            );
            if let Some(stdout) = &job.stdout {
                assert!(
                    String::from_utf8_lossy(&out.stdout).contains(stdout.as_str()),
                    "apply {rel}"
                );
            }
        }

        // The whole result, as `-o json` prints it.
        // The second run of a name replaces the first (without --replace it is refused).
        let out = cli(&["apply", "--replace", "-f", &rel, "-o", "json"], &state);
        assert_eq!(
            out.status.code(),
            Some(want.exit_code),
            "apply -o json {rel}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let value = json_of(&out);
        let items: Vec<serde_json::Value> = match value["kind"].as_str() {
            Some("List") => value["items"].as_array().unwrap().clone(),
            _ => vec![value],
        };
        let names: Vec<&str> = items.iter().map(|j| j["metadata"]["name"].as_str().unwrap()).collect();
        let wanted: Vec<&str> = want.jobs.keys().map(String::as_str).collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(sorted, wanted, "{rel}: the expectation names every job of the file");
        for job in &items {
            let name = job["metadata"]["name"].as_str().unwrap();
            check_job(&rel, job, &want.jobs[name]);
        }
    }
    // The pools examples made outlive the runner on purpose: removed as the README shows.
    let pools = json_of(&cli(&["pool", "ls", "-o", "json"], &state));
    for pool in pools.as_array().unwrap() {
        let name = pool["name"].as_str().unwrap();
        let out = cli(&["pool", "rm", name], &state);
        assert_eq!(
            out.status.code(),
            Some(0),
            "pool rm {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
