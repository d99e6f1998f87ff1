"""Validation over time: an experiment states the recurrence interval its after-run must
cover, and the evaluation compares step-time distributions (p50, p99, max, tail stalls),
flagging "mean better, tails worse" and calling a too-short after-run too short."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rankscope.cli import main
from rankscope.commands.demo import start_demo
from rankscope.diagnosis.baseline import distribution
from rankscope.launch.experiments import (
    COVER_INTERVALS,
    TAIL_P99_TOLERANCE,
    interval_coverage,
    load_experiment,
    record_experiment,
    tail_change,
)
from rankscope.sim import load_scenario

MS = 1e6


def _series(p50_ms: float, n: int, stalls: int, stall_ms: float) -> list[float]:
    # n steps around p50 with `stalls` of them at stall_ms.
    base = [p50_ms * MS * (1 + 0.001 * (i % 5)) for i in range(n - stalls)]
    return base + [stall_ms * MS] * stalls


# -- the tail rule -------------------------------------------------------------------------


def test_a_p99_within_tolerance_is_not_worse_beyond_it_is() -> None:
    import numpy as np

    before = distribution(np.array(_series(100, 50, 1, 300)))
    slightly = distribution(np.array(_series(95, 50, 1, 300 * 1.04)), reference_p50=before.p50)
    much = distribution(np.array(_series(90, 50, 1, 300 * 1.5)), reference_p50=before.p50)
    small = tail_change(before, slightly)
    assert small["mean_better"] and not small["worse"], small
    assert small["p99_ratio"] < 1 + TAIL_P99_TOLERANCE
    big = tail_change(before, much)
    assert big["mean_better"] and big["p99_worse"] and big["worse"], big


def test_tail_stalls_are_compared_as_rates_with_one_stall_of_slack() -> None:
    import numpy as np

    before = distribution(np.array(_series(100, 40, 2, 400)))
    # Twice as long a run with twice the stalls: the same rate, not worse.
    same_rate = distribution(np.array(_series(100, 80, 4, 400)), reference_p50=before.p50)
    assert not tail_change(before, same_rate)["stalls_worse"]
    # One stall more than the rate allows is noise; three more are not.
    plus_one = distribution(np.array(_series(100, 40, 3, 400)), reference_p50=before.p50)
    plus_three = distribution(np.array(_series(100, 40, 5, 400)), reference_p50=before.p50)
    assert not tail_change(before, plus_one)["stalls_worse"]
    assert tail_change(before, plus_three)["stalls_worse"]


def test_interval_coverage_needs_two_intervals_of_the_after_run() -> None:
    assert COVER_INTERVALS == 2
    assert interval_coverage(None, 10, 3)["covered"] is None
    assert interval_coverage(6, 30, 11)["covered"] is False
    ok = interval_coverage(6, 8, 12)
    assert ok["covered"] is True and ok["required_steps"] == 12
    assert ok["before_covered"] is False


def test_a_bad_interval_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = tmp_path / "rec"
    rec.mkdir()
    argv = ["experiment", "record", str(rec), "--hypothesis", "checkpoint", "--change", "c"]
    argv += ["--metric", "step_time", "--direction", "down", "--rejection", "r"]
    assert main([*argv, "--interval", "0"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert main([*argv, "--interval", "6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["interval"] == 6


# -- simulated before/after runs -----------------------------------------------------------


def _run(rec: Path, scenario: str, run: str, steps: int, ranks: int = 8, **over: object) -> None:
    handles = start_demo(
        load_scenario(scenario, ranks=ranks, **over),
        steps,
        pace="fast",
        record_dir=str(rec),
        run_id=run,
    )
    handles.wait(timeout=120)
    assert handles.wait_ingested()
    handles.stop()


PREDICTION = dict(
    hypothesis="checkpoint",
    change="checkpoint every 20 steps instead of every 5",
    metric="step_time",
    direction="down",
    rejection="step time and checkpoint stalls unchanged",
)


def test_less_frequent_longer_checkpoints_are_mean_better_tails_worse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = tmp_path / "rec"
    record_experiment(rec, **PREDICTION, id="ck", interval=5)
    _run(rec, "checkpoint", "before", 40, fault__every=5, fault__magnitude=1.0)
    _run(rec, "checkpoint", "after", 40, fault__every=20, fault__magnitude=2.5)
    capsys.readouterr()
    argv = ["experiment", "evaluate", str(rec), "--id", "ck", "--before", "before"]
    assert main([*argv, "--after", "after", "--json"]) == 0
    ev = json.loads(capsys.readouterr().out)["evaluation"]
    before, after = ev["distribution"]["before"], ev["distribution"]["after"]
    for d in (before, after):
        assert {"n", "mean", "p50", "p90", "p99", "max", "tail_stalls"} <= set(d)
    assert after["mean"] < before["mean"]
    assert after["p99"] > (1 + TAIL_P99_TOLERANCE) * before["p99"]
    assert ev["tails_worse"] is True and ev["tails"]["p99_worse"] is True
    assert ev["covers_interval"] is True
    assert ev["verdict"] in ("supported", "rejected", "improved_other")  # not too_short
    assert any("mean better, tails worse" in n for n in ev["notes"])
    # the keys of an evaluation before this change are all still there
    assert {"step_before", "step_after", "tail_worse", "accounting_closed"} <= set(ev)
    assert main([*argv, "--after", "after"]) == 0
    text = capsys.readouterr().out
    assert "MEAN BETTER, TAILS WORSE" in text
    assert "interval 5 steps" in text and "covered" in text


def test_an_after_run_shorter_than_two_intervals_is_too_short_to_validate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = tmp_path / "rec"
    pred = dict(
        hypothesis="data_imbalance",
        change="packer balances attention cost",
        metric="entry_spread",
        direction="down",
        rejection="entry spread unchanged",
    )
    record_experiment(rec, **pred, id="short", interval=20)
    record_experiment(rec, **pred, id="long", interval=5)
    _run(rec, "data-imbalance", "before", 24)
    _run(rec, "data-imbalance", "after", 24, fault="healthy")
    capsys.readouterr()
    for exp in ("short", "long"):
        argv = ["experiment", "evaluate", str(rec), "--id", exp, "--before", "before"]
        assert main([*argv, "--after", "after", "--json"]) == 0
    long_ev = load_experiment(rec, "long").evaluation
    short_ev = load_experiment(rec, "short").evaluation
    assert long_ev is not None and short_ev is not None
    # Same runs, same measurement: covered, the change is supported...
    assert long_ev["verdict"] == "supported" and long_ev["covers_interval"] is True
    # ...but a 20-step recurrence needs 40 steady steps the 24-step after-run does not have.
    assert short_ev["covers_interval"] is False
    assert short_ev["verdict"] == "too_short"
    assert short_ev["measured_verdict"] == "supported"
    assert short_ev["interval_check"]["required_steps"] == 40
    assert any("too short to validate" in n for n in short_ev["notes"])
    argv = ["experiment", "evaluate", str(rec), "--id", "short", "--before", "before"]
    assert main([*argv, "--after", "after"]) == 0
    assert "TOO SHORT TO VALIDATE" in capsys.readouterr().out
