#!/usr/bin/env bash
# Benchmarks runner against ctr, side by side in one run, on a private containerd with the
# busybox test image. Prints medians and ratios (runner / ctr; lower is better).
#   one-shot: `runner apply` of a busybox `sh -c true` job  vs  `ctr run --rm` of the same
#   exec:     exec round trip of /bin/true in a live container (library)  vs  `ctr task exec`
#   pooled:   `runner apply` of the same job from a warm pool  vs  `ctr run --rm`
#   eval pool: an evaluation-shaped job (workspace, assets, user, stdin) cold and from a pool
#             made without shape flags  vs  `ctr run --rm`
#   throughput: N concurrent one-shot jobs (library), cold and from a warm pool
#   pause:    pause and resume of a live session over HTTP  vs  `ctr task pause/resume`
#   snapshot: a snapshot of a 100 MiB change; a job from the snapshot vs from its base image
#   checkpoint: CRIU on a Python session with 100 MiB of heap: checkpoint, restore to first
#             answer vs a cold session, fork into 10 vs 10 cold sessions at once
#   http:     runner serve on loopback: session create → first shell answer, shell and exec
#             round trips, on busybox (sh) and on the Python image (bash), cold and from
#             warm pools (`serve --pool`); the `target` rows hold the first answers to issue
#             36's targets (cold 40 ms, pooled 5 ms), beside `ctr run --rm` / `ctr task exec`
#   network:  one-shot `runner apply` with `network: bridge` vs `network: none`, and N of them
#             at once (jobs per second); the bridge attach itself (namespaces, CNI ADD, the
#             wall, the resolver's policy: the runner's own debug timing, median); the
#             resolver under issue 31's flood (the network test's figures, release build;
#             BENCH_FLOOD=0 skips it)
# BENCH_ONLY=network runs only the one-shot row (for the ratio to ctr) and the network rows;
# BENCH_ONLY=state the one-shot row and the pause and snapshot rows;
# BENCH_ONLY=eval the one-shot row and the eval pool rows;
# BENCH_ONLY=clirate the one-shot row and the pooled CLI and HTTP burst rows (bench-clirate.sh);
# BENCH_ONLY=density only the density rows (scripts/bench-density.sh: N live Python sessions,
# N the third argument, default 5000);
# BENCH_RUNNER=PATH measures that runner binary instead of building this tree (a before/after
# pair: build the other tree's release binary, keep it, pass it here).
#   pull:     the Python image from a loopback registry (docker-registry): `runner image pull`
#             vs `ctr image pull --plain-http`, wall time and peak RSS, into a second private
#             containerd whose content is deleted and garbage-collected between runs
# Usage: scripts/bench.sh [RUNS] [CONCURRENT] [N]   (defaults 15, 20 and 5000)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-15}
concurrent=${2:-20}

