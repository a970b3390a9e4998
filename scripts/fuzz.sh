#!/usr/bin/env bash
# libFuzzer over the manifest → spec pipeline (fuzz/fuzz_targets/manifest.rs), seeded with the
# example manifests. Needs a nightly toolchain and cargo-fuzz (installed here if missing).
# CI runs the same oracle on stable (tests/fuzz_manifests.rs); this is for longer hunts.
# Usage: scripts/fuzz.sh [SECONDS]   (default 60)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
corpus=fuzz/corpus/manifest
mkdir -p "$corpus"
cp manifests/examples/*.yaml "$corpus/"
cargo +nightly fuzz run manifest "$corpus" -- -max_total_time="$seconds" -max_len=16384 -dict=fuzz/manifest.dict
