//! Helpers shared by the integration tests.
#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

/// The busybox test image imported into the containerd of state dir `state`.
pub fn import_busybox(state: &Path) {
    let out = runner_ctd(
        &["image", "import", image_dir().join("busybox-oci.tar").to_str().unwrap()],
        state,
    );
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}

/// The built `runner` binary.
pub fn runner_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_runner"))
}

/// Run `runner ARGS` with a private state dir; returns its output.
pub fn runner(args: &[&str], state_dir: &Path) -> Output {
    Command::new(runner_bin())
        .args(args)
        .env("RUNNER_STATE_DIR", state_dir)
        .env_remove("HUID")
        .env_remove("HGID")
        .output()
        .expect("run runner")
}

/// Write a manifest into `dir` and return its path.
pub fn write_manifest(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Host-backend Environment + Job around `command` (YAML flow list or string).
pub fn host_job(name: &str, command: &str, extra_job: &str) -> String {
    format!(
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: host}}\nspec:\n  backend: host\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {name}}}\nspec:\n  environment: host\n  command: {command}\n{extra_job}"
    )
}

/// PIDs of live processes whose command line contains `needle`.
pub fn processes_matching(needle: &str) -> Vec<i32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        // Zombies have an empty cmdline; they hold no resources but a slot in the table.
        if text.contains(needle) {
            out.push(pid);
        }
    }
    out
}

/// Kill what a failed test left behind, so one failure does not leak into the next run.
pub fn kill_matching(needle: &str) {
    for pid in processes_matching(needle) {
        unsafe_kill(pid);
    }
}

fn unsafe_kill(pid: i32) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
}

/// Wait up to `limit` for `cond`.
pub fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    cond()
}

/// The private containerd the test script started, and the namespace to use. Panics with
/// instructions when absent: these tests never skip silently.
pub fn containerd_env() -> (PathBuf, String) {
    let address = std::env::var("CONTAINERD_ADDRESS").unwrap_or_else(|_| {
        panic!("containerd tests need CONTAINERD_ADDRESS and CONTAINERD_NAMESPACE: run scripts/test.sh, which starts a private containerd")
    });
    let namespace = std::env::var("CONTAINERD_NAMESPACE").unwrap_or_else(|_| "runner-test".into());
    (PathBuf::from(address), namespace)
}

/// Directory of the image archives the test script built.
pub fn image_dir() -> PathBuf {
    PathBuf::from(std::env::var("RUNNER_TEST_IMAGES").unwrap_or_else(|_| {
        panic!("containerd tests need RUNNER_TEST_IMAGES (built by scripts/test.sh from images/busybox/build.sh)")
    }))
}

/// `runner ARGS` set up for the test containerd and the given state dir, not yet run.
pub fn runner_ctd_command(args: &[&str], state_dir: &Path) -> Command {
    let (address, namespace) = containerd_env();
    let mut cmd = Command::new(runner_bin());
    cmd.args(args)
        .env("RUNNER_STATE_DIR", state_dir)
        .env("CONTAINERD_ADDRESS", address)
        .env("CONTAINERD_NAMESPACE", namespace)
        .env_remove("HUID")
        .env_remove("HGID");
    cmd
}

/// Run `runner` against the test containerd.
pub fn runner_ctd(args: &[&str], state_dir: &Path) -> Output {
    runner_ctd_command(args, state_dir).output().expect("run runner")
}

/// A command's stdout as JSON; the panic shows both streams.
pub fn json_of(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): stdout={} stderr={}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// Containers in the test namespace labelled as belonging to job (or session) `job`.
pub fn containers_of(job: &str) -> usize {
    containers_where(&format!("labels.\"runner.dev/job\"=={job}")).len()
}

/// The ids of the containers in the test namespace that `ctr containers ls` finds with
/// `filter`.
pub fn containers_where(filter: &str) -> Vec<String> {
    let (address, namespace) = containerd_env();
    let out = Command::new("ctr")
        .args([
            "--address",
            address.to_str().unwrap(),
            "--namespace",
            &namespace,
            "containers",
            "ls",
            "-q",
            filter,
        ])
        .output()
        .expect("run ctr");
    assert!(
        out.status.success(),
        "ctr containers ls: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect()
}

/// The PIDs of the `runner pool fill` processes of `pool` of `state`'s pools. A filler's own
/// short-lived helpers are not fillers (the child that holds a new user namespace while its id
/// maps are written shares the filler's memory, so its command line too): only processes whose
/// parent is not one are counted, and none gone since it was seen.
pub fn pool_fillers(state: &Path, pool: &str) -> Vec<u32> {
    let state = state.to_string_lossy().into_owned();
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let fill = args
            .windows(3)
            .any(|w| w[0] == "pool" && w[1] == "fill" && w[2] == pool);
        if fill && args.iter().any(|a| a.starts_with(&state)) {
            pids.push(pid);
        }
    }
    let parents: Vec<(u32, Option<i64>)> = pids.iter().map(|&pid| (pid, stat_field(pid, 1))).collect();
    parents
        .iter()
        .filter(|(_, parent)| parent.is_some_and(|p| !pids.iter().any(|&q| i64::from(q) == p)))
        .map(|(pid, _)| *pid)
        .collect()
}

