"""A `Diagnosis` as plain JSON-ready data (the ``rankscope diagnose --json`` schema).

Schema ``rankscope.diagnosis/1`` — top-level keys:

``schema``, ``run``
    Schema id; the run (``job``, ``run``, ``scope``, ``parent_run``, ``world_size``,
    ``steps`` [first, last], ``n_steps``, ``baseline_run``). With a ``regime``, these
    are the steps since the shift.
``warmup``
    null, or the warm-up steps set aside at the start of the window: ``steps``,
    ``first_step`` (the first steady step), ``warm_ns``, ``steady_ns`` (median job step
    times).
``regime``
    null, or when the step time shifted inside the window: ``start_step``,
    ``start_index``, ``steps``, ``before_ns``, ``after_ns`` (every analysis below reads the
    steps since ``start_step``).
``localisation``
    Who sets the steps, no catalogue needed: ``step_ns`` (median job step),
    ``stability`` (share of steps set by the most frequent setter), ``stays``,
    ``setters`` [{``rank``, ``steps``}], ``moving_gain``, ``outlier_share``, ``imbalance``,
    ``suspects`` [{``kind`` (rank, host, stage, rail, link), ``key``, ``label``, ``ranks``,
    ``gain_ns``, ``gain`` (what-if share of the step), ``net_gain`` (beyond chance, the
    steps' noise and the baseline), ``noise`` (the share the steps' noise could give,
    already taken off ``net_gain``), ``sets``, ``category``, ``excess_ns`` {category:
    ns}, ``what_if``}] best first, ``top`` (the suspect, smallest entity that accounts for the loss) and
    ``finding`` {``material``, ``moving``, ``gain``, ``suspect``}.
``verdict``
    ``top`` (mechanism) and ``hypotheses``: each ``mechanism`` (the vocabulary of
    `verdict.MECHANISMS`), ``score`` (0..1), ``impact`` (share of step time), ``strength``,
    ``ranks``, ``hosts``, ``rails``, ``groups``, ``evidence`` (strings with numbers),
    ``caveats``, ``next_experiment`` {``scope``, ``change``, ``metric``, ``direction``,
    ``supports``, ``rejects``, ``perturbation``, ``command``, ``then``, ``notes``} and
    ``category`` (where the implicated ranks' time goes, for ``unexplained_straggler``;
    else null). ``perturbation`` is null, or the controlled experiment that separates the
    mechanism from its rivals: ``kind`` (``swap_shards``, ``swap_placement``,
    ``sweep_pairwise``), ``ranks`` (the pair, slow rank first), ``separates``, ``why``,
    ``outcomes`` [[observed, mechanism]]. ``command`` is its argv (a list of strings; it
    shows its plan, ``--yes`` launches it) and ``then`` the argv of each follow-up (the
    swap's evaluation), written for the recording path ``rankscope diagnose`` was given;
    null and [] without one, or where the command line would refuse them (the reason in
    ``notes``).
``numerator``
    Work per step against the baseline: ``fields`` [{``name``, ``current``, ``baseline``,
    ``ratio``, ``z``, ``changed``}], ``numerator_changed``, ``executed_ratio``.
``decomposition``
    ``compute_rule``, ``step_ns``, ``first_appears`` and ``categories`` [{``category``,
    ``current_ns``, ``baseline_ns``, ``delta_ns``, ``max_rank_current_ns``,
    ``max_rank_baseline_ns``}] (mean per rank-step; baseline fields null without one).
``critical_path``
    ``last_arrivers`` [{``rank``, ``count``, ``decisive``}], ``critical_ranks``
    [{``rank``, ``steps``}], ``critical_stability``, ``ties``, ``complete``,
    ``clock_error_ns``, ``skew_resolvable``, ``groups`` (worst skew first).
``correlations``
    ``effects`` (strongest per metric first), ``slow_rank``, ``work``.
``curves``
    ``convention`` and ``points`` [{``group``, ``op``, ``size``, ``count``, ``nbytes``,
    ``time_ns``, ``algbw_gbps``, ``busbw_gbps``, ``expected_busbw_gbps``,
    ``expected_ratio``}], ``shifts`` against the baseline, ``expected`` (null unless the
    fabric's expected curve, an nccl-tests import, was given: {``source_run``, ``share``,
    ``finding``: ``fabric_underperforms`` / ``fabric_fine`` / ``no_match``, ``summary``,
    ``unmatched``, ``points`` [{``group``, ``op``, ``bucket``, ``size``, ``busbw_gbps``,
    ``expected_busbw_gbps``, ``ratio``, ``below``}]}).
``distributions``
    ``current`` / ``baseline`` {``n``, ``mean``, ``p50``, ``p90``, ``p99``, ``max``,
    ``tail_stalls``}, ratios, ``manifest_diff`` [{``field``, ``baseline``, ``current``}],
    ``mean_improved_tail_worse``.
``trends``, ``fabric``, ``stall``
    Over-time analysis, slow-link findings, and the hang view.

Times are ns; NaN becomes null.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from rankscope.collector.schema import OPS
from rankscope.diagnosis.controlled import Commands
from rankscope.diagnosis.curves import bucket_label
from rankscope.diagnosis.decomposition import CATEGORIES, COMPUTE_RULE
from rankscope.diagnosis.engine import Diagnosis
from rankscope.diagnosis.localise import Suspect

SCHEMA = "rankscope.diagnosis/1"

MAX_ROWS = 20
"""Long tables (curve points, groups, effects) are cut to this many rows."""


def plain(value: Any) -> Any:
    """Convert numpy scalars/arrays, tuples and dataclasses to JSON-ready values.

    Args:
        value: anything produced by the diagnosis.

    Returns:
        dicts, lists, str, int, float (finite) or None.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return value if np.isfinite(value) else None
    return value


