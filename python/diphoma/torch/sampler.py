"""``ElasticSampler``: the data order of a global batch that does not depend on the world size.

The rule of the Rust worker (``worker/src/train.rs``, ``data::shard``): step ``s`` trains the
global batch ``s`` of a seeded permutation of the data set (a new permutation each epoch), and
rank ``r`` of ``w`` takes the contiguous share ``[r·B/w, (r+1)·B/w)`` of it. Whatever the world
size when a step runs, the step sees the same samples; with a per-rank loss **summed** over the
share and scaled by ``sampler.scale`` (``w / B``), DDP's average of the ranks' gradients is the
mean gradient of the global batch, exactly as the worker's, even when ``w`` does not divide ``B``.
"""

import torch
import torch.distributed as dist

from diphoma import ConfigError


class ElasticSampler(torch.utils.data.Sampler):
    """A batch sampler for ``DataLoader(dataset, batch_sampler=sampler)``: each item is this
    rank's share of one global batch of ``global_batch`` samples out of ``length``.

    ``set_step(step)`` moves to step ``step`` (``state.step`` after a re-form); iterating
    yields the shares from there to the end of that epoch (``length // global_batch`` steps;
    the incomplete last batch is dropped). Rank and world are read from ``torch.distributed``
    when iteration starts.
    """

    def __init__(self, length, global_batch, seed=0):
        if global_batch < 1 or length < global_batch:
            raise ConfigError(f"ElasticSampler: global_batch {global_batch} must be in 1..=length {length}")
        self.length, self.global_batch, self.seed = length, global_batch, seed
        self.steps_per_epoch = length // global_batch
        self.step = 0

    def set_step(self, step):
        """The next iteration starts at global step ``step``."""
        self.step = int(step)

    @property
    def scale(self):
        """``world / global_batch``: multiply a loss summed over this rank's share by it."""
        return dist.get_world_size() / self.global_batch

    def order(self, epoch):
        """The permutation of epoch ``epoch`` (seeded by ``seed + epoch``)."""
        return torch.randperm(self.length, generator=torch.Generator().manual_seed(self.seed + epoch))

    def share(self, step, rank, world):
        """Indices of rank ``rank``'s share of global step ``step`` in a world of ``world``."""
        epoch, k = divmod(step, self.steps_per_epoch)
        batch = self.order(epoch)[k * self.global_batch : (k + 1) * self.global_batch]
        return batch[rank * self.global_batch // world : (rank + 1) * self.global_batch // world].tolist()

    def __iter__(self):
        rank, world = dist.get_rank(), dist.get_world_size()
        end = (self.step // self.steps_per_epoch + 1) * self.steps_per_epoch
        for s in range(self.step, end):
            self.step = s
            yield self.share(s, rank, world)

    def __len__(self):
        return self.steps_per_epoch - self.step % self.steps_per_epoch
