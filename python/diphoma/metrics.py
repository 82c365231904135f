"""The Prometheus metrics of a Python worker, under the Rust worker's names (``diphoma_worker_*``,
no labels, its own registry; ``worker/src/metrics.rs``), so the chart's PodMonitor, the Training
dashboard and ``kubectl diphoma top`` read PyTorch jobs as they read Rust ones:

| metric | recorded by |
|---|---|
| ``diphoma_worker_step``, ``_loss``, ``_samples_per_second`` | ``diphoma.report`` |
| ``diphoma_worker_allreduce_seconds`` (histogram), ``_allreduce_bytes_total`` | the process group's ``all_reduce`` (each call: seconds on the ring, bytes of its buffers) |
| ``diphoma_worker_ring_generation`` | the process group, when it is created |
| ``diphoma_worker_repairs_total`` | ``diphoma.torch.elastic.run``, at each re-form after a failure |
| ``diphoma_worker_batch_share`` | ``diphoma.torch.ElasticSampler`` (this rank's samples of a global batch) |

``serve_if_configured(host)`` serves ``/metrics`` (``prometheus_client``'s HTTP server, a
daemon thread) once per process on ``host`` (the ring's own IP: the pod IP) at
``DIPHOMA_METRICS_PORT``, or at the contract's metrics port 9400 in a worker pod (where the
operator declares the container port ``metrics``); standalone without the variable nothing is
served.
"""

import os
import threading

import prometheus_client as pc

ENV_METRICS_PORT = "DIPHOMA_METRICS_PORT"
DEFAULT_PORT = 9400  # diphoma_contract::DEFAULT_METRICS_PORT
_ENV_MEMBERSHIP = "DIPHOMA_MEMBERSHIP"  # set in worker pods only (the contract's variables)

REGISTRY = pc.CollectorRegistry(auto_describe=True)
ALLREDUCE_SECONDS = pc.Histogram(
    "diphoma_worker_allreduce_seconds", "Duration of each step's allreduce", registry=REGISTRY,
    buckets=[1e-5 * 4.0**i for i in range(12)],  # the Rust worker's exponential buckets
)
ALLREDUCE_BYTES = pc.Counter("diphoma_worker_allreduce_bytes", "Bytes allreduced", registry=REGISTRY)
STEP = pc.Gauge("diphoma_worker_step", "Last committed step", registry=REGISTRY)
LOSS = pc.Gauge("diphoma_worker_loss", "Training loss of the last step", registry=REGISTRY)
SAMPLES_PER_SECOND = pc.Gauge("diphoma_worker_samples_per_second", "Samples per second over the ring", registry=REGISTRY)
RING_GENERATION = pc.Gauge("diphoma_worker_ring_generation", "Ring generation", registry=REGISTRY)
REPAIRS = pc.Counter("diphoma_worker_repairs", "Ring re-formations after a failure", registry=REGISTRY)
BATCH_SHARE = pc.Gauge("diphoma_worker_batch_share", "Samples of each global batch this member computes", registry=REGISTRY)

_served = {}
_lock = threading.Lock()


def port_from_env(env=None):
    """The port to serve on: ``DIPHOMA_METRICS_PORT`` (0 or empty: none) plus ``LOCAL_RANK``
    (so the ranks of one launcher serve side by side), else 9400 in a worker pod, else None.
    Raises ``ValueError`` naming the variable when it is not a port."""
    env = os.environ if env is None else env
    raw = env.get(ENV_METRICS_PORT)
    if raw is None:
        return DEFAULT_PORT if env.get(_ENV_MEMBERSHIP) else None
    if not raw.strip():
        return None
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"environment variable {ENV_METRICS_PORT}: {raw!r} is not a port (0 to 65535)")
    return port + int(env.get("LOCAL_RANK") or 0) if port else None


def serve_if_configured(host):
    """Starts ``/metrics`` on ``host`` at ``port_from_env()`` unless already served or not
    configured; returns the (host, port) served, or None. A port already taken is reported as a
    warning, not raised: training goes on without metrics. In a pod of several training
    processes only local rank 0 serves (``DIPHOMA_LOCAL_RANK``): the pod's one metrics port is
    its."""
    if os.environ.get("DIPHOMA_LOCAL_RANK", "0").strip() not in ("", "0"):
        return None
    port = port_from_env()
    with _lock:
        if port is None or _served:
            return _served.get("at")
        try:
            pc.start_http_server(port, addr=host, registry=REGISTRY)
        except OSError as e:
            import warnings

            warnings.warn(f"diphoma: /metrics not served on {host}:{port}: {e}")
            return None
        _served["at"] = (host, port)
        return _served["at"]


__all__ = ["ALLREDUCE_BYTES", "ALLREDUCE_SECONDS", "BATCH_SHARE", "LOSS", "REGISTRY", "REPAIRS", "RING_GENERATION",
           "SAMPLES_PER_SECOND", "STEP", "port_from_env", "serve_if_configured"]
