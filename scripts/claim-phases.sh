#!/usr/bin/env bash
# Where a pooled session's creation and first answer spend their time, phase by phase: N
# sessions per image (busybox's sh, the python image's bash) over HTTP from warm pools
# (`runner serve --pool`, RUNNER_LOG=runner=debug), one after another with a pause for the
# refill, then the median of each phase the server logged ("claim phase" events):
#   manifest          the request's documents parsed, bound, resolved (blocking pool)
#   manifest: ...     its steps, each from the create's start. On the async worker: the
#                     request's documents parsed. On the blocking pool, meanwhile: the pool
#                     reached, the scratch workspace made, the env dir read; then, with the
#                     parsed documents, the Job bound (then resolved: "manifest")
#   setup snapshot    whether the Environment snapshots its setup
#   pool key          the pool key: kept per process by Environment shape and image (else the
#                     image resolved and the member spec hashed), inside `claim`
#   key checked       a kept key's image record read again (sent when the claim began, awaited
#                     once the member is readied)
#   member record     what the claim needs of the member (its init, process, user range):
#                     the record its filler wrote, checked against the kernel (a member an
#                     older runner made: its container and task records from containerd)
#   member readied    its agent opened, unused places taken out, hostname set
#   static root back  for a job with assets: the static root the filler took out put back
#   claim             the whole claim: pool key, ready index, rename, member record, readied
#   bind late         workspace, mounts and assets bound into the member
#   member's shell    the member's pre-started shell checked (adopted or killed)
#   live from member  the whole sandbox from the claimed member
#   sandbox           the session's runtime (claim + live from member)
#   session create    the whole create, as the server sees it
#   shell hello sent  the member's shell sent its adoption's hello (the first call sends its
#                     command behind it and reads both answers)
#   shell adopted     the hello's answer read when no call came within 10 ms, or
#   shell started     started after the claim (no member shell), off the create's path
#   access: ...      the access log's time of the create and of the shell calls (the first of
#                     each session and the repeated ones of the last)
# and the client's view: create, create to the first shell answer.
# The phases' own debug lines (~20 per create, each formatted and written) add to the times:
# SERVE_LOG=runner=info leaves only the access log and the client's view, for an A/B of
# binaries as users meet them.
# Usage: [SERVE_LOG=runner=info] scripts/claim-phases.sh [N]   (N defaults to 12)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-12}
# shellcheck source=scripts/bench-env.sh
. scripts/bench-env.sh
bench_env claim
cleanup() {
  if [ -n "${serve_pid:-}" ]; then kill "$serve_pid" 2>/dev/null; wait "$serve_pid" 2>/dev/null || true; fi
  "$runner" pool rm bb py >/dev/null 2>&1 || true
  bench_stop
}
trap cleanup EXIT
bench_containerd
bench_busybox
if [ -f "${RUNNER_TEST_IMAGES:-/nonexistent}/python-oci.tar" ]; then
  "$runner" image import "$RUNNER_TEST_IMAGES/python-oci.tar" >/dev/null
else
  images/python/build.sh "$work/python.tar" oci >/dev/null
  "$runner" image import "$work/python.tar" >/dev/null
fi
mkdir -p "$work/envs"
printf 'apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: bb}\nspec:\n  image: local/busybox:1.35\n---\napiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: py}\nspec:\n  image: local/python:3.11\n' > "$work/envs/envs.yaml"
echo "claim-token-$$-0123456789abcdef" > "$work/token"
RUNNER_LOG=${SERVE_LOG:-runner=debug} "$runner" serve --listen 127.0.0.1:0 --token-file "$work/token" --env-dir "$work/envs" \
  --pool bb=2 --pool py=2 > "$work/serve.out" 2>"$work/serve.err" &
serve_pid=$!
url=$(bench_url "$work/serve.out" "$work/serve.err")
for _ in $(seq 1 600); do
  "$runner" pool ls -o json | python3 -c 'import json,sys; p=json.load(sys.stdin); sys.exit(0 if len(p)==2 and all(x["ready"]==2 for x in p) else 1)' && break
  sleep 0.5
done
for env in bb py; do
  from=$(($(wc -l < "$work/serve.err") + 1))
  client=$(BENCH_URL="$url" BENCH_TOKEN="$(cat "$work/token")" BENCH_ENV=$env BENCH_SESSIONS="$n" BENCH_PAUSE_MS=800 "$bench" http 5)
  tail -n +"$from" "$work/serve.err" | CLIENT="$client" ENV_NAME="$env" python3 -c '
import json, os, re, statistics, sys
phases = {}
for line in sys.stdin:
    m = re.search(r"claim phase phase=\"([^\"]+)\" ms=([0-9.]+)", line)
    if m:
        phases.setdefault(m.group(1), []).append(float(m.group(2)))
    # The access log: each request as the server saw it, from its head read to its answer.
    m = re.search(r"request method=POST route=\"/v1/sessions(/\{id\}/shell)?\" status=20[01] ms=([0-9.]+)", line)
    if m:
        phases.setdefault("access: shell call" if m.group(1) else "access: create", []).append(float(m.group(2)))
c = json.loads(os.environ["CLIENT"])
env = os.environ["ENV_NAME"]
print("%s: %s of %s sessions from the pool (medians, ms; min..max)" % (env, c["from_pool"], c["sessions"]))
order = ["manifest: parsed", "manifest: workspace", "manifest: blocking", "manifest: env dir", "manifest: bound", "manifest", "setup snapshot", "pool key", "member record", "member readied", "key checked", "claim", "bind late", "member\x27s shell", "live from member",
         "sandbox", "session create", "access: create", "shell hello sent", "shell adopted", "shell started", "access: shell call"]
for name in order + sorted(set(phases) - set(order)):
    d = phases.get(name)
    if d:
        print("  %17s %6.2f  (%.2f..%.2f, %d)" % (name, statistics.median(d), min(d), max(d), len(d)))
print("  client: create %s ms, create to first answer %s ms (%s), shell call %s ms" % (
    c["session_create_ms"], c["session_create_to_first_answer_ms"], c["first_answer_range_ms"], c["shell_ms_median"]))
'
done
