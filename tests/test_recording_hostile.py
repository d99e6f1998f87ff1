"""Hostile recordings (issue 17): bad records already on disk, broken ``meta.json``, odd
segment numbering, a killed hub, and a fuzz of the decoder and every reader.

A bad record — one an older hub accepted and the current one refuses — is skipped and
reported (segment, offset, what was wrong), never a traceback, and costs nothing else of
the recording. The recordings are written with `RecordingWriter` directly, bypassing the
hub's validation, as an older hub would have (`hostile_records`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import hostile_records as hostile
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hub_job import assert_windows_equal, header, identity, job

from rankscope.collector import schema
from rankscope.diagnosis.assemble import rank_info
from rankscope.hub import recording, replay
from rankscope.hub.inspection import inspect_recording
from rankscope.hub.recording import (
    META_NAME,
    ReadReport,
    RecordingError,
    RecordingWriter,
    read_frames,
    read_meta,
    segments,
    session_liveness,
)

REFUSED = (
    "hello_mesh_str",
    "hello_mesh_list",
    "hello_mesh_float",
    "hello_mesh_not_map",
    "hello_mesh_big",
    "hello_rail_big",
    "hello_rail_u64",
    "hello_gpu_index_neg",
    "hello_node_rank_big",
    "hello_local_rank_big",
    "hello_shard_big",
    "hello_world_huge",
    "hello_inc_big",
    "hello_host_not_str",
    "hello_t_start_u64",
    "garbage",
    "empty",
    "truncated_msgpack",
    "top_level_list",
    "wrong_version",
    "steps_wrong_rows",
)
"""The hand-written records every reader must refuse, whatever the hub's ingest checks."""


def with_records(
    path: Path,
    names: list[str],
    world: int = 4,
    steps: int = 6,
    format_version: int = recording.FORMAT_VERSION,
) -> list[bytes]:
    """A clean job with the named bad records after its hellos; returns the bad payloads."""
    bad = hostile.bad_records()
    messages = list(job(world=world, steps=steps).messages)
    for name in names:
        messages.insert(2 * world, bad[name])
    hostile.write_recording(path, messages, format_version=format_version)
    return [bad[n] for n in names]


def offsets_of(path: Path, payloads: list[bytes]) -> list[tuple[str, int]]:
    return [(f.segment, f.offset) for f in read_frames(path) if f.payload in payloads]


# -- bad records ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", REFUSED)
def test_a_bad_record_is_skipped_reported_and_costs_nothing_else(tmp_path, name) -> None:
    clean = tmp_path / "clean"
    hostile.write_recording(clean, job(world=4, steps=6).messages)
    bad = with_records(tmp_path / "bad", [name], format_version=1)  # format 1's frame sizes
    store = replay.load(tmp_path / "bad")
    assert_windows_equal(store.window("r1"), replay.load(clean).window("r1"))
    rec = store.health["recording"]
    assert rec["bad_records"] == 1
    (skip,) = [s for s in rec["skipped"] if s["reason"] == "bad_record"]
    assert [(skip["segment"], skip["offset"])] == offsets_of(tmp_path / "bad", bad)
    assert skip["nbytes"] == len(bad[0]) + 20
    reason, _, detail = skip["detail"].partition(": ")
    assert reason and detail, skip
    assert sum(store.health["rejects"].values()) >= 1


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("hello_mesh_str", "mesh"),
        ("hello_rail_big", "rail"),
        ("hello_gpu_index_neg", "gpu_index"),
        ("hello_node_rank_big", "node_rank"),
    ],
)
def test_the_report_names_the_field_that_was_wrong(tmp_path, name, says) -> None:
    with_records(tmp_path, [name])
    (skip,) = replay.load(tmp_path).health["recording"]["skipped"]
    assert says in skip["detail"]


def test_each_bad_record_is_one_warning_line_with_segment_and_offset(tmp_path, caplog) -> None:
    bad = with_records(tmp_path, ["hello_rail_big", "garbage"])
    with caplog.at_level(logging.WARNING, logger="rankscope.hub"):
        replay.load(tmp_path)
    lines = [r.getMessage() for r in caplog.records if "skipped the record" in r.getMessage()]
    where = offsets_of(tmp_path, bad)
    assert len(lines) == 2
    for line, (seg, off) in zip(sorted(lines), sorted(where, key=lambda w: w[1]), strict=True):
        assert "\n" not in line and f"{seg} offset {off}: " in line


