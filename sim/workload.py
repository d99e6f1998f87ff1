"""Sequence lengths and the packers that turn them into per-rank work.

Each step draws a pool of documents from a long-tailed length distribution (a lognormal
body with a Pareto tail, cut to the row length) and packs it into ``dp * grad_accum``
slots (one slot = one micro batch of one data-parallel rank). Two packers:

- ``token_balanced`` concatenates the pool and cuts it into equal slots: tokens are exactly
  balanced, but a slot holding one long document costs far more attention (Σ seq²) than a
  slot of many short ones.
- ``attn_balanced`` assigns whole documents to ranks, costliest first, each round filling
  the ranks with the least estimated cost so far (a vectorised longest-processing-time rule
  on ``tokens + w * seq²``, ``w`` from the model): estimated compute comes out balanced,
  tokens close, and no rank collects several long documents.

Both see the same pool, so valid tokens per step are the same; only the assignment differs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from rankscope.sim.spec import Scenario, WorkloadSpec


@dataclass(frozen=True)
class Work:
    """Work of every slot in one step, shape ``(dp, grad_accum)``."""

    tokens: np.ndarray
    """float64 executed tokens (valid + padding)."""
    valid_tokens: np.ndarray
    """float64 tokens of real documents."""
    samples: np.ndarray
    """float64 documents (or document pieces) in the slot."""
    attn_cost: np.ndarray
    """float64 Σ seq² over the slot's documents."""


def effective_workload(scenario: Scenario) -> WorkloadSpec:
    """The workload the job really runs: the scenario's, with workload faults applied.

    ``data_imbalance`` switches to the token-balanced packer; ``numerator_change`` adds
    padding (``padding``: same valid tokens, more executed ones) or lengthens sequences
    (``longer``: longer rows and documents, more tokens per step); ``checkpoint`` sets the
    checkpoint period and write time.

    Args:
        scenario: the resolved scenario.

    Returns:
        The effective workload.
    """
    wl, f = scenario.workload, scenario.fault
    if f.mechanism == "data_imbalance":
        return dataclasses.replace(wl, packer="token_balanced")
    if f.mechanism == "numerator_change" and f.variant == "padding":
        return dataclasses.replace(wl, pad_fraction=wl.pad_fraction + f.magnitude)
    if f.mechanism == "numerator_change":
        # Longer sequences at the same global batch (in sequences): longer rows and longer
        # documents, so more tokens and more attention per step.
        grow = 1.0 + f.magnitude
        return dataclasses.replace(
            wl,
            seq_len=round(wl.seq_len * grow / 128.0) * 128,
            length_median=wl.length_median * grow,
            tail_min=wl.tail_min * grow,
        )
    if f.mechanism == "checkpoint":
        return dataclasses.replace(wl, checkpoint_every=f.every, checkpoint_s=f.magnitude)
    return wl


def draw_lengths(spec: WorkloadSpec, rng: np.random.Generator, total: int) -> np.ndarray:
    """Draw documents until their lengths add up to exactly ``total`` tokens.

    Args:
        spec: the workload (median, sigma, tail share, tail shape, row length).
        rng: random stream of this step.
        total: tokens to fill.

    Returns:
        int64 lengths in ``[16, seq_len]``; the last one is trimmed to hit ``total``.
    """
    mean_guess = min(spec.seq_len, spec.length_median * np.exp(spec.length_sigma**2 / 2))
    mean_guess = 0.5 * mean_guess + 0.5 * spec.tail_fraction * spec.seq_len + 1.0
    n = int(total / mean_guess * 1.3) + 16
    parts = []
    have = 0
    while have < total:
        body = spec.length_median * np.exp(spec.length_sigma * rng.standard_normal(n))
        tail = spec.tail_min * (1.0 + rng.pareto(spec.tail_alpha, n))
        lens = np.where(rng.random(n) < spec.tail_fraction, tail, body)
        lens = np.clip(np.rint(lens), 16, spec.seq_len).astype(np.int64)
        parts.append(lens)
        have += int(lens.sum())
    lens = np.concatenate(parts)
    csum = np.cumsum(lens)
    last = int(np.searchsorted(csum, total))
    lens = lens[: last + 1].copy()
    lens[-1] -= int(csum[last]) - total
    return lens[lens > 0]


