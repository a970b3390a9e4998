//! The namespaces a bridge container joins, made and pinned by runner itself.
//!
//! A container in a user namespace can mount `sysfs` only in a network namespace its own user
//! namespace owns (runc 1.1 mounts sysfs and has no fallback), so a netns made in the host's
//! user namespace (`ip netns add`) makes runc fail with EPERM. For a container with a range,
//! runner therefore makes the user namespace itself (the range's maps), makes the network
//! namespace inside it, pins both (bind mounts of their nsfs files beside the container's
//! rootfs), and names both by path in the spec; runc joins them instead of making its own.
//! With `hostUsers: true` only the netns is made.

use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use super::{NetError, io_err};
use crate::spec::IdRange;

const USERNS_PIN: &str = "userns";
const NETNS_PIN: &str = "netns";

/// The namespaces a container joins, by path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pinned {
    pub userns: Option<PathBuf>,
    pub netns: PathBuf,
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
pub fn pin_namespaces(dir: &Path, range: Option<IdRange>) -> Result<Pinned, NetError> {
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
        let step = |what: &str| -> Result<(), NetError> {
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
pub(crate) unsafe fn loopback_up() -> bool {
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
fn bind_ns(source: &str, target: &Path) -> Result<(), NetError> {
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
