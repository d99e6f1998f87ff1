"""Host evidence the collector records itself: GC pauses per step (``gc.callbacks``), the
training thread's CPU time per phase and step, and the MoE ``expert_tokens`` count.

Rows are read back from the monitor's rings (the pump is told to wait an hour). Times are
compared as ratios and bounds, never against the wall clock, so a loaded machine passes."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from rankscope.collector import gc_pauses
from rankscope.collector.gc_pauses import CLOCK
from rankscope.collector.identity import Identity
from rankscope.collector.monitor import Monitor

SLACK_NS = 2_000_000
"""Clock reads at a span's ends are not simultaneous: CPU may exceed wall by this much."""


def _monitor() -> Monitor:
    m = Monitor(
        job="j",
        run="r",
        identity=Identity(rank=0, world_size=1, local_rank=0, host="h", node_rank=0, pid=1),
        hub="tcp://127.0.0.1:9",  # nobody listens: sends are dropped, never waited for
        flush_interval_s=3600,  # rows stay in the rings for the test to read
        sample_interval_s=0,
        clock_sync=False,
    ).start()
    end = time.monotonic() + 20
    while m.pump.cpu_s == 0.0 and time.monotonic() < end:  # the pump's first pass
        time.sleep(0.005)
    return m


@pytest.fixture
def mon():
    m = _monitor()
    yield m
    m.close(timeout_s=0.2)


@pytest.fixture
def no_auto_gc():
    """Only the collections a test asks for (``gc.collect`` still runs the callbacks)."""
    was = gc.isenabled()
    gc.disable()
    yield
    if was:
        gc.enable()


def _cycles(n: int) -> None:
    for _ in range(n):
        a: list = []
        a.append(a)


def test_a_collection_inside_a_step_is_in_that_step_only(mon: Monitor, no_auto_gc) -> None:
    mon.begin_step(0)
    _cycles(20_000)
    gc.collect()
    mon.end_step()
    mon.begin_step(1)
    _cycles(100)
    mon.end_step()
    mon.begin_step(2)
    gc.collect()
    gc.collect(0)
    mon.end_step()
    rows = mon._steps.unread()
    assert rows["step"].tolist() == [0, 1, 2]
    assert rows["gc_count"].tolist() == [1, 0, 2]
    gc_ns = rows["gc_ns"]
    assert gc_ns[0] > 0 and gc_ns[1] == 0 and gc_ns[2] > 0
    wall = rows["t_end"] - rows["t_start"]
    assert (gc_ns <= wall).all()  # a pause inside a step is shorter than the step


def test_the_callback_is_registered_once_per_process_and_removed_on_close() -> None:
    def ours() -> int:
        return sum(cb is CLOCK for cb in gc.callbacks)

    users = CLOCK.users  # a monitor another test left open would hold it too
    assert ours() == (1 if users else 0)
    a, b = _monitor(), _monitor()
    try:
        assert ours() == 1 and CLOCK.users == users + 2
        a.close(timeout_s=0.2)
        assert ours() == 1  # b still counts its steps' pauses
    finally:
        a.close(timeout_s=0.2)
        b.close(timeout_s=0.2)
    assert CLOCK.users == users and ours() == (1 if users else 0)


def test_the_callback_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = gc_pauses.GcClock()
    clock("stop", {})  # a stop without its start (registered mid-collection): ignored
    assert clock.count == 0 and clock.errors == 0

    def broken() -> int:
        raise OSError("no clock")

    monkeypatch.setattr(gc_pauses, "_mono", broken)
    clock("start", {"generation": 0})
    assert clock.errors == 1
    gc.callbacks.append(clock)
    try:
        gc.collect()  # the program's own collection goes on undisturbed
    finally:
        gc.callbacks.remove(clock)
    assert clock.errors >= 2


def test_steps_without_the_callback_report_gc_unknown(mon: Monitor) -> None:
    mon._gc = False  # as where gc.callbacks could not be used
    with mon.step(0):
        pass
    row = mon._steps.unread()[0]
    assert row["gc_ns"] == -1 and row["gc_count"] == -1 and row["cpu_ns"] >= 0
    mon._gc = True


def _busy(cpu_ns: int) -> None:
    c0 = time.thread_time_ns()
    while time.thread_time_ns() - c0 < cpu_ns:
        pass


