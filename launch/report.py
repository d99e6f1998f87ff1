"""Plain-text and JSON forms of plans, launches and ladders, for the CLI, snapshots and the
TUI. The plan is always shown in full — hosts, ranks, environment and the exact command —
because it is what the user confirms."""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from rankscope.launch.ladder import Ladder
from rankscope.launch.plan import RerunPlan
from rankscope.launch.runner import TELEMETRY, Launch

__all__ = ["LADDER_WIDTH", "ladder_dict", "ladder_text", "launch_text", "plan_text", "short_names"]


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


_ORIGIN = {
    TELEMETRY: "FROM TELEMETRY",
    "--script": "from your --script",
    "--script-arg": "from your --script-arg",
    "--scenario": "from your --scenario",
    "template": "the launcher template's own program",
    "none": "none",
}
_TELEMETRY_WHAT = {
    "script": "the parent's manifest argv[0]",
    "args": "the parent's manifest argv[1:]",
    "hosts": "host names the parent's ranks reported",
    "scenario": "the parent's manifest",
}


def sources_text(launch: Launch) -> list[str]:
    """Where each part of what runs comes from: the user's flags, the template, or
    telemetry (what the parent's ranks reported, which anyone reaching the hub can write).

    Args:
        launch: the prepared launch.

    Returns:
        Lines of text (none for a launch that does not say).
    """
    return origin_lines(
        launch.sources,
        {
            "script": launch.values.get("script"),
            "args": " ".join(map(str, launch.values.get("script_args") or ())),
            "hosts": ", ".join(launch.plan.hosts),
            "scenario": launch.values.get("scenario"),
        },
    )


def origin_lines(sources: dict[str, str], shown: dict[str, Any]) -> list[str]:
    """The ``program comes from:`` lines of a plan.

    Args:
        sources: part -> origin (`rankscope.launch.runner.launch_sources`).
        shown: part -> the value it has (script path, arguments, hosts...).

    Returns:
        Lines of text (none when ``sources`` is empty).
    """
    if not sources:
        return []
    lines = ["  program comes from:"]
    for part, origin in sources.items():
        what = _ORIGIN.get(origin, origin)
        if origin == TELEMETRY:
            what += f" ({_TELEMETRY_WHAT.get(part, 'the recording')})"
        value = shown.get(part)
        value = f"{value}  <- " if value and origin not in ("none", "template") else ""
        lines.append(f"    {part + ':':<9} {value}{what}")
    if sources.get("script") == TELEMETRY and shown.get("script"):
        lines.append(
            "    the script was chosen by telemetry: a confirmed launch runs it only when "
            "you name it (--script) or [rerun] allow lists it"
        )
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
    lines += sources_text(launch)
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


LADDER_WIDTH = 80
"""Columns the ladder's text fits by default (a terminal over SSH, a ticket's code block)."""

_SEPARATORS = "-_./:"


def short_names(names: Sequence[str], width: int) -> tuple[dict[str, str], str]:
    """Run names that fit ``width`` cells and still tell the runs apart.

    A rerun is named after its parent (``<run>-<scope>``), so the runs of one ladder share
    a long start and differ at the end: that common start, cut back to a separator, is
    shown as ``…``. A name still too long keeps its end (``…-one-node``); should two ends
    coincide, the name keeps its start and end around the ellipsis instead.

    Args:
        names: the run names.
        width: cells available for one name (at least 3).

    Returns:
        ``(name -> shown, shared)``: ``shared`` is the start every name has, where the
        names were cut after it (empty otherwise).
    """
    width = max(width, 3)
    unique = list(dict.fromkeys(names))
    if all(len(n) <= width for n in unique):
        return {n: n for n in unique}, ""
    cut = deep = 0
    if len(unique) > 1:
        common = os.path.commonprefix(unique)  # noqa: RUF071 (names, not paths)
        shortest = min(len(n) for n in unique)
        # The last separator of the common start: the parent keeps its last word
        # (``…-a1b2c3``), its reruns that word and their scope (``…-a1b2c3-one-node``);
        # where that is still too long, the reruns drop the shared word (``…-one-node``).
        seps = [i for i, ch in enumerate(common) if ch in _SEPARATORS and 0 < i <= shortest - 2]
        cut = seps[-1] if seps else 0
        ends = [
            i
            for i in range(len(common) + 1)
            if all(i < len(n) and n[i] in _SEPARATORS for n in unique if len(n) > i)
        ]
        deep = max([cut, *(i for i in ends if i <= len(common))])

    def tail(name: str) -> str:
        for start in dict.fromkeys((cut, deep)):
            if 0 < start < len(name) - 1:
                shown = f"…{name[start:]}"
                if len(shown) <= width:
                    return shown
        if len(name) <= width:
            return name
        end = name[len(name) - (width - 1) :]
        at = next((i for i, ch in enumerate(end) if ch in _SEPARATORS), 0)
        return f"…{end[at:]}"

    out = {n: tail(n) for n in unique}
    if len(set(out.values())) < len(out):
        head = (width - 1) // 2
        out = {
            n: n if len(n) <= width else f"{n[:head]}…{n[len(n) - (width - 1 - head) :]}"
            for n in unique
        }
    # The start every name shares (cut at a separator), when names were cut there; tails
    # cut only to fit the width share nothing worth naming.
    shared = any(v == f"…{n[k:]}" for n, v in out.items() for k in (cut, deep) if k)
    elided = unique[0][:cut] if shared and cut else ""
    return out, elided


