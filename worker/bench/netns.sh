#!/usr/bin/env bash
# worker/bench/netns.sh — network profiles for the benchmarks (issue 30): a network namespace of
# the run's own, its loopback shaped per rank address with tc htb, so that a ring on this one
# machine sees a link of a cluster's rate. Everything stays in 127.0.0.0/8 inside the namespace;
# the host's network is never touched and nothing else is ever a target.
#
#   netns.sh PROFILE CMD...   run CMD in a new namespace shaped as PROFILE (by hand)
#   source netns.sh           the functions below (worker/bench/run.sh, python/bench/run.sh):
#     netns_enter "$0" ARGS…  re-runs the calling script inside a new namespace (unshare -n);
#                             the namespace goes away with its last process
#     netns_cleanup           kills every process still in the namespace (the caller's EXIT
#                             trap, so that nothing keeps it alive, also on failure)
#     netns_setup N           lo up, rank r's address 127.0.0.(r+2)/32 on lo, labelled lo:rR
#                             (gloo's GLOO_SOCKET_IFNAME=lo:rR picks it), and on a bridge mpiR
#                             without ports (Open MPI's btl_tcp_if_include=mpiR)
#     netns_shape PROFILE     sets every class to the profile's rate (loopback: no qdisc at all)
#     netns_probe FILE        one TCP stream over each ring link (iperf3, 2 s), Gbit/s into FILE
#
# Profiles (Gbit/s that each rank can receive; a ring's link into rank r): loopback (unshaped),
# 10g, 2.5g, 1g. Shaping is by destination address (a u32 filter on `ip dst 127.0.0.N/32` per
# class), so each rank must listen on its own address and connect from it: the Rust bench binds
# the address given by --hosts, gloo is given its device by GLOO_SOCKET_IFNAME=lo:rR and the ranks
# of `python -m diphoma.run` their ring addresses in DIPHOMA_RING_ADDRESSES (both set per rank by
# netns/sitecustomize.py), Open MPI by btl_tcp_if_include=mpiR (netns/mpi_rank.sh); the LD_PRELOAD
# shim netns/srcbind.c binds each outgoing loopback connection to its process's own address, so
# that the bytes a peer sends back on it are shaped as this rank's link too. This kernel has htb
# and tbf but no netem: rate only, no added delay.
#
# Exported inside: NETNS_PROFILE, NETNS_RATE_GBIT (empty: unshaped), NETNS_ADDRS (rank
# addresses), LD_PRELOAD (the shim), PYTHONPATH (+ netns/), NETNS_RANKS.
NETNS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/netns"
NETNS_RANKS="${NETNS_RANKS:-4}"
NETNS_CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/diphoma/bench"

netns_rate() {  # PROFILE -> Gbit/s, empty for loopback; exit 2 on an unknown profile
  case "$1" in
    loopback) echo "" ;; 10g) echo 10 ;; 2.5g) echo 2.5 ;; 1g) echo 1 ;;
    *) echo "netns: unknown profile '$1' (loopback, 10g, 2.5g, 1g)" >&2; return 2 ;;
  esac
}

netns_enter() {  # SCRIPT ARGS...: exec SCRIPT inside a new network namespace (unless inside one)
  if [[ -n "${NETNS_INSIDE:-}" ]]; then return 0; fi
  [[ $(id -u) == 0 ]] || { echo "netns: network profiles need root (unshare -n, tc)" >&2; exit 2; }
  command -v iperf3 >/dev/null || { apt-get install -y iperf3 || { apt-get update && apt-get install -y iperf3; }; } >&2
  mkdir -p "$NETNS_CACHE/bin"
  cc -O2 -shared -fPIC -o "$NETNS_CACHE/bin/srcbind.so" "$NETNS_DIR/srcbind.c" -ldl
  NETNS_INSIDE=1 exec unshare --net --fork --kill-child -- bash "$@"
}

netns_cleanup() {  # kill every process of this namespace but this shell (they are all ours)
  local me ns p
  me=$$; ns=$(readlink /proc/$$/ns/net)
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    [[ $p == "$me" || $p == "$BASHPID" || $p == "$PPID" ]] && continue  # PPID: unshare
    [[ $(readlink "/proc/$p/ns/net" 2>/dev/null) == "$ns" ]] && kill -KILL "$p" 2>/dev/null
  done
  return 0
}