/// Field `n` (0: the state) after the command name of /proc/PID/stat (`None` once it is gone).
pub fn stat_field(pid: u32, n: usize) -> Option<i64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(n)?.parse().ok()
}

/// A process that is gone or a zombie (exited, its parent yet to reap it).
pub fn exited(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
    })
}

/// The bearer token `serve_with` gives its server.
pub const SERVE_TOKEN: &str = "test-token-common-0123456789abcdef";

/// A `runner serve` on loopback, stopped (SIGTERM, as an operator stops it) when dropped.
pub struct Served {
    pub child: std::process::Child,
    pub url: String,
}

impl Drop for Served {
    fn drop(&mut self) {
        // A server the test already reaped is not signalled: its PID may be another's by now.
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let _ = self.child.wait();
    }
}

/// Start `cmd` (a runner command with its environment and global flags set) as
/// `serve --listen 127.0.0.1:0` with `SERVE_TOKEN`, the token file in `dir`.
pub fn serve_with(cmd: Command, dir: &Path) -> Served {
    serve_with_args(cmd, dir, &[])
}

/// As `serve_with`, with more `serve` options (`--env-dir DIR`).
pub fn serve_with_args(mut cmd: Command, dir: &Path, extra: &[&str]) -> Served {
    use std::io::BufRead;
    let token_file = dir.join("serve-token");
    std::fs::write(&token_file, format!("{SERVE_TOKEN}\n")).unwrap();
    let mut child = cmd
        .args(["serve", "--listen", "127.0.0.1:0", "--token-file"])
        .arg(&token_file)
        .args(extra)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("no listening line: {line:?}"))
        .to_string();
    Served { child, url }
}

impl Served {
    /// (status, JSON body, or the text as a JSON string) of a request with the token.
    pub fn call(&self, method: &str, path: &str, body: Option<&str>) -> (u16, serde_json::Value) {
        let req = ureq::request(method, &format!("{}{path}", self.url))
            .timeout(Duration::from_secs(120))
            .set("Authorization", &format!("Bearer {SERVE_TOKEN}"));
        let result = match body {
            Some(b) => req.send_string(b),
            None => req.call(),
        };
        let (code, text) = match result {
            Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
            Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap_or_default()),
            Err(e) => panic!("{method} {path}: {e}"),
        };
        (
            code,
            serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)),
        )
    }
}

/// The text between `<!-- generated: NAME -->` and `<!-- end: NAME -->` of `file` is
/// `content` (rewritten when UPDATE_DOCS is set).
pub fn check_generated(file: &Path, name: &str, content: &str) {
    let text = std::fs::read_to_string(file).unwrap();
    let (start, end) = (format!("<!-- generated: {name} -->\n"), format!("<!-- end: {name} -->"));
    let a = text
        .find(&start)
        .unwrap_or_else(|| panic!("{}: no {start:?}", file.display()))
        + start.len();
    let b = text[a..]
        .find(&end)
        .unwrap_or_else(|| panic!("{}: no {end:?}", file.display()))
        + a;
    if text[a..b] == *content {
        return;
    }
    if std::env::var_os("UPDATE_DOCS").is_some() {
        std::fs::write(file, format!("{}{content}{}", &text[..a], &text[b..])).unwrap();
        return;
    }
    panic!(
        "{} ({name}) does not match the code; UPDATE_DOCS=1 cargo test --test docs --test module_graph rewrites it.\nexpected:\n{content}\nfound:\n{}",
        file.display(),
        &text[a..b]
    );
}

/// `runner serve` on a state dir of its own into which the busybox and Python test images
/// were imported (what the live-sandbox tests start from).
pub struct ImagesServer {
    pub served: Served,
    /// Its state dir is `state` in here.
    pub dir: tempfile::TempDir,
}

pub fn serve_test_images() -> ImagesServer {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    for image in ["busybox-oci.tar", "python-oci.tar"] {
        let out = runner_ctd(&["image", "import", image_dir().join(image).to_str().unwrap()], &state);
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let served = serve_with(runner_ctd_command(&[], &state), dir.path());
    ImagesServer { served, dir }
}
