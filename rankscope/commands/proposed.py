"""The command lines ``rankscope diagnose`` proposes for the next experiment of each
hypothesis, checked against the planning of the command that would run them.

The pair of ranks comes from the diagnosis (`rankscope.diagnosis.controlled`); this module
writes the argv for the recording path the user gave and keeps only what the command line
would accept: a path and run ids a launcher template takes, a rerun the run can be reduced
to (scope ``full``), a swap of two ranks the rerun holds, a sweep the run has collectives
for. What fails a check is left out, with the reason, rather than shown and refused later.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import Any

from rankscope.diagnosis.controlled import Commands, Perturbation, command_lines, is_simulated


def _refusal(cmds: Commands, p: Perturbation, diag: Any, path: str) -> str | None:
    """Why the command line would refuse ``cmds``, or None when it would accept them."""
    from rankscope.launch.plan import propose, swap_of
    from rankscope.launch.safety import UnsafeValueError, check_value
    from rankscope.launch.sweep import plan_sweep

    window = diag.window
    try:
        # A launcher template substitutes the recording path and the run ids.
        check_value("recording", path, "path")
        check_value("run", window.run, "name")
        if cmds.new_run is not None:
            check_value("new run", cmds.new_run, "name")
    except UnsafeValueError as exc:
        return str(exc)
    try:
        if p.kind == "sweep_pairwise":
            plan_sweep(window, "pairwise", hypotheses=diag.verdict.hypotheses)
        else:
            plan = propose(window, diag.verdict.hypotheses, "full", run=cmds.new_run)
            swap_of(p.kind.removeprefix("swap_"), p.ranks, plan.world_size)
    except ValueError as exc:
        return str(exc)
    return None


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
    from rankscope.commands.rerun import live_hub

    window = diag.window
    simulated = is_simulated(window)
    steps = int(window.steps[-1]) + 1 if window.steps.size else None
    hub = live_hub(path)
    out: dict[str, Commands] = {}
    for h in diag.verdict.hypotheses:
        p = h.next_experiment.perturbation
        if p is None:
            continue
        cmds = command_lines(p, path, window.run, simulated=simulated, steps=steps, taken=runs)
        refused = _refusal(cmds, p, diag, path)
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
