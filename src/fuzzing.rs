//! The fuzz oracle shared by `fuzz/` (cargo fuzz) and the stable mutation test in
//! `tests/fuzz_manifests.rs`: any bytes go through parse → bind → resolve → spec build, and
//! whatever is accepted must yield a spec the hardening predicate passes. Rejections are fine
//! (they are the point of most inputs); a panic, an empty error message or an unhardened spec
//! is a bug. Resolution only reads the host (canonicalize, stat), so fuzzing writes nothing.

use std::path::Path;
use std::sync::OnceLock;

use crate::manifest::{self, Backend};
use crate::spec::{self, HostEnv};

/// What one input came to.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Specs built (jobs accepted on the containerd backend).
    pub specs: usize,
    /// Jobs accepted on the host backend (no OCI spec).
    pub host_jobs: usize,
    /// Whether the input was refused before any job was planned.
    pub refused: bool,
}

fn host() -> &'static HostEnv {
    static HOST: OnceLock<HostEnv> = OnceLock::new();
    HOST.get_or_init(|| HostEnv::detect(Path::new("/var/lib/runner-fuzz-state")))
}

/// Run one input through the whole pipeline, relative paths taken from `base`; panics on a
/// bug (see the module docs).
pub fn check(data: &[u8], base: &Path) -> Outcome {
    let Ok(text) = std::str::from_utf8(data) else {
        return Outcome {
            refused: true,
            ..Outcome::default()
        };
    };
    let set = match manifest::parse_str(text, base, None) {
        Ok(set) => set,
        Err(e) => {
            assert!(!e.to_string().trim().is_empty(), "empty parse error for {text:?}");
            return Outcome {
                refused: true,
                ..Outcome::default()
            };
        }
    };
    let mut outcome = Outcome::default();
    for job in &set.jobs {
        let bound = match set.bind(job, None) {
            Ok(b) => b,
            Err(e) => {
                assert!(!e.to_string().trim().is_empty(), "empty bind error for {text:?}");
                continue;
            }
        };
        let plan = match spec::resolve(&bound, host()) {
            Ok(p) => p,
            Err(e) => {
                assert!(!e.to_string().trim().is_empty(), "empty resolve error for {text:?}");
                continue;
            }
        };
        if bound.backend == Backend::Host {
            outcome.host_jobs += 1;
            continue;
        }
        match spec::build(&plan, host()) {
            Ok(built) => {
                let violations = spec::hardening::violations(&built, plan.env().host_users);
                assert!(
                    violations.is_empty(),
                    "accepted manifest built an unhardened spec: {violations:?}\ninput: {text:?}"
                );
                outcome.specs += 1;
            }
            Err(e) => assert!(!e.to_string().trim().is_empty(), "empty build error for {text:?}"),
        }
    }
    outcome
}
