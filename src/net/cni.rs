//! The CNI plugins (Debian's containernetworking-plugins), run per the CNI spec (1.0.0 as the
//! installed 1.1 plugins speak it): `CNI_COMMAND`, `CNI_CONTAINERID`, `CNI_NETNS`,
//! `CNI_IFNAME`, `CNI_PATH` in the environment, the plugin's config on stdin with `name`,
//! `cniVersion` and the previous plugin's result (`prevResult`); ADD in list order, DEL in
//! reverse with the cached ADD result. Behind a trait, so the layer's logic runs in tests
//! without root (`Fake`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use serde_json::{Value, json};

use super::{IFNAME, Net, NetError, PortStatus, io_err};

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

/// Runs CNI plugins, and takes a bridge the plugins made down again.
pub trait Cni: Send + Sync {
    /// Run one plugin; its parsed stdout (`Null` when it printed nothing).
    fn invoke(&self, call: &Call<'_>) -> Result<Value, NetError>;
    /// Delete the network interface `name` (none is success).
    fn delete_link(&self, name: &str) -> Result<(), NetError>;
}

/// The network's plugin list (a conflist's `plugins`) for a container publishing `ports`
/// (their host ports picked already). `ipam_dir`: where host-local keeps its leases.
pub fn plugins(net: &Net, ports: &[PortStatus], ipam_dir: &Path) -> Vec<Value> {
    let mut list = vec![json!({
        "type": "bridge",
        "bridge": net.bridge,
        "isGateway": true,
        // No NAT from the plugin: the wall decides what leaves (and masquerades it).
        "ipMasq": false,
        "hairpinMode": true,
        "ipam": {
            "type": "host-local",
            "dataDir": ipam_dir,
            "ranges": [[{"subnet": net.subnet, "gateway": net.gateway.to_string()}]],
            "routes": [{"dst": "0.0.0.0/0"}],
        },
    })];
    if !ports.is_empty() {
        // DNAT from the host's ports (PREROUTING for other hosts, OUTPUT for this one), and
        // SNAT of what comes from the host's loopback so the answers find their way back.
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
        list.push(json!({
            "type": "portmap",
            "capabilities": {"portMappings": true},
            "snat": true,
            "runtimeConfig": {"portMappings": mappings},
        }));
    }
    // No `firewall` plugin: iptables' FORWARD chain (where a host with Docker has a DROP
    // policy) accepts the whole subnet once per network, where the plugin added and deleted
    // a pair of rules per container (~45 ms of every run).
    list
}

/// What DEL runs for a plugin of the list. The bridge plugin's DEL is its IPAM's DEL (it
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

impl Cni for Plugins {
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

/// Plugins in memory: ADD of a bridge plugin hands out the subnet's addresses in order, DEL
/// gives them back; every call is recorded.
#[derive(Debug, Default)]
pub struct Fake {
    pub calls: Mutex<Vec<(String, String, String)>>,
    pub leased: Mutex<Vec<(String, std::net::Ipv4Addr)>>,
    /// A plugin type whose ADD fails.
    pub fail_add: Option<String>,
}

impl Cni for Fake {
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
        let mut leased = self.leased.lock().expect("fake cni");
        match (call.command, kind.as_str()) {
            ("ADD", "bridge") => {
                let subnet = call.plugin["ipam"]["ranges"][0][0]["subnet"]
                    .as_str()
                    .unwrap_or("10.89.0.0/16");
                let base: std::net::Ipv4Addr = subnet
                    .split('/')
                    .next()
                    .unwrap_or_default()
                    .parse()
                    .unwrap_or(std::net::Ipv4Addr::new(10, 89, 0, 0));
                let ip = (2..)
                    .map(|i| std::net::Ipv4Addr::from(u32::from(base) + i))
                    .find(|ip| !leased.iter().any(|(_, l)| l == ip))
                    .expect("an address");
                leased.push((call.container.to_string(), ip));
                Ok(json!({"cniVersion": CNI_VERSION, "ips": [{"address": format!("{ip}/16")}]}))
            }
            ("DEL", "host-local") => {
                leased.retain(|(c, _)| c != call.container);
                Ok(Value::Null)
            }
            _ => Ok(call.prev.cloned().unwrap_or(Value::Null)),
        }
    }

    fn delete_link(&self, name: &str) -> Result<(), NetError> {
        self.calls
            .lock()
            .expect("fake cni")
            .push(("DELLINK".into(), name.into(), String::new()));
        Ok(())
    }
}