netns_setup() {  # N: addresses and (empty) htb classes for N ranks
  local n=${1:-$NETNS_RANKS} r a
  [[ -n "${NETNS_INSIDE:-}" ]] || { echo "netns_setup: not inside netns_enter" >&2; return 2; }
  ip link set lo up
  NETNS_ADDRS=""
  for ((r = 0; r < n; r++)); do
    a=127.0.0.$((r + 2))
    ip addr add "$a/32" dev lo label "lo:r$r"
    # The same address on an empty bridge mpiR, for Open MPI: it keys interfaces by kernel
    # index, so lo's labels collapse into one (peers then see an "unexpected" address). Local
    # delivery to the address still goes through lo and its shaping.
    ip link add "mpi$r" type bridge && ip link set "mpi$r" up && ip addr add "$a/32" dev "mpi$r"
    NETNS_ADDRS="$NETNS_ADDRS${NETNS_ADDRS:+ }$a"
  done
  export NETNS_ADDRS NETNS_RANKS=$n
  export LD_PRELOAD="$NETNS_CACHE/bin/srcbind.so${LD_PRELOAD:+:$LD_PRELOAD}"
  export PYTHONPATH="$NETNS_DIR${PYTHONPATH:+:$PYTHONPATH}"
}

netns_shape() {  # PROFILE: one htb class per rank address at the profile's rate
  local p=$1 rate r a
  rate=$(netns_rate "$p") || return 2
  tc qdisc del dev lo root 2>/dev/null || true
  export NETNS_PROFILE=$p NETNS_RATE_GBIT=$rate
  [[ -z $rate ]] && return 0
  # Unclassified traffic (the launchers' stores on 127.0.0.1) passes unshaped (htb's default 0).
  # Bursts of 1 ms at the rate (at least 256 KiB: loopback's GSO frames are up to 64 KiB).
  local burst; burst=$(python3 -c "print(max(262144, int($rate * 1e9 / 8 / 1000)))")
  tc qdisc add dev lo root handle 1: htb r2q 1000
  r=0
  for a in $NETNS_ADDRS; do
    tc class add dev lo parent 1: classid "1:$((r + 10))" htb rate "${rate}gbit" ceil "${rate}gbit" \
      burst "$burst" cburst "$burst" quantum 131072
    tc filter add dev lo parent 1: protocol ip prio 1 u32 match ip dst "$a/32" flowid "1:$((r + 10))"
    r=$((r + 1))
  done
}

netns_probe() {  # FILE: a single TCP stream into each rank address from its ring predecessor
  local out=$1 addrs r n src dst port=5299 bps pid
  read -r -a addrs <<<"$NETNS_ADDRS"; n=${#addrs[@]}
  : >"$out"
  for ((r = 0; r < n; r++)); do
    src=${addrs[(r + n - 1) % n]}; dst=${addrs[r]}
    iperf3 -s -1 -B "$dst" -p "$port" >/dev/null 2>&1 & pid=$!
    sleep 0.3
    bps=$(iperf3 -c "$dst" -B "$src" -p "$port" -t 2 -O 0.5 -J 2>/dev/null |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"])' 2>/dev/null || echo 0)
    kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
    python3 -c "import sys; print(f'link {sys.argv[1]} -> {sys.argv[2]}: {float(sys.argv[3])/1e9:.3f} Gbit/s')" \
      "$src" "$dst" "$bps" | tee -a "$out"
  done
}

# CLI: netns.sh PROFILE CMD...
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -euo pipefail
  [[ $# -ge 2 ]] || { echo "usage: $0 PROFILE CMD..." >&2; exit 2; }
  netns_rate "$1" >/dev/null
  netns_enter "$0" "$@"
  profile=$1; shift
  trap 'netns_cleanup' EXIT
  netns_setup "$NETNS_RANKS"
  netns_shape "$profile"
  echo "# profile $profile (${NETNS_RATE_GBIT:-unshaped} Gbit/s per rank address), single TCP stream per link:" >&2
  netns_probe "$(mktemp)" >&2
  "$@"
fi
