"""The data plane of a ``"diphoma"`` process group: what moves a collective's bytes.

``ring`` (the default) is Diphoma's own ring, joined by the membership source. ``gloo`` and
``nccl`` (``DIPHOMA_DATA_PLANE``, ``spec.ring.dataPlane`` in a pod) keep the ring for the
membership, the failure detection and the state sync, and move the default group's
collectives through a communicator of that library of its own for each generation (torchft's
design, with the ring's detection instead of a collective timeout; ``LibraryPlane``, one code
path for both: ``gloo`` is the CPU-testable twin of ``nccl``). ``nccl`` carries the CUDA
tensors of all-reduce, broadcast and all-gather on their device (one process per GPU: NCCL
refuses two ranks on one device) and the group's CPU tensors over the ring; it needs a torch
with NCCL and a CUDA device, else ``chosen()`` refuses it naming the variable.

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
  collective goes on once its peer answers), so every gloo collective works on copies of its
  tensors, copied back only when it succeeded, and an abandoned communicator is kept alive, never
  destroyed (its destructor would wait for the collective). One copy each way per collective:
  the plane is the CPU-testable twin of a GPU library's, not a faster ring. NCCL's ``abort()``
  (``ncclCommAbort``) ends a collective in flight, so the nccl plane works on the tensors in
  place; its works are polled (``_Polled``), never waited for with a timeout (NCCL's own
  timeout makes the work an error that tears the communicator down).

With several training processes per pod (the contract's ``DIPHOMA_LOCAL_RANK`` and
``DIPHOMA_PROCESSES_PER_WORKER`` = P > 1, set by the pod's launcher, and more than one pod),
the ``ring`` plane's all-reduce is **hierarchical** (``HierarchicalPlane``; Horovod's and
NCCL's two-level all-reduce): local rank ``l`` of pod ``p`` is ring rank ``p·P + l``; the P
processes of a pod reduce-scatter over an in-pod ring (TCP on the pod's address, for CPU
tensors; shared memory would spare the kernel's copies: not built) or, for CUDA tensors where
the process has CUDA and NCCL, over a NCCL communicator of the pod's processes on the device
(``pod_library``; ``DIPHOMA_POD_PLANE=gloo`` runs the same stages on a gloo communicator for
CPU tensors, the CPU-testable twin), chunk ``l`` is all-reduced across the pods over the ring
of local rank ``l`` in host memory (a CUDA chunk copied there and back; the P cross-pod rings
in parallel, each carrying 1/P of the bytes), and the pod all-gathers the chunks (NCCL's or
gloo's all-gather where its reduce-scatter ran); a rest of fewer than P elements goes over the flat ring, and so does a whole
all-reduce of less than ``DIPHOMA_HIERARCHICAL_MIN_BYTES`` (default 1 MiB: below it the
stages' fixed cost outweighs what they can save). Both rings are the ring
generation's, built at its first all-reduce (``Ring.subring``, their addresses all-gathered
over the ring; the pod's communicator from a store rank 0 serves) and watched as the gloo communicator's collectives are (above): a member lost or
silent in any stage fails the all-reduce with ``RingChanged`` and the rings are shut
(``Ring.abort``) and the pod's communicator aborted, so every stage's peers fail too (gloo's
stages work on a copy: nothing is written late). Broadcast, all-gather, reduce-scatter and
barrier stay on the flat ring (it carries the membership and the state sync);
``DIPHOMA_HIERARCHICAL=0`` keeps the all-reduce flat too, as does the ``gloo`` plane.

Sub-groups (``new_group``) keep rings of their own.
"""

import contextlib
import ctypes
import logging
import os
import secrets
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from diphoma import CollectiveMismatch, ConfigError, RingChanged
from diphoma.run import free_ports
from diphoma.torch import _ops
from diphoma.torch._watchdog import detection_seconds

