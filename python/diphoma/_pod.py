"""``python -m diphoma.run SCRIPT`` in a DiphomaJob's worker pod: torchrun's agent for one pod.

The pod is one member of the job's ring; it runs ``spec.processesPerWorker`` training
processes (``DIPHOMA_PROCESSES_PER_WORKER``, one per GPU, as ``torchrun --nproc-per-node``;
below "the process" is each of them): local rank ``l`` of ``P`` at pod rank ``p`` is ring rank
``p·P + l`` of ``pods·P`` (``pod_env``; the contract's ``local`` module gives its ring port).
The pod stays the unit of membership and failure: one process that fails takes the pod out
(its siblings are stopped, the launcher exits with its code, ``group_exit``), one whose ring
failed restarts with all of them. Its training process (``SCRIPT`` through
``diphoma._boot``, unchanged: it reads ``RANK``/``LOCAL_RANK``, joins with
``init_process_group(backend="diphoma")`` through ``env://`` and resumes from its own
snapshot) runs at one ring generation with torchrun's variables for it (``pod_env``): ``RANK``
is the pod's rank in that generation, ``WORLD_SIZE`` its size, ``MASTER_ADDR`` rank 0's pod IP,
``MASTER_PORT`` the job's rendezvous store port (``DIPHOMA_STORE_PORT``, the ring port + 1),
``TORCHELASTIC_RESTART_COUNT`` this pod's restarts so far, ``TORCHELASTIC_RUN_ID`` the job's
UID, and ``DIPHOMA_GENERATION`` the generation (its ``init_process_group`` raises
``RingChanged`` when the ring has moved past it by then: the launcher starts it again).
The launcher watches the ring ConfigMap (``diphoma.RingWatch``: it binds nothing, the process
does) and, as torchrun restarts its workers after a rendezvous, restarts the process in place
at each new generation that lists the pod (``decide``): the pod, its node and its GPUs stay.
The process (in a session of its own) has ``--grace`` seconds to exit by itself (its collective
in flight fails at once with ``RingChanged``) before SIGKILL, and whatever it left in its
session (data-loader workers, helpers) is killed with it. A process that fails because its
ring lost a peer waits for the operator's next generation (at most twice ``detectionSeconds``,
then the same one again, at most ``MAX_STUCK`` times in a row; 1 s when it was torch's
rendezvous store, served by rank 0's process, that went away); one that fails for any other
reason ends the launcher with its exit code, so the job's ``faultTolerance.restartOnExitCodes``
decides (exit 1, a Python exception: the job fails, its traceback's last lines in
``status.lastFailure.message``). Exit 0 of the process, a generation
without this pod (scale-down) or SIGTERM (the pod deleted) end the launcher with 0.
``--no-python`` is refused in a pod (the error file tells the ring's faults from the script's);
torchrun's output and rendezvous flags are ignored there, with a log line.
"""

import json
import os
import signal
import subprocess
import sys
import time

from diphoma.run import base_env, command, exit_code, torchrun_env

# What a process's error says when the ring under it failed (diphoma's exceptions: a peer lost, a
# newer generation), and when torch's rendezvous store did (rank 0's process, which serves it,
# was restarted or stopped under a peer that had just connected).
RING_FAULTS = ("RingChanged", "RingError")
STORE_FAULTS = ("DistNetworkError", "DistStoreError")
# Restarts at one generation after ring faults, with no newer generation coming, before the
# launcher gives up: the operator re-forms a ring that lost a member within detectionSeconds.
MAX_STUCK = 3
# Set by ``python -m diphoma.run --pods`` (the local stand-in for a job's pods, whose ring never
# changes): a ring fault ends the pod's launcher at once instead of waiting for a generation.
FIXED_ENV = "DIPHOMA_RING_FIXED"


def host_of(address):
    """The IP of an ``IP:port`` address (``[v6]:port`` too)."""
    return address.rsplit(":", 1)[0].strip("[]")


