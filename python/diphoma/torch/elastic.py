"""Elastic training without restarting the survivors, modelled on Horovod Elastic
(``hvd.elastic.run``, ``TorchState.commit()/restore()``).

```python
state = diphoma.torch.elastic.State(model=model, optimizer=opt, epoch=0)

@diphoma.torch.elastic.run
def train(state):
    ddp = DDP(state.model)           # built inside: each generation has its own process group
    while state.step < total:
        sampler.set_step(state.step)
        for x, y in loader:
            ...one step...
            state.step += 1
            state.commit()

train(state)
```

``run`` joins the ring through ``diphoma.Follower`` (the membership source the environment
describes), creates the ``"diphoma"`` process group of that generation, makes every member
hold the state of the most advanced one (the highest committed ``step``, the lowest rank among
equals: the Rust worker's rule), then calls the function. When a collective fails because the
ring changed (``diphoma.RingChanged``, or any exception raised while the ring has failed, as DDP
raises from its reducer), or a commit learns of a newer generation, it rolls the state back to
the last commit, destroys the group, joins the next generation **in the same process**,
broadcasts the state again (joiners receive it this way) and calls the function again.
Anything else propagates. A member that the new generation no longer lists (scale-down,
SIGTERM in a pod) returns None.

``DIPHOMA_TIMEOUT`` (seconds) bounds each join and collective (default: 30 standalone, 4 in a
pod, below the job's failure detection); a pod whose joiners take long to start (``import
torch``) raises it so that a new generation waits for them.

The state travels as ``torch.save`` bytes over the ring's own broadcast: model and optimizer
``state_dict``s, ``step`` and the extra attributes (any picklable values). Peers are
authenticated with the job's key, so the bytes are trusted like a checkpoint of the same job.
"""

import copy
import ctypes
import functools
import io
import logging
import os

import torch
import torch.distributed as dist

import diphoma
import diphoma.torch as backend
from diphoma import RingChanged, RingError, metrics
from diphoma._native import sync_root
from diphoma.torch import checkpoint


# Ring changes are announced here (WARNING: shown on stderr without any logging set up).
_log = logging.getLogger("diphoma")


class _Switch(RingChanged):
    """A commit learnt of a newer generation that lists this process."""


class _Leave(Exception):
    """The newest generation does not list this process."""


