//! A foreground `runner apply` handed to the `runner serve` of its state dir
//! (`service::handoff`), against the private containerd of scripts/test.sh: it prints, exits
//! and records as an apply run in the CLI's own process does (relative paths, stdin, several
//! jobs, errors, Ctrl-C, a CLI killed, the server stopping), and what the server cannot run as
//! the CLI would runs in the CLI.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

const IMAGE: &str = "local/busybox:1.35";
/// What the CLI logs (at debug) when the server took its apply.
const TAKEN: &str = "the server took the apply";
const DECLINED: &str = "the server declined the apply";
/// ... when the server found the apply wrong (the CLI prints the server's error).
const REFUSED: &str = "the server refused the apply";

struct Setup {
    dir: tempfile::TempDir,
    state: PathBuf,
    served: Option<Served>,
}

impl Setup {
    /// A state dir with the busybox image and a `runner serve` of it.
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        import_busybox(&state);
        let served = serve(&state, dir.path());
        Setup {
            dir,
            state,
            served: Some(served),
        }
    }

    /// `runner apply ARGS` from `cwd`, logging whether the server took it.
    fn apply_command(&self, cwd: &Path, args: &[&str]) -> Command {
        let mut all = vec!["apply", "--log", "warn,runner::cli::handoff=debug"];
        all.extend_from_slice(args);
        let mut cmd = runner_ctd_command(&all, &self.state);
        cmd.current_dir(cwd);
        cmd
    }

    fn apply(&self, cwd: &Path, args: &[&str]) -> Output {
        self.apply_command(cwd, args).output().unwrap()
    }

    fn server_pid(&self) -> i32 {
        self.served.as_ref().unwrap().child.id() as i32
    }
}

