"""Diagnosis metrics against small cases computed by hand."""

import numpy as np
import pytest

from rankscope.collector import schema
from rankscope.diagnosis import robust
from rankscope.diagnosis.critical import critical_path, group_skew
from rankscope.diagnosis.curves import (
    algbw_bytes,
    bucket_label,
    bus_factor,
    compare_curves,
    message_curves,
    size_bucket,
)
from rankscope.diagnosis.decomposition import compare, decompose
from rankscope.diagnosis.synthetic import instance_table, make_groups, make_window, rank_layout

OP = schema.OP_INDEX


def grid(values: list[list[float]]) -> np.ndarray:
    return np.array(values, dtype=np.float64)


# --- robust statistics -------------------------------------------------------------------


def test_robust_z_by_hand() -> None:
    x = np.array([1.0, 2.0, 3.0, 4.0, 100.0])
    # median 3, |dev| = 2,1,0,1,97 -> MAD 1 -> sigma 1.4826
    z = robust.robust_z(x)
    assert z[4] == pytest.approx(97 / 1.4826)
    assert z[2] == 0.0


def test_robust_scale_floor_on_flat_series() -> None:
    x = np.full(10, 200.0)
    assert robust.robust_scale(x) == pytest.approx(0.2)  # 1e-3 x median
    assert robust.robust_scale(np.zeros(4)) == 1.0


def test_peer_median_is_the_median_of_the_others() -> None:
    # Two ranks: each one's peer is the other, not their mean.
    assert robust.peer_median(np.array([0.2, 0.8])).tolist() == [0.8, 0.2]
    x = np.array([3.0, np.nan, 1.0, 2.0, 5.0])
    got = robust.peer_median(x)
    assert np.isnan(got[1])
    assert got[[0, 2, 3, 4]].tolist() == [2.0, 3.0, 3.0, 2.0]
    rng = np.random.default_rng(3)
    for n in range(1, 10):
        y = rng.integers(0, 4, n).astype(float)
        y[rng.random(n) < 0.2] = np.nan
        got = robust.peer_median(y)
        for i in range(n):
            others = np.delete(y, i)
            others = others[np.isfinite(others)]
            if np.isfinite(y[i]) and others.size:
                assert got[i] == np.median(others), (y, i)
            else:
                assert np.isnan(got[i]), (y, i)


def test_effect_size_by_hand() -> None:
    # Two groups of two: means 1 and 3, grand mean 2; SS_between = 4, SS_total = 4 + 2*0.5^2*2
    v = np.array([0.5, 1.5, 2.5, 3.5])
    c = np.array([0, 0, 1, 1])
    e = robust.effect_size(v, c)
    assert e.eta2 == pytest.approx(4.0 / 5.0)
    # eps2 = (SSb - (k-1) MSw) / SSt, MSw = 1 / 2
    assert e.epsilon2 == pytest.approx((4.0 - 0.5) / 5.0)
    assert e.n_groups == 2


def test_effect_size_ignores_unknown_codes() -> None:
    v = np.array([1.0, 1.0, 5.0, 5.0, 99.0])
    c = np.array([0, 0, 1, 1, -1])
    e = robust.effect_size(v, c)
    assert e.eta2 == pytest.approx(1.0)


def test_group_quantiles_match_numpy() -> None:
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 7, 500)
    vals = rng.normal(1e6, 3e5, 500)
    vals[::17] = np.nan
    q = robust.group_quantiles(codes, vals, 8, (0.5, 0.9, 1.0))
    for g in range(7):
        sel = (codes == g) & np.isfinite(vals)
        assert q[:, g] == pytest.approx(np.quantile(vals[sel], [0.5, 0.9, 1.0]), rel=1e-9)
    assert np.isnan(q[:, 7]).all()


def test_theil_sen_ignores_spike() -> None:
    x = np.arange(10.0)
    y = 2.0 * x + 1.0
    y[5] = 1000.0
    assert robust.theil_sen(x, y) == pytest.approx(2.0)


