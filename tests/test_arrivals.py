"""Arrival matching (ARCHITECTURE §6) against small cases computed by hand."""

import numpy as np
import pytest

from rankscope.collector import schema
from rankscope.diagnosis import arrivals
from rankscope.diagnosis.arrivals import (
    async_cut,
    match,
    rank_step_aggregates,
    row_contributions,
    segment_nanmedian,
)

NT = schema.NO_TIME


def rows(*entries: tuple) -> dict[str, np.ndarray]:
    """Rows from (rank, step, group, seq, t_enter, t_exit[, flags, t_start, t_end, nbytes])."""
    out = {c: [] for c in arrivals.ROW_COLUMNS}
    for e in entries:
        rank, step, group, seq, enter, exit_ = e[:6]
        flags = e[6] if len(e) > 6 else 0
        t_start = e[7] if len(e) > 7 else NT
        t_end = e[8] if len(e) > 8 else NT
        nbytes = e[9] if len(e) > 9 else 1024
        for c, v in (
            ("rank", rank),
            ("step", step),
            ("op", schema.OP_INDEX["all_reduce"]),
            ("group", group),
            ("seq", seq),
            ("nbytes", nbytes),
            ("t_enter", enter),
            ("t_start", t_start),
            ("t_end", t_end),
            ("t_exit", exit_),
            ("flags", flags),
        ):
            out[c].append(v)
    dts = {"rank": np.int32, **schema.COLL_COLUMNS}
    return {c: np.array(v, dtype=dts[c]) for c, v in out.items()}


def test_first_last_margin_skew_transfer_by_hand() -> None:
    r = rows(
        (2, 5, 0, 0, 200, 410),
        (0, 5, 0, 0, 100, 400),
        (1, 5, 0, 0, 300, 420),
    )
    m = match(r, {0: 3})
    inst = m.instances
    assert len(inst) == 1
    assert inst.first.tolist() == [100.0]
    assert inst.last.tolist() == [300.0]
    assert inst.last_rank.tolist() == [1]
    assert inst.margin.tolist() == [100.0]  # 300 - 200
    assert inst.skew.tolist() == [200.0]
    assert inst.transfer.tolist() == [110.0]  # median(110, 100, 120)
    assert inst.n_arrived.tolist() == [3] and inst.n_members.tolist() == [3]
    assert m.complete.tolist() == [True]
    assert m.row_is_last.tolist() == [False, False, True]
    assert m.row_first.tolist() == [100.0] * 3
    assert np.isnan(inst.device_transfer).all()
    assert inst.step.tolist() == [5]


def test_overstay_is_the_time_in_a_collective_after_the_first_member_left() -> None:
    # Rank 0 arrives last but leaves 300 ns after the others: its process was held there.
    r = rows(
        (0, 5, 0, 0, 300, 700),
        (1, 5, 0, 0, 100, 400),
        (2, 5, 0, 0, 200, 410),
    )
    m = match(r, {0: 3})
    got = row_contributions(r, m)
    assert got["overstay_ns"].tolist() == [300.0, 0.0, 10.0]
    # Never more than the row's own transfer, and nothing before the instance completes.
    assert np.all(got["overstay_ns"] <= got["exposed_transfer_ns"])
    half = {k: v[1:] for k, v in r.items()}
    assert row_contributions(half, match(half, {0: 3}))["overstay_ns"].tolist() == [0.0, 0.0]


def test_ties_go_to_the_lowest_rank_and_give_zero_margin() -> None:
    r = rows(
        (2, 0, 0, 0, 500, 600),
        (1, 0, 0, 0, 500, 600),
        (0, 0, 0, 0, 500, 600),
        (0, 0, 0, 1, 600, 800),
        (2, 0, 0, 1, 700, 800),
        (1, 0, 0, 1, 700, 800),
    )
    m = match(r, {0: 3})
    assert m.instances.last_rank.tolist() == [0, 1]
    assert m.instances.margin.tolist() == [0.0, 0.0]
    assert m.instances.skew.tolist() == [0.0, 100.0]
    # Exactly one last arriver per instance, even with ties.
    assert m.row_is_last.tolist() == [False, False, True, False, False, True]


def test_incomplete_instances_and_unknown_groups() -> None:
    r = rows(
        (0, 1, 0, 7, 10, 50),
        (2, 1, 0, 7, 30, 50),
        (0, 1, 9, 0, 10, 20),
    )
    m = match(r, {0: 3})
    assert m.instances.group.tolist() == [0, 9]
    assert m.instances.n_arrived.tolist() == [2, 1]
    assert m.instances.n_members.tolist() == [3, -1]
    assert m.complete.tolist() == [False, False]
    assert np.isnan(m.instances.margin[1])  # one row: no runner-up
    agg = rank_step_aggregates(r, m, 3, np.array([1]))
    # Incomplete instances count calls and time inside, nothing else.
    assert agg["n"][:, 0].tolist() == [2.0, 0.0, 1.0]
    assert agg["coll_ns"][:, 0].tolist() == [50.0, 0.0, 20.0]
    for name in ("wait_ns", "transfer_ns", "late_ns", "times_last"):
        assert not agg[name].any(), name


