"""The ``torch.distributed`` backend ``"diphoma"``: importing this module registers it.

An unchanged DDP script changes only ``dist.init_process_group(backend="diphoma")`` and is
started by ``python -m diphoma.run`` (which also sets torch's ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT`` for the rendezvous). The process group is a Python subclass of
``torch.distributed.ProcessGroup``; each collective is checked at once (CPU tensors of a
supported dtype, a supported op: otherwise ``diphoma.ConfigError`` naming what is wrong). An
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
import queue
import threading
import weakref

import torch
import torch.distributed as dist
from torch.futures import Future

import diphoma
from diphoma import ConfigError, Follower, RingChanged

BACKEND = "diphoma"

_DTYPES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int32: "int32",
    torch.int64: "int64",
}
# Average natively (an f32 scale in the ring); the others sum and divide here.
_RING_AVERAGES = (torch.float32, torch.float16, torch.bfloat16)
_OPS = (
    (dist.ReduceOp.SUM, "sum"),
    (dist.ReduceOp.AVG, "avg"),
    (dist.ReduceOp.MAX, "max"),
    (dist.ReduceOp.MIN, "min"),
)


# The process groups whose thread runs: stopped at exit, before the interpreter finalizes, so no
# thread is inside torch's C++ (completing a future) when daemon threads are torn down.
_LIVE = weakref.WeakSet()
_STOP = object()


@atexit.register
def _shutdown_all():
    for pg in list(_LIVE):
        pg.shutdown()


def _op_name(op):
    for known, name in _OPS:
        if op == known:
            return name
    name = getattr(op, "op", op)  # a ReduceOp object prints as its address; its .op by name
    raise ConfigError(f"diphoma: unsupported reduce op {name} (SUM, AVG, MAX, MIN)")


def _check(t):
    """Raises ConfigError unless ``t`` is a CPU tensor of a supported dtype."""
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"diphoma: expected a tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise ConfigError(
            f"diphoma: tensor on device {t.device} is not supported (CPU tensors only; no GPU path yet)"
        )
    if t.dtype not in _DTYPES:
        raise ConfigError(
            f"diphoma: unsupported dtype {t.dtype} "
            "(float32, float64, float16, bfloat16, int32, int64)"
        )


def _reduce_opts(opts):
    return dist.ReduceOp.SUM if opts is None else opts.reduceOp


class _InPlace:
    """A contiguous view of ``t`` for the ring: ``t`` itself when it is contiguous (no copy),
    else a contiguous copy written back by ``done()``."""

    def __init__(self, t):
        self.t = t
        self.buf = t if t.is_contiguous() else t.contiguous()

    def done(self):
        if self.buf is not self.t:
            self.t.copy_(self.buf)


class _Work(dist.Work):
    """One collective's handle. Its future always completes with the collective's output;
    ``wait()`` raises the collective's error. torch 2.15's DDP reducer crashes the interpreter
    (SIGSEGV in backward) on a future completed with an exception, so a failure reaches DDP
    as a completed bucket and then as the group's error: every later call raises
    ``RingChanged`` (and ``diphoma.torch.elastic``'s ``State.commit`` checks it first).

    A collective that ran on the caller's thread returns its ``Work`` already completed
    (``done(result)`` before it is handed out): its future is made only if ``get_future()`` is
    called, as torch's own ``all_reduce(async_op=False)`` never does."""

    def __init__(self):
        super().__init__()
        self.fut = None  # made by the submitter (queued work) or by get_future() (completed)
        self.result = None
        self.completed = False
        self.error = None

    def done(self, result):
        """Completes a work that nobody can wait on yet (no future made)."""
        self.result, self.completed = result, True

    def wait(self, timeout=None):
        if not self.completed:
            self.fut.wait()
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self):
        return self.completed or self.fut.done()

    def is_success(self):
        return self.is_completed() and self.error is None

    def get_future(self):
        if self.fut is None:
            self.fut = Future()
            self.fut.set_result(self.result)
        return self.fut


