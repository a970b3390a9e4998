//! A container's rootfs and workspace seen through its user namespace's ids (see
//! `runtime::idmap` for why runner does this itself).
//!
//! Overlayfs cannot be idmapped itself, but it accepts idmapped layers: each lower layer is
//! bound idmapped (disk id `n` shows as `base + n`), the upper and work directories stay
//! plain, and the overlay is mounted on the host at the run directory's `rootfs`, which the
//! spec's `root.path` names; the task is then created without rootfs mounts. Files the
//! container writes land in its own upper directory with its range's ids, and go with it.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use containerd_client::types::Mount;
use nix::mount::{MntFlags, MsFlags};

use crate::runtime::idmap::{self, Flags, IdMap};
use crate::spec::IdRange;

/// Where a remapped container's rootfs is mounted, in its root directory.
pub const ROOTFS_DIR: &str = "rootfs";
/// Where the idmapped views of its workspace are mounted, in its run directory.
pub const VIEWS_DIR: &str = "views";
/// The file in its run directory naming its range (`host_base`), for teardown.
pub const RANGE_FILE: &str = "userns";

/// The largest mount data the kernel takes in one page.
const MOUNT_DATA_MAX: usize = 4095;

/// The user namespace whose mapping shifts an image's ids into `range`, for `mount_rootfs`.
/// Made apart from the mounts so that a create can make it while containerd prepares the
/// snapshot (a child process is cloned for it: ~0.3-0.5 ms that need not wait), and kept
/// for the range's next lease (`kept_user_namespace`).
pub fn rootfs_namespace(range: IdRange) -> io::Result<OwnedFd> {
    let map = IdMap::range(range);
    idmap::kept_user_namespace(&[map], &[map])
}

/// Mount the snapshot's `mounts` at `dir/rootfs` with the image's ids shifted into `range`,
/// whose namespace `userns` is (`rootfs_namespace`). Returns the rootfs path.
pub fn mount_rootfs(mounts: &[Mount], dir: &Path, range: IdRange, userns: OwnedFd) -> io::Result<PathBuf> {
    let [mount] = mounts else {
        return Err(io::Error::other(format!(
            "the snapshotter gave {} mounts for a rootfs; remapping handles one",
            mounts.len()
        )));
    };
    let target = dir.join(ROOTFS_DIR);
    std::fs::create_dir_all(&target)?;
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o755))?;
    match mount.r#type.as_str() {
        // A snapshot without parent: a plain directory.
        "bind" | "rbind" => {
            let read_only = mount.options.iter().any(|o| o == "ro");
            let tree = idmap::idmapped_tree(
                idmap::Source::Path(Path::new(&mount.source)),
                Some(userns.as_fd()),
                Flags {
                    read_only,
                    restricted: false,
                },
            )?;
            idmap::attach(tree, &target)?;
        }
        "overlay" => {
            let Overlay {
                lower,
                upper,
                mut data,
                flags,
            } = parse_overlay(&mount.options)?;
            if lower.is_empty() {
                return Err(io::Error::other("an overlay rootfs without lower layers"));
            }
            // The merged root takes the upper directory's owner and mode: give it those the
            // top layer's root shows through the mapping, as if copied up.
            if let Some(upper) = &upper {
                let top = std::fs::metadata(&lower[0])?;
                std::os::unix::fs::lchown(upper, Some(range.host_id(top.uid())), Some(range.host_id(top.gid())))?;
                std::fs::set_permissions(upper, std::fs::Permissions::from_mode(top.mode() & 0o7777))?;
            }
            let layers = dir.join("layers");
            std::fs::create_dir_all(&layers)?;
            let attached = (|| {
                let mut names = Vec::new();
                for (i, dir) in lower.iter().enumerate() {
                    let at = layers.join(i.to_string());
                    std::fs::create_dir(&at)?;
                    idmap::attach(
                        idmap::idmapped_tree(idmap::Source::Path(dir), Some(userns.as_fd()), Flags::default())?,
                        &at,
                    )?;
                    names.push(at.display().to_string());
                }
                data.push(format!("lowerdir={}", names.join(":")));
                let data = data.join(",");
                if data.len() > MOUNT_DATA_MAX {
                    return Err(io::Error::other(format!(
                        "the overlay options of this image are {} bytes (the kernel takes {MOUNT_DATA_MAX})",
                        data.len()
                    )));
                }
                nix::mount::mount(Some("overlay"), &target, Some("overlay"), flags, Some(data.as_str()))
                    .map_err(|e| io::Error::new(io::Error::from(e).kind(), format!("mounting the overlay rootfs: {e}")))
            })();
            // The overlay holds its layers; their mount points are not needed any more.
            for entry in std::fs::read_dir(&layers)?.flatten() {
                let _ = nix::mount::umount2(&entry.path(), MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW);
                let _ = std::fs::remove_dir(entry.path());
            }
            let _ = std::fs::remove_dir(&layers);
            attached?;
        }
        other => {
            return Err(io::Error::other(format!(
                "cannot remap a rootfs mount of type {other:?} (overlay and bind are supported); hostUsers: true runs without a user namespace"
            )));
        }
    }
    Ok(target)
}

