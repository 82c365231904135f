"""Every c10d operation the libraries call, on the "diphoma" default group and on a gloo group of
the same ranks in the same run, compared result for result (where gloo refuses a dtype or op,
against a reference computed here from every rank's deterministic input; where both refuse, the
diphoma group must raise ConfigError naming the operation). Then sub-groups (new_group, a 2-D
DeviceMesh), point to point, the object collectives, coalescing, monitored_barrier, and a second
init_process_group after destroy_process_group. Prints "ops ok" on rank 0."""

import datetime
import functools
import os
import sys

import torch
import torch.distributed as dist

import diphoma
import diphoma.torch  # noqa: F401

dist.init_process_group(backend="diphoma")
rank, world = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64]
OPS = [dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX,
       dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR]
TRACE = os.environ.get("OPS_TRACE")
if TRACE:
    import faulthandler

    faulthandler.dump_traceback_later(float(TRACE), exit=True)
checked = {"gloo": 0, "reference": 0, "refused": 0}


def value(r, n, dtype, salt=0):
    """Rank r's input: small values, exact in every dtype, products and partial sums."""
    i = torch.arange(n, dtype=torch.int64) * 3 + r * 7 + salt
    if dtype == torch.bool:
        return (i % 3 == 0)
    if dtype.is_complex:
        return torch.complex((i % 5 - 2).float(), (i % 3 - 1).float()).to(dtype)
    if dtype == torch.uint8:
        return (i % 5).to(dtype)
    return (i % 5 - 2).to(dtype)


def reference(op, xs):
    """The reduction of ``xs`` (every rank's tensor) computed here; raises where it is undefined."""
    if op == dist.ReduceOp.AVG:
        if xs[0].dtype == torch.bool:
            return functools.reduce(torch.logical_or, xs)
        s = functools.reduce(torch.add, [x.to(torch.complex128 if x.is_complex() else torch.float64) for x in xs])
        if xs[0].is_floating_point() or xs[0].is_complex():
            return (s / world).to(xs[0].dtype)
        return torch.trunc(s / world).to(xs[0].dtype)
    if xs[0].dtype == torch.bool and op == dist.ReduceOp.SUM:
        return functools.reduce(torch.logical_or, xs)
    if xs[0].dtype == torch.bool and op == dist.ReduceOp.PRODUCT:
        return functools.reduce(torch.logical_and, xs)
    f = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.PRODUCT: torch.mul, dist.ReduceOp.MIN: torch.minimum,
         dist.ReduceOp.MAX: torch.maximum, dist.ReduceOp.BAND: torch.bitwise_and,
         dist.ReduceOp.BOR: torch.bitwise_or, dist.ReduceOp.BXOR: torch.bitwise_xor}[op]
    return functools.reduce(lambda a, b: f(a, b).to(a.dtype), xs)


def same(got, want, what):
    if got.is_floating_point() or got.is_complex():
        torch.testing.assert_close(got, want, msg=lambda m: f"rank {rank}: {what}: {m}")
    else:
        assert torch.equal(got, want), f"rank {rank}: {what}: {got} != {want}"


def compare(what, run, expected):
    """Runs ``run(group)`` on gloo then on diphoma (each returns the tensor to compare) and
    checks diphoma's against gloo's, else against ``expected()``; where torch refuses the call
    before any backend, diphoma's group must be refused the same way; where only the reference
    is undefined, diphoma must refuse with a ConfigError naming the operation."""
    if TRACE:
        print(f"rank {rank}: {what}", file=sys.stderr, flush=True)
    try:
        want, source = run(gloo), "gloo"
    except (RuntimeError, ValueError, TypeError) as e:
        gloo_error = str(e)
        try:
            want, source = expected(), "reference"
        except (RuntimeError, ValueError, TypeError):
            want, source = None, "refused"
    try:
        got = run(None)
    except ValueError as e:  # diphoma.ConfigError is one too
        if source != "gloo" and str(e) == gloo_error and not isinstance(e, diphoma.ConfigError):
            checked["refused"] += 1  # by torch itself, for every backend
            return
        if source == "refused":
            assert isinstance(e, diphoma.ConfigError) and what.split()[0] in str(e), f"rank {rank}: {what}: {e!r}"
            checked["refused"] += 1
            return
        raise
    assert source != "refused", f"rank {rank}: {what}: neither gloo nor the reference defines it, diphoma did not refuse"
    same(got, want, f"{what} (against {source})")
    checked[source] += 1


