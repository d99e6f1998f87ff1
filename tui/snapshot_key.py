"""``ctrl+s``: write a snapshot bundle of the view on screen (``rankscope.snapshot``).

The bundle is written in a worker thread (it reads the source and flushes a live hub's
recording); the screen's SVG is taken on the event loop first, as it is now.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rankscope.sanitize import for_terminal


def view_of(app: Any) -> Any:
    """The app's view choices as a snapshot's ``View``.

    Args:
        app: the running `RankscopeApp`.

    Returns:
        ``rankscope.snapshot.View``.
    """
    from rankscope.snapshot import View

    w = app.model.window if app.model is not None else None
    return View(
        run=w.run if w is not None else app.run_id,
        metric=app.metric,
        group_by=app.group_by,
        pins=app.pins,
        baseline_run=app.baseline_run,
        filter=app.filter_text,
        zoom=app.zoom,
    )


def write_snapshot(app: Any) -> None:
    """Write a bundle of what is on screen into the working directory, notifying where.

    Args:
        app: the running `RankscopeApp`.
    """
    from rankscope.snapshot import snapshot_from_source

    view = view_of(app)
    svg = app.export_screenshot()
    last = app.settings.view.window_steps
    app.notify("snapshot: writing…", timeout=2)

    def job() -> None:
        try:
            bundle = snapshot_from_source(Path.cwd(), app.source, view, last=last, screen_svg=svg)
        except Exception as exc:  # a failed snapshot must not take the view down
            why = for_terminal(f"snapshot failed: {exc}")
            app.call_from_thread(app.notify, why, severity="error", markup=False)
            return
        where = for_terminal(f"snapshot: {bundle.folder}")
        app.call_from_thread(app.notify, where, timeout=8, markup=False)

    app.run_worker(job, thread=True, group="snapshot", exclusive=True, exit_on_error=False)
