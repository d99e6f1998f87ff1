"""Torch jobs behind the collector benchmark (``bench_collector.py``): the real gloo DDP
job under torchrun with the collector switched on and off inside the same processes, and
separate launches of the unmodified example under ``rankscope run``.

This file is also the torchrun worker: ``python -m torch.distributed.run ...
benchmarks/collector_jobs.py --blocks|--steps ...`` runs one rank.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "tiny_ddp.py"
BUCKET_MODES = ("every", "sampled", "tail", "off")
"""The collector's DDP bucket-timing settings, one instrumented arm each."""
SAMPLE_EVERY = 10
BLOCK_S = 3.0
"""Timed seconds per block in the block-interleaved job (warm-up: a third of it)."""


def load() -> str:
    """The load average now, for the report."""
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (5 min {five:.1f})"


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile)."""
    v = sorted(values)
    return v[len(v) // 4], statistics.median(v), v[(3 * len(v)) // 4]


def python_comm_hook(state, bucket):  # type: ignore[no-untyped-def]
    """DDP's default all-reduce written as a Python comm hook, with nothing of rankscope:
    the price any Python comm hook pays against DDP's built-in C++ path. (Unannotated: DDP
    refuses a ``bucket`` annotation other than ``dist.GradBucket``.)"""
    import torch.distributed as dist

    group = dist.group.WORLD
    tensor = bucket.buffer()
    tensor.div_(group.size())
    return group.allreduce([tensor]).get_future().then(lambda f: f.value()[0])


class Installed:
    """Switches the installed torch hooks off and on again between steps (patched
    attributes and global optimizer hooks), so a bare step runs none of rankscope's code."""

    def __init__(self) -> None:
        from torch.optim import optimizer

        from rankscope.collector import torch_collectives

        state = torch_collectives._state
        self.patched = [(o, n, getattr(o, n), orig) for o, n, orig in state.originals]
        self.hook_dicts: tuple[dict[Any, Any], ...] = (
            optimizer._global_optimizer_pre_hooks,
            optimizer._global_optimizer_post_hooks,
        )
        self.hooks = [dict(d) for d in self.hook_dicts]
        self.state = state
        self.mon = state.mon

    def set(self, on: bool) -> None:
        for owner, name, new, orig in self.patched:
            setattr(owner, name, new if on else orig)
        for d, saved in zip(self.hook_dicts, self.hooks):
            d.clear()
            if on:
                d.update(saved)
        self.state.mon = self.mon if on else None


