"""``rankscope watch`` and ``rankscope open``: argument errors, a live hub fed by a simulated
job, and a recording followed while another writer appends to it. The app's ``run`` is
replaced by a headless Pilot session (no terminal here); everything else is real."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from rankscope.cli import main
from rankscope.tui.app import RankscopeApp


class Tty:
    def isatty(self) -> bool:
        return True


@pytest.fixture
def headless(monkeypatch):
    """Make the commands believe they have a terminal and drive the app with a Pilot.

    ``headless.script`` is an async function ``(pilot) -> None`` run inside the session.
    """
    seen: dict = {}

    def fake_run(self: RankscopeApp, *args, **kwargs):
        async def session():
            async with self.run_test(size=(120, 36)) as pilot:
                await seen["script"](pilot)

        seen["app"] = self
        asyncio.run(session())

    monkeypatch.setattr(RankscopeApp, "run", fake_run)
    monkeypatch.setattr(sys.stdin, "isatty", Tty().isatty, raising=False)
    monkeypatch.setattr(sys.stdout, "isatty", Tty().isatty, raising=False)
    return seen


async def until(pilot, predicate, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached")
        await pilot.pause(0.05)


def test_errors_name_what_is_wrong(tmp_path: Path, capsys) -> None:
    assert main(["open", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[view]\nmetric = 'speed'\n")
    assert main(["watch", "--config", str(bad)]) == 2
    assert "view.metric 'speed'" in capsys.readouterr().err
    # Under pytest there is no terminal: both commands say so instead of drawing garbage.
    assert main(["watch", "--bind", "tcp://127.0.0.1:0"]) == 2
    assert "needs a terminal" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["open", str(empty)]) == 2
    assert "needs a terminal" in capsys.readouterr().err


def test_open_says_when_a_folder_is_not_a_recording(tmp_path: Path, headless, capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["open", str(empty), "--no-follow"]) == 2
    assert "rankscope: error:" in capsys.readouterr().err


def test_watch_shows_a_simulated_job_pushing_to_its_hub(headless, tmp_path: Path) -> None:
    from rankscope.sim import load_scenario
    from rankscope.sim import run as run_sim

    record = tmp_path / "rec"

    async def script(pilot):
        app = pilot.app
        endpoint = app.source.hub.endpoint
        scenario = load_scenario("slow-device", ranks=16, seed=2)
        await asyncio.to_thread(run_sim, scenario, endpoint, 6, run_id="live-1")
        await until(pilot, lambda: app.model is not None and app.model.header is not None)
        await until(pilot, lambda: app.model.header.step == 5)
        assert app.model.header.world_size == 16 and app.model.header.run == "live-1"
        assert app.source.live

    headless["script"] = script
    assert main(["watch", "--bind", "tcp://127.0.0.1:0", "--record", str(record)]) == 0
    assert headless["app"].model.header.step == 5
    assert any(record.iterdir())  # the hub recorded while the view watched


def test_open_follows_a_growing_recording(headless, tmp_path: Path) -> None:
    from rankscope.hub.server import Hub
    from rankscope.sim import load_scenario
    from rankscope.sim import run as run_sim

    record = tmp_path / "rec"
    scenario = load_scenario("healthy", ranks=8, seed=1)
    hub = Hub("tcp://127.0.0.1:0", record_dir=str(record), flush_s=0.05)
    hub.start()
    try:
        run_sim(scenario, hub.endpoint, 4, run_id="grow", t0_ns=10**18)

        async def script(pilot):
            app = pilot.app
            await until(pilot, lambda: app.model is not None and app.model.header is not None)
            await until(pilot, lambda: app.model.header.step == 3)
            # The hub keeps writing while the viewer is attached.
            await asyncio.to_thread(run_sim, scenario, hub.endpoint, 9, run_id="grow", t0_ns=10**18)
            await until(pilot, lambda: app.model.header.step == 8)
            assert hub.health["messages"] > 0

        headless["script"] = script
        assert main(["open", str(record)]) == 0
    finally:
        hub.stop()


def test_open_a_snapshot_restores_its_view_without_saving_it(
    headless, tmp_path: Path, monkeypatch
) -> None:
    state = tmp_path / "state"
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    record = tmp_path / "rec"
    argv = ["demo", "--headless", "--steps", "8", "--ranks", "16", "--seed", "4"]
    assert main([*argv, "--scenario", "slow-device", "--record", str(record)]) == 0
    snap = tmp_path / "snap"
    argv = ["snapshot", str(record), "--out", str(snap), "--steps", "6", "--pin", "12"]
    assert main([*argv, "--metric", "transfer", "--group-by", "rail"]) == 0

    async def script(pilot):
        app = pilot.app
        await until(pilot, lambda: app.model is not None and app.model.grid is not None)
        assert (app.pins, app.metric, app.group_by) == ((12,), "transfer", "rail")
        assert app.model.grid.rank[0] == 12 and app.model.grid.dimension == "rail"
        await pilot.press("m")
        await until(pilot, lambda: app.model.grid.spec.name == "input")

    headless["script"] = script
    assert main(["open", str(snap)]) == 0
    assert not list(state.rglob("*.json"))  # the user's own view of the job is untouched
