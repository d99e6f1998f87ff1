"""Numerator, baseline, correlation, trends and stall analyses on small hand-made windows."""

import numpy as np
import pytest

from rankscope.collector import schema
from rankscope.diagnosis.baseline import (
    TAIL_STALL,
    compare_runs,
    distribution,
    flatten,
    manifest_diff,
    tail_got_worse,
)
from rankscope.diagnosis.correlate import rank_metrics
from rankscope.diagnosis.decomposition import decompose
from rankscope.diagnosis.numerator import check_numerator, per_step_work
from rankscope.diagnosis.robust import effect_size
from rankscope.diagnosis.stall import detect_stall
from rankscope.diagnosis.straggler import relative_to_step, slow_rank_pattern, work_correlation
from rankscope.diagnosis.synthetic import instance_table, make_groups, make_window, rank_layout
from rankscope.diagnosis.trends import find_spikes, trends
from rankscope.diagnosis.window import CollRows


def steady(n_ranks: int, n_steps: int, step: float = 1000.0, **kw):
    t_start = np.tile(np.arange(n_steps) * step, (n_ranks, 1)).astype(float)
    return make_window(t_start, t_start + step, **kw)


# --- numerator ----------------------------------------------------------------------------


def _work_window(tokens: float, valid: float, rng: np.random.Generator, n_steps: int = 30):
    shape = (4, n_steps)
    noise = 1 + 0.005 * rng.standard_normal(shape)
    return steady(
        4,
        n_steps,
        ranks=rank_layout(4, ranks_per_host=4),
        work={
            "tokens": tokens * noise,
            "valid_tokens": valid * noise,
            "samples": np.full(shape, 8.0),
            "attn_cost": (tokens**2) * noise,
        },
    )


def test_per_step_work_and_padding_by_hand() -> None:
    w = steady(
        2,
        1,
        ranks=rank_layout(2, ranks_per_host=2),
        work={"tokens": np.array([[100.0], [300.0]]), "valid_tokens": np.array([[90.0], [270.0]])},
    )
    work = per_step_work(w)
    assert work["tokens"][0] == 400
    assert work["padding_fraction"][0] == pytest.approx(0.1)
    assert np.isnan(work["flops"][0])


def test_numerator_unchanged_within_noise() -> None:
    rng = np.random.default_rng(1)
    chk = check_numerator(_work_window(1000, 980, rng), _work_window(1000, 980, rng))
    assert chk.has_baseline
    assert not chk.numerator_changed
    assert chk.changed == ()


def test_numerator_flags_more_padding() -> None:
    rng = np.random.default_rng(2)
    # Same useful tokens, 30 % more executed tokens: padding.
    chk = check_numerator(_work_window(1300, 980, rng), _work_window(1000, 980, rng))
    assert chk.numerator_changed
    assert "tokens" in chk.changed and "padding_fraction" in chk.changed
    assert "valid_tokens" not in chk.changed
    assert chk.useful_ratio == pytest.approx(1.0, abs=0.01)
    assert chk.executed_ratio == pytest.approx(1.69, rel=0.03)  # attn_cost ~ tokens^2


def test_numerator_without_baseline_reports_values_only() -> None:
    chk = check_numerator(_work_window(1000, 980, np.random.default_rng(3)))
    assert not chk.has_baseline and not chk.numerator_changed
    tokens = next(f for f in chk.fields if f.name == "tokens")
    assert tokens.current == pytest.approx(4000, rel=0.02)
    assert np.isnan(tokens.ratio)


# --- baseline -----------------------------------------------------------------------------


def test_distribution_by_hand() -> None:
    d = distribution(np.array([1.0, 2.0, 3.0, 4.0, 100.0]))
    assert (d.n, d.p50, d.max, d.mean) == (5, 3.0, 100.0, 22.0)
    assert d.tail_stalls == 1  # 100 > 2 x 3
    assert d.stall_threshold == TAIL_STALL * 3.0
    d2 = distribution(np.array([5.0, 7.0]), reference_p50=3.0)
    assert d2.tail_stalls == 1


