"""``rankscope sweep PATH --scope pairwise``: repeat a recorded run's own collectives outside
the application, nccl-tests style, and say whether the primitive path alone is slow.

The plan comes from the run's window and its diagnosis (`rankscope.launch.sweep.plan_sweep`):
the groups, ops and message sizes the run issued plus a size ladder around them, on one
node, two nodes or the full group — or, at ``pairwise``, each link of the suspect group in
turn. Without ``--yes`` the plan and its command are printed and nothing starts.

With ``--yes`` the sweep runs: through a launcher template like a rerun (``torchrun``: one
`rankscope.launch.sweep_worker` per rank under ``rankscope run``, which reports it to the
hub as a run of scope ``sweep`` with ``parent_run``), or, for a simulated parent, on the
simulated cluster (`rankscope.sim.sweep`, priced in this process from the parent's
scenario; it is not sent to a hub). The result goes to ``PATH/sweeps/<run>.json``, with
its algbw/busbw per size beside the application's curve and the baseline's, and the
pairwise finding (the slow pair, rail, NIC or host).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, TextIO

from rankscope.commands.grammar import (
    add_baseline,
    add_run,
    add_steps,
    baseline_window,
    read_store,
    warn,
    window_of,
)
from rankscope.errors import CommandError
from rankscope.sanitize import terminal_text

HELP = "Repeat a run's collectives outside it (pairwise, node, full) and report busbw per size"
DEFAULT_STEPS = 64
SIMULATED = "simulated"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from rankscope.launch.sweep import SCOPES

    p.add_argument("path", metavar="PATH", help="recording directory of the hub")
    p.add_argument("--scope", required=True, choices=SCOPES, help="where the sweep runs")
    add_run(p, "run whose collectives are repeated (default: the latest full run)")
    add_baseline(p)
    add_steps(p, DEFAULT_STEPS, "most recent steps of the run to analyse")
    p.add_argument("--group", default=None, help="sweep only this group (its name in the run)")
    p.add_argument(
        "--sizes",
        nargs="+",
        default=None,
        metavar="SIZE",
        help="message sizes per rank (65536, 64K, 4M) instead of the ladder around the run's",
    )
    p.add_argument("--iters", type=int, default=5, help="timed operations per size (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed operations per size")
    p.add_argument("--repeats", type=int, default=1, help="timed loops per size (median kept)")
    p.add_argument(
        "--launcher",
        default="torchrun",
        help="launcher template, or 'simulated' for a simulated parent (default torchrun)",
    )
    p.add_argument(
        "--launchers",
        action="append",
        default=[],
        metavar="DIR",
        help="extra folder of launcher templates (repeatable)",
    )
    p.add_argument(
        "--hub", default=None, help="hub endpoint the sweep reports to (default: PATH's live hub)"
    )
    p.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with CUDA)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port")
    p.add_argument("--new-run", metavar="ID", default=None, help="id of the sweep run")
    p.add_argument("--yes", action="store_true", help="run the sweep (default: show the plan)")
    p.add_argument("--json", action="store_true", help="print a machine-readable result")


def sweeps_dir(record: str | Path) -> Path:
    """Where the plans, logs and results of a recording's sweeps live: ``<record>/sweeps``."""
    return Path(record) / "sweeps"


def _unique(run: str, folder: Path) -> str:
    name, n = run, 1
    while (folder / f"{name}.json").exists() or (folder / f"{name}.plan.json").exists():
        n += 1
        name = f"{run}-{n}"
    return name


def _hub(args: argparse.Namespace) -> tuple[str, str | None]:
    from rankscope.collector.runtime import DEFAULT_HUB
    from rankscope.commands.rerun import live_hub

    if args.hub:
        return args.hub, None
    live = live_hub(args.path)
    if live is not None:
        return live, None
    return DEFAULT_HUB, (
        f"no hub is recording {args.path} now: the sweep's result file is written, but no hub "
        f"may receive it as a run (start rankscope hub --record {args.path} or pass --hub)"
    )


def _simulated_scenario(window: Any) -> Any:
    from rankscope.sim.spec import build_scenario

    sim = window.manifest.get("sim") if isinstance(window.manifest, dict) else None
    if not isinstance(sim, dict) or not isinstance(sim.get("spec"), dict):
        raise CommandError(
            f"run {window.run!r} is not a simulated run: the simulated launcher sweeps only "
            "those (use --launcher torchrun)"
        )
    return build_scenario(sim["spec"], name=str(sim.get("scenario", "parent")))


