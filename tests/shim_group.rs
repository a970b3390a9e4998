//! `runner serve --sessions-per-shim N` (issue 36, item 5; docs/guide/capacity.md): live
//! sessions of one Environment share a containerd shim, N at most, through the HTTP API as
//! users run it, against the private containerd of scripts/test.sh. Which shim supervises a
//! session is read from the host: the parent of its container's init.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;

const BUSYBOX: &str = r#"{"environment": {"image": "local/busybox:1.35"}}"#;
/// Another Environment on the same image: never in a group with the first.
const BUSYBOX_OTHER: &str = r#"{"environment": {"image": "local/busybox:1.35", "env": {"OTHER": "1"}}}"#;

struct Server {
    served: Served,
    _dir: tempfile::TempDir,
}

fn server(args: &[&str]) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    let served = serve_with_args(runner_ctd_command(&[], &state), dir.path(), args);
    Server { served, _dir: dir }
}

impl Server {
    fn create(&self, body: &str) -> String {
        let (code, body) = self.served.call("POST", "/v1/sessions", Some(body));
        assert_eq!(code, 201, "{body}");
        body["id"].as_str().unwrap().to_string()
    }

    /// (status, body) of `echo WORD` through the session's stateful shell.
    fn echo(&self, id: &str, word: &str) -> (u16, serde_json::Value) {
        let body = serde_json::json!({"command": format!("echo {word}")}).to_string();
        self.served
            .call("POST", &format!("/v1/sessions/{id}/shell"), Some(&body))
    }

    fn answers(&self, id: &str, word: &str) {
        let (code, body) = self.echo(id, word);
        assert_eq!(code, 200, "{id}: {body}");
        assert_eq!(body["exitCode"], 0, "{id}: {body}");
        assert!(
            body["output"].as_str().unwrap_or_default().contains(word),
            "{id}: {body}"
        );
    }

    fn delete(&self, id: &str) {
        let (code, body) = self.served.call("DELETE", &format!("/v1/sessions/{id}"), None);
        assert_eq!(code, 204, "{id}: {body}");
    }
}

/// The shim process supervising session `id`: the parent of its container's init.
fn shim_of(id: &str) -> u32 {
    let containers = containers_where(&format!("labels.\"runner.dev/job\"=={id}"));
    assert_eq!(containers.len(), 1, "{id}: {containers:?}");
    let init = task_pids()
        .remove(&containers[0])
        .unwrap_or_else(|| panic!("no task for {}", containers[0]));
    let shim = stat_field(init, 1).unwrap_or_else(|| panic!("no process {init}")) as u32;
    let argv0 = std::fs::read(format!("/proc/{shim}/cmdline")).unwrap();
    let argv0 = String::from_utf8_lossy(argv0.split(|b| *b == 0).next().unwrap()).into_owned();
    assert!(
        argv0.ends_with("containerd-shim-runc-v2"),
        "the parent of {id}'s init ({init}) is {shim}, {argv0}"
    );
    shim
}

/// Container id → the host pid of its task's init (`ctr tasks ls`).
fn task_pids() -> HashMap<String, u32> {
    let (address, namespace) = containerd_env();
    let out = std::process::Command::new("ctr")
        .args([
            "--address",
            address.to_str().unwrap(),
            "--namespace",
            &namespace,
            "tasks",
            "ls",
        ])
        .output()
        .expect("run ctr");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            Some((f.next()?.to_string(), f.next()?.parse().ok()?))
        })
        .collect()
}

/// Processes whose parent is `shim` (the inits it supervises).
fn children_of(shim: u32) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|pid| stat_field(*pid, 1) == Some(i64::from(shim)))
        .count()
}