def test_manifest_diff_field_by_field() -> None:
    base = {"versions": {"torch": "2.3", "nccl": "2.20"}, "env": {"NCCL_ALGO": "Ring"}, "x": 1}
    cur = {"versions": {"torch": "2.3", "nccl": "2.21"}, "env": {}, "y": [1, 2]}
    diff = {c.field: (c.baseline, c.current) for c in manifest_diff(cur, base)}
    assert diff == {
        "versions.nccl": ("2.20", "2.21"),
        "env": (None, {}),
        "env.NCCL_ALGO": ("Ring", None),
        "x": (1, None),
        "y": (None, [1, 2]),
    }
    assert flatten({"a": {"b": {"c": 1}}}) == {"a.b.c": 1}
    # What a simulated run records about its injected fault is never part of the diff.
    sim_base = {"sim": {"scenario": "x", "truth": {"mechanism": "healthy"}, "spec": {"s": 1}}}
    sim_cur = {"sim": {"scenario": "x", "truth": {"mechanism": "slow"}, "spec": {"s": 2}}}
    assert manifest_diff(sim_cur, sim_base) == ()


def test_compare_runs_ratios_and_stalls() -> None:
    base = steady(2, 20, ranks=rank_layout(2, ranks_per_host=2))
    t_start = np.tile(np.arange(20) * 1200.0, (2, 1))
    dur = np.full((2, 20), 1200.0)
    dur[:, 7] = 3000.0
    cur = make_window(t_start, t_start + dur, ranks=rank_layout(2, ranks_per_host=2))
    cmp = compare_runs(cur, base)
    assert cmp.p50_ratio == pytest.approx(1.2)
    assert cmp.current.tail_stalls == 1  # 3000 > 2 x 1000 (baseline median)
    assert cmp.max_ratio == pytest.approx(3.0)
    assert not cmp.mean_improved_tail_worse


def test_mean_improved_tail_worse() -> None:
    before = distribution(np.full(100, 10.0))
    x = np.full(100, 8.0)
    x[:3] = 30.0
    after = distribution(x, reference_p50=before.p50)
    assert after.mean < before.mean
    assert tail_got_worse(before, after)
    assert not tail_got_worse(before, distribution(np.full(100, 8.0), reference_p50=10.0))


# --- correlation --------------------------------------------------------------------------


def _compute_window(compute: np.ndarray, **kw):
    n_ranks, n_steps = compute.shape
    top = compute.max(axis=0)
    t_start = np.tile(np.arange(n_steps) * 2.0 * top.max(), (n_ranks, 1))
    return make_window(
        t_start,
        t_start + top,
        # The forward span contains the collective in which the rank waits.
        phase_ns={"forward": np.broadcast_to(top, compute.shape).copy()},
        coll={"exposed_wait_ns": top - compute},
        ranks=rank_layout(n_ranks),
        **kw,
    )


def test_relative_to_step() -> None:
    x = np.array([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]])
    assert relative_to_step(x).tolist() == [[0.5, 0.5], [1.0, 1.0], [1.5, 1.5]]


def test_slow_rank_stable_vs_moving() -> None:
    rng = np.random.default_rng(5)
    n_ranks, n_steps = 32, 40
    base = 1000.0 * (1 + 0.002 * rng.standard_normal((n_ranks, n_steps)))
    hw = base.copy()
    hw[13] *= 1.3
    p = slow_rank_pattern(_compute_window(hw), decompose(_compute_window(hw)))
    assert p.modal_rank == 13 and p.modal_share == 1.0 and p.stable
    assert p.persistent[13] == pytest.approx(1.3, rel=0.01)
    assert p.persistent_z[13] > 50
    data = base.copy()
    movers = rng.integers(0, n_ranks, n_steps)
    data[movers, np.arange(n_steps)] *= 1.3
    w = _compute_window(data)
    p2 = slow_rank_pattern(w, decompose(w))
    assert not p2.stable
    assert p2.distinct > 10
    assert p2.split_half_r < p.split_half_r


def test_a_spike_in_one_of_two_steps_is_no_persistent_slowness() -> None:
    # A two-step window (a regime just begun): rank 5 is 14 % slow in one step only, rank
    # 9 is 7 % slow in both. Only rank 9 is persistently slow; the mean of rank 5's two
    # steps would put it at 7 % as well.
    rng = np.random.default_rng(2)
    c = 1000.0 * (1 + 0.002 * rng.standard_normal((32, 2)))
    c[5, 1] *= 1.14
    c[9] *= 1.07
    w = _compute_window(c)
    p = slow_rank_pattern(w, decompose(w))
    assert p.persistent[9] == pytest.approx(1.07, rel=0.01)
    assert p.persistent[5] == pytest.approx(1.0, abs=0.01)
    assert p.persistent_z[9] > 10 > p.persistent_z[5]
    assert p.residual[9] > 0.05 > p.residual[5]


