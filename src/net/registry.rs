//! The networks registered on this host: each one once (its elements in the wall's sets,
//! iptables' FORWARD pair for its subnet, a marker `network.json` in its directory), vetted
//! before a container joins (a definition that changed under running containers, an
//! overlapping subnet, a bridge another network has: refused), and taken down when no
//! container is on it. Under the network lock.

use std::path::Path;

use super::firewall::plan;
use super::{Host, Net, NetError, io_err};

/// In a network's directory: what it was registered with.
const MARKER: &str = "network.json";

impl Host {
    /// The networks registered on this host (their directories' markers).
    pub(super) fn registered(&self) -> Vec<Net> {
        let Ok(dirs) = std::fs::read_dir(&self.paths.dir) else {
            return Vec::new();
        };
        dirs.flatten()
            .filter_map(|e| std::fs::read(e.path().join(MARKER)).ok())
            .filter_map(|b| serde_json::from_slice(&b).ok())
            .collect()
    }

    /// Whether a container is on a network: an interface on its bridge, or an address leased.
    pub(super) fn in_use(&self, net: &Net) -> bool {
        let nonempty = |dir: &Path, skip: &dyn Fn(&str) -> bool| {
            std::fs::read_dir(dir)
                .map(|d| d.flatten().any(|e| !skip(&e.file_name().to_string_lossy())))
                .unwrap_or(false)
        };
        nonempty(&self.paths.sys_class_net.join(&net.bridge).join("brif"), &|_| false)
            || nonempty(&self.paths.ipam_dir.join(&net.name), &|n| {
                n == "lock" || n.starts_with("last_reserved_ip")
            })
    }

    /// Whether a network must be registered before a container joins it (`false`: it is, as
    /// defined). A network whose definition changed is refused while a container is on it
    /// (and taken down first otherwise); one that overlaps another's subnet or takes its
    /// bridge is refused. Before CNI ADD, which would make the bridge as asked.
    pub(super) fn vet(&self, net: &Net) -> Result<bool, NetError> {
        let marker = self.net_dir(net).join(MARKER);
        let known: Option<Net> = std::fs::read(&marker)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        if known.as_ref() == Some(net) {
            return Ok(false);
        }
        if let Some(old) = known {
            if self.in_use(&old) {
                return Err(NetError::Conflict(format!(
                    "network {} is in use as {} on {}; its definition changed to {} on {}: end its containers first",
                    old.name, old.subnet, old.bridge, net.subnet, net.bridge
                )));
            }
            self.unregister(&old)?;
        }
        if let Some(other) = self
            .registered()
            .into_iter()
            .find(|o| o.name != net.name && (o.overlaps(net) || o.bridge == net.bridge))
        {
            return Err(NetError::Conflict(format!(
                "network {} ({} on {}) clashes with network {} ({} on {}) on this host",
                net.name, net.subnet, net.bridge, other.name, other.subnet, other.bridge
            )));
        }
        Ok(true)
    }

    /// Make a vetted network known to the wall and to iptables, and mark it registered.
    /// After the wall stands.
    pub(super) fn register(&self, net: &Net) -> Result<(), NetError> {
        self.firewall
            .apply("registering a network", &plan::batch(plan::net_elements(net, true)))?;
        self.firewall.forward(&net.subnet, true)?;
        let dir = self.net_dir(net);
        std::fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let text = serde_json::to_vec(net).map_err(|e| io_err("encoding the network")(std::io::Error::other(e)))?;
        let marker = dir.join(MARKER);
        std::fs::write(&marker, text).map_err(io_err(format!("writing {}", marker.display())))
    }

    /// Take a network off the host: its bridge (with the veths of dead namespaces), its set
    /// elements, its iptables pair, IPAM's and its own directory.
    pub(super) fn unregister(&self, net: &Net) -> Result<(), NetError> {
        if self.paths.sys_class_net.join(&net.bridge).exists() {
            self.cni.delete_link(&net.bridge)?;
        }
        // Its elements go only where the wall still has them (a delete of a missing one
        // fails): read back typed.
        let listed = self
            .firewall
            .elements("bridges")?
            .iter()
            .any(|e| matches!(e, nftables::expr::Expression::String(b) if b == &net.bridge));
        if listed {
            self.firewall
                .apply("unregistering a network", &plan::batch(plan::net_elements(net, false)))?;
        }
        self.firewall.forward(&net.subnet, false)?;
        for dir in [self.paths.ipam_dir.join(&net.name), self.net_dir(net)] {
            if dir.exists() {
                std::fs::remove_dir_all(&dir).map_err(io_err(format!("removing {}", dir.display())))?;
            }
        }
        Ok(())
    }

    /// The wall, made when it is not the current one (an older one is replaced whole, with
    /// every registered network and the running resolver's port); whether it was made now.
    pub(super) fn ensure_wall(&self, resolver_port: Option<u16>) -> Result<bool, NetError> {
        if self.firewall.wall_current()? {
            return Ok(false);
        }
        self.firewall
            .apply("making the wall", &plan::wall(resolver_port, &self.registered()))?;
        Ok(true)
    }
}
