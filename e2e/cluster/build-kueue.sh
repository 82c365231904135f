#!/usr/bin/env bash
# build-kueue.sh — build Kueue (sigs.k8s.io/kueue, the manager binary) with nothing but the Go
# toolchain and the Go module proxy, into a cache outside the repository, and print the directory
# holding the `kueue` binary. The module's manifests (config/components/{crd,rbac,webhook,...})
# are then under `$(go env GOMODCACHE)/sigs.k8s.io/kueue@$KUEUE_VERSION/`; the second line of the
# output is that directory.
# Cold build: about 3 minutes and 125 MB on 2 cores (see /work/shared/design/go-tools.md).
set -euo pipefail

KUEUE_VERSION=${KUEUE_VERSION:-v0.17.0}
ROOT=${DIPHOMA_TOOLS_KUEUE:-${XDG_CACHE_HOME:-$HOME/.cache}/diphoma/kueue}
OUT="$ROOT/bin/$KUEUE_VERSION"

export GOTOOLCHAIN=local GOWORK=off CGO_ENABLED=0
unset GOFLAGS
mkdir -p "$OUT"
if [[ ! -x "$OUT/kueue" ]]; then
  GOBIN="$OUT" go install -trimpath -ldflags="-s -w" "sigs.k8s.io/kueue/cmd/kueue@${KUEUE_VERSION}"
fi
mod="$(go env GOMODCACHE)/sigs.k8s.io/kueue@${KUEUE_VERSION}"
if [[ ! -d "$mod/config/components" ]]; then
  # the binary is cached but the module cache was cleaned: fetch the module's files again
  (cd "$OUT" && GOFLAGS=-mod=mod go mod download "sigs.k8s.io/kueue@${KUEUE_VERSION}")
fi
echo "$OUT"
echo "$mod"
