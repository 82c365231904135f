#!/usr/bin/env python3
"""bars.py DIR - check the allreduce bars of design/performance.md §1 on one run's results
(the LIB_nN_rR.txt tables that summarize.py merges, plus probes/ringbw_nN_rR.txt).

Per (lib, n, size) the time is the median over rounds of the per-round medians, as in
summarize.py. TCP anchors: gloo, mpi_tcp, mpi_tcpring (mpi_shm is not TCP and not a bar).
Bars: n=2 and n=4 faster than the best TCP anchor at every size; at >= 16 MiB n=2 busbw
>= 85% of ringbw's per-link rate (median over ranks and rounds); f16/bf16 element rate
>= 1.8x f32's at the same buffer size >= 16 MiB."""
import glob, os, re, statistics, sys

d = sys.argv[1]
t = {}
for f in glob.glob(os.path.join(d, "*_n[0-9]*_r[0-9]*.txt")):
    m = re.match(r"(.+)_n(\d+)_r(\d+)\.txt", os.path.basename(f))
    lib, n = m.group(1), int(m.group(2))
    for line in open(f):
        p = line.split()
        if len(p) == 8 and p[0].isdigit():
            t.setdefault((lib, n, int(p[0])), []).append((float(p[3]), int(p[1])))
med = {k: (statistics.median(x for x, _ in v), v[0][1]) for k, v in t.items()}
ring = {}
for f in glob.glob(os.path.join(d, "probes", "ringbw_n*_r*.txt")):
    n = int(re.search(r"ringbw_n(\d+)_", f).group(1))
    ring.setdefault(n, []).extend(float(x) for x in re.findall(r"per-link ([\d.]+) GB/s", open(f).read()))
ok_all = True

def verdict(ok):
    global ok_all
    ok_all &= ok
    return "met" if ok else "MISSED"

print("| bar | n | size | diphoma | reference | ratio | verdict |")
print("|---|---|---|---|---|---|---|")
anchors = ["gloo", "mpi_tcp", "mpi_tcpring"]
for n in (2, 4):
    for size in sorted({s for (l, nn, s) in med if l == "rust" and nn == n}):
        ours = med[("rust", n, size)][0]
        cands = [(med[(a, n, size)][0], a) for a in anchors if (a, n, size) in med]
        if not cands:
            continue
        best, who = min(cands)
        print(f"| faster than best TCP anchor | {n} | {size} | {ours:.1f} us | {who} {best:.1f} us | "
              f"{best / ours:.2f}x | {verdict(ours < best)} |")
if 2 in ring:
    rb = statistics.median(ring[2])
    for size in sorted(s for (l, nn, s) in med if l == "rust" and nn == 2 and s >= 16 << 20):
        bus = size / (med[("rust", 2, size)][0] * 1e-6) / 1e9  # busbw = algbw for n=2
        print(f"| busbw >= 85% of ringbw | 2 | {size} | {bus:.3f} GB/s | ringbw {rb:.3f} GB/s | "
              f"{bus / rb:.0%} | {verdict(bus >= 0.85 * rb)} |")
for dt in ("f16", "bf16"):
    for size in sorted(s for (l, nn, s) in med if l == f"rust-{dt}" and nn == 2 and s >= 16 << 20):
        if ("rust", 2, size) not in med:
            continue
        (th, ch), (tf, cf) = med[(f"rust-{dt}", 2, size)], med[("rust", 2, size)]
        r = (ch / th) / (cf / tf)
        print(f"| {dt} element rate >= 1.8x f32 | 2 | {size} | {ch / th:.0f} Melem/s | f32 {cf / tf:.0f} Melem/s | "
              f"{r:.2f}x | {verdict(r >= 1.8)} |")
print()
print("all bars met" if ok_all else "some bars MISSED")
