"""``rankscope inspect PATH``: what a recording holds — runs, ranks, step times, last
arrivers, drops, rejects, clock error and anything the reader had to skip."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rankscope.commands.grammar import add_run
from rankscope.errors import CommandError
from rankscope.hub.inspection import inspect_recording
from rankscope.sanitize import terminal_text

HELP = "Summarise a recording: runs, ranks, step times, last arrivers, drops, rejects"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path", metavar="PATH", help="recording directory (rankscope hub --record DIR) or segment"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_run(p, "only this run id")


def _ms(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:.3f} ms"


def _us(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e3:.1f} µs"


def format_text(rep: dict[str, Any]) -> str:
    """The report as a short human-readable text."""
    out = [
        f"recording {rep['path']} (format v{rep['format_version']}, {rep['sessions']} hub "
        f"session(s), {rep['frames']} messages, {rep['bytes'] / 1e6:.1f} MB)"
    ]
    if rep["skipped"]:
        out.append(f"  skipped {rep['skipped_bytes']} bytes:")
        for s in rep["skipped"]:
            why = f"{s['reason']}: {s['detail']}" if s.get("detail") else s["reason"]
            out.append(f"    {s['segment']} @ {s['offset']}: {s['nbytes']} bytes ({why})")
    rejects = {**rep["rejects"]}
    for k, v in rep["replay_rejects"].items():
        rejects[k] = rejects.get(k, 0) + v
    if rejects:
        out.append("  rejected: " + ", ".join(f"{k} {v}" for k, v in sorted(rejects.items())))
    for run in rep["runs"]:
        st, dist = run["steps"], run["step_time_ns"]
        parent = f", parent {run['parent_run']}" if run["parent_run"] else ""
        out += [
            "",
            f"run {run['run']}  job {run['job']}  scope {run['scope']}{parent}",
            f"  ranks {run['ranks_seen']}/{run['world_size']} on {len(run['hosts'])} host(s): "
            + ", ".join(run["hosts"][:8])
            + (" ..." if len(run["hosts"]) > 8 else ""),
            f"  steps {st['first']}..{st['last']} ({st['count']} seen, {st['complete']} from "
            "every rank)",
            f"  step time (slowest rank): p50 {_ms(dist['p50'])}  p90 {_ms(dist['p90'])}  "
            f"p99 {_ms(dist['p99'])}  max {_ms(dist['max'])}",
        ]
        co = run["collectives"]
        out.append(
            f"  collectives: {co['instances_complete']} complete, "
            f"{co['instances_incomplete']} closed incomplete ({co['rows']} rows)"
        )
        for t in run["last_arriver"]["top"]:
            share = "" if t["share"] is None else f" ({100 * t['share']:.0f}%)"
            late = run["lateness_mean_ns"][t["rank"]]
            out.append(
                f"  last to arrive: rank {t['rank']} in {t['count']} instances{share}, "
                f"mean lateness {_us(late)}"
            )
        d = run["drops"]
        clock = run["clock_error_ns"]
        out.append(
            f"  collector drops: {d['batches']} batches, {d['events']} events;  clock error "
            f"max {_us(clock['max'])}, median {_us(clock['median'])}"
        )
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    if not Path(args.path).exists():
        raise CommandError(f"no recording at {args.path!r}")
    try:
        rep = inspect_recording(args.path, run=args.run)
    except KeyError as exc:  # an unknown --run; a bad recording is a RecordingError
        raise CommandError(str(exc.args[0])) from None
    if args.json:
        json.dump(rep, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(terminal_text(format_text(rep)))
    return 0
