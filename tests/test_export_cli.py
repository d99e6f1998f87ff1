"""``rankscope export`` on a recording of the simulated cluster, end to end."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from rankscope.cli import main
from rankscope.hub import replay


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("rec") / "demo"
    code = main(
        [
            "demo",
            "--headless",
            "--steps",
            "8",
            "--ranks",
            "16",
            "--seed",
            "3",
            "--record",
            str(path),
        ]
    )
    assert code == 0
    return str(path)


def test_perfetto_and_csv_from_a_recording(recording, tmp_path, capsys) -> None:
    out = tmp_path / "trace.json"
    code = main(
        [
            "export",
            recording,
            "--perfetto",
            str(out),
            "--csv",
            str(tmp_path / "csv"),
            "--steps",
            "4",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "ui.perfetto.dev" in printed and "rank_steps.csv (64 rows)" in printed
    doc = json.loads(out.read_text())
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    cats = {e["cat"] for e in slices}
    assert cats == {"step", "phase", "collective"}  # phase spans come from the frames
    steps = {e["args"]["step"] for e in slices if e["cat"] == "step"}
    assert len(steps) == 4 and doc["otherData"]["steps"] == [min(steps), max(steps)]
    # Every phase span lies inside its own step on its rank.
    bounds = {
        (e["args"]["rank"], e["args"]["step"]): (e["ts"], e["ts"] + e["dur"])
        for e in slices
        if e["cat"] == "step"
    }
    for e in slices:
        if e["cat"] == "phase":
            a, b = bounds[(e["args"]["rank"], e["args"]["step"])]
            assert a - 1e-3 <= e["ts"] and e["ts"] + e["dur"] <= b + 1e-3
    marks = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    with (tmp_path / "csv" / "collectives.csv").open() as fh:
        instances = list(csv.DictReader(fh))
    complete = [r for r in instances if r["last_rank"] != ""]
    assert len(marks) == len(complete) > 0
    assert sorted(
        (m["args"]["group"], m["args"]["seq"], m["args"]["rank"]) for m in marks
    ) == sorted((int(r["group"]), int(r["seq"]), int(r["last_rank"])) for r in complete)


def test_export_errors_name_the_problem(recording, tmp_path, capsys) -> None:
    assert main(["export", recording]) == 2
    assert "--perfetto" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "missing"), "--csv", str(tmp_path / "c")]) == 2
    assert "no recording" in capsys.readouterr().err
    assert main(["export", recording, "--run", "nope", "--csv", str(tmp_path / "c")]) == 2
    assert "unknown run 'nope'" in capsys.readouterr().err
    assert main(["export", recording, "--steps", "0", "--csv", str(tmp_path / "c")]) == 2
    assert "--steps" in capsys.readouterr().err


def test_perfetto_of_chosen_ranks(recording, tmp_path, capsys) -> None:
    out = tmp_path / "some.json"
    argv = ["export", recording, "--perfetto", str(out), "--steps", "4"]
    assert main([*argv, "--ranks", "2-4,9"]) == 0
    doc = json.loads(out.read_text())
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["rank"] for e in slices} == {2, 3, 4, 9}
    assert {e["cat"] for e in slices} == {"step", "phase", "collective"}
    assert doc["otherData"]["ranks_included"] == 4
    # last:N: the ranks that arrived last most often in the exported steps.
    assert main([*argv, "--ranks", "last:2"]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    chosen = {e["args"]["rank"] for e in events if e["ph"] == "X"}
    _, window = replay.load_run(recording, None, 4)
    times = np.nansum(window.coll["times_last"], axis=1)
    assert len(chosen) == 2 and min(times[sorted(chosen)]) >= np.sort(times)[-2]
    capsys.readouterr()
    for bad, why in (("3-1", "outside"), ("x", "not a rank"), ("99", "outside"), ("last:0", "N")):
        assert main([*argv, "--ranks", bad]) == 2
        assert why in capsys.readouterr().err
