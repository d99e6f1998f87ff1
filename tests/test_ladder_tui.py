"""The rerun menu and the ladder screen with Pilot key presses: for each fault of the
simulated cluster, reruns at one-rank (``1``), one-node (``n``) and two-node (``2``) are
planned, confirmed (``y``) and launched through the ``simulated`` template from the TUI,
and the ladder screen names the first scope matching the fault's mechanism."""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import replace
from pathlib import Path

import pytest

from rankscope.commands.demo import start_demo
from rankscope.hub.server import Hub
from rankscope.sim import load_scenario
from rankscope.tui.app import RankscopeApp, make_app
from rankscope.tui.ladder_screen import LadderScreen
from rankscope.tui.main_screen import MainScreen
from rankscope.tui.rerun_context import session_of
from rankscope.tui.rerun_screen import RerunScreen
from rankscope.tui.settings import deterministic_settings
from rankscope.tui.sources import LiveSource, StaticSource

SIZE = (140, 44)
RANKS = 32
STEPS = 10


def run_async(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return wrapper


def _record_parent(scenario: str, rec: Path) -> None:
    handles = start_demo(
        load_scenario(scenario, ranks=RANKS), STEPS, pace="fast", record_dir=str(rec), run_id="p"
    )
    handles.wait(timeout=120)
    assert handles.wait_ingested()
    handles.stop()


async def _until(pilot, cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await pilot.pause(0.05)
        if cond():
            return
    raise AssertionError(f"timed out waiting for {what}")


async def _rerun(pilot, app: RankscopeApp, key: str, scope: str) -> str:
    await pilot.press("r")
    await _until(pilot, lambda: isinstance(app.screen, RerunScreen), "the rerun menu")
    menu = app.screen
    assert isinstance(menu, RerunScreen)
    await pilot.press(key)
    await _until(pilot, lambda: menu.result is not None and not menu.planning, "a plan")
    assert menu.context.launcher == "simulated"  # the default for a simulated parent
    assert menu.result is not None and menu.result.scope == scope, menu.result
    assert menu.result.launch is not None, menu.result.error
    shown = str(menu.query_one("#body").render())
    assert "rankscope.launch.simulated" in shown and f"--scope={scope}" in shown
    await pilot.press("y")
    await _until(pilot, lambda: isinstance(app.screen, MainScreen), "the menu to close")
    child = menu.result.launch.plan.run
    assert app.run_id == child  # the view follows the new run
    running = session_of(app).running[child]
    await _until(pilot, lambda: running.poll() is not None, f"{child} to finish", 90)
    assert running.poll() == 0, running.launch.log.read_text()[-2000:]
    return child


def _no_stall_view():
    # The simulated reruns send no heartbeats, so once the last one has finished the view
    # knows only that no step came for refresh.stall_s, and opens the stall view (on a busy
    # machine, while the ladder computes). Not what this test is about: the view is kept.
    settings = deterministic_settings()
    return replace(settings, refresh=replace(settings.refresh, stall_s=3600.0))


# Every fault's first scope is checked fast through the CLI ladder (test_ladder_sim); here
# the TUI's path is walked for one-rank and two-node in the default tier (~10 s each in a
# busy suite), the rest in the slow.
CASES = [
    ("slow-device", "one-rank"),
    pytest.param("data-imbalance", "one-node", marks=pytest.mark.slow),
    pytest.param("local-fabric", "one-node", marks=pytest.mark.slow),
    ("network-rail", "two-node"),
    pytest.param("placement", "two-node", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("scenario", "first"), CASES)
@run_async
async def test_reruns_from_the_tui_find_the_first_scope(
    scenario: str, first: str, tmp_path: Path
) -> None:
    rec = tmp_path / "rec"
    _record_parent(scenario, rec)
    with Hub(record_dir=str(rec)) as hub:
        app = make_app(_no_stall_view(), LiveSource(hub), run="p")
        async with app.run_test(size=SIZE) as pilot:
            await _until(pilot, lambda: app.model is not None, "the first sample")
            children = [
                await _rerun(pilot, app, key, scope)
                for key, scope in (("1", "one-rank"), ("n", "one-node"), ("2", "two-node"))
            ]
            store = hub.store
            await _until(
                pilot,
                lambda: all(
                    any(s.run == c and s.steps_complete >= STEPS for s in store.runs())
                    for c in children
                ),
                "the reruns' steps at the hub",
            )
            time.sleep(1.0)  # the recording flushes every 0.5 s; the ladder replays it
            await pilot.press("L")
            await _until(pilot, lambda: isinstance(app.screen, LadderScreen), "the ladder")
            screen = app.screen
            assert isinstance(screen, LadderScreen)
            await _until(pilot, lambda: screen.ladder is not None, "the ladder to compute", 90)
            lad = screen.ladder
            assert lad is not None
            assert [r.scope for r in lad.rungs] == ["one-rank", "one-node", "two-node", "full"]
            assert lad.first_scope == first, [(r.scope, r.why) for r in lad.rungs]
            text = str(screen.query_one("#table").render())
            assert f"first scope with the regression: {first}" in text
            await pilot.press("escape")
            await _until(pilot, lambda: isinstance(app.screen, MainScreen), "the main screen")


@run_async
async def test_without_a_hub_the_plan_is_shown_but_not_launched() -> None:
    from rankscope.tui.scenes import Fault, synthetic_run

    win = synthetic_run(16, 12, fault=Fault("slow_device", rank=5), run="s")
    app = make_app(deterministic_settings(), StaticSource([win]))
    async with app.run_test(size=SIZE) as pilot:
        await _until(pilot, lambda: app.model is not None, "the first sample")
        await pilot.press("r")
        await _until(pilot, lambda: isinstance(app.screen, RerunScreen), "the menu")
        menu = app.screen
        assert isinstance(menu, RerunScreen)
        await pilot.press("1")
        await _until(pilot, lambda: menu.result is not None and not menu.planning, "a plan")
        assert menu.result is not None and menu.result.launch is None
        assert "not launchable" in menu.result.error
        assert "rerun s at one-rank" in str(menu.query_one("#body").render())
        await pilot.press("y")  # refused: nothing to launch
        assert isinstance(app.screen, RerunScreen)
        assert session_of(app).running == {}
        await pilot.press("escape")
        await _until(pilot, lambda: isinstance(app.screen, MainScreen), "the main screen")


@run_async
async def test_experiment_form_records_before_and_judges_after(tmp_path: Path) -> None:
    from textual.widgets import Input, OptionList, Select

    from rankscope.launch.experiments import list_experiments
    from rankscope.sim import run as run_sim
    from rankscope.tui.experiment_screen import ExperimentScreen

    rec = tmp_path / "rec"
    _record_parent("data-imbalance", rec)
    with Hub(record_dir=str(rec)) as hub:
        app = make_app(deterministic_settings(), LiveSource(hub), run="p")
        async with app.run_test(size=SIZE) as pilot:
            await _until(pilot, lambda: app.model is not None, "the first sample")
            await pilot.press("e")
            await _until(pilot, lambda: isinstance(app.screen, ExperimentScreen), "the form")
            form = app.screen
            assert isinstance(form, ExperimentScreen)
            await _until(pilot, lambda: form.suggested, "the diagnosis' suggestion")
            # Prefilled from the verdict's next experiment; the user edits the change.
            assert form.query_one("#hypothesis", Input).value == "data_imbalance"
            assert "packed batches" in form.query_one("#change", Input).value
            assert form.query_one("#rejection", Input).value
            change = form.query_one("#change", Input)
            change.value = ""
            change.focus()
            await pilot.press(*"attention-balanced packer")
            form.query_one("#metric", Select).value = "entry_spread"
            form.query_one("#direction", Select).value = "down"
            await pilot.press("ctrl+s")
            (saved,) = list_experiments(rec)
            assert (saved.metric, saved.direction, saved.parent_run) == (
                "entry_spread",
                "down",
                "p",
            )
            assert saved.change == "attention-balanced packer"
            await pilot.press("escape")
            # The run with the change: the same job with the attention-balanced packer.
            twin = load_scenario("data-imbalance", ranks=RANKS, fault="healthy")
            await asyncio.to_thread(run_sim, twin, hub.endpoint, STEPS, pace="fast", run_id="after")
            app.run_id = "after"
            await _until(
                pilot,
                lambda: (
                    any(s.run == "after" and s.steps_complete >= STEPS for s in hub.store.runs())
                    and app.model is not None
                    and app.model.window is not None
                    and app.model.window.run == "after"
                ),
                "the after-run on screen",
            )
            time.sleep(1.0)  # recording flush
            await pilot.press("e")
            await _until(pilot, lambda: isinstance(app.screen, ExperimentScreen), "the form")
            form = app.screen
            assert isinstance(form, ExperimentScreen)
            form.query_one("#records", OptionList).focus()
            await pilot.press("home", "enter")
            await _until(pilot, lambda: form.last_result is not None, "the evaluation", 60)
            result = form.last_result
            assert result is not None and result.evaluation is not None
            assert result.evaluation["verdict"] == "supported"
            assert (result.before_run, result.after_run) == ("p", "after")
            shown = str(form.query_one("#result").render())
            assert "supported" in shown and "accounting closed" in shown
            assert list_experiments(rec)[0].status == "supported"
