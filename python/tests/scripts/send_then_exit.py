"""Rank 0 (which hosts torch's store) sends a non-contiguous tensor to rank 1 and leaves at once
(destroy_process_group, exit): the message must still arrive, with the view's elements.
Rank 1 prints what it received."""

import torch
import torch.distributed as dist

import diphoma.torch  # noqa: F401

dist.init_process_group(backend="diphoma")
view = torch.arange(12.0).reshape(3, 4)[:, 1]  # [1, 5, 9], stride 4
if dist.get_rank() == 0:
    dist.send(view, dst=1)
else:
    got = torch.empty(3)
    dist.recv(got, src=0)
    print(f"received {got.tolist()}", flush=True)
dist.destroy_process_group()
