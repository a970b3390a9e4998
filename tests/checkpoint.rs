//! Checkpoint, restore and fork of live sessions (CRIU) over `runner serve`, as users call
//! them, against the private containerd of scripts/test.sh and the CRIU scripts/criu.sh
//! installs: a fork has its source's shell and Python variables, files and running processes
//! and diverges after; a checkpoint restores after its source is gone; refusals are clean.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};

fn create(s: &Served) -> String {
    let body = json!({"environment": {"image": "local/python:3.11"}});
    let (code, v) = s.call("POST", "/v1/sessions", Some(&body.to_string()));
    assert_eq!(code, 201, "{v}");
    v["id"].as_str().unwrap().to_string()
}

fn shell(s: &Served, id: &str, command: &str) -> String {
    let (code, v) = s.call(
        "POST",
        &format!("/v1/sessions/{id}/shell"),
        Some(&json!({"command": command, "timeoutSeconds": 20}).to_string()),
    );
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["exitCode"], 0, "{command}: {v}");
    v["output"].as_str().unwrap().to_string()
}

fn python(s: &Served, id: &str, code: &str) -> Value {
    let (status, v) = s.call(
        "POST",
        &format!("/v1/sessions/{id}/python"),
        Some(&json!({"code": code}).to_string()),
    );
    assert_eq!(status, 200, "{v}");
    assert!(v["error"].is_null(), "{code}: {v}");
    v
}

/// The host id the session's root is (its user-namespace range's base).
fn range_base(s: &Served, id: &str) -> String {
    shell(s, id, "read -r _ base _ </proc/self/uid_map; echo $base")
        .trim()
        .to_string()
}

/// Lines the source's background loop has written so far, read twice apart: it runs.
fn ticks_grow(s: &Served, id: &str) {
    let count = |s: &Served| shell(s, id, "wc -l </tmp/ticks").trim().parse::<u64>().unwrap();
    let before = count(s);
    std::thread::sleep(Duration::from_millis(700));
    let after = count(s);
    assert!(
        after > before,
        "the background loop runs in {id}: {before} then {after}"
    );
}

