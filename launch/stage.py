"""Staged scale-up of an accepted change: a small group, a representative slice, then the
full job, with checks after each stage and a stop at the first that fails.

The method: "Apply the change to a small group, then a representative slice, and finally
the complete scale", checking at each step that the job is still the same job and that
nothing got worse on the way. A stage is a rerun of the parent at one scope of the ladder
(`rankscope.launch.plan.propose` chooses the hosts exactly as ``rankscope rerun`` does)
with the experiment's change applied, compared with the **reference at the same scope**:
an unchanged rerun of the parent there (an existing ladder rung on the same hosts, else a
control rerun the stage launches first), or the parent itself at ``full``. Checks, in
order; the first that fails stops the staging and prints the rollback condition:

1. **workload**: the stage's mean executed and valid tokens per rank-step equal the
   parent's kept ranks' (over the steps both ran) within `WORKLOAD_TOLERANCE`: the rerun
   keeps per-rank micro batch, gradient accumulation and local shapes (the plan's
   ``preserved``), so a change that moved the numerator (shorter sequences, dropped
   padding, less work) shows here and not as a speed-up.
2. **memory**: the stage's peak memory (``mem_peak``, else ``mem_reserved``, else
   ``mem_allocated``) stays under `MEMORY_HEADROOM` of the device's memory when the
   manifest states it (``gpu.memory_gib``), else within `MEMORY_GROWTH` of the reference's
   peak; "not measured" when the ranks report no memory.
3. **tails**: the steady step-time distribution against the reference's
   (`rankscope.launch.experiments.tail_change`: p99 and tail stalls beyond tolerance),
   and, with a recorded interval, a stage long enough to cover it.
4. **metric**: the experiment's predicted metric moved in the predicted direction against
   the reference (`rankscope.diagnosis.experiment.evaluate`).

**The change.** On the ``simulated`` launcher the change is a set of overrides of the
parent's scenario as it ran (``--sim-set section.key=value``; ``fault=NAME`` swaps the
fault table for another mechanism's, e.g. ``fault=healthy``), written into the changed
rerun's saved spec, so its manifest records what ran. On a real launcher it is the
script's arguments (``--script-arg``). With neither, the stages rerun the parent
unchanged: the checks then compare an unchanged rerun with the reference and say so.

Changed reruns below ``full`` carry their reference as ``parent_run`` (they are a
perturbation of it), so the parent's ladder keeps only unchanged rungs; at ``full`` the
changed run is the parent's child and shows beside it, as a swap rerun does.
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from rankscope.diagnosis.window import Window
from rankscope.launch.experiments import (
    ExperimentRecord,
    distribution_dict,
    interval_coverage,
    swap_from_argv,
    tail_change,
)
from rankscope.launch.plan import propose
from rankscope.launch.runner import Launch, LaunchSettings, prepare
from rankscope.launch.scopes import LADDER
from rankscope.launch.templates import LauncherTemplate

__all__ = [
    "CHECKS",
    "DEFAULT_STAGES",
    "MEMORY_GROWTH",
    "MEMORY_HEADROOM",
    "WORKLOAD_TOLERANCE",
    "Check",
    "Stage",
    "StageChange",
    "StageLaunchError",
    "apply_sim_set",
    "check_stage",
    "parse_sim_set",
    "plan_stages",
    "rollback_text",
    "run_stages",
    "stage_plan_lines",
    "stage_result_lines",
]

DEFAULT_STAGES = ("one-node", "two-node", "full")
"""Small group, representative slice, complete scale."""
CHECKS = ("workload", "memory", "tails", "metric")
"""The checks of a stage, in the order they run."""
WORKLOAD_TOLERANCE = 0.01
"""Mean tokens per rank-step may differ from the parent's kept ranks by this fraction."""
MEMORY_HEADROOM = 0.95
"""Peak memory must stay under this fraction of the device's memory, when known."""
MEMORY_GROWTH = 0.25
"""Without the device's memory: the peak may exceed the reference's by this fraction."""
_WORK_COLUMNS = ("tokens", "valid_tokens")
_MEMORY_COLUMNS = ("mem_peak", "mem_reserved", "mem_allocated")
_KEY = re.compile(r"^[a-z][a-z_]*(\.[a-z][a-z_]*)?$")


