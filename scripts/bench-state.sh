# Sourced by bench.sh: the rows of issue 34 (sandbox state). Uses bench.sh's median, ctr_,
# $runs, $work and a running `runner serve`.
#   pause_rows URL TOKEN   pause and resume of a live busybox session over HTTP (curl's
#                          time_total) vs `ctr task pause/resume` of the anchor container
pause_rows() {
  local url=$1 token=$2 id p=() r=() cp=() cr=() i
  id=$(curl -sf -H "Authorization: Bearer $token" -d '{"environment": {"image": "local/busybox:1.35"}}' "$url/v1/sessions" |
    sed -n 's/.*"id":"\([^"]*\)".*/\1/p')
  [ -n "$id" ] || { echo "pause: no session" >&2; return 1; }
  # curl's time_total in µs (bench.sh's median takes µs).
  call_us() { curl -sf -o /dev/null -w '%{time_total}\n' -X POST -H "Authorization: Bearer $token" "$url/v1/sessions/$id/$1" | awk '{printf "%d\n", $1 * 1e6}'; }
  for i in $(seq 1 "$runs"); do
    p+=("$(call_us pause)"); r+=("$(call_us resume)")
    cp+=("$(ms_of ctr_ task pause anchor)"); cr+=("$(ms_of ctr_ task resume anchor)")
  done
  curl -sf -o /dev/null -X DELETE -H "Authorization: Bearer $token" "$url/v1/sessions/$id"
  local pm rm cpm crm
  pm=$(printf '%s\n' "${p[@]}" | median); rm=$(printf '%s\n' "${r[@]}" | median)
  cpm=$(printf '%s\n' "${cp[@]}" | median); crm=$(printf '%s\n' "${cr[@]}" | median)
  echo "pause      session pause over HTTP: ${pm} ms   resume: ${rm} ms   ctr task pause: ${cpm} ms   resume: ${crm} ms   ratios $(awk "BEGIN{printf \"%.2f / %.2f\", $pm/$cpm, $rm/$crm}")  (median of $runs; target <= 10 ms each)"
}
#   snapshot_rows URL TOKEN  a snapshot of a 100 MiB change (a fresh busybox session each run,
#                          new random data: nothing is shared between runs) over HTTP; then
#                          `runner apply` of a `true` job on that snapshot vs on its base image
#                          (alternating)
snapshot_rows() {
  local url=$1 token=$2 i id t=() took=() frozen=() base=() snap=() answer
  local n=$(( runs < 5 ? runs : 5 ))
  for i in $(seq 1 "$n"); do
    id=$(curl -sf -H "Authorization: Bearer $token" -d '{"environment": {"image": "local/busybox:1.35"}}' "$url/v1/sessions" |
      sed -n 's/.*"id":"\([^"]*\)".*/\1/p')
    curl -sf -o /dev/null -H "Authorization: Bearer $token" -d '{"command": "mkdir -p /opt && head -c 104857600 /dev/urandom > /opt/big", "timeoutSeconds": 60}' "$url/v1/sessions/$id/exec"
    answer=$(curl -sf -w '\n%{time_total}\n' -H "Authorization: Bearer $token" -d '{"name": "bench-100m", "replace": true}' "$url/v1/sessions/$id/snapshot")
    t+=("$(echo "$answer" | tail -1 | awk '{printf "%d\n", $1 * 1e6}')")
    took+=("$(echo "$answer" | sed -n 's/.*"tookMs":\([0-9]*\).*/\1/p' | awk '{print $1 * 1000}')")
    frozen+=("$(echo "$answer" | sed -n 's/.*"frozenMs":\([0-9]*\).*/\1/p' | awk '{print $1 * 1000}')")
    curl -sf -o /dev/null -X DELETE -H "Authorization: Bearer $token" "$url/v1/sessions/$id"
  done
  # Beside it: what containerd alone takes to receive 100 MiB into its content store
  # (`ctr content ingest`, new random data each run) — the floor of any snapshot that keeps
  # its layer blob, as an image must.
  local ing=() d
  for i in $(seq 1 "$n"); do
    head -c 104857600 /dev/urandom > "$work/blob"
    d="sha256:$(sha256sum "$work/blob" | cut -d' ' -f1)"
    ing+=("$(ms_of sh -c "ctr --address '$CONTAINERD_ADDRESS' --namespace '$CONTAINERD_NAMESPACE' content ingest --expected-digest $d --expected-size 104857600 bench-ingest-$i < '$work/blob'")")
    ctr_ content rm "$d" >/dev/null 2>&1 || true
  done
  rm -f "$work/blob"
  local tm im
  tm=$(printf '%s\n' "${t[@]}" | median); im=$(printf '%s\n' "${ing[@]}" | median)
  echo "snapshot   100 MiB change over HTTP: ${tm} ms (runner's own: $(printf '%s\n' "${took[@]}" | median) ms, sandbox frozen $(printf '%s\n' "${frozen[@]}" | median) ms)   ctr content ingest of 100 MiB: ${im} ms   ratio $(awk "BEGIN{printf \"%.2f\", $tm/$im}")  (median of $n; target <= 1000 ms)"
  printf 'apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: on-base}\nspec: {image: local/busybox:1.35}\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: on-base}\nspec: {environment: on-base, command: "true"}\n' > "$work/on-base.yaml"
  sed 's/on-base/on-snap/g; s|local/busybox:1.35|"snapshot:bench-100m"|' "$work/on-base.yaml" > "$work/on-snap.yaml"
  "$runner" apply --replace -f "$work/on-snap.yaml" >/dev/null 2>&1
  for i in $(seq 1 "$runs"); do
    base+=("$(ms_of "$runner" apply --replace -f "$work/on-base.yaml")")
    snap+=("$(ms_of "$runner" apply --replace -f "$work/on-snap.yaml")")
  done
  local bm sm
  bm=$(printf '%s\n' "${base[@]}" | median); sm=$(printf '%s\n' "${snap[@]}" | median)
  echo "snapshot   job start (runner apply, true) from the 100 MiB snapshot: ${sm} ms   from its base image: ${bm} ms   ratio $(awk "BEGIN{printf \"%.2f\", $sm/$bm}")  (median of $runs)"
  # The same from warm pools of the two Environments (steady state: each refilled untimed
  # right after its run, as bench.sh's pooled row: the next run never shares the machine
  # with a filler).
  "$runner" pool create on-base -f "$work/on-base.yaml" --size 2 >/dev/null
  "$runner" pool create on-snap -f "$work/on-snap.yaml" --size 2 >/dev/null
  base=(); snap=()
  for i in $(seq 1 "$runs"); do
    base+=("$(ms_of "$runner" apply --replace -f "$work/on-base.yaml")")
    "$runner" pool fill on-base >/dev/null
    snap+=("$(ms_of "$runner" apply --replace -f "$work/on-snap.yaml")")
    "$runner" pool fill on-snap >/dev/null
  done
  "$runner" pool rm on-base >/dev/null; "$runner" pool rm on-snap >/dev/null
  bm=$(printf '%s\n' "${base[@]}" | median); sm=$(printf '%s\n' "${snap[@]}" | median)
  echo "snapshot   pooled job start from the 100 MiB snapshot: ${sm} ms   from its base image: ${bm} ms   ratio $(awk "BEGIN{printf \"%.2f\", $sm/$bm}")  (median of $runs)"
  "$runner" snapshot rm bench-100m >/dev/null
}
#   workspace_rows URL TOKEN  a snapshot holding a 20 MiB workspace (2,000 files of 10 KiB: a
#                          checked-out, built repository), then `runner apply` of a job on it
#                          with an empty workspace of its own (the snapshot's files are given
#                          to it) vs the same job on the base image after the host copied the
#                          same tree into its workspace (`cp -a`: the way without a snapshot)
workspace_rows() {
  local url=$1 token=$2 id i seeded=() copied=() answer
  id=$(curl -sf -H "Authorization: Bearer $token" -d '{"environment": {"image": "local/busybox:1.35"}}' "$url/v1/sessions" |
    sed -n 's/.*"id":"\([^"]*\)".*/\1/p')
  [ -n "$id" ] || { echo "workspace: no session" >&2; return 1; }
  curl -sf -o /dev/null -H "Authorization: Bearer $token" -d '{"command": "mkdir -p src && i=0; while [ $i -lt 2000 ]; do head -c 10240 /dev/urandom > src/f$i; i=$((i+1)); done", "timeoutSeconds": 120}' "$url/v1/sessions/$id/exec"
  answer=$(curl -sf -H "Authorization: Bearer $token" -d '{"name": "bench-ws", "replace": true, "workspace": true}' "$url/v1/sessions/$id/snapshot")
  curl -sf -o /dev/null -X DELETE -H "Authorization: Bearer $token" "$url/v1/sessions/$id"
  mkdir -p "$work/tree/src"
  for i in $(seq 0 1999); do head -c 10240 /dev/urandom > "$work/tree/src/f$i"; done
  local doc='apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: %s}\nspec: {image: "%s"}\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: %s}\nspec: {environment: %s, workspace: "%s", command: "test -e src/f1999"}\n'
  # shellcheck disable=SC2059
  printf "$doc" ws-snap "snapshot:bench-ws" ws-snap ws-snap "$work/ws-snap" > "$work/ws-snap.yaml"
  # shellcheck disable=SC2059
  printf "$doc" ws-copy local/busybox:1.35 ws-copy ws-copy "$work/ws-copy" > "$work/ws-copy.yaml"
  for i in $(seq 1 "$runs"); do
    rm -rf "$work/ws-snap" "$work/ws-copy"; mkdir "$work/ws-snap"
    seeded+=("$(ms_of "$runner" apply --replace -f "$work/ws-snap.yaml")")
    copied+=("$(ms_of sh -c "cp -a '$work/tree' '$work/ws-copy' && '$runner' apply --replace -f '$work/ws-copy.yaml'")")
  done
  rm -rf "$work/ws-snap" "$work/ws-copy" "$work/tree"
  "$runner" snapshot rm bench-ws >/dev/null
  local sm cm
  sm=$(printf '%s\n' "${seeded[@]}" | median); cm=$(printf '%s\n' "${copied[@]}" | median)
  echo "snapshot   job start with the 20 MiB workspace (2,000 files) from the snapshot: ${sm} ms   cp -a of the tree + the job on its base image: ${cm} ms   ratio $(awk "BEGIN{printf \"%.2f\", $sm/$cm}")  (median of $runs; the snapshot's workspace part: $(echo "$answer" | sed -n 's/.*"workspaceBytes":\([0-9]*\).*/\1/p') bytes)"
}
#   state_only             BENCH_ONLY=state: the anchor container and a `runner serve`, then
#                          the rows above
state_only() {
  ctr_ run -d local/busybox:1.35 anchor sh -c 'sleep 100000' >/dev/null
  echo "bench-token-$$-0123456789abcdef" > "$work/token"
  "$runner" serve --listen 127.0.0.1:0 --token-file "$work/token" > "$work/serve.out" 2>"$work/serve.err" &
  local serve_pid=$! url
  for _ in $(seq 1 100); do grep -q listening "$work/serve.out" 2>/dev/null && break; sleep 0.05; done
  url=$(sed -n 's/^listening on //p' "$work/serve.out")
  pause_rows "$url" "$(cat "$work/token")"
  snapshot_rows "$url" "$(cat "$work/token")"
  workspace_rows "$url" "$(cat "$work/token")"
  kill "$serve_pid"; wait "$serve_pid" 2>/dev/null || true
}
