"""Train a small GPT on packed variable-length sequences, with faults to diagnose.

Run it with torchrun (gloo on CPU, NCCL when CUDA is present):

    torchrun --nproc_per_node=2 examples/gpt_packing.py --steps 40 --packer attn

Instrumented without touching the code, with a hub running (``rankscope hub --record
/tmp/rec``, or ``rankscope watch`` for the live view):

    rankscope run --hub tcp://127.0.0.1:5555 -- torchrun --nproc_per_node=2 \\
        examples/gpt_packing.py --steps 40

or with the explicit API (phases and per-step work, including Σ seq² as ``attn_cost``):

    RANKSCOPE_HUB=tcp://127.0.0.1:5555 torchrun --nproc_per_node=2 \\
        examples/gpt_packing.py --rankscope --steps 40

Fault knobs, one per incident of the README:

- ``--packer token``: token-balanced packing; tokens per rank stay equal, Σ seq² does not.
- ``--slow-rank R --slow-ms X``: rank R runs X ms of extra matmuls in every forward pass.
- ``--seq-scale S`` / ``--pad P``: longer sequences / padding to a multiple of P: more work
  per step under the same model name (a numerator change, not a systems loss).
- ``--grad-sync hier``: gradients reduced inside each node, then across nodes, through
  explicit collectives, so intra-node and cross-node groups can be told apart.

Rank r reads the packed buffer of ``rankscope.shard_of(r)``: its own, unless the run swaps
two ranks' shards (``RANKSCOPE_SWAP_SHARDS=R1,R2``, from ``rankscope rerun --swap-shards``).
The packing is a property of the data (it follows the swap); ``--slow-rank`` is a property
of the rank (it stays).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn  # before init_process_group: see the end of train

sys.path.insert(0, str(Path(__file__).resolve().parent))

from seqpack import PACKERS, LengthDist, global_batch, pack, pad_lengths, rank_batch
from tinygpt import ATTENTION, ExtraCompute, GPTConfig, TinyGPT, linear_weight
from workload_probe import Probe, make_probe

GRAD_SYNC = ("ddp", "fsdp", "hier")


def build_parser() -> argparse.ArgumentParser:
    """The example's command line (also used by tests to check the job config)."""
    ap = argparse.ArgumentParser(
        prog="gpt_packing.py",
        description="Small GPT with sequence packing, DDP/FSDP2, and fault knobs.",
    )
    m = ap.add_argument_group("model")
    m.add_argument("--model-name", default="tinygpt-64x2")
    m.add_argument("--d-model", type=int, default=64)
    m.add_argument("--n-layer", type=int, default=2)
    m.add_argument("--n-head", type=int, default=4)
    m.add_argument("--vocab", type=int, default=256)
    m.add_argument("--attn", choices=ATTENTION, default="math")
    d = ap.add_argument_group("data")
    d.add_argument(
        "--tokens-per-rank",
        type=int,
        default=2048,
        help="valid tokens per rank per step; the global batch is this × world size",
    )
    d.add_argument("--global-tokens", type=int, default=0, help="fix the global batch instead")
    d.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps")
    d.add_argument("--len-median", type=float, default=64.0)
    d.add_argument("--len-sigma", type=float, default=1.5)
    d.add_argument("--len-min", type=int, default=16)
    d.add_argument("--len-max", type=int, default=1024)
    d.add_argument("--seq-scale", type=float, default=1.0, help="multiply every length by S")
    d.add_argument("--pad", type=int, default=0, help="pad sequences to a multiple of P")
    d.add_argument("--packer", choices=PACKERS, default="attn")
    t = ap.add_argument_group("training")
    t.add_argument("--steps", type=int, default=40)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    t.add_argument("--grad-sync", choices=GRAD_SYNC, default="ddp")
    t.add_argument(
        "--bucket-mb", type=float, default=25.0, help="DDP / hier bucket size (torch default)"
    )
    t.add_argument("--ckpt-every", type=int, default=0, help="save every N steps (0: never)")
    t.add_argument("--ckpt-dir", default="")
    t.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    t.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    t.add_argument(
        "--rail-ifnames",
        default="",
        help="comma-separated network interfaces; local rank i binds gloo to entry i "
        "(a rail-optimised fabric: each local rank has its own NIC and rail)",
    )
    f = ap.add_argument_group("faults")
    f.add_argument("--slow-rank", type=int, default=-1)
    f.add_argument("--slow-ms", type=float, default=0.0)
    o = ap.add_argument_group("observation")
    o.add_argument("--rankscope", action="store_true", help="use the explicit rankscope API")
    o.add_argument("--job", default="gpt-packing", help="job name reported to rankscope")
    o.add_argument("--profile", action="store_true", help="record the steps with torch.profiler")
    o.add_argument(
        "--profile-blocks",
        type=int,
        default=0,
        help="with --profile, record only alternate blocks of this many steps (off, on, on, "
        "off, ...), so one process measures its own steps with and without the profiler",
    )
    o.add_argument("--timings", default="", help="write each rank's step times to DIR/rankN.json")
    o.add_argument("--log-every", type=int, default=10)
    return ap


