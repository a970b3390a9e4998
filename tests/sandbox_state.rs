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

/// The freezer state of the cgroup a host process is in: cgroup v1's `freezer.state`, or
/// v2's `cgroup.freeze` and `cgroup.events` said the same way (`THAWED`, `FROZEN`).
fn freezer_state(pid: u32) -> String {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next().unwrap(), parts.next().unwrap());
        if controllers.split(',').any(|c| c == "freezer") {
            let file = format!("/sys/fs/cgroup/freezer{path}/freezer.state");
            return std::fs::read_to_string(&file).unwrap().trim().to_string();
        }
    }
    let path = cgroups
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .unwrap_or_else(|| panic!("no freezer found for pid {pid}: {cgroups}"));
    let events = std::fs::read_to_string(format!("/sys/fs/cgroup{path}/cgroup.events")).unwrap();
    if events.lines().any(|l| l == "frozen 1") {
        "FROZEN".into()
    } else {
        "THAWED".into()
    }
}

/// What runc (in containerd's runc root for the namespace) says of a session's container.
fn runc_status(session: &str) -> String {
    let (address, namespace) = containerd_env();
    let out = Command::new("ctr")
        .args(["--address", address.to_str().unwrap(), "--namespace", &namespace])
        .args([
            "containers",
            "ls",
            "-q",
            &format!("labels.\"runner.dev/job\"=={session}"),
        ])
        .output()
        .unwrap();
    let id = String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap()
        .trim()
        .to_string();
    let out = Command::new("runc")
        .args(["--root", &format!("/run/containerd/runc/{namespace}"), "state", &id])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "runc state {id}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["status"].as_str().unwrap().to_string()
}

/// `runner pause|resume SESSION` against the server; its exit code and output.
fn cli(s: &Served, args: &[&str]) -> (i32, String) {
    let out = Command::new(runner_bin())
        .args(args)
        .env("RUNNER_URL", &s.url)
        .env("RUNNER_TOKEN", SERVE_TOKEN)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
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
    // runner froze the cgroup itself: the kernel and runc say so (containerd's shim, which
    // was not asked, still calls the task running).
    assert_eq!(freezer_state(pid), "FROZEN");
    assert_eq!(runc_status(&id), "paused");
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
    // A snapshot of a paused session leaves it paused (it was not frozen for it again).
    let snap = format!("paused-{}", std::process::id());
    let (code, v) = snapshot(&s, &id, json!({"name": snap}));
    assert_eq!((code, &v["frozenMs"]), (201, &json!(0)), "{v}");
    assert_eq!(freezer_state(pid), "FROZEN");
    assert_eq!(cgroup_cpu_ns(pid), frozen, "still no CPU");
    let (code, _) = s.call("DELETE", &format!("/v1/snapshots/{snap}"), None);
    assert_eq!(code, 204);

    let (code, v) = s.call("POST", &format!("/v1/sessions/{id}/resume"), None);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["state"], "running", "{v}");
    assert!(v.get("pausedSince").is_none(), "{v}");
    assert_eq!(freezer_state(pid), "THAWED");
    assert_eq!(runc_status(&id), "running");
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

    // The CLI's verbs, as docker's: pause, resume (and its alias unpause).
    assert_eq!(cli(&s, &["pause", &id]), (0, format!("{id} paused\n")));
    assert_eq!(freezer_state(pid), "FROZEN");
    let (code, text) = cli(&s, &["unpause", &id, "-o", "json"]);
    assert_eq!(code, 0, "{text}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&text).unwrap()["state"],
        "running"
    );
    assert_eq!(freezer_state(pid), "THAWED");
    let (code, text) = cli(&s, &["resume", "s-nope"]);
    assert_ne!(code, 0);
    assert!(text.contains("s-nope"), "{text}");

    // A paused session is ended as any other (thawed to be killed).
    assert_eq!(cli(&s, &["pause", &id]).0, 0);
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

/// `POST /v1/sessions/{id}/snapshot` with `body`.
fn snapshot(s: &Served, id: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
    s.call("POST", &format!("/v1/sessions/{id}/snapshot"), Some(&body.to_string()))
}

/// `runner apply --replace -f FILE -o json` of a Job that must end well: its result.
fn job_result(state: &std::path::Path, file: &std::path::Path) -> serde_json::Value {
    let out = runner_ctd(
        &["apply", "--replace", "-f", file.to_str().unwrap(), "-o", "json"],
        state,
    );
    let v = json_of(&out);
    assert_eq!(out.status.code(), Some(0), "{v}");
    v["status"]["result"].clone()
}

