#!/usr/bin/env bash
# start-coscheduling.sh WORK_DIR [SCHEDULER_NAME] — starts the scheduler-plugins scheduler
# (built by build-coscheduling.sh) as a SECOND scheduler next to kube-scheduler on the local
# control plane of WORK_DIR (started by start.sh: its env file and admin kubeconfig), with one
# profile, SCHEDULER_NAME (default diphoma-coscheduling), running the Coscheduling plugin (its
# queue sort, PreFilter, PostFilter, Permit, Reserve through multiPoint); pods that name another
# scheduler are left to kube-scheduler. Installs the plugin's PodGroup CRD
# (podgroups.scheduling.x-k8s.io, v1alpha1, from the module: manifests/coscheduling/crd.yaml)
# first. Loopback only, no leader election; its pid is recorded in WORK_DIR/coscheduling.pid, so
# stop.sh (and start.sh's watchdog) stop it with the control plane; log: logs/coscheduling.log.
# Optional: COSCHED_PERMIT_WAIT_S (the plugin's permitWaitingTimeSeconds: how long a member with
# a node waits at Permit for the rest of its gang; default 10, as the module's sample config),
# COSCHED_BACKOFF_S (podGroupBackoffSeconds, default 10: after a round in which a member found no
# node, the group is not tried for that long; without it the plugin re-activates the siblings of
# each member it holds at Permit and a gang that does not fit is tried thousands of times a
# minute, which slowed the training of the other jobs on 2 cores), SCHED_MAX_UNSCHEDULABLE
# (default 30s, below), SCHED_V (log verbosity, default 4).
set -euo pipefail
W=$(cd "${1:?usage: $0 WORK_DIR [SCHEDULER_NAME]}" && pwd)
NAME=${2:-diphoma-coscheduling}
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck disable=SC1091
source "$W/env"
{ read -r SBIN; read -r MOD; } < <(bash "$HERE/build-coscheduling.sh")
mkdir -p "$W/logs" "$W/coscheduling-certs"
freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PORT=$(freeport)

kubectl apply -f "$MOD/manifests/coscheduling/crd.yaml" >/dev/null
kubectl wait --for=condition=Established crd/podgroups.scheduling.x-k8s.io --timeout=60s >/dev/null

cat >"$W/coscheduling.yaml" <<CFG
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: $W/admin.kubeconfig
  qps: 50
  burst: 100
leaderElection:
  leaderElect: false
profiles:
- schedulerName: ${NAME}
  plugins:
    multiPoint:
      enabled:
      - name: Coscheduling
    queueSort:
      enabled:
      - name: Coscheduling
      disabled:
      - name: "*"
  pluginConfig:
  - name: Coscheduling
    args:
      permitWaitingTimeSeconds: ${COSCHED_PERMIT_WAIT_S:-10}
      podGroupBackoffSeconds: ${COSCHED_BACKOFF_S:-10}
CFG
# --pod-max-in-unschedulable-pods-duration (as start.sh gives kube-scheduler; default 5m): a gang
# whose members were all last rejected at Permit is parked with only Coscheduling to blame, and
# the plugin asks to be woken by pods added and PodGroups changed, not by pods deleted: room
# appearing (a finished job's pods going) wakes no member. Parked pods are tried again after this
# long (checked every 30 s).
"$SBIN/scheduler" \
  --config="$W/coscheduling.yaml" \
  --authentication-kubeconfig="$W/admin.kubeconfig" \
  --authorization-kubeconfig="$W/admin.kubeconfig" \
  --bind-address=127.0.0.1 \
  --secure-port="$PORT" \
  --cert-dir="$W/coscheduling-certs" \
  --pod-max-in-unschedulable-pods-duration="${SCHED_MAX_UNSCHEDULABLE:-30s}" \
  --v="${SCHED_V:-4}" </dev/null >>"$W/logs/coscheduling.log" 2>&1 &
echo $! >"$W/coscheduling.pid"
for ((i = 0; i < 300; i++)); do
  curl -fsSk "https://127.0.0.1:${PORT}/healthz" >/dev/null 2>&1 && break
  kill -0 "$(cat "$W/coscheduling.pid")" 2>/dev/null ||
    { echo "the coscheduling scheduler exited; see $W/logs/coscheduling.log" >&2; exit 1; }
  sleep 0.2
done
curl -fsSk "https://127.0.0.1:${PORT}/healthz" >/dev/null ||
  { echo "the coscheduling scheduler is not healthy; see $W/logs/coscheduling.log" >&2; exit 1; }
echo "export CP_COSCHED_PORT=${PORT} CP_COSCHED_NAME=${NAME}" >>"$W/env"
echo "coscheduling scheduler ${NAME} up (127.0.0.1:${PORT}); log $W/logs/coscheduling.log"
