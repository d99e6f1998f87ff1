"""Real faults in real torch jobs (``examples/faultcases.py``), diagnosed end to end.

Each case is ``examples/faultjobs.py`` under ``torchrun`` (gloo, CPU, one thread per rank)
reporting to a real hub through the collector. Two kinds of test per case:

- the *data* carries the fault: checked from the window alone (phase and collective
  times), so a failing verdict test points at the diagnosis, not at the job;
- the *verdict* names it: `diagnose`'s top mechanism and rank (or stage), and the
  localisation's what-if suspect. A healthy job must be called healthy, unless the shared
  machine slowed one rank for the whole run, so that the others waited for it in the
  collectives: then a straggler on that rank is the answer.

Every case is one session fixture, so each run happens once; the DDP cases share one
healthy baseline run (the hub's store holds it by run id).
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

pytest.importorskip("torch")
if shutil.which("torchrun") is None:
    pytest.skip("torchrun is not installed", allow_module_level=True)

import faultcases  # noqa: E402

pytestmark = pytest.mark.torch

MEASURED_S = {
    "gap": 20.0,
    "throttle": 21.0,
    "gc": 24.0,
    "data": 22.0,
    "input": 22.0,
    "slow": 22.0,
    "blocked": 22.0,
    "pipeline": 23.0,
    "warmup": 18.0,
    "healthy": 14.0,
}
"""Wall seconds of each case's run (torchrun start to the window settled in the store),
measured on this project's 2-core machine with both cores busy with other work (load
5-11); at load 3 they take 5-9 s."""
BASELINE_S = 20.0
"""The shared healthy baseline run, measured the same way: whichever DDP case comes first
pays for it."""


def _timeout(name: str) -> int:
    # Six times the loaded measurement plus a minute: start-up of torch and gloo, most of
    # each run, is what a busier machine stretches most.
    extra = BASELINE_S if faultcases.CASES[name].baseline is not None else 0.0
    return int(60 + 6 * (MEASURED_S[name] + extra))


TIMEOUT_S = {name: _timeout(name) for name in faultcases.CASES}


@pytest.fixture(scope="session")
def fault_hub(tmp_path_factory):
    with faultcases.local_hub(tmp_path_factory.mktemp("real-faults") / "record") as h:
        yield h


def _measure(hub, name):
    # Each torchrun may take most of the test's budget; two runs (baseline and fault) fit.
    return faultcases.measure(name, hub, timeout=TIMEOUT_S[name] / 2.5)


def _case_fixture(name):
    """A session fixture that runs case ``name`` once (with its baseline) into the hub."""

    @pytest.fixture(scope="session")
    def run(fault_hub):
        return _measure(fault_hub, name)

    return run


gap_case = _case_fixture("gap")
throttle_case = _case_fixture("throttle")
gc_case = _case_fixture("gc")
data_case = _case_fixture("data")
input_case = _case_fixture("input")
slow_case = _case_fixture("slow")
blocked_case = _case_fixture("blocked")
pipeline_case = _case_fixture("pipeline")
warmup_case = _case_fixture("warmup")
healthy_case = _case_fixture("healthy")


# -- what the windows hold ---------------------------------------------------------------
def _rank_step(w, values):
    return np.where(w.present, values, np.nan)


def _phase(w, *names):
    return _rank_step(w, sum(np.nan_to_num(w.phase_ns[n]) for n in names if n in w.phase_ns))


def _unaccounted(w):
    """(R, S) ns of each rank-step in no phase and no collective: host time nobody named."""
    phases = sum(np.nan_to_num(v) for v in w.phase_ns.values())
    return _rank_step(w, w.step_ns - phases - np.nan_to_num(w.coll["coll_ns"]))


def _cpu(w, name):
    """(R, S) training-thread CPU ns of one phase (NaN where the collector did not measure
    it)."""
    cpu = w.phase_cpu_ns.get(name)
    assert cpu is not None, f"no CPU time recorded for {name}"
    return _rank_step(w, np.where(cpu >= 0, cpu, np.nan))


def _cpu_share(w, name):
    """(R,) median over steps of the training thread's CPU time over wall time in a phase
    (NaN where the collector did not measure it)."""
    cpu = w.phase_cpu_ns.get(name)
    if cpu is None:
        return np.full(w.world_size, np.nan)
    return np.nanmedian(_rank_step(w, np.where(cpu >= 0, cpu, np.nan)) / w.phase_ns[name], axis=1)


def _straggler_in_data(w, trim=False, rank=None):
    """The rank the others waited for, from the collectives alone: ``(rank, wait, noise)``
    for the rank with the largest ``wait``, the others' arrival wait (median over them,
    mean over steps) less the rank's own, as a share of the step; ``noise`` is 1.645
    standard errors of that mean over the steps (a one-sided 95 % allowance). Net of its
    own wait: two ranks whose lead changes hands wait for each other about as much, and
    neither is a straggler (seen at load 3: rank 0 last in 11 of 20 steps, the other's
    median wait 6 % of the step, but rank 0 waited 16 % of its own steps' time for it in
    the other 9). By that cost, not by how often it came last: at load 6 rank 0 came last
    more often, yet rank 0 waited 3 % of the step longer for rank 1 than rank 1 for it.

    ``trim``: each rank's steps with the largest difference are left out of its mean and
    noise, as many as localisation leaves out of a suspect's gain (`localise._dropped`: a
    tenth of the steps, at least two), so that two isolated spikes, which the diagnosis is
    documented not to call a straggler, are not one here either. Seen on the busy machine
    in about one healthy run in seven: a rank the other waited 20 ms for in one step of
    15 ms ones and 8 ms in another, a few ms either way in the rest: 6.5 % beyond the
    noise untrimmed, 2.8 % trimmed; localisation found 0 % beyond chance and noise.
    ``rank``: read that rank, not the one with the largest wait."""
    if not _complete(w).any():
        return -1, 0.0, 0.0
    share = _wait_share(w)
    net = np.full(w.world_size, -np.inf)
    noise = np.zeros(w.world_size)
    for r in range(w.world_size):
        diff = np.nanmedian(share[_others(w, r)], axis=0) - share[r]
        diff = _set_aside(diff) if trim else diff[np.isfinite(diff)]
        net[r] = np.mean(diff) if diff.size else -np.inf
        if diff.size >= 3:
            noise[r] = 1.645 * np.std(diff, ddof=1) / np.sqrt(diff.size)
    if rank is None:
        rank = int(np.nanargmax(net))
    return rank, float(net[rank]), float(noise[rank])


def _waited_for_rank(w, rank):
    """What the others waited for ``rank``, not net of its own wait: per step the others'
    median arrival wait as a share of the step, mean over the steps left once the largest
    are set aside as in `_straggler_in_data`. Like for like between two runs: the cost a
    rank set in the baseline, whether or not another rank there cost as much (localisation
    nets a suspect's gain by its gain in the baseline the same way)."""
    if not _complete(w).any():
        return 0.0
    waited = _set_aside(np.nanmedian(_wait_share(w)[_others(w, rank)], axis=0))
    return float(np.mean(waited)) if waited.size else 0.0


def _wait_share(w):
    """(R, S) each rank-step's arrival wait as a share of its step."""
    return _rank_step(w, w.coll["exposed_wait_ns"]) / _rank_step(w, w.step_ns)


def _set_aside(values):
    """The finite per-step values, sorted, less the largest as many as localisation leaves
    out of a suspect's gain (`localise._dropped`)."""
    from rankscope.diagnosis.localise import _dropped

    kept = np.sort(values[np.isfinite(values)])
    return kept[: kept.size - _dropped(kept.size)]


def _starved(w, ranks):
    """Whether the window shows every one of ``ranks`` kept off its cores: its compute
    phases' CPU share at least `MIN_CPU_LOSS` + 0.1 below its peer's (`_cpu_loss`)."""
    from rankscope.diagnosis.hostside import MIN_CPU_LOSS

    loss = [_cpu_loss(w, r) for r in ranks]
    return bool(loss) and min(loss) >= MIN_CPU_LOSS + 0.1


def _assert_healthy_unless_a_rank_straggled(got):
    """A healthy job on a shared machine: other work may slow one rank for a whole run
    (seen here in about one run in four: one rank's forward at 0.4-0.5 CPU per wall
    second, the other's at 0.95), and that rank then truly sets the step. What the
    collectives show decides what is owed and what is allowed:

    - the others waited under 1 % of the step for anyone: the answer is healthy, or
      ``cpu_contention`` on ranks the window shows starved (a core taken from a rank
      is real whether or not the job paid for it; seen with the machine busy, each run
      diagnosed alone);
    - they waited over 6 % of it for one rank beyond the steps' noise (the mean wait less
      its one-sided 95 % allowance, both over the steps left once the largest are set
      aside as localisation does, `_straggler_in_data`) and beyond what the others waited
      for the same rank in the baseline run (`_waited_for_rank`, like for like; seen once
      in 40 runs here: the others waited 23 % of the step for rank 0, in the baseline
      20 %, when rank 1 cost as much there and nothing here, the step 1.09x the
      baseline's): a straggler (``cpu_contention`` or ``unexplained_straggler``) on it;
    - otherwise healthy, or a straggler on the rank the others waited for. That includes
      a rank the machine slowed in both runs: no regression against the baseline, and
      still a loss the job pays, which the diagnosis may name (never a catalogued fault
      that is not there, nor checkpoint for a warm-up). A mean wait over 6 % that the
      steps' noise could give (twenty steps, each a fifth of the step noisy on a busy
      machine) is no straggler the diagnosis owes.
    """
    d = _diagnose(got)
    top = d.verdict.top
    # A busy machine can slow a whole run against its baseline: a regression the steps
    # show, which no catalogued mechanism explains. Well past the verdict's threshold (1.5x)
    # it must read as unexplained (or as a rank the window shows starved, with the rest
    # unexplained), near it as unexplained or healthy; never a fault.
    ratio = _step_ratio(got)
    if ratio > 1.8:
        if top.mechanism == "cpu_contention":
            # The machine's own cause, where the window shows it: a rank kept off its
            # cores (seen: forward at 0.54 CPU per wall second against 1.00, 7 ms a step
            # more run-queue delay) accounting for part of a 1.9x regression; the rest must
            # still be named unexplained.
            loss = [round(_cpu_loss(d.window, r), 2) for r in top.ranks]
            assert _starved(d.window, top.ranks), (ratio, loss, _top3(d))
            assert d.verdict.get("unexplained_straggler").score >= 0.5, (ratio, _top3(d))
        else:
            assert top.mechanism == "unexplained_straggler", (ratio, _top3(d))
        return d
    if ratio > 1.35 and top.mechanism == "unexplained_straggler":
        return d
    # Over the steps the diagnosis read (warm-up set aside).
    rank, wait, noise = _straggler_in_data(d.window)
    _, cut, cut_noise = _straggler_in_data(d.window, trim=True, rank=rank)
    net = cut
    if got.baseline is not None and cut > 0:
        grew = _waited_for_rank(d.window, rank) - _waited_for_rank(got.baseline, rank)
        net = max(0.0, min(cut, grew))
    why = (rank, wait, noise, cut, cut_noise, net, _top3(d))
    if wait < 0.01:
        if top.mechanism == "cpu_contention":
            from rankscope.diagnosis.hostside import MIN_CPU_LOSS

            loss = [round(_cpu_loss(d.window, r), 2) for r in top.ranks]
            assert min(loss) >= MIN_CPU_LOSS + 0.1, (*why, loss)
        else:
            assert top.mechanism == "healthy", why
    elif min(net, cut - cut_noise) > 0.06:
        assert top.mechanism in STRAGGLERS, why
        assert rank in top.ranks, why
    else:
        assert top.mechanism in ("healthy", *STRAGGLERS), why
        if top.mechanism != "healthy" and wait > 0.06:
            assert rank in top.ranks, why
    return d


STRAGGLERS = ("cpu_contention", "unexplained_straggler")


def _step_ratio(got):
    """The run's median step over its baseline's (NaN without one), each the median over
    steps of the slowest rank's step: what the job waited for."""
    if got.baseline is None:
        return float("nan")

    def step(w):
        return float(np.nanmedian(np.nanmax(_rank_step(w, w.step_ns), axis=0)))

    return step(got.window) / step(got.baseline)


def _waited_for(w):
    """(R,) what the job waited for each rank, from the collectives alone: per step, the
    others' arrival wait (median over them) less the rank's own, where positive, as a
    mean over steps and a share of the median step. A rank slowed by the machine for the
    whole run and a rank with a pause every few steps are both read, whichever costs more."""
    wait = _rank_step(w, w.coll["exposed_wait_ns"])
    step = float(np.nanmedian(_rank_step(w, w.step_ns)))
    out = np.zeros(w.world_size)
    for r in range(w.world_size):
        others = np.nanmedian(wait[_others(w, r)], axis=0)
        out[r] = np.nanmean(np.clip(np.nan_to_num(others - wait[r]), 0.0, None)) / step
    return out


def _med(a, axis=1):
    return np.nanmedian(a, axis=axis)


def _complete(w):
    inst = w.instances
    return (inst.n_arrived >= inst.n_members) & (inst.n_members >= 2)


MS = 1e6


def _others(w, rank):
    return [r for r in range(w.world_size) if r != rank]


def _diagnose(got):
    from rankscope.diagnosis.engine import diagnose

    return diagnose(got.window, got.baseline)


def _top3(d):
    return [(h.mechanism, round(h.score, 2), tuple(h.ranks)) for h in d.verdict.hypotheses[:3]]


def _assert_verdict(got):
    """The verdict names the case's mechanism (or an equally right one) on its rank.

    Unless the machine also kept that rank off the cores (its compute phases at a CPU
    share well below its peer's, `_cpu_loss`; seen in CI's loaded pass for the GC rank,
    its forward at 0.44 CPU per wall second against 0.89): two real causes on one rank,
    either may lead by what it costs, so ``cpu_contention`` on the rank may lead while
    the case's mechanism is still named on it with a score of at least 0.5; so may
    ``cpu_contention`` on another rank the window shows starved as much (the machine's
    fault, not the case's, and real all the same). Likewise the
    open world's remainder: where the rank's lead is materially more than the mechanism
    covers (the GC rank, also slower between its pauses in some runs: host_gap +7-12 ms a
    step beside 15-19 % of the step in pauses), ``unexplained_straggler`` on the rank may
    lead by the part left over, and the case's mechanism must still be named on it."""
    from rankscope.diagnosis.hostside import MIN_CPU_LOSS
    from rankscope.diagnosis.localise import MATERIAL

    d = _diagnose(got)
    truth = got.truth
    top = d.verdict.top
    right = (truth["mechanism"], *truth.get("alternatives", ()))
    ranks = tuple(truth["ranks"][:1])
    loss = _cpu_loss(got.window, ranks[0]) if ranks else 0.0
    # The rank cpu_contention leads on, if it leads, and how short of CPU the window shows
    # it: the case's rank, or another that the machine starved as much (seen with both
    # cores busy and two jobs at once: the GC case's other rank at 0.31 CPU per wall second
    # in its forward against 0.74, setting steps of its own).
    on = top.ranks[0] if top.mechanism == "cpu_contention" and top.ranks else None
    on_loss = _cpu_loss(got.window, on) if on is not None else 0.0
    why = (round(loss, 2), on, round(on_loss, 2), _top3(d))
    named = [h for h in d.verdict.hypotheses if h.mechanism in right and h.score >= 0.5]
    starved = on is not None and on_loss >= MIN_CPU_LOSS + 0.1
    left_over = top.mechanism == "unexplained_straggler" and top.impact >= MATERIAL
    if ranks and (starved or left_over):
        assert any(h.ranks[:1] == ranks for h in named), why
    else:
        assert top.mechanism in right, why
    if ranks:
        assert top.mechanism != "healthy", why
        if not starved or on == ranks[0]:
            assert tuple(top.ranks[:1]) == ranks, why
    return d


def _assert_localised(got, kind="rank", established=True):
    """The localisation's suspect is the faulty rank (or stage), with a material gain.

    ``established=False`` for a fault that recurs in a few steps only (five GC pauses in
    twenty steps): on a busy machine the steps' noise may leave such a gain short of what
    the localisation alone establishes (its net gain less `Suspect.noise`), while the
    mechanism's own evidence names it; the estimate beyond chance must still be material.

    Unless the machine slowed another rank for the whole run as much: when the
    collectives show the job waiting for a second rank at least `RIVAL` times as long as
    for the faulty one, either may be the suspect, and the faulty rank must still be
    among the suspects with a material gain of its own."""
    from rankscope.diagnosis import localise

    loc = _diagnose(got).localisation
    top = loc.top
    truth = got.truth
    assert top is not None, loc
    if kind == "rank":
        cost = _waited_for(got.window)
        fault = truth["ranks"][0]
        rival = max(cost[o] for o in _others(got.window, fault))
        if rival >= RIVAL * cost[fault] and not set(truth["ranks"]) <= set(top.ranks):
            mine = loc.of("rank", str(fault))
            assert mine is not None and mine.gain >= localise.MATERIAL, (cost, loc.suspects)
            return mine
    assert set(truth["ranks"]) <= set(top.ranks), top
    if kind == "stage":
        assert top.kind in ("stage", "rank"), top
    # The faulty rank leads; its margin over chance (with two ranks, the other rank's gain)
    # is immaterial only where the other rank cost nearly as much in the same re-timing
    # (CI's loaded pass: the GC rank's gain 0.277 of the step, 0.018 beyond the rank the
    # machine slowed): then its own gain must be material.
    others = [s for s in loc.suspects if s.kind == top.kind and s.key != top.key]
    rival = max((s.gain for s in others), default=0.0)
    net = top.net_gain if established else top.net_gain + top.noise
    if rival >= RIVAL * top.gain:
        assert top.gain >= localise.MATERIAL, top
    else:
        assert net >= localise.MATERIAL, top
    return top


RIVAL = 0.65
"""A rival the job waited for at least this share as long as for the faulty rank (by the
collectives' waits, `_waited_for`) may be the localisation's top suspect. The two
measures differ: the localisation re-times each rank's busy time, and the ratio of the
rival's gain to the faulty rank's ran up to 1.3x the ratio of their waits in eight loaded
GC runs (0.61 against 0.47); CI's loaded pass once saw the two ranks' gains tied (0.231
against 0.226, the GC rank second) where the waits put the rival under 0.8."""


# -- (a) host time outside every phase ------------------------------------------------------
@pytest.mark.timeout(TIMEOUT_S["gap"])
def test_gap_rank_spends_its_extra_time_outside_every_phase(gap_case):
    w, base = gap_case.window, gap_case.baseline
    r = gap_case.case.ranks[0]
    un = _med(_unaccounted(w))
    # 25 ms asleep each step, in no phase and no collective, on rank r only ...
    assert un[r] > 15 * MS, un / MS
    assert all(un[o] < un[r] - 15 * MS for o in _others(w, r)), un / MS
    assert un[r] > _med(_unaccounted(base))[r] + 15 * MS
    # ... while the others wait for it in the gradient all-reduce, where it comes last. How
    # long is the gap less what the machine slowed them by before the all-reduce (11.6 ms
    # of the 25 seen in a loaded pass: two spinners and another worker's torch job on two
    # cores), so it is held to a third of the gap, and to several times the rank's own.
    wait = _med(_rank_step(w, w.coll["wait_ns"]))
    assert all(wait[o] > 8 * MS and wait[o] > 4 * wait[r] for o in _others(w, r)), wait / MS
    last = w.instances.last_rank[_complete(w)]
    assert np.mean(last == r) > 0.8


@pytest.mark.timeout(TIMEOUT_S["gap"])
def test_gap_verdict_names_the_rank_never_healthy(gap_case):
    _assert_verdict(gap_case)


@pytest.mark.timeout(TIMEOUT_S["gap"])
def test_gap_localised_to_the_rank(gap_case):
    top = _assert_localised(gap_case)
    # What-if: fixing it gives back most of what the job waited for it, read from the
    # collectives alone (0.93-0.98 of it seen, quiet and at load 4; 0.67 in a pass with two
    # spinners and another worker's torch job, where re-timing the rank to a peer the
    # machine also slowed gives back less); not a fixed share of the 25 ms: where the
    # machine slows the other rank, the job waits for the gap rank less. The rank is
    # re-timed to its peer, not to the mean of the two.
    w = _diagnose(gap_case).window
    r = gap_case.case.ranks[0]
    waited_ns = _waited_for(w)[r] * float(np.nanmedian(_rank_step(w, w.step_ns)))
    assert waited_ns > 5 * MS, (waited_ns / MS, top)
    assert top.gain_ns > 0.6 * waited_ns, (waited_ns / MS, top)


# -- (b) a CPU-throttled rank -------------------------------------------------------------
@pytest.mark.timeout(TIMEOUT_S["throttle"])
def test_throttled_rank_phases_take_longer(throttle_case):
    w, base = throttle_case.window, throttle_case.baseline
    r = throttle_case.case.ranks[0]
    fault = throttle_case.fault
    assert fault["method"] in ("cgroup-v2", "cgroup-v1", "shared-core"), fault
    fwd = _med(_phase(w, "forward"))
    # The same forward pass, several times longer in wall time on the throttled rank
    # (backward is not compared: the others' includes waiting for it in DDP's buckets).
    assert all(fwd[r] > 1.8 * fwd[o] for o in _others(w, r)), fwd / MS
    # For the same CPU: the training thread ran for a fraction of the pass's wall time.
    share = _cpu_share(w, "forward")
    assert share[r] < 0.6 and share[r] < 0.7 * np.nanmax(share[_others(w, r)]), share
    # ... because of the throttle, not because the rank is slow anyway. Under a quota the
    # kernel says so itself: most periods of the run were throttled, and the thread ran at
    # no more than the quota's share of a core (0.22-0.24 of its forward's wall time seen,
    # quiet and loaded; the bound leaves room for a pass that begins on a fresh period's
    # budget). Neither can a busy machine fake: it lowers a share and throttles nothing.
    # A comparison with the baseline run cannot promise as much: CI's loaded pass has
    # starved the baseline's same rank to 1.84x and 2.6x its peer's forward in two runs.
    if fault["method"].startswith("cgroup"):
        assert fault["nr_throttled"] > 0.3 * fault["nr_periods"] > 0, fault
        assert share[r] < 1.4 * faultcases.THROTTLE_QUOTA, (share, fault)
    else:
        # A shared busy core throttles nothing the kernel counts: the rank's lead over its
        # peers is compared with its lead in the baseline, as ratios within each run.
        fwd_base = _med(_phase(base, "forward"))
        lead = fwd[r] / np.nanmax(fwd[_others(w, r)])
        lead_base = fwd_base[r] / np.nanmax(fwd_base[_others(base, r)])
        assert lead > 1.5 * lead_base, (fwd / MS, fwd_base / MS)
    last = w.instances.last_rank[_complete(w)]
    assert np.mean(last == r) > 0.6


@pytest.mark.timeout(TIMEOUT_S["throttle"])
def test_throttle_verdict_is_cpu_contention_on_the_rank(throttle_case):
    from rankscope.diagnosis.hostside import MIN_CPU_LOSS

    w, r = throttle_case.window, throttle_case.case.ranks[0]
    share = _cpu_share(w, "forward")
    loss = 1.0 - share[r] / np.nanmedian(share[_others(w, r)])
    if loss >= MIN_CPU_LOSS + 0.1:
        _assert_verdict(throttle_case)
        return
    # The machine starved the other rank nearly as much (seen with two xdist workers and
    # two spinners on two cores: the CPU shares' contrast is what cpu_contention reads):
    # the rank must still be named, as cpu_contention or as an unexplained straggler.
    d = _diagnose(throttle_case)
    top = d.verdict.top
    assert top.mechanism in ("cpu_contention", "unexplained_straggler"), (loss, _top3(d))
    assert top.ranks[:1] == (r,), (loss, _top3(d))


@pytest.mark.timeout(TIMEOUT_S["throttle"])
def test_throttle_localised_to_the_rank(throttle_case):
    _assert_localised(throttle_case)


# -- (c) garbage-collection pauses --------------------------------------------------------
def _gc_steps(got):
    every = int(next(f for f in got.case.flags if f.startswith("--gc-every=")).split("=")[1])
    return got.window.steps % every == every - 1


@pytest.mark.timeout(TIMEOUT_S["gc"])
def test_gc_rank_pauses_every_few_steps(gc_case):
    w = gc_case.window
    r = gc_case.case.ranks[0]
    on = _gc_steps(gc_case)
    assert on.sum() >= 4
    un = _unaccounted(w)[r]
    # Each collection walks 800k live lists: tens of ms outside every phase, in the
    # collecting steps only.
    excess = np.nanmedian(un[on]) - np.nanmedian(un[~on])
    assert excess > 15 * MS, (un[on] / MS, un[~on] / MS)
    worst = np.argsort(np.nan_to_num(un, nan=-np.inf))[-int(on.sum()) :]
    assert on[worst].sum() >= on.sum() - 1, (w.steps[worst], w.steps[on])
    # The collector's GC callbacks saw the pauses, on that rank and in those steps.
    gc_ns = _rank_step(w, w.host["gc_ns"])
    assert np.nanmin(gc_ns[r, on]) > 10 * MS, gc_ns[r] / MS
    assert np.nanmax(gc_ns[r, ~on]) < 0.5 * np.nanmin(gc_ns[r, on]), gc_ns[r] / MS
    assert np.nanmax(gc_ns[_others(w, r)]) < 5 * MS, gc_ns / MS
    # The other rank waits for it in those steps.
    for o in _others(w, r):
        wait = _rank_step(w, w.coll["wait_ns"])[o]
        assert np.nanmedian(wait[on]) - np.nanmedian(wait[~on]) > 15 * MS


@pytest.mark.timeout(TIMEOUT_S["gc"])
def test_gc_verdict_is_host_pause_on_the_rank(gc_case):
    _assert_verdict(gc_case)


def _cpu_loss(w, rank):
    """The largest share by which ``rank``'s compute phases ran on the CPU less than its
    peers' median, phase by phase (forward, backward), from the window alone."""
    out = 0.0
    for name in ("forward", "backward"):
        share = _cpu_share(w, name)
        peers = np.nanmedian(share[_others(w, rank)])
        if np.isfinite(share[rank]) and peers > 0:
            out = max(out, 1.0 - share[rank] / peers)
    return out


@pytest.mark.timeout(TIMEOUT_S["gc"])
def test_gc_localised_to_the_rank(gc_case):
    _assert_localised(gc_case, established=False)


# -- (d) an unbalanced two-stage pipeline --------------------------------------------------
# The pipeline and warm-up cases run in the slow tier (~21 s of torchruns in a busy default
# suite); the default tier keeps the gap, CPU-quota, GC and healthy cases.
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S["pipeline"])
def test_pipeline_heavy_stage_computes_and_the_other_waits(pipeline_case):
    w = pipeline_case.window
    heavy = pipeline_case.case.ranks[0]
    light = 1 - heavy
    assert w.ranks.mesh["pp"].tolist() == [0, 1]
    # Six layers against one (the light stage also holds the output head and the loss):
    # in CPU time the heavy stage does several times the light one's work whatever the
    # load (wall time is not: at load 3 a slowed light stage was seen at 14 ms of compute
    # against 35). The ratio narrows on a contended machine (2.7x seen at load 5 with two
    # torch jobs and two spinners on two cores); a balanced split is below 1x.
    cpu = _med(sum(_cpu(w, n) for n in ("forward", "backward")))
    assert cpu[heavy] > 2 * cpu[light], cpu / MS
    pp_wait = _med(_phase(w, "pp_wait"))
    step = _med(_rank_step(w, w.step_ns))
    # (Not by a fixed factor: where other work on the machine slows the light stage, the
    # heavy one waits for it too; 24 against 42 ms was seen at load 8.)
    assert pp_wait[light] > 1.3 * pp_wait[heavy], pp_wait / MS
    assert pp_wait[light] > 0.3 * step[light], (pp_wait / MS, step / MS)
    # The activations and gradients went through send/recv, which the collector saw.
    assert np.all(_med(_rank_step(w, w.coll["n"])) >= _microbatches(w))


