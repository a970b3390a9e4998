//! The layer's logic without root: a fake firewall, fake CNI plugins and a fake resolver, in
//! a network directory of the test's own.

use std::sync::Arc;

use super::*;
use crate::manifest::{EgressEntry, Protocol};

struct World {
    _dir: tempfile::TempDir,
    host: Host,
    fw: Arc<firewall::fake::Fake>,
    cni: Arc<cni::Fake>,
    resolver: Arc<resolver::control::Fake>,
    root: PathBuf,
}

fn world() -> World {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let paths = NetPaths {
        dir: root.join("net"),
        cni_path: vec![root.join("cni")],
        ipam_dir: root.join("ipam"),
        host_resolv_conf: root.join("resolv.conf"),
        sys_class_net: root.join("sys"),
    };
    std::fs::write(&paths.host_resolv_conf, "nameserver 192.0.2.53\noptions edns0\n").unwrap();
    let fw = Arc::new(firewall::fake::Fake::default());
    let cni = Arc::new(cni::Fake::default());
    let resolver = Arc::new(resolver::control::Fake::default());
    let host = Host::with(paths, fw.clone(), cni.clone(), resolver.clone());
    World {
        _dir: dir,
        host,
        fw,
        cni,
        resolver,
        root,
    }
}

fn egress(entries: &[&str]) -> Egress {
    let mut e = Egress::default();
    for t in entries {
        match EgressEntry::parse(t).unwrap() {
            EgressEntry::Cidr(r) => e.cidrs.push(r),
            EgressEntry::Domain(d) => e.domains.push(d),
        }
    }
    e
}

impl World {
    fn request(&self, id: &str, entries: &[&str], ports: Vec<PortSpec>) -> AttachRequest {
        let dir = self.root.join("run").join(id);
        std::fs::create_dir_all(&dir).unwrap();
        AttachRequest {
            pinned: Pinned {
                userns: None,
                netns: dir.join("netns"),
            },
            dir,
            id: id.into(),
            name: format!("job-{id}"),
            egress: egress(entries),
            ports,
            exe: "/bin/false".into(),
            net: Net::default_net(),
        }
    }
}

#[test]
fn attach_makes_the_wall_once_and_puts_a_containers_cidrs_in_its_sets() {
    let w = world();
    let a = w
        .host
        .attach(&w.request(
            "c1",
            &["10.0.0.0/8", "10.1.0.0/16", "203.0.113.7:443", "pypi.org"],
            Vec::new(),
        ))
        .unwrap();
    let st = w.fw.snapshot();
    assert!(st.table && st.sets.contains_key(firewall::plan::WALL_MARK));
    assert!(st.forward.contains(SUBNET), "iptables' pair for the subnet");
    // The overlapping CIDR collapsed into one element; the port rule went to its own set.
    let ip: Ipv4Addr = a.ip.parse().unwrap();
    let links = w.cni.links.lock().unwrap().clone();
    assert!(
        matches!(&links[..], [(veth, got)] if *got == ip && veth.starts_with("veth") && veth.len() <= 15),
        "{links:?}"
    );
    assert_eq!(
        ip,
        Ipv4Addr::new(10, 89, 0, 2),
        "the subnet's first address after the gateway"
    );
    assert_eq!(w.fw.elements_of(firewall::plan::ALLOW_NET, ip).len(), 1);
    assert_eq!(w.fw.elements_of(firewall::plan::ALLOW_PORT, ip).len(), 1);
    // The resolver got its policy, in memory and as a file.
    let msgs = w.resolver.messages.lock().unwrap().clone();
    assert!(
        matches!(&msgs[..], [resolver::control::Message::Attach(p)] if p.ip == ip && p.domains.len() == 1 && p.name == "job-c1")
    );
    assert!(resolver::any_policy(&w.host.paths));
    let hosts = std::fs::read_to_string(w.host.files(&Net::default_net()).0).unwrap();
    assert!(hosts.contains(&format!("{ip}\tjob-c1 c1\t# c1")), "{hosts}");
    // A second container: the wall stands, so no new wall; an empty egress adds nothing.
    let applied = st.applied.len();
    w.host.attach(&w.request("c2", &[], Vec::new())).unwrap();
    assert_eq!(w.fw.snapshot().applied.len(), applied, "{:?}", w.fw.snapshot().applied);
}

