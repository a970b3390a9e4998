//! The network layer: `network: bridge` and named networks, between the spec and the runtimes
//! (in the spirit of netavark + aardvark-dns). The runtime calls a small interface — `Host`:
//! `attach`, `detach`, `set_egress` (a live session's PATCH), `remove_if_unused` (gc) — and
//! the namespace pins (`ns`), which it names in the spec before the attach runs.
//!
//! - `ns`: the user and network namespaces runner makes and pins itself;
//! - `cni`: the CNI plugins (bridge + host-local, portmap), behind a trait;
//! - `ports`: published host ports, recorded host-wide;
//! - `names`: a network's hosts and resolv.conf;
//! - `registry`: networks registered on the host (and taken down unused);
//! - `firewall`: the nftables wall, typed (the `nftables` crate), behind a trait with a fake;
//! - `netlink`: the few netlink messages sent in-process (set elements, a set's existence,
//!   a link's removal);
//! - `resolver`: runner's DNS resolver for bridge containers, its own process (`runner
//!   resolver`), bounded, with policies in memory fed over a control socket.
//!
//! Host paths come from `Config` (`NetPaths`); nothing here reads the environment. Every
//! change of shared host state runs under one host-wide lock (`NetPaths::lock_file`).

pub mod cni;
pub mod firewall;
mod ipam;
mod names;
pub mod netlink;
pub mod ns;
mod paths;
pub mod ports;
mod registry;
pub mod resolver;

use std::io;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

pub use self::ns::{Pinned, pin_namespaces, pin_paths, unpin};
pub use crate::config::NetPaths;
use crate::manifest::{EgressDomain, EgressRule, PortSpec};
use firewall::{Firewall, FirewallError, plan};
use resolver::{Control, Policy, ResolverError};

/// Where, in a container's rootfs directory, the pins and the cached CNI result live
/// (`/run/runner/rootfs/<containerd>/<id>/net`: out of the state dir, which may be removed
/// while the container runs).
pub const NET_DIR: &str = "net";
const CNI_CACHE: &str = "cni.json";
/// The interface the container sees.
pub const IFNAME: &str = "eth0";
/// runner's default network, the one every `network: bridge` container joins.
pub const BRIDGE: &str = "runner0";
pub const SUBNET: &str = "10.89.0.0/16";
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 89, 0, 1);
const NETWORK_NAME: &str = "runner";

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("CNI plugin {plugin} ({command}) failed: {message}")]
    Plugin {
        plugin: String,
        command: &'static str,
        message: String,
    },
    #[error("the firewall: {0}")]
    Firewall(#[from] FirewallError),
    #[error("publishing ports: {0}")]
    Ports(String),
    #[error("runner's resolver: {0}")]
    Resolver(#[from] ResolverError),
    #[error("{0}")]
    Conflict(String),
    #[error("container {0} is not on a bridge network (no attach record in its run directory)")]
    NotAttached(String),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> NetError {
    let what = what.into();
    move |source| NetError::Io { what, source }
}

/// A published port as it was bound (`hostPort` is the one picked when none was asked for).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PortStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub container_port: u16,
    pub protocol: crate::manifest::Protocol,
    #[serde(rename = "hostIP")]
    pub host_ip: String,
    pub host_port: u16,
}

impl std::fmt::Display for PortStatus {
    /// Docker's `docker port` form: `8080/tcp -> 127.0.0.1:34567`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{} -> {}:{}",
            self.container_port,
            self.protocol.lower(),
            self.host_ip,
            self.host_port
        )
    }
}

/// One bridge network: runner's default (`network: bridge`) or a Network document's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Net {
    /// The CNI network name (IPAM's directory): `runner`, or `runner-<Network name>`.
    pub name: String,
    pub bridge: String,
    /// `a.b.c.d/n`.
    pub subnet: String,
    pub gateway: Ipv4Addr,
}

impl Net {
    pub fn default_net() -> Net {
        Net {
            name: NETWORK_NAME.into(),
            bridge: BRIDGE.into(),
            subnet: SUBNET.into(),
            gateway: GATEWAY,
        }
    }

