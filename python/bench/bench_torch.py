"""One rank of ``make bench-torch`` (started by ``python -m diphoma.run``; see run.sh).

``ddp BACKEND MODEL STEPS WARMUP OUT``: torchvision MODEL (resnet18, resnet50; 10 classes) under
DDP with BACKEND (gloo, diphoma) and DDP's defaults (25 MB buckets, the first 1 MB), a batch of
2 synthetic 32×32 images per rank; after WARMUP warm-up steps of each kind, STEPS timed steps
with gradient allreduce alternating with STEPS under ``no_sync()`` (the same compute, no
communication), STEPS of a second DDP model whose comm hook communicates nothing (DDP's own
bucketing, copies and hooks: the step any backend's step contains) and STEPS of the backend's
``all_reduce`` of buffers of DDP's bucket sizes one after another (the communication alone,
outside backward), so load that comes and goes hits all alike; every step starts on a barrier.
Rank 0 appends one JSON line to OUT: the median of each (s) and the bucket sizes (elements);
the communication share is 1 − no_sync / step. Runs without a comm hook of their own (all but
gloo's bf16 pair) also time STEPS of a third DDP model whose comm hook is DDP's own
``allreduce_hook`` (it divides by the world size, then all-reduces) with a clock around it (the
bucket timeline): per step, when each bucket's all_reduce was submitted and when it completed,
and when backward returned; the row gets the medians of that step (``traced_s``), of backward's end minus the last
bucket's submission (``exposed_s``: communication no computation hides), of the other buckets'
submission-to-completion times summed (``hidden_s``), the last bucket's size
(``last_bucket``, elements) and the CPU time the process's other threads (the backend's: every
rank runs with one intra-op thread) used in the step (``backend_cpu_s``).

``allreduce BACKEND SIZES OUT``: ``torch.distributed.all_reduce`` (sum, in place) of float32
tensors of each size in SIZES (bytes, comma-separated), timed as ``diphoma-worker bench`` times
the Rust runtime (performance.md §1): 5 warm-up operations, k calibrated on rank 0 so that k
back-to-back operations take about 20 ms, 20 samples of k operations, each sample the slowest
rank's mean; rank 0 appends one JSON line per size with the median (s) and k.

``DIPHOMA_COMPRESSION=bf16`` (ddp): the diphoma group carries every float32 all-reduce as
bfloat16 (the backend's own); gloo gets DDP's ``bf16_compress_hook`` on the timed model (the
like-for-like anchor), and its buckets' all_reduce is timed as that hook does it (cast to
bfloat16, all_reduce, cast back).

``BENCH_PARAMS=DIR`` (ddp): after the timing, the training-result check: a fresh model from the
same seed (0) trained STEPS steps under DDP with the same communication (backend, compression,
hook) on batches of a seed of each rank's own (so that the all-reduce matters); rank 0 saves its
parameters to a file in DIR, named in the row (``params``), for report.py to compare contenders,
and the largest |change| of a parameter in those steps (``params_change``, for scale).

Every JSON line carries the backend, the world size, ``DIPHOMA_RING_PROTECTION`` (the
diphoma ring's frame protection; gloo has none), ``DIPHOMA_COMPRESSION`` (``compression``: none or
bf16), ``BENCH_LAYOUT`` (pods × processes, e.g. ``2x2``, with `` flat`` under
``DIPHOMA_HIERARCHICAL=0``; absent for the other parts) and, inside worker/bench/netns.sh's
namespace, the network profile (``profile``: ``NETNS_PROFILE``) and its rate (``rate_gbit``:
``NETNS_RATE_GBIT``, null when unshaped).
"""

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torchvision
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, bf16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import diphoma.torch  # noqa: F401  registers "diphoma"

SAMPLES, SAMPLE_S, WARMUP = 20, 0.02, 5


def timed(fns, n):
    """Per function of ``fns``, the median over ``n`` calls (s); the calls alternate between
    the functions and each starts together on every rank (barrier)."""
    out = [[] for _ in fns]
    for _ in range(n):
        for fn, ts in zip(fns, out):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in out]


