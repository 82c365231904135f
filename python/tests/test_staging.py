"""The pipelined staging of all-reduces (``diphoma.torch._staging``, issue 27 item 3): the
segment size and the segments (pure), the pipeline's order (the copy of the next segment is
queued before the current one is reduced, and its copy back before the next one is), the CPU
sides of the pipeline, the wiring of a work's CUDA completion (``wait()`` and the future), and
real all-reduces at 3 ranks through segments of a few hundred bytes, exact. Without a GPU the
CUDA side (``_CudaSide``, the copy streams and events) runs only in ``make gpu-check``
(``python/bench/gpu_check.py``)."""

import os
import sys

import pytest
import torch

import diphoma
from diphoma.torch import _Work, _staging
from conftest import check, launch


def test_segment_size_from_the_environment():
    assert _staging.segment_bytes({}) == _staging.SEGMENT_BYTES == 4 << 20
    assert _staging.segment_bytes({_staging.ENV_SEGMENT_BYTES: " "}) == 4 << 20
    assert _staging.segment_bytes({_staging.ENV_SEGMENT_BYTES: "300"}) == 300
    # CPU tensors go whole (nothing to overlap) unless the variable is set.
    assert _staging.host_segment_bytes({}) == sys.maxsize
    assert _staging.host_segment_bytes({_staging.ENV_SEGMENT_BYTES: "300"}) == 300
    for bad in ("0", "-4", "4MiB", "1.5"):
        with pytest.raises(diphoma.ConfigError, match=f"DIPHOMA_STAGING_SEGMENT_BYTES='{bad}' is not a positive"):
            _staging.segment_bytes({_staging.ENV_SEGMENT_BYTES: bad})


