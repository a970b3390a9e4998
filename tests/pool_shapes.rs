//! One warm pool serves every job of its Environment (issue 36, item 4): jobs with and without
//! a workspace, static assets and stdin claim members of the same pool, made without
//! `--workspace` or `--static-assets`, and each gets what a cold run of the same Job gets —
//! output, exit code, identity, its working directory (`pwd`, its listing with owners and
//! modes, whether it can write there), what `/static` holds or that there is none, and the
//! files it leaves in its workspace. Through `runner apply` and `runner serve`'s job routes,
//! on a user-namespaced Environment with a non-root user and a `hostUsers: true` one as root.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;

const ENVS: &str = r#"apiVersion: runner/v1alpha1
kind: Environment
metadata: {name: eval}
spec:
  image: local/busybox:1.35
  workdir: /workspace
  user: "1000:1000"
  env: {GREETING: hello}
  resources: {memory: 64Mi, pids: 64}
---
apiVersion: runner/v1alpha1
kind: Environment
metadata: {name: rooted}
spec:
  image: local/busybox:1.35
  workdir: /srv/work
  hostUsers: true
  resources: {memory: 64Mi, pids: 64}
"#;

/// What every job prints: who it is, where, what its cwd holds (modes, links, owners, names:
/// not times), what `/` and `/static` hold, its stdin, whether it can write in its cwd and
/// in `/static` (root can, as in a cold container's rootfs), and the options of the mount
/// seen at its cwd (a workspace's: `nosuid,nodev`, idmapped in a user namespace; the topmost:
/// a member's workspace is mounted on its place's own bind).
const PROBE: &str = r#"["sh", "-c", "id; pwd; echo $GREETING; ls -lan . | awk 'NR>1 {print $1, $2, $3, $4, $NF}'; ls /; ls -lanR /static 2>&1 | awk '{print $1, $3, $4, $NF}'; cat; echo written > out.txt; echo write=$?; cat out.txt; ls; touch /static/new 2>/dev/null; echo static-write=$?; ls /static; awk -v d=$(pwd) '$5 == d {m = $6} END {if (m) print \"mount\", m}' /proc/self/mountinfo"]"#;

/// Per Environment, the jobs: every combination of workspace, assets and stdin.
const SHAPES: &[(&str, bool, bool, bool)] = &[
    ("bare", false, false, false),
    ("ws", true, false, false),
    ("assets-stdin", false, true, true),
    ("full", true, true, true),
    ("stdin", false, false, true),
    ("ws-assets", true, true, false),
];

