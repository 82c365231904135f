#!/usr/bin/env bash
# timeline.sh NAMESPACE KIND — where a converge's time goes (issue 14): for each worker pod of
# NAMESPACE (KIND: diphoma | pytorch, the job kind to start the clock at), the seconds from the
# first job's creation to the pod created, bound by the scheduler (PodScheduled), Running and
# Ready; for Diphoma also each ring ConfigMap's creation. Prints, per stage, the p10/p50/p90/max
# offsets in seconds (1 s resolution: API timestamps are RFC 3339 seconds). Read-only: GETs with
# the current KUBECONFIG. Run by run.sh right after a converge (before the idle window).
set -euo pipefail
ns=$1 kind=$2
case $kind in
  diphoma) jobs=diphomajobs ;;
  pytorch) jobs=pytorchjobs ;;
  *) echo "timeline.sh: KIND must be diphoma or pytorch, not '$kind'" >&2; exit 2 ;;
esac
t0=$(kubectl get "$jobs" -n "$ns" -o json | jq -r '[.items[].metadata.creationTimestamp] | min')
[[ $t0 != null ]] || { echo "timeline.sh: no $jobs in $ns" >&2; exit 1; }
{
  kubectl get pods -n "$ns" -o json | jq -r --arg t0 "$t0" '
    def s: fromdateiso8601 - ($t0 | fromdateiso8601);
    def cond($t): [.status.conditions[]? | select(.type == $t and .status == "True") | .lastTransitionTime] | first;
    .items[] |
      ("created \(.metadata.creationTimestamp | s)"),
      (cond("PodScheduled") // empty | "bound \(s)"),
      (.status.containerStatuses[0].state.running.startedAt // empty | "running \(s)"),
      (cond("Ready") // empty | "ready \(s)")'
  if [[ $kind == diphoma ]]; then
    kubectl get configmaps -n "$ns" -l app.kubernetes.io/managed-by=diphoma-operator -o json |
      jq -r --arg t0 "$t0" '.items[] | select(.metadata.name | endswith("-ring"))
        | "ring \(.metadata.creationTimestamp | fromdateiso8601 - ($t0 | fromdateiso8601))"'
  fi
} | sort -k1,1 -k2,2n | awk '
  function flush() {
    if (c) printf "| %s | %d | %d | %d | %d | %d |\n", st, c, v[int((c - 1) * 0.1) + 1], v[int((c - 1) * 0.5) + 1], v[int((c - 1) * 0.9) + 1], v[c]
  }
  BEGIN { printf "| stage (s from the first job created) | count | p10 | p50 | p90 | max |\n|---|---|---|---|---|---|\n" }
  $1 != st { flush(); st = $1; c = 0 }
  { v[++c] = $2 }
  END { flush() }' | awk 'NR <= 2 { print; next } { print | "sort -t\"|\" -k7,7n" }'
