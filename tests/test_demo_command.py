"""``rankscope demo`` as a new user meets it: it records by default, so the rerun menu,
the experiment form and ctrl+s work in the plain demo; quitting stops it cleanly and says
what reached the hub; ``--hub`` sends the simulated cluster to a hub already running, and
the README's walk-through runs as written."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

import rankscope.commands.demo as demo
import rankscope.sim.emit as sim_emit
from rankscope.cli import main
from rankscope.collector.sender import Sender
from rankscope.hub.inspection import inspect_recording
from rankscope.hub.replay import load
from rankscope.hub.server import Hub
from rankscope.sim import load_scenario
from rankscope.sim import run as sim_run

README = Path(__file__).resolve().parents[1] / "README.md"
HANG_S = 240
"""A subprocess that runs this long has hung (a hang detector, not a timing claim)."""


def _json_out(capsys) -> dict[str, Any]:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_plain_demo_records_to_a_temporary_folder_it_names(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    argv = ["demo", "--headless", "--scenario", "slow-device", "--ranks", "16", "--steps", "3"]
    assert main([*argv, "--json"]) == 0
    out = _json_out(capsys)
    rec = Path(out["record"])
    assert rec.parent == tmp_path and rec.name.startswith(demo.RECORD_PREFIX)
    assert load(rec).window(out["run"]).steps.tolist() == [0, 1, 2]
    assert out["sent"] == out["reached_hub"] == out["messages"] and out["lost"] == 0

    assert main([*argv]) == 0  # the plain summary names the folder and how to reopen it
    text = capsys.readouterr().out
    (named,) = re.findall(r"^recording: (\S+)$", text, re.M)
    assert f"rankscope open {named}" in text and (Path(named) / "meta.json").exists()

    before = sorted(tmp_path.iterdir())
    assert main([*argv, "--no-record", "--json"]) == 0
    assert _json_out(capsys)["record"] is None and sorted(tmp_path.iterdir()) == before


def test_ranks_default_to_what_the_scenario_says(tmp_path, capsys) -> None:
    argv = ["demo", "--headless", "--steps", "1", "--no-record", "--json"]
    assert main([*argv]) == 0  # the worked example, as the README describes it
    assert _json_out(capsys)["world_size"] == load_scenario("seed-example").world_size == 512
    assert main([*argv, "--scenario", "slow-device", "--ranks", "16"]) == 0
    assert _json_out(capsys)["world_size"] == 16


def test_bind_in_use_is_one_line_and_exit_2(capsys) -> None:
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PULL)
    try:
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        bind = f"tcp://127.0.0.1:{port}"
        assert main(["demo", "--headless", "--no-record", "--bind", bind]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "in use" in err and f"--hub {bind}" in err
    finally:
        taken.close(0)
        ctx.term()


def test_hub_excludes_a_recording_of_its_own(capsys) -> None:
    argv = ["demo", "--headless", "--hub", "tcp://127.0.0.1:1", "--record", "x"]
    assert main(argv) == 2
    assert "--record" in capsys.readouterr().err


def _stopped_run_delivery(
    folder: Path, stop_linger_s: float, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, int, bool]:
    """Stop a simulated run while its hub is behind, and count what reaches the hub.

    The hub reads nothing until the run is stopped, which happens once one of the run's
    sends has found the queue full and waited for a second (the run is stuck, not merely
    slow: a starved machine can pause a run without filling anything); from that moment
    the hub reads slowly (a millisecond a message), so the queues are still full when the
    run closes its sockets: with no linger their contents are lost.

    Returns:
        (messages the run counts as sent, messages the hub received, whether the run was
        seen stuck on a full queue before it was stopped).
    """
    waiting_since: list[float | None] = [None]

    class Watched(Sender):
        def _wait_and_send(self, sock, data, timeout_ms, cancel):  # type: ignore[no-untyped-def]
            waiting_since[0] = time.monotonic()
            try:
                return super()._wait_and_send(sock, data, timeout_ms, cancel)
            finally:
                waiting_since[0] = None

    monkeypatch.setattr(sim_emit, "Sender", Watched)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    endpoint = f"ipc://{folder}/hub.sock"
    pull.bind(endpoint)
    stop, done = threading.Event(), threading.Event()
    got = [0]
    stuck = [False]

    def hub() -> None:
        stop.wait()
        while not done.is_set():
            if pull.poll(50):
                pull.recv()
                got[0] += 1
                time.sleep(0.001)

    def stop_when_stuck() -> None:
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline and not stop.is_set():
            since = waiting_since[0]
            if since is not None and time.monotonic() - since >= 1.0:
                stuck[0] = True
                break
            time.sleep(0.05)
        stop.set()

    reader = threading.Thread(target=hub, daemon=True)
    reader.start()
    stopper = threading.Thread(target=stop_when_stuck, daemon=True)
    stopper.start()
    try:
        info = sim_run(
            load_scenario("slow-device", ranks=16),
            endpoint,
            10**6,
            hwm=50,
            send_timeout_s=HANG_S,
            stop=stop,
            stop_linger_s=stop_linger_s,
        )
        deadline = time.monotonic() + HANG_S
        while got[0] < info.messages and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # anything beyond what was counted would show here
        return info.messages, got[0], stuck[0]
    finally:
        stop.set()
        done.set()
        stopper.join(HANG_S)
        reader.join(HANG_S)
        pull.close(0)
        ctx.term()


def test_a_stopped_run_s_queued_messages_still_reach_the_hub(monkeypatch) -> None:
    # What the demo's quit does (`start_demo(stop_linger_s=QUIT_WAIT_S)`): everything the
    # run counts as sent reaches the hub, though its queues were full when it stopped.
    with tempfile.TemporaryDirectory(prefix="rs-") as folder:  # short: ipc path limit
        sent, received, stuck = _stopped_run_delivery(Path(folder), HANG_S, monkeypatch)
    assert stuck  # the hub was behind: messages were queued when the run stopped
    assert received == sent


def test_plain_tui_demo_snapshots_plans_records_and_quits_cleanly(
    tmp_path, monkeypatch, capsys
) -> None:
    """The TUI is driven headless through the same path as ``rankscope demo`` (only the
    terminal is replaced): no ``--record``, yet every headline feature works."""
    from rankscope.snapshot import open_snapshot
    from rankscope.tui.experiment_screen import ExperimentScreen
    from rankscope.tui.main_screen import MainScreen
    from rankscope.tui.rerun_screen import RerunScreen
    from rankscope.tui.settings import deterministic_settings
    from rankscope.tui.sources import RecordingSource

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(
        "rankscope.tui.settings.load_settings",
        lambda config=None: deterministic_settings(tmp_path / "state"),
    )
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    seen: dict[str, Any] = {}

    async def until(pilot, cond, what: str) -> None:
        deadline = time.monotonic() + HANG_S
        while not cond():
            if time.monotonic() > deadline:
                notes = [n.message for n in pilot.app._notifications]
                raise AssertionError(f"timed out waiting for {what}; notifications {notes}")
            await pilot.pause(0.05)

    async def script(pilot) -> None:
        app = pilot.app
        try:
            await until(
                pilot,
                lambda: (
                    app.model is not None
                    and app.model.window is not None
                    and app.model.window.steps.size >= 2
                ),
                "two steps on screen",
            )
            await pilot.press("ctrl+s")
            await until(
                pilot,
                lambda: any(
                    (p / "snapshot.json").exists() for p in work.iterdir() if p.name[0] != "."
                ),
                "the snapshot bundle",
            )
            seen["bundle"] = next(p for p in work.iterdir() if p.name[0] != ".")
            await pilot.press("r")
            await until(pilot, lambda: isinstance(app.screen, RerunScreen), "the rerun menu")
            menu = app.screen
            await pilot.press("n")
            await until(pilot, lambda: menu.result is not None and not menu.planning, "a plan")
            seen["plan"] = (menu.result.launch is not None, menu.result.error)
            await pilot.press("escape")
            await until(pilot, lambda: isinstance(app.screen, MainScreen), "the main screen")
            await pilot.press("e")
            await until(pilot, lambda: isinstance(app.screen, ExperimentScreen), "the form")
            form = app.screen
            await until(pilot, lambda: form.suggested, "the suggested experiment")
            await pilot.press("ctrl+s")
            record = Path(app.source.hub.record_dir)
            await until(
                pilot, lambda: list(record.glob("experiments/*.json")), "the experiment record"
            )
            seen["experiments"] = sorted(p.name for p in record.glob("experiments/*.json"))
            await pilot.press("escape")
            await until(pilot, lambda: isinstance(app.screen, MainScreen), "the main screen")
        except BaseException as exc:
            seen["error"] = exc
        await pilot.press("q")

    real = demo.run_app
    monkeypatch.setattr(
        demo, "run_app", lambda app: real(app, headless=True, size=(120, 40), auto_pilot=script)
    )
    argv = ["demo", "--view", "tui", "--scenario", "network-rail", "--ranks", "16"]
    rc = main([*argv, "--baseline-steps", "4", "--json"])
    if "error" in seen:
        raise seen["error"]
    out = _json_out(capsys)
    assert rc == 0 and out["stopped"] is True  # quitting is not an error
    assert Path(out["record"]).parent == tmp_path
    assert out["sent"] == out["reached_hub"] and out["lost"] == 0 and out["dropped"] == 0
    assert seen["plan"] == (True, "")  # launchable: a hub to report to, a recording beside
    assert len(seen["experiments"]) == 1

    opened = open_snapshot(seen["bundle"])  # what `rankscope open BUNDLE` reads
    content = json.loads((seen["bundle"] / "snapshot.json").read_text())
    assert content["reopen"] == f"rankscope open {seen['bundle']}"
    assert opened.recording is not None and (opened.recording / "meta.json").exists()
    source = RecordingSource(opened.recording, follow=False)
    source.start()
    try:
        assert source.window(opened.view.run, 8) is not None
    finally:
        source.stop()


def _walkthrough() -> list[str]:
    """The README's "simulated walk through" commands, as printed there."""
    text = README.read_text()
    block = text.split("A simulated walk through:", 1)[1].split("\n\n", 2)[1]
    return [line.strip() for line in block.splitlines() if line.strip()]


