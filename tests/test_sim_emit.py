"""The simulator's `Emitter` waits for room through `Sender.send(timeout_ms, cancel)`: a
message counts as dropped only when the wait ran out or was cancelled, and every wait that
found room counts as a retry."""

from __future__ import annotations

import threading

import zmq

from rankscope.collector.sender import Sender
from rankscope.sim.emit import Emitter


def test_a_full_queue_with_no_hub_drops_after_the_wait(no_hub: str) -> None:
    ctx = zmq.Context()
    try:
        sender = Sender(no_hub, hwm=1, context=ctx, linger_ms=0)
        emit = Emitter([sender], timeout_s=0.02, stop=None)
        for _ in range(4):
            emit.send(0, b"m" * 16)
        # Nothing ever reads: the queue takes its high-water mark (one message) whatever
        # the state of the connection attempts, and no wait can find room after that.
        assert (emit.messages, emit.dropped) == (1, 3)
        assert emit.dropped == sender.dropped and emit.retries == sender.waited == 0
    finally:
        # destroy, not term: term would wait for ever on a socket a failed assertion
        # left open.
        ctx.destroy(linger=0)


def test_a_slow_receiver_gets_everything_and_waits_count_as_retries() -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 1)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    got: list[bytes] = []
    n = 200
    start = threading.Event()

    def receive() -> None:
        start.wait(10)
        while len(got) < n and pull.poll(10_000):
            got.append(pull.recv())

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    try:
        senders = [Sender(f"tcp://127.0.0.1:{port}", hwm=1, context=ctx) for _ in range(2)]
        emit = Emitter(senders, timeout_s=30.0, stop=None)
        payload = b"x" * 100_000  # larger than the socket buffers: the queues fill up
        for i in range(n):
            if i == 20:
                start.set()
            emit.send(i, payload)
        start.set()
        t.join(30)
        assert len(got) == n and emit.messages == n and emit.dropped == 0
        assert emit.retries == sum(s.waited for s in senders) > 0
        assert emit.bytes == n * len(payload)
    finally:
        ctx.destroy(linger=0)


def test_stop_cancels_the_wait_and_counts_a_drop(no_hub: str) -> None:
    ctx = zmq.Context()
    try:
        sender = Sender(no_hub, hwm=1, context=ctx, linger_ms=0)
        stop = threading.Event()
        # A wait this long would outlast the test run: only the stop event ends it.
        emit = Emitter([sender], timeout_s=3600.0, stop=stop)
        emit.send(0, b"first")  # queued: the queue holds one message
        stop.set()
        emit.send(0, b"second")
        assert (emit.messages, emit.dropped) == (1, 1)
    finally:
        ctx.destroy(linger=0)
