"""Prints what float32 all-reduces give under the environment's ``DIPHOMA_COMPRESSION``: each
rank contributes 1 + 2⁻¹⁰ (exact in float32, 1.0 once rounded to bfloat16's 8 bits of mantissa),
so the SUM and AVG say which dtype crossed the wire; MAX and a float64 SUM never compress."""

import torch
import torch.distributed as dist

import diphoma.torch  # noqa: F401  registers the "diphoma" backend

dist.init_process_group(backend="diphoma")
world = dist.get_world_size()
x = 1 + 2**-10
got = {}
for name, dtype, op in [("sum", torch.float32, dist.ReduceOp.SUM), ("avg", torch.float32, dist.ReduceOp.AVG),
                        ("max", torch.float32, dist.ReduceOp.MAX), ("sum64", torch.float64, dist.ReduceOp.SUM)]:
    t = torch.full((1000,), x, dtype=dtype)
    dist.all_reduce(t, op=op)
    assert torch.all(t == t[0]), name
    got[name] = t[0].item()
if dist.get_rank() == 0:
    print("reduced", repr(got), flush=True)
dist.destroy_process_group()
