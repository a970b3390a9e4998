//! The runtime interface on the host backend, through the library: spawn (setup) → execute
//! many times → stream → poll → kill → cleanup. These cases are the host half of the parity
//! suite the containerd backend will share.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use runner::manifest;
use runner::runtime::{ExecRequest, ProcessState, Runtime, RuntimeEvent, RuntimeOptions, host::HostRuntime};
use runner::spec::{self, HostEnv};

fn host_env(state: &Path) -> HostEnv {
    let mut h = HostEnv::detect(state);
    h.vars = std::env::vars().collect::<BTreeMap<_, _>>();
    h
}

async fn spawn_with(dir: &Path, setup: &[&str], options: RuntimeOptions) -> HostRuntime {
    std::fs::create_dir_all(dir.join("ws")).unwrap();
    let setup_yaml = if setup.is_empty() {
        String::new()
    } else {
        format!(
            "  setup:\n    commands: [{}]\n",
            setup.iter().map(|c| format!("{c:?}")).collect::<Vec<_>>().join(", ")
        )
    };
    let yaml = format!(
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: h}}\nspec:\n  backend: host\n  env: {{MARK: m1}}\n{setup_yaml}---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: j}}\nspec:\n  environment: h\n  workspace: ./ws\n  command: \"true\"\n"
    );
    let set = manifest::parse_str(&yaml, dir, None).unwrap();
    let bound = set.bind(&set.jobs[0], None).unwrap();
    let host = host_env(&dir.join("state"));
    let plan = spec::resolve(&bound, &host).unwrap();
    HostRuntime::spawn(&plan, &host, &options).await.unwrap()
}

async fn spawn(dir: &Path) -> HostRuntime {
    spawn_with(dir, &[], RuntimeOptions::default()).await
}

fn sh(script: &str) -> ExecRequest {
    ExecRequest {
        argv: vec!["sh".into(), "-c".into(), script.into()],
        ..Default::default()
    }
}

#[tokio::test]
async fn many_commands_run_in_one_runtime_in_the_workspace() {
    let dir = tempfile::tempdir().unwrap();
    let rt = spawn(dir.path()).await;
    assert_eq!(rt.poll(), ProcessState::Idle);
    for i in 0..20 {
        let r = rt.execute(sh(&format!("echo {i} >> log; echo $MARK"))).await.unwrap();
        assert_eq!(r.exit_code, Some(0));
        assert_eq!(r.stdout, "m1\n");
    }
    let log = std::fs::read_to_string(dir.path().join("ws/log")).unwrap();
    assert_eq!(log.lines().count(), 20);
    let r = rt.execute(sh("exit 7")).await.unwrap();
    assert_eq!(r.exit_code, Some(7));
    assert_eq!(rt.poll(), ProcessState::Exited(7));
    rt.cleanup().await.unwrap();
}

#[tokio::test]
async fn per_command_env_cwd_and_stdin() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("ws/sub")).unwrap();
    let rt = spawn(dir.path()).await;
    let mut req = sh("pwd; echo $EXTRA; cat");
    req.env.insert("EXTRA".into(), "x1".into());
    req.cwd = Some("sub".into());
    req.stdin = Some(b"from stdin".to_vec());
    let r = rt.execute(req).await.unwrap();
    let ws = std::fs::canonicalize(dir.path().join("ws/sub")).unwrap();
    assert_eq!(r.stdout, format!("{}\nx1\nfrom stdin", ws.display()));
    rt.cleanup().await.unwrap();
}

#[tokio::test]
async fn setup_runs_once_at_spawn_with_its_output_apart() {
    let dir = tempfile::tempdir().unwrap();
    let rt = spawn_with(
        dir.path(),
        &["echo one >> setup.log", "echo ready"],
        RuntimeOptions::default(),
    )
    .await;
    let setup = rt.setup().expect("setup ran");
    assert_eq!(setup.exit_code, Some(0));
    assert_eq!(setup.stdout, "ready\n");
    rt.execute(sh("true")).await.unwrap();
    rt.execute(sh("true")).await.unwrap();
    assert_eq!(
        std::fs::read_to_string(dir.path().join("ws/setup.log")).unwrap(),
        "one\n"
    );
    rt.cleanup().await.unwrap();
}

#[tokio::test]
async fn a_failing_setup_stops_at_the_first_failure() {
    let dir = tempfile::tempdir().unwrap();
    let rt = spawn_with(
        dir.path(),
        &["echo a", "exit 5", "echo never"],
        RuntimeOptions::default(),
    )
    .await;
    let setup = rt.setup().unwrap();
    assert_eq!(setup.exit_code, Some(5));
    assert_eq!(setup.stdout, "a\n");
    rt.cleanup().await.unwrap();
}

