"""torch.distributed.checkpoint (DCP) on the "diphoma" backend, resharded: ``save DIR`` at any
world writes a model whose weight is a DTensor sharded by rows over a 1-D DeviceMesh, plus a
replicated tensor and a step; ``load DIR`` at another world reads it into a fresh sharding and
checks every shard against the full tensor it was made from. Prints "dcp ok" on rank 0."""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import diphoma.torch  # noqa: F401

mode, directory = sys.argv[1], sys.argv[2]
dist.init_process_group(backend="diphoma")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
full = torch.arange(12 * 5, dtype=torch.float32).view(12, 5) / 7  # the same on every rank
bias = torch.linspace(-1, 1, 9, dtype=torch.float64)
if mode == "save":
    state = {"weight": distribute_tensor(full, mesh, [Shard(0)]), "bias": bias, "step": torch.tensor(123)}
    dcp.save(state, checkpoint_id=directory)
else:
    state = {"weight": distribute_tensor(torch.zeros(12, 5), mesh, [Shard(0)]),
             "bias": torch.zeros(9, dtype=torch.float64), "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=directory)
    w = state["weight"]
    rows = 12 // world
    assert torch.equal(w.to_local(), full[rank * rows : (rank + 1) * rows]), (rank, w.to_local())
    assert torch.equal(w.full_tensor(), full)
    assert torch.equal(state["bias"], bias) and int(state["step"]) == 123
dist.barrier()
dist.destroy_process_group()
if rank == 0:
    print(f"dcp ok: {mode} at world {world}", flush=True)
