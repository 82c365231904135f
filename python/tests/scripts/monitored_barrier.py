"""monitored_barrier names who is missing: at world 3, rank 2 never calls it. Rank 0 raises
naming rank 2 (with wait_all_ranks), rank 1 raises because rank 0 never releases it. Each rank
prints what it saw; the launcher's exit status is 0 when each saw what it should."""

import datetime
import sys

import torch.distributed as dist

import diphoma.torch  # noqa: F401

dist.init_process_group(backend="diphoma")
rank = dist.get_rank()
dist.monitored_barrier(timeout=datetime.timedelta(seconds=20))  # all present: passes
if rank == 2:
    dist.barrier()  # the ring's barrier, after the others gave up on the monitored one
    sys.exit(0)
try:
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=2), wait_all_ranks=True)
    print(f"rank {rank}: passed", flush=True)
    sys.exit(1)
except RuntimeError as e:
    print(f"rank {rank}: {e}", flush=True)
dist.barrier()
