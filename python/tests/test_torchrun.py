"""``python -m diphoma.run`` as torchrun: its variables, its flags, torch's failure summary
naming the root-cause rank with its traceback, restarts of every rank (``--max-restarts``)
resuming an unchanged tutorial-style DDP script from its own snapshot."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import SCRIPTS, check


def run(*args, timeout=120, env=None):
    """``python -m diphoma.run ARGS`` with stdout and stderr captured."""
    return subprocess.run([sys.executable, "-m", "diphoma.run", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def script(name):
    return os.path.join(SCRIPTS, name)


def test_every_rank_sees_torchruns_variables_and_prefixed_output():
    p = check(run("--nproc-per-node", "3", "--run-id", "job7", script("raise_on_rank.py"), "-1"))
    for r in range(3):
        assert f"[rank{r}]:rank {r} of 3 local {r} restart 0 run job7" in p.stdout, p.stdout
    p = check(run("--nproc", "2", "--no-python", "/bin/sh", "-c",
                  "echo $GROUP_RANK $ROLE_RANK $ROLE_WORLD_SIZE $LOCAL_WORLD_SIZE $MASTER_ADDR $TORCHELASTIC_MAX_RESTARTS"))
    assert "[rank1]:0 1 2 2 127.0.0.1 0" in p.stdout, p.stdout


def test_a_failing_rank_is_named_with_its_traceback(tmp_path):
    """Rank 1 of 3 raises; the ranks it leaves in a barrier fail with RingChanged. The summary's
    root cause is rank 1 with its exception and traceback (from its error file, written for an
    unchanged script), not a rank that only lost its peer."""
    p = run("--nproc", "3", "--log-dir", str(tmp_path), script("raise_on_rank.py"), "1")
    assert p.returncode == 1, (p.returncode, p.stderr[-3000:])  # rank 1's own code: it had time to exit
    root = p.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert "rank      : 1 (local_rank: 1)" in root and "ValueError: bad batch on rank 1" in root, p.stderr[-3000:]
    assert 'raise_on_rank.py", line' in root, root
    assert "diphoma.run: root cause: rank 1" in p.stderr and "ValueError: bad batch on rank 1" in p.stderr
    errors = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f == "error.json"]
    assert any("bad batch on rank 1" in open(e).read() for e in errors), errors


def test_a_rank_that_exits_first_is_the_root_cause_with_its_code():
    """Rank 1 calls sys.exit(3); rank 0's all_reduce then fails with RingChanged. The root cause
    is rank 1 with exit 3, and so is the launcher's exit code (the others get time to exit by
    themselves before they are stopped, so no rank is blamed for a SIGTERM)."""
    p = run("--nproc", "2", script("exit_early.py"))
    assert p.returncode == 3, (p.returncode, p.stderr[-3000:])
    assert "diphoma.run: root cause: rank 1, exit 3" in p.stderr, p.stderr[-3000:]
    root = p.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert "rank      : 1 (local_rank: 1)" in root, root  # torch's table agrees


def test_of_two_ranks_raising_within_a_second_the_first_is_the_root_cause():
    """torch's error files carry whole seconds; diphoma._boot stamps the exception's own time,
    so rank 1's error, 0.1 s before rank 0's, is the root cause whatever the second."""
    for _ in range(3):
        p = run("--nproc", "2", script("two_raise.py"))
        assert p.returncode == 1, p.stderr[-3000:]
        assert "diphoma.run: root cause: rank 1, exit 1: ZeroDivisionError: rank 1's first error" in p.stderr, p.stderr[-3000:]


def test_an_elastic_rank_that_exits_1_to_127_stops_the_run_with_its_code():
    """As a DiphomaJob's default restartOnExitCodes: 1-127 is the script's permanent error, not
    a lost member to re-form without; the others are stopped."""
    p = run("--nproc", "2", "--elastic", "--grace", "1", script("elastic_exit.py"), timeout=50)
    assert p.returncode == 5, p.stderr[-3000:]
    assert "local-1 (rank 1) exited with 5: a permanent error" in p.stderr, p.stderr[-3000:]


def test_max_restarts_resumes_an_unchanged_torchrun_script_from_its_snapshot(tmp_path):
    """PyTorch's tutorial-style script (LOCAL_RANK, env://, DistributedSampler, rank 0's
    snapshot); rank 1 dies in epoch 2 of the first attempt: every rank is restarted with
    TORCHELASTIC_RESTART_COUNT 1, loads the snapshot of epoch 2 and trains to the end."""
    snap = str(tmp_path / "snapshot.pt")
    p = check(run("--nproc-per-node", "2", "--max-restarts", "1", script("torchrun_ddp.py"), "4", snap, "2"))
    assert "[rank1]:rank 1: dying" in p.stdout, p.stdout
    assert "restarting every rank (1 of 1)" in p.stderr, p.stderr[-3000:]
    for r in (0, 1):
        assert f"[rank{r}]:rank {r}: Resuming training from snapshot at Epoch 2" in p.stdout, p.stdout
    assert "[rank0]:trained: epochs 4" in p.stdout, p.stdout
    # Without restarts the same failure ends the run with rank 1's exit code.
    p = run("--nproc-per-node", "2", script("torchrun_ddp.py"), "4", str(tmp_path / "other.pt"), "2")
    assert p.returncode == 1 and "diphoma.run: root cause: rank 1, exit 1" in p.stderr, p.stderr[-3000:]


def test_lightning_resumes_from_its_own_last_checkpoint_after_a_restart(tmp_path):
    """A framework that owns the loop commits and restores with its own hooks: Lightning's
    ModelCheckpoint(save_last=True) every 3 steps and fit(ckpt_path="last"). Rank 1 dies at
    step 7; every rank is restarted (as the in-pod launcher restarts a pod's process in place)
    and the run resumes at step 6, the last checkpoint, not at 0, and ends at 12."""
    p = check(run("--nproc", "2", "--max-restarts", "1", script("lightning_resume.py"), str(tmp_path / "ckpt"),
                  timeout=300))
    assert "[rank1]:rank 1: dying" in p.stdout, p.stdout
    assert "[rank0]:start at step 0 restart 0" in p.stdout, p.stdout
    assert "[rank0]:start at step 6 restart 1" in p.stdout, p.stdout
    assert "[rank0]:done at step 12" in p.stdout, p.stdout


def test_nproc_per_node_takes_torchruns_device_words():
    """--nproc-per-node cpu/auto as torchrun reads them (auto: the accelerators, else the
    cores); gpu without one and a word torchrun does not know are refused, named."""
    cores = torch._utils.cpu_count()
    accelerators = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    for word, world in (("cpu", cores), ("auto", accelerators or cores)):
        p = check(run("--nproc-per-node", word, "--no-python", "/bin/sh", "-c", "echo world $WORLD_SIZE"))
        assert f"[rank0]:world {world}" in p.stdout, p.stdout
    for word in ("many",) if torch.cuda.is_available() else ("gpu", "many"):
        p = run("--nproc-per-node", word, script("omp.py"))
        assert p.returncode == 2 and f"--nproc-per-node {word}: " in p.stderr, p.stderr


def test_module_filter_and_refused_flags():
    p = check(run("--nproc", "2", "--local-ranks-filter", "1", "-m", "json.tool", "--help"))
    assert "[rank1]:usage: python -m json.tool" in p.stdout and "[rank0]" not in p.stdout, p.stdout
    p = check(run("--nproc", "2", "--master-port", "29661", "--rdzv-backend", "c10d", "--rdzv_endpoint", "x:1",
                  "--no-python", "/bin/sh", "-c", "echo port $MASTER_PORT"))
    assert "[rank1]:port 29661" in p.stdout, p.stdout
    p = run("--master-addr", "10.0.0.1", script("omp.py"))
    assert p.returncode == 2 and "this launcher runs one node on 127.0.0.1" in p.stderr, p.stderr
    p = run("--nnodes", "2", "--node-rank", "1", script("omp.py"))
    assert p.returncode == 2 and "this launcher runs one node" in p.stderr, p.stderr
    p = run("--elastic", "--max-restarts", "1", script("omp.py"))
    assert p.returncode == 2 and "--elastic re-forms in place" in p.stderr, p.stderr


@pytest.mark.parametrize("launcher", ["torchrun", "mp.spawn"])
def test_started_outside_diphoma_run_the_error_says_how_to_start(launcher, tmp_path):
    """Under torchrun (or mp.spawn, or plain python with torch's variables), the ring's own
    variables are missing: the error says to start through python -m diphoma.run."""
    code = ("import torch.distributed as dist, diphoma.torch\n"
            "dist.init_process_group(backend='diphoma', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIPHOMA_")}
    if launcher == "torchrun":
        env.update(TORCHELASTIC_RUN_ID="x", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 1, p.stderr
    assert "start it with python -m diphoma.run" in p.stderr, p.stderr[-2000:]
