//! Jobs with Kubernetes semantics end to end through the CLI, against the private containerd
//! of scripts/test.sh: detached indexed runs, deadlines, retries, delete.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;

const ENV: &str =
    "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: bb}\nspec:\n  image: local/busybox:1.35\n";

fn job(name: &str, command: &str, extra: &str) -> String {
    format!(
        "{ENV}---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {name}, labels: {{suite: jobs-test}}}}\nspec:\n  environment: bb\n  command: {command}\n{extra}"
    )
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_detached_indexed_job_runs_every_index_n_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    let file = write_manifest(
        dir.path(),
        "idx.yaml",
        &job(
            "indexed",
            r#"["sh", "-c", "echo index=$JOB_COMPLETION_INDEX; sleep 0.3"]"#,
            "  completions: 4\n  parallelism: 2\n  completionMode: Indexed\n",
        ),
    );
    let start = Instant::now();
    let out = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "--detach"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(start.elapsed() < Duration::from_secs(2), "--detach must return at once");
    let out = runner_ctd(&["wait", "indexed", "--timeout", "60s"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let logs = runner_ctd(&["logs", "indexed"], &state);
    let text = String::from_utf8_lossy(&logs.stdout);
    for i in 0..4 {
        assert!(text.contains(&format!("index={i}\n")), "{text}");
    }
    let got = json_of(&runner_ctd(&["get", "job", "indexed", "-o", "json"], &state));
    assert_eq!(got["status"]["phase"], "Succeeded");
    assert_eq!(got["status"]["succeeded"], 4);
    // Never more than 2 at a time: the third attempt started after one of the first two ended.
    let attempts = got["status"]["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 4);
    let list = runner_ctd(&["get", "jobs", "-l", "suite=jobs-test"], &state);
    let listing = String::from_utf8_lossy(&list.stdout);
    assert!(
        listing
            .lines()
            .any(|l| l.starts_with("indexed") && l.contains("Succeeded") && l.contains("4/4")),
        "{listing}"
    );
    let index2 = runner_ctd(&["logs", "indexed", "--index", "2"], &state);
    assert_eq!(String::from_utf8_lossy(&index2.stdout), "index=2\n");
}

/// Index 2 fails at once and fails the Job; indexes 0 and 1 take the SIGTERM the Job's end
/// sends without dying and exit 0 a moment later, within their grace: they succeeded (as
/// Kubernetes counts a pod that exits 0 while terminating), and the counts say so.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn attempts_that_exit_zero_while_the_job_fails_are_counted_as_succeeded() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    let file = write_manifest(
        dir.path(),
        "ix.yaml",
        &job(
            "indexed-fail",
            r#"["sh", "-c", "if [ $JOB_COMPLETION_INDEX = 2 ]; then exit 1; fi; trap '' TERM; sleep 1; exit 0"]"#,
            "  completions: 3\n  parallelism: 3\n  completionMode: Indexed\n",
        ),
    );
    let out = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], &state);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let got = json_of(&out);
    let status = &got["status"];
    assert_eq!(
        (status["succeeded"].as_u64(), status["failed"].as_u64()),
        (Some(2), Some(1)),
        "{status}"
    );
    for a in status["attempts"].as_array().unwrap() {
        let expected = if a["index"] == 2 {
            ("Failed", "Error", 1)
        } else {
            ("Succeeded", "Completed", 0)
        };
        assert_eq!(
            (
                a["phase"].as_str().unwrap(),
                a["reason"].as_str().unwrap(),
                a["exitCode"].as_i64().unwrap()
            ),
            (expected.0, expected.1, expected.2),
            "{a}"
        );
    }
    let list = runner_ctd(&["get", "jobs"], &state);
    let listing = String::from_utf8_lossy(&list.stdout);
    assert!(
        listing
            .lines()
            .any(|l| l.starts_with("indexed-fail") && l.contains("2/3")),
        "{listing}"
    );
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn the_active_deadline_ends_the_job_with_deadline_exceeded() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    let file = write_manifest(
        dir.path(),
        "dl.yaml",
        &job("deadline", r#"["sleep", "30"]"#, "  activeDeadlineSeconds: 2\n"),
    );
    let start = Instant::now();
    let out = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], &state);
    assert!(start.elapsed() < Duration::from_secs(10));
    assert_eq!(out.status.code(), Some(1));
    let got = json_of(&out);
    assert_eq!(got["status"]["reason"], "DeadlineExceeded");
    assert_eq!(got["status"]["conditions"][0]["type"], "Failed");
    assert_eq!(containers_of("deadline"), 0);
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn retries_follow_the_backoff_limit() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    let file = write_manifest(
        dir.path(),
        "bo.yaml",
        &job("backoff", r#"["sh", "-c", "exit 1"]"#, "  backoffLimit: 2\n"),
    );
    // Kubernetes' 10 s base delay, shortened for the test (the state machine tests pin the real one).
    let out = runner_ctd_command(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], &state)
        .env("RUNNER_BACKOFF_BASE", "300ms")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let got = json_of(&out);
    assert_eq!(got["status"]["failed"], 3);
    assert_eq!(got["status"]["reason"], "BackoffLimitExceeded");
    let attempts = got["status"]["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 3);
    assert!(attempts.iter().all(|a| a["exitCode"] == 1));
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn delete_stops_the_job_and_leaves_no_container() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    let file = write_manifest(
        dir.path(),
        "del.yaml",
        &job("doomed", r#"["sh", "-c", "sleep 990"]"#, ""),
    );
    let out = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "--detach"], &state);
    assert_eq!(out.status.code(), Some(0));
    assert!(eventually(Duration::from_secs(10), || !processes_matching("sleep 990").is_empty()));
    let out = runner_ctd(&["delete", "job", "doomed"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(processes_matching("sleep 990").is_empty());
    assert_eq!(containers_of("doomed"), 0);
    let out = runner_ctd(&["get", "job", "doomed"], &state);
    assert_eq!(out.status.code(), Some(2), "deleted jobs are gone");
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_job_whose_runner_is_killed_is_readopted_with_its_true_exit_code_and_output() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    let file = write_manifest(
        dir.path(),
        "adopt.yaml",
        &job(
            "adopted",
            r#"["sh", "-c", "echo before; sleep 4; cat; echo adopted; exit 4"]"#,
            "  stdin: \"kept across the runner's death\\n\"\n",
        ),
    );
    let mut apply = runner_ctd_command(&["apply", "-f", file.to_str().unwrap()], &state)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    apply.kill().unwrap(); // SIGKILL: no cleanup, no result recorded
    apply.wait().unwrap();
    let out = runner_ctd(&["wait", "adopted", "--timeout", "60s"], &state);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let got = json_of(&runner_ctd(&["get", "job", "adopted", "-o", "json"], &state));
    assert_eq!(got["status"]["result"]["exitCode"], 4, "{got}");
    assert_eq!(
        got["status"]["attempts"].as_array().unwrap().len(),
        1,
        "exactly one terminal result: {got}"
    );
    let logs = runner_ctd(&["logs", "adopted"], &state);
    assert_eq!(
        String::from_utf8_lossy(&logs.stdout),
        "before\nkept across the runner's death\nadopted\n"
    );
    assert_eq!(containers_of("adopted"), 0);
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn results_stay_correct_when_containerd_restarts_mid_job() {
    // A containerd of this test's own (the suite's shared one must not restart under others).
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let env = |cmd: &mut std::process::Command| {
        cmd.env("RUNNER_STATE_DIR", &state)
            .env("CONTAINERD_NAMESPACE", "runner-restart-test")
            .env_remove("CONTAINERD_ADDRESS");
    };
    let run = |args: &[&str]| {
        let mut cmd = std::process::Command::new(runner_bin());
        cmd.args(args);
        env(&mut cmd);
        cmd.output().unwrap()
    };
    assert_eq!(run(&["daemon", "start"]).status.code(), Some(0));
    // Stop this test's daemon (and what runs on it) even when an assertion fails.
    struct Stop<F: Fn()>(F);
    impl<F: Fn()> Drop for Stop<F> {
        fn drop(&mut self) {
            (self.0)();
        }
    }
    let _stop = Stop(|| {
        run(&["gc"]);
        run(&["daemon", "stop"]);
    });
    let socket = String::from_utf8_lossy(&run(&["daemon", "status"]).stdout)
        .trim()
        .rsplit(' ')
        .next()
        .unwrap()
        .to_string();
    let with_address = |args: &[&str]| {
        let mut full: Vec<&str> = args.to_vec();
        full.extend(["--address", socket.as_str()]);
        run(&full)
    };
    assert_eq!(
        with_address(&["image", "import", image_dir().join("busybox-oci.tar").to_str().unwrap()])
            .status
            .code(),
        Some(0)
    );
    let file = write_manifest(
        dir.path(),
        "restart.yaml",
        &job("survivor", r#"["sh", "-c", "sleep 3; echo done; exit 3"]"#, ""),
    );
    let out = with_address(&["apply", "-f", file.to_str().unwrap(), "--detach"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    std::thread::sleep(Duration::from_millis(1000));
    // Restart the daemon under the running job: the shim keeps the task.
    assert_eq!(run(&["daemon", "stop"]).status.code(), Some(0));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(run(&["daemon", "start"]).status.code(), Some(0));
    let out = with_address(&["wait", "survivor", "--timeout", "60s"]);
    let got = json_of(&with_address(&["get", "job", "survivor", "-o", "json"]));
    assert_eq!(out.status.code(), Some(1), "{got}");
    assert_eq!(got["status"]["result"]["exitCode"], 3, "{got}");
    assert_eq!(
        String::from_utf8_lossy(&with_address(&["logs", "survivor"]).stdout),
        "done\n"
    );
    run(&["gc", "--address", socket.as_str()]);
    run(&["daemon", "stop"]);
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn gc_removes_the_cgroups_runc_leaves_behind() {
    // A namespace of this test's own: the parent cgroup goes only when no container exists.
    let namespace = format!("runner-cgroup-test-{}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let run = |args: &[&str]| {
        runner_ctd_command(args, &state)
            .env("CONTAINERD_NAMESPACE", &namespace)
            .output()
            .unwrap()
    };
    let image = image_dir().join("busybox-oci.tar");
    assert_eq!(
        run(&["image", "import", image.to_str().unwrap()]).status.code(),
        Some(0)
    );
    let file = write_manifest(dir.path(), "job.yaml", &job("cg", r#"["true"]"#, ""));
    let out = run(&["apply", "-f", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let parents = || {
        ["memory", "pids", "cpu", "unified", ""]
            .iter()
            .map(|h| Path::new("/sys/fs/cgroup").join(h).join("runner").join(&namespace))
            .filter(|p| p.is_dir())
            .collect::<Vec<_>>()
    };
    assert!(
        !parents().is_empty(),
        "runc left no parent cgroup: the test proves nothing"
    );
    let out = run(&["gc"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        said.starts_with("removed 0 containers") && !said.contains(" 0 cgroups"),
        "{said}"
    );
    assert_eq!(parents(), Vec::<std::path::PathBuf>::new());
    assert_eq!(run(&["image", "rm", "local/busybox:1.35"]).status.code(), Some(0));
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn logs_follow_streams_output_while_the_attempt_runs() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    let file = write_manifest(
        dir.path(),
        "follow.yaml",
        &job(
            "follow",
            r#"["sh", "-c", "echo first; echo err-first >&2; sleep 3; echo second"]"#,
            "",
        ),
    );
    let out = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "--detach"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let mut child = runner_ctd_command(&["logs", "-f", "follow"], &state)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
    assert_eq!(line, "first\n");
    // The first line came while the job still runs (it sleeps 3 s before its last line).
    let got = json_of(&runner_ctd(&["get", "job", "follow", "-o", "json"], &state));
    assert_eq!(got["status"]["phase"], "Running", "{got}");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    assert_eq!(rest, "second\n");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(err, "err-first\n");
    assert_eq!(child.wait().unwrap().code(), Some(0));
    // Without -f the stored output, the same bytes.
    let out = runner_ctd(&["logs", "follow"], &state);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "first\nsecond\n");
    let out = runner_ctd(&["delete", "job", "follow"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!state.join("logs").join("follow").exists());
}

/// `logs -f --prefix --tail N` on a running Indexed Job: from each index's last lines on, every
/// line whole with its index before it, though the indexes write halves of lines at once.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn logs_follow_with_prefix_never_mixes_indexes_inside_a_line() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    let file = write_manifest(
        dir.path(),
        "mixed.yaml",
        &job(
            "mixed",
            r#"["sh", "-c", "echo start$JOB_COMPLETION_INDEX; echo second$JOB_COMPLETION_INDEX; sleep 2; printf half$JOB_COMPLETION_INDEX; sleep 1; echo -done$JOB_COMPLETION_INDEX"]"#,
            "  completions: 2\n  parallelism: 2\n  completionMode: Indexed\n",
        ),
    );
    let out = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "--detach"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    // Both indexes wrote their first two lines.
    let live =
        |i: u32| std::fs::read_to_string(state.join(format!("logs/mixed/{i}-0.live.stdout"))).unwrap_or_default();
    let start = std::time::Instant::now();
    while !(live(0).contains("second0") && live(1).contains("second1")) {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(60),
            "no output: {:?} {:?}",
            live(0),
            live(1)
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = runner_ctd(&["logs", "-f", "--prefix", "--tail", "1", "mixed"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let lines: Vec<&str> = text.lines().collect();
    for i in 0..2 {
        let own: Vec<&str> = lines
            .iter()
            .copied()
            .filter(|l| l.starts_with(&format!("[{i}] ")))
            .collect();
        assert_eq!(
            own,
            [format!("[{i}] second{i}"), format!("[{i}] half{i}-done{i}")],
            "{text}"
        );
    }
    assert_eq!(lines.len(), 4, "{text}");
}

/// stdin through `runner apply` in the foreground: the command reads it, then EOF; setup reads
/// /dev/null; a job without stdin sees EOF at once.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn stdin_reaches_a_foreground_job_after_setup_and_absent_stdin_is_eof() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    let manifest = "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: bb-setup}\nspec:\n  image: local/busybox:1.35\n  setup:\n    commands: [\"cat; echo setup-done\"]\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: fg-stdin}\nspec:\n  environment: bb-setup\n  command: \"cat; echo done\"\n  stdin: \"line one\\nline two\\n\"\n  timeoutSeconds: 20\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: fg-no-stdin}\nspec:\n  environment: bb\n  command: \"cat; echo eof\"\n  timeoutSeconds: 20\n";
    let file = write_manifest(dir.path(), "fg.yaml", &format!("{ENV}---\n{manifest}"));
    let out = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let list = json_of(&out);
    let items = list["items"].as_array().unwrap();
    let with = &items[0]["status"]["result"];
    assert_eq!(with["stdout"], "line one\nline two\ndone\n", "{with}");
    assert_eq!(with["setup"]["stdout"], "setup-done\n", "setup reads /dev/null: {with}");
    let without = &items[1]["status"]["result"];
    assert_eq!(without["stdout"], "eof\n", "{without}");
    assert_eq!(without["timedOut"], false);
    assert!(without["durationMs"].as_u64().unwrap() < 10_000, "{without}");
    // The default (human) output path prints the same stdout.
    let human = runner_ctd(&["apply", "--replace", "-f", file.to_str().unwrap()], &state);
    assert_eq!(human.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&human.stdout),
        "line one\nline two\ndone\neof\n"
    );
}

/// stdin through `apply --detach` (the supervisor process), for every index of an Indexed Job
/// whose indexes run in parallel.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn stdin_reaches_every_index_of_a_detached_parallel_job() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    let file = write_manifest(
        dir.path(),
        "par.yaml",
        &job(
            "par-stdin",
            r#"["sh", "-c", "echo index=$JOB_COMPLETION_INDEX; cat"]"#,
            "  stdin: \"shared input\\n\"\n  completions: 3\n  parallelism: 3\n  completionMode: Indexed\n  timeoutSeconds: 20\n",
        ),
    );
    let out = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "--detach"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let out = runner_ctd(&["wait", "par-stdin", "--timeout", "60s"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    for i in 0..3 {
        let logs = runner_ctd(&["logs", "par-stdin", "--index", &i.to_string()], &state);
        assert_eq!(
            String::from_utf8_lossy(&logs.stdout),
            format!("index={i}\nshared input\n")
        );
    }
    assert_eq!(containers_of("par-stdin"), 0);
}

// ---- warm pools

const POOL_ENV: &str = r#"apiVersion: runner/v1alpha1
kind: Environment
metadata: {name: pooled}
spec:
  image: local/busybox:1.35
  workdir: /workspace
  user: "1000:1000"
  env: {GREETING: "hello world", TZ: UTC}
  setup:
    commands: ["echo setting up; ls /workspace"]
  resources: {memory: 32Mi, pids: 64}
"#;

/// The cases a pooled run must answer exactly as a cold one: identity, environment, mounts,
/// stdin, setup split, a read-only asset, timeouts with and without a SIGTERM handler, OOM,
/// and a job that leaves processes and files behind for the next one.
const POOL_CASES: &[(&str, &str, &str)] = &[
    (
        "look",
        r#"["sh", "-c", "id; hostname; pwd; env | sort; ls /static/data; cat /static/data/f.txt; cat; echo written > out.txt; echo err >&2; exit 7"]"#,
        "  stdin: \"from stdin\\n\"\n",
    ),
    (
        "ro-asset",
        r#"["sh", "-c", "echo x > /static/data/f.txt; echo rc=$?; touch /static/new; echo rc=$?"]"#,
        "",
    ),
    ("sleepy", r#"["sleep", "30"]"#, "  timeoutSeconds: 1\n"),
    (
        "trapper",
        r#"["sh", "-c", "trap 'echo got TERM; exit 3' TERM; sleep 30 & wait"]"#,
        "  timeoutSeconds: 1\n",
    ),
    ("bomb", r#"["sh", "-c", "x=aaaaaaaa; while :; do x=$x$x; done"]"#, ""),
    (
        "litter",
        r#"["sh", "-c", "echo left > /tmp/litter; sleep 1000 & echo started"]"#,
        "",
    ),
    (
        "after-litter",
        r#"["sh", "-c", "test -e /tmp/litter && echo leftover || echo clean; ps | grep -v grep | grep -c 'sleep 1000'"]"#,
        "",
    ),
];

/// Write the pool test's manifest (a workspace per job, writable by uid 1000, and assets).
fn pool_manifest(dir: &Path) -> std::path::PathBuf {
    let assets = dir.join("assets");
    std::fs::create_dir_all(&assets).unwrap();
    std::fs::write(assets.join("f.txt"), "asset\n").unwrap();
    let mut text = POOL_ENV.to_string();
    for (name, command, extra) in POOL_CASES {
        let ws = dir.join(format!("ws-{name}"));
        std::fs::create_dir_all(&ws).unwrap();
        std::fs::write(ws.join("input.txt"), "in\n").unwrap();
        std::fs::set_permissions(&ws, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
        text.push_str(&format!(
            "---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {name}}}\nspec:\n  environment: pooled\n  workspace: ./ws-{name}\n  staticAssets:\n    - {{source: ./assets, savePath: data}}\n  command: {command}\n  terminationGracePeriodSeconds: 1\n{extra}"
        ));
    }
    write_manifest(dir, "pool.yaml", &text)
}

/// Per job: what must be identical between a cold and a pooled run, and whether a pool ran it.
fn pool_results(out: &std::process::Output) -> Vec<(String, serde_json::Value, bool)> {
    let all = json_of(out);
    all["items"]
        .as_array()
        .unwrap_or_else(|| panic!("{all}"))
        .iter()
        .map(|o| {
            let r = &o["status"]["result"];
            let kept = serde_json::json!({
                "phase": o["status"]["phase"],
                "reason": o["status"]["reason"],
                "exitCode": r["exitCode"],
                "signal": r["signal"],
                "timedOut": r["timedOut"],
                "oomKilled": r["oomKilled"],
                "stdout": r["stdout"],
                "stderr": r["stderr"],
                "setup": [r["setup"]["exitCode"], r["setup"]["stdout"], r["setup"]["stderr"]],
            });
            (
                o["metadata"]["name"].as_str().unwrap().to_string(),
                kept,
                r["pool"].is_string(),
            )
        })
        .collect()
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn pooled_and_cold_runs_give_the_same_results() {
    let cold_dir = tempfile::tempdir().unwrap();
    let pool_dir = tempfile::tempdir().unwrap();
    let (cold_state, pool_state) = (cold_dir.path().join("state"), pool_dir.path().join("state"));
    import_busybox(&cold_state);
    let cold_file = pool_manifest(cold_dir.path());
    let pool_file = pool_manifest(pool_dir.path());
    let out = runner_ctd(
        &[
            "pool",
            "create",
            "pooled",
            "-f",
            pool_file.to_str().unwrap(),
            "--size",
            &POOL_CASES.len().to_string(),
            "--workspace",
            "--static-assets",
            "--name",
            "cases",
        ],
        &pool_state,
    );
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let _rm = RemovePool(pool_state.clone(), "cases");
    // Cold and pooled side by side (different state dirs: the cold one has no pool).
    let cold =
        runner_ctd_command(&["apply", "-f", cold_file.to_str().unwrap(), "-o", "json"], &cold_state).spawn_output();
    let pooled = runner_ctd(&["apply", "-f", pool_file.to_str().unwrap(), "-o", "json"], &pool_state);
    let cold = cold.join().unwrap();
    let (cold, pooled) = (pool_results(&cold), pool_results(&pooled));
    assert_eq!(cold.len(), POOL_CASES.len());
    for ((name, c, c_pooled), (_, p, p_pooled)) in cold.iter().zip(&pooled) {
        assert!(!c_pooled, "{name} ran pooled without a pool");
        assert!(p_pooled, "{name} did not run in a pool member");
        assert_eq!(c, p, "{name}: cold and pooled differ");
    }
    let by_name = |n: &str| &cold.iter().find(|(name, ..)| name == n).unwrap().1;
    // The cases prove what they are meant to (and not only that both runs agree).
    let look = by_name("look");
    assert_eq!(look["exitCode"], 7);
    let stdout = look["stdout"].as_str().unwrap();
    for line in [
        "uid=1000(user) gid=1000(user)",
        "\nlook\n/workspace\n",
        "GREETING=hello world\n",
        "asset\nfrom stdin\n",
    ] {
        assert!(stdout.contains(line), "{line:?} in {stdout}");
    }
    // The entry shell's own exports (setup runs), but none of the agent's `cd`.
    assert!(!stdout.contains("OLDPWD="), "{stdout}");
    assert_eq!(look["setup"][1], "setting up\ninput.txt\n");
    for dir in [cold_dir.path(), pool_dir.path()] {
        assert_eq!(
            std::fs::read_to_string(dir.join("ws-look/out.txt")).unwrap(),
            "written\n"
        );
    }
    assert!(
        by_name("ro-asset")["stderr"]
            .as_str()
            .unwrap()
            .contains("Read-only file system")
    );
    assert_eq!(by_name("ro-asset")["stdout"], "rc=1\nrc=1\n");
    assert_eq!(
        (&by_name("sleepy")["timedOut"], &by_name("sleepy")["signal"]),
        (&true.into(), &9.into())
    );
    assert_eq!(by_name("trapper")["exitCode"], 3);
    assert_eq!(by_name("bomb")["oomKilled"], true);
    assert_eq!(by_name("after-litter")["stdout"], "clean\n0\n");
    // Every member served one job and is gone; the pool was refilled; rm removes the rest.
    // (A used member is removed by the pool's filler, off the job's path.)
    for (name, ..) in &pooled {
        assert!(
            eventually(Duration::from_secs(60), || containers_of(name) == 0),
            "{name}'s member is still there"
        );
    }
    let ls = || json_of(&runner_ctd(&["pool", "ls", "-o", "json"], &pool_state));
    assert!(
        eventually(Duration::from_secs(60), || ls()[0]["ready"] == POOL_CASES.len()),
        "{}",
        ls()
    );
    assert_eq!(pool_members(&pool_state, "cases"), POOL_CASES.len());
    let out = runner_ctd(&["pool", "rm", "cases"], &pool_state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(ls(), serde_json::json!([]));
    assert_eq!(pool_members(&pool_state, "cases"), 0);
}

/// Removes a test's pool even when an assertion failed (members outlive every runner).
struct RemovePool(std::path::PathBuf, &'static str);

impl Drop for RemovePool {
    fn drop(&mut self) {
        if self.0.join("pools").join(format!("{}.json", self.1)).exists() {
            runner_ctd(&["pool", "rm", self.1], &self.0);
        }
    }
}

/// Containers of the test namespace that are members of pool `pool` of a state dir.
fn pool_members(state: &Path, pool: &str) -> usize {
    let (address, namespace) = containerd_env();
    let state = std::fs::canonicalize(state).unwrap();
    let out = std::process::Command::new("ctr")
        .args(["--address", address.to_str().unwrap(), "--namespace", &namespace])
        .args(["containers", "ls", "-q"])
        .arg(format!(
            "labels.\"runner.dev/pool\"=={pool},labels.\"runner.dev/state-dir\"==\"{}\"",
            state.display()
        ))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().count()
}

trait SpawnOutput {
    fn spawn_output(&mut self) -> std::thread::JoinHandle<std::process::Output>;
}

impl SpawnOutput for std::process::Command {
    /// Run in the background; join for its output.
    fn spawn_output(&mut self) -> std::thread::JoinHandle<std::process::Output> {
        let child = self
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::spawn(move || child.wait_with_output().unwrap())
    }
}

/// `kind: WarmPool` in a manifest: `validate` counts and checks it (size limit with its line
/// and column, a host Environment refused), `apply` makes the pool before the file's jobs run,
/// so they claim its members; `export` refuses it by name.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_warm_pool_in_a_manifest_is_made_before_its_jobs_run() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    let text = "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: wp-env}\nspec:\n  image: local/busybox:1.35\n  env: {WHO: pooled}\n---\napiVersion: runner/v1alpha1\nkind: WarmPool\nmetadata: {name: wp}\nspec:\n  environment: wp-env\n  size: 2\n  workspace: false\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: wp-job}\nspec:\n  environment: wp-env\n  command: [\"sh\", \"-c\", \"echo $WHO on $(hostname)\"]\n";
    let file = write_manifest(dir.path(), "wp.yaml", text);
    let f = file.to_str().unwrap();
    let out = runner_ctd(&["validate", "-f", f], &state);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("(1 environment, 1 job, 1 warm pool)"),
        "{out:?}"
    );
    let _rm = RemovePool(state.clone(), "wp");
    let out = runner_ctd(&["apply", "-f", f, "-o", "json"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("warmpool.runner/wp ready: 2 members"));
    let got = json_of(&out);
    assert_eq!(got["status"]["result"]["stdout"], "pooled on wp-job\n");
    assert_eq!(got["status"]["result"]["pool"], "wp");
    let big = write_manifest(dir.path(), "big.yaml", &text.replace("size: 2", "size: 900"));
    let out = runner_ctd(&["validate", "-f", big.to_str().unwrap()], &state);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("big.yaml:13:9: WarmPool \"wp\": spec.size: a pool of 900 members is above the limit of 256"),
        "{err}"
    );
    let host = write_manifest(
        dir.path(),
        "host.yaml",
        &text.replace("  image: local/busybox:1.35\n", "  backend: host\n"),
    );
    let out = runner_ctd(&["validate", "-f", host.to_str().unwrap()], &state);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("only containerd Environments have warm pools"),
        "{out:?}"
    );
    // A mount under another would be hidden by the other's late mount: no pool.
    let cache = dir.path().join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    let nested = write_manifest(
        dir.path(),
        "nested.yaml",
        &format!(
            "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: nested}}\nspec:\n  image: local/busybox:1.35\n  mounts: [{{source: {0}, target: /opt}}, {{source: {0}, target: /opt/inner, readOnly: true}}]\n",
            cache.display()
        ),
    );
    let out = runner_ctd(
        &[
            "pool",
            "create",
            "nested",
            "-f",
            nested.to_str().unwrap(),
            "--workspace",
        ],
        &state,
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot have a warm pool: /opt/inner lies under /opt"),
        "{out:?}"
    );
    let out = runner_ctd(&["export", "-f", f], &state);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("WarmPool \"wp\" is runner's own and is not exported"));
    assert!(String::from_utf8_lossy(&out.stdout).contains("kind: Job\n"));
}

/// Pools outlive the runner that made them and a containerd restart; `gc` keeps their ready
/// members; a member whose init died is seen as broken, never claimed (the job runs cold, with
/// the same result), and the next fill replaces it.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn pools_survive_a_containerd_restart_and_broken_members_are_replaced() {
    // A containerd of this test's own (the suite's shared one must not restart under others).
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let run = |args: &[&str]| {
        std::process::Command::new(runner_bin())
            .args(args)
            .env("RUNNER_STATE_DIR", &state)
            .env("CONTAINERD_NAMESPACE", "runner-pool-restart-test")
            .env_remove("CONTAINERD_ADDRESS")
            .output()
            .unwrap()
    };
    assert_eq!(run(&["daemon", "start"]).status.code(), Some(0));
    struct Stop<F: Fn()>(F);
    impl<F: Fn()> Drop for Stop<F> {
        fn drop(&mut self) {
            (self.0)();
        }
    }
    let _stop = Stop(|| {
        run(&["pool", "rm", "bb"]);
        run(&["gc"]);
        run(&["daemon", "stop"]);
    });
    let socket = String::from_utf8_lossy(&run(&["daemon", "status"]).stdout)
        .trim()
        .rsplit(' ')
        .next()
        .unwrap()
        .to_string();
    let image = image_dir().join("busybox-oci.tar");
    assert_eq!(
        run(&["image", "import", image.to_str().unwrap()]).status.code(),
        Some(0)
    );
    let file = write_manifest(
        dir.path(),
        "job.yaml",
        &job("after-restart", r#"["sh", "-c", "echo ok"]"#, ""),
    );
    let f = file.to_str().unwrap();
    let out = run(&["pool", "create", "bb", "-f", f, "--size", "2"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let ls = || json_of(&run(&["pool", "ls", "-o", "json"]))[0].clone();
    // `get pools` is `pool ls` with kubectl's verbs: a table, one by name, -o name.
    let text = |out: std::process::Output| String::from_utf8_lossy(&out.stdout).to_string();
    let table = text(run(&["get", "pools"]));
    assert!(
        table.starts_with("NAME ") && table.lines().nth(1).unwrap().starts_with("bb "),
        "{table}"
    );
    assert_eq!(text(run(&["get", "pool", "bb", "-o", "name"])), "warmpool.runner/bb\n");
    assert_eq!(run(&["get", "pool", "none"]).status.code(), Some(2));
    assert_eq!(run(&["gc"]).status.code(), Some(0));
    assert_eq!((ls()["ready"].as_u64(), ls()["broken"].as_u64()), (Some(2), Some(0)));
    assert_eq!(run(&["daemon", "stop"]).status.code(), Some(0));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(run(&["daemon", "start"]).status.code(), Some(0));
    assert_eq!((ls()["ready"].as_u64(), ls()["broken"].as_u64()), (Some(2), Some(0)));
    let result = |out: &std::process::Output| json_of(out)["status"]["result"].clone();
    let pooled = result(&run(&["apply", "-f", f, "-o", "json"]));
    assert_eq!((&pooled["stdout"], &pooled["pool"]), (&"ok\n".into(), &"bb".into()));
    // Break every member (their inits die), as a host reboot or an OOM of the agent would.
    assert!(eventually(Duration::from_secs(60), || ls()["ready"] == 2), "{}", ls());
    let ctr = |args: &[&str]| {
        std::process::Command::new("ctr")
            .args(["--address", &socket, "--namespace", "runner-pool-restart-test"])
            .args(args)
            .output()
            .unwrap()
    };
    let members =
        String::from_utf8_lossy(&ctr(&["containers", "ls", "-q", "labels.\"runner.dev/pool\"==bb"]).stdout).to_string();
    for id in members.lines() {
        ctr(&["tasks", "kill", "-s", "SIGKILL", id]);
    }
    assert!(eventually(Duration::from_secs(10), || ls()["broken"] == 2), "{}", ls());
    let cold = result(&run(&["apply", "--replace", "-f", f, "-o", "json"]));
    assert_eq!(cold["stdout"], "ok\n");
    assert!(cold.get("pool").is_none(), "a broken member was claimed: {cold}");
    let out = run(&["pool", "fill", "bb"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("2 ready"), "{out:?}");
    assert_eq!((ls()["ready"].as_u64(), ls()["broken"].as_u64()), (Some(2), Some(0)));
}

/// The seccomp filter admits only the host's native syscall ABI unless the Environment asks:
/// a 64-bit program that makes one 32-bit system call (`int $0x80`) is killed with SIGSYS
/// and the Job says why; with `allow32BitSyscalls: true` the same call works.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn the_32bit_syscall_abi_is_refused_unless_the_environment_allows_it() {
    assert_eq!(std::env::consts::ARCH, "x86_64", "the probe is x86_64 assembly");
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    let ws = dir.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    // getpid through the 32-bit ABI, then exit through the native one: 0 when the call worked.
    let source = ws.join("probe.c");
    std::fs::write(
        &source,
        "void _start(void) {\n  long pid;\n  __asm__ volatile (\"int $0x80\" : \"=a\"(pid) : \"a\"(20L) : \"memory\");\n  __asm__ volatile (\"syscall\" :: \"a\"(60L), \"D\"(pid > 0 ? 0L : 3L) : \"rcx\", \"r11\", \"memory\");\n  __builtin_unreachable();\n}\n",
    )
    .unwrap();
    let built = std::process::Command::new("gcc")
        .args(["-nostdlib", "-static", "-fno-stack-protector", "-O2", "-o"])
        .arg(ws.join("probe"))
        .arg(&source)
        .output()
        .expect("gcc (scripts/deps.sh installs it)");
    assert!(built.status.success(), "{}", String::from_utf8_lossy(&built.stderr));
    for (name, extra) in [("abi-native", ""), ("abi-compat", "  allow32BitSyscalls: true\n")] {
        let manifest = format!(
            "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: {name}}}\nspec:\n  image: local/busybox:1.35\n{extra}---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {name}}}\nspec:\n  environment: {name}\n  workspace: ./ws\n  command: [\"/workspace/probe\"]\n  timeoutSeconds: 20\n"
        );
        let file = write_manifest(dir.path(), &format!("{name}.yaml"), &manifest);
        let out = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], &state);
        let job = json_of(&out);
        if extra.is_empty() {
            assert_eq!(out.status.code(), Some(1), "{job}");
            assert_eq!(job["status"]["reason"], "Error", "{job}");
            assert_eq!(job["status"]["result"]["exitCode"], 159, "killed by SIGSYS: {job}");
            let message = job["status"]["message"].as_str().unwrap_or_default();
            assert!(message.contains("allow32BitSyscalls"), "{job}");
        } else {
            assert_eq!(out.status.code(), Some(0), "{job}");
            assert_eq!(job["status"]["result"]["exitCode"], 0, "{job}");
        }
    }
}

/// Whether a pool served a job is said: `pool=NAME`, or `cold (why)` naming the pool and what it
/// serves instead (here: a job with mounts of its own, which no member has a place for), in
/// apply's status line, `describe` and the events; a job with a workspace claims from the same
/// pool as one without. Making the pool again from a changed Environment removes its members
/// of the old shape as outdated, not as broken.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn whether_a_pool_served_a_job_is_said_and_why_not() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    let envs = write_manifest(dir.path(), "env.yaml", ENV);
    let _rm = RemovePool(state.clone(), "bb");
    let made = runner_ctd(
        &["pool", "create", "bb", "-f", envs.to_str().unwrap(), "--size", "2"],
        &state,
    );
    assert_eq!(made.status.code(), Some(0), "{}", String::from_utf8_lossy(&made.stderr));
    std::fs::create_dir_all(dir.path().join("ws")).unwrap();
    let with_mount = write_manifest(
        dir.path(),
        "mounted.yaml",
        &job(
            "with-mount",
            r#"["true"]"#,
            &format!(
                "  mounts: [{{source: {}, target: /data}}]\n",
                dir.path().join("ws").display()
            ),
        ),
    );
    let out = runner_ctd(&["apply", "-f", with_mount.to_str().unwrap()], &state);
    let line = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{line}");
    assert!(
        line.contains("cold (pool bb serves jobs without mounts of their own"),
        "{line}"
    );
    let described =
        String::from_utf8_lossy(&runner_ctd(&["describe", "job", "with-mount"], &state).stdout).into_owned();
    assert!(
        described.contains("Pool: none, cold (pool bb serves jobs without mounts of their own"),
        "{described}"
    );
    assert!(described.contains("ColdStart"), "{described}");
    for (name, extra) in [
        ("plain", String::new()),
        ("with-ws", format!("  workspace: {}\n", dir.path().join("ws").display())),
    ] {
        let file = write_manifest(dir.path(), &format!("{name}.yaml"), &job(name, r#"["true"]"#, &extra));
        let out = runner_ctd(&["apply", "-f", file.to_str().unwrap()], &state);
        let line = String::from_utf8_lossy(&out.stderr);
        assert!(line.contains("pool=bb"), "{name}: {line}");
        let described = String::from_utf8_lossy(&runner_ctd(&["describe", "job", name], &state).stdout).into_owned();
        assert!(
            described.contains("Pool: bb") && described.contains("Pooled"),
            "{described}"
        );
    }
    // The pool made again from a changed Environment, once the claims' refills are done (two
    // claims: a filler may be queued behind the one that refilled, and it would be the one to
    // find the old members outdated): its members of the old shape are outdated, not broken.
    let ls = || json_of(&runner_ctd(&["pool", "ls", "-o", "json"], &state));
    assert!(
        eventually(Duration::from_secs(60), || ls()[0]["ready"] == 2
            && fillers(&state, "bb").is_empty()),
        "{}",
        ls()
    );
    let changed = write_manifest(
        dir.path(),
        "changed.yaml",
        &format!("{ENV}  resources: {{memory: 48Mi}}\n"),
    );
    let again = runner_ctd(
        &["pool", "create", "bb", "-f", changed.to_str().unwrap(), "--size", "1"],
        &state,
    );
    let said = String::from_utf8_lossy(&again.stdout);
    assert_eq!(
        again.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert!(
        said.contains("removed 2 outdated") && !said.contains("broken"),
        "{said}"
    );
}

/// An OOM kill names the limit it reached, in the status and in apply's status line (issue
/// 37, item 8: it said only "exit code 137").
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn an_oom_kill_names_the_memory_limit() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    let manifest = "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: small}\nspec:\n  image: local/busybox:1.35\n  resources: {memory: 32Mi}\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: greedy}\nspec:\n  environment: small\n  command: \"head -c 200000000 /dev/zero | tail\"\n";
    let file = write_manifest(dir.path(), "oom.yaml", manifest);
    let out = runner_ctd(&["apply", "-f", file.to_str().unwrap()], &state);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("job/greedy Failed (OOMKilled) exit=137")
            && stderr.contains(": killed: memory limit 32Mi reached (exit code 137)"),
        "{stderr}"
    );
    let got = json_of(&runner_ctd(&["get", "job", "greedy", "-o", "json"], &state));
    assert_eq!(
        got["status"]["message"],
        "killed: memory limit 32Mi reached (exit code 137); raise resources.memory of its Environment"
    );
}

/// The `runner pool fill` processes of a pool of a state dir: their niceness.
fn fillers(state: &Path, pool: &str) -> Vec<i64> {
    pool_fillers(state, pool)
        .into_iter()
        .filter_map(|pid| stat_field(pid, 16))
        .collect()
}

/// A burst of claims starts one filler while one waits for the pool's fill lock (the others
/// see it queued and start none), at a lower priority than jobs; it makes up for every claim.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_burst_of_claims_queues_one_filler() {
    use std::os::fd::AsRawFd;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    let text = "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: burst}\nspec:\n  image: local/busybox:1.35\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: burst-job}\nspec:\n  environment: burst\n  command: [\"true\"]\n";
    let file = write_manifest(dir.path(), "burst.yaml", text);
    let f = file.to_str().unwrap();
    let out = runner_ctd(&["pool", "create", "burst", "-f", f, "--size", "4"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let _rm = RemovePool(state.clone(), "burst");
    // Hold the fill lock as a filling filler would: the first claim's filler queues behind it.
    let lock = std::fs::File::open(state.join("pools").join("burst.lock")).unwrap();
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    for i in 0..4 {
        let out = runner_ctd(&["apply", "--replace", "-f", f, "-o", "json"], &state);
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(json_of(&out)["status"]["result"]["pool"], "burst", "apply {i}");
    }
    let queued = fillers(&state, "burst");
    assert_eq!(queued.len(), 1, "fillers while the fill lock is held: {queued:?}");
    assert_eq!(queued[0], 10, "the filler's niceness");
    drop(lock);
    let ls = || json_of(&runner_ctd(&["pool", "ls", "-o", "json"], &state));
    assert!(
        eventually(Duration::from_secs(60), || ls()[0]["ready"] == 4
            && fillers(&state, "burst").is_empty()),
        "the pool was not refilled: {}",
        ls()
    );
    // Claims read the ready index, an entry per ready member; what `pool rm` tears down
    // leaves entries that `gc` prunes.
    let indexed = |state: &Path| -> usize {
        std::fs::read_dir(state.join("ready"))
            .map(|keys| {
                keys.flatten()
                    .map(|k| std::fs::read_dir(k.path()).unwrap().count())
                    .sum()
            })
            .unwrap_or(0)
    };
    assert_eq!(indexed(&state), 4);
    let out = runner_ctd(&["pool", "rm", "burst"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let out = runner_ctd(&["gc"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(indexed(&state), 0);
}
