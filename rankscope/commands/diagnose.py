"""``rankscope diagnose PATH``: the verdict and its evidence for one recorded run.

PATH is a recording directory (``rankscope hub --record DIR`` or ``rankscope demo
--headless --record DIR``). With ``--baseline PATH`` (its most recent run, or
``--baseline-run ID``), or ``--baseline-run ID`` alone for another run of PATH, the run is
compared with a healthy run: numerator, decomposition deltas, distributions, manifest diff
and message-size curves. ``--json`` prints the documented schema of
`rankscope.diagnosis.serialize` (hypotheses with ``mechanism``, ``score``, ``ranks``,
``hosts``, ``evidence``, ``next_experiment``).

Where a swap or a sweep separates a hypothesis from its rivals, its next experiment carries
the command lines for PATH, checked against the planning of the command that runs them
(`rankscope.commands.proposed`): ``run:`` (``rankscope rerun ... --swap-shards SLOW,PEER``,
``--swap-placement A,B`` or ``rankscope sweep ... --scope pairwise``; each shows its plan
and launches with ``--yes``) and ``then:`` (``rankscope experiment swap``), in the JSON as
``next_experiment.command`` and ``next_experiment.then``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rankscope.commands.grammar import (
    add_baseline,
    add_run,
    add_steps,
    baseline_window,
    load_run,
    recording_of,
)
from rankscope.errors import CommandError
from rankscope.sanitize import terminal_text

HELP = "Diagnose a recorded run: ranked hypotheses with evidence and the next experiment"
DEFAULT_STEPS = 100


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path", metavar="PATH", help="recording directory, or a snapshot folder (its window/)"
    )
    add_run(p, "run id in PATH (default: the most recent run)")
    add_baseline(p)
    add_steps(p, DEFAULT_STEPS, "most recent steps of each run to analyse (at least 2)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    from rankscope.commands.proposed import propose_commands
    from rankscope.diagnosis.engine import diagnose
    from rankscope.diagnosis.serialize import to_dict
    from rankscope.diagnosis.text import render_text

    if args.steps < 2:
        raise CommandError(f"--steps must be at least 2, got {args.steps}")
    args.path = recording_of(args.path)
    store, window = load_run(args.path, args.run, args.steps)
    hang = _hang(store, window.run, args.path)
    if not window.has_complete_step() and (hang is None or not hang.stalled):
        # A verdict needs steps: "healthy" on nothing would be a claim without evidence.
        raise CommandError(
            f"run {window.run} in {args.path} holds no complete step of any rank to diagnose "
            "(records the replay skipped, if any, are named above)"
        )
    baseline = baseline_window(args, store, args.path)
    diag = diagnose(window, baseline)
    commands = propose_commands(diag, args.path, [r.run for r in store.runs()])
    if args.json:
        out = to_dict(diag, commands)
        if hang is not None:
            stall = out.setdefault("stall", {})
            stall["hang"] = hang.to_dict()
            if hang.stalled:
                stall["stalled"] = True
                stall["culprits"] = [c.rank for c in hang.culprits]
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        text = render_text(diag, commands=commands)
        if hang is not None and hang.stalled:
            text = _hang_text(hang) + text
        sys.stdout.write(terminal_text(text))
    return 0


def _hang(store: Any, run_id: str, path: Any) -> Any:
    """The heartbeat judge's verdict on the run, or None for a run without heartbeats
    (older collectors and recordings). A live recording is judged now; a finished one at
    its last heartbeat."""
    import time

    from rankscope.hub.hang import judge_run
    from rankscope.hub.recording import session_liveness

    run = store.run_state(run_id)
    if run is None or not run.beats.count:
        return None
    live = session_liveness(path).live
    now = time.time_ns() if live else int(run.beats.heard_ns.max())
    return judge_run(store, run_id, now)


def _hang_text(hang: Any) -> str:
    lines = [f"STALLED: no rank progressed for {hang.idle_s:.1f} s ({hang.case})"]
    for c in hang.culprits[:8]:
        lines.append(
            f"  culprit rank {c.rank} on {c.host or '?'}: {c.case} in "
            f"{c.group_name or '-'}:{c.op or '-'}#{c.seq} — {c.detail}"
        )
    for w in hang.waiting[:16]:
        lines.append(f"  rank {w.rank}: {w.where}")
    return "\n".join(lines) + "\n\n"
