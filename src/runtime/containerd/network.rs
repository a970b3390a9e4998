//! `network: bridge`: a network namespace runner makes and pins itself, attached to a Linux
//! bridge by the CNI plugins (Debian's containernetworking-plugins), and walled in with
//! nftables.
//!
//! The namespaces. A container in a user namespace can mount `sysfs` only in a network
//! namespace its own user namespace owns (runc 1.1 mounts sysfs and has no fallback), so a
//! netns made in the host's user namespace (`ip netns add`) makes runc fail with EPERM. For a
//! container with a range, runner therefore makes the user namespace itself (the range's
//! maps), makes the network namespace inside it, pins both (bind mounts of their nsfs files
//! beside the container's rootfs), and names both by path in the spec; runc joins them
//! instead of making its own. With `hostUsers: true` only the netns is made.
//!
//! The plugins run per the CNI spec (0.4.0/1.0.0 as the installed 1.1 plugins speak it):
//! `CNI_COMMAND`, `CNI_CONTAINERID`, `CNI_NETNS`, `CNI_IFNAME`, `CNI_PATH` in the environment,
//! the plugin's config on stdin with `name`, `cniVersion` and the previous plugin's result
//! (`prevResult`); ADD in list order, DEL in reverse with the cached ADD result. The result is
//! cached in the run directory before anything else can fail, so every teardown path (and
//! `runner gc`) can DEL. All invocations on a host hold one lock: the bridge and firewall
//! plugins edit shared host state (the bridge, iptables chains).
//!
//! The wall (`nft` table `inet runner`): traffic from the bridge to anywhere but the
//! bridge's own network is dropped (forward hook), and so is traffic from it to the host
//! itself (input hook) unless it answers a connection the host opened. A container's
//! `egress.allow` entries become accept rules for its address ahead of the drops (tagged with
//! its id, removed before its address is released); what they let out is masqueraded.

use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{Value, json};

use super::dns;
use crate::manifest::{EgressDomain, EgressRule, PortSpec, Protocol};
use crate::runtime::PortStatus;
use crate::spec::IdRange;

/// Where the pins and the cached CNI result live, inside a container's rootfs directory
/// (`/run/runner/rootfs/<containerd>/<id>/net`: out of the state dir, which may be removed
/// while the container runs).
pub const NET_DIR: &str = "net";
const USERNS_PIN: &str = "userns";
const NETNS_PIN: &str = "netns";
const CNI_CACHE: &str = "cni.json";
/// The interface the container sees.
const IFNAME: &str = "eth0";
/// runner's default network, the one every `network: bridge` container joins.
pub const BRIDGE: &str = "runner0";
pub const SUBNET: &str = "10.89.0.0/16";
pub const GATEWAY: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 89, 0, 1);
const NETWORK_NAME: &str = "runner";
/// Host-wide network state: per network its names and its registration, the resolver's
/// policies, the published ports.
const NET_STATE: &str = "/run/runner/net";
/// In a network's directory: what it was registered with.
const NET_MARKER: &str = "network.json";

/// One bridge network: runner's default (`network: bridge`) or a Network document's.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Net {
    /// The CNI network name (IPAM's directory): `runner`, or `runner-<Network name>`.
    pub name: String,
    pub bridge: String,
    /// `a.b.c.d/n`.
    pub subnet: String,
    pub gateway: std::net::Ipv4Addr,
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

    /// Its `/etc/hosts` and `/etc/resolv.conf` (bind-mounted read-only into its containers)
    /// and its registration.
    fn dir(&self) -> PathBuf {
        Path::new(NET_STATE).join(&self.name)
    }

    /// Its hosts and resolv.conf files (what `attach` keeps up to date).
    pub fn files(&self) -> (PathBuf, PathBuf) {
        (self.dir().join("hosts"), self.dir().join("resolv.conf"))
    }

    fn range(&self) -> Option<(u32, u32)> {
        let (addr, prefix) = self.subnet.split_once('/')?;
        let start = u32::from(addr.parse::<std::net::Ipv4Addr>().ok()?);
        let prefix: u32 = prefix.parse().ok()?;
        Some((start, start | (u32::MAX.checked_shr(prefix).unwrap_or(0))))
    }

    fn overlaps(&self, other: &Net) -> bool {
        match (self.range(), other.range()) {
            (Some(a), Some(b)) => a.0 <= b.1 && b.0 <= a.1,
            _ => false,
        }
    }
}
const CNI_VERSION: &str = "1.0.0";
/// Where Debian (and most distributions) install the CNI plugins.
const DEFAULT_CNI_PATH: &str = "/usr/lib/cni:/opt/cni/bin";
/// Host-wide: every runner on the host shares the bridge, its IPAM and its firewall.
pub const LOCK_FILE: &str = "/run/runner/cni.lock";
const NFT_TABLE: &str = "runner";
/// Where host-local keeps its leases (CNI's default data directory), per network name.
const IPAM_DIR: &str = "/var/lib/cni/networks";
/// Marks the wall's newest rule (a published port's connections, DNATed by portmap, pass).
const WALL_VERSION: &str = "runner wall 5";
/// Tags the two iptables rules that let the network's traffic through FORWARD.
const IPT_COMMENT: &str = "runner bridge network";

/// What a container may reach off its network.
#[derive(Clone, Debug, Default)]
pub struct Egress {
    pub cidrs: Vec<EgressRule>,
    /// Enforced by runner's resolver (see `dns`).
    pub domains: Vec<EgressDomain>,
    /// Where the resolver asks for them (empty: the host's resolvers).
    pub upstream: Vec<std::net::SocketAddr>,
}

#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
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
    #[error("nftables: {0}")]
    Nft(String),
    #[error("publishing ports: {0}")]
    Ports(String),
    #[error("runner's resolver: {0}")]
    Resolver(String),
    #[error("{0}")]
    Conflict(String),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> NetworkError {
    let what = what.into();
    move |source| NetworkError::Io { what, source }
}

/// The namespaces a container joins, by path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pinned {
    pub userns: Option<PathBuf>,
    pub netns: PathBuf,
}

/// What a container got on the network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attached {
    /// Its address on the bridge (`10.89.0.7`).
    pub ip: String,
    /// Its published ports, each with the host port it got.
    pub ports: Vec<PortStatus>,
}

/// Where `pin_namespaces` pins the namespaces (known before they are made).
pub fn pin_paths(dir: &Path, range: Option<IdRange>) -> Pinned {
    Pinned {
        userns: range.map(|_| dir.join(USERNS_PIN)),
        netns: dir.join(NETNS_PIN),
    }
}

