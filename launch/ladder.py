"""The ladder: a run and its reduced-scope reruns side by side, and the first scope where the
regression appears.

For each rung (one run at one scope): the job's step distribution (p50/p90/max), the
wall-time decomposition, the verdict when given, and whether the regression is there.

**When does a rung show the regression?** It is compared with the *healthy expectation*,
taken from a reference run: the baseline run when one is given (all its ranks healthy),
else the parent (full) run itself, where the median rank and the median group of each kind
stand for healthy — a fault on a minority of ranks or groups does not move a median. Three
things are compared, because a rerun keeps the local shapes but not the communication
pattern (tolerances in `Tolerances`):

- **local time**: per rank and step, the step minus what it spent waiting for others or
  in exposed communication (``compute + input + memory + checkpoint + recovery + other``
  of the decomposition). The rung's value is the p50 over steps of the *slowest* rank
  (synchronous progress follows maxima); the expectation is the median over ranks of each
  rank's p50 in the reference. The rung regresses when it exceeds the expectation by more
  than ``local``.
- **local spread**: per step, the slowest rank's local time minus the rung's median rank's,
  p50 over steps, as a fraction of the expectation. Ranks given different work diverge and
  the slowest sets the step; this shows only where several ranks meet, and it regresses
  above ``spread``.
- **collective bandwidth**: the bus bandwidth of each (group, op, message-size bucket)
  point of the rung (``diagnosis.curves``), against the median over the reference's
  groups of the same kind (the group name without its trailing index: ``tp3`` -> ``tp``),
  op and bucket. The rung regresses when its worst point falls short by more than
  ``comm``. Points without a comparable reference are left out and counted.

The **first scope** is the smallest scope of ``one-rank, one-node, two-node, full`` with a
regressing rung. A clean rung at a scope eliminates every mechanism that would have shown
there (`rankscope.launch.scopes`). A numerator change (more work on every rank) is only
visible against a baseline run; with the parent as reference it cannot be told apart.

**Sweeps** of the parent (``rankscope sweep``: its collectives repeated outside it, results
in ``PATH/sweeps/<run>.json``) are listed beside the rungs (`read_sweeps`): they are not a
scope of the job, so they take no part in the rule, but each says what the primitive path
alone showed (the slow pair, rail or host, or whether it reproduces the slow curve).
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rankscope.collector.schema import OPS
from rankscope.diagnosis.baseline import Distribution, distribution, job_step_ns
from rankscope.diagnosis.curves import (
    EXPECTED_SHARE,
    ExpectedCurve,
    bucket_label,
    message_curves,
    split_baseline,
)
from rankscope.diagnosis.decomposition import CATEGORIES, Decomposition, decompose
from rankscope.diagnosis.exposure import exposed_union, rows_cover_window
from rankscope.diagnosis.robust import nanmax, nanmedian
from rankscope.diagnosis.window import Window
from rankscope.launch.scopes import (
    ABSENT_MEANS,
    APPEARS_MEANS,
    LADDER,
    MECHANISMS,
    implicated_by,
    scope_index,
)

__all__ = [
    "CommCheck",
    "Ladder",
    "Rung",
    "SweepEntry",
    "Tolerances",
    "build_ladder",
    "decomposition",
    "local_ns",
    "read_sweeps",
    "sweeps_text",
]

MIN_POINT_COUNT = 2
"""Instances a curve point needs before it is judged."""

RULE = (
    "regression = slowest-rank local time (p50 over steps) > (1 + local) x the reference's "
    "median rank, or slowest minus median rank of the rung (p50 over steps) > spread x that, "
    "or the worst (group kind, op, size) busbw < (1 - comm) x the reference's median group of "
    "that kind; reference = the baseline run when given, else the parent run"
)


@dataclass(frozen=True)
class Tolerances:
    """How far a rung may stray from the healthy expectation before it counts as the
    regression."""

    local: float = 0.10
    """Slowest-rank local time above the healthy median rank, as a fraction."""
    spread: float = 0.05
    """Slowest minus median rank of the rung, as a fraction of the healthy median rank."""
    comm: float = 0.25
    """Worst collective point's busbw below the healthy reference, as a fraction."""

    def __post_init__(self) -> None:
        for name in ("local", "spread", "comm"):
            value = getattr(self, name)
            if not 0 < value < 1:
                raise ValueError(f"tolerance {name}={value!r} must be within (0, 1)")


_NOT_LOCAL = ("exposed_comm", "arrival_wait", "pipeline_idle")


