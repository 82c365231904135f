"""Runs one of Hugging Face Accelerate's packaged distributed test scripts unchanged
(``accelerate.test_utils.scripts.MODULE``, argv[1]) under ``python -m diphoma.run --backend
diphoma``, and checks that the "diphoma" group carried its collectives: the default group is
diphoma's when the script starts, and the group ran at least one collective by the end (counted
here, around the group's submit). Prints "accelerate ok: MODULE N collectives" on rank 0."""

import runpy
import sys

import torch.distributed as dist

import diphoma.torch as backend

assert dist.is_initialized() and dist.get_backend() == "diphoma", "start with diphoma.run --backend diphoma"
rank = dist.get_rank()
count = [0]
submit = backend.ProcessGroupDiphoma._submit


def counted(self, *args, **kwargs):
    count[0] += 1
    return submit(self, *args, **kwargs)


backend.ProcessGroupDiphoma._submit = counted
module = f"accelerate.test_utils.scripts.{sys.argv[1]}"
sys.argv = [module]
runpy.run_module(module, run_name="__main__", alter_sys=True)
assert count[0] > 0, "no collective ran on the diphoma group"
if rank == 0:
    print(f"accelerate ok: {module} {count[0]} collectives", flush=True)
