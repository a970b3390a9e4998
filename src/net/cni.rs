//! The container's side of a network: its veth on the bridge, made in-process over netlink
//! (`link`), and the CNI plugins (Debian's containernetworking-plugins) for what runner does not
//! do itself (`portmap`), run per the CNI spec (1.0.0 as the installed 1.1 plugins speak it): `CNI_COMMAND`, `CNI_CONTAINERID`, `CNI_NETNS`,
//! `CNI_IFNAME`, `CNI_PATH` in the environment, the plugin's config on stdin with `name`,
//! `cniVersion` and the previous plugin's result (`prevResult`); ADD in list order, DEL in
//! reverse with the cached ADD result. Behind a trait, so the layer's logic runs in tests
//! without root (`Fake`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use serde_json::{Value, json};

use super::{IFNAME, NetError, PortStatus, io_err};

const CNI_VERSION: &str = "1.0.0";

/// One plugin invocation: ADD or DEL, for (container id, network name), in a namespace.
pub struct Call<'a> {
    pub command: &'static str,
    pub plugin: &'a Value,
    pub container: &'a str,
    pub network: &'a str,
    pub netns: &'a Path,
    pub prev: Option<&'a Value>,
}

/// A container's link to its network's bridge (what the CNI bridge plugin made, ~9 ms of a
/// process per attach, now ~1 ms in-process, as netavark does it).
#[derive(Clone, Debug)]
pub struct Link<'a> {
    pub bridge: &'a str,
    pub gateway: std::net::Ipv4Addr,
    pub prefix: u8,
    /// The host's end (on the bridge).
    pub host_if: &'a str,
    pub netns: &'a Path,
    pub ip: std::net::Ipv4Addr,
}