def test_inspect_lists_each_bad_record_with_where_and_what(tmp_path) -> None:
    from rankscope.commands.inspect import format_text

    bad = with_records(tmp_path, ["hello_rail_big"])
    ((seg, off),) = offsets_of(tmp_path, bad)
    text = format_text(inspect_recording(tmp_path))
    (line,) = [x for x in text.splitlines() if "bad_record" in x]
    assert line.strip().startswith(f"{seg} @ {off}: ") and "rail" in line


def test_past_the_bounds_bad_records_are_counted_not_listed(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(recording, "MAX_LISTED_BAD_RECORDS", 3)
    monkeypatch.setattr(replay, "WARN_BAD_RECORDS", 2)
    with_records(tmp_path, ["garbage"] * 7, format_version=1)  # format 1's frame sizes
    with caplog.at_level(logging.WARNING, logger="rankscope.hub"):
        store = replay.load(tmp_path)
    rec = store.health["recording"]
    assert rec["bad_records"] == 7 and len(rec["skipped"]) == 3
    assert rec["skipped_bytes"] == 7 * (len(hostile.bad_records()["garbage"]) + 20)
    said = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(said) == 3 and "5 more bad records" in said[-1]
    assert store.window("r1").world_size == 4


def test_every_reader_reads_a_recording_of_every_bad_record(tmp_path) -> None:
    with_records(tmp_path, list(hostile.bad_records()))
    outcome = hostile.run_readers(tmp_path)
    assert outcome.failures == []
    assert len(outcome.ran) == 13 and outcome.bad_records >= len(REFUSED)


def test_the_follower_skips_bad_records_and_keeps_following(tmp_path) -> None:
    j = job(world=2, steps=4, slow=1)
    bad = hostile.bad_records()
    w = RecordingWriter(tmp_path, flush_s=0.0)
    for m in j.messages[:4]:
        w.append(m, 1)
    w.append(bad["hello_mesh_str"], 2)
    w.flush()
    f = replay.Follower(tmp_path, poll_s=0.01).start()
    w.append(bad["garbage"], 3)
    for m in j.messages[4:]:
        w.append(m, 4)
    w.close()
    deadline = time.monotonic() + 20
    while f.report.frames < len(j.messages) + 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    f.stop()
    assert f.report.bad_records == 2
    assert f.store.window("r1").steps.shape[0] == 4


def test_the_follower_stops_on_a_newer_format_with_one_line(tmp_path, caplog) -> None:
    hostile.write_recording(tmp_path, [b"one"])
    seg = segments(tmp_path)[0]
    data = bytearray(seg.read_bytes())
    data[8] = 99  # the segment's format version
    seg.write_bytes(bytes(data))
    with caplog.at_level(logging.ERROR, logger="rankscope.hub"):
        f = replay.Follower(tmp_path, poll_s=0.01).start()
        deadline = time.monotonic() + 20
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
        f.stop()
    (said,) = caplog.records
    assert "version 99" in said.getMessage() and said.exc_info is None


def _hello_message(**ident: object) -> schema.Message:
    h = {**header("r1", 1), "kind": "hello", "identity": {**identity(1, 4), **ident}}
    return schema.Message(kind="hello", header=h)


@pytest.mark.parametrize(
    ("ident", "says"),
    [
        ({"mesh": {"tp": "x"}}, "identity.mesh.tp must be an integer, got str"),
        ({"mesh": [1]}, "identity.mesh must be a map"),
        ({"rail": 2**31}, "identity.rail 2147483648 is outside 32 bits"),
        ({"gpu_index": -(2**31) - 1}, "outside 32 bits"),
        ({"node_rank": True}, "identity.node_rank must be an integer, got bool"),
        ({"world_size": 2**21}, "identity.world_size 2097152 is over 1048576"),
    ],
)
def test_reader_check_refuses_what_the_rank_table_cannot_hold(ident, says) -> None:
    reason, detail = replay.reader_check(_hello_message(**ident)) or ("", "")
    assert reason == "bad_hello" and says in detail


def _lax_decode(monkeypatch) -> None:
    """The decoder of an older hub: a hello's identity unchecked (issue 17's gap)."""
    strict = schema.decode

    def lax(data: bytes, *args: Any, **kwargs: Any) -> schema.Message:
        try:
            obj = msgpack.unpackb(data, raw=False)
        except Exception:
            obj = None
        if isinstance(obj, dict) and obj.get("kind") == "hello":
            return schema.Message(kind="hello", header=obj, nbytes=len(data))
        return strict(data, *args, **kwargs)

    monkeypatch.setattr(schema, "decode", lax)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("hello_mesh_str", "identity.mesh.tp must be an integer, got str"),
        ("hello_rail_big", "identity.rail 1099511627776 is outside 32 bits"),
        ("hello_node_rank_big", "identity.node_rank 9223372036854775807 is outside 32 bits"),
        ("hello_world_huge", "identity.world_size 1099511627776 is outside 32 bits"),
    ],
)
def test_what_an_older_decoder_let_through_the_replay_still_refuses(
    tmp_path, monkeypatch, name, says
) -> None:
    _lax_decode(monkeypatch)
    with_records(tmp_path, [name])
    store = replay.load(tmp_path)
    (skip,) = store.health["recording"]["skipped"]
    assert skip["detail"] == f"bad_hello: {says}"
    assert store.window("r1").world_size == 4 and store.runs()[0].n_ranks_seen == 4


