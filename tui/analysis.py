"""The diagnosis as the TUI shows it: verdict, structure, decomposition, curves, manifest.

`analyse` runs in a worker thread on the slow diagnosis clock and returns plain rows the
panels format. It calls the diagnosis library and only converts units and picks the rows
worth a line on screen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rankscope.diagnosis.window import Window

if TYPE_CHECKING:
    from rankscope.diagnosis.verdict import Hypothesis as RankedHypothesis

NS_PER_MS = 1e6


@dataclass(frozen=True)
class Hypothesis:
    """One ranked explanation."""

    mechanism: str
    """One of the verdict names (``slow_device``, ``data_imbalance``...)."""
    score: float
    evidence: str
    """The evidence in a phrase."""
    next_experiment: str
    ranks: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    supports: str = ""
    """The observation that would support it."""
    rejects: str = ""
    """The observation that would reject it."""


@dataclass(frozen=True)
class StructureRow:
    """One dimension's effect on one per-rank metric."""

    metric: str
    dimension: str
    effect: float
    """ε² (variance explained, corrected for the number of groups)."""
    standout: str
    """The group that stands out."""
    z: float
    """Robust z of the standout group among the groups."""


@dataclass(frozen=True)
class CategoryRow:
    """One decomposition category, mean ms per rank-step."""

    category: str
    current_ms: float
    baseline_ms: float
    """NaN without a baseline."""
    max_rank_ms: float
    """The largest rank's value, averaged over steps."""

    @property
    def delta_ms(self) -> float:
        """Current minus baseline (NaN without a baseline)."""
        return self.current_ms - self.baseline_ms


@dataclass(frozen=True)
class CurveRow:
    """One message-size curve point."""

    group: str
    op: str
    size: str
    count: int
    time_ms: float
    busbw_gbps: float
    baseline_busbw_gbps: float = math.nan


@dataclass(frozen=True)
class ManifestRow:
    """One manifest field that differs from the baseline."""

    field: str
    baseline: str
    current: str


@dataclass(frozen=True)
class AnalysisView:
    """Everything the diagnosis clock produces for the screens."""

    run: str
    baseline_run: str | None
    hypotheses: tuple[Hypothesis, ...] = ()
    """Display rows of `ranked`, same order."""
    ranked: tuple[RankedHypothesis, ...] = field(default=(), repr=False)
    """The engine's hypotheses as ranked (``Diagnosis.verdict.hypotheses``), each with its
    full ``next_experiment`` (change, metric, direction, supports, rejects): what the rerun
    menu and the experiment form start from, so they agree with the verdict line."""
    structure: tuple[StructureRow, ...] = ()
    decomposition: tuple[CategoryRow, ...] = ()
    step_ms: float = math.nan
    baseline_step_ms: float = math.nan
    first_appears: str | None = None
    """Category where the missing time first appears (needs a baseline)."""
    curves: tuple[CurveRow, ...] = ()
    curves_convention: str = ""
    manifest: tuple[ManifestRow, ...] = ()
    """Fields that differ from the baseline's manifest."""
    manifest_fields: tuple[tuple[str, str], ...] = ()
    """This run's manifest, flattened (shown when there is no baseline)."""
    stall: Any = field(default=None, repr=False)
    """``rankscope.diagnosis.stall.Stall`` of the window."""
    diagnosis: Any = field(default=None, repr=False)
    """The full ``rankscope.diagnosis.engine.Diagnosis`` (for snapshots and reports)."""
    note: str = ""
    """What could not be computed, and why."""
    headline: str = ""
    """The what-if of the straggler the verdict is about (``step −12 ms (−9 %) if rank 7
    behaved like the median rank``), empty when localisation found nothing material or the
    top hypothesis is about something else."""


def _fmt_value(value: Any) -> str:
    text = "—" if value is None else str(value)
    return text if len(text) <= 60 else text[:59] + "…"


def structure_rows(correlations: Any) -> tuple[StructureRow, ...]:
    """Every dimension effect across metrics, strongest first.

    Args:
        correlations: ``rankscope.diagnosis.correlate.Correlations``.

    Returns:
        One row per (metric, dimension), by decreasing effect size.
    """
    effects = sorted(correlations.effects, key=lambda e: -e.epsilon2)
    return tuple(
        StructureRow(e.metric, e.dimension, float(e.epsilon2), e.standout, float(e.standout_z))
        for e in effects
    )


