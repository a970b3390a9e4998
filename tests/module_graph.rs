//! The dependency rule of the layout (docs/design/layout.md): top-level modules import only
//! modules of lower layers, so there is no cycle, and `cli` and `api` never import each other.
//! Read from the `crate::` paths of the sources; `cargo test --test module_graph -- --nocapture`
//! prints the graph.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

mod common;

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

/// The lines of a source before its test module (tests may sit beside what they test).
fn code_lines(text: &str) -> usize {
    let lines: Vec<&str> = text.lines().collect();
    lines
        .windows(2)
        .position(|w| w[0].trim() == "#[cfg(test)]" && w[1].trim_start().starts_with("mod tests"))
        .unwrap_or(lines.len())
}

/// No source file is over 1,000 lines (outside its tests): a file that grows past it holds
/// several parts, which get a module of their own.
#[test]
fn no_source_file_is_over_a_thousand_lines() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let n = code_lines(&std::fs::read_to_string(f).unwrap());
            (n > 1000).then(|| format!("{}: {n} lines", f.strip_prefix(src()).unwrap().display()))
        })
        .collect();
    long.sort();
    assert!(
        long.is_empty(),
        "split these into modules of their parts:\n{}",
        long.join("\n")
    );
}

/// The sibling modules of `dir` a file of it imports (`super::x`, `crate::<path>::x`), with
/// comments left out. `mod.rs` is the parent, not a sibling.
fn sibling_imports(dir: &Path, text: &str) -> BTreeSet<String> {
    // Outside src (a test's own tree) only `super::` paths count.
    let crate_path = match dir.strip_prefix(src()) {
        Ok(rel) => format!("crate::{}::", rel.to_string_lossy().replace('/', "::")),
        Err(_) => "super::".to_string(),
    };
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        for prefix in ["super::", crate_path.as_str()] {
            let mut rest = code;
            while let Some(i) = rest.find(prefix) {
                rest = &rest[i + prefix.len()..];
                let names: Vec<&str> = match rest.strip_prefix('{') {
                    Some(group) => group.split(',').collect(),
                    None => vec![rest],
                };
                for item in names {
                    let name: String = item
                        .trim()
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if dir.join(format!("{name}.rs")).exists() || dir.join(&name).join("mod.rs").exists() {
                        out.insert(name);
                    }
                }
            }
        }
    }
    out
}

/// A cycle among the sibling modules of `dir`, if there is one.
fn sibling_cycle(dir: &Path) -> Option<Vec<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        let (name, files) = if path.is_dir() {
            let mut files = Vec::new();
            rust_files(&path, &mut files);
            // A directory module's own files import their parent's siblings as `super::super::`
            // or by crate path; only its mod.rs and crate paths are read here.
            (
                entry.file_name().to_string_lossy().to_string(),
                vec![path.join("mod.rs")],
            )
        } else if path.extension().is_some_and(|e| e == "rs") && path.file_name().unwrap() != "mod.rs" {
            (
                path.file_stem().unwrap().to_string_lossy().to_string(),
                vec![path.clone()],
            )
        } else {
            continue;
        };
        let deps = graph.entry(name.clone()).or_default();
        for file in files.iter().filter(|f| f.exists()) {
            let text = std::fs::read_to_string(file).unwrap();
            let text = &text[..text
                .lines()
                .take(code_lines(&text))
                .map(|l| l.len() + 1)
                .sum::<usize>()
                .min(text.len())];
            deps.extend(sibling_imports(dir, text).into_iter().filter(|d| *d != name));
        }
    }
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for dep in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(dep, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|n| visit(n, &graph, &mut Vec::new(), &mut done))
}

/// Inside the service layer, and inside sessions, modules import each other one way (what
/// two need is in a third): jobs and reconcile, resident and shell once imported each other.
#[test]
fn service_modules_import_each_other_without_cycles() {
    for dir in ["service", "service/sessions", "net", "confined", "manifest"] {
        let cycle = sibling_cycle(&src().join(dir));
        assert!(cycle.is_none(), "{dir}: {}", cycle.unwrap().join(" -> "));
    }
}

/// The HTTP face parses and answers: no process-global state and no shell scripts in `api/`
/// (the protocols' state and their scripts live with the session, in `service/`).
#[test]
fn api_has_no_session_logic() {
    let mut files = Vec::new();
    rust_files(&src().join("api"), &mut files);
    let mut found = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            let global_state = code.trim_start().starts_with("static ")
                || code.contains(" static ") && (code.contains("Mutex") || code.contains("Lock"));
            let script = ["; then", "; do", "\\nfi", "trap '", "$(", "exec sh", "sh -c '"]
                .iter()
                .any(|s| code.contains(s));
            if global_state || script {
                found.push(format!("{}:{}: {}", file.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(found.is_empty(), "session logic in api/:\n{}", found.join("\n"));
}

#[test]
fn the_sibling_scanner_sees_super_and_crate_paths() {
    let dir = src().join("service");
    let found = sibling_imports(
        &dir,
        "use super::{jobs, Context};\nuse crate::service::pools::x;\n// super::logs\n",
    );
    assert_eq!(found, ["jobs", "pools"].into_iter().map(String::from).collect());
    // A cycle is found where there is one, through a directory module too.
    let tree = tempfile::tempdir().unwrap();
    std::fs::write(tree.path().join("a.rs"), "use super::b::X;\n").unwrap();
    std::fs::create_dir(tree.path().join("b")).unwrap();
    std::fs::write(tree.path().join("b/mod.rs"), "use super::{c, d};\n").unwrap();
    std::fs::write(tree.path().join("c.rs"), "pub fn f() { super::a::g() }\n").unwrap();
    std::fs::write(tree.path().join("d.rs"), "").unwrap();
    assert_eq!(sibling_cycle(tree.path()).unwrap(), ["a", "b", "c", "a"]);
    std::fs::write(tree.path().join("c.rs"), "").unwrap();
    assert_eq!(sibling_cycle(tree.path()), None);
}

/// docs/design/layout.md shows the layers as the sources have them (generated) and names every
/// entry of src/ in its tree.
#[test]
fn the_layout_notes_match_the_tree() {
    let graph = graph();
    let mut by_layer: BTreeMap<u32, Vec<&str>> = BTreeMap::new();
    for (module, layer) in LAYERS {
        if graph.contains_key(*module) {
            by_layer.entry(*layer).or_default().push(module);
        }
    }
    let mut picture = String::from("```\n");
    for (layer, modules) in by_layer.iter().rev() {
        let below: BTreeSet<&str> = modules
            .iter()
            .flat_map(|m| graph[*m].iter().map(String::as_str))
            .collect();
        picture.push_str(&format!(
            "{layer}  {:<42} imports {}\n",
            modules.join("  "),
            if below.is_empty() {
                "nothing of ours".to_string()
            } else {
                below.into_iter().collect::<Vec<_>>().join(", ")
            }
        ));
    }
    picture.push_str("```\n");
    let notes = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/design/layout.md");
    common::check_generated(&notes, "layers", &picture);
    let text = std::fs::read_to_string(&notes).unwrap();
    let missing: Vec<String> = std::fs::read_dir(src())
        .unwrap()
        .flatten()
        .map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            if e.path().is_dir() {
                format!("src/{name}/")
            } else {
                format!("src/{name}")
            }
        })
        .filter(|entry| !text.contains(entry.as_str()))
        .collect();
    assert!(missing.is_empty(), "docs/design/layout.md does not name {missing:?}");
}
