"""Drill-down through the hub: requests for raw rows routed to the relays that keep them.

A node's reducing relay keeps its ranks' raw messages (`hub.rawring`) on its own node,
where the engineer at the hub cannot reach them. With ``rankscope hub --drill`` the hub
binds one more socket (``PORT + 2``, or ``PATH.drill``) with the data socket's security;
relays started with ``--drill ADDR`` connect to it, outward, with their upstream keys,
and say every `ANNOUNCE_S` which ranks of which runs their ring holds. A client
(``rankscope fetch --hub``, `rawring.fetch`) sends the hub the same request it would send
a relay; the hub splits it by relay, forwards each part, waits for the answers (at most
`REPLY_S`) and returns one reply in the relay's format: the messages of every relay, the
steps each still holds per rank, and as missing the ranks no relay announced or whose
relay did not answer in time. No port is opened on the nodes.

Frames on the drill socket (a ROUTER; peers are DEALERs):

- client → hub: ``[b"", request]`` (`rawring.Request`); hub → client: ``[b"", head, *messages]``
- relay → hub: ``[b"", b"serve", {"v", "runs": {run: [ranks]}}]`` (the announcement)
- hub → relay: ``[b"", b"fetch", id, request]``; relay → hub: ``[b"", b"reply", id, head, *messages]``

Everything a peer sends is checked; what does not fit is counted (``bad``) and, from a
client, answered with an error naming what was wrong.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from rankscope.collector import schema
from rankscope.hub.rawring import (
    MAX_REQUEST_BYTES,
    PROTOCOL,
    RawRequestError,
    RawRing,
    Request,
    parse_request,
)

log = logging.getLogger("rankscope.hub")

ANNOUNCE_S = 2.0
"""How often a relay says what its ring holds."""
FORGET_S = 3 * ANNOUNCE_S + 1.0
"""A relay not heard from for this long is no longer asked."""
REPLY_S = 5.0
"""Longest the hub waits for the relays' answers to one request."""
MAX_PENDING = 64
"""Requests in flight at once; more are refused until some are answered."""
MAX_ANNOUNCED_RANKS = 1 << 20
MAX_HELD_BYTES = 512 << 20
"""Bytes of relays' answers the hub holds at once over all requests in flight; an answer
that would go past it is left out (its ranks said missing, the reply marked cut)."""


def drill_endpoint(data_endpoint: str) -> str:
    """The drill address that goes with a hub data address: ``PORT + 2``, ``PATH.drill``."""
    if data_endpoint.startswith("ipc://"):
        return data_endpoint + ".drill"
    host, sep, port = data_endpoint[len("tcp://") :].rpartition(":")
    if not data_endpoint.startswith("tcp://") or not sep or not port.isdigit():
        raise ValueError(f"no drill address for {data_endpoint!r}")
    return f"tcp://{host}:{int(port) + 2}"


def error_reply(text: str) -> bytes:
    return msgpack.packb({"v": PROTOCOL, "ok": False, "error": text})


@dataclass
class _Relay:
    runs: dict[str, set[int]]
    seen: float


@dataclass
class _Pending:
    client: bytes
    request: Request
    run: str
    asked: list[int]
    waiting: set[bytes]
    deadline: float
    share: int = 0
    """Bytes each relay may answer with (the request's bound over the relays asked)."""
    missing: set[int] = field(default_factory=set)
    heads: list[dict[str, Any]] = field(default_factory=list)
    messages: list[bytes] = field(default_factory=list)
    held: int = 0
    cut: bool = False


@dataclass
class DrillCounters:
    relays: int = 0
    """Relays heard from within `FORGET_S`."""
    requests: int = 0
    answered: int = 0
    timed_out: int = 0
    """Relays that did not answer a request in time."""
    bad: int = 0


