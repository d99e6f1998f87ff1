"""Instances of groups that span relays: parts from each relay, combined by the hub.

A direct run and the same run through reducing relays give the hub the same per rank-step
sums and the same instances (first, last, last arriver, margin, skew), and the same
verdict; the transfer medians are the stated approximation, within the spread of the
parts' medians. What does not add up is refused and counted; parts that never cover their
group close as the hub closes instances that never completed.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_relay_reduce import _direct_and_reduced, _messages, _tampered, _without_steps_of

from rankscope.collector import schema
from rankscope.diagnosis import diagnose
from rankscope.diagnosis.serialize import to_dict
from rankscope.diagnosis.window import COLL_AGGREGATES
from rankscope.hub.intake import Intake
from rankscope.hub.partial import PartError, combine, make_part
from rankscope.hub.reduce import NodeReducer
from rankscope.hub.store import Store

EXACT = ("group", "seq", "step", "op", "nbytes", "n_members", "n_arrived", "first", "last")
EXACT += ("last_rank", "margin", "skew")


def _sorted(inst):  # type: ignore[no-untyped-def]
    return np.lexsort((inst.seq, inst.group))


@pytest.mark.parametrize("tp", [8, 4])
@pytest.mark.parametrize("rack", [False, True], ids=["node relays", "node and rack relays"])
def test_groups_split_across_nodes_are_combined_to_what_the_direct_run_gives(
    tp: int, rack: bool
) -> None:
    # "placement": each tensor-parallel group has members on two hosts.
    msgs, cluster = _messages("placement", 12, layout__tp=tp)
    host = np.asarray(cluster.layout.host)
    direct, reduced, relays = _direct_and_reduced(msgs, host, rack)
    assert sum(r.counters.parts for r in relays) > 0
    assert direct.health["rejects"] == {} and reduced.health["rejects"] == {}
    run = reduced.run_state("r")
    assert run is not None and run.part_counts["combined"] > 0
    assert run.part_counts["unsplit"] == 0 and run.part_counts["incomplete"] == 0
    wd, wr = direct.window("r"), reduced.window("r")
    for agg in COLL_AGGREGATES:
        np.testing.assert_array_equal(wd.coll[agg], wr.coll[agg], err_msg=agg)
    a, b = wd.instances, wr.instances
    assert len(a) == len(b)
    oa, ob = _sorted(a), _sorted(b)
    for f in EXACT:
        np.testing.assert_array_equal(getattr(a, f)[oa], getattr(b, f)[ob], err_msg=f)
    # The median transfer: within 2 % of the direct one here (the parts' medians differ
    # by at most the members' spread of exits).
    t_a, t_b = a.transfer[oa], b.transfer[ob]
    assert np.nanmax(np.abs(t_a - t_b) / np.nanmedian(t_a)) < 0.02
    np.testing.assert_array_equal(np.isnan(t_a), np.isnan(t_b))
    va, vb = (to_dict(diagnose(w))["verdict"] for w in (wd, wr))
    assert va["top"] == vb["top"]
    assert [(h["mechanism"], h["ranks"]) for h in va["hypotheses"]] == [
        (h["mechanism"], h["ranks"]) for h in vb["hypotheses"]
    ]


def test_a_member_that_stops_leaves_its_group_s_parts_to_close_as_incomplete() -> None:
    # A member of a group split across hosts stops at step 6: its host's relay passes its
    # peers' rows on, the other host's parts never cover the group; the hub closes both as
    # it closes what never completed.
    msgs, cluster = _messages("placement", 12, layout__tp=8)
    host = np.asarray(cluster.layout.host)
    split = [
        g["ranks"]
        for g in cluster.groups
        if g["name"].startswith("tp") and len(set(host[g["ranks"]].tolist())) > 1
    ]
    msgs = _without_steps_of(msgs, split[0][0], 6)
    direct, reduced, _ = _direct_and_reduced(msgs, host)
    assert reduced.health["rejects"] == {}
    run = reduced.run_state("r")
    # Still held (the hub waits while the stopped rank's peers are heard from), or closed.
    assert run is not None and (run.part_counts["incomplete"] > 0 or run.parts.held)
    wd, wr = direct.window("r"), reduced.window("r")
    for agg in COLL_AGGREGATES:
        np.testing.assert_array_equal(wd.coll[agg], wr.coll[agg], err_msg=agg)


def _parts_message() -> tuple[Store, Intake, bytes]:
    """A hub fed a placement run but one node message with parts (returned)."""
    msgs, cluster = _messages("placement", 2, layout__tp=8)
    host = np.asarray(cluster.layout.host)
    store = Store(history_steps=16, raw_steps=2)
    intake = Intake(store)
    relays: dict[int, NodeReducer] = {}
    held = None
    for r, data in msgs:
        relay = relays.setdefault(int(host[r]), NodeReducer())
        for out in relay.take(data, now=0.0) + relay.due(now=0.0):
            m = schema.decode(out)
            if held is None and m.kind == "reduced" and "parts" in m.tables:
                held = out
            else:
                assert intake.feed(out)
    assert held is not None
    return store, intake, held


@pytest.mark.parametrize(
    ("table", "col", "fn", "reason"),
    [
        ("part_cells", "rank", lambda a: a + 10_000, "bad_reduced"),
        ("part_cells", "n", lambda a: a * 0, "bad_reduced"),
        ("part_cells", "exit_ns", lambda a: -a - 1, "bad_reduced"),
        ("part_cells", "group", lambda a: a + 999, "bad_reduced"),
        ("parts", "last", lambda a: a - 10**12, "bad_time"),
        ("parts", "n_members", lambda a: a + 100, "bad_reduced"),
        ("parts", "last_rank", lambda a: a + 1000, "bad_reduced"),
        ("parts", "op", lambda a: a + 100, "bad_op"),
        ("parts", "exit_median", lambda a: np.full_like(a, np.inf), "bad_reduced"),
    ],
)
def test_parts_that_do_not_fit_the_run_are_refused(table, col, fn, reason) -> None:  # type: ignore[no-untyped-def]
    store, intake, held = _parts_message()
    assert not intake.feed(_tampered(held, table, col, fn))
    assert store.health["rejects"].get(reason) == 1


def test_shares_that_disagree_on_what_was_called_are_refused_when_combined() -> None:
    store, intake, held = _parts_message()
    run = store.run_state("r")
    assert run is not None
    combined = run.part_counts["combined"]
    assert intake.feed(_tampered(held, "parts", "nbytes", lambda a: a + 1))
    store.settle()
    assert store.health["rejects"].get("bad_parts", 0) >= 1
    assert run.part_counts["combined"] == combined


def test_a_share_sent_twice_is_folded_once() -> None:
    store, intake, held = _parts_message()
    assert intake.feed(held)
    once = store.window("r").coll["n"].copy()
    assert intake.feed(held)  # valid on its own; refused when it would be combined again
    store.settle()
    assert store.health["rejects"].get("duplicate_instance", 0) >= 1
    np.testing.assert_array_equal(store.window("r").coll["n"], once)


# -- the arithmetic ------------------------------------------------------------------


def _rows(rng: np.random.Generator, c: int, k: int, tie: bool = False):  # type: ignore[no-untyped-def]
    t0 = 1_700_000_000_000_000_000
    enter = t0 + rng.integers(0, 50_000, (c, k)) + np.arange(k) * 1_000_000
    if tie:
        enter[[1, c - 2], 0] = enter[:, 0].max() + 7
    last = enter.max(axis=0)
    exit_ = last + rng.integers(1_000, 40_000, (c, k))
    return enter, exit_


def _split(rng: np.random.Generator, members: np.ndarray, enter, exit_, shares: int, cut=None):  # type: ignore[no-untyped-def]
    """Parts of ``shares`` random disjoint subsets of the members (each non-empty), and
    their part rows."""
    c, k = enter.shape
    if cut is None:
        cut = np.full((c, k), schema.NO_TIME, np.int64)
    owner = np.concatenate([np.arange(shares), rng.integers(0, shares, c - shares)])
    rng.shuffle(owner)
    parts, cells, rows = [], [], []
    zeros = np.zeros((c, k), np.int64)
    for s in rng.permutation(shares):
        at = np.flatnonzero(owner == s)
        made = make_part(
            7,
            3,
            0,
            members[at],
            np.arange(k, dtype=np.int64),
            np.zeros(k, np.int8),
            np.full(k, 1 << 20),
            enter[at],
            exit_[at],
            cut[at],
            np.where(cut[at] == schema.NO_TIME, 0, schema.FLAG_ASYNC).astype(np.int16),
            zeros[at] + schema.NO_TIME,
            zeros[at] + schema.NO_TIME,
        )
        assert made is not None
        parts.append(made[0])
        cells.append(made[1])
        rows.append(made[2])
    pid = np.concatenate([np.full(p["seq"].shape[0], i) for i, p in enumerate(parts)])

    def cat(tables):  # type: ignore[no-untyped-def]
        return {key: np.concatenate([t[key] for t in tables]) for key in tables[0]}

    return cat(parts), pid, cat(cells), cat(rows)


@pytest.mark.parametrize("seed", range(12))
def test_combined_parts_equal_one_relay_s_match_and_the_median_stays_within_the_bound(
    seed: int,
) -> None:
    from rankscope.diagnosis.blocks import block_sums, match_block

    rng = np.random.default_rng(seed)
    c, k = int(rng.integers(4, 40)), int(rng.integers(1, 12))
    members = np.sort(rng.choice(10_000, c, replace=False)).astype(np.int64)
    enter, exit_ = _rows(rng, c, k, tie=seed % 3 == 0)
    shares = int(rng.integers(2, min(c, 6) + 1))
    parts, pid, cells, rows = _split(rng, members, enter, exit_, shares)
    got = combine(members, parts, pid, cells, rows)
    assert got.split
    origin = int(enter.min())
    e, x = (enter - origin).astype(np.float64), (exit_ - origin).astype(np.float64)
    m = match_block(e.copy(), x, members[:, None])
    want = block_sums(e, x, m, np.zeros(1, np.int64))
    inst = got.instances
    np.testing.assert_array_equal(inst["first"] - origin, m.first)
    np.testing.assert_array_equal(inst["last"] - origin, m.last)
    np.testing.assert_array_equal(inst["last_rank"], m.last_rank)
    np.testing.assert_array_equal(inst["margin"], m.margin)
    np.testing.assert_array_equal(inst["first_exit"] - origin, m.first_exit)
    for name in schema.CELL_SUMS:
        np.testing.assert_array_equal(got.cells[name], want[name][:, 0], err_msg=name)
    np.testing.assert_array_equal(got.cells["times_last"], want["times_last"][:, 0])
    # The transfer: between the lowest and highest of the parts' own medians.
    med = parts["first"] + parts["exit_median"] - np.repeat(inst["last"], 1)[parts["seq"]]
    for j in range(k):
        mine = med[parts["seq"] == j]
        assert mine.min() - 1e-6 <= inst["transfer"][j] <= mine.max() + 1e-6
        assert abs(inst["transfer"][j] - m.transfer[j]) <= mine.max() - mine.min() + 1e-6


def test_shares_in_any_order_combine_to_the_same() -> None:
    rng = np.random.default_rng(5)
    members = np.arange(0, 64, 4, dtype=np.int64)
    enter, exit_ = _rows(rng, 16, 6, tie=True)
    parts, pid, cells, rows = _split(rng, members, enter, exit_, 4)
    a = combine(members, parts, pid, cells, rows)
    order = rng.permutation(pid.shape[0])
    b = combine(
        members,
        {key: v[order] for key, v in parts.items()},
        pid[order],
        {key: v[::-1] for key, v in cells.items()},
        {key: v[::-1] for key, v in rows.items()},
    )
    for key in a.instances:
        np.testing.assert_array_equal(a.instances[key], b.instances[key], err_msg=key)
    for key in a.cells:
        np.testing.assert_array_equal(a.cells[key], b.cells[key], err_msg=key)


def test_a_member_that_left_before_the_last_came_keeps_only_its_time_inside() -> None:
    rng = np.random.default_rng(1)
    members = np.arange(8, dtype=np.int64)
    enter, exit_ = _rows(rng, 8, 3)
    early = int(np.argmin(enter[:, 1]))
    exit_[early, 1] = enter[:, 1].max() - 5  # left before the last member came (clocks)
    parts, pid, cells, rows = _split(rng, members, enter, exit_, 2)
    got = combine(members, parts, pid, cells, rows)
    assert not got.split
    np.testing.assert_array_equal(got.cells["coll_ns"], (exit_ - enter).sum(axis=1))
    assert not got.cells["wait_ns"].any() and not got.cells["times_last"].any()


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda p, pid, c: (p, pid, {k: v[1:] for k, v in c.items()}), "group's members"),
        (lambda p, pid, c: ({**p, "op": p["op"] + (pid == 0)}, pid, c), "op"),
        (lambda p, pid, c: ({k: v[1:] for k, v in p.items()}, pid[1:], c), "instances"),
        (lambda p, pid, c: (p, pid, {**c, "n": c["n"] + 1}), "calls"),
    ],
)
def test_shares_that_do_not_add_up_are_named(change, why) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(2)
    members = np.arange(8, dtype=np.int64)
    enter, exit_ = _rows(rng, 8, 4)
    parts, pid, cells, rows = _split(rng, members, enter, exit_, 3)
    with pytest.raises(PartError, match=why):
        combine(members, *change(parts, pid, cells), rows)


@pytest.mark.parametrize("seed", range(16))
def test_asynchronous_calls_combine_to_the_hub_s_own_sums_whatever_their_cuts(seed: int) -> None:
    """Asynchronous rows: where each call's exposed time starts (its cut) falls anywhere,
    before the instance's entries, between its last entry and first exit, after its exits;
    the combined sums equal the hub's row by row (`block_sums` with the same cuts)."""
    from rankscope.diagnosis.blocks import block_sums, match_block

    rng = np.random.default_rng(100 + seed)
    c, k = int(rng.integers(3, 30)), int(rng.integers(1, 10))
    members = np.sort(rng.choice(5_000, c, replace=False)).astype(np.int64)
    enter, exit_ = _rows(rng, c, k)
    lo, hi = enter.min() - 20_000, exit_.max() + 20_000
    cut = rng.integers(lo, hi, (c, k))
    cut[rng.random((c, k)) < 0.2] = schema.NO_TIME  # blocking rows among them
    shares = int(rng.integers(1, min(c, 5) + 1))
    parts, pid, cells, rows = _split(rng, members, enter, exit_, shares, cut)
    got = combine(members, parts, pid, cells, rows)
    assert got.split
    origin = int(enter.min())
    e, x = (enter - origin).astype(np.float64), (exit_ - origin).astype(np.float64)
    is_async = cut != schema.NO_TIME
    rel = np.where(is_async, (cut - origin).astype(np.float64), np.nan)
    m = match_block(e.copy(), x, members[:, None])
    want = block_sums(e, x, m, np.zeros(1, np.int64), is_async, rel)
    for name in schema.CELL_SUMS:
        np.testing.assert_array_equal(got.cells[name], want[name][:, 0], err_msg=name)
    np.testing.assert_array_equal(got.cells["times_last"], want["times_last"][:, 0])


