"""Sweeps seen outside ``rankscope sweep``: the ladder lists a run's sweeps beside its scope
rungs, and the snapshot bundle carries their result files and says what they concluded
(simulated cluster: a pairwise sweep of the network-rail scenario names the slow rail)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
from simrec import record_sim

from rankscope.cli import main
from rankscope.launch.ladder import read_sweeps, sweeps_text
from rankscope.sanitize import for_markdown

RANKS = 16
STEPS = 8


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A recording of the network-rail scenario and its pairwise sweep's ``--json``."""
    rec = tmp_path_factory.mktemp("sweep-views") / "rail"
    record_sim("network-rail", rec, ranks=RANKS, steps=STEPS)
    argv = ["sweep", str(rec), "--scope", "pairwise", "--launcher", "simulated", "--yes"]
    return rec, _json(main, [*argv, "--json"])


def _json(fn, argv: list[str]) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = fn(argv)
    assert code == 0, buf.getvalue()[-2000:]
    return json.loads(buf.getvalue())


def test_ladder_lists_the_runs_sweeps_beside_its_rungs(swept, capsys) -> None:
    rec, sweep = swept
    assert sweep["found"]["finding"] == "network_rail"  # what the sweep itself found
    assert main(["ladder", str(rec), "--run", "parent", "--no-verdict"]) == 0
    text = capsys.readouterr().out
    section = text[text.index("sweeps:") :]
    assert f"{sweep['run']} pairwise (simulated): found network_rail" in section
    assert f"rail {sweep['found']['rail']}" in section
    assert all(len(line) <= 80 for line in section.splitlines())
    assert main(["ladder", str(rec), "--run", "parent", "--no-verdict", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["run"] for r in data["rungs"]] == ["parent"]  # a sweep is not a rung
    (entry,) = data["sweeps"]
    assert entry["run"] == sweep["run"] and entry["scope"] == "pairwise"
    assert entry["finding"] == "network_rail" and entry["backend"] == "simulated"
    assert entry["found"]["rail"] == sweep["found"]["rail"]
    assert entry["found"]["pair"] == sweep["found"]["pair"]
    assert entry["conclusion"] == sweep["conclusion"]
    assert (rec / entry["file"]).resolve() == Path(sweep["result"]).resolve()


def test_only_finished_sweeps_of_the_run_are_listed(swept, tmp_path) -> None:
    rec, sweep = swept
    copy = tmp_path / "rec"
    shutil.copytree(rec / "sweeps", copy / "sweeps")
    result = json.loads(Path(sweep["result"]).read_text())
    other = {**result, "run": "other-sweep", "parent_run": "someone-else"}
    (copy / "sweeps" / "other-sweep.json").write_text(json.dumps(other))
    (copy / "sweeps" / "torn.json").write_text('{"run": "torn", "parent_')
    (copy / "sweeps" / "x.plan.json").write_text(json.dumps({**result, "run": "x"}))
    unfinished = {k: v for k, v in result.items() if k != "analysis"}
    (copy / "sweeps" / "unfinished.json").write_text(json.dumps(unfinished))
    assert [e.run for e in read_sweeps(copy, "parent")] == [sweep["run"]]
    assert [e.run for e in read_sweeps(copy, "someone-else")] == ["other-sweep"]
    assert read_sweeps(tmp_path / "nowhere", "parent") == ()
    assert sweeps_text(()) == ["sweeps: none"]


def test_snapshot_carries_the_sweep_and_its_conclusion(swept, tmp_path, capsys) -> None:
    rec, sweep = swept
    out = tmp_path / "bundle"
    assert main(["snapshot", str(rec), "--run", "parent", "--out", str(out)]) == 0
    capsys.readouterr()
    content = json.loads((out / "snapshot.json").read_text())
    (entry,) = content["sweeps"]
    assert entry["run"] == sweep["run"] and entry["finding"] == "network_rail"
    assert content["files"][f"sweep:{sweep['run']}"] == entry["file"]
    carried = out / entry["file"]
    assert carried.read_bytes() == Path(sweep["result"]).read_bytes()
    md = (out / "snapshot.md").read_text()
    section = md[md.index("## Sweeps") : md.index("## Experiments")]
    assert for_markdown(sweep["conclusion"]) in section
    assert for_markdown(sweep["run"]) in section
    assert "network_rail" in section.replace("\\_", "_")
