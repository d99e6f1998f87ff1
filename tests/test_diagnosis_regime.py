"""The current regime: a level shift in step time inside the window, and nothing else."""

from __future__ import annotations

import time

import numpy as np
import pytest
from tui_pilot import settle

from rankscope.diagnosis.regime import current_regime, since
from rankscope.diagnosis.synthetic import instance_table, make_window

MS = 1e6


def _window(step_ms: np.ndarray, ranks: int = 8):
    rng = np.random.default_rng(0)
    n = step_ms.shape[0]
    step = np.tile(step_ms * MS, (ranks, 1)) * (1 + 0.002 * rng.standard_normal((ranks, n)))
    t_start = np.tile(np.cumsum(np.r_[0.0, step_ms[:-1] * MS]), (ranks, 1))
    inst = instance_table(
        group=np.zeros(n, dtype=np.int32),
        seq=np.arange(n),
        step=np.arange(n),
        op=np.zeros(n, dtype=np.int8),
        nbytes=np.full(n, 1 << 20),
        n_members=np.full(n, ranks),
        first=np.zeros(n),
        last=np.zeros(n),
        transfer=np.ones(n),
    )
    return make_window(t_start, t_start + step, instances=inst)


def _noisy(n: int, seed: int = 1) -> np.ndarray:
    return 100.0 * (1 + 0.01 * np.random.default_rng(seed).standard_normal(n))


def test_a_slowdown_that_stays_starts_a_regime() -> None:
    y = np.r_[_noisy(20), 115.0 * np.ones(3)]
    r = current_regime(_window(y))
    assert r is not None
    assert (r.start_step, r.start_index, r.steps) == (20, 20, 3)
    assert r.change == pytest.approx(0.15, abs=0.02)
    assert "changed at step 20" in r.describe() and "slower" in r.describe()
    later = since(_window(y), r.start_index)
    assert later.steps.tolist() == [20, 21, 22]
    assert later.t_end.shape == (8, 3) and later.coll["n"].shape == (8, 3)
    assert later.instances.step.tolist() == [20, 21, 22]
    # The window as it stood when step 21 arrived: the shift is one step old, no regime yet.
    then = since(_window(y), 0, 21)
    assert then.steps.tolist() == list(range(21)) and then.t_end.shape == (8, 21)
    assert then.instances.step.max() == 20
    assert current_regime(then) is None


def test_a_recovery_is_a_regime_too() -> None:
    r = current_regime(_window(np.r_[130.0 + _noisy(15) - 100.0, _noisy(4, seed=2)]))
    assert r is not None and r.start_step == 15 and r.change < -0.2
    assert "faster" in r.describe()


@pytest.mark.parametrize(
    "case",
    ["steady", "periodic spikes", "one late spike", "too few steps before", "small shift"],
)
def test_no_regime_without_a_lasting_shift(case: str) -> None:
    y = _noisy(30)
    if case == "periodic spikes":
        y[4::5] = 160.0  # checkpoints: the steps between return to the old level
    elif case == "one late spike":
        y[-1] = 200.0
    elif case == "too few steps before":
        y = np.r_[_noisy(4), 130.0 * np.ones(6)]
    elif case == "small shift":
        y[-5:] = 101.5  # inside MIN_SHIFT of the median
    assert current_regime(_window(y)) is None


def test_the_view_names_a_new_straggler_two_steps_after_its_onset() -> None:
    # Through the simulator and the hub's intake: a GPU throttles from step 20 on.
    from rankscope.hub.intake import Intake
    from rankscope.hub.store import Store
    from rankscope.sim import Cluster, load_scenario
    from rankscope.sim.emit import Emitter, RankStreams
    from rankscope.tui.mainmodel import last_ranking

    cluster = Cluster(load_scenario("slow-device", ranks=64, seed=3, fault__onset=20))
    (slow,) = cluster.truth["ranks"]
    sent: list[bytes] = []

    class Collect:
        def send(self, data: bytes, timeout_ms: float = 0, *, cancel: object = None) -> bool:
            sent.append(data)
            return True

    store = Store(history_steps=120)
    intake = Intake(store)
    streams = RankStreams(cluster, Emitter([Collect()], 0.0, None), run_id="r", scope="full")
    streams.start()
    for k in range(22):
        streams.add(cluster.step(k))
    for data in sent:
        intake.feed(data, time.time_ns())
    store.settle()
    w = store.window("r")
    regime = current_regime(w)
    assert regime is not None and regime.start_step == 20 and regime.steps == 2
    assert last_ranking(w, 1, first_index=regime.start_index)[0].rank == slow
    # Counted over the whole window, the healthy history still outnumbers it.
    assert last_ranking(w, 1)[0].rank != slow


