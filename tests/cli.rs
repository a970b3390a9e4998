//! The `runner` binary end to end on the host backend: exit codes, output formats, timeouts
//! that kill whole process trees, output caps. Each test works in its own temp dir.

mod common;

use std::time::{Duration, Instant};

use common::*;

#[test]
fn apply_json_keeps_streams_apart_and_maps_a_failing_job_to_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_manifest(
        dir.path(),
        "job.yaml",
        &host_job("out-err", r#"["sh", "-c", "echo out; echo err >&2; exit 3"]"#, ""),
    );
    let out = runner(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], dir.path());
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let job = json_of(&out);
    let result = &job["status"]["result"];
    assert_eq!(result["exitCode"], 3);
    assert_eq!(result["stdout"], "out\n");
    assert_eq!(result["stderr"], "err\n");
    assert_eq!(result["timedOut"], false);
    assert_eq!(job["status"]["phase"], "Failed");
    assert_eq!(job["status"]["reason"], "Error");
    assert_eq!(job["kind"], "Job");
    assert!(job["status"]["startTime"].as_str().unwrap().ends_with('Z'));
}

/// A command that cannot start is the submission's failure (exit 127), and the Job says why.
#[test]
fn a_command_that_cannot_start_fails_the_job_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_manifest(
        dir.path(),
        "job.yaml",
        &host_job("missing", r#"["/nonexistent/program-971"]"#, ""),
    );
    let out = runner(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], dir.path());
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let job = json_of(&out);
    assert_eq!(job["status"]["reason"], "Error", "{job}");
    assert_eq!(job["status"]["result"]["exitCode"], 127, "{job}");
    let message = job["status"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("cannot start") && message.contains("program-971"),
        "{job}"
    );
}

#[test]
fn apply_yaml_and_default_output_of_a_succeeding_job() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_manifest(dir.path(), "job.yaml", &host_job("ok", r#""echo hi""#, ""));
    let out = runner(
        &["apply", "--replace", "-f", file.to_str().unwrap(), "-o", "yaml"],
        dir.path(),
    );
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("phase: Succeeded"), "{text}");
    assert!(text.contains("reason: Completed"), "{text}");
    let out = runner(&["apply", "--replace", "-f", file.to_str().unwrap()], dir.path());
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\n");
    assert!(String::from_utf8_lossy(&out.stderr).contains("job/ok Succeeded (Completed)"));
}

#[test]
fn timeout_kills_backgrounded_and_reparented_grandchildren() {
    let dir = tempfile::tempdir().unwrap();
    // Three escape attempts: a background child, a re-parented grandchild (subshell exits),
    // and one that leaves the process group with setsid. Then the job blocks.
    let cmd = r#"["sh", "-c", "sleep 971.1 & (sleep 971.2 &) ; setsid sleep 971.3 & echo started; sleep 971.4"]"#;
    let file = write_manifest(dir.path(), "job.yaml", &host_job("tree", cmd, "  timeoutSeconds: 1\n"));
    let start = Instant::now();
    let out = runner(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], dir.path());
    let elapsed = start.elapsed();
    let survivors = processes_matching("sleep 971.");
    kill_matching("sleep 971.");
    assert_eq!(out.status.code(), Some(1));
    let job = json_of(&out);
    assert_eq!(job["status"]["result"]["timedOut"], true);
    assert_eq!(job["status"]["reason"], "Timeout");
    assert_eq!(job["status"]["result"]["stdout"], "started\n");
    assert!(elapsed < Duration::from_secs(3), "took {elapsed:?}");
    assert!(survivors.is_empty(), "processes survived the timeout: {survivors:?}");
}

#[test]
fn fifty_megabytes_of_output_are_capped_with_an_exact_dropped_count() {
    let dir = tempfile::tempdir().unwrap();
    let total: u64 = 50 * 1000 * 1000;
    let cmd = format!(r#"["sh", "-c", "head -c {total} /dev/zero | tr '\\0' x"]"#);
    let file = write_manifest(dir.path(), "job.yaml", &host_job("flood", &cmd, ""));
    let out = runner(
        &["apply", "--replace", "-f", file.to_str().unwrap(), "-o", "json"],
        dir.path(),
    );
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let result = &json_of(&out)["status"]["result"];
    let kept = result["stdout"].as_str().unwrap().len() as u64;
    let dropped = result["stdoutDroppedBytes"].as_u64().unwrap();
    assert_eq!(kept, 10 * 1024 * 1024);
    assert_eq!(kept + dropped, total);
    // A smaller cap on the command line.
    let out = runner(
        &[
            "apply",
            "--replace",
            "-f",
            file.to_str().unwrap(),
            "-o",
            "json",
            "--max-output-bytes",
            "1000",
        ],
        dir.path(),
    );
    let result = &json_of(&out)["status"]["result"];
    assert_eq!(result["stdout"].as_str().unwrap().len(), 1000);
    assert_eq!(result["stdoutDroppedBytes"].as_u64().unwrap(), total - 1000);
}

#[test]
fn stdin_is_delivered_and_absent_stdin_is_eof() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_manifest(
        dir.path(),
        "job.yaml",
        &host_job("cat", r#"["cat"]"#, "  stdin: \"a\\nb\\n\"\n"),
    );
    let out = runner(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], dir.path());
    assert_eq!(json_of(&out)["status"]["result"]["stdout"], "a\nb\n");
    let file = write_manifest(
        dir.path(),
        "job2.yaml",
        &host_job("cat2", r#"["cat"]"#, "  timeoutSeconds: 5\n"),
    );
    let out = runner(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], dir.path());
    let status = &json_of(&out)["status"];
    assert_eq!(status["result"]["timedOut"], false, "cat must see EOF at once");
    assert_eq!(status["phase"], "Succeeded");
}

