"""The TUI's stall view asks the heartbeat judge where the run sends beats: a run whose
ranks all exited cleanly, or that is busy in one long step, has stopped making steps
without being stalled; a run whose ranks wait in a collective that one never entered is.
"""

from __future__ import annotations

import time

import pytest
from test_tui_app import run_async, settle

from rankscope.collector import schema
from rankscope.hub.intake import Intake
from rankscope.hub.store import Store
from rankscope.sim import load_scenario
from rankscope.sim.emit import iter_messages
from rankscope.tui.app import make_app
from rankscope.tui.main_screen import MainScreen
from rankscope.tui.report_screens import StallScreen
from rankscope.tui.settings import deterministic_settings
from rankscope.tui.sources import StoreSource

S = 1_000_000_000
RANKS = 4
POS = {k: -1 for k in schema.BEAT_POS_FIELDS}


def _store(hung: bool) -> Store:
    """A recorded 4-rank simulated run, then one beat per rank sent now: each rank's last
    beat as it exited (``hung=False``), or rank 2 stopped outside collectives while the
    others wait 30 s in the world group's next all-reduce (``hung=True``)."""
    now = time.time_ns()
    t0 = now - 120 * S
    store = Store()
    intake = Intake(store)
    scenario = load_scenario("healthy", ranks=RANKS, seed=3)
    for m in iter_messages(scenario, 12, run_id="r", t0_ns=t0):
        assert intake.feed(m, t_recv_ns=t0 + 60 * S)
    run = store.run_state("r")
    gid = min(int(g) for g in run.groups)
    for r in range(RANKS):
        inside = hung and r != 2
        pos = {**POS, "t": now - S, "step": 12, "step_t0": now - 40 * S, "ended": 11,
               "ended_t": now - 40 * S, "group": gid if inside else -1,
               "seq": 50 if inside else -1, "op": 0 if inside else -1,
               "since": now - 30 * S if inside else -1}  # fmt: skip
        if not hung:
            pos["exit_t"] = now - 2 * S
        head = {"job": run.job, "run": "r", "rank": r, "inc": 0, "batch": 99}
        state = "run" if hung else "exit"
        assert intake.feed(schema.beat_message(head, pos, state=state), t_recv_ns=now - S)
    return store


class _Recorded(StoreSource):
    """The same store read as a finished recording (a hang bundle's window, say)."""

    live = False


async def _screen(hung: bool, live: bool) -> type:
    """The screen the view shows once it has decided: for a live source, a second of
    samples (``refresh.sample_hz``) after ``stall_s`` without progress; for a recording,
    whose clock does not run, right after it opened."""
    clock = [0.0]
    settings = deterministic_settings()
    source = StoreSource(_store(hung), "live") if live else _Recorded(_store(hung), "rec")
    app = make_app(settings, source, run="r", clock=lambda: clock[0])
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot, app, analysis=False)
        if live:
            assert isinstance(app.screen, MainScreen)
            clock[0] = settings.refresh.stall_s + 1
        await pilot.pause(1.0)
        await settle(pilot, app, analysis=False)
        return type(app.screen)


@pytest.mark.parametrize(
    ("live", "hung", "shown"),
    [
        pytest.param(True, False, MainScreen, id="live-exited-cleanly"),
        pytest.param(True, True, StallScreen, id="live-held-by-one-rank"),
        # No clock runs for a recording: its last beats are what the judge reads.
        pytest.param(False, True, StallScreen, id="recording-held-by-one-rank"),
        pytest.param(False, False, MainScreen, id="recording-exited-cleanly"),
    ],
)
@run_async
async def test_the_stall_view_opens_only_for_a_run_the_beats_show_held(live, hung, shown):
    assert await _screen(hung=hung, live=live) is shown
