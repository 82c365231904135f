"""Every collective of the "diphoma" backend, for every dtype and op, against a reference each
rank computes locally from every rank's (deterministic) input. Exits non-zero on the first
mismatch; prints "collectives ok" on rank 0."""

import torch
import torch.distributed as dist

import diphoma.torch  # noqa: F401

dist.init_process_group(backend="diphoma")
rank, world = dist.get_rank(), dist.get_world_size()
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
OPS = {
    dist.ReduceOp.SUM: lambda xs: sum(xs[1:], xs[0]),
    dist.ReduceOp.MAX: lambda xs: torch.stack(xs).amax(0),
    dist.ReduceOp.MIN: lambda xs: torch.stack(xs).amin(0),
    dist.ReduceOp.AVG: None,
}


def value(r, n, dtype, salt=0):
    """Rank r's input: small integers, exact in every dtype and every partial sum."""
    i = torch.arange(n, dtype=torch.int64)
    return ((i * 3 + r * 7 + salt) % 11 - 5).to(dtype)


def reference(op, xs):
    if op == dist.ReduceOp.AVG:
        s = sum(x.double() for x in xs)
        if xs[0].is_floating_point():
            return (s / world).to(xs[0].dtype)
        return torch.div(s, world, rounding_mode="trunc").to(xs[0].dtype)
    return OPS[op](xs)


def same(got, want, what):
    if got.is_floating_point() and got.dtype != torch.float64:
        torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, want), f"{what}: {got} != {want}"


for dtype in DTYPES:
    for op in OPS:
        for n in (1, 13, 5000):
            what = f"all_reduce {dtype} {op} n={n}"
            want = reference(op, [value(r, n, dtype) for r in range(world)])
            t = value(rank, n, dtype)
            ptr = t.data_ptr()
            dist.all_reduce(t, op=op)
            assert t.data_ptr() == ptr
            same(t, want, what)
            # non-contiguous: the first column of an (n, 2) tensor (stride 2)
            base = torch.zeros(n, 2, dtype=dtype)
            base[:, 0] = value(rank, n, dtype)
            nc = base[:, 0]
            assert not nc.is_contiguous() or n == 1
            dist.all_reduce(nc, op=op)
            same(base[:, 0], want, what + " non-contiguous")
            assert torch.equal(base[:, 1], torch.zeros(n, dtype=dtype)), what + " wrote outside the view"
        # reduce_scatter (list and tensor forms)
        m = 7
        ins = [value(rank, m, dtype, salt=c) for c in range(world)]
        want = reference(op, [value(r, m, dtype, salt=rank) for r in range(world)])
        out = torch.empty(m, dtype=dtype)
        dist.reduce_scatter(out, ins, op=op)
        same(out, want, f"reduce_scatter {dtype} {op}")
        flat = torch.cat(ins)
        keep = flat.clone()
        out2 = torch.empty(m, dtype=dtype)
        dist.reduce_scatter_tensor(out2, flat, op=op)
        same(out2, want, f"reduce_scatter_tensor {dtype} {op}")
        assert torch.equal(flat, keep), "reduce_scatter_tensor changed its input"
    # broadcast from every root, contiguous and not
    for root in range(world):
        t = value(rank, 33, dtype)
        dist.broadcast(t, src=root)
        same(t, value(root, 33, dtype), f"broadcast {dtype} root {root}")
        base = torch.stack([value(rank, 33, dtype), value(rank, 33, dtype, salt=1)])
        dist.broadcast(base[:, 5], src=root)
        assert torch.equal(base[:, 5], torch.stack([value(root, 33, dtype)[5], value(root, 33, dtype, salt=1)[5]]))
    # all_gather (list and tensor forms)
    mine = value(rank, 9, dtype).reshape(3, 3)
    outs = [torch.empty(3, 3, dtype=dtype) for _ in range(world)]
    dist.all_gather(outs, mine)
    for r in range(world):
        same(outs[r], value(r, 9, dtype).reshape(3, 3), f"all_gather {dtype} from {r}")
    big = torch.empty(world * 9, dtype=dtype)
    dist.all_gather_into_tensor(big, mine.reshape(-1))
    same(big, torch.cat([value(r, 9, dtype) for r in range(world)]), f"all_gather_into_tensor {dtype}")

# Several asynchronous works in flight complete in order with the right results.
ts = [torch.full((1000,), float(rank + i)) for i in range(5)]
works = [dist.all_reduce(t, async_op=True) for t in ts]
for w in works:
    w.wait()
for i, t in enumerate(ts):
    assert torch.equal(t, torch.full((1000,), float(sum(range(world)) + world * i))), i
fut = dist.all_reduce(torch.ones(3), async_op=True).get_future()
assert torch.equal(fut.wait()[0], torch.full((3,), float(world)))
dist.barrier()
if rank == 0:
    print("collectives ok")
dist.destroy_process_group()
