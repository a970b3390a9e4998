//! A pooled session's first answer (issue 36, item 1): pool members hold a shell started
//! before the claim, which a session adopts. These tests hold the adopted shell to a cold
//! session's (every piece of state a command can see, on bash and on busybox's sh), and check
//! that a shell that cannot be adopted — under an Environment's setup, in a one-shot job — is
//! gone before anything of the claimant runs.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

/// Two Environments (busybox's sh, the python image's bash) with what a claim binds late:
/// variables (one quoted awkwardly), a working directory that is the workspace, a user.
const ENVS: &str = "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: bb}\nspec:\n  image: local/busybox:1.35\n  workdir: /workspace\n  env: {FOO: \"it's a b\", HOME: /tmp}\n---\napiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: py}\nspec:\n  image: local/python:3.11\n  workdir: /workspace\n  user: \"1000:1000\"\n  env: {FOO: \"it's a b\", LANG: C.UTF-8, PYTHONDONTWRITEBYTECODE: \"1\"}\n---\napiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: py-setup}\nspec:\n  image: local/python:3.11\n  setup:\n    commands: [\"for p in /proc/[0-9]*; do tr '\\\\0' ' ' < $p/cmdline; echo; done > /tmp/setup-saw\"]\n";

/// Everything a shell command can see of the shell it runs in, with what differs between any
/// two shells (PIDs, the session's name, the shell's random nonce) left out or replaced.
const PROBE: &str = r#"echo "== export"; export -p
echo "== set"; set | grep -v -E '^(BASHPID|PPID|RANDOM|SRANDOM|EPOCHREALTIME|EPOCHSECONDS|SECONDS|_|BASH_COMMAND|LINENO|HISTCMD)='
echo "== seconds $((SECONDS < 2))"
echo "== options $-"; set -o
if [ -n "$BASH_VERSION" ]; then echo "== shopt"; shopt; echo "== history"; history | wc -l; fi
echo "== traps"; trap
echo "== aliases"; alias
echo "== ids"; id; umask; pwd; readlink /proc/$$/cwd; hostname
echo "== limits"; ulimit -a
echo "== init"; grep -E '^Sig(Ign|Cgt)' /proc/1/status
echo "== status"; grep -E '^(SigIgn|SigCgt|Cap|NoNewPrivs|Seccomp|Uid|Gid|Groups)' /proc/$$/status
echo "== fds"; ls /proc/$$/fd
echo "== oom"; cat /proc/$$/oom_score_adj
echo "== processes"; for p in /proc/[0-9]*; do cat $p/comm; done >/tmp/.procs; sort /tmp/.procs; rm /tmp/.procs
echo "== shared"; ls /.runner | grep -v '^req-'"#;

fn normalized(output: &str, session: &str) -> String {
    let mut text = output.replace(session, "SESSION");
    // The shell's nonce, in its EXIT trap.
    while let Some(i) = text.find("printf \"X") {
        let start = i + "printf \"X".len();
        let end = start + text[start..].find(|c: char| !c.is_ascii_digit()).unwrap_or(0);
        text.replace_range(start..end, "N");
        if end == start {
            break;
        }
    }
    text
}

