//! The containerd backend against a real, private containerd (started by scripts/test.sh;
//! `CONTAINERD_ADDRESS`, `CONTAINERD_NAMESPACE`, `RUNNER_TEST_IMAGES`). Marked ignored so a
//! bare `cargo test` does not need root and containerd; the test script runs them with
//! `--include-ignored`, and without their environment they fail loudly.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use runner::containerd::Containerd;
use runner::manifest;
use runner::runtime::containerd::{self as ctd, Engine};
use runner::runtime::{ExecRequest, ExecResult, ProcessState, Runtime, RuntimeEvent, RuntimeOptions};
use runner::spec::{self, HostEnv, RunPlan};
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

use common::*;

const IMAGE: &str = "local/busybox:1.35";

static IMPORTED: OnceCell<()> = OnceCell::const_new();

async fn client() -> Containerd {
    let (address, namespace) = containerd_env();
    let c = Containerd::connect(&address, &namespace)
        .await
        .expect("connect to the test containerd");
    IMPORTED
        .get_or_init(|| async {
            let path = image_dir().join("busybox-oci.tar");
            runner::image::import(&c, &path, &Default::default())
                .await
                .expect("import busybox");
        })
        .await;
    c
}

fn host(state: &Path) -> HostEnv {
    let mut h = HostEnv::detect(state);
    h.vars = BTreeMap::new();
    h
}

async fn engine(state: &Path) -> Engine {
    Engine::new(client().await, state, host(state), RuntimeOptions::default())
}

/// A job name no other test uses (tests run in parallel and check their own leftovers).
fn unique_name() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!("t{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// A RunPlan for a Job in `dir` with the given Environment spec lines and Job spec lines;
/// the job gets a unique name.
fn plan(dir: &Path, env_extra: &str, job_extra: &str, command: &str) -> RunPlan {
    std::fs::create_dir_all(dir.join("ws")).unwrap();
    let yaml = format!(
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: bb}}\nspec:\n  image: {IMAGE}\n{env_extra}---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: t}}\nspec:\n  environment: bb\n  workspace: ./ws\n  command: {command}\n{job_extra}"
    );
    let set = manifest::parse_str(&yaml, dir, None).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    let mut bound = set.bind(&set.jobs[0], None).unwrap();
    bound.job.name = unique_name();
    spec::resolve(&bound, &host(&dir.join("state"))).unwrap()
}

async fn oneshot(dir: &Path, env_extra: &str, job_extra: &str, command: &str) -> ExecResult {
    oneshot_named(dir, env_extra, job_extra, command).await.0
}

/// As `oneshot`, also returning the job's name (for leftover checks).
async fn oneshot_named(dir: &Path, env_extra: &str, job_extra: &str, command: &str) -> (ExecResult, String) {
    let p = plan(dir, env_extra, job_extra, command);
    let r = engine(&dir.join("state"))
        .await
        .run_oneshot(&p, &CancellationToken::new())
        .await
        .unwrap();
    (r, p.job().name.clone())
}

/// A workspace any uid may write to (the jobs below run as non-root users).
fn open_workspace(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir.join("ws")).unwrap();
    std::fs::set_permissions(dir.join("ws"), std::fs::Permissions::from_mode(0o777)).unwrap();
}

