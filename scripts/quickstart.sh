#!/usr/bin/env bash
# From a fresh machine to a finished job: install dependencies, build runner, run the
# example jobs end to end and print their results.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh
cargo build --release --locked
RUNNER=target/release/runner
export RUNNER_STATE_DIR="${RUNNER_STATE_DIR:-$PWD/.runner-state}"

echo "== runner validate"
for f in manifests/examples/*.yaml; do "$RUNNER" validate -f "$f"; done

echo "== hello (host backend)"
"$RUNNER" apply -f manifests/examples/hello.yaml

echo "== eval with setup and static assets (host backend)"
"$RUNNER" apply -f manifests/examples/eval.yaml --backend host -o wide

echo "== the hardened container spec of the eval job"
"$RUNNER" spec -f manifests/examples/eval.yaml | head -n 20
echo "..."
