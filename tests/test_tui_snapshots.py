"""Snapshot tests (pytest-textual-snapshot): the screens as SVG, compared with the accepted
ones in ``tests/__snapshots__/test_tui_snapshots/``.

Deterministic by construction: seeded simulated runs, a static source with fixed health
counters, no clock, no machine name, no animation, a fixed palette and terminal size.
After a deliberate change, look at the report (``pytest --snapshot-report``) before
``pytest tests/test_tui_snapshots.py --snapshot-update``.
"""

from __future__ import annotations

import pytest

from rankscope.tui.app import make_app
from rankscope.tui.heatmap import Heatmap
from rankscope.tui.screenshots import simulated_store, wait_ready
from rankscope.tui.settings import deterministic_settings
from rankscope.tui.sources import StaticSource

HEALTH = {"events_per_s": 0.0, "drops": {"batches": 0, "events": 0}, "rejects": {}}


@pytest.fixture(scope="module")
def windows():
    store = simulated_store(
        [("seed-example-baseline", "run-0412", 32, 40), ("seed-example", "run-0419", 32, 40)]
    )
    return [store.window(run, 120) for run in ("run-0412", "run-0419")]


def _app(windows, baseline: str | None = "run-0412"):
    app = make_app(deterministic_settings(), StaticSource(windows, HEALTH, label="snapshot"))
    if baseline is not None:
        app.initial_view(baseline_run=baseline)
    return app


def test_main_screen(snap_compare, windows) -> None:
    assert snap_compare(_app(windows), terminal_size=(120, 36), run_before=wait_ready)


def test_main_screen_80x24(snap_compare, windows) -> None:
    assert snap_compare(_app(windows), terminal_size=(80, 24), run_before=wait_ready)


def test_rank_detail(snap_compare, windows) -> None:
    async def open_detail(pilot) -> None:
        await wait_ready(pilot)
        heatmap = pilot.app.screen.query_one(Heatmap)
        heatmap.cursor = 5
        await pilot.press("enter")
        while pilot.app.detail is None:
            await pilot.pause(0.05)
        await wait_ready(pilot)

    assert snap_compare(_app(windows), terminal_size=(120, 40), run_before=open_detail)


def test_help(snap_compare, windows) -> None:
    assert snap_compare(
        _app(windows, None), press=["question_mark"], terminal_size=(100, 46), run_before=wait_ready
    )


def test_help_80x24_scrolled_to_the_end(snap_compare, windows) -> None:
    assert snap_compare(
        _app(windows, None),
        press=["question_mark", "end"],
        terminal_size=(80, 24),
        run_before=wait_ready,
    )


def test_saved_view_note_80x24(snap_compare, windows, tmp_path) -> None:
    from rankscope.tui.viewstate import SavedView, save_view

    job = windows[1].job
    save_view(tmp_path, job, SavedView("step", "rail", (5, 9), None, "run-0419"))
    source = StaticSource(windows, HEALTH, label="snapshot")
    app = make_app(deterministic_settings(tmp_path), source, baseline="run-0412")

    async def settled_without_toast(pilot) -> None:
        # The toast that also says so times out on the wall clock: leave it out.
        await wait_ready(pilot)
        pilot.app.clear_notifications()
        await pilot.pause(0.1)

    assert snap_compare(app, terminal_size=(80, 24), run_before=settled_without_toast)