def test_device_transfer_uses_device_timed_rows_only() -> None:
    d = schema.FLAG_DEVICE_TIMED
    r = rows(
        (0, 0, 0, 0, 100, 900, d, 200, 700),
        (1, 0, 0, 0, 150, 900, d, 400, 650),
        (2, 0, 0, 0, 120, 900, 0),
    )
    m = match(r, {0: 3})
    # max t_start = 400; t_end - 400 over the two timed rows: 300, 250 -> median 275.
    assert m.instances.device_transfer.tolist() == [275.0]
    assert m.instances.transfer.tolist() == [750.0]


def test_nbytes_is_the_median_and_op_the_first_rows() -> None:
    r = rows(
        (0, 0, 0, 0, 1, 9, 0, NT, NT, 100),
        (1, 0, 0, 0, 2, 9, 0, NT, NT, 300),
        (2, 0, 0, 0, 3, 9, 0, NT, NT, 200),
    )
    assert match(r, {0: 3}).instances.nbytes.tolist() == [200]


def test_aggregates_of_blocking_collectives_by_hand() -> None:
    r = rows(
        (0, 5, 0, 0, 100, 400),
        (1, 5, 0, 0, 300, 420),
        (0, 5, 0, 1, 500, 700),
        (1, 5, 0, 1, 450, 700),
    )
    m = match(r, {0: 2})
    agg = rank_step_aggregates(r, m, 2, np.array([5]))
    assert agg["n"][:, 0].tolist() == [2.0, 2.0]
    assert agg["coll_ns"][:, 0].tolist() == [300.0 + 200.0, 120.0 + 250.0]
    assert agg["wait_ns"][:, 0].tolist() == [200.0, 50.0]
    assert agg["transfer_ns"][:, 0].tolist() == [100.0 + 200.0, 120.0 + 200.0]
    assert agg["late_ns"][:, 0].tolist() == [50.0, 200.0]
    assert agg["times_last"][:, 0].tolist() == [1.0, 1.0]
    # Blocking: everything is exposed.
    assert agg["exposed_wait_ns"].tolist() == agg["wait_ns"].tolist()
    assert agg["exposed_transfer_ns"].tolist() == agg["transfer_ns"].tolist()
    # Per row, wait + transfer is the time inside the collective.
    total = agg["wait_ns"] + agg["transfer_ns"]
    assert total.tolist() == agg["coll_ns"].tolist()


