"""The live store and the validation path, fed through `Intake` (no sockets)."""

import time

import msgpack
import numpy as np
import pytest
from test_hub_job import BASE, STEP_NS, assert_windows_equal, header, identity, job

from rankscope.collector import schema
from rankscope.diagnosis.arrivals import build_window
from rankscope.hub.intake import Intake
from rankscope.hub.store import Store
from rankscope.hub.validate import Limits


def fed(j, **kw) -> tuple[Store, Intake]:
    store = Store(**kw)
    intake = Intake(store)
    for m in j.messages:
        intake.feed(m)
    return store, intake


def reference(j, **kw):
    return build_window(
        job=j.job,
        run=j.run,
        identities=j.identities,
        groups=j.groups,
        phase_names=["mine"],
        manifest={"torch": "2.13", "rank": 0},
        **j.raw,
        **kw,
    )


def test_store_window_equals_build_window_on_the_same_rows() -> None:
    j = job(world=4, steps=6, slow=2)
    store, _ = fed(j, raw_steps=100)
    w = store.window(j.run)
    assert_windows_equal(w, reference(j), skip=("health", "clock_error_ns"))
    assert w.clock_error_ns.tolist() == [1000.0, 1001.0, 1002.0, 1003.0]
    # The delayed rank (in both groups) is the last arriver of every collective.
    assert (w.instances.last_rank == 2).all()
    assert w.coll["times_last"][2].sum() == len(w.instances) == 6 * 4
    assert store.health["rejects"] == {}


def test_instances_beyond_the_bound_go_oldest_first_and_their_sums_stay() -> None:
    j = job(world=4, steps=6, slow=2)
    full, _ = fed(j)
    capped, _ = fed(j, max_instance_rows=10)
    capped.settle()
    a, b = full.window(j.run), capped.window(j.run)
    assert len(a.instances) == 24 and 0 < len(b.instances) <= 10
    # Whole steps, the newest: every instance of the steps kept, none of the others.
    kept_steps = set(b.instances.step.tolist())
    assert min(kept_steps) > max(set(a.instances.step.tolist()) - kept_steps)

    def keys(t):  # type: ignore[no-untyped-def]
        return sorted(zip(t.step.tolist(), t.group.tolist(), t.seq.tolist(), strict=True))

    assert keys(b.instances) == [k for k in keys(a.instances) if k[0] in kept_steps]
    for name in a.coll:  # every instance's sums are in the ring, dropped or not
        np.testing.assert_array_equal(a.coll[name], b.coll[name], err_msg=name)
    assert capped.window(j.run).health["instances_dropped"] == 24 - len(b.instances)
    assert "instances_dropped" not in a.health
    with pytest.raises(ValueError, match="max_instance_rows"):
        Store(max_instance_rows=0)


def test_arrival_order_of_messages_does_not_matter() -> None:
    j = job(world=4, steps=5, slow=1, seed=3)
    a, _ = fed(j)
    rng = np.random.default_rng(0)
    head = [m for m in j.messages if schema.decode(m).kind in ("hello", "groups")]
    rest = [m for m in j.messages if m not in head]
    b = Store()
    intake = Intake(b)
    for m in head + [rest[i] for i in rng.permutation(len(rest))]:
        assert intake.feed(m)
    assert_windows_equal(a.window(j.run), b.window(j.run))


def test_window_last_and_history_ring() -> None:
    j = job(world=2, steps=10, slow=1)
    store, _ = fed(j, history_steps=4, raw_steps=2)
    w = store.window(j.run)
    assert w.steps.tolist() == [6, 7, 8, 9]
    assert_windows_equal(
        store.window(j.run, last=3), reference(j, last=3), skip=("health", "clock_error_ns", "rows")
    )
    assert store.window(j.run, last=3).rows.step.tolist() == [8] * 8 + [9] * 8
    totals = store.totals(j.run)
    assert totals.steps.tolist() == list(range(10))
    assert (totals.ranks_reporting == 2).all()
    # Lifetime arrivals cover evicted steps too.
    assert totals.times_last[1] == 10 * 4 and totals.times_last[0] == 0
    # A step older than the ring is dropped and counted.
    st = schema.empty_table("steps", 1)
    st["step"][:] = 2
    st["t_start"][:] = BASE
    st["t_end"][:] = BASE + 10
    Intake(store).feed(schema.steps_message(header(j.run, 0), st))
    assert store.health["late_steps"] == 1
    s = store.runs()[0]
    assert (s.first_step, s.last_step, s.steps_complete, s.n_ranks_seen) == (0, 9, 4, 2)
    assert s.hosts == ("node0", "node1") and s.world_size == 2