def test_majority_level_is_the_lower_median() -> None:
    from rankscope.diagnosis.robust import majority_level

    x = np.array([[1.0, 9.0], [3.0, np.nan], [np.nan, np.nan], [4.0, 1.0], [5.0, 2.0]]).T
    # Per column: {1, 9} -> 1; {3} -> 3; {} -> NaN; {1, 4} -> 1; {2, 5} -> 2.
    got = majority_level(x, axis=0)
    assert got[[0, 1, 3, 4]].tolist() == [1.0, 3.0, 1.0, 2.0] and np.isnan(got[2])
    odd = majority_level(np.array([7.0, 1.0, 3.0, np.nan, 100.0]))
    assert odd == 3.0  # four finite values: the lower middle one
    assert majority_level(np.array([2.0, 8.0, 5.0])) == 5.0  # odd count: the median


def test_work_correlation_explains_data_imbalance() -> None:
    rng = np.random.default_rng(6)
    n_ranks, n_steps = 16, 30
    attn = rng.lognormal(0, 0.5, (n_ranks, n_steps)) * 1e6
    tokens = np.full((n_ranks, n_steps), 8192.0)
    compute = 500.0 + attn * 1e-3 * (1 + 0.002 * rng.standard_normal((n_ranks, n_steps)))
    w = _compute_window(compute, work={"tokens": tokens, "attn_cost": attn})
    wc = work_correlation(w, decompose(w))
    assert wc.attn_rho > 0.95
    assert wc.r2 > 0.95
    assert wc.slowest_is_heaviest > 0.9
    assert wc.work_excess == pytest.approx(wc.compute_excess, rel=0.05)
    assert np.isnan(wc.tokens_rho)  # tokens are equal on every rank
    assert wc.tokens_max_ratio == 1.0
    assert wc.rho_text("tokens") == "equal on every rank"
    assert wc.rho_text("attn_cost") == f"ρ {wc.attn_rho:.2f}"


def test_input_effect_points_at_the_host() -> None:
    rng = np.random.default_rng(7)
    n_ranks, n_steps = 32, 20
    step = 1000.0
    inp = 10 + rng.random((n_ranks, n_steps))
    inp[8:16] += 200  # host 1
    w = steady(n_ranks, n_steps, step, phase_ns={"input": inp}, ranks=rank_layout(32))
    metrics = rank_metrics(w, decompose(w))
    e = effect_size(metrics["input"], w.ranks.host)
    assert e.standout == 1
    assert e.epsilon2 > 0.9


# --- trends -------------------------------------------------------------------------------


def test_periodic_checkpoint_spikes() -> None:
    n_ranks, n_steps = 8, 40
    step = np.full((n_ranks, n_steps), 1000.0)
    ckpt = np.zeros((n_ranks, n_steps))
    ckpt[:, 3::5] = 800.0
    step += ckpt
    step *= 1 + 0.001 * np.random.default_rng(8).standard_normal((1, n_steps))
    t_start = np.tile(np.concatenate(([0], np.cumsum(step[0])[:-1])), (n_ranks, 1))
    w = make_window(t_start, t_start + step, phase_ns={"checkpoint": ckpt}, ranks=rank_layout(8))
    s = find_spikes(w, decompose(w))
    assert s.steps.tolist() == list(range(3, 40, 5))
    assert s.periodic and s.period == 5.0
    assert s.dominant_category() == "checkpoint"
    assert s.share_of_time == pytest.approx(8 * 800 / step[0].sum(), rel=0.02)


def test_irregular_spikes_are_not_periodic() -> None:
    n_steps = 40
    step = np.full((4, n_steps), 1000.0)
    comm = np.zeros((4, n_steps))
    hit = [2, 3, 11, 25, 26, 27, 38]
    comm[:, hit] = 600.0
    step += comm
    t_start = np.tile(np.concatenate(([0], np.cumsum(step[0])[:-1])), (4, 1))
    w = make_window(
        t_start, t_start + step, coll={"exposed_transfer_ns": comm}, ranks=rank_layout(4)
    )
    s = find_spikes(w, decompose(w))
    assert s.steps.tolist() == hit
    assert not s.periodic
    assert s.dominant_category() == "exposed_comm"