# shellcheck source=scripts/bench-env.sh
. scripts/bench-env.sh
# shellcheck source=scripts/bench-state.sh
. scripts/bench-state.sh
# shellcheck source=scripts/bench-checkpoint.sh
. scripts/bench-checkpoint.sh
# shellcheck source=scripts/bench-clirate.sh
. scripts/bench-clirate.sh
# shellcheck source=scripts/bench-density.sh
. scripts/bench-density.sh
bench_env bench
cleanup() {
  # Servers a row started, and a pool one left (a failed row): their members must not outlive
  # the bench's containerd.
  if [ -f "$work/servers" ]; then
    while read -r pid; do kill "$pid" 2>/dev/null && { wait "$pid" 2>/dev/null || true; }; done <"$work/servers"
  fi
  "$runner" pool rm bb >/dev/null 2>&1 || true
  ctr_ tasks kill -a -s 9 anchor >/dev/null 2>&1 || true
  sleep 0.2
  ctr_ tasks rm anchor >/dev/null 2>&1 || true
  ctr_ containers rm anchor >/dev/null 2>&1 || true
  "$runner" gc >/dev/null 2>&1 || true
  # ctr puts its containers' cgroups under /<namespace>; runc leaves that parent behind.
  for h in /sys/fs/cgroup /sys/fs/cgroup/*/; do rmdir "$h/$CONTAINERD_NAMESPACE" 2>/dev/null || true; done
  "$runner" daemon stop >/dev/null 2>&1 || true
  RUNNER_STATE_DIR="$work/pull-state" "$runner" daemon stop >/dev/null 2>&1 || true
  if [ -f "$work/registries/pids" ]; then
    while read -r pid; do kill "$pid" 2>/dev/null || true; done <"$work/registries/pids"
  fi
  rm -rf "$work"
}
ctr_() { ctr --address "$CONTAINERD_ADDRESS" --namespace "$CONTAINERD_NAMESPACE" "$@"; }
bench_containerd
trap cleanup EXIT
bench_busybox
# The Python image (bash, debootstrap; its rootfs is cached under /var/cache/runner/images).
images/python/build.sh "$work/python.tar" oci >/dev/null
"$runner" image import "$work/python.tar" >/dev/null
if [ "${BENCH_ONLY:-}" = density ]; then
  density_rows "${3:-5000}"
  exit 0
fi

cat > "$work/true.yaml" <<YAML
apiVersion: runner/v1alpha1
kind: Environment
metadata: {name: bb}
spec:
  image: local/busybox:1.35
---
apiVersion: runner/v1alpha1
kind: Job
metadata: {name: bench}
spec:
  environment: bb
  command: ["sh", "-c", "true"]
YAML

# The same job is applied again and again: a runner that refuses an existing name (issue 37)
# replaces it; an earlier one (BENCH_RUNNER) has no --replace and replaced it by itself.
replace=""
if "$runner" apply --help 2>/dev/null | grep -q -- '--replace'; then replace=--replace; fi
ms_of() { # run a command, print its wall time in ms
  local t0 t1
  t0=$(date +%s%N); "$@" >/dev/null 2>&1; t1=$(date +%s%N)
  echo $(( (t1 - t0) / 1000 ))
}
median() { sort -n | awk '{a[NR]=$1} END {m=a[int((NR+1)/2)]; printf "%.1f", m/1000}'; }

network_rows() {
  # network: bridge against network: none, the same one-shot job, alternating.
  sed 's/^  image: local\/busybox:1.35$/  image: local\/busybox:1.35\n  network: bridge/' "$work/true.yaml" > "$work/bridge.yaml"
  grep -q 'network: bridge' "$work/bridge.yaml"
  nb=(); nn=()
  : > "$work/attach.log"
  for _ in $(seq 1 "$runs"); do
    nb+=("$(ms_of "$runner" apply $replace -f "$work/bridge.yaml")")
    nn+=("$(ms_of "$runner" apply $replace -f "$work/true.yaml")")
  done
  b_med=$(printf '%s\n' "${nb[@]}" | median); n_med=$(printf '%s\n' "${nn[@]}" | median)
  echo "network    one-shot runner apply, network: bridge ${b_med} ms   network: none ${n_med} ms   added $(awk "BEGIN{printf \"%+.1f\", $b_med-$n_med}") ms  (median of $runs)"
  # The attach alone (in the job's process, beside containerd's create), as the runner times it.
  for _ in $(seq 1 "$runs"); do
    RUNNER_LOG=runner=debug "$runner" apply $replace -f "$work/bridge.yaml" 2>&1 >/dev/null | sed -n 's/.*bridge attach ms=\([0-9.]*\).*/\1/p' >> "$work/attach.log" || true
  done
  # Issue 31's attack on the resolver (tests/network/resolver.rs, a release build of it): one
  # container floods it, another's lookups are timed; helpers and the resolver's memory sampled.
  # Not with BENCH_RUNNER (the test runs this tree's binary).
  if [ -z "${BENCH_RUNNER:-}" ] && [ "${BENCH_FLOOD:-1}" = 1 ]; then
    mkdir -p "$work/test-images"
    cp "$work/python.tar" "$work/test-images/python-oci.tar"
    flood=$(RUNNER_TEST_IMAGES="$work/test-images" cargo test --release --locked --test network -- \
      --include-ignored --exact resolver::a_flooding_container_leaves_the_resolver_bounded_and_another_containers_dns_fast \
      --nocapture 2>&1 | sed -n 's/^flood: //p')
    echo "resolver   under a flood: ${flood:-the flood test printed nothing (run it: cargo test --test network -- --include-ignored a_flooding)}"
  fi
  if [ -s "$work/attach.log" ]; then
    a_med=$(awk '{print $1*1000}' "$work/attach.log" | median)
    echo "network    bridge attach (namespaces, link, wall, resolver): ${a_med} ms  (median of $(wc -l < "$work/attach.log"), the runner's own timing)"
  else
    echo "network    bridge attach: this runner does not time it (no 'bridge attach' debug line)"
  fi
  # Concurrent bridge jobs: $concurrent `runner apply` processes at once, each its own job, with
  # network: bridge and with network: none (each the median of 3 rounds).
  conc_round() { # $1: the manifest to start from; prints the round's wall ms
    local t0 t1 i
    for i in $(seq 1 "$concurrent"); do
      sed "s/^metadata: {name: bench}$/metadata: {name: conc-$i}/" "$1" > "$work/conc-$i.yaml"
    done
    t0=$(date +%s%N)
    for i in $(seq 1 "$concurrent"); do "$runner" apply -f "$work/conc-$i.yaml" >/dev/null 2>&1 & done
    wait
    t1=$(date +%s%N)
    for i in $(seq 1 "$concurrent"); do "$runner" delete job "conc-$i" >/dev/null; done
    echo $(( (t1 - t0) / 1000000 ))
  }
  cb=(); cn=()
  for _ in 1 2 3; do cb+=("$(conc_round "$work/bridge.yaml")"); cn+=("$(conc_round "$work/true.yaml")"); done
  cb_med=$(printf '%s\n' "${cb[@]}" | sort -n | sed -n 2p); cn_med=$(printf '%s\n' "${cn[@]}" | sort -n | sed -n 2p)
  echo "network    $concurrent concurrent runner apply: bridge $(awk "BEGIN{printf \"%.1f\", $concurrent*1000/$cb_med}") jobs/s (${cb_med} ms)   none $(awk "BEGIN{printf \"%.1f\", $concurrent*1000/$cn_med}") jobs/s (${cn_med} ms)  (median of 3 rounds)"

}
eval_pool_rows() {
  # An evaluation-shaped Job (issue 36, item 4): a workspace, static assets, `user: 1000:1000`
  # and stdin; cold, and from a pool made without shape flags (one pool serves every shape of
  # its Environment's jobs), in its steady state as above; ctr runs beside both.
  mkdir -p "$work/eval-ws" "$work/eval-assets"
  echo data > "$work/eval-assets/f.txt"
  chmod 777 "$work/eval-ws"
  cat > "$work/eval.yaml" <<YAML
apiVersion: runner/v1alpha1
kind: Environment
metadata: {name: ev}
spec:
  image: local/busybox:1.35
  workdir: /workspace
  user: "1000:1000"
---
apiVersion: runner/v1alpha1
kind: Job
metadata: {name: eval-bench}
spec:
  environment: ev
  workspace: $work/eval-ws
  staticAssets: [{source: $work/eval-assets, savePath: data}]
  stdin: "answer"
  command: ["sh", "-c", "cat /static/data/f.txt - > out.txt"]
YAML
  "$runner" apply $replace -f "$work/eval.yaml" >/dev/null
  ec=(); c3=()
  for i in $(seq 1 "$runs"); do
    ec+=("$(ms_of "$runner" apply $replace -f "$work/eval.yaml")")
    c3+=("$(ms_of ctr_ run --rm local/busybox:1.35 "e$i" sh -c true)")
  done
  "$runner" pool create ev -f "$work/eval.yaml" --size 3 >/dev/null
  ep=()
  for i in $(seq 1 "$runs"); do
    ep+=("$(ms_of "$runner" apply $replace -f "$work/eval.yaml")")
    "$runner" pool fill ev >/dev/null
  done
  served=$("$runner" get job eval-bench -o json | grep -c '"pool": "ev"' || true)
  "$runner" pool rm ev >/dev/null
  [ "$served" -ge 1 ] || { echo "bench: the evaluation-shaped job was not served by pool ev" >&2; exit 1; }
  ec_med=$(printf '%s\n' "${ec[@]}" | median)
  ep_med=$(printf '%s\n' "${ep[@]}" | median)
  c3_med=$(printf '%s\n' "${c3[@]}" | median)
  echo "eval pool  evaluation-shaped Job (workspace, assets, user, stdin) from a pool: ${ep_med} ms   cold: ${ec_med} ms   ctr run --rm: ${c3_med} ms   ratio pooled $(awk "BEGIN{printf \"%.2f\", $ep_med/$c3_med}") cold $(awk "BEGIN{printf \"%.2f\", $ec_med/$c3_med}")  (median of $runs)"
}


