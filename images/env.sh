# Sourced by the image scripts: the local image store's settings and the two steps every local
# build shares. Root and no daemon; the vfs storage driver (no overlay mounts needed), runc with
# cgroupfs and explicit ulimits (crun raises RLIMIT_NOFILE above the hard limit and refuses the
# hybrid cgroup layout of these machines).
podman() { command podman --storage-driver vfs "$@"; }
buildah() { command buildah --storage-driver vfs "$@"; }

# The chart's appVersion: the tag of every image.
diphoma_image_version() {
  sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$(dirname "${BASH_SOURCE[0]}")/../charts/diphoma-operator/Chart.yaml"
}

# ensure_base IMAGE VARIANT PACKAGES — a Debian bookworm root filesystem with PACKAGES (comma
# separated; mmdebstrap VARIANT: extract unpacks only, apt also configures), imported as IMAGE
# once. The local stand-in for a base image, as no image registry is reachable here.
ensure_base() {
  podman image exists "$1" && return 0
  local tar; tar=$(mktemp --suffix=.tar)
  mmdebstrap --quiet --variant="$2" --include="$3" bookworm "$tar" && podman import --quiet "$tar" "$1" >/dev/null
  local rc=$?; rm -f "$tar"; return $rc
}

# The registry the chart's defaults and the examples name; local builds carry its tag too, so
# that they run unchanged on the local cluster.
DIPHOMA_REGISTRY=ghcr.io/diphoma

# build_image NAME CONTAINERFILE CONTEXT [BUILDAH ARGS...] — builds localhost/NAME:VERSION, also
# tagged $DIPHOMA_REGISTRY/NAME:VERSION (nothing pulled), and prints its name, size and seconds. The working containers that buildah keeps
# for the intermediate stages of this build are removed, and the untagged images they leave.
build_image() {
  local ref before start=$SECONDS; ref=localhost/$1:$(diphoma_image_version)
  before=$(buildah containers --quiet | sort)
  buildah bud --quiet --pull=never --layers=false --runtime=runc --ulimit=nofile=20000:20000 \
    --ulimit=nproc=32768:32768 -t "$ref" -t "$DIPHOMA_REGISTRY/$1:$(diphoma_image_version)" \
    -f "$2" "${@:4}" "$3" >/dev/null || return 1
  for c in $(comm -13 <(echo "$before") <(buildah containers --quiet | sort)); do
    buildah rm "$c" >/dev/null
  done
  buildah rmi --prune >/dev/null 2>&1 || true
  printf '%s\t%s MB\t%s s\n' "$ref" "$(($(podman image inspect --format '{{.Size}}' "$ref") / 1000000))" "$((SECONDS - start))"
}
