"""Ranks that said hello and completed no step: never called healthy, named first."""

from __future__ import annotations

import numpy as np
import pytest

from rankscope.collector import schema
from rankscope.diagnosis import diagnose
from rankscope.diagnosis.coverage import unreported
from rankscope.hub.intake import Intake
from rankscope.hub.store import Store
from rankscope.sim import load_scenario
from rankscope.sim.emit import iter_messages

T0 = 1_700_000_000_000_000_000


def _sim(name: str, seed: int, steps: int = 16) -> list[tuple[int, bytes]]:
    """The messages of a seeded 32-rank simulated run (hosts of 8), as sent, with the rank
    that sends each."""
    scenario = load_scenario(name, ranks=32, topology__gpus_per_host=8, seed=seed)
    msgs = iter_messages(scenario, steps, run_id="r", t0_ns=T0)
    return [(int(schema.decode(d).header["rank"]), d) for d in msgs]


@pytest.fixture(scope="module")
def healthy_messages() -> list[tuple[int, bytes]]:
    return _sim("healthy", 3, steps=12)


def _window(msgs: list[tuple[int, bytes]], silent: set[int], kinds: set[str], from_step: int = 0):  # type: ignore[no-untyped-def]
    """The run's window with the messages of ``kinds`` of the ``silent`` ranks left out
    (steps messages from ``from_step`` on)."""

    def keep(r: int, d: bytes) -> bool:
        if r not in silent:
            return True
        m = schema.decode(d)
        if m.kind != "steps":
            return m.kind not in kinds
        return "steps" not in kinds or int(m.tables["steps"]["step"].min()) < from_step

    kept = [d for r, d in msgs if keep(r, d)]
    store = Store(history_steps=64, raw_steps=16)
    Intake(store).feed_many(kept, 0)
    store.settle()
    return store.window("r")


def test_a_run_whose_every_rank_reports_is_still_healthy(healthy_messages) -> None:  # type: ignore[no-untyped-def]
    w = _window(healthy_messages, set(), set())
    assert unreported(w).ranks.shape[0] == 0
    assert diagnose(w).verdict.top.mechanism == "healthy"


@pytest.mark.parametrize("silent", [{5}, set(range(16))], ids=["one rank", "half the job"])
def test_ranks_that_said_hello_and_sent_no_step_are_named_not_called_healthy(
    healthy_messages, silent: set[int]
) -> None:  # type: ignore[no-untyped-def]
    # Their collectors stopped after the hello (or their steps were refused): the others'
    # timings alone look healthy, but nothing can be said of these ranks.
    w = _window(healthy_messages, silent, {"steps"})
    assert sorted(unreported(w).ranks.tolist()) == sorted(silent)
    v = diagnose(w).verdict
    top = v.top
    assert top.mechanism == "unexplained_straggler" and top.score == 1.0
    assert set(top.ranks) == silent
    assert "completed no step in this window" in top.evidence[0]
    assert (
        f": {len(silent)} of the 32 that said hello, while {32 - len(silent)} went on"
        in (top.evidence[0])
    )
    healthy = v.get("healthy")
    assert healthy.score == 0.0
    assert any("completed no step in this window" in c for c in healthy.caveats)


def test_a_rank_that_stopped_reporting_mid_window_is_named_and_one_a_step_behind_is_not(
    healthy_messages,
) -> None:  # type: ignore[no-untyped-def]
    # Steps of ~0.8 s: rank 5's last step is 3, nine steps (~7 s) before the others'
    # latest, past a stall's threshold (5 median steps and 6 s): its collector stopped.
    w = _window(healthy_messages, {5}, {"steps"}, from_step=3)
    gone = unreported(w)
    assert gone.ranks.tolist() == [5] and not gone.never[0] and gone.last_step[0] == 2
    assert gone.behind_s[0] > 6.0
    top = diagnose(w).verdict.top
    assert top.mechanism == "unexplained_straggler" and top.ranks == (5,)
    assert "rank(s) 5 stopped reporting (last step 2" in top.evidence[0]
    # Two steps behind (~1.6 s) is how a collector's flush can lag: not named.
    w = _window(healthy_messages, {5}, {"steps"}, from_step=10)
    assert unreported(w).ranks.shape[0] == 0


def test_ranks_that_never_said_hello_are_not_silent(healthy_messages) -> None:  # type: ignore[no-untyped-def]
    # A recording of chosen ranks (a relay's raw ring, a reduced-scope rerun) holds the
    # hellos of those ranks only: the others of the world are not expected to report.
    w = _window(healthy_messages, {30, 31}, {"hello", "steps", "groups", "samples", "stats"})
    assert unreported(w).ranks.shape[0] == 0


def test_a_window_without_any_complete_step_has_no_silent_ranks() -> None:
    from rankscope.diagnosis.synthetic import make_window

    t = np.zeros((4, 3))
    w = make_window(t, t + 1.0, present=np.zeros((4, 3), bool))
    assert not w.has_complete_step() and unreported(w).ranks.shape[0] == 0


def _without_colls_of(msgs: list[tuple[int, bytes]], rank: int) -> list[tuple[int, bytes]]:
    """The stream with ``rank``'s collective rows gone (a collector timing none)."""
    out = []
    for r, d in msgs:
        m = schema.decode(d)
        if r == rank and m.kind == "steps":
            h = {k: m.header[k] for k in ("job", "run", "rank", "inc", "batch")}
            t = m.tables
            d = schema.steps_message(
                h, t["steps"], t.get("phases"), None, m.header.get("phase_names")
            )
        out.append((r, d))
    return out


