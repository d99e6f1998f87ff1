"""Who holds a connection to the hub: its ZAP handler and its data socket's connection
events, in one thread (`Gate`).

ZeroMQ asks a context's ZAP handler (a socket bound at ``inproc://zeromq.zap.01``) about
every CURVE peer, and about plain peers of a socket with a ZAP domain, once their greeting
is in and before their first message. The gate answers from the hub's authorised client
keys (`hub.security`) and from the number of data connections open: past
`Limits.max_connections` a new data connection is refused (``too many connections``).
ZeroMQ gives a bound socket no other way to turn a peer away, and each peer may hold up to
``MAXMSGSIZE`` bytes of a message while it arrives, so the cap is what bounds that memory
(cap × `Limits.max_message_bytes`). The count is exact: the same thread reads the data
socket's monitor, and reads it to the end before each answer, so the connection being
asked about (accepted before its greeting) is already counted. A connection counts from
its TCP accept to its close, handshake or not; ZeroMQ closes one whose handshake has not
finished within `HANDSHAKE_S`.

The counters it keeps are the hub's ``transport`` counters: data connections accepted and
lost, handshakes ``refused`` (keys) and refused as ``too_many_connections``.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import zmq
from zmq.auth.certs import load_certificates
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("rankscope.hub")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DATA_DOMAIN = b"rankscope-data"
"""ZAP domain of the hub's data socket (the cap counts its connections alone)."""
CLOCK_DOMAIN = b"rankscope-clock"
DRILL_DOMAIN = b"rankscope-drill"
"""ZAP domain of the hub's drill socket (`hub.drill`): keys only, no cap."""

HANDSHAKE_S = 10.0
"""Longest a peer may take over its greeting and handshake (ZeroMQ's ``HANDSHAKE_IVL``,
30 s by default) before ZeroMQ closes it: a connection that never completes one holds a
slot of the cap this long."""

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
"""Monitor events of a connection refused at the security handshake."""
MONITOR_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED


class Gate:
    """The hub's ZAP handler and data-connection counter.

    Args:
        ctx: the hub's context; the ZAP socket is bound in it at once (before any socket
            of the context accepts a peer), when ``authorized`` or ``max_connections``
            asks for one.
        authorized: folder of the authorised clients' public keys (CURVE), or None.
        max_connections: most data connections open at once; 0 for no cap.
        stats: the counters to keep (the hub's ``transport_stats``).
        refusal_hint: what a handshake refused for its keys usually means (logged once).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        *,
        authorized: Path | None,
        max_connections: int,
        stats: dict[str, int],
        refusal_hint: str,
    ) -> None:
        if max_connections < 0:
            raise ValueError(f"max_connections must be ≥ 0, got {max_connections}")
        self.max_connections = max_connections
        self.stats = stats
        self.refusal_hint = refusal_hint
        self.keys: set[bytes] | None = None
        if authorized is not None:
            self.keys = set(load_certificates(str(authorized))) if authorized.is_dir() else set()
        self.zap: zmq.Socket | None = None
        if authorized is not None or max_connections:
            self.zap = ctx.socket(zmq.REP)
            self.zap.setsockopt(zmq.LINGER, 0)
            self.zap.bind(ZAP_ENDPOINT)
        self.monitor: zmq.Socket | None = None
        self.open: set[int] = set()
        """Descriptors of the data connections open now."""
        self._cap_refusals = 0
        """Refusals for the cap whose failed handshake the monitor has not shown yet."""

    def prepare(self, sock: zmq.Socket, domain: bytes) -> None:
        """Options of a socket the gate covers (before it binds): its ZAP domain, so that
        plain peers are asked about too, and the handshake time limit."""
        if self.zap is not None:
            sock.zap_domain = domain
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))

    def watch(self, data: zmq.Socket) -> None:
        """Monitor ``data`` (call from the thread that owns it, before `run` starts)."""
        self.monitor = data.get_monitor_socket(MONITOR_EVENTS)

    def run(self, stop: threading.Event) -> None:
        """Answer ZAP requests and count connections until ``stop`` is set; closes the
        gate's sockets when it ends."""
        poller = zmq.Poller()
        for s in (self.zap, self.monitor):
            if s is not None:
                poller.register(s, zmq.POLLIN)
        try:
            while not stop.is_set():
                ready = dict(poller.poll(100))
                self._read_monitor()
                if self.zap is not None and self.zap in ready:
                    while True:
                        try:
                            request = self.zap.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._read_monitor()  # this peer's accept is counted first
                        self.zap.send_multipart(self.answer(request))
        except Exception as exc:  # never let the thread die silently
            log.exception("hub connection gate failed: %r", exc)
        finally:
            self.close()

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply to ``request`` (RFC 27): version, request id, status, text,
        user id, metadata."""
        if len(request) < 6 or request[0] != b"1.0":
            rid = request[1] if len(request) > 1 else b""
            return [b"1.0", rid, b"400", b"malformed request", b"", b""]
        _, rid, domain, _address, _identity, mechanism = request[:6]
        user = b""
        if mechanism == b"CURVE" and self.keys is not None and len(request) == 7:
            user = z85.encode(request[6])
            if user not in self.keys:
                return [b"1.0", rid, b"400", b"unknown key", b"", b""]
        elif not (mechanism == b"NULL" and self.keys is None):
            return [b"1.0", rid, b"400", b"mechanism not accepted", b"", b""]
        if domain == DATA_DOMAIN and self.max_connections and len(self.open) > self.max_connections:
            self._cap_refusals += 1
            self.stats["too_many_connections"] = self.stats.get("too_many_connections", 0) + 1
            if self.stats["too_many_connections"] == 1:
                log.warning(
                    "hub: refusing data connections past %d open (--max-connections)",
                    self.max_connections,
                )
            return [b"1.0", rid, b"400", b"too many connections", b"", b""]
        return [b"1.0", rid, b"200", b"OK", user, b""]

    def _read_monitor(self) -> None:
        monitor = self.monitor
        if monitor is None:
            return
        while True:
            try:
                ev = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            event = ev["event"]
            if event == zmq.EVENT_ACCEPTED:
                self.stats["connects"] += 1
                self.open.add(ev["value"])
            elif event == zmq.EVENT_DISCONNECTED:
                self.stats["disconnects"] += 1
                self.open.discard(ev["value"])
            elif event & _HANDSHAKE_FAILED:
                if self._cap_refusals:
                    self._cap_refusals -= 1
                    continue
                self.stats["refused"] += 1
                if self.stats["refused"] == 1:
                    log.warning(
                        "hub refused a connection at the security handshake: %s",
                        self.refusal_hint,
                    )

    def close(self) -> None:
        """Close the gate's sockets (idempotent)."""
        for name in ("zap", "monitor"):
            s = getattr(self, name)
            if s is not None:
                s.close(0)
                setattr(self, name, None)