@dataclass(frozen=True)
class CommCheck:
    """The rung's worst collective point against its healthy reference."""

    group: str
    op: str
    size: str
    busbw_gbps: float
    reference_gbps: float
    expected: bool = False
    """The reference is nccl-tests' busbw at this op and size (judged at
    ``curves.EXPECTED_SHARE``), not a run's group of the same kind."""

    @property
    def ratio(self) -> float:
        return self.busbw_gbps / self.reference_gbps


@dataclass(frozen=True)
class Rung:
    """One run of the ladder."""

    scope: str
    run: str
    world_size: int
    hosts: tuple[str, ...]
    step: Distribution
    """Job step time per step (ns): median over ranks, per step."""
    decomposition: dict[str, float]
    """Mean ns per rank-step of each category (sums to the mean step time)."""
    local_ns: float
    """p50 over steps of the slowest rank's local time."""
    local_ratio: float
    """``local_ns`` / the reference's median-rank local time."""
    spread_ratio: float
    """p50 over steps of (slowest - median rank) local time / the reference's median rank;
    0 for one rank."""
    comm: CommCheck | None
    """Worst collective point with a reference; None when none is comparable."""
    unmatched_points: int
    """Curve points with no reference of the same kind, op and size."""
    regression: bool
    why: str
    verdict: str | None = None
    verdict_score: float | None = None


@dataclass(frozen=True)
class SweepEntry:
    """One sweep of the parent run, as its result file says."""

    run: str
    """The sweep's run id (``scope=sweep``)."""
    scope: str
    """What it swept: ``pairwise``, ``one-node``, ``two-node`` or ``full``."""
    backend: str | None
    """``gloo``, ``nccl`` or ``simulated``."""
    finding: str | None
    """``healthy``, ``primitive`` or ``application`` (a group sweep), or the pairwise
    finding (the slow pair, rail, host...)."""
    found: dict[str, Any] = field(default_factory=dict)
    """What it named: ``pair``, ``rail``, ``host``, ``rank``, ``group`` (null where not)."""
    conclusion: str = ""
    """The sweep's conclusion, one sentence."""
    reproduces: bool | None = None
    """Whether the primitive path alone reproduced the slow curve (null for pairwise)."""
    file: str = ""
    """The result file, relative to the recording (``sweeps/<run>.json``)."""


SWEEPS_DIR = "sweeps"
"""Folder of a recording that holds its sweeps (``rankscope sweep``)."""


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _sweep_entry(path: Path, data: Mapping[str, Any]) -> SweepEntry:
    analysis = _map(data.get("analysis"))
    found = _map(analysis.get("found"))
    plan = _map(data.get("plan"))
    scope = analysis.get("sweep_scope") or plan.get("scope") or "?"
    finding = found.get("finding")
    reproduces = analysis.get("reproduces")
    return SweepEntry(
        run=str(data.get("run") or path.stem),
        scope=str(scope),
        backend=None if data.get("backend") is None else str(data.get("backend")),
        finding=None if finding is None else str(finding),
        found={str(k): v for k, v in found.items() if k != "finding"},
        conclusion=str(analysis.get("conclusion") or ""),
        reproduces=reproduces if isinstance(reproduces, bool) else None,
        file=f"{SWEEPS_DIR}/{path.name}",
    )


def read_sweeps(record: str | Path, parent_run: str) -> tuple[SweepEntry, ...]:
    """The sweeps of one run in a recording, from ``<record>/sweeps/<run>.json``.

    Plans (``*.plan.json``), files that are not a finished sweep result (no ``analysis``,
    unreadable) and sweeps of other runs are left out.

    Args:
        record: recording directory.
        parent_run: the run the sweeps repeat.

    Returns:
        The entries, by sweep run id.
    """
    folder = Path(record) / SWEEPS_DIR
    if not folder.is_dir():
        return ()
    out = []
    for path in sorted(folder.glob("*.json")):
        if path.name.endswith(".plan.json"):
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or not isinstance(data.get("analysis"), Mapping):
            continue
        if data.get("parent_run") != parent_run:
            continue
        out.append(_sweep_entry(path, data))
    return tuple(sorted(out, key=lambda e: e.run))


def _found_text(entry: SweepEntry) -> str:
    named = [
        f"{k} {v}" for k, v in entry.found.items() if v not in (None, [], "") and k != "slow_pairs"
    ]
    head = entry.finding or "?"
    return f"{head} ({', '.join(named)})" if named else head


