"""The hub over real ZeroMQ sockets: raw PUSH senders, the clock ROUTER, restarts."""

import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
from test_hub_job import assert_windows_equal, header, job
from waiting import wait_for

from rankscope.collector import schema
from rankscope.hub.intake import Intake
from rankscope.hub.replay import load
from rankscope.hub.server import Hub, parse_bind
from rankscope.hub.store import Store


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def pusher(ctx, endpoint):
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 2000)
    s.connect(endpoint)
    return s


def test_parse_bind() -> None:
    assert parse_bind("tcp://127.0.0.1:0") == ("tcp", "127.0.0.1", 0)
    assert parse_bind("tcp://*:5555") == ("tcp", "*", 5555)
    assert parse_bind("tcp://*:*") == ("tcp", "*", 0)
    assert parse_bind("ipc:///tmp/x") == ("ipc", "/tmp/x", -1)
    for bad in ("127.0.0.1:5", "tcp://host", "tcp://h:65535", "tcp://h:x"):
        with pytest.raises(ValueError, match=r"port|tcp://"):
            parse_bind(bad)


def test_port_zero_binds_data_and_clock_side_by_side(ctx) -> None:
    with Hub() as hub, Hub() as other:
        assert hub.endpoint.startswith("tcp://127.0.0.1:")
        assert hub.clock_endpoint == f"tcp://127.0.0.1:{hub.port + 1}"
        assert hub.port != other.port
        # The same fixed port twice fails with a clear error.
        with pytest.raises(zmq.ZMQError, match="cannot bind"):
            Hub(f"tcp://127.0.0.1:{hub.port}").start()


def test_clock_router_answers_pings(ctx) -> None:
    with Hub() as hub:
        d = ctx.socket(zmq.DEALER)
        d.connect(hub.clock_endpoint)
        before = time.time_ns()
        d.send(msgpack.packb({"v": 1, "t0": 12345}))
        assert d.poll(10_000)
        reply = msgpack.unpackb(d.recv())
        assert reply["v"] == 1 and reply["t0"] == 12345
        assert before <= reply["t_hub"] <= time.time_ns()
        # REQ-style envelopes work too; garbage is ignored and counted.
        r = ctx.socket(zmq.REQ)
        r.connect(hub.clock_endpoint)
        d.send(b"\xc1junk")
        r.send(msgpack.packb({"v": 1, "t0": 7}))
        assert r.poll(10_000)
        assert msgpack.unpackb(r.recv())["t0"] == 7
        assert wait_for(lambda: hub.health["transport"]["clock_bad"] == 1)
        assert hub.health["transport"]["clock_pings"] == 2


def test_robustness_every_bad_input_counted_and_valid_data_kept(ctx, tmp_path) -> None:
    j = job(world=4, steps=6, slow=1)
    n_first = len(j.messages) // 2
    with Hub(record_dir=str(tmp_path)) as hub:
        s = pusher(ctx, hub.endpoint)
        for m in j.messages[:n_first]:
            s.send(m)
        bad = [
            b"garbage bytes \x00\xff",
            msgpack.packb({**header(j.run, 0), "v": 99, "kind": "steps"}),
            schema.steps_message(header("nobody-said-hello", 0), _steps([100])),
        ]
        for b in bad:
            s.send(b)
        # Duplicates and an out-of-order step from rank 0.
        s.send(j.steps[0][0])
        s.send(schema.steps_message(header(j.run, 0), _steps([1000])))
        s.send(schema.steps_message(header(j.run, 0), _steps([999])))
        # An oversized message is cut by ZeroMQ at the transport: its connection resets.
        big = ctx.socket(zmq.PUSH)
        big.connect(hub.endpoint)
        big.send(b"\x00" * (schema.MAX_MESSAGE_BYTES + 1024))
        assert wait_for(lambda: hub.health["transport"]["disconnects"] >= 1)
        big.close(0)
        for m in j.messages[n_first:]:
            s.send(m)
        assert wait_for(lambda: hub.store.health["messages"] >= len(j.messages) + 2)
        h = hub.health
        assert h["rejects"] == {
            "bad_msgpack": 1,
            "bad_version": 1,
            "unknown_rank": 1,
            "duplicate_step": 1,
        }
        w = hub.store.window(j.run)
        assert w.steps.tolist() == [0, 1, 2, 3, 4, 5, 999, 1000]
        assert w.present[:, :6].all() and w.present[0, 6:].all()
        assert (w.instances.last_rank[w.instances.group == 0] == 1).all()
        s.close(0)
    # Everything accepted is in the recording, rejects in its meta.
    replayed = load(tmp_path)
    assert_windows_equal(replayed.window(j.run), hub.store.window(j.run))
    assert replayed.health["recorded"]["rejects"]["bad_msgpack"] == 1