def test_a_live_store_that_took_a_bad_hello_still_gives_its_window(monkeypatch) -> None:
    """A hub whose ingest lets a bad identity through: the views do not die of it, the
    bad values read as unknown."""
    from rankscope.hub.intake import Intake
    from rankscope.hub.store import Store

    _lax_decode(monkeypatch)
    store = Store()
    intake = Intake(store)
    messages = list(job(world=4, steps=3).messages)
    messages.insert(8, hostile.bad_records()["hello_rail_big"])
    for m in messages:
        intake.feed(m)
    w = store.window("r1")
    assert w.ranks.rail.tolist() == [0, -1, 0, 1]


def test_reader_check_keeps_extreme_values_it_can_hold() -> None:
    ok = _hello_message(rail=2**31 - 1, gpu_index=-(2**31), mesh={"tp": 0, "dp": None, "x": "y"})
    assert replay.reader_check(ok) is None


def test_the_rank_table_reads_impossible_identity_values_as_unknown() -> None:
    ranks = rank_info(
        {
            0: {**identity(0, 4), "rail": 2**40, "mesh": {"tp": "x", "dp": 1}},
            1: {**identity(1, 4), "gpu_index": 1.5, "mesh": [1]},
            2: {**identity(2, 4), "node_rank": np.int64(1), "mesh": {"tp": 2**63}},
        },
        4,
    )
    assert ranks.rail.tolist() == [-1, 1, 0, -1]
    assert ranks.gpu_index.tolist() == [0, -1, 0, -1]
    assert ranks.node_rank.tolist() == [0, 0, 1, -1]
    assert ranks.mesh["tp"].tolist() == [-1] * 4 and ranks.mesh["dp"].tolist() == [1, -1, -1, -1]


def test_damage_and_bad_records_together_lose_only_themselves(tmp_path) -> None:
    """kill -9 mid-frame, flipped bytes and bad records in one recording: every good
    frame outside the damage is replayed."""
    bad = with_records(tmp_path, ["hello_rail_big", "garbage"], format_version=1)
    seg = segments(tmp_path)[0]
    data = bytearray(seg.read_bytes())
    good = [f for f in read_frames(tmp_path) if f.payload not in bad]
    victim = good[-5]  # a steps message near the end: flip one payload byte
    data[victim.offset + 20 + 3] ^= 0xFF
    seg.write_bytes(bytes(data[:-7]))  # and the last frame cut short
    report = ReadReport()
    store = replay.load(tmp_path, report=report)
    assert report.bad_records == 2
    assert sorted(s.reason for s in report.skipped) == [
        "bad_record",
        "bad_record",
        "corrupt",
        "truncated",
    ]
    assert report.frames == len(good) - 2 + len(bad)  # less the flipped and the cut frame
    assert store.window("r1").world_size == 4 and store.runs()[0].n_ranks_seen == 4