/// A `runner serve` of `state` (its token in `dir`), once its hand-off socket is there.
fn serve(state: &Path, dir: &Path) -> Served {
    let served = serve_with(runner_ctd_command(&[], state), dir);
    assert!(
        eventually(Duration::from_secs(10), || state.join("serve.sock").exists()),
        "the server made no hand-off socket"
    );
    served
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The stderr of an apply without its timings and the hand-off's own log lines, to compare a
/// handed apply with one run in the CLI.
fn comparable(stderr: &[u8]) -> String {
    text(stderr)
        .lines()
        .filter(|l| !l.contains("runner::cli::handoff"))
        .map(|l| {
            // `job/NAME Phase (Reason) exit=N 123ms cold (...)`: the figures differ per run.
            match l.find(" exit=") {
                Some(at) if l.starts_with("job/") => {
                    let code: String = l[at..].split_whitespace().next().unwrap_or("").into();
                    format!("{}{code}", &l[..at])
                }
                _ => l.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn two_jobs(prefix: &str) -> String {
    format!(
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: bb}}\nspec:\n  image: {IMAGE}\n  workdir: /workspace\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {prefix}-first}}\nspec:\n  environment: bb\n  workspace: ./ws\n  stdin: \"from stdin\\n\"\n  command: [\"sh\", \"-c\", \"cat; cat /workspace/data; echo to stderr >&2; exit 3\"]\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {prefix}-second}}\nspec:\n  environment: bb\n  completions: 2\n  completionMode: Indexed\n  command: [\"sh\", \"-c\", \"echo index $JOB_COMPLETION_INDEX\"]\n"
    )
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_handed_apply_prints_exits_and_records_as_one_run_in_the_cli() {
    let s = Setup::new();
    // The manifest is in a subdirectory and named relative to the working directory: its
    // relative workspace resolves against the file's directory, not the server's.
    let sub = s.dir.path().join("sub");
    std::fs::create_dir_all(sub.join("ws")).unwrap();
    std::fs::write(sub.join("ws/data"), "from the workspace\n").unwrap();
    write_manifest(&sub, "jobs.yaml", &two_jobs("ho"));

    let handed = s.apply(s.dir.path(), &["-f", "sub/jobs.yaml"]);
    let handed_err = text(&handed.stderr);
    assert!(handed_err.contains(TAKEN), "{handed_err}");
    assert_eq!(handed.status.code(), Some(1), "{handed_err}");
    let out = text(&handed.stdout);
    assert!(
        out.contains("from stdin\nfrom the workspace\n"),
        "stdin and the workspace: {out}"
    );
    assert!(out.contains("[0] index 0") && out.contains("[1] index 1"), "{out}");
    assert!(handed_err.contains("to stderr"), "{handed_err}");
    assert!(
        handed_err.contains("job/ho-first Failed (Error) exit=3"),
        "{handed_err}"
    );
    assert!(
        handed_err.contains("job/ho-second Succeeded (Completed) exit=0"),
        "{handed_err}"
    );

    // The same file run in the CLI's own process: the same output, results and exit code.
    let local = s.apply(s.dir.path(), &["--local", "--replace", "-f", "sub/jobs.yaml"]);
    assert!(!text(&local.stderr).contains(TAKEN), "{}", text(&local.stderr));
    assert_eq!(local.status.code(), handed.status.code());
    assert_eq!(text(&local.stdout), out);
    assert_eq!(comparable(&local.stderr), comparable(&handed.stderr));

    // -o json, handed: the objects as an apply prints them; the store has the same.
    let json = s.apply(s.dir.path(), &["--replace", "-o", "json", "-f", "sub/jobs.yaml"]);
    assert!(text(&json.stderr).contains(TAKEN), "{}", text(&json.stderr));
    // Several jobs print as a kubectl List.
    let list = json_of(&json);
    assert_eq!(list["kind"], "List", "{list}");
    let printed = list["items"].as_array().cloned().unwrap_or_default();
    assert_eq!(printed.len(), 2, "{list}");
    let first = &printed[0];
    assert_eq!(first["status"]["result"]["exitCode"], 3, "{first}");
    assert_eq!(
        first["status"]["result"]["stdout"], "from stdin\nfrom the workspace\n",
        "{first}"
    );
    assert_eq!(
        first["spec"]["workspace"].as_str().map(PathBuf::from),
        Some(sub.join("ws").canonicalize().unwrap()),
        "{first}"
    );
    let stored = json_of(&runner_ctd(&["get", "job", "ho-first", "-o", "json"], &s.state));
    assert_eq!(stored["status"], first["status"], "{stored}");

    // -o name.
    let names = s.apply(s.dir.path(), &["--replace", "-o", "name", "-f", "sub/jobs.yaml"]);
    assert_eq!(text(&names.stdout), "job.runner/ho-first\njob.runner/ho-second\n");

    // A host-backend job with includeHostEnv sees the CLI's environment and user, not the
    // server's.
    let host = "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: h}\nspec:\n  backend: host\n  includeHostEnv: true\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: ho-host}\nspec:\n  environment: h\n  command: [\"sh\", \"-c\", \"echo $HANDOFF_PROBE\"]\n";
    write_manifest(s.dir.path(), "host.yaml", host);
    // An environment of 256 KiB (a CI runner's can be large) still goes with the apply.
    let probed = s
        .apply_command(s.dir.path(), &["-f", "host.yaml"])
        .env("HANDOFF_PROBE", "the CLI's own")
        .envs((0..4).map(|i| (format!("HANDOFF_BALLAST_{i}"), "x".repeat(64 * 1024))))
        .output()
        .unwrap();
    assert!(text(&probed.stderr).contains(TAKEN), "{}", text(&probed.stderr));
    assert_eq!(text(&probed.stdout), "the CLI's own\n", "{}", text(&probed.stderr));
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_handed_apply_fails_with_the_cli_own_errors() {
    let s = Setup::new();
    let dir = s.dir.path();
    // A bad field: its line and column, the file as the user named it.
    write_manifest(
        dir,
        "bad.yaml",
        &format!(
            "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: bb}}\nspec:\n  image: {IMAGE}\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: ho-bad}}\nspec:\n  environment: bb\n  command: [\"true\"]\n  timeoutSeconds: soon\n"
        ),
    );
    let handed = s.apply(dir, &["-f", "bad.yaml"]);
    let local = s.apply(dir, &["--local", "-f", "bad.yaml"]);
    assert!(text(&handed.stderr).contains(REFUSED), "{}", text(&handed.stderr));
    assert_eq!(handed.status.code(), Some(2), "{}", text(&handed.stderr));
    assert_eq!(local.status.code(), Some(2));
    assert_eq!(comparable(&handed.stderr), comparable(&local.stderr));
    assert!(
        comparable(&handed.stderr).contains("bad.yaml:13"),
        "{}",
        text(&handed.stderr)
    );

    // A name that exists, without --replace: refused as AlreadyExists, by both.
    write_manifest(
        dir,
        "ok.yaml",
        &format!(
            "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: bb}}\nspec:\n  image: {IMAGE}\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: ho-twice}}\nspec:\n  environment: bb\n  command: [\"true\"]\n"
        ),
    );
    let first = s.apply(dir, &["-f", "ok.yaml"]);
    assert_eq!(first.status.code(), Some(0), "{}", text(&first.stderr));
    let again = s.apply(dir, &["-f", "ok.yaml"]);
    let again_local = s.apply(dir, &["--local", "-f", "ok.yaml"]);
    assert_eq!(again.status.code(), Some(2), "{}", text(&again.stderr));
    assert_eq!(comparable(&again.stderr), comparable(&again_local.stderr));
}

/// A long job the tests stop: `sleep SECONDS` is how its process is found.
fn sleeper(name: &str, seconds: u32) -> String {
    format!(
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: bb}}\nspec:\n  image: {IMAGE}\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {name}}}\nspec:\n  environment: bb\n  command: [\"sh\", \"-c\", \"echo started; sleep {seconds}\"]\n"
    )
}