def _microbatches(w):
    cfg = w.manifest.get("job_config") or {}
    return int(cfg.get("microbatches", 1))


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S["pipeline"])
def test_pipeline_verdict_names_the_heavy_stage(pipeline_case):
    from rankscope.commands.eval_scoring import localise

    d = _assert_verdict(pipeline_case)
    assert localise(d, pipeline_case.truth)["stage"] is True, _top3(d)


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S["pipeline"])
def test_pipeline_localised_to_the_heavy_stage(pipeline_case):
    _assert_localised(pipeline_case, kind="stage")


# -- (f) a rank that reads a heavier data shard (slow tier, with the pipeline) ------------
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S["data"])
def test_heavy_shard_rank_does_more_work(data_case):
    w = data_case.window
    r = data_case.case.ranks[0]
    tokens = _med(_rank_step(w, w.work["tokens"]))
    # Twice the samples, as the collector counted them ...
    assert tokens[r] == pytest.approx(2 * tokens[1 - r], rel=0.01), tokens
    # ... and more CPU time in forward and backward for them, whatever the load.
    cpu = _med(sum(_cpu(w, n) for n in ("forward", "backward")))
    assert cpu[r] > 1.3 * cpu[1 - r], cpu / MS


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S["data"])
def test_heavy_shard_verdict_names_the_rank_and_its_shard(data_case):
    d = _assert_verdict(data_case)
    di = d.verdict.get("data_imbalance")
    assert di.ranks[:1] == (1,), _top3(d)
    assert any("rank 1 (shard 1) had 2.0" in e for e in di.evidence), di.evidence


