"""A real one-node rerun of a torch gloo job through the ``torchrun`` template, reporting to
the same hub as a child run (2 ranks on this machine)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from ports import free_port_pair

from rankscope.cli import main
from rankscope.hub.server import Hub

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "tiny_ddp.py"
STEPS = 6


def _wait_steps(hub: Hub, pred, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = [r for r in hub.store.runs() if pred(r)]
        if runs and runs[0].steps_complete >= STEPS:
            return runs[0]
        time.sleep(0.1)
    raise AssertionError(f"no matching run with {STEPS} steps: {hub.store.runs()}")


# Measured ~10 s alone, 26 s in a busy suite (two 2-rank runs): the slow tier; the default
# tier reruns from the TUI against simulated jobs (test_ladder_tui). The limit only catches
# a hang on a loaded machine.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_node_rerun_of_a_gloo_job_reports_as_a_child_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = tmp_path / "rec"
    with Hub(record_dir=str(rec)) as hub:
        parent_cmd = [
            sys.executable,
            "-m",
            "rankscope",
            "run",
            "--hub",
            hub.endpoint,
            "--job",
            "tiny",
            "--run",
            "tiny-full",
            "--",
            "torchrun",
            "--nproc-per-node=2",
            f"--master-port={free_port_pair()}",
            str(SCRIPT),
            f"--steps={STEPS}",
        ]
        done = subprocess.run(parent_cmd, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        parent = _wait_steps(hub, lambda r: r.run == "tiny-full")
        assert parent.world_size == 2 and parent.scope == "full"
        time.sleep(1.0)  # let the recording flush what the store already has
        argv = ["rerun", str(rec), "--scope", "one-node", "--launcher", "torchrun", "--yes"]
        # The parent's script comes from its manifest (telemetry): naming it confirms it.
        argv += ["--script", str(SCRIPT)]
        code = main([*argv, "--master-port", str(free_port_pair()), "--json"])
        out = json.loads(capsys.readouterr().out)
        log = Path(out["log"])
        assert code == 0, log.read_text()[-3000:]
        child = _wait_steps(hub, lambda r: r.parent_run == "tiny-full")
    cmd = out["commands"][0]
    assert cmd["argv"][1:5] == ["-m", "rankscope", "run", "--"]
    assert "torchrun" in cmd["argv"] and "--nproc-per-node=2" in cmd["argv"]
    assert cmd["argv"][-2:] == [str(SCRIPT), f"--steps={STEPS}"]  # the parent's own script
    assert cmd["env"]["RANKSCOPE_PARENT_RUN"] == "tiny-full"
    assert child.run == out["plan"]["run"] == "tiny-full-one-node"
    assert child.scope == "one-node"
    assert child.job == "tiny"
    assert child.world_size == 2
    assert log.parent == rec / "reruns" and log.stat().st_size > 0
