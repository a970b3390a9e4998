# Reads numbers from stdin and prints their sum; the expected answer is a static asset.
read -r line
total=0
for n in $line; do total=$((total + n)); done
echo "sum=$total"
expected_file="${RUNNER_STATIC_DIR:-/static}/fixtures/expected.txt"
if [ "sum=$total" = "$(cat "$expected_file")" ]; then echo "PASS"; else echo "FAIL" >&2; exit 1; fi
