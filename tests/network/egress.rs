//! What a container may reach off its network: CIDR and domain entries, and a live change.
use super::*;

#[test]
#[ignore = "needs a private containerd and the CNI plugins: run scripts/test.sh"]
fn egress_is_denied_unless_allowed_by_address_and_port() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_python(&state);
    let up = upstream(dir.path());
    let a = &up.addr;
    // Probes in Python (busybox's nc has no UDP): each TCP port's answer, then one datagram.
    let probes = format!(
        "python3 -c '\nimport os, socket, time\nprint(\"ip\", socket.gethostbyname(socket.gethostname()))\nfor p in (8080, 8081):\n    t = time.monotonic()\n    try:\n        s = socket.create_connection((\"{a}\", p), timeout=3)\n        s.sendall(b\"GET / HTTP/1.0\\r\\n\\r\\n\")\n        print(\"tcp%d\" % p, s.makefile(\"rb\").read().decode().strip().splitlines()[-1])\n    except OSError as e:\n        print(\"tcp%d\" % p, \"refused in %dms:\" % ((time.monotonic() - t) * 1000), e)\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(os.environ[\"UDP_MARK\"].encode(), (\"{a}\", 9090))\nprint(\"sent\")\ni = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)\ni.settimeout(2)\ni.sendto(b\"\\x08\\x00\\x00\\x00\\x00\\x00\\x00\\x01ping\", (\"{a}\", 0))\ntry:\n    i.recv(64)\n    print(\"icmp reply\")\nexcept OSError:\n    print(\"icmp none\")\n'"
    );
    let run = |name: &str, allow: &str, mark: &str| -> String {
        let env_extra = if allow.is_empty() {
            format!("  env: {{UDP_MARK: {mark}}}\n")
        } else {
            format!("  env: {{UDP_MARK: {mark}}}\n  egress:\n    allow: [{allow}]\n")
        };
        let text = manifest(name, &probes, None, &env_extra).replace(IMAGE, PYTHON);
        let file = write_manifest(dir.path(), &format!("{name}.yaml"), &text);
        let out = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], &state);
        stdout_of(&out)
    };
    let reached = |text: &str, probe: &str| text.contains(&format!("{probe} upstream {}", &probe[3..]));

    let closed = run("egress-none", "", "from-closed");
    assert!(!reached(&closed, "tcp8080") && !reached(&closed, "tcp8081"), "{closed}");
    assert!(closed.contains("icmp none"), "{closed}");
    let port = run("egress-port", &format!("\"{a}:8080\""), "from-port");
    assert!(reached(&port, "tcp8080"), "{port}");
    assert!(!reached(&port, "tcp8081"), "{port}");
    // A port rule is TCP and UDP to that port: no ICMP.
    assert!(port.contains("icmp none"), "{port}");
    let open = run(
        "egress-cidr",
        // The upstream is 10.199.N.2 of 10.199.N.0/30 (`upstream`): its /30. (trim_end_matches
        // took slot 2's "10.199.2.2" down to "10.199", a wrong rule and a failing test.)
        &format!(
            "\"{}.0/30\"",
            a.strip_suffix(".2").expect("the upstream's address ends in .2")
        ),
        "from-cidr",
    );
    assert!(reached(&open, "tcp8080") && reached(&open, "tcp8081"), "{open}");
    assert!(open.contains("icmp reply"), "{open}");
    // UDP: only the container whose rule has no port got a datagram through.
    assert!(eventually(Duration::from_secs(5), || std::fs::read_to_string(
        &up.udp_log
    )
    .unwrap()
    .contains("from-cidr")));
    let udp = std::fs::read_to_string(&up.udp_log).unwrap();
    assert!(!udp.contains("from-closed") && !udp.contains("from-port"), "{udp}");
    // A refused connect fails at once (a TCP reset from the wall), not after its timeout.
    let refused = closed
        .lines()
        .find(|l| l.starts_with("tcp8080 refused in "))
        .unwrap_or_else(|| panic!("{closed}"));
    let ms: u64 = refused["tcp8080 refused in ".len()..]
        .split("ms")
        .next()
        .unwrap()
        .parse()
        .unwrap();
    println!("a connect the wall refuses failed after {ms} ms: {refused}");
    assert!(ms < 500 && refused.contains("Connection refused"), "{refused}");
    // The containers' elements went with them.
    for text in [&closed, &port, &open] {
        let ip = text
            .lines()
            .find_map(|l| l.strip_prefix("ip "))
            .unwrap_or_else(|| panic!("{text}"));
        assert_no_elements_of(ip);
    }
    assert_released(&state, &[]);
}