/// The manifest: both Environments, and per Environment one job of each shape, each with a
/// workspace of its own under `dir` (writable by the non-root user) when it has one.
fn manifest(dir: &Path) -> String {
    let assets = dir.join("assets");
    std::fs::create_dir_all(assets.join("sub")).unwrap();
    std::fs::write(assets.join("f.txt"), "asset\n").unwrap();
    std::fs::write(assets.join("sub/g.txt"), "deeper\n").unwrap();
    let mut text = ENVS.to_string();
    for env in ["eval", "rooted"] {
        for (shape, workspace, static_assets, stdin) in SHAPES {
            let name = format!("{env}-{shape}");
            text.push_str(&format!(
                "---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {name}}}\nspec:\n  environment: {env}\n  command: {PROBE}\n"
            ));
            if *workspace {
                let ws = dir.join(format!("ws-{name}"));
                std::fs::create_dir_all(&ws).unwrap();
                std::fs::write(ws.join("input.txt"), "in\n").unwrap();
                std::fs::set_permissions(&ws, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
                text.push_str(&format!("  workspace: {}\n", ws.display()));
            }
            if *static_assets {
                text.push_str(&format!(
                    "  staticAssets:\n    - {{source: {}, savePath: data}}\n    - {{source: {}, savePath: nested/deeper/g.txt}}\n",
                    assets.display(),
                    assets.join("sub/g.txt").display()
                ));
            }
            if *stdin {
                text.push_str("  stdin: \"from stdin\\n\"\n");
            }
        }
    }
    text
}

/// Per job: (name, what must be identical to a cold run, the pool that served it).
fn results(items: &serde_json::Value) -> Vec<(String, serde_json::Value, Option<String>)> {
    let mut out: Vec<_> = items
        .as_array()
        .unwrap_or_else(|| panic!("{items}"))
        .iter()
        .map(|o| {
            let r = &o["status"]["result"];
            let kept = serde_json::json!({
                "phase": o["status"]["phase"],
                "exitCode": r["exitCode"],
                "stdout": r["stdout"],
                "stderr": r["stderr"],
            });
            (
                o["metadata"]["name"].as_str().unwrap().to_string(),
                kept,
                r["pool"].as_str().map(String::from),
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Every file a job left in its workspace, with its content.
fn workspace_files(dir: &Path) -> Vec<(String, String)> {
    let mut files: Vec<(String, String)> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("ws-"))
        .flat_map(|ws| {
            std::fs::read_dir(ws.path())
                .unwrap()
                .flatten()
                .map(move |f| {
                    (
                        format!(
                            "{}/{}",
                            ws.file_name().to_string_lossy(),
                            f.file_name().to_string_lossy()
                        ),
                        std::fs::read_to_string(f.path()).unwrap(),
                    )
                })
                .collect::<Vec<_>>()
        })
        .collect();
    files.sort();
    files
}

/// Removes the test's pools even when an assertion failed (members outlive every runner).
struct RemovePools(PathBuf);

impl Drop for RemovePools {
    fn drop(&mut self) {
        for pool in ["eval", "rooted", "own", "link"] {
            if self.0.join("pools").join(format!("{pool}.json")).exists() {
                runner_ctd(&["pool", "rm", pool], &self.0);
            }
        }
    }
}

/// A pool per Environment, made with no shape flags, as large as its jobs.
fn make_pools(state: &Path, envs: &Path) {
    for pool in ["eval", "rooted"] {
        let out = runner_ctd(
            &[
                "pool",
                "create",
                pool,
                "-f",
                envs.to_str().unwrap(),
                "--size",
                &SHAPES.len().to_string(),
            ],
            state,
        );
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let ls = json_of(&runner_ctd(&["pool", "ls", "-o", "json"], state));
    for p in ls.as_array().unwrap() {
        assert_eq!(
            (&p["workspace"], &p["staticAssets"]),
            (&true.into(), &true.into()),
            "{ls}"
        );
    }
}

/// The cold results prove what the comparison is about (and not only that both agree).
fn check_cold(cold: &[(String, serde_json::Value, Option<String>)]) {
    let stdout = |n: &str| {
        cold.iter().find(|(name, ..)| name == n).unwrap().1["stdout"]
            .as_str()
            .unwrap()
            .to_string()
    };
    // Without a workspace the cwd is the rootfs's: made by runc, owned by the container's
    // root, not writable by uid 1000; with one, the job's files.
    let bare = stdout("eval-bare");
    assert!(
        bare.starts_with("uid=1000(user) gid=1000(user)\n/workspace\nhello\n"),
        "{bare}"
    );
    assert!(
        bare.contains("drwxr-xr-x 2 0 0 .\n") && bare.contains("write=1\n"),
        "{bare}"
    );
    assert!(!bare.contains("\nstatic\n") && !bare.contains("input.txt"), "{bare}");
    let full = stdout("eval-full");
    assert!(full.contains("drwxrwxrwx 2 1000 1000 .\n"), "{full}");
    assert!(
        full.contains("input.txt\n") && full.contains("/static/data/sub:\n"),
        "{full}"
    );
    // The directories above a nested asset are the container root's, as runc makes them.
    assert!(
        full.contains("/static/nested/deeper:\n") && full.contains("drwxr-xr-x 0 0 deeper\n"),
        "{full}"
    );
    assert!(full.contains("from stdin\nwrite=0\nwritten\n"), "{full}");
    // Root in a cold rootfs cwd writes there (its file is gone with the container).
    let rooted = stdout("rooted-bare");
    assert!(rooted.starts_with("uid=0(root) gid=0(root)"), "{rooted}");
    assert!(
        rooted.contains("/srv/work\n") && rooted.contains("write=0\nwritten\nout.txt\n"),
        "{rooted}"
    );
    let rooted = stdout("rooted-full");
    assert!(rooted.contains("static-write=0\ndata\nnested\nnew\n"), "{rooted}");
    assert!(full.contains("static-write=1\n"), "{full}");
}

#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn one_pool_serves_jobs_with_and_without_workspace_assets_and_stdin_as_cold_runs() {
    let cold_dir = tempfile::tempdir().unwrap();
    let pool_dir = tempfile::tempdir().unwrap();
    let (cold_state, pool_state) = (cold_dir.path().join("state"), pool_dir.path().join("state"));
    import_busybox(&cold_state);
    import_busybox(&pool_state);
    let cold_file = write_manifest(cold_dir.path(), "jobs.yaml", &manifest(cold_dir.path()));
    let pool_file = write_manifest(pool_dir.path(), "jobs.yaml", &manifest(pool_dir.path()));
    let envs = write_manifest(pool_dir.path(), "envs.yaml", ENVS);
    let _rm = RemovePools(pool_state.clone());
    make_pools(&pool_state, &envs);
    // Cold and pooled side by side (different state dirs: the cold one has no pool).
    let cold = {
        let (file, state) = (cold_file.clone(), cold_state.clone());
        std::thread::spawn(move || runner_ctd(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], &state))
    };
    let pooled = runner_ctd(&["apply", "-f", pool_file.to_str().unwrap(), "-o", "json"], &pool_state);
    let cold = cold.join().unwrap();
    let (cold, pooled) = (results(&json_of(&cold)["items"]), results(&json_of(&pooled)["items"]));
    assert_eq!(cold.len(), 2 * SHAPES.len());
    check_cold(&cold);
    for ((name, c, c_pool), (_, p, p_pool)) in cold.iter().zip(&pooled) {
        assert_eq!(c_pool, &None, "{name} ran pooled without a pool");
        let env = name.split('-').next().unwrap();
        assert_eq!(p_pool.as_deref(), Some(env), "{name} was not served by pool {env}: {p}");
        assert_eq!(c, p, "{name}: cold and pooled differ");
    }
    assert_eq!(workspace_files(cold_dir.path()), workspace_files(pool_dir.path()));
    assert!(workspace_files(pool_dir.path()).contains(&("ws-eval-full/out.txt".into(), "written\n".into())));
}

/// `runner serve`'s job routes claim from the same pools: a manifest POSTed to /v1/jobs with
/// jobs of every shape, each served by its Environment's pool with the cold results.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn jobs_over_http_claim_from_one_pool_whatever_their_shape() {
    let cold_dir = tempfile::tempdir().unwrap();
    let pool_dir = tempfile::tempdir().unwrap();
    let (cold_state, pool_state) = (cold_dir.path().join("state"), pool_dir.path().join("state"));
    import_busybox(&cold_state);
    import_busybox(&pool_state);
    let cold_file = write_manifest(cold_dir.path(), "jobs.yaml", &manifest(cold_dir.path()));
    let text = manifest(pool_dir.path());
    let envs = write_manifest(pool_dir.path(), "envs.yaml", ENVS);
    let _rm = RemovePools(pool_state.clone());
    make_pools(&pool_state, &envs);
    let served = serve_with(runner_ctd_command(&[], &pool_state), pool_dir.path());
    let cold = runner_ctd(&["apply", "-f", cold_file.to_str().unwrap(), "-o", "json"], &cold_state);
    let (code, created) = served.call("POST", "/v1/jobs", Some(&text));
    assert_eq!(code, 201, "{created}");
    let start = Instant::now();
    let items = loop {
        let (code, list) = served.call("GET", "/v1/jobs", None);
        assert_eq!(code, 200, "{list}");
        let done = list
            .as_array()
            .unwrap()
            .iter()
            .filter(|j| j["status"]["phase"] == "Succeeded" || j["status"]["phase"] == "Failed")
            .count();
        if done == 2 * SHAPES.len() {
            break list;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "{list}");
        std::thread::sleep(Duration::from_millis(200));
    };
    let (cold, pooled) = (results(&json_of(&cold)["items"]), results(&items));
    assert_eq!(pooled.len(), 2 * SHAPES.len());
    for ((name, c, _), (_, p, p_pool)) in cold.iter().zip(&pooled) {
        let env = name.split('-').next().unwrap();
        assert_eq!(p_pool.as_deref(), Some(env), "{name} was not served by pool {env}: {p}");
        assert_eq!(c, p, "{name}: cold and pooled (over HTTP) differ");
    }
    assert_eq!(workspace_files(cold_dir.path()), workspace_files(pool_dir.path()));
}

/// A root job writing past its ephemeral storage into `/static` is evicted from a pool member
/// as from a cold container (where `/static` is in the rootfs): the member's static root is a
/// host directory, and it is counted, not left to fill the host's disk.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn writes_in_a_members_static_root_count_against_ephemeral_storage() {
    let dir = tempfile::tempdir().unwrap();
    let (cold_state, pool_state) = (dir.path().join("cold"), dir.path().join("pooled"));
    import_busybox(&cold_state);
    import_busybox(&pool_state);
    std::fs::create_dir_all(dir.path().join("assets")).unwrap();
    std::fs::write(dir.path().join("assets/f.txt"), "asset\n").unwrap();
    let env = "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: tight}\nspec:\n  image: local/busybox:1.35\n  resources: {memory: 128Mi, pids: 64, ephemeralStorage: 8Mi}\n";
    let envs = write_manifest(dir.path(), "env.yaml", env);
    // 1 MiB files (each under RLIMIT_FSIZE), 24 of them, then a wait the eviction cuts short.
    let job = format!(
        "{env}---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: filler}}\nspec:\n  environment: tight\n  staticAssets: [{{source: {}, savePath: data}}]\n  timeoutSeconds: 60\n  command: [\"sh\", \"-c\", \"for i in $(seq 1 24); do head -c 1048576 /dev/zero > /static/f$i || exit 3; done; sleep 30; echo survived\"]\n",
        dir.path().join("assets").display()
    );
    let file = write_manifest(dir.path(), "job.yaml", &job);
    let out = runner_ctd(
        &["pool", "create", "tight", "-f", envs.to_str().unwrap(), "--size", "1"],
        &pool_state,
    );
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    struct Rm(PathBuf);
    impl Drop for Rm {
        fn drop(&mut self) {
            runner_ctd(&["pool", "rm", "tight"], &self.0);
        }
    }
    let _rm = Rm(pool_state.clone());
    let mut seen = Vec::new();
    for state in [&cold_state, &pool_state] {
        let out = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], state);
        let all = json_of(&out);
        let job = if all["items"].is_array() {
            &all["items"][0]
        } else {
            &all
        };
        let status = &job["status"];
        assert_eq!(status["reason"], "Evicted", "{job}");
        assert!(status.to_string().contains("ephemeral"), "{job}");
        assert!(
            !status["result"]["stdout"].as_str().unwrap_or("").contains("survived"),
            "{job}"
        );
        seen.push((
            status["phase"].clone(),
            status["reason"].clone(),
            status["result"]["pool"].clone(),
        ));
    }
    assert_eq!(seen[0].2, serde_json::Value::Null);
    assert_eq!(seen[1].2, "tight", "the pooled run was not served by the pool");
    assert_eq!((&seen[0].0, &seen[0].1), (&seen[1].0, &seen[1].1));
}