# -- (g) a rank whose data loader is slow (slow tier) ----------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S["input"])
def test_slow_loader_rank_waits_in_input(input_case):
    w = input_case.window
    r = input_case.case.ranks[0]
    inp = _med(_phase(w, "input"))
    # The loader's 20 ms a batch, timed inside its next() (a busy machine only adds).
    assert inp[r] > 18 * MS and inp[r] > 5 * inp[1 - r], inp / MS


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S["input"])
def test_slow_loader_verdict_names_the_rank(input_case):
    _assert_verdict(input_case)


# -- (h) a rank whose forward pass is slower: computing, or blocked (slow tier) ------------
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S["slow"])
def test_slower_rank_computes_longer(slow_case):
    fwd = _med(_phase(slow_case.window, "forward"))
    # 15 ms of matmuls more a step, spun for wall time: rank 1's forward holds at least that
    # whatever the machine, and stands well apart from rank 0's. Not by a fixed 12 ms: the
    # machine may stretch rank 0's own forward more than rank 1's (6.9 against 18.2 ms, with
    # four other busy processes on the two cores).
    assert fwd[1] > 15 * MS and fwd[1] > 2 * fwd[0], fwd / MS


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S["slow"])
def test_slower_rank_verdict_names_it(slow_case):
    _assert_verdict(slow_case)


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S["blocked"])
def test_blocked_rank_waits_in_forward_without_running(blocked_case):
    w = blocked_case.window
    fwd = _med(_phase(w, "forward"))
    cpu = _med(_cpu(w, "forward"))
    # 15 ms asleep a step inside the forward: wall time, not CPU time.
    assert fwd[1] - fwd[0] > 12 * MS, fwd / MS
    assert cpu[1] - cpu[0] < 0.5 * (fwd[1] - fwd[0]), (cpu / MS, fwd / MS)
    assert np.isfinite(w.host["runq_ns"]).all(), "the collector read no run-queue delay"


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S["blocked"])
def test_blocked_rank_is_not_called_starved_beyond_its_run_queue(blocked_case):
    d = _assert_verdict(blocked_case)
    # What cpu_contention claims is at most what the kernel saw rank 1 wait for a core
    # beyond rank 0 (a busy machine queues a rank that wakes more often a little longer).
    w = d.window
    queued = np.nanmedian(np.clip(w.host["runq_ns"][1] - w.host["runq_ns"][0], 0, None))
    share = queued / np.nanmedian(_rank_step(w, w.step_ns))
    cc = d.verdict.get("cpu_contention")
    if 1 in cc.ranks:
        assert cc.impact <= share + 0.02, (cc.impact, share, _top3(d))


