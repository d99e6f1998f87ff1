"""``rankscope experiment``: write a falsifiable prediction before the run, judge it after.

    rankscope experiment record PATH --hypothesis data_imbalance \\
        --change "packer balances attention cost" --metric entry_spread --direction down \\
        --rejection "entry spread unchanged while transfer stays flat"
    rankscope experiment evaluate PATH --id 001-data_imbalance --before ID --after ID
    rankscope experiment list PATH

Records live beside the recording in ``PATH/experiments/<id>.json``; the evaluation
(`rankscope.diagnosis.experiment`) is added to the same file.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from rankscope.commands.grammar import add_run, add_steps, read_store, window_of
from rankscope.commands.rerun import DEFAULT_STEPS
from rankscope.errors import CommandError

HELP = "Record an experiment's prediction before the run; evaluate it after; list them"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    rec = sub.add_parser("record", help="write the prediction (before the run)")
    rec.add_argument("path", metavar="PATH", help="recording directory")
    rec.add_argument("--hypothesis", required=True, help="mechanism under test")
    rec.add_argument("--change", required=True, help="the one change the run makes")
    rec.add_argument("--metric", required=True, help="diagnostic metric predicted to move")
    rec.add_argument("--direction", required=True, choices=("down", "up"))
    rec.add_argument("--rejection", required=True, help="the observation that would reject it")
    rec.add_argument("--id", default=None, help="record id (default NNN-<hypothesis>)")
    add_run(rec, "the run the experiment starts from")
    rec.add_argument("--scope", default=None, help="scope the experiment runs at")
    rec.add_argument("--json", action="store_true")

    ev = sub.add_parser("evaluate", help="judge a recorded prediction from two runs")
    ev.add_argument("path", metavar="PATH", help="recording directory")
    ev.add_argument("--id", required=True, help="experiment id")
    ev.add_argument("--before", metavar="ID", required=True, help="run without the change")
    ev.add_argument("--after", metavar="ID", required=True, help="run with the change")
    add_steps(ev, DEFAULT_STEPS, "most recent steps of each run", old=("--last",))
    ev.add_argument("--json", action="store_true")

    sw = sub.add_parser("swap", help="say where a swapped pair's slowness went (data/hardware)")
    sw.add_argument("path", metavar="PATH", help="recording directory")
    sw.add_argument("--before", metavar="ID", required=True, help="run without the swap")
    sw.add_argument("--after", metavar="ID", required=True, help="rerun with the swap")
    sw.add_argument(
        "--swap-shards", metavar="R1,R2", default=None, help="the swap (default: the rerun's argv)"
    )
    sw.add_argument("--swap-placement", metavar="R1,R2", default=None, help="the swap")
    add_steps(sw, DEFAULT_STEPS, "most recent steps of each run", old=("--last",))
    sw.add_argument("--json", action="store_true")

    ls = sub.add_parser("list", help="list the experiments of a recording")
    ls.add_argument("path", metavar="PATH", help="recording directory")
    ls.add_argument("--json", action="store_true")


def _print_record(rec, as_json: bool) -> None:
    if as_json:
        print(json.dumps(asdict(rec), indent=2, allow_nan=False))
        return
    print(f"experiment {rec.id} ({rec.status}), recorded {rec.created}")
    print(f"  hypothesis: {rec.hypothesis}")
    print(f"  change:     {rec.change}")
    print(f"  predicts:   {rec.metric} goes {rec.direction}")
    print(f"  rejected if: {rec.rejection}")
    ev = rec.evaluation
    if ev is None:
        return
    print(f"  before {rec.before_run} -> after {rec.after_run}: {ev.get('verdict')}")
    before, after, change = ev.get("before"), ev.get("after"), ev.get("change")
    if isinstance(before, (int, float)) and isinstance(after, (int, float)):
        pct = f" ({change:+.1%})" if isinstance(change, (int, float)) else ""
        print(f"  {rec.metric}: {before:.4g} -> {after:.4g}{pct}")
    sb, sa = ev.get("step_before") or {}, ev.get("step_after") or {}
    if sb.get("p50") is not None and sa.get("p50") is not None:
        print(
            f"  step p50 {sb['p50'] / 1e6:.1f} -> {sa['p50'] / 1e6:.1f} ms, "
            f"p90 {sb['p90'] / 1e6:.1f} -> {sa['p90'] / 1e6:.1f} ms"
        )
    print(f"  accounting closed: {ev.get('accounting_closed')}")
    if ev.get("recorded_before_after_run") is False:
        print("  warning: the prediction was recorded after the after-run had started")
    for note in ev.get("notes") or ():
        print(f"  note: {note}")


def _swap(args: argparse.Namespace, store: object) -> int:
    from rankscope.commands.rerun import swap_pair
    from rankscope.launch.experiments import evaluate_swap, swap_from_argv

    before = window_of(store, args.path, args.before, args.steps)
    after = window_of(store, args.path, args.after, args.steps)
    if args.swap_shards and args.swap_placement:
        raise CommandError("give one of --swap-shards and --swap-placement")
    if args.swap_shards or args.swap_placement:
        kind = "shards" if args.swap_shards else "placement"
        pair = swap_pair(f"--swap-{kind}", args.swap_shards or args.swap_placement)
    else:
        launcher = after.manifest.get("launcher")
        argv = launcher.get("argv") if isinstance(launcher, dict) else after.manifest.get("argv")
        found = swap_from_argv(argv)
        if found is None:
            raise CommandError(
                f"run {args.after!r} records no swap; pass --swap-shards or --swap-placement"
            )
        kind, pair = found
    try:
        out = evaluate_swap(before, after, kind, pair)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    if args.json:
        print(json.dumps(out, indent=2, allow_nan=False))
        return 0
    a, b = out["ranks"]
    print(f"swap of {kind} between ranks {a} and {b}: {args.before} -> {args.after}")
    print(
        f"  slow rank before: {out['slow_rank']}; rms busy gap {out['gap_before_ns'] / 1e6:.1f} ms "
        f"-> {out['gap_after_ns'] / 1e6:.1f} ms over {len(out['steps'])} steps; after/before "
        f"{out['ratio']:+.2f}"
    )
    print(f"  verdict: {out['verdict']}")
    return 0


def run(args: argparse.Namespace) -> int:
    from rankscope.launch.experiments import (
        evaluate_experiment,
        list_experiments,
        record_experiment,
    )

    if not Path(args.path).is_dir():
        # Records live beside a recording: a mistyped PATH must not grow a new folder.
        raise CommandError(f"no recording at {args.path!r}")
    if args.action == "record":
        rec = record_experiment(
            args.path,
            hypothesis=args.hypothesis,
            change=args.change,
            metric=args.metric,
            direction=args.direction,
            rejection=args.rejection,
            id=args.id,
            parent_run=args.run,
            scope=args.scope,
        )
        _print_record(rec, args.json)
        return 0
    if args.action == "list":
        recs = list_experiments(args.path)
        if args.json:
            print(json.dumps([asdict(r) for r in recs], indent=2, allow_nan=False))
        else:
            for r in recs:
                runs = f"  {r.before_run} -> {r.after_run}" if r.after_run else ""
                print(f"{r.id:<28} {r.status:<15} {r.hypothesis}: {r.metric} {r.direction}{runs}")
        return 0
    store = read_store(args.path, args.steps)
    if args.action == "swap":
        return _swap(args, store)
    rec = evaluate_experiment(
        args.path,
        args.id,
        window_of(store, args.path, args.before, args.steps),
        window_of(store, args.path, args.after, args.steps),
    )
    _print_record(rec, args.json)
    return 0