def test_average_ranks_ties() -> None:
    assert robust.average_ranks(np.array([3.0, 1.0, 3.0, 2.0])).tolist() == [2.5, 0.0, 2.5, 1.0]


# --- decomposition ------------------------------------------------------------------------


def _two_rank_window(**kw):
    t_start = grid([[0, 100], [0, 100]])
    t_end = grid([[100, 200], [100, 200]])
    return make_window(t_start, t_end, ranks=rank_layout(2, ranks_per_host=2), **kw)


def test_decomposition_collectives_inside_or_between_phases() -> None:
    # Every rank-step: 100 ns = input 10 + compute 70 + wait 15 + transfer 5.
    # rank 0 issues its collectives inside forward/backward (the spans cover them: 90 ns of
    # compute phases); rank 1 issues them between spans (70 ns of compute phases).
    w = _two_rank_window(
        phase_ns={
            "input": grid([[10, 10], [10, 10]]),
            "forward": grid([[40, 40], [30, 30]]),
            "backward": grid([[40, 40], [30, 30]]),
            "optimizer": grid([[10, 10], [10, 10]]),
        },
        coll={
            "exposed_wait_ns": grid([[15, 15], [15, 15]]),
            "exposed_transfer_ns": grid([[5, 5], [5, 5]]),
        },
    )
    d = decompose(w)
    assert d.category("compute").tolist() == [[70, 70], [70, 70]]
    assert d.category("arrival_wait").tolist() == [[15, 15], [15, 15]]
    assert d.category("exposed_comm").tolist() == [[5, 5], [5, 5]]
    assert d.category("input").tolist() == [[10, 10], [10, 10]]
    assert (d.category("other") == 0).all()
    assert (d.overlap_ns == 0).all()
    assert np.allclose(d.ns.sum(axis=0), 100.0)
    assert d.compute_from_phases.all()


def test_decomposition_unlabelled_gap() -> None:
    # Collectives between spans and a 10 ns unlabelled gap: it lands in "host_gap", and a
    # user phase in "other".
    w = _two_rank_window(
        phase_ns={"forward": grid([[60, 60], [60, 60]]), "input": grid([[10, 10], [10, 10]])},
        coll={"exposed_wait_ns": grid([[20, 20], [20, 20]])},
    )
    d = decompose(w)
    assert d.category("compute")[0, 0] == 60
    assert d.category("host_gap")[0, 0] == 10
    assert d.category("other")[0, 0] == 0
    wu = _two_rank_window(
        phase_ns={
            "forward": grid([[60, 60], [60, 60]]),
            "input": grid([[10, 10], [10, 10]]),
            "logging": grid([[4, 4], [4, 4]]),
        },
        coll={"exposed_wait_ns": grid([[20, 20], [20, 20]])},
    )
    du = decompose(wu)
    assert du.category("other")[0, 0] == 4
    assert du.category("host_gap")[0, 0] == 6
    assert np.allclose(du.ns.sum(axis=0), 100.0)
    # Collectives inside the spans plus a gap: compute absorbs at most the gap (documented).
    w2 = _two_rank_window(
        phase_ns={"forward": grid([[80, 80], [80, 80]]), "input": grid([[10, 10], [10, 10]])},
        coll={"exposed_wait_ns": grid([[20, 20], [20, 20]])},
    )
    d2 = decompose(w2)
    assert d2.category("compute")[0, 0] == 70  # true compute 60, gap 10
    assert d2.category("other")[0, 0] == 0


def test_decomposition_residual_without_compute_phases() -> None:
    w = _two_rank_window(
        phase_ns={"input": grid([[20, 20], [20, 20]])},
        coll={"exposed_wait_ns": grid([[30, 0], [0, 30]])},
    )
    d = decompose(w)
    assert d.category("compute")[0, 0] == 50
    assert d.category("compute")[0, 1] == 80
    assert (d.category("other") == 0).all()
    assert not d.compute_from_phases.any()


