"""Checkpoints of an elastic State (``diphoma.torch.checkpoint``): written atomically, the
newest valid one wins (a truncated or foreign newer file is skipped), and an elastic run that
finds one in DIPHOMA_CHECKPOINT_DIR resumes from it: 20 steps, then a second run to 40, end
where an undisturbed 40-step run ends (the tolerance of test_elastic.py)."""

import os
import sys

import pytest
import torch

from conftest import check, launch
from test_elastic import undisturbed

from diphoma.torch import checkpoint


def snap(step):
    return {"step": step, "model": {"w": torch.full((3,), float(step))}, "optimizer": None, "extra": {"epoch": step // 10}}


def test_newest_valid_checkpoint_wins_and_only_the_newest_are_kept(tmp_path):
    for s in (5, 10, 15, 20):
        checkpoint.save(snap(s), str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [f"torch-{s:012d}.pt" for s in (10, 15, 20)]  # KEEP 3, no temporaries
    # A newest file cut short (a crash mid-copy) and one whose step differs from its name.
    (tmp_path / f"torch-{30:012d}.pt").write_bytes((tmp_path / f"torch-{20:012d}.pt").read_bytes()[:100])
    os.rename(tmp_path / f"torch-{15:012d}.pt", tmp_path / f"torch-{25:012d}.pt")
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        path, got = checkpoint.load_newest(str(tmp_path))
    assert path.endswith(f"torch-{20:012d}.pt") and got["step"] == 20 and got["extra"] == {"epoch": 2}
    assert torch.equal(got["model"]["w"], torch.full((3,), 20.0))
    assert checkpoint.load_newest(str(tmp_path / "absent")) is None


def test_bad_checkpoint_every_is_named(monkeypatch):
    monkeypatch.setenv("DIPHOMA_CHECKPOINT_EVERY", "often")
    import diphoma

    with pytest.raises(diphoma.ConfigError, match="DIPHOMA_CHECKPOINT_EVERY"):
        checkpoint.every()


def test_an_elastic_run_resumes_from_the_newest_checkpoint(tmp_path):
    env = dict(os.environ, DIPHOMA_CHECKPOINT_DIR=str(tmp_path / "ckpt"), DIPHOMA_CHECKPOINT_EVERY="5")
    for steps in (20, 40):
        out = tmp_path / f"out{steps}"
        out.mkdir()
        check(launch(2, "elastic_train.py", str(out), str(steps), env=env, elastic=True))
    assert sorted(os.listdir(tmp_path / "ckpt"))[-1] == f"torch-{40:012d}.pt"
    torch.testing.assert_close(torch.load(tmp_path / "out40" / "params.pt"), undisturbed(40), atol=5e-5, rtol=2e-4)


def test_an_elastic_run_takes_its_frame_protection_from_the_environment(tmp_path):
    """``DIPHOMA_RING_PROTECTION`` reaches the ring of an elastic run (the ring directory's
    generations) as it does a fixed one: a bad value is refused naming the variable, and
    ``encryption`` trains to the undisturbed parameters."""
    env = lambda mode: dict(os.environ, DIPHOMA_RING_PROTECTION=mode)  # noqa: E731
    bad = launch(2, "elastic_train.py", str(tmp_path), "4", env=env("mac"), elastic=True)
    assert bad.returncode != 0, bad.stdout
    assert 'DIPHOMA_RING_PROTECTION: "mac" is not one of none, integrity, encryption' in bad.stdout + bad.stderr
    out = tmp_path / "encrypted"
    out.mkdir()
    check(launch(2, "elastic_train.py", str(out), "20", env=env("encryption"), elastic=True))
    torch.testing.assert_close(torch.load(out / "params.pt"), undisturbed(20), atol=5e-5, rtol=2e-4)
