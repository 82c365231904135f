"""``python -m diphoma.run``'s environment for the ranks, as torchrun's: several ranks get
``OMP_NUM_THREADS=1`` unless it is set, so their thread pools do not oversubscribe the cores."""

import os

from conftest import check, launch


def test_several_ranks_get_one_omp_thread_each():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    p = check(launch(2, "omp.py", env=env))
    for r in (0, 1):
        assert f"rank {r} OMP_NUM_THREADS=1 threads=1" in p.stdout, p.stdout


def test_a_set_omp_num_threads_is_kept():
    p = check(launch(2, "omp.py", env={**os.environ, "OMP_NUM_THREADS": "2"}))
    for r in (0, 1):
        assert f"rank {r} OMP_NUM_THREADS=2 threads=2" in p.stdout, p.stdout