#[test]
fn detach_takes_everything_of_the_container_and_only_its() {
    let w = world();
    let a1 = w
        .host
        .attach(&w.request("c1", &["10.0.0.0/8", "198.51.100.0/24:80"], Vec::new()))
        .unwrap();
    let a2 = w.host.attach(&w.request("c2", &["10.0.0.0/8"], Vec::new())).unwrap();
    w.host.detach(&w.root.join("run/c1")).unwrap();
    let ip1: Ipv4Addr = a1.ip.parse().unwrap();
    let ip2: Ipv4Addr = a2.ip.parse().unwrap();
    assert!(w.fw.elements_of(firewall::plan::ALLOW_NET, ip1).is_empty());
    assert!(w.fw.elements_of(firewall::plan::ALLOW_PORT, ip1).is_empty());
    assert_eq!(w.fw.elements_of(firewall::plan::ALLOW_NET, ip2).len(), 1);
    assert!(!w.root.join("run/c1").join(CNI_CACHE).exists());
    assert!(
        !w.host.paths.ipam_dir.join("runner").join(&a1.ip).exists(),
        "the address was given back"
    );
    assert!(w.host.paths.ipam_dir.join("runner").join(&a2.ip).exists());
    let hosts = std::fs::read_to_string(w.host.files(&Net::default_net()).0).unwrap();
    assert!(!hosts.contains("# c1") && hosts.contains("# c2"), "{hosts}");
    // Detaching again (gc after a failed teardown) is a no-op.
    w.host.detach(&w.root.join("run/c1")).unwrap();
}

#[test]
fn a_wall_made_again_under_a_container_does_not_stop_its_detach() {
    let w = world();
    let a = w.host.attach(&w.request("c1", &["10.0.0.0/8"], Vec::new())).unwrap();
    // The table goes (another version's wall replaced it, say): the delete of the elements
    // fails, so what the wall has is read back instead.
    w.fw.apply("test", &firewall::plan::wall(None, &[Net::default_net()]))
        .unwrap();
    assert!(
        w.fw.elements_of(firewall::plan::ALLOW_NET, a.ip.parse().unwrap())
            .is_empty()
    );
    w.host.detach(&w.root.join("run/c1")).unwrap();
}

#[test]
fn a_patch_replaces_the_cidrs_and_tells_the_resolver() {
    let w = world();
    let a = w
        .host
        .attach(&w.request("c1", &["10.0.0.0/8", "203.0.113.7:443"], Vec::new()))
        .unwrap();
    let ip: Ipv4Addr = a.ip.parse().unwrap();
    w.host
        .set_egress(
            &w.root.join("run/c1"),
            &egress(&["203.0.113.7:443", "192.0.2.0/24", "*.example.test"]),
        )
        .unwrap();
    let nets = w.fw.elements_of(firewall::plan::ALLOW_NET, ip);
    assert_eq!(nets.len(), 1);
    assert!(
        nets[0].contains("192.0.2.0") && !nets.iter().any(|e| e.contains("10.0.0.0")),
        "{nets:?}"
    );
    assert_eq!(w.fw.elements_of(firewall::plan::ALLOW_PORT, ip).len(), 1);
    let msgs = w.resolver.messages.lock().unwrap().clone();
    assert!(matches!(msgs.last(), Some(resolver::control::Message::Patch(p)) if p.domains.len() == 1));
    // The record follows: a detach after the patch removes the new elements.
    w.host.detach(&w.root.join("run/c1")).unwrap();
    assert!(w.fw.elements_of(firewall::plan::ALLOW_NET, ip).is_empty());
    assert!(w.fw.elements_of(firewall::plan::ALLOW_PORT, ip).is_empty());
}

