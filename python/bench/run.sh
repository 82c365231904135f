#!/usr/bin/env bash
# python/bench/run.sh — `make bench-torch`: in one run on this machine, in ROUNDS interleaved
# rounds (the order of the contenders rotates each round, so that load hits them alike):
# - DDP step time on CPU with backend gloo against diphoma, the latter with the ring's default
#   per-frame integrity (the default until issue 30) and without it (none, the default since;
#   gloo has none): torchvision ResNet-18
#   and ResNet-50, synthetic 32×32 images, batch 2 per rank, world 2 and 4; step time,
#   communication share, ratio to gloo; and where the step goes: DDP with a comm hook that
#   communicates nothing, and the backend's all_reduce of DDP's buckets alone (their sum: the floor);
# - torch.distributed.all_reduce from Python (gloo, diphoma integrity, diphoma none) against the
#   Rust `diphoma-worker bench` (integrity, none) at the protocol's sizes, timed alike (the
#   binding's overhead);
# - where all_reduce's time goes beyond the ring (python/bench/overhead.py: the native ring call,
#   the process group, dist.all_reduce sync and async, interleaved; the time outside the ring);
# - layouts at world 4 (PARTS=layout, not in the default PARTS): 2 local pods × 2 processes
#   (python -m diphoma.run --pods 2: the hierarchical all-reduce, and flat with
#   DIPHOMA_HIERARCHICAL=0; every size hierarchical: DIPHOMA_HIERARCHICAL_MIN_BYTES=0) against 4 × 1 diphoma and gloo at world 4: all_reduce at SIZES and
#   the DDP step of MODELS, no protection. On one machine every layout sends the same bytes over
#   the same loopback: the table shows the hierarchical path's cost, its gain needs two nodes.
# Writes python/bench/RESULTS.md: medians over rounds, ratios as the median of the rounds'
# ratios with their min–max, and the machine's load average before and after. A part left out
# of PARTS keeps its section of the previous RESULTS.md (each section states its own run).
#
# Setup (idempotent): the cached torch venv with torchvision (python/venv.sh test), the wheel
# built --release and installed into it, `cargo build --release -p diphoma-worker`.
# Env: PARTS ("ddp allreduce overhead") ROUNDS (3) STEPS (10: timed steps of each kind per run) WARMUP
#      (2) WORLDS ("2 4") MODELS ("resnet18 resnet50") SIZES (1K,64K,1M,16M,64M)
#      OUT (python/bench/RESULTS.md). The 1 MiB binding overhead alone, in a few minutes:
#      PARTS=allreduce SIZES=1M ROUNDS=5 WORLDS=2 make bench-torch
# Every rank runs with OMP_NUM_THREADS=1 unless it is set (python -m diphoma.run's default, as
# torchrun's), the same for every backend.
#
# Horovod is not compared: `pip install horovod` (0.28.1, the newest release, an sdist of 2023)
# in a throwaway venv with HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1
# failed on this machine (2026-12-01): its CMake configure stops at "No module named 'torch'"
# inside pip's isolated build environment ("Failed building wheel for horovod"). Not retried
# with --no-build-isolation against torch 2.15.
set -euo pipefail
repo="$(git rev-parse --show-toplevel)"
cd "$repo"
PARTS="${PARTS:-ddp allreduce overhead}"  # PARTS=layout runs the layouts (not in the default)
ROUNDS="${ROUNDS:-3}"; STEPS="${STEPS:-10}"; WARMUP="${WARMUP:-2}"
WORLDS="${WORLDS:-2 4}"
MODELS="${MODELS:-resnet18 resnet50}"; SIZES="${SIZES:-1K,64K,1M,16M,64M}"
OUT="${OUT:-$repo/python/bench/RESULTS.md}"
venv=$(bash python/venv.sh test)
target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
"$venv/bin/maturin" build --quiet --release -m python/Cargo.toml -o "$target/wheels-bench" >&2
"$venv/bin/pip" install --quiet --disable-pip-version-check --force-reinstall --no-deps "$target"/wheels-bench/diphoma-*.whl
cargo build --release -p diphoma-worker
rows=$(mktemp); rust=$(mktemp); overhead=$(mktemp)
trap 'rm -f "$rows" "$rust" "$overhead"' EXIT
bytes=$(python3 -c 'import sys; m={"K":1<<10,"M":1<<20,"G":1<<30}; print(",".join(str(int(s[:-1])*m[s[-1]] if s[-1] in m else int(s)) for s in sys.argv[1].split(",")))' "$SIZES")
contenders=(gloo diphoma:integrity diphoma:none)
# launch ROUND CONTENDER WORLD ARGS…: one run of bench_torch.py under the standalone launcher.
launch() {
  local backend=${2%%:*} protection=${2#*:}
  [[ $backend == gloo ]] && protection=integrity   # unused by gloo
  BENCH_ROUND=$1 DIPHOMA_RING_PROTECTION=$protection PYTHONWARNINGS=ignore \
    "$venv/bin/python" -m diphoma.run --nproc "$3" python/bench/bench_torch.py "${@:4}"
}
# layout ROUND NAME ARGS…: one run of bench_torch.py at world 4 in layout NAME (4x1, gloo, 2x2,
# "2x2 flat"), no protection.
layout() {
  local name=$2 how=(--nproc 4) hier=1
  case $name in 2x2) how=(--pods 2 --nproc 2) ;; "2x2 flat") how=(--pods 2 --nproc 2); hier=0 ;; esac
  BENCH_ROUND=$1 BENCH_LAYOUT=$name DIPHOMA_HIERARCHICAL=$hier DIPHOMA_HIERARCHICAL_MIN_BYTES=0 \
    DIPHOMA_RING_PROTECTION=none PYTHONWARNINGS=ignore \
    "$venv/bin/python" -m diphoma.run "${how[@]}" python/bench/bench_torch.py "${@:3}"
}
layouts=(gloo 4x1 2x2 "2x2 flat")
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for ((r = 0; r < ROUNDS; r++)); do
  order=("${contenders[@]:r%3}" "${contenders[@]:0:r%3}")   # rotate the order each round
  for w in $WORLDS; do
    echo "round $((r + 1))/$ROUNDS world $w: ${order[*]}" >&2
    if [[ " $PARTS " == *" ddp "* ]]; then
      for model in $MODELS; do
        for c in "${order[@]}"; do launch "$r" "$c" "$w" ddp "${c%%:*}" "$model" "$STEPS" "$WARMUP" "$rows"; done
      done
    fi
    if [[ " $PARTS " == *" allreduce "* ]]; then
      for c in "${order[@]}"; do launch "$r" "$c" "$w" allreduce "${c%%:*}" "$bytes" "$rows"; done
      for p in integrity none; do
        echo "## round $r world $w protection $p" >>"$rust"
        "$target/release/diphoma-worker" bench --world "$w" --sizes "$SIZES" --protection "$p" >>"$rust"
      done
    fi
    if [[ " $PARTS " == *" overhead "* ]]; then
      echo "### round $((r + 1)), world $w" >>"$overhead"
      SIZES=$SIZES DIPHOMA_RING_PROTECTION=integrity PYTHONWARNINGS=ignore \
        "$venv/bin/python" -m diphoma.run --nproc "$w" python/bench/overhead.py >>"$overhead"
    fi
  done
  if [[ " $PARTS " == *" layout "* ]]; then
    lorder=("${layouts[@]:r%4}" "${layouts[@]:0:r%4}")
    echo "round $((r + 1))/$ROUNDS layouts at world 4: ${lorder[*]}" >&2
    for l in "${lorder[@]}"; do
      backend=diphoma; [[ $l == gloo ]] && backend=gloo
      for model in $MODELS; do layout "$r" "$l" ddp "$backend" "$model" "$STEPS" "$WARMUP" "$rows"; done
      layout "$r" "$l" allreduce "$backend" "$bytes" "$rows"
    done
  fi
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
OVERHEAD=$overhead "$venv/bin/python" python/bench/report.py "$rows" "$rust" "$OUT" "$load_before" "$load_after" \
  "PARTS=\"$PARTS\" ROUNDS=$ROUNDS STEPS=$STEPS WARMUP=$WARMUP WORLDS=\"$WORLDS\" MODELS=\"$MODELS\" SIZES=$SIZES"
