"""``ElasticSampler``: the data order of a global batch that does not depend on the world size,
split over the ranks in proportion to their measured speeds.

The rule of the Rust worker (``worker/src/train.rs``): step ``s`` trains the global batch ``s``
of a seeded permutation of the data set (a new permutation each epoch), and the ranks take
consecutive shares of it, rank ``r`` the samples ``[n₀+…+nᵣ₋₁, n₀+…+nᵣ)``. The shares ``nᵣ``
come from the contract's ``split`` (``diphoma.split``, the Rust worker's own function, through
the binding): proportional to the ranks' speeds when speed-weighted, else equal (the lower ranks
take the remainder). Whatever the world size and the split when a step runs, the step sees the
same samples.

**A mean loss is right by default.** ``ElasticSampler(..., reduction="mean")`` (the default,
as a torch loss's own ``reduction``) keeps the shares equal, whatever ``spec.balance`` asks
(``DIPHOMA_SPEED_WEIGHTED`` in a pod; a ``speed_weighted=True`` argument is refused with what
to do): DDP's average of the ranks' mean gradients ``(1/w)·Σᵣ (1/nᵣ)·Σ_{i∈shareᵣ} ∇ℓᵢ`` is
the global batch's mean gradient only when every ``nᵣ`` is ``B/w`` (when ``w`` does not
divide ``B``, the lower ranks' shares are one sample larger, a weight within ``1/nᵣ`` of
equal, as with ``DistributedSampler``'s padding). With speed-weighted shares a mean loss
would silently weigh a slow rank's samples more, so they need ``reduction="sum"``: each rank's
loss **summed** over its share and multiplied by ``sampler.scale`` (``w / B``, the same on
every rank), whose DDP average ``(1/w)·Σᵣ (w/B)·Σ_{i∈shareᵣ} ∇ℓᵢ = (1/B)·Σᵢ ∇ℓᵢ`` is the
mean gradient of the global batch whatever the shares ``nᵣ`` (they only regroup the sum). (A
mean over an unequal share times ``sampler.mean_scale``, ``nᵣ·w / B`` per rank, is the same.)

**Speed-weighted shares** (with ``reduction="sum"``: on by default, as
``spec.balance.speedWeighted``; in a worker pod the operator's ``DIPHOMA_SPEED_WEIGHTED`` and
``DIPHOMA_BALANCE_EVERY`` decide, as for the Rust worker). Each rank measures its compute time per sample and keeps the Rust worker's smoothed
estimate (``diphoma.Speed``, an exponential moving average of weight 0.3):

- A step runs from the sampler handing out a share to being asked for the next one (the
  training loop's body). Its *compute* time runs from the share handed out to the step's last
  submission of a collective, less the time the process waited for the ring before that
  submission. The diphoma process group records both (``CollectiveTime``): a wait is counted
  per burst of collectives (from a submission into its empty queue until the queue is empty
  again), from the burst's last submission to its end.
- With DDP this is the Rust worker's measure, the compute of the share (loading, forward,
  backward): the gradient buckets are submitted during backward and reduced while it goes on,
  the last one when backward ends, and the training thread first waits after it (a fast rank
  waits there for the slow one). Nothing that costs the same whatever the share (the
  optimizer, a commit) is counted, so a rank's rate does not fall with its share (which would
  feed back into the split). A blocking collective after backward (``dist.all_reduce`` of a
  logged loss) becomes the last submission: the optimizer work before it then counts, the
  DDP wait before it does not. On the slowest rank, a bucket reduced before the next one is
  submitted counts as a wait although backward went on meanwhile: its compute time is
  underestimated by up to its buckets' ring time (small when compute dominates the step).
  A step without any collective (``no_sync``) counts its wall time less its waits.
- The first step of each process group is not measured (it holds DDP's lazy set-up).
- Every ``balance_every`` steps (at steps that are multiples of it) and at the first step of
  every process group (a ring change), the ranks exchange their rates with one small
  collective: an ``all_reduce`` of a ``world``-long float64 vector, each rank's rate in its own
  slot and zeros elsewhere (so the sum is exact and the same on every rank), issued from the
  sampler when the next share is asked for, a point that is the same on every rank. Every rank
  then derives the same split. A rank that has not measured itself yet (a joiner) counts as the
  mean of the others (``split``'s rule): after a ring change the survivors keep their measured
  speeds and the joiners start at the mean.
- Only the diphoma backend counts waits: with another backend (gloo) the shares stay equal and
  nothing is exchanged.
- With ``DataLoader(num_workers > 0)`` the loader asks for shares ahead by its prefetch depth:
  the exchanges still happen at the same point on every rank, and in steady state one share is
  asked for per training step, so each measured interval is still one step (timed against the
  size of the share asked for, which differs only around a re-split).
- This rank's share is the ``diphoma_worker_batch_share`` gauge (``diphoma.metrics``), as the
  Rust worker's.

The split reaches the job's status as the Rust worker's does: rank 0's progress records carry
every rank's share (``status.progress.minBatchShare``/``maxBatchShare``).
"""

