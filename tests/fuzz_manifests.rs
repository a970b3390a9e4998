//! The fuzz oracle (`runner::fuzzing::check`) on stable Rust in every CI run: seed manifests
//! mutated deterministically (byte flips, manifest/YAML tokens inserted, lines spliced between
//! seeds, ranges dropped). `fuzz/` runs the same oracle under libFuzzer for longer hunts.
//! RUNNER_FUZZ_ITERATIONS and RUNNER_FUZZ_SEED change the budget and the sequence.

use std::path::PathBuf;

use runner::fuzzing::check;

/// Tokens that reach the interesting branches: refusals, limits, YAML features.
const TOKENS: &[&str] = &[
    "backend: host\n",
    "backend: containerd\n",
    "network: host\n",
    "network: none\n",
    "user: host\n",
    "user: \"0:0\"\n",
    "user: \"4294967295:1\"\n",
    "user: \"1000:1000\"\n",
    "privileged: true\n",
    "capabilities: [SYS_ADMIN]\n",
    "hostPID: true\n",
    "mounts:\n    - {source: /etc, target: /x}\n",
    "mounts:\n    - {source: /tmp, target: /proc/x}\n",
    "mounts:\n    - {source: /tmp, target: /data, readOnly: false}\n",
    "mounts:\n    - {source: ../.., target: /up}\n",
    "workdir: /proc/self/fd/7\n",
    "workdir: /workspace\n",
    "workspace: /tmp\n",
    "workspace: /\n",
    "resources: {memory: 0, cpu: \"0\", pids: 0}\n",
    "resources: {memory: 1Ei, cpu: \"1e309\", pids: -1}\n",
    "resources: {memory: 64Mi, cpu: 500m, pids: 16}\n",
    "timeoutSeconds: 0\n",
    "timeoutSeconds: 18446744073709551615\n",
    "parallelism: 3\n",
    "completions: 5\n",
    "completionMode: Indexed\n",
    "backoffLimit: -1\n",
    "env: {PATH: /x, \"A=B\": c}\n",
    "env:\n    - {name: X, value: \"\\u0000\"}\n",
    "labels: {containerd.io/gc.root: x}\n",
    "setup:\n    commands: [\"true\"]\n",
    "stdin: \"\\u0000\\n\"\n",
    "command: [\"sh\", \"-c\", \"echo hi\"]\n",
    "command: []\n",
    "&a [*a, *a, *a]",
    "*a",
    "<<: {x: 1}\n",
    "!!binary aGk=",
    "---\n",
    "{",
    "}",
    "[",
    ": ",
    "- ",
    "\t",
    "\"",
    "'",
    "#",
    "\u{0}",
    "\u{feff}",
    "\n  ",
    "9999999999999999999999",
    "-0x1",
    "~",
    "null",
];

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*: deterministic for a given seed, good enough to pick mutations.
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// The examples' directory: their relative workspaces and assets resolve there.
fn base() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("manifests/examples")
}

fn seeds() -> Vec<Vec<u8>> {
    let dir = base();
    let mut seeds: Vec<Vec<u8>> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "yaml"))
        .map(|e| std::fs::read(e.path()).unwrap())
        .collect();
    assert!(seeds.len() >= 3, "seed manifests missing under {}", dir.display());
    seeds.sort();
    // One seed touching most of the Job and Environment fields.
    seeds.push(
        b"apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: e}\nspec:\n  image: local/busybox:1.35\n  workdir: /workspace\n  network: none\n  resources: {memory: 64Mi, cpu: 500m, pids: 16}\n  env: {A: b}\n  user: \"1000:1000\"\n  setup:\n    commands: [\"true\"]\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: j, labels: {a: b}}\nspec:\n  environment: e\n  command: [\"sh\", \"-c\", \"true\"]\n  stdin: \"x\"\n  timeoutSeconds: 5\n  completions: 2\n  parallelism: 2\n  completionMode: Indexed\n  backoffLimit: 1\n"
            .to_vec(),
    );
    seeds
}

fn mutate(rng: &mut Rng, input: &[u8], seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..=rng.below(2) {
        let at = rng.below(out.len() + 1);
        match rng.below(6) {
            0 if !out.is_empty() => {
                let i = rng.below(out.len());
                out[i] ^= 1 << rng.below(8);
            }
            1 | 2 => {
                let token = TOKENS[rng.below(TOKENS.len())].as_bytes();
                out.splice(at..at, token.iter().copied());
            }
            3 if !out.is_empty() => {
                let end = (at + rng.below(64)).min(out.len());
                out.drain(at.min(end)..end);
            }
            4 => {
                // A line from another seed, at a line start of this one.
                let other = &seeds[rng.below(seeds.len())];
                let lines: Vec<&[u8]> = other.split(|b| *b == b'\n').collect();
                let line = lines[rng.below(lines.len())];
                let start = out[..at].iter().rposition(|b| *b == b'\n').map_or(0, |p| p + 1);
                let mut piece = line.to_vec();
                piece.push(b'\n');
                out.splice(start..start, piece);
            }
            _ => {
                // Duplicate a range (repeated keys, repeated documents).
                let end = (at + rng.below(128)).min(out.len());
                let piece = out[at.min(end)..end].to_vec();
                out.splice(end..end, piece);
            }
        }
    }
    out
}

#[test]
fn mutated_manifests_never_crash_and_every_accepted_one_is_hardened() {
    let iterations: usize = std::env::var("RUNNER_FUZZ_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4000);
    let seed: u64 = std::env::var("RUNNER_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_1234_abcd_0001);
    let seeds = seeds();
    let dir = base();
    let mut rng = Rng(seed | 1);
    let (mut accepted, mut refused) = (0usize, 0usize);
    for seed_input in &seeds {
        let outcome = check(seed_input, &dir);
        assert!(
            outcome.specs + outcome.host_jobs > 0,
            "a seed manifest is not accepted: {}",
            String::from_utf8_lossy(seed_input)
        );
    }
    for i in 0..iterations {
        let original = &seeds[rng.below(seeds.len())];
        let input = mutate(&mut rng, original, &seeds);
        let outcome = std::panic::catch_unwind(|| check(&input, &dir)).unwrap_or_else(|panic| {
            eprintln!(
                "iteration {i} (RUNNER_FUZZ_SEED={seed}) crashed on:\n{}",
                String::from_utf8_lossy(&input)
            );
            std::panic::resume_unwind(panic)
        });
        if outcome.specs + outcome.host_jobs > 0 {
            accepted += 1;
        }
        if outcome.refused {
            refused += 1;
        }
    }
    // The mutations must reach both sides, or this test checks nothing.
    assert!(
        accepted > iterations / 20,
        "only {accepted} of {iterations} inputs were accepted"
    );
    assert!(
        refused > iterations / 20,
        "only {refused} of {iterations} inputs were refused"
    );
    eprintln!("{iterations} inputs: {accepted} accepted, {refused} refused at parse");
}

#[test]
fn yaml_bombs_are_refused() {
    let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
    for i in 0..12 {
        let prev = if i == 0 { "a".to_string() } else { format!("b{}", i - 1) };
        bomb.push_str(&format!(
            "b{i}: &b{i} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"
        ));
    }
    assert!(check(bomb.as_bytes(), &base()).refused);
    let deep = "[".repeat(100_000);
    assert!(check(deep.as_bytes(), &base()).refused);
}
