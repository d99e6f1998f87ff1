"""The simulated cluster through a real hub: same schema, same validation, no rejects."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
from tui_pilot import settle

from rankscope.cli import main
from rankscope.collector import schema
from rankscope.commands.demo import start_demo, summary_line
from rankscope.hub.recording import read_frames
from rankscope.hub.replay import load
from rankscope.hub.server import Hub
from rankscope.sim import ScopeSpec, load_scenario, run


def _decoded(path: Path) -> list[schema.Message]:
    return [schema.decode(f.payload) for f in read_frames(path)]


def test_headless_demo_writes_a_recording_the_hub_accepts(tmp_path: Path, capsys) -> None:
    rec = tmp_path / "rec"
    rc = main(
        [
            "demo",
            "--headless",
            "--scenario",
            "slow-device",
            "--ranks",
            "16",
            "--steps",
            "4",
            "--record",
            str(rec),
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0
    assert out["complete"] and out["dropped"] == 0 and out["hub_rejects"] == {}
    assert out["hub_messages"] == out["messages"]
    msgs = _decoded(rec)  # raises on any message the schema rejects
    kinds = [m.kind for m in msgs]
    assert kinds.count("hello") == 16 and kinds.count("steps") == 4 * 16
    store = load(rec)
    assert store.health["rejects"] == {}
    w = store.window(out["run"])
    assert w.world_size == 16 and w.steps.tolist() == [0, 1, 2, 3]
    truth = w.manifest["sim"]["truth"]
    assert w.scope == "full"
    if truth["present"]:
        (slow,) = truth["ranks"]
        share = np.nansum(w.coll["times_last"], axis=1) / np.nansum(w.coll["n"], axis=1)
        assert int(np.argmax(share)) == slow
        assert np.nanmean(w.device["throttle"][slow]) > 0


def test_same_seed_records_identical_tables(tmp_path: Path) -> None:
    tables = []
    for i in range(2):
        with Hub(record_dir=str(tmp_path / f"r{i}")) as hub:
            info = run(
                load_scenario("checkpoint", ranks=16),
                hub.endpoint,
                6,
                run_id="det",
                t0_ns=1_700_000_000_000_000_000,
            )
            assert info.dropped == 0
        seen = []
        for m in _decoded(tmp_path / f"r{i}"):
            cols = {t: {c: a.tobytes() for c, a in cols.items()} for t, cols in m.tables.items()}
            seen.append((m.kind, m.header["rank"], m.header.get("batch"), repr(cols)))
        tables.append(sorted(seen))
    assert tables[0] == tables[1]
    steps_msgs = [t for t in tables[0] if t[0] == "steps"]
    assert len(steps_msgs) == 6 * 16


def test_reduced_rerun_reports_scope_and_parent(tmp_path: Path) -> None:
    sc = load_scenario("slow-host-input", ranks=32)
    with Hub() as hub:
        run(sc, hub.endpoint, 2, run_id="full")
        host = sc.fault.host
        info = run(
            sc,
            hub.endpoint,
            2,
            scope=ScopeSpec("one-node", hosts=(host,)),
            parent_run="full",
            run_id="node",
        )
        assert info.world_size == 8 and info.truth["present"]
        _wait(lambda: len(hub.store.run_ids()) == 2 and _steps(hub, "node") == 2)
        w = hub.store.window("node")
        assert (w.scope, w.parent_run, w.world_size) == ("one-node", "full", 8)
        assert set(w.ranks.hosts) == {f"node{host:03d}"}
        assert np.nanmedian(w.phase_ns["input"]) > 0.5e6 * sc.fault.magnitude


def test_stop_ends_a_paced_run(tmp_path: Path) -> None:
    stop = threading.Event()
    with Hub() as hub:
        timer = threading.Timer(0.5, stop.set)
        timer.start()
        info = run(load_scenario("healthy", ranks=8), hub.endpoint, 10_000, pace=0.05, stop=stop)
        timer.cancel()
    assert 0 < info.steps < 10_000


def test_senders_close_only_once_the_receiver_says_all_is_in() -> None:
    # ZeroMQ may lose what is still in flight to a receiver that is behind when the
    # sending socket closes (seen: a 4,096-rank demo through two reducing relays lost
    # ~120 messages of 50,177). Given `delivered`, the run asks it with the number sent,
    # and closes only once it answers yes: here after the hub counted all of them.
    asked: list[int] = []
    with Hub() as hub:

        def delivered(n: int) -> bool:
            asked.append(n)
            return hub.health["messages"] >= n

        info = run(load_scenario("healthy", ranks=8), hub.endpoint, 3, delivered=delivered)
        assert asked and asked[-1] == info.messages
        assert hub.health["messages"] >= info.messages  # all in before the run returned
    # Bounded: a receiver that never says so is waited for at most `deliver_wait_s`.
    with Hub() as hub:
        info = run(
            load_scenario("healthy", ranks=8),
            hub.endpoint,
            1,
            delivered=lambda n: False,
            deliver_wait_s=0.2,
        )
        assert info.messages > 0


def test_demo_handles_give_a_live_summary() -> None:
    handles = start_demo(load_scenario("slow-device", ranks=16), 3, pace="fast")
    try:
        handles.wait(timeout=30)
        assert handles.wait_ingested(timeout=30)
        line = summary_line(handles)
        assert handles.run_id in line and "step 2" in line
    finally:
        handles.stop()


def test_list_names_every_scenario(capsys) -> None:
    assert main(["demo", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("healthy", "seed-example", "seed-example-baseline", "network-rail"):
        assert name in out


def test_bad_scenario_is_an_error_not_a_crash(capsys) -> None:
    assert main(["demo", "--headless", "--scenario", "nope"]) == 2
    assert "no scenario named 'nope'" in capsys.readouterr().err


def _steps(hub: Hub, run_id: str) -> int:
    try:
        return int(hub.store.window(run_id).steps.shape[0])
    except KeyError:
        return 0


def _wait(cond, timeout: float = 20.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout / 0.05)):
        if cond():
            return
        done.wait(0.05)
    raise AssertionError("condition not reached")


def test_demo_tui_shows_the_simulated_straggler(tmp_path: Path) -> None:
    import asyncio

    from rankscope.commands.demo import make_demo_app
    from rankscope.tui.settings import deterministic_settings

    handles = start_demo(load_scenario("slow-device", ranks=16), 4, pace="fast")
    try:
        handles.wait(timeout=30)
        assert handles.wait_ingested(timeout=30)
        (slow,) = handles.info.truth["ranks"]
        app = make_demo_app(handles, settings=deterministic_settings(tmp_path))

        async def drive() -> None:
            async with app.run_test(size=(120, 36)) as pilot:
                await settle(app, pilot)
                assert app.model.header.run == handles.run_id
                assert app.model.header.world_size == 16
                assert app.model.ranking[0].rank == slow
                await pilot.press("q")

        asyncio.run(drive())
    finally:
        handles.stop()


def test_demo_opens_against_its_healthy_twin(tmp_path: Path, capsys) -> None:
    import asyncio

    from rankscope.commands.demo import make_demo_app
    from rankscope.tui.settings import deterministic_settings

    scenario = load_scenario("slow-device", ranks=16)
    handles = start_demo(scenario, 4, pace="fast", baseline_steps=5)
    try:
        handles.wait(timeout=30)
        assert handles.wait_ingested(timeout=30)
        base = handles.baseline
        assert base is not None and base.run == f"{handles.run_id}-healthy"
        twin = handles.hub.store.window(base.run)
        assert twin.steps.tolist() == [0, 1, 2, 3, 4]
        assert twin.job == handles.hub.store.window(handles.run_id).job
        assert twin.manifest["sim"]["truth"]["mechanism"] == "healthy"
        app = make_demo_app(handles, settings=deterministic_settings(tmp_path))

        async def drive() -> None:
            async with app.run_test(size=(120, 36)) as pilot:
                await settle(app, pilot)
                assert app.model.header.run == handles.run_id
                assert app.model.header.baseline_run == base.run
                assert app.model.header.baseline is not None
                await pilot.press("q")

        asyncio.run(drive())
    finally:
        handles.stop()
    rec = tmp_path / "rec"
    argv = ["demo", "--headless", "--scenario", "slow-device", "--ranks", "16", "--steps", "3"]
    assert main([*argv, "--baseline-steps", "4", "--record", str(rec), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["complete"] and out["hub_messages"] > out["messages"]
    assert sorted(load(rec).run_ids()) == sorted([out["run"], out["baseline_run"]])