@pytest.mark.parametrize(("byte", "bit"), [(0, 0), (5, 3), (11, 2), (8, 7 + 8)])
def test_a_flipped_bit_in_a_segment_header_costs_only_the_header(tmp_path, byte, bit) -> None:
    hostile.write_recording(tmp_path, [b"one", b"two"], sessions=2)
    seg = segments(tmp_path)[0]
    data = bytearray(seg.read_bytes())
    data[byte + bit // 8] ^= 1 << (bit % 8)  # the magic, or the version to 2^8 + 1 and up
    seg.write_bytes(bytes(data))
    report = ReadReport()
    assert [f.payload for f in read_frames(tmp_path, report)] == [b"one", b"two"]
    assert [(s.segment, s.offset, s.nbytes, s.reason) for s in report.skipped] == [
        (seg.name, 0, 16, "bad_header")
    ]


def test_a_plausible_newer_version_is_still_refused(tmp_path) -> None:
    hostile.write_recording(tmp_path, [b"one"])
    seg = segments(tmp_path)[0]
    data = bytearray(seg.read_bytes())
    data[8] = 3
    seg.write_bytes(bytes(data))
    with pytest.raises(RecordingError, match="format version 3"):
        list(read_frames(tmp_path))


# -- segment numbering ------------------------------------------------------------------------


def _renamed(path: Path, names: list[str]) -> None:
    """Write one segment per name (two frames each, payload = its name)."""
    for name in names:
        w = RecordingWriter(path)
        w.append(name.encode(), 1)
        w.append(name.encode(), 2)
        w.close()
        (newest,) = [p for p in segments(path) if p.name.startswith("segment-0000")][-1:]
        newest.rename(path / f".{name}")
    for name in names:
        (path / f".{name}").rename(path / name)


def test_segment_numbers_past_six_digits_are_read_in_number_order(tmp_path) -> None:
    _renamed(tmp_path, ["segment-999999.rsrec"])
    w = RecordingWriter(tmp_path)  # the next number is 1000000: seven digits
    w.append(b"after", 3)
    w.close()
    assert [p.name for p in segments(tmp_path)] == [
        "segment-999999.rsrec",
        "segment-1000000.rsrec",
    ]
    assert [f.payload for f in read_frames(tmp_path)] == [b"segment-999999.rsrec"] * 2 + [b"after"]
    assert read_meta(tmp_path)["sessions"][-1]["first_segment"] == "segment-1000000.rsrec"


def test_gaps_and_a_number_written_twice_hide_nothing(tmp_path) -> None:
    names = ["segment-000000.rsrec", "segment-000005.rsrec", "segment-0000005.rsrec"]
    _renamed(tmp_path, names)
    w = RecordingWriter(tmp_path)
    w.append(b"next", 3)
    w.close()
    assert [p.name for p in segments(tmp_path)] == [
        "segment-000000.rsrec",
        "segment-0000005.rsrec",
        "segment-000005.rsrec",
        "segment-000006.rsrec",
    ]
    got = [f.payload for f in read_frames(tmp_path)]
    assert got == [n.encode() for n in sorted(names, key=recording.segment_key) for _ in "ab"] + [
        b"next"
    ]


def test_a_segment_that_appears_under_the_writer_is_never_written_into(tmp_path) -> None:
    w = RecordingWriter(tmp_path, max_segment_bytes=64, flush_s=0.0)
    w.append(b"x" * 40, 1)
    w.flush()
    stranger = tmp_path / "segment-000001.rsrec"
    stranger.write_bytes(b"someone else's file")
    w.append(b"y" * 40, 2)  # rotation: 000001 is taken, the writer moves to 000002
    w.close()
    assert stranger.read_bytes() == b"someone else's file"
    assert (tmp_path / "segment-000002.rsrec").exists()
    report = ReadReport()
    assert [f.payload for f in read_frames(tmp_path, report)] == [b"x" * 40, b"y" * 40]
    assert [s.reason for s in report.skipped] == ["bad_header"]


def test_follow_moves_on_from_segment_999999_to_1000000(tmp_path) -> None:
    _renamed(tmp_path, ["segment-999999.rsrec"])
    stop = threading.Event()
    got: list[bytes] = []

    def reader() -> None:
        for f in recording.follow(tmp_path, poll_s=0.01, stop=stop):
            got.append(f.payload)

    t = threading.Thread(target=reader)
    t.start()
    w = RecordingWriter(tmp_path, flush_s=0.0)
    w.append(b"later", 3)
    w.close()
    deadline = time.monotonic() + 20
    while len(got) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    t.join(10)
    assert got == [b"segment-999999.rsrec"] * 2 + [b"later"]


def test_a_second_hub_on_a_recording_being_written_changes_nothing(tmp_path) -> None:
    w = RecordingWriter(tmp_path, info={"endpoint": "tcp://a:1"})
    w.append(b"first", 1)
    w.flush()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "lock"}
    with pytest.raises(RecordingError, match="another hub"):
        RecordingWriter(tmp_path, info={"endpoint": "tcp://b:2"})
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "lock"}
    assert after == before
    w.close()
    assert [s.get("endpoint") for s in read_meta(tmp_path)["sessions"]] == ["tcp://a:1"]


