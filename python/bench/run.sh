#!/usr/bin/env bash
# python/bench/run.sh — `make bench-torch`: in one run on this machine, in ROUNDS interleaved
# rounds (the order of the contenders rotates each round, so that load hits them alike):
# - DDP step time on CPU with backend gloo against diphoma, the latter with the ring's default
#   per-frame integrity (the default until issue 30) and without it (none, the default since;
#   gloo has none): torchvision ResNet-18
#   and ResNet-50, synthetic 32×32 images, batch 2 per rank, world 2 and 4; step time,
#   communication share, ratio to gloo; and where the step goes: DDP with a comm hook that
#   communicates nothing, and the backend's all_reduce of DDP's buckets alone (their serial sum),
#   beside the physical floor (below); the bucket timeline (DDP's own all-reduce hook with a
#   clock around it: what backward hides, what the last bucket leaves exposed, what backward
#   loses to the hidden all-reduces); and the bf16 pair (below);
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
# built --release and installed into it, `cargo build --release -p diphoma-worker` (both before
# the network namespace, under PROFILES; netns.sh installs iperf3 if missing).
# Env: PARTS ("ddp allreduce overhead") ROUNDS (3) STEPS (10: timed steps of each kind per run) WARMUP
#      (2) WORLDS ("2 4") MODELS ("resnet18 resnet50") SIZES (1K,64K,1M,16M,64M)
#      OUT (python/bench/RESULTS.md) PROFILE / PROFILES (none: plain loopback; below).
#      The 1 MiB binding overhead alone, in a few minutes:
#      PARTS=allreduce SIZES=1M ROUNDS=5 WORLDS=2 make bench-torch
# Every rank runs with OMP_NUM_THREADS=1 unless it is set (python -m diphoma.run's default, as
# torchrun's), the same for every backend.
#
# bf16 on the wire (part ddp): diphoma with DIPHOMA_COMPRESSION=bf16 (no protection) against gloo
# with DDP's bf16_compress_hook (the like-for-like anchor), in the same rotation as the f32
# contenders; step time and ratio to gloo + hook, and the training result's difference: every
# DDP run also trains a fresh model from seed 0 for STEPS steps (each rank on batches of its own
# seed) and report.py prints the max |Δparam| between the contenders. Beside each DDP cell its
# physical floor: the larger of the step under a comm hook that communicates nothing and the link
# time of its gradient bytes, 2·(n−1)/n · bytes / rate (a ring all-reduce; bf16: half the bytes),
# and the bars of issue 30, printed, never asserted: where the link is the bottleneck, diphoma's
# default (no protection) ≤ 0.85× gloo's step and bf16's step rate ≥ 1.8× f32's; everywhere,
# diphoma's default never slower than gloo.
#
# Network profiles (issue 30; root): PROFILE=1g or PROFILES="1g 2.5g 10g loopback" runs the parts
# ddp and allreduce (the default PARTS then; overhead and layout run on plain loopback only)
# inside one network namespace of the run's own, shaped by worker/bench/netns.sh as `make bench`
# is: every rank of every contender on its own address 127.0.0.(r+2) (gloo by
# GLOO_SOCKET_IFNAME=lo:rR, the diphoma ring by DIPHOMA_RING_ADDRESSES, both set per rank by
# worker/bench/netns/sitecustomize.py, as python -m diphoma.run puts every rank on 127.0.0.1;
# the Rust bench by --hosts; outgoing connections bound to the rank's address by the srcbind
# shim), the loopback shaped per address with htb at the
# profile's rate, the profiles interleaved in every round, each profile's single TCP stream per
# link measured once (iperf3) and printed with its tables. RESULTS.md gets one "Network
# profiles" section per run, a subsection per profile; the plain loopback sections stay as they
# were.
#
# Horovod is not compared: `pip install horovod` (0.28.1, the newest release, an sdist of 2023)
# in a throwaway venv with HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1
# failed on this machine (2026-12-01): its CMake configure stops at "No module named 'torch'"
# inside pip's isolated build environment ("Failed building wheel for horovod"). Not retried
# with --no-build-isolation against torch 2.15.
set -euo pipefail
repo="$(git rev-parse --show-toplevel)"
cd "$repo"
if [[ -n "${PROFILE:-}${PROFILES:-}" ]]; then PROFILES="${PROFILES:-$PROFILE}"; fi
# PARTS=layout runs the layouts (not in the default); under PROFILES the default is "ddp allreduce".
if [[ -z ${PARTS:-} ]]; then PARTS="ddp allreduce"; [[ -n ${PROFILES:-} ]] || PARTS+=" overhead"; fi
ROUNDS="${ROUNDS:-3}"; STEPS="${STEPS:-10}"; WARMUP="${WARMUP:-2}"
WORLDS="${WORLDS:-2 4}"
MODELS="${MODELS:-resnet18 resnet50}"; SIZES="${SIZES:-1K,64K,1M,16M,64M}"
OUT="${OUT:-$repo/python/bench/RESULTS.md}"
venv=$(bash python/venv.sh test)
target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
if [[ -n ${PROFILES:-} ]]; then
  source worker/bench/netns.sh
  for p in $PROFILES; do netns_rate "$p" >/dev/null; done
  for part in $PARTS; do
    [[ $part == ddp || $part == allreduce ]] || { echo "PARTS=$part runs on plain loopback only, not with PROFILES" >&2; exit 2; }
  done
