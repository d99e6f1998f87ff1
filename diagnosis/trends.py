"""Behaviour over time: trends, periodic spikes and bursty tails.

- **Allocator growth**: reserved memory, allocator retries and time in the ``memory`` phase
  rising with time since start (Theil–Sen slopes, robust to spikes).
- **Thermal drift**: per rank, SM clock falling and temperature rising over the window.
- **Spikes**: steps whose time stands out from the run's median by a robust z-score. When
  they recur at a regular interval they point at periodic work (checkpoint, evaluation);
  irregular bursts whose extra time lands in collective transfer point at intermittent
  congestion. Each spike's extra time is attributed to the category that grew in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.diagnosis.baseline import job_step_ns
from rankscope.diagnosis.decomposition import CATEGORIES, Decomposition
from rankscope.diagnosis.robust import nanmean, nanmedian, robust_scale, spearman, theil_sen
from rankscope.diagnosis.window import Window

SPIKE_Z = 6.0
"""A step is a spike when its robust z exceeds this…"""
SPIKE_MIN_EXCESS = 0.1
"""…and it is at least this fraction longer than the median step (noise-free runs have a
tiny spread, and a 0.5 % wobble is not a spike)."""
PERIODIC_CV = 0.25
"""Spike intervals whose coefficient of variation is below this are periodic."""


@dataclass(frozen=True)
class Trend:
    """A robust linear trend of one per-step series."""

    name: str
    slope_per_step: float
    """Theil–Sen slope in the series' unit per step."""
    relative_change: float
    """Slope × window length / median: the growth over the window as a fraction."""
    rho: float
    """Spearman ρ of the series with the step index (monotonicity)."""


@dataclass(frozen=True)
class Spikes:
    """Steps that stand out from the median step, and their pattern."""

    steps: np.ndarray
    """int64 step ids of the spikes."""
    excess_ns: np.ndarray
    """float64 per spike: step time over the median step."""
    category: tuple[str, ...]
    """Per spike, the decomposition category that grew most in it."""
    period: float
    """Median interval between spikes in steps (NaN with fewer than two)."""
    interval_cv: float
    """Coefficient of variation of the intervals (0 = perfectly periodic)."""
    share_of_time: float
    """Spike excess over the whole window's time."""

    @property
    def periodic(self) -> bool:
        """Three or more spikes at a regular interval of two steps or more (consecutive
        slow steps are a slow stretch, not periodic work)."""
        return (
            self.steps.size >= 3
            and bool(self.interval_cv <= PERIODIC_CV)
            and bool(self.period >= 2)
        )

    def dominant_category(self) -> str | None:
        """The category most spikes put their extra time in."""
        if not self.category:
            return None
        names, counts = np.unique(np.array(self.category), return_counts=True)
        return str(names[int(np.argmax(counts))])


@dataclass(frozen=True)
class Trends:
    """Over-time analysis of one window."""

    step_time: Trend
    memory: tuple[Trend, ...]
    """``mem_reserved``, ``mem_allocated``, ``alloc_retries``, ``memory_phase``."""
    per_category: tuple[Trend, ...]
    """Trend of each decomposition category's mean per step."""
    thermal_ranks: np.ndarray
    """int64 ranks whose SM clock fell over the window by more than the others'."""
    sm_clock_change: np.ndarray
    """float64 (R,) relative change of SM clock over the window (NaN without samples)."""
    temp_change_c: np.ndarray
    """float64 (R,) temperature change over the window in °C."""
    spikes: Spikes


def series_trend(name: str, y: np.ndarray) -> Trend:
    """Theil–Sen trend of a per-step series against the step index.

    Args:
        name: label.
        y: float (S,).

    Returns:
        The trend (NaN fields when fewer than three finite points).
    """
    x = np.arange(y.shape[0], dtype=np.float64)
    slope = theil_sen(x, y)
    med = float(nanmedian(y)) if np.isfinite(y).any() else float("nan")
    rel = slope * y.shape[0] / abs(med) if med and np.isfinite(med) and np.isfinite(slope) else 0.0
    return Trend(name=name, slope_per_step=slope, relative_change=float(rel), rho=spearman(x, y))


TREND_MIN_STEPS = 3
"""A trend needs at least this many steps (Theil–Sen and Spearman need three points)."""
TREND_MIN_BASE = 0.1
"""A trend's change is shown as a percentage only when the line's value at the start of the
window is at least this fraction of the series' median: a percentage of a base near zero,
or of one that changes sign, says nothing the absolute change does not say better."""


