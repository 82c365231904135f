"""``make gpu-check``: the prepared GPU check of issue 27 (item 6), for a machine with one NVIDIA
GPU. Prints a table, and exits 0 with "no CUDA device" where there is none.

1. CUDA-tensor all_reduce through diphoma's pipelined host staging (``diphoma.torch._staging``:
   4 MiB segments copied device to pinned host memory on a copy stream, each reduced around
   the ring as soon as its copy is done, copied back on the copy stream while the ring reduces
   the next) with 2 processes sharing the GPU, against gloo's CUDA path (``ProcessGroupGloo``:
   one copy each way, its own ring, no overlap) in the same run, and against diphoma with one
   segment per tensor (``DIPHOMA_STAGING_SEGMENT_BYTES`` = the largest size: the same copies,
   not overlapped): f32 and bf16, 1 KiB to 256 MiB, each result exact against a reference
   (integer values, exact in both dtypes), median time per call and bus bandwidth; the bar
   (pipelined diphoma ≥ 1.3× gloo's throughput from 16 MiB) printed as met or missed with the
   ratio. Before the table, each backend's stream order: the tensor written on a side stream
   behind a ~50 ms GPU spin, ``all_reduce(async_op=True)``, then ``wait()`` (and the future's
   ``wait()``) and a kernel adding 1 on that stream, with no host synchronisation in between:
   exact only if the collective waited for the caller's stream before reading and ``wait()``
   made the stream wait for the result.
2. DDP ResNet-50 (torchvision, synthetic 32×32 images, batch 8 per rank) on CUDA with diphoma
   and with gloo: the same parameters within tolerance after the same steps, step time of
   each.
3. One of 2 elastic ranks on CUDA killed with ``kill -9`` mid-run: the other goes on at the
   next generation in its own process (its pid unchanged) and finishes.
4. With 2 or more GPUs (NCCL refuses two ranks on one GPU; skipped with one): the ``nccl``
   data plane (``DIPHOMA_DATA_PLANE=nccl``: a NCCL communicator per ring generation) exact at
   every size and timed, and through the kill -9 of part 3; and 2 local pods × 2 processes
   (``python -m diphoma.run --pods 2``) with NCCL inside each pod (the hierarchical
   all-reduce's in-pod stages), exact at every size.

Usage: ``python gpu_check.py`` (the driver, run by ``python/bench/gpu_check.sh``); it starts
its ranks with ``python -m diphoma.run`` running this file with ``--part``. Every process it
starts is stopped by its recorded pid, also on failure. Budget: under 8 minutes (each part has
a timeout; a part that runs out is reported as such and the others still run).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

# 1 KiB .. 256 MiB, ×4 (GPU_CHECK_MAX_BYTES lowers the top, for a dry run)
SIZES = [1 << k for k in range(10, 29, 2) if 1 << k <= int(os.environ.get("GPU_CHECK_MAX_BYTES", 1 << 28))]
BAR_FROM = 16 << 20
BAR = 1.3
DDP_STEPS, DDP_WARMUP, DDP_BATCH = 12, 2, 8
ELASTIC_STEPS = 40


def human(n):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n // size} {unit}"
    return f"{n} B"


def device():
    """This rank's GPU: ``cuda:LOCAL_RANK`` (an elastic member ``local-N``: N) modulo the GPUs
    there are (2 ranks share one). ``GPU_CHECK_CPU=1`` runs the parts on the CPU instead: a dry run of this script's
    own code where there is no GPU (its numbers say nothing about a GPU)."""
    import torch

    if os.environ.get("GPU_CHECK_CPU") == "1":
        return torch.device("cpu")
    index = os.environ.get("LOCAL_RANK") or os.environ.get("DIPHOMA_POD_NAME", "local-0").rsplit("-", 1)[-1]
    dev = torch.device("cuda", int(index) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def sync(dev):
    """Waits for the work queued on ``dev`` (nothing to wait for on the CPU)."""
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# -- the ranks' parts -----------------------------------------------------------------------
def part_allreduce(backend, out):
    """Every size and dtype: exactness, then the median time of timed calls (rank 0 writes)."""
    import torch
    import torch.distributed as dist

    import diphoma.torch  # noqa: F401

    dist.init_process_group(backend=backend)
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    rows = []
    try:
        order = stream_order(dev, rank, world)
    except Exception as e:  # noqa: BLE001 - reported in the table's header
        order = f"{type(e).__name__}: {e}"[:200]
    for dtype in (torch.float32, torch.bfloat16):
        for size in SIZES:
            n = size // torch.tensor([], dtype=dtype).element_size()
            base = (torch.arange(n, device=dev) % 7).to(dtype)
            want = base * world + sum(range(world))  # Σ_r (base + r), exact: integers ≤ 2·6 + 1
            t = base + rank
            try:
                dist.all_reduce(t)
                sync(dev)
                exact = bool(torch.equal(t, want))
                calls = max(3, min(30, (64 << 20) // size))
                times = []
                for _ in range(calls + 1):
                    t.copy_(base)
                    sync(dev)
                    dist.barrier()
                    t0 = time.perf_counter()
                    dist.all_reduce(t)
                    sync(dev)
                    times.append(time.perf_counter() - t0)
                times = sorted(times[1:])
                rows.append({"dtype": str(dtype).split(".")[-1], "bytes": size, "exact": exact,
                             "seconds": times[len(times) // 2]})
            except Exception as e:  # noqa: BLE001 - a backend that refuses a dtype is reported
                rows.append({"dtype": str(dtype).split(".")[-1], "bytes": size, "exact": False, "seconds": None,
                             "error": f"{type(e).__name__}: {e}"[:200]})
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"rows": rows, "stream_order": order}, f)
    dist.barrier()
    dist.destroy_process_group()


def stream_order(dev, rank, world):
    """The stream semantics of a CUDA all_reduce, without a host synchronisation between the
    calls: on a side stream, a 64 MiB tensor is written by a kernel queued behind a GPU spin
    (``torch.cuda._sleep``, about 50 ms), so a collective that read it without waiting for the
    caller's stream would reduce zeros; after ``wait()`` (then, second round, the future's
    ``wait()``) a kernel on that stream adds 1, so a result copied back after it would lose
    the 1. True when every element is Σ(rank + 1) + 1 both times; None on the CPU (dry run)."""
    import torch
    import torch.distributed as dist

    if dev.type != "cuda":
        return None
    n = (64 << 20) // 4
    want = sum(r + 1 for r in range(world)) + 1
    side = torch.cuda.Stream(dev)
    ok = True
    for use_future in (False, True):
        with torch.cuda.stream(side):
            t = torch.zeros(n, device=dev)
            torch.cuda._sleep(100_000_000)  # cycles: tens of ms, queued before the write
            t.fill_(rank + 1)
            work = dist.all_reduce(t, async_op=True)
            if use_future:
                work.get_future().wait()
            else:
                work.wait()
            t.add_(1)
        side.synchronize()
        ok = ok and bool(torch.equal(t, torch.full_like(t, want)))
    return ok


def resnet50():
    import torch
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet50(num_classes=10)


def part_ddp(backend, out):
    """DDP ResNet-50 on CUDA: DDP_WARMUP + DDP_STEPS steps; rank 0 writes the parameters and
    the median step time."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import diphoma.torch  # noqa: F401

    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    dist.init_process_group(backend=backend)
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    model = DDP(resnet50().to(dev), device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    times = []
    for step in range(DDP_WARMUP + DDP_STEPS):
        x = torch.randn(DDP_BATCH * world, 3, 32, 32, generator=g)[rank * DDP_BATCH:(rank + 1) * DDP_BATCH].to(dev)
        y = torch.randint(0, 10, (DDP_BATCH * world,), generator=g)[rank * DDP_BATCH:(rank + 1) * DDP_BATCH].to(dev)
        sync(dev)
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sync(dev)
        if step >= DDP_WARMUP:
            times.append(time.perf_counter() - t0)
    params = torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])
    if rank == 0:
        torch.save({"params": params, "step_seconds": sorted(times)[len(times) // 2]}, out)
    dist.barrier()
    dist.destroy_process_group()


def part_elastic(out_dir):
    """An elastic script on CUDA (``diphoma.torch.elastic``): ELASTIC_STEPS steps of a small
    MLP, a record per commit (pid, step, generation, world) in ``out_dir/<member>.json``."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import diphoma.torch  # noqa: F401
    from diphoma.torch import elastic

    dev = device()
    name = os.environ["DIPHOMA_POD_NAME"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8)).to(dev)
    state = elastic.State(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    record = {"pid": os.getpid(), "first_generation": None}

    @elastic.run
    def train(state):
        ddp = DDP(state.model, device_ids=[dev.index] if dev.type == "cuda" else None)
        gen = dist.distributed_c10d._get_default_group().ring.generation
        record["first_generation"] = record["first_generation"] or gen
        g = torch.Generator().manual_seed(2)
        while state.step < ELASTIC_STEPS:
            x, y = torch.randn(16, 64, generator=g).to(dev), torch.randn(16, 8, generator=g).to(dev)
            state.optimizer.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            state.optimizer.step()
            state.step += 1
            state.commit()
            record.update(step=state.step, generation=gen, world=dist.get_world_size(),
                          cuda=str(next(state.model.parameters()).device))
            with open(os.path.join(out_dir, f"{name}.json.tmp"), "w") as f:
                json.dump(record, f)
            os.rename(os.path.join(out_dir, f"{name}.json.tmp"), os.path.join(out_dir, f"{name}.json"))
            time.sleep(0.05)

    train(state)


# -- the driver ------------------------------------------------------------------------------
def launch(args, timeout, env=None):
    """``python -m diphoma.run ARGS`` (this file as the script); stopped by its pid (SIGTERM,
    then SIGKILL) when ``timeout`` s pass. Returns (exit code or None, output)."""
    p = subprocess.Popen([sys.executable, "-m", "diphoma.run", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env)
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        try:
            out, _ = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        return None, out


# The all_reduce runs: (name, backend, DIPHOMA_STAGING_SEGMENT_BYTES or None for the default).
RUNS = (("diphoma", "diphoma", None), ("one segment", "diphoma", str(max(SIZES, default=1 << 10))),
        ("gloo", "gloo", None))


def check_allreduce(tmp):
    from diphoma.torch import _staging

    results, order, failed = {}, {}, False
    for name, backend, segment in RUNS:
        out = os.path.join(tmp, f"allreduce-{name.replace(' ', '-')}.json")
        env = dict(os.environ)
        if segment is not None:
            env[_staging.ENV_SEGMENT_BYTES] = segment
        rc, log = launch(["--nproc", "2", __file__, "--part", "allreduce", "--backend", backend, "--out", out], 240,
                         env=env)
        if rc != 0:
            print(f"all_reduce with {name}: exit {rc}\n{log[-3000:]}")
            return False
        with open(out) as f:
            got = json.load(f)
        results[name] = {(r["dtype"], r["bytes"]): r for r in got["rows"]}
        order[name] = got["stream_order"]
    print("\n1. CUDA-tensor all_reduce, 2 processes sharing the GPU (bus bandwidth = 2·(n−1)/n · bytes / time)")
    for name, _, _ in RUNS:
        said = {True: "exact", False: "WRONG", None: "- (no GPU)"}.get(order[name], order[name])
        print(f"   stream order with {name} (caller's stream waited for, wait() and the future ordering its stream): {said}")
        failed |= order[name] is not None and order[name] is not True and name != "gloo"
    print(f"   diphoma: pipelined, {human(_staging.SEGMENT_BYTES)} segments (segs); 1-seg: one segment per tensor, "
          "the copies not overlapped")
    print(f"{'dtype':9} {'size':>8} {'segs':>5} {'exact':>6} {'diphoma ms':>11} {'GB/s':>7} {'1-seg ms':>9} "
          f"{'gloo ms':>9} {'GB/s':>7} {'ratio':>6}  bar")
    for key in sorted(results["diphoma"], key=lambda k: (k[0], k[1])):
        d, g = results["diphoma"][key], results["gloo"].get(key, {})
        one = results["one segment"].get(key, {})
        esize = 4 if key[0] == "float32" else 2
        segs = len(_staging.segments(key[1] // esize, esize, _staging.SEGMENT_BYTES))
        ok = d["exact"] and one.get("exact", False)
        failed |= not ok
        bw = lambda r: (key[1] / r["seconds"] / 1e9) if r.get("seconds") else None  # noqa: E731 (2·(n−1)/n = 1 at n = 2)
        ratio = (g["seconds"] / d["seconds"]) if d.get("seconds") and g.get("seconds") else None
        bar = ""
        if key[1] >= BAR_FROM and ratio is not None:
            bar = f"{'met' if ratio >= BAR else 'missed'} ({ratio:.2f}× vs {BAR}×)"
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        print(f"{key[0]:9} {human(key[1]):>8} {segs:>5} {str(ok):>6} "
              f"{fmt(d.get('seconds') and d['seconds'] * 1e3, '11.3f')} {fmt(bw(d), '7.2f')} "
              f"{fmt(one.get('seconds') and one['seconds'] * 1e3, '9.3f')} "
              f"{fmt(g.get('seconds') and g['seconds'] * 1e3, '9.3f')} {fmt(bw(g), '7.2f')} "
              f"{fmt(ratio, '6.2f')}  {bar}{' gloo: ' + g['error'] if g.get('error') else ''}"
              f"{' diphoma: ' + d['error'] if d.get('error') else ''}"
              f"{' 1-seg: ' + one['error'] if one.get('error') else ''}")
    return not failed


def check_ddp(tmp):
    import torch

    got = {}
    for backend in ("diphoma", "gloo"):
        out = os.path.join(tmp, f"ddp-{backend}.pt")
        rc, log = launch(["--nproc", "2", __file__, "--part", "ddp", "--backend", backend, "--out", out], 180)
        if rc != 0:
            print(f"DDP ResNet-50 with {backend}: exit {rc}\n{log[-3000:]}")
            return False
        got[backend] = torch.load(out)
    diff = (got["diphoma"]["params"] - got["gloo"]["params"]).abs().max().item()
    same = torch.allclose(got["diphoma"]["params"], got["gloo"]["params"], atol=1e-4, rtol=1e-3)
    print(f"\n2. DDP ResNet-50 on CUDA, 2 ranks, {DDP_STEPS} timed steps of batch {DDP_BATCH} per rank")
    print(f"   step time: diphoma {got['diphoma']['step_seconds'] * 1e3:.1f} ms, gloo {got['gloo']['step_seconds'] * 1e3:.1f} ms"
          f" (ratio {got['gloo']['step_seconds'] / got['diphoma']['step_seconds']:.2f}×)")
    print(f"   parameters: max |diphoma − gloo| = {diff:.2e}: {'same within atol 1e-4, rtol 1e-3' if same else 'DIFFER'}")
    return same


def check_elastic(tmp, plane="ring", label="3."):
    out = os.path.join(tmp, f"elastic-{plane}")
    os.makedirs(out)
    p = subprocess.Popen([sys.executable, "-m", "diphoma.run", "--nproc", "2", "--elastic", "--ring-dir",
                          os.path.join(tmp, f"ring-{plane}"), __file__, "--part", "elastic", "--out", out],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, DIPHOMA_DATA_PLANE=plane))
    pids, ok = [], False
    try:
        deadline = time.monotonic() + 120
        before = {}
        while time.monotonic() < deadline and p.poll() is None:
            before = read_records(out)
            pids = [r["pid"] for r in before.values()]
            if all(before.get(n, {}).get("step", 0) >= 5 for n in ("local-0", "local-1")):
                break
            time.sleep(0.05)
        if "local-1" not in before or p.poll() is not None:
            print(f"\n{label} kill -9: the ranks did not reach step 5\n{p.communicate(timeout=30)[0][-3000:]}")
            return False
        os.kill(before["local-1"]["pid"], signal.SIGKILL)
        rc = p.wait(timeout=120)
        after = read_records(out)
        a, b = after.get("local-0", {}), before["local-0"]
        ok = (rc == 0 and a.get("pid") == b["pid"] and a.get("generation", 0) > 1 and a.get("step") == ELASTIC_STEPS)
        print(f"\n{label} kill -9 of rank 1 at step {before['local-1']['step']}: rank 0 (pid {b['pid']}, {a.get('cuda')}) "
              f"{'went on' if ok else 'did NOT go on'} at generation {a.get('generation')} (world {a.get('world')}) "
              f"to step {a.get('step')}, same pid: {a.get('pid') == b['pid']}; launcher exit {rc}")
        return ok
    except subprocess.TimeoutExpired:
        print(f"\n{label} kill -9: the survivor did not finish within 120 s")
        return False
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def check_nccl(tmp):
    """Part 4 (the module doc): with one GPU, says why it is skipped and passes."""
    import torch

    if torch.cuda.device_count() < 2:
        print(f"\n4. dataPlane nccl and NCCL inside the pod: skipped ({torch.cuda.device_count()} GPU: NCCL refuses "
              "two ranks on one GPU; run on a machine with 2 or more)")
        return True
    ok = True
    small = dict(os.environ, GPU_CHECK_MAX_BYTES=str(64 << 20))  # the 8-minute budget
    for label, args, env in (
            ("dataPlane nccl, 2 ranks on 2 GPUs", ["--nproc", "2"], dict(small, DIPHOMA_DATA_PLANE="nccl")),
            ("2 pods x 2 processes, NCCL inside each pod", ["--pods", "2", "--nproc", "2"],
             dict(small, DIPHOMA_HIERARCHICAL_MIN_BYTES="0"))):
        out = os.path.join(tmp, f"nccl-{len(args)}.json")
        rc, log = launch([*args, __file__, "--part", "allreduce", "--backend", "diphoma", "--out", out], 180, env)
        if rc != 0:
            print(f"\n4. {label}: exit {rc}\n{log[-3000:]}")
            ok = False
            continue
        with open(out) as f:
            got = json.load(f)  # part_allreduce's record: its rows and its stream-order check
        rows, order = got["rows"], got["stream_order"]
        said = {True: "exact", False: "WRONG"}.get(order, order)
        print(f"\n4. {label}: all_reduce, ms per call (exact against the reference); stream order: {said}")
        for r in rows:
            ok &= r["exact"]
            ms = f"{r['seconds'] * 1e3:.3f}" if r.get("seconds") else "-"
            print(f"   {r['dtype']:9} {human(r['bytes']):>8} {str(r['exact']):>6} {ms:>10}{' ' + r['error'] if r.get('error') else ''}")
    return check_elastic(tmp, "nccl", "4. dataPlane nccl,") and ok


def read_records(out):
    got = {}
    for n in os.listdir(out):
        if n.endswith(".json"):
            try:
                with open(os.path.join(out, n)) as f:
                    got[n[:-5]] = json.load(f)
            except (OSError, ValueError):
                pass
    return got


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("allreduce", "ddp", "elastic"))
    ap.add_argument("--backend", default="diphoma")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.part == "allreduce":
        return part_allreduce(a.backend, a.out)
    if a.part == "ddp":
        return part_ddp(a.backend, a.out)
    if a.part == "elastic":
        return part_elastic(a.out)
    try:
        import torch
    except ImportError:
        print("gpu-check: no CUDA device (torch is not installed for this python)")
        return 0
    if not torch.cuda.is_available() and os.environ.get("GPU_CHECK_CPU") != "1":
        print(f"gpu-check: no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False); nothing checked")
        return 0
    start = time.monotonic()
    if torch.cuda.is_available():
        print(f"gpu-check: {torch.cuda.get_device_name(0)} ×{torch.cuda.device_count()}, torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}")
    else:
        print("gpu-check: GPU_CHECK_CPU=1: a dry run on the CPU (no GPU numbers)")
    results = {}
    with tempfile.TemporaryDirectory(prefix="diphoma-gpu-check-") as tmp:
        for name, check in (("allreduce", check_allreduce), ("ddp", check_ddp), ("elastic", check_elastic),
                            ("nccl", check_nccl)):
            try:
                results[name] = check(tmp)
            except Exception as e:  # noqa: BLE001 - reported, the other parts still run
                print(f"{name}: {type(e).__name__}: {e}")
                results[name] = False
    said = ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in results.items())
    print(f"\ngpu-check: {said} in {time.monotonic() - start:.0f} s")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