# ctr running runner's own hardened spec (seccomp allowlist, limits, masked paths, cgroup
# namespace) on the same busybox files, to separate what the spec costs inside runc from what
# runner's client adds. The rootfs is a plain directory (no snapshot work for this one).
mkdir -p "$work/rootfs"
images/busybox/build.sh "$work/rootfs.tar" rootfs >/dev/null
tar -xf "$work/rootfs.tar" -C "$work/rootfs"
# Without the user namespace (ctr cannot remap a plain directory; its cost is measured below).
sed 's/^  image: .*/&\n  hostUsers: true/' "$work/true.yaml" > "$work/true-host-users.yaml"
"$runner" spec -f "$work/true-host-users.yaml" | sed "s|\"path\": \"rootfs\"|\"path\": \"$work/rootfs\"|" > "$work/spec.json"

# Warm every path once (page cache, first shim binary load).
"$runner" apply $replace -f "$work/true.yaml" >/dev/null
ctr_ run --rm local/busybox:1.35 warm sh -c true >/dev/null
ctr_ run --rm --config "$work/spec.json" warm-spec >/dev/null

r=(); c=(); s=()
for i in $(seq 1 "$runs"); do
  r+=("$(ms_of "$runner" apply $replace -f "$work/true.yaml")")
  c+=("$(ms_of ctr_ run --rm local/busybox:1.35 "b$i" sh -c true)")
  s+=("$(ms_of ctr_ run --rm --config "$work/spec.json" "s$i")")
