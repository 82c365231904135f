"""The decisions of the ``"diphoma"`` process group, as pure functions (no ring, no I/O): how a
reduction of a dtype and op runs on the ring, the local half of the reductions the ring does not
do, the layout of an all-to-all, and the checks that name a caller's mistake.

The ring reduces float32, float64, float16, bfloat16, int32 and int64 natively with SUM, AVG,
MAX and MIN. Everything else torch's collectives accept is mapped onto what the ring does:

- bool, uint8, int8 and int16 are widened to int32, reduced, and narrowed back (integer sums
  wrap as in gloo; a bool SUM is a logical or and PRODUCT a logical and, as NCCL maps them);
- PRODUCT, BAND, BOR and BXOR, and complex dtypes, are all-gathered (a byte collective: any
  dtype) and reduced locally, in rank order: ``world`` times the bytes of a native reduction;
- broadcast, all-gather, gather, scatter and all-to-all move bytes, so they take every dtype.

With ``DIPHOMA_COMPRESSION=bf16`` (``spec.ring.compression``) a float32 SUM or AVG all-reduce
runs on a bfloat16 copy: half the bytes on the wire, each hop's addition in float32 rounded to
bfloat16 for the next (the ring's bfloat16 reduction), the result cast back to float32 — what
DDP's ``bf16_compress_hook`` does, for every all-reduce of the group.
"""

import functools
import os

import torch
import torch.distributed as dist

from diphoma import ConfigError

# dtype -> the ring's name for it.
NATIVE = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int32: "int32",
    torch.int64: "int64",
}
# The ring's name -> dtype.
BY_NAME = {name: dtype for dtype, name in NATIVE.items()}
# The variable naming the wire dtype of float32 all-reductions, and its values.
ENV_COMPRESSION = "DIPHOMA_COMPRESSION"
COMPRESSIONS = {"none": None, "bf16": torch.bfloat16}
# Average natively (an f32 scale in the ring); the other native types sum and divide.
RING_AVERAGES = (torch.float32, torch.float16, torch.bfloat16)
# Reduced in int32 and narrowed back.
WIDENED = (torch.bool, torch.uint8, torch.int8, torch.int16)
# Reduced locally after an all-gather.
GATHERED_DTYPES = (torch.complex64, torch.complex128)

_NATIVE_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.MIN: "min",
}
_BITWISE = {
    dist.ReduceOp.BAND: torch.bitwise_and,
    dist.ReduceOp.BOR: torch.bitwise_or,
    dist.ReduceOp.BXOR: torch.bitwise_xor,
}


def op_label(op):
    """``op`` (a ``ReduceOp`` or its ``RedOpType``) by name, as torch prints it."""
    name = getattr(op, "op", op)  # a ReduceOp object prints as its address; its .op by name
    return str(name).rsplit(".", 1)[-1]


def _red_op_type(op):
    return getattr(op, "op", op)


def compression(environ=os.environ):
    """The wire dtype of float32 all-reductions ``DIPHOMA_COMPRESSION`` names: None for
    ``none`` (also unset or empty), ``torch.bfloat16`` for ``bf16``. Raises ``ConfigError``
    naming the variable for any other value."""
    name = environ.get(ENV_COMPRESSION, "").strip().lower() or "none"
    if name not in COMPRESSIONS:
        raise ConfigError(f"diphoma: {ENV_COMPRESSION}={name!r} is not a compression ({', '.join(COMPRESSIONS)})")
    return COMPRESSIONS[name]


class Plan:
    """How one reduction runs: ``kind`` is ``"native"`` (the ring reduces ``ring_dtype`` with
    ``ring_op``), ``"widen"`` (as native on a copy widened to int32, narrowed back),
    ``"compress"`` (as native on a float32 tensor's copy of the wire dtype ``ring_dtype``, cast
    back) or ``"gather"`` (all-gather, then ``local(stacked)`` over the rank dimension 0)."""

    __slots__ = ("kind", "ring_dtype", "ring_op", "local")

    def __init__(self, kind, ring_dtype=None, ring_op=None, local=None):
        self.kind, self.ring_dtype, self.ring_op, self.local = kind, ring_dtype, ring_op, local

    def __repr__(self):
        return f"Plan({self.kind}, {self.ring_dtype}, {self.ring_op})"