def pod_env(generation, rank, members, restart, store_port, run_id, base, local_rank=0, processes=1):
    """The environment of local rank ``local_rank`` of the pod's ``processes`` training
    processes at ring generation ``generation``, where this pod is ``rank`` of ``members``
    (``(pod, "IP:port")`` by rank): ``base`` with torchrun's variables (``torchrun_env``) for
    process ``local_rank`` on node ``rank`` of ``len(members)`` (``RANK`` = ``rank·processes +
    local_rank``, ``WORLD_SIZE`` = ``len(members)·processes``, ``GROUP_RANK`` = ``rank``), the
    rendezvous store at rank 0's IP and ``store_port``, restarted ``restart`` times,
    ``DIPHOMA_GENERATION`` (the generation the process must join, see ``diphoma.torch``) and
    the layout (``local_env``). ``CUDA_VISIBLE_DEVICES`` is left as it is: as under torchrun,
    the process picks ``cuda:LOCAL_RANK`` itself."""
    world = len(members)
    env = base_env(processes, base)
    env.update(torchrun_env(rank * processes + local_rank, world * processes, store_port, restart, run_id,
                            local_rank=local_rank, local_world=processes, group_rank=rank, group_world=world,
                            master_addr=host_of(members[0][1])))
    env.update(local_env(local_rank, processes))
    env["DIPHOMA_GENERATION"] = str(generation)
    return env


