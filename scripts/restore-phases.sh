#!/usr/bin/env bash
# Where a restore and a fork spend their time, phase by phase: on the Python image, a session
# holding 100 MiB of Python heap (the `checkpoint` bench row's) is checkpointed, restored N
# times one after another (each to its first Python answer, then removed) and forked into 10
# M times, over HTTP (`runner serve`, RUNNER_LOG=runner=debug); then the median of each phase
# the server logged ("restore phase" and "criu phase" events):
#   checkpoint read      `criu check` (cached) and the checkpoint's session.json
#   manifest             the request's documents parsed, bound, resolved
#   workspace filled     the checkpoint's workspace copied into the new scratch workspace
#   agent filled         its agent directory copied, owners moved to the new range
#   rootfs filled        its writable layer copied into the new snapshot, owners moved
#   container created    the whole container as a cold session makes it (range, cgroup,
#                        snapshot, spec, containerd's record; the two fills above inside)
#   images linked        CRIU's images hard-linked into the run directory, userns-*.img
#                        rewritten for the new range
#   fifos held           the shells' input FIFOs opened by the host
#   task create          Tasks.Create with runc's criu_image_path (the shim starts)
#   task start (criu restore)  Tasks.Start: runc runs `criu restore`
#     criu: ...          inside it, CRIU's own log (its timestamps): from its start to the
#                        namespaces and mounts, to the processes forked, to their memory
#                        read, to the end
#   host mounts dropped (off the path)  the host's copies of the container's mounts released
#                        and the restore's images unlinked, in the background
#   sandbox              the whole runtime (container created .. task start)
#   shells adopted       the resident shells taken over
#   python reattached    the host listens again and the restored driver connects (it polls)
#   session restored     the whole restore, as the server sees it
# and the client's view: restore to first answer, fork into 10. A fork's phases overlap (its
# restores run four at a time), so their medians are per restore under that load.
# Then, unless BENCH_ROW=0, bench.sh's `checkpoint` row on the same server (its figures beside
# a cold session's in the same run).
# Usage: scripts/restore-phases.sh [N] [M]   (N defaults to 8 restores, M to 2 forks)
# BENCH_RUNNER=PATH measures that binary (as bench.sh). With CONTAINERD_ADDRESS naming a running
# containerd, that one is used (in a namespace of the script's own); else a private one starts.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-8}
m=${2:-2}
# shellcheck source=scripts/bench-env.sh
. scripts/bench-env.sh
bench_env restore
shared=0
if [ -n "${CONTAINERD_ADDRESS:-}" ] && [ -S "$CONTAINERD_ADDRESS" ]; then shared=1; fi
cleanup() {
  if [ -n "${serve_pid:-}" ]; then kill "$serve_pid" 2>/dev/null; wait "$serve_pid" 2>/dev/null || true; fi
  if [ "$shared" = 1 ]; then
    "$runner" gc >/dev/null 2>&1 || true
    "$runner" image rm local/python:3.11 >/dev/null 2>&1 || true
    rm -rf "$work"
  else
    bench_stop
  fi
}
trap cleanup EXIT
if [ "$shared" = 0 ]; then bench_containerd; fi
if [ -f "${RUNNER_TEST_IMAGES:-/nonexistent}/python-oci.tar" ]; then
  "$runner" image import "$RUNNER_TEST_IMAGES/python-oci.tar" >/dev/null
else
  images/python/build.sh "$work/python.tar" oci >/dev/null
  "$runner" image import "$work/python.tar" >/dev/null
fi
echo "restore-token-$$-0123456789abcdef" > "$work/token"
RUNNER_LOG=runner=debug "$runner" serve --listen 127.0.0.1:0 --token-file "$work/token" \
  > "$work/serve.out" 2>"$work/serve.err" &
serve_pid=$!
url=$(bench_url "$work/serve.out" "$work/serve.err")
auth="Authorization: Bearer $(cat "$work/token")"
post() { # POST body $2 to $1; its answer, or the error's and exit
  local out code
  out=$(curl -s -w '\n%{http_code}' -H "$auth" -d "$2" "$url$1")
  code=${out##*$'\n'}
  case $code in 2??) printf '%s\n' "${out%$'\n'*}" ;; *) echo "POST $1: $out" >&2; return 1 ;; esac
}
id_of() { sed -n 's/.*"id":"\([^"]*\)".*/\1/p'; }
delete() { curl -sf -o /dev/null -X DELETE -H "$auth" "$url/v1/sessions/$1"; }
ms_since() { awk -v now="$(date +%s.%N)" -v t0="$1" 'BEGIN{printf "%.1f\n", (now - t0) * 1e3}'; }

