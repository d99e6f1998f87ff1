"""Critical path: who arrives last, by how much, and what sets the step time.

Synchronous progress follows maxima at every rendezvous, so this module reports maxima and
counts, never averages alone: the last-arriving rank of every collective instance, lateness
per rank, arrival skew against post-arrival transfer per group and message-size bucket, and
per step the rank whose busy time sets the pace.

Ties in arrival order: the instance table names the lowest rank among equal last entries;
an instance whose last arriver beat the second-last by no more than the clock error is
counted in ``times_last`` but not in ``times_last_decisive``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.collector.schema import OPS
from rankscope.diagnosis.curves import size_bucket, transfer_time
from rankscope.diagnosis.decomposition import Decomposition
from rankscope.diagnosis.robust import group_quantiles, nanmean, nanmedian
from rankscope.diagnosis.window import Window


@dataclass(frozen=True)
class GroupSkew:
    """Arrival skew against post-arrival transfer per (group, op, size bucket); columnar."""

    group: np.ndarray
    op: np.ndarray
    bucket: np.ndarray
    count: np.ndarray
    skew_p50: np.ndarray
    skew_p99: np.ndarray
    skew_max: np.ndarray
    transfer_p10: np.ndarray
    """Transfer of the quiet instances: the reference for bursts that hit most steps."""
    transfer_p50: np.ndarray
    transfer_p99: np.ndarray
    transfer_max: np.ndarray
    skew_share: np.ndarray
    """``skew_p50 / (skew_p50 + transfer_p50)``: above 0.5 waiting dominates the collective."""
    row_of_instance: np.ndarray
    """int64 per instance of the window: its row here, -1 when left out (incomplete)."""

    def __len__(self) -> int:
        return int(self.group.shape[0])


@dataclass(frozen=True)
class CriticalPath:
    """Last arrivers, lateness and the ranks and operations that set the step time."""

    times_last: np.ndarray
    """int64 (R,) complete instances where the rank entered last."""
    times_last_decisive: np.ndarray
    """int64 (R,) the same, only when it was later than the runner-up by more than the
    clock error (the order is then certain)."""
    ties: int
    """Complete instances whose last two entries were not separable (margin ≤ clock error)."""
    complete: int
    """Complete instances (every member arrived, two or more members)."""
    late_mean_ns: np.ndarray
    """float64 (R,) mean lateness per collective (``late_ns / n``)."""
    critical_rank: np.ndarray
    """int64 (S,) per step, the rank with the most busy (non-waiting) time; -1 if none."""
    critical_counts: np.ndarray
    """int64 (R,) steps in which each rank was critical."""
    critical_stability: float
    """Share of steps whose critical rank is the most frequent one: near 1, one rank sets
    the pace every step (hardware-like); near 1/S, it moves with the batch (data-like)."""
    critical_excess: np.ndarray
    """float64 (S,) busy time of the critical rank over the median rank's, per step (ns)."""
    groups: GroupSkew
    clock_error_ns: float
    """Largest clock-alignment uncertainty among ranks (0 when unknown)."""
    skew_resolvable: float
    """Share of complete instances whose skew exceeds twice the clock error: below ~0.5,
    arrival-order conclusions rest on skews the clocks cannot resolve."""

    def top_last(self, k: int = 5) -> list[tuple[int, int]]:
        """The ``k`` ranks that arrived last most often, as ``(rank, count)``."""
        order = np.argsort(-self.times_last, kind="stable")[:k]
        return [(int(r), int(self.times_last[r])) for r in order if self.times_last[r] > 0]

    def top_critical(self, k: int = 5) -> list[tuple[int, int]]:
        """The ``k`` ranks that set the step most often, as ``(rank, steps)``."""
        order = np.argsort(-self.critical_counts, kind="stable")[:k]
        return [(int(r), int(self.critical_counts[r])) for r in order if self.critical_counts[r]]


def busy_ns(window: Window, decomp: Decomposition) -> np.ndarray:
    """Per rank and step the time not spent waiting for others: step − arrival wait −
    pipeline idle. The rank with the most of it is the one the others wait for.

    Args:
        window: the window.
        decomp: its decomposition.

    Returns:
        float64 (R, S); NaN where absent.
    """
    return decomp.step_ns - decomp.category("arrival_wait") - decomp.category("pipeline_idle")


