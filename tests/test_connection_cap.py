"""`Limits.max_connections`: data connections past the cap are refused at their
handshake (`hub.gate`), plain or CURVE, counted apart from refused keys; a slot frees when
a connection closes. Loopback only; deliveries are waited for, never timed."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_hub_job import header, identity
from waiting import wait_for

from rankscope.cli import main
from rankscope.collector import schema
from rankscope.collector.security import load_client_curve, private_dir, write_key_pair
from rankscope.collector.sender import Sender
from rankscope.commands.keys import make_keys
from rankscope.hub.gate import DATA_DOMAIN, Gate
from rankscope.hub.security import load_hub_security
from rankscope.hub.server import Hub
from rankscope.hub.validate import Limits


def hello(run: str) -> bytes:
    return schema.hello_message(header(run, 0), identity(0, 1))


def refused(sender: Sender) -> bool:
    sender.read_events()
    return sender.handshake_failures > 0


def test_a_plain_hub_refuses_data_connections_past_its_cap_and_frees_a_slot_on_close() -> None:
    with Hub("tcp://127.0.0.1:0", limits=Limits(max_connections=2)) as hub:
        first, second = Sender(hub.endpoint), Sender(hub.endpoint)
        for i, s in enumerate((first, second)):
            assert s.send(hello(f"run{i}"))
        assert wait_for(lambda: {"run0", "run1"} <= set(hub.store.run_ids()))
        with Sender(hub.endpoint, watch=True) as third:
            third.send(hello("run2"))
            assert wait_for(lambda: refused(third))
            assert wait_for(lambda: hub.transport_stats["too_many_connections"] >= 1)
            assert "run2" not in hub.store.run_ids()
        assert hub.transport_stats["refused"] == 0  # not a key problem
        first.close()
        assert wait_for(lambda: hub.transport_stats["disconnects"] >= 2)  # and the third's
        with Sender(hub.endpoint) as fourth:
            assert fourth.send(hello("run3"))
            assert wait_for(lambda: "run3" in hub.store.run_ids())
        second.close()
        # The clock socket is not counted: pings still answered with the data slots full.
        assert hub.health["transport"]["too_many_connections"] >= 1


def test_a_curve_hub_counts_refusals_for_the_cap_apart_from_unknown_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    make_keys(keys, ["client"], force=False)
    good = load_client_curve(keys)
    _, pair = write_key_pair(private_dir(tmp_path / "stranger"), "stranger")
    stranger = load_client_curve(keys, pair)
    hub = Hub(
        "tcp://127.0.0.1:0", security=load_hub_security(keys), limits=Limits(max_connections=1)
    )
    with hub:
        with Sender(hub.endpoint, curve=good) as one:
            assert one.send(hello("one"))
            assert wait_for(lambda: "one" in hub.store.run_ids())
            with Sender(hub.endpoint, curve=good, watch=True) as two:
                two.send(hello("two"))
                assert wait_for(lambda: refused(two))
            with Sender(hub.endpoint, curve=stranger, watch=True) as bad:
                bad.send(hello("bad"))
                assert wait_for(lambda: refused(bad))
            assert wait_for(lambda: hub.transport_stats["refused"] >= 1)
            stats = hub.transport_stats
            # The stranger's key is checked first: it is refused for its key, not the cap.
            assert stats["too_many_connections"] == 1 and stats["refused"] == 1, stats
        assert "two" not in hub.store.run_ids() and "bad" not in hub.store.run_ids()


def _request(domain: bytes, mechanism: bytes, *creds: bytes) -> list[bytes]:
    return [b"1.0", b"7", domain, b"127.0.0.1", b"", mechanism, *creds]


def test_gate_answers_follow_rfc_27_and_refuse_what_it_does_not_know(tmp_path: Path) -> None:
    import zmq

    ctx = zmq.Context()
    try:
        stats = {"connects": 0, "disconnects": 0, "refused": 0}
        gate = Gate(ctx, authorized=None, max_connections=1, stats=stats, refusal_hint="")
        gate.open = {11}
        assert gate.answer(_request(DATA_DOMAIN, b"NULL"))[2:4] == [b"200", b"OK"]
        gate.open = {11, 12}
        assert gate.answer(_request(DATA_DOMAIN, b"NULL"))[2:4] == [
            b"400",
            b"too many connections",
        ]
        assert gate.answer(_request(b"rankscope-clock", b"NULL"))[2] == b"200"  # not capped
        assert gate.answer(_request(DATA_DOMAIN, b"PLAIN", b"u", b"p"))[2] == b"400"
        assert gate.answer([b"2.0", b"7"])[1:3] == [b"7", b"400"]
        assert gate.answer([])[2] == b"400"
        assert stats["too_many_connections"] == 1
        gate.close()
    finally:
        ctx.term()


def test_a_negative_cap_is_refused_and_the_hub_command_takes_one(capsys) -> None:
    with pytest.raises(ValueError, match="max_connections"):
        Limits(max_connections=-1)
    assert main(["hub", "--max-connections", "-3", "--bind", "tcp://127.0.0.1:0"]) != 0
    assert "max_connections" in capsys.readouterr().err
