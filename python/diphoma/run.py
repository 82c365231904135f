"""Standalone launcher, like ``torchrun --standalone``: ``python -m diphoma.run --nproc 4
train.py [args…]`` starts 4 ranks of ``train.py`` on 127.0.0.1.

It picks free ports (one ring address per rank, one for torch's rendezvous store), writes a
random per-job key to a private temporary file, and sets for every rank the ring's
``DIPHOMA_RANK``, ``DIPHOMA_WORLD_SIZE``, ``DIPHOMA_RING_ADDRESSES``, ``DIPHOMA_JOB_UID``,
``DIPHOMA_KEY_FILE`` and torchrun's variables (``torchrun_env``). It takes torchrun's common
flags (``parse``) and runs the ranks under torch's ``torch.distributed.elastic.multiprocessing``
(``run_fixed``): output prefixed ``[rankN]:``, per-rank logs and error files, and when a rank
fails the others get ``--grace`` seconds to exit by themselves before SIGTERM (SIGKILL after
``--grace`` more), then torch's failure summary names the root cause (``root_cause``) and the
launcher exits with its code (128 + N for signal N), or restarts every rank
(``--max-restarts``). SIGINT/SIGTERM to the launcher stop every rank. Like torchrun, it sets
``OMP_NUM_THREADS=1`` for every rank when there are several and the variable is not set, so N
ranks' intra-op thread pools do not oversubscribe the cores. The key file is removed on exit.
``DIPHOMA_RING_PROTECTION`` passes through from the launcher's environment: ``none`` (the
default, as for jobs), ``integrity`` or ``encryption``.

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

With ``--pods N`` (N > 1) it stands in for a DiphomaJob of N worker pods of ``--nproc-per-node``
processes each (``replicas: N``, ``processesPerWorker``), all on 127.0.0.1: it writes the
ring directory's one generation of N pods (``pod-0`` …, each with ``2·P`` consecutive free ports
from its ring port: local rank ``l`` listens at ``+ 2·l``, rank 0's store at ``+ 1``) and runs
one pod agent (below) per pod, as the kubelet would; ring rank ``p·P + l`` is local rank ``l`` of
pod ``p``, and the all-reduce is hierarchical as in a job (``diphoma.torch._plane``). The first
pod that fails stops the others (``--grace``) and its exit code is the launcher's. A fixed
ring: ``--elastic`` and ``--max-restarts`` are refused with it (a job's operator re-forms it).

In a DiphomaJob's worker pod (the contract's ``DIPHOMA_MEMBERSHIP`` is set) it is torchrun's
agent for that pod instead: ``diphoma._pod`` runs the pod's ``spec.processesPerWorker``
processes (``DIPHOMA_PROCESSES_PER_WORKER``, one per GPU) at each ring generation with
torchrun's variables for them and restarts them in place when the ring changes; with
``--elastic`` it starts them once and they follow the ring themselves. With
``DIPHOMA_RING_DIR`` and ``DIPHOMA_POD_NAME`` already set (and ``DIPHOMA_STORE_PORT``,
``DIPHOMA_JOB_UID`` without ``--elastic``) it is the same pod agent for a member of a ring
directory published by someone else (the tests' stand-in for a worker pod).
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


def free_ports(n, host=HOST):
    """``n`` distinct ports free on ``host`` (default 127.0.0.1) at the time of the call."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_span(n, host=HOST):
    """A port ``p`` such that ``p`` … ``p + n - 1`` are all free on ``host`` at the time of the
    call (a local pod's ports: its ring port and its processes' ports after it)."""
    while True:
        first = free_ports(1, host)[0]
        socks = []
        try:
            for port in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, port))
            return first
        except OSError:
            continue
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