def check_args(args: argparse.Namespace, world: int) -> None:
    """Reject settings that cannot run, naming the flag."""
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    if args.tokens_per_rank < 1 and args.global_tokens < 1:
        raise SystemExit("--tokens-per-rank or --global-tokens must be >= 1")
    if args.micro_batches < 1:
        raise SystemExit(f"--micro-batches must be >= 1, got {args.micro_batches}")
    if args.slow_rank >= world:
        raise SystemExit(f"--slow-rank {args.slow_rank} is outside world size {world}")
    if args.slow_ms < 0:
        raise SystemExit(f"--slow-ms must be >= 0, got {args.slow_ms}")
    if args.ckpt_every and not args.ckpt_dir:
        raise SystemExit("--ckpt-every needs --ckpt-dir")
    if args.profile_blocks < 0 or (args.profile_blocks and not args.profile):
        raise SystemExit(f"--profile-blocks needs --profile and >= 0, got {args.profile_blocks}")


def profiled_step(step: int, block: int) -> bool:
    """Whether a step runs under the profiler with ``--profile-blocks``: blocks in the order
    off, on, on, off (repeated), so a drift in machine speed hits both arms alike."""
    return (step // block) % 4 in (1, 2)


def model_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        name=args.model_name,
        vocab=args.vocab,
        d_model=args.d_model,
        n_layer=args.n_layer,
        n_head=args.n_head,
        attn=args.attn,
    )


def length_dist(args: argparse.Namespace) -> LengthDist:
    return LengthDist(
        median=args.len_median,
        sigma=args.len_sigma,
        min_len=args.len_min,
        max_len=args.len_max,
        scale=args.seq_scale,
    )


def job_config(args: argparse.Namespace, world: int) -> dict[str, Any]:
    """What the run is, for the manifest: model, batch, sequence distribution, packer,
    precision and checkpoint policy. Faults are included so a manifest diff shows them."""
    cfg = model_config(args)
    dist_ = length_dist(args)
    return {
        "model": cfg.name,
        "d_model": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "vocab": cfg.vocab,
        "attention": cfg.attn,
        "batch_unit": "tokens",
        "global_batch": global_tokens(args, world),
        "grad_accum": args.micro_batches,
        "micro_batch": global_tokens(args, world) // (world * args.micro_batches),
        "seq_len": {
            "dist": "lognormal",
            "median": dist_.median * dist_.scale,
            "sigma": dist_.sigma,
            "min": dist_.lo,
            "max": dist_.hi,
            "pad_multiple": max(args.pad, 1),
        },
        "packer": args.packer,
        "precision": args.precision,
        "grad_sync": args.grad_sync,
        "checkpoint_every": args.ckpt_every,
        "seed": args.seed,
        "fault": {"slow_rank": args.slow_rank, "slow_ms": args.slow_ms},
    }


def global_tokens(args: argparse.Namespace, world: int) -> int:
    return args.global_tokens if args.global_tokens > 0 else args.tokens_per_rank * world


