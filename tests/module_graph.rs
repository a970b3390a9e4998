//! The dependency rule of the layout (README, "Design notes"): top-level modules import only
//! modules of lower layers, so there is no cycle, and `cli` and `api` never import each other.
//! Read from the `crate::` paths of the sources; `cargo test --test module_graph -- --nocapture`
//! prints the graph.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each top-level module's layer: a module may import only modules of lower layers.
const LAYERS: &[(&str, u32)] = &[
    ("config", 0),
    ("owner", 0),
    ("confined", 0),
    ("signals", 0),
    ("metrics", 0),
    ("manifest", 1),
    ("spec", 2),
    ("fuzzing", 3),
    ("containerd", 3),
    ("net", 3),
    ("image", 4),
    ("runtime", 5),
    ("job", 6),
    ("service", 7),
    ("cli", 8),
    ("api", 8),
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a source file belongs to (`None`: lib.rs, main.rs).
fn module_of(file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src()).unwrap();
    let first = rel.components().next()?.as_os_str().to_string_lossy().to_string();
    let name = first.strip_suffix(".rs").unwrap_or(&first).to_string();
    (name != "lib" && name != "main").then_some(name)
}

/// The modules a source names as `crate::NAME` (also inside `use crate::{a, b}` groups), with
/// comments left out.
fn imports(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(i) = rest.find("crate::") {
            rest = &rest[i + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                // `use crate::{a::x, b}`: the group may span lines; take what this line has.
                for item in group.split(',') {
                    let name: String = item
                        .trim()
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if !name.is_empty() {
                        out.insert(name);
                    }
                }
            } else {
                let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                if !name.is_empty() {
                    out.insert(name);
                }
            }
        }
    }
    out
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let Some(module) = module_of(&file) else { continue };
        let text = std::fs::read_to_string(&file).unwrap();
        let deps = graph.entry(module.clone()).or_default();
        deps.extend(imports(&text).into_iter().filter(|d| *d != module));
    }
    graph
}

#[test]
fn top_level_modules_import_only_lower_layers() {
    let graph = graph();
    let layer: BTreeMap<&str, u32> = LAYERS.iter().copied().collect();
    println!("module graph (layer: module -> imports):");
    for (module, deps) in &graph {
        let deps: Vec<&str> = deps.iter().map(String::as_str).collect();
        println!(
            "  {}: {module} -> {}",
            layer.get(module.as_str()).map_or("?".into(), |l| l.to_string()),
            deps.join(", ")
        );
    }
    let mut broken = Vec::new();
    for (module, deps) in &graph {
        let Some(&from) = layer.get(module.as_str()) else {
            broken.push(format!(
                "{module}: not in LAYERS (give it a layer in tests/module_graph.rs)"
            ));
            continue;
        };
        for dep in deps {
            match layer.get(dep.as_str()) {
                None => broken.push(format!("{module} -> {dep}: {dep} is not a top-level module in LAYERS")),
                Some(&to) if to >= from => broken.push(format!(
                    "{module} (layer {from}) -> {dep} (layer {to}): imports upward or sideways"
                )),
                Some(_) => {}
            }
        }
    }
    assert!(
        broken.is_empty(),
        "the dependency rule is broken:\n{}",
        broken.join("\n")
    );
}

#[test]
fn the_scanner_sees_plain_and_grouped_imports() {
    let found = imports("use crate::a::X;\nuse crate::{b, c::Y};\n// crate::commented\nlet x = crate::d::f();");
    assert_eq!(found, ["a", "b", "c", "d"].into_iter().map(String::from).collect());
}
