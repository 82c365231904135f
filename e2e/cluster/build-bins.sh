#!/usr/bin/env bash
# build-bins.sh — build kube-apiserver, kube-controller-manager, kube-scheduler, kubectl
# (from the Go module k8s.io/kubernetes), etcd (from go.etcd.io/etcd/server/v3) and optionally
# helm + kubeconform, using nothing but the Go toolchain and the Go module proxy.
# Verified on Go 1.26.8 (see e2e/cluster/README.md for versions, times, disk and memory).
# Builds only what is missing; outputs live outside the repository so every clone reuses them.
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.36.3}          # a k8s.io/kubernetes tag the proxy serves
ETCD_VERSION=${ETCD_VERSION:-v3.6.14}        # go.etcd.io/etcd/server/v3 tag
HELM_VERSION=${HELM_VERSION:-v3.21.4}        # "" to skip
KUBECONFORM_VERSION=${KUBECONFORM_VERSION:-} # e.g. v0.7.0; "" to skip
ROOT=${DIPHOMA_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/diphoma/k8s-tools}
OUT="$ROOT/bin/$K8S_VERSION"
SRC="$ROOT/src/$K8S_VERSION"

export GOTOOLCHAIN=local   # fail loudly instead of fetching another toolchain
export GOWORK=off          # a go.work above us would force -mod=readonly semantics
export CGO_ENABLED=0       # upstream builds these as static binaries (hack/lib/golang.sh KUBE_STATIC_LIBRARIES)
unset GOFLAGS              # an inherited -mod=vendor / -mod=mod breaks 'go get' / 'go install pkg@v'

mp=${K8S_VERSION#v1.}                  # 36.3
K8S_MINOR=${mp%%.*}                    # 36
STAGING_VERSION="v0.${mp}"             # v0.36.3 — staging modules are tagged v0.<minor>.<patch>
mkdir -p "$OUT" "$SRC/k8s" "$SRC/etcd"

if [[ ! -x "$OUT/kube-apiserver" || ! -x "$OUT/kubectl" ]]; then
  cd "$SRC/k8s"
  printf 'module local.test/k8s-bins\n\ngo 1.24.0\n' > go.mod   # placeholder so go runs in module mode
  # 1. fetch k8s.io/kubernetes' own go.mod and read its staging list + go/godebug lines from it
  go mod download "k8s.io/kubernetes@${K8S_VERSION}"
  modfile="$(go env GOMODCACHE)/cache/download/k8s.io/kubernetes/@v/${K8S_VERSION}.mod"
  staging=$(sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\)[[:space:]]*=>[[:space:]]*\./staging/src/.*#\1#p' "$modfile")
  go_line=$(sed -n 's/^go \([0-9.]*\)[[:space:]]*$/\1/p' "$modfile")
  godebug_line=$(grep -E '^godebug ' "$modfile" || true)
  [[ -n "$staging" && -n "$go_line" ]] || { echo "could not parse $modfile" >&2; exit 1; }
  # 2. the wrapper module: same go/godebug lines as upstream (keeps upstream's GODEBUG defaults),
  #    every staging module replaced by its published v0.x.y twin
  {
    printf 'module local.test/k8s-bins\n\ngo %s\n' "$go_line"
    [[ -n "$godebug_line" ]] && printf '\n%s\n' "$godebug_line"
    printf '\nreplace (\n'
    for m in $staging; do printf '\t%s => %s %s\n' "$m" "$m" "$STAGING_VERSION"; done
    printf ')\n'
  } > go.mod
  # 3. record the four main packages as tools (Go >= 1.24 'tool' directive) and resolve the graph
  go get -tool \
    "k8s.io/kubernetes/cmd/kube-apiserver@${K8S_VERSION}" \
    "k8s.io/kubernetes/cmd/kube-controller-manager@${K8S_VERSION}" \
    "k8s.io/kubernetes/cmd/kube-scheduler@${K8S_VERSION}" \
    "k8s.io/kubernetes/cmd/kubectl@${K8S_VERSION}"
  go mod tidy || go mod tidy -e
  # 4. build, stamping the version the way hack/lib/version.sh does
  date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  ld="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $p.gitVersion=${K8S_VERSION} -X $p.gitMajor=1 -X $p.gitMinor=${K8S_MINOR}"
    ld+=" -X $p.gitTreeState=clean -X $p.buildDate=${date}"
  done
  go build -trimpath -tags=notest,grpcnotrace -ldflags="$ld" -o "$OUT/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubectl
fi

if [[ ! -x "$OUT/etcd" ]]; then
  cd "$SRC/etcd"
  # 'go install go.etcd.io/etcd/server/v3@vX' is refused: server/go.mod has replace directives (../api ...)
  printf 'module local.test/etcd-bin\n\ngo 1.25.0\n\nrequire go.etcd.io/etcd/server/v3 %s\n' "$ETCD_VERSION" > go.mod
  cat > main.go <<'GO'
// Same as go.etcd.io/etcd/server/v3/main.go: the etcd binary is just etcdmain.Main.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
  go mod tidy
  go build -trimpath -ldflags="-s -w" -o "$OUT/etcd" .
fi

if [[ -n "$HELM_VERSION" && ! -x "$OUT/helm" ]]; then
  major=${HELM_VERSION%%.*}   # v3 or v4
  GOBIN="$OUT" go install -trimpath \
    -ldflags="-s -w -X helm.sh/helm/${major}/internal/version.version=${HELM_VERSION}" \
    "helm.sh/helm/${major}/cmd/helm@${HELM_VERSION}"
fi

if [[ -n "$KUBECONFORM_VERSION" && ! -x "$OUT/kubeconform" ]]; then
  GOBIN="$OUT" go install -trimpath -ldflags="-s -w" \
    "github.com/yannh/kubeconform/cmd/kubeconform@${KUBECONFORM_VERSION}"
fi

"$OUT/kube-apiserver" --version >&2    # expect: Kubernetes v1.36.3
# no `| head` here: under pipefail, etcd killed by SIGPIPE would fail the script (exit 141)
etcd_version=$("$OUT/etcd" --version)
echo "${etcd_version%%$'\n'*}" >&2
echo "$OUT"
