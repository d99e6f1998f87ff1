"""The controlled experiments from the TUI, driven with Pilot on the simulated cluster: the
rerun menu offers the swap the verdict on screen proposes (its pair of ranks), ``y`` runs
it through the ``simulated`` template and the menu shows the swap's evaluation; the ladder
lists the run's sweeps beside its rungs; the experiment form stages a supported change."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from simrec import record_sim
from test_ladder_tui import _no_stall_view, _until, run_async

from rankscope.commands.demo import start_demo
from rankscope.hub.server import Hub
from rankscope.sim import load_scenario
from rankscope.tui.app import RankscopeApp, make_app
from rankscope.tui.main_screen import MainScreen
from rankscope.tui.rerun_context import session_of
from rankscope.tui.rerun_screen import RerunScreen
from rankscope.tui.settings import deterministic_settings
from rankscope.tui.sources import LiveSource

SIZE = (140, 44)
RANKS = 16
STEPS = 12


def _lines(app: RankscopeApp) -> list[str]:
    # The terminal's lines as drawn now.
    return ["".join(seg.text for seg in strip) for strip in app.screen._compositor.render_strips()]


def _verdict_on_screen(app: RankscopeApp) -> bool:
    a = app.analysis
    return a is not None and a.run == "p" and bool(a.ranked)


@pytest.mark.slow  # ~7-10 s in a busy suite
@run_async
async def test_the_menu_runs_the_proposed_shard_swap_and_shows_where_the_slowness_went(
    tmp_path: Path,
) -> None:
    rec = tmp_path / "rec"
    record_sim("data-imbalance", rec, ranks=RANKS, steps=STEPS, run_id="p")
    with Hub(record_dir=str(rec)) as hub:
        app = make_app(_no_stall_view(), LiveSource(hub), run="p")
        async with app.run_test(size=SIZE) as pilot:
            await _until(pilot, lambda: _verdict_on_screen(app), "the verdict of p")
            assert app.analysis is not None
            proposed = next(
                h.next_experiment.perturbation
                for h in app.analysis.ranked
                if h.mechanism == "data_imbalance"
            )
            assert proposed is not None and proposed.kind == "swap_shards"
            pair = ",".join(map(str, proposed.ranks))
            await pilot.press("r")
            await _until(pilot, lambda: isinstance(app.screen, RerunScreen), "the rerun menu")
            menu = app.screen
            assert isinstance(menu, RerunScreen)
            # The menu offers the verdict's swap, with the diagnosis' pair, before any key.
            assert f"s swap shards {pair}" in str(menu.query_one("#status").render())
            await pilot.press("s")
            await _until(pilot, lambda: menu.result is not None and not menu.planning, "a plan")
            res = menu.result
            assert res is not None and res.controlled is not None, res
            assert res.launch is not None, res.error
            assert res.scope == f"swap shards {pair}"
            body = str(menu.query_one("#body").render())
            assert f"--swap-shards={pair}" in body  # the simulated launcher's own flag
            assert "follows the shard" in body  # the prediction, stated before the run
            assert f"--swap-shards {pair}" in body  # the same experiment's command line
            assert menu.outcome is None
            await pilot.press("y")
            await _until(pilot, lambda: menu.experimenting, "the swap to start")
            assert isinstance(app.screen, RerunScreen)  # the menu waits for the verdict
            child = res.launch.plan.run
            assert child in session_of(app).running
            await _until(pilot, lambda: menu.outcome is not None, "the swap's evaluation", 120)
            assert menu.outcome is not None
            assert menu.outcome[0].startswith("follows the shard"), menu.outcome
            shown = str(menu.query_one("#body").render())
            assert "follows the shard: data" in shown
            assert f"p -> {child}" in shown
            await pilot.press("escape")
            await _until(pilot, lambda: isinstance(app.screen, MainScreen), "the main screen")


@run_async
async def test_the_menu_runs_the_proposed_pairwise_sweep_and_the_ladder_lists_it(
    tmp_path: Path,
) -> None:
    from rankscope.tui.ladder_screen import LadderScreen

    rec = tmp_path / "rec"
    record_sim("network-rail", rec, ranks=RANKS, steps=STEPS, run_id="p")
    with Hub(record_dir=str(rec)) as hub:
        app = make_app(_no_stall_view(), LiveSource(hub), run="p")
        async with app.run_test(size=SIZE) as pilot:
            await _until(pilot, lambda: _verdict_on_screen(app), "the verdict of p")
            await pilot.press("r")
            await _until(pilot, lambda: isinstance(app.screen, RerunScreen), "the rerun menu")
            menu = app.screen
            assert isinstance(menu, RerunScreen)
            assert "s pairwise sweep" in str(menu.query_one("#status").render())
            await pilot.press("s")
            await _until(pilot, lambda: menu.result is not None and not menu.planning, "a plan")
            res = menu.result
            assert res is not None and res.controlled is not None, res
            plan = res.controlled
            assert plan.sweep_argv and not res.error, res.error
            body = str(menu.query_one("#body").render())
            assert "at pairwise" in body and "links:" in body
            assert not (rec / "sweeps").exists()  # nothing runs before `y`
            await pilot.press("y")
            await _until(pilot, lambda: menu.outcome is not None, "the sweep's finding", 120)
            assert menu.outcome is not None
            assert "found network_rail" in " ".join(menu.outcome), menu.outcome
            assert (rec / "sweeps" / f"{plan.sweep_run}.json").exists()
            await pilot.press("escape")
            await _until(pilot, lambda: isinstance(app.screen, MainScreen), "the main screen")
            await pilot.press("L")
            await _until(pilot, lambda: isinstance(app.screen, LadderScreen), "the ladder")
            screen = app.screen
            assert isinstance(screen, LadderScreen)
            await _until(pilot, lambda: not screen.building, "the ladder to compute", 60)
            assert [e.run for e in screen.sweeps] == [plan.sweep_run]
            (entry,) = screen.sweeps
            assert entry.scope == "pairwise" and entry.finding == "network_rail"
            # No scope rerun yet: the ladder says so, and the sweep is listed beside it.
            assert "no reduced-scope rerun of p yet" in str(screen.query_one("#table").render())
            await pilot.pause(0.1)
            drawn = "\n".join(_lines(app))
            assert plan.sweep_run in drawn and "network_rail" in drawn, drawn
            assert all(h in drawn for h in ("run", "scope", "found", "conclusion")), drawn


def _supported_experiment(rec: Path, hub: Hub) -> str:
    # A prediction recorded from p, judged supported against the same job without the
    # imbalance (as the experiment form records and judges one).
    from rankscope.hub import replay
    from rankscope.launch.experiments import evaluate_experiment, record_experiment
    from rankscope.sim import run as run_sim

    exp = record_experiment(
        rec,
        hypothesis="data_imbalance",
        change="attention-balanced packer",
        metric="entry_spread",
        direction="down",
        rejection="entry spread unchanged",
        parent_run="p",
    )
    twin = load_scenario("data-imbalance", ranks=RANKS, fault="healthy")
    run_sim(twin, hub.endpoint, STEPS, pace="fast", run_id="after")
    deadline = time.monotonic() + 30
    while not any(s.run == "after" and s.steps_complete >= STEPS for s in hub.store.runs()):
        assert time.monotonic() < deadline, "the after-run never reached the hub"
        time.sleep(0.1)
    time.sleep(1.0)  # the recording flushes every 0.5 s
    store = replay.load(rec)
    judged = evaluate_experiment(rec, exp.id, store.window("p"), store.window("after"))
    assert judged.status == "supported", judged.evaluation
    return exp.id


@run_async
async def test_the_form_stages_a_supported_experiment_and_shows_the_rollback(
    tmp_path: Path,
) -> None:
    from textual.widgets import OptionList

    from rankscope.launch.experiments import load_experiment
    from rankscope.tui.experiment_screen import ExperimentScreen
    from rankscope.tui.stage_screen import StageScreen

    rec = tmp_path / "rec"
    record_sim("data-imbalance", rec, ranks=RANKS, steps=STEPS, run_id="p")
    with Hub(record_dir=str(rec)) as hub:
        exp_id = await asyncio.to_thread(_supported_experiment, rec, hub)
        app = make_app(_no_stall_view(), LiveSource(hub), run="p")
        async with app.run_test(size=SIZE) as pilot:
            await _until(pilot, lambda: app.model is not None, "the first sample")
            await pilot.press("e")
            await _until(pilot, lambda: isinstance(app.screen, ExperimentScreen), "the form")
            form = app.screen
            assert isinstance(form, ExperimentScreen)
            form.query_one("#records", OptionList).focus()
            await pilot.press("home", "ctrl+t")
            await _until(pilot, lambda: isinstance(app.screen, StageScreen), "the staging")
            stage = app.screen
            assert isinstance(stage, StageScreen)
            await _until(pilot, lambda: stage.plan is not None and not stage.planning, "a plan")
            plan = stage.plan
            assert plan is not None and not plan.error, stage.lines
            assert plan.stages[0].scope == "one-node"
            body = str(stage.query_one("#body").render())
            assert f"stage experiment {exp_id} (supported)" in body
            # The same staging as a command line, shown beside the plan.
            assert plan.cli == (
                f"rankscope experiment stage {rec} --id {exp_id} --run p --launcher simulated --yes"
            )
            assert f"  $ {plan.cli}" in stage.lines
            # No change given: the stages rerun the parent unchanged, so the metric the
            # experiment predicted does not move against the control, and the staging
            # stops at its first stage with the rollback line.
            assert "none given" in body
            await pilot.press("y")
            await _until(pilot, lambda: stage.running, "the stages to start")
            await _until(pilot, lambda: stage.attempt is not None, "the staging to end", 180)
            attempt = stage.attempt
            assert attempt is not None and attempt["passed"] is False, attempt
            assert attempt["stopped_at"] == "one-node", attempt
            shown = str(stage.query_one("#body").render())
            assert "stage one-node:" in shown and "FAILED" in shown
            assert "workload" in shown and "metric" in shown  # each check, as it came back
            assert "rollback: revert 'attention-balanced packer'" in shown
            assert load_experiment(rec, exp_id).stages[-1]["stopped_at"] == "one-node"


@run_async
async def test_without_a_hub_the_swap_is_shown_with_its_command_but_not_launched() -> None:
    from rankscope.tui.scenes import Fault, synthetic_run
    from rankscope.tui.sources import StaticSource

    win = synthetic_run(16, 12, fault=Fault("slow_device", rank=5), run="s")
    app = make_app(deterministic_settings(), StaticSource([win]))
    async with app.run_test(size=SIZE) as pilot:
        await _until(
            pilot, lambda: app.analysis is not None and bool(app.analysis.ranked), "a verdict"
        )
        assert app.analysis is not None
        top = app.analysis.ranked[0]
        p = top.next_experiment.perturbation
        assert top.mechanism == "slow_device" and p is not None and p.kind == "swap_shards"
        assert p.ranks[0] == 5  # the slow rank, swapped with a healthy one
        await pilot.press("r")
        await _until(pilot, lambda: isinstance(app.screen, RerunScreen), "the menu")
        menu = app.screen
        assert isinstance(menu, RerunScreen)
        # Before any key, the menu lists what the verdict proposes.
        intro = str(menu.query_one("#body").render())
        assert f"  swap shards 5,{p.ranks[1]}  slow_device" in intro
        await pilot.press("s")
        await _until(pilot, lambda: menu.result is not None and not menu.planning, "a plan")
        res = menu.result
        assert res is not None and res.controlled is not None
        assert res.launch is None and "not launchable" in res.error
        body = str(menu.query_one("#body").render())
        assert "rerun s at full" in body and "stays with the device" in body
        # The experiment and its evaluation as command lines (a real run: torchrun).
        run_cmd, judge = res.controlled.cli
        assert run_cmd.startswith("rankscope rerun PATH --scope full --run s --swap-shards")
        assert judge == "rankscope experiment swap PATH --before s --after s-swap-shards"
        await pilot.press("y")  # refused: nothing to launch
        assert isinstance(app.screen, RerunScreen) and not menu.experimenting
        assert session_of(app).running == {}


@pytest.mark.slow
@run_async
async def test_the_menu_runs_the_proposed_placement_swap(tmp_path: Path) -> None:
    # At 32 ranks the placement scenario splits two of eight tensor-parallel groups across
    # hosts (test_method_walk: at 16 no diagnosis can call them misplaced).
    rec = tmp_path / "rec"
    handles = start_demo(
        load_scenario("placement", ranks=32), STEPS, pace="fast", record_dir=str(rec), run_id="p"
    )
    try:
        handles.wait(timeout=120)
        assert handles.wait_ingested()
    finally:
        handles.stop()
    with Hub(record_dir=str(rec)) as hub:
        app = make_app(_no_stall_view(), LiveSource(hub), run="p")
        async with app.run_test(size=SIZE) as pilot:
            await _until(pilot, lambda: _verdict_on_screen(app), "the verdict of p")
            await pilot.press("r")
            await _until(pilot, lambda: isinstance(app.screen, RerunScreen), "the rerun menu")
            menu = app.screen
            assert isinstance(menu, RerunScreen)
            await pilot.press("s")
            await _until(pilot, lambda: menu.result is not None and not menu.planning, "a plan")
            res = menu.result
            assert res is not None and res.controlled is not None and res.launch is not None
            assert res.controlled.offer.perturbation.kind == "swap_placement", res.scope
            await pilot.press("y")
            await _until(pilot, lambda: menu.outcome is not None, "the swap's evaluation", 180)
            assert menu.outcome is not None
            assert menu.outcome[0] == "moves with the placement: topology", menu.outcome
