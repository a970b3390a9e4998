//! `network: bridge` with the real CNI plugins (Debian's containernetworking-plugins), real
//! network namespaces and real nftables, through `runner apply`. Traffic goes only between
//! this machine's own addresses: containers on the test's bridge, and a server the test starts
//! on the host.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use common::*;

const IMAGE: &str = "local/busybox:1.35";
const PYTHON: &str = "local/python:3.11";
/// host-local's leases: one file per address in use.
const IPAM_DIR: &str = "/var/lib/cni/networks/runner";

fn import(state: &Path) {
    let out = runner_ctd(
        &["image", "import", image_dir().join("busybox-oci.tar").to_str().unwrap()],
        state,
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

fn import_python(state: &Path) {
    let out = runner_ctd(
        &["image", "import", image_dir().join("python-oci.tar").to_str().unwrap()],
        state,
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

fn manifest(name: &str, command: &str, workspace: Option<&Path>, env_extra: &str) -> String {
    let ws = workspace.map_or(String::new(), |w| format!("  workspace: {}\n", w.display()));
    format!(
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: br}}\nspec:\n  image: {IMAGE}\n  network: bridge\n{env_extra}---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {name}}}\nspec:\n  environment: br\n  command: {command:?}\n{ws}"
    )
}

fn apply(dir: &Path, state: &Path, name: &str, command: &str, workspace: Option<&Path>) -> Command {
    let file = write_manifest(dir, &format!("{name}.yaml"), &manifest(name, command, workspace, ""));
    let mut cmd = runner_ctd_command(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], state);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

fn stdout_of(out: &Output) -> String {
    let v = json_of(out);
    assert_eq!(v["status"]["phase"], "Succeeded", "{v}");
    v["status"]["result"]["stdout"].as_str().unwrap_or_default().to_string()
}

/// Nothing of the container's network stays: its address is leased to nobody, and its run
/// directory (pins, cached CNI result) is gone.
fn assert_released(state: &Path, ips: &[String]) {
    for ip in ips {
        assert!(
            !Path::new(IPAM_DIR).join(ip).exists(),
            "the IPAM lease of {ip} was not released"
        );
    }
    let run = state.join("run");
    let left: Vec<PathBuf> = std::fs::read_dir(&run)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "run directories left: {left:?}");
}

fn ip_of(text: &str) -> String {
    text.split_whitespace()
        .find_map(|w| w.strip_suffix("/16").filter(|a| a.starts_with("10.89.")))
        .unwrap_or_else(|| panic!("no 10.89.x.y/16 address in {text:?}"))
        .to_string()
}

#[test]
#[ignore = "needs a private containerd and the CNI plugins: run scripts/test.sh"]
fn twenty_concurrent_bridge_jobs_get_distinct_addresses_and_leave_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import(&state);
    let jobs: Vec<Child> = (0..20)
        .map(|i| {
            apply(
                dir.path(),
                &state,
                &format!("br{i}"),
                "ip -4 -o addr show eth0; ls /sys/class/net",
                None,
            )
            .spawn()
            .unwrap()
        })
        .collect();
    let mut ips = BTreeSet::new();
    for job in jobs {
        let out = job.wait_with_output().unwrap();
        let text = stdout_of(&out);
        // sysfs is the container's own: it lists the container's interfaces only.
        assert!(text.contains("eth0\nlo\n"), "{text}");
        ips.insert(ip_of(&text));
    }
    assert_eq!(ips.len(), 20, "{ips:?}");
    assert_released(&state, &ips.into_iter().collect::<Vec<_>>());
}

/// A `runner apply` that is stopped as Ctrl-C stops it (its job torn down) when the test
/// ends, failing or not: a failed assertion must not leave a job on the bridge.
struct Stop(Child);

impl Drop for Stop {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.0.wait();
    }
}

/// A python HTTP server on the host, on every address (so the bridge's gateway too).
struct HostServer {
    child: Child,
    port: u16,
}

impl Drop for HostServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn host_server(dir: &Path) -> HostServer {
    let port = std::net::TcpListener::bind("0.0.0.0:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    std::fs::write(dir.join("index.html"), "host secret\n").unwrap();
    let child = Command::new("python3")
        .args(["-m", "http.server", "--bind", "0.0.0.0", &port.to_string()])
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(eventually(Duration::from_secs(10), || std::net::TcpStream::connect((
        "127.0.0.1",
        port
    ))
    .is_ok()));
    HostServer { child, port }
}

#[test]
#[ignore = "needs a private containerd and the CNI plugins: run scripts/test.sh"]
fn containers_on_the_bridge_reach_each_other_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import(&state);
    let www = dir.path().join("www");
    std::fs::create_dir_all(&www).unwrap();
    let host = host_server(&www);

