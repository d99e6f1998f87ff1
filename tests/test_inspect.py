"""``rankscope inspect`` on recordings: every documented key, damage, run filter, errors."""

import json
import os
import subprocess
import sys

import pytest
from test_hub_job import job

from rankscope.cli import main
from rankscope.hub.inspection import inspect_recording
from rankscope.hub.intake import Intake
from rankscope.hub.recording import RecordingWriter, segments
from rankscope.hub.store import Store

RUN_KEYS = {
    "job",
    "run",
    "scope",
    "parent_run",
    "world_size",
    "ranks_seen",
    "hosts",
    "ranks",
    "steps",
    "step_time_ns",
    "collectives",
    "last_arriver",
    "lateness_mean_ns",
    "drops",
    "collector_errors",
    "clock_error_ns",
}
TOP_KEYS = {
    "path",
    "format_version",
    "sessions",
    "frames",
    "bytes",
    "skipped",
    "skipped_bytes",
    "rejects",
    "replay_rejects",
    "transport",
    "scopes",
    "runs",
}


def record(path, *jobs, junk: int = 0, **writer):
    store = Store()
    w = RecordingWriter(path, **writer)
    intake = Intake(store, w)
    for j in jobs:
        for m in j.messages:
            intake.feed(m)
    for _ in range(junk):
        intake.feed(b"\xc1 not msgpack")
    w.close({"rejects": store.health["rejects"]})


def test_json_report_names_the_slow_rank_and_its_lateness(tmp_path) -> None:
    j = job(world=4, steps=12, slow=3, delay=200_000, async_buckets=False)
    record(tmp_path, j, junk=2)
    proc = subprocess.run(
        [sys.executable, "-m", "rankscope", "inspect", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    rep = json.loads(proc.stdout)
    assert set(rep) == TOP_KEYS
    assert rep["rejects"] == {"bad_msgpack": 2} and rep["replay_rejects"] == {}
    assert rep["skipped"] == [] and rep["sessions"] == 1
    assert rep["frames"] == len(j.messages) and rep["scopes"] == ["full"]
    (run,) = rep["runs"]
    assert set(run) == RUN_KEYS
    assert run["world_size"] == 4 and run["ranks_seen"] == 4
    assert run["hosts"] == ["node0", "node1"]
    assert [r["host"] for r in run["ranks"]] == ["node0", "node0", "node1", "node1"]
    assert run["steps"] == {"first": 0, "last": 11, "count": 12, "complete": 12}
    dist = run["step_time_ns"]
    assert dist["n"] == 12 and dist["p50"] <= dist["p90"] <= dist["p99"] <= dist["max"]
    # Per step: two world collectives (rank 3 delayed) and one in the group of ranks 0, 2.
    counts = run["last_arriver"]["counts"]
    assert counts[3] == 12 * 2 and sum(counts) == 12 * 3
    assert run["last_arriver"]["top"][0]["rank"] == 3
    late = run["lateness_mean_ns"]
    assert 0.8 * 200_000 < late[3] < 1.2 * 200_000
    assert all(x < 10_000 for x in late[:3])
    assert run["collectives"]["instances_complete"] == 12 * 3
    assert run["drops"] == {"batches": 6, "events": 60}
    assert run["clock_error_ns"]["max"] == 1003.0
    assert run["clock_error_ns"]["per_rank"] == [1000.0, 1001.0, 1002.0, 1003.0]


def test_truncated_tail_is_reported_and_the_rest_inspected(tmp_path) -> None:
    j = job(world=2, steps=5, slow=1)
    record(tmp_path, j, format_version=1)  # one frame a message: the cut costs the last
    seg = segments(tmp_path)[0]
    os.truncate(seg, seg.stat().st_size - 7)
    rep = inspect_recording(tmp_path)
    assert rep["frames"] == len(j.messages) - 1
    (skip,) = rep["skipped"]
    assert skip["reason"] == "truncated" and rep["skipped_bytes"] == skip["nbytes"] > 0


def test_run_filter_and_text_output(tmp_path, capsys) -> None:
    a = job(world=2, steps=3, slow=1, run="ra")
    b = job(world=2, steps=3, slow=0, run="rb", name="other")
    record(tmp_path, a, b)
    assert [r["run"] for r in inspect_recording(tmp_path)["runs"]] == ["ra", "rb"]
    assert main(["inspect", str(tmp_path), "--run", "rb", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["job"] for r in rep["runs"]] == ["other"]
    assert main(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "run ra" in text and "run rb" in text and "last to arrive: rank 1" in text


@pytest.mark.parametrize("args", [["--run", "nope"], []])
def test_errors_name_the_problem(tmp_path, capsys, args) -> None:
    if args:
        record(tmp_path, job(world=2, steps=1, slow=1))
        expect = "nope"
    else:
        expect = "no recording"
    assert main(["inspect", str(tmp_path), *args]) == 2
    assert expect in capsys.readouterr().err
