#!/usr/bin/env bash
# start-kueue.sh WORK_DIR — starts Kueue (built by build-kueue.sh) against the local control
# plane of WORK_DIR (started by start.sh: its env file, admin kubeconfig and pid files), on
# loopback only, with DiphomaJob configured as a Kueue external framework; records its pid in
# WORK_DIR/kueue.pid, so stop.sh (and start.sh's watchdog) stop it with the control plane.
#
# - CRDs: the module's config/components/crd/bases (v1beta2 is the storage version; no conversion
#   webhook is registered: nothing here reads another version).
# - Webhooks: the module's config/components/webhook manifests, only those on Kueue's own API
#   group (the job-framework webhooks, pods included, are left out: no framework but DiphomaJob
#   is used), each given a `url:` client config on 127.0.0.1 and the CA generated here instead
#   of a Service (there is no kube-proxy).
# - Metrics, health and webhook ports on 127.0.0.1; the visibility server (0.0.0.0 by default)
#   is turned off; no leader election; internal certificate management off.
set -euo pipefail
W=$(cd "${1:?usage: $0 WORK_DIR}" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck disable=SC1091
source "$W/env"
{ read -r KBIN; read -r MOD; } < <(bash "$HERE/build-kueue.sh")
K="$W/kueue"
mkdir -p "$K/certs" "$W/logs"
freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
WEBHOOK_PORT=$(freeport)
METRICS_PORT=$(freeport)
HEALTH_PORT=$(freeport)

# --- webhook serving certificate: a CA of its own and a leaf for IP 127.0.0.1 ---
(
  cd "$K/certs"
  openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out ca.key 2>/dev/null
  openssl req -x509 -new -key ca.key -sha256 -days 3650 -subj "/CN=kueue-webhook-ca" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" -out ca.crt
  printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1\n' >tls.ext
  openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out tls.key 2>/dev/null
  openssl req -new -key tls.key -subj "/CN=127.0.0.1" -out tls.csr
  openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 -days 3650 \
    -extfile tls.ext -out tls.crt 2>/dev/null
  rm -f tls.csr
)

# Kueue v0.17 reads its metrics-server certificate from a fixed path when internal certificate
# management is off (cmd/kueue/main.go: /etc/kueue/metrics/certs); nothing verifies it here (the
# metrics port is loopback and unscraped), so the webhook's leaf is copied there once.
MC=/etc/kueue/metrics/certs
if [[ ! -s $MC/tls.crt || ! -s $MC/tls.key ]]; then
  mkdir -p "$MC" 2>/dev/null && cp "$K/certs/tls.crt" "$K/certs/tls.key" "$MC/" ||
    { echo "Kueue needs a certificate in $MC (not writable here): create it once as root" >&2; exit 1; }
fi

# --- CRDs (server-side: the Workload CRD is too large for the last-applied annotation) ---
kubectl apply --server-side --force-conflicts -f "$MOD/config/components/crd/bases" >/dev/null
for crd in workloads clusterqueues localqueues resourceflavors workloadpriorityclasses; do
  for ((i = 0; i < 300; i++)); do
    est=$(kubectl get "crd/$crd.kueue.x-k8s.io" \
      -o jsonpath='{.status.conditions[?(@.type=="Established")].status}' 2>/dev/null || true)
    [[ $est == True ]] && break
    sleep 0.2
  done
  [[ $est == True ]] || { echo "CRD $crd.kueue.x-k8s.io not established" >&2; exit 1; }
done
kubectl create namespace kueue-system --dry-run=client -o yaml | kubectl apply -f - >/dev/null

# --- Kueue's configuration ---
cat >"$K/config.yaml" <<CFG
apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
namespace: kueue-system
health:
  healthProbeBindAddress: 127.0.0.1:${HEALTH_PORT}
metrics:
  bindAddress: 127.0.0.1:${METRICS_PORT}
webhook:
  host: 127.0.0.1
  port: ${WEBHOOK_PORT}
  certDir: $K/certs
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
manageJobsWithoutQueueName: false
integrations:
  frameworks: ["batch/job"]
  externalFrameworks: ["DiphomaJob.v1alpha1.diphoma.io"]
# All-or-nothing admission, as GPU clusters configure it: an admitted Workload whose PodsReady
# condition (written by the operator from the ring) is not True within the timeout, or within
# recoveryTimeout after it turned False, is evicted and requeued after a back-off; meanwhile
# blockAdmission admits nothing else in its ClusterQueue.
waitForPodsReady:
  timeout: ${KUEUE_PODS_READY_TIMEOUT:-90s}
  recoveryTimeout: ${KUEUE_PODS_READY_RECOVERY_TIMEOUT:-20s}
  blockAdmission: true
  requeuingStrategy:
    timestamp: Eviction
    backoffBaseSeconds: 1
    backoffMaxSeconds: 10
CFG

# --- webhook configurations: Kueue's own group only, url client config on loopback ---
CA_B64=$(base64 -w0 <"$K/certs/ca.crt")
kubectl create --dry-run=client -o json -f "$MOD/config/components/webhook/manifests.yaml" |
  python3 -c '
import json, sys
port, ca = sys.argv[1], sys.argv[2]
text, dec, items, at = sys.stdin.read(), json.JSONDecoder(), [], 0
while text[at:].strip():  # kubectl prints one JSON object per document
    at += len(text[at:]) - len(text[at:].lstrip())
    doc, at = dec.raw_decode(text, at)
    items += doc["items"] if doc.get("kind") == "List" else [doc]
for cfg in items:
    cfg["metadata"]["name"] = "kueue-" + cfg["metadata"]["name"]
    kept = []
    for h in cfg.get("webhooks", []):
        if not all("kueue.x-k8s.io" in r.get("apiGroups", []) for r in h.get("rules", [])):
            continue
        path = h["clientConfig"]["service"]["path"]
        h["clientConfig"] = {"url": "https://127.0.0.1:%s%s" % (port, path), "caBundle": ca}
        kept.append(h)
    cfg["webhooks"] = kept
print(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
' "$WEBHOOK_PORT" "$CA_B64" >"$K/webhooks.json"

# --- the manager ---
# ElasticJobsViaWorkloadSlices (alpha): a DiphomaJob annotated kueue.x-k8s.io/elastic-job scales
# through workload slices without stopping its workers.
"$KBIN/kueue" --config="$K/config.yaml" --kubeconfig="$KUBECONFIG" \
  --feature-gates=VisibilityOnDemand=false,ElasticJobsViaWorkloadSlices=true --zap-log-level="${KUEUE_LOG_LEVEL:-2}" >"$W/logs/kueue.log" 2>&1 &
echo $! >"$W/kueue.pid"
for ((i = 0; i < 300; i++)); do
  curl -fsS "http://127.0.0.1:${HEALTH_PORT}/readyz" >/dev/null 2>&1 && break
  kill -0 "$(cat "$W/kueue.pid")" 2>/dev/null || { echo "kueue exited; see $W/logs/kueue.log" >&2; exit 1; }
  sleep 0.2
done
curl -fsS "http://127.0.0.1:${HEALTH_PORT}/readyz" >/dev/null || { echo "kueue not ready; see $W/logs/kueue.log" >&2; exit 1; }
# Registered once the webhook server answers, so no request is refused while Kueue starts.
for ((i = 0; i < 150; i++)); do
  curl -fsS --cacert "$K/certs/ca.crt" -o /dev/null "https://127.0.0.1:${WEBHOOK_PORT}/" 2>/dev/null && break
  [[ $(curl -s -o /dev/null -w '%{http_code}' --cacert "$K/certs/ca.crt" "https://127.0.0.1:${WEBHOOK_PORT}/") != 000 ]] && break
  sleep 0.2
done
kubectl apply -f "$K/webhooks.json" >/dev/null
echo "export KUEUE_METRICS_PORT=${METRICS_PORT} KUEUE_WEBHOOK_PORT=${WEBHOOK_PORT}" >>"$W/env"
echo "kueue up (webhook 127.0.0.1:${WEBHOOK_PORT}); log $W/logs/kueue.log"