def _template_launch(args: argparse.Namespace, plan: Any, folder: Path, hub: str) -> Any:
    """The sweep's worker through a launcher template, as a rerun's script would run."""
    from rankscope.launch import sweep_worker
    from rankscope.launch.plan import RerunPlan
    from rankscope.launch.runner import LaunchSettings, prepare
    from rankscope.launch.templates import find_launcher

    rerun = RerunPlan(
        job=plan.job,
        parent_run=plan.parent_run,
        run=plan.run,
        scope="sweep",
        hosts=plan.hosts,
        ranks=plan.ranks,
        nproc_per_node=plan.nproc_per_node,
        world_size=plan.world_size,
        parent_world_size=plan.world_size,
        gpus=(),
        shards=(),
        reason=plan.reason,
        preserved=(),
        changes=(),
        expectations=(),
    )
    script_args = [
        f"--plan={folder / f'{plan.run}.plan.json'}",
        f"--out={folder / f'{plan.run}.json'}",
    ]
    if args.backend:
        script_args.append(f"--backend={args.backend}")
    settings = LaunchSettings(
        hub=hub,
        script=str(Path(sweep_worker.__file__).resolve()),
        script_args=tuple(script_args),
        master_port=args.master_port,
    )
    template = find_launcher(args.launcher, args.launchers)
    launch = prepare(rerun, template, settings, record=args.path)
    log = folder / f"{plan.run}.log"
    return replace(launch, log=log, values={**launch.values, "log": str(log)})


def _plan_text(plan: Any, command: str, warnings: list[str]) -> list[str]:
    def sizes(s: Any) -> str:
        return ", ".join(_size_text(int(b)) for b in s)

    lines = [
        f"sweep {plan.run} of {plan.parent_run} at {plan.scope}: {plan.reason}",
        f"  hosts {', '.join(plan.hosts)}; {plan.world_size} ranks (parent ranks "
        f"{', '.join(map(str, plan.ranks))}); dtype {plan.dtype}, {plan.warmup} warmup + "
        f"{plan.iters} timed x{plan.repeats}",
    ]
    for t in plan.targets:
        lines.append(f"  {t.op} on {t.group} ({len(t.ranks)} ranks): {sizes(t.sizes)}")
    if plan.pairs:
        shown = ", ".join(f"{a}-{b}" for a, b in plan.pairs[:12])
        more = f" and {len(plan.pairs) - 12} more" if len(plan.pairs) > 12 else ""
        lines.append(f"  {plan.pair_op} on {len(plan.pairs)} links: {shown}{more}")
        lines.append(f"  at {sizes(plan.pair_sizes)}")
    lines += [f"  note: {n}" for n in plan.notes]
    lines.append(f"  command: {command}")
    lines += [f"  warning: {w}" for w in warnings]
    return lines


def _size_text(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.4g} {unit}"
    return f"{nbytes} B"


def _run_template(launch: Any, plan: Any, folder: Path) -> int:
    from rankscope.launch.runner import start

    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{plan.run}.plan.json").write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
    running = start(launch)
    try:
        while (code := running.poll()) is None:
            time.sleep(0.2)
    except KeyboardInterrupt:
        running.cancel()
        print(terminal_text(f"cancelled {plan.run}"), file=sys.stderr)
        return 130
    return code


def _analyse(result: dict[str, Any], plan: Any, window: Any, baseline: Any) -> dict[str, Any]:
    from rankscope.launch.sweep import compare, pair_points, pairwise_finding, sweep_points

    out: dict[str, Any] = {
        "run": plan.run,
        "parent_run": plan.parent_run,
        "scope": "sweep",
        "sweep_scope": plan.scope,
        "backend": result.get("backend"),
        "points": [asdict(p) for p in sweep_points(result)],
    }
    found: dict[str, Any] = {"pair": None, "rail": None, "host": None, "rank": None, "group": None}
    if plan.scope == "pairwise":
        points = pair_points(result, window)
        finding = pairwise_finding(points)
        out["pairwise"] = asdict(finding)
        pair = finding.slow_pairs[0] if finding.slow_pairs else None
        if finding.slow_rail is not None:
            # A slow rail is named by one of its own links, not a mixed-rail pair that
            # merely crosses it.
            on_rail = [p.pair for p in points if p.rails == (finding.slow_rail, finding.slow_rail)]
            pair = next((q for q in finding.slow_pairs if q in on_rail), pair)
        found.update(
            finding=finding.finding,
            pair=list(pair) if pair is not None else None,
            slow_pairs=[list(p) for p in finding.slow_pairs],
            rail=finding.slow_rail,
            host=finding.slow_host,
            rank=finding.slow_rank,
        )
        out["reproduces"] = None
        out["conclusion"] = finding.why
    else:
        comp = compare(result, window, baseline)
        out["comparison"] = asdict(comp)
        out["reproduces"] = comp.reproduces
        out["conclusion"] = comp.conclusion
        found["group"] = comp.slow_groups[0] if comp.slow_groups else None
        if comp.app_slow is False:
            found["finding"] = "healthy"
        else:
            found["finding"] = "primitive" if comp.reproduces else "application"
    out["found"] = found
    return out