done
r_med=$(printf '%s\n' "${r[@]}" | median)
c_med=$(printf '%s\n' "${c[@]}" | median)
s_med=$(printf '%s\n' "${s[@]}" | median)
echo "one-shot   runner apply: ${r_med} ms   ctr run --rm: ${c_med} ms   ratio $(awk "BEGIN{printf \"%.2f\", $r_med/$c_med}")  (median of $runs)"
echo "           ctr run --rm with runner's spec: ${s_med} ms = $(awk "BEGIN{printf \"%.2f\", $s_med/$c_med}")x ctr run --rm"
if [ "${BENCH_ONLY:-}" = network ]; then
  network_rows
  exit 0
fi
if [ "${BENCH_ONLY:-}" = state ]; then
  state_only
  exit 0
fi
if [ "${BENCH_ONLY:-}" = eval ]; then
  eval_pool_rows
  exit 0
fi
if [ "${BENCH_ONLY:-}" = clirate ]; then
  clirate_rows
  exit 0
fi
# Where the floor is: the container lifecycle alone (create, Tasks.Create/Start/Wait/Delete,
# remove) driven by the library without a CLI process or the durable logger, and what ctr's own
# client costs (process start + connect), to read the ratio above against.
l_med=$(env -u BENCH_DURABLE "$bench" oneshot "$runs" | sed -n 's/.*"oneshot_ms_median": \([0-9.]*\).*/\1/p')
v=(); for i in $(seq 1 "$runs"); do v+=("$(ms_of ctr_ version)"); done
v_med=$(printf '%s\n' "${v[@]}" | median)
# One-shot jobs from a warm pool, in its steady state: after each timed run the pool is
# refilled (untimed; the run's own background filler is waited for), and ctr runs beside it.
"$runner" pool create bb -f "$work/true.yaml" --size 3 >/dev/null
p=(); c2=()
for i in $(seq 1 "$runs"); do
  p+=("$(ms_of "$runner" apply $replace -f "$work/true.yaml")")
  "$runner" pool fill bb >/dev/null
  c2+=("$(ms_of ctr_ run --rm local/busybox:1.35 "p$i" sh -c true)")