/// Image `snapshot:NAME`: busybox after `command` ran in a session of it (state dir `state`).
fn snapshot_image(state: &Path, dir: &Path, name: &str, command: &str) {
    let served = serve_with(runner_ctd_command(&[], state), dir);
    let (code, v) = served.call(
        "POST",
        "/v1/sessions",
        Some(&serde_json::json!({"environment": {"image": "local/busybox:1.35"}}).to_string()),
    );
    assert_eq!(code, 201, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let (code, v) = served.call(
        "POST",
        &format!("/v1/sessions/{id}/exec"),
        Some(&serde_json::json!({"command": command, "timeoutSeconds": 20}).to_string()),
    );
    assert_eq!((code, &v["exitCode"]), (200, &0.into()), "{v}");
    let (code, v) = served.call(
        "POST",
        &format!("/v1/sessions/{id}/snapshot"),
        Some(&serde_json::json!({"name": name}).to_string()),
    );
    assert_eq!(code, 201, "{v}");
    let (code, _) = served.call("DELETE", &format!("/v1/sessions/{id}"), None);
    assert_eq!(code, 204);
}

/// An image with a `/static` of its own (a session's snapshot that made one): its pool's
/// members keep it for a job without assets, as a cold run shows it (the filler took the
/// static root out of every member). A job with assets starts cold: a cold start binds each
/// asset into the image's `/static`, beside its files, where a member's static root put back
/// would hide them.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_pool_of_an_image_with_its_own_static_keeps_it_for_jobs_without_assets() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    let name = format!("own-static-{}", std::process::id());
    snapshot_image(&state, dir.path(), &name, "mkdir /static && echo own > /static/own.txt");
    let assets = dir.path().join("assets");
    std::fs::create_dir_all(&assets).unwrap();
    std::fs::write(assets.join("f.txt"), "asset\n").unwrap();
    let envs = write_manifest(
        dir.path(),
        "envs.yaml",
        &format!(
            "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: own}}\nspec:\n  image: snapshot:{name}\n"
        ),
    );
    let _rm = RemovePools(state.clone());
    let out = runner_ctd(
        &["pool", "create", "own", "-f", envs.to_str().unwrap(), "--size", "2"],
        &state,
    );
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let jobs = write_manifest(
        dir.path(),
        "jobs.yaml",
        &format!(
            "{}---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: plain}}\nspec:\n  environment: own\n  command: [\"sh\", \"-c\", \"ls /static; cat /static/own.txt\"]\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: with-assets}}\nspec:\n  environment: own\n  staticAssets: [{{source: {}, savePath: data}}]\n  command: [\"sh\", \"-c\", \"ls /static; cat /static/data/f.txt; touch /static/new && echo static-write=$?\"]\n",
            std::fs::read_to_string(&envs).unwrap(),
            assets.display()
        ),
    );
    let out = runner_ctd(&["apply", "-f", jobs.to_str().unwrap(), "-o", "json"], &state);
    let done = results(&json_of(&out)["items"]);
    let by = |n: &str| {
        done.iter()
            .find(|(name, ..)| name == n)
            .unwrap_or_else(|| panic!("{done:?}"))
    };
    let (_, plain, pool) = by("plain");
    assert_eq!(pool.as_deref(), Some("own"), "{plain}");
    assert_eq!(plain["stdout"], "own.txt\nown\n", "the image's own /static: {plain}");
    let (_, with, pool) = by("with-assets");
    assert_eq!(pool.as_deref(), None, "{with}");
    assert_eq!(with["stdout"], "data\nown.txt\nasset\nstatic-write=0\n", "{with}");
    // Nothing of it stays in the suite's namespace: the members, then the image.
    let out = runner_ctd(&["pool", "rm", "own"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let out = runner_ctd(&["snapshot", "rm", &name], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}

/// An image whose `/static` is a link (to `/srv/static`): a cold run binds each asset through
/// the link, beside the image's files there. Its pool serves the jobs without assets (the
/// filler took the static root out through the link) and leaves those with assets to a cold
/// start (the static root put back on the link's own name failed them): each job's output is
/// the same as a cold run's.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_pool_of_an_image_whose_static_is_a_link_serves_jobs_as_cold_runs() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    let name = format!("link-static-{}", std::process::id());
    snapshot_image(
        &state,
        dir.path(),
        &name,
        "mkdir -p /srv/static && echo image > /srv/static/img.txt && ln -s /srv/static /static",
    );
    let assets = dir.path().join("assets");
    std::fs::create_dir_all(&assets).unwrap();
    std::fs::write(assets.join("f.txt"), "asset\n").unwrap();
    // The cold one differs in its limits: a pool serves every Environment of its shape.
    let env = |env: &str, more: &str| {
        format!(
            "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: {env}}}\nspec:\n  image: snapshot:{name}\n{more}"
        )
    };
    let envs = write_manifest(
        dir.path(),
        "envs.yaml",
        &format!(
            "{}---\n{}",
            env("link", ""),
            env("link-cold", "  resources: {memory: 96Mi}\n")
        ),
    );
    let _rm = RemovePools(state.clone());
    let out = runner_ctd(
        &["pool", "create", "link", "-f", envs.to_str().unwrap(), "--size", "2"],
        &state,
    );
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let job = |env: &str, job: &str, assets_line: &str, command: &str| {
        format!(
            "---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {job}}}\nspec:\n  environment: {env}\n{assets_line}  command: [\"sh\", \"-c\", {command:?}]\n"
        )
    };
    let with_assets = format!("  staticAssets: [{{source: {}, savePath: data}}]\n", assets.display());
    let look = "readlink /static; ls /static/ /srv/static/; cat /static/data/f.txt 2>&1; touch /static/new && echo static-write=$?";
    let mut text = std::fs::read_to_string(&envs).unwrap();
    for (env, suffix) in [("link", "pooled"), ("link-cold", "cold")] {
        text.push_str(&job(env, &format!("plain-{suffix}"), "", look));
        text.push_str(&job(env, &format!("assets-{suffix}"), &with_assets, look));
    }
    let jobs = write_manifest(dir.path(), "jobs.yaml", &text);
    let out = runner_ctd(&["apply", "-f", jobs.to_str().unwrap(), "-o", "json"], &state);
    let done = results(&json_of(&out)["items"]);
    let by = |n: &str| {
        done.iter()
            .find(|(name, ..)| name == n)
            .cloned()
            .unwrap_or_else(|| panic!("{n}: {done:?}"))
    };
    // What a cold run shows: the image's files through the link; with assets, each asset
    // bound beside them.
    let (_, plain, pool) = by("plain-cold");
    assert_eq!(pool, None, "{plain}");
    assert_eq!(
        plain["stdout"],
        "/srv/static\n/srv/static/:\nimg.txt\n\n/static/:\nimg.txt\ncat: can't open '/static/data/f.txt': No such file or directory\nstatic-write=0\n",
        "{plain}"
    );
    let (_, cold, _) = by("assets-cold");
    assert_eq!(
        cold["stdout"],
        "/srv/static\n/srv/static/:\ndata\nimg.txt\n\n/static/:\ndata\nimg.txt\nasset\nstatic-write=0\n",
        "{cold}"
    );
    for (shape, from) in [("plain", Some("link")), ("assets", None)] {
        let (_, cold, _) = by(&format!("{shape}-cold"));
        let (_, pooled, pool) = by(&format!("{shape}-pooled"));
        assert_eq!(pool.as_deref(), from, "{pooled}");
        assert_eq!(
            (&pooled["stdout"], &pooled["exitCode"]),
            (&cold["stdout"], &cold["exitCode"]),
            "{shape}: pooled {pooled}\ncold {cold}"
        );
    }
    let out = runner_ctd(&["pool", "rm", "link"], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let out = runner_ctd(&["snapshot", "rm", &name], &state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}