def torchrun_env(rank, world, master_port, restart=0, run_id="none", max_restarts=0, local_rank=None,
                 local_world=None, group_rank=0, group_world=1, master_addr=HOST):
    """What torchrun sets for rank ``rank`` of ``world``, restarted ``restart`` times, on node
    ``group_rank`` of ``group_world`` (default: the one node, where the local rank and world are
    the global ones), role ``default``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_NAME``, ``ROLE_RANK``,
    ``ROLE_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``,
    ``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_RUN_ID``, ``TORCH_NCCL_ASYNC_ERROR_HANDLING``
    (as strings)."""
    env = dict(
        RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank if local_rank is None else local_rank,
        LOCAL_WORLD_SIZE=world if local_world is None else local_world, GROUP_RANK=group_rank,
        GROUP_WORLD_SIZE=group_world, ROLE_NAME="default", ROLE_RANK=rank, ROLE_WORLD_SIZE=world,
        MASTER_ADDR=master_addr, MASTER_PORT=master_port, TORCHELASTIC_RESTART_COUNT=restart,
        TORCHELASTIC_MAX_RESTARTS=max_restarts, TORCHELASTIC_RUN_ID=run_id,
        TORCH_NCCL_ASYNC_ERROR_HANDLING=1,
    )
    return {k: str(v) for k, v in env.items()}


def rank_envs(nproc, key_file, base=None, restart=0, run_id="none", max_restarts=0, master_port=None):
    """The environment of each of ``nproc`` ranks (``base``: the launcher's own, see
    ``base_env``): the ring's ``DIPHOMA_*`` variables and torchrun's (``torchrun_env``), the
    rendezvous store at ``master_port`` (default: a free port)."""
    ports = free_ports(nproc + 1)
    if master_port:
        ports[0] = master_port
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
            **torchrun_env(r, nproc, ports[0], restart, run_id, max_restarts),
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


