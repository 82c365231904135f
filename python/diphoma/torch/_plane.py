"""The data plane of a ``"diphoma"`` process group: what moves a collective's bytes.

``ring`` (the default) is Diphoma's own ring, joined by the membership source. ``gloo``
(``DIPHOMA_DATA_PLANE=gloo``, ``spec.ring.dataPlane: gloo`` in a pod) keeps the ring for the
membership, the failure detection and the state sync, and moves the default group's
collectives through a gloo communicator of its own for each generation (torchft's design,
with the ring's detection instead of a collective timeout):

- **Created from an id the ring distributes.** At the group's first collective rank 0 serves a
  ``TCPStore`` on a free port at its ring address and broadcasts that address over the ring;
  every member then builds a ``ProcessGroupGloo`` under the generation's prefix. A new
  generation builds a new one; the old one is never used again.
- **Never a hang on a dead peer.** A collective of that communicator is waited for in ticks;
  once it has waited one liveness window (the ring's in a pod, ``detectionSeconds / 4``;
  standalone the same from ``DIPHOMA_DETECTION_SECONDS``) the other members are probed as the
  ring's own collectives probe them (each process answers at its ring address): a member that
  does not answer is blamed (``diphoma-ring``'s ``foreign::verdict``), a slow one is waited for.
  A newer generation, a blamed member or an error of gloo (a closed connection) raises
  ``RingChanged`` naming it; the follower reports it and the elastic runner re-forms in the same
  process.
- **Nothing written late.** gloo cannot abort a collective in flight (``abort()`` returns, the
  collective goes on once its peer answers), so every collective works on copies of its
  tensors, copied back only when it succeeded, and an abandoned communicator is kept alive, never
  destroyed (its destructor would wait for the collective). One copy each way per collective:
  the plane is the CPU-testable twin of a GPU library's, not a faster ring.

Sub-groups (``new_group``) keep rings of their own.
"""

import ctypes
import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from diphoma import ConfigError, RingChanged
from diphoma.torch import _ops
from diphoma.torch._watchdog import detection_seconds

ENV = "DIPHOMA_DATA_PLANE"
PLANES = ("ring", "gloo")
# How often a collective of a library plane looks at its ring (a newer generation) while it waits.
TICK = timedelta(milliseconds=50)
# How long a collective may still take to complete once a member closed its ring connection.
LEFT_GRACE = timedelta(seconds=1)
_log = logging.getLogger("diphoma")
_LIBRARY_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def chosen(environ=os.environ):
    """The data plane ``DIPHOMA_DATA_PLANE`` names (default ``ring``); ``ConfigError`` naming
    the variable for any other value."""
    name = environ.get(ENV, "").strip() or "ring"
    if name not in PLANES:
        raise ConfigError(f"diphoma: {ENV}={name!r} is not a data plane ({', '.join(PLANES)})")
    return name


def create(name, ring, timeout):
    """The data plane ``name`` (``chosen()``) over ``ring``, for the default group."""
    return RingPlane(ring) if name == "ring" else GlooPlane(ring, timeout)


class RingPlane:
    """Diphoma's ring: each call is one ring collective on a contiguous CPU tensor, in place."""

    def __init__(self, ring):
        self.ring = ring

    def averages(self, dtype):
        return dtype in _ops.RING_AVERAGES

    def allreduce(self, t, op):
        self.ring.allreduce(t.data_ptr(), t.numel(), _ops.NATIVE[t.dtype], op)

    def reduce_scatter(self, flat, op):
        """Afterwards this rank's chunk of ``flat`` (``world`` equal chunks) holds the reduction."""
        self.ring.reduce_scatter(flat.data_ptr(), flat.numel(), _ops.NATIVE[flat.dtype], op)

    def allgather(self, flat):
        """``flat``: ``world`` equal chunks, this rank's filled; afterwards every chunk is."""
        self.ring.allgather(flat.data_ptr(), flat.numel() * flat.element_size())

    def broadcast(self, t, root):
        self.ring.broadcast(t.data_ptr(), t.numel() * t.element_size(), root)

    def barrier(self):
        self.ring.barrier()

    def close(self):
        pass


def _serve_store(ring):
    """A ``TCPStore`` every member of ``ring`` reaches: served by rank 0 on a free port at its
    ring address, whose ``host:port`` the others receive over the ring's broadcast; its calls
    bounded by the ring's join timeout."""
    world, timeout = ring.world, timedelta(seconds=ring.timeout)
    addr = torch.zeros(64, dtype=torch.uint8)
    if ring.rank == 0:
        store = dist.TCPStore(ring.host, 0, world, True, timeout=timeout, wait_for_workers=False)
        address = f"{ring.host}:{store.port}".encode()
        addr[: len(address)] = torch.tensor(list(address), dtype=torch.uint8)
    ring.broadcast(addr.data_ptr(), addr.numel(), 0)
    if ring.rank == 0:
        return store
    host, port = bytes(addr.tolist()).rstrip(b"\0").decode().rsplit(":", 1)
    return dist.TCPStore(host, int(port), world, False, timeout=timeout)


