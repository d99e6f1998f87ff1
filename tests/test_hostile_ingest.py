"""Hostile input at ingest: whatever a sender claims, the hub never raises, every message is
either ingested with values every reader can use or rejected with a counted reason, and
memory stays within the store's budgets (`hub.validate.Limits`, `Store.admit`)."""

from __future__ import annotations

import contextlib
import gc
import io
import time
import tracemalloc
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_hub_job import BASE, STEP_NS, header, identity, job

from rankscope.collector import schema
from rankscope.diagnosis.assemble import rank_info
from rankscope.hub.intake import Intake
from rankscope.hub.server import Hub
from rankscope.hub.store import MIN_RING_STEPS, Store
from rankscope.hub.validate import Limits

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


def hello(run="r1", rank=0, world=4, inc=0, job_="j", manifest=None, **ident) -> bytes:
    return schema.hello_message(
        header(run, rank, job_, inc=inc), {**identity(rank, world), **ident}, manifest=manifest
    )


def steps(run="r1", rank=0, ss=(0,), inc=0, colls=True, **override) -> bytes:
    """A steps message of ``ss`` steps, one all-reduce per step; ``override`` sets columns
    (``colls.NAME`` or ``steps.NAME``)."""
    n = len(ss)
    st_ = schema.empty_table("steps", n)
    st_["step"][:] = ss
    st_["t_start"][:] = [BASE + s * STEP_NS for s in ss]
    st_["t_end"][:] = [BASE + s * STEP_NS + STEP_NS // 2 for s in ss]
    co = schema.empty_table("colls", n)
    co["step"][:] = ss
    co["op"][:] = schema.OP_INDEX["all_reduce"]
    co["group"][:] = 0
    co["seq"][:] = ss
    co["nbytes"][:] = 1 << 20
    co["t_enter"][:] = [BASE + s * STEP_NS + 1000 * (rank + 1) for s in ss]
    co["t_exit"][:] = [BASE + s * STEP_NS + 100_000 for s in ss]
    co["flags"][:] = 0
    for key, value in override.items():
        table, col = key.split("__")
        (st_ if table == "steps" else co)[col][:] = value
    return schema.steps_message(header(run, rank, inc=inc), st_, colls=co if colls else None)


def groups(run="r1", world=4) -> bytes:
    return schema.groups_message(
        header(run, 0), [{"id": 0, "name": "world", "ranks": list(range(world))}]
    )


def started(world=4, **store_kw) -> tuple[Store, Intake]:
    store = Store(**store_kw)
    intake = Intake(store)
    for r in range(world):
        assert intake.feed(hello(rank=r, world=world))
    assert intake.feed(groups(world=world))
    return store, intake


def rejects(store: Store) -> dict[str, int]:
    return dict(store.health["rejects"])


def raw_hello(identity_: dict, **top) -> bytes:
    """A hello packed by hand: no client-side encoding gets in the way of a hostile field."""
    msg = {**header("r1", identity_.get("rank", 0)), "kind": "hello", "v": schema.SCHEMA_VERSION}
    msg.update(identity=identity_, scope="full", parent_run=None, manifest={}, t_start_ns=None)
    msg.update(top)
    return msgpack.packb(msg, use_bin_type=True)


# -- identity ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("mesh", {"dp": "0"}, "bad_type"),
        ("mesh", {"tp": 2**31}, "bad_identity"),
        ("mesh", {"pp": None}, "bad_type"),
        ("mesh", {f"d{i}": 0 for i in range(40)}, "bad_identity"),
        ("rail", 2**32, "bad_identity"),
        ("gpu_index", 2**40, "bad_identity"),
        ("node_rank", 2**31, "bad_identity"),
        ("node_rank", -7, "bad_identity"),
        ("pid", -1, "bad_identity"),
        ("local_rank", -1, "bad_identity"),
        ("shard", INT64_MIN, "bad_identity"),
        ("host", "h" * 10_000, "bad_identity"),
        ("rack", 7, "bad_type"),
        ("rail", 1.5, "bad_type"),
        ("rail", True, "bad_type"),
    ],
)
def test_a_hello_field_a_reader_cannot_hold_is_rejected_and_named(field, value, reason) -> None:
    store = Store()
    intake = Intake(store)
    ident = {**identity(0, 4), field: value}
    assert not intake.feed(raw_hello(ident))
    assert rejects(store) == {reason: 1}
    assert store.run_ids() == []  # nothing of it is kept


