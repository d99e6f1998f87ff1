"""Per-node relays (`rankscope.hub.relay`): the node's collectors send to a relay over ipc,
the relay forwards bundles to a real hub over loopback tcp. What the hub stores must not
depend on the way the data came; the relay must never hold a collector up; clock pings
pass through."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from waiting import wait_for

from rankscope.collector.clock import ClockSync, clock_endpoint
from rankscope.collector.identity import Identity
from rankscope.collector.monitor import Monitor
from rankscope.collector.sender import Sender
from rankscope.diagnosis.engine import diagnose
from rankscope.hub.relay import Relay, RelayError, check_listen
from rankscope.hub.server import Hub
from rankscope.sim import emit, load_scenario


@pytest.fixture
def hub():
    h = Hub(bind="tcp://127.0.0.1:0", record_dir=None).start()
    yield h
    h.stop()


def _ipc(tmp_path: Path, name: str) -> str:
    return f"ipc://{tmp_path / name}"


def test_the_listening_side_stays_on_the_node() -> None:
    assert check_listen("ipc:///tmp/r.sock") == "ipc:///tmp/r.sock"
    assert check_listen("tcp://127.0.0.1:0") == "tcp://127.0.0.1:0"
    assert check_listen("tcp://[::1]:7000") == "tcp://[::1]:7000"
    for bad in ("tcp://10.0.0.1:5555", "tcp://node3:5555", "udp://x", "tcp://*:5555"):
        with pytest.raises(RelayError):
            check_listen(bad)
    with pytest.raises(RelayError, match="max_bundle_messages"):
        Relay("ipc:///tmp/r.sock", "tcp://127.0.0.1:5555", max_bundle_messages=0)


def test_a_collector_through_a_relay_reaches_the_hub_and_syncs_with_its_clock(
    hub: Hub, tmp_path: Path
) -> None:
    with Relay(_ipc(tmp_path, "relay"), hub.endpoint) as relay:
        assert relay.clock_endpoint == _ipc(tmp_path, "relay") + ".clock"
        # The node's socket files are the user's alone.
        assert (tmp_path / "relay").stat().st_mode & 0o077 == 0
        clock = ClockSync(relay.clock_endpoint, context=zmq.Context.instance())
        assert wait_for(lambda: (clock.tick(), clock.synced)[1], timeout=30)
        # The offset is to the hub's clock: hub time now, read through the offset.
        assert abs(clock.to_hub(time.monotonic_ns()) - time.time_ns()) < 50_000_000
        assert hub.transport_stats["clock_pings"] >= 1
        clock.socket.close(0)  # type: ignore[union-attr]

        ident = Identity(rank=0, world_size=1, local_rank=0, host="n0", node_rank=0, pid=1)
        mon = Monitor(
            job="j", run="relayed", identity=ident, hub=relay.endpoint, sample_interval_s=0
        )
        mon.start()
        try:
            # Its clock pings go through the relay too.
            assert wait_for(lambda: mon.pump.clock.synced, timeout=30)
            for step in range(5):
                with mon.step(step):
                    t = time.monotonic_ns()
                    mon.record_collective("all_reduce", 0, nbytes=8, t_enter=t, t_exit=t + 1000)
        finally:
            mon.close()

        def got() -> bool:
            ids = hub.store.run_ids()
            return "relayed" in ids and len(hub.store.window("relayed").steps) == 5

        assert wait_for(got, timeout=30)
        w = hub.store.window("relayed")
        assert np.all(w.present)
        assert hub.store.health["clock_error_ns"]["relayed"][0] < 50_000_000
    assert hub.transport_stats["bundles"] >= 1
    assert relay.counters.forwarded == hub.transport_stats["bundled"]
    assert relay.counters.dropped == 0
    assert not (tmp_path / "relay").exists()  # its socket files are gone with it


def _seeded(endpoint: str | None, relays: list[str] | None, run: str) -> emit.RunInfo:
    scenario = load_scenario("slow-device", ranks=32, seed=11)
    return emit.run(
        scenario,
        endpoint or "tcp://127.0.0.1:9",
        steps=12,
        run_id=run,
        t0_ns=1_700_000_000_000_000_000,
        relays=relays,
    )


def test_direct_and_relayed_runs_of_one_seeded_simulation_are_the_same(tmp_path: Path) -> None:
    """32 simulated ranks, 4 hosts, a slow device: once straight to one hub, once through
    two relays (two hosts each) to another. Last arrivers, lateness and wait sums, step
    times and the verdict must be identical."""
    direct_hub = Hub(bind="tcp://127.0.0.1:0", record_dir=None).start()
    relayed_hub = Hub(bind="tcp://127.0.0.1:0", record_dir=None).start()
    relays = [Relay(_ipc(tmp_path, f"r{k}"), relayed_hub.endpoint).start() for k in range(2)]
    try:
        a = _seeded(direct_hub.endpoint, None, "run")
        b = _seeded(None, [r.endpoint for r in relays], "run")
        # The same messages, and each of the 4 hosts' own groups (their relay learns them).
        assert a.dropped == b.dropped == 0 and b.messages == a.messages + 4

        def ingested(h: Hub, n: int) -> bool:
            return h.store.health["messages"] >= n

        assert wait_for(lambda: ingested(direct_hub, a.messages), timeout=60)
        assert wait_for(lambda: ingested(relayed_hub, b.messages), timeout=60)
        direct_hub.store.settle()
        relayed_hub.store.settle()
        wa, wb = direct_hub.store.window("run"), relayed_hub.store.window("run")
    finally:
        for r in relays:
            r.stop()
        direct_hub.stop()
        relayed_hub.stop()
    # Both relays carried their hosts' ranks, in bundles.
    assert all(r.counters.forwarded > 0 and r.counters.dropped == 0 for r in relays)
    assert relayed_hub.transport_stats["bundled"] == b.messages
    assert direct_hub.transport_stats["bundles"] == 0
    np.testing.assert_array_equal(wa.steps, wb.steps)
    np.testing.assert_array_equal(wa.present, wb.present)
    np.testing.assert_array_equal(wa.step_ns, wb.step_ns)
    for name in ("group", "seq", "last_rank", "first", "last", "skew", "transfer"):
        np.testing.assert_array_equal(getattr(wa.instances, name), getattr(wb.instances, name))
    for name, values in wa.coll.items():
        np.testing.assert_array_equal(values, wb.coll[name], err_msg=name)
    da, db = diagnose(wa), diagnose(wb)
    assert da.verdict.top.mechanism == db.verdict.top.mechanism == "slow_device"
    assert da.verdict.top.ranks == db.verdict.top.ranks


def test_without_its_hub_the_back_pressure_reaches_the_collectors_which_never_wait(
    tmp_path: Path,
) -> None:
    """The hub is not there: the relay queues one bundle upstream, holds the next and
    stops reading; its receive queue fills, then the collector's, which drops and counts
    (its stats tell the hub) without ever waiting. When a hub comes, what was held goes."""
    port = _free_port()
    upstream = f"tcp://127.0.0.1:{port}"
    relay = Relay(
        _ipc(tmp_path, "relay"), upstream, hwm=1, rcvhwm=10, max_bundle_messages=10, flush_s=0.01
    )
    relay.start()
    sender = Sender(relay.endpoint, hwm=10, context=zmq.Context.instance())
    try:
        n = 3000
        for _ in range(n):
            sender.send(_hello("held"))  # the collector's side never waits
        assert sender.dropped > 0 and sender.sent + sender.dropped == n
        assert wait_for(lambda: relay.counters.received >= 10, timeout=30)
        assert relay.counters.dropped == 0  # held, not thrown away
        hub = Hub(bind=upstream, record_dir=None).start()
        try:
            assert wait_for(lambda: "held" in hub.store.run_ids(), timeout=30)
            assert wait_for(lambda: relay.counters.forwarded >= 20, timeout=30)
        finally:
            hub.stop()
    finally:
        sender.close(linger_ms=0)
        relay.stop(drain_s=0)


def test_a_relay_forwards_again_when_its_hub_comes_back(tmp_path: Path) -> None:
    port = _free_port()
    upstream = f"tcp://127.0.0.1:{port}"
    relay = Relay(_ipc(tmp_path, "relay"), upstream, flush_s=0.01).start()
    sender = Sender(relay.endpoint, context=zmq.Context.instance())
    try:
        first = Hub(bind=upstream, record_dir=None).start()
        try:
            assert sender.send(_hello("before"))
            assert wait_for(lambda: "before" in first.store.run_ids(), timeout=30)
        finally:
            first.stop()
        second = Hub(bind=upstream, record_dir=None).start()
        try:
            # Sent until the new hub has one (what the relay sent into the gap is lost).
            assert wait_for(
                lambda: sender.send(_hello("after")) and "after" in second.store.run_ids(),
                timeout=30,
                every=0.2,
            )
        finally:
            second.stop()
        assert relay.counters.connects >= 2 and relay.counters.disconnects >= 1
    finally:
        sender.close(linger_ms=0)
        relay.stop(drain_s=0)


def test_rankscope_relay_forwards_until_interrupted(hub: Hub, tmp_path: Path) -> None:
    listen = _ipc(tmp_path, "cli")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rankscope",
            "relay",
            "--listen",
            listen,
            "--upstream",
            hub.endpoint,
            "--insecure",
            "--status-every",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_for(lambda: (tmp_path / "cli").exists(), timeout=60)
        sender = Sender(listen, context=zmq.Context.instance())
        assert sender.send(_hello("cli"))
        assert wait_for(lambda: "cli" in hub.store.run_ids(), timeout=30)
        sender.close(linger_ms=0)
    finally:
        proc.send_signal(2)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "relay on " + listen in out
    assert "forwarded 1 in 1 bundles | dropped 0" in out


def test_rankscope_relay_refuses_an_address_off_the_node(capsys) -> None:
    from rankscope.cli import main

    assert main(["relay", "--listen", "tcp://10.1.2.3:5555", "--upstream", "tcp://h:5555"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rankscope: error: ") and "own node only" in err


def _hello(run: str) -> bytes:
    from rankscope.collector import schema

    ident = {"rank": 0, "world_size": 1, "local_rank": 0, "host": "n0", "node_rank": 0, "pid": 1}
    return schema.encode(
        {"kind": "hello", "job": "j", "run": run, "rank": 0, "inc": 0, "identity": ident}
    )


def _free_port() -> int:
    from ports import free_port_pair

    return free_port_pair()


def test_clock_endpoint_of_a_relay_on_tcp_is_the_next_port() -> None:
    assert clock_endpoint("tcp://127.0.0.1:7000") == "tcp://127.0.0.1:7001"


RELAYED_SCRIPT = """
import os, time
import rankscope
mon = rankscope.start(rank=0, world_size=1, local_rank=0, host="n0", flush_interval_s=0.05)
assert os.environ["RANKSCOPE_HUB"].startswith("ipc://"), os.environ["RANKSCOPE_HUB"]
assert os.environ["RANKSCOPE_KEYS"] == "off"
for step in range(4):
    with mon.step(step):
        t = time.monotonic_ns()
        mon.record_collective("all_reduce", 0, nbytes=8, t_enter=t, t_exit=t + 1000)
