//! Any bytes as a manifest: parse → bind → resolve → spec build; an accepted manifest must
//! yield a hardened spec (`runner::fuzzing::check` panics otherwise).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Relative workspaces and assets of the seed corpus resolve against the examples.
    let base = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/examples");
    runner::fuzzing::check(data, &base);
});