def test_header_and_world_extremes_are_rejected() -> None:
    store = Store()
    intake = Intake(store)
    assert not intake.feed(raw_hello({**identity(0, 4), "world_size": 2**31}))
    assert not intake.feed(hello(inc=2**31))
    big = {**header("r1", 2**31), "kind": "steps", "v": 1, "tables": {}}
    assert not intake.feed(msgpack.packb(big))
    assert not intake.feed(hello(run="x" * 1000))
    got = rejects(store)
    assert got == {"bad_identity": 1, "bad_header": 3}, got


def test_unknown_identity_fields_are_dropped_and_readers_build_the_rank_table() -> None:
    store = Store()
    intake = Intake(store)
    assert intake.feed(raw_hello({**identity(0, 1), "evil": {"nested": [1, 2]}, "mesh": {}}))
    run = store.run_state("r1")
    assert "evil" not in run.identities[0]
    assert store.window("r1").ranks.world_size == 1


def test_a_spoofed_hello_cannot_make_the_real_ranks_steps_stale() -> None:
    store, intake = started(world=2)
    t = time.time_ns()
    assert intake.feed(steps(rank=0, ss=[0]), t)
    # A huge incarnation: refused whatever the timing.
    assert not intake.feed(hello(rank=0, world=2, inc=10**6), t + 1)
    # One more incarnation from another host while the real rank is live: refused.
    assert not intake.feed(hello(rank=0, world=2, inc=1, host="attacker", pid=4), t + 2)
    # The same incarnation from another process: refused too.
    assert not intake.feed(hello(rank=0, world=2, pid=99), t + 3)
    assert rejects(store) == {"bad_incarnation": 1, "identity_conflict": 2}
    # The real rank goes on: its steps are not stale.
    assert intake.feed(steps(rank=0, ss=[1]), t + 4)
    # Its own hello again (collectors resend every 30 s) is fine.
    assert intake.feed(hello(rank=0, world=2), t + 5)
    assert int(store.run_state("r1").incarnation[0]) == 0
    # A restart: the old process went silent, the new one says hello after the quiet time.
    quiet = int(Limits().identity_quiet_s * 1e9)
    later = t + 4 + quiet + 1
    assert intake.feed(hello(rank=0, world=2, inc=1, pid=5000), later)
    assert int(store.run_state("r1").incarnation[0]) == 1
    assert not intake.feed(steps(rank=0, ss=[2]), later + 1)  # the old incarnation is stale
    assert rejects(store)["stale_incarnation"] == 1


def test_a_new_rank_cannot_start_far_above_the_runs_incarnations() -> None:
    step = Limits().max_incarnation_step
    store = Store()
    intake = Intake(store)
    assert intake.feed(hello(rank=0, world=4, inc=3))
    # A rank new to the run may start up to a step above the run's latest incarnation.
    assert intake.feed(hello(rank=1, world=4, inc=3 + step))
    assert not intake.feed(hello(rank=2, world=4, inc=3 + 2 * step + 1))
    assert rejects(store) == {"bad_incarnation": 1}


# -- memory ------------------------------------------------------------------------------


def test_a_hello_claiming_millions_of_ranks_costs_nothing() -> None:
    store = Store()
    intake = Intake(store)
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        assert not intake.feed(hello(world=4_000_000))
        now, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert rejects(store) == {"world_too_large": 1}
    assert now - base < 1 << 20
    # Under the limit but over what the store's budget can floor: refused as well.
    small = Store(max_cells=64 * MIN_RING_STEPS)
    assert not Intake(small).feed(hello(world=65))
    assert rejects(small) == {"world_too_large": 1}