/// How a workspace view shows ids: in a user namespace of `range`, the tree's `owner` (uid,
/// gid on the host) as the job's `user` (uid, gid inside).
#[derive(Clone, Copy, Debug)]
pub struct ViewIds {
    pub owner: (u32, u32),
    pub user: (u32, u32),
    pub range: IdRange,
}

/// A view of `source` (a workspace, or a path resolved beneath it) for a container, mounted
/// `nosuid,nodev` in its run directory, where only the host and the container's root reach
/// it; the spec (or a pool member's place) binds the view, never the workspace path. With
/// `ids` it is idmapped: what the job writes is stored as the owner's. Returns where the view
/// is mounted.
pub fn workspace_view(
    run_dir: &Path,
    index: usize,
    source: idmap::Source<'_>,
    ids: Option<ViewIds>,
    read_only: bool,
) -> io::Result<PathBuf> {
    let userns = view_namespace(ids)?;
    let target = run_dir.join(VIEWS_DIR).join(format!("v{index}"));
    std::fs::create_dir_all(run_dir.join(VIEWS_DIR))?;
    idmap::bind_idmapped(
        source,
        &target,
        userns.as_ref().map(|u| u.as_fd()),
        Flags {
            read_only,
            restricted: true,
        },
    )?;
    Ok(target)
}

/// The user namespace a view is seen through: the workspace's owner as the job's user.
fn view_namespace(ids: Option<ViewIds>) -> io::Result<Option<OwnedFd>> {
    match ids {
        Some(ids) => {
            let (uids, gids) = idmap::owner_maps(ids.owner, ids.user, ids.range);
            Ok(Some(idmap::kept_user_namespace(&[uids], &[gids])?))
        }
        None => Ok(None),
    }
}

/// The directory a container's writes to its rootfs land in, from its snapshot's mounts: an
/// overlay's upper directory, or the directory of a writable bind (a snapshot without parent).
pub fn writable_layer(mounts: &[Mount]) -> Option<PathBuf> {
    let [mount] = mounts else { return None };
    match mount.r#type.as_str() {
        "overlay" => mount
            .options
            .iter()
            .find_map(|o| o.strip_prefix("upperdir="))
            .map(PathBuf::from),
        "bind" | "rbind" if !mount.options.iter().any(|o| o == "ro") => Some(PathBuf::from(&mount.source)),
        _ => None,
    }
}

/// Why a bind of the workspace could not be given a view.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    /// The source does not resolve beneath the workspace now (the sandbox swapped a
    /// component for a link leaving it, or removed it): the job's or the sandbox's doing.
    #[error("mount source in the workspace: {0}")]
    Resolve(#[source] crate::confined::ConfinedError),
    #[error("mounting {what}: {source}")]
    Mount {
        what: String,
        #[source]
        source: io::Error,
    },
}

/// Views for a container's binds of its workspace (`binds`: index in the spec, source, read
/// only), in its run directory. A source beneath the workspace is resolved now, beneath the
/// workspace's descriptor, and mounted from what that resolution found: whatever an earlier
/// attempt, a parallel index or a session on the same workspace left there (a component
/// swapped for a link to a host directory) cannot redirect the mount. The workspace itself
/// (a path the host chose) gets a view only with `ids`; without, it is bound as it is.
/// Returns the view of each bind that got one.
pub fn workspace_views(
    run_dir: &Path,
    workspace: &Path,
    binds: &[(usize, PathBuf, bool)],
    ids: Option<ViewIds>,
) -> Result<Vec<(usize, PathBuf)>, ViewError> {
    each_view(workspace, binds, ids, |index, source, read_only| {
        workspace_view(run_dir, index, source, ids, read_only)
    })
}

/// `workspace_views`' views as detached trees, not mounted anywhere yet: a claimed pool
/// member's late binds attach each straight at its place. A tree is private and has its
/// final flags already (`idmap::idmapped_tree`), which is what the staging of `late::bind_place`
/// gives a host path; that staging (a bind, made private, remounted, bound on, then unmounted
/// and removed) and the view's own mount point were 0.45-0.5 ms of a pooled session's claim.
pub fn workspace_trees(
    workspace: &Path,
    binds: &[(usize, PathBuf, bool)],
    ids: Option<ViewIds>,
) -> Result<Vec<(usize, OwnedFd)>, ViewError> {
    each_view(workspace, binds, ids, |_, source, read_only| {
        let userns = view_namespace(ids)?;
        idmap::idmapped_tree(
            source,
            userns.as_ref().map(|u| u.as_fd()),
            Flags {
                read_only,
                restricted: true,
            },
        )
    })
}

