"""PyTorch Lightning, unchanged: ``Trainer(strategy=DDPStrategy(process_group_backend=BACKEND))``
on CPU with a DistributedSampler Lightning inserts itself, started by ``python -m diphoma.run``
(Lightning sees torchrun's variables and lets the launcher own the processes). ``BACKEND`` is
argv[1] ("diphoma" or "gloo"); rank 0 saves the trained weights and the logged loss to argv[2]."""

import os
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy

import diphoma.torch  # noqa: F401  (registers the backend)

backend, out = sys.argv[1], sys.argv[2]


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True, reduce_fx="mean")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


g = torch.Generator().manual_seed(1)
x = torch.randn(256, 8, generator=g)
y = (x[:, :1] * 2 - x[:, 1:2]).tanh()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_epochs=3,
                     strategy=DDPStrategy(process_group_backend=backend), logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
model = Regression()
trainer.fit(model, loader)
assert torch.distributed.get_backend() == backend, torch.distributed.get_backend()
if trainer.global_rank == 0:
    torch.save({"state": model.state_dict(), "loss": float(trainer.callback_metrics["loss"])}, out)
    print(f"lightning ok: {backend} loss {float(trainer.callback_metrics['loss']):.6f}", flush=True)
