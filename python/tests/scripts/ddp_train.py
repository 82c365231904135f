"""A plain seeded DDP training script (the only Diphoma line is the import): K steps of SGD on a
small MLP with a fixed global batch, one gradient-accumulation step under ``no_sync``, then rank
0 saves the parameters. Usage: ddp_train.py BACKEND STEPS OUT.pt; with ``DDP_COMM_HOOK=bf16`` the
gradients are averaged through DDP's ``bf16_compress_hook``."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import diphoma.torch  # noqa: F401  registers the "diphoma" backend

backend, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group(backend=backend)
rank, world = dist.get_rank(), dist.get_world_size()
assert dist.get_backend() == backend, dist.get_backend()

torch.manual_seed(1234 + rank)  # different initial weights per rank: DDP must broadcast rank 0's
model = torch.nn.Sequential(
    torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)
)
ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets: allreduce overlaps backward
if os.environ.get("DDP_COMM_HOOK") == "bf16":  # DDP's own gradient compression
    ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
data = torch.Generator().manual_seed(99)
global_batch = 16
for step in range(steps):
    x = torch.randn(global_batch, 32, generator=data)
    y = torch.randn(global_batch, 4, generator=data)
    mine = slice(rank * global_batch // world, (rank + 1) * global_batch // world)
    half = (mine.stop - mine.start) // 2
    opt.zero_grad()
    with ddp.no_sync():  # first half of the local batch: gradients accumulate without a collective
        torch.nn.functional.mse_loss(ddp(x[mine][:half]), y[mine][:half]).backward()
    torch.nn.functional.mse_loss(ddp(x[mine][half:]), y[mine][half:]).backward()
    opt.step()

params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
gathered = [torch.empty_like(params) for _ in range(world)]
dist.all_gather(gathered, params)
assert all(torch.equal(gathered[0], g) for g in gathered), "ranks disagree"
dist.barrier()
if rank == 0:
    torch.save(params, out)
dist.destroy_process_group()