class PackedBatches(torch.utils.data.IterableDataset):
    """Yields this rank's packed micro-batches, step after step (a real DataLoader source,
    so input waits are where a monitor expects them)."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int) -> None:
        self.args = args
        self.rank = rank
        self.world = world
        self.dist = length_dist(args)
        self.lin_w = linear_weight(model_config(args))

    def __iter__(self) -> Iterator[list[Any]]:
        a = self.args
        per_micro = global_tokens(a, self.world) // a.micro_batches
        for step in range(a.steps):
            micro = []
            for mb in range(a.micro_batches):
                key = step * a.micro_batches + mb
                valid = global_batch(self.dist, per_micro, a.seed, key)
                executed = pad_lengths(valid, a.pad)
                owner = pack(a.packer, executed, self.world, a.seed, key, self.lin_w)
                micro.append(rank_batch(valid, executed, owner, self.rank, a.vocab, a.seed, key))
            yield micro


def init_distributed(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if "RANK" not in os.environ:
        # Plain `python gpt_packing.py`: a world of one, still through a process group.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.rail_ifnames:
        names = [n for n in args.rail_ifnames.split(",") if n]
        if not names:
            raise SystemExit(f"--rail-ifnames {args.rail_ifnames!r} names no interface")
        os.environ["GLOO_SOCKET_IFNAME"] = names[local_rank % len(names)]
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def node_groups(world: int) -> tuple[Any, Any]:
    """(intra-node group, cross-node group) of this rank, from torchrun's local world size."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local:
        raise SystemExit(f"world size {world} is not a multiple of local world size {local}")
    rank = dist.get_rank()
    intra = cross = None
    # Every rank creates every group, in the same order; the names ("intra0", "cross1")
    # tell a monitor which kind of group each is.
    for n in range(world // local):
        members = list(range(n * local, (n + 1) * local))
        g = dist.new_group(members, group_desc=f"intra{n}")
        intra = g if rank in members else intra
    for lr in range(local):
        members = list(range(lr, world, local))
        g = dist.new_group(members, group_desc=f"cross{lr}")
        cross = g if rank in members else cross
    return intra, cross


def grad_buckets(model: torch.nn.Module, bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Parameters in reverse order (as gradients become ready), cut into buckets."""
    buckets: list[list[torch.nn.Parameter]] = [[]]
    size = 0
    for p in reversed(list(model.parameters())):
        nbytes = p.numel() * p.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


def hierarchical_sync(buckets: list[list[torch.nn.Parameter]], intra: Any, cross: Any) -> None:
    """Average gradients: sum inside the node, then across nodes between same local ranks."""
    world = dist.get_world_size()
    for bucket in buckets:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat, group=intra)
        dist.all_reduce(flat, group=cross)
        flat /= world
        off = 0
        for p in bucket:
            n = p.numel()
            p.grad.copy_(flat[off : off + n].view_as(p.grad))
            off += n


def wrap_model(
    args: argparse.Namespace, model: torch.nn.Module, device: torch.device
) -> torch.nn.Module:
    if args.grad_sync == "ddp" and dist.get_world_size() > 1:
        return torch.nn.parallel.DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=args.bucket_mb,
        )
    if args.grad_sync == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block)
        fully_shard(model)
    return model


def train(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    rank, world, device = init_distributed(args)
    check_args(args, world)
    probe: Probe = make_probe(args.rankscope, args.job, job_config(args, world))
    torch.manual_seed(args.seed)
    cfg = model_config(args)
    slow = ExtraCompute(args.slow_ms) if rank == args.slow_rank else None
    base = TinyGPT(cfg, slow=slow).to(device)
    intra = cross = None
    if args.grad_sync == "hier":
        intra, cross = node_groups(world)
        for p in base.parameters():
            dist.broadcast(p.data, src=0)
    model = probe.instrument(wrap_model(args, base, device))
    buckets = grad_buckets(base, int(args.bucket_mb * 2**20))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if args.precision == "bf16"
        else contextlib.nullcontext()
    )
    # The packed buffer this rank reads: its own, or its swap partner's under a shard swap
    # (RANKSCOPE_SWAP_SHARDS, set by `rankscope rerun --swap-shards R1,R2`).
    from rankscope.collector.shards import shard_of

    try:
        shard = shard_of(rank, world)
    except ValueError as exc:
        raise SystemExit(f"gpt_packing.py: {exc}") from None
    loader = torch.utils.data.DataLoader(
        PackedBatches(args, shard, world), batch_size=None, num_workers=0
    )
    profiler = None
    if args.profile and not args.profile_blocks:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.__enter__()
    profiled = np.zeros(args.steps, dtype=bool)
    # Closing a profiler builds its event tree: timed apart from the steps.
    close_ns: list[int] = []
    step_ns = np.zeros(args.steps, dtype=np.int64)
    # Process CPU time (all threads: training, gloo, a monitor's background thread) per
    # step: less sensitive than wall time to other processes sharing the cores.
    cpu_ns = np.zeros(args.steps, dtype=np.int64)
    forward_ns = np.zeros(args.steps, dtype=np.int64)
    it = iter(loader)
    for step in range(args.steps):
        if args.profile_blocks:
            profiled[step] = profiled_step(step, args.profile_blocks)
            if profiled[step] and profiler is None:
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                profiler.__enter__()
            elif not profiled[step] and profiler is not None:
                c = time.process_time_ns()
                profiler.__exit__(None, None, None)
                close_ns.append(time.process_time_ns() - c)
                profiler = None
        elif profiler is not None:
            profiled[step] = True
        t0 = time.perf_counter_ns()
        c0 = time.process_time_ns()
        probe.begin_step(step)
        micro = next(it)
        ce_sum = 0.0
        for i, mb in enumerate(micro):
            tokens = torch.from_numpy(mb.tokens).to(device)
            targets = torch.from_numpy(mb.targets).to(device)
            # Loss normalised by the global target count (times world, undone by the
            # gradient average), so packing never changes the gradient.
            norm = max(mb.global_targets / world * len(micro), 1.0)
            sync = (
                model.no_sync()
                if i < len(micro) - 1
                and isinstance(model, torch.nn.parallel.DistributedDataParallel)
                else contextlib.nullcontext()
            )
            with sync:
                tf = time.perf_counter_ns()
                with autocast:
                    loss = model(tokens, mb.lengths.tolist(), targets, norm)
                forward_ns[step] += time.perf_counter_ns() - tf
                with probe.phase("backward"):
                    loss.backward()
            ce_sum += float(loss.detach()) * norm
        if intra is not None:
            hierarchical_sync(buckets, intra, cross)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0 and rank == 0:
            with probe.phase("checkpoint"):
                Path(args.ckpt_dir).mkdir(parents=True, exist_ok=True)
                torch.save(base.state_dict(), Path(args.ckpt_dir) / "model.pt")
        probe.work(
            tokens=sum(int(mb.lengths.sum()) for mb in micro),
            valid_tokens=sum(mb.valid_tokens for mb in micro),
            samples=sum(int(mb.lengths.shape[0]) for mb in micro),
            attn_cost=sum(mb.attn_cost for mb in micro),
        )
        probe.end_step()
        if profiler is not None:
            profiler.step()
        step_ns[step] = time.perf_counter_ns() - t0
        cpu_ns[step] = time.process_time_ns() - c0
        if rank == 0 and args.log_every and (step + 1) % args.log_every == 0:
            targets_here = sum(int((mb.targets >= 0).sum()) for mb in micro)
            print(
                f"step {step + 1}/{args.steps} rank0 loss {ce_sum / max(targets_here, 1):.3f} "
                f"step_ms {step_ns[step] / 1e6:.1f}",
                flush=True,
            )
    if profiler is not None:
        c = time.process_time_ns()
        profiler.__exit__(None, None, None)
        close_ns.append(time.process_time_ns() - c)
    if args.timings:
        out = Path(args.timings)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "rank": rank,
                    "world": world,
                    "step_ns": step_ns.tolist(),
                    "cpu_ns": cpu_ns.tolist(),
                    "forward_ns": forward_ns.tolist(),
                    "profiled": profiled.tolist(),
                    "profiler_close_cpu_ns": close_ns,
                }
            )
        )
    probe.close()
    dist.barrier()
    # End gloo's worker threads before interpreter exit, where one that frees a tensor
    # late aborts the process: destroy_process_group joins them when it drops the last
    # reference to the group. Hence torch.distributed.nn (whose default arguments would bind
    # group.WORLD) is imported before the group exists, and the model goes first: DDP's
    # reducer would free the group with the GIL held and deadlock with a waiting worker.
    del model, base
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    return train(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
