"""Recording format: round trip, damage recovery, following a growing recording."""

import json
import os
import struct
import threading

import pytest
from test_hub_job import assert_windows_equal, job

from rankscope.hub import recording
from rankscope.hub.intake import Intake
from rankscope.hub.recording import (
    ReadReport,
    RecordingError,
    RecordingWriter,
    follow,
    read_frames,
    segments,
)
from rankscope.hub.replay import Follower, load
from rankscope.hub.store import Store

HEADER = 16
FRAME = 20


def write(path, payloads, **kw):
    w = RecordingWriter(path, **kw)
    for i, p in enumerate(payloads):
        w.append(p, 1000 + i)
    w.close({"rejects": {"bad_msgpack": 2}})
    return w


def payloads(n=5):
    return [bytes([i]) * (10 + 7 * i) for i in range(n)]


def test_round_trip_and_meta(tmp_path) -> None:
    write(tmp_path, payloads())
    frames = list(read_frames(tmp_path))
    assert [f.payload for f in frames] == payloads()
    assert [f.t_recv_ns for f in frames] == [1000, 1001, 1002, 1003, 1004]
    assert frames[0].offset == HEADER and frames[0].segment == "segment-000000.rsrec"
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["format"] == "rankscope-recording" and meta["version"] == recording.FORMAT_VERSION
    (s,) = meta["sessions"]
    assert s["messages"] == 5 and s["stopped_ns"] is not None
    assert s["counters"] == {"rejects": {"bad_msgpack": 2}}


def test_second_writer_starts_a_new_segment_that_readers_join(tmp_path) -> None:
    write(tmp_path, payloads(3))
    write(tmp_path, [b"later"])
    assert [p.name for p in segments(tmp_path)] == ["segment-000000.rsrec", "segment-000001.rsrec"]
    assert [f.payload for f in read_frames(tmp_path)] == [*payloads(3), b"later"]
    assert len(json.loads((tmp_path / "meta.json").read_text())["sessions"]) == 2


def test_one_writer_at_a_time(tmp_path) -> None:
    w = RecordingWriter(tmp_path)
    with pytest.raises(RecordingError, match="another hub"):
        RecordingWriter(tmp_path)
    w.close()
    RecordingWriter(tmp_path).close()


def test_rotation_by_size(tmp_path) -> None:
    write(tmp_path, payloads(6), max_segment_bytes=120, flush_s=0.0)
    assert len(segments(tmp_path)) > 1
    assert [f.payload for f in read_frames(tmp_path)] == payloads(6)


def test_truncated_tail_keeps_everything_before_it(tmp_path) -> None:
    ps = payloads()
    write(tmp_path, ps, format_version=1)  # offsets of format 1's frames
    seg = segments(tmp_path)[0]
    size = seg.stat().st_size
    os.truncate(seg, size - 5)
    report = ReadReport()
    assert [f.payload for f in read_frames(tmp_path, report)] == ps[:-1]
    (skip,) = report.skipped
    assert skip.reason == "truncated"
    assert skip.nbytes == FRAME + len(ps[-1]) - 5
    assert skip.offset == size - FRAME - len(ps[-1])
    # A tail cut inside the frame header too.
    os.truncate(seg, size - len(ps[-1]) - FRAME + 3)
    report = ReadReport()
    assert len(list(read_frames(tmp_path, report))) == 4
    assert report.skipped[0].nbytes == 3


def test_corrupt_frame_is_skipped_and_the_rest_read(tmp_path) -> None:
    ps = payloads()
    write(tmp_path, ps, format_version=1)  # offsets of format 1's frames
    seg = segments(tmp_path)[0]
    data = bytearray(seg.read_bytes())
    third = HEADER + sum(FRAME + len(p) for p in ps[:2])
    data[third + FRAME + 3] ^= 0xFF  # a flipped payload byte: checksum mismatch
    seg.write_bytes(bytes(data))
    report = ReadReport()
    got = [f.payload for f in read_frames(tmp_path, report)]
    assert got == ps[:2] + ps[3:]
    (skip,) = report.skipped
    assert (skip.reason, skip.offset, skip.nbytes) == ("corrupt", third, FRAME + len(ps[2]))


def test_garbage_between_frames_and_bad_length(tmp_path) -> None:
    ps = payloads(3)
    write(tmp_path, ps, format_version=1)  # offsets of format 1's frames
    seg = segments(tmp_path)[0]
    data = bytearray(seg.read_bytes())
    second = HEADER + FRAME + len(ps[0])
    struct.pack_into("<I", data, second + 4, 0xFFFFFFF0)  # length beyond any message
    seg.write_bytes(bytes(data) + b"trailing junk")
    report = ReadReport()
    assert [f.payload for f in read_frames(tmp_path, report)] == [ps[0], ps[2]]
    assert [s.reason for s in report.skipped] == ["corrupt", "truncated"]
    assert report.skipped[1].nbytes == len(b"trailing junk")


def test_not_a_recording(tmp_path) -> None:
    with pytest.raises(RecordingError, match="no recording segments"):
        list(read_frames(tmp_path))
    (tmp_path / "segment-000000.rsrec").write_bytes(b"hello world, not a segment")
    report = ReadReport()
    assert list(read_frames(tmp_path, report)) == []
    assert report.skipped[0].reason == "bad_header"


def test_newer_format_is_refused_with_its_version(tmp_path) -> None:
    write(tmp_path, payloads(1))
    seg = segments(tmp_path)[0]
    data = bytearray(seg.read_bytes())
    struct.pack_into("<I", data, 8, 99)
    seg.write_bytes(bytes(data))
    with pytest.raises(RecordingError, match="version 99"):
        list(read_frames(tmp_path))


