#!/usr/bin/env bash
# demo.sh DIR — on a cluster started by cluster-up.sh: install the DiphomaJob CRD, run the operator,
# train the digits MLP with a 4-worker GPU DiphomaJob, kill -9 one worker mid-training and show the
# ring re-formed at a new generation (survivors keep training, a replacement joins), wait for
# Succeeded and print the test accuracy; then run the allreduce benchmark as a 4-GPU pod.
set -euo pipefail
D=${1:?usage: $0 DIR}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck disable=SC1091
source "$D/env"
ns=diphoma-demo
step() { printf '\n== %s\n' "$*"; }
wait_for() { # what timeout_s cmd...
  local what=$1 t=$2; shift 2
  for ((i = 0; i < t * 2; i++)); do "$@" >/dev/null 2>&1 && return 0; sleep 0.5; done
  echo "timed out waiting for $what" >&2; kubectl -n "$ns" get dpj,pods -o wide >&2; return 1
}

step "GPU nodes of the process kubelet"
kubectl get nodes -L nvidia.com/gpu.product,nvidia.com/gpu.count

step "install the DiphomaJob CRD and start the operator"
kubectl apply -f "$ROOT/crds/diphomajob.yaml" >/dev/null
kubectl wait --for=condition=Established crd/diphomajobs.diphoma.io --timeout=60s >/dev/null
diphoma-operator run --metrics-addr 127.0.0.1:0 </dev/null >"$D/logs/operator.log" 2>&1 &
echo $! >"$D/operator.pid"
kubectl create namespace "$ns" >/dev/null
kubectl -n "$ns" wait --for=create serviceaccount/default --timeout=60s >/dev/null

step "a DiphomaJob: 4 workers × 1 GPU train the digits MLP"
kubectl -n "$ns" apply -f - <<'YAML'
apiVersion: diphoma.io/v1alpha1
kind: DiphomaJob
metadata: {name: digits}
spec:
  replicas: 4
  gpusPerWorker: 1
  faultTolerance: {detectionSeconds: 5}
  template:
    spec:
      terminationGracePeriodSeconds: 5
      containers:
      - name: worker
        image: diphoma-worker:dev
        args: [train, --steps, "4000", --log-every, "1000"]
YAML
field() { kubectl -n "$ns" get dpj digits -o jsonpath="{$1}"; }
wait_for "the ring" 90 bash -c "[[ \$(kubectl -n $ns get dpj digits -o jsonpath='{.status.phase}') == Running ]]"
kubectl -n "$ns" get pods -o wide
echo "ring membership (generation $(field .status.ring.generation)):"
kubectl -n "$ns" get configmap digits-ring -o jsonpath='{.data.membership\.json}'; echo
wait_for "progress from rank 0" 60 bash -c "[[ -n \$(kubectl -n $ns get dpj digits -o jsonpath='{.status.progress.step}') ]]"
kubectl -n "$ns" get dpj digits

step "kill -9 the process of worker 1 mid-training"
pid=$(kubectl -n "$ns" get pod digits-worker-1 -o jsonpath='{.status.containerStatuses[0].containerID}')
survivor=$(kubectl -n "$ns" get pod digits-worker-0 -o jsonpath='{.status.containerStatuses[0].containerID}')
kill -9 "${pid#process://}"
start=$(date +%s%N)
wait_for "the repaired ring" 90 bash -c "[[ \$(kubectl -n $ns get dpj digits -o jsonpath='{.status.ring.generation}') -ge 2 ]]"
ms=$(( ($(date +%s%N) - start) / 1000000 ))
echo "ring re-formed at generation $(field .status.ring.generation), ${ms} ms after the kill (as seen by polling kubectl)"
echo "repairs: $(field .status.repairs)"
echo "lastFailure: $(field .status.lastFailure)"
kubectl -n "$ns" get dpj digits

step "training goes on to the end"
wait_for "Succeeded" 300 bash -c "[[ \$(kubectl -n $ns get dpj digits -o jsonpath='{.status.phase}') == Succeeded ]]"
kubectl -n "$ns" get dpj digits
now=$(kubectl -n "$ns" get pod digits-worker-0 -o jsonpath='{.status.containerStatuses[0].state.terminated.exitCode}')
echo "worker 0 kept its process through the repair (${survivor}); it exited with code ${now}"
uid=$(kubectl -n "$ns" get pod digits-worker-0 -o jsonpath='{.metadata.uid}')
grep -E "generation|accuracy" "$D/kubelet/logs/${ns}_digits-worker-0_${uid}/worker.log" | tail -4
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
    image: diphoma-worker:dev
    args: [bench, --world, "4", --sizes, "1K,64K,1M", --samples, "5"]
    resources: {limits: {nvidia.com/gpu: "4"}}
YAML
kubectl -n "$ns" wait --for=jsonpath='{.status.phase}'=Succeeded pod/allreduce-bench --timeout=300s >/dev/null || {
  kubectl -n "$ns" get pod allreduce-bench -o yaml >&2; exit 1; }
uid=$(kubectl -n "$ns" get pod allreduce-bench -o jsonpath='{.metadata.uid}')
cat "$D/kubelet/logs/${ns}_allreduce-bench_${uid}/bench.log"
echo
echo "demo done. Logs: $D/logs (operator.log, kubelet.log) and $D/kubelet/logs."
