"""Sources, sampling errors, per-job view files, and the main model built from a sample."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from rankscope.tui.mainmodel import ViewState, build_main_model, last_ranking, step_stats
from rankscope.tui.scenes import Fault, synthetic_run
from rankscope.tui.sources import (
    RecordingSource,
    RunEntry,
    StaticSource,
    StoreSource,
    baseline_window,
    run_entry,
    sample,
)
from rankscope.tui.viewstate import SavedView, load_view, save_view, state_path


@pytest.fixture(scope="module")
def window():
    return synthetic_run(32, 12, fault=Fault("slow_device", rank=5), run="r2")


def test_sample_picks_the_newest_full_run(window) -> None:
    rerun = synthetic_run(8, 4, run="r3")
    object.__setattr__(rerun, "parent_run", "r2")
    smp = sample(StaticSource([window, rerun]), None, 100)
    assert smp.run == "r2" and smp.window is window and smp.error == ""
    assert [r.run for r in smp.runs] == ["r2", "r3"]
    assert sample(StaticSource([window, rerun]), "r3", 100).window is rerun
    missing = sample(StaticSource([window]), "nope", 100)
    assert missing.window is None and missing.error == "no steps yet"
    assert sample(StaticSource([]), None, 10).error == "no runs yet"


def test_baseline_window_has_its_own_bound_and_is_read_again_only_when_it_grows() -> None:
    base = synthetic_run(64, 12, run="base")
    asked: list[int] = []

    class Counting(StaticSource):
        def window(self, run, last):
            asked.append(last)
            return super().window(run, last)

    source = Counting([base])
    runs = source.runs()
    first = baseline_window(source, "base", runs, 120, max_cells=2048)
    assert first is base and asked == [32]  # 2,048 cells / 64 ranks
    # A finished baseline: its last step is the one already read, so it is not read again.
    assert baseline_window(source, "base", runs, 120, 2048, previous=first) is first
    assert asked == [32]
    grown = [RunEntry(r.job, r.run, world_size=64, last_step=r.last_step + 1) for r in runs]
    baseline_window(source, "base", grown, 120, 2048, previous=first)
    assert asked == [32, 32]
    # Another baseline run never reuses the previous one's window.
    assert baseline_window(source, "other", runs, 120, 2048, previous=first) is None


def test_a_followed_recording_is_live_until_its_hub_has_stopped(tmp_path: Path, window) -> None:
    class Follower:
        def __init__(self, p):
            self.store = StaticSource([window])

    path = tmp_path / "rec"
    path.mkdir()
    meta = path / "meta.json"

    def source() -> RecordingSource:
        return RecordingSource(path, follow=True, follower=Follower)

    assert source().live  # no meta.json yet: a hub may be starting
    meta.write_text(json.dumps({"sessions": [{"endpoint": "tcp://h:5555", "stopped_ns": None}]}))
    assert source().live
    meta.write_text(json.dumps({"sessions": [{"endpoint": "tcp://h:5555", "stopped_ns": 7}]}))
    assert not source().live  # finished: its end is not a stall


def test_sample_reports_store_errors_instead_of_raising(window) -> None:
    class Broken(StaticSource):
        def window(self, run, last):
            raise RuntimeError("store is rebuilding")

    smp = sample(Broken([window]), None, 10)
    assert smp.window is None and smp.error == "RuntimeError: store is rebuilding"
    model = build_main_model(smp, ViewState())
    assert model.grid is None and model.message == "RuntimeError: store is rebuilding"


def test_store_source_reads_any_store_shape(window) -> None:
    @dataclass
    class Summary:
        job: str
        run: str
        scope: str
        world_size: int
        last_step: int

    @dataclass
    class Health:
        events_per_s: float
        dropped: int

    class Store:
        def __init__(self):
            self.asked = []

        def runs(self):
            return [Summary("j", "r2", "one-node", 8, 41)]

        def window(self, run, last):
            self.asked.append((run, last))
            return window

        @property
        def health(self):
            return Health(1e6, 3)

    store = Store()
    src = StoreSource(store, "live tcp://*:5555")
    runs = src.runs()
    assert runs == [RunEntry("j", "r2", "one-node", None, 8, 42, 41)]
    assert src.window("r2", 50) is window and store.asked == [("r2", 50)]
    assert src.health() == {"events_per_s": 1e6, "dropped": 3}
    assert run_entry({"job": "j", "run": "x", "steps_complete": 7}).steps == 7
    assert run_entry({"job": "j", "run": "x", "last_step": None}).last_step == -1


def test_recording_source_starts_and_stops_its_follower(tmp_path: Path, window) -> None:
    path = tmp_path / "rec"
    path.mkdir()
    calls = []

    class Follower:
        def __init__(self, p):
            calls.append(("init", p))
            self.store = StaticSource([window])

        def start(self):
            calls.append("start")

        def stop(self):
            calls.append("stop")

    src = RecordingSource(path, follow=True, follower=Follower)
    assert src.live and calls == [("init", path)]
    assert [r.run for r in src.runs()] == ["r2"]
    src.start()
    src.start()
    src.stop()
    src.stop()
    assert calls == [("init", path), "start", "stop"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RecordingSource(tmp_path / "nope")


def test_view_state_roundtrip_and_bad_files(tmp_path: Path) -> None:
    view = SavedView("wait", "rail", (3, 9), "run-a")
    path = save_view(tmp_path, "llama/70b run", view)
    assert path.parent == tmp_path / "views" and path.name.startswith("llama_70b_run-")
    assert load_view(tmp_path, "llama/70b run") == view
    assert load_view(tmp_path, "other") is None
    assert state_path(tmp_path, "a/b") != state_path(tmp_path, "a_b")
    path.write_text("{not json")
    assert load_view(tmp_path, "llama/70b run") is None
    path.write_text(
        json.dumps({"format": 1, "metric": "speed", "group_by": 3, "pins": [1, -2, True, "x", 4]})
    )
    got = load_view(tmp_path, "llama/70b run")
    assert got == SavedView("lateness", "host", (1, 4), None)
    assert list((tmp_path / "views").glob(".view-*")) == []


def test_main_model_numbers(window) -> None:
    stats = step_stats(window)
    per_step = np.nanmedian(window.step_ns, axis=0) / 1e6
    assert stats.p50 == pytest.approx(np.percentile(per_step, 50))
    assert stats.max == pytest.approx(per_step.max()) and stats.steps == 12
    ranking = last_ranking(window)
    assert ranking[0].rank == 5 and ranking[0].times_last == 24
    smp = sample(StaticSource([window], health={"events_per_s": 5.0}), None, 10)
    model = build_main_model(smp, ViewState(metric="sm_clock", group_by="rail", pins=(5,)))
    assert model.header.health == {"events_per_s": 5.0}
    assert model.header.tokens_per_s > 0 and model.header.clock_error_ms == pytest.approx(0.05)
    assert model.grid.dimension == "rail" and model.grid.rank[0] == 5
    assert model.arrivals[0].last_rank == 5 and model.arrivals[0].margin_ms > 5


def test_last_ranking_survives_counts_that_overflow_their_sum() -> None:
    w = synthetic_run(4, 3, run="huge")
    big = np.finfo(np.float64).max
    w.coll["times_last"][:] = 0.0
    w.coll["times_last"][2, :2] = big  # finite each, infinite summed
    w.coll["late_ns"][2, :2] = big
    top = last_ranking(w)[0]
    assert top.rank == 2 and top.times_last == int(big) and np.isfinite(top.late_ms)


def test_large_worlds_get_fewer_steps(window) -> None:
    from rankscope.tui.sources import MIN_STEPS, steps_within

    assert steps_within(120, 512, 1 << 20) == 120
    assert steps_within(120, 16384, 1 << 20) == 64
    assert steps_within(120, 1 << 20, 1 << 20) == MIN_STEPS
    assert steps_within(120, 0, 1 << 20) == 120 and steps_within(120, 10**6, None) == 120
    asked = []

    class Recording(StaticSource):
        def window(self, run, last):
            asked.append(last)
            return super().window(run, last)

    sample(Recording([window]), None, 120, max_cells=32 * 20)  # the window has 32 ranks
    assert asked == [20]