    /// The network a container joins: a Network document's, else the default one.
    pub fn of(def: Option<&crate::manifest::NetworkDef>) -> Net {
        match def {
            None => Net::default_net(),
            Some(d) => Net {
                name: format!("{NETWORK_NAME}-{}", d.name),
                bridge: d.bridge.clone(),
                subnet: d.cidr(),
                gateway: d.gateway,
            },
        }
    }

    /// The subnet's address and prefix length.
    pub fn cidr(&self) -> (Ipv4Addr, u8) {
        let (a, p) = self.subnet.split_once('/').unwrap_or((&self.subnet, "32"));
        (a.parse().unwrap_or(Ipv4Addr::UNSPECIFIED), p.parse().unwrap_or(32))
    }

    fn range(&self) -> (u32, u32) {
        let (addr, prefix) = self.cidr();
        let start = u32::from(addr);
        (start, start | u32::MAX.checked_shr(u32::from(prefix)).unwrap_or(0))
    }

    fn overlaps(&self, other: &Net) -> bool {
        let (a, b) = (self.range(), other.range());
        a.0 <= b.1 && b.0 <= a.1
    }
}

/// What a container may reach off its network.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Egress {
    pub cidrs: Vec<EgressRule>,
    /// Enforced by runner's resolver.
    pub domains: Vec<EgressDomain>,
    /// Where the resolver asks for them (empty: the host's resolvers).
    pub upstream: Vec<std::net::SocketAddr>,
}

/// What a container got on the network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attached {
    /// Its address on the bridge (`10.89.0.7`).
    pub ip: String,
    /// Its published ports, each with the host port it got.
    pub ports: Vec<PortStatus>,
}

/// What the runtime asks for when a container joins a network.
#[derive(Clone, Debug)]
pub struct AttachRequest {
    /// The container's `net/` run directory (pins and the attach record).
    pub dir: PathBuf,
    pub id: String,
    /// What the other containers of the network call this one (its hostname).
    pub name: String,
    pub pinned: Pinned,
    pub egress: Egress,
    pub ports: Vec<PortSpec>,
    /// The `runner` binary (the resolver is `runner resolver`).
    pub exe: PathBuf,
    pub net: Net,
}

/// What `detach` (and gc, and a PATCH) needs, written before CNI ADD and completed after.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Record {
    container_id: String,
    netns: PathBuf,
    #[serde(default = "Net::default_net")]
    network: Net,
    plugins: Vec<serde_json::Value>,
    #[serde(default)]
    result: Option<serde_json::Value>,
    /// The CIDR entries whose elements are in the wall (as written: `10.0.0.0/8:443`).
    #[serde(default)]
    cidrs: Vec<String>,
    #[serde(default)]
    domains: Vec<EgressDomain>,
    #[serde(default)]
    upstream: Vec<std::net::SocketAddr>,
    #[serde(default)]
    name: String,
}

impl Record {
    fn ip(&self) -> Option<Ipv4Addr> {
        self.result.as_ref().and_then(cni::result_ip)
    }

    fn cidr_rules(&self) -> Vec<EgressRule> {
        self.cidrs.iter().filter_map(|c| EgressRule::parse(c).ok()).collect()
    }

    fn read(dir: &Path) -> Option<Record> {
        Self::load(dir).ok().flatten()
    }

