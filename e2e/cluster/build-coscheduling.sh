#!/usr/bin/env bash
# build-coscheduling.sh — build the scheduler-plugins scheduler (sigs.k8s.io/scheduler-plugins,
# cmd/scheduler: kube-scheduler with the out-of-tree plugins, Coscheduling among them) with
# nothing but the Go toolchain and the Go module proxy, into a cache outside the repository, and
# print the directory holding the `scheduler` binary. The second line of the output is the
# module's directory in the Go module cache: its PodGroup CRD (scheduling.x-k8s.io/v1alpha1,
# Apache-2.0 like the whole module) is `manifests/coscheduling/crd.yaml` there.
#
# v0.34.7 is the release the Go module proxy serves here (v0.35.0 was refused). The binary is
# built in a copy of the module's source (cmd, pkg, apis, go.mod, go.sum: 4 MB, under the cache)
# as the main module, so that its go.mod's `replace` directives (the k8s.io staging modules at
# v0.34.7), which `go install pkg@version` refuses, apply, with one change: the proxy refuses
# k8s.io/csi-translation-lib v0.34.7 (and v0.34.6), so v0.34.5 is used (it translates in-tree
# volumes to CSI for the volume-limits plugin; no test pod here has such a volume, and its API
# did not change within v0.34).
# Cold build: about 8 minutes on 2 cores (most of k8s.io/kubernetes' scheduler is compiled);
# one build only: afterwards it prints the cached path.
set -euo pipefail

SP_VERSION=${SCHEDULER_PLUGINS_VERSION:-v0.34.7}
CSI_TRANSLATION_LIB=${CSI_TRANSLATION_LIB_VERSION:-v0.34.5}
ROOT=${DIPHOMA_TOOLS_COSCHEDULING:-${XDG_CACHE_HOME:-$HOME/.cache}/diphoma/coscheduling}
OUT="$ROOT/bin/$SP_VERSION"
SRC="$ROOT/src/$SP_VERSION"

export GOTOOLCHAIN=local GOWORK=off CGO_ENABLED=0
unset GOFLAGS
mod="$(go env GOMODCACHE)/sigs.k8s.io/scheduler-plugins@${SP_VERSION}"
if [[ ! -f "$mod/go.mod" ]]; then
  mkdir -p "$OUT"
  (cd "$OUT" && printf 'module diphoma.invalid/fetch\ngo 1.24.0\n' >go.mod &&
    go mod download "sigs.k8s.io/scheduler-plugins@${SP_VERSION}" && rm -f go.mod go.sum) >&2
fi
if [[ ! -x "$OUT/scheduler" ]]; then
  rm -rf "$SRC" && mkdir -p "$SRC" "$OUT"
  cp -r "$mod/go.mod" "$mod/go.sum" "$mod/cmd" "$mod/pkg" "$mod/apis" "$SRC/"
  chmod -R u+w "$SRC"
  sed -i -E "s#(k8s.io/csi-translation-lib => k8s.io/csi-translation-lib) v[0-9.]+#\1 ${CSI_TRANSLATION_LIB}#" "$SRC/go.mod"
  (cd "$SRC" && go build -mod=mod -trimpath -ldflags="-s -w" -o "$OUT/scheduler.tmp" ./cmd/scheduler) >&2
  mv "$OUT/scheduler.tmp" "$OUT/scheduler"
fi
echo "$OUT"
echo "$mod"
