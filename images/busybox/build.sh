#!/usr/bin/env bash
# A tiny test image from Debian's busybox-static: /bin/busybox and its applets, a passwd with
# root, nobody and a uid 1000 user, /tmp. Usage: build.sh OUT.tar [oci|docker|rootfs]
# Name: $IMAGE_NAME (default local/busybox:1.35).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"

out=${1:?usage: build.sh OUT.tar [oci|docker|rootfs]}
format=${2:-oci}
name=${IMAGE_NAME:-local/busybox:1.35}
busybox=/bin/busybox
[ -x "$busybox" ] || { echo "busybox-static is not installed (apt-get install busybox-static)" >&2; exit 1; }
file -L "$busybox" 2>/dev/null | grep -q "statically linked" || ldd "$busybox" 2>&1 | grep -q "not a dynamic" \
  || { echo "$busybox is not static" >&2; exit 1; }

rootfs=$(mktemp -d)
trap 'rm -rf "$rootfs"' EXIT
mkdir -p "$rootfs"/{bin,etc,tmp,root,workspace,home/user,usr/bin,proc,sys,dev}
chmod 1777 "$rootfs/tmp"
cp "$busybox" "$rootfs/bin/busybox"
for applet in $("$busybox" --list); do
  [ "$applet" = busybox ] || ln -sf busybox "$rootfs/bin/$applet"
done
ln -sf ../../bin/env "$rootfs/usr/bin/env"
printf 'root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' > "$rootfs/etc/passwd"
printf 'root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n' > "$rootfs/etc/group"
chown 1000:1000 "$rootfs/home/user"
pack_image "$rootfs" "$out" "$name" "$format" '["sh"]' '["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]'
echo "wrote $out ($format, $name)"
