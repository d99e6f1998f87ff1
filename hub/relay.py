"""A per-node relay: the node's ranks send to it, it forwards to the hub in bundles.

One relay runs on each node (``rankscope relay``, or ``rankscope run --relay``). The
node's collectors connect to it over ``ipc://`` (or loopback tcp) instead of to the hub;
the relay takes what they send and forwards it upstream, to the hub or to a relay one level
up (racks -> hub), as *bundles*: one multipart ZeroMQ message whose frames are the
collectors' messages, byte for byte, sent once per flush interval (`FLUSH_S`) or when a
bundle is full (`MAX_BUNDLE_MESSAGES`, `MAX_BUNDLE_BYTES`). The hub feeds each frame as if
the rank had sent it (`rankscope.hub.server`), so what it stores and records is the same
whether a relay carried it or not; what changes is what the hub's network side sees: one
connection per node instead of one per rank, one message per node and interval instead of
one per rank and step, and CURVE paid once per bundle on the node's way out, never on the
node itself (a node's relay listens only on ``ipc://`` or loopback, so keys never leave
the hub's users).

A forwarding relay decodes nothing: validation stays the hub's (`rankscope.hub.validate`).
It only refuses a frame larger than the hub would take (``MAXMSGSIZE``, as the hub's own
socket). With ``reduce`` it decodes what its collectors send, matches the groups whose
members all send through it and gathers its node's messages into one per flush
(`rankscope.hub.reduce`); the hub still checks everything that arrives. A relay that
listens beyond its node (a rack's, ``server``) serves the hub's keys and takes only the
authorised clients.

Never in the way of training: when the upstream has no room (hub slow, gone or
restarting: ``hwm`` bundles queued), the relay keeps its bundle and stops reading until
there is room, so the back-pressure reaches the collectors, whose sends never block: they
drop and count, and their stats tell the hub, as without a relay. ZeroMQ reconnects on its
own. Memory is bounded by the receive queue (``rcvhwm`` messages of at most
``max_message_bytes``), one bundle held and ``hwm`` bundles queued upstream. On stop, what
cannot leave within the drain time is counted as dropped.

Clock sync passes through: the relay answers on the clock address that goes with its own
(`collector.clock.clock_endpoint`) by forwarding each ping to the upstream's clock socket
and the reply back (a ROUTER/DEALER pair; the hub returns a ping's envelope with its
reply), so a collector's offset is to the hub's clock, over one more hop whose delay is
symmetric (the round trip bounds the error as before). Two levels of relays fit in the
hub's four-frame limit on a ping.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from rankscope.collector import schema
from rankscope.collector.clock import clock_endpoint
from rankscope.collector.security import ClientCurve
from rankscope.collector.sender import check_endpoint
from rankscope.hub.drill import DrillLink
from rankscope.hub.rawring import MAX_REQUEST_BYTES, RawRing, answer
from rankscope.hub.reduce import NodeReducer, ReduceCounters
from rankscope.hub.security import HubSecurity

log = logging.getLogger("rankscope")

FLUSH_S = 0.05
"""Longest time a received message waits in the relay before its bundle leaves: what a
relay adds to the live view's latency (the collectors themselves ship every 0.25-1 s)."""

MAX_BUNDLE_MESSAGES = 1024
"""Messages in one bundle at most (a full bundle leaves at once)."""

MAX_BUNDLE_BYTES = 8 << 20
"""Bytes in one bundle at most (a full bundle leaves at once)."""

UPSTREAM_HWM = 64
"""Bundles queued for the upstream before the relay stops reading from its collectors."""

RCVHWM = 10_000
"""Messages ZeroMQ queues from the node's collectors before they drop and count theirs."""

MAX_CLOCK_FRAME_BYTES = 256
"""A clock ping is a few dozen bytes; a larger frame is not forwarded."""

MAX_CLOCK_FRAMES = 3
"""Frames of a ping the relay forwards (its own envelope included): the hub answers at
most four, so two relay levels fit."""

