"""Snapshot bundles from a recording: contents, schema, re-opening, report, errors."""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest

import rankscope.snapshot as snapshot_mod
from rankscope.cli import main
from rankscope.hub import replay
from rankscope.snapshot import (
    SCHEMA,
    SnapshotError,
    View,
    load_snapshot,
    open_snapshot,
)

STEPS = 6


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rec") / "demo"
    argv = ["demo", "--headless", "--steps", "10", "--ranks", "16", "--seed", "5"]
    assert main([*argv, "--scenario", "slow-device", "--record", str(path)]) == 0
    return path


@pytest.fixture(scope="module")
def bundle(recording, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("snap") / "incident"
    argv = ["snapshot", str(recording), "--out", str(out), "--tar", "--steps", str(STEPS)]
    # No --metric: the bundle records the metric the TUI opens with (lateness).
    assert main([*argv, "--pin", "3", "--pin", "9"]) == 0
    return out


def _documented_keys() -> set[str]:
    doc = snapshot_mod.__doc__ or ""
    table = doc[doc.index("schema ``rankscope.snapshot/1``") :]
    return set(re.findall(r"^``(\w+)``", table, flags=re.M))


def test_bundle_holds_every_file(bundle) -> None:
    names = {p.name for p in bundle.iterdir()}
    assert {"snapshot.md", "snapshot.json", "screen.svg", "window", "manifest.json"} <= names
    assert (bundle / "window" / "meta.json").exists()
    assert not (bundle / "window" / "lock").exists()
    content = json.loads((bundle / "snapshot.json").read_text())
    for key, rel in content["files"].items():
        if key != "png_note":
            assert (bundle / rel).exists(), f"{key}: {rel} listed but missing"
    assert ("png" in content["files"]) != ("png_note" in content["files"])
    if "png" in content["files"]:
        assert (bundle / "screen.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (bundle / "screen.svg").read_text().lstrip().startswith("<svg")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest == json.loads((bundle / "manifests" / f"{content['run']}.json").read_text())
    assert manifest["sim"]["scenario"] == "slow-device"


def test_json_schema_is_the_documented_one(bundle, recording) -> None:
    content = json.loads((bundle / "snapshot.json").read_text())
    assert content["schema"] == SCHEMA
    assert set(content) == _documented_keys()
    assert content["diagnosis"]["schema"] == "rankscope.diagnosis/1"
    assert content["window"]["n_steps"] == STEPS
    assert content["window"]["path"] == "window" and content["window"]["frames"] > 0
    assert content["source"] == {"kind": "recording", "path": str(recording)}
    assert content["view"] == {
        "run": content["run"],
        "metric": "lateness",
        "group_by": "host",
        "pins": [3, 9],
        "baseline_run": None,
        "filter": "",
        "zoom": None,
    }
    assert [p["rank"] for p in content["pins"]] == [3, 9]
    assert content["reopen"] == f"rankscope open {bundle}"
    highlights = content["manifest"]["highlights"]
    assert highlights["gpu.model"] and "job_config.model" in highlights


def test_window_reopens_as_the_same_run(bundle, recording) -> None:
    opened = open_snapshot(bundle)
    assert opened.view == View(run=opened.content["run"], metric="lateness", pins=(3, 9))
    reopened = replay.load(opened.recording).window(opened.content["run"], last=STEPS)
    original = replay.load(recording).window(opened.content["run"], last=STEPS)
    assert reopened.steps.tolist() == original.steps.tolist()
    assert list(opened.content["window"]["steps"]) == [
        int(original.steps[0]),
        int(original.steps[-1]),
    ]
    np.testing.assert_array_equal(reopened.present, original.present)
    np.testing.assert_allclose(reopened.step_ns, original.step_ns)
    for name in ("times_last", "late_ns", "wait_ns"):
        np.testing.assert_allclose(reopened.coll[name], original.coll[name], err_msg=name)
    assert reopened.manifest == original.manifest
    # The recording kept only the window's steps.
    assert replay.load(opened.recording).totals(opened.content["run"]).steps.size == STEPS


def test_tarball_opens_like_the_folder(bundle) -> None:
    tarball = bundle.with_name(bundle.name + ".tar.gz")
    content, folder = load_snapshot(tarball)
    assert content == json.loads((bundle / "snapshot.json").read_text())
    opened = open_snapshot(tarball)
    assert opened.recording is not None and (opened.recording / "meta.json").exists()
    assert folder != bundle


def test_markdown_names_verdict_and_rejection(bundle) -> None:
    content = json.loads((bundle / "snapshot.json").read_text())
    md = (bundle / "snapshot.md").read_text()
    top = content["diagnosis"]["verdict"]["hypotheses"][0]
    assert f"**{top['mechanism']}**" in md
    assert f"**Rejected if:** {top['next_experiment']['rejects']}" in md
    for section in (
        "## Step time",
        "## Where the step time goes",
        "## Last-arriving ranks",
        "## Correlation with structure",
        "## Pinned ranks",
        "## Manifest",
        "## Ladder",
        "## Experiments",
        "## Reopen",
    ):
        assert section in md
    assert f"rankscope open {bundle}" in md


def test_export_reads_a_snapshot_folder(bundle, tmp_path, capsys) -> None:
    assert main(["export", str(bundle), "--csv", str(tmp_path / "csv")]) == 0
    assert f"rank_steps.csv ({16 * STEPS} rows)" in capsys.readouterr().out


def test_report_renders_the_snapshot(bundle, capsys) -> None:
    assert main(["report", str(bundle), "--width", "140"]) == 0
    out = capsys.readouterr().out
    content = json.loads((bundle / "snapshot.json").read_text())
    assert content["diagnosis"]["verdict"]["top"] in out
    assert "rejected if" in out and "last-arriving ranks" in out


def test_errors_name_the_problem(bundle, recording, tmp_path, capsys) -> None:
    assert main(["snapshot", str(recording), "--out", str(bundle)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["snapshot", str(recording), "--out", str(tmp_path / "x"), "--pin", "99"]) == 2
    assert "--pin [99]" in capsys.readouterr().err
    assert (
        main(["snapshot", str(recording), "--out", str(tmp_path / "y"), "--metric", "speed"]) == 2
    )
    assert "invalid choice: 'speed'" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "no snapshot.json" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    (other / "snapshot.json").write_text(json.dumps({"schema": "rankscope.snapshot/9"}))
    with pytest.raises(SnapshotError, match="snapshot/9"):
        load_snapshot(other)
    with pytest.raises(SnapshotError, match=r"view\.pins"):
        View.from_dict({"pins": ["a"]})
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tf:
        data = b"{}"
        info = tarfile.TarInfo("../escape.json")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    with pytest.raises(SnapshotError, match="refusing"):
        load_snapshot(evil)
