"""Diphoma's ring runtime for Python.

``diphoma.Ring`` is one member of one ring generation of the Rust runtime (``diphoma-ring``):
allreduce, reduce-scatter, all-gather, broadcast and barrier over authenticated TCP, run with
the GIL released. ``import diphoma.torch`` registers the ``torch.distributed`` backend
``"diphoma"``; ``python -m diphoma.run --nproc N script.py`` starts N ranks on 127.0.0.1.

Exceptions: ``ConfigError`` (a ``ValueError``: a bad argument or environment variable, named in
the message; nothing was sent) and ``RingError`` (a ``RuntimeError``: a collective or the join
failed; the ring is unusable afterwards).
"""

from diphoma._native import ConfigError, Ring, RingError

for _e in (ConfigError, RingError):
    _e.__module__ = __name__  # shown as diphoma.ConfigError in tracebacks

__all__ = ["ConfigError", "Ring", "RingError"]