def test_follow_yields_frames_as_they_land_across_segments(tmp_path) -> None:
    got: list[bytes] = []
    stop = threading.Event()
    seen = threading.Condition()

    def reader() -> None:
        for f in follow(tmp_path, poll_s=0.01, stop=stop):
            with seen:
                got.append(f.payload)
                seen.notify_all()

    t = threading.Thread(target=reader)
    t.start()
    w = RecordingWriter(tmp_path, flush_s=0.0)
    for i in range(3):
        w.append(b"a%d" % i, i)
        w.flush()
        with seen:
            assert seen.wait_for(lambda i=i: len(got) == i + 1, timeout=10)
    # A partial frame at the end is waited for, not reported.
    w.append(b"b0", 9)
    w.close()
    w2 = RecordingWriter(tmp_path, flush_s=0.0)
    w2.append(b"c0", 10)
    w2.close()
    with seen:
        assert seen.wait_for(lambda: len(got) == 5, timeout=10)
    stop.set()
    t.join(timeout=10)
    assert got == [b"a0", b"a1", b"a2", b"b0", b"c0"]


def test_replay_builds_the_live_store(tmp_path) -> None:
    j = job(world=4, steps=5, slow=3)
    live = Store()
    w = RecordingWriter(tmp_path)
    intake = Intake(live, w)
    for m in j.messages:
        intake.feed(m)
    intake.feed(b"garbage")  # rejected: neither stored nor recorded
    w.close({"rejects": live.health["rejects"]})
    replayed = load(tmp_path)
    assert_windows_equal(replayed.window(j.run), live.window(j.run))
    assert replayed.runs() == live.runs()
    h = replayed.health
    assert h["rejects"] == {}
    assert h["recorded"]["rejects"] == {"bad_msgpack": 1}
    assert h["recording"]["frames"] == len(j.messages)
    assert h["recording"]["skipped"] == []


def test_follower_feeds_a_store_while_the_recording_grows(tmp_path) -> None:
    j = job(world=2, steps=4, slow=1)
    live = Store()
    w = RecordingWriter(tmp_path, flush_s=0.0)
    intake = Intake(live, w)
    half = len(j.messages) // 2
    for m in j.messages[:half]:
        intake.feed(m)
    w.flush()
    f = Follower(tmp_path, poll_s=0.01).start()
    for m in j.messages[half:]:
        intake.feed(m)
    w.close()
    import time

    deadline = time.monotonic() + 20
    while f.store.health["messages"] < len(j.messages) and time.monotonic() < deadline:
        time.sleep(0.02)
    f.stop()
    assert_windows_equal(f.store.window(j.run), live.window(j.run))


@pytest.mark.parametrize("background", [False, True])
def test_round_trip_with_and_without_the_writer_thread(tmp_path, background) -> None:
    many = payloads(40)
    w = RecordingWriter(tmp_path, flush_s=0.001, background=background)
    for i, p in enumerate(many):
        w.append(p, 1000 + i)
        if i % 7 == 0:
            w.flush()  # a flush from another caller interleaves with the thread's
    w.close({"rejects": {}})
    frames = list(read_frames(tmp_path))
    assert [f.payload for f in frames] == many
    assert [f.t_recv_ns for f in frames] == list(range(1000, 1040))
    (s,) = json.loads((tmp_path / "meta.json").read_text())["sessions"]
    assert s["messages"] == 40 and s["stopped_ns"] is not None


def test_a_failed_background_write_is_reported_and_its_frames_kept(tmp_path, monkeypatch) -> None:
    real_write = recording._write_all
    failed = threading.Event()
    calls = []

    def failing_once(fd, chunks):
        calls.append(len(chunks))
        if len(calls) == 1:
            failed.set()
            raise OSError(28, "No space left on device")
        return real_write(fd, chunks)

    monkeypatch.setattr(recording, "_write_all", failing_once)
    w = RecordingWriter(tmp_path, flush_s=0.01, background=True)
    w.append(b"first", 1)
    assert failed.wait(20)
    # The thread's failure reaches the next append (the hub counts it as record_error);
    # the message itself is queued all the same.
    with pytest.raises(RecordingError, match="No space left"):
        w.append(b"second", 2)
    w.append(b"third", 3)  # reported once
    w.close()
    assert [f.payload for f in read_frames(tmp_path)] == [b"first", b"second", b"third"]


def test_a_backlog_past_its_bound_is_written_by_the_appender(tmp_path, monkeypatch) -> None:
    """When the disk falls behind by ``max_backlog_bytes``, `append` waits for it: memory
    stays bounded and the hub slows to the disk's pace (ZeroMQ then holds what comes)."""
    real_write = recording._write_all
    release = threading.Event()
    writing = threading.Event()

    def held_write(fd, chunks):
        writing.set()
        release.wait(30)
        return real_write(fd, chunks)

    monkeypatch.setattr(recording, "_write_all", held_write)
    w = RecordingWriter(tmp_path, flush_s=0.01, background=True, max_backlog_bytes=200)
    w.append(b"a" * 50, 1)
    assert writing.wait(20)  # the thread holds the file, its write stuck
    w.append(b"b" * 50, 2)  # under the bound: queued, returns at once
    blocked = threading.Thread(target=w.append, args=(b"c" * 200, 3))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive(), "append returned while the backlog was past its bound"
    release.set()
    blocked.join(20)
    assert not blocked.is_alive()
    w.close()
    assert [f.payload for f in read_frames(tmp_path)] == [b"a" * 50, b"b" * 50, b"c" * 200]
