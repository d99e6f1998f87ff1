"""The verdict on every simulated scenario, and the seed's worked example end to end.

Each scenario runs in-process at 64 ranks against a healthy baseline of the same job (the
same drawn configuration without the fault, on its own noise), exactly as
``rankscope eval`` scores it; the top hypothesis must be the simulator's truth and name the
afflicted ranks, hosts and rails where the truth has them.
"""

import numpy as np
import pytest

from rankscope.commands.eval_ import baseline_of, catalog, score_case, simulate_window
from rankscope.diagnosis.engine import diagnose
from rankscope.diagnosis.experiment import evaluate
from rankscope.diagnosis.robust import nanmedian
from rankscope.sim.spec import load_scenario

STEPS = 20


def _run(name: str, seed: int, ranks: int = 64, scope=None):
    sc = load_scenario(name, seed=seed, ranks=ranks)
    window, truth = simulate_window(sc, STEPS, f"{name}-{seed}", scope)
    base, _ = simulate_window(baseline_of(sc), STEPS, f"baseline-{seed}", scope)
    return window, base, truth


@pytest.mark.parametrize("name", catalog())
def test_verdict_on_scenario(name: str) -> None:
    window, base, truth = _run(name, seed=5)
    diag = diagnose(window, base)
    top = diag.verdict.top
    assert top.mechanism == truth["mechanism"], [
        (h.mechanism, round(h.score, 2)) for h in diag.verdict.hypotheses[:3]
    ]
    rank_ok, host_ok, rail_ok = score_case(diag, truth)
    assert rank_ok in (True, None) and host_ok in (True, None) and rail_ok in (True, None), (
        truth,
        top.ranks[:8],
        top.hosts,
        top.rails,
    )
    # Every hypothesis carries evidence and a falsifiable next experiment.
    assert top.evidence
    assert top.next_experiment.supports and top.next_experiment.rejects


def test_healthy_without_baseline_is_healthy() -> None:
    sc = load_scenario("healthy", seed=9, ranks=128)
    window, _ = simulate_window(sc, STEPS, "healthy-alone")
    assert diagnose(window).verdict.top.mechanism == "healthy"


# --- the seed's worked example ------------------------------------------------------------


@pytest.fixture(scope="module")
def worked_example():
    new = load_scenario("seed-example")
    old = load_scenario("seed-example-baseline")
    w_new, truth = simulate_window(new, STEPS, "new-packer")
    w_old, _ = simulate_window(old, STEPS, "old-packer")
    return new, old, w_new, w_old, truth


def _median_instances(window, values):
    inst = window.instances
    ok = inst.n_arrived >= inst.n_members
    return float(nanmedian(values[ok]))


def test_worked_example_new_packer_raises_entry_spread_not_transfer(worked_example) -> None:
    _, _, w_new, w_old, truth = worked_example
    assert truth["mechanism"] == "data_imbalance"
    diag = diagnose(w_new, w_old)
    # The manifests differ in the packing policy; the useful work per step does not.
    changed = {c.field for c in diag.comparison.manifest}
    assert "job_config.packer" in changed
    assert abs(diag.numerator.useful_ratio - 1.0) < 0.02
    assert not diag.numerator.numerator_changed
    # Missing time first appears as waiting at the all-reduce ...
    assert diag.delta is not None and diag.delta.first_appears == "arrival_wait"
    assert diag.comparison.p50_ratio > 1.05
    # ... entry spread rises while post-arrival transfer is unchanged.
    spread_new = _median_instances(w_new, w_new.instances.skew)
    spread_old = _median_instances(w_old, w_old.instances.skew)
    tr_new = _median_instances(w_new, w_new.instances.transfer)
    tr_old = _median_instances(w_old, w_old.instances.transfer)
    assert spread_new > 3 * spread_old
    assert tr_new == pytest.approx(tr_old, rel=0.05)
    assert all(abs(s.ratio - 1) < 0.05 for s in diag.curve_shifts)
    # The slow rank moves with the batch and compute follows Σseq², not tokens.
    work = diag.correlations.work
    assert not diag.correlations.slow_rank.stable
    assert work.attn_rho > 0.8
    assert work.tokens_max_ratio == pytest.approx(1.0, abs=0.01)
    assert work.attn_max_ratio > 1.5
    top = diag.verdict.top
    assert top.mechanism == "data_imbalance"
    assert top.next_experiment.scope == "one-node"


def test_worked_example_one_node_replay_reproduces(worked_example) -> None:
    new, old, *_ = worked_example
    w_new, truth = simulate_window(new, STEPS, "new-one-node", "one-node")
    assert truth["mechanism"] == "data_imbalance"
    w_old, _ = simulate_window(old, STEPS, "old-one-node", "one-node")
    assert w_new.world_size == 8
    assert all(not g.crosses_hosts for g in w_new.groups.values())
    diag = diagnose(w_new, w_old)
    # Without any inter-node traffic the compute skew is still there: not the fabric.
    assert diag.verdict.top.mechanism == "data_imbalance"
    assert diag.correlations.work.compute_max_ratio > 1.03


def test_worked_example_attention_balanced_packer_fixes_it(worked_example) -> None:
    _, _, w_new, w_old, _ = worked_example
    record = {
        "hypothesis": "data_imbalance",
        "change": "pack balancing the attention cost as well as tokens",
        "metric": "entry_spread",
        "direction": "down",
        "rejection": "entry spread unchanged with balanced attention cost",
    }
    result = evaluate(w_new, w_old, record)
    assert result.verdict == "supported"
    assert result.change < -0.5
    assert result.step_improved
    assert result.accounting_closed
    assert not result.tail_worse
    # Predicted: lower maximum attention time, post-arrival transfer unchanged.
    transfer = evaluate(w_new, w_old, {**record, "metric": "transfer"})
    assert abs(transfer.change) < 0.05
    assert transfer.verdict == "improved_other"
    compute_max = evaluate(w_new, w_old, {**record, "metric": "compute_max"})
    assert compute_max.moved_as_predicted
    assert np.isfinite(result.predicted_delta_ns)