def _op(i: int) -> str:
    return OPS[i] if 0 <= i < len(OPS) else "other"


def _group_name(diag: Diagnosis, gid: int) -> str:
    g = diag.window.groups.get(int(gid))
    return g.name if g is not None else f"group{gid}"


def _hypothesis(h: Any, cmds: Commands | None) -> dict[str, Any]:
    out = plain(h)
    nx = out["next_experiment"]
    nx["command"] = list(cmds.command) if cmds is not None and cmds.command else None
    nx["then"] = [list(t) for t in cmds.then] if cmds is not None else []
    nx["notes"] = list(cmds.notes) if cmds is not None else []
    return out


def to_dict(diag: Diagnosis, commands: Mapping[str, Commands] | None = None) -> dict[str, Any]:
    """The documented JSON form of a diagnosis (see the module docstring).

    Args:
        diag: the diagnosis.
        commands: the checked command lines of each mechanism's next experiment
            (``rankscope diagnose`` writes them for the recording path it was given).

    Returns:
        A JSON-ready map.
    """
    w = diag.window
    steps = w.steps
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "run": {
            "job": w.job,
            "run": w.run,
            "scope": w.scope,
            "parent_run": w.parent_run,
            "world_size": w.world_size,
            "steps": [int(steps[0]), int(steps[-1])] if steps.size else [],
            "n_steps": int(steps.size),
            "baseline_run": diag.baseline_run,
        },
        "warmup": plain(diag.warmup),
        "regime": plain(diag.regime),
        "localisation": _localisation(diag),
        "verdict": {
            "top": diag.verdict.top.mechanism,
            "hypotheses": [
                _hypothesis(h, (commands or {}).get(h.mechanism)) for h in diag.verdict.hypotheses
            ],
        },
        "numerator": {
            "has_baseline": diag.numerator.has_baseline,
            "numerator_changed": diag.numerator.numerator_changed,
            "executed_ratio": plain(diag.numerator.executed_ratio),
            "useful_ratio": plain(diag.numerator.useful_ratio),
            "changed": list(diag.numerator.changed),
            "fields": [plain(f) for f in diag.numerator.fields],
        },
        "decomposition": _decomposition(diag),
        "critical_path": _critical(diag),
        "correlations": _correlations(diag),
        "curves": _curves(diag),
        "distributions": {
            "current": plain(diag.comparison.current),
            "baseline": plain(diag.comparison.baseline),
            "p50_ratio": plain(diag.comparison.p50_ratio),
            "p99_ratio": plain(diag.comparison.p99_ratio),
            "max_ratio": plain(diag.comparison.max_ratio),
            "manifest_diff": [plain(c) for c in diag.comparison.manifest],
            "mean_improved_tail_worse": diag.comparison.mean_improved_tail_worse,
        },
        "trends": _trends(diag),
        "fabric": {
            "hosts": [plain(f) for f in diag.fabric.hosts[:5]],
            "rails": [plain(f) for f in diag.fabric.rails[:5]],
            "placement": [plain(f) for f in diag.fabric.placement],
        },
        "stall": {
            "stalled": diag.stall.stalled,
            "idle_steps": plain(diag.stall.idle_steps),
            "median_step_ns": plain(diag.stall.median_step_ns),
            "culprits": diag.stall.culprits(),
            "silent_ranks": list(diag.stall.silent_ranks[:64]),
            "pending": [plain(p) for p in diag.stall.pending[:MAX_ROWS]],
        },
    }
    return out