/// Make and pin the namespaces in `dir` (created): a user namespace with `range`'s maps and
/// a network namespace it owns, or (no range) a network namespace of the host's user
/// namespace.
pub fn pin_namespaces(dir: &Path, range: Option<IdRange>) -> Result<Pinned, NetworkError> {
    std::fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
    let (to_parent_r, to_parent_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| io_err("a pipe")(e.into()))?;
    let (to_child_r, to_child_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| io_err("a pipe")(e.into()))?;
    let with_user = range.is_some();
    // SAFETY: the child makes raw system calls only and never returns: a forked child of a
    // threaded process must not take a lock or allocate (another thread may have held the
    // lock at the fork, and nothing in the child would ever release it).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io_err("forking the namespace helper")(io::Error::last_os_error()));
    }
    if pid == 0 {
        unsafe {
            let mut ok: u8 = 1;
            if with_user {
                ok = u8::from(libc::unshare(libc::CLONE_NEWUSER) == 0);
                libc::write(to_parent_w.as_raw_fd(), (&ok as *const u8).cast(), 1);
                // Wait for the maps: a netns made before them would belong to a user
                // namespace whose root is nobody.
                let mut b = 0u8;
                libc::read(to_child_r.as_raw_fd(), (&mut b as *mut u8).cast(), 1);
            }
            if ok == 1 {
                ok = u8::from(libc::unshare(libc::CLONE_NEWNET) == 0 && loopback_up() && ping_allowed(with_user));
            }
            libc::write(to_parent_w.as_raw_fd(), (&ok as *const u8).cast(), 1);
            loop {
                libc::pause();
            }
        }
    }
    drop(to_parent_w);
    drop(to_child_r);
    let helper = nix::unistd::Pid::from_raw(pid);
    let made = (|| {
        let step = |what: &str| -> Result<(), NetworkError> {
            let mut b = [0u8; 1];
            match nix::unistd::read(&to_parent_r, &mut b) {
                Ok(1) if b[0] == 1 => Ok(()),
                _ => Err(io_err(format!(
                    "the namespace helper could not make the {what} namespace"
                ))(io::Error::other("unshare failed"))),
            }
        };
        let mut userns = None;
        if let Some(range) = range {
            step("user")?;
            let map = format!("0 {} {}\n", range.host_base, IdRange::SIZE);
            std::fs::write(format!("/proc/{pid}/uid_map"), &map).map_err(io_err("writing uid_map"))?;
            std::fs::write(format!("/proc/{pid}/gid_map"), &map).map_err(io_err("writing gid_map"))?;
            nix::unistd::write(&to_child_w, &[1u8]).map_err(|e| io_err("the namespace helper")(e.into()))?;
            let pin = dir.join(USERNS_PIN);
            bind_ns(&format!("/proc/{pid}/ns/user"), &pin)?;
            userns = Some(pin);
        }
        step("network")?;
        let netns = dir.join(NETNS_PIN);
        bind_ns(&format!("/proc/{pid}/ns/net"), &netns)?;
        Ok(Pinned { userns, netns })
    })();
    let _ = nix::sys::signal::kill(helper, nix::sys::signal::Signal::SIGKILL);
    let _ = nix::sys::wait::waitpid(helper, None);
    if made.is_err() {
        let _ = unpin(dir);
    }
    made
}

/// Let every group of the container use ICMP echo sockets (`ping` without NET_RAW, which
/// the hardened spec drops), as Docker does: `net.ipv4.ping_group_range` of the new netns.
/// The ids are the writer's user namespace's: the range's 65536 inside one, else all.
/// Raw system calls only (see `loopback_up`).
unsafe fn ping_allowed(in_userns: bool) -> bool {
    unsafe {
        let path = c"/proc/sys/net/ipv4/ping_group_range";
        let value: &[u8] = if in_userns { b"0 65535" } else { b"0 2147483647" };
        let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return false;
        }
        let ok = libc::write(fd, value.as_ptr().cast(), value.len()) == value.len() as isize;
        libc::close(fd);
        ok
    }
}

/// Bring up `lo` in the calling thread's network namespace (runc does it only for the
/// namespaces it makes itself; without it nothing in the container can use 127.0.0.1).
/// Raw system calls only: it runs in the namespace helper, a child of a threaded process.
unsafe fn loopback_up() -> bool {
    unsafe {
        let sock = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if sock < 0 {
            return false;
        }
        let mut req: libc::ifreq = std::mem::zeroed();
        for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
            *dst = *src as libc::c_char;
        }
        let mut ok = libc::ioctl(sock, libc::SIOCGIFFLAGS, &mut req) == 0;
        if ok {
            req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            ok = libc::ioctl(sock, libc::SIOCSIFFLAGS, &req) == 0;
        }
        libc::close(sock);
        ok
    }
}

