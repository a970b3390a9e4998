//! The HTTP API in-process: `router()` on the host backend, no socket, no containerd (part of
//! the ordinary `cargo test`). Auth, the status of every kind of failure, path escapes, jobs,
//! and the OpenAPI document against what is served. Also the session logic called from the
//! library, without HTTP.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use runner::api::{AppState, router};
use runner::config::Config;
use runner::service::sessions::{Check, EnvironmentRef, NewSession, SessionManager, ShellRequest};
use runner::service::{Connect, Context, Invalid, ServiceError};
use serde_json::{Value, json};
use tower::ServiceExt;

const TOKEN: &str = "api-test-token-0123456789";

struct Api {
    app: axum::Router,
    state: Arc<AppState>,
    dir: tempfile::TempDir,
}

/// A server state over a fresh state dir. containerd is a socket that does not exist: the
/// host backend works, anything needing containerd is unavailable.
fn api() -> Api {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::new(dir.path().join("state"));
    config.address = Some(dir.path().join("no-containerd.sock"));
    config.namespace = "api-test".into();
    // Detached jobs run `runner supervise`: this test binary is not runner.
    config.runner_exe = Some(env!("CARGO_BIN_EXE_runner").into());
    let ctx = Context::new(config, Connect::Existing).unwrap();
    let state = Arc::new(AppState::new(TOKEN.as_bytes().to_vec(), ctx, Duration::from_secs(600)));
    Api {
        app: router(state.clone()),
        state,
        dir,
    }
}

impl Api {
    async fn send(&self, method: &str, path: &str, token: Option<&str>, body: Body) -> (StatusCode, Vec<u8>) {
        let mut request = Request::builder().method(method).uri(path);
        if let Some(t) = token {
            request = request.header("authorization", format!("Bearer {t}"));
        }
        let response = self.app.clone().oneshot(request.body(body).unwrap()).await.unwrap();
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), 64 << 20).await.unwrap();
        (status, bytes.to_vec())
    }

    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        let body = body.map_or_else(Body::empty, |b| Body::from(b.to_string()));
        let (status, bytes) = self.send(method, path, Some(TOKEN), body).await;
        (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }

    async fn session(&self, workspace: &Path) -> String {
        let (status, body) = self
            .call(
                "POST",
                "/v1/sessions",
                Some(json!({"environment": {"backend": "host"}, "workspace": workspace})),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        body["id"].as_str().unwrap().to_string()
    }
}

/// PIDs of this process's children that are zombies.
fn zombie_children() -> Vec<i32> {
    let me = std::process::id().to_string();
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: comm may hold spaces, so split after its ')'.
        let Some((head, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.first() == Some(&"Z") && fields.get(1) == Some(&me.as_str()) {
            out.push(head.split_whitespace().next().unwrap_or("0").parse().unwrap_or(0));
        }
    }
    out
}

fn host_manifest(name: &str, command: &str) -> String {
    format!(
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: h}}\nspec: {{backend: host}}\n---\n\
         apiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {name}}}\nspec:\n  environment: h\n  command: {command:?}\n"
    )
}

#[tokio::test]
async fn without_the_token_everything_but_healthz_is_401() {
    let api = api();
    assert_eq!(api.send("GET", "/healthz", None, Body::empty()).await.0, StatusCode::OK);
    for (method, path) in [
        ("GET", "/v1/sessions"),
        ("POST", "/v1/sessions"),
        ("GET", "/v1/jobs"),
        ("DELETE", "/v1/jobs/x"),
        ("GET", "/openapi.json"),
    ] {
        for token in [None, Some("wrong-token-0123456789"), Some("")] {
            let (status, body) = api.send(method, path, token, Body::empty()).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {path} {token:?}");
            assert!(String::from_utf8_lossy(&body).contains("bearer token"));
        }
    }
    // The scheme in any case, as RFC 9110 has it; the token itself exactly.
    for (header, want) in [
        (format!("bearer {TOKEN}"), StatusCode::OK),
        (format!("BEARER {TOKEN}"), StatusCode::OK),
        (format!("Basic {TOKEN}"), StatusCode::UNAUTHORIZED),
        (format!("Bearer {}", TOKEN.to_uppercase()), StatusCode::UNAUTHORIZED),
        (format!("Bearer{TOKEN}"), StatusCode::UNAUTHORIZED),
    ] {
        let request = Request::builder()
            .uri("/v1/sessions")
            .header("authorization", &header)
            .body(Body::empty())
            .unwrap();
        let status = api.app.clone().oneshot(request).await.unwrap().status();
        assert_eq!(status, want, "{header}");
    }
}

