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

from rankscope.diagnosis.decomposition import Decomposition
from rankscope.diagnosis.grouprows import GroupSkew, group_rows
from rankscope.diagnosis.robust import nanmean, nanmedian
from rankscope.diagnosis.window import Window


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


BUSY_CATEGORIES = ("arrival_wait", "pipeline_idle")
"""What `busy_ns` takes out of the step (a decomposition of only these serves it)."""


def busy_ns(window: Window, decomp: Decomposition, out: np.ndarray | None = None) -> np.ndarray:
    """Per rank and step the time not spent waiting for others: step − arrival wait −
    pipeline idle. The rank with the most of it is the one the others wait for.

    Args:
        window: the window.
        decomp: its decomposition.
        out: float64 (R, S) to write into (default a new array); ``decomp.step_ns`` itself
            where the caller made the decomposition for this alone.

    Returns:
        float64 (R, S) (``out`` when given); NaN where absent.
    """
    wait, idle = (decomp.category(c) for c in BUSY_CATEGORIES)
    busy = np.subtract(decomp.step_ns, wait, out=out)
    busy -= idle
    return busy


def group_skew(window: Window, all_complete: bool = False) -> GroupSkew:
    """Skew and transfer percentiles per (group, op, size bucket) over complete instances.

    Args:
        window: the window.
        all_complete: every instance is known to be complete (`grouprows.group_rows`).

    Returns:
        The columnar table (`grouprows.group_rows` of the window's instances).
    """
    return group_rows(window.instances, all_complete)


def critical_path(
    window: Window, decomp: Decomposition, groups: GroupSkew | None = None
) -> CriticalPath:
    """Last arrivers, lateness, per-group skew vs transfer and the pace-setting ranks.

    Args:
        window: the window.
        decomp: its decomposition (`decomposition.decompose`).
        groups: `grouprows.group_rows` of its instances if already computed.

    Returns:
        The critical-path summary.
    """
    n_ranks = window.world_size
    inst = window.instances
    complete = (inst.n_arrived >= inst.n_members) & (inst.n_members >= 2) & (inst.last_rank >= 0)
    every = bool(complete.all())

    def col(a: np.ndarray) -> np.ndarray:
        # Gathering ten million rows costs as much as the analysis: only when needed.
        return a if every else a[complete]

    last = col(inst.last_rank)
    clock = window.clock_error_ns
    clock_err = float(np.fmax.reduce(clock)) if clock is not None and clock.size else 0.0
    clock_err = clock_err if np.isfinite(clock_err) else 0.0
    # Two ranks' entries each carry their own error: the order is certain beyond the sum.
    per_rank_err = np.nan_to_num(clock, nan=clock_err) if clock is not None else np.zeros(n_ranks)
    margin = col(inst.margin)
    in_range = last < n_ranks
    if not in_range.all():
        last = last[in_range]
        margin = margin[in_range]
    uniform = per_rank_err.size == 0 or np.ptp(per_rank_err) == 0
    if uniform:
        decisive = margin > 2.0 * (per_rank_err[0] if per_rank_err.size else 0.0)
    else:
        decisive = margin > 2.0 * per_rank_err[last]
    times_last = np.bincount(last, minlength=n_ranks)[:n_ranks]
    # Ties are few: count them off rather than weigh every instance.
    n_ties = int(decisive.size - np.count_nonzero(decisive))
    times_dec = times_last.copy()
    if n_ties:
        times_dec -= np.bincount(last[~decisive], minlength=n_ranks)[:n_ranks]
    skew = col(inst.skew)
    resolvable = (
        float(np.count_nonzero(skew > 2.0 * clock_err) / skew.size) if skew.size else float("nan")
    )

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
        ties=n_ties,
        complete=int(np.count_nonzero(complete)),
        late_mean_ns=late_mean,
        critical_rank=crit,
        critical_counts=counts.astype(np.int64),
        critical_stability=stability,
        critical_excess=excess,
        groups=groups if groups is not None else group_skew(window, every),
        clock_error_ns=clock_err,
        skew_resolvable=resolvable,
    )
