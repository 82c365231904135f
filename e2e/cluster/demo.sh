#!/usr/bin/env bash
# demo.sh DIR — on a cluster started by cluster-up.sh: install the operator with its Helm chart,
# apply manifests/examples/digits.yaml (4 GPU workers, elastic 2–6, checkpoints), stream the job's
# progress, kill -9 one worker mid-training and show the ring re-formed at a new generation
# (survivors keep their processes, a replacement joins), wait for Succeeded and print the test
# accuracy; then run the allreduce benchmark as a 4-GPU pod. With DIPHOMA_RUNTIME=podman (what
# `make demo` starts) the operator and the workers run as containers of the local images.
set -euo pipefail
D=${1:?usage: $0 DIR}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck disable=SC1091
source "$D/env"
ns=diphoma-demo
op_ns=diphoma-system
step() { printf '\n== %s\n' "$*"; }
field() { kubectl -n "$ns" get dpj digits -o jsonpath="{$1}"; }
# Prints the job's progress line whenever it changes until `cond` (a bash expression over the
# fields phase, gen, step) holds, or fails after timeout_s.
follow() { # what timeout_s cond
  local what=$1 t=$2 cond=$3 last="" line phase gen step
  local cols='PHASE:.status.phase,READY:.status.ready,GEN:.status.ring.generation,STEP:.status.progress.step,LOSS:.status.progress.loss,SAMPLES/S:.status.progress.samplesPerSecond,CKPT:.status.progress.lastCheckpointStep,RESTARTS:.status.repairs.total'
  for ((i = 0; i < t * 2; i++)); do
    line=$(kubectl -n "$ns" get dpj digits --no-headers -o custom-columns="$cols" 2>/dev/null || true)
    [[ "$line" != "$last" ]] && { printf '  %s\n' "$line"; last=$line; }
    read -r phase _ gen step _ <<<"$line"
    [[ "$phase" == Failed ]] && { echo "the job failed: $(field .status.lastFailure)" >&2; return 1; }
    if eval "$cond"; then return 0; fi
    sleep 0.5
  done
  echo "timed out waiting for $what" >&2; kubectl -n "$ns" get dpj,pods -o wide >&2; return 1
}

step "GPU nodes of the local kubelet"
kubectl get nodes -L nvidia.com/gpu.product,nvidia.com/gpu.count

# Container mode: the images of the local store (images/build.sh), never pulled. They are also
# tagged with the registry the examples name, so digits.yaml applies unchanged.
images=()
if [[ "${DIPHOMA_RUNTIME:-process}" == podman ]]; then
  # shellcheck source=images/env.sh
  source "$ROOT/images/env.sh"
  images=(--set image.repository=localhost/diphoma-operator --set image.pullPolicy=Never
    --set helmTest.image.repository=localhost/diphoma-probe)
  step "the images, in the local image store"
  podman images --filter "reference=localhost/diphoma-*:$(diphoma_image_version)"
fi

step "helm install the operator (namespace $op_ns enforces Pod Security 'restricted')"
bash "$ROOT/e2e/cluster/install-operator.sh" "${images[@]}"
kubectl -n "$op_ns" get pods -o custom-columns='NAME:.metadata.name,STATUS:.status.phase,IMAGE:.spec.containers[0].image,CONTAINER:.status.containerStatuses[0].containerID'

step "apply manifests/examples/digits.yaml"
kubectl create namespace "$ns" >/dev/null
kubectl -n "$ns" wait --for=create serviceaccount/default --timeout=60s >/dev/null
# The local cluster has no storage provisioner: a hostPath PersistentVolume, bound to the
# example's claim, holds the checkpoints (a real cluster's StorageClass provides one).
# (World-writable, as local-path-provisioner makes its directories: the worker image runs as 65532.)
mkdir -p -m 0777 "$D/volumes/digits-checkpoints"
kubectl apply -f - >/dev/null <<YAML
apiVersion: v1
kind: PersistentVolume
metadata: {name: demo-digits-checkpoints}
spec:
  capacity: {storage: 1Gi}
  accessModes: [ReadWriteMany]
  persistentVolumeReclaimPolicy: Retain
  hostPath: {path: $D/volumes/digits-checkpoints}
  claimRef: {namespace: $ns, name: digits-checkpoints}
YAML
kubectl -n "$ns" apply -f "$ROOT/manifests/examples/digits.yaml"
follow "the first ring" 120 '[[ $phase == Running && ${step:-0} =~ ^[0-9]+$ && $step -ge 1 ]]'
kubectl -n "$ns" get pods -o wide
echo "ring membership (generation $(field .status.ring.generation)):"
kubectl -n "$ns" get configmap digits-ring -o jsonpath='{.data.membership\.json}'; echo
follow "step 600" 180 '[[ ${step:-0} =~ ^[0-9]+$ && $step -ge 600 ]]'

step "kill -9 the process of worker 1 mid-training (its container's main process)"
pid=$(kubectl -n "$ns" get pod digits-worker-1 -o jsonpath='{.status.containerStatuses[0].containerID}')
survivor=$(kubectl -n "$ns" get pod digits-worker-0 -o jsonpath='{.status.containerStatuses[0].containerID}')
kill -9 "${pid#process://}"
start=$(date +%s%N)
follow "the repaired ring" 90 '[[ ${gen:-0} =~ ^[0-9]+$ && $gen -ge 2 ]]'
ms=$(( ($(date +%s%N) - start) / 1000000 ))
echo "ring re-formed at generation $(field .status.ring.generation), ${ms} ms after the kill (as seen by polling kubectl)"
echo "repairs: $(field .status.repairs)"
echo "lastFailure: $(field .status.lastFailure)"

step "training goes on to the end"
follow "Succeeded" 600 '[[ $phase == Succeeded ]]'
kubectl -n "$ns" get dpj digits
echo "test accuracy in the job's status: $(field .status.progress.testAccuracy)"
now=$(kubectl -n "$ns" get pod digits-worker-0 -o jsonpath='{.status.containerStatuses[0].state.terminated.exitCode}')
echo "worker 0 kept its process through the repair (${survivor}); it exited with code ${now}"
kubectl -n "$ns" logs digits-worker-0 | grep -E "generation|accuracy" | tail -4
echo "checkpoints: $(ls "$D/volumes/digits-checkpoints" | tr '\n' ' ')"
kubectl -n "$ns" get events --field-selector involvedObject.kind=DiphomaJob -o custom-columns=REASON:.reason,MESSAGE:.message | tail -8

step "the allreduce runtime: a benchmark pod with 4 GPUs (4 ranks)"
kubectl -n "$ns" apply -f - >/dev/null <<'YAML'
apiVersion: v1
kind: Pod
metadata: {name: allreduce-bench}
spec:
  restartPolicy: Never
  containers:
  - name: bench
    image: ghcr.io/diphoma/diphoma-worker:0.1.0
    args: [bench, --world, "4", --sizes, "1K,64K,1M", --samples, "5"]
    resources: {limits: {nvidia.com/gpu: "4"}}
YAML
kubectl -n "$ns" wait --for=jsonpath='{.status.phase}'=Succeeded pod/allreduce-bench --timeout=300s >/dev/null || {
  kubectl -n "$ns" get pod allreduce-bench -o yaml >&2; exit 1; }
kubectl -n "$ns" logs allreduce-bench
echo
echo "demo done. Logs: $D/logs (kubelet.log) and $D/kubelet/logs (the operator's and the workers')."
