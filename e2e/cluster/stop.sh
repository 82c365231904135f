#!/usr/bin/env bash
# stop.sh WORK_DIR [--keep] — stops only the processes whose ids start.sh (and the process kubelet)
# recorded in WORK_DIR/*.pid, newest layer first, and the containers labelled with its kubelet
# root, then removes WORK_DIR unless --keep.
set -uo pipefail
W=${1:?usage: $0 WORK_DIR [--keep]}
[[ -d "$W" ]] || exit 0
for c in operator kueue coscheduling kubelet kube-scheduler kube-controller-manager kube-apiserver etcd watchdog; do
  f="$W/$c.pid"; [[ -f "$f" ]] || continue
  pid=$(cat "$f")
  rm -f "$f"
  [[ "$pid" == "$PPID" ]] && continue   # the watchdog runs us: it ends by itself
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -KILL "$pid" 2>/dev/null
done
# Containers of the kubelet's container mode that it could not stop itself (it was killed).
if command -v podman >/dev/null && [[ -d "$W/kubelet" ]]; then
  podman --storage-driver vfs rm --force --time 0 --filter "label=io.diphoma.kubelet-root=$W/kubelet" >/dev/null 2>&1
fi
[[ "${2:-}" == --keep ]] || rm -rf "$W"
exit 0
