"""Rank 1 raises ZeroDivisionError; rank 0 raises TypeError 0.1 s later (the same second, most
often): the launcher must name rank 1, whose exception came first."""

import time

import torch
import torch.distributed as dist

import diphoma.torch  # noqa: F401

dist.init_process_group(backend="diphoma")
dist.all_reduce(torch.ones(3))
if dist.get_rank() == 0:
    time.sleep(0.1)
    raise TypeError("rank 0's later error")
raise ZeroDivisionError("rank 1's first error")