def test_async_rows_expose_only_what_follows_the_last_async_issue() -> None:
    a = schema.FLAG_ASYNC
    b = schema.FLAG_DDP_BUCKET
    r = rows(
        # rank 0 issues two buckets at 100 and 200; the cut is 200.
        (0, 1, 0, 0, 100, 400, b),
        (1, 1, 0, 0, 250, 400, b),
        (0, 1, 0, 1, 200, 500, a),
        (1, 1, 0, 1, 150, 500, a),
        (0, 1, 0, 2, 600, 700),
        (1, 1, 0, 2, 600, 700),
    )
    cut = async_cut(r["rank"], r["step"], r["t_enter"], r["flags"])
    assert cut.tolist() == [200.0, 250.0, 200.0, 250.0, 200.0, 250.0]
    m = match(r, {0: 2})
    c = row_contributions(r, m, cut)
    # Row 0: waits [100, 250] -> 50 after the cut; transfer [250, 400] -> all 150 exposed.
    # Row 1 (rank 1, enters last at 250 = its cut): no wait; transfer [250, 400] -> 150.
    # Row 2: last 200, waits 0; transfer [200, 500] -> cut 200 -> 300.
    # Row 3 (rank 1, cut 250): waits [150, 200] -> 0 exposed; transfer [200, 500] -> 250.
    # Blocking rows 4, 5: no wait, transfer 100 each, all exposed.
    assert c["wait_ns"].tolist() == [150.0, 0.0, 0.0, 50.0, 0.0, 0.0]
    assert c["exposed_wait_ns"].tolist() == [50.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert c["transfer_ns"].tolist() == [150.0, 150.0, 300.0, 300.0, 100.0, 100.0]
    assert c["exposed_transfer_ns"].tolist() == [150.0, 150.0, 300.0, 250.0, 100.0, 100.0]


def test_overlapping_async_rows_are_exposed_once() -> None:
    """Buckets still in flight after the last issue are nested intervals [cut, exit]: each
    row is charged only the piece after the previous exit, so the shares add up to the
    union [cut, last exit], not once per bucket."""
    a = schema.FLAG_ASYNC
    b = schema.FLAG_DDP_BUCKET
    r = rows(
        (0, 1, 0, 0, 100, 400, b),
        (1, 1, 0, 0, 250, 400, b),
        (0, 1, 0, 1, 200, 500, a),
        (1, 1, 0, 1, 150, 500, a),
        (0, 1, 0, 2, 600, 700),
        (1, 1, 0, 2, 600, 700),
    )
    start = async_cut(r["rank"], r["step"], r["t_enter"], r["flags"], t_exit=r["t_exit"])
    # Row 2 ends after row 0 (rank 0) and row 3 after row 1 (rank 1): they start at 400.
    assert start[:4].tolist() == [200.0, 250.0, 400.0, 400.0]
    m = match(r, {0: 2})
    c = row_contributions(r, m)  # computes the same starts from the rows
    # Row 0: piece [200, 400] = wait [200, 250] + transfer [250, 400].
    # Row 2: piece [400, 500], all transfer (its instance was complete at 200).
    # Rank 1: row 1 [250, 400] transfer, row 3 [400, 500] transfer.
    assert c["exposed_wait_ns"].tolist() == [50.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert c["exposed_transfer_ns"].tolist() == [150.0, 150.0, 100.0, 100.0, 100.0, 100.0]
    agg = rank_step_aggregates(r, m, 2, np.array([1]))
    exposed = agg["exposed_wait_ns"] + agg["exposed_transfer_ns"]
    # Union after the cut plus the blocking row: rank 0 [200, 500] + 100, rank 1 [250, 500] + 100.
    assert exposed[:, 0].tolist() == [400.0, 350.0]
    # The unexposed sums still count every row whole.
    assert agg["transfer_ns"][:, 0].tolist() == [550.0, 550.0]


def test_epochs_keep_restarted_sequences_apart() -> None:
    r = rows((0, 0, 0, 0, 10, 20), (1, 0, 0, 0, 15, 20), (0, 9, 0, 0, 99, 120))
    m = match(r, {0: 2}, epoch=np.array([0, 0, 1]))
    assert m.instances.n_arrived.tolist() == [2, 1]
    assert m.complete.tolist() == [True, False]


def test_int_times_are_made_relative_and_unknown_exit_is_nan() -> None:
    base = 1_700_000_000_000_000_000
    r = rows((0, 0, 0, 0, base + 10, base + 30), (1, 0, 0, 0, base + 20, NT))
    m = match(r, {0: 2}, t0_ns=base)
    assert m.instances.first.tolist() == [10.0]
    assert m.instances.transfer.tolist() == [10.0]  # only the known exit counts
    assert m.t0_ns == base


def test_bad_rows_name_the_problem() -> None:
    r = rows((0, 0, 0, 0, 10, 30))
    del r["seq"]
    with pytest.raises(ValueError, match="'seq'"):
        match(r, {0: 1})
    r = rows((0, 0, 0, 0, 10, 30), (1, 0, 0, 0, 10, 30))
    r["flags"] = r["flags"][:1]
    with pytest.raises(ValueError, match="'flags'"):
        match(r, {0: 1})
    r = rows((0, 0, 0, 0, NT, 30))
    with pytest.raises(ValueError, match="t_enter"):
        match(r, {0: 1})


def test_empty_rows() -> None:
    m = match(rows(), {0: 2})
    assert len(m.instances) == 0 and m.row_instance.shape == (0,)


@pytest.mark.parametrize("n_sizes", [3, 40])
def test_segment_nanmedian_agrees_with_numpy(n_sizes: int) -> None:
    rng = np.random.default_rng(n_sizes)
    counts = rng.integers(1, n_sizes + 1, size=300)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    values = rng.normal(size=counts.sum())
    values[rng.random(values.shape[0]) < 0.2] = np.nan
    got = segment_nanmedian(values, starts, counts)
    for i, (s, c) in enumerate(zip(starts, counts)):
        seg = values[s : s + c]
        want = np.nan if np.isnan(seg).all() else np.nanmedian(seg)
        assert got[i] == pytest.approx(want, nan_ok=True)


def test_large_keys_fall_back_to_lexsort() -> None:
    big = 2**61
    r = rows((0, 0, 0, big, 10, 30), (1, 0, 0, big, 20, 30), (0, 0, 0, 0, 5, 30))
    r["group"] = np.array([2**30, 2**30, 0], dtype=np.int32)
    m = match(r, {2**30: 2, 0: 2})
    assert m.instances.group.tolist() == [0, 2**30]
    assert m.instances.n_arrived.tolist() == [1, 2]
    assert m.instances.last_rank.tolist() == [0, 1]


def test_segment_nanmedian_equal_sizes_with_and_without_nan() -> None:
    rng = np.random.default_rng(7)
    values = rng.normal(size=16 * 50)
    starts = np.arange(0, values.shape[0], 16)
    counts = np.full(50, 16)
    np.testing.assert_array_equal(
        segment_nanmedian(values, starts, counts), np.median(values.reshape(50, 16), axis=1)
    )
    values[rng.random(values.shape[0]) < 0.3] = np.nan
    values[:16] = np.nan
    got = segment_nanmedian(values, starts, counts)
    assert np.isnan(got[0])
    np.testing.assert_allclose(got[1:], np.nanmedian(values.reshape(50, 16)[1:], axis=1))