ENV = "DIPHOMA_DATA_PLANE"
HIERARCHICAL_ENV = "DIPHOMA_HIERARCHICAL"
HIERARCHICAL_MIN_ENV = "DIPHOMA_HIERARCHICAL_MIN_BYTES"
POD_PLANE_ENV = "DIPHOMA_POD_PLANE"
# Below this an all-reduce stays on the flat ring: the three stages' fixed cost (measured 3 ms
# against 0.8 ms flat for 64 KiB at 2 pods × 2 on loopback, python/bench/RESULTS.md "Layouts")
# exceeds what 1/P of the bytes per cross-pod ring could save (1 MiB crosses 10 Gbit/s in 0.8 ms).
HIERARCHICAL_MIN_BYTES = 1 << 20
PLANES = ("ring", "gloo", "nccl")
# How often a collective of a library plane looks at its ring (a newer generation) while it waits.
TICK = timedelta(milliseconds=50)
# How long a collective may still take to complete once a member closed its ring connection.
LEFT_GRACE = timedelta(seconds=1)
# Bytes of an address ("IP:port", IPv6 included) or a tag sent over the ring.
_ADDRESS_BYTES = 64
_log = logging.getLogger("diphoma")
_LIBRARY_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def chosen(environ=os.environ):
    """The data plane ``DIPHOMA_DATA_PLANE`` names (default ``ring``); ``ConfigError`` naming
    the variable for any other value, and for ``nccl`` where it cannot run
    (``library_unavailable``)."""
    name = environ.get(ENV, "").strip().lower() or "ring"
    if name not in PLANES:
        raise ConfigError(f"diphoma: {ENV}={name!r} is not a data plane ({', '.join(PLANES)})")
    why = library_unavailable(name, torch.cuda.is_available(), dist.is_nccl_available())
    if why:
        raise ConfigError(f"diphoma: {ENV}={name}: {why} (the nccl data plane carries CUDA tensors; "
                          "use ring or gloo on CPU)")
    return name


def processes_per_pod(world, environ=os.environ):
    """How many processes of a pod the default group's all-reduce reduces among first (pure):
    P, the contract's ``DIPHOMA_PROCESSES_PER_WORKER``, when the pod's launcher set this
    process's ``DIPHOMA_LOCAL_RANK`` (a process of a pod of several, ring rank ``pod·P +
    local rank``), P > 1, ``world`` holds more than one pod of P, and ``DIPHOMA_HIERARCHICAL``
    is not ``0``; else 1 (a flat ring: one process per pod, one pod, or the standalone
    launcher, whose every process is a member of its own). ``ConfigError`` naming
    ``DIPHOMA_HIERARCHICAL`` unless it is unset, ``0`` or ``1``."""
    hierarchical = environ.get(HIERARCHICAL_ENV, "").strip()
    if hierarchical not in ("", "0", "1"):
        raise ConfigError(f"diphoma: {HIERARCHICAL_ENV}={hierarchical!r} must be 0 (a flat all-reduce) or 1 "
                          "(the default: hierarchical with several processes per pod)")
    if not environ.get("DIPHOMA_LOCAL_RANK", "").strip() or hierarchical == "0":
        return 1
    try:
        processes = int(environ.get("DIPHOMA_PROCESSES_PER_WORKER", "1"))
    except ValueError:
        return 1  # refused by the ring's own reading of the layout (contract::local)
    return processes if 1 < processes < world and world % processes == 0 else 1


def create(name, ring, timeout, processes=1):
    """The data plane ``name`` (``chosen()``) over ``ring``, for the default group; with
    ``processes`` > 1 per pod (``processes_per_pod``) the ``ring`` plane's all-reduce is
    hierarchical."""
    if name in ("gloo", "nccl"):
        return LibraryPlane(ring, timeout, name)
    return HierarchicalPlane(ring, processes, timeout) if processes > 1 else RingPlane(ring)


class RingPlane:
    """Diphoma's ring: each call is one ring collective on a contiguous CPU tensor, in place."""

    def __init__(self, ring):
        self.ring = ring

    def on_device(self, what, t):
        """Whether collective ``what`` (``allreduce``, ``broadcast``, ``allgather``) takes the
        CUDA tensor ``t`` on its device (else the group stages it through host memory)."""
        return False

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
    addr = torch.zeros(_ADDRESS_BYTES, dtype=torch.uint8)
    if ring.rank == 0:
        store = dist.TCPStore(ring.host, 0, world, True, timeout=timeout, wait_for_workers=False)
        _put_text(addr, f"{ring.host}:{store.port}")
    ring.broadcast(addr.data_ptr(), addr.numel(), 0)
    if ring.rank == 0:
        return store
    host, port = _text(addr).rsplit(":", 1)
    return dist.TCPStore(host, int(port), world, False, timeout=timeout)


