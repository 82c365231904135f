#!/usr/bin/env bash
# start.sh BIN_DIR [WORK_DIR]
# Starts etcd + kube-apiserver + kube-controller-manager + kube-scheduler on 127.0.0.1 only,
# with a throw-away PKI, and writes WORK_DIR/env (KUBECONFIG, ports) and one WORK_DIR/*.pid per process
# (for the controller-manager and the scheduler, that of the supervisor that restarts them).
# Stop with: stop.sh WORK_DIR
# With OWNER_PID set, a watchdog stops the control plane as soon as that process is gone (a test
# binary that panics or is killed never leaves etcd or the apiserver behind).
# Optional: APISERVER_EXTRA_ARGS, KCM_CONTROLLERS, KCM_EXTRA_ARGS, NODE_MONITOR_PERIOD,
# NODE_MONITOR_GRACE_PERIOD, SCHED_V (the scheduler's log verbosity, default 4: each pod's moves
# between its queues with the plugins that rejected it, the gang plugin's quorum and Permit
# timeouts, which the gang tests print when they fail; a few hundred KB a suite),
# SCHED_QPS/SCHED_BURST (the scheduler's client limits, default 50/100), SCHED_MAX_UNSCHEDULABLE
# (the scheduler's --pod-max-in-unschedulable-pods-duration, default 30s; see below),
# FEATURE_GATES (the API server's, the controller-manager's and the scheduler's; default:
# Kubernetes' gang scheduling, KEP-4671, alpha in 1.36: GenericWorkload serves
# scheduling.k8s.io/v1alpha2 Workloads and PodGroups and the pods' spec.schedulingGroup, and runs
# the controller-manager's podgroup-protection controller, which releases a deleted PodGroup once
# no pod names it; GangScheduling enables the scheduler's plugin; "" for none).
# Flags are taken from envtest, kwok's binary runtime and hack/local-up-cluster.sh
# (../shared/control-plane/README.md §3); verified with the v1.36.3 binaries (e2e/cluster/README.md).
set -euo pipefail
BIN=$(cd "${1:?usage: $0 BIN_DIR [WORK_DIR]}" && pwd)
W=${2:-$(mktemp -d -t k8s-cp.XXXXXX)}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$W/logs"
P="$W/pki"
# any failure below stops what was already started
trap 'rc=$?; if [[ $rc != 0 ]]; then "$HERE/stop.sh" "$W" --keep; echo "control plane failed to start; logs in $W/logs" >&2; fi' EXIT
if [[ -n ${OWNER_PID:-} ]]; then
  (trap '' INT; while kill -0 "$OWNER_PID" 2>/dev/null; do sleep 1; done; "$HERE/stop.sh" "$W") \
    </dev/null >/dev/null 2>&1 &
  echo $! >"$W/watchdog.pid"
fi
[[ -f "$P/operator.crt" ]] || "$HERE/gen-pki.sh" "$P"

FEATURE_GATES=${FEATURE_GATES-GenericWorkload=true,GangScheduling=true}
GATE_ARGS=()
API_GATE_ARGS=()
if [[ -n $FEATURE_GATES ]]; then
  GATE_ARGS=(--feature-gates="$FEATURE_GATES")
  # the alpha API group version the gates serve (off by default even with them on)
  [[ $FEATURE_GATES == *GenericWorkload=true* ]] && API_GATE_ARGS=(--runtime-config=scheduling.k8s.io/v1alpha2=true)
fi

freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
ETCD_PORT=${ETCD_PORT:-$(freeport)}
API_PORT=${API_PORT:-$(freeport)}
KCM_PORT=${KCM_PORT:-$(freeport)}
SCHED_PORT=${SCHED_PORT:-$(freeport)}

