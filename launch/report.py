"""Plain-text and JSON forms of plans, launches and ladders, for the CLI, snapshots and the
TUI. The plan is always shown in full — hosts, ranks, environment and the exact command —
because it is what the user confirms."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from rankscope.launch.ladder import Ladder
from rankscope.launch.plan import RerunPlan
from rankscope.launch.runner import Launch

__all__ = ["ladder_dict", "ladder_text", "launch_text", "plan_text"]


def _ms(ns: float) -> str:
    return "-" if not math.isfinite(ns) else f"{ns / 1e6:.1f}"


def plan_text(plan: RerunPlan) -> list[str]:
    """The plan: scope, hosts, ranks, what is kept, what changes, what outcomes mean.

    Args:
        plan: the plan.

    Returns:
        Lines of text.
    """
    ranks = ",".join(map(str, plan.ranks))
    if len(ranks) > 60:
        ranks = f"{plan.ranks[0]}..{plan.ranks[-1]} ({len(plan.ranks)} ranks)"
    lines = [
        f"rerun {plan.parent_run} at {plan.scope} as {plan.run} (job {plan.job})",
        f"  hosts:   {', '.join(plan.hosts)}  ({plan.nnodes} x {plan.nproc_per_node} ranks)",
        f"  ranks:   {ranks} of {plan.parent_world_size}",
        f"  why:     {plan.reason}",
    ]
    if plan.gpus:
        lines.append(f"  gpus:    {','.join(map(str, plan.gpus))} on each host")
    lines.append("  keeps:")
    lines += [f"    - {p}" for p in plan.preserved]
    lines.append("  changes:")
    for c in plan.changes:
        note = f"  ({c.note})" if c.note else ""
        lines.append(f"    - {c.name}: {c.before} -> {c.after}{note}")
    if plan.expectations:
        lines.append("  expected:")
        for e in plan.expectations:
            mark = "reproduces here" if e.should_reproduce else "cannot show here"
            lines.append(f"    - {e.mechanism} ({e.score:.2f}, {mark})")
            lines.append(f"        appears: {e.if_appears}")
            lines.append(f"        absent:  {e.if_absent}")
    lines += [f"  warning: {w}" for w in plan.warnings]
    return lines


def launch_text(launch: Launch) -> list[str]:
    """The plan followed by every command exactly as it will run, and its environment.

    Args:
        launch: the prepared launch.

    Returns:
        Lines of text.
    """
    lines = plan_text(launch.plan)
    lines.append(f"  launcher: {launch.launcher}")
    for i, cmd in enumerate(launch.commands):
        where = f" on {cmd.host}" if cmd.host else ""
        lines.append(f"  command {i + 1}{where}:")
        lines.append(f"    argv: {list(cmd.argv)}")
        for name, value in cmd.env.items():
            lines.append(f"    env:  {name}={value}")
        lines.append(f"    $ {cmd.display}")
    lines.append(f"  log:     {launch.log}")
    lines += [f"  warning: {w}" for w in launch.warnings]
    return lines


def ladder_text(ladder: Ladder) -> list[str]:
    """The ladder as a table: one line per rung, then the conclusion.

    Args:
        ladder: the ladder.

    Returns:
        Lines of text.
    """
    lines = [
        f"ladder of {ladder.parent_run} (healthy expectation: {ladder.reference})",
        f"{'scope':<9} {'run':<24} {'ranks':>5} {'p50 ms':>8} {'p90 ms':>8} {'max ms':>8} "
        f"{'local':>6} {'spread':>6} {'busbw':>6}  {'verdict':<16} regression",
    ]
    for r in ladder.rungs:
        bw = f"{r.comm.ratio:.2f}x" if r.comm is not None else "-"
        verdict = r.verdict or "-"
        lines.append(
            f"{r.scope:<9} {r.run[:24]:<24} {r.world_size:>5} {_ms(r.step.p50):>8} "
            f"{_ms(r.step.p90):>8} {_ms(r.step.max):>8} {r.local_ratio:>5.2f}x "
            f"{r.spread_ratio:>6.0%} {bw:>6}  "
            f"{verdict[:16]:<16} {'YES' if r.regression else 'no'}: {r.why}"
        )
    lines.append("decomposition (mean ms per rank-step):")
    for r in ladder.rungs:
        parts = ", ".join(f"{k} {_ms(v)}" for k, v in r.decomposition.items() if v > 0)
        lines.append(f"  {r.scope:<9} {parts}")
    if ladder.first_scope and ladder.unmeasured_below:
        lines.append(
            f"smallest measured scope with the regression: {ladder.first_scope} "
            f"({ladder.first_run}); not run below it: {', '.join(ladder.unmeasured_below)}"
        )
    elif ladder.first_scope:
        lines.append(f"first scope with the regression: {ladder.first_scope} ({ladder.first_run})")
    else:
        lines.append("first scope with the regression: none")
    lines.append(f"  means:      {ladder.meaning}")
    if ladder.eliminated:
        lines.append(f"  eliminates: {', '.join(ladder.eliminated)}")
    if ladder.implicated:
        lines.append(f"  implicates: {', '.join(ladder.implicated)}")
    if ladder.missing:
        lines.append(f"  not run:    {', '.join(ladder.missing)}")
    return lines


def _clean(value: Any) -> Any:
    # JSON has no NaN: unknown numbers become null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def ladder_dict(ladder: Ladder) -> dict[str, Any]:
    """The ladder as plain JSON-ready data (``rankscope ladder --json``).

    Args:
        ladder: the ladder.

    Returns:
        Keys: ``parent_run``, ``reference``, ``reference_local_ns``, ``rungs`` (each with
        ``scope``, ``run``, ``world_size``, ``hosts``, ``step`` {n, mean, p50, p90, p99, max,
        tail_stalls, stall_threshold} in ns, ``decomposition`` (ns), ``local_ns``,
        ``local_ratio``, ``spread_ratio``, ``comm`` {group, op, size, busbw_gbps, reference_gbps, ratio} or
        null, ``unmatched_points``, ``regression``, ``why``, ``verdict``, ``verdict_score``),
        ``first_scope``, ``first_run``, ``meaning``, ``eliminated``, ``implicated``,
        ``missing``, ``unmeasured_below`` (scopes under ``first_scope`` with no run, so
        ``first_scope`` is only the smallest measured one), ``tolerances`` {local, spread,
        comm}, ``rule``.
    """
    out = asdict(ladder)
    for rung, obj in zip(out["rungs"], ladder.rungs):
        if obj.comm is not None:
            rung["comm"]["ratio"] = obj.comm.ratio
    return _clean(out)
