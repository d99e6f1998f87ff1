"""The plan is shown in full, and the ladder's JSON is valid JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from rankscope.diagnosis.synthetic import make_window, rank_layout
from rankscope.launch.ladder import build_ladder
from rankscope.launch.plan import Suspect, propose
from rankscope.launch.report import ladder_dict, ladder_text, launch_text
from rankscope.launch.runner import LaunchSettings, prepare
from rankscope.launch.templates import find_launcher


def _window(world: int = 16, run: str = "r1", scope: str = "full", parent=None):
    t0 = np.tile(np.arange(4) * 1e8, (world, 1))
    manifest = {"argv": ["train.py", "--lr=0.1"], "job_config": {"micro_batch": 2}}
    win = make_window(t0, t0 + 1e8, ranks=rank_layout(world), manifest=manifest)
    return dataclasses.replace(win, job="llm", run=run, scope=scope, parent_run=parent)


def test_launch_text_shows_hosts_env_and_exact_command(tmp_path: Path) -> None:
    win = _window()
    plan = propose(win, [Suspect("local_fabric", 0.7, hosts=("node0001",))], "one-node")
    launch = prepare(
        plan,
        find_launcher("torchrun"),
        LaunchSettings(hub="tcp://10.0.0.1:5555", python="/venv/bin/python"),
        record=tmp_path,
        manifest=win.manifest,
        local=["node0001"],
    )
    text = "\n".join(launch_text(launch))
    assert "hosts:   node0001" in text
    assert "env:  RANKSCOPE_PARENT_RUN=r1" in text
    assert "env:  RANKSCOPE_SCOPE=one-node" in text
    assert "/venv/bin/python -m rankscope run -- torchrun" in text
    assert "local_fabric (0.70, reproduces here)" in text
    assert f"log:     {tmp_path / 'reruns' / 'r1-one-node.log'}" in text
    assert "micro batch (2)" in text


def test_ladder_json_round_trips_without_nan() -> None:
    parent = _window()
    child = _window(8, run="c", scope="one-node", parent="r1")
    ladder = build_ladder(parent, [child])
    data = json.loads(json.dumps(ladder_dict(ladder), allow_nan=False))
    assert [r["scope"] for r in data["rungs"]] == ["one-node", "full"]
    assert data["rungs"][0]["step"]["p50"] == 1e8
    assert data["first_scope"] is None
    assert "reference" in data["rule"]
    assert data["tolerances"] == {"local": 0.1, "spread": 0.05, "comm": 0.25}
    text = "\n".join(ladder_text(ladder))
    assert "first scope with the regression: none" in text