class State:
    """What survives a ring change: ``model`` and ``optimizer`` (their ``state_dict``s),
    ``step`` (committed steps, 0 at first) and the keyword ``extra`` attributes.

    ``commit()`` records the live state as the one to roll back to (and writes a checkpoint
    when one is due); ``restore()`` rolls back to it. Both copy, so keep commits to step
    boundaries (the Rust worker commits every step).
    """

    def __init__(self, model=None, optimizer=None, **extra):
        self.model, self.optimizer, self.step = model, optimizer, 0
        self._extra = sorted(extra)
        for k, v in extra.items():
            setattr(self, k, v)
        self._follower = None
        self._saved = self.snapshot()

    def snapshot(self):
        """A deep copy of the live state as a dict (``step``, ``model``, ``optimizer``,
        ``extra``)."""
        return copy.deepcopy(
            {
                "step": self.step,
                "model": None if self.model is None else self.model.state_dict(),
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
                "extra": {k: getattr(self, k) for k in self._extra},
            }
        )

    def load(self, snap):
        """Makes ``snap`` (from ``snapshot``) the live and the committed state."""
        self._saved = snap
        snap = copy.deepcopy(snap)
        self.step = snap["step"]
        if self.model is not None:
            self.model.load_state_dict(snap["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(snap["optimizer"])
        for k, v in snap["extra"].items():
            setattr(self, k, v)

    def restore(self):
        """Rolls the live state back to the last commit."""
        self.load(self._saved)

    def commit(self):
        """Records the live state as the one to roll back to; on rank 0 writes a checkpoint
        when ``DIPHOMA_CHECKPOINT_EVERY`` divides ``step``; then asks the membership source
        (which also publishes rank 0's progress record, see ``diphoma.report``) whether a newer
        generation was published: if so, raises so that ``run`` re-forms the ring. Raises
        ``RingChanged`` without committing when a collective of the group failed since (DDP's
        gradient buckets complete even when the ring fails, see ``diphoma.torch``); re-raises
        any other failure of the group as it is (a ``CollectiveMismatch``: the ranks' calls
        differ, and would again at every generation)."""
        group = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        error = getattr(group, "error", None)
        if error is not None and not isinstance(error, RingChanged):
            raise error
        if error is not None:
            raise RingChanged(f"diphoma: a collective failed during step {self.step}: {error}")
        self._saved = self.snapshot()
        progress = diphoma._progress
        progress["explicit"] = True  # the committed steps are the progress (not optimizer steps)
        dirname, n = checkpoint.directory(), checkpoint.every()
        if dirname and n and self.step % n == 0 and dist.is_initialized() and dist.get_rank() == 0:
            checkpoint.save(self._saved, dirname)
            progress["last_checkpoint"] = self.step
        if self._follower is None:
            return
        decision = self._follower.commit(
            self.step,
            progress["total_steps"],
            progress["loss"],
            diphoma._samples_per_second(),
            progress["last_checkpoint"],
        )
        if decision == "switch":
            raise _Switch(f"diphoma: a newer ring generation was published after step {self.step}")
        if decision == "leave":
            raise _Leave()


def _address(buf):
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def sync(state, ring):
    """Every member of ``ring`` gets the committed state of the most advanced one (highest
    ``step``, lowest rank among equals: ``diphoma-ring``'s ``sync_root``, the Rust worker's rule)
    over the ring's broadcast; returns that rank."""
    if ring.world == 1:
        return 0
    steps = torch.zeros(ring.world, dtype=torch.int64)
    steps[ring.rank] = state.step
    ring.allreduce(steps.data_ptr(), ring.world, "int64", "sum")
    root = sync_root(steps.tolist())
    blob = bytearray()
    if ring.rank == root:
        out = io.BytesIO()
        torch.save(state._saved, out)
        blob = bytearray(out.getvalue())
    size = torch.tensor([len(blob)], dtype=torch.int64)
    ring.broadcast(size.data_ptr(), 8, root)
    if ring.rank != root:
        blob = bytearray(int(size))
    ring.broadcast(_address(blob), len(blob), root)
    if ring.rank != root:
        state.load(torch.load(io.BytesIO(bytes(blob)), weights_only=False))
    return root


def _timeout():
    raw = os.environ.get("DIPHOMA_TIMEOUT")
    return float(raw) if raw else None


def run(func):
    """Decorates ``func(state, *args, **kwargs)`` to run elastically (see the module doc).
    Before the first generation, the newest valid checkpoint in ``DIPHOMA_CHECKPOINT_DIR``
    (if any) becomes the state. Returns ``func``'s result, or None when this process left the
    ring. Raises ``RingError`` when the ring cannot re-form."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        follower = diphoma.Follower.from_env(timeout=_timeout())
        state._follower = follower
        diphoma._set_follower(follower)
        dirname = checkpoint.directory()
        resumed = dirname and checkpoint.load_newest(dirname)
        if resumed:
            state.load(resumed[1])
            diphoma._progress["last_checkpoint"] = state.step
        joined = None
        while True:
            ring = follower.connect()
            if joined is not None:
                _log.warning("diphoma: rank %d left ring generation %d (world %d) and joined generation %d: "
                             "rank %d of world %d", joined[1], joined[0], joined[2], ring.generation, ring.rank, ring.world)
            joined = (ring.generation, ring.rank, ring.world)
            backend._HANDOFF.append(ring)
            dist.init_process_group(backend=backend.BACKEND, store=dist.HashStore(), rank=ring.rank, world_size=ring.world)
            try:
                sync(state, ring)
                return func(state, *args, **kwargs)
            except _Leave:
                return None
            except BaseException as e:
                if not (isinstance(e, RingChanged) or ring.failed):
                    raise
                state.restore()
                if not isinstance(e, _Switch):
                    if not follower.failed(ring):
                        raise RingError("diphoma: the ring could not re-form") from e
                    metrics.REPAIRS.inc()
            finally:
                dist.destroy_process_group()

    return wrapper


__all__ = ["RingChanged", "State", "run", "sync"]
