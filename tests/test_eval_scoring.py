"""``rankscope eval``'s scoring on hand-made runs: outcomes, counts, the full confusion
matrix, localisation (stage included) and warm-up."""

from types import SimpleNamespace

import numpy as np

from rankscope.collector.schema import MECHANISMS
from rankscope.commands.eval_scoring import (
    OUTCOMES,
    Case,
    abbreviations,
    confusion_matrix,
    localise,
    make_case,
    render,
    score,
    to_json,
)


def _case(truth: str, predicted: str, scale: int = 64, seed: int = 1, **kw) -> Case:
    return Case(
        scenario=truth.replace("_", "-"),
        scale=scale,
        seed=seed,
        truth=truth,
        predicted=predicted,
        score=0.9,
        runner_up="healthy",
        rank_ok=kw.pop("rank_ok", None),
        host_ok=kw.pop("host_ok", None),
        rail_ok=None,
        magnitude=0.5,
        seconds=1.0,
        **kw,
    )


def _mixed() -> list[Case]:
    return [
        _case("slow_device", "slow_device", rank_ok=True, host_ok=True, localised=True),
        _case("slow_device", "healthy", seed=2, localised=False),  # missed
        _case("network_rail", "healthy", scale=512, seed=3),  # missed
        _case("slow_device", "data_imbalance", seed=4, localised=False),  # wrong name
        _case("slow_host_input", "unexplained_straggler", localised=True),  # found, unexplained
        _case("local_fabric", "unexplained_straggler", localised=False),  # wrong place
        _case("checkpoint", "unexplained_straggler"),  # truth names no place
        _case("healthy", "healthy", baseline_alone="healthy"),
        _case("healthy", "checkpoint", scale=512, baseline_alone="host_pause"),  # false alarm
    ]


def test_outcomes_are_one_each() -> None:
    got = [c.outcome for c in _mixed()]
    assert got == [
        "correct",
        "missed",
        "missed",
        "wrong_name",
        "unexplained_localised",
        "wrong_name",
        "wrong_name",
        "correct",
        "false_alarm",
    ]
    assert set(got) <= set(OUTCOMES)
    # An unexplained straggler that is the truth is simply correct.
    assert _case("unexplained_straggler", "unexplained_straggler").outcome == "correct"


def test_counts_by_hand() -> None:
    s = score(_mixed())
    assert s.runs == 9
    assert (s.top1.ok, s.top1.n) == (2, 9)
    assert (s.missed.ok, s.missed.n) == (2, 7)
    assert (s.false_alarms.ok, s.false_alarms.n) == (1, 2)
    assert (s.wrong_name.ok, s.wrong_name.n) == (3, 7)
    assert (s.unexplained_localised.ok, s.unexplained_localised.n) == (1, 7)
    assert (s.baseline_alarms.ok, s.baseline_alarms.n) == (1, 2)
    assert (s.localisation["ranks"].ok, s.localisation["ranks"].n) == (1, 1)
    assert s.localisation["stage"].n == 0 and str(s.localisation["stage"]) == "n/a"
    # Outcomes partition the runs.
    total = s.top1.ok + s.missed.ok + s.false_alarms.ok + s.wrong_name.ok
    assert total + s.unexplained_localised.ok == s.runs
    assert [(scale, n) for scale, n, _, _ in s.per_scale] == [(64, 7), (512, 2)]
    assert str(s.per_scale[1][3]) == "1/1 (100.0 %)"


def test_confusion_matrix_covers_the_vocabulary() -> None:
    labels, matrix = confusion_matrix(_mixed())
    assert labels == MECHANISMS
    assert len(matrix) == len(MECHANISMS) and all(len(r) == len(MECHANISMS) for r in matrix)
    i = {m: k for k, m in enumerate(labels)}
    assert matrix[i["slow_device"]][i["healthy"]] == 1
    assert matrix[i["slow_device"]][i["slow_device"]] == 1
    assert matrix[i["slow_device"]][i["data_imbalance"]] == 1
    assert matrix[i["healthy"]][i["checkpoint"]] == 1
    assert matrix[i["slow_host_input"]][i["unexplained_straggler"]] == 1
    assert sum(map(sum, matrix)) == 9
    # A name outside the vocabulary (a real job's own) gets a row and a column.
    labels, matrix = confusion_matrix([_case("gc_storm", "host_pause")])
    assert labels[-1] == "gc_storm" and matrix[-1][labels.index("host_pause")] == 1