/// What `workspace_views` and `workspace_trees` share: which binds get a view, each source
/// resolved beneath the workspace, `make` called with it.
fn each_view<T>(
    workspace: &Path,
    binds: &[(usize, PathBuf, bool)],
    ids: Option<ViewIds>,
    mut make: impl FnMut(usize, idmap::Source<'_>, bool) -> io::Result<T>,
) -> Result<Vec<(usize, T)>, ViewError> {
    let mut views = Vec::new();
    let mut root = None;
    for (index, source, read_only) in binds {
        let Ok(rel) = source.strip_prefix(workspace) else {
            continue;
        };
        let mount_error = |source| ViewError::Mount {
            what: format!("workspace path {}", rel.display()),
            source,
        };
        let view = if rel.as_os_str().is_empty() {
            if ids.is_none() {
                continue;
            }
            make(*index, idmap::Source::Path(workspace), *read_only).map_err(mount_error)?
        } else {
            let root = match &mut root {
                Some(root) => root,
                None => root.insert(crate::confined::Root::open(workspace).map_err(ViewError::Resolve)?),
            };
            let fd = root.open_path(&rel.to_string_lossy()).map_err(ViewError::Resolve)?;
            make(*index, idmap::Source::Fd(fd.as_fd()), *read_only).map_err(mount_error)?
        };
        views.push((*index, view));
    }
    Ok(views)
}

/// The owner the workspace's files are stored as: the workspace directory's owner. (With
/// `user: host` the job runs as HUID/HGID, which usually own it; when they do not, the job
/// still writes as the directory's owner: the kernel refuses writes to a file whose owner an
/// idmapped mount does not map, so any other choice would make the workspace read-only.)
pub fn workspace_owner(workspace: &Path) -> io::Result<(u32, u32)> {
    let meta = std::fs::metadata(workspace)?;
    Ok((meta.uid(), meta.gid()))
}

/// The range a container's spec maps (`None`: no user namespace).
pub fn range_of(spec: &oci_spec::runtime::Spec) -> Option<IdRange> {
    let maps = spec.linux().as_ref()?.uid_mappings().clone()?;
    let first = maps.iter().find(|m| m.container_id() == 0)?;
    Some(IdRange {
        host_base: first.host_id(),
    })
}

/// The mount flag a generic option stands for (`None`: filesystem data).
fn mount_flag(option: &str) -> Option<MsFlags> {
    Some(match option {
        "ro" => MsFlags::MS_RDONLY,
        "rw" | "defaults" | "suid" | "dev" | "exec" | "async" => MsFlags::empty(),
        "nosuid" => MsFlags::MS_NOSUID,
        "nodev" => MsFlags::MS_NODEV,
        "noexec" => MsFlags::MS_NOEXEC,
        "sync" => MsFlags::MS_SYNCHRONOUS,
        "noatime" => MsFlags::MS_NOATIME,
        "nodiratime" => MsFlags::MS_NODIRATIME,
        "relatime" => MsFlags::MS_RELATIME,
        "strictatime" => MsFlags::MS_STRICTATIME,
        _ => return None,
    })
}

/// An overlay mount's options, split: lower layers, the upper directory, the rest of the data,
/// and the generic options as mount flags (as containerd parses them).
#[derive(Debug, PartialEq)]
struct Overlay {
    lower: Vec<PathBuf>,
    upper: Option<PathBuf>,
    data: Vec<String>,
    flags: MsFlags,
}

fn parse_overlay(options: &[String]) -> io::Result<Overlay> {
    let mut out = Overlay {
        lower: Vec::new(),
        upper: None,
        data: Vec::new(),
        flags: MsFlags::empty(),
    };
    for option in options {
        if let Some(flag) = mount_flag(option) {
            out.flags |= flag;
            continue;
        }
        match option.split_once('=') {
            Some(("lowerdir", dirs)) => out.lower.extend(dirs.split(':').map(PathBuf::from)),
            // A layer added this way would not be idmapped: refuse rather than expose it.
            Some((key, _)) if key.starts_with("lowerdir+") || key.starts_with("datadir+") => {
                return Err(io::Error::other(format!("cannot remap the overlay option {key:?}")));
            }
            Some(("upperdir", dir)) => {
                out.upper = Some(PathBuf::from(dir));
                out.data.push(option.clone());
            }
            _ => out.data.push(option.clone()),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_options_split_into_layers_data_and_flags() {
        let options: Vec<String> = [
            "index=off",
            "workdir=/s/3/work",
            "upperdir=/s/3/fs",
            "lowerdir=/s/2/fs:/s/1/fs",
            "ro",
            "nosuid",
            "userxattr",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let o = parse_overlay(&options).unwrap();
        assert_eq!(o.lower, [PathBuf::from("/s/2/fs"), PathBuf::from("/s/1/fs")]);
        assert_eq!(o.upper, Some(PathBuf::from("/s/3/fs")));
        assert_eq!(
            o.data,
            ["index=off", "workdir=/s/3/work", "upperdir=/s/3/fs", "userxattr"]
        );
        assert_eq!(o.flags, MsFlags::MS_RDONLY | MsFlags::MS_NOSUID);
        // A layer that would bypass the idmapping is refused.
        assert!(parse_overlay(&["lowerdir+=/s/1/fs".to_string()]).is_err());
    }
}
