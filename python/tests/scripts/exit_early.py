"""Rank 1 leaves with sys.exit(3) before a collective the others run: the launcher must name
rank 1 (exit 3) as the root cause, not a rank whose ring lost it."""

import sys

import torch
import torch.distributed as dist

import diphoma.torch  # noqa: F401

dist.init_process_group(backend="diphoma")
if dist.get_rank() == 1:
    sys.exit(3)
dist.all_reduce(torch.ones(3))