#[test]
fn invalid_utf8_output_is_replaced_not_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_manifest(
        dir.path(),
        "job.yaml",
        &host_job("bytes", r#"["printf", "ok\\377\\376!"]"#, ""),
    );
    let out = runner(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], dir.path());
    assert_eq!(json_of(&out)["status"]["result"]["stdout"], "ok\u{fffd}\u{fffd}!");
}

#[test]
fn setup_output_is_reported_apart_and_a_failing_setup_fails_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let env = "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: host}\nspec:\n  backend: host\n  setup:\n    commands: [\"echo setting up\", \"echo setup-err >&2\"]\n";
    let job = "---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: s}\nspec:\n  environment: host\n  command: \"echo main\"\n";
    let file = write_manifest(dir.path(), "job.yaml", &format!("{env}{job}"));
    let out = runner(
        &["apply", "--replace", "-f", file.to_str().unwrap(), "-o", "json"],
        dir.path(),
    );
    let result = &json_of(&out)["status"]["result"];
    assert_eq!(result["stdout"], "main\n");
    assert_eq!(result["setup"]["stdout"], "setting up\n");
    assert_eq!(result["setup"]["stderr"], "setup-err\n");
    assert_eq!(result["setup"]["exitCode"], 0);
    // disableSetup skips it.
    let file = write_manifest(dir.path(), "job2.yaml", &format!("{env}{job}  disableSetup: true\n"));
    let out = runner(
        &["apply", "--replace", "-f", file.to_str().unwrap(), "-o", "json"],
        dir.path(),
    );
    assert!(json_of(&out)["status"]["result"].get("setup").is_none());
    // A failing setup: the command never runs.
    let failing = env.replace("\"echo setup-err >&2\"", "\"exit 4\"");
    let file = write_manifest(dir.path(), "job3.yaml", &format!("{failing}{job}"));
    let out = runner(
        &["apply", "--replace", "-f", file.to_str().unwrap(), "-o", "json"],
        dir.path(),
    );
    assert_eq!(out.status.code(), Some(1));
    let status = &json_of(&out)["status"];
    assert_eq!(status["reason"], "SetupFailed");
    assert_eq!(status["result"]["setup"]["exitCode"], 4);
    assert_eq!(status["result"]["stdout"], "");
}

#[test]
fn validate_exits_2_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let base =
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: e}\nspec:\n  image: local/busybox:1.35\n";
    let cases = [
        ("  colour: blue\n", "spec.colour"),
        ("  resources: {memory: lots}\n", "spec.resources.memory"),
        ("  mounts: [{source: /proc, target: /data}]\n", "spec.mounts[0].source"),
        (
            "  mounts: [{source: /tmp, target: /workspace/x}]\n",
            "spec.mounts[0].target",
        ),
    ];
    for (extra, field) in cases {
        let file = write_manifest(dir.path(), "bad.yaml", &format!("{base}{extra}"));
        let out = runner(&["validate", "-f", file.to_str().unwrap()], dir.path());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra}: {stderr}");
        assert!(stderr.contains(field), "{extra}: expected {field} in {stderr}");
        assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    }
    let file = write_manifest(dir.path(), "good.yaml", base);
    let out = runner(&["validate", "-f", file.to_str().unwrap()], dir.path());
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn spec_prints_the_hardened_spec_of_a_containerd_job() {
    let dir = tempfile::tempdir().unwrap();
    let repo = env!("CARGO_MANIFEST_DIR");
    let out = runner(
        &["spec", "-f", &format!("{repo}/manifests/examples/eval.yaml")],
        dir.path(),
    );
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let spec = json_of(&out);
    assert_eq!(spec["process"]["noNewPrivileges"], true);
    assert_ne!(spec["linux"]["seccomp"]["defaultAction"], "SCMP_ACT_ALLOW");
    assert_eq!(spec["linux"]["resources"]["devices"][0]["allow"], false);
    // Same input, same bytes (capability sets are sorted).
    let again = runner(
        &["spec", "-f", &format!("{repo}/manifests/examples/eval.yaml")],
        dir.path(),
    );
    assert_eq!(out.stdout, again.stdout);
}

