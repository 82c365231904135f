"""Rank 1 leaves right after the group forms; rank 0 runs a DDP backward, whose gradient
allreduce fails (peer lost). The interpreter must not crash: backward returns, and the next
collective raises diphoma.RingChanged, which rank 0 prints. Usage: ddp_peer_lost.py"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import diphoma
import diphoma.torch  # noqa: F401

dist.init_process_group(backend="diphoma", timeout=__import__("datetime").timedelta(seconds=20))
model = DDP(torch.nn.Linear(8, 8))
if dist.get_rank() == 1:
    os._exit(0)  # gone without a word: its sockets close
model(torch.ones(4, 8)).sum().backward()
try:
    dist.all_reduce(torch.ones(2))
except diphoma.RingChanged as e:
    print(f"RingChanged: {e}", flush=True)
    os._exit(0)
os._exit(1)