def _steps(steps):
    st = schema.empty_table("steps", len(steps))
    st["step"][:] = steps
    st["t_start"][:] = [1_700_000_000_000_000_000 + s for s in steps]
    st["t_end"][:] = st["t_start"] + 10
    return st


def test_restart_on_the_same_port_and_record_dir_loses_nothing(ctx, tmp_path) -> None:
    j = job(world=2, steps=8, slow=1)
    half = len(j.messages) // 2
    first = Hub(record_dir=str(tmp_path)).start()
    port = first.port
    s = pusher(ctx, first.endpoint)
    for m in j.messages[:half]:
        s.send(m)
    assert wait_for(lambda: first.store.health["messages"] >= half)
    first.stop()
    first.stop()  # idempotent
    # The sender keeps its socket: ZeroMQ reconnects when the hub is back.
    second = Hub(f"tcp://127.0.0.1:{port}", record_dir=str(tmp_path)).start()
    for m in j.messages[half:]:
        s.send(m)
    # The second hub resumed from the recording: it knows the ranks without a new hello.
    assert second.resumed_frames == half
    assert wait_for(lambda: second.store.health["messages"] >= len(j.messages))
    assert second.store.health["rejects"] == {}
    second.stop()
    s.close(0)
    replayed = load(tmp_path)
    assert replayed.health["recording"]["skipped"] == []
    whole = Store()
    intake = Intake(whole)
    for m in j.messages:
        intake.feed(m)
    assert_windows_equal(replayed.window(j.run), whole.window(j.run))
    assert_windows_equal(second.store.window(j.run), whole.window(j.run))
    assert replayed.health["recorded"]["sessions"] == 2


def test_stop_before_start_and_repeated_stop() -> None:
    hub = Hub()
    hub.stop()
    hub.stop()
    assert hub.store.runs() == []


def test_window_while_ingesting_is_consistent(ctx) -> None:
    j = job(world=4, steps=30, slow=0)
    with Hub() as hub:
        s = pusher(ctx, hub.endpoint)
        for m in j.messages:
            s.send(m)
        seen = []
        while hub.store.health["messages"] < len(j.messages):
            if hub.store.run_ids():
                w = hub.store.window(j.run)
                seen.append(w.steps.shape[0])
                assert np.isnan(w.coll["n"][~w.present]).all()
            time.sleep(0.005)
        assert hub.store.window(j.run).present.all()
        s.close(0)


def test_a_stalled_disk_does_not_stall_ingest(ctx, tmp_path, monkeypatch) -> None:
    """The recording's thread writes; the receive loop only queues. While every write is
    held, the hub still takes and stores every message; once the disk answers, the
    recording holds them all, in order."""
    from rankscope.hub import recording

    release = threading.Event()
    writing = threading.Event()
    real_write = recording._write_all

    def held_write(fd, chunks):
        writing.set()
        release.wait(30)
        return real_write(fd, chunks)

    monkeypatch.setattr(recording, "_write_all", held_write)
    j = job(world=2, steps=8, slow=1)
    hub = Hub(record_dir=str(tmp_path), flush_s=0.02).start()
    try:
        s = pusher(ctx, hub.endpoint)
        s.send(j.messages[0])
        assert writing.wait(20), "the recording's thread never tried to write"
        for m in j.messages[1:]:
            s.send(m)
        # Every message is stored while the first write is still held.
        assert wait_for(lambda: hub.store.health["messages"] >= len(j.messages))
        assert not release.is_set()
        # What waits for the disk shows in the hub's health.
        behind = sum(len(m) for m in j.messages[1:])
        assert hub.health["record_backlog_bytes"] >= behind
        release.set()
        assert wait_for(lambda: hub.health["record_backlog_bytes"] == 0)
    finally:
        release.set()
        hub.stop()
        s.close(0)
    assert [f.payload for f in recording.read_frames(tmp_path)] == j.messages
