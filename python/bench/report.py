"""Writes ``make bench-torch``'s RESULTS.md from the rows of bench_torch.py (JSON lines) and
the tables of ``diphoma-worker bench`` (see run.sh). Ratios are the median over rounds of the
per-round ratio, with its min–max; times are medians over rounds of each run's median.

Each part (the DDP step; all_reduce with the Rust bench's tables) states its own run: a part
with no rows in this run keeps its sections from the existing OUT unchanged.

Usage: ``report.py ROWS RUST OUT LOAD_BEFORE LOAD_AFTER PARAMS``; the tables of overhead.py,
when that part ran, in the file named by the environment variable ``OVERHEAD``.
"""

import datetime
import json
import os
import platform
import re
import statistics
import sys
from collections import defaultdict

rows_path, rust_path, out_path, load_before, load_after, params = sys.argv[1:7]
rows = [json.loads(line) for line in open(rows_path)]
layout_rows = [r for r in rows if "layout" in r]  # PARTS=layout: a table of their own
rows = [r for r in rows if "layout" not in r]
NAMES = {("gloo", "-"): "gloo", ("diphoma", "integrity"): "diphoma", ("diphoma", "none"): "diphoma none"}


def name(r):
    return NAMES[(r["backend"], r["protection"])]


def spread(xs):
    """``median (min–max)`` of the per-round values ``xs``."""
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})" if xs else "–"


def ratios(by_round, a, b):
    """Per-round ratios b / a over the rounds that have both."""
    return [v[b] / v[a] for v in by_round.values() if a in v and b in v]


RUN = (f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.node()} "
       f"({os.cpu_count()} CPUs), `make bench-torch` with {params}; load average before "
       f"{load_before}, after {load_after}.")
# The part each section belongs to, by the start of its title.
PARTS = {"## DDP step": "ddp", "## all_reduce (": "allreduce", "## The Rust bench": "allreduce",
         "## all_reduce beyond the ring": "overhead", "## Layouts": "layout"}


def previous(path):
    """The sections of an existing OUT, by part: {part: [lines]} (titles included)."""
    kept, part, fenced = defaultdict(list), None, False
    if os.path.exists(path):
        for line in open(path).read().splitlines():
            fenced ^= line.startswith("```")
            if line.startswith("## ") and not fenced:
                part = next((v for k, v in PARTS.items() if line.startswith(k)), None)
            if part:
                kept[part].append(line)
    return kept


kept = previous(out_path)
out = ["# make bench-torch", "",
       "`diphoma` is the ring with per-frame integrity (a keyed BLAKE3 tag per frame, the default "
       "until issue 30); `diphoma none` is the same ring without it, as gloo runs, and the default "
       "since. Ratios: median over rounds "
       "of each round's ratio (min–max). Each part states the run it comes from.", ""]
ddp_out = ["## DDP step on CPU (torchvision, synthetic 32×32, batch 2 per rank)", "", RUN, "",
           "| model | world | gloo step (ms) | comm share | diphoma step (ms) | comm share | diphoma none step (ms) | comm share | diphoma / gloo | diphoma none / gloo |",
           "|---|---|---|---|---|---|---|---|---|---|"]
ddp = defaultdict(lambda: defaultdict(dict))  # (model, world) -> round -> name -> row
for r in rows:
    if r["kind"] == "ddp":
        ddp[(r["model"], r["world"])][r["round"]][name(r)] = r
for (m, w), by_round in sorted(ddp.items()):
    cells = []
    for n in ("gloo", "diphoma", "diphoma none"):
        rs = [v[n] for v in by_round.values() if n in v]
        cells += [f"{statistics.median(x['step_s'] for x in rs) * 1e3:.0f}" if rs else "–",
                  f"{statistics.median(x['comm_share'] for x in rs):.0%}" if rs else "–"]
    steps = {k: {n: x["step_s"] for n, x in v.items()} for k, v in by_round.items()}
    ddp_out.append(f"| {m} | {w} | {' | '.join(cells)} | {spread(ratios(steps, 'gloo', 'diphoma'))} | "
                   f"{spread(ratios(steps, 'gloo', 'diphoma none'))} |")
ddp_out += ["", "### Where the DDP step goes", "",
            "Per backend, medians over rounds (ms): `no_sync` (compute only); DDP with a comm hook that "
            "communicates nothing (compute plus DDP's own bucketing, copies and hooks); the backend's "
            "`all_reduce` of DDP's bucket sizes one after another, outside backward; their floor (the "
            "step with no overlap and no cost beyond the all_reduce calls); the step; step − floor "
            "(below 0: communication overlapped with backward). The bar is 0.85× gloo's step.", "",
            "| model | world | backend | no_sync | DDP, no comm | buckets' all_reduce | floor | step | step − floor | 0.85× gloo step |",
            "|---|---|---|---|---|---|---|---|---|---|"]
for (m, w), by_round in sorted(ddp.items()):
    gloo = [v["gloo"]["step_s"] for v in by_round.values() if "gloo" in v]
    for n in ("gloo", "diphoma", "diphoma none"):
        rs = [v[n] for v in by_round.values() if n in v]
        if rs:
            med = {k: statistics.median(x[k] for x in rs) * 1e3 for k in ("compute_s", "no_comm_s", "buckets_s", "step_s")}
            floor = med["no_comm_s"] + med["buckets_s"]
            bar = f"{0.85 * statistics.median(gloo) * 1e3:.0f}" if gloo else "–"
            ddp_out.append(f"| {m} | {w} | {n} | {med['compute_s']:.0f} | {med['no_comm_s']:.0f} | {med['buckets_s']:.0f} | "
                           f"{floor:.0f} | {med['step_s']:.0f} | {med['step_s'] - floor:+.0f} | {bar} |")
