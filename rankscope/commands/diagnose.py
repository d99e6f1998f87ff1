"""``rankscope diagnose PATH``: the verdict and its evidence for one recorded run.

PATH is a recording directory (``rankscope hub --record DIR`` or ``rankscope demo
--headless --record DIR``). With ``--baseline PATH`` (its most recent run, or
``--baseline-run ID``), or ``--baseline-run ID`` alone for another run of PATH, the run is
compared with a healthy run: numerator, decomposition deltas, distributions, manifest diff
and message-size curves. ``--json`` prints the documented schema of
`rankscope.diagnosis.serialize` (hypotheses with ``mechanism``, ``score``, ``ranks``,
``hosts``, ``evidence``, ``next_experiment``).
"""

from __future__ import annotations

import argparse
import json
import sys

from rankscope.commands.grammar import (
    add_baseline,
    add_run,
    add_steps,
    baseline_window,
    load_run,
    recording_of,
)
from rankscope.errors import CommandError
from rankscope.sanitize import terminal_text

HELP = "Diagnose a recorded run: ranked hypotheses with evidence and the next experiment"
DEFAULT_STEPS = 100


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path", metavar="PATH", help="recording directory, or a snapshot folder (its window/)"
    )
    add_run(p, "run id in PATH (default: the most recent run)")
    add_baseline(p)
    add_steps(p, DEFAULT_STEPS, "most recent steps of each run to analyse (at least 2)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    from rankscope.diagnosis.engine import diagnose
    from rankscope.diagnosis.serialize import to_dict
    from rankscope.diagnosis.text import render_text

    if args.steps < 2:
        raise CommandError(f"--steps must be at least 2, got {args.steps}")
    args.path = recording_of(args.path)
    store, window = load_run(args.path, args.run, args.steps)
    baseline = baseline_window(args, store, args.path)
    diag = diagnose(window, baseline)
    if args.json:
        json.dump(to_dict(diag), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(terminal_text(render_text(diag)))
    return 0
