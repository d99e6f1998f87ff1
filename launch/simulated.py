"""Entry point of the ``simulated`` launcher: rerun a simulated job at a reduced scope.

``python -m rankscope.launch.simulated --hub ... --scenario ... --scope one-node --hosts
node003 ...`` loads the parent's scenario with the same seed and cluster size, keeps the
chosen hosts, ranks or GPUs (`rankscope.sim.ScopeSpec`) and streams the new run to the hub
with its ``parent_run`` — what ``rankscope run -- torchrun`` does for a real job. The
launcher template ``config/launchers/simulated.toml`` builds this command line from a plan.

The simulator is imported only when this runs, never by the planning code.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from rankscope.launch.safety import UnsafeValueError, check_value

__all__ = ["main"]


def _list(field: str, text: str, kind: str) -> list[str]:
    items = [t for t in text.split(",") if t]
    return [check_value(field, t, kind) for t in items]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m rankscope.launch.simulated",
        description="Rerun a simulated job at a reduced scope, reporting to a hub.",
    )
    p.add_argument("--hub", required=True, help="hub data endpoint")
    p.add_argument(
        "--scenario",
        required=True,
        help="the parent's scenario: a name, a .toml file, or its saved .json spec",
    )
    p.add_argument("--seed", type=int, default=None, help="scenario seed (the parent's)")
    p.add_argument("--world-size", type=int, default=None, help="the parent's world size")
    p.add_argument("--job", default=None, help="job name (the parent's)")
    p.add_argument("--scope", required=True, choices=("full", "two-node", "one-node", "one-rank"))
    p.add_argument("--hosts", default="", help="hosts, comma-separated (node scopes)")
    p.add_argument("--ranks", default="", help="parent ranks kept (one-rank: the device's rank)")
    p.add_argument("--gpus", default="", help="GPU indices kept on each host")
    p.add_argument("--run", required=True, help="id of the new run")
    p.add_argument("--parent-run", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--pace", default="fast", help="fast, realtime, or seconds per step")
    p.add_argument(
        "--swap-shards", default="", help="two ranks of the rerun that exchange data shards"
    )
    p.add_argument(
        "--swap-placement", default="", help="two ranks of the rerun that exchange devices"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the rerun; prints one JSON line about what was sent.

    Args:
        argv: arguments (default ``sys.argv[1:]``).

    Returns:
        0 on success, 2 on a bad argument.
    """
    args = parse_args(argv)
    try:
        hosts = _list("hosts", args.hosts, "host")
        ranks = [int(r) for r in _list("ranks", args.ranks, "int")]
        gpus = [int(g) for g in _list("gpus", args.gpus, "int")]
        swap_shards = tuple(int(r) for r in _list("swap_shards", args.swap_shards, "int"))
        swap_placement = tuple(int(r) for r in _list("swap_placement", args.swap_placement, "int"))
        check_value("run", args.run, "name")
        check_value("parent_run", args.parent_run, "name")
    except UnsafeValueError as exc:
        print(f"rankscope.launch.simulated: {exc}", file=sys.stderr)
        return 2
    from rankscope.sim import ScenarioError, ScopeSpec, load_scenario
    from rankscope.sim import run as run_sim

    try:
        scenario = load_scenario(args.scenario, seed=args.seed, ranks=args.world_size, job=args.job)
    except ScenarioError as exc:
        print(f"rankscope.launch.simulated: {exc}", file=sys.stderr)
        return 2
    if args.scope == "one-rank":
        # The rank names the device; hosts and GPUs would say the same thing again.
        spec = ScopeSpec(args.scope, ranks=tuple(ranks[:1]))
    elif args.scope in ("one-node", "two-node"):
        spec = ScopeSpec(args.scope, hosts=tuple(hosts), gpus=tuple(gpus))
    else:
        spec = ScopeSpec("full")
    spec = replace(spec, swap_shards=swap_shards, swap_placement=swap_placement)
    pace: str | float = args.pace
    if pace not in ("fast", "realtime"):
        pace = float(pace)
    try:
        info = run_sim(
            scenario,
            args.hub,
            args.steps,
            pace=pace,
            scope=spec,
            parent_run=args.parent_run,
            run_id=args.run,
            argv=["rankscope.launch.simulated", *(argv if argv is not None else sys.argv[1:])],
        )
    except ValueError as exc:
        print(f"rankscope.launch.simulated: {exc}", file=sys.stderr)
        return 2
    print(
        json.dumps(
            {
                "run": info.run,
                "parent_run": info.parent_run,
                "scope": info.scope,
                "world_size": info.world_size,
                "steps": info.steps,
                "messages": info.messages,
                "dropped": info.dropped,
                "wall_s": round(info.wall_s, 3),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