def test_abbreviations_are_unique() -> None:
    short = abbreviations((*MECHANISMS, "pipeline_idle", "placement_x"))
    assert len(set(short.values())) == len(short)
    assert short["slow_host_input"] == "SHI" and short["unexplained_straggler"] == "US"


def test_render_lists_every_missed_fault() -> None:
    text = render(_mixed(), "Simulated scenarios", "intro")
    assert "**faults called healthy (missed): 2/7 (28.6 %)**" in text
    assert "false alarms on healthy runs: 1/2 (50.0 %)" in text
    assert "faults called by another fault's name: 3/7 (42.9 %)" in text
    assert "at the right rank/host/stage; not counted as correct): 1/7 (14.3 %)" in text
    assert "top-1 mechanism correct: 2/9 (22.2 %)" in text
    missed = text.split("Missed faults (injected, called healthy):")[1].split("\n\n")[1]
    assert "- slow-device @ 64 ranks, seed 2: truth slow_device" in missed
    assert "- network-rail @ 512 ranks, seed 3: truth network_rail" in missed
    assert "False alarms (healthy, called faulty):" in text
    assert "Localised but unexplained:\n\n- slow-host-input @ 64 ranks, seed 1" in text
    assert "baseline of healthy @ 512 ranks, seed 1: host_pause" in text
    # Every vocabulary row, zeros as dots; the header has one column per mechanism.
    for m in MECHANISMS:
        assert f"\n| {m} | " in text
    assert "| healthy | · | · | · | · | · | · | 1 |" in text
    assert "warm-up recognised (where the truth has one): n/a (no run has one)" in text


def test_real_cases_have_no_seed_in_labels() -> None:
    c = _case("pipeline_imbalance", "healthy", scale=2, seed=0, suite="real")
    assert c.label == "pipeline-imbalance @ 2 ranks"


def test_warmup_recognised_or_na() -> None:
    cases = [
        _case("healthy", "healthy", warmup_truth=4, warmup_found=4),
        _case("healthy", "healthy", warmup_truth=4, warmup_found=0),
        _case("healthy", "healthy", warmup_truth=8, warmup_found=10),
        _case("healthy", "healthy"),
    ]
    assert [c.warmup_recognised for c in cases] == [True, False, True, None]
    s = score(cases)
    assert s.warmup is not None and (s.warmup.ok, s.warmup.n) == (2, 3)
    # The diagnosis exposes no warm-up yet: n/a, and how many runs had one.
    s = score([_case("healthy", "healthy", warmup_truth=4)])
    assert s.warmup is None and s.warmup_runs == 1
    assert "n/a (1 runs have one" in render([_case("healthy", "healthy", warmup_truth=4)], "x", "y")


def _diag(mechanism: str, ranks=(), hosts=(), rails=(), pp=None, warmup=None, **extra):
    top = SimpleNamespace(
        mechanism=mechanism,
        score=0.8,
        impact=0.2,
        ranks=tuple(ranks),
        hosts=tuple(hosts),
        rails=tuple(rails),
        **extra,
    )
    other = SimpleNamespace(mechanism="healthy", score=0.2)
    mesh = {} if pp is None else {"pp": np.asarray(pp, dtype=np.int32)}
    diag = SimpleNamespace(
        verdict=SimpleNamespace(top=top, hypotheses=(top, other)),
        window=SimpleNamespace(ranks=SimpleNamespace(mesh=mesh)),
    )
    if warmup is not None:
        diag.warmup_steps = warmup
    return diag


