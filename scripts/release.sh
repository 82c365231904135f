#!/usr/bin/env bash
# release.sh [--profile release|debug] [--pytorch] [--out ROOT] — builds a release into one
# directory, ROOT/VERSION (default ROOT: target/release-dir; VERSION: the chart's appVersion),
# and prints that directory. Nothing is pushed; everything a release consists of is a file:
#   diphoma-operator-CHART.tgz       the chart (`helm package`)
#   install.yaml                     manifests/install.yaml (the chart rendered, without helm)
#   diphomajob-crd.yaml              the CRD (crds/diphomajob.yaml)
#   images/diphoma-NAME-VERSION.oci.tar   operator, worker, probe (and pytorch with --pytorch:
#                                    several GB, so only on request) as OCI archives, each named
#                                    ghcr.io/diphoma/diphoma-NAME:VERSION inside
#   diphoma-VERSION-*.whl            the Python wheel
#   kubectl-diphoma-linux-amd64.tar.gz    the plugin binary and LICENSE
#   diphoma.yaml                     the krew manifest: its uri and sha256 are those of the tarball
#   LICENSE, THIRD_PARTY_NOTICES.md  ours, and the third-party licenses of what the binaries ship
#   SHA256SUMS                       over every other file
# --profile debug builds the debug binaries (fast; what the tests install); release is what a
# release ships. RELEASE_URL (default https://github.com/diphoma/diphoma/releases/download/
# vVERSION) is where the krew manifest says the tarball is downloaded from.
# scripts/check-release.sh DIR verifies the result. A failed build removes its partial directory.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
profile=release pytorch=0 out=$ROOT/target/release-dir
while (($#)); do
  case $1 in
    --profile) profile=${2:?--profile needs release or debug}; shift 2 ;;
    --pytorch) pytorch=1; shift ;;
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    *) echo "usage: $0 [--profile release|debug] [--pytorch] [--out ROOT]" >&2; exit 2 ;;
  esac
done
[[ $profile == release || $profile == debug ]] || { echo "release.sh: --profile is release or debug, not $profile" >&2; exit 2; }
# shellcheck source=images/env.sh
source "$ROOT/images/env.sh"
cd "$ROOT"
version=$(diphoma_image_version)
chart_version=$(sed -n 's/^version: *//p' charts/diphoma-operator/Chart.yaml)
[[ -n $version && -n $chart_version ]] || { echo "release.sh: Chart.yaml lacks version or appVersion" >&2; exit 1; }
helm=$(bash e2e/cluster/build-bins.sh 2>/dev/null)/helm
dir=$out/$version
url=${RELEASE_URL:-https://github.com/diphoma/diphoma/releases/download/v$version}
target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
log() { printf 'release.sh: %s\n' "$*" >&2; }

rm -rf "$dir"; mkdir -p "$dir/images"
work=$(mktemp -d)
finished=0
cleanup() { rm -rf "$work"; ((finished)) || rm -rf "$dir"; }
trap cleanup EXIT

flag=(); [[ $profile == release ]] && flag=(--release)
log "building the binaries ($profile)"
cargo build "${flag[@]}" --locked -p diphoma-operator -p diphoma-worker -p diphoma-e2e -p kubectl-diphoma \
  --bin diphoma-operator --bin diphoma-worker --bin diphoma-probe --bin kubectl-diphoma >&2

log "chart, install.yaml, CRD"
"$helm" package charts/diphoma-operator -d "$dir" >/dev/null
cp manifests/install.yaml "$dir/install.yaml"
cp crds/diphomajob.yaml "$dir/diphomajob-crd.yaml"
cp LICENSE "$dir/LICENSE"

log "images (images/build.sh $profile), as OCI archives"
bash images/build.sh "$profile" >&2
images=(operator worker probe)
if ((pytorch)); then
  mkdir -p "$target/wheels"
  "$(bash python/venv.sh build)/bin/maturin" build --quiet --release --strip --locked -m python/Cargo.toml -o "$target/wheels" >&2
  bash images/build-pytorch.sh >&2
  images+=(pytorch)
fi
for i in "${images[@]}"; do
  buildah push --quiet "localhost/diphoma-$i:$version" \
    "oci-archive:$dir/images/diphoma-$i-$version.oci.tar:$DIPHOMA_REGISTRY/diphoma-$i:$version" >/dev/null
done

log "wheel"
mprofile=(--profile dev); [[ $profile == release ]] && mprofile=(--release --strip)
"$(bash python/venv.sh build)/bin/maturin" build --quiet "${mprofile[@]}" --locked -m python/Cargo.toml -o "$work/wheels" >&2
cp "$work"/wheels/diphoma-*.whl "$dir/"

log "kubectl-diphoma tarball and krew manifest"
mkdir -p "$work/plugin"
cp "$target/$profile/kubectl-diphoma" LICENSE "$work/plugin/"
[[ $profile == release ]] && strip "$work/plugin/kubectl-diphoma"
tarball=kubectl-diphoma-linux-amd64.tar.gz
# Reproducible: fixed order, owner and times, no gzip timestamp.
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$work/plugin" -cf - kubectl-diphoma LICENSE |
  gzip -n > "$dir/$tarball"
python3 - "$ROOT/plugins/diphoma.yaml" "$dir/diphoma.yaml" "$version" "$url/$tarball" \
  "$(sha256sum "$dir/$tarball" | cut -d' ' -f1)" <<'PY'
# The krew manifest of this release, from plugins/diphoma.yaml: this version, and only the
# platform built here (linux/amd64), its uri and sha256 those of the tarball.
import sys, yaml
src, dst, version, uri, sha = sys.argv[1:]
m = yaml.safe_load(open(src))
m["spec"]["version"] = "v" + version
linux = [p for p in m["spec"]["platforms"] if p["selector"]["matchLabels"] == {"os": "linux", "arch": "amd64"}]
if len(linux) != 1:
    sys.exit(f"{src}: expected one linux/amd64 platform, found {len(linux)}")
linux[0]["uri"], linux[0]["sha256"] = uri, sha
m["spec"]["platforms"] = linux
# Multi-line strings (the description) as literal blocks, as written in plugins/diphoma.yaml.
yaml.SafeDumper.add_representer(str, lambda d, v: d.represent_scalar(
    "tag:yaml.org,2002:str", v, style="|" if "\n" in v else None))
with open(dst, "w") as f:
    f.write("# The krew plugin manifest of this release (generated by scripts/release.sh).\n")
    yaml.safe_dump(m, f, sort_keys=False)
PY

log "third-party notices"
bash scripts/notices.sh > "$dir/THIRD_PARTY_NOTICES.md"

(cd "$dir" && find . -type f ! -name SHA256SUMS -printf '%P\n' | LC_ALL=C sort | xargs sha256sum > SHA256SUMS)
finished=1
echo "$dir"