def test_two_bursts_in_a_row_of_a_bursty_run_are_not_a_regime() -> None:
    rng = np.random.default_rng(5)
    y = _noisy(40)
    y[rng.random(40) < 0.3] = 140.0  # congestion bursts all along
    y[-2:] = 140.0
    assert current_regime(_window(y)) is None


def test_diagnose_judges_the_steps_since_the_shift(tmp_path, capsys) -> None:
    import json

    from rankscope.cli import main
    from rankscope.commands.demo import start_demo
    from rankscope.sim import load_scenario

    scenario = load_scenario("slow-device", ranks=64, seed=21, fault__onset=24)
    rec = tmp_path / "rec"
    handles = start_demo(scenario, 27, pace="fast", record_dir=str(rec), run_id="onset")
    try:
        handles.wait(timeout=60)
        assert handles.wait_ingested()
        (slow,) = handles.info.truth["ranks"]
    finally:
        handles.stop()
    assert main(["diagnose", str(rec), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["regime"]["start_step"] == 24 and out["regime"]["steps"] == 3
    assert out["run"]["steps"] == [24, 26]
    top = out["verdict"]["hypotheses"][0]
    assert top["mechanism"] == "slow_device" and top["ranks"][0] == slow
    assert main(["diagnose", str(rec)]) == 0
    assert "step time changed at step 24" in capsys.readouterr().out


def test_the_main_screen_says_since_when(tmp_path) -> None:
    import asyncio

    from rankscope.commands.demo import make_demo_app, start_demo
    from rankscope.sim import load_scenario
    from rankscope.tui.panels import LastArrivalsPanel, VerdictLine
    from rankscope.tui.settings import deterministic_settings

    scenario = load_scenario("slow-device", ranks=16, seed=3, fault__onset=20)
    handles = start_demo(scenario, 23, pace="fast")
    try:
        handles.wait(timeout=60)
        assert handles.wait_ingested()
        (slow,) = handles.info.truth["ranks"]
        app = make_demo_app(handles, settings=deterministic_settings(tmp_path))

        async def drive() -> None:
            async with app.run_test(size=(160, 40)) as pilot:
                await settle(app, pilot, analysis=True)
                assert app.model.regime_step == 20
                assert app.model.ranking[0].rank == slow
                panel = app.screen.query_one(LastArrivalsPanel)
                assert panel.border_title == "last to arrive · since step 20"
                line = str(app.screen.query_one(VerdictLine).render())
                assert line.startswith("▶ slow_device") and "since step 20 (+" in line
                await pilot.press("q")

        asyncio.run(drive())
    finally:
        handles.stop()


def test_a_regime_is_found_from_its_true_start() -> None:
    # Job step times (ms) of a simulated 512-rank job whose GPU throttles from step 30: the
    # candidate starts after 30 count slow steps as "earlier", which widens their spread
    # enough to hide the shift of step 36; the start at 30 shows it plainly.
    y = np.array(
        [373.9, 377.8, 385.1, 391.3, 379.2, 381.5, 387.9, 402.8, 375.6, 392.7, 394.0, 375.2,
         375.0, 377.0, 392.2, 393.8, 390.8, 374.4, 373.7, 396.3, 403.8, 381.7, 378.9, 378.2,
         374.7, 372.2, 376.9, 373.6, 383.8, 390.2, 423.4, 438.6, 453.9, 439.0, 439.9, 436.6,
         433.6]
    )  # fmt: skip
    r = current_regime(_window(y))
    assert r is not None and r.start_step == 30 and r.steps == 7


def test_a_small_shift_seen_in_every_step_is_a_regime() -> None:
    # A 4,096-rank job whose GPU throttles to 0.8x from step 30: +4 % step time, about 5σ
    # of the healthy steps as a level, though its first slow step alone is only 3.4σ out.
    y = np.array(
        [637.4, 635.3, 648.1, 632.4, 634.1, 640.4, 628.1, 644.3, 638.0, 630.6, 634.1, 639.9,
         642.7, 638.3, 643.7, 640.4, 645.0, 643.3, 639.7, 645.0, 639.6, 638.1, 633.2, 643.4,
         633.1, 637.4, 639.6, 638.8, 636.3, 638.6, 657.5, 670.7, 667.8, 667.8, 673.4, 664.7,
         662.5, 660.5]
    )  # fmt: skip
    for n in range(32, y.size + 1):
        r = current_regime(_window(y[:n]))
        assert r is not None and r.start_step == 30, n


def test_a_drift_is_not_a_regime() -> None:
    # Allocator growth: the step time climbs ~1 % a step; every later step is above the
    # earlier median, but the earlier steps already rise.
    y = 800.0 * (1 + 0.01 * np.arange(40)) + np.random.default_rng(3).normal(0, 6, 40)
    for n in range(8, 41):
        assert current_regime(_window(y[:n])) is None, n