/// A session's first shell answer to `PROBE`, and whether a pool served it.
fn probe(served: &Served, environment: &str) -> (String, bool) {
    let (status, session) = served.call(
        "POST",
        "/v1/sessions",
        Some(&format!(r#"{{"environment": "{environment}"}}"#)),
    );
    assert!((200..300).contains(&status), "{session}");
    let id = session["id"].as_str().unwrap().to_string();
    let body = serde_json::json!({"command": PROBE}).to_string();
    let (status, r) = served.call("POST", &format!("/v1/sessions/{id}/shell"), Some(&body));
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["exitCode"], 0, "{}", r["output"]);
    let (status, _) = served.call("DELETE", &format!("/v1/sessions/{id}"), None);
    assert_eq!(status, 204);
    (
        normalized(r["output"].as_str().unwrap(), &id),
        session["pool"].is_string(),
    )
}

fn import_images(state: &Path) {
    for image in ["busybox-oci.tar", "python-oci.tar"] {
        let out = runner_ctd(&["image", "import", image_dir().join(image).to_str().unwrap()], state);
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    }
}

fn ready(state: &Path, pools: usize) -> bool {
    let ls = json_of(&runner_ctd(&["pool", "ls", "-o", "json"], state));
    ls.as_array()
        .is_some_and(|a| a.len() == pools && a.iter().all(|p| p["ready"] == 1))
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn an_adopted_shell_is_a_cold_sessions_shell() {
    let (cold_dir, pool_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let envs = cold_dir.path().join("envs");
    std::fs::create_dir_all(&envs).unwrap();
    std::fs::write(envs.join("envs.yaml"), ENVS).unwrap();
    let envs = envs.to_str().unwrap();
    let (cold_state, pool_state) = (cold_dir.path().join("state"), pool_dir.path().join("state"));
    import_images(&cold_state);
    import_images(&pool_state);
    let cold = serve_with_args(
        runner_ctd_command(&[], &cold_state),
        cold_dir.path(),
        &["--env-dir", envs],
    );
    let pooled = serve_with_args(
        runner_ctd_command(&[], &pool_state),
        pool_dir.path(),
        &[
            "--env-dir",
            envs,
            "--pool",
            "bb=1",
            "--pool",
            "py=1",
            "--pool",
            "py-setup=1",
        ],
    );
    let pools = RemovePools(pool_state.clone(), &["bb", "py", "py-setup"]);
    assert!(
        eventually(Duration::from_secs(120), || ready(&pool_state, 3)),
        "the pools were not filled"
    );
    // The members' shells have been up a while: a new shell's SECONDS is 0.
    std::thread::sleep(Duration::from_secs(3));
    for env in ["bb", "py"] {
        let (from_pool, was_pooled) = probe(&pooled, env);
        let (from_cold, was_cold) = probe(&cold, env);
        assert!(was_pooled && !was_cold, "{env}: pooled {was_pooled}, cold {was_cold}");
        for seen in [
            "FOO=",
            "s a b'\n",
            "== seconds 1\n",
            "\n/workspace\n/workspace\n",
            "sh-default.in",
        ] {
            assert!(from_pool.contains(seen), "{env}: {seen:?} in {from_pool}");
        }
        assert!(from_pool.contains("bash") == (env == "py"), "{from_pool}");
        if from_pool != from_cold {
            let diff: Vec<String> = from_pool
                .lines()
                .zip(from_cold.lines())
                .filter(|(p, c)| p != c)
                .map(|(p, c)| format!("pooled: {p}\ncold:   {c}"))
                .collect();
            panic!(
                "{env}: the adopted shell differs from a cold session's:\n{}\n\nwhole pooled:\n{from_pool}",
                diff.join("\n")
            );
        }
    }
    // With setup at the claim, the member's shell is gone before setup runs; the session's
    // shell is started after it, as a cold one's.
    let (status, session) = pooled.call("POST", "/v1/sessions", Some(r#"{"environment": "py-setup"}"#));
    assert!((200..300).contains(&status), "{session}");
    assert_eq!(session["pool"], "py-setup");
    let id = session["id"].as_str().unwrap();
    let (_, r) = pooled.call(
        "POST",
        &format!("/v1/sessions/{id}/shell"),
        Some(r#"{"command": "cat /tmp/setup-saw; echo $BASH_VERSION"}"#),
    );
    let out = r["output"].as_str().unwrap();
    assert!(!out.contains("sh-default"), "setup saw the member's shell: {out}");
    assert!(out.lines().last().is_some_and(|l| l.starts_with('5')), "{out}");
    pooled.call("DELETE", &format!("/v1/sessions/{id}"), None);
    // Refilled (a filler still at work when the pools go would leave its member behind).
    assert!(
        eventually(Duration::from_secs(120), || ready(&pool_state, 3)),
        "the pools were not refilled"
    );
    drop(pooled);
    drop(pools);
    assert_eq!(
        json_of(&runner_ctd(&["pool", "ls", "-o", "json"], &pool_state)),
        serde_json::json!([])
    );
}

/// `runner serve` of state dir `state` (images imported), keeping pool `pool[0]` of `size`
/// members of a busybox Environment of that name from its env dir in `dir`; returned once the
/// pool is full, with what removes it.
fn serve_busybox_pool(dir: &Path, state: &Path, pool: &'static [&'static str], size: usize) -> (Served, RemovePools) {
    import_images(state);
    let envs = dir.join("envs");
    std::fs::create_dir_all(&envs).unwrap();
    let name = pool[0];
    let env = format!(
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: {name}}}\nspec:\n  image: local/busybox:1.35\n"
    );
    std::fs::write(envs.join(format!("{name}.yaml")), env).unwrap();
    let served = serve_with_args(
        runner_ctd_command(&[], state),
        dir,
        &["--env-dir", envs.to_str().unwrap(), "--pool", &format!("{name}={size}")],
    );
    let pools = RemovePools(state.to_path_buf(), pool);
    let full = || json_of(&runner_ctd(&["pool", "ls", "-o", "json"], state))[0]["ready"] == size;
    assert!(eventually(Duration::from_secs(180), full), "the pool was not filled");
    (served, pools)
}

/// Removes a test's pools, the test passed or not (members outlive every runner).
struct RemovePools(std::path::PathBuf, &'static [&'static str]);

impl Drop for RemovePools {
    fn drop(&mut self) {
        let out = runner_ctd(&[&["pool", "rm"], self.1].concat(), &self.0);
        if !std::thread::panicking() {
            assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        }
    }
}

/// The PID in its sandbox of host process `pid`.
fn ns_pid(pid: i32) -> Option<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// The shell of pool `pool`'s one member: its host PID and its PID in the sandbox.
fn member_shell(pool: &str) -> (i32, i32) {
    let members = containers_where(&format!("labels.\"runner.dev/pool\"=={pool}"));
    assert_eq!(members.len(), 1, "{members:?}");
    let (_, namespace) = containerd_env();
    let cgroup = format!("/runner/{namespace}/{}", members[0]);
    // The member's processes but its init (PID 1 in the sandbox): its shell alone.
    let shells: Vec<(i32, i32)> = runner::runtime::cgroupfs::procs(&cgroup)
        .into_iter()
        .filter_map(|pid| Some((pid, ns_pid(pid)?)))
        .filter(|&(_, ns)| ns != 1)
        .collect();
    assert_eq!(shells.len(), 1, "the member's processes but its init: {shells:?}");
    shells[0]
}

/// A session of Environment `pool`, served by its pool: its id.
fn pooled_session(served: &Served, pool: &str) -> String {
    let body = format!(r#"{{"environment": "{pool}"}}"#);
    let (status, session) = served.call("POST", "/v1/sessions", Some(&body));
    assert_eq!(status, 201, "{session}");
    assert_eq!(session["pool"], pool, "{session}");
    session["id"].as_str().unwrap().to_string()
}

/// A member's shell that died before the claim does not answer its hello, which the
/// session's first call finds after sending its command behind it (nothing of the command
/// can have run there): the command runs in a new shell, whose state later calls keep, and
/// the answer says nothing of it (no state was lost: the session had none yet).
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_member_shell_that_died_before_the_claim_is_replaced_unseen() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let (served, _pools) = serve_busybox_pool(dir.path(), &state, &["dead"], 1);
    let (host, in_sandbox) = member_shell("dead");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(host), nix::sys::signal::Signal::SIGKILL).unwrap();
    assert!(
        eventually(Duration::from_secs(10), || exited(host as u32)),
        "the member's shell outlived SIGKILL"
    );
    let id = pooled_session(&served, "dead");
    let shell = |command: &str| {
        let body = serde_json::json!({ "command": command }).to_string();
        let (status, r) = served.call("POST", &format!("/v1/sessions/{id}/shell"), Some(&body));
        assert_eq!((status, &r["exitCode"]), (200, &0.into()), "{command}: {r}");
        r["output"].as_str().unwrap().to_string()
    };
    let first = shell("cd /tmp && echo $$ && pwd");
    let lines: Vec<&str> = first.lines().collect();
    assert_eq!(lines.len(), 2, "the first answer: {first:?}");
    assert_ne!(lines[0], in_sandbox.to_string(), "the dead shell answered: {first:?}");
    assert_eq!(lines[1], "/tmp", "{first:?}");
    assert_eq!(
        shell("pwd; echo $$"),
        format!("/tmp\n{}\n", lines[0]),
        "the new shell keeps its state"
    );
    let (status, _) = served.call("DELETE", &format!("/v1/sessions/{id}"), None);
    assert_eq!(status, 204);
}

/// A member's shell that hangs before the claim (stopped, here) never answers its hello: the
/// session's first call waits no longer than a shell's start limit for it. Either the call
/// sent its command behind the hello (it may then have run in the hung shell: a 503 says so
/// and that the next call starts a new shell), or the session gave up on the shell first and
/// started another, where the call runs. Either way the hung shell is killed, and the next
/// call answers from a new shell.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_member_shell_that_hangs_before_the_claim_is_killed_and_replaced() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let (served, _pools) = serve_busybox_pool(dir.path(), &state, &["hung"], 1);
    let (host, in_sandbox) = member_shell("hung");
    kill(Pid::from_raw(host), Signal::SIGSTOP).unwrap();
    let id = pooled_session(&served, "hung");
    let shell = |command: &str| {
        let body = serde_json::json!({ "command": command }).to_string();
        served.call("POST", &format!("/v1/sessions/{id}/shell"), Some(&body))
    };
    let (status, first) = shell("echo $$");
    eprintln!("the first call: {status} {first}");
    match status {
        503 => {
            let error = first["error"].as_str().unwrap_or_default();
            assert!(
                error.contains("did not answer its start in time")
                    && error.contains("the next call starts a new shell"),
                "{first}"
            );
        }
        200 => {
            assert_eq!(first["exitCode"], 0, "{first}");
            let pid = first["output"].as_str().unwrap().trim().to_string();
            assert_ne!(pid, in_sandbox.to_string(), "the hung shell answered: {first}");
        }
        _ => panic!("the first call: {status} {first}"),
    }
    assert!(
        eventually(Duration::from_secs(10), || exited(host as u32)),
        "the hung shell was left running"
    );
    let (status, next) = shell("echo $$; echo ok");
    assert_eq!((status, &next["exitCode"]), (200, &0.into()), "{next}");
    let output = next["output"].as_str().unwrap();
    assert!(output.ends_with("ok\n"), "{next}");
    assert_ne!(output.lines().next(), Some(in_sandbox.to_string().as_str()), "{next}");
    let (status, _) = served.call("DELETE", &format!("/v1/sessions/{id}"), None);
    assert_eq!(status, 204);
}