def _put_text(row, text):
    """Writes ``text`` (UTF-8, at most ``row.numel()`` bytes) into the zeroed uint8 ``row``."""
    raw = text.encode()
    row[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)


def _text(row):
    """The text ``_put_text`` wrote into ``row``."""
    return bytes(row.tolist()).rstrip(b"\0").decode()


def _bytes(t):
    """The bytes of the contiguous ``t`` as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


class _Watched:
    """A data plane whose collectives run off the ring, watched by it: the waiting, blaming and
    abandoning of the module doc, shared by the gloo communicator and the hierarchical rings.
    A subclass names what it abandons (``abandoned``) and lets go of it (``_drop``)."""

    abandoned = "communicator"

    def __init__(self, ring):
        self.ring = ring
        self.window = ring.liveness_window or detection_seconds() / 4
        ring.answer_liveness()

    def _wait(self, what, t0, work):
        """Waits for ``work`` (``wait(timedelta)`` raising until it is done, ``is_completed()``)
        in ticks, as the module doc says; raises ``RingChanged`` naming the member blamed."""
        checked = 0.0
        while True:
            try:
                work.wait(TICK)
                return
            except Exception:  # noqa: BLE001 - the tick passed, or the collective's error
                if work.is_completed():
                    try:
                        work.wait()
                        return
                    except Exception as e:  # noqa: BLE001
                        self._fail(what, t0, e)
                # Each tick: a newer generation, a member that left (its ring connection closed:
                # blamed unless the collective completes within LEFT_GRACE, as the last one does
                # when a member finished it and exited first); each window: the others' liveness.
                if self.ring.closed_peer is not None:
                    try:
                        work.wait(LEFT_GRACE)
                        return
                    except Exception:  # noqa: BLE001 - not done, or its error: blamed below
                        pass
                waited = time.monotonic() - t0
                probe = waited - checked >= self.window
                checked = waited if probe else checked
                blamed = self.ring.blame(what, waited, False, self.window, probe)
                if blamed:
                    self._abandon(f"{blamed} ({what} of the {self.abandoned})")

    def _fail(self, what, t0, error):
        blamed = self.ring.blame(what, time.monotonic() - t0, True, self.window)
        self._abandon(f"{blamed} ({what} of the {self.abandoned}: {error})")

    def _abandon(self, why):
        """Lets go of this generation's communicator (``_drop``), says so (the ``diphoma``
        logger, WARNING) and raises ``RingChanged(why)``."""
        self._drop()
        _log.warning("diphoma: the %s of ring generation %d is abandoned: %s", self.abandoned,
                     self.ring.generation, why)
        raise RingChanged(why) from None

    def _drop(self):
        raise NotImplementedError


class _Polled:
    """A NCCL work waited for as ``_Watched._wait`` waits (``wait(timedelta)`` raising until it
    is done): by polling ``is_completed()``, never by ``wait(timeout)``, which NCCL treats as
    the collective's own timeout (an error that tears the communicator down); the final
    ``wait()`` raises its error and makes this thread's current stream wait for it."""

    POLL = 0.001  # seconds

    def __init__(self, work):
        self.work = work

    def wait(self, timeout=None):
        if timeout is not None:
            deadline = time.monotonic() + timeout.total_seconds()
            while not self.work.is_completed():
                if time.monotonic() >= deadline:
                    raise TimeoutError
                time.sleep(self.POLL)
        self.work.wait()

    def is_completed(self):
        return self.work.is_completed()


def library_unavailable(name, cuda_available, nccl_available):
    """Why data plane ``name`` cannot run in this process (pure; ``None`` when it can): ``nccl``
    needs a torch built with NCCL and a CUDA device."""
    if name != "nccl":
        return None
    if not nccl_available:
        return "this torch has no NCCL (a CPU-only build)"
    if not cuda_available:
        return "no CUDA device is visible to this process"
    return None


