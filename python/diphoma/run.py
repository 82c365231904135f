"""Standalone launcher, like ``torchrun --standalone``: ``python -m diphoma.run --nproc 4
train.py [args…]`` starts 4 ranks of ``train.py`` on 127.0.0.1.

It picks free ports (one ring address per rank, one for torch's rendezvous store), writes a
random per-job key to a private temporary file, and sets for every rank the ring's
``DIPHOMA_RANK``, ``DIPHOMA_WORLD_SIZE``, ``DIPHOMA_RING_ADDRESSES``, ``DIPHOMA_JOB_UID``,
``DIPHOMA_KEY_FILE`` and torch's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``. When a rank fails, the others are
stopped (SIGTERM, then SIGKILL after ``--grace`` seconds) and the launcher exits with the failed
rank's code (128 + N for a rank killed by signal N); SIGINT/SIGTERM to the launcher stop every
rank. Like torchrun, it sets ``OMP_NUM_THREADS=1`` for every rank when there are several and the
variable is not set, so N ranks' intra-op thread pools do not oversubscribe the cores. The key file is removed on exit. ``DIPHOMA_RING_PROTECTION`` passes through from the
launcher's environment: ``none`` (allowed on this loopback-only ring), ``integrity`` (the
default) or ``encryption``.

With ``--elastic`` the ranks follow a ring directory instead of a fixed world (the standalone
stand-in for the operator and its two ConfigMaps, read by ``diphoma-ring``'s ``FileRing``): the
launcher names its processes ``local-0``, ``local-1``, … (``DIPHOMA_POD_NAME``), writes
generation 1 of the contract's membership into ``<dir>/membership.json`` (``DIPHOMA_RING_DIR``)
and, when a rank dies, publishes the next generation without it, so the survivors re-form in
their own processes (``diphoma.torch.elastic.run``). With ``--replace`` it also starts a new
process for each lost one and publishes the generation after that with it (the joiner receives
the state by broadcast). Rank 0's progress record (``diphoma.report``) and the failure reports
land in the same directory (``progress.json``, ``report.<name>``). The launcher exits 0 once
every remaining rank exited 0, and with the last failure's code when none remains.
"""

import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from diphoma import membership_json

HOST = "127.0.0.1"


def free_ports(n):
    """``n`` distinct ports free on 127.0.0.1 at the time of the call."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def base_env(nproc, base=None):
    """The environment every rank starts from: ``base`` (default: the launcher's own), with
    ``OMP_NUM_THREADS=1`` when ``nproc`` > 1 and it is not set (torchrun's default)."""
    env = dict(os.environ if base is None else base)
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def rank_envs(nproc, key_file, base=None):
    """The environment of each of ``nproc`` ranks (``base``: the launcher's own, see
    ``base_env``)."""
    ports = free_ports(nproc + 1)
    addresses = ",".join(f"{HOST}:{p}" for p in ports[1:])
    job_uid = f"standalone-{secrets.token_hex(8)}"
    envs = []
    for r in range(nproc):
        env = base_env(nproc, base)
        env.update(
            DIPHOMA_RANK=str(r),
            DIPHOMA_WORLD_SIZE=str(nproc),
            DIPHOMA_RING_ADDRESSES=addresses,
            DIPHOMA_JOB_UID=job_uid,
            DIPHOMA_KEY_FILE=key_file,
            RANK=str(r),
            WORLD_SIZE=str(nproc),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR=HOST,
            MASTER_PORT=str(ports[0]),
        )
        envs.append(env)
    return envs


def exit_code(rc):
    """A child's return code as a shell would report it (signals as 128 + N)."""
    return 128 - rc if rc < 0 else rc


def stop(procs, grace):
    """SIGTERM to every running rank, SIGKILL to those still running after ``grace`` s."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def supervise(procs, grace):
    """Waits for every rank; on the first failure stops the others. Returns the exit code."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            stop(procs, grace)
            return exit_code(failed[0])
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)


def write_atomic(path, text):
    """Replaces ``path`` by ``text`` atomically (a temporary file, then rename)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, path)


class Elastic:
    """The members of an elastic standalone ring and the generations published for them."""

    def __init__(self, ring_dir, key_file, command, base=None):
        self.ring_dir, self.key_file, self.command = ring_dir, key_file, command
        self.base = dict(os.environ if base is None else base)
        self.job_uid = f"standalone-{secrets.token_hex(8)}"
        self.members = []  # [name, port, Popen], by rank
        self.procs = []  # every process started, for the launcher to stop
        self.generation = 0
        self.spawned = 0

    def spawn(self):
        """Starts a new member process (not yet in a published generation)."""
        name, port = f"local-{self.spawned}", free_ports(1)[0]
        self.spawned += 1
        env = dict(self.base, DIPHOMA_RING_DIR=self.ring_dir, DIPHOMA_POD_NAME=name,
                   DIPHOMA_JOB_UID=self.job_uid, DIPHOMA_KEY_FILE=self.key_file)
        self.procs.append(subprocess.Popen(self.command, env=env))
        self.members.append([name, port, self.procs[-1]])

    def publish(self):
        """Writes the next generation: every member still listed, in rank order."""
        self.generation += 1
        doc = membership_json(self.generation, self.job_uid, [(n, HOST, port) for n, port, _ in self.members])
        write_atomic(os.path.join(self.ring_dir, "membership.json"), doc)

    def supervise(self, replace):
        """Publishes a generation without each rank that fails (and, with ``replace``, one
        with its replacement); returns the exit code (see the module doc)."""
        code = 0
        while True:
            failed = [m for m in self.members if m[2].poll() not in (None, 0)]
            if failed:
                code = exit_code(failed[-1][2].returncode)
                self.members = [m for m in self.members if m not in failed]
                if not self.members:
                    return code
                self.publish()
                if replace:
                    for _ in failed:
                        self.spawn()
                    self.publish()
            if all(m[2].poll() == 0 for m in self.members):
                return 0
            time.sleep(0.05)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m diphoma.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=1, help="number of ranks (default 1)")
    ap.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL")
    ap.add_argument("--elastic", action="store_true",
                    help="follow a ring directory: a rank that dies is dropped and the others re-form")
    ap.add_argument("--replace", action="store_true", help="with --elastic: start a new rank for each lost one")
    ap.add_argument("--ring-dir", help="with --elastic: the ring directory (default: a temporary one)")
    ap.add_argument("script", help="the training script")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = ap.parse_args(argv)
    if a.nproc < 1:
        ap.error("--nproc must be at least 1")
    tmp = tempfile.mkdtemp(prefix="diphoma-run-")
    procs = []

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        key_file = os.path.join(tmp, "ring.key")
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
        command = [sys.executable, a.script, *a.args]
        if a.elastic:
            ring_dir = a.ring_dir or tmp
            os.makedirs(ring_dir, exist_ok=True)
            ring = Elastic(ring_dir, key_file, command, base_env(a.nproc))
            procs = ring.procs  # grows with the replacements
            for _ in range(a.nproc):
                ring.spawn()
            ring.publish()
            return ring.supervise(a.replace)
        for env in rank_envs(a.nproc, key_file):
            procs.append(subprocess.Popen(command, env=env))
        return supervise(procs, a.grace)
    except KeyboardInterrupt:
        stop(procs, a.grace)
        return 130
    finally:
        stop(procs, a.grace)
        for s, h in old.items():
            signal.signal(s, h)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
