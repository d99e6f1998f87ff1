"""A torchtitan-style training script: named device mesh, FSDP2, tensor and pipeline
parallelism on a small transformer, written with no rankscope call at all.

Run it under ``rankscope run`` and the collector sees it anyway (zero-code)::

    rankscope hub --record /tmp/rec &
    rankscope run --hub tcp://127.0.0.1:5555 --job titan -- \\
        torchrun --standalone --nproc_per_node=4 examples/titan_like.py --pp 2 --dp 2

The mesh is built the way torch's documentation builds it (``init_device_mesh`` imported
at the top, dimensions ``("pp", "dp", "tp")``); each pipeline stage holds a slice of the
blocks (``--heavy-stage S --heavy-factor F`` gives stage S F times the blocks of the
others, an uneven layer split); the stage's blocks are TP-parallelised over ``tp``
(colwise/rowwise MLP) and FSDP2-sharded over ``dp``; the stages run a
``torch.distributed.pipelining`` schedule (``--schedule gpipe|1f1b|interleaved``).
The default split is balanced: the embedding (stage 0) costs next to nothing, and the
loss head (last stage, d x vocab multiply-adds a token against about 10 d^2 a block) is
kept small by the default vocabulary of 32 (about 3 % of a two-block stage's
multiply-adds); with ``--vocab 128`` the head stage does up to 1.1x the first's work.
Gloo on CPU, one thread per rank. Arguments ``--job``, ``--steps``, ``--log-every`` and
``--rankscope`` follow the other example workloads (``--rankscope`` is accepted and
ignored: this script is only ever instrumented from outside).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class Block(nn.Module):
    """Pre-norm residual MLP block with a token-mixing layer (attention's cost without
    its variable-length bookkeeping: the point here is the layout, not the model)."""

    def __init__(self, d: int, ratio: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, ratio * d)
        self.down = nn.Linear(ratio * d, d)
        self.mix = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        h = h + torch.softmax(h @ self.mix(h).transpose(-1, -2) / h.shape[-1] ** 0.5, -1) @ h
        return x + self.down(torch.relu(self.up(h)))


class StageModel(nn.Module):
    """One pipeline stage's part of the model: embedding on the first, head on the last."""

    def __init__(self, vocab: int, d: int, n_blocks: int, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d) if first else None
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.head = nn.Linear(d, vocab) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x) if self.head is not None else x


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (mesh dim pp)")
    p.add_argument("--dp", type=int, default=2, help="FSDP2 data-parallel ranks (mesh dim dp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (mesh dim tp)")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="sequences per dp rank and step")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32, help="tokens (the head's size)")
    p.add_argument("--blocks", type=int, default=2, help="blocks per (virtual) stage")
    p.add_argument("--heavy-stage", type=int, default=-1, help="stage given more blocks")
    p.add_argument("--heavy-factor", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="torch.compile each stage's blocks")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--job", default="titan-like")
    p.add_argument("--log-every", type=int, default=0)
    p.add_argument("--rankscope", action="store_true", help="accepted; capture is zero-code")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.pp * args.dp * args.tp != world:
        raise SystemExit(f"pp {args.pp} x dp {args.dp} x tp {args.tp} != world size {world}")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (args.pp, args.dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank = mesh["pp"].get_local_rank()
    per_rank = 2 if args.schedule == "interleaved" else 1
    n_stages = args.pp * per_rank
    stage_ids = [pp_rank + k * args.pp for k in range(per_rank)]
    stages, params = [], []
    for s in stage_ids:
        n = args.blocks * (args.heavy_factor if s == args.heavy_stage else 1)
        model = StageModel(args.vocab, args.d_model, n, s == 0, s == n_stages - 1)
        if args.tp > 1:
            for b in model.blocks:
                parallelize_module(
                    b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()}
                )
        for b in model.blocks:
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        if args.compile:
            for b in model.blocks:
                b.compile()
        stages.append(
            PipelineStage(model, s, n_stages, torch.device("cpu"), group=mesh["pp"].get_group())
        )
        params += list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())

    if args.schedule == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, args.microbatches, loss_fn=loss_fn)
    else:
        cls = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
        schedule = cls(stages[0], args.microbatches, loss_fn=loss_fn)
    dp_rank = mesh["dp"].get_local_rank()
    g = torch.Generator().manual_seed(1000 + dp_rank)  # one data shard per dp rank
    first, last = 0 in stage_ids, n_stages - 1 in stage_ids
    for step in range(args.steps):
        t0 = time.perf_counter()
        x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        if first and last:
            schedule.step(x, target=y)
        elif first:
            schedule.step(x)
        elif last:
            schedule.step(target=y)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0 and args.log_every and (step + 1) % args.log_every == 0:
            print(f"step {step + 1} {1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
