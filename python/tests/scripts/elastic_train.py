"""An elastic DDP training script: a seeded MLP on a fixed synthetic data set, global batch 24
through diphoma.torch.ElasticSampler, SGD with momentum, a commit every step, progress through
diphoma.report. Usage (under ``python -m diphoma.run --elastic``): elastic_train.py OUT STEPS.

Each process writes OUT/<member>.json (<pod>.<local rank>.json in a pod of several) after every commit (its pid, step, generation, world,
the generation it first joined) so that the test can kill one mid-run and check that the others
kept their process; rank 0 of the last generation saves the parameters to OUT/params.pt."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import diphoma
import diphoma.torch
from diphoma.torch import elastic

GLOBAL_BATCH = 24
# A test's mistake on one member (test_elastic.py): its float32 all-reduces go as bfloat16, so
# its frames differ from its peers' in size.
COMPRESSED = os.environ.get("COMPRESSED_MEMBER")
if COMPRESSED and COMPRESSED == os.environ.get("DIPHOMA_POD_NAME"):
    os.environ["DIPHOMA_COMPRESSION"] = "bf16"


def model_and_data():
    """The model (seeded) and the data set, the same in every process and in the test."""
    torch.manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    )
    g = torch.Generator().manual_seed(99)
    data = torch.utils.data.TensorDataset(torch.randn(480, 16, generator=g), torch.randn(480, 4, generator=g))
    return model, data


def optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def main(out, steps):
    name = os.environ["DIPHOMA_POD_NAME"]
    if os.environ.get("DIPHOMA_PROCESSES_PER_WORKER", "1") != "1":  # a pod of several processes
        name += f".{os.environ['DIPHOMA_LOCAL_RANK']}"
    record = {"pid": os.getpid(), "first_generation": None}
    model, data = model_and_data()
    sampler = diphoma.torch.ElasticSampler(len(data), GLOBAL_BATCH, seed=7, reduction="sum")
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    state = elastic.State(model=model, optimizer=optimizer(model))

    @elastic.run
    def train(state):
        ddp = DDP(state.model)
        gen = dist.distributed_c10d._get_default_group().ring.generation
        record["first_generation"] = record["first_generation"] or gen
        while state.step < steps:
            sampler.set_step(state.step)
            for x, y in loader:
                state.optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(ddp(x), y, reduction="sum") * sampler.scale
                loss.backward()
                state.optimizer.step()
                state.step += 1
                diphoma.report(step=state.step, total_steps=steps, loss=loss.item(), samples=GLOBAL_BATCH)
                state.commit()
                record.update(step=state.step, generation=gen, world=dist.get_world_size())
                with open(os.path.join(out, f"{name}.json.tmp"), "w") as f:
                    json.dump(record, f)
                os.rename(os.path.join(out, f"{name}.json.tmp"), os.path.join(out, f"{name}.json"))
                time.sleep(0.02)  # pacing, so that the test's kill lands mid-run
                if state.step >= steps:
                    break
        params = torch.cat([p.detach().reshape(-1) for p in state.model.parameters()])
        gathered = [torch.empty_like(params) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, params)
        assert all(torch.equal(gathered[0], g) for g in gathered), "ranks disagree"
        if dist.get_rank() == 0:
            torch.save(params, os.path.join(out, "params.pt"))
            x, y = data.tensors
            with torch.no_grad():
                accuracy = (state.model(x).argmax(1) == y.argmax(1)).float().mean().item()
            diphoma.report(test_accuracy=accuracy)
        return params

    train(state)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
