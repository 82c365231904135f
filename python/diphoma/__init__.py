"""Diphoma's ring runtime for Python.

``diphoma.Ring`` is one member of one ring generation of the Rust runtime (``diphoma-ring``):
allreduce, reduce-scatter, all-gather, broadcast and barrier over authenticated TCP, run with
the GIL released. ``diphoma.Follower`` follows the ring's generations through ``diphoma-ring``'s
membership sources (the fixed standalone ring, the ring directory of ``python -m diphoma.run
--elastic``, or the ring ConfigMap in a worker pod); ``diphoma.RingWatch`` only watches the ring
ConfigMap (the in-pod launcher, which restarts a torchrun script at each new generation). ``import diphoma.torch`` registers the
``torch.distributed`` backend ``"diphoma"``; ``diphoma.torch.elastic`` re-forms the ring without
restarting the process; ``python -m diphoma.run --nproc N script.py`` starts N ranks on
127.0.0.1. ``diphoma.report`` publishes training progress on the Rust worker's heartbeat path.
``diphoma.metrics`` serves the Rust worker's Prometheus metrics from Python workers.
``diphoma.split`` and ``diphoma.Speed`` are the contract's speed-weighted shares (the Rust
worker's functions), used by ``diphoma.torch.ElasticSampler``.

Exceptions: ``ConfigError`` (a ``ValueError``: a bad argument or environment variable, named in
the message; nothing was sent), ``RingError`` (a ``RuntimeError``: the ring could not be joined)
and its subclasses ``RingChanged`` (a collective of an established ring failed: a member was
lost or a newer generation published; the ring must re-form) and ``CollectiveMismatch`` (the
ranks called different collectives or sizes: the script's mistake, never re-formed for).
"""

import time

from diphoma._native import (
    CollectiveMismatch,
    ConfigError,
    Follower,
    Ring,
    RingWatch,
    RingChanged,
    RingError,
    Speed,
    membership_json,
    split,
)

from diphoma import metrics  # noqa: E402  (after the native module)

for _e in (ConfigError, RingError, RingChanged, CollectiveMismatch):
    _e.__module__ = __name__  # shown as diphoma.ConfigError in tracebacks

# The follower of the process group in use (set by the torch backend and the elastic runner),
# and what report() was told so far ("explicit": the script reports or commits itself, so the
# automatic steps of _optimizer_stepped stop; "batch": the global batch of ElasticSampler).
_current = {"follower": None}
_progress = {"total_steps": None, "step": 0, "loss": float("nan"), "samples": 0, "since": None,
             "last_checkpoint": None, "explicit": False, "auto_steps": 0, "batch": None}


def _set_follower(follower):
    _current["follower"] = follower


def _samples_per_second():
    since = _progress["since"]
    return 0.0 if since is None else _progress["samples"] / max(time.monotonic() - since, 1e-9)


def report(step=None, loss=None, samples=None, test_accuracy=None, total_steps=None):
    """Publishes training progress as the Rust worker does: rank 0's progress record (the
    heartbeat ConfigMap's ``progress.json`` in a pod, ``<ring dir>/progress.json`` under
    ``python -m diphoma.run --elastic``), written at most every 5 s and at the last step, which
    the operator copies into ``status.progress`` (``kubectl get dpj``, ``/metrics``).

    ``step``: steps done; ``total_steps``: steps in the run (once is enough; without it the
    status shows no percentage or ETA); ``loss``: the step's training loss; ``samples``:
    samples the step trained over the whole ring (for samples/s); ``test_accuracy`` (in
    [0, 1]): the final record, written at once. Other ranks and a ring without membership
    source write nothing. A script that never calls it still shows its steps: the library
    counts optimizer steps (``_optimizer_stepped``) until the first call or
    ``elastic.State.commit``. Raises ``ConfigError`` when ``test_accuracy`` is outside [0, 1].
    """
    _progress["explicit"] = True
    _publish(step, loss, samples, test_accuracy, total_steps)


def _publish(step=None, loss=None, samples=None, test_accuracy=None, total_steps=None):
    p = _progress
    if total_steps is not None:
        p["total_steps"] = int(total_steps)
    if step is not None:
        p["step"] = int(step)
    if loss is not None:
        p["loss"] = float(loss)
    if samples is not None:
        if p["since"] is None:  # the rate runs from the first report: its samples took unknown time
            p["since"] = time.monotonic()
        else:
            p["samples"] += int(samples)
    metrics.STEP.set(p["step"])
    metrics.LOSS.set(p["loss"])
    metrics.SAMPLES_PER_SECOND.set(_samples_per_second())
    follower = _current["follower"]
    if test_accuracy is not None:
        if not 0.0 <= test_accuracy <= 1.0:
            raise ConfigError(f"diphoma.report: test_accuracy {test_accuracy} is not in [0, 1]")
        if follower is not None:
            follower.report_test_accuracy(float(test_accuracy))
        return
    if follower is not None:
        follower.publish(p["step"], p["total_steps"], p["loss"], _samples_per_second(), p["last_checkpoint"])


def _optimizer_stepped(optimizer, args, kwargs):
    """``torch.optim``'s global post-step hook (registered by ``diphoma.torch`` with its
    process group): while the script reports nothing itself, each optimizer step of a
    ``diphoma`` job is a training step, its samples the ``ElasticSampler``'s global batch when
    it uses one, so a torchrun script or a framework's loop (Lightning, Accelerate) shows
    progress. The count is this process's: a process restarted in place counts from 0."""
    p = _progress
    if p["explicit"] or _current["follower"] is None:
        return
    p["auto_steps"] += 1
    _publish(step=p["auto_steps"], samples=p["batch"])


__all__ = ["CollectiveMismatch", "ConfigError", "Follower", "Ring", "RingChanged", "RingWatch", "RingError", "Speed", "membership_json", "report", "split"]