def _suspect(s: Suspect | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {
        **plain(s),
        "label": s.label,
        "category": s.category,
        "what_if": s.what_if(),
    }


def _localisation(diag: Diagnosis) -> dict[str, Any] | None:
    loc, found = diag.localisation, diag.finding
    if loc is None:
        return None
    setters = loc.setter[loc.setter >= 0]
    counts = np.bincount(setters) if setters.size else np.zeros(0, dtype=np.int64)
    order = np.argsort(-counts, kind="stable")[:5]
    return {
        "step_ns": plain(loc.step_ns),
        "stability": plain(loc.stability),
        "stays": loc.stays,
        "setters": [{"rank": int(r), "steps": int(counts[r])} for r in order if counts[r]],
        "moving_gain": plain(loc.moving_gain),
        "outlier_share": plain(loc.outlier_share),
        "imbalance": plain(loc.imbalance),
        "suspects": [_suspect(s) for s in loc.suspects[:MAX_ROWS]],
        "top": _suspect(loc.top),
        "finding": None
        if found is None
        else {
            "material": found.material,
            "moving": found.moving,
            "gain": plain(found.gain),
            "suspect": _suspect(found.suspect),
        },
    }


def _decomposition(diag: Diagnosis) -> dict[str, Any]:
    cur = diag.decomposition.mean_per_step()
    cur_max = diag.decomposition.max_rank_per_step()
    rows = []
    delta = {r.category: r for r in diag.delta.rows} if diag.delta is not None else {}
    for c in CATEGORIES:
        d = delta.get(c)
        rows.append(
            {
                "category": c,
                "current_ns": plain(cur[c]),
                "baseline_ns": plain(d.baseline_ns) if d else None,
                "delta_ns": plain(d.delta_ns) if d else None,
                "max_rank_current_ns": plain(cur_max[c]),
                "max_rank_baseline_ns": plain(d.max_rank_baseline_ns) if d else None,
            }
        )
    return {
        "compute_rule": COMPUTE_RULE,
        "step_ns": plain(diag.comparison.current.p50),
        "first_appears": diag.delta.first_appears if diag.delta is not None else None,
        "categories": rows,
    }


def _critical(diag: Diagnosis) -> dict[str, Any]:
    cp = diag.critical
    gs = cp.groups
    order = np.argsort(-np.nan_to_num(gs.skew_max, nan=-1.0), kind="stable")[:MAX_ROWS]
    groups = [
        {
            "group": _group_name(diag, int(gs.group[i])),
            "op": _op(int(gs.op[i])),
            "size": bucket_label(int(gs.bucket[i])),
            "count": int(gs.count[i]),
            "skew_p50_ns": plain(gs.skew_p50[i]),
            "skew_p99_ns": plain(gs.skew_p99[i]),
            "skew_max_ns": plain(gs.skew_max[i]),
            "transfer_p50_ns": plain(gs.transfer_p50[i]),
            "transfer_p99_ns": plain(gs.transfer_p99[i]),
            "transfer_max_ns": plain(gs.transfer_max[i]),
            "skew_share": plain(gs.skew_share[i]),
        }
        for i in order
    ]
    return {
        "last_arrivers": [
            {"rank": r, "count": c, "decisive": int(cp.times_last_decisive[r])}
            for r, c in cp.top_last(10)
        ],
        "critical_ranks": [{"rank": r, "steps": s} for r, s in cp.top_critical(10)],
        "critical_stability": plain(cp.critical_stability),
        "ties": cp.ties,
        "complete": cp.complete,
        "clock_error_ns": plain(cp.clock_error_ns),
        "skew_resolvable": plain(cp.skew_resolvable),
        "groups": groups,
    }


def _correlations(diag: Diagnosis) -> dict[str, Any]:
    corr = diag.correlations
    effects = []
    metrics = sorted({e.metric for e in corr.effects})
    for m in metrics:
        effects += [plain(e) for e in corr.for_metric(m)[:5]]
    sr = corr.slow_rank
    return {
        "effects": effects,
        "slow_rank": {
            "modal_rank": sr.modal_rank,
            "modal_share": plain(sr.modal_share),
            "distinct": sr.distinct,
            "split_half_r": plain(sr.split_half_r),
            "stable": sr.stable,
        },
        "work": plain(corr.work),
    }


def _curves(diag: Diagnosis) -> dict[str, Any]:
    c = diag.curves
    ex = diag.expected.expected_per_point if diag.expected is not None else None
    order = np.lexsort((c.bucket, c.group))[: MAX_ROWS * 5]
    return {
        "convention": c.convention,
        "points": [
            {
                "group": _group_name(diag, int(c.group[i])),
                "op": _op(int(c.op[i])),
                "size": bucket_label(int(c.bucket[i])),
                "count": int(c.count[i]),
                "nbytes": plain(c.nbytes[i]),
                "time_ns": plain(c.time_ns[i]),
                "algbw_gbps": plain(c.algbw_gbps[i]),
                "busbw_gbps": plain(c.busbw_gbps[i]),
                "expected_busbw_gbps": plain(ex[i]) if ex is not None else None,
                "expected_ratio": (
                    plain(c.busbw_gbps[i] / ex[i]) if ex is not None and ex[i] > 0 else None
                ),
            }
            for i in order
        ],
        "shifts": [plain(s) for s in diag.curve_shifts[:MAX_ROWS]],
        "expected": _expected(diag),
    }


def _expected(diag: Diagnosis) -> dict[str, Any] | None:
    e = diag.expected
    if e is None:
        return None
    return {
        "source_run": e.source_run,
        "share": e.share,
        "finding": e.finding,
        "summary": e.summary,
        "unmatched": e.unmatched,
        "points": [{**plain(p), "size": bucket_label(p.bucket)} for p in e.points[: MAX_ROWS * 5]],
    }


def _trends(diag: Diagnosis) -> dict[str, Any]:
    t = diag.trends
    sp = t.spikes
    return {
        "step_time": plain(t.step_time),
        "memory": [plain(m) for m in t.memory],
        "thermal_ranks": plain(t.thermal_ranks),
        "spikes": {
            "steps": plain(sp.steps),
            "excess_ns": plain(sp.excess_ns),
            "category": list(sp.category),
            "period": plain(sp.period),
            "interval_cv": plain(sp.interval_cv),
            "periodic": sp.periodic,
            "share_of_time": plain(sp.share_of_time),
        },
    }
