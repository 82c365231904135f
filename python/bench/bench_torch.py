"""One rank of ``make bench-torch`` (started by ``python -m diphoma.run``; see run.sh).

``ddp BACKEND MODEL STEPS OUT``: torchvision MODEL (resnet18, resnet50; 10 classes) under DDP
with BACKEND (gloo, diphoma), a batch of 2 synthetic 32×32 images per rank; after 2 warm-up
steps, STEPS timed steps with gradient allreduce and STEPS under ``no_sync()`` (the same
compute, no communication). Rank 0 appends one JSON line to OUT: the median step time with
and without communication; the communication share is 1 − no_sync / step.

``allreduce BACKEND OUT``: ``torch.distributed.all_reduce`` of float32 tensors of 1 KiB to 64
MiB (powers of 4); per size the median of a number of calls that fills about 0.5 s (at least
5); rank 0 appends one JSON line per size.
"""

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP

import diphoma.torch  # noqa: F401  registers "diphoma"


def timed(fn, n):
    out = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def ddp(model_name, steps, out):
    torch.manual_seed(0)
    model = DDP(getattr(torchvision.models, model_name)(num_classes=10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def local():
        with model.no_sync():
            step()

    timed(step, 2)
    with_comm, without = timed(step, steps), timed(local, steps)
    return {"kind": "ddp", "model": model_name, "step_s": with_comm, "compute_s": without,
            "comm_share": max(0.0, 1 - without / with_comm)}


def allreduce():
    rows = []
    for size in [1 << k for k in range(10, 27, 2)]:
        t = torch.ones(size // 4)
        dist.all_reduce(t)
        t0 = time.perf_counter()
        dist.all_reduce(t)
        n = torch.tensor([max(5, min(200, int(0.5 / max(time.perf_counter() - t0, 1e-6))))])
        dist.broadcast(n, 0)  # every rank must run as many: a rank's own estimate would hang
        n = int(n)
        rows.append({"kind": "allreduce", "bytes": size, "median_s": timed(lambda: dist.all_reduce(t), n)})
    return rows


def main():
    mode, backend = sys.argv[1], sys.argv[2]
    dist.init_process_group(backend=backend)
    rows = [ddp(sys.argv[3], int(sys.argv[4]), sys.argv[5])] if mode == "ddp" else allreduce()
    if dist.get_rank() == 0:
        with open(sys.argv[-1], "a") as f:
            for r in rows:
                f.write(json.dumps({**r, "backend": backend, "world": dist.get_world_size()}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
