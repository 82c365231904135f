"""Checkpoints of an elastic ``State`` in ``DIPHOMA_CHECKPOINT_DIR``, as the Rust worker keeps
them: written atomically (a temporary file in the same directory, ``fsync``, ``rename``,
``fsync`` of the directory), so a crash leaves the previous set of files or the new one, never
a partial checkpoint under a final name; read back as the newest file that loads and matches
its name, skipping (with a warning) any other.

Files: ``torch-<step, 12 digits>.pt`` (``torch.save`` of ``{"format", "step", "model",
"optimizer", "extra"}``), next to the Rust worker's ``ckpt-*.safetensors`` without clashing;
the newest ``KEEP`` are kept. ``DIPHOMA_CHECKPOINT_EVERY`` (steps, default 0: never) is when
``State.commit`` on rank 0 writes one.
"""

import os
import re
import warnings

import torch

FORMAT = "diphoma-torch-v1"
KEEP = 3
ENV_DIR = "DIPHOMA_CHECKPOINT_DIR"
ENV_EVERY = "DIPHOMA_CHECKPOINT_EVERY"
_NAME = re.compile(r"^torch-(\d{12})\.pt$")


def directory():
    """``DIPHOMA_CHECKPOINT_DIR``, or None when unset or empty."""
    return os.environ.get(ENV_DIR) or None


def every():
    """``DIPHOMA_CHECKPOINT_EVERY`` as a number of steps (0: never). Raises ``ConfigError``
    naming the variable when it is not a non-negative integer."""
    from diphoma import ConfigError

    raw = os.environ.get(ENV_EVERY, "0").strip() or "0"
    if not raw.isdigit():
        raise ConfigError(f"environment variable {ENV_EVERY}: {raw!r} is not a non-negative integer")
    return int(raw)


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(snapshot, dirname):
    """Writes ``snapshot`` (a dict with ``step``) as ``torch-<step>.pt`` in ``dirname``
    atomically, removes all but the newest ``KEEP`` and returns the path."""
    os.makedirs(dirname, exist_ok=True)
    path = os.path.join(dirname, f"torch-{snapshot['step']:012d}.pt")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save({"format": FORMAT, **snapshot}, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    _fsync_dir(dirname)
    for old in sorted(n for n in os.listdir(dirname) if _NAME.match(n))[:-KEEP]:
        os.remove(os.path.join(dirname, old))
    return path


def load_newest(dirname):
    """The newest valid checkpoint in ``dirname`` as ``(path, snapshot)``, or None. A file
    that does not load, has another format, or whose step differs from its name is skipped
    with a warning."""
    if not os.path.isdir(dirname):
        return None
    for name in sorted((n for n in os.listdir(dirname) if _NAME.match(n)), reverse=True):
        path = os.path.join(dirname, name)
        try:
            snap = torch.load(path, weights_only=False)
            if not isinstance(snap, dict) or snap.get("format") != FORMAT:
                raise ValueError(f"format is not {FORMAT}")
            if snap.get("step") != int(_NAME.match(name).group(1)):
                raise ValueError(f"step {snap.get('step')} does not match the file name")
        except Exception as e:  # noqa: BLE001 - any unreadable file is skipped
            warnings.warn(f"diphoma: skipping checkpoint {path}: {e}", stacklevel=2)
            continue
        snap.pop("format")
        return path, snap
    return None
