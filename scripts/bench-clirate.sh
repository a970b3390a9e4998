# Sourced by bench.sh: the rows of issue 36, item 2 (pooled speed through the command line and
# in bursts over HTTP). Uses bench.sh's $runner, $bench, $work, $concurrent, $replace, ctr_ and
# the `true` job in $work/true.yaml.
#   clirate_rows   cli pooled:  $concurrent `runner apply` processes at once (each its own
#                               process and job name, as a CI matrix or a harness shelling out
#                               runs them) from a full, settled pool of $concurrent, to the last
#                               result (target 100 jobs/s), beside $concurrent `ctr run --rm`
#                               at once; median of BENCH_CLI_ROUNDS (5) rounds; two rows: each
#                               apply running its job itself (`--local`), and each handed to a
#                               `runner serve` of the state dir, in the same rounds
#                  http burst:  `runner serve --pool bb=N` with N the largest pool (256), then N
#                               `POST /v1/sessions` at once, to the last 201 (target 300/s) and
#                               to the last first answer, beside the ctr rate above
# BENCH_CLI_ROUNDS=0 skips the CLI row (one `ctr run --rm` burst still gives the HTTP row its
# ratio); BENCH_BURST sets the HTTP burst's size (256); BENCH_BURST_LOG=FILE keeps the burst
# server's stderr there (with RUNNER_LOG=runner=debug: its "claim phase" events).
clirate_rows() {
  local rounds=${BENCH_CLI_ROUNDS:-5} i r
  local state=$RUNNER_STATE_DIR
  for i in $(seq 1 "$concurrent"); do sed "s/name: bench}/name: cli$i}/" "$work/true.yaml" > "$work/cli$i.yaml"; done
  [ "$rounds" -eq 0 ] || "$runner" pool create bb -f "$work/true.yaml" --size "$concurrent" >/dev/null
  # A round starts from a full pool that no filler is working on: the previous round's filler
  # (queued or filling) is waited for, then an explicit fill makes up what it left.
  settle() {
    local _
    for _ in $(seq 1 600); do
      if flock -n "$state/pools/bb.queue" true && flock -n "$state/pools/bb.lock" true; then break; fi
      sleep 0.1
    done
    "$runner" pool fill bb >/dev/null
    "$runner" pool ls -o json | grep -q "\"ready\": *$concurrent\b" ||
      { echo "bench: pool bb is not full before a round: $("$runner" pool ls)" >&2; return 1; }
  }
  burst() { # $1: a label for the files; runs "${@:2}" N times at once ({} is 1..N); prints the wall ms
    local what=$1 s e pids=() n fails=0
    shift
    s=$(date +%s%N)
    for n in $(seq 1 "$concurrent"); do
      "${@//\{\}/$n}" >"$work/$what-$n.out" 2>"$work/$what-$n.err" &
      pids+=($!)
    done
    for n in "${pids[@]}"; do wait "$n" || fails=$((fails + 1)); done
    e=$(date +%s%N)
    if [ "$fails" -gt 0 ]; then
      echo "bench: $fails of $concurrent $what runs failed: $(cat "$work/$what-1.err")" >&2
      return 1
    fi
    echo $(((e - s) / 1000000))
  }
  # The same applies handed to a `runner serve` of the state dir (what a node that runs one
  # gets; `--local` keeps an apply in its own process): the server is started once, and the
  # in-process bursts pass --local so both shapes are measured in the same rounds.
  local served_pid=
  if [ "$rounds" -gt 0 ]; then
    echo "bench-token-$$-0123456789abcdef" > "$work/handoff-token"
    "$runner" serve --listen 127.0.0.1:0 --token-file "$work/handoff-token" > "$work/serve-handoff.out" 2>"$work/serve-handoff.err" &
    served_pid=$!
    for _ in $(seq 1 300); do grep -q listening "$work/serve-handoff.out" 2>/dev/null && break; sleep 0.1; done
    [ -S "$state/serve.sock" ] || { echo "bench: the hand-off server did not start: $(tail -3 "$work/serve-handoff.err")" >&2; kill "$served_pid"; return 1; }
  fi
  local cli=() handed=() ctrs=() pooled=0 pooled_handed=0 p
  for r in $(seq 1 "$rounds"); do
    settle
    cli+=("$(burst cli "$runner" apply --local $replace -f "$work/cli{}.yaml")")
    # Every job's own result, from the pool (the status line names the member's pool).
    p=$(cat "$work"/cli-*.err | grep -c 'Succeeded (Completed) exit=0 .* pool=bb' || true)
    pooled=$((pooled + p))
    settle
    handed+=("$(burst handed "$runner" apply $replace -f "$work/cli{}.yaml")")
    p=$(cat "$work"/handed-*.err | grep -c 'Succeeded (Completed) exit=0 .* pool=bb' || true)
    pooled_handed=$((pooled_handed + p))
    ctrs+=("$(burst ctr ctr_ run --rm local/busybox:1.35 "cr$r-{}" sh -c true)")
  done
  if [ -n "$served_pid" ]; then kill "$served_pid"; wait "$served_pid" 2>/dev/null || true; fi
  [ "$rounds" -eq 0 ] || "$runner" pool rm bb >/dev/null
  [ "$rounds" -gt 0 ] || ctrs+=("$(burst ctr ctr_ run --rm local/busybox:1.35 "cr0-{}" sh -c true)")
  local mid=$(((rounds + 1) / 2)) cli_med ctr_med
  [ "$rounds" -gt 0 ] || mid=1
  ctr_med=$(printf '%s\n' "${ctrs[@]}" | sort -n | sed -n "${mid}p")
  rate() { awk "BEGIN{printf \"%.1f\", $concurrent * 1000 / $1}"; }
  [ "$rounds" -eq 0 ] || {
  cli_med=$(printf '%s\n' "${cli[@]}" | sort -n | sed -n "${mid}p")
  echo "cli pooled $concurrent concurrent runner apply --local from a pool of $concurrent: $(rate "$cli_med") jobs/s to the last result (target 100)   $concurrent concurrent ctr run --rm: $(rate "$ctr_med") jobs/s   ratio $(awk "BEGIN{printf \"%.2f\", $cli_med/$ctr_med}") (runner's time / ctr's)  (median of $rounds rounds: runner ${cli[*]} ms, ctr ${ctrs[*]} ms; $pooled of $((rounds * concurrent)) from the pool; load $(cut -d' ' -f1-3 /proc/loadavg))"
  local handed_med
  handed_med=$(printf '%s\n' "${handed[@]}" | sort -n | sed -n "${mid}p")
  echo "cli pooled $concurrent concurrent runner apply handed to runner serve, from a pool of $concurrent: $(rate "$handed_med") jobs/s to the last result (target 100)   $concurrent concurrent ctr run --rm: $(rate "$ctr_med") jobs/s   ratio $(awk "BEGIN{printf \"%.2f\", $handed_med/$ctr_med}") (runner's time / ctr's)  (median of $rounds rounds: runner ${handed[*]} ms; $pooled_handed of $((rounds * concurrent)) from the pool; load $(cut -d' ' -f1-3 /proc/loadavg))"
  }

  # A burst over HTTP from the largest pool a server keeps.
  local size=${BENCH_BURST:-256} url pid out
  mkdir -p "$work/burst-envs"
  printf 'apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: bb}\nspec:\n  image: local/busybox:1.35\n' > "$work/burst-envs/bb.yaml"
  echo "bench-token-$$-0123456789abcdef" > "$work/burst-token"
  "$runner" serve --listen 127.0.0.1:0 --token-file "$work/burst-token" --env-dir "$work/burst-envs" --pool "bb=$size" > "$work/serve-burst.out" 2>"$work/serve-burst.err" &
  pid=$!
  # The server makes its pool before it listens.
  for _ in $(seq 1 3000); do grep -q listening "$work/serve-burst.out" 2>/dev/null && break; sleep 0.1; done
  url=$(sed -n 's/^listening on //p' "$work/serve-burst.out")
  [ -n "$url" ] || { echo "bench: the burst server did not start: $(tail -3 "$work/serve-burst.err")" >&2; kill "$pid"; return 1; }
  for _ in $(seq 1 600); do "$runner" pool ls -o json | grep -q "\"ready\": *$size\b" && break; sleep 0.5; done
  out=$(BENCH_URL="$url" BENCH_TOKEN="$(cat "$work/burst-token")" BENCH_ENV=bb "$bench" http-burst "$size")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  [ -z "${BENCH_BURST_LOG:-}" ] || cp "$work/serve-burst.err" "$BENCH_BURST_LOG"
  "$runner" pool rm bb >/dev/null
  local created from_pool
  created=$(echo "$out" | sed -n 's/.*"created_per_s": \([0-9.]*\).*/\1/p')
  from_pool=$(echo "$out" | sed -n 's/.*"from_pool": \([0-9]*\).*/\1/p')
  echo "http burst $size sessions at once from a pool of $size: $created sandboxes/s to the last 201 (target 300)   $concurrent concurrent ctr run --rm: $(rate "$ctr_med") containers/s   ratio $(awk "BEGIN{printf \"%.2f\", $concurrent * 1000 / ($created * $ctr_med)}") (time per sandbox / ctr's per container)  ($from_pool from the pool; $out; load $(cut -d' ' -f1-3 /proc/loadavg))"
}
