//! Names relative to the root: parsed and checked before any syscall.

use super::*;

/// A caller's path, split into components with `..`, NUL and empty components dealt with.
pub(super) struct RelPath<'a> {
    pub(super) comps: Vec<&'a [u8]>,
}

impl<'a> RelPath<'a> {
    pub(super) fn parse(rel: &'a str) -> Result<Self> {
        let comps = split_components(rel.as_bytes()).map_err(|reason| ConfinedError::InvalidPath {
            path: rel.to_string(),
            reason,
        })?;
        Ok(RelPath { comps })
    }

    pub(super) fn joined(&self) -> Vec<u8> {
        join(&self.comps)
    }

    pub(super) fn shown(&self) -> String {
        String::from_utf8_lossy(&self.joined()).into_owned()
    }
}

/// Splits a relative name; leading, doubled and trailing `/` and `.` components vanish.
pub(super) fn split_components(raw: &[u8]) -> Result<Vec<&[u8]>, &'static str> {
    if raw.contains(&0) {
        return Err("contains a NUL byte");
    }
    let mut comps = Vec::new();
    for comp in raw.split(|&b| b == b'/') {
        match comp {
            b"" | b"." => {}
            b".." => return Err("has a `..` component"),
            comp => comps.push(comp),
        }
    }
    Ok(comps)
}

/// Components joined with `/`; `.` (the starting directory) when there are none.
pub(super) fn join<C: AsRef<[u8]>>(comps: &[C]) -> Vec<u8> {
    if comps.is_empty() {
        return b".".to_vec();
    }
    let mut out = Vec::new();
    for (i, comp) in comps.iter().enumerate() {
        if i > 0 {
            out.push(b'/');
        }
        out.extend_from_slice(comp.as_ref());
    }
    out
}

pub(super) fn child_shown(parent: &str, name: &[u8]) -> String {
    let name = String::from_utf8_lossy(name);
    if parent.is_empty() || parent == "." {
        name.into_owned()
    } else {
        format!("{parent}/{name}")
    }
}