/// The short scheduling slice a session's shell runs with (src/runtime/latency.rs) is asked
/// for when the filler starts a member's shell, before any claim: the adopter has nothing
/// left to do for it on the claim's path. The session's shell is that very process.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_member_shell_has_its_short_slice_before_the_claim() {
    use runner::runtime::latency::{self, SHELL_SLICE};
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let (served, _pools) = serve_busybox_pool(dir.path(), &state, &["slice"], 1);
    let (host, in_sandbox) = member_shell("slice");
    let before = latency::scheduling(host).expect("sched_getattr of the member's shell");
    assert!(before.resets_on_fork, "before the claim: {before:?}");
    // Kernels from 6.12 report the slice (older ones ignore it for normal tasks).
    if let Some(slice) = before.slice {
        assert_eq!(slice, SHELL_SLICE, "before the claim");
    }

    let id = pooled_session(&served, "slice");
    let (status, r) = served.call(
        "POST",
        &format!("/v1/sessions/{id}/shell"),
        Some(r#"{"command": "echo $$"}"#),
    );
    assert_eq!(status, 200, "{r}");
    assert_eq!(
        r["output"].as_str().unwrap().trim(),
        in_sandbox.to_string(),
        "the adopted shell: {r}"
    );
    let after = latency::scheduling(host).expect("sched_getattr of the session's shell");
    assert_eq!(after, before, "the session's shell");
    let (status, _) = served.call("DELETE", &format!("/v1/sessions/{id}"), None);
    assert_eq!(status, 204);
}