def _diagnosed(msgs: list[tuple[int, bytes]]):  # type: ignore[no-untyped-def]
    store = Store(history_steps=64, raw_steps=16)
    Intake(store).feed_many([d for _, d in msgs], 0)
    store.settle()
    return diagnose(store.window("r"))


@pytest.mark.parametrize("seed", [3, 4])
def test_a_rank_that_times_no_collective_is_named_and_leaves_the_verdict_alone(seed) -> None:  # type: ignore[no-untyped-def]
    # Rank 5 reports its steps but not one collective: every instance of its groups stays
    # incomplete. Its peers' time in them was read as compute (a false data_imbalance or
    # straggler at score 1), and its own collective time as compute too.
    healthy = _sim("healthy", seed)
    v = _diagnosed(_without_colls_of(healthy, 5)).verdict
    assert v.top.mechanism == "unexplained_straggler" and v.top.ranks == (5,)
    assert "recorded no collective call while members of their groups did" in v.top.evidence[0]
    assert v.top.impact == 0.0
    assert all(h.score < 0.5 for h in v.hypotheses if h.mechanism != "unexplained_straggler")
    # The slow device is still found, on the same rank and at the same cost, rank 5 named
    # beside it.
    slow = _sim("slow-device", seed)
    want = _diagnosed(slow).verdict.top
    got = _diagnosed(_without_colls_of(slow, 5)).verdict
    assert want.mechanism == "slow_device"
    assert got.top.mechanism == "slow_device" and got.top.ranks == want.ranks
    assert got.top.impact == pytest.approx(want.impact, abs=0.01)
    assert got.get("unexplained_straggler").ranks[0] == 5


def _shifted(msgs: list[tuple[int, bytes]], ranks: range, ns: int) -> list[tuple[int, bytes]]:
    """The stream with every time of ``ranks``' steps messages moved by ``ns``: a host whose
    clock is off and was not aligned."""
    out = []
    for r, d in msgs:
        m = schema.decode(d)
        if r in ranks and m.kind == "steps":
            h = {k: m.header[k] for k in ("job", "run", "rank", "inc", "batch")}
            t = {name: {c: np.array(v) for c, v in tab.items()} for name, tab in m.tables.items()}
            for name, cols in (
                ("steps", ("t_start", "t_end")),
                ("phases", ("t0", "t1")),
                ("colls", ("t_enter", "t_start", "t_end", "t_exit")),
            ):
                for c in cols:
                    a = t[name][c]
                    a[a != schema.NO_TIME] += ns
            d = schema.steps_message(
                h, t["steps"], t["phases"], t["colls"], m.header.get("phase_names")
            )
        out.append((r, d))
    return out


@pytest.mark.parametrize("seed", [3, 4])
def test_a_host_on_a_clock_of_its_own_is_named_not_called_healthy(seed) -> None:  # type: ignore[no-untyped-def]
    # Host 1's clock runs 12 ms ahead, unaligned. Its ranks seem to arrive late everywhere;
    # uncorrected, a real slow device elsewhere was called healthy (seed 4, score 0.94).
    from rankscope.diagnosis.clockskew import clock_skew

    healthy = _sim("healthy", seed)
    assert clock_skew(_window(healthy, set(), set())).ranks.shape[0] == 0
    for name in ("healthy", "slow-device"):
        msgs = _shifted(_sim(name, seed), range(8, 16), 12_000_000)
        store = Store(history_steps=64, raw_steps=16)
        Intake(store).feed_many([d for _, d in msgs], 0)
        store.settle()
        w = store.window("r")
        skew = clock_skew(w)
        assert skew.ranks.tolist() == list(range(8, 16))
        assert np.allclose(skew.offset_ns, 12e6, atol=0.1e6)
        v = diagnose(w).verdict
        assert v.top.mechanism != "healthy" and v.get("healthy").score == 0.0
        named = v.get("unexplained_straggler")
        assert named.score == 1.0 and set(range(8, 16)) <= set(named.ranks)
        assert any("their clock is off by about that" in e for e in named.evidence)


def test_a_rank_that_notices_completions_late_by_varying_amounts_keeps_its_clock() -> None:
    # Starved of a core, a rank leaves collectives late by a few ms, differently each time:
    # its clock is not off (an offset is a constant), so nothing is said of it.
    from rankscope.diagnosis.clockskew import clock_skew

    rng = np.random.default_rng(7)
    out = []
    for r, d in _sim("healthy", 3):
        m = schema.decode(d)
        if r == 9 and m.kind == "steps":
            h = {k: m.header[k] for k in ("job", "run", "rank", "inc", "batch")}
            co = {c: np.array(v) for c, v in m.tables["colls"].items()}
            co["t_exit"] += rng.exponential(5e6, co["t_exit"].shape[0]).astype(np.int64)
            t = m.tables
            d = schema.steps_message(h, t["steps"], t["phases"], co, m.header.get("phase_names"))
        out.append((r, d))
    store = Store(history_steps=64, raw_steps=16)
    Intake(store).feed_many([d for _, d in out], 0)
    store.settle()
    assert clock_skew(store.window("r")).ranks.shape[0] == 0


def test_one_rank_with_absurd_times_does_not_make_the_others_stop(healthy_messages) -> None:  # type: ignore[no-untyped-def]
    # A recording takes any time (no window around a hub's clock): rank 3's steps end ten
    # days ahead. Measured from the latest end, every other rank would read as stopped;
    # a rank stops only when half of the others went on without it.
    msgs = _shifted(healthy_messages, range(3, 4), 10 * 86_400 * 10**9)
    w = _window(msgs, set(), set())
    assert unreported(w).ranks.shape[0] == 0