#[test]
#[ignore = "needs the containerd of scripts/test.sh"]
fn sessions_of_one_environment_share_a_shim_and_a_dead_shim_ends_its_group_honestly() {
    let s = server(&["--sessions-per-shim", "3"]);
    let ids: Vec<String> = (0..4).map(|_| s.create(BUSYBOX)).collect();
    let shims: Vec<u32> = ids.iter().map(|id| shim_of(id)).collect();
    // Three to a shim, the fourth in a group of its own.
    assert_eq!(shims[0], shims[1], "{shims:?}");
    assert_eq!(shims[0], shims[2], "{shims:?}");
    assert_ne!(shims[0], shims[3], "{shims:?}");
    assert_eq!(children_of(shims[0]), 3, "the shared shim supervises the three inits");
    // Another Environment never joins them, though both groups have room.
    let other = s.create(BUSYBOX_OTHER);
    let other_shim = shim_of(&other);
    assert!(!shims.contains(&other_shim), "{other_shim} in {shims:?}");
    for (i, id) in ids.iter().enumerate() {
        s.answers(id, &format!("hello-{i}"));
    }
    // The group's first member goes (its bundle was the shim's working directory): the
    // others keep working, and a new session takes the free place.
    s.delete(&ids[0]);
    s.answers(&ids[1], "after-delete-1");
    s.answers(&ids[2], "after-delete-2");
    let joined = s.create(BUSYBOX);
    assert_eq!(shim_of(&joined), shims[0], "the fuller group with room is filled first");
    s.answers(&joined, "joined");
    // SIGKILL to the shared shim: every session of its group ends with an error, soon; the
    // other group and the other Environment's session go on.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(shims[0] as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    for id in [&ids[1], &ids[2], &joined] {
        let t0 = Instant::now();
        let failed = eventually(Duration::from_secs(60), || {
            let (code, body) = s.echo(id, "after-kill");
            code >= 400 || body["exitCode"] != 0
        });
        assert!(failed, "{id} still answers after its shim was killed");
        let (code, body) = s.echo(id, "after-kill");
        assert_eq!(code, 409, "{id}: {body}");
        assert!(
            body.to_string().contains("the sandbox ended") && body.to_string().contains("shim"),
            "{id}: {body}"
        );
        assert!(t0.elapsed() < Duration::from_secs(60), "{id}: took {:?}", t0.elapsed());
        // What the session is, as a GET says: ended, not running.
        let (code, view) = s.served.call("GET", &format!("/v1/sessions/{id}"), None);
        assert_eq!((code, view["state"].as_str()), (200, Some("ended")), "{id}: {view}");
    }
    s.answers(&ids[3], "other-group");
    s.answers(&other, "other-env");
    // New sessions still work, in a new shim.
    let fresh = s.create(BUSYBOX);
    assert_ne!(shim_of(&fresh), shims[0]);
    s.answers(&fresh, "fresh");
    // Every session can be deleted, the dead ones too, and nothing of them stays.
    for id in [&ids[1], &ids[2], &joined, &ids[3], &other, &fresh] {
        s.delete(id);
        assert_eq!(containers_of(id), 0, "{id}");
    }
}

#[test]
#[ignore = "needs the containerd of scripts/test.sh"]
fn without_the_option_each_session_has_its_own_shim() {
    let s = server(&[]);
    let ids: Vec<String> = (0..2).map(|_| s.create(BUSYBOX)).collect();
    assert_ne!(shim_of(&ids[0]), shim_of(&ids[1]));
    for id in &ids {
        s.delete(id);
    }
    // The option's bounds are the command line's.
    refuses_out_of_bounds("--sessions-per-shim", &["0", "257", "x"]);
}