src=$(post /v1/sessions '{"environment": {"image": "local/python:3.11"}}' | id_of)
[ -n "$src" ] || { echo "no session" >&2; exit 1; }
post "/v1/sessions/$src/python" '{"code": "big = bytearray(100 << 20)\nbig[::4096] = b\"x\" * len(big[::4096])"}' >/dev/null
post "/v1/sessions/$src/checkpoint" '{"name": "phases", "replace": true}' >/dev/null
# One restore unmeasured: the first pays for the page cache and containerd's warm-up.
r=$(post /v1/sessions '{"fromCheckpoint": "phases"}' | id_of); delete "$r"

from=$(($(wc -l < "$work/serve.err") + 1))
client=()
for _ in $(seq 1 "$n"); do
  t0=$(date +%s.%N)
  r=$(post /v1/sessions '{"fromCheckpoint": "phases"}' | id_of)
  [ -n "$r" ] || { echo "restore failed" >&2; tail -5 "$work/serve.err" >&2; exit 1; }
  post "/v1/sessions/$r/python" '{"code": "print(len(big))"}' | grep -q 104857600
  client+=("$(ms_since "$t0")")
  delete "$r"
done
tail -n +"$from" "$work/serve.err" > "$work/restore.log"
from=$(($(wc -l < "$work/serve.err") + 1))
forks=(); ck_ms=()
for _ in $(seq 1 "$m"); do
  t0=$(date +%s.%N)
  post "/v1/sessions/$src/fork" '{"count": 10}' > "$work/fork.json"
  forks+=("$(ms_since "$t0")")
  ck_ms+=("$(sed -n 's/.*"checkpointMs":\([0-9]*\).*/\1/p' "$work/fork.json")")
  for s in $(grep -o '"id":"[^"]*"' "$work/fork.json" | cut -d'"' -f4); do delete "$s"; done
done
tail -n +"$from" "$work/serve.err" > "$work/fork.log"
delete "$src"
curl -sf -o /dev/null -X DELETE -H "$auth" "$url/v1/checkpoints/phases"

report() { # report TITLE LOG CLIENT-MS...
  local title=$1 log=$2
  shift 2
  CLIENT="$*" TITLE="$title" python3 -c '
import os, re, statistics, sys
phases = {}
for line in sys.stdin:
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    m = re.search(r"(restore|criu|claim) phase phase=\"([^\"]+)\" ms=([0-9.]+)", line)
    if m and (m.group(1) != "claim" or m.group(2) in ("manifest", "sandbox")):
        name = ("criu: " if m.group(1) == "criu" else "") + m.group(2)
        phases.setdefault(name, []).append(float(m.group(3)))
order = ["checkpoint read", "manifest", "workspace filled", "agent filled", "rootfs filled", "container created",
         "images linked", "fifos held", "task create", "task start (criu restore)"]
order += sorted(p for p in phases if p.startswith("criu: "))
order += ["host mounts dropped (off the path)", "sandbox", "shells adopted", "python reattached", "session restored"]
print(os.environ["TITLE"] + " (medians, ms; min..max, count)")
for name in order + sorted(set(phases) - set(order)):
    d = phases.get(name)
    if d:
        print("  %-28s %7.1f  (%.1f..%.1f, %d)" % (name, statistics.median(d), min(d), max(d), len(d)))
c = [float(x) for x in os.environ["CLIENT"].split()]
print("  client: %.1f ms median (%.1f..%.1f, %d)" % (statistics.median(c), min(c), max(c), len(c)))
' < "$log"
}
report "restore of a Python session with 100 MiB of heap, to its first answer, one at a time" "$work/restore.log" "${client[@]}"
report "fork of it into 10 (per restore; four at a time)" "$work/fork.log" "${forks[@]}"
echo "  the fork's checkpoint of its source (checkpointMs): ${ck_ms[*]} ms"
if [ "${BENCH_ROW:-1}" = 1 ]; then
  # What bench.sh gives the row: its median (µs in, ms out) and runs.
  median() { sort -n | awk '{a[NR]=$1} END {m=a[int((NR+1)/2)]; printf "%.1f", m/1000}'; }
  runs=${BENCH_RUNS:-5}
  # shellcheck source=scripts/bench-checkpoint.sh
  . scripts/bench-checkpoint.sh
  checkpoint_rows "$url" "$(cat "$work/token")"
fi