def describe_trend(trend: Trend, n_steps: int, unit: str = "ns") -> str:
    """A trend in words: the change over the window, the relative change where it means
    something, and ρ — never ``nan``.

    The change is the Theil–Sen line's rise from the first step to the last (slope × the
    steps between them). The percentage is of the line's value at the first step, taken as
    the series' median less half the change (the line passes near the median mid-window);
    it is shown only when that start is at least `TREND_MIN_BASE` of the median, so a
    near-zero or sign-changing base gives the absolute change alone. The series are
    non-negative (times, bytes, counts).

    Args:
        trend: the trend (`series_trend`).
        n_steps: steps in the series the trend was fitted on.
        unit: ``"ns"`` (shown in ms or µs), ``"bytes"`` (MiB/GiB) or ``"count"``.

    Returns:
        E.g. ``"+3.21 ms over 64 steps (+7.9% from the first, ρ 0.93)"``, ``"flat"``, or
        ``"n/a (too few steps)"``.
    """
    if n_steps < TREND_MIN_STEPS or not np.isfinite(trend.slope_per_step):
        return "n/a (too few steps)"
    rho = f"ρ {trend.rho:.2f}" if np.isfinite(trend.rho) else None
    slope = float(trend.slope_per_step)
    delta = slope * (n_steps - 1)
    if delta == 0.0:
        return "flat" + (f" ({rho})" if rho else "")
    pct = None
    rel = float(trend.relative_change)
    if rel != 0.0 and np.isfinite(rel):
        median = slope * n_steps / rel  # relative_change = slope × steps / |median|
        start = median - delta / 2
        if median > 0 and start >= TREND_MIN_BASE * median:
            pct = f"{100 * delta / start:+.1f}% from the first"
    notes = ", ".join(x for x in (pct, rho) if x)
    return f"{_amount(delta, unit)} over {n_steps} steps" + (f" ({notes})" if notes else "")


def _amount(x: float, unit: str) -> str:
    if unit == "ns":
        return f"{x / 1e6:+.2f} ms" if abs(x) >= 1e4 else f"{x / 1e3:+.2f} µs"
    if unit == "bytes":
        return f"{x / 2**30:+.2f} GiB" if abs(x) >= 2**30 else f"{x / 2**20:+.1f} MiB"
    return f"{x:+.3g}"


def find_spikes(window: Window, decomp: Decomposition) -> Spikes:
    """Spikes in the job's step time and the category each one's extra time went to.

    Args:
        window: the window.
        decomp: its decomposition.

    Returns:
        The spikes and their pattern.
    """
    step = job_step_ns(window)
    med = float(nanmedian(step)) if np.isfinite(step).any() else float("nan")
    if not np.isfinite(med) or med <= 0:
        empty = np.zeros(0)
        return Spikes(empty.astype(np.int64), empty, (), float("nan"), float("nan"), 0.0)
    z = (step - med) / robust_scale(step)
    hit = np.isfinite(z) & (z > SPIKE_Z) & (step > (1 + SPIKE_MIN_EXCESS) * med)
    idx = np.flatnonzero(hit)
    cat_mean = nanmean(decomp.ns, axis=1)  # (C, S)
    typical = nanmedian(cat_mean, axis=1)  # (C,)
    cats = []
    for j in idx:
        grow = cat_mean[:, j] - typical
        cats.append(CATEGORIES[int(np.nanargmax(grow))] if np.isfinite(grow).any() else "other")
    steps_hit = window.steps[idx].astype(np.int64)
    if steps_hit.size >= 2:
        gaps = np.diff(steps_hit).astype(np.float64)
        period = float(np.median(gaps))
        cv = float(gaps.std() / gaps.mean()) if gaps.mean() > 0 else float("nan")
    else:
        period, cv = float("nan"), float("nan")
    total = float(np.nansum(step))
    excess = step[idx] - med
    return Spikes(
        steps=steps_hit,
        excess_ns=excess,
        category=tuple(cats),
        period=period,
        interval_cv=cv,
        share_of_time=float(excess.sum() / total) if total > 0 else 0.0,
    )


def _drift(x: np.ndarray) -> np.ndarray:
    """Per rank, (mean of last quarter − mean of first quarter) / mean of first quarter."""
    n = x.shape[1]
    q = max(n // 4, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        a = nanmean(x[:, :q], axis=1)
        b = nanmean(x[:, -q:], axis=1)
        return np.where(a != 0, (b - a) / np.abs(a), np.nan)


def trends(window: Window, decomp: Decomposition) -> Trends:
    """Trends, thermal drift and spikes over the window.

    Args:
        window: the window.
        decomp: its decomposition.

    Returns:
        The over-time analysis.
    """
    step = job_step_ns(window)
    mem = []
    for name in ("mem_reserved", "mem_allocated", "alloc_retries"):
        col = np.where(window.present & (window.memory[name] >= 0), window.memory[name], np.nan)
        mem.append(series_trend(name, nanmedian(col, axis=0)))
    mem.append(series_trend("memory_phase", nanmean(decomp.category("memory"), axis=0)))
    per_cat = tuple(
        series_trend(c, nanmean(decomp.ns[i], axis=0)) for i, c in enumerate(CATEGORIES)
    )
    clock = _drift(window.device["sm_clock_mhz"])
    temp_first = nanmean(window.device["temp_c"][:, : max(step.shape[0] // 4, 1)], axis=1)
    temp_last = nanmean(window.device["temp_c"][:, -max(step.shape[0] // 4, 1) :], axis=1)
    temp = temp_last - temp_first
    thermal = np.zeros(0, dtype=np.int64)
    if np.isfinite(clock).sum() >= 3:
        # A clock that fell well beyond the fleet's own drift (robust z < -4, ≥ 2 % drop).
        spread = robust_scale(clock)
        z = (clock - nanmedian(clock)) / spread
        thermal = np.flatnonzero(np.isfinite(z) & (z < -4.0) & (clock < -0.02)).astype(np.int64)
    return Trends(
        step_time=series_trend("step_time", step),
        memory=tuple(mem),
        per_category=per_cat,
        thermal_ranks=thermal,
        sm_clock_change=clock,
        temp_change_c=temp,
        spikes=find_spikes(window, decomp),
    )
