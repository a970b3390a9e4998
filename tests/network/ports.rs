//! Published ports.
use super::*;

#[test]
#[ignore = "needs a private containerd and the CNI plugins: run scripts/test.sh"]
fn published_ports_answer_from_the_host_even_for_a_server_on_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_python(&state);
    let ws = dir.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    let fixed = free_port();
    // Three servers: TCP on 127.0.0.1 (what reference 000 rewrites to 0.0.0.0; runner makes
    // the published port reach it as it is), TCP on every address with a hostPort asked for,
    // and a UDP echo on 127.0.0.1. They serve until the test stops the job.
    let server = r#"
import socket, threading, http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
        self.wfile.write(("served on %s" % self.server.server_address[0]).encode())
    def log_message(self, *a): pass
for addr in (("127.0.0.1", 8080), ("0.0.0.0", 8081)):
    threading.Thread(target=http.server.HTTPServer(addr, H).serve_forever, daemon=True).start()
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("127.0.0.1", 5353))
open("/workspace/up", "w").close()
while True:
    data, peer = u.recvfrom(100); u.sendto(b"echo " + data, peer)
"#;
    let ports = format!(
        "  ports:\n  - containerPort: 8080\n  - containerPort: 8081\n    hostPort: {fixed}\n    name: fixed\n  - {{containerPort: 5353, protocol: UDP}}\n"
    );
    let job = format!("ports-{}", std::process::id());
    let text = manifest(&job, "python3 /workspace/server.py", Some(&ws), &ports).replace(IMAGE, PYTHON);
    std::fs::write(ws.join("server.py"), server).unwrap();
    let file = write_manifest(dir.path(), "ports.yaml", &text);
    let mut cmd = runner_ctd_command(&["apply", "-f", file.to_str().unwrap()], &state);
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    let running = Stop(cmd.spawn().unwrap());
    let ports = published_ports(&state, &job);
    assert!(eventually(Duration::from_secs(20), || ws.join("up").exists()));
    assert_eq!(ports.len(), 3, "{ports:?}");
    assert!(ports.iter().all(|p| p["hostIP"] == "127.0.0.1"), "{ports:?}");
    assert_eq!(host_port(&ports, 8081), fixed, "{ports:?}");
    let loopback = host_port(&ports, 8080);
    assert_ne!(loopback, 0);
    let answer = http_get(&format!("127.0.0.1:{loopback}")).unwrap();
    assert!(answer.ends_with("served on 127.0.0.1"), "{answer}");
    let answer = http_get(&format!("127.0.0.1:{fixed}")).unwrap();
    assert!(answer.ends_with("served on 0.0.0.0"), "{answer}");
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    udp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    udp.send_to(b"ping", ("127.0.0.1", host_port(&ports, 5353))).unwrap();
    let mut buf = [0u8; 64];
    let (n, _) = udp.recv_from(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"echo ping");
    // Published on loopback (the default hostIP): not on the host's other addresses.
    assert!(
        http_get(&format!("10.89.0.1:{loopback}")).is_err(),
        "a port published on 127.0.0.1 answered on the bridge's gateway address"
    );
    // The status and describe say what was published.
    let described = runner_ctd(&["describe", "job", &job], &state);
    let described = String::from_utf8_lossy(&described.stdout);
    assert!(
        described.contains(&format!("Port: 8080/tcp -> 127.0.0.1:{loopback}")),
        "{described}"
    );
    // A second job asking for the same host port is refused, saying who has it.
    let clash = format!("clash-{}", std::process::id());
    let text = manifest(
        &clash,
        "true",
        None,
        &format!("  ports:\n  - {{containerPort: 80, hostPort: {fixed}}}\n"),
    );
    let file = write_manifest(dir.path(), "clash.yaml", &text);
    let out = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], &state);
    let v = json_of(&out);
    assert_eq!(v["status"]["phase"], "Failed", "{v}");
    let message = v["status"]["attempts"][0]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!("hostPort {fixed}/TCP on 127.0.0.1 is published by container")),
        "{v}"
    );
    drop(running);
    let _ = runner_ctd(&["delete", "job", &job], &state);
    // The ports are free again and nothing maps them.
    assert!(http_get(&format!("127.0.0.1:{fixed}")).is_err());
    for port in [loopback, fixed] {
        assert_unpublished(port);
    }
}

