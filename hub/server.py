"""The hub process: ZeroMQ receivers in front of the intake, the store and the recording.

Sockets (ARCHITECTURE §2, §5):

- data: PULL bound at ``PORT``; collectors PUSH msgpack messages. ``MAXMSGSIZE`` is
  ``schema.MAX_MESSAGE_BYTES``: ZeroMQ cuts a larger message at the transport and resets
  that connection (the collector reconnects), which shows as a ``disconnects`` count;
  ``RCVHWM`` bounds what waits in memory while the hub is busy.
- clock: ROUTER bound at ``PORT + 1`` (tcp only); a ping ``{"v": 1, "t0": x}`` is answered
  ``{"v": 1, "t0": x, "t_hub": time.time_ns()}`` at once, from its own thread, so clock
  replies never queue behind data.

Binding port 0 picks a free port for data whose successor is also free for the clock.

With a `HubSecurity` (``security=``), both sockets are CURVE servers and a ZAP handler in
the hub's context accepts only the authorised clients' keys (`rankscope.hub.security`); a
client that fails the handshake delivers nothing and the hub goes on. Without one (the
default) they speak plain ZeroMQ: whether that is allowed on an address is the commands'
decision (`hub_security`), not this class's.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import msgpack
import zmq

from rankscope.collector import schema
from rankscope.collector.clock import clock_endpoint
from rankscope.hub import allocator
from rankscope.hub.drill import DrillBroker, drill_endpoint
from rankscope.hub.gate import CLOCK_DOMAIN, DATA_DOMAIN, DRILL_DOMAIN, Gate
from rankscope.hub.intake import Intake
from rankscope.hub.recording import ReadReport, RecordingWriter, segments
from rankscope.hub.replay import load
from rankscope.hub.security import HubSecurity
from rankscope.hub.store import Store
from rankscope.hub.validate import LIVE_LIMITS, Limits

log = logging.getLogger("rankscope.hub")

CLOCK_VERSION = 1
MAX_BUNDLE_FRAMES = 4096
"""Frames of one multipart message fed as messages (a relay's bundles hold at most 1,024);
the rest are read off and counted as ``too_many_frames``."""
_DRAIN = 512
"""Messages taken per wake-up before housekeeping (settle, flush) gets a turn."""
_STOP_GRACE_S = 0.05
_STOP_DRAIN_MAX_S = 1.0
"""On stop, messages are drained until none came for ``_STOP_GRACE_S`` (at most
``_STOP_DRAIN_MAX_S``): those a sender handed over just before are still on their way
through ZeroMQ's I/O thread."""


def parse_bind(bind: str) -> tuple[str, str, int]:
    """Split ``tcp://HOST:PORT`` (``*`` or ``0`` for any port is ``0``).

    Args:
        bind: ZeroMQ address; ``ipc://`` and ``inproc://`` are passed through with port -1.

    Returns:
        (transport, host, port).

    Raises:
        ValueError: a tcp address without a valid port.
    """
    transport, sep, rest = bind.partition("://")
    if not sep:
        raise ValueError(f"hub address {bind!r} must look like tcp://HOST:PORT")
    if transport != "tcp":
        return transport, rest, -1
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        raise ValueError(f"hub address {bind!r} needs a port: tcp://HOST:PORT")
    if port == "*":
        port = "0"
    if not port.isdigit() or not 0 <= int(port) < 65535:
        raise ValueError(f"hub address {bind!r}: port must be 0..65534 (the clock uses PORT+1)")
    return transport, host, int(port)


class Hub:
    """Receives, validates, stores and records what collectors send.

    Use as a context manager or call `start` / `stop`. ``store`` is live while it runs.
    """

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        record_dir: str | None = None,
        *,
        store: Store | None = None,
        settle_s: float = 0.1,
        flush_s: float = 0.5,
        rcvhwm: int = 10_000,
        resume: bool = True,
        keep_freed_memory: bool = True,
        security: HubSecurity | None = None,
        limits: Limits | None = None,
        drill: bool = False,
    ) -> None:
        """Configure (nothing is bound until `start`).

        Args:
            bind: data address ``tcp://HOST:PORT``; port 0 picks free ports.
            record_dir: recording directory, or None for no recording.
            store: the store to fill (a new one by default).
            settle_s: period of the collective matching pass.
            flush_s: longest time a received message waits before it is on disk (the
                recording's own thread writes it; the receive loop never waits for the
                disk unless it falls far behind, `RecordingWriter`).
            rcvhwm: messages ZeroMQ queues for the hub before pushing back on senders
                (which then drop and count, never block).
            resume: when ``record_dir`` already holds a recording, replay it into the
                store before listening, so a restarted hub knows the runs, ranks and steps
                it had (ranks need not say hello again).
            keep_freed_memory: on `start`, let the process keep freed heap memory for
                reuse (`hub.allocator`; a process-wide glibc setting): the matching pass
                then stops faulting its temporaries in from the kernel on every pass.
            security: CURVE keys for the data and clock sockets (`hub_security` chooses
                them), or None for plain ZeroMQ.
            limits: what the hub accepts whatever a sender claims (`hub.validate.Limits`;
                ``LIVE_LIMITS`` by default; a production hub adds a window around its
                clock, ``Limits(time_window_s=DEFAULT_TIME_WINDOW_S)``).
            drill: also bind the drill socket (``PORT + 2``, ``PATH.drill``), through which
                relays that keep raw rows answer drill-down requests (`hub.drill`).
        """
        self.bind = bind
        self.security = security
        self._gate: Gate | None = None
        self.transport, self.host, self.port = parse_bind(bind)
        self.record_dir = record_dir
        self.store = store if store is not None else Store()
        self.settle_s = settle_s
        self.flush_s = flush_s
        if rcvhwm < 1:
            raise ValueError(f"rcvhwm must be ≥ 1 (ZeroMQ reads 0 as no bound), got {rcvhwm}")
        self.rcvhwm = rcvhwm
        self.resume = resume
        self.keep_freed_memory = keep_freed_memory
        self.limits = limits if limits is not None else LIVE_LIMITS
        self.resumed_frames = 0
        self.recorder: RecordingWriter | None = None
        self.intake: Intake | None = None
        self._ctx: zmq.Context | None = None
        self._data: zmq.Socket | None = None
        self._clock: zmq.Socket | None = None
        self.drill = drill
        self._drill: zmq.Socket | None = None
        self.broker: DrillBroker | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = False
        self._stopped = False
        self._lock = threading.Lock()
        self.transport_stats = {
            "connects": 0,
            "disconnects": 0,
            "refused": 0,
            "too_many_connections": 0,
            "clock_pings": 0,
            "clock_bad": 0,
            "bundles": 0,
            "bundled": 0,
        }
        """Data connections accepted and lost, ``refused`` at the security handshake (no
        keys, an unauthorised key, another hub's key) and for ``too_many_connections``
        (`Limits.max_connections`, `hub.gate`), clock pings answered and bad, and relays'
        bundles received with the messages they carried."""

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> Hub:
        """Bind the sockets, open the recording and start the receive threads.

        Raises:
            zmq.ZMQError: the address is taken.
            RecordingError: the record directory is held by another hub.
        """
        with self._lock:
            if self._started:
                return self
            if self.keep_freed_memory:
                allocator.keep_freed_memory()
            if self.resume and self.record_dir is not None and segments(self.record_dir):
                report = ReadReport()
                load(self.record_dir, store=self.store, report=report)
                self.resumed_frames = report.frames
            self._ctx = zmq.Context()
            try:
                self._gate = Gate(
                    self._ctx,
                    authorized=self.security.authorized if self.security is not None else None,
                    max_connections=self.limits.max_connections,
                    stats=self.transport_stats,
                    refusal_hint=self._refusal_hint(),
                )
                if self.security is not None:
                    self.security.warn_if_no_clients()
                self._bind()
                assert self._data is not None
                self._gate.watch(self._data)
                if self.record_dir is not None:
                    self.recorder = RecordingWriter(
                        self.record_dir,
                        flush_s=self.flush_s,
                        info={"endpoint": self.endpoint},
                        background=True,
                    )
            except Exception:
                self._close_sockets()
                raise
            self.intake = Intake(self.store, self.recorder, limits=self.limits)
            self._started = True
            self._threads = [
                threading.Thread(target=self._recv_loop, name="rankscope-hub-data", daemon=True),
                threading.Thread(
                    target=self._gate.run,
                    args=(self._stop,),
                    name="rankscope-hub-gate",
                    daemon=True,
                ),
            ]
            if self._clock is not None:
                self._threads.append(
                    threading.Thread(
                        target=self._clock_loop, name="rankscope-hub-clock", daemon=True
                    )
                )
            if self._drill is not None:
                self.broker = DrillBroker(self._drill, self._latest_run)
                self._threads.append(
                    threading.Thread(
                        target=self.broker.run,
                        args=(self._stop,),
                        name="rankscope-hub-drill",
                        daemon=True,
                    )
                )
            for t in self._threads:
                t.start()
            log.info(
                "hub listening on %s (clock %s, %s)",
                self.endpoint,
                self.clock_endpoint,
                "CURVE" if self.security is not None else "plain",
            )
            return self

    def _new_data_socket(self) -> zmq.Socket:
        assert self._ctx is not None
        s = self._ctx.socket(zmq.PULL)
        # A larger message resets its connection inside ZeroMQ, before it is ever held whole.
        s.setsockopt(zmq.MAXMSGSIZE, min(schema.MAX_MESSAGE_BYTES, self.limits.max_message_bytes))
        s.setsockopt(zmq.RCVHWM, self.rcvhwm)
        s.setsockopt(zmq.LINGER, 0)
        if self.security is not None:
            self.security.apply(s)
        if self._gate is not None:
            self._gate.prepare(s, DATA_DOMAIN)
        return s

    def _new_clock_socket(self) -> zmq.Socket:
        assert self._ctx is not None
        clock = self._ctx.socket(zmq.ROUTER)
        clock.setsockopt(zmq.LINGER, 0)
        # A ping is a few dozen bytes: anything much larger is refused by ZeroMQ itself.
        clock.setsockopt(zmq.MAXMSGSIZE, max(64, 4 * self.limits.max_clock_frame_bytes))
        if self.security is not None:
            self.security.apply(clock)
        if self._gate is not None:
            self._gate.prepare(clock, CLOCK_DOMAIN)
        return clock

    def _new_drill_socket(self) -> zmq.Socket:
        assert self._ctx is not None
        s = self._ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        # Requests and relays' announcements are small; a relay's answer is frames of its
        # collectors' messages, each within the data socket's bound.
        s.setsockopt(zmq.MAXMSGSIZE, schema.MAX_MESSAGE_BYTES + (1 << 20))
        s.setsockopt(zmq.SNDHWM, 64)
        if self.security is not None:
            self.security.apply(s)
        if self._gate is not None:
            self._gate.prepare(s, DRILL_DOMAIN)
        return s

    def _latest_run(self) -> str | None:
        ids = self.store.run_ids()
        return ids[-1] if ids else None

    def _bind(self) -> None:
        assert self._ctx is not None
        if self.transport != "tcp":
            self._data = self._new_data_socket()
            self._data.bind(self.bind)
            where = clock_endpoint(self.bind)
            if where is not None:  # ipc: the clock beside the data socket's path
                self._clock = self._new_clock_socket()
                self._clock.bind(where)
            if self.drill and self.transport == "ipc":
                self._drill = self._new_drill_socket()
                self._drill.bind(drill_endpoint(self.bind))
            return
        tries = 50 if self.port == 0 else 1
        last_exc: Exception | None = None
        for _ in range(tries):
            data = self._new_data_socket()
            try:
                if self.port == 0:
                    port = data.bind_to_random_port(f"tcp://{self.host}", max_port=65534)
                else:
                    data.bind(f"tcp://{self.host}:{self.port}")
                    port = self.port
            except zmq.ZMQError as exc:
                data.close(0)
                raise zmq.ZMQError(
                    exc.errno, f"cannot bind hub data socket {self.bind}: {exc}"
                ) from None
            clock = self._new_clock_socket()
            drill = self._new_drill_socket() if self.drill else None
            try:
                clock.bind(f"tcp://{self.host}:{port + 1}")
                if drill is not None:
                    drill.bind(f"tcp://{self.host}:{port + 2}")
            except zmq.ZMQError as exc:
                for s in (drill, clock, data):
                    if s is not None:
                        s.close(0)
                last_exc = exc
                continue  # the clock (or drill) port is taken: try other ports
            self._data, self._clock, self._drill, self.port = data, clock, drill, port
            return
        raise zmq.ZMQError(
            getattr(last_exc, "errno", zmq.EADDRINUSE),
            f"cannot bind the hub clock socket next to {self.bind}: {last_exc}",
        )

    @property
    def endpoint(self) -> str:
        """The data address collectors connect to (``tcp://host:port``)."""
        if self.transport != "tcp":
            return self.bind
        host = self.host
        if host in ("*", "0.0.0.0", "::", "[::]"):
            host = socket.gethostname()
        return f"tcp://{host}:{self.port}"

    @property
    def drill_endpoint(self) -> str | None:
        """Where drill-down requests are taken (None without ``drill``)."""
        return drill_endpoint(self.endpoint) if self._drill is not None else None

    @property
    def clock_endpoint(self) -> str | None:
        if self.transport != "tcp":
            return clock_endpoint(self.bind)
        return self.endpoint.rsplit(":", 1)[0] + f":{self.port + 1}"

    def stop(self) -> None:
        """Drain what has arrived, stop the threads, close sockets and the recording.
        Idempotent."""
        with self._lock:
            if self._stopped or not self._started:
                self._stopped = True
                return
            self._stopped = True
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        self.store.settle()
        if self.recorder is not None:
            self.recorder.close(self.counters())
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._gate is not None:
            if self._data is not None and self._gate.monitor is not None:
                self._data.disable_monitor()
            self._gate.close()  # its thread has ended (or never started)
            self._gate = None
        for s in (self._data, self._clock, self._drill):
            if s is not None:
                s.close(0)
        self._data = self._clock = self._drill = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def __enter__(self) -> Hub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- loops --------------------------------------------------------------------------

    def _recv_loop(self) -> None:
        data = self._data
        assert data is not None and self.intake is not None
        feed = self.intake.feed
        feed_many = self.intake.feed_many
        max_bytes = self.limits.max_queued_bytes
        poller = zmq.Poller()
        poller.register(data, zmq.POLLIN)
        last_settle = time.monotonic()
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(50))
                if data in ready:
                    # Take a batch (at most _DRAIN messages or max_queued_bytes) off
                    # ZeroMQ, then process it: the intake checks its small tables' values
                    # together.
                    batch: list[bytes] = []
                    taken = 0
                    while len(batch) < _DRAIN and taken < max_bytes:
                        try:
                            buf = data.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        batch.append(buf)
                        taken += len(buf)
                        if data.rcvmore:
                            taken += self._bundle(data, batch)
                    if batch:
                        feed_many(batch, time.time_ns())
                    del batch
                now = time.monotonic()
                if now - last_settle >= self.settle_s:
                    last_settle = now
                    self._housekeeping()
            # What ZeroMQ holds, or is still reading off the network, belongs in the
            # recording: drain it all, then again while more comes within a short grace
            # period (for a bounded time).
            deadline = time.monotonic() + _STOP_DRAIN_MAX_S
            while True:
                while True:
                    try:
                        buf = data.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    rest: list[bytes] = [buf]
                    if data.rcvmore:
                        self._bundle(data, rest)
                    for one in rest:
                        feed(one, time.time_ns())
                if time.monotonic() >= deadline or not data.poll(int(_STOP_GRACE_S * 1000)):
                    break
        except Exception as exc:  # never let the thread die silently
            log.exception("hub receive loop failed: %r", exc)

    def _bundle(self, data: zmq.Socket, batch: list[bytes]) -> int:
        """Take the rest of a relay's bundle (a multipart message whose frames are
        collectors' messages, `rankscope.hub.relay`) into ``batch``: each frame is fed as
        if its rank had sent it. Returns the bytes taken."""
        taken = 0
        n = 1
        extra = 0
        while data.rcvmore:
            buf = data.recv()  # the frames of a multipart message are all there already
            if n >= MAX_BUNDLE_FRAMES:
                extra += 1  # not a relay's bundle: read off and counted, never fed
                continue
            batch.append(buf)
            taken += len(buf)
            n += 1
        self.transport_stats["bundles"] += 1
        self.transport_stats["bundled"] += n
        if extra:
            self.store.count_reject("too_many_frames", extra)
        return taken

    def _refusal_hint(self) -> str:
        if self.security is None:
            return (
                "a collector speaking CURVE to this plain hub (started with --insecure or "
                "without keys)"
            )
        return (
            f"a collector without keys, with a key not in {self.security.authorized}, or "
            "holding another hub's key"
        )

    def _housekeeping(self) -> None:
        try:
            self.store.settle()
        except Exception as exc:
            self.store.count_reject("internal_error")
            log.exception("settle failed: %r", exc)
        if self.recorder is not None:
            try:
                self.recorder.maybe_flush(self.counters())
            except Exception as exc:
                self.store.count_reject("record_error")
                log.warning("recording flush failed: %r", exc)

    def _clock_loop(self) -> None:
        sock = self._clock
        assert sock is not None
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    t_hub = time.time_ns()
                    # A ping is a few bytes: a larger frame is refused before unpacking.
                    big = len(frames) > 4 or len(frames[-1]) > self.limits.max_clock_frame_bytes
                    reply = None if big else _clock_reply(frames[-1], t_hub)
                    if reply is None:
                        self.transport_stats["clock_bad"] += 1
                        continue
                    self.transport_stats["clock_pings"] += 1
                    sock.send_multipart([*frames[:-1], reply], zmq.NOBLOCK)
        except Exception as exc:
            log.exception("hub clock loop failed: %r", exc)

    # -- reporting ----------------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        """JSON-ready counters for the recording's meta.json."""
        h = self.store.health
        return {
            "messages": h["messages"],
            "events": h["events"],
            "rejects": h["rejects"],
            "drops": h["drops"],
            "collector_errors": h["collector_errors"],
            "clock_error_ns": {
                run: {str(k): v for k, v in ranks.items()}
                for run, ranks in h["clock_error_ns"].items()
            },
            "transport": dict(self.transport_stats),
        }

    @property
    def health(self) -> dict[str, Any]:
        """The store's health plus ``transport`` (connects, disconnects, clock pings) and,
        when recording, ``record_backlog_bytes`` (received, not on disk yet)."""
        h = self.store.health
        h["transport"] = dict(self.transport_stats)
        if self.recorder is not None:
            h["record_backlog_bytes"] = self.recorder.backlog_bytes
        return h


def _clock_reply(payload: bytes, t_hub: int) -> bytes | None:
    try:
        msg = msgpack.unpackb(payload, raw=False)
    except Exception:
        return None
    if not isinstance(msg, dict) or msg.get("v") != CLOCK_VERSION:
        return None
    t0 = msg.get("t0")
    if not isinstance(t0, int) or isinstance(t0, bool):
        return None
    return msgpack.packb({"v": CLOCK_VERSION, "t0": t0, "t_hub": t_hub})
