#!/usr/bin/env bash
# A Python image from Debian: debootstrap --variant=minbase bookworm + python3, packed for
# `runner image import`. The rootfs is cached (RUNNER_IMAGE_CACHE, default
# /var/cache/runner/images) so a second build only re-packs it.
# Usage: build.sh OUT.tar [oci|docker|rootfs]; name: $IMAGE_NAME (default local/python:3.11).
# PYTHON_PACKAGES="python3-ipython ..." adds Debian packages (a rootfs cached apart per list);
# with IPython in the image, sessions' Python runs in IPython's InteractiveShell.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"

out=${1:?usage: build.sh OUT.tar [oci|docker|rootfs]}
format=${2:-oci}
name=${IMAGE_NAME:-local/python:3.11}
suite=${DEBIAN_SUITE:-bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
cache=${RUNNER_IMAGE_CACHE:-/var/cache/runner/images}
extra=${PYTHON_PACKAGES:-}
include="python3,ca-certificates${extra:+,${extra// /,}}"
rootfs="$cache/python-$suite-rootfs${extra:+-$(printf '%s' "$extra" | sha256sum | cut -c1-12)}"

command -v debootstrap >/dev/null || { echo "debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }
if [ ! -f "$rootfs/.complete" ]; then
  echo "debootstrap $suite into $rootfs (first build only; takes a few minutes)"
  rm -rf "$rootfs" "$rootfs.partial"
  mkdir -p "$cache"
  debootstrap --variant=minbase --include="$include" "$suite" "$rootfs.partial" "$mirror" >"$rootfs.log" 2>&1 \
    || { tail -20 "$rootfs.log" >&2; exit 1; }
  # Smaller and reproducible: no package caches or logs, a user for uid 1000.
  rm -rf "$rootfs.partial"/var/cache/apt/archives/*.deb "$rootfs.partial"/var/lib/apt/lists/* "$rootfs.partial"/var/log/*
  chroot "$rootfs.partial" /usr/sbin/useradd -u 1000 -m -s /bin/bash user 2>/dev/null || true
  mkdir -p "$rootfs.partial/workspace"
  touch "$rootfs.partial/.complete"
  mv "$rootfs.partial" "$rootfs"
fi
pack_image "$rootfs" "$out" "$name" "$format" '["python3"]' \
  '["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin","LANG=C.UTF-8","PYTHONDONTWRITEBYTECODE=1"]'
echo "wrote $out ($format, $name)"
