//! What `runner serve` does for density (issue 36, item 5; docs/guide/capacity.md), against the
//! private containerd of scripts/test.sh: it raises its open-files limit to the hard limit and
//! names the host limits too low for `--expect-sessions`; its threads do not grow with the
//! sessions it has served (each engine used to start two storage-monitor threads that never
//! ended).

mod common;

use std::io::BufRead;
use std::os::unix::process::CommandExt;
use std::process::Stdio;

use common::*;

/// A `runner serve` (stopped when dropped, as `Served`) with its stderr in a file.
struct Server {
    served: Served,
    stderr: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl std::ops::Deref for Server {
    type Target = Served;

    fn deref(&self) -> &Served {
        &self.served
    }
}

/// This process's hard open-files limit (what a child may get without privilege to raise it).
fn hard_nofile() -> u64 {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .unwrap()
        .1
}

/// `runner serve` with open-files limits `soft`/`hard` and more arguments; stderr to a file.
fn server(soft: u64, hard: u64, args: &[&str]) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_busybox(&state);
    std::fs::write(dir.path().join("token"), format!("{SERVE_TOKEN}\n")).unwrap();
    let stderr = dir.path().join("serve.err");
    let mut cmd = runner_ctd_command(&[], &state);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--token-file"])
        .arg(dir.path().join("token"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr).unwrap());
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            use nix::sys::resource::{Resource, getrlimit, setrlimit};
            let (_, now) = getrlimit(Resource::RLIMIT_NOFILE)?;
            setrlimit(Resource::RLIMIT_NOFILE, soft, hard.min(now)).map_err(std::io::Error::from)
        });
    }
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("runner serve with open files {soft}/{hard}: {e}"));
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| {
            panic!(
                "no listening line: {line:?}: {}",
                std::fs::read_to_string(&stderr).unwrap()
            )
        })
        .to_string();
    Server {
        served: Served { child, url },
        stderr,
        _dir: dir,
    }
}

impl Server {
    fn limits_row(&self, row: &str) -> String {
        let limits = std::fs::read_to_string(format!("/proc/{}/limits", self.child.id())).unwrap();
        limits
            .lines()
            .find(|l| l.starts_with(row))
            .unwrap_or_else(|| panic!("no {row} in {limits}"))
            .to_string()
    }

    fn threads(&self) -> Vec<String> {
        std::fs::read_dir(format!("/proc/{}/task", self.child.id()))
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .map(|c| c.trim().to_string())
            .collect()
    }
}

#[test]
#[ignore = "needs the containerd of scripts/test.sh"]
fn serve_raises_its_open_files_limit_and_names_what_the_host_lacks() {
    // A soft limit of 256 (a shell's is often 1024): the server raises it to the hard one.
    // 10 million sessions need more than an 8192 hard limit: it says so, and what to set.
    assert!(
        hard_nofile() >= 8192,
        "the suite needs a hard open-files limit of 8192 at least"
    );
    let s = server(256, 8192, &["--expect-sessions", "10000000"]);
    let row = s.limits_row("Max open files");
    let fields: Vec<_> = row.split_whitespace().collect();
    // Soft up to hard; with CAP_SYS_RESOURCE (root outside a container that drops it) the
    // hard limit too, up to fs.nr_open.
    let now = fields[3];
    assert_eq!(fields[3], fields[4], "{row}");
    let raised: u64 = now.parse().unwrap();
    let may_raise_hard = nix::sys::resource::setrlimit(
        nix::sys::resource::Resource::RLIMIT_NOFILE,
        nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
            .unwrap()
            .0,
        hard_nofile() + 1,
    )
    .is_ok();
    if may_raise_hard {
        assert!(raised > 8192, "{row}");
    } else {
        assert_eq!(raised, 8192, "{row}");
    }
    let stderr = std::fs::read_to_string(&s.stderr).unwrap();
    assert!(
        stderr.contains(&format!("runner: open files limit raised from 256 to {now}")),
        "{stderr}"
    );
    let line = stderr
        .lines()
        .find(|l| l.starts_with(&format!("runner: host limit: the server's open-files limit is {now};")))
        .unwrap_or_else(|| panic!("no open-files line in {stderr}"));
    assert!(
        line.contains("10000000 live sessions need at least") && line.contains("LimitNOFILE="),
        "{line}"
    );
    // pid_max: 10 million sessions' threads exceed any kernel's pid space (2^22 at most).
    assert!(
        stderr.lines().any(|l| l.starts_with("runner: host limit: kernel.pid_max is ") && l.contains("sysctl -w kernel.pid_max=")),
        "{stderr}"
    );
    // The sessions still work.
    let (code, body) = s.call(
        "POST",
        "/v1/sessions",
        Some(r#"{"environment": {"image": "local/busybox:1.35"}}"#),
    );
    assert_eq!(code, 201, "{body}");
    let id = body["id"].as_str().unwrap().to_string();
    assert_eq!(s.call("DELETE", &format!("/v1/sessions/{id}"), None).0, 204);
}

#[test]
#[ignore = "needs the containerd of scripts/test.sh"]
fn a_host_that_holds_the_expected_sessions_gets_no_warning() {
    let s = server(1024, hard_nofile(), &["--expect-sessions", "1"]);
    // Its soft limit is its hard one now (a spawned child's hard limit is the parent's
    // original one, which the test harness may have changed for itself).
    let row = s.limits_row("Max open files");
    let fields: Vec<_> = row.split_whitespace().collect();
    assert_eq!(fields[3], fields[4], "{row}");
    let stderr = std::fs::read_to_string(&s.stderr).unwrap();
    assert!(
        stderr.contains(&format!("runner: open files limit raised from 1024 to {}", fields[4])),
        "{stderr}"
    );
    assert!(!stderr.contains("host limit"), "{stderr}");
    // A count of 0 is refused by the command line.
    let out = runner_ctd_command(
        &["serve", "--token-file", "/nonexistent", "--expect-sessions", "0"],
        std::path::Path::new("/tmp"),
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--expect-sessions"));
}

/// Sessions created and deleted one after another, some kept live: the server's threads do
/// not grow with them (one storage monitor, two threads, for the whole process).
#[test]
#[ignore = "needs the containerd of scripts/test.sh"]
fn the_servers_threads_do_not_grow_with_the_sessions_it_served() {
    let s = server(hard_nofile(), hard_nofile(), &[]);
    let create = || {
        let (code, body) = s.call(
            "POST",
            "/v1/sessions",
            Some(r#"{"environment": {"image": "local/busybox:1.35"}}"#),
        );
        assert_eq!(code, 201, "{body}");
        body["id"].as_str().unwrap().to_string()
    };
    let live: Vec<String> = (0..3).map(|_| create()).collect();
    for _ in 0..6 {
        let id = create();
        assert_eq!(s.call("DELETE", &format!("/v1/sessions/{id}"), None).0, 204);
    }
    let threads = s.threads();
    let storage = threads.iter().filter(|t| t.starts_with("runner-storage")).count();
    assert_eq!(storage, 2, "9 sessions served, 3 live: {threads:?}");
    for id in live {
        assert_eq!(s.call("DELETE", &format!("/v1/sessions/{id}"), None).0, 204);
    }
}
