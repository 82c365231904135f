"""The ``torch.distributed`` backend ``"diphoma"``: importing this module registers it.

An unchanged DDP script changes only ``dist.init_process_group(backend="diphoma")`` and is
started by ``python -m diphoma.run`` (which also sets torch's ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT`` for the rendezvous). The process group is a Python subclass of
``torch.distributed.ProcessGroup`` that serves every c10d operation torch's API and the
libraries on top call (``diphoma.torch._ops`` says how each dtype and op maps onto the ring;
point to point and ``monitored_barrier`` go through torch's store, ``diphoma.torch._p2p``;
``new_group``/``DeviceMesh`` sub-groups get rings of their own members, ``_subring``). Each
call is checked at once (CPU tensors, a dtype and op some path defines: otherwise
``diphoma.ConfigError`` naming the operation and what is wrong). CUDA tensors are taken by
all-reduce, broadcast and all-gather (``HOST_STAGED``) through host memory. An all-reduce is
pipelined (``diphoma.torch._staging``): segments of ``DIPHOMA_STAGING_SEGMENT_BYTES`` (4 MiB)
are copied device to host into pinned buffers on a copy stream, each reduced around the ring
as soon as its copy is done and copied back on the copy stream, the copies of one segment
overlapping the ring's transfer of the next; the copy stream waits for an event of the
caller's current stream (no host synchronisation on the caller's thread), and ``wait()`` (and
the work's CUDA-aware future) makes the caller's stream wait for the copies back. Broadcast,
all-gather and the all-reduces whose plan all-gathers keep the simple staging
(``_InPlace``): one blocking copy each way of the whole tensor, made once the caller's stream
has run, not overlapped with the ring. An
asynchronous call (``async_op=True``, and every call of DDP's reducer) then runs on the group's
background thread, in call order, returning a ``Work`` whose future completes when the ring is
done. A synchronous call (torch passes ``opts.asyncOp = False``: ``dist.all_reduce(t)``) runs
on the caller's thread when nothing is queued before it, so it costs no thread hop, and returns
a completed ``Work``. Either way ``wait()`` raises the collective's error, and a group whose
collective failed refuses every later one with ``diphoma.RingChanged``. Contiguous tensors are
reduced in place from their ``data_ptr()`` (no copy); non-contiguous ones go through a
contiguous copy.

Rendezvous: ``diphoma.Follower.from_env()`` (standalone: the launcher's ``DIPHOMA_*``
variables or its ring directory; in a worker pod: the contract's variables and the ring
ConfigMap, through ``diphoma-ring``'s follower). ``diphoma.torch.elastic`` re-forms the group at
each new generation; ``diphoma.torch.ElasticSampler`` keeps the data order of a global batch
fixed across world sizes.
"""

import atexit
import logging
import os
import queue
import secrets
import threading
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.futures import Future

import diphoma
from diphoma import ConfigError, Follower, RingChanged, metrics
from diphoma.run import free_ports
from diphoma.torch import _ops, _plane, _staging
from diphoma.torch._p2p import StoreP2P
from diphoma.torch._watchdog import Watchdog, detection_seconds

BACKEND = "diphoma"


# The process groups whose thread runs: stopped at exit, before the interpreter finalizes, so no
# thread is inside torch's C++ (completing a future) when daemon threads are torn down.
_LIVE = weakref.WeakSet()
# How long a group that is shut down waits at most for its sent messages to be received (they
# live in rank 0's store, which may be this process: see diphoma.torch._p2p).
_FLUSH_SECONDS = 30
_STOP = object()
# How long a rank whose collective lost its peer looks for a mismatch notice of that collective
# (posted within milliseconds by the rank that found it, before it leaves the ring).
MISMATCH_WAIT = 0.5
_log = logging.getLogger("diphoma")


@atexit.register
def _shutdown_all():
    for pg in list(_LIVE):
        pg.shutdown()


# The collectives that take CUDA tensors, staged through host memory (``_InPlace``): every
# tensor they hand the ring is a host copy, and their results are copied back.
HOST_STAGED = frozenset({"all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather",
                         "all_gather_into_tensor", "all_gather_into_tensor_coalesced"})


def _check(t, what, wait_for_caller=True):
    """Raises ConfigError naming collective ``what`` unless ``t`` is a dense CPU tensor, or a
    CUDA tensor of a collective in ``HOST_STAGED`` on a machine where CUDA is available. For a
    CUDA tensor it then waits for the caller's current CUDA stream (``_caller_stream_done``),
    so that the ring reads what the work queued before the call wrote, unless
    ``wait_for_caller`` is false: the pipelined all-reduce (``diphoma.torch._staging``) has its
    copy stream wait for an event of the caller's stream instead."""
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"diphoma: {what}: expected a tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ConfigError(f"diphoma: {what}: {t.layout} tensors are not supported (dense tensors only)")
    if t.is_cpu:
        return
    if t.device.type == "cuda" and what in HOST_STAGED and torch.cuda.is_available():
        if wait_for_caller:
            _caller_stream_done(t)
        return
    staged = ", ".join(sorted(HOST_STAGED))
    raise ConfigError(
        f"diphoma: {what}: tensor on device {t.device} is not supported (CPU tensors only, and CUDA tensors "
        f"where CUDA is available for {staged}, staged through host memory)"
    )


