"""Block matching (`diagnosis.blocks`) agrees with row matching on any block."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rankscope.collector import schema
from rankscope.diagnosis.arrivals import ROW_COLUMNS, match, row_contributions
from rankscope.diagnosis.blocks import block_nanmedian, block_sums, match_block


@st.composite
def blocks(draw):
    """A block of c ranks x k instances of one group: integer times with ties, some unknown
    exits (or exits before the last entry), optional device times."""
    c = draw(st.integers(1, 6))
    k = draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ranks = np.sort(rng.choice(50, c, replace=False))
    enter = rng.integers(0, 8, (c, k)) * 1000  # few values: ties are common
    exit_ = enter.max(axis=0) + rng.integers(0, 500, (c, k))
    if draw(st.booleans()):
        exit_ = np.where(rng.random((c, k)) < 0.2, schema.NO_TIME, exit_)
    if draw(st.booleans()):
        exit_ = np.where(rng.random((c, k)) < 0.2, enter + 10, exit_)  # before the last entry
    flags = np.zeros((c, k), np.int32)
    if draw(st.booleans()):
        flags[rng.random((c, k)) < 0.5] |= schema.FLAG_DEVICE_TIMED
    return ranks, enter, exit_, flags, rng


def as_rows(ranks, enter, exit_, flags, rng):
    """The block as collective rows, in a random order."""
    c, k = enter.shape
    rows = {
        "rank": np.repeat(ranks, k).astype(np.int32),
        "step": np.zeros(c * k, np.int64),
        "op": np.zeros(c * k, np.int8),
        "group": np.zeros(c * k, np.int32),
        "seq": np.tile(np.arange(k), c),
        "nbytes": np.full(c * k, 64, np.int64),
        "t_enter": enter.reshape(-1),
        "t_start": (enter.max(axis=0)[None, :] + 5 + np.zeros((c, 1), np.int64)).reshape(-1),
        "t_end": (enter.max(axis=0)[None, :] + 50 + 7 * np.arange(c)[:, None]).reshape(-1),
        "t_exit": exit_.reshape(-1),
        "flags": flags.reshape(-1),
    }
    order = rng.permutation(c * k)
    return {name: rows[name][order] for name in ROW_COLUMNS}


def relative(t):
    out = t.astype(np.float64)
    out[t == schema.NO_TIME] = np.nan
    return out


@settings(max_examples=80, deadline=None)
@given(blocks())
def test_match_block_equals_match_of_the_rows(block) -> None:
    ranks, enter, exit_, flags, rng = block
    c, k = enter.shape
    rows = as_rows(ranks, enter, exit_, flags, rng)
    want = match(rows, {0: c}).instances
    t_start = relative(enter.max(axis=0)[None, :] + 5 + np.zeros((c, 1), np.int64))
    t_end = relative(enter.max(axis=0)[None, :] + 50 + 7 * np.arange(c)[:, None])
    got = match_block(
        relative(enter),
        relative(exit_),
        ranks[:, None].astype(np.int64),
        flags=flags,
        t_start=t_start,
        t_end=t_end,
    )
    for name in ("first", "last", "margin", "transfer", "device_transfer"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    np.testing.assert_array_equal(got.last_rank, want.last_rank)
    np.testing.assert_array_equal(ranks[got.last_row], want.last_rank)
    # Ranks given per cell (not sorted) pick the same last arriver.
    perm = rng.permutation(c)
    again = match_block(
        relative(enter[perm]), relative(exit_[perm]), np.repeat(ranks[perm, None], k, axis=1)
    )
    np.testing.assert_array_equal(again.last_rank, want.last_rank)
    np.testing.assert_array_equal(again.margin, want.margin)


@settings(max_examples=80, deadline=None)
@given(blocks(), st.booleans(), st.booleans())
def test_block_sums_equal_the_row_shares_summed(block, done, asynchronous) -> None:
    ranks, enter, exit_, _, rng = block
    c, k = enter.shape
    e, x = relative(enter), relative(exit_)
    m = match_block(e, x, ranks[:, None].astype(np.int64))
    cuts = int(rng.integers(1, k + 1))
    starts = np.unique(np.concatenate([[0], rng.integers(0, k, cuts)]))
    is_async = cut = None
    if asynchronous:
        is_async = rng.random((c, k)) < 0.5
        cut = np.where(rng.random((c, 1)) < 0.7, e.max(axis=1, keepdims=True) - 500.0, np.nan)
        cut = np.broadcast_to(cut, (c, k))
    got = block_sums(e, x, m if done else None, starts, is_async, cut)
    # Reference: the row shares of a one-instance-per-column match, summed per run.
    rows = {
        "rank": np.repeat(ranks, k).astype(np.int32),
        "step": np.tile(np.searchsorted(starts, np.arange(k), side="right") - 1, c),
        "group": np.zeros(c * k, np.int32),
        "seq": np.tile(np.arange(k), c),
        "op": np.zeros(c * k, np.int8),
        "nbytes": np.ones(c * k, np.int64),
        "t_enter": enter.reshape(-1),
        "t_start": np.full(c * k, schema.NO_TIME),
        "t_end": np.full(c * k, schema.NO_TIME),
        "t_exit": exit_.reshape(-1),
        "flags": np.zeros(c * k, np.int32)
        if is_async is None
        else np.where(is_async.reshape(-1), schema.FLAG_ASYNC, 0).astype(np.int32),
    }
    matched = match(rows, {0: c if done else c + 1})
    shares = row_contributions(rows, matched, None if cut is None else cut.reshape(-1))
    run = rows["step"]
    for name, sums in got.items():
        want = np.zeros((c, starts.shape[0]))
        np.add.at(want, (np.repeat(np.arange(c), k), run), shares[name])
        np.testing.assert_array_equal(sums, want, err_msg=name)


def test_block_nanmedian_agrees_with_numpy() -> None:
    rng = np.random.default_rng(2)
    for c in (1, 2, 5, 16):
        v = rng.normal(size=(c, 40))
        v[rng.random((c, 40)) < 0.3] = np.nan
        want = np.full(40, np.nan)
        ok = ~np.isnan(v).all(axis=0)
        want[ok] = np.nanmedian(v[:, ok], axis=0)
        np.testing.assert_allclose(block_nanmedian(v.copy()), want, equal_nan=True)
        np.testing.assert_allclose(block_nanmedian(v.copy(), overwrite=True), want, equal_nan=True)
