#!/usr/bin/env bash
# The evaluation harnesses on runner, end to end, against a real `runner serve` on the
# containerd named by CONTAINERD_ADDRESS (scripts/test.sh's private one):
#
#   tests/harness/run.sh --install VENV      # the venv only: Inspect AI, Harbor, mini-swe-agent from PyPI
#   tests/harness/run.sh RUNNER_BIN          # everything (HARNESS_VENV=VENV: a venv --install made)
#
# In a fresh venv (Python >= 3.12: Harbor needs it; pip's cache kept in the work dir and
# removed with it) it installs clients/python and clients/harness with its extras, imports
# the busybox and Python test images ($RUNNER_TEST_IMAGES) into a state dir and namespace of
# its own, starts `runner serve` with a random token, and then:
#   1. the package's pytest suite (unit tests, and the sandbox core, Inspect provider, Harbor
#      and mini-swe-agent environments against the server);
#   2. `inspect eval` of tests/harness/inspect_task (mockllm/model; a compose file of two
#      services, one with a warm pool): one sample passes, one fails;
#   3. the same eval interrupted (SIGINT) while its sample runs: nothing is left;
#   4. `harbor run` of tests/harness/harbor_task/hello with Harbor's oracle agent: reward 1;
#   5. `mini` with a scripted model: the run submits, its actions' output is right. The server
#      is restarted on a unix socket first, so the harnesses' RUNNER_SOCKET path runs too.
# A watcher records every session the harnesses make while it lives (its OCI spec through ctr,
# and /proc as the sandbox sees it): each must have runner's hardening. After each harness no
# session, pool or container of the namespace may be left. It stops exactly the PIDs it
# started, and fails loudly: nothing is skipped.
set -euo pipefail

