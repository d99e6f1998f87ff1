"""Variable-length sequences and the two packers of the GPT packing example.

Every rank draws the same global batch from a generator seeded by ``(seed, step)`` and runs
the same packer, so the assignment of sequences to ranks needs no communication and a rerun
at another scope sees the same sequences.

Two packers, both realistic:

``token``
    First-fit decreasing into one bin per rank with a capacity of ``ceil(tokens / world)``:
    tokens per rank come out balanced to within a fraction of a percent, but the longest
    sequences land together in the first bins, so the sum of squared lengths (the attention
    work) is not balanced at all.
``attn``
    Longest-processing-time first on the cost estimate ``L² + linear_weight · L`` (attention
    plus the per-token linear layers): the per-rank compute comes out balanced while tokens
    per rank differ by tens of percent.

Bins are handed to ranks in an order shuffled per step, as a data loader deals packed
buffers, so no rank is systematically given the long sequences: which rank is slowest moves
with the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PACKERS = ("token", "attn")


@dataclass(frozen=True)
class LengthDist:
    """A long-tailed (log-normal, clipped) sequence-length distribution.

    Attributes:
        median: median length before clipping, in tokens.
        sigma: log-space standard deviation; 1.5 puts about 5 % of sequences above 12× the
            median.
        min_len: shortest sequence.
        max_len: longest sequence; longer draws are clipped to it.
        scale: multiplies every length (and both bounds): the ``--seq-scale`` knob that makes
            sequences longer while the model stays the same.
    """

    median: float = 64.0
    sigma: float = 1.5
    min_len: int = 16
    max_len: int = 1024
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.median > 0:
            raise ValueError(f"median length must be > 0, got {self.median}")
        if not self.sigma >= 0:
            raise ValueError(f"sigma must be >= 0, got {self.sigma}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(
                f"need 1 <= min_len <= max_len, got min_len={self.min_len} max_len={self.max_len}"
            )
        if not self.scale > 0:
            raise ValueError(f"seq scale must be > 0, got {self.scale}")

    @property
    def lo(self) -> int:
        """Shortest length after scaling."""
        return max(1, round(self.min_len * self.scale))

    @property
    def hi(self) -> int:
        """Longest length after scaling."""
        return max(self.lo, round(self.max_len * self.scale))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Draw ``n`` lengths.

        Args:
            rng: the generator to draw from.
            n: how many.

        Returns:
            int64 lengths in ``[lo, hi]``.
        """
        raw = rng.lognormal(math.log(self.median * self.scale), self.sigma, size=n)
        return np.clip(np.rint(raw), self.lo, self.hi).astype(np.int64)


def global_batch(dist: LengthDist, valid_tokens: int, seed: int, step: int) -> np.ndarray:
    """The sequence lengths of one step's global batch.

    Sequences are drawn until their valid tokens reach ``valid_tokens`` exactly; the last one
    is cut to fit, so every step carries the same useful work whatever the distribution.

    Args:
        dist: the length distribution.
        valid_tokens: valid tokens per step, over all ranks.
        seed: run seed.
        step: step number (each step draws independently, so ranks agree without talking).

    Returns:
        int64 lengths summing to ``valid_tokens``.
    """
    if valid_tokens < 1:
        raise ValueError(f"valid tokens per step must be >= 1, got {valid_tokens}")
    rng = np.random.default_rng([seed, step])
    # Draw in blocks sized from the median so one or two draws usually suffice.
    chunks: list[np.ndarray] = []
    total = 0
    while total < valid_tokens:
        block = dist.sample(rng, max(16, int(2 * valid_tokens / (dist.median * dist.scale))))
        chunks.append(block)
        total += int(block.sum())
    lengths = np.concatenate(chunks)
    ends = np.cumsum(lengths)
    n = int(np.searchsorted(ends, valid_tokens)) + 1
    lengths = lengths[:n].copy()
    lengths[-1] -= int(ends[n - 1]) - valid_tokens
    return lengths


def pad_lengths(lengths: np.ndarray, multiple: int) -> np.ndarray:
    """Executed lengths when every sequence is padded up to a multiple of ``multiple``.

    Args:
        lengths: valid lengths.
        multiple: pad each sequence to a multiple of this (``<= 1``: no padding).

    Returns:
        int64 executed lengths, each ``>=`` its valid length.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if multiple <= 1:
        return lengths.copy()
    return -(-lengths // multiple) * multiple


def attention_cost(lengths: np.ndarray) -> float:
    """Σ L², the attention work of a set of sequences (what ``attn_cost`` reports)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return float(np.dot(lengths, lengths))


def _deal(bins: np.ndarray, world: int, rng: np.random.Generator) -> np.ndarray:
    # Bin b goes to rank order[b]: shuffled per step so the long bin lands anywhere.
    order = rng.permutation(world)
    return order[bins]


