"""The compiled pass over the usual block (`diagnosis.block_kernel`) gives, to the bit,
what `match_block` and `block_sums` give; anything unusual is refused so that the numpy
path serves it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rankscope.diagnosis import block_kernel
from rankscope.diagnosis.blocks import block_sums, match_block

BASE = 1_700_000_000_000_000_000


@pytest.fixture(scope="module")
def compiled() -> None:
    block_kernel.warm(background=False)
    assert block_kernel.ready(), "numba is a dependency: the kernel must compile"


def numpy_path(enter, exit_, t0, starts, ranks):
    e = (enter - t0).astype(np.float64)
    x = (exit_ - t0).astype(np.float64)
    m = match_block(e, x, ranks[:, None])
    return m, block_sums(e, x, m, starts)


def assert_same(got, want) -> None:
    (gm, gs), (wm, ws) = got, want
    for name in ("first", "last", "last_row", "last_rank", "transfer", "device_transfer"):
        np.testing.assert_array_equal(getattr(gm, name), getattr(wm, name), err_msg=name)
    np.testing.assert_array_equal(gm.margin, wm.margin)
    assert gm.exits_after_last and wm.exits_after_last
    assert gs.keys() == ws.keys()
    for name in ws:
        np.testing.assert_array_equal(gs[name], ws[name], err_msg=name)


def random_block(rng, c: int, k: int, spread: int):
    t = BASE + np.arange(k) * 20_000
    enter = t[None, :] + rng.integers(0, spread, (c, k))
    exit_ = enter.max(axis=0) + rng.integers(0, spread, (c, k))
    ranks = np.sort(rng.choice(8192, c, replace=False)).astype(np.int64)
    cuts = rng.integers(0, k, int(rng.integers(0, 8)))
    starts = np.unique(np.concatenate([[0], cuts])).astype(np.int64)
    return enter, exit_, ranks, starts, BASE - int(rng.integers(0, 10**9))


@pytest.mark.parametrize("n", range(1, 21))
def test_network_sorts_every_zero_one_input(n: int) -> None:
    # A comparator network sorts every input once it sorts every 0/1 input.
    a, b = block_kernel.network(n)
    assert ((a < b) & (b < n)).all()
    for bits in itertools.product((0, 1), repeat=n) if n <= 14 else []:
        v = list(bits)
        for x, y in zip(a.tolist(), b.tolist()):
            if v[x] > v[y]:
                v[x], v[y] = v[y], v[x]
        assert v == sorted(v), bits


@pytest.mark.parametrize("n", [15, 16, 17, 31, 64, 100, 128])
def test_network_sorts_random_values(n: int) -> None:
    rng = np.random.default_rng(n)
    a, b = block_kernel.network(n)
    for _ in range(200):
        v = rng.integers(0, 4, n).astype(float)
        w = v.copy()
        for x, y in zip(a.tolist(), b.tolist()):
            if w[x] > w[y]:
                w[x], w[y] = w[y], w[x]
        np.testing.assert_array_equal(w, np.sort(v))


@pytest.mark.parametrize("c", [1, 2, 3, 5, 16, 17, 64, 128, 129, 300])
def test_compiled_pass_equals_the_numpy_definitions(compiled, c: int) -> None:
    rng = np.random.default_rng(c)
    for _ in range(12):
        k = int(rng.integers(1, 2_000 if c <= 64 else 150))
        # A narrow spread makes ties at the last entry common (lowest rank, zero margin).
        spread = int(rng.choice([3, 5_000]))
        enter, exit_, ranks, starts, t0 = random_block(rng, c, k, spread)
        got = block_kernel.usual_block(enter, exit_, t0, starts, ranks)
        assert got is not None
        assert_same(got, numpy_path(enter, exit_, t0, starts, ranks))


def test_uncompiled_pass_is_the_same_code(compiled) -> None:
    rng = np.random.default_rng(7)
    for c, k in [(1, 5), (4, 40), (9, 700), (130, 3)]:  # 700 > one tile at c=9
        enter, exit_, ranks, starts, t0 = random_block(rng, c, k, 50)
        got = block_kernel.usual_block(enter, exit_, t0, starts, ranks, kernel=block_kernel._pass)
        assert got is not None
        assert_same(got, numpy_path(enter, exit_, t0, starts, ranks))


def test_ties_pick_the_lowest_rank_and_a_zero_margin(compiled) -> None:
    enter = np.full((3, 2), BASE + 100, np.int64)
    enter[0, 1] = BASE + 50
    exit_ = enter.max(axis=0) + np.array([[5], [7], [9]])
    m, sums = block_kernel.usual_block(enter, exit_, BASE, np.array([0]), np.array([2, 5, 9]))
    assert m.last_rank.tolist() == [2, 5] and m.margin.tolist() == [0.0, 0.0]
    assert m.transfer.tolist() == [7.0, 7.0]
    assert sums["times_last"][:, 0].tolist() == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("where", ["unknown exit", "exit before the last entry"])
def test_unusual_blocks_are_refused(compiled, where: str) -> None:
    rng = np.random.default_rng(3)
    enter, exit_, ranks, starts, t0 = random_block(rng, 4, 600, 5_000)
    exit_[2, 555] = -1 if where == "unknown exit" else enter[:, 555].max() - 1
    assert block_kernel.usual_block(enter, exit_, t0, starts, ranks) is None


def test_sums_that_float64_cannot_hold_exactly_are_refused(compiled) -> None:
    enter = np.array([[BASE, BASE + 1]], np.int64)
    exit_ = enter + 10
    assert block_kernel.usual_block(enter, exit_, BASE, np.array([0]), np.array([0])) is not None
    # Relative times near 2**53 / k: the numpy path sums them with rounding of its own.
    far = BASE - 2**52
    assert block_kernel.usual_block(enter, exit_, far, np.array([0]), np.array([0])) is None


def test_without_the_kernel_nothing_is_computed(monkeypatch) -> None:
    monkeypatch.setattr(block_kernel, "_kernel", None)
    enter = np.array([[BASE]], np.int64)
    assert block_kernel.usual_block(enter, enter + 1, BASE, np.array([0]), np.array([0])) is None
