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