class StageLaunchError(RuntimeError):
    """A stage's run did not start, failed, or never reached the recording."""


@dataclass(frozen=True)
class StageChange:
    """How the experiment's change is applied to a stage's rerun."""

    sim_set: tuple[tuple[str, Any], ...] = ()
    """Overrides of the simulated parent's scenario (``("fault.every", 12)``)."""
    script_args: tuple[str, ...] | None = None
    """The changed run's script arguments (a real launcher's way to apply the change)."""

    @property
    def applied(self) -> bool:
        """Whether the stages change anything at all."""
        return bool(self.sim_set) or self.script_args is not None

    def describe(self) -> str:
        """One line: what the changed reruns do differently."""
        parts = [f"{k}={json.dumps(v)}" for k, v in self.sim_set]
        if self.script_args is not None:
            parts.append("script arguments " + " ".join(self.script_args))
        if not parts:
            return (
                "none given: the stages rerun the parent unchanged, so the checks compare an "
                "unchanged rerun with the reference (pass --sim-set or --script-arg to apply "
                "the change)"
            )
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sim_set": {k: v for k, v in self.sim_set},
            "script_args": list(self.script_args) if self.script_args is not None else None,
            "applied": self.applied,
            "describe": self.describe(),
        }


def parse_sim_set(text: str) -> tuple[str, Any]:
    """Read one ``--sim-set`` override: ``section.key=value`` or ``fault=MECHANISM``.

    The value is read as JSON when it parses (``12``, ``0.5``, ``true``, ``[1, 2]``), else
    kept as text (``attn_balanced``).

    Args:
        text: the flag's value.

    Returns:
        ``(key, value)``.

    Raises:
        ValueError: no ``=``, or a key that is not ``section.key`` / ``fault``.
    """
    key, sep, raw = str(text).partition("=")
    key = key.strip()
    if not sep or not _KEY.match(key) or ("." not in key and key != "fault"):
        raise ValueError(
            f"--sim-set takes section.key=value or fault=MECHANISM (e.g. fault.every=12), "
            f"got {text!r}"
        )
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError:
        value = raw.strip()
    return key, value


