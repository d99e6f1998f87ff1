"""Where the current regime of a run starts: a level shift in step time inside the window.

A fault that begins mid-run (a GPU that starts throttling, a link that degrades) leaves
the window with two regimes: healthy steps, then slow ones. Every pooled statistic of the
window — the modal slowest rank, the last-arrival counts, the trend — is then dominated by
the longer, older regime, and names the fault only once it fills most of the window. The
method asks "when did it start?" before "why?"; this module answers the first so that the
second is asked of the steps that matter.

The rule, on the job's step time (the median rank's, per step):

- the *current regime* starts at the earliest step ``s`` such that the steps from ``s`` on
  have moved, as a level, farther than ``max(SHIFT_SIGMAS × σ, MIN_SHIFT × median)`` from
  the earlier steps' median (σ: robust spread of the earlier steps), and every one of them
  lies on that side farther than ``max(STEP_SIGMAS × σ, MIN_STEP_SHIFT × median)`` and
  than half the shift of their median: a level shift seen in every step, not a few
  outliers (one large spike after a modest step is two excursions, not a level);
- at least ``MIN_BEFORE`` steps precede it and at least ``MIN_AFTER`` follow it (one odd
  step is a hiccup, not a regime);
- the new steps are not one more burst of a recurring pattern: if a share ``p`` of the
  earlier steps were that far out on the same side (Laplace-smoothed), a run of ``k``
  such steps in a row arises by chance with odds ``p^k``, which must stay below
  ``RUN_CHANCE``. A clean history lets two steps make a regime; a heavy-tailed one needs
  a run its own bursts cannot explain (three or four steps), so a fault that starts in a
  noisy run is still found within a few steps, and two bursts in a row are not a level;
- the earlier steps do not already trend that way (ρ ≤ ``MAX_DRIFT_RHO``: a drift is not
  a new level).

A periodic spike (checkpoints) or a burst never qualifies: the steps between spikes return
to the earlier level. A slow drift (allocator growth) does not either: its earlier steps
already trend, and the trend analysis reads it over the whole window.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

import numpy as np

from rankscope.diagnosis.window import CollRows, InstanceTable, Window

MEDIAN_RANKS = 256
"""Most ranks whose median makes a step's job step time (a level shift of the whole job
shows in any few hundred of them)."""
MIN_BEFORE = 6
"""Steps of the earlier regime needed to know its level."""
MIN_AFTER = 2
"""Steps of the new regime needed to call it one."""
SHIFT_SIGMAS = 4.0
"""Distance of the new level (median) from the earlier one, in robust standard deviations
of the earlier steps."""
MIN_SHIFT = 0.03
"""...and at least this fraction of the earlier median (a regime change users care about)."""
STEP_SIGMAS = 2.0
"""Distance of every step of the new regime from the earlier level, in the same σ."""
MIN_STEP_SHIFT = 0.015
"""...and at least this fraction of the earlier median."""
MAX_DRIFT_RHO = 0.5
"""Earlier steps trending toward the new level this strongly (Spearman ρ with time) make it
a drift, which the trend analysis reads, not a regime."""
RUN_CHANCE = 0.01
"""Largest chance that the new steps are a run of the earlier steps' own excursions (see
the module docstring)."""


@dataclass(frozen=True)
class Regime:
    """The current regime of a window whose step time shifted."""

    start_step: int
    """First step id of the current regime."""
    start_index: int
    """Its column in the window."""
    steps: int
    """Steps in the current regime."""
    before_ns: float
    """Median step time of the earlier steps."""
    after_ns: float
    """Median step time of the current regime."""

    @property
    def change(self) -> float:
        """Relative change of the median step time (+0.25 = 25 % slower)."""
        return self.after_ns / self.before_ns - 1.0

    def describe(self) -> str:
        """One line for the verdict's evidence."""
        word = "slower" if self.change > 0 else "faster"
        return (
            f"step time changed at step {self.start_step}: median {self.before_ns / 1e6:,.1f} "
            f"→ {self.after_ns / 1e6:,.1f} ms ({abs(self.change):.0%} {word}); the verdict "
            f"reads the {self.steps} step(s) since"
        )