def library_group(backend, store, rank, world, ring, timeout):
    """A ``backend`` (``gloo``, ``nccl``) communicator of ``world`` ranks over ``store`` (a
    generation's prefix), this process rank ``rank``: connecting bounded by ``ring``'s join
    timeout (gloo binds ``ring``'s host), each collective by ``timeout`` (a backstop: the ring's
    probes come first)."""
    if backend == "nccl":
        from torch._C._distributed_c10d import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(store, rank, world, opts)
    from torch._C._distributed_c10d import ProcessGroupGloo

    opts = ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=ring.timeout)  # connecting
    opts._devices = [ProcessGroupGloo.create_device(hostname=ring.host)]
    pg = ProcessGroupGloo(store, rank, world, opts)
    pg.set_timeout(timeout)
    return pg


def _abandon_library_group(pg):
    """Aborts ``pg`` (nccl: its collectives in flight end; gloo: they go on) and keeps it from
    ever being destroyed (gloo's destructor would wait for a collective in flight)."""
    pg.abort()
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))


class LibraryPlane(_Watched):
    """A third-party library's communicator of this generation (``gloo`` or ``nccl``) under
    ``ring``'s membership (see the module doc). ``gloo`` works on host copies of the tensors
    (it cannot abort a collective in flight); ``nccl`` on the caller's CUDA tensors in place
    (``ncclCommAbort`` ends a collective in flight, so nothing is written late), and carries the
    CPU tensors of the same group over the ring."""

    def __init__(self, ring, timeout, backend):
        super().__init__(ring)
        self.backend = backend
        self.abandoned = f"{backend} communicator"
        self.timeout = timeout
        self.pg = None
        self._store = None
        self._host = RingPlane(ring) if backend == "nccl" else None  # an nccl plane's CPU tensors

    def on_device(self, what, t):
        return self.backend == "nccl" and t.is_cuda

    def averages(self, dtype):
        return False  # the group sums and divides (gloo has no AVG; one path for both)

    def _connect(self):
        """Builds the generation's communicator (at the group's first collective, on every rank)."""
        self._store = _serve_store(self.ring)
        prefix = dist.PrefixStore(f"diphoma/{self.backend}/{self.ring.generation}/", self._store)
        self.pg = library_group(self.backend, prefix, self.ring.rank, self.ring.world, self.ring, self.timeout)
        _log.info("diphoma: ring generation %d (rank %d of %d): collectives through a %s communicator",
                  self.ring.generation, self.ring.rank, self.ring.world, self.backend)

    def _run(self, what, tensors, start):
        """Runs ``start(tensors')`` (a collective of the communicator: on copies of ``tensors``
        for gloo, on ``tensors`` for nccl), waits for it as the module doc says and copies gloo's
        results back; raises ``RingChanged`` naming the member blamed."""
        t0 = time.monotonic()
        if self.pg is None:
            try:
                self._connect()
            except RingChanged:
                raise
            except Exception as e:  # noqa: BLE001 - a member lost while connecting
                self._fail(what, t0, e)
        in_place = self.backend == "nccl"
        copies = tensors if in_place else [t.clone() for t in tensors]
        try:
            work = start(copies)
        except Exception as e:  # noqa: BLE001 - refused before anything was sent: the arguments
            raise ConfigError(f"diphoma: {what} of the {self.backend} data plane: {e}") from None
        self._wait(what, t0, _Polled(work) if in_place else work)
        if not in_place:
            for t, c in zip(tensors, copies):
                t.copy_(c)

    def _drop(self):
        """Aborts the communicator (nccl: its collectives in flight end; gloo: they go on) and
        never uses or destroys it again (see the module doc)."""
        if self.pg is not None:
            _abandon_library_group(self.pg)
            self.pg = None

    def _host_tensor(self, t):
        """Whether an nccl plane carries ``t`` over the ring (a CPU tensor)."""
        return self._host is not None and t.is_cpu

    def allreduce(self, t, op):
        if self._host_tensor(t):
            return self._host.allreduce(t, op)
        opts = dist.AllreduceOptions()
        opts.reduceOp = _LIBRARY_OPS[op]
        self._run("allreduce", [t], lambda c: self.pg.allreduce(c, opts))

    def reduce_scatter(self, flat, op):
        """As ``RingPlane.reduce_scatter``, by an all-reduce of the whole of ``flat``."""
        self.allreduce(flat, op)

    def allgather(self, flat):
        if self._host_tensor(flat):
            return self._host.allgather(flat)
        raw = _bytes(flat)  # any dtype
        mine = raw.view(self.ring.world, -1)[self.ring.rank].clone()
        self._run("allgather", [raw], lambda c: self.pg._allgather_base(c[0], mine))

    def broadcast(self, t, root):
        if self._host_tensor(t):
            return self._host.broadcast(t, root)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        self._run("broadcast", [_bytes(t)], lambda c: self.pg.broadcast(c, opts))

    def barrier(self):
        if self._host is not None:
            return self._host.barrier()
        self._run("barrier", [], lambda c: self.pg.barrier())

    def close(self):
        self.pg = None
        self._store = None


