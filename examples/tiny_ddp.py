"""A tiny DDP training job on gloo, with explicit collectives and an optional straggler.

Run it under torchrun, unmodified under ``rankscope run`` (zero-code) or with the explicit
API::

    rankscope run --hub tcp://127.0.0.1:5555 -- \\
        torchrun --nproc_per_node=4 examples/tiny_ddp.py --steps 20 --delay-rank 2 --delay-ms 40
    torchrun --nproc_per_node=4 examples/tiny_ddp.py --rankscope explicit --steps 20

``--delay-rank R --delay-ms D`` makes rank R sleep D ms before each of its collectives
(before the forward pass for the DDP gradient bucket, and before each explicit
collective), so R arrives last at every collective by about D: a known straggler for
tests to find. The explicit collectives (all-reduce, all-gather, reduce-scatter) all
synchronize every rank, so the lateness does not carry over from one to the next. ``--rankscope off`` (the default) leaves the script unmodified.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.nn  # before init_process_group: see the end of main
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--delay-rank", type=int, default=-1, help="rank that arrives late")
    p.add_argument("--delay-ms", type=float, default=0.0, help="its delay per collective")
    p.add_argument("--explicit-colls", type=int, default=3, help="explicit collectives per step")
    p.add_argument(
        "--step-sleep-ms", type=float, default=0.0, help="extra work per step, all ranks"
    )
    p.add_argument(
        "--rankscope",
        choices=("off", "explicit"),
        default="off",
        help="explicit: call rankscope.start/instrument/step; off: unmodified script",
    )
    p.add_argument(
        "--quiet-exit",
        action="store_true",
        help="end with the process group's own barrier, which rankscope does not see "
        "(with --explicit-colls 0, a run whose program issues no collective at all)",
    )
    p.add_argument(
        "--compile", action="store_true", help="torch.compile the DDP model (after instrument)"
    )
    p.add_argument("--job", default="tiny_ddp")
    p.add_argument(
        "--timings", default="", help="write rank 0's per-step wall and CPU times to this JSON"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    mon = None
    if args.rankscope == "explicit":
        import rankscope

        mon = rankscope.start(
            job=args.job,
            job_config={
                "model": f"mlp-{args.hidden}",
                "micro_batch": args.batch,
                "global_batch": args.batch * world,
                "precision": "fp32",
            },
        )

    model = nn.Sequential(nn.Linear(16, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 4))
    ddp = DDP(model)
    if mon is not None:
        import rankscope

        rankscope.instrument(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    net = torch.compile(ddp) if args.compile else ddp
    n = args.batch * (args.steps + 1)
    data = TensorDataset(torch.randn(n, 16), torch.randn(n, 4))
    loader = DataLoader(data, batch_size=args.batch, shuffle=False)
    it = iter(loader)
    delay_s = args.delay_ms / 1000.0 if rank == args.delay_rank else 0.0
    metric = torch.zeros(4)
    gathered = torch.zeros(4 * world)
    step_times = []
    step_cpu = []  # process CPU time (all threads: training, gloo, rankscope) per step
    # The *_single names are newer spellings of all_gather_into_tensor/reduce_scatter_tensor.
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter_single = (
        getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    )

    for step in range(args.steps):
        t0 = time.perf_counter()
        c0 = time.process_time()
        if mon is not None:
            mon.begin_step(step)
        x, y = next(it)
        if delay_s:
            time.sleep(delay_s)
        if args.step_sleep_ms:
            time.sleep(args.step_sleep_ms / 1000.0)
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()  # the gradient bucket all-reduce
        opt.step()
        if mon is not None:
            mon.work(tokens=x.numel(), valid_tokens=x.numel(), samples=x.shape[0])
        metric.fill_(float(loss.detach()))
        for k in range(args.explicit_colls):
            if delay_s:
                time.sleep(delay_s)
            if k % 3 == 0:
                dist.all_reduce(metric)
            elif k % 3 == 1:
                all_gather_single(gathered, metric)
            else:
                reduce_scatter_single(metric, gathered)
        if mon is not None:
            mon.end_step()
        step_times.append(time.perf_counter() - t0)
        step_cpu.append(time.process_time() - c0)

    if rank == 0 and args.timings:
        out = {"step_s": step_times, "cpu_s": step_cpu}
        if args.compile:  # frames torch.compile compiled: the model did run compiled
            out["compiled_frames"] = int(torch._dynamo.utils.counters["frames"]["ok"])
        with open(args.timings, "w") as f:
            json.dump(out, f)
    if mon is not None:
        mon.close()
    if args.quiet_exit:
        dist.group.WORLD.barrier().wait()
    else:
        dist.barrier()
    # End gloo's worker threads before interpreter exit: one that frees a tensor after the
    # interpreter has begun to finalise aborts the process ("terminate called without an
    # active exception"). destroy_process_group joins them if it drops the last reference
    # to the group. torch.distributed.nn, which DDP imports, binds group.WORLD into default
    # arguments, so it is imported at the top, before the group exists; DDP's reducer
    # holds the group and would free it with the GIL held, which deadlocks with a worker
    # waiting for the GIL, so the model goes first.
    del ddp
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