    /// `read`, telling a record that is there but could not be read (no descriptor left, at
    /// the open-files limit) from none: a detach must then fail, to be tried again, not
    /// skip the CNI DEL.
    fn load(dir: &Path) -> io::Result<Option<Record>> {
        match std::fs::read(dir.join(CNI_CACHE)) {
            Ok(bytes) => Ok(serde_json::from_slice(&bytes).ok()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn write(&self, dir: &Path) -> Result<(), NetError> {
        let tmp = dir.join(format!("{CNI_CACHE}.tmp"));
        let text = serde_json::to_vec(self).map_err(|e| io_err("encoding the attach record")(io::Error::other(e)))?;
        std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, dir.join(CNI_CACHE)))
            .map_err(io_err("writing the attach record"))
    }
}

/// The network layer of this host: its paths and the three things it drives.
#[derive(Clone)]
pub struct Host {
    pub paths: NetPaths,
    firewall: Arc<dyn Firewall>,
    cni: Arc<dyn cni::Cni>,
    resolver: Arc<dyn Control>,
}

impl Host {
    /// The real thing: nftables, the CNI plugins on disk, the host's resolver.
    pub fn new(paths: NetPaths) -> Host {
        Host {
            firewall: Arc::new(firewall::nft::Nft),
            cni: Arc::new(cni::Plugins {
                path: paths.cni_path.clone(),
                sys_class_net: paths.sys_class_net.clone(),
            }),
            resolver: Arc::new(resolver::control::Client::new(&paths)),
            paths,
        }
    }

    /// With other parts (tests: the fakes).
    pub fn with(
        paths: NetPaths,
        firewall: Arc<dyn Firewall>,
        cni: Arc<dyn cni::Cni>,
        resolver: Arc<dyn Control>,
    ) -> Host {
        Host {
            paths,
            firewall,
            cni,
            resolver,
        }
    }

    /// A network's directory: its name files and its registration.
    pub fn net_dir(&self, net: &Net) -> PathBuf {
        self.paths.dir.join(&net.name)
    }

    /// Its hosts and resolv.conf files (what `attach` keeps up to date).
    pub fn files(&self, net: &Net) -> (PathBuf, PathBuf) {
        let dir = self.net_dir(net);
        (dir.join("hosts"), dir.join("resolv.conf"))
    }