def test_decomposition_scales_overlapping_categories() -> None:
    # input 80 + wait 80 > step 100: scaled by 100/160, overlap recorded.
    w = _two_rank_window(
        phase_ns={"input": grid([[80, 0], [0, 0]])},
        coll={"exposed_wait_ns": grid([[80, 0], [0, 0]])},
    )
    d = decompose(w)
    assert d.category("input")[0, 0] == pytest.approx(50)
    assert d.category("arrival_wait")[0, 0] == pytest.approx(50)
    assert d.overlap_ns[0, 0] == pytest.approx(60)
    assert d.ns[:, 0, 0].sum() == pytest.approx(100)


def test_decomposition_absent_rank_step_is_nan() -> None:
    t_end = grid([[100, np.nan], [100, 200]])
    w = make_window(grid([[0, 100], [0, 100]]), t_end, ranks=rank_layout(2, ranks_per_host=2))
    d = decompose(w)
    assert np.isnan(d.ns[:, 0, 1]).all()
    assert d.mean_per_step()["compute"] == pytest.approx(100)


def test_compare_names_the_category_that_grew() -> None:
    base = _two_rank_window()
    t_start = grid([[0, 130], [0, 130]])
    t_end = grid([[130, 260], [130, 260]])
    cur = make_window(
        t_start,
        t_end,
        ranks=rank_layout(2, ranks_per_host=2),
        coll={"exposed_wait_ns": grid([[30, 30], [30, 30]])},
    )
    delta = compare(decompose(cur), decompose(base))
    rows = {r.category: r for r in delta.rows}
    assert delta.first_appears == "arrival_wait"
    assert rows["arrival_wait"].delta_ns == pytest.approx(30)
    assert rows["compute"].delta_ns == pytest.approx(0)
    assert delta.step_current_ns - delta.step_baseline_ns == pytest.approx(30)


# --- curves -------------------------------------------------------------------------------


def test_bus_factors_nccl_tests() -> None:
    ops = np.array([OP["all_reduce"], OP["all_gather"], OP["reduce_scatter"], OP["all_to_all"]])
    n = np.array([8, 8, 4, 2])
    assert bus_factor(ops, n).tolist() == [2 * 7 / 8, 7 / 8, 3 / 4, 1 / 2]
    ones = np.array([OP["broadcast"], OP["reduce"], OP["send"], OP["recv"]])
    assert bus_factor(ones, np.array([8, 8, 2, 2])).tolist() == [1.0, 1.0, 1.0, 1.0]


def test_algbw_size_convention() -> None:
    ops = np.array([OP["all_reduce"], OP["all_gather"], OP["broadcast"]])
    s = algbw_bytes(ops, np.array([1000, 1000, 1000]), np.array([4, 4, 4]))
    assert s.tolist() == [1000.0, 4000.0, 1000.0]


def test_size_bucket_and_label() -> None:
    assert size_bucket(np.array([0, 1, 1023, 1024, 3 << 20])).tolist() == [-1, 0, 9, 10, 21]
    assert bucket_label(10) == "1 KiB"
    assert bucket_label(21) == "2 MiB"
    assert bucket_label(-1) == "unknown"


def test_message_curves_by_hand() -> None:
    # all_reduce over 8 ranks, 100 MB per rank, 1 ms transfer -> algbw 100 GB/s, busbw 175.
    inst = instance_table(
        group=[0, 0, 1],
        seq=[0, 1, 0],
        op=[OP["all_reduce"]] * 2 + [OP["all_gather"]],
        nbytes=[100_000_000, 100_000_000, 1_000_000],
        n_members=[8, 8, 4],
        first=[0.0, 0.0, 0.0],
        last=[0.0, 0.0, 0.0],
        transfer=[900_000.0, 1_100_000.0, 100_000.0],
    )
    c = message_curves(inst)
    assert len(c) == 2
    ar = int(np.flatnonzero(c.group == 0)[0])
    assert c.time_ns[ar] == pytest.approx(1_000_000)
    assert c.algbw_gbps[ar] == pytest.approx(100.0)
    assert c.busbw_gbps[ar] == pytest.approx(175.0)
    ag = int(np.flatnonzero(c.group == 1)[0])
    # all_gather: S = 1 MB x 4 over 0.1 ms = 40 GB/s; busbw x 3/4 = 30
    assert c.algbw_gbps[ag] == pytest.approx(40.0)
    assert c.busbw_gbps[ag] == pytest.approx(30.0)
    assert "2(n-1)/n" in c.convention


