"""Pilot tests: press the keys, then check the app's state, its screens and the files it
writes. Every app comes from `make_app` with a static seeded source and fixed settings."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import io
import json
from pathlib import Path

import numpy as np
import pytest
from textual.widgets import Static

from rankscope.tui.app import RankscopeApp, make_app
from rankscope.tui.detail_screen import RankDetailScreen
from rankscope.tui.dialogs import BaselinePicker, FilterDialog, HelpScreen, key_rows
from rankscope.tui.heatgrid import GROUP, PIN, RANK
from rankscope.tui.heatmap import Heatmap
from rankscope.tui.main_screen import MainScreen
from rankscope.tui.report_screens import (
    CurvesScreen,
    ManifestScreen,
    StallScreen,
    StructureScreen,
)
from rankscope.tui.scenes import Fault, synthetic_run
from rankscope.tui.settings import GROUP_BY, METRICS, deterministic_settings
from rankscope.tui.sources import StaticSource
from rankscope.tui.viewstate import state_path

SIZE = (120, 36)


def run_async(fn):
    """Run an async test body on a fresh event loop (no asyncio plugin needed)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return wrapper


def _rendered(widget, width: int = 160) -> str:
    """A widget's content as plain text, rendered at ``width`` columns."""
    from rich.console import Console

    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(widget.content)
    return console.export_text()


@pytest.fixture(scope="module")
def slow13():
    return synthetic_run(64, 40, fault=Fault("slow_device", rank=13), run="run-b")


@pytest.fixture(scope="module")
def healthy():
    return synthetic_run(
        64,
        40,
        run="run-a",
        seed=1,
        manifest={
            "versions": {"torch": "2.13.0", "nccl": "2.26.2"},
            "config": {"global_batch": 4096, "micro_batch": 4, "seq_len": 8192},
        },
    )


async def wait_for(pilot, predicate, timeout: float = 30.0) -> None:
    """Let the app run until ``predicate()`` holds (generous: the machine may be busy)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached")
        await pilot.pause(0.05)


async def settle(pilot, app: RankscopeApp, analysis: bool = True, timeout: float = 120.0) -> None:
    """Wait until the model (and the diagnosis) for the current view have arrived and been
    drawn: no worker running, no sample being built and, when the diagnosis is waited for,
    none whose result is still on its way (``diagnosing`` stays set until the app has
    handled it). The deadline is wall-clock time, generous for a shared machine."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        await pilot.pause(0.02)
        busy = any(w.is_running for w in app.workers) or app._sampling
        busy = busy or (analysis and app.diagnosing)
        ready = app.model is not None and (not analysis or app.analysis is not None)
        if ready and not busy:
            await pilot.pause(0.02)  # ends with a layout pass of the screen
            return
    raise AssertionError("the app did not settle")


def _app(windows, tmp_path: Path | None = None, **kw) -> RankscopeApp:
    settings = deterministic_settings(tmp_path or "")
    return make_app(settings, StaticSource(windows, health={"events_per_s": 12000}), **kw)


@run_async
async def test_startup_shows_the_run_and_its_straggler(slow13, healthy) -> None:
    app = _app([healthy, slow13])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        assert isinstance(app.screen, MainScreen)
        header = app.model.header
        assert header.run == "run-b"  # the newest run is shown
        assert header.world_size == 64 and header.hosts == 8 and header.step == 1039
        grid = app.screen.query_one(Heatmap).grid
        assert grid.spec.name == "lateness" and len(grid) == 64
        top = app.model.ranking[0]
        assert top.rank == 13 and top.times_last == 80
        assert app.model.arrivals[0].last_rank == 13
        assert app.analysis is not None and app.analysis.structure[0].metric == "lateness"


@run_async
async def test_metric_and_group_keys_cycle(slow13) -> None:
    app = _app([slow13])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        first = METRICS.index(app.metric)
        await pilot.press("m")
        await settle(pilot, app, analysis=False)
        assert app.metric == METRICS[first + 1]
        assert app.screen.query_one(Heatmap).grid.spec.name == METRICS[first + 1]
        for _ in range(len(METRICS) - 1):
            await pilot.press("m")
        await settle(pilot, app, analysis=False)
        assert app.metric == METRICS[first]
        assert app.screen.query_one(Heatmap).grid.spec.name == METRICS[first]
        await pilot.press("g")
        await settle(pilot, app, analysis=False)
        assert app.group_by == GROUP_BY[1]
        assert app.screen.query_one(Heatmap).grid.dimension == "rack"


