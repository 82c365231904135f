"""Pods of several training processes (``spec.processesPerWorker``, issue 27): 2 pods × 2
processes, each pod a ``python -m diphoma.run`` launcher (``diphoma._pod``) that follows a ring
directory this test publishes, as the operator publishes the ring ConfigMap. The ring lists
pods; each pod's local rank ``l`` is ring rank ``pod·2 + l`` at the pod's ring port + 2·l.

The default group's all-reduce is hierarchical there (``diphoma.torch._plane``: in-pod ring,
then local rank l's ring across the pods); each process logs it (``scripts/info_log.py``) and
the tests check that it ran at each generation of two pods.

- An unchanged DDP script (``ddp_train.py``, torchrun's variables) trains at world 4 to the
  parameters gloo reaches at world 4 (tolerance: test_ddp.py's, for the same n = 4).
- Every c10d operation and dtype against a gloo group of the same ranks (``ops_vs_gloo.py``).
- An elastic script through a ``kill -9`` of one process: its pod's launcher stops the
  sibling and exits 137, the other pod's processes keep their pids and go on at the next
  generation, a replacement pod joins the one after, and the final parameters equal an
  undisturbed run's (tolerance: test_elastic.py's).
- The same script through a process paused past the liveness window and resumed: nobody hangs.

Every process started is stopped by its recorded pid when the test ends, also on failure.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import SCRIPTS, check, launch, records
from diphoma import ConfigError, membership_json
from diphoma.torch._plane import (hierarchical_min_bytes, hierarchical_split, pod_groups, pod_library,
                                  processes_per_pod)
from test_ddp import GLOO_EXIT_ABORT
from test_elastic import STEPS as ELASTIC_STEPS, undisturbed

HOST = "127.0.0.1"
PROCESSES = 2


def pod_port():
    """A ring port for a local pod of 2 processes: it, + 1 (the store) and + 2 are free."""
    while True:
        s = socket.socket()
        s.bind((HOST, 0))
        port = s.getsockname()[1]
        s.close()
        try:
            for p in (port + 1, port + 2):
                with socket.socket() as t:
                    t.bind((HOST, p))
            return port
        except OSError:
            continue


class Pods:
    """The operator's part for local pods: the ring directory, its key, each pod's launcher."""

    def __init__(self, tmp_path, env=None):
        self.env = env or {}  # more variables for every pod's launcher
        self.dir = tmp_path / "ring"
        self.dir.mkdir()
        self.key = tmp_path / "ring.key"
        self.key.write_bytes(os.urandom(32))
        self.key.chmod(0o600)
        self.uid = "local-pods-test"
        self.generation = 0
        self.ports = {}
        self.launchers = {}  # pod -> Popen
        self.logs = {}

    def start(self, pod, *args):
        """Starts pod ``pod``'s launcher: ``python -m diphoma.run ARGS`` with the pod's variables."""
        self.ports[pod] = pod_port()
        # Every pod has the same store port in a job (spec.ringPort + 1); rank 0's process serves it
        # on its pod's IP. Here all pods share 127.0.0.1: the first pod's, whose + 1 is kept free.
        store = next(iter(self.ports.values())) + 1
        env = dict(os.environ, DIPHOMA_RING_DIR=str(self.dir), DIPHOMA_POD_NAME=pod, DIPHOMA_KEY_FILE=str(self.key),
                   DIPHOMA_JOB_UID=self.uid, DIPHOMA_STORE_PORT=str(store),
                   DIPHOMA_PROCESSES_PER_WORKER=str(PROCESSES), DIPHOMA_DETECTION_SECONDS="2",
                   DIPHOMA_HIERARCHICAL_MIN_BYTES="0",  # the tests' small tensors go hierarchical too
                   **self.env)
        self.logs[pod] = open(self.dir.parent / f"{pod}.log", "w+")
        self.launchers[pod] = subprocess.Popen([sys.executable, "-m", "diphoma.run", *args], env=env,
                                               stdout=self.logs[pod], stderr=subprocess.STDOUT)

    def publish(self, *pods):
        """Publishes the next generation: ``pods`` by rank."""
        self.generation += 1
        doc = membership_json(self.generation, self.uid, [(p, HOST, self.ports[p]) for p in pods])
        tmp = self.dir / "membership.json.tmp"
        tmp.write_text(doc)
        os.rename(tmp, self.dir / "membership.json")

    def log(self, pod):
        """Pod ``pod``'s launcher's output so far (also once ``stop`` closed it)."""
        return (self.dir.parent / f"{pod}.log").read_text()

    def wait(self, pod, timeout):
        try:
            return self.launchers[pod].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{pod}'s launcher still runs after {timeout} s\n{self.log(pod)[-4000:]}") from None

    def stop(self, pids=()):
        """SIGTERM to every launcher still running (they stop their processes), SIGKILL after
        10 s; then SIGKILL to each of ``pids`` (training processes) still alive."""
        for p in self.launchers.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.launchers.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for f in self.logs.values():
            f.close()


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def with_info_log(script):
    """The launcher's arguments that run ``scripts/SCRIPT`` with the ``diphoma`` logger at INFO."""
    return os.path.join(SCRIPTS, "info_log.py"), os.path.join(SCRIPTS, script)


