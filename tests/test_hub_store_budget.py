"""The store's one cell budget across runs (`hub.ringbudget`, `Store._plan`)."""

import numpy as np
import pytest
from test_hub_job import assert_windows_equal, header, identity

from rankscope.collector import schema
from rankscope.hub import replay
from rankscope.hub.intake import Intake
from rankscope.hub.recording import RecordingWriter
from rankscope.hub.ringbudget import RingClaim, plan
from rankscope.hub.store import Store

T0 = 1_800_000_000_000_000_000
STEP_NS = 1_000_000_000
GAP_NS = 3_600 * 10**9  # an hour between runs: the older one is idle


def hello(run: str, world: int, t0: int) -> list[bytes]:
    groups = [{"id": 0, "name": "world", "ranks": list(range(world)), "backend": "gloo"}]
    out = []
    for r in range(world):
        h = header(run, r)
        out.append(schema.hello_message(h, identity(r, world), t_start_ns=t0))
        out.append(schema.groups_message(h, groups))
    return out


def steps(run: str, world: int, first: int, n: int, t0: int) -> list[bytes]:
    """One message per rank and step, each with a phase and an all-reduce over all ranks;
    rank ``r`` enters ``r`` µs late so every instance has a known last arriver."""
    out = []
    for s in range(first, first + n):
        start = t0 + s * STEP_NS
        for r in range(world):
            st = schema.empty_table("steps", 1)
            st["step"][:] = s
            st["t_start"][:] = start
            st["t_end"][:] = start + STEP_NS // 2 + 1000 * r
            st["tokens"][:] = 100 + s
            ph = {
                "step": [s],
                "phase": [schema.PHASES.index("forward")],
                "t0": [start],
                "t1": [start + 10 * s + 5],
            }
            co = schema.empty_table("colls", 1)
            co["step"][:] = s
            co["group"][:] = 0
            co["seq"][:] = s
            co["op"][:] = schema.OP_INDEX["all_reduce"]
            co["nbytes"][:] = 1 << 20
            co["t_enter"][:] = start + 1_000_000 + 1000 * r
            co["t_exit"][:] = start + 2_000_000 + 1000 * world
            out.append(schema.steps_message(header(run, r), st, phases=ph, colls=co))
    return out


def feed(intake: Intake, msgs: list[bytes]) -> None:
    for m in msgs:
        assert intake.feed(m)


def test_plan_floors_water_fills_active_runs_then_keeps_idle_ones() -> None:
    big = RingClaim(world=100, steps=0, want=50, floor=4, active=True, last_ns=10)
    small = RingClaim(world=2, steps=0, want=30, floor=30, active=True, last_ns=10)
    idle = RingClaim(world=100, steps=40, want=50, floor=4, active=False, last_ns=1)
    older = RingClaim(world=100, steps=40, want=50, floor=4, active=False, last_ns=0)
    # The small run takes all it wants, the large ones split the rest evenly.
    assert plan([big, small, big], 5_060) == [25, 30, 25]
    # Alone, an active run takes all it wants; idle runs keep what is left, newest first.
    assert plan([idle, big, older], 6_000) == [6, 50, 4]
    assert plan([idle, big, older], 10_000) == [40, 50, 10]
    # Floors hold even when they alone exceed the budget.
    assert plan([big, idle], 100) == [4, 4]
    with pytest.raises(ValueError, match="floor"):
        plan([RingClaim(world=1, steps=0, want=2, floor=3, active=True, last_ns=0)], 10)


def ring_budget(store: Store) -> int:
    cells = store.ring_cells()
    # The grids behind the count: 93 bytes a cell, 8 more for each work, memory and phase
    # grid (here tokens and forward, once the run has steps), 9 a slot.
    for rid, n in cells.items():
        run = store.run_state(rid)
        extra = len(run.work) + len(run.memory) + len(run.phases)
        assert extra == (2 if run.max_step is not None else 0)
        assert store.ring_nbytes()[rid] == n * (93 + 8 * extra) + 9 * run.H
    return sum(cells.values())


