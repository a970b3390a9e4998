#!/usr/bin/env bash
# Install what building and testing runner needs, from Debian's packages. Idempotent: skips
# apt-get entirely when everything is already there.
set -euo pipefail

PACKAGES=(containerd runc gcc protobuf-compiler containernetworking-plugins busybox-static iproute2 debootstrap procps python3 python3-venv docker-registry skopeo apache2-utils openssl curl nftables iptables dnsmasq-base jq mkdocs)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
"$(dirname "$0")/criu.sh"
command -v cargo >/dev/null || { echo "deps: cargo is not installed (install a Rust toolchain)" >&2; exit 1; }
rustup component list --installed 2>/dev/null | grep -q rustfmt || rustup component add rustfmt clippy >/dev/null 2>&1 || true