rankscope.close()
"""


def test_rankscope_run_relay_puts_a_relay_between_the_command_and_the_hub(
    hub: Hub, tmp_path: Path
) -> None:
    script = tmp_path / "job.py"
    script.write_text(RELAYED_SCRIPT)
    argv = [sys.executable, "-m", "rankscope", "run", "--relay", "--hub", hub.endpoint]
    argv += ["--run", "via-relay", "--", sys.executable, str(script)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "relay on ipc://" in out.stderr and "dropped 0" in out.stderr, out.stderr

    def four() -> bool:
        return "via-relay" in hub.store.run_ids() and len(hub.store.window("via-relay").steps) == 4

    assert wait_for(four, timeout=30)
    assert hub.transport_stats["bundled"] >= 2  # the hello and the steps at least
    # The command's own exit status comes back through rankscope.
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "rankscope",
            "run",
            "--relay",
            "--hub",
            hub.endpoint,
            "--",
            sys.executable,
            "-c",
            "raise SystemExit(3)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 3, bad.stderr


def test_direct_and_reducing_relays_give_the_hub_the_same_run(tmp_path: Path) -> None:
    """The same seeded 32-rank run (tp=8 inside hosts of 8) straight to one hub, and to
    another through four node relays that reduce and a rack relay that gathers them:
    every aggregate, every instance and the verdict are identical, from a quarter of the
    bytes."""
    scenario = load_scenario(
        "slow-device", ranks=32, seed=11, layout__tp=8, topology__gpus_per_host=8
    )
    direct_hub = Hub(bind="tcp://127.0.0.1:0", record_dir=None).start()
    relayed_hub = Hub(bind="tcp://127.0.0.1:0", record_dir=None).start()
    rack = Relay(_ipc(tmp_path, "rack"), relayed_hub.endpoint, reduce=True).start()
    nodes = [Relay(_ipc(tmp_path, f"n{k}"), rack.endpoint, reduce=True).start() for k in range(4)]
    try:
        kw = {"steps": 12, "run_id": "run", "t0_ns": 1_700_000_000_000_000_000}
        a = emit.run(scenario, direct_hub.endpoint, **kw)
        b = emit.run(scenario, "tcp://127.0.0.1:9", relays=[n.endpoint for n in nodes], **kw)
        assert a.dropped == b.dropped == 0
        for n in nodes:
            n.stop()  # what they hold leaves first
        rack.stop()

        def settled(h: Hub) -> bool:
            return h.store.health["messages"] > 0 and h.store.run_state("run") is not None

        assert wait_for(lambda: direct_hub.store.health["messages"] >= a.messages, timeout=60)
        assert wait_for(lambda: settled(relayed_hub), timeout=60)
        assert wait_for(
            lambda: (
                relayed_hub.store.window("run").present.sum()
                == direct_hub.store.window("run").present.sum()
            ),
            timeout=60,
        )
        direct_hub.store.settle()
        relayed_hub.store.settle()
        wa, wb = direct_hub.store.window("run"), relayed_hub.store.window("run")
        rejects = relayed_hub.store.health["rejects"]
    finally:
        for r in (*nodes, rack):
            r.stop()
        direct_hub.stop()
        relayed_hub.stop()
    assert rejects == {}
    assert all(n.reducer is not None and n.reducer.counters.reduced_rows > 0 for n in nodes)
    assert rack.reducer is not None and rack.reducer.counters.merged > 0
    assert sum(n.counters.received_bytes for n in nodes) == b.bytes
    # ~0.35 of the ranks' packed messages reach the rack (under a quarter of them before
    # integer columns travelled packed: node-local groups save rows, not bytes per row).
    assert rack.counters.received_bytes < b.bytes / 2
    np.testing.assert_array_equal(wa.present, wb.present)
    np.testing.assert_array_equal(wa.step_ns, wb.step_ns)
    for name, values in wa.coll.items():
        np.testing.assert_array_equal(values, wb.coll[name], err_msg=name)
    ia, ib = wa.instances, wb.instances
    oa, ob = np.lexsort((ia.seq, ia.group)), np.lexsort((ib.seq, ib.group))
    for name in ("group", "seq", "last_rank", "first", "last", "margin"):
        np.testing.assert_array_equal(getattr(ia, name)[oa], getattr(ib, name)[ob])
    # Groups whose first step came before the rack's relay heard every member's hello go
    # on as parts (`hub.partial`): their median transfer is the parts' weighted median.
    ta, tb = ia.transfer[oa], ib.transfer[ob]
    assert np.nanmax(np.abs(ta - tb) / np.nanmedian(ta)) < 0.02
    da, db = diagnose(wa), diagnose(wb)
    assert da.verdict.top.mechanism == db.verdict.top.mechanism == "slow_device"
    assert da.verdict.top.ranks == db.verdict.top.ranks


def test_demo_through_relay_processes(capsys) -> None:
    import json

    from rankscope.cli import main

    argv = ["demo", "--scenario", "slow-device", "--ranks", "32", "--headless", "--steps", "6"]
    assert main([*argv, "--relays", "2", "--no-record", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["complete"] is True and r["lost"] == 0 and r["dropped"] == 0
    assert len(r["relays"]) == 2
    # Every message went through a relay: the hub counted them in bundles.
    forwarded = [int(x["summary"].split("forwarded ")[1].split()[0]) for x in r["relays"]]
    assert all(f > 0 for f in forwarded) and sum(forwarded) == r["sent"]
    assert r["bundles"] >= 2
    assert main([*argv, "--relays", "-1"]) == 2
    assert main([*argv, "--reduce"]) == 2  # reducing is what relays do


def test_demo_through_reducing_relay_processes(capsys) -> None:
    import json

    from rankscope.cli import main

    argv = ["demo", "--scenario", "slow-device", "--ranks", "32", "--headless", "--steps", "6"]
    assert main([*argv, "--relays", "2", "--reduce", "--no-record", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["complete"] is True and r["lost"] == 0 and r["dropped"] == 0
    assert all("node messages" in x["summary"] for x in r["relays"])


def test_a_multipart_message_beyond_a_bundle_is_counted_not_fed(hub: Hub) -> None:
    """Anyone may send a multipart message to the hub's data socket: frames past
    `MAX_BUNDLE_FRAMES` are read off and counted, the first ones fed as usual."""
    from rankscope.hub.server import MAX_BUNDLE_FRAMES

    ctx = zmq.Context.instance()
    push = ctx.socket(zmq.PUSH)
    push.connect(hub.endpoint)
    try:
        frames = [_hello("many")] + [b"junk"] * (MAX_BUNDLE_FRAMES + 9)
        push.send_multipart(frames)
        rejects = lambda: hub.store.health["rejects"]  # noqa: E731
        assert wait_for(lambda: rejects().get("too_many_frames", 0) == 10, timeout=30)
        assert wait_for(lambda: "many" in hub.store.run_ids(), timeout=30)
        # The junk frames within the bound were fed and rejected one by one, by decode.
        assert wait_for(lambda: rejects().get("bad_msgpack", 0) == MAX_BUNDLE_FRAMES - 1)
    finally:
        push.close(0)


def test_a_second_relay_on_a_live_socket_is_refused_a_stale_one_reused(tmp_path: Path) -> None:
    listen = _ipc(tmp_path, "relay")
    with Relay(listen, "tcp://127.0.0.1:9"), pytest.raises(RelayError, match="in use"):
        Relay(listen, "tcp://127.0.0.1:9").start()
    (tmp_path / "relay").write_bytes(b"")  # a file left behind by a killed relay
    with Relay(listen, "tcp://127.0.0.1:9") as again:
        assert again.endpoint == listen


def test_clock_pings_are_not_queued_for_an_absent_hub(tmp_path: Path) -> None:
    """With no hub behind the relay a ping is refused at once, never queued to come back
    later with a stale round trip; the collector's clock stays on its fallback."""
    upstream = f"tcp://127.0.0.1:{_free_port()}"
    with Relay(_ipc(tmp_path, "relay"), upstream) as relay:
        assert relay.clock_endpoint is not None
        clock = ClockSync(relay.clock_endpoint, context=zmq.Context.instance(), timeout_s=0.1)
        try:
            assert wait_for(lambda: (clock.tick(), relay.counters.clock_bad >= 2)[1], timeout=30)
            assert not clock.synced and relay.counters.clock_pings == 0
        finally:
            clock.socket.close(0)  # type: ignore[union-attr]


