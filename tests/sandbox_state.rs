//! A sandbox's state over `runner serve` (HTTP, as users call it) against the private
//! containerd of scripts/test.sh: pause and resume (the freezer: no CPU while paused, the same
//! processes after), autoResume and idlePauseSeconds.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

/// A server on a fresh state dir with busybox imported.
fn server(dir: &std::path::Path) -> Served {
    let state = dir.join("state");
    let image = image_dir().join("busybox-oci.tar");
    let out = runner_ctd(&["image", "import", image.to_str().unwrap()], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    serve_with(runner_ctd_command(&[], &state), dir)
}

fn create(s: &Served, body: serde_json::Value) -> String {
    let (code, v) = s.call("POST", "/v1/sessions", Some(&body.to_string()));
    assert_eq!(code, 201, "{v}");
    v["id"].as_str().unwrap().to_string()
}

fn exec(s: &Served, id: &str, command: &str) -> (u16, serde_json::Value) {
    s.call(
        "POST",
        &format!("/v1/sessions/{id}/exec"),
        Some(&json!({"command": command, "timeoutSeconds": 20}).to_string()),
    )
}

/// The host PID of a session's init (its container's task, as `ctr` shows it).
fn init_pid(session: &str) -> u32 {
    let (address, namespace) = containerd_env();
    let ctr = |args: &[&str]| {
        let out = Command::new("ctr")
            .args(["--address", address.to_str().unwrap(), "--namespace", &namespace])
            .args(args)
            .output()
            .expect("run ctr");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let filter = format!("labels.\"runner.dev/job\"=={session}");
    let id = ctr(&["containers", "ls", "-q", &filter]);
    let id = id
        .lines()
        .next()
        .unwrap_or_else(|| panic!("no container of {session}"))
        .trim()
        .to_string();
    let tasks = ctr(&["tasks", "ls"]);
    let line = tasks
        .lines()
        .find(|l| l.split_whitespace().next() == Some(id.as_str()))
        .unwrap_or_else(|| panic!("no task {id} in {tasks}"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// CPU time (ns) of the cgroup a host process is in: cgroup v1's cpuacct, or v2's cpu.stat.
fn cgroup_cpu_ns(pid: u32) -> u64 {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next().unwrap(), parts.next().unwrap());
        if controllers.split(',').any(|c| c == "cpuacct") {
            for mount in ["cpuacct", "cpu,cpuacct", "cpuacct,cpu"] {
                let file = PathBuf::from(format!("/sys/fs/cgroup/{mount}{path}/cpuacct.usage"));
                if let Ok(text) = std::fs::read_to_string(&file) {
                    return text.trim().parse().unwrap();
                }
            }
        }
    }
    for line in cgroups.lines() {
        if let Some(path) = line.strip_prefix("0::") {
            for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
                if let Ok(text) = std::fs::read_to_string(format!("{root}{path}/cpu.stat")) {
                    let usec: u64 = text
                        .lines()
                        .find_map(|l| l.strip_prefix("usage_usec "))
                        .unwrap()
                        .trim()
                        .parse()
                        .unwrap();
                    return usec * 1000;
                }
            }
        }
    }
    panic!("no CPU accounting found for pid {pid}: {cgroups}");
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_paused_session_uses_no_cpu_and_resumes_the_same_process() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    let id = create(&s, json!({"environment": {"image": "local/busybox:1.35"}}));
    // A busy loop in the background: it runs on after the call.
    let (code, v) = exec(&s, &id, "sh -c 'while :; do :; done' >/dev/null 2>&1 & echo $!");
    assert_eq!(code, 200, "{v}");
    let busy = v["stdout"].as_str().unwrap().trim().to_string();
    let pid = init_pid(&id);
    let before = cgroup_cpu_ns(pid);
    std::thread::sleep(Duration::from_millis(300));
    assert!(cgroup_cpu_ns(pid) > before, "the busy loop runs");

    let (code, v) = s.call("POST", &format!("/v1/sessions/{id}/pause"), None);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["state"], "paused", "{v}");
    assert!(v["pausedSince"].is_string(), "{v}");
    let frozen = cgroup_cpu_ns(pid);
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(cgroup_cpu_ns(pid), frozen, "a paused sandbox uses no CPU");
    let (_, v) = s.call("GET", &format!("/v1/sessions/{id}"), None);
    assert_eq!(v["state"], "paused", "{v}");
    // A call to a paused session is refused, clearly; pausing again changes nothing.
    let (code, v) = exec(&s, &id, "true");
    assert_eq!(code, 409, "{v}");
    assert!(v.to_string().contains("is paused"), "{v}");
    let (code, _) = s.call("GET", &format!("/v1/sessions/{id}/files/list"), None);
    assert_eq!(code, 409);
    let (code, v) = s.call("POST", &format!("/v1/sessions/{id}/pause"), None);
    assert_eq!((code, &v["state"]), (200, &json!("paused")), "{v}");

    let (code, v) = s.call("POST", &format!("/v1/sessions/{id}/resume"), None);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["state"], "running", "{v}");
    assert!(v.get("pausedSince").is_none(), "{v}");
    let thawed = cgroup_cpu_ns(pid);
    std::thread::sleep(Duration::from_millis(300));
    assert!(cgroup_cpu_ns(pid) > thawed, "the busy loop runs again");
    // The same process, not a new one.
    let (code, v) = exec(&s, &id, &format!("kill -0 {busy} && echo alive"));
    assert_eq!((code, v["stdout"].as_str()), (200, Some("alive\n")), "{v}");

    // A session with a call in progress is not paused under it.
    let streaming = {
        let url = format!("{}/v1/sessions/{id}/exec", s.url);
        std::thread::spawn(move || {
            ureq::post(&url)
                .set("Authorization", &format!("Bearer {SERVE_TOKEN}"))
                .send_string(&json!({"command": "sleep 2"}).to_string())
                .map(|r| r.status())
                .unwrap_or(0)
        })
    };
    assert!(
        eventually(Duration::from_secs(5), || {
            s.call("GET", &format!("/v1/sessions/{id}"), None).1["activeCalls"] == 1
        }),
        "the sleeping call is in progress"
    );
    let (code, v) = s.call("POST", &format!("/v1/sessions/{id}/pause"), None);
    assert_eq!(code, 409, "{v}");
    assert!(v.to_string().contains("in progress"), "{v}");
    assert_eq!(streaming.join().unwrap(), 200);

    // A paused session is ended as any other (thawed to be killed).
    let (code, v) = s.call("POST", &format!("/v1/sessions/{id}/pause"), None);
    assert_eq!(code, 200, "{v}");
    let (code, _) = s.call("DELETE", &format!("/v1/sessions/{id}"), None);
    assert_eq!(code, 204);
    assert_eq!(containers_of(&id), 0);
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn an_idle_session_pauses_itself_and_a_call_resumes_it_with_auto_resume() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    let id = create(
        &s,
        json!({"environment": {"image": "local/busybox:1.35"}, "autoResume": true, "idlePauseSeconds": 1}),
    );
    let (code, v) = exec(&s, &id, "echo kept > /tmp/state");
    assert_eq!(code, 200, "{v}");
    let began = Instant::now();
    assert!(
        eventually(Duration::from_secs(10), || {
            s.call("GET", &format!("/v1/sessions/{id}"), None).1["state"] == "paused"
        }),
        "the idle session paused itself"
    );
    assert!(began.elapsed() >= Duration::from_millis(900));
    let (_, v) = s.call("GET", &format!("/v1/sessions/{id}"), None);
    assert_eq!(
        (v["autoResume"].as_bool(), v["idlePauseSeconds"].as_u64()),
        (Some(true), Some(1)),
        "{v}"
    );
    // The call resumes it, and finds its state.
    let (code, v) = exec(&s, &id, "cat /tmp/state");
    assert_eq!((code, v["stdout"].as_str()), (200, Some("kept\n")), "{v}");
    let (_, v) = s.call("GET", &format!("/v1/sessions/{id}"), None);
    assert_eq!(v["state"], "running", "{v}");
    let (code, _) = s.call("DELETE", &format!("/v1/sessions/{id}"), None);
    assert_eq!(code, 204);
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn pause_settings_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    let (code, v) = s.call(
        "POST",
        "/v1/sessions",
        Some(
            &json!({"environment": {"image": "local/busybox:1.35"}, "backend": "host", "autoResume": true}).to_string(),
        ),
    );
    assert_eq!(code, 400, "{v}");
    assert!(v.to_string().contains("containerd"), "{v}");
    let (code, v) = s.call(
        "POST",
        "/v1/sessions",
        Some(&json!({"environment": {"image": "local/busybox:1.35"}, "idlePauseSeconds": -1}).to_string()),
    );
    assert_eq!(code, 400, "{v}");
    assert!(v.to_string().contains("idlePauseSeconds"), "{v}");
    let (code, _) = s.call("POST", "/v1/sessions/s-nope/pause", None);
    assert_eq!(code, 404);
}
