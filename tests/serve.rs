//! `runner serve` over HTTP against the private containerd of scripts/test.sh, with the
//! Python image from images/python/build.sh: reference 003's acceptance criteria (AC-2..5,
//! AC-7, AC-8), DNS blocked in `network: none`, auth, shell persistence and interruption,
//! files, Jobs.

mod common;

use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::*;

const TOKEN: &str = "test-token-0123456789abcdef-serve";

struct Server {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
    state: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
    }
}

fn server() -> Server {
    server_with(tempfile::tempdir().unwrap(), &[])
}

/// A server with more arguments (`dir` holds what they name; the state dir goes in it too).
fn server_with(dir: tempfile::TempDir, args: &[&str]) -> Server {
    let state = dir.path().join("state");
    for image in ["busybox-oci.tar", "python-oci.tar"] {
        let out = runner_ctd(&["image", "import", image_dir().join(image).to_str().unwrap()], &state);
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    }
    std::fs::write(dir.path().join("token"), format!("{TOKEN}\n")).unwrap();
    let (address, namespace) = containerd_env();
    let mut child = std::process::Command::new(runner_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--token-file"])
        .arg(dir.path().join("token"))
        .args(args)
        .env("RUNNER_STATE_DIR", &state)
        .env("CONTAINERD_ADDRESS", address)
        .env("CONTAINERD_NAMESPACE", namespace)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .expect("listening line")
        .to_string();
    Server {
        child,
        url,
        _dir: dir,
        state,
    }
}

/// (status, body) of a request; 4xx/5xx are answers too.
fn call(method: &str, url: &str, token: Option<&str>, body: Option<&str>) -> (u16, String) {
    let mut req = ureq::request(method, url).timeout(Duration::from_secs(120));
    if let Some(t) = token {
        req = req.set("Authorization", &format!("Bearer {t}"));
    }
    let result = match body {
        Some(b) => req.send_string(b),
        None => req.call(),
    };
    // Read whole: ureq's `into_string` gives up past 10 MB, and an answer at the output
    // limit is a little more.
    let text = |r: ureq::Response| {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut r.into_reader(), &mut text).map(|_| text)
    };
    match result {
        Ok(r) => (r.status(), text(r).unwrap_or_default()),
        Err(ureq::Error::Status(code, r)) => (code, text(r).unwrap_or_default()),
        Err(e) => panic!("{method} {url}: {e}"),
    }
}

/// A request over a plain socket, reading the answer even when the server answers (401,
/// 413) without reading the whole body.
fn raw(url: &str, method: &str, path: &str, token: Option<&str>, body: &str) -> String {
    use std::io::{Read, Write};
    let addr = url.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(body.as_bytes());
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer
}

fn ok_json(method: &str, url: &str, body: Option<&str>) -> serde_json::Value {
    let (status, text) = call(method, url, Some(TOKEN), body);
    assert!((200..300).contains(&status), "{method} {url}: {status} {text}");
    serde_json::from_str(&text).unwrap_or(serde_json::Value::Null)
}

