"""One CLI grammar: the same option names for the same things in every command, one-line
errors with exit status 2 for what the user gave, and dry runs that write nothing."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from rankscope.cli import COMMANDS, build_parser, main
from rankscope.commands.grammar import METAVARS, steps_count
from rankscope.diagnosis.trends import Trend, describe_trend, series_trend

PRODUCERS = {"demo", "eval", "import"}
"""Commands that make runs rather than read a recording: their ``--steps`` is how many
steps to simulate, and they are owned by their own modules' grammar (demo: ``--run-id``,
``--baseline-steps``)."""


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    rec = tmp_path_factory.mktemp("grammar") / "rec"
    argv = ["demo", "--scenario", "slow-device", "--ranks", "16", "--seed", "3", "--headless"]
    argv += ["--pace", "fast", "--steps", "10", "--record", str(rec), "--run-id", "parent"]
    assert main(argv) == 0
    return rec, "parent"


def _tree(folder: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*"))


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], *names: str) -> str:
    capsys.readouterr()
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("rankscope: error: "), err
    assert "Traceback" not in err
    for name in names:
        assert name in lines[0], (name, err)
    return lines[0]


def _missing_cases(missing: str, out: Path) -> list[list[str]]:
    record = ["--hypothesis", "h", "--change", "c", "--metric", "m", "--direction", "up"]
    return [
        ["diagnose", missing],
        ["export", missing, "--csv", str(out / "csv")],
        ["snapshot", missing, "--out", str(out / "snap")],
        ["report", missing],
        ["inspect", missing],
        ["ladder", missing],
        ["rerun", missing, "--scope", "one-rank"],
        ["experiment", "list", missing],
        ["experiment", "evaluate", missing, "--id", "x", "--before", "a", "--after", "b"],
        ["experiment", "record", missing, *record, "--rejection", "r"],
        ["open", missing],
        ["sweep", missing, "--scope", "pairwise"],
    ]


def test_a_missing_recording_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    missing = str(tmp_path / "nosuch")
    cases = _missing_cases(missing, tmp_path)
    reading = {argv[0] for argv in cases}
    # Every command that reads a recording or snapshot is covered here.
    assert reading == set(COMMANDS) - PRODUCERS - {"hub", "relay", "fetch", "watch", "run", "keys"}
    for argv in cases:
        _one_line_error(capsys, argv, "nosuch")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # and nothing was created


def test_the_entry_point_prints_no_traceback(tmp_path: Path) -> None:
    # The two commands that used to end in a traceback, through the real console entry.
    for argv in (["ladder", "nosuch"], ["rerun", "nosuch", "--scope", "one-node"]):
        done = subprocess.run(
            [sys.executable, "-m", "rankscope", *argv],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip() == "rankscope: error: no recording at 'nosuch'"
        assert done.stdout == ""


def test_an_unknown_run_is_one_line_and_exit_2(recording, tmp_path: Path, capsys) -> None:
    rec, parent = recording
    r = str(rec)
    cases = [
        ["diagnose", r, "--run", "nosuch"],
        ["diagnose", r, "--baseline-run", "nosuch"],
        ["diagnose", r, "--baseline", r, "--baseline-run", "nosuch"],
        ["export", r, "--run", "nosuch", "--csv", str(tmp_path / "csv")],
        ["snapshot", r, "--run", "nosuch", "--out", str(tmp_path / "s")],
        ["snapshot", r, "--baseline-run", "nosuch", "--out", str(tmp_path / "s")],
        ["inspect", r, "--run", "nosuch"],
        ["ladder", r, "--run", "nosuch"],
        ["ladder", r, "--baseline-run", "nosuch"],
        ["rerun", r, "--scope", "one-rank", "--run", "nosuch"],
        ["rerun", r, "--scope", "one-rank", "--baseline-run", "nosuch"],
        ["experiment", "evaluate", r, "--id", "x", "--before", "nosuch", "--after", parent],
    ]
    for argv in cases:
        line = _one_line_error(capsys, argv, "nosuch")
        assert parent in line, line  # the message lists the runs there are
    assert not (tmp_path / "s").exists() and not (tmp_path / "csv").exists()


def test_bad_values_and_unreadable_files_are_one_line(recording, tmp_path: Path, capsys) -> None:
    rec, _ = recording
    r = str(rec)
    _one_line_error(capsys, ["diagnose", r, "--steps", "x"], "--steps", "'x'")
    _one_line_error(capsys, ["ladder", r, "--steps", "0"], "--steps")
    _one_line_error(capsys, ["diagnose", r, "--steps", "1"], "--steps", "at least 2")
    _one_line_error(capsys, ["rerun", r, "--scope", "sideways"], "--scope", "sideways")
    _one_line_error(capsys, ["export", r, "--csv", str(tmp_path / "c"), "--ranks", "99"], "99")
    assert not (tmp_path / "c").exists()  # refused before anything was written
    _one_line_error(capsys, ["snapshot", r, "--pin", "99", "--out", str(tmp_path / "p")], "99")
    _one_line_error(capsys, ["ladder", r, "--local-tol", "-1"], "local")
    _one_line_error(capsys, ["hub", "--bind", "nonsense"], "nonsense")
    _one_line_error(capsys, ["watch", "--config", str(tmp_path / "none.toml")], "none.toml")
    _one_line_error(capsys, ["run", "--topology", str(tmp_path / "t.toml"), "--", "true"], "t.toml")
    _one_line_error(capsys, ["diagnose", r, "--baseline", str(tmp_path / "old")], "--baseline")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "snapshot.json").write_text("{")
    _one_line_error(capsys, ["report", str(bad)], "snapshot.json")
    (bad / "meta.json").write_text("garbage")
    _one_line_error(capsys, ["diagnose", str(bad)], str(bad))
    _one_line_error(capsys, ["inspect", str(bad)], str(bad))


def _subparsers(parser: argparse.ArgumentParser, prefix: str = ""):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix}{name}", sub
                yield from _subparsers(sub, f"{prefix}{name} ")


def test_shared_options_take_the_same_kind_of_value_everywhere() -> None:
    seen: dict[str, set[str]] = {opt: set() for opt in METAVARS}
    for name, sub in _subparsers(build_parser()):
        if name.split()[0] in PRODUCERS:
            continue
        for action in sub._actions:
            for opt in action.option_strings:
                if opt in METAVARS:
                    assert action.metavar == METAVARS[opt], (name, opt, action.metavar)
                    assert action.help != argparse.SUPPRESS, (name, opt)
                    seen[opt].add(name)
                if opt == "--steps":
                    assert action.type is steps_count, name
                    assert action.dest == "steps"
                if opt == "--last":  # the old spelling: hidden, and the same value
                    assert action.help == argparse.SUPPRESS, name
                    assert action.dest == "steps" and action.type is steps_count, name
        positional = [a for a in sub._actions if not a.option_strings and a.dest == "path"]
        for a in positional:
            assert a.metavar == "PATH", name
    assert (
        seen["--baseline"]
        == seen["--baseline-run"]
        == {"diagnose", "snapshot", "ladder", "rerun", "sweep"}
    )
    assert {
        "diagnose",
        "export",
        "snapshot",
        "ladder",
        "rerun",
        "sweep",
        "experiment evaluate",
    } <= seen["--steps"]
    assert {
        "diagnose",
        "export",
        "snapshot",
        "inspect",
        "ladder",
        "rerun",
        "open",
        "watch",
    } <= seen["--run"]


def test_old_spellings_keep_working_and_say_so(recording, capsys) -> None:
    rec, parent = recording
    capsys.readouterr()
    assert main(["ladder", str(rec), "--last", "6", "--no-verdict", "--json"]) == 0
    out, err = capsys.readouterr()
    assert '"n_steps": 6' in out or "6" in out
    assert "--last is deprecated; use --steps" in err
    # A run id where ladder and rerun once took one in --baseline: read as --baseline-run.
    assert main(["ladder", str(rec), "--baseline", parent, "--no-verdict"]) == 0
    out, err = capsys.readouterr()
    assert f"baseline run '{parent}'" in out
    assert "a run id goes in --baseline-run" in err


def test_list_launchers_needs_nothing_else(capsys) -> None:
    assert main(["rerun", "--list-launchers"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert {"torchrun", "slurm", "simulated"} <= set(names)
    _one_line_error(capsys, ["rerun"], "PATH", "--scope")


def test_rerun_dry_run_without_a_hub_prints_the_plan_and_writes_nothing(recording, capsys) -> None:
    rec, parent = recording
    before = _tree(rec)
    capsys.readouterr()
    argv = ["rerun", str(rec), "--scope", "one-node", "--launcher", "simulated"]
    assert main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"rerun {parent} at one-node" in out
    command = [line for line in out.splitlines() if line.strip().startswith("$ ")]
    assert len(command) == 1 and "rankscope.launch.simulated" in command[0]
    assert f"--parent-run={parent}" in command[0]
    assert "no hub is recording" in out  # the stand-in endpoint is called one
    assert "nothing was started or written" in out
    assert _tree(rec) == before
    # Launching needs the hub: refused in one line, still writing nothing.
    _one_line_error(capsys, [*argv, "--yes"], "no hub is recording")
    assert _tree(rec) == before


def test_run_dry_run_prints_the_command_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    capsys.readouterr()
    argv = ["run", "--dry-run", "--job", "j", "--", "torchrun", "--nproc-per-node=2", "a b.py"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "torchrun --nproc-per-node=2 'a b.py'"
    assert f"PYTHONPATH={tmp_path}" in "\n".join(out)
    assert list(tmp_path.iterdir()) == []


def _trend(rel: float, rho: float = 0.9, n: int = 64, median: float = 100e6) -> Trend:
    # series_trend's definition: relative_change = slope × steps / |median|.
    return Trend("step_time", rel * median / n, rel, rho)


def test_trends_never_read_nan_or_a_percentage_of_nothing() -> None:
    assert describe_trend(_trend(0.2), 2) == "n/a (too few steps)"
    assert describe_trend(Trend("x", float("nan"), 0.0, float("nan")), 64) == (
        "n/a (too few steps)"
    )
    assert describe_trend(Trend("x", 0.0, 0.0, float("nan")), 64) == "flat"
    # A fall of 1.185 medians over the window is a fall from ~1.6 to ~0.4 medians: -74 %,
    # not "-118.5 %".
    text = describe_trend(_trend(-1.185), 64)
    assert "-118.5" not in text and "% from the first" in text
    pct = float(text.split("(")[1].split("%")[0])
    assert -76 < pct < -73
    # A line that starts near zero has no meaningful percentage: the change alone.
    assert "%" not in describe_trend(_trend(1.95), 64)
    # A median of zero (relative change 0) with a real slope: the change alone, no "0.0%".
    assert describe_trend(Trend("x", 1e5, 0.0, 0.7), 64) == "+6.30 ms over 64 steps (ρ 0.70)"
    for t in (_trend(0.5, rho=float("nan")), _trend(-3.0), _trend(1e-9)):
        assert "nan" not in describe_trend(t, 64).lower()


def test_a_fitted_trend_reads_as_its_change_from_the_first_step() -> None:
    t = series_trend("step_time", np.linspace(100e6, 200e6, 10))
    assert describe_trend(t, 10) == "+100.00 ms over 10 steps (+100.0% from the first, ρ 1.00)"
    t = series_trend("step_time", np.linspace(200e6, 100e6, 10))
    assert describe_trend(t, 10) == "-100.00 ms over 10 steps (-50.0% from the first, ρ -1.00)"


def test_diagnose_text_on_two_steps_has_no_nan_trend(tmp_path: Path, capsys) -> None:
    rec = tmp_path / "rec"
    argv = ["demo", "--scenario", "healthy", "--ranks", "8", "--seed", "1", "--headless"]
    assert main([*argv, "--pace", "fast", "--steps", "2", "--record", str(rec)]) == 0
    capsys.readouterr()
    assert main(["diagnose", str(rec), "--steps", "2"]) == 0
    text = capsys.readouterr().out
    over_time = text.split("OVER TIME", 1)[1].split("\n\n", 1)[0]
    assert "step time trend n/a (too few steps)" in over_time
    assert "nan" not in over_time
