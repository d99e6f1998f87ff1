"""``rankscope import KIND PATH... --record DIR``: another tool's files as a recording.

KIND is one of ``rankscope.hub.importers.IMPORTERS`` (``kineto``, ``nccl-inspector``,
``flight-recorder``, ``nccl-tests``). PATHs are files, globs or directories (searched
recursively); ``.gz`` files are read as they are. A file that cannot be used, or only in
part, is one line on stderr naming it and what was wrong; the rest is imported. The exit
status is nonzero only when nothing could be imported. Every command that reads a
recording then works on DIR (``diagnose``, ``open``, ``inspect``, ``export``...).
"""

from __future__ import annotations

import argparse
import json
import sys

from rankscope.errors import CommandError
from rankscope.sanitize import terminal_text

HELP = "Import profiler traces, NCCL logs or nccl-tests output into a recording"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from rankscope.hub.importers import IMPORTERS

    p.add_argument("kind", metavar="KIND", help=f"source kind: {', '.join(IMPORTERS)}")
    p.add_argument("paths", metavar="PATH", nargs="+", help="files, globs or directories")
    p.add_argument("--record", metavar="DIR", required=True, help="recording directory to write")
    p.add_argument("--job", metavar="NAME", default="imported", help="job name (default imported)")
    p.add_argument(
        "--run", metavar="ID", default=None, help="run id (default KIND-<UTC time of import>)"
    )
    p.add_argument("--json", action="store_true", help="print the import report as JSON")


def run(args: argparse.Namespace) -> int:
    from rankscope.hub.importers import ImportError_, write_recording

    try:
        rep = write_recording(args.kind, args.paths, args.record, job=args.job, run=args.run)
    except ImportError_ as exc:
        raise CommandError(str(exc)) from None
    for file, what in rep.problems:
        print(terminal_text(f"rankscope: import: {file}: {what}"), file=sys.stderr)
    if args.json:
        json.dump(rep.to_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        align = (
            ""
            if rep.alignment_ns is None
            else f", clock alignment error {rep.alignment_ns / 1e3:.1f} µs"
        )
        print(
            terminal_text(
                f"imported {len(rep.files_read)} file(s) as {rep.ranks} rank(s): {rep.steps} "
                f"step rows, {rep.colls} collective rows, {rep.messages} messages into "
                f"{args.record}{align}"
            )
        )
        if rep.lacks:
            print(terminal_text("  the source lacks: " + ", ".join(rep.lacks)))
        last = rep.details.get("last_by_kernel")
        if last:
            print(
                "without entry times the last arrival is read from kernel durations (a "
                "collective's kernel runs until its last peer arrives: the last to arrive "
                "has the shortest):"
            )
            for row in last:
                print(
                    terminal_text(
                        f"  comm {row['comm']} ({row['ranks']} ranks): rank {row['rank']} "
                        f"shortest in {row['share']:.0%} of the {row['ordered']} of "
                        f"{row['collectives']} collectives whose shortest kernel stands out, "
                        f"the others' kernels {row['wait_us']:.0f} µs longer (median)"
                    )
                )
        bw = rep.details.get("bandwidth_by_size")
        if bw:
            print(
                "transfer bandwidth per message size, from the shortest kernel of each "
                "collective (the last arriver's, which waited for no one):"
            )
            for row in bw:
                print(
                    terminal_text(
                        f"  comm {row['comm']} ({row['ranks']} ranks) {row['op']} "
                        f"{row['nbytes']:,} B: busbw {row['busbw_gbs']:.3g} GB/s, transfer "
                        f"{row['transfer_us']:.0f} µs (median of {row['collectives']})"
                    )
                )
    return 0 if rep.files_read and rep.messages else 1
