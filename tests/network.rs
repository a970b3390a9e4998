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
/// host-local's leases: one file per address in use.
const IPAM_DIR: &str = "/var/lib/cni/networks/runner";

fn import(state: &Path) {
    let out = runner_ctd(
        &["image", "import", image_dir().join("busybox-oci.tar").to_str().unwrap()],
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
    let server = apply(
        dir.path(),
        &state,
        "server",
        "ip -4 -o addr show eth0 > /workspace/ip.tmp && mv /workspace/ip.tmp /workspace/ip; mkdir -p /tmp/www; echo pong > /tmp/www/index.html; exec httpd -f -p 7070 -h /tmp/www",
        Some(&ws),
    )
    .spawn()
    .unwrap();
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
    let _ = server.wait_with_output();
    assert_released(&state, &[server_ip]);
}

#[test]
#[ignore = "needs a private containerd and the CNI plugins: run scripts/test.sh"]
fn a_killed_runner_leaves_no_network_behind_after_gc_and_delete() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    import(&state);
    let ws = dir.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    let mut child = apply(
        dir.path(),
        &state,
        "orphan",
        "ip -4 -o addr show eth0 > /workspace/ip.tmp && mv /workspace/ip.tmp /workspace/ip; sleep 963",
        Some(&ws),
    )
    .spawn()
    .unwrap();
    assert!(eventually(Duration::from_secs(20), || ws.join("ip").exists()));
    let ip = ip_of(&std::fs::read_to_string(ws.join("ip")).unwrap());
    // SIGKILL: no cleanup runs.
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(Path::new(IPAM_DIR).join(&ip).exists());
    let gc = runner_ctd(&["gc"], &state);
    assert!(gc.status.success(), "{}", String::from_utf8_lossy(&gc.stderr));
    let del = runner_ctd(&["delete", "job", "orphan"], &state);
    assert!(del.status.success(), "{}", String::from_utf8_lossy(&del.stderr));
    assert!(eventually(Duration::from_secs(10), || processes_matching("sleep 963").is_empty()));
    assert_released(&state, &[ip]);
}
