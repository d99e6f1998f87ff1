"""``rankscope snapshot PATH``: write a snapshot bundle of a recording without the TUI.

The screen of a CLI snapshot is the ``rankscope report`` rendering of the same content.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

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

HELP = "Write a snapshot bundle (Markdown, JSON, screen, raw window, manifests) of a recording"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from rankscope.snapshot import DEFAULT_STEPS
    from rankscope.tui.settings import GROUP_BY, METRICS, ViewSettings

    p.add_argument("path", metavar="PATH", help="recording directory (rankscope hub --record)")
    p.add_argument(
        "--out", metavar="DIR", default=None, help="bundle folder (default: snapshot-RUN-TIME)"
    )
    p.add_argument("--tar", action="store_true", help="also write DIR.tar.gz")
    add_steps(p, DEFAULT_STEPS, "most recent steps in the window")
    add_run(p, "run id (default: the most recent run that is not a rerun)")
    add_baseline(p)
    p.add_argument("--pin", type=int, action="append", default=[], help="pin a rank (repeat)")
    view = ViewSettings()
    p.add_argument(
        "--metric",
        default=view.metric,
        choices=METRICS,
        help=f"heatmap metric to restore ({view.metric}, as the TUI opens)",
    )
    p.add_argument(
        "--group-by",
        default=view.group_by,
        choices=GROUP_BY,
        help=f"rank grouping to restore ({view.group_by})",
    )


def _main_run(store: Any) -> str | None:
    runs = store.runs()
    roots = [r for r in runs if not r.parent_run]
    pick = (roots or runs)[-1:] if runs else []
    return pick[0].run if pick else None


def _load(path: str, run: str | None, steps: int) -> tuple[Any, Any]:
    store, window = load_run(path, run, steps)
    if run is None:
        main = _main_run(store)
        if main is not None and main != window.run:
            window = store.window(main, last=steps)
    return store, window


def default_folder(run: str, now: float | None = None) -> str:
    """The bundle folder when ``--out`` is not given: ``snapshot-<run>-<local time>`` in the
    working directory. The run id comes from telemetry: it is made a safe name component
    (no ``/``, ``..`` or ``%``) and joined to the time, never formatted by ``strftime``.

    Args:
        run: the run id as recorded.
        now: epoch seconds (default: now).

    Returns:
        A folder name without any path separator.
    """
    from rankscope.sanitize import for_filename

    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"snapshot-{for_filename(run)}-{stamp}"


def run(args: argparse.Namespace) -> int:
    from rankscope.commands.report import render_svg
    from rankscope.snapshot import View, take_snapshot

    store, window = _load(args.path, args.run, args.steps)
    baseline = baseline_window(args, store, args.path)
    if args.pin and any(not 0 <= p < window.world_size for p in args.pin):
        bad = [p for p in args.pin if not 0 <= p < window.world_size]
        raise CommandError(f"--pin {bad} outside the run's ranks 0..{window.world_size - 1}")
    reruns = []
    for summary in store.runs():
        if summary.parent_run == window.run:
            reruns.append(store.window(summary.run, last=args.steps))
    out = args.out or default_folder(window.run)
    view = View(
        run=window.run,
        metric=args.metric,
        group_by=args.group_by,
        pins=tuple(args.pin),
        baseline_run=baseline.run if baseline is not None else None,
    )
    bundle = take_snapshot(
        out,
        window,
        recording=args.path,
        baseline=baseline,
        baseline_recording=recording_of(args.baseline) if args.baseline else None,
        reruns=reruns,
        view=view,
        screen_svg=render_svg,
        tar=args.tar,
    )
    c = bundle.content
    top = (c["diagnosis"].get("verdict") or {}).get("top")
    lines = [
        f"snapshot of {c['run']} ({c['scope']}, steps "
        f"{'-'.join(map(str, c['window']['steps'])) or 'none'}): "
        f"{bundle.folder}" + (f" and {bundle.tarball}" if bundle.tarball else ""),
        f"verdict: {top or 'none (' + c['diagnosis'].get('note', 'not judged') + ')'}; "
        f"{c['window']['frames']} messages in window/; "
        + ("screen.png written" if "png" in c["files"] else c["files"].get("png_note", "")),
        f"reopen: {c['reopen']}  ·  read: rankscope report {bundle.folder}",
    ]
    print(terminal_text("\n".join(lines)))
    return 0
