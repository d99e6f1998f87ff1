"""The controlled experiment the verdict on screen proposes — a shard swap, a placement swap
or a pairwise sweep (`rankscope.diagnosis.controlled`) — planned, run and judged for the
rerun menu, with the same functions as the command line.

A swap is ``rankscope rerun PATH --scope full --swap-*``: `rankscope.launch.plan.propose`
at ``full``, `rankscope.launch.runner.prepare` through the launcher template and
`rankscope.commands.rerun.apply_swap`; once the rerun has reported its steps it is judged
by `rankscope.launch.experiments.evaluate_swap`, as ``rankscope experiment swap`` judges
it. A sweep is ``rankscope sweep PATH --scope pairwise`` itself (`rankscope.commands.sweep`
``run``, given the arguments its parser reads), which writes ``PATH/sweeps/<run>.json``;
its finding is read back as the ladder reads it (`rankscope.launch.ladder.read_sweeps`).

Everything here runs in worker threads; nothing touches a widget.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankscope.diagnosis.controlled import Perturbation, command_lines, is_simulated
from rankscope.launch.runner import Launch, RunningRerun
from rankscope.tui.rerun_context import RerunContext, load_windows, parent_of, shown_hypotheses

LABELS = {
    "swap_shards": "swap shards",
    "swap_placement": "swap placement",
    "sweep_pairwise": "pairwise sweep",
}
"""How the menu names each perturbation kind."""
ARRIVAL_WAIT_S = 60.0
"""How long a finished swap rerun's steps may take to reach the hub."""


@dataclass(frozen=True)
class Offer:
    """One hypothesis' controlled experiment, as the menu offers it."""

    mechanism: str
    perturbation: Perturbation

    @property
    def label(self) -> str:
        """``swap shards 5,12``, ``swap placement 3,19`` or ``pairwise sweep``."""
        p = self.perturbation
        name = LABELS.get(p.kind, p.kind)
        return f"{name} {','.join(map(str, p.ranks))}" if p.ranks else name


def offers(hypotheses: tuple[Any, ...] | None) -> list[Offer]:
    """The controlled experiments of a verdict, in its order (one per hypothesis that has
    one; ``healthy`` has none).

    Args:
        hypotheses: ``rankscope.diagnosis.verdict.Hypothesis`` in the verdict's order.

    Returns:
        The offers, best hypothesis first.
    """
    out = []
    for h in hypotheses or ():
        p = getattr(h.next_experiment, "perturbation", None)
        if p is not None and h.mechanism != "healthy":
            out.append(Offer(h.mechanism, p))
    return out


@dataclass(frozen=True)
class ControlledPlan:
    """A controlled experiment ready to launch (or shown only, with ``error`` saying why)."""

    offer: Offer
    parent: str
    lines: tuple[str, ...]
    """The plan as the menu shows it."""
    cli: tuple[str, ...] = ()
    """The equivalent command lines (the experiment, then its evaluation), for the log."""
    launch: Launch | None = None
    """The swap rerun's launch (None for a sweep, or when not launchable)."""
    sweep_argv: tuple[str, ...] = ()
    """``rankscope sweep`` arguments (after ``sweep``) of a launchable sweep."""
    sweep_run: str = ""
    """The sweep's run id (its result is ``PATH/sweeps/<run>.json``)."""
    expected_steps: int | None = None
    """Steps the swap rerun replays (the parent's), when the launcher passes them."""
    error: str = ""
    launcher: str = ""


def _taken(app: Any, ctx: RerunContext) -> set[str]:
    # Run ids a new rerun must not take: the runs known, and the logs in PATH/reruns.
    from rankscope.launch.runner import reruns_dir

    taken = {r.run for r in app.source.runs()}
    if ctx.record is not None and reruns_dir(ctx.record).is_dir():
        taken |= {f.stem for f in reruns_dir(ctx.record).iterdir()}
    return taken