/// Pin a namespace: bind its nsfs file onto an empty file.
fn bind_ns(source: &str, target: &Path) -> Result<(), NetworkError> {
    std::fs::File::create(target).map_err(io_err(format!("creating {}", target.display())))?;
    nix::mount::mount(
        Some(source),
        target,
        None::<&str>,
        nix::mount::MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(|e| io_err(format!("pinning {source} at {}", target.display()))(e.into()))
}

/// Unpin the namespaces of `dir` (the namespaces end with their last user).
pub fn unpin(dir: &Path) -> io::Result<()> {
    for name in [NETNS_PIN, USERNS_PIN] {
        let pin = dir.join(name);
        if pin.exists() {
            match nix::mount::umount2(&pin, nix::mount::MntFlags::MNT_DETACH) {
                Ok(()) | Err(nix::errno::Errno::EINVAL) => {}
                Err(e) => return Err(e.into()),
            }
            std::fs::remove_file(&pin)?;
        }
    }
    Ok(())
}

/// The network's plugin list (a CNI conflist's `plugins`) for a container publishing `ports`
/// (their host ports picked already).
fn plugins(net: &Net, ports: &[PortStatus]) -> Vec<Value> {
    let mut list = vec![json!({
        "type": "bridge",
        "bridge": net.bridge,
        "isGateway": true,
        // No NAT: nothing leaves the network (see the nft wall).
        "ipMasq": false,
        "hairpinMode": true,
        "ipam": {
            "type": "host-local",
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
    // policy) accepts the whole subnet once, with the wall (see `ensure_iptables`), instead
    // of a pair of rules added and deleted per container (~45 ms of every run).
    list
}

fn cni_path() -> String {
    std::env::var("RUNNER_CNI_PATH").unwrap_or_else(|_| DEFAULT_CNI_PATH.to_string())
}

fn find_plugin(name: &str) -> Result<PathBuf, NetworkError> {
    for dir in cni_path().split(':') {
        let p = Path::new(dir).join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(NetworkError::Plugin {
        plugin: name.into(),
        command: "find",
        message: format!(
            "not found in {} (install containernetworking-plugins, or set RUNNER_CNI_PATH)",
            cni_path()
        ),
    })
}

/// Run one plugin; its parsed stdout.
fn invoke(
    command: &'static str,
    plugin: &Value,
    (container, network): (&str, &str),
    netns: &Path,
    prev: Option<&Value>,
) -> Result<Value, NetworkError> {
    let kind = plugin["type"].as_str().unwrap_or_default().to_string();
    let binary = find_plugin(&kind)?;
    let mut config = plugin.clone();
    config["name"] = json!(network);
    config["cniVersion"] = json!(CNI_VERSION);
    if let Some(prev) = prev {
        config["prevResult"] = prev.clone();
    }
    let mut child = Command::new(&binary)
        .env_clear()
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", container)
        .env("CNI_NETNS", netns)
        .env("CNI_IFNAME", IFNAME)
        .env("CNI_PATH", cni_path())
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(io_err(format!("running {}", binary.display())))?;
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(config.to_string().as_bytes())
        .map_err(io_err(format!("writing to {}", binary.display())))?;
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
        return Err(NetworkError::Plugin {
            plugin: kind,
            command,
            message,
        });
    }
    if out.stdout.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Null);
    }
    serde_json::from_slice(&out.stdout).map_err(|e| NetworkError::Plugin {
        plugin: kind,
        command,
        message: format!("unreadable result: {e}"),
    })
}

/// The host-wide lock every plugin invocation holds (released when the guard drops).
fn lock() -> Result<nix::fcntl::Flock<std::fs::File>, NetworkError> {
    let path = Path::new(LOCK_FILE);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io_err(format!("creating {}", parent.display())))?;
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(io_err(format!("opening {LOCK_FILE}")))?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| io_err(format!("locking {LOCK_FILE}"))(e.into()))
}

/// Attach container `id` (its pinned namespaces in `dir`) to the bridge network: CNI ADD of
/// every plugin, the wall in place. On failure what was added is deleted again.
/// `name`: what the other containers of the network call this one (its hostname).
#[allow(clippy::too_many_arguments)]
pub fn attach(
    dir: &Path,
    id: &str,
    name: &str,
    pinned: Pinned,
    egress: &Egress,
    ports: &[PortSpec],
    exe: &Path,
    net: &Net,
) -> Result<Attached, NetworkError> {
    let t0 = std::time::Instant::now();
    let ms = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1e3;
    let _lock = lock()?;
    // Nothing below needs the wall until the container starts, after this returns.
    let check = start_wall_check();
    let unregistered = vet(net)?;
    let has_rules = !egress.cidrs.is_empty() || !egress.domains.is_empty();
    let published = pick_ports(ports)?;
    let list = plugins(net, &published);
    let who = (id, net.name.as_str());
    // The cache names what DEL needs before ADD runs: a crash mid-ADD is undone by gc.
    write_cache(dir, id, &pinned.netns, net, &list, has_rules, None)?;
    // Recorded after the cache (which detach finds the id in) and under the lock: a port
    // is never handed out twice, and never stays taken by a container that is gone.
    if let Err(e) = record_ports(id, &published) {
        let _ = std::fs::remove_file(dir.join(CNI_CACHE));
        return Err(e);
    }
    let mut prev: Option<Value> = None;
    for (i, plugin) in list.iter().enumerate() {
        match invoke("ADD", plugin, who, &pinned.netns, prev.as_ref()) {
            Ok(result) => prev = Some(result),
            Err(e) => {
                for done in list[..i].iter().rev() {
                    let _ = invoke("DEL", done, who, &pinned.netns, prev.as_ref());
                }
                let _ = invoke("DEL", plugin, who, &pinned.netns, prev.as_ref());
                let _ = std::fs::remove_file(dir.join(CNI_CACHE));
                let _ = release_ports(id);
                return Err(e);
            }
        }
    }
    let result = prev.unwrap_or(Value::Null);
    tracing::debug!(ms = ms(t0), "CNI ADD");
    let wall_made = ensure_wall(check)?;
    if unregistered {
        register(net)?;
    }
    tracing::debug!(ms = ms(t0), "wall");
    write_cache(dir, id, &pinned.netns, net, &list, has_rules, Some(&result))?;
    if !published.is_empty() {
        loopback_redirect(&pinned.netns, &published)?;
    }
    let ip = result["ips"][0]["address"]
        .as_str()
        .and_then(|a| a.split('/').next())
        .unwrap_or_default()
        .to_string();
    let Ok(addr) = ip.parse::<std::net::Ipv4Addr>() else {
        return Err(NetworkError::Plugin {
            plugin: "bridge".into(),
            command: "ADD",
            message: format!("no IPv4 address in its result ({ip:?})"),
        });
    };
    // The resolver's policy first: from here detach (which finds it by address) removes it,
    // and a resolver about to exit for want of containers sees it.
    let (set, port_set) = set_names(id);
    let policy = dns::Policy {
        id: id.to_string(),
        ip: addr,
        domains: egress.domains.clone(),
        upstream: egress.upstream.clone(),
        set: set.clone(),
        port_set: port_set.clone(),
        hosts_file: net.dir().join("hosts"),
    };
    write_policy(&policy)?;
    let (resolver_port, started) = ensure_resolver(exe)?;
    tracing::debug!(ms = ms(t0), "resolver");
    // At most one nft transaction: the redirect to the resolver's port when the wall or the
    // resolver is new (they are made and changed only here, under the lock), and this
    // container's accept rules (tagged with its id; detach removes them before its address
    // can go to anyone else) and its sets for the addresses its domains resolve to.
    let mut script = String::new();
    if wall_made || started {
        script = format!(
            "flush chain inet {NFT_TABLE} dns
add rule inet {NFT_TABLE} dns iifname @bridges ip daddr @gateways udp dport 53 redirect to :{resolver_port}
add rule inet {NFT_TABLE} dns iifname @bridges ip daddr @gateways tcp dport 53 redirect to :{resolver_port}
flush set inet {NFT_TABLE} resolver
add element inet {NFT_TABLE} resolver {{ {resolver_port} }}
"
        );
    }
    let tag = rule_tag(id);
    let bridge = &net.bridge;
    for rule in &egress.cidrs {
        let port = rule
            .port
            .map_or(String::new(), |p| format!(" meta l4proto {{ tcp, udp }} th dport {p}"));
        for chain in ["forward", "input"] {
            script.push_str(&format!(
                "insert rule inet {NFT_TABLE} {chain} iifname \"{bridge}\" ip saddr {ip} ip daddr {}/{}{port} accept comment \"{tag}\"\n",
                rule.addr, rule.prefix,
            ));
        }
    }
    if !egress.domains.is_empty() {
        // Forward only: the resolver never lets a host address into a set, so the input
        // hook has nothing to accept.
        script.push_str(&format!(
            "add set inet {NFT_TABLE} {set} {{ type ipv4_addr; flags timeout; }}
add set inet {NFT_TABLE} {port_set} {{ type ipv4_addr . inet_service; flags timeout; }}
insert rule inet {NFT_TABLE} forward iifname \"{bridge}\" ip saddr {ip} ip daddr @{set} accept comment \"{tag}\"
insert rule inet {NFT_TABLE} forward iifname \"{bridge}\" ip saddr {ip} meta l4proto {{ tcp, udp }} ip daddr . th dport @{port_set} accept comment \"{tag}\"
"
        ));
    }
    if !script.is_empty() {
        nft_script(&script)?;
        tracing::debug!(ms = ms(t0), "nft rules");
    }
    names(net, id, Some((&ip, name)))?;
    Ok(Attached { ip, ports: published })
}

fn write_cache(
    dir: &Path,
    id: &str,
    netns: &Path,
    net: &Net,
    plugins: &[Value],
    rules: bool,
    result: Option<&Value>,
) -> Result<(), NetworkError> {
    // `rules`: whether detach has nft rules and sets of the container's to look for.
    let cache = json!({"containerId": id, "netns": netns, "ifname": IFNAME, "network": net, "plugins": plugins, "rules": rules, "result": result});
    let tmp = dir.join(format!("{CNI_CACHE}.tmp"));
    std::fs::write(&tmp, cache.to_string())
        .and_then(|()| std::fs::rename(&tmp, dir.join(CNI_CACHE)))
        .map_err(io_err("caching the CNI result"))
}

/// Undo `attach` and `pin_namespaces` for the run directory `dir` (a container's `net/`):
/// CNI DEL with the cached result (in reverse order), then the pins. Nothing there is
/// success; every step is tried even when one fails, and the first error is returned.
pub fn detach(dir: &Path) -> Result<(), NetworkError> {
    let cache_file = dir.join(CNI_CACHE);
    let mut first: Option<NetworkError> = None;
    if let Ok(text) = std::fs::read_to_string(&cache_file) {
        let cache: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let id = cache["containerId"].as_str().unwrap_or_default().to_string();
        let netns = PathBuf::from(cache["netns"].as_str().unwrap_or_default());
        let result = cache.get("result").filter(|r| !r.is_null()).cloned();
        let list = cache["plugins"].as_array().cloned().unwrap_or_default();
        // A cache older than named networks was the default network's.
        let net: Net = serde_json::from_value(cache["network"].clone()).unwrap_or_else(|_| Net::default_net());
        let t0 = std::time::Instant::now();
        match lock() {
            Ok(_lock) => {
                // A cache without the field is older than it: look.
                if cache["rules"].as_bool() != Some(false)
                    && let Err(e) = remove_rules(&id)
                {
                    first.get_or_insert(e);
                }
                if let Some(ip) = cached_ip(result.as_ref())
                    && let Err(e) = std::fs::remove_file(dns::policy_path(ip))
                    && e.kind() != io::ErrorKind::NotFound
                {
                    first.get_or_insert(io_err("removing the resolver's policy")(e));
                }
                if let Err(e) = names(&net, &id, None) {
                    first.get_or_insert(e);
                }
                let t1 = std::time::Instant::now();
                for plugin in list.iter().rev() {
                    if let Err(e) = invoke("DEL", &del_form(plugin), (&id, &net.name), &netns, result.as_ref()) {
                        first.get_or_insert(e);
                    }
                }
                tracing::debug!(
                    ms = t0.elapsed().as_secs_f64() * 1e3,
                    del_ms = t1.elapsed().as_secs_f64() * 1e3,
                    "CNI DEL"
                );
                // After portmap's DEL: the port is free for others only once nothing maps it.
                if first.is_none()
                    && let Err(e) = release_ports(&id)
                {
                    first.get_or_insert(e);
                }
            }
            Err(e) => {
                first.get_or_insert(e);
            }
        }
        if first.is_none() {
            let _ = std::fs::remove_file(&cache_file);
        }
    }
    if let Err(e) = unpin(dir) {
        first.get_or_insert(NetworkError::Io {
            what: format!("unpinning the namespaces in {}", dir.display()),
            source: e,
        });
    }
    match first {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The host-wide record of published ports: `<protocol> <hostIP> <hostPort> <container id>`
/// per line (kept under the network lock).
const PORTS_FILE: &str = "/run/runner/net/ports";
/// How many free-port picks may land on a port another container holds before giving up.
const PICK_TRIES: usize = 64;

fn recorded_ports() -> Result<Vec<(Protocol, std::net::Ipv4Addr, u16, String)>, NetworkError> {
    let text = match std::fs::read_to_string(PORTS_FILE) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(io_err(format!("reading {PORTS_FILE}"))(e)),
    };
    Ok(text
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let proto = match w.next()? {
                "tcp" => Protocol::Tcp,
                "udp" => Protocol::Udp,
                _ => return None,
            };
            Some((
                proto,
                w.next()?.parse().ok()?,
                w.next()?.parse().ok()?,
                w.next()?.to_string(),
            ))
        })
        .collect())
}

