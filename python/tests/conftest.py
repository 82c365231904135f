"""Helpers of the diphoma Python tests: run a script under the standalone launcher."""

import json
import os
import subprocess
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")


def launch(nproc, script, *args, timeout=120, env=None, elastic=False):
    """Runs ``python -m diphoma.run --nproc N [--elastic] scripts/SCRIPT ARGS`` and returns the
    completed process (stdout and stderr captured as text)."""
    flags = ["--elastic"] if elastic else []
    return subprocess.run(
        [sys.executable, "-m", "diphoma.run", "--nproc", str(nproc), *flags, os.path.join(SCRIPTS, script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def check(proc):
    """Fails the test with the ranks' output unless the launcher exited 0."""
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def records(out):
    """The JSON records the ranks of a test script wrote into directory ``out``, by file name
    without ``.json`` (a record being replaced at that moment is skipped)."""
    got = {}
    for n in os.listdir(out):
        if n.endswith(".json"):
            try:
                with open(os.path.join(out, n)) as f:
                    got[n[: -len(".json")]] = json.load(f)
            except (OSError, ValueError):
                pass  # being replaced
    return got
