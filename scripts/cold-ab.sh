#!/usr/bin/env bash
# Cold sessions over HTTP from two or more release binaries, measured in one window: one
# `runner serve` per binary on one private containerd, sessions created in turn (A B A B ...,
# the order flipped every block), each deleted and a pause before the next; prints per
# binary and image the median create and create -> first shell answer, and the median of the
# paired differences against the first binary, with `ctr run --rm` before and after.
# What decides "did a change make cold starts slower": a host's speed drifts by a third over
# a day, two runs an hour apart cannot say; one window alternating can.
# Usage: scripts/cold-ab.sh N DIR...   (each DIR holds a `runner`; N sessions per binary and
#        image; env: BLOCK (5) sessions in a row, PAUSE_MS (300) after each delete,
#        ENV_<i>="VAR=value ..." for the i-th server, e.g. ENV_1="RUNNER_WARM_CGROUP_ATTACH=off")
# Binaries older than 2026-11-26 probe the host's user-namespace leases one by one, so on a
# host with many (`ls /run/runner/userns | wc -l`) their creates pay for it: give each such
# server a lease dir of its own (ENV_0="RUNNER_USERNS_DIR=/run/runner-ab-0"), on a test host
# only (its ranges may then overlap those of other live containers).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 3 ] || { echo "usage: $0 N DIR DIR [DIR...]" >&2; exit 2; }
n=$1; shift; dirs=("$@")
for d in "${dirs[@]}"; do [ -x "$d/runner" ] || { echo "$d/runner: not an executable" >&2; exit 2; }; done
BENCH_RUNNER="$(cd "${dirs[0]}" && pwd)/runner"
export BENCH_RUNNER
# shellcheck source=scripts/bench-env.sh
. scripts/bench-env.sh
bench_env coldab
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null || true; done
  # Each server's namespace, and ctr's: what they left in containerd, and the cgroup parents
  # runc leaves (runner gc removes its own; ctr's are under /NAMESPACE, empty by now).
  for i in "${!pids[@]}"; do
    RUNNER_STATE_DIR="$work/state-$i" CONTAINERD_NAMESPACE="$CONTAINERD_NAMESPACE-$i" "$runner" gc >/dev/null 2>&1 || true
  done
  for h in /sys/fs/cgroup/*/ /sys/fs/cgroup/; do rmdir "$h$CONTAINERD_NAMESPACE-ctr" 2>/dev/null || true; done
  bench_stop
}
trap cleanup EXIT
bench_containerd
images/busybox/build.sh "$work/busybox.tar" oci >/dev/null
images/python/build.sh "$work/python.tar" oci >/dev/null
echo "cold-ab-token-$$-0123456789abcdef" > "$work/token"
urls=()
for i in "${!dirs[@]}"; do
  d=${dirs[$i]}
  # Each server its own state dir and namespace (their binaries may differ in their records).
  dir_env=(RUNNER_STATE_DIR="$work/state-$i" CONTAINERD_NAMESPACE="$CONTAINERD_NAMESPACE-$i")
  extra=ENV_$i
  read -r -a extra_env <<< "${!extra:-}"
  env "${dir_env[@]}" "$d/runner" image import "$work/busybox.tar" >/dev/null
  env "${dir_env[@]}" "$d/runner" image import "$work/python.tar" >/dev/null
  env "${dir_env[@]}" "${extra_env[@]}" "$d/runner" serve --listen 127.0.0.1:0 --token-file "$work/token" \
    > "$work/serve$i.out" 2>"$work/serve$i.err" &
  pids+=($!)
  for _ in $(seq 1 100); do grep -q listening "$work/serve$i.out" 2>/dev/null && break; sleep 0.05; done
  url=$(sed -n 's/^listening on //p' "$work/serve$i.out")
  [ -n "$url" ] || { echo "server $i ($d) did not start:" >&2; cat "$work/serve$i.err" >&2; exit 1; }
  urls+=("$url")
  echo "server $i: $d/runner ${!extra:-}"
done
ctr_() { ctr --address "$CONTAINERD_ADDRESS" --namespace "$CONTAINERD_NAMESPACE-ctr" "$@"; }
ctr_ image import "$work/busybox.tar" >/dev/null
ctr_rows() {
  ctr_ run --rm local/busybox:1.35 "w$1" sh -c true >/dev/null
  for k in $(seq 1 10); do
    t0=$(date +%s%N); ctr_ run --rm local/busybox:1.35 "c$1-$k" sh -c true >/dev/null; t1=$(date +%s%N)
    echo $(((t1 - t0) / 1000))
  done | sort -n | awk -v w="$1" '{a[NR]=$1} END{printf "ctr run --rm (%s): median %.1f ms of 10\n", w, a[int((NR+1)/2)]/1000}'
}
echo "load $(cut -d' ' -f1-3 /proc/loadavg)"
ctr_rows before
BENCH_TOKEN="$(cat "$work/token")" python3 scripts/cold_ab.py "$n" "${urls[@]}"
ctr_rows after
echo "load $(cut -d' ' -f1-3 /proc/loadavg)"