/// Whether two bindings of one protocol and port collide (a wildcard address takes them all).
fn overlaps(a: std::net::Ipv4Addr, b: std::net::Ipv4Addr) -> bool {
    a == b || a.is_unspecified() || b.is_unspecified()
}

/// Bind the host's `ip:port` for a moment: the port it got (0 asks the kernel for a free
/// one), or why it cannot be had.
fn probe(protocol: Protocol, ip: std::net::Ipv4Addr, port: u16) -> io::Result<u16> {
    let addr = std::net::SocketAddr::from((ip, port));
    match protocol {
        Protocol::Tcp => std::net::TcpListener::bind(addr)?.local_addr().map(|a| a.port()),
        Protocol::Udp => std::net::UdpSocket::bind(addr)?.local_addr().map(|a| a.port()),
    }
}

/// The host port of each published port: the one asked for (refused when another container
/// or a host process has it) or a free one.
fn pick_ports(ports: &[PortSpec]) -> Result<Vec<PortStatus>, NetworkError> {
    let mut taken = recorded_ports()?;
    let mut out = Vec::new();
    for p in ports {
        let held = |taken: &[(Protocol, std::net::Ipv4Addr, u16, String)], port: u16| {
            taken
                .iter()
                .find(|(proto, ip, n, _)| *proto == p.protocol && *n == port && overlaps(*ip, p.host_ip))
                .map(|(_, _, _, id)| id.clone())
        };
        let unavailable = |port: u16, e: io::Error| {
            NetworkError::Ports(match e.kind() {
                io::ErrorKind::AddrNotAvailable => format!("hostIP {} is not an address of this host", p.host_ip),
                io::ErrorKind::AddrInUse => format!(
                    "hostPort {port}/{} on {} is in use by a process of this host",
                    p.protocol.as_str(),
                    p.host_ip
                ),
                _ => format!("binding {}:{port}/{}: {e}", p.host_ip, p.protocol.as_str()),
            })
        };
        let host_port = match p.host_port {
            Some(port) => {
                if let Some(other) = held(&taken, port) {
                    return Err(NetworkError::Ports(format!(
                        "hostPort {port}/{} on {} is published by container {other} already",
                        p.protocol.as_str(),
                        p.host_ip
                    )));
                }
                probe(p.protocol, p.host_ip, port).map_err(|e| unavailable(port, e))?
            }
            None => {
                let mut got = None;
                for _ in 0..PICK_TRIES {
                    let port = probe(p.protocol, p.host_ip, 0).map_err(|e| unavailable(0, e))?;
                    if held(&taken, port).is_none() {
                        got = Some(port);
                        break;
                    }
                }
                got.ok_or_else(|| NetworkError::Ports("no free host port found".into()))?
            }
        };
        // Later entries of this container see the earlier ones as taken.
        taken.push((p.protocol, p.host_ip, host_port, String::new()));
        out.push(PortStatus {
            name: p.name.clone(),
            container_port: p.container_port,
            protocol: p.protocol,
            host_ip: p.host_ip.to_string(),
            host_port,
        });
    }
    Ok(out)
}