def test_phase_cpu_time_of_a_sleep_is_small_and_of_a_busy_loop_near_its_wall(
    mon: Monitor,
) -> None:
    with mon.step(0):
        with mon.phase("input"):
            time.sleep(0.05)
        with mon.phase("forward"):
            _busy(30_000_000)
    ph = mon._phases.unread()
    wall = ph["t1"] - ph["t0"]
    cpu = ph["cpu_ns"]
    sleep, busy = 0, 1
    assert cpu[sleep] >= 0 and cpu[sleep] < 0.2 * wall[sleep]
    # The busy loop ran 30 ms of the thread's CPU: all of it is in the span, and no more
    # than the span's wall time (ratio, whatever the machine's load).
    assert 30_000_000 <= cpu[busy] <= wall[busy] + SLACK_NS
    assert cpu[busy] / wall[busy] > 5 * cpu[sleep] / wall[sleep]
    step = mon._steps.unread()[0]
    step_wall = step["t_end"] - step["t_start"]
    assert cpu.sum() <= step["cpu_ns"] <= step_wall + SLACK_NS


def test_a_step_ended_on_another_thread_reports_cpu_unknown(mon: Monitor) -> None:
    mon.begin_step(0)
    t = threading.Thread(target=mon.end_step)
    t.start()
    t.join()
    assert mon._steps.unread()[0]["cpu_ns"] == -1


def test_recorded_phases_and_expert_tokens(mon: Monitor) -> None:
    with mon.step(0):
        mon.work(tokens=10, expert_tokens=300)
        mon.work(expert_tokens=12)
        mon.work(expert_tokens=-4)  # refused and counted
        mon.record_phase("forward", 100, 200, cpu_ns=90)
        mon.record_phase("forward", 300, 400)
        mon.record_phase("forward", 500, 600, cpu_ns=-9)  # refused: kept with cpu unknown
    with mon.step(1):
        pass
    rows = mon._steps.unread()
    assert rows["expert_tokens"].tolist() == [312, -1]
    assert rows["tokens"].tolist() == [10, -1]
    assert mon._phases.unread()["cpu_ns"].tolist() == [90, -1, -1]
    errors = mon.stats()["errors"]
    assert errors["bad_work"] == 1 and errors["bad_phase"] == 1


def test_an_only_expert_count_still_makes_a_setup_step_a_step(mon: Monitor) -> None:
    mon._auto = True
    mon._auto_touch()
    mon.work(expert_tokens=5)
    assert mon._activity_since_begin()


def test_a_program_that_empties_gc_callbacks_gets_unknown_gc_not_zero(mon: Monitor) -> None:
    with mon.step(0):
        pass
    while CLOCK.registered:
        gc.callbacks.remove(CLOCK)
    assert mon.stats()["errors"]["gc_callback_removed"] == 1  # seen on the pump's next stats
    with mon.step(1):
        gc.collect()
    rows = mon._steps.unread()
    assert rows["gc_count"].tolist()[0] >= 0 and rows["gc_count"].tolist()[1] == -1
    assert rows["cpu_ns"][1] >= 0  # the CPU clock is unaffected


def test_end_to_end_through_the_sender_into_the_store_window(no_auto_gc) -> None:
    from test_collector_monitor import Pull, _monitor

    from rankscope.hub.intake import Intake
    from rankscope.hub.store import Store

    pull = Pull()
    try:
        mon = _monitor(pull.endpoint, identity=Identity(0, 1, 0, "h0", 0, 1))
        with mon.step(0):
            with mon.phase("forward"):
                _busy(5_000_000)
            gc.collect()
        with mon.step(1), mon.phase("input"):
            time.sleep(0.01)
        mon.close()
        store = Store()
        intake = Intake(store)
        raw = []
        while pull.sock.poll(300):
            raw.append(pull.sock.recv())
        for m in raw:
            intake.feed(m)
    finally:
        pull.close()
    w = store.window("r1")
    assert w.steps.tolist() == [0, 1]
    assert w.host["gc_count"][0].tolist() == [1.0, 0.0]
    assert w.host["gc_ns"][0, 0] > 0 and w.host["gc_ns"][0, 1] == 0
    assert w.host["cpu_ns"][0, 0] >= w.phase_cpu_ns["forward"][0, 0] >= 5_000_000
    assert w.phase_cpu_ns["input"][0, 1] < 0.2 * w.phase_ns["input"][0, 1]
    assert store.health["rejects"] == {}