/// A pool (of a state dir) removed when dropped.
struct PoolGuard<'a>(&'a std::path::Path, &'a str);

impl Drop for PoolGuard<'_> {
    fn drop(&mut self) {
        let _ = runner_ctd(&["pool", "rm", self.1], self.0);
    }
}

/// A manifest with one Environment on `image` and one Job running `command`.
fn job_manifest(dir: &std::path::Path, job: &str, image: &str, command: &str) -> PathBuf {
    write_manifest(
        dir,
        &format!("{job}.yaml"),
        &format!(
            "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: {job}-env}}\nspec: {{image: \"{image}\"}}\n---\n\
             apiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {job}}}\nspec:\n  environment: {job}-env\n  command: {command:?}\n"
        ),
    )
}

/// Run a job to its end through the CLI; its stdout.
fn run_job(state: &std::path::Path, file: &std::path::Path) -> String {
    let out = runner_ctd(
        &["apply", "--replace", "-f", file.to_str().unwrap(), "-o", "json"],
        state,
    );
    let v = json_of(&out);
    assert_eq!(out.status.code(), Some(0), "{v}");
    let job = v.get("items").map_or(&v, |items| &items[0]);
    job["status"]["result"]["stdout"]
        .as_str()
        .unwrap_or_else(|| panic!("no stdout in {v}"))
        .to_string()
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_session_snapshot_is_an_image_jobs_and_sessions_start_from() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let s = server(dir.path());
    let name = format!("snap-{}", std::process::id());
    let id = create(&s, json!({"environment": {"image": "local/busybox:1.35"}}));
    let (code, v) = exec(
        &s,
        &id,
        "echo made > /etc/made && rm /bin/ls && mkdir -p /opt/d && head -c 2097152 /dev/urandom > /opt/d/blob \
         && chown 1000:100 /opt/d/blob && ln /opt/d/blob /opt/d/hard && echo secret > in-workspace && pwd",
    );
    assert_eq!(code, 200, "{v}");
    let workdir = v["stdout"].as_str().unwrap().trim().to_string();

    let (code, v) = snapshot(&s, &id, json!({"name": name}));
    assert_eq!(code, 201, "{v}");
    assert_eq!(v["image"], format!("snapshot:{name}"), "{v}");
    assert_eq!(v["base"], "local/busybox:1.35", "{v}");
    assert!(v["layerBytes"].as_u64().unwrap() > 2 << 20, "{v}");
    // A whole containerd image: every blob in the content store, unpacked.
    let (address, namespace) = containerd_env();
    let out = Command::new("ctr")
        .args(["--address", address.to_str().unwrap(), "--namespace", &namespace])
        .args(["images", "check", &format!("name==snapshot:{name}")])
        .output()
        .unwrap();
    let check = String::from_utf8_lossy(&out.stdout);
    assert!(check.contains("complete (3/3)") && check.contains("true"), "{check}");
    // No ingest of it is left behind.
    let out = Command::new("ctr")
        .args(["--address", address.to_str().unwrap(), "--namespace", &namespace])
        .args(["content", "active"])
        .output()
        .unwrap();
    let active = String::from_utf8_lossy(&out.stdout);
    assert!(!active.contains("runner-commit"), "{active}");
    // A name is taken once, unless replaced.
    let (code, v) = snapshot(&s, &id, json!({"name": name}));
    assert_eq!(code, 409, "{v}");
    let (code, v) = snapshot(&s, &id, json!({"name": name, "replace": true}));
    assert_eq!(code, 201, "{v}");
    let (code, v) = snapshot(&s, &id, json!({"name": "Bad/Name"}));
    assert_eq!(code, 400, "{v}");
    // The session goes on running after it.
    let (code, v) = exec(&s, &id, "cat /etc/made");
    assert_eq!((code, v["stdout"].as_str()), (200, Some("made\n")), "{v}");

    // Listed with its disk use, over HTTP and by the CLI.
    let (code, v) = s.call("GET", "/v1/snapshots", None);
    assert_eq!(code, 200, "{v}");
    let listed = v
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["name"] == name.as_str())
        .cloned();
    let listed = listed.unwrap_or_else(|| panic!("{name} not in {v}"));
    assert!(
        listed["diskBytes"].as_u64().unwrap() >= listed["layerBytes"].as_u64().unwrap(),
        "{listed}"
    );
    let out = runner_ctd(&["snapshot", "ls", "-o", "json"], &state);
    assert!(
        json_of(&out)
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["name"] == name.as_str())
    );

    // A job on it has the changes (ids as the sandbox saw them, the link, the whiteout), and
    // nothing of the workspace or of runner's directories.
    let file = job_manifest(
        dir.path(),
        "on-snapshot",
        &format!("snapshot:{name}"),
        &format!(
            "cat /etc/made; ls -ln /opt/d/blob | awk '{{print $3, $4, $2}}'; ls /bin/ls 2>&1 || true; \
             ls {workdir}/in-workspace /.runner /.runner-tools 2>&1 | sed 's/.*\\(No such\\)/\\1/'"
        ),
    );
    let stdout = run_job(&state, &file);
    assert!(stdout.starts_with("made\n1000 100 2\n"), "{stdout}");
    assert!(stdout.contains("/bin/ls: No such file"), "{stdout}");
    assert_eq!(stdout.matches("No such file").count(), 4, "{stdout}");
    // The base image is untouched.
    let file = job_manifest(
        dir.path(),
        "on-base",
        "local/busybox:1.35",
        "ls /bin/ls; cat /etc/made 2>&1 || true",
    );
    let stdout = run_job(&state, &file);
    assert!(
        stdout.starts_with("/bin/ls\n") && stdout.contains("No such file"),
        "{stdout}"
    );
    // A session on it too.
    let other = create(&s, json!({"environment": {"image": format!("snapshot:{name}")}}));
    let (code, v) = exec(&s, &other, "cat /etc/made");
    assert_eq!((code, v["stdout"].as_str()), (200, Some("made\n")), "{v}");
    for session in [&id, &other] {
        let (code, _) = s.call("DELETE", &format!("/v1/sessions/{session}"), None);
        assert_eq!(code, 204);
    }

    // Removed, it is gone from the list and from what images resolve.
    let (code, _) = s.call("DELETE", &format!("/v1/snapshots/{name}"), None);
    assert_eq!(code, 204);
    let (code, _) = s.call("DELETE", &format!("/v1/snapshots/{name}"), None);
    assert_eq!(code, 404);
    let out = runner_ctd(&["snapshot", "ls", "-o", "json"], &state);
    assert!(
        !json_of(&out)
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["name"] == name.as_str())
    );
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn the_cli_snapshots_a_running_job_attempt() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let image = image_dir().join("busybox-oci.tar");
    let out = runner_ctd(&["image", "import", image.to_str().unwrap()], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let job = format!("snapjob-{}", std::process::id());
    let name = format!("{job}-img");
    let file = job_manifest(
        dir.path(),
        &job,
        "local/busybox:1.35",
        "echo from-job > /etc/from-job; echo ready; sleep 60",
    );
    let out = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "--detach"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    // Its attempt 0, once it wrote its file (snapshots of it until one has the file).
    let probe = job_manifest(dir.path(), "probe", &format!("snapshot:{name}"), "cat /etc/from-job");
    let mut made = serde_json::Value::Null;
    let ready = eventually(Duration::from_secs(20), || {
        let out = runner_ctd(
            &[
                "snapshot",
                "create",
                &format!("{job}-0"),
                &name,
                "--replace",
                "-o",
                "json",
            ],
            &state,
        );
        if out.status.code() != Some(0) {
            return false;
        }
        made = json_of(&out);
        let out = runner_ctd(
            &["apply", "--replace", "-f", probe.to_str().unwrap(), "-o", "json"],
            &state,
        );
        json_of(&out)["status"]["result"]["stdout"] == "from-job\n"
    });
    assert!(ready, "the running attempt was snapshotted with its file: {made}");
    assert_eq!(made["source"], format!("{job}-0"), "{made}");
    // The job's own name finds its one running container too — not another state dir's Job
    // of the same name on the same containerd namespace.
    let state2 = dir.path().join("state2");
    let out = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "--detach"], &state2);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let out = runner_ctd(&["snapshot", "create", &job, &name, "--replace"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("snapshot {name} made of {job}")),
        "{out:?}"
    );
    // A Job without a workspace has none to hold: said, with the option.
    let out = runner_ctd(&["snapshot", "create", &job, &name, "--replace", "--workspace"], &state);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("workspace") && err.contains("no workspace mounted"),
        "{err}"
    );
    // Unknown sources and names are clear errors.
    let out = runner_ctd(&["snapshot", "create", "no-such-job", "x"], &state);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no-such-job"), "{out:?}");
    let out = runner_ctd(&["snapshot", "rm", "never-made"], &state);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found"), "{out:?}");
    for state in [&state, &state2] {
        let out = runner_ctd(&["delete", "job", &job], state);
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let out = runner_ctd(&["snapshot", "rm", &name], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}

/// An Environment whose setup (`commands`) counts its runs in `count_dir` (a file each: each
/// sandbox writes as its own range's ids, which may not write another's files) and is
/// snapshotted, and an indexed Job of `n` at once on it.
fn setup_manifest(dir: &std::path::Path, env: &str, count_dir: &std::path::Path, commands: &str, n: u32) -> PathBuf {
    write_manifest(
        dir,
        &format!("{env}.yaml"),
        &format!(
            "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: {env}}}\nspec:\n  image: local/busybox:1.35\n\
             \x20 mounts: [{{source: {count}, target: /count}}]\n\
             \x20 setup:\n    snapshot: true\n    commands: [\"mktemp /count/run.XXXXXX\", {commands:?}]\n---\n\
             apiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {env}-job}}\nspec:\n  environment: {env}\n\
             \x20 completions: {n}\n  parallelism: {n}\n  completionMode: Indexed\n  command: \"cat /etc/prepared; ls /bin/ls 2>&1 | grep -c 'No such'\"\n",
            count = count_dir.display(),
        ),
    )
}

fn runs(count_dir: &std::path::Path) -> usize {
    std::fs::read_dir(count_dir).unwrap().count()
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_snapshotted_setup_runs_once_for_many_jobs_and_again_when_it_changes() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let image = image_dir().join("busybox-oci.tar");
    let out = runner_ctd(&["image", "import", image.to_str().unwrap()], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let count = dir.path().join("count");
    std::fs::create_dir(&count).unwrap();
    // The sandbox's root is a range id: it writes here as "others".
    std::fs::set_permissions(&count, std::fs::Permissions::from_mode(0o777)).unwrap();
    // A setup unique to this run (the snapshots of other runs have other keys).
    let tag = format!("{}-{}", std::process::id(), dir.path().display().to_string().len());
    let commands = format!("echo prepared-{tag} > /etc/prepared && rm /bin/ls");
    let env = "setup-once";
    let file = setup_manifest(dir.path(), env, &count, &commands, 4);
    // Four attempts at once, all first uses: setup runs once, each starts from its snapshot.
    let out = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], &state);
    let v = json_of(&out);
    assert_eq!(out.status.code(), Some(0), "{v}");
    assert_eq!(runs(&count), 1, "setup ran once for 4 jobs: {v}");
    let logs = runner_ctd(&["logs", &format!("{env}-job")], &state);
    let text = String::from_utf8_lossy(&logs.stdout);
    assert_eq!(text.matches(&format!("prepared-{tag}\n1\n")).count(), 4, "{text}");
    // Its snapshot is listed, named by its key.
    let out = runner_ctd(&["snapshot", "ls", "-o", "json"], &state);
    let listed = json_of(&out);
    let mine: Vec<_> = listed
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["source"] == format!("setup of Environment {env}"))
        .cloned()
        .collect();
    assert!(!mine.is_empty(), "{listed}");
    assert!(mine.iter().all(|s| s["layerBytes"].as_u64() > Some(0)), "{listed}");
    // Again: no setup at all.
    let out = runner_ctd(&["apply", "--replace", "-f", file.to_str().unwrap()], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(runs(&count), 1);
    // A session of the Environment starts from the snapshot too.
    let s = serve_with(runner_ctd_command(&[], &state), dir.path());
    let id = create(
        &s,
        json!({"environment": {"image": "local/busybox:1.35", "mounts": [{"source": count, "target": "/count"}],
               "setup": {"snapshot": true, "commands": ["mktemp /count/run.XXXXXX", commands]}}}),
    );
    let (code, v) = exec(&s, &id, "cat /etc/prepared");
    assert_eq!(
        (code, v["stdout"].as_str()),
        (200, Some(format!("prepared-{tag}\n").as_str())),
        "{v}"
    );
    assert_eq!(
        runs(&count),
        1,
        "the session ran no setup: it started from the jobs' snapshot"
    );
    let (code, _) = s.call("DELETE", &format!("/v1/sessions/{id}"), None);
    assert_eq!(code, 204);
    drop(s);
    // A changed setup is a new key: it runs once more.
    let changed = setup_manifest(dir.path(), env, &count, &format!("{commands} && true"), 2);
    let out = runner_ctd(&["apply", "--replace", "-f", changed.to_str().unwrap()], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(runs(&count), 2);
    // The base image is untouched.
    let file = job_manifest(
        dir.path(),
        "base-after-setup",
        "local/busybox:1.35",
        "ls /bin/ls; ls /etc/prepared 2>&1 || true",
    );
    let stdout = run_job(&state, &file);
    assert!(
        stdout.starts_with("/bin/ls\n") && stdout.contains("No such file"),
        "{stdout}"
    );
    // gc removes the superseded snapshot (another test's gc may have done it already).
    let out = runner_ctd(&["gc"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("superseded setup snapshots removed"),
        "{out:?}"
    );
    let out = runner_ctd(&["snapshot", "ls", "-o", "json"], &state);
    let left: Vec<_> = json_of(&out)
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["source"] == format!("setup of Environment {env}"))
        .cloned()
        .collect();
    assert_eq!(left.len(), 1, "only the newest setup snapshot is left: {left:?}");
    for snapshot in left {
        {
            let name = snapshot["name"].as_str().unwrap();
            let out = runner_ctd(&["snapshot", "rm", name], &state);
            assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        }
    }
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_pool_of_a_snapshotted_setup_holds_prepared_members() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let image = image_dir().join("busybox-oci.tar");
    let out = runner_ctd(&["image", "import", image.to_str().unwrap()], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let count = dir.path().join("count");
    std::fs::create_dir(&count).unwrap();
    std::fs::set_permissions(&count, std::fs::Permissions::from_mode(0o777)).unwrap();
    let tag = format!("pool-{}", std::process::id());
    let env = "setup-pool";
    let file = setup_manifest(
        dir.path(),
        env,
        &count,
        &format!("echo prepared-{tag} > /etc/prepared && rm /bin/ls"),
        1,
    );
    let out = runner_ctd(
        &["pool", "create", env, "-f", file.to_str().unwrap(), "--size", "1"],
        &state,
    );
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    // The pool goes however the test ends (its members outlive this process otherwise).
    let pool = PoolGuard(&state, env);
    assert_eq!(runs(&count), 1, "the pool's members start from the setup's snapshot");
    let out = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], &state);
    let v = json_of(&out);
    assert_eq!(out.status.code(), Some(0), "{v}");
    let result = &v["status"]["result"];
    assert_eq!(result["pool"], env, "a member served it: {v}");
    assert_eq!(result["stdout"], format!("prepared-{tag}\n1\n"), "{v}");
    assert!(result.get("setup").is_none(), "no setup at the claim: {v}");
    assert_eq!(runs(&count), 1);
    drop(pool);
    let out = runner_ctd(&["snapshot", "ls", "-o", "json"], &state);
    for snapshot in json_of(&out).as_array().unwrap() {
        if snapshot["source"] == format!("setup of Environment {env}") {
            let out = runner_ctd(&["snapshot", "rm", snapshot["name"].as_str().unwrap()], &state);
            assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        }
    }
}

