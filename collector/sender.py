"""Non-blocking ZeroMQ PUSH sender: the only way collector data leaves a rank.

A training rank must never wait for the hub. Every send is ``NOBLOCK`` against a bounded
high-water mark: when the hub is slow or gone and the queue is full, the message is dropped
and counted instead of queued without bound. ZeroMQ reconnects by itself, so a hub that
starts late or restarts on the same address receives data again without any action here.

Producers that may wait (the simulator replaying a cluster faster than real time) pass
``timeout_ms`` to ``send``: it waits for room up to that long and counts a drop only when
the wait runs out. The collector inside a training job never does.

Given a `ClientCurve`, the socket is a CURVE client of the hub. A hub that refuses the
handshake (it requires CURVE and this sender has no keys, or it does not authorise this
sender's key) receives nothing: messages queue up to the high-water mark and are then
dropped and counted, exactly as when the hub is unreachable, and ``read_events`` logs one
warning that says why. ZeroMQ soon stops retrying a hub that refused the handshake: the
sender stays disconnected until its process starts again with the right keys.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from rankscope.collector.security import ClientCurve

log = logging.getLogger("rankscope")

DEFAULT_HWM = 1000
"""Messages queued per connection before new ones are dropped (a few MB of step batches)."""

LINGER_MS = 200
"""How long ``close`` may wait to flush queued messages; bounded so process exit never hangs."""

RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 1000
"""Reconnect quickly to a restarted hub, backing off to at most one try a second."""

CANCEL_CHECK_MS = 50
"""While waiting for room, how often a ``cancel`` event is looked at."""

HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
"""Monitor events of a connection the hub refused at the security handshake."""

WATCHED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
"""Monitor events ``watch`` follows."""


def handshake_advice(endpoint: str, event: int, curve: ClientCurve | None) -> str:
    """Why a hub refused this client's handshake, and what to do, in one line.

    Args:
        endpoint: the hub's address.
        event: the ZeroMQ monitor event (one of ``HANDSHAKE_FAILED``).
        curve: the client's keys, or None when it speaks plain ZeroMQ.

    Returns:
        The warning text.
    """
    head = f"the hub at {endpoint} refused the connection handshake; nothing reaches it"
    if curve is None:
        return (
            f"{head}: it requires CURVE keys and this process has none (give it hub.key and "
            "client.key_secret from `rankscope keys` in $RANKSCOPE_KEYS or "
            "~/.config/rankscope/keys)"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"{head}: it does not authorise this client's key from {curve.source} (put its "
            ".key file in the hub's authorized_clients/ and restart the hub)"
        )
    return (
        f"{head}: it speaks plain ZeroMQ or holds another hub key than {curve.source}/hub.key "
        "(RANKSCOPE_KEYS=none speaks plain ZeroMQ)"
    )


def check_endpoint(endpoint: str) -> str:
    """Validate a ZeroMQ endpoint string such as ``tcp://127.0.0.1:5555``.

    Args:
        endpoint: the address to check.

    Returns:
        The endpoint, stripped of surrounding spaces.

    Raises:
        ValueError: naming the endpoint when it is not ``tcp://``, ``ipc://`` or ``inproc://``,
            or is a wildcard bind address (``tcp://*:PORT``).
    """
    if not isinstance(endpoint, str):
        raise ValueError(f"hub endpoint must be a string, got {type(endpoint).__name__}")
    ep = endpoint.strip()
    if not ep.startswith(("tcp://", "ipc://", "inproc://")) or ep.endswith("://"):
        raise ValueError(f"hub endpoint {endpoint!r} is not a ZeroMQ address like tcp://HOST:PORT")
    if ep.startswith("tcp://") and ep[6:].rpartition(":")[0] in ("*", "0.0.0.0", "[::]", "::"):
        raise ValueError(
            f"hub endpoint {endpoint!r} is a bind address; name the hub's host to connect to"
        )
    return ep


class Sender:
    """A PUSH socket connected to the hub's PULL socket; ``send`` never blocks.

    Not thread-safe: one thread at a time calls ``send`` and ``close`` (the collector's
    background thread). A ZeroMQ socket may move between threads only with a memory barrier,
    which a lock or queue hand-off between them provides.

    Attributes:
        endpoint: the address connected to.
        sent: messages accepted by ZeroMQ.
        dropped: messages not sent: the queue was full (hub slow, absent or restarting) and
            any wait allowed by ``timeout_ms`` ran out or was cancelled.
        dropped_bytes: total size of the dropped messages.
        errors: sends that failed for another reason (closed context, bad state).
        waited: sends that found the queue full and then got room within their timeout.
        connected: after ``watch``: True while connected to the hub, False after the
            connection was lost, None before the first connection.
        reconnects: connections made after a lost one (the hub restarted or came back).
        handshake_failures: connection attempts the hub refused at the security handshake
            (seen after ``watch``).
        curve: the CURVE keys in use, or None for plain ZeroMQ.
    """

    def __init__(
        self,
        endpoint: str,
        hwm: int = DEFAULT_HWM,
        *,
        context: zmq.Context | None = None,
        linger_ms: int = LINGER_MS,
        curve: ClientCurve | None = None,
        watch: bool = False,
    ) -> None:
        """Connect a PUSH socket; connecting succeeds even when nothing listens yet.

        Args:
            endpoint: hub data address, e.g. ``tcp://10.0.0.1:5555``.
            hwm: send high-water mark in messages (>= 1).
            context: ZeroMQ context; the process-wide shared one by default, so that many
                senders (a simulated cluster) share one I/O thread.
            linger_ms: how long ``close`` waits to flush pending messages.
            curve: the client's CURVE keys and the hub's public key, or None for plain
                ZeroMQ.
            watch: follow the connection from before it is made (`watch`), so that not
                even a handshake refused at once on loopback goes unseen.

        Raises:
            ValueError: on a malformed endpoint or a non-positive ``hwm``.
        """
        self.endpoint = check_endpoint(endpoint)
        if not isinstance(hwm, int) or isinstance(hwm, bool) or hwm < 1:
            raise ValueError(f"hwm must be a positive int, got {hwm!r}")
        self.sent = 0
        self.dropped = 0
        self.dropped_bytes = 0
        self.errors = 0
        self.waited = 0
        self.connected: bool | None = None
        self.reconnects = 0
        self.handshake_failures = 0
        self.curve = curve
        self._poller: zmq.Poller | None = None
        self._monitor: zmq.Socket | None = None
        self._ctx = context or zmq.Context.instance()
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.LINGER, max(0, int(linger_ms)))
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        # Keep IMMEDIATE off: messages queue (up to the HWM) while the hub is not there yet,
        # so a hub started seconds after the job still gets each rank's hello.
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        if curve is not None:
            curve.apply(sock)
        if watch:
            self._monitor = _monitor_of(sock)
        try:
            sock.connect(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ValueError(f"cannot connect to hub endpoint {self.endpoint!r}: {exc}") from None
        self._sock: zmq.Socket | None = sock

    def send(
        self, data: bytes, timeout_ms: float = 0, *, cancel: threading.Event | None = None
    ) -> bool:
        """Queue one message; by default without ever blocking.

        The collector's own path always uses the default (``timeout_ms=0``): a training
        rank must never wait for the hub. A producer with nothing better to do than wait
        (the simulator) may give a timeout; the message then counts as dropped only when
        no room appeared before it ran out.

        Args:
            data: the encoded message.
            timeout_ms: longest wait for room in the queue when it is full; 0 never waits.
            cancel: when set, a wait ends at once (the message is dropped and counted);
                looked at every ``CANCEL_CHECK_MS``.

        Returns:
            True when ZeroMQ accepted it, False when it was dropped (counted).
        """
        sock = self._sock
        if sock is None:
            return self._drop(data)
        try:
            # Always copy: zero-copy sends need pyzmq's garbage-collector thread, which is
            # gone at interpreter exit, exactly when the final flush runs.
            sock.send(data, zmq.NOBLOCK, copy=True)
        except zmq.Again:
            if not timeout_ms > 0 or not self._wait_and_send(sock, data, timeout_ms, cancel):
                return self._drop(data)
            self.waited += 1
        except zmq.ZMQError:
            self.errors += 1
            return self._drop(data)
        self.sent += 1
        return True

    def _drop(self, data: bytes) -> bool:
        self.dropped += 1
        self.dropped_bytes += len(data)
        return False

    def _wait_and_send(
        self, sock: zmq.Socket, data: bytes, timeout_ms: float, cancel: threading.Event | None
    ) -> bool:
        """Wait for POLLOUT (room below the HWM) and send; False when time or ``cancel``
        ran out first. ZMQ errors other than a full queue propagate to ``send``."""
        if self._poller is None:
            self._poller = zmq.Poller()
            self._poller.register(sock, zmq.POLLOUT)
        deadline = time.monotonic() + timeout_ms / 1000.0
        while True:
            if cancel is not None and cancel.is_set():
                return False
            left_ms = (deadline - time.monotonic()) * 1000.0
            if left_ms <= 0:
                return False
            slice_ms = min(left_ms, CANCEL_CHECK_MS) if cancel is not None else left_ms
            if self._poller.poll(max(1, int(slice_ms))):
                try:
                    sock.send(data, zmq.NOBLOCK, copy=True)
                    return True
                except zmq.Again:
                    continue  # another message took the room (or a spurious wake)

    def watch(self) -> zmq.Socket | None:
        """Follow the connection to the hub through ZeroMQ's socket monitor (from now on,
        or from the start for a sender built with ``watch=True``).

        Returns:
            A socket that turns readable (``POLLIN``) when the connection is made or lost;
            call ``read_events`` then. None when monitoring is unavailable or closed.
        """
        if self._monitor is None and self._sock is not None:
            self._monitor = _monitor_of(self._sock)
        return self._monitor

    def read_events(self) -> bool:
        """Take the pending connection events (never blocks).

        Returns:
            True when the connection came back after being lost since the last call: a
            hub that restarted without its recording must then hear ``hello`` again.
        """
        mon = self._monitor
        back = False
        while mon is not None:
            try:
                event = recv_monitor_message(mon, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            except zmq.ZMQError:
                self.errors += 1
                break
            if event == zmq.EVENT_CONNECTED:
                if self.connected is False:
                    self.reconnects += 1
                    back = True
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False
            elif event & HANDSHAKE_FAILED:
                self.handshake_failures += 1
                if self.handshake_failures == 1:
                    log.warning("rankscope: %s", handshake_advice(self.endpoint, event, self.curve))
        return back

    @property
    def closed(self) -> bool:
        """True after ``close``."""
        return self._sock is None

    def close(self, linger_ms: int | None = None) -> None:
        """Close the socket, waiting at most ``linger_ms`` to flush what is queued.

        Args:
            linger_ms: override of the linger given at construction.
        """
        sock, self._sock = self._sock, None
        self._poller = None
        mon, self._monitor = self._monitor, None
        if sock is None:
            return
        if mon is not None:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            mon.close(linger=0)
        try:
            sock.close(linger=None if linger_ms is None else max(0, int(linger_ms)))
        except zmq.ZMQError:
            self.errors += 1

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _monitor_of(sock: zmq.Socket) -> zmq.Socket | None:
    """The monitor socket of the ``WATCHED`` events of ``sock``, or None when ZeroMQ
    cannot make one."""
    try:
        return sock.get_monitor_socket(WATCHED)
    except zmq.ZMQError:
        return None