/// Makes a container's link, runs CNI plugins, and takes a bridge down again.
pub trait Cni: Send + Sync {
    /// The bridge (made when missing, with the gateway on it), a veth pair with the host's end
    /// on it in hairpin mode and `eth0` in the namespace, its address and default route.
    fn link(&self, link: &Link<'_>) -> Result<(), NetError>;
    /// Run one plugin; its parsed stdout (`Null` when it printed nothing).
    fn invoke(&self, call: &Call<'_>) -> Result<Value, NetError>;
    /// Delete the network interface `name` (none is success).
    fn delete_link(&self, name: &str) -> Result<(), NetError>;
}

/// What the bridge plugin would have answered (`prevResult` for portmap, the attach record).
pub fn result(link: &Link<'_>) -> Value {
    json!({
        "cniVersion": CNI_VERSION,
        "interfaces": [
            {"name": link.bridge},
            {"name": link.host_if},
            {"name": IFNAME, "sandbox": link.netns},
        ],
        "ips": [{"address": format!("{}/{}", link.ip, link.prefix), "gateway": link.gateway.to_string(), "interface": 2}],
        "routes": [{"dst": "0.0.0.0/0"}],
    })
}

/// The plugins a container publishing `ports` (their host ports picked already) needs: portmap
/// (DNAT from the host's ports: PREROUTING for other hosts, OUTPUT for this one; SNAT of what
/// comes from the host's loopback so the answers find their way back), or none.
pub fn plugins(ports: &[PortStatus]) -> Vec<Value> {
    if ports.is_empty() {
        return Vec::new();
    }
    let mappings: Vec<Value> = ports
        .iter()
        .map(|p| {
            json!({
                "hostPort": p.host_port,
                "containerPort": p.container_port,
                "protocol": p.protocol.lower(),
                "hostIP": p.host_ip,
            })
        })
        .collect();
    // No `firewall` plugin: iptables' FORWARD chain (where a host with Docker has a DROP
    // policy) accepts the whole subnet once per network, where the plugin added and deleted
    // a pair of rules per container (~45 ms of every run).
    vec![json!({
        "type": "portmap",
        "capabilities": {"portMappings": true},
        "snat": true,
        "runtimeConfig": {"portMappings": mappings},
    })]
}

/// What DEL runs for a plugin of a record's list (records of runner versions that ran the
/// bridge plugin have it first). The bridge plugin's DEL is its IPAM's DEL (it
/// delegates with the same config) plus deleting the veth inside the namespace, which costs
/// 20-30 ms of every teardown in the kernel's synchronous device removal. runner calls the
/// IPAM plugin itself and lets the veth go with the namespace: unpinned right after, with no
/// process left in it, the namespace is destroyed and its devices (the veth pair) with it.
/// host-local hands addresses out in order over the subnet, so the address is not given again
/// before that.
pub fn del_form(plugin: &Value) -> Value {
    match (plugin["type"].as_str(), plugin["ipam"]["type"].as_str()) {
        (Some("bridge"), Some(ipam)) => {
            let mut p = plugin.clone();
            p["type"] = json!(ipam);
            p
        }
        _ => plugin.clone(),
    }
}

/// The IPv4 address a bridge plugin's result gave the container.
pub fn result_ip(result: &Value) -> Option<std::net::Ipv4Addr> {
    result["ips"][0]["address"].as_str()?.split('/').next()?.parse().ok()
}

/// The plugins on disk, found along `path`.
#[derive(Clone, Debug)]
pub struct Plugins {
    pub path: Vec<PathBuf>,
    /// Where a bridge port's settings are (`<if>/brport/hairpin_mode`).
    pub sys_class_net: PathBuf,
}

impl Plugins {
    fn path_var(&self) -> String {
        self.path
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(":")
    }

    fn find(&self, name: &str) -> Result<PathBuf, NetError> {
        self.path
            .iter()
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
            .ok_or_else(|| NetError::Plugin {
                plugin: name.into(),
                command: "find",
                message: format!(
                    "not found in {} (install containernetworking-plugins, or give --cni-path)",
                    self.path_var()
                ),
            })
    }
}

/// IPv4 forwarding on, as the CNI bridge plugin's `isGateway` (which `link` stands in for)
/// turns it on: without it the host routes nothing from the bridge onward, and a `network:
/// bridge` sandbox reaches the host and nothing past it, its egress rules whatever they say (a
/// fresh Debian host boots with it off). What a sandbox may reach past the host is the wall's
/// to decide (`inet runner`). Written only when off.
fn enable_ipv4_forwarding() -> std::io::Result<()> {
    enable_forwarding_at(Path::new("/proc/sys/net/ipv4/ip_forward"))
}

/// `enable_ipv4_forwarding` on the sysctl file `path`.
fn enable_forwarding_at(path: &Path) -> std::io::Result<()> {
    if std::fs::read_to_string(path)?.trim() == "1" {
        return Ok(());
    }
    tracing::info!("turning IPv4 forwarding on (net.ipv4.ip_forward), as the CNI bridge plugin does");
    std::fs::write(path, "1")
}

impl Cni for Plugins {
    fn link(&self, link: &Link<'_>) -> Result<(), NetError> {
        let fail = |what: &str| io_err(format!("{what} ({} on {})", link.host_if, link.bridge));
        super::netlink::ensure_bridge(link.bridge, link.gateway, link.prefix).map_err(fail("making the bridge"))?;
        enable_ipv4_forwarding().map_err(fail("turning IPv4 forwarding on"))?;
        let netns = std::fs::File::open(link.netns).map_err(fail("opening the network namespace"))?;
        super::netlink::add_veth(link.host_if, link.bridge, IFNAME, &netns).map_err(fail("making the veth pair"))?;
        // Hairpin: a container reaches itself through a published port of its own.
        let hairpin = self.sys_class_net.join(link.host_if).join("brport/hairpin_mode");
        std::fs::write(&hairpin, "1").map_err(fail("hairpin mode"))?;
        super::netlink::configure_in(netns, IFNAME, link.ip, link.prefix, link.gateway)
            .map_err(fail("the container's address and route"))
    }

    fn invoke(&self, call: &Call<'_>) -> Result<Value, NetError> {
        let kind = call.plugin["type"].as_str().unwrap_or_default().to_string();
        let binary = self.find(&kind)?;
        let mut config = call.plugin.clone();
        config["name"] = json!(call.network);
        config["cniVersion"] = json!(CNI_VERSION);
        if let Some(prev) = call.prev {
            config["prevResult"] = prev.clone();
        }
        let mut child = Command::new(&binary)
            .env_clear()
            .env("CNI_COMMAND", call.command)
            .env("CNI_CONTAINERID", call.container)
            .env("CNI_NETNS", call.netns)
            .env("CNI_IFNAME", IFNAME)
            .env("CNI_PATH", self.path_var())
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(io_err(format!("running {}", binary.display())))?;
        let written = child
            .stdin
            .take()
            .expect("piped")
            .write_all(config.to_string().as_bytes());
        let out = child
            .wait_with_output()
            .map_err(io_err(format!("running {}", binary.display())))?;
        if !out.status.success() {
            // The spec's error object: {code, msg, details}.
            let message = serde_json::from_slice::<Value>(&out.stdout)
                .ok()
                .and_then(|v| {
                    let msg = v["msg"].as_str()?.to_string();
                    Some(match v["details"].as_str() {
                        Some(d) if !d.is_empty() => format!("{msg}: {d}"),
                        _ => msg,
                    })
                })
                .unwrap_or_else(|| {
                    format!(
                        "{} {}",
                        String::from_utf8_lossy(&out.stdout).trim(),
                        String::from_utf8_lossy(&out.stderr).trim()
                    )
                });
            return Err(NetError::Plugin {
                plugin: kind,
                command: call.command,
                message,
            });
        }
        written.map_err(io_err(format!("writing to {}", binary.display())))?;
        if out.stdout.iter().all(u8::is_ascii_whitespace) {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&out.stdout).map_err(|e| NetError::Plugin {
            plugin: kind,
            command: call.command,
            message: format!("unreadable result: {e}"),
        })
    }

    fn delete_link(&self, name: &str) -> Result<(), NetError> {
        super::netlink::delete_link(name).map_err(io_err(format!("deleting the interface {name}")))
    }
}

/// Links and plugins in memory: every call is recorded.
#[derive(Debug, Default)]
pub struct Fake {
    pub calls: Mutex<Vec<(String, String, String)>>,
    /// The links made: (host interface, container address).
    pub links: Mutex<Vec<(String, std::net::Ipv4Addr)>>,
    /// A plugin type whose ADD fails.
    pub fail_add: Option<String>,
}

impl Cni for Fake {
    fn link(&self, link: &Link<'_>) -> Result<(), NetError> {
        self.links
            .lock()
            .expect("fake cni")
            .push((link.host_if.to_string(), link.ip));
        Ok(())
    }

    fn invoke(&self, call: &Call<'_>) -> Result<Value, NetError> {
        let kind = call.plugin["type"].as_str().unwrap_or_default().to_string();
        self.calls
            .lock()
            .expect("fake cni")
            .push((call.command.into(), kind.clone(), call.container.into()));
        if call.command == "ADD" && self.fail_add.as_deref() == Some(&kind) {
            return Err(NetError::Plugin {
                plugin: kind,
                command: call.command,
                message: "failing as asked".into(),
            });
        }
        Ok(call.prev.cloned().unwrap_or(Value::Null))
    }

    fn delete_link(&self, name: &str) -> Result<(), NetError> {
        self.calls
            .lock()
            .expect("fake cni")
            .push(("DELLINK".into(), name.into(), String::new()));
        Ok(())
    }
}

#[cfg(test)]
mod forwarding_tests {
    use super::*;

    #[test]
    fn forwarding_is_turned_on_when_off_and_left_alone_when_on() {
        let dir = tempfile::tempdir().unwrap();
        let off = dir.path().join("off");
        std::fs::write(&off, "0\n").unwrap();
        enable_forwarding_at(&off).unwrap();
        assert_eq!(std::fs::read_to_string(&off).unwrap(), "1");
        // Already on: not written (a write would leave "1" without its newline).
        let on = dir.path().join("on");
        std::fs::write(&on, "1\n").unwrap();
        enable_forwarding_at(&on).unwrap();
        assert_eq!(std::fs::read_to_string(&on).unwrap(), "1\n");
        // A host without the file (no IPv4): the link fails with the reason.
        assert!(enable_forwarding_at(&dir.path().join("missing")).is_err());
    }
}
