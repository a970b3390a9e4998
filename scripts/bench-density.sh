#!/usr/bin/env bash
# Density (issue 36, item 5): N live idle Python-image sessions (each with its resident bash) on
# one node, through `runner serve` over HTTP, with `network: none`. Prints, each beside its
# target and, where a plain path exists, beside `ctr`:
#   create rate   sessions/s over the last 500 created, while the earlier ones live
#   PSS           per session: every process of the sandbox, its shim, and 1/N of the server
#                 (smaps_rollup); containerd's own beside it; `ctr run -d` of the same image
#                 with a sleeping bash (its processes and its shim) for the plain path
#   idle CPU      host CPU % (of all cores) over 30 s with the N sessions idle
#   shell p50/p99 `true` through the stateful shell of idle sessions picked at random across
#                 all N, while 10 others run a busy loop (target p99 10 ms); the sampler runs
#                 at nice -10 and says how much CPU other work on the host took meanwhile
#   walls         what N sessions use of the host's limits (threads against kernel.pid_max,
#                 the server's and containerd's fds, mounts, cgroups)
# Safety on a shared machine: creation stops when MemAvailable falls under
# BENCH_MIN_AVAILABLE_GIB (default 4), or at SIGUSR1 to the measuring python3; the N reached
# and why is printed.
# Host settings runner cannot make itself (kernel.pid_max, ...) are raised here for the run and
# put back at the end; `runner serve` checks them at start (docs/guide/capacity.md).
#
#   scripts/bench-density.sh [N]        alone (default 5000); BENCH_RUNNER=PATH measures that
#                                       binary, else this tree's debug build
#   BENCH_ONLY=density scripts/bench.sh [RUNS] [CONCURRENT] [N]   from bench.sh (release build)
# BENCH_DENSITY_CONCURRENCY: creates in flight at once (default 8).
# BENCH_DENSITY_BUSY: sessions that run a busy loop during the second shell sampling (default
# 10); BENCH_DENSITY_CALLS: shell calls per sampling (default 2000, whatever N: a p99 needs
# them); BENCH_DENSITY_SAMPLER_NICE: the sampler's nice while it samples (default -10: a client
# that waits for a CPU behind the busy loops would add its own wait to the figure; 0 measures
# what a client at the default priority sees).
# BENCH_DENSITY_HOLD=FILE: once the N sessions live, the run makes FILE and waits until it is
# removed (to profile them) before measuring.
# BENCH_SESSIONS_PER_SHIM=N: the server runs with `--sessions-per-shim N` (sessions of one
# Environment share a containerd shim, N at most; default 1: a shim each).

# density_rows N: needs $runner, $work, a running containerd (CONTAINERD_ADDRESS) with
# local/python:3.11 imported, and ctr_ (bench.sh's).
density_rows() {
  local n=$1 old_pid_max serve_pid url token ctr_pss
  # Each session is ~4 threads of its shim (the Go runtime's), its init and bash: kernel.pid_max
  # counts threads. Raised for the run (a host setting runner cannot make), put back after.
  old_pid_max=$(cat /proc/sys/kernel/pid_max)
  if [ "$old_pid_max" -lt 4194304 ]; then
    echo 4194304 > /proc/sys/kernel/pid_max
    echo "density    kernel.pid_max raised from $old_pid_max to 4194304 for the run"
  fi
  ulimit -n "$(ulimit -Hn)"
  # The plain path first, on a quiet host: `ctr run -d` of the same image with a sleeping bash.
  ctr_pss=$(density_ctr_pss 20)
  echo "density-$$-token-0123456789abcdef" > "$work/density-token"
  token=$(cat "$work/density-token")
  # Sessions live as long as the run: the TTL is far beyond it.
  local expect=()
  if "$runner" serve --help | grep -q -- --expect-sessions; then expect=(--expect-sessions "$n"); fi
  local per_shim=${BENCH_SESSIONS_PER_SHIM:-1}
  if [ "$per_shim" != 1 ]; then
    expect+=(--sessions-per-shim "$per_shim")
    echo "density    runner serve --sessions-per-shim $per_shim"
  fi
  "$runner" serve --listen 127.0.0.1:0 --token-file "$work/density-token" --session-ttl 24h \
    "${expect[@]}" > "$work/density-serve.out" 2>"$work/density-serve.err" &
  serve_pid=$!
  for _ in $(seq 1 200); do grep -q listening "$work/density-serve.out" 2>/dev/null && break; sleep 0.05; done
  url=$(sed -n 's/^listening on //p' "$work/density-serve.out")
  [ -n "$url" ] || { echo "density: runner serve did not start: $(cat "$work/density-serve.err")" >&2; return 1; }
  # What the server said of the host's limits at its start.
  sed -n 's/^runner: host limit: /density    serve start: /p' "$work/density-serve.err"
  local rc=0
  BENCH_URL=$url BENCH_TOKEN=$token BENCH_N=$n BENCH_SERVE_PID=$serve_pid BENCH_CTR_PSS=$ctr_pss \
    BENCH_MIN_AVAILABLE_GIB=${BENCH_MIN_AVAILABLE_GIB:-4} BENCH_CONCURRENCY=${BENCH_DENSITY_CONCURRENCY:-8} \
    python3 -c "$DENSITY_PY" || rc=$?
  density_teardown "$url" "$token" "$serve_pid"
  if [ "$old_pid_max" -lt 4194304 ]; then echo "$old_pid_max" > /proc/sys/kernel/pid_max; fi
  return $rc
}

