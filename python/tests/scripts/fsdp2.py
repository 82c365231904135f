"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on CPU over backend argv[1] ("diphoma" or
"gloo"): a small MLP sharded per layer, 5 SGD steps on fixed data; rank 0 saves the full
parameters (gathered) and the losses to argv[2]."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import diphoma.torch  # noqa: F401

backend, out = sys.argv[1], sys.argv[2]
dist.init_process_group(backend=backend)
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1 + rank)
x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
losses = []
for _ in range(5):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
full = {k: v.full_tensor() for k, v in model.state_dict().items()}
if rank == 0:
    torch.save({"state": full, "losses": losses}, out)
    print(f"fsdp2 ok: {backend} losses {losses}", flush=True)
dist.destroy_process_group()