def test_an_idle_run_shrinks_to_its_floor_and_the_active_one_keeps_its_size() -> None:
    world = 4
    store = Store(history_steps=40, max_cells=224, floor_cells=32, idle_s=60, raw_steps=100)
    intake = Intake(store)
    feed(intake, hello("base", world, T0) + steps("base", world, 0, 50, T0))
    store.settle()
    # Alone, the baseline run keeps all it asks for (history_steps).
    assert store.run_state("base").H == 40
    before = store.window("base", last=16)

    t1 = T0 + GAP_NS
    feed(intake, hello("live", world, t1))
    # The baseline has been idle an hour: it gives up its ring down to the floor (16 steps,
    # the least any ring keeps) and the new run gets what it would get alone.
    assert store.run_state("base").H == 16
    assert store.run_state("live").H == 40
    assert ring_budget(store) <= 224
    feed(intake, steps("live", world, 0, 60, t1))
    store.settle()
    assert store.run_state("live").H == 40
    assert store.run_state("base").H == 16
    assert ring_budget(store) <= 224

    # The newest steps of both runs survive, exactly as they were.
    base = store.window("base")
    assert base.steps.tolist() == list(range(34, 50))
    assert_windows_equal(base, before)
    assert (base.instances.last_rank == world - 1).all() and len(base.instances) == 16
    assert base.coll["times_last"][world - 1].tolist() == [1.0] * 16
    live = store.window("live")
    assert live.steps.tolist() == list(range(20, 60))
    assert live.phase_ns["forward"][0].tolist() == [10.0 * s + 5 for s in range(20, 60)]
    # Lifetime totals still count every step of the shrunk run.
    totals = store.totals("base")
    assert totals.steps.tolist() == list(range(50))
    assert (totals.ranks_reporting == world).all()
    assert totals.times_last[world - 1] == 50


def test_two_active_runs_share_the_budget_and_the_survivor_grows_back() -> None:
    world = 4
    store = Store(history_steps=30, max_cells=200, floor_cells=32, idle_s=60)
    intake = Intake(store)
    feed(intake, hello("a", world, T0) + steps("a", world, 0, 40, T0))
    feed(intake, hello("b", world, T0 + 40 * STEP_NS))  # starts while "a" still runs
    # Both active: an even split of the 200 cells, 25 steps each.
    assert (store.run_state("a").H, store.run_state("b").H) == (25, 25)
    assert store.window("a").steps.tolist() == list(range(15, 40))
    feed(intake, steps("b", world, 40, 20, T0))
    t_late = T0 + 60 * STEP_NS + GAP_NS
    feed(intake, steps("b", world, 60, 10, t_late - 60 * STEP_NS))
    store.settle()
    # "a" idle for an hour of "b"'s steps: "b" grows to all it wants (30 steps), "a" keeps
    # what is left above its floor of 16: (200 - 4 × 30) / 4 = 20 steps.
    assert store.run_state("a").H == 20
    assert store.run_state("b").H == 30
    assert ring_budget(store) <= 200
    assert store.window("a").steps.tolist() == list(range(20, 40))
    # "b" grew after holding 25 steps: its 25 newest then, and everything after.
    assert store.window("b").steps.tolist() == list(range(45, 70))
    feed(intake, steps("b", world, 70, 10, t_late - 60 * STEP_NS))
    assert store.window("b").steps.tolist() == list(range(50, 80))


def test_a_small_rerun_takes_little_and_a_third_run_never_breaks_the_budget() -> None:
    store = Store(history_steps=30, max_cells=500, floor_cells=32, idle_s=60)
    intake = Intake(store)
    feed(intake, hello("full", 16, T0) + steps("full", 16, 0, 30, T0))
    assert store.run_state("full").H == 30
    feed(intake, hello("rerun", 1, T0 + 30 * STEP_NS) + steps("rerun", 1, 0, 40, T0))
    # The rerun keeps all 30 steps it wants; the full run gives up just the cells it needs.
    assert store.run_state("rerun").H == 30
    assert store.run_state("full").H == 29
    feed(intake, hello("other", 8, T0 + GAP_NS) + steps("other", 8, 0, 5, T0 + GAP_NS))
    store.settle()
    assert sum(store.ring_cells().values()) <= 500
    assert store.run_state("full").H == 16  # idle: its floor (at least 16 steps)
    assert store.run_state("rerun").H == 30  # idle, but its 30 cells are its floor
    assert store.run_state("other").H == (500 - 16 * 16 - 30) // 8
    assert [(s.run, s.ring_steps) for s in store.runs()] == [
        ("full", 16),
        ("rerun", 30),
        ("other", 26),
    ]
    assert store.window("full").steps.tolist() == list(range(14, 30))


def test_the_recording_keeps_every_step_of_a_shrunk_run(tmp_path) -> None:
    world = 2
    store = Store(history_steps=30, max_cells=100, floor_cells=16, idle_s=60)
    writer = RecordingWriter(tmp_path)
    intake = Intake(store, writer)
    feed(intake, hello("base", world, T0) + steps("base", world, 0, 40, T0))
    feed(intake, hello("live", world, T0 + GAP_NS) + steps("live", world, 0, 40, T0 + GAP_NS))
    store.settle()
    writer.close()
    assert store.window("base").steps.tolist() == list(range(20, 40))
    whole = replay.load(tmp_path, history_steps=100, max_cells=10_000)
    assert whole.window("base").steps.tolist() == list(range(40))
    assert whole.window("live").steps.tolist() == list(range(40))
    # A replay with the live hub's budget plans the same rings as the live hub did.
    again = replay.load(tmp_path, history_steps=30, max_cells=100, floor_cells=16, idle_s=60)
    assert again.ring_cells() == store.ring_cells()
    assert_windows_equal(again.window("base"), store.window("base"), skip=("health",))


