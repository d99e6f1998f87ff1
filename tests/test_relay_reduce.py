"""A relay's reduction (`rankscope.hub.reduce`): the same seeded run direct and reduced on
its nodes gives the hub the same aggregates, instances and diagnosis; what does not add up
is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rankscope.collector import schema
from rankscope.diagnosis import diagnose
from rankscope.diagnosis.serialize import to_dict
from rankscope.diagnosis.window import COLL_AGGREGATES
from rankscope.hub.intake import Intake
from rankscope.hub.reduce import NodeReducer
from rankscope.hub.store import Store
from rankscope.hub.validate import REPLAY_LIMITS as REPLAY
from rankscope.sim import Cluster, load_scenario
from rankscope.sim.emit import Kept, RankStreams

T0 = 1_700_000_000_000_000_000
INSTANCE_FIELDS = (
    "group",
    "seq",
    "step",
    "op",
    "nbytes",
    "n_members",
    "n_arrived",
    "first",
    "last",
    "last_rank",
    "margin",
    "skew",
    "transfer",
    "device_transfer",
)


def _messages(name: str, steps: int, **over: object) -> tuple[list[tuple[int, bytes]], Cluster]:
    scenario = load_scenario(name, ranks=32, topology__gpus_per_host=8, seed=3, **over)
    cluster = Cluster(scenario, t0_ns=T0)
    keep = Kept()
    streams = RankStreams(cluster, keep, run_id="r", scope="full", node_groups=True)
    streams.start()
    for k in range(steps):
        streams.add(cluster.step(k))
    streams.finish()
    return keep.out, cluster


def _without_steps_of(
    msgs: list[tuple[int, bytes]], rank: int, first: int
) -> list[tuple[int, bytes]]:
    """The stream with ``rank`` gone silent from step ``first`` (its process died)."""
    out = []
    for r, data in msgs:
        if r == rank:
            m = schema.decode(data)
            if m.kind == "steps" and int(m.tables["steps"]["step"].min()) >= first:
                continue
        out.append((r, data))
    return out


def _direct_and_reduced(
    msgs: list[tuple[int, bytes]],
    host: np.ndarray,
    rack: bool = False,
    upper: NodeReducer | None = None,
    partials: bool = True,
) -> tuple[Store, Store, list[NodeReducer]]:
    """The stream fed to one hub as it is, and to another through a relay per host that
    reduces, flushing after each message (and, with ``rack``, through one more relay that
    gathers the hosts' node messages, flushing after each host's step: ``upper``, or a new
    one); ``partials`` as `NodeReducer` takes it."""
    direct = Store(history_steps=64, raw_steps=16)
    Intake(direct).feed_many([d for _, d in msgs], 0)
    reduced = Store(history_steps=64, raw_steps=16)
    intake = Intake(reduced)
    relays: dict[int, NodeReducer] = {}
    upper = upper or NodeReducer(partials=partials)

    def up(frames: list[bytes]) -> None:
        if not rack:
            for out in frames:
                assert intake.feed(out)
            return
        for f in frames:
            for out in upper.take(f, now=0.0):
                assert intake.feed(out)
        for out in upper.due(now=0.0):
            assert intake.feed(out)

    for r, data in msgs:
        relay = relays.setdefault(int(host[r]), NodeReducer(partials=partials))
        up(relay.take(data, now=0.0) + relay.due(now=0.0))
    for relay in relays.values():
        up(relay.flush_all())
    if rack:
        assert upper.counters.merged > 0
        for out in upper.flush_all():
            assert intake.feed(out)
    direct.settle()
    reduced.settle()
    return direct, reduced, list(relays.values())


CASES = [
    ("slow-device", {"layout__tp": 8}, None),
    ("healthy", {"layout__tp": 8}, None),
    # async and point-to-point rows stay rows: the exposed-time union needs them
    ("pipeline-imbalance", {}, None),
    # tensor-parallel groups split across hosts: those go on as rows
    ("placement", {}, None),
    # rank 5 stops at step 6: its node's held rows give up and the hub closes them
    ("slow-device", {"layout__tp": 8}, (5, 6)),
]


@pytest.mark.parametrize("rack", [False, True], ids=["node relays", "node and rack relays"])
@pytest.mark.parametrize(("name", "over", "dead"), CASES)
def test_reduced_run_gives_the_hub_what_the_direct_run_does(
    name: str, over: dict[str, object], dead: tuple[int, int] | None, rack: bool
) -> None:
    msgs, cluster = _messages(name, 12, **over)
    if dead is not None:
        msgs = _without_steps_of(msgs, *dead)
    host = np.asarray(cluster.layout.host)
    # Groups split across relays go on as rows here: their parts are `test_partial`'s (the
    # median transfers they give are an approximation).
    upper = NodeReducer(partials=False)
    direct, reduced, relays = _direct_and_reduced(msgs, host, rack, upper, partials=False)
    if rack and name == "placement":
        # Tensor-parallel groups split across hosts of the rack: matched at the rack.
        assert upper.counters.reduced_rows > 0
    assert direct.health["rejects"] == {} and reduced.health["rejects"] == {}
    assert sum(r.counters.reduced_rows for r in relays) > 0
    if dead is not None:  # the dead rank's peers' rows went on for the hub to close
        assert sum(r.counters.passed_rows for r in relays) > 0
    wd, wr = direct.window("r"), reduced.window("r")
    for agg in COLL_AGGREGATES:
        np.testing.assert_array_equal(wd.coll[agg], wr.coll[agg], err_msg=agg)
    run_d, run_r = direct.run_state("r"), reduced.run_state("r")
    assert run_d is not None and run_r is not None
    assert run_d.stats == run_r.stats and len(run_d.stats) == 32  # gathered too
    assert reduced.health["gathered"] >= len(msgs) - 32 - 8  # but hellos and groups
    a, b = wd.instances, wr.instances
    assert len(a) == len(b)
    oa, ob = np.lexsort((a.seq, a.group)), np.lexsort((b.seq, b.group))
    for f in INSTANCE_FIELDS:
        np.testing.assert_array_equal(getattr(a, f)[oa], getattr(b, f)[ob], err_msg=f)
    da = json.dumps(to_dict(diagnose(wd)), sort_keys=True, default=str)
    db = json.dumps(to_dict(diagnose(wr)), sort_keys=True, default=str)
    assert da == db
    # The rows that went on (the hub keeps the latest steps' raw rows) are the direct
    # run's, each under its own rank: a node message's rows are queued several ranks at
    # a time.
    assert wd.t0_ns == wr.t0_ns
    assert wd.rows is not None
    if wr.rows is None:  # every call was reduced (a rack's relay holds every member)
        assert rack and sum(r.counters.passed_rows for r in relays) == 0
        return

    def raw(rows):  # type: ignore[no-untyped-def]
        cols = ("rank", "group", "seq", "step", "t_enter", "t_exit", "flags")
        return sorted(zip(*(getattr(rows, c).tolist() for c in cols), strict=True))

    got, want = raw(wr.rows), raw(wd.rows)
    # A (group, step) goes on whole or not at all: its rows are the direct run's, all of
    # them, under the same ranks.
    keys = {(row[1], row[3]) for row in got}
    assert [row for row in want if (row[1], row[3]) in keys] == got


def test_instances_a_relay_matched_are_bounded_like_the_hub_s_own() -> None:
    msgs, cluster = _messages("slow-device", 8, layout__tp=8)
    host = np.asarray(cluster.layout.host)
    _, reduced, _ = _direct_and_reduced(msgs, host)
    bounded = Store(history_steps=64, raw_steps=16, max_instance_rows=40)
    intake = Intake(bounded)
    relays: dict[int, NodeReducer] = {}
    for r, data in msgs:  # no matching pass in between: node messages alone bring them
        relay = relays.setdefault(int(host[r]), NodeReducer())
        for out in relay.take(data, now=0.0) + relay.due(now=0.0):
            assert intake.feed(out)
    run = bounded.run_state("r")
    assert run is not None and 0 < len(run.instances) <= 40 and run.instances_dropped > 0
    bounded.settle()
    w, full = bounded.window("r"), reduced.window("r")
    assert len(w.instances) < len(full.instances)
    for agg in COLL_AGGREGATES:  # the sums of dropped instances stay
        np.testing.assert_array_equal(w.coll[agg], full.coll[agg], err_msg=agg)


def test_reduction_carries_fewer_bytes_and_keeps_the_slow_rank() -> None:
    msgs, cluster = _messages("slow-device", 6, layout__tp=8)
    direct, reduced, relays = _direct_and_reduced(msgs, np.asarray(cluster.layout.host))
    sent = sum(len(d) for _, d in msgs)
    assert sum(r.counters.messages for r in relays) > 0
    w = reduced.window("r")
    late = np.nansum(w.coll["late_ns"], axis=1)
    slow = int(np.argmax(late))
    assert slow == int(np.argmax(np.nansum(direct.window("r").coll["late_ns"], axis=1)))
    # what left the relays: the rows of node-local groups became sums
    out = []
    host = np.asarray(cluster.layout.host)
    again: dict[int, NodeReducer] = {}
    for r, data in msgs:
        relay = again.setdefault(int(host[r]), NodeReducer())
        out += relay.take(data, now=0.0) + relay.due(now=0.0)
    # The ranks' own rows travel packed (~20 B a collective); the node's sums and instances
    # carry float columns, so the saving is in rows, not in bytes per row: ~0.52 here.
    assert sum(map(len, out)) < 0.6 * sent


# -- what does not add up is refused ------------------------------------------------


def _hub_with_run() -> tuple[Store, Intake, list[bytes]]:
    """A hub fed one step of a run, but for the node messages holding sums of node 0's
    relay (returned, not fed)."""
    msgs, cluster = _messages("healthy", 2, layout__tp=8)
    store = Store(history_steps=16, raw_steps=2)
    intake = Intake(store)
    host = np.asarray(cluster.layout.host)
    relay = NodeReducer()
    reduced: list[bytes] = []
    for r, data in msgs:
        if host[r] != host[0]:
            intake.feed(data)
            continue
        for out in relay.take(data, now=0.0) + relay.due(now=0.0):
            m = schema.decode(out)
            if m.kind == "reduced" and m.tables["cells"]["rank"].shape[0]:
                reduced.append(out)
            else:
                assert intake.feed(out)
    assert reduced
    return store, intake, reduced


def _tampered(data: bytes, table: str, col: str, fn) -> bytes:  # type: ignore[no-untyped-def]
    m = schema.decode(data)
    tabs = {k: {c: v.copy() for c, v in t.items()} for k, t in m.tables.items()}
    tabs[table][col] = fn(tabs[table][col])
    return schema.reduced_message(
        {k: m.header[k] for k in ("job", "run", "rank", "inc")}, tabs, m.header.get("phase_names")
    )


@pytest.mark.parametrize(
    ("table", "col", "fn", "reason"),
    [
        ("cells", "rank", lambda a: a + 10_000, "bad_reduced"),
        ("cells", "n", lambda a: a + 1, "bad_reduced"),
        ("cells", "times_last", lambda a: a + 10_000, "bad_reduced"),
        ("cells", "wait_ns", lambda a: -a - 1, "bad_reduced"),
        ("cells", "late_ns", lambda a: np.full_like(a, np.nan), "bad_reduced"),
        ("instances", "group", lambda a: a + 999, "bad_reduced"),
        ("instances", "n_members", lambda a: a + 1, "bad_reduced"),
        ("instances", "last_rank", lambda a: a + 8, "bad_reduced"),
        ("instances", "first", lambda a: a + 10**15, "bad_time"),
        ("instances", "seq", lambda a: np.zeros_like(a), "bad_reduced"),
        ("instances", "op", lambda a: a + 100, "bad_op"),
    ],
)
def test_a_reduced_message_that_does_not_add_up_is_refused(table, col, fn, reason) -> None:  # type: ignore[no-untyped-def]
    store, intake, reduced = _hub_with_run()
    before = store.window("r")
    assert not intake.feed(_tampered(reduced[0], table, col, fn))
    assert store.health["rejects"].get(reason) == 1
    after = store.window("r")
    for agg in COLL_AGGREGATES:  # nothing of it was folded
        np.testing.assert_array_equal(before.coll[agg], after.coll[agg])


def test_a_reduced_message_is_folded_once() -> None:
    store, intake, reduced = _hub_with_run()
    assert intake.feed(reduced[0])
    once = store.window("r").coll["n"].copy()
    assert not intake.feed(reduced[0])
    assert store.health["rejects"].get("duplicate_instance") == 1
    np.testing.assert_array_equal(store.window("r").coll["n"], once)


def test_sums_of_an_incarnation_the_hub_does_not_hold_are_left_out_and_the_rows_kept() -> None:
    store, intake, reduced = _hub_with_run()
    before = store.window("r")
    assert intake.feed(_tampered(reduced[0], "cells", "inc", lambda a: a + 1))
    assert store.health["rejects"].get("unknown_rank") == 1
    after = store.window("r")
    assert before.reduced == {} and after.reduced == {}  # no sum folded
    assert after.present.sum() > before.present.sum()  # its ranks' steps were taken


def test_a_recording_of_a_reduced_run_reads_back_byte_for_byte_and_replays_the_same(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """Node messages in a recording (format 2 stores their columns as columns): read back
    byte for byte, replayed to the window the live hub held, and cut to a snapshot window
    that replays to those steps."""
    from rankscope.hub.recording import RecordingWriter, read_frames
    from rankscope.hub.replay import load
    from rankscope.snapshot_window import window_frames

    msgs, cluster = _messages("slow-device", 8, layout__tp=8)
    host = np.asarray(cluster.layout.host)
    live = Store(history_steps=64, raw_steps=16)
    intake = Intake(live)
    relays: dict[int, NodeReducer] = {}
    sent: list[bytes] = []
    for r, data in msgs:
        relay = relays.setdefault(int(host[r]), NodeReducer())
        sent += relay.take(data, now=0.0) + relay.due(now=0.0)
    for relay in relays.values():
        sent += relay.flush_all()
    writer = RecordingWriter(tmp_path / "rec")
    for k, data in enumerate(sent):
        assert intake.feed(data, T0 + k)
        writer.append(data, T0 + k)
    writer.close()
    live.settle()
    assert [f.payload for f in read_frames(tmp_path / "rec")] == sent
    replayed = load(tmp_path / "rec", history_steps=64, raw_steps=16)
    a, b = live.window("r"), replayed.window("r")
    for agg in COLL_AGGREGATES:
        np.testing.assert_array_equal(a.coll[agg], b.coll[agg], err_msg=agg)
    assert len(a.instances) == len(b.instances)
    cut = list(window_frames(tmp_path / "rec", "r", [3, 4]))
    assert any(schema.decode(p).kind == "reduced" for p, _ in cut)
    snap = Store(history_steps=64, raw_steps=16)
    snap_intake = Intake(snap)
    for payload, t in cut:
        snap_intake.feed(payload, t)
    snap.settle()
    w = snap.window("r")
    assert w.steps.tolist() == [3, 4] and w.present.all()
    np.testing.assert_array_equal(w.coll["late_ns"], a.coll["late_ns"][:, 3:5])


def test_a_relay_keeps_a_bounded_number_of_runs_and_hands_on_what_a_retired_one_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past `MAX_RUNS` runs a new run's hello retires the run heard from longest ago: what
    it gathered leaves in a node message first, and its later messages go on unchanged."""
    from rankscope.hub import reduce

    monkeypatch.setattr(reduce, "MAX_RUNS", 2)
    relay = NodeReducer()
    streams = []
    for k in range(3):
        scenario = load_scenario("healthy", ranks=8, seed=k, topology__gpus_per_host=8)
        cluster = Cluster(scenario, t0_ns=T0)
        keep = Kept()
        s = RankStreams(cluster, keep, run_id=f"run{k}", scope="full", node_groups=True)
        s.start()
        s.add(cluster.step(0))
        streams.append(keep.out)
    out: list[bytes] = []
    for k, msgs in enumerate(streams):
        for _, data in msgs:
            out += relay.take(data, now=float(k))
    runs = {schema.decode(d).header["run"] for d in out if schema.decode(d).kind == "reduced"}
    assert runs == {"run0"}  # run0 was retired by run2's hello: its gathered rows left
    assert set(relay._runs) == {"run1", "run2"}
    steps0 = [d for _, d in streams[0] if schema.decode(d).kind == "steps"]
    assert relay.take(steps0[0], now=9.0) == [steps0[0]]  # a retired run's message goes on


