"""Bad input gives a clear Python exception naming what is wrong: no hang, no crash, and the
process group stays usable afterwards. Also: the launcher forwards a failed rank's exit code and
stops the other ranks."""

import os
import secrets
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import diphoma
import diphoma.torch  # noqa: F401
from diphoma.run import free_ports, rank_envs
from conftest import check, launch


@pytest.fixture(scope="module")
def world_one(tmp_path_factory):
    """The "diphoma" backend in this process, as a ring of one rank (the launcher's env)."""
    key = tmp_path_factory.mktemp("key") / "ring.key"
    key.write_bytes(secrets.token_bytes(32))
    saved = dict(os.environ)
    os.environ.update(rank_envs(1, str(key))[0])
    dist.init_process_group(backend="diphoma")
    yield
    dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def test_device_tensor_is_refused_by_name(world_one):
    # No GPU here: a 'meta' tensor takes the same path as a CUDA one (a non-CPU device).
    with pytest.raises(diphoma.ConfigError, match="device meta.*CPU tensors only"):
        dist.all_reduce(torch.ones(4, device="meta"))
    with pytest.raises(diphoma.ConfigError, match="device meta"):
        dist.broadcast(torch.ones(4, device="meta"), src=0)


def test_a_cuda_tensor_without_cuda_or_outside_the_staged_collectives_is_refused_by_name(world_one):
    """CUDA tensors go through host memory for all-reduce, broadcast and all-gather
    (``HOST_STAGED``) where CUDA is available; elsewhere the error names the collective, the
    device and where CUDA tensors are taken. No GPU here: the check is fed a tensor that says
    it is on ``cuda:0`` (its data is never read: the check refuses first)."""
    from diphoma.torch import HOST_STAGED, _check

    class OnCuda(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda:0")

        @property
        def is_cpu(self):
            return False

    t = torch.ones(4).as_subclass(OnCuda)
    assert {"all_reduce", "broadcast", "all_gather"} <= HOST_STAGED
    if not torch.cuda.is_available():
        with pytest.raises(diphoma.ConfigError, match=r"all_reduce: tensor on device cuda:0 is not supported .*CUDA "
                                                      r"tensors where CUDA is available for .*all_reduce"):
            _check(t, "all_reduce")
    with pytest.raises(diphoma.ConfigError, match="all_to_all_single: tensor on device cuda:0"):
        _check(t, "all_to_all_single")


def test_reduction_without_a_definition_is_refused_by_name(world_one):
    """What neither the ring nor a local reduction defines raises ConfigError at once, naming
    the collective and the op or dtype (they used to fail in torch with "No backend type
    associated with device type cpu", or hang)."""
    with pytest.raises(diphoma.ConfigError, match="all_reduce: reduce op BAND needs an integer or bool tensor, got torch.float32"):
        dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND)
    with pytest.raises(diphoma.ConfigError, match="reduce_scatter_tensor: reduce op MAX has no order on complex"):
        dist.reduce_scatter_tensor(torch.empty(2, dtype=torch.complex64), torch.ones(2, dtype=torch.complex64), op=dist.ReduceOp.MAX)
    with pytest.raises(diphoma.ConfigError, match="reduce: unsupported dtype torch.float8_e4m3fn"):
        dist.reduce(torch.zeros(4, dtype=torch.float8_e4m3fn), dst=0)
    premul = dist._make_nccl_premul_sum(2.0)
    with pytest.raises(diphoma.ConfigError, match="all_reduce: unsupported reduce op PREMUL_SUM"):
        dist.all_reduce(torch.ones(4), op=premul)


