"""``python -m diphoma.run``'s environment for the ranks and its signals, as torchrun's: several ranks get
``OMP_NUM_THREADS=1`` unless it is set, so their thread pools do not oversubscribe the cores."""

import os
import signal
import subprocess
import sys
import time

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


def test_ctrl_c_twice_to_the_launchers_process_group_stops_every_rank_with_130(tmp_path):
    """As a terminal's Ctrl-C: SIGINT to the launcher's whole process group, twice. Every rank
    stops and the launcher exits 128 + 2 naming the signal (before: exit 1 with torch's
    SignalException, and under ``timeout`` a launcher that hung after its ranks had gone)."""
    script = tmp_path / "loop.py"
    script.write_text("import time, torch, torch.distributed as dist\n"
                      "import diphoma.torch\n"
                      "dist.init_process_group('diphoma')\n"
                      "for i in range(100000):\n"
                      "    dist.all_reduce(torch.ones(8))\n"
                      "    print('step', i, flush=True)\n"
                      "    time.sleep(0.05)\n")
    p = subprocess.Popen([sys.executable, "-m", "diphoma.run", "--nproc", "2", str(script)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert "step" in p.stdout.readline() + p.stdout.readline()
        for _ in range(2):
            os.killpg(p.pid, signal.SIGINT)
            time.sleep(0.3)
        out, err = p.communicate(timeout=60)  # a bound, not a measurement: a hang fails here
        assert p.returncode == 130, err[-3000:]
        assert "diphoma.run: stopped by signal 2" in err, err[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