def test_two_hubs_without_working_locks_never_share_a_segment(tmp_path, monkeypatch) -> None:
    """A file system where flock does nothing (some network mounts): two hubs write the
    same directory at once, rotating often; every frame of both is read, none is lost."""
    monkeypatch.setattr(recording.fcntl, "flock", lambda fd, op: None)
    a = RecordingWriter(tmp_path, max_segment_bytes=80, flush_s=0.0)
    b = RecordingWriter(tmp_path, max_segment_bytes=80, flush_s=0.0)
    for i in range(6):
        a.append(b"a%d" % i + b"." * 30, i)
        a.flush()
        b.append(b"b%d" % i + b"." * 30, i)
        b.flush()
    a.close()
    b.close()
    got = [f.payload[:2] for f in read_frames(tmp_path)]
    assert sorted(got) == sorted([b"a%d" % i for i in range(6)] + [b"b%d" % i for i in range(6)])
    assert len(segments(tmp_path)) == len({p.name for p in segments(tmp_path)}) >= 12


# -- meta.json --------------------------------------------------------------------------------

BROKEN_META = {
    "list": b"[1, 2, 3]",
    "string": b'"meta"',
    "truncated": b'{"format": "rankscope-recording", "version": 1, "sess',
    "empty": b"",
    "version_str": b'{"format": "rankscope-recording", "version": "1", "sessions": []}',
    "sessions_map": b'{"format": "rankscope-recording", "version": 1, "sessions": {}}',
    "session_not_map": b'{"format": "rankscope-recording", "version": 1, "sessions": [3]}',
    "counts_str": (
        b'{"format": "rankscope-recording", "version": 1, "sessions": '
        b'[{"messages": "many", "stopped_ns": null}]}'
    ),
    "no_format": b'{"version": 1, "sessions": []}',
    "not_utf8": b"\xff\xfe{",
}


@pytest.mark.parametrize("kind", sorted(BROKEN_META))
def test_a_broken_meta_is_kept_aside_and_rebuilt_from_the_segments(tmp_path, kind, caplog) -> None:
    hostile.write_recording(tmp_path, [b"a", b"bb", b"ccc"], sessions=2)
    (tmp_path / META_NAME).write_bytes(BROKEN_META[kind])
    with caplog.at_level(logging.WARNING, logger="rankscope.hub"):
        w = RecordingWriter(tmp_path)  # the hub starts
    w.append(b"dddd", 9)
    w.close()
    assert (tmp_path / "meta.json.bad-1").read_bytes() == BROKEN_META[kind]
    meta = json.loads((tmp_path / META_NAME).read_text())
    assert recording.meta_problem(meta) is None
    (repair,) = meta["repairs"]
    assert repair["kept_as"] == "meta.json.bad-1" and repair["problem"]
    rebuilt, new = meta["sessions"][:-1], meta["sessions"][-1]
    assert [(s["first_segment"], s["messages"], s["bytes"]) for s in rebuilt] == [
        ("segment-000000.rsrec", 2, 3),
        ("segment-000001.rsrec", 1, 3),
    ]
    assert all(s["stopped_ns"] is not None and s["rebuilt"] for s in rebuilt)
    assert new["first_segment"] == "segment-000002.rsrec" and new["messages"] == 1
    assert [f.payload for f in read_frames(tmp_path)] == [b"a", b"bb", b"ccc", b"dddd"]
    (said,) = [r.getMessage() for r in caplog.records if "meta.json.bad-1" in r.getMessage()]
    assert repair["problem"] in said and "rebuilt from 2 segment(s)" in said


def test_a_second_repair_keeps_the_first_bad_copy(tmp_path) -> None:
    hostile.write_recording(tmp_path, [b"a"])
    (tmp_path / META_NAME).write_text("[1]")
    RecordingWriter(tmp_path).close()
    (tmp_path / META_NAME).write_text("[2]")
    RecordingWriter(tmp_path).close()
    assert (tmp_path / "meta.json.bad-1").read_text() == "[1]"
    assert (tmp_path / "meta.json.bad-2").read_text() == "[2]"