# -- (e) a healthy job with a slow warm-up --------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S["warmup"])
def test_warmup_steps_are_slower_on_every_rank(warmup_case):
    w = warmup_case.window
    k = warmup_case.truth["warmup_steps"]
    assert w.steps[0] == 0 and w.steps.shape[0] == warmup_case.case.steps
    fwd = _phase(w, "forward")
    # The job adds 100 ms of forward compute to each warm-up step: on a busy machine that
    # work only stretches, while the rest of the forward also stretches (12 ms medians were
    # seen at load 4, against ~4 ms on a quiet machine), so the test holds the excess to
    # most of what was added rather than holding the two to a fixed ratio.
    added_ns = 100 * MS
    for r in range(w.world_size):
        excess = np.nanmedian(fwd[r, :k]) - np.nanmedian(fwd[r, k:])
        assert excess > 0.8 * added_ns, fwd[r] / MS
    step = np.nanmax(_rank_step(w, w.step_ns), axis=0)
    # Several times slower (how many depends on how busy the machine keeps the rest).
    assert np.median(step[:k]) > 2 * np.median(step[k:]), step / MS


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S["warmup"])
def test_warmup_is_set_aside_and_the_verdict_is_healthy(warmup_case):
    d = _assert_healthy_unless_a_rank_straggled(warmup_case)
    assert abs(d.warmup_steps - warmup_case.truth["warmup_steps"]) <= 1, d.warmup
    assert d.verdict.top.mechanism != "checkpoint"