def pod_groups(rank, world, processes):
    """The two sub-rings of ring rank ``rank`` of ``world`` in pods of ``processes`` (pure):
    ``((in-pod ring ranks, this rank's place), (cross-pod ring ranks, this rank's place))``.
    Rank ``p·P + l`` is local rank ``l`` of pod ``p``: its pod's ranks ``p·P .. p·P + P - 1``
    (place ``l``) and local rank ``l`` of every pod, ``l, P + l, …`` (place ``p``)."""
    pod, local = divmod(rank, processes)
    return ((list(range(pod * processes, (pod + 1) * processes)), local),
            (list(range(local, world, processes)), pod))


def hierarchical_split(count, processes, element_size=1, min_bytes=0):
    """The part of ``count`` elements of ``element_size`` bytes the hierarchical all-reduce
    takes (pure): none below ``min_bytes`` in all (``hierarchical_min_bytes``: the flat ring
    takes it whole), else the largest multiple of ``processes`` (equal chunks, one per local
    rank); the rest, fewer than ``processes`` elements, goes over the flat ring."""
    return 0 if count * element_size < min_bytes else count - count % processes


def hierarchical_min_bytes(environ=os.environ):
    """The smallest all-reduce (bytes) that goes hierarchical: ``DIPHOMA_HIERARCHICAL_MIN_BYTES``,
    default ``HIERARCHICAL_MIN_BYTES``; ``ConfigError`` naming the variable unless it is an
    integer ≥ 0."""
    raw = environ.get(HIERARCHICAL_MIN_ENV, "").strip()
    if not raw:
        return HIERARCHICAL_MIN_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"diphoma: {HIERARCHICAL_MIN_ENV}={raw!r} must be a number of bytes (0 or more)")
    return value


def pod_library(environ, nccl_ready):
    """The library that runs the in-pod stages of the hierarchical all-reduce besides the
    in-pod ring (pure): ``nccl`` where this process has CUDA and a torch with NCCL (for CUDA
    tensors: ``nccl_ready``), else ``gloo`` when ``DIPHOMA_POD_PLANE=gloo`` (for CPU tensors:
    the CPU-testable twin of the NCCL path), else None (the in-pod ring only). ``ConfigError``
    naming the variable for a value other than ``ring`` or ``gloo``."""
    name = environ.get(POD_PLANE_ENV, "").strip().lower() or "ring"
    if name not in ("ring", "gloo"):
        raise ConfigError(f"diphoma: {POD_PLANE_ENV}={name!r} is not an in-pod plane for CPU tensors (ring, gloo)")
    return "nccl" if nccl_ready else (None if name == "ring" else name)


