#!/usr/bin/env bash
# Start the test registries: Debian's docker-registry (the CNCF distribution registry) on
# loopback, twice: plain HTTP without auth, and TLS (a CA this script makes) with htpasswd
# auth. Usage: scripts/registries.sh DIR — writes DIR/env (the variables the tests read) and
# DIR/pids (what to stop). Nothing here listens beyond 127.0.0.1.
set -euo pipefail
dir=$1
mkdir -p "$dir"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

plain_port=$(free_port)
tls_port=$(free_port)
user=runner-test
password=$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')

# A CA and a server certificate for localhost and 127.0.0.1.
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=runner test CA" \
  -keyout "$dir/ca.key" -out "$dir/ca.pem" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" \
  -keyout "$dir/server.key" -out "$dir/server.csr" 2>/dev/null
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' >"$dir/san.ext"
openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
  -days 2 -extfile "$dir/san.ext" -out "$dir/server.pem" 2>/dev/null
htpasswd -Bbn "$user" "$password" >"$dir/htpasswd"

config() { # name port extra-http extra-top
  cat >"$dir/$1.yml" <<YAML
version: 0.1
log:
  level: warn
  accesslog:
    disabled: false
storage:
  filesystem:
    rootdirectory: $dir/$1-data
  delete:
    enabled: true
http:
  addr: 127.0.0.1:$2
$3
$4
YAML
}
config plain "$plain_port" "" ""
config tls "$tls_port" "  tls:
    certificate: $dir/server.pem
    key: $dir/server.key" "auth:
  htpasswd:
    realm: runner-test
    path: $dir/htpasswd"

: >"$dir/pids"
for name in plain tls; do
  docker-registry serve "$dir/$name.yml" >"$dir/$name.log" 2>&1 &
  echo $! >>"$dir/pids"
done
for i in $(seq 100); do
  if curl -fs "http://127.0.0.1:$plain_port/v2/" >/dev/null \
    && [ "$(curl -s -o /dev/null -w '%{http_code}' --cacert "$dir/ca.pem" "https://localhost:$tls_port/v2/")" = 401 ]; then
    break
  fi
  [ "$i" = 100 ] && { cat "$dir"/*.log; echo "registries: did not start" >&2; exit 1; }
  sleep 0.1
done
cat >"$dir/env" <<ENV
export RUNNER_TEST_REGISTRY=127.0.0.1:$plain_port
export RUNNER_TEST_REGISTRY_LOG=$dir/plain.log
export RUNNER_TEST_REGISTRY_DATA=$dir/plain-data
export RUNNER_TEST_TLS_REGISTRY=localhost:$tls_port
export RUNNER_TEST_TLS_REGISTRY_CA=$dir/ca.pem
export RUNNER_TEST_TLS_REGISTRY_USER=$user
export RUNNER_TEST_TLS_REGISTRY_PASSWORD=$password
ENV
echo "registries: plain http://127.0.0.1:$plain_port, TLS+auth https://localhost:$tls_port"