def _wrap(text: str, width: int, indent: int) -> list[str]:
    return textwrap.wrap(
        text,
        width=width,
        subsequent_indent=" " * indent,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [""]


def ladder_text(ladder: Ladder, width: int = LADDER_WIDTH) -> list[str]:
    """The ladder as a table that fits ``width`` columns: one line per rung, then why each
    rung does or does not show the regression, the decompositions and the conclusion.

    Args:
        ladder: the ladder.
        width: columns the text must fit (no line is longer; at least 70). Run names are
            shortened to fit by their distinguishing end (`short_names`).

    Returns:
        Lines of text.
    """
    width = max(width, 70)
    head = (
        "{scope:<8} {run:<{w}} {ranks:>5} {p50:>7} {p90:>7} {max:>7} "
        "{local:>6} {spread:>6} {busbw:>6} {reg:>3}"
    )
    fixed = len(
        head.format(
            w=0,
            scope="",
            run="",
            ranks="",
            p50="",
            p90="",
            max="",
            local="",
            spread="",
            busbw="",
            reg="",
        )
    )
    names = [r.run for r in ladder.rungs]
    room = width - fixed
    shown, elided = short_names(names, room)
    w = max([3, *(len(v) for v in shown.values())])
    lines = _wrap(
        f"ladder of {ladder.parent_run} (healthy expectation: {ladder.reference})", width, 2
    )
    if elided:
        lines += _wrap(
            f"  runs named by their distinguishing end (…); every name starts with {elided}",
            width,
            4,
        )
    lines.append(
        head.format(
            w=w,
            scope="scope",
            run="run",
            ranks="ranks",
            p50="p50 ms",
            p90="p90 ms",
            max="max ms",
            local="local",
            spread="spread",
            busbw="busbw",
            reg="reg",
        )
    )
    for r in ladder.rungs:
        bw = f"{r.comm.ratio:.2f}x" if r.comm is not None else "-"
        lines.append(
            head.format(
                w=w,
                scope=r.scope[:8],
                run=shown[r.run],
                ranks=r.world_size,
                p50=_ms(r.step.p50),
                p90=_ms(r.step.p90),
                max=_ms(r.step.max),
                local=f"{r.local_ratio:.2f}x",
                spread=f"{r.spread_ratio:.0%}",
                busbw=bw,
                reg="YES" if r.regression else "no",
            )
        )
    lines.append("why (and each rung's verdict):")
    for r in ladder.rungs:
        verdict = f" · verdict {r.verdict}" if r.verdict else ""
        lines += _wrap(
            f"  {r.scope:<8}  {'YES' if r.regression else 'no'}: {r.why}{verdict}", width, 12
        )
    lines.append("decomposition (mean ms per rank-step):")
    for r in ladder.rungs:
        parts = ", ".join(f"{k} {_ms(v)}" for k, v in r.decomposition.items() if v > 0)
        lines += _wrap(f"  {r.scope:<8}  {parts}", width, 12)
    if ladder.first_scope and ladder.unmeasured_below:
        lines += _wrap(
            f"smallest measured scope with the regression: {ladder.first_scope} "
            f"({ladder.first_run}); not run below it: {', '.join(ladder.unmeasured_below)}",
            width,
            2,
        )
    elif ladder.first_scope:
        lines += _wrap(
            f"first scope with the regression: {ladder.first_scope} ({ladder.first_run})",
            width,
            2,
        )
    else:
        lines.append("first scope with the regression: none")
    lines += _wrap(f"  means:      {ladder.meaning}", width, 14)
    if ladder.eliminated:
        lines += _wrap(f"  eliminates: {', '.join(ladder.eliminated)}", width, 14)
    if ladder.implicated:
        lines += _wrap(f"  implicates: {', '.join(ladder.implicated)}", width, 14)
    if ladder.missing:
        lines += _wrap(f"  not run:    {', '.join(ladder.missing)}", width, 14)
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