def test_allocator_growth_trend() -> None:
    n_ranks, n_steps = 4, 50
    reserved = np.tile(1e9 + 2e7 * np.arange(n_steps), (n_ranks, 1))
    mem_phase = np.tile(0.5 * np.arange(n_steps), (n_ranks, 1))
    w = steady(
        n_ranks,
        n_steps,
        ranks=rank_layout(4),
        memory={"mem_reserved": reserved},
        phase_ns={"memory": mem_phase},
    )
    t = trends(w, decompose(w))
    by = {m.name: m for m in t.memory}
    assert by["mem_reserved"].slope_per_step == pytest.approx(2e7)
    assert by["mem_reserved"].rho == pytest.approx(1.0)
    assert by["memory_phase"].slope_per_step == pytest.approx(0.5)
    assert np.isnan(by["alloc_retries"].slope_per_step)


def test_thermal_drift_flags_the_falling_clock() -> None:
    n_ranks, n_steps = 16, 40
    clock = np.full((n_ranks, n_steps), 1980.0)
    clock += np.random.default_rng(9).normal(0, 2, clock.shape)
    clock[5] = np.linspace(1980, 1500, n_steps)
    w = steady(n_ranks, n_steps, ranks=rank_layout(16), device={"sm_clock_mhz": clock})
    t = trends(w, decompose(w))
    assert t.thermal_ranks.tolist() == [5]
    assert t.sm_clock_change[5] < -0.15


# --- stall --------------------------------------------------------------------------------


def test_stall_names_missing_ranks() -> None:
    ranks = rank_layout(4, ranks_per_host=4)
    groups = make_groups(ranks, [[0, 1, 2, 3]], names=["world"])
    w0 = steady(4, 5, ranks=ranks)
    # Step 5 never ends: ranks 0, 1, 3 entered (group 0, seq 5) at 5100; rank 2 did not.
    rows = CollRows(
        rank=np.array([0, 1, 3]),
        step=np.full(3, 5),
        op=np.full(3, schema.OP_INDEX["all_reduce"]),
        group=np.zeros(3, np.int32),
        seq=np.full(3, 5),
        nbytes=np.full(3, 1024),
        t_enter=np.array([5100.0, 5150.0, 5120.0]),
        t_start=np.full(3, np.nan),
        t_end=np.full(3, np.nan),
        t_exit=np.full(3, np.nan),
        flags=np.zeros(3, np.int32),
    )
    inst = instance_table(
        group=[0],
        seq=[5],
        step=[5],
        op=[schema.OP_INDEX["all_reduce"]],
        nbytes=[1024],
        n_members=[4],
        n_arrived=[3],
        first=[5100.0],
        last=[5150.0],
    )
    w = make_window(w0.t_start, w0.t_end, ranks=ranks, groups=groups, instances=inst)
    w = type(w)(**{**w.__dict__, "rows": rows})
    st = detect_stall(w, now_ns=20_000.0)
    assert st.stalled
    assert st.idle_steps == pytest.approx(15.0)
    assert len(st.pending) == 1
    assert st.pending[0].missing == (2,)
    assert st.pending[0].group_name == "world"
    assert st.culprits() == [2]
    # Judged at the latest time in the data (5150), the run is not yet stalled.
    assert not detect_stall(w).stalled


def test_no_stall_in_steady_run() -> None:
    w = steady(4, 10, ranks=rank_layout(4))
    st = detect_stall(w)
    assert not st.stalled and st.pending == () and st.silent_ranks == ()


def test_less_executed_work_is_not_a_numerator_change() -> None:
    rng = np.random.default_rng(4)
    chk = check_numerator(_work_window(800, 780, rng), _work_window(1000, 980, rng))
    assert "tokens" in chk.changed
    assert not chk.numerator_changed
    assert chk.executed_ratio == 1.0


# --- exposure -----------------------------------------------------------------------------