for dtype in DTYPES:
    for op in OPS:
        n = 11
        xs = [value(r, n, dtype) for r in range(world)]

        def all_reduce(group, op=op, dtype=dtype):
            t = value(rank, n, dtype)
            dist.all_reduce(t, op=op, group=group)
            return t

        compare(f"all_reduce {dtype} {op}", all_reduce, lambda op=op, xs=xs: reference(op, xs))
        for dst in range(world):
            def reduce(group, op=op, dtype=dtype, dst=dst):
                t = value(rank, n, dtype)
                dist.reduce(t, dst=dst, op=op, group=group)
                return t if rank == dst else t[:0]

            compare(f"reduce {dtype} {op} dst {dst}", reduce,
                    lambda op=op, xs=xs, dst=dst: reference(op, xs) if rank == dst else reference(op, xs)[:0])

        def reduce_scatter_tensor(group, op=op, dtype=dtype):
            out = torch.empty(3, dtype=dtype)
            dist.reduce_scatter_tensor(out, value(rank, 3 * world, dtype), op=op, group=group)
            return out

        compare(f"reduce_scatter_tensor {dtype} {op}", reduce_scatter_tensor,
                lambda op=op, dtype=dtype: reference(op, [value(r, 3 * world, dtype) for r in range(world)]).view(world, 3)[rank])

    # Byte collectives: every dtype, from every root.
    for root in range(world):
        def broadcast(group, dtype=dtype, root=root):
            t = value(rank, 17, dtype)
            dist.broadcast(t, src=root, group=group)
            return t

        compare(f"broadcast {dtype} src {root}", broadcast, lambda dtype=dtype, root=root: value(root, 17, dtype))

        def gather(group, dtype=dtype, root=root):
            outs = [torch.empty(2, 3, dtype=dtype) for _ in range(world)] if rank == root else None
            dist.gather(value(rank, 6, dtype).view(2, 3), outs, dst=root, group=group)
            return torch.stack(outs) if rank == root else torch.zeros(0)

        compare(f"gather {dtype} dst {root}", gather, lambda dtype=dtype, root=root: torch.stack(
            [value(r, 6, dtype).view(2, 3) for r in range(world)]) if rank == root else torch.zeros(0))

        def scatter(group, dtype=dtype, root=root):
            out = torch.empty(5, dtype=dtype)
            ins = [value(root, 5, dtype, salt=c) for c in range(world)] if rank == root else None
            dist.scatter(out, ins, src=root, group=group)
            return out

        compare(f"scatter {dtype} src {root}", scatter, lambda dtype=dtype, root=root: value(root, 5, dtype, salt=rank))

    def all_gather(group, dtype=dtype):
        outs = [torch.empty(3, 2, dtype=dtype) for _ in range(world)]
        dist.all_gather(outs, value(rank, 6, dtype).view(3, 2), group=group)
        return torch.stack(outs)

    compare(f"all_gather {dtype}", all_gather, lambda dtype=dtype: torch.stack([value(r, 6, dtype).view(3, 2) for r in range(world)]))

    def all_to_all_single_even(group, dtype=dtype):
        out = torch.empty(2 * world, 3, dtype=dtype)
        dist.all_to_all_single(out, value(rank, 6 * world, dtype).view(2 * world, 3), group=group)
        return out

    compare(f"all_to_all_single {dtype} even", all_to_all_single_even, lambda dtype=dtype: torch.cat(
        [value(j, 6 * world, dtype).view(2 * world, 3)[2 * rank : 2 * rank + 2] for j in range(world)]))

    # Uneven splits: rank r sends r + j + 1 rows to rank j.
    def all_to_all_single_uneven(group, dtype=dtype):
        ins = [rank + j + 1 for j in range(world)]
        outs = [j + rank + 1 for j in range(world)]
        out = torch.empty(sum(outs), 2, dtype=dtype)
        dist.all_to_all_single(out, value(rank, 2 * sum(ins), dtype).view(-1, 2), outs, ins, group=group)
        return out

    def uneven_reference(dtype=dtype):
        pieces = []
        for j in range(world):
            sends = [j + i + 1 for i in range(world)]
            start = sum(sends[:rank])
            pieces.append(value(j, 2 * sum(sends), dtype).view(-1, 2)[start : start + sends[rank]])
        return torch.cat(pieces)

    compare(f"all_to_all_single {dtype} uneven", all_to_all_single_uneven, uneven_reference)

    def all_to_all(group, dtype=dtype):
        ins = [value(rank, rank + j + 1, dtype, salt=j) for j in range(world)]
        outs = [torch.empty(j + rank + 1, dtype=dtype) for j in range(world)]
        dist.all_to_all(outs, ins, group=group)
        return torch.cat(outs)

    compare(f"all_to_all {dtype}", all_to_all, lambda dtype=dtype: torch.cat([value(j, j + rank + 1, dtype, salt=rank) for j in range(world)]))