def _argv(command: str) -> list[str]:
    words = shlex.split(command)
    assert words[0] == "rankscope", command
    return [sys.executable, "-m", "rankscope", *words[1:]]


def _until_recorded(rec: Path, frames: int) -> None:
    """Wait until the hub has written ``frames`` messages to its recording (it flushes
    every half second; a person typing the next command gives it that time)."""
    deadline = time.monotonic() + HANG_S
    while inspect_recording(rec)["frames"] < frames:
        assert time.monotonic() < deadline, f"the hub did not record {frames} messages"
        time.sleep(0.1)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_readme_walkthrough_runs_as_written(tmp_path) -> None:
    hub_cmd, demo_cmd, rerun_cmd, ladder_cmd = _walkthrough()
    assert hub_cmd.endswith(" &") and "--headless" in demo_cmd and "--hub" in demo_cmd
    readme_ep = re.search(r"--bind (\S+)", hub_cmd).group(1)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # The one change: a free port instead of the README's fixed one, which may be taken.
    hub = subprocess.Popen(
        _argv(hub_cmd[:-2].replace(readme_ep, "tcp://127.0.0.1:0")),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert hub.stdout is not None
        line = ""
        while "rankscope hub on" not in line:
            line = hub.stdout.readline()
            assert line, "the hub exited before listening"
        endpoint = re.search(r"rankscope hub on (tcp://\S+)", line).group(1)

        def run(command: str, *extra: str) -> subprocess.CompletedProcess[str]:
            done = subprocess.run(
                [*_argv(command.replace(readme_ep, endpoint)), *extra],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=HANG_S,
                env=env,
            )
            assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
            return done

        out = json.loads(run(demo_cmd, "--json").stdout.strip().splitlines()[-1])
        assert out["hub"] == endpoint and out["dropped"] == 0 and out["record"] is None
        rec = tmp_path / "rec"
        _until_recorded(rec, out["sent"])
        run(rerun_cmd)
        shown = run(ladder_cmd).stdout
        assert "smallest measured scope with the regression: two-node" in shown
        ladder = json.loads(run(ladder_cmd, "--json").stdout)
        assert ladder["parent_run"] == out["run"] and ladder["first_scope"] == "two-node"
        report = inspect_recording(rec)
        assert {r["run"] for r in report["runs"]} == {out["run"], f"{out['run']}-two-node"}
        assert report["rejects"] == {}
    finally:
        hub.send_signal(signal.SIGINT)
        try:
            hub.wait(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            hub.kill()
            raise


def test_ctrl_c_stops_a_demo_sending_to_a_hub_and_still_counts_what_it_sent(
    monkeypatch, capsys
) -> None:
    # Ctrl-C arrives while the main thread waits for the job (a join with no timeout); no
    # own hub to stop gives the job no extra time to finish before the summary is read.
    real = demo.start_demo

    def start_then_interrupt(*args, **kwargs):
        handles = real(*args, **kwargs)

        def interrupt() -> None:
            deadline = time.monotonic() + HANG_S
            while handles.last_step is None and time.monotonic() < deadline:
                time.sleep(0.02)
            # Delivered to this thread, not the main one, as the kernel may deliver a
            # terminal's Ctrl-C: only Python's flag is set, and the main thread must still
            # wake up to it.
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()
        return handles

    monkeypatch.setattr(demo, "start_demo", start_then_interrupt)
    # Python's own Ctrl-C, whatever an earlier test in this process left installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    hub = Hub(bind="tcp://127.0.0.1:0").start()
    try:
        argv = ["demo", "--hub", hub.endpoint, "--scenario", "slow-device", "--ranks", "16"]
        assert main([*argv, "--baseline-steps", "0", "--json"]) == 0  # the way to stop it
        out = _json_out(capsys)
        assert out["stopped"] is True and out["steps"] is not None and out["dropped"] == 0
        deadline = time.monotonic() + HANG_S
        while hub.health["messages"] < out["sent"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hub.health["messages"] == out["sent"]
    finally:
        signal.signal(signal.SIGINT, previous)
        hub.stop()
