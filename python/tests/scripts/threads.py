"""Which thread runs each collective of the "diphoma" backend: a synchronous call (torch's
``async_op=False``) on the caller's thread, with no hop to the group's thread; an asynchronous
one (DDP's buckets) on the group's thread, in call order, also when a synchronous call follows
queued ones. The ring is the real one, wrapped to record the calling thread of each native
call. Prints "threads ok" on rank 0; exits non-zero on the first mismatch."""

import threading

import torch
import torch.distributed as dist

import diphoma.torch  # noqa: F401

dist.init_process_group(backend="diphoma")
rank, world = dist.get_rank(), dist.get_world_size()
group = dist.distributed_c10d._get_default_group()
MAIN = threading.get_ident()
calls = []  # (native method, thread id, first element of the buffer before the call)


class Recorder:
    """Forwards every call to the real ring, recording the calling thread."""

    def __init__(self, ring):
        self.ring = ring

    def __getattr__(self, name):
        real = getattr(self.ring, name)
        if not callable(real):
            return real

        def call(*args):
            calls.append((name, threading.get_ident(), args))
            return real(*args)

        return call


group.plane.ring = Recorder(group.plane.ring)  # the ring plane (the default) calls it


def threads_of(fn):
    calls.clear()
    fn()
    return [(name, tid == MAIN) for name, tid, _ in calls]


t = torch.full((1000,), float(rank + 1))
got = threads_of(lambda: dist.all_reduce(t))
assert got == [("allreduce", True)], f"sync all_reduce ran on {got}"
assert torch.equal(t, torch.full((1000,), world * (world + 1) / 2)), t
assert threads_of(lambda: dist.barrier()) == [("barrier", True)]
b = torch.full((10,), float(rank))
assert threads_of(lambda: dist.broadcast(b, 0)) == [("broadcast", True)]
assert torch.equal(b, torch.zeros(10))

w = None


def submit_async():
    global w
    w = dist.all_reduce(t, async_op=True)
    w.wait()


got = threads_of(submit_async)
assert got == [("allreduce", False)], f"async all_reduce ran on {got}"

# Queued asynchronous calls, then a synchronous one: all run in call order, with the right sums.
xs = [torch.full((100_000,), float(rank + i)) for i in range(6)]
calls.clear()
works = [dist.all_reduce(x, async_op=True) for x in xs[:5]]
dist.all_reduce(xs[5])
for w in works:
    w.wait()
order = [args[0] for name, _, args in calls if name == "allreduce"]
assert order == [x.data_ptr() for x in xs], "collectives ran out of call order"
for i, x in enumerate(xs):
    want = sum(r + i for r in range(world))
    assert torch.equal(x, torch.full((100_000,), float(want))), f"tensor {i}: {x[:3]}"

# The Work of a synchronous call is complete when returned, and its future holds the output.
opts = dist.AllreduceOptions()
opts.asyncOp = False
y = torch.ones(8)
w = group.allreduce([y], opts)
assert w.is_completed() and w.is_success()
assert w.wait() is True
assert w.get_future().value()[0] is y
assert torch.equal(y, torch.full((8,), float(world)))

dist.destroy_process_group()
if rank == 0:
    print("threads ok")
