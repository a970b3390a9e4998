# Shared by the image recipes: pack a root filesystem directory into an archive that
# `runner image import` loads. Formats: oci (OCI image layout tar, named), docker
# (`docker save` layout), rootfs (a plain tarball; import it with --name).
# Usage: pack_image ROOTFS_DIR OUT.tar NAME FORMAT CMD_JSON ENV_JSON
set -euo pipefail

go_arch() {
  case "$(uname -m)" in
    x86_64) echo amd64 ;;
    aarch64) echo arm64 ;;
    *) uname -m ;;
  esac
}

sha256() { sha256sum "$1" | cut -d' ' -f1; }

pack_image() {
  local rootfs=$1 out=$2 name=$3 format=$4 cmd_json=$5 env_json=$6
  local work
  work=$(mktemp -d)
  # Reproducible layer: fixed owner, order and times.
  tar --numeric-owner --owner=0 --group=0 --sort=name --mtime=@0 --xattrs --xattrs-include='security.capability' \
    -C "$rootfs" -cf "$work/layer.tar" .
  if [ "$format" = rootfs ]; then
    mv "$work/layer.tar" "$out"
    rm -rf "$work"
    return
  fi
  local layer_sha layer_size config config_sha config_size
  layer_sha=$(sha256 "$work/layer.tar")
  layer_size=$(stat -c %s "$work/layer.tar")
  config="{\"architecture\":\"$(go_arch)\",\"os\":\"linux\",\"config\":{\"Env\":$env_json,\"Cmd\":$cmd_json,\"WorkingDir\":\"/\"},\"rootfs\":{\"type\":\"layers\",\"diff_ids\":[\"sha256:$layer_sha\"]},\"history\":[{\"created_by\":\"runner images/$(basename "$(dirname "$0")")/build.sh\"}]}"
  printf '%s' "$config" > "$work/config.json"
  config_sha=$(sha256 "$work/config.json")
  config_size=$(stat -c %s "$work/config.json")
  mkdir -p "$work/out"
  if [ "$format" = docker ]; then
    mkdir -p "$work/out/$layer_sha"
    mv "$work/layer.tar" "$work/out/$layer_sha/layer.tar"
    mv "$work/config.json" "$work/out/$config_sha.json"
    printf '[{"Config":"%s.json","RepoTags":["%s"],"Layers":["%s/layer.tar"]}]' "$config_sha" "$name" "$layer_sha" > "$work/out/manifest.json"
  else
    mkdir -p "$work/out/blobs/sha256"
    mv "$work/layer.tar" "$work/out/blobs/sha256/$layer_sha"
    mv "$work/config.json" "$work/out/blobs/sha256/$config_sha"
    local manifest manifest_sha manifest_size
    manifest="{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"config\":{\"mediaType\":\"application/vnd.oci.image.config.v1+json\",\"digest\":\"sha256:$config_sha\",\"size\":$config_size},\"layers\":[{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar\",\"digest\":\"sha256:$layer_sha\",\"size\":$layer_size}]}"
    printf '%s' "$manifest" > "$work/manifest.json"
    manifest_sha=$(sha256 "$work/manifest.json")
    manifest_size=$(stat -c %s "$work/manifest.json")
    mv "$work/manifest.json" "$work/out/blobs/sha256/$manifest_sha"
    printf '{"imageLayoutVersion":"1.0.0"}' > "$work/out/oci-layout"
    printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
      "$manifest_sha" "$manifest_size" "$name" "${name##*:}" > "$work/out/index.json"
  fi
  tar --numeric-owner --owner=0 --group=0 --sort=name --mtime=@0 -C "$work/out" -cf "$out" .
  rm -rf "$work"
}