def _token_balanced(lens: np.ndarray, n_slots: int, cap: int) -> tuple[np.ndarray, ...]:
    """Concatenate and cut every ``cap`` tokens; a document crossing a cut becomes two
    pieces (document masking keeps attention inside each piece)."""
    ends = np.cumsum(lens)
    cuts = np.arange(1, n_slots) * cap
    bounds = np.union1d(ends, cuts)
    pieces = np.diff(np.concatenate([[0], bounds]))
    slot = np.minimum((bounds - 1) // cap, n_slots - 1)
    tokens = np.bincount(slot, weights=pieces, minlength=n_slots)
    attn = np.bincount(slot, weights=pieces.astype(np.float64) ** 2, minlength=n_slots)
    count = np.bincount(slot, minlength=n_slots).astype(np.float64)
    return tokens, count, attn


def _attn_balanced(
    lens: np.ndarray, dp: int, accum: int, attn_weight: float
) -> tuple[np.ndarray, ...]:
    """Whole documents to ranks by the longest-processing-time rule (costliest first, to the
    least loaded rank); then each rank's documents are dealt over its micro batches in snake
    order."""
    lens_f = lens.astype(np.float64)
    cost = lens_f + attn_weight * lens_f**2
    order = np.argsort(-cost, kind="stable")
    rank_of = np.empty(lens.shape[0], dtype=np.int64)
    load = np.zeros(dp)
    start, n_docs = 0, order.shape[0]
    while start < n_docs:
        # Longest-processing-time first, many documents per round: handing the next n
        # documents to the n emptiest ranks is what the one-at-a-time rule would do as long
        # as none of those ranks, after taking its document, is emptier than the n-th rank
        # was, i.e. while the n-th load <= the least load + the smallest cost in the round.
        by_load = np.argsort(load, kind="stable")
        sorted_load = load[by_load]
        end = min(start + dp, n_docs)
        bound = sorted_load[0] + cost[order[end - 1]]
        n = min(max(1, int(np.searchsorted(sorted_load, bound, side="right"))), end - start)
        docs, take = order[start : start + n], by_load[:n]
        rank_of[docs] = take
        load[take] += cost[docs]
        start += n
    # position of each document among its rank's documents, in cost order
    by_rank = order[np.argsort(rank_of[order], kind="stable")]
    counts = np.bincount(rank_of, minlength=dp)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    micro = np.empty_like(rank_of)
    pos = (np.arange(by_rank.shape[0]) - starts) % (2 * accum)
    # snake order (0, 1, .., A-1, A-1, .., 0) keeps micro batches of one rank balanced too
    micro[by_rank] = np.where(pos < accum, pos, 2 * accum - 1 - pos)
    slot = rank_of * accum + micro
    n_slots = dp * accum
    tokens = np.bincount(slot, weights=lens_f, minlength=n_slots)
    attn = np.bincount(slot, weights=lens_f**2, minlength=n_slots)
    count = np.bincount(slot, minlength=n_slots).astype(np.float64)
    return tokens, count, attn


def pack_step(spec: WorkloadSpec, rng: np.random.Generator, dp: int, attn_weight: float) -> Work:
    """Draw one step's documents and pack them onto ``dp`` ranks × ``grad_accum`` micro batches.

    Args:
        spec: the workload.
        rng: random stream of this step.
        dp: data-parallel ranks.
        attn_weight: compute of one unit of Σ seq² in token-equivalents (from the model);
            the attention-balanced packer's cost estimate is ``tokens + attn_weight * seq²``.

    Returns:
        `Work` with arrays of shape ``(dp, grad_accum)``.
    """
    n_slots = dp * spec.grad_accum
    cap = spec.micro_batch * spec.seq_len
    lens = draw_lengths(spec, rng, n_slots * cap)
    if spec.packer == "token_balanced":
        valid, count, attn = _token_balanced(lens, n_slots, cap)
    else:
        valid, count, attn = _attn_balanced(lens, dp, spec.grad_accum, attn_weight)
    shape = (dp, spec.grad_accum)
    return Work(
        tokens=(valid * (1.0 + spec.pad_fraction)).reshape(shape),
        valid_tokens=valid.reshape(shape),
        samples=count.reshape(shape),
        attn_cost=attn.reshape(shape),
    )