done
"$runner" pool rm bb >/dev/null
p_med=$(printf '%s\n' "${p[@]}" | median)
c2_med=$(printf '%s\n' "${c2[@]}" | median)
echo "pooled     runner apply from a warm pool: ${p_med} ms   ctr run --rm: ${c2_med} ms   ratio $(awk "BEGIN{printf \"%.2f\", $p_med/$c2_med}")  (median of $runs)"
eval_pool_rows
echo "floor      lifecycle alone (library): ${l_med} ms = $(awk "BEGIN{printf \"%.2f\", $l_med/$c_med}")x ctr run --rm;  ctr version: ${v_med} ms"
# What a user namespace costs per job (a range lease, idmapped layers and workspace view, the
# overlay mounted by runner, runc entering the namespace): the library lifecycle with a
# workspace in alternating blocks of jobs in their own user namespace and with `hostUsers:
# true`, so drift hits both; each block's first job is reported apart (it pays for the other
# kind's leftovers).
userns=$("$bench" userns $((runs * 3)))
u_med=$(echo "$userns" | sed -n 's/.*"userns_ms_median": \([0-9.]*\).*/\1/p')
h_med=$(echo "$userns" | sed -n 's/.*"host_users_ms_median": \([0-9.]*\).*/\1/p')
u_cost=$(echo "$userns" | sed -n 's/.*"cost_ms": \(-*[0-9.]*\).*/\1/p')
echo "userns     lifecycle with a workspace, own user namespace: ${u_med} ms   hostUsers: true: ${h_med} ms   cost ${u_cost} ms  ($userns)"

ctr_ run -d local/busybox:1.35 anchor sh -c 'sleep 100000' >/dev/null
e=()
for i in $(seq 1 "$runs"); do e+=("$(ms_of ctr_ task exec --exec-id "e$i" anchor /bin/true)"); done
e_med=$(printf '%s\n' "${e[@]}" | median)
x_med=$("$bench" exec "$runs" | sed -n 's/.*"exec_ms_median": \([0-9.]*\).*/\1/p')
echo "exec       runner live exec: ${x_med} ms   ctr task exec: ${e_med} ms   ratio $(awk "BEGIN{printf \"%.2f\", $x_med/$e_med}")  (median of $runs)"

echo "throughput cold:   $("$bench" concurrent "$concurrent")"
"$runner" pool create bb -f "$work/true.yaml" --size "$concurrent" >/dev/null
echo "throughput pooled: $(BENCH_POOL=1 "$bench" concurrent "$concurrent")"
"$runner" pool rm bb >/dev/null
# The same through the command line, and bursts over HTTP (issue 36, item 2).
clirate_rows