def test_runs_are_bounded_per_job_and_in_total() -> None:
    limits = Limits(max_runs=10, max_runs_per_job=4)
    store = Store()
    intake = Intake(store, limits=limits)
    for i in range(6):
        intake.feed(hello(run=f"a{i}", job_="a"))
    for i in range(20):
        intake.feed(hello(run=f"x{i}", job_=f"job{i}"))
    assert len(store.run_ids()) == 10
    assert sum(1 for r in store.runs() if r.job == "a") == 4
    assert rejects(store) == {"too_many_runs": 2 + 14}


def test_the_cell_budget_covers_every_runs_floor() -> None:
    store = Store(max_cells=100_000, floor_cells=16_384)
    intake = Intake(store)
    admitted = 0
    for i in range(50):
        admitted += intake.feed(hello(run=f"r{i}", world=1024))
    floors = sum(store.floor_cells_of(r.world_size) for r in store.runs())
    assert admitted == len(store.run_ids()) == 100_000 // (1024 * 16)
    assert floors <= store.max_cells
    assert sum(store.ring_cells().values()) <= store.max_cells
    assert rejects(store) == {"store_full": 50 - admitted}


def test_manifests_are_bounded_and_identical_ones_are_held_once() -> None:
    store = Store()
    intake = Intake(store, limits=Limits(max_identity_bytes=200_000))
    huge = {"env": {f"K{i}": "v" * 100 for i in range(300_000)}}  # ~30 MB packed
    sent = [hello(rank=r, manifest=huge) for r in range(3)]
    gc.collect()
    tracemalloc.start()
    try:
        for m in sent:
            assert not intake.feed(m)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert rejects(store) == {"too_large": 3}
    # Measured before decoding: no Python object of the manifest was ever made.
    assert peak < 2 * len(sent[0])
    same = {"env": {f"K{i}": "v" * 100 for i in range(1000)}}  # ~100 KB
    for r in range(4):
        assert intake.feed(hello(rank=r, manifest=same))
    run = store.run_state("r1")
    assert len(msgpack.packb(same)) < run.identity_bytes < 2 * len(msgpack.packb(same))
    assert store.window("r1").manifest == same
    # Distinct manifests fill the identity budget, then are refused.
    other = Intake(store, limits=Limits(max_identity_bytes=200_000))
    assert not other.feed(hello(run="r2", manifest={**same, "x": 1}))
    assert rejects(store)["store_full"] == 1
    assert store.identity_bytes() <= 200_000


def test_an_oversized_message_is_counted() -> None:
    store, _ = started()
    intake = Intake(store, limits=Limits(max_message_bytes=4096))
    big = steps(ss=list(range(200)))
    assert len(big) > 4096
    assert not intake.feed(big)
    assert not Intake(store).feed(b"\x00" * (schema.MAX_MESSAGE_BYTES + 1))
    assert rejects(store) == {"too_large": 2}


# -- values ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ({"colls__nbytes": -5_000_000_000}, "bad_nbytes"),
        ({"colls__t_exit": BASE}, "bad_time"),  # exit before entry
        ({"colls__op": 77}, "bad_op"),
        ({"colls__op": -3}, "bad_op"),
        ({"colls__t_enter": INT64_MAX}, "bad_time"),
        ({"colls__t_exit": INT64_MAX}, "bad_time"),
        ({"colls__t_enter": INT64_MIN}, "bad_time"),
        ({"colls__t_start": INT64_MIN}, "bad_time"),
        ({"colls__t_end": INT64_MAX}, "bad_time"),
        ({"colls__seq": INT64_MIN}, "bad_step"),
        ({"colls__group": -4}, "bad_group"),
        ({"steps__t_end": INT64_MAX}, "bad_time"),
        ({"steps__t_start": INT64_MIN}, "bad_time"),
        ({"steps__t_end": BASE + 10 * 86_400 * 10**9}, "bad_time"),  # a 10-day step
        ({"steps__step": -9}, "bad_step"),
    ],
)
@pytest.mark.parametrize("n", [1, 3])
def test_a_value_that_cannot_be_true_is_rejected(override, reason, n) -> None:
    store, intake = started()
    assert not intake.feed(steps(ss=list(range(n)), **override))
    assert rejects(store) == {reason: 1}
    assert store.runs()[0].last_step is None  # nothing of the message is kept
    assert intake.feed(steps(ss=list(range(n))))  # the sender's next good message is


