"""Writes ``make bench-torch``'s RESULTS.md from the rows of bench_torch.py (JSON lines) and
the tables of ``diphoma-worker bench`` (see run.sh). Ratios are the median over rounds of the
per-round ratio, with its min–max; times are medians over rounds of each run's median.

Each part (the DDP step; all_reduce with the Rust bench's tables) states its own run: a part
with no rows in this run keeps its sections from the existing OUT unchanged.

Beside each DDP cell its physical floor: the larger of the step under a comm hook that
communicates nothing and the link time of the gradient bytes, 2·(n−1)/n · bytes / rate (a ring
all-reduce; bf16 half the bytes), at the profile's rate (shaped profiles), the measured single
stream's (loopback profile), none on plain loopback; then the bars of issue 30 (printed, never
asserted), and for the bf16 pair the training result's difference (max |Δparam| after the same
steps from the same seed, from the parameter files the rows name).

A run under network profiles (rows with ``profile``) writes one "Network profiles" section, a
subsection per profile with its rate and its measured single TCP stream per link (the files
``LINKS/PROFILE.txt`` of netns_probe, in the order of ``PROFILES``), and keeps every plain
loopback section of OUT.

Usage: ``report.py ROWS RUST OUT LOAD_BEFORE LOAD_AFTER PARAMS``; the tables of overhead.py,
when that part ran, in the file named by the environment variable ``OVERHEAD``; ``LINKS`` and
``PROFILES`` as above.
"""

import datetime
import json
import os
import platform
import re
import statistics
import sys
from collections import defaultdict

import torch

rows_path, rust_path, out_path, load_before, load_after, params = sys.argv[1:7]
rows = [json.loads(line) for line in open(rows_path)]
layout_rows = [r for r in rows if "layout" in r]  # PARTS=layout: a table of their own
rows = [r for r in rows if "layout" not in r]
profile_rows = [r for r in rows if r.get("profile")]  # under worker/bench/netns.sh: a section of their own
rows = [r for r in rows if not r.get("profile")]
NAMES = {("gloo", "-", "none"): "gloo", ("diphoma", "integrity", "none"): "diphoma",
         ("diphoma", "none", "none"): "diphoma none", ("gloo", "-", "bf16"): "gloo bf16 hook",
         ("diphoma", "none", "bf16"): "diphoma bf16"}
F32 = ("gloo", "diphoma", "diphoma none")
BF16 = ("gloo bf16 hook", "diphoma bf16")


def name(r):
    return NAMES.get((r["backend"], r["protection"], r.get("compression", "none")),
                     f"{r['backend']} {r['protection']} {r.get('compression', 'none')}")


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
         "## all_reduce beyond the ring": "overhead", "## Layouts": "layout", "## Network profiles": "profiles"}


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


def med(rs, k):
    return statistics.median(x[k] for x in rs)


def link_s(numel, world, wire_bytes, rate_gbit):
    """A ring all-reduce's time on links of ``rate_gbit`` for ``numel`` elements of
    ``wire_bytes`` each: 2·(n−1)/n · bytes / rate (None without a rate)."""
    if not rate_gbit:
        return None
    return 2 * (world - 1) / world * numel * wire_bytes * 8 / (rate_gbit * 1e9)


def max_delta(pairs):
    """The largest |Δparam| over the (path, path) pairs of parameter files (None if none)."""
    worst = None
    for a, b in pairs:
        if not (a and b and os.path.exists(a) and os.path.exists(b)):
            continue
        pa, pb = torch.load(a), torch.load(b)
        d = max(float((pa[k] - pb[k]).abs().max()) for k in pa)
        worst = d if worst is None else max(worst, d)
    return worst


def ms(x):
    return "–" if x is None else f"{x * 1e3:.0f}"