/// A session with state in every place a fork must carry: shell variables and directory, a
/// background process, files in its rootfs and workspace, Python variables and 8 MiB of heap.
fn prepared(s: &Served) -> String {
    let id = create(s);
    shell(
        s,
        &id,
        "export X=source; greet() { echo hi $1; }; cd /tmp; echo data >/tmp/f; echo w >/workspace/w; \
         (while :; do echo t >>/tmp/ticks; sleep 0.1; done) >/dev/null 2>&1 &",
    );
    python(s, &id, "x = 42\nbig = bytearray(8 << 20)\nbig[-1] = 7");
    id
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_forked_session_has_the_source_state_and_diverges() {
    let served = serve_test_images();
    let s = &served.served;
    let source = prepared(s);
    let (code, v) = s.call(
        "POST",
        &format!("/v1/sessions/{source}/fork"),
        Some(&json!({"count": 2}).to_string()),
    );
    assert_eq!(code, 201, "{v}");
    let forks: Vec<String> = v["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(forks.len(), 2, "{v}");
    let base = range_base(s, &source);
    for id in &forks {
        assert_ne!(id, &source);
        assert_eq!(
            shell(s, id, "echo $X; pwd; greet you; cat /tmp/f /workspace/w"),
            "source\n/tmp\nhi you\ndata\nw\n",
            "fork {id}"
        );
        let v = python(s, id, "print(x, len(big), big[-1])");
        assert_eq!(v["output"], "42 8388608 7\n", "{v}");
        ticks_grow(s, id);
        // Its own sandbox: another user-namespace range than its source's.
        assert_ne!(range_base(s, id), base, "fork {id} shares its source's host ids");
    }
    // Each goes its own way.
    let (a, b) = (&forks[0], &forks[1]);
    shell(s, a, "export X=a; echo a >/tmp/only-a; echo a >/workspace/only-a");
    python(s, a, "x = 1");
    assert_eq!(
        shell(s, b, "echo $X; ls /tmp/only-a /workspace/only-a 2>&1 | wc -l"),
        "source\n2\n"
    );
    assert_eq!(python(s, b, "print(x)")["output"], "42\n");
    assert_eq!(shell(s, a, "echo $X; cat /tmp/only-a"), "a\na\n");
    assert_eq!(python(s, a, "print(x)")["output"], "1\n");
    // The source too, and it goes on after being forked.
    assert_eq!(shell(s, &source, "echo $X; ls /tmp/only-a 2>&1 | wc -l"), "source\n1\n");
    assert_eq!(python(s, &source, "print(x)")["output"], "42\n");
    ticks_grow(s, &source);
    // A fork's temporary checkpoint is gone.
    let (code, v) = s.call("GET", "/v1/checkpoints", None);
    assert_eq!((code, v.as_array().map(|a| a.len())), (200, Some(0)), "{v}");
    for id in forks.iter().chain([&source]) {
        let (code, _) = s.call("DELETE", &format!("/v1/sessions/{id}"), None);
        assert_eq!(code, 204);
    }
}

/// busybox's `sh` reads its shell's FIFO as a script file it opens read-only: a fork's shell
/// must find a writer on it from its restore on (the host holds one until the session adopts
/// it), or it sees EOF and exits, and the copy's state is lost.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_forked_busybox_shell_keeps_its_state() {
    let served = serve_test_images();
    let s = &served.served;
    let body = json!({"environment": {"image": "local/busybox:1.35"}});
    let (code, v) = s.call("POST", "/v1/sessions", Some(&body.to_string()));
    assert_eq!(code, 201, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    shell(s, &id, "export X=bb; cd /tmp");
    let (code, v) = s.call(
        "POST",
        &format!("/v1/sessions/{id}/fork"),
        Some(&json!({"count": 1}).to_string()),
    );
    assert_eq!(code, 201, "{v}");
    let fork = v["sessions"][0]["id"].as_str().unwrap().to_string();
    // Long enough for a shell that saw EOF at its restore to be gone.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(shell(s, &fork, "echo $X; pwd"), "bb\n/tmp\n");
    for id in [fork, id] {
        s.call("DELETE", &format!("/v1/sessions/{id}"), None);
    }
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_checkpoint_restores_after_its_source_is_gone() {
    let served = serve_test_images();
    let s = &served.served;
    let source = prepared(s);
    let path = format!("/v1/sessions/{source}/checkpoint");
    let (code, v) = s.call("POST", &path, Some(r#"{"name": "c-1"}"#));
    assert_eq!(code, 201, "{v}");
    assert_eq!(
        (v["name"].as_str(), v["source"].as_str()),
        (Some("c-1"), Some(source.as_str()))
    );
    // Its processes' memory is in it: more than the 8 MiB of heap.
    assert!(v["bytes"].as_u64().unwrap() > 8 << 20, "{v}");
    let (code, v) = s.call("POST", &path, Some(r#"{"name": "c-1"}"#));
    assert_eq!(code, 409, "{v}");
    let (code, v) = s.call("POST", &path, Some(r#"{"name": "c-1", "replace": true}"#));
    assert_eq!(code, 201, "{v}");
    let (code, v) = s.call("POST", &path, Some(r#"{"name": "Bad/Name"}"#));
    assert_eq!(code, 400, "{v}");
    assert!(v["error"].as_str().unwrap().starts_with("name:"), "{v}");
    let (code, v) = s.call("DELETE", &format!("/v1/sessions/{source}"), None);
    assert_eq!(code, 204, "{v}");

    let (code, v) = s.call("POST", "/v1/sessions", Some(r#"{"fromCheckpoint": "c-1"}"#));
    assert_eq!(code, 201, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    assert_eq!(
        shell(s, &id, "echo $X; pwd; cat /tmp/f /workspace/w"),
        "source\n/tmp\ndata\nw\n"
    );
    assert_eq!(python(s, &id, "print(x, len(big))")["output"], "42 8388608\n");
    ticks_grow(s, &id);
    // Twice from one checkpoint: two sessions.
    let (code, v) = s.call("POST", "/v1/sessions", Some(r#"{"fromCheckpoint": "c-1"}"#));
    assert_eq!(code, 201, "{v}");
    let second = v["id"].as_str().unwrap().to_string();
    assert_eq!(python(s, &second, "print(x)")["output"], "42\n");

    let (code, v) = s.call("GET", "/v1/checkpoints", None);
    assert_eq!(code, 200);
    assert_eq!(v.as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v[0]["name"], "c-1");
    // A restore names its checkpoint alone.
    let body = json!({"fromCheckpoint": "c-1", "environment": {"image": "local/python:3.11"}});
    let (code, v) = s.call("POST", "/v1/sessions", Some(&body.to_string()));
    assert_eq!(code, 400, "{v}");
    assert!(v["error"].as_str().unwrap().starts_with("environment:"), "{v}");
    let (code, _) = s.call("DELETE", "/v1/checkpoints/c-1", None);
    assert_eq!(code, 204);
    let (code, v) = s.call("POST", "/v1/sessions", Some(r#"{"fromCheckpoint": "c-1"}"#));
    assert_eq!(code, 404, "{v}");
    for id in [id, second] {
        s.call("DELETE", &format!("/v1/sessions/{id}"), None);
    }
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn what_cannot_be_checkpointed_is_refused_cleanly() {
    let served = serve_test_images();
    let s = &served.served;
    // Memory CRIU cannot read (memfd_secret): CRIU refuses, the answer says so in its words,
    // and the session goes on with its interpreter's state.
    let id = create(s);
    let v = python(
        s,
        &id,
        "import ctypes, mmap, os\nfd = ctypes.CDLL(None, use_errno=True).syscall(447, 0)\n\
         assert fd >= 0, 'memfd_secret is not available on this kernel'\n\
         os.ftruncate(fd, 4096)\nm = mmap.mmap(fd, 4096)\nm[0:5] = b'hello'",
    );
    assert!(v["error"].is_null(), "{v}");
    let began = std::time::Instant::now();
    let (code, v) = s.call(
        "POST",
        &format!("/v1/sessions/{id}/checkpoint"),
        Some(r#"{"name": "secret"}"#),
    );
    assert!((400..500).contains(&code), "{code} {v}");
    assert!(v["error"].as_str().unwrap().contains("CRIU refused"), "{v}");
    assert!(began.elapsed() < Duration::from_secs(60), "a refusal never hangs");
    assert_eq!(python(s, &id, "print(bytes(m[0:5]))")["output"], "b'hello'\n");
    assert_eq!(shell(s, &id, "echo alive"), "alive\n");
    let (code, v) = s.call("GET", "/v1/checkpoints", None);
    assert_eq!((code, v.as_array().map(|a| a.len())), (200, Some(0)), "{v}");
    // Bounds of a fork.
    for count in [0, 101] {
        let (code, v) = s.call(
            "POST",
            &format!("/v1/sessions/{id}/fork"),
            Some(&json!({"count": count}).to_string()),
        );
        assert_eq!(code, 400, "{v}");
        assert!(v["error"].as_str().unwrap().starts_with("count:"), "{v}");
    }
    s.call("DELETE", &format!("/v1/sessions/{id}"), None);

    // A session claimed from a warm pool (its workspace was mounted after its processes
    // started): refused with the reason and what to do.
    let pool = json!({"name": "ck", "environment": {"image": "local/python:3.11"}, "size": 1});
    let (code, v) = s.call("POST", "/v1/pools", Some(&pool.to_string()));
    assert_eq!(code, 201, "{v}");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while s.call("GET", "/v1/pools", None).1[0]["ready"] != 1 {
        assert!(std::time::Instant::now() < deadline, "the pool did not fill");
        std::thread::sleep(Duration::from_millis(200));
    }
    let id = create(s);
    let (_, v) = s.call("GET", &format!("/v1/sessions/{id}"), None);
    assert_eq!(v["pool"], "ck", "{v}");
    let (code, v) = s.call(
        "POST",
        &format!("/v1/sessions/{id}/checkpoint"),
        Some(r#"{"name": "pooled"}"#),
    );
    assert!((400..500).contains(&code), "{code} {v}");
    assert!(v["error"].as_str().unwrap().contains("\"pool\": false"), "{v}");
    s.call("DELETE", &format!("/v1/sessions/{id}"), None);
    // What the answer says to do: the same Environment with `"pool": false` gets a sandbox
    // of its own while the pool has a ready member, and that one checkpoints.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while s.call("GET", "/v1/pools", None).1[0]["ready"] != 1 {
        assert!(std::time::Instant::now() < deadline, "the pool did not refill");
        std::thread::sleep(Duration::from_millis(200));
    }
    let body = json!({"environment": {"image": "local/python:3.11"}, "pool": false});
    let (code, v) = s.call("POST", "/v1/sessions", Some(&body.to_string()));
    assert_eq!(code, 201, "{v}");
    assert!(v["pool"].is_null(), "{v}");
    let own = v["id"].as_str().unwrap().to_string();
    assert_eq!(
        s.call("GET", "/v1/pools", None).1[0]["ready"],
        1,
        "the member stayed ready"
    );
    let (code, v) = s.call(
        "POST",
        &format!("/v1/sessions/{own}/checkpoint"),
        Some(r#"{"name": "unpooled"}"#),
    );
    assert_eq!(code, 201, "{v}");
    s.call("DELETE", "/v1/checkpoints/unpooled", None);
    s.call("DELETE", &format!("/v1/sessions/{own}"), None);
    // `pool` is a new session's choice: a restore never claims.
    let (code, v) = s.call(
        "POST",
        "/v1/sessions",
        Some(r#"{"fromCheckpoint": "x", "pool": false}"#),
    );
    assert_eq!(code, 400, "{v}");
    assert!(v["error"].as_str().unwrap().starts_with("pool:"), "{v}");
    s.call("DELETE", "/v1/pools/ck", None);

    // Without CRIU on the server's PATH: a clear answer, at once.
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = runner_ctd_command(&[], &served.dir.path().join("state"));
    cmd.env("PATH", "/usr/bin:/bin");
    let bare = serve_with(cmd, dir.path());
    let id = create(&bare);
    let (code, v) = bare.call(
        "POST",
        &format!("/v1/sessions/{id}/checkpoint"),
        Some(r#"{"name": "none"}"#),
    );
    assert_eq!(code, 503, "{v}");
    assert!(v["error"].as_str().unwrap().contains("CRIU is not installed"), "{v}");
    bare.call("DELETE", &format!("/v1/sessions/{id}"), None);
}

/// The host walks what the sandbox wrote when it checkpoints it: an agent directory stuffed
/// past its bound is refused with the bound it broke, the sandbox is thawed and goes on,
/// nothing of the attempt is left, and another session answers its calls meanwhile. (A tree
/// deeper than the walker goes cannot be made: the storage watcher evicts a sandbox nesting
/// past 256 levels first.)
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_hostile_tree_is_refused_and_the_sandbox_and_its_neighbour_go_on() {
    let served = serve_test_images();
    let s = &served.served;
    let id = create(s);
    let bystander = create(s);
    let attempt = |name: &str| {
        std::thread::scope(|scope| {
            let ck = scope.spawn(|| {
                s.call(
                    "POST",
                    &format!("/v1/sessions/{id}/checkpoint"),
                    Some(&json!({ "name": name }).to_string()),
                )
            });
            // The neighbour's calls go on answering while the host walks the tree.
            let mut calls = 0;
            while !ck.is_finished() || calls == 0 {
                assert_eq!(shell(s, &bystander, "echo up"), "up\n");
                calls += 1;
            }
            ck.join().unwrap()
        })
    };
    // The agent directory (which the sandbox can write) past its 10,000 entries.
    shell(
        s,
        &id,
        "mkdir /.runner/junk && cd /.runner/junk && seq 10001 | xargs touch && cd / && echo ok",
    );
    let (code, v) = attempt("stuffed");
    assert!((400..500).contains(&code), "{code} {v}");
    assert!(v["error"].as_str().unwrap().contains("entries"), "{v}");
    // Thawed, and the same shell: its processes run.
    assert_eq!(shell(s, &id, "echo still here"), "still here\n");
    let (_, v) = s.call("GET", "/v1/checkpoints", None);
    assert_eq!(v.as_array().map(|a| a.len()), Some(0), "{v}");
    let left: Vec<_> = std::fs::read_dir(served.dir.path().join("state").join("checkpoints"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "the refused checkpoint left {left:?}");

    // Cleaned up, the same sandbox checkpoints.
    shell(s, &id, "rm -rf /.runner/junk");
    let (code, v) = attempt("clean");
    assert_eq!(code, 201, "{v}");
    s.call("DELETE", "/v1/checkpoints/clean", None);
    for session in [&id, &bystander] {
        s.call("DELETE", &format!("/v1/sessions/{session}"), None);
    }
}
