//! Records the commit `runner version` reports: `git rev-parse` of the checkout being built,
//! marked `-dirty` when it has changes; "unknown" outside a git checkout (a crate tarball).

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    let suffix = if dirty { "-dirty" } else { "" };
    println!("cargo:rustc-env=RUNNER_COMMIT={commit}{suffix}");
    // Rebuilt when HEAD moves (a commit, a checkout) or the index changes (staged edits);
    // `--git-path` finds each file in a worktree too. A file that is not there (a packed ref)
    // is not named: cargo would run this script on every build.
    let mut watched = vec!["HEAD".to_string(), "index".to_string(), "packed-refs".to_string()];
    watched.extend(git(&["symbolic-ref", "-q", "HEAD"]));
    for name in watched {
        if let Some(path) = git(&["rev-parse", "--git-path", &name])
            && std::path::Path::new(&path).exists()
        {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