def test_p2p_and_sub_groups_without_a_shared_store_are_refused_at_once():
    """A group whose store is process-local (a HashStore, as diphoma.torch.elastic.run uses)
    cannot carry messages between ranks: send, recv, monitored_barrier and new_group raise
    ConfigError at once instead of waiting for the timeout."""
    from diphoma.torch._p2p import StoreP2P
    from datetime import timedelta

    p2p = StoreP2P(dist.PrefixStore("g", dist.HashStore()), timedelta(minutes=30))
    for call in (lambda: p2p.send(torch.ones(1), 0, 1, 0), lambda: p2p.recv(torch.ones(1), 1, 0, 0),
                 lambda: p2p.monitored_barrier(0, 2, 1.0, False)):
        with pytest.raises(diphoma.ConfigError, match="needs a store shared by the ranks"):
            call()


def test_group_still_works_after_refusals(world_one):
    t = torch.arange(5.0)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert torch.equal(t, torch.arange(5.0))
    dist.barrier()


def test_native_ring_refuses_bad_arguments(world_one):
    ring = dist.distributed_c10d._get_default_group().ring
    with pytest.raises(diphoma.ConfigError, match='unsupported dtype "uint8"'):
        ring.allreduce(torch.ones(2).data_ptr(), 2, "uint8", "sum")
    with pytest.raises(diphoma.ConfigError, match="unsupported reduce op"):
        ring.allreduce(torch.ones(2).data_ptr(), 2, "float32", "product")
    with pytest.raises(diphoma.ConfigError, match="not aligned"):
        ring.allreduce(torch.ones(2).data_ptr() + 1, 1, "float32", "sum")
    with pytest.raises(diphoma.ConfigError, match="Avg is not defined for I64"):
        ring.allreduce(torch.ones(2, dtype=torch.int64).data_ptr(), 2, "int64", "avg")


@pytest.mark.parametrize(
    "missing", ["DIPHOMA_RANK", "DIPHOMA_WORLD_SIZE", "DIPHOMA_RING_ADDRESSES", "DIPHOMA_JOB_UID", "DIPHOMA_KEY_FILE"]
)
def test_missing_env_variable_is_named(missing, tmp_path):
    key = tmp_path / "ring.key"
    key.write_bytes(secrets.token_bytes(32))
    env = rank_envs(1, str(key))[0]
    del env[missing]
    code = "import diphoma.torch, torch.distributed as dist\ndist.init_process_group(backend='diphoma')\n"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stderr  # a Python exception, not a signal
    assert f"diphoma.ConfigError: environment variable {missing} is not set" in p.stderr, p.stderr


def test_peer_that_never_comes_is_a_ring_error(tmp_path):
    """Rank 0 of a world of 2 whose peer never starts: RingError after the join's bound (and a
    ConfigError for a bound that is not positive)."""
    key = tmp_path / "ring.key"
    key.write_bytes(secrets.token_bytes(32))
    env = rank_envs(2, str(key))[0]
    code = "import diphoma\ntry:\n    diphoma.Ring.from_env(timeout=0)\nexcept diphoma.ConfigError as e:\n    print(e)\ntry:\n    diphoma.Ring.from_env(timeout=1.5)\nexcept diphoma.RingError as e:\n    print('RingError', e)\n"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=90)
    assert p.returncode == 0, p.stderr
    assert "timeout 0 s is not positive" in p.stdout and "RingError" in p.stdout, p.stdout


def test_launcher_forwards_exit_code_and_stops_the_others(tmp_path):
    pidfile = str(tmp_path / "rank0.pid")
    p = launch(2, "fail.py", pidfile, timeout=60)
    assert p.returncode == 3, p.stderr
    pid = int(open(pidfile).read())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_free_ports_are_distinct():
    ports = free_ports(16)
    assert len(set(ports)) == 16


def test_shut_down_group_refuses_and_exit_is_clean(monkeypatch, tmp_path):
    """shutdown() finishes submitted work, is idempotent, and later collectives raise."""
    key = tmp_path / "ring.key"
    key.write_bytes(secrets.token_bytes(32))
    for k, v in rank_envs(1, str(key))[0].items():
        monkeypatch.setenv(k, v)
    pg = diphoma.torch.ProcessGroupDiphoma(diphoma.Ring.from_env(), 0, 1)
    work = pg.allreduce([torch.ones(2)])
    pg.shutdown()
    assert work.wait()
    pg.shutdown()
    with pytest.raises(diphoma.ConfigError, match="shut down"):
        pg.allreduce([torch.ones(2)])