class _Thread:
    """One call of ``fn`` on a thread of its own, as ``_Watched._wait`` waits for a work: the
    stages of a hierarchical all-reduce, whose rings release the GIL."""

    def __init__(self, fn):
        self.error = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._call, args=(fn,), name="diphoma-hier", daemon=True)
        self._thread.start()

    def _call(self, fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - raised by wait()
            self.error = e
        self._done.set()

    def wait(self, timeout=None):
        """Returns once the call ended (raising its error), or raises ``TimeoutError`` after
        ``timeout`` (a ``timedelta``; None: no bound)."""
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise TimeoutError
        if self.error is not None:
            raise self.error

    def is_completed(self):
        return self._done.is_set()


class HierarchicalPlane(_Watched):
    """The ``ring`` plane of a pod of ``processes`` training processes: its all-reduce in two
    levels (the module doc), everything else on the flat ``ring``."""

    abandoned = "pair of in-pod and cross-pod rings"

    def __init__(self, ring, processes, timeout=timedelta(minutes=30)):
        super().__init__(ring)
        self.flat = RingPlane(ring)
        self.processes = processes
        self.timeout = timeout
        self.pod = self.across = None  # this generation's sub-rings, built at the first all-reduce
        self._work = None  # the stages in flight
        self.min_bytes = hierarchical_min_bytes()
        # The pod's library communicator (``pod_library``), built with the sub-rings.
        self.library = pod_library(os.environ, torch.cuda.is_available() and dist.is_nccl_available())
        self.pod_pg = None
        self._store = None

    def on_device(self, what, t):
        """Whether collective ``what`` takes ``t`` on its device (a CUDA tensor's all-reduce,
        whose in-pod stages run on NCCL), not staged through host memory by the group."""
        return what == "allreduce" and t.is_cuda and self.library == "nccl"

    def _through_library(self, t):
        """Whether ``t``'s in-pod stages run on the pod's library communicator: CUDA tensors
        with ``nccl``, CPU tensors with ``gloo`` (``DIPHOMA_POD_PLANE=gloo``)."""
        return self.library == ("nccl" if t.is_cuda else "gloo")

    def averages(self, dtype):
        return False  # sums over both rings, divided by the group

    def _connect(self):
        """Builds the generation's in-pod and cross-pod rings (every member at once): each binds
        two free ports on its ring host, the addresses and rank 0's tag are all-gathered over
        the ring, then the rings join, the pod's first."""
        ring, world = self.ring, self.ring.world
        ports = free_ports(2, ring.host)
        table = torch.zeros((world, 3, _ADDRESS_BYTES), dtype=torch.uint8)
        for i, text in enumerate((f"{ring.host}:{ports[0]}", f"{ring.host}:{ports[1]}", secrets.token_hex(8))):
            _put_text(table[ring.rank, i], text)
        self.flat.allgather(table)
        tag = _text(table[0, 2])
        (pod_ranks, local), (across_ranks, pod) = pod_groups(ring.rank, world, self.processes)
        self.pod = ring.subring(local, [_text(table[r, 0]) for r in pod_ranks], f"{tag}/pod/{pod}")
        self.across = ring.subring(pod, [_text(table[r, 1]) for r in across_ranks], f"{tag}/local/{local}")
        if self.library:
            self._store = _serve_store(ring)
            prefix = dist.PrefixStore(f"diphoma/pod-{self.library}/{tag}/{pod}/", self._store)
            self.pod_pg = library_group(self.library, prefix, local, self.processes, ring, self.timeout)
        _log.info("diphoma: ring generation %d (rank %d of %d): all-reduce hierarchical, pod %d of %d, "
                  "local rank %d of %d%s", ring.generation, ring.rank, world, pod, world // self.processes, local,
                  self.processes, f"; in the pod: {self.library}" if self.library else "")

    @staticmethod
    def _stages(pod, across, t, op):
        """Reduce-scatter over the in-pod ring ``pod``, all-reduce of this local rank's chunk
        over the cross-pod ring ``across``, all-gather over ``pod``: on the contiguous ``t`` of
        a native dtype, whose numel ``pod.world`` divides."""
        dtype, n = _ops.NATIVE[t.dtype], t.numel()
        chunk = n // pod.world
        pod.reduce_scatter(t.data_ptr(), n, dtype, op)
        across.allreduce(t.data_ptr() + pod.rank * chunk * t.element_size(), chunk, dtype, op)
        pod.allgather(t.data_ptr(), n * t.element_size())

    @staticmethod
    def _library_stages(pg, across, local, t, op):
        """As ``_stages`` with the in-pod reduce-scatter and all-gather on the pod's library
        communicator ``pg`` (NCCL for a CUDA ``t``; gloo for a CPU one): the cross-pod ring
        all-reduces this local rank's chunk in host memory (a CUDA chunk copied there and back)."""
        chunk = t.numel() // pg.size()
        out = torch.empty(chunk, dtype=t.dtype, device=t.device)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _LIBRARY_OPS[op]
        with torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext():
            pg._reduce_scatter_base(out, t, opts).wait()
            host = out.cpu() if t.is_cuda else out  # waits for the stream: NCCL's result is there
            across.allreduce(host.data_ptr(), chunk, _ops.NATIVE[t.dtype], op)
            if host is not out:
                out.copy_(host)
            pg._allgather_base(t, out).wait()
            if t.is_cuda:
                torch.cuda.current_stream(t.device).synchronize()

    def allreduce(self, t, op):
        """``t`` (contiguous, a native dtype) all-reduced by ``op``: its first
        ``hierarchical_split`` elements over the two levels (watched), the rest over the ring
        (all of it below ``DIPHOMA_HIERARCHICAL_MIN_BYTES``)."""
        head = hierarchical_split(t.numel(), self.processes, t.element_size(), self.min_bytes)
        flat = t.reshape(-1)
        if head:
            t0 = time.monotonic()
            # A newer generation or a member that left: never start on this generation's sub-rings
            # (they would go on without the ring's membership).
            blamed = self.ring.blame("allreduce", 0.0, False, self.window, False)
            if blamed:
                self._abandon(f"{blamed} (allreduce of the {self.abandoned})")
            if self.pod is None:
                try:
                    self._connect()
                except (RingChanged, ConfigError):
                    raise
                except Exception as e:  # noqa: BLE001 - a member lost while joining the sub-rings
                    self._fail("allreduce", t0, e)
            part, pod, across, pg = flat[:head], self.pod, self.across, self.pod_pg
            if self._through_library(t):
                # gloo cannot abort: its stages work on a copy, written back once they succeeded.
                work_on = part if t.is_cuda else part.clone()
                self._work = _Thread(lambda: self._library_stages(pg, across, pod.rank, work_on, op))
            else:
                work_on = part
                self._work = _Thread(lambda: self._stages(pod, across, part, op))
            self._wait("allreduce", t0, self._work)
            self._work = None
            if work_on is not part:
                part.copy_(work_on)
        if head < t.numel():
            rest = flat[head:]
            host = rest.cpu() if rest.is_cuda else rest  # the flat ring reduces host memory
            self.flat.allreduce(host, op)
            if host is not rest:
                rest.copy_(host)

    def _drop(self):
        """Shuts both sub-rings (a stage in flight fails at once, the peers of every stage see
        this member leave) and lets go of them."""
        for r in (self.pod, self.across):
            if r is not None:
                r.abort()
        if self.pod_pg is not None:
            _abandon_library_group(self.pod_pg)
        self.pod = self.across = self.pod_pg = self._store = None
        if self._work is not None:  # returns at once, its rings shut: nothing written after this
            try:
                self._work.wait()
            except Exception:  # noqa: BLE001 - the stage's error, already accounted for
                pass
            self._work = None

    def _fail(self, what, t0, error):
        """A stage's error: the ranks' calls differ (``CollectiveMismatch``) or a bad argument
        (``ConfigError``) as they are, the sub-rings shut; else blamed as the module doc says."""
        if isinstance(error, (CollectiveMismatch, ConfigError)):
            self._drop()
            raise error
        super()._fail(what, t0, error)

    def reduce_scatter(self, flat, op):
        self.flat.reduce_scatter(flat, op)

    def allgather(self, flat):
        self.flat.allgather(flat)

    def broadcast(self, t, root):
        self.flat.broadcast(t, root)

    def barrier(self):
        self.flat.barrier()

    def close(self):
        self._drop()
