"""Drill-down past a reducing relay (`rankscope.hub.rawring`, ``rankscope fetch``): the
relay keeps its ranks' recent messages as sent, bounded in bytes, and serves the ranks and
steps asked for; the reply replays as an ordinary recording. Requests from anyone who can
reach the socket are checked field by field."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from waiting import wait_for

from rankscope.cli import main
from rankscope.collector import schema
from rankscope.hub.rawring import (
    PROTOCOL,
    RawRequestError,
    RawRing,
    Request,
    answer,
    fetch,
    parse_request,
)
from rankscope.hub.recording import read_frames
from rankscope.hub.relay import Relay
from rankscope.hub.server import Hub
from rankscope.sim import Cluster, load_scenario
from rankscope.sim.emit import Kept, RankStreams

T0 = 1_700_000_000_000_000_000


def _messages(steps: int = 10, ranks: int = 16) -> list[tuple[int, bytes]]:
    """A seeded tp=8 run on hosts of 8: (sending rank, message), in sending order."""
    scenario = load_scenario(
        "slow-device", ranks=ranks, seed=5, layout__tp=8, topology__gpus_per_host=8
    )
    cluster = Cluster(scenario, t0_ns=T0)
    keep = Kept()
    streams = RankStreams(cluster, keep, run_id="run", scope="full", node_groups=True)
    streams.start()
    for k in range(steps):
        streams.add(cluster.step(k))
    streams.finish()
    return keep.out


def _kind_steps(data: bytes) -> tuple[str, int, int]:
    m = schema.decode(data)
    steps = [t["step"] for t in m.tables.values() if "step" in t and t["step"].size]
    if not steps:
        return m.kind, -1, -1
    return m.kind, int(min(s.min() for s in steps)), int(max(s.max() for s in steps))


def _ring_of(msgs, max_bytes=1 << 30) -> RawRing:
    ring = RawRing(max_bytes)
    for i, (_, data) in enumerate(msgs):
        ring.add(data, t_recv=T0 + i)
    return ring


def test_the_ring_returns_the_ranks_and_steps_asked_for_byte_for_byte() -> None:
    msgs = _messages()
    ring = _ring_of(msgs)
    run, got, cut = ring.select(None, {2, 3}, (4, 6))
    assert run == "run" and not cut
    want_rows = [
        d
        for r, d in msgs
        if r in (2, 3)
        and (k := _kind_steps(d))[0] in ("steps", "samples", "stats")
        and (k[1] < 0 or (k[2] >= 4 and k[1] <= 6))
    ]
    ids = [d for r, d in msgs if r in (2, 3) and _kind_steps(d)[0] in ("hello", "groups")]
    got_data = [e.data for e in got]
    # Identities first (each rank's hello, then its group tables), then the rows in order.
    assert sorted(got_data[: len(ids)]) == sorted(ids)
    assert got_data[len(ids) :] == want_rows
    assert {schema.decode(e.data).header["rank"] for e in got} == {2, 3}
    assert ring.held("run", [2, 3]) == {2: (0, 9), 3: (0, 9)}
    # The newest N steps of those ranks.
    _, newest, _ = ring.select("run", {2}, None, last=2)
    rows = [e for e in newest if schema.decode(e.data).kind == "steps"]
    assert rows and all(e.last >= 8 for e in rows)


def test_the_ring_is_bounded_in_bytes_and_says_what_it_still_holds() -> None:
    msgs = _messages()
    total = sum(len(d) for r, d in msgs if _kind_steps(d)[0] in ("steps", "samples", "stats"))
    ring = _ring_of(msgs, max_bytes=total // 3)
    assert ring.counters.evicted > 0
    assert ring.nbytes <= total // 3 + ring.max_identity_bytes
    held = ring.held("run", range(16))
    # The oldest steps were evicted, the newest kept, for every rank.
    assert all(lo > 0 and hi == 9 for lo, hi in held.values()), held
    # Identities survive the eviction of rows: what is returned still replays.
    _, got, _ = ring.select("run", {5}, None)
    assert schema.decode(got[0].data).kind == "hello"


def test_identities_are_bounded_apart() -> None:
    ring = RawRing(1 << 20, max_identity_bytes=4096)
    for run in range(50):
        hello = schema.hello_message(
            {"job": "j", "run": f"r{run}", "rank": 0, "inc": 0, "batch": 0},
            {"rank": 0, "world_size": 1, "local_rank": 0, "host": "h", "pid": 1, "node_rank": 0},
        )
        assert ring.add(hello, t_recv=run)
    assert ring.nbytes <= 4096
    assert "r49" in ring.runs() and "r0" not in ring.runs()


@pytest.mark.parametrize(
    "body, says",
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb([1, 2]), "must be a map"),
        (msgpack.packb({"v": "other/9"}), "v must be"),
        (msgpack.packb({"v": PROTOCOL, "ranks": [1, -1]}), "ranks[1]"),
        (msgpack.packb({"v": PROTOCOL, "ranks": [True]}), "ranks[0]"),
        (msgpack.packb({"v": PROTOCOL, "ranks": "0-7"}), "ranks must be a list"),
        (msgpack.packb({"v": PROTOCOL, "steps": [5, 2]}), "before first"),
        (msgpack.packb({"v": PROTOCOL, "steps": [1]}), "steps must be"),
        (msgpack.packb({"v": PROTOCOL, "steps": [1, 2], "last": 3}), "give one of them"),
        (msgpack.packb({"v": PROTOCOL, "run": ""}), "run must be"),
        (msgpack.packb({"v": PROTOCOL, "max_bytes": 0}), "max_bytes"),
        (msgpack.packb({"v": PROTOCOL, "drop": 1}), "unknown field"),
        (b"\x00" * (70 << 10), "bytes (at most"),
    ],
)
def test_a_bad_request_is_refused_naming_the_field(body: bytes, says: str) -> None:
    with pytest.raises(RawRequestError) as err:
        parse_request(body)
    assert says in str(err.value)
    ring = RawRing(1 << 20)
    head = msgpack.unpackb(answer(ring, body)[0])
    assert head["ok"] is False and says in head["error"]
    assert ring.counters.bad_requests == 1


def test_a_reply_is_bounded_and_says_it_was_cut() -> None:
    ring = _ring_of(_messages())
    frames = answer(ring, Request(ranks=(0, 1), max_bytes=20_000).encode())
    head = msgpack.unpackb(frames[0])
    assert head["ok"] and head["cut"]
    assert sum(map(len, frames[1:])) <= 20_000
    assert head["messages"] == len(frames) - 1 == len(head["t_recv"])


def test_fetch_from_a_reducing_relay_writes_a_recording_of_the_raw_rows(
    tmp_path: Path, capsys
) -> None:
    """A node's relay reduces its tensor-parallel groups for the hub and keeps the raw
    messages; ``rankscope fetch`` copies two ranks' steps 4-7 into a recording that holds
    exactly what those ranks sent, which replays and exports like any run."""
    msgs = _messages()
    node0 = [(r, d) for r, d in msgs if r < 8]
    hub = Hub(bind="tcp://127.0.0.1:0", record_dir=None).start()
    relay = Relay(f"ipc://{tmp_path / 'n0'}", hub.endpoint, reduce=True, raw_ring_bytes=64 << 20)
    relay.start()
    push = zmq.Context.instance().socket(zmq.PUSH)
    try:
        assert relay.raw_endpoint == f"ipc://{tmp_path / 'n0'}.raw"
        assert (tmp_path / "n0.raw").stat().st_mode & 0o077 == 0
        push.connect(relay.endpoint)
        for _, data in node0:
            push.send(data)
        assert wait_for(lambda: relay.counters.received == len(node0), timeout=60)
        assert wait_for(lambda: relay.reducer.counters.reduced_rows > 0, timeout=60)
        rec = tmp_path / "drill"
        argv = ["fetch", relay.raw_endpoint, "--ranks", "2-3", "--step-range", "4:7"]
        assert main([*argv, "--record", str(rec)]) == 0
        # Ranks the relay never saw are said, not silently absent.
        reply = fetch(relay.raw_endpoint, Request(ranks=(3, 12)), timeout_s=10)
        assert reply.missing == [12] and reply.messages
        none = main(["fetch", relay.raw_endpoint, "--ranks", "12", "--record", str(tmp_path / "x")])
        assert none == 2 and "ranks not held: 12" in capsys.readouterr().err
        assert not (tmp_path / "x").exists()
    finally:
        push.close(0)
        relay.stop()
        hub.stop()
    recorded = [f.payload for f in read_frames(rec)]
    want = [
        d
        for r, d in node0
        if r in (2, 3)
        and (
            (k := _kind_steps(d))[0] in ("hello", "groups")
            or (k[0] in ("steps", "samples", "stats") and (k[1] < 0 or (k[2] >= 4 and k[1] <= 7)))
        )
    ]
    assert sorted(recorded) == sorted(want)
    meta = json.loads((rec / "meta.json").read_text())
    source = meta["sessions"][-1]["source"]
    assert source["kind"] == "relay-raw" and source["ranks"] == [2, 3]
    assert source["held"] == {"2": [0, 9], "3": [0, 9]}
    # The recording reads like any run: the two ranks' steps 4-7, row by row.
    out = tmp_path / "trace.json"
    assert main(["export", str(rec), "--perfetto", str(out)]) == 0
    trace = json.loads(out.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert any(e.get("ph") == "X" for e in events)
    from rankscope.commands.grammar import load_run

    _, w = load_run(str(rec), "run", 100)
    present = np.flatnonzero(w.present.any(axis=1))
    assert present.tolist() == [2, 3]
    assert set(w.steps.tolist()) == {4, 5, 6, 7}


def test_fetch_says_what_was_wrong(tmp_path: Path, capsys) -> None:
    assert (
        main(
            ["fetch", "ipc:///nonexistent/raw", "--record", str(tmp_path / "r"), "--timeout", "0.3"]
        )
        == 2
    )
    assert "no answer" in capsys.readouterr().err
    assert main(["fetch", "ipc:///x", "--ranks", "3-1", "--record", str(tmp_path / "r")]) == 2
    assert "--ranks" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_the_raw_endpoint_stays_on_the_node_and_needs_a_ring(tmp_path: Path, capsys) -> None:
    from rankscope.hub.relay import RelayError

    up = "tcp://127.0.0.1:9"
    with pytest.raises(RelayError, match="its own node"):
        Relay(
            f"ipc://{tmp_path / 'r'}", up, raw_ring_bytes=1 << 20, raw_endpoint="tcp://10.1.2.3:7"
        )
    with pytest.raises(RelayError, match="needs a raw ring"):
        Relay(f"ipc://{tmp_path / 'r'}", up, raw_endpoint=f"ipc://{tmp_path / 'x'}")
    assert main(["relay", "--upstream", up, "--raw-endpoint", f"ipc://{tmp_path / 'x'}"]) == 2
    assert "--raw-endpoint needs --raw-ring" in capsys.readouterr().err
    # On tcp, a free loopback port of its own, answering.
    with Relay("tcp://127.0.0.1:0", up, raw_ring_bytes=1 << 20) as relay:
        assert relay.raw_endpoint is not None and relay.raw_endpoint.startswith("tcp://127.0.0.1:")
        reply = fetch(relay.raw_endpoint, Request(), timeout_s=10)
        assert reply.run is None and reply.messages == []