def test_an_absurd_step_id_of_one_rank_does_not_pass_for_another_ranks_step() -> None:
    """Repeated steps are found on exact (rank, step) pairs: a rank's step 2**40 + s must
    not read as its neighbour's step s (a packed key would alias them)."""
    from rankscope.hub.validate import check_reduced

    store, _, reduced = _hub_with_run()
    m = schema.decode(reduced[0])
    one = m.tables["steps"]
    st = {k: np.concatenate([v[:1], v[:1]]) for k, v in one.items()}
    r, s = int(st["rank"][1]), int(st["step"][1])
    # rank r - 1 at step 2**40 + s: packed as rank * 2**40 + step, it reads as rank r at s
    st["rank"][0], st["step"][0] = r - 1, (1 << 40) + s
    tables = {**m.tables, "steps": st}
    run = store.run_state("r")
    assert run is not None
    verdict = check_reduced(
        schema.Message(kind="reduced", header=m.header, tables=tables), run, None, REPLAY
    )
    assert verdict.duplicate_steps == 0 and not verdict.empty


def test_a_relay_lists_its_share_of_instances_and_its_sums_cover_them_all() -> None:
    """At scale a relay lists only its ranks' share of the hub's instance table (forced
    here: a share of a quarter instance a step); the sums, the counts of completed
    instances and of times each rank came last stay those of every instance."""
    msgs, cluster = _messages("slow-device", 8, layout__tp=8)
    host = np.asarray(cluster.layout.host)
    direct = Store(history_steps=64, raw_steps=16)
    Intake(direct).feed_many([d for _, d in msgs], 0)
    listed = Store(history_steps=64, raw_steps=16)
    intake = Intake(listed)
    relays: dict[int, NodeReducer] = {}
    for r, data in msgs:
        relay = relays.setdefault(int(host[r]), NodeReducer(instance_steps=10**6))
        for out in relay.take(data, now=0.0) + relay.due(now=0.0):
            assert intake.feed(out)
    for relay in relays.values():
        for out in relay.flush_all():
            assert intake.feed(out)
    direct.settle()
    listed.settle()
    assert listed.health["rejects"] == {}
    wd, wl = direct.window("r"), listed.window("r")
    for agg in COLL_AGGREGATES:
        np.testing.assert_array_equal(wd.coll[agg], wl.coll[agg], err_msg=agg)
    td, tl = direct.totals("r"), listed.totals("r")
    assert tl.instances_complete == td.instances_complete
    np.testing.assert_array_equal(tl.times_last, td.times_last)
    # One instance of each tensor-parallel group a step, a different call each step.
    tp = wl.instances.n_members == 8
    assert tp.sum() == 4 * 8 < (wd.instances.n_members == 8).sum()
    one = tp & (wl.instances.group == wl.instances.group[tp][0])
    k = int((wd.instances.group == wl.instances.group[tp][0]).sum()) // 8  # calls a step
    at = wl.instances.seq[one] - k * wl.instances.step[one]  # the call's place in its step
    assert len(set(at.tolist())) == 8  # the offset moves with the step
    # The listed instances are the direct run's own.
    a, b = wd.instances, wl.instances
    key_a = {(g, s): i for i, (g, s) in enumerate(zip(a.group.tolist(), a.seq.tolist()))}
    for j, (g, s) in enumerate(zip(b.group.tolist(), b.seq.tolist())):
        i = key_a[(g, s)]
        for f in ("first", "last", "last_rank", "margin", "transfer"):
            assert getattr(a, f)[i] == getattr(b, f)[j] or (
                np.isnan(getattr(a, f)[i]) and np.isnan(getattr(b, f)[j])
            )