def apply_sim_set(raw: Mapping[str, Any], sim_set: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """A scenario's contents with overrides applied (the input is not changed).

    Args:
        raw: the scenario as it ran (a run manifest's ``sim.spec``).
        sim_set: ``(key, value)`` pairs from `parse_sim_set`.

    Returns:
        The new contents; ``fault=NAME`` replaces the whole fault table (another
        mechanism's keys differ), ``section.key`` sets one key.
    """
    out = copy.deepcopy(dict(raw))
    for key, value in sim_set:
        if key == "fault":
            out["fault"] = {"mechanism": value}
            continue
        section, _, name = key.partition(".")
        table = out.get(section)
        out[section] = {**(table if isinstance(table, dict) else {}), name: value}
    return out


def _validate_spec(name: str, raw: dict[str, Any]) -> None:
    # The simulator says what a scenario may hold; it is imported only to check one.
    from rankscope.sim.spec import build_scenario

    build_scenario(raw, name=name, source="--sim-set")


@dataclass(frozen=True)
class Stage:
    """One stage: the changed rerun at one scope, and what it is compared with."""

    scope: str
    launch: Launch
    """The changed rerun."""
    reference: str
    """Run id of the reference at this scope."""
    reference_kind: str
    """``parent`` (the full run itself), ``rerun`` (an unchanged rerun already recorded on
    the same hosts) or ``control`` (an unchanged rerun this stage launches first)."""
    control: Launch | None = None
    """The control rerun to launch first (``reference_kind == "control"``)."""

    @property
    def run(self) -> str:
        return self.launch.plan.run


def _unchanged_rung(
    children: Sequence[Window], parent: str, scope: str, hosts: Sequence[str]
) -> Window | None:
    # An unchanged rerun of the parent at this scope on the same hosts: a ladder rung.
    for w in children:
        if w.parent_run != parent or w.scope != scope:
            continue
        launcher = w.manifest.get("launcher")
        argv = launcher.get("argv") if isinstance(launcher, dict) else w.manifest.get("argv")
        if swap_from_argv(argv) is not None:
            continue
        seen = {w.ranks.hosts[int(h)] for h in np.unique(w.ranks.host) if h >= 0}
        if seen == set(hosts):
            return w
    return None


def plan_stages(
    parent: Window,
    hypotheses: Sequence[Any],
    scopes: Sequence[str],
    *,
    experiment: ExperimentRecord,
    change: StageChange,
    template: LauncherTemplate,
    settings: LaunchSettings,
    record: str | Path,
    children: Sequence[Window] = (),
) -> tuple[list[Stage], list[str]]:
    """Plan every stage: hosts, the changed rerun's command, its reference. Writes nothing.

    Args:
        parent: the run the change is staged from (normally at ``full`` scope).
        hypotheses: its verdict's hypotheses, best first (they pick the suspect hosts).
        scopes: ladder scopes in the order to stage them.
        experiment: the experiment whose change is staged.
        change: how the change is applied.
        template: the launcher template.
        settings: hub endpoint, script, steps... of every rerun (the changed runs' script
            arguments come from ``change``).
        record: the recording folder.
        children: windows of the recording's other runs (to find unchanged rungs).

    Returns:
        ``(stages, notes)``: notes say which requested scopes were the whole job already.

    Raises:
        ValueError: an unknown or repeated scope, a scope the parent cannot be reduced to,
            a ``--sim-set`` the launcher or the scenario cannot take.
    """
    for s in scopes:
        if s not in LADDER:
            raise ValueError(f"unknown stage {s!r}; stages are scopes of {', '.join(LADDER)}")
    if len(set(scopes)) != len(scopes) or not scopes:
        raise ValueError(f"--stages names each scope once, got {','.join(scopes) or 'none'}")
    stages: list[Stage] = []
    notes: list[str] = []
    covered: set[tuple[int, ...]] = set()
    for scope in scopes:
        run = f"{parent.run}-{experiment.id}-{scope}"
        plan = propose(parent, hypotheses, scope, run=run)
        if plan.ranks in covered:
            notes.append(f"{scope}: the same ranks as the stage before it (skipped)")
            continue
        if scope != "full" and len(plan.ranks) == parent.world_size and "full" in scopes:
            notes.append(f"{scope}: the {plan.nnodes}-host job is its own {scope} (staged as full)")
            continue
        covered.add(plan.ranks)
        control = None
        if scope == "full":
            reference, kind = parent.run, "parent"
        else:
            rung = _unchanged_rung(children, parent.run, scope, plan.hosts)
            if rung is not None:
                reference, kind = rung.run, "rerun"
            else:
                control_plan = propose(parent, hypotheses, scope)
                control = prepare(
                    control_plan, template, settings, record=record, manifest=parent.manifest
                )
                reference, kind = control.plan.run, "control"
        changed = settings
        if change.script_args is not None:
            changed = replace(settings, script_args=change.script_args)
        # Below full the changed run is a perturbation of its reference, not a rung.
        plan = replace(plan, parent_run=reference if kind != "parent" else parent.run)
        launch = prepare(plan, template, changed, record=record, manifest=parent.manifest)
        if change.sim_set:
            if launch.scenario_spec is None or "scenario" not in launch.sources:
                raise ValueError(
                    f"--sim-set changes a simulated parent's scenario; the {template.name} "
                    "launcher of this parent takes the change as --script-arg"
                )
            path, name, raw = launch.scenario_spec
            new = apply_sim_set(raw, change.sim_set)
            _validate_spec(name, new)
            launch = replace(launch, scenario_spec=(path, name, new))
        stages.append(Stage(scope, launch, reference, kind, control))
    return stages, notes


@dataclass(frozen=True)
class Check:
    """One check of one stage."""

    name: str
    """One of `CHECKS`."""
    status: str
    """``pass``, ``fail``, ``not measured`` (counts as no failure) or ``not checked`` (an
    earlier check failed)."""
    detail: str
    values: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail, **self.values}


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def _mean_work(window: Window, column: str, rows: Sequence[int], steps: np.ndarray) -> float:
    data = window.work.get(column)
    if data is None or data.size == 0:
        return float("nan")
    cols = np.isin(window.steps, steps)
    block = data[np.asarray(rows, dtype=np.int64)][:, cols]
    return float(np.nanmean(block)) if np.isfinite(block).any() else float("nan")