def test_resize_keeps_the_newest_steps_of_a_run_with_open_instances() -> None:
    world = 3
    store = Store(history_steps=20, raw_steps=100)
    intake = Intake(store)
    msgs = steps("r", world, 0, 12, T0)
    # Rank 2 has not sent its last two steps: their instances are still open.
    feed(intake, hello("r", world, T0) + [m for i, m in enumerate(msgs) if i < 30 or i % 3 != 2])
    reference = store.window("r", last=6)
    run = store.run_state("r")
    run.resize(6)
    assert run.H == 6
    assert_windows_equal(store.window("r"), reference)
    run.resize(9)  # room for three more steps; the six kept stay as they were
    assert_windows_equal(store.window("r"), reference)
    feed(intake, [m for i, m in enumerate(msgs) if i >= 30 and i % 3 == 2])
    feed(intake, steps("r", world, 12, 3, T0))
    w = store.window("r")
    assert w.steps.tolist() == list(range(6, 15))
    assert (w.instances.n_arrived == world).all()
    assert np.isfinite(w.coll["times_last"]).all()
    with pytest.raises(ValueError, match="at least one"):
        run.resize(0)


def test_bad_budget_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="max_cells"):
        Store(max_cells=0)
    with pytest.raises(ValueError, match="idle_s"):
        Store(idle_s=-1)


def test_a_run_the_view_shows_keeps_its_history_while_a_newer_one_streams() -> None:
    world = 4
    store = Store(history_steps=40, max_cells=224, floor_cells=32, idle_s=60, raw_steps=100)
    intake = Intake(store)
    feed(intake, hello("old", world, T0) + steps("old", world, 0, 50, T0))
    store.settle()
    store.watch("old")  # the view opens the finished run
    t1 = T0 + GAP_NS
    feed(intake, hello("new", world, t1) + steps("new", world, 0, 60, t1))
    store.settle()
    # Watched, the old run is planned as an active one: the two share the budget instead
    # of the old one dropping to its floor of 16 steps.
    assert store.run_state("old").H > 16
    assert ring_budget(store) <= 224
    assert store.window("old").steps.tolist()[-1] == 49


def test_the_views_sampler_marks_the_run_it_shows() -> None:
    from rankscope.tui.sources import StoreSource, sample

    store = Store(history_steps=40, max_cells=224, floor_cells=32, idle_s=60)
    intake = Intake(store)
    feed(intake, hello("a", 4, T0) + steps("a", 4, 0, 5, T0))
    feed(intake, hello("b", 4, T0) + steps("b", 4, 0, 5, T0))
    store.settle()
    assert sample(StoreSource(store, "test"), "a", 16).window is not None
    assert set(store._watched) == {"a"}


def test_the_instance_budget_is_shared_as_the_ring_cells_are() -> None:
    world = 4
    store = Store(history_steps=40, max_cells=224, floor_cells=32, idle_s=60, max_instance_rows=24)
    intake = Intake(store)
    feed(intake, hello("base", world, T0) + steps("base", world, 0, 50, T0))
    store.settle()
    base = store.run_state("base")
    # Alone, the baseline run holds the whole budget: its newest steps' instances.
    assert 12 <= len(base.instances) <= 24
    assert store.window("base").instances.step.max() == 49

    t1 = T0 + GAP_NS
    feed(intake, hello("live", world, t1))
    # Idle at its floor (16 of the 224 cells' steps, 64 cells against the new run's 160),
    # the baseline keeps its share of the budget, 24 x 64 / 224: the newest of its steps.
    assert base.max_instance_rows == 24 * 64 // 224
    assert 0 < len(base.instances) <= 6
    assert store.window("base").instances.step.min() >= 44
    feed(intake, steps("live", world, 0, 60, t1))
    store.settle()
    live = store.run_state("live")
    assert live.max_instance_rows == 24 * 160 // 224
    assert 0 < len(live.instances) <= 17
    assert len(live.instances) + len(base.instances) <= 24
    assert store.window("live").instances.step.max() == 59
    # What was dropped is counted; the sums of every instance stay in the rings.
    assert live.instances_dropped > 0
    w = store.window("live")
    assert w.coll["times_last"][world - 1].tolist() == [1.0] * 40


def test_a_table_bound_lower_gives_its_memory_back() -> None:
    from rankscope.hub.columns import Columns

    t = Columns({"a": np.int64}, 16, limit=100_000)
    t.append({"a": np.arange(90_000)}, 90_000)
    t.keep(np.arange(90_000) >= 89_000)  # a thousand rows left in a large buffer
    big = t.capacity
    t.fit(2_000)
    assert t.capacity == 2_500 < big and t.limit == 2_000
    assert t.view()["a"].tolist() == list(range(89_000, 90_000))
    t.fit(100)  # never below the rows held
    assert t.capacity == 1_000 and len(t) == 1_000