fn write_ports(lines: &[(Protocol, std::net::Ipv4Addr, u16, String)]) -> Result<(), NetworkError> {
    let text: String = lines
        .iter()
        .map(|(proto, ip, port, id)| format!("{} {ip} {port} {id}\n", proto.lower()))
        .collect();
    let tmp = format!("{PORTS_FILE}.tmp");
    if let Some(parent) = Path::new(PORTS_FILE).parent() {
        std::fs::create_dir_all(parent).map_err(io_err(format!("creating {}", parent.display())))?;
    }
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, PORTS_FILE))
        .map_err(io_err(format!("writing {PORTS_FILE}")))
}

fn record_ports(id: &str, published: &[PortStatus]) -> Result<(), NetworkError> {
    if published.is_empty() {
        return Ok(());
    }
    let mut lines = recorded_ports()?;
    for p in published {
        let ip = p.host_ip.parse().unwrap_or(std::net::Ipv4Addr::UNSPECIFIED);
        lines.push((p.protocol, ip, p.host_port, id.to_string()));
    }
    write_ports(&lines)
}

/// Forget container `id`'s ports (none is success).
fn release_ports(id: &str) -> Result<(), NetworkError> {
    let lines = recorded_ports()?;
    if !lines.iter().any(|l| l.3 == id) {
        return Ok(());
    }
    let kept: Vec<_> = lines.into_iter().filter(|l| l.3 != id).collect();
    write_ports(&kept)
}

/// Reference 000's runtime rewrites a loopback bind address to 0.0.0.0 so a published port
/// reaches a server told to listen on 127.0.0.1. runner does the same for programs it does
/// not know: inside the container's network namespace, a connection arriving on eth0 for a
/// published port that no socket bound to eth0's address (or to every address) would take is
/// DNATed to 127.0.0.1, with `route_localnet` on eth0 so the kernel accepts it. A server
/// bound to 127.0.0.1, to 0.0.0.0 or to the container's own address all answer.
fn loopback_redirect(netns: &Path, ports: &[PortStatus]) -> Result<(), NetworkError> {
    let mut script = String::from(
        "table ip runner {\n  chain prerouting {\n    type nat hook prerouting priority dstnat; policy accept;\n",
    );
    for p in ports {
        let (proto, port) = (p.protocol.lower(), p.container_port);
        script.push_str(&format!(
            "    iifname \"{IFNAME}\" {proto} dport {port} socket transparent 0 accept\n    iifname \"{IFNAME}\" {proto} dport {port} dnat to 127.0.0.1\n"
        ));
    }
    script.push_str("  }\n}\n");
    let ns = std::fs::File::open(netns).map_err(io_err(format!("opening {}", netns.display())))?;
    let sysctl = std::ffi::CString::new(format!("/proc/sys/net/ipv4/conf/{IFNAME}/route_localnet")).expect("no NUL");
    let mut cmd = Command::new("nft");
    cmd.args(["-f", "-"]);
    let fd = ns.as_raw_fd();
    // SAFETY: between fork and exec the child makes raw system calls only.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(io::Error::last_os_error());
            }
            let f = libc::open(sysctl.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if f < 0 {
                return Err(io::Error::last_os_error());
            }
            let ok = libc::write(f, b"1".as_ptr().cast(), 1) == 1;
            libc::close(f);
            if ok { Ok(()) } else { Err(io::Error::last_os_error()) }
        });
    }
    nft_run(cmd, &script)
        .map_err(|e| NetworkError::Nft(format!("the loopback redirect in the container's namespace: {e}")))
}

/// What DEL runs for a plugin of the list. The bridge plugin's DEL is its IPAM's DEL (it
/// delegates with the same config) plus deleting the veth inside the namespace, which costs
/// 20-30 ms of every teardown in the kernel's synchronous device removal. runner calls the
/// IPAM plugin itself and lets the veth go with the namespace: unpinned right after, with no
/// process left in it, the namespace is destroyed and its devices (the veth pair) with it.
/// host-local hands addresses out in order over the /16, so the address is not given again
/// before that.
fn del_form(plugin: &Value) -> Value {
    match (plugin["type"].as_str(), plugin["ipam"]["type"].as_str()) {
        (Some("bridge"), Some(ipam)) => {
            let mut p = plugin.clone();
            p["type"] = json!(ipam);
            p
        }
        _ => plugin.clone(),
    }
}

