#!/usr/bin/env bash
# What a request pays for finding the machine idle: `GET /v1/sessions` (no sandbox touched) on
# one keep-alive connection, back to back and after pauses of 50 ms and 0.8 s (as the pooled
# benchmarks pause for a refill), against `runner serve` and, beside it in the same run,
# Python's http.server answering the same path. The server's own time is its access log's.
# On a VM whose idle CPUs halt, a request after a pause waits for a CPU to wake: that wait
# is in every pooled create the benchmarks time, and no server removes it.
# Usage: scripts/bench-idle-wake.sh [N]   (N requests per pause, default 15)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-15}
# shellcheck source=scripts/bench-env.sh
. scripts/bench-env.sh
bench_env idle
cleanup() {
  for p in ${serve_pid:-} ${py_pid:-}; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
echo "idle-token-$$-0123456789abcdef" > "$work/token"
RUNNER_LOG=runner=debug "$runner" serve --listen 127.0.0.1:0 --token-file "$work/token" \
  > "$work/serve.out" 2> "$work/serve.err" &
serve_pid=$!
url=$(bench_url "$work/serve.out" "$work/serve.err")
python3 - "$n" "$url" "$(cat "$work/token")" "$work/serve.err" <<'EOF'
import http.client, http.server, re, socket, statistics, sys, threading, time, urllib.parse

n, url, token, log = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
PAUSES = (0.0, 0.05, 0.8)


class Plain(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self):
        super().setup()
        # Without it Nagle holds the body behind the head: 40 ms per answer.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self):
        body = b"[]"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


plain = http.server.HTTPServer(("127.0.0.1", 0), Plain)
threading.Thread(target=plain.serve_forever, daemon=True).start()


def sweep(host, port):
    conn = http.client.HTTPConnection(host, port)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = {}
    for pause in PAUSES:
        times = []
        for _ in range(n):
            time.sleep(pause)
            t = time.perf_counter()
            conn.request("GET", "/v1/sessions", headers={"Authorization": "Bearer " + token})
            conn.getresponse().read()
            times.append((time.perf_counter() - t) * 1e3)
        out[pause] = statistics.median(times)
    return out


u = urllib.parse.urlparse(url)
ours = sweep(u.hostname, u.port)
theirs = sweep("127.0.0.1", plain.server_address[1])
served = [float(m.group(1)) for m in re.finditer(r'route="/v1/sessions" status=200 ms=([0-9.]+)', open(log).read())]
for i, pause in enumerate(PAUSES):
    own = statistics.median(served[i * n:(i + 1) * n]) if len(served) >= (i + 1) * n else float("nan")
    print("idle wake  pause %4.2f s: runner serve %.2f ms (its own time %.3f ms)   python http.server %.2f ms"
          % (pause, ours[pause], own, theirs[pause]))
EOF