def job_step_ns(window: Window) -> np.ndarray:
    """Per step, the median rank's step time (of at most ``MEDIAN_RANKS`` evenly spaced
    ranks; NaN where none of them reported).

    Args:
        window: the window.

    Returns:
        float64 (S,).
    """
    # Ranks of a synchronous job share the step time; an even subsample of them keeps the
    # median exact enough and the cost flat at 16k ranks (the view calls this every frame).
    every = max(1, window.present.shape[0] // MEDIAN_RANKS)
    present = window.present[::every]
    step = np.where(present, window.t_end[::every] - window.t_start[::every], np.nan)
    known = np.isfinite(step)
    if known.all():
        return np.median(step, axis=0)
    out = np.full(step.shape[1], np.nan)
    seen = known.any(axis=0)  # a step still open has no end yet
    if seen.any():
        out[seen] = np.nanmedian(step[:, seen], axis=0)
    return out


def _shift(before: np.ndarray, after: np.ndarray) -> tuple[bool, bool]:
    """Whether the ``after`` steps moved as a level beyond the earlier one on one side, and
    whether the earlier steps were clean of excursions that far out on that side."""
    med = float(np.median(before))
    sigma = 1.4826 * float(np.median(np.abs(before - med)))
    level = max(SHIFT_SIGMAS * sigma, MIN_SHIFT * med)
    each = max(STEP_SIGMAS * sigma, MIN_STEP_SHIFT * med)
    moved = float(np.median(after)) - med
    for side in (1.0, -1.0):
        # A new level: every new step beyond the floor, and none below half the median
        # shift (one large spike after a modest step is two excursions, not a level).
        beyond = np.maximum(each, 0.5 * side * moved)
        if side * moved > level and np.all(side * (after - med) > beyond):
            # Excursions that already happened before are a recurring pattern (bursts,
            # periodic spikes), and earlier steps already rising toward the new level are
            # a drift (allocator growth, heat): neither is a new level.
            n_out = int(np.count_nonzero(side * (before - med) > level))
            p_out = (n_out + 1) / (before.size + 2)
            recurring = p_out**after.size > RUN_CHANCE
            return True, not recurring and side * _rank_trend(before) <= MAX_DRIFT_RHO
    return False, False


def _rank_trend(x: np.ndarray) -> float:
    """Spearman ρ of a series with its index (ties broken by order)."""
    n = x.size
    ranks = np.empty(n)
    ranks[np.argsort(x, kind="stable")] = np.arange(n)
    idx = np.arange(n) - (n - 1) / 2.0
    return float(np.dot(ranks - (n - 1) / 2.0, idx) / np.dot(idx, idx))


def regime_start(series: np.ndarray) -> int | None:
    """Where the current regime of a step-time series starts (the rule above).

    Args:
        series: float (S,) step times in step order, without gaps.

    Returns:
        The index of the regime's first step, or None.
    """
    vals = np.asarray(series, dtype=np.float64)
    if vals.size < MIN_BEFORE + MIN_AFTER:
        return None
    # The longest candidate regime whose steps lie beyond the level of the steps before
    # it, with those earlier steps clean. Every start is tried: a later candidate's
    # "earlier steps" hold the regime's own first steps, which widen their spread and can
    # hide a shift that the true start shows plainly. A start can qualify only if its
    # whole suffix lies MIN_STEP_SHIFT beyond the median of the steps before it (that
    # floor is never undercut): a running median screens the starts cheaply, and only
    # those passing pay for the full test.
    lo = np.minimum.accumulate(vals[::-1])[::-1]
    hi = np.maximum.accumulate(vals[::-1])[::-1]
    ordered = sorted(vals[:MIN_BEFORE].tolist())
    for k in range(MIN_BEFORE, vals.size - MIN_AFTER + 1):
        if k > MIN_BEFORE:
            bisect.insort(ordered, float(vals[k - 1]))
        half = k // 2
        med = ordered[half] if k % 2 else 0.5 * (ordered[half - 1] + ordered[half])
        if lo[k] <= med * (1 + MIN_STEP_SHIFT) and hi[k] >= med * (1 - MIN_STEP_SHIFT):
            continue
        shifted, clean = _shift(vals[:k], vals[k:])
        if not (shifted and clean):
            continue
        if k == MIN_BEFORE and _shift(vals[: k - 1], vals[k - 1 :])[0]:
            # Still extending at the first usable step: its start (and the level before
            # it) lies outside what the series shows.
            return None
        return k
    return None


def current_regime(window: Window) -> Regime | None:
    """The start of the current regime, when the step time shifted inside the window.

    Args:
        window: the window.

    Returns:
        The regime, or None when the window is one regime (or too short to tell).
    """
    y = job_step_ns(window)
    ok = np.flatnonzero(np.isfinite(y))
    vals = y[ok]
    found = regime_start(vals)
    if found is None:
        return None
    col = int(ok[found])
    return Regime(
        start_step=int(window.steps[col]),
        start_index=col,
        steps=int(ok.size - found),
        before_ns=float(np.median(vals[:found])),
        after_ns=float(np.median(vals[found:])),
    )


def since(window: Window, first_index: int) -> Window:
    """The window restricted to its columns from ``first_index`` on.

    Args:
        window: the window.
        first_index: first column kept.

    Returns:
        A window of the later steps: every per-rank-step array, the instances and the raw
        rows of those steps.
    """
    cols = slice(first_index, None)
    kept = window.steps[cols]

    def by_step(table: InstanceTable | CollRows) -> InstanceTable | CollRows:
        mask = np.isin(table.step, kept)
        return dataclasses.replace(
            table, **{f.name: getattr(table, f.name)[mask] for f in dataclasses.fields(table)}
        )

    def grid(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: v[:, cols] for k, v in d.items()}

    instances = by_step(window.instances)
    rows = by_step(window.rows) if window.rows is not None else None
    assert isinstance(instances, InstanceTable)
    assert rows is None or isinstance(rows, CollRows)
    return dataclasses.replace(
        window,
        steps=kept,
        present=window.present[:, cols],
        t_start=window.t_start[:, cols],
        t_end=window.t_end[:, cols],
        phase_ns=grid(window.phase_ns),
        work=grid(window.work),
        memory=grid(window.memory),
        device=grid(window.device),
        coll=grid(window.coll),
        instances=instances,
        rows=rows,
        host=grid(window.host),
        phase_cpu_ns=grid(window.phase_cpu_ns),
    )
