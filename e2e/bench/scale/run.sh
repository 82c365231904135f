#!/usr/bin/env bash
# run.sh [N ...] — the scale benchmark (`make bench-scale`, issue 14 parts 2-4), on the local
# control plane with fake GPU nodes from kwok, side by side with Kubeflow's training operator.
#
# One control plane (e2e/cluster/start.sh: etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, all on 127.0.0.1) and one kwok process that plays ceil(8N/GPUS_PER_NODE)+2
# nodes of GPUS_PER_NODE `nvidia.com/gpu` each (pod IPs from 127.x.y.0/24 per node: loopback
# strings that nothing connects to; kwok serves nothing: --server-address is empty). For each
# N, in this order and on the same nodes:
#   1. Diphoma: N DiphomaJobs of 4 workers (`diphoma-probe` images: kwok never runs them).
#      Converge: from the first create to every job with its ring published at size 4 and all
#      4N worker pods Running. Idle: IDLE_S seconds with nothing happening. Storm: 10% of all
#      worker pods deleted at once, until every hit job has a newer ring of 4 again and 4N pods
#      are Running. At the last N (FAILOVER=1): the leader is killed (SIGKILL, by its pid)
#      with one worker pod deleted right after; takeover = kill -> the standby holds the Lease;
#      repair = kill -> that job's ring re-formed; every job's repair/failure counters compared.
#   2. The same for the training operator: N PyTorchJobs of 1 master + 3 workers (1 GPU each).
#      Converge: until all 4N pods are Running; storm: until 4N pods are Running again and
#      none of the deleted pods (by uid) remains.
#   The jobs of 1 are deleted (and their pods gone) before 2 starts.
# Each operator has its own client identity (a client certificate, CN=diphoma-operator-a/-b,
# training-operator); an audit policy logs only their requests (Metadata level), and each window
# counts the log's requests (once per auditID, at requestReceivedTimestamp) by verb and resource.
# CPU seconds (utime+stime) and peak RSS (VmHWM) come from /proc/<pid> of each operator.
# Prints tables and writes them, with the raw per-window counts, to $OUT (default
# e2e/bench/scale/out). A benchmark: nothing is asserted.
#
# Right after each converge, timeline.sh writes where its time went ($OUT/timeline-N-*.md: pods
# created, bound, Running, Ready, rings published, as percentiles of seconds from the first job).
#
# Environment: IDLE_S (300), GPUS_PER_NODE (64), LEASE_S (120), STORM_PCT (10), FAILOVER (1), POLL_S (1),
# KWOK_PARALLELISM (16: kwok's pod and node stage workers; its default 4 plays ~60 pod stages/s
# here, 67 s for the 4,000 pods of N=1000, for both operators alike, where real kubelets work in
# parallel per node), DIPHOMA_OPERATOR (target/release/diphoma-operator), KEEP=1 keeps the work
# directory. The operator's own settings pass through its environment.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../../.." && pwd)
SIZES=("$@")
[[ ${#SIZES[@]} -gt 0 ]] || SIZES=(100 300 1000)
IDLE_S=${IDLE_S:-300}
GPUS_PER_NODE=${GPUS_PER_NODE:-64}
# kwok renews each node Lease every LEASE_S/4; on a busy 2-core machine a 40 s Lease (the
# kubelet's) went stale for more than the operator's node-loss window at 250 nodes
LEASE_S=${LEASE_S:-120}
KWOK_PARALLELISM=${KWOK_PARALLELISM:-16}
STORM_PCT=${STORM_PCT:-10}
FAILOVER=${FAILOVER:-1}
POLL_S=${POLL_S:-1}
OUT=${OUT:-$HERE/out}
DOP=${DIPHOMA_OPERATOR:-$REPO/target/release/diphoma-operator}
[[ -x "$DOP" ]] || { echo "DIPHOMA_OPERATOR: $DOP is not an executable (cargo build --release -p diphoma-operator)" >&2; exit 1; }
BIN=$(bash "$REPO/e2e/cluster/build-bins.sh" 2>/dev/null)
TOOLS=$(bash "$HERE/build-tools.sh" 2>/dev/null)
mkdir -p "$OUT"
W=$(mktemp -d -t diphoma-scale.XXXXXX)
PIDS=()
OWN_CERTS=
cleanup() {
  local rc=$?
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  [[ -n $OWN_CERTS ]] && rm -rf /tmp/k8s-webhook-server
  bash "$REPO/e2e/cluster/stop.sh" "$W" ${KEEP:+--keep}
  [[ -n ${KEEP:-} ]] && echo "work directory kept: $W" >&2
  exit $rc
}
trap cleanup EXIT INT TERM
log() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }
now() { date -u +%Y-%m-%dT%H:%M:%S.%6NZ; }
secs() { date -u +%s.%N; }

# --- identities, audit policy, control plane -----------------------------------------------
bash "$REPO/e2e/cluster/gen-pki.sh" "$W/pki" >/dev/null
IDS=(diphoma-operator-a diphoma-operator-b training-operator)
(
  cd "$W/pki"
  printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n' >client.ext
  for id in "${IDS[@]}"; do
    openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$id.key" 2>/dev/null
    openssl req -new -key "$id.key" -subj "/O=system:masters/CN=$id" -out "$id.csr"
    openssl x509 -req -in "$id.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 -days 2 \
      -extfile client.ext -out "$id.crt" 2>/dev/null
  done
)
cat >"$W/bench-audit-policy.yaml" <<EOF
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  users: [${IDS[0]}, ${IDS[1]}, ${IDS[2]}]
- level: None
EOF
AUDIT="$W/audit.log"
log "starting the control plane in $W"
APISERVER_EXTRA_ARGS="--audit-policy-file=$W/bench-audit-policy.yaml --audit-log-path=$AUDIT --audit-log-format=json --audit-log-maxsize=1000000 --audit-log-maxbackup=0 --audit-log-mode=batch --audit-log-batch-max-wait=1s --max-requests-inflight=800 --max-mutating-requests-inflight=400" \
  SCHED_V=1 SCHED_QPS=500 SCHED_BURST=1000 NODE_MONITOR_GRACE_PERIOD=$((LEASE_S * 3 / 2))s KCM_EXTRA_ARGS="--kube-api-qps=500 --kube-api-burst=1000" \
  KCM_CONTROLLERS='*,-endpoints-controller,-endpointslice-controller,-endpointslice-mirroring-controller' bash "$REPO/e2e/cluster/start.sh" "$BIN" "$W" >/dev/null
# shellcheck disable=SC1091
source "$W/env"
APISERVER=$(cat "$W/kube-apiserver.pid")
API=$CP_API_URL
for id in "${IDS[@]}"; do
  sed -e "s#$W/pki/admin.crt#$W/pki/$id.crt#" -e "s#$W/pki/admin.key#$W/pki/$id.key#" \
    -e "s#name: admin#name: $id#;s#user: admin#user: $id#" "$KUBECONFIG" >"$W/$id.kubeconfig"
done
k() { kubectl "$@"; }

# --- kwok and its nodes ---------------------------------------------------------------------
max_n=0
for n in "${SIZES[@]}"; do ((n > max_n)) && max_n=$n; done
NODES=$(((8 * max_n + GPUS_PER_NODE - 1) / GPUS_PER_NODE + 2))
log "kwok with $NODES nodes of $GPUS_PER_NODE GPUs"
# kwok's own stages (from its module): nodes initialized at once and their Leases renewed; pods
# Ready at once (IPs from the node's podCIDR), deleted at once when asked to.
S="$TOOLS/kwok-kustomize/stage"
for f in "$S/node/fast/node-initialize.yaml" "$S/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml" \
  "$S/pod/fast/pod-ready.yaml" "$S/pod/fast/pod-complete.yaml" "$S/pod/fast/pod-delete.yaml"; do
  cat "$f"; echo "---"
done >"$W/kwok-stages.yaml"
# kwok's own configuration, in the same file: how many pod and node stages it plays at once.
# kwok does not default the fields of a configuration given this way, so its other defaults
# (pkg/apis/config/v1alpha1) are spelled out.
cat >>"$W/kwok-stages.yaml" <<EOF
apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  podPlayStageParallelism: $KWOK_PARALLELISM
  nodePlayStageParallelism: $KWOK_PARALLELISM
  nodeLeaseParallelism: 4
  podsOnNodeSyncParallelism: 1
  enablePodsOnNodeSyncListPager: true
  enablePodsOnNodeSyncStreamWatch: false
  enableDebuggingHandlers: true
  enableProfilingHandler: true
  enableContentionProfiling: false
EOF
"$TOOLS/bin/kwok" \
  --config="$W/kwok-stages.yaml" \
  --kubeconfig="$KUBECONFIG" \
  --manage-all-nodes=false \
  --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
  --cidr=127.0.0.0/8 \
  --node-ip=127.0.0.1 \
  --node-lease-duration-seconds="$LEASE_S" \
  --v=WARN \
  --server-address= \
  >"$W/logs/kwok.log" 2>&1 &
KWOK=$!
echo "$KWOK" >"$W/kwok.pid"
PIDS+=("$KWOK")
for ((i = 0; i < NODES; i++)); do
  cat <<EOF
apiVersion: v1
kind: Node
metadata:
  name: gpu-$i
  annotations: {kwok.x-k8s.io/node: fake}
  labels: {type: kwok, kubernetes.io/hostname: gpu-$i}
spec:
  podCIDR: 127.$((1 + i / 256)).$((i % 256)).0/24
status:
  allocatable: {cpu: "256", memory: 1Ti, pods: "$((GPUS_PER_NODE + 16))", nvidia.com/gpu: "$GPUS_PER_NODE"}
  capacity: {cpu: "256", memory: 1Ti, pods: "$((GPUS_PER_NODE + 16))", nvidia.com/gpu: "$GPUS_PER_NODE"}
---
EOF
done >"$W/nodes.yaml"
k create -f "$W/nodes.yaml" >/dev/null
until [[ $(k get nodes --no-headers 2>/dev/null | grep -c ' Ready ') -ge $NODES ]]; do
  kill -0 "$KWOK" 2>/dev/null || { echo "kwok exited: $(tail -3 "$W/logs/kwok.log")" >&2; exit 1; }
  sleep 1
done
log "nodes Ready"

# --- CRDs, operators ------------------------------------------------------------------------
k apply -f "$REPO/crds/diphomajob.yaml" >/dev/null
k apply --server-side -f "$TOOLS/to-crds/kubeflow.org_pytorchjobs.yaml" >/dev/null
for _ in $(seq 60); do # (right after apply, a CRD has no conditions yet and `wait` fails)
  k wait --for=condition=Established crd/diphomajobs.diphoma.io crd/pytorchjobs.kubeflow.org --timeout=60s >/dev/null 2>&1 && break
  sleep 1
done
k create namespace bench-d >/dev/null
k create namespace bench-t >/dev/null
k create namespace kubeflow >/dev/null
freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

declare -A OPID OPORT
start_diphoma() { # replica (a|b)
  local r=$1 port
  port=$(freeport)
  KUBECONFIG="$W/diphoma-operator-$r.kubeconfig" RUST_LOG=warn POD_NAME="diphoma-operator-$r" \
    "$DOP" run --metrics-addr "127.0.0.1:$port" --leader-elect --lease-namespace default \
    >"$W/logs/diphoma-operator-$r.log" 2>&1 &
  OPID[d$r]=$!
  OPORT[d$r]=$port
  PIDS+=("$!")
}
# whether replica $1 says it leads (its /metrics; read whole: `grep -q` in a pipe would end
# curl with SIGPIPE, a failure under pipefail)
leads() {
  local m
  m=$(curl -fsS "http://127.0.0.1:${OPORT[d$1]}/metrics" 2>/dev/null) || return 1
  [[ $m == *$'\n'"diphoma_operator_leader 1"* ]]
}
start_diphoma a
until leads a; do sleep 0.5; done
start_diphoma b
log "diphoma-operator a leads (pid ${OPID[da]}), b is its standby (pid ${OPID[db]})"

# The training operator: PyTorchJob only; metrics, health and webhook on loopback. Its cert
# rotator (cert-controller) needs its Secret and ValidatingWebhookConfiguration to exist, writes
# the certificates into the Secret and waits for them as files in its fixed directory
# /tmp/k8s-webhook-server/serving-certs (a mounted Secret in a cluster): the harness copies them
# there. The webhook is registered with an objectSelector that matches nothing, so the API server
# never calls it (its https URL on 127.0.0.1 would not match the certificate's service name).
CERTS=/tmp/k8s-webhook-server
if [[ -e $CERTS ]]; then echo "$CERTS exists: another training operator runs here? not touching it" >&2; exit 1; fi
mkdir -p "$CERTS/serving-certs"
OWN_CERTS=1
TO_WEBHOOK=$(freeport)
TO_METRICS=$(freeport)
TO_HEALTH=$(freeport)
k create secret generic training-operator-webhook-cert -n kubeflow >/dev/null
k apply -f - >/dev/null <<EOF
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata: {name: validator.training-operator.kubeflow.org}
webhooks:
- name: validator.pytorchjob.training-operator.kubeflow.org
  admissionReviewVersions: [v1]
  sideEffects: None
  failurePolicy: Ignore
  clientConfig: {url: "https://127.0.0.1:$TO_WEBHOOK/validate-kubeflow-org-v1-pytorchjob"}
  objectSelector: {matchLabels: {bench-scale.diphoma.io/never: "true"}}
  rules: [{apiGroups: [kubeflow.org], apiVersions: [v1], operations: [CREATE, UPDATE], resources: [pytorchjobs]}]
EOF
"$TOOLS/bin/training-operator.v1" \
  --kubeconfig="$W/training-operator.kubeconfig" \
  --enable-scheme=pytorchjob \
  --metrics-bind-address="127.0.0.1:$TO_METRICS" \
  --health-probe-bind-address="127.0.0.1:$TO_HEALTH" \
  --webhook-server-port="$TO_WEBHOOK" \
  --leader-elect=false \
  >"$W/logs/training-operator.log" 2>&1 &
OPID[t]=$!
PIDS+=("$!")
until [[ -n $(k get secret -n kubeflow training-operator-webhook-cert -o jsonpath='{.data.tls\.crt}') ]]; do sleep 0.5; done
for f in tls.crt tls.key ca.crt; do
  k get secret -n kubeflow training-operator-webhook-cert -o jsonpath="{.data.${f/./\\.}}" | base64 -d >"$CERTS/serving-certs/$f"
done
until curl -fsS "http://127.0.0.1:$TO_HEALTH/readyz" >/dev/null 2>&1; do sleep 0.5; done
log "training-operator pid ${OPID[t]} ready"

# --- measurement helpers --------------------------------------------------------------------
cpu_s() { # pid -> utime+stime in seconds
  awk -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); print ($12 + $13) / hz }' "/proc/$1/stat"
}
rss_mib() { awk '/^VmHWM/ { printf "%.1f", $2 / 1024 }' "/proc/$1/status"; }
# requests of user $1 received in [$2, $3): "count verb resource" lines, and the total
requests() {
  sleep 2 # the audit batch backend writes within a second
  jq -r --arg u "$1" --arg a "$2" --arg b "$3" '
    select(.user.username == $u and .requestReceivedTimestamp >= $a and .requestReceivedTimestamp < $b
           and (.stage == "ResponseStarted" or (.stage == "ResponseComplete" and .verb != "watch")
                or .stage == "Panic"))
    | "\(.verb) \(.objectRef.resource // .requestURI)\(if .objectRef.subresource then "/" + .objectRef.subresource else "" end)"' \
    "$W"/audit*.log | sort | uniq -c | sort -rn
}
total() { awk '{ s += $1 } END { print s + 0 }'; }
short() { awk '{ printf "%s%s %s=%s", (NR > 1 ? "," : ""), "", $2 " " $3, $1 }' | sed 's/^ //'; }
ring_sizes() { # jobs with a ring of 4 published, in bench-d
  k get diphomajobs -n bench-d -o json | jq '[.items[] | select(.status.ring.size == 4)] | length'
}
running() { k get pods -n "$1" --no-headers --field-selector=status.phase=Running 2>/dev/null | grep -c ' Running ' || true; }
wait_until() { # timeout_s cmd... -> 0 when cmd succeeded
  local end=$(($(date +%s) + $1)); shift
  while ! "$@"; do
    (($(date +%s) < end)) || return 1
    sleep "$POLL_S"
  done
}

