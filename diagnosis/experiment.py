"""Experiments and accounting (seed: "Write a falsifiable perturbation", "Close the
accounting").

An experiment record states, before the run, the hypothesis, the one change, the
diagnostic metric it should move and in which direction, and the rejection condition.
Given the before and after windows this module says:

- **supported**: the predicted metric moved in the predicted direction beyond noise;
- **rejected**: it did not (or moved the other way);
- **improved_other**: the step time improved although the predicted metric did not move —
  useful, but it does not support the explanation.

It also closes the **accounting**: on the critical path — per step, the largest rank's
value of the category the hypothesis blames — that category should shrink by about the
step-time improvement (within ``ACCOUNTING_TOLERANCE`` of it, allowing for newly exposed
work and measurement error). The mean over ranks would not do: when a straggler is fixed,
the other ranks' compute does not change, their waiting does. It also warns when the mean
improved but the tail got worse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rankscope.diagnosis.baseline import Distribution, distribution, job_step_ns, tail_got_worse
from rankscope.diagnosis.curves import transfer_time
from rankscope.diagnosis.decomposition import CATEGORIES, Decomposition, decompose
from rankscope.diagnosis.exposure import exposed_union, rows_cover_window
from rankscope.diagnosis.regime import since
from rankscope.diagnosis.robust import nanmean, nanmedian, nanpercentile, robust_scale
from rankscope.diagnosis.warmup import warmup_of
from rankscope.diagnosis.window import Window

VERDICTS = ("supported", "rejected", "improved_other")

MIN_MOVE = 0.03
"""A metric must move by at least 3 % of its before value…"""
Z_MOVE = 3.0
"""…and by this many standard errors of the per-step series, to count as moved."""
ACCOUNTING_TOLERANCE = 0.25
"""The predicted categories must account for the step change within 25 % of it."""

ACCOUNTING_CATEGORY: dict[str, str] = {
    "data_imbalance": "compute",
    "slow_device": "compute",
    "numerator_change": "compute",
    "slow_host_input": "input",
    "local_fabric": "exposed_comm",
    "network_rail": "exposed_comm",
    "placement": "exposed_comm",
    "intermittent_congestion": "exposed_comm",
    "checkpoint": "checkpoint",
    "allocator_growth": "memory",
    "pipeline_imbalance": "pipeline_idle",
    "host_pause": "host_gap",
    "cpu_contention": "compute",
    "expert_imbalance": "compute",
    "unexplained_straggler": "host_gap",
}
"""Per hypothesis, the category its fix should shrink on the critical path."""


def _per_step(name: str) -> Callable[[Window, Decomposition], np.ndarray]:
    i = CATEGORIES.index(name)
    return lambda w, d: nanmean(d.ns[i], axis=0)


def _column_max(x: np.ndarray) -> np.ndarray:
    top = np.max(np.where(np.isfinite(x), x, -np.inf), axis=0)
    return np.where(np.isfinite(x).any(axis=0), top, np.nan)


def _compute_max(w: Window, d: Decomposition) -> np.ndarray:
    return _column_max(d.category("compute"))


def _instance_series(values: Callable[[Window], np.ndarray], q: float):
    def series(w: Window, d: Decomposition) -> np.ndarray:
        inst = w.instances
        out = np.full(w.steps.shape[0], np.nan)
        ok = (inst.n_arrived >= inst.n_members) & (inst.n_members >= 2)
        if not ok.any():
            return out
        v = values(w)[ok]
        j = np.searchsorted(w.steps, inst.step[ok])
        for k in range(w.steps.shape[0]):
            sel = j == k
            if sel.any():
                out[k] = float(nanpercentile(v[sel], q))
        return out

    return series


METRICS: dict[str, Callable[[Window, Decomposition], np.ndarray]] = {
    "step_time": lambda w, d: job_step_ns(w),
    **{c: _per_step(c) for c in CATEGORIES},
    "compute_max": _compute_max,
    "entry_spread": _instance_series(lambda w: w.instances.skew, 50),
    "entry_spread_p99": _instance_series(lambda w: w.instances.skew, 99),
    "transfer": _instance_series(lambda w: transfer_time(w.instances), 50),
    "transfer_p99": _instance_series(lambda w: transfer_time(w.instances), 99),
    "attn_max": lambda w, d: _column_max(w.work["attn_cost"]),
}
"""Diagnostic metrics an experiment may predict, each a per-step series (ns, or Σseq²
for ``attn_max``); compared by their medians over steps."""


@dataclass(frozen=True)
class ExperimentSpec:
    """The prediction, written before the run."""

    hypothesis: str
    change: str
    metric: str
    direction: str
    """``down`` or ``up``."""
    rejection: str = ""

    @classmethod
    def from_record(cls, record: Any) -> ExperimentSpec:
        """Accept a mapping or an object with the same fields (e.g. a stored record).

        Raises:
            ValueError: a missing field, an unknown metric or a bad direction.
        """
        get = record.get if isinstance(record, dict) else lambda k, d=None: getattr(record, k, d)
        missing = [k for k in ("hypothesis", "metric", "direction") if not get(k)]
        if missing:
            raise ValueError(f"experiment record misses {missing}")
        spec = cls(
            hypothesis=str(get("hypothesis")),
            change=str(get("change", "") or ""),
            metric=str(get("metric")),
            direction=str(get("direction")),
            rejection=str(get("rejection", "") or ""),
        )
        if spec.metric not in METRICS:
            raise ValueError(f"unknown metric {spec.metric!r}; measurable: {sorted(METRICS)}")
        if spec.direction not in ("down", "up"):
            raise ValueError(f"direction must be 'down' or 'up', got {spec.direction!r}")
        return spec


@dataclass(frozen=True)
class ExperimentResult:
    """What the before and after runs show about the prediction."""

    verdict: str
    """One of ``VERDICTS``."""
    metric: str
    direction: str
    before: float
    after: float
    change: float
    """(after − before) / before."""
    z: float
    """Change in standard errors of the median."""
    moved_as_predicted: bool
    step_before: Distribution
    step_after: Distribution
    step_change_ns: float
    """Median step after − before (negative = faster)."""
    step_improved: bool
    category_deltas: dict[str, float]
    """Mean per rank-step change of every category (ns)."""
    accounting_category: str
    """The category the hypothesis blames ('' for an unknown hypothesis)."""
    predicted_delta_ns: float
    """Change of that category on the critical path (largest rank per step, mean over
    steps)."""
    step_mean_change_ns: float
    """Change of the mean job step time."""
    accounting_closed: bool
    tail_worse: bool
    """The mean improved but p99 or the stall rate got worse."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for an experiment record's ``evaluation``."""
        from rankscope.diagnosis.serialize import plain

        return plain(self)