def sweeps_text(entries: Sequence[SweepEntry], width: int = 80) -> list[str]:
    """The ladder's sweeps section: one entry per sweep, its scope, what it found and its
    conclusion, wrapped to ``width`` columns.

    Args:
        entries: the parent's sweeps (`read_sweeps`).
        width: columns (at least 40).

    Returns:
        Lines; ``["sweeps: none"]`` when there are none.
    """
    width = max(width, 40)
    if not entries:
        return ["sweeps: none"]
    lines = ["sweeps:"]
    for e in entries:
        text = f"{e.run} {e.scope} ({e.backend or '?'}): found {_found_text(e)}"
        if e.conclusion:
            text += f" — {e.conclusion}"
        lines += textwrap.wrap(
            text, width, initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False
        ) or ["  " + e.run]
    return lines


@dataclass(frozen=True)
class Ladder:
    """Rungs in scope order and what the first regressing scope means."""

    parent_run: str
    reference: str
    """Which run stood for healthy, and how."""
    reference_local_ns: float
    rungs: tuple[Rung, ...]
    first_scope: str | None
    first_run: str | None
    meaning: str
    """What the first appearance means (per the method)."""
    eliminated: tuple[str, ...]
    """Mechanisms a clean rung below the first scope ruled out (each would have shown
    there)."""
    implicated: tuple[str, ...]
    """Mechanisms whose smallest scope is the first scope and that no clean rung ruled out."""
    missing: tuple[str, ...]
    """Ladder scopes with no run."""
    tolerances: Tolerances
    rule: str = RULE
    unmeasured_below: tuple[str, ...] = ()
    """Scopes below ``first_scope`` with no run: the regression may first appear there, so
    ``first_scope`` is only the smallest *measured* scope and the mechanisms of these
    scopes stay implicated."""
    sweeps: tuple[SweepEntry, ...] = ()
    """Sweeps of the parent run, beside the rungs (not part of the rule)."""


def decomposition(window: Window) -> Decomposition:
    """The window's decomposition as the diagnosis engine computes it: overlapping
    asynchronous collectives counted once when the raw rows cover the window.

    Args:
        window: the run.

    Returns:
        Its decomposition.
    """
    return decompose(window, exposed_union(window) if rows_cover_window(window) else None)


def local_ns(decomp: Decomposition) -> np.ndarray:
    """Per rank and step, the time not spent waiting for others or in exposed communication.

    Args:
        decomp: the window's decomposition.

    Returns:
        float64 (R, S) ns; NaN where the rank did not report.
    """
    keep = [i for i, c in enumerate(CATEGORIES) if c not in _NOT_LOCAL]
    out = decomp.ns[keep].sum(axis=0)
    out[~np.isfinite(decomp.step_ns)] = np.nan
    return out


def _kind(name: str) -> str:
    # "tp3" -> "tp", "dp_rail_7" -> "dp_rail": groups of one kind play the same role.
    return re.sub(r"[\W_]*\d+$", "", name) or name


def _points(window: Window) -> dict[tuple[str, int, int], list[tuple[str, float, int]]]:
    curves = message_curves(window.instances)
    out: dict[tuple[str, int, int], list[tuple[str, float, int]]] = {}
    for i in range(len(curves)):
        g = window.groups.get(int(curves.group[i]))
        name = g.name if g is not None else f"group{int(curves.group[i])}"
        bw = float(curves.busbw_gbps[i])
        if not np.isfinite(bw) or bw <= 0:
            continue
        key = (_kind(name), int(curves.op[i]), int(curves.bucket[i]))
        out.setdefault(key, []).append((name, bw, int(curves.count[i])))
    return out


def _reference(window: Window) -> tuple[float, dict[tuple[str, int, int], float]]:
    local = local_ns(decomposition(window))
    per_rank = nanmedian(local, axis=1)
    ref_local = float(nanmedian(per_rank))
    ref_bw = {
        key: float(np.median([bw for _, bw, _ in pts])) for key, pts in _points(window).items()
    }
    return ref_local, ref_bw


def _verdict_of(verdict: Any) -> tuple[str | None, float | None]:
    if verdict is None:
        return None, None
    hyps = getattr(verdict, "hypotheses", None)
    if hyps is None and isinstance(verdict, Mapping):
        hyps = verdict.get("hypotheses")
    top = hyps[0] if hyps else verdict
    get = top.get if isinstance(top, Mapping) else lambda k, d=None: getattr(top, k, d)
    mech = get("mechanism", None)
    score = get("score", None)
    return (str(mech) if mech is not None else None), (float(score) if score is not None else None)


