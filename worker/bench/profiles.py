#!/usr/bin/env python3
"""profiles.py DIR PROFILE... - the network profiles of one `make bench` run side by side (issue 30).

DIR/PROFILE/ holds, per round R and world N: rustmodes_nN_rR.txt (diphoma-worker bench with
--protection none,integrity,encryption: busbw per mode), rust-bf16_n2_rR.txt, gloo_nN_rR.txt,
mpi_tcp_nN_rR.txt (nccl-tests rows: size count k time min algbw busbw wrong), and
probes/link.txt (a single TCP stream per link, iperf3). Values are the median over rounds.

busbw is printed in Gbit/s (GB/s x 8), so that it reads against the profile's link rate
directly. A profile is link-bound when the unprotected ring's busbw at the largest size is
within 10% of its rate. Bars (design/performance.md, issue 30): in link-bound profiles busbw >=
90% of the rate from 16 MiB and integrity costing <= 10% of busbw from 16 MiB; everywhere the
default protection never slower than gloo (in shaped profiles at every size, on loopback from
1 MiB), judged for each candidate default (none and integrity, today's default); bf16 >= 1.8x f32's element rate where link-bound."""
import glob, os, re, statistics, sys

MODES = ["none", "integrity", "encryption"]
RATES = {"loopback": None, "10g": 10.0, "2.5g": 2.5, "1g": 1.0}
CANDIDATES = ["none", "integrity"]  # candidate defaults, judged against gloo
d, profiles = sys.argv[1], sys.argv[2:]
verdicts = []


def rows(f, n):
    """nccl-tests rows of a table: {size: busbw Gbit/s}, from the time (the printed busbw has
    3 decimals of GB/s, too few for small sizes)."""
    out = {}
    for line in open(f):
        p = line.split()
        if len(p) == 8 and p[0].isdigit():
            out[int(p[0])] = int(p[0]) * 8 / (float(p[3]) * 1e3) * 2 * (n - 1) / n
    return out


def mode_rows(f):
    """The side-by-side table of several protection modes: {(mode, size): busbw Gbit/s}."""
    out, modes = {}, None
    for line in open(f):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == "size(B)":
            modes = [c.split()[1] for c in cells if c.startswith("busbw ")]
        elif modes and cells and cells[0].isdigit():
            for m, v in zip(modes, cells[1:1 + len(modes)]):
                out[(m, int(cells[0]))] = float(v) * 8
    return out


def load(p):
    """{(lib, n, size): median busbw Gbit/s over rounds}, and the probe's link rates."""
    t = {}
    for f in glob.glob(os.path.join(d, p, "*_n[0-9]*_r[0-9]*.txt")):
        lib, n = re.match(r"(.+)_n(\d+)_r\d+\.txt", os.path.basename(f)).groups()
        if lib == "rustmodes":
            for (m, s), v in mode_rows(f).items():
                t.setdefault((m, int(n), s), []).append(v)
        else:
            for s, v in rows(f, int(n)).items():
                t.setdefault((lib, int(n), s), []).append(v)
    links = []
    lf = os.path.join(d, p, "probes", "link.txt")
    if os.path.exists(lf):
        links = [float(x) for x in re.findall(r": ([\d.]+) Gbit/s", open(lf).read())]
    return {k: statistics.median(v) for k, v in t.items()}, links


def verdict(name, p, n, size, val, ref, ok):
    verdicts.append((name, p, n, size, val, ref, ok))


def human(size):
    for unit, sh in (("MiB", 20), ("KiB", 10)):
        if size >= 1 << sh:
            return f"{size >> sh} {unit}"
    return f"{size} B"


data = {p: load(p) for p in profiles}
libs = MODES + ["gloo", "mpi_tcp", "rust-bf16"]
print("busbw in Gbit/s (median over rounds); `% link`: the unprotected ring's busbw / the profile's rate;"
      " `M/gloo`: gloo's time / diphoma's with protection M (> 1: diphoma faster).\n")
for p in profiles:
    med, links = data[p]
    rate = RATES[p]
    probe = ", ".join(f"{x:.2f}" for x in links) or "not measured"
    print(f"## profile {p}: {'unshaped loopback' if rate is None else f'{rate:g} Gbit/s per rank (htb per address)'}")
    print(f"\nsingle TCP stream per link (iperf3, Gbit/s): {probe}\n")
    for n in sorted({k[1] for k in med}):
        sizes = sorted({k[2] for k in med if k[1] == n})
        present = [l for l in libs if any((l, n, s) in med for s in sizes)]
        print(f"n={n}\n")
        print("| size | " + " | ".join(present) + (" | % link" if rate else "") + "".join(f" | {m}/gloo" for m in CANDIDATES) + " |")
        print("|---|" + "---|" * (len(present) + len(CANDIDATES) + (1 if rate else 0)))
        for s in sizes:
            cells = [f"{med[(l, n, s)]:.3f}" if (l, n, s) in med else "-" for l in present]
            extra = []
            if rate:
                extra.append(f"{med[('none', n, s)] / rate:.0%}" if ("none", n, s) in med else "-")
            gv = med.get(("gloo", n, s))
            for m in CANDIDATES:
                dv = med.get((m, n, s))
                extra.append(f"{dv / gv:.2f}x" if dv and gv else "-")
                if dv and gv and (rate or s >= 1 << 20):
                    verdict(f"{m} as default: never slower than gloo", p, n, s, dv, gv, dv >= gv)
            print(f"| {human(s)} | " + " | ".join(cells + extra) + " |")
            if rate and s >= 16 << 20 and ("none", n, s) in med:
                verdict("busbw >= 90% of the link rate", p, n, s, med[("none", n, s)], rate,
                        med[("none", n, s)] >= 0.9 * rate)
                if ("integrity", n, s) in med:
                    verdict("integrity costs <= 10% of busbw", p, n, s, med[("integrity", n, s)],
                            med[("none", n, s)], med[("integrity", n, s)] >= 0.9 * med[("none", n, s)])
            if n == 2 and s >= 16 << 20 and ("rust-bf16", 2, s) in med and ("none", 2, s) in med:
                # same buffer bytes: element rate ratio = busbw ratio x 2 (half the bytes per element)
                r = 2 * med[("rust-bf16", 2, s)] / med[("none", 2, s)]
                verdict("bf16 element rate >= 1.8x f32's", p, 2, s, r, 1.8, r >= 1.8)
        print()
    if rate:
        top = [(n, max(s for (l, nn, s) in med if l == "none" and nn == n)) for n in sorted({k[1] for k in med})]
        bound = [f"n={n}: {med[('none', n, s)] / rate:.0%} of {rate:g} Gbit/s at {human(s)} -> "
                 f"{'link-bound' if med[('none', n, s)] >= 0.9 * rate else 'NOT link-bound (CPU-bound)'}"
                 for n, s in top if ("none", n, s) in med]
        print("link-bound? " + "; ".join(bound) + "\n")

print("## bars\n")
print("| bar | profile | n | size | value | reference | ratio | verdict |")
print("|---|---|---|---|---|---|---|---|")
for name, p, n, s, v, ref, ok in verdicts:
    print(f"| {name} | {p} | {n} | {human(s)} | {v:.3f} | {ref:.3f} | {v / ref:.2f} | {'met' if ok else 'MISSED'} |")
missed = sum(not v[-1] for v in verdicts)
print(f"\n{len(verdicts) - missed} of {len(verdicts)} bar cells met" + (f", {missed} MISSED" if missed else ""))
