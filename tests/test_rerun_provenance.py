"""Reruns say where their program comes from, and ``--yes`` runs a program telemetry chose
only when the user named it or the allow-list holds it (issue 17 part 5)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from test_hub_job import BASE, header, identity, job
from test_inspect import record

from rankscope.cli import main
from rankscope.collector import schema
from rankscope.hub import replay
from rankscope.launch.plan import propose
from rankscope.launch.report import launch_text
from rankscope.launch.runner import (
    TELEMETRY,
    LaunchSettings,
    launch_sources,
    prepare,
    program_check,
)
from rankscope.launch.templates import find_launcher

RUN = "r1"
SCRIPT = "/opt/jobs/train.py"
ARGS = ["--lr", "0.1"]


def torch_recording(path: Path, argv: list[str] | None = None) -> Path:
    """A four-rank run on two hosts whose manifest names its training script."""
    argv = [SCRIPT, *ARGS] if argv is None else argv
    j = job(world=4, steps=8, slow=2, run=RUN, name="j")
    for r in range(4):
        j.messages[2 * r] = schema.hello_message(
            header(RUN, r, "j"),
            identity(r, 4),
            manifest={"torch": "2.13", "argv": argv, "rank": r},
            t_start_ns=BASE,
        )
    record(path, j)
    return path


@pytest.fixture
def isolated_config(tmp_path, monkeypatch) -> Path:
    """An empty settings file, so no user's allow-list leaks into the test."""
    cfg = tmp_path / "rankscope.toml"
    cfg.write_text("")
    monkeypatch.setenv("RANKSCOPE_CONFIG", str(cfg))
    return cfg


def _launch(rec: Path, **settings):
    window = replay.load(rec).window(RUN, last=8)
    plan = propose(window, [], "one-node")
    return prepare(
        plan,
        find_launcher("torchrun"),
        LaunchSettings(hub="tcp://127.0.0.1:5555", **settings),
        record=rec,
        manifest=window.manifest,
        local=[],
    )


def test_plan_marks_the_telemetry_sourced_program(tmp_path) -> None:
    rec = torch_recording(tmp_path / "rec")
    launch = _launch(rec)
    assert launch.sources == {"script": TELEMETRY, "args": TELEMETRY, "hosts": TELEMETRY}
    assert launch.telemetry_script == SCRIPT
    text = "\n".join(launch_text(launch))
    assert f"script:   {SCRIPT}  <- FROM TELEMETRY (the parent's manifest argv[0])" in text
    assert "args:     --lr 0.1  <- FROM TELEMETRY (the parent's manifest argv[1:])" in text
    host = launch.plan.hosts[0]
    assert f"hosts:    {host}  <- FROM TELEMETRY (host names the parent's ranks reported)" in text
    assert "the script was chosen by telemetry" in text
    assert launch.to_dict()["sources"]["script"] == TELEMETRY

    mine = _launch(rec, script="/home/me/other.py")
    assert mine.sources["script"] == "--script" and mine.sources["args"] == "none"
    assert mine.values["script_args"] == []  # another script: none of the parent's arguments
    assert "script:   /home/me/other.py  <- from your --script" in "\n".join(launch_text(mine))
    assert program_check(mine) is None


def test_naming_the_parents_script_confirms_it_and_keeps_its_arguments(tmp_path) -> None:
    rec = torch_recording(tmp_path / "rec")
    named = _launch(rec, script=SCRIPT)
    assert named.sources == {"script": "--script", "args": TELEMETRY, "hosts": TELEMETRY}
    assert named.values["script_args"] == ARGS
    assert program_check(named) is None


def test_allow_list_patterns_admit_a_telemetry_script(tmp_path) -> None:
    launch = _launch(torch_recording(tmp_path / "rec"))
    assert program_check(launch, ["/opt/jobs/*.py"]) is None
    assert program_check(launch, [SCRIPT]) is None
    refused = program_check(launch, ["/opt/jobs/*.sh", "train.py"])
    assert refused is not None and "\n" not in refused
    assert f"--script '{SCRIPT}'" in refused and "[rerun] allow" in refused


