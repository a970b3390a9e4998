//! Every manifest under `manifests/` → `tests/golden/<path>.json`: the OCI spec of each
//! containerd job, and the plan of each host job. `UPDATE_GOLDEN=1 cargo test --test golden`
//! rewrites the files; review the diff like code.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use runner::manifest::{self, Backend};
use runner::spec::{self, HostEnv};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Fixed host facts, so the output does not depend on who runs the test.
fn host() -> HostEnv {
    HostEnv {
        uid: 0,
        gid: 0,
        huid: None,
        hgid: None,
        state_dir: PathBuf::from("/var/lib/runner"),
        arch: "x86_64".into(),
        vars: BTreeMap::new(),
        nofile_hard: 1 << 20,
    }
}

fn manifests(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            manifests(&path, out);
        } else if matches!(path.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")) {
            out.push(path);
        }
    }
}

/// What a manifest file turns into, with the checkout's absolute path replaced by `$REPO`.
fn render(file: &Path) -> serde_json::Value {
    let set = manifest::load_file(file, None).unwrap_or_else(|e| panic!("{e}"));
    let host = host();
    let mut jobs = serde_json::Map::new();
    for job in &set.jobs {
        let bound = set.bind(job, None).unwrap_or_else(|e| panic!("{e}"));
        let plan = spec::resolve(&bound, &host).unwrap_or_else(|e| panic!("{e}"));
        let value = match bound.backend {
            Backend::Containerd => {
                let built = spec::build(&plan, &host).unwrap_or_else(|e| panic!("{e}"));
                let violations = spec::hardening::violations(&built, plan.env().host_users);
                assert!(violations.is_empty(), "{}: {violations:?}", file.display());
                spec::to_json(&built).unwrap()
            }
            Backend::Host => serde_json::json!({
                "backend": "host",
                "argv": job.command.argv(),
                "setup": bound.env.setup,
                "workspace": plan.workspace,
                "env": bound.env.env,
                "assets": plan.assets.iter().map(|a| (a.target.clone(), a.source.clone())).collect::<BTreeMap<_, _>>(),
            }),
        };
        jobs.insert(job.name.clone(), value);
    }
    let text = serde_json::to_string(&jobs).unwrap();
    let root = std::fs::canonicalize(repo()).unwrap();
    serde_json::from_str(&text.replace(&*root.to_string_lossy(), "$REPO")).unwrap()
}

#[test]
fn every_manifest_matches_its_golden_file() {
    let mut files = Vec::new();
    manifests(&repo().join("manifests"), &mut files);
    assert!(files.len() >= 3, "expected the example manifests, found {files:?}");
    let update = std::env::var_os("UPDATE_GOLDEN").is_some();
    let mut failures = Vec::new();
    for file in files {
        let rel = file.strip_prefix(repo().join("manifests")).unwrap();
        let golden = repo().join("tests/golden").join(rel).with_extension("json");
        let actual = render(&file);
        if update {
            std::fs::create_dir_all(golden.parent().unwrap()).unwrap();
            std::fs::write(&golden, serde_json::to_string_pretty(&actual).unwrap() + "\n").unwrap();
            continue;
        }
        let expected: serde_json::Value = match std::fs::read_to_string(&golden) {
            Ok(text) => serde_json::from_str(&text).unwrap(),
            Err(e) => {
                failures.push(format!("{}: {e} (run with UPDATE_GOLDEN=1)", golden.display()));
                continue;
            }
        };
        if expected != actual {
            failures.push(format!(
                "{} differs from {} (run with UPDATE_GOLDEN=1 and review the diff)",
                file.display(),
                golden.display()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_eval_example_spec_has_the_hardened_defaults() {
    let value = render(&repo().join("manifests/examples/eval.yaml"));
    let spec = &value["eval-sum"];
    assert_eq!(spec["process"]["noNewPrivileges"], true);
    assert_eq!(spec["linux"]["seccomp"]["defaultAction"], "SCMP_ACT_ERRNO");
    assert_eq!(spec["process"]["capabilities"]["ambient"], serde_json::json!([]));
    assert_eq!(spec["process"]["capabilities"]["inheritable"], serde_json::json!([]));
    assert_eq!(spec["linux"]["resources"]["devices"][0]["allow"], false);
    assert!(
        spec["linux"]["maskedPaths"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p == "/proc/kcore")
    );
    assert_eq!(spec["linux"]["resources"]["memory"]["limit"], 256 << 20);
    assert_eq!(spec["linux"]["resources"]["pids"]["limit"], 64);
    let fixtures = spec["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["destination"] == "/static/fixtures")
        .expect("static asset mount");
    assert!(fixtures["options"].as_array().unwrap().iter().any(|o| o == "ro"));
}