def _bucket_rows(cut_enter: list[float], exits: list[float], lasts: list[float]):
    """One rank, one step, async buckets entering at ``cut_enter`` and leaving at ``exits``;
    the instance of bucket i completed (last arrival) at ``lasts[i]``."""
    n = len(exits)
    flags = np.full(n, schema.FLAG_ASYNC | schema.FLAG_DDP_BUCKET, np.int32)
    rows = CollRows(
        rank=np.zeros(n, np.int64),
        step=np.zeros(n, np.int64),
        op=np.full(n, schema.OP_INDEX["all_reduce"]),
        group=np.zeros(n, np.int32),
        seq=np.arange(n),
        nbytes=np.full(n, 1 << 20),
        t_enter=np.array(cut_enter, float),
        t_start=np.full(n, np.nan),
        t_end=np.full(n, np.nan),
        t_exit=np.array(exits, float),
        flags=flags,
    )
    inst = instance_table(
        group=np.zeros(n),
        seq=np.arange(n),
        op=np.full(n, schema.OP_INDEX["all_reduce"]),
        nbytes=np.full(n, 1 << 20),
        n_members=np.full(n, 2),
        first=np.array(cut_enter, float),
        last=np.array(lasts, float),
    )
    ranks = rank_layout(1, ranks_per_host=1)
    w = make_window(
        np.array([[0.0]]),
        np.array([[1000.0]]),
        ranks=ranks,
        instances=inst,
        coll={"n": np.array([[float(n)]])},
    )
    return type(w)(**{**w.__dict__, "rows": rows})


def test_exposure_union_counts_nested_async_buckets_once() -> None:
    from rankscope.diagnosis.exposure import exposed_union, rows_cover_window

    # Three buckets issued at 100, 200, 300 (cut = 300); they leave at 400, 500, 600.
    # Bucket 2's instance completed at 450 (others still arriving until then).
    w = _bucket_rows([100, 200, 300], [400, 500, 600], [150, 450, 300])
    assert rows_cover_window(w)
    e = exposed_union(w)
    # Union after the cut: [300, 600] = 300 ns, not 100 + 200 + 300 = 600.
    # Pieces: [300, 400] bucket 0 (complete at 150: transfer 100);
    #         [400, 500] bucket 1 (complete at 450: wait 50, transfer 50);
    #         [500, 600] bucket 2 (complete at 300: transfer 100).
    assert e["exposed_wait_ns"][0, 0] == pytest.approx(50.0)
    assert e["exposed_transfer_ns"][0, 0] == pytest.approx(250.0)


def test_exposure_counts_calls_whose_instance_never_completed() -> None:
    # A member's rows are missing (its collector times no collective): no instance of the
    # group completes. What the rank spent in them is exposed all the same, as transfer
    # (the split needs the last arrival): read as compute, it made the rank a straggler.
    from rankscope.diagnosis.exposure import exposed_union

    w = _bucket_rows([100, 200, 300], [400, 500, 600], [150, 450, 300])
    inst = w.instances
    open_ = type(inst)(**{**inst.__dict__, "n_arrived": np.ones(3, np.int32)})
    e = exposed_union(type(w)(**{**w.__dict__, "instances": open_}))
    assert e["exposed_wait_ns"][0, 0] == 0.0
    assert e["exposed_transfer_ns"][0, 0] == pytest.approx(300.0)  # the union after the cut
    # A blocking call of an incomplete instance: exposed whole.
    rows = w.rows
    assert rows is not None
    blocking = type(rows)(**{**rows.__dict__, "flags": np.zeros(3, np.int32)})
    w2 = type(w)(**{**w.__dict__, "instances": open_, "rows": blocking})
    e = exposed_union(w2)
    assert e["exposed_transfer_ns"][0, 0] == pytest.approx(300.0 + 300.0 + 300.0)


def test_exposure_needs_rows_for_every_rank_step() -> None:
    from rankscope.diagnosis.exposure import rows_cover_window

    w = _bucket_rows([100], [400], [150])
    w2 = type(w)(**{**w.__dict__, "rows": None})
    assert not rows_cover_window(w2)