def test_times_outside_the_window_around_the_hub_clock_are_rejected(tmp_path: Path) -> None:
    from rankscope.hub import replay
    from rankscope.hub.recording import RecordingWriter

    limits = Limits(time_window_s=3600.0)
    store = Store()
    writer = RecordingWriter(tmp_path, flush_s=0.0)
    intake = Intake(store, writer, limits=limits)
    now = BASE + 2 * STEP_NS  # the hub's clock at receipt: the steps' own era
    for r in range(4):
        assert intake.feed(hello(rank=r), now)
    assert intake.feed(steps(ss=[0]), now)
    far = BASE + 2 * 3600 * 10**9
    assert not intake.feed(steps(ss=[1], steps__t_start=far, steps__t_end=far + 1), now)
    assert not intake.feed(steps(ss=[1]), now + 3 * 3600 * 10**9)  # the hub's clock moved on
    assert rejects(store) == {"bad_time": 2}
    writer.close()
    again = replay.load(tmp_path)  # what was recorded replays as accepted
    assert again.health["rejects"] == {}
    assert again.runs()[0].last_step == 0


def test_a_backlog_burst_keeps_complete_steps_complete() -> None:
    world, lag, n = 2, 60, 100
    store, intake = started(world=world)
    t = 0
    for s in range(n):
        t += STEP_NS
        assert intake.feed(steps(rank=0, ss=[s]), t)
        if s < n - lag:
            assert intake.feed(steps(rank=1, ss=[s]), t)
        if s % 5 == 0:
            store.settle()
    assert intake.feed(steps(rank=1, ss=list(range(n - lag, n))), t)  # the sender catches up
    totals = store.totals("r1")
    assert totals.instances_incomplete == 0
    assert totals.instances_complete == n
    assert (totals.ranks_reporting == world).all()


def test_a_rank_that_stops_still_closes_its_peers_instances() -> None:
    store, intake = started(world=2, stale_steps=4)
    t = 0
    for s in range(40):
        t += 10 * 10**9  # 10 s a step: rank 1 is soon silent for longer than the hold
        assert intake.feed(steps(rank=0, ss=[s]), t)
        if s < 10:
            assert intake.feed(steps(rank=1, ss=[s]), t)
        store.settle()
    totals = store.totals("r1")
    assert totals.instances_complete == 10
    assert totals.instances_incomplete == 40 - 10 - 4


# -- property-based: random extreme values ----------------------------------------------

EXTREME_INTS = st.one_of(
    st.integers(-3, 3),
    st.sampled_from(
        [2**31 - 1, 2**31, -(2**31), 2**32, 2**53 + 1, 2**62, INT64_MAX, INT64_MIN, 2**64 - 1]
    ),
    st.integers(INT64_MIN, 2**64 - 1),
)
ANY_VALUE = st.one_of(
    EXTREME_INTS,
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=300),
    st.lists(st.integers(-2, 2), max_size=3),
    st.dictionaries(st.text(max_size=4), EXTREME_INTS, max_size=3),
)
IDENTITY_FIELDS = (*schema.HELLO_REQUIRED, *schema.HELLO_OPTIONAL)


