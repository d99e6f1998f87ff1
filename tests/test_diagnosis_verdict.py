"""The verdict on small hand-made windows (no simulator)."""

import numpy as np
import pytest

from rankscope.diagnosis.engine import diagnose
from rankscope.diagnosis.synthetic import make_window, rank_layout

R, S = 16, 60


def _steps(step: np.ndarray):
    t0 = np.cumsum(np.concatenate([np.zeros((step.shape[0], 1)), step[:, :-1]], axis=1), axis=1)
    return t0, t0 + step


def test_allocator_growth_without_a_memory_phase() -> None:
    rng = np.random.default_rng(0)
    step = 1e9 * (1 + 0.004 * np.arange(S))[None, :] * (1 + 0.002 * rng.standard_normal((R, S)))
    reserved = np.repeat(1e10 * (1 + 0.01 * np.arange(S))[None, :], R, axis=0)
    w = make_window(*_steps(step), ranks=rank_layout(R), memory={"mem_reserved": reserved})
    top = diagnose(w).verdict.top
    assert top.mechanism == "allocator_growth"
    assert top.impact > 0.15
    assert any("no memory-management phase" in e for e in top.evidence)
    # The same footprint with a flat step time is no regression.
    flat = 1e9 * (1 + 0.002 * rng.standard_normal((R, S)))
    w2 = make_window(*_steps(flat), ranks=rank_layout(R), memory={"mem_reserved": reserved})
    assert diagnose(w2).verdict.top.mechanism == "healthy"


def test_slow_device_names_rank_clock_and_throttle() -> None:
    rng = np.random.default_rng(1)
    compute = 8e8 * (1 + 0.003 * rng.standard_normal((R, S)))
    compute[11] *= 1.25
    top_c = compute.max(axis=0)
    wait = top_c - compute
    step = np.broadcast_to(top_c + 5e7, (R, S)).copy()
    clock = np.full((R, S), 1980.0)
    clock[11] = 1500.0
    throttle = np.zeros((R, S))
    throttle[11] = 0x20
    w = make_window(
        *_steps(step),
        ranks=rank_layout(R),
        phase_ns={"forward": compute + wait},
        coll={"exposed_wait_ns": wait, "exposed_transfer_ns": np.full((R, S), 5e7)},
        device={"sm_clock_mhz": clock, "throttle": throttle},
    )
    top = diagnose(w).verdict.top
    assert top.mechanism == "slow_device"
    assert top.ranks == (11,) and top.hosts == ("node0001",)
    text = " ".join(top.evidence)
    assert "SM clock of rank 11 1500 MHz" in text and "throttle reasons 0x20" in text
    assert top.next_experiment.scope == "one-rank"


def test_slow_host_input_names_the_host() -> None:
    rng = np.random.default_rng(2)
    inp = 5e6 * (1 + 0.1 * rng.standard_normal((R, S)))
    inp[8:16] += 2e8  # host 1
    busy = 8e8 + inp
    step = np.broadcast_to(busy.max(axis=0), (R, S)).copy()
    wait = step - busy
    w = make_window(
        *_steps(step),
        ranks=rank_layout(R),
        phase_ns={"input": inp, "forward": np.full((R, S), 8e8) + wait},
        coll={"exposed_wait_ns": wait},
    )
    top = diagnose(w).verdict.top
    assert top.mechanism == "slow_host_input"
    assert top.hosts == ("node0001",) and set(top.ranks) == set(range(8, 16))


def test_a_run_without_collectives_says_what_was_not_judged() -> None:
    rng = np.random.default_rng(2)
    step = 1e8 * (1 + 0.002 * rng.standard_normal((R, S)))
    bare = diagnose(make_window(*_steps(step), ranks=rank_layout(R))).verdict.top
    assert bare.mechanism == "healthy"
    assert any("no collective was recorded" in c for c in bare.caveats)
    n = np.full((R, S), 3.0)
    timed = diagnose(make_window(*_steps(step), ranks=rank_layout(R), coll={"n": n}))
    assert not any("no collective" in c for c in timed.verdict.top.caveats)