#[test]
fn egress_entries_are_checked_with_their_place() {
    let dir = tempfile::tempdir().unwrap();
    for (allow, network, want) in [
        ("[\"exa_mple.com\"]", "bridge", "not a domain name"),
        ("[\"*foo.example.com\"]", "bridge", "'*' only as a whole first label"),
        ("[\"example.com:0\"]", "bridge", "not a port"),
        ("[\"1.2.3.4.5\"]", "bridge", "not an IPv4 address"),
        ("[\"example.com\"]", "none", "egress needs network: bridge"),
        ("[\"10.0.0.1/33\"]", "bridge", "not a prefix length"),
        ("[\"10.0.0.1/8\"]", "bridge", "bits set beyond /8"),
        ("[\"10.0.0.0/8:0\"]", "bridge", "not a port"),
        ("[\"::1\"]", "bridge", "IPv6"),
        ("[\"10.0.0.0/8\"]", "none", "egress needs network: bridge"),
    ] {
        let text = format!(
            "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: e}}\nspec:\n  image: {IMAGE}\n  network: {network}\n  egress:\n    allow: {allow}\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: j}}\nspec:\n  environment: e\n  command: \"true\"\n"
        );
        let file = write_manifest(dir.path(), "e.yaml", &text);
        let out = runner(&["validate", "-f", file.to_str().unwrap()], &dir.path().join("state"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{allow} on {network} was accepted");
        assert!(
            err.contains(want) && err.contains("spec.egress.allow[0]") && err.contains(":8:"),
            "{allow}: {err}"
        );
    }
}

#[test]
#[ignore = "needs a private containerd and the CNI plugins: run scripts/test.sh"]
fn a_session_over_http_gets_the_bridge_and_egress_its_environment_names() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_python(&state);
    let up = upstream(dir.path());
    let server = serve_with(runner_ctd_command(&[], &state), dir.path());
    let call = |method: &str, path: &str, body: Option<&str>| server.call(method, path, body);
    let a = &up.addr;
    let (code, session) = call(
        "POST",
        "/v1/sessions",
        Some(&format!(
            r#"{{"environment": {{"image": "{PYTHON}", "network": "bridge", "egress": {{"allow": ["{a}:8080"]}}}}}}"#
        )),
    );
    assert_eq!(code, 201, "{session}");
    let id = session["id"].as_str().unwrap().to_string();
    let probe = format!(
        "import socket\nfor p in (8080, 8081):\n    try:\n        s = socket.create_connection((\"{a}\", p), timeout=3)\n        s.sendall(b\"GET / HTTP/1.0\\r\\n\\r\\n\")\n        print(p, s.makefile(\"rb\").read().decode().strip().splitlines()[-1])\n    except OSError:\n        print(p, \"refused\")\n"
    );
    let body = serde_json::json!({"command": ["python3", "-c", probe]}).to_string();
    let (code, out) = call("POST", &format!("/v1/sessions/{id}/exec"), Some(&body));
    assert_eq!(code, 200, "{out}");
    assert_eq!(out["stdout"], "8080 upstream 8080\n8081 refused\n", "{out}");
    assert_eq!(call("DELETE", &format!("/v1/sessions/{id}"), None).0, 204);
    drop(server);
    assert_released(&state, &[]);
}

#[test]
#[ignore = "needs a private containerd, the CNI plugins and dnsmasq: run scripts/test.sh"]
fn domains_are_reached_only_through_runners_resolver_and_only_when_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_python(&state);
    let mut up = public_upstream(dir.path());
    let a = up.addr.clone();
    let (prefix, last) = a.rsplit_once('.').unwrap();
    let host_side = format!("{prefix}.{}", last.parse::<u8>().unwrap() - 1);
    up.serve_names(&[
        ("allowed.test", &a),
        ("wild.test", &a),
        ("denied.test", &a),
        ("metadata.test", "169.254.169.254"),
        ("host.test", &host_side),
        ("private.test", "10.199.250.9"),
        ("cgnat.test", "100.64.0.9"),
    ]);
    let ws = dir.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    // Each probe prints one line; then the container waits so the test can read its sets.
    let probe = format!(
        r#"
import socket, struct, time
def resolve(name):
    try:
        return socket.gethostbyname(name)
    except OSError:
        return "nxdomain"
def tcp(addr, port):
    try:
        s = socket.create_connection((addr, port), timeout=2)
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        return s.makefile("rb").read().decode().strip().splitlines()[-1]
    except OSError:
        return "refused"
out = []
out.append("allowed %s %s %s" % (resolve("allowed.test"), tcp("allowed.test", 8080), tcp("{a}", 8081)))
# The upstream's resolver itself is out of reach (before a rule without a port opens its
# address, which is what a domain rule cannot help: the address is shared).
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(2)
u.sendto(bytes.fromhex("{query}")[2:], ("{a}", 53))
try:
    u.recv(512); out.append("direct answered")
except OSError:
    out.append("direct unanswered")
out.append("denied %s" % resolve("denied.test"))
out.append("apex %s" % resolve("wild.test"))
out.append("sub %s %s" % (resolve("a.b.wild.test"), tcp("{a}", 8081)))
out.append("metadata %s" % resolve("metadata.test"))
out.append("host %s %s" % (resolve("host.test"), tcp("{host_side}", 8080)))
out.append("private %s" % resolve("private.test"))
out.append("cgnat %s" % resolve("cgnat.test"))
out.append("me %s" % socket.gethostbyname("dns-probe"))
# Over TCP to runner's resolver, as a client does after a truncated answer.
q = bytes.fromhex("{query}")
s = socket.create_connection(("10.89.0.1", 53), timeout=3); s.sendall(q)
n = struct.unpack(">H", s.recv(2))[0]; r = b""
while len(r) < n: r += s.recv(n - len(r))
out.append("tcp-dns %s" % socket.inet_ntoa(r[-4:]))
# The network's names are the resolver's too (for tools that skip /etc/hosts).
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(3)
u.sendto(bytes.fromhex("{own}"), ("10.89.0.1", 53))
r = u.recv(512)
out.append("own-name %s" % (socket.inet_ntoa(r[-4:]) == socket.gethostbyname("dns-probe")))
open("/workspace/out.tmp", "w").write("\n".join(out) + "\n")
import os; os.rename("/workspace/out.tmp", "/workspace/out")
time.sleep(60)
"#,
        query = hex(&dns_query("allowed.test", true)),
        own = hex(&dns_query("dns-probe", false)),
    );
    std::fs::write(ws.join("probe.py"), probe).unwrap();
    let env_extra = "  egress:\n    allow: [\"allowed.test:8080\", \"*.wild.test\", \"metadata.test\", \"host.test\", \"private.test\", \"cgnat.test\"]\n";
    let text = manifest("dns-probe", "python3 /workspace/probe.py", Some(&ws), env_extra).replace(IMAGE, PYTHON);
    let file = write_manifest(dir.path(), "dns-probe.yaml", &text);
    let mut cmd = runner_ctd_command(&["apply", "-f", file.to_str().unwrap()], &state);
    cmd.env("RUNNER_DNS_UPSTREAM", &a)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let running = Stop(cmd.spawn().unwrap());
    assert!(
        eventually(Duration::from_secs(30), || ws.join("out").exists()),
        "the probe never finished"
    );
    let out = std::fs::read_to_string(ws.join("out")).unwrap();
    let sets = Command::new("nft")
        .args(["list", "table", "inet", "runner"])
        .output()
        .unwrap();
    let sets = String::from_utf8_lossy(&sets.stdout).to_string();
    drop(running);
    let _ = runner_ctd(&["delete", "job", "dns-probe"], &state);
    let me = out
        .lines()
        .find_map(|l| l.strip_prefix("me "))
        .unwrap_or_else(|| panic!("{out}"))
        .to_string();
    let want = format!(
        "allowed {a} upstream 8080 refused\n\
         direct unanswered\n\
         denied nxdomain\n\
         apex nxdomain\n\
         sub {a} upstream 8081\n\
         metadata 169.254.169.254\n\
         host {host_side} refused\n\
         private 10.199.250.9\n\
         cgnat 100.64.0.9\n\
         me {me}\n\
         tcp-dns {a}\n\
         own-name True\n"
    );
    assert_eq!(out, want);
    // The answers' addresses went into the container's sets, for the answer's TTL (60 s
    // here), except those no domain may open: the host's, metadata, private ranges.
    assert!(sets.contains(&format!("{me} . {a} . 8080 timeout 1m")), "{sets}");
    assert!(sets.contains(&format!("{me} . {a} timeout 1m")), "{sets}");
    for closed in [
        "169.254.169.254",
        &format!("{host_side} "),
        "10.199.250.9",
        "100.64.0.9",
    ] {
        assert!(!sets.contains(closed), "{closed} entered a set: {sets}");
    }
    // Its elements and policy went with it.
    assert_no_elements_of(&me);
    assert!(!Path::new(&format!("/run/runner/net/dns/{me}")).exists());
    assert_released(&state, &[]);
}