/// Issue 34 item 4: a WarmPool with `spec.snapshot` holds members started from that snapshot
/// (applied as a manifest, as users write it); a job that starts from the snapshot with the
/// pool's Environment's settings claims one and sees the snapshot's files, a job of the
/// Environment's own image is not served by it, and bad or unknown snapshots are refused with
/// their field.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_warm_pool_from_a_snapshot_serves_what_starts_from_it() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let s = server(dir.path());
    let snap = format!("poolsnap-{}", std::process::id());
    let id = create(&s, json!({"environment": {"image": "local/busybox:1.35"}}));
    let (code, v) = exec(&s, &id, &format!("echo {snap} > /etc/prepared && rm /bin/ls"));
    assert_eq!(code, 200, "{v}");
    let (code, v) = snapshot(&s, &id, json!({"name": snap}));
    assert_eq!(code, 201, "{v}");
    let (code, _) = s.call("DELETE", &format!("/v1/sessions/{id}"), None);
    assert_eq!(code, 204);

    let pool = format!("from-{}", std::process::id());
    let env_doc = |name: &str, image: &str| {
        format!(
            "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: {name}}}\nspec:\n  image: \"{image}\"\n  resources: {{memory: 96Mi}}\n"
        )
    };
    let pool_doc = |snapshot: &str| {
        format!(
            "{}---\napiVersion: runner/v1alpha1\nkind: WarmPool\nmetadata: {{name: {pool}}}\nspec:\n  environment: base\n  size: 1\n  snapshot: {snapshot}\n",
            env_doc("base", "local/busybox:1.35")
        )
    };
    // A name that cannot be a snapshot's: the field and its line.
    let bad = write_manifest(dir.path(), "bad-pool.yaml", &pool_doc("Not/A/Name"));
    let out = runner_ctd(&["apply", "-f", bad.to_str().unwrap()], &state);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0));
    assert!(err.contains("spec.snapshot") && err.contains(":14:13:"), "{err}");
    // A snapshot that does not exist: refused, saying so, and no pool is left.
    let missing = write_manifest(dir.path(), "missing-pool.yaml", &pool_doc("no-such-snapshot"));
    let out = runner_ctd(&["apply", "-f", missing.to_str().unwrap()], &state);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0));
    assert!(err.contains("no snapshot \"no-such-snapshot\""), "{err}");
    let out = runner_ctd(&["pool", "ls", "-o", "json"], &state);
    assert_eq!(json_of(&out), json!([]), "a refused pool is not kept");

    let file = write_manifest(dir.path(), "pool.yaml", &pool_doc(&snap));
    let out = runner_ctd(&["apply", "-f", file.to_str().unwrap()], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let _pool = PoolGuard(&state, &pool);
    let out = runner_ctd(&["pool", "ls", "-o", "json"], &state);
    let listed = json_of(&out);
    assert_eq!(listed[0]["snapshot"], snap.as_str(), "{listed}");
    assert_eq!(listed[0]["ready"], 1, "{listed}");
    let out = runner_ctd(&["pool", "ls", "-o", "wide"], &state);
    assert!(String::from_utf8_lossy(&out.stdout).contains(&snap));

    // A job of an Environment on the snapshot, with the pool Environment's settings: a member.
    let job = |name: &str, env: &str, image: &str| {
        write_manifest(
            dir.path(),
            &format!("{name}.yaml"),
            &format!(
                "{}---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {name}}}\nspec:\n  environment: {env}\n  command: \"cat /etc/prepared 2>&1; ls /bin/ls 2>&1 | grep -c 'No such'; true\"\n",
                env_doc(env, image)
            ),
        )
    };
    let result = |file: &PathBuf| job_result(&state, file);
    let r = result(&job("on-snap", "prepared", &format!("snapshot:{snap}")));
    assert_eq!(
        r["pool"],
        pool.as_str(),
        "a member of the snapshot's pool served it: {r}"
    );
    assert_eq!(r["stdout"], format!("{snap}\n1\n"), "{r}");
    // The Environment's own image is not what the pool holds: a cold start, the base's files.
    let r = result(&job("on-base", "base", "local/busybox:1.35"));
    assert!(r.get("pool").is_none(), "{r}");
    assert!(
        r["coldStart"]
            .as_str()
            .unwrap()
            .contains(&format!("starts from snapshot {snap}")),
        "{r}"
    );
    assert!(r["stdout"].as_str().unwrap().contains("No such file"), "{r}");
    // The pool refilled from the snapshot.
    assert!(eventually(Duration::from_secs(30), || {
        let out = runner_ctd(&["pool", "ls", "-o", "json"], &state);
        json_of(&out)[0]["ready"] == 1
    }));
    let r = result(&job("on-snap-again", "prepared", &format!("snapshot:{snap}")));
    assert_eq!(r["pool"], pool.as_str(), "{r}");
    drop(_pool);
    let (code, _) = s.call("DELETE", &format!("/v1/snapshots/{snap}"), None);
    assert_eq!(code, 204);
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_snapshot_with_its_workspace_gives_it_to_what_starts_from_it() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let s = server(dir.path());
    let snap = format!("wssnap-{}", std::process::id());
    let id = create(&s, json!({"environment": {"image": "local/busybox:1.35"}}));
    let (code, v) = exec(
        &s,
        &id,
        "mkdir -p proj/sub && echo built > proj/sub/out && echo snapshot > conflict && ln -s proj/sub/out link \
         && echo changed > /etc/rootfs-change && mkfifo pipe && pwd",
    );
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["stdout"], "/workspace\n", "{v}");
    let (code, v) = snapshot(&s, &id, json!({"name": snap, "workspace": true}));
    assert_eq!(code, 201, "{v}");
    assert_eq!(v["workspace"], "/workspace", "{v}");
    // The workspace, its two directories above the files, the files, the link; no FIFO.
    assert_eq!(v["workspaceEntries"], 6, "{v}");
    let (code, v) = s.call("GET", "/v1/snapshots", None);
    assert_eq!(code, 200, "{v}");
    let listed = v
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["name"] == snap.as_str())
        .cloned();
    assert_eq!(listed.unwrap()["workspace"], "/workspace", "{v}");
    // A whole image: `ctr` sees the workspace's files in it.
    let (address, namespace) = containerd_env();
    let out = Command::new("ctr")
        .args(["--address", address.to_str().unwrap(), "--namespace", &namespace])
        .args(["images", "check", &format!("name==snapshot:{snap}")])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("complete"), "{out:?}");

    // A Job with a workspace of its own: the snapshot's files where it has none of that
    // name, its own where it has; nothing through the link it planted to a host directory.
    let ws = dir.path().join("job-ws");
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(ws.join("conflict"), "job's own\n").unwrap();
    std::fs::write(ws.join("mine"), "mine\n").unwrap();
    let job = |name: &str, extra: &str, workspace: Option<&std::path::Path>| {
        let workspace = workspace.map_or(String::new(), |w| format!("  workspace: {}\n", w.display()));
        write_manifest(
            dir.path(),
            &format!("{name}.yaml"),
            &format!(
                "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: {name}-env}}\nspec:\n  image: \"snapshot:{snap}\"\n  resources: {{memory: 96Mi}}\n{extra}\
                 ---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {name}}}\nspec:\n  environment: {name}-env\n{workspace}  command: \"cat /workspace/proj/sub/out /workspace/conflict; cat /workspace/mine 2>&1 | grep -c 'No such'; readlink /workspace/link; cat /etc/rootfs-change; \
                 test \\\"$(stat -c %u /workspace/proj/sub/out)\\\" = \\\"$(id -u)\\\" && echo owned\"\n"
            ),
        )
    };
    let result = |file: &PathBuf| job_result(&state, file);
    let r = result(&job("ws-own", "", Some(&ws)));
    assert_eq!(
        r["stdout"], "built\njob's own\n0\nproj/sub/out\nchanged\nowned\n",
        "{r}"
    );
    assert_eq!(std::fs::read_to_string(ws.join("conflict")).unwrap(), "job's own\n");
    assert_eq!(std::fs::read_to_string(ws.join("proj/sub/out")).unwrap(), "built\n");

    let planted = dir.path().join("planted-ws");
    std::fs::create_dir_all(&planted).unwrap();
    std::os::unix::fs::symlink(&outside, planted.join("proj")).unwrap();
    let file = job("ws-planted", "", Some(&planted));
    let out = runner_ctd(
        &["apply", "--replace", "-f", file.to_str().unwrap(), "-o", "json"],
        &state,
    );
    let r = json_of(&out)["status"]["result"].clone();
    assert_eq!(r["exitCode"], 1, "proj is the job's own link, left as it is: {r}");
    assert_eq!(r["stdout"], "snapshot\n1\nproj/sub/out\nchanged\n", "{r}");
    assert_eq!(
        std::fs::read_dir(&outside).unwrap().count(),
        0,
        "nothing went through the link"
    );
    assert!(std::fs::symlink_metadata(planted.join("proj")).unwrap().is_symlink());

    // Without a workspace mounted there, the image has them at that path.
    let r = result(&job("ws-unmounted", "  mountWorkspace: false\n", None));
    assert_eq!(r["stdout"], "built\nsnapshot\n1\nproj/sub/out\nchanged\nowned\n", "{r}");

    // A session from it gets them in its scratch workspace.
    let other = create(&s, json!({"environment": {"image": format!("snapshot:{snap}")}}));
    let (code, v) = exec(&s, &other, "cat proj/sub/out conflict");
    assert_eq!((code, v["stdout"].as_str()), (200, Some("built\nsnapshot\n")), "{v}");
    // A snapshot of that session without its workspace holds none to give: a job with a
    // workspace sees only its own.
    let plain = format!("{snap}-plain");
    let (code, v) = snapshot(&s, &other, json!({"name": plain}));
    assert_eq!(code, 201, "{v}");
    assert!(v.get("workspace").is_none(), "{v}");
    let empty = dir.path().join("empty-ws");
    std::fs::create_dir_all(&empty).unwrap();
    let file = job_manifest(
        dir.path(),
        "on-plain",
        &format!("snapshot:{plain}"),
        "ls /workspace | wc -l; cat /etc/rootfs-change",
    );
    let text = std::fs::read_to_string(&file).unwrap() + &format!("  workspace: {}\n", empty.display());
    std::fs::write(&file, text).unwrap();
    assert_eq!(run_job(&state, &file), "0\nchanged\n");

    // A warm pool of the snapshot: the member that serves a job gives its workspace the files.
    let pool = format!("wspool-{}", std::process::id());
    let pool_file = write_manifest(
        dir.path(),
        "ws-pool.yaml",
        &format!(
            "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: ws-pooled-env}}\nspec:\n  image: \"snapshot:{snap}\"\n  resources: {{memory: 96Mi}}\n\
             ---\napiVersion: runner/v1alpha1\nkind: WarmPool\nmetadata: {{name: {pool}}}\nspec: {{environment: ws-pooled-env, size: 1}}\n"
        ),
    );
    let out = runner_ctd(&["apply", "-f", pool_file.to_str().unwrap()], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let _pool = PoolGuard(&state, &pool);
    let pooled_ws = dir.path().join("pooled-ws");
    std::fs::create_dir_all(&pooled_ws).unwrap();
    let r = result(&job("ws-pooled", "", Some(&pooled_ws)));
    assert_eq!(r["pool"], pool.as_str(), "a member served it: {r}");
    assert_eq!(r["stdout"], "built\nsnapshot\n1\nproj/sub/out\nchanged\nowned\n", "{r}");
    // A Job a member is serving is snapshotted with its workspace too: the claim labels the
    // member with where its workspace is.
    assert!(eventually(Duration::from_secs(30), || {
        json_of(&runner_ctd(&["pool", "ls", "-o", "json"], &state))[0]["ready"] == 1
    }));
    let live_ws = dir.path().join("live-ws");
    std::fs::create_dir_all(&live_ws).unwrap();
    let live = write_manifest(
        dir.path(),
        "ws-live.yaml",
        &format!(
            "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: ws-pooled-env}}\nspec:\n  image: \"snapshot:{snap}\"\n  resources: {{memory: 96Mi}}\n\
             ---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: ws-live}}\nspec:\n  environment: ws-pooled-env\n  workspace: {}\n  command: \"echo from-member > live; sleep 60\"\n",
            live_ws.display()
        ),
    );
    let out = runner_ctd(&["apply", "-f", live.to_str().unwrap(), "--detach"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let member = format!("pool-{pool}-");
    assert!(
        eventually(Duration::from_secs(30), || live_ws.join("live").exists()
            && containers_where("labels.\"runner.dev/job\"==ws-live")
                .iter()
                .any(|id| id.starts_with(&member))),
        "a member of {pool} runs ws-live"
    );
    let live_snap = format!("{snap}-live");
    let out = runner_ctd(
        &["snapshot", "create", "ws-live", &live_snap, "--workspace", "-o", "json"],
        &state,
    );
    let made = json_of(&out);
    assert_eq!(out.status.code(), Some(0), "{made}");
    assert_eq!(made["workspace"], "/workspace", "{made}");
    // Its files, the snapshot's it was given and its own, are the new snapshot's workspace.
    assert!(made["workspaceEntries"].as_u64().unwrap() >= 7, "{made}");
    let out = runner_ctd(&["delete", "job", "ws-live"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    drop(_pool);

    for session in [&id, &other] {
        let (code, _) = s.call("DELETE", &format!("/v1/sessions/{session}"), None);
        assert_eq!(code, 204);
    }
    for name in [&snap, &plain, &live_snap] {
        let (code, _) = s.call("DELETE", &format!("/v1/snapshots/{name}"), None);
        assert_eq!(code, 204);
    }
}
