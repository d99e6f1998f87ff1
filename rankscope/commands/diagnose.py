"""``rankscope diagnose PATH``: the verdict and its evidence for one recorded run.

PATH is a recording directory (``rankscope hub --record DIR`` or ``rankscope demo
--headless --record DIR``). With ``--baseline PATH`` the run is compared with a healthy
run's recording: numerator, decomposition deltas, distributions, manifest diff and
message-size curves. ``--json`` prints the documented schema of
`rankscope.diagnosis.serialize` (hypotheses with ``mechanism``, ``score``, ``ranks``,
``hosts``, ``evidence``, ``next_experiment``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

HELP = "Diagnose a recorded run: ranked hypotheses with evidence and the next experiment"
DEFAULT_STEPS = 100


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="recording directory")
    p.add_argument("--baseline", metavar="PATH", help="recording of a healthy baseline run")
    p.add_argument("--run", default=None, help="run id in PATH (default: the most recent run)")
    p.add_argument(
        "--baseline-run", default=None, help="run id in the baseline (default: most recent)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        help=f"most recent steps to analyse (default {DEFAULT_STEPS})",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def load_window(path: str, run: str | None, steps: int) -> Any:
    """Replay a recording and return the window of one run (raw rows kept).

    Args:
        path: recording directory.
        run: run id, or None for the most recent.
        steps: steps in the window.

    Returns:
        The `Window`.

    Raises:
        ValueError: naming what is wrong (no recording, unknown run, bad step count).
    """
    from rankscope.hub.replay import load_run

    if steps < 2:
        raise ValueError(f"--steps must be at least 2, got {steps}")
    return load_run(path, run, steps)[1]


def run(args: argparse.Namespace) -> int:
    from rankscope.diagnosis.engine import diagnose
    from rankscope.diagnosis.serialize import to_dict
    from rankscope.diagnosis.text import render_text

    try:
        window = load_window(args.path, args.run, args.steps)
        baseline = None
        if args.baseline:
            baseline = load_window(args.baseline, args.baseline_run, args.steps)
    except ValueError as exc:
        print(f"rankscope diagnose: {exc}", file=sys.stderr)
        return 2
    diag = diagnose(window, baseline)
    if args.json:
        json.dump(to_dict(diag), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(diag))
    return 0
