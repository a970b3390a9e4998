//! A session's resident shell runs with a short scheduling slice, its commands with the
//! kernel's default (src/runtime/latency.rs; issue 36, item 5: an idle session answers while
//! others keep the CPUs busy). Through the HTTP API as users run it, against the private
//! containerd of scripts/test.sh; the shell's and its child's host processes are found in the
//! container's cgroup by their PIDs inside the sandbox.

mod common;

use std::time::Duration;

use common::*;
use runner::runtime::latency::{self, SHELL_SLICE};

/// The host PID of the process with PID `ns_pid` in the sandbox of container `container`.
fn host_pid(container: &str, ns_pid: i32) -> i32 {
    let (_, namespace) = containerd_env();
    let cgroup = format!("/runner/{namespace}/{container}");
    let procs = runner::runtime::cgroupfs::procs(&cgroup);
    procs
        .iter()
        .copied()
        .find(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/status"))
                .ok()
                .and_then(|s| s.lines().find_map(|l| l.strip_prefix("NSpid:")).map(str::to_string))
                .and_then(|l| l.split_whitespace().last().and_then(|p| p.parse::<i32>().ok()))
                == Some(ns_pid)
        })
        .unwrap_or_else(|| panic!("no process {ns_pid} of {container} among {procs:?}"))
}

/// What `command` printed through the session's shell, trimmed.
fn shell(served: &Served, id: &str, command: &str) -> String {
    let body = serde_json::json!({ "command": command }).to_string();
    let (code, body) = served.call("POST", &format!("/v1/sessions/{id}/shell"), Some(&body));
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["exitCode"], 0, "{body}");
    body["output"].as_str().unwrap_or_default().trim().to_string()
}

#[test]
#[ignore = "needs the containerd of scripts/test.sh"]
fn the_resident_shell_gets_a_short_slice_and_its_commands_the_default() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    let served = serve_with(runner_ctd_command(&[], &state), dir.path());
    let (code, body) = served.call(
        "POST",
        "/v1/sessions",
        Some(r#"{"environment": {"image": "local/busybox:1.35"}}"#),
    );
    assert_eq!(code, 201, "{body}");
    let id = body["id"].as_str().unwrap().to_string();
    let containers = containers_where(&format!("labels.\"runner.dev/job\"=={id}"));
    assert_eq!(containers.len(), 1, "{containers:?}");

    let shell_pid: i32 = shell(&served, &id, "echo $$").parse().expect("the shell's pid");
    let child_pid: i32 = shell(&served, &id, "sleep 300 >/dev/null 2>&1 & echo $!")
        .parse()
        .expect("the child's pid");
    let (shell_host, child_host) = (host_pid(&containers[0], shell_pid), host_pid(&containers[0], child_pid));
    let of_shell = latency::scheduling(shell_host).expect("sched_getattr of the shell");
    let of_child = latency::scheduling(child_host).expect("sched_getattr of the child");
    assert!(of_shell.resets_on_fork, "the shell: {of_shell:?}");
    assert!(!of_child.resets_on_fork, "its command: {of_child:?}");
    // Kernels from 6.12 report the slice (older ones ignore it for normal tasks: nothing to see).
    if let Some(child_slice) = of_child.slice {
        assert_eq!(of_shell.slice, Some(SHELL_SLICE), "the shell");
        assert!(
            child_slice > SHELL_SLICE,
            "its command runs with the default slice: {child_slice:?}"
        );
    }
    // The shell keeps working, state and all.
    assert_eq!(shell(&served, &id, "cd /tmp && export K=v; echo ok"), "ok");
    assert_eq!(shell(&served, &id, "echo $PWD $K"), "/tmp v");

    let (code, body) = served.call("DELETE", &format!("/v1/sessions/{id}"), None);
    assert_eq!(code, 204, "{body}");
    assert!(eventually(Duration::from_secs(10), || containers_of(&id) == 0));
}