def test_a_relay_sends_each_group_table_entry_on_once() -> None:
    """Every rank reports the groups it belongs to; a reducing relay sends each membership
    on once, and the hub holds the same groups as from the ranks themselves."""
    msgs, cluster = _messages("slow-device", 4, layout__tp=8)
    host = np.asarray(cluster.layout.host)
    # As collectors do: each rank also reports every group it is in.
    job = schema.decode(msgs[0][1]).header["job"]
    every = [
        (
            r,
            schema.groups_message(
                {"job": job, "run": "r", "rank": r, "inc": 0},
                [g for g in cluster.groups if r in g["ranks"]],
            ),
        )
        for r in range(32)
    ]
    hellos = [(r, d) for r, d in msgs if schema.decode(d).kind == "hello"]
    rest = [(r, d) for r, d in msgs if schema.decode(d).kind != "hello"]
    stream = hellos + every + rest
    direct = Store(history_steps=16, raw_steps=4)
    Intake(direct).feed_many([d for _, d in stream], 0)
    relays: dict[int, NodeReducer] = {}
    upper = NodeReducer()
    out: list[bytes] = []
    for r, data in stream:
        relay = relays.setdefault(int(host[r]), NodeReducer())
        for f in relay.take(data, now=0.0) + relay.due(now=0.0):
            out += upper.take(f, now=0.0)
    for relay in relays.values():
        for f in relay.flush_all():
            out += upper.take(f, now=0.0)
    out += upper.flush_all()
    sent = [
        g["id"]
        for d in out
        if schema.decode(d).kind == "groups"
        for g in schema.decode(d).header["groups"]
    ]
    # Rank 0's table of every group, then each group once more at most (the rack's relay
    # saw the node relays' copies first).
    assert len(sent) <= 2 * len(cluster.groups)
    assert upper.counters.groups_deduplicated > 0
    relayed = Store(history_steps=16, raw_steps=4)
    Intake(relayed).feed_many(out, 0)
    a, b = direct.run_state("r"), relayed.run_state("r")
    assert a is not None and b is not None and a.groups == b.groups


def test_a_reducing_relay_behind_its_collectors_still_sends_between_frames():
    # A reducing relay's bundle stays empty while it takes rows in, so reading what waits
    # must end after a flush interval however much still waits: a relay behind its
    # collectors (more ranks than its cores keep up with) otherwise read until they paused
    # and sent nothing until then (seen at 2,048 ranks a relay: one node message a run).
    import zmq

    from rankscope.hub.relay import Relay

    msgs, _ = _messages("healthy", 2)
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.bind("inproc://relay-fill-turns")
        push.connect("inproc://relay-fill-turns")
        for _, data in msgs:
            push.send(data)

        def read(flush_s: float) -> int:
            relay = Relay(
                "ipc:///tmp/unused.sock", "tcp://127.0.0.1:1", reduce=True, flush_s=flush_s
            )
            assert pull.poll(1000)
            relay._fill(pull, [], 0)
            return relay.counters.received

        assert read(1e-9) == 1  # a turn ends after the frame that outlasts the interval
        assert read(60.0) == len(msgs) - 1  # within it, everything waiting is read
    finally:
        pull.close(linger=0)
        push.close(linger=0)