/// The nftables wall, one for every network, made once per host; whether it was made now
/// (an older version is made again whole). The networks are set elements (`register`): a
/// rule names `@bridges`, never a bridge.
fn ensure_wall(mut check: WallCheck) -> Result<bool, NetworkError> {
    let listed = |what: &[&str]| -> Result<bool, NetworkError> {
        Command::new("nft")
            .args(what)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .map_err(|e| NetworkError::Nft(format!("running nft (install nftables): {e}")))
    };
    let current = check
        .0
        .take()
        .unwrap_or_else(|| Err(io::Error::other("asked twice")))
        .and_then(|c| c.wait_with_output())
        .map(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains(WALL_VERSION))
        .map_err(|e| NetworkError::Nft(format!("running nft (install nftables): {e}")))?;
    if current {
        return Ok(false);
    }
    if listed(&["list", "table", "inet", NFT_TABLE])? {
        nft_script(&format!("delete table inet {NFT_TABLE}\n"))?;
    }
    // forward: within one network anything; from a network, nothing else (not another
    // network either) unless a container's rule accepts it first; to a network, answers
    // and published ports (DNATed by portmap). input: a network reaches the host only with
    // answers and DNS for the resolver; the resolver's port is for the networks alone.
    let rules = format!(
        "table inet {NFT_TABLE} {{
  set bridges {{ type ifname; }}
  set same {{ type ifname . ifname; }}
  set gateways {{ type ipv4_addr; }}
  set subnets {{ type ipv4_addr; flags interval; }}
  set resolver {{ type inet_service; }}
  chain forward {{
    type filter hook forward priority filter - 10; policy accept;
    iifname . oifname @same accept
    iifname @bridges drop
    oifname @bridges ct state established,related accept
    oifname @bridges ct status dnat accept comment \"{WALL_VERSION}\"
    oifname @bridges drop
  }}
  chain input {{
    type filter hook input priority filter - 10; policy accept;
    meta l4proto {{ tcp, udp }} th dport @resolver iifname != @bridges iifname != \"lo\" drop
    iifname @bridges ct state established,related accept
    iifname @bridges ip daddr @gateways meta l4proto {{ tcp, udp }} th dport @resolver accept
    iifname @bridges drop
  }}
  chain dns {{
    type nat hook prerouting priority dstnat; policy accept;
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr @subnets oifname != @bridges masquerade
  }}
}}
"
    );
    nft_script(&rules)?;
    // The networks registered before are elements of the new sets again.
    for net in registered() {
        nft_script(&elements("add", &net))?;
    }
    Ok(true)
}

/// The question whether the wall stands, asked of nft in the background (a process start,
/// ~3 ms, that runs beside the bridge plugin's). Asked under the network lock, which whoever
/// takes the wall down holds too.
struct WallCheck(Option<io::Result<std::process::Child>>);

