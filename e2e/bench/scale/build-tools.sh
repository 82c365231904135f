#!/usr/bin/env bash
# build-tools.sh — build kwok and Kubeflow's training operator for the scale benchmark from the
# Go module proxy, cached outside the repository like e2e/cluster/build-bins.sh. Prints the cache
# directory: bin/{kwok,training-operator.v1}, kwok's kustomize/ manifests and the training
# operator's CRDs (manifests/base/crds) copied from the two modules.
#
# kwok: plain `go install sigs.k8s.io/kwok/cmd/kwok@KWOK_VERSION`.
# training operator: its own cmd/training-operator.v1/main.go, built in a wrapper module that
# requires github.com/kubeflow/training-operator@TO_VERSION, with one line changed: the webhook
# server gets `Host: "127.0.0.1"` (upstream binds it on every interface, and has no flag for it;
# everything here listens on loopback only). Nothing else differs from upstream.
set -euo pipefail
KWOK_VERSION=${KWOK_VERSION:-v0.8.0}
TO_VERSION=${TO_VERSION:-v1.8.1}
ROOT=${DIPHOMA_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/diphoma}/scale-tools
OUT="$ROOT/kwok-$KWOK_VERSION+to-$TO_VERSION"
export GOTOOLCHAIN=local GOWORK=off CGO_ENABLED=0
unset GOFLAGS
mkdir -p "$OUT/bin"
modcache=$(go env GOMODCACHE)
if [[ ! -x "$OUT/bin/kwok" ]]; then
  GOBIN="$OUT/bin" go install -trimpath -ldflags="-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
fi
if [[ ! -x "$OUT/bin/training-operator.v1" ]]; then
  src="$ROOT/src/training-operator-$TO_VERSION"
  mkdir -p "$src"
  cd "$src"
  printf 'module local.test/training-operator-bin\n\ngo 1.22\n\nrequire github.com/kubeflow/training-operator %s\n' "$TO_VERSION" >go.mod
  go mod download "github.com/kubeflow/training-operator@$TO_VERSION"
  upstream="$modcache/github.com/kubeflow/training-operator@$TO_VERSION/cmd/training-operator.v1/main.go"
  sed 's/^\([[:space:]]*\)Port: webhookServerPort,/\1Host: "127.0.0.1", Port: webhookServerPort,/' "$upstream" >main.go
  grep -q 'Host: "127.0.0.1", Port: webhookServerPort' main.go || { echo "could not patch $upstream" >&2; exit 1; }
  go mod tidy
  go build -trimpath -ldflags="-s -w" -o "$OUT/bin/training-operator.v1" .
fi
if [[ ! -d "$OUT/kwok-kustomize" ]]; then
  go mod download "sigs.k8s.io/kwok@$KWOK_VERSION"
  cp -r "$modcache/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize" "$OUT/kwok-kustomize"
  chmod -R u+w "$OUT/kwok-kustomize"
fi
if [[ ! -d "$OUT/to-crds" ]]; then
  cp -r "$modcache/github.com/kubeflow/training-operator@$TO_VERSION/manifests/base/crds" "$OUT/to-crds"
  chmod -R u+w "$OUT/to-crds"
fi
echo "$OUT"