#[tokio::test]
async fn each_kind_of_failure_has_its_status() {
    let api = api();
    let work = tempfile::tempdir().unwrap();
    let id = api.session(work.path()).await;

    // 400: unreadable JSON, a wrong field, a bad manifest (naming the field).
    let (status, body) = api
        .call("POST", &format!("/v1/sessions/{id}/exec"), Some(json!({"nope": 1})))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, body) = api
        .call("POST", &format!("/v1/sessions/{id}/exec"), Some(json!({"command": []})))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body["error"].as_str().unwrap().contains("command"), "{body}");
    let (status, body) = api
        .call(
            "POST",
            &format!("/v1/sessions/{id}/shell"),
            Some(json!({"command": "true", "name": "a b"})),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let bad = api
        .send(
            "POST",
            "/v1/jobs",
            Some(TOKEN),
            Body::from(
                "apiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: x}\nspec: {command: 7, nonsense: 1}\n",
            ),
        )
        .await;
    assert_eq!(bad.0, StatusCode::BAD_REQUEST, "{}", String::from_utf8_lossy(&bad.1));
    let (status, body) = api
        .call(
            "POST",
            "/v1/sessions",
            Some(json!({"environment": {"apiVersion": "runner/v1alpha1", "kind": "Job", "spec": {}}})),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(
        body["error"].as_str().unwrap().starts_with("environment.kind"),
        "{body}"
    );

    // axum's own rejections answer JSON too: a query string that does not parse, a method
    // the route lacks (with its Allow header), a terminal without its upgrade.
    for (method, path, want) in [
        ("GET", "/v1/jobs/x/logs?stream=bogus", StatusCode::BAD_REQUEST),
        ("GET", "/v1/jobs/x/logs?tailLines=-1", StatusCode::BAD_REQUEST),
        ("PUT", "/v1/sessions", StatusCode::METHOD_NOT_ALLOWED),
        ("GET", &format!("/v1/sessions/{id}/pty"), StatusCode::BAD_REQUEST),
    ] {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header("authorization", format!("Bearer {TOKEN}"))
            .body(Body::empty())
            .unwrap();
        let response = api.app.clone().oneshot(request).await.unwrap();
        let (status, headers) = (response.status(), response.headers().clone());
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        let body: Value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}: {}", String::from_utf8_lossy(&bytes)));
        assert_eq!(status, want, "{method} {path}: {body}");
        assert!(
            !body["error"].as_str().unwrap_or_default().is_empty(),
            "{method} {path}: {body}"
        );
        assert_eq!(headers["content-type"], "application/json", "{method} {path}");
        if want == StatusCode::METHOD_NOT_ALLOWED {
            assert!(headers.contains_key("allow"), "{method} {path}: {headers:?}");
        }
    }

    // 404: a session, a job, a route that does not exist.
    for path in [
        "/v1/sessions/s-nope",
        "/v1/jobs/nope",
        "/v1/jobs/nope/logs",
        "/v1/nothing",
    ] {
        let (status, body) = api.call("GET", path, None).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}: {body}");
    }
    assert_eq!(api.call("DELETE", "/v1/jobs/nope", None).await.0, StatusCode::NOT_FOUND);

    // 413: a declared length over the cap is refused before the body is read.
    let request = Request::builder()
        .method("PUT")
        .uri(format!("/v1/sessions/{id}/files?path=big"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("content-length", (65u64 << 20).to_string())
        .body(Body::from("small"))
        .unwrap();
    let response = api.app.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);

    // 422: a command that fails under check: raise; the body still carries its output.
    let (status, body) = api
        .call(
            "POST",
            &format!("/v1/sessions/{id}/shell"),
            Some(json!({"command": "echo out; exit 3", "check": "raise"})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(body["exitCode"], 3);
    assert_eq!(body["output"], "out\n");
    assert!(body["error"].as_str().unwrap().contains("exit code 3"), "{body}");
    // ... and a session whose setup fails.
    let (status, body) = api
        .call(
            "POST",
            "/v1/sessions",
            Some(json!({"environment": {"backend": "host", "setup": {"commands": ["exit 9"]}}})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");

    // 501: the persistent Python interpreter needs a sandbox.
    let (status, body) = api
        .call("POST", &format!("/v1/sessions/{id}/python"), Some(json!({"code": "1"})))
        .await;
    assert_eq!(status, StatusCode::NOT_IMPLEMENTED, "{body}");

    // 503: containerd is unreachable (never started behind a request).
    let (status, body) = api
        .call(
            "POST",
            "/v1/sessions",
            Some(json!({"environment": {"image": "local/busybox:1.35"}})),
        )
        .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body["error"].as_str().unwrap().contains("containerd"), "{body}");
    assert!(
        !api.dir.path().join("state/containerd").exists(),
        "a request started a containerd"
    );
}

#[tokio::test]
async fn exec_shell_and_files_on_the_host_backend() {
    let api = api();
    let work = tempfile::tempdir().unwrap();
    let id = api.session(work.path()).await;
    let (status, r) = api
        .call(
            "POST",
            &format!("/v1/sessions/{id}/exec"),
            Some(json!({"command": ["sh", "-c", "cat; echo err >&2"], "stdin": "in"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{r}");
    assert_eq!(
        (r["exitCode"].clone(), r["stdout"].clone(), r["stderr"].clone()),
        (json!(0), json!("in"), json!("err\n"))
    );
    let shell = |command: &str| json!({"command": command});
    api.call(
        "POST",
        &format!("/v1/sessions/{id}/shell"),
        Some(shell("export A=1; mkdir -p d; cd d")),
    )
    .await;
    let (_, r) = api
        .call("POST", &format!("/v1/sessions/{id}/shell"), Some(shell("echo $A; pwd")))
        .await;
    assert_eq!(r["output"], format!("1\n{}/d\n", work.path().display()));
    // A directory whose name holds a quote is kept as well.
    api.call(
        "POST",
        &format!("/v1/sessions/{id}/shell"),
        Some(shell("mkdir -p \"it's\" && cd \"it's\"")),
    )
    .await;
    let (_, r) = api
        .call("POST", &format!("/v1/sessions/{id}/shell"), Some(shell("pwd")))
        .await;
    assert_eq!(r["output"], format!("{}/d/it's\n", work.path().display()));

    let put = api
        .send(
            "PUT",
            &format!("/v1/sessions/{id}/files?path=a/b/c.txt"),
            Some(TOKEN),
            Body::from("hello"),
        )
        .await;
    assert_eq!(put.0, StatusCode::NO_CONTENT);
    assert_eq!(std::fs::read_to_string(work.path().join("a/b/c.txt")).unwrap(), "hello");
    let got = api
        .send(
            "GET",
            &format!("/v1/sessions/{id}/files?path=a/b/c.txt"),
            Some(TOKEN),
            Body::empty(),
        )
        .await;
    assert_eq!((got.0, got.1), (StatusCode::OK, b"hello".to_vec()));
    let (status, listing) = api
        .call("GET", &format!("/v1/sessions/{id}/files/list?path=a/b"), None)
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(listing[0]["name"], "c.txt");
    assert_eq!(listing[0]["type"], "file");

    // Escapes: `..`, absolute paths and links out of the workspace are refused, and nothing
    // outside is read or made.
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), "host secret").unwrap();
    std::os::unix::fs::symlink(outside.path(), work.path().join("evil")).unwrap();
    for path in ["../x", "a/../../x", "evil/secret", "evil/new/file"] {
        let got = api
            .send(
                "GET",
                &format!("/v1/sessions/{id}/files?path={path}"),
                Some(TOKEN),
                Body::empty(),
            )
            .await;
        assert!(
            got.0 == StatusCode::BAD_REQUEST || got.0 == StatusCode::NOT_FOUND,
            "{path}: {}",
            got.0
        );
        assert!(!String::from_utf8_lossy(&got.1).contains("host secret"));
        let put = api
            .send(
                "PUT",
                &format!("/v1/sessions/{id}/files?path={path}"),
                Some(TOKEN),
                Body::from("x"),
            )
            .await;
        assert_eq!(
            put.0,
            StatusCode::BAD_REQUEST,
            "{path}: {}",
            String::from_utf8_lossy(&put.1)
        );
    }
    assert!(!outside.path().join("new").exists());
    assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 1);
    // An absolute path names a path of the workspace (as `docker cp` names the container's).
    let put = api
        .send(
            "PUT",
            &format!("/v1/sessions/{id}/files?path=/abs.txt"),
            Some(TOKEN),
            Body::from("in"),
        )
        .await;
    assert_eq!(put.0, StatusCode::NO_CONTENT);
    assert_eq!(std::fs::read_to_string(work.path().join("abs.txt")).unwrap(), "in");

    assert_eq!(
        api.call("DELETE", &format!("/v1/sessions/{id}"), None).await.0,
        StatusCode::NO_CONTENT
    );
    assert_eq!(
        api.call("GET", &format!("/v1/sessions/{id}"), None).await.0,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_run_detached_and_a_running_one_is_not_applied_again() {
    let api = api();
    let submit = |text: String| api.send("POST", "/v1/jobs", Some(TOKEN), Body::from(text));
    let (status, body) = submit(host_manifest("quick", "echo hi")).await;
    assert_eq!(status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&body));
    assert_eq!(
        serde_json::from_slice::<Value>(&body).unwrap()["created"],
        json!(["quick"])
    );
    let mut phase = Value::Null;
    for _ in 0..300 {
        let (status, job) = api.call("GET", "/v1/jobs/quick", None).await;
        assert_eq!(status, StatusCode::OK, "{job}");
        phase = job["status"]["phase"].clone();
        if phase == "Succeeded" || phase == "Failed" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(phase, "Succeeded");
    let logs = api.send("GET", "/v1/jobs/quick/logs", Some(TOKEN), Body::empty()).await;
    assert_eq!((logs.0, logs.1), (StatusCode::OK, b"hi\n".to_vec()));
    // Its supervisor (our child) is reaped: a zombie would pile up in a long-lived server and
    // look like a live supervisor.
    let mut zombies = zombie_children();
    for _ in 0..50 {
        if zombies.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        zombies = zombie_children();
    }
    assert!(zombies.is_empty(), "zombie children: {zombies:?}");

    // 409: the same job again while it runs.
    assert_eq!(submit(host_manifest("slow", "sleep 30")).await.0, StatusCode::CREATED);
    let (status, body) = submit(host_manifest("slow", "sleep 30")).await;
    assert_eq!(status, StatusCode::CONFLICT, "{}", String::from_utf8_lossy(&body));
    let (_, list) = api.call("GET", "/v1/jobs?labelSelector=", None).await;
    assert_eq!(list.as_array().unwrap().len(), 2, "{list}");
    let (_, job) = api.call("GET", "/v1/jobs/slow", None).await;
    assert_eq!(job["spec"]["backend"], "host", "{job}");
    for name in ["slow", "quick"] {
        assert_eq!(
            api.call("DELETE", &format!("/v1/jobs/{name}"), None).await.0,
            StatusCode::NO_CONTENT
        );
        assert_eq!(
            api.call("GET", &format!("/v1/jobs/{name}"), None).await.0,
            StatusCode::NOT_FOUND
        );
    }
}

#[tokio::test]
async fn every_documented_route_is_served_and_every_served_route_documented() {
    let api = api();
    let work = tempfile::tempdir().unwrap();
    let id = api.session(work.path()).await;
    let (status, doc) = api.call("GET", "/openapi.json", None).await;
    assert_eq!(status, StatusCode::OK);
    let paths = doc["paths"].as_object().unwrap();
    let mut documented = Vec::new();
    for (path, operations) in paths {
        for (method, operation) in operations.as_object().unwrap() {
            documented.push(format!("{} {path}", method.to_uppercase()));
            // Every body schema the document refers to is in it.
            let text = operation.to_string();
            for reference in text.split("\"$ref\":\"#/components/schemas/").skip(1) {
                let name = reference.split('"').next().unwrap();
                assert!(
                    doc["components"]["schemas"].get(name).is_some(),
                    "{path}: {name} undefined"
                );
            }
            let concrete = path.replace("{id}", &id).replace("{name}", "x");
            let (status, body) = api
                .call(&method.to_uppercase(), &format!("{concrete}?path=."), None)
                .await;
            assert_ne!(status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
            assert!(
                !body["error"].as_str().unwrap_or("").starts_with("no route"),
                "{method} {path} is documented but not served"
            );
        }
    }
    // What the router serves, probed by method: any method/path pair not documented is
    // answered 405 or "no route".
    for path in paths.keys() {
        let concrete = path.replace("{id}", &id).replace("{name}", "x");
        for method in ["GET", "POST", "PUT", "DELETE", "PATCH"] {
            if documented.contains(&format!("{method} {path}")) {
                continue;
            }
            let (status, _) = api.call(method, &concrete, None).await;
            assert!(
                status == StatusCode::METHOD_NOT_ALLOWED || status == StatusCode::NOT_FOUND,
                "{method} {path} is served ({status}) but not documented"
            );
        }
    }
    assert!(documented.len() >= 23, "{documented:?}");
    // A compatibility face documents its own failure shapes, not ours.
    let swerex = &paths["/v1/sessions/{id}/swerex/run_in_session"]["post"]["responses"];
    assert!(swerex.get("511").is_some() && swerex.get("401").is_some(), "{swerex}");
    assert!(swerex.get("409").is_none(), "{swerex}");
    drop(api.state);
}

#[tokio::test]
async fn sessions_are_callable_from_the_library_without_http() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = Context::new(Config::new(dir.path().join("state")), Connect::Existing).unwrap();
    let manager = SessionManager::new(ctx, Duration::from_millis(200));
    let mut spec = serde_json::Map::new();
    spec.insert("backend".into(), "host".into());
    let view = manager
        .create(NewSession::new(EnvironmentRef::Spec(spec)))
        .await
        .unwrap();
    let session = manager.lease(&view.id).unwrap();
    let first = session
        .shell(ShellRequest {
            command: "cd /; X=kept; export X".into(),
            timeout: None,
            check: Check::Raise,
            name: None,
        })
        .await
        .unwrap();
    assert_eq!(first.exit_code, Some(0));
    let second = session
        .shell(ShellRequest {
            command: "echo $X $(pwd)".into(),
            timeout: None,
            check: Check::Ignore,
            name: None,
        })
        .await
        .unwrap();
    assert_eq!(second.output, "kept /\n");
    let failed = session
        .shell(ShellRequest {
            command: "exit 4".into(),
            timeout: None,
            check: Check::Raise,
            name: None,
        })
        .await;
    assert!(
        matches!(&failed, Err(ServiceError::Invalid(Invalid::Failed(out))) if out.exit_code == Some(4)),
        "{failed:?}"
    );
    session.write_file("f.txt", "data".into()).await.unwrap();
    assert_eq!(session.list_files("").await.unwrap().entries.len(), 1);

    // Held by a call, a session is not idle, however long the call takes.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(manager.reap_idle().await.is_empty(), "a leased session was reaped");
    assert_eq!(manager.get(&view.id).unwrap().active_calls, 1);
    drop(session);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(manager.reap_idle().await, vec![view.id.clone()]);
    assert!(matches!(manager.lease(&view.id), Err(ServiceError::NotFound { .. })));
}

#[tokio::test]
async fn metrics_count_requests_by_route_sessions_jobs_and_errors() {
    let api = api();
    let work = tempfile::tempdir().unwrap();
    let id = api.session(work.path()).await;
    for _ in 0..3 {
        let (status, _) = api
            .call(
                "POST",
                &format!("/v1/sessions/{id}/exec"),
                Some(json!({"command": "true"})),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
    }
    assert_eq!(api.call("GET", "/v1/jobs/missing", None).await.0, StatusCode::NOT_FOUND);
    assert_eq!(
        api.send("GET", "/metrics", None, Body::empty()).await.0,
        StatusCode::UNAUTHORIZED
    );
    let (status, body) = api.send("GET", "/metrics", Some(TOKEN), Body::empty()).await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8(body).unwrap();
    // By route template, never by concrete id.
    let exec =
        "runner_http_request_duration_seconds_count{route=\"/v1/sessions/{id}/exec\",method=\"POST\",status=\"200\"}";
    let count: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix(exec))
        .unwrap_or_else(|| panic!("no {exec} in\n{text}"))
        .trim()
        .parse()
        .unwrap();
    assert!(count >= 3, "{count}");
    assert!(!text.contains(&id), "a session id became a label");
    assert!(text.contains("runner_sessions_live{backend=\"host\"} 1\n"), "{text}");
    assert!(text.contains("runner_jobs{phase=\"Running\"} 0\n"), "{text}");
    assert!(text.contains("runner_errors_total{kind=\"not_found\"}"), "{text}");
    assert!(text.contains("runner_errors_total{kind=\"unauthorized\"}"), "{text}");
    assert!(
        text.contains("# TYPE runner_http_request_duration_seconds histogram"),
        "{text}"
    );
}

/// A client that is slow to read a stream still gets all of it, the exit last. After the
/// command exited, its output pump may wait for the client longer than the drain limit (2 s,
/// meant for pipes an escaped process holds open); the pump was cut there, the pipe's last
/// bytes lost and the exit sent all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_of_a_stream_gets_all_of_it() {
    use futures::StreamExt;
    let api = api();
    let work = tempfile::tempdir().unwrap();
    let id = api.session(work.path()).await;
    // The command writes until its pipe is full (so the pump is waiting for the client: every
    // channel after the pipe is full too), says how much it wrote, and exits.
    // (Full for half a second: a pump between two reads leaves it full for a moment.)
    let fill = "import os, time\nos.set_blocking(1, False)\nn, full = 0, None\nwhile full is None or time.monotonic() - full < 0.5:\n    try:\n        n += os.write(1, b'a' * 65536)\n        full = None\n    except BlockingIOError:\n        full = full or time.monotonic()\n        time.sleep(0.01)\nopen('written', 'w').write(str(n))\n";
    let request = Request::builder()
        .method("POST")
        .uri(format!("/v1/sessions/{id}/exec/stream"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(Body::from(json!({"command": ["python3", "-c", fill]}).to_string()))
        .unwrap();
    let response = api.app.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let written = work.path().join("written");
    for _ in 0..300 {
        if written.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The client reads nothing for longer than the drain limit after the command's end.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let written: usize = std::fs::read_to_string(&written).unwrap().parse().unwrap();
    let mut body = response.into_body().into_data_stream();
    let mut text = Vec::new();
    while let Some(frame) = tokio::time::timeout(Duration::from_secs(60), body.next())
        .await
        .expect("the stream stalled")
    {
        text.extend_from_slice(&frame.unwrap());
    }
    let events: Vec<Value> = String::from_utf8(text)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let stdout: usize = events
        .iter()
        .filter(|e| e["type"] == "stdout")
        .map(|e| e["data"].as_str().unwrap().len())
        .sum();
    assert_eq!(stdout, written, "the stream lost output");
    let last = events.last().unwrap();
    assert_eq!(last["type"], "exit", "{last}");
    assert_eq!(last["exitCode"], 0, "{last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_stream_stops_its_command_and_frees_the_session() {
    let api = api();
    let work = tempfile::tempdir().unwrap();
    let id = api.session(work.path()).await;
    let request = Request::builder()
        .method("POST")
        .uri(format!("/v1/sessions/{id}/exec/stream"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(Body::from(json!({"command": "sleep 60"}).to_string()))
        .unwrap();
    let response = api.app.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    // The client goes away without reading.
    drop(response);
    // The session runs one command at a time: the next one must not wait for `sleep 60`.
    let next = tokio::time::timeout(
        Duration::from_secs(20),
        api.call(
            "POST",
            &format!("/v1/sessions/{id}/exec"),
            Some(json!({"command": "echo free"})),
        ),
    )
    .await
    .expect("the dropped stream's command still holds the session");
    assert_eq!(next.1["stdout"], "free\n", "{}", next.1);
}

#[tokio::test]
async fn a_containerd_job_is_refused_while_containerd_is_unreachable() {
    let api = api();
    let manifest = "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: c}\nspec: {image: local/busybox:1.35}\n---\n\
                    apiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: never}\nspec: {environment: c, command: \"true\"}\n";
    let (status, body) = api.send("POST", "/v1/jobs", Some(TOKEN), Body::from(manifest)).await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(api.call("GET", "/v1/jobs/never", None).await.0, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_bad_session_request_names_its_own_field() {
    let api = api();
    for (body, field) in [
        (
            json!({"environment": {"backend": "host", "noSuchField": 1}}),
            "environment.noSuchField",
        ),
        (
            json!({"environment": {"backend": "host", "resources": {"memory": "lots"}}}),
            "environment.resources.memory",
        ),
        (
            json!({"environment": {"apiVersion": "runner/v1alpha1", "kind": "Environment", "metadata": {"name": "e"}, "spec": {"backend": "host", "bogus": true}}}),
            "environment.spec.bogus",
        ),
        (
            json!({"environment": {"backend": "host"}, "staticAssets": [{"nope": 1}]}),
            "staticAssets[0]",
        ),
        (
            json!({"environment": {"backend": "host"}, "staticAssets": [{"source": 5, "savePath": "a"}]}),
            "staticAssets[0].source",
        ),
        (
            json!({"environment": {"backend": "host"}, "mounts": [{"source": "/proc", "target": "/data"}]}),
            "mounts[0].source",
        ),
        (
            json!({"environment": {"backend": "host"}, "mounts": [{"source": "/tmp", "target": "../x"}]}),
            "mounts[0].target",
        ),
        (
            json!({"environment": {"backend": "host"}, "mounts": [{"source": "/tmp", "target": "/x", "readOnly": "no"}]}),
            "mounts[0].readOnly",
        ),
        (
            json!({"environment": {"backend": "host"}, "mounts": [["/tmp", "/x"]]}),
            "mounts[0]",
        ),
    ] {
        let (status, answer) = api.call("POST", "/v1/sessions", Some(body.clone())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {answer}");
        let error = answer["error"].as_str().unwrap();
        assert!(error.starts_with(field), "{body}: {error}");
        assert!(
            !error.contains("document") && !error.contains("\"s-"),
            "{body}: {error}"
        );
    }
}

/// `GET /v1/jobs/{name}/logs` takes what `runner logs` takes: index, attempt, tailLines,
/// prefix, setup, stream, follow (issue 37, item 3).
#[tokio::test]
async fn job_logs_take_index_tail_prefix_stream_and_follow() {
    let api = api();
    let manifest = "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: h}\nspec: {backend: host}\n---\n\
         apiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: two}\nspec:\n  environment: h\n  completions: 2\n  completionMode: Indexed\n  \
         command: 'echo a$JOB_COMPLETION_INDEX; echo b$JOB_COMPLETION_INDEX; echo e$JOB_COMPLETION_INDEX >&2'\n";
    let (status, body) = api.send("POST", "/v1/jobs", Some(TOKEN), Body::from(manifest)).await;
    assert_eq!(status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&body));
    // Following a running job answers once it ended, with everything.
    let followed = api
        .send(
            "GET",
            "/v1/jobs/two/logs?follow=true&prefix=true",
            Some(TOKEN),
            Body::empty(),
        )
        .await;
    assert_eq!(followed.0, StatusCode::OK);
    assert_eq!(String::from_utf8_lossy(&followed.1), "[0] a0\n[0] b0\n[1] a1\n[1] b1\n");
    let get = |query: &'static str| {
        let api = &api;
        async move {
            let (status, body) = api
                .send("GET", &format!("/v1/jobs/two/logs{query}"), Some(TOKEN), Body::empty())
                .await;
            (status, String::from_utf8_lossy(&body).to_string())
        }
    };
    assert_eq!(get("").await, (StatusCode::OK, "a0\nb0\na1\nb1\n".into()));
    assert_eq!(get("?index=1").await.1, "a1\nb1\n");
    assert_eq!(get("?tailLines=1&prefix=true").await.1, "[0] b0\n[1] b1\n");
    assert_eq!(get("?stream=stderr").await.1, "e0\ne1\n");
    // An attempt the job did not make is said, not answered with nothing.
    let (status, body) = get("?attempt=3").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("there is no attempt 3"), "{body}");
    assert_eq!(get("?tail=1").await.0, StatusCode::BAD_REQUEST);
    assert_eq!(get("?stream=both").await.0, StatusCode::BAD_REQUEST);
    let (status, _) = api.send("GET", "/v1/jobs/none/logs", Some(TOKEN), Body::empty()).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_pool_request_is_checked_before_containerd_is_asked() {
    let api = api();
    let (status, body) = api.call("GET", "/v1/pools", None).await;
    assert_eq!((status, body), (StatusCode::OK, json!([])));
    for (request, field) in [
        (json!({"name": "Not-A-Name", "environment": {"image": "x"}}), "name: "),
        (json!({"name": "p", "environment": 7}), "environment: "),
        (json!({"name": "p", "environment": "named"}), "environment: \"named\""),
        (
            json!({"name": "p", "environment": {"image": "x"}, "size": 100000}),
            "size: ",
        ),
        (
            json!({"name": "p", "environment": {"kind": "Environment", "metadata": [], "spec": {}}}),
            "environment.metadata: ",
        ),
        (
            json!({"name": "p", "environment": {}, "sizes": 1}),
            "unknown field `sizes`",
        ),
    ] {
        let (status, body) = api.call("POST", "/v1/pools", Some(request.clone())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{request} -> {body}");
        let error = body["error"].as_str().unwrap_or_default();
        assert!(error.contains(field), "{request}: {error}");
    }
    let (status, body) = api.call("DELETE", "/v1/pools/none", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
}
