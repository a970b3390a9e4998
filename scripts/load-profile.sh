#!/usr/bin/env bash
# Where the CPU goes under load: N concurrent one-shot jobs (the library's `bench concurrent`,
# or N `runner apply` processes with --cli) on a private containerd, sampled system-wide with
# perf, then the share of each program (runc, the shim, containerd, runner, idle). A share of
# idle ("swapper") near zero means the jobs are CPU-bound, not waiting on a lock or a
# connection. Usage: scripts/load-profile.sh [N] [--cli] [--pool]   (N defaults to 20)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-20}
cli=false pool=false
for a in "${@:2}"; do
  case $a in
    --cli) cli=true ;;
    --pool) pool=true ;;
    *) echo "unknown option $a" >&2; exit 2 ;;
  esac
done

command -v perf >/dev/null || { apt-get update -q && apt-get install -y -q linux-perf; }
# shellcheck source=scripts/bench-env.sh
. scripts/bench-env.sh
bench_env profile
cleanup() {
  "$runner" pool rm bb >/dev/null 2>&1 || true
  bench_stop
}
trap cleanup EXIT
bench_containerd
bench_busybox

printf 'apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: bb}\nspec:\n  image: local/busybox:1.35\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: bench}\nspec:\n  environment: bb\n  command: ["sh", "-c", "true"]\n' >"$work/true.yaml"
for i in $(seq 1 "$n"); do sed "s/^metadata: {name: bench}$/metadata: {name: load-$i}/" "$work/true.yaml" >"$work/load-$i.yaml"; done

load() {
  if $cli; then
    local t0
    t0=$(date +%s%N)
    for i in $(seq 1 "$n"); do "$runner" apply -f "$work/load-$i.yaml" >/dev/null & done
    wait
    echo "{\"jobs\": $n, \"seconds\": $(( ($(date +%s%N) - t0) / 1000000 ))e-3}" >"$work/result"
  elif $pool; then
    BENCH_POOL=1 "$bench" concurrent "$n" >"$work/result"
  else
    "$bench" concurrent "$n" >"$work/result"
  fi
}
"$bench" concurrent "$n" >/dev/null # warm up: first use of the image, the page cache
if $pool; then "$runner" pool create bb -f "$work/true.yaml" --size "$n" >/dev/null; fi
perf record -q -a -F 999 -o "$work/perf.data" -- bash -c "$(declare -f load); runner=$runner bench=$bench work=$work n=$n cli=$cli pool=$pool load" 2>/dev/null
echo "$n concurrent one-shot jobs ($($cli && echo 'runner apply processes' || echo library)$($pool && echo ', from a warm pool' || true)), under perf: $(tail -1 "$work/result")"
echo "share of CPU samples by program (all CPUs; swapper = idle):"
perf report -i "$work/perf.data" --sort comm --stdio 2>/dev/null | grep -v '^#' | grep -v '^$' | head -12
