"""A small torch job with one real fault at a time, for diagnosis end to end.

Run it with torchrun (gloo, CPU, one thread per rank), usually through
``examples/faultcases.py``, which also makes the faults that live outside the process
(a CPU quota, a busy neighbour on a shared core):

    RANKSCOPE_HUB=tcp://127.0.0.1:5555 torchrun --standalone --nproc_per_node=2 \\
        examples/faultjobs.py --rankscope --steps 24 --fault gap --fault-rank 1

Every step is the data loader (``input``), ``forward``, ``backward`` and ``optimizer``;
with ``--rankscope`` the collector records all four on its own (DDP hooks, autograd, the
optimizer hooks), and the pipeline marks its phases and its ``pp_wait`` itself. Faults:

- ``gap``: rank R spends ``--gap-ms`` after its optimizer step in host code outside any
  phase (``--gap-kind sleep``: off the CPU, ``busy``: spinning in Python), so the others
  wait for it at the next gradient all-reduce.
- ``throttle``: rank R's process runs under a CPU quota (``--throttle-cgroup DIR``: it
  joins that cgroup, whose quota the caller set) or on a core that a busy process shares
  (``--throttle-core C``: it pins itself there). Either way its phases take longer in wall
  time for the same CPU work.
- ``gc``: rank R holds ``--gc-objects`` live lists and runs a full ``gc.collect()`` before
  the forward pass of every ``--gc-every``-th step; each collection walks them all.
- ``pipeline``: two stages (rank = stage, mesh ``pp``) with explicit ``send``/``recv`` of
  activations and gradients over ``--microbatches`` microbatches (GPipe order); stage R
  has ``--heavy-layers`` layers, the other ``--light-layers``. Blocking receives are
  recorded as ``pp_wait``.
- ``warmup``: a healthy job whose first ``--warmup-steps`` steps run ``--warmup-ms`` more
  compute in every rank's forward pass (as compilation or allocator warm-up would).
- ``data``: the data shard numbered R holds ``--shard-scale`` times as many samples per
  batch (as a shard of longer documents would), so whichever rank reads it does that much
  more forward and backward work and the others wait for it.
- ``input``: rank R's data loader waits ``--input-ms`` for each batch (slow storage or
  decoding), inside the loader's ``next()``, which the collector times as ``input``.
- ``slow``: rank R's forward pass runs ``--slow-ms`` longer every step, as on a slower
  device: ``--slow-kind busy`` computes (a slower processor), ``--slow-kind sleep`` blocks
  the thread (a host thread waiting on a slower accelerator, or on a blocking call).
- ``none``: the healthy job.

Data shards: rank r reads shard ``rankscope.shard_of(r)``, which is r itself unless the run
swaps two ranks' shards (``RANKSCOPE_SWAP_SHARDS=R1,R2``, set by ``rankscope rerun
--swap-shards R1,R2``). Shard s is ``--batch`` random samples per step from a generator
seeded by s, and the ``data`` fault belongs to a shard, not a rank: after a swap of the
slow rank with a peer, the peer is slow (``rankscope experiment swap`` says "follows the
shard"). The ``throttle`` fault belongs to the process, and stays.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn  # before init_process_group: see the end of main
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset, default_collate

from rankscope.collector.shards import shard_of

FAULTS = ("none", "gap", "throttle", "gc", "pipeline", "warmup", "data", "input", "slow")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="faultjobs.py", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=3, help="hidden layers (DDP job)")
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--fault-rank", type=int, default=1, help="the rank (or stage) at fault")
    p.add_argument("--gap-ms", type=float, default=25.0)
    p.add_argument("--gap-kind", choices=("sleep", "busy"), default="sleep")
    p.add_argument("--slow-ms", type=float, default=15.0)
    p.add_argument("--slow-kind", choices=("busy", "sleep"), default="busy")
    p.add_argument("--throttle-cgroup", default="", help="cgroup directory rank R joins")
    p.add_argument("--throttle-core", type=int, default=-1, help="core rank R pins itself to")
    p.add_argument("--gc-every", type=int, default=4)
    p.add_argument("--gc-objects", type=int, default=800_000)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--heavy-layers", type=int, default=6)
    p.add_argument("--light-layers", type=int, default=1)
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--warmup-ms", type=float, default=100.0)
    p.add_argument(
        "--shard-scale", type=float, default=3.0, help="samples per batch of the data fault's shard"
    )
    p.add_argument(
        "--input-ms", type=float, default=20.0, help="wait per batch of the input fault's loader"
    )
    p.add_argument("--rankscope", action="store_true", help="instrument with the explicit API")
    p.add_argument("--job", default="faultjobs")
    p.add_argument("--log-every", type=int, default=0)
    return p.parse_args(argv)


def busy(ms: float, x: torch.Tensor | None = None) -> None:
    """Spin on the CPU for ``ms`` of wall time: matmuls on ``x``, else Python."""
    end = time.perf_counter() + ms / 1000.0
    while time.perf_counter() < end:
        if x is not None:
            x = torch.tanh(x @ x.T @ x / x.shape[1])
        else:
            sum(range(1000))


class Stack(nn.Module):
    """``layers`` Linear+ReLU blocks; ``extra_ms`` of matmuls in the forward while set."""

    def __init__(self, width: int, layers: int, out: int | None = None) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks += [nn.Linear(width, width), nn.ReLU()]
        if out is not None:
            blocks.append(nn.Linear(width, out))
        self.body = nn.Sequential(*blocks)
        self.extra_ms = 0.0
        self.blocked_ms = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.extra_ms:
            with torch.no_grad():
                busy(self.extra_ms, x[:32].detach().clone())
        if self.blocked_ms:
            time.sleep(self.blocked_ms / 1000.0)
        return self.body(x)


def join_throttle(args: argparse.Namespace, rank: int) -> None:
    """Put this process under the quota or on the shared core, before any thread starts."""
    if args.fault != "throttle" or rank != args.fault_rank:
        return
    if args.throttle_cgroup:
        # cgroup.procs moves every thread of the process (v1 and v2).
        Path(args.throttle_cgroup, "cgroup.procs").write_text(str(os.getpid()))
    elif args.throttle_core >= 0:
        # Threads started later (gloo's, the collector's) inherit the affinity.
        os.sched_setaffinity(0, {args.throttle_core})
    else:
        raise SystemExit("--fault throttle needs --throttle-cgroup or --throttle-core")


def start_monitor(args: argparse.Namespace, rank: int, world: int, shard: int):
    if not args.rankscope:
        return None
    import rankscope

    cfg = {
        "model": f"mlp-{args.hidden}x{args.layers}",
        "micro_batch": args.batch,
        "global_batch": args.batch * world,
        "precision": "fp32",
        "fault": args.fault,
    }
    mesh = None
    if args.fault == "pipeline":
        cfg["model"] = f"pp2-mlp-{args.hidden}"
        cfg["global_batch"] = args.batch
        cfg["micro_batch"] = args.batch // args.microbatches
        cfg["microbatches"] = args.microbatches
        mesh = {"pp": rank}
    # The shard read is part of the rank's identity (as the simulated cluster records it);
    # under `rankscope run` the monitor started already and keeps its own identity, but the
    # swap is in the manifest either way (its env records RANKSCOPE_SWAP_SHARDS).
    return rankscope.start(job=args.job, job_config=cfg, mesh=mesh, shard=shard)


class _NoPhase:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _phase(mon, name: str):
    return mon.phase(name) if mon is not None else _NoPhase()


def shard_rows(args: argparse.Namespace, shard: int) -> int:
    """Samples per batch of one data shard: ``--batch``, scaled for the data fault's shard."""
    if args.fault == "data" and shard == args.fault_rank:
        return max(1, round(args.batch * args.shard_scale))
    return args.batch


