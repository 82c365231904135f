"""A DDP script written as PyTorch's own torchrun tutorial writes it (``multigpu_torchrun.py``):
it reads LOCAL_RANK from the environment, joins with ``init_process_group`` through env://,
shards with a DistributedSampler, and rank 0 saves a snapshot every epoch that every rank loads
when it starts; changed only in its backend name ("diphoma") and device (CPU).

``python torchrun_ddp.py EPOCHS SNAPSHOT [FAIL_EPOCH]``: with FAIL_EPOCH, rank 1 of the first
attempt (TORCHELASTIC_RESTART_COUNT 0) dies with os._exit(1) at the start of that epoch, so a
launcher run with --max-restarts resumes from the snapshot. Rank 0 prints the final loss.
EPOCH_SECONDS (default 0) paces the epochs, for tests that stop a worker while it trains."""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import diphoma.torch  # noqa: F401  (registers the backend)


def ddp_setup():
    dist.init_process_group(backend="diphoma")


class Trainer:
    def __init__(self, model, train_data, optimizer, snapshot_path):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print(f"rank {self.global_rank}: loading snapshot", flush=True)
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"rank {self.global_rank}: Resuming training from snapshot at Epoch {self.epochs_run}", flush=True)

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self.optimizer.zero_grad()
            loss = F.mse_loss(self.model(source), targets)
            loss.backward()
            self.optimizer.step()
        return loss.item()

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "OPTIMIZER_STATE": self.optimizer.state_dict(),
                    "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path + ".tmp")
        os.replace(self.snapshot_path + ".tmp", self.snapshot_path)

    def train(self, max_epochs, fail_epoch):
        loss = float("nan")
        for epoch in range(self.epochs_run, max_epochs):
            if epoch == fail_epoch and self.global_rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
                print("rank 1: dying", flush=True)
                os._exit(1)
            loss = self._run_epoch(epoch)
            time.sleep(float(os.environ.get("EPOCH_SECONDS", "0")))
            dist.barrier()
            if self.global_rank == 0:
                self._save_snapshot(epoch + 1)
        return loss


def main(total_epochs, snapshot_path, fail_epoch):
    ddp_setup()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 20), torch.randn(256, 1))
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    loader = DataLoader(data, batch_size=32, shuffle=False, sampler=DistributedSampler(data))
    loss = Trainer(model, loader, optimizer, snapshot_path).train(total_epochs, fail_epoch)
    if dist.get_rank() == 0:
        print(f"trained: epochs {total_epochs} loss {loss:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else -1)
