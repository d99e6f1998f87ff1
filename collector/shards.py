"""Which data shard a rank reads, with the shard swap of a controlled rerun applied.

``rankscope rerun ... --swap-shards R1,R2`` sets ``RANKSCOPE_SWAP_SHARDS=R1,R2`` in the
rerun's environment: rank R1 should read the shard rank R2 read in the parent run, and R2
the shard of R1; every other rank keeps its own. A workload that picks its shard by rank
asks `shard_of` instead::

    from rankscope.collector.shards import shard_of   # or rankscope.shard_of
    shard = shard_of(rank, world)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=shard)

Slowness that then moves to the other rank of the pair is the data's; slowness that stays
is the rank's device or process (``rankscope experiment swap``). This module imports
nothing beyond the standard library, so a script may call it before torch is set up and
whether or not the collector runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

SWAP_ENV = "RANKSCOPE_SWAP_SHARDS"
"""The environment variable of a shard swap: ``R1,R2`` (two different ranks), or unset."""

__all__ = ["SWAP_ENV", "shard_of", "swapped_shards"]


def swapped_shards(
    env: Mapping[str, str] | None = None, world_size: int | None = None
) -> tuple[int, int] | None:
    """The pair of ranks whose shards are exchanged in this run.

    Args:
        env: environment (``os.environ`` by default).
        world_size: ranks in the job; when given, both ranks must be below it.

    Returns:
        ``(r1, r2)``, or None when ``RANKSCOPE_SWAP_SHARDS`` is unset or blank.

    Raises:
        ValueError: naming the variable and its value, when it is not two different
            non-negative integers ``R1,R2`` (below ``world_size`` when given).
    """
    env = os.environ if env is None else env
    raw = env.get(SWAP_ENV)
    if raw is None or not raw.strip():
        return None
    parts = [p.strip() for p in raw.split(",")]
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() and len(p) <= 9 for p in parts):
        raise ValueError(f"{SWAP_ENV}={raw!r} is not two ranks R1,R2 (e.g. {SWAP_ENV}=3,5)")
    a, b = int(parts[0]), int(parts[1])
    if a == b:
        raise ValueError(f"{SWAP_ENV}={raw!r} names rank {a} twice; a swap takes two ranks")
    if world_size is not None and max(a, b) >= world_size:
        raise ValueError(
            f"{SWAP_ENV}={raw!r} names rank {max(a, b)}, outside the job's {world_size} ranks"
        )
    return a, b


def shard_of(rank: int, world_size: int | None = None, env: Mapping[str, str] | None = None) -> int:
    """The rank whose data shard ``rank`` reads: itself, unless a shard swap names it.

    Args:
        rank: this rank (``torch.distributed.get_rank()``, or ``RANK``).
        world_size: ranks in the job, to check the swap against (recommended).
        env: environment (``os.environ`` by default).

    Returns:
        The shard index to load: the other rank of the pair for a swapped rank, else
        ``rank``.

    Raises:
        ValueError: a negative ``rank``, or a malformed ``RANKSCOPE_SWAP_SHARDS`` (the
            message names the variable and its value). A bad swap stops the job rather than
            running it unswapped, where its result would read as "stays with the device".
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an int >= 0, got {rank!r}")
    pair = swapped_shards(env, world_size)
    if pair is None:
        return rank
    a, b = pair
    return b if rank == a else a if rank == b else rank
