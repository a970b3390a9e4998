#!/usr/bin/env bash
# Start the test registries: Debian's docker-registry (the CNCF distribution registry) on
# loopback, three times: plain HTTP without auth, TLS (a CA this script makes) with htpasswd
# auth, and TLS that demands a client certificate (mutual TLS) as well as htpasswd auth. Usage: scripts/registries.sh DIR — writes DIR/env (the variables the tests read) and
# DIR/pids (what to stop). Nothing here listens beyond 127.0.0.1.
set -euo pipefail
dir=$1
mkdir -p "$dir"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

plain_port=$(free_port)
tls_port=$(free_port)
mtls_port=$(free_port)
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
# A client certificate the mutual-TLS registry accepts, and one from another CA it refuses.
openssl req -newkey rsa:2048 -nodes -subj "/CN=runner test client" \
  -keyout "$dir/client.key" -out "$dir/client.csr" 2>/dev/null
printf 'extendedKeyUsage=clientAuth\n' >"$dir/client.ext"
openssl x509 -req -in "$dir/client.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
  -days 2 -extfile "$dir/client.ext" -out "$dir/client.cert" 2>/dev/null
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=a stranger" \
  -keyout "$dir/stranger.key" -out "$dir/stranger.cert" 2>/dev/null
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
config mtls "$mtls_port" "  tls:
    certificate: $dir/server.pem
    key: $dir/server.key
    clientcas:
      - $dir/ca.pem" "auth:
  htpasswd:
    realm: runner-test
    path: $dir/htpasswd"

for name in plain tls mtls; do
  docker-registry serve "$dir/$name.yml" >"$dir/$name.log" 2>&1 &
  echo $! >>"$dir/pids"
done
for i in $(seq 100); do
  if curl -fs "http://127.0.0.1:$plain_port/v2/" >/dev/null \
    && [ "$(curl -s -o /dev/null -w '%{http_code}' --cacert "$dir/ca.pem" "https://localhost:$tls_port/v2/")" = 401 ] \
    && [ "$(curl -s -o /dev/null -w '%{http_code}' --cacert "$dir/ca.pem" --cert "$dir/client.cert" --key "$dir/client.key" \
      "https://localhost:$mtls_port/v2/")" = 401 ]; then
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
export RUNNER_TEST_MTLS_REGISTRY=localhost:$mtls_port
export RUNNER_TEST_MTLS_CLIENT_CERT=$dir/client.cert
export RUNNER_TEST_MTLS_CLIENT_KEY=$dir/client.key
export RUNNER_TEST_MTLS_STRANGER_CERT=$dir/stranger.cert
export RUNNER_TEST_MTLS_STRANGER_KEY=$dir/stranger.key
ENV
echo "registries: plain http://127.0.0.1:$plain_port, TLS+auth https://localhost:$tls_port, mutual TLS+auth https://localhost:$mtls_port"