def _caller_stream_done(t):
    """Blocks until the caller's current CUDA stream on ``t``'s device has run what was queued
    on it (the kernels that wrote ``t``): the collective may read ``t`` from another thread,
    whose copies run on another stream (the simple staging of ``_InPlace``)."""
    torch.cuda.current_stream(t.device).synchronize()


def _same_layout(what, tensors, like, count=None):
    """Raises ConfigError naming ``what`` unless every tensor of ``tensors`` is a CPU tensor
    with ``like``'s numel and dtype (and there are ``count`` of them, when given)."""
    if count is not None and len(tensors) != count:
        raise ConfigError(f"diphoma: {what} needs {count} tensors, got {len(tensors)}")
    for o in tensors:
        _check(o, what)
        if o.numel() != like.numel() or o.dtype != like.dtype:
            raise ConfigError(
                f"diphoma: {what}: every tensor must have {like.numel()} elements of {like.dtype}, "
                f"got {o.numel()} of {o.dtype}"
            )


def _reduce_opts(opts):
    return dist.ReduceOp.SUM if opts is None else opts.reduceOp


class _InPlace:
    """A contiguous host view of ``t`` for the ring: ``t`` itself when it is a contiguous CPU
    tensor (no copy), else a contiguous copy written back by ``done()``: of a non-contiguous
    CPU tensor, or of a CUDA tensor a copy in pinned host memory, made here on the caller's
    thread (device to host, after ``_check`` waited for the caller's stream) and copied back
    to the device by ``done()`` before the collective's work completes (host to device, waited
    for). The simple staging of broadcast, all-gather and the all-reduces whose plan
    all-gathers: one copy each way, not overlapped with the ring's transfer (gloo's CUDA path
    does the same). The other all-reduces are pipelined (``diphoma.torch._staging``). With
    ``on_device`` (a data plane that takes CUDA tensors, ``nccl``) a CUDA tensor is handled as
    a CPU one: itself when contiguous, else a contiguous copy on its device."""

    def __init__(self, t, on_device=False):
        self.t = t
        if t.is_cpu or on_device:
            self.buf = t if t.is_contiguous() else t.contiguous()
        else:
            self.buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.buf.copy_(t)

    def done(self):
        if self.buf is not self.t:
            self.t.copy_(self.buf)


def _describe(result):
    """The tensors of a collective's ``result`` (a tensor, or nested lists of them) as a mismatch
    names them: ``"1 tensor: 5 torch.float32 elements (20 bytes), shape (5,)"``; empty when there
    are none."""
    flat, todo = [], [result]
    while todo:
        x = todo.pop(0)
        if isinstance(x, torch.Tensor):
            flat.append(x)
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
    if not flat:
        return ""
    parts = [f"{t.numel()} {t.dtype} elements ({t.numel() * t.element_size()} bytes), shape {tuple(t.shape)}"
             for t in flat[:4]]
    more = f", and {len(flat) - 4} more" if len(flat) > 4 else ""
    return f"{len(flat)} tensor{'s' if len(flat) > 1 else ''}: {'; '.join(parts)}{more}"


class _Work(dist.Work):
    """One collective's handle. Its future always completes with the collective's output;
    ``wait()`` raises the collective's error. torch 2.15's DDP reducer crashes the interpreter
    (SIGSEGV in backward) on a future completed with an exception, so a failure reaches DDP
    as a completed bucket and then as the group's error: every later call raises
    ``RingChanged`` (and ``diphoma.torch.elastic``'s ``State.commit`` checks it first).

    A collective that ran on the caller's thread returns its ``Work`` already completed
    (``done(result)`` before it is handed out): its future is made only if ``get_future()`` is
    called, as torch's own ``all_reduce(async_op=False)`` never does.

    A work whose CUDA tensors a copy stream writes back (the pipelined all-reduce,
    ``diphoma.torch._staging``) has a ``cuda`` completion: ``wait()`` makes the caller's
    current stream wait for the copies back (no host synchronisation with the GPU), and its
    future is CUDA-aware (``Future(devices=...)``, completed with the copy streams current), so
    that its waiters' streams wait for them too."""

    def __init__(self):
        super().__init__()
        self.fut = None  # made by the submitter (queued work) or by get_future() (completed)
        self.result = None
        self.completed = False
        self.error = None
        self.source = -1  # the sender, for a receive from any source
        self.call = None  # the tensors this rank passed, named by a CollectiveMismatch (``_describe``)
        self.cuda = None  # a _staging.Completion: the copy streams' done events of its CUDA tensors

    def _new_future(self):
        return Future() if self.cuda is None else self.cuda.future()

    def _complete(self, result):
        """Completes the future of a queued work, on the group's thread."""
        if self.cuda is None:
            self.fut.set_result(result)
        else:
            self.cuda.complete(self.fut, result)

    def _source_rank(self):
        return self.source

    def done(self, result):
        """Completes a work that nobody can wait on yet (no future made)."""
        self.result, self.completed = result, True

    def wait(self, timeout=None):
        if not self.completed:
            self.fut.wait()
        if self.cuda is not None:
            self.cuda.wait()  # the caller's stream waits for the copies back
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self):
        return self.completed or self.fut.done()

    def is_success(self):
        return self.is_completed() and self.error is None

    def get_future(self):
        if self.fut is None:
            self.fut = self._new_future()
            self._complete(self.result)
        return self.fut


