# Sourced by bench.sh: the CRIU rows of issue 34. Uses bench.sh's median (µs in, ms out), $runs,
# $work and a running `runner serve` (with CRIU on its PATH: scripts/criu.sh).
#   checkpoint_rows URL TOKEN  on the Python image, each run a fresh session holding 100 MiB of
#     Python heap: its checkpoint; a restore of it to the first Python answer vs a cold session
#     to its first Python answer (the plain path to a Python sandbox); a fork into 10 vs 10 cold
#     sessions made at once (each to its first answer).
checkpoint_rows() {
  local url=$1 token=$2 i id n=$(( runs < 5 ? runs : 5 ))
  local ck=() restore=() cold=() fork=() cold10=()
  local auth="Authorization: Bearer $token"
  us() { awk '{printf "%d\n", $1 * 1e6}'; }
  since_us() { awk -v now="$(date +%s.%N)" -v t0="$1" 'BEGIN{printf "%d\n", (now - t0) * 1e6}'; }
  new_session() { curl -sf -H "$auth" -d "$1" "$url/v1/sessions" | sed -n 's/.*"id":"\([^"]*\)".*/\1/p'; }
  first_answer() { curl -sf -o /dev/null -H "$auth" -d '{"code": "print(1)"}' "$url/v1/sessions/$1/python"; }
  delete() { curl -sf -o /dev/null -X DELETE -H "$auth" "$url/v1/sessions/$1"; }
  # Seconds (as µs) of a cold session to its first Python answer.
  cold_one() {
    local t0 s
    t0=$(date +%s.%N)
    s=$(new_session '{"environment": {"image": "local/python:3.11"}}')
    first_answer "$s"
    since_us "$t0"
    delete "$s"
  }
  for i in $(seq 1 "$n"); do
    id=$(new_session '{"environment": {"image": "local/python:3.11"}}')
    [ -n "$id" ] || { echo "checkpoint: no session" >&2; return 1; }
    curl -sf -o /dev/null -H "$auth" -d '{"code": "big = bytearray(100 << 20)\nbig[::4096] = b\"x\" * len(big[::4096])"}' "$url/v1/sessions/$id/python"
    ck+=("$(curl -sf -o /dev/null -w '%{time_total}\n' -H "$auth" -d '{"name": "bench-ck", "replace": true}' "$url/v1/sessions/$id/checkpoint" | us)")
    local t0 r
    t0=$(date +%s.%N)
    r=$(new_session '{"fromCheckpoint": "bench-ck"}')
    [ -n "$r" ] || { echo "checkpoint: no restore" >&2; return 1; }
    first_answer "$r"
    restore+=("$(since_us "$t0")")
    delete "$r"
    cold+=("$(cold_one)")
    fork+=("$(curl -sf -o "$work/fork.json" -w '%{time_total}\n' -H "$auth" -d '{"count": 10}' "$url/v1/sessions/$id/fork" | us)")
    for s in $(grep -o '"id":"[^"]*"' "$work/fork.json" | cut -d'"' -f4); do delete "$s"; done
    delete "$id"
    # 10 cold sessions at once, to their first answers.
    t0=$(date +%s.%N)
    local ids=() pids=()
    local j
    # Waited for by PID: a caller that runs this in its own shell (restore-phases.sh) has its
    # `runner serve` as a background job too, which a bare `wait` would wait for forever.
    for j in $(seq 1 10); do new_session '{"environment": {"image": "local/python:3.11"}}' > "$work/cold-$j" & pids+=($!); done
    wait "${pids[@]}"
    for f in "$work"/cold-*; do ids+=("$(cat "$f")"); rm -f "$f"; done
    pids=()
    for s in "${ids[@]}"; do first_answer "$s" & pids+=($!); done
    wait "${pids[@]}"
    cold10+=("$(since_us "$t0")")
    for s in "${ids[@]}"; do delete "$s"; done
  done
  curl -sf -o /dev/null -X DELETE -H "$auth" "$url/v1/checkpoints/bench-ck"
  local ckm rm cm fm c10
  ckm=$(printf '%s\n' "${ck[@]}" | median); rm=$(printf '%s\n' "${restore[@]}" | median)
  cm=$(printf '%s\n' "${cold[@]}" | median); fm=$(printf '%s\n' "${fork[@]}" | median)
  c10=$(printf '%s\n' "${cold10[@]}" | median)
  echo "checkpoint python session with 100 MiB heap: checkpoint ${ckm} ms   restore to first answer ${rm} ms (target <= 300) vs cold session to first answer ${cm} ms, ratio $(awk "BEGIN{printf \"%.2f\", $rm/$cm}")   fork into 10: ${fm} ms (target <= 3000) vs 10 cold sessions at once ${c10} ms, ratio $(awk "BEGIN{printf \"%.2f\", $fm/$c10}")  (median of $n)"
}
