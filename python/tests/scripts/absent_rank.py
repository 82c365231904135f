"""Rank 2 of 3 never calls the second all_reduce (it sleeps past the others' timeout, then
exits 0): ranks 0 and 1 are told within DIPHOMA_DETECTION_SECONDS which rank they wait for (a
warning of the ``diphoma`` logger on stderr), and their collective's error at
init_process_group's timeout (6 s) names it. Each rank prints what it got; exits 0."""

import time
from datetime import timedelta

import torch
import torch.distributed as dist

import diphoma
import diphoma.torch  # noqa: F401

dist.init_process_group(backend="diphoma", timeout=timedelta(seconds=6))
rank = dist.get_rank()
dist.all_reduce(torch.ones(4))  # every rank is in the ring
if rank == 2:
    time.sleep(12)
    print("rank 2: left without calling it", flush=True)
else:
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        print(f"rank {rank}: no error", flush=True)
    except diphoma.RingError as e:
        print(f"rank {rank}: after {time.monotonic() - t0:.0f} s: {type(e).__name__}: {e}", flush=True)