def _sweep_id(record: Path | None, name: str) -> str:
    # As ``rankscope sweep`` numbers a sweep past the results and plans already there.
    from rankscope.commands.sweep import sweeps_dir

    if record is None:
        return name
    folder = sweeps_dir(record)
    out, n = name, 1
    while (folder / f"{out}.json").exists() or (folder / f"{out}.plan.json").exists():
        n += 1
        out = f"{name}-{n}"
    return out


def _with_launcher(argv: list[str], launcher: str) -> list[str]:
    if "--launcher" in argv:
        i = argv.index("--launcher")
        argv = [*argv[: i + 1], launcher, *argv[i + 2 :]]
    elif launcher != "torchrun":
        argv = [*argv, "--launcher", launcher]
    return argv


def _shell(argv: Any) -> str:
    from shlex import quote

    return " ".join(quote(str(a)) for a in argv)


def plan_controlled(app: Any, ctx: RerunContext, index: int = 0) -> ControlledPlan | str:
    """Plan the ``index``-th controlled experiment the verdict on screen proposes (the
    verdict of the run on screen, else a fresh diagnosis of it).

    Args:
        app: the app (its source, the run and the verdict on screen).
        ctx: hub, recording, launcher.
        index: which offer (taken modulo their number).

    Returns:
        The plan, or why there is none.
    """
    from rankscope.diagnosis.engine import diagnose

    parent = parent_of(app)
    if parent is None:
        return "no run on screen yet"
    window = load_windows(app, ctx, [parent]).get(parent)
    if window is None:
        return f"run {parent} has no steps yet"
    ctx = ctx.with_launcher_for(window)
    hypotheses = shown_hypotheses(app, parent)
    if hypotheses is None:
        hypotheses = diagnose(window).verdict.hypotheses
    offered = offers(hypotheses)
    if not offered:
        return (
            f"the verdict on {parent} proposes no swap or sweep (none separates its "
            "hypotheses, or no pair of ranks has a gap to follow)"
        )
    offer = offered[index % len(offered)]
    p = offer.perturbation
    simulated = is_simulated(window)
    steps = int(window.steps[-1]) + 1 if window.steps.size else None
    path = str(ctx.record) if ctx.record is not None else "PATH"
    cmds = command_lines(p, path, parent, simulated=simulated, steps=steps, taken=_taken(app, ctx))
    head = [
        f"{offer.label} of {parent}: the controlled experiment for {offer.mechanism}",
        f"  separates {p.separates}",
        *([f"  why: {p.why}"] if p.why else []),
        "  outcomes:",
        *(f"    {seen}: {means}" for seen, means in p.outcomes),
        "",
    ]
    command = _with_launcher(list(cmds.command), ctx.launcher)
    cli = (_shell(command), *(_shell(t) for t in cmds.then))
    try:
        if p.kind == "sweep_pairwise":
            return _plan_sweep(offer, parent, window, hypotheses, ctx, head, command, cli)
        return _plan_swap(offer, parent, window, hypotheses, ctx, head, cmds.new_run, steps, cli)
    except ValueError as exc:  # also UnsafeValueError, TemplateError
        return ControlledPlan(
            offer, parent, (*head, f"cannot plan: {exc}"), cli, error=f"cannot plan: {exc}"
        )


def _cli_lines(cli: tuple[str, ...]) -> list[str]:
    lines = ["  the same from the command line (plan only; --yes runs it):"]
    lines += [f"    $ {c}" for c in cli]
    return lines


