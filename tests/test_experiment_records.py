"""Experiment records are written before the run and never rewritten by the evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rankscope.launch.experiments import (
    ExperimentError,
    list_experiments,
    load_experiment,
    record_experiment,
    save_evaluation,
)

PRED = dict(
    hypothesis="data_imbalance",
    change="packer balances attention cost as well as tokens",
    metric="arrival_wait",
    direction="down",
    rejection="entry spread unchanged while step time drops",
)


def test_record_then_list_and_load(tmp_path: Path) -> None:
    a = record_experiment(tmp_path, **PRED, parent_run="r1", now_ns=1_700_000_000 * 10**9)
    b = record_experiment(tmp_path, **dict(PRED, hypothesis="network rail 3"))
    assert a.id == "001-data_imbalance"
    assert b.id == "002-network_rail_3"
    assert a.created == "2023-11-14T22:13:20Z"
    assert a.status == "recorded"
    path = tmp_path / "experiments" / "001-data_imbalance.json"
    assert json.loads(path.read_text())["rejection"] == PRED["rejection"]
    assert [r.id for r in list_experiments(tmp_path)] == [a.id, b.id]
    assert load_experiment(tmp_path, a.id) == a


def test_a_prediction_is_never_overwritten(tmp_path: Path) -> None:
    record_experiment(tmp_path, **PRED, id="e1")
    with pytest.raises(ExperimentError, match="already exists"):
        record_experiment(tmp_path, **dict(PRED, direction="up"), id="e1")
    assert load_experiment(tmp_path, "e1").direction == "down"


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"rejection": " "}, "rejection is empty"),
        ({"metric": ""}, "metric is empty"),
        ({"direction": "sideways"}, "direction"),
        ({"id": "../../etc/passwd"}, "id="),
        ({"id": "a;b"}, "id="),
    ],
)
def test_bad_records_are_refused(tmp_path: Path, over: dict, match: str) -> None:
    with pytest.raises(ExperimentError, match=match):
        record_experiment(tmp_path, **{**PRED, **over})
    assert not list(tmp_path.glob("**/*.json"))


def test_unknown_id_lists_what_exists(tmp_path: Path) -> None:
    record_experiment(tmp_path, **PRED, id="e1")
    with pytest.raises(ExperimentError, match="recorded: e1"):
        load_experiment(tmp_path, "e2")


def test_evaluation_is_added_and_the_prediction_kept(tmp_path: Path) -> None:
    rec = record_experiment(tmp_path, **PRED, id="e1")
    out = save_evaluation(
        tmp_path,
        "e1",
        before_run="r1",
        after_run="r2",
        evaluation={"verdict": "supported", "accounting_closed": True},
    )
    assert out.status == "supported"
    again = load_experiment(tmp_path, "e1")
    assert again == out
    for name in ("hypothesis", "change", "metric", "direction", "rejection", "created"):
        assert getattr(again, name) == getattr(rec, name)
    assert (again.before_run, again.after_run) == ("r1", "r2")
    with pytest.raises(TypeError):
        save_evaluation(tmp_path, "e1", before_run="r1", after_run="r2", evaluation={"x": object()})
    assert load_experiment(tmp_path, "e1").evaluation == {
        "verdict": "supported",
        "accounting_closed": True,
    }
