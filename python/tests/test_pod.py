"""The in-pod launcher's decisions (``diphoma._pod``, pure): when ``python -m diphoma.run``
restarts a torchrun script in place, waits, leaves or fails, and the torchrun variables it
gives the process at each ring generation. Its run on the local cluster, through a kill -9 of
a worker, is e2e/tests/python.rs."""

import pytest

from diphoma import ConfigError
from diphoma._pod import changes, decide, fault, group_exit, host_of, pod_env, processes_per_worker, restart_cause

MEMBERS = [("w-0", "127.0.0.2:29500"), ("w-2", "127.0.0.4:29500"), ("w-3", "127.0.0.5:29500")]


def test_each_rank_gets_torchruns_variables_for_its_generation():
    env = pod_env(7, 1, MEMBERS, 2, 29501, "uid-1", {"PATH": "/bin", "RANK": "stale"})
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "DIPHOMA_GENERATION")} == {
        "RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "3", "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.2",
        "MASTER_PORT": "29501", "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "uid-1",
        "DIPHOMA_GENERATION": "7"}
    assert env["PATH"] == "/bin" and "OMP_NUM_THREADS" not in env  # one process: torch's own threads
    assert host_of("[fd00::5]:29500") == "fd00::5"


def test_a_newer_generation_restarts_the_process_or_ends_a_removed_member():
    assert decide(3, None, "", None) == "wait"
    assert decide(3, None, "", (4, 1)) == "restart"
    assert decide(3, 1, "RingChanged: peer 1 lost", (4, 0)) == "restart"
    assert decide(3, 1, "", (4, 0)) == "restart", "no exception of its own: the ring change ended it"
    assert decide(3, None, "", (4, None)) == "leave", "scaled down"
    assert decide(3, 0, "", (4, 0)) == "leave", "done is done"
    assert decide(3, 1, "ValueError: bad shard\nTraceback ...", (4, 0)) == "fail", "its own error, whatever came"


def test_a_ring_or_store_fault_rejoins_and_the_scripts_own_error_fails():
    ring = 'RingChanged: all_reduce: peer rank 2 lost\nTraceback ...'
    assert fault(ring) == "ring" and decide(3, 1, ring, None) == "rejoin"
    store = "torch.distributed.DistNetworkError: failed to recv, got 0 bytes"
    assert fault(store) == "store" and decide(3, 1, store, None) == "rejoin"
    mismatch = "CollectiveMismatch: all_reduce of 10 elements on rank 0, 12 on rank 1 (a RingError)"
    assert fault(mismatch) is None and decide(3, 1, mismatch, None) == "fail"
    quoted = 'ValueError: expected RingChanged\n  File "train.py", line 3, in <module>\n    except RingChanged:'
    assert fault(quoted) is None, "the exception's type decides, not words in its traceback"
    assert decide(3, 1, "ValueError: bad shard", None) == "fail"
    assert decide(3, -9, "", None) == "fail", "killed by someone else: this worker failed"
    assert decide(3, 0, "", None) == "leave"


def test_the_restart_log_says_who_left_and_who_came():
    assert changes(None, MEMBERS) == ""
    assert changes(MEMBERS, MEMBERS[:1] + [("w-4", "127.0.0.6:29500")]) == " (lost w-2, w-3; added w-4)"
    assert changes(MEMBERS, MEMBERS) == ""


def test_each_restart_in_place_has_the_cause_the_status_counts():
    assert restart_cause(MEMBERS, MEMBERS[:2]) == "MemberLost"
    assert restart_cause(MEMBERS, MEMBERS[1:] + [("w-4", "127.0.0.6:29500")]) == "MemberLost", "lost and joined"
    assert restart_cause(MEMBERS[:2], MEMBERS) == "MemberJoined"
    assert restart_cause(MEMBERS, MEMBERS) == "RingFault", "the same members again"


def test_a_process_of_a_new_generation_refuses_the_previous_generations_store():
    """A joiner that connected to rank 0's previous process (it serves the rendezvous store on
    the same address until replaced) is told at once, as a store fault the launcher retries."""
    import torch.distributed as dist

    from diphoma.torch import _same_generation_store

    store = dist.HashStore()
    _same_generation_store(store, 0, "2")  # rank 0's process of generation 2
    _same_generation_store(store, 1, "2")
    try:
        _same_generation_store(store, 1, "3")
    except dist.DistStoreError as e:
        assert fault(f"torch.distributed.DistStoreError: {e}") == "store", e
    else:
        raise AssertionError("a joiner of generation 3 took generation 2's store")


def test_each_process_of_a_pod_of_several_gets_its_local_and_global_rank():
    """Pod rank 1 of 3, local rank 1 of 2: ring rank 1·2 + 1 of 6, as torchrun's node 1."""
    env = pod_env(7, 1, MEMBERS, 0, 29501, "uid-1", {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1"}, 1, 2)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DIPHOMA_LOCAL_RANK",
                                "DIPHOMA_PROCESSES_PER_WORKER")} == {
        "RANK": "3", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.2", "MASTER_PORT": "29501", "DIPHOMA_LOCAL_RANK": "1",
        "DIPHOMA_PROCESSES_PER_WORKER": "2"}
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1", "not overridden: the process picks cuda:LOCAL_RANK"
    assert env["OMP_NUM_THREADS"] == "1", "several processes: torchrun's default"


def test_one_failed_process_takes_the_pod_out_its_own_failure_first():
    ring = "RingChanged: all_reduce: peer rank 3 lost"
    assert group_exit([None, None], ["", ""]) == (None, "", None)
    assert group_exit([0, None], ["", ""]) == (None, "", None), "one done, the other still runs"
    assert group_exit([0, 0], ["", ""]) == (0, "", None)
    assert group_exit([1, -9], [ring, ""]) == (-9, "", 1), "the killed one, not its sibling's ring fault"
    assert group_exit([1, 1], [ring, ring]) == (1, ring, 0)
    rc, error, local = group_exit([None, 1], ["", "ValueError: bad shard"])
    assert (rc, local) == (1, 1) and decide(3, rc, error, None) == "fail"


def test_the_launcher_follows_the_jobs_processes_per_worker():
    assert processes_per_worker(1, {}) == 1
    assert processes_per_worker(1, {"DIPHOMA_PROCESSES_PER_WORKER": "8"}) == 8
    assert processes_per_worker(8, {"DIPHOMA_PROCESSES_PER_WORKER": "8"}) == 8
    for nproc, env, named in ((4, {"DIPHOMA_PROCESSES_PER_WORKER": "8"}, "spec.processesPerWorker"),
                              (2, {}, "--nproc-per-node 2"),
                              (1, {"DIPHOMA_PROCESSES_PER_WORKER": "0"}, "DIPHOMA_PROCESSES_PER_WORKER"),
                              (1, {"DIPHOMA_PROCESSES_PER_WORKER": "x"}, "DIPHOMA_PROCESSES_PER_WORKER")):
        with pytest.raises(ConfigError, match=named):
            processes_per_worker(nproc, env)
