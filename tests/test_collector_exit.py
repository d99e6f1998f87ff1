"""A process that reports to a hub must exit on its own when the hub is not there.

Each case is a real subprocess: a collector (``rankscope.start``) or the simulator whose
hub is unreachable, accepted the connection and then died, or accepted it and then
stopped reading. ZeroMQ's ``ctx.term()`` waits until every socket of the context is closed
and its linger has run out, so one socket left open, or one with an unbounded linger,
keeps the process from exiting. The subprocess timeout only detects such a hang; no test
here asserts how long an exit takes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HANG_S = 60
"""A process still running this long after it was due to exit is taken to hang."""

TRAINING = """
import os, sys, time
import rankscope
mon = rankscope.start(job="exit-probe", rank=0, world_size=1, instrument_torch=False,
                      flush_interval_s=0.05, hwm=16)
flag = sys.argv[1] if len(sys.argv) > 1 else ""
step = 0
def one_step():
    global step
    with mon.step(step):
        t = time.monotonic_ns()
        for _ in range(20):
            mon.record_collective("all_reduce", 0, nbytes=64, t_enter=t, t_exit=t + 1000)
    step += 1
    time.sleep(0.005)
for _ in range(40):
    one_step()
print("trained", flush=True)
while flag and not os.path.exists(flag):  # the test takes the hub away meanwhile
    one_step()
for _ in range(40):  # steps with the hub gone: their rows queue, then drop
    one_step()
print("done", step, flush=True)
"""

HUB = """
import sys, zmq
ctx = zmq.Context()
pull = ctx.socket(zmq.PULL)
pull.setsockopt(zmq.RCVHWM, 1)
pull.bind("tcp://127.0.0.1:0")
print(pull.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
pull.recv()
print("received", flush=True)
while sys.argv[1] == "read":
    pull.recv()
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _finish(proc: subprocess.Popen[str], what: str) -> str:
    try:
        out, err = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{what} did not exit within {HANG_S} s (hung on exit?):\n{err[-3000:]}")
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{err[-3000:]}"
    return out


def test_training_process_exits_when_the_hub_never_answers(no_hub: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINING],
        env=_env(RANKSCOPE_HUB=no_hub),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out = _finish(proc, "a training process with an unreachable hub")
    assert "done 80" in out


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_training_process_exits_when_its_hub_goes_away(tmp_path: Path, how: str) -> None:
    """The hub accepts the connection and takes the first message, then is killed (the
    connection drops) or stopped (the connection stays up and nobody reads: the queue
    fills and the final flush has nowhere to go)."""
    hub = subprocess.Popen(
        [sys.executable, "-c", HUB, "read"], env=_env(), stdout=subprocess.PIPE, text=True
    )
    flag = tmp_path / "hub-gone"
    train = None
    try:
        assert hub.stdout is not None
        endpoint = hub.stdout.readline().strip()
        assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
        train = subprocess.Popen(
            [sys.executable, "-c", TRAINING, str(flag)],
            env=_env(RANKSCOPE_HUB=endpoint),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # The hub really had the connection: it received a message from the rank.
        assert hub.stdout.readline().strip() == "received"
        hub.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        if how == "killed":
            hub.wait(HANG_S)
        flag.touch()
        out = _finish(train, f"a training process whose hub was {how}")
        assert "trained" in out and "done" in out
    finally:
        for p in (train, hub):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


SIMULATOR = """
import sys
from rankscope.sim import load_scenario, run
info = run(load_scenario("seed-example", ranks=8), sys.argv[1], 3, senders=2, hwm=2,
           send_timeout_s=0.05)
print("sent", info.messages, "dropped", info.dropped, flush=True)
"""


def test_simulator_exits_when_the_hub_never_answers(no_hub: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SIMULATOR, no_hub],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    words = _finish(proc, "a simulator with an unreachable hub").split()
    # Two sockets with a high-water mark of two: four messages queued, the rest dropped.
    assert words[:2] == ["sent", "4"] and words[2] == "dropped" and int(words[3]) > 0


SIMULATOR_FAILING_SENDER = """
import sys
import rankscope.sim.emit as emit
from rankscope.sim import load_scenario

built = []
class Second(emit.Sender):
    def __init__(self, *a, **k):
        if built:
            raise OSError("too many open files")
        super().__init__(*a, **k)
        built.append(self)
emit.Sender = Second
try:
    emit.run(load_scenario("seed-example", ranks=4), sys.argv[1], 1, senders=2)
except OSError as exc:
    print("raised", exc, "first closed", built[0].closed, flush=True)
"""


def test_simulator_exits_when_a_sender_cannot_be_built(no_hub: str) -> None:
    """The first sender is built, the second fails: the run must close the first and end
    its context instead of waiting for that socket for ever."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SIMULATOR_FAILING_SENDER, no_hub],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out = _finish(proc, "a simulator whose second sender failed")
    assert out.strip() == "raised too many open files first closed True"
