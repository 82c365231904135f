#!/usr/bin/env bash
# build-pytorch.sh — builds images/pytorch.Containerfile into the local image store as
# localhost/diphoma-pytorch:VERSION from the wheel of `make wheel` (target/wheels), on a local
# Debian base with python3 and venv; torch comes from PyPI inside the build, through this
# machine's CA bundle. Several GB (PyPI's torch is the CUDA build): not part of `make test`.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
# shellcheck source=images/env.sh
source "$HERE/env.sh"
BASE=localhost/diphoma-python-base:bookworm
ensure_base "$BASE" apt python3,python3-venv,ca-certificates
ctx=$(mktemp -d); trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/target/wheels"
TARGET=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
cp "$TARGET"/wheels/diphoma-*.whl "$ctx/target/wheels/"
ca=/etc/ssl/certs/ca-certificates.crt
build_image diphoma-pytorch "$HERE/pytorch.Containerfile" "$ctx" --build-arg "BASE=$BASE" \
  --build-arg WHEEL=prebuilt --network=host --volume="$ca:$ca:ro"