DRAIN_S = 1.0
"""On stop, how long what is still arriving may take to be forwarded."""


class RelayError(ValueError):
    """A relay that cannot be set up as asked (the message says what and why)."""


def check_listen(endpoint: str, served: bool = False) -> str:
    """The address a relay listens on, checked: ``ipc://PATH`` or loopback tcp, unless it
    is ``served`` with the hub's keys (a rack's relay, which its nodes' relays reach over
    the network, authenticated as the hub authenticates them).

    A node's relay carries no keys on its listening side: it must not be reachable from off
    the node. (``tcp://127.0.0.1:0`` picks a free port.)

    Raises:
        RelayError: naming the address and what is wrong with it.
    """
    if served and isinstance(endpoint, str) and endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        if host and port.isdigit() and int(port) <= 65535:
            return endpoint  # any interface: ZeroMQ says at bind whether it can
        raise RelayError(f"relay listen address {endpoint!r}: expected tcp://HOST:PORT")
    try:
        ep = check_endpoint(endpoint)
    except ValueError as exc:
        raise RelayError(str(exc)) from None
    if ep.startswith("ipc://"):
        return ep
    if ep.startswith("tcp://"):
        host = ep[len("tcp://") :].rpartition(":")[0].strip("[]")
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if loopback:
            return ep
    raise RelayError(
        f"relay listen address {endpoint!r}: a relay listens on its own node only "
        "(ipc://PATH or tcp://127.0.0.1:PORT); its way to the hub (--upstream) carries the keys. "
        "A rack's relay that other nodes reach serves the hub's keys (--serve-keys DIR)"
    )


@dataclass
class RelayCounters:
    """What a relay did, for its status line and its summary."""

    received: int = 0
    """Messages taken from the node's collectors."""
    received_bytes: int = 0
    forwarded: int = 0
    """Messages handed to the upstream socket (inside bundles)."""
    bundles: int = 0
    dropped: int = 0
    """Messages that could not leave: a failed send, or still held when the relay stopped."""
    dropped_bytes: int = 0
    clock_pings: int = 0
    """Pings forwarded upstream."""
    clock_replies: int = 0
    """Replies passed back to a collector."""
    clock_bad: int = 0
    """Pings not forwarded (too many frames, too large)."""
    connects: int = 0
    """Upstream connections made (the first, and each after one was lost)."""
    disconnects: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__, errors=dict(self.errors))


