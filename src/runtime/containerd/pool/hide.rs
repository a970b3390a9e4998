//! What a member offers and a job has no use for, taken out of the member at claim so the job
//! sees what a cold run shows: the workspace place of a job without a workspace (then the
//! workdir is the rootfs's, as runc makes a cold container's cwd) and the static-assets root
//! of a job without assets (gone, unless the image has a `/static` of its own).
//!
//! Done in the member's mount namespace by a thread of our own that ends after it: the mounts
//! are runc's binds in that namespace (made there, so not locked), and a slave of the host's
//! place, so nothing of it reaches the host. Only runner's agent has run in the member.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use super::*;

/// In a member's run directory: present when its image has a `/static` of its own (then a
/// job without assets finds it there, as in a cold container).
pub(super) const STATIC_IN_IMAGE: &str = "static-in-image";

/// Whether the image under a member's rootfs has `name` at its root, from the snapshot's mounts
/// before the container starts (runc has made no mount point yet). `rootfs` is empty when
/// runner mounted the (remapped) rootfs itself at `mounted`.
pub(super) fn image_has(rootfs: &[containerd_client::types::Mount], mounted: &Path, name: &str) -> bool {
    let present = |dir: &Path| -> Option<bool> {
        let m = std::fs::symlink_metadata(dir.join(name)).ok()?;
        // An overlay whiteout (a 0/0 character device) hides what the layers below have.
        Some(!(m.file_type().is_char_device() && m.rdev() == 0))
    };
    match rootfs {
        [] => std::fs::symlink_metadata(mounted.join(name)).is_ok(),
        [m] if m.r#type == "overlay" => m
            .options
            .iter()
            .find_map(|o| o.strip_prefix("lowerdir="))
            // Top layer first, as overlay lists them.
            .is_some_and(|lowers| lowers.split(':').find_map(|l| present(Path::new(l))).unwrap_or(false)),
        [m] if m.r#type == "bind" || m.r#type == "rbind" => present(Path::new(&m.source)).unwrap_or(false),
        // A snapshotter runner cannot read: keep the mount point (an empty directory is less
        // wrong than an image's directory removed).
        _ => true,
    }
}

/// Unmount `targets` and, with `static_root`, the static-assets root (removing its mount point
/// when `remove_static`: runc made it, the image has none) in the mount namespace of
/// `init_pid`, checked to be the member's init as `set_hostname` checks it.
pub(super) fn hide_unused(
    init_pid: u32,
    cgroup: &str,
    targets: Vec<String>,
    static_root: bool,
    remove_static: bool,
) -> Result<(), RuntimeError> {
    let path = format!("/proc/{init_pid}/ns/mnt");
    let cgroup = cgroup.to_string();
    let io = |what: String, e: std::io::Error| RuntimeError::Io {
        what: format!("{what} in the claimed container"),
        source: e,
    };
    std::thread::spawn(move || -> Result<(), RuntimeError> {
        let ns = std::fs::File::open(&path).map_err(|e| io("opening the mount namespace".into(), e))?;
        let in_member = std::fs::read_to_string(format!("/proc/{init_pid}/cgroup"))
            .is_ok_and(|c| c.lines().any(|l| l.ends_with(&cgroup)));
        let own = std::fs::metadata("/proc/thread-self/ns/mnt").map(|m| m.ino()).ok();
        let theirs = ns.metadata().map(|m| m.ino()).ok();
        if !in_member || own.is_none() || own == theirs {
            return Err(RuntimeError::Internal(format!(
                "process {init_pid} is not the claimed container's init"
            )));
        }
        // A thread shares its process's root and cwd until it unshares them; setns into a
        // mount namespace refuses a thread that shares them.
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_FS)
            .map_err(|e| io("leaving the process's filesystem context".into(), e.into()))?;
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNS)
            .map_err(|e| io("entering the mount namespace".into(), e.into()))?;
        // The thread's root is now the container's: paths resolve in its rootfs.
        let mut unmount = targets;
        if static_root {
            unmount.push(spec::STATIC_ROOT.to_string());
        }
        for target in &unmount {
            nix::mount::umount2(target.as_str(), nix::mount::MntFlags::MNT_DETACH)
                .map_err(|e| io(format!("unmounting the unused {target}"), e.into()))?;
        }
        if static_root && remove_static {
            std::fs::remove_dir(spec::STATIC_ROOT)
                .map_err(|e| io(format!("removing the unused {}", spec::STATIC_ROOT), e))?;
        }
        Ok(())
    })
    .join()
    .map_err(|_| RuntimeError::Internal("the thread unmounting unused places panicked".into()))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use containerd_client::types::Mount;

    fn overlay(lowers: &[&Path]) -> Vec<Mount> {
        let lowers: Vec<String> = lowers.iter().map(|l| l.display().to_string()).collect();
        vec![Mount {
            r#type: "overlay".into(),
            source: "overlay".into(),
            options: vec![format!("lowerdir={}", lowers.join(":")), "upperdir=/nowhere".into()],
            ..Default::default()
        }]
    }

    #[test]
    fn the_image_has_a_path_when_its_topmost_layer_naming_it_is_no_whiteout() {
        let dir = tempfile::tempdir().unwrap();
        let (top, bottom) = (dir.path().join("top"), dir.path().join("bottom"));
        std::fs::create_dir_all(&top).unwrap();
        std::fs::create_dir_all(bottom.join("static")).unwrap();
        let nowhere = Path::new("/nonexistent");
        assert!(image_has(&overlay(&[&top, &bottom]), nowhere, "static"));
        assert!(!image_has(&overlay(&[&top]), nowhere, "static"));
        // A whiteout in an upper layer removes what the lower one has.
        nix::sys::stat::mknod(
            &top.join("static"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o600),
            0,
        )
        .expect("mknod of a whiteout (the suite runs as root)");
        assert!(!image_has(&overlay(&[&top, &bottom]), nowhere, "static"));
        // A bind (a snapshot without parents) and a rootfs runner mounted itself.
        let bind = vec![Mount {
            r#type: "bind".into(),
            source: bottom.display().to_string(),
            ..Default::default()
        }];
        assert!(image_has(&bind, nowhere, "static"));
        assert!(image_has(&[], &bottom, "static"));
        assert!(!image_has(&[], &top.join("missing"), "static"));
    }
}
