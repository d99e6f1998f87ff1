"""The command lines ``rankscope diagnose`` proposes for the next experiment of each
hypothesis, checked against the planning of the command that would run them.

The pair of ranks comes from the diagnosis (`rankscope.diagnosis.controlled`); this module
writes the argv for the recording path the user gave and keeps only what the command line
would accept: a path and run ids a launcher template takes, a sweep the run has collectives
for, a rerun the run can be reduced to (scope ``full``) with a swap of two of its ranks,
rendered through its launcher template as the rerun's dry run renders it (a real run whose
manifest names no script fails there). What fails a check is left out, with the reason,
rather than shown and refused later. The rerun's id avoids the recording's runs and the
logs in ``PATH/reruns`` (where the launcher would number it past them).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import Any

from rankscope.diagnosis.controlled import Commands, Perturbation, command_lines, is_simulated
from rankscope.errors import CommandError


def _launcher(argv: tuple[str, ...]) -> str:
    # The template the rerun would use: its --launcher, else the rerun's default.
    return argv[argv.index("--launcher") + 1] if "--launcher" in argv else "torchrun"


def _refusal(
    cmds: Commands, p: Perturbation, diag: Any, path: str, hub: str, steps: int | None
) -> str | None:
    """Why the command line would refuse ``cmds``, or None when it would accept them: the
    values its launcher template takes, the sweep's plan, or the rerun's plan, swap and
    commands rendered through the template (as ``rankscope rerun`` renders its dry run)."""
    from rankscope.commands.rerun import apply_swap
    from rankscope.launch.plan import propose, swap_of
    from rankscope.launch.runner import LaunchSettings, prepare
    from rankscope.launch.safety import UnsafeValueError, check_value
    from rankscope.launch.sweep import plan_sweep
    from rankscope.launch.templates import find_launcher

    window = diag.window
    try:
        check_value("recording", path, "path")
        check_value("run", window.run, "name")
        if p.kind == "sweep_pairwise":
            plan_sweep(window, "pairwise", hypotheses=diag.verdict.hypotheses)
            return None
        plan = propose(window, diag.verdict.hypotheses, "full", run=cmds.new_run)
        swap = swap_of(p.kind.removeprefix("swap_"), p.ranks, plan.world_size)
        settings = LaunchSettings(hub=hub, steps=steps if "--rerun-steps" in cmds.command else None)
        template = find_launcher(_launcher(cmds.command))
        launch = apply_swap(
            prepare(plan, template, settings, record=path, manifest=window.manifest), swap
        )
    except (UnsafeValueError, ValueError, CommandError) as exc:
        return str(exc)
    if launch.plan.run != cmds.new_run:
        return f"the rerun would report as {launch.plan.run}, not {cmds.new_run}"
    return None


def _rerun_ids(path: str) -> set[str]:
    """Run ids a rerun of ``path`` would not take: those with a log or a launch record in
    ``path/reruns`` (the launcher numbers a new one past them)."""
    from rankscope.launch.runner import reruns_dir

    folder = reruns_dir(path)
    if not folder.is_dir():
        return set()
    return {f.stem for f in folder.iterdir() if f.suffix in (".log", ".json")}


def propose_commands(diag: Any, path: str, runs: Collection[str] = ()) -> dict[str, Commands]:
    """The checked command lines of every hypothesis whose next experiment has a
    perturbation.

    Args:
        diag: the `Diagnosis`.
        path: the recording directory as the user named it.
        runs: the run ids the recording holds (a rerun's id avoids them).

    Returns:
        Map mechanism → `Commands` (an empty ``command`` and the reason in ``notes`` where
        the command line would refuse them).
    """
    from rankscope.collector.runtime import DEFAULT_HUB
    from rankscope.commands.rerun import live_hub

    window = diag.window
    simulated = is_simulated(window)
    steps = int(window.steps[-1]) + 1 if window.steps.size else None
    hub = live_hub(path)
    taken = set(runs) | _rerun_ids(path)
    out: dict[str, Commands] = {}
    for h in diag.verdict.hypotheses:
        p = h.next_experiment.perturbation
        if p is None:
            continue
        cmds = command_lines(p, path, window.run, simulated=simulated, steps=steps, taken=taken)
        refused = _refusal(cmds, p, diag, path, hub or DEFAULT_HUB, steps)
        if refused is not None:
            out[h.mechanism] = Commands((), (), None, (f"no command: {refused}",))
            continue
        sweep = p.kind == "sweep_pairwise"
        notes = [f"{'the sweep' if sweep else 'the rerun'} shows its plan; add --yes to run it"]
        # A simulated sweep is priced in its own process; everything else reports to a hub.
        if hub is None and not (sweep and simulated):
            notes.append(
                f"no hub records {path} now: start one (rankscope hub --record {path}) first, "
                "or add --hub ENDPOINT"
            )
        out[h.mechanism] = replace(cmds, notes=tuple(notes))
    return out