fi
if [[ -z ${NETNS_INSIDE:-} ]]; then  # built once, before the namespace (netns_enter runs this script again)
  "$venv/bin/maturin" build --quiet --release -m python/Cargo.toml -o "$target/wheels-bench" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check --force-reinstall --no-deps "$target"/wheels-bench/diphoma-*.whl
  cargo build --release -p diphoma-worker
fi
if [[ -n ${PROFILES:-} ]]; then
  export PROFILES PARTS ROUNDS STEPS WARMUP WORLDS MODELS SIZES OUT
  netns_enter "$0" "$@"  # everything below runs again inside a new network namespace
  netns_setup "$(tr ' ' '\n' <<<"$WORLDS" | sort -n | tail -1)"
  hosts=$(tr ' ' , <<<"$NETNS_ADDRS")
fi
tmp=$(mktemp -d)
cleanup() { rm -rf "$tmp"; if [[ -n ${NETNS_INSIDE:-} ]]; then netns_cleanup; fi; }
trap cleanup EXIT
trap 'exit 130' INT TERM
rows=$tmp/rows; rust=$tmp/rust; overhead=$tmp/overhead; links=$tmp/links
mkdir -p "$tmp/params" "$links"; : >"$rows"; : >"$rust"; : >"$overhead"
bytes=$(python3 -c 'import sys; m={"K":1<<10,"M":1<<20,"G":1<<30}; print(",".join(str(int(s[:-1])*m[s[-1]] if s[-1] in m else int(s)) for s in sys.argv[1].split(",")))' "$SIZES")
# backend:protection:compression. all_reduce from Python: the first three; the DDP step: all five
# (bf16: diphoma's DIPHOMA_COMPRESSION against gloo with DDP's bf16_compress_hook).
contenders=(gloo:-:none diphoma:integrity:none diphoma:none:none)
ddp_contenders=("${contenders[@]}" gloo:-:bf16 diphoma:none:bf16)
# launch ROUND CONTENDER WORLD ARGS…: one run of bench_torch.py under the standalone launcher.
launch() {
  local backend protection compression
  IFS=: read -r backend protection compression <<<"$2"
  [[ $backend == gloo ]] && protection=integrity   # unused by gloo
  BENCH_ROUND=$1 BENCH_PARAMS=$tmp/params DIPHOMA_RING_PROTECTION=$protection DIPHOMA_COMPRESSION=$compression \
    PYTHONWARNINGS=ignore "$venv/bin/python" -m diphoma.run --nproc "$3" python/bench/bench_torch.py "${@:4}"
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
  dorder=("${ddp_contenders[@]:r%5}" "${ddp_contenders[@]:0:r%5}")
  for p in ${PROFILES:-plain}; do
    if [[ -n ${PROFILES:-} ]]; then
      netns_shape "$p"
      if [[ ! -s $links/$p.txt ]]; then
        echo "### profile $p (${NETNS_RATE_GBIT:-unshaped} Gbit/s per rank address): a single TCP stream per link" >&2
        netns_probe "$links/$p.txt" >&2
      fi
    fi
    for w in $WORLDS; do
      echo "round $((r + 1))/$ROUNDS${PROFILES:+ profile $p} world $w: ${dorder[*]}" >&2
      if [[ " $PARTS " == *" ddp "* ]]; then
        for model in $MODELS; do
          for c in "${dorder[@]}"; do launch "$r" "$c" "$w" ddp "${c%%:*}" "$model" "$STEPS" "$WARMUP" "$rows"; done
        done
      fi
      if [[ " $PARTS " == *" allreduce "* ]]; then
        for c in "${order[@]}"; do launch "$r" "$c" "$w" allreduce "${c%%:*}" "$bytes" "$rows"; done
        for pr in integrity none; do
          echo "## ${PROFILES:+profile $p }round $r world $w protection $pr" >>"$rust"
          "$target/release/diphoma-worker" bench --world "$w" ${PROFILES:+--hosts "$hosts"} --sizes "$SIZES" \
            --protection "$pr" >>"$rust"
        done
      fi
      if [[ " $PARTS " == *" overhead "* ]]; then
        echo "### round $((r + 1)), world $w" >>"$overhead"
        SIZES=$SIZES DIPHOMA_RING_PROTECTION=integrity PYTHONWARNINGS=ignore \
          "$venv/bin/python" -m diphoma.run --nproc "$w" python/bench/overhead.py >>"$overhead"
      fi
    done
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
OVERHEAD=$overhead LINKS=$links PROFILES="${PROFILES:-}" "$venv/bin/python" python/bench/report.py "$rows" "$rust" "$OUT" \
  "$load_before" "$load_after" \
  "PARTS=\"$PARTS\" ROUNDS=$ROUNDS STEPS=$STEPS WARMUP=$WARMUP WORLDS=\"$WORLDS\" MODELS=\"$MODELS\" SIZES=$SIZES${PROFILES:+ PROFILES=\"$PROFILES\"}"