def pack_tokens(lengths: np.ndarray, world: int, rng: np.random.Generator) -> np.ndarray:
    """Token-balanced packing: first-fit decreasing into ``world`` equal-capacity bins.

    Args:
        lengths: executed sequence lengths of the global batch.
        world: number of ranks.
        rng: per-step generator that deals bins to ranks.

    Returns:
        int64 owner rank of each sequence.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    cap = -(-int(lengths.sum()) // world)
    load = np.zeros(world, dtype=np.int64)
    bins = np.empty(lengths.shape[0], dtype=np.int64)
    for i in np.argsort(-lengths, kind="stable"):
        fits = np.flatnonzero(load + lengths[i] <= cap)
        b = int(fits[0]) if fits.size else int(np.argmin(load))
        bins[i] = b
        load[b] += lengths[i]
    return _deal(bins, world, rng)


def pack_attention(
    lengths: np.ndarray, world: int, rng: np.random.Generator, linear_weight: float
) -> np.ndarray:
    """Attention-cost-balanced packing: longest-processing-time first on ``L² + w·L``.

    Args:
        lengths: executed sequence lengths of the global batch.
        world: number of ranks.
        rng: per-step generator that deals bins to ranks.
        linear_weight: tokens' linear-layer cost in units of one attention score pair; the
            example measures it for its model (``tinygpt.linear_weight``).

    Returns:
        int64 owner rank of each sequence.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    cost = lengths.astype(np.float64) ** 2 + linear_weight * lengths
    load = np.zeros(world, dtype=np.float64)
    bins = np.empty(lengths.shape[0], dtype=np.int64)
    for i in np.argsort(-cost, kind="stable"):
        b = int(np.argmin(load))
        bins[i] = b
        load[b] += cost[i]
    return _deal(bins, world, rng)


def pack(
    packer: str, lengths: np.ndarray, world: int, seed: int, step: int, linear_weight: float
) -> np.ndarray:
    """Run one of ``PACKERS`` on a global batch.

    Args:
        packer: ``"token"`` or ``"attn"``.
        lengths: executed sequence lengths.
        world: number of ranks.
        seed: run seed.
        step: step number.
        linear_weight: see `pack_attention`.

    Returns:
        int64 owner rank of each sequence.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    # A stream separate from the length draw, so both packers see the same batch.
    rng = np.random.default_rng([seed, step, 1])
    if packer == "token":
        return pack_tokens(lengths, world, rng)
    if packer == "attn":
        return pack_attention(lengths, world, rng, linear_weight)
    raise ValueError(f"unknown packer {packer!r}; choose one of {', '.join(PACKERS)}")


@dataclass(frozen=True)
class RankBatch:
    """One rank's packed buffer for one step.

    Attributes:
        tokens: int64 (T,) input ids, sequences back to back.
        targets: int64 (T,) next-token targets; -100 where there is none (a sequence's last
            token, padding).
        lengths: executed length of each packed sequence (attention runs per sequence).
        valid_tokens: tokens that are not padding.
        global_targets: target tokens over all ranks (the loss is normalised by it, so the
            gradient does not depend on how the batch was packed).
    """

    tokens: np.ndarray
    targets: np.ndarray
    lengths: np.ndarray
    valid_tokens: int
    global_targets: int

    @property
    def attn_cost(self) -> float:
        return attention_cost(self.lengths)


def rank_batch(
    valid: np.ndarray,
    executed: np.ndarray,
    owner: np.ndarray,
    rank: int,
    vocab: int,
    seed: int,
    step: int,
) -> RankBatch:
    """Materialise one rank's share of the global batch.

    Each sequence is an arithmetic progression modulo ``vocab`` with its own start and
    stride, so the model has something learnable; padding is token 0 with no target.

    Args:
        valid: valid lengths of every sequence in the global batch.
        executed: executed (padded) lengths, same order.
        owner: owner rank of every sequence.
        rank: this rank.
        vocab: vocabulary size.
        seed: run seed.
        step: step number.

    Returns:
        The rank's packed buffer.
    """
    rng = np.random.default_rng([seed, step, 2])
    n = valid.shape[0]
    starts = rng.integers(0, vocab, size=n)
    strides = rng.integers(1, 4, size=n)
    mine = np.flatnonzero(owner == rank)
    ex = executed[mine]
    va = valid[mine]
    total = int(ex.sum())
    seq_of = np.repeat(np.arange(mine.shape[0]), ex)
    offsets = np.concatenate([[0], np.cumsum(ex)[:-1]]).astype(np.int64)
    pos = np.arange(total, dtype=np.int64) - np.repeat(offsets, ex)
    is_valid = pos < np.repeat(va, ex)
    seq_tokens = (starts[mine][seq_of] + pos * strides[mine][seq_of]) % vocab
    tokens = np.where(is_valid, seq_tokens, 0)
    has_next = pos + 1 < np.repeat(va, ex)
    targets = np.where(has_next, (seq_tokens + strides[mine][seq_of]) % vocab, -100)
    return RankBatch(
        tokens=tokens.astype(np.int64),
        targets=targets.astype(np.int64),
        lengths=ex.astype(np.int64),
        valid_tokens=int(va.sum()),
        global_targets=int(np.maximum(valid - 1, 0).sum()),
    )
