#!/usr/bin/env bash
# install-operator.sh [HELM FLAGS...] — installs the operator with its Helm chart, as a user
# would: release diphoma-operator in namespace diphoma-system, which enforces the Pod Security
# "restricted" profile; waits until the operator is ready. Needs kubectl and helm on PATH and
# KUBECONFIG. Used by `make demo` and by the e2e tests (OperatorMode::Chart).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
ns=diphoma-system
kubectl create namespace "$ns" >/dev/null
kubectl label namespace "$ns" pod-security.kubernetes.io/enforce=restricted >/dev/null
if ! helm install diphoma-operator "$ROOT/charts/diphoma-operator" -n "$ns" --wait --timeout 300s "$@" >/dev/null; then
  # Say why the operator is not ready (its pods, their events and conditions), then fail.
  kubectl -n "$ns" get pods -o wide >&2 || true
  kubectl -n "$ns" describe pods >&2 || true
  exit 1
fi
