#!/usr/bin/env bash
# python/bench/run.sh — `make bench-torch`: in one run on this machine, DDP step time on CPU
# with backend gloo against diphoma (torchvision ResNet-18 and ResNet-50, synthetic 32×32
# images, batch 2 per rank, world 2 and 4: step time, communication share, ratio), and
# torch.distributed.all_reduce latency from Python (1 KiB–64 MiB) against the Rust
# `diphoma-worker bench` (the binding's overhead). Writes python/bench/RESULTS.md.
#
# Setup (idempotent): the cached torch venv with torchvision (python/venv.sh test), the wheel
# built --release and installed into it, `cargo build --release -p diphoma-worker`.
# Env: STEPS (10) WORLDS ("2 4") OUT (python/bench/RESULTS.md).
#
# Horovod is not compared: `pip install horovod` (0.28.1, the newest release, an sdist of 2023)
# in a throwaway venv with HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1
# failed on this machine (2026-12-01): its CMake configure stops at "No module named 'torch'"
# inside pip's isolated build environment ("Failed building wheel for horovod"). Not retried
# with --no-build-isolation against torch 2.15.
set -euo pipefail
repo="$(git rev-parse --show-toplevel)"
cd "$repo"
STEPS="${STEPS:-10}"; WORLDS="${WORLDS:-2 4}"; OUT="${OUT:-$repo/python/bench/RESULTS.md}"
venv=$(bash python/venv.sh test)
target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
"$venv/bin/maturin" build --quiet --release -m python/Cargo.toml -o "$target/wheels-bench" >&2
"$venv/bin/pip" install --quiet --disable-pip-version-check --force-reinstall --no-deps "$target"/wheels-bench/diphoma-*.whl
cargo build --release -p diphoma-worker
rows=$(mktemp); rust=$(mktemp)
trap 'rm -f "$rows" "$rust"' EXIT
launch() { PYTHONWARNINGS=ignore "$venv/bin/python" -m diphoma.run --nproc "$1" python/bench/bench_torch.py "${@:2}"; }
for w in $WORLDS; do
  for model in resnet18 resnet50; do
    for backend in gloo diphoma; do launch "$w" ddp "$backend" "$model" "$STEPS" "$rows"; done
  done
  for backend in gloo diphoma; do launch "$w" allreduce "$backend" "$rows"; done
  echo "## world $w" >>"$rust"
  "$target/release/diphoma-worker" bench --world "$w" --sizes 1K,4K,16K,64K,256K,1M,4M,16M,64M >>"$rust"
done
"$venv/bin/python" - "$rows" "$rust" "$OUT" <<'PY'
import json, sys, platform, datetime
rows = [json.loads(l) for l in open(sys.argv[1])]
out = ["# make bench-torch", "", f"Run {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC on {platform.node()} "
       f"({__import__('os').cpu_count()} CPUs), one run; medians.", "",
       "## DDP step on CPU (synthetic 32×32, batch 2 per rank)", "",
       "| model | world | gloo step (ms) | gloo comm share | diphoma step (ms) | diphoma comm share | diphoma / gloo |",
       "|---|---|---|---|---|---|---|"]
ddp = {(r["model"], r["world"], r["backend"]): r for r in rows if r["kind"] == "ddp"}
for (m, w) in sorted({(m, w) for m, w, _ in ddp}):
    g, d = ddp.get((m, w, "gloo")), ddp.get((m, w, "diphoma"))
    if g and d:
        out.append(f"| {m} | {w} | {g['step_s']*1e3:.1f} | {g['comm_share']:.0%} | {d['step_s']*1e3:.1f} | "
                   f"{d['comm_share']:.0%} | {d['step_s']/g['step_s']:.2f} |")
out += ["", "## torch.distributed.all_reduce from Python (float32, µs)", "",
        "| world | bytes | gloo | diphoma |", "|---|---|---|---|"]
ar = {(r["world"], r["bytes"], r["backend"]): r["median_s"] for r in rows if r["kind"] == "allreduce"}
for (w, b) in sorted({(w, b) for w, b, _ in ar}):
    out.append(f"| {w} | {b} | {ar.get((w, b, 'gloo'), float('nan'))*1e6:.0f} | {ar.get((w, b, 'diphoma'), float('nan'))*1e6:.0f} |")
out += ["", "## The Rust `diphoma-worker bench` in the same run", "", "```", open(sys.argv[2]).read().rstrip(), "```", ""]
open(sys.argv[3], "w").write("\n".join(out))
print("\n".join(out))
PY