def _bytes(t):
    """The bytes of the contiguous ``t`` as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


class GlooPlane:
    """A gloo communicator of this generation under ``ring``'s membership (see the module doc)."""

    backend = "gloo"

    def __init__(self, ring, timeout):
        self.ring, self.timeout = ring, timeout
        self.window = ring.liveness_window or detection_seconds() / 4
        self.pg = None
        self._store = None
        ring.answer_liveness()

    def averages(self, dtype):
        return False  # gloo has no AVG: the group sums and divides

    def _connect(self):
        """Builds the generation's communicator (at the group's first collective, on every rank)."""
        from torch._C._distributed_c10d import ProcessGroupGloo

        self._store = _serve_store(self.ring)
        opts = ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=self.ring.timeout)  # connecting
        opts._devices = [ProcessGroupGloo.create_device(hostname=self.ring.host)]
        prefix = dist.PrefixStore(f"diphoma/{self.backend}/{self.ring.generation}/", self._store)
        self.pg = ProcessGroupGloo(prefix, self.ring.rank, self.ring.world, opts)
        self.pg.set_timeout(self.timeout)  # each collective: a backstop, the ring's probes come first
        _log.info("diphoma: ring generation %d (rank %d of %d): collectives through a gloo communicator",
                  self.ring.generation, self.ring.rank, self.ring.world)

    def _run(self, what, tensors, start):
        """Runs ``start(copies)`` (a gloo collective on copies of ``tensors``), waits for it as the
        module doc says and copies the results back; raises ``RingChanged`` naming the member
        blamed."""
        t0 = time.monotonic()
        if self.pg is None:
            try:
                self._connect()
            except RingChanged:
                raise
            except Exception as e:  # noqa: BLE001 - a member lost while connecting
                self._fail(what, t0, e)
        copies = [t.clone() for t in tensors]
        try:
            work = start(copies)
        except Exception as e:  # noqa: BLE001 - refused before anything was sent: the arguments
            raise ConfigError(f"diphoma: {what} of the gloo data plane: {e}") from None
        checked = 0.0
        while True:
            try:
                work.wait(TICK)
                break
            except Exception:  # noqa: BLE001 - the tick passed, or gloo's error
                if work.is_completed():
                    try:
                        work.wait()
                        break
                    except Exception as e:  # noqa: BLE001
                        self._fail(what, t0, e)
                # Each tick: a newer generation, a member that left (its ring connection closed:
                # blamed unless the collective completes within LEFT_GRACE, as the last one does
                # when a member finished it and exited first); each window: the others' liveness.
                if self.ring.closed_peer is not None:
                    try:
                        work.wait(LEFT_GRACE)
                        break
                    except Exception:  # noqa: BLE001 - not done, or gloo's error: blamed below
                        pass
                waited = time.monotonic() - t0
                probe = waited - checked >= self.window
                checked = waited if probe else checked
                blamed = self.ring.blame(what, waited, False, self.window, probe)
                if blamed:
                    self._abandon(f"{blamed} ({what} of the gloo data plane)")
        for t, c in zip(tensors, copies):
            t.copy_(c)

    def _fail(self, what, t0, error):
        blamed = self.ring.blame(what, time.monotonic() - t0, True, self.window)
        self._abandon(f"{blamed} ({what} of the gloo data plane: {error})")

    def _abandon(self, why):
        """Never uses the communicator again, never destroys it (see the module doc), says so
        (the ``diphoma`` logger, WARNING) and raises ``RingChanged(why)``."""
        if self.pg is not None:
            self.pg.abort()
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self.pg))
            self.pg = None
        _log.warning("diphoma: the gloo communicator of ring generation %d is abandoned: %s",
                     self.ring.generation, why)
        raise RingChanged(why) from None

    def allreduce(self, t, op):
        opts = dist.AllreduceOptions()
        opts.reduceOp = _LIBRARY_OPS[op]
        self._run("allreduce", [t], lambda c: self.pg.allreduce(c, opts))

    def reduce_scatter(self, flat, op):
        """As ``RingPlane.reduce_scatter``, by an all-reduce of the whole of ``flat``."""
        self.allreduce(flat, op)

    def allgather(self, flat):
        raw = _bytes(flat)  # any dtype
        mine = raw.view(self.ring.world, -1)[self.ring.rank].clone()
        self._run("allgather", [raw], lambda c: self.pg._allgather_base(c[0], mine))

    def broadcast(self, t, root):
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        self._run("broadcast", [_bytes(t)], lambda c: self.pg.broadcast(c, opts))

    def barrier(self):
        self._run("barrier", [], lambda c: self.pg.barrier())

    def close(self):
        self.pg = None
        self._store = None
