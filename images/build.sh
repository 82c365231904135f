#!/usr/bin/env bash
# build.sh [PROFILE] — builds the images of images/*.Containerfile into the local image store
# (root, no daemon: buildah with the vfs driver), from the workspace's binaries of PROFILE
# (release: `make images`; debug: the container-mode tests, which test the binaries they built).
# The base is a local stand-in for distroless `cc` (libc6 and libgcc-s1 from Debian, made once
# with mmdebstrap), since no image registry is reachable here. Tags: localhost/NAME:VERSION with
# VERSION the chart's appVersion. Prints one line per image: name, size, seconds.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
PROFILE=${1:-release}
# shellcheck source=images/env.sh
source "$HERE/env.sh"
VERSION=$(diphoma_image_version)
TARGET=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/$PROFILE
BASE=localhost/diphoma-base:bookworm

if ! podman image exists "$BASE"; then
  tar=$(mktemp --suffix=.tar); trap 'rm -f "$tar"' EXIT
  mmdebstrap --quiet --variant=extract --include=libc6,libgcc-s1 bookworm "$tar"
  podman import --quiet "$tar" "$BASE" >/dev/null
fi

ctx=$(mktemp -d); trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/target/$PROFILE"
for image in operator worker probe; do
  bin=diphoma-$image
  [[ -x "$TARGET/$bin" ]] || { echo "images/build.sh: $TARGET/$bin is missing (cargo build first)" >&2; exit 1; }
  cp "$TARGET/$bin" "$ctx/target/$PROFILE/"
  start=$SECONDS
  buildah bud --quiet --pull=never --layers=false --build-arg "BASE=$BASE" --build-arg BINARIES=prebuilt \
    --build-arg "PROFILE=$PROFILE" -t "localhost/$bin:$VERSION" -f "$HERE/$image.Containerfile" "$ctx" >/dev/null
  size=$(podman image inspect --format '{{.Size}}' "localhost/$bin:$VERSION")
  printf 'localhost/%s:%s\t%s MB\t%s s\n' "$bin" "$VERSION" "$((size / 1000000))" "$((SECONDS - start))"
done
buildah rmi --prune >/dev/null 2>&1 || true   # the intermediate (prebuilt) stages