class Relay:
    """Forwards what a node's collectors send to the hub, in bundles (module docstring).

    Use as a context manager or call `start` / `stop`.

    Attributes:
        listen: the address the node's collectors send to.
        upstream: the hub's (or the upper relay's) data address.
        counters: what it did so far (`RelayCounters`).
    """

    def __init__(
        self,
        listen: str,
        upstream: str,
        *,
        curve: ClientCurve | None = None,
        flush_s: float = FLUSH_S,
        max_bundle_messages: int = MAX_BUNDLE_MESSAGES,
        max_bundle_bytes: int = MAX_BUNDLE_BYTES,
        hwm: int = UPSTREAM_HWM,
        rcvhwm: int = RCVHWM,
        max_message_bytes: int = schema.MAX_MESSAGE_BYTES,
        clock: bool = True,
        reduce: bool = False,
        server: HubSecurity | None = None,
        raw_ring_bytes: int = 0,
        raw_endpoint: str | None = None,
        drill: str | None = None,
    ) -> None:
        """Configure (nothing is bound until `start`).

        Args:
            listen: ``ipc://PATH`` or a loopback ``tcp://127.0.0.1:PORT`` (port 0 picks
                one, and the clock socket takes the next).
            upstream: the hub's data address (or an upper relay's).
            curve: the keys for the upstream when the hub requires CURVE.
            flush_s: longest wait of a message in the relay.
            max_bundle_messages: most messages in one bundle.
            max_bundle_bytes: most bytes in one bundle.
            hwm: bundles queued upstream before the relay stops reading (back-pressure).
            rcvhwm: messages queued from the collectors.
            max_message_bytes: a larger message from a collector resets its connection
                (as at the hub).
            clock: pass clock pings through to the upstream's clock socket.
            reduce: match the collectives of groups whose members all send here and
                forward their sums instead of their rows (`hub.reduce`).
            server: the hub's keys, for a relay that listens beyond its node (a rack's):
                its listening and clock sockets are CURVE servers that take only the
                authorised clients, as the hub's are.
            raw_ring_bytes: keep this many bytes of the collectors' recent messages, as
                sent, and serve them on ``raw_endpoint`` (`hub.rawring`; 0: none).
            raw_endpoint: where drill-down requests are answered (default: ``PATH.raw``
                beside an ``ipc://PATH`` listen address, else a free loopback port).
            drill: the hub's drill address (``rankscope hub --drill``): the relay connects
                to it with the upstream's keys, says what its ring holds and answers the
                requests the hub routes to it (`hub.drill`).

        Raises:
            RelayError: a bad address or setting.
        """
        self.listen = check_listen(listen, served=server is not None)
        self.server = server
        self._auth: Any = None
        try:
            self.upstream = check_endpoint(upstream)
        except ValueError as exc:
            raise RelayError(f"--upstream: {exc}") from None
        for name, value in (
            ("max_bundle_messages", max_bundle_messages),
            ("max_bundle_bytes", max_bundle_bytes),
            ("hwm", hwm),
            ("rcvhwm", rcvhwm),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RelayError(f"{name} must be a positive int, got {value!r}")
        if not flush_s > 0:
            raise RelayError(f"flush_s must be > 0, got {flush_s!r}")
        self.curve = curve
        self.flush_s = float(flush_s)
        self.max_bundle_messages = max_bundle_messages
        self.max_bundle_bytes = max_bundle_bytes
        self.hwm = hwm
        self.rcvhwm = rcvhwm
        self.max_message_bytes = min(int(max_message_bytes), schema.MAX_MESSAGE_BYTES)
        self.clock = clock
        self.counters = RelayCounters()
        self.reducer = NodeReducer() if reduce else None
        if not isinstance(raw_ring_bytes, int) or isinstance(raw_ring_bytes, bool):
            raise RelayError(f"raw_ring_bytes must be an int, got {raw_ring_bytes!r}")
        if raw_ring_bytes < 0:
            raise RelayError(f"raw_ring_bytes must be >= 0, got {raw_ring_bytes}")
        self.ring = RawRing(raw_ring_bytes) if raw_ring_bytes else None
        if raw_endpoint is not None and self.ring is None:
            raise RelayError("a raw endpoint needs a raw ring (raw_ring_bytes > 0)")
        if self.ring is not None and raw_endpoint is None:
            raw_endpoint = (
                self.listen + ".raw" if self.listen.startswith("ipc://") else "tcp://127.0.0.1:0"
            )
        self.raw_listen = (
            check_listen(raw_endpoint, served=server is not None) if raw_endpoint else None
        )
        self._raw: zmq.Socket | None = None
        self._raw_bound = ""
        if drill is not None and self.ring is None:
            raise RelayError("--drill needs a raw ring (raw_ring_bytes > 0) to serve")
        try:
            self.drill = check_endpoint(drill) if drill is not None else None
        except ValueError as exc:
            raise RelayError(f"--drill: {exc}") from None
        self._link: DrillLink | None = None
        self._ctx: zmq.Context | None = None
        self._pull: zmq.Socket | None = None
        self._push: zmq.Socket | None = None
        self._clock_front: zmq.Socket | None = None
        self._clock_back: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._drain_s = DRAIN_S
        self._bound = ""
        self._ipc_paths: list[str] = []

    # -- lifecycle ----------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """The address the node's collectors connect to (the bound one once started)."""
        return self._bound or self.listen

    @property
    def clock_endpoint(self) -> str | None:
        """Where the relay answers clock pings (None without clock pass-through)."""
        return clock_endpoint(self.endpoint) if self.clock else None

    @property
    def raw_endpoint(self) -> str | None:
        """Where drill-down requests are answered (the bound address once started; None
        without a raw ring)."""
        return self._raw_bound or self.raw_listen

    def start(self) -> Relay:
        """Bind the listening sockets, connect upstream and start the forwarding thread.

        Raises:
            RelayError: an address is taken or cannot be used.
        """
        if self._thread is not None:
            return self
        ctx = self._ctx = zmq.Context()
        try:
            if self.server is not None:
                self._auth = self.server.start_authenticator(ctx)
            self._bind(ctx)
            self._bind_raw(ctx)
            if self.drill is not None:
                self._link = DrillLink(ctx, self.drill, curve=self.curve)
            push = self._push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, self.hwm)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.TCP_KEEPALIVE, 1)
            if self.curve is not None:
                self.curve.apply(push)
            self._monitor = push.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            push.connect(self.upstream)
            up_clock = clock_endpoint(self.upstream) if self.clock else None
            if up_clock is not None and self._clock_front is not None:
                back = self._clock_back = ctx.socket(zmq.DEALER)
                back.setsockopt(zmq.LINGER, 0)
                back.setsockopt(zmq.SNDHWM, 64)
                # A ping queued while the hub is away would come back with a stale round
                # trip: with no connection it is refused at once (and the collector's own
                # ping times out), as the collectors' clock sockets do.
                back.setsockopt(zmq.IMMEDIATE, 1)
                if self.curve is not None:
                    self.curve.apply(back)
                back.connect(up_clock)
        except (zmq.ZMQError, ValueError) as exc:
            self._close()
            raise RelayError(f"relay {self.listen} -> {self.upstream}: {exc}") from None
        self._thread = threading.Thread(target=self._loop, name="rankscope-relay", daemon=True)
        self._thread.start()
        log.info("relay on %s (clock %s) -> %s", self.endpoint, self.clock_endpoint, self.upstream)
        return self

    def _bind(self, ctx: zmq.Context) -> None:
        pull = self._pull = ctx.socket(zmq.PULL)
        if self.server is not None:
            self.server.apply(pull)
        pull.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        pull.setsockopt(zmq.RCVHWM, self.rcvhwm)
        pull.setsockopt(zmq.LINGER, 0)
        if self.listen.startswith("tcp://") and self.listen.endswith(":0"):
            host = self.listen[len("tcp://") : -len(":0")]
            for _ in range(50):
                port = pull.bind_to_random_port(f"tcp://{host}", max_port=65534)
                if not self.clock or self._bind_clock(ctx, f"tcp://{host}:{port + 1}"):
                    self._bound = f"tcp://{host}:{port}"
                    return
                pull.unbind(f"tcp://{host}:{port}")
            raise zmq.ZMQError(zmq.EADDRINUSE, "no free pair of ports for data and clock")
        if self.listen.startswith("ipc://"):
            _refuse_live_socket(self.listen[len("ipc://") :])
        pull.bind(self.listen)
        self._bound = self.listen
        self._own_ipc(self.listen)
        clock = clock_endpoint(self.listen) if self.clock else None
        if clock is not None and not self._bind_clock(ctx, clock):
            raise zmq.ZMQError(zmq.EADDRINUSE, f"cannot bind the relay clock socket {clock}")

    def _bind_raw(self, ctx: zmq.Context) -> None:
        if self.raw_listen is None:
            return
        raw = self._raw = ctx.socket(zmq.ROUTER)
        if self.server is not None:
            self.server.apply(raw)
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES + 1024)
        raw.setsockopt(zmq.SNDHWM, 4)
        if self.raw_listen.startswith("tcp://") and self.raw_listen.endswith(":0"):
            host = self.raw_listen[len("tcp://") : -len(":0")]
            port = raw.bind_to_random_port(f"tcp://{host}")
            self._raw_bound = f"tcp://{host}:{port}"
            return
        if self.raw_listen.startswith("ipc://"):
            _refuse_live_socket(self.raw_listen[len("ipc://") :])
        raw.bind(self.raw_listen)
        self._raw_bound = self.raw_listen
        self._own_ipc(self.raw_listen)

    def _bind_clock(self, ctx: zmq.Context, address: str) -> bool:
        front = ctx.socket(zmq.ROUTER)
        if self.server is not None:
            self.server.apply(front)
        front.setsockopt(zmq.LINGER, 0)
        front.setsockopt(zmq.MAXMSGSIZE, 4 * MAX_CLOCK_FRAME_BYTES)
        try:
            front.bind(address)
        except zmq.ZMQError:
            front.close(0)
            return False
        self._clock_front = front
        self._own_ipc(address)
        return True

    def _own_ipc(self, address: str) -> None:
        # Only this user's processes may send to the node's relay.
        if address.startswith("ipc://"):
            path = address[len("ipc://") :]
            try:
                os.chmod(path, 0o600)
                self._ipc_paths.append(path)
            except OSError as exc:
                self._error("ipc_chmod", exc)

    def stop(self, drain_s: float = DRAIN_S) -> None:
        """Forward what has arrived (for at most ``drain_s``), then close. Idempotent."""
        t = self._thread
        self._drain_s = max(0.0, float(drain_s))
        self._stop.set()
        if t is not None and t is not threading.current_thread():
            t.join(timeout=self._drain_s + 5.0)
        self._close()

    def _close(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None
        for s in (self._pull, self._clock_front, self._clock_back, self._raw):
            if s is not None:
                s.close(0)
        if self._push is not None:
            if self._monitor is not None:
                self._push.disable_monitor()
                self._monitor.close(0)
                self._monitor = None
            # What is queued upstream gets a short, bounded chance to leave.
            self._push.close(linger=500)
        self._pull = self._push = self._clock_front = self._clock_back = self._raw = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        for path in self._ipc_paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        self._ipc_paths = []

    def __enter__(self) -> Relay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the loop -------------------------------------------------------------------------
    def _loop(self) -> None:
        pull, push = self._pull, self._push
        front, back, monitor = self._clock_front, self._clock_back, self._monitor
        raw = self._raw
        link = self._link
        assert pull is not None and push is not None
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        for s in (front, back, monitor, raw, link.sock if link is not None else None):
            if s is not None:
                poller.register(s, zmq.POLLIN)
        bundle: list[bytes] = []
        size = 0
        due = 0.0
        # A closed bundle the upstream had no room for: nothing more is read from the
        # collectors until it leaves (their own queues then fill, and they drop and count,
        # where the hub sees it).
        held: tuple[list[bytes], int] | None = None
        expire_at = 0.0
        try:
            while not self._stop.is_set():
                wait = 100.0 if not bundle else max(0.0, (due - time.monotonic()) * 1000)
                ready = dict(poller.poll(min(100, int(wait) + 1)))
                if held is not None and push in ready and self._ship(*held):
                    held = None
                    poller.register(pull, zmq.POLLIN)
                    poller.unregister(push)
                if held is None and pull in ready:
                    if not bundle:
                        due = time.monotonic() + self.flush_s
                    size = self._fill(pull, bundle, size)
                if held is None and not bundle and self.reducer is not None:
                    # Rows held for a member that stopped sending leave on their own.
                    now = time.monotonic()
                    if now >= expire_at:
                        expire_at = now + 1.0
                        size = self._add_reduced(bundle, size)
                        due = now
                if front is not None and front in ready:
                    self._clock_up(front, back)
                if back is not None and back in ready:
                    self._clock_down(back, front)
                if monitor is not None and monitor in ready:
                    self._read_monitor(monitor)
                if raw is not None and raw in ready:
                    self._serve_raw(raw)
                if link is not None:
                    self._serve_drill(link, link.sock in ready)
                if (
                    held is None
                    and bundle
                    and (self._full(bundle, size) or time.monotonic() >= due)
                ):
                    size = self._add_reduced(bundle, size)
                    if not self._ship(bundle, size):
                        held = (bundle, size)
                        poller.unregister(pull)
                        poller.register(push, zmq.POLLOUT)
                    bundle, size = [], 0
            self._drain(pull, held, bundle, size)
        except Exception as exc:  # never die silently: the node's data would stop
            self._error("loop", exc)
            log.exception("relay loop failed: %r", exc)

    def _drain(
        self,
        pull: zmq.Socket,
        held: tuple[list[bytes], int] | None,
        bundle: list[bytes],
        size: int,
    ) -> None:
        """Stopping: forward what is held and what the collectors still send, for at most
        the drain time; what cannot leave by then is counted as dropped."""
        deadline = time.monotonic() + self._drain_s
        push = self._push
        assert push is not None
        while held is not None and time.monotonic() < deadline:
            if push.poll(50, zmq.POLLOUT) and self._ship(*held):
                held = None
        if held is not None:
            self._count_dropped(*held)
        final = False
        while time.monotonic() < deadline:
            if not bundle and not pull.poll(50):
                if final or self.reducer is None:
                    break
                # Nothing more arrives: what the reduction still holds leaves as rows.
                final = True
            size = self._fill(pull, bundle, size)
            size = self._add_reduced(bundle, size, final)
            if not bundle:
                continue
            while not self._ship(bundle, size):
                if time.monotonic() >= deadline:
                    self._count_dropped(bundle, size)
                    return
                push.poll(50, zmq.POLLOUT)
            bundle, size = [], 0
        if bundle:
            self._count_dropped(bundle, size)

    def _add_reduced(self, bundle: list[bytes], size: int, final: bool = False) -> int:
        """Append what the reduction has ready (its sums; rows that gave up waiting; on
        ``final``, everything it holds); returns the bundle's size."""
        if self.reducer is None:
            return size
        try:
            more = self.reducer.flush_all() if final else self.reducer.due()
        except Exception as exc:  # a reduction bug must not stop the relay
            self._error("reduce", exc)
            return size
        bundle += more
        return size + sum(map(len, more))

    def _full(self, bundle: list[bytes], size: int) -> bool:
        return len(bundle) >= self.max_bundle_messages or size >= self.max_bundle_bytes

    def _fill(self, pull: zmq.Socket, bundle: list[bytes], size: int) -> int:
        """Add what the collectors have sent to ``bundle`` until it is full or nothing is
        waiting, or, reducing, a flush interval has passed: a reducing relay's bundle stays
        empty while it takes in rows, and one that falls behind its collectors (a busy
        node) must still send what it reduced, not hold it until they pause. Returns the
        bundle's size in bytes."""
        c = self.counters
        reducer = self.reducer
        until = time.monotonic() + self.flush_s
        while not self._full(bundle, size):
            try:
                frame = pull.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            c.received += 1
            c.received_bytes += len(frame)
            if self.ring is not None:
                try:
                    self.ring.add(frame)
                except Exception as exc:  # the ring must never cost the node its data
                    self._error("raw_ring", exc)
            if reducer is None:
                bundle.append(frame)
                size += len(frame)
                continue
            try:
                out = reducer.take(frame)
            except Exception as exc:  # a reduction bug must not lose the node's data
                self._error("reduce", exc)
                out = [frame]
            for f in out:
                bundle.append(f)
                size += len(f)
            if time.monotonic() >= until:
                break
        return size

    def _serve_raw(self, raw: zmq.Socket) -> None:
        """Answer the drill-down requests waiting (`hub.rawring.answer`)."""
        assert self.ring is not None
        for _ in range(8):
            try:
                frames = raw.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # [peer identity, b"", request] from a DEALER or REQ client.
            if len(frames) != 3 or frames[1] != b"":
                self.ring.counters.bad_requests += 1
                continue
            try:
                raw.send_multipart(
                    [frames[0], b"", *answer(self.ring, frames[2])], zmq.NOBLOCK, copy=False
                )
            except zmq.ZMQError as exc:  # the asker left, or its queue is full
                self._error("raw_reply", exc)

    def _serve_drill(self, link: DrillLink, ready: bool) -> None:
        """Say what the ring holds (every few seconds) and answer what the hub routed."""
        ring = self.ring
        assert ring is not None
        link.announce(ring, time.monotonic())
        if ready:
            bad = link.serve(lambda req: answer(ring, req))
            ring.counters.bad_requests += bad

    def _count_dropped(self, bundle: list[bytes], size: int) -> None:
        self.counters.dropped += len(bundle)
        self.counters.dropped_bytes += size

    def _ship(self, bundle: list[bytes], size: int) -> bool:
        """Hand one bundle to the upstream socket; False when it has no room (kept)."""
        push = self._push
        assert push is not None
        try:
            # A multipart message is queued whole or not at all (the high-water mark is
            # checked on its first frame).
            push.send_multipart(bundle, zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            self._error("send", exc)
            self._count_dropped(bundle, size)
            return True  # gone: not retried
        c = self.counters
        c.forwarded += len(bundle)
        c.bundles += 1
        return True

    def _clock_up(self, front: zmq.Socket, back: zmq.Socket | None) -> None:
        while True:
            try:
                frames = front.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if (
                back is None
                or len(frames) > MAX_CLOCK_FRAMES
                or len(frames[-1]) > MAX_CLOCK_FRAME_BYTES
            ):
                self.counters.clock_bad += 1
                continue
            try:
                back.send_multipart(frames, zmq.NOBLOCK)
                self.counters.clock_pings += 1
            except zmq.Again:
                self.counters.clock_bad += 1  # the upstream clock is not there: the ping is lost

    def _clock_down(self, back: zmq.Socket, front: zmq.Socket | None) -> None:
        while True:
            try:
                frames = back.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if front is None or len(frames) < 2:
                continue
            try:
                front.send_multipart(frames, zmq.NOBLOCK)  # ROUTER: an unknown peer is dropped
                self.counters.clock_replies += 1
            except zmq.ZMQError:
                self.counters.clock_bad += 1

    def _read_monitor(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                ev = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if ev["event"] == zmq.EVENT_CONNECTED:
                self.counters.connects += 1
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                self.counters.disconnects += 1

    def _error(self, what: str, exc: BaseException) -> None:
        n = self.counters.errors.get(what, 0)
        self.counters.errors[what] = n + 1
        if n == 0:
            log.warning("rankscope relay: %s: %r (reported once)", what, exc)


def _refuse_live_socket(path: str) -> None:
    """ZeroMQ binds an ipc path by replacing whatever socket file is there: refuse one that
    a live process still listens on (another relay of this node), reuse a stale one."""
    import socket

    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        return  # nobody listens: a file left by a relay that was killed
    finally:
        probe.close()
    raise zmq.ZMQError(zmq.EADDRINUSE, f"{path} is in use (another relay listens there)")


def status_line(
    c: RelayCounters, reduced: ReduceCounters | None = None, ring: RawRing | None = None
) -> str:
    """One line of a relay's counters."""
    line = (
        f"received {c.received} ({c.received_bytes / (1 << 20):.1f} MiB)"
        f" | forwarded {c.forwarded} in {c.bundles} bundles | dropped {c.dropped}"
        f" | upstream {'up' if c.connects > c.disconnects else 'down'}"
        f" | clock pings {c.clock_pings}"
    )
    if reduced is not None:
        line += (
            f" | reduced {reduced.reduced_rows} rows to {reduced.instances} instances"
            f" | {reduced.messages} node messages ({reduced.merged} from lower relays)"
            f" | {reduced.passed_rows} rows on unreduced"
        )
    if ring is not None:
        rc = ring.counters
        line += (
            f" | raw ring {ring.nbytes / (1 << 20):.1f} MiB, {rc.evicted} evicted,"
            f" {rc.requests} requests ({rc.bad_requests} bad), {rc.served_messages} served"
        )
    if c.errors:
        line += " | errors " + ", ".join(f"{k} {v}" for k, v in sorted(c.errors.items()))
    return line
