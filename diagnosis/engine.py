"""One entry point: ``diagnose(window, baseline=None) -> Diagnosis``.

It runs the seed's ordered reduction on one window — numerator, decomposition, critical
path, structure, message-size curves, distributions, behaviour over time, stall — and
ranks the hypotheses. The CLI, the TUI and snapshots all call it, so they agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from rankscope.diagnosis.baseline import BaselineComparison, compare_runs
from rankscope.diagnosis.correlate import Correlations, correlate
from rankscope.diagnosis.critical import CriticalPath, critical_path
from rankscope.diagnosis.curves import Curves, CurveShift, compare_curves, curves_from_rows
from rankscope.diagnosis.decomposition import (
    Decomposition,
    DecompositionDelta,
    compare,
    decompose,
)
from rankscope.diagnosis.exposure import exposed_union, rows_cover_window
from rankscope.diagnosis.fabric import FabricView, fabric_view
from rankscope.diagnosis.grouprows import GroupSkew
from rankscope.diagnosis.numerator import NumeratorCheck, check_numerator
from rankscope.diagnosis.regime import Regime, current_regime, since
from rankscope.diagnosis.stall import Stall, detect_stall
from rankscope.diagnosis.trends import Trends, trends
from rankscope.diagnosis.verdict import Evidence, Verdict, judge
from rankscope.diagnosis.window import Window


@dataclass(frozen=True)
class Diagnosis:
    """Everything the diagnosis found about one window, and the verdict."""

    window: Window
    has_baseline: bool
    baseline_run: str | None
    decomposition: Decomposition
    delta: DecompositionDelta | None
    """Decomposition against the baseline (None without one)."""
    numerator: NumeratorCheck
    critical: CriticalPath
    correlations: Correlations
    curves: Curves
    curve_shifts: tuple[CurveShift, ...]
    """busbw against the baseline's matching points, worst first."""
    comparison: BaselineComparison
    trends: Trends
    fabric: FabricView
    stall: Stall
    verdict: Verdict
    regime: Regime | None = None
    """Set when the step time shifted inside the window: every analysis above then reads
    the steps since (``window`` is that part), and the stall check the whole window."""


def _decompose(window: Window) -> Decomposition:
    # The raw rows, when they cover the window, count overlapping async collectives once.
    exposed = exposed_union(window) if rows_cover_window(window) else None
    return decompose(window, exposed)


def gather_evidence(
    window: Window,
    baseline: Window | None = None,
    baseline_decomp: Decomposition | None = None,
    baseline_rows: GroupSkew | None = None,
) -> Evidence:
    """Run every analysis the verdict reads on one window.

    Args:
        window: the window.
        baseline: the healthy run, for the numerator check, the distributions and the
            decomposition delta.
        baseline_decomp: its decomposition if already computed.
        baseline_rows: its per-(group, op, size bucket) rows if already computed (each
            link's transfer is compared with the baseline's same groups).

    Returns:
        The evidence bundle.
    """
    decomp = _decompose(window)
    crit = critical_path(window, decomp)
    delta = None
    if baseline is not None:
        delta = compare(decomp, baseline_decomp or _decompose(baseline))
    return Evidence(
        window=window,
        decomp=decomp,
        crit=crit,
        corr=correlate(window, decomp, crit),
        trends=trends(window, decomp),
        fabric=fabric_view(window, crit.groups, baseline, baseline_rows),
        numerator=check_numerator(window, baseline),
        comparison=compare_runs(window, baseline),
        delta=delta,
    )


def diagnose(
    window: Window, baseline: Window | None = None, now_ns: float | None = None
) -> Diagnosis:
    """Diagnose one window, optionally against a healthy baseline run.

    Args:
        window: the window of the run under study.
        baseline: a window of the healthy run (same model and work) or None.
        now_ns: the instant the stall check judges, relative to ``window.t0_ns`` (default:
            the latest time seen in the window).

    Returns:
        The analyses and the ranked verdict. When the run's step time shifted inside the
        window (`regime.current_regime`), they are of the steps since the shift: a fault
        that began mid-window is judged on the steps it acts in, not diluted by the ones
        before it.
    """
    whole = window
    regime = current_regime(window)
    if regime is not None:
        window = since(window, regime.start_index)
    base_ev = gather_evidence(baseline) if baseline is not None else None
    ev = gather_evidence(
        window,
        baseline,
        base_ev.decomp if base_ev is not None else None,
        base_ev.crit.groups if base_ev is not None else None,
    )
    verdict = judge(ev, base_ev)
    curves = curves_from_rows(ev.crit.groups)
    shifts: tuple[CurveShift, ...] = ()
    if baseline is not None and base_ev is not None:
        base_curves = curves_from_rows(base_ev.crit.groups)
        shifts = compare_curves(curves, window.groups, base_curves, baseline.groups)
    return Diagnosis(
        window=window,
        has_baseline=baseline is not None,
        baseline_run=baseline.run if baseline is not None else None,
        decomposition=ev.decomp,
        delta=ev.delta,
        numerator=ev.numerator,
        critical=ev.crit,
        correlations=ev.corr,
        curves=curves,
        curve_shifts=shifts,
        comparison=ev.comparison,
        trends=ev.trends,
        fabric=ev.fabric,
        stall=detect_stall(whole, now_ns),
        verdict=verdict,
        regime=regime,
    )