def _rung(
    window: Window,
    ref_local: float,
    ref_bw: Mapping[tuple[str, int, int], float],
    tol: Tolerances,
    verdict: Any,
    expected: ExpectedCurve | None = None,
) -> Rung:
    decomp = decomposition(window)
    local = local_ns(decomp)
    slowest = nanmax(local, axis=0)
    value = float(nanmedian(slowest)) if np.isfinite(slowest).any() else float("nan")
    ratio = value / ref_local if ref_local > 0 else float("nan")
    gap = slowest - nanmedian(local, axis=0)
    spread = float(nanmedian(gap)) / ref_local if np.isfinite(gap).any() else float("nan")
    worst: CommCheck | None = None
    worst_margin = float("inf")
    unmatched = 0
    exp_bw: dict[tuple[int, int], float] = {}
    if expected is not None:
        exp_bw = {
            (int(o), int(b)): float(v)
            for o, b, v in zip(expected.op, expected.bucket, expected.busbw_gbps)
            if np.isfinite(v) and v > 0
        }
    spans = {g.name: g.crosses_hosts for g in window.groups.values()}
    for key, pts in _points(window).items():
        ref = ref_bw.get(key)
        for name, bw, count in pts:
            # nccl-tests' busbw where op, size and host span match; else the run's groups.
            e = None
            if expected is not None and expected.cross_host in (None, spans.get(name)):
                e = exp_bw.get((key[1], key[2]))
            if e is None and ref is None:
                unmatched += 1
                continue
            if count < MIN_POINT_COUNT:
                continue
            if e is not None:
                check = CommCheck(name, OPS[key[1]], bucket_label(key[2]), bw, e, expected=True)
                margin = check.ratio / EXPECTED_SHARE
            elif ref is not None:
                check = CommCheck(name, OPS[key[1]], bucket_label(key[2]), bw, ref)
                margin = check.ratio / (1.0 - tol.comm)
            else:
                continue
            if margin < worst_margin:
                worst, worst_margin = check, margin
    reasons = []
    if np.isfinite(ratio) and ratio > 1.0 + tol.local:
        reasons.append(f"slowest-rank local time {ratio:.2f}x the healthy median rank")
    if np.isfinite(spread) and spread > tol.spread:
        reasons.append(f"slowest rank {spread:.0%} of a healthy step above the rung's median rank")
    if worst is not None and worst_margin < 1.0:
        healthy = "nccl-tests'" if worst.expected else "the healthy"
        reasons.append(
            f"{worst.group} {worst.op} {worst.size}: busbw {worst.busbw_gbps:.1f} GB/s, "
            f"{worst.ratio:.2f}x {healthy} {worst.reference_gbps:.1f} GB/s"
        )
    if reasons:
        why = "; ".join(reasons)
    else:
        comm = f", worst busbw {worst.ratio:.2f}x" if worst is not None else ""
        why = f"within tolerance (local {ratio:.2f}x, spread {spread:.0%}{comm})"
    steps = job_step_ns(window)
    hosts_idx = np.unique(window.ranks.host[window.present.any(axis=1) & (window.ranks.host >= 0)])
    mech, score = _verdict_of(verdict)
    return Rung(
        scope=window.scope,
        run=window.run,
        world_size=window.world_size,
        hosts=tuple(window.ranks.hosts[int(h)] for h in hosts_idx),
        step=distribution(steps),
        decomposition=decomp.mean_per_step(),
        local_ns=value,
        local_ratio=ratio,
        spread_ratio=spread,
        comm=worst,
        unmatched_points=unmatched,
        regression=bool(reasons),
        why=why,
        verdict=mech,
        verdict_score=score,
    )


