"""Naming the ranks a collective waits for, as torch's ``TORCH_NCCL_DESYNC_DEBUG`` does for
NCCL, within ``detectionSeconds`` instead of at the collective's timeout (30 min by default).

A ring collective cannot tell a slow peer from one that never calls it: every rank waits on its
neighbour. So when a collective of the group has run ``after / 2`` seconds (``DIPHOMA_DETECTION_
SECONDS``, 10 standalone: the job's ``faultTolerance.detectionSeconds`` in a pod), the rank posts
``diphoma/waiting/<seq>/<rank>`` in the group's store (torch's rendezvous store, shared by the
ranks) and, another ``after / 2`` later, reads which ranks posted the same: those that did not
had not called collective ``seq`` within ``after / 2`` seconds of this rank (they compute, hang in the
script, or called another collective first). It logs them
once per collective (the ``diphoma`` logger, WARNING) and keeps them for the error the
collective raises if it times out. Nothing is written while collectives finish in time.
"""

import logging
import os
import threading
import time

_log = logging.getLogger("diphoma")
ENV_DETECTION = "DIPHOMA_DETECTION_SECONDS"
DEFAULT_AFTER = 10.0
STOP_WAIT = 2.0


def detection_seconds(environ=os.environ):
    """``DIPHOMA_DETECTION_SECONDS`` (the operator sets it in a pod), else 10; a value that is
    not a positive number is the default."""
    try:
        after = float(environ.get(ENV_DETECTION, DEFAULT_AFTER))
    except ValueError:
        return DEFAULT_AFTER
    return after if after > 0 else DEFAULT_AFTER


def absent(world, posted):
    """The ranks of ``range(world)`` not in ``posted`` (pure)."""
    return [r for r in range(world) if r not in posted]


def waiting_key(seq, rank):
    return f"diphoma/waiting/{seq}/{rank}"


class Watchdog:
    """Watches the collective in flight of one process group whose ranks share ``store``
    (see the module doc). ``begin(seq)``/``end()`` bracket collective ``seq`` (numbered in call
    order, the same on every rank) where it runs; ``absent_ranks(seq)`` is what was found for
    ``seq`` (None: nothing)."""

    def __init__(self, store, rank, world, after):
        self.store, self.rank, self.world, self.after = store, rank, world, after
        self._lock = threading.Lock()
        self._current = None  # (seq, what, monotonic start)
        self._found = {}  # seq -> absent ranks
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="diphoma-watchdog", daemon=True)
        self._thread.start()

    def begin(self, seq):
        with self._lock:
            self._current = (seq, time.monotonic())

    def end(self):
        with self._lock:
            self._current = None

    def absent_ranks(self, seq):
        with self._lock:
            return self._found.get(seq)

    def stop(self):
        """Stops the thread and waits for it (at most ``STOP_WAIT`` s: a store read in flight
        ends at once when the store's server has gone): a daemon thread still inside torch's C++
        (a store read) when the interpreter finalizes aborts the process."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(STOP_WAIT)

    def _still(self, seq):
        """Whether collective ``seq`` is still in flight and not yet looked at."""
        with self._lock:
            return self._current is not None and self._current[0] == seq and seq not in self._found

    def _watch(self):
        posted = None  # the collective this rank posted itself waiting in
        while not self._stop.wait(min(0.5, self.after / 4)):
            with self._lock:
                current = self._current
            if current is None or time.monotonic() - current[1] < self.after / 2:
                continue
            seq, start = current
            try:
                if posted != seq:
                    self.store.set(waiting_key(seq, self.rank), str(self.rank))
                    posted = seq
                # Another `after / 2` for the others to post theirs: a rank that entered it up
                # to `after / 2` later than this one has posted by then. Read once per collective,
                # and only if it still waits (and the group is not stopping).
                if self._stop.wait(self.after / 2) or not self._still(seq):
                    continue
                waiting = {r for r in range(self.world) if self.store.check([waiting_key(seq, r)])}
            except Exception as e:  # noqa: BLE001 - the store went away: the collective will fail itself
                _log.debug("diphoma watchdog: %s", e)
                continue
            missing = absent(self.world, waiting)
            with self._lock:
                if self._current is None or self._current[0] != seq or seq in self._found:
                    continue
                self._found = {seq: missing}  # only the latest is ever asked for
            if missing:
                _log.warning(
                    "diphoma: collective %d of this group has waited %.0f s on rank %d for rank(s) %s, which did not "
                    "call it within %.0f s of this rank: every rank must call the same collectives in the same order",
                    seq, time.monotonic() - start, self.rank, ", ".join(map(str, missing)), self.after / 2)