/// A one-shot job that claims a member finds no shell of the pool's in it.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_one_shot_job_finds_no_member_shell() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_images(&state);
    let file = write_manifest(
        dir.path(),
        "job.yaml",
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: pyj}\nspec:\n  image: local/python:3.11\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: lonely}\nspec:\n  environment: pyj\n  command: [\"sh\", \"-c\", \"for p in /proc/[0-9]*; do tr '\\\\0' ' ' < $p/cmdline; echo; done; ls /.runner\"]\n",
    );
    let out = runner_ctd(
        &["pool", "create", "pyj", "-f", file.to_str().unwrap(), "--size", "1"],
        &state,
    );
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let pools = RemovePools(state.clone(), &["pyj"]);
    let applied = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], &state);
    assert!(
        eventually(Duration::from_secs(120), || ready(&state, 1)),
        "the pool was not refilled"
    );
    drop(pools);
    let all = json_of(&applied);
    let r = &all["status"]["result"];
    assert_eq!(r["pool"], "pyj", "{all}");
    assert_eq!(r["exitCode"], 0, "{all}");
    let out = r["stdout"].as_str().unwrap();
    assert!(!out.contains("bash") && !out.contains("sh-default"), "{out}");
}

/// A server keeps each pool key it computed (by Environment and image: issue 36), and a claim
/// reuses it only while the image's record names the content it was computed for: an image
/// re-tagged under the Environment's name between two claims is the second claim's image,
/// never a member of the old one.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_retagged_image_is_never_served_by_a_member_of_the_old_one() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_images(&state);
    // A name of this test's own: the containerd namespace is shared with other tests.
    let name = format!("local/retag-{}:1", std::process::id());
    let tag = |source: &str| {
        let out = runner_ctd(&["image", "tag", source, &name], &state);
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    };
    tag("local/busybox:1.35");
    let envs = dir.path().join("envs");
    std::fs::create_dir_all(&envs).unwrap();
    std::fs::write(
        envs.join("re.yaml"),
        format!("apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: re}}\nspec:\n  image: {name}\n"),
    )
    .unwrap();
    let served = serve_with_args(
        runner_ctd_command(&[], &state),
        dir.path(),
        &["--env-dir", envs.to_str().unwrap(), "--pool", "re=2"],
    );
    let pools = RemovePools(state.clone(), &["re"]);
    let full = || {
        json_of(&runner_ctd(&["pool", "ls", "-o", "json"], &state))
            .as_array()
            .is_some_and(|a| a.len() == 1 && a[0]["ready"] == 2)
    };
    assert!(eventually(Duration::from_secs(120), full), "the pool was not filled");
    // Which image a session runs on: the python image has python3, busybox has not.
    let image_of = |expect_pool: Option<bool>| -> String {
        let (status, session) = served.call("POST", "/v1/sessions", Some(r#"{"environment": "re"}"#));
        assert!((200..300).contains(&status), "{session}");
        if let Some(pooled) = expect_pool {
            assert_eq!(session["pool"].is_string(), pooled, "{session}");
        }
        let id = session["id"].as_str().unwrap().to_string();
        let (status, r) = served.call(
            "POST",
            &format!("/v1/sessions/{id}/shell"),
            Some(r#"{"command": "command -v python3 >/dev/null && echo python || echo busybox"}"#),
        );
        assert_eq!(status, 200, "{r}");
        served.call("DELETE", &format!("/v1/sessions/{id}"), None);
        r["output"].as_str().unwrap().trim().to_string()
    };
    let reads_ahead = || -> u64 {
        let (_, text) = served.call("GET", "/metrics", None);
        let text = text.as_str().unwrap().to_string();
        text.lines()
            .find_map(|l| l.strip_prefix(r#"runner_pool_image_reads_total{ahead="true"} "#))
            .map_or(0, |v| v.trim().parse().unwrap())
    };
    // The first claim computes the key (and keeps it); a member of busybox serves it, and one
    // more stays ready.
    assert_eq!(image_of(Some(true)), "busybox");
    tag("local/python:3.11");
    // A kept key would name the busybox member still ready. The record is read when the
    // request arrives (the server learnt the Environment's image from the first session):
    // after the re-tag, so the re-tag is seen.
    let before = reads_ahead();
    assert_eq!(image_of(None), "python");
    assert_eq!(
        reads_ahead(),
        before + 1,
        "the second claim's image record was not read ahead"
    );
    drop(served);
    drop(pools);
    let _ = runner_ctd(&["image", "rm", &name], &state);
}

/// Claims that miss the kept pool keys together (a burst on a server that has claimed nothing
/// yet) compute their key once, the others waiting for it (issue 36, item 2: 256 claims each
/// resolving the image and hashing the member's spec took a fresh server's burst 0.4 s). The
/// sessions name their Environment inline, as the README's do: the pool's own key, kept when
/// it was filled, is then not theirs to reuse, yet its members serve them.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_burst_of_claims_on_a_fresh_server_computes_its_pool_key_once() {
    const BURST: usize = 12;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let (served, pools) = serve_busybox_pool(dir.path(), &state, &["keyed"], BURST);
    let computed = || -> u64 {
        let (_, text) = served.call("GET", "/metrics", None);
        let text = text.as_str().unwrap().to_string();
        text.lines()
            .find_map(|l| l.strip_prefix("runner_pool_keys_computed_total "))
            .map_or(0, |v| v.trim().parse().unwrap())
    };
    let before = computed();
    let go = std::sync::Barrier::new(BURST);
    let sessions: Vec<serde_json::Value> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..BURST)
            .map(|_| {
                s.spawn(|| {
                    go.wait();
                    served.call(
                        "POST",
                        "/v1/sessions",
                        Some(r#"{"environment": {"image": "local/busybox:1.35"}}"#),
                    )
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap())
            .map(|(status, v)| {
                assert_eq!(status, 201, "{v}");
                v
            })
            .collect()
    });
    let after = computed();
    let pooled = sessions.iter().filter(|v| v["pool"].is_string()).count();
    for v in &sessions {
        served.call("DELETE", &format!("/v1/sessions/{}", v["id"].as_str().unwrap()), None);
    }
    assert_eq!(pooled, BURST, "{sessions:?}");
    assert_eq!(
        after - before,
        1,
        "keys computed by {BURST} claims at once (before them: {before})"
    );
    drop(served);
    drop(pools);
}

/// A member that cannot be readied at its claim (here its agent's control FIFO is gone) is
/// torn down and what claimed it starts cold, as when no member is ready: a session over HTTP
/// and a one-shot `runner apply` both succeed, neither from the pool.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_member_lost_at_its_claim_leaves_its_job_to_a_cold_start() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let (served, _pools) = serve_busybox_pool(dir.path(), &state, &["lost"], 2);
    let full = || json_of(&runner_ctd(&["pool", "ls", "-o", "json"], &state))[0]["ready"] == 2;
    let env = std::fs::read_to_string(dir.path().join("envs").join("lost.yaml")).unwrap();
    // Every member loses its agent's control FIFO (what readying opens first).
    let break_members = || {
        let mut broken = 0;
        for e in std::fs::read_dir(state.join("run")).unwrap().flatten() {
            let ctl = e.path().join("agent").join("ctl");
            if e.file_name().to_string_lossy().starts_with("pool-lost-") && ctl.exists() {
                std::fs::remove_file(ctl).unwrap();
                broken += 1;
            }
        }
        broken
    };
    assert_eq!(break_members(), 2);
    let (status, session) = served.call("POST", "/v1/sessions", Some(r#"{"environment": "lost"}"#));
    assert_eq!(status, 201, "{session}");
    assert!(session.get("pool").is_none(), "{session}");
    let id = session["id"].as_str().unwrap().to_string();
    let (status, r) = served.call(
        "POST",
        &format!("/v1/sessions/{id}/shell"),
        Some(r#"{"command": "echo cold"}"#),
    );
    assert_eq!((status, r["output"].as_str()), (200, Some("cold\n")), "{r}");
    served.call("DELETE", &format!("/v1/sessions/{id}"), None);
    // The pool made up for the lost member: that one is broken too before the job claims.
    assert!(eventually(Duration::from_secs(120), full), "the pool was not refilled");
    assert_eq!(break_members(), 1);
    let job = write_manifest(
        dir.path(),
        "job.yaml",
        &format!(
            "{env}---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: lost-job}}\nspec:\n  environment: lost\n  command: [\"echo\", \"ran\"]\n"
        ),
    );
    let out = runner_ctd(&["apply", "-f", job.to_str().unwrap(), "-o", "json"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let result = &json_of(&out)["status"]["result"];
    assert_eq!(result["exitCode"], 0, "{result}");
    assert!(result["pool"].is_null(), "{result}");
    drop(served);
}