RESULTS="$OUT/results.md"
RAW="$OUT/requests.txt"
: >"$RAW"
{
  echo "# bench-scale $(date -u +%Y-%m-%dT%H:%MZ), commit $(git -C "$REPO" rev-parse --short HEAD)$(git -C "$REPO" diff --quiet || echo '+dirty')"
  echo
  echo "$NODES kwok nodes x $GPUS_PER_NODE nvidia.com/gpu, node Leases of $LEASE_S s, kwok stage parallelism $KWOK_PARALLELISM; idle window ${IDLE_S} s; storm ${STORM_PCT}% of the worker pods; poll every ${POLL_S} s."
  echo
  echo "| N | operator | converge s | CPU s converge | requests converge | idle req/s | CPU s idle | apiserver CPU s idle | storm pods | storm repair s | requests storm | CPU s storm | CPU s total | peak RSS MiB |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
} >"$RESULTS"
record() { # label user t0 t1 -> total, raw lines into $RAW
  local counts
  counts=$(requests "$2" "$3" "$4")
  { echo "## $1 ($2, $3 .. $4)"; echo "$counts"; echo; } >>"$RAW"
  echo "$counts" | total
}

# --- Diphoma ---------------------------------------------------------------------------------
diphoma_jobs() { # n
  for ((j = 0; j < $1; j++)); do
    cat <<EOF
{"apiVersion":"diphoma.io/v1alpha1","kind":"DiphomaJob","metadata":{"name":"dj-$j","namespace":"bench-d"},"spec":{"replicas":4,"gpusPerWorker":1,"template":{"spec":{"terminationGracePeriodSeconds":5,"containers":[{"name":"worker","image":"diphoma-probe:dev","args":["--sleep","3600"]}]}}}}
EOF
  done
}
pytorch_jobs() { # n
  for ((j = 0; j < $1; j++)); do
    local c='"containers":[{"name":"pytorch","image":"pytorch-fake:none","resources":{"limits":{"nvidia.com/gpu":1}}}]'
    cat <<EOF
{"apiVersion":"kubeflow.org/v1","kind":"PyTorchJob","metadata":{"name":"pt-$j","namespace":"bench-t"},"spec":{"pytorchReplicaSpecs":{"Master":{"replicas":1,"restartPolicy":"OnFailure","template":{"spec":{"terminationGracePeriodSeconds":5,$c}}},"Worker":{"replicas":3,"restartPolicy":"OnFailure","template":{"spec":{"terminationGracePeriodSeconds":5,$c}}}}}}
EOF
  done
}
# create the objects of file $1 with 4 parallel kubectl processes
create_all() {
  split -n l/4 "$1" "$1.part."
  local f ps=()
  for f in "$1".part.*; do
    k create -f "$f" >/dev/null &
    ps+=("$!")
  done
  wait "${ps[@]}"
  rm -f "$1".part.*
}
delete_pods() { # namespace file-of-names: all at once (8 parallel kubectl, no wait)
  xargs -P 8 -n 50 kubectl delete pod -n "$1" --wait=false <"$2" >/dev/null
}