out += (ddp_out + [""]) if ddp else kept["ddp"]

# The Rust bench: "## round R world W protection P" then nccl-tests rows (size count k time ...).
rust = defaultdict(dict)  # (world, bytes) -> round -> "rust integrity"/"rust none" -> seconds
key = None
for line in open(rust_path):
    if m := re.match(r"## round (\d+) world (\d+) protection (\w+)", line):
        key = (int(m[1]), int(m[2]), m[3])
    elif key and (f := line.split()) and f[0].isdigit():
        rust[(key[1], int(f[0]))].setdefault(key[0], {})[f"rust {key[2]}"] = float(f[3]) * 1e-6
ar = defaultdict(dict)
for r in rows:
    if r["kind"] == "allreduce":
        ar[(r["world"], r["bytes"])].setdefault(r["round"], {})[name(r)] = r["median_s"]
ar_out = ["## all_reduce (float32, sum, in place): from Python and the Rust bench, µs", "", RUN, "",
          "Timed alike (performance.md §1): k back-to-back operations per sample (≈20 ms), 20 samples, "
          "each the slowest rank's mean, median. Overhead: Python diphoma / Rust at the same protection.", "",
          "| world | bytes | gloo | diphoma | diphoma none | Rust integrity | Rust none | diphoma / gloo | diphoma none / gloo | overhead integrity | overhead none |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
for (w, b) in sorted(set(ar) | set(rust)):
    by_round = defaultdict(dict)
    for src in (ar.get((w, b), {}), rust.get((w, b), {})):
        for k, v in src.items():
            by_round[k].update(v)
    med = [statistics.median(v[n] for v in by_round.values() if n in v) * 1e6
           if any(n in v for v in by_round.values()) else float("nan")
           for n in ("gloo", "diphoma", "diphoma none", "rust integrity", "rust none")]
    ar_out.append(f"| {w} | {b} | " + " | ".join(f"{x:.0f}" for x in med) + " | "
                  + " | ".join(spread(ratios(by_round, a, c)) for a, c in
                               (("gloo", "diphoma"), ("gloo", "diphoma none"),
                                ("rust integrity", "diphoma"), ("rust none", "diphoma none"))) + " |")
ar_out += ["", "## The Rust bench's own tables", "", "```", open(rust_path).read().rstrip(), "```", ""]
out += ar_out if ar else kept["allreduce"]
tables = open(os.environ["OVERHEAD"]).read().strip() if os.environ.get("OVERHEAD") else ""
out += (["", "## all_reduce beyond the ring (python/bench/overhead.py)", "", RUN, "",
         "One process per rank runs each layer interleaved: the native ring call (the floor), the "
         "process group with `asyncOp` false, `dist.all_reduce` (synchronous: on the caller's thread), "
         "and `dist.all_reduce(async_op=True).wait()` (the group's thread). \"Outside the ring\": the "
         "time per operation not spent in the native call.", "", tables, ""]
        if tables else kept["overhead"])
LAYOUTS = ("gloo", "4x1", "2x2", "2x2 flat")
by_cell = defaultdict(lambda: defaultdict(dict))  # (what) -> round -> layout -> seconds
for r in layout_rows:
    what = f"DDP step {r['model']}" if r["kind"] == "ddp" else f"all_reduce {r['bytes']} B"
    by_cell[(r["kind"] != "ddp", r.get("model", ""), r.get("bytes", 0), what)][r["round"]][r["layout"]] = (
        r["step_s"] if r["kind"] == "ddp" else r["median_s"])
layout_out = ["## Layouts at world 4: 2 pods × 2 processes against 4 × 1 (ms)", "", RUN, "",
              "`2x2`: `python -m diphoma.run --pods 2 --nproc-per-node 2` (two local pods; the all-reduce "
              "hierarchical at every size (`DIPHOMA_HIERARCHICAL_MIN_BYTES=0`; by default below 1 MiB goes flat): "
              "in-pod reduce-scatter, cross-pod all-reduce per local rank, in-pod all-gather); "
              "`2x2 flat`: the same with `DIPHOMA_HIERARCHICAL=0`; `4x1`: four processes of one ring; `gloo`: "
              "gloo at world 4. No protection. On one machine every layout crosses the same loopback: this "
              "shows what the two levels cost, not what they save between nodes.", "",
              "| what | " + " | ".join(LAYOUTS) + " | 2x2 / 4x1 | 2x2 / gloo |", "|---|" + "---|" * (len(LAYOUTS) + 2)]
for key, by_round in sorted(by_cell.items()):
    med = [statistics.median(v[n] for v in by_round.values() if n in v) * 1e3
           if any(n in v for v in by_round.values()) else float("nan") for n in LAYOUTS]
    layout_out.append(f"| {key[3]} | " + " | ".join(f"{x:.2f}" for x in med) + " | "
                      + " | ".join(spread(ratios(by_round, a, "2x2")) for a in ("4x1", "gloo")) + " |")
out += (layout_out + [""]) if layout_rows else kept["layout"]
open(out_path, "w").write("\n".join(out))
print("\n".join(out))
