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
the communication share is 1 − no_sync / step.

``allreduce BACKEND SIZES OUT``: ``torch.distributed.all_reduce`` (sum, in place) of float32
tensors of each size in SIZES (bytes, comma-separated), timed as ``diphoma-worker bench`` times
the Rust runtime (performance.md §1): 5 warm-up operations, k calibrated on rank 0 so that k
back-to-back operations take about 20 ms, 20 samples of k operations, each sample the slowest
rank's mean; rank 0 appends one JSON line per size with the median (s) and k.

Every JSON line carries the backend, the world size, ``DIPHOMA_RING_PROTECTION`` (the
diphoma ring's frame protection; gloo has none) and ``BENCH_LAYOUT`` (pods × processes, e.g.
``2x2``, with `` flat`` under ``DIPHOMA_HIERARCHICAL=0``; absent for the other parts).
"""

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torchvision
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


def ddp(model_name, steps, warmup):
    def build(hook=None):
        torch.manual_seed(0)
        model = DDP(getattr(torchvision.models, model_name)(num_classes=10))
        if hook:
            model.register_comm_hook(None, hook)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    buckets = {}  # bucket index -> numel, in the order of the last no-comm step (DDP rebuilds them after the first)

    def no_comm(state, bucket):
        """A comm hook that communicates nothing: the bucket comes back as it went in."""
        buckets[bucket.index()] = bucket.buffer().numel()
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    (model, opt), (bare, bare_opt) = build(), build(no_comm)
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

    def allreduce_buckets():
        """The backend's all_reduce of buffers of DDP's bucket sizes, one after another."""
        offset = 0
        for n in buckets.values():
            dist.all_reduce(flat[offset:offset + n])
            offset += n

    fns = [step, local, hooked, allreduce_buckets]
    timed(fns, warmup)
    with_comm, without, no_comm_s, buckets_s = timed(fns, steps)
    return [{"kind": "ddp", "model": model_name, "step_s": with_comm, "compute_s": without,
             "comm_share": max(0.0, 1 - without / with_comm), "no_comm_s": no_comm_s,
             "buckets_s": buckets_s, "buckets": list(buckets.values()), "steps": steps,
             "threads": torch.get_num_threads()}]


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
    dist.init_process_group(backend=backend)
    if mode == "ddp":
        rows = ddp(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        rows = allreduce([int(s) for s in sys.argv[3].split(",")])
    protection = (os.environ.get("DIPHOMA_RING_PROTECTION") or "none") if backend == "diphoma" else "-"
    if dist.get_rank() == 0:
        with open(sys.argv[-1], "a") as f:
            for r in rows:
                layout = {"layout": os.environ["BENCH_LAYOUT"]} if os.environ.get("BENCH_LAYOUT") else {}
                f.write(json.dumps({**r, **layout, "backend": backend, "protection": protection,
                                    "world": dist.get_world_size(),
                                    "round": int(os.environ.get("BENCH_ROUND", "0"))}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