#[test]
fn a_patch_of_a_container_without_a_network_says_so() {
    let w = world();
    let dir = w.root.join("run/none");
    std::fs::create_dir_all(&dir).unwrap();
    let err = w.host.set_egress(&dir, &egress(&["10.0.0.0/8"])).unwrap_err();
    assert!(matches!(err, NetError::NotAttached(_)), "{err}");
}

#[test]
fn a_failed_plugin_leaves_no_lease_port_or_record() {
    let mut w = world();
    let cni = Arc::new(cni::Fake {
        fail_add: Some("portmap".into()),
        ..Default::default()
    });
    w.host = Host::with(w.host.paths.clone(), w.fw.clone(), cni.clone(), w.resolver.clone());
    let port = PortSpec {
        name: None,
        container_port: 80,
        host_port: None,
        host_ip: Ipv4Addr::LOCALHOST,
        protocol: Protocol::Tcp,
    };
    let err = w.host.attach(&w.request("c1", &[], vec![port])).unwrap_err();
    assert!(err.to_string().contains("portmap"), "{err}");
    assert_eq!(cni.links.lock().unwrap().len(), 1, "linked before portmap ran");
    let leases: Vec<_> = std::fs::read_dir(w.host.paths.ipam_dir.join("runner"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("10."))
        .collect();
    assert!(leases.is_empty(), "the address was given back: {leases:?}");
    assert!(!ports::any(&w.host.paths.ports_file()));
    assert!(!w.root.join("run/c1").join(CNI_CACHE).exists());
}

#[test]
fn published_ports_get_the_loopback_redirect_in_the_containers_namespace() {
    let w = world();
    let port = PortSpec {
        name: None,
        container_port: 80,
        host_port: None,
        host_ip: Ipv4Addr::LOCALHOST,
        protocol: Protocol::Tcp,
    };
    let a = w.host.attach(&w.request("c1", &[], vec![port])).unwrap();
    assert_eq!(a.ports.len(), 1);
    assert_eq!(w.fw.snapshot().in_namespaces, vec![w.root.join("run/c1/netns")]);
    w.host.detach(&w.root.join("run/c1")).unwrap();
    assert!(!ports::any(&w.host.paths.ports_file()));
}

#[test]
fn gc_takes_unused_networks_the_resolver_and_the_wall_down() {
    let w = world();
    w.host.attach(&w.request("c1", &["10.0.0.0/8"], Vec::new())).unwrap();
    // Its address is leased: the network is in use.
    assert!(!w.host.remove_if_unused().unwrap());
    assert!(w.fw.snapshot().table);
    w.host.detach(&w.root.join("run/c1")).unwrap();
    assert!(w.host.remove_if_unused().unwrap());
    let st = w.fw.snapshot();
    assert!(!st.table && st.forward.is_empty(), "{st:?}");
    assert!(!*w.resolver.running.lock().unwrap());
}

#[test]
fn a_changed_or_clashing_network_definition_is_refused() {
    let w = world();
    w.host.attach(&w.request("c1", &[], Vec::new())).unwrap();
    let mut other = w.request("c2", &[], Vec::new());
    other.net = Net {
        name: "runner-evalnet".into(),
        bridge: "rn-evalnet".into(),
        subnet: "10.89.4.0/24".into(),
        gateway: Ipv4Addr::new(10, 89, 4, 1),
    };
    let err = w.host.attach(&other).unwrap_err().to_string();
    assert!(err.contains("clashes with network runner"), "{err}");
    let mut changed = w.request("c3", &[], Vec::new());
    changed.net.subnet = "10.90.0.0/16".into();
    let err = w.host.attach(&changed).unwrap_err().to_string();
    assert!(err.contains("is in use") && err.contains("definition changed"), "{err}");
}