def _plan_swap(
    offer: Offer,
    parent: str,
    window: Any,
    hypotheses: tuple[Any, ...],
    ctx: RerunContext,
    head: list[str],
    new_run: str | None,
    steps: int | None,
    cli: tuple[str, ...],
) -> ControlledPlan:
    from rankscope.commands.rerun import apply_swap
    from rankscope.errors import CommandError
    from rankscope.launch.plan import propose, swap_of
    from rankscope.launch.report import launch_text, plan_text
    from rankscope.launch.runner import LaunchSettings, prepare
    from rankscope.launch.templates import find_launcher

    p = offer.perturbation
    plan = propose(window, hypotheses, "full", run=new_run)
    swap = swap_of(p.kind.removeprefix("swap_"), p.ranks, plan.world_size)
    predictions = [f"swap of {swap.kind} between ranks {swap.ranks[0]} and {swap.ranks[1]}"]
    predictions += [f"  predicts {seen}: {means}" for seen, means in swap.predictions]
    if ctx.hub is None or ctx.record is None:
        why = (
            "no hub to report to"
            if ctx.hub is None
            else "no recording to log beside (start the view with --record DIR to launch)"
        )
        lines = (*head, *plan_text(plan), *predictions, *_cli_lines(cli))
        return ControlledPlan(
            offer, parent, lines, cli, error=f"{why}: shown, not launchable", launcher=ctx.launcher
        )
    simulated = ctx.launcher == "simulated"
    launch = prepare(
        plan,
        find_launcher(ctx.launcher, ctx.launcher_dirs),
        LaunchSettings(hub=ctx.hub, steps=steps if simulated else None),
        record=ctx.record,
        manifest=window.manifest,
    )
    try:
        launch = apply_swap(launch, swap)
    except CommandError as exc:
        lines = (*head, *plan_text(plan), f"cannot launch: {exc}", *_cli_lines(cli))
        return ControlledPlan(
            offer, parent, lines, cli, error=f"cannot launch: {exc}", launcher=ctx.launcher
        )
    lines = (*head, *launch_text(launch), *predictions, *_cli_lines(cli))
    return ControlledPlan(
        offer,
        parent,
        lines,
        cli,
        launch=launch,
        expected_steps=steps if simulated else None,
        launcher=ctx.launcher,
    )


def _plan_sweep(
    offer: Offer,
    parent: str,
    window: Any,
    hypotheses: tuple[Any, ...],
    ctx: RerunContext,
    head: list[str],
    command: list[str],
    cli: tuple[str, ...],
) -> ControlledPlan:
    from rankscope.launch.sweep import plan_sweep

    plan = plan_sweep(window, "pairwise", hypotheses=hypotheses)
    run = _sweep_id(ctx.record, plan.run)
    lines = [
        *head,
        f"sweep {run} of {parent} at pairwise: {plan.reason}",
        f"  hosts {', '.join(plan.hosts)}; {plan.world_size} ranks; dtype {plan.dtype}, "
        f"{plan.warmup} warmup + {plan.iters} timed x{plan.repeats}",
    ]
    if plan.pairs:
        shown = ", ".join(f"{a}-{b}" for a, b in plan.pairs[:12])
        more = f" and {len(plan.pairs) - 12} more" if len(plan.pairs) > 12 else ""
        lines.append(f"  {plan.pair_op} on {len(plan.pairs)} links: {shown}{more}")
    lines += [f"  note: {n}" for n in plan.notes]
    if ctx.launcher == "simulated":
        lines.append("  runs on the simulated cluster, in this process (not reported to a hub)")
    lines.append(f"  result: sweeps/{run}.json in the recording")
    lines += _cli_lines(cli)
    if ctx.record is None:
        why = "no recording: a sweep writes its result beside one (start with --record DIR)"
        return ControlledPlan(offer, parent, tuple(lines), cli, error=why, launcher=ctx.launcher)
    argv = command[2:]  # after "rankscope sweep"
    argv += ["--new-run", run, "--yes", "--json"]
    if ctx.hub is not None and ctx.launcher != "simulated":
        argv += ["--hub", ctx.hub]
    return ControlledPlan(
        offer,
        parent,
        tuple(lines),
        cli,
        sweep_argv=tuple(argv),
        sweep_run=run,
        launcher=ctx.launcher,
    )


