#!/usr/bin/env bash
# build.sh [PROFILE] — builds the operator, worker and probe images (images/*.Containerfile) into
# the local image store from the workspace's binaries of PROFILE (release: `make images`; debug:
# the container-mode tests and the demo, which run the binaries they built), on a local stand-in
# for distroless `cc` (Debian's libc6 and libgcc-s1), debug info stripped. Tags:
# localhost/NAME:VERSION and ghcr.io/diphoma/NAME:VERSION (what the chart and the examples name),
# VERSION the chart's appVersion. Both profiles write the same tags: the last build wins.
# Prints one line per image: name, size, seconds.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
PROFILE=${1:-release}
# shellcheck source=images/env.sh
source "$HERE/env.sh"
TARGET=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/$PROFILE
BASE=localhost/diphoma-base:bookworm
ensure_base "$BASE" extract libc6,libgcc-s1
ctx=$(mktemp -d); trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/target/$PROFILE"
for image in operator worker probe; do
  bin=$TARGET/diphoma-$image
  [[ -x "$bin" ]] || { echo "images/build.sh: $bin is missing (cargo build first)" >&2; exit 1; }
  strip --strip-debug -o "$ctx/target/$PROFILE/diphoma-$image" "$bin"   # as the Containerfile's stage
  build_image "diphoma-$image" "$HERE/$image.Containerfile" "$ctx" --build-arg "BASE=$BASE" \
    --build-arg BINARIES=prebuilt --build-arg "PROFILE=$PROFILE"
done
