"""Distributions against a baseline run, and the field-by-field manifest diff.

The job's step time per step is the median over ranks of ``t_end - t_start`` (ranks of a
synchronous job finish together; the median ignores a rank that reported late). A **tail
stall** is a step longer than ``TAIL_STALL`` × the baseline's median step (× the run's own
median without a baseline): a mean can improve while these get worse, and they cost
calendar throughput all the same (seed: "Validate over time").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rankscope.diagnosis.robust import nanmedian
from rankscope.diagnosis.window import Window

TAIL_STALL = 2.0
"""A step longer than this many median steps is a tail stall."""


@dataclass(frozen=True)
class Distribution:
    """Summary of a per-step time series (ns)."""

    n: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float
    tail_stalls: int
    """Steps longer than ``TAIL_STALL`` × the reference median."""
    stall_threshold: float
    """The threshold used (ns)."""


def job_step_ns(window: Window) -> np.ndarray:
    """Per step the job's step time: median over present ranks of ``t_end - t_start``.

    Args:
        window: the window.

    Returns:
        float64 (S,); NaN for a step no rank reported.
    """
    step = np.where(window.present, window.step_ns, np.nan)
    return nanmedian(step, axis=0)


def distribution(x: np.ndarray, reference_p50: float | None = None) -> Distribution:
    """p50/p90/p99/max and the tail-stall count of a series.

    Args:
        x: float values (NaN ignored).
        reference_p50: the median that defines a stall (default: the series' own).

    Returns:
        The summary (NaN fields when the series is empty).
    """
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        nan = float("nan")
        return Distribution(0, nan, nan, nan, nan, nan, 0, nan)
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    ref = float(p50) if reference_p50 is None or not np.isfinite(reference_p50) else reference_p50
    thr = TAIL_STALL * ref
    return Distribution(
        n=int(x.size),
        mean=float(x.mean()),
        p50=float(p50),
        p90=float(p90),
        p99=float(p99),
        max=float(x.max()),
        tail_stalls=int((x > thr).sum()),
        stall_threshold=float(thr),
    )


@dataclass(frozen=True)
class ManifestChange:
    """One manifest field that differs (``None`` on the side where it is absent)."""

    field: str
    """Dotted path, e.g. ``env.NCCL_ALGO`` or ``config.micro_batch``."""
    baseline: Any
    current: Any


def flatten(manifest: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested maps into dotted keys (lists are compared whole).

    Args:
        manifest: nested map of plain values.
        prefix: key prefix (for recursion).

    Returns:
        ``{"a.b.c": value}``.
    """
    out: dict[str, Any] = {}
    for key, value in manifest.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


SIMULATOR_ONLY = ("sim.truth", "sim.spec")
"""Manifest fields a simulated run carries for scoring and for reruns. They name the
injected fault, so the diagnosis never reads them, and the diff leaves them out."""


def manifest_diff(current: dict[str, Any], baseline: dict[str, Any]) -> tuple[ManifestChange, ...]:
    """Field-by-field difference of two manifests.

    Args:
        current: manifest of the run under study.
        baseline: manifest of the healthy run.

    Returns:
        Changed, added and removed fields, sorted by field name.
    """
    a = flatten(baseline)
    b = flatten(current)
    out = []
    for key in sorted(set(a) | set(b)):
        if key.startswith(SIMULATOR_ONLY):
            continue
        if a.get(key) != b.get(key) or (key in a) != (key in b):
            out.append(ManifestChange(key, a.get(key), b.get(key)))
    return tuple(out)


@dataclass(frozen=True)
class BaselineComparison:
    """Step-time distributions of the run and its baseline."""

    current: Distribution
    baseline: Distribution | None
    p50_ratio: float
    """current p50 / baseline p50 (NaN without a baseline)."""
    p99_ratio: float
    max_ratio: float
    manifest: tuple[ManifestChange, ...]
    mean_improved_tail_worse: bool
    """The mean got better than the baseline while p99 or the stall count got worse."""


def compare_runs(window: Window, baseline: Window | None = None) -> BaselineComparison:
    """Compare step-time distributions (and manifests) with the baseline run.

    Args:
        window: the run under study.
        baseline: the healthy run, or None.

    Returns:
        The comparison; without a baseline only ``current`` is filled.
    """
    cur_steps = job_step_ns(window)
    if baseline is None:
        return BaselineComparison(
            current=distribution(cur_steps),
            baseline=None,
            p50_ratio=float("nan"),
            p99_ratio=float("nan"),
            max_ratio=float("nan"),
            manifest=(),
            mean_improved_tail_worse=False,
        )
    base = distribution(job_step_ns(baseline))
    cur = distribution(cur_steps, reference_p50=base.p50)
    return BaselineComparison(
        current=cur,
        baseline=base,
        p50_ratio=cur.p50 / base.p50 if base.p50 > 0 else float("nan"),
        p99_ratio=cur.p99 / base.p99 if base.p99 > 0 else float("nan"),
        max_ratio=cur.max / base.max if base.max > 0 else float("nan"),
        manifest=manifest_diff(window.manifest, baseline.manifest),
        mean_improved_tail_worse=tail_got_worse(base, cur),
    )


def tail_got_worse(before: Distribution, after: Distribution) -> bool:
    """The mean improved but the tail (p99 or tail-stall count) got worse.

    Args:
        before: distribution before the change (its p50 defines stalls for both).
        after: distribution after, computed with ``reference_p50=before.p50``.

    Returns:
        True when ``after.mean < before.mean`` and (p99 or stalls) rose.
    """
    if not (np.isfinite(before.mean) and np.isfinite(after.mean)):
        return False
    # Stall counts are compared as rates: the runs may have different lengths.
    rate_b = before.tail_stalls / max(before.n, 1)
    rate_a = after.tail_stalls / max(after.n, 1)
    return after.mean < before.mean and (after.p99 > before.p99 or rate_a > rate_b)