def check_workload(parent: Window, stage: Window, parent_ranks: Sequence[int]) -> Check:
    """Mean executed and valid tokens per rank-step of the stage against the parent's kept
    ranks, over the steps both ran (all of each when none are shared).

    Args:
        parent: the parent run.
        stage: the changed rerun.
        parent_ranks: the parent's ranks the stage kept (the plan's ``ranks``).

    Returns:
        The check (``not measured`` when the ranks report no tokens).
    """
    steps = np.intersect1d(parent.steps, stage.steps)
    over = f"over {steps.size} common steps"
    if steps.size == 0:
        steps = np.union1d(parent.steps, stage.steps)
        over = "no common steps: each run's own"
    kept = [r for r in parent_ranks if 0 <= r < parent.world_size]
    values: dict[str, Any] = {}
    worst = 0.0
    parts = []
    for col in _WORK_COLUMNS:
        p = _mean_work(parent, col, kept, steps)
        s = _mean_work(stage, col, range(stage.world_size), steps)
        if not (np.isfinite(p) and np.isfinite(s)) or p <= 0:
            continue
        rel = s / p - 1.0
        values[col] = {"parent": p, "stage": s, "change": rel}
        worst = max(worst, abs(rel))
        parts.append(f"{col} {p:,.0f} -> {s:,.0f} per rank-step ({rel:+.1%})")
    values["steps_compared"] = int(steps.size)
    if not parts:
        return Check("workload", "not measured", "the ranks report no tokens", values)
    ok = worst <= WORKLOAD_TOLERANCE
    verdict = "same local work" if ok else "the numerator changed: not the same job"
    detail = (
        f"{'; '.join(parts)} vs the parent's {len(kept)} kept ranks ({over}): {verdict} "
        f"(tolerance {WORKLOAD_TOLERANCE:.0%})"
    )
    return Check("workload", "pass" if ok else "fail", detail, values)


def _peak(window: Window) -> tuple[str | None, float]:
    for col in _MEMORY_COLUMNS:
        data = window.memory.get(col)
        if data is not None and data.size and np.isfinite(data).any():
            return col, float(np.nanmax(data))
    return None, float("nan")


def _capacity(window: Window) -> float:
    gpu = window.manifest.get("gpu")
    gib = gpu.get("memory_gib") if isinstance(gpu, dict) else None
    if isinstance(gib, (int, float)) and not isinstance(gib, bool) and gib > 0:
        return float(gib) * 2**30
    return float("nan")