def test_two_levels_of_relays_carry_data_and_clock(hub: Hub, tmp_path: Path) -> None:
    """node relay -> rack relay -> hub: a bundle of bundles arrives as the ranks' messages,
    and a ping's envelope (two relays deep: four frames at the hub) still fits."""
    with (
        Relay("tcp://127.0.0.1:0", hub.endpoint) as rack,
        Relay(_ipc(tmp_path, "node"), rack.endpoint) as node,
    ):
        assert node.clock_endpoint is not None
        clock = ClockSync(node.clock_endpoint, context=zmq.Context.instance())
        try:
            assert wait_for(lambda: (clock.tick(), clock.synced)[1], timeout=30)
            assert abs(clock.to_hub(time.monotonic_ns()) - time.time_ns()) < 50_000_000
        finally:
            clock.socket.close(0)  # type: ignore[union-attr]
        sender = Sender(node.endpoint, context=zmq.Context.instance())
        for run in ("a", "b", "c"):
            assert sender.send(_hello(run))
        sender.close(linger_ms=1000)
        assert wait_for(lambda: {"a", "b", "c"} <= set(hub.store.run_ids()), timeout=30)
    assert hub.transport_stats["bundled"] == 3 and hub.store.health["rejects"] == {}


def test_a_collector_with_keys_speaks_plain_to_its_nodes_relay(
    hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys found in the environment are for tcp: to an ipc relay the collector speaks
    plain ZeroMQ (a CURVE handshake there would be refused and every message lost)."""
    import rankscope
    from rankscope.commands.keys import make_keys

    make_keys(tmp_path / "keys", ["client"], force=False)
    monkeypatch.setenv("RANKSCOPE_KEYS", str(tmp_path / "keys"))
    with Relay(_ipc(tmp_path, "relay"), hub.endpoint) as relay:
        mon = rankscope.start(
            job="j", run="keyed", hub=relay.endpoint, rank=0, world_size=1, local_rank=0
        )
        try:
            assert mon.pump.curve is None
            with mon.step(0):
                pass
        finally:
            rankscope.close()
        assert wait_for(lambda: "keyed" in hub.store.run_ids(), timeout=30)


def test_a_racks_relay_serves_the_hubs_keys_to_the_nodes_relays(tmp_path: Path) -> None:
    """A rack's relay, which other nodes reach over the network, listens as a CURVE server
    with the hub's keys: a node's relay with an authorised client key gets through (its
    node message reaches the hub), one speaking plain delivers nothing; without keys the
    same address beyond loopback is refused."""
    from rankscope.collector.security import load_client_curve
    from rankscope.commands.keys import make_keys
    from rankscope.hub.security import load_hub_security

    keys = tmp_path / "keys"
    make_keys(keys, ["client"], force=False)
    with pytest.raises(RelayError, match="--serve-keys"):
        Relay("tcp://10.1.2.3:7000", "tcp://127.0.0.1:9")
    served = load_hub_security(keys)
    assert Relay("tcp://0.0.0.0:7000", "tcp://127.0.0.1:9", server=served).listen

    hub = Hub(bind="tcp://127.0.0.1:0", record_dir=None).start()
    rack = Relay("tcp://127.0.0.1:0", hub.endpoint, reduce=True, server=served).start()
    plain = Relay(_ipc(tmp_path, "plain"), rack.endpoint, reduce=True).start()
    node = Relay(
        _ipc(tmp_path, "node"), rack.endpoint, reduce=True, curve=load_client_curve(keys)
    ).start()
    scenario = load_scenario("healthy", ranks=16, seed=2, layout__tp=8, topology__gpus_per_host=8)
    try:
        emit.run(scenario, "tcp://127.0.0.1:9", steps=3, run_id="good", relays=[node.endpoint])
        emit.run(scenario, "tcp://127.0.0.1:9", steps=3, run_id="bad", relays=[plain.endpoint])
        node.stop()
        plain.stop()
        assert wait_for(lambda: hub.store.health.get("node_messages", 0) > 0, timeout=30)
        rack.stop()
        w = hub.store.window("good")
        assert w.present.all() and np.nansum(w.reduced["n"]) > 0
        assert "bad" not in hub.store.run_ids()
    finally:
        for r in (node, plain, rack):
            r.stop()
        hub.stop()
