"""Numerator check: is the work per step the same as in the baseline run?

A throughput loss is a systems loss only if each step does the same useful work. More
padding, longer sequences or recomputation raise the executed work while the model name
stays the same (seed: "Verify the regression and numerator"). This module compares the work
columns per step — summed over ranks, median over steps — against the baseline and flags
any that moved by more than noise and more than ``MIN_CHANGE``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.diagnosis.robust import robust_scale
from rankscope.diagnosis.window import Window

FIELDS = ("tokens", "valid_tokens", "padding_fraction", "attn_cost", "samples", "flops")
"""Compared per step. ``attn_cost`` is Σ seq² of the packed sequences."""

EXECUTED = ("tokens", "attn_cost", "flops", "padding_fraction")
"""Fields that measure executed (not useful) work: their growth is a numerator change."""

MIN_CHANGE = 0.02
"""A relative change smaller than this is not reported as a numerator change however
significant: 2 % of work is inside what packing and batching legitimately vary."""

Z_CHANGE = 4.0
"""…and it must exceed the step-to-step noise of both runs by this many standard errors."""


@dataclass(frozen=True)
class WorkField:
    """One work measure per step, current run against the baseline."""

    name: str
    current: float
    """Median over steps of the per-step total over ranks (a fraction for padding)."""
    baseline: float
    ratio: float
    """current / baseline (NaN without a baseline or when unknown)."""
    z: float
    """Difference in standard errors of the median."""
    changed: bool


@dataclass(frozen=True)
class NumeratorCheck:
    """Work per step against the baseline."""

    fields: tuple[WorkField, ...]
    has_baseline: bool
    changed: tuple[str, ...]
    """Names of the fields that changed."""
    executed_ratio: float
    """Largest growth among executed-work fields that changed, per unit of useful work
    (1.0 when none grew)."""
    useful_ratio: float
    """valid_tokens (or samples) ratio: useful work per step (NaN when unknown)."""

    @property
    def comparable(self) -> bool:
        """The baseline does the same useful work per step (valid tokens or samples within
        ``MIN_CHANGE``); otherwise it is a different global batch or job."""
        return not np.isfinite(self.useful_ratio) or abs(self.useful_ratio - 1.0) < MIN_CHANGE

    @property
    def numerator_changed(self) -> bool:
        """Executed work per step grew: part of a slowdown is more work, not a systems loss.
        (Less executed work cannot explain a slowdown; it is still listed in ``changed``.)"""
        return self.executed_ratio > 1.0


def per_step_work(window: Window) -> dict[str, np.ndarray]:
    """Per-step totals of every work field, counting each data shard once.

    Ranks that share a data shard (tensor-parallel peers, pipeline stages) process the
    same tokens; summing them would count a batch ``tp × pp`` times and make runs with
    different layouts look like different work. When every rank reports its shard, each
    shard contributes the mean of its ranks; otherwise every rank counts.

    Args:
        window: the window.

    Returns:
        Field -> float64 (S,) (padding as a fraction of tokens); NaN where unknown.
    """
    out = {}
    present = window.present
    shard = window.ranks.shard.astype(np.int64)
    by_shard = bool(shard.size) and bool((shard >= 0).all())
    if by_shard:
        _, inv = np.unique(shard, return_inverse=True)
        n_shards = int(inv.max()) + 1
    for name in ("tokens", "valid_tokens", "attn_cost", "samples", "flops"):
        arr = np.where(present, window.work[name], np.nan)
        known = np.isfinite(arr) & (arr >= 0)
        vals = np.where(known, arr, 0.0)
        if by_shard and name != "flops":
            sums = np.zeros((n_shards, arr.shape[1]))
            cnts = np.zeros((n_shards, arr.shape[1]))
            np.add.at(sums, inv, vals)
            np.add.at(cnts, inv, known.astype(np.float64))
            with np.errstate(invalid="ignore", divide="ignore"):
                total = np.where(cnts > 0, sums / np.where(cnts > 0, cnts, 1.0), 0.0).sum(axis=0)
        else:
            # FLOPs are each rank's own share of the model: they add up across ranks.
            total = vals.sum(axis=0)
        out[name] = np.where(known.any(axis=0), total, np.nan)
    tok = out["tokens"]
    with np.errstate(invalid="ignore", divide="ignore"):
        out["padding_fraction"] = np.where(tok > 0, 1.0 - out["valid_tokens"] / tok, np.nan)
    return out


def _median_se(x: np.ndarray) -> tuple[float, float]:
    x = x[np.isfinite(x)]
    if x.size == 0:
        return float("nan"), float("nan")
    # 1.253 σ/√n is the standard error of a median under normal noise.
    return float(np.median(x)), float(1.253 * robust_scale(x) / np.sqrt(x.size))


def check_numerator(window: Window, baseline: Window | None = None) -> NumeratorCheck:
    """Compare work per step with the baseline run.

    Args:
        window: the run under study.
        baseline: the healthy run (None: report current values only).

    Returns:
        Per-field comparison and which executed-work fields changed.
    """
    cur = per_step_work(window)
    base = per_step_work(baseline) if baseline is not None else None
    fields = []
    changed = []
    for name in FIELDS:
        c, c_se = _median_se(cur[name])
        if base is None:
            fields.append(WorkField(name, c, float("nan"), float("nan"), float("nan"), False))
            continue
        b, b_se = _median_se(base[name])
        if name == "padding_fraction":
            # A fraction: compare the share of padding, not a ratio of tiny numbers.
            ratio = (1.0 - b) / (1.0 - c) if np.isfinite(b) and c < 1 else float("nan")
        else:
            ratio = c / b if b > 0 else float("nan")
        se = float(np.hypot(c_se, b_se))
        z = (c - b) / se if se > 0 else (np.inf * np.sign(c - b) if c != b else 0.0)
        is_changed = bool(
            np.isfinite(ratio) and abs(ratio - 1.0) >= MIN_CHANGE and abs(z) >= Z_CHANGE
        )
        if is_changed:
            changed.append(name)
        fields.append(WorkField(name, c, b, float(ratio), float(z), is_changed))
    by_name = {f.name: f for f in fields}
    useful = by_name["valid_tokens"].ratio
    if not np.isfinite(useful):
        useful = by_name["samples"].ratio
    # Executed work per unit of useful work: a larger global batch is not a numerator
    # change, the same batch costing more is.
    per_useful = useful if np.isfinite(useful) and useful > 0 else 1.0
    executed = []
    for n in EXECUTED:
        f = by_name[n]
        if n not in changed:
            continue
        r = f.ratio if n == "padding_fraction" else f.ratio / per_useful
        if r >= 1.0 + MIN_CHANGE:
            executed.append(r)
    return NumeratorCheck(
        fields=tuple(fields),
        has_baseline=base is not None,
        changed=tuple(changed),
        executed_ratio=float(max(executed)) if executed else 1.0,
        useful_ratio=float(useful),
    )