#[test]
#[ignore = "needs a private containerd and the CNI plugins: run scripts/test.sh"]
fn a_session_over_http_publishes_its_ports_and_reports_them() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_python(&state);
    let server = serve_with(runner_ctd_command(&[], &state), dir.path());
    let (code, session) = server.call(
        "POST",
        "/v1/sessions",
        Some(&format!(
            r#"{{"environment": {{"image": "{PYTHON}", "network": "bridge", "ports": [{{"containerPort": 8000, "name": "web"}}]}}}}"#
        )),
    );
    assert_eq!(code, 201, "{session}");
    let id = session["id"].as_str().unwrap().to_string();
    let port = &session["network"]["ports"][0];
    assert_eq!(port["name"], "web", "{session}");
    let host_port = port["hostPort"].as_u64().unwrap();
    assert_eq!(
        server.call("GET", &format!("/v1/sessions/{id}"), None).1["network"],
        session["network"]
    );
    // One request, served by a command of the session while the host calls it.
    let serve = r#"
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"session server")
http.server.HTTPServer(("127.0.0.1", 8000), H).handle_request()
"#;
    let body = serde_json::json!({"command": ["python3", "-c", serve], "timeoutSeconds": 30}).to_string();
    std::thread::scope(|s| {
        let exec = s.spawn(|| server.call("POST", &format!("/v1/sessions/{id}/exec"), Some(&body)));
        let mut answer = Err(std::io::Error::other("never tried"));
        assert!(eventually(Duration::from_secs(20), || {
            answer = http_get(&format!("127.0.0.1:{host_port}"));
            answer.is_ok()
        }));
        assert!(answer.unwrap().ends_with("session server"));
        let (code, out) = exec.join().unwrap();
        assert_eq!((code, out["exitCode"].as_i64()), (200, Some(0)), "{out}");
    });
    assert_eq!(server.call("DELETE", &format!("/v1/sessions/{id}"), None).0, 204);
    drop(server);
    assert_released(&state, &[]);
    assert_unpublished(host_port as u16);
}

#[test]
fn ports_are_checked_with_their_place() {
    let dir = tempfile::tempdir().unwrap();
    for (ports, network, want, field) in [
        (
            "[{containerPort: 0}]",
            "bridge",
            "0 is not a port",
            "spec.ports[0].containerPort",
        ),
        (
            "[{containerPort: 80, hostPort: 70000}]",
            "bridge",
            "70000 is not a port",
            "spec.ports[0].hostPort",
        ),
        (
            "[{containerPort: 80, protocol: tcp}]",
            "bridge",
            "Kubernetes spells it TCP",
            "spec.ports[0].protocol",
        ),
        (
            "[{containerPort: 80, protocol: SCTP}]",
            "bridge",
            "TCP or UDP",
            "spec.ports[0].protocol",
        ),
        (
            "[{containerPort: 80, hostIP: '::1'}]",
            "bridge",
            "not an IPv4 address",
            "spec.ports[0].hostIP",
        ),
        (
            "[{containerPort: 80, name: Web_1}]",
            "bridge",
            "not a port name",
            "spec.ports[0].name",
        ),
        (
            "[{containerPort: 80}, {containerPort: 80}]",
            "bridge",
            "published by spec.ports[0]",
            "spec.ports[1].containerPort",
        ),
        (
            "[{containerPort: 80, hostPort: 9000}, {containerPort: 81, hostPort: 9000, hostIP: 0.0.0.0}]",
            "bridge",
            "taken by spec.ports[0]",
            "spec.ports[1].hostPort",
        ),
        (
            "[{containerPort: 80}]",
            "none",
            "ports need network: bridge",
            "spec.ports[0].containerPort",
        ),
        (
            "[{containerPort: 80, hostport: 1}]",
            "bridge",
            "unknown field `hostport`",
            "",
        ),
    ] {
        let text = format!(
            "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: e}}\nspec:\n  image: {IMAGE}\n  network: {network}\n  ports: {ports}\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: j}}\nspec:\n  environment: e\n  command: \"true\"\n"
        );
        let file = write_manifest(dir.path(), "p.yaml", &text);
        let out = runner(&["validate", "-f", file.to_str().unwrap()], &dir.path().join("state"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{ports} on {network} was accepted");
        assert!(
            err.contains(want) && err.contains(field) && err.contains(":7:"),
            "{ports}: {err}"
        );
    }
}
