"""Clock-sync client: the offset from this process's monotonic clock to the hub's clock.

Every time on the wire is on the hub-aligned clock (ARCHITECTURE §5). The hot path stamps
events with ``time.monotonic_ns()`` (cheap, never jumps); the encoder adds the offset
estimated here. Estimation is NTP-style: a DEALER socket sends ``{"v": 1, "t0": t0}`` to the
hub's ROUTER, which answers ``{"v": 1, "t0": t0, "t_hub": t_hub}``; with ``t1`` the local
receive time, ``offset = t_hub - (t0 + t1) / 2`` and the error is at most half the round
trip. The sample with the smallest round trip among recent ones is kept, so a queueing
delay on one ping does not move the estimate. Pings are sent one at a time, driven by the
collector's background thread; nothing here ever blocks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import msgpack
import zmq

from rankscope.collector.security import ClientCurve
from rankscope.collector.sender import check_endpoint

CLOCK_VERSION = 1
BURST = 8
"""Pings sent back to back when the client starts."""
RESYNC_S = 10.0
"""Interval between periodic re-sync pings (each a short burst of ``RESYNC_BURST``)."""
RESYNC_BURST = 3
PING_TIMEOUT_S = 0.5
"""A ping without an answer after this long is abandoned (the hub is away)."""
WINDOW_S = 300.0
"""Only samples this recent compete for the best one: the two clocks drift apart slowly."""
FALLBACK_ERROR_NS = 1_000_000_000
"""Stated uncertainty before any ping succeeded: the offset then comes from the host's wall
clock, which agrees with the hub's only as well as NTP keeps the machines together."""


def realtime_minus_monotonic_ns(tries: int = 5) -> int:
    """``CLOCK_REALTIME`` minus ``CLOCK_MONOTONIC`` now, in ns.

    Read as monotonic, realtime, monotonic a few times and taken from the tightest
    bracket: two plain reads in a row are off by however long the thread was kept off its
    core between them (a millisecond on a loaded host).

    Args:
        tries: brackets read.

    Returns:
        The shift: a realtime ns minus it is the monotonic ns of the same moment.
    """
    best, shift = -1, 0
    for _ in range(max(1, tries)):
        m0 = time.monotonic_ns()
        real = time.time_ns()
        m1 = time.monotonic_ns()
        if best < 0 or m1 - m0 < best:
            best, shift = m1 - m0, real - (m0 + m1) // 2
    return shift


def clock_endpoint(data_endpoint: str) -> str | None:
    """The clock-sync address that goes with a hub data address.

    The convention: a hub (or a node's relay) at ``tcp://HOST:PORT`` takes data on
    ``PORT`` and answers clock pings on ``PORT + 1``; at ``ipc://PATH`` it answers on
    ``ipc://PATH.clock``. ``inproc://`` carries no clock service (one process, one clock).

    Args:
        data_endpoint: the hub data address.

    Returns:
        The clock address, or None for ``inproc``.

    Raises:
        ValueError: when a tcp address has no numeric port.
    """
    ep = check_endpoint(data_endpoint)
    if ep.startswith("ipc://"):
        return ep + ".clock"
    if not ep.startswith("tcp://"):
        return None
    host, sep, port = ep[len("tcp://") :].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"hub endpoint {data_endpoint!r} needs a numeric port below 65535")
    return f"tcp://{host}:{int(port) + 1}"


