"""Clock-offset estimation against an in-process fake hub ROUTER with a known offset."""

from __future__ import annotations

import socket
import threading
import time

import msgpack
import pytest
import zmq

from rankscope.collector.clock import FALLBACK_ERROR_NS, ClockSync, clock_endpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeHub:
    """A ROUTER answering pings with ``monotonic_ns() + offset``, after ``delay_s``."""

    def __init__(self, ctx: zmq.Context, port: int, offset_ns: int, delay_s: float = 0.0):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.port = port
        self.offset_ns = offset_ns
        self.delay_s = delay_s
        self.answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, data = self.sock.recv_multipart()
            msg = msgpack.unpackb(data)
            if self.delay_s:
                time.sleep(self.delay_s)
            # Stamped after the delay: a one-sided delay, the worst case for the NTP bound.
            t_hub = time.monotonic_ns() + self.offset_ns
            reply = {"v": 1, "t0": msg["t0"], "t_hub": t_hub}
            self.sock.send_multipart([ident, msgpack.packb(reply)])
            self.answered += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def _drive(clock: ClockSync, until: float, want_answers: int) -> None:
    poller = zmq.Poller()
    assert clock.socket is not None
    poller.register(clock.socket, zmq.POLLIN)
    while time.monotonic() < until and clock.answered < want_answers:
        wait_ms = max(0, (clock.next_due_ns() - time.monotonic_ns()) // 1_000_000)
        poller.poll(min(wait_ms, 50))
        clock.tick()


@pytest.mark.parametrize("offset_ns", [0, 123_456_789_000, -5_000_000_000_000])
def test_known_offset_recovered_within_rtt_bound(offset_ns: int) -> None:
    ctx = zmq.Context()
    port = _free_port()
    hub = FakeHub(ctx, port, offset_ns)
    clock = ClockSync(f"tcp://127.0.0.1:{port}", context=ctx, burst=8)
    try:
        assert not clock.synced and clock.error_ns == FALLBACK_ERROR_NS
        _drive(clock, time.monotonic() + 10, want_answers=8)
        assert clock.synced
        assert clock.answered >= 8
        # The estimate is within the stated error (half the best round trip) of the truth.
        assert abs(clock.offset_ns - offset_ns) <= clock.error_ns
        assert clock.error_ns < 50_000_000
        assert clock.to_hub(1000) == 1000 + clock.offset_ns
    finally:
        clock.close()
        hub.close()
        ctx.term()


def test_delayed_replies_raise_the_stated_error() -> None:
    ctx = zmq.Context()
    port = _free_port()
    hub = FakeHub(ctx, port, offset_ns=42_000_000, delay_s=0.02)
    clock = ClockSync(f"tcp://127.0.0.1:{port}", context=ctx, burst=3)
    try:
        _drive(clock, time.monotonic() + 10, want_answers=3)
        assert clock.synced
        assert clock.error_ns >= 10_000_000  # rtt >= 20 ms
        # The hub stamp lies somewhere inside the round trip, so half of it bounds the error.
        assert abs(clock.offset_ns - 42_000_000) <= clock.error_ns
    finally:
        clock.close()
        hub.close()
        ctx.term()


def test_smallest_round_trip_sample_wins() -> None:
    clock = ClockSync(None, now=lambda: 0)
    clock.add_sample(t0=0, t1=1_000_000, t_hub=5_000_000)  # rtt 1 ms, offset 4.5 ms
    clock.add_sample(t0=2_000_000, t1=2_000_100, t_hub=7_000_050)  # rtt 100 ns, offset 5 ms
    clock.add_sample(t0=3_000_000, t1=8_000_000, t_hub=0)  # rtt 5 ms, far off
    assert clock.offset_ns == 5_000_000
    assert clock.error_ns == 50


def test_stale_samples_leave_the_window() -> None:
    clock = ClockSync(None, window_s=1.0)
    clock.add_sample(t0=0, t1=100, t_hub=1_000)  # best rtt, but old
    clock.add_sample(t0=5_000_000_000, t1=5_000_010_000, t_hub=5_000_005_000 + 77)
    assert clock.offset_ns == 77
    assert clock.error_ns == 5_000


def test_no_hub_keeps_fallback_and_never_blocks() -> None:
    ctx = zmq.Context()
    clock = ClockSync(f"tcp://127.0.0.1:{_free_port()}", context=ctx, timeout_s=0.05)
    try:
        t0 = time.monotonic()
        for _ in range(200):
            clock.tick()
        assert time.monotonic() - t0 < 5  # generous: ticks are non-blocking
        assert not clock.synced
        assert clock.error_ns == FALLBACK_ERROR_NS
        # The fallback is the wall clock: within a second of time.time_ns().
        assert abs(clock.to_hub(time.monotonic_ns()) - time.time_ns()) < 1_000_000_000
    finally:
        clock.close()
        ctx.term()


def test_garbage_and_stale_replies_are_ignored() -> None:
    clock = ClockSync(None)
    clock._outstanding = 10
    clock._on_reply(b"\xc1garbage", 20)
    clock._on_reply(msgpack.packb({"v": 1, "t0": 9, "t_hub": 100}), 20)  # not outstanding
    clock._on_reply(msgpack.packb({"v": 2, "t0": 10, "t_hub": 100}), 20)  # wrong version
    assert not clock.synced
    clock._on_reply(msgpack.packb({"v": 1, "t0": 10, "t_hub": 115}), 20)
    assert clock.synced and clock.offset_ns == 100 and clock.error_ns == 5


def test_clock_endpoint_convention() -> None:
    assert clock_endpoint("tcp://10.1.2.3:5555") == "tcp://10.1.2.3:5556"
    assert clock_endpoint("tcp://[::1]:7000") == "tcp://[::1]:7001"
    assert clock_endpoint("ipc:///tmp/hub") == "ipc:///tmp/hub.clock"
    assert clock_endpoint("inproc://hub") is None
    for bad in ("tcp://host", "tcp://host:port", "tcp://host:65535", "nonsense"):
        with pytest.raises(ValueError, match="endpoint"):
            clock_endpoint(bad)


def test_restart_forgets_the_old_hub_and_learns_the_new_offset() -> None:
    # A hub restarted on another machine has another clock: its first answers must win
    # even when the old hub's samples had a smaller round trip.
    ctx = zmq.Context()
    port = _free_port()
    old = FakeHub(ctx, port, offset_ns=0)
    clock = ClockSync(f"tcp://127.0.0.1:{port}", context=ctx, burst=4, resync_s=3600)
    try:
        _drive(clock, time.monotonic() + 10, want_answers=4)
        assert abs(clock.offset_ns) <= clock.error_ns
        old.close()
        new = FakeHub(ctx, _free_port(), offset_ns=7_000_000_000_000, delay_s=0.002)
        try:
            clock.socket.disconnect(f"tcp://127.0.0.1:{port}")  # type: ignore[union-attr]
            clock.socket.connect(f"tcp://127.0.0.1:{new.port}")  # type: ignore[union-attr]
            before = clock.answered
            clock.restart()
            assert clock.next_due_ns() <= time.monotonic_ns()  # pings again at once
            _drive(clock, time.monotonic() + 10, want_answers=before + 4)
            assert clock.answered >= before + 4
            assert abs(clock.offset_ns - 7_000_000_000_000) <= clock.error_ns
        finally:
            new.close()
    finally:
        clock.close()
        ctx.term()
