"""``rankscope rerun PATH --scope one-node``: propose a reduced-scope rerun of a recorded run,
show it in full, and launch it only with ``--yes``.

The plan comes from the run's window and its diagnosis (the verdict's top hypotheses pick
the suspect rank, node or pair); the command from a launcher template. The rerun reports
to the hub that records PATH (or ``--hub``) as a new run with ``parent_run`` and its scope;
its output goes to ``PATH/reruns/<run>.log``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from rankscope.launch.scopes import LADDER

HELP = "Propose (and with --yes launch) a one-rank/one-node/two-node/full rerun of a run"
DEFAULT_LAST = 64
"""Steps of the run the plan and the ladder look at."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="recording directory of the hub")
    p.add_argument("--scope", required=True, choices=LADDER, help="scope of the rerun")
    p.add_argument("--run", default=None, help="run to reduce (default: the latest full run)")
    p.add_argument("--baseline", default=None, help="a healthy run, for the diagnosis")
    p.add_argument("--launcher", default="torchrun", help="launcher template (default torchrun)")
    p.add_argument(
        "--launchers",
        action="append",
        default=[],
        metavar="DIR",
        help="extra folder of launcher templates (repeatable; overrides shipped ones by name)",
    )
    p.add_argument("--list-launchers", action="store_true", help="list templates and exit")
    p.add_argument(
        "--hub", default=None, help="hub endpoint the rerun reports to (default: PATH's live hub)"
    )
    p.add_argument("--script", default=None, help="training script (default: the run's own)")
    p.add_argument(
        "--script-arg",
        action="append",
        default=None,
        metavar="ARG",
        help="a script argument (repeatable; default: the run's own)",
    )
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port")
    p.add_argument("--steps", type=int, default=None, help="steps (simulated launcher)")
    p.add_argument("--new-run", default=None, help="id of the new run (default <run>-<scope>)")
    p.add_argument(
        "--keep-global-batch",
        action="store_true",
        help="raise gradient accumulation to keep the global batch (default: keep local work)",
    )
    p.add_argument("--last", type=int, default=DEFAULT_LAST, help="steps of the run to analyse")
    p.add_argument("--dry-run", action="store_true", help="only show the plan (the default)")
    p.add_argument("--yes", action="store_true", help="launch without asking")
    p.add_argument("--detach", action="store_true", help="with --yes: do not wait for the end")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def load_store(path: str | Path, last: int) -> Any:
    """Replay a recording, keeping the raw collective rows of every step analysed (so the
    decomposition counts overlapping asynchronous collectives once).

    Args:
        path: recording directory.
        last: steps per run to keep.

    Returns:
        The store.
    """
    from rankscope.hub import replay

    last = max(int(last), 1)
    return replay.load(path, history_steps=last, raw_steps=last)


def pick_run(store: Any, run: str | None) -> Any:
    """The run to reduce: ``run`` when given, else the latest full-scope run.

    Args:
        store: a hub store.
        run: run id or None.

    Returns:
        Its `RunSummary`.

    Raises:
        SystemExit: no such run, or no run at all (the message lists the runs).
    """
    runs = store.runs()
    if not runs:
        raise SystemExit("the recording holds no run")
    if run is not None:
        found = next((r for r in runs if r.run == run), None)
        if found is None:
            raise SystemExit(f"no run {run!r}; runs: {', '.join(r.run for r in runs)}")
        return found
    full = [r for r in runs if r.scope == "full" and r.parent_run is None]
    return (full or runs)[-1]


def live_hub(path: str | Path) -> str | None:
    """The endpoint of the hub writing ``path`` now, if one is (from its ``meta.json``)."""
    from rankscope.hub.recording import read_meta

    sessions = read_meta(path).get("sessions") or []
    last = sessions[-1] if sessions and isinstance(sessions[-1], dict) else {}
    if last.get("stopped_ns") is None and isinstance(last.get("endpoint"), str):
        return str(last["endpoint"])
    return None


def _prepare(args: argparse.Namespace) -> tuple[Any, Any]:
    from rankscope.diagnosis.engine import diagnose
    from rankscope.launch.plan import propose
    from rankscope.launch.runner import LaunchSettings, prepare
    from rankscope.launch.templates import find_launcher

    store = load_store(args.path, args.last)
    summary = pick_run(store, args.run)
    window = store.window(summary.run, last=args.last)
    baseline = store.window(args.baseline, last=args.last) if args.baseline else None
    verdict = diagnose(window, baseline).verdict
    plan = propose(
        window,
        verdict.hypotheses,
        args.scope,
        run=args.new_run,
        keep_global_batch=args.keep_global_batch,
    )
    hub = args.hub or live_hub(args.path)
    if hub is None:
        raise SystemExit(
            f"no hub is recording {args.path} now; start one (rankscope hub --record "
            f"{args.path}) or pass --hub ENDPOINT"
        )
    settings = LaunchSettings(
        hub=hub,
        script=args.script,
        script_args=tuple(args.script_arg) if args.script_arg is not None else None,
        master_port=args.master_port,
        steps=args.steps,
    )
    template = find_launcher(args.launcher, args.launchers)
    launch = prepare(plan, template, settings, record=args.path, manifest=window.manifest)
    return launch, verdict


def run(args: argparse.Namespace) -> int:
    from rankscope.launch.report import launch_text
    from rankscope.launch.runner import start
    from rankscope.launch.safety import UnsafeValueError
    from rankscope.launch.templates import TemplateError, list_launchers, load_template

    if args.list_launchers:
        for name, path in list_launchers(args.launchers).items():
            try:
                desc = load_template(path).description
            except TemplateError as exc:
                desc = f"(broken: {exc})"
            print(f"{name:<16} {desc}  [{path}]")
        return 0
    try:
        launch, verdict = _prepare(args)
    except (UnsafeValueError, TemplateError, ValueError, KeyError) as exc:
        print(f"rankscope rerun: {exc}", file=sys.stderr)
        return 2
    go = args.yes and not args.dry_run
    if args.json:
        out = launch.to_dict()
        out["verdict"] = [h.mechanism for h in verdict.hypotheses[:3]]
        out["launched"] = go
        print(json.dumps(out, indent=2))
    else:
        print("\n".join(launch_text(launch)))
    if not go:
        if not args.json:
            print("dry run: nothing was started; pass --yes to launch")
        return 0
    running = start(launch)
    if not args.json:
        print(f"started {running.run} (pids {', '.join(map(str, running.pids))})", flush=True)
    if args.detach:
        return 0
    try:
        while (code := running.poll()) is None:
            time.sleep(0.2)
    except KeyboardInterrupt:
        code = running.cancel()
        print(f"cancelled {running.run}", file=sys.stderr)
        return 130
    if not args.json:
        print(f"{running.run} finished with exit code {code}; log: {launch.log}")
    return 0 if code == 0 else 1