fn start_wall_check() -> WallCheck {
    WallCheck(Some(
        Command::new("nft")
            .args(["list", "chain", "inet", NFT_TABLE, "forward"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn(),
    ))
}

impl Drop for WallCheck {
    /// An attach that failed before asking for the answer still reaps the process.
    fn drop(&mut self) {
        if let Some(Ok(mut child)) = self.0.take() {
            let _ = child.wait();
        }
    }
}

/// A network's elements of the wall's sets.
fn elements(verb: &str, net: &Net) -> String {
    let (b, g, s) = (&net.bridge, net.gateway, &net.subnet);
    format!(
        "{verb} element inet {NFT_TABLE} bridges {{ \"{b}\" }}
{verb} element inet {NFT_TABLE} same {{ \"{b}\" . \"{b}\" }}
{verb} element inet {NFT_TABLE} gateways {{ {g} }}
{verb} element inet {NFT_TABLE} subnets {{ {s} }}
"
    )
}

/// The networks registered on this host (their directories' markers).
fn registered() -> Vec<Net> {
    let Ok(dirs) = std::fs::read_dir(NET_STATE) else {
        return Vec::new();
    };
    dirs.flatten()
        .filter_map(|e| std::fs::read(e.path().join(NET_MARKER)).ok())
        .filter_map(|b| serde_json::from_slice(&b).ok())
        .collect()
}

/// Whether a container is on a network: an interface on its bridge, or an address leased.
fn in_use(net: &Net) -> bool {
    let nonempty = |dir: &Path, skip: &dyn Fn(&str) -> bool| {
        std::fs::read_dir(dir)
            .map(|d| d.flatten().any(|e| !skip(&e.file_name().to_string_lossy())))
            .unwrap_or(false)
    };
    nonempty(&Path::new("/sys/class/net").join(&net.bridge).join("brif"), &|_| false)
        || nonempty(&Path::new(IPAM_DIR).join(&net.name), &|n| {
            n == "lock" || n.starts_with("last_reserved_ip")
        })
}

/// Whether a network must be registered before a container joins it (`false`: it is, as
/// defined). A network whose definition changed is refused while a container is on it (and
/// taken down first otherwise); one that overlaps another's subnet or takes its bridge is
/// refused. Before CNI ADD, which would make the bridge as asked. Under the lock.
fn vet(net: &Net) -> Result<bool, NetworkError> {
    let marker = net.dir().join(NET_MARKER);
    let known: Option<Net> = std::fs::read(&marker)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    if known.as_ref() == Some(net) {
        // A wall made anew got every registered network's elements again (ensure_wall).
        return Ok(false);
    }
    if let Some(old) = known {
        if in_use(&old) {
            return Err(NetworkError::Conflict(format!(
                "network {} is in use as {} on {}; its definition changed to {} on {}: end its containers first",
                old.name, old.subnet, old.bridge, net.subnet, net.bridge
            )));
        }
        unregister(&old)?;
    }
    if let Some(other) = registered()
        .into_iter()
        .find(|o| o.name != net.name && (o.overlaps(net) || o.bridge == net.bridge))
    {
        return Err(NetworkError::Conflict(format!(
            "network {} ({} on {}) clashes with network {} ({} on {}) on this host",
            net.name, net.subnet, net.bridge, other.name, other.subnet, other.bridge
        )));
    }
    Ok(true)
}

/// Make a vetted network known to the wall (its sets' elements) and to iptables, and mark
/// it registered. After the wall stands. Under the lock.
fn register(net: &Net) -> Result<(), NetworkError> {
    let marker = net.dir().join(NET_MARKER);
    nft_script(&elements("add", net))?;
    ensure_iptables(&net.subnet)?;
    std::fs::create_dir_all(net.dir()).map_err(io_err(format!("creating {}", net.dir().display())))?;
    let text = serde_json::to_vec(net).map_err(|e| io_err("encoding the network")(io::Error::other(e)))?;
    std::fs::write(&marker, text).map_err(io_err(format!("writing {}", marker.display())))
}

/// Take a network off the host: its bridge (with the veths of dead namespaces), its set
/// elements, its iptables pair, IPAM's and its own directory. Under the lock.
fn unregister(net: &Net) -> Result<(), NetworkError> {
    let bridge = Path::new("/sys/class/net").join(&net.bridge);
    if bridge.exists() {
        let out = Command::new("ip")
            .args(["link", "del", &net.bridge])
            .output()
            .map_err(io_err("running ip link del"))?;
        if !out.status.success() && bridge.exists() {
            return Err(NetworkError::Nft(format!(
                "ip link del {}: {}",
                net.bridge,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
    }
    // The elements go only where the wall still stands (delete of a missing one fails).
    let listed = Command::new("nft")
        .args(["list", "set", "inet", NFT_TABLE, "bridges"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains(&format!("\"{}\"", net.bridge)))
        .unwrap_or(false);
    if listed {
        nft_script(&elements("delete", net))?;
    }
    for rule in iptables_rules(&net.subnet) {
        while iptables("-C", &rule)? == Some(true) {
            if iptables("-D", &rule)? != Some(true) {
                return Err(NetworkError::Nft(format!("iptables -D {} failed", rule.join(" "))));
            }
        }
    }
    for dir in [Path::new(IPAM_DIR).join(&net.name), net.dir()] {
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(io_err(format!("removing {}", dir.display())))?;
        }
    }
    Ok(())
}

/// iptables' FORWARD rules for a subnet, both ways. They only undo a DROP policy: the wall
/// (nftables, where a drop is final) decides what passes.
fn iptables_rules(subnet: &str) -> [Vec<&str>; 2] {
    ["-s", "-d"].map(|dir| {
        let mut r = vec!["FORWARD", dir, subnet];
        r.extend(["-m", "comment", "--comment", IPT_COMMENT, "-j", "ACCEPT"]);
        r
    })
}

/// Run iptables; `None` when it is not installed (then no iptables rule can drop either).
fn iptables(action: &str, rule: &[&str]) -> Result<Option<bool>, NetworkError> {
    match Command::new("iptables")
        .args(["-w", action])
        .args(rule)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(status) => Ok(Some(status.success())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(NetworkError::Nft(format!("running iptables: {e}"))),
    }
}

fn ensure_iptables(subnet: &str) -> Result<(), NetworkError> {
    for rule in iptables_rules(subnet) {
        match iptables("-C", &rule)? {
            None => {
                tracing::debug!("no iptables here: nothing in FORWARD to open");
                return Ok(());
            }
            Some(true) => {}
            Some(false) => {
                if iptables("-I", &rule)? != Some(true) {
                    return Err(NetworkError::Nft(format!("iptables -I {} failed", rule.join(" "))));
                }
            }
        }
    }
    Ok(())
}

/// Take down every network no container is on (no interface on its bridge, no address
/// leased), and, with none left, the resolver and the wall. What `runner gc` does; whether
/// there was anything to take down.
pub fn remove_if_unused() -> Result<bool, NetworkError> {
    let _lock = lock()?;
    let mut nets = registered();
    // A default network made before networks were registered.
    if !nets.iter().any(|n| n.name == NETWORK_NAME) && Path::new("/sys/class/net").join(BRIDGE).exists() {
        nets.push(Net::default_net());
    }
    let mut any = false;
    let mut left = 0;
    for net in nets {
        if in_use(&net) {
            left += 1;
            continue;
        }
        unregister(&net)?;
        any = true;
    }
    let policies = std::fs::read_dir(dns::POLICY_DIR)
        .map(|mut d| d.next().is_some())
        .unwrap_or(false);
    let ports = std::fs::read_to_string(PORTS_FILE).is_ok_and(|t| !t.trim().is_empty());
    if left > 0 || policies || ports {
        return Ok(any);
    }
    any |= stop_resolver()?;
    let table = Command::new("nft")
        .args(["list", "table", "inet", NFT_TABLE])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if table {
        nft_script(&format!("delete table inet {NFT_TABLE}\n"))?;
        any = true;
    }
    let _ = std::fs::remove_file(PORTS_FILE);
    Ok(any)
}

/// Keep the network's name files: add (`entry`) or drop (None) container `id`'s line of the
/// hosts file, and write resolv.conf. Written in place (truncate, write): containers bind
/// the files' inodes, so they see every change. Runs under the network lock.
fn names(net: &Net, id: &str, entry: Option<(&str, &str)>) -> Result<(), NetworkError> {
    let dir = net.dir();
    std::fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
    let (hosts, resolv) = net.files();
    let tag = format!("# {id}");
    let old = std::fs::read_to_string(&hosts).unwrap_or_default();
    let mut text = String::from("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n");
    for line in old.lines().filter(|l| l.contains("\t# ") && !l.ends_with(&tag)) {
        text.push_str(line);
        text.push('\n');
    }
    let Some((ip, name)) = entry else {
        return write_in_place(&hosts, &text);
    };
    // Hostnames are job names (DNS labels); anything else is left out of the file.
    let valid = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
    let names = if valid { format!("{name} {id}") } else { id.to_string() };
    text.push_str(&format!("{ip}\t{names}\t{tag}\n"));
    write_in_place(&hosts, &text)?;
    // Written as a container joins (the host's options may have changed since the last).
    write_in_place(
        &resolv,
        &resolv_conf(
            net.gateway,
            &std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default(),
        ),
    )
}

fn write_in_place(path: &Path, text: &str) -> Result<(), NetworkError> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(path)
        .map_err(io_err(format!("opening {}", path.display())))?;
    f.write_all(text.as_bytes())
        .map_err(io_err(format!("writing {}", path.display())))
}

/// The network's resolv.conf: runner's resolver (the gateway) and the host's `options`
/// lines. The host's resolvers are not named: a container reaches no resolver but runner's,
/// and the host's search domains are the host's own network's.
fn resolv_conf(gateway: std::net::Ipv4Addr, host: &str) -> String {
    let mut out = format!("# runner: its resolver on the bridge\nnameserver {gateway}\n");
    for line in host.lines().map(str::trim) {
        if line.starts_with("options") {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The names of container `id`'s sets (nft names take no '-'): for addresses, and for
/// address . port pairs.
fn set_names(id: &str) -> (String, String) {
    use sha2::Digest;
    let h = hex::encode(&sha2::Sha256::digest(id.as_bytes())[..8]);
    (format!("d{h}"), format!("p{h}"))
}

/// The address a cached CNI result gave the container.
fn cached_ip(result: Option<&Value>) -> Option<std::net::Ipv4Addr> {
    result?["ips"][0]["address"].as_str()?.split('/').next()?.parse().ok()
}

fn write_policy(policy: &dns::Policy) -> Result<(), NetworkError> {
    std::fs::create_dir_all(dns::POLICY_DIR).map_err(io_err(format!("creating {}", dns::POLICY_DIR)))?;
    let path = dns::policy_path(policy.ip);
    let tmp = path.with_extension("tmp");
    let text = serde_json::to_vec(policy).map_err(|e| io_err("encoding the resolver's policy")(io::Error::other(e)))?;
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(io_err(format!("writing {}", path.display())))
}

/// The port of the host's resolver, started (`exe resolver`) when none runs (then `true`).
/// Under the network lock, so two attaches never start two.
fn ensure_resolver(exe: &Path) -> Result<(u16, bool), NetworkError> {
    let fail = |m: String| NetworkError::Resolver(m);
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dns::RESOLVER_LOCK)
        .map_err(io_err(format!("opening {}", dns::RESOLVER_LOCK)))?;
    match nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        // Held: a resolver lives, and it wrote its port before whoever started it let go of
        // the network lock.
        Err(_) => {
            return std::fs::read_to_string(dns::RESOLVER_PORT)
                .ok()
                .and_then(|p| p.trim().parse().ok())
                .map(|port| (port, false))
                .ok_or_else(|| fail(format!("a resolver holds {} but left no port", dns::RESOLVER_LOCK)));
        }
        Ok(free) => drop(free),
    }
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open("/run/runner/net/resolver.log")
        .map_err(io_err("opening the resolver's log"))?;
    let mut cmd = Command::new(exe);
    cmd.arg("resolver")
        .env("RUNNER_LOG", "warn,runner::runtime::containerd::dns=info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log);
    // Its own session: a Ctrl-C of the runner that started it is not for it.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd
        .spawn()
        .map_err(io_err(format!("starting {} resolver", exe.display())))?;
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = io::BufRead::read_line(&mut io::BufReader::new(stdout), &mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap_or_default();
    // Reaped here while this process lives (a zombie would hold nothing, but looks alive).
    std::thread::spawn(move || child.wait());
    let mut words = line.split_whitespace();
    match (words.next(), words.next().and_then(|p| p.parse::<u16>().ok())) {
        (Some("ready" | "running"), Some(port)) => Ok((port, true)),
        _ => Err(fail(format!(
            "the resolver did not start ({:?}; see /run/runner/net/resolver.log)",
            line.trim()
        ))),
    }
}

/// `runner resolver`: serve the bridge's DNS until no container needs it.
pub async fn run_resolver() -> io::Result<()> {
    dns::serve(LOCK_FILE).await
}

/// Stop the host's resolver (it would exit by itself a minute after its last container).
/// The caller holds the network lock and has seen no container policy. Whether one ran.
fn stop_resolver() -> Result<bool, NetworkError> {
    let lock = match std::fs::OpenOptions::new().write(true).open(dns::RESOLVER_LOCK) {
        Ok(f) => f,
        Err(_) => return Ok(false),
    };
    if let Ok(free) = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        drop(free);
        return Ok(false);
    }
    // The lock is held, so the PID the resolver wrote is the resolver.
    let Some(pid) = std::fs::read_to_string(dns::RESOLVER_PID)
        .ok()
        .and_then(|p| p.trim().parse::<i32>().ok())
    else {
        return Ok(false);
    };
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM);
    let _ = std::fs::remove_file(dns::RESOLVER_PID);
    let _ = std::fs::remove_file(dns::RESOLVER_PORT);
    Ok(true)
}

/// The comment that tags a container's own rules.
fn rule_tag(id: &str) -> String {
    format!("runner:{id}")
}

/// Run an nft script (atomic: all of it or none).
fn nft_script(script: &str) -> Result<(), NetworkError> {
    let mut cmd = Command::new("nft");
    cmd.args(["-f", "-"]);
    nft_run(cmd, script)
}

fn nft_run(mut cmd: Command, script: &str) -> Result<(), NetworkError> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| NetworkError::Nft(format!("running nft (install nftables): {e}")))?;
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(script.as_bytes())
        .map_err(|e| NetworkError::Nft(e.to_string()))?;
    let out = child.wait_with_output().map_err(|e| NetworkError::Nft(e.to_string()))?;
    if !out.status.success() {
        return Err(NetworkError::Nft(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    Ok(())
}

/// Delete container `id`'s egress rules (found by their comment; none is success).
fn remove_rules(id: &str) -> Result<(), NetworkError> {
    let out = Command::new("nft")
        .args(["-a", "list", "table", "inet", NFT_TABLE])
        .output()
        .map_err(|e| NetworkError::Nft(format!("running nft (install nftables): {e}")))?;
    if !out.status.success() {
        // No table: no rules.
        return Ok(());
    }
    let tag = format!("comment \"{}\"", rule_tag(id));
    let (set, port_set) = set_names(id);
    let mut chain = String::new();
    let mut script = String::new();
    let mut sets = String::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let line = line.trim();
        if let Some(name) = line.strip_prefix("chain ") {
            chain = name.split_whitespace().next().unwrap_or_default().to_string();
        } else if let Some(name) = line.strip_prefix("set ").and_then(|n| n.split_whitespace().next())
            && (name == set || name == port_set)
        {
            // After the rules that name it.
            sets.push_str(&format!("delete set inet {NFT_TABLE} {name}\n"));
        } else if line.contains(&tag)
            && let Some(handle) = line.rsplit_once("# handle ").map(|(_, h)| h.trim())
        {
            script.push_str(&format!("delete rule inet {NFT_TABLE} {chain} handle {handle}\n"));
        }
    }
    script.push_str(&sets);
    if script.is_empty() {
        return Ok(());
    }
    nft_script(&script)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_names_runners_resolver_only() {
        let host = "# generated\nnameserver 127.0.0.53\nnameserver ::1\nnameserver 10.0.0.2\nsearch corp.example\noptions edns0 trust-ad\n";
        let out = resolv_conf(GATEWAY, host);
        assert_eq!(
            out,
            "# runner: its resolver on the bridge\nnameserver 10.89.0.1\noptions edns0 trust-ad\n"
        );
    }
}
