"""A relay's ring of its ranks' raw messages, served on request for drill-down.

A reducing relay (`hub.reduce`) forwards sums where it can match a group on its node, so
the hub never holds those ranks' own rows. The relay keeps what its collectors sent, as
sent, for the recent past: a ring bounded in bytes (`RawRing`), oldest messages out first.
Each rank's identity (its latest ``hello``) and its group tables are kept apart, so that
what a request returns always replays into a recording the hub's own checks accept.

A request names a run, ranks and a step range; the reply is the matching messages byte for
byte, with the step range the ring still holds for each rank asked for (steps older than
that were evicted: said, never silently missing). `RawServer` answers requests on a ROUTER
socket of the relay's thread; `fetch` is the client (``rankscope relay fetch``), which
writes the reply as an ordinary recording, so ``export --perfetto``, ``open`` and
``diagnose`` read a reduced rank's raw rows as they read any run.

The ring reads each message it keeps (`schema.decode`: kind, run, rank, steps); a message
that does not decode is not kept (the hub counts it when it arrives there). Requests are
checked field by field and answered with an error naming the field; a reply is bounded in
bytes (`MAX_REPLY_BYTES`, or less when the request asks), and says when it was cut.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import zmq

from rankscope.collector import schema

PROTOCOL = "rankscope.raw/1"
"""The request and reply header's ``v``."""

MAX_REPLY_BYTES = 256 << 20
"""Most bytes of messages one reply carries."""

MAX_REQUEST_BYTES = 64 << 10
"""A request is a small map: ranks (or ranges of them), a step range and a run."""

MAX_RANKS = 1 << 20
"""Most ranks one request may name."""

_KEPT_KINDS = frozenset({"steps", "samples", "stats"})
"""Kinds the ring keeps in time order; ``hello`` and ``groups`` are kept per rank apart;
beats (liveness) and reduced messages (not one rank's rows) are not kept."""


class RawRequestError(ValueError):
    """A drill-down request that cannot be answered, naming the field."""


@dataclass(frozen=True)
class Entry:
    """One kept message."""

    run: str
    rank: int
    first: int
    """First step id of its rows (-1: none)."""
    last: int
    t_recv: int
    """When the relay received it (ns, its wall clock)."""
    data: bytes


@dataclass
class RingCounters:
    kept: int = 0
    """Messages added to the ring."""
    evicted: int = 0
    unreadable: int = 0
    """Messages that did not decode (not kept)."""
    requests: int = 0
    bad_requests: int = 0
    served_messages: int = 0
    served_bytes: int = 0


@dataclass
class _Identity:
    hello: Entry
    groups: list[Entry] = field(default_factory=list)
    groups_bytes: int = 0