def test_make_case_localises_an_unexplained_straggler() -> None:
    truth = {"mechanism": "slow_device", "ranks": [5], "hosts": ["node000"], "rails": [5]}
    c = make_case(
        _diag("unexplained_straggler", ranks=[5, 4]),
        truth,
        scenario="s",
        scale=8,
        seed=1,
        seconds=0,
    )
    assert c.outcome == "unexplained_localised" and not c.correct
    assert c.rank_ok is None  # the implicated-ranks rate counts right mechanisms only
    c = make_case(
        _diag("unexplained_straggler", ranks=[3]), truth, scenario="s", scale=8, seed=1, seconds=0
    )
    assert c.outcome == "wrong_name" and c.localised is False
    c = make_case(
        _diag("slow_device", ranks=[5], hosts=["node000"], rails=[5]),
        truth,
        scenario="s",
        scale=8,
        seed=1,
        seconds=0,
    )
    assert c.correct and (c.rank_ok, c.host_ok, c.rail_ok) == (True, True, True)


def test_an_equally_right_mechanism_of_the_truth_is_correct_and_localised() -> None:
    # A real case on two CPU ranks: a slower rank's compute is unexplained_straggler,
    # and slow_device would be as right; a third mechanism is not.
    truth = {"mechanism": "unexplained_straggler", "ranks": [1], "alternatives": ["slow_device"]}
    kw = dict(scenario="slow", scale=2, seed=0, seconds=0, suite="real")
    alt = make_case(_diag("slow_device", ranks=[1]), truth, **kw)
    assert alt.correct and alt.outcome == "correct" and alt.rank_ok is True
    other = make_case(_diag("cpu_contention", ranks=[1]), truth, **kw)
    assert not other.correct and other.outcome == "wrong_name" and other.rank_ok is None
    assert score([alt, other]).top1.ok == 1


def test_stage_from_the_hypothesis_or_the_mesh() -> None:
    truth = {"mechanism": "pipeline_imbalance", "ranks": [], "stage": 1}
    # No stage attribute: the pp coordinate of the first implicated rank.
    assert localise(_diag("pipeline_imbalance", ranks=[3], pp=[0, 0, 1, 1]), truth)["stage"]
    assert (
        localise(_diag("pipeline_imbalance", ranks=[0], pp=[0, 0, 1, 1]), truth)["stage"] is False
    )
    # Its own stage wins.
    assert localise(_diag("pipeline_imbalance", ranks=[0], pp=[0, 1], stage=1), truth)["stage"]
    # Nothing says which stage: not judged.
    assert localise(_diag("pipeline_imbalance", ranks=[0]), truth)["stage"] is None
    c = make_case(
        _diag("pipeline_imbalance", ranks=[1], pp=[0, 1]),
        truth,
        scenario="p",
        scale=2,
        seed=0,
        seconds=0,
    )
    assert c.stage_ok is True and c.localised is True
    c = make_case(
        _diag("unexplained_straggler", ranks=[1], pp=[0, 1]),
        truth,
        scenario="p",
        scale=2,
        seed=0,
        seconds=0,
    )
    assert c.outcome == "unexplained_localised"


def test_make_case_reads_warmup_when_exposed() -> None:
    truth = {"mechanism": "healthy", "warmup_steps": 4}
    c = make_case(_diag("healthy", warmup=4), truth, scenario="w", scale=2, seed=0, seconds=0)
    assert (c.warmup_truth, c.warmup_found, c.warmup_recognised) == (4, 4, True)
    c = make_case(_diag("healthy"), truth, scenario="w", scale=2, seed=0, seconds=0)
    assert c.warmup_found is None and c.warmup_recognised is None


def test_json_has_the_counts_and_nulls_for_nan() -> None:
    c = make_case(
        _diag("healthy"),
        {"mechanism": "host_pause", "ranks": [1]},
        scenario="gc",
        scale=2,
        seed=0,
        seconds=0,
        suite="real",
    )
    doc = to_json([c])
    assert doc["scores"]["missed"] == {"ok": 1, "n": 1, "rate": 1.0}
    assert doc["missed"] == ["gc @ 2 ranks"]
    assert doc["cases"][0]["magnitude"] is None and doc["cases"][0]["outcome"] == "missed"
    assert doc["confusion"]["labels"] == list(MECHANISMS)