def test_message_curves_prefers_device_transfer() -> None:
    inst = instance_table(
        group=[0],
        op=[OP["broadcast"]],
        nbytes=[1000],
        n_members=[2],
        first=[0.0],
        last=[0.0],
        transfer=[1000.0],
        device_transfer=[500.0],
    )
    assert message_curves(inst).algbw_gbps[0] == pytest.approx(2.0)


def test_compare_curves_matches_by_group_name() -> None:
    ranks = rank_layout(16)
    members = [list(range(8)), list(range(8, 16))]
    g_cur = make_groups(ranks, members, names=["tp0", "tp1"])
    g_base = make_groups(ranks, members[::-1], names=["tp1", "tp0"])  # ids swapped
    kw = dict(op=[OP["all_reduce"]] * 2, nbytes=[1 << 20] * 2, n_members=[8, 8])
    kw.update(first=[0.0, 0.0], last=[0.0, 0.0])
    cur = message_curves(instance_table(group=[0, 1], transfer=[2000.0, 1000.0], **kw))
    base = message_curves(instance_table(group=[0, 1], transfer=[1000.0, 1000.0], **kw))
    shifts = compare_curves(cur, g_cur, base, g_base)
    by_name = {s.group: s.ratio for s in shifts}
    assert by_name["tp0"] == pytest.approx(0.5)  # tp0: 2000 now vs 1000 in the baseline
    assert by_name["tp1"] == pytest.approx(1.0)
    assert shifts[0].group == "tp0"


# --- critical path ------------------------------------------------------------------------


def _critical_window(instances, clock=None):
    ranks = rank_layout(4, ranks_per_host=4)
    n = len(instances)
    t = grid([[0.0], [0.0], [0.0], [0.0]])
    return make_window(
        t,
        t + 1000,
        ranks=ranks,
        groups=make_groups(ranks, [[0, 1, 2, 3]]),
        instances=instances,
        clock_error_ns=clock,
        coll={
            "n": np.full((4, 1), float(n)),
            "late_ns": grid([[0], [30], [0], [90]]),
            "exposed_wait_ns": grid([[300], [200], [300], [0]]),
        },
    )


def test_critical_counts_ties_and_lateness() -> None:
    inst = instance_table(
        group=[0, 0, 0],
        seq=[0, 1, 2],
        op=[OP["all_reduce"]] * 3,
        nbytes=[1024] * 3,
        n_members=[4, 4, 4],
        first=[0.0, 0.0, 0.0],
        last=[90.0, 50.0, 60.0],
        last_rank=[3, 1, 3],
        margin=[40.0, 0.0, 5.0],  # seq 1 is a tie (rank 1 named: the lowest of the tied)
        transfer=[10.0, 10.0, 10.0],
    )
    cp = critical_path(
        _critical_window(inst, clock=np.full(4, 2.0)), decompose(_critical_window(inst))
    )
    assert cp.times_last.tolist() == [0, 1, 0, 2]
    # margin 0 (tie) and 5 > 2*2 -> seq 2 decisive, seq 1 not
    assert cp.times_last_decisive.tolist() == [0, 0, 0, 2]
    assert cp.ties == 1
    assert cp.complete == 3
    assert cp.late_mean_ns.tolist() == [0.0, 10.0, 0.0, 30.0]
    # Rank 3 never waits: it is the busiest and sets the step.
    assert cp.critical_rank.tolist() == [3]
    assert cp.top_last(1) == [(3, 2)]
    assert cp.critical_excess[0] == pytest.approx(1000 - 750)