def _result_text(analysis: dict[str, Any]) -> list[str]:
    lines = [f"{analysis['run']} ({analysis['backend']}): {analysis['conclusion']}"]
    for p in analysis["points"]:
        lines.append(
            f"  {p['op']:<14} {p['group']:<10} {p['nbytes']:>11} B  algbw "
            f"{p['algbw_gbps']:8.3g} GB/s  busbw {p['busbw_gbps']:8.3g} GB/s"
        )
    pw = analysis.get("pairwise")
    if pw:
        for pair, bw in sorted(pw["pair_busbw_gbps"].items(), key=lambda kv: kv[1])[:8]:
            lines.append(f"  link {pair:<9} busbw {bw:8.3g} GB/s")
        f = analysis["found"]
        if f["finding"] != "healthy":
            lines.append(
                f"  found {f['finding']}: pair {f['pair']}, rail {f['rail']}, host {f['host']}"
            )
    return lines


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``rankscope sweep``: plan, and with ``--yes`` run and judge, a sweep.

    Args:
        args: the parsed command line.
        out: where the plan and the result are written (default: standard output; the
            TUI passes its own buffer).

    Returns:
        The exit status.
    """
    out = sys.stdout if out is None else out
    from rankscope.commands.rerun import pick_run
    from rankscope.diagnosis.engine import diagnose
    from rankscope.launch.sweep import plan_sweep

    if args.iters < 1 or args.warmup < 0 or args.repeats < 1:
        raise CommandError("--iters and --repeats must be at least 1, --warmup at least 0")
    store = read_store(args.path, args.steps)
    summary = pick_run(store, args.run)
    window = window_of(store, args.path, summary.run, args.steps)
    baseline = baseline_window(args, store, args.path)
    verdict = diagnose(window, baseline).verdict
    folder = sweeps_dir(args.path)
    try:
        plan = plan_sweep(
            window,
            args.scope,
            hypotheses=verdict.hypotheses,
            group=args.group,
            sizes=args.sizes,
            run=args.new_run,
            iters=args.iters,
            warmup=args.warmup,
            repeats=args.repeats,
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    plan = replace(plan, run=_unique(plan.run, folder))
    warnings: list[str] = []
    launch = None
    if args.launcher == SIMULATED:
        scenario = _simulated_scenario(window)
        command = (
            f"simulated cluster, in this process: scenario {scenario.name} "
            f"(seed {scenario.seed}) as the parent ran it; not reported to a hub"
        )
    else:
        hub, warning = _hub(args)
        if warning is not None:
            warnings.append(warning)
        launch = _template_launch(args, plan, folder, hub)
        warnings += list(launch.warnings)
        command = " ; ".join(c.display for c in launch.commands)
    out_file = folder / f"{plan.run}.json"
    if not args.yes:
        if args.json:
            print(
                json.dumps(
                    {
                        "plan": plan.to_dict(),
                        "command": command,
                        "warnings": warnings,
                        "launched": False,
                    },
                    indent=2,
                ),
                file=out,
            )
        else:
            print(terminal_text("\n".join(_plan_text(plan, command, warnings))), file=out)
            print("dry run: nothing was started or written; pass --yes to run the sweep", file=out)
        return 0
    if not args.json:
        print(terminal_text("\n".join(_plan_text(plan, command, warnings))), flush=True, file=out)
    else:
        for w in warnings:
            warn(w)
    if launch is None:
        from rankscope.sim.sweep import simulate_sweep

        result = simulate_sweep(_simulated_scenario(window), plan.to_dict())
        folder.mkdir(parents=True, exist_ok=True)
    else:
        code = _run_template(launch, plan, folder)
        if code != 0 or not out_file.exists():
            raise CommandError(f"sweep {plan.run} failed (exit code {code}); its log: {launch.log}")
        from rankscope.launch.sweep import load_result

        try:
            result = load_result(out_file)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
    analysis = _analyse(result, plan, window, baseline)
    result = {**result, "run": plan.run, "parent_run": plan.parent_run, "scope": "sweep"}
    result["analysis"] = analysis
    tmp = out_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=_plain) + "\n")
    tmp.replace(out_file)
    if args.json:
        print(
            json.dumps(
                {**analysis, "result": str(out_file), "launched": True}, indent=2, default=_plain
            ),
            file=out,
        )
    else:
        print(terminal_text("\n".join(_result_text(analysis))), file=out)
        print(terminal_text(f"result: {out_file}"), file=out)
    return 0


def _plain(value: Any) -> Any:
    # NaN-free plain JSON: numpy scalars and tuples pass through json's own handling.
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON: {type(value).__name__}")
