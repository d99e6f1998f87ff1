"""One entry point: ``diagnose(window, baseline=None) -> Diagnosis``.

It runs the seed's ordered reduction on one window, in three stages a reader can follow:

1. **when**: warm-up steps are set aside (`warmup`), and where the step time shifted
   inside the window the steps since the shift are read (`regime`);
2. **localise** (no catalogue): numerator, wall-time decomposition, critical path, who
   sets each step and what fixing them would gain (`localise`), structure, links,
   message-size curves, distributions, behaviour over time (`gather_evidence`);
3. **explain**: every catalogued judge (`judges.JUDGES`), reconciled so one fault gets one
   name, then **verdict**: scores, the open-world remainder (`openworld`) and ``healthy``
   (`verdict.judge`).

The CLI, the TUI and snapshots all call it, so they agree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rankscope.diagnosis.baseline import BaselineComparison, compare_runs
from rankscope.diagnosis.correlate import Correlations, correlate
from rankscope.diagnosis.coverage import unreported, without_ranks
from rankscope.diagnosis.critical import CriticalPath, critical_path
from rankscope.diagnosis.curves import (
    Curves,
    CurveShift,
    ExpectedCurve,
    ExpectedJudgement,
    ExpectedPoint,
    bucket_label,
    compare_curves,
    compare_expected,
    curves_from_rows,
    split_baseline,
)
from rankscope.diagnosis.decomposition import (
    Decomposition,
    DecompositionDelta,
    compare,
    decompose,
)
from rankscope.diagnosis.exposure import exposed_union, rows_cover_window
from rankscope.diagnosis.fabric import FabricView, fabric_view
from rankscope.diagnosis.grouprows import GroupSkew
from rankscope.diagnosis.localise import Finding, Localisation, Suspect, link_suspects, localise
from rankscope.diagnosis.numerator import NumeratorCheck, check_numerator
from rankscope.diagnosis.regime import Regime, current_regime, since
from rankscope.diagnosis.stall import Stall, detect_stall
from rankscope.diagnosis.trends import Trends, trends
from rankscope.diagnosis.verdict import Evidence, Verdict, judge
from rankscope.diagnosis.warmup import Warmup, warmup_of
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
    localisation: Localisation | None = None
    """Who sets the steps and the what-if gain of each suspect, net of chance and of the
    baseline's same entity."""
    finding: Finding | None = None
    """The material straggler localisation found (or that it found none)."""
    warmup: Warmup | None = None
    """The warm-up steps set aside at the start of the window, when there were any."""
    expected: ExpectedJudgement | None = None
    """The curves against the fabric's expected curve (an nccl-tests import), when given."""

    @property
    def warmup_steps(self) -> int:
        """Steps set aside as warm-up (0: none)."""
        return self.warmup.steps if self.warmup is not None else 0


MIN_LOCALISE_STEPS = 3
"""Steps of a new regime needed before localisation reads the regime alone."""


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
    fabric = fabric_view(window, crit.groups, baseline, baseline_rows)
    loc = localise(window, decomp)
    return Evidence(
        window=window,
        decomp=decomp,
        crit=crit,
        corr=correlate(window, decomp, crit),
        trends=trends(window, decomp),
        fabric=fabric,
        numerator=check_numerator(window, baseline),
        comparison=compare_runs(window, baseline),
        loc=with_links(loc, link_suspects(fabric, loc.step_ns)),
        delta=delta,
        baseline=baseline,
    )


def with_links(loc: Localisation, links: tuple[Suspect, ...]) -> Localisation:
    """The localisation with the link suspects among its suspects, best first."""
    if not links:
        return loc
    suspects = sorted((*loc.suspects, *links), key=lambda s: -s.net_gain)
    return dataclasses.replace(loc, suspects=tuple(suspects))


FABRIC_MECHANISMS = ("network_rail", "local_fabric", "intermittent_congestion", "placement")
"""Hypotheses whose groups the fabric's expected curve speaks to."""