import logging
import os
import threading
import time

import torch
import torch.distributed as dist

import diphoma
from diphoma import ConfigError, metrics
from diphoma._native import DEFAULT_BALANCE_EVERY, ENV_BALANCE_EVERY, ENV_SPEED_WEIGHTED, Speed, split


_log = logging.getLogger("diphoma")


class CollectiveTime:
    """When a process group's caller submitted collectives and how long it may have waited for
    them. Waits are counted per burst of collectives (from a submission into an empty queue
    until the queue is empty again): the time from the burst's last submission to the end of
    its last collective, added to a running total (seconds). ``submitted()`` is called by the
    submitting thread, ``completed()`` by the group's thread after each collective."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending = 0
        self._last_submit = 0.0
        self._total_at_submit = 0.0
        self._total = 0.0

    def submitted(self):
        with self._lock:
            self._pending += 1
            self._last_submit = time.monotonic()
            self._total_at_submit = self._total

    def last_submit(self):
        """``(time.monotonic()`` of the last submission, the wait total when it was made``)``
        (no wait can end between a burst's submissions, so that total is every wait that
        ended before it)."""
        with self._lock:
            return self._last_submit, self._total_at_submit

    def completed(self):
        with self._lock:
            self._pending -= 1
            if self._pending == 0:
                self._total += time.monotonic() - self._last_submit

    def total(self):
        """Seconds of waits so far (bursts still running are not counted yet)."""
        with self._lock:
            return self._total


def _env_speed_weighted():
    raw = os.environ.get(ENV_SPEED_WEIGHTED)
    if raw is None or raw == "":
        return True
    if raw not in ("true", "false"):
        raise ConfigError(f"environment variable {ENV_SPEED_WEIGHTED}: {raw!r} is not true or false")
    return raw == "true"


def speed_weighting(reduction, speed_weighted, configured):
    """Whether a sampler splits by speed (pure): ``reduction`` is how the script reduces its
    loss over its share (``"mean"`` or ``"sum"``), ``speed_weighted`` the argument (None: not
    given), ``configured`` what ``spec.balance`` / ``DIPHOMA_SPEED_WEIGHTED`` asks. A mean
    loss keeps equal shares (the only ones under which DDP's average of means is the batch's
    mean). Raises ``ConfigError`` for another ``reduction``, or for ``speed_weighted=True``
    with a mean loss, saying what to write instead."""
    if reduction not in ("mean", "sum"):
        raise ConfigError(f"ElasticSampler: reduction {reduction!r} is not 'mean' or 'sum'")
    if reduction == "sum":
        return configured if speed_weighted is None else bool(speed_weighted)
    if speed_weighted:
        raise ConfigError(
            "ElasticSampler: speed_weighted=True needs reduction='sum': sum the loss over this rank's share and "
            "multiply it by sampler.scale (a mean loss over unequal shares weighs a slow rank's samples more)"
        )
    return False


def _env_balance_every():
    raw = os.environ.get(ENV_BALANCE_EVERY)
    if raw is None or raw == "":
        return DEFAULT_BALANCE_EVERY
    try:
        every = int(raw)
    except ValueError:
        every = 0
    if every < 1:
        raise ConfigError(f"environment variable {ENV_BALANCE_EVERY}: {raw!r} is not a whole number ≥ 1")
    return every


def _compute_time(blocked, t0, b0):
    """The compute time of a step that started at ``t0`` with the group's wait total at
    ``b0``: until its last submission less the waits that ended before that; a step without a
    collective (``no_sync``): its wall time less its waits."""
    last, waited = blocked.last_submit()
    if last > t0:
        return last - t0 - (waited - b0)
    return time.monotonic() - t0 - (blocked.total() - b0)


def _default_group():
    return dist.distributed_c10d._get_default_group()


class ElasticSampler(torch.utils.data.Sampler):
    """A batch sampler for ``DataLoader(dataset, batch_sampler=sampler)``: each item is this
    rank's share of one global batch of ``global_batch`` samples out of ``length`` (see the
    module doc for the order, the shares and the loss rule).

    ``set_step(step)`` moves to step ``step`` (``state.step`` after a re-form); iterating
    yields the shares from there to the end of that epoch (``length // global_batch`` steps;
    the incomplete last batch is dropped). Rank, world and process group are read from
    ``torch.distributed`` when iteration starts.

    ``reduction`` says how the script reduces its loss over its share, as a torch loss's own
    argument: ``"mean"`` (default) keeps the shares equal, so DDP's average is the global
    batch's mean gradient; ``"sum"`` (the loss summed, then multiplied by ``scale``) allows
    speed-weighted shares. ``speed_weighted`` (with ``"sum"``; default:
    ``DIPHOMA_SPEED_WEIGHTED``, ``true`` when unset) splits each global batch in proportion to
    the ranks' measured speeds, re-split every ``balance_every`` steps (default:
    ``DIPHOMA_BALANCE_EVERY``, 10 when unset); the same values must be given on every rank.
    Attributes: ``shares`` (every rank's share of the current step, in rank order), ``rates``
    (the rates, samples/s, of the last exchange; 0.0 for a rank not yet measured), ``speed``
    (this rank's ``diphoma.Speed``).

    Raises ``ConfigError`` for a ``global_batch`` outside ``1..=length``, a ``balance_every``
    below 1, a ``reduction`` other than ``"mean"``/``"sum"``, ``speed_weighted=True`` with
    ``"mean"``, or a malformed environment variable (named).
    """

    def __init__(self, length, global_batch, seed=0, speed_weighted=None, balance_every=None, reduction="mean"):
        if global_batch < 1 or length < global_batch:
            raise ConfigError(f"ElasticSampler: global_batch {global_batch} must be in 1..=length {length}")
        self.length, self.global_batch, self.seed = length, global_batch, seed
        self.steps_per_epoch = length // global_batch
        self.step = 0
        configured = _env_speed_weighted()
        self.reduction = reduction
        self.speed_weighted = speed_weighting(reduction, speed_weighted, configured)
        if configured and speed_weighted is None and not self.speed_weighted:
            _log.info("ElasticSampler: equal shares for a mean loss; for speed-weighted shares pass "
                      "reduction='sum' and multiply the summed loss by sampler.scale")
        self.balance_every = _env_balance_every() if balance_every is None else int(balance_every)
        if self.balance_every < 1:
            raise ConfigError(f"ElasticSampler: balance_every {balance_every} must be at least 1")
        self.speed = Speed()
        self.rates = []
        self.shares = []
        self._group = None  # the process group the shares were derived in
        self._exchanged = None  # the step before which the rates were exchanged last

    def set_step(self, step):
        """The next iteration starts at global step ``step``."""
        self.step = int(step)

    @property
    def scale(self):
        """``world / global_batch``, the same on every rank whatever the shares: multiply a
        loss **summed** over this rank's share by it (DDP's average of the gradients is then
        the global batch's mean gradient)."""
        return dist.get_world_size() / self.global_batch

    @property
    def mean_scale(self):
        """``share · world / global_batch`` for this rank's share of the current step: multiply
        a loss that is a **mean** over the share by it (per rank; it changes with the split)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        shares = self.shares if len(self.shares) == world else split(self.global_batch, [1.0] * world)
        return shares[rank] * world / self.global_batch

    def order(self, epoch):
        """The permutation of epoch ``epoch`` (seeded by ``seed + epoch``)."""
        return torch.randperm(self.length, generator=torch.Generator().manual_seed(self.seed + epoch))

    def share(self, step, rank, world, shares=None):
        """Indices of rank ``rank``'s share of global step ``step`` in a world of ``world``
        whose ranks have ``shares`` (in rank order; default: the equal split)."""
        shares = split(self.global_batch, [1.0] * world) if shares is None else shares
        epoch, k = divmod(step, self.steps_per_epoch)
        batch = self.order(epoch)[k * self.global_batch : (k + 1) * self.global_batch]
        start = sum(shares[:rank])
        return batch[start : start + shares[rank]].tolist()

    def _resplit(self, group, rank, world):
        """The split for the rates every rank holds after exchanging them (speed-weighted with
        the diphoma backend), else the equal split; published for the progress records."""
        if self.speed_weighted and hasattr(group, "blocked"):
            mine = torch.zeros(world, dtype=torch.float64)
            mine[rank] = self.speed.rate
            dist.all_reduce(mine)
            self.rates = mine.tolist()
            self.shares = split(self.global_batch, self.rates)
        else:
            self.shares = split(self.global_batch, [1.0] * world)
        metrics.BATCH_SHARE.set(self.shares[rank])
        follower = diphoma._current["follower"]
        if follower is not None:
            follower.set_shares(self.shares)

    def __iter__(self):
        group = _default_group()
        rank, world = dist.get_rank(), dist.get_world_size()
        diphoma._progress["batch"] = self.global_batch  # the samples of an automatic report's step
        blocked = getattr(group, "blocked", None)
        fresh = group is not self._group or len(self.shares) != world
        end = (self.step // self.steps_per_epoch + 1) * self.steps_per_epoch
        for s in range(self.step, end):
            self.step = s
            due = s % self.balance_every == 0 and s != self._exchanged
            if fresh or (self.speed_weighted and due):
                self._group = group
                self._resplit(group, rank, world)
                self._exchanged = s
            mine = self.share(s, rank, world, self.shares)
            t0 = time.monotonic()
            b0 = blocked.total() if blocked is not None else 0.0
            yield mine
            # Asked for the next share: step s is done.
            if blocked is not None and not fresh:
                self.speed.record(_compute_time(blocked, t0, b0), len(mine))
            fresh = False

    def __len__(self):
        return self.steps_per_epoch - self.step % self.steps_per_epoch