diphoma_converged() { [[ $(ring_sizes) -ge $N && $(running bench-d) -ge $((4 * N)) ]]; }
diphoma_repaired() { # every hit job has a newer ring of 4; 4N pods Running
  local newer
  newer=$(k get diphomajobs -n bench-d -o json | jq --slurpfile before "$W/gens.json" '
    ($before[0]) as $b | [.items[] | select($b[.metadata.name] != null)
      | select(.status.ring.size == 4 and .status.ring.generation > $b[.metadata.name])] | length')
  [[ $newer -ge $HIT && $(running bench-d) -ge $((4 * N)) ]]
}
pt_converged() { [[ $(running bench-t) -ge $((4 * N)) ]]; }
pt_repaired() { # 4N Running, none of the deleted uids left
  local left
  left=$(k get pods -n bench-t -o json | jq --slurpfile gone "$W/gone-uids.json" '
    ($gone[0] | map({(.): 1}) | add) as $g
    | [.items[] | select(.status.phase == "Running" and ($g[.metadata.uid] | not))] | length')
  [[ $left -ge $((4 * N)) ]]
}

bench_one() { # n
  N=$1
  local pid=${OPID[da]} user=diphoma-operator-a a1 a2 t0 t1 t2 t3 t4 t5 c0 c1 c2 c3 c4 s0 s1 sconv sidle sstorm conv repair
  # ---- Diphoma
  diphoma_jobs "$N" >"$W/dj.json"
  log "N=$N: Diphoma: creating $N jobs"
  c0=$(cpu_s "$pid"); t0=$(now); s0=$(secs)
  create_all "$W/dj.json"
  wait_until 1800 diphoma_converged || log "N=$N: Diphoma did not converge in 30 min"
  s1=$(secs); t1=$(now); c1=$(cpu_s "$pid")
  conv=$(echo "$s1 - $s0" | bc)
  log "N=$N: Diphoma converged in $conv s; idle for $IDLE_S s"
  bash "$HERE/timeline.sh" bench-d diphoma >"$OUT/timeline-$N-diphoma.md" 2>&1 || true
  a1=$(cpu_s "$APISERVER")
  sleep "$IDLE_S"
  t2=$(now); c2=$(cpu_s "$pid"); a2=$(cpu_s "$APISERVER")
  # storm
  k get diphomajobs -n bench-d -o json | jq '[.items[] | {(.metadata.name): .status.ring.generation}] | add' >"$W/gens-all.json"
  k get pods -n bench-d --no-headers -o custom-columns=N:.metadata.name | shuf -n $((4 * N * STORM_PCT / 100)) >"$W/storm.txt"
  HIT=$(sed 's/-worker-.*//' "$W/storm.txt" | sort -u | wc -l)
  sed 's/-worker-.*//' "$W/storm.txt" | sort -u | jq -R . | jq -s --slurpfile all "$W/gens-all.json" \
    '($all[0]) as $a | map({(.): $a[.]}) | add' >"$W/gens.json"
  log "N=$N: Diphoma: deleting $(wc -l <"$W/storm.txt") worker pods of $HIT jobs"
  t3=$(now); s0=$(secs)
  delete_pods bench-d "$W/storm.txt"
  wait_until 1800 diphoma_repaired || log "N=$N: Diphoma did not repair in 30 min"
  s1=$(secs); t4=$(now); c3=$(cpu_s "$pid")
  repair=$(echo "$s1 - $s0" | bc)
  log "N=$N: Diphoma repaired in $repair s"
  local rc ri rs idle
  rc=$(record "N=$N diphoma converge" $user "$t0" "$t1")
  ri=$(record "N=$N diphoma idle" $user "$t1" "$t2")
  rs=$(record "N=$N diphoma storm" $user "$t3" "$t4")
  record "N=$N diphoma standby (b) over converge..storm" diphoma-operator-b "$t0" "$t4" >/dev/null
  idle=$(echo "scale=2; $ri / $IDLE_S" | bc)
  printf '| %s | diphoma | %.1f | %.1f | %s | %s | %.1f | %.1f | %s | %.1f | %s | %.1f | %.1f | %s |\n' \
    "$N" "$conv" "$(echo "$c1 - $c0" | bc)" "$rc" "$idle" "$(echo "$c2 - $c1" | bc)" "$(echo "$a2 - $a1" | bc)" "$(wc -l <"$W/storm.txt")" "$repair" "$rs" \
    "$(echo "$c3 - $c2" | bc)" "$(cpu_s "$pid")" "$(rss_mib "$pid")" >>"$RESULTS"
  if [[ $FAILOVER == 1 && $N == "${SIZES[-1]}" ]]; then failover; fi
  # tear down: jobs deleted, pods gone
  log "N=$N: deleting the Diphoma jobs"
  k delete diphomajobs -n bench-d --all --wait=false >/dev/null
  wait_until 1800 bash -c "[[ \$(kubectl get pods -n bench-d --no-headers 2>/dev/null | wc -l) == 0 ]]" || true

  # ---- training operator
  pid=${OPID[t]}; user=training-operator
  pytorch_jobs "$N" >"$W/pt.json"
  log "N=$N: training-operator: creating $N PyTorchJobs"
  c0=$(cpu_s "$pid"); t0=$(now); s0=$(secs)
  create_all "$W/pt.json"
  wait_until 1800 pt_converged || log "N=$N: training-operator did not converge in 30 min"
  s1=$(secs); t1=$(now); c1=$(cpu_s "$pid")
  conv=$(echo "$s1 - $s0" | bc)
  log "N=$N: training-operator converged in $conv s; idle for $IDLE_S s"
  bash "$HERE/timeline.sh" bench-t pytorch >"$OUT/timeline-$N-training-operator.md" 2>&1 || true
  a1=$(cpu_s "$APISERVER")
  sleep "$IDLE_S"
  t2=$(now); c2=$(cpu_s "$pid"); a2=$(cpu_s "$APISERVER")
  k get pods -n bench-t -o json | jq -r '.items[] | "\(.metadata.name) \(.metadata.uid)"' | shuf -n $((4 * N * STORM_PCT / 100)) >"$W/storm-t.txt"
  cut -d' ' -f1 "$W/storm-t.txt" >"$W/storm.txt"
  cut -d' ' -f2 "$W/storm-t.txt" | jq -R . | jq -s . >"$W/gone-uids.json"
  log "N=$N: training-operator: deleting $(wc -l <"$W/storm.txt") pods"
  t3=$(now); s0=$(secs)
  delete_pods bench-t "$W/storm.txt"
  wait_until 1800 pt_repaired || log "N=$N: training-operator did not repair in 30 min"
  s1=$(secs); t4=$(now); c3=$(cpu_s "$pid")
  repair=$(echo "$s1 - $s0" | bc)
  log "N=$N: training-operator repaired in $repair s"
  rc=$(record "N=$N training-operator converge" $user "$t0" "$t1")
  ri=$(record "N=$N training-operator idle" $user "$t1" "$t2")
  rs=$(record "N=$N training-operator storm" $user "$t3" "$t4")
  idle=$(echo "scale=2; $ri / $IDLE_S" | bc)
  printf '| %s | training-operator | %.1f | %.1f | %s | %s | %.1f | %.1f | %s | %.1f | %s | %.1f | %.1f | %s |\n' \
    "$N" "$conv" "$(echo "$c1 - $c0" | bc)" "$rc" "$idle" "$(echo "$c2 - $c1" | bc)" "$(echo "$a2 - $a1" | bc)" "$(wc -l <"$W/storm.txt")" "$repair" "$rs" \
    "$(echo "$c3 - $c2" | bc)" "$(cpu_s "$pid")" "$(rss_mib "$pid")" >>"$RESULTS"
  [[ $N == "${SIZES[-1]}" ]] && return 0 # the last: the cleanup stops everything
  log "N=$N: deleting the PyTorchJobs"
  k delete pytorchjobs -n bench-t --all --wait=false >/dev/null
  wait_until 1800 bash -c "[[ \$(kubectl get pods -n bench-t --no-headers 2>/dev/null | wc -l) == 0 ]]" || true
}

counters() { # job -> "repairs failures" for every job, sorted
  k get diphomajobs -n bench-d -o json | jq -r '.items[] | "\(.metadata.name) \(.status.repairs.total) \(.status.failures.total)"' | sort
}
failover() {
  local victim job t0 s0 s_lead s_rep gen0 holder
  counters >"$W/counters-before.txt"
  victim=$(k get pods -n bench-d --no-headers -o custom-columns=N:.metadata.name | shuf -n 1)
  job=${victim%%-worker-*}
  gen0=$(k get diphomajob -n bench-d "$job" -o jsonpath='{.status.ring.generation}')
  log "failover at N=$N: kill -9 of the leader (pid ${OPID[da]}), then delete $victim"
  t0=$(now); s0=$(secs)
  kill -KILL "${OPID[da]}"
  k delete pod -n bench-d "$victim" --wait=false >/dev/null
  s_lead="" s_rep=""
  local end=$(($(date +%s) + 600))
  while [[ -z $s_lead || -z $s_rep ]] && (($(date +%s) < end)); do
    if [[ -z $s_lead ]] && leads b; then
      s_lead=$(secs)
    fi
    if [[ -z $s_rep ]] && [[ $(k get diphomajob -n bench-d "$job" -o json | jq --argjson g "$gen0" \
      '.status.ring.size == 4 and .status.ring.generation > $g') == true ]]; then
      s_rep=$(secs)
    fi
    sleep 0.5
  done
  holder=$(k get lease -n default diphoma-operator -o jsonpath='{.spec.holderIdentity}')
  sleep 10 # let a double count show, if there is one
  counters >"$W/counters-after.txt"
  local changed
  changed=$(diff "$W/counters-before.txt" "$W/counters-after.txt" | grep '^>' || true)
  {
    echo
    echo "Failover at N=$N: leader diphoma-operator-a killed (SIGKILL) at $t0, then $victim (job $job) deleted."
    echo
    echo "| takeover s (kill -> standby leads) | repair s (kill -> $job's ring re-formed at 4) | Lease holder after | jobs whose counters changed (job repairs failures) |"
    echo "|---|---|---|---|"
    printf '| %s | %s | %s | %s |\n' "${s_lead:+$(printf %.1f "$(echo "$s_lead - $s0" | bc)")}" \
      "${s_rep:+$(printf %.1f "$(echo "$s_rep - $s0" | bc)")}" \
      "$holder" "$(echo "$changed" | sed 's/^> //' | paste -sd ';' -)"
    echo
    echo "Before: $(grep "^$job " "$W/counters-before.txt"); standby b: CPU $(cpu_s "${OPID[db]}") s, peak RSS $(rss_mib "${OPID[db]}") MiB."
  } >>"$OUT/failover.md"
  OPID[da]=${OPID[db]}
}

: >"$OUT/failover.md"
for n in "${SIZES[@]}"; do bench_one "$n"; done
cat "$RESULTS"
cat "$OUT/failover.md" | tee -a "$RESULTS"
echo "(raw request counts per window: $RAW)" >&2
