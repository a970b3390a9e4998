//! The hardened-default predicate: properties every spec we send to containerd must have
//! (`docs/security.md`). Golden tests, the fuzz target and the integration tests call it.

use oci_spec::runtime::{LinuxNamespaceType, LinuxSeccompAction, Spec};

use super::seccomp::MUST_BLOCK;
use super::{MASKED_PATHS, READONLY_PATHS};

/// Every way `spec` falls short of the hardened default; empty when it complies.
/// `host_users`: the Environment opted out of a user namespace (`hostUsers: true`).
pub fn violations(spec: &Spec, host_users: bool) -> Vec<String> {
    let mut out = Vec::new();
    let Some(process) = spec.process() else {
        return vec!["no process".into()];
    };
    if process.no_new_privileges() != Some(true) {
        out.push("noNewPrivileges is not true".into());
    }
    match process.capabilities() {
        Some(caps) => {
            if caps.ambient().as_ref().is_some_and(|a| !a.is_empty()) {
                out.push("ambient capabilities are not empty".into());
            }
            if caps.inheritable().as_ref().is_some_and(|a| !a.is_empty()) {
                out.push("inheritable capabilities are not empty".into());
            }
            let bounding = caps.bounding().clone().unwrap_or_default();
            if bounding.len() > 14 {
                out.push(format!("{} bounding capabilities (at most 14)", bounding.len()));
            }
            for cap in [
                oci_spec::runtime::Capability::SysAdmin,
                oci_spec::runtime::Capability::SysPtrace,
                oci_spec::runtime::Capability::SysModule,
                oci_spec::runtime::Capability::NetAdmin,
            ] {
                if bounding.contains(&cap) {
                    out.push(format!("capability {cap} is granted"));
                }
            }
        }
        None => out.push("capabilities are unset (the runtime would pick its own)".into()),
    }
    if process.rlimits().as_ref().is_none_or(|r| r.is_empty()) {
        out.push("no explicit rlimits".into());
    }
    if process.user().uid() > crate::manifest::MAX_ID as u32 {
        out.push("uid above the allowed range".into());
    }
    if spec.hooks().is_some() {
        out.push("OCI hooks are set".into());
    }
    let Some(linux) = spec.linux() else {
        out.push("no linux section".into());
        return out;
    };
    match linux.seccomp() {
        Some(sc) => {
            if sc.default_action() == LinuxSeccompAction::ScmpActAllow {
                out.push("seccomp default action is allow".into());
            }
            let allowed: Vec<&String> = sc
                .syscalls()
                .iter()
                .flatten()
                .filter(|s| s.action() == LinuxSeccompAction::ScmpActAllow && s.args().is_none())
                .flat_map(|s| s.names())
                .collect();
            for name in MUST_BLOCK {
                if allowed.iter().any(|a| a == name) {
                    out.push(format!("seccomp allows {name}"));
                }
            }
            if allowed.iter().any(|a| *a == "clone" || *a == "clone3") {
                out.push("seccomp allows clone without a namespace-flag filter".into());
            }
        }
        None => out.push("no seccomp profile".into()),
    }
    let masked = linux.masked_paths().clone().unwrap_or_default();
    for p in MASKED_PATHS {
        if !masked.iter().any(|m| m == p) {
            out.push(format!("{p} is not masked"));
        }
    }
    let readonly = linux.readonly_paths().clone().unwrap_or_default();
    for p in READONLY_PATHS {
        if !readonly.iter().any(|m| m == p) {
            out.push(format!("{p} is not read-only"));
        }
    }
    if linux.devices().as_ref().is_some_and(|d| !d.is_empty()) {
        out.push("host devices are passed in".into());
    }
    if linux.sysctl().as_ref().is_some_and(|s| !s.is_empty()) {
        out.push("sysctls are set".into());
    }
    let namespaces: Vec<LinuxNamespaceType> = linux.namespaces().iter().flatten().map(|n| n.typ()).collect();
    for ns in [
        LinuxNamespaceType::Pid,
        LinuxNamespaceType::Ipc,
        LinuxNamespaceType::Uts,
        LinuxNamespaceType::Mount,
        LinuxNamespaceType::Cgroup,
    ] {
        if !namespaces.contains(&ns) {
            out.push(format!("no new {ns:?} namespace"));
        }
    }
    if !host_users {
        let size = crate::manifest::USERNS_IDS;
        if u64::from(process.user().uid()) >= size || u64::from(process.user().gid()) >= size {
            out.push("the process's ids are outside its user namespace".into());
        }
        if !namespaces.contains(&LinuxNamespaceType::User) {
            out.push("no new user namespace".into());
        }
        for (what, maps) in [("uid", linux.uid_mappings()), ("gid", linux.gid_mappings())] {
            let maps = maps.clone().unwrap_or_default();
            if maps.is_empty() {
                out.push(format!("no {what} mappings for the user namespace"));
            }
            // A range must stay clear of the host's accounts (ids below 65536, root first)
            // and of ids above the largest we allow.
            let size = crate::manifest::USERNS_IDS;
            if maps.iter().any(|m| {
                u64::from(m.host_id()) < size
                    || u64::from(m.size()) > size
                    || u64::from(m.host_id()) + u64::from(m.size()) > crate::manifest::MAX_ID + 1
            }) {
                out.push(format!("a {what} mapping reaches host accounts or ids above the limit"));
            }
        }
    }
    if linux
        .namespaces()
        .iter()
        .flatten()
        .any(|n| n.path().is_some() && n.typ() != LinuxNamespaceType::Network)
    {
        out.push("joins an existing non-network namespace".into());
    }
    match linux.resources() {
        Some(r) => {
            let first = r.devices().as_ref().and_then(|d| d.first());
            if !first.is_some_and(|d| !d.allow() && d.typ().is_none() && d.major().is_none()) {
                out.push("the first device rule is not deny-all".into());
            }
            if r.memory().as_ref().and_then(|m| m.limit()).is_none_or(|l| l <= 0) {
                out.push("no memory limit".into());
            }
            if r.pids().as_ref().is_none_or(|p| p.limit() <= 0) {
                out.push("no pids limit above 0".into());
            }
            if r.cpu().as_ref().and_then(|c| c.quota()).is_none_or(|q| q <= 0) {
                out.push("no cpu quota".into());
            }
        }
        None => out.push("no resources".into()),
    }
    for m in spec.mounts().iter().flatten() {
        let opts = m.options().clone().unwrap_or_default();
        if m.typ().as_deref() == Some("bind") {
            for required in ["nosuid", "nodev", "rprivate"] {
                if !opts.iter().any(|o| o == required) {
                    out.push(format!("bind mount {} lacks {required}", m.destination().display()));
                }
            }
        }
        if opts.iter().any(|o| o.contains("shared")) {
            out.push(format!("mount {} uses shared propagation", m.destination().display()));
        }
    }
    out
}
