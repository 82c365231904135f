"""Pods of several training processes (``spec.processesPerWorker``, issue 27): 2 pods × 2
processes, each pod a ``python -m diphoma.run`` launcher (``diphoma._pod``) that follows a ring
directory this test publishes, as the operator publishes the ring ConfigMap. The ring lists
pods; each pod's local rank ``l`` is ring rank ``pod·2 + l`` at the pod's ring port + 2·l.

- An unchanged DDP script (``ddp_train.py``, torchrun's variables) trains at world 4 to the
  parameters gloo reaches at world 4 (tolerance: test_ddp.py's, for the same n = 4).
- An elastic script through a ``kill -9`` of one process: its pod's launcher stops the
  sibling and exits 137, the other pod's processes keep their pids and go on at the next
  generation, a replacement pod joins the one after, and the final parameters equal an
  undisturbed run's (tolerance: test_elastic.py's).

Every process started is stopped by its recorded pid when the test ends, also on failure.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import torch

from conftest import SCRIPTS, check, launch, records
from diphoma import membership_json
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

    def __init__(self, tmp_path):
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
                   DIPHOMA_PROCESSES_PER_WORKER=str(PROCESSES), DIPHOMA_DETECTION_SECONDS="2")
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
        self.logs[pod].seek(0)
        return self.logs[pod].read()

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


def test_ddp_of_two_pods_of_two_processes_equals_gloo_at_world_4(tmp_path):
    steps, gloo_out, ours_out = "20", str(tmp_path / "gloo.pt"), str(tmp_path / "ours.pt")
    proc = launch(4, "ddp_train.py", "gloo", steps, gloo_out)
    if proc.returncode == 134 and GLOO_EXIT_ABORT in proc.stderr:  # see test_ddp.py
        proc = launch(4, "ddp_train.py", "gloo", steps, gloo_out)
    check(proc)
    pods = Pods(tmp_path)
    try:
        for pod in ("pod-a", "pod-b"):
            pods.start(pod, "--nproc-per-node", str(PROCESSES), os.path.join(SCRIPTS, "ddp_train.py"), "diphoma",
                       steps, ours_out)
        pods.publish("pod-a", "pod-b")
        for pod in ("pod-a", "pod-b"):
            assert pods.wait(pod, 180) == 0, pods.log(pod)[-6000:]
    finally:
        pods.stop()
    torch.testing.assert_close(torch.load(ours_out), torch.load(gloo_out), atol=2e-5, rtol=1e-4)


def test_a_killed_process_takes_its_pod_out_and_the_other_pod_goes_on(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    pods = Pods(tmp_path)
    script = ("--elastic", "--nproc-per-node", str(PROCESSES), os.path.join(SCRIPTS, "elastic_train.py"), str(out),
              str(ELASTIC_STEPS))
    first = ("pod-a.0", "pod-a.1", "pod-b.0", "pod-b.1")
    pids = []
    try:
        for pod in ("pod-a", "pod-b"):
            pods.start(pod, *script)
        pods.publish("pod-a", "pod-b")
        deadline = time.monotonic() + 120
        while True:
            before = records(out)
            pids = [r["pid"] for r in before.values()]
            if all(n in before and before[n]["step"] >= 8 for n in first):
                break
            for pod in ("pod-a", "pod-b"):
                assert pods.launchers[pod].poll() is None, pods.log(pod)[-6000:]
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.05)
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
    for name in ("pod-a.0", "pod-a.1"):
        assert after[name]["pid"] == before[name]["pid"], name  # the same process throughout
        assert after[name]["first_generation"] == 1 and after[name]["generation"] > 1, after[name]
        assert after[name]["step"] == ELASTIC_STEPS and after[name]["world"] == 4, after[name]
    assert {after[n]["first_generation"] for n in ("pod-c.0", "pod-c.1")} == {3}
    ours = torch.load(out / "params.pt")
    torch.testing.assert_close(ours, undisturbed(ELASTIC_STEPS), atol=5e-5, rtol=2e-4)
