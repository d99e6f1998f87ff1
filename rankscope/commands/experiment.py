"""``rankscope experiment``: write a falsifiable prediction before the run, judge it after.

    rankscope experiment record PATH --hypothesis data_imbalance \\
        --change "packer balances attention cost" --metric entry_spread --direction down \\
        --rejection "entry spread unchanged while transfer stays flat"
    rankscope experiment evaluate PATH --id 001-data_imbalance --before ID --after ID
    rankscope experiment stage PATH --id 001-data_imbalance --run ID --launcher simulated \\
        --sim-set fault=healthy --yes
    rankscope experiment list PATH

Records live beside the recording in ``PATH/experiments/<id>.json``; the evaluation
(`rankscope.diagnosis.experiment`) is added to the same file.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rankscope.commands.grammar import add_run, add_steps, read_store, steps_count, window_of
from rankscope.commands.rerun import DEFAULT_STEPS
from rankscope.errors import CommandError

DEFAULT_STAGE_SCOPES = ("one-node", "two-node", "full")
"""Small group, representative slice, complete scale (`rankscope.launch.stage`)."""
RECORDING_WAIT_S = 30.0
"""How long a finished stage run may take to reach the recording."""

HELP = "Record an experiment's prediction before the run; evaluate it after; stage it; list them"


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
    rec.add_argument(
        "--interval",
        type=steps_count,
        default=None,
        metavar="STEPS",
        help="recurrence interval of the regression (stall period, drift) that the after-run "
        "must cover twice over",
    )
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

    st = sub.add_parser(
        "stage",
        help="apply the change at growing scope, checking each stage (dry run without --yes)",
        description="Rerun the parent with the experiment's change at each stage (one-node, "
        "two-node, full by default), compare it with an unchanged run at the same scope, "
        "and stop at the first failing check (workload, memory, tails, metric) with the "
        "rollback condition. Without --yes: print the plan, write nothing.",
    )
    st.add_argument("path", metavar="PATH", help="recording directory")
    st.add_argument("--id", required=True, help="experiment id")
    add_run(st, "run to stage from (default: the experiment's parent run, else the latest full)")
    st.add_argument(
        "--stages",
        default=",".join(DEFAULT_STAGE_SCOPES),
        metavar="S1,S2,...",
        help=f"scopes in order (default {','.join(DEFAULT_STAGE_SCOPES)})",
    )
    st.add_argument("--launcher", default="torchrun", help="launcher template (default torchrun)")
    st.add_argument(
        "--hub", metavar="ENDPOINT", default=None, help="hub endpoint (default: PATH's live hub)"
    )
    st.add_argument(
        "--sim-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="the change on the simulated launcher: an override of the parent's scenario "
        "(section.key=value, or fault=MECHANISM), repeatable",
    )
    st.add_argument(
        "--script", default=None, help="training script of every stage run (default: the parent's)"
    )
    st.add_argument(
        "--script-arg",
        action="append",
        default=None,
        metavar="ARG",
        help="the changed runs' script arguments (the change on a real launcher), repeatable",
    )
    st.add_argument(
        "--rerun-steps",
        type=steps_count,
        default=None,
        metavar="N",
        help="steps of each stage's runs (default: the template's, at least 3 x the interval)",
    )
    add_steps(st, DEFAULT_STEPS, "most recent steps of each run", old=("--last",))
    st.add_argument("--yes", action="store_true", help="run the stages (default: show the plan)")
    st.add_argument("--json", action="store_true", help="print the plan or the results as JSON")

    ls = sub.add_parser("list", help="list the experiments of a recording")
    ls.add_argument("path", metavar="PATH", help="recording directory")
    ls.add_argument("--json", action="store_true")


def _ms(v: object) -> str:
    return f"{v / 1e6:8.1f}" if isinstance(v, (int, float)) else f"{'-':>8}"


def distribution_lines(ev: dict) -> list[str]:
    """The evaluation's step-time distributions, tail check and interval check, in a few
    lines (older evaluations without ``distribution`` show p50/p90 only)."""
    dist = ev.get("distribution")
    if not isinstance(dist, dict):
        sb, sa = ev.get("step_before") or {}, ev.get("step_after") or {}
        if sb.get("p50") is None or sa.get("p50") is None:
            return []
        return [
            f"  step p50 {sb['p50'] / 1e6:.1f} -> {sa['p50'] / 1e6:.1f} ms, "
            f"p90 {sb['p90'] / 1e6:.1f} -> {sa['p90'] / 1e6:.1f} ms"
        ]
    lines = ["  step ms      p50      p99      max  stalls/steps"]
    for side in ("before", "after"):
        d = dist.get(side) or {}
        lines.append(
            f"  {side:<7}{_ms(d.get('p50'))} {_ms(d.get('p99'))} {_ms(d.get('max'))}"
            f"  {d.get('tail_stalls')}/{d.get('n')}"
        )
    tails = ev.get("tails") or {}
    ratio = tails.get("p99_ratio")
    p99 = f"p99 {ratio:.2f}x" if isinstance(ratio, (int, float)) else "p99 -"
    if ev.get("tails_worse"):
        lines.append(
            f"  MEAN BETTER, TAILS WORSE: {p99}, stalls "
            f"{tails.get('stalls_before')} -> {tails.get('stalls_after')}"
        )
    else:
        worse = "worse" if tails.get("worse") else "not worse"
        lines.append(
            f"  tails {worse} ({p99}, stalls {tails.get('stalls_before')} -> "
            f"{tails.get('stalls_after')}; tolerance in the JSON's tails.rule)"
        )
    check = ev.get("interval_check") or {}
    if check.get("interval") is not None:
        state = "covered" if ev.get("covers_interval") else "TOO SHORT TO VALIDATE"
        lines.append(
            f"  interval {check['interval']} steps: after-run {check.get('after_steps')} steady "
            f"steps, needs {check.get('required_steps')}: {state}"
        )
    return lines


def _print_record(rec, as_json: bool) -> None:
    if as_json:
        print(json.dumps(asdict(rec), indent=2, allow_nan=False))
        return
    print(f"experiment {rec.id} ({rec.status}), recorded {rec.created}")
    print(f"  hypothesis: {rec.hypothesis}")
    print(f"  change:     {rec.change}")
    print(f"  predicts:   {rec.metric} goes {rec.direction}")
    print(f"  rejected if: {rec.rejection}")
    if rec.interval is not None:
        print(f"  must cover: {rec.interval}-step recurrence interval (x2)")
    ev = rec.evaluation
    if ev is None:
        return
    print(f"  before {rec.before_run} -> after {rec.after_run}: {ev.get('verdict')}")
    before, after, change = ev.get("before"), ev.get("after"), ev.get("change")
    if isinstance(before, (int, float)) and isinstance(after, (int, float)):
        pct = f" ({change:+.1%})" if isinstance(change, (int, float)) else ""
        print(f"  {rec.metric}: {before:.4g} -> {after:.4g}{pct}")
    for line in distribution_lines(ev):
        print(line)
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
        found = swap_from_argv(argv, after.manifest.get("env"))
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


def _stage_hub(args: argparse.Namespace, go: bool) -> tuple[str, str | None]:
    from rankscope.collector.runtime import DEFAULT_HUB
    from rankscope.commands.rerun import live_hub

    if args.hub:
        return args.hub, None
    live = live_hub(args.path)
    if live is not None:
        return live, None
    why = (
        f"no hub is recording {args.path} now; start one (rankscope hub --record {args.path}) "
        "or pass --hub ENDPOINT"
    )
    if go:
        raise CommandError(why)
    return DEFAULT_HUB, f"{why}: the commands show {DEFAULT_HUB}"


def _expected_steps(template: object, settings: object) -> int | None:
    # The runs' length when the template passes one ({steps}); None: unknown (a real job).
    command = " ".join((*getattr(template, "command", ()), *getattr(template, "argv", ())))
    if "{steps}" not in command:
        return None
    steps = getattr(settings, "steps", None) or getattr(template, "defaults", {}).get("steps")
    return int(steps) if isinstance(steps, int) else None


def _recorded_window(path: str, run: str, expected: int | None, hub: str, steps: int) -> Any:
    """The window of a finished stage run once the recording holds it to its last step
    (or, length unknown, once its step count stops growing).

    Replaying a recording costs seconds when it holds many runs, so it is read once the
    hub has had two flush intervals to write what the run sent, and again only if needed.
    """
    import time

    from rankscope.hub import replay
    from rankscope.hub.recording import RecordingError
    from rankscope.launch.stage import StageLaunchError

    deadline = time.monotonic() + RECORDING_WAIT_S
    last: int | None = None
    while True:
        time.sleep(1.0)  # the hub flushes every 0.5 s
        try:
            store = replay.load(path, history_steps=steps, raw_steps=steps)
            summary = next((r for r in store.runs() if r.run == run), None)
        except RecordingError:
            summary = None
        if summary is not None and summary.last_step is not None:
            if expected is not None and summary.steps_complete >= min(expected, steps):
                return store.window(run, last=steps)
            if expected is None and summary.last_step == last:
                return store.window(run, last=steps)
            last = summary.last_step
        if time.monotonic() > deadline:
            raise StageLaunchError(
                f"run {run!r} did not reach the recording {path} within "
                f"{RECORDING_WAIT_S:.0f} s of its end: is the hub at {hub} recording {path}?"
            )


def _stage(args: argparse.Namespace) -> int:
    from rankscope.commands.rerun import allow_list, pick_run
    from rankscope.diagnosis.engine import diagnose
    from rankscope.launch.experiments import load_experiment, save_stages
    from rankscope.launch.runner import LaunchSettings, program_check, start
    from rankscope.launch.stage import (
        StageChange,
        StageLaunchError,
        parse_sim_set,
        plan_stages,
        run_stages,
        stage_plan_lines,
        stage_result_lines,
    )
    from rankscope.launch.templates import find_launcher
    from rankscope.sanitize import terminal_text

    rec = load_experiment(args.path, args.id)
    if rec.evaluation is not None and rec.status != "supported":
        raise CommandError(
            f"experiment {rec.id!r} was evaluated {rec.status}: only a supported change is staged"
        )
    go = bool(args.yes)
    try:
        change = StageChange(
            sim_set=tuple(parse_sim_set(t) for t in args.sim_set),
            script_args=tuple(args.script_arg) if args.script_arg is not None else None,
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    scopes = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    store = read_store(args.path, args.steps)
    summary = pick_run(store, args.run or rec.parent_run)
    parent = window_of(store, args.path, summary.run, args.steps)
    verdict = diagnose(parent).verdict
    children = [
        window_of(store, args.path, r.run, args.steps)
        for r in store.runs()
        if r.parent_run == parent.run
    ]
    template = find_launcher(args.launcher)
    hub, warning = _stage_hub(args, go)
    steps = args.rerun_steps
    if steps is None and rec.interval is not None:
        # Two intervals to cover, and room for the warm-up the evaluation leaves out.
        default = template.defaults.get("steps")
        steps = max(3 * rec.interval, default if isinstance(default, int) else 0)
    settings = LaunchSettings(hub=hub, script=args.script, steps=steps)
    try:
        stages, notes = plan_stages(
            parent,
            verdict.hypotheses,
            scopes,
            experiment=rec,
            change=change,
            template=template,
            settings=settings,
            record=args.path,
            children=children,
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    if warning is not None:
        notes.append(warning)
    if not go:
        if args.json:
            out = {
                "experiment": rec.id,
                "parent_run": parent.run,
                "change": change.to_dict(),
                "stages": [
                    {
                        "scope": s.scope,
                        "run": s.run,
                        "reference": s.reference,
                        "reference_kind": s.reference_kind,
                        "control": s.control.to_dict() if s.control is not None else None,
                        "launch": s.launch.to_dict(),
                    }
                    for s in stages
                ],
                "notes": notes,
                "launched": False,
            }
            print(json.dumps(out, indent=2, allow_nan=False))
        else:
            print(terminal_text("\n".join(stage_plan_lines(rec, stages, change, notes))))
            print("dry run: nothing was started or written; pass --yes to run the stages")
        return 0
    allow = allow_list(None)
    for s in stages:
        for launch in (s.control, s.launch):
            refused = program_check(launch, allow) if launch is not None else None
            if refused is not None:
                raise CommandError(refused)
    expected = _expected_steps(template, settings)

    def execute(launch):  # type: ignore[no-untyped-def]
        try:
            running = start(launch)
        except RuntimeError as exc:
            raise StageLaunchError(str(exc)) from None
        if not args.json:
            print(terminal_text(f"started {running.run} at {launch.plan.scope}"), flush=True)
        try:
            code = running.wait()
        except KeyboardInterrupt:
            running.cancel()
            raise
        if code != 0:
            raise StageLaunchError(f"{running.run} exited with code {code}; log: {launch.log}")
        return _recorded_window(args.path, running.run, expected, hub, args.steps)

    def recorded(run: str):  # type: ignore[no-untyped-def]
        return window_of(store, args.path, run, args.steps)

    def progress(entry: dict) -> None:
        if not args.json:
            lines = stage_result_lines({"results": [entry]})
            print(terminal_text("\n".join(lines)), flush=True)

    if not args.json:
        print(terminal_text(f"change applied to each stage: {change.describe()}"))
    attempt = run_stages(
        rec, parent, stages, change, execute=execute, window=recorded, progress=progress
    )
    save_stages(args.path, rec.id, attempt)
    if args.json:
        print(json.dumps({"experiment": rec.id, **attempt, "launched": True}, indent=2))
    else:
        tail = stage_result_lines({**attempt, "results": []})
        print(terminal_text("\n".join(tail)))
    return 0 if attempt["passed"] else 1


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
            interval=args.interval,
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
                last = r.stages[-1] if r.stages else None
                if last is not None:
                    runs += "  staged: " + (
                        "all passed"
                        if last.get("passed")
                        else f"stopped at {last.get('stopped_at')}"
                    )
                print(f"{r.id:<28} {r.status:<15} {r.hypothesis}: {r.metric} {r.direction}{runs}")
        return 0
    if args.action == "stage":
        return _stage(args)
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