@pytest.mark.parametrize("numel", [0, 1, 2, 99, 100, 101, 1000, 4097])
@pytest.mark.parametrize("element_size", [1, 2, 4, 8])
@pytest.mark.parametrize("max_bytes", [1, 3, 8, 400, 1 << 22])
def test_segments_cover_the_tensor_in_order_within_the_size(numel, element_size, max_bytes):
    got = _staging.segments(numel, element_size, max_bytes)
    per = max(1, max_bytes // element_size)
    assert [s for s, _ in got] == list(range(0, numel, per))
    assert sum(n for _, n in got) == numel
    assert all(0 < n <= per for _, n in got)
    assert all(n == per for _, n in got[:-1])
    assert all(n * element_size <= max(max_bytes, element_size) for _, n in got)


def test_segments_examples():
    assert _staging.segments(10, 4, 16) == [(0, 4), (4, 4), (8, 2)]
    assert _staging.segments(0, 4, 16) == []
    assert _staging.segments(3, 8, 4) == [(0, 1), (1, 1), (2, 1)]  # a segment is at least one element
    assert _staging.segments(5, 2, 1 << 22) == [(0, 5)]


class _Ready:
    def __init__(self, log, i):
        self.log, self.i = log, i

    def synchronize(self):
        self.log.append(("wait", self.i))


def _run_pipeline(n):
    log = []

    def copy_in(i):
        log.append(("in", i))
        return _Ready(log, i)

    _staging.pipeline(list(range(n)), copy_in, lambda i: log.append(("reduce", i)),
                      lambda i: log.append(("out", i)))
    return log


def test_the_pipeline_queues_the_next_copy_before_reducing_and_the_copy_back_before_the_next():
    assert _run_pipeline(0) == []
    assert _run_pipeline(1) == [("in", 0), ("wait", 0), ("reduce", 0), ("out", 0)]
    assert _run_pipeline(3) == [("in", 0), ("in", 1), ("wait", 0), ("reduce", 0), ("out", 0),
                                ("in", 2), ("wait", 1), ("reduce", 1), ("out", 1),
                                ("wait", 2), ("reduce", 2), ("out", 2)]
    log = _run_pipeline(7)
    at = {e: k for k, e in enumerate(log)}
    for i in range(7):
        assert at[("in", i)] < at[("wait", i)] < at[("reduce", i)] < at[("out", i)]
        if i + 1 < 7:
            assert at[("in", i + 1)] < at[("reduce", i)], "the next segment's copy is queued before this one is reduced"
            assert at[("out", i)] < at[("reduce", i + 1)], "this segment's copy back is queued before the next is reduced"
        if 1 <= i < 6:
            # While segment i is reduced, 3 segments are in flight: i-1 (back), i, i+1 (in).
            assert at[("out", i - 1)] < at[("in", i + 1)]
    assert sum(1 for e in log if e[0] == "in") == 7


def test_cpu_sides_reduce_segments_in_place_cast_and_written_back():
    """The stager on CPU tensors with a stand-in for the ring (each host segment doubled):
    a contiguous tensor is reduced in place (the segments are its views), a non-contiguous one
    through a copy written back, a widened one (int8 in int32) and a compressed one (float32 in
    bfloat16) through a cast per segment; the segments are handed over in order."""
    stager = _staging.Stager(12, 12)
    plain = torch.arange(10, dtype=torch.float32)
    strided = torch.arange(14, dtype=torch.float64).view(7, 2).t()  # non-contiguous
    small = torch.tensor([1, -2, 3, 4, -5], dtype=torch.int8)
    compressed = torch.tensor([1.0, 1 + 2**-10, 3.0], dtype=torch.float32)
    seen = []

    def reduce(host, k):
        seen.append((k, host.dtype, host.numel(), host.data_ptr()))
        host.mul_(2)

    ptr = plain.data_ptr()
    stager.allreduce([(plain, torch.float32), (strided, torch.float64), (small, torch.int32),
                      (compressed, torch.bfloat16)], reduce, ready={})
    assert torch.equal(plain, torch.arange(10, dtype=torch.float32) * 2)
    assert torch.equal(strided, torch.arange(14, dtype=torch.float64).view(7, 2).t() * 2)
    assert torch.equal(small, torch.tensor([2, -4, 6, 8, -10], dtype=torch.int8))
    assert torch.equal(compressed, torch.tensor([2.0, 2.0, 6.0]))  # 1 + 2⁻¹⁰ rounded to bfloat16
    assert [(k, d, n) for k, d, n, _ in seen] == [
        (0, torch.float32, 3), (0, torch.float32, 3), (0, torch.float32, 3), (0, torch.float32, 1),
        (1, torch.float64, 1)] + [(1, torch.float64, 1)] * 13 + [
        (2, torch.int32, 3), (2, torch.int32, 2), (3, torch.bfloat16, 3)]
    assert [p for k, _, _, p in seen if k == 0] == [ptr, ptr + 12, ptr + 24, ptr + 36], "in place, no copy"


class _FakeCompletion:
    """Records what a work does with its CUDA completion (no GPU here)."""

    def __init__(self):
        self.waited, self.completed = 0, []

    def future(self):
        return torch.futures.Future()

    def complete(self, fut, result):
        self.completed.append(result)
        fut.set_result(result)

    def wait(self):
        self.waited += 1


def test_a_works_cuda_completion_is_waited_on_by_wait_and_completes_its_future():
    """``wait()`` makes the caller's stream wait (``Completion.wait``), and the future is made
    and completed by the completion (a CUDA-aware future, completed on the copy streams), for a
    work completed inline and for one completed by the group's thread."""
    w = _Work()
    w.cuda = _FakeCompletion()
    w.done(["t"])
    assert w.wait() and w.cuda.waited == 1
    assert w.get_future().wait() == ["t"] and w.cuda.completed == [["t"]]

    queued = _Work()
    queued.cuda = _FakeCompletion()
    queued.fut = queued._new_future()
    queued._complete(["u"])
    assert queued.cuda.completed == [["u"]] and queued.wait() and queued.cuda.waited == 1


@pytest.mark.parametrize("compression", ["none", "bf16"])
def test_all_reduces_through_segments_of_a_few_hundred_bytes_are_exact(compression):
    """3 ranks, segments of 200 bytes: odd sizes of every pipelined plan, non-contiguous and
    coalesced tensors, asynchronous calls; one ring collective per segment (counted)."""
    env = {**os.environ, _staging.ENV_SEGMENT_BYTES: "200", "DIPHOMA_COMPRESSION": compression}
    p = check(launch(3, "staging.py", timeout=200, env=env))
    assert "staging ok" in p.stdout and f"compressed {compression == 'bf16'}" in p.stdout, p.stdout


def test_ranks_with_different_segment_sizes_fail_instead_of_hanging():
    p = check(launch(2, "staging.py", "--mismatch", timeout=100))
    assert p.stdout.count("mismatch refused") == 2, p.stdout
    assert "DIPHOMA_STAGING_SEGMENT_BYTES" in p.stdout, p.stdout  # the hint names the variable


def test_a_bad_segment_size_is_refused_by_name_at_init():
    env = {**os.environ, _staging.ENV_SEGMENT_BYTES: "lots"}
    p = launch(1, "staging.py", timeout=100, env=env)
    assert p.returncode != 0
    assert "DIPHOMA_STAGING_SEGMENT_BYTES='lots' is not a positive number of bytes" in p.stderr + p.stdout


def test_pinned_buffers_grow_by_powers_of_two_up_to_the_segment_and_old_ones_are_kept(monkeypatch):
    """The CUDA side's pinned segment buffers (``Stager._buffer``; plain CPU tensors stand in
    for pinned ones here): made at first use, grown by powers of two (from 4 KiB) up to the
    segment size, a replaced one kept until the next done event (its copies may still run)."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda n, dtype, pin_memory: empty(n, dtype=dtype))
    stager = _staging.Stager(4 << 20, 4 << 20)
    sizes = [stager._buffer(0, 1, n).numel() for n in (100, 5000, 4 << 20, 1000)]
    assert sizes == [4096, 8192, 4 << 20, 4 << 20]
    assert [b.numel() for b in stager._retired] == [4096, 8192]
    assert stager._pools[0][0] is None and stager._pools[0][2] is None
    tiny = _staging.Stager(1, 1)  # a segment is at least one element (up to 8 bytes)
    assert [tiny._buffer(0, 0, n).numel() for n in (1, 8, 4)] == [1, 8, 8]


def test_ddp_through_small_segments_trains_as_gloo(tmp_path):
    """DDP's bucketed gradient all-reduces (asynchronous, waited on through their futures) cut
    into 512-byte segments train to gloo's parameters at world 2 (the tolerance of
    ``test_ddp.py``)."""
    from test_ddp import GLOO_EXIT_ABORT, STEPS

    out = {}
    for backend in ("gloo", "diphoma"):
        out[backend] = str(tmp_path / f"{backend}.pt")
        env = {**os.environ, _staging.ENV_SEGMENT_BYTES: "512"}
        proc = launch(2, "ddp_train.py", backend, str(STEPS), out[backend], env=env)
        if backend == "gloo" and proc.returncode == 134 and GLOO_EXIT_ABORT in proc.stderr:
            proc = launch(2, "ddp_train.py", backend, str(STEPS), out[backend], env=env)  # as test_ddp.py
        check(proc)
    torch.testing.assert_close(torch.load(out["diphoma"]), torch.load(out["gloo"]), atol=2e-5, rtol=1e-4)
