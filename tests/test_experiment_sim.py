"""An experiment end to end: the prediction is recorded before the after-run, then judged
from the two recorded runs (``rankscope experiment record / evaluate / list``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rankscope.cli import main
from rankscope.commands.demo import start_demo
from rankscope.hub.server import Hub
from rankscope.sim import load_scenario
from rankscope.sim import run as run_sim

RANKS = 32
STEPS = 20  # the drawn warm-up of this seed takes five; the steady steps after it decide


def _record(path: Path, *extra: str) -> None:
    argv = ["experiment", "record", str(path), "--hypothesis", "data_imbalance"]
    argv += ["--change", "attention-balanced packer", "--direction", "down", *extra]
    assert main(argv) == 0


def test_packer_fix_supports_imbalance_and_transfer_prediction_does_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = tmp_path / "rec"
    handles = start_demo(
        load_scenario("data-imbalance", ranks=RANKS),
        STEPS,
        pace="fast",
        record_dir=str(rec),
        run_id="before",
    )
    handles.wait(timeout=120)
    assert handles.wait_ingested()
    handles.stop()
    # Predictions first: one on the mechanism, one on a metric it should not move.
    _record(rec, "--metric", "entry_spread", "--rejection", "entry spread unchanged")
    _record(rec, "--metric", "transfer", "--rejection", "transfer unchanged", "--id", "xfer")
    capsys.readouterr()
    # The after-run: the same job with the attention-balanced packer (the healthy twin).
    with Hub(record_dir=str(rec)) as hub:
        seen = hub.health["messages"]
        info = run_sim(
            load_scenario("data-imbalance", ranks=RANKS, fault="healthy"),
            hub.endpoint,
            STEPS,
            pace="fast",
            run_id="after",
        )
        deadline = time.monotonic() + 30
        while hub.health["messages"] < seen + info.messages and time.monotonic() < deadline:
            time.sleep(0.05)

    def evaluate(exp_id: str) -> dict:
        argv = ["experiment", "evaluate", str(rec), "--id", exp_id]
        assert main([*argv, "--before", "before", "--after", "after", "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    good = evaluate("001-data_imbalance")
    ev = good["evaluation"]
    assert ev["verdict"] == "supported"
    assert ev["after"] < ev["before"]
    assert ev["recorded_before_after_run"] is True
    assert (good["before_run"], good["after_run"]) == ("before", "after")
    other = evaluate("xfer")["evaluation"]
    assert other["verdict"] == "improved_other"
    assert other["step_improved"]
    # Saved beside the recording, prediction intact.
    saved = json.loads((rec / "experiments" / "xfer.json").read_text())
    assert saved["metric"] == "transfer" and saved["evaluation"]["verdict"] == "improved_other"
    assert main(["experiment", "list", str(rec), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(r["id"], r["evaluation"]["verdict"]) for r in listed] == [
        ("001-data_imbalance", "supported"),
        ("xfer", "improved_other"),
    ]


def test_unknown_metric_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["experiment", "record", str(tmp_path), "--hypothesis", "slow_device"]
    argv += ["--change", "swap GPU", "--metric", "vibes", "--direction", "down"]
    assert main([*argv, "--rejection", "x"]) == 2
    assert "unknown metric 'vibes'" in capsys.readouterr().err
    assert not (tmp_path / "experiments").exists()
