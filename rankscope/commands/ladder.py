"""``rankscope ladder PATH``: a run and its reduced-scope reruns side by side — each scope's
step distribution, decomposition and verdict — and the first scope where the regression
appears, with what that eliminates (rule: `rankscope.launch.ladder`); then the run's
sweeps (``PATH/sweeps/*.json``) and what each found."""

from __future__ import annotations

import argparse
import json

from rankscope.commands.grammar import (
    add_baseline,
    add_run,
    add_steps,
    baseline_window,
    read_store,
    window_of,
)
from rankscope.commands.rerun import DEFAULT_STEPS, pick_run
from rankscope.errors import CommandError
from rankscope.sanitize import terminal_text

HELP = "Show a run and its reruns by scope, and the first scope where the regression appears"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="recording directory of the hub")
    add_run(p, "the full run (default: the latest full run)")
    add_baseline(p)
    add_steps(p, DEFAULT_STEPS, "most recent steps of each run to analyse", old=("--last",))
    p.add_argument("--local-tol", type=float, default=None, help="local-time tolerance (0.10)")
    p.add_argument("--spread-tol", type=float, default=None, help="spread tolerance (0.05)")
    p.add_argument("--comm-tol", type=float, default=None, help="busbw tolerance (0.25)")
    p.add_argument("--no-verdict", action="store_true", help="skip the per-rung diagnosis")
    p.add_argument("--json", action="store_true", help="print the ladder as JSON")


def run(args: argparse.Namespace) -> int:
    from rankscope.diagnosis.engine import diagnose
    from rankscope.launch.ladder import Tolerances, build_ladder, read_sweeps, sweeps_text
    from rankscope.launch.report import LADDER_WIDTH, ladder_dict, ladder_text

    try:
        given = {
            k: v
            for k, v in (
                ("local", args.local_tol),
                ("spread", args.spread_tol),
                ("comm", args.comm_tol),
            )
            if v is not None
        }
        tolerances = Tolerances(**given)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    store = read_store(args.path, args.steps)
    parent = pick_run(store, args.run)
    children = [r for r in store.runs() if r.parent_run == parent.run]
    windows = {r.run: window_of(store, args.path, r.run, args.steps) for r in [parent, *children]}
    baseline = baseline_window(args, store, args.path, legacy_run=True)
    verdicts = {}
    if not args.no_verdict:
        verdicts = {run: diagnose(w, baseline).verdict for run, w in windows.items()}
    ladder = build_ladder(
        windows[parent.run],
        [windows[c.run] for c in children],
        baseline=baseline,
        verdicts=verdicts,
        tolerances=tolerances,
        sweeps=read_sweeps(args.path, parent.run),
    )
    if args.json:
        print(json.dumps(ladder_dict(ladder), indent=2, allow_nan=False))
    else:
        lines = ladder_text(ladder)
        if ladder.sweeps:
            lines += ["", *sweeps_text(ladder.sweeps, LADDER_WIDTH)]
        print(terminal_text("\n".join(lines)))
    return 0
