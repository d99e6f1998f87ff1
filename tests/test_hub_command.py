"""``rankscope hub`` as a process: status lines, clean stop, killed and restarted mid-run."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import zmq
from test_hub_job import assert_windows_equal, job

from rankscope.hub.intake import Intake
from rankscope.hub.replay import load
from rankscope.hub.store import Store


class HubProcess:
    """``rankscope hub`` in a subprocess; collects its stdout lines."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rankscope", "hub", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()
        self.endpoint = self.wait_line(r"rankscope hub on (tcp://\S+)").group(1)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_line(self, pattern: str, timeout: float = 60.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.proc.poll() is not None and not self._t.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no line matching {pattern!r} in {self.lines}")


def send(endpoint: str, messages: list[bytes]) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.connect(endpoint)
    for m in messages:
        s.send(m)
    s.close(linger=10_000)
    ctx.term()


def test_status_lines_and_clean_stop_on_sigterm(tmp_path) -> None:
    j = job(world=4, steps=6, slow=1)
    hub = HubProcess(
        "--bind", "tcp://127.0.0.1:0", "--record", str(tmp_path), "--status-every", "0.2"
    )
    send(hub.endpoint, [*j.messages, b"junk"])
    hub.wait_line(rf"messages {len(j.messages)} \| rejects 1 \(bad_msgpack 1\)")
    line = hub.wait_line(r"runs 1 \| ranks 4/4 \| last step 5").string
    assert "drops 6 batches/60 events" in line
    hub.proc.send_signal(signal.SIGTERM)
    assert hub.proc.wait(timeout=30) == 0
    hub.wait_line(r"^stopped: runs 1")
    live = Store()
    intake = Intake(live)
    for m in j.messages:
        intake.feed(m)
    assert_windows_equal(load(tmp_path).window(j.run), live.window(j.run))


def test_killed_hub_loses_nothing_recorded_and_a_restart_resumes(tmp_path) -> None:
    j = job(world=4, steps=10, slow=2)
    half = len(j.messages) // 2
    first = HubProcess(
        "--bind", "tcp://127.0.0.1:0", "--record", str(tmp_path), "--status-every", "0.1"
    )
    send(first.endpoint, j.messages[:half])
    first.wait_line(rf"messages {half} ")
    # The hub flushes every 0.5 s: wait until the recording holds what it received.
    deadline = time.monotonic() + 30
    while load(tmp_path).health["messages"] < half and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait(timeout=30)
    assert len(load(tmp_path).health["recording"]["skipped"]) == 0
    assert load(tmp_path).health["messages"] == half
    port = first.endpoint.rsplit(":", 1)[1]
    second = HubProcess(
        "--bind", f"tcp://127.0.0.1:{port}", "--record", str(tmp_path), "--status-every", "0.1"
    )
    second.wait_line(rf"resumed {half} messages")
    send(second.endpoint, j.messages[half:])
    second.wait_line(rf"messages {len(j.messages)} \| rejects 0")
    second.proc.send_signal(signal.SIGINT)
    assert second.proc.wait(timeout=30) == 0
    whole = Store()
    intake = Intake(whole)
    for m in j.messages:
        intake.feed(m)
    replayed = load(tmp_path)
    assert replayed.health["recorded"]["sessions"] == 2
    assert_windows_equal(replayed.window(j.run), whole.window(j.run))


def test_bad_bind_is_a_clear_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rankscope", "hub", "--bind", "tcp://127.0.0.1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "needs a port" in proc.stderr


def test_status_line_shows_a_recording_that_falls_behind() -> None:
    from rankscope.commands.hub import BACKLOG_SHOWN, status_line

    store = Store()
    health = {**store.health, "transport": {}}
    assert "behind" not in status_line(health, store)  # not recording
    health["record_backlog_bytes"] = BACKLOG_SHOWN - 1  # within one flush: normal
    assert "behind" not in status_line(health, store)
    health["record_backlog_bytes"] = 40 << 20
    assert status_line(health, store).endswith(" | recording 40 MiB behind")


def test_status_line_counts_what_came_through_relays() -> None:
    from rankscope.commands.hub import status_line

    store = Store()
    health = {**store.health, "transport": {"bundles": 0, "bundled": 0}}
    assert "relayed" not in status_line(health, store)
    health["transport"] = {"bundles": 3, "bundled": 24}
    assert " | relayed 24 in 3 bundles" in status_line(health, store)


def test_status_line_tells_refused_keys_from_refusals_for_the_connection_cap() -> None:
    from rankscope.commands.hub import status_line

    store = Store()
    health = {**store.health, "transport": {"refused": 0, "too_many_connections": 0}}
    assert "refused" not in status_line(health, store)
    health["transport"] = {"refused": 2, "too_many_connections": 5}
    line = status_line(health, store)
    assert " | refused 2 (keys)" in line and " | refused 5 (--max-connections)" in line


def test_a_message_over_max_message_bytes_never_reaches_the_hub() -> None:
    j = job(world=4, steps=3)
    assert max(map(len, j.messages)) < 1 << 20
    hub = HubProcess(
        "--bind",
        "tcp://127.0.0.1:0",
        "--status-every",
        "0.2",
        "--max-message-bytes",
        str(1 << 20),
        "--rcvhwm",
        "64",
    )
    send(hub.endpoint, [b"\x00" * (2 << 20)])  # junk: a bad_msgpack reject if it got in
    send(hub.endpoint, j.messages)
    line = hub.wait_line(rf"messages {len(j.messages)} ").string
    hub.proc.send_signal(signal.SIGTERM)
    assert hub.proc.wait(timeout=30) == 0
    assert "rejects 0" in line, line
    assert not any("bad_msgpack" in x for x in hub.lines), hub.lines


def test_hub_refuses_an_unbounded_receive_queue() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rankscope", "hub", "--bind", "tcp://127.0.0.1:0", "--rcvhwm", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "rcvhwm must be ≥ 1" in proc.stderr
