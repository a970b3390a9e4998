//! A burst of CLI processes on a warm pool (issue 36, item 2): 20 `runner apply` processes at
//! once, each its own job, from a pool of 20. Every job ends with its own one result from a
//! member of its own; the pool is refilled to its size and never holds more; the claims'
//! refills are coalesced into a few `runner pool fill` processes, which wait for the claims
//! to pause before they start.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{
    containers_where, eventually, import_busybox, json_of, pool_fillers, runner_ctd, runner_ctd_command, write_manifest,
};

const SIZE: usize = 20;
const POOL: &str = "cliburst";

/// The pool and what the test left, removed even when an assertion fails.
struct Cleanup(PathBuf, &'static str);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = runner_ctd(&["pool", "rm", self.1], &self.0);
        let _ = runner_ctd(&["gc"], &self.0);
    }
}

/// A pool named `pool` of `size` busybox members in a new state dir under `dir`; the
/// Environment's document.
fn busybox_pool(dir: &Path, pool: &str, size: usize) -> (PathBuf, String) {
    let state = dir.join("state");
    import_busybox(&state);
    let env = format!(
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: {pool}}}\nspec:\n  image: local/busybox:1.35\n"
    );
    let env_file = write_manifest(dir, "env.yaml", &env);
    let out = runner_ctd(
        &[
            "pool",
            "create",
            pool,
            "-f",
            env_file.to_str().unwrap(),
            "--size",
            &size.to_string(),
        ],
        &state,
    );
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    (state, env)
}

/// The sum of the numbers after `after` in the pool's fill reports (its fillers' output).
fn filler_sum(state: &Path, pool: &str, after: &str) -> (usize, String) {
    let log = std::fs::read_to_string(state.join("pools").join(format!("{pool}.log"))).unwrap_or_default();
    let sum = log
        .lines()
        .filter_map(|l| {
            l.split(after)
                .nth(1)?
                .split([',', ')', ' ', ';'])
                .next()?
                .parse::<usize>()
                .ok()
        })
        .sum();
    (sum, log)
}

/// The pool's members nobody has claimed (ready, or being made), as containerd lists them: a
/// member claimed is marked in its run directory before it is relabelled as its job's.
fn unclaimed_members(state: &Path) -> usize {
    containers_where(&format!(
        "labels.\"runner.dev/kind\"==pool,labels.\"runner.dev/pool\"=={POOL}"
    ))
    .iter()
    .filter(|id| {
        let claimed = std::fs::read_dir(state.join("run").join(id))
            .map(|d| {
                d.flatten()
                    .any(|e| e.file_name().to_string_lossy().starts_with("claimed-"))
            })
            .unwrap_or(false);
        !claimed
    })
    .count()
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn twenty_cli_applies_at_once_from_a_pool_of_twenty() {
    let dir = tempfile::tempdir().unwrap();
    let (state, env) = busybox_pool(dir.path(), POOL, SIZE);
    let _cleanup = Cleanup(state.clone(), POOL);
    // Each job its own file and name; a member that served another job before would show the
    // mark that job left (members are never reused).
    let files: Vec<PathBuf> = (0..SIZE)
        .map(|i| {
            write_manifest(
                dir.path(),
                &format!("job-{i}.yaml"),
                &format!(
                    "{env}---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: cb-{i}}}\nspec:\n  environment: {POOL}\n  command: [\"sh\", \"-c\", \"test ! -e /tmp/served || exit 9; echo {i} > /tmp/served; echo job-{i} $(hostname)\"]\n"
                ),
            )
        })
        .collect();

    // Watch the pool while the burst runs and is refilled: unclaimed members, and the fillers.
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (stop, state) = (stop.clone(), state.clone());
        std::thread::spawn(move || {
            let (mut most_members, mut most_fillers, mut seen) = (0, 0, BTreeSet::new());
            while !stop.load(Ordering::Relaxed) {
                most_members = most_members.max(unclaimed_members(&state));
                let now = pool_fillers(&state, POOL);
                most_fillers = most_fillers.max(now.len());
                seen.extend(now);
                std::thread::sleep(Duration::from_millis(10));
            }
            (most_members, most_fillers, seen)
        })
    };

    let children: Vec<_> = files
        .iter()
        .map(|f| {
            runner_ctd_command(&["apply", "-f", f.to_str().unwrap(), "-o", "json"], &state)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("starting runner apply")
        })
        .collect();
    for (i, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "job {i}: {stderr}");
        let status = &json_of(&out)["status"];
        assert_eq!(status["result"]["pool"], POOL, "job {i} ran cold: {status}");
        assert_eq!(status["result"]["exitCode"], 0, "job {i}: {status}");
        assert_eq!(
            status["result"]["stdout"],
            format!("job-{i} cb-{i}\n"),
            "job {i}: {status}"
        );
        assert_eq!(status["attempts"].as_array().unwrap().len(), 1, "job {i}: {status}");
    }

    // Refilled to its size by the claims' fillers (nobody fills it by hand here).
    let ls = || json_of(&runner_ctd(&["pool", "ls", "-o", "json"], &state));
    assert!(
        eventually(Duration::from_secs(120), || ls()[0]["ready"] == SIZE
            && pool_fillers(&state, POOL).is_empty()),
        "the pool was not refilled: {}",
        ls()
    );
    stop.store(true, Ordering::Relaxed);
    let (most_members, most_fillers, seen) = watcher.join().unwrap();
    eprintln!(
        "burst of {SIZE}: at most {most_members} unclaimed members, {most_fillers} fillers at once, {} fillers in all",
        seen.len()
    );
    assert!(
        most_members <= SIZE,
        "the pool held {most_members} unclaimed members at once (size {SIZE})"
    );
    // One filler queued at a time (a claim that finds one queued starts none), and one filling.
    assert!(most_fillers <= 2, "{most_fillers} fillers at once");
    assert!(
        !seen.is_empty() && seen.len() <= 4,
        "fillers for {SIZE} claims: {seen:?}"
    );
    // What the fillers did, by their reports: exactly the missing members made, and every
    // used member removed by them (an apply's start-up reconciliation leaves a live pool's
    // used members to its filler, which waits for the burst to pass).
    let (made, log) = filler_sum(&state, POOL, "(made ");
    assert_eq!(made, SIZE, "members made by the fillers: {log}");
    assert_eq!(
        filler_sum(&state, POOL, "removed ").0,
        SIZE,
        "used members removed by the fillers: {log}"
    );
    assert_eq!(unclaimed_members(&state), SIZE);
}

