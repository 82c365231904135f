"""Standalone launcher, like ``torchrun --standalone``: ``python -m diphoma.run --nproc 4
train.py [args…]`` starts 4 ranks of ``train.py`` on 127.0.0.1.

It picks free ports (one ring address per rank, one for torch's rendezvous store), writes a
random per-job key to a private temporary file, and sets for every rank the ring's
``DIPHOMA_RANK``, ``DIPHOMA_WORLD_SIZE``, ``DIPHOMA_RING_ADDRESSES``, ``DIPHOMA_JOB_UID``,
``DIPHOMA_KEY_FILE`` and torch's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``. When a rank fails, the others are
stopped (SIGTERM, then SIGKILL after ``--grace`` seconds) and the launcher exits with the failed
rank's code (128 + N for a rank killed by signal N); SIGINT/SIGTERM to the launcher stop every
rank. The key file is removed on exit.
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


def rank_envs(nproc, key_file, base=None):
    """The environment of each of ``nproc`` ranks (``base``: the launcher's own)."""
    ports = free_ports(nproc + 1)
    addresses = ",".join(f"{HOST}:{p}" for p in ports[1:])
    job_uid = f"standalone-{secrets.token_hex(8)}"
    envs = []
    for r in range(nproc):
        env = dict(os.environ if base is None else base)
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


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m diphoma.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=1, help="number of ranks (default 1)")
    ap.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL")
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
        for env in rank_envs(a.nproc, key_file):
            procs.append(subprocess.Popen([sys.executable, a.script, *a.args], env=env))
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
