"""The screenshot tool shoots a given recording (the README's incident pictures)."""

from __future__ import annotations

import pytest

from rankscope.cli import main
from rankscope.tui import screenshots


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    record = tmp_path_factory.mktemp("shots") / "rec"
    argv = ["demo", "--headless", "--steps", "8", "--ranks", "16", "--seed", "4"]
    argv += ["--baseline-steps", "8", "--run-id", "rail-fault"]
    assert main([*argv, "--scenario", "network-rail", "--record", str(record)]) == 0
    return record


def test_a_recording_is_shot_with_the_run_baseline_and_keys(recording, tmp_path) -> None:
    from rankscope.hub.replay import load

    runs = [r.run for r in load(recording).runs()]
    assert len(runs) == 2 and "rail-fault" in runs, runs
    fault = "rail-fault"
    base = next(r for r in runs if r != fault)
    argv = ["--record", str(recording), "--run", fault, "--baseline", base]
    argv += ["--name", "incident", "--size", "100x28", "--keys", "m", "--out", str(tmp_path)]
    assert screenshots.main(argv) == 0
    svg = (tmp_path / "incident.svg").read_text("utf-8")
    # Textual writes non-breaking spaces between words in the SVG's text.
    text = svg.replace("\u00a0", " ").replace("&#160;", " ")
    assert fault in text and base in text
    # One press of m moves the heatmap from lateness to the next metric (wait).
    assert "arrival lateness" not in text
    assert "rankscope · incident" in text


def test_a_bad_terminal_size_is_named(recording, tmp_path) -> None:
    with pytest.raises(SystemExit, match="--size must be COLSxROWS"):
        screenshots.main(["--record", str(recording), "--size", "wide", "--out", str(tmp_path)])