def test_simulated_launcher_runs_its_own_program() -> None:
    manifest = {"argv": [SCRIPT], "sim": {"scenario": "slow-device", "seed": 1}}
    sources = launch_sources(find_launcher("simulated"), LaunchSettings(hub=""), manifest)
    assert sources == {"script": "template", "scenario": TELEMETRY, "hosts": TELEMETRY}
    torchrun = launch_sources(find_launcher("torchrun"), LaunchSettings(hub=""), manifest)
    assert torchrun["script"] == TELEMETRY and torchrun["args"] == "none"


def test_yes_refuses_a_telemetry_program_that_does_not_match(
    tmp_path, capsys, isolated_config
) -> None:
    rec = torch_recording(tmp_path / "rec")
    argv = ["rerun", str(rec), "--scope", "one-node", "--launcher", "torchrun"]
    argv += ["--hub", "tcp://127.0.0.1:9", "--yes"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "FROM TELEMETRY" in out  # the plan was shown, saying so
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("rankscope: error: refusing to run")
    assert "[rerun] allow" in lines[0] and f"--script '{SCRIPT}'" in lines[0]
    assert not (rec / "reruns").exists(), "something was started or written"


def test_yes_with_another_script_in_the_allow_list_still_refuses(
    tmp_path, capsys, isolated_config
) -> None:
    isolated_config.write_text('[rerun]\nallow = ["/shared/approved/*.py"]\n')
    rec = torch_recording(tmp_path / "rec")
    argv = ["rerun", str(rec), "--scope", "one-node", "--launcher", "torchrun"]
    assert main([*argv, "--hub", "tcp://127.0.0.1:9", "--yes"]) == 2
    assert "refusing to run" in capsys.readouterr().err
    assert not (rec / "reruns").exists()


def test_bad_allow_list_is_an_error_naming_the_key(tmp_path, capsys, isolated_config) -> None:
    isolated_config.write_text('[rerun]\nallow = "train.py"\n')
    rec = torch_recording(tmp_path / "rec")
    argv = ["rerun", str(rec), "--scope", "one-node", "--hub", "tcp://127.0.0.1:9", "--yes"]
    assert main(argv) == 2
    assert "rerun.allow must be a list of strings" in capsys.readouterr().err


def test_tui_rerun_screen_marks_telemetry_and_refuses_y(tmp_path, monkeypatch) -> None:
    from tui_pilot import settle

    from rankscope.tui.app import make_app
    from rankscope.tui.rerun_context import RerunContext, session_of
    from rankscope.tui.rerun_screen import RerunScreen
    from rankscope.tui.settings import deterministic_settings
    from rankscope.tui.sources import RecordingSource

    monkeypatch.chdir(tmp_path)
    rec = torch_recording(tmp_path / "rec")
    app = make_app(deterministic_settings(), RecordingSource(rec, follow=False))
    ctx = RerunContext(hub="tcp://127.0.0.1:9", record=rec, launcher="torchrun")

    async def scenario() -> tuple[str, str]:
        async with app.run_test(size=(140, 44)) as pilot:
            await settle(app, pilot)
            menu = RerunScreen(ctx)
            app.push_screen(menu)
            await pilot.pause(0.1)
            await pilot.press("n")
            deadline = time.monotonic() + 60
            while (menu.result is None or menu.planning) and time.monotonic() < deadline:
                await pilot.pause(0.05)
            assert menu.result is not None and menu.result.launch is not None, menu.result
            body = str(menu.query_one("#body").render())
            await pilot.press("y")
            await pilot.pause(0.2)
            assert isinstance(app.screen, RerunScreen)  # not launched: still open
            assert not session_of(app).running
            return body, str(menu.query_one("#status").render())

    body, status = asyncio.run(scenario())
    assert "program comes from:" in body and "FROM TELEMETRY" in body
    assert status.startswith("refusing to run") and "[rerun] allow" in status
    assert "--script" not in status  # the menu has no flag: the allow-list is the way
    assert not (rec / "reruns").exists()
