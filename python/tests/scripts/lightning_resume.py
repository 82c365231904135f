"""PyTorch Lightning owning the loop, restarted as torchrun (and the in-pod launcher) restart
a script: its own ``ModelCheckpoint(save_last=True)`` commits every 3 steps and
``fit(ckpt_path="last")`` restores, so a restarted run resumes where the last checkpoint was.

``python -m diphoma.run --nproc 2 --max-restarts 1 lightning_resume.py CKPT_DIR``: rank 1 of
the first attempt (TORCHELASTIC_RESTART_COUNT 0) dies with os._exit(1) at step 7 of 12. Rank 0
prints the step each attempt starts at and the step it ends at."""

import os
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy

import diphoma.torch  # noqa: F401  (registers the backend)

ckpt_dir = sys.argv[1]
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def on_train_start(self):
        if self.global_rank == 0:
            print(f"start at step {self.trainer.global_step} restart {restart}", flush=True)

    def training_step(self, batch, _):
        if self.global_rank == 1 and restart == "0" and self.trainer.global_step == 7:
            print("rank 1: dying", flush=True)
            os._exit(1)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


g = torch.Generator().manual_seed(1)
x = torch.randn(256, 8, generator=g)
y = (x[:, :1] * 2 - x[:, 1:2]).tanh()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
checkpoints = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_last=True, save_top_k=-1)
trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=12,
                     strategy=DDPStrategy(process_group_backend="diphoma"), logger=False, callbacks=[checkpoints],
                     enable_progress_bar=False, enable_model_summary=False)
last = os.path.join(ckpt_dir, "last.ckpt")
trainer.fit(Regression(), loader, ckpt_path=last if os.path.exists(last) else None)
if trainer.global_rank == 0:
    print(f"done at step {trainer.global_step}", flush=True)
