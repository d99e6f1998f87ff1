"""``rankscope ladder PATH``: a run and its reduced-scope reruns side by side — each scope's
step distribution, decomposition and verdict — and the first scope where the regression
appears, with what that eliminates (rule: `rankscope.launch.ladder`)."""

from __future__ import annotations

import argparse
import json
import sys

from rankscope.commands.rerun import DEFAULT_LAST, load_store, pick_run

HELP = "Show a run and its reruns by scope, and the first scope where the regression appears"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="recording directory of the hub")
    p.add_argument("--run", default=None, help="the full run (default: the latest full run)")
    p.add_argument("--baseline", default=None, help="a healthy run: the healthy expectation")
    p.add_argument("--last", type=int, default=DEFAULT_LAST, help="steps of each run to analyse")
    p.add_argument("--local-tol", type=float, default=None, help="local-time tolerance (0.10)")
    p.add_argument("--spread-tol", type=float, default=None, help="spread tolerance (0.05)")
    p.add_argument("--comm-tol", type=float, default=None, help="busbw tolerance (0.25)")
    p.add_argument("--no-verdict", action="store_true", help="skip the per-rung diagnosis")
    p.add_argument("--json", action="store_true", help="print the ladder as JSON")


def run(args: argparse.Namespace) -> int:
    from rankscope.diagnosis.engine import diagnose
    from rankscope.launch.ladder import Tolerances, build_ladder
    from rankscope.launch.report import ladder_dict, ladder_text

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
        print(f"rankscope ladder: {exc}", file=sys.stderr)
        return 2
    store = load_store(args.path, args.last)
    parent = pick_run(store, args.run)
    children = [r for r in store.runs() if r.parent_run == parent.run]
    windows = {r.run: store.window(r.run, last=args.last) for r in [parent, *children]}
    baseline = store.window(args.baseline, last=args.last) if args.baseline else None
    verdicts = {}
    if not args.no_verdict:
        verdicts = {run: diagnose(w, baseline).verdict for run, w in windows.items()}
    ladder = build_ladder(
        windows[parent.run],
        [windows[c.run] for c in children],
        baseline=baseline,
        verdicts=verdicts,
        tolerances=tolerances,
    )
    if args.json:
        print(json.dumps(ladder_dict(ladder), indent=2, allow_nan=False))
    else:
        print("\n".join(ladder_text(ladder)))
    return 0
