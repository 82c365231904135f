#!/usr/bin/env bash
# demo.sh DIR — on a cluster started by cluster-up.sh: show the GPU nodes, run the ring-allreduce
# benchmark (4 ranks) as a pod that asks for 4 GPUs, wait for it and print its table.
# Until the operator exists this is a plain Pod; the DiphomaJob demo replaces it.
set -euo pipefail
D=${1:?usage: $0 DIR}
# shellcheck disable=SC1091
source "$D/env"
ns=diphoma-demo
kubectl create namespace "$ns" >/dev/null
kubectl -n "$ns" wait --for=create serviceaccount/default --timeout=60s >/dev/null
echo "== nodes"
kubectl get nodes -L nvidia.com/gpu.product,nvidia.com/gpu.count
kubectl -n "$ns" apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Pod
metadata: {name: allreduce-bench}
spec:
  restartPolicy: Never
  containers:
  - name: bench
    image: diphoma-worker:dev
    args: [bench, --world, "4", --sizes, "1K,64K,1M,16M", --samples, "5"]
    resources: {limits: {nvidia.com/gpu: "4"}}
YAML
echo "== pod allreduce-bench (4 GPUs) scheduled and running"
kubectl -n "$ns" wait --for=condition=PodScheduled pod/allreduce-bench --timeout=60s >/dev/null
kubectl -n "$ns" get pod allreduce-bench -o wide
kubectl -n "$ns" wait --for=jsonpath='{.status.phase}'=Succeeded pod/allreduce-bench --timeout=300s >/dev/null || {
  kubectl -n "$ns" get pod allreduce-bench -o yaml >&2; exit 1; }
uid=$(kubectl -n "$ns" get pod allreduce-bench -o jsonpath='{.metadata.uid}')
echo "== its output (the process kubelet keeps container logs under $D/kubelet/logs)"
cat "$D/kubelet/logs/${ns}_allreduce-bench_${uid}/bench.log"
kubectl -n "$ns" get pod allreduce-bench -o jsonpath='{"exit code: "}{.status.containerStatuses[0].state.terminated.exitCode}{"\n"}'
