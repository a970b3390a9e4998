//! `network: bridge` with the real CNI plugins (Debian's containernetworking-plugins), real
//! network namespaces and real nftables, through `runner apply`. Traffic goes only between
//! this machine's own addresses: containers on the test's bridge, and a server the test starts
//! on the host.

mod bridge;
#[path = "../common/mod.rs"]
mod common;
mod egress;
mod ports;
mod resolver;

pub use std::path::{Path, PathBuf};
pub use std::process::{Child, Command, Output, Stdio};
pub use std::time::Duration;

pub use common::*;

const IMAGE: &str = "local/busybox:1.35";
const PYTHON: &str = "local/python:3.11";
/// host-local's leases: one file per address in use.
const IPAM_DIR: &str = "/var/lib/cni/networks/runner";

pub fn import(state: &Path) {
    let out = runner_ctd(
        &["image", "import", image_dir().join("busybox-oci.tar").to_str().unwrap()],
        state,
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

pub fn import_python(state: &Path) {
    let out = runner_ctd(
        &["image", "import", image_dir().join("python-oci.tar").to_str().unwrap()],
        state,
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

pub fn manifest(name: &str, command: &str, workspace: Option<&Path>, env_extra: &str) -> String {
    let ws = workspace.map_or(String::new(), |w| format!("  workspace: {}\n", w.display()));
    format!(
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: br}}\nspec:\n  image: {IMAGE}\n  network: bridge\n{env_extra}---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {name}}}\nspec:\n  environment: br\n  command: {command:?}\n{ws}"
    )
}

