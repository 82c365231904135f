"""A Python worker's /metrics: the Rust worker's metric names (read from worker/src/metrics.rs),
recorded by the process group and diphoma.report, served over HTTP at the ring's address."""

import os
import re
import socket

import pytest

from diphoma import metrics
from conftest import check, launch

RUST_METRICS = os.path.join(os.path.dirname(__file__), "..", "..", "worker", "src", "metrics.rs")


def rust_names():
    """The metric names the Rust worker registers (``n("…")`` in its WorkerMetrics::new)."""
    return {f"diphoma_worker_{m}" for m in re.findall(r'\bn\("([a-z_]+)"\)', open(RUST_METRICS).read())}


def test_a_python_worker_serves_the_rust_workers_metrics():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = check(launch(1, "metrics_scrape.py", str(port), timeout=60))
    got = {}
    for line in p.stdout.splitlines():
        name, _, value = line.split("]:", 1)[-1].partition(" ")
        got[name] = float(value)
    names = rust_names()
    assert len(names) == 8, names
    for name in names:
        key = name + "_count" if name.endswith("_seconds") else name
        assert key in got, (name, sorted(got))
    assert got["diphoma_worker_allreduce_seconds_count"] == 3
    assert got["diphoma_worker_allreduce_bytes_total"] == 3 * 1000 * 4
    assert got["diphoma_worker_step"] == 7 and got["diphoma_worker_loss"] == 0.25
    assert got["diphoma_worker_ring_generation"] == 1 and got["diphoma_worker_samples_per_second"] > 0


def test_the_metrics_port_comes_from_the_environment():
    assert metrics.port_from_env({}) is None  # standalone: nothing served
    assert metrics.port_from_env({"DIPHOMA_MEMBERSHIP": "/etc/ring"}) == 9400  # a worker pod: the contract's port
    assert metrics.port_from_env({"DIPHOMA_METRICS_PORT": "9500", "DIPHOMA_MEMBERSHIP": "x"}) == 9500
    assert metrics.port_from_env({"DIPHOMA_METRICS_PORT": "9500", "LOCAL_RANK": "2"}) == 9502  # side by side
    assert metrics.port_from_env({"DIPHOMA_METRICS_PORT": "0"}) is None
    with pytest.raises(ValueError, match="DIPHOMA_METRICS_PORT: 'http' is not a port"):
        metrics.port_from_env({"DIPHOMA_METRICS_PORT": "http"})


def test_in_a_pod_of_several_processes_only_local_rank_0_serves(monkeypatch):
    """The pod has one metrics port (9400): its other local ranks serve nothing, and warn of
    no port taken."""
    monkeypatch.setenv("DIPHOMA_MEMBERSHIP", "x")
    monkeypatch.setenv("DIPHOMA_LOCAL_RANK", "1")
    assert metrics.serve_if_configured("127.0.0.1") is None
