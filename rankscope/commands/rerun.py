"""``rankscope rerun PATH --scope one-node``: propose a reduced-scope rerun of a recorded run,
show it in full, and launch it only with ``--yes``.

The plan comes from the run's window and its diagnosis (the verdict's top hypotheses pick
the suspect rank, node or pair); the command from a launcher template. The rerun reports
to the hub that records PATH (or ``--hub``) as a new run with ``parent_run`` and its scope;
its output goes to ``PATH/reruns/<run>.log``.

The program a rerun runs is, unless ``--script`` names it, the parent's ``argv`` from its
manifest: telemetry. The plan marks every part that comes from telemetry (script,
arguments, hosts), and ``--yes`` runs a telemetry script only when ``[rerun] allow`` of
the settings file (``--config``, ``RANKSCOPE_CONFIG``, ``./rankscope.toml``, the user
config dir) matches it (`rankscope.launch.runner.program_check`); naming the parent's
script with ``--script`` confirms it and keeps its recorded arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rankscope.collector.shards import SWAP_ENV  # set in a real rerun by --swap-shards
from rankscope.commands.grammar import (
    add_baseline,
    add_run,
    add_steps,
    baseline_window,
    read_store,
    steps_count,
    window_of,
)
from rankscope.errors import CommandError
from rankscope.launch.scopes import LADDER
from rankscope.launch.templates import is_local_host
from rankscope.sanitize import for_terminal, terminal_text

HELP = "Propose (and with --yes launch) a one-rank/one-node/two-node/full rerun of a run"
DEFAULT_STEPS = 64
"""Steps of the run the plan, the ladder and an experiment's evaluation look at."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path", metavar="PATH", nargs="?", default=None, help="recording directory of the hub"
    )
    p.add_argument(
        "--scope", default=None, choices=LADDER, help="scope of the rerun (required to plan one)"
    )
    add_run(p, "run to reduce (default: the latest full run)")
    add_baseline(p)
    add_steps(p, DEFAULT_STEPS, "most recent steps of the run to analyse", old=("--last",))
    p.add_argument("--launcher", default="torchrun", help="launcher template (default torchrun)")
    p.add_argument(
        "--launchers",
        action="append",
        default=[],
        metavar="DIR",
        help="extra folder of launcher templates (repeatable; overrides shipped ones by name)",
    )
    p.add_argument(
        "--list-launchers", action="store_true", help="list templates and exit (needs nothing else)"
    )
    p.add_argument(
        "--hub", default=None, help="hub endpoint the rerun reports to (default: PATH's live hub)"
    )
    p.add_argument(
        "--script",
        default=None,
        help="training script (default: the run's own, from its manifest; --yes runs that "
        "only when it is in [rerun] allow, or named here, which keeps its arguments)",
    )
    p.add_argument(
        "--script-arg",
        action="append",
        default=None,
        metavar="ARG",
        help="a script argument (repeatable; default: the run's own)",
    )
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port")
    p.add_argument(
        "--rerun-steps",
        type=steps_count,
        default=None,
        metavar="N",
        help="steps the rerun runs (simulated launcher; default: the template's)",
    )
    p.add_argument(
        "--new-run", metavar="ID", default=None, help="id of the new run (default <run>-<scope>)"
    )
    p.add_argument(
        "--keep-global-batch",
        action="store_true",
        help="raise gradient accumulation to keep the global batch (default: keep local work)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="only show the plan and its commands, writing nothing (the default without --yes)",
    )
    p.add_argument("--yes", action="store_true", help="launch without asking")
    p.add_argument(
        "--config",
        metavar="PATH",
        default=None,
        help="settings file with the [rerun] allow-list (default: RANKSCOPE_CONFIG, "
        "./rankscope.toml, the user config dir)",
    )
    p.add_argument("--detach", action="store_true", help="with --yes: do not wait for the end")
    p.add_argument(
        "--swap-shards",
        metavar="R1,R2",
        default=None,
        help="two ranks of the rerun exchange their data shards (slowness that follows the "
        "shard is data; that stays is hardware)",
    )
    p.add_argument(
        "--swap-placement",
        metavar="R1,R2",
        default=None,
        help="two ranks of the rerun exchange their hosts/GPUs, every group keeping its shape "
        "(simulated launcher only)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def swap_pair(flag: str, text: str) -> tuple[int, int]:
    """Read ``R1,R2`` of a swap flag.

    Raises:
        CommandError: not two different non-negative integers.
    """
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise CommandError(f"{flag} takes two ranks R1,R2 (e.g. {flag} 3,5), got {text!r}")
    a, b = int(parts[0]), int(parts[1])
    if a == b:
        raise CommandError(f"{flag} takes two different ranks, got {text!r}")
    return a, b


def _swap(args: argparse.Namespace, world: int) -> Any:
    from rankscope.launch.plan import swap_of

    given = [(k, v) for k, v in (("shards", args.swap_shards), ("placement", args.swap_placement))]
    given = [(k, v) for k, v in given if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise CommandError("one swap per rerun: give --swap-shards or --swap-placement")
    kind, text = given[0]
    pair = swap_pair(f"--swap-{kind}", text)
    try:
        return swap_of(kind, pair, world)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def _remote_env(launcher: str, command: Any, assign: str) -> Any:
    # ssh and sbatch --wrap carry the environment inside the command line, as a leading
    # ``env NAME=value ...`` (`rankscope.launch.safety.shell_join`): the swap joins it there.
    argv = list(command.argv)
    for i, token in enumerate(argv):
        for lead in ("env ", "--wrap=env "):
            if token.startswith(lead):
                argv[i] = f"{lead}{assign} {token[len(lead) :]}"
                return replace(command, argv=tuple(argv))
    raise CommandError(
        f"--swap-shards on the remote host {command.host} is not supported by the {launcher} "
        f"template (no environment in its command line); set {assign} there"
    )


def apply_swap(launch: Any, swap: Any) -> Any:
    """The launch with a swap applied, as ``rerun --swap-*`` runs it.

    The simulated launcher takes the swap as its own flag; a real workload reads a shard
    swap from its environment (`SWAP_ENV`), in the command's env on this machine and in
    the remote command line's ``env`` prefix on another. Templates do not know swaps, so
    the rendered launch is amended here.

    Raises:
        CommandError: a placement swap on a real launcher, or a remote command with no
            environment in its command line.
    """
    pair = f"{swap.ranks[0]},{swap.ranks[1]}"
    flag = f"--swap-{swap.kind}={pair}"
    assign = f"{SWAP_ENV}={pair}"
    commands = []
    for c in launch.commands:
        if "rankscope.launch.simulated" in c.argv:
            commands.append(replace(c, argv=(*c.argv, flag)))
        elif swap.kind == "placement":
            raise CommandError(
                f"--swap-placement is not supported by the {launch.launcher} template yet "
                "(it needs a rank-order change); use the simulated launcher or reorder hosts"
            )
        elif c.host is not None and not is_local_host(c.host):
            commands.append(_remote_env(launch.launcher, c, assign))
        else:
            commands.append(replace(c, env={**c.env, SWAP_ENV: pair}))
    return replace(launch, commands=tuple(commands), plan=replace(launch.plan, swap=swap))


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
        CommandError: no such run, or no run at all (the message lists the runs).
    """
    runs = store.runs()
    if not runs:
        raise CommandError("the recording holds no run")
    if run is not None:
        found = next((r for r in runs if r.run == run), None)
        if found is None:
            known = ", ".join(for_terminal(r.run) for r in runs)
            raise CommandError(f"unknown run {run!r}; runs: {known}")
        return found
    full = [r for r in runs if r.scope == "full" and r.parent_run is None]
    return (full or runs)[-1]


def live_hub(path: str | Path) -> str | None:
    """The endpoint of the hub writing ``path`` now, if one is (from its ``meta.json``)."""
    live, endpoint = _last_hub(path)
    return endpoint if live else None


def _last_hub(path: str | Path) -> tuple[bool, str | None]:
    # (still writing, endpoint) of the recording's last hub session. A session that was
    # never marked stopped is live only while its process runs and its heartbeat is fresh
    # (`session_liveness`): a hub killed with -9 does not get a rerun sent to it.
    from rankscope.hub.recording import session_liveness

    state = session_liveness(path)
    endpoint = state.endpoint if isinstance(state.endpoint, str) else None
    return state.live and endpoint is not None, endpoint


def _report_hub(args: argparse.Namespace, launching: bool) -> tuple[str, str | None]:
    """The endpoint the rerun reports to, and a warning when it is only a stand-in.

    A launch needs a hub that records PATH now (or ``--hub``). A dry run does not: it shows
    the command with the endpoint of the hub that last wrote PATH (or the default), and
    says that nothing may listen there.
    """
    from rankscope.collector.runtime import DEFAULT_HUB

    if args.hub:
        return args.hub, None
    live, endpoint = _last_hub(args.path)
    if live and endpoint is not None:
        return endpoint, None
    why = (
        f"no hub is recording {args.path} now; start one (rankscope hub --record "
        f"{args.path}) or pass --hub ENDPOINT"
    )
    if launching:
        raise CommandError(why)
    stand_in = endpoint or DEFAULT_HUB
    return stand_in, f"{why}: the command shows {stand_in}, where nothing may listen"


def _prepare(args: argparse.Namespace, launching: bool) -> tuple[Any, Any]:
    from rankscope.diagnosis.engine import diagnose
    from rankscope.launch.plan import propose
    from rankscope.launch.runner import LaunchSettings, prepare
    from rankscope.launch.templates import find_launcher

    store = read_store(args.path, args.steps)
    summary = pick_run(store, args.run)
    window = window_of(store, args.path, summary.run, args.steps)
    baseline = baseline_window(args, store, args.path, legacy_run=True)
    verdict = diagnose(window, baseline).verdict
    try:
        plan = propose(
            window,
            verdict.hypotheses,
            args.scope,
            run=args.new_run,
            keep_global_batch=args.keep_global_batch,
        )
    except ValueError as exc:  # the run cannot be reduced to this scope
        raise CommandError(str(exc)) from None
    swap = _swap(args, plan.world_size)
    hub, warning = _report_hub(args, launching)
    settings = LaunchSettings(
        hub=hub,
        script=args.script,
        script_args=tuple(args.script_arg) if args.script_arg is not None else None,
        master_port=args.master_port,
        steps=args.rerun_steps,
    )
    template = find_launcher(args.launcher, args.launchers)
    launch = prepare(plan, template, settings, record=args.path, manifest=window.manifest)
    if warning is not None:
        launch = replace(launch, warnings=(warning, *launch.warnings))
    if swap is not None:
        launch = apply_swap(launch, swap)
    return launch, verdict


def allow_list(config: str | None) -> tuple[str, ...]:
    """The rerun allow-list of the settings file (``[rerun] allow``).

    Args:
        config: ``--config``, or None for the documented discovery order.

    Returns:
        The patterns (empty when no file sets them).

    Raises:
        CommandError: the settings file is missing, unreadable or invalid.
    """
    from rankscope.tui.settings import SettingsError, load_settings

    try:
        return load_settings(config).rerun.allow
    except SettingsError as exc:
        raise CommandError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from rankscope.launch.report import launch_text
    from rankscope.launch.runner import program_check, start
    from rankscope.launch.templates import TemplateError, list_launchers, load_template

    if args.list_launchers:
        for name, path in list_launchers(args.launchers).items():
            try:
                desc = load_template(path).description
            except TemplateError as exc:
                desc = f"(broken: {exc})"
            print(f"{name:<16} {desc}  [{path}]")
        return 0
    if args.path is None or args.scope is None:
        missing = " and ".join(
            what for what, v in (("PATH", args.path), ("--scope", args.scope)) if v is None
        )
        raise CommandError(
            f"rerun needs {missing} (rankscope rerun PATH --scope "
            f"{'|'.join(LADDER)}; or rankscope rerun --list-launchers)"
        )
    go = args.yes and not args.dry_run
    allow = allow_list(getattr(args, "config", None)) if go else ()
    launch, verdict = _prepare(args, go)
    refused = program_check(launch, allow) if go else None
    if args.json:
        out = launch.to_dict()
        out["verdict"] = [h.mechanism for h in verdict.hypotheses[:3]]
        out["launched"] = go and refused is None
        print(json.dumps(out, indent=2))
    else:
        print(terminal_text("\n".join(launch_text(launch))))
        swap = launch.plan.swap
        if swap is not None:
            a, b = swap.ranks
            print(terminal_text(f"swap of {swap.kind} between ranks {a} and {b}; predictions:"))
            for outcome, means in swap.predictions:
                print(terminal_text(f"  {outcome}: {means}"))
    if refused is not None:
        raise CommandError(refused)
    if not go:
        if not args.json:
            print("dry run: nothing was started or written; pass --yes to launch")
        return 0
    running = start(launch)
    if not args.json:
        pids = ", ".join(map(str, running.pids))
        print(terminal_text(f"started {running.run} (pids {pids})"), flush=True)
    if args.detach:
        return 0
    try:
        while (code := running.poll()) is None:
            time.sleep(0.2)
    except KeyboardInterrupt:
        code = running.cancel()
        print(terminal_text(f"cancelled {running.run}"), file=sys.stderr)
        return 130
    if not args.json:
        print(terminal_text(f"{running.run} finished with exit code {code}; log: {launch.log}"))
    return 0 if code == 0 else 1