def hierarchical(generation, pod, local, pods=2):
    """What local rank ``local`` of pod ``pod`` logs when its group's all-reduce is hierarchical."""
    rank = pod * PROCESSES + local
    return (f"ring generation {generation} (rank {rank} of {pods * PROCESSES}): all-reduce hierarchical, "
            f"pod {pod} of {pods}, local rank {local} of {PROCESSES}")


def test_the_all_reduce_is_hierarchical_only_across_pods_of_several_processes():
    pod = {"DIPHOMA_LOCAL_RANK": "1", "DIPHOMA_PROCESSES_PER_WORKER": "2"}
    assert processes_per_pod(4, pod) == 2
    assert processes_per_pod(8, {**pod, "DIPHOMA_PROCESSES_PER_WORKER": "4"}) == 4
    assert processes_per_pod(2, pod) == 1  # one pod: its ring is the flat ring
    assert processes_per_pod(4, {**pod, "DIPHOMA_HIERARCHICAL": "0"}) == 1  # opted out
    assert processes_per_pod(4, {"DIPHOMA_PROCESSES_PER_WORKER": "2"}) == 1  # not started as a pod's process
    assert processes_per_pod(4, {"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == 1  # the standalone launcher
    assert processes_per_pod(4, {**pod, "DIPHOMA_PROCESSES_PER_WORKER": "x"}) == 1
    assert processes_per_pod(6, {**pod, "DIPHOMA_PROCESSES_PER_WORKER": "4"}) == 1  # not whole pods
    assert processes_per_pod(4, {**pod, "DIPHOMA_HIERARCHICAL": "1"}) == 2
    for bogus in ("bogus", "no", "2"):
        with pytest.raises(ConfigError, match=f"DIPHOMA_HIERARCHICAL='{bogus}' must be 0"):
            processes_per_pod(4, {**pod, "DIPHOMA_HIERARCHICAL": bogus})


def test_each_rank_reduces_in_its_pod_then_across_pods_with_its_local_rank():
    # 3 pods of 2: rank 3 is local rank 1 of pod 1.
    assert pod_groups(3, 6, 2) == (([2, 3], 1), ([1, 3, 5], 1))
    assert pod_groups(0, 6, 2) == (([0, 1], 0), ([0, 2, 4], 0))
    assert pod_groups(7, 8, 4) == (([4, 5, 6, 7], 3), ([3, 7], 1))
    # Equal chunks over the two levels; the rest (fewer than P elements) over the flat ring.
    assert [hierarchical_split(n, 4) for n in (0, 3, 4, 10, 1000)] == [0, 0, 4, 8, 1000]
    # Below the smallest hierarchical all-reduce (bytes), all of it over the flat ring.
    assert hierarchical_split(1000, 4, 4, 4000) == 1000 and hierarchical_split(999, 4, 4, 4000) == 0
    # The in-pod stages' library: NCCL wherever it can run (CUDA tensors), gloo on request (CPU).
    assert pod_library({}, True) == "nccl" and pod_library({"DIPHOMA_POD_PLANE": "gloo"}, True) == "nccl"
    assert pod_library({}, False) is None and pod_library({"DIPHOMA_POD_PLANE": "GLOO"}, False) == "gloo"
    with pytest.raises(ConfigError, match="DIPHOMA_POD_PLANE='shm' is not an in-pod plane"):
        pod_library({"DIPHOMA_POD_PLANE": "shm"}, False)
    assert hierarchical_min_bytes({}) == 1 << 20 and hierarchical_min_bytes({"DIPHOMA_HIERARCHICAL_MIN_BYTES": "0"}) == 0
    with pytest.raises(ConfigError, match="DIPHOMA_HIERARCHICAL_MIN_BYTES='1M' must be a number of bytes"):
        hierarchical_min_bytes({"DIPHOMA_HIERARCHICAL_MIN_BYTES": "1M"})


@pytest.mark.parametrize("pod_plane", ["ring", "gloo"])
def test_ddp_of_two_pods_of_two_processes_equals_gloo_at_world_4(tmp_path, pod_plane):
    """With ``DIPHOMA_POD_PLANE=gloo`` the in-pod stages run on a gloo communicator of the pod
    (the CPU twin of NCCL in the pod: the same code path, ``_library_stages``)."""
    steps, gloo_out, ours_out = "20", str(tmp_path / "gloo.pt"), str(tmp_path / "ours.pt")
    proc = launch(4, "ddp_train.py", "gloo", steps, gloo_out)
    if proc.returncode == 134 and GLOO_EXIT_ABORT in proc.stderr:  # see test_ddp.py
        proc = launch(4, "ddp_train.py", "gloo", steps, gloo_out)
    check(proc)
    pods = Pods(tmp_path, {"DIPHOMA_POD_PLANE": pod_plane})
    try:
        for pod in ("pod-a", "pod-b"):
            pods.start(pod, "--nproc-per-node", str(PROCESSES), *with_info_log("ddp_train.py"), "diphoma", steps,
                       ours_out)
        pods.publish("pod-a", "pod-b")
        for pod in ("pod-a", "pod-b"):
            assert pods.wait(pod, 180) == 0, pods.log(pod)[-6000:]
    finally:
        pods.stop()
    # Each process all-reduced over its pod's ring and its local rank's ring across the pods.
    for pod, index in (("pod-a", 0), ("pod-b", 1)):
        for local in range(PROCESSES):
            assert hierarchical(1, index, local) in pods.log(pod), pods.log(pod)[-4000:]
        assert ("in the pod: gloo" in pods.log(pod)) == (pod_plane == "gloo"), pods.log(pod)[-4000:]
    torch.testing.assert_close(torch.load(ours_out), torch.load(gloo_out), atol=2e-5, rtol=1e-4)


def test_every_operation_in_two_pods_of_two_processes_matches_a_gloo_group():
    """ops_vs_gloo.py's every operation and dtype at world 4, against a gloo group of the same
    ranks: the hierarchical all-reduce (11 elements: 10 over the two levels, 1 over the flat
    ring) exact for integers, within float tolerance otherwise. Run as a user runs it:
    ``python -m diphoma.run --pods 2 --nproc-per-node 2`` (two local pods)."""
    p = subprocess.run([sys.executable, "-m", "diphoma.run", "--pods", "2", "--nproc-per-node", str(PROCESSES),
                        *with_info_log("ops_vs_gloo.py")], capture_output=True, text=True, timeout=400,
                       env=dict(os.environ, DIPHOMA_HIERARCHICAL_MIN_BYTES="0"))
    output = p.stdout + p.stderr
    assert p.returncode == 0, output[-6000:]
    assert "ops ok" in output, output[-4000:]
    assert hierarchical(1, 1, 1) in output, output[-4000:]


def test_local_pods_stop_together_when_one_fails(tmp_path):
    """Ring rank 3 (local rank 1 of pod-1) exits 1: its pod exits 1, the launcher stops pod-0
    and exits 1 too, naming the pod; none of the four processes is left running."""
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      f"open(os.path.join({str(tmp_path)!r}, os.environ['RANK'] + '.pid'), 'w').write(str(os.getpid()))\n"
                      "sys.exit(1) if os.environ['RANK'] == '3' else time.sleep(600)\n")
    p = subprocess.run([sys.executable, "-m", "diphoma.run", "--pods", "2", "--nproc-per-node", str(PROCESSES),
                        "--grace", "1", str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, (p.stdout + p.stderr)[-4000:]
    assert "pod-1 exited with 1; stopping the other pods" in p.stderr, p.stderr[-4000:]
    pids = [int(f.read_text()) for f in tmp_path.glob("*.pid")]
    assert len(pids) == 4 and not any(alive(pid) for pid in pids), pids


def test_local_pods_end_when_their_ring_breaks_without_restarting_the_script(tmp_path):
    """Ring rank 1 returns after its first all-reduce while the others go on: their ring breaks.
    Under ``--pods`` nobody publishes another generation, so each pod's launcher ends at once
    (before, each restarted its processes in place three times over about 165 s, waiting for
    the operator); every process ran the script once."""
    script = tmp_path / "early.py"
    script.write_text("import os, sys, torch, torch.distributed as dist\n"
                      "import diphoma.torch\n"
                      "sys.stdout.write(f\"started {os.environ['RANK']}\\n\")\n"
                      "dist.init_process_group('diphoma')\n"
                      "t = torch.ones(4)\n"
                      "dist.all_reduce(t)\n"
                      "if dist.get_rank() == 1:\n"
                      "    sys.exit(0)\n"
                      "for _ in range(1000):\n"
                      "    dist.all_reduce(t)\n")
    p = subprocess.run([sys.executable, "-m", "diphoma.run", "--pods", "2", "--nproc-per-node", str(PROCESSES),
                        str(script)], capture_output=True, text=True, timeout=240)
    output = p.stdout + p.stderr
    assert p.returncode != 0, output[-4000:]
    assert "the ring is fixed (python -m diphoma.run --pods), no other generation comes" in output, output[-4000:]
    # Under --pods the ranks write to the console unprefixed, unbuffered (-u, as torchrun runs
    # them): print()'s pieces are separate writes and two ranks' lines can interleave
    # ("started started1 3"); one write per line stays whole, and the ranks are read by number.
    assert sorted(re.findall(r"started (\d+)", p.stdout)) == [str(r) for r in range(4)], output[-4000:]


def test_local_pods_refuse_what_applies_to_one_pod_or_to_elastic_rings():
    for flags, said in ((["--pods", "2", "--log-dir", "/tmp/x"], "--log-dir, --redirects, --tee"),
                        (["--pods", "2", "--local-ranks-filter", "0"], "--local-ranks-filter are for one pod"),
                        (["--replace"], "--replace starts a new rank for each lost one of an --elastic ring")):
        p = subprocess.run([sys.executable, "-m", "diphoma.run", *flags, "x.py"], capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 2 and said in p.stderr, (flags, p.stderr)


def test_the_hierarchical_variables_are_refused_also_where_they_do_not_apply():
    """A typo in them shows at once, not only once the job runs in pods of several processes."""
    for var, value in (("DIPHOMA_HIERARCHICAL_MIN_BYTES", "1MiB"), ("DIPHOMA_POD_PLANE", "shm")):
        p = launch(2, "collectives.py", env=dict(os.environ, **{var: value}))
        assert p.returncode != 0 and f"{var}='{value}'" in p.stderr, p.stderr[-3000:]


FIRST = ("pod-a.0", "pod-a.1", "pod-b.0", "pod-b.1")


def elastic_script(out):
    """The launcher's arguments of a pod that trains ``elastic_train.py`` into ``out``."""
    return ("--elastic", "--nproc-per-node", str(PROCESSES), *with_info_log("elastic_train.py"), str(out),
            str(ELASTIC_STEPS))


def train_until_step_8(pods, out, pids):
    """Starts pod-a and pod-b on ``elastic_script``, publishes generation 1 with both and waits
    until each process committed step 8 (``pids`` gets their pids, for the test's cleanup);
    returns the records then."""
    for pod in ("pod-a", "pod-b"):
        pods.start(pod, *elastic_script(out))
    pods.publish("pod-a", "pod-b")
    deadline = time.monotonic() + 120
    while True:
        before = records(out)
        pids[:] = [r["pid"] for r in before.values()]
        if all(n in before and before[n]["step"] >= 8 for n in FIRST):
            return before
        for pod in ("pod-a", "pod-b"):
            assert pods.launchers[pod].poll() is None, pods.log(pod)[-6000:]
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.05)


def test_a_killed_process_takes_its_pod_out_and_the_other_pod_goes_on(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    pods = Pods(tmp_path)
    script, first = elastic_script(out), FIRST
    pids = []
    try:
        before = train_until_step_8(pods, out, pids)
        assert {before[n]["world"] for n in first} == {4}
        assert before["pod-b.1"]["step"] < ELASTIC_STEPS, "the run ended before the kill"
        os.kill(before["pod-b.1"]["pid"], signal.SIGKILL)
        # Its pod leaves: the launcher stops the sibling and exits with the killed one's code.
        assert pods.wait("pod-b", 30) == 128 + signal.SIGKILL, pods.log("pod-b")[-4000:]
        assert not alive(before["pod-b.0"]["pid"]), "the sibling of the killed process still runs"
        assert "local rank 1 of pod-b exited with 137" in pods.log("pod-b"), pods.log("pod-b")[-4000:]
        # The operator's part: a generation without the pod, then one with its replacement.
        pods.publish("pod-a")
        pods.start("pod-c", *script)
        pods.publish("pod-a", "pod-c")
        assert pods.wait("pod-a", 180) == 0, pods.log("pod-a")[-6000:]
        assert pods.wait("pod-c", 60) == 0, pods.log("pod-c")[-6000:]
        after = records(out)
        pids = [r["pid"] for r in after.values()]
    finally:
        pods.stop(pids)
    # Generations 1 (pod-a, pod-b) and 3 (pod-a, pod-c) all-reduced over the two levels; generation 2
    # (pod-a alone) over its flat ring.
    for local in range(PROCESSES):
        assert hierarchical(1, 0, local) in pods.log("pod-a"), pods.log("pod-a")[-4000:]
        assert hierarchical(3, 0, local) in pods.log("pod-a"), pods.log("pod-a")[-4000:]
        assert hierarchical(3, 1, local) in pods.log("pod-c"), pods.log("pod-c")[-4000:]
    assert "all-reduce hierarchical" not in "".join(l for l in pods.log("pod-a").splitlines(True)
                                                    if "ring generation 2 " in l)
    for name in ("pod-a.0", "pod-a.1"):
        assert after[name]["pid"] == before[name]["pid"], name  # the same process throughout
        assert after[name]["first_generation"] == 1 and after[name]["generation"] > 1, after[name]
        assert after[name]["step"] == ELASTIC_STEPS and after[name]["world"] == 4, after[name]
    assert {after[n]["first_generation"] for n in ("pod-c.0", "pod-c.1")} == {3}
    ours = torch.load(out / "params.pt")
    torch.testing.assert_close(ours, undisturbed(ELASTIC_STEPS), atol=5e-5, rtol=2e-4)


def test_a_process_paused_past_the_window_and_resumed_hangs_nobody(tmp_path):
    """pod-b.1 stopped for 3 s (6 liveness windows of 0.5 s) among the hierarchical all-reduces,
    then resumed: the others blame it through the ring's liveness probes and shut generation 1's
    sub-rings, so no stage waits on it; the resumed process finds them shut; at generation 2
    (both pods again, the operator's part) all four go on in their processes to the parameters
    of an undisturbed run."""
    out = tmp_path / "out"
    out.mkdir()
    pods = Pods(tmp_path)
    pids = []
    try:
        before = train_until_step_8(pods, out, pids)
        paused = before["pod-b.1"]["pid"]
        os.kill(paused, signal.SIGSTOP)
        time.sleep(3)
        os.kill(paused, signal.SIGCONT)
        pods.publish("pod-a", "pod-b")
        for pod in ("pod-a", "pod-b"):
            assert pods.wait(pod, 180) == 0, pods.log(pod)[-6000:]
        after = records(out)
    finally:
        pods.stop(pids)
    log = pods.log("pod-a")
    assert "rank 3 did not answer its liveness probe" in log, log[-4000:]
    assert "the pair of in-pod and cross-pod rings of ring generation 1 is abandoned" in log, log[-4000:]
    for name in FIRST:
        assert after[name]["pid"] == before[name]["pid"] and after[name]["step"] == ELASTIC_STEPS, after[name]
        assert after[name]["generation"] == 2, after[name]
    assert hierarchical(2, 1, 1) in pods.log("pod-b"), pods.log("pod-b")[-4000:]
    torch.testing.assert_close(torch.load(out / "params.pt"), undisturbed(ELASTIC_STEPS), atol=5e-5, rtol=2e-4)