def _reader_safe(store: Store) -> None:
    """What every reader does with a run's identity and window: nothing may raise, and
    every identity integer fits the int32 columns the readers use. A validation or
    ingest bug shows as ``internal_error``: none may occur."""
    assert "internal_error" not in rejects(store), rejects(store)
    for rid in store.run_ids():
        run = store.run_state(rid)
        info = rank_info(run.identities, run.world_size)
        for name in ("node_rank", "local_rank", "gpu_index", "rail", "shard"):
            getattr(info, name)
        for ident in run.identities.values():
            for v in ident.values():
                if isinstance(v, int):
                    assert -1 <= v < 2**31
            for v in (ident.get("mesh") or {}).values():
                assert isinstance(v, int) and -1 <= v < 2**31
        w = store.window(rid)
        store.totals(rid)
        assert np.isfinite(w.t_end[~np.isnan(w.t_end)]).all()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fields=st.dictionaries(st.sampled_from(IDENTITY_FIELDS), ANY_VALUE, max_size=4),
    mesh=st.one_of(
        st.none(), st.dictionaries(st.sampled_from(schema.MESH_DIMS), ANY_VALUE, max_size=3)
    ),
    inc=EXTREME_INTS,
    world=st.one_of(st.integers(1, 8), EXTREME_INTS),
)
def test_random_identities_are_ingested_safely_or_rejected_with_a_count(
    fields, mesh, inc, world
) -> None:
    store = Store(max_cells=1_000_000)
    intake = Intake(store)
    ident = {**identity(0, 8), "world_size": world, **fields}
    if mesh is not None:
        ident["mesh"] = mesh
    top = {**header("r1", 0, inc=0), "kind": "hello", "v": 1, "identity": ident, "inc": inc}
    try:
        data = msgpack.packb(top, use_bin_type=True)
    except (OverflowError, TypeError):  # msgpack cannot carry it: no sender can send it
        return
    accepted = intake.feed(data)
    counted = sum(rejects(store).values())
    assert accepted != (counted == 1), (accepted, rejects(store))
    _reader_safe(store)


COLUMN_VALUES = st.lists(EXTREME_INTS, min_size=1, max_size=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    column=st.sampled_from(
        [
            "colls__t_enter",
            "colls__t_exit",
            "colls__t_start",
            "colls__t_end",
            "colls__nbytes",
            "colls__op",
            "colls__seq",
            "colls__group",
            "colls__step",
            "steps__t_start",
            "steps__t_end",
            "steps__step",
            "steps__tokens",
            "steps__gc_ns",
            "steps__cpu_ns",
        ]
    ),
    values=COLUMN_VALUES,
    n=st.integers(1, 3),
)
# A run whose only step has no start (NO_TIME): its window's origin is its earliest end.
@example(column="steps__t_start", values=[-1], n=1)
def test_random_column_values_are_ingested_safely_or_rejected_with_a_count(
    column, values, n
) -> None:
    table, name = column.split("__")
    dt = schema.TABLES[table][name]
    info = np.iinfo(dt)
    vals = [min(max(v, info.min), info.max) for v in (values * n)[:n]]
    store, intake = started()
    accepted = intake.feed(steps(ss=list(range(n)), **{column: vals}))
    got = rejects(store)
    if not accepted:
        assert sum(got.values()) >= 1
    _reader_safe(store)
    if accepted:
        w = store.window("r1")
        known = w.t_end[~np.isnan(w.t_end)]
        # Times relative to the window's origin stay within a week of it.
        assert (np.abs(known) <= Limits().max_duration_s * 1e9 * 2).all()


# -- memory under the hostile senders ----------------------------------------------------


