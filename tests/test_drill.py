"""Drill-down through the hub (`rankscope.hub.drill`): relays that keep raw rows connect
to the hub's drill socket and say what they hold; a request to the hub is split by relay,
answered by each, and returned as one reply in the relay's format, so ``rankscope fetch``
reads it the same. No port opens on a node; the drill socket has the data socket's keys."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import zmq
from test_raw_ring import _kind_steps, _messages
from waiting import wait_for

from rankscope.cli import main
from rankscope.collector.security import load_client_curve
from rankscope.commands.keys import make_keys
from rankscope.hub.drill import drill_endpoint
from rankscope.hub.rawring import PROTOCOL, RawFetchError, Request, fetch
from rankscope.hub.recording import read_frames
from rankscope.hub.relay import Relay
from rankscope.hub.security import load_hub_security
from rankscope.hub.server import Hub


def _feed(relay: Relay, msgs: list[tuple[int, bytes]]) -> None:
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(relay.endpoint)
    for _, data in msgs:
        push.send(data)
    assert wait_for(lambda: relay.counters.received == len(msgs), timeout=60)
    push.close(linger=1000)


def _expected(msgs, ranks, lo, hi):
    return [
        d
        for r, d in msgs
        if r in ranks
        and (
            (k := _kind_steps(d))[0] in ("hello", "groups")
            or (k[0] in ("steps", "samples", "stats") and (k[1] < 0 or (k[2] >= lo and k[1] <= hi)))
        )
    ]


def test_the_hub_routes_a_request_to_the_relays_that_hold_the_ranks(tmp_path: Path) -> None:
    msgs = _messages()  # 16 ranks, hosts of 8
    hub = Hub(bind="tcp://127.0.0.1:0", drill=True).start()
    assert hub.drill_endpoint == drill_endpoint(hub.endpoint)
    relays = [
        Relay(
            f"ipc://{tmp_path / f'n{k}'}",
            hub.endpoint,
            reduce=True,
            raw_ring_bytes=32 << 20,
            drill=hub.drill_endpoint,
        ).start()
        for k in range(2)
    ]
    try:
        for k, relay in enumerate(relays):
            _feed(relay, [(r, d) for r, d in msgs if r // 8 == k])
        assert hub.broker is not None
        assert wait_for(lambda: hub.broker.relays() == 2, timeout=30)
        assert wait_for(lambda: "run" in hub.store.run_ids(), timeout=30)
        # Ranks of both nodes in one request; the run is the hub's newest by default.
        rec = tmp_path / "drill"
        argv = ["fetch", hub.drill_endpoint, "--ranks", "3,12", "--step-range", "4:6"]
        assert main([*argv, "--record", str(rec)]) == 0
        recorded = sorted(f.payload for f in read_frames(rec))
        assert recorded == sorted(_expected(msgs, {3, 12}, 4, 6))
        reply = fetch(hub.drill_endpoint, Request(ranks=(3, 12, 40)), timeout_s=10)
        assert reply.run == "run" and reply.missing == [40]
        assert reply.held == {3: (0, 9), 12: (0, 9)}
        # A relay gone: its ranks are said missing once the hub gave up waiting.
        hub.broker.reply_s = 0.5
        relays[1].stop()
        reply = fetch(hub.drill_endpoint, Request(ranks=(3, 12)), timeout_s=10)
        assert reply.missing == [12]
        assert 3 in reply.held and reply.messages
    finally:
        for r in relays:
            r.stop()
        hub.stop()


def test_what_reaches_the_drill_socket_is_checked() -> None:
    with Hub(bind="tcp://127.0.0.1:0", drill=True) as hub:
        assert hub.broker is not None
        # A client's malformed request: refused, naming the field.
        with pytest.raises(RawFetchError, match="steps"):
            fetch(hub.drill_endpoint, Request(steps=(5, 2)), timeout_s=10)
        with pytest.raises(RawFetchError, match="no run yet"):
            fetch(hub.drill_endpoint, Request(), timeout_s=10)
        # Announcements that do not fit are counted and change nothing.
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(hub.drill_endpoint)
        bad = [
            [b"", b"serve", b"\xc1"],
            [b"", b"serve", msgpack.packb({"v": PROTOCOL, "runs": {"r": [-1]}})],
            [b"", b"serve", msgpack.packb({"v": PROTOCOL, "runs": {"r": "0-7"}})],
            [b"", b"reply", b"12345678", b"{}"],
            [b"", b"what", b"x", b"y"],
        ]
        for frames in bad:
            s.send_multipart(frames)
        assert wait_for(lambda: hub.broker.counters.bad >= len(bad), timeout=30)
        assert hub.broker.relays() == 0
        s.close(0)


def test_the_drill_socket_takes_only_authorised_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    make_keys(keys, ["client"], force=False)
    curve = load_client_curve(keys)
    msgs = [(r, d) for r, d in _messages(steps=3) if r < 8]
    hub = Hub(bind="tcp://127.0.0.1:0", drill=True, security=load_hub_security(keys)).start()
    relay = Relay(
        f"ipc://{tmp_path / 'n0'}",
        hub.endpoint,
        curve=curve,
        reduce=True,
        raw_ring_bytes=8 << 20,
        drill=hub.drill_endpoint,
    ).start()
    try:
        _feed(relay, msgs)
        assert hub.broker is not None
        assert wait_for(lambda: hub.broker.relays() == 1, timeout=30)
        reply = fetch(hub.drill_endpoint, Request(run="run", ranks=(2,)), curve=curve, timeout_s=10)
        assert reply.messages and not reply.missing
        # Without keys the handshake fails: no answer, nothing learnt.
        with pytest.raises(RawFetchError, match="no answer"):
            fetch(hub.drill_endpoint, Request(run="run", ranks=(2,)), timeout_s=1.0)
    finally:
        relay.stop()
        hub.stop()


def test_drill_flags_need_their_ring(tmp_path: Path, capsys) -> None:
    up = "tcp://127.0.0.1:9"
    argv = [
        "relay",
        "--upstream",
        up,
        "--listen",
        f"ipc://{tmp_path / 'r'}",
        "--drill",
        "tcp://127.0.0.1:11",
    ]
    assert main(argv) == 2
    assert "--drill needs --raw-ring" in capsys.readouterr().err


class _Sent:
    """A stand-in for the broker's socket that keeps what it sends."""

    def __init__(self) -> None:
        self.out: list[list[bytes]] = []

    def send_multipart(self, frames, *args, **kw) -> None:  # type: ignore[no-untyped-def]
        self.out.append([bytes(f) for f in frames])


