"""The sender never blocks: with no hub it drops and counts; with a hub the data arrives."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import zmq

from rankscope.collector.sender import Sender, check_endpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pull(ctx: zmq.Context, port: int) -> zmq.Socket:
    # ZeroMQ releases a closed socket's port asynchronously: retry the bind for a while.
    for _ in range(200):
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(f"tcp://127.0.0.1:{port}")
            return sock
        except zmq.ZMQError:
            sock.close()
            time.sleep(0.025)
    raise RuntimeError(f"port {port} stayed busy")


def _recv_all(sock: zmq.Socket, n: int, timeout_ms: int = 5000) -> list[bytes]:
    out: list[bytes] = []
    while len(out) < n and sock.poll(timeout_ms):
        out.append(sock.recv())
    return out


def test_no_hub_drops_beyond_hwm_and_never_blocks(no_hub: str) -> None:
    with Sender(no_hub, hwm=10, linger_ms=0) as s:
        results = [s.send(b"x" * 100) for _ in range(1000)]
    assert s.sent + s.dropped == 1000
    assert s.dropped >= 1000 - 20  # at most the HWM (plus ZMQ's pipe slack) is queued
    assert s.dropped_bytes == 100 * s.dropped
    assert results.count(False) == s.dropped


def test_messages_arrive_in_order() -> None:
    ctx = zmq.Context()
    port = _free_port()
    pull = _pull(ctx, port)
    try:
        with Sender(f"tcp://127.0.0.1:{port}", context=ctx) as s:
            for i in range(200):
                assert s.send(i.to_bytes(4, "little"))
            got = _recv_all(pull, 200)
        assert [int.from_bytes(b, "little") for b in got] == list(range(200))
        assert s.sent == 200 and s.dropped == 0
    finally:
        pull.close()
        ctx.term()


def test_late_hub_receives_queued_messages() -> None:
    ctx = zmq.Context()
    port = _free_port()
    s = Sender(f"tcp://127.0.0.1:{port}", hwm=100, context=ctx)
    for i in range(5):
        s.send(bytes([i]))
    pull = _pull(ctx, port)
    try:
        got = _recv_all(pull, 5)
        assert got == [bytes([i]) for i in range(5)]
    finally:
        s.close(linger_ms=0)
        pull.close()
        ctx.term()


def test_hub_restart_on_same_port_receives_again() -> None:
    ctx = zmq.Context()
    port = _free_port()
    pull = _pull(ctx, port)
    s = Sender(f"tcp://127.0.0.1:{port}", context=ctx)
    try:
        s.send(b"before")
        assert _recv_all(pull, 1) == [b"before"]
        pull.close()
        pull = _pull(ctx, port)
        # Messages sent while the connection re-establishes may be lost; keep sending
        # until one arrives, which proves the reconnect.
        got: list[bytes] = []
        for _ in range(100):
            s.send(b"after")
            got = _recv_all(pull, 1, timeout_ms=100)
            if got:
                break
        assert got == [b"after"]
    finally:
        s.close(linger_ms=0)
        pull.close()
        ctx.term()


def test_send_after_close_is_counted_not_raised() -> None:
    s = Sender(f"tcp://127.0.0.1:{_free_port()}", linger_ms=0)
    s.close()
    assert s.closed
    assert s.send(b"abc") is False
    assert s.dropped == 1 and s.dropped_bytes == 3
    s.close()  # closing twice is harmless


@pytest.mark.parametrize(
    "bad", ["", "localhost:5555", "tcp://", "http://x:1", 5555, "tcp://*:5555", "tcp://0.0.0.0:1"]
)
def test_bad_endpoint_is_named(bad: object) -> None:
    with pytest.raises(ValueError, match="endpoint"):
        check_endpoint(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("hwm", [0, -1, True, 1.5])
def test_bad_hwm(hwm: object) -> None:
    with pytest.raises(ValueError, match="hwm"):
        Sender("tcp://127.0.0.1:1", hwm=hwm)  # type: ignore[arg-type]


def test_unresolvable_tcp_address_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cannot connect"):
        Sender("tcp://:not-a-port")


def test_timeout_waits_for_a_late_hub_instead_of_dropping() -> None:
    ctx = zmq.Context()
    port = _free_port()
    n, hwm = 300, 5
    got: list[bytes] = []

    def late_hub() -> None:
        time.sleep(0.3)  # the sender fills its queue (hwm) and has to wait for this hub
        pull = _pull(ctx, port)
        got.extend(_recv_all(pull, n))
        pull.close()

    reader = threading.Thread(target=late_hub)
    reader.start()
    s = Sender(f"tcp://127.0.0.1:{port}", hwm=hwm, context=ctx)
    try:
        results = [s.send(i.to_bytes(4, "little"), timeout_ms=20_000) for i in range(n)]
        reader.join(30)
    finally:
        s.close(linger_ms=0)
        ctx.term()
    assert all(results)
    assert s.sent == n and s.dropped == 0 and s.dropped_bytes == 0
    assert s.waited >= 1  # the queue was full at least once: the wait is what saved them
    assert [int.from_bytes(b, "little") for b in got] == list(range(n))


def test_timeout_that_runs_out_counts_one_drop(no_hub: str) -> None:
    with Sender(no_hub, hwm=2, linger_ms=0) as s:
        while s.send(b"fill"):  # no hub: fills the queue, then drops once
            pass
        before = s.dropped
        assert s.send(b"late", timeout_ms=50) is False
        assert s.dropped == before + 1
        assert s.dropped_bytes == 4 * (before + 1)
        assert s.waited == 0


def test_cancel_ends_a_wait_and_counts_the_drop(no_hub: str) -> None:
    cancel = threading.Event()
    with Sender(no_hub, hwm=1, linger_ms=0) as s:
        while s.send(b"fill"):
            pass
        before = s.dropped
        out: list[bool] = []
        waiter = threading.Thread(
            target=lambda: out.append(s.send(b"x", timeout_ms=600_000, cancel=cancel))
        )
        waiter.start()
        time.sleep(0.1)
        cancel.set()
        waiter.join(30)
        assert not waiter.is_alive(), "a cancelled wait did not end"
        assert out == [False]
        assert s.dropped == before + 1
        assert s.send(b"y", timeout_ms=600_000, cancel=cancel) is False  # already set
        assert s.dropped == before + 2


def test_default_send_never_waits_even_when_full(no_hub: str) -> None:
    # The collector's path: a full queue drops at once, the poller is never created.
    with Sender(no_hub, hwm=1, linger_ms=0) as s:
        results = [s.send(b"z") for _ in range(50)]
        assert results.count(False) == s.dropped >= 40
        assert s._poller is None and s.waited == 0
