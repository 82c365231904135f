#!/usr/bin/env bash
# check-release.sh DIR [HELM] — verifies a release directory of scripts/release.sh complete and
# consistent; prints one line per check, and fails on the first problem, naming the file:
#   - every expected file is there (chart package, install.yaml, CRD, the operator, worker and
#     probe OCI archives, the wheel, the plugin tarball, the krew manifest, LICENSE, notices),
#     and DIR's name is the chart's appVersion;
#   - SHA256SUMS lists exactly the other files, and each sum matches;
#   - the krew manifest: version vVERSION, each platform's uri names a tarball here whose sha256
#     it gives, and the tarball holds the `bin` and every `files` entry;
#   - each OCI archive is an OCI layout naming ghcr.io/diphoma/diphoma-NAME:VERSION;
#   - the wheel is diphoma VERSION with its native module;
#   - the chart: its appVersion is VERSION, it lints and renders with a parent chart's `global`
#     set (helm/helm#10392), and the CRD it installs is the release's CRD file;
#   - install.yaml holds the same CRD.
# HELM defaults to the pinned helm of e2e/cluster/build-bins.sh. Run by the container-mode e2e
# test on the debug release it installs from (e2e/tests/containers.rs), so by `make test`.
set -euo pipefail
dir=${1:?usage: $0 DIR [HELM]}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
helm=${2:-$(bash "$ROOT/e2e/cluster/build-bins.sh" 2>/dev/null)/helm}
[[ -d $dir ]] || { echo "check-release.sh: $dir is not a directory" >&2; exit 1; }
dir=$(cd "$dir" && pwd)
version=$(basename "$dir")
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fail() { echo "check-release.sh: $dir: $*" >&2; exit 1; }
ok() { echo "ok: $*"; }