def run_fixed(a, key_file, log_dir):
    """Runs ``a.nproc`` ranks of one fixed ring with torch's
    ``torch.distributed.elastic.multiprocessing`` (as torchrun's local agent): every line of
    their output prefixed ``[rankN]:`` (``--local-ranks-filter`` keeps some), copies in
    ``log_dir`` (``--redirects``, ``--tee``), each rank's uncaught exception in its error file.
    When a rank fails, the others get ``a.grace`` s to exit by themselves (``settle``), then
    SIGTERM (torch's SIGKILL 30 s later); the whole ring is started again, on new ports, up to
    ``a.max_restarts`` times
    (``TORCHELASTIC_RESTART_COUNT`` counts them). Returns the exit code: 0, or the first failed
    rank's (128 + N for a signal), after printing torch's failure summary naming the root-cause
    rank, its exit code and its traceback."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    entry, args = command(a)
    ranks = set(range(a.nproc)) if a.local_ranks_filter is None else a.local_ranks_filter
    run_id = a.run_id or secrets.token_hex(4)
    specs = DefaultLogsSpecs(log_dir=log_dir, redirects=Std.from_str(a.redirects),
                             tee=Std.ALL if a.tee == "0" and a.redirects == "0" else Std.from_str(a.tee),
                             local_ranks_filter=ranks)
    for restart in range(a.max_restarts + 1):
        envs = rank_envs(a.nproc, key_file, base_env(a.nproc), restart, run_id, a.max_restarts, a.master_port)
        ctx = start_processes(name="diphoma", entrypoint=entry, args={r: args for r in range(a.nproc)},
                              envs={r: envs[r] for r in range(a.nproc)}, logs_specs=specs,
                              log_line_prefixes={r: f"[rank{r}]:" for r in range(a.nproc)})
        try:
            result = settle(ctx, a.grace)
        finally:
            ctx.close(signal.SIGTERM, timeout=max(1, int(a.grace)))
        if not result.is_failed():
            return 0
        root = root_cause(result.failures, result.exited)
        if restart < a.max_restarts:
            print(f"diphoma.run: rank {root.local_rank} failed (exit {exit_code(root.exitcode)}); "
                  f"restarting every rank ({restart + 1} of {a.max_restarts})", file=sys.stderr, flush=True)
    # torch's summary calls the earliest failure the root cause (whole seconds, first among
    # equals): ours goes first, no later than any other.
    root.timestamp = min(f.timestamp for f in result.failures.values())
    failures = {root.local_rank: root, **result.failures}
    print(ChildFailedError(name=a.script, failures=failures).format_msg(), file=sys.stderr, flush=True)
    print(f"diphoma.run: root cause: rank {root.local_rank}, exit {exit_code(root.exitcode)}: {failure_text(root)[0]}",
          file=sys.stderr, flush=True)
    return exit_code(root.exitcode)


def settle(ctx, grace):
    """Waits until every rank of ``ctx`` (torch's ``SubprocessContext``) exited 0 or one
    failed; then gives the others up to ``grace`` s to exit by themselves (a rank that raised
    may still be writing its traceback; its ring peers fail at once) before torch's ``wait``
    records the failures and stops what still runs. Returns torch's ``RunProcsResult``."""
    procs = dict(enumerate(h.proc for h in ctx.subprocess_handlers.values()))
    exited = {}  # local rank -> when its exit was first seen (seconds since the epoch)

    def look():
        for r, p in procs.items():
            if r not in exited and p.poll() is not None:
                exited[r] = time.time()

    while True:
        look()
        codes = [p.returncode for p in procs.values()]
        if None not in codes or any(c not in (None, 0) for c in codes):
            break
        time.sleep(0.05)
    deadline = time.monotonic() + grace
    while len(exited) < len(procs) and time.monotonic() < deadline:
        time.sleep(0.05)
        look()
    result = ctx.wait(0)
    result.exited = exited
    return result


def failure_text(f):
    """(the last line, the whole text) of a ``ProcessFailure``'s message: the exception and its
    traceback from the rank's error file, else torch's words for a signal or an exit code."""
    m = f.message
    if isinstance(m, dict):  # what ErrorHandler.record_exception writes
        return m.get("message", ""), m.get("message", "") + "\n" + m.get("extraInfo", {}).get("py_callstack", "")
    if f.exitcode > 0 and m.startswith("To enable traceback"):  # torch's words for "no error file"
        m = f"exited with code {f.exitcode} without an uncaught exception (sys.exit, os._exit)"
    return (m.strip().splitlines() or [""])[-1], m


def root_cause(failures, exited=None):
    """The failure that started it, of torch's ``ProcessFailure``s by local rank (``exited``:
    when the launcher saw each rank gone): the earliest of those that are not consequences,
    else the earliest of all, by the exception's time (``diphoma._boot`` stamps it to the
    sub-second) or the exit seen. A consequence is a rank whose
    recorded exception is its ring losing a peer (``RingChanged``, ``RingError``), or one the
    launcher stopped (SIGTERM) before it recorded any; a rank that recorded another exception
    is a cause even when it was stopped while it exited."""
    def consequence(f):
        if isinstance(f.message, dict):
            return f.message.get("message", "").split(":")[0] in ("RingChanged", "RingError")
        return f.exitcode == -signal.SIGTERM

    def when(f):  # the exception's own time, else when the rank was seen gone, else torch's
        if isinstance(f.message, dict) and "diphoma_time" in f.message.get("extraInfo", {}):
            return f.message["extraInfo"]["diphoma_time"]
        return (exited or {}).get(f.local_rank, f.timestamp)

    causes = [f for f in failures.values() if not consequence(f)] or list(failures.values())
    return min(causes, key=lambda f: (when(f), f.local_rank))


def command(a):
    """The program every rank runs and its arguments: ``python -m diphoma._boot [--backend B]
    (-m MODULE | SCRIPT) ARGS`` (``diphoma._boot``), or ``SCRIPT ARGS`` itself with
    ``--no-python``."""
    if a.no_python:
        return a.script, tuple(a.args)
    boot = ["-u", "-m", "diphoma._boot", *(["--backend", a.backend] if a.backend else []), *(["-m"] if a.module else [])]
    return sys.executable, (*boot, a.script, *a.args)


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
        self.worlds = []  # the world size of each published generation

    def spawn(self):
        """Starts a new member process (not yet in a published generation)."""
        name, port = f"local-{self.spawned}", free_ports(1)[0]
        self.spawned += 1
        env = dict(self.base, DIPHOMA_RING_DIR=self.ring_dir, DIPHOMA_POD_NAME=name,
                   DIPHOMA_JOB_UID=self.job_uid, DIPHOMA_KEY_FILE=self.key_file)
        self.procs.append(subprocess.Popen(self.command, env=env))
        self.members.append([name, port, self.procs[-1]])

    def publish(self, why=None):
        """Writes the next generation: every member still listed, in rank order; announces it
        on stderr with ``why`` (what changed) after the first."""
        self.generation += 1
        doc = membership_json(self.generation, self.job_uid, [(n, HOST, port) for n, port, _ in self.members])
        write_atomic(os.path.join(self.ring_dir, "membership.json"), doc)
        self.worlds.append(len(self.members))
        if why:
            names = ", ".join(n for n, _, _ in self.members)
            print(f"diphoma.run: {why}; published generation {self.generation}: world {len(self.members)} ({names})",
                  file=sys.stderr, flush=True)

    def supervise(self, replace):
        """Publishes a generation without each rank that is lost (killed by a signal) and,
        with ``replace``, one with its replacement; a rank that exits with 1-127 (an exception,
        ``sys.exit``) is a permanent error, as in a DiphomaJob: every rank is stopped and that
        code returned. Returns the exit code (see the module doc)."""
        code = 0
        while True:
            failed = [m for m in self.members if m[2].poll() not in (None, 0)]
            if failed:
                code = exit_code(failed[-1][2].returncode)
                permanent = [m for m in failed if 1 <= m[2].returncode <= 127]
                if permanent:
                    name, rc = permanent[0][0], permanent[0][2].returncode
                    print(f"diphoma.run: {name} (rank {self.members.index(permanent[0])}) exited with {rc}: a permanent "
                          "error (exits 1-127, as a DiphomaJob's default faultTolerance.restartOnExitCodes); "
                          "stopping every rank", file=sys.stderr, flush=True)
                    return rc
                lost = ", ".join(f"{m[0]} (rank {self.members.index(m)}, exit {exit_code(m[2].returncode)})" for m in failed)
                self.members = [m for m in self.members if m not in failed]
                if not self.members:
                    return code
                self.publish(f"lost {lost}")
                if replace:
                    for _ in failed:
                        self.spawn()
                    self.publish(f"started {', '.join(m[0] for m in self.members[-len(failed):])}")
            if all(m[2].poll() == 0 for m in self.members):
                if len(self.worlds) > 1:
                    print(f"diphoma.run: finished after {len(self.worlds) - 1} ring change(s): generation "
                          f"{self.generation}, world {' -> '.join(map(str, self.worlds))}", file=sys.stderr, flush=True)
                return 0
            time.sleep(0.05)


def pod_args(a):
    """The pod agent's command line for the launcher's arguments ``a`` (``--pods``): the same
    script, arguments and flags, one pod's ``--nproc-per-node``."""
    flags = ["--nproc-per-node", str(a.nproc), "--grace", str(a.grace)]
    flags += ["--backend", a.backend] if a.backend else []
    flags += ["-m"] if a.module else []
    return [sys.executable, "-m", "diphoma.run", *flags, a.script, *a.args]


def run_pods(a, key_file, ring_dir, procs):
    """Runs ``a.pods`` local pods of ``a.nproc`` processes (the module doc); returns the exit
    code. Every launcher started is appended to ``procs`` (for the caller to stop)."""
    uid = f"standalone-{secrets.token_hex(8)}"
    ports = [free_span(2 * a.nproc) for _ in range(a.pods)]
    base = base_env(a.nproc * a.pods)
    for i in range(a.pods):
        env = dict(base, DIPHOMA_RING_DIR=ring_dir, DIPHOMA_POD_NAME=f"pod-{i}", DIPHOMA_KEY_FILE=key_file,
                   DIPHOMA_JOB_UID=uid, DIPHOMA_STORE_PORT=str(ports[0] + 1),
                   DIPHOMA_PROCESSES_PER_WORKER=str(a.nproc), DIPHOMA_RING_FIXED="1")
        procs.append(subprocess.Popen(pod_args(a), env=env))
    write_atomic(os.path.join(ring_dir, "membership.json"),
                 membership_json(1, uid, [(f"pod-{i}", HOST, port) for i, port in enumerate(ports)]))
    while True:
        failed = [(i, p.returncode) for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed:
            i, rc = failed[0]
            print(f"diphoma.run: pod-{i} exited with {exit_code(rc)}; stopping the other pods", file=sys.stderr,
                  flush=True)
            return exit_code(rc)
        if all(p.returncode == 0 for p in procs):
            return 0
        time.sleep(0.05)


def parse(argv):
    """The launcher's arguments (torchrun's names where they mean the same; see ``main``)."""
    ap = argparse.ArgumentParser(prog="python -m diphoma.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", default="1",
                    help="number of ranks (default 1), or as torchrun: cpu, gpu, auto (the accelerators, else the cores)")
    ap.add_argument("--nnodes", default="1", help="must be 1 (standalone: one node; a DiphomaJob spans nodes)")
    ap.add_argument("--node-rank", "--node_rank", type=int, default=0, help="must be 0")
    ap.add_argument("--standalone", action="store_true", help="accepted for torchrun's command lines (always standalone)")
    ap.add_argument("--pods", type=int, default=1,
                    help="run this many local pods of --nproc-per-node processes each, as a DiphomaJob's worker pods "
                    "(replicas, processesPerWorker): the all-reduce is hierarchical across them")
    for flag in ("--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf"):
        ap.add_argument(flag, flag.replace("-", "_").replace("__", "--"), help="accepted and ignored, as torchrun --standalone does")
    ap.add_argument("--master-addr", "--master_addr", default=HOST, help=f"must be {HOST} (one node)")
    ap.add_argument("--master-port", "--master_port", type=int, help="the rendezvous store's port (default: a free one)")
    ap.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                    help="restart every rank this many times after a failure (fixed ring)")
    ap.add_argument("--run-id", "--run_id", help="TORCHELASTIC_RUN_ID (default: random)")
    ap.add_argument("--log-dir", "--log_dir", help="where each rank's stdout, stderr and error file go (default: a temporary directory)")
    ap.add_argument("-r", "--redirects", default="0", help="redirect std streams to files in --log-dir: 0 none, 1 stdout, 2 stderr, 3 both")
    ap.add_argument("-t", "--tee", default="0", help="also copy std streams to the console (same codes as --redirects)")
    ap.add_argument("--local-ranks-filter", "--local_ranks_filter", type=lambda v: {int(r) for r in v.split(",") if r},
                    help="show only these ranks' output on the console, e.g. 0 or 0,2")
    ap.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a Python module (python -m)")
    ap.add_argument("--no-python", "--no_python", action="store_true", help="run SCRIPT as a program, not through python")
    ap.add_argument("--backend", help="initialise the default process group with this backend (env://) before the "
                    "script runs, for libraries that pick their own (Accelerate picks gloo on CPU)")
    ap.add_argument("--grace", type=float, default=5.0,
                    help="after a rank fails, seconds the others get to exit by themselves before SIGTERM (torch's "
                    "agent sends SIGKILL 30 s after it); with --elastic, seconds between SIGTERM and SIGKILL")
    ap.add_argument("--elastic", action="store_true",
                    help="follow a ring directory: a rank that dies is dropped and the others re-form")
    ap.add_argument("--replace", action="store_true", help="with --elastic: start a new rank for each lost one")
    ap.add_argument("--ring-dir", help="with --elastic: the ring directory (default: a temporary one)")
    ap.add_argument("script", help="the training script (a module with -m, a program with --no-python)")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = ap.parse_args(argv)
    try:
        a.nproc = int(a.nproc)
    except ValueError:
        from torch.distributed.run import determine_local_world_size  # torchrun's own reading

        try:
            a.nproc = determine_local_world_size(a.nproc)
        except ValueError as e:
            ap.error(f"--nproc-per-node {a.nproc}: {e}")
    if a.nproc < 1:
        ap.error("--nproc must be at least 1")
    if a.nnodes not in ("1", "1:1") or a.node_rank != 0:
        ap.error(f"--nnodes {a.nnodes} --node-rank {a.node_rank}: this launcher runs one node; "
                 "to train across nodes, submit a DiphomaJob (see README.md, PyTorch)")
    if a.master_addr not in (HOST, "localhost"):
        ap.error(f"--master-addr {a.master_addr}: this launcher runs one node on {HOST}")
    if a.no_python and (a.module or a.backend):
        ap.error("--no-python runs a program: it takes neither -m nor --backend")
    if a.pods < 1:
        ap.error("--pods must be at least 1")
    if a.pods > 1 and (a.elastic or a.max_restarts or a.no_python):
        ap.error("--pods runs a fixed ring of local pods: it takes neither --elastic, --max-restarts nor --no-python")
    if a.pods > 1 and (a.log_dir or a.redirects != "0" or a.tee != "0" or a.local_ranks_filter is not None):
        ap.error("--pods: each pod's processes write to the console, as a pod's log: --log-dir, --redirects, --tee "
                 "and --local-ranks-filter are for one pod (--nproc alone)")
    if a.replace and not a.elastic:
        ap.error("--replace starts a new rank for each lost one of an --elastic ring: add --elastic")
    if a.elastic and (a.max_restarts or a.module or a.no_python or a.backend):
        ap.error("--elastic re-forms in place: it takes neither --max-restarts, -m, --no-python nor --backend")
    return a


def main(argv=None):
    a = parse(argv)
    tmp = tempfile.mkdtemp(prefix="diphoma-run-")
    procs = []

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(signum)  # the launcher exits 128 + signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    signalled = False
    try:
        # A DiphomaJob's worker pod (the contract's variables), or a local stand-in for one: a
        # member of a ring directory that someone else publishes.
        if os.environ.get("DIPHOMA_MEMBERSHIP") or (os.environ.get("DIPHOMA_RING_DIR")
                                                    and os.environ.get("DIPHOMA_POD_NAME")):
            from diphoma import _pod

            return _pod.main(a, tmp)
        key_file = os.path.join(tmp, "ring.key")
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
        if a.pods > 1:
            return run_pods(a, key_file, tmp, procs)
        if not a.elastic:
            return run_fixed(a, key_file, a.log_dir or os.path.join(tmp, "logs"))
        command = [sys.executable, a.script, *a.args]
        ring_dir = a.ring_dir or tmp
        os.makedirs(ring_dir, exist_ok=True)
        ring = Elastic(ring_dir, key_file, command, base_env(a.nproc))
        procs = ring.procs  # grows with the replacements
        for _ in range(a.nproc):
            ring.spawn()
        ring.publish()
        return ring.supervise(a.replace)
    except KeyboardInterrupt as e:
        signalled = True
        return 128 + (e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT)
    except Exception as e:
        if type(e).__name__ != "SignalException":  # torch's agent's, for a signal while it runs the ranks
            raise
        signalled = True
        print(f"diphoma.run: stopped by signal {int(e.sigval)}", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    finally:
        for s in old:  # a second Ctrl-C does not cut the stop short (it is bounded by --grace)
            signal.signal(s, signal.SIG_IGN)
        # A pod agent stops its own processes within --grace of SIGTERM: it gets that and more.
        stop(procs, 2 * a.grace + 5 if a.pods > 1 else a.grace)
        if not signalled:  # stopped by a signal: the process exits with 128 + it, a repeat is ignored
            for s, h in old.items():
                signal.signal(s, h)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
