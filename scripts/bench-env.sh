# Sourced by the benchmark scripts (bench.sh, load-profile.sh): the release build they
# measure, and a private state dir and containerd namespace of their own.
#   bench_env NAME          builds (unless BENCH_RUNNER names a binary: then its directory's
#                           `bench` is the library's); sets runner, bench, work; exports RUNNER_STATE_DIR and
#                           CONTAINERD_NAMESPACE (runner-NAME-PID)
#   bench_containerd        starts the private containerd; exports CONTAINERD_ADDRESS
#   bench_busybox           builds the busybox test image and imports it
#   bench_stop              removes what runner left in containerd, stops it, removes $work
#   bench_url OUT ERR       waits (10 s) for `runner serve` to print its address in OUT and
#                           prints it; without one, prints ERR (its log) and fails
bench_env() {
  scripts/deps.sh
  if [ -n "${BENCH_RUNNER:-}" ]; then
    # A given binary (a before/after pair): nothing is built; the library rows need this tree's.
    runner=$BENCH_RUNNER
    # Beside it (a kept pair), or where cargo puts it beside a target/release/runner.
    bench="$(dirname "$BENCH_RUNNER")/bench"
    [ -x "$bench" ] || bench="$(dirname "$BENCH_RUNNER")/examples/bench"
    [ -x "$bench" ] || { echo "bench: no bench program beside $BENCH_RUNNER (cargo build --release --example bench)" >&2; exit 1; }
  else
    cargo build --release --locked --bin runner --example bench >/dev/null 2>&1 ||
      cargo build --release --locked --bin runner --example bench
    runner="$PWD/target/release/runner"
    bench="$PWD/target/release/examples/bench"
  fi
  work=$(mktemp -d "/tmp/runner-$1.XXXXXX")
  export RUNNER_STATE_DIR="$work/state" CONTAINERD_NAMESPACE="runner-$1-$$"
}
bench_containerd() {
  "$runner" daemon start >/dev/null
  export CONTAINERD_ADDRESS
  CONTAINERD_ADDRESS=$("$runner" daemon status | sed -n 's/^running (pid [0-9]*) at //p')
}
bench_busybox() {
  images/busybox/build.sh "$work/busybox.tar" oci >/dev/null
  "$runner" image import "$work/busybox.tar" >/dev/null
}
bench_stop() {
  "$runner" gc >/dev/null 2>&1 || true
  "$runner" daemon stop >/dev/null 2>&1 || true
  rm -rf "$work"
}
bench_url() {
  local url=""
  for _ in $(seq 1 200); do
    url=$(sed -n 's/^listening on //p' "$1" 2>/dev/null)
    [ -n "$url" ] && break
    sleep 0.05
  done
  [ -n "$url" ] || { cat "$2" >&2; return 1; }
  echo "$url"
}