def test_accounted_memory_stays_within_the_budgets_under_hostile_senders() -> None:
    """Each hostile sender of issue 17, one after the other, against one store: what the
    store holds afterwards stays within its cell and identity budgets, and what Python
    keeps allocated does not grow with what the senders claimed."""
    limits = Limits(max_identity_bytes=8 << 20)
    store = Store(max_cells=2_000_000)
    intake = Intake(store, limits=limits)
    for m in job(world=4, steps=4).messages:
        intake.feed(m)
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        intake.feed(hello(run="huge", world=4_000_000))
        for i in range(300):
            intake.feed(hello(run=f"new{i}", job_=f"j{i % 7}", world=64))
        blob = {"env": {f"K{i}": "v" * 100 for i in range(100_000)}}  # ~10 MB packed
        for r in range(3):
            intake.feed(hello(run="r1", rank=r, manifest=blob))
        for r in range(4):
            intake.feed(steps(run="r1", rank=r, ss=[10], colls__t_exit=INT64_MAX))
        store.settle()
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    ring = sum(store.ring_nbytes().values())
    assert sum(store.ring_cells().values()) <= store.max_cells
    assert store.identity_bytes() <= limits.max_identity_bytes
    # Rings, identities, and an overhead per run: its tables' first blocks (~0.45 MiB
    # measured) and its per-rank arrays.
    per_run = sum((1 << 20) + 128 * r.world_size for r in store.runs())
    assert held - base <= ring + limits.max_identity_bytes + per_run
    got = rejects(store)
    assert got["world_too_large"] == 1 and got["too_large"] == 3 and got["bad_time"] == 4
    # The new runs beyond the budget's floors are refused, counted.
    assert got.get("too_many_runs", 0) + got["store_full"] == 300 - (len(store.run_ids()) - 1)


# -- a hostile stream through a real hub, then every reader ------------------------------


def _cli(argv: list[str]) -> tuple[int, str]:
    from rankscope.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue() + err.getvalue()


def hostile_stream() -> list[bytes]:
    """The operator's hostile messages, after which the valid job goes on."""
    return [
        raw_hello({**identity(1, 4), "mesh": {"dp": "zero"}}),
        raw_hello({**identity(1, 4), "rail": 2**32}),
        raw_hello({**identity(1, 4), "gpu_index": 2**33, "node_rank": -(2**40)}),
        hello(rank=1, inc=10**9),
        hello(rank=1, inc=1, host="spoof"),
        hello(run="huge", world=4_000_000),
        steps(rank=1, ss=[3], colls__nbytes=-1 << 40),
        steps(rank=1, ss=[3], colls__t_exit=BASE),
        steps(rank=1, ss=[3], colls__op=99),
        steps(rank=1, ss=[3], colls__t_exit=INT64_MAX, colls__t_start=INT64_MIN),
        steps(rank=1, ss=[3], steps__t_end=INT64_MAX),
        b"\xc1 not msgpack",
    ]


def test_a_hostile_stream_through_a_real_hub_leaves_every_reader_working(tmp_path) -> None:
    good = job(world=4, steps=6)
    record = tmp_path / "rec"
    ctx = zmq.Context()
    hub = Hub(record_dir=str(record), flush_s=0.01)
    try:
        with hub:
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 2000)
            push.connect(hub.endpoint)
            head = [m for m in good.messages if schema.decode(m).kind in ("hello", "groups")]
            rest = [m for m in good.messages if m not in head]
            sent = [*head, *hostile_stream(), *rest]
            for m in sent:
                push.send(m)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                h = hub.store.health
                if h["messages"] + sum(h["rejects"].values()) >= len(sent):
                    break
                time.sleep(0.02)
            push.close()
        health = hub.store.health
    finally:
        ctx.term()
    assert health["messages"] == len(good.messages)
    assert sum(health["rejects"].values()) == len(hostile_stream())
    # The live store serves every run's series to Prometheus.
    from prometheus_client import generate_latest

    from rankscope.hub.prometheus import make_registry, store_source

    registry, collector = make_registry(store_source(hub.store))
    text = generate_latest(registry).decode()
    assert collector.errors == 0
    assert "rankscope_run_world_size{" in text and 'run="r1"' in text
    p = str(record)
    for argv in (
        ["inspect", p],
        ["inspect", p, "--json"],
        ["diagnose", p, "--steps", "6"],
        ["diagnose", p, "--json", "--steps", "6"],
        ["snapshot", p, "--out", str(tmp_path / "snap"), "--steps", "6"],
        ["export", p, "--csv", str(tmp_path / "csv"), "--perfetto", str(tmp_path / "t.json")],
    ):
        rc, text = _cli(argv)
        assert "Traceback" not in text, (argv, text[-3000:])
        assert rc == 0, (argv, rc, text[-2000:])


