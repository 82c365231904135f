#!/usr/bin/env bash
# fetch-prometheus.sh — unpacks Debian's `prometheus` package (its binaries only: no service is
# installed or started) into the tools cache and prints the path of the prometheus binary;
# promtool lies beside it. The e2e dashboard test starts prometheus on 127.0.0.1 itself; the chart
# test runs `promtool test rules`. Reuses what is there.
set -euo pipefail
ROOT=${DIPHOMA_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/diphoma/k8s-tools}
OUT="$ROOT/prometheus"
if [[ ! -x "$OUT/usr/bin/prometheus" || ! -x "$OUT/usr/bin/promtool" ]]; then
  command -v apt-get >/dev/null && command -v dpkg >/dev/null ||
    { echo "fetch-prometheus: needs apt-get and dpkg (Debian) to fetch the prometheus package" >&2; exit 1; }
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  chmod 755 "$tmp"   # apt's _apt user downloads into it when it can
  if ! (cd "$tmp" && apt-get download prometheus >/dev/null 2>&1); then
    sudo=""; [[ $(id -u) == 0 ]] || sudo=sudo
    $sudo apt-get update -qq
    (cd "$tmp" && apt-get download prometheus >/dev/null)
  fi
  rm -rf "$OUT.part" "$OUT" && dpkg -x "$tmp"/prometheus_*.deb "$OUT.part" && mv "$OUT.part" "$OUT"
fi
"$OUT/usr/bin/prometheus" --version 2>&1 | sed -n 1p >&2
echo "$OUT/usr/bin/prometheus"
