//! Helpers shared by the integration tests.
#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

/// The built `runner` binary.
pub fn runner_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_runner"))
}

/// Run `runner ARGS` with a private state dir; returns its output.
pub fn runner(args: &[&str], state_dir: &Path) -> Output {
    Command::new(runner_bin())
        .args(args)
        .env("RUNNER_STATE_DIR", state_dir)
        .env_remove("HUID")
        .env_remove("HGID")
        .output()
        .expect("run runner")
}

/// Write a manifest into `dir` and return its path.
pub fn write_manifest(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Host-backend Environment + Job around `command` (YAML flow list or string).
pub fn host_job(name: &str, command: &str, extra_job: &str) -> String {
    format!(
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: host}}\nspec:\n  backend: host\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {name}}}\nspec:\n  environment: host\n  command: {command}\n{extra_job}"
    )
}

/// PIDs of live processes whose command line contains `needle`.
pub fn processes_matching(needle: &str) -> Vec<i32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        // Zombies have an empty cmdline; they hold no resources but a slot in the table.
        if text.contains(needle) {
            out.push(pid);
        }
    }
    out
}

/// Kill what a failed test left behind, so one failure does not leak into the next run.
pub fn kill_matching(needle: &str) {
    for pid in processes_matching(needle) {
        unsafe_kill(pid);
    }
}

fn unsafe_kill(pid: i32) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
}

/// Wait up to `limit` for `cond`.
pub fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    cond()
}

/// The private containerd the test script started, and the namespace to use. Panics with
/// instructions when absent: these tests never skip silently.
pub fn containerd_env() -> (PathBuf, String) {
    let address = std::env::var("CONTAINERD_ADDRESS").unwrap_or_else(|_| {
        panic!("containerd tests need CONTAINERD_ADDRESS and CONTAINERD_NAMESPACE: run scripts/test.sh, which starts a private containerd")
    });
    let namespace = std::env::var("CONTAINERD_NAMESPACE").unwrap_or_else(|_| "runner-test".into());
    (PathBuf::from(address), namespace)
}

/// Directory of the image archives the test script built.
pub fn image_dir() -> PathBuf {
    PathBuf::from(std::env::var("RUNNER_TEST_IMAGES").unwrap_or_else(|_| {
        panic!("containerd tests need RUNNER_TEST_IMAGES (built by scripts/test.sh from images/busybox/build.sh)")
    }))
}

/// `runner ARGS` set up for the test containerd and the given state dir, not yet run.
pub fn runner_ctd_command(args: &[&str], state_dir: &Path) -> Command {
    let (address, namespace) = containerd_env();
    let mut cmd = Command::new(runner_bin());
    cmd.args(args)
        .env("RUNNER_STATE_DIR", state_dir)
        .env("CONTAINERD_ADDRESS", address)
        .env("CONTAINERD_NAMESPACE", namespace)
        .env_remove("HUID")
        .env_remove("HGID");
    cmd
}

/// Run `runner` against the test containerd.
pub fn runner_ctd(args: &[&str], state_dir: &Path) -> Output {
    runner_ctd_command(args, state_dir).output().expect("run runner")
}

/// A command's stdout as JSON; the panic shows both streams.
pub fn json_of(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): stdout={} stderr={}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// Containers in the test namespace labelled as belonging to job (or session) `job`.
pub fn containers_of(job: &str) -> usize {
    let (address, namespace) = containerd_env();
    let out = Command::new("ctr")
        .args([
            "--address",
            address.to_str().unwrap(),
            "--namespace",
            &namespace,
            "containers",
            "ls",
            "-q",
        ])
        .arg(format!("labels.\"runner.dev/job\"=={job}"))
        .output()
        .expect("run ctr");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .count()
}