def test_a_batch_checks_values_together_and_still_names_each_culprit() -> None:
    """The live receive loop feeds batches (`Intake.feed_many`): a bad message among good
    ones is rejected with its own reason, the others are ingested, as one by one."""
    bad = [
        steps(rank=1, ss=[2], colls__op=99),
        steps(rank=2, ss=[2], colls__t_exit=BASE),
        steps(rank=3, ss=[2], colls__nbytes=-(2**40)),
    ]
    batch = [steps(rank=r, ss=[s]) for s in range(2) for r in range(4)]
    batch[3:3] = bad
    one, i1 = started()
    many, i2 = started()
    accepted = [i1.feed(m, 0) for m in batch]
    assert i2.feed_many(batch, 0) == sum(accepted) == 8
    assert rejects(one) == rejects(many) == {"bad_op": 1, "bad_time": 1, "bad_nbytes": 1}
    assert one.window("r1").steps.tolist() == many.window("r1").steps.tolist() == [0, 1]
    # Large tables are checked message by message.
    big = steps(ss=list(range(600)), colls__t_enter=-5)
    assert i2.feed_many([big, steps(rank=1, ss=[5])], 0) == 1
    assert rejects(many)["bad_time"] == 2


def test_a_batch_with_empty_tables_is_checked_together(caplog: pytest.LogCaptureFixture) -> None:
    """Steps whose collective table is present but empty (a step with no collective yet)
    are plausible: the batch check takes them without falling back, and says nothing."""
    empty = [schema.empty_table("colls", 0)]
    batch = [
        schema.steps_message(
            header("r1", r),
            _one_step(s),
            colls=empty[0],
        )
        for s in range(2)
        for r in range(4)
    ]
    store, intake = started()
    with caplog.at_level("WARNING", logger="rankscope.hub"):
        assert intake.feed_many(batch, 0) == 8
    assert "batch value check failed" not in caplog.text
    assert rejects(store) == {}
    assert store.window("r1").steps.tolist() == [0, 1]