class ProcessGroupDiphoma(dist.ProcessGroup):
    """A ``torch.distributed`` process group over one ``diphoma.Ring``.

    Collectives are validated on the caller's thread and run in call order (the ring needs every
    rank to issue the same collectives in the same order): asynchronous ones on one background
    thread, synchronous ones (``opts.asyncOp`` false) on the caller's thread once the background
    thread has nothing left before them.
    """

    def __init__(self, ring, rank, size, store=None, timeout=None, plane="ring", processes=1):
        super().__init__(rank, size)
        self.ring = ring
        self._timeout = timeout or timedelta(minutes=30)  # torch's default
        # What moves the bytes: with processes > 1 per pod, a hierarchical all-reduce.
        self.plane = _plane.create(plane, ring, self._timeout, processes)
        self.wire = _ops.compression()  # float32 all-reduces' wire dtype (None: float32)
        # The all-reduces' segments and CUDA copy streams (DIPHOMA_STAGING_SEGMENT_BYTES).
        self._staging = _staging.Stager(_staging.segment_bytes(), _staging.host_segment_bytes())
        self._p2p = StoreP2P(store if store is not None else dist.HashStore(), self._timeout)
        self._coalesced = None  # the works since start_coalescing, while coalescing
        self._queue = queue.SimpleQueue()
        # Collectives submitted and not yet run (queued, or running inline): a synchronous call
        # runs inline only at 0 (else it would overtake them).
        self._queued = 0
        self._count_lock = threading.Lock()
        self._stopped = False
        self.error = None  # the first collective that failed: the group is unusable after it
        self.blocked = CollectiveTime()  # the caller's waits for the ring (ElasticSampler's speed)
        self.main = False  # the default group's, over the follower's ring (not a sub-group's)
        self._seq = 0  # collectives submitted, in call order (the same numbers on every rank)
        # Names the ranks a slow collective waits for; needs a store the ranks share.
        self._watchdog = None if self._p2p._local else Watchdog(self._p2p.store, rank, size, detection_seconds())
        self._thread = threading.Thread(target=self._serve, name="diphoma-pg", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def shutdown(self):
        """Finishes the collectives already submitted, stops the group's thread and closes the
        ring (``dist.destroy_process_group`` and interpreter exit call it; idempotent)."""
        if not self._stopped:
            self._stopped = True
            self._queue.put(_STOP)
            self._thread.join()
            self._staging.close()
            if self._watchdog is not None:
                self._watchdog.stop()
            self.plane.close()
            self.ring = None
            self._p2p.flush(min(self._timeout.total_seconds(), _FLUSH_SECONDS))
        _LIVE.discard(self)

    # -- machinery ---------------------------------------------------------------------
    def _serve(self):
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            job, work, result, seq = item
            self._run(job, work, seq)
            self.blocked.completed()
            with self._count_lock:  # the ring is free: a synchronous call may run inline now
                self._queued -= 1
            work._complete(result)

    def _run(self, job, work, seq):
        """Runs ``job``, collective ``seq``; its error goes to ``work`` and becomes the group's
        (a ring error naming the ranks the watchdog found absent, if any)."""
        if self._watchdog is not None:
            self._watchdog.begin(seq)
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            e = self._mismatch_shared(e, work, seq)
            follower = diphoma._current["follower"]
            if isinstance(e, RingChanged) and self.main and follower is not None and self.ring.failed:
                # Named for the operator (a silent peer found by the ring's liveness probes) now,
                # whether the process re-forms (elastic.run) or is restarted (a torchrun script).
                follower.report_failure(self.ring)
            missing = self._watchdog.absent_ranks(seq) if self._watchdog is not None else None
            if missing and isinstance(e, diphoma.RingError):
                e = type(e)(f"{e} (rank(s) {', '.join(map(str, missing))} never called this collective, "
                            f"number {seq} of the group)")
            work.error = e
            if not isinstance(e, ConfigError):  # a caller's mistake every rank saw leaves the ring in step
                self.error = self.error or e
        finally:
            if self._watchdog is not None:
                self._watchdog.end()

    def _mismatch_shared(self, e, work, seq):
        """``e``, the error of collective ``seq``, as the ranks tell it each other through the
        group's store (not in a single-process ``HashStore`` group): a rank that finds the ranks'
        calls differ (``CollectiveMismatch``, naming this rank's call) posts it under
        ``diphoma/mismatch/<seq>``; its ring neighbours only see it leave, so a rank whose
        collective failed with a lost peer (a closed connection: the store's server, were it the
        lost one, answers at once; a frozen one, which would not, leaves a timeout, not a lost
        peer) looks there for up to ``MISMATCH_WAIT`` s and raises the mismatch instead (the
        script's mistake, not a lost member: nothing is reported)."""
        key = f"diphoma/mismatch/{seq}"
        try:
            if isinstance(e, diphoma.CollectiveMismatch):
                mine = _describe(work.call)
                e = type(e)(f"{e}; this rank's collective number {seq} of the group had {mine or 'no tensor'}")
                if not self._p2p._local:
                    self._p2p.store.set(key, f"rank {self.rank()} (its call: {mine or 'no tensor'})")
            elif isinstance(e, RingChanged) and self.ring.failure_kind == "peer_lost" and not self._p2p._local:
                deadline = time.monotonic() + MISMATCH_WAIT
                while time.monotonic() < deadline and not self._p2p.store.check([key]):
                    time.sleep(0.02)
                if self._p2p.store.check([key]):
                    found_by, mine = self._p2p.store.get(key).decode(), _describe(work.call)
                    e = diphoma.CollectiveMismatch(
                        f"diphoma: ring generation {self.ring.generation} (rank {self.rank()} of {self.size()}): the "
                        f"ranks called different collectives or sizes: {found_by} received a frame of another size "
                        f"and left the ring, so this rank saw: {e}; this rank's collective number {seq} of the group "
                        f"had {mine or 'no tensor'} (check that every rank calls the same collectives, in the same "
                        "order, with tensors of the same size and dtype, and has the same DIPHOMA_COMPRESSION, "
                        "DIPHOMA_DATA_PLANE and DIPHOMA_STAGING_SEGMENT_BYTES)")
        except Exception as store_error:  # noqa: BLE001 - the store went away with rank 0: e as it is
            _log.debug("diphoma: the mismatch notice of collective %d: %s", seq, store_error)
        return e

    def _submit(self, job, result, opts=None, cuda=None):
        """Runs ``job`` in call order and returns its ``Work``: on the caller's thread when the
        caller will wait for it at once (``opts.asyncOp`` false, as torch sets it for
        ``async_op=False``) and nothing is queued before it; else on the background thread.
        ``cuda``: the ``_staging.Completion`` the job fills (CUDA tensors written back on a
        copy stream)."""
        if self._stopped:
            raise ConfigError("diphoma: the process group is shut down")
        if self.error is not None:
            cls = type(self.error) if isinstance(self.error, diphoma.RingError) else RingChanged
            raise cls(f"an earlier collective of this group failed: {self.error}")
        work = _Work()
        work.call = result  # described only if the ranks' calls turn out to differ
        work.cuda = cuda
        self.blocked.submitted()
        self._seq += 1
        seq = self._seq
        with self._count_lock:
            inline = self._queued == 0 and not getattr(opts, "asyncOp", True)
            self._queued += 1
            if not inline:
                work.fut = work._new_future()
                self._queue.put((job, work, result, seq))
        if self._coalesced is not None:
            self._coalesced.append(work)
        if inline:
            self._run(job, work, seq)
            self.blocked.completed()
            with self._count_lock:
                self._queued -= 1
            work.done(result)
        return work

    def _ring_reduce(self, native, t, ring_op):
        """``native`` (the data plane's allreduce or reduce_scatter) on the contiguous ``t`` of a
        native dtype: averages of types the plane does not average are sums divided here."""
        if ring_op == "avg" and not self.plane.averages(t.dtype):
            native(t, "sum")
            if t.is_floating_point():
                t.div_(self.size())
            else:
                t.div_(self.size(), rounding_mode="trunc")
        else:
            native(t, ring_op)

    def _view(self, t, what):
        """The ``_InPlace`` view of ``t`` the data plane's collective ``what`` works on: on its
        device where the plane takes it there (``on_device``: NCCL), else in host memory."""
        return _InPlace(t, self.plane.on_device(what, t))

    def _gathered(self, t):
        """Every rank's copy of ``t``: a ``(world, *t.shape)`` tensor in rank order (one byte
        all-gather; any dtype), on ``t``'s device for the ``nccl`` plane, else on the host."""
        device = t.device if self.plane.on_device("allgather", t) else "cpu"
        flat = torch.empty((self.size(), *t.shape), dtype=t.dtype, device=device)
        flat[self.rank()].copy_(t)
        self.plane.allgather(flat)
        return flat

    def _allreduce_into(self, t, plan):
        """All-reduces the contiguous ``t`` in place by ``plan`` (``_ops.plan_reduction``)."""
        if plan.kind == "native":
            self._ring_reduce(self.plane.allreduce, t, plan.ring_op)
        elif plan.kind in ("widen", "compress"):
            cast = t.to(_ops.BY_NAME[plan.ring_dtype])
            self._ring_reduce(self.plane.allreduce, cast, plan.ring_op)
            t.copy_(cast)
        else:
            t.copy_(plan.local(self._gathered(t)))

    def _scatter_into(self, flat, out, plan):
        """Reduce-scatters the contiguous ``flat`` (world equal chunks) by ``plan`` and copies
        this rank's reduced chunk into ``out``."""
        mine = flat.view(self.size(), -1)[self.rank()]
        if plan.kind == "native":
            self._ring_reduce(self.plane.reduce_scatter, flat, plan.ring_op)
        else:
            self._allreduce_into(flat, plan)  # world times the bytes: rare dtypes and ops
        out.copy_(mine.view(out.shape))

    # -- collectives -------------------------------------------------------------------
    def allreduce(self, tensors, opts=None, what="all_reduce"):
        """``dist.all_reduce`` (also ``reduce`` and ``all_reduce_coalesced``): the tensors whose
        plan the ring reduces go through one segmented pipeline (``diphoma.torch._staging``:
        CUDA tensors through pinned segments on a copy stream, whose copies overlap the ring's
        transfer; CPU tensors in place, whole unless ``DIPHOMA_STAGING_SEGMENT_BYTES`` is set), then those whose plan all-gathers
        (simple staging, ``_InPlace``). The caller's thread never waits for its CUDA stream
        here: the copy stream waits for an event recorded on it now. When the data plane
        takes a CUDA tensor of the call on its device (``on_device``: the ``nccl`` plane, NCCL
        inside the pod), every tensor of the call goes to it whole (``_allreduce_whole``)."""
        if any(isinstance(t, torch.Tensor) and t.is_cuda and self.plane.on_device("allreduce", t) for t in tensors):
            return self._allreduce_whole(tensors, opts, what)
        for t in tensors:
            _check(t, what, wait_for_caller=False)
        plans = [_ops.plan_reduction(what, t.dtype, _reduce_opts(opts), self.wire) for t in tensors]
        piped = [(t, plan) for t, plan in zip(tensors, plans) if plan.kind in _staging.PIPELINED]
        gathered = []
        for t, plan in zip(tensors, plans):
            if plan.kind not in _staging.PIPELINED:
                if not t.is_cpu:
                    _caller_stream_done(t)
                gathered.append((_InPlace(t), plan))
        ready = self._staging.ready([t for t, _ in piped])
        devices = sorted({t.device for t in tensors if not t.is_cpu}, key=lambda d: d.index)
        cuda = _staging.Completion(devices) if devices else None
        entries = [(t, _ops.BY_NAME[plan.ring_dtype]) for t, plan in piped]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)

        def reduce(host, k):
            self._ring_reduce(self.plane.allreduce, host, piped[k][1].ring_op)

        def job():
            t0 = time.perf_counter()
            self._staging.allreduce(entries, reduce, ready, cuda)
            for v, plan in gathered:
                self._allreduce_into(v.buf, plan)
                v.done()
            metrics.ALLREDUCE_SECONDS.observe(time.perf_counter() - t0)
            metrics.ALLREDUCE_BYTES.inc(nbytes)

        return self._submit(job, tensors, opts, cuda)

    def _allreduce_whole(self, tensors, opts, what):
        """The all-reduce of a data plane that takes CUDA tensors on their device: each tensor
        in one plane collective, in place (``_view``: on the device where the plane takes it
        there, else staged whole through host memory; no segments)."""
        for t in tensors:
            _check(t, what)
        plans = [_ops.plan_reduction(what, t.dtype, _reduce_opts(opts), self.wire) for t in tensors]
        views = [self._view(t, "allreduce") for t in tensors]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)

        def job():
            t0 = time.perf_counter()
            for v, plan in zip(views, plans):
                self._allreduce_into(v.buf, plan)
                v.done()
            metrics.ALLREDUCE_SECONDS.observe(time.perf_counter() - t0)
            metrics.ALLREDUCE_BYTES.inc(nbytes)

        return self._submit(job, tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts, what="all_reduce_coalesced")

    def reduce(self, tensors, opts=None):
        """``dist.reduce``: an all-reduce whose result torch reads on ``opts.rootRank`` only
        (the other ranks' tensors hold it too, which torch leaves unspecified)."""
        return self.allreduce(tensors, opts, what="reduce")

    def broadcast(self, tensors, opts=None):
        root = 0 if opts is None else opts.rootRank
        if not 0 <= root < self.size():
            raise ConfigError(f"diphoma: broadcast: src rank {root} is not in the group (ranks 0 to {self.size() - 1})")
        for t in tensors:
            _check(t, "broadcast")
        views = [self._view(t, "broadcast") for t in tensors]

        def job():
            for v in views:
                self.plane.broadcast(v.buf, root)
                v.done()

        return self._submit(job, tensors, opts)

    def allgather(self, output_tensors, input_tensors, opts=None):
        for outs, t in zip(output_tensors, input_tensors):
            _check(t, "all_gather")
            _same_layout("all_gather", outs, t, self.size())

        def job():
            for outs, t in zip(output_tensors, input_tensors):
                flat = self._gathered(t.reshape(-1))
                for r, o in enumerate(outs):
                    o.copy_(flat[r].view(o.shape))

        return self._submit(job, output_tensors, opts)

    def all_gather_single(self, output, input, opts=None):
        return self.all_gather_single_coalesced([output], [input], opts, "all_gather_into_tensor", output)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None, what="all_gather_into_tensor_coalesced",
                                    result=None):
        """The coalesced ``all_gather_into_tensor`` (FSDP, ``_coalescing_manager``): one
        all-gather per pair, in order, as one work (whose future holds ``result``, default
        ``outputs``)."""
        for o, i in zip(outputs, inputs):
            _check(o, what)
            _check(i, what)
            if o.numel() != i.numel() * self.size() or o.dtype != i.dtype:
                raise ConfigError(f"diphoma: {what} needs an output of world × the input's numel and dtype")
        views = [self._view(o, "allgather") for o in outputs]

        def job():
            for v, i in zip(views, inputs):
                flat = v.buf.view(self.size(), -1)
                flat[self.rank()].copy_(i.reshape(-1))
                self.plane.allgather(flat)
                v.done()

        return self._submit(job, outputs if result is None else result, opts)

    def _root_list(self, what, lists, like, root, name):
        """The tensor list only rank ``root`` passes (``name``: ``gather_list``,
        ``scatter_list``; torch hands it as ``[list]`` there and ``[]`` elsewhere), checked
        against ``like``; empty on the other ranks."""
        items = lists[0] if lists else []
        if self.rank() == root:
            _same_layout(what, items, like, self.size())
        elif items:
            raise ConfigError(f"diphoma: {what}: only rank {root} passes {name}")
        return items

    def gather(self, output_tensors, input_tensors, opts=None):
        """``dist.gather``: every rank's input lands on ``opts.rootRank`` (one all-gather of the
        inputs, read on the root)."""
        root = opts.rootRank
        (t,) = input_tensors
        _check(t, "gather")
        outs = self._root_list("gather", output_tensors, t, root, "gather_list")

        def job():
            flat = self._gathered(t.reshape(-1))
            for r, o in enumerate(outs):
                o.copy_(flat[r].view(o.shape))

        return self._submit(job, output_tensors, opts)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """``dist.scatter``: chunk ``r`` of ``opts.rootRank``'s list lands on rank ``r`` (one
        broadcast of the whole list, each rank keeping its chunk)."""
        root = opts.rootRank
        (out,) = output_tensors
        _check(out, "scatter")
        ins = self._root_list("scatter", input_tensors, out, root, "scatter_list")

        def job():
            flat = torch.empty((self.size(), out.numel()), dtype=out.dtype)
            for r, t in enumerate(ins):
                flat[r].copy_(t.reshape(-1))
            self.plane.broadcast(flat, root)
            out.copy_(flat[self.rank()].view(out.shape))

        return self._submit(job, output_tensors, opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """``dist.all_to_all``: input ``j`` goes to rank ``j``, output ``j`` comes from rank
        ``j`` (sizes may differ per pair)."""
        what = "all_to_all"
        for t in (*output_tensors, *input_tensors):
            _check(t, what)
        if len(output_tensors) != self.size() or len(input_tensors) != self.size():
            raise ConfigError(f"diphoma: {what} needs {self.size()} input and output tensors")
        dtype = input_tensors[0].dtype
        if any(t.dtype != dtype for t in (*output_tensors, *input_tensors)):
            raise ConfigError(f"diphoma: {what}: every tensor must have the dtype {dtype}")

        def job():
            flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
            got = self._exchange(what, flat_in, [t.numel() for t in input_tensors], [t.numel() for t in output_tensors])
            for o, g in zip(output_tensors, got):
                o.copy_(g.view(o.shape))

        return self._submit(job, output_tensors, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """``dist.all_to_all_single``: rows (dimension 0) of ``input`` split by
        ``input_split_sizes`` (even when empty) go to the ranks in order; ``output`` receives
        ``output_split_sizes[j]`` rows from rank ``j``."""
        what = "all_to_all_single"
        _check(output, what)
        _check(input, what)
        world = self.size()
        if output.dtype != input.dtype:
            raise ConfigError(f"diphoma: {what}: output dtype {output.dtype} differs from input dtype {input.dtype}")
        in_rows, out_rows = (input.shape[0] if input.dim() else 1), (output.shape[0] if output.dim() else 1)
        row = input.numel() // in_rows if in_rows else 0
        ins = (_ops.check_splits(what, input_split_sizes, in_rows, world, "input") if len(input_split_sizes)
               else _ops.even_splits(what, in_rows, world, "input"))
        outs = (_ops.check_splits(what, output_split_sizes, out_rows, world, "output") if len(output_split_sizes)
                else _ops.even_splits(what, out_rows, world, "output"))
        out_row = output.numel() // out_rows if out_rows else 0
        if in_rows and out_rows and row != out_row:
            raise ConfigError(f"diphoma: {what}: input rows of {row} elements, output rows of {out_row}")
        out = _InPlace(output)

        def job():
            got = self._exchange(what, input.reshape(-1), [n * row for n in ins], [n * out_row for n in outs])
            torch.cat(got, out=out.buf.view(-1))
            out.done()

        return self._submit(job, output, opts)

    alltoall_base = all_to_all_single

    def _exchange(self, what, flat_in, sends, receives):
        """The all-to-all core, in elements: this rank sends ``sends[j]`` elements of the
        contiguous ``flat_in`` (in rank order) to rank ``j`` and expects ``receives[j]`` from
        it; returns the received pieces by source rank. One all-gather of every rank's counts
        (a mismatch raises ``ConfigError`` naming the ranks on every rank), then one of the
        inputs padded to the longest: ``world`` times the bytes of a point-to-point exchange."""
        rank = self.rank()
        counts = self._gathered(torch.tensor(sends, dtype=torch.int64)).tolist()
        _ops.check_received(what, counts, rank, receives)
        longest = max(sum(c) for c in counts)
        padded = torch.zeros(longest, dtype=flat_in.dtype)
        padded[: flat_in.numel()] = flat_in
        every = self._gathered(padded)
        return [every[j, start : start + n] for j, (start, n) in enumerate(_ops.alltoall_offsets(counts, rank))]

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        what = "reduce_scatter"
        plans = []
        for out, ins in zip(output_tensors, input_tensors):
            _check(out, what)
            _same_layout(what, ins, out, self.size())
            plans.append(_ops.plan_reduction(what, out.dtype, _reduce_opts(opts)))

        def job():
            for out, ins, plan in zip(output_tensors, input_tensors, plans):
                flat = torch.cat([t.reshape(-1) for t in ins])
                self._scatter_into(flat, out, plan)

        return self._submit(job, output_tensors, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        return self.reduce_scatter_single_coalesced([output], [input], opts, "reduce_scatter_tensor", output)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None, what="reduce_scatter_tensor_coalesced",
                                        result=None):
        """The coalesced ``reduce_scatter_tensor`` (FSDP, ``_coalescing_manager``): one
        reduce-scatter per pair, in order, as one work (whose future holds ``result``, default
        ``outputs``)."""
        plans = []
        for output, input in zip(outputs, inputs):
            _check(output, what)
            _check(input, what)
            if input.numel() != output.numel() * self.size() or output.dtype != input.dtype:
                raise ConfigError(f"diphoma: {what} needs an input of world × the output's numel and dtype")
            plans.append(_ops.plan_reduction(what, output.dtype, _reduce_opts(opts)))

        def job():
            for output, input, plan in zip(outputs, inputs, plans):
                # The ring leaves partial sums in the other chunks: work on a copy of the input.
                self._scatter_into(input.reshape(-1).clone(), output, plan)

        return self._submit(job, outputs if result is None else result, opts)

    # Older torch releases call the tensor forms of all_gather_into_tensor and
    # reduce_scatter_tensor by these names.
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single

    def barrier(self, opts=None):
        return self._submit(lambda: self.plane.barrier(), [], opts)

    # -- point to point, over torch's store ---------------------------------------------
    def send(self, tensors, dst, tag=0):
        """``dist.send``/``isend``: the bytes of each tensor under a key of this (source,
        destination, tag) and the next sequence number in torch's store (the rendezvous
        store); returns a completed work. Matched in order with the destination's ``recv``."""
        for t in tensors:
            _check(t, "send")
        for t in tensors:
            self._p2p.send(t.contiguous(), self.rank(), dst, tag)
        w = _Work()
        w.done(tensors)
        return w

    def recv(self, tensors, src, tag=0):
        """``dist.recv``/``irecv``: waits (up to the group's timeout) for the matching
        ``send`` of rank ``src`` on a thread of its own; the work completes when every tensor
        is filled. A size or dtype that differs from the sent one raises ``ConfigError``
        naming both."""
        return self._recv(tensors, lambda t: self._p2p.recv(t, src, self.rank(), tag))

    def recv_anysource(self, tensors, tag=0):
        """``dist.recv(src=None)``: the first matching ``send`` of any rank; the work's
        ``_source_rank()`` names it."""
        others = [r for r in range(self.size()) if r != self.rank()]
        return self._recv(tensors, lambda t: self._p2p.recv_any(t, others, self.rank(), tag))

    recvAnysource = recv_anysource

    def _recv(self, tensors, take):
        for t in tensors:
            _check(t, "recv")
        work = _Work()
        work.fut = Future()
        views = [_InPlace(t) for t in tensors]
        # The sequence numbers are taken now, in call order; the waits may overlap.
        takes = [take(v.buf) for v in views]

        def run():
            try:
                for v, wait in zip(views, takes):
                    work.source = wait()
                    v.done()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                work.error = e
            work.fut.set_result(tensors)

        threading.Thread(target=run, name="diphoma-recv", daemon=True).start()
        return work

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """``dist.monitored_barrier``: as gloo's, every rank checks in with rank 0 through the
        store; rank 0 raises naming the first rank (every rank, with ``wait_all_ranks``) that
        did not arrive within ``timeout``, and the others raise if rank 0 does not release
        them within it."""
        seconds = (timeout or self._timeout).total_seconds()
        self._p2p.monitored_barrier(self.rank(), self.size(), seconds, wait_all_ranks)

    # -- coalescing (torch's _coalescing_manager with a device) ---------------------------
    def start_coalescing(self, device):
        self._coalesced = []

    def end_coalescing(self, device):
        """Waits for the works issued since ``start_coalescing`` and returns one completed
        work (they ran in call order already)."""
        works, self._coalesced = self._coalesced or [], None
        for w in works:
            w.wait()
        w = _Work()
        w.done([])
        return w

    # -- what torch asks a group's backend (batch_isend_irecv, FSDP2, DeviceMesh) ----------
    def _get_backend(self, device):
        """This group is its own (CPU) backend: torch's ``group._get_backend(device)`` returns
        it, and its answers below are a plain backend's."""
        return self

    @property
    def _device_types(self):
        """The devices this group serves, which torch's ``monitored_barrier`` and default-device
        choices read: the CPU, once torch has registered the group. Empty before, while torch
        builds it, so that its flight recorder (which needs a C++ backend to file entries
        under) leaves this group alone, as it does every Python group."""
        return [torch.device("cpu")] if self in dist.distributed_c10d._world.pg_map else []

    # torch names every group (``group_name``: destroy_process_group looks it up); a group
    # without registered backends keeps the name itself.
    def setGroupName(self, name):
        self._group_name = name

    def getGroupName(self):
        return getattr(self, "_group_name", "")

    supports_coalescing = False  # batch_isend_irecv: one call per operation
    supports_splitting = False  # new_group/DeviceMesh: a new ring per sub-group (_subring)
    _supports_time_estimate = False

    def supports_tensor_alloc(self, device):
        return False

    def getBackendName(self):
        return BACKEND

    def __repr__(self):
        return f"ProcessGroupDiphoma({self.ring!r})"


# A ring joined by the elastic runner, for the next group it creates (see _create).
_HANDOFF = []


def _create(store, rank, size, timeout):
    """The backend's constructor (``Backend.register_backend``). For the default group: takes
    the ring the elastic runner just joined, else joins the first generation of the membership
    source the environment describes (``diphoma.Follower.from_env``: the launcher's variables,
    its ring directory, or a worker pod's contract), bounding the join and each collective by
    ``init_process_group``'s ``timeout``. For a sub-group (``new_group``, ``DeviceMesh``): a
    ring of its members only (``_subring``). torch's ``store`` (this group's prefix) carries
    the sub-group's addresses and the point-to-point messages."""
    _staging.segment_bytes()  # a bad DIPHOMA_STAGING_SEGMENT_BYTES is refused before joining a ring
    if dist.is_initialized() and not _HANDOFF:
        return ProcessGroupDiphoma(_subring(store, rank, size), rank, size, store, timeout)
    plane = _plane.chosen()
    # Refused wherever they are set, not only in pods of several processes, where they apply.
    _plane.hierarchical_min_bytes()
    _plane.pod_library(os.environ, False)
    if _HANDOFF:
        ring = _HANDOFF.pop()
    else:
        try:
            follower = Follower.from_env(timeout=timeout.total_seconds())
        except ConfigError as e:
            if "DIPHOMA_RANK is not set" not in str(e):
                raise
            raise ConfigError(
                f"{e}: start it with python -m diphoma.run, which takes torchrun's flags and sets the "
                "ring's variables with torchrun's (not torchrun, mp.spawn or plain python), or run it in a DiphomaJob"
            ) from None
        # The in-pod launcher's (diphoma._pod): checked before joining, so that a process started
        # for a generation the ring has left never breaks the newer one its peers are forming.
        expected = os.environ.get("DIPHOMA_GENERATION")
        if expected and follower.pending_generation != int(expected):
            raise RingChanged(
                f"diphoma: the ring moved on to generation {follower.pending_generation} since this process was "
                f"started for generation {expected} (RANK and WORLD_SIZE are that generation's): the launcher restarts it"
            )
        if expected:
            _same_generation_store(store, rank, expected)
        ring = follower.connect()
        diphoma._set_follower(follower)
    if (ring.rank, ring.world) != (rank, size):
        raise ConfigError(
            f"diphoma: torch rank {rank}/world {size} differ from the ring's "
            f"DIPHOMA_RANK {ring.rank}/DIPHOMA_WORLD_SIZE {ring.world}"
        )
    metrics.RING_GENERATION.set(ring.generation)
    metrics.serve_if_configured(ring.host)
    group = ProcessGroupDiphoma(ring, rank, size, store, timeout, plane, _plane.processes_per_pod(size))
    group.main = True
    return group


def _same_generation_store(store, rank, generation):
    """In a pod (the in-pod launcher's ``DIPHOMA_GENERATION``): rank 0 posts the generation its
    process was started for in torch's rendezvous store, and every other rank checks it there.
    A process started for a new generation can connect to rank 0's previous process, which
    serves the store on the same address until its launcher replaces it (a joiner is often
    quicker), and would then wait for a ring whose rank 0 waits for it in the new store. Raises
    ``DistStoreError`` (a store fault: the launcher starts the process again) when the store is
    another generation's; a store that went away raises torch's own error."""
    key = "diphoma/generation"
    if rank == 0:
        store.set(key, generation)
        return
    served = store.get(key).decode()
    if served != generation:
        raise dist.DistStoreError(
            f"diphoma: the rendezvous store at MASTER_ADDR serves generation {served}, not {generation} this process "
            "was started for (rank 0's previous process): the launcher starts it again"
        )


def _subring(store, rank, size):
    """The ring of a sub-group whose member ``rank`` of ``size`` this process is: every member
    binds a free port on its ring host and posts it in the group's ``store``; the group's rank 0
    posts a random tag that keeps the sub-ring's handshakes apart from every other group's
    (``diphoma.Ring.subring``). Raises ``ConfigError`` when the default group is not a
    ``"diphoma"`` group or its store is a ``HashStore`` (``diphoma.torch.elastic.run``)."""
    parent = dist.distributed_c10d._get_default_group()
    if not isinstance(parent, ProcessGroupDiphoma):
        raise ConfigError('diphoma: new_group(backend="diphoma") needs a "diphoma" default process group')
    parent._p2p._usable("new_group")
    if rank == 0:
        store.set("diphoma/tag", secrets.token_hex(8))
    host = parent.ring.host
    port = free_ports(1, host)[0]
    store.set(f"diphoma/address/{rank}", f"{host}:{port}")
    addresses = [store.get(f"diphoma/address/{r}").decode() for r in range(size)]
    return parent.ring.subring(rank, addresses, store.get("diphoma/tag").decode())


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    # Progress for scripts that never call diphoma.report: their optimizer steps (a no-op
    # until a "diphoma" default group has joined a ring with a membership source).
    register_optimizer_step_post_hook(diphoma._optimizer_stepped)

from diphoma.torch.sampler import CollectiveTime, ElasticSampler  # noqa: E402  (after the registration)

__all__ = ["BACKEND", "ElasticSampler", "ProcessGroupDiphoma"]