    // A: a web server that says its address through its workspace.
    let ws = dir.path().join("server-ws");
    std::fs::create_dir_all(&ws).unwrap();
    let server = Stop(
        apply(
            dir.path(),
            &state,
            "server",
        "ip -4 -o addr show eth0 > /workspace/ip.tmp && mv /workspace/ip.tmp /workspace/ip; mkdir -p /tmp/www; echo pong > /tmp/www/index.html; exec httpd -f -p 7070 -h /tmp/www",
            Some(&ws),
        )
        .spawn()
        .unwrap(),
    );
    assert!(
        eventually(Duration::from_secs(20), || ws.join("ip").exists()),
        "the server never started"
    );
    let server_ip = ip_of(&std::fs::read_to_string(ws.join("ip")).unwrap());
    // The host itself reaches its server on the bridge's address (the bridge exists now):
    // the wall, not routing, is what stops a container.
    assert!(
        std::net::TcpStream::connect(("10.89.0.1", host.port)).is_ok(),
        "the host's server must answer on the bridge address from the host"
    );

    // B: reaches A; not the host (its gateway address, nor its other addresses), nor the
    // cloud metadata address.
    // (busybox's static wget crashes on any URL here, so the client is nc: a crash is exit
    // 139 and would look like a refusal; each probe prints its exit code.)
    let command = format!(
        "get() {{ printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 $1 $2; echo \" $3 rc=$?\"; }}; \
         get {server_ip} 7070 peer; get 10.89.0.1 {port} gateway; get 169.254.169.254 80 metadata",
        port = host.port
    );
    let out = apply(dir.path(), &state, "client", &command, None).output().unwrap();
    let text = stdout_of(&out);
    assert!(text.contains("pong\n peer rc=0"), "the peer did not answer: {text}");
    assert!(!text.contains("host secret"), "the host answered: {text}");
    for probe in ["gateway", "metadata"] {
        let rc = text
            .split(&format!(" {probe} rc="))
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or_else(|| panic!("no {probe} probe in {text}"));
        assert!(rc != "0" && rc != "139", "{probe}: {text}");
    }

    // Deleting the server's job tears its network down.
    let del = runner_ctd(&["delete", "job", "server"], &state);
    assert!(del.status.success(), "{}", String::from_utf8_lossy(&del.stderr));
    drop(server);
    assert_released(&state, &[server_ip]);
}

/// `runner apply` of a bridge job that publishes a port, says its address and sleeps
/// `seconds`, SIGKILLed once the job runs (no cleanup runs): its address and host port.
fn orphan_a_bridge_job(dir: &Path, state: &Path, name: &str, seconds: u32) -> (String, u16) {
    let ws = dir.join(format!("{name}-ws"));
    std::fs::create_dir_all(&ws).unwrap();
    let command =
        format!("ip -4 -o addr show eth0 > /workspace/ip.tmp && mv /workspace/ip.tmp /workspace/ip; sleep {seconds}");
    let text = manifest(name, &command, Some(&ws), "  ports: [{containerPort: 80}]\n");
    let file = write_manifest(dir, &format!("{name}.yaml"), &text);
    let mut cmd = runner_ctd_command(&["apply", "-f", file.to_str().unwrap()], state);
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    assert!(eventually(Duration::from_secs(20), || ws.join("ip").exists()));
    let ip = ip_of(&std::fs::read_to_string(ws.join("ip")).unwrap());
    let port = host_port(&published_ports(state, name), 80);
    child.kill().unwrap();
    child.wait().unwrap();
    (ip, port)
}

/// Nothing publishes host port `port` any more: no record, no DNAT rule.
fn assert_unpublished(port: u16) {
    let recorded = std::fs::read_to_string("/run/runner/net/ports").unwrap_or_default();
    assert!(!recorded.contains(&format!(" {port} ")), "{recorded}");
    let nat = Command::new("iptables-save").args(["-t", "nat"]).output().unwrap();
    let nat = String::from_utf8_lossy(&nat.stdout);
    assert!(!nat.contains(&format!("--dport {port} ")), "{nat}");
}

