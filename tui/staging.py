"""Staged scale-up of a supported experiment for the experiment form, with the functions
``rankscope experiment stage`` uses: `rankscope.launch.stage.plan_stages` (one-node,
two-node, full; a control rerun where no unchanged rung exists), then
`rankscope.launch.stage.run_stages`, whose checks (workload, memory, tails, metric) come
back stage by stage and which stops with the rollback condition at the first that fails;
the attempt is saved in the record (`rankscope.launch.experiments.save_stages`).

Runs in worker threads; nothing here touches a widget.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rankscope.launch.experiments import ExperimentRecord
from rankscope.tui.rerun_context import RerunContext, load_windows, session_of

STAGES = ("one-node", "two-node", "full")
"""Small group, representative slice, complete scale (the command's default)."""


@dataclass(frozen=True)
class StagingPlan:
    """The stages of one experiment, ready to run (or shown only, ``error`` says why)."""

    record: ExperimentRecord
    parent: str
    lines: tuple[str, ...]
    cli: str
    """The same staging from the command line."""
    stages: tuple[Any, ...] = ()
    change: Any = None
    launcher: str = ""
    expected_steps: int | None = None
    error: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)


def parse_change(text: str, simulated: bool) -> Any:
    """The change the stages apply, from the form's text: ``KEY=VALUE`` overrides of a
    simulated parent's scenario (``fault=healthy``, ``section.key=value``), else the
    changed runs' script arguments. Empty: no change (the stages rerun the parent).

    Raises:
        ValueError: an override the scenario cannot take.
    """
    from rankscope.launch.stage import StageChange, parse_sim_set

    words = shlex.split(text)
    if not words:
        return StageChange()
    if simulated:
        return StageChange(sim_set=tuple(parse_sim_set(w) for w in words))
    return StageChange(script_args=tuple(words))


def _cli(path: str, rec: ExperimentRecord, parent: str, launcher: str, text: str, sim: bool):
    argv = ["rankscope", "experiment", "stage", path, "--id", rec.id, "--run", parent]
    argv += ["--launcher", launcher]
    for word in shlex.split(text):
        argv += ["--sim-set" if sim else "--script-arg", word]
    return " ".join(shlex.quote(a) for a in [*argv, "--yes"])


def plan_staging(
    app: Any, ctx: RerunContext, rec: ExperimentRecord, change_text: str
) -> StagingPlan | str:
    """Plan the staged scale-up of ``rec`` from its parent run.

    Args:
        app: the app (its source and run list).
        ctx: hub, recording, launcher.
        rec: a supported experiment record.
        change_text: how the stages apply the change (`parse_change`).

    Returns:
        The plan, or why there is none.
    """
    from rankscope.collector.runtime import DEFAULT_HUB
    from rankscope.diagnosis.engine import diagnose
    from rankscope.launch.runner import LaunchSettings
    from rankscope.launch.stage import plan_stages, stage_plan_lines
    from rankscope.launch.templates import find_launcher

    if rec.status != "supported":
        return (
            f"experiment {rec.id} is {rec.status}: only a supported change is staged "
            "(judge it first: enter on the record)"
        )
    if ctx.record is None:
        return "no recording: stage runs are logged and recorded beside one"
    parent = rec.parent_run or rec.before_run
    if parent is None:
        return f"experiment {rec.id} names no run to stage from"
    kids = [r.run for r in app.source.runs() if r.parent_run == parent]
    windows = load_windows(app, ctx, [parent, *kids])
    if parent not in windows:
        return f"run {parent} has no steps here"
    window = windows[parent]
    ctx = ctx.with_launcher_for(window)
    simulated = ctx.launcher == "simulated"
    cli = _cli(str(ctx.record), rec, parent, ctx.launcher, change_text, simulated)
    try:
        change = parse_change(change_text, simulated)
        template = find_launcher(ctx.launcher, ctx.launcher_dirs)
        steps = None
        if rec.interval is not None:
            # Two intervals to cover, and room for the warm-up the evaluation leaves out.
            default = template.defaults.get("steps")
            steps = max(3 * rec.interval, default if isinstance(default, int) else 0)
        settings = LaunchSettings(hub=ctx.hub or DEFAULT_HUB, steps=steps)
        stages, notes = plan_stages(
            window,
            diagnose(window).verdict.hypotheses,
            STAGES,
            experiment=rec,
            change=change,
            template=template,
            settings=settings,
            record=ctx.record,
            children=[windows[k] for k in kids if k in windows],
        )
    except ValueError as exc:  # also TemplateError, UnsafeValueError
        return StagingPlan(rec, parent, (f"cannot plan: {exc}",), cli, error=f"cannot plan: {exc}")
    lines = [*stage_plan_lines(rec, stages, change, notes), "", "the same from the command line:"]
    lines.append(f"  $ {cli}")
    error = "" if ctx.hub is not None else "no hub to report to: shown, not launchable"
    expected = (steps or template.defaults.get("steps")) if simulated else None
    return StagingPlan(
        rec,
        parent,
        tuple(lines),
        cli,
        tuple(stages),
        change,
        ctx.launcher,
        expected if isinstance(expected, int) else None,
        error,
        tuple(notes),
    )


def run_staging(
    app: Any,
    ctx: RerunContext,
    plan: StagingPlan,
    progress: Callable[[str, dict[str, Any] | None], None],
) -> dict[str, Any]:
    """Run the stages in order (in a worker), each stage's result reported as it is known.

    Args:
        app: the app (its source, settings and rerun session).
        ctx: where to read the runs.
        plan: from `plan_staging`.
        progress: called with ``(line, None)`` when a run starts and ``("", entry)`` with each
            stage's result (`rankscope.launch.stage.run_stages`).

    Returns:
        The attempt (also saved in the record).
    """
    from rankscope.launch.experiments import save_stages
    from rankscope.launch.runner import program_check, start
    from rankscope.launch.stage import StageLaunchError, run_stages
    from rankscope.tui.controlled import wait_for_steps

    assert ctx.record is not None
    settings = getattr(app, "settings", None)
    allow = settings.rerun.allow if settings is not None else ()

    def execute(launch: Any) -> Any:
        refused = program_check(launch, allow, cli=False)
        if refused is not None:
            raise StageLaunchError(refused)
        try:
            running = start(launch)
        except (OSError, RuntimeError) as exc:
            raise StageLaunchError(str(exc)) from None
        session_of(app).running[running.run] = running
        progress(f"started {running.run} at {launch.plan.scope}", None)
        code = running.wait()
        if code != 0:
            raise StageLaunchError(f"{running.run} exited with code {code}; log: {launch.log}")
        wait_for_steps(app, running.run, plan.expected_steps)
        window = load_windows(app, ctx, [running.run]).get(running.run)
        if window is None:
            raise StageLaunchError(f"run {running.run!r} did not reach the recording")
        return window

    def recorded(run: str) -> Any:
        window = load_windows(app, ctx, [run]).get(run)
        if window is None:
            raise StageLaunchError(f"run {run!r} is not in the recording")
        return window

    parent = load_windows(app, ctx, [plan.parent])[plan.parent]
    attempt = run_stages(
        plan.record,
        parent,
        plan.stages,
        plan.change,
        execute=execute,
        window=recorded,
        progress=lambda entry: progress("", entry),
    )
    save_stages(ctx.record, plan.record.id, attempt)
    return attempt
