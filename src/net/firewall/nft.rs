//! The nftables implementation: batches go to `nft -j -f -` as the `nftables` crate's typed
//! JSON, state comes back as `nft -j list …` parsed into the same types; the wall's version
//! is a set found by name over netlink, in-process (every attach asks).

use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Command, Stdio};

use nftables::expr::Expression;
use nftables::schema::{NfListObject, NfObject, Nftables};

use super::{Firewall, FirewallError, plan};
use crate::net::netlink;

/// Tags the two iptables rules that let a network's traffic through FORWARD.
const IPT_COMMENT: &str = "runner bridge network";

#[derive(Clone, Debug, Default)]
pub struct Nft;

fn run(mut cmd: Command, what: &str, input: &[u8]) -> Result<Vec<u8>, FirewallError> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| FirewallError::Spawn { program: "nft", source })?;
    let mut stdin = child.stdin.take().expect("piped");
    let written = stdin.write_all(input);
    drop(stdin);
    let out = child
        .wait_with_output()
        .map_err(|source| FirewallError::Spawn { program: "nft", source })?;
    if !out.status.success() {
        return Err(FirewallError::Refused {
            what: what.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    written.map_err(|source| FirewallError::Spawn { program: "nft", source })?;
    Ok(out.stdout)
}

fn encode(batch: &Nftables<'static>) -> Vec<u8> {
    // The schema's types serialize infallibly (strings, numbers, enums).
    serde_json::to_vec(batch).expect("nftables objects serialize")
}

impl Firewall for Nft {
    fn apply(&self, what: &str, batch: &Nftables<'static>) -> Result<(), FirewallError> {
        if batch.objects.is_empty() {
            return Ok(());
        }
        let mut cmd = Command::new("nft");
        cmd.args(["-j", "-f", "-"]);
        run(cmd, what, &encode(batch)).map(drop)
    }

    fn elements(&self, set: &str) -> Result<Vec<Expression<'static>>, FirewallError> {
        let out = Command::new("nft")
            .args(["-j", "list", "set", "inet", plan::TABLE, set])
            .output()
            .map_err(|source| FirewallError::Spawn { program: "nft", source })?;
        if !out.status.success() {
            // No wall, or no such set: no elements.
            return Ok(Vec::new());
        }
        set_elements(&out.stdout, set)
    }

    fn wall_current(&self) -> Result<bool, FirewallError> {
        netlink::set_exists(plan::TABLE, plan::WALL_MARK).map_err(|source| FirewallError::Netlink {
            what: "looking for the wall".into(),
            source,
        })
    }

    fn wall_exists(&self) -> Result<bool, FirewallError> {
        // Every wall version has had the `bridges` set.
        netlink::set_exists(plan::TABLE, "bridges").map_err(|source| FirewallError::Netlink {
            what: "looking for the wall".into(),
            source,
        })
    }

    fn forward(&self, subnet: &str, open: bool) -> Result<(), FirewallError> {
        for dir in ["-s", "-d"] {
            let rule = [
                "FORWARD",
                dir,
                subnet,
                "-m",
                "comment",
                "--comment",
                IPT_COMMENT,
                "-j",
                "ACCEPT",
            ];
            let ipt = |action: &'static str| -> Result<Option<bool>, FirewallError> {
                match Command::new("iptables")
                    .args(["-w", action])
                    .args(rule)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                {
                    Ok(status) => Ok(Some(status.success())),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(source) => Err(FirewallError::Spawn {
                        program: "iptables",
                        source,
                    }),
                }
            };
            let fail = |action| FirewallError::Iptables {
                action,
                rule: rule.join(" "),
            };
            if open {
                match ipt("-C")? {
                    None => return Ok(()),
                    Some(true) => {}
                    Some(false) => {
                        if ipt("-I")? != Some(true) {
                            return Err(fail("-I"));
                        }
                    }
                }
            } else {
                while ipt("-C")? == Some(true) {
                    if ipt("-D")? != Some(true) {
                        return Err(fail("-D"));
                    }
                }
            }
        }
        Ok(())
    }

    fn apply_in(&self, netns: &Path, localnet_if: &str, batch: &Nftables<'static>) -> Result<(), FirewallError> {
        let ns = std::fs::File::open(netns).map_err(|source| FirewallError::Namespace {
            path: netns.display().to_string(),
            source,
        })?;
        let sysctl =
            std::ffi::CString::new(format!("/proc/sys/net/ipv4/conf/{localnet_if}/route_localnet")).map_err(|e| {
                FirewallError::Namespace {
                    path: netns.display().to_string(),
                    source: std::io::Error::other(e),
                }
            })?;
        let mut cmd = Command::new("nft");
        cmd.args(["-j", "-f", "-"]);
        let fd = ns.as_raw_fd();
        // SAFETY: between fork and exec the child makes raw system calls only (no allocation,
        // no lock): setns, open, write, close.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let f = libc::open(sysctl.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if f < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let ok = libc::write(f, b"1".as_ptr().cast(), 1) == 1;
                libc::close(f);
                if ok {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        run(
            cmd,
            "the loopback redirect in the container's namespace",
            &encode(batch),
        )
        .map(drop)
    }
}

/// The elements of a set as `nft -j list set` prints them.
fn set_elements(json: &[u8], set: &str) -> Result<Vec<Expression<'static>>, FirewallError> {
    let parsed: Nftables<'static> = serde_json::from_slice(json).map_err(|source| FirewallError::Unreadable {
        what: format!("set {set}"),
        source,
    })?;
    Ok(parsed
        .objects
        .iter()
        .filter_map(|o| match o {
            NfObject::ListObject(NfListObject::Set(s)) => s.elem.as_ref().map(|e| e.to_vec()),
            _ => None,
        })
        .flatten()
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What nft 1.0.6 printed for the containers' sets (captured in a namespace of our own).
    #[test]
    fn listed_elements_are_read_back_typed_and_by_owner() {
        let listed = [
            r#"{"nftables": [{"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5", "json_schema_version": 1}}, {"set": {"family": "inet", "name": "allow_net", "table": "runner", "type": ["ipv4_addr", "ipv4_addr"], "handle": 7, "flags": ["interval"], "elem": [{"concat": ["10.89.0.7", {"prefix": {"addr": "10.0.0.0", "len": 8}}]}]}}]}"#,
            r#"{"nftables": [{"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5", "json_schema_version": 1}}, {"set": {"family": "inet", "name": "dom_port", "table": "runner", "type": ["ipv4_addr", "ipv4_addr", "inet_service"], "handle": 10, "flags": ["timeout"], "elem": [{"elem": {"val": {"concat": ["10.89.0.7", "198.51.100.1", 443]}, "timeout": 60, "expires": 59}}]}}]}"#,
            r#"{"nftables": [{"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5", "json_schema_version": 1}}, {"set": {"family": "inet", "name": "allow_port", "table": "runner", "type": ["ipv4_addr", "ipv4_addr", "inet_service"], "handle": 8, "flags": ["interval"], "elem": [{"concat": ["10.89.0.8", "203.0.113.7", 443]}]}}]}"#,
        ];
        let owners: Vec<Option<std::net::Ipv4Addr>> = listed
            .iter()
            .map(|j| {
                let e = set_elements(j.as_bytes(), "x").unwrap();
                assert_eq!(e.len(), 1);
                plan::element_owner(&e[0])
            })
            .collect();
        assert_eq!(
            owners,
            vec![
                Some("10.89.0.7".parse().unwrap()),
                Some("10.89.0.7".parse().unwrap()),
                Some("10.89.0.8".parse().unwrap())
            ]
        );
        // A delete names the element without its timeout.
        let e = set_elements(listed[1].as_bytes(), "x").unwrap();
        assert_eq!(
            serde_json::to_string(&plan::element_key(&e[0])).unwrap(),
            r#"{"concat":["10.89.0.7","198.51.100.1",443]}"#
        );
    }
}