kubeconfig() { # file user cert key
  cat > "$1" <<KC
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: https://127.0.0.1:${API_PORT}
    certificate-authority: ${P}/ca.crt
users:
- name: $2
  user:
    client-certificate: $3
    client-key: $4
contexts:
- name: local
  context:
    cluster: local
    user: $2
current-context: local
KC
}
kubeconfig "$W/admin.kubeconfig" admin "$P/admin.crt" "$P/admin.key"
# An in-process operator's identity (user diphoma-operator), and the audit log of the operator's
# requests only (that user, or a chart-installed operator's ServiceAccount), one JSON line per
# request at its completion: the tests and benchmarks count the operator's API requests there.
kubeconfig "$W/operator.kubeconfig" diphoma-operator "$P/operator.crt" "$P/operator.key"
cat >"$W/audit-policy.yaml" <<'POLICY'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    users:
      - diphoma-operator
      - system:serviceaccount:diphoma-system:diphoma-operator
  - level: None
POLICY

wait_for() { # what timeout_s cmd...
  local what=$1 t=$2; shift 2
  for ((i = 0; i < t * 5; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  echo "timed out waiting for $what; logs in $W/logs" >&2
  return 1
}

# supervise NAME CMD...: runs CMD in the background as a kubelet runs a control-plane static pod
# (restartPolicy Always): started again 1 s after it exits, its output appended to logs/NAME.log
# with a line saying so. NAME.pid is the supervisor's; SIGTERM stops it and its child. (Seen:
# kube-scheduler v1.35.4's alpha GangScheduling plugin panicked when a gang's pod waiting at
# Permit was deleted while another pod of the gang reached Permit; README "Gang scheduling".)
supervise() {
  local name=$1; shift
  (
    set +e
    child=
    trap '[[ -n $child ]] && kill -TERM "$child" 2>/dev/null; wait "$child" 2>/dev/null; exit 0' TERM
    while :; do
      "$@" >>"$W/logs/$name.log" 2>&1 &
      child=$!
      wait "$child"
      echo "--- $name exited with status $?; restarting it in 1 s (supervise, start.sh)" >>"$W/logs/$name.log"
      sleep 1
    done
  ) </dev/null >/dev/null 2>&1 &
  echo $! >"$W/$name.pid"
}

# --- etcd (same flags as kubernetes hack/lib/etcd.sh + envtest's --unsafe-no-fsync) ---
"$BIN/etcd" \
  --name=default \
  --data-dir="$W/etcd" \
  --listen-client-urls="http://127.0.0.1:${ETCD_PORT}" \
  --advertise-client-urls="http://127.0.0.1:${ETCD_PORT}" \
  --listen-peer-urls="http://localhost:0" \
  --unsafe-no-fsync=true \
  --log-level=warn >"$W/logs/etcd.log" 2>&1 &
echo $! >"$W/etcd.pid"
wait_for etcd 30 curl -fsS "http://127.0.0.1:${ETCD_PORT}/health"

# --- kube-apiserver ---
"$BIN/kube-apiserver" \
  --etcd-servers="http://127.0.0.1:${ETCD_PORT}" \
  --bind-address=127.0.0.1 \
  --secure-port="${API_PORT}" \
  --advertise-address=127.0.0.1 \
  --endpoint-reconciler-type=none \
  --cert-dir="$W/apiserver-certs" \
  --tls-cert-file="$P/apiserver.crt" \
  --tls-private-key-file="$P/apiserver.key" \
  --client-ca-file="$P/ca.crt" \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$P/sa.key" \
  --service-account-signing-key-file="$P/sa.key" \
  --service-cluster-ip-range=10.0.0.0/24 \
  --authorization-mode=Node,RBAC \
  --kubelet-client-certificate="$P/apiserver-kubelet-client.crt" \
  --kubelet-client-key="$P/apiserver-kubelet-client.key" \
  --kubelet-certificate-authority="$P/ca.crt" \
  --kubelet-preferred-address-types=InternalIP \
  --allow-privileged=true \
  --audit-policy-file="$W/audit-policy.yaml" \
  --audit-log-path="$W/logs/audit.log" \
  --audit-log-format=json \
  --audit-log-mode=blocking \
  "${GATE_ARGS[@]}" "${API_GATE_ARGS[@]}" \
  ${APISERVER_EXTRA_ARGS:-} \
  --v="${KLOG_V:-1}" >"$W/logs/kube-apiserver.log" 2>&1 &
echo $! >"$W/kube-apiserver.pid"
wait_for kube-apiserver 120 curl -fsS --cacert "$P/ca.crt" --cert "$P/admin.crt" --key "$P/admin.key" \
  "https://127.0.0.1:${API_PORT}/readyz"

# --- kube-controller-manager (admin identity, like kwok; see recipe for least-privilege variant) ---
supervise kube-controller-manager "$BIN/kube-controller-manager" \
  --kubeconfig="$W/admin.kubeconfig" \
  --authentication-kubeconfig="$W/admin.kubeconfig" \
  --authorization-kubeconfig="$W/admin.kubeconfig" \
  --bind-address=127.0.0.1 \
  --secure-port="${KCM_PORT}" \
  --cert-dir="$W/kcm-certs" \
  --leader-elect=false \
  --node-monitor-period="${NODE_MONITOR_PERIOD:-1s}" \
  --node-monitor-grace-period="${NODE_MONITOR_GRACE_PERIOD:-8s}" \
  --controllers="${KCM_CONTROLLERS:-*}" \
  --service-account-private-key-file="$P/sa.key" \
  --root-ca-file="$P/ca.crt" \
  --use-service-account-credentials=false \
  "${GATE_ARGS[@]}" \
  ${KCM_EXTRA_ARGS:-} \
  --v="${KLOG_V:-1}"

# --- kube-scheduler (kubeconfig must live in the config file when --config is used) ---
cat >"$W/kube-scheduler.yaml" <<CFG
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: $W/admin.kubeconfig
  qps: ${SCHED_QPS:-50}
  burst: ${SCHED_BURST:-100}
leaderElection:
  leaderElect: false
CFG
# --pod-max-in-unschedulable-pods-duration (deprecated, but applied with --config too: it has no
# KubeSchedulerConfiguration field; default 5m): how long a pod may stay parked among the
# unschedulable ones before it is tried again with no event asking for it. On 1.35 a gang member
# rejected at Permit (the GangScheduling plugin's 5-minute timeout) was parked so, woken by no
# room appearing; 1.36 retries a gang's members after a back-off instead (README, "Gang
# scheduling"), and the gang suite passed with the default 5m: 30s stays as a bound.
supervise kube-scheduler "$BIN/kube-scheduler" \
  --config="$W/kube-scheduler.yaml" \
  "${GATE_ARGS[@]}" \
  --pod-max-in-unschedulable-pods-duration="${SCHED_MAX_UNSCHEDULABLE:-30s}" \
  --authentication-kubeconfig="$W/admin.kubeconfig" \
  --authorization-kubeconfig="$W/admin.kubeconfig" \
  --bind-address=127.0.0.1 \
  --secure-port="${SCHED_PORT}" \
  --cert-dir="$W/scheduler-certs" \
  --v="${SCHED_V:-4}"

wait_for kube-controller-manager 60 curl -fsSk "https://127.0.0.1:${KCM_PORT}/healthz"
wait_for kube-scheduler 60 curl -fsSk "https://127.0.0.1:${SCHED_PORT}/healthz"
# proof that controllers run: the serviceaccount controller creates default/default
wait_for default-serviceaccount 60 "$BIN/kubectl" --kubeconfig="$W/admin.kubeconfig" \
  -n default get serviceaccount default

cat >"$W/env" <<ENV
export KUBECONFIG=$W/admin.kubeconfig
export PATH=$BIN:\$PATH
export CP_WORKDIR=$W
export CP_API_URL=https://127.0.0.1:${API_PORT}
export CP_ETCD_URL=http://127.0.0.1:${ETCD_PORT}
export CP_KCM_PORT=${KCM_PORT}
export CP_SCHED_PORT=${SCHED_PORT}
export CP_OPERATOR_KUBECONFIG=$W/operator.kubeconfig
export CP_AUDIT_LOG=$W/logs/audit.log
ENV
echo "control plane up; source $W/env"
