"""Experiments and accounting on hand-made before/after windows."""

import numpy as np
import pytest

from rankscope.collector import schema
from rankscope.diagnosis.experiment import ExperimentSpec, evaluate, metric_value
from rankscope.diagnosis.synthetic import instance_table, make_groups, make_window, rank_layout

N_RANKS, N_STEPS = 8, 40


def _window(slow_extra: float, skew: float, transfer: float, seed: int, spikes=()):
    """8 ranks; each step rank (step % 8) computes ``slow_extra`` ns longer than the others,
    who wait for it at one all-reduce per step (entry spread ``skew``)."""
    rng = np.random.default_rng(seed)
    compute = 1e6 * (1 + 0.002 * rng.standard_normal((N_RANKS, N_STEPS)))
    compute[np.arange(N_STEPS) % N_RANKS, np.arange(N_STEPS)] += slow_extra
    for s in spikes:
        compute[:, s] += 3e6
    top = compute.max(axis=0)
    wait = top - compute
    step = top + transfer
    t_start = np.tile(np.arange(N_STEPS) * 1e7, (N_RANKS, 1))
    ranks = rank_layout(N_RANKS)
    groups = make_groups(ranks, [list(range(N_RANKS))], ["world"])
    first = t_start[0] + 1e5
    inst = instance_table(
        group=np.zeros(N_STEPS),
        seq=np.arange(N_STEPS),
        step=np.arange(N_STEPS),
        op=np.full(N_STEPS, schema.OP_INDEX["all_reduce"]),
        nbytes=np.full(N_STEPS, 1 << 26),
        n_members=np.full(N_STEPS, N_RANKS),
        first=first,
        last=first + skew * (1 + 0.01 * rng.standard_normal(N_STEPS)),
        last_rank=np.arange(N_STEPS) % N_RANKS,
        margin=np.full(N_STEPS, skew / 2),
        transfer=transfer * (1 + 0.01 * rng.standard_normal(N_STEPS)),
    )
    return make_window(
        t_start,
        t_start + step,
        ranks=ranks,
        groups=groups,
        phase_ns={"forward": compute + wait},
        coll={
            "n": np.ones((N_RANKS, N_STEPS)),
            "exposed_wait_ns": wait,
            "exposed_transfer_ns": np.full((N_RANKS, N_STEPS), transfer),
        },
        instances=inst,
    )


RECORD = {
    "hypothesis": "data_imbalance",
    "change": "balance attention cost",
    "metric": "entry_spread",
    "direction": "down",
    "rejection": "entry spread unchanged",
}


def test_supported_and_accounting_closed() -> None:
    before = _window(slow_extra=3e5, skew=3e5, transfer=2e5, seed=1)
    after = _window(slow_extra=0.5e5, skew=0.5e5, transfer=2e5, seed=2)
    r = evaluate(before, after, RECORD)
    assert r.verdict == "supported"
    assert r.moved_as_predicted and r.change == pytest.approx(-5 / 6, abs=0.02)
    assert r.step_improved
    # Max-rank compute shrank by about the step improvement (~250 µs).
    assert r.accounting_category == "compute"
    assert r.predicted_delta_ns == pytest.approx(r.step_mean_change_ns, rel=0.1)
    assert r.accounting_closed
    assert not r.tail_worse
    plain = r.to_dict()
    assert plain["verdict"] == "supported" and plain["step_before"]["p50"] > 0


def test_improved_through_another_mechanism() -> None:
    # The step gets faster because transfer shrank; the predicted entry spread did not move.
    before = _window(slow_extra=3e5, skew=3e5, transfer=2e6, seed=1)
    after = _window(slow_extra=3e5, skew=3e5, transfer=0.5e6, seed=2)
    r = evaluate(before, after, RECORD)
    assert r.verdict == "improved_other"
    assert not r.moved_as_predicted and r.step_improved
    assert any("another mechanism" in n for n in r.notes)


def test_rejected_when_nothing_moves() -> None:
    before = _window(slow_extra=3e5, skew=3e5, transfer=2e5, seed=1)
    after = _window(slow_extra=3e5, skew=3e5, transfer=2e5, seed=2)
    r = evaluate(before, after, RECORD)
    assert r.verdict == "rejected"
    assert abs(r.change) < 0.03
    assert not r.accounting_closed


def test_wrong_direction_is_rejected() -> None:
    before = _window(slow_extra=3e5, skew=3e5, transfer=2e5, seed=1)
    after = _window(slow_extra=6e5, skew=6e5, transfer=2e5, seed=2)
    r = evaluate(before, after, RECORD)
    assert r.verdict == "rejected" and r.change > 0.5


def test_warns_when_mean_improves_but_tail_worsens() -> None:
    before = _window(slow_extra=3e5, skew=3e5, transfer=2e5, seed=1)
    after = _window(slow_extra=0.5e5, skew=0.5e5, transfer=2e5, seed=2, spikes=(5, 17))
    r = evaluate(before, after, RECORD)
    assert r.step_after.mean < r.step_before.mean
    assert r.tail_worse
    assert any("tail" in n for n in r.notes)


def test_record_validation() -> None:
    with pytest.raises(ValueError, match="unknown metric"):
        ExperimentSpec.from_record({**RECORD, "metric": "vibes"})
    with pytest.raises(ValueError, match="direction"):
        ExperimentSpec.from_record({**RECORD, "direction": "sideways"})
    with pytest.raises(ValueError, match="misses"):
        ExperimentSpec.from_record({"metric": "entry_spread"})
    with pytest.raises(ValueError, match="unknown metric"):
        metric_value(_window(1e5, 1e5, 1e5, 0), "vibes")


def test_metric_value_by_hand() -> None:
    w = _window(slow_extra=3e5, skew=3e5, transfer=2e5, seed=1)
    assert metric_value(w, "entry_spread") == pytest.approx(3e5, rel=0.02)
    assert metric_value(w, "transfer") == pytest.approx(2e5, rel=0.02)
    assert metric_value(w, "step_time") == pytest.approx(1e6 + 3e5 + 2e5, rel=0.01)