@pytest.mark.parametrize(("where", "linear"), [("none", True), ("before", True), ("after", False)])
def test_calls_whose_exposed_time_does_not_hang_on_the_last_entry_travel_as_sums(
    where: str, linear: bool
) -> None:
    """Blocking calls, and asynchronous ones cut before their instance's entries or after
    its exits, need no part row: only calls cut between can depend on the last entry."""
    rng = np.random.default_rng(9)
    members = np.arange(12, dtype=np.int64)
    enter, exit_ = _rows(rng, 12, 5)
    cut = {
        "none": np.full(enter.shape, schema.NO_TIME),
        "before": enter.min(axis=0) - 1 + np.zeros_like(enter),
        "after": exit_.max(axis=0) + 1 + np.zeros_like(enter),
    }[where].astype(np.int64)
    parts, pid, cells, rows = _split(rng, members, enter, exit_, 3, cut)
    assert rows["rank"].shape[0] == 0
    assert (cells["linear"] == linear).all()
    got = combine(members, parts, pid, cells, rows)
    if where == "after":  # nothing of the wait exposed; the transfer from the cut on
        assert not got.cells["exposed_wait_ns"].any()
        np.testing.assert_array_equal(got.cells["exposed_transfer_ns"], np.zeros(12))


@pytest.mark.parametrize(
    ("rows_first", "pass_between"),
    [(True, False), (True, True), (False, False)],
    ids=["rows first", "rows first and a matching pass", "parts first"],
)
def test_members_that_came_as_rows_combine_with_the_relay_s_parts(
    rows_first: bool, pass_between: bool
) -> None:
    """Half the hosts send through one reducing relay (two members of each data-parallel
    group: parts), the other half straight to the hub (rows): whichever comes first, and
    whether a matching pass saw the rows before the parts came, the hub makes the rows
    parts of one member and combines them with the relay's."""
    msgs, cluster = _messages("slow-device", 12, layout__tp=8)
    host = np.asarray(cluster.layout.host)
    direct = Store(history_steps=64, raw_steps=16)
    Intake(direct).feed_many([d for _, d in msgs], 0)
    relay = NodeReducer()
    via: list[bytes] = []
    straight: list[bytes] = []
    for r, data in msgs:
        if host[r] < 2:
            via += relay.take(data, now=0.0) + relay.due(now=0.0)
        else:
            straight.append(data)
    via += relay.flush_all()

    # Hellos and group tables first (the hub must know every rank), then the rest.
    def early(d: bytes) -> bool:
        return schema.decode(d).kind in ("hello", "groups")

    first, second = (straight, via) if rows_first else (via, straight)
    mixed = Store(history_steps=64, raw_steps=16)
    intake = Intake(mixed)
    for d in [d for d in first + second if early(d)]:
        intake.feed(d)
    for d in [d for d in first if not early(d)]:
        intake.feed(d)
    if pass_between:
        mixed.settle()  # the rows are matched (and wait) before the first part comes
    for d in [d for d in second if not early(d)]:
        intake.feed(d)
    direct.settle()
    mixed.settle()
    assert mixed.health["rejects"] == {}
    run = mixed.run_state("r")
    assert run is not None and relay.counters.parts > 0
    assert run.part_counts["combined"] > 0 and not run.parts.held
    wd, wm = direct.window("r"), mixed.window("r")
    for agg in COLL_AGGREGATES:
        np.testing.assert_array_equal(wd.coll[agg], wm.coll[agg], err_msg=agg)
    # What the diagnosis reads as exposed: the union over the rows the hub holds, with the
    # relays' sums kept apart (parts made of its own rows are not counted twice).
    from rankscope.diagnosis.exposure import exposed_union, rows_cover_window

    assert rows_cover_window(wd) and rows_cover_window(wm)
    ed, em = exposed_union(wd), exposed_union(wm)
    for name in ("exposed_wait_ns", "exposed_transfer_ns"):
        np.testing.assert_allclose(ed[name], em[name], rtol=1e-12, err_msg=name)