fn kill(pid: i32, signal: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal).unwrap();
}

fn reason_of(state: &Path, job: &str) -> serde_json::Value {
    json_of(&runner_ctd(&["get", "job", job, "-o", "json"], state))["status"]["reason"].clone()
}

/// Apply `file` (whose job runs `sleep SECONDS`) in the background: the CLI, once the job's
/// sleep runs.
fn running_apply(s: &Setup, file: &Path, seconds: u32) -> std::process::Child {
    let child = s
        .apply_command(s.dir.path(), &["-f", file.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let needle = format!("sleep {seconds}");
    assert!(eventually(Duration::from_secs(20), || !processes_matching(&needle).is_empty()));
    child
}

/// Apply a `sleeper` job NAME (`sleep SECONDS`), and once it runs send the CLI `signal`.
fn signal_a_running_apply(s: &Setup, name: &str, seconds: u32, signal: nix::sys::signal::Signal) -> Output {
    let file = write_manifest(s.dir.path(), &format!("{name}.yaml"), &sleeper(name, seconds));
    let child = running_apply(s, &file, seconds);
    kill(child.id() as i32, signal);
    child.wait_with_output().unwrap()
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn ctrl_c_or_a_killed_cli_stops_the_handed_jobs() {
    use nix::sys::signal::Signal;
    let s = Setup::new();
    // Ctrl-C: the jobs stop, their results are printed, the exit code is 130.
    let out = signal_a_running_apply(&s, "ho-int", 9617, Signal::SIGINT);
    let stderr = text(&out.stderr);
    assert!(stderr.contains(TAKEN), "{stderr}");
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("job/ho-int Failed (Interrupted)"), "{stderr}");
    assert!(processes_matching("sleep 9617").is_empty());
    assert_eq!(reason_of(&s.state, "ho-int"), "Interrupted");
    assert_eq!(containers_of("ho-int"), 0);

    // SIGTERM: 143.
    let out = signal_a_running_apply(&s, "ho-term", 9627, Signal::SIGTERM);
    assert_eq!(out.status.code(), Some(143), "{}", text(&out.stderr));
    assert_eq!(reason_of(&s.state, "ho-term"), "Interrupted");

    // A CLI killed outright: its connection closes, and the server stops and records the job.
    signal_a_running_apply(&s, "ho-kill", 9637, Signal::SIGKILL);
    assert!(
        eventually(Duration::from_secs(20), || processes_matching("sleep 9637").is_empty()),
        "the server left the killed CLI's job running"
    );
    assert!(eventually(Duration::from_secs(20), || reason_of(&s.state, "ho-kill")
        == "Interrupted"));
    assert!(eventually(Duration::from_secs(20), || containers_of("ho-kill") == 0));
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_stopping_server_stops_the_handed_jobs_and_reports_them() {
    use nix::sys::signal::Signal;
    let mut s = Setup::new();
    let dir = s.dir.path().to_path_buf();
    // Two jobs: the server stops during the first, and the second never runs.
    let two = format!(
        "{}---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: ho-stop-next}}\nspec:\n  environment: bb\n  command: [\"true\"]\n",
        sleeper("ho-stop", 9647)
    );
    let file = write_manifest(&dir, "stop.yaml", &two);
    let child = running_apply(&s, &file, 9647);
    let stopping = Instant::now();
    kill(s.server_pid(), Signal::SIGTERM);
    let out = child.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert!(stderr.contains(TAKEN), "{stderr}");
    assert!(stderr.contains("job/ho-stop Failed (Interrupted)"), "{stderr}");
    assert!(stderr.contains("stopped with the runner that ran it"), "{stderr}");
    // The CLI was not stopped: a job left unrun is the runner's failure (exit 2), said.
    assert!(
        stderr.contains("the server stopped before job/ho-stop-next ran"),
        "{stderr}"
    );
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stopping.elapsed() < Duration::from_secs(15), "{:?}", stopping.elapsed());
    let mut served = s.served.take().unwrap();
    let _ = served.child.wait();
    assert!(processes_matching("sleep 9647").is_empty());
    // The server took its socket with it: the next apply runs in the CLI.
    assert!(!s.state.join("serve.sock").exists());
    let file = write_manifest(&dir, "after.yaml", &sleeper("ho-after", 0));
    let after = s.apply(&dir, &["-f", file.to_str().unwrap()]);
    assert_eq!(after.status.code(), Some(0), "{}", text(&after.stderr));
    assert!(!text(&after.stderr).contains(TAKEN));

    // One job, stopped with the server: exit 2 and why, not a Ctrl-C's 130.
    s.served = Some(serve(&s.state, &dir));
    let file = write_manifest(&dir, "one.yaml", &sleeper("ho-one", 9648));
    let child = running_apply(&s, &file, 9648);
    kill(s.server_pid(), Signal::SIGTERM);
    let out = child.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert!(stderr.contains(TAKEN), "{stderr}");
    assert!(
        stderr.contains("the server stopped, and job/ho-one with it"),
        "{stderr}"
    );
    assert_eq!(out.status.code(), Some(2), "{stderr}");
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn what_the_server_cannot_run_as_the_cli_would_runs_in_the_cli() {
    let mut s = Setup::new();
    let dir = s.dir.path().to_path_buf();
    // Another configuration (a registry the server was not told of): declined, run here.
    let file = write_manifest(&dir, "cfg.yaml", &sleeper("ho-cfg", 0));
    let other = s.apply(
        &dir,
        &["--insecure-registry", "127.0.0.1:1", "-f", file.to_str().unwrap()],
    );
    let stderr = text(&other.stderr);
    assert_eq!(other.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains(DECLINED) && stderr.contains("configuration"),
        "{stderr}"
    );
    assert!(stderr.contains("job/ho-cfg Succeeded"), "{stderr}");

    // A file that makes a warm pool: the CLI makes it (and says so) and runs the job.
    let pool = format!(
        "{}---\napiVersion: runner/v1alpha1\nkind: WarmPool\nmetadata: {{name: ho-pool}}\nspec:\n  environment: bb\n  size: 1\n",
        sleeper("ho-pooled", 0)
    );
    let file = write_manifest(&dir, "pool.yaml", &pool);
    let pooled = s.apply(&dir, &["-f", file.to_str().unwrap()]);
    let stderr = text(&pooled.stderr);
    assert_eq!(pooled.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains(DECLINED), "{stderr}");
    assert!(stderr.contains("warmpool.runner/ho-pool ready"), "{stderr}");
    let removed = runner_ctd(&["pool", "rm", "ho-pool"], &s.state);
    assert_eq!(removed.status.code(), Some(0), "{}", text(&removed.stderr));

    // A manifest from a pipe is read by the apply run here (read once, it could not be read
    // again after a decline).
    let piped = s
        .apply_command(&dir, &["-f", "/dev/stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(sleeper("ho-piped", 0).as_bytes())?;
            child.wait_with_output()
        })
        .unwrap();
    assert_eq!(piped.status.code(), Some(0), "{}", text(&piped.stderr));
    assert!(
        text(&piped.stderr).contains("not a regular file"),
        "{}",
        text(&piped.stderr)
    );
    assert!(
        text(&piped.stderr).contains("job/ho-piped Succeeded"),
        "{}",
        text(&piped.stderr)
    );

    // A server that died without a word leaves its socket: the CLI runs the apply itself.
    let mut served = s.served.take().unwrap();
    kill(served.child.id() as i32, nix::sys::signal::Signal::SIGKILL);
    let _ = served.child.wait();
    assert!(s.state.join("serve.sock").exists());
    let file = write_manifest(&dir, "stale.yaml", &sleeper("ho-stale", 0));
    let stale = s.apply(&dir, &["-f", file.to_str().unwrap()]);
    assert_eq!(stale.status.code(), Some(0), "{}", text(&stale.stderr));
    assert!(!text(&stale.stderr).contains(TAKEN));
    // A server started again takes the socket back.
    s.served = Some(serve(&s.state, &dir));
    let file = write_manifest(&dir, "again.yaml", &sleeper("ho-again", 0));
    let again = s.apply(&dir, &["-f", file.to_str().unwrap()]);
    assert!(text(&again.stderr).contains(TAKEN), "{}", text(&again.stderr));
}

/// A server outlives the private containerd under it. When the daemon dies (SIGKILL, as the
/// OOM killer would), the server starts it again. Its sessions live on, new ones start, and an
/// apply handed to it right after the death runs there, not failed as an infrastructure error.
/// A daemon stopped on purpose (`runner daemon stop`) is left stopped.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_server_starts_its_private_containerd_again_when_it_dies() {
    // A containerd of this test's own: the suite's shared one must not die under others.
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let socket = std::cell::RefCell::new(String::new());
    let command = |args: &[&str]| {
        let mut cmd = Command::new(runner_bin());
        cmd.args(args)
            .current_dir(dir.path())
            .env("RUNNER_STATE_DIR", &state)
            .env("CONTAINERD_NAMESPACE", "runner-revive-test")
            .env_remove("HUID")
            .env_remove("HGID");
        match socket.borrow().as_str() {
            "" => cmd.env_remove("CONTAINERD_ADDRESS"),
            address => cmd.env("CONTAINERD_ADDRESS", address),
        };
        cmd
    };
    let run = |args: &[&str]| command(args).output().unwrap();
    let status = || text(&run(&["daemon", "status"]).stdout);
    let daemon_pid = || -> Option<i32> {
        let status = status();
        let pid = status.strip_prefix("running (pid ")?.split(')').next()?;
        pid.parse().ok()
    };
    assert_eq!(run(&["daemon", "start"]).status.code(), Some(0));
    struct Stop<F: Fn()>(F);
    impl<F: Fn()> Drop for Stop<F> {
        fn drop(&mut self) {
            (self.0)();
        }
    }
    let _stop = Stop(|| {
        run(&["daemon", "start"]);
        run(&["gc"]);
        run(&["daemon", "stop"]);
    });
    *socket.borrow_mut() = status().trim().rsplit(' ').next().unwrap().to_string();
    let first = daemon_pid().expect("the daemon runs");
    let tar = image_dir().join("busybox-oci.tar");
    assert_eq!(run(&["image", "import", tar.to_str().unwrap()]).status.code(), Some(0));
    let served = serve_with(command(&[]), dir.path());
    let before = session_in(&served);
    shell_says(&served, &before, "echo one", "one\n");

    kill(first, nix::sys::signal::Signal::SIGKILL);
    assert!(eventually(Duration::from_secs(5), || exited(first as u32)));
    assert!(status().contains(&format!("pid {first} died")), "{}", status());
    // At once: the apply is the server's, which starts the daemon if its watch has not yet.
    // (The CLI, given the address, would not start one: a decline would fail here.)
    let file = write_manifest(dir.path(), "after.yaml", &sleeper("after-death", 0));
    let mut all = vec!["apply", "--log", "warn,runner::cli::handoff=debug", "-f"];
    all.push(file.to_str().unwrap());
    let applied = run(&all);
    let stderr = text(&applied.stderr);
    assert_eq!(applied.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains(TAKEN), "{stderr}");
    assert_eq!(text(&applied.stdout), "started\n");
    let second = daemon_pid().expect("the daemon runs again");
    assert_ne!(second, first);

    // The session made before lives on; a new one starts.
    shell_says(&served, &before, "echo two", "two\n");
    let after = session_in(&served);
    shell_says(&served, &after, "hostname", &format!("{after}\n"));
    let revivals = || {
        let (_, metrics) = served.call("GET", "/metrics", None);
        let metrics = metrics.as_str().unwrap_or_default().to_string();
        metrics
            .lines()
            .find_map(|l| l.strip_prefix("runner_containerd_revivals_total{result=\"started\"} "))
            .map(str::to_string)
    };
    assert_eq!(revivals().as_deref(), Some("1"));

    // Without a word from anyone, the server's watch starts a dead daemon too (counted once
    // it answers).
    kill(second, nix::sys::signal::Signal::SIGKILL);
    assert!(
        eventually(Duration::from_secs(20), || revivals().as_deref() == Some("2")),
        "the server did not start its containerd again: {}",
        status()
    );
    assert!(daemon_pid().is_some_and(|p| p != second), "{}", status());
    shell_says(&served, &after, "echo three", "three\n");
    for id in [&before, &after] {
        let (code, body) = served.call("DELETE", &format!("/v1/sessions/{id}"), None);
        assert_eq!(code, 204, "{body}");
    }

    // Stopped on purpose: it stays stopped.
    assert_eq!(run(&["daemon", "stop"]).status.code(), Some(0));
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(status().trim(), "stopped");
    drop(served);
}

/// A busybox session of `served`: its id.
fn session_in(served: &Served) -> String {
    let (code, body) = served.call(
        "POST",
        "/v1/sessions",
        Some(&format!(r#"{{"environment": {{"image": "{IMAGE}"}}}}"#)),
    );
    assert_eq!(code, 201, "{body}");
    body["id"].as_str().unwrap().to_string()
}

fn shell_says(served: &Served, id: &str, command: &str, output: &str) {
    let (code, body) = served.call(
        "POST",
        &format!("/v1/sessions/{id}/shell"),
        Some(&serde_json::json!({ "command": command }).to_string()),
    );
    assert_eq!((code, body["output"].as_str()), (200, Some(output)), "{body}");
}