def _one_step(s: int) -> dict:
    st_ = schema.empty_table("steps", 1)
    st_["step"][:] = [s]
    st_["t_start"][:] = [BASE + s * STEP_NS]
    st_["t_end"][:] = [BASE + s * STEP_NS + STEP_NS // 2]
    return st_


def test_a_batch_with_phases_builds_the_store_one_by_one_builds() -> None:
    j = job(world=4, steps=6)
    one, many = Store(), Store()
    i1, i2 = Intake(one), Intake(many)
    for m in j.messages:
        i1.feed(m, 0)
    i2.feed_many(j.messages, 0)
    assert one.health["rejects"] == many.health["rejects"] == {}
    a, b = one.window(j.run), many.window(j.run)
    assert a.steps.tolist() == b.steps.tolist()
    for name in a.phase_ns:
        np.testing.assert_array_equal(a.phase_ns[name], b.phase_ns[name], err_msg=name)
    # A phase code beyond the message's names, in a batch of good messages.
    d = msgpack.unpackb(j.steps[0][-1], raw=False)
    code = np.frombuffer(d["tables"]["phases"]["cols"]["phase"], np.int16).copy()
    code[-1] = 99
    d["tables"]["phases"]["cols"]["phase"] = code.tobytes()
    d["tables"]["steps"]["cols"]["step"] = np.array([50], np.int64).tobytes()
    fresh = Store()
    i3 = Intake(fresh)
    i3.feed_many([*j.messages, msgpack.packb(d, use_bin_type=True)], 0)
    assert fresh.health["rejects"] == {"bad_phase": 1}


def test_a_large_clock_frame_is_refused_before_it_is_unpacked() -> None:
    ctx = zmq.Context()

    def dealer(hub: Hub) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        s.connect(hub.clock_endpoint)
        return s

    try:
        with Hub(limits=Limits(max_clock_frame_bytes=64)) as hub:
            # Over the limit but small: the hub counts it and answers the next ping.
            s = dealer(hub)
            s.send(msgpack.packb({"v": 1, "t0": 5, "pad": "x" * 100}))
            s.send(msgpack.packb({"v": 1, "t0": 7}))
            assert msgpack.unpackb(s.recv())["t0"] == 7  # only the small ping is answered
            assert hub.transport_stats["clock_bad"] == 1
            assert hub.transport_stats["clock_pings"] == 1
            # Far over it: ZeroMQ resets the connection before the frame is held whole,
            # and the hub goes on answering everyone else.
            big = dealer(hub)
            big.send(msgpack.packb({"v": 1, "t0": 9, "pad": "x" * 100_000}))
            other = dealer(hub)
            other.send(msgpack.packb({"v": 1, "t0": 11}))
            assert msgpack.unpackb(other.recv())["t0"] == 11
            assert hub.transport_stats["clock_bad"] == 1
            for sock in (s, big, other):
                sock.close()
    finally:
        ctx.term()


HEADER_VALUE = st.one_of(
    ANY_VALUE,
    st.sampled_from(["r1", "j", "", "x" * 300, "steps", "hello", "groups", "stats"]),
    st.just(1),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    top=st.dictionaries(
        st.sampled_from(
            [
                "v",
                "kind",
                "job",
                "run",
                "rank",
                "inc",
                "batch",
                "scope",
                "parent_run",
                "t_start_ns",
                "manifest",
                "phase_names",
                "stats",
                "groups",
                "tables",
            ]
        ),
        HEADER_VALUE,
        max_size=10,
    ),
    kind=st.sampled_from(schema.KINDS),
)
def test_random_messages_never_raise_and_every_refusal_is_counted(top, kind) -> None:
    store, intake = started()
    before = sum(rejects(store).values())
    msg = {**header("r1", 0), "v": 1, "kind": kind, **top}
    if kind == "hello" and "identity" not in top:
        msg["identity"] = identity(0, 4)
    try:
        data = msgpack.packb(msg, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):
        return
    accepted = intake.feed(data)
    got = sum(rejects(store).values()) - before
    assert accepted or got >= 1, (msg, rejects(store))
    _reader_safe(store)


def test_rankscope_hub_takes_its_limits_from_flags_and_names_a_bad_one() -> None:
    from rankscope.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["hub", "--bind", "tcp://127.0.0.1:0", "--max-world", "0"])
    assert rc == 2
    assert "max_world_size" in err.getvalue() and "Traceback" not in err.getvalue()


def test_a_message_over_the_hubs_size_limit_never_reaches_python() -> None:
    ctx = zmq.Context()

    def rejected(hub: Hub, n: int) -> bool:
        deadline = time.monotonic() + 30
        while sum(hub.counters()["rejects"].values()) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        return sum(hub.counters()["rejects"].values()) == n

    try:
        with Hub(limits=Limits(max_message_bytes=1 << 20)) as hub:
            small = ctx.socket(zmq.PUSH)
            small.setsockopt(zmq.LINGER, 0)
            small.connect(hub.endpoint)
            small.send(b"not msgpack")  # a message the hub does see, and rejects
            assert rejected(hub, 1), hub.counters()
            big = ctx.socket(zmq.PUSH)
            big.setsockopt(zmq.LINGER, 0)
            big.connect(hub.endpoint)
            big.send(b"\x00" * (2 << 20))  # reset by ZeroMQ: never a message to reject
            deadline = time.monotonic() + 30
            while hub.transport_stats["disconnects"] < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert hub.transport_stats["disconnects"] >= 1
            small.send(b"again")
            assert rejected(hub, 2), hub.counters()  # only the two small ones
            assert hub.counters()["rejects"] == {"bad_msgpack": 2}
    finally:
        ctx.destroy(linger=0)
