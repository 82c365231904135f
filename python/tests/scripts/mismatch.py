"""Rank 0 all-reduces 4 elements, rank 1 five: the script's mistake. Each rank prints the
exception class and message it got (CollectiveMismatch, not RingChanged), then what the next
collective raises; exits 0."""

import torch
import torch.distributed as dist

import diphoma
import diphoma.torch  # noqa: F401

dist.init_process_group(backend="diphoma")
rank = dist.get_rank()
for attempt in ("first", "next"):
    try:
        dist.all_reduce(torch.ones(4 + rank))
        print(f"rank {rank}: {attempt}: no error", flush=True)
    except diphoma.RingError as e:
        print(f"rank {rank}: {attempt}: {type(e).__name__}: {e}", flush=True)
