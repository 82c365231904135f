"""All-reduces through the segmented pipeline (``diphoma.torch._staging``) at the environment's
``DIPHOMA_STAGING_SEGMENT_BYTES`` (the test sets a few hundred bytes): odd sizes, every plan the
pipeline runs (native, widened, compressed under ``DIPHOMA_COMPRESSION``), non-contiguous
tensors, several tensors in one call, synchronous and asynchronous calls, each result exactly
against a reference every rank computes from every rank's deterministic input, and the number
and sizes of the ring collectives each call made (one per segment, none larger than a segment).
Prints "staging ok: N ring collectives" on rank 0.

With ``--mismatch``: rank 1 uses another segment size than the others (set here before the
group is made), and the first large all-reduce must fail with ``CollectiveMismatch`` or
``RingChanged`` on every rank (never hang); prints "mismatch refused".
"""

import os
import sys

import torch
import torch.distributed as dist

import diphoma
import diphoma.torch  # noqa: F401
from diphoma.torch import _staging

if "--mismatch" in sys.argv and os.environ["RANK"] == "1":
    os.environ[_staging.ENV_SEGMENT_BYTES] = "64"

dist.init_process_group(backend="diphoma")
rank, world = dist.get_rank(), dist.get_world_size()
group = dist.distributed_c10d._get_default_group()

if "--mismatch" in sys.argv:
    try:
        dist.all_reduce(torch.ones(1000))
    except (diphoma.CollectiveMismatch, diphoma.RingChanged) as e:
        print(f"rank {rank}: mismatch refused: {type(e).__name__}: {e}", flush=True)
        sys.exit(0)
    sys.exit(f"rank {rank}: an all-reduce with another segment size on rank 1 was not refused")

SEGMENT = _staging.segment_bytes()
assert SEGMENT == int(os.environ[_staging.ENV_SEGMENT_BYTES]), SEGMENT
COMPRESSED = os.environ.get("DIPHOMA_COMPRESSION") == "bf16"

calls = []  # bytes of each ring all-reduce
ring_allreduce = group.plane.allreduce


def counted(t, op):
    calls.append(t.numel() * t.element_size())
    return ring_allreduce(t, op)


group.plane.allreduce = counted


def value(r, n, dtype, salt=0):
    """Rank r's input: small integers, exact in every dtype and every partial sum (bool: r odd
    or i a multiple of 5)."""
    i = torch.arange(n, dtype=torch.int64)
    if dtype == torch.bool:
        return ((i + r) % 5 == 0)
    return ((i * 3 + r * 7 + salt) % 11 - 5).to(dtype)


def reference(op, xs):
    if xs[0].dtype == torch.bool:
        s = torch.stack(xs)
        return s.any(0) if op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG) else s.all(0)
    if op == dist.ReduceOp.SUM:
        return sum(xs[1:], xs[0])
    if op == dist.ReduceOp.MAX:
        return torch.stack(xs).amax(0)
    s = sum(x.double() for x in xs)
    if xs[0].is_floating_point():
        return (s / world).to(xs[0].dtype)
    return torch.div(s, world, rounding_mode="trunc").to(xs[0].dtype)


def ring_bytes(t, op):
    """The element size the ring reduces ``t`` in (its plan's dtype)."""
    from diphoma.torch import _ops

    plan = _ops.plan_reduction("all_reduce", t.dtype, op, group.wire)
    assert plan.kind in _staging.PIPELINED, plan
    return _ops.BY_NAME[plan.ring_dtype].itemsize


def expected_calls(tensors, op):
    got = []
    for t in tensors:
        size = ring_bytes(t, op)
        got += [n * size for _, n in _staging.segments(t.numel(), size, SEGMENT)]
    return got


SIZES = [0, 1, 7, 49, 50, 51, 333, 1001]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int8, torch.bool]
total = 0
for dtype in DTYPES:
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG):
        if dtype == torch.bool and op == dist.ReduceOp.AVG:
            continue
        for n in SIZES:
            what = f"{dtype} {op} n={n}"
            calls.clear()
            t = value(rank, n, dtype)
            want = reference(op, [value(r, n, dtype) for r in range(world)])
            dist.all_reduce(t, op=op)
            if op == dist.ReduceOp.AVG and dtype in (torch.float32, torch.bfloat16):
                # The ring averages these with a float32 scale (and in bfloat16 under
                # compression): within rounding of the reference's float64 division.
                tol = 1e-2 if COMPRESSED or dtype == torch.bfloat16 else 1e-6
                torch.testing.assert_close(t, want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")
            else:
                assert torch.equal(t, want), f"{what}: {t} != {want}"
            assert calls == expected_calls([t], op), f"{what}: ring calls {calls}"
            assert all(c <= max(SEGMENT, 8) for c in calls), f"{what}: {calls}"
            total += len(calls)

# Non-contiguous tensors, several tensors in one call, and asynchronous calls in flight together.
a = torch.stack([value(rank, 301, torch.float32), value(rank, 301, torch.float32, 1)], 1)  # (301, 2)
b = value(rank, 257, torch.float32, 2)
c = value(rank, 99, torch.float32, 3)[::2]  # non-contiguous
tensors = [a.t(), b, c]  # a.t() is non-contiguous too
wants = [reference(dist.ReduceOp.SUM, [x(r) for r in range(world)]) for x in (
    lambda r: torch.stack([value(r, 301, torch.float32), value(r, 301, torch.float32, 1)], 1).t(),
    lambda r: value(r, 257, torch.float32, 2),
    lambda r: value(r, 99, torch.float32, 3)[::2])]
calls.clear()
work = dist.all_reduce_coalesced(tensors, async_op=True)
second = value(rank, 500, torch.float32, 4)
work2 = dist.all_reduce(second, async_op=True)
work.wait()
work2.wait()
for got, want in zip(tensors, wants):
    assert torch.equal(got, want), f"coalesced: {got} != {want}"
assert torch.equal(second, reference(dist.ReduceOp.SUM, [value(r, 500, torch.float32, 4) for r in range(world)]))
assert calls == expected_calls(tensors, dist.ReduceOp.SUM) + expected_calls([second], dist.ReduceOp.SUM), calls
total += len(calls)

# A float32 SUM under compression crosses the wire as bfloat16 segments (half the bytes).
calls.clear()
t = value(rank, 1001, torch.float32)
dist.all_reduce(t)
assert torch.equal(t, reference(dist.ReduceOp.SUM, [value(r, 1001, torch.float32) for r in range(world)]))
per = 2 if COMPRESSED else 4
assert calls == [n * per for _, n in _staging.segments(1001, per, SEGMENT)], calls

if rank == 0:
    print(f"staging ok: {total} ring collectives, segment {SEGMENT} bytes, compressed {COMPRESSED}", flush=True)
dist.destroy_process_group()