def test_a_meta_of_another_format_is_still_refused_and_left_alone(tmp_path) -> None:
    (tmp_path / META_NAME).write_text('{"format": "someone-else"}')
    with pytest.raises(RecordingError, match="does not describe a recording"):
        RecordingWriter(tmp_path)
    assert (tmp_path / META_NAME).read_text() == '{"format": "someone-else"}'
    assert not list(tmp_path.glob("meta.json.bad-*"))


@pytest.mark.parametrize("kind", sorted(BROKEN_META))
def test_readers_take_a_broken_meta_as_they_find_it(tmp_path, kind) -> None:
    hostile.write_recording(tmp_path, job(world=2, steps=3, slow=1).messages)
    (tmp_path / META_NAME).write_bytes(BROKEN_META[kind])
    meta = read_meta(tmp_path)
    assert isinstance(meta, dict) and all(isinstance(s, dict) for s in meta.get("sessions", []))
    rep = inspect_recording(tmp_path)
    assert rep["runs"][0]["steps"]["count"] == 3 and isinstance(rep["format_version"], int)
    assert replay.recorded_counters(tmp_path)["rejects"] == {}
    assert session_liveness(tmp_path).state in ("none", "live", "stopped", "dead")
    assert (tmp_path / META_NAME).read_bytes() == BROKEN_META[kind]  # readers never write


# -- liveness ---------------------------------------------------------------------------------


def _needs_proc() -> None:
    me = recording.process_identity()
    if None in (me["boot_id"], me["pid_ns"], me["pid_start"]):
        pytest.skip("this system does not say who a process is (/proc)")


def test_a_running_hub_is_live_and_a_closed_one_stopped(tmp_path) -> None:
    w = RecordingWriter(tmp_path, info={"endpoint": "tcp://h:1"})
    state = session_liveness(tmp_path)
    assert state.live and state.endpoint == "tcp://h:1"
    w.close()
    assert session_liveness(tmp_path).state == "stopped"


KILLED_HUB = """
import os, signal, sys
from rankscope.hub.recording import RecordingWriter
w = RecordingWriter(sys.argv[1], flush_s=0.0, info={"endpoint": "tcp://127.0.0.1:9"})
w.append(b"before the kill", 1)
w.flush()
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_hub_killed_with_sigkill_is_dead_and_its_recording_survives(tmp_path) -> None:
    from rankscope.commands.rerun import live_hub

    _needs_proc()
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_HUB, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert session_liveness(tmp_path).live
        assert live_hub(tmp_path) == "tcp://127.0.0.1:9"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    meta = read_meta(tmp_path)
    assert meta["sessions"][-1]["stopped_ns"] is None  # nobody marked it stopped
    state = session_liveness(tmp_path)
    assert state.state == "dead" and f"pid {proc.pid}" in state.why
    assert live_hub(tmp_path) is None
    assert [f.payload for f in read_frames(tmp_path)] == [b"before the kill"]
    w = RecordingWriter(tmp_path)  # the lock died with it: a new hub starts
    w.append(b"after", 2)
    w.close()
    assert [f.payload for f in read_frames(tmp_path)] == [b"before the kill", b"after"]


def _session(path: Path, **fields: object) -> None:
    base = {"endpoint": "tcp://other:1", "stopped_ns": None, "updated_ns": 1_000 * 10**9}
    meta = {"format": "rankscope-recording", "version": 1, "sessions": [{**base, **fields}]}
    (path / META_NAME).write_text(json.dumps(meta))


def test_a_stale_heartbeat_from_another_host_is_dead(tmp_path) -> None:
    _session(tmp_path, hub_host="elsewhere", pid=1, heartbeat_s=0.5)
    now = 1_000 * 10**9
    assert session_liveness(tmp_path, now_ns=now + 5 * 10**9).live
    state = session_liveness(tmp_path, now_ns=now + 31 * 10**9)
    assert state.state == "dead" and "heartbeat is 31 s old" in state.why
    _session(tmp_path, hub_host="elsewhere", heartbeat_s=10)  # 20 of its beats: 200 s
    assert session_liveness(tmp_path, now_ns=now + 150 * 10**9).live


def test_a_pid_reused_by_another_process_is_dead(tmp_path) -> None:
    _needs_proc()
    me = recording.process_identity()
    _session(tmp_path, **{**me, "pid_start": me["pid_start"] + 1}, updated_ns=time.time_ns())
    state = session_liveness(tmp_path)
    assert state.state == "dead" and "reused" in state.why
    _session(tmp_path, **me, updated_ns=time.time_ns())
    assert session_liveness(tmp_path).live


def test_a_session_of_an_older_hub_without_pid_or_heartbeat_reads_as_before(tmp_path) -> None:
    (tmp_path / META_NAME).write_text(json.dumps({"sessions": [{"stopped_ns": None}]}))
    assert session_liveness(tmp_path).live
    assert session_liveness(tmp_path / "missing").state == "none"


# -- fuzz -------------------------------------------------------------------------------------

_values = st.one_of(
    st.sampled_from(hostile.ODD_VALUES),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=3),
)
_mutations = st.lists(
    st.builds(
        hostile.Mutation,
        st.sampled_from(hostile.MUTATION_KINDS),
        st.integers(min_value=0, max_value=2**30),
        _values,
    ),
    max_size=6,
)
_plans = st.builds(
    hostile.Plan,
    world=st.integers(1, 5),
    steps=st.integers(1, 6),
    seed=st.integers(0, 2**30),
    mutations=_mutations.map(tuple),
    sessions=st.integers(1, 3),
    flips=st.sampled_from([0, 0, 1, 4]),
    truncate=st.booleans(),
    reruns=st.booleans(),
)


def fuzz(examples: int) -> settings:
    """Hypothesis settings of these tests: few examples (the suite runs on a busy laptop),
    no deadline (a loaded core makes any example slow), the same examples on every run
    (``benchmarks/fuzz_readers.py`` draws new ones for as long as it is given)."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