pub fn apply(dir: &Path, state: &Path, name: &str, command: &str, workspace: Option<&Path>) -> Command {
    let file = write_manifest(dir, &format!("{name}.yaml"), &manifest(name, command, workspace, ""));
    let mut cmd = runner_ctd_command(&["apply", "-f", file.to_str().unwrap(), "-o", "json"], state);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

pub fn stdout_of(out: &Output) -> String {
    let v = json_of(out);
    assert_eq!(v["status"]["phase"], "Succeeded", "{v}");
    v["status"]["result"]["stdout"].as_str().unwrap_or_default().to_string()
}

/// Nothing of the container's network stays: its address is leased to nobody, and its run
/// directory (pins, cached CNI result) is gone.
pub fn assert_released(state: &Path, ips: &[String]) {
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

pub fn ip_of(text: &str) -> String {
    text.split_whitespace()
        .find_map(|w| w.strip_suffix("/16").filter(|a| a.starts_with("10.89.")))
        .unwrap_or_else(|| panic!("no 10.89.x.y/16 address in {text:?}"))
        .to_string()
}

/// A `runner apply` that is stopped as Ctrl-C stops it (its job torn down) when the test
/// ends, failing or not: a failed assertion must not leave a job on the bridge.
pub struct Stop(pub Child);

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
pub struct HostServer {
    pub child: Child,
    pub port: u16,
}

impl Drop for HostServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn host_server(dir: &Path) -> HostServer {
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

/// `runner apply` of a bridge job that publishes a port, says its address and sleeps
/// `seconds`, SIGKILLed once the job runs (no cleanup runs): its address and host port.
pub fn orphan_a_bridge_job(dir: &Path, state: &Path, name: &str, seconds: u32) -> (String, u16) {
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
pub fn assert_unpublished(port: u16) {
    let recorded = std::fs::read_to_string("/run/runner/net/ports").unwrap_or_default();
    assert!(!recorded.contains(&format!(" {port} ")), "{recorded}");
    let nat = Command::new("iptables-save").args(["-t", "nat"]).output().unwrap();
    let nat = String::from_utf8_lossy(&nat.stdout);
    assert!(!nat.contains(&format!("--dport {port} ")), "{nat}");
}

/// A host of the test's own: a network namespace behind a veth pair, with TCP servers on
/// ports 8080 and 8081 and a UDP listener on 9090 that records what it receives.
pub struct Upstream {
    pub ns: String,
    pub host_if: String,
    pub addr: String,
    pub udp_log: PathBuf,
    pub server: Child,
    /// dnsmasq, when the test serves names.
    pub dns: Option<Child>,
}

impl Upstream {
    /// Serve these names (each to an address) with dnsmasq on the upstream's address.
    pub fn serve_names(&mut self, names: &[(&str, &str)]) {
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

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A DNS query for `name`'s A record (`tcp`: with its length in front).
pub fn dns_query(name: &str, tcp: bool) -> Vec<u8> {
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

pub fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A host of the test's own on a private address (10.199.n.2/30): reached by a container only
/// through a CIDR entry (a domain's answer never opens a private range).
pub fn upstream(dir: &Path) -> Upstream {
    upstream_at(dir, |n| (format!("10.199.{n}.1"), format!("10.199.{n}.2")), 250)
}

/// The same on a documentation address (203.0.113.4n+2/30, TEST-NET-3: not a closed range),
/// for what domain entries open. It lives in a namespace this test made, like the other.
pub fn public_upstream(dir: &Path) -> Upstream {
    upstream_at(
        dir,
        |n| (format!("203.0.113.{}", 4 * n + 1), format!("203.0.113.{}", 4 * n + 2)),
        62,
    )
}

pub fn upstream_at(dir: &Path, addrs: impl Fn(u32) -> (String, String), slots: u32) -> Upstream {
    // Unique per test of this process (tests run side by side), and per process.
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tag = format!("{}{k}", std::process::id() % 100_000);
    let n = (std::process::id() * 4 + k) % slots + 1;
    let ns = format!("rtup{tag}");
    let host_if = format!("rtu{tag}");
    let peer = format!("rtp{tag}");
    let (host_addr, addr) = addrs(n);
    sh(&["ip", "netns", "add", &ns]);
    sh(&["ip", "link", "add", &host_if, "type", "veth", "peer", "name", &peer]);
    sh(&["ip", "link", "set", &peer, "netns", &ns]);
    sh(&["ip", "addr", "add", &format!("{host_addr}/30"), "dev", &host_if]);
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
def echo_one(c):
    while True:
        data = c.recv(1024)
        if not data:
            return
        c.sendall(data)
def echo():
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("{addr}", 8082)); s.listen(16)
    while True:
        c, _ = s.accept()
        threading.Thread(target=echo_one, args=(c,), daemon=True).start()
for p in (8080, 8081): threading.Thread(target=tcp, args=(p,), daemon=True).start()
threading.Thread(target=echo, daemon=True).start()
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

/// The wall's sets keep nothing of container `ip` (its CIDR and domain elements went with it).
pub fn assert_no_elements_of(ip: &str) {
    for set in ["allow_net", "allow_port", "dom", "dom_port"] {
        let out = Command::new("nft")
            .args(["list", "set", "inet", "runner", set])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            !text.contains(&format!("{ip} . ")),
            "{set} keeps elements of {ip}: {text}"
        );
    }
}

/// The published ports `runner get job NAME -o json` reports for the job's first attempt,
/// once its container is attached.
pub fn published_ports(state: &Path, job: &str) -> Vec<serde_json::Value> {
    let (mut ports, mut last) = (Vec::new(), String::new());
    // Generous: two of these tests run side by side on 2 cores, one of them may be the
    // resolver's flood; the failure quotes what `get` said last (a failed job says why).
    assert!(
        eventually(Duration::from_secs(60), || {
            let out = runner_ctd(&["get", "job", job, "-o", "json"], state);
            last = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            match v["status"]["attempts"][0]["network"]["ports"].as_array() {
                Some(p) => {
                    ports = p.clone();
                    true
                }
                None => false,
            }
        }),
        "job {job} never reported its ports; `runner get job {job} -o json` said:\n{last}"
    );
    ports
}

pub fn host_port(ports: &[serde_json::Value], container_port: u16) -> u16 {
    ports
        .iter()
        .find(|p| p["containerPort"] == container_port)
        .and_then(|p| p["hostPort"].as_u64())
        .unwrap_or_else(|| panic!("no hostPort for {container_port} in {ports:?}")) as u16
}

/// A port of this host nothing listens on (the kernel's pick, released at once).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn http_get(addr: &str) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(3))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"GET / HTTP/1.0\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok(text)
}