def test_near_equal_scores_are_ranked_by_impact() -> None:
    from dataclasses import replace

    from rankscope.diagnosis.verdict import SCORE_TIE, rank

    rng = np.random.default_rng(4)
    step = 1e9 * (1 + 0.002 * rng.standard_normal((R, S)))
    hyps = {h.mechanism: h for h in diagnose(make_window(*_steps(step))).verdict.hypotheses}
    healthy = hyps.pop("healthy")
    a, b, c = (hyps[m] for m in sorted(hyps)[:3])
    small = replace(a, score=1.0, impact=0.026)  # saturated, cheap
    large = replace(b, score=1.0 - SCORE_TIE / 2, impact=0.8)  # a little weaker, costly
    far = replace(c, score=1.0 - 2 * SCORE_TIE, impact=0.9)  # clearly weaker: stays behind
    low = replace(healthy, score=0.0)
    assert [h.mechanism for h in rank([small, far, low, large])] == [
        b.mechanism,
        a.mechanism,
        c.mechanism,
        "healthy",
    ]
    # Healthy keeps its place by score: a weak mechanism does not jump it on impact.
    weak = replace(a, score=0.4, impact=0.5)
    sound = replace(healthy, score=0.6)
    assert [h.mechanism for h in rank([weak, sound])] == ["healthy", a.mechanism]


def _uniform_jobs():
    """A maker of jobs whose every rank takes ``factor`` seconds a step (0.2 % noise)."""
    rng = np.random.default_rng(3)

    def run(factor: float):
        step = factor * 1e9 * (1 + 0.002 * rng.standard_normal((R, S)))
        return make_window(*_steps(step), ranks=rank_layout(R))

    return run


def test_a_run_much_slower_than_its_baseline_is_not_called_healthy() -> None:
    # Every rank 2.5x slower and no mechanism with a signature: the step regressed all the
    # same, so healthy must not lead with a high score; the same job at the baseline's pace
    # stays healthy.
    run = _uniform_jobs()
    base = run(1.0)
    same = {h.mechanism: h for h in diagnose(run(1.0), base).verdict.hypotheses}["healthy"]
    slow = {h.mechanism: h for h in diagnose(run(2.5), base).verdict.hypotheses}["healthy"]
    assert same.score > 0.9
    assert slow.score < 0.05
    assert any("2.50x the baseline's: a regression" in c for c in slow.caveats), slow.caveats


def test_a_regression_no_mechanism_explains_reads_unexplained() -> None:
    # The same 2.5x slower job: what leads is the regression left unexplained, on the job
    # (no rank sets it) and where the time grew, not the best of the mechanisms' scores
    # near zero; a job at the baseline's pace leads with healthy.
    run = _uniform_jobs()
    base = run(1.0)
    top = diagnose(run(2.5), base).verdict.top
    assert top.mechanism == "unexplained_straggler", (top.mechanism, top.score)
    assert top.score > 0.9 and top.ranks == ()
    assert top.impact == pytest.approx(1 - 1 / 2.5, abs=0.02)
    assert any("2.50x the baseline's" in e for e in top.evidence), top.evidence
    assert any("no catalogued mechanism accounts for it" in e for e in top.evidence)
    assert top.next_experiment.scope == "one-rank"
    assert "baseline's side by side" in top.next_experiment.change
    assert diagnose(run(1.0), base).verdict.top.mechanism == "healthy"
    # Slower but under the regression's threshold: not called anything.
    assert diagnose(run(1.2), base).verdict.top.mechanism == "healthy"


def test_a_mechanism_far_too_small_for_the_regression_fades() -> None:
    from rankscope.diagnosis.verdict import MIN_COVER, covers

    share = 1 - 1 / 2.8  # the step regressed 2.8x: 64 % of it is new
    assert covers(0.035, 1.0, share) < 0.05  # 3.5 % of the step: not the cause
    assert covers(0.8, 1.0, share) > 0.99  # 80 %: accounts for all of it
    assert covers(2 * MIN_COVER * share, 1.0, share) > 0.99
    assert covers(0.035, 0.0, share) == 1.0  # no regression: nothing fades
