//! The host's firewall as the network layer sees it: one trait, an nftables implementation
//! (typed objects through the `nftables` crate to `nft -j`, state read back typed, set
//! existence and resolver-time elements through our own netlink), and an in-memory fake for
//! tests (`fake`). What the wall is, and what each change sends, is `plan`: pure.
//!
//! Structural changes (the wall, a network's registration, a container's CIDR elements) are
//! per container, never per packet or per answer, and run under the host-wide network lock:
//! the host runs at most one `nft` of ours at a time. The resolver's per-answer elements never
//! start a process (`netlink::apply_set_changes`).

pub mod fake;
pub mod nft;
pub mod plan;

use std::path::Path;

use nftables::expr::Expression;
use nftables::schema::Nftables;

pub use plan::TABLE;

#[derive(Debug, thiserror::Error)]
pub enum FirewallError {
    #[error("running {program} (install nftables / iptables): {source}")]
    Spawn {
        program: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("nft refused the change ({what}): {stderr}")]
    Refused { what: String, stderr: String },
    #[error("nft's JSON for {what} could not be read: {source}")]
    Unreadable {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("iptables {action} {rule} failed")]
    Iptables { action: &'static str, rule: String },
    #[error("netlink ({what}): {source}")]
    Netlink {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("entering the container's network namespace {path}: {source}")]
    Namespace {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl FirewallError {
    /// Whether the change failed because something it names is not there (a wall made again
    /// since, say): the caller reads the state back and retries with what exists.
    pub fn is_missing(&self) -> bool {
        matches!(self, FirewallError::Refused { stderr, .. } if stderr.contains("No such file") || stderr.contains("does not exist"))
    }
}

/// What the network layer asks of the host's firewall.
pub trait Firewall: Send + Sync {
    /// Apply a batch as one transaction (all of it or none).
    fn apply(&self, what: &str, batch: &Nftables<'static>) -> Result<(), FirewallError>;
    /// The elements of one of the wall's sets, typed (empty when there is no wall).
    fn elements(&self, set: &str) -> Result<Vec<Expression<'static>>, FirewallError>;
    /// Whether the current wall stands (its version's mark is there).
    fn wall_current(&self) -> Result<bool, FirewallError>;
    /// Whether any table of the wall's name stands (of any version).
    fn wall_exists(&self) -> Result<bool, FirewallError>;
    /// iptables' FORWARD pair for a subnet (they only undo a DROP policy, such as Docker's):
    /// insert (`open`) or remove. A host without iptables has nothing to undo.
    fn forward(&self, subnet: &str, open: bool) -> Result<(), FirewallError>;
    /// Apply a batch inside the network namespace pinned at `netns`, after setting
    /// `route_localnet` on `localnet_if` there.
    fn apply_in(&self, netns: &Path, localnet_if: &str, batch: &Nftables<'static>) -> Result<(), FirewallError>;
}