def with_expected(verdict: Verdict, judgement: ExpectedJudgement | None) -> Verdict:
    """The fabric hypotheses with what the expected curve (nccl-tests) says of their
    groups: an evidence line where a group's busbw is below the expected share, a caveat
    where every matched group reaches it. Scores are not changed.

    Args:
        verdict: the verdict.
        judgement: the curves against the expected curve, or None.

    Returns:
        The verdict, its fabric hypotheses annotated.
    """
    if judgement is None or not judgement.points:
        return verdict
    lowest: dict[str, ExpectedPoint] = {}
    for p in judgement.points:  # lowest ratio first
        lowest.setdefault(p.group, p)
    hyps = []
    for h in verdict.hypotheses:
        pts = [lowest[g] for g in h.groups if g in lowest]
        if h.mechanism in FABRIC_MECHANISMS and pts:
            w = min(pts, key=lambda p: p.ratio)
            run = f"run {judgement.source_run!r}"
            if w.below:
                line = (
                    f"{w.group} {w.op} {bucket_label(w.bucket)}: busbw {w.busbw_gbps:.1f} GB/s, "
                    f"x{w.ratio:.2f} of the {w.expected_busbw_gbps:.1f} GB/s nccl-tests measured "
                    f"at the same size ({run}; below {judgement.share:.0%})"
                )
                h = dataclasses.replace(h, evidence=(*h.evidence, line))
            else:
                line = (
                    f"nccl-tests ({run}) measured no more: {', '.join(p.group for p in pts[:4])} "
                    f"reach x{w.ratio:.2f} or more of its busbw at the same sizes"
                )
                h = dataclasses.replace(h, caveats=(*h.caveats, line))
        hyps.append(h)
    return dataclasses.replace(verdict, hypotheses=tuple(hyps))


def set_warmup_aside(window: Window) -> tuple[Window, Warmup | None]:
    """The window without its warm-up steps (`warmup`), and the warm-up."""
    warm = warmup_of(window)
    return (since(window, warm.steps), warm) if warm is not None else (window, None)


def diagnose(
    window: Window,
    baseline: Window | None = None,
    now_ns: float | None = None,
    expected: ExpectedCurve | None = None,
) -> Diagnosis:
    """Diagnose one window, optionally against a healthy baseline run.

    Args:
        window: the window of the run under study.
        baseline: a window of the healthy run (same model and work) or None. An imported
            nccl-tests recording given here is no run of the job: it becomes ``expected``
            (`curves.split_baseline`) and the run is diagnosed without a baseline run.
        now_ns: the instant the stall check judges, relative to ``window.t0_ns`` (default:
            the latest time seen in the window).
        expected: the fabric's expected curve (`curves.expected_curve`), or None.

    Returns:
        The analyses and the ranked verdict. When the run's step time shifted inside the
        window (`regime.current_regime`), they are of the steps since the shift: a fault
        that began mid-window is judged on the steps it acts in, not diluted by the ones
        before it.
    """
    baseline, from_baseline = split_baseline(baseline)
    expected = expected if expected is not None else from_baseline
    gone = unreported(window)
    if gone.no_calls.any():
        # A rank whose collectives are not timed reads its collective time as compute:
        # compared with peers that split theirs, it would pass for a straggler.
        window = without_ranks(window, gone.ranks[gone.no_calls])
    whole = window
    window, warm = set_warmup_aside(window)
    steady = window
    regime = current_regime(window)
    if regime is not None:
        window = since(window, regime.start_index)
    if baseline is not None:
        baseline, _ = set_warmup_aside(baseline)
    base_ev = gather_evidence(baseline) if baseline is not None else None
    ev = gather_evidence(
        window,
        baseline,
        base_ev.decomp if base_ev is not None else None,
        base_ev.crit.groups if base_ev is not None else None,
    )
    if regime is not None and regime.steps < MIN_LOCALISE_STEPS:
        # Two steps are enough to see that the step time moved, not to tell a straggler
        # from a spike: localisation reads the steady steps until the regime has more.
        loc = localise(steady, _decompose(steady))
        ev = dataclasses.replace(ev, loc=with_links(loc, link_suspects(ev.fabric, loc.step_ns)))
    verdict = judge(dataclasses.replace(ev, unreported=gone), base_ev)
    curves = curves_from_rows(ev.crit.groups)
    shifts: tuple[CurveShift, ...] = ()
    if baseline is not None and base_ev is not None:
        base_curves = curves_from_rows(base_ev.crit.groups)
        shifts = compare_curves(curves, window.groups, base_curves, baseline.groups)
    vs_expected = compare_expected(curves, window, expected) if expected is not None else None
    verdict = with_expected(verdict, vs_expected)
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
        localisation=verdict.localisation,
        finding=verdict.finding,
        warmup=warm,
        expected=vs_expected,
    )