def _decomp(w: Window) -> Decomposition:
    return decompose(w, exposed_union(w) if rows_cover_window(w) else None)


def _median_se(x: np.ndarray) -> tuple[float, float]:
    x = x[np.isfinite(x)]
    if x.size == 0:
        return float("nan"), float("nan")
    return float(np.median(x)), float(1.253 * robust_scale(x) / np.sqrt(x.size))


def _steady(window: Window) -> Window:
    warm = warmup_of(window)
    return since(window, warm.steps) if warm is not None else window


def evaluate(before: Window, after: Window, record: Any) -> ExperimentResult:
    """Judge one experiment from its before and after windows.

    Args:
        before: window of the run before the change.
        after: window of the run with the one change.
        record: the prediction (`ExperimentSpec`, a mapping, or a stored record).

    Returns:
        The verdict, the accounting and the tail check.

    Raises:
        ValueError: the record names an unknown metric or direction.
    """
    spec = record if isinstance(record, ExperimentSpec) else ExperimentSpec.from_record(record)
    # Warm-up steps say nothing about either run's steady state.
    before, after = _steady(before), _steady(after)
    d_b, d_a = _decomp(before), _decomp(after)
    m_b, se_b = _median_se(METRICS[spec.metric](before, d_b))
    m_a, se_a = _median_se(METRICS[spec.metric](after, d_a))
    change = (m_a - m_b) / abs(m_b) if m_b else float("nan")
    se = float(np.hypot(se_a, se_b))
    z = (m_a - m_b) / se if se > 0 else 0.0
    sign = -1.0 if spec.direction == "down" else 1.0
    moved = bool(np.isfinite(change) and sign * change >= MIN_MOVE and sign * z >= Z_MOVE)
    s_b = distribution(job_step_ns(before))
    s_a = distribution(job_step_ns(after), reference_p50=s_b.p50)
    step_change = s_a.p50 - s_b.p50
    step_se = float(np.hypot(_median_se(job_step_ns(before))[1], _median_se(job_step_ns(after))[1]))
    step_improved = bool(step_change < 0 and -step_change >= max(Z_MOVE * step_se, 0.01 * s_b.p50))
    mean_b, mean_a = d_b.mean_per_step(), d_a.mean_per_step()
    deltas = {c: mean_a[c] - mean_b[c] for c in CATEGORIES}
    cat = ACCOUNTING_CATEGORY.get(spec.hypothesis, "")
    predicted = float("nan")
    if cat:
        crit_b = nanmean(_column_max(d_b.category(cat)))
        crit_a = nanmean(_column_max(d_a.category(cat)))
        predicted = float(crit_a - crit_b)
    step_mean_change = float(nanmean(job_step_ns(after)) - nanmean(job_step_ns(before)))
    closed = bool(
        cat
        and step_mean_change < 0
        and abs(predicted - step_mean_change) <= ACCOUNTING_TOLERANCE * abs(step_mean_change)
    )
    if moved:
        verdict = "supported"
    elif step_improved:
        verdict = "improved_other"
    else:
        verdict = "rejected"
    notes = []
    if moved and not closed and step_improved:
        notes.append(
            f"accounting open: {cat} on the critical path changed {predicted / 1e6:+.2f} ms "
            f"for a step change of {step_mean_change / 1e6:+.2f} ms"
        )
    if verdict == "improved_other":
        notes.append(
            f"step time improved by {-step_change / 1e6:.2f} ms but {spec.metric} did not move "
            f"{spec.direction}: the change works through another mechanism"
        )
    tail = tail_got_worse(s_b, s_a)
    if tail:
        notes.append("mean improved but the tail got worse: calendar throughput may not improve")
    return ExperimentResult(
        verdict=verdict,
        metric=spec.metric,
        direction=spec.direction,
        before=m_b,
        after=m_a,
        change=float(change),
        z=float(z),
        moved_as_predicted=moved,
        step_before=s_b,
        step_after=s_a,
        step_change_ns=float(step_change),
        step_improved=step_improved,
        category_deltas=deltas,
        accounting_category=cat,
        predicted_delta_ns=predicted,
        step_mean_change_ns=step_mean_change,
        accounting_closed=closed,
        tail_worse=tail,
        notes=tuple(notes),
    )


def metric_value(window: Window, metric: str) -> float:
    """The median over steps of one diagnostic metric (for previews and the TUI).

    Args:
        window: the window.
        metric: a name in ``METRICS``.

    Returns:
        The value (NaN when not measurable in this window).
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; measurable: {sorted(METRICS)}")
    return float(nanmedian(METRICS[metric](window, _decomp(window))))
