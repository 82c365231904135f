"""Elastic DDP training with speed-weighted shares (``diphoma.torch.ElasticSampler``): a seeded
MLP on a fixed synthetic data set, global batch 64, SGD, a commit every step. Usage (under
``python -m diphoma.run --elastic``): balance_train.py OUT STEPS.

Environment (all optional):
- ``BALANCE_CPUS``: ``c0,c1,…``: member ``local-i`` pins itself (and every thread it starts
  later) to CPU ``cᵢ`` before importing torch.
- ``BALANCE_EXTRA``: ``i:k``: member ``local-i`` computes ``k`` extra forward passes of its
  share per step (real compute, results discarded): a rank ``k+1``-ish times slower per sample.
- ``BALANCE_WIDTH``: hidden width (default 64).
- ``BALANCE_PACE``: seconds to sleep after each commit (default 0), so a test's kill lands
  mid-run.
- ``DIPHOMA_SPEED_WEIGHTED``, ``DIPHOMA_BALANCE_EVERY``: the sampler's switches.

Each process writes OUT/<member>.json after every commit (pid, step, generation, world, rank,
the shares and rates of the step, the generation it first joined); rank 0 of the last
generation saves the parameters to OUT/params.pt."""

import os
import sys

NAME = os.environ.get("DIPHOMA_POD_NAME", "local-0")  # imported by the test: no member
INDEX = int(NAME.rsplit("-", 1)[1])
if os.environ.get("BALANCE_CPUS"):
    cpus = [int(c) for c in os.environ["BALANCE_CPUS"].split(",")]
    os.sched_setaffinity(0, {cpus[INDEX % len(cpus)]})

import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import diphoma  # noqa: E402
import diphoma.torch  # noqa: E402
from diphoma.torch import elastic  # noqa: E402

GLOBAL_BATCH = 64
WIDTH = int(os.environ.get("BALANCE_WIDTH", "64"))


def model_and_data(width=WIDTH):
    """The model (seeded, hidden width ``width``) and the data set, the same in every process
    and in the test."""
    torch.manual_seed(4321)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 4)
    )
    g = torch.Generator().manual_seed(77)
    data = torch.utils.data.TensorDataset(torch.randn(1280, 16, generator=g), torch.randn(1280, 4, generator=g))
    return model, data


def optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.05)


def extra_passes():
    raw = os.environ.get("BALANCE_EXTRA", "")
    if not raw:
        return 0
    who, k = raw.split(":")
    return int(k) if int(who) == INDEX else 0


def main(out, steps):
    torch.set_num_threads(1)
    record = {"pid": os.getpid(), "first_generation": None}
    model, data = model_and_data()
    # BALANCE_LOSS=mean: the sampler's default and a mean loss, as most scripts write it.
    reduction = os.environ.get("BALANCE_LOSS", "sum")
    kwargs = {"reduction": "sum"} if reduction == "sum" else {}
    sampler = diphoma.torch.ElasticSampler(len(data), GLOBAL_BATCH, seed=11, **kwargs)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    state = elastic.State(model=model, optimizer=optimizer(model))
    extra, pace = extra_passes(), float(os.environ.get("BALANCE_PACE", "0"))

    def write():
        with open(os.path.join(out, f"{NAME}.json.tmp"), "w") as f:
            json.dump(record, f)
        os.rename(os.path.join(out, f"{NAME}.json.tmp"), os.path.join(out, f"{NAME}.json"))

    @elastic.run
    def train(state):
        ddp = DDP(state.model)
        gen = dist.distributed_c10d._get_default_group().ring.generation
        record["first_generation"] = record["first_generation"] or gen
        while state.step < steps:
            sampler.set_step(state.step)
            for x, y in loader:
                # This rank's share of the current split; a mean loss would take mean_scale.
                world = dist.get_world_size()
                assert len(x) == sampler.shares[dist.get_rank()], (len(x), sampler.shares)
                assert abs(sampler.mean_scale - len(x) * world / GLOBAL_BATCH) < 1e-12
                with torch.no_grad():
                    for _ in range(extra):
                        state.model(x)
                state.optimizer.zero_grad()
                per_sample = torch.nn.functional.mse_loss(ddp(x), y, reduction="none").sum(1)
                if reduction == "sum":
                    loss = per_sample.sum() * sampler.scale
                else:  # a mean over this rank's share
                    loss = per_sample.mean()
                loss.backward()
                state.optimizer.step()
                state.step += 1
                diphoma.report(step=state.step, total_steps=steps, loss=loss.item(), samples=GLOBAL_BATCH)
                state.commit()
                record.update(step=state.step, generation=gen, world=dist.get_world_size(), rank=dist.get_rank(),
                              shares=list(sampler.shares), rates=list(sampler.rates))
                write()
                if pace:
                    time.sleep(pace)
                if state.step >= steps:
                    break
        params = torch.cat([p.detach().reshape(-1) for p in state.model.parameters()])
        gathered = [torch.empty_like(params) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, params)
        assert all(torch.equal(gathered[0], g) for g in gathered), "ranks disagree"
        if dist.get_rank() == 0:
            torch.save(params, os.path.join(out, "params.pt"))
            diphoma.report(test_accuracy=0.5)
        return params

    train(state)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
