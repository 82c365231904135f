"""The pipelined host staging of the ``"diphoma"`` group's all-reduces (issue 27, item 3).

The ring reduces host memory. An all-reduce (also ``reduce`` and ``all_reduce_coalesced``)
whose plan the ring runs (``_ops`` plan kinds ``native``, ``widen`` and ``compress``) is cut into
segments of at most ``DIPHOMA_STAGING_SEGMENT_BYTES`` bytes of the ring's dtype (``segments``,
default ``SEGMENT_BYTES``, 4 MiB) and each segment is reduced around the ring on its own, in
``pipeline``'s order:

    copy_in(0), copy_in(1), reduce(0), copy_out(0), copy_in(2), reduce(1), copy_out(1), ...

For a CUDA tensor (``_CudaSide``) ``copy_in`` queues the segment's device-to-host copy into a
pinned buffer on the group's copy stream of that device (a ``torch.cuda.Stream`` of its own)
and returns an event the ring thread waits on before it reduces the segment; ``copy_out``
queues the host-to-device copy on the same stream. While the ring reduces segment i on the
host, segment i+1's device-to-host copy and segment i−1's host-to-device copy run on the
copy stream: the PCIe copies hide behind the ring's transfer, and the tensor never needs
pinned memory of its full size (``DEPTH`` pinned segment buffers per device, reused in turn:
the copy stream runs its copies in the order they were queued, so a buffer's next
device-to-host copy starts after its previous host-to-device copy ended, and the ring thread
writes a buffer only after the event of the copy into it).

The caller's thread never waits for the GPU: ``Stager.ready`` records an event on the caller's
current stream at call time, and the copy stream waits on it (``Stream.wait_event``) before
its first copy, so the collective reads what the caller's work queued before the call wrote.
The work's end is an event recorded on the copy stream after the last copy back
(``Completion``): ``Work.wait()`` makes the caller's current stream wait on it, and the work's
future is CUDA-aware (``torch.futures.Future(devices=...)``, completed with the copy streams
current), so DDP's reducer, which waits on the future, gets the same ordering.

A ``compress`` plan (float32 carried as bfloat16 under ``DIPHOMA_COMPRESSION=bf16``) and a
``widen`` plan (bool and small integers reduced as int32) cast each segment on the device, on
the copy stream, before its copy to the host, and cast it back there after its copy back:
under compression half the PCIe bytes of the float32 tensor.

CPU tensors take the same ``pipeline`` (``_HostSide``: a contiguous tensor is reduced in
place; a cast is made per segment) in one segment, the whole tensor (``host_segment_bytes``):
there is no copy to overlap, and each segment would be one ring collective more (a few hundred
microseconds per 4 MiB). Where ``DIPHOMA_STAGING_SEGMENT_BYTES`` is set, CPU tensors are cut
into its segments too, as CUDA tensors are: the pipeline's real path on the CPU (the tests
run it so). Every rank must use the same segment sizes (as for ``DIPHOMA_COMPRESSION``; a group
whose ranks hold CPU and CUDA tensors needs the variable set): a rank that differs fails its
first large all-reduce with ``CollectiveMismatch``.

Broadcast and all-gather keep the simple staging (``diphoma.torch._InPlace``: one blocking copy
each way of the whole tensor, not overlapped), as do all-reduces whose plan all-gathers
(PRODUCT, bitwise ops, complex dtypes).
"""

import collections
import contextlib
import os
import sys
import threading

import torch
from torch.futures import Future

from diphoma import ConfigError

ENV_SEGMENT_BYTES = "DIPHOMA_STAGING_SEGMENT_BYTES"
# The default segment: large enough that the ring's per-collective latency (a few hundred µs for
# 2·(world−1) steps) stays small against its transfer, small enough that a 25 MiB DDP bucket
# is several segments whose copies overlap.
SEGMENT_BYTES = 4 << 20
# Pinned segment buffers per device: the segment the ring reduces, the next one's
# device-to-host copy and the previous one's host-to-device copy.
DEPTH = 3
# The plan kinds (``_ops.Plan.kind``) the ring reduces, which the pipeline runs.
PIPELINED = ("native", "widen", "compress")