def check_memory(reference: Window, stage: Window) -> Check:
    """The stage's peak memory against the device's memory (when the manifest states it)
    or the reference's peak.

    Args:
        reference: the unchanged run at the same scope.
        stage: the changed rerun.

    Returns:
        The check (``not measured`` when the stage's ranks report no memory).
    """
    col, peak = _peak(stage)
    if col is None:
        return Check("memory", "not measured", "the ranks report no memory samples")
    _, ref = _peak(reference)
    cap = _capacity(stage)
    growth = peak / ref - 1.0 if np.isfinite(ref) and ref > 0 else float("nan")
    values = {
        "column": col,
        "peak_bytes": peak,
        "reference_bytes": _finite(ref),
        "capacity_bytes": _finite(cap),
        "growth": _finite(growth),
    }
    vs = f" ({growth:+.0%} vs the reference)" if np.isfinite(growth) else ""
    if np.isfinite(cap):
        ok = peak <= MEMORY_HEADROOM * cap
        detail = (
            f"{col} {peak / 2**30:.1f} GiB{vs}, {peak / cap:.0%} of the device's "
            f"{cap / 2**30:.0f} GiB (limit {MEMORY_HEADROOM:.0%})"
        )
    elif np.isfinite(growth):
        ok = growth <= MEMORY_GROWTH
        detail = (
            f"{col} {peak / 2**30:.1f} GiB{vs}; device memory unknown, growth limit "
            f"{MEMORY_GROWTH:.0%}"
        )
    else:
        return Check(
            "memory",
            "not measured",
            f"{col} {peak / 2**30:.1f} GiB; no device memory nor reference peak to compare",
            values,
        )
    return Check("memory", "pass" if ok else "fail", detail, values)


def _value(metric: str, v: float) -> str:
    # Every diagnostic metric is a time in ns but attn_max (sum of seq^2).
    return f"{v:.4g}" if metric == "attn_max" else f"{v / 1e6:.2f} ms"


def check_tails_and_metric(
    experiment: ExperimentRecord, reference: Window, stage: Window
) -> tuple[Check, Check]:
    """Tail behaviour and the predicted metric of the stage against its reference.

    Args:
        experiment: the experiment (metric, direction, interval).
        reference: the unchanged run at the same scope.
        stage: the changed rerun.

    Returns:
        ``(tails, metric)``.
    """
    from rankscope.diagnosis.experiment import evaluate

    res = evaluate(reference, stage, experiment)
    sb, sa = res.step_before, res.step_after
    tails = tail_change(sb, sa)
    cover = interval_coverage(experiment.interval, sb.n, sa.n)
    values = {
        "distribution": {"before": distribution_dict(sb), "after": distribution_dict(sa)},
        "tails": tails,
        "covers_interval": cover["covered"],
    }
    ratio = tails["p99_ratio"]
    p99 = f"p99 {sb.p99 / 1e6:.1f} -> {sa.p99 / 1e6:.1f} ms" + (
        f" ({ratio:.2f}x)" if ratio is not None else ""
    )
    stalls = f"stalls {tails['stalls_before']}/{sb.n} -> {tails['stalls_after']}/{sa.n}"
    if cover["covered"] is False:
        tail = Check(
            "tails",
            "fail",
            f"too short to validate: {sa.n} steady steps, the {experiment.interval}-step "
            f"interval needs {cover['required_steps']} ({p99}, {stalls})",
            values,
        )
    else:
        worse = "worse beyond tolerance" if tails["worse"] else "not worse"
        tail = Check(
            "tails", "fail" if tails["worse"] else "pass", f"{p99}, {stalls}: {worse}", values
        )
    moved = res.moved_as_predicted
    metric = Check(
        "metric",
        "pass" if moved else "fail",
        f"{res.metric} {_value(res.metric, res.before)} -> {_value(res.metric, res.after)} "
        f"({res.change:+.1%}, z {res.z:+.1f}): "
        + (
            f"moved {res.direction} as predicted"
            if moved
            else f"did not move {res.direction} beyond noise"
        ),
        {
            "metric": res.metric,
            "direction": res.direction,
            "before": _finite(res.before),
            "after": _finite(res.after),
            "change": _finite(res.change),
            "z": _finite(res.z),
        },
    )
    return tail, metric


