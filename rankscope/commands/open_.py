"""``rankscope open PATH``: the TUI on a recording, following it while it grows.

``PATH`` is a hub's record directory (``rankscope hub --record DIR``, ``rankscope watch
--record DIR``, ``rankscope demo --record DIR``) or a snapshot bundle (its folder,
``snapshot.json`` or ``.tar.gz``), whose view (pins, metric, grouping, baseline) is
restored. The viewer only reads the files: any number of viewers can attach and detach
while the hub writes, without disturbing it or the job.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rankscope.commands.grammar import add_run
from rankscope.errors import CommandError

HELP = "TUI on a recording or a snapshot (follows a growing recording)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="record directory, segment file or snapshot bundle")
    p.add_argument(
        "--no-follow",
        action="store_true",
        help="read what is there once instead of following new data",
    )
    add_run(p, "run to show (default: the newest full run)")
    p.add_argument("--config", default=None, help="settings file (see config/default.toml)")


def _is_snapshot(path: Path) -> bool:
    return (
        path.name.endswith(".tar.gz")
        or path.name == "snapshot.json"
        or (path.is_dir() and (path / "snapshot.json").is_file())
    )


def run(args: argparse.Namespace) -> int:
    from rankscope.tui.app import make_app
    from rankscope.tui.settings import GROUP_BY, METRICS, load_settings
    from rankscope.tui.sources import RecordingSource

    settings = load_settings(args.config)
    path = Path(args.path)
    run_id = args.run
    follow = not args.no_follow
    view = None
    if _is_snapshot(path):
        from rankscope.snapshot import open_snapshot

        opened = open_snapshot(path)
        if opened.recording is None:
            raise CommandError(f"{path} holds no window/ recording")
        path, view, follow = opened.recording, opened.view, False
        run_id = run_id or view.run
    if not path.exists():
        raise CommandError(f"{str(path)!r} does not exist")
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise CommandError("open needs a terminal")
    try:
        source = RecordingSource(path, follow=follow)
    except FileNotFoundError as exc:
        raise CommandError(f"{path}: {exc}") from None
    app = make_app(settings, source, run=run_id)
    if view is not None:
        app.initial_view(
            metric=view.metric if view.metric in METRICS else None,
            group_by=view.group_by if view.group_by in GROUP_BY else None,
            pins=view.pins,
            baseline_run=view.baseline_run,
            filter_text=view.filter,
            zoom=view.zoom,
        )
    app.run()
    return 0
