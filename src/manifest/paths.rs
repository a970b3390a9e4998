//! Pure path rules shared by manifest validation and the spec builder (which re-checks them
//! after symlinks are resolved). See `docs/security.md`: what the spec builder refuses.

use std::path::{Component, Path, PathBuf};

use super::error::ManifestErrorKind;

/// Host paths that must never be bind-mounted, nor anything under them, nor any directory
/// that contains them (binding `/var` would expose `/var/lib/containerd`).
const SENSITIVE_HOST_PATHS: &[&str] = &[
    "/proc",
    "/sys",
    "/dev",
    "/etc",
    "/boot",
    "/run/containerd",
    "/var/run/containerd",
    "/var/lib/containerd",
    "/run/docker",
    "/run/docker.sock",
    "/var/run/docker.sock",
    "/var/run/docker",
    "/var/lib/docker",
    "/run/runc",
    "/run/containerd-rootless",
];

/// File names of daemon sockets refused wherever they live (a private containerd's socket
/// sits in a directory we cannot list here).
const SOCKET_NAMES: &[&str] = &[
    "containerd.sock",
    "containerd.sock.ttrpc",
    "docker.sock",
    "containerd-debug.sock",
];

/// Container paths a mount may not cover: the kernel's pseudo-filesystems are set up by
/// runc with masked and read-only paths that a bind mount would undo.
const FORBIDDEN_TARGET_ROOTS: &[&str] = &["/proc", "/sys", "/dev"];

/// Lexical checks every path in a manifest passes: no NUL, not empty, no `..`.
pub fn check_lexical(path: &str) -> Result<(), ManifestErrorKind> {
    if path.is_empty() {
        return Err(ManifestErrorKind::EmptyPath);
    }
    if path.contains('\0') {
        return Err(ManifestErrorKind::Nul);
    }
    if Path::new(path).components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(ManifestErrorKind::DotDot(path.to_string()));
    }
    Ok(())
}

/// A path inside the container: absolute, lexically clean.
pub fn check_container_path(path: &str) -> Result<(), ManifestErrorKind> {
    check_lexical(path)?;
    if !path.starts_with('/') {
        return Err(ManifestErrorKind::NotAbsolute(path.to_string()));
    }
    Ok(())
}

/// Normalise `//a/./b/` to `/a/b` (no `..` is present by then).
pub fn normalize(path: &str) -> String {
    let mut out = String::new();
    for c in Path::new(path).components() {
        if let Component::Normal(part) = c {
            out.push('/');
            out.push_str(&part.to_string_lossy());
        }
    }
    if out.is_empty() { "/".to_string() } else { out }
}

/// `child` equals `parent` or lies below it (both normalised, absolute).
pub fn is_within(child: &str, parent: &str) -> bool {
    parent == "/" || child == parent || (child.starts_with(parent) && child.as_bytes().get(parent.len()) == Some(&b'/'))
}

/// A mount target: absolute, clean, not `/`, not under /proc, /sys or /dev.
pub fn check_target(target: &str) -> Result<(), ManifestErrorKind> {
    check_container_path(target)?;
    let t = normalize(target);
    if t == "/" || FORBIDDEN_TARGET_ROOTS.iter().any(|root| is_within(&t, root)) {
        return Err(ManifestErrorKind::RefusedTarget(target.to_string()));
    }
    Ok(())
}

/// The working directory: absolute, clean, and not under /proc (CVE-2024-21626 used
/// `/proc/self/fd/N` to reach the host), /sys or /dev.
pub fn check_workdir(workdir: &str) -> Result<(), ManifestErrorKind> {
    check_container_path(workdir)?;
    let w = normalize(workdir);
    if FORBIDDEN_TARGET_ROOTS.iter().any(|root| is_within(&w, root)) {
        return Err(ManifestErrorKind::RefusedWorkdir(workdir.to_string()));
    }
    Ok(())
}

/// Why an absolute, normalised host path must not be bind-mounted, if it must not.
/// `state_dir` is the runner's own state directory (it holds other jobs' data).
pub fn refused_source(path: &str, state_dir: Option<&str>) -> Option<String> {
    if path == "/" {
        return Some("the host's root filesystem".to_string());
    }
    let name = path.rsplit('/').next().unwrap_or_default();
    if SOCKET_NAMES.contains(&name) {
        return Some("a container daemon's socket".to_string());
    }
    let state = state_dir.map(normalize);
    let sensitive = SENSITIVE_HOST_PATHS
        .iter()
        .map(|s| (s.to_string(), "a host system path"))
        .chain(state.map(|s| (s, "the runner's state directory")));
    for (sensitive, what) in sensitive {
        if is_within(path, &sensitive) {
            return Some(format!("{sensitive} is {what}"));
        }
        if is_within(&sensitive, path) {
            return Some(format!("it contains {sensitive}, {what}"));
        }
    }
    None
}

/// `savePath` of a static asset: relative, clean, non-empty.
pub fn check_save_path(save_path: &str) -> Result<(), ManifestErrorKind> {
    check_lexical(save_path).map_err(|_| ManifestErrorKind::SavePath(save_path.to_string()))?;
    if save_path.starts_with('/') || normalize(save_path) == "/" {
        return Err(ManifestErrorKind::SavePath(save_path.to_string()));
    }
    Ok(())
}

/// `base` joined with `rel` without the `.` steps (`./ws` in `.` is `ws`, not `././ws`);
/// `..` is left as written (a symlink may sit before it).
pub fn join_clean(base: &Path, rel: &str) -> PathBuf {
    let mut out: PathBuf = base.components().filter(|c| !matches!(c, Component::CurDir)).collect();
    for c in Path::new(rel).components() {
        match c {
            Component::CurDir => {}
            other => out.push(other.as_os_str()),
        }
    }
    if out.as_os_str().is_empty() {
        out.push(".");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_system_paths_their_children_and_their_parents() {
        for p in [
            "/",
            "/proc",
            "/proc/1",
            "/etc/shadow",
            "/var",
            "/run",
            "/var/lib/docker/x",
        ] {
            assert!(refused_source(p, None).is_some(), "{p} should be refused");
        }
        for p in ["/home/u/data", "/tmp/ws", "/srv/x"] {
            assert!(refused_source(p, None).is_none(), "{p} should be allowed");
        }
        assert!(refused_source("/srv/state/jobs", Some("/srv/state")).is_some());
        assert!(refused_source("/srv", Some("/srv/state")).is_some());
        assert!(refused_source("/tmp/x/containerd.sock", None).is_some());
    }

    #[test]
    fn targets_under_pseudo_filesystems_are_refused() {
        assert!(check_target("/proc/sys").is_err());
        assert!(check_target("/dev").is_err());
        assert!(check_target("/").is_err());
        assert!(check_target("data").is_err());
        assert!(check_target("/data/../etc").is_err());
        assert!(check_target("/data").is_ok());
        assert!(check_target("/process").is_ok());
    }

    #[test]
    fn within_is_component_wise() {
        assert!(is_within("/workspace/a", "/workspace"));
        assert!(is_within("/workspace", "/workspace"));
        assert!(!is_within("/workspace2", "/workspace"));
        assert_eq!(normalize("//a/./b/"), "/a/b");
    }
}
