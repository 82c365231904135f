"""Point-to-point messages and the monitored barrier of the ``"diphoma"`` process group, over
the group's torch store (the ``PrefixStore`` torch hands the backend: keys are the group's own).

The ring connects each rank to its ring neighbours only, so ``send``/``recv`` between any two
ranks go through the store that ``init_process_group`` made for the rendezvous (a ``TCPStore``
served by rank 0 with ``env://``): each message is one value under
``p2p/<src>-<dst>/<tag>/<n>``, ``n`` counting that pair's messages of that tag in call order on
both sides (the matching rule of gloo and MPI), deleted once received. Every byte passes
rank 0's store server, so this is for what libraries exchange point to point (small tensors,
pipeline stages at low rates), not for bulk data.

A store that lives in one process (``HashStore``, which ``diphoma.torch.elastic.run`` uses)
cannot carry messages between ranks: every call then raises ``ConfigError`` at once instead of
waiting forever.
"""

import ctypes
import threading
import time
import warnings

import torch.distributed as dist

from diphoma import ConfigError

_HEADER = b"\n"  # between the text header "<dtype> <numel>" and the bytes


def _poll(found, seconds):
    """Calls ``found()`` 1 to 10 ms apart until it returns something other than None, or
    ``seconds`` have passed (then returns None). Polled rather than waited on: torch's store
    client runs one request at a time, and a blocking wait would hold back every send of this
    process."""
    deadline = time.monotonic() + seconds
    pause = 0.001
    while True:
        got = found()
        if got is not None or time.monotonic() > deadline:
            return got
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def _root_store(store):
    """The store under ``store``'s prefixes."""
    return getattr(store, "_underlying_non_prefix_store", store)


def _payload(t):
    """The message of the contiguous CPU tensor ``t``: a header naming its dtype and numel, then
    its bytes."""
    raw = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""
    return f"{t.dtype} {t.numel()}".encode() + _HEADER + raw


def _fill(t, message, src):
    """Copies ``message`` (from ``_payload``) into the contiguous ``t``; raises ``ConfigError``
    naming both sides when rank ``src`` sent another dtype or size."""
    header, raw = message.split(_HEADER, 1)
    want = f"{t.dtype} {t.numel()}"
    if header.decode() != want:
        raise ConfigError(f"diphoma: recv: rank {src} sent {header.decode()} elements, the receive buffer holds {want}")
    if raw:
        ctypes.memmove(t.data_ptr(), raw, len(raw))


