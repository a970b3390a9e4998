#!/usr/bin/env bash
# CRIU for checkpoint/restore/fork (runc runs the `criu` on its PATH). Debian bookworm's
# criu 3.17 fails `criu check` on kernels whose vDSO layout it does not know (6.x: "Unexpected
# rt vDSO area bounds"), so when no working criu is on PATH this builds the one Debian ships in
# trixie (4.1.1) from Debian's own source archive, checked against the archive's SHA-256, and
# installs it as /usr/local/sbin/criu. Cached under $CRIU_CACHE. Idempotent.
set -euo pipefail

VERSION=4.1.1
SHA256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
URL=http://deb.debian.org/debian/pool/main/c/criu/criu_${VERSION}.orig.tar.xz
CACHE=${CRIU_CACHE:-/var/cache/runner/criu-$VERSION}
BUILD_DEPS=(gcc make pkg-config xz-utils libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler libnl-3-dev libnet1-dev libcap-dev libbsd-dev libnftables-dev uuid-dev libgnutls28-dev iproute2 nftables)

if command -v criu >/dev/null && criu check >/dev/null 2>&1; then
  exit 0
fi
if [ ! -x "$CACHE/criu" ]; then
  missing=()
  for p in "${BUILD_DEPS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "criu: installing build dependencies ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  echo "criu: building $VERSION from Debian's source archive"
  curl -fsSL --retry 3 -o "$work/criu.tar.xz" "$URL"
  echo "$SHA256  $work/criu.tar.xz" | sha256sum -c --quiet -
  tar -C "$work" -xf "$work/criu.tar.xz"
  make -C "$work/criu-$VERSION" -j"$(nproc)" criu >"$work/build.log" 2>&1 || { tail -30 "$work/build.log" >&2; exit 1; }
  mkdir -p "$CACHE"
  install -m 0755 "$work/criu-$VERSION/criu/criu" "$CACHE/criu"
fi
install -m 0755 "$CACHE/criu" /usr/local/sbin/criu
hash -r
if ! /usr/local/sbin/criu check >/dev/null 2>&1; then
  echo "criu: /usr/local/sbin/criu check fails on this host:" >&2
  /usr/local/sbin/criu check >&2 || true
  exit 1
fi
case ":$PATH:" in *:/usr/local/sbin:*) ;; *) echo "criu: /usr/local/sbin is not on PATH" >&2; exit 1 ;; esac
[ "$(command -v criu)" = /usr/local/sbin/criu ] || { echo "criu: $(command -v criu) comes before /usr/local/sbin/criu on PATH" >&2; exit 1; }
echo "criu: $(/usr/local/sbin/criu --version | head -1) ready"
