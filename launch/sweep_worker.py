"""One process of a sweep: time the plan's collectives through torch.distributed.

Started by a launcher template (torchrun) once per rank, the way a rerun starts the
training script::

    rankscope run -- torchrun --nproc-per-node=2 .../rankscope/launch/sweep_worker.py \\
        --plan=PATH/sweeps/RUN.plan.json --out=PATH/sweeps/RUN.json

Every rank creates every group of the plan (torch requires all ranks to call
``new_group`` in the same order), then each row — one (group, op, size), or one link of a
pairwise sweep — runs in turn: ``warmup`` untimed operations on the group, a barrier on
the group, ``iters`` timed operations (synchronised with the device on CUDA), nccl-tests
style, then a barrier on the whole world that closes the row. Ranks outside the row's group
only wait in that barrier. The time of a row is the slowest member's mean; rank 0 writes
them (`rankscope.launch.sweep.RESULT_KEYS`).

With gloo the rank binds the interface the parent's rank reported (``GLOO_SOCKET_IFNAME``,
when that interface exists here), so the sweep takes the application's network path. Under
``rankscope run`` the collector reports the sweep as a run of its own (scope ``sweep``,
``parent_run``): one step per row, on every rank (a pairwise row's step is complete
although only its pair works in it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rankscope sweep worker", description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, help="the sweep plan file")
    p.add_argument("--out", required=True, help="result file rank 0 writes")
    p.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with CUDA)")
    return p.parse_args(argv)


def _bind_nic(nic: str) -> None:
    # Only where the parent's interface exists here: another machine's name would make
    # gloo fail to start instead of taking the default route.
    if nic and "GLOO_SOCKET_IFNAME" not in os.environ and Path(f"/sys/class/net/{nic}").exists():
        os.environ["GLOO_SOCKET_IFNAME"] = nic


def main(argv: list[str] | None = None) -> int:
    """Run the plan on this rank; rank 0 writes the result file.

    Returns:
        0, or 2 when the plan does not fit the launched world.
    """
    args = _args(argv)
    from rankscope.launch.sweep import SweepPlan

    plan = SweepPlan.from_dict(json.loads(Path(args.plan).read_text()))
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan.world_size:
        print(f"sweep: launched {world} ranks, the plan has {plan.world_size}", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    backend = args.backend or ("nccl" if cuda else "gloo")
    if backend == "gloo" and rank < len(plan.nics):
        _bind_nic(plan.nics[rank])
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
    dtype = getattr(torch, plan.dtype)
    elem = torch.tensor([], dtype=dtype).element_size()
    index = {p: i for i, p in enumerate(plan.ranks)}
    from rankscope.collector import runtime

    mon = runtime.current()
    # The *_single names are newer spellings of the *_tensor ones.
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    rows: list[tuple[str, str, list[int], int, tuple[Any, Any]]] = []
    # kind, op, members (sweep ranks), nbytes, group
    made: dict[tuple[int, ...], Any] = {}

    def group_of(members: list[int]) -> Any:
        key = tuple(members)
        if key not in made:
            made[key] = dist.new_group(list(key))
        return made[key]

    for t in plan.targets:
        members = [index[r] for r in t.ranks if r in index]
        if len(members) < 2:
            continue
        g = group_of(members)
        rows += [("point", t.op, members, size, (t, g)) for size in t.sizes]
    for a, b in plan.pairs:
        members = [index[a], index[b]]
        g = group_of(members)
        rows += [("pair", plan.pair_op, members, size, ((a, b), g)) for size in plan.pair_sizes]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def one_op(op: str, g: Any, members: list[int], nbytes: int) -> Any:
        n = len(members)
        numel = max(nbytes // elem, n)
        numel -= numel % n if op == "all_to_all" else 0
        x = torch.ones(numel, dtype=dtype, device=device)
        if op == "all_reduce":
            return lambda: dist.all_reduce(x, group=g)
        if op == "all_gather":
            out = torch.empty(numel * n, dtype=dtype, device=device)
            return lambda: gather_single(out, x, group=g)
        if op == "reduce_scatter":
            big = torch.ones(numel * n, dtype=dtype, device=device)
            return lambda: scatter_single(x, big, group=g)
        if op == "broadcast":
            return lambda: dist.broadcast(x, src=members[0], group=g)
        if op == "all_to_all":
            out = torch.empty_like(x)
            return lambda: dist.all_to_all_single(out, x, group=g)
        raise ValueError(f"sweep cannot repeat {op!r}")

    times = torch.zeros(len(rows), dtype=torch.float64)
    dist.barrier()
    for k, (_, op, members, nbytes, (_, g)) in enumerate(rows):
        # Every rank marks every row as a step, which the world barrier closes: a row of a
        # pairwise sweep, where two ranks work and the others wait, is still a complete
        # step of the sweep run in the hub, and its step time is the same on every rank.
        if mon is not None:
            mon.begin_step(k)
        if rank in members:
            run = one_op(op, g, members, nbytes)
            for _ in range(plan.warmup):
                run()
            sync()
            dist.barrier(group=g)
            means = []
            for _ in range(max(plan.repeats, 1)):
                t0 = time.perf_counter_ns()
                for _ in range(plan.iters):
                    run()
                sync()
                means.append((time.perf_counter_ns() - t0) / plan.iters)
            times[k] = float(statistics.median(means))
        dist.barrier()
        if mon is not None:
            mon.end_step()
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if rank == 0:
        points, pairs = [], []
        for k, (kind, op, members, nbytes, (what, _)) in enumerate(rows):
            if kind == "point":
                points.append(
                    {
                        "group": what.group,
                        "op": op,
                        "nbytes": nbytes,
                        "n": len(members),
                        "time_ns": float(times[k]),
                    }
                )
            else:
                pairs.append(
                    {"pair": list(what), "op": op, "nbytes": nbytes, "time_ns": float(times[k])}
                )
        out = {
            "plan": plan.to_dict(),
            "backend": backend,
            "points": points,
            "pairs": pairs,
            "iters": plan.iters,
            "warmup": plan.warmup,
        }
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=2) + "\n")
        os.replace(tmp, args.out)
    if mon is not None:
        mon.close()
    dist.barrier()
    made.clear()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