def segment_bytes(environ=os.environ):
    """The staging segment size ``DIPHOMA_STAGING_SEGMENT_BYTES`` names (a positive integer
    of bytes; default ``SEGMENT_BYTES`` when unset or empty). ``ConfigError`` naming the
    variable for anything else."""
    raw = environ.get(ENV_SEGMENT_BYTES, "").strip()
    if not raw:
        return SEGMENT_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"diphoma: {ENV_SEGMENT_BYTES}={raw!r} is not a positive number of bytes "
                          f"(the all-reduce staging segment; default {SEGMENT_BYTES})")
    return value


def host_segment_bytes(environ=os.environ):
    """The segment size of CPU tensors: the whole tensor (``sys.maxsize``) unless
    ``DIPHOMA_STAGING_SEGMENT_BYTES`` is set, then that (``segment_bytes``)."""
    return segment_bytes(environ) if environ.get(ENV_SEGMENT_BYTES, "").strip() else sys.maxsize


def segments(numel, element_size, max_bytes):
    """The segments of a tensor of ``numel`` elements of ``element_size`` bytes, each of at
    most ``max_bytes`` bytes (at least one element each): ``(start, count)`` pairs in
    elements, in order, covering ``0..numel`` exactly; none for an empty tensor (pure)."""
    per = max(1, max_bytes // element_size)
    return [(start, min(per, numel - start)) for start in range(0, numel, per)]


def pipeline(segments, copy_in, reduce, copy_out):
    """Runs ``segments`` through the staging pipeline, in order: ``copy_in(segment)`` queues the
    segment's copy into host memory and returns what to wait on before reducing it (an object
    with ``synchronize()``, such as a ``torch.cuda.Event``, or None when the copy is done);
    ``reduce(segment)`` reduces it around the ring; ``copy_out(segment)`` queues its copy back.
    The copy of segment i+1 is queued before segment i is reduced, and the copy back of
    segment i before segment i+1 is reduced, so on a GPU both run while the ring reduces. The
    one pipeline of the CUDA path and of the CPU path (and of the tests)."""
    if not segments:
        return
    ready = copy_in(segments[0])
    for i, segment in enumerate(segments):
        following = copy_in(segments[i + 1]) if i + 1 < len(segments) else None
        if ready is not None:
            ready.synchronize()
        reduce(segment)
        copy_out(segment)
        ready = following


class Completion:
    """The CUDA side of one work whose results copy streams write: ``devices`` (the CUDA
    devices of its tensors, for a CUDA-aware future) and, once its job queued its last copy,
    ``done``: each device's copy stream and the event recorded there after it."""

    def __init__(self, devices):
        self.devices = devices
        self.done = []  # (stream, event), appended by Stager.allreduce on the ring thread

    def future(self):
        """A future whose waiters' current streams wait for the copy streams (``complete``)."""
        return Future(devices=self.devices)

    def complete(self, fut, result):
        """Sets ``fut``'s result with each copy stream current on its device, so that the future
        records its events there: a waiter (``fut.wait()``, ``then`` callbacks, DDP's reducer)
        has its stream wait for the copies back, without a host synchronisation."""
        with contextlib.ExitStack() as streams:
            for stream, _ in self.done:
                streams.enter_context(torch.cuda.stream(stream))
            fut.set_result(result)

    def wait(self):
        """Makes the caller's current stream of each device wait for the copies back (no host
        synchronisation)."""
        for stream, event in self.done:
            torch.cuda.current_stream(stream.device).wait_event(event)


class Stager:
    """One process group's staging: its segment size, and per CUDA device a copy stream and
    ``DEPTH`` pinned segment buffers, kept for the group's life (each made at its first use,
    as large as the segment that needs it, grown by powers of two up to the segment size; a
    buffer replaced by a larger one is kept until the copies queued so far are done)."""

    def __init__(self, segment_bytes=SEGMENT_BYTES, host_segment_bytes=sys.maxsize):
        self.segment_bytes = segment_bytes
        self.host_segment_bytes = host_segment_bytes  # CPU tensors' (``host_segment_bytes()``)
        self._lock = threading.Lock()
        self._streams = {}  # device index -> copy stream
        self._pools = {}  # device index -> DEPTH pinned uint8 buffers (None: not made yet)
        self._retired = []  # buffers replaced by larger ones, kept until the next done event
        # (events, kept) of works whose copies may still run: device tensors of the staging
        # (casts, contiguous copies) are dropped once their events completed.
        self._pending = collections.deque()

    def copy_stream(self, device):
        with self._lock:
            stream = self._streams.get(device.index)
            if stream is None:
                stream = self._streams[device.index] = torch.cuda.Stream(device=device)
            return stream

    def _buffer(self, index, slot, nbytes):
        """Pinned buffer ``slot`` of device ``index``'s pool, of at least ``nbytes`` bytes."""
        pool = self._pools.setdefault(index, [None] * DEPTH)
        buffer = pool[slot]
        if buffer is None or buffer.numel() < nbytes:
            if buffer is not None:
                self._retired.append(buffer)  # copies queued from or into it may still run
            size = max(nbytes, min(self.segment_bytes, max(4096, 1 << (nbytes - 1).bit_length())))
            buffer = pool[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return buffer

    def ready(self, tensors):
        """On the caller's thread, at call time: an event recorded on the caller's current
        stream of each CUDA device of ``tensors`` (``{device index: event}``; the copy stream
        waits on it before it reads), and each CUDA tensor marked as used by its copy stream
        (``record_stream``: the caching allocator does not hand its memory out again before
        the copies are done, even if the caller drops it first). No host synchronisation."""
        events = {}
        for t in tensors:
            if t.is_cpu:
                continue
            index = t.device.index
            if index not in events:
                events[index] = torch.cuda.Event()
                events[index].record(torch.cuda.current_stream(t.device))
            t.record_stream(self.copy_stream(t.device))
        return events

    def allreduce(self, entries, reduce, ready, completion=None):
        """Runs on the ring thread: all-reduces each ``(tensor, ring_dtype)`` of ``entries`` in
        place, through one ``pipeline`` over the segments of them all, in order;
        ``reduce(host, k)`` reduces the contiguous host segment ``host`` of entry ``k`` around
        the ring (in ``ring_dtype``). ``ready`` is ``ready()``'s events (CUDA entries);
        ``completion`` gets each device's copy stream and done event."""
        self._release()
        devices = sorted(ready)
        with contextlib.ExitStack() as scope:
            for index in devices:
                stream = self._streams[index]
                scope.enter_context(torch.cuda.device(index))
                scope.enter_context(torch.cuda.stream(stream))
                stream.wait_event(ready[index])  # the caller's work queued before the call
            sides, counters = [], {}
            try:
                for t, ring_dtype in entries:
                    if t.is_cpu:
                        sides.append(_HostSide(t, ring_dtype))
                    else:
                        index = t.device.index
                        side = _CudaSide(t, ring_dtype, self._streams[index],
                                         lambda slot, nbytes, index=index: self._buffer(index, slot, nbytes),
                                         counters.setdefault(index, [0]))
                        sides.append(side)
                order = [(k, start, count) for k, side in enumerate(sides)
                         for start, count in segments(side.numel, side.element_size,
                                                      self.host_segment_bytes if isinstance(side, _HostSide)
                                                      else self.segment_bytes)]
                pipeline(order,
                         lambda s: sides[s[0]].copy_in(s),
                         lambda s: reduce(sides[s[0]].host[s], s[0]),
                         lambda s: sides[s[0]].copy_out(s))
            finally:
                try:
                    for side in sides:
                        side.finish()  # a non-contiguous tensor's write-back, queued before the done event
                finally:
                    self._record_done(devices, sides, completion)

    def _record_done(self, devices, sides, completion):
        """Records each device's done event on its copy stream, after everything queued there."""
        events = []
        for index in devices:
            done = torch.cuda.Event()
            done.record(self._streams[index])
            events.append(done)
            if completion is not None:
                completion.done.append((self._streams[index], done))
        if events:
            self._pending.append((events, sides, self._retired))
            self._retired = []

    def _release(self):
        """Drops the staging tensors of works whose copies have all completed (oldest first)."""
        while self._pending and all(e.query() for e in self._pending[0][0]):
            self._pending.popleft()

    def close(self):
        """Waits for the copies still queued on the copy streams (at shutdown)."""
        for stream in self._streams.values():
            stream.synchronize()
        self._pending.clear()
        self._retired = []


class _HostSide:
    """A CPU tensor's side of the pipeline: its segments are reduced in place when it is
    contiguous and of the ring's dtype; else on a contiguous copy, written back by
    ``finish()``, and in the ring's dtype through a cast per segment."""

    def __init__(self, t, ring_dtype):
        self.t, self.copied = t, not t.is_contiguous()
        self.flat = t.contiguous().view(-1)
        self.ring_dtype = ring_dtype
        self.numel = t.numel()
        self.element_size = ring_dtype.itemsize
        self.host = {}  # segment -> its host tensor, from copy_in to copy_out

    def copy_in(self, segment):
        _, start, count = segment
        part = self.flat[start:start + count]
        self.host[segment] = part if part.dtype == self.ring_dtype else part.to(self.ring_dtype)
        return None

    def copy_out(self, segment):
        _, start, count = segment
        host = self.host.pop(segment)
        if host.dtype != self.flat.dtype:
            self.flat[start:start + count].copy_(host)

    def finish(self):
        if self.copied:
            self.t.copy_(self.flat.view(self.t.shape))


class _CudaSide:
    """A CUDA tensor's side of the pipeline, on the ring thread with its device's copy
    ``stream`` current: each segment is copied (cast first, when the ring's dtype differs) into
    the next of the device's ``DEPTH`` pinned buffers (``buffer(slot, nbytes)``; ``counter``:
    the device's segments of this all-reduce so far) with a non-blocking copy on the copy stream, whose event ``copy_in`` returns;
    ``copy_out`` queues the copy back (and the cast back) on the copy stream. A non-contiguous
    tensor goes through a contiguous device copy, written back by ``finish()`` on the copy
    stream."""

    def __init__(self, t, ring_dtype, stream, buffer, counter):
        self.t, self.stream, self.buffer, self.counter = t, stream, buffer, counter
        self.copied = not t.is_contiguous()
        self.ring_dtype = ring_dtype
        self.numel = t.numel()
        self.element_size = ring_dtype.itemsize
        if not self.copied:
            self.flat = t.view(-1)
        else:  # allocated and filled on the copy stream (the current one), after the caller's work
            self.flat = torch.empty(self.numel, dtype=t.dtype, device=t.device)
            self.flat.view(t.shape).copy_(t)
        # The device tensor in the ring's dtype, made per segment on the copy stream.
        self.wire = None if ring_dtype == t.dtype else torch.empty(self.numel, dtype=ring_dtype, device=t.device)
        self.host = {}  # segment -> its pinned host view, from copy_in to copy_out

    def copy_in(self, segment):
        _, start, count = segment
        source = self.flat[start:start + count]
        if self.wire is not None:
            self.wire[start:start + count].copy_(source)  # the cast, on the device
            source = self.wire[start:start + count]
        nbytes = count * self.element_size
        buffer = self.buffer(self.counter[0] % DEPTH, nbytes)
        self.counter[0] += 1
        host = buffer[:nbytes].view(self.ring_dtype)
        host.copy_(source, non_blocking=True)  # device to pinned host, on the copy stream
        self.host[segment] = host
        copied = torch.cuda.Event()
        copied.record(self.stream)
        return copied

    def copy_out(self, segment):
        _, start, count = segment
        host = self.host.pop(segment)
        if self.wire is None:
            self.flat[start:start + count].copy_(host, non_blocking=True)
        else:
            self.wire[start:start + count].copy_(host, non_blocking=True)
            self.flat[start:start + count].copy_(self.wire[start:start + count])  # the cast back

    def finish(self):
        if self.copied:
            self.t.copy_(self.flat.view(self.t.shape))