@run_async
async def test_space_pins_and_pins_persist_per_job(slow13, tmp_path: Path) -> None:
    app = _app([slow13], tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        heatmap = app.screen.query_one(Heatmap)
        for _ in range(13):
            await pilot.press("down")
        assert heatmap.selected().rank == 13
        await pilot.press("space")
        await settle(pilot, app, analysis=False)
        assert app.pins == (13,)
        grid = heatmap.grid
        assert grid.kinds[0] == PIN and grid.rank[0] == 13
        assert heatmap.selected().rank == 13  # the selection follows the rank
        await pilot.press("m")
        await settle(pilot, app, analysis=False)
    saved = json.loads(state_path(tmp_path, "demo-llm").read_text())
    assert saved["pins"] == [13] and saved["metric"] == "wait"

    again = _app([slow13], tmp_path)
    async with again.run_test(size=SIZE) as pilot:
        await settle(pilot, again)
        assert again.pins == (13,) and again.metric == "wait"
        assert again.screen.query_one(Heatmap).grid.rank[0] == 13
        await pilot.press("home", "space")  # the pinned row is the first: unpin it
        await settle(pilot, again, analysis=False)
        assert again.pins == ()
    assert json.loads(state_path(tmp_path, "demo-llm").read_text())["pins"] == []


@run_async
async def test_pin_slowest(slow13) -> None:
    app = _app([slow13])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("P")
        await settle(pilot, app, analysis=False)
        assert len(app.pins) == 4 and app.pins[0] == 13
        grid = app.screen.query_one(Heatmap).grid
        assert list(grid.rank[:4]) == list(app.pins)


@run_async
async def test_filter_dialog_and_escape(slow13) -> None:
    app = _app([slow13])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("slash")
        assert isinstance(app.screen, FilterDialog)
        await pilot.press(*"8-10,r13", "enter")
        await settle(pilot, app, analysis=False)
        assert isinstance(app.screen, MainScreen)
        assert app.filter_text == "8-10,r13"
        grid = app.screen.query_one(Heatmap).grid
        assert grid.rank.tolist() == [8, 9, 10, 13] and grid.hidden == 60
        await pilot.press("slash", "escape")  # cancelled: filter unchanged
        assert app.filter_text == "8-10,r13"
        await pilot.press("escape")
        await settle(pilot, app, analysis=False)
        assert app.filter_text == "" and len(app.screen.query_one(Heatmap).grid) == 64


async def _enter_row(pilot, app: RankscopeApp, heatmap: Heatmap, row: int, rank: int) -> None:
    """Move to group row ``row`` (asserting it names ``rank`` as its worst) and enter it."""
    for _ in range(row):
        await pilot.press("down")
    got = heatmap.selected()
    assert got.kind == GROUP and got.group == row and got.rank == rank
    await pilot.press("enter")
    await settle(pilot, app, analysis=False)


@run_async
async def test_enter_zooms_into_a_group_then_opens_a_rank(tmp_path: Path) -> None:
    big = synthetic_run(128, 20, fault=Fault("slow_device", rank=77), run="big")
    app = _app([big])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        heatmap = app.screen.query_one(Heatmap)
        assert (heatmap.grid.kinds == GROUP).all() and len(heatmap.grid) == 16
        await _enter_row(pilot, app, heatmap, 9, rank=77)
        assert app.zoom == 9
        assert heatmap.grid.rank.tolist() == list(range(72, 80))
        assert heatmap.selected().kind == RANK
        for _ in range(5):
            await pilot.press("down")
        assert heatmap.selected().rank == 77
        await pilot.press("enter")
        await settle(pilot, app, analysis=False)
        assert isinstance(app.screen, RankDetailScreen) and app.screen.rank == 77
        assert app.detail is not None and app.detail.rank == 77
        step = app.detail.series[0]
        assert np.nanmean(step.rank) > np.nanmean(step.median)
        sm = next(c for c in app.detail.samples if c.label == "SM clock")
        assert sm.rank < 1500 < sm.median
        await pilot.press("space")
        assert 77 in app.pins
        await pilot.press("escape")
        assert isinstance(app.screen, MainScreen) and app.zoom == 9
        await pilot.press("escape")
        await settle(pilot, app, analysis=False)
        assert app.zoom is None and len(heatmap.grid) == 17  # 16 hosts + the pin


@run_async
async def test_host_rows_roll_up_into_racks_and_enter_opens_one() -> None:
    # 16 hosts of 8 ranks in 4 racks, above a budget of 8 host rows: rack rows.
    big = synthetic_run(128, 20, fault=Fault("slow_device", rank=77), run="big")
    settings = deterministic_settings("")
    settings = dataclasses.replace(
        settings, view=dataclasses.replace(settings.view, group_rows_max=8)
    )
    app = make_app(settings, StaticSource([big]))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        heatmap = app.screen.query_one(Heatmap)
        assert heatmap.grid.rolled_up == "rack" and len(heatmap.grid) == 4
        assert "worst rank of each rack" in _rendered(app.screen.query_one("#legend"), 400)
        await _enter_row(pilot, app, heatmap, 2, rank=77)
        # The rack's 32 ranks fit the rank rows: one row each.
        assert app.zoom_up == 2 and heatmap.grid.rank.tolist() == list(range(64, 96))
        await pilot.press("escape")
        await settle(pilot, app, analysis=False)
        assert app.zoom_up is None and heatmap.grid.rolled_up == "rack"


@run_async
async def test_pause_stops_sampling_but_keeps_view_changes(slow13) -> None:
    calls = []

    class Counting(StaticSource):
        def window(self, run, last):
            calls.append(run)
            return super().window(run, last)

    app = make_app(deterministic_settings(), Counting([slow13]))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("p")
        assert app.paused
        await settle(pilot, app, analysis=False)
        before = len(calls)
        await pilot.pause(0.8)  # three sampling periods at 4 Hz
        assert len(calls) == before
        header = app.screen.query_one("#header").content
        assert "PAUSED" in header.plain.splitlines()[0]
        await pilot.press("m")
        await settle(pilot, app, analysis=False)
        assert app.screen.query_one(Heatmap).grid.spec.name == "wait"
        await pilot.press("p")
        assert not app.paused
        await wait_for(pilot, lambda: len(calls) > before)


@run_async
async def test_baseline_picker_sets_the_comparison(slow13, healthy) -> None:
    app = _app([healthy, slow13])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        assert app.analysis.baseline_run is None
        await pilot.press("b")
        assert isinstance(app.screen, BaselinePicker)
        await pilot.press("down", "enter")
        await settle(pilot, app)
        assert app.baseline_run == "run-a"
        await wait_for(pilot, lambda: app.analysis.baseline_run == "run-a")
        assert app.model.header.baseline_run == "run-a"
        assert app.model.header.baseline.p50 < app.model.header.stats.p50
        assert app.analysis.baseline_run == "run-a"
        rows = {r.category: r for r in app.analysis.decomposition}
        assert np.isfinite(rows["compute"].baseline_ms)
        fields = {m.field for m in app.analysis.manifest}
        assert fields == {"versions.nccl"}
        await pilot.press("d")
        assert isinstance(app.screen, ManifestScreen)
        assert app.screen.query_one("DataTable").row_count == 1
        await pilot.press("escape", "b", "home", "enter")  # "(no baseline)" is first
        await settle(pilot, app)
        assert app.baseline_run is None


@run_async
async def test_report_screens_and_help(slow13) -> None:
    app = _app([slow13])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        for key, screen in (("s", StructureScreen), ("c", CurvesScreen)):
            await pilot.press(key)
            assert isinstance(app.screen, screen)
            assert app.screen.query_one("DataTable").row_count > 0
            await pilot.press("escape")
            assert isinstance(app.screen, MainScreen)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        text = _rendered(app.screen.query_one("#keys"))
        for _, _keys, description in key_rows(app.help_sections()):
            assert description in text
        for binding_key in ("space", "P", "/", "m", "g", "enter", "esc", "p", "b", "q", "?"):
            assert f"  {binding_key} " in text
        await pilot.press("escape")
        assert isinstance(app.screen, MainScreen)
        await pilot.press("q")
    assert app.return_code == 0


@run_async
async def test_stall_view_opens_when_steps_stop_and_closes_when_they_resume(slow13) -> None:
    now = [0.0]
    hung = synthetic_run(64, 40, fault=Fault("hang", rank=21), run="run-b")
    resumed = synthetic_run(64, 41, fault=Fault("slow_device", rank=13), run="run-b")

    class Live(StaticSource):
        live = True

        def __init__(self):
            super().__init__([hung])

        def advance(self):
            self._windows = {"run-b": resumed}

    source = Live()
    settings = deterministic_settings()
    app = make_app(settings, source, clock=lambda: now[0])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        assert isinstance(app.screen, MainScreen)
        now[0] = settings.refresh.stall_s + 1
        await wait_for(pilot, lambda: isinstance(app.screen, StallScreen))
        await wait_for(pilot, lambda: app.analysis.stall is not None and app.analysis.stall.stalled)
        table = app.screen.query_one("DataTable")
        await wait_for(pilot, lambda: table.row_count == 1)
        assert table.get_row_at(0)[:5] == ["dp", "all_reduce", "39", "63/64", "r21"]
        assert app.analysis.stall.culprits() == [21]
        assert "r21" in app.screen.query_one("#note").content.plain
        source.advance()
        await wait_for(pilot, lambda: isinstance(app.screen, MainScreen))
        assert app.model.header.step == 1040


@run_async
async def test_narrow_terminal_hides_structure_and_keeps_the_heatmap(slow13) -> None:
    app = _app([slow13])
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        screen = app.screen
        assert screen.has_class("-narrow")
        assert not screen.query_one("#structure").display
        heatmap = screen.query_one(Heatmap)
        assert heatmap.size.height >= 8 and heatmap.dense
        assert heatmap.size.width >= 60


@run_async
async def test_rerun_menu_and_experiment_form_start_from_the_verdict_on_screen(
    slow13, healthy, monkeypatch
) -> None:
    from textual.widgets import Input, Select

    import rankscope.diagnosis.engine as engine
    from rankscope.tui.experiment_screen import ExperimentScreen
    from rankscope.tui.rerun_screen import RerunScreen

    app = _app([healthy, slow13])
    app.initial_view(baseline_run="run-a")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await wait_for(pilot, lambda: app.analysis.baseline_run == "run-a")
        ranked = app.analysis.ranked
        assert [h.mechanism for h in ranked] == [h.mechanism for h in app.analysis.hypotheses]
        top = ranked[0]
        assert top.mechanism == "slow_device" and 13 in top.ranks
        calls = []
        real = engine.diagnose
        monkeypatch.setattr(engine, "diagnose", lambda *a, **k: calls.append(a) or real(*a, **k))

        await pilot.press("e")
        form = app.screen
        assert isinstance(form, ExperimentScreen)
        await wait_for(pilot, lambda: form.suggested)
        nxt = top.next_experiment
        assert form.query_one("#hypothesis", Input).value == "slow_device"
        assert form.query_one("#change", Input).value == nxt.change
        assert form.query_one("#rejection", Input).value == nxt.rejects
        assert form.query_one("#metric", Select).value == nxt.metric
        await pilot.press("escape")

        await pilot.press("r", "1")
        menu = app.screen
        assert isinstance(menu, RerunScreen)
        await wait_for(pilot, lambda: menu.result is not None and not menu.planning)
        assert menu.result.launch is None  # no hub: shown, not launched
        ranks_line = next(line for line in menu.result.lines if line.strip().startswith("ranks:"))
        assert ranks_line.split()[1] == "13"  # the verdict's slow rank
        assert calls == []  # neither diagnosed the run again


@run_async
async def test_a_baseline_cut_to_its_own_bound_still_serves_every_comparison() -> None:
    from dataclasses import replace

    from rankscope.tui.screenshots import simulated_store
    from rankscope.tui.sources import StoreSource

    store = simulated_store(
        [("seed-example-baseline", "run-0412", 32, 40), ("seed-example", "run-0419", 32, 40)]
    )
    reads: list[tuple[str, int]] = []

    class Counting(StoreSource):
        def window(self, run, last):
            reads.append((run, last))
            return super().window(run, last)

    settings = deterministic_settings()
    settings = replace(settings, view=replace(settings.view, baseline_max_cells=1024))
    app = make_app(settings, Counting(store, "store"))
    app.initial_view(baseline_run="run-0412")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await wait_for(pilot, lambda: app.analysis.baseline_run == "run-0412")
        assert app.model.window.steps.size == 40
        assert app._baseline.steps.size == 32  # 1,024 cells / 32 ranks
        header = app.model.header
        assert header.baseline is not None and header.baseline.steps == 32
        assert header.baseline.p50 < header.stats.p50
        analysis = app.analysis
        rows = {r.category: r for r in analysis.decomposition}
        assert all(np.isfinite(r.baseline_ms) for r in rows.values())
        assert analysis.first_appears == "arrival_wait"
        assert abs(rows["compute"].delta_ms) < 0.1 * rows["compute"].baseline_ms
        assert any(np.isfinite(c.baseline_busbw_gbps) for c in analysis.curves)
        assert {m.field for m in analysis.manifest}  # the worked example changed its config
        assert analysis.ranked[0].mechanism == "data_imbalance"
        # A finished baseline is read once, not on every tick of the sampling clock.
        before = [r for r in reads if r[0] == "run-0412"]
        assert before == [("run-0412", 32)]
        await pilot.pause(0.8)  # three sampling periods at 4 Hz
        assert [r for r in reads if r[0] == "run-0412"] == before
        assert sum(r[0] == "run-0419" for r in reads) > 1
        # What was read is kept by the sampling side itself, so a sample that starts before
        # the previous model reached the UI does not read the baseline again either.
        again = await asyncio.to_thread(app._baseline_window, app._sample, "run-0412", True)
        assert again is not None and [r for r in reads if r[0] == "run-0412"] == before


@pytest.mark.slow  # ~7-10 s in a busy suite
@run_async
async def test_group_by_skips_dimensions_the_run_does_not_report(slow13) -> None:
    app = _app([slow13])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        seen = [app.group_by]
        for _ in range(len(GROUP_BY)):
            await pilot.press("g")
            await settle(pilot, app, analysis=False)
            seen.append(app.group_by)
        # This run has no pipeline, context or expert parallel coordinates.
        assert seen == [
            "host",
            "rack",
            "rail",
            "gpu",
            "dp",
            "tp",
            "shard",
            "host",
            "rack",
            "rail",
            "gpu",
        ]
        assert app.screen.query_one(Heatmap).grid.dimension == "gpu"


def _panel_text(widget) -> str:
    """What a Static-like panel shows, as plain text at its width."""
    import io

    from rich.console import Console

    console = Console(width=widget.content_region.width, file=io.StringIO(), record=True)
    console.print(widget.content)
    return console.export_text()


@run_async
async def test_panels_say_what_is_missing_and_keep_each_category_whole(slow13, healthy) -> None:
    import re

    from rankscope.tui.panels import DecompositionPanel, HeaderBar, fmt_ms

    alone = _app([slow13])
    async with alone.run_test(size=SIZE) as pilot:
        await settle(pilot, alone)
        header = alone.screen.query_one(HeaderBar).content.plain
        assert "no other run to compare" in header
        panel = _panel_text(alone.screen.query_one(DecompositionPanel))
        assert "no other run here to compare with" in panel
        # A category and its number are never split over two lines.
        for row in alone.analysis.decomposition:
            if row.current_ms >= 0.01 * alone.analysis.step_ms:
                shown = rf"{row.category} {re.escape(fmt_ms(row.current_ms))}"
                assert any(re.search(shown, line) for line in panel.splitlines()), panel
    both = _app([healthy, slow13])
    async with both.run_test(size=SIZE) as pilot:
        await settle(pilot, both)
        assert "no baseline (b)" in both.screen.query_one(HeaderBar).content.plain
        panel = _panel_text(both.screen.query_one(DecompositionPanel))
        assert "press b to choose one" in panel


@run_async
async def test_the_view_follows_the_newest_full_run_as_runs_appear(slow13, healthy) -> None:
    class Growing(StaticSource):
        def __init__(self):
            super().__init__([healthy])

        def add(self, window):
            self._windows = {**self._windows, window.run: window}

    source = Growing()
    app = make_app(deterministic_settings(), source)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        assert app.model.header.run == "run-a"
        source.add(slow13)  # a recording being read, or the job restarted
        await wait_for(pilot, lambda: app.model.header.run == "run-b")
        assert app.run_id is None
        assert any("showing run-b" in n.message for n in app._notifications)


@run_async
async def test_screens_say_why_they_have_nothing_to_compare(slow13) -> None:
    from textual.widgets import Input

    from rankscope.tui.experiment_screen import ExperimentScreen
    from rankscope.tui.ladder_screen import LadderScreen

    app = _app([slow13])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("L")
        ladder = app.screen
        assert isinstance(ladder, LadderScreen)
        await wait_for(pilot, lambda: not ladder.building)
        assert ladder.ladder is None  # one rung would name "full" as the first scope
        assert "no reduced-scope rerun of run-b yet" in str(ladder.query_one("#table").render())
        await pilot.press("escape", "d")
        assert isinstance(app.screen, ManifestScreen)
        assert app.screen.query_one("#title").content.plain.startswith("Manifest of run-b")
        assert "no other run here to compare with" in app.screen.query_one("#note").content.plain
        await pilot.press("escape", "c")
        assert isinstance(app.screen, CurvesScreen)
        assert app.screen.query_one("#note").content.plain.startswith("no baseline (no other run")
        await pilot.press("escape", "e")
        form = app.screen
        assert isinstance(form, ExperimentScreen)
        assert "no recording" in form.query_one("#result").content.plain
        assert form.query_one("#change", Input).border_title == "the one change"
        await pilot.press("escape")
        assert isinstance(app.screen, MainScreen)


@run_async
async def test_a_run_reduced_by_relays_opens_in_every_view() -> None:
    """A hub fed by reducing relays holds the node's tensor-parallel calls as sums, not
    rows: the main view, a rank's detail and the report screens still open and name the
    slow rank (`rankscope.hub.reduce`)."""
    from rankscope.hub.intake import Intake
    from rankscope.hub.reduce import NodeReducer
    from rankscope.hub.store import Store
    from rankscope.sim import Cluster, load_scenario
    from rankscope.sim.emit import Kept, RankStreams

    scenario = load_scenario(
        "slow-device", ranks=32, seed=3, layout__tp=8, topology__gpus_per_host=8
    )
    cluster = Cluster(scenario, t0_ns=1_700_000_000_000_000_000)
    keep = Kept()
    streams = RankStreams(cluster, keep, run_id="reduced", scope="full", node_groups=True)
    streams.start()
    for k in range(12):
        streams.add(cluster.step(k))
    streams.finish()
    store = Store(history_steps=64, raw_steps=8)
    intake = Intake(store)
    relays: dict[int, NodeReducer] = {}
    for rank, data in keep.out:
        relay = relays.setdefault(int(cluster.layout.host[rank]), NodeReducer())
        for out in relay.take(data, now=0.0) + relay.due(now=0.0):
            intake.feed(out)
    for relay in relays.values():
        for out in relay.flush_all():
            intake.feed(out)
    store.settle()
    window = store.window("reduced")
    assert window.reduced and np.nansum(window.reduced["n"]) > 0
    slow = cluster.truth["ranks"][0]
    app = _app([window])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        assert app.analysis is not None
        top = app.analysis.hypotheses[0]
        assert top.mechanism == "slow_device" and top.ranks == (slow,)
        assert app.model.ranking[0].rank == slow  # the last-arriver panel, from the sums
        rank = slow
        for key, screen in (("s", StructureScreen), ("c", CurvesScreen)):
            await pilot.press(key)
            assert isinstance(app.screen, screen)
            await pilot.press("escape")
        app.open_detail(rank)
        await settle(pilot, app, analysis=False)
        assert isinstance(app.screen, RankDetailScreen) and app.screen.rank == rank
        assert app.detail is not None and app.detail.rank == rank
        # The calls its node's relay matched are counted, and where their rows are is said.
        assert app.detail.reduced_calls > 0
        note = app.screen.query_one("#reduced", Static)
        assert note.display and f"--ranks {rank}" in str(note.render())
        await pilot.press("escape")
        await pilot.press("q")
    assert app.return_code == 0


@run_async
async def test_a_window_without_a_complete_step_says_so_instead_of_waiting(slow13) -> None:
    # Nothing to judge: the diagnosis comes back with its reason, and the panels show it
    # rather than waiting for a diagnosis that has already come.
    from rankscope.tui.panels import DecompositionPanel

    empty = type(slow13)(**{**slow13.__dict__, "present": np.zeros_like(slow13.present)})
    app = _app([empty])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        assert app.analysis is not None and "no complete step" in app.analysis.note
        panel = _panel_text(app.screen.query_one(DecompositionPanel))
        assert "no complete step of any rank" in panel, panel
        assert "waiting for the first diagnosis" not in panel