#[test]
#[ignore = "needs a private containerd and the CNI plugins: run scripts/test.sh"]
fn a_killed_runner_leaves_no_network_behind_after_gc_and_delete() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import(&state);
    let (ip, port) = orphan_a_bridge_job(dir.path(), &state, "orphan", 963);
    assert!(Path::new(IPAM_DIR).join(&ip).exists());
    let gc = runner_ctd(&["gc"], &state);
    assert!(gc.status.success(), "{}", String::from_utf8_lossy(&gc.stderr));
    let del = runner_ctd(&["delete", "job", "orphan"], &state);
    assert!(del.status.success(), "{}", String::from_utf8_lossy(&del.stderr));
    assert!(eventually(Duration::from_secs(10), || processes_matching("sleep 963").is_empty()));
    assert_released(&state, &[ip]);
    assert_unpublished(port);
}

/// A host of the test's own: a network namespace behind a veth pair, with TCP servers on
/// ports 8080 and 8081 and a UDP listener on 9090 that records what it receives.
struct Upstream {
    ns: String,
    host_if: String,
    addr: String,
    udp_log: PathBuf,
    server: Child,
    /// dnsmasq, when the test serves names.
    dns: Option<Child>,
}

impl Upstream {
    /// Serve these names (each to an address) with dnsmasq on the upstream's address.
    fn serve_names(&mut self, names: &[(&str, &str)]) {
        let mut cmd = Command::new("ip");
        cmd.args([
            "netns",
            "exec",
            &self.ns,
            "dnsmasq",
            "--no-daemon",
            "--no-resolv",
            "--no-hosts",
        ])
        .arg(format!("--listen-address={}", self.addr))
        .args(["--bind-interfaces", "--local-ttl=60"]);
        for (name, addr) in names {
            cmd.arg(format!("--address=/{name}/{addr}"));
        }
        self.dns = Some(cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap());
        // It answers before the test goes on.
        let sock = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        let query = dns_query(names[0].0, false);
        assert!(
            eventually(Duration::from_secs(10), || {
                let _ = sock.send_to(&query, (self.addr.as_str(), 53));
                sock.recv(&mut [0u8; 512]).is_ok()
            }),
            "dnsmasq did not answer"
        );
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A DNS query for `name`'s A record (`tcp`: with its length in front).
fn dns_query(name: &str, tcp: bool) -> Vec<u8> {
    let mut m = vec![0x42, 0x42, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
    for label in name.split('.') {
        m.push(label.len() as u8);
        m.extend_from_slice(label.as_bytes());
    }
    m.extend_from_slice(&[0, 0, 1, 0, 1]);
    if tcp {
        let mut framed = (m.len() as u16).to_be_bytes().to_vec();
        framed.extend_from_slice(&m);
        return framed;
    }
    m
}

impl Drop for Upstream {
    fn drop(&mut self) {
        if let Some(mut dns) = self.dns.take() {
            let _ = dns.kill();
            let _ = dns.wait();
        }
        let _ = self.server.kill();
        let _ = self.server.wait();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .stderr(Stdio::null())
            .status();
    }
}

fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn upstream(dir: &Path) -> Upstream {
    // Unique per test of this process (tests run side by side), and per process.
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tag = format!("{}{k}", std::process::id() % 100_000);
    let n = (std::process::id() * 4 + k) % 250 + 1;
    let ns = format!("rtup{tag}");
    let host_if = format!("rtu{tag}");
    let peer = format!("rtp{tag}");
    let addr = format!("10.199.{n}.2");
    sh(&["ip", "netns", "add", &ns]);
    sh(&["ip", "link", "add", &host_if, "type", "veth", "peer", "name", &peer]);
    sh(&["ip", "link", "set", &peer, "netns", &ns]);
    sh(&["ip", "addr", "add", &format!("10.199.{n}.1/30"), "dev", &host_if]);
    sh(&["ip", "link", "set", &host_if, "up"]);
    sh(&["ip", "-n", &ns, "addr", "add", &format!("{addr}/30"), "dev", &peer]);
    sh(&["ip", "-n", &ns, "link", "set", &peer, "up"]);
    sh(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
    let udp_log = dir.join("udp.log");
    std::fs::write(&udp_log, "").unwrap();
    let script = format!(
        r#"
import socket, threading
def tcp(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("{addr}", port)); s.listen(16)
    while True:
        c, _ = s.accept(); c.recv(1024)
        c.sendall(b"HTTP/1.0 200 OK\r\n\r\nupstream %d\n" % port); c.close()
def udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("{addr}", 9090))
    while True:
        data, peer = s.recvfrom(1024)
        with open("{log}", "a") as f: f.write(data.decode(errors="replace"))
for p in (8080, 8081): threading.Thread(target=tcp, args=(p,), daemon=True).start()
udp()
"#,
        log = udp_log.display()
    );
    let server = Command::new("ip")
        .args(["netns", "exec", &ns, "python3", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let up = Upstream {
        ns,
        host_if,
        addr,
        udp_log,
        server,
        dns: None,
    };
    // The host reaches it (so a refusal from a container is the wall's doing).
    assert!(eventually(Duration::from_secs(10), || std::net::TcpStream::connect((
        up.addr.as_str(),
        8080
    ))
    .is_ok()));
    up
}

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
        "python3 -c '\nimport os, socket\nfor p in (8080, 8081):\n    try:\n        s = socket.create_connection((\"{a}\", p), timeout=3)\n        s.sendall(b\"GET / HTTP/1.0\\r\\n\\r\\n\")\n        print(\"tcp%d\" % p, s.makefile(\"rb\").read().decode().strip().splitlines()[-1])\n    except OSError as e:\n        print(\"tcp%d\" % p, \"refused:\", e)\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(os.environ[\"UDP_MARK\"].encode(), (\"{a}\", 9090))\nprint(\"sent\")\ni = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)\ni.settimeout(2)\ni.sendto(b\"\\x08\\x00\\x00\\x00\\x00\\x00\\x00\\x01ping\", (\"{a}\", 0))\ntry:\n    i.recv(64)\n    print(\"icmp reply\")\nexcept OSError:\n    print(\"icmp none\")\n'"
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
        &format!("\"{}/30\"", a.trim_end_matches(".2").to_string() + ".0"),
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
    // The containers' rules went with them.
    let rules = Command::new("nft")
        .args(["list", "table", "inet", "runner"])
        .output()
        .unwrap();
    let rules = String::from_utf8_lossy(&rules.stdout);
    assert!(!rules.contains("runner:egress-"), "{rules}");
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
fn containers_on_the_bridge_resolve_each_other_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import(&state);
    import_python(&state);
    // The hosts file is the network's, shared by every runner on the host: a name of its own.
    let name = format!("named-{}", std::process::id());
    let ws = dir.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    let server = Stop(
        apply(
            dir.path(),
            &state,
            &name,
            "touch /workspace/up; mkdir -p /tmp/www; echo by-name > /tmp/www/index.html; exec httpd -f -p 7070 -h /tmp/www",
            Some(&ws),
        )
        .spawn()
        .unwrap(),
    );
    assert!(eventually(Duration::from_secs(20), || ws.join("up").exists()));
    let probe = format!(
        "python3 -c '\nimport socket\naddr = socket.gethostbyname(\"{name}\")\ns = socket.create_connection((\"{name}\", 7070), timeout=3)\ns.sendall(b\"GET / HTTP/1.0\\r\\n\\r\\n\")\nprint(addr.startswith(\"10.89.\"), s.makefile(\"rb\").read().decode().strip().splitlines()[-1])\ntry:\n    open(\"/etc/hosts\", \"a\").write(\"1.2.3.4 evil\\n\")\n    print(\"hosts writable\")\nexcept OSError:\n    print(\"hosts read-only\")\nprint(\"loopback resolver\" if \"nameserver 127.\" in open(\"/etc/resolv.conf\").read() else \"no loopback resolver\")\n'"
    );
    let text = manifest("resolver", &probe, None, "").replace(IMAGE, PYTHON);
    let file = write_manifest(dir.path(), "resolver.yaml", &text);
    let out = runner_ctd(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], &state);
    assert_eq!(
        stdout_of(&out),
        "True by-name\nhosts read-only\nno loopback resolver\n",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(server);
    // The name went with its container.
    let hosts = std::fs::read_to_string("/run/runner/net/runner/hosts").unwrap();
    assert!(!hosts.contains(&name), "{hosts}");
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
#[ignore = "needs a private containerd and the CNI plugins: run scripts/test.sh"]
fn gc_releases_the_network_of_a_container_whose_state_dir_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("gone-state");
    import(&state);
    let (ip, port) = orphan_a_bridge_job(dir.path(), &state, "storeless-br", 962);
    // Nothing of the network is pinned under the state dir: it can be removed whole.
    std::fs::remove_dir_all(&state).unwrap();
    let other = dir.path().join("other-state");
    let gc = runner_ctd(&["gc"], &other);
    assert!(gc.status.success(), "{}", String::from_utf8_lossy(&gc.stderr));
    assert!(eventually(Duration::from_secs(10), || processes_matching("sleep 962").is_empty()));
    assert!(
        !Path::new(IPAM_DIR).join(&ip).exists(),
        "gc left the address leased: {}",
        String::from_utf8_lossy(&gc.stdout)
    );
    let hosts = std::fs::read_to_string("/run/runner/net/runner/hosts").unwrap_or_default();
    assert!(!hosts.contains(&format!("{ip}\t")), "{hosts}");
    assert_unpublished(port);
}

/// The published ports `runner get job NAME -o json` reports for the job's first attempt,
/// once its container is attached.
fn published_ports(state: &Path, job: &str) -> Vec<serde_json::Value> {
    let mut ports = Vec::new();
    assert!(
        eventually(Duration::from_secs(20), || {
            let out = runner_ctd(&["get", "job", job, "-o", "json"], state);
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            match v["status"]["attempts"][0]["network"]["ports"].as_array() {
                Some(p) => {
                    ports = p.clone();
                    true
                }
                None => false,
            }
        }),
        "job {job} never reported its ports"
    );
    ports
}

fn host_port(ports: &[serde_json::Value], container_port: u16) -> u16 {
    ports
        .iter()
        .find(|p| p["containerPort"] == container_port)
        .and_then(|p| p["hostPort"].as_u64())
        .unwrap_or_else(|| panic!("no hostPort for {container_port} in {ports:?}")) as u16
}

/// A port of this host nothing listens on (the kernel's pick, released at once).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn http_get(addr: &str) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(3))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"GET / HTTP/1.0\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok(text)
}

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

#[test]
#[ignore = "needs a private containerd, the CNI plugins and dnsmasq: run scripts/test.sh"]
fn domains_are_reached_only_through_runners_resolver_and_only_when_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_python(&state);
    let mut up = upstream(dir.path());
    let a = up.addr.clone();
    let host_side = a.trim_end_matches(".2").to_string() + ".1";
    up.serve_names(&[
        ("allowed.test", &a),
        ("wild.test", &a),
        ("denied.test", &a),
        ("metadata.test", "169.254.169.254"),
        ("host.test", &host_side),
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
    let env_extra =
        "  egress:\n    allow: [\"allowed.test:8080\", \"*.wild.test\", \"metadata.test\", \"host.test\"]\n";
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
    let want = format!(
        "allowed {a} upstream 8080 refused\n\
         direct unanswered\n\
         denied nxdomain\n\
         apex nxdomain\n\
         sub {a} upstream 8081\n\
         metadata 169.254.169.254\n\
         host {host_side} refused\n\
         tcp-dns {a}\n\
         own-name True\n"
    );
    assert_eq!(out, want);
    // The answers' addresses went into the container's sets, for the answer's TTL (60 s
    // here), except those the host keeps to itself.
    assert!(sets.contains(&format!("{a} . 8080 timeout 1m")), "{sets}");
    assert!(sets.contains(&format!("{a} timeout 1m")), "{sets}");
    assert!(
        !sets.contains("169.254.169.254") && !sets.contains(&format!("{host_side} ")),
        "{sets}"
    );
    // Its sets, rules and policy went with it.
    let after = Command::new("nft")
        .args(["list", "table", "inet", "runner"])
        .output()
        .unwrap();
    let after = String::from_utf8_lossy(&after.stdout);
    assert!(
        !after.contains("runner:dns-probe") && !after.contains(&format!("{a} . 8080")),
        "{after}"
    );
    assert_released(&state, &[]);
}

/// containerd restarts while a bridge job runs and its runner is SIGKILLed: `runner gc`
/// afterwards leaves nothing of the network (the CNI cache beside the rootfs still names what
/// to DEL). On a containerd of the test's own: the suite's shared one must not restart under
/// the other tests.
#[test]
#[ignore = "needs containerd and the CNI plugins: run scripts/test.sh"]
fn a_containerd_restart_and_a_killed_runner_leave_no_network_after_gc() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let own = |args: &[&str]| -> Command {
        let mut cmd = Command::new(runner_bin());
        cmd.args(args)
            .env("RUNNER_STATE_DIR", &state)
            .env("CONTAINERD_NAMESPACE", "runner-br-restart")
            .env_remove("CONTAINERD_ADDRESS");
        cmd
    };
    let run = |args: &[&str]| own(args).output().unwrap();
    assert_eq!(run(&["daemon", "start"]).status.code(), Some(0));
    struct Down<F: Fn()>(F);
    impl<F: Fn()> Drop for Down<F> {
        fn drop(&mut self) {
            (self.0)();
        }
    }
    let _down = Down(|| {
        run(&["gc"]);
        run(&["daemon", "stop"]);
    });
    let out = run(&["image", "import", image_dir().join("busybox-oci.tar").to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ws = dir.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    let text = manifest(
        "restarted",
        "ip -4 -o addr show eth0 > /workspace/ip.tmp && mv /workspace/ip.tmp /workspace/ip; sleep 961",
        Some(&ws),
        "  ports: [{containerPort: 80}]\n",
    );
    let file = write_manifest(dir.path(), "restarted.yaml", &text);
    let mut apply = own(&["apply", "-f", file.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(eventually(Duration::from_secs(20), || ws.join("ip").exists()));
    let ip = ip_of(&std::fs::read_to_string(ws.join("ip")).unwrap());
    let port = {
        let out = run(&["get", "job", "restarted", "-o", "json"]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["status"]["attempts"][0]["network"]["ports"][0]["hostPort"]
            .as_u64()
            .unwrap() as u16
    };
    apply.kill().unwrap();
    apply.wait().unwrap();
    assert_eq!(run(&["daemon", "stop"]).status.code(), Some(0));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(run(&["daemon", "start"]).status.code(), Some(0));
    // The job's store re-adopts an attempt whose runner died; deleting the job is what ends it.
    let del = run(&["delete", "job", "restarted"]);
    assert!(del.status.success(), "{}", String::from_utf8_lossy(&del.stderr));
    let gc = run(&["gc"]);
    assert!(gc.status.success(), "{}", String::from_utf8_lossy(&gc.stderr));
    assert!(eventually(Duration::from_secs(10), || processes_matching("sleep 961").is_empty()));
    assert!(!Path::new(IPAM_DIR).join(&ip).exists(), "the lease of {ip} stayed");
    assert_unpublished(port);
    let hosts = std::fs::read_to_string("/run/runner/net/runner/hosts").unwrap_or_default();
    assert!(!hosts.contains(&format!("{ip}\t")), "{hosts}");
    let rules = Command::new("nft")
        .args(["list", "table", "inet", "runner"])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&rules.stdout).contains("runner:restarted"));
}

/// `kind: Network`: a container reaches the containers of its own network (by name too), and
/// nothing on another network or on the default one; an unused network goes with `runner gc`.
#[test]
#[ignore = "needs a private containerd and the CNI plugins: run scripts/test.sh"]
fn named_networks_are_isolated_from_each_other_and_from_the_default_one() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import(&state);
    import_python(&state);
    let ws = dir.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    let networks = "apiVersion: runner/v1alpha1\nkind: Network\nmetadata: {name: alpha}\nspec: {subnet: 10.97.0.0/24}\n---\napiVersion: runner/v1alpha1\nkind: Network\nmetadata: {name: beta}\nspec: {subnet: 10.96.0.0/24, gateway: 10.96.0.254, bridge: rtest-beta}\n";
    let env = |name: &str, image: &str, network: &str| {
        format!(
            "---\napiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: {name}}}\nspec:\n  image: {image}\n  network: {network}\n"
        )
    };
    let job = |name: &str, env: &str, command: &str, workspace: bool| {
        let ws = if workspace {
            format!("  workspace: {}\n", ws.display())
        } else {
            String::new()
        };
        format!(
            "---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {name}}}\nspec:\n  environment: {env}\n  command: {command:?}\n{ws}"
        )
    };
    let server = format!(
        "{networks}{}{}",
        env("on-alpha", IMAGE, "alpha"),
        job(
            "srv-alpha",
            "on-alpha",
            "ip -4 -o addr show eth0 > /workspace/ip; mkdir -p /tmp/www; echo alpha > /tmp/www/index.html; exec httpd -f -p 7070 -h /tmp/www",
            true
        )
    );
    let file = write_manifest(dir.path(), "server.yaml", &server);
    let mut cmd = runner_ctd_command(&["apply", "-f", file.to_str().unwrap()], &state);
    let running = Stop(cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap());
    assert!(eventually(Duration::from_secs(20), || ws.join("ip").exists()
        && std::fs::read_to_string(ws.join("ip")).unwrap().contains("inet ")));
    let text = std::fs::read_to_string(ws.join("ip")).unwrap();
    let ip = text
        .split_whitespace()
        .find_map(|w| w.strip_suffix("/24"))
        .unwrap_or_else(|| panic!("no /24 address in {text:?}"))
        .to_string();
    assert!(ip.starts_with("10.97.0."), "{ip}");
    let probe = |network: &str| -> String {
        let script = format!(
            "python3 -c '\nimport socket\ntry:\n    a = socket.gethostbyname(\"srv-alpha\")\nexcept OSError:\n    a = \"unknown\"\ntry:\n    s = socket.create_connection((\"{ip}\", 7070), timeout=2)\n    s.sendall(b\"GET / HTTP/1.0\\r\\n\\r\\n\")\n    body = s.makefile(\"rb\").read().decode().strip().splitlines()[-1]\nexcept OSError:\n    body = \"refused\"\nns = [l.split()[1] for l in open(\"/etc/resolv.conf\") if l.startswith(\"nameserver\")]\nprint(a, body, *ns)\n'"
        );
        let name = format!("probe-{}", network.replace(':', "-"));
        let text = format!(
            "{networks}{}{}",
            env("prober", PYTHON, network),
            job(&name, "prober", &script, false)
        );
        let file = write_manifest(dir.path(), &format!("{name}.yaml"), &text);
        stdout_of(&runner_ctd(
            &["apply", "-f", file.to_str().unwrap(), "-o", "json"],
            &state,
        ))
    };
    assert_eq!(probe("alpha"), format!("{ip} alpha 10.97.0.1\n"));
    assert_eq!(probe("beta"), "unknown refused 10.96.0.254\n");
    assert_eq!(probe("bridge"), "unknown refused 10.89.0.1\n");
    // While srv-alpha is on alpha, the host holds alpha to its definition: another subnet
    // under the same name, another network over its subnet, or one taking its bridge is
    // refused when a container would join it.
    for (doc, want) in [
        (
            "metadata: {name: alpha}\nspec: {subnet: 10.97.1.0/24}",
            "network runner-alpha is in use as 10.97.0.0/24",
        ),
        (
            "metadata: {name: gamma}\nspec: {subnet: 10.97.0.128/25}",
            "clashes with network runner-alpha",
        ),
        (
            "metadata: {name: delta}\nspec: {subnet: 10.94.0.0/24, bridge: rn-alpha}",
            "clashes with network runner-alpha",
        ),
    ] {
        let name = doc.split(['}', ' ']).nth(2).unwrap().to_string();
        let text = format!(
            "apiVersion: runner/v1alpha1\nkind: Network\n{doc}\n{}{}",
            env("clash", IMAGE, &name),
            job(&format!("clash-{name}"), "clash", "true", false)
        );
        let file = write_manifest(dir.path(), "clash.yaml", &text);
        // (An infrastructure failure is retried with backoff: a short one here.)
        let out = runner_ctd_command(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], &state)
            .env("RUNNER_BACKOFF_BASE", "10ms")
            .output()
            .unwrap();
        let v = json_of(&out);
        let message = v["status"]["attempts"][0]["message"].as_str().unwrap_or_default();
        assert!(message.contains(want), "{doc}: {v}");
    }
    drop(running);
    let _ = runner_ctd(&["delete", "job", "srv-alpha"], &state);
    // Nothing is on alpha or beta any more: gc takes them down (the default network may
    // still carry other tests' containers).
    let gc = runner_ctd(&["gc"], &state);
    assert!(gc.status.success(), "{}", String::from_utf8_lossy(&gc.stderr));
    for bridge in ["rn-alpha", "rtest-beta"] {
        assert!(!Path::new("/sys/class/net").join(bridge).exists(), "{bridge} stayed");
    }
    let nft = Command::new("nft")
        .args(["list", "table", "inet", "runner"])
        .output()
        .unwrap();
    let nft = String::from_utf8_lossy(&nft.stdout);
    assert!(!nft.contains("rn-alpha") && !nft.contains("10.96.0.0/24"), "{nft}");
    assert!(!Path::new("/var/lib/cni/networks/runner-alpha").exists());
}

#[test]
fn networks_are_checked_with_their_place() {
    let dir = tempfile::tempdir().unwrap();
    let net = |name: &str, spec: &str| {
        format!("apiVersion: runner/v1alpha1\nkind: Network\nmetadata: {{name: {name}}}\nspec: {spec}\n")
    };
    let tail = "---\napiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: e}\nspec:\n  image: local/busybox:1.35\n  network: n1\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: j}\nspec:\n  environment: e\n  command: \"true\"\n";
    for (doc, want) in [
        (net("n1", "{subnet: 10.97.0.0/33}"), "is not a subnet"),
        (net("n1", "{subnet: 10.97.0.1/24}"), "is not a subnet"),
        (
            net("n1", "{subnet: 10.89.5.0/24}"),
            "overlaps runner's default bridge network",
        ),
        (
            net("n1", "{subnet: 10.97.0.0/24, gateway: 10.98.0.1}"),
            "is not a host address of 10.97.0.0/24",
        ),
        (
            net("n1", "{subnet: 10.97.0.0/24, bridge: a-very-long-bridge-name}"),
            "is not a bridge name",
        ),
        (net("bridge", "{subnet: 10.97.0.0/24}"), "is not a Network name"),
        (net("n1", "{subnet: 10.97.0.0/24, mtu: 9000}"), "unknown field `mtu`"),
        (
            format!(
                "{}---\n{}",
                net("n1", "{subnet: 10.97.0.0/24}"),
                net("n2", "{subnet: 10.97.0.128/25}")
            ),
            "overlaps Network \"n1\"",
        ),
        (net("n2", "{subnet: 10.97.0.0/24}"), "no Network \"n1\""),
    ] {
        let file = write_manifest(dir.path(), "n.yaml", &format!("{doc}{tail}"));
        let out = runner(&["validate", "-f", file.to_str().unwrap()], &dir.path().join("state"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{doc}: {err}");
        assert!(err.contains("n.yaml:"), "{err}");
    }
}

/// A session over HTTP names a Network of `serve --env-dir`.
#[test]
#[ignore = "needs a private containerd and the CNI plugins: run scripts/test.sh"]
fn a_session_over_http_joins_a_network_of_the_env_dir() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import_python(&state);
    let envs = dir.path().join("envs");
    std::fs::create_dir_all(&envs).unwrap();
    std::fs::write(
        envs.join("net.yaml"),
        "apiVersion: runner/v1alpha1\nkind: Network\nmetadata: {name: sessnet}\nspec: {subnet: 10.95.0.0/24}\n",
    )
    .unwrap();
    let server = serve_with_args(
        runner_ctd_command(&[], &state),
        dir.path(),
        &["--env-dir", envs.to_str().unwrap()],
    );
    let (code, session) = server.call(
        "POST",
        "/v1/sessions",
        Some(&format!(
            r#"{{"environment": {{"image": "{PYTHON}", "network": "sessnet"}}}}"#
        )),
    );
    assert_eq!(code, 201, "{session}");
    let id = session["id"].as_str().unwrap().to_string();
    assert!(
        session["network"]["ip"]
            .as_str()
            .unwrap_or_default()
            .starts_with("10.95.0."),
        "{session}"
    );
    let body = serde_json::json!({"command": ["python3", "-c", "print([l for l in open('/etc/resolv.conf') if l.startswith('nameserver')][0].strip())"]}).to_string();
    let (code, out) = server.call("POST", &format!("/v1/sessions/{id}/exec"), Some(&body));
    assert_eq!(code, 200, "{out}");
    assert_eq!(out["stdout"], "nameserver 10.95.0.1\n", "{out}");
    // A network nobody declared is the request's error, with its field.
    let (code, err) = server.call(
        "POST",
        "/v1/sessions",
        Some(&format!(
            r#"{{"environment": {{"image": "{PYTHON}", "network": "nowhere"}}}}"#
        )),
    );
    assert_eq!(code, 400, "{err}");
    assert!(
        err["error"]
            .as_str()
            .unwrap_or_default()
            .starts_with("network: no Network \"nowhere\""),
        "{err}"
    );
    assert_eq!(server.call("DELETE", &format!("/v1/sessions/{id}"), None).0, 204);
    drop(server);
    assert_released(&state, &[]);
}