/// `PATCH /v1/sessions/{id}` with a new egress: a connection to a destination it removes is cut
/// (an established one, at its next packet), a destination it adds is reachable at once, and
/// what it no longer allows is refused in milliseconds. Bad entries and a session without a
/// bridge network are refused with their reason.
#[test]
#[ignore = "needs a private containerd and the CNI plugins: run scripts/test.sh"]
fn a_patch_of_a_live_sessions_egress_cuts_what_it_removes_and_opens_what_it_adds() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_python(&state);
    let up = public_upstream(dir.path());
    let server = serve_with(runner_ctd_command(&[], &state), dir.path());
    let call = |method: &str, path: &str, body: Option<&str>| server.call(method, path, body);
    let a = &up.addr;
    let (code, session) = call(
        "POST",
        "/v1/sessions",
        Some(&format!(
            r#"{{"environment": {{"image": "{PYTHON}", "network": "bridge", "egress": {{"allow": ["{a}/32"]}}}}}}"#
        )),
    );
    assert_eq!(code, 201, "{session}");
    let id = session["id"].as_str().unwrap().to_string();
    let exec = |code: &str| -> String {
        let body = serde_json::json!({"command": ["python3", "-c", code]}).to_string();
        let (status, out) = call("POST", &format!("/v1/sessions/{id}/exec"), Some(&body));
        assert_eq!(status, 200, "{out}");
        out["stdout"].as_str().unwrap_or_default().to_string()
    };
    // An established connection to the echo server, kept in the background: it says each
    // second whether its round trip worked.
    let hold = format!(
        "import socket, subprocess, sys\nsubprocess.Popen([sys.executable, '-c', '''\nimport socket, time\ns = socket.create_connection((\"{a}\", 8082), timeout=2)\nwhile True:\n    try:\n        s.sendall(b\"x\")\n        ok = s.recv(16) == b\"x\"\n        line = \"ok\" if ok else \"closed\"\n    except OSError as e:\n        line = \"cut %s\" % e\n    open(\"/tmp/hold\", \"a\").write(\"%f %s\\\\n\" % (time.time(), line))\n    if not line.startswith(\"ok\"):\n        break\n    time.sleep(0.05)\n'''], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    );
    exec(&hold);
    let last = || exec("print(open('/tmp/hold').read().strip().splitlines()[-1])");
    assert!(
        eventually(Duration::from_secs(10), || last().contains(" ok")),
        "the held connection never worked: {}",
        last()
    );
    let connect = |port: u16| {
        exec(&format!(
            "import socket, time\nt = time.monotonic()\ntry:\n    socket.create_connection((\"{a}\", {port}), timeout=3).close(); r = 'open'\nexcept OSError as e:\n    r = 'refused %s' % e.strerror\nprint('%s %d' % (r, (time.monotonic() - t) * 1000))"
        ))
    };
    assert!(connect(8081).starts_with("open"), "{}", connect(8081));

    // Bad entries are refused with their place; nothing changed.
    let (code, err) = call(
        "PATCH",
        &format!("/v1/sessions/{id}"),
        Some(r#"{"egress": {"allow": ["10.0.0.0/8", "-bad-"]}}"#),
    );
    assert_eq!(code, 400, "{err}");
    assert!(err.to_string().contains("egress.allow[1]"), "{err}");
    assert!(last().contains(" ok"));

    // Only port 8080 now: the held connection (port 8082) is cut at its next packet.
    let t = std::time::Instant::now();
    let (code, view) = call(
        "PATCH",
        &format!("/v1/sessions/{id}"),
        Some(&format!(r#"{{"egress": {{"allow": ["{a}:8080"]}}}}"#)),
    );
    assert_eq!(code, 200, "{view}");
    println!("PATCH answered in {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    assert_eq!(view["id"], id.as_str());
    assert!(
        eventually(Duration::from_secs(3), || last().contains(" cut")),
        "the connection to a removed destination was not cut: {}",
        last()
    );
    println!("held connection after the PATCH: {}", last());
    assert!(connect(8080).starts_with("open"));
    let refused = connect(8081);
    println!("a connect to a removed destination: {refused}");
    let ms: f64 = refused.trim().rsplit(' ').next().unwrap().parse().unwrap();
    assert!(
        refused.starts_with("refused Connection refused") && ms < 500.0,
        "{refused}"
    );

    // A new allowance works at once.
    let (code, view) = call(
        "PATCH",
        &format!("/v1/sessions/{id}"),
        Some(&format!(r#"{{"egress": {{"allow": ["{a}:8080", "{a}:8081"]}}}}"#)),
    );
    assert_eq!(code, 200, "{view}");
    assert!(connect(8081).starts_with("open"), "{}", connect(8081));
    let ip = exec("import socket; print(socket.gethostbyname(socket.gethostname()))");

    // A session on no bridge network has no egress to change.
    let (code, other) = call(
        "POST",
        "/v1/sessions",
        Some(&format!(r#"{{"environment": {{"image": "{PYTHON}"}}}}"#)),
    );
    assert_eq!(code, 201, "{other}");
    let other = other["id"].as_str().unwrap().to_string();
    let (code, err) = call(
        "PATCH",
        &format!("/v1/sessions/{other}"),
        Some(r#"{"egress": {"allow": ["10.0.0.0/8"]}}"#),
    );
    assert_eq!(code, 409, "{err}");
    assert!(err.to_string().contains("no bridge network"), "{err}");
    assert_eq!(call("DELETE", &format!("/v1/sessions/{other}"), None).0, 204);
    assert_eq!(call("DELETE", &format!("/v1/sessions/{id}"), None).0, 204);
    drop(server);
    assert_no_elements_of(ip.trim());
    assert_released(&state, &[]);
}