/// Containers, active snapshots and leases of ours whose job name is `job`.
async fn leftovers(c: &Containerd, job: &str) -> usize {
    let filter = format!("labels.\"{}\"=={job}", ctd::LABEL_JOB);
    c.containers(vec![filter.clone()]).await.unwrap().len()
        + c.snapshots(vec![filter.clone()]).await.unwrap().len()
        + c.leases(vec![filter]).await.unwrap().len()
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn image_import_in_all_three_formats() {
    let dir = tempfile::tempdir().unwrap();
    let images = image_dir();
    let imports: [(&str, &[&str], &str); 3] = [
        ("busybox-oci.tar", &[], "local/busybox:1.35"),
        ("busybox-docker.tar", &["--name", "local/bbd:1"], "local/bbd:1"),
        (
            "busybox-rootfs.tar",
            &["--name", "local/bbr:1", "--env", "FROM_IMAGE=yes"],
            "local/bbr:1",
        ),
    ];
    for (file, extra, name) in imports {
        let path = images.join(file);
        let mut args = vec!["image", "import", path.to_str().unwrap()];
        args.extend_from_slice(extra);
        let out = runner_ctd(&args, dir.path());
        assert_eq!(
            out.status.code(),
            Some(0),
            "{file}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains(name));
    }
    let ls = runner_ctd(&["image", "ls"], dir.path());
    let listing = String::from_utf8_lossy(&ls.stdout);
    for name in ["local/busybox:1.35", "local/bbd:1", "local/bbr:1"] {
        assert!(listing.contains(name), "{name} missing from:\n{listing}");
    }
    // A rootfs tarball without a name is refused with a clear message.
    let out = runner_ctd(
        &["image", "import", images.join("busybox-rootfs.tar").to_str().unwrap()],
        dir.path(),
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--name"));
    // Every imported image runs, and the rootfs import's --env reaches the process.
    for name in ["local/bbd:1", "local/bbr:1"] {
        let d = dir.path().join(name.replace(['/', ':'], "-"));
        let p = plan(&d, "", "", r#"["sh", "-c", "echo ran:$FROM_IMAGE"]"#);
        let mut p = p;
        p.bound.env.image = Some(name.to_string());
        let r = engine(&d.join("state"))
            .await
            .run_oneshot(&p, &CancellationToken::new())
            .await
            .unwrap();
        let expected = if name == "local/bbr:1" { "ran:yes\n" } else { "ran:\n" };
        assert_eq!(r.stdout, expected, "{name}");
    }
    // Images survive containerd's garbage collection (GC labels and image records hold them).
    let c = client().await;
    c.lease_create("runner-test-gc-trigger", Default::default())
        .await
        .unwrap();
    c.lease_delete_sync("runner-test-gc-trigger").await.unwrap();
    for name in ["local/busybox:1.35", "local/bbd:1", "local/bbr:1"] {
        runner::image::resolve(&c, name)
            .await
            .unwrap_or_else(|e| panic!("{name} after GC: {e}"));
    }
    // rm removes it.
    let out = runner_ctd(&["image", "rm", "local/bbd:1"], dir.path());
    assert_eq!(out.status.code(), Some(0));
    assert!(c.image_get("local/bbd:1").await.unwrap().is_none());
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn exit_code_and_separated_streams() {
    let dir = tempfile::tempdir().unwrap();
    let (r, name) = oneshot_named(dir.path(), "", "", r#"["sh", "-c", "echo out; echo err >&2; exit 5"]"#).await;
    assert_eq!(r.exit_code, Some(5));
    assert_eq!(r.stdout, "out\n");
    assert_eq!(r.stderr, "err\n");
    assert!(!r.timed_out && !r.oom_killed);
    assert!(r.cpu_time_ms.is_some() && r.peak_memory_bytes.is_some());
    assert_eq!(leftovers(&client().await, &name).await, 0);
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn stdin_is_delivered_then_closed_and_absent_stdin_is_eof() {
    let dir = tempfile::tempdir().unwrap();
    let r = oneshot(
        dir.path(),
        "",
        "  stdin: \"line1\\nline2\\n\"\n  timeoutSeconds: 10\n",
        r#"["sh", "-c", "cat; echo done"]"#,
    )
    .await;
    assert_eq!(r.stdout, "line1\nline2\ndone\n");
    assert!(!r.timed_out);
    let r = oneshot(
        dir.path(),
        "",
        "  timeoutSeconds: 10\n",
        r#"["sh", "-c", "cat; echo eof"]"#,
    )
    .await;
    assert_eq!(r.stdout, "eof\n");
    assert!(!r.timed_out);
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn setup_output_is_split_exactly_from_the_command() {
    let dir = tempfile::tempdir().unwrap();
    let env = "  setup:\n    commands: [\"printf 'no newline'\", \"echo e >&2\"]\n";
    let r = oneshot(dir.path(), env, "", r#"["sh", "-c", "echo main"]"#).await;
    let setup = r.setup.clone().unwrap();
    assert_eq!(setup.stdout, "no newline");
    assert_eq!(setup.stderr, "e\n");
    assert_eq!(setup.exit_code, Some(0));
    assert_eq!(r.stdout, "main\n");
    assert_eq!(r.stderr, "");
    // A failing setup: the command does not run.
    let env = "  setup:\n    commands: [\"echo before\", \"exit 7\"]\n";
    let r = oneshot(dir.path(), env, "", r#"["sh", "-c", "echo main"]"#).await;
    assert_eq!(r.setup.unwrap().exit_code, Some(7));
    assert_eq!(r.stdout, "");
    // disableSetup skips it.
    let r = oneshot(
        dir.path(),
        env,
        "  disableSetup: true\n",
        r#"["sh", "-c", "echo main"]"#,
    )
    .await;
    assert!(r.setup.is_none());
    assert_eq!(r.stdout, "main\n");
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn timeout_kills_every_process_of_the_container() {
    let dir = tempfile::tempdir().unwrap();
    let start = Instant::now();
    let (r, name) = oneshot_named(
        dir.path(),
        "",
        "  timeoutSeconds: 1\n",
        r#"["sh", "-c", "sleep 981 & (sleep 982 &); echo started; sleep 983"]"#,
    )
    .await;
    let elapsed = start.elapsed();
    assert!(r.timed_out);
    assert_eq!(r.stdout, "started\n");
    // The bound proves the timeout ended the job (its command sleeps 983 s), not how fast:
    // a loaded suite took 6.7 s once against an earlier 4 s bound.
    assert!(elapsed < Duration::from_secs(60), "took {elapsed:?}");
    for sleep in ["sleep 981", "sleep 982", "sleep 983"] {
        assert!(processes_matching(sleep).is_empty(), "{sleep} survived");
    }
    assert_eq!(leftovers(&client().await, &name).await, 0);
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn a_memory_bomb_is_oom_killed_and_exit_137_alone_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let env = "  resources: {memory: 32Mi}\n";
    let r = oneshot(
        dir.path(),
        env,
        "  timeoutSeconds: 30\n",
        r#"["sh", "-c", "x=aaaaaaaa; while :; do x=$x$x; done"]"#,
    )
    .await;
    assert!(r.oom_killed, "{r:?}");
    assert!(!r.timed_out);
    assert_eq!(r.exit_code, Some(137));
    let status = runner::job::status_of(r, false);
    assert_eq!(status.1, runner::job::Reason::OomKilled);
    let r = oneshot(dir.path(), env, "", r#"["sh", "-c", "exit 137"]"#).await;
    assert!(!r.oom_killed);
    assert_eq!(r.exit_code, Some(137));
    assert_eq!(runner::job::status_of(r, false).1, runner::job::Reason::Error);
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn a_pids_limit_stops_a_fork_flood() {
    let dir = tempfile::tempdir().unwrap();
    let start = Instant::now();
    let (r, name) = oneshot_named(
        dir.path(),
        "  resources: {pids: 16}\n",
        "  timeoutSeconds: 20\n",
        r#"["sh", "-c", "cat /sys/fs/cgroup/pids/pids.max /sys/fs/cgroup/pids.max 2>/dev/null; for i in $(seq 1 200); do sleep 30 & done; echo unreachable"]"#,
    )
    .await;
    // The shell cannot fork past the limit: it reports it and gives up, long before 200.
    assert!(!r.timed_out, "{r:?}");
    assert!(r.stdout.starts_with("16\n"), "{r:?}");
    assert!(!r.stdout.contains("unreachable"), "{r:?}");
    assert!(r.stderr.contains("fork"), "{}", r.stderr);
    assert!(start.elapsed() < Duration::from_secs(10));
    assert_eq!(leftovers(&client().await, &name).await, 0);
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn cpu_quota_throttles() {
    let dir = tempfile::tempdir().unwrap();
    let busy = r#"["sh", "-c", "end=$(( $(date +%s) + 3 )); while [ $(date +%s) -lt $end ]; do :; done"]"#;
    let r = oneshot(dir.path(), "  resources: {cpu: 200m}\n", "", busy).await;
    let cpu = r.cpu_time_ms.expect("cpu time");
    assert!(r.duration_ms >= 2000);
    // 20% of at most 3 s of wall time, with slack for accounting granularity.
    assert!(cpu < 1000, "used {cpu} ms of CPU in {} ms at 200m", r.duration_ms);
    assert!(cpu > 100, "used only {cpu} ms: did the loop run?");
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn static_assets_are_read_only_and_the_workspace_is_shared() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("assets")).unwrap();
    std::fs::write(dir.path().join("assets/expected.txt"), "42\n").unwrap();
    let job = "  staticAssets: [{source: ./assets, savePath: fixtures}]\n";
    let r = oneshot(
        dir.path(),
        "",
        job,
        r#"["sh", "-c", "cat /static/fixtures/expected.txt; echo x > /static/fixtures/new && echo WROTE; echo result > /workspace/out.txt"]"#,
    )
    .await;
    assert_eq!(r.stdout, "42\n");
    assert!(r.stderr.contains("Read-only file system"), "{}", r.stderr);
    assert!(!dir.path().join("assets/new").exists());
    assert_eq!(
        std::fs::read_to_string(dir.path().join("ws/out.txt")).unwrap(),
        "result\n"
    );
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn network_none_has_only_loopback_and_host_shares_the_host() {
    let dir = tempfile::tempdir().unwrap();
    let ifaces = r#"["sh", "-c", "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | sort"]"#;
    let r = oneshot(dir.path(), "", "", ifaces).await;
    assert_eq!(r.stdout, "lo\n");
    let r = oneshot(dir.path(), "  network: host\n  hostUsers: true\n", "", ifaces).await;
    let host_ifaces = std::fs::read_to_string("/proc/net/dev").unwrap();
    let mut expected: Vec<&str> = host_ifaces
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(str::trim)
        .collect();
    expected.sort();
    assert_eq!(r.stdout.lines().collect::<Vec<_>>(), expected);
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn user_is_honoured_and_owns_workspace_files() {
    let dir = tempfile::tempdir().unwrap();
    open_workspace(dir.path());
    // The workspace belongs to a user of the host: the job (1000 in its user namespace) sees
    // it as its own, and what it writes there is stored as that user's, never a range id.
    std::os::unix::fs::chown(dir.path().join("ws"), Some(2001), Some(2002)).unwrap();
    let r = oneshot(
        dir.path(),
        "  user: \"1000:1000\"\n",
        "",
        r#"["sh", "-c", "id -u; id -g; stat -c %u:%g /workspace; touch /workspace/by-1000"]"#,
    )
    .await;
    assert_eq!(r.stdout, "1000\n1000\n1000:1000\n", "{}", r.stderr);
    let meta = std::fs::metadata(dir.path().join("ws/by-1000")).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (2001, 2002));
    // user: host = HUID/HGID (the human behind sudo), else the runner's own ids.
    let d2 = dir.path().join("host");
    open_workspace(&d2);
    // The human owns their workspace; the job, running as them, writes as them.
    std::os::unix::fs::chown(d2.join("ws"), Some(4321), Some(4322)).unwrap();
    let mut p = plan(
        &d2,
        "  user: host\n",
        "",
        r#"["sh", "-c", "id -u; touch /workspace/by-host"]"#,
    );
    let mut h = host(&d2.join("state"));
    h.huid = Some(4321);
    h.hgid = Some(4322);
    p.bound.env.user = Some(manifest::UserSpec::Host);
    let e = Engine::new(client().await, &d2.join("state"), h, RuntimeOptions::default());
    let r = e.run_oneshot(&p, &CancellationToken::new()).await.unwrap();
    assert_eq!(r.stdout, "4321\n", "{}", r.stderr);
    let meta = std::fs::metadata(d2.join("ws/by-host")).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (4321, 4322));
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn many_execs_in_one_live_container() {
    let dir = tempfile::tempdir().unwrap();
    let env = "  setup:\n    commands: [\"echo setup-ran >> /workspace/setup.log\"]\n";
    let p = plan(dir.path(), env, "", r#""true""#);
    open_workspace(dir.path());
    let e = engine(&dir.path().join("state")).await;
    let live = e.spawn_live(&p).await.unwrap();
    assert_eq!(live.setup().unwrap().exit_code, Some(0));
    for i in 0..30 {
        let r = live
            .execute(ExecRequest {
                argv: vec![
                    "sh".into(),
                    "-c".into(),
                    format!("echo {i} >> /tmp/state; wc -l < /tmp/state"),
                ],
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(r.stdout.trim(), (i + 1).to_string());
    }
    assert_eq!(
        std::fs::read_to_string(dir.path().join("ws/setup.log")).unwrap(),
        "setup-ran\n"
    );
    live.cleanup().await.unwrap();
    assert_eq!(leftovers(&client().await, &p.job().name).await, 0);
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn twenty_concurrent_jobs_leave_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let e = Arc::new(engine(&dir.path().join("state")).await);
    let mut handles = Vec::new();
    for i in 0..20 {
        let d = dir.path().join(format!("j{i}"));
        let p = plan(&d, "", "", &format!(r#"["sh", "-c", "echo job{i}"]"#));
        let mut p = p;
        p.bound.job.name = "concurrent".into();
        let e = e.clone();
        handles.push(tokio::spawn(async move {
            let r = e.run_oneshot(&p, &CancellationToken::new()).await.unwrap();
            assert_eq!(r.stdout, format!("job{i}\n"));
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    assert_eq!(leftovers(&client().await, "concurrent").await, 0);
    assert_eq!(ranges_held(&dir.path().join("state")), Vec::<u32>::new());
}

/// A create that fails midway (its workspace vanished after the plan was made) leaves
/// nothing: no container, snapshot or create lease (the lease is taken beside the spec's
/// preparation, so it exists before the failure), and no user-namespace range.
#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn a_create_that_fails_midway_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let p = plan(dir.path(), "", "", r#"["true"]"#);
    std::fs::remove_dir(dir.path().join("ws")).unwrap();
    let err = engine(&dir.path().join("state"))
        .await
        .run_oneshot(&p, &CancellationToken::new())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("workspace"), "{err}");
    assert_eq!(leftovers(&client().await, &p.job().name).await, 0);
    assert_eq!(ranges_held(&dir.path().join("state")), Vec::<u32>::new());
}

/// The user-namespace ranges (host bases) a state dir's containers hold.
fn ranges_held(state: &Path) -> Vec<u32> {
    let state = std::fs::canonicalize(state).unwrap_or_else(|_| state.to_path_buf());
    runner::runtime::idmap::Leases::at(std::path::Path::new(runner::config::DEFAULT_USERNS_DIR))
        .held(&state)
        .unwrap()
        .into_iter()
        .map(|l| l.host_base)
        .collect()
}

/// The first line of a `/proc/<pid>/uid_map` as (inside, outside, count).
fn first_map(text: &str) -> (u32, u32, u32) {
    let n: Vec<u32> = text
        .split_whitespace()
        .take(3)
        .map(|t| t.parse().unwrap_or_else(|_| panic!("{text:?}")))
        .collect();
    (n[0], n[1], n[2])
}

async fn uid_map_of(live: &ctd::LiveContainer) -> (u32, u32, u32) {
    let r = live
        .execute(ExecRequest {
            argv: vec!["cat".into(), "/proc/self/uid_map".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    first_map(&r.stdout)
}

/// PIDs in a container's cgroup (v1 pids hierarchy or v2).
fn container_pids(engine: &Engine, id: &str) -> Vec<u32> {
    let rel = format!("{}/{id}", engine.cgroup_parent());
    for root in ["/sys/fs/cgroup/pids", "/sys/fs/cgroup"] {
        if let Ok(text) = std::fs::read_to_string(format!("{root}{rel}/cgroup.procs")) {
            return text.lines().filter_map(|l| l.trim().parse().ok()).collect();
        }
    }
    panic!("no cgroup for {id}")
}

/// Real, effective, saved and filesystem uids of a host process.
fn host_uids(pid: u32) -> Vec<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    line.split_whitespace().skip(1).map(|t| t.parse().unwrap()).collect()
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn root_in_the_sandbox_is_a_range_of_its_own_on_the_host() {
    let dir = tempfile::tempdir().unwrap();
    // A file only the host's root may read, bound in: root in the sandbox is not that root.
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "s3cret").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let r = oneshot(
        dir.path(),
        &format!("  mounts: [{{source: {}, target: /secret}}]\n", secret.display()),
        "",
        r#"["sh", "-c", "cat /proc/self/uid_map; id -u; cat /secret || echo refused; echo x > /dev/null && head -c 3 /dev/zero | wc -c; ls /proc/self/ns/user && touch /rootfs-write && echo rootfs-ok"]"#,
    )
    .await;
    let mut lines = r.stdout.lines();
    let (inside, base, count) = first_map(lines.next().unwrap());
    assert_eq!((inside, count), (0, 65536), "{}", r.stdout);
    assert!(base >= 1 << 30, "{base}");
    assert_eq!(
        lines.collect::<Vec<_>>(),
        ["0", "refused", "3", "/proc/self/ns/user", "rootfs-ok"],
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains("Permission denied"), "{}", r.stderr);

    // Two live sandboxes: disjoint ranges, and their processes run as range ids on the host.
    let state = dir.path().join("state");
    let e = engine(&state).await;
    let a = e
        .spawn_live(&plan(&dir.path().join("a"), "", "", r#""true""#))
        .await
        .unwrap();
    let b = e
        .spawn_live(&plan(&dir.path().join("b"), "  user: \"1000:1000\"\n", "", r#""true""#))
        .await
        .unwrap();
    let (_, base_a, _) = uid_map_of(&a).await;
    let (_, base_b, _) = uid_map_of(&b).await;
    assert!(base_a.abs_diff(base_b) >= 65536, "{base_a} {base_b}");
    let mut held = ranges_held(&state);
    held.sort();
    let mut want = vec![base_a, base_b];
    want.sort();
    assert_eq!(held, want);
    for (live, base, uid) in [(&a, base_a, 0), (&b, base_b, 1000)] {
        let pids = container_pids(&e, live.id());
        assert!(!pids.is_empty());
        for pid in pids {
            for host_uid in host_uids(pid) {
                assert_eq!(host_uid, base + uid, "pid {pid}");
            }
        }
    }
    a.cleanup().await.unwrap();
    b.cleanup().await.unwrap();
    assert_eq!(ranges_held(&state), Vec::<u32>::new());
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn escape_probes_stay_refused_in_the_user_namespace() {
    let dir = tempfile::tempdir().unwrap();
    // Each probe prints its name and the errno it got (0: it worked). Raw system calls, so
    // no library can hide a success.
    let script = r#"
import ctypes, errno, os, socket
libc = ctypes.CDLL(None, use_errno=True)
def sc(name, nr, *args):
    r = libc.syscall(nr, *args)
    print(name, 0 if r >= 0 else ctypes.get_errno())
sc("mount", 165, b"none", b"/mnt", b"tmpfs", 0, None)
sc("unshare-user", 272, 0x10000000)
sc("unshare-mount", 272, 0x00020000)
sc("setns", 308, os.open("/proc/self/ns/mnt", os.O_RDONLY), 0)
sc("keyctl", 250, 1, None)
sc("bpf", 321, 0, None, 0)
sc("perf_event_open", 298, None, 0, -1, -1, 0)
sc("init_module", 175, None, 0, b"")
sc("finit_module", 313, 0, b"", 0)
sc("kexec_load", 246, 0, 0, None, 0)
sc("open_by_handle_at", 304, 0, None, 0)
sc("ptrace-attach-1", 101, 16, 1, 0, 0)
for name, fam, typ in [("raw-inet", socket.AF_INET, socket.SOCK_RAW), ("packet", 17, socket.SOCK_RAW)]:
    try:
        socket.socket(fam, typ, 0 if fam != 17 else 0x0300).close(); print(name, 0)
    except OSError as e:
        print(name, e.errno)
for path, data in [("/proc/sys/kernel/hostname", "x"), ("/proc/sysrq-trigger", "h"), ("/sys/kernel/uevent_helper", "x"), ("/proc/sys/vm/drop_caches", "3")]:
    try:
        with open(path, "w") as f: f.write(data)
        print("write " + path, 0)
    except OSError as e:
        print("write " + path, e.errno)
"#;
    std::fs::create_dir_all(dir.path().join("ws")).unwrap();
    std::fs::write(dir.path().join("ws/probe.py"), script).unwrap();
    let r = python_oneshot(dir.path(), "", r#"["python3", "probe.py"]"#).await;
    assert_eq!(r.exit_code, Some(0), "{}", r.stderr);
    let results: Vec<(String, i32)> = r
        .stdout
        .lines()
        .map(|l| {
            let (name, code) = l.rsplit_once(' ').unwrap();
            (name.to_string(), code.parse().unwrap())
        })
        .collect();
    assert_eq!(results.len(), 18, "{}", r.stdout);
    for (name, code) in &results {
        assert_ne!(*code, 0, "{name} worked inside the sandbox:\n{}", r.stdout);
    }
}

static PYTHON: OnceCell<()> = OnceCell::const_new();

/// A one-shot job on the Python image (imported once), with a workspace in `dir`.
async fn python_oneshot(dir: &Path, env_extra: &str, command: &str) -> ExecResult {
    let c = client().await;
    PYTHON
        .get_or_init(|| async {
            runner::image::import(&c, &image_dir().join("python-oci.tar"), &Default::default())
                .await
                .expect("import python");
        })
        .await;
    std::fs::create_dir_all(dir.join("ws")).unwrap();
    let yaml = format!(
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: py}}\nspec:\n  image: local/python:3.11\n{env_extra}---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: py}}\nspec:\n  environment: py\n  workspace: ./ws\n  command: {command}\n"
    );
    let set = manifest::parse_str(&yaml, dir, None).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    let mut bound = set.bind(&set.jobs[0], None).unwrap();
    bound.job.name = unique_name();
    let p = spec::resolve(&bound, &host(&dir.join("state"))).unwrap();
    engine(&dir.join("state"))
        .await
        .run_oneshot(&p, &CancellationToken::new())
        .await
        .unwrap()
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn setuid_binaries_keep_their_bits_and_run() {
    let dir = tempfile::tempdir().unwrap();
    let r = python_oneshot(
        dir.path(),
        "  user: \"1000:1000\"\n",
        r#"["sh", "-c", "stat -c %a:%u:%g /usr/bin/passwd; /usr/bin/passwd --help >/dev/null && echo ran"]"#,
    )
    .await;
    // The image's root-owned setuid binary keeps its bits and owner through the mapping, and
    // runs (noNewPrivileges keeps it from raising privileges, as in every container of ours).
    assert_eq!(r.stdout, "4755:0:0\nran\n", "{}", r.stderr);
}

/// A foreground `runner apply` stopped by `signal` kills the job's whole tree, records it as
/// Interrupted, exits 128 + the signal, and leaves nothing behind.
fn stopping_the_cli_leaves_nothing_behind(signal: nix::sys::signal::Signal, job: &str, sleep: u32) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    // The image, imported once for the whole binary.
    rt.block_on(client());
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("ws")).unwrap();
    let yaml = format!(
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: bb}}\nspec:\n  image: {IMAGE}\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {job}}}\nspec:\n  environment: bb\n  command: [\"sh\", \"-c\", \"echo started; sleep {sleep}\"]\n"
    );
    let file = write_manifest(dir.path(), "job.yaml", &yaml);
    let state = dir.path().join("state");
    let child = runner_ctd_command(&["apply", "-f", file.to_str().unwrap()], &state)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let needle = format!("sleep {sleep}");
    assert!(eventually(Duration::from_secs(10), || !processes_matching(&needle).is_empty()));
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), signal).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(128 + signal as i32),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(processes_matching(&needle).is_empty());
    let left = rt.block_on(async { leftovers(&client().await, job).await });
    assert_eq!(left, 0);
    let got = json_of(&runner_ctd(&["get", "job", job, "-o", "json"], &state));
    assert_eq!(got["status"]["reason"], "Interrupted", "{got}");
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn ctrl_c_of_the_cli_leaves_nothing_behind() {
    stopping_the_cli_leaves_nothing_behind(nix::sys::signal::Signal::SIGINT, "interrupted", 979);
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn sigterm_of_the_cli_leaves_nothing_behind() {
    stopping_the_cli_leaves_nothing_behind(nix::sys::signal::Signal::SIGTERM, "terminated", 978);
}

/// A stop that would outlast `--shutdown-grace` (here a command deaf to SIGTERM with a 30 s
/// termination grace) does not hold the CLI: it exits 143 at the end of its own grace period
/// and says so; a later `delete` finishes the job.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_foreground_apply_stops_within_its_shutdown_grace() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    // The image, imported once for the whole binary.
    rt.block_on(client());
    let dir = tempfile::tempdir().unwrap();
    let job = "deaf-to-sigterm";
    let yaml = format!(
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: bb}}\nspec:\n  image: {IMAGE}\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {job}}}\nspec:\n  environment: bb\n  terminationGracePeriodSeconds: 30\n  command: [\"sh\", \"-c\", \"trap '' TERM; echo started; sleep 976\"]\n"
    );
    let file = write_manifest(dir.path(), "job.yaml", &yaml);
    let state = dir.path().join("state");
    let child = runner_ctd_command(
        &["apply", "--shutdown-grace", "500ms", "-f", file.to_str().unwrap()],
        &state,
    )
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    assert!(eventually(Duration::from_secs(10), || !processes_matching("sleep 976").is_empty()));
    let stopped = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let out = child.wait_with_output().unwrap();
    let took = stopped.elapsed();
    eprintln!("apply stopped {took:?} after SIGTERM (grace 500ms, the job's own 30s)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{stderr}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(
        stderr.contains("did not stop within the 500ms shutdown grace period"),
        "{stderr}"
    );
    let deleted = runner_ctd(&["delete", "job", job], &state);
    assert_eq!(
        deleted.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&deleted.stderr)
    );
    assert!(eventually(Duration::from_secs(40), || processes_matching("sleep 976").is_empty()));
    let left = rt.block_on(async { leftovers(&client().await, job).await });
    assert_eq!(left, 0);
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn an_exec_timeout_kills_the_command_but_not_the_sandbox() {
    exec_timeout_case(true).await;
    exec_timeout_case(false).await;
}

async fn exec_timeout_case(via_agent: bool) {
    let dir = tempfile::tempdir().unwrap();
    let p = plan(dir.path(), "", "", r#""true""#);
    let e = engine(&dir.path().join("state")).await;
    let mut options = e.options().clone();
    options.exec_via_agent = via_agent;
    let e = e.with_options(options);
    let live = e.spawn_live(&p).await.unwrap();
    let start = Instant::now();
    let r = live
        .execute(ExecRequest {
            argv: vec!["sh".into(), "-c".into(), "sleep 985 & sleep 987".into()],
            timeout: Some(Duration::from_millis(500)),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(r.timed_out);
    assert!(start.elapsed() < Duration::from_secs(3));
    assert!(
        processes_matching("sleep 985").is_empty(),
        "the command's background child survived"
    );
    assert!(processes_matching("sleep 987").is_empty());
    // What a command starts in the background stays up in the sandbox, and does not hold
    // the command's result back.
    let start = Instant::now();
    let r = live
        .execute(ExecRequest {
            argv: vec!["sh".into(), "-c".into(), "sleep 988 & echo started".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(r.stdout, "started\n");
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(
        !processes_matching("sleep 988").is_empty(),
        "the background process must keep running"
    );
    let r = live
        .execute(ExecRequest {
            argv: vec!["echo".into(), "alive".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(r.stdout, "alive\n");
    live.cleanup().await.unwrap();
    assert!(
        eventually(Duration::from_secs(3), || processes_matching("sleep 988").is_empty()),
        "cleanup must end the sandbox: {:?}",
        processes_matching("sleep 988")
    );
}

/// The runtime-interface cases both backends must pass alike.
async fn parity_cases(rt: &dyn Runtime) {
    let sh = |s: &str| ExecRequest {
        argv: vec!["sh".into(), "-c".into(), s.into()],
        ..Default::default()
    };
    assert_eq!(rt.poll(), ProcessState::Idle);
    let r = rt.execute(sh("echo out; echo err >&2; exit 3")).await.unwrap();
    assert_eq!(
        (r.exit_code, r.stdout.as_str(), r.stderr.as_str()),
        (Some(3), "out\n", "err\n")
    );
    assert_eq!(rt.poll(), ProcessState::Exited(3));
    let mut req = sh("cat");
    req.stdin = Some(b"piped".to_vec());
    assert_eq!(rt.execute(req).await.unwrap().stdout, "piped");
    let mut req = sh("cat; echo eof");
    req.timeout = Some(Duration::from_secs(5));
    let r = rt.execute(req).await.unwrap();
    assert_eq!((r.stdout.as_str(), r.timed_out), ("eof\n", false));
    let mut req = sh("echo $EXTRA");
    req.env.insert("EXTRA".into(), "x".into());
    assert_eq!(rt.execute(req).await.unwrap().stdout, "x\n");
    rt.execute(sh("echo kept > state.txt")).await.unwrap();
    assert_eq!(rt.execute(sh("cat state.txt")).await.unwrap().stdout, "kept\n");
    let mut req = sh("sleep 986");
    req.timeout = Some(Duration::from_millis(300));
    let r = rt.execute(req).await.unwrap();
    assert!(r.timed_out);
    let mut rx = rt
        .stream(
            vec!["sh".into(), "-c".into(), "echo a; echo b >&2; exit 4".into()],
            None,
        )
        .await
        .unwrap();
    let mut events = Vec::new();
    while let Some(e) = rx.recv().await {
        events.push(e);
    }
    assert!(
        events.contains(&RuntimeEvent::Stdout { data: "a\n".into() }),
        "{events:?}"
    );
    assert!(
        events.contains(&RuntimeEvent::Stderr { data: "b\n".into() }),
        "{events:?}"
    );
    assert!(
        matches!(events.last(), Some(RuntimeEvent::Exit { exit_code: Some(4), .. })),
        "{events:?}"
    );
    let r = rt.execute(sh("printf 'ok\\377'")).await.unwrap();
    assert_eq!(r.stdout, "ok\u{fffd}");
    rt.cleanup().await.unwrap();
    assert!(rt.execute(sh("true")).await.is_err());
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn parity_of_the_runtime_interface_on_both_backends() {
    let dir = tempfile::tempdir().unwrap();
    let p = plan(dir.path(), "", "", r#""true""#);
    let state = dir.path().join("state");
    let live = engine(&state).await.spawn_live(&p).await.unwrap();
    parity_cases(&live).await;
    // The same through Tasks.Exec instead of the agent.
    let e = engine(&state).await;
    let mut options = e.options().clone();
    options.exec_via_agent = false;
    let e = e.with_options(options);
    let live = e.spawn_live(&p).await.unwrap();
    parity_cases(&live).await;
    let mut hp = p.clone();
    hp.bound.backend = manifest::Backend::Host;
    hp.bound.network = manifest::NetworkMode::Host;
    let h = runner::runtime::host::HostRuntime::spawn(&hp, &host(&state), &RuntimeOptions::default())
        .await
        .unwrap();
    parity_cases(&h).await;
    assert!(processes_matching("sleep 986").is_empty());
}

/// Start `runner apply` of a job running `sleep SECONDS` with its own state dir, and SIGKILL it
/// once the job's process runs: what it leaves is a job attempt without a runner.
fn orphan_a_job(dir: &Path, state: &Path, name: &str, seconds: u32) {
    let yaml = format!(
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: bb}}\nspec:\n  image: {IMAGE}\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {name}}}\nspec:\n  environment: bb\n  command: [\"sh\", \"-c\", \"sleep {seconds}\"]\n"
    );
    let file = write_manifest(dir, &format!("{name}.yaml"), &yaml);
    let mut child = runner_ctd_command(&["apply", "-f", file.to_str().unwrap()], state)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let needle = format!("sleep {seconds}");
    assert!(eventually(Duration::from_secs(10), || !processes_matching(&needle).is_empty()));
    // SIGKILL: no cleanup runs; the container keeps running under its shim.
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn gc_readopts_its_own_orphaned_jobs_and_removes_what_no_store_owns() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let rt = tokio::runtime::Runtime::new().unwrap();
    // A job of this store whose runner died: gc must not kill it but give it a supervisor.
    orphan_a_job(dir.path(), &state, "orphaned", 968);
    // A job of another store that is gone (its state dir removed): nobody can adopt it.
    let gone = dir.path().join("gone-state");
    orphan_a_job(dir.path(), &gone, "storeless", 967);
    // A job of another store that still exists: not ours to judge.
    let other = dir.path().join("other-state");
    orphan_a_job(dir.path(), &other, "foreign", 966);
    // Nothing of a running container stays mounted under its state dir: it can be removed.
    std::fs::remove_dir_all(&gone).unwrap();
    // A live container of this (alive) test process must survive gc.
    let p = plan(&dir.path().join("live"), "", "", r#""true""#);
    let live = rt.block_on(async { engine(&state).await.spawn_live(&p).await.unwrap() });

    let out = runner_ctd(&["gc"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.contains("removed 1 containers"), "{text}");
    assert!(eventually(Duration::from_secs(5), || processes_matching("sleep 967").is_empty()));
    assert_eq!(rt.block_on(async { leftovers(&client().await, "storeless").await }), 0);
    // The orphan of this store was re-adopted: still running, now supervised again.
    assert!(!processes_matching("sleep 968").is_empty(), "{text}");
    let got = json_of(&runner_ctd(&["get", "job", "orphaned", "-o", "json"], &state));
    assert_eq!(got["status"]["phase"], "Running", "{got}");
    assert!(eventually(Duration::from_secs(10), || {
        let d = runner_ctd(&["describe", "job", "orphaned"], &state);
        String::from_utf8_lossy(&d.stdout).contains("(running)")
    }));
    // The other store's job is untouched until its own store deletes it.
    assert!(!processes_matching("sleep 966").is_empty());
    for (name, st) in [("orphaned", &state), ("foreign", &other)] {
        let out = runner_ctd(&["delete", "job", name], st);
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(rt.block_on(async { leftovers(&client().await, name).await }), 0);
    }
    assert!(processes_matching("sleep 968").is_empty() && processes_matching("sleep 966").is_empty());
    // The live one is untouched and still answers.
    let r = rt
        .block_on(live.execute(ExecRequest {
            argv: vec!["echo".into(), "still here".into()],
            ..Default::default()
        }))
        .unwrap();
    assert_eq!(r.stdout, "still here\n");
    rt.block_on(live.cleanup()).unwrap();
    // Every range is back: the gone store's by gc, the others' by their teardown.
    for st in [&state, &gone, &other] {
        assert_eq!(ranges_held(st), Vec::<u32>::new(), "{}", st.display());
    }
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn concurrent_imports_of_the_same_blobs_all_succeed() {
    let dir = tempfile::tempdir().unwrap();
    // A rootfs layer no other test has: a unique file, 4 MiB so writes overlap.
    let mut tar = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    let data: Vec<u8> = format!("{:?}", std::time::SystemTime::now())
        .into_bytes()
        .repeat(1 << 18);
    header.set_size(data.len() as u64);
    header.set_mode(0o644);
    header.set_cksum();
    tar.append_data(&mut header, "unique.txt", data.as_slice()).unwrap();
    let path = dir.path().join("layer.tar");
    std::fs::write(&path, tar.into_inner().unwrap()).unwrap();
    let c = client().await;
    let mut tasks = Vec::new();
    for i in 0..4 {
        let (c, path) = (c.clone(), path.clone());
        tasks.push(tokio::spawn(async move {
            let options = runner::image::ImportOptions {
                name: Some(format!("local/concurrent:{i}")),
                ..Default::default()
            };
            runner::image::import(&c, &path, &options).await
        }));
    }
    for t in tasks {
        t.await.unwrap().expect("every concurrent import succeeds");
    }
    for i in 0..4 {
        runner::image::resolve(&c, &format!("local/concurrent:{i}"))
            .await
            .unwrap();
        c.image_delete(&format!("local/concurrent:{i}")).await.unwrap();
    }
}

#[tokio::test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
async fn durable_output_goes_through_the_logger_and_a_broken_logger_is_an_error_not_silence() {
    let dir = tempfile::tempdir().unwrap();
    let env = "  setup:\n    commands: [\"echo set\"]\n";
    let p = plan(dir.path(), env, "", r#"["sh", "-c", "echo out; echo err >&2; exit 2"]"#);
    let e = engine(&dir.path().join("state")).await;
    let mut options = e.options().clone();
    options.durable_output = true;
    options.logger_binary = Some(runner_bin());
    let e = e.with_options(options.clone());
    let r = e.run_oneshot(&p, &CancellationToken::new()).await.unwrap();
    assert_eq!(
        (r.exit_code, r.stdout.as_str(), r.stderr.as_str()),
        (Some(2), "out\n", "err\n")
    );
    assert_eq!(r.setup.unwrap().stdout, "set\n");
    // A logger that writes nothing must fail the run, never report empty output.
    options.logger_binary = Some(PathBuf::from("/bin/true"));
    let e = e.with_options(options);
    let err = e.run_oneshot(&p, &CancellationToken::new()).await.unwrap_err();
    assert!(err.to_string().contains("output logger"), "{err}");
    assert_eq!(leftovers(&client().await, &p.job().name).await, 0);
}
