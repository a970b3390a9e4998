//! A network's name files, bind-mounted read-only into its containers: `hosts` (each
//! container by its job's name and its id) and `resolv.conf` (runner's resolver). Written in
//! place (truncate, write): containers bind the files' inodes, so they see every change.
//! Under the network lock.

use std::io::Write;
use std::net::Ipv4Addr;
use std::path::Path;

use super::{NetError, io_err};

/// Add (`entry`: address, name) or drop (None) container `id`'s line of the hosts file in
/// `dir`, and write resolv.conf (from the host's, `host_resolv`).
pub fn update(
    dir: &Path,
    gateway: Ipv4Addr,
    host_resolv: &Path,
    id: &str,
    entry: Option<(Ipv4Addr, &str)>,
) -> Result<(), NetError> {
    std::fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
    let (hosts, resolv) = (dir.join("hosts"), dir.join("resolv.conf"));
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
    let names = if valid_name(name) {
        format!("{name} {id}")
    } else {
        id.to_string()
    };
    text.push_str(&format!("{ip}\t{names}\t{tag}\n"));
    write_in_place(&hosts, &text)?;
    // Written as a container joins (the host's options may have changed since the last).
    write_in_place(
        &resolv,
        &resolv_conf(gateway, &std::fs::read_to_string(host_resolv).unwrap_or_default()),
    )
}

/// Whether a name may stand in the hosts file (and be answered by the resolver).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 253 && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
}

fn write_in_place(path: &Path, text: &str) -> Result<(), NetError> {
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
pub fn resolv_conf(gateway: Ipv4Addr, host: &str) -> String {
    let mut out = format!("# runner: its resolver on the bridge\nnameserver {gateway}\n");
    for line in host.lines().map(str::trim) {
        if line.starts_with("options") {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_names_runners_resolver_only() {
        let host = "# generated\nnameserver 127.0.0.53\nnameserver ::1\nnameserver 10.0.0.2\nsearch corp.example\noptions edns0 trust-ad\n";
        let out = resolv_conf(Ipv4Addr::new(10, 89, 0, 1), host);
        assert_eq!(
            out,
            "# runner: its resolver on the bridge\nnameserver 10.89.0.1\noptions edns0 trust-ad\n"
        );
    }

    #[test]
    fn hosts_lines_come_and_go_with_their_containers() {
        let dir = tempfile::tempdir().unwrap();
        let resolv = dir.path().join("host-resolv");
        std::fs::write(&resolv, "options ndots:2\n").unwrap();
        let gw = Ipv4Addr::new(10, 89, 0, 1);
        update(
            dir.path(),
            gw,
            &resolv,
            "c1",
            Some((Ipv4Addr::new(10, 89, 0, 2), "web")),
        )
        .unwrap();
        update(
            dir.path(),
            gw,
            &resolv,
            "c2",
            Some((Ipv4Addr::new(10, 89, 0, 3), "bad name!")),
        )
        .unwrap();
        let hosts = std::fs::read_to_string(dir.path().join("hosts")).unwrap();
        assert!(
            hosts.contains("10.89.0.2\tweb c1\t# c1\n") && hosts.contains("10.89.0.3\tc2\t# c2\n"),
            "{hosts}"
        );
        update(dir.path(), gw, &resolv, "c1", None).unwrap();
        let hosts = std::fs::read_to_string(dir.path().join("hosts")).unwrap();
        assert!(!hosts.contains("c1") && hosts.contains("# c2"), "{hosts}");
        assert!(
            std::fs::read_to_string(dir.path().join("resolv.conf"))
                .unwrap()
                .contains("ndots:2")
        );
    }
}