def run_sweep(plan: ControlledPlan, record: Path) -> list[str]:
    """Run a planned sweep as ``rankscope sweep ... --yes`` runs it, and read its finding.

    Args:
        plan: a sweep plan with ``sweep_argv``.
        record: the recording it writes its result into.

    Returns:
        The finding in lines (as the ladder's sweeps section words it), or why it failed.
    """
    import argparse

    from rankscope.commands import sweep
    from rankscope.errors import CommandError
    from rankscope.launch.ladder import read_sweeps, sweeps_text

    parser = argparse.ArgumentParser(prog="rankscope sweep")
    sweep.add_arguments(parser)
    args = parser.parse_args(list(plan.sweep_argv))
    try:
        # The command's plan and result text go to a buffer, not to the terminal the app
        # draws on; the finding is read back from the result file below.
        code = sweep.run(args, out=io.StringIO())
    except CommandError as exc:
        return [f"sweep failed: {exc}"]
    entry = next((e for e in read_sweeps(record, plan.parent) if e.run == plan.sweep_run), None)
    if code != 0 or entry is None:
        return [f"sweep {plan.sweep_run} wrote no result (exit code {code})"]
    # The ladder's own wording of the entry, under a first line that names the finding.
    head = f"sweep {entry.run}: found {entry.finding or '?'}"
    return [head, *sweeps_text([entry], width=100)[1:]]


def wait_for_steps(app: Any, run: str, expected: int | None) -> None:
    """Wait (in a worker) until a finished rerun's steps are at the hub — ``expected`` of
    them, or, length unknown, until their count stops growing — and in its recording.

    Args:
        app: the app (its source's run list).
        run: the rerun's id.
        expected: the steps it runs, when the launcher passes them.
    """
    deadline = time.monotonic() + ARRIVAL_WAIT_S
    last = None
    while time.monotonic() < deadline:
        entry = next((r for r in app.source.runs() if r.run == run), None)
        steps = entry.steps if entry is not None else 0
        if entry is not None and (
            (expected is not None and steps >= expected) or (expected is None and steps == last)
        ):
            break
        last = steps if entry is not None else None
        time.sleep(0.5)
    time.sleep(1.0)  # the hub flushes its recording every 0.5 s; the windows replay it


def evaluate_rerun(
    app: Any, ctx: RerunContext, plan: ControlledPlan, running: RunningRerun
) -> list[str]:
    """Wait for a swap rerun to end and its steps to arrive, then judge the swap as
    ``rankscope experiment swap`` does.

    Args:
        app: the app (its source).
        ctx: where to read the runs.
        plan: the swap's plan.
        running: the launched rerun.

    Returns:
        The evaluation in lines (its outcome first), or why there is none.
    """
    from rankscope.launch.experiments import evaluate_swap

    code = running.wait()
    after = running.run
    if code != 0:
        return [f"{after} exited with code {code}; log {running.launch.log}"]
    wait_for_steps(app, after, plan.expected_steps)
    windows = load_windows(app, ctx, [plan.parent, after])
    if plan.parent not in windows or after not in windows:
        return [f"no steps of {after} yet: judge it later with", f"  $ {plan.cli[-1]}"]
    p = plan.offer.perturbation
    kind = p.kind.removeprefix("swap_")
    try:
        out = evaluate_swap(windows[plan.parent], windows[after], kind, p.ranks)
    except ValueError as exc:
        return [f"cannot judge the swap: {exc}"]
    a, b = out["ranks"]
    return [
        f"{out['outcome']}: {out['means']}",
        f"  swap of {kind} between ranks {a} and {b}: {plan.parent} -> {after}",
        f"  slow rank before: {out['slow_rank']}; rms busy gap {out['gap_before_ns'] / 1e6:.1f} "
        f"ms -> {out['gap_after_ns'] / 1e6:.1f} ms over {len(out['steps'])} steps; "
        f"after/before {out['ratio']:+.2f}",
        f"  verdict: {out['verdict']}",
    ]