def hypothesis_rows(verdict: Any) -> tuple[Hypothesis, ...]:
    """The verdict's hypotheses as display rows (evidence cut to its first observation).

    Args:
        verdict: ``rankscope.diagnosis.verdict.Verdict``.

    Returns:
        Rows in the verdict's order.
    """
    out = []
    for h in verdict.hypotheses:
        nxt = h.next_experiment
        step = ""
        if nxt is not None and nxt.change:
            step = nxt.change if nxt.scope in ("", "none") else f"{nxt.scope}: {nxt.change}"
        out.append(
            Hypothesis(
                mechanism=h.mechanism,
                score=float(h.score),
                evidence=h.evidence[0] if h.evidence else "",
                next_experiment=step,
                ranks=tuple(int(r) for r in h.ranks),
                hosts=tuple(h.hosts),
                supports=nxt.supports if nxt is not None else "",
                rejects=nxt.rejects if nxt is not None else "",
            )
        )
    return tuple(out)


def analyse(
    window: Window, baseline: Window | None = None, now_ns: float | None = None
) -> AnalysisView:
    """Run the diagnosis on a window and keep what the screens show.

    Args:
        window: the current window.
        baseline: the baseline run's window, or None.
        now_ns: the instant (relative to ``window.t0_ns``) the stall check judges; default
            the latest time in the window.

    Returns:
        The analysis view.
    """
    from rankscope.collector.schema import OPS
    from rankscope.diagnosis.baseline import flatten
    from rankscope.diagnosis.curves import CONVENTION, bucket_label
    from rankscope.diagnosis.decomposition import CATEGORIES
    from rankscope.diagnosis.engine import diagnose
    from rankscope.diagnosis.window import NO_COMPLETE_STEP

    if now_ns is None and not window.has_complete_step():
        # Before the first step ends there is nothing to judge (a hang at the first
        # collective is judged on the stall clock, which passes ``now_ns``).
        return AnalysisView(
            run=window.run,
            baseline_run=baseline.run if baseline is not None else None,
            note=NO_COMPLETE_STEP,
        )
    d = diagnose(window, baseline, now_ns)
    cur_mean = d.decomposition.mean_per_step()
    cur_max = d.decomposition.max_rank_per_step()
    base_mean = {r.category: r.baseline_ns for r in d.delta.rows} if d.delta is not None else {}
    rows = tuple(
        CategoryRow(
            c,
            cur_mean[c] / NS_PER_MS,
            base_mean.get(c, math.nan) / NS_PER_MS,
            cur_max[c] / NS_PER_MS,
        )
        for c in CATEGORIES
    )
    names = {gid: g.name for gid, g in window.groups.items()}
    shifted = {(s.group, s.op, s.bucket): s.baseline_busbw_gbps for s in d.curve_shifts}
    curves = d.curves
    curve_rows = []
    for i in range(len(curves)):
        group = names.get(int(curves.group[i]), f"g{int(curves.group[i])}")
        op = OPS[int(curves.op[i])] if 0 <= int(curves.op[i]) < len(OPS) else "?"
        bucket = int(curves.bucket[i])
        curve_rows.append(
            CurveRow(
                group=group,
                op=op,
                size=bucket_label(bucket),
                count=int(curves.count[i]),
                time_ms=float(curves.time_ns[i]) / NS_PER_MS,
                busbw_gbps=float(curves.busbw_gbps[i]),
                baseline_busbw_gbps=shifted.get((group, op, bucket), math.nan),
            )
        )
    step = d.decomposition.step_ns
    base_step = d.delta.step_baseline_ns if d.delta is not None else math.nan
    return AnalysisView(
        run=window.run,
        baseline_run=d.baseline_run,
        hypotheses=hypothesis_rows(d.verdict),
        ranked=tuple(d.verdict.hypotheses),
        structure=structure_rows(d.correlations),
        decomposition=rows,
        step_ms=float(np.nanmean(step)) / NS_PER_MS if np.isfinite(step).any() else math.nan,
        baseline_step_ms=base_step / NS_PER_MS,
        first_appears=d.delta.first_appears if d.delta is not None else None,
        curves=tuple(curve_rows),
        curves_convention=CONVENTION,
        manifest=tuple(
            ManifestRow(c.field, _fmt_value(c.baseline), _fmt_value(c.current))
            for c in d.comparison.manifest
        ),
        manifest_fields=tuple(
            (k, _fmt_value(v)) for k, v in sorted(flatten(window.manifest).items())
        ),
        stall=d.stall,
        diagnosis=d,
        headline=what_if_headline(d),
    )


def what_if_headline(d: Any) -> str:
    """The localisation's what-if when it is about the top hypothesis: the suspect shares
    a rank with it, or it is the open-world straggler itself.

    Args:
        d: ``rankscope.diagnosis.engine.Diagnosis``.

    Returns:
        The headline, or "".
    """
    found = d.finding
    if found is None or not found.material or found.suspect is None:
        return ""
    top = d.verdict.top
    s = found.suspect
    if top.mechanism == "unexplained_straggler" or set(top.ranks) & set(s.ranks):
        cat = f", extra time in {s.category}" if s.category else ""
        return s.what_if() + cat
    return ""