# Mismatched all_to_all split sizes are the caller's mistake, named on every rank.
if world > 1:
    try:
        wrong = [2] * world if rank == 0 else [1] * world
        dist.all_to_all_single(torch.empty(world), torch.empty(sum(wrong)), [1] * world, wrong)
        raise AssertionError("mismatched splits accepted")
    except diphoma.ConfigError as e:
        assert "split sizes disagree" in str(e) and "rank 0 sends 2 rows" in str(e), str(e)

# Point to point: a ring of send/recv, then isend/irecv both ways, batch_isend_irecv, any source.
nxt, prv = (rank + 1) % world, (rank - 1) % world
if world > 1:
    t = torch.full((4,), float(rank))
    if rank % 2 == 0:
        dist.send(t, nxt)
        got = torch.empty(4)
        dist.recv(got, prv)
    else:
        got = torch.empty(4)
        dist.recv(got, prv)
        dist.send(t, nxt)
    same(got, torch.full((4,), float(prv)), "send/recv ring")
    for tag in (0, 7):
        a, b = torch.empty(3, dtype=torch.int64), torch.empty(3, dtype=torch.int64)
        reqs = [dist.irecv(a, prv, tag=tag), dist.irecv(b, prv, tag=tag),
                dist.isend(torch.arange(3) + rank, nxt, tag=tag), dist.isend(torch.arange(3) * 10 + rank, nxt, tag=tag)]
        for q in reqs:
            q.wait()
        same(a, torch.arange(3) + prv, f"isend/irecv order tag {tag}")
        same(b, torch.arange(3) * 10 + prv, f"isend/irecv second tag {tag}")
    back = torch.empty(2, dtype=torch.bfloat16)
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank), dtype=torch.bfloat16), prv),
           dist.P2POp(dist.irecv, back, nxt)]
    for q in dist.batch_isend_irecv(ops):
        q.wait()
    same(back, torch.full((2,), float(nxt), dtype=torch.bfloat16), "batch_isend_irecv")
    if rank == 0:
        seen = set()
        for _ in range(world - 1):
            x = torch.empty(1, dtype=torch.int32)
            src = dist.recv(x)
            assert int(x) == src * 100, (src, x)
            seen.add(src)
        assert seen == set(range(1, world)), seen
    else:
        dist.send(torch.tensor([rank * 100], dtype=torch.int32), 0)
    # A receive of another size is named, not silently truncated.
    if rank == 0:
        dist.send(torch.zeros(5), 1)
    elif rank == 1:
        try:
            dist.recv(torch.empty(4), 0)
            raise AssertionError("a recv of the wrong size was accepted")
        except diphoma.ConfigError as e:
            assert "rank 0 sent torch.float32 5" in str(e), str(e)