def test_pipeline_recv_time_stays_in_pipeline_idle() -> None:
    from rankscope.diagnosis.exposure import exposed_union

    # One rank-step of 1000 ns: forward 600, then a recv entered at 600 whose instance
    # completed (the sender arrived) at 900 and left at 950; pp_wait spans [600, 950].
    rows = CollRows(
        rank=np.zeros(1, np.int64),
        step=np.zeros(1, np.int64),
        op=np.array([schema.OP_INDEX["recv"]]),
        group=np.zeros(1, np.int32),
        seq=np.zeros(1, np.int64),
        nbytes=np.array([1 << 20]),
        t_enter=np.array([600.0]),
        t_start=np.full(1, np.nan),
        t_end=np.full(1, np.nan),
        t_exit=np.array([950.0]),
        flags=np.zeros(1, np.int32),
    )
    inst = instance_table(
        group=[0],
        seq=[0],
        op=[schema.OP_INDEX["recv"]],
        nbytes=[1 << 20],
        n_members=[2],
        first=[600.0],
        last=[900.0],
    )
    w = make_window(
        np.array([[0.0]]),
        np.array([[1000.0]]),
        ranks=rank_layout(1, ranks_per_host=1),
        instances=inst,
        phase_ns={"forward": np.array([[600.0]]), "pp_wait": np.array([[350.0]])},
        coll={"n": np.ones((1, 1))},
    )
    w = type(w)(**{**w.__dict__, "rows": rows})
    e = exposed_union(w)
    assert e["exposed_wait_ns"][0, 0] == 300.0 and e["exposed_transfer_ns"][0, 0] == 50.0
    assert e["p2p_ns"][0, 0] == 350.0
    d = decompose(w, e)
    assert d.category("pipeline_idle")[0, 0] == 350.0
    assert d.category("arrival_wait")[0, 0] == 0.0
    assert d.category("exposed_comm")[0, 0] == 0.0
    assert d.category("compute")[0, 0] == 600.0
    assert d.category("host_gap")[0, 0] == 50.0


def test_decompose_splits_each_rank_step_alone_whatever_the_block_of_ranks(monkeypatch) -> None:
    # decompose works through blocks of ranks; every rank-step's split is its own, so a
    # block of one rank gives what one block of everything gives: unknown, negative,
    # infinite and negative-zero measurements, absent rank-steps, user phases, calls that
    # never completed and point-to-point time. Only the first ranks hold them, so a block
    # of the others is all known and present: the shortcuts taken there must give what
    # the general path gives, bit for bit. (Where a -0.0 was measured the sign of a zero
    # may differ: ``np.fmax(-0.0, 0.0)`` depends on where in the array the element is.)
    import rankscope.diagnosis.decomposition as dec

    rng = np.random.default_rng(11)
    world, steps, spoiled = 90, 23, 40
    step = rng.uniform(80, 120, (world, steps)) * 1e6
    t_start = np.cumsum(np.full((world, steps), 150e6), axis=1)

    def part(scale: float) -> np.ndarray:
        a = rng.uniform(0, scale, (world, steps)) * 1e6
        head = a[:spoiled]
        head[rng.random(head.shape) < 0.05] = np.nan
        head[rng.random(head.shape) < 0.02] *= -1
        head[rng.random(head.shape) < 0.02] = -0.0
        head[rng.random(head.shape) < 0.01] = np.inf
        head[rng.random(head.shape) < 0.02] = 0.0
        return a

    phases = {n: part(40) for n in ("forward", "backward", "pipeline_idle", "input")}
    phases["forward"][::7] = 0.0  # ranks without compute phases: compute is the residual
    phases["backward"][::7] = 0.0
    phases["tokenize"] = part(5)
    coll = {"exposed_wait_ns": part(20), "exposed_transfer_ns": part(20)}
    # Some calls never completed: their time is in coll_ns, not in wait or transfer.
    coll["wait_ns"], coll["transfer_ns"] = coll["exposed_wait_ns"], coll["exposed_transfer_ns"]
    coll["coll_ns"] = np.nan_to_num(coll["wait_ns"] + coll["transfer_ns"], nan=0.0)
    coll["coll_ns"][:spoiled:3] += 5e6
    present = np.ones((world, steps), bool)
    present[:spoiled] = rng.random((spoiled, steps)) > 0.05
    t_end = t_start + step
    t_end[:spoiled:5, 3] = np.nan
    w = make_window(t_start, t_end, phase_ns=phases, coll=coll, present=present)
    exposed = {**coll, "p2p_ns": part(10)}
    # An infinite measurement overflows the sums it enters (it is still counted).
    with np.errstate(over="ignore", invalid="ignore"):
        whole = [decompose(w), decompose(w, exposed)]
        monkeypatch.setattr(dec, "_BLOCK_CELLS", 7)
        blocked = [decompose(w), decompose(w, exposed)]
    for d, small in zip(whole, blocked, strict=True):
        for name in ("ns", "step_ns", "overlap_ns", "compute_from_phases"):
            a, b = getattr(d, name), getattr(small, name)
            assert np.array_equal(a, b, equal_nan=True), name
            assert a[..., spoiled:, :].tobytes() == b[..., spoiled:, :].tobytes(), name
        absent = np.isnan(d.step_ns)
        assert absent[:spoiled].any() and not absent[spoiled:].any()
        assert np.isnan(d.ns[:, absent]).all()
        sums = d.ns[:, spoiled:].sum(axis=0)
        assert np.allclose(sums, d.step_ns[spoiled:], rtol=1e-9)