# Live sandboxes over HTTP (runner serve on loopback).
echo "bench-token-$$-0123456789abcdef" > "$work/token"
"$runner" serve --listen 127.0.0.1:0 --token-file "$work/token" > "$work/serve.out" 2>"$work/serve.err" &
serve_pid=$!
for _ in $(seq 1 100); do grep -q listening "$work/serve.out" 2>/dev/null && break; sleep 0.05; done
url=$(sed -n 's/^listening on //p' "$work/serve.out")
http=$(BENCH_URL="$url" BENCH_TOKEN="$(cat "$work/token")" "$bench" http "$runs")
http_py=$(BENCH_URL="$url" BENCH_TOKEN="$(cat "$work/token")" BENCH_IMAGE=local/python:3.11 "$bench" http "$runs")
pause=$(pause_rows "$url" "$(cat "$work/token")")
snapshot=$(snapshot_rows "$url" "$(cat "$work/token")"; workspace_rows "$url" "$(cat "$work/token")")
checkpoint=$(checkpoint_rows "$url" "$(cat "$work/token")")
# What keeping the kernel's cgroup attach lock warm saves a cold session (a second server with
# it off, --warm-cgroup-attach off; the two alternate, three rounds of BENCH_SESSIONS each).
# On a host whose cgroup2 is mounted with favordynmods the two are the same.
"$runner" --warm-cgroup-attach off serve --listen 127.0.0.1:0 --token-file "$work/token" > "$work/serve-cold.out" 2>"$work/serve-cold.err" &
cold_pid=$!
for _ in $(seq 1 100); do grep -q listening "$work/serve-cold.out" 2>/dev/null && break; sleep 0.05; done
url_off=$(sed -n 's/^listening on //p' "$work/serve-cold.out")
created_ms() { BENCH_URL="$1" BENCH_TOKEN="$(cat "$work/token")" "$bench" http 1 | sed -n 's/.*"session_create_ms": \([0-9.]*\).*/\1/p'; }
w_on=(); w_off=()
for _ in 1 2 3; do w_on+=("$(created_ms "$url")"); w_off+=("$(created_ms "$url_off")"); done
kill "$serve_pid" "$cold_pid"; wait "$serve_pid" "$cold_pid" 2>/dev/null || true
won_med=$(printf '%s\n' "${w_on[@]}" | sort -n | sed -n 2p); woff_med=$(printf '%s\n' "${w_off[@]}" | sort -n | sed -n 2p)
h_exec=$(echo "$http" | sed -n 's/.*"exec_ms_median": \([0-9.]*\).*/\1/p')
echo "http       busybox: $http"
echo "http       python (bash resident shell): $http_py"
echo "$pause"
echo "$snapshot"
echo "$checkpoint"
echo "http       cold session create, cgroup attach lock kept warm: ${won_med} ms   not: ${woff_med} ms  (median of 3 rounds)"
# The same from warm pools `serve --pool` keeps (sessions claim a member; the pool refills).
mkdir -p "$work/envs"
printf 'apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: bb}\nspec:\n  image: local/busybox:1.35\n---\napiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: py}\nspec:\n  image: local/python:3.11\n' > "$work/envs/envs.yaml"
"$runner" serve --listen 127.0.0.1:0 --token-file "$work/token" --env-dir "$work/envs" --pool bb=2 --pool py=2 > "$work/serve2.out" 2>"$work/serve2.err" &
serve_pid=$!
for _ in $(seq 1 200); do grep -q listening "$work/serve2.out" 2>/dev/null && break; sleep 0.05; done
url=$(sed -n 's/^listening on //p' "$work/serve2.out")
http_pool=$(BENCH_URL="$url" BENCH_TOKEN="$(cat "$work/token")" BENCH_ENV=bb BENCH_PAUSE_MS=800 "$bench" http "$runs")
sleep 1
http_pool_py=$(BENCH_URL="$url" BENCH_TOKEN="$(cat "$work/token")" BENCH_ENV=py BENCH_PAUSE_MS=800 "$bench" http "$runs")
kill "$serve_pid"; wait "$serve_pid" 2>/dev/null || true
"$runner" pool rm bb py >/dev/null
echo "http pool  busybox: $http_pool"
echo "http pool  python: $http_pool_py"
echo "http exec  session exec over HTTP: ${h_exec} ms   ctr task exec: ${e_med} ms   ratio $(awk "BEGIN{printf \"%.2f\", $h_exec/$e_med}")"
# Issue 36's session targets, each beside the plain ctr path of this run: a cold session's
# create → first shell answer (target 40 ms) against `ctr run --rm` (a container started, its
# command answered); a pooled one's (target 5 ms) against `ctr task exec` (an answer from a
# container already running, the plain path's cheapest).
target_row() { # $1 what, $2 the bench's JSON, $3 the target (ms), $4 ctr's ms, $5 ctr's path
  local ms
  ms=$(echo "$2" | sed -n 's/.*"session_create_to_first_answer_ms": \([0-9.]*\).*/\1/p')
  echo "target     $1 create → first answer: ${ms} ms (target $3 ms)   $5: $4 ms   ratio $(awk "BEGIN{printf \"%.2f\", $ms/$4}")"
}
target_row "cold session, busybox:" "$http" 40 "$c_med" "ctr run --rm"
target_row "cold session, python: " "$http_py" 40 "$c_med" "ctr run --rm"
target_row "pooled session, busybox:" "$http_pool" 5 "$e_med" "ctr task exec"
target_row "pooled session, python: " "$http_pool_py" 5 "$e_med" "ctr task exec"