class DrillBroker:
    """The hub's drill socket and what it knows of the relays (module docstring).

    Args:
        sock: the bound ROUTER socket (the hub sets its security).
        latest_run: the hub's newest run id, for a request that names none.
    """

    def __init__(self, sock: zmq.Socket, latest_run: Any, reply_s: float = REPLY_S) -> None:
        self.sock = sock
        self.latest_run = latest_run
        self.reply_s = reply_s
        """Longest wait for the relays' answers to one request."""
        self.counters = DrillCounters()
        self._relays: dict[bytes, _Relay] = {}
        self._pending: dict[bytes, _Pending] = {}
        self._held = 0
        """Bytes of answers held over all requests in flight (`MAX_HELD_BYTES`)."""
        self._ids = itertools.count(1)

    def run(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(100):
                for _ in range(64):
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    try:
                        self.handle(frames)
                    except Exception as exc:  # one bad peer must not stop the broker
                        self.counters.bad += 1
                        log.warning("drill: %r", exc)
            now = time.monotonic()
            self.expire(now)
            self._forget(now)

    # -- frames -------------------------------------------------------------------------
    def handle(self, frames: list[bytes]) -> None:
        if len(frames) < 3 or frames[1] != b"":
            self.counters.bad += 1
            return
        peer, body = frames[0], frames[2:]
        if len(body) == 1:
            self._request(peer, body[0])
        elif body[0] == b"serve" and len(body) == 2:
            self._announce(peer, body[1])
        elif body[0] == b"reply" and len(body) >= 3:
            self._reply(peer, body[1], body[2], body[3:])
        else:
            self.counters.bad += 1

    def _send(self, peer: bytes, frames: list[bytes]) -> None:
        try:
            self.sock.send_multipart([peer, b"", *frames], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:  # the peer left or its queue is full: nothing to keep
            pass

    def _announce(self, peer: bytes, body: bytes) -> None:
        try:
            msg = msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=0)
            runs = msg["runs"]
            if msg.get("v") != PROTOCOL or not isinstance(runs, dict) or len(runs) > 64:
                raise ValueError("not an announcement")
            out: dict[str, set[int]] = {}
            total = 0
            for run, ranks in runs.items():
                if not isinstance(run, str) or not 0 < len(run) <= schema.MAX_NAME_CHARS:
                    raise ValueError("bad run")
                if not isinstance(ranks, list):
                    raise ValueError("bad ranks")
                total += len(ranks)
                if total > MAX_ANNOUNCED_RANKS:
                    raise ValueError("too many ranks")
                if not all(
                    isinstance(r, int) and not isinstance(r, bool) and 0 <= r <= schema.INT32_MAX
                    for r in ranks
                ):
                    raise ValueError("bad rank")
                out[run] = set(ranks)
        except Exception:
            self.counters.bad += 1
            return
        self._relays[peer] = _Relay(out, time.monotonic())

    def _request(self, client: bytes, body: bytes) -> None:
        self.counters.requests += 1
        try:
            req = parse_request(body)
        except RawRequestError as exc:
            self.counters.bad += 1
            self._send(client, [error_reply(str(exc))])
            return
        if len(self._pending) >= MAX_PENDING:
            self._send(client, [error_reply(f"{MAX_PENDING} requests in flight: try again")])
            return
        now = time.monotonic()
        self._forget(now)
        run = req.run if req.run is not None else self.latest_run()
        if run is None:
            self._send(client, [error_reply("the hub holds no run yet: give --run")])
            return
        holders = {p: r.runs.get(run, set()) for p, r in self._relays.items()}
        holders = {p: ranks for p, ranks in holders.items() if ranks}
        held = set().union(*holders.values()) if holders else set()
        asked = sorted(req.ranks) if req.ranks is not None else sorted(held)
        want = set(asked)
        parts = {p: sorted(ranks & want) for p, ranks in holders.items() if ranks & want}
        rid = next(self._ids).to_bytes(8, "little")
        pend = _Pending(
            client, req, run, asked, set(parts), now + self.reply_s, missing=want - held
        )
        if not parts:
            self._finish(rid, pend)
            return
        self._pending[rid] = pend
        pend.share = max(1, req.max_bytes // len(parts))
        for peer, ranks in parts.items():
            sub = Request(
                run=run, ranks=tuple(ranks), steps=req.steps, last=req.last, max_bytes=pend.share
            )
            self._send(peer, [b"fetch", rid, sub.encode()])

    def _reply(self, peer: bytes, rid: bytes, head: bytes, messages: list[bytes]) -> None:
        pend = self._pending.get(rid)
        if pend is None or peer not in pend.waiting:
            self.counters.bad += 1  # late (its request timed out) or not asked
            return
        pend.waiting.discard(peer)
        size = sum(map(len, messages))
        try:
            h = msgpack.unpackb(head, raw=False)
            ok = isinstance(h, dict) and h.get("ok") is True
            t_recv = h.get("t_recv") if ok else None
            if not ok or not isinstance(t_recv, list) or len(t_recv) != len(messages):
                raise ValueError("bad reply")
            if size > pend.share:  # a relay answers within what it was given
                raise ValueError("reply over its share")
        except Exception:
            self.counters.bad += 1
            pend.missing |= self._asked_of(peer, pend)
        else:
            if self._held + size > MAX_HELD_BYTES:
                pend.missing |= self._asked_of(peer, pend)
                pend.cut = True
            else:
                self._held += size
                pend.held += size
                pend.heads.append(h)
                pend.messages += messages
        if not pend.waiting:
            del self._pending[rid]
            self._finish(rid, pend)

    def _asked_of(self, peer: bytes, pend: _Pending) -> set[int]:
        relay = self._relays.get(peer)
        return relay.runs.get(pend.run, set()) & set(pend.asked) if relay is not None else set()

    def expire(self, now: float) -> None:
        for rid, pend in list(self._pending.items()):
            if now >= pend.deadline:
                self.counters.timed_out += len(pend.waiting)
                for peer in pend.waiting:
                    pend.missing |= self._asked_of(peer, pend)
                del self._pending[rid]
                self._finish(rid, pend)

    def relays(self) -> int:
        """Relays heard from within `FORGET_S`."""
        self._forget(time.monotonic())
        return self.counters.relays

    def _forget(self, now: float) -> None:
        for peer in [p for p, r in self._relays.items() if now - r.seen > FORGET_S]:
            del self._relays[peer]
        self.counters.relays = len(self._relays)

    def _finish(self, rid: bytes, pend: _Pending) -> None:
        held: dict[str, Any] = {}
        t_recv: list[int] = []
        for h in pend.heads:
            held.update(h.get("held") or {})
            t_recv += [int(t) for t in h.get("t_recv") or []]
            pend.missing |= {int(r) for r in h.get("missing") or [] if isinstance(r, int)}
        head = {
            "v": PROTOCOL,
            "ok": True,
            "run": pend.run if pend.messages else None,
            "messages": len(pend.messages),
            "cut": pend.cut or any(bool(h.get("cut")) for h in pend.heads),
            "held": held,
            "missing": sorted(pend.missing)[:1000],
            "t_recv": t_recv,
        }
        self.counters.answered += 1
        self._held -= pend.held
        self._send(pend.client, [msgpack.packb(head), *pend.messages])


# -- the relay's side -------------------------------------------------------------------
class DrillLink:
    """A relay's connection to the hub's drill socket: it announces what its ring holds
    and answers the requests the hub forwards (`rawring.answer`)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, curve: Any = None) -> None:
        s = self.sock = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 16)
        s.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES + 1024)
        if curve is not None:
            curve.apply(s)
        s.connect(endpoint)
        self.endpoint = endpoint
        self._next = 0.0
        self._said = -1

    def announce(self, ring: RawRing, now: float) -> None:
        """Say what the ring holds: when that changed, else every `ANNOUNCE_S`."""
        if now < self._next and ring.version == self._said:
            return
        self._next, self._said = now + ANNOUNCE_S, ring.version
        body = msgpack.packb({"v": PROTOCOL, "runs": ring.runs()})
        try:
            self.sock.send_multipart([b"", b"serve", body], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def serve(self, answer: Any) -> int:
        """Answer the requests waiting; returns how many frames were malformed."""
        bad = 0
        for _ in range(8):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 4 or frames[0] != b"" or frames[1] != b"fetch":
                bad += 1
                continue
            out = answer(frames[3])
            try:
                self.sock.send_multipart([b"", b"reply", frames[2], *out], zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:
                bad += 1
        return bad

    def close(self) -> None:
        self.sock.close(0)


__all__ = [
    "ANNOUNCE_S",
    "DrillBroker",
    "DrillLink",
    "drill_endpoint",
]