class StoreP2P:
    """The point-to-point state of one process group: ``store`` (torch's, for this group),
    ``timeout`` (a ``timedelta``: how long a receive or the barrier waits) and the per-pair
    sequence numbers."""

    def __init__(self, store, timeout):
        self.store, self.timeout = store, timeout
        self._lock = threading.Lock()
        self._sent, self._taken = {}, {}  # (peer, tag) -> messages sent / receives issued
        self._posted = []  # keys sent and perhaps not yet received (see flush)
        self._barriers = 0
        self._local = isinstance(_root_store(store), dist.HashStore)

    def _usable(self, what):
        if self._local:
            raise ConfigError(
                f"diphoma: {what} needs a store shared by the ranks; this group's is a HashStore "
                "(diphoma.torch.elastic.run): use collectives there, or start the script with "
                "init_process_group(backend='diphoma') under python -m diphoma.run"
            )

    def _next(self, counters, peer, tag):
        with self._lock:
            n = counters.get((peer, tag), 0)
            counters[(peer, tag)] = n + 1
            return n

    def send(self, t, src, dst, tag):
        """Posts the contiguous ``t`` from ``src`` to ``dst`` (returns at once)."""
        self._usable("send")
        key = f"p2p/{src}-{dst}/{tag}/{self._next(self._sent, dst, tag)}"
        self.store.set(key, _payload(t))
        with self._lock:
            self._posted.append(key)
            if len(self._posted) >= 1024:  # keep only what may still be unreceived
                self._posted = [k for k in self._posted if self.store.check([k])]

    def flush(self, seconds):
        """Waits up to ``seconds`` until every message this process sent has been received
        (its key deleted): a rank that sends and then leaves must not take its messages with
        it when it hosts the store. Returns the keys still unreceived (warned about)."""
        if self._local:
            return []
        pending = list(self._posted)

        def received():
            pending[:] = [k for k in pending if self.store.check([k])]
            return None if pending else True

        try:
            _poll(received, seconds)
        except (RuntimeError, dist.DistError):
            return []  # the store is gone already: nothing left to wait for
        self._posted = pending
        if pending:
            warnings.warn(f"diphoma: {len(pending)} sent messages were not received within {seconds:g} s: {pending[:4]}")
        return pending

    def recv(self, t, src, dst, tag):
        """Takes the next sequence number of ``src``'s messages to ``dst`` now and returns the
        wait: a function that blocks until that message arrives (``DistStoreError`` after the
        timeout), fills ``t`` and returns ``src``."""
        self._usable("recv")
        n = self._next(self._taken, src, tag)
        return lambda: self._take(t, lambda: [(src, f"p2p/{src}-{dst}/{tag}/{n}")])

    def recv_any(self, t, sources, dst, tag):
        """As ``recv`` from whichever of ``sources`` sends first."""
        self._usable("recv")

        def candidates():
            with self._lock:
                return [(src, f"p2p/{src}-{dst}/{tag}/{self._taken.get((src, tag), 0)}") for src in sources]

        def claim(src, key):
            with self._lock:
                n = self._taken.get((src, tag), 0)
                if key != f"p2p/{src}-{dst}/{tag}/{n}":
                    return False  # another receive took it
                self._taken[(src, tag)] = n + 1
                return True

        return lambda: self._take(t, candidates, claim)

    def _take(self, t, candidates, claim=lambda src, key: True):
        """Polls the keys of ``candidates()`` (``[(src, key)]``) until one exists that
        ``claim`` grants; fills ``t`` from it, deletes it and returns its ``src``. Raises
        ``DistStoreError`` after the timeout."""
        def pick():
            for src, key in candidates():
                if self.store.check([key]) and claim(src, key):
                    return src, key
            return None

        found = _poll(pick, self.timeout.total_seconds())
        if found is None:
            raise dist.DistStoreError(f"diphoma: recv: nothing arrived within {self.timeout}")
        src, key = found
        _fill(t, self.store.get(key), src)
        self.store.delete_key(key)
        return src

    def _arrived(self, key, seconds):
        """True once ``key`` exists, False after ``seconds``."""
        return _poll(lambda: True if self.store.check([key]) else None, seconds) is not None

    def monitored_barrier(self, rank, world, seconds, wait_all_ranks):
        """Rank 0 waits up to ``seconds`` for every other rank's check-in and then releases
        them; raises ``RuntimeError`` naming the ranks that did not check in (on rank 0) or
        that rank 0 did not release this rank (on the others)."""
        self._usable("monitored_barrier")
        self._barriers += 1
        prefix = f"monitored_barrier/{self._barriers}"
        if rank != 0:
            self.store.set(f"{prefix}/{rank}", b"1")
            if not self._arrived(f"{prefix}/done", seconds):
                raise RuntimeError(
                    f"diphoma: monitored_barrier: rank 0 did not release rank {rank} within {seconds:g} s"
                )
            return
        deadline = time.monotonic() + seconds
        missing = []
        for r in range(1, world):
            if not self._arrived(f"{prefix}/{r}", max(deadline - time.monotonic(), 0.0)):
                missing.append(r)
                if not wait_all_ranks:
                    break
        if missing:
            who = ", ".join(str(r) for r in missing)
            raise RuntimeError(
                f"diphoma: monitored_barrier: rank{'s' if len(missing) > 1 else ''} {who} "
                f"failed to pass monitored_barrier in {seconds:g} s"
            )
        self.store.set(f"{prefix}/done", b"1")
        for r in range(1, world):
            self.store.delete_key(f"{prefix}/{r}")


__all__ = ["StoreP2P"]
