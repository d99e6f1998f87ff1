"""Warm-up: the slow first steps of a healthy run, recognised and set aside.

The first steps of a training run are slower for every rank: communicators are set up,
the allocator grows its pools, kernels are compiled or autotuned, caches are cold. They
say nothing about the job's steady state, yet read naively they look like faults:
consecutive slow steps become "periodic spikes every 1 step" (a checkpoint), a step time
that falls after them becomes a regime change, and a trend over the window a drift.

The rule, on the job's step time (the median rank's, per step): the warm-up is the block
of steps at the start of the window that lie above the steady band, where the steady
level and its spread come from the steps after the first `MAX_SHARE` of the window:

- a step is *out* when it exceeds the steady median by ``max(SIGMAS × σ, MIN_EXCESS ×
  median)`` (σ: robust spread of the steady steps);
- the block is the leading run of out steps, allowing one in-band step inside it (a
  second graph compiled a step later) when the step after it is slow like the block
  (`RESUME`; on a busy machine a step just past the band after an in-band one is noise),
  and holds at most `MAX_SHARE` of the window;
- a block of one step counts only when no later step is out by as much: one slow step
  followed by others like it is the first of a recurring pattern (checkpoints), not a
  warm-up.

It needs no step ids: a window that starts mid-run shows no slow leading block, and one
that starts after a restart shows the restart's own warm-up, which is set aside the same
way. Everything the diagnosis reads is then of the steps after it; the report says how
many steps were set aside and how much slower they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.diagnosis.regime import job_step_ns
from rankscope.diagnosis.robust import robust_scale
from rankscope.diagnosis.window import Window

SIGMAS = 6.0
"""Distance above the steady median, in robust standard deviations of the steady steps…"""
MIN_EXCESS = 0.2
"""…and at least this fraction of the steady median (a slow first step of a warm-up is
typically several times the steady one; a 20 % floor keeps noise out)."""
RESUME = 0.25
"""A step after an in-band one continues the warm-up only when its excess over the steady
median is at least this share of the block's so far."""
MAX_SHARE = 1.0 / 3.0
"""Largest share of the window a warm-up may take; the steady level is read after it."""
MIN_STEADY = 6
"""Steady steps needed after the warm-up to know the steady level."""


@dataclass(frozen=True)
class Warmup:
    """The warm-up steps at the start of a window."""

    steps: int
    """Steps set aside (the first ``steps`` columns of the window)."""
    first_step: int
    """Step id of the first steady step."""
    warm_ns: float
    """Median job step time of the warm-up steps."""
    steady_ns: float
    """Median job step time of the steady steps."""

    @property
    def ratio(self) -> float:
        """How many times slower the warm-up steps were (median)."""
        return self.warm_ns / self.steady_ns if self.steady_ns > 0 else float("nan")

    def describe(self) -> str:
        """One line for the report."""
        return (
            f"warm-up: the first {self.steps} step(s) ran {self.ratio:.1f}x the steady step "
            f"({self.warm_ns / 1e6:,.1f} vs {self.steady_ns / 1e6:,.1f} ms); set aside, the "
            f"diagnosis reads steps {self.first_step} on"
        )


def warmup_length(series: np.ndarray) -> int:
    """How many leading steps of a job step-time series are warm-up (rule above).

    Args:
        series: float (S,) job step times in step order; NaN for steps not seen.

    Returns:
        The number of leading steps to set aside (0 when there is no warm-up).
    """
    y = np.asarray(series, dtype=np.float64)
    limit = int(y.size * MAX_SHARE)
    if limit < 1 or y.size - limit < MIN_STEADY:
        return 0
    steady = y[limit:]
    steady = steady[np.isfinite(steady)]
    if steady.size < MIN_STEADY:
        return 0
    med = float(np.median(steady))
    if not med > 0:
        return 0
    sigma = float(robust_scale(steady))
    sigma = sigma if np.isfinite(sigma) else 0.0
    bar = med + max(SIGMAS * sigma, MIN_EXCESS * med)
    out = np.isfinite(y) & (y > bar)
    if not out[0]:
        return 0
    k, gap = 0, 0
    for i in range(limit):
        if out[i] and gap and y[i] - med < RESUME * (float(np.median(y[:k])) - med):
            break  # past the band by noise, not slow like the warm-up before the gap
        if out[i]:
            k, gap = i + 1, 0
        else:
            gap += 1
            if gap > 1:
                break
    if k == 1:
        later = y[1:][np.isfinite(y[1:])]
        if later.size and float(later.max()) - med >= 0.5 * (float(y[0]) - med):
            return 0
    return k


def find_warmup(window_steps: np.ndarray, job_step: np.ndarray) -> Warmup | None:
    """The warm-up of a window from its step ids and job step times.

    Args:
        window_steps: int64 (S,) step ids.
        job_step: float (S,) the job's step time per step (`regime.job_step_ns`).

    Returns:
        The warm-up, or None.
    """
    k = warmup_length(job_step)
    if k == 0:
        return None
    warm = job_step[:k][np.isfinite(job_step[:k])]
    steady = job_step[k:][np.isfinite(job_step[k:])]
    return Warmup(
        steps=k,
        first_step=int(window_steps[k]),
        warm_ns=float(np.median(warm)),
        steady_ns=float(np.median(steady)),
    )


def warmup_of(window: Window) -> Warmup | None:
    """`find_warmup` of a `Window`."""
    return find_warmup(window.steps, job_step_ns(window))