#[tokio::test]
async fn stream_yields_output_as_it_happens_then_the_exit() {
    let dir = tempfile::tempdir().unwrap();
    let rt = spawn(dir.path()).await;
    let mut rx = rt
        .stream(
            vec!["sh".into(), "-c".into(), "echo a; sleep 0.3; echo b >&2; exit 2".into()],
            None,
        )
        .await
        .unwrap();
    let start = Instant::now();
    let mut events = Vec::new();
    let mut first_at = None;
    while let Some(ev) = rx.recv().await {
        first_at.get_or_insert(start.elapsed());
        events.push(ev);
    }
    assert!(
        first_at.unwrap() < Duration::from_millis(250),
        "first event came late: {first_at:?}"
    );
    assert_eq!(
        events,
        vec![
            RuntimeEvent::Stdout { data: "a\n".into() },
            RuntimeEvent::Stderr { data: "b\n".into() },
            RuntimeEvent::Exit {
                exit_code: Some(2),
                signal: None,
                timed_out: false
            },
        ]
    );
    rt.cleanup().await.unwrap();
}

#[tokio::test]
async fn one_process_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let rt = std::sync::Arc::new(spawn(dir.path()).await);
    let a = {
        let rt = rt.clone();
        tokio::spawn(async move {
            rt.execute(sh("echo start-a >> order; sleep 0.3; echo end-a >> order"))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let b = rt.execute(sh("echo b >> order")).await.unwrap();
    a.await.unwrap().unwrap();
    assert_eq!(b.exit_code, Some(0));
    let order = std::fs::read_to_string(dir.path().join("ws/order")).unwrap();
    assert_eq!(order, "start-a\nend-a\nb\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_sees_a_running_command_and_kill_ends_its_tree() {
    let dir = tempfile::tempdir().unwrap();
    let rt = std::sync::Arc::new(spawn(dir.path()).await);
    let running = {
        let rt = rt.clone();
        tokio::spawn(async move { rt.execute(sh("sleep 972.1 & sleep 972.2")).await })
    };
    assert!(common::eventually(Duration::from_secs(2), || rt.poll() == ProcessState::Running));
    assert!(common::eventually(
        Duration::from_secs(2),
        || common::processes_matching("sleep 972.").len() >= 2
    ));
    rt.kill().await.unwrap();
    let r = running.await.unwrap().unwrap();
    let survivors = common::processes_matching("sleep 972.");
    common::kill_matching("sleep 972.");
    assert_eq!(r.signal, Some(9));
    assert!(survivors.is_empty(), "{survivors:?}");
    assert_eq!(rt.poll(), ProcessState::Exited(137));
}

#[tokio::test]
async fn timeout_in_the_process_group_fallback_kills_background_children() {
    let dir = tempfile::tempdir().unwrap();
    let options = RuntimeOptions {
        use_cgroup: false,
        ..RuntimeOptions::default()
    };
    let rt = spawn_with(dir.path(), &[], options).await;
    let mut req = sh("sleep 973.1 & (sleep 973.2 &); sleep 973.3");
    req.timeout = Some(Duration::from_millis(300));
    let start = Instant::now();
    let r = rt.execute(req).await.unwrap();
    let survivors = common::processes_matching("sleep 973.");
    common::kill_matching("sleep 973.");
    assert!(r.timed_out);
    assert_eq!(r.signal, Some(15), "SIGTERM first, within the grace period");
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(survivors.is_empty(), "{survivors:?}");
}

#[tokio::test]
async fn a_process_ignoring_sigterm_is_killed_after_the_grace() {
    let dir = tempfile::tempdir().unwrap();
    let rt = spawn(dir.path()).await;
    let mut req = sh("trap '' TERM; sleep 974.1; true");
    req.timeout = Some(Duration::from_millis(200));
    let r = rt.execute(req).await.unwrap();
    common::kill_matching("sleep 974.");
    assert!(r.timed_out);
    assert_eq!(r.signal, Some(9));
    assert_eq!(r.status_code(), 137);
}

#[tokio::test]
async fn leftovers_of_a_finished_command_are_killed_so_output_ends() {
    let dir = tempfile::tempdir().unwrap();
    let rt = spawn(dir.path()).await;
    let start = Instant::now();
    let r = rt.execute(sh("sleep 975.1 & echo done")).await.unwrap();
    assert_eq!(r.stdout, "done\n");
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(common::processes_matching("sleep 975.").is_empty());
}

#[tokio::test]
async fn a_missing_program_is_a_start_error() {
    let dir = tempfile::tempdir().unwrap();
    let rt = spawn(dir.path()).await;
    let err = rt
        .execute(ExecRequest {
            argv: vec!["/nonexistent/prog".into()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(err.to_string().contains("/nonexistent/prog"), "{err}");
}

#[tokio::test]
async fn cleanup_removes_scratch_space_and_ends_the_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: h}\nspec:\n  backend: host\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: j}\nspec:\n  environment: h\n  command: \"true\"\n";
    let set = manifest::parse_str(yaml, dir.path(), None).unwrap();
    let bound = set.bind(&set.jobs[0], None).unwrap();
    let host = host_env(&dir.path().join("state"));
    let plan = spec::resolve(&bound, &host).unwrap();
    let rt = HostRuntime::spawn(&plan, &host, &RuntimeOptions::default())
        .await
        .unwrap();
    let r = rt.execute(sh("pwd")).await.unwrap();
    let scratch = std::path::PathBuf::from(r.stdout.trim());
    assert!(scratch.is_dir());
    rt.cleanup().await.unwrap();
    assert!(!scratch.exists());
    assert!(rt.execute(sh("true")).await.is_err());
    rt.cleanup().await.unwrap();
}