def plan_reduction(what, dtype, op, wire=None):
    """The :class:`Plan` of reduction collective ``what`` (its torch name, for errors) over
    tensors of ``dtype`` with ``op``; ``wire`` (``compression()``, for all-reduces) carries a
    float32 SUM or AVG in that dtype. Raises ``ConfigError`` naming the collective, the op or
    the dtype that no plan covers (PREMUL_SUM; bitwise ops on floating types; dtypes without
    arithmetic such as float8)."""
    kind = _red_op_type(op)
    if kind == dist.ReduceOp.PREMUL_SUM:
        raise ConfigError(f"diphoma: {what}: unsupported reduce op PREMUL_SUM (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR)")
    if kind in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise ConfigError(f"diphoma: {what}: reduce op {op_label(op)} needs an integer or bool tensor, got {dtype}")
    if dtype.is_complex and kind in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
        raise ConfigError(f"diphoma: {what}: reduce op {op_label(op)} has no order on complex tensors ({dtype})")
    if wire is not None and dtype == torch.float32 and kind in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        return Plan("compress", NATIVE[wire], _NATIVE_OPS[kind])
    if dtype in NATIVE and kind in _NATIVE_OPS:
        return Plan("native", NATIVE[dtype], _NATIVE_OPS[kind])
    if dtype in WIDENED and kind in _NATIVE_OPS:
        ring_op = _NATIVE_OPS[kind]
        if dtype == torch.bool:
            ring_op = {"sum": "max", "avg": "max"}.get(ring_op, ring_op)
        return Plan("widen", "int32", ring_op)
    if dtype in NATIVE or dtype in WIDENED or dtype in GATHERED_DTYPES:
        if kind in _NATIVE_OPS or kind in _BITWISE or kind == dist.ReduceOp.PRODUCT:
            return Plan("gather", local=functools.partial(local_reduce, kind))
    if kind not in _NATIVE_OPS and kind not in _BITWISE and kind != dist.ReduceOp.PRODUCT:
        raise ConfigError(f"diphoma: {what}: unsupported reduce op {op_label(op)} (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR)")
    raise ConfigError(
        f"diphoma: {what}: unsupported dtype {dtype} for reductions "
        "(float32, float64, float16, bfloat16, int64, int32, int16, int8, uint8, bool, complex64, complex128)"
    )


def local_reduce(kind, stacked):
    """Reduces ``stacked`` (``(world, …)``: every rank's tensor, in rank order) over dimension
    0 with ``kind`` (a ``RedOpType``); integer AVG truncates, as the ring's does."""
    world = stacked.shape[0]
    if kind == dist.ReduceOp.SUM:
        return _narrow(stacked.sum(0), stacked.dtype)
    if kind == dist.ReduceOp.PRODUCT:
        if stacked.dtype == torch.bool:
            return stacked.all(0)
        return _narrow(stacked.prod(0), stacked.dtype)
    if kind == dist.ReduceOp.MAX:
        return stacked.amax(0)
    if kind == dist.ReduceOp.MIN:
        return stacked.amin(0)
    if kind == dist.ReduceOp.AVG:
        if stacked.dtype == torch.bool:
            return stacked.any(0)
        s = stacked.sum(0)
        if stacked.is_floating_point() or stacked.is_complex():
            return (s / world).to(stacked.dtype)
        return s.div(world, rounding_mode="trunc").to(stacked.dtype)
    return functools.reduce(_BITWISE[kind], stacked.unbind(0))


def _narrow(t, dtype):
    return t if t.dtype == dtype else t.to(dtype)


def even_splits(what, rows, world, side):
    """``rows`` split evenly over ``world`` ranks (an all-to-all without split sizes); raises
    ``ConfigError`` naming ``what`` and ``side`` ("input", "output") when ``world`` does not
    divide ``rows``."""
    if rows % world:
        raise ConfigError(f"diphoma: {what}: the {side}'s {rows} rows do not split evenly over {world} ranks")
    return [rows // world] * world


def check_splits(what, splits, rows, world, side):
    """``splits`` (rows per rank) checked against ``rows`` and ``world``; returns them as a
    list of ints. Raises ``ConfigError`` naming ``side`` on a mismatch."""
    splits = [int(s) for s in splits]
    if len(splits) != world or any(s < 0 for s in splits) or sum(splits) != rows:
        raise ConfigError(
            f"diphoma: {what}: {side} split sizes {splits} must be {world} non-negative counts adding up to {rows} rows"
        )
    return splits


def alltoall_offsets(sent, rank):
    """Where each rank's rows for ``rank`` lie, from ``sent`` (``sent[j][i]``: rows rank ``j``
    sends to rank ``i``, a list of lists): ``[(start, count)]`` by source rank, ``start`` in
    rows from the beginning of the source's input."""
    return [(sum(row[:rank]), row[rank]) for row in sent]


def check_received(what, sent, rank, expected):
    """Raises ``ConfigError`` naming every source rank whose count for ``rank`` (``sent[j]
    [rank]``) differs from ``expected[j]``, the output split sizes ``rank`` was called with."""
    bad = [(j, row[rank], expected[j]) for j, row in enumerate(sent) if row[rank] != expected[j]]
    if bad:
        detail = "; ".join(f"rank {j} sends {got} rows, rank {rank} expects {want}" for j, got, want in bad)
        raise ConfigError(f"diphoma: {what}: split sizes disagree across ranks: {detail}")