def test_critical_skips_incomplete_and_flags_clock() -> None:
    inst = instance_table(
        group=[0, 0],
        seq=[0, 1],
        op=[OP["all_reduce"]] * 2,
        nbytes=[1024] * 2,
        n_members=[4, 4],
        n_arrived=[4, 3],
        first=[0.0, 0.0],
        last=[10.0, 500.0],
        last_rank=[2, 1],
        margin=[10.0, 100.0],
        transfer=[10.0, 10.0],
    )
    w = _critical_window(inst, clock=np.full(4, 20.0))
    cp = critical_path(w, decompose(w))
    assert cp.complete == 1
    assert cp.times_last.tolist() == [0, 0, 1, 0]
    assert cp.times_last_decisive.sum() == 0  # margin 10 < 2 x 20
    assert cp.skew_resolvable == 0.0  # skew 10 < 2 x 20
    assert cp.clock_error_ns == 20.0


def test_group_skew_percentiles() -> None:
    skews = np.arange(1.0, 101.0)
    inst = instance_table(
        group=np.zeros(100),
        seq=np.arange(100),
        op=np.full(100, OP["all_reduce"]),
        nbytes=np.full(100, 4096),
        n_members=np.full(100, 4),
        first=np.zeros(100),
        last=skews,
        transfer=np.full(100, 50.0),
    )
    w = _critical_window(inst)
    gs = group_skew(w)
    assert len(gs) == 1
    assert gs.skew_p50[0] == pytest.approx(50.5)
    assert gs.skew_max[0] == pytest.approx(100.0)
    assert gs.skew_p99[0] == pytest.approx(np.quantile(skews, 0.99))
    assert gs.skew_share[0] == pytest.approx(50.5 / 100.5)
    assert gs.bucket[0] == 12


# --- slow links -----------------------------------------------------------------------------


def test_misplaced_groups_found_by_mesh_not_name() -> None:
    from dataclasses import replace

    from rankscope.diagnosis.fabric import fabric_view
    from rankscope.diagnosis.grouprows import group_rows

    ranks = rank_layout(32, ranks_per_host=8, tp=4)
    host = ranks.host.copy()
    host[7], host[8] = 1, 0  # ranks 7 and 8 swapped devices across hosts 0 and 1
    ranks = replace(ranks, host=host)
    tp_groups = [list(range(g * 4, g * 4 + 4)) for g in range(8)]
    dp_groups = [list(range(t, 32, 4)) for t in range(4)]
    # Unnamed groups: only the mesh coordinates tell tp from dp.
    n_groups = len(tp_groups) + len(dp_groups)
    groups = make_groups(ranks, tp_groups + dp_groups, names=[f"pg{i}" for i in range(n_groups)])
    n_per = 20
    gid = np.repeat(np.arange(n_groups), n_per)
    is_tp = gid < len(tp_groups)
    transfer = np.where(is_tp, 1e4, 1e5)
    transfer[(gid == 1) | (gid == 2)] = 5e4  # the two tp groups now crossing hosts
    inst = instance_table(
        group=gid,
        seq=np.tile(np.arange(n_per), n_groups),
        step=np.tile(np.arange(n_per), n_groups) % 4,
        op=np.full(gid.size, OP["all_reduce"]),
        nbytes=np.full(gid.size, 1 << 20),
        n_members=np.where(is_tp, 4, 8),
        first=np.zeros(gid.size),
        last=np.zeros(gid.size),
        transfer=transfer,
    )
    t = np.tile(np.arange(4) * 1e6, (32, 1))
    w = make_window(t, t + 5e5, ranks=ranks, groups=groups, instances=inst)
    view = fabric_view(w, group_rows(inst))
    assert len(view.placement) == 1
    found = view.placement[0]
    assert set(found.groups) == {"pg1", "pg2"}
    assert found.slowdown == pytest.approx(5.0)
    assert set(found.hosts) == {"node0000", "node0001"}
    assert found.label.startswith("2 tp group")
    # The two hosts' remaining intra-host tp groups are as fast as each other.
    assert all(f.slowdown == pytest.approx(1.0) for f in view.hosts)