/// `runner serve OPTION VALUE` exits 2 naming the option, for each of `values`.
fn refuses_out_of_bounds(option: &str, values: &[&str]) {
    for bad in values {
        let out = runner_ctd_command(
            &["serve", "--token-file", "/nonexistent", option, bad],
            std::path::Path::new("/tmp"),
        )
        .output()
        .unwrap();
        assert_eq!(out.status.code(), Some(2), "{option} {bad}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(option),
            "{option} {bad}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Creates and deletes at once, 4 to a shim: no shim ever supervises more than 4 inits, and
/// every session answers (a joiner never lands on a shim that its group's last delete shut
/// down). A group takes joiners once its first task exists: creates that all start before
/// any exists found groups of their own (later ones fill them), so one session comes first.
#[test]
#[ignore = "needs the containerd of scripts/test.sh"]
fn concurrent_creates_and_deletes_keep_groups_within_their_size() {
    let s = std::sync::Arc::new(server(&["--sessions-per-shim", "4"]));
    let create_many = |n: usize| -> Vec<String> {
        let handles: Vec<_> = (0..n)
            .map(|_| {
                let s = s.clone();
                std::thread::spawn(move || s.create(BUSYBOX))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    };
    let mut first = vec![s.create(BUSYBOX)];
    first.extend(create_many(9));
    let check = |ids: &[String]| {
        let mut per_shim: HashMap<u32, usize> = HashMap::new();
        for id in ids {
            *per_shim.entry(shim_of(id)).or_default() += 1;
        }
        for (shim, n) in &per_shim {
            assert!(*n <= 4, "shim {shim} supervises {n}: {per_shim:?}");
            assert_eq!(children_of(*shim), *n, "shim {shim}");
        }
        per_shim.len()
    };
    let shims = check(&first);
    // A burst founds a group per 4, not per create: the creates that find a group of their
    // Environment being founded wait for its first task and join it.
    assert_eq!(shims, 3, "10 sessions in groups of 4");
    // Half of them go while as many come; the one that founded the first group among them.
    let (leaving, staying) = first.split_at(5);
    let deleters: Vec<_> = leaving
        .iter()
        .cloned()
        .map(|id| {
            let s = s.clone();
            std::thread::spawn(move || s.delete(&id))
        })
        .collect();
    let second = create_many(5);
    for d in deleters {
        d.join().unwrap();
    }
    let live: Vec<String> = staying.iter().cloned().chain(second).collect();
    check(&live);
    for (i, id) in live.iter().enumerate() {
        s.answers(id, &format!("live-{i}"));
    }
    for id in &live {
        s.delete(id);
        assert_eq!(containers_of(id), 0, "{id}");
    }
}

/// A session that shares its shim is checkpointed, forked and restored as one with a shim of
/// its own: CRIU dumps its container alone (runc, not the shim, does the work), the group's
/// other session goes on, and what starts from the checkpoint is a sandbox of its own.
#[test]
#[ignore = "needs the containerd of scripts/test.sh (and CRIU, scripts/criu.sh)"]
fn a_session_sharing_its_shim_is_checkpointed_forked_and_restored() {
    let s = server(&["--sessions-per-shim", "3"]);
    let (source, neighbour) = (s.create(BUSYBOX), s.create(BUSYBOX));
    let shim = shim_of(&source);
    assert_eq!(shim_of(&neighbour), shim, "the two sessions share a shim");
    let shell = |id: &str, command: &str| -> String {
        let body = serde_json::json!({"command": command, "timeoutSeconds": 20}).to_string();
        let (code, v) = s.served.call("POST", &format!("/v1/sessions/{id}/shell"), Some(&body));
        assert_eq!(code, 200, "{id}: {v}");
        assert_eq!(v["exitCode"], 0, "{id}: {command}: {v}");
        v["output"].as_str().unwrap().to_string()
    };
    shell(&source, "export X=grouped; cd /tmp; echo data >/tmp/f");
    shell(&neighbour, "export Y=neighbour");

    let (code, v) = s
        .served
        .call("POST", &format!("/v1/sessions/{source}/fork"), Some(r#"{"count": 1}"#));
    assert_eq!(code, 201, "{v}");
    let fork = v["sessions"][0]["id"].as_str().unwrap().to_string();
    // Long enough for a shell that saw EOF at its restore to be gone.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(shell(&fork, "echo $X; pwd; cat /tmp/f"), "grouped\n/tmp\ndata\n");
    assert_eq!(shell(&source, "echo $X; pwd"), "grouped\n/tmp\n");
    assert_eq!(shell(&neighbour, "echo $Y"), "neighbour\n");

    let (code, v) = s.served.call(
        "POST",
        &format!("/v1/sessions/{source}/checkpoint"),
        Some(r#"{"name": "grouped"}"#),
    );
    assert_eq!(code, 201, "{v}");
    s.delete(&source);
    // The group's other session keeps its shim and its state.
    assert_eq!(shim_of(&neighbour), shim);
    assert_eq!(shell(&neighbour, "echo $Y"), "neighbour\n");
    let (code, v) = s
        .served
        .call("POST", "/v1/sessions", Some(r#"{"fromCheckpoint": "grouped"}"#));
    assert_eq!(code, 201, "{v}");
    let restored = v["id"].as_str().unwrap().to_string();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(shell(&restored, "echo $X; pwd; cat /tmp/f"), "grouped\n/tmp\ndata\n");
    assert_ne!(shim_of(&restored), shim, "a restore has a shim of its own");
    for id in [&fork, &restored, &neighbour] {
        s.delete(id);
    }
    let (code, _) = s.served.call("DELETE", "/v1/checkpoints/grouped", None);
    assert_eq!(code, 204);
}

/// The containers of the warm shims (seeds) of the server whose state dir is `state`, with
/// a task or not.
fn seed_containers(state: &std::path::Path) -> Vec<String> {
    let state = std::fs::canonicalize(state).unwrap();
    containers_where(&format!(
        "labels.\"runner.dev/kind\"==shim-seed,labels.\"runner.dev/state-dir\"==\"{}\"",
        state.display()
    ))
}

/// The warm shims (seeds) of the server whose state dir is `state`: container id → the shim
/// its created task runs under.
fn seeds_of(state: &std::path::Path) -> HashMap<String, u32> {
    let tasks = task_pids();
    seed_containers(state)
        .into_iter()
        .filter_map(|id| {
            let init = *tasks.get(&id)?;
            let shim = stat_field(init, 1)? as u32;
            Some((id, shim))
        })
        .collect()
}

/// `runner serve --warm-shims` (default 1; issue 36, item 3): the server keeps a container
/// whose task is created and never started, so its shim runs; a cold session is handed to
/// that shim and the seed goes; a new seed is made once the server is quiet; each session
/// still has a shim of its own, which ends with it; the server's stop deletes its seed, and
/// `runner gc` deletes the seed of a server that died.
#[test]
#[ignore = "needs the containerd of scripts/test.sh"]
fn a_cold_session_takes_the_warm_shim_and_a_new_one_is_made() {
    let s = server(&[]);
    let state = s._dir.path().join("state");
    let mut seeds = HashMap::new();
    assert!(
        eventually(Duration::from_secs(20), || {
            seeds = seeds_of(&state);
            seeds.len() == 1
        }),
        "no warm shim: {seeds:?}"
    );
    let (seed, warm) = seeds.into_iter().next().unwrap();
    let a = s.create(BUSYBOX);
    assert_eq!(shim_of(&a), warm, "the cold session runs under the warm shim");
    assert!(
        eventually(Duration::from_secs(20), || containers_where(&format!("id=={seed}"))
            .is_empty()),
        "the spent seed {seed} is still there"
    );
    s.answers(&a, "warm");
    // A new seed, with a shim of its own, once the server is quiet.
    let mut next = HashMap::new();
    assert!(
        eventually(Duration::from_secs(20), || {
            next = seeds_of(&state);
            next.len() == 1
        }),
        "no new warm shim: {next:?}"
    );
    let (next_seed, next_warm) = next.into_iter().next().unwrap();
    assert_ne!(next_seed, seed);
    assert_ne!(next_warm, warm);
    let b = s.create(BUSYBOX);
    assert_eq!(shim_of(&b), next_warm);
    assert_eq!(children_of(warm), 1, "a's shim supervises a's init alone");
    s.answers(&b, "warm-again");
    // A session's shim ends with it, as a shim of its own does.
    s.delete(&a);
    assert!(
        eventually(Duration::from_secs(20), || exited(warm)),
        "a's shim {warm} outlived a"
    );
    s.answers(&b, "still");
    s.delete(&b);
    // The server's stop deletes its seeds (the one ready, and b's if it is not gone yet)
    // and their shims.
    let mut last = None;
    assert!(eventually(Duration::from_secs(20), || {
        last = seeds_of(&state).into_iter().find(|(id, _)| *id != next_seed);
        last.is_some()
    }));
    let (_, last_warm) = last.unwrap();
    drop(s.served);
    assert!(seed_containers(&state).is_empty(), "a stopped server left its seed");
    assert!(eventually(Duration::from_secs(20), || exited(last_warm)));

    // A server killed outright leaves its seed to `runner gc`.
    let mut t = server(&[]);
    let state = t._dir.path().join("state");
    assert!(eventually(Duration::from_secs(20), || seeds_of(&state).len() == 1));
    let (seed, warm) = seeds_of(&state).into_iter().next().unwrap();
    t.served.child.kill().unwrap();
    t.served.child.wait().unwrap();
    let gc = runner_ctd(&["gc"], &state);
    assert!(gc.status.success(), "{}", String::from_utf8_lossy(&gc.stderr));
    assert!(
        String::from_utf8_lossy(&gc.stdout).contains(&format!("warm-shim/{seed}: the seed of a server that died")),
        "{}",
        String::from_utf8_lossy(&gc.stdout)
    );
    assert!(containers_where(&format!("id=={seed}")).is_empty());
    assert!(eventually(Duration::from_secs(20), || exited(warm)));
}

/// `--warm-shims 0`: no seed; cold sessions start their own shims. The bounds are the
/// command line's.
#[test]
#[ignore = "needs the containerd of scripts/test.sh"]
fn without_warm_shims_no_seed_is_kept() {
    let s = server(&["--warm-shims", "0"]);
    let state = s._dir.path().join("state");
    let id = s.create(BUSYBOX);
    s.answers(&id, "cold");
    std::thread::sleep(Duration::from_millis(1500));
    assert!(seeds_of(&state).is_empty(), "{:?}", seeds_of(&state));
    s.delete(&id);
    refuses_out_of_bounds("--warm-shims", &["9", "x"]);
}
