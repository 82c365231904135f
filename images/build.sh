#!/usr/bin/env bash
# build.sh [PROFILE] — builds the operator, worker and probe images (images/*.Containerfile) into
# the local image store from the workspace's binaries of PROFILE (release: `make images`; debug:
# the container-mode tests and the demo, which run the binaries they built), on a local stand-in
# for distroless `cc` (Debian's libc6 and libgcc-s1). Tags: localhost/NAME:VERSION, VERSION the
# chart's appVersion. Prints one line per image: name, size, seconds.
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
  cp "$bin" "$ctx/target/$PROFILE/"
  build_image "diphoma-$image" "$HERE/$image.Containerfile" "$ctx" --build-arg "BASE=$BASE" \
    --build-arg BINARIES=prebuilt --build-arg "PROFILE=$PROFILE"
done
