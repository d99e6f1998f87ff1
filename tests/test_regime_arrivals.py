"""A regime seen in arrivals: one rank late from a step on, while the job's step time moves
less than its own heavy-tailed noise (a large job waits for each step's worst spike)."""

from __future__ import annotations

import numpy as np

from rankscope.diagnosis.regime import arrival_start, current_regime, job_step_ns, regime_start
from rankscope.diagnosis.synthetic import make_window

MS = 1e6
RANKS = 1024
STEPS = 40
ONSET = 37
SLOW = 1021
"""Not one of the evenly spaced ranks the job's step time is read from (every 4th)."""


def _window(slow: bool, seed: int = 0, growth: float = 0.0):
    rng = np.random.default_rng(seed)
    step_ms = 640.0 * (1 + 0.015 * rng.standard_normal(STEPS)) * (1 + growth * np.arange(STEPS))
    # Healthy steps slowed by one rank's compute spike: every rank waits for it, so the job's
    # step time jumps by more than the slow GPU below will ever add.
    spikes = np.array([8, 14, 20, 25, 27, 33])
    step_ms[spikes] += rng.uniform(40.0, 60.0, spikes.size)
    late = (100.0 + 20.0 * rng.standard_normal((RANKS, STEPS))) * MS
    late[rng.integers(0, RANKS, spikes.size), spikes] += rng.uniform(600.0, 900.0, spikes.size) * MS
    if slow:
        step_ms[ONSET:] += 30.0
        late[SLOW, ONSET:] += 800.0 * MS
    step = np.tile(step_ms * MS, (RANKS, 1)) * (1 + 0.001 * rng.standard_normal((RANKS, STEPS)))
    t_start = np.tile(np.cumsum(np.r_[0.0, step_ms[:-1] * MS]), (RANKS, 1))
    n = np.full((RANKS, STEPS), 200.0)
    return make_window(t_start, t_start + step, coll={"late_ns": late, "n": n})


def test_a_straggler_inside_the_step_time_noise_starts_a_regime_from_its_arrivals() -> None:
    w = _window(slow=True)
    # The step time alone shows no regime: its shift is smaller than the healthy spikes.
    assert regime_start(job_step_ns(w)) is None
    regime = current_regime(w)
    assert regime is not None
    assert (regime.start_step, regime.steps, regime.rank) == (ONSET, STEPS - ONSET, SLOW)
    assert f"rank {SLOW} arrives late from step {ONSET}" in regime.describe()


def test_two_late_steps_are_enough() -> None:
    w = _window(slow=True)
    late = w.coll["late_ns"][:, : ONSET + 2]
    assert arrival_start(late, job_step_ns(w)[: ONSET + 2]) == (ONSET, SLOW)
    assert arrival_start(late[:, :-1], job_step_ns(w)[: ONSET + 1]) is None


def test_single_rank_spikes_of_a_healthy_run_are_no_regime() -> None:
    for seed in range(5):
        w = _window(slow=False, seed=seed)
        late, y = w.coll["late_ns"], job_step_ns(w)
        assert current_regime(w) is None
        for end in range(10, STEPS + 1):  # every prefix, as the live view sees it
            assert arrival_start(late[:, :end], y[:end]) is None


def test_a_rank_late_at_the_end_of_a_drifting_job_is_no_regime() -> None:
    # The whole job slows 1 % a step (allocator growth): the trends read it over the whole
    # window. A rank late in its last steps is no new level to restrict the verdict to.
    w = _window(slow=True, growth=0.01)
    assert arrival_start(w.coll["late_ns"], job_step_ns(w)) == (ONSET, SLOW)
    assert current_regime(w) is None
