"""Each collective, dtype and op of the "diphoma" backend against a reference computed in the
script (scripts/collectives.py), at a power-of-two world and an odd one."""

import pytest

from conftest import check, launch


@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_match_reference(world):
    p = check(launch(world, "collectives.py"))
    assert "collectives ok" in p.stdout


def test_sync_collectives_run_on_the_callers_thread():
    """A synchronous call runs on the caller's thread (no hop to the group's thread), an
    asynchronous one on the group's thread, and a mix of both keeps the call order."""
    p = check(launch(2, "threads.py"))
    assert "threads ok" in p.stdout
