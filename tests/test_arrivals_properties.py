"""Properties of arrival matching that hold for any input."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rankscope.collector import schema
from rankscope.diagnosis.arrivals import ROW_COLUMNS, match, rank_step_aggregates


@st.composite
def jobs(draw):
    """A random world, groups over it and collective rows (some missing), distinct entries."""
    world = draw(st.integers(2, 7))
    n_groups = draw(st.integers(1, 3))
    groups = {}
    for g in range(n_groups):
        members = draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True))
        groups[g] = sorted(members)
    n_seq = draw(st.integers(1, 5))
    out = {c: [] for c in ROW_COLUMNS}
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    t = 0
    for g, members in groups.items():
        for s in range(n_seq):
            for r in members:
                if rng.random() < 0.15:
                    continue  # a row that never arrived
                t += int(rng.integers(1, 50))  # distinct entries: no ties to break
                flags = int(rng.choice([0, schema.FLAG_ASYNC, schema.FLAG_DEVICE_TIMED]))
                vals = {
                    "rank": r,
                    "step": s // 2,
                    "op": 0,
                    "group": g,
                    "seq": s,
                    "nbytes": int(rng.integers(1, 1000)),
                    "t_enter": t,
                    "t_start": t + 1,
                    "t_end": t + int(rng.integers(2, 99)),
                    "t_exit": t + int(rng.integers(0, 500)),
                    "flags": flags,
                }
                for c in ROW_COLUMNS:
                    out[c].append(vals[c])
    dts = {"rank": np.int32, **schema.COLL_COLUMNS}
    rows = {c: np.array(v, dtype=dts[c]) for c, v in out.items()}
    order = rng.permutation(rows["rank"].shape[0])  # arrival order must not matter
    rows = {c: v[order] for c, v in rows.items()}
    perm = rng.permutation(world)
    return world, groups, rows, perm


@settings(max_examples=60, deadline=None)
@given(jobs())
def test_permuting_rank_ids_permutes_the_result(job) -> None:
    world, groups, rows, perm = job
    sizes = {g: len(m) for g, m in groups.items()}
    steps = np.unique(rows["step"])
    base = match(rows, sizes)
    base_agg = rank_step_aggregates(rows, base, world, steps)

    moved = dict(rows)
    moved["rank"] = perm[rows["rank"]].astype(np.int32)
    got = match(moved, sizes)
    got_agg = rank_step_aggregates(moved, got, world, steps)

    a, b = base.instances, got.instances
    assert b.last_rank.tolist() == perm[a.last_rank].tolist()
    for name in ("group", "seq", "step", "n_arrived", "first", "last", "skew", "nbytes"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    for name in ("margin", "transfer", "device_transfer"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_array_equal(base.complete, got.complete)
    for name, grid in base_agg.items():
        np.testing.assert_array_equal(got_agg[name][perm], grid, err_msg=name)


@settings(max_examples=60, deadline=None)
@given(jobs())
def test_matching_invariants(job) -> None:
    world, groups, rows, _ = job
    sizes = {g: len(m) for g, m in groups.items()}
    m = match(rows, sizes)
    inst = m.instances
    n = rows["rank"].shape[0]
    # Every row lands in exactly one instance, and each instance has one last arriver.
    assert np.bincount(m.row_instance, minlength=len(inst)).tolist() == inst.n_arrived.tolist()
    assert np.bincount(m.row_instance[m.row_is_last], minlength=len(inst)).tolist() == [1] * len(
        inst
    )
    enter = rows["t_enter"].astype(float)
    assert (enter >= m.row_first).all() and (enter <= m.row_last).all()
    assert (enter[m.row_is_last] == inst.last[m.row_instance[m.row_is_last]]).all()
    assert (inst.skew >= 0).all()
    multi = inst.n_arrived > 1
    assert (inst.margin[multi] >= 0).all() and (inst.margin[multi] <= inst.skew[multi]).all()
    assert m.complete.tolist() == (inst.n_arrived == inst.n_members).tolist()
    # Aggregates: wait + transfer adds up to the time inside collectives on complete rows.
    steps = np.unique(rows["step"])
    agg = rank_step_aggregates(rows, m, world, steps)
    assert agg["n"].sum() == n
    assert agg["times_last"].sum() == m.complete.sum()
    assert (agg["exposed_wait_ns"] <= agg["wait_ns"] + 1e-9).all()
    assert (agg["exposed_transfer_ns"] <= agg["transfer_ns"] + 1e-9).all()