class ClockSync:
    """Non-blocking NTP-style estimator of ``hub_time - local_monotonic``.

    Drive it with ``tick()`` whenever ``socket`` is readable or ``next_due_ns()`` passes.
    Not thread-safe: one thread ticks it (the collector's background thread); the
    ``offset_ns``/``error_ns`` attributes may be read from anywhere.

    Attributes:
        offset_ns: current offset estimate (add to a local monotonic time).
        error_ns: its uncertainty (half the best round trip, or ``FALLBACK_ERROR_NS``).
        synced: True once a ping was answered.
        pings: pings sent; answered: pings answered in time.
    """

    def __init__(
        self,
        endpoint: str | None,
        *,
        context: zmq.Context | None = None,
        now: Callable[[], int] = time.monotonic_ns,
        burst: int = BURST,
        resync_s: float = RESYNC_S,
        timeout_s: float = PING_TIMEOUT_S,
        window_s: float = WINDOW_S,
        curve: ClientCurve | None = None,
    ) -> None:
        """Connect to the hub's clock address (connecting never waits for the hub).

        Args:
            endpoint: the hub's clock address, or None to run on the fallback only.
            context: ZeroMQ context (the shared one by default).
            now: local monotonic clock in ns (tests substitute their own).
            burst: pings sent back to back at start.
            resync_s: seconds between periodic re-syncs.
            timeout_s: seconds before an unanswered ping is abandoned.
            window_s: how old a sample may be and still be used.
            curve: the client's CURVE keys and the hub's public key, or None for plain
                ZeroMQ (a hub that refuses the handshake leaves the fallback in use).
        """
        self._now = now
        self.offset_ns = time.time_ns() - now()
        self.error_ns = FALLBACK_ERROR_NS
        self.synced = False
        self.pings = 0
        self.answered = 0
        self._burst = max(0, int(burst))
        self._burst_left = self._burst
        self._resync_ns = int(resync_s * 1e9)
        self._timeout_ns = int(timeout_s * 1e9)
        self._window_ns = int(window_s * 1e9)
        self._samples: deque[tuple[int, int, int]] = deque(maxlen=256)
        self._outstanding: int | None = None
        self._next_ns = now()
        self.socket: zmq.Socket | None = None
        if endpoint is not None:
            ctx = context or zmq.Context.instance()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 4)
            sock.setsockopt(zmq.RCVHWM, 16)
            # Pings queued while the hub is away would come back with a stale round trip.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            if curve is not None:
                curve.apply(sock)
            sock.connect(check_endpoint(endpoint))
            self.socket = sock

    def restart(self) -> None:
        """Forget the samples and ping in a burst again (the hub restarted, maybe elsewhere).

        The current offset stays in use until the first new answer replaces it.
        """
        self._samples.clear()
        self._outstanding = None
        self._burst_left = self._burst
        self._next_ns = self._now()

    def to_hub(self, local_ns: int) -> int:
        """Convert one local monotonic time to the hub clock."""
        return local_ns + self.offset_ns

    def next_due_ns(self) -> int:
        """Local monotonic time at which ``tick`` has something to do next."""
        if self.socket is None:
            return 1 << 62
        if self._outstanding is not None:
            return self._outstanding + self._timeout_ns
        return self._next_ns

    def tick(self) -> None:
        """Read any answers, abandon a late ping, and send the next one when due."""
        sock = self.socket
        if sock is None:
            return
        while True:
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._on_reply(data, self._now())
        now = self._now()
        if self._outstanding is not None and now - self._outstanding > self._timeout_ns:
            self._outstanding = None
            self._next_ns = now + (self._resync_ns if self._burst_left == 0 else 0)
        if self._outstanding is None and now >= self._next_ns:
            t0 = self._now()
            try:
                sock.send(msgpack.packb({"v": CLOCK_VERSION, "t0": t0}), zmq.NOBLOCK)
            except zmq.Again:
                # No connection yet (IMMEDIATE): try again later instead of queueing.
                self._next_ns = now + self._timeout_ns
                return
            self.pings += 1
            self._outstanding = t0

    def add_sample(self, t0: int, t1: int, t_hub: int) -> None:
        """Fold one answered ping into the estimate.

        Args:
            t0: local send time; t1: local receive time; t_hub: hub time in the answer.
        """
        rtt = t1 - t0
        if rtt < 0:
            return
        self._samples.append((t1, rtt, t_hub - (t0 + t1) // 2))
        horizon = t1 - self._window_ns
        recent = [s for s in self._samples if s[0] >= horizon]
        _, best_rtt, best_offset = min(recent, key=lambda s: s[1])
        self.offset_ns = best_offset
        self.error_ns = max(1, best_rtt // 2)
        self.synced = True

    def _on_reply(self, data: bytes, t1: int) -> None:
        try:
            msg = msgpack.unpackb(data, raw=False)
            t0, t_hub = msg["t0"], msg["t_hub"]
            ok = msg.get("v") == CLOCK_VERSION and isinstance(t0, int) and isinstance(t_hub, int)
        except Exception:
            ok = False
        if not ok or t0 != self._outstanding:
            return  # garbage or the answer to an abandoned ping: its round trip is unknown
        self._outstanding = None
        self.answered += 1
        self.add_sample(t0, t1, t_hub)
        if self._burst_left > 0:
            self._burst_left -= 1
            self._next_ns = t1
            if self._burst_left == 0:
                self._next_ns = t1 + self._resync_ns
        else:
            self._burst_left = RESYNC_BURST - 1
            self._next_ns = t1

    def close(self) -> None:
        """Close the socket (idempotent)."""
        sock, self.socket = self.socket, None
        if sock is not None:
            sock.close(linger=0)
