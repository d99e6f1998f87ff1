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

The job's step time is not the only place a regime shows. In a synchronous job every rank
waits for each step's worst rank, so the step time's healthy spread grows with the world
size (the largest of more ranks' compute spikes), while one throttled GPU adds the same
few milliseconds at any size: at thousands of ranks its shift can sit inside the step
time's noise for good, although the rank arrives late at every collective of every step.
When the step time shows no regime, the same rule is asked of *arrivals*
(`arrival_start`): each rank's lateness per step (``coll["late_ns"]``) over that of the
step's median rank. A rank whose excess lateness moved as a level (``SHIFT_SIGMAS`` σ of
its own earlier steps, σ no less than the typical rank's, and at least ``MIN_SHIFT`` of the
job's median step), every new step beyond it, with no drift before, starts a regime —
unless such a run is explained by the run's own excursions: with ``p`` the share of
earlier (rank, step) cells as far beyond their rank's level as every new step is
(Laplace-smoothed, from the same evenly spaced ranks as the step time), a run on one of
``R`` ranks arises by chance with odds about ``R p^MIN_AFTER`` (a rank's lateness persists
from step to step, so a longer run is not taken as rarer), which must stay below
``RUN_CHANCE``; and the job's step time before it must not already trend upward
(``MAX_DRIFT_RHO``, as for the step-time rule: a drifting job is read by the trends). A compute spike makes one rank late for one step, so spikes keep ``p``
honest and rarely make a run; a throttled GPU is late in every step. Warm-up steps
(`warmup`) are no part of the earlier steps here: everyone is late then.
"""

from __future__ import annotations

import bisect
import dataclasses
import warnings
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
    rank: int | None = None
    """The rank whose lateness shifted, when the regime was found from arrivals
    (`arrival_start`: the step time moved less than its own noise); None when the step
    time itself shifted."""

    @property
    def change(self) -> float:
        """Relative change of the median step time (+0.25 = 25 % slower)."""
        return self.after_ns / self.before_ns - 1.0

    def describe(self) -> str:
        """One line for the verdict's evidence."""
        word = "slower" if self.change > 0 else "faster"
        if self.rank is not None:
            return (
                f"rank {self.rank} arrives late from step {self.start_step} (step time median {self.before_ns / 1e6:,.1f} → "
                f"{self.after_ns / 1e6:,.1f} ms, {abs(self.change):.0%} {word}); the verdict "
                f"reads the {self.steps} step(s) since"
            )
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


MAX_ARRIVAL_CANDIDATES = 16
"""Most ranks whose arrivals `arrival_start` tests in full, the latest first (a bound on
the cost of a call, which the view makes every frame; a straggler is among the latest)."""


def _column_median(x: np.ndarray) -> np.ndarray:
    """Per column, the median of the finite entries (NaN where none)."""
    if np.isfinite(x).all():
        return np.median(x, axis=0)
    out = np.full(x.shape[1], np.nan)
    seen = np.isfinite(x).any(axis=0)
    if seen.any():
        out[seen] = np.nanmedian(x[:, seen], axis=0)
    return out


def arrival_start(late: np.ndarray, step_ns: np.ndarray, first: int = 0) -> tuple[int, int] | None:
    """Where a rank's lateness shifted as a level (the module docstring's second rule).

    Args:
        late: float (R, S) each rank's Σ lateness per step (``coll["late_ns"]``), NaN where
            the rank did not report the step; columns in step order, without gaps.
        step_ns: float (S,) the job's step time of the same columns (`job_step_ns`).
        first: columns before this one (a warm-up) are no part of the earlier steps.

    Returns:
        ``(index of the regime's first column, rank)``, or None.
    """
    late = np.asarray(late, dtype=np.float64)
    n_ranks, n_steps = late.shape
    if n_steps - first < MIN_BEFORE + MIN_AFTER or n_ranks < 2:
        return None
    every = max(1, n_ranks // MEDIAN_RANKS)
    # Lateness over the step's median rank: what the whole job shares (a warm-up step, a
    # slow collective everyone waits in) is no rank's own.
    ref = _column_median(late[::every])
    if not np.isfinite(ref[first:]).all():
        return None
    floor = MIN_STEP_SHIFT * float(np.min(step_ns[first:]))
    # Screen: the newest steps' excess over the rank's mean excess before them (cheap, one
    # pass; the mean is only the order in which ranks are tested in full).
    # Column by column over the few newest steps (a reduction along that short axis costs
    # several times more at 65,536 ranks); a rank with an unknown one among them (its sum
    # is not finite) is no candidate.
    tail = late[:, n_steps - MIN_AFTER :]
    newest = tail[:, 0] - ref[n_steps - MIN_AFTER]
    for c in range(1, MIN_AFTER):
        np.minimum(newest, tail[:, c] - ref[n_steps - MIN_AFTER + c], out=newest)
    newest[~np.isfinite(np.einsum("ij->i", tail))] = -np.inf
    earlier = late[:, first : n_steps - MIN_AFTER]
    # In order along the steps; NaN for a rank that missed a step: redone below.
    mean_before = np.einsum("ij->i", earlier) / max(earlier.shape[1], 1)
    gaps = ~np.isfinite(mean_before)
    if gaps.any():
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean_before[gaps] = np.nanmean(earlier[gaps], axis=1)
    proxy = newest - (mean_before - float(ref[first : n_steps - MIN_AFTER].mean()))
    cand = np.flatnonzero(np.isfinite(proxy) & (proxy > floor))
    if not cand.size:
        return None
    cand = cand[np.argsort(-proxy[cand], kind="stable")][:MAX_ARRIVAL_CANDIDATES]
    sampled = late[::every] - ref
    # A rank's spread is read from a few steps, and the latest of thousands of ranks is
    # often one whose few steps happened to lie close: its spread is taken as no less than
    # the typical rank's, so chance pairs of high steps in a wide job are no shift.
    typical = sampled[:, first : n_steps - MIN_AFTER]
    typical = typical - _column_median(typical.T)[:, None]
    with np.errstate(all="ignore"):
        spread = 1.4826 * _column_median(np.abs(typical).T)
    spread = spread[np.isfinite(spread)]
    sigma_job = float(np.median(spread)) if spread.size else 0.0
    # Every new step must lie this far beyond the earlier median, whatever the start: a
    # running median screens the starts before any start pays for the full test.
    bar = max(STEP_SIGMAS * sigma_job, floor)
    for rank in cand.tolist():
        series = late[rank] - ref
        lo = np.minimum.accumulate(series[::-1])[::-1]  # NaN once a newer step is unknown
        ordered: list[float] = []
        for k in range(first, n_steps - MIN_AFTER + 1):
            if k > first and np.isfinite(series[k - 1]):
                bisect.insort(ordered, float(series[k - 1]))
            n = len(ordered)
            if k < first + MIN_BEFORE or n < MIN_BEFORE:
                continue
            run_med = ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
            if not lo[k] - run_med > bar:
                continue
            before = series[first:k]
            before = before[np.isfinite(before)]
            after = series[k:]
            med = float(np.median(before))
            job = float(np.median(step_ns[first:k]))
            if float(after.min()) - med <= MIN_STEP_SHIFT * job:
                continue
            sigma = max(1.4826 * float(np.median(np.abs(before - med))), sigma_job)
            level = max(SHIFT_SIGMAS * sigma, MIN_SHIFT * job)
            moved = float(np.median(after)) - med
            each = max(STEP_SIGMAS * sigma, MIN_STEP_SHIFT * job, 0.5 * moved)
            if not (moved > level and np.all(after - med > each)):
                continue
            if _rank_trend(before) > MAX_DRIFT_RHO:
                continue
            # Could the run be the job's own excursions on one of its ranks? Cells as far
            # beyond their own rank's level as every new step is, among the earlier steps of
            # evenly spaced ranks. A rank's lateness is not independent from step to step (its inputs and its
            # neighbours persist), so a longer run is not taken as rarer: its chance is
            # bounded by that of its first MIN_AFTER steps.
            cells = sampled[:, first:k]
            known = np.isfinite(cells)
            own = _column_median(cells.T)[:, None]
            far = float(after.min()) - med
            n_out = int(np.count_nonzero(known & (cells - own >= far)))
            p_out = (n_out + 1) / (int(known.sum()) + 2)
            if n_ranks * p_out**MIN_AFTER > RUN_CHANCE:
                continue
            return k, int(rank)
    return None


def current_regime(window: Window) -> Regime | None:
    """The start of the current regime, when the step time shifted inside the window, or
    else a rank's arrivals did (`arrival_start`).

    Args:
        window: the window.

    Returns:
        The regime, or None when the window is one regime (or too short to tell).
    """
    y = job_step_ns(window)
    ok = np.flatnonzero(np.isfinite(y))
    vals = y[ok]
    found = regime_start(vals)
    rank = None
    late = window.coll.get("late_ns")
    if found is None and late is not None and late.shape[1] == y.size:
        # Imported here: the warm-up reads the job step time from this module.
        from rankscope.diagnosis.warmup import warmup_length

        warm = warmup_length(vals)
        hit = arrival_start(late if ok.size == y.size else late[:, ok], vals, first=warm)
        # A job whose step time was already rising before it is drifting (allocator
        # growth, heat): the trend analysis reads that over the whole window, and a rank
        # late at the end of it is no new level (the step-time rule's drift test).
        if hit is not None and _rank_trend(vals[warm : hit[0]]) <= MAX_DRIFT_RHO:
            found, rank = hit
    if found is None:
        return None
    col = int(ok[found])
    return Regime(
        start_step=int(window.steps[col]),
        start_index=col,
        steps=int(ok.size - found),
        before_ns=float(np.median(vals[:found])),
        after_ns=float(np.median(vals[found:])),
        rank=rank,
    )


def since(window: Window, first_index: int, stop_index: int | None = None) -> Window:
    """The window restricted to its columns from ``first_index`` on (up to ``stop_index``,
    exclusive: the window as it stood when that step arrived).

    Args:
        window: the window.
        first_index: first column kept.
        stop_index: first column left out (None: to the end).

    Returns:
        A window of those steps: every per-rank-step array, the instances and the raw
        rows of those steps.
    """
    cols = slice(first_index, stop_index)
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
        reduced=grid(window.reduced),
    )
