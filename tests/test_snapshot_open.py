"""Opening a snapshot in the TUI restores the view it was taken with.

The snapshot carries ``window/`` (a recording) and ``view``; the app restores a job's view
from its state folder, so a viewer opened on ``window/`` with the snapshot's view in a
private state folder shows what the snapshot's author saw.
"""

from __future__ import annotations

import asyncio

from rankscope.cli import main
from rankscope.snapshot import open_snapshot
from rankscope.tui.app import make_app
from rankscope.tui.settings import deterministic_settings
from rankscope.tui.sources import RecordingSource
from rankscope.tui.viewstate import SavedView, save_view


def test_open_restores_pins_metric_and_grouping(tmp_path) -> None:
    record = tmp_path / "rec"
    argv = ["demo", "--headless", "--steps", "8", "--ranks", "16", "--seed", "4"]
    assert main([*argv, "--scenario", "network-rail", "--record", str(record)]) == 0
    out = tmp_path / "snap"
    argv = ["snapshot", str(record), "--out", str(out), "--tar", "--steps", "6", "--pin", "12"]
    assert main([*argv, "--pin", "4", "--metric", "transfer", "--group-by", "rail"]) == 0

    opened = open_snapshot(out.with_name("snap.tar.gz"))
    assert opened.recording is not None
    state = tmp_path / "state"
    view = opened.view
    save_view(
        state,
        opened.content["job"],
        SavedView(view.metric, view.group_by, view.pins, view.baseline_run),
    )
    app = make_app(
        deterministic_settings(state), RecordingSource(opened.recording, follow=False), run=view.run
    )

    async def scenario() -> tuple[tuple[int, ...], str, str]:
        async with app.run_test(size=(120, 40)) as pilot:
            for _ in range(400):  # the first sample and model build run in workers
                await pilot.pause(0.05)
                if app.pins:
                    break
            return app.pins, app.metric, app.group_by

    pins, metric, group_by = asyncio.run(scenario())
    assert (pins, metric, group_by) == ((12, 4), "transfer", "rail")