# Completeness.
charts=("$dir"/diphoma-operator-*.tgz); wheels=("$dir"/diphoma-"$version"-*.whl)
[[ ${#charts[@]} == 1 && -f ${charts[0]} ]] || fail "expected one chart package diphoma-operator-*.tgz"
[[ ${#wheels[@]} == 1 && -f ${wheels[0]} ]] || fail "expected one wheel diphoma-$version-*.whl"
chart=${charts[0]} wheel=${wheels[0]}
for f in install.yaml diphomajob-crd.yaml LICENSE THIRD_PARTY_NOTICES.md diphoma.yaml SHA256SUMS \
  kubectl-diphoma-linux-amd64.tar.gz images/diphoma-{operator,worker,probe}-"$version".oci.tar; do
  [[ -s $dir/$f ]] || fail "$f is missing or empty"
done
ok "complete (version $version)"

# SHA256SUMS: exactly the other files, each sum right.
listed=$(awk '{print $2}' "$dir/SHA256SUMS" | sed 's|^\*||; s|^\./||' | LC_ALL=C sort)
present=$(cd "$dir" && find . -type f ! -name SHA256SUMS -printf '%P\n' | LC_ALL=C sort)
[[ $listed == "$present" ]] || fail "SHA256SUMS does not list exactly the files: $(diff <(echo "$listed") <(echo "$present") | grep '^[<>]' | tr '\n' ' ')"
(cd "$dir" && sha256sum --quiet --strict -c SHA256SUMS >&2) || fail "SHA256SUMS: a sum does not match (above)"
ok "SHA256SUMS ($(wc -l < "$dir/SHA256SUMS") files)"

# The krew manifest against the tarballs.
python3 - "$dir" "$version" "$work" <<'PY' || fail "diphoma.yaml (krew manifest): see above"
import hashlib, os, sys, tarfile, yaml
d, version, work = sys.argv[1:]
m = yaml.safe_load(open(os.path.join(d, "diphoma.yaml")))
def die(msg): sys.exit(f"diphoma.yaml: {msg}")
if m.get("kind") != "Plugin" or m.get("apiVersion") != "krew.googlecontainertools.github.com/v1alpha2":
    die("not a krew Plugin (apiVersion krew.googlecontainertools.github.com/v1alpha2)")
if m["spec"].get("version") != "v" + version:
    die(f"spec.version {m['spec'].get('version')!r}, expected v{version}")
platforms = m["spec"].get("platforms") or die("spec.platforms is empty")
for p in platforms:
    sel = p["selector"]["matchLabels"]
    name = p["uri"].rsplit("/", 1)[-1]
    path = os.path.join(d, name)
    if not os.path.isfile(path):
        die(f"platform {sel}: uri {p['uri']} names {name}, which is not in the release")
    sha = hashlib.sha256(open(path, "rb").read()).hexdigest()
    if p.get("sha256") != sha:
        die(f"platform {sel}: sha256 {p.get('sha256')}, but {name} has {sha}")
    with tarfile.open(path) as t:
        names = set(t.getnames())
    for f in [p["bin"]] + [f["from"] for f in p.get("files", [])]:
        if f not in names:
            die(f"platform {sel}: {name} lacks {f} (has {sorted(names)})")
print(f"ok: krew manifest v{version}: {len(platforms)} platform(s), uri and sha256 match")
PY

# The images: OCI layouts, each named as the chart and the examples expect.
for i in operator worker probe pytorch; do
  f=$dir/images/diphoma-$i-$version.oci.tar
  [[ -f $f ]] || continue
  tar -xf "$f" -C "$work" index.json oci-layout 2>/dev/null || fail "images/${f##*/} is not an OCI archive (no index.json, oci-layout)"
  ref=$(python3 -c 'import json,sys; print(" ".join(m.get("annotations",{}).get("org.opencontainers.image.ref.name","") for m in json.load(open(sys.argv[1]))["manifests"]))' "$work/index.json")
  [[ $ref == "ghcr.io/diphoma/diphoma-$i:$version" ]] || fail "images/${f##*/} names ${ref:-nothing}, expected ghcr.io/diphoma/diphoma-$i:$version"
  rm -f "$work/index.json" "$work/oci-layout"
done
ok "images: OCI archives named ghcr.io/diphoma/diphoma-*:$version"

# The wheel.
python3 - "$wheel" "$version" <<'PY' || fail "${wheel##*/}: see above"
import sys, zipfile
path, version = sys.argv[1:]
names = zipfile.ZipFile(path).namelist()
meta = next((n for n in names if n.endswith(".dist-info/METADATA")), None) or sys.exit("no METADATA")
text = zipfile.ZipFile(path).read(meta).decode()
if f"\nVersion: {version}\n" not in text or "\nName: diphoma\n" not in text:
    sys.exit(f"{path}: METADATA is not diphoma {version}")
if not any(n.startswith("diphoma/_native") for n in names):
    sys.exit(f"{path}: no native module diphoma/_native*")
PY
ok "wheel ${wheel##*/}"

# The chart: its version, as a dependency (global set), and its CRD.
app=$("$helm" show chart "$chart" | sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p')
[[ $app == "$version" ]] || fail "${chart##*/}: appVersion $app, but the release is $version"
"$helm" lint --strict "$chart" --set global.x=1 --set global.imageRegistry=r.example >/dev/null ||
  fail "${chart##*/}: helm lint with global set failed"
"$helm" template diphoma-operator "$chart" --kube-version 1.30.0 --set global.x=1 > "$work/rendered.yaml" ||
  fail "${chart##*/}: helm template with global set failed"
python3 - "$work/rendered.yaml" "$dir/diphomajob-crd.yaml" "$dir/install.yaml" <<'PY' || fail "the CRD: see above"
import sys, yaml
rendered, crd_file, install = sys.argv[1:]
def crds(path):
    return [d for d in yaml.safe_load_all(open(path)) if d and d.get("kind") == "CustomResourceDefinition"]
def body(d):
    d = dict(d); d.pop("metadata"); return d
want = crds(crd_file)
if len(want) != 1:
    sys.exit(f"{crd_file}: expected one CRD, found {len(want)}")
for path in (rendered, install):
    got = crds(path)
    if len(got) != 1 or body(got[0]) != body(want[0]):
        sys.exit(f"{path}: its CRD is not diphomajob-crd.yaml's")
    if got[0]["metadata"].get("annotations", {}).get("helm.sh/resource-policy") != "keep":
        sys.exit(f"{path}: the CRD lacks helm.sh/resource-policy: keep")
PY
ok "chart ${chart##*/}: appVersion $version, lints and renders with global set, its CRD is the release's"