def check_stage(
    experiment: ExperimentRecord,
    parent: Window,
    reference: Window,
    stage: Window,
    parent_ranks: Sequence[int],
) -> list[Check]:
    """Every check of one stage, in `CHECKS` order; after the first that fails, the later
    ones are not run (``not checked``), except that tails and metric come from one
    evaluation and are both shown.

    Args:
        experiment: the experiment whose change is staged.
        parent: the parent run.
        reference: the unchanged run at the stage's scope.
        stage: the changed rerun.
        parent_ranks: the parent's ranks the stage kept.

    Returns:
        One `Check` per name of `CHECKS`.
    """
    out: list[Check] = []
    runners: list[tuple[tuple[str, ...], Callable[[], Sequence[Check]]]] = [
        (("workload",), lambda: [check_workload(parent, stage, parent_ranks)]),
        (("memory",), lambda: [check_memory(reference, stage)]),
        (("tails", "metric"), lambda: check_tails_and_metric(experiment, reference, stage)),
    ]
    for names, run in runners:
        if any(c.failed for c in out):
            out += [Check(n, "not checked", "an earlier check failed") for n in names]
        else:
            out += run()
    return out


def rollback_text(
    experiment: ExperimentRecord, scope: str, check: Check, passed: Sequence[str]
) -> str:
    """The rollback condition shown when a stage fails.

    Args:
        experiment: the experiment (its rejection condition).
        scope: the failing stage.
        check: the failing check.
        passed: scopes that passed before it.

    Returns:
        One line.
    """
    kept = f"it held at {', '.join(passed)}; " if passed else ""
    return (
        f"rollback: revert '{experiment.change}' — the {check.name} check failed at {scope} "
        f"({check.detail}); {kept}rejected if: {experiment.rejection}"
    )


def run_stages(
    experiment: ExperimentRecord,
    parent: Window,
    stages: Sequence[Stage],
    change: StageChange,
    *,
    execute: Callable[[Launch], Window],
    window: Callable[[str], Window],
    progress: Callable[[dict[str, Any]], None] | None = None,
    now_ns: int | None = None,
) -> dict[str, Any]:
    """Run the stages in order, stopping at the first failing check.

    Args:
        experiment: the experiment whose change is staged.
        parent: the parent run.
        stages: from `plan_stages`.
        change: how the change is applied (recorded with the attempt).
        execute: starts a launch, waits for its end and returns its run's window; raises
            `StageLaunchError` when the run fails (the staging stops there, as at a
            failed check, with ``failed_check`` = ``launch``).
        window: the window of a recorded run (for ``rerun`` references).
        progress: called with each stage's result as it is known.
        now_ns: start time (default now).

    Returns:
        The attempt, plain data: ``parent_run``, ``started``, ``change``, ``results`` (one
        per stage run: ``scope``, ``run``, ``reference``, ``reference_kind``, ``checks``,
        ``passed``), ``passed``, ``stopped_at``, ``failed_check``, ``rollback``.
    """
    t = time.time_ns() if now_ns is None else int(now_ns)
    attempt: dict[str, Any] = {
        "parent_run": parent.run,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t / 1e9)),
        "change": change.to_dict(),
        "stages": [s.scope for s in stages],
        "results": [],
        "passed": False,
        "stopped_at": None,
        "failed_check": None,
        "rollback": None,
    }
    passed: list[str] = []
    for stage in stages:
        try:
            if stage.control is not None:
                reference = execute(stage.control)
            elif stage.reference_kind == "parent":
                reference = parent
            else:
                reference = window(stage.reference)
            result = execute(stage.launch)
        except StageLaunchError as exc:
            failed_launch = Check("launch", "fail", str(exc))
            attempt["results"].append(
                {"scope": stage.scope, "run": stage.run, "checks": [failed_launch.to_dict()]}
            )
            attempt["stopped_at"] = stage.scope
            attempt["failed_check"] = "launch"
            attempt["rollback"] = rollback_text(experiment, stage.scope, failed_launch, passed)
            return attempt
        checks = check_stage(experiment, parent, reference, result, stage.launch.plan.ranks)
        failed = next((c for c in checks if c.failed), None)
        entry = {
            "scope": stage.scope,
            "run": result.run,
            "reference": reference.run,
            "reference_kind": stage.reference_kind,
            "hosts": list(stage.launch.plan.hosts),
            "world_size": stage.launch.plan.world_size,
            "checks": [c.to_dict() for c in checks],
            "passed": failed is None,
        }
        attempt["results"].append(entry)
        if progress is not None:
            progress(entry)
        if failed is not None:
            attempt["stopped_at"] = stage.scope
            attempt["failed_check"] = failed.name
            attempt["rollback"] = rollback_text(experiment, stage.scope, failed, passed)
            if not change.applied:
                attempt["rollback"] += " (no change was applied: these runs rerun the parent)"
            return attempt
        passed.append(stage.scope)
    attempt["passed"] = True
    return attempt