die() { echo "FAIL: $*" >&2; exit 1; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1

# Harbor 0.25 needs Python >= 3.12 (its code uses 3.12 syntax); Inspect and mini-swe-agent run
# on it too, so one interpreter serves all three.
find_python() {
  local p
  for p in ${HARNESS_PYTHON:-} python3.13 python3.12 python3 /root/.pyenv/versions/3.1[2-9]*/bin/python3; do
    command -v "$p" >/dev/null 2>&1 || [ -x "$p" ] || continue
    if "$p" -c 'import sys, venv, ensurepip; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      command -v "$p" 2>/dev/null || echo "$p"
      return 0
    fi
  done
  return 1
}

# install VENV: the venv with the three harnesses from PyPI and this repository's packages.
install() {
  local venv=$1 python
  python=$(find_python) || die "no Python >= 3.12 with venv (Harbor needs 3.12): install one (python3.12 on PATH) or set HARNESS_PYTHON"
  rm -rf "$venv"
  "$python" -m venv "$venv" || die "$python -m venv failed"
  local pkg
  pkg=$(mktemp -d "${venv%/*}/pkg.XXXXXX")
  # Built from copies: an in-tree build would leave build/ and *.egg-info in the repository.
  cp -r "$root/clients/python" "$pkg/python"
  cp -r "$root/clients/harness" "$pkg/harness"
  # Without what an earlier in-tree build left (ignored by git, so only on a developer's
  # checkout): setuptools would package its stale build/lib copies, whose times the copy made
  # as new as the sources', instead of the sources.
  rm -rf "$pkg"/python/build "$pkg"/harness/build "$pkg"/python/src/*.egg-info "$pkg"/harness/src/*.egg-info
  # The releases the issue names, pinned: the suite tests what it says it supports.
  PIP_CACHE_DIR="$pkg/pip-cache" "$venv/bin/python" -m pip install --quiet \
    "$pkg/python" "$pkg/harness[inspect,harbor,mini-swe-agent,test]" \
    inspect-ai==0.3.285 harbor==0.25.0 mini-swe-agent==2.4.6 mypy types-PyYAML \
    || die "pip install of the harnesses failed"
  # (mini-swe-agent makes its config directory on import: here, not in ~/.config.)
  MSWEA_SILENT_STARTUP=1 MSWEA_GLOBAL_CONFIG_DIR="$pkg/mswea" \
    "$venv/bin/python" -c 'import inspect_ai, harbor, minisweagent, runner_harness' || die "the venv cannot import the harnesses"
  rm -rf "$pkg"
}

if [ "${1:-}" = "--install" ]; then
  [ $# -eq 2 ] || die "usage: $0 --install VENV"
  started=$(date +%s)
  install "$2"
  echo "harness venv ready in $(($(date +%s) - started)) s: $("$2/bin/python" -m pip list 2>/dev/null | grep -iE '^(inspect.ai|harbor|mini-swe-agent) ' | tr -s ' ' | paste -sd ',')"
  exit 0
fi

[ $# -eq 1 ] || die "usage: $0 RUNNER_BIN  |  $0 --install VENV"
runner=$(realpath "$1")
[ -x "$runner" ] && [ -f "$runner" ] || die "$1 is not an executable (cargo build)"
: "${CONTAINERD_ADDRESS:?the harness tests run on a containerd: set CONTAINERD_ADDRESS (scripts/test.sh does)}"
: "${RUNNER_TEST_IMAGES:?set RUNNER_TEST_IMAGES to the directory of busybox-oci.tar and python-oci.tar (scripts/test.sh builds them)}"
for image in busybox-oci.tar python-oci.tar; do
  [ -f "$RUNNER_TEST_IMAGES/$image" ] || die "$RUNNER_TEST_IMAGES/$image is missing (images/*/build.sh)"
done
command -v ctr >/dev/null || die "ctr is needed to read the sandboxes' specs (apt-get install containerd)"

began=$(date +%s)
work=$(mktemp -d "${TMPDIR:-/tmp}/runner-harness-test.XXXXXX")
chmod 755 "$work"
export CONTAINERD_NAMESPACE="${CONTAINERD_NAMESPACE:-runner-test}-harness"
export RUNNER_STATE_DIR="$work/state"
server_pid= watcher_pid= child_pid=
ctr_() { ctr --address "$CONTAINERD_ADDRESS" --namespace "$CONTAINERD_NAMESPACE" "$@"; }
cleanup() {
  local status=$?
  for pid in $child_pid $watcher_pid; do kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  if [ -n "$server_pid" ]; then
    kill -TERM "$server_pid" 2>/dev/null || true
    for _ in $(seq 150); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  # What a failure left: removed, and the namespace's cgroups and user-namespace ranges with it.
  "$runner" gc >/dev/null 2>&1 || true
  if [ "$status" -ne 0 ] && [ -s "$work/serve.err" ]; then
    echo "--- runner serve's stderr (last 40 lines) ---" >&2
    tail -n 40 "$work/serve.err" >&2
  fi
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- the venv ------------------------------------------------------------------------------
venv=${HARNESS_VENV:-}
if [ -z "$venv" ]; then
  venv=$work/venv
  echo "== installing Inspect AI, Harbor and mini-swe-agent into a venv"
  install "$venv"
fi
[ -x "$venv/bin/python" ] || die "HARNESS_VENV=$venv has no bin/python (make it with $0 --install $venv)"
py=$venv/bin/python
export PATH="$venv/bin:$PATH"
MSWEA_SILENT_STARTUP=1 MSWEA_GLOBAL_CONFIG_DIR="$work/mswea" "$py" -c 'import inspect_ai, harbor, minisweagent, runner_harness' \
  || die "the venv $venv cannot import the harnesses"

# --- the server ----------------------------------------------------------------------------
for image in busybox-oci.tar python-oci.tar; do
  "$runner" image import "$RUNNER_TEST_IMAGES/$image" >/dev/null || die "importing $image"
done
"$py" -c 'import secrets; print(secrets.token_hex(24))' >"$work/token"
chmod 600 "$work/token"
mkdir -p "$work/cwd"
# start_server --listen 127.0.0.1:0 | --socket PATH: runner serve in the background; $url is
# where it listens, as it says (http://... or unix:...).
start_server() {
  : >"$work/serve.out"
  # (Warnings and errors only: the watcher's polling would fill the access log.)
  (cd "$work/cwd" && RUNNER_LOG=warn exec "$runner" serve "$@" --token-file "$work/token") >"$work/serve.out" 2>>"$work/serve.err" &
  server_pid=$!
  url=
  for _ in $(seq 300); do
    line=$(head -n 1 "$work/serve.out" 2>/dev/null || true)
    case $line in "listening on "*) url=${line#listening on }; break ;; esac
    kill -0 "$server_pid" 2>/dev/null || die "runner serve exited: $(cat "$work/serve.err")"
    sleep 0.1
  done
  [ -n "$url" ] || die "runner serve did not say where it listens within 30 s"
}
# stop_server: SIGTERM, as a node's service manager stops it (it ends every session).
stop_server() {
  kill -TERM "$server_pid"
  wait "$server_pid" || die "runner serve did not stop cleanly: $(tail -n 5 "$work/serve.err")"
  server_pid=
}
start_server --listen 127.0.0.1:0
export RUNNER_URL=$url RUNNER_TOKEN_FILE=$work/token
unset RUNNER_TOKEN RUNNER_SOCKET
# Offline: LiteLLM (under Harbor and mini) would fetch its model price list; Inspect's data
# directory (its logs of sandboxes, auto-compose files) stays in the work dir.
export LITELLM_LOCAL_MODEL_COST_MAP=True MSWEA_CONFIGURED=true MSWEA_SILENT_STARTUP=1 \
  XDG_DATA_HOME="$work/xdg-data" XDG_CONFIG_HOME="$work/xdg-config" XDG_CACHE_HOME="$work/xdg-cache" \
  MSWEA_GLOBAL_CONFIG_DIR="$work/mswea" HOME="$work/home"
mkdir -p "$HOME"
echo "runner serve (pid $server_pid) at $url, namespace $CONTAINERD_NAMESPACE"

"$py" "$here/watch.py" watch "$url" "$work/token" "$work/observed.jsonl" &
watcher_pid=$!
touch "$work/observed.jsonl"

# nothing_left WHAT: no session, pool or container of the namespace remains but the server's
# one warm shim (`serve --warm-shims`, default 1: a seed container whose task is created).
nothing_left() {
  local sessions pools containers tasks seeds
  sessions=$("$py" - <<'EOF'
import os
from runner_harness import server_from_env
with server_from_env().client() as c:
    print(len(c.sessions.list()), len(c.pools.list()))
EOF
)
  containers=$(ctr_ containers ls -q 'labels."runner.dev/kind"!=shim-seed' | wc -l)
  tasks=$(ctr_ tasks ls -q | { grep -vc '^shim-seed-' || true; })
  seeds=$(ctr_ containers ls -q 'labels."runner.dev/kind"==shim-seed' | wc -l)
  echo "after $1: sessions, pools = $sessions; containers=$containers tasks=$tasks warm-shims=$seeds"
  [ "$sessions" = "0 0" ] && [ "$containers$tasks" = "00" ] && [ "$seeds" -le 1 ] || {
    ctr_ containers ls >&2
    die "$1 left sandboxes behind"
  }
}

# hardened WHAT MIN: every session made since the last call had runner's hardening, and at
# least MIN were seen.
mark=0
hardened() {
  sleep 0.3
  local lines
  lines=$(wc -l <"$work/observed.jsonl")
  "$py" "$here/watch.py" check "$work/observed.jsonl" "$mark" "$2" || die "$1: a sandbox without runner's hardening"
  mark=$lines
}

# run_child OUT CMD...: in the background and waited for, so a SIGTERM to this script is
# handled at once (and the child stopped by its PID).
run_child() {
  local out=$1 status=0
  shift
  "$@" >"$out" 2>&1 &
  child_pid=$!
  wait "$child_pid" || status=$?
  child_pid=
  return "$status"
}

# --- 1. the package's own tests ------------------------------------------------------------
echo "== pytest clients/harness (unit, and against the server)"
t=$(date +%s)
(cd "$root/clients/harness" && run_child "$work/pytest.log" "$py" -m pytest -p no:cacheprovider -q tests) \
  || { cat "$work/pytest.log"; die "the runner-harness tests"; }
tail -n 1 "$work/pytest.log"
# Not beside the sandboxes: under CPU load runner's exec timeouts misfire (see the report in
# clients/harness/README.md), which the tests above exercise.
(cd "$root/clients/harness" && run_child "$work/mypy.log" "$py" -m mypy --strict --cache-dir "$work/mypy-cache" src) \
  || { cat "$work/mypy.log"; die "mypy --strict on clients/harness"; }
echo "mypy --strict: $(tail -n 1 "$work/mypy.log")"
mark=$(wc -l <"$work/observed.jsonl")
nothing_left "the pytest suite"
echo "pytest: $(($(date +%s) - t)) s"

# --- 2. inspect eval -----------------------------------------------------------------------
echo "== inspect eval (mockllm/model, sandbox=\"runner\" from compose.yaml, a warm pool)"
t=$(date +%s)
# From the task's directory, as a user runs it (Inspect finds compose.yaml beside task.py).
(cd "$here/inspect_task" && run_child "$work/inspect.log" inspect eval task.py --model mockllm/model \
  --display plain --log-dir "$work/inspect-logs" --log-format json) \
  || { cat "$work/inspect.log"; die "inspect eval"; }
"$py" - "$work/inspect-logs" <<'EOF' || { cat "$work/inspect.log"; die "the inspect eval's results"; }
import glob, json, sys
logs = glob.glob(sys.argv[1] + "/*.json")
assert len(logs) == 1, logs
log = json.load(open(logs[0]))
assert log["status"] == "success", (log["status"], log.get("error"))
scores = {s["id"]: s["scores"]["runs_in_sandbox"] for s in log["samples"]}
print("inspect samples:", {k: (v["value"], v["answer"]) for k, v in scores.items()})
assert scores["add"]["value"] == "C" and scores["add"]["answer"] == "42", scores
assert scores["off-by-one"]["value"] == "I" and scores["off-by-one"]["answer"] == "41", scores
assert log["results"]["scores"][0]["metrics"]["accuracy"]["value"] == 0.5
EOF
# Two samples, two services each.
hardened "inspect eval" 4
grep -q '"pool": "inspect-default-' "$work/observed.jsonl" || die "no inspect sandbox came from the task's warm pool"
nothing_left "inspect eval"
echo "inspect eval: $(($(date +%s) - t)) s"

# --- 3. an interrupted inspect eval --------------------------------------------------------
echo "== inspect eval interrupted (SIGINT while its sample runs)"
t=$(date +%s)
(cd "$here/inspect_task" && exec inspect eval task.py -T hang=true --model mockllm/model --display plain \
  --log-dir "$work/inspect-hang") >"$work/inspect-hang.log" 2>&1 &
child_pid=$!
for _ in $(seq 600); do
  [ "$(wc -l <"$work/observed.jsonl")" -ge "$((mark + 2))" ] && break
  kill -0 "$child_pid" 2>/dev/null || { cat "$work/inspect-hang.log"; die "the hanging eval ended by itself"; }
  sleep 0.1
done
[ "$(wc -l <"$work/observed.jsonl")" -ge "$((mark + 2))" ] || die "the hanging eval's sandboxes never appeared"
sleep 0.5
kill -INT "$child_pid"
for _ in $(seq 300); do kill -0 "$child_pid" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$child_pid" 2>/dev/null; then
  cat "$work/inspect-hang.log"
  die "inspect eval did not stop within 30 s of SIGINT"
fi
wait "$child_pid" || true
child_pid=
hardened "the interrupted inspect eval" 2
nothing_left "the interrupted inspect eval"
echo "interrupted eval: $(($(date +%s) - t)) s"

# --- 4. harbor run -------------------------------------------------------------------------
echo "== harbor run (oracle agent, --env runner_harness.harbor:RunnerEnvironment)"
t=$(date +%s)
(cd "$work" && run_child "$work/harbor.log" harbor run -p "$here/harbor_task/hello" --agent oracle \
  --env runner_harness.harbor:RunnerEnvironment -o "$work/harbor-jobs" -n 1) \
  || { cat "$work/harbor.log"; die "harbor run"; }
"$py" - "$work/harbor-jobs" <<'EOF' || { cat "$work/harbor.log"; die "the harbor run's results"; }
import glob, json, sys
results = glob.glob(sys.argv[1] + "/*/result.json")
assert len(results) == 1, results
trials = glob.glob(sys.argv[1] + "/*/*/result.json")
assert len(trials) == 1, trials
trial = json.load(open(trials[0]))
assert trial.get("exception_info") is None, trial["exception_info"]
rewards = trial["verifier_result"]["rewards"]
print("harbor trial:", trial["trial_name"], "rewards", rewards)
assert rewards == {"reward": 1.0}, rewards
EOF
hardened "harbor run" 1
nothing_left "harbor run"
echo "harbor run: $(($(date +%s) - t)) s"

# --- 5. mini-swe-agent, through a unix socket ---------------------------------------------
echo "== mini (scripted model, runner_harness.mini_swe_agent.RunnerEnvironment; runner serve on a unix socket)"
t=$(date +%s)
kill -TERM "$watcher_pid" && wait "$watcher_pid" || true
stop_server
start_server --socket "$work/runner.sock"
[ "$url" = "unix:$work/runner.sock" ] || die "runner serve --socket says it listens on $url"
export RUNNER_SOCKET=$work/runner.sock
unset RUNNER_URL
"$py" "$here/watch.py" watch "$url" "$work/token" "$work/observed.jsonl" &
watcher_pid=$!
(cd "$work" && run_child "$work/mini.log" mini -c mini.yaml -c "$here/mini/run.yaml" -t "add two numbers" -y \
  --exit-immediately -o "$work/mini.traj.json") || { cat "$work/mini.log"; die "mini"; }
"$py" - "$work/mini.traj.json" <<'EOF' || { cat "$work/mini.log"; die "the mini run's trajectory"; }
import json, sys
traj = json.load(open(sys.argv[1]))
info = traj["info"]
assert info["exit_status"] == "Submitted", info["exit_status"]
assert info["submission"] == "def add(a, b):\n    return a + b\n", info["submission"]
observations = [m["content"] for m in traj["messages"] if m["role"] in ("user", "tool") and "returncode" in str(m["content"])]
print("mini observations:", [o.replace("\n", " ")[:60] for o in observations])
assert '"output": "42\\n"' in observations[0], observations[0]
assert '"returncode": 3' in observations[1] and '"output": "out\\nerr\\n/repo\\n"' in observations[1], observations[1]
EOF
hardened "mini" 1
nothing_left "mini"
echo "mini: $(($(date +%s) - t)) s"

# What gc leaves must be nothing: no cgroup of the namespace, no user-namespace range taken
# (as scripts/test.sh checks for the main suite's namespace).
kill -TERM "$watcher_pid" && wait "$watcher_pid" || true
watcher_pid=
# The server's stop deletes its warm shim too: nothing of the namespace is left in containerd.
stop_server
left=$(ctr_ containers ls -q | wc -l)
[ "$left" = 0 ] || die "the stopped server left $left containers: $(ctr_ containers ls -q)"
"$runner" gc >/dev/null
cgroups=$(find /sys/fs/cgroup -maxdepth 4 -type d -path "*/runner/$CONTAINERD_NAMESPACE*" 2>/dev/null | wc -l)
ranges=$({ grep -l "\"containerd\":\"$CONTAINERD_ADDRESS#$CONTAINERD_NAMESPACE\"" "${RUNNER_USERNS_DIR:-/run/runner/userns}"/* 2>/dev/null || true; } | wc -l)
echo "after gc: cgroups=$cgroups user-namespace-ranges=$ranges"
[ "$cgroups$ranges" = "00" ] || die "cgroups or user-namespace ranges of $CONTAINERD_NAMESPACE left behind"

echo "PASS: the harness suite in $(($(date +%s) - began)) s"
