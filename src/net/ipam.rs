//! Addresses on a network, kept as the CNI `host-local` plugin keeps them (so either can read
//! and release the other's): in `<ipam dir>/<network>/`, one file per address in use named by
//! the address and holding `<container id>\r\n<ifname>`, and `last_reserved_ip.0` (the last
//! address handed out: the next search starts after it, so an address is not given again
//! soon). Under the network lock; host-local's own `lock` file is taken too, for a host-local
//! of another runner version.

use std::net::Ipv4Addr;
use std::path::Path;

use super::{NetError, io_err};

const LAST: &str = "last_reserved_ip.0";

/// Lease an address of `subnet` (`addr/prefix`) to container `id`: the first free one after the
/// last handed out, never the network, gateway or broadcast address.
pub fn lease(
    dir: &Path,
    subnet: (Ipv4Addr, u8),
    gateway: Ipv4Addr,
    id: &str,
    ifname: &str,
) -> Result<Ipv4Addr, NetError> {
    std::fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
    let _lock = host_local_lock(dir)?;
    let (net, prefix) = subnet;
    let size = 1u64 << (32 - u32::from(prefix.min(30)));
    let first = u64::from(u32::from(net)) + 1;
    let last = u64::from(u32::from(net)) + size - 2;
    let after = std::fs::read_to_string(dir.join(LAST))
        .ok()
        .and_then(|t| t.trim().parse::<Ipv4Addr>().ok())
        .map(|a| u64::from(u32::from(a)))
        .filter(|a| (first..=last).contains(a))
        .unwrap_or(last);
    let count = last - first + 1;
    for i in 1..=count {
        let candidate = Ipv4Addr::from((first + (after - first + i) % count) as u32);
        if candidate == gateway {
            continue;
        }
        let path = dir.join(candidate.to_string());
        // create_new: an address somebody holds is never taken over.
        match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(mut f) => {
                use std::io::Write;
                f.write_all(format!("{id}\r\n{ifname}").as_bytes())
                    .map_err(io_err(format!("writing {}", path.display())))?;
                std::fs::write(dir.join(LAST), candidate.to_string())
                    .map_err(io_err(format!("writing {}", dir.join(LAST).display())))?;
                return Ok(candidate);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io_err(format!("creating {}", path.display()))(e)),
        }
    }
    Err(NetError::Conflict(format!(
        "no free address on {net}/{prefix} ({count} in use)"
    )))
}

/// Give back what container `id` holds here (nothing is success).
pub fn release(dir: &Path, id: &str) -> Result<(), NetError> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    let _lock = host_local_lock(dir)?;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.parse::<Ipv4Addr>().is_err() {
            continue;
        }
        let holder = std::fs::read_to_string(e.path()).unwrap_or_default();
        if holder.split("\r\n").next().map(str::trim) == Some(id) {
            std::fs::remove_file(e.path()).map_err(io_err(format!("removing {}", e.path().display())))?;
        }
    }
    Ok(())
}

fn host_local_lock(dir: &Path) -> Result<nix::fcntl::Flock<std::fs::File>, NetError> {
    let path = dir.join("lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_err(format!("opening {}", path.display())))?;
    nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| io_err(format!("locking {}", path.display()))(e.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_handed_out_in_turn_and_given_back() {
        let dir = tempfile::tempdir().unwrap();
        let net = (Ipv4Addr::new(10, 97, 0, 0), 29);
        let gw = Ipv4Addr::new(10, 97, 0, 1);
        let got: Vec<Ipv4Addr> = (0..5)
            .map(|i| lease(dir.path(), net, gw, &format!("c{i}"), "eth0").unwrap())
            .collect();
        // .0 the network, .1 the gateway, .7 broadcast: .2 to .6.
        assert_eq!(got, (2..=6).map(|i| Ipv4Addr::new(10, 97, 0, i)).collect::<Vec<_>>());
        let err = lease(dir.path(), net, gw, "c5", "eth0").unwrap_err().to_string();
        assert!(err.contains("no free address"), "{err}");
        assert_eq!(
            std::fs::read_to_string(dir.path().join("10.97.0.4")).unwrap(),
            "c2\r\neth0"
        );
        release(dir.path(), "c2").unwrap();
        assert!(!dir.path().join("10.97.0.4").exists());
        // The next one after the last handed out (wrapping), not the one just freed first.
        assert_eq!(
            lease(dir.path(), net, gw, "c6", "eth0").unwrap(),
            Ipv4Addr::new(10, 97, 0, 4)
        );
        release(dir.path(), "nobody").unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 5 + 2);
    }
}