def steps_msg(run: str, rank: int, steps: list[int], inc: int = 0, **tables) -> bytes:
    st = schema.empty_table("steps", len(steps))
    st["step"][:] = steps
    st["t_start"][:] = [BASE + s * STEP_NS for s in steps]
    st["t_end"][:] = [BASE + s * STEP_NS + 1000 for s in steps]
    return schema.steps_message(header(run, rank, inc=inc), st, **tables)


def test_every_reject_reason_is_counted_and_valid_data_is_kept() -> None:
    j = job(world=2, steps=3, slow=1)
    store, intake = fed(j)
    before = store.window(j.run)
    bad = {
        "bad_msgpack": b"\xc1\xc1garbage",
        "bad_version": msgpack.packb({**header(j.run, 0), "v": 9, "kind": "stats", "stats": {}}),
        "unknown_rank": steps_msg("other-run", 0, [1]),
        "rank_out_of_range": schema.groups_message(header(j.run, 0), [{"id": 5, "ranks": [0, 7]}]),
        "world_size_mismatch": schema.hello_message(header(j.run, 1), identity(1, 3)),
        "run_mismatch": schema.hello_message(
            {**header(j.run, 1), "job": "another"}, identity(1, 2)
        ),
        "bad_phase": steps_msg(
            j.run,
            0,
            [50],
            phases={"step": [50], "phase": [99], "t0": [BASE], "t1": [BASE + 1]},
        ),
        "bad_time": steps_msg(
            j.run,
            0,
            [51],
            colls={**schema.empty_table("colls", 1), "step": [51], "t_enter": [schema.NO_TIME]},
        ),
        "bad_stats": schema.encode({**header(j.run, 0), "kind": "stats", "stats": [1, 2]}),
    }
    for reason, data in bad.items():
        assert not intake.feed(data), reason
    # A rank whose hello never came: unknown, even in a known run.
    hello3 = schema.hello_message(header("r3", 0), identity(0, 4))
    assert intake.feed(hello3)
    assert not intake.feed(steps_msg("r3", 1, [0]))
    rejects = store.health["rejects"]
    for reason in bad:
        assert rejects.get(reason, 0) >= 1, (reason, rejects)
    assert rejects["unknown_rank"] == 2
    assert_windows_equal(store.window(j.run), before)
    # Valid data after the bad ones is still taken.
    assert intake.feed(steps_msg(j.run, 0, [3]))
    assert store.window(j.run).steps.tolist() == [0, 1, 2, 3]


def test_too_large_reaches_its_reason_through_decode() -> None:
    store = Store()
    Intake(store).feed(b"\x00" * (schema.MAX_MESSAGE_BYTES + 1))
    assert store.health["rejects"] == {"too_large": 1}


def test_duplicate_steps_are_dropped_with_their_rows_and_counted() -> None:
    j = job(world=2, steps=3, slow=1)
    store, intake = fed(j)
    before = store.window(j.run)
    # The same steps again: every step of the message is a duplicate.
    assert not intake.feed(j.steps[0][1])
    # A message repeating step 2 and adding step 3 keeps step 3 only.
    co = schema.empty_table("colls", 2)
    co["step"][:] = [2, 3]
    co["t_enter"][:] = BASE
    co["t_exit"][:] = BASE + 5
    co["group"][:] = 9
    assert intake.feed(steps_msg(j.run, 0, [2, 3, 3], colls=co))
    assert store.health["rejects"]["duplicate_step"] == 1 + 2
    w = store.window(j.run)
    assert w.steps.tolist() == [0, 1, 2, 3]
    for name in before.coll:
        np.testing.assert_array_equal(w.coll[name][:, :3], before.coll[name], err_msg=name)
    assert w.coll["n"][0, 3] == 1.0  # the step-3 row was kept, the step-2 row dropped


def test_out_of_order_steps_are_sorted() -> None:
    store = Store()
    intake = Intake(store)
    intake.feed(schema.hello_message(header("r", 0), identity(0, 1)))
    for s in (5, 3, 4, 1):
        assert intake.feed(steps_msg("r", 0, [s]))
    w = store.window("r")
    assert w.steps.tolist() == [1, 3, 4, 5]
    assert np.all(np.diff(w.t_start[0]) > 0)
    assert store.health["rejects"] == {}


