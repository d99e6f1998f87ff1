"""The store's matching pass (`hub.matching`): the block path, taken when every rank of a
group reports the same instances in the same order, gives the window that
``build_window`` gives from the same rows; anything irregular takes the rows path."""

from __future__ import annotations

import numpy as np
import pytest
from test_hub_job import BASE, assert_windows_equal, header, identity

from rankscope.collector import schema
from rankscope.diagnosis.arrivals import build_window
from rankscope.hub import matching
from rankscope.hub.intake import Intake
from rankscope.hub.store import Store

RUN = "m1"


def single_group_job(
    world: int = 4,
    steps: int = 6,
    colls: int = 5,
    *,
    per_message: int | list[int] = 1,
    missing: tuple[int, int, int] | None = None,
    async_first: bool = False,
    device: bool = False,
    unknown_exit: bool = False,
    seed: int = 0,
) -> tuple[list[bytes], list[bytes], dict[str, dict[str, np.ndarray]], list[dict]]:
    """Messages of a job whose collectives are all on the world group.

    Returns (hello + groups messages, steps messages in arrival order, raw tables, groups).
    ``missing`` = (rank, step, index) drops one row; ``per_message`` batches steps per
    message (one count for all ranks, or one per rank).
    """
    rng = np.random.default_rng(seed)
    groups = [{"id": 3, "name": "world", "ranks": list(range(world))}]
    head = [schema.hello_message(header(RUN, r), identity(r, world)) for r in range(world)]
    head.append(schema.groups_message(header(RUN, 0), groups))
    batches = [per_message] * world if isinstance(per_message, int) else per_message
    raw_steps, raw_colls = [], []
    tables: list[list[tuple[dict, dict]]] = [[] for _ in range(world)]
    for s in range(steps):
        t0 = BASE + s * 10_000_000
        enter = t0 + 1_000_000 * np.arange(1, colls + 1) + rng.integers(0, 30, (world, colls)) * 100
        for r in range(world):
            st = schema.empty_table("steps", 1)
            st["step"][:] = s
            st["t_start"][:] = t0 + r
            st["t_end"][:] = t0 + 9_000_000
            keep = np.ones(colls, bool)
            if missing is not None and missing[:2] == (r, s):
                keep[missing[2]] = False
            co = schema.empty_table("colls", int(keep.sum()))
            co["step"][:] = s
            co["group"][:] = 3
            co["seq"][:] = (s * colls + np.arange(colls))[keep]
            co["nbytes"][:] = 4096
            co["t_enter"][:] = enter[r][keep]
            exit_ = enter.max(axis=0) + 200_000 + rng.integers(0, 30, colls) * 100
            if unknown_exit and r == 1:
                exit_[0] = schema.NO_TIME
            co["t_exit"][:] = exit_[keep]
            flags = np.zeros(colls, np.int32)
            if async_first:
                flags[0] = schema.FLAG_ASYNC | schema.FLAG_DDP_BUCKET
            if device:
                flags |= schema.FLAG_DEVICE_TIMED
                co["t_start"][:] = (enter.max(axis=0) + 1000)[keep]
                co["t_end"][:] = (enter.max(axis=0) + 150_000 + 100 * r)[keep]
            co["flags"][:] = flags[keep]
            tables[r].append((st, co))
            raw_steps.append({**st, "rank": np.array([r], np.int32)})
            raw_colls.append({**co, "rank": np.full(co["step"].shape[0], r, np.int32)})
    body = []
    for r in range(world):
        for i in range(0, steps, batches[r]):
            chunk = tables[r][i : i + batches[r]]
            st = {k: np.concatenate([c[0][k] for c in chunk]) for k in chunk[0][0]}
            co = {k: np.concatenate([c[1][k] for c in chunk]) for k in chunk[0][1]}
            body.append((i, r, schema.steps_message(header(RUN, r, batch=i), st, colls=co)))
    body.sort(key=lambda x: (x[0], x[1]))
    raw = {
        "steps": {k: np.concatenate([t[k] for t in raw_steps]) for k in raw_steps[0]},
        "colls": {k: np.concatenate([t[k] for t in raw_colls]) for k in raw_colls[0]},
    }
    return head, [m for _, _, m in body], raw, groups


def reference(raw, groups, world: int, run: str = RUN):
    ids = {r: {**identity(r, world), "incarnation": 0} for r in range(world)}
    return build_window(job="j", run=run, identities=ids, groups=groups, **raw)


def feed(head, body, order=None, settle_every: int = 0, **kw) -> Store:
    store = Store(raw_steps=100, **kw)
    intake = Intake(store)
    for m in head:
        assert intake.feed(m, 0)
    # The receive clock advances 10 s a message: a rank that stops sending is silent for
    # longer than the store's lag hold (`store.LAG_HOLD_S`) after a few more messages.
    for i, j in enumerate(order if order is not None else range(len(body))):
        assert intake.feed(body[j], (i + 1) * 10_000_000_000)
        if settle_every and i % settle_every == settle_every - 1:
            store.settle()  # partial steps: blocks wait, whole, for their other ranks
    return store


@pytest.fixture
def paths(monkeypatch):
    """Counts the blocks (one at a time, or several together) and row passes the store
    runs."""
    seen = {"blocks": 0, "rows": 0, "together": 0}
    settle_block, settle_blocks = matching._settle_block, matching._settle_blocks
    settle_rows = matching._settle_rows

    def block(*a, **k):
        seen["blocks"] += 1
        return settle_block(*a, **k)

    def blocks(run, batch, *a, **k):
        seen["blocks"] += len(batch)
        seen["together"] += 1
        return settle_blocks(run, batch, *a, **k)

    def rows(*a, **k):
        seen["rows"] += 1
        return settle_rows(*a, **k)

    monkeypatch.setattr(matching, "_settle_block", block)
    monkeypatch.setattr(matching, "_settle_blocks", blocks)
    monkeypatch.setattr(matching, "_settle_rows", rows)
    return seen


