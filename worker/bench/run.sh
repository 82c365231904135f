#!/usr/bin/env bash
# worker/bench/run.sh — `make bench`: Diphoma's allreduce side by side with the anchors of
# ../shared/bench/anchors (torch gloo, Open MPI over TCP and shared memory) and the physical
# probes (ringbw, tcp_pingpong, membw), rounds interleaved, in one run on this machine; then the
# merged table (summarize.py) and the bars of design/performance.md §1 (bars.py).
#
# Idempotent setup: apt packages openmpi-bin libopenmpi-dev (root), a venv with torch+numpy from
# PyPI cached in ${XDG_CACHE_HOME:-$HOME/.cache}/diphoma/bench, `cargo build --release`.
# Every benchmark runs in its own process group, which is killed when it ends or times out and
# on exit, so nothing stays running.
#
# Env: SIZES (1K,64K,1M,16M,64M) SAMPLES (20) ROUNDS (5) WORLDS ("2 4") OUT (results dir)
#      DW (a diphoma-worker release binary to use instead of building one)
#      QUIET_WAIT (s to wait for an idle CPU before each run, 30) RUN_TIMEOUT (s per run, 600)
#
# Network profiles (issue 30; root): PROFILES="loopback 10g 2.5g 1g" (or PROFILE=1g) runs the
# whole comparison inside one network namespace of its own (worker/bench/netns.sh): each rank on
# its own address 127.0.0.(r+2), the loopback shaped per address with htb at the profile's rate,
# the profiles interleaved in every round (the namespace is reshaped between them), a single
# TCP stream's rate measured per link and profile (iperf3). Per profile and round: Diphoma with
# each protection mode (none, integrity, encryption; one run, samples interleaved), bf16 at n=2
# (protection none, BF16=0 leaves it out), gloo, Open MPI over TCP (each rank held to its own
# address by netns/mpi_rank.sh). Then profiles.py prints the tables side by side, busbw against
# the link's rate, whether each profile is link-bound, and the bars. Open MPI over shared memory
# is not shaped by a network and is left out of profiles.
set -euo pipefail
repo="$(git rev-parse --show-toplevel)"
if [[ -n "${PROFILE:-}${PROFILES:-}" ]]; then PROFILES="${PROFILES:-$PROFILE}"; fi
anchors="$repo/../shared/bench/anchors"
here="$repo/worker/bench"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/diphoma/bench"
# The bench's own torch venv, or else the cached one of the Python tests (python/venv.sh test).
VENV="$CACHE/venv"
[[ -x $VENV/bin/python ]] || VENV=$(bash "$repo/python/venv.sh" test)
SIZES="${SIZES:-1K,64K,1M,16M,64M}"; SAMPLES="${SAMPLES:-20}"; ROUNDS="${ROUNDS:-5}"
WORLDS="${WORLDS:-2 4}"; RUN_TIMEOUT="${RUN_TIMEOUT:-600}"
OUT="${OUT:-$CACHE/results/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$CACHE/bin" "$OUT/probes"
[[ -d "$anchors" ]] || { echo "anchors not found at $anchors" >&2; exit 2; }

# --- setup (idempotent) -------------------------------------------------------------------
if ! command -v mpirun >/dev/null || ! command -v mpicc >/dev/null; then
  apt-get install -y openmpi-bin libopenmpi-dev || { apt-get update && apt-get install -y openmpi-bin libopenmpi-dev; }