def build_ladder(
    parent: Window,
    children: Sequence[Window],
    *,
    baseline: Window | None = None,
    verdicts: Mapping[str, Any] | None = None,
    tolerances: Tolerances | None = None,
    sweeps: Sequence[SweepEntry] = (),
    expected: ExpectedCurve | None = None,
) -> Ladder:
    """Line up a run and its reruns and find the first scope where the regression appears.

    Args:
        parent: the run being reduced (normally at ``full`` scope).
        children: its reruns (windows whose ``parent_run`` is ``parent.run``; others are
            ignored). Runs at ``custom`` scope are left off the ladder.
        baseline: a healthy run of the same job, when there is one.
        verdicts: run id -> the diagnosis verdict of that run (optional, shown per rung).
        tolerances: how far a rung may stray from healthy (default `Tolerances()`).
        sweeps: the parent's sweeps (`read_sweeps`), listed beside the rungs.
        expected: the fabric's expected curve (an nccl-tests import). An nccl-tests
            recording given as ``baseline`` is taken as this (`curves.split_baseline`).
            Each rung's points of the same op, size and host span are judged against it
            (below ``curves.EXPECTED_SHARE`` of its busbw regresses); local time and the
            other points keep the run reference.

    Returns:
        The ladder (rule in the module docstring).
    """
    tol = tolerances if tolerances is not None else Tolerances()
    baseline, from_baseline = split_baseline(baseline)
    expected = expected if expected is not None else from_baseline
    ref_window = baseline if baseline is not None else parent
    ref_local, ref_bw = _reference(ref_window)
    if baseline is not None:
        reference = f"baseline run {baseline.run!r}"
    else:
        reference = f"median rank and median group of each kind of {parent.run!r}"
    if expected is not None:
        reference += (
            f"; busbw against the nccl-tests curve {expected.run!r} where op, size and "
            f"host span match (below {EXPECTED_SHARE:.0%} regresses)"
        )
    verdicts = verdicts or {}
    windows = [parent] + [w for w in children if w.parent_run == parent.run]
    windows = [w for w in windows if w.scope in LADDER]
    windows.sort(key=lambda w: (scope_index(w.scope), w is not parent, w.run))
    rungs = tuple(_rung(w, ref_local, ref_bw, tol, verdicts.get(w.run), expected) for w in windows)
    first = next((r for r in rungs if r.regression), None)
    # Only clean rungs below the first regressing scope eliminate anything: that is the
    # ordered reduction. A clean rung above it (a rerun that left the suspect out) does not.
    limit = scope_index(first.scope) if first is not None else len(LADDER)
    clean = {r.scope for r in rungs if not r.regression and scope_index(r.scope) < limit}
    eliminated = tuple(
        m.name
        for m in MECHANISMS.values()
        if any(scope_index(s) >= scope_index(m.first_scope) for s in clean)
    )
    present = {r.scope for r in rungs}
    # A scope as large as the parent job is the parent itself: a one-host job is its own
    # one-node rung (and two-node), a two-host job its own two-node rung.
    n_hosts = len(set(parent.ranks.host.tolist()))
    covered = [s for s, h in (("one-rank", 0), ("one-node", 1), ("two-node", 2)) if n_hosts <= h]
    if parent.world_size <= 1:
        covered = ["one-rank", "one-node", "two-node"]
    present |= set(covered)
    unmeasured: tuple[str, ...] = ()
    if first is None:
        meaning = "the regression appears at no measured scope: " + ABSENT_MEANS["full"]
        implicated: tuple[str, ...] = ()
    else:
        # The parent regressing at "full" regresses at the smallest scope it is as well.
        scope = covered[0] if first.run == parent.run and covered else first.scope
        # Only the scopes between the largest clean rung below and the first regressing one
        # are open: a scope inside a clean one (one rank of a clean node) is clean too.
        top = scope_index(scope)
        below = max((scope_index(s) for s in clean), default=-1)
        unmeasured = tuple(s for s in LADDER[below + 1 : top] if s not in present)
        meaning = APPEARS_MEANS[scope]
        if scope != first.scope:
            job = f"{n_hosts}-host" if parent.world_size > 1 else "one-rank"
            meaning = f"the {job} job is its own {scope} rung: {meaning}"
        if unmeasured:
            meaning = (
                f"present at {first.scope}, but {', '.join(unmeasured)} "
                f"{'was' if len(unmeasured) == 1 else 'were'} not run, so it may first appear "
                f"lower; rerun there to narrow it. If {scope} is the first: {meaning}"
            )
        implicated = tuple(
            m for s in (*unmeasured, scope) for m in implicated_by(s) if m not in eliminated
        )
    return Ladder(
        parent_run=parent.run,
        reference=reference,
        reference_local_ns=ref_local,
        rungs=rungs,
        first_scope=first.scope if first else None,
        first_run=first.run if first else None,
        meaning=meaning,
        eliminated=eliminated,
        implicated=implicated,
        missing=tuple(s for s in LADDER if s not in present),
        tolerances=tol,
        unmeasured_below=unmeasured,
        sweeps=tuple(sweeps),
    )