def test_a_recording_with_parts_replays_and_exports_the_combined_instances(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Parts in a recording: replayed to the window the live hub held, cut to a snapshot
    window that replays, and exported to Parquet with the instances they combine to."""
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from rankscope.hub.export_parquet import write_parquet
    from rankscope.hub.recording import RecordingWriter
    from rankscope.hub.replay import load
    from rankscope.snapshot_window import window_frames

    msgs, cluster = _messages("placement", 8, layout__tp=8)
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
    assert any(
        "parts" in schema.decode(d).tables for d in sent if schema.decode(d).kind == "reduced"
    )
    writer = RecordingWriter(tmp_path / "rec")
    for k, data in enumerate(sent):
        assert intake.feed(data, 1_700_000_000_000_000_000 + k)
        writer.append(data, 1_700_000_000_000_000_000 + k)
    writer.close()
    live.settle()
    replayed = load(tmp_path / "rec", history_steps=64, raw_steps=16)
    a, b = live.window("r"), replayed.window("r")
    for agg in COLL_AGGREGATES:
        np.testing.assert_array_equal(a.coll[agg], b.coll[agg], err_msg=agg)
    assert len(a.instances) == len(b.instances)
    snap = Store(history_steps=64, raw_steps=16)
    snap_intake = Intake(snap)
    for payload, t in window_frames(tmp_path / "rec", "r", [3, 4]):
        snap_intake.feed(payload, t)
    snap.settle()
    w = snap.window("r")
    assert w.steps.tolist() == [3, 4] and w.present.all()
    np.testing.assert_array_equal(w.coll["late_ns"], a.coll["late_ns"][:, 3:5])
    write_parquet(tmp_path / "pq", tmp_path / "rec")
    inst = pq.read_table(tmp_path / "pq" / "instances.parquet")
    assert inst.num_rows == len(a.instances)


def test_one_rank_steps_cut_is_async_cut() -> None:
    # A collector's message holds one rank-step: its cut is computed in integers without
    # the general segmenting; it must equal `async_cut` row for row, ties in exit and
    # unknown exits included.
    from rankscope.diagnosis.arrivals import async_cut
    from rankscope.hub.partial import with_cut

    rng = np.random.default_rng(11)
    for _ in range(500):
        n = int(rng.integers(1, 40))
        enter = rng.integers(10**15, 10**15 + 10**6, n)
        exit_ = enter + rng.integers(0, 10**4, n)
        exit_[rng.random(n) < 0.2] = schema.NO_TIME
        if n > 2:
            exit_[1] = exit_[0]  # a tie
        flags = np.where(rng.random(n) < 0.7, schema.FLAG_ASYNC, 0).astype(np.int64)
        co = {"t_enter": enter, "t_exit": exit_, "step": np.full(n, 7), "flags": flags}
        got = with_cut(co, 3)["cut"]
        rows = np.flatnonzero(flags)
        want = np.full(n, schema.NO_TIME, np.int64)
        if rows.shape[0]:
            t0 = int(enter[rows].min())
            rel = async_cut(
                np.full(rows.shape[0], 3),
                co["step"][rows],
                enter[rows],
                flags[rows],
                t0,
                exit_[rows],
            )
            want[rows] = np.where(
                np.isnan(rel), schema.NO_TIME, t0 + np.nan_to_num(rel).astype(np.int64)
            )
        assert np.array_equal(got, want), (co, got, want)
