#!/usr/bin/env bash
# worker/bench/balance.sh — `make bench-balance`: speed-weighted shares and periodic averaging,
# side by side in one run on this machine; prints a Markdown report (worker/bench/BALANCE.md
# holds a committed one).
#
# Part 1, one slowed rank: 4 `diphoma-worker train --launched` processes on 127.0.0.1, ranks
# 0–2 pinned to CPU 0 and rank 3 to CPU 1 together with a CPU burner (`nice -n -10`, pinned by
# taskset, started and stopped by its PID). Equal shares against speed-weighted shares,
# ROUNDS rounds interleaved; the ideal is the sum of the ranks' measured compute rates
# (samples/s) of the speed-weighted run, i.e. the throughput with no rank waiting for another
# and free communication.
# Part 2, periodic averaging: `train --standalone --world 4` of the synthetic model of PARAMS
# parameters for STEPS steps, every-step synchronisation against periodic averaging with
# H = 1, 4, 16: samples/s, allreduces and test accuracy.
#
# Env: ROUNDS (2) BURN_PARAMS (2000000) BURN_STEPS (60) PARAMS (50000000) STEPS (32)
#      RUN_TIMEOUT (s per run, 900) PARTS ("1 2": which parts to run). Needs two CPUs and
#      taskset (util-linux).
set -euo pipefail
repo="$(git rev-parse --show-toplevel)"
ROUNDS="${ROUNDS:-2}"; BURN_PARAMS="${BURN_PARAMS:-2000000}"; BURN_STEPS="${BURN_STEPS:-60}"
PARAMS="${PARAMS:-50000000}"; STEPS="${STEPS:-32}"; RUN_TIMEOUT="${RUN_TIMEOUT:-900}"
PARTS="${PARTS:-1 2}"
(cd "$repo" && cargo build --release --locked -p diphoma-worker >&2)
target="$(cd "$repo" && cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
DW="$target/release/diphoma-worker"
work="$(mktemp -d)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

# launched OUT EXTRA...: the 4 pinned ranks with a burner on rank 3's CPU; rank 0's stdout to OUT.
launched() {
  local out=$1; shift
  head -c 32 /dev/urandom > "$work/key"
  local addrs
  addrs=$(python3 -c 'import socket
ss=[socket.socket() for _ in range(4)]
[s.bind(("127.0.0.1",0)) for s in ss]
print(",".join("127.0.0.1:%d" % s.getsockname()[1] for s in ss))')
  nice -n -10 taskset -c 1 sh -c 'while :; do :; done' & local burner=$!; pids+=("$burner")
  local ranks=() r
  for r in 0 1 2 3; do
    local cpu=0; [[ $r == 3 ]] && cpu=1
    DIPHOMA_RANK=$r DIPHOMA_WORLD_SIZE=4 DIPHOMA_RING_ADDRESSES=$addrs DIPHOMA_JOB_UID=bench \
      DIPHOMA_KEY_FILE="$work/key" RAYON_NUM_THREADS=1 \
      timeout "$RUN_TIMEOUT" taskset -c "$cpu" "$DW" train --launched --model synthetic \
      --params "$BURN_PARAMS" --layers 2 --lr 0.05 --steps "$BURN_STEPS" --balance-every 2 \
      --log-every 0 "$@" > "$work/rank$r.out" 2>&1 &
    ranks+=($!); pids+=($!)
  done
  wait "${ranks[@]}" || true
  kill -KILL "$burner" 2>/dev/null || true; wait "$burner" 2>/dev/null || true
  cp "$work/rank0.out" "$out"
}
# field FILE REGEX: the first capture of REGEX in FILE.
field() { sed -nE "s#.*$2.*#\1#p" "$1" | head -1; }

echo "# Balance benchmark (make bench-balance)"
echo
echo '```'
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), kernel $(uname -r)"
echo "commit: $(git -C "$repo" rev-parse --short HEAD)$(git -C "$repo" diff --quiet -- worker || echo '+dirty')"
echo "load at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "command: PARTS='$PARTS' ROUNDS=$ROUNDS BURN_PARAMS=$BURN_PARAMS BURN_STEPS=$BURN_STEPS PARAMS=$PARAMS STEPS=$STEPS make bench-balance"
echo '```'
if [[ " $PARTS " == *" 1 "* ]]; then
echo
echo "## 1. Four ranks, rank 3 sharing its CPU with a burner (synthetic model, $BURN_PARAMS parameters, batch 64, $BURN_STEPS steps)"
echo
echo "| round | split | samples/s | final shares | rank rates (samples/s) | ideal (sum of rates) | of ideal |"
echo "|---|---|---|---|---|---|---|"
for r in $(seq 1 "$ROUNDS"); do
  launched "$work/eq$r" --speed-weighted false
  launched "$work/sw$r" --speed-weighted true
  ideal=$(field "$work/sw$r" 'rates [^ ]+ samples/s \(sum ([0-9.]+)\)')
  for kind in eq sw; do
    f="$work/$kind$r"
    sps=$(field "$f" 'throughput ([0-9.]+) samples/s')
    shares=$(field "$f" 'shares ([0-9/]+)')
    rates=$(field "$f" 'rates ([0-9./]+) samples/s')
    name=$([[ $kind == eq ]] && echo equal || echo speed-weighted)
    pct=$(python3 -c "print(f'{100*float(\"${sps:-0}\")/float(\"${ideal:-1}\"):.0f}%')")
    echo "| $r | $name | ${sps:-?} | ${shares:-?} | ${rates:-not exchanged} | ${ideal:-?} | $pct |"
  done
done
fi
if [[ " $PARTS " == *" 2 "* ]]; then
echo
echo "## 2. Periodic averaging: 4 ranks (threads), synthetic model of $PARAMS parameters, batch 64, $STEPS steps"
echo
echo "| sync | samples/s | allreduces | test accuracy | final loss |"
echo "|---|---|---|---|---|"
for h in 0 1 4 16; do
  f="$work/p$h"
  timeout "$RUN_TIMEOUT" "$DW" train --standalone --world 4 --model synthetic --params "$PARAMS" \
    --lr 0.05 --steps "$STEPS" --log-every "$STEPS" --sync-every "$h" > "$f" 2>&1 || true
  sps=$(field "$f" 'throughput ([0-9.]+) samples/s')
  ars=$(field "$f" 'allreduces ([0-9]+) for')
  acc=$(field "$f" 'test accuracy ([0-9.]+)')
  loss=$(field "$f" 'loss ([0-9.]+) samples/s')
  name=$([[ $h == 0 ]] && echo "every step" || echo "periodic H=$h")
  echo "| $name | ${sps:-?} | ${ars:-?} | ${acc:-?} | ${loss:-?} |"
done
fi
echo
echo "load at end: $(cut -d' ' -f1-3 /proc/loadavg)"
