"""How ``python -m diphoma.run`` starts a Python rank: ``python -m diphoma._boot [--backend B]
(-m MODULE | SCRIPT) [ARGS…]`` runs the script (or module) as ``__main__``, as ``python SCRIPT``
or ``python -m MODULE`` would, with two additions of torchrun's machinery:

- an exception that ends the rank is recorded in ``TORCHELASTIC_ERROR_FILE`` (torch's
  ``torch.distributed.elastic.multiprocessing.errors.ErrorHandler``, what ``@record`` does), so
  the launcher's failure summary names the root-cause rank with its traceback, for unchanged
  scripts too;
- under the in-pod launcher (``DIPHOMA_LAUNCHER_PID``), the rank dies with the launcher (Linux's
  ``PR_SET_PDEATHSIG``), as a container's processes die with its first one: a worker pod whose
  launcher is killed leaves no training process behind;
- with ``--backend B``, the default process group is initialised with backend ``B`` (``env://``)
  before the script runs, for libraries that choose their own CPU backend and keep a group
  that exists (Hugging Face Accelerate picks gloo on CPU unless one is initialised).
"""

import json
import os
import runpy
import sys
import time


def _die_with_launcher():
    """SIGKILL for this process when the launcher ``DIPHOMA_LAUNCHER_PID`` names dies (at once
    when it already has)."""
    pid = os.environ.get("DIPHOMA_LAUNCHER_PID")
    if not pid or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(pid):
        os._exit(128 + signal.SIGKILL)


def main(argv):
    _die_with_launcher()
    backend = None
    if argv[:1] == ["--backend"]:
        backend, argv = argv[1], argv[2:]
    module = argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv:
        sys.exit("diphoma._boot: no script or module to run")
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    handler = ErrorHandler()
    handler.initialize()
    try:
        if backend:
            import torch.distributed as dist

            if backend == "diphoma":
                import diphoma.torch  # noqa: F401  (registers it)
            dist.init_process_group(backend=backend)
        sys.argv = list(argv)
        if module:
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit:
        raise
    except BaseException as e:
        when = time.time()
        handler.record_exception(e)
        _stamp(when)
        raise


def _stamp(when):
    """Adds ``diphoma_time`` (``when``, seconds since the epoch, sub-second) to the error file
    torch's ErrorHandler just wrote, whose own timestamp has whole seconds: the launcher orders
    failures within a second by it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    try:
        with open(path) as f:
            data = json.load(f)
        data["message"]["extraInfo"]["diphoma_time"] = when
        with open(path, "w") as f:
            json.dump(data, f)
    except (OSError, TypeError, KeyError, ValueError):
        pass  # no error file (not under the launcher), or not torch's layout: nothing to add


if __name__ == "__main__":
    main(sys.argv[1:])
