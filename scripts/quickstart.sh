#!/usr/bin/env bash
# From a fresh machine to a finished containerized job: install dependencies, build runner,
# build and import the Python image (debootstrap; cached after the first time), and run the
# example Python job in a hardened container on runner's private containerd (started on
# first use when no system containerd answers). Then the other examples.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh
# RUNNER_BUILD_PROFILE=dev: the test suite runs this on the binary it already built (a second,
# optimised build of the whole tree was half of CI's time); a newcomer gets the release build.
profile="${RUNNER_BUILD_PROFILE:-release}"
cargo build --profile "$profile" --locked
case "$profile" in dev) out=debug ;; *) out="$profile" ;; esac
RUNNER="${CARGO_TARGET_DIR:-$PWD/target}/$out/runner"
export RUNNER_STATE_DIR="${RUNNER_STATE_DIR:-/var/lib/runner}"

echo "== images"
images/python/build.sh /tmp/runner-python.tar
images/busybox/build.sh /tmp/runner-busybox.tar
"$RUNNER" image import /tmp/runner-python.tar
"$RUNNER" image import /tmp/runner-busybox.tar
"$RUNNER" image ls

echo "== validate"
for f in manifests/examples/*.yaml; do "$RUNNER" validate -f "$f"; done

echo "== a Python job in a container (no network, 512Mi, half a core, uid 1000)"
"$RUNNER" apply --replace -f manifests/examples/python.yaml

echo "== an evaluation: setup commands, static assets, stdin (container)"
"$RUNNER" apply --replace -f manifests/examples/eval.yaml -o wide

echo "== a trusted job on the host backend"
"$RUNNER" apply --replace -f manifests/examples/hello.yaml

echo
echo "runner's private containerd keeps running for the next jobs; stop it with: $RUNNER daemon stop"
