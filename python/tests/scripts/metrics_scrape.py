"""One rank with ``DIPHOMA_METRICS_PORT`` set (argv[1]): all-reduces a 1,000-element float32
tensor 3 times, reports step 7 with loss 0.25 and 64 samples, then scrapes its own
``/metrics`` over HTTP at the ring's address and prints the diphoma_worker_ lines."""

import os
import sys
import urllib.request

import torch
import torch.distributed as dist

import diphoma
import diphoma.torch  # noqa: F401

os.environ["DIPHOMA_METRICS_PORT"] = sys.argv[1]
dist.init_process_group(backend="diphoma")
for _ in range(3):
    dist.all_reduce(torch.ones(1000))
diphoma.report(step=6, total_steps=10, loss=0.5, samples=64)  # the rate runs from here
diphoma.report(step=7, total_steps=10, loss=0.25, samples=64)
host = dist.distributed_c10d._get_default_group().ring.host
body = urllib.request.urlopen(f"http://{host}:{sys.argv[1]}/metrics", timeout=10).read().decode()
for line in body.splitlines():
    if line.startswith("diphoma_worker_") and "_created" not in line:
        print(line, flush=True)
dist.destroy_process_group()