#[test]
fn an_unreachable_containerd_is_exit_2_naming_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let repo = env!("CARGO_MANIFEST_DIR");
    let sock = dir.path().join("nothing.sock");
    let out = runner(
        &[
            "apply",
            "-f",
            &format!("{repo}/manifests/examples/eval.yaml"),
            "--address",
            sock.to_str().unwrap(),
        ],
        dir.path(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(sock.to_str().unwrap()), "{stderr}");
    assert!(stderr.contains("runner daemon start"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}

#[test]
fn global_flags_work_before_and_after_the_verb() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_manifest(dir.path(), "job.yaml", &host_job("flags", r#""true""#, ""));
    let f = file.to_str().unwrap();
    let state = dir.path().join("state");
    let s = state.to_str().unwrap();
    for args in [
        vec!["--namespace", "x", "--state-dir", s, "validate", "-f", f],
        vec![
            "validate",
            "-f",
            f,
            "--namespace",
            "x",
            "--address",
            "/tmp/none.sock",
            "--state-dir",
            s,
        ],
    ] {
        let out = runner(&args, dir.path());
        assert_eq!(
            out.status.code(),
            Some(0),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn a_workspace_inside_the_state_dir_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir_all(state.join("ws")).unwrap();
    let file = write_manifest(
        dir.path(),
        "job.yaml",
        &host_job(
            "st",
            r#""true""#,
            &format!("  workspace: {}\n", state.join("ws").display()),
        ),
    );
    let out = runner(&["validate", "-f", file.to_str().unwrap()], &state);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("state directory"));
}

#[test]
fn jobs_are_kept_in_the_store_and_expire_after_their_ttl() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_manifest(
        dir.path(),
        "job.yaml",
        &host_job("kept", r#""echo kept""#, "  ttlSecondsAfterFinished: 1\n"),
    );
    let out = runner(&["apply", "--replace", "-f", file.to_str().unwrap()], dir.path());
    assert_eq!(out.status.code(), Some(0));
    let got = runner(&["get", "job", "kept", "-o", "json"], dir.path());
    let job = json_of(&got);
    assert_eq!(job["status"]["phase"], "Succeeded");
    assert_eq!(job["status"]["succeeded"], 1);
    assert_eq!(job["status"]["conditions"][0]["type"], "Complete");
    assert_eq!(
        job["spec"]["backend"], "host",
        "the stored job names its Environment's backend"
    );
    assert_eq!(
        String::from_utf8_lossy(&runner(&["logs", "kept"], dir.path()).stdout),
        "kept\n"
    );
    let describe = String::from_utf8_lossy(&runner(&["describe", "job", "kept"], dir.path()).stdout).to_string();
    assert!(
        describe.contains("Complete") && describe.contains("AttemptFinished"),
        "{describe}"
    );
    // Applying the same finished job again runs it again.
    assert_eq!(
        runner(&["apply", "--replace", "-f", file.to_str().unwrap()], dir.path())
            .status
            .code(),
        Some(0)
    );
    std::thread::sleep(std::time::Duration::from_millis(2100));
    let list = runner(&["get", "jobs"], dir.path());
    assert!(
        !String::from_utf8_lossy(&list.stdout).contains("kept"),
        "expired jobs are purged"
    );
}

#[test]
fn a_detached_host_job_can_be_waited_for_and_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_manifest(dir.path(), "job.yaml", &host_job("bg", r#""sleep 991""#, ""));
    let out = runner(&["apply", "-f", file.to_str().unwrap(), "--detach"], dir.path());
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(eventually(std::time::Duration::from_secs(10), || !processes_matching(
        "sleep 991"
    )
    .is_empty()));
    let waited = runner(&["wait", "bg", "--timeout", "1s"], dir.path());
    assert_eq!(waited.status.code(), Some(2), "still running after the timeout");
    let deleted = runner(&["delete", "job", "bg"], dir.path());
    assert_eq!(
        deleted.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&deleted.stderr)
    );
    assert!(eventually(std::time::Duration::from_secs(5), || processes_matching(
        "sleep 991"
    )
    .is_empty()));
    kill_matching("sleep 991");
}

/// The store keeps the job's resolved view: a job whose host Environment comes from
/// `--env-dir` is shown as a host job by every later verb (which are not given the env dir),
/// and `--max-output-bytes` reaches the detached supervisor.
#[test]
fn a_detached_env_dir_job_keeps_its_backend_and_output_limit() {
    let dir = tempfile::tempdir().unwrap();
    let envs = dir.path().join("envs");
    std::fs::create_dir(&envs).unwrap();
    write_manifest(
        &envs,
        "host.yaml",
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: from-dir}\nspec:\n  backend: host\n",
    );
    let file = write_manifest(
        dir.path(),
        "job.yaml",
        "apiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: viewed}\nspec:\n  environment: from-dir\n  command: \"head -c 5000 /dev/zero | tr '\\\\0' x\"\n",
    );
    let out = runner(
        &[
            "apply",
            "-f",
            file.to_str().unwrap(),
            "--env-dir",
            envs.to_str().unwrap(),
            "--max-output-bytes",
            "1000",
            "--detach",
        ],
        dir.path(),
    );
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "job.runner/viewed created\n");
    let waited = runner(&["wait", "viewed", "--timeout", "30s"], dir.path());
    assert_eq!(
        waited.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&waited.stderr)
    );
    let got = runner(&["get", "job", "viewed", "-o", "json"], dir.path());
    let object = json_of(&got);
    assert_eq!(object["spec"]["backend"], "host", "{object}");
    assert_eq!(object["spec"]["environment"], "from-dir", "{object}");
    let result = &object["status"]["result"];
    assert_eq!(result["stdout"].as_str().unwrap().len(), 1000, "{result}");
    assert_eq!(result["stdoutDroppedBytes"], 4000, "{result}");
}

/// `serve --metrics-listen` serves the metrics without the token on a second address, and
/// `--log-format json` logs one JSON object per request; SIGTERM ends it with exit 0.
#[test]
fn serve_exposes_metrics_and_logs_requests_as_json() {
    use std::io::{BufRead, Read};
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("token"), "metrics-test-token-0123456789\n").unwrap();
    let mut child = std::process::Command::new(runner_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--log-format",
            "json",
        ])
        .arg("--token-file")
        .arg(dir.path().join("token"))
        .env("RUNNER_STATE_DIR", dir.path().join("state"))
        .env("CONTAINERD_ADDRESS", dir.path().join("none.sock"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .expect("listening line")
        .to_string();
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let metrics = loop {
        let mut line = String::new();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "no metrics line");
        if let Some(m) = line.trim().strip_prefix("runner: metrics on ") {
            break m.to_string();
        }
    };
    let status = ureq::get(&format!("{url}/v1/sessions"))
        .set("Authorization", "Bearer metrics-test-token-0123456789")
        .call()
        .unwrap()
        .status();
    assert_eq!(status, 200);
    let text = ureq::get(&metrics).call().unwrap().into_string().unwrap();
    assert!(
        text.contains(
            "runner_http_request_duration_seconds_count{route=\"/v1/sessions\",method=\"GET\",status=\"200\"} 1"
        ),
        "{text}"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert_eq!(child.wait().unwrap().code(), Some(0));
    let mut rest = String::new();
    stderr.read_to_string(&mut rest).unwrap();
    let access: serde_json::Value = rest
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["target"] == "runner::access")
        .unwrap_or_else(|| panic!("no JSON access line in {rest}"));
    assert_eq!(access["fields"]["route"], "/v1/sessions");
    assert_eq!(access["fields"]["status"], 200);
}