def test_incomplete_instances_show_then_close_as_incomplete() -> None:
    j = job(world=3, steps=40, colls=1, slow=0, async_buckets=False)
    store = Store(stale_steps=5)
    intake = Intake(store)
    for i, m in enumerate(j.messages):
        d = schema.decode(m)
        if d.kind == "steps" and d.header["rank"] == 2 and d.tables["steps"]["step"][0] >= 30:
            continue  # rank 2 stops at step 30
        # The receive clock advances 10 s a message: rank 2 is soon silent for longer
        # than the store's lag hold (`store.LAG_HOLD_S`).
        intake.feed(m, (i + 1) * 10_000_000_000)
    w = store.window(j.run)
    inst = w.instances
    world = inst.group == 0
    late = inst.step >= 30
    assert (inst.n_arrived[world & late] == 2).all()
    assert (inst.n_members[world & late] == 3).all()
    assert (inst.n_arrived[world & ~late] == 3).all()
    totals = store.totals(j.run)
    # Steps 30..34 are closed (more than 5 steps behind step 39); 35..39 stay pending.
    assert totals.instances_incomplete == 5
    assert np.isnan(w.coll["n"][2, -1]) and w.coll["n"][0, -1] == 1.0
    assert w.coll["times_last"][:, -1].tolist()[:2] == [0.0, 0.0]


def test_restarted_rank_replaces_its_steps() -> None:
    store = Store()
    intake = Intake(store)
    intake.feed(schema.hello_message(header("r", 0), identity(0, 1)))
    assert intake.feed(steps_msg("r", 0, [1, 2]))
    # Data of incarnation 1 before its hello is unknown; after it, incarnation 0 is stale.
    assert not intake.feed(steps_msg("r", 0, [2], inc=1))
    # The restarted process says hello once the old one has been silent for a while.
    later = time.time_ns() + int(Limits().identity_quiet_s * 1e9) + 1
    assert intake.feed(schema.hello_message(header("r", 0, inc=1), identity(0, 1)), later)
    assert not intake.feed(steps_msg("r", 0, [3], inc=0))
    st = schema.empty_table("steps", 1)
    st["step"][:] = 2
    st["t_start"][:] = BASE + 7 * STEP_NS
    st["t_end"][:] = BASE + 7 * STEP_NS + 99
    assert intake.feed(schema.steps_message(header("r", 0, inc=1), st))
    w = store.window("r")
    assert w.step_ns[0].tolist() == [1000.0, 99.0]
    assert w.ranks.incarnation.tolist() == [1]
    assert store.health["rejects"] == {"unknown_rank": 1, "stale_incarnation": 1}


def test_health_reports_collector_drops_and_clock_error() -> None:
    j = job(world=3, steps=2, slow=1)
    store, _ = fed(j)
    h = store.health
    assert h["drops"] == {"batches": 0 + 1 + 2, "events": 0 + 10 + 20}
    assert h["clock_error_ns"] == {j.run: {0: 1000.0, 1: 1001.0, 2: 1002.0}}
    assert h["messages"] == len(j.messages)
    assert h["events"] == int(j.raw["colls"]["rank"].shape[0])


def test_unknown_run_names_the_known_ones() -> None:
    store, _ = fed(job(world=2, steps=1, slow=1))
    with pytest.raises(KeyError, match="r1"):
        store.window("nope")
    with pytest.raises(KeyError, match="no run"):
        Store().window()


def test_instances_wait_for_a_late_groups_message() -> None:
    j = job(world=2, steps=3, slow=1)
    store = Store()
    intake = Intake(store)
    groups = [m for m in j.messages if schema.decode(m).kind == "groups"]
    for m in j.messages:
        if m not in groups:
            intake.feed(m)
    w = store.window(j.run)
    assert (w.instances.n_members == -1).all() and not w.coll["times_last"].any()
    for m in groups:
        intake.feed(m)
    w = store.window(j.run)
    assert (w.instances.n_arrived == w.instances.n_members).all()
    assert w.coll["times_last"][1].sum() == len(w.instances)
    assert_windows_equal(w, fed(j)[0].window(j.run))
