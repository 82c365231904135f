#!/usr/bin/env bash
# stop.sh WORK_DIR [--keep] — stops only the processes whose ids start.sh (and the process kubelet)
# recorded in WORK_DIR/*.pid, newest layer first, then removes WORK_DIR unless --keep.
set -uo pipefail
W=${1:?usage: $0 WORK_DIR [--keep]}
[[ -d "$W" ]] || exit 0
for c in operator kubelet kube-scheduler kube-controller-manager kube-apiserver etcd watchdog; do
  f="$W/$c.pid"; [[ -f "$f" ]] || continue
  pid=$(cat "$f")
  rm -f "$f"
  [[ "$pid" == "$PPID" ]] && continue   # the watchdog runs us: it ends by itself
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -KILL "$pid" 2>/dev/null
done
[[ "${2:-}" == --keep ]] || rm -rf "$W"
exit 0
