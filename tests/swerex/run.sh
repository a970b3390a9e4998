#!/usr/bin/env bash
# SWE-ReX compatibility: SWE-ReX 1.4.0 (from PyPI, in a fresh venv) drives a host-backend
# session of `RUNNER_BIN serve` through its RemoteRuntime, and the same sequence through its
# own LocalRuntime; test_swerex.py compares the two. No containerd is needed (or started).
#
#   tests/swerex/run.sh target/debug/runner
set -euo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 RUNNER_BIN" >&2
    exit 2
fi
runner_bin=$(realpath "$1")
[ -x "$runner_bin" ] || { echo "FAIL: $1 is not an executable" >&2; exit 1; }
here=$(cd "$(dirname "$0")" && pwd)
command -v python3 >/dev/null || { echo "FAIL: python3 is required" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/runner-swerex-test.XXXXXX")
server_pid=
cleanup() {
    if [ -n "$server_pid" ]; then
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT
# Stopped by a signal, still stop the server (bash runs the EXIT trap only on exit).
trap 'exit 143' TERM INT

python3 -m venv "$work/venv" || { echo "FAIL: python3 -m venv failed (is the venv module installed?)" >&2; exit 1; }
# RemoteRuntime imports aiohttp, which swe-rex 1.4.0 does not declare (SWE-agent brings it).
"$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check swe-rex==1.4.0 aiohttp \
    || { echo "FAIL: installing swe-rex==1.4.0 (and aiohttp) from PyPI failed" >&2; exit 1; }
py="$work/venv/bin/python"

"$py" -c 'import secrets; print(secrets.token_hex(24))' >"$work/token"
mkdir -p "$work/state"
# A containerd address that does not exist: serve uses only what this test asks for (host
# sessions) and never starts a private containerd.
RUNNER_STATE_DIR="$work/state" CONTAINERD_ADDRESS="$work/no-containerd.sock" \
    "$runner_bin" serve --listen 127.0.0.1:0 --token-file "$work/token" \
    >"$work/serve.out" 2>"$work/serve.err" &
server_pid=$!

url=
for _ in $(seq 200); do
    if line=$(head -n 1 "$work/serve.out" 2>/dev/null) && [ -n "$line" ]; then
        url=${line#listening on }
        break
    fi
    if ! kill -0 "$server_pid" 2>/dev/null; then
        echo "FAIL: runner serve exited:" >&2
        cat "$work/serve.err" >&2
        exit 1
    fi
    sleep 0.1
done
[ -n "$url" ] || { echo "FAIL: runner serve did not say where it listens" >&2; cat "$work/serve.err" >&2; exit 1; }
echo "runner serve (pid $server_pid) at $url"

# A host-backend session, with the bearer token.
session=$("$py" - "$url" "$work/token" <<'EOF'
import json, sys, urllib.request
url, token_file = sys.argv[1], sys.argv[2]
token = open(token_file).read().strip()
req = urllib.request.Request(
    url + "/v1/sessions",
    data=json.dumps({"environment": {"backend": "host"}}).encode(),
    headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"},
    method="POST",
)
with urllib.request.urlopen(req, timeout=60) as r:
    assert r.status == 201, r.status
    print(r.read().decode())
EOF
)
echo "session: $session"

status=0
"$py" "$here/test_swerex.py" "$url" "$work/token" "$session" || status=$?
if [ "$status" -ne 0 ]; then
    echo "--- runner serve stderr ---" >&2
    cat "$work/serve.err" >&2
    echo "FAIL: test_swerex.py exited with $status" >&2
    exit "$status"
fi
echo "PASS"