def ddp_section(rows, title, rate=None, rate_what="", shaped=False):
    """The DDP step's tables of ``rows`` under heading ``title`` (its level: the subsections one
    below it): f32 contenders, the bf16 pair, where the step goes with the physical floor at
    ``rate`` Gbit/s (None: no link time), the bars (the link-bound ones only when ``shaped``)."""
    sub = "#" * (title.split()[0].count("#") + 1)
    ddp = defaultdict(lambda: defaultdict(dict))  # (model, world) -> round -> name -> row
    for r in rows:
        if r["kind"] == "ddp":
            ddp[(r["model"], r["world"])][r["round"]][name(r)] = r
    if not ddp:
        return []
    out = [title, "",
           "| model | world | gloo step (ms) | comm share | diphoma step (ms) | comm share | diphoma none step (ms) | comm share | diphoma / gloo | diphoma none / gloo |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for (m, w), by_round in sorted(ddp.items()):
        cells = []
        for n in F32:
            rs = [v[n] for v in by_round.values() if n in v]
            cells += [f"{med(rs, 'step_s') * 1e3:.0f}" if rs else "–", f"{med(rs, 'comm_share'):.0%}" if rs else "–"]
        steps = {k: {n: x["step_s"] for n, x in v.items()} for k, v in by_round.items()}
        out.append(f"| {m} | {w} | {' | '.join(cells)} | {spread(ratios(steps, 'gloo', 'diphoma'))} | "
                   f"{spread(ratios(steps, 'gloo', 'diphoma none'))} |")
    if any(n in v for by_round in ddp.values() for v in by_round.values() for n in BF16):
        out += ["", f"{sub} bf16 on the wire: diphoma `DIPHOMA_COMPRESSION=bf16` against gloo with DDP's `bf16_compress_hook`", "",
                "Step times (ms), medians over rounds; ratios per round, median (min–max). Rate ratios: the f32 step "
                "over the bf16 step of the same backend (diphoma: no protection, as its bf16 runs). Training result: "
                "a fresh model from seed 0 trained the same steps (column) with each contender's communication, each "
                "rank on batches of its own seed; the largest |Δparam| between two contenders' parameters, over rounds, "
                "and for scale the largest change of a parameter in those steps (gloo, f32; batches of 2 images of "
                "32×32 leave ResNet's last BatchNorm layers normalising 2 values each: gradients in the thousands, "
                "so bf16's rounding moves the parameters visibly within a few steps).", "",
                "| model | world | gloo bf16 hook step | diphoma bf16 step | diphoma bf16 / gloo bf16 hook | "
                "bf16 rate / f32 rate, diphoma | bf16 rate / f32 rate, gloo | steps | max abs Δparam diphoma bf16 vs gloo bf16 hook | "
                "diphoma none vs gloo (f32) | gloo bf16 hook vs gloo (bf16's own effect) | max abs param change, gloo |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for (m, w), by_round in sorted(ddp.items()):
            steps = {k: {n: x["step_s"] for n, x in v.items()} for k, v in by_round.items()}
            med_step = [ms(statistics.median(v[n]["step_s"] for v in by_round.values() if n in v))
                        if any(n in v for v in by_round.values()) else "–" for n in BF16]

            def pairs(a, b):
                return [(v[a].get("params"), v[b].get("params")) for v in by_round.values() if a in v and b in v]

            n_steps = sorted({x.get("params_steps") for v in by_round.values() for x in v.values() if x.get("params_steps")})
            change = max((v["gloo"]["params_change"] for v in by_round.values()
                          if "params_change" in v.get("gloo", {})), default=None)
            deltas = [max_delta(pairs(a, b)) for a, b in
                      (("gloo bf16 hook", "diphoma bf16"), ("gloo", "diphoma none"), ("gloo", "gloo bf16 hook"))]
            out.append(f"| {m} | {w} | {' | '.join(med_step)} | {spread(ratios(steps, 'gloo bf16 hook', 'diphoma bf16'))} | "
                       f"{spread(ratios(steps, 'diphoma bf16', 'diphoma none'))} | {spread(ratios(steps, 'gloo bf16 hook', 'gloo'))} | "
                       f"{','.join(map(str, n_steps)) or '–'} | "
                       + " | ".join("–" if d is None else f"{d:.2e}" for d in deltas + [change]) + " |")
    link_note = (f"link time at {rate:g} Gbit/s{rate_what}" if rate else "no link rate on plain loopback: the floor is the compute-only step")
    out += ["", f"{sub} Where the DDP step goes, and its physical floor", "",
            "Per backend, medians over rounds (ms): `no_sync` (compute only); DDP with a comm hook that "
            "communicates nothing (compute plus DDP's own bucketing, copies and hooks); the backend's "
            "`all_reduce` of DDP's bucket sizes one after another, outside backward (gloo bf16 hook: as the hook "
            "does it); their serial sum (the step with no overlap and no cost beyond the all_reduce calls); the "
            "step; step − serial sum (below 0: communication overlapped with backward); the link time of the "
            f"gradient bytes, 2·(n−1)/n · bytes / rate ({link_note}; bf16: half the bytes); the physical floor, "
            "the larger of DDP with no comm and the link time; step / floor. The bar is 0.85× gloo's step.", "",
            "| model | world | backend | no_sync | DDP, no comm | buckets' all_reduce | serial sum | step | step − serial sum | "
            "link time | physical floor | step / floor | 0.85× gloo step |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    cells = {}  # (model, world) -> name -> (step, floor, link) medians (s)
    for (m, w), by_round in sorted(ddp.items()):
        gloo = [v["gloo"]["step_s"] for v in by_round.values() if "gloo" in v]
        for n in F32 + BF16:
            rs = [v[n] for v in by_round.values() if n in v]
            if not rs:
                continue
            md = {k: med(rs, k) for k in ("compute_s", "no_comm_s", "buckets_s", "step_s")}
            link = link_s(sum(rs[0]["buckets"]), w, 2 if n in BF16 else 4, rate)
            floor = max(md["no_comm_s"], link or 0)
            cells.setdefault((m, w), {})[n] = (md["step_s"], floor, link, md["no_comm_s"])
            serial = md["no_comm_s"] + md["buckets_s"]
            bar = ms(0.85 * statistics.median(gloo)) if gloo and n in F32 else "–"
            out.append(f"| {m} | {w} | {n} | {ms(md['compute_s'])} | {ms(md['no_comm_s'])} | {ms(md['buckets_s'])} | "
                       f"{ms(serial)} | {ms(md['step_s'])} | {(md['step_s'] - serial) * 1e3:+.0f} | {ms(link)} | "
                       f"{ms(floor)} | {md['step_s'] / floor:.2f} | {bar} |")
    traced = [(m, w, n, [v[n] for v in by_round.values() if n in v and "exposed_s" in v[n]])
              for (m, w), by_round in sorted(ddp.items()) for n in F32 + BF16]
    if any(rs for *_, rs in traced):
        out += ["", f"{sub} Bucket by bucket: what backward hides", "",
                "A third DDP model per run, whose comm hook is DDP's own `allreduce_hook` with a clock around it, "
                "medians over rounds (ms): its step; the last bucket's size and its exposed communication, from "
                "its submission (backward has no gradient left to compute) to backward's end; the other buckets' "
                "all_reduce during backward, submission to completion, summed; the same share of the buckets' "
                "all_reduce alone (the serial column above × their share of the bytes); what backward lost "
                "to them: traced step − DDP with no comm − exposed (on cores that backward and the all-reduces "
                "share, the CPU the hidden all-reduces take); and the CPU time the backend's threads used in "
                "the step (the process's CPU time less the training thread's; one intra-op thread per rank).", "",
                "| model | world | backend | DDP, no comm | step, hook timed | last bucket (MB) | exposed | "
                "other buckets during backward | the same alone | backward's loss | backend threads' CPU |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for m, w, n, rs in traced:
            if not rs:
                continue
            md = {k: med(rs, k) for k in ("no_comm_s", "traced_s", "exposed_s", "hidden_s", "buckets_s", "backend_cpu_s")}
            last, total = rs[0]["last_bucket"], sum(rs[0]["buckets"])
            alone = md["buckets_s"] * (1 - last / total) if total else None
            out.append(f"| {m} | {w} | {n} | {ms(md['no_comm_s'])} | {ms(md['traced_s'])} | {last * 4 / 1e6:.1f} | "
                       f"{ms(md['exposed_s'])} | {ms(md['hidden_s'])} | {ms(alone)} | "
                       f"{(md['traced_s'] - md['no_comm_s'] - md['exposed_s']) * 1e3:+.0f} | {ms(md['backend_cpu_s'])} |")
    out += ["", f"{sub} Bars (issue 30; printed, not asserted)", "",
            "A cell is link-bound when the link time of its f32 gradient bytes is at least its compute-only step "
            "(DDP with no comm, median over the contenders)" + ("" if shaped else "; on unshaped loopback no cell is") +
            ". Where link-bound: diphoma's default (no protection) ≤ 0.85× gloo's step, and bf16's step rate ≥ 1.8× "
            "f32's (diphoma none step / diphoma bf16 step; beside it the physical floors' ratio, what the link "
            "allows); everywhere: diphoma's default never slower than gloo. Per-round ratios, median (min–max).", "",
            "| model | world | link-bound (f32 link / compute, ms) | default ≤ 0.85× gloo | bf16 rate ≥ 1.8× f32 (floors' ratio) | default ≤ gloo |",
            "|---|---|---|---|---|---|"]
    for (m, w), by_round in sorted(ddp.items()):
        c = cells.get((m, w), {})
        steps = {k: {n: x["step_s"] for n, x in v.items()} for k, v in by_round.items()}
        comp = statistics.median(x[3] for x in c.values()) if c else None
        f32_link = link_s(sum(next(iter(next(iter(by_round.values())).values()))["buckets"]), w, 4, rate)
        bound = bool(shaped and f32_link and comp and f32_link >= comp)

        def verdict(xs, ok, applies=True):
            if not applies:
                return "n/a"
            if not xs:
                return "–"
            return f"{'met' if ok(statistics.median(xs)) else 'missed'} {spread(xs)}"

        default = ratios(steps, "gloo", "diphoma none")
        bf16 = ratios(steps, "diphoma bf16", "diphoma none")
        floors = (f"; floors {c['diphoma none'][1] / c['diphoma bf16'][1]:.2f}"
                  if "diphoma none" in c and "diphoma bf16" in c else "")
        out.append(f"| {m} | {w} | {'yes' if bound else 'no'} ({ms(f32_link)} / {ms(comp)}) | "
                   f"{verdict(default, lambda x: x <= 0.85, bound)} | "
                   f"{verdict(bf16, lambda x: x >= 1.8, bound)}{floors if bound else ''} | {verdict(default, lambda x: x <= 1.0)} |")
    return out + [""]


def parse_rust(path):
    """``diphoma-worker bench``'s tables: "## [profile P ]round R world W protection X" then
    nccl-tests rows (size count k time ...): {profile or None: {(world, bytes): {round: {"rust X": s}}}}."""
    rust = defaultdict(lambda: defaultdict(dict))
    key = None
    for line in open(path):
        if m := re.match(r"## (?:profile (\S+) )?round (\d+) world (\d+) protection (\w+)", line):
            key = (m[1], int(m[2]), int(m[3]), m[4])
        elif key and (f := line.split()) and f[0].isdigit():
            rust[key[0]][(key[2], int(f[0]))].setdefault(key[1], {})[f"rust {key[3]}"] = float(f[3]) * 1e-6
    return rust


def allreduce_table(rows, rust):
    """The all_reduce table of ``rows`` beside the Rust bench's ``rust`` ({(world, bytes): ...})."""
    ar = defaultdict(dict)
    for r in rows:
        if r["kind"] == "allreduce":
            ar[(r["world"], r["bytes"])].setdefault(r["round"], {})[name(r)] = r["median_s"]
    if not ar:
        return []
    out = ["Timed alike (performance.md §1): k back-to-back operations per sample (≈20 ms), 20 samples, "
           "each the slowest rank's mean, median. Overhead: Python diphoma / Rust at the same protection.", "",
           "| world | bytes | gloo | diphoma | diphoma none | Rust integrity | Rust none | diphoma / gloo | diphoma none / gloo | overhead integrity | overhead none |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (w, b) in sorted(set(ar) | set(rust)):
        by_round = defaultdict(dict)
        for src in (ar.get((w, b), {}), rust.get((w, b), {})):
            for k, v in src.items():
                by_round[k].update(v)
        md = [statistics.median(v[n] for v in by_round.values() if n in v) * 1e6
              if any(n in v for v in by_round.values()) else float("nan")
              for n in ("gloo", "diphoma", "diphoma none", "rust integrity", "rust none")]
        out.append(f"| {w} | {b} | " + " | ".join(f"{x:.0f}" for x in md) + " | "
                   + " | ".join(spread(ratios(by_round, a, c)) for a, c in
                                (("gloo", "diphoma"), ("gloo", "diphoma none"),
                                 ("rust integrity", "diphoma"), ("rust none", "diphoma none"))) + " |")
    return out


kept = previous(out_path)
rust = parse_rust(rust_path)
out = ["# make bench-torch", "",
       "`diphoma` is the ring with per-frame integrity (a keyed BLAKE3 tag per frame, the default "
       "until issue 30); `diphoma none` is the same ring without it, as gloo runs, and the default "
       "since; `diphoma bf16` is `diphoma none` with `DIPHOMA_COMPRESSION=bf16`, `gloo bf16 hook` gloo with "
       "DDP's `bf16_compress_hook`. Ratios: median over rounds "
       "of each round's ratio (min–max). Each part states the run it comes from.", ""]
ddp_out = ddp_section(rows, "## DDP step on CPU (torchvision, synthetic 32×32, batch 2 per rank)")
out += (ddp_out[:2] + [RUN, ""] + ddp_out[2:]) if ddp_out else kept["ddp"]
ar_out = allreduce_table(rows, rust.get(None, {}))
if ar_out:
    out += (["## all_reduce (float32, sum, in place): from Python and the Rust bench, µs", "", RUN, ""] + ar_out
            + ["", "## The Rust bench's own tables", "", "```", open(rust_path).read().rstrip(), "```", ""])
else:
    out += kept["allreduce"]
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
    md = [statistics.median(v[n] for v in by_round.values() if n in v) * 1e3
          if any(n in v for v in by_round.values()) else float("nan") for n in LAYOUTS]
    layout_out.append(f"| {key[3]} | " + " | ".join(f"{x:.2f}" for x in md) + " | "
                      + " | ".join(spread(ratios(by_round, a, "2x2")) for a in ("4x1", "gloo")) + " |")
out += (layout_out + [""]) if layout_rows else kept["layout"]


def links(profile):
    """netns_probe's lines for ``profile`` ("link A -> B: X Gbit/s"), and their lowest rate."""
    path = os.path.join(os.environ.get("LINKS", ""), f"{profile}.txt")
    lines = [x.strip() for x in open(path)] if os.environ.get("LINKS") and os.path.exists(path) else []
    rates = [float(m[1]) for x in lines if (m := re.search(r": ([0-9.]+) Gbit/s", x))]
    return lines, (min(rates) if rates else None)


if profile_rows:
    order = os.environ.get("PROFILES", "").split()
    order += [p for p in dict.fromkeys(r["profile"] for r in profile_rows) if p not in order]
    prof_out = ([""] if out and out[-1] else []) + ["## Network profiles: the DDP step and all_reduce on shaped links (worker/bench/netns.sh)", "", RUN, "",
                "Every rank of every contender ran inside one network namespace of the run's own, rank r on its own "
                "address 127.0.0.(r+2) (gloo: `GLOO_SOCKET_IFNAME=lo:rR`; the diphoma ring: its "
                "`DIPHOMA_RING_ADDRESSES`, both set per rank by worker/bench/netns/sitecustomize.py; the Rust bench: "
                "`--hosts`; outgoing connections bound to the rank's address by the srcbind shim), the namespace's "
                "loopback shaped with one htb class per rank address at the profile's rate (the link into each rank); "
                "the profiles interleaved in every round. Under each profile: its single TCP stream per ring link "
                "(iperf3, 2 s, measured once per profile).", ""]
    for p in order:
        prs = [r for r in profile_rows if r["profile"] == p]
        if not prs:
            continue
        rate = prs[0].get("rate_gbit")
        lines, measured = links(p)
        prof_out += [f"### profile {p}: " + (f"{rate:g} Gbit/s per rank address" if rate else "unshaped loopback"), "",
                     "Single TCP stream per link: " + ("; ".join(lines) if lines else "not measured") + ".", ""]
        prof_out += ddp_section(prs, f"#### DDP step on CPU, profile {p} (ms)", rate or measured,
                                "" if rate else " (the lowest measured single stream: unshaped)", shaped=bool(rate))
        ar_p = allreduce_table(prs, rust.get(p, {}))
        if ar_p:
            prof_out += [f"#### all_reduce (float32, sum, in place), profile {p}: from Python and the Rust bench, µs", ""] + ar_p + [""]
    if rust:
        prof_out += ["### The Rust bench's own tables (every profile)", "", "```", open(rust_path).read().rstrip(), "```", ""]
    out += prof_out
else:
    out += kept["profiles"]
open(out_path, "w").write("\n".join(out))
print("\n".join(out))