def compression():
    """The run's wire compression of float32 all-reduces: ``none`` or ``bf16``."""
    return (os.environ.get("DIPHOMA_COMPRESSION") or "none").strip().lower()


def build(model_name, hook=None):
    """DDP of a fresh torchvision ``model_name`` from seed 0 with comm hook ``hook``, and SGD."""
    torch.manual_seed(0)
    model = DDP(getattr(torchvision.models, model_name)(num_classes=10))
    if hook:
        model.register_comm_hook(None, hook)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def gloo_hook(backend):
    """gloo's comm hook for the run's compression: DDP's bf16_compress_hook under bf16 (diphoma
    compresses in the backend itself)."""
    return bf16_compress_hook if backend == "gloo" and compression() == "bf16" else None


def train_params(model_name, backend, steps):
    """The training-result check (``BENCH_PARAMS``): a fresh model from seed 0 trained ``steps``
    DDP steps with the run's communication, each rank on batches of its own seed (1 + rank);
    its parameters afterwards (every rank holds the same) and the largest |change| of one."""
    model, opt = build(model_name, gloo_hook(backend))
    before = {k: v.detach().clone() for k, v in model.module.named_parameters()}
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    for _ in range(steps):
        x, y = torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    after = {k: v.detach().clone() for k, v in model.module.named_parameters()}
    return after, max(float((after[k] - before[k]).abs().max()) for k in after)


def ddp(model_name, backend, steps, warmup):
    buckets = {}  # bucket index -> numel, in the order of the last no-comm step (DDP rebuilds them after the first)

    def no_comm(state, bucket):
        """A comm hook that communicates nothing: the bucket comes back as it went in."""
        buckets[bucket.index()] = bucket.buffer().numel()
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    (model, opt), (bare, bare_opt) = build(model_name, gloo_hook(backend)), build(model_name, no_comm)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))

    def stepper(m, o):
        def step():
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
        return step

    step, bare_step = stepper(model, opt), stepper(bare, bare_opt)

    def hooked():
        buckets.clear()
        bare_step()

    def local():
        with model.no_sync():
            step()

    flat = torch.zeros(sum(p.numel() for p in model.parameters()))  # DDP's buckets hold every gradient
    hook = gloo_hook(backend)

    def allreduce_buckets():
        """The backend's all_reduce of buffers of DDP's bucket sizes, one after another (with
        gloo's bf16 hook: as the hook does it, a bfloat16 copy reduced and copied back)."""
        offset = 0
        for n in buckets.values():
            b = flat[offset:offset + n]
            if hook:
                half = b.to(torch.bfloat16).div_(dist.get_world_size())
                dist.all_reduce(half)
                b.copy_(half)
            else:
                dist.all_reduce(b)
            offset += n

    fns = [step, local, hooked, allreduce_buckets]
    timeline = []  # per traced step: (backward's end, [(submitted, completed, numel)], other threads' CPU s)
    if hook is None:  # the bucket timeline under DDP's own all-reduce hook
        events = []

        def clocked(state, bucket):
            t0, n = time.perf_counter(), bucket.buffer().numel()

            def completed(fut):
                events.append((t0, time.perf_counter(), n))
                return fut.value()
            return allreduce_hook(None, bucket).then(completed)

        tm, to = build(model_name, clocked)

        def traced_step():
            events.clear()
            cpu, own = time.process_time(), time.thread_time()
            to.zero_grad()
            torch.nn.functional.cross_entropy(tm(x), y).backward()
            end = time.perf_counter()
            to.step()
            # CPU time of the process's other threads in the step: the backend's (OMP_NUM_THREADS=1)
            timeline.append((end, sorted(events), time.process_time() - cpu - (time.thread_time() - own)))
        fns.append(traced_step)
    timed(fns, warmup)
    timeline.clear()
    with_comm, without, no_comm_s, buckets_s, *traced = timed(fns, steps)
    row = {"kind": "ddp", "model": model_name, "step_s": with_comm, "compute_s": without,
           "comm_share": max(0.0, 1 - without / with_comm), "no_comm_s": no_comm_s,
           "buckets_s": buckets_s, "buckets": list(buckets.values()), "steps": steps,
           "threads": torch.get_num_threads()}
    if traced and all(ev for _, ev, _ in timeline):
        row.update(traced_s=traced[0],
                   exposed_s=statistics.median(end - ev[-1][0] for end, ev, _ in timeline),
                   hidden_s=statistics.median(sum(b - a for a, b, _ in ev[:-1]) for _, ev, _ in timeline),
                   last_bucket=timeline[0][1][-1][2],
                   backend_cpu_s=statistics.median(c for *_, c in timeline))
    return [row]


