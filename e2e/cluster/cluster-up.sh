#!/usr/bin/env bash
# cluster-up.sh DIR NODES GPUS [RUNTIME] — the control plane (start.sh) plus the local kubelet as
# a daemon, for the shell: writes DIR/env (KUBECONFIG, PATH with kubectl, helm and the workspace
# binaries, DIPHOMA_KUBELET_SOCKET, DIPHOMA_RUNTIME). RUNTIME `process` (default) runs pods as
# processes of the workspace binaries; `podman` runs them as containers of the local images,
# built first from the debug binaries (images/build.sh debug). With PYTORCH=1 and RUNTIME
# `process`, the image `diphoma-pytorch` of the PyTorch examples maps to the python of the cached
# torch venv with the freshly built wheel (python/install.sh: the venv is created once, ~5.4 GB);
# with `podman`, build that image first (make image-pytorch). Stop with stop.sh DIR.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
D=${1:?usage: $0 DIR NODES GPUS [RUNTIME]}; NODES=${2:-4}; GPUS=${3:-8}; RUNTIME=${4:-process}
if [[ -f "$D/kube-apiserver.pid" ]] && kill -0 "$(cat "$D/kube-apiserver.pid")" 2>/dev/null; then
  echo "a cluster is already up in $D (make cluster-down first)" >&2; exit 1
fi
rm -rf "$D"; mkdir -p "$D"
BIN=$(bash "$HERE/build-bins.sh" 2>/dev/null)
TARGET=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug
[[ "$RUNTIME" == podman ]] && bash "$ROOT/images/build.sh" debug >&2
IMAGES=()
if [[ "${PYTORCH:-0}" == 1 && "$RUNTIME" == process ]]; then
  IMAGES=(--image "diphoma-pytorch=$(bash "$ROOT/python/install.sh")/bin/python")
fi
bash "$HERE/start.sh" "$BIN" "$D" >/dev/null
"$TARGET/diphoma-kubelet" run ${IMAGES[@]+"${IMAGES[@]}"} --kubeconfig "$D/admin.kubeconfig" --root "$D/kubelet" \
  --socket "$D/kubelet.sock" --nodes "$NODES" --gpus "$GPUS" --bin-dir "$TARGET" --runtime "$RUNTIME" \
  </dev/null >"$D/logs/kubelet.log" 2>&1 &
echo $! >"$D/kubelet.pid"
for _ in $(seq 1 100); do [[ -S "$D/kubelet.sock" ]] && break; sleep 0.1; done
[[ -S "$D/kubelet.sock" ]] || { echo "the process kubelet did not start; see $D/logs/kubelet.log" >&2; bash "$HERE/stop.sh" "$D" --keep; exit 1; }
cat >>"$D/env" <<ENV
export PATH=$TARGET:\$PATH
export DIPHOMA_KUBELET_SOCKET=$D/kubelet.sock
export DIPHOMA_RUNTIME=$RUNTIME
ENV
echo "cluster up ($RUNTIME): $NODES nodes × $GPUS GPUs. source $D/env; make cluster-down to stop" >&2
