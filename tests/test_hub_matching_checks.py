"""The checks that send a block's parts to the rows path, on blocks large enough for the
fast paths of `diagnosis.blocks` (integer-key median, first-row arriver): a part that differs
from its sub-block in one middle row of ``seq``, ``step``, ``nbytes``, ``group`` or
``flags`` still gives the window ``build_window`` gives from the same rows."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from test_hub_job import BASE, assert_windows_equal, header, identity
from test_hub_matching import feed, paths, reference  # noqa: F401 (fixture)

from rankscope.collector import schema
from rankscope.diagnosis.blocks import block_nanmedian, match_block

RUN = "m1"
WORLD, STEPS, COLLS = 8, 4, 700
"""One step of all ranks is a (8, 700) block: the integer-key median applies."""


def job(
    tweak: Callable[[int, int, dict[str, np.ndarray]], None] | None = None, seed: int = 0
) -> tuple[list[bytes], list[bytes], dict, list[dict]]:
    """Messages of one world group (id 3), one step per message; ``tweak(rank, step,
    colls)`` edits a message's rows before it is encoded. Entry times have ties."""
    rng = np.random.default_rng(seed)
    groups = [{"id": 3, "name": "world", "ranks": list(range(WORLD))}]
    head = [schema.hello_message(header(RUN, r), identity(r, WORLD)) for r in range(WORLD)]
    head.append(schema.groups_message(header(RUN, 0), groups))
    body, raw_steps, raw_colls = [], [], []
    for s in range(STEPS):
        t0 = BASE + s * 100_000_000
        enter = t0 + 20_000 * np.arange(COLLS) + rng.integers(0, 4, (WORLD, COLLS)) * 1000
        exit_ = enter.max(axis=0) + 8_000 + rng.integers(0, 500, (WORLD, COLLS))
        for r in range(WORLD):
            st = schema.empty_table("steps", 1)
            st["step"][:] = s
            st["t_start"][:] = t0
            st["t_end"][:] = t0 + 90_000_000
            co = schema.empty_table("colls", COLLS)
            co["step"][:] = s
            co["group"][:] = 3
            co["seq"][:] = s * COLLS + np.arange(COLLS)
            co["nbytes"][:] = 1 << 20
            co["t_enter"][:] = enter[r]
            co["t_exit"][:] = exit_[r]
            co["t_start"][:] = enter.max(axis=0) + 1000
            co["t_end"][:] = enter.max(axis=0) + 5000 + 100 * r
            co["flags"][:] = 0
            if tweak is not None:
                tweak(r, s, co)
            body.append(schema.steps_message(header(RUN, r, batch=s), st, colls=co))
            raw_steps.append({**st, "rank": np.array([r], np.int32)})
            raw_colls.append({**co, "rank": np.full(COLLS, r, np.int32)})
    raw = {
        "steps": {k: np.concatenate([t[k] for t in raw_steps]) for k in raw_steps[0]},
        "colls": {k: np.concatenate([t[k] for t in raw_colls]) for k in raw_colls[0]},
    }
    return head, body, raw, groups


def _at(rank: int, step: int, fn: Callable[[dict[str, np.ndarray]], None]):
    def tweak(r: int, s: int, co: dict[str, np.ndarray]) -> None:
        if (r, s) == (rank, step):
            fn(co)

    return tweak


def _seq(co):
    co["seq"][COLLS // 2] += 10_000  # an instance no other rank has


def _step(co):
    co["step"][COLLS // 2] -= 1  # a step the rank has reported already


def _nbytes(co):
    co["nbytes"][COLLS // 2] = 1 << 10  # one member moves another size: the median


def _group(co):
    co["group"][COLLS // 2] = 4
    co["seq"][COLLS // 2] = 0  # the only call of group 4


def _flags(co):
    co["flags"][COLLS // 2] = schema.FLAG_DEVICE_TIMED


def _no_exit(co):
    co["t_exit"][COLLS // 2] = schema.NO_TIME  # NaN in the transfer median


@pytest.mark.parametrize(
    "tweak",
    [None, _seq, _step, _nbytes, _group, _flags, _no_exit],
    ids=["none", "seq", "step", "nbytes", "group", "flags", "no-exit"],
)
@pytest.mark.parametrize("settle_every", [0, 5])
def test_a_part_unlike_its_sub_block_in_one_middle_row(paths, tweak, settle_every) -> None:  # noqa: F811
    head, body, raw, groups = job(None if tweak is None else _at(2, 1, tweak))
    store = feed(head, body, settle_every=settle_every)
    want = reference(raw, groups, WORLD)
    assert_windows_equal(store.window(RUN), want, skip=("health", "clock_error_ns"))
    assert paths["blocks"] > 0
    # Instances of two steps that differ in one rank's seq or step cannot form a block.
    assert (paths["rows"] > 0) == (tweak in (_seq, _step, _group))


def test_parts_kept_across_passes_still_match_their_sub_block(paths) -> None:  # noqa: F811
    """Half a step's ranks in one pass, the rest in the next: the waiting parts are compared
    again, with the references they were kept with."""
    head, body, raw, groups = job()
    store = feed(head, body, settle_every=WORLD // 2)
    want = reference(raw, groups, WORLD)
    assert_windows_equal(store.window(RUN), want, skip=("health", "clock_error_ns"))
    assert paths["rows"] == 0 and store.totals(RUN).instances_complete == STEPS * COLLS


@pytest.mark.filterwarnings("ignore:All-NaN slice")
def test_block_median_and_last_arriver_on_large_blocks() -> None:
    rng = np.random.default_rng(3)
    for c, k in [(2, 4096), (16, 600), (200, 40)]:
        for nan, negative in [(0.0, 0.0), (0.0, 0.3), (0.2, 0.0)]:
            v = rng.integers(0, 50, (c, k)).astype(np.float64)  # many ties
            v[rng.random((c, k)) < negative] *= -1
            v[rng.random((c, k)) < nan] = np.nan
            v[:, 0] = np.nan  # a column without any value
            want = np.full(k, np.nan)
            want[1:] = np.nanmedian(v[:, 1:], axis=0)
            np.testing.assert_array_equal(block_nanmedian(v.copy()), want)
            np.testing.assert_array_equal(block_nanmedian(v.copy(), overwrite=True), want)
        enter = rng.integers(0, 3, (c, k)).astype(np.float64)  # ties at the latest entry
        exit_ = enter.max(axis=0) + rng.integers(0, 9, (c, k))
        ranks = np.sort(rng.choice(10 * c, c, replace=False)).astype(np.int64)
        m = match_block(enter.copy(), exit_, ranks[:, None])
        first_at_last = (enter == enter.max(axis=0)).argmax(axis=0)
        np.testing.assert_array_equal(m.last_row, first_at_last)
        np.testing.assert_array_equal(m.last_rank, ranks[first_at_last])
        np.testing.assert_array_equal(m.transfer, np.median(exit_ - enter.max(axis=0), axis=0))