# -- the healthy job against another run of itself -----------------------------------------
@pytest.mark.timeout(TIMEOUT_S["healthy"])
def test_healthy_runs_have_no_rank_apart(healthy_case):
    for w in (healthy_case.window, healthy_case.baseline):
        assert w.present.all()
        # No rank spends time outside its phases (how fast each computes is up to the
        # machine: other work can slow one rank's forward threefold, even at its full
        # share of CPU time, and then it truly straggles; the verdict test reads that).
        un = _med(_unaccounted(w))
        assert np.all(un < 10 * MS), un / MS


@pytest.mark.timeout(TIMEOUT_S["healthy"])
def test_healthy_verdict_is_healthy(healthy_case):
    _assert_healthy_unless_a_rank_straggled(healthy_case)
    # Each run alone too: with two ranks and twenty steps, one of them leads by chance, and
    # without a baseline only the steps' noise tells that lead from a straggler.
    for w in (healthy_case.window, healthy_case.baseline):
        _assert_healthy_unless_a_rank_straggled(
            dataclasses.replace(healthy_case, window=w, baseline=None)
        )


# -- the interface rankscope eval --real uses ---------------------------------------------
@pytest.mark.timeout(TIMEOUT_S["gap"])
def test_run_case_reads_back_what_the_hub_holds(fault_hub, gap_case):
    window, baseline, truth = faultcases.run_case("gap", fault_hub)
    assert truth == {
        "mechanism": "unexplained_straggler",
        "ranks": (1,),
        "alternatives": ("host_pause",),
    }
    # Read back from the store, not rerun: the same steps of the same runs.
    assert window.run == gap_case.window.run and baseline.run == gap_case.baseline.run
    assert np.array_equal(window.t_end, gap_case.window.t_end, equal_nan=True)
