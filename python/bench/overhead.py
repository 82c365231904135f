"""Where a ``torch.distributed.all_reduce`` from Python spends its time beyond the ring
(``make bench-overhead``; started by ``python -m diphoma.run --nproc N``, see overhead.sh).

Float32 in-place sums of each size in SIZES (bytes, comma-separated) through four layers, in
one process and interleaved (the order rotates each sample, so load that comes and goes hits
every layer alike):

- ``ring``: the native ``diphoma.Ring.allreduce`` on the tensor's ``data_ptr()`` (the floor);
- ``group``: ``ProcessGroupDiphoma.allreduce`` with ``asyncOp`` false, then ``wait()``;
- ``all_reduce``: ``dist.all_reduce(t)`` (torch's wrapper, then the group);
- ``all_reduce async``: ``dist.all_reduce(t, async_op=True).wait()`` (the group's thread).

Every native call goes through one forwarding wrapper that sums the time spent inside it, so
each layer's time splits into the ring's and the rest ("outside": Python, torch and the thread
hop, run after the ring has evicted the caches at sizes beyond L2). Each sample is k
back-to-back operations (k sized on rank 0 to ≈ ``SAMPLE_MS``), each sample's value the
slowest rank's; medians over ``SAMPLES`` samples. Rank 0 prints a table, in µs per operation.

Env: SIZES (1K,64K,1M,16M) SAMPLES (20) SAMPLE_MS (20).
"""

import os
import statistics
import time

import torch
import torch.distributed as dist

import diphoma.torch  # noqa: F401  registers "diphoma"


def sizes():
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for s in os.environ.get("SIZES", "1K,64K,1M,16M").split(","):
        yield int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


class Timed:
    """Forwards to the real ring; ``inside`` sums the seconds spent in its allreduce."""

    def __init__(self, ring):
        self.ring, self.inside = ring, 0.0

    def __getattr__(self, name):
        return getattr(self.ring, name)

    def allreduce(self, *args):
        t0 = time.perf_counter()
        try:
            return self.ring.allreduce(*args)
        finally:
            self.inside += time.perf_counter() - t0


def main():
    samples = int(os.environ.get("SAMPLES", "20"))
    sample_s = float(os.environ.get("SAMPLE_MS", "20")) / 1e3
    dist.init_process_group(backend="diphoma")
    group = dist.distributed_c10d._get_default_group()
    ring = group.ring = Timed(group.ring)
    sync = dist.AllreduceOptions()
    sync.asyncOp = False
    rows = []
    for size in sizes():
        t = torch.zeros(size // 4)  # zeros: sums stay finite however many operations run
        layers = {
            "ring": lambda: ring.allreduce(t.data_ptr(), t.numel(), "float32", "sum"),
            "group": lambda: group.allreduce([t], sync).wait(),
            "all_reduce": lambda: dist.all_reduce(t),
            "all_reduce async": lambda: dist.all_reduce(t, async_op=True).wait(),
        }
        names = list(layers)
        for fn in layers.values():
            for _ in range(5):
                fn()
        dist.barrier()
        t0 = time.perf_counter()
        layers["all_reduce"]()
        k = torch.tensor([max(1, min(4096, round(sample_s / max(time.perf_counter() - t0, 1e-7))))])
        dist.broadcast(k, 0)  # every rank must run as many
        k = int(k)
        total = torch.zeros(len(names), samples, dtype=torch.float64)
        outside = torch.zeros(len(names), samples, dtype=torch.float64)
        for i in range(samples):
            for j in range(len(names)):
                n = (i + j) % len(names)
                dist.barrier()
                ring.inside = 0.0
                t0 = time.perf_counter()
                for _ in range(k):
                    layers[names[n]]()
                total[n, i] = (time.perf_counter() - t0) / k
                outside[n, i] = total[n, i] - ring.inside / k
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        dist.all_reduce(outside, op=dist.ReduceOp.MAX)
        for n, name in enumerate(names):
            rows.append((size, k, name, statistics.median(total[n].tolist()),
                         statistics.median(outside[n].tolist())))
    if dist.get_rank() == 0:
        print(f"World {dist.get_world_size()}, {samples} samples of k operations, each the slowest rank's mean; "
              f"medians in µs; ratio: layer / ring; protection {os.environ.get('DIPHOMA_RING_PROTECTION') or 'none'}.\n")
        print(f"| bytes | k | layer | time (µs) | outside the ring (µs) | / ring |")
        print("|---|---|---|---|---|---|")
        floor = {size: tot for size, _, name, tot, _ in rows if name == "ring"}
        for size, k, name, tot, out in rows:
            print(f"| {size} | {k} | {name} | {tot * 1e6:.1f} | {out * 1e6:.1f} | {tot / floor[size]:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
