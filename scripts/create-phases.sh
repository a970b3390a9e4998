#!/usr/bin/env bash
# Where a cold session's creation spends its time, phase by phase: N cold sessions over HTTP
# (`runner serve`, busybox) while perf records every process start, fork and exit, then the
# median of each phase between them: the shim's `start` command and its daemon, `runc create`,
# `runc init` (its copy of runc into a memfd, the cgroup attach before its first clone, its
# work in the container), the wait for Tasks.Start, `runc start`, up to the agent's exec.
# Usage: scripts/create-phases.sh [N]   (N defaults to 12)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-12}
command -v perf >/dev/null || { apt-get update -q && apt-get install -y -q linux-perf; }
# shellcheck source=scripts/bench-env.sh
. scripts/bench-env.sh
bench_env phases
cleanup() {
  if [ -n "${serve_pid:-}" ]; then kill "$serve_pid" 2>/dev/null; wait "$serve_pid" 2>/dev/null || true; fi
  bench_stop
}
trap cleanup EXIT
bench_containerd
bench_busybox
echo "phases-token-$$-0123456789abcdef" > "$work/token"
"$runner" serve --listen 127.0.0.1:0 --token-file "$work/token" > "$work/serve.out" 2>"$work/serve.err" &
serve_pid=$!
for _ in $(seq 1 100); do grep -q listening "$work/serve.out" 2>/dev/null && break; sleep 0.05; done
url=$(sed -n 's/^listening on //p' "$work/serve.out")
BENCH_URL="$url" BENCH_TOKEN="$(cat "$work/token")" BENCH_SESSIONS=2 "$bench" http 1 >/dev/null
perf record -q -o "$work/perf.data" -e sched:sched_process_exec -e sched:sched_process_exit \
  -e sched:sched_process_fork -a -- \
  env BENCH_URL="$url" BENCH_TOKEN="$(cat "$work/token")" BENCH_SESSIONS="$n" "$bench" http 1
perf script -i "$work/perf.data" 2>/dev/null | python3 -c '
import re, statistics, sys
ev = []
for line in sys.stdin:
    m = re.match(r"\s*(\S.*?)\s+(\d+)\s+\[\d+\]\s+([\d.]+):\s+sched:(\w+):\s+(.*)", line)
    if m:
        ev.append((float(m.group(3)) * 1e3, m.group(1), int(m.group(2)), m.group(4), m.group(5)))
execs = [e for e in ev if e[3] == "sched_process_exec"]
found = []
for i, (t, comm, pid, kind, rest) in enumerate(ev):
    # Each container starts with runc init re-executing itself: walk back to the runc create
    # and the two shim starts before it, forward to runc start and the agent it execs.
    if kind != "sched_process_exec" or "filename=/proc/self/exe" not in rest:
        continue
    before = [e for e in execs if e[0] <= t]
    runcs = [e for e in before if e[4].startswith("filename=/usr/sbin/runc")]
    shims = [e for e in before if "containerd-shim" in e[4]]
    if not runcs or len(shims) < 2:
        continue
    s = {"shim start": shims[-2][0], "shim daemon": shims[-1][0], "runc create": runcs[-1][0], "runc init": t}
    for e in ev[i + 1:]:
        if "memfd exec" not in s and e[3] == "sched_process_exec" and "/dev/fd/" in e[4] and e[2] == pid:
            s["memfd exec"] = e[0]
        elif "first clone" not in s and e[3] == "sched_process_fork" and e[1].startswith("runc:[0:PARENT]"):
            s["first clone"] = e[0]
        elif "create exits" not in s and e[3] == "sched_process_exit" and e[2] == runcs[-1][2]:
            s["create exits"] = e[0]
        elif "create exits" in s and "runc start" not in s and e[3] == "sched_process_exec" and e[4].startswith("filename=/usr/sbin/runc"):
            s["runc start"] = e[0]
        elif "runc start" in s and e[3] == "sched_process_exec" and e[4].startswith("filename=/bin/sh"):
            s["agent exec"] = e[0]
            break
    if len(s) == 9 and s["runc init"] - s["shim start"] < 100:
        found.append(s)
names = ["shim start", "shim daemon", "runc create", "runc init", "memfd exec", "first clone", "create exits", "runc start", "agent exec"]
print(f"{len(found)} cold containers (medians, ms; min..max)")
for a, b in zip(names, names[1:]):
    d = [s[b] - s[a] for s in found]
    print(f"  {a:>12} -> {b:<12} {statistics.median(d):6.1f}  ({min(d):.1f}..{max(d):.1f})")
d = [s["agent exec"] - s["shim start"] for s in found]
print(f"  shim start -> agent exec  {statistics.median(d):6.1f}")
'
