"""Messages that mix groups (a rank's tensor-parallel calls and its data-parallel buckets in
one message, as the simulator and real hybrid-parallel jobs send them): the matching pass
splits each into one piece per group, so they take the block path, and the store ends with
exactly the window that ``build_window`` (the rows path, `diagnosis.arrivals.match`) gives
from the same rows, whatever the arrival order, batching and pass timing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hub_job import BASE, assert_windows_equal, header, identity
from test_hub_matching import feed, paths, reference  # noqa: F401  (paths: a fixture)

from rankscope.collector import schema
from rankscope.hub import matching
from rankscope.hub.intake import Intake
from rankscope.hub.pending import Part, prepare

RUN = "mixed"
BUCKET = schema.FLAG_ASYNC | schema.FLAG_DDP_BUCKET


def hybrid_job(
    world: int = 8,
    tp: int = 2,
    steps: int = 4,
    layers: int = 6,
    buckets: int = 3,
    *,
    per_message: int = 1,
    device: bool = False,
    blocking_buckets: bool = False,
    unknown_exit: bool = False,
    missing: tuple[int, int, int] | None = None,
    tweak=None,
    seed: int = 0,
):
    """Messages of a job with tensor-parallel groups (``tp`` consecutive ranks) and
    data-parallel groups (ranks with the same tp index); each rank's message interleaves
    its tp calls with its dp gradient buckets (asynchronous unless ``blocking_buckets``).

    Returns (hello + groups messages, steps messages, raw tables, group table).
    ``missing`` = (rank, step, row) drops one row of one message; ``tweak(rank, step,
    colls)`` edits a message's rows before it is encoded.
    """
    rng = np.random.default_rng(seed)
    n_tp = world // tp
    groups = [{"id": 10 + t, "ranks": list(range(t * tp, (t + 1) * tp))} for t in range(n_tp)]
    groups += [{"id": 100 + j, "ranks": list(range(j, world, tp))} for j in range(tp)]
    head = [schema.hello_message(header(RUN, r), identity(r, world)) for r in range(world)]
    head.append(schema.groups_message(header(RUN, 0), groups))
    colls = layers + buckets
    raw_steps, raw_colls = [], []
    tables: list[list[tuple[dict, dict]]] = [[] for _ in range(world)]
    for s in range(steps):
        t0 = BASE + s * 50_000_000
        # Position of each call in issue order: buckets go out between the tp calls.
        kinds = np.zeros(colls, bool)
        kinds[rng.choice(np.arange(1, colls), buckets, replace=False)] = True
        slot_t = t0 + 1_000_000 * np.arange(1, colls + 1)
        enter = slot_t + rng.integers(0, 50, (world, colls)) * 1000
        exit_ = np.empty((world, colls), np.int64)
        members = [np.array(g["ranks"]) for g in groups]
        group_of = np.empty((world, colls), np.int32)
        seq = np.empty((world, colls), np.int64)
        for r in range(world):
            tp_id, dp_id = 10 + r // tp, 100 + r % tp
            group_of[r] = np.where(kinds, dp_id, tp_id)
            seq[r, ~kinds] = s * layers + np.arange(layers)
            seq[r, kinds] = s * buckets + np.arange(buckets)
        for g, ranks in zip(groups, members):
            cols = group_of[ranks[0]] == g["id"]
            last = enter[np.ix_(ranks, cols)].max(axis=0)
            # Buckets run on while later tp calls go on (overlapping intervals).
            service = np.where(kinds[cols], 2_500_000, 300_000)
            exit_[np.ix_(ranks, cols)] = (
                last + service + rng.integers(0, 40, (ranks.shape[0], int(cols.sum()))) * 100
            )
        for r in range(world):
            st_ = schema.empty_table("steps", 1)
            st_["step"][:] = s
            st_["t_start"][:] = t0 + r
            st_["t_end"][:] = t0 + 45_000_000
            keep = np.ones(colls, bool)
            if missing is not None and missing[:2] == (r, s):
                keep[missing[2]] = False
            co = schema.empty_table("colls", int(keep.sum()))
            co["step"][:] = s
            co["group"][:] = group_of[r][keep]
            co["seq"][:] = seq[r][keep]
            co["nbytes"][:] = np.where(kinds, 1 << 22, 1 << 16)[keep]
            co["t_enter"][:] = enter[r][keep]
            ex = exit_[r].copy()
            if unknown_exit and r == 1:
                ex[0] = schema.NO_TIME
            co["t_exit"][:] = ex[keep]
            flags = np.where(kinds & ~blocking_buckets, BUCKET, 0).astype(np.int32)
            if device:
                flags |= schema.FLAG_DEVICE_TIMED
                co["t_start"][:] = (enter[r] + 2000)[keep]
                co["t_end"][:] = (exit_[r] - 1000 - 10 * r)[keep]
            co["flags"][:] = flags[keep]
            if tweak is not None:
                tweak(r, s, co)
            tables[r].append((st_, co))
            raw_steps.append({**st_, "rank": np.array([r], np.int32)})
            raw_colls.append({**co, "rank": np.full(co["step"].shape[0], r, np.int32)})
    body = []
    for r in range(world):
        for i in range(0, steps, per_message):
            chunk = tables[r][i : i + per_message]
            st_ = {k: np.concatenate([c[0][k] for c in chunk]) for k in chunk[0][0]}
            co = {k: np.concatenate([c[1][k] for c in chunk]) for k in chunk[0][1]}
            body.append((i, r, schema.steps_message(header(RUN, r, batch=i), st_, colls=co)))
    body.sort(key=lambda x: (x[0], x[1]))
    raw = {
        "steps": {k: np.concatenate([t[k] for t in raw_steps]) for k in raw_steps[0]},
        "colls": {k: np.concatenate([t[k] for t in raw_colls]) for k in raw_colls[0]},
    }
    return head, [m for _, _, m in body], raw, groups


@pytest.mark.parametrize("settle_every", [0, 1, 3, 7])
def test_mixed_messages_take_blocks_and_equal_build_window(paths, settle_every: int) -> None:  # noqa: F811
    head, body, raw, groups = hybrid_job()
    store = feed(head, body, settle_every=settle_every)
    assert_windows_equal(
        store.window(RUN), reference(raw, groups, 8, RUN), skip=("health", "clock_error_ns")
    )
    assert paths["blocks"] > 0 and paths["rows"] == 0
    totals = store.totals(RUN)
    # 4 tp groups x 6 layers + 2 dp groups x 3 buckets, per step
    assert totals.instances_complete == 4 * (4 * 6 + 2 * 3)
    assert totals.instances_incomplete == 0
    # Asynchronous buckets overlap: only part of their time is exposed.
    w = store.window(RUN)
    assert (w.coll["exposed_transfer_ns"] < w.coll["transfer_ns"]).any()


@pytest.mark.parametrize(
    "kw",
    [
        {"device": True},
        {"unknown_exit": True},
        {"blocking_buckets": True},
        {"per_message": 2},
        {"per_message": 3, "steps": 5},
    ],
    ids=["device", "unknown-exit", "blocking-buckets", "two-steps-a-message", "ragged"],
)
def test_mixed_variants_equal_build_window(paths, kw) -> None:  # noqa: F811
    head, body, raw, groups = hybrid_job(**kw)
    order = np.random.default_rng(3).permutation(len(body))
    store = feed(head, body, order=order, settle_every=3)
    assert_windows_equal(
        store.window(RUN), reference(raw, groups, 8, RUN), skip=("health", "clock_error_ns")
    )
    assert paths["blocks"] > 0 and paths["rows"] == 0


def test_a_piece_missing_a_row_takes_the_rows_path_with_the_same_result(paths) -> None:  # noqa: F811
    head, body, raw, groups = hybrid_job(missing=(3, 1, 4))
    store = feed(head, body, settle_every=5)
    assert_windows_equal(
        store.window(RUN), reference(raw, groups, 8, RUN), skip=("health", "clock_error_ns")
    )
    assert paths["rows"] > 0 and paths["blocks"] > 0


def _middle_tp_row(co) -> int:
    return int(np.flatnonzero(co["group"] < 100)[2])


@pytest.mark.parametrize(
    "column, rows_path",
    [("seq", True), ("step", True), ("nbytes", False)],
    ids=["seq", "step", "nbytes"],
)
@pytest.mark.parametrize("settle_every", [0, 4])
def test_a_piece_unlike_its_sub_block_in_one_middle_row(
    paths,  # noqa: F811
    column: str,
    rows_path: bool,
    settle_every: int,
) -> None:
    # Every message mixes groups, so every part is a piece: rank 3's tp piece of step 1
    # differs from the other pieces of its sub-block in one row.
    def tweak(r: int, s: int, co: dict[str, np.ndarray]) -> None:
        if (r, s) == (3, 1):
            i = _middle_tp_row(co)
            if column == "seq":
                co["seq"][i] += 10_000  # an instance no other rank has
            elif column == "step":
                co["step"][i] -= 1  # a row filed under the step before
            else:
                co["nbytes"][i] = 1 << 10  # one member moves another size: the median

    head, body, raw, groups = hybrid_job(tweak=tweak)
    store = feed(head, body, settle_every=settle_every)
    assert_windows_equal(
        store.window(RUN), reference(raw, groups, 8, RUN), skip=("health", "clock_error_ns")
    )
    assert paths["blocks"] > 0
    assert (paths["rows"] > 0) == rows_path


def test_prepare_splits_by_group_keeping_row_order_and_cuts() -> None:
    rng = np.random.default_rng(5)
    n = 40
    cols = schema.empty_table("colls", n)
    cols["group"][:] = rng.choice([7, 2, 9], n)
    cols["seq"][:] = np.arange(n)
    cols["step"][:] = np.repeat([4, 5], n // 2)
    cols["t_enter"][:] = BASE + np.arange(n) * 1000
    cols["t_exit"][:] = BASE + np.arange(n) * 1000 + 5000
    cols["flags"][:] = np.where(cols["group"] == 9, BUCKET, 0)
    whole = Part(3, 0, cols, None, True, False, arrival=11)
    single = Part(4, 0, {k: v[cols["group"] == 2] for k, v in cols.items()}, None, False, False)
    assert whole.group == -1 and single.group == 2
    # The same group first and last, another in between: still a mixed part.
    sandwich = {k: v[:3].copy() for k, v in cols.items()}
    sandwich["group"][:] = [5, 6, 5]
    sandwich["flags"][:] = 0
    split = prepare([Part(0, 0, sandwich, None, False, False)], BASE)
    assert [(p.group, p.n) for p in split] == [(5, 2), (6, 1)]
    out = prepare([single, whole], BASE)
    assert out[0] is single
    pieces = out[1:]
    assert [p.group for p in pieces] == [2, 7, 9]
    for p in pieces:
        sel = cols["group"] == p.group
        assert p.rank == 3 and p.arrival == 11 and p.n == int(sel.sum())
        for c in schema.COLL_COLUMNS:
            np.testing.assert_array_equal(p.cols[c], cols[c][sel])
            np.testing.assert_array_equal(p.column(c), cols[c][sel])
        assert p.is_async == (p.group == 9)
        assert (p.cut is not None) == p.is_async
    # The cut of an async row: the latest async issue of its rank-step (every row here is
    # its own interval, so the exits of earlier rows raise it).
    bucket = pieces[2]
    for step in (4, 5):
        rows = bucket.cols["step"] == step
        t = (bucket.cols["t_enter"][rows] - BASE).astype(float)
        ex = (bucket.cols["t_exit"][rows] - BASE).astype(float)
        want = np.maximum(t.max(), np.concatenate([[-np.inf], ex[:-1]]))
        np.testing.assert_array_equal(bucket.cut[rows], want)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    tp=st.sampled_from([1, 2, 4]),
    dp=st.integers(1, 3),
    steps=st.integers(1, 4),
    layers=st.integers(1, 5),
    buckets=st.integers(1, 3),
    per_message=st.integers(1, 3),
    device=st.booleans(),
    settle_every=st.integers(0, 6),
    seed=st.integers(0, 10_000),
)
def test_any_arrival_order_and_pass_timing_gives_the_rows_path_window(
    tp, dp, steps, layers, buckets, per_message, device, settle_every, seed
) -> None:
    world = tp * dp
    head, body, raw, groups = hybrid_job(
        world, tp, steps, layers, buckets, per_message=per_message, device=device, seed=seed
    )
    order = np.random.default_rng(seed).permutation(len(body))
    store = feed(head, body, order=order, settle_every=settle_every)
    assert_windows_equal(
        store.window(RUN), reference(raw, groups, world, RUN), skip=("health", "clock_error_ns")
    )
    totals = store.totals(RUN)
    assert totals.instances_complete == steps * ((world // tp) * layers + tp * buckets)


def test_waiting_pieces_keep_only_their_own_rows_and_still_match() -> None:
    world = 8
    head, body, raw, groups = hybrid_job(world=world, tp=2, steps=4)
    late = [m for m in body if schema.decode(m).header["rank"] == 5]
    store = feed(head, [m for m in body if m not in late], settle_every=4)
    run = store.run_state(RUN)
    assert run is not None and run.pending.kept
    pieces = [p for p in run.pending.kept if p.batch is not None]
    assert pieces  # rank 5's tp and dp groups wait for it
    for p in pieces:
        held = [q for q in pieces if q.batch is p.batch]
        assert p.batch["step"].shape[0] == sum(q.n for q in held)
    # The waiting pieces then match as if they had never waited.
    intake = Intake(store)
    for m in late:
        assert intake.feed(m)
    assert_windows_equal(
        store.window(RUN), reference(raw, groups, world, RUN), skip=("health", "clock_error_ns")
    )
    assert store.totals(RUN).instances_complete == 4 * (4 * 6 + 2 * 3)


@pytest.mark.parametrize(
    "kw",
    [{}, {"blocking_buckets": True}, {"device": True}],
    ids=["async-buckets", "blocking-buckets", "device-timed"],
)
@pytest.mark.parametrize("settle_every", [0, 20])
def test_blocks_settled_together_equal_blocks_settled_one_by_one(
    paths,  # noqa: F811
    monkeypatch,
    kw,
    settle_every,
) -> None:
    """Complete blocks of as many ranks each (the tp groups) are settled side by side in
    one go; the window and the lifetime totals are exactly those of one block at a time."""
    head, body, raw, groups = hybrid_job(world=12, tp=3, steps=5, **kw)
    order = np.random.default_rng(5).permutation(len(body))
    together = feed(head, body, order=order, settle_every=settle_every)
    together.settle()
    assert paths["together"] > 0
    with monkeypatch.context() as m:
        m.setattr(matching, "_simple", lambda b, sizes: False)
        one_by_one = feed(head, body, order=order, settle_every=settle_every)
    assert_windows_equal(together.window(RUN), one_by_one.window(RUN))
    assert_windows_equal(together.totals(RUN), one_by_one.totals(RUN), skip=())
    assert_windows_equal(
        together.window(RUN), reference(raw, groups, 12, RUN), skip=("health", "clock_error_ns")
    )
