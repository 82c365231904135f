"""Every c10d operation the libraries call, against gloo in the same run (scripts/ops_vs_gloo.py),
the named failures of monitored_barrier, and the pure decisions of ``diphoma.torch._ops``."""

import os

import pytest
import torch
import torch.distributed as dist

import diphoma
from diphoma.torch import _ops
from conftest import check, launch


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_operation_matches_gloo(world):
    """all_reduce, reduce, reduce_scatter_tensor over every dtype and op; broadcast, gather,
    scatter, all_gather, all_to_all(_single, uneven) over every dtype; point to point, object
    collectives, coalescing, monitored_barrier, new_group and DeviceMesh sub-groups, and a
    second init_process_group: each against a gloo group of the same ranks."""
    p = check(launch(world, "ops_vs_gloo.py", timeout=200))
    assert "ops ok" in p.stdout, p.stdout
    counts = eval(p.stdout.split("ops ok: ", 1)[1].splitlines()[0])  # noqa: S307 - our own dict
    assert counts["gloo"] > 300, counts  # most cases are compared against gloo itself


def test_a_message_sent_before_leaving_arrives_with_the_views_elements():
    """The sender hosts the store and exits right after a blocking send of a strided view: the
    group's shutdown waits until the message was received, and the receiver gets the view's
    elements, not the memory after its first one."""
    p = check(launch(2, "send_then_exit.py", timeout=100))
    assert "received [1.0, 5.0, 9.0]" in p.stdout, p.stdout


def test_monitored_barrier_names_the_missing_rank():
    p = check(launch(3, "monitored_barrier.py", timeout=100))
    assert "rank 0: diphoma: monitored_barrier: rank 2 failed to pass monitored_barrier in 2 s" in p.stdout, p.stdout
    assert "rank 1: diphoma: monitored_barrier: rank 0 did not release rank 1 within 2 s" in p.stdout, p.stdout


@pytest.mark.parametrize(
    "dtype,op,kind,ring_op",
    [
        (torch.float32, dist.ReduceOp.AVG, "native", "avg"),
        (torch.int64, dist.ReduceOp.MAX, "native", "max"),
        (torch.uint8, dist.ReduceOp.SUM, "widen", "sum"),
        (torch.bool, dist.ReduceOp.SUM, "widen", "max"),  # logical or, as NCCL maps it
        (torch.bool, dist.ReduceOp.MIN, "widen", "min"),
        (torch.float32, dist.ReduceOp.PRODUCT, "gather", None),
        (torch.int8, dist.ReduceOp.BXOR, "gather", None),
        (torch.complex64, dist.ReduceOp.SUM, "gather", None),
    ],
)
def test_reduction_plans(dtype, op, kind, ring_op):
    plan = _ops.plan_reduction("all_reduce", dtype, op)
    assert (plan.kind, plan.ring_op) == (kind, ring_op)


def test_compression_plans_only_float32_sums_and_averages():
    wire = _ops.compression({"DIPHOMA_COMPRESSION": "bf16"})
    assert wire == torch.bfloat16
    assert _ops.compression({}) is None and _ops.compression({"DIPHOMA_COMPRESSION": " "}) is None
    assert _ops.compression({"DIPHOMA_COMPRESSION": "BF16"}) is wire  # as ' bf16': spelling, not meaning
    for op, ring_op in [(dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "avg")]:
        plan = _ops.plan_reduction("all_reduce", torch.float32, op, wire)
        assert (plan.kind, plan.ring_dtype, plan.ring_op) == ("compress", "bfloat16", ring_op)
    assert _ops.plan_reduction("all_reduce", torch.float32, dist.ReduceOp.MAX, wire).kind == "native"
    assert _ops.plan_reduction("all_reduce", torch.float64, dist.ReduceOp.SUM, wire).kind == "native"
    with pytest.raises(diphoma.ConfigError, match="DIPHOMA_COMPRESSION='fp8' is not a compression"):
        _ops.compression({"DIPHOMA_COMPRESSION": "fp8"})


def test_float32_all_reduces_cross_the_wire_as_bfloat16_under_compression():
    """1 + 2⁻¹⁰ from each of 3 ranks: float32 sums it exactly, bfloat16 rounds it to 1 first."""
    runs = {}
    for wire in ("none", "bf16"):
        p = check(launch(3, "compression.py", timeout=100, env={**os.environ, "DIPHOMA_COMPRESSION": wire}))
        runs[wire] = eval(p.stdout.split("reduced ", 1)[1].splitlines()[0])  # noqa: S307 - our own dict
    exact = 3 * (1 + 2**-10)
    assert runs["none"] == {"sum": exact, "avg": 1 + 2**-10, "max": 1 + 2**-10, "sum64": exact}, runs
    assert runs["bf16"] == {"sum": 3.0, "avg": 1.0, "max": 1 + 2**-10, "sum64": exact}, runs


def test_local_reductions_wrap_and_truncate_as_the_ring():
    stacked = torch.tensor([[200, 3], [100, 250]], dtype=torch.uint8)
    assert torch.equal(_ops.local_reduce(dist.ReduceOp.SUM, stacked), torch.tensor([44, 253], dtype=torch.uint8))
    assert torch.equal(_ops.local_reduce(dist.ReduceOp.PRODUCT, stacked), torch.tensor([32, 238], dtype=torch.uint8))
    ints = torch.tensor([[-3], [0]], dtype=torch.int32)
    assert torch.equal(_ops.local_reduce(dist.ReduceOp.AVG, ints), torch.tensor([-1], dtype=torch.int32))
    flags = torch.tensor([[True, False], [True, True]])
    assert torch.equal(_ops.local_reduce(dist.ReduceOp.PRODUCT, flags), torch.tensor([True, False]))


def test_alltoall_layout_and_mismatches():
    sent = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]  # sent[j][i]: rows j sends to i
    assert _ops.alltoall_offsets(sent, 1) == [(1, 2), (4, 5), (7, 8)]
    _ops.check_received("all_to_all_single", sent, 1, [2, 5, 8])
    with pytest.raises(diphoma.ConfigError, match="rank 2 sends 8 rows, rank 1 expects 9"):
        _ops.check_received("all_to_all_single", sent, 1, [2, 5, 9])
    with pytest.raises(diphoma.ConfigError, match="input split sizes \\[1, 1\\] must be 3 non-negative counts adding up to 4 rows"):
        _ops.check_splits("all_to_all_single", [1, 1], 4, 3, "input")
    with pytest.raises(diphoma.ConfigError, match="the output's 5 rows do not split evenly over 2 ranks"):
        _ops.even_splits("all_to_all_single", 5, 2, "output")