@pytest.mark.parametrize("settle_every", [0, 1, 3, 5])
def test_blocks_equal_build_window(paths, settle_every: int) -> None:
    head, body, raw, groups = single_group_job(world=4, steps=6, colls=5)
    store = feed(head, body, settle_every=settle_every)
    assert_windows_equal(
        store.window(RUN), reference(raw, groups, 4), skip=("health", "clock_error_ns")
    )
    assert paths["blocks"] > 0 and paths["rows"] == 0
    totals = store.totals(RUN)
    assert totals.instances_complete == 30 and totals.instances_incomplete == 0


@pytest.mark.parametrize(
    "kw",
    [
        {"async_first": True},
        {"device": True},
        {"unknown_exit": True},
        {"per_message": 2},
        {"per_message": 3, "steps": 7},
    ],
    ids=["async", "device", "unknown-exit", "two-steps-a-message", "ragged-last-message"],
)
def test_blocks_cover_async_device_unknown_exit_and_batched_steps(paths, kw) -> None:
    head, body, raw, groups = single_group_job(world=3, **kw)
    order = np.random.default_rng(1).permutation(len(body))
    store = feed(head, body, order=order, settle_every=2)
    assert_windows_equal(
        store.window(RUN), reference(raw, groups, 3), skip=("health", "clock_error_ns")
    )
    assert paths["blocks"] > 0 and paths["rows"] == 0


@pytest.mark.parametrize(
    "kw",
    [
        {"missing": (2, 3, 1)},  # a rank lacks one instance: its step's block is refused
        {"per_message": [1, 2, 1, 3]},  # ranks batch steps differently: keys collide
    ],
    ids=["missing-row", "different-batching"],
)
def test_irregular_parts_take_the_rows_path_with_the_same_result(paths, kw) -> None:
    head, body, raw, groups = single_group_job(world=4, steps=6, **kw)
    store = feed(head, body, settle_every=3)
    want = reference(raw, groups, 4)
    assert_windows_equal(store.window(RUN), want, skip=("health", "clock_error_ns"))
    assert paths["rows"] > 0
    if "missing" in kw:  # the instance without rank 2 never completes
        assert (store.window(RUN).instances.n_arrived < 4).sum() == 1


def test_incomplete_blocks_close_when_stale() -> None:
    head, body, _, _ = single_group_job(world=4, steps=12, colls=3)
    rank3 = [m for m in body if schema.decode(m).header["rank"] == 3]
    # Rank 3 stops after step 1: later instances never complete and close once stale.
    store = feed(head, [m for m in body if m not in rank3[2:]], settle_every=4, stale_steps=4)
    totals = store.totals(RUN)
    assert totals.instances_complete == 2 * 3
    assert totals.instances_incomplete == (12 - 2 - 4) * 3  # steps 2..7 are 4 behind 11
    w = store.window(RUN)
    assert (w.instances.n_arrived[w.instances.step >= 8] == 3).all()  # still open
    assert w.coll["times_last"][:3, 2:].sum() == 0 and np.isnan(w.coll["n"][3, 2:]).all()
    assert w.coll["n"][:3, 2:].sum() == 10 * 3 * 3  # calls count at once, complete or not


def test_columns_trim_moves_past_a_leading_run_and_compacts_stragglers_later() -> None:
    from rankscope.hub.columns import Columns

    table = Columns({"step": np.int64, "x": np.float64}, 16)
    table.append({"step": np.arange(10), "x": np.arange(10) * 1.5}, 10)
    before = table.view()["step"]
    table.trim(table.view()["step"] >= 4)
    assert table.view()["step"].tolist() == [4, 5, 6, 7, 8, 9]
    assert np.shares_memory(table.view()["step"], before)  # no copy for a leading run
    table.append({"step": np.array([1, 12]), "x": 0.0}, 2)  # a straggler closed late
    table.trim(table.view()["step"] >= 5)
    assert table.view()["step"].tolist() == [5, 6, 7, 8, 9, 1, 12]  # 1 of 7: kept for now
    table.trim(table.view()["step"] >= 9)
    assert table.view()["step"].tolist() == [9, 12]  # 1 of 3 stale: compacted
    assert table.view()["x"].tolist() == [13.5, 0.0]
    table.append({"step": np.arange(20, 40), "x": 1.0}, 20)  # grows past the capacity
    assert table.view()["step"].tolist() == [9, 12, *range(20, 40)]


def test_columns_with_a_limit_grow_to_what_the_rows_need_not_to_twice_the_bound() -> None:
    from rankscope.hub.columns import Columns

    free = Columns({"x": np.int64}, 16)
    bounded = Columns({"x": np.int64}, 16, limit=1000)
    for table in (free, bounded):
        for k in range(11):  # 1,100 rows in batches of 100, the owner trimming nothing yet
            table.append({"x": np.arange(100) + 100 * k}, 100)
    assert free.capacity == 2048  # doubled past what the rows need
    assert bounded.capacity == 1100 + 1100 // 4  # a quarter of headroom, not 2,048
    assert bounded.view()["x"].tolist() == list(range(1100))
    bounded.append({"x": np.arange(1100, 1600)}, 500)
    assert bounded.capacity == 1600 + 1600 // 4
    assert bounded.view()["x"].tolist() == list(range(1600))