def _announce(broker, peer: bytes, runs) -> None:  # type: ignore[no-untyped-def]
    broker.handle([peer, b"", b"serve", msgpack.packb({"v": PROTOCOL, "runs": runs})])


def _reply_head(n: int) -> bytes:
    return msgpack.packb({"v": PROTOCOL, "ok": True, "messages": n, "t_recv": [0] * n})


def test_the_broker_holds_relays_to_their_share_and_its_own_bound(monkeypatch) -> None:
    from rankscope.hub import drill

    sent = _Sent()
    broker = drill.DrillBroker(sent, lambda: "r")  # type: ignore[arg-type]
    _announce(broker, b"A", {"r": [1, 2]})
    _announce(broker, b"B", {"r": [3]})
    broker.handle([b"client", b"", Request(ranks=(1, 3), max_bytes=1000).encode()])
    fetches = {f[0]: f for f in sent.out}
    assert set(fetches) == {b"A", b"B"} and fetches[b"A"][2] == b"fetch"
    rid = fetches[b"A"][3]
    asked = msgpack.unpackb(fetches[b"A"][4])
    assert asked["ranks"] == [1] and asked["max_bytes"] == 500  # split between the relays
    # A answers beyond its share: refused, its ranks said missing; B's answer is kept.
    broker.handle([b"A", b"", b"reply", rid, _reply_head(1), b"x" * 600])
    broker.handle([b"B", b"", b"reply", rid, _reply_head(1), b"y" * 400])
    client = sent.out[-1]
    assert client[0] == b"client"
    head = msgpack.unpackb(client[2])
    assert head["ok"] and head["missing"] == [1] and client[3:] == [b"y" * 400]
    assert broker.counters.bad == 1
    # Past the bound on what the hub holds at once, an answer is left out and said cut.
    monkeypatch.setattr(drill, "MAX_HELD_BYTES", 300)
    broker.handle([b"client", b"", Request(ranks=(3,), max_bytes=1000).encode()])
    rid = sent.out[-1][3]
    broker.handle([b"B", b"", b"reply", rid, _reply_head(1), b"z" * 400])
    head = msgpack.unpackb(sent.out[-1][2])
    assert head["cut"] and head["missing"] == [3] and len(sent.out[-1]) == 3
    assert broker._held == 0  # nothing left held once answered
