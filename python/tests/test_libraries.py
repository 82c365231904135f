"""The libraries users train with, unchanged, on the "diphoma" backend: torch's own DCP
(resharded 4 -> 2) and FSDP2 (against gloo), PyTorch Lightning's DDPStrategy against gloo, and
Hugging Face Accelerate's packaged distributed test scripts, and Accelerate's own save_state /
load_state resuming a restarted run."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import SCRIPTS, check, launch


def test_dcp_saves_at_world_4_and_loads_resharded_at_world_2(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    assert "dcp ok: save at world 4" in check(launch(4, "dcp_reshard.py", "save", ckpt)).stdout
    assert "dcp ok: load at world 2" in check(launch(2, "dcp_reshard.py", "load", ckpt)).stdout


@pytest.mark.parametrize("world", [2, 3])
def test_lightning_ddp_trains_as_with_gloo(world, tmp_path):
    """Same seed, data and steps: the weights after 3 epochs agree with gloo's within float32
    summation-order error (the two backends add the ranks' gradients in different orders; at
    world 2 the sum is the same either way)."""
    got = {}
    for backend in ("diphoma", "gloo"):
        out = str(tmp_path / f"{backend}.pt")
        check(launch(world, "lightning_ddp.py", backend, out, timeout=200))
        got[backend] = torch.load(out)
    for k, v in got["gloo"]["state"].items():
        torch.testing.assert_close(got["diphoma"]["state"][k], v, rtol=1e-5, atol=1e-6)
    assert abs(got["diphoma"]["loss"] - got["gloo"]["loss"]) < 1e-5


# Accelerate's own distributed test scripts that run distributed on CPU (the wrapper checks that
# the diphoma group carried collectives). Left out: test_ops (its PartialState() takes no cpu
# flag, so on a machine without accelerators it runs one process per rank, undistributed),
# test_ddp_comm_hook (DDP with device_ids: GPUs only), test_distributed_data_loop (its
# join_uneven_inputs joins only on accelerators: with gloo it hangs at "Test joining uneven
# inputs", with diphoma it fails at once with CollectiveMismatch).
@pytest.mark.parametrize("module", ["test_script", "test_sync"])
def test_accelerates_own_test_scripts(module):
    env = {**os.environ, "ACCELERATE_USE_CPU": "1"}
    p = subprocess.run([sys.executable, "-m", "diphoma.run", "--nproc", "2", "--backend", "diphoma",
                        os.path.join(SCRIPTS, "accelerate_script.py"), module],
                       capture_output=True, text=True, timeout=240, env=env)
    check(p)
    assert f"accelerate ok: accelerate.test_utils.scripts.{module}" in p.stdout, p.stdout[-3000:]


def test_accelerate_resumes_from_its_own_saved_state_after_a_restart(tmp_path):
    """A framework that owns the loop commits and restores with its own hooks: Accelerate's
    save_state every 3 steps and load_state on start. Rank 1 dies at step 7; every rank is
    restarted (as the in-pod launcher restarts a pod's process in place), the run resumes at
    step 6, not 0, and ends with the weights of a run that never failed (same data, same order:
    the same float32 sums)."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1"}
    out = {}
    for mode in ("die", "live"):
        args = ["--max-restarts", "1"] if mode == "die" else []
        p = subprocess.run([sys.executable, "-m", "diphoma.run", "--nproc", "2", "--backend", "diphoma", *args,
                            os.path.join(SCRIPTS, "accelerate_resume.py"), str(tmp_path / mode), mode],
                           capture_output=True, text=True, timeout=240, env=env)
        check(p)
        out[mode] = p.stdout
    assert "[rank1]:rank 1: dying" in out["die"], out["die"]
    assert "[rank0]:start at step 0 restart 0" in out["die"], out["die"]
    assert "[rank0]:start at step 6 restart 1" in out["die"], out["die"]
    done = [next(x for x in o.splitlines() if "done at step 12 weights" in x) for o in out.values()]
    assert done[0] == done[1], done


def test_fsdp2_trains_as_with_gloo(tmp_path):
    """FSDP2 (``fully_shard`` per layer, CPU): all-gathers of the shards, reduce-scatters of the
    gradients and the DTensor state dict on the diphoma backend give gloo's losses and weights
    (world 2: the reduction of two shards is the same sum in either order)."""
    got = {}
    for backend in ("diphoma", "gloo"):
        out = str(tmp_path / f"{backend}.pt")
        check(launch(2, "fsdp2.py", backend, out, timeout=200))
        got[backend] = torch.load(out)
    assert got["diphoma"]["losses"] == got["gloo"]["losses"], got
    for k, v in got["gloo"]["state"].items():
        torch.testing.assert_close(got["diphoma"]["state"][k], v, rtol=0, atol=0)