/// Applies one right after another: each one's start-up reconciliation (which removes what
/// dead runner processes left) leaves the used members of the one before to the pool's filler,
/// which is waiting for the claims to pause — tearing them down there would put a teardown on
/// every apply of a burst. (Each job runs long enough for its apply's reconciliation, which
/// runs beside it, to finish.)
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn the_next_apply_leaves_used_members_to_the_pools_filler() {
    const POOL2: &str = "cliseq";
    const N: usize = 3;
    let dir = tempfile::tempdir().unwrap();
    let (state, env) = busybox_pool(dir.path(), POOL2, N);
    let _cleanup = Cleanup(state.clone(), POOL2);
    for i in 0..N {
        let file = write_manifest(
            dir.path(),
            &format!("seq-{i}.yaml"),
            &format!(
                "{env}---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: seq-{i}}}\nspec:\n  environment: {POOL2}\n  command: [\"sleep\", \"0.3\"]\n"
            ),
        );
        let out = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], &state);
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(json_of(&out)["status"]["result"]["pool"], POOL2, "job {i} ran cold");
    }
    let ls = || json_of(&runner_ctd(&["pool", "ls", "-o", "json"], &state));
    assert!(
        eventually(Duration::from_secs(60), || ls()[0]["ready"] == N
            && pool_fillers(&state, POOL2).is_empty()),
        "the pool was not refilled: {}",
        ls()
    );
    let (removed, log) = filler_sum(&state, POOL2, "removed ");
    assert_eq!(
        removed, N,
        "used members removed by the fillers (not by the applies): {log}"
    );
}

/// A filler a claim queued waits while its pool's used members keep coming (each marks the
/// pool's `.queue` file, as a burst's applies do one after another), then fills once they
/// pause: a refill inside a burst takes the CPU its jobs need.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_queued_filler_waits_for_the_burst_to_pass() {
    const POOL3: &str = "cliwait";
    let dir = tempfile::tempdir().unwrap();
    let (state, env) = busybox_pool(dir.path(), POOL3, 1);
    let _cleanup = Cleanup(state.clone(), POOL3);
    let file = write_manifest(
        dir.path(),
        "one.yaml",
        &format!(
            "{env}---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: one}}\nspec:\n  environment: {POOL3}\n  command: [\"true\"]\n"
        ),
    );
    let out = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(json_of(&out)["status"]["result"]["pool"], POOL3);
    // More used members, every 50 ms for 1.2 s (well inside the filler's longest wait, 2 s):
    // the pool stays empty meanwhile.
    let queue = state.join("pools").join(format!("{POOL3}.queue"));
    let ready = || json_of(&runner_ctd(&["pool", "ls", "-o", "json"], &state))[0]["ready"].clone();
    let t0 = std::time::Instant::now();
    while t0.elapsed() < Duration::from_millis(1200) {
        std::fs::File::options()
            .write(true)
            .open(&queue)
            .and_then(|f| f.set_modified(std::time::SystemTime::now()))
            .unwrap();
        assert_eq!(ready(), 0, "refilled during the burst, after {:?}", t0.elapsed());
        std::thread::sleep(Duration::from_millis(50));
    }
    // Once they pause, it fills.
    assert!(
        eventually(Duration::from_secs(60), || ready() == 1
            && pool_fillers(&state, POOL3).is_empty()),
        "the pool was not refilled: {}",
        ready()
    );
}
