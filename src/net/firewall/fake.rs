//! A firewall in memory, for tests of the network layer without root: it keeps what the
//! batches made (sets with their elements, chains with their rule count) and refuses what nft
//! would refuse (a delete of something absent fails the whole batch), so a test can check the
//! outcome of attach, detach and PATCH, and their fallbacks.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nftables::expr::Expression;
use nftables::schema::{FlushObject, NfCmd, NfListObject, NfObject, Nftables};

use super::{Firewall, FirewallError, plan};

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct State {
    pub table: bool,
    /// Set name → its elements (JSON, without timeouts).
    pub sets: BTreeMap<String, BTreeSet<String>>,
    /// Chain name → how many rules.
    pub chains: BTreeMap<String, usize>,
    /// Subnets with iptables' FORWARD pair.
    pub forward: BTreeSet<String>,
    /// Batches applied inside container namespaces.
    pub in_namespaces: Vec<PathBuf>,
    /// Every batch applied on the host, by what it was for.
    pub applied: Vec<String>,
}

#[derive(Debug, Default)]
pub struct Fake {
    pub state: Mutex<State>,
}

fn key(e: &Expression<'static>) -> String {
    serde_json::to_string(&plan::element_key(e)).unwrap_or_default()
}

fn refuse(what: &str, why: String) -> FirewallError {
    FirewallError::Refused {
        what: what.to_string(),
        stderr: format!("Error: Could not process rule: No such file or directory ({why})"),
    }
}

impl Fake {
    pub fn snapshot(&self) -> State {
        self.state.lock().expect("fake firewall").clone()
    }

    /// Elements of a set whose first field is `ip` (a container's).
    pub fn elements_of(&self, set: &str, ip: std::net::Ipv4Addr) -> Vec<String> {
        let st = self.state.lock().expect("fake firewall");
        st.sets
            .get(set)
            .map(|s| s.iter().filter(|e| e.contains(&format!("\"{ip}\""))).cloned().collect())
            .unwrap_or_default()
    }
}

fn step(st: &mut State, what: &str, cmd: &NfCmd<'static>) -> Result<(), FirewallError> {
    match cmd {
        NfCmd::Add(obj) | NfCmd::Create(obj) | NfCmd::Insert(obj) => match obj {
            NfListObject::Table(_) => st.table = true,
            NfListObject::Set(s) => {
                st.sets.entry(s.name.to_string()).or_default();
            }
            NfListObject::Chain(c) => {
                st.chains.entry(c.name.to_string()).or_default();
            }
            NfListObject::Rule(r) => {
                *st.chains
                    .get_mut(r.chain.as_ref())
                    .ok_or_else(|| refuse(what, format!("no chain {}", r.chain)))? += 1;
            }
            NfListObject::Element(e) => {
                let set = st
                    .sets
                    .get_mut(e.name.as_ref())
                    .ok_or_else(|| refuse(what, format!("no set {}", e.name)))?;
                set.extend(e.elem.iter().map(key));
            }
            _ => {}
        },
        NfCmd::Delete(obj) => match obj {
            NfListObject::Table(_) => {
                if !st.table {
                    return Err(refuse(what, "no table".into()));
                }
                st.table = false;
                st.sets.clear();
                st.chains.clear();
            }
            NfListObject::Element(e) => {
                let set = st
                    .sets
                    .get_mut(e.name.as_ref())
                    .ok_or_else(|| refuse(what, format!("no set {}", e.name)))?;
                for el in e.elem.iter() {
                    if !set.remove(&key(el)) {
                        return Err(refuse(what, format!("no element {} in {}", key(el), e.name)));
                    }
                }
            }
            NfListObject::Set(s) => {
                st.sets.remove(s.name.as_ref());
            }
            NfListObject::Chain(c) => {
                st.chains.remove(c.name.as_ref());
            }
            _ => {}
        },
        NfCmd::Flush(FlushObject::Chain(c)) => {
            if let Some(n) = st.chains.get_mut(c.name.as_ref()) {
                *n = 0;
            }
        }
        NfCmd::Flush(FlushObject::Set(s)) => {
            if let Some(set) = st.sets.get_mut(s.name.as_ref()) {
                set.clear();
            }
        }
        _ => {}
    }
    Ok(())
}

impl Firewall for Fake {
    fn apply(&self, what: &str, batch: &Nftables<'static>) -> Result<(), FirewallError> {
        let mut st = self.state.lock().expect("fake firewall");
        // A transaction: on a failure nothing of it stays.
        let mut next = st.clone();
        for obj in batch.objects.iter() {
            if let NfObject::CmdObject(cmd) = obj {
                step(&mut next, what, cmd)?;
            }
        }
        next.applied.push(what.to_string());
        *st = next;
        Ok(())
    }

    fn elements(&self, set: &str) -> Result<Vec<Expression<'static>>, FirewallError> {
        let st = self.state.lock().expect("fake firewall");
        Ok(st
            .sets
            .get(set)
            .map(|s| s.iter().filter_map(|e| serde_json::from_str(e).ok()).collect())
            .unwrap_or_default())
    }

    fn wall_current(&self) -> Result<bool, FirewallError> {
        let st = self.state.lock().expect("fake firewall");
        Ok(st.table && st.sets.contains_key(plan::WALL_MARK))
    }

    fn wall_exists(&self) -> Result<bool, FirewallError> {
        Ok(self.state.lock().expect("fake firewall").table)
    }

    fn forward(&self, subnet: &str, open: bool) -> Result<(), FirewallError> {
        let mut st = self.state.lock().expect("fake firewall");
        if open {
            st.forward.insert(subnet.to_string());
        } else {
            st.forward.remove(subnet);
        }
        Ok(())
    }

    fn apply_in(&self, netns: &Path, _localnet_if: &str, _batch: &Nftables<'static>) -> Result<(), FirewallError> {
        self.state
            .lock()
            .expect("fake firewall")
            .in_namespaces
            .push(netns.to_path_buf());
        Ok(())
    }
}
