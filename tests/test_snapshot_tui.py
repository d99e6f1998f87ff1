"""``ctrl+s`` in the TUI writes a snapshot bundle of the view on screen."""

from __future__ import annotations

import asyncio
import json

from rankscope.cli import main
from rankscope.snapshot import open_snapshot
from rankscope.tui.app import make_app
from rankscope.tui.settings import deterministic_settings
from rankscope.tui.sources import RecordingSource


def test_ctrl_s_writes_the_bundle_with_the_view(tmp_path, monkeypatch) -> None:
    record = tmp_path / "rec"
    argv = ["demo", "--headless", "--steps", "8", "--ranks", "16", "--seed", "4"]
    assert main([*argv, "--scenario", "network-rail", "--record", str(record)]) == 0
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    app = make_app(deterministic_settings(), RecordingSource(record, follow=False))

    async def scenario() -> list:
        async with app.run_test(size=(120, 40)) as pilot:
            for _ in range(200):
                await pilot.pause(0.05)
                if app.model is not None and app.model.window is not None:
                    break
            app.pins = (4, 12)
            app.group_by = "rail"
            await pilot.press("ctrl+s")
            for _ in range(600):
                await pilot.pause(0.05)
                # A bundle is written in a hidden directory and renamed when whole.
                done = [
                    p
                    for p in work.iterdir()
                    if not p.name.startswith(".") and (p / "snapshot.json").exists()
                ]
                if done:
                    return done
            return []

    bundles = asyncio.run(scenario())
    assert len(bundles) == 1, "ctrl+s wrote no bundle"
    opened = open_snapshot(bundles[0])
    assert opened.view.pins == (4, 12) and opened.view.group_by == "rail"
    assert opened.view.run == opened.content["run"]
    assert opened.recording is not None and (opened.recording / "meta.json").exists()
    svg = (bundles[0] / "screen.svg").read_text()
    assert svg.lstrip().startswith("<svg") and "rankscope" in svg
    content = json.loads((bundles[0] / "snapshot.json").read_text())
    assert content["source"]["kind"] == "recording"
    assert [p["rank"] for p in content["pins"]] == [4, 12]