def save_params(rows, model_name, backend, steps):
    """``BENCH_PARAMS``: the training-result check's parameters, saved by rank 0 into that
    directory and named in the row."""
    params, change = train_params(model_name, backend, steps)
    if dist.get_rank() == 0:
        r = rows[0]
        name = (f"{os.environ.get('NETNS_PROFILE') or 'plain'}_{model_name}_w{dist.get_world_size()}"
                f"_r{os.environ.get('BENCH_ROUND', '0')}_{backend}-{os.environ.get('DIPHOMA_RING_PROTECTION') or 'none'}"
                f"-{compression()}.pt")
        r["params"] = os.path.join(os.environ["BENCH_PARAMS"], name)
        r["params_steps"], r["params_change"] = steps, change
        torch.save(params, r["params"])


def allreduce(sizes):
    rows = []
    for size in sizes:
        t = torch.zeros(size // 4)  # zeros: sums stay finite however many operations run
        for _ in range(WARMUP):
            dist.all_reduce(t)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        k = torch.tensor([max(1, min(4096, round(SAMPLE_S / max(time.perf_counter() - t0, 1e-7))))])
        dist.broadcast(k, 0)  # every rank must run as many: a rank's own estimate would hang
        k = int(k)
        means = torch.zeros(SAMPLES, dtype=torch.float64)
        for i in range(SAMPLES):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(k):
                dist.all_reduce(t)
            means[i] = (time.perf_counter() - t0) / k
        dist.all_reduce(means, op=dist.ReduceOp.MAX)  # each sample: the slowest rank's mean
        rows.append({"kind": "allreduce", "bytes": size, "k": k, "median_s": statistics.median(means.tolist())})
    return rows


def main():
    mode, backend = sys.argv[1], sys.argv[2]
    # The synthetic training drives values into the denormal range, where x86 computes many
    # times slower (ResNet-50, world 2: a step of 524 ms with them, 221 ms flushed): every rank of
    # every contender flushes them, so that the step times the communication, not the values.
    torch.set_flush_denormal(True)
    dist.init_process_group(backend=backend)
    if mode == "ddp":
        rows = ddp(sys.argv[3], backend, int(sys.argv[4]), int(sys.argv[5]))
        if os.environ.get("BENCH_PARAMS"):
            save_params(rows, sys.argv[3], backend, int(sys.argv[4]))
    else:
        rows = allreduce([int(s) for s in sys.argv[3].split(",")])
    protection = (os.environ.get("DIPHOMA_RING_PROTECTION") or "none") if backend == "diphoma" else "-"
    if dist.get_rank() == 0:
        with open(sys.argv[-1], "a") as f:
            for r in rows:
                layout = {"layout": os.environ["BENCH_LAYOUT"]} if os.environ.get("BENCH_LAYOUT") else {}
                if os.environ.get("NETNS_PROFILE"):  # inside worker/bench/netns.sh's namespace
                    rate = os.environ.get("NETNS_RATE_GBIT")
                    layout.update(profile=os.environ["NETNS_PROFILE"], rate_gbit=float(rate) if rate else None)
                f.write(json.dumps({**r, **layout, "backend": backend, "protection": protection,
                                    "compression": compression(),
                                    "world": dist.get_world_size(),
                                    "round": int(os.environ.get("BENCH_ROUND", "0"))}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
