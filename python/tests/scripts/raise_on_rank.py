"""A torchrun-style script: every rank joins the "diphoma" group through env://, all-reduces once,
then rank argv[1] raises ValueError (the others wait in a barrier the launcher must break)."""

import os
import sys

import torch
import torch.distributed as dist

import diphoma.torch  # noqa: F401

dist.init_process_group(backend="diphoma")
t = torch.ones(2)
dist.all_reduce(t)
print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} "
      f"restart {os.environ['TORCHELASTIC_RESTART_COUNT']} run {os.environ['TORCHELASTIC_RUN_ID']}", flush=True)
if dist.get_rank() == int(sys.argv[1]):
    raise ValueError(f"bad batch on rank {dist.get_rank()}")
dist.barrier()