def test_decompose_only_some_categories_gives_them_as_the_full_split_does() -> None:
    # The heatmap asks for one category (the busy time for two): each must be the full
    # split's, bit for bit (the scaling of overlapping categories needs every measured
    # one); a category not asked for is refused, not read as zeros.
    rng = np.random.default_rng(5)
    world, steps = 40, 9
    step = rng.uniform(80, 120, (world, steps)) * 1e6
    t_start = np.cumsum(np.full((world, steps), 150e6), axis=1)
    phases = {
        n: rng.uniform(0, 50, (world, steps)) * 1e6 for n in ("forward", "backward", "pp_wait")
    }
    phases["tokenize"] = rng.uniform(0, 9, (world, steps)) * 1e6
    coll = {
        "exposed_wait_ns": rng.uniform(0, 30, (world, steps)) * 1e6,
        "exposed_transfer_ns": rng.uniform(0, 30, (world, steps)) * 1e6,
    }
    present = rng.random((world, steps)) > 0.1
    w = make_window(t_start, t_start + step, phase_ns=phases, coll=coll, present=present)
    full = decompose(w)
    assert (full.overlap_ns[present] > 0).any()  # some rank-steps were scaled down
    from rankscope.diagnosis.decomposition import CATEGORIES

    for cats in [
        ("compute",),
        ("arrival_wait", "pipeline_idle"),
        ("exposed_comm",),
        ("host_gap",),
        ("other",),
        ("compute", "other"),
    ]:
        part = decompose(w, only=cats)
        for c in cats:
            assert part.category(c).tobytes() == full.category(c).tobytes(), c
        missing = next(c for c in CATEGORIES if c not in cats)
        with pytest.raises(KeyError, match="not computed"):
            part.category(missing)
        assert set(part.mean_per_step()) == set(cats)
    with pytest.raises(KeyError, match="unknown categories"):
        decompose(w, only=("compute", "idle"))


def test_decompose_without_rows_counts_calls_that_never_completed_as_comm() -> None:
    # The sums hold an incomplete call's time inside (coll_ns) but no wait or transfer:
    # that time is collective, not compute. Rank 0: a 1000 ns step, forward 900, 300 ns
    # in calls that never completed; rank 1: the same with its 300 ns split (complete).
    w = make_window(
        np.zeros((2, 1)),
        np.full((2, 1), 1000.0),
        phase_ns={"forward": np.full((2, 1), 900.0)},
        coll={
            "n": np.ones((2, 1)),
            "coll_ns": np.full((2, 1), 300.0),
            "wait_ns": np.array([[0.0], [100.0]]),
            "transfer_ns": np.array([[0.0], [200.0]]),
            "exposed_wait_ns": np.array([[0.0], [100.0]]),
            "exposed_transfer_ns": np.array([[0.0], [200.0]]),
        },
    )
    d = decompose(w)
    assert d.category("exposed_comm")[0, 0] == 300.0  # all of it, as transfer
    assert d.category("compute")[0, 0] == d.category("compute")[1, 0] == 700.0
    assert d.category("host_gap")[0, 0] == 0.0


@pytest.mark.parametrize(
    ("k", "m", "q"),
    [(0, 5, 0.3), (3, 10, 0.3), (5, 5, 0.3), (22, 22, 0.5), (1, 4, 0.0), (40, 200, 0.1)],
)
def test_binomial_tail_is_the_exact_sum(k, m, q) -> None:
    from math import comb

    from rankscope.diagnosis.robust import binomial_tail

    exact = sum(comb(m, j) * q**j * (1 - q) ** (m - j) for j in range(k, m + 1))
    assert binomial_tail(k, m, q) == pytest.approx(exact, rel=1e-9, abs=1e-300)