network_rows

# Pulls. The registry gets the Python image from runner's push; the pulls go to a containerd
# of their own, so no blob is shared with the images above, and each pull's image is deleted
# and garbage-collected before the next (every run downloads and unpacks everything).
scripts/registries.sh "$work/registries" >/dev/null
# shellcheck disable=SC1091
. "$work/registries/env"
ref="$RUNNER_TEST_REGISTRY/bench/python:3.11"
"$runner" image tag local/python:3.11 "$ref" >/dev/null
"$runner" --insecure-registry "$RUNNER_TEST_REGISTRY" image push "$ref" >/dev/null 2>&1
RUNNER_STATE_DIR="$work/pull-state" "$runner" daemon start >/dev/null
pull_addr=$(RUNNER_STATE_DIR="$work/pull-state" "$runner" daemon status | sed -n 's/^running (pid [0-9]*) at //p')
timed_rss() { # run a command; print "wall-ms peak-rss-KiB" (fails loudly if it fails)
  # Each pull starts after a sync: a pull is mostly writes (content fsynced, layers unpacked),
  # and without it each pull paid for the previous one's writeback (2–9 s for either tool).
  python3 - "$@" <<'PY'
import os, resource, subprocess, sys, time
os.sync()
t = time.monotonic()
r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
if r.returncode != 0:
    sys.exit(f"{sys.argv[1:]} failed: {r.stderr.decode()[-500:]}")
print(round((time.monotonic() - t) * 1000), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
PY
}
wipe() {
  ctr --address "$pull_addr" -n "$1" images rm "$ref" >/dev/null
  local lease
  lease=$(ctr --address "$pull_addr" -n "$1" leases create | awk '{print $1}')
  ctr --address "$pull_addr" -n "$1" leases delete --sync "$lease" >/dev/null
}
pull_runs=5
: > "$work/pull-r"; : > "$work/pull-c"
pull_r() {
  CONTAINERD_ADDRESS="$pull_addr" CONTAINERD_NAMESPACE="r$1" RUNNER_STATE_DIR="$work/pull-state" \
    timed_rss "$runner" --insecure-registry "$RUNNER_TEST_REGISTRY" image pull "$ref" >> "$work/pull-r"
  wipe "r$1"
}
pull_c() {
  timed_rss ctr --address "$pull_addr" -n "c$1" image pull --plain-http "$ref" >> "$work/pull-c"
  wipe "c$1"
}
for i in $(seq 1 "$pull_runs"); do
  # Alternating order: neither tool always follows the other.
  if [ $((i % 2)) = 1 ]; then pull_r "$i"; pull_c "$i"; else pull_c "$i"; pull_r "$i"; fi
done
pr=$(awk '{print $1*1000}' "$work/pull-r" | median); pc=$(awk '{print $1*1000}' "$work/pull-c" | median)
rr=$(awk 'BEGIN{m=0} {if ($2>m) m=$2} END{printf "%.1f", m/1024}' "$work/pull-r")
rc=$(awk 'BEGIN{m=0} {if ($2>m) m=$2} END{printf "%.1f", m/1024}' "$work/pull-c")
echo "pull       python image (171 MiB) from a loopback registry: runner image pull ${pr} ms   ctr image pull --plain-http ${pc} ms   ratio $(awk "BEGIN{printf \"%.2f\", $pr/$pc}")  (median of $pull_runs)"
echo "           peak RSS: runner ${rr} MiB   ctr ${rc} MiB"