    fn lock(&self) -> Result<nix::fcntl::Flock<std::fs::File>, NetError> {
        let path = self.paths.lock_file();
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(io_err(format!("creating {}", parent.display())))?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io_err(format!("opening {}", path.display())))?;
        nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| io_err(format!("locking {}", path.display()))(e.into()))
    }

    /// Attach a container (its namespaces pinned already) to its network: CNI ADD of every
    /// plugin, the wall and the resolver in place, its CIDR entries in the wall's sets, its
    /// policy with the resolver, its name in the network's hosts file. On a failure before the
    /// record is complete, what was added is deleted again.
    pub fn attach(&self, req: &AttachRequest) -> Result<Attached, NetError> {
        let t0 = std::time::Instant::now();
        let ms = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1e3;
        let _lock = self.lock()?;
        let unregistered = self.vet(&req.net)?;
        let published = ports::pick(&self.paths.ports_file(), &req.ports)?;
        let list = cni::plugins(&published);
        let mut record = Record {
            container_id: req.id.clone(),
            netns: req.pinned.netns.clone(),
            network: req.net.clone(),
            plugins: list.clone(),
            result: None,
            cidrs: Vec::new(),
            domains: Vec::new(),
            upstream: req.egress.upstream.clone(),
            name: req.name.clone(),
        };
        // The record names what detach needs before anything is made: a crash midway is
        // undone by gc.
        record.write(&req.dir)?;
        let ipam_dir = self.paths.ipam_dir.join(&req.net.name);
        let ports_file = self.paths.ports_file();
        let undo = |e: NetError| {
            let _ = ipam::release(&ipam_dir, &req.id);
            let _ = ports::release(&ports_file, &req.id);
            let _ = std::fs::remove_file(req.dir.join(CNI_CACHE));
            e
        };
        // Recorded after the record (which detach finds the id in) and under the lock: a port
        // is never handed out twice, and never stays taken by a container that is gone.
        ports::record(&ports_file, &req.id, &published).map_err(undo)?;
        let (_, prefix) = req.net.cidr();
        let ip = ipam::lease(&ipam_dir, req.net.cidr(), req.net.gateway, &req.id, IFNAME).map_err(undo)?;
        let host_if = veth_name(&req.id);
        let link = cni::Link {
            bridge: &req.net.bridge,
            gateway: req.net.gateway,
            prefix,
            host_if: &host_if,
            netns: &req.pinned.netns,
            ip,
        };
        self.cni.link(&link).map_err(undo)?;
        tracing::debug!(ms = ms(t0), "linked");
        let call = |command, plugin: &serde_json::Value, prev: Option<&serde_json::Value>| {
            self.cni.invoke(&cni::Call {
                command,
                plugin,
                container: &req.id,
                network: &req.net.name,
                netns: &req.pinned.netns,
                prev,
            })
        };
        let mut prev = cni::result(&link);
        for (i, plugin) in list.iter().enumerate() {
            match call("ADD", plugin, Some(&prev)) {
                Ok(result) => prev = result,
                Err(e) => {
                    for done in list[..=i].iter().rev() {
                        let _ = call("DEL", done, Some(&prev));
                    }
                    return Err(undo(e));
                }
            }
        }
        tracing::debug!(ms = ms(t0), "CNI ADD");
        record.result = Some(cni::result(&link));
        record.cidrs = plan::normalize(&req.egress.cidrs)
            .iter()
            .map(ToString::to_string)
            .collect();
        record.domains = req.egress.domains.clone();
        // Complete before the wall has its elements: from here detach undoes all of it.
        record.write(&req.dir)?;
        // The resolver's policy first (file, then the running resolver), so a resolver about
        // to exit for want of containers sees it (it decides under this lock).
        let policy = self.policy(&record, ip);
        resolver::write_policy(&self.paths, &policy)?;
        let (port, started) = self.resolver.ensure(&req.exe)?;
        let made = self.ensure_wall(Some(port))?;
        if unregistered {
            self.register(&req.net)?;
        }
        // One transaction: the resolver's redirect when it is new (and the wall is not), and
        // this container's CIDR elements.
        let mut changes = Vec::new();
        if started && !made {
            changes.extend(plan::resolver(port));
        }
        changes.extend(plan::cidrs(ip, &req.egress.cidrs, true));
        if !changes.is_empty() {
            self.firewall.apply("a container's egress", &plan::batch(changes))?;
        }
        tracing::debug!(ms = ms(t0), "wall");
        if !published.is_empty() {
            self.firewall
                .apply_in(&req.pinned.netns, IFNAME, &plan::loopback_redirect(IFNAME, &published))?;
        }
        self.resolver.attach(&policy)?;
        names::update(
            &self.net_dir(&req.net),
            req.net.gateway,
            &self.paths.host_resolv_conf,
            &req.id,
            Some((ip, &req.name)),
        )?;
        tracing::debug!(ms = ms(t0), "attached");
        Ok(Attached {
            ip: ip.to_string(),
            ports: published,
        })
    }

    fn policy(&self, record: &Record, ip: Ipv4Addr) -> Policy {
        Policy {
            id: record.container_id.clone(),
            ip,
            name: if names::valid_name(&record.name) {
                record.name.clone()
            } else {
                String::new()
            },
            network: record.network.name.clone(),
            domains: record.domains.clone(),
            upstream: record.upstream.clone(),
        }
    }

    /// Undo `attach` and the pins for the run directory `dir` (a container's `net/`): its
    /// elements, its policy, its name, CNI DEL with the cached result (in reverse order), its
    /// ports, then the pins. Nothing there is success; every step is tried even when one
    /// fails, and the first error is returned.
    pub fn detach(&self, dir: &Path) -> Result<(), NetError> {
        let mut first: Option<NetError> = None;
        let record = Record::load(dir).map_err(io_err(format!("reading the attach record in {}", dir.display())))?;
        if let Some(record) = record {
            match self.lock() {
                Ok(_lock) => {
                    let t0 = std::time::Instant::now();
                    if let Err(e) = self.forget(&record) {
                        first.get_or_insert(e);
                    }
                    for plugin in record.plugins.iter().rev() {
                        let called = self.cni.invoke(&cni::Call {
                            command: "DEL",
                            plugin: &cni::del_form(plugin),
                            container: &record.container_id,
                            network: &record.network.name,
                            netns: &record.netns,
                            prev: record.result.as_ref(),
                        });
                        if let Err(e) = called {
                            first.get_or_insert(e);
                        }
                    }
                    // The address last: the veth that had it goes with the namespace (unpinned
                    // below), and addresses are handed out in turn, so it is not given again soon.
                    if let Err(e) = ipam::release(&self.paths.ipam_dir.join(&record.network.name), &record.container_id)
                    {
                        first.get_or_insert(e);
                    }
                    tracing::debug!(ms = t0.elapsed().as_secs_f64() * 1e3, "detached");
                    // After portmap's DEL: the port is free for others only once nothing maps it.
                    if first.is_none()
                        && let Err(e) = ports::release(&self.paths.ports_file(), &record.container_id)
                    {
                        first.get_or_insert(e);
                    }
                }
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
            if first.is_none() {
                let _ = std::fs::remove_file(dir.join(CNI_CACHE));
            }
        }
        if let Err(e) = unpin(dir) {
            first.get_or_insert(NetError::Io {
                what: format!("unpinning the namespaces in {}", dir.display()),
                source: e,
            });
        }
        first.map_or(Ok(()), Err)
    }

    /// A container's elements, policy and name, gone (under the lock).
    fn forget(&self, record: &Record) -> Result<(), NetError> {
        let mut first = None;
        if let Some(ip) = record.ip() {
            if let Err(e) = self.remove_cidrs(ip, &record.cidr_rules()) {
                first.get_or_insert(e);
            }
            if let Err(e) = resolver::remove_policy(&self.paths, ip) {
                first.get_or_insert(e.into());
            }
            // The resolver removes the domain elements it added; without a resolver, they
            // are read back and removed here.
            let told = self.resolver.detach(ip, &record.container_id);
            if !matches!(told, Ok(true))
                && let Err(e) = self.remove_domain_elements(ip)
            {
                first.get_or_insert(e);
            }
            if let Err(e) = told {
                tracing::warn!(error = %e, "the resolver did not take the detach");
            }
        }
        if let Err(e) = names::update(
            &self.net_dir(&record.network),
            record.network.gateway,
            &self.paths.host_resolv_conf,
            &record.container_id,
            None,
        ) {
            first.get_or_insert(e);
        }
        first.map_or(Ok(()), Err)
    }

    /// Delete container `ip`'s CIDR elements: those it was given, or (when the wall changed
    /// since) those the wall has, read back.
    fn remove_cidrs(&self, ip: Ipv4Addr, rules: &[EgressRule]) -> Result<(), NetError> {
        if rules.is_empty() || !self.firewall.wall_exists()? {
            return Ok(());
        }
        match self.firewall.apply(
            "removing a container's egress",
            &plan::batch(plan::cidrs(ip, rules, false)),
        ) {
            Err(e) if e.is_missing() => self.remove_owned(ip, &[plan::ALLOW_NET, plan::ALLOW_PORT]),
            other => other.map_err(NetError::from),
        }
    }

    fn remove_domain_elements(&self, ip: Ipv4Addr) -> Result<(), NetError> {
        if !self.firewall.wall_exists()? {
            return Ok(());
        }
        self.remove_owned(ip, &[plan::DOM, plan::DOM_PORT])
    }

    /// Delete every element of `sets` that belongs to container `ip`, as the wall has them.
    fn remove_owned(&self, ip: Ipv4Addr, sets: &[&str]) -> Result<(), NetError> {
        let mut changes = Vec::new();
        for set in sets {
            let owned = self
                .firewall
                .elements(set)?
                .iter()
                .filter(|e| plan::element_owner(e) == Some(ip))
                .map(plan::element_key)
                .collect();
            changes.extend(plan::delete_elements(set, owned));
        }
        if changes.is_empty() {
            return Ok(());
        }
        Ok(self
            .firewall
            .apply("removing a container's elements", &plan::batch(changes))?)
    }

    /// Replace a live container's egress: its CIDR elements in one transaction (the old ones
    /// deleted, the new ones added), then its domains with the resolver (which drops, in one
    /// batch, the addresses no domain allows any more). The wall matches per packet, so what
    /// is no longer allowed stops at its next packet, established connections included.
    pub fn set_egress(&self, dir: &Path, egress: &Egress) -> Result<(), NetError> {
        let mut record = Record::read(dir).ok_or_else(|| NetError::NotAttached(dir.display().to_string()))?;
        let ip = record
            .ip()
            .ok_or_else(|| NetError::NotAttached(record.container_id.clone()))?;
        let _lock = self.lock()?;
        let old = record.cidr_rules();
        let new = plan::normalize(&egress.cidrs);
        let mut changes = Vec::new();
        let kept: Vec<EgressRule> = old.iter().filter(|r| new.contains(r)).copied().collect();
        changes.extend(plan::cidrs(
            ip,
            &old.iter().filter(|r| !kept.contains(r)).copied().collect::<Vec<_>>(),
            false,
        ));
        changes.extend(plan::cidrs(
            ip,
            &new.iter().filter(|r| !kept.contains(r)).copied().collect::<Vec<_>>(),
            true,
        ));
        if !changes.is_empty() {
            match self.firewall.apply("a container's new egress", &plan::batch(changes)) {
                Err(e) if e.is_missing() => {
                    // The wall lost them (made again since): what it has goes, then the new.
                    self.remove_owned(ip, &[plan::ALLOW_NET, plan::ALLOW_PORT])?;
                    self.firewall
                        .apply("a container's new egress", &plan::batch(plan::cidrs(ip, &new, true)))?;
                }
                other => other?,
            }
        }
        record.cidrs = new.iter().map(ToString::to_string).collect();
        record.domains = egress.domains.clone();
        record.write(dir)?;
        let policy = self.policy(&record, ip);
        resolver::write_policy(&self.paths, &policy)?;
        if !self.resolver.patch(&policy)? {
            // No resolver runs: nothing answers names, so only the elements left behind matter.
            self.remove_domain_elements(ip)?;
        }
        Ok(())
    }

    /// Take down every network no container is on (no interface on its bridge, no address
    /// leased), and, with none left, the resolver and the wall. What `runner gc` does;
    /// whether there was anything to take down.
    pub fn remove_if_unused(&self) -> Result<bool, NetError> {
        let _lock = self.lock()?;
        let mut nets = self.registered();
        // A default network made before networks were registered.
        if !nets.iter().any(|n| n.name == NETWORK_NAME) && self.paths.sys_class_net.join(BRIDGE).exists() {
            nets.push(Net::default_net());
        }
        let mut any = false;
        let mut left = 0;
        for net in nets {
            if self.in_use(&net) {
                left += 1;
                continue;
            }
            self.unregister(&net)?;
            any = true;
        }
        if left > 0 || resolver::any_policy(&self.paths) || ports::any(&self.paths.ports_file()) {
            return Ok(any);
        }
        any |= self.resolver.stop()?;
        if self.firewall.wall_exists()? {
            self.firewall.apply(
                "taking the wall down",
                &plan::batch(vec![
                    nftables::schema::NfObject::CmdObject(nftables::schema::NfCmd::Add(
                        nftables::schema::NfListObject::Table(wall_table()),
                    )),
                    nftables::schema::NfObject::CmdObject(nftables::schema::NfCmd::Delete(
                        nftables::schema::NfListObject::Table(wall_table()),
                    )),
                ]),
            )?;
            any = true;
        }
        let _ = std::fs::remove_file(self.paths.ports_file());
        Ok(any)
    }
}

/// The host's end of a container's veth pair: `veth` and 8 hex digits (at most 15 characters),
/// from the container's id and the time (a veth left by a namespace not yet destroyed never
/// clashes with the next one of the same id).
fn veth_name(id: &str) -> String {
    use sha2::Digest;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let h = sha2::Sha256::digest(format!("{id}/{nanos}").as_bytes());
    format!("veth{}", hex::encode(&h[..4]))
}

fn wall_table() -> nftables::schema::Table<'static> {
    nftables::schema::Table {
        family: nftables::types::NfFamily::INet,
        name: plan::TABLE.into(),
        handle: None,
    }
}

#[cfg(test)]
mod tests;