# The object collectives (uint8 and int64 tensors underneath).
objs = [{"rank": rank, "s": "x" * rank}] if rank == 0 else [None]
dist.broadcast_object_list(objs, src=0)
assert objs[0] == {"rank": 0, "s": ""}, objs
gathered = [None] * world
dist.all_gather_object(gathered, ("hi", rank, [rank] * rank))
assert gathered == [("hi", r, [r] * r) for r in range(world)], gathered
got = [None] * world if rank == world - 1 else None
dist.gather_object({"r": rank}, got, dst=world - 1)
if rank == world - 1:
    assert got == [{"r": r} for r in range(world)], got
mine = [None]
dist.scatter_object_list(mine, [f"for {r}" for r in range(world)] if rank == 0 else None, src=0)
assert mine[0] == f"for {rank}", mine

# Coalescing: all_reduce_coalesced and torch's coalescing manager (DDP, FSDP).
ts = [torch.full((3,), float(rank)), torch.full((5,), 2.0)]
dist.all_reduce_coalesced(ts)
same(ts[0], torch.full((3,), float(sum(range(world)))), "all_reduce_coalesced 0")
same(ts[1], torch.full((5,), 2.0 * world), "all_reduce_coalesced 1")
from torch.distributed.distributed_c10d import _coalescing_manager  # noqa: E402

outs = [torch.empty(2 * world), torch.empty(world)]
with _coalescing_manager(async_ops=True) as cm:
    dist.all_gather_into_tensor(outs[0], torch.full((2,), float(rank)))
    dist.all_gather_into_tensor(outs[1], torch.full((1,), float(rank * 2)))
cm.wait()
same(outs[0], torch.arange(world).repeat_interleave(2).float(), "coalesced all_gather_into_tensor")
same(outs[1], torch.arange(world).float() * 2, "coalesced all_gather_into_tensor 2")
rs = [torch.empty(1), torch.empty(2)]
with _coalescing_manager():
    dist.reduce_scatter_tensor(rs[0], torch.ones(world))
    dist.reduce_scatter_tensor(rs[1], torch.ones(2 * world) * 3)
same(rs[0], torch.full((1,), float(world)), "coalesced reduce_scatter_tensor")
same(rs[1], torch.full((2,), 3.0 * world), "coalesced reduce_scatter_tensor 2")
with _coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
    a, b = torch.ones(2), torch.ones(3)
    dist.all_reduce(a)
    dist.broadcast(b * rank, src=0)
cm.wait()
same(a, torch.full((2,), float(world)), "coalescing manager with a device")

dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)

# Sub-groups: their collectives run over their own members only.
if world >= 2:
    evens = list(range(0, world, 2))
    odds = list(range(1, world, 2))
    g_even, g_odd = dist.new_group(evens), dist.new_group(odds)
    mine_group, members = (g_even, evens) if rank % 2 == 0 else (g_odd, odds)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine_group)
    same(t, torch.tensor([float(sum(members))]), "new_group all_reduce")
    outs = [torch.empty(1, dtype=torch.int64) for _ in members]
    dist.all_gather(outs, torch.tensor([rank]), group=mine_group)
    assert [int(o) for o in outs] == members, outs
    t = torch.tensor([rank])
    dist.broadcast(t, src=members[-1], group=mine_group)  # a global rank, as torch's API takes
    assert int(t) == members[-1], t
    if len(members) > 1:
        if rank == members[0]:
            dist.send(torch.tensor([42.0]), members[1], group=mine_group)
        elif rank == members[1]:
            x = torch.empty(1)
            dist.recv(x, members[0], group=mine_group)
            assert float(x) == 42.0
    dist.destroy_process_group(g_even if rank % 2 == 0 else g_odd)
if world == 4:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        pg = mesh.get_group(dim)
        members = dist.get_process_group_ranks(pg)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=pg)
        same(t, torch.tensor([float(sum(m + 1 for m in members))]), f"DeviceMesh {dim} all_reduce")

dist.barrier()
dist.destroy_process_group()

# A second process group in the same process, after destroy_process_group.
dist.init_process_group(backend="diphoma")
t = torch.ones(4)
dist.all_reduce(t)
same(t, torch.full((4,), float(world)), "all_reduce after a second init_process_group")
dist.destroy_process_group()
if rank == 0:
    print(f"ops ok: {checked}", flush=True)
sys.exit(0)
