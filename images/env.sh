# Sourced by the image scripts: the local image store's settings. Root and no daemon; the vfs
# storage driver (no overlay mounts needed), runc with cgroupfs (crun raises RLIMIT_NOFILE above
# the hard limit and refuses the hybrid cgroup layout of these machines).
podman() { command podman --storage-driver vfs "$@"; }
buildah() { command buildah --storage-driver vfs "$@"; }
# The flags every `podman run` here needs (see above).
PODMAN_RUN_FLAGS=(--runtime runc --cgroup-manager cgroupfs)
# The chart's appVersion: the tag of every image.
diphoma_image_version() {
  sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$(dirname "${BASH_SOURCE[0]}")/../charts/diphoma-operator/Chart.yaml"
}