/// A server keeps its sessions' scratch workspaces in a directory of its own that local users
/// cannot list (mode 0711, random names), and a few made ahead there (issue 36, item 1:
/// making one was 0.2–0.4 ms of a pooled session's create). A session created without a
/// workspace gets one owned by nobody and open to every uid; deleting the session removes
/// it; SIGTERM removes the directory with the sessions (and waits for a workspace of 20,000
/// files to be removed).
#[test]
fn scratch_workspaces_live_in_a_directory_of_the_servers_that_goes_at_stop() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = std::process::Command::new(runner_bin());
    cmd.env("RUNNER_STATE_DIR", dir.path().join("state"))
        .env("CONTAINERD_ADDRESS", dir.path().join("none.sock"));
    let mut served = serve_with(cmd, dir.path());
    let pid = served.child.id();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let start = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .nth(19)
        .unwrap()
        .to_string();
    let prefix = format!("runner-session-{pid}-{start}-");
    let tmp = std::env::temp_dir();
    let homes = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(&tmp)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .map(|e| e.path())
            .collect()
    };
    assert_eq!(
        homes(),
        Vec::<std::path::PathBuf>::new(),
        "nothing before the first session"
    );
    // What the server's directory holds once its stock is made again after a create (one
    // filler, 4 made ahead).
    let settled = |want: usize| -> std::path::PathBuf {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let found = homes();
            let n = found.first().map(|h| std::fs::read_dir(h).unwrap().count());
            if found.len() == 1 && n == Some(want) {
                return found[0].clone();
            }
            assert!(Instant::now() < deadline, "{found:?} holds {n:?}, not {want}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let mut sessions = Vec::new();
    for i in 0..6 {
        let (status, v) = served.call("POST", "/v1/sessions", Some(r#"{"environment": {"backend": "host"}}"#));
        assert_eq!(status, 201, "{v}");
        let ws = std::path::PathBuf::from(v["workspace"].as_str().unwrap());
        let home = settled(i + 1 + 4);
        assert_eq!(ws.parent(), Some(home.as_path()), "{v}");
        let m = std::fs::symlink_metadata(&home).unwrap();
        assert_eq!((m.uid(), m.mode() & 0o7777), (0, 0o711), "{}", home.display());
        let m = std::fs::symlink_metadata(&ws).unwrap();
        assert!(m.is_dir(), "{}", ws.display());
        assert_eq!(
            (m.uid(), m.gid(), m.mode() & 0o7777),
            (65_534, 65_534, 0o777),
            "session {i}: {}",
            ws.display()
        );
        sessions.push((v["id"].as_str().unwrap().to_string(), ws));
    }
    // One session deleted: its workspace goes with it.
    let (first, ws) = sessions.remove(0);
    assert_eq!(served.call("DELETE", &format!("/v1/sessions/{first}"), None).0, 204);
    settled(5 + 4);
    assert!(!ws.exists(), "{} outlived its session", ws.display());
    // A workspace that takes a while to remove: the server's stop waits for it.
    let (id, ws) = &sessions[0];
    let (status, v) = served.call(
        "POST",
        &format!("/v1/sessions/{id}/exec"),
        Some(r#"{"command": ["sh", "-c", "mkdir many && cd many && seq 20000 | xargs touch"], "timeoutSeconds": 120}"#),
    );
    assert_eq!((status, &v["exitCode"]), (200, &0.into()), "{v}");
    assert_eq!(std::fs::read_dir(ws.join("many")).unwrap().count(), 20_000);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert_eq!(served.child.wait().unwrap().code(), Some(0));
    assert_eq!(homes(), Vec::<std::path::PathBuf>::new(), "after the server's stop");
}

/// A reader that went away (`runner describe job X | head -1`) ends a printing verb quietly,
/// with exit 0 and no panic; `apply`, whose job runs in the process, finishes the job anyway.
#[test]
fn a_closed_stdout_ends_printing_quietly_and_never_a_job() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_manifest(
        dir.path(),
        "job.yaml",
        &host_job("piped", r#"["sh", "-c", "sleep 0.3; echo done"]"#, ""),
    );
    // stdout is a pipe whose reader is already closed: the first write fails with EPIPE.
    let run = |args: &[&str]| {
        let (read, write) = nix::unistd::pipe().unwrap();
        drop(read);
        std::process::Command::new(runner_bin())
            .args(args)
            .env("RUNNER_STATE_DIR", dir.path())
            .stdout(std::process::Stdio::from(write))
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap()
    };
    let applied = run(&["apply", "-f", file.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&applied.stderr);
    assert_eq!(applied.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let got = json_of(&runner(&["get", "job", "piped", "-o", "json"], dir.path()));
    assert_eq!(got["status"]["phase"], "Succeeded", "{got}");
    for args in [
        vec!["describe", "job", "piped"],
        vec!["get", "jobs"],
        vec!["get", "jobs", "-o", "wide"],
        vec!["get", "job", "piped", "-o", "json"],
        vec!["logs", "piped"],
    ] {
        let out = run(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("panicked") && !stderr.contains("Broken pipe"),
            "{args:?}: {stderr}"
        );
    }
}

/// Applying a Job whose name exists is refused, as Kubernetes answers AlreadyExists: exit 2
/// naming the way out, the old record and its logs kept; `--replace` runs it again.
#[test]
fn re_applying_a_finished_job_is_refused_unless_replace() {
    let dir = tempfile::tempdir().unwrap();
    let first = write_manifest(dir.path(), "a.yaml", &host_job("twice", r#""echo first""#, ""));
    assert_eq!(
        runner(&["apply", "-f", first.to_str().unwrap()], dir.path())
            .status
            .code(),
        Some(0)
    );
    let second = write_manifest(dir.path(), "b.yaml", &host_job("twice", r#""echo second""#, ""));
    let refused = runner(&["apply", "-f", second.to_str().unwrap()], dir.path());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(r#"job "twice" already exists (Succeeded)"#) && stderr.contains("--replace"),
        "{stderr}"
    );
    let logs = runner(&["logs", "twice"], dir.path());
    assert_eq!(String::from_utf8_lossy(&logs.stdout), "first\n");
    let replaced = runner(&["apply", "--replace", "-f", second.to_str().unwrap()], dir.path());
    assert_eq!(
        replaced.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&replaced.stderr)
    );
    let logs = runner(&["logs", "twice"], dir.path());
    assert_eq!(String::from_utf8_lossy(&logs.stdout), "second\n");
}

/// The host backend stops a timed-out command as docs/security.md says: SIGTERM, the Job's
/// `terminationGracePeriodSeconds`, then SIGKILL (a command deaf to SIGTERM ends after both).
#[test]
fn a_timeout_waits_the_jobs_grace_period_before_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_manifest(
        dir.path(),
        "job.yaml",
        &host_job(
            "deaf",
            r#"["sh", "-c", "trap '' TERM; sleep 30"]"#,
            "  timeoutSeconds: 1\n  terminationGracePeriodSeconds: 1\n",
        ),
    );
    let out = runner(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], dir.path());
    let job = json_of(&out);
    let result = &job["status"]["result"];
    assert_eq!(job["status"]["reason"], "Timeout", "{job}");
    let ms = result["durationMs"].as_u64().unwrap();
    // 1 s of timeout and 1 s of grace; well under the 30 s sleep (nothing kept it alive).
    assert!((1900..6000).contains(&ms), "{ms} ms: {job}");
    assert_eq!(result["signal"], 9, "{job}");
}

/// `get job -o yaml` prints the whole resolved Job (paths absolute, defaults filled in), and
/// that output applies again from anywhere: same spec, same run (issue 37, item 6). Its
/// `spec.backend` is checked, never a choice.
#[test]
fn a_job_get_prints_applies_again_to_the_same_spec() {
    let dir = tempfile::tempdir().unwrap();
    // The workspace may not be in the state dir.
    let state = dir.path().join("state");
    let envs = dir.path().join("envs");
    std::fs::create_dir(&envs).unwrap();
    std::fs::create_dir_all(dir.path().join("src/ws")).unwrap();
    std::fs::write(dir.path().join("src/ws/in.txt"), "from the workspace\n").unwrap();
    std::fs::write(dir.path().join("src/asset.txt"), "an asset\n").unwrap();
    write_manifest(
        &envs,
        "host.yaml",
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: from-dir}\nspec:\n  backend: host\n",
    );
    let file = write_manifest(
        &dir.path().join("src"),
        "job.yaml",
        r#"apiVersion: runner/v1alpha1
kind: Job
metadata:
  name: round
  labels: {team: evals}
spec:
  environment: from-dir
  workspace: ws
  staticAssets: [{source: asset.txt, savePath: data/asset.txt}]
  command: 'cat in.txt; cat; echo "index $JOB_COMPLETION_INDEX"'
  stdin: "from stdin\n"
  timeoutSeconds: 30.5
  disableSetup: true
  completions: 2
  parallelism: 1
  completionMode: Indexed
  backoffLimit: 1
  activeDeadlineSeconds: 600
  ttlSecondsAfterFinished: 3600
  terminationGracePeriodSeconds: 3
  podFailurePolicy:
    rules:
    - action: FailJob
      onExitCodes: {operator: In, values: [42]}
"#,
    );
    let env_dir = envs.to_str().unwrap();
    let first = runner(&["apply", "-f", file.to_str().unwrap(), "--env-dir", env_dir], &state);
    assert_eq!(
        first.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let spec_of = |out: &std::process::Output| json_of(out)["spec"].clone();
    let before = spec_of(&runner(&["get", "job", "round", "-o", "json"], &state));
    let ws = dir.path().join("src/ws");
    let asset = dir.path().join("src/asset.txt");
    let expected = serde_json::json!({
        "environment": "from-dir",
        "backend": "host",
        "command": ["/bin/sh", "-c", r#"cat in.txt; cat; echo "index $JOB_COMPLETION_INDEX""#],
        "completions": 2,
        "workspace": ws,
        "staticAssets": [{"source": asset, "savePath": "data/asset.txt"}],
        "stdin": "from stdin\n",
        "timeoutSeconds": 30.5,
        "disableSetup": true,
        "parallelism": 1,
        "completionMode": "Indexed",
        "backoffLimit": 1,
        "activeDeadlineSeconds": 600,
        "ttlSecondsAfterFinished": 3600,
        "terminationGracePeriodSeconds": 3,
        "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}}]},
    });
    assert_eq!(before, expected);
    let logs_before = runner(&["logs", "round"], &state);

    // Printed as YAML, status and all, then applied from another directory.
    let printed = runner(&["get", "job", "round", "-o", "yaml"], &state);
    assert_eq!(printed.status.code(), Some(0));
    let elsewhere = dir.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let again = write_manifest(&elsewhere, "again.yaml", &String::from_utf8_lossy(&printed.stdout));
    let second = runner(
        &[
            "apply",
            "--replace",
            "-f",
            again.to_str().unwrap(),
            "--env-dir",
            env_dir,
        ],
        &state,
    );
    assert_eq!(
        second.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
    let after_json = runner(&["get", "job", "round", "-o", "json"], &state);
    assert_eq!(spec_of(&after_json), expected);
    assert_eq!(json_of(&after_json)["metadata"]["labels"]["team"], "evals");
    let logs_after = runner(&["logs", "round"], &state);
    assert_eq!(logs_after.stdout, logs_before.stdout);
    assert!(
        String::from_utf8_lossy(&logs_after.stdout).contains("from the workspace\nfrom stdin\n"),
        "{}",
        String::from_utf8_lossy(&logs_after.stdout)
    );

    // Its backend is where it ran: another one is refused at that field, naming the way out.
    let refused = runner(
        &[
            "apply",
            "--replace",
            "-f",
            again.to_str().unwrap(),
            "--env-dir",
            env_dir,
            "--backend",
            "containerd",
        ],
        &state,
    );
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("spec.backend") && stderr.contains("says backend host, but it resolves to containerd"),
        "{stderr}"
    );
}

/// A foreground `apply` prints every index's output, each line prefixed `[INDEX] ` when there
/// are several (`--index I` picks one, unprefixed); `logs --prefix`, `--tail N` and `--setup`
/// read the same output back (issue 37, items 3 and 9).
#[test]
fn every_index_is_printed_prefixed_and_logs_prefix_tail_and_setup() {
    let dir = tempfile::tempdir().unwrap();
    let env = "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: host}\nspec:\n  backend: host\n  setup:\n    commands: [\"echo preparing $JOB_COMPLETION_INDEX\"]\n";
    // Index 1 ends without a newline; index 2 fails after its output, a second after the
    // others ended (its failure fails the Job, which stops what still runs).
    let job = "---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: three}\nspec:\n  environment: host\n  completions: 3\n  parallelism: 3\n  completionMode: Indexed\n  command: 'echo \"first $JOB_COMPLETION_INDEX\"; echo \"err $JOB_COMPLETION_INDEX\" >&2; printf \"second $JOB_COMPLETION_INDEX\"; [ $JOB_COMPLETION_INDEX = 1 ] || echo; [ $JOB_COMPLETION_INDEX != 2 ] || { sleep 1; exit 1; }'\n";
    let file = write_manifest(dir.path(), "job.yaml", &format!("{env}{job}"));
    let text = |o: &[u8]| String::from_utf8_lossy(o).to_string();
    let out = runner(&["apply", "-f", file.to_str().unwrap()], dir.path());
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "[0] first 0\n[0] second 0\n[1] first 1\n[1] second 1\n[2] first 2\n[2] second 2\n"
    );
    let stderr = text(&out.stderr);
    assert!(
        stderr.starts_with("[0] err 0\n[1] err 1\n[2] err 2\njob/three Failed"),
        "{stderr}"
    );

    let again = |extra: &[&str]| {
        let mut args = vec!["apply", "--replace", "-f", file.to_str().unwrap()];
        args.extend_from_slice(extra);
        runner(&args, dir.path())
    };
    let one = again(&["--index", "1"]);
    assert_eq!(text(&one.stdout), "first 1\nsecond 1");
    assert!(
        text(&one.stderr).starts_with("err 1\njob/three Failed"),
        "{}",
        text(&one.stderr)
    );

    let logs = |extra: &[&str]| {
        let mut args = vec!["logs", "three"];
        args.extend_from_slice(extra);
        let out = runner(&args, dir.path());
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        (text(&out.stdout), text(&out.stderr))
    };
    assert_eq!(logs(&[]).0, "first 0\nsecond 0\nfirst 1\nsecond 1first 2\nsecond 2\n");
    assert_eq!(
        logs(&["--prefix"]).0,
        "[0] first 0\n[0] second 0\n[1] first 1\n[1] second 1\n[2] first 2\n[2] second 2\n"
    );
    assert_eq!(logs(&["--prefix"]).1, "[0] err 0\n[1] err 1\n[2] err 2\n");
    assert_eq!(
        logs(&["--tail", "1", "--prefix"]).0,
        "[0] second 0\n[1] second 1\n[2] second 2\n"
    );
    assert_eq!(logs(&["--tail", "1", "--index", "1"]).0, "second 1");
    assert_eq!(logs(&["--tail", "0"]).0, "");
    assert_eq!(
        logs(&["--setup", "--prefix"]).0,
        "[0] preparing 0\n[1] preparing 1\n[2] preparing 2\n"
    );
    let unknown = runner(&["logs", "nothing-here", "--tail", "3"], dir.path());
    assert_eq!(unknown.status.code(), Some(2));
    // An index or attempt the job does not have is said, not printed as nothing.
    for (args, says) in [
        (
            &["--index", "3"][..],
            "job three has completion indexes 0 to 2: there is no index 3",
        ),
        (&["--attempt", "7"][..], "there is no attempt 7"),
        (
            &["--index", "1", "--attempt", "2"][..],
            "job three index 1 made attempts 0 to 0: there is no attempt 2",
        ),
    ] {
        let mut all = vec!["logs", "three"];
        all.extend_from_slice(args);
        let out = runner(&all, dir.path());
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out.stderr));
        assert!(text(&out.stderr).contains(says), "{args:?}: {}", text(&out.stderr));
    }
    assert_eq!(logs(&["--attempt", "0", "--index", "2"]).0, "first 2\nsecond 2\n");
}

/// The errors a newcomer met, as `runner validate` prints them (issue 37, item 8): each names
/// the file, line and column, the field, and what to write instead.
#[test]
fn errors_say_where_and_what_to_write() {
    let dir = tempfile::tempdir().unwrap();
    let env = "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: host}\nspec:\n  backend: host\n---\n";
    let job = |spec: &str| {
        format!(
            "{env}apiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: j}}\nspec:\n  environment: host\n{spec}"
        )
    };
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "missing workspace",
            job("  workspace: ./nope\n  command: \"true\"\n"),
            "case.yaml:12:14: Job \"j\": spec.workspace: ",
        ),
        (
            "missing workspace, said plainly",
            job("  workspace: ./nope\n  command: \"true\"\n"),
            "/nope: does not exist",
        ),
        (
            "a duration for seconds",
            job("  command: \"true\"\n  timeoutSeconds: \"10s\"\n"),
            "case.yaml:13:19: document 2: spec.timeoutSeconds: \"10s\" is not a number of seconds: write 10 (seconds, no unit)",
        ),
        (
            "a fraction for whole seconds",
            job("  command: \"true\"\n  activeDeadlineSeconds: 1.5\n"),
            "spec.activeDeadlineSeconds: 1.5 is not a whole number of seconds",
        ),
        (
            "a colon in a plain value",
            job("  command: echo a: b\n"),
            "case.yaml:12:18: document 2: spec: mapping values are not allowed in this context; a value holding `: ` must be quoted",
        ),
        ("a tab", job("\tcommand: x\n"), "YAML indents with spaces, never tabs"),
        (
            "an unknown kind",
            env.replace("kind: Environment", "kind: Netwrk"),
            "unknown kind \"Netwrk\" (expected Environment, Job, Network or WarmPool)",
        ),
    ];
    for (case, text, expected) in cases {
        let file = write_manifest(dir.path(), "case.yaml", &text);
        let out = runner(&["validate", "-f", file.to_str().unwrap()], &dir.path().join("state"));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{case}: {stderr}");
        assert!(stderr.contains(expected), "{case}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{case}: one line: {stderr}");
    }
}

/// The tables a newcomer reads (issue 37, item 9): PHASE as `get job` says it, a multi-line
/// command on one line, `-o name`, `get -w`, `delete --all` and `-l`, `version`, `completion`.
#[test]
fn tables_name_watch_delete_many_version_and_completion() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let text = |out: &std::process::Output| String::from_utf8_lossy(&out.stdout).to_string();
    let two_lines = host_job("multi", "\"echo one\\necho two\"", "");
    let file = write_manifest(dir.path(), "multi.yaml", &two_lines);
    let applied = runner(&["apply", "-f", file.to_str().unwrap(), "-o", "name"], &state);
    assert_eq!(text(&applied), "job.runner/multi\n");
    let wide = text(&runner(&["get", "jobs", "-o", "wide"], &state));
    let lines: Vec<&str> = wide.lines().collect();
    assert_eq!(lines.len(), 2, "{wide}");
    assert!(lines[0].starts_with("NAME") && lines[0].contains(" PHASE "), "{wide}");
    assert!(lines[1].ends_with(r"/bin/sh -c echo one\necho two"), "{wide}");
    let long = host_job("long", &format!("\"echo {}\"", "x".repeat(100)), "");
    let long = long.replace("metadata: {name: long}", "metadata: {name: long, labels: {group: a}}");
    let file = write_manifest(dir.path(), "long.yaml", &long);
    assert_eq!(
        runner(&["apply", "-f", file.to_str().unwrap()], &state).status.code(),
        Some(0)
    );
    let row = text(&runner(&["get", "job", "long"], &state));
    assert!(row.lines().nth(1).unwrap().ends_with('…'), "{row}");
    assert_eq!(
        text(&runner(&["get", "jobs", "-o", "name"], &state)),
        "job.runner/long\njob.runner/multi\n"
    );

    // A watch prints the list, then each change, until interrupted.
    let mut watch = std::process::Command::new(runner_bin())
        .args(["get", "jobs", "-w"])
        .env("RUNNER_STATE_DIR", &state)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(watch.stdout.take().unwrap()));
    let header = lines.next().unwrap().unwrap();
    assert!(header.starts_with("NAME"), "{header}");
    let slow = write_manifest(dir.path(), "slow.yaml", &host_job("slow", "\"sleep 1\"", ""));
    assert_eq!(
        runner(&["apply", "-f", slow.to_str().unwrap(), "--detach"], &state)
            .status
            .code(),
        Some(0)
    );
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let done = line.starts_with("slow ") && line.contains("Succeeded");
        seen.push(line);
        if done {
            break;
        }
    }
    assert!(
        seen.iter().any(|l| l.starts_with("slow ") && l.contains("Running")),
        "{seen:?}"
    );
    unsafe { libc::kill(watch.id() as i32, libc::SIGINT) };
    assert_eq!(watch.wait().unwrap().code(), Some(0));

    // delete -l: only the labelled one; --all: the rest.
    let deleted = runner(&["delete", "job", "-l", "group=a"], &state);
    assert_eq!(
        text(&deleted),
        "job.runner/long deleted\n",
        "{}",
        String::from_utf8_lossy(&deleted.stderr)
    );
    let deleted = runner(&["delete", "jobs", "--all"], &state);
    assert_eq!(text(&deleted), "job.runner/multi deleted\njob.runner/slow deleted\n");
    assert_eq!(text(&runner(&["get", "jobs", "-o", "name"], &state)), "");
    let neither = runner(&["delete", "job"], &state);
    assert_eq!(neither.status.code(), Some(2));

    // version: this build's commit; containerd's, or why there is none.
    let version = runner(&["version", "--address", "/nonexistent.sock"], &state);
    let said = text(&version);
    assert_eq!(version.status.code(), Some(0));
    assert!(
        said.starts_with(&format!("runner {} (commit ", env!("CARGO_PKG_VERSION"))),
        "{said}"
    );
    assert!(!said.contains("commit unknown"), "{said}");
    assert!(
        said.contains("containerd: not reachable:") && said.contains("/nonexistent.sock"),
        "{said}"
    );
    // completion: a script bash accepts, naming the verbs.
    let script = text(&runner(&["completion", "bash"], &state));
    assert!(script.contains("runner__apply") || script.contains("apply"), "{script}");
    let path = write_manifest(dir.path(), "runner.bash", &script);
    let checked = std::process::Command::new("bash")
        .arg("-n")
        .arg(&path)
        .status()
        .unwrap();
    assert!(checked.success());
    for shell in ["zsh", "fish"] {
        assert!(!text(&runner(&["completion", shell], &state)).is_empty());
    }
}