def stage_plan_lines(
    experiment: ExperimentRecord, stages: Sequence[Stage], change: StageChange, notes: Sequence[str]
) -> list[str]:
    """The dry-run plan: the change, then per stage the hosts, the reference and the
    commands.

    Args:
        experiment: the experiment.
        stages: from `plan_stages`.
        change: how the change is applied.
        notes: from `plan_stages`.

    Returns:
        Lines of text.
    """
    lines = [
        f"stage experiment {experiment.id} ({experiment.status}): {experiment.change}",
        f"  predicts: {experiment.metric} goes {experiment.direction}; "
        f"rejected if: {experiment.rejection}",
        f"  change applied to each stage: {change.describe()}",
        "  checks after each stage: " + ", ".join(CHECKS) + "; stop at the first that fails",
    ]
    if experiment.interval is not None:
        lines.append(f"  each stage must cover {experiment.interval}-step interval twice")
    for i, s in enumerate(stages, 1):
        plan = s.launch.plan
        lines.append(
            f"  {i}. {s.scope}: {', '.join(plan.hosts)} ({plan.world_size} of "
            f"{plan.parent_world_size} ranks) as {s.run}"
        )
        if s.control is not None:
            lines.append(f"     reference: control rerun {s.reference} (unchanged), launched first")
            lines += [f"       $ {c.display}" for c in s.control.commands]
        else:
            what = "the parent itself" if s.reference_kind == "parent" else "recorded rerun"
            lines.append(f"     reference: {what} {s.reference}")
        lines.append("     changed run:")
        lines += [f"       $ {c.display}" for c in s.launch.commands]
        if s.launch.scenario_spec is not None and change.sim_set:
            lines.append(f"       scenario with the change: {s.launch.scenario_spec[0]}")
    lines += [f"  note: {n}" for n in notes]
    return lines


def stage_result_lines(attempt: Mapping[str, Any]) -> list[str]:
    """A staging attempt's results: one line per check per stage, then the outcome.

    Args:
        attempt: from `run_stages`.

    Returns:
        Lines of text.
    """
    lines = []
    for r in attempt.get("results", ()):
        state = "passed" if r.get("passed") else "FAILED"
        vs = f" vs {r['reference_kind']} {r['reference']}" if "reference" in r else ""
        lines.append(f"stage {r['scope']}: {r['run']}{vs}: {state}")
        for c in r.get("checks", ()):
            lines.append(f"  {c['name']:<8} {c['status']:<12} {c['detail']}")
    if attempt.get("passed"):
        lines.append("all stages passed: the change holds at " + ", ".join(attempt["stages"]))
    elif attempt.get("rollback"):
        lines.append(str(attempt["rollback"]))
    return lines