def group_skew(window: Window) -> GroupSkew:
    """Skew and transfer percentiles per (group, op, size bucket) over complete instances.

    Args:
        window: the window.

    Returns:
        The columnar table.
    """
    inst = window.instances
    ok = (inst.n_arrived >= inst.n_members) & (inst.n_members >= 2)
    group = inst.group[ok].astype(np.int64)
    op = inst.op[ok].astype(np.int64)
    bucket = size_bucket(inst.nbytes[ok])
    key = (group * (len(OPS) + 1) + op) * 64 + (bucket + 1)
    keys, inv = np.unique(key, return_inverse=True)
    k = keys.size
    skew = group_quantiles(inv, inst.skew[ok], k, (0.5, 0.99, 1.0))
    tr = group_quantiles(inv, transfer_time(inst)[ok], k, (0.5, 0.99, 1.0, 0.1))
    with np.errstate(invalid="ignore", divide="ignore"):
        share = skew[0] / (skew[0] + tr[0])
    row_of = np.full(len(inst), -1, dtype=np.int64)
    row_of[ok] = inv
    return GroupSkew(
        group=(keys // (64 * (len(OPS) + 1))).astype(np.int32),
        op=((keys // 64) % (len(OPS) + 1)).astype(np.int8),
        bucket=(keys % 64 - 1).astype(np.int32),
        count=np.bincount(inv, minlength=k).astype(np.int64),
        skew_p50=skew[0],
        skew_p99=skew[1],
        skew_max=skew[2],
        transfer_p10=tr[3],
        transfer_p50=tr[0],
        transfer_p99=tr[1],
        transfer_max=tr[2],
        skew_share=share,
        row_of_instance=row_of,
    )


def critical_path(window: Window, decomp: Decomposition) -> CriticalPath:
    """Last arrivers, lateness, per-group skew vs transfer and the pace-setting ranks.

    Args:
        window: the window.
        decomp: its decomposition (`decomposition.decompose`).

    Returns:
        The critical-path summary.
    """
    n_ranks = window.world_size
    inst = window.instances
    complete = (inst.n_arrived >= inst.n_members) & (inst.n_members >= 2) & (inst.last_rank >= 0)
    last = inst.last_rank[complete].astype(np.int64)
    clock = window.clock_error_ns
    clock_err = float(np.nanmax(clock)) if clock is not None and clock.size else 0.0
    clock_err = clock_err if np.isfinite(clock_err) else 0.0
    # Two ranks' entries each carry their own error: the order is certain beyond the sum.
    per_rank_err = np.nan_to_num(clock, nan=clock_err) if clock is not None else np.zeros(n_ranks)
    margin = inst.margin[complete]
    tie_limit = 2.0 * per_rank_err[np.clip(last, 0, n_ranks - 1)]
    decisive = margin > tie_limit
    times_last = np.bincount(last, minlength=n_ranks)[:n_ranks]
    times_dec = np.bincount(last[decisive], minlength=n_ranks)[:n_ranks]
    skew = inst.skew[complete]
    resolvable = float(np.mean(skew > 2.0 * clock_err)) if skew.size else float("nan")

    n = window.coll["n"]
    with np.errstate(invalid="ignore", divide="ignore"):
        late = np.where(n > 0, window.coll["late_ns"] / n, np.nan)
    late_mean = nanmean(late, axis=1)

    busy = busy_ns(window, decomp)
    filled = np.where(np.isfinite(busy), busy, -np.inf)
    any_rank = np.isfinite(busy).any(axis=0)
    crit = np.where(any_rank, np.argmax(filled, axis=0), -1).astype(np.int64)
    counts = np.bincount(crit[crit >= 0], minlength=n_ranks)[:n_ranks]
    n_steps = int(any_rank.sum())
    stability = float(counts.max() / n_steps) if n_steps else float("nan")
    top = np.where(any_rank, filled.max(axis=0), np.nan)
    excess = top - nanmedian(busy, axis=0)
    return CriticalPath(
        times_last=times_last.astype(np.int64),
        times_last_decisive=times_dec.astype(np.int64),
        ties=int((~decisive).sum()),
        complete=int(complete.sum()),
        late_mean_ns=late_mean,
        critical_rank=crit,
        critical_counts=counts.astype(np.int64),
        critical_stability=stability,
        critical_excess=excess,
        groups=group_skew(window),
        clock_error_ns=clock_err,
        skew_resolvable=resolvable,
    )