/// A verb's help shows its own flags, the global ones once under `runner options` (issue 37,
/// item 8: every verb's help listed eight global flags).
#[test]
fn help_shows_a_verbs_own_flags_and_options_the_global_ones() {
    let dir = tempfile::tempdir().unwrap();
    let help = |args: &[&str]| {
        let out = runner(args, dir.path());
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    for verb in ["validate", "export", "logs", "apply", "get jobs"] {
        let mut args: Vec<&str> = verb.split(' ').collect();
        args.push("--help");
        let text = help(&args);
        assert!(text.trim_end().ends_with("runner options"), "{verb}:\n{text}");
        // The footer names a few; the flags themselves are not listed.
        let text = text.trim_end().rsplit_once('\n').unwrap().0;
        for global in [
            "--address",
            "--dns-upstream",
            "--hosts-dir",
            "--warm-cgroup-attach",
            "--state-dir",
        ] {
            assert!(!text.contains(global), "{verb} --help shows {global}:\n{text}");
        }
    }
    assert!(help(&["logs", "--help"]).starts_with("Print a job's output"));
    let options = help(&["options"]);
    for (heading, flag) in [
        ("Containerd:", "--address"),
        ("Registries:", "--hosts-dir"),
        ("Networks:", "--dns-upstream"),
        ("State and logging:", "--state-dir"),
        ("Jobs and servers:", "--shutdown-grace"),
    ] {
        let at = options.find(heading).unwrap_or_else(|| panic!("{heading}:\n{options}"));
        assert!(options[at..].contains(flag), "{flag} under {heading}:\n{options}");
    }
    assert!(!options.contains("--runner-exe"));
}
