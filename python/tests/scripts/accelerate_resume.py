"""Hugging Face Accelerate owning the loop, restarted as torchrun (and the in-pod launcher)
restart a script: its own ``accelerator.save_state(dir)`` commits every 3 steps (the model, the
optimizer and a step counter registered with ``register_for_checkpointing``) and
``load_state(dir)`` with ``skip_first_batches`` restores, so a restarted run resumes where the
last checkpoint was and ends with the weights of a run that never failed.

``ACCELERATE_USE_CPU=1 python -m diphoma.run --nproc 2 --backend diphoma [--max-restarts 1]
accelerate_resume.py CKPT_DIR die|live``: with ``die``, rank 1 of the first attempt
(TORCHELASTIC_RESTART_COUNT 0) dies with os._exit(1) at step 7 of 12. Rank 0 prints the step each
attempt starts at and, at the end, the step and the weights' sum."""

import os
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator

import diphoma.torch  # noqa: F401  (registers the backend)

ckpt_dir, mode = sys.argv[1], sys.argv[2]
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
STEPS, EVERY = 12, 3


class Step:
    """The step counter, saved and restored with the state."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, d):
        self.n = d["n"]


accelerator = Accelerator(cpu=True)
assert dist.get_backend() == "diphoma", dist.get_backend()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(1)
x = torch.randn(256, 8, generator=g)
y = (x[:, :1] * 2 - x[:, 1:2]).tanh()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
step = Step()
accelerator.register_for_checkpointing(step)
if os.path.exists(os.path.join(ckpt_dir, "model.safetensors")):
    accelerator.load_state(ckpt_dir)
if accelerator.is_main_process:
    print(f"start at step {step.n} restart {restart}", flush=True)
while step.n < STEPS:
    per_epoch = len(loader)
    batches = accelerator.skip_first_batches(loader, step.n % per_epoch)
    for xb, yb in batches:
        if mode == "die" and accelerator.process_index == 1 and restart == "0" and step.n == 7:
            print("rank 1: dying", flush=True)
            os._exit(1)
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step.n += 1
        if step.n % EVERY == 0:
            accelerator.save_state(ckpt_dir)
        if step.n == STEPS:
            break
if accelerator.is_main_process:
    total = sum(p.detach().double().sum().item() for p in accelerator.unwrap_model(model).parameters())
    print(f"done at step {step.n} weights {total:.10f}", flush=True)