def local_env(local_rank, processes):
    """The layout variables of local rank ``local_rank`` of ``processes``: the contract's
    ``DIPHOMA_LOCAL_RANK`` and ``DIPHOMA_PROCESSES_PER_WORKER`` (the ring rank and port its
    ``diphoma`` process group takes, see ``contract::local``) and torchrun's ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``."""
    return {"DIPHOMA_LOCAL_RANK": str(local_rank), "DIPHOMA_PROCESSES_PER_WORKER": str(processes),
            "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(processes)}


def processes_per_worker(nproc, env):
    """How many training processes this pod runs: the operator's ``DIPHOMA_PROCESSES_PER_WORKER``
    (``spec.processesPerWorker``; unset: 1); ``nproc`` (``--nproc-per-node``) must be 1 (the
    default: follow the job) or equal to it. Raises ``ConfigError`` naming both otherwise."""
    from diphoma import ConfigError

    raw = env.get("DIPHOMA_PROCESSES_PER_WORKER", "").strip() or "1"
    try:
        processes = int(raw)
    except ValueError:
        raise ConfigError(f"DIPHOMA_PROCESSES_PER_WORKER {raw!r} is not a whole number") from None
    if processes < 1:
        raise ConfigError(f"DIPHOMA_PROCESSES_PER_WORKER {processes} is not at least 1")
    if nproc not in (1, processes):
        raise ConfigError(f"--nproc-per-node {nproc}, but the job's spec.processesPerWorker is {processes} "
                          "(DIPHOMA_PROCESSES_PER_WORKER): set spec.processesPerWorker, the launcher follows it")
    return processes


def group_exit(codes, errors):
    """The pod's processes as one (pure): ``codes`` their exit statuses by local rank (``None``
    while running), ``errors`` their error files' texts. Returns ``(rc, error, local_rank)``:
    ``(None, "", None)`` while none failed and some still run, ``(0, "", None)`` once all
    exited 0, else the failure that took the pod out: a process's own failure (its exception,
    a signal from outside: ``fault`` is ``None``) before a ring fault, which its siblings'
    collectives get as a consequence; the lowest local rank among equals."""
    failed = [(fault(errors[l]) is not None, l) for l, c in enumerate(codes) if c not in (None, 0)]
    if failed:
        _, l = min(failed)
        return codes[l], errors[l], l
    if all(c == 0 for c in codes):
        return 0, "", None
    return None, "", None


def fault(error):
    """What failed under a process, by the type of the exception its error file records
    (``error_text``: ``"Type: message"`` first): ``"ring"`` (diphoma's ``RingChanged`` or
    ``RingError``), ``"store"`` (torch's rendezvous store), or ``None``: the script's own
    error, a ``CollectiveMismatch`` (the ranks called different collectives) included."""
    kind = error.split(":", 1)[0].strip().rsplit(".", 1)[-1]
    if kind in RING_FAULTS:
        return "ring"
    return "store" if kind in STORE_FAULTS else None


def decide(running, rc, error, newest):
    """What the pod's launcher does next (pure). ``running``: the generation the process was
    started at; ``rc``: its exit status (``None`` while it runs; negative: a signal);
    ``error``: its error file's text; ``newest``: ``(generation, rank)`` of the newest
    generation seen after ``running``, or ``None``. Returns ``"wait"`` (nothing to do yet),
    ``"restart"`` (a newer generation lists this pod: stop the process if it runs and start it
    there), ``"leave"`` (exit 0: done, or no longer a member), ``"rejoin"`` (the ring failed
    under it, ``fault``: start again once the next generation is known) or ``"fail"`` (exit
    with its code). A process that exited 0 is done, and one whose error file records an
    exception of its own has failed, even when a newer generation came."""
    if rc == 0:
        return "leave"
    if rc is not None and error and not fault(error):
        return "fail"
    if newest is not None:
        return "restart" if newest[1] is not None else "leave"
    if rc is None:
        return "wait"
    return "rejoin" if fault(error) else "fail"


def changes(before, after):
    """What changed from members ``before`` to ``after`` (``(pod, address)`` by rank), for the
    restart's log line: ``" (lost A; added B)"``, empty when nothing did."""
    if before is None:
        return ""
    old, new = [p for p, _ in before], [p for p, _ in after]
    parts = [f"{w} {', '.join(ps)}" for w, ps in (("lost", [p for p in old if p not in new]),
                                                    ("added", [p for p in new if p not in old])) if ps]
    return f" ({'; '.join(parts)})" if parts else ""


def restart_cause(before, after):
    """Why the process restarts in place going from members ``before`` to ``after`` (``(pod,
    address)`` by rank), as the contract names it for ``status.inPlaceRestarts``: a member
    lost, else one joined, else the same members again after the ring failed under them."""
    from diphoma._native import RESTART_MEMBER_JOINED, RESTART_MEMBER_LOST, RESTART_RING_FAULT

    old, new = {p for p, _ in before}, {p for p, _ in after}
    if old - new:
        return RESTART_MEMBER_LOST
    return RESTART_MEMBER_JOINED if new - old else RESTART_RING_FAULT


def wait_newest(watch, than, seconds, stopping):
    """``watch.newest(than, …)`` for up to ``seconds``, in slices of at most 0.5 s so that a
    SIGTERM (``stopping``) is seen at once; ``None`` when no newer generation came."""
    deadline = time.monotonic() + seconds
    while not stopping:
        g = watch.newest(than, max(0.0, min(0.5, deadline - time.monotonic())))
        if g is not None or time.monotonic() >= deadline:
            return g
    return None


def error_text(path):
    """The exception an error file (torch's ``ErrorHandler`` layout) records, with its
    traceback; empty when there is none."""
    try:
        with open(path) as f:
            m = json.load(f)["message"]
        return m.get("message", "") + "\n" + m.get("extraInfo", {}).get("py_callstack", "")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""


def log(text):
    print(f"diphoma.run: {text}", file=sys.stderr, flush=True)


def stop(procs, grace):
    """Gives each of ``procs`` (the pod's processes) until ``grace`` s from now to exit by
    itself, then SIGKILL (its ring's SIGTERM handler would only ask it to leave at a step
    boundary, which an unchanged script never reaches); then SIGKILL to what is left of its
    session (data-loader workers, helpers: each was started in a session of its own). Returns
    their exit statuses."""
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return [proc.returncode for proc in procs]


def signal_all(procs, sig):
    """Sends ``sig`` to each of ``procs`` that still runs."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)


def start(entry, args, envs):
    """Starts one process per environment of ``envs`` (by local rank), each in a session of
    its own."""
    return [subprocess.Popen([entry, *args], env=env, start_new_session=True) for env in envs]


def main_elastic(a, processes):
    """``--elastic`` in a pod: the pod's ``processes`` processes of an elastic script
    (``diphoma.torch.elastic``, which follows the ring itself and re-forms in its own process)
    are started once, each with its layout (``local_env``), and supervised: one that fails
    (an exception, a signal) takes the pod out: its siblings get SIGKILL at once (their ring
    is broken without it, and the pod is the ring's member) and the launcher exits with its
    code, so the operator replaces the pod while the other pods' processes go on at the next
    generation. All exiting 0 ends it with 0; SIGTERM is passed on (``--grace`` s, then
    SIGKILL). The ring's variables (``DIPHOMA_MEMBERSHIP`` in a pod, ``DIPHOMA_RING_DIR`` with
    ``DIPHOMA_POD_NAME`` for a local stand-in of a pod) pass through."""
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    envs = [dict(base_env(processes, os.environ), **local_env(l, processes)) for l in range(processes)]
    procs = start(sys.executable, ("-u", a.script, *a.args), envs)
    pod = os.environ.get("DIPHOMA_POD_NAME", "this pod")
    try:
        while not stopping:
            codes = [p.poll() for p in procs]
            rc, _, l = group_exit(codes, [""] * processes)
            if rc == 0:
                return 0
            if rc is not None:
                log(f"local rank {l} of {pod} exited with {exit_code(rc)}: stopping its {processes - 1} sibling(s), "
                    f"the pod leaves the ring")
                signal_all(procs, signal.SIGKILL)
                stop(procs, 0)
                return exit_code(rc)
            time.sleep(0.05)
        signal_all(procs, signal.SIGTERM)
        stop(procs, a.grace)
        return 0
    finally:
        signal_all(procs, signal.SIGKILL)  # also on an exception of the launcher's own
        stop(procs, 0)


def main(a, tmp):
    """Runs ``a.script`` in this pod (see the module doc) until it is done; returns the exit code."""
    from diphoma import ConfigError, RingWatch

    processes = processes_per_worker(a.nproc, os.environ)
    if a.elastic:
        return main_elastic(a, processes)
    stopping = []  # SIGTERM (the pod deleted): stop the processes, exit 0
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    if a.no_python:
        raise ConfigError("--no-python in a worker pod: the launcher tells the ring's faults from the script's own "
                          "errors by the error file diphoma._boot writes for a Python script")
    for flag, value in (("--log-dir", a.log_dir), ("--redirects", a.redirects != "0"), ("--tee", a.tee != "0"),
                        ("--local-ranks-filter", a.local_ranks_filter), ("--run-id", a.run_id),
                        ("--master-port", a.master_port)):
        if value:
            log(f"{flag} is ignored in a worker pod: the processes' output is the pod's log, the job's UID the run "
                "id, the rendezvous store on spec.ringPort + 1")
    if a.max_restarts:
        log(f"--max-restarts {a.max_restarts} is ignored in a worker pod: the job's faultTolerance.restartOnExitCodes "
            "and runPolicy.backoffLimit decide what a failure costs")
    try:
        store_port = int(os.environ["DIPHOMA_STORE_PORT"])
        detection = float(os.environ.get("DIPHOMA_DETECTION_SECONDS", "10"))
        run_id = os.environ["DIPHOMA_JOB_UID"]
    except (KeyError, ValueError) as e:
        raise ConfigError(f"the worker pod's environment: {e} (set by the operator)") from None
    watch = RingWatch.from_env()
    entry, args = command(a)
    procs, running, restart, seen, members = None, None, 0, None, None
    error_files = []
    causes = {}  # in-place restarts by cause, reported to the operator at each one
    stuck = 0  # restarts at the same generation in a row (the ring failed, none newer came)

    def errors():
        return [error_text(f) for f in error_files]

    try:
        while not stopping:
            if procs is None:  # wait for a generation that lists this pod
                g = watch.newest(seen, 0.5)
                if g is None:
                    continue
                seen = g[0]
                if g[1] is None:
                    if running is not None:
                        log(f"generation {g[0]} does not list {watch.pod}: leaving")
                        return 0
                    continue
                before = members if running is not None else None
                running, rank, members = g
                error_files = [os.path.join(tmp, f"error-{restart}-{l}.json") for l in range(processes)]
                envs = [pod_env(running, rank, members, restart, store_port, run_id, os.environ, l, processes)
                        for l in range(processes)]
                for env, f in zip(envs, error_files):
                    env.update(TORCHELASTIC_ERROR_FILE=f, DIPHOMA_LAUNCHER_PID=str(os.getpid()))
                if restart:
                    log(f"restart {restart} in place: pod rank {rank} of {len(members)}"
                        f"{f' ({processes} processes)' if processes > 1 else ''} at generation {running}"
                        f"{changes(before, members)}")
                    why = restart_cause(before, members)
                    causes[why] = causes.get(why, 0) + 1
                    watch.report_restarts(causes, running)
                procs = start(entry, args, envs)
                continue
            g = watch.newest(running, 0.2)
            codes = [p.poll() for p in procs]
            rc, error, local = group_exit(codes, errors() if any(codes) else [""] * processes)
            if rc is not None:
                # One failed (or all are done): the pod is one member, its processes one ring
                # share; the others are stopped (they cannot go on without it).
                if rc != 0:
                    signal_all(procs, signal.SIGKILL)
                stop(procs, 0)  # what they left of their sessions
            action = decide(running, rc, error, g and g[:2])
            if action == "wait":
                continue
            who = f"rank {rank}" if processes == 1 else f"pod rank {rank} (local rank {local})"
            if action == "rejoin":
                # The ring's loss makes the operator publish a new generation (within
                # detectionSeconds); a store that went away was rank 0's restarting process.
                what = fault(error)
                if os.environ.get(FIXED_ENV) == "1":
                    # python -m diphoma.run --pods: nobody publishes another generation. A moment
                    # first, so that the pod whose process failed is the first to exit.
                    time.sleep(1.0)
                    log(f"{who}'s {what} failed at generation {running} (exit {exit_code(rc)}): the ring is fixed "
                        "(python -m diphoma.run --pods), no other generation comes")
                    return exit_code(rc)
                log(f"{who}'s {what} failed at generation {running} (exit {exit_code(rc)}): waiting for the next "
                    "generation")
                g = wait_newest(watch, running, 2 * detection if what == "ring" else 1.0, stopping)
                if stopping:
                    break
                stuck = 0 if g else stuck + 1
                if stuck > MAX_STUCK:
                    log(f"{who}'s {what} failed {stuck} times in a row at generation {running}, and no newer one "
                        f"came: giving up with exit {exit_code(rc)}")
                    return exit_code(rc)
                action = decide(running, rc, "", g and g[:2]) if g else "restart"
                g = g or (running, rank, members)
            if action == "restart" and g[0] > running:
                stuck = 0
            if action == "fail":
                said = error.splitlines()[:1]  # the exception, as the last log line
                log(f"{who} ({watch.pod}) failed at generation {running} with exit {exit_code(rc)}"
                    + "".join(f": {line}" for line in said))
                return exit_code(rc)
            if rc is None and all(c == 0 for c in stop(procs, a.grace)):
                action = "leave"  # they finished while they had their grace: done
            procs = None
            if action == "leave":
                if g and g[1] is None:
                    log(f"generation {g[0]} does not list {watch.pod}: leaving")
                return 0
            restart += 1
            seen = g[0] - 1  # start at it: the next wait returns it
        if procs is not None:
            signal_all(procs, signal.SIGTERM)
            stop(procs, a.grace)
        return 0
    finally:
        if procs is not None:  # also on an exception of the launcher's own
            signal_all(procs, signal.SIGKILL)
            stop(procs, 0)
