"""The diagnosis as the TUI shows it: verdict, structure, decomposition, curves, manifest.

`analyse` runs in a worker thread on the slow diagnosis clock and returns plain rows the
panels format. It calls the diagnosis library and only converts units and picks the rows
worth a line on screen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rankscope.diagnosis.window import Window

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
    note: str = ""
    """What could not be computed, and why."""


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
    from rankscope.diagnosis.baseline import flatten, manifest_diff
    from rankscope.diagnosis.correlate import correlate
    from rankscope.diagnosis.critical import critical_path
    from rankscope.diagnosis.curves import CONVENTION, bucket_label, message_curves
    from rankscope.diagnosis.decomposition import CATEGORIES, decompose
    from rankscope.diagnosis.stall import detect_stall

    decomp = decompose(window)
    base_decomp = decompose(baseline) if baseline is not None else None
    cur_mean = decomp.mean_per_step()
    cur_max = decomp.max_rank_per_step()
    base_mean = base_decomp.mean_per_step() if base_decomp is not None else {}
    rows = tuple(
        CategoryRow(
            c,
            cur_mean[c] / NS_PER_MS,
            base_mean.get(c, math.nan) / NS_PER_MS,
            cur_max[c] / NS_PER_MS,
        )
        for c in CATEGORIES
    )
    first = None
    if base_decomp is not None:
        grown = [r for r in rows if np.isfinite(r.delta_ms) and r.delta_ms > 0]
        first = max(grown, key=lambda r: r.delta_ms).category if grown else None
    crit = critical_path(window, decomp)
    corr = correlate(window, decomp, crit)

    curves = message_curves(window.instances)
    names = {gid: g.name for gid, g in window.groups.items()}
    from rankscope.collector.schema import OPS

    curve_rows = tuple(
        CurveRow(
            group=names.get(int(curves.group[i]), f"g{int(curves.group[i])}"),
            op=OPS[int(curves.op[i])] if 0 <= int(curves.op[i]) < len(OPS) else "?",
            size=bucket_label(int(curves.bucket[i])),
            count=int(curves.count[i]),
            time_ms=float(curves.time_ns[i]) / NS_PER_MS,
            busbw_gbps=float(curves.busbw_gbps[i]),
        )
        for i in range(len(curves))
    )
    manifest: tuple[ManifestRow, ...] = ()
    if baseline is not None:
        manifest = tuple(
            ManifestRow(c.field, _fmt_value(c.baseline), _fmt_value(c.current))
            for c in manifest_diff(window.manifest, baseline.manifest)
        )
    step = float(np.nanmean(decomp.step_ns)) if np.isfinite(decomp.step_ns).any() else math.nan
    base_step = math.nan
    if base_decomp is not None and np.isfinite(base_decomp.step_ns).any():
        base_step = float(np.nanmean(base_decomp.step_ns))
    return AnalysisView(
        run=window.run,
        baseline_run=baseline.run if baseline is not None else None,
        hypotheses=(),
        structure=structure_rows(corr),
        decomposition=rows,
        step_ms=step / NS_PER_MS,
        baseline_step_ms=base_step / NS_PER_MS,
        first_appears=first,
        curves=curve_rows,
        curves_convention=CONVENTION,
        manifest=manifest,
        manifest_fields=tuple(
            (k, _fmt_value(v)) for k, v in sorted(flatten(window.manifest).items())
        ),
        stall=detect_stall(window, now_ns),
        note="",
    )
