#!/usr/bin/env bash
# worker/bench/striping.sh — issue 30 item 3, "fill the link": in each network profile, can one
# TCP stream per ring neighbour fill every link of a ring at once, and would several streams per
# link (striping) fill them better? Bytes only (iperf3), no reduction: it separates what the
# stream can carry from what the ring's CPU work (copies, the reduction, frame protection) costs.
#
# Inside one network namespace shaped by netns.sh (root), for each PROFILE and world N: all N
# links of a ring (rank r-1's address -> rank r's) carry iperf3 streams at the same time, first
# one per link, then STREAMS per link (iperf3 -P); prints per link the received Gbit/s, their sum
# as a share of N x the profile's rate, and how busy the machine's CPUs were meanwhile.
#
#   bash worker/bench/striping.sh            PROFILES ("1g 2.5g 10g loopback") WORLDS ("2 4")
#                                            STREAMS (4) SECS (3: seconds per measurement)
# Prints a markdown table on stdout; nothing is kept, the namespace goes with the run.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/netns.sh"
PROFILES="${PROFILES:-1g 2.5g 10g loopback}"; WORLDS="${WORLDS:-2 4}"
STREAMS="${STREAMS:-4}"; SECS="${SECS:-3}"
for p in $PROFILES; do netns_rate "$p" >/dev/null; done
netns_enter "$0" "$@"
netns_setup "$(tr ' ' '\n' <<<"$WORLDS" | sort -n | tail -1)"
read -r -a addrs <<<"$NETNS_ADDRS"
tmp=$(mktemp -d)
trap 'netns_cleanup; rm -rf "$tmp"' EXIT

busy() { awk '/^cpu /{print $2+$3+$4+$7+$8, $5+$6}' /proc/stat; }  # busy and idle jiffies

ring() {  # N P: every link of an N-rank ring at once, P streams each; one table row
  local n=$1 par=$2 r src dst b0 b1
  for ((r = 0; r < n; r++)); do
    # bounded: a server whose client never came must not hold the run
    timeout $((SECS + 15)) iperf3 -s -1 -B "${addrs[r]}" -p $((5300 + r)) >/dev/null 2>&1 &
  done
  sleep 0.3
  b0=$(busy)
  for ((r = 0; r < n; r++)); do
    src=${addrs[(r + n - 1) % n]}; dst=${addrs[r]}
    timeout $((SECS + 15)) iperf3 -c "$dst" -B "$src" -p $((5300 + r)) -P "$par" -t "$SECS" -O 0.5 -J >"$tmp/$r.json" 2>/dev/null &
  done
  wait  # the clients, and the servers they ended
  b1=$(busy)
  python3 - "$tmp" "$n" "$par" "${NETNS_RATE_GBIT:-}" "$NETNS_PROFILE" "$b0" "$b1" <<'EOF'
import json, sys
tmp, n, par, rate, profile, b0, b1 = sys.argv[1:]
n, par = int(n), int(par)
got = []
for r in range(n):
    try:
        with open(f"{tmp}/{r}.json") as f:
            got.append(json.load(f)["end"]["sum_received"]["bits_per_second"] / 1e9)
    except (OSError, ValueError, KeyError):
        got.append(0.0)
(busy0, idle0), (busy1, idle1) = (map(int, b.split()) for b in (b0, b1))
cpu = (busy1 - busy0) / max(1, (busy1 - busy0) + (idle1 - idle0))
share = f"{sum(got) / (n * float(rate)):.0%}" if rate else "-"
print(f"| {profile} | {n} | {par} | {', '.join(f'{g:.2f}' for g in got)} | {sum(got):.2f} | {share} | {cpu:.0%} |")
EOF
}

echo "| profile | n | streams per link | per link (Gbit/s) | sum | sum / (n x rate) | CPU busy |"
echo "|---|---|---|---|---|---|---|"
for p in $PROFILES; do
  netns_shape "$p"
  for w in $WORLDS; do
    ring "$w" 1
    ring "$w" "$STREAMS"
  done
done