fn session(s: &Server, environment: &str) -> String {
    let v = ok_json(
        "POST",
        &format!("{}/v1/sessions", s.url),
        Some(&format!(r#"{{"environment": {environment}}}"#)),
    );
    v["id"].as_str().unwrap().to_string()
}

#[test]
#[ignore = "needs a private containerd and the Python image: run scripts/test.sh"]
fn without_the_token_everything_but_healthz_is_401() {
    let s = server();
    assert_eq!(call("GET", &format!("{}/healthz", s.url), None, None).0, 200);
    assert!(raw(&s.url, "POST", "/v1/sessions", None, "{}").starts_with("HTTP/1.1 401"));
    assert_eq!(
        call("GET", &format!("{}/v1/sessions", s.url), Some("wrong-token"), None).0,
        401
    );
    assert_eq!(
        call(
            "GET",
            &format!("{}/v1/jobs", s.url),
            Some(&TOKEN[..TOKEN.len() - 1]),
            None
        )
        .0,
        401
    );
    let (status, body) = call("GET", &format!("{}/openapi.json", s.url), None, None);
    assert_eq!(status, 401);
    assert!(body.contains("\"error\""));
    let doc = ok_json("GET", &format!("{}/openapi.json", s.url), None);
    assert!(doc["paths"]["/v1/sessions/{id}/shell"].is_object());
    // Bodies are capped: 413 before anything runs (JSON above 4 MiB, anything above 64 MiB).
    let big = format!(r#"{{"environment": "{}"}}"#, "x".repeat(5 << 20));
    let answer = raw(&s.url, "POST", "/v1/sessions", Some(TOKEN), &big);
    assert!(
        answer.starts_with("HTTP/1.1 413"),
        "{}",
        &answer[..answer.len().min(200)]
    );
    assert!(answer.contains("too large"));
    let huge = "x".repeat(65 << 20);
    let answer = raw(&s.url, "PUT", "/v1/sessions/none/files?path=x", Some(TOKEN), &huge);
    assert!(
        answer.starts_with("HTTP/1.1 413"),
        "{}",
        &answer[..answer.len().min(200)]
    );
}

#[test]
#[ignore = "needs a private containerd and the Python image: run scripts/test.sh"]
fn exec_and_the_stateful_shell() {
    let s = server();
    let id = session(&s, r#"{"image": "local/python:3.11"}"#);
    let base = format!("{}/v1/sessions/{id}", s.url);
    let r = ok_json(
        "POST",
        &format!("{base}/exec"),
        Some(r#"{"command": ["sh", "-c", "echo out; echo err >&2; exit 5"]}"#),
    );
    assert_eq!(
        (r["exitCode"].as_i64(), r["stdout"].as_str(), r["stderr"].as_str()),
        (Some(5), Some("out\n"), Some("err\n"))
    );
    // The containerd operations behind it are timed in /metrics.
    let (status, metrics) = call("GET", &format!("{}/metrics", s.url), Some(TOKEN), None);
    assert_eq!(status, 200);
    for op in ["create", "start", "exec"] {
        assert!(
            metrics.contains(&format!("runner_container_operation_seconds_count{{op=\"{op}\"}}")),
            "{op}: {metrics}"
        );
    }
    ok_json(
        "POST",
        &format!("{base}/shell"),
        Some(r#"{"command": "cd /tmp && export X=yes"}"#),
    );
    let r = ok_json("POST", &format!("{base}/shell"), Some(r#"{"command": "pwd; echo $X"}"#));
    assert_eq!(r["output"], "/tmp\nyes\n");
    let start = Instant::now();
    let r = ok_json(
        "POST",
        &format!("{base}/shell"),
        Some(r#"{"command": "sleep 30", "timeoutSeconds": 1}"#),
    );
    assert!(start.elapsed() < Duration::from_secs(4));
    assert_eq!(r["timedOut"], true);
    let r = ok_json(
        "POST",
        &format!("{base}/shell"),
        Some(r#"{"command": "echo $X; cat; echo eof"}"#),
    );
    assert_eq!(
        r["output"], "yes\neof\n",
        "the shell survives the timeout; stdin is EOF"
    );
    // Named shells keep their own state; check=raise turns a failure into 422.
    let r = ok_json(
        "POST",
        &format!("{base}/shell"),
        Some(r#"{"command": "pwd", "name": "other"}"#),
    );
    assert_eq!(r["output"], "/workspace\n");
    let (status, _) = call(
        "POST",
        &format!("{base}/shell"),
        Some(TOKEN),
        Some(r#"{"command": "false", "check": "raise"}"#),
    );
    assert_eq!(status, 422);
    // The streaming variant: NDJSON events as they happen, the exit last.
    let resp = ureq::post(&format!("{base}/exec/stream"))
        .set("Authorization", &format!("Bearer {TOKEN}"))
        .send_string(r#"{"command": "echo one; echo two >&2; exit 3"}"#)
        .unwrap();
    assert_eq!(resp.header("content-type"), Some("application/x-ndjson"));
    let events: Vec<serde_json::Value> = resp
        .into_string()
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        events.iter().any(|e| e["type"] == "stdout" && e["data"] == "one\n"),
        "{events:?}"
    );
    assert!(
        events.iter().any(|e| e["type"] == "stderr" && e["data"] == "two\n"),
        "{events:?}"
    );
    assert_eq!(events.last().unwrap()["type"], "exit");
    assert_eq!(events.last().unwrap()["exitCode"], 3);
    // A background process that holds the output open: the stream still ends with the exit
    // (its later output is discarded, as for a plain exec), and the process lives on, still
    // read (it neither blocks nor dies of SIGPIPE when it writes).
    let resp = ureq::post(&format!("{base}/exec/stream"))
        .set("Authorization", &format!("Bearer {TOKEN}"))
        .timeout(Duration::from_secs(30))
        .send_string(
            r#"{"command": "(sleep 1; while :; do echo later; sleep 0.2; done) & echo $! >/tmp/bg-stream; echo started"}"#,
        )
        .unwrap();
    let body = resp
        .into_string()
        .expect("the stream ended within 30 s although a background process holds its output");
    let events: Vec<serde_json::Value> = body.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(events.last().unwrap()["type"], "exit", "{events:?}");
    assert_eq!(events.last().unwrap()["exitCode"], 0, "{events:?}");
    assert!(
        events.iter().any(|e| e["type"] == "stdout" && e["data"] == "started\n"),
        "{events:?}"
    );
    std::thread::sleep(Duration::from_secs(2));
    let r = ok_json(
        "POST",
        &format!("{base}/exec"),
        Some(r#"{"command": "kill -0 $(cat /tmp/bg-stream) && echo writer alive && kill $(cat /tmp/bg-stream)"}"#),
    );
    assert_eq!(r["stdout"], "writer alive\n", "{r}");
    // One that floods the output without a pause: the stream still ends (the server stops
    // forwarding a few MiB after the exit instead of following the flood for ever).
    let resp = ureq::post(&format!("{base}/exec/stream"))
        .set("Authorization", &format!("Bearer {TOKEN}"))
        .timeout(Duration::from_secs(60))
        .send_string(r#"{"command": "yes & echo $! >/tmp/yes-stream; echo started"}"#)
        .unwrap();
    let mut body = Vec::new();
    std::io::Read::read_to_end(&mut resp.into_reader(), &mut body)
        .expect("the stream ended within 60 s although a background process floods its output");
    let last = String::from_utf8_lossy(&body)
        .lines()
        .last()
        .unwrap_or_default()
        .to_string();
    assert!(last.contains(r#""type":"exit""#), "{last}");
    let r = ok_json(
        "POST",
        &format!("{base}/exec"),
        Some(r#"{"command": "kill $(cat /tmp/yes-stream) && echo flood stopped"}"#),
    );
    assert_eq!(r["stdout"], "flood stopped\n", "{r}");
    let (status, _) = call("DELETE", &base, Some(TOKEN), None);
    assert_eq!(status, 204);
    // Deleting the session leaves no container.
    assert_eq!(containers_of(&id), 0, "the session's container remains");
    assert_eq!(
        call(
            "POST",
            &format!("{base}/exec"),
            Some(TOKEN),
            Some(r#"{"command": "true"}"#)
        )
        .0,
        404
    );
}

#[test]
#[ignore = "needs a private containerd and the Python image: run scripts/test.sh"]
fn the_persistent_python_session() {
    let s = server();
    let id = session(
        &s,
        r#"{"image": "local/python:3.11", "resources": {"memory": "256Mi", "cpu": "2"}}"#,
    );
    let base = format!("{}/v1/sessions/{id}", s.url);
    // AC-2: state persists between calls.
    let r = ok_json("POST", &format!("{base}/python"), Some(r#"{"code": "x = 42"}"#));
    assert!(r["vars"].as_array().unwrap().iter().any(|v| v == "x"), "{r}");
    // AC-3/AC-4: variables listed with type and summary, read by name.
    let vars = ok_json("GET", &format!("{base}/python/vars"), None);
    assert!(
        vars.as_array()
            .unwrap()
            .iter()
            .any(|v| v["name"] == "x" && v["type"] == "int"),
        "{vars}"
    );
    assert_eq!(ok_json("GET", &format!("{base}/python/vars/x"), None)["value"], 42);
    // A value JSON cannot hold (an evaluation's `inf` or `nan` score) comes back as its repr,
    // and the interpreter keeps its state.
    ok_json(
        "POST",
        &format!("{base}/python"),
        Some(r#"{"code": "d = {'score': float('inf'), 'loss': float('nan'), 'ok': 1}; big = [10**40]"}"#),
    );
    assert_eq!(
        ok_json("GET", &format!("{base}/python/vars/d"), None)["value"]["repr"],
        "{'score': inf, 'loss': nan, 'ok': 1}"
    );
    assert_eq!(
        ok_json("GET", &format!("{base}/python/vars/big"), None)["value"]["repr"],
        format!("[{}]", "1".to_string() + &"0".repeat(40))
    );
    assert_eq!(ok_json("GET", &format!("{base}/python/vars/x"), None)["value"], 42);
    // AC-5: output of later code sees earlier state.
    let r = ok_json(
        "POST",
        &format!("{base}/python"),
        Some(r#"{"code": "y = x + 1; print(y)"}"#),
    );
    assert_eq!(r["output"], "43\n");
    // AC-8: a timeout stops the code, reports it, and the interpreter carries on.
    let start = Instant::now();
    let r = ok_json(
        "POST",
        &format!("{base}/python"),
        Some(r#"{"code": "import time; time.sleep(30)", "timeoutSeconds": 2}"#),
    );
    assert!(start.elapsed() < Duration::from_secs(6));
    assert!(r["error"].as_str().unwrap_or_default().contains("Timeout"), "{r}");
    let r = ok_json(
        "POST",
        &format!("{base}/python"),
        Some(r#"{"code": "print(\"after\", y)"}"#),
    );
    assert_eq!(r["output"], "after 43\n");
    // AC-7: an allocation over the memory limit fails gracefully and is reported.
    let r = ok_json(
        "POST",
        &format!("{base}/python"),
        Some(r#"{"code": "big = b'x' * (1024 * 1024 * 1024)"}"#),
    );
    let error = r["error"].as_str().unwrap_or_default().to_string();
    assert!(error.contains("Memory"), "{r}");
    let r = ok_json(
        "POST",
        &format!("{base}/python"),
        Some(r#"{"code": "print('usable')"}"#),
    );
    assert_eq!(r["output"], "usable\n");
    // DNS fails in network: none.
    let r = ok_json(
        "POST",
        &format!("{base}/python"),
        Some(
            r#"{"code": "import socket\ntry:\n    socket.gethostbyname('example.com')\n    print('resolved')\nexcept OSError as e:\n    print('blocked')"}"#,
        ),
    );
    assert_eq!(r["output"], "blocked\n");
    call("DELETE", &base, Some(TOKEN), None);
    let left = runner_ctd(&["gc"], &s.state);
    assert!(String::from_utf8_lossy(&left.stdout).starts_with("removed 0 containers"));
}

/// Reference 003's acceptance list through its own routes and shapes (`/sandbox/…`), as a
/// client of that reference would call them after changing only its base URL.
#[test]
#[ignore = "needs a private containerd and the Python image: run scripts/test.sh"]
fn reference_003_acceptance_through_its_own_routes() {
    let s = server();
    let id = session(
        &s,
        r#"{"image": "local/python:3.11", "resources": {"memory": "256Mi"}}"#,
    );
    let base = format!("{}/v1/sessions/{id}/sandbox", s.url);
    // AC-2: exactly {output, stderr, vars}.
    let r = ok_json("POST", &format!("{base}/exec"), Some(r#"{"code": "x = 42"}"#));
    assert_eq!(r, serde_json::json!({"output": "", "stderr": "", "vars": ["x"]}));
    // AC-3, AC-4.
    let vars = ok_json("GET", &format!("{base}/vars"), None);
    assert_eq!(vars, serde_json::json!([{"name": "x", "type": "int", "summary": "42"}]));
    assert_eq!(
        ok_json("GET", &format!("{base}/var/x"), None),
        serde_json::json!({"value": 42})
    );
    // AC-5: state persists.
    ok_json("POST", &format!("{base}/exec"), Some(r#"{"code": "x = 1"}"#));
    let r = ok_json("POST", &format!("{base}/exec"), Some(r#"{"code": "print(x)"}"#));
    assert_eq!(r["output"], "1\n");
    // AC-6: DNS does not resolve.
    let r = ok_json(
        "POST",
        &format!("{base}/exec"),
        Some(
            r#"{"code": "import socket\ntry:\n    socket.gethostbyname('example.com'); print('resolved')\nexcept OSError:\n    print('blocked')"}"#,
        ),
    );
    assert_eq!(r["output"], "blocked\n");
    // AC-7: an allocation over the limit fails gracefully.
    let r = ok_json(
        "POST",
        &format!("{base}/exec"),
        Some(r#"{"code": "big = b'x' * (1024 ** 3)"}"#),
    );
    assert!(r["error"].as_str().unwrap_or_default().contains("Memory"), "{r}");
    // AC-8: `timeout` (seconds) stops the code and returns an error.
    let start = Instant::now();
    let r = ok_json(
        "POST",
        &format!("{base}/exec"),
        Some(r#"{"code": "import time; time.sleep(30)", "timeout": 2}"#),
    );
    assert!(start.elapsed() < Duration::from_secs(6));
    assert!(r["error"].as_str().unwrap_or_default().contains("Timeout"), "{r}");
    let r = ok_json(
        "POST",
        &format!("{base}/exec"),
        Some(r#"{"code": "print('still here')"}"#),
    );
    assert_eq!(r["output"], "still here\n");
    call("DELETE", &format!("{}/v1/sessions/{id}", s.url), Some(TOKEN), None);
}

/// With IPython in the image, a session's Python is IPython's shell: `_`, magics, a cell's
/// value as output without a prompt, errors apart from the output; the shapes do not change.
#[test]
#[ignore = "needs a private containerd and the IPython image: run scripts/test.sh"]
fn ipython_runs_the_python_of_an_image_that_has_it() {
    let s = server();
    let image = image_dir().join("python-ipython-oci.tar");
    let out = runner_ctd(&["image", "import", image.to_str().unwrap()], &s.state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let id = session(&s, r#"{"image": "local/python-ipython:3.11"}"#);
    let base = format!("{}/v1/sessions/{id}/sandbox", s.url);
    let r = ok_json("POST", &format!("{base}/exec"), Some(r#"{"code": "x = 41"}"#));
    assert_eq!(r, serde_json::json!({"output": "", "stderr": "", "vars": ["x"]}));
    let r = ok_json("POST", &format!("{base}/exec"), Some(r#"{"code": "x + 1"}"#));
    assert_eq!(r["output"], "42\n");
    let r = ok_json("POST", &format!("{base}/exec"), Some(r#"{"code": "_ + 1"}"#));
    assert_eq!(r["output"], "43\n", "IPython's `_`: {r}");
    let r = ok_json("POST", &format!("{base}/exec"), Some(r#"{"code": "%time y = 2"}"#));
    assert!(r["output"].as_str().unwrap().contains("Wall time"), "{r}");
    let vars = ok_json("GET", &format!("{base}/vars"), None);
    let names: Vec<&str> = vars
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["x", "y"], "IPython's own names stay hidden: {vars}");
    let r = ok_json("POST", &format!("{base}/exec"), Some(r#"{"code": "1/0"}"#));
    assert!(r["error"].as_str().unwrap().contains("ZeroDivisionError"), "{r}");
    assert_eq!(r["output"], "");
    let r = ok_json(
        "POST",
        &format!("{base}/exec"),
        Some(r#"{"code": "import time; time.sleep(30)", "timeout": 1}"#),
    );
    assert!(r["error"].as_str().unwrap_or_default().contains("Timeout"), "{r}");
    let r = ok_json("POST", &format!("{base}/exec"), Some(r#"{"code": "print(x)"}"#));
    assert_eq!(r["output"], "41\n");
    call("DELETE", &format!("{}/v1/sessions/{id}", s.url), Some(TOKEN), None);
}

#[test]
#[ignore = "needs a private containerd and the Python image: run scripts/test.sh"]
fn files_round_trip_through_the_workspace() {
    let s = server();
    let id = session(&s, r#"{"image": "local/busybox:1.35"}"#);
    let base = format!("{}/v1/sessions/{id}", s.url);
    let (status, _) = call(
        "PUT",
        &format!("{base}/files?path=sub/a.txt"),
        Some(TOKEN),
        Some("hello file"),
    );
    assert_eq!(status, 204);
    let r = ok_json(
        "POST",
        &format!("{base}/exec"),
        Some(r#"{"command": ["cat", "sub/a.txt"]}"#),
    );
    assert_eq!(r["stdout"], "hello file");
    ok_json(
        "POST",
        &format!("{base}/exec"),
        Some(r#"{"command": ["sh", "-c", "echo made > sub/b.txt"]}"#),
    );
    assert_eq!(
        call("GET", &format!("{base}/files?path=sub/b.txt"), Some(TOKEN), None).1,
        "made\n"
    );
    let list = ok_json("GET", &format!("{base}/files/list?path=sub"), None);
    let names: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["a.txt", "b.txt"]);
    assert_eq!(
        call("GET", &format!("{base}/files?path=../etc/passwd"), Some(TOKEN), None).0,
        400
    );
    // Upload a tar.
    let mut tar = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    header.set_size(3);
    header.set_mode(0o644);
    header.set_cksum();
    tar.append_data(&mut header, "up/c.txt", &b"tar"[..]).unwrap();
    let bytes = tar.into_inner().unwrap();
    let resp = ureq::post(&format!("{base}/files/upload"))
        .set("Authorization", &format!("Bearer {TOKEN}"))
        .send_bytes(&bytes)
        .unwrap();
    assert_eq!(resp.status(), 200);
    let report: serde_json::Value = serde_json::from_str(&resp.into_string().unwrap()).unwrap();
    assert_eq!(report["files"], 1, "{report}");
    let r = ok_json(
        "POST",
        &format!("{base}/exec"),
        Some(r#"{"command": ["cat", "up/c.txt"]}"#),
    );
    assert_eq!(r["stdout"], "tar");
    call("DELETE", &base, Some(TOKEN), None);
}

#[test]
#[ignore = "needs a private containerd and the Python image: run scripts/test.sh"]
fn jobs_over_http_use_the_cli_code_paths() {
    let s = server();
    let manifest = "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: bb}\nspec:\n  image: local/busybox:1.35\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: http-job}\nspec:\n  environment: bb\n  command: [\"sh\", \"-c\", \"cat; echo from-http\"]\n  stdin: \"via-http\\n\"\n";
    let created = ok_json("POST", &format!("{}/v1/jobs", s.url), Some(manifest));
    assert_eq!(created["created"][0], "http-job");
    let start = Instant::now();
    loop {
        let job = ok_json("GET", &format!("{}/v1/jobs/http-job", s.url), None);
        if job["status"]["phase"] == "Succeeded" {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "{job}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        call("GET", &format!("{}/v1/jobs/http-job/logs", s.url), Some(TOKEN), None).1,
        "via-http\nfrom-http\n"
    );
    let list = ok_json("GET", &format!("{}/v1/jobs", s.url), None);
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(
        call("DELETE", &format!("{}/v1/jobs/http-job", s.url), Some(TOKEN), None).0,
        204
    );
    assert_eq!(
        call("GET", &format!("{}/v1/jobs/http-job", s.url), Some(TOKEN), None).0,
        404
    );
}

/// Everything under `dir`: relative name → (size, mode, mtime), to prove nothing changed.
fn snapshot(dir: &std::path::Path) -> std::collections::BTreeMap<String, (u64, u32, i64)> {
    use std::os::unix::fs::MetadataExt;
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let m = e.path().symlink_metadata().unwrap();
            let name = e.path().strip_prefix(dir).unwrap().display().to_string();
            out.insert(name, (m.len(), m.mode(), m.mtime()));
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
    out
}

/// A tar holding `(name, data)` members, names written raw (`..` and absolute names too).
fn raw_tar(members: &[(&str, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, data) in members {
        let mut header = tar::Header::new_old();
        header.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_entry_type(tar::EntryType::Regular);
        header.set_cksum();
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }
    out.resize(out.len() + 1024, 0);
    out
}

/// The sandbox plants symlinks (absolute and relative, to a host directory) at every position
/// of the paths the file API is asked for, and flips a directory and such a symlink in a tight
/// loop while the API reads, writes, lists and unpacks 1,000 times: nothing outside the
/// workspace is ever read, created or changed.
#[test]
#[ignore = "needs a private containerd and the Python image: run scripts/test.sh"]
fn the_file_api_never_leaves_the_workspace() {
    let s = server();
    let host = tempfile::tempdir().unwrap();
    let outside = host.path().join("outside");
    std::fs::create_dir_all(outside.join("sub")).unwrap();
    std::fs::write(outside.join("secret"), "host secret").unwrap();
    std::fs::write(outside.join("sub/secret"), "host secret").unwrap();
    let before = snapshot(host.path());
    let id = session(&s, r#"{"image": "local/busybox:1.35"}"#);
    let base = format!("{}/v1/sessions/{id}", s.url);
    let out = outside.display().to_string();
    let sh = |script: &str| {
        let body = serde_json::json!({"command": ["sh", "-c", script]}).to_string();
        let r = ok_json("POST", &format!("{base}/exec"), Some(&body));
        assert_eq!(r["exitCode"], 0, "{script}: {r}");
    };
    // Planted links: absolute to the host dir, relative climbing out, at first, middle, last.
    sh(&format!(
        "ln -s {out} abs && ln -s ../../../../../../../{out} rel && mkdir -p real/deep && ln -s {out} real/abs && ln -s {out}/secret last && ln -s ../.. real/up && echo inside > real/file"
    ));
    let secret_free = |body: &str| assert!(!body.contains("host secret"), "{body}");
    for path in [
        "abs/secret",
        "rel/secret",
        "real/abs/secret",
        "last",
        "abs/sub/secret",
        "real/up/secret",
        "/abs/secret",
        "real/deep/../../abs/secret",
    ] {
        let (status, body) = call("GET", &format!("{base}/files?path={path}"), Some(TOKEN), None);
        assert!((400..500).contains(&status), "read {path}: {status} {body}");
        secret_free(&body);
        let (status, body) = call("PUT", &format!("{base}/files?path={path}"), Some(TOKEN), Some("pwned"));
        assert!((400..500).contains(&status), "write {path}: {status} {body}");
        let (status, body) = call(
            "PUT",
            &format!("{base}/files?path={path}/a/b/c/x"),
            Some(TOKEN),
            Some("pwned"),
        );
        assert!((400..500).contains(&status), "write under {path}: {status} {body}");
        let (status, body) = call(
            "POST",
            &format!("{base}/files/mkdir?path={path}/made"),
            Some(TOKEN),
            None,
        );
        assert!((400..500).contains(&status), "mkdir {path}: {status} {body}");
        let (_, body) = call("GET", &format!("{base}/files/list?path={path}"), Some(TOKEN), None);
        assert!(!body.contains("\"secret\""), "list {path}: {body}");
        let (_, body) = call("GET", &format!("{base}/files/download?path={path}"), Some(TOKEN), None);
        secret_free(&body);
        let upload = raw_tar(&[("x", b"pwned")]);
        let resp = ureq::post(&format!("{base}/files/upload?path={path}"))
            .set("Authorization", &format!("Bearer {TOKEN}"))
            .send_bytes(&upload);
        assert!(resp.is_err(), "upload into {path} was accepted");
    }
    // Reading inside still works, and a download keeps links as links.
    assert_eq!(
        call("GET", &format!("{base}/files?path=real/file"), Some(TOKEN), None).1,
        "inside\n"
    );
    let (status, body) = call("GET", &format!("{base}/files/download?path=real"), Some(TOKEN), None);
    assert_eq!(status, 200);
    secret_free(&body);
    // Archives: `..`, absolute names, a link member and a member through it.
    for members in [vec![("../escape", &b"x"[..])], vec![("a/../../escape", &b"x"[..])]] {
        let resp = ureq::post(&format!("{base}/files/upload"))
            .set("Authorization", &format!("Bearer {TOKEN}"))
            .send_bytes(&raw_tar(&members));
        assert!(matches!(resp, Err(ureq::Error::Status(400, _))), "{members:?}");
    }
    let mut linked = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Symlink);
    h.set_size(0);
    linked.append_link(&mut h, "lnk", &outside).unwrap();
    let mut h = tar::Header::new_gnu();
    h.set_size(5);
    h.set_mode(0o644);
    h.set_cksum();
    linked.append_data(&mut h, "lnk/planted", &b"pwned"[..]).unwrap();
    let resp = ureq::post(&format!("{base}/files/upload"))
        .set("Authorization", &format!("Bearer {TOKEN}"))
        .send_bytes(&linked.into_inner().unwrap());
    assert!(matches!(resp, Err(ureq::Error::Status(400, _))));
    let absolute = raw_tar(&[(&format!("{out}/abs-name"), b"inside")]);
    let resp = ureq::post(&format!("{base}/files/upload?path=absdir"))
        .set("Authorization", &format!("Bearer {TOKEN}"))
        .send_bytes(&absolute)
        .unwrap();
    assert_eq!(
        resp.status(),
        200,
        "an absolute name is extracted inside, its / stripped"
    );
    assert_eq!(before, snapshot(host.path()), "something outside changed");

    // The race: the sandbox swaps `flip` between a directory and a link to the host dir.
    sh(&format!(
        "mkdir -p flip; sh -c 'while :; do rm -rf flip; ln -s {out} flip; rm -f flip; mkdir -p flip; echo in > flip/x; done' >/dev/null 2>&1 &"
    ));
    let (mut ok, mut refused) = (0, 0);
    for i in 0..1000 {
        let (w, _) = call(
            "PUT",
            &format!("{base}/files?path=flip/x"),
            Some(TOKEN),
            Some(&format!("w{i}")),
        );
        let (r, body) = call("GET", &format!("{base}/files?path=flip/x"), Some(TOKEN), None);
        secret_free(&body);
        let (_, listing) = call("GET", &format!("{base}/files/list?path=flip"), Some(TOKEN), None);
        assert!(!listing.contains("\"secret\""), "{listing}");
        for status in [w, r] {
            if (200..300).contains(&status) {
                ok += 1;
            } else {
                refused += 1;
            }
        }
    }
    eprintln!("race: {ok} operations succeeded, {refused} were refused");
    assert!(
        ok > 0 && refused > 0,
        "the race was not exercised both ways: {ok} ok, {refused} refused"
    );
    assert_eq!(before, snapshot(host.path()), "something outside changed");
    call("DELETE", &base, Some(TOKEN), None);
}

/// `POST /v1/sessions` takes a whole Environment document as pasted from a manifest, and
/// refuses a document of another kind naming the field.
#[test]
#[ignore = "needs a private containerd and the Python image: run scripts/test.sh"]
fn a_session_takes_a_whole_environment_document() {
    let s = server();
    let doc = r#"{"apiVersion": "runner/v1alpha1", "kind": "Environment", "metadata": {"name": "pasted"}, "spec": {"image": "local/busybox:1.35", "env": {"FROM": "document"}}}"#;
    let id = session(&s, doc);
    let r = ok_json(
        "POST",
        &format!("{}/v1/sessions/{id}/exec", s.url),
        Some(r#"{"command": ["sh", "-c", "echo $FROM"]}"#),
    );
    assert_eq!(r["stdout"], "document\n");
    // Sessions get a user namespace of their own by default, and none with hostUsers: true.
    let uid_map = |id: &str| {
        let r = ok_json(
            "POST",
            &format!("{}/v1/sessions/{id}/exec", s.url),
            Some(r#"{"command": ["cat", "/proc/self/uid_map"]}"#),
        );
        let text = r["stdout"].as_str().unwrap().to_string();
        text.split_whitespace()
            .map(|t| t.parse::<u64>().unwrap())
            .collect::<Vec<_>>()
    };
    let map = uid_map(&id);
    assert!(map[0] == 0 && map[1] >= 1 << 30 && map[2] == 65536, "{map:?}");
    call("DELETE", &format!("{}/v1/sessions/{id}", s.url), Some(TOKEN), None);
    let host_users = session(
        &s,
        r#"{"apiVersion": "runner/v1alpha1", "kind": "Environment", "metadata": {"name": "hu"}, "spec": {"image": "local/busybox:1.35", "hostUsers": true}}"#,
    );
    assert_eq!(uid_map(&host_users), [0, 0, 4294967295]);
    call(
        "DELETE",
        &format!("{}/v1/sessions/{host_users}", s.url),
        Some(TOKEN),
        None,
    );
    for (bad, field) in [
        (
            r#"{"apiVersion": "runner/v1alpha1", "kind": "Job", "spec": {}}"#,
            "environment.kind",
        ),
        (
            r#"{"apiVersion": "v1", "kind": "Environment", "spec": {}}"#,
            "environment.apiVersion",
        ),
        (
            r#"{"apiVersion": "runner/v1alpha1", "kind": "Environment", "spec": {}, "status": {}}"#,
            "environment.status",
        ),
        (
            r#"{"apiVersion": "runner/v1alpha1", "kind": "Environment", "spec": {"image": "x", "memory": 1}}"#,
            "spec.memory",
        ),
    ] {
        let (status, body) = call(
            "POST",
            &format!("{}/v1/sessions", s.url),
            Some(TOKEN),
            Some(&format!(r#"{{"environment": {bad}}}"#)),
        );
        assert_eq!(status, 400, "{bad}: {body}");
        assert!(body.contains(field), "{bad}: {body}");
    }
}

/// The resident shell (issue 14): one long-lived shell per named shell, on bash (the python
/// image) and busybox `sh`. Everything a terminal user expects to persist persists; output is
/// framed exactly; a timeout stops the command and keeps the shell and its state; a command
/// that ignores SIGINT gets SIGTERM; one that makes the shell itself deaf is killed with it
/// and the answer says the state is lost; `exit` ends the shell and the next call gets a new one.
#[test]
#[ignore = "needs a private containerd and the Python image: run scripts/test.sh"]
fn the_resident_shell_keeps_state_frames_output_and_survives_timeouts() {
    let s = server();
    for (image, bash) in [("local/python:3.11", true), ("local/busybox:1.35", false)] {
        let id = session(&s, &format!(r#"{{"image": "{image}"}}"#));
        let base = format!("{}/v1/sessions/{id}", s.url);
        let sh = |command: &str, timeout: u32| {
            ok_json(
                "POST",
                &format!("{base}/shell"),
                Some(&serde_json::json!({"command": command, "timeoutSeconds": timeout}).to_string()),
            )
        };
        let out = |command: &str| sh(command, 20)["output"].as_str().unwrap().to_string();
        // State: plain (unexported) variables, functions, aliases, options, the directory.
        sh(
            "v=plain; f() { echo \"fn $1\"; }; alias hi='echo aliased'; set -u; cd /tmp",
            20,
        );
        assert_eq!(out("echo $v; f 1; hi; pwd"), "plain\nfn 1\naliased\n/tmp\n", "{image}");
        let r = sh("echo $undefined_var", 20);
        assert_eq!(r["exitCode"].as_i64().map(|c| c != 0), Some(true), "{image}: {r}");
        assert_eq!(r["timedOut"], false, "{image}: {r}");
        sh("set +u", 20);
        // A special builtin's error ends the command and the call, not the shell (busybox's
        // sh dropped the call's status line with it: each call waited its whole timeout).
        // (bash, outside POSIX mode, goes on after `set -Z`.)
        for (command, said, aborts) in [
            ("set -Z; echo not reached", "-Z", !bash),
            ("readonly ro=1; ro=2; echo not reached", "ro", true),
            ("echo ${unset_here?is unset}; echo not reached", "is unset", true),
        ] {
            let r = sh(command, 20);
            assert_eq!(r["timedOut"], false, "{image}: {command}: {r}");
            let output = r["output"].as_str().unwrap();
            assert!(output.contains(said), "{image}: {command}: {r}");
            assert_eq!(output.contains("not reached"), !aborts, "{image}: {command}: {r}");
            assert_eq!(r["exitCode"] != 0, aborts, "{image}: {command}: {r}");
        }
        assert_eq!(out("echo $v"), "plain\n", "{image}: the shell's state after the errors");
        if bash {
            sh("shopt -s extglob; declare -A m=([k]=v)", 20);
            assert_eq!(out("echo ${m[k]}; shopt -q extglob && echo on"), "v\non\n");
        }
        // Framing: text that looks like the protocol, no trailing newline, NUL and invalid
        // UTF-8, exit codes exactly, stderr interleaved, more than a pipe's buffer.
        let r = sh(
            "printf 'N1-1 0\\nS1-1 0\\nR1 5\\nX1 0'; printf '\\000\\377'; echo e >&2; (exit 42)",
            20,
        );
        assert_eq!(r["exitCode"], 42);
        assert_eq!(r["output"], "N1-1 0\nS1-1 0\nR1 5\nX1 0\u{0}\u{fffd}e\n", "{image}");
        assert_eq!(sh("false", 20)["exitCode"], 1);
        assert_eq!(
            out("i=0; while [ $i -lt 20000 ]; do echo line$i; i=$((i+1)); done | wc -l").trim(),
            "20000"
        );
        let big = out("i=0; while [ $i -lt 20000 ]; do echo 0123456789; i=$((i+1)); done");
        assert_eq!(big.len(), 220_000, "{image}: all of it, framed at its end");
        // Over the output limit (10 MiB): its head and tail, and what was cut, counted.
        let r = sh("head -c 11000000 /dev/zero | tr '\\000' x; echo END", 60);
        let output = r["output"].as_str().unwrap();
        assert_eq!(output.len(), 10 * 1024 * 1024, "{image}");
        assert!(output.starts_with("xxxx") && output.ends_with("xxEND\n"), "{image}");
        assert_eq!(r["outputDroppedBytes"], 11_000_004 - 10 * 1024 * 1024, "{image}");
        assert!(sh("echo small", 20).get("outputDroppedBytes").is_none(), "{image}");
        // A pipeline whose writer dies of SIGPIPE: its output alone (bash without a terminal
        // says it could not restore the terminal's modes; on a terminal it says nothing).
        assert_eq!(out("yes | head -2; echo after"), "y\ny\nafter\n", "{image}");
        // A quote, a heredoc, a syntax error: each is one call. Tabs and carriage returns are
        // text, not line editing; a NUL is refused.
        assert_eq!(out("echo \"it's\"; cat <<EOF\nhere\nEOF"), "it's\nhere\n");
        assert_eq!(
            out("cat <<EOF\n\tindented\nEOF\nprintf '%s' 'x\ry'"),
            "\tindented\nx\ry",
            "{image}"
        );
        let (status, _) = call(
            "POST",
            &format!("{base}/shell"),
            Some(TOKEN),
            Some(r#"{"command": "echo a\u0000b"}"#),
        );
        assert_eq!(status, 400);
        // A background job that keeps the output open does not take the call's output away.
        // (bash says `[1] PID` for the job, as on a terminal.)
        let kept = out("sleep 30 & echo kept");
        assert!(kept.ends_with("kept\n"), "{image}: {kept:?}");
        let r = sh("echo (", 20);
        assert!(r["exitCode"].as_i64().unwrap() != 0, "{image}: {r}");
        assert_eq!(out("echo still $v"), "still plain\n");
        // Timeouts: an external command, then a loop of builtins in the shell itself. The
        // state and a background job live on.
        sh("sleep 300 & echo $! >/tmp/bg", 20);
        let start = Instant::now();
        let r = sh("sleep 30", 1);
        assert!(start.elapsed() < Duration::from_secs(5), "{image}");
        assert_eq!(r["timedOut"], true);
        assert_eq!(r["exitCode"], 130, "{image}: the interrupted command's status");
        let r = sh("while :; do :; done", 1);
        assert_eq!(r["timedOut"], true, "{image}: {r}");
        if r["output"].as_str().unwrap().contains("state is lost") {
            // busybox's ash hangs on about one interrupt in 300 of a loop of builtins (see
            // `resident.rs`): the shell is killed and the answer says so. bash never does.
            assert!(!bash, "{image}: {r}");
            assert_eq!(out("echo ${v:-fresh}"), "fresh\n", "{image}");
            sh("v=plain; sleep 300 & echo $! >/tmp/bg", 20);
        }
        assert_eq!(
            out("echo $v; kill -0 $(cat /tmp/bg) && echo bg alive"),
            "plain\nbg alive\n",
            "{image}"
        );
        // A child that ignores SIGINT gets SIGTERM; the shell keeps its state.
        let r = sh("sh -c 'trap \"\" INT; sleep 30'", 1);
        assert_eq!(r["timedOut"], true);
        assert_eq!(out("echo $v"), "plain\n", "{image}");
        // Background jobs that end while the shell waits for its next call (the SIGTERM above
        // ended the earlier ones too) leave it and its state alone: busybox's ash once took
        // the SIGCHLD that interrupted its read for the end of its input, and exited.
        sh("sleep 0.2 & sleep 0.3 &", 20);
        std::thread::sleep(Duration::from_millis(800));
        assert_eq!(out("echo $v"), "plain\n", "{image}");
        // Named shells are separate processes and run at once.
        let other = std::thread::scope(|scope| {
            let slow = scope.spawn(|| sh("sleep 2; echo slow", 20));
            std::thread::sleep(Duration::from_millis(300));
            let start = Instant::now();
            let r = ok_json(
                "POST",
                &format!("{base}/shell"),
                Some(r#"{"command": "echo ${v:-unset}", "name": "other"}"#),
            );
            assert!(
                start.elapsed() < Duration::from_secs(1),
                "{image}: the other shell waited"
            );
            assert_eq!(slow.join().unwrap()["output"], "slow\n");
            r
        });
        assert_eq!(other["output"], "unset\n");
        // A shell deaf to SIGINT (and, being interactive, to SIGTERM) is killed: said so.
        let r = sh("trap '' INT; while :; do :; done", 1);
        assert_eq!(r["timedOut"], true);
        assert!(r["output"].as_str().unwrap().contains("state is lost"), "{image}: {r}");
        assert_eq!(out("echo ${v:-fresh}"), "fresh\n", "{image}");
        // exit: its status, then a fresh shell.
        sh("v=again", 20);
        let r = sh("echo bye; exit 3", 20);
        assert_eq!(
            (
                r["exitCode"].as_i64(),
                r["output"].as_str().map(|o| o.starts_with("bye\n"))
            ),
            (Some(3), Some(true)),
            "{image}: {r}"
        );
        assert_eq!(out("echo ${v:-fresh}"), "fresh\n", "{image}");
        ok_json("DELETE", &base, None);
    }
}

/// SWE-ReX's routes on a containerd session run in the resident shell: every shell variable
/// persists (as in SWE-ReX's own bash), the wrapper leaves none of its own, a timeout is
/// SWE-ReX's CommandTimeoutError and the session stays usable, and closing a bash session
/// ends its shell process.
#[test]
#[ignore = "needs a private containerd and the Python image: run scripts/test.sh"]
fn swerex_bash_sessions_in_a_sandbox_are_resident_shells() {
    let s = server();
    let id = session(&s, r#"{"image": "local/python:3.11"}"#);
    let base = format!("{}/v1/sessions/{id}", s.url);
    let shells = |what: &str| {
        let r = ok_json(
            "POST",
            &format!("{base}/exec"),
            Some(
                &serde_json::json!({"command": ["sh", "-c",
                    "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' <$f; echo; done | grep -c '^/usr/bin/bash --norc --noprofile --noediting -i' || true"]})
                .to_string(),
            ),
        );
        assert_eq!(r["exitCode"], 0, "{what}: {r}");
        r["stdout"].as_str().unwrap().trim().parse::<u32>().unwrap()
    };
    // The session's `default` shell starts with the session, before any call asks for it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while shells("before any call") == 0 {
        assert!(Instant::now() < deadline, "the default shell never started");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(shells("before any call"), 1);
    let rx = |route: &str, body: serde_json::Value| {
        call(
            "POST",
            &format!("{base}/swerex/{route}"),
            Some(TOKEN),
            Some(&body.to_string()),
        )
    };
    // check=ignore: SWE-ReX asks for no exit code, so `$?` carries over to the next command.
    let run = |command: &str| {
        let (status, text) = rx(
            "run_in_session",
            serde_json::json!({"action_type": "bash", "session": "s", "command": command, "check": "ignore"}),
        );
        assert_eq!(status, 200, "{command}: {text}");
        serde_json::from_str::<serde_json::Value>(&text).unwrap()
    };
    assert_eq!(rx("create_session", serde_json::json!({"session": "s"})).0, 200);
    run("x=41; y=$((x+1)); false");
    let r = run("echo $? $y; set | grep '^__rx_'");
    assert_eq!(r["output"], "1 42\n", "{r}");
    let (status, text) = rx(
        "run_in_session",
        serde_json::json!({"action_type": "bash", "session": "s", "command": "sleep 30", "timeout": 1}),
    );
    assert_eq!(status, 511, "{text}");
    assert!(text.contains("CommandTimeoutError"), "{text}");
    assert_eq!(run("echo $y")["output"], "42\n");
    // Beside the session's `default` shell.
    assert_eq!(shells("open"), 2);
    assert_eq!(rx("close_session", serde_json::json!({"session": "s"})).0, 200);
    assert_eq!(shells("closed"), 1, "closing the bash session ends its shell");
}

/// Sessions from the warm pool `serve --pool` keeps: the member's sandbox gets the session's
/// workspace, Environment variables, setup and hostname late, runs the resident shell and the
/// file API as a cold one does, is destroyed when the session ends, and the pool is refilled.
/// A session whose Environment the pool does not fit starts cold.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn sessions_start_from_the_warm_pool_serve_keeps() {
    let dir = tempfile::tempdir().unwrap();
    let envs = dir.path().join("envs");
    std::fs::create_dir_all(&envs).unwrap();
    std::fs::write(
        envs.join("pooled.yaml"),
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: pooled-bb}\nspec:\n  image: local/busybox:1.35\n  workdir: /workspace\n  user: \"1000:1000\"\n  env: {FOO: bar}\n  setup:\n    commands: [\"echo set up > /tmp/setup-ran\"]\n",
    )
    .unwrap();
    let envs = envs.to_str().unwrap().to_string();
    let s = server_with(dir, &["--env-dir", &envs, "--pool", "pooled-bb=2"]);
    let created = ok_json(
        "POST",
        &format!("{}/v1/sessions", s.url),
        Some(r#"{"environment": "pooled-bb"}"#),
    );
    assert_eq!(created["pool"], "pooled-bb", "{created}");
    let id = created["id"].as_str().unwrap();
    let base = format!("{}/v1/sessions/{id}", s.url);
    let r = ok_json(
        "POST",
        &format!("{base}/exec"),
        Some(r#"{"command": ["sh", "-c", "echo $FOO; id -u; pwd; hostname; cat /tmp/setup-ran; echo hi > made.txt"]}"#),
    );
    assert_eq!(r["exitCode"], 0, "{r}");
    let out = r["stdout"].as_str().unwrap();
    assert!(out.starts_with("bar\n1000\n/workspace\n"), "{out}");
    assert!(out.ends_with("set up\n"), "{out}");
    // The workspace the file API serves is the one the sandbox writes.
    let (status, body) = call("GET", &format!("{base}/files?path=made.txt"), Some(TOKEN), None);
    assert_eq!((status, body.as_str()), (200, "hi\n"));
    ok_json(
        "POST",
        &format!("{base}/shell"),
        Some(r#"{"command": "cd /tmp && export X=kept"}"#),
    );
    let r = ok_json(
        "POST",
        &format!("{base}/shell"),
        Some(r#"{"command": "pwd; echo $X $FOO"}"#),
    );
    assert_eq!(r["output"], "/tmp\nkept bar\n");
    let ls = || json_of(&runner_ctd(&["pool", "ls", "-o", "json"], &s.state));
    assert_eq!(call("DELETE", &base, Some(TOKEN), None).0, 204);
    assert!(
        eventually(Duration::from_secs(60), || ls()[0]["ready"] == 2),
        "the pool was not refilled: {}",
        ls()
    );
    // The server waited for its claims to pause before it started the filler: the filler
    // does not wait again (its report says how long it did). The report is printed once
    // the filler is done, a moment after its member is counted ready.
    let log_path = s.state.join("pools").join("pooled-bb.log");
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        eventually(Duration::from_secs(30), || log().contains("waited")),
        "no filler's report: {}",
        log()
    );
    let log = log();
    let fills: Vec<&str> = log.lines().filter(|l| l.contains("waited")).collect();
    assert!(
        fills.iter().all(|l| l.contains("waited 0 ms")),
        "a server's filler waited again: {log}"
    );
    // An Environment the pool does not fit (another image) starts cold.
    let cold = ok_json(
        "POST",
        &format!("{}/v1/sessions", s.url),
        Some(r#"{"environment": {"image": "local/python:3.11"}}"#),
    );
    assert!(cold.get("pool").is_none(), "{cold}");
    call(
        "DELETE",
        &format!("{}/v1/sessions/{}", s.url, cold["id"].as_str().unwrap()),
        Some(TOKEN),
        None,
    );
    let out = runner_ctd(&["pool", "rm", "pooled-bb"], &s.state);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A harness's pool over HTTP (Inspect's task_init / task_cleanup): made from an inline
/// Environment, claimed by a session of the same Environment, refilled, and gone with every
/// member after DELETE; a request the pool cannot serve is refused naming its field.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn pools_over_http_are_made_claimed_and_removed() {
    let s = server();
    let env =
        r#"{"image": "local/busybox:1.35", "resources": {"memory": "128Mi", "cpu": "1"}, "env": {"WHO": "pool"}}"#;
    let made = ok_json(
        "POST",
        &format!("{}/v1/pools", s.url),
        Some(&format!(r#"{{"name": "http-pool", "environment": {env}, "size": 1}}"#)),
    );
    assert_eq!(
        (made["ready"].as_u64(), made["workspace"].as_bool()),
        (Some(1), Some(true)),
        "{made}"
    );
    let session = ok_json(
        "POST",
        &format!("{}/v1/sessions", s.url),
        Some(&format!(r#"{{"environment": {env}}}"#)),
    );
    assert_eq!(session["pool"], "http-pool", "{session}");
    let base = format!("{}/v1/sessions/{}", s.url, session["id"].as_str().unwrap());
    let r = ok_json(
        "POST",
        &format!("{base}/exec"),
        Some(r#"{"command": ["sh", "-c", "echo $WHO"]}"#),
    );
    assert_eq!(r["stdout"], "pool\n", "{r}");
    assert_eq!(call("DELETE", &base, Some(TOKEN), None).0, 204);
    let list = || ok_json("GET", &format!("{}/v1/pools", s.url), None);
    assert!(
        eventually(Duration::from_secs(60), || list()[0]["ready"] == 1),
        "the pool was not refilled: {}",
        list()
    );
    // What a pool cannot hold is refused before anything is made.
    let (status, body) = call(
        "POST",
        &format!("{}/v1/pools", s.url),
        Some(TOKEN),
        Some(r#"{"name": "bridged", "environment": {"image": "local/busybox:1.35", "network": "bridge"}}"#),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("environment: ") && body.contains("bridge"), "{body}");
    let removed = ok_json("DELETE", &format!("{}/v1/pools/http-pool", s.url), None);
    assert_eq!(removed["removed"].as_array().map(Vec::len), Some(1), "{removed}");
    assert_eq!(list(), serde_json::json!([]));
    assert_eq!(
        call("DELETE", &format!("{}/v1/pools/http-pool", s.url), Some(TOKEN), None).0,
        404
    );
    // Nothing of the pool is left in containerd.
    let (address, namespace) = containerd_env();
    let out = std::process::Command::new("ctr")
        .args(["--address", address.to_str().unwrap(), "--namespace", &namespace])
        .args(["containers", "ls", "-q"])
        .output()
        .unwrap();
    let left = String::from_utf8_lossy(&out.stdout);
    assert!(!left.contains("pool-http-pool"), "{left}");
}

/// SIGTERM stops the server within `--shutdown-grace` whatever its sandboxes do: a call whose
/// command never ends, and a streamed one whose client never reads, are cut at the end of the
/// grace period, and their sessions' containers are gone after the server exits.
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn sigterm_stops_the_server_within_its_grace_whatever_the_sandboxes_do() {
    let mut s = server_with(tempfile::tempdir().unwrap(), &["--shutdown-grace", "2s"]);
    let (a, b) = (
        session(&s, r#"{"image": "local/busybox:1.35"}"#),
        session(&s, r#"{"image": "local/busybox:1.35"}"#),
    );
    let url = s.url.clone();
    let held = std::thread::spawn({
        let url = url.clone();
        move || {
            call(
                "POST",
                &format!("{url}/v1/sessions/{a}/exec"),
                Some(TOKEN),
                Some(r#"{"command": ["sleep", "975"]}"#),
            )
        }
    });
    // A streamed flood to a client that reads nothing.
    let streamed = raw_stream(&url, &format!("/v1/sessions/{b}/exec/stream"), r#"{"command": "yes"}"#);
    assert!(eventually(Duration::from_secs(10), || !processes_matching("sleep 975").is_empty()));
    let stopped = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(s.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let exited = eventually(Duration::from_secs(10), || s.child.try_wait().unwrap().is_some());
    let took = stopped.elapsed();
    eprintln!("serve stopped {took:?} after SIGTERM (grace 2s; a call in flight, a stream unread)");
    assert!(exited, "the server did not stop within 10 s");
    assert!(took < Duration::from_secs(4), "{took:?}");
    drop(streamed);
    let _ = held.join();
    assert!(
        processes_matching("sleep 975").is_empty(),
        "the session's container outlived the server"
    );
}

/// Open a streamed call over a plain socket and return it unread.
fn raw_stream(url: &str, path: &str, body: &str) -> std::net::TcpStream {
    use std::io::Write;
    let addr = url.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(body.as_bytes()).unwrap();
    stream
}

/// A command that overruns its timeout right after its session was created answers as timed
/// out, its whole tree killed. The default shell the session starts meanwhile is orphaned to
/// the agent in the same clock tick as the command's process: the host must signal the
/// command's process (the one the kernel confirms), not the shell (it once answered 500 after
/// 6.5 s, the command left running, in 24 of 25 tries).
#[test]
#[ignore = "needs a private containerd: run scripts/test.sh"]
fn a_timeout_right_after_create_kills_the_command_not_the_shell() {
    let s = server();
    for i in 0..6 {
        let id = session(&s, r#"{"image": "local/python:3.11"}"#);
        let r = ok_json(
            "POST",
            &format!("{}/v1/sessions/{id}/exec", s.url),
            Some(
                r#"{"command": ["/bin/sh", "-c", "exec \"$@\" 2>&1", "a", "bash", "-lc", "echo before; sleep 10"], "timeoutSeconds": 1}"#,
            ),
        );
        assert_eq!(
            (&r["timedOut"], &r["stdout"]),
            (&true.into(), &"before\n".into()),
            "try {i}: {r}"
        );
        // The default shell lives on, with the session's state.
        let r = ok_json(
            "POST",
            &format!("{}/v1/sessions/{id}/shell", s.url),
            Some(r#"{"command": "x=1; echo $x"}"#),
        );
        assert_eq!(r["output"], "1\n", "try {i}: {r}");
        let (code, _) = call("DELETE", &format!("{}/v1/sessions/{id}", s.url), Some(TOKEN), None);
        assert_eq!(code, 204);
    }
}
