"""The run-queue delay: time a thread waited for a core, told from time it chose to wait."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from rankscope.collector import runqueue

pytestmark = pytest.mark.skipif(
    runqueue.wait_ns() < 0, reason="no /proc/thread-self/schedstat on this system"
)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(200))


def test_a_thread_sharing_its_core_waits_and_a_sleeping_one_does_not():
    core = min(os.sched_getaffinity(0))
    spinner = subprocess.Popen(
        [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"]
    )
    out: dict = {}

    def measure() -> None:
        os.sched_setaffinity(0, {core})  # this thread only
        time.sleep(0.3)  # the spinner is running by now
        q0, t0 = runqueue.wait_ns(), time.monotonic_ns()
        _busy(0.4)
        out["busy"] = (runqueue.wait_ns() - q0) / (time.monotonic_ns() - t0)
        q0 = runqueue.wait_ns()
        time.sleep(0.4)
        out["asleep_ns"] = runqueue.wait_ns() - q0

    try:
        t = threading.Thread(target=measure)
        t.start()
        t.join(30)
    finally:
        spinner.kill()
        spinner.wait()
    # Two runnable threads on one core: each waits about half the time (more when the
    # machine is busier still).
    assert out["busy"] > 0.2, out
    # Asleep, the thread is not runnable: only its wake-up can wait for the core.
    assert out["asleep_ns"] < 50e6, out


def test_each_thread_and_a_forked_child_read_their_own_delay():
    main = runqueue.wait_ns()
    _busy(0.05)
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(runqueue.wait_ns()))
    t.start()
    t.join()
    assert main >= 0 and seen[0] >= 0
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's thread is read anew, not through the parent's descriptor
        os.write(w, str(runqueue.wait_ns()).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    assert int(os.read(r, 64)) >= 0
    # The descriptor read after the fork is the parent's own thread still.
    assert runqueue.wait_ns() >= main
