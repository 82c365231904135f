#!/usr/bin/env bash
# check-integrations.sh — tests docs/integrations/ against the real parts here (`make test`):
#   - Argo CD's health check (argocd/diphoma.io/DiphomaJob/health.lua) is run by Debian's lua5.1
#     (Argo CD runs gopher-lua, Lua 5.1) on every input of health_test.yaml, each object first
#     checked against the CRD's schema (every field it sets exists there, phases in its enum):
#     the status and message must be the expected ones;
#   - kube-state-metrics' configuration (kube-state-metrics/diphomajob-metrics.yaml): each path
#     it reads exists in the CRD's schema (metadata: the standard fields), and its phase StateSet
#     lists exactly the CRD's phases.
# The CRD is crds/diphomajob.yaml (generated from the Rust types, fresh-checked).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
command -v lua5.1 >/dev/null || { echo "check-integrations.sh: lua5.1 missing (make deps installs Debian's lua5.1)" >&2; exit 1; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
python3 - "$ROOT" "$work" <<'PY'
import os, subprocess, sys, yaml
root, work = sys.argv[1:]
crd = yaml.safe_load(open(os.path.join(root, "crds/diphomajob.yaml")))
schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
METADATA = {"name", "namespace", "generation", "uid", "labels", "annotations", "resourceVersion", "creationTimestamp"}
failed = []

def child(s, key):
    """The schema of `key` under object schema `s` (None: not there)."""
    if key in s.get("properties", {}):
        return s["properties"][key]
    extra = s.get("additionalProperties")
    if isinstance(extra, dict):
        return extra
    if s.get("x-kubernetes-preserve-unknown-fields"):
        return {"x-kubernetes-preserve-unknown-fields": True}
    return None

def check_object(value, s, where):
    """Every field of `value` exists in schema `s`; enums respected."""
    if s.get("x-kubernetes-preserve-unknown-fields") and "properties" not in s:
        return
    if "enum" in s and value not in s["enum"]:
        failed.append(f"{where}: {value!r} is not one of {s['enum']}")
    if isinstance(value, dict):
        for k, v in value.items():
            c = child(s, k)
            if c is None:
                failed.append(f"{where}.{k}: not in the CRD's schema")
            else:
                check_object(v, c, f"{where}.{k}")
    elif isinstance(value, list) and "items" in s:
        for i, v in enumerate(value):
            check_object(v, s["items"], f"{where}[{i}]")

def lua(v):
    if isinstance(v, bool): return "true" if v else "false"
    if isinstance(v, (int, float)): return repr(v)
    if isinstance(v, str): return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, list): return "{" + ", ".join(lua(x) for x in v) + "}"
    if isinstance(v, dict): return "{" + ", ".join(f"[{lua(k)}] = {lua(x)}" for k, x in v.items()) + "}"
    if v is None: return "nil"
    raise TypeError(v)

# Argo CD's health check.
base = os.path.join(root, "docs/integrations/argocd/diphoma.io/DiphomaJob")
tests = yaml.safe_load(open(os.path.join(base, "health_test.yaml")))["tests"]
for t in tests:
    path = os.path.join(base, t["inputPath"])
    obj = yaml.safe_load(open(path))
    for part in ("spec", "status"):
        if part in obj:
            check_object(obj[part], schema["properties"][part], f"{t['inputPath']}: {part}")
    for k in obj.get("metadata", {}):
        if k not in METADATA:
            failed.append(f"{t['inputPath']}: metadata.{k}: not a standard field")
    runner = os.path.join(work, "run.lua")
    with open(runner, "w") as f:
        f.write(f"obj = {lua(obj)}\n"
                f"local hs = dofile({lua(os.path.join(base, 'health.lua'))})\n"
                "io.write(hs.status, '\\n', hs.message or '', '\\n')\n")
    out = subprocess.run(["lua5.1", runner], capture_output=True, text=True)
    if out.returncode != 0:
        failed.append(f"{t['inputPath']}: health.lua failed: {out.stderr.strip()}")
        continue
    status, message = (out.stdout.split("\n") + ["", ""])[:2]
    want = t["healthStatus"]
    if (status, message) != (want["status"], want.get("message", message)):
        failed.append(f"{t['inputPath']}: got {status}: {message!r}, expected {want['status']}: {want.get('message')!r}")
print(f"argocd health.lua: {len(tests)} cases", file=sys.stderr)

# kube-state-metrics.
ksm = yaml.safe_load(open(os.path.join(root, "docs/integrations/kube-state-metrics/diphomajob-metrics.yaml")))
n = 0
for r in ksm["spec"]["resources"]:
    gvk = r["groupVersionKind"]
    if (gvk["group"], gvk["version"], gvk["kind"]) != (crd["spec"]["group"], crd["spec"]["versions"][0]["name"], crd["spec"]["names"]["kind"]):
        failed.append(f"kube-state-metrics: groupVersionKind {gvk} is not the CRD's")
    paths = [("labelsFromPath." + k, p) for k, p in r.get("labelsFromPath", {}).items()]
    for m in r["metrics"]:
        each = m["each"]
        spec = each[{"Gauge": "gauge", "StateSet": "stateSet", "Info": "info"}[each["type"]]]
        paths.append((m["name"], spec["path"]))
        if each["type"] == "StateSet" and spec["path"] == ["status", "phase"]:
            enum = schema["properties"]["status"]["properties"]["phase"]["enum"]
            if spec["list"] != enum:
                failed.append(f"kube-state-metrics {m['name']}: list {spec['list']} is not the CRD's phases {enum}")
    for name, path in paths:
        n += 1
        if path[0] == "metadata":
            if len(path) != 2 or path[1] not in METADATA:
                failed.append(f"kube-state-metrics {name}: {path} is not a standard metadata field")
            continue
        s = schema
        for i, key in enumerate(path):
            s = child(s, key) if s is not None else None
            if s is None:
                failed.append(f"kube-state-metrics {name}: {'.'.join(path[:i + 1])} is not in the CRD's schema")
                break
        else:
            if s.get("type") not in ("integer", "number", "string"):
                failed.append(f"kube-state-metrics {name}: {'.'.join(path)} is a {s.get('type')}, not a value")
print(f"kube-state-metrics: {n} paths", file=sys.stderr)
if failed:
    sys.exit("check-integrations.sh:\n  " + "\n  ".join(failed))
PY
