"""A snapshot taken while a simulated incident is still running names the injected cause."""

from __future__ import annotations

import time

import pytest

from rankscope.commands.demo import start_demo
from rankscope.hub import replay
from rankscope.sim import load_scenario
from rankscope.snapshot import View, open_snapshot, snapshot_from_source, take_snapshot

WINDOW = 16


@pytest.mark.parametrize("scenario", ["network-rail", "data-imbalance"])
def test_live_snapshot_names_the_injected_cause(scenario, tmp_path) -> None:
    record = tmp_path / "rec"
    # Paced so the job is still running when the snapshot is taken.
    handles = start_demo(
        load_scenario(scenario, ranks=16, seed=11), 400, pace=0.02, record_dir=str(record)
    )
    try:
        store = handles.hub.store
        deadline = time.monotonic() + 60
        window = None
        while time.monotonic() < deadline:
            if handles.run_id in store.run_ids():
                window = store.window(handles.run_id, last=WINDOW)
                if window.steps.size >= WINDOW and window.present[:, :-1].all():
                    break
            time.sleep(0.05)
        assert window is not None and window.steps.size >= WINDOW, "the simulated job stalled"
        assert handles.running
        bundle = take_snapshot(
            tmp_path / "snap",
            window,
            recording=record,
            flush=handles.hub.recorder.flush,
            view=View(pins=(0,)),
        )
        still_live = handles.running
    finally:
        handles.stop()
    assert still_live, "the job ended before the snapshot was written; it was not live"
    truth = window.manifest["sim"]["truth"]
    top = bundle.content["diagnosis"]["verdict"]["hypotheses"][0]
    assert top["mechanism"] == truth["mechanism"]
    for key in ("ranks", "hosts", "rails"):
        assert set(truth[key]) <= set(top[key]), f"{key}: truth {truth[key]}, named {top[key]}"
    md = (bundle.folder / "snapshot.md").read_text()
    assert f"**{truth['mechanism']}**" in md
    # window/ holds every step the snapshot's window showed.
    opened = open_snapshot(bundle.folder)
    again = replay.load(opened.recording).window(window.run, last=WINDOW)
    assert again.steps.tolist() == window.steps.tolist()


def test_viewer_snapshot_of_a_live_hub_and_of_a_recording(tmp_path) -> None:
    """The ``ctrl+s`` entry point, on the two sources the TUI has."""
    from rankscope.tui.sources import LiveSource, RecordingSource

    record = tmp_path / "rec"
    handles = start_demo(
        load_scenario("network-rail", ranks=16, seed=2), 400, pace=0.02, record_dir=str(record)
    )
    try:
        store = handles.hub.store
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready = handles.run_id in store.run_ids()
            if ready and store.window(handles.run_id, last=8).steps.size >= 8:
                break
            time.sleep(0.05)
        view = View(metric="transfer", group_by="rail", pins=(4, 12))
        live = snapshot_from_source(
            tmp_path / "snaps", LiveSource(handles.hub), view, last=8, screen_svg="<svg/>"
        )
    finally:
        handles.stop()
    assert live.content["run"] == handles.run_id
    assert live.content["view"]["pins"] == [4, 12] and live.content["view"]["group_by"] == "rail"
    assert live.content["source"] == {"kind": "recording", "path": str(record)}
    steps = live.content["window"]["steps"]
    again = replay.load(live.folder / "window").window(handles.run_id, last=8)
    assert [int(again.steps[0]), int(again.steps[-1])] == steps

    replayed = RecordingSource(record, follow=False)
    saved = snapshot_from_source(tmp_path / "snaps2", replayed, View(), last=8)
    assert saved.content["run"] == handles.run_id
    assert saved.content["view"]["metric"] == "lateness"  # the TUI's default
    assert saved.folder.parent == tmp_path / "snaps2"
    assert saved.folder.name.startswith(f"snapshot-{handles.run_id}-")
