//! Where the network layer's host-wide files are, all beneath `NetPaths::dir` (`Config`'s).

use std::path::PathBuf;

use crate::config::NetPaths;

impl NetPaths {
    /// Held (flock) by every change of the host's network state: CNI, the wall, the name
    /// files, the ports, the resolver's start and stop.
    pub fn lock_file(&self) -> PathBuf {
        self.dir.join("lock")
    }

    /// The published ports, one line each.
    pub fn ports_file(&self) -> PathBuf {
        self.dir.join("ports")
    }

    /// The resolver's policies as files, one per container address: what a resolver that
    /// (re)starts loads. The running resolver keeps them in memory.
    pub fn policy_dir(&self) -> PathBuf {
        self.dir.join("dns")
    }

    /// Held (flock) by the live resolver.
    pub fn resolver_lock(&self) -> PathBuf {
        self.dir.join("resolver.lock")
    }

    /// The live resolver's PID and DNS port (written once it listens).
    pub fn resolver_pid(&self) -> PathBuf {
        self.dir.join("resolver.pid")
    }

    pub fn resolver_port(&self) -> PathBuf {
        self.dir.join("resolver.port")
    }

    /// Its control socket (root only, 0600): attach, detach and patch messages.
    pub fn resolver_socket(&self) -> PathBuf {
        self.dir.join("resolver.sock")
    }

    /// Its log (rotated at `ResolverLimits::log_bytes`, one old file kept as `.1`).
    pub fn resolver_log(&self) -> PathBuf {
        self.dir.join("resolver.log")
    }
}
