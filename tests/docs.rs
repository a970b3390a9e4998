//! The book and the README say what the code does: the generated tables (every global option
//! with its variable and default; every HTTP route) match their source, and every command block
//! is either run by CI (`tests/docs/run.sh`) or says why it cannot be. `UPDATE_DOCS=1 cargo test
//! --test docs` rewrites the generated tables.

use std::path::{Path, PathBuf};

use clap::CommandFactory;

mod common;

use common::check_generated;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

#[test]
fn the_configuration_table_lists_every_global_option() {
    let command = runner::cli::Cli::command();
    // Grouped under their headings, in the order the headings first appear.
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for arg in command
        .get_arguments()
        .filter(|a| a.is_global_set() && a.get_long().is_some())
    {
        let long = arg.get_long().unwrap();
        if long == "runner-exe" {
            continue; // internal: the binary supervisors run (tests)
        }
        let heading = arg.get_help_heading().unwrap_or("Other").to_string();
        let value = arg
            .get_value_names()
            .map(|v| format!(" {}", v.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(" ")))
            .unwrap_or_default();
        let env = arg
            .get_env()
            .map(|e| format!("`{}`", e.to_string_lossy()))
            .unwrap_or_default();
        let default: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().to_string())
            .collect();
        let default = if default.is_empty() {
            String::new()
        } else {
            format!("`{}`", default.join(","))
        };
        let help = arg
            .get_long_help()
            .or(arg.get_help())
            .map(|h| h.to_string())
            .unwrap_or_default();
        let row = format!("| `--{long}{value}` | {env} | {default} | {} |", cell(&help));
        match groups.iter_mut().find(|(h, _)| *h == heading) {
            Some((_, rows)) => rows.push(row),
            None => groups.push((heading, vec![row])),
        }
    }
    let mut rows = String::from("| option | environment | default | what |\n|---|---|---|---|\n");
    for (heading, group) in groups {
        rows.push_str(&format!("| **{heading}** | | | |\n"));
        for row in group {
            rows.push_str(&row);
            rows.push('\n');
        }
    }
    check_generated(&root().join("docs/reference/configuration.md"), "options", &rows);
}

#[test]
fn the_api_table_lists_every_route() {
    let doc = runner::api::openapi();
    let mut rows = String::from("| method | path | what | query |\n|---|---|---|---|\n");
    for (path, methods) in doc["paths"].as_object().unwrap() {
        for (method, op) in methods.as_object().unwrap() {
            let query: Vec<String> = op["parameters"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["in"] == "query")
                .map(|p| format!("`{}`", p["name"].as_str().unwrap()))
                .collect();
            rows.push_str(&format!(
                "| {} | `{path}` | {} | {} |\n",
                method.to_uppercase(),
                cell(op["summary"].as_str().unwrap_or_default()),
                query.join(", ")
            ));
        }
    }
    check_generated(&root().join("docs/reference/api.md"), "routes", &rows);
}

/// Every page: README.md and docs/**/*.md.
fn pages() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
    }
    let mut out = vec![root().join("README.md")];
    walk(&root().join("docs"), &mut out);
    out.sort();
    out
}

/// Each command block (```sh, ```bash, ```console) comes right after `<!-- ci: run -->` (run by
/// tests/docs/run.sh) or `<!-- ci: skip: WHY -->`.
#[test]
fn every_command_block_is_run_or_says_why_not() {
    let mut unmarked = Vec::new();
    let mut runs = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let mut in_block = false;
        for (i, line) in lines.iter().enumerate() {
            if line.starts_with("```") {
                let opening = !in_block;
                in_block = !in_block;
                let lang = line.trim_start_matches('`').trim();
                if !opening || !matches!(lang, "sh" | "bash" | "console" | "shell") {
                    continue;
                }
                let marker = i.checked_sub(1).map(|j| lines[j].trim()).unwrap_or("");
                if marker == "<!-- ci: run -->" {
                    runs += 1;
                } else if !(marker.starts_with("<!-- ci: skip: ") && marker.len() > "<!-- ci: skip:  -->".len()) {
                    unmarked.push(format!("{}:{}", page.strip_prefix(root()).unwrap().display(), i + 1));
                }
            }
        }
    }
    assert!(
        unmarked.is_empty(),
        "command blocks with neither <!-- ci: run --> nor <!-- ci: skip: WHY --> before them:\n{}",
        unmarked.join("\n")
    );
    assert!(runs >= 3, "only {runs} blocks run");
}

/// Links between pages point at pages that exist (mkdocs --strict checks the book's; this
/// checks the README's too, without mkdocs).
#[test]
fn links_between_pages_resolve() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let dir = page.parent().unwrap();
        let mut rest = text.as_str();
        while let Some(i) = rest.find("](") {
            rest = &rest[i + 2..];
            let target = &rest[..rest.find(')').unwrap_or(0)];
            let file = target.split('#').next().unwrap_or("");
            if file.is_empty() || file.contains("://") || !file.ends_with(".md") {
                continue;
            }
            if !dir.join(file).exists() {
                broken.push(format!("{}: {target}", page.strip_prefix(root()).unwrap().display()));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "links to pages that do not exist:\n{}",
        broken.join("\n")
    );
}