# density_teardown URL TOKEN PID: whatever sessions the measuring side left (it was killed,
# it failed) are deleted over HTTP, the server stopped, `runner gc` run; containers left in
# this namespace after that fail the run loudly (a containerd stopped under live shims would
# orphan them).
density_teardown() {
  local url=$1 token=$2 pid=$3 id left
  for id in $(curl -sf -H "Authorization: Bearer $token" "$url/v1/sessions" | jq -r '.[].id'); do
    curl -sf -o /dev/null -X DELETE -H "Authorization: Bearer $token" "$url/v1/sessions/$id" || true
  done
  kill "$pid"; wait "$pid" 2>/dev/null || true
  "$runner" gc > "$work/density-gc.out" 2>&1 || cat "$work/density-gc.out" >&2
  left=$(ctr_ containers ls -q | wc -l)
  if [ "$left" != 0 ]; then
    echo "density: $left containers left in $CONTAINERD_NAMESPACE after runner gc" >&2
    return 1
  fi
}

# density_ctr_pss K: PSS (KiB) per container of K `ctr run -d` Python containers each running
# `bash -c 'sleep infinity'` (its processes and its shim), then removes them.
density_ctr_pss() {
  local k=$1 i pss
  for i in $(seq 1 "$k"); do
    ctr_ run -d local/python:3.11 "density-ctr-$$-$i" bash -c 'sleep infinity' >/dev/null
  done
  pss=$(python3 - "density-ctr-$$-" "$k" <<'PY'
import os, sys
prefix, k = sys.argv[1], int(sys.argv[2])
def pss(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return sum(int(l.split()[1]) for l in f if l.startswith("Pss:"))
    except OSError:
        return 0
children, shims = {}, []
for p in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{p}/stat").read()
        cmd = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
    except OSError:
        continue
    children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(p))
    if cmd and cmd[0].endswith(b"containerd-shim-runc-v2") and any(a.decode(errors="replace").startswith(prefix) for a in cmd):
        shims.append(int(p))
total, todo = 0, list(shims)
while todo:
    p = todo.pop()
    total += pss(p)
    todo += children.get(p, [])
if len(shims) != k:
    sys.exit(f"density: found {len(shims)} shims of the {k} ctr containers")
print(total // k)
PY
)
  for i in $(seq 1 "$k"); do
    ctr_ tasks kill -s 9 "density-ctr-$$-$i" >/dev/null 2>&1 || true
  done
  sleep 0.5
  for i in $(seq 1 "$k"); do
    ctr_ tasks rm -f "density-ctr-$$-$i" >/dev/null 2>&1 || true
    ctr_ containers rm "density-ctr-$$-$i" >/dev/null 2>&1 || true
  done
  for h in /sys/fs/cgroup /sys/fs/cgroup/*/; do rmdir "$h/$CONTAINERD_NAMESPACE" 2>/dev/null || true; done
  echo "$pss"
}

# The measuring side, in Python (stdlib only): HTTP keep-alive connections to the server, the
# host's /proc for memory, CPU, threads and fds.
DENSITY_PY=$(cat <<'PY'
import http.client, json, os, random, signal, statistics, sys, threading, time, urllib.parse

url = urllib.parse.urlparse(os.environ["BENCH_URL"])
token = os.environ["BENCH_TOKEN"]
target_n = int(os.environ["BENCH_N"])
serve_pid = int(os.environ["BENCH_SERVE_PID"])
ctr_pss_kib = int(os.environ["BENCH_CTR_PSS"])
min_available = float(os.environ["BENCH_MIN_AVAILABLE_GIB"]) * 2**30
concurrency = int(os.environ["BENCH_CONCURRENCY"])
namespace = os.environ["CONTAINERD_NAMESPACE"]
BUSY = int(os.environ.get("BENCH_DENSITY_BUSY", "10"))
SHELL_CALLS = int(os.environ.get("BENCH_DENSITY_CALLS", "2000"))
SAMPLER_NICE = int(os.environ.get("BENCH_DENSITY_SAMPLER_NICE", "-10"))
ENV = {"image": "local/python:3.11", "network": "none"}


class Api:
    def __init__(self):
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)

    def call(self, method, path, body=None):
        data = None if body is None else json.dumps(body)
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        try:
            self.conn.request(method, path, body=data, headers=headers)
            r = self.conn.getresponse()
            text = r.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            raise
        if r.status >= 300:
            raise RuntimeError(f"{method} {path}: {r.status} {text[:500].decode(errors='replace')}")
        return json.loads(text) if text else None


def meminfo(key):
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def pss(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return sum(int(l.split()[1]) for l in f if l.startswith("Pss:"))
    except OSError:
        return 0


def count(path):
    try:
        return len(os.listdir(path))
    except OSError:
        return 0


def limit(pid, what):
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith(what):
                return line.split()[-3]
    return "?"


def processes():
    """pid -> (ppid, argv) of every process of the host."""
    out = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{p}/stat").read()
            argv = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        out[int(p)] = (int(stat.rsplit(")", 1)[1].split()[1]), argv)
    return out


def sandbox_tree():
    """The shims of this run's namespace, and every process below them."""
    procs = processes()
    children = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    shims = [
        pid for pid, (_, argv) in procs.items()
        if argv and argv[0].endswith(b"containerd-shim-runc-v2") and namespace.encode() in argv
    ]
    below, todo = [], [c for s in shims for c in children.get(s, [])]
    while todo:
        p = todo.pop()
        below.append(p)
        todo += children.get(p, [])
    return shims, below


def containerd_pid():
    # The daemon whose socket this run uses: runner's private one records its pid.
    state = os.environ["RUNNER_STATE_DIR"]
    try:
        return int(open(os.path.join(state, "containerd", "containerd.pid")).read())
    except OSError:
        return None


def threads_total():
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[1])


def cpu_ticks():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]


def comm_and_ticks(pid):
    """A process's name and CPU ticks (user + system, every thread), or None once it is gone."""
    try:
        head, rest = open(f"/proc/{pid}/stat").read().rsplit(")", 1)
        f = rest.split()
        return head.split("(", 1)[1], int(f[11]) + int(f[12])
    except (OSError, IndexError, ValueError):
        return None


def proc_cpu(pids):
    return sum(got[1] for got in map(comm_and_ticks, pids) if got)


# --- create N sessions, CONCURRENCY at a time, while the host has memory to spare ---
ids, created_at, lock = [], [], threading.Lock()
stop_reason = None
errors = []


def creator():
    global stop_reason
    api = Api()
    while True:
        with lock:
            if stop_reason or len(ids) + inflight[0] >= target_n:
                return
            if meminfo("MemAvailable") < min_available:
                stop_reason = f"MemAvailable under {min_available / 2**30:.0f} GiB"
                return
            inflight[0] += 1
        try:
            s = api.call("POST", "/v1/sessions", {"environment": ENV})
        except Exception as e:  # the first failure is the wall: stop and say what it was
            with lock:
                inflight[0] -= 1
                errors.append(str(e))
                stop_reason = stop_reason or f"a create failed: {e}"
            api = Api()
            return
        with lock:
            inflight[0] -= 1
            ids.append(s["id"])
            created_at.append(time.monotonic())
            if len(ids) % 500 == 0:
                print(f"density    {len(ids)} sessions, MemAvailable {meminfo('MemAvailable') / 2**30:.1f} GiB, "
                      f"threads {threads_total()}", file=sys.stderr, flush=True)


inflight = [0]
KERNEL = ("SUnreclaim", "KernelStack", "PageTables")
kernel_before = sum(meminfo(k) for k in KERNEL)


def enough(*_):
    # SIGUSR1 (or SIGINT): stop creating and measure what lives.
    global stop_reason
    stop_reason = stop_reason or "stopped by a signal"


signal.signal(signal.SIGUSR1, enough)
signal.signal(signal.SIGINT, enough)
t0 = time.monotonic()
workers = [threading.Thread(target=creator) for _ in range(concurrency)]
for w in workers:
    w.start()
while any(w.is_alive() for w in workers):
    time.sleep(0.2)  # the main thread takes the signals
n = len(ids)
took = time.monotonic() - t0
print(f"density    created {n} of {target_n} sessions in {took:.0f} s"
      + (f"; stopped: {stop_reason}" if stop_reason else ""))
last = created_at[-500:] if n >= 2 else []
rate_last = (len(last) - 1) / (last[-1] - last[0]) if len(last) >= 2 and last[-1] > last[0] else 0.0
first = created_at[:500]
rate_first = (len(first) - 1) / (first[-1] - first[0]) if len(first) >= 2 and first[-1] > first[0] else 0.0
print(f"density    create rate while they live: last {len(last)}: {rate_last:.1f} sessions/s   "
      f"first {len(first)}: {rate_first:.1f} sessions/s  ({concurrency} at once)")


def delete_all():
    # The busy ones (the first BUSY) go first: popped from the end.
    todo = list(reversed(ids))
    failed = []

    def deleter():
        api = Api()
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            try:
                api.call("DELETE", f"/v1/sessions/{i}")
            except Exception as e:
                failed.append(f"{i}: {e}")
                api = Api()

    ts = [threading.Thread(target=deleter) for _ in range(concurrency)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if failed:
        print(f"density    {len(failed)} deletes failed, first: {failed[0]}", file=sys.stderr)


try:
    if n < BUSY + 10:
        sys.exit(f"density: only {n} sessions: {errors[:1]}")
    # --- memory: PSS per session ---
    time.sleep(2)
    shims, below = sandbox_tree()
    cd = containerd_pid()
    sandbox_kib = sum(pss(p) for p in shims + below)
    server_kib = pss(serve_pid)
    per = (sandbox_kib + server_kib) / n
    print(f"density    PSS per session: {per / 1024:.2f} MiB (sandbox processes and shim {sandbox_kib / n / 1024:.2f}, "
          f"server's share {server_kib / n / 1024:.3f}; {len(shims)} shims, {len(below)} sandbox processes)   "
          f"ctr run -d (bash, sleep): {ctr_pss_kib / 1024:.2f} MiB   ratio {per / max(ctr_pss_kib, 1):.2f}   "
          f"(target: 5,000 in 24 GiB)")
    kernel = (sum(meminfo(k) for k in KERNEL) - kernel_before) / n
    print(f"density    kernel memory per session (unreclaimable slab, stacks, page tables): {kernel / 2**20:.2f} MiB   "
          f"server PSS {server_kib / 1024:.0f} MiB, containerd PSS {pss(cd) / 1024 if cd else 0:.0f} MiB, "
          f"MemAvailable {meminfo('MemAvailable') / 2**30:.1f} GiB")
    # --- the walls: what N sessions use of the host's limits ---
    shim_threads = sum(count(f"/proc/{s}/task") for s in shims)
    sandbox_threads = sum(count(f"/proc/{p}/task") for p in below)
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    print(f"density    threads per session: {(shim_threads + sandbox_threads) / n:.2f} (shims' {shim_threads / n:.2f}: "
          f"{len(shims)} shims of {shim_threads / max(len(shims), 1):.1f} threads, {n / max(len(shims), 1):.1f} sessions each; "
          f"sandboxes' {sandbox_threads / n:.2f})")
    print(f"density    walls: threads {threads_total()} (kernel.pid_max {pid_max}; shims {shim_threads / max(len(shims), 1):.1f} threads each)   "
          f"server fds {count(f'/proc/{serve_pid}/fd')} (limit {limit(serve_pid, 'Max open files')})   "
          f"containerd fds {count(f'/proc/{cd}/fd') if cd else '?'} (limit {limit(cd, 'Max open files') if cd else '?'})   "
          f"containerd threads {count(f'/proc/{cd}/task') if cd else '?'}   "
          f"host mounts {sum(1 for _ in open('/proc/self/mountinfo'))}   "
          f"cgroups (memory) {int(open('/proc/cgroups').read().split('memory')[1].split()[1])}")
    # BENCH_DENSITY_HOLD=FILE: made now, and the run waits until it is removed: N live
    # sessions held for profiling (perf, /proc) before anything is measured.
    hold = os.environ.get("BENCH_DENSITY_HOLD")
    if hold:
        open(hold, "w").close()
        print(f"density    holding {n} sessions until {hold} is removed", file=sys.stderr, flush=True)
        while os.path.exists(hold):
            time.sleep(1)
    # --- idle CPU over 30 s ---
    parts = {"server": [serve_pid], "containerd": [cd] if cd else [], "shims": shims, "sandboxes": below}
    a_total, a_idle = cpu_ticks()
    a_parts = {k: proc_cpu(v) for k, v in parts.items()}
    time.sleep(30)
    b_total, b_idle = cpu_ticks()
    b_parts = {k: proc_cpu(v) for k, v in parts.items()}
    ncpu = os.cpu_count()
    host = 100 * (1 - (b_idle - a_idle) / max(b_total - a_total, 1))
    hz = os.sysconf("SC_CLK_TCK")
    share = {k: 100 * (b_parts[k] - a_parts[k]) / hz / 30 / ncpu for k in parts}
    print(f"density    idle CPU of {n} idle sessions over 30 s: {sum(share.values()):.1f} % of {ncpu} cores ("
          + ", ".join(f"{k} {v:.1f}" for k, v in share.items())
          + f")   host {host:.1f} % (everything running on it)")
    # --- shell round trips of idle sessions, then while 10 work ---
    # The sampler is a client on the same two cores as the busy loops: at the default nice it
    # would wait for a CPU itself after each answer and add that to what it measures (see
    # docs/guide/capacity.md). It samples at nice -10 (its own thread only), so that what is
    # measured is the server and the sandbox; what else ran on the host meanwhile is printed.
    try:
        os.setpriority(os.PRIO_PROCESS, 0, SAMPLER_NICE)
        sampler = f"sampler at nice {SAMPLER_NICE}"
    except OSError as e:
        sampler = f"sampler at nice {os.getpriority(os.PRIO_PROCESS, 0)} (could not set {SAMPLER_NICE}: {e.strerror})"
    busy = ids[:BUSY]
    api = Api()
    rng = random.Random(36)

    def our_pids():
        """Every process of this run: the server, containerd, the shims and every process
        below them (the busy loops too), and this sampler."""
        shims_now, below_now = sandbox_tree()
        return [serve_pid, os.getpid()] + ([cd] if cd else []) + shims_now + below_now

    def ours():
        """CPU ticks of every process of this run (`our_pids`)."""
        return proc_cpu(our_pids())

    def every_process():
        """comm and CPU ticks of every process on the host (kernel threads too)."""
        seen = {}
        for p in filter(str.isdigit, os.listdir("/proc")):
            got = comm_and_ticks(p)
            if got:
                seen[int(p)] = got
        return seen

    def named_others(before, after, elapsed_ticks):
        """The three processes not of this run that took the most CPU between two
        `every_process` snapshots (a kernel thread such as kdamond counts here), in % of all
        cores: what "other work on the host" was."""
        mine = set(our_pids())
        took = {}
        for pid, (comm, ticks) in after.items():
            if pid in mine or pid not in before:
                continue
            took[comm] = took.get(comm, 0) + ticks - before[pid][1]
        top = sorted(((t, c) for c, t in took.items() if t > 0), reverse=True)[:3]
        return ", ".join(f"{c} {100 * t / max(elapsed_ticks, 1):.0f} %" for t, c in top) or "none"

    def sample(calls, among):
        took = []
        a_total, a_idle = cpu_ticks()
        a_ours = ours()
        a_all = every_process()
        for _ in range(calls):
            i = rng.choice(among)
            t = time.perf_counter()
            r = api.call("POST", f"/v1/sessions/{i}/shell", {"command": "true"})
            took.append((time.perf_counter() - t) * 1e3)
            if r.get("exitCode") != 0:
                raise RuntimeError(f"shell in {i}: {r}")
        b_total, b_idle = cpu_ticks()
        # Ticks of the whole host (every core) minus idle, minus this run's own: what other
        # work on the host took while sampling, in % of all cores.
        others = 100 * max((b_total - a_total) - (b_idle - a_idle) - (ours() - a_ours), 0) / max(b_total - a_total, 1)
        others = f"{others:.0f} % of its CPU; most: {named_others(a_all, every_process(), b_total - a_total)}"
        took.sort()
        return statistics.median(took), took[int(0.99 * (len(took) - 1))], took[-1], others

    calls = SHELL_CALLS
    q50, q99, qmax, other = sample(calls, ids)
    print(f"density    shell call of an idle session, none busy: p50 {q50:.2f} ms   p99 {q99:.2f} ms   max {qmax:.2f} ms  "
          f"({calls} calls across {n} sessions; {sampler}; other work on the host {other})")
    for i in busy:
        api.call("POST", f"/v1/sessions/{i}/shell",
                 {"command": "nohup sh -c 'while :; do :; done' >/dev/null 2>&1 &"})
    idle = ids[BUSY:]
    p50, p99, pmax, other = sample(calls, idle)
    print(f"density    shell call of an idle session, {BUSY} others busy: p50 {p50:.2f} ms   p99 {p99:.2f} ms (target 10 ms)   "
          f"max {pmax:.2f} ms  ({calls} calls across {len(idle)} sessions; {sampler}; other work on the host {other})")
finally:
    t = time.monotonic()
    delete_all()
    print(f"density    deleted {n} sessions in {time.monotonic() - t:.0f} s", file=sys.stderr)
if stop_reason and n < target_n:
    sys.exit(3)
PY
)

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  # Alone: a private containerd of its own, the Python image, then the rows.
  set -euo pipefail
  cd "$(dirname "$0")/.."
  n=${1:-5000}
  scripts/deps.sh
  if [ -n "${BENCH_RUNNER:-}" ]; then
    runner=$BENCH_RUNNER
  else
    cargo build --locked --bin runner >/dev/null 2>&1 || cargo build --locked --bin runner
    runner="$PWD/target/debug/runner"
  fi
  work=$(mktemp -d /tmp/runner-density.XXXXXX)
  export RUNNER_STATE_DIR="$work/state" CONTAINERD_NAMESPACE="runner-density-$$"
  ctr_() { ctr --address "$CONTAINERD_ADDRESS" --namespace "$CONTAINERD_NAMESPACE" "$@"; }
  cleanup() {
    "$runner" gc >/dev/null 2>&1 || true
    # containerd's state goes only with no container left (live shims would be orphaned).
    if [ "$(ctr_ containers ls -q | wc -l)" = 0 ]; then
      "$runner" daemon stop >/dev/null 2>&1 || true
      rm -rf "$work"
    else
      echo "density: containers left in $CONTAINERD_NAMESPACE; containerd and $work kept: remove them with runner gc" >&2
    fi
  }
  "$runner" daemon start >/dev/null
  export CONTAINERD_ADDRESS
  CONTAINERD_ADDRESS=$("$runner" daemon status | sed -n 's/^running (pid [0-9]*) at //p')
  trap cleanup EXIT
  images/python/build.sh "$work/python.tar" oci >/dev/null
  "$runner" image import "$work/python.tar" >/dev/null
  density_rows "$n"
fi