fi
if ! "$VENV/bin/python" -c 'import torch, numpy' 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet torch numpy
fi
# DW=path/to/diphoma-worker: a release binary built beforehand (no cargo run here).
if [[ -z ${DW:-} ]]; then
  (cd "$repo" && cargo build --release -p diphoma-worker)
  target=$(cd "$repo" && cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
  DW="$target/release/diphoma-worker"
fi
cc -O3 -march=native -o "$CACHE/bin/membw" "$anchors/membw.c"
cc -O2 -pthread -o "$CACHE/bin/ringbw" "$anchors/ringbw.c"
cc -O2 -o "$CACHE/bin/tcp_pingpong" "$anchors/tcp_pingpong.c"
export BIN_DIR="$CACHE/bin"   # run_mpi.sh builds mpi_allreduce_bench there

# --- process hygiene ------------------------------------------------------------------------
pgids=()
cleanup() { for g in "${pgids[@]}"; do kill -KILL -- "-$g" 2>/dev/null || true; done; }
trap cleanup EXIT
trap 'exit 130' INT TERM
# bounded FILE CMD...: run CMD in a new process group, tee its stdout to FILE, kill the group
# when it ends or after RUN_TIMEOUT seconds.
bounded() {
  local file="$1"; shift
  setsid "$@" > "$file" &
  local pid=$! t=0; pgids+=("$pid")
  while kill -0 "$pid" 2>/dev/null; do
    sleep 0.2; t=$((t+1))
    if (( t > RUN_TIMEOUT*5 )); then echo "# TIMEOUT after ${RUN_TIMEOUT}s: $*" | tee -a "$file"; break; fi
  done
  kill -KILL -- "-$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  cat "$file"
}
busy_pct() { local a b; read -r _ a1 a2 a3 a4 a5 a6 a7 _ < /proc/stat; sleep 1
  read -r _ b1 b2 b3 b4 b5 b6 b7 _ < /proc/stat
  local tot=$(( (b1+b2+b3+b4+b5+b6+b7)-(a1+a2+a3+a4+a5+a6+a7) )) idle=$(( (b4+b5)-(a4+a5) ))
  echo $(( tot>0 ? 100*(tot-idle)/tot : 0 )); }
wait_quiet() { local t0=$SECONDS ok=0 b=0; while (( SECONDS-t0 < ${QUIET_WAIT:-30} )); do
    b=$(busy_pct); if (( b <= 10 )); then ok=$((ok+1)); (( ok>=2 )) && break; else ok=0; fi; done
  echo "# pre-run CPU busy ${b}% (waited $((SECONDS-t0)) s)"; }

# --- network profiles (issue 30) -------------------------------------------------------------
if [[ -n "${PROFILES:-}" ]]; then
  source "$here/netns.sh"
  for p in $PROFILES; do netns_rate "$p" >/dev/null; done
  export OUT SIZES SAMPLES ROUNDS WORLDS PROFILES DW
  # Everything below runs again inside the new namespace (netns_enter re-executes this script).
  netns_enter "$0" "$@"
  netns_setup 4
  trap 'cleanup; netns_cleanup' EXIT
  read -r -a addrs <<<"$NETNS_ADDRS"
  hosts=$(tr ' ' , <<<"$NETNS_ADDRS")
  {
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(free -g | awk '/Mem:/{print $2}') GiB, kernel $(uname -r)"
  echo "commit: $(git -C "$repo" rev-parse --short HEAD)$(git -C "$repo" diff --quiet -- worker || echo '+dirty')"
  echo "torch: $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')  open-mpi: $(mpirun --version 2>/dev/null | head -1)"
  echo "profiles: $PROFILES  rank addresses: $NETNS_ADDRS  SIZES=$SIZES SAMPLES=$SAMPLES ROUNDS=$ROUNDS WORLDS=\"$WORLDS\""
  echo "load at start: $(cut -d' ' -f1-3 /proc/loadavg); uptime: $(uptime)"
  } | tee "$OUT/machine.txt"
  [[ -x $CACHE/bin/mpi_allreduce_bench ]] || mpicc -O2 -o "$CACHE/bin/mpi_allreduce_bench" "$anchors/mpi_allreduce_bench.c" -lm
  for r in $(seq 1 "$ROUNDS"); do
    for p in $PROFILES; do
      netns_shape "$p"; d="$OUT/$p"; mkdir -p "$d/probes"
      if [[ ! -s "$d/probes/link.txt" ]]; then
        wait_quiet; echo "### profile $p: a single TCP stream per link"; netns_probe "$d/probes/link.txt"
      fi
      for n in $WORLDS; do
        wait_quiet; echo "### round $r  $p  diphoma f32 n=$n (none,integrity,encryption)"
        bounded "$d/rustmodes_n${n}_r$r.txt" "$DW" bench --world "$n" --hosts "$hosts" --sizes "$SIZES" \
          --samples "$SAMPLES" --protection none,integrity,encryption
        if [[ $n == 2 && ${BF16:-1} == 1 ]]; then
          wait_quiet; echo "### round $r  $p  diphoma bf16 n=2 (none)"
          bounded "$d/rust-bf16_n2_r$r.txt" "$DW" bench --world 2 --hosts "$hosts" --sizes "$SIZES" \
            --samples "$SAMPLES" --protection none --dtype bf16
        fi
        wait_quiet; echo "### round $r  $p  gloo n=$n"
        bounded "$d/gloo_n${n}_r$r.txt" env OMP_NUM_THREADS=1 "$VENV/bin/python" "$anchors/gloo_allreduce_bench.py" \
          --world "$n" --sizes "$SIZES" --samples "$SAMPLES"
        # Open MPI over TCP: each rank (netns/mpi_rank.sh) restricted to its own address's bridge
        # (btl_tcp_if_include=mpiR) and its outgoing connections bound to that address (the
        # shim), so that the peers see the address it published; mpirun itself without the shim.
        # (Given lo's labels lo:rR, Open MPI 4.1.4 refused its peers' connections, "inbound MPI
        # TCP connection request from an IP address that is unexpected": it keys interfaces by
        # kernel index; with ADDR/32 it aborted in mca_btl_tcp_component_init.)
        wait_quiet; echo "### round $r  $p  MPI tcp n=$n"
        bounded "$d/mpi_tcp_n${n}_r$r.txt" env LD_PRELOAD= NETNS_SHIM="$NETNS_CACHE/bin/srcbind.so" \
          mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$n" --mca pml ob1 --mca btl tcp,self \
          --mca oob_tcp_if_include lo "$here/netns/mpi_rank.sh" "$CACHE/bin/mpi_allreduce_bench" "$SIZES" 5 "$SAMPLES" 20
      done
    done
  done
  echo "load at end: $(cut -d' ' -f1-3 /proc/loadavg); uptime: $(uptime)" | tee -a "$OUT/machine.txt"
  echo "### profiles side by side ($OUT)"
  { cat "$OUT/machine.txt"; echo; python3 "$here/profiles.py" "$OUT" $PROFILES; } | tee "$OUT/profiles.md"
  exit 0
fi

# --- the run ------------------------------------------------------------------------------
{
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(free -g | awk '/Mem:/{print $2}') GiB, kernel $(uname -r)"
echo "commit: $(git -C "$repo" rev-parse --short HEAD)$(git -C "$repo" diff --quiet -- worker || echo '+dirty')"
echo "torch: $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')  open-mpi: $(mpirun --version 2>/dev/null | head -1)"
echo "load at start: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$OUT/machine.txt"
wait_quiet; echo "### membw"; bounded "$OUT/probes/membw.txt" "$CACHE/bin/membw" 64 20
for r in $(seq 1 "$ROUNDS"); do
  wait_quiet; echo "### round $r  tcp_pingpong"; bounded "$OUT/probes/pingpong_r$r.txt" "$CACHE/bin/tcp_pingpong" 1024 20000
  for n in $WORLDS; do
    wait_quiet; echo "### round $r  ringbw n=$n"
    bounded "$OUT/probes/ringbw_n${n}_r$r.txt" "$CACHE/bin/ringbw" "$n" 64 9 128
    wait_quiet; echo "### round $r  diphoma f32 n=$n"
    bounded "$OUT/rust_n${n}_r$r.txt" "$DW" bench --world "$n" --sizes "$SIZES" --samples "$SAMPLES"
    if [[ $n == 2 ]]; then  # half types next to their f32 reference, for the element-rate bar
      for dt in f16 bf16; do
        wait_quiet; echo "### round $r  diphoma $dt n=2"
        bounded "$OUT/rust-${dt}_n2_r$r.txt" "$DW" bench --world 2 --sizes "$SIZES" --samples "$SAMPLES" --dtype "$dt"
      done
    fi
    wait_quiet; echo "### round $r  gloo n=$n"
    bounded "$OUT/gloo_n${n}_r$r.txt" env OMP_NUM_THREADS=1 "$VENV/bin/python" "$anchors/gloo_allreduce_bench.py" --world "$n" --sizes "$SIZES" --samples "$SAMPLES"
    wait_quiet; echo "### round $r  MPI tcp n=$n"
    bounded "$OUT/mpi_tcp_n${n}_r$r.txt" bash "$anchors/run_mpi.sh" "$n" tcp "$SIZES" 5 "$SAMPLES" 20
    wait_quiet; echo "### round $r  MPI tcp ring(alg 4) n=$n"
    bounded "$OUT/mpi_tcpring_n${n}_r$r.txt" env MPI_EXTRA="--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm 4" \
      bash "$anchors/run_mpi.sh" "$n" tcp "$SIZES" 5 "$SAMPLES" 20
    wait_quiet; echo "### round $r  MPI shm n=$n (not TCP)"
    bounded "$OUT/mpi_shm_n${n}_r$r.txt" bash "$anchors/run_mpi.sh" "$n" shm "$SIZES" 5 "$SAMPLES" 20
  done
done
echo "load at end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/machine.txt"
echo "### merged table ($OUT)"
python3 "$anchors/summarize.py" "$OUT" | tee "$OUT/summary.md"
echo "### bars"
python3 "$here/bars.py" "$OUT" | tee "$OUT/bars.md"