class RawRing:
    """The recent raw messages of a relay's ranks, at most ``max_bytes`` of them.

    Identities (hellos and group tables) are bounded apart, by ``max_identity_bytes``: a
    rank's group tables beyond its share are dropped oldest first, and its hello is
    replaced by its newest."""

    def __init__(self, max_bytes: int, max_identity_bytes: int | None = None) -> None:
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.max_identity_bytes = (
            max_identity_bytes if max_identity_bytes is not None else max(1 << 20, max_bytes // 8)
        )
        self.counters = RingCounters()
        self._ring: deque[Entry] = deque()
        self._bytes = 0
        self._ids: dict[tuple[str, int], _Identity] = {}
        self._id_bytes = 0
        self.version = 0
        """Changes whenever the set of identities held does (what `runs` says)."""

    @property
    def nbytes(self) -> int:
        """Bytes of messages held (ring and identities)."""
        return self._bytes + self._id_bytes

    def add(self, data: bytes, t_recv: int | None = None) -> bool:
        """Keep ``data`` if it is one rank's message worth keeping; returns whether it was."""
        try:
            msg = schema.decode(data)
        except schema.SchemaError:
            self.counters.unreadable += 1
            return False
        if msg.kind not in _KEPT_KINDS and msg.kind not in ("hello", "groups"):
            return False
        head = msg.header
        run, rank = str(head["run"]), int(head["rank"])
        first, last = _step_range(msg)
        e = Entry(run, rank, first, last, t_recv if t_recv is not None else time.time_ns(), data)
        if msg.kind == "hello":
            self._hello(e)
        elif msg.kind == "groups":
            self._groups(e)
        else:
            self._ring.append(e)
            self._bytes += len(data)
            while self._bytes > self.max_bytes and self._ring:
                old = self._ring.popleft()
                self._bytes -= len(old.data)
                self.counters.evicted += 1
        self.counters.kept += 1
        return True

    def _hello(self, e: Entry) -> None:
        key = (e.run, e.rank)
        ident = self._ids.get(key)
        if ident is None:
            self._ids[key] = _Identity(e)
            self._id_bytes += len(e.data)
            self.version += 1
        else:
            self._id_bytes += len(e.data) - len(ident.hello.data)
            ident.hello = e
        self._trim_identities()

    def _groups(self, e: Entry) -> None:
        ident = self._ids.get((e.run, e.rank))
        if ident is None:  # group tables before the hello: nothing to replay them with
            return
        ident.groups.append(e)
        ident.groups_bytes += len(e.data)
        self._id_bytes += len(e.data)
        self._trim_identities()

    def _trim_identities(self) -> None:
        # Group tables go first, the largest holder's oldest; then whole identities, the
        # oldest hello first (a rank long gone).
        while self._id_bytes > self.max_identity_bytes:
            fat = max(self._ids.values(), key=lambda i: i.groups_bytes, default=None)
            if fat is not None and fat.groups:
                g = fat.groups.pop(0)
                fat.groups_bytes -= len(g.data)
                self._id_bytes -= len(g.data)
                self.counters.evicted += 1
                continue
            if not self._ids:
                return
            key = min(self._ids, key=lambda k: self._ids[k].hello.t_recv)
            gone = self._ids.pop(key)
            self._id_bytes -= len(gone.hello.data)
            self.version += 1
            self.counters.evicted += 1

    def has(self, run: str | None, rank: int) -> bool:
        """Whether the ring holds ``rank``'s identity in ``run``."""
        return (run, rank) in self._ids

    def runs(self) -> dict[str, list[int]]:
        """Run id -> the ranks whose identity the ring holds."""
        out: dict[str, list[int]] = {}
        for run, rank in sorted(self._ids):
            out.setdefault(run, []).append(rank)
        return out

    def held(self, run: str, ranks: Iterable[int]) -> dict[int, tuple[int, int]]:
        """Per rank asked for, the first and last step the ring still holds rows of."""
        want = set(ranks)
        lo: dict[int, int] = {}
        hi: dict[int, int] = {}
        for e in self._ring:
            if e.run == run and e.rank in want and e.first >= 0:
                lo[e.rank] = min(lo.get(e.rank, e.first), e.first)
                hi[e.rank] = max(hi.get(e.rank, e.last), e.last)
        return {r: (lo[r], hi[r]) for r in sorted(lo)}

    def select(
        self,
        run: str | None,
        ranks: set[int] | None,
        steps: tuple[int, int] | None,
        max_bytes: int = MAX_REPLY_BYTES,
        *,
        last: int | None = None,
    ) -> tuple[str | None, list[Entry], bool]:
        """The messages of ``run`` (the newest run held when None) from ``ranks`` (all when
        None) with rows in ``steps`` (inclusive; all when None; with ``last``, the newest
        ``last`` steps held of those ranks): identities first, then the rest in arrival
        order, at most ``max_bytes``. Returns (run, entries, cut short)."""
        if run is None:
            newest = max(self._ids.values(), key=lambda i: i.hello.t_recv, default=None)
            if newest is None:
                return None, [], False
            run = newest.hello.run
        idents = [
            i
            for (r, k), i in sorted(self._ids.items())
            if r == run and (ranks is None or k in ranks)
        ]
        out: list[Entry] = []
        size = 0
        for ident in idents:
            for e in (ident.hello, *ident.groups):
                if size + len(e.data) > max_bytes:
                    return run, out, True
                out.append(e)
                size += len(e.data)
        have = {i.hello.rank for i in idents}
        if last is not None:
            top = max((e.last for e in self._ring if e.run == run and e.rank in have), default=-1)
            steps = (max(0, top - last + 1), top) if top >= 0 else None
        for e in self._ring:
            if e.run != run or e.rank not in have:
                continue
            if steps is not None and e.first >= 0 and (e.last < steps[0] or e.first > steps[1]):
                continue
            if size + len(e.data) > max_bytes:
                return run, out, True
            out.append(e)
            size += len(e.data)
        return run, out, False


def _step_range(msg: schema.Message) -> tuple[int, int]:
    lo, hi = -1, -1
    for table in msg.tables.values():
        step = table.get("step")
        if step is None or step.shape[0] == 0:
            continue
        a, b = int(np.min(step)), int(np.max(step))
        lo = a if lo < 0 else min(lo, a)
        hi = max(hi, b)
    return lo, hi


# -- the request ------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    run: str | None = None
    ranks: tuple[int, ...] | None = None
    steps: tuple[int, int] | None = None
    """First and last step id (inclusive)."""
    last: int | None = None
    """Instead of ``steps``: the newest ``last`` steps the ring holds of the ranks asked for."""
    max_bytes: int = MAX_REPLY_BYTES

    def encode(self) -> bytes:
        body: dict[str, Any] = {"v": PROTOCOL, "max_bytes": self.max_bytes}
        if self.run is not None:
            body["run"] = self.run
        if self.ranks is not None:
            body["ranks"] = list(self.ranks)
        if self.steps is not None:
            body["steps"] = list(self.steps)
        if self.last is not None:
            body["last"] = self.last
        return msgpack.packb(body, use_bin_type=True)


def _int(where: str, value: Any, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise RawRequestError(f"{where} must be an int in [{lo}, {hi}], got {value!r}")
    return value


def parse_request(data: bytes) -> Request:
    """Check a request field by field.

    Raises:
        RawRequestError: naming what was wrong.
    """
    if len(data) > MAX_REQUEST_BYTES:
        raise RawRequestError(f"request of {len(data)} bytes (at most {MAX_REQUEST_BYTES})")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=0)
    except Exception as exc:
        raise RawRequestError(f"request is not msgpack: {exc}") from None
    if not isinstance(body, dict):
        raise RawRequestError(f"request must be a map, got {type(body).__name__}")
    if body.get("v") != PROTOCOL:
        raise RawRequestError(f"v must be {PROTOCOL!r}, got {body.get('v')!r}")
    unknown = set(body) - {"v", "run", "ranks", "steps", "last", "max_bytes"}
    if unknown:
        raise RawRequestError(f"unknown field(s): {', '.join(sorted(map(str, unknown)))}")
    run = body.get("run")
    if run is not None and (not isinstance(run, str) or not 0 < len(run) <= schema.MAX_NAME_CHARS):
        raise RawRequestError(f"run must be a non-empty string, got {run!r}"[:200])
    ranks = body.get("ranks")
    if ranks is not None:
        if not isinstance(ranks, list) or len(ranks) > MAX_RANKS:
            raise RawRequestError(f"ranks must be a list of at most {MAX_RANKS} ints")
        ranks = tuple(_int(f"ranks[{i}]", r, 0, schema.INT32_MAX) for i, r in enumerate(ranks))
    steps = body.get("steps")
    if steps is not None:
        if not isinstance(steps, list) or len(steps) != 2:
            raise RawRequestError(f"steps must be [first, last], got {steps!r}"[:200])
        a = _int("steps[0]", steps[0], 0, schema.MAX_TIME_NS)
        b = _int("steps[1]", steps[1], 0, schema.MAX_TIME_NS)
        if b < a:
            raise RawRequestError(f"steps: last {b} before first {a}")
        steps = (a, b)
    last = body.get("last")
    if last is not None:
        last = _int("last", last, 1, schema.MAX_ROWS)
        if steps is not None:
            raise RawRequestError("steps and last: give one of them")
    max_bytes = _int("max_bytes", body.get("max_bytes", MAX_REPLY_BYTES), 1, MAX_REPLY_BYTES)
    return Request(run, ranks, steps, last, max_bytes)


def answer(ring: RawRing, data: bytes) -> list[bytes]:
    """The reply frames to one request: a header map, then the messages."""
    c = ring.counters
    c.requests += 1
    try:
        req = parse_request(data)
    except RawRequestError as exc:
        c.bad_requests += 1
        return [msgpack.packb({"v": PROTOCOL, "ok": False, "error": str(exc)})]
    ranks = set(req.ranks) if req.ranks is not None else None
    run, entries, cut = ring.select(req.run, ranks, req.steps, req.max_bytes, last=req.last)
    asked = sorted(ranks) if ranks is not None else (ring.runs().get(run, []) if run else [])
    held = ring.held(run, asked) if run is not None else {}
    head = {
        "v": PROTOCOL,
        "ok": True,
        "run": run,
        "messages": len(entries),
        "cut": cut,
        "held": {str(r): list(v) for r, v in held.items()},
        "missing": [r for r in asked if not ring.has(run, r)][:1000],
        "t_recv": [e.t_recv for e in entries],
    }
    c.served_messages += len(entries)
    c.served_bytes += sum(len(e.data) for e in entries)
    return [msgpack.packb(head), *(e.data for e in entries)]


# -- the client ---------------------------------------------------------------------------
@dataclass
class Reply:
    run: str | None
    messages: list[bytes]
    t_recv: list[int]
    cut: bool
    held: dict[int, tuple[int, int]]
    missing: list[int]


class RawFetchError(RuntimeError):
    """The relay could not be reached, or refused the request (its reason included)."""


def fetch(
    endpoint: str,
    request: Request,
    *,
    timeout_s: float = 10.0,
    curve: Any = None,
) -> Reply:
    """Ask a relay's raw endpoint for ``request`` and wait at most ``timeout_s``.

    Raises:
        RawFetchError: no answer in time, a refusal, or a reply that is not one.
    """
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES + (64 << 20))
    if curve is not None:
        curve.apply(sock)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", request.encode()])
        if not sock.poll(int(timeout_s * 1000)):
            raise RawFetchError(f"no answer from {endpoint} within {timeout_s:g} s")
        frames = sock.recv_multipart()
    finally:
        sock.close(0)
    if len(frames) < 2 or frames[0] != b"":
        raise RawFetchError(f"{endpoint}: not a drill-down reply")
    try:
        head = msgpack.unpackb(frames[1], raw=False)
    except Exception as exc:
        raise RawFetchError(f"{endpoint}: unreadable reply header: {exc}") from None
    if not isinstance(head, dict) or head.get("v") != PROTOCOL:
        raise RawFetchError(f"{endpoint}: not a {PROTOCOL} reply")
    if not head.get("ok"):
        raise RawFetchError(f"{endpoint} refused the request: {head.get('error')}")
    msgs = frames[2:]
    t_recv = head.get("t_recv") or []
    if len(msgs) != head.get("messages") or len(t_recv) != len(msgs):
        raise RawFetchError(
            f"{endpoint}: reply holds {len(msgs)} messages of {head.get('messages')}"
        )
    held = {int(k): (int(v[0]), int(v[1])) for k, v in (head.get("held") or {}).items()}
    return Reply(
        head.get("run"),
        msgs,
        [int(t) for t in t_recv],
        bool(head.get("cut")),
        held,
        [int(r) for r in head.get("missing") or []],
    )