class ProcessGroupDiphoma(dist.ProcessGroup):
    """A ``torch.distributed`` process group over one ``diphoma.Ring``.

    Collectives are validated on the caller's thread and run in call order (the ring needs every
    rank to issue the same collectives in the same order): asynchronous ones on one background
    thread, synchronous ones (``opts.asyncOp`` false) on the caller's thread once the background
    thread has nothing left before them.
    """

    def __init__(self, ring, rank, size):
        super().__init__(rank, size)
        self.ring = ring
        self._queue = queue.SimpleQueue()
        # Collectives submitted and not yet run (queued, or running inline): a synchronous call
        # runs inline only at 0 (else it would overtake them).
        self._queued = 0
        self._count_lock = threading.Lock()
        self._stopped = False
        self.error = None  # the first collective that failed: the group is unusable after it
        self.blocked = CollectiveTime()  # the caller's waits for the ring (ElasticSampler's speed)
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
            self.ring = None
        _LIVE.discard(self)

    # -- machinery ---------------------------------------------------------------------
    def _serve(self):
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            job, work, result = item
            self._run(job, work)
            self.blocked.completed()
            with self._count_lock:  # the ring is free: a synchronous call may run inline now
                self._queued -= 1
            work.fut.set_result(result)

    def _run(self, job, work):
        """Runs ``job``; its error goes to ``work`` and becomes the group's."""
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            work.error = e
            self.error = self.error or e

    def _submit(self, job, result, opts=None):
        """Runs ``job`` in call order and returns its ``Work``: on the caller's thread when the
        caller will wait for it at once (``opts.asyncOp`` false, as torch sets it for
        ``async_op=False``) and nothing is queued before it; else on the background thread."""
        if self._stopped:
            raise ConfigError("diphoma: the process group is shut down")
        if self.error is not None:
            raise RingChanged(f"an earlier collective of this group failed: {self.error}")
        work = _Work()
        self.blocked.submitted()
        with self._count_lock:
            inline = self._queued == 0 and not getattr(opts, "asyncOp", True)
            self._queued += 1
            if not inline:
                work.fut = Future()
                self._queue.put((job, work, result))
        if inline:
            self._run(job, work)
            self.blocked.completed()
            with self._count_lock:
                self._queued -= 1
            work.done(result)
        return work

    def _reduce(self, native, t, op):
        """``native`` (the ring's allreduce or reduce_scatter) on the contiguous ``t`` with op
        ``op``: averages of types the ring does not average are sums divided here."""
        if op == "avg" and t.dtype not in _RING_AVERAGES:
            native(t.data_ptr(), t.numel(), _DTYPES[t.dtype], "sum")
            if t.is_floating_point():
                t.div_(self.size())
            else:
                t.div_(self.size(), rounding_mode="trunc")
        else:
            native(t.data_ptr(), t.numel(), _DTYPES[t.dtype], op)

    # -- collectives -------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        op = _op_name(_reduce_opts(opts))
        for t in tensors:
            _check(t)
        views = [_InPlace(t) for t in tensors]

        def job():
            for v in views:
                self._reduce(self.ring.allreduce, v.buf, op)
                v.done()

        return self._submit(job, tensors, opts)

    def broadcast(self, tensors, opts=None):
        root = 0 if opts is None else opts.rootRank
        for t in tensors:
            _check(t)
        views = [_InPlace(t) for t in tensors]

        def job():
            for v in views:
                self.ring.broadcast(v.buf.data_ptr(), v.buf.numel() * v.buf.element_size(), root)
                v.done()

        return self._submit(job, tensors, opts)

    def allgather(self, output_tensors, input_tensors, opts=None):
        for outs, t in zip(output_tensors, input_tensors):
            _check(t)
            if len(outs) != self.size():
                raise ConfigError(f"diphoma: allgather needs {self.size()} outputs, got {len(outs)}")
            for o in outs:
                _check(o)
                if o.numel() != t.numel() or o.dtype != t.dtype:
                    raise ConfigError("diphoma: allgather outputs must match the input's numel and dtype")
        work = [(outs, torch.empty((self.size(), t.numel()), dtype=t.dtype), t) for outs, t in zip(output_tensors, input_tensors)]

        def job():
            for outs, flat, t in work:
                flat[self.rank()].copy_(t.reshape(-1))
                self.ring.allgather(flat.data_ptr(), flat.numel() * flat.element_size())
                for r, o in enumerate(outs):
                    o.copy_(flat[r].view(o.shape))

        return self._submit(job, output_tensors, opts)

    def all_gather_single(self, output, input, opts=None):
        _check(output)
        _check(input)
        if output.numel() != input.numel() * self.size() or output.dtype != input.dtype:
            raise ConfigError("diphoma: all_gather_into_tensor needs an output of world × the input's numel and dtype")
        out = _InPlace(output)

        def job():
            flat = out.buf.view(self.size(), -1)
            flat[self.rank()].copy_(input.reshape(-1))
            self.ring.allgather(flat.data_ptr(), flat.numel() * flat.element_size())
            out.done()

        return self._submit(job, output, opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = _op_name(_reduce_opts(opts))
        for out, ins in zip(output_tensors, input_tensors):
            _check(out)
            if len(ins) != self.size():
                raise ConfigError(f"diphoma: reduce_scatter needs {self.size()} inputs, got {len(ins)}")
            for t in ins:
                _check(t)
                if t.numel() != out.numel() or t.dtype != out.dtype:
                    raise ConfigError("diphoma: reduce_scatter inputs must match the output's numel and dtype")

        def job():
            for out, ins in zip(output_tensors, input_tensors):
                flat = torch.cat([t.reshape(-1) for t in ins])
                self._scatter_into(flat, out, op)

        return self._submit(job, output_tensors, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        op = _op_name(_reduce_opts(opts))
        _check(output)
        _check(input)
        if input.numel() != output.numel() * self.size() or output.dtype != input.dtype:
            raise ConfigError("diphoma: reduce_scatter_tensor needs an input of world × the output's numel and dtype")

        def job():
            # The ring leaves partial sums in the other chunks: work on a copy of the input.
            self._scatter_into(input.reshape(-1).clone(), output, op)

        return self._submit(job, output, opts)

    def _scatter_into(self, flat, out, op):
        """Reduce-scatters the contiguous ``flat`` (world equal chunks) and copies this rank's
        reduced chunk into ``out``."""
        mine = flat.view(self.size(), -1)[self.rank()]
        if op == "avg" and flat.dtype not in _RING_AVERAGES:
            self.ring.reduce_scatter(flat.data_ptr(), flat.numel(), _DTYPES[flat.dtype], "sum")
            mine = mine / self.size() if flat.is_floating_point() else mine.div(self.size(), rounding_mode="trunc")
        else:
            self.ring.reduce_scatter(flat.data_ptr(), flat.numel(), _DTYPES[flat.dtype], op)
        out.copy_(mine.view(out.shape))

    # Older torch releases call the tensor forms of all_gather_into_tensor and
    # reduce_scatter_tensor by these names.
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single

    def barrier(self, opts=None):
        return self._submit(lambda: self.ring.barrier(), [], opts)

    def getBackendName(self):
        return BACKEND

    def __repr__(self):
        return f"ProcessGroupDiphoma({self.ring!r})"


# A ring joined by the elastic runner, for the next group it creates (see _create).
_HANDOFF = []


def _create(store, rank, size, timeout):
    """The backend's constructor (``Backend.register_backend``): takes the ring the elastic
    runner just joined, else joins the first generation of the membership source the
    environment describes (``diphoma.Follower.from_env``: the launcher's variables, its ring
    directory, or a worker pod's contract), bounding the join and each collective by
    ``init_process_group``'s ``timeout``; torch's store is used only by torch's own
    rendezvous."""
    if _HANDOFF:
        ring = _HANDOFF.pop()
    else:
        follower = Follower.from_env(timeout=timeout.total_seconds())
        ring = follower.connect()
        diphoma._set_follower(follower)
    if (ring.rank, ring.world) != (rank, size):
        raise ConfigError(
            f"diphoma: torch rank {rank}/world {size} differ from the ring's "
            f"DIPHOMA_RANK {ring.rank}/DIPHOMA_WORLD_SIZE {ring.world}"
        )
    return ProcessGroupDiphoma(ring, rank, size)


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])

from diphoma.torch.sampler import CollectiveTime, ElasticSampler  # noqa: E402  (after the registration)

__all__ = ["BACKEND", "ElasticSampler", "ProcessGroupDiphoma"]
