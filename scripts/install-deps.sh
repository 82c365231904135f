#!/usr/bin/env bash
# install-deps.sh — installs what the build, the tests and the demo need on a fresh Debian machine
# (root or sudo): Debian packages for the control-plane scripts and the images, and a Rust
# toolchain check.
# Go builds of Kubernetes, etcd and helm are done by e2e/cluster/build-bins.sh (cached).
set -euo pipefail
need=()
# buildah, podman, runc and mmdebstrap: the images and the kubelet's container mode (no daemon).
# lua5.1: the Argo CD health check's test (scripts/check-integrations.sh).
for cmd_pkg in curl:curl openssl:openssl python3:python3 git:git cc:gcc buildah:buildah \
  podman:podman runc:runc mmdebstrap:mmdebstrap lua5.1:lua5.1; do
  command -v "${cmd_pkg%%:*}" >/dev/null 2>&1 || need+=("${cmd_pkg#*:}")
done
# PyYAML: the release and integration scripts read YAML with the system python3.
python3 -c 'import yaml' 2>/dev/null || need+=(python3-yaml)
if ((${#need[@]})); then
  sudo=""; [[ $(id -u) == 0 ]] || sudo=sudo
  echo "installing Debian packages: ${need[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}"
fi
command -v go >/dev/null || { echo "install-deps: Go (>= 1.25) is required to build the control plane" >&2; exit 1; }
command -v cargo >/dev/null || { echo "install-deps: a Rust toolchain (>= 1.89, rustup) is required" >&2; exit 1; }
for comp in clippy rustfmt; do   # `make test` lints and checks formatting
  cargo "${comp/rustfmt/fmt}" --version >/dev/null 2>&1 || rustup component add "$comp"
done