def train_ddp(args: argparse.Namespace, mon, rank: int, world: int, shard: int) -> None:
    model = Stack(args.hidden, args.layers, out=16)
    ddp = DDP(model)
    if mon is not None:
        import rankscope

        rankscope.instrument(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    # This rank's data shard: its own, or its swap partner's (RANKSCOPE_SWAP_SHARDS).
    rows = shard_rows(args, shard)
    n = rows * (args.steps + 1)
    g = torch.Generator().manual_seed(shard)
    data = TensorDataset(torch.randn(n, args.hidden, generator=g), torch.randn(n, 16, generator=g))
    at_fault = rank == args.fault_rank
    collate = default_collate
    if args.fault == "input" and at_fault:

        def collate(batch: list) -> Any:
            # A loader waiting on slow storage or decoding, inside the DataLoader's next().
            time.sleep(args.input_ms / 1000.0)
            return default_collate(batch)

    it = iter(DataLoader(data, batch_size=rows, shuffle=False, collate_fn=collate))
    live: list[list[int]] = []
    if args.fault == "gc" and at_fault:
        # What the setup allocated (torch's and DDP's ~300k objects) is frozen out of the
        # collections, so their length is set by the live containers made here, which every
        # full collection has to walk.
        gc.freeze()
        live = [[i] for i in range(args.gc_objects)]
    for step in range(args.steps):
        t0 = time.perf_counter()
        if mon is not None:
            mon.begin_step(step)
        model.extra_ms = (
            args.warmup_ms if args.fault == "warmup" and step < args.warmup_steps else 0.0
        )
        if args.fault == "slow" and at_fault:
            if args.slow_kind == "busy":
                model.extra_ms = args.slow_ms
            else:
                model.blocked_ms = args.slow_ms
        x, y = next(it)
        if live and step % args.gc_every == args.gc_every - 1:
            gc.collect()
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.fault == "gap" and at_fault:
            # Host work between the optimizer and the next step, in no phase.
            if args.gap_kind == "sleep":
                time.sleep(args.gap_ms / 1000.0)
            else:
                busy(args.gap_ms)
        if mon is not None:
            mon.work(tokens=x.shape[0], valid_tokens=x.shape[0], samples=x.shape[0])
            mon.end_step()
        if rank == 0 and args.log_every and (step + 1) % args.log_every == 0:
            print(f"step {step + 1} {1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
    del live, ddp


def train_pipeline(args: argparse.Namespace, mon, rank: int, world: int) -> None:
    if world != 2:
        raise SystemExit("--fault pipeline runs two stages on two ranks")
    stage = rank
    layers = args.heavy_layers if stage == args.fault_rank else args.light_layers
    model = Stack(args.hidden, layers, out=16 if stage == 1 else None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    peer = 1 - stage
    mb = args.batch // args.microbatches
    g = torch.Generator().manual_seed(0)  # both stages draw the same batches
    for step in range(args.steps):
        t0 = time.perf_counter()
        if mon is not None:
            mon.begin_step(step)
        x = torch.randn(args.batch, args.hidden, generator=g)
        y = torch.randn(args.batch, 16, generator=g)
        sends = []
        if stage == 0:
            acts = []
            for m in range(args.microbatches):
                with _phase(mon, "forward"):
                    a = model(x[m * mb : (m + 1) * mb])
                send = a.detach().contiguous()
                sends.append((dist.isend(send, peer), send))
                acts.append(a)
            for m in range(args.microbatches):
                grad = torch.empty(mb, args.hidden)
                with _phase(mon, "pp_wait"):
                    dist.recv(grad, peer)
                with _phase(mon, "backward"):
                    acts[m].backward(grad)
        else:
            for m in range(args.microbatches):
                a = torch.empty(mb, args.hidden)
                with _phase(mon, "pp_wait"):
                    dist.recv(a, peer)
                a.requires_grad_(True)
                with _phase(mon, "forward"):
                    loss = nn.functional.mse_loss(model(a), y[m * mb : (m + 1) * mb])
                with _phase(mon, "backward"):
                    loss.backward()
                sends.append((dist.isend(a.grad, peer), a.grad))
        with _phase(mon, "pp_wait"):
            for work, _ in sends:
                work.wait()
        opt.step()
        opt.zero_grad()
        if mon is not None:
            mon.work(tokens=args.batch, valid_tokens=args.batch, samples=args.batch)
            mon.end_step()
        if rank == 0 and args.log_every and (step + 1) % args.log_every == 0:
            print(f"step {step + 1} {1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        shard = shard_of(rank, int(os.environ.get("WORLD_SIZE", "0")) or None)
    except ValueError as exc:  # a malformed swap: stop rather than run unswapped
        raise SystemExit(f"faultjobs.py: {exc}") from None
    join_throttle(args, rank)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mon = start_monitor(args, rank, world, shard)
    if args.fault == "pipeline":
        train_pipeline(args, mon, rank, world)
    else:
        train_ddp(args, mon, rank, world, shard)
    if mon is not None:
        mon.close()  # before the barrier, which would open a step of its own
    dist.barrier()
    # End gloo's worker threads before the interpreter finalises (see tiny_ddp.py): the
    # DDP model was freed when its train function returned, now the group goes.
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
