#!/usr/bin/env bash
# The Python client's tests against real servers: clients/python/run-tests.sh RUNNER_BIN [PYTEST_ARGS...]
#
# Makes a venv in a temporary directory, installs this package (with its `test` extra: pytest,
# PyYAML) into it, starts two `RUNNER_BIN serve` (one on 127.0.0.1:<free port>, one on a unix
# socket) with a random token and their own state dirs, runs pytest with their addresses in
# RUNNER_TEST_URL / RUNNER_TEST_SOCKET / RUNNER_TEST_TOKEN, and stops those two servers (by PID)
# however it ends. The tests use the host backend only: no containerd is needed, and none is
# used or started (the servers are pointed at a containerd socket that does not exist).
set -euo pipefail

die() { echo "run-tests.sh: $*" >&2; exit 1; }

[ $# -ge 1 ] || die "usage: $0 RUNNER_BIN [PYTEST_ARGS...]"
bin=$1
shift
[ -x "$bin" ] && [ -f "$bin" ] || die "$bin: not an executable file (build it: cargo build)"
bin=$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-python3}
command -v "$python" >/dev/null || die "$python not found (Python >= 3.9 is needed)"

started=$(date +%s)
work=$(mktemp -d "${TMPDIR:-/tmp}/runner-pyclient.XXXXXX")
server_pids=()
pytest_pid=""

stop_servers() {
    local pid
    for pid in "${server_pids[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${server_pids[@]}"; do
        # A server ends its sessions on SIGTERM; give it 10 s, then SIGKILL that PID.
        for _ in $(seq 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            echo "run-tests.sh: server $pid did not stop on SIGTERM; killing it" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
        wait "$pid" 2>/dev/null || true
    done
    server_pids=()
pytest_pid=""
}

cleanup() {
    local status=$?
    if [ -n "$pytest_pid" ] && kill -0 "$pytest_pid" 2>/dev/null; then
        kill -TERM "$pytest_pid" 2>/dev/null || true
        wait "$pytest_pid" 2>/dev/null || true
    fi
    stop_servers
    if [ "$status" -ne 0 ]; then
        for log in "$work"/*.err; do
            [ -s "$log" ] || continue
            echo "--- $(basename "$log") (the server's stderr) ---" >&2
            tail -n 40 "$log" >&2
        done
    fi
    rm -rf "$work"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- the venv -------------------------------------------------------------------------------
if ! "$python" -c 'import venv, ensurepip' 2>/dev/null; then
    die "Python's venv module (with ensurepip) is missing: on Debian/Ubuntu install the package python3-venv (apt-get install python3-venv)"
fi
if ! "$python" -m venv "$work/venv" >"$work/venv.log" 2>&1; then
    cat "$work/venv.log" >&2
    die "python3 -m venv failed: on Debian/Ubuntu install the package python3-venv (apt-get install python3-venv)"
fi
venv_python=$work/venv/bin/python
"$venv_python" -c 'import sys; assert sys.version_info >= (3, 9), sys.version' ||
    die "Python >= 3.9 is needed"
echo "run-tests.sh: installing runner-client and pytest into a venv" >&2
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
# Built from a copy: an in-tree build would leave build/ and *.egg-info in the repository.
mkdir "$work/pkg"
cp -r "$here/pyproject.toml" "$here/README.md" "$here/src" "$work/pkg/"
"$venv_python" -m pip install --quiet "$work/pkg[test]" ||
    die "pip install of the package failed"

# --- the servers ----------------------------------------------------------------------------
head -c 32 /dev/urandom | base64 >"$work/token"
chmod 600 "$work/token"

# start_server NAME ARGS...: starts `serve` in its own directory and state dir; sets $address
# to what it prints on its first line (after "listening on ").
start_server() {
    local name=$1
    shift
    mkdir -p "$work/$name/state" "$work/$name/cwd"
    (
        cd "$work/$name/cwd"
        RUNNER_STATE_DIR="$work/$name/state" CONTAINERD_ADDRESS="$work/no-containerd.sock" \
            exec "$bin" serve --token-file "$work/token" "$@"
    ) >"$work/$name.out" 2>"$work/$name.err" &
    local pid=$!
    server_pids+=("$pid")
    local line=""
    for _ in $(seq 300); do
        line=$(head -n 1 "$work/$name.out" 2>/dev/null || true)
        case $line in
        "listening on "*) break ;;
        esac
        kill -0 "$pid" 2>/dev/null || die "the $name server exited before listening: $(cat "$work/$name.err")"
        sleep 0.1
    done
    case $line in
    "listening on "*) address=${line#listening on } ;;
    *) die "the $name server printed no 'listening on' line within 30 s: $(cat "$work/$name.err")" ;;
    esac
    echo "run-tests.sh: $name server (pid $pid) on $address" >&2
}

start_server tcp --listen 127.0.0.1:0
tcp_address=$address
case $tcp_address in
http://127.0.0.1:*) ;;
*) die "unexpected TCP address: $tcp_address" ;;
esac
start_server unix --socket "$work/runner.sock"
[ "$address" = "unix:$work/runner.sock" ] || die "unexpected socket address: $address"

# --- the tests ------------------------------------------------------------------------------
cd "$here"
status=0
env -u RUNNER_TOKEN -u RUNNER_URL \
    RUNNER_TEST_URL="$tcp_address" \
    RUNNER_TEST_SOCKET=$work/runner.sock \
    RUNNER_TEST_TOKEN=$(cat "$work/token") \
    RUNNER_TEST_SCRATCH=$work \
    "$venv_python" -m pytest -p no:cacheprovider -q "$here/tests" "$@" &
# In the background and waited for, so that a SIGTERM to this script is handled at once.
pytest_pid=$!
wait "$pytest_pid" || status=$?
pytest_pid=""
echo "run-tests.sh: pytest exited $status after $(($(date +%s) - started)) s" >&2
exit "$status"
