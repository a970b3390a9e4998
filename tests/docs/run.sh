#!/usr/bin/env bash
# The README's and the book's examples, run as written: every command block marked
# `<!-- ci: run -->` (tests/docs.rs checks each block is marked run or says why it cannot be)
# runs with bash -euo pipefail against the suite's containerd, from a directory holding the
# repository's manifests, with `runner` on PATH, its own state dir and the test images
# imported. `127.0.0.1:8080` becomes a free port; curl fails on an HTTP error. Then the book is
# built with `mkdocs build --strict` (a broken link fails).
#
#   tests/docs/run.sh RUNNER_BIN      (CONTAINERD_ADDRESS, CONTAINERD_NAMESPACE, RUNNER_TEST_IMAGES set)
set -euo pipefail

[ $# -eq 1 ] || { echo "usage: $0 RUNNER_BIN" >&2; exit 2; }
runner_bin=$(realpath "$1")
repo=$(cd "$(dirname "$0")/../.." && pwd)
for v in CONTAINERD_ADDRESS CONTAINERD_NAMESPACE RUNNER_TEST_IMAGES; do
    [ -n "${!v:-}" ] || { echo "FAIL: $v is not set (scripts/test.sh sets it)" >&2; exit 1; }
done
for tool in jq curl python3 mkdocs; do
    command -v "$tool" >/dev/null || { echo "FAIL: $tool is required (scripts/deps.sh installs it)" >&2; exit 1; }
done

work=$(mktemp -d "${TMPDIR:-/tmp}/runner-docs.XXXXXX")
block_pid=
cleanup() {
    # A block's own background processes (a server it started) go with its process group.
    [ -n "$block_pid" ] && kill -TERM -- "-$block_pid" 2>/dev/null || true
    RUNNER_STATE_DIR="$work/state" "$runner_bin" delete job --all >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

mkdir -p "$work/bin" "$work/run"
ln -s "$runner_bin" "$work/bin/runner"
ln -s "$repo/manifests" "$work/run/manifests"
cat >"$work/prelude.sh" <<'PRELUDE'
# An HTTP error fails the block (as a reader would notice it).
curl() { command curl --fail-with-body "$@"; }
PRELUDE
export PATH="$work/bin:$PATH" RUNNER_STATE_DIR="$work/state"
for image in busybox-oci.tar python-oci.tar; do
    runner image import "$RUNNER_TEST_IMAGES/$image" >/dev/null
done

# Blocks as NUL-separated records: file, line, text.
python3 - "$repo" >"$work/blocks" <<'PY'
import pathlib, sys
root = pathlib.Path(sys.argv[1])
pages = [root / "README.md"] + sorted((root / "docs").rglob("*.md"))
for page in pages:
    lines = page.read_text().split("\n")
    for i, line in enumerate(lines):
        if line.strip() == "<!-- ci: run -->" and i + 1 < len(lines) and lines[i + 1].startswith("```"):
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            body = "\n".join(lines[i + 2:end])
            sys.stdout.write(f"{page.relative_to(root)}\0{i + 2}\0{body}\0")
PY

ran=0
while IFS= read -r -d '' file && IFS= read -r -d '' line && IFS= read -r -d '' body; do
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    script="$work/block-$ran.sh"
    { cat "$work/prelude.sh"; printf '%s\n' "${body//127.0.0.1:8080/127.0.0.1:$port}"; } >"$script"
    echo "== $file:$line"
    start=$(date +%s)
    ( cd "$work/run" && exec setsid bash -euo pipefail "$script" ) >"$work/out" 2>&1 &
    block_pid=$!
    if ! timeout 300 tail --pid="$block_pid" -f /dev/null; then
        kill -TERM -- "-$block_pid" 2>/dev/null || true
        echo "FAIL: $file:$line did not end within 300 s" >&2
        cat "$work/out" >&2
        exit 1
    fi
    if ! wait "$block_pid"; then
        echo "FAIL: $file:$line: the block failed; its output:" >&2
        cat "$work/out" >&2
        exit 1
    fi
    kill -TERM -- "-$block_pid" 2>/dev/null || true
    block_pid=
    tail -3 "$work/out" | sed 's/^/   /'
    echo "   ok ($(( $(date +%s) - start )) s)"
    ran=$((ran + 1))
done <"$work/blocks"
[ "$ran" -ge 3 ] || { echo "FAIL: only $ran blocks found to run" >&2; exit 1; }

echo "== the book (mkdocs build --strict)"
(cd "$repo" && mkdocs build --strict --quiet --site-dir "$work/site")
echo "docs: $ran blocks ran, the book builds"