def test_ddp_backward_through_a_lost_peer_raises_instead_of_crashing():
    """torch's DDP reducer crashed the interpreter (SIGSEGV) on a bucket whose Work future
    failed; the group now completes the bucket and refuses the next call with RingChanged."""
    p = launch(2, "ddp_peer_lost.py", timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "RingChanged: " in p.stdout and "failed" in p.stdout, p.stdout


def test_at_world_3_every_rank_gets_the_collective_mismatch():
    """Rank r all-reduces 4 + r elements: only rank 1 receives a frame of another size, its
    neighbours only see it leave; they raise the CollectiveMismatch it posted in the group's
    store (naming its call and theirs), not RingChanged."""
    p = check(launch(3, "mismatch.py", timeout=60))
    for r in range(3):
        line = next(x for x in p.stdout.splitlines() if f"rank {r}: first: " in x)
        assert f"rank {r}: first: CollectiveMismatch: " in line, p.stdout
        assert f"had 1 tensor: {4 + r} torch.float32 elements" in line, p.stdout
    assert "RingChanged" not in p.stdout, p.stdout


def test_ranks_calling_different_sizes_get_a_collective_mismatch_not_ring_changed():
    """A size mismatch across ranks is the script's mistake: every rank raises
    CollectiveMismatch naming the sizes it saw (not RingChanged, which would drive a re-form),
    and the group keeps refusing with the same class."""
    p = check(launch(2, "mismatch.py", timeout=60))
    assert "rank 0: first: CollectiveMismatch: " in p.stdout and "expected a frame of 16 bytes from its peer and received one of 20" in p.stdout, p.stdout
    assert "rank 1: first: CollectiveMismatch: " in p.stdout and "expected a frame of 20 bytes from its peer and received one of 16" in p.stdout, p.stdout
    assert "rank 0: next: CollectiveMismatch: an earlier collective" in p.stdout, p.stdout
    # Each rank names its own call: the tensor's elements, dtype and shape.
    for r, n in ((0, 4), (1, 5)):
        said = f"of the group had 1 tensor: {n} torch.float32 elements ({4 * n} bytes), shape ({n},)"
        line = next(x for x in p.stdout.splitlines() if f"rank {r}: first: CollectiveMismatch: " in x)
        assert said in line, p.stdout
    assert not issubclass(diphoma.CollectiveMismatch, diphoma.RingChanged)


def test_a_rank_that_never_calls_a_collective_is_named_within_detection_seconds():
    """Rank 2 of 3 skips an all_reduce: within DIPHOMA_DETECTION_SECONDS (2 s here) ranks 0
    and 1 log that they wait for rank 2, and the error at the collective's timeout names it."""
    env = dict(os.environ, DIPHOMA_DETECTION_SECONDS="2")
    p = check(launch(3, "absent_rank.py", timeout=120, env=env))
    for r in (0, 1):
        assert f"on rank {r} for rank(s) 2, which did not call it within 1 s" in p.stderr, p.stderr[-4000:]
        line = next(line for line in p.stdout.splitlines() if f"]:rank {r}: " in line)
        assert "rank(s) 2 never called this collective" in line, p.stdout
    assert "rank 2: left without calling it" in p.stdout, p.stdout


def test_a_sparse_tensor_and_a_src_outside_the_group_are_named(world_one):
    with pytest.raises(diphoma.ConfigError, match="all_reduce: torch.sparse_coo tensors are not supported"):
        dist.all_reduce(torch.ones(3).to_sparse())
    with pytest.raises(diphoma.ConfigError, match="broadcast: src rank 7 is not in the group \\(ranks 0 to 0\\)"):
        dist.broadcast(torch.ones(2), src=7)