def worker(argv: list[str]) -> int:
    """One rank of the in-job comparisons (this file run by torchrun)."""
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("blocks", "steps"), required=True)
    p.add_argument("--pairs", type=int, required=True)
    p.add_argument("--warm", type=int, default=100, help="untimed steps first (steps mode)")
    p.add_argument("--seconds", type=float, default=BLOCK_S, help="timed seconds per block")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=0, help="hidden x hidden layers (0: MLP 16-h-4)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL")
    p.add_argument("--hub", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    from rankscope.collector import runtime, torch_hooks

    cuda = a.device == "cuda"
    if cuda:
        # One GPU a rank, NCCL; each step ends with the device's work done, so its wall time
        # is the step's (an asynchronous launch would otherwise time only the host).
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    dim = a.hidden if a.layers else 16

    def make() -> Any:
        torch.manual_seed(0)
        if a.layers:
            body: list[Any] = []
            for _ in range(a.layers):
                body += [nn.Linear(a.hidden, a.hidden), nn.ReLU()]
            net = nn.Sequential(*body, nn.Linear(a.hidden, 4))
        else:
            net = nn.Sequential(nn.Linear(16, a.hidden), nn.ReLU(), nn.Linear(a.hidden, 4))
        if cuda:
            return DDP(net.to(dev), device_ids=[dev.index], bucket_cap_mb=a.bucket_mb)
        return DDP(net, bucket_cap_mb=a.bucket_mb)

    plain = make()  # made before any monitor: DDP's built-in all-reduce, no hooks
    inst = None
    metric, gathered = torch.zeros(4, device=dev), torch.zeros(4 * world, device=dev)
    b = a.batch

    def randn(*shape: int) -> Any:
        return torch.randn(*shape, device=dev)

    data = TensorDataset(randn(b * 40, dim), randn(b * 40, 4))

    def block(model: Any, steps: int) -> tuple[list[float], float, float]:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        part = TensorDataset(*(t[: b * steps] for t in data.tensors))
        walls = []
        p0, c0 = time.process_time(), time.thread_time()
        for x, y in DataLoader(part, batch_size=b):
            t0 = time.perf_counter()
            one_step(model, opt, x, y)
            walls.append(time.perf_counter() - t0)
        return walls, (time.process_time() - p0) / steps, (time.thread_time() - c0) / steps

    def one_step(model: Any, opt: Any, x: Any, y: Any) -> None:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        metric.fill_(float(loss.detach()))
        dist.all_reduce(metric)
        dist.all_gather_single(gathered, metric)
        dist.reduce_scatter_single(metric, gathered)
        if cuda:
            torch.cuda.synchronize()

    rows: list[dict[str, Any]] = []
    if a.mode == "steps":
        # One monitor for the whole run; its hooks are switched off for the other arms.
        # Its background thread's CPU is measured on its own and reported beside. Each
        # instrumented arm has its own model, whose comm hook (or none) follows the
        # bucket-timing setting in force at its first forward.
        mon = runtime.start(job="bench-steps", run=f"bench-steps-{a.hub[-5:]}", hub=a.hub)
        mon.ddp_sample_every = SAMPLE_EVERY
        switch = Installed()
        models = {"bare": plain, "python_hook": make()}
        models["python_hook"].register_comm_hook(None, python_comm_hook)
        for mode in BUCKET_MODES:
            models[mode] = make()
        opts = {k: torch.optim.SGD(m.parameters(), lr=0.001) for k, m in models.items()}
        n = b * (a.warm + a.pairs)
        feed = TensorDataset(randn(n, dim), randn(n, 4))
        batches = {k: iter(DataLoader(feed, batch_size=b)) for k in models}
        rng = random.Random(7)  # the same on every rank: all ranks run the same arm
        pump0, t_start = 0.0, time.perf_counter()
        for i in range(a.warm + a.pairs):
            if i == a.warm:
                pump0, t_start = mon.pump.cpu_s, time.perf_counter()
            order = list(models)
            rng.shuffle(order)
            got = {}
            for arm in order:
                on = arm in BUCKET_MODES
                switch.set(on)
                mon._auto = on
                if on:
                    mon.ddp_buckets = arm
                    # The step hooks take the first optimizer that steps as the step clock:
                    # each arm's own optimizer is the clock during its steps, or only one
                    # arm would pay for step boundaries and the optimizer phase.
                    torch_hooks._state.step_optimizer = id(opts[arm])
                t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
                x, y = next(batches[arm])
                one_step(models[arm], opts[arm], x, y)
                got[arm] = (
                    time.perf_counter() - t0,
                    time.thread_time() - c0,
                    time.process_time() - p0,
                )
            if i >= a.warm:
                rows.append({"pair": i, **got})
        switch.set(True)
        span = time.perf_counter() - t_start
        pump = (mon.pump.cpu_s - pump0) / (len(BUCKET_MODES) * a.pairs)
        st = mon.stats()
        rows.append(
            {
                "pump_cpu": pump,
                "span": span,
                "params": sum(p.numel() for p in plain.parameters()),
                "dropped": st["dropped_batches"] + st["dropped_events"],
                "buckets": len(models["every"].reducer._get_zeros_like_grad_buckets()),
            }
        )
        runtime.close()
    if a.mode == "blocks":
        # Blocks of about ``seconds`` whatever the step time; every rank uses rank 0's count.
        block(plain, 20)
        walls, _, _ = block(plain, 40)
        steps = [max(50, min(5000, int(a.seconds / statistics.median(walls))))]
        dist.broadcast_object_list(steps, src=0)
        steps_n, warm_n = steps[0], max(20, steps[0] // 3)
        n = b * steps_n
        data = TensorDataset(randn(n, dim), randn(n, 4))
    for pair in range(a.pairs if a.mode == "blocks" else 0):
        order = ["bare", "inst"] if random.Random(pair).random() < 0.5 else ["inst", "bare"]
        for arm in order:
            dist.barrier()  # every rank runs the same arm
            mon = None
            model = plain
            if arm == "inst":
                mon = runtime.start(job="bench-ab", run=f"bench-ab-{a.hub[-5:]}-{pair}", hub=a.hub)
                if inst is None:
                    inst = make()  # instrumented by the DDP patch
                else:
                    runtime.instrument(inst)
                model = inst
            block(model, warm_n)  # start-up (hello, manifest, clock burst) settles here
            at = (mon.pump.cpu_s, getattr(mon.pump, "wakes", 0)) if mon else (0.0, 0)
            w0 = time.perf_counter()
            walls, proc, thread = block(model, steps_n)
            span = time.perf_counter() - w0
            row = {
                "pair": pair,
                "arm": arm,
                "steps": steps_n,
                "wall_med": statistics.median(walls),
                "proc": proc,
                "thread": thread,
                "span": span,
            }
            if mon is not None:
                row["pump_cpu"] = (mon.pump.cpu_s - at[0]) / steps_n
                row["wakes_per_s"] = (getattr(mon.pump, "wakes", 0) - at[1]) / span
                st = mon.stats()
                row["dropped"] = st["dropped_batches"] + st["dropped_events"]
                runtime.close()
            rows.append(row)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, rows)
    if rank == 0:
        Path(a.out).write_text(json.dumps(every))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def in_job_ab(nproc: int, pairs: int, hidden: int = 256) -> dict[str, Any]:
    """The tiny DDP job (``examples/tiny_ddp.py``'s loop) under torchrun, each pair a bare
    block and an instrumented block of about ``BLOCK_S`` seconds each, run back to back
    by the same processes in random order.

    Args:
        nproc: ranks.
        pairs: bare/instrumented block pairs.
        hidden: the MLP's hidden width.

    Returns:
        Per-pair ratios (quartiles), the bare arm's medians, the background thread's
        CPU per step and wakes per second, drops, the hub's CPU share and the load.
    """
    from rankscope.hub.server import Hub

    hub = Hub(bind="tcp://127.0.0.1:0").start()
    load_before = load()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    try:
        ranks = _torchrun_worker(
            nproc,
            [
                "--mode=blocks",
                f"--pairs={pairs}",
                f"--hidden={hidden}",
                f"--hub={hub.endpoint}",
            ],
        )
    finally:
        elapsed = time.perf_counter() - t0
        hub_cpu = (time.process_time() - cpu0) / elapsed
        hub.stop()
    ratios: dict[str, list[float]] = {"wall": [], "proc": [], "thread": []}
    bare: dict[str, list[float]] = {"wall": [], "proc": [], "thread": []}
    pump, wakes, dropped = [], [], 0
    for pair in range(pairs):
        arm = {}
        for name in ("bare", "inst"):
            rows = [r for rank in ranks for r in rank if r["pair"] == pair and r["arm"] == name]
            arm[name] = {
                "wall": statistics.mean(r["wall_med"] for r in rows),
                "proc": statistics.mean(r["proc"] for r in rows),
                "thread": statistics.mean(r["thread"] for r in rows),
            }
            if name == "inst":
                pump.append(statistics.mean(r["pump_cpu"] for r in rows))
                wakes.append(statistics.mean(r["wakes_per_s"] for r in rows))
                dropped += sum(r["dropped"] for r in rows)
        for k in ratios:
            ratios[k].append(arm["inst"][k] / arm["bare"][k])
            bare[k].append(arm["bare"][k])
    return {
        "nproc": nproc,
        "hidden": hidden,
        "pairs": pairs,
        "steps": ranks[0][0]["steps"],
        "ratios": {k: quartiles(v) for k, v in ratios.items()},
        "bare": {k: statistics.median(v) for k, v in bare.items()},
        "pump_us_per_step": statistics.median(pump) * 1e6,
        "wakes_per_s": statistics.median(wakes),
        "dropped": dropped,
        "hub_cpu_share": hub_cpu,
        "load": (load_before, load()),
        "elapsed_s": elapsed,
    }


def _torchrun_worker(nproc: int, args: list[str]) -> list[Any]:
    """Run ``_ab_worker`` under torchrun; every rank's rows."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ab.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(Path(__file__).resolve()),
            *args,
            f"--out={out}",
        ]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if not out.exists():
            raise RuntimeError(f"torchrun worker failed ({done.returncode}): {done.stderr[-2000:]}")
        return list(json.loads(out.read_text()))


TINY = {"hidden": 256, "layers": 0, "batch": 8, "bucket_mb": 25.0}
"""``examples/tiny_ddp.py``'s model: MLP 16-256-4, batch 8 (one bucket, ~2-20 ms steps)."""
LARGE = {"hidden": 512, "layers": 8, "batch": 512, "bucket_mb": 1.0}
"""Eight 512x512 layers (2.1 M parameters, 8.4 MB of gradients in ~9 buckets), batch 512:
steps of 100 ms and more, the order of a real GPU job's step."""


def in_job_steps(
    nproc: int, pairs: int, model: dict[str, Any] = TINY, warm: int = 100, device: str = "cpu"
) -> dict[str, Any]:
    """The same job with one monitor running throughout and its hooks switched on and off
    from one step to the next (all ranks alike). Each round runs, in shuffled order, a
    step with DDP's built-in all-reduce, one with a Python comm hook (no rankscope) and
    one instrumented step per bucket-timing setting (``BUCKET_MODES``), so load drift
    cancels round by round. The background thread runs through all arms; its CPU is
    measured on its own.

    Args:
        nproc: ranks.
        pairs: timed rounds.
        model: ``TINY`` or ``LARGE`` (hidden, layers, batch, bucket_mb).
        warm: untimed rounds first.
        device: ``cpu`` (gloo) or ``cuda`` (NCCL, one GPU a rank; steps end synchronized).

    Returns:
        Per arm, quartiles over rounds and ranks of the wall ratio to the built-in step
        of the same round and of the added training-thread and process CPU (µs); the
        bare step's medians; the background thread's CPU per instrumented step; the
        model's parameters and buckets; drops; the load.
    """
    from rankscope.hub.server import Hub

    hub = Hub(bind="tcp://127.0.0.1:0").start()
    load_before = load()
    try:
        ranks = _torchrun_worker(
            nproc,
            [
                "--mode=steps",
                f"--pairs={pairs}",
                f"--warm={warm}",
                f"--hidden={model['hidden']}",
                f"--layers={model['layers']}",
                f"--batch={model['batch']}",
                f"--bucket-mb={model['bucket_mb']}",
                f"--device={device}",
                f"--hub={hub.endpoint}",
            ],
        )
    finally:
        hub.stop()
    arms = ("python_hook", *BUCKET_MODES)
    wall: dict[str, list[float]] = {k: [] for k in arms}
    added_wall: dict[str, list[float]] = {k: [] for k in arms}
    thread: dict[str, list[float]] = {k: [] for k in arms}
    proc: dict[str, list[float]] = {k: [] for k in arms}
    bare_wall, bare_thread, pump = [], [], []
    for rows in ranks:
        for r in rows[:-1]:
            for k in arms:
                wall[k].append(r[k][0] / r["bare"][0])
                added_wall[k].append((r[k][0] - r["bare"][0]) * 1e6)
                thread[k].append((r[k][1] - r["bare"][1]) * 1e6)
                proc[k].append((r[k][2] - r["bare"][2]) * 1e6)
            bare_wall.append(r["bare"][0])
            bare_thread.append(r["bare"][1])
        pump.append(rows[-1]["pump_cpu"] * 1e6)
    last = ranks[0][-1]
    return {
        "nproc": nproc,
        "pairs": pairs,
        "device": device,
        "model": model,
        "params": last["params"],
        "buckets": last["buckets"],
        "dropped": sum(rows[-1]["dropped"] for rows in ranks),
        "wall": {k: quartiles(v) for k, v in wall.items()},
        "added_wall_us": {k: quartiles(v) for k, v in added_wall.items()},
        "thread_us": {k: quartiles(v) for k, v in thread.items()},
        "proc_us": {k: quartiles(v) for k, v in proc.items()},
        "bare_wall_ms": statistics.median(bare_wall) * 1e3,
        "bare_thread_us": statistics.median(bare_thread) * 1e6,
        "pump_us_per_step": statistics.mean(pump),
        "load": (load_before, load()),
    }


# -- 4. zero-code, separate processes ---------------------------------------------------
def _run_job(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Median step wall time and mean process CPU per step of rank 0 (after warm-up)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "t.json"
        subprocess.run(
            [*cmd, f"--timings={out}"], env=env, check=True, capture_output=True, timeout=600
        )
        data = json.loads(out.read_text())
    wall, cpu = data["step_s"][50:], data["cpu_s"][50:]
    return statistics.median(wall), sum(cpu) / len(cpu)


def zero_code_pairs(quick: bool) -> dict[str, Any]:
    """Unmodified ``examples/tiny_ddp.py`` under torchrun, bare vs ``rankscope run``, each
    pair two separate launches in alternating order.

    Args:
        quick: fewer pairs.

    Returns:
        Wall and CPU ratios (quartiles over pairs), steps the hub received, the load.
    """
    from rankscope.hub.server import Hub

    pairs = 2 if quick else 5
    steps = 250
    hub = Hub(bind="tcp://127.0.0.1:0").start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env["OMP_NUM_THREADS"] = "1"
    job = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=4",
        str(SCRIPT),
        f"--steps={steps}",
        "--hidden=256",
    ]
    zero = [sys.executable, "-m", "rankscope", "run", "--hub", hub.endpoint, "--", *job]
    rows = []
    load_before = load()
    try:
        for i in range(pairs):
            order = [("bare", job), ("inst", zero)]
            if i % 2:
                order.reverse()
            got = {name: _run_job(cmd, env) for name, cmd in order}
            rows.append((got["bare"], got["inst"]))
        received = sum(r.steps_complete for r in hub.store.runs())
    finally:
        hub.stop()
    return {
        "pairs": pairs,
        "steps": steps,
        "wall": quartiles([i[0] / b[0] for b, i in rows]),
        "proc": quartiles([i[1] / b[1] for b, i in rows]),
        "received_steps": received,
        "load": (load_before, load()),
    }


def bootstrap_cost(quick: bool) -> tuple[float, float, int]:
    """Process CPU of ``import torch.distributed`` with and without the injected
    ``sitecustomize`` (median over interleaved launches).

    Args:
        quick: fewer launches.

    Returns:
        (ms without, ms with, launches per arm).
    """
    from rankscope.collector.autostart import prepare_site_dir

    site = prepare_site_dir()
    n = 4 if quick else 10
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    zero_env = dict(
        base_env, PYTHONPATH=os.pathsep.join(filter(None, [site, base_env.get("PYTHONPATH")]))
    )
    code = "import torch.distributed, time, resource; r = resource.getrusage(resource.RUSAGE_SELF); print(r.ru_utime + r.ru_stime)"
    got: dict[str, list[float]] = {"bare": [], "zero": []}
    for i in range(n):
        for name in ("bare", "zero") if i % 2 else ("zero", "bare"):
            env = base_env if name == "bare" else zero_env
            out = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True
            )
            got[name].append(float(out.stdout.strip()) * 1e3)
    return statistics.median(got["bare"]), statistics.median(got["zero"]), n


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