@fuzz(300)
@given(
    data=st.one_of(
        st.binary(max_size=200),
        st.builds(
            hostile.apply,
            st.just(job(world=2, steps=1, slow=1).messages[:6]),
            _mutations,
        ).map(lambda ms: ms[len(ms) // 2] if ms else b""),
    )
)
def test_the_decoder_raises_only_schema_errors(data) -> None:
    try:
        schema.decode(data)
    except schema.SchemaError as exc:
        assert exc.reason and isinstance(exc.detail, str)


@fuzz(60)
@given(data=st.binary(max_size=400), where=st.integers(0, 400))
def test_the_segment_reader_raises_only_recording_errors(tmp_path_factory, data, where) -> None:
    path = tmp_path_factory.mktemp("seg")
    hostile.write_recording(path, [b"one", b"two"])
    seg = segments(path)[0]
    raw = seg.read_bytes()
    seg.write_bytes(raw[:where] + data + raw[where:])
    report = ReadReport()
    try:
        frames = list(read_frames(path, report))
    except RecordingError:
        return
    assert report.frames == len(frames)


@fuzz(40)
@given(plan=_plans)
def test_no_library_reader_raises_on_extreme_records(tmp_path_factory, plan) -> None:
    path = tmp_path_factory.mktemp("rec")
    hostile.build(path, plan)
    outcome = hostile.run_readers(path, commands=False)
    assert outcome.failures == [], outcome.failures[0][1]


@fuzz(4)
@given(plan=_plans)
def test_no_command_raises_on_extreme_records(tmp_path_factory, plan) -> None:
    path = tmp_path_factory.mktemp("rec")
    hostile.build(path, plan)
    outcome = hostile.run_readers(path, commands=True)
    assert outcome.failures == [], outcome.failures[0][1]


def test_the_generator_writes_what_the_readers_then_refuse(tmp_path) -> None:
    """The fuzz is not vacuous: its mutations reach the readers as records they refuse,
    and the clean part of the job still replays."""
    plan = hostile.Plan(
        world=3,
        steps=3,
        mutations=(
            hostile.Mutation("identity", 7 * hostile._IDENTITY_KEYS.index("rail"), 2**40),
            hostile.Mutation("bad_record", 0, None),
        ),
    )
    messages = hostile.build(tmp_path, plan)
    assert any(b"rail" in m and msgpack.unpackb(m)["identity"]["rail"] == 2**40 for m in messages)
    store = replay.load(tmp_path)
    details = [s["detail"] for s in store.health["recording"]["skipped"]]
    assert any("rail" in d for d in details) and any("mesh" in d for d in details)
    # Rank 0's hello was refused, so its data is refused too; ranks 1 and 2 replay.
    assert store.window("r1").world_size == 3 and store.runs()[0].n_ranks_seen == 2
