"""Recording format 2: compressed frames of re-encoded column tables, read back exactly."""

from __future__ import annotations

import json
import random
import struct

import hostile_records as hostile
import msgpack
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hub_job import assert_windows_equal, header, job

from rankscope.collector import schema
from rankscope.hub import recording, recording_codec, replay
from rankscope.hub.recording import (
    ReadReport,
    RecordingError,
    RecordingWriter,
    read_frames,
    segments,
)
from rankscope.hub.recording_codec import CodecError, Decoder, Encoder, decode_block

T0 = 1_700_000_000_000_000_000


def _timed(messages: list[bytes]) -> list[tuple[bytes, int]]:
    return [(m, T0 + 1000 * i) for i, m in enumerate(messages)]


def _through_codec(messages: list[bytes], **kw) -> list[tuple[int, bytes]]:
    enc, dec = Encoder(**kw), Decoder()
    return [x for body, t in enc.bodies(_timed(messages)) for x in dec.messages(body, t)]


def _write(path, messages, **kw) -> None:
    w = RecordingWriter(path, **kw)
    for payload, t in _timed(messages):
        w.append(payload, t)
    w.close()


def _coll_rows(messages: list[bytes]) -> int:
    rows = 0
    for m in messages:
        msg = schema.decode(m)
        rows += msg.tables["colls"]["op"].shape[0] if "colls" in msg.tables else 0
    return rows


def _heartbeat() -> bytes:
    """A kind this schema does not know (a newer collector's), with a table of its own."""
    return msgpack.packb(
        {
            **header("r1", 0),
            "v": schema.SCHEMA_VERSION,
            "kind": "heartbeat",
            "tables": {"beats": {"n": 2, "cols": {"t": np.arange(2, dtype="<i8").tobytes()}}},
        },
        use_bin_type=True,
    )


# -- exact round trip --------------------------------------------------------------------------


def test_every_message_comes_back_byte_for_byte_with_its_receive_time() -> None:
    messages = [*job(world=4, steps=6, colls=5).messages, _heartbeat(), b"", b"\xc1garbage"]
    got = _through_codec(messages)
    assert [p for _, p in got] == messages
    assert [t for t, _ in got] == [t for _, t in _timed(messages)]


def test_small_blocks_and_a_message_larger_than_a_block_come_back_too() -> None:
    messages = list(job(world=3, steps=4, colls=50).messages)
    big = max(messages, key=len)
    got = _through_codec(messages, block_bytes=len(big) - 1)
    assert [p for _, p in got] == messages
    tags = [body[0] for body, _ in Encoder(block_bytes=len(big) - 1).bodies(_timed(messages))]
    assert recording_codec.TAG_MESSAGE in tags and recording_codec.TAG_BLOCK in tags


def test_extreme_column_values_and_float_bit_patterns_come_back() -> None:
    st_ = schema.empty_table("steps", 3)
    st_["step"][:] = [0, 2**63 - 1, -(2**63)]
    st_["attn_cost"][:] = [np.nan, -0.0, np.inf]
    st_["flops"][:] = np.frombuffer(b"\x01\x00\x00\x00\x00\x00\xf8\x7f" * 3, "<f8")  # a NaN payload
    co = schema.empty_table("colls", 4)
    co["t_enter"][:] = [2**63 - 1, -(2**63), 0, -1]
    co["t_exit"][:] = [-(2**63), 2**63 - 1, -1, 0]
    co["op"][:] = [-128, 127, 0, -1]
    messages = [schema.steps_message(header("r1", 0), st_, colls=co)] * 3
    assert [p for _, p in _through_codec(messages)] == messages


def test_a_message_stored_whole_when_no_column_is_where_its_shape_says() -> None:
    """Two messages of one shape (same length, ``tables`` at the same offset), the second
    with different bytes where the first holds its columns: both come back exactly."""
    a = job(world=2, steps=2, colls=3, slow=1).steps[0][0]
    b = bytearray(a)
    b[len(b) // 2 :] = bytes(reversed(b[len(b) // 2 :]))
    got = _through_codec([a, bytes(b), a])
    assert [p for _, p in got] == [a, bytes(b), a]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.sampled_from(hostile.MUTATION_KINDS), st.integers(0, 1 << 30), st.integers()),
        max_size=6,
    ),
    st.integers(0, 1 << 30),
)
def test_mutated_messages_come_back_exactly(mutations, seed) -> None:
    base = list(job(world=3, steps=3, colls=4, seed=seed % 1000).messages)
    plan = [hostile.Mutation(kind, where, value) for kind, where, value in mutations]
    messages = hostile.apply(base, plan, seed)
    assert [
        p
        for _, p in _through_codec(messages, block_bytes=random.Random(seed).choice((300, 1 << 20)))
    ] == messages


# -- volume ------------------------------------------------------------------------------------


def test_format_2_takes_a_small_part_of_format_1(tmp_path) -> None:
    messages = list(job(world=8, steps=20, colls=40).messages)
    _write(tmp_path / "v1", messages, format_version=1)
    _write(tmp_path / "v2", messages)
    size = {v: sum(p.stat().st_size for p in segments(tmp_path / v)) for v in ("v1", "v2")}
    rows = _coll_rows(messages)
    assert size["v1"] / rows > 60  # 65 bytes of columns a row, and the message's rest
    assert size["v2"] < size["v1"] / 4, size
    assert size["v2"] / rows <= 24, size["v2"] / rows
    meta = json.loads((tmp_path / "v2" / "meta.json").read_text())
    (sess,) = meta["sessions"]
    assert sess["format"] == 2 and sess["stored_bytes"] == size["v2"] - 16
    assert sess["bytes"] == sum(map(len, messages))


def _packed_and_unpacked(seed: int) -> list[bytes]:
    """Steps messages of one rank whose collective columns travel packed at some widths,
    unpacked in small tables, and unpacked where times span more than 4 bytes."""
    rng = np.random.default_rng(seed)
    out = []
    for i, (n, spread) in enumerate([(300, 10**8), (8, 10**8), (300, 10**11), (300, 10**3)] * 3):
        co = schema.empty_table("colls", n)
        co["step"][:] = i
        co["seq"][:] = i * 1000 + np.arange(n) * (1 + i % 2)
        co["nbytes"][:] = rng.choice([4, 1 << 20, 1 << 34], n)
        co["t_enter"][:] = 10**18 + np.sort(rng.integers(0, spread, n))
        co["t_exit"][:] = co["t_enter"] + rng.integers(0, 10**6, n)
        co["flags"][:] = 0
        co["group"][:] = 0
        co["op"][:] = 0
        st = schema.empty_table("steps", 1)
        st["step"][:] = i
        out.append(schema.steps_message(header("r1", 0, batch=i), st, colls=co))
    return out


def test_packed_columns_are_stored_as_columns_and_come_back_byte_for_byte() -> None:
    messages = _packed_and_unpacked(5)
    names = {c for m in messages for _, c, _, _ in recording_codec.column_ranges(m)}
    assert {"t_enter@u4", "t_exit@u4", "seq@u2"} <= names, names
    assert "t_enter" in names  # the small and the wide tables
    assert [p for _, p in _through_codec(messages)] == messages
    assert [p for _, p in _through_codec(messages, block_bytes=300)] == messages


# -- old recordings ----------------------------------------------------------------------------


def test_a_format_1_recording_reads_and_a_new_session_appends_format_2(tmp_path) -> None:
    j = job(world=4, steps=6)
    half = len(j.messages) // 2
    _write(tmp_path / "rec", j.messages[:half], format_version=1)
    assert json.loads((tmp_path / "rec" / "meta.json").read_text())["version"] == 1
    assert [f.payload for f in read_frames(tmp_path / "rec")] == j.messages[:half]
    _write(tmp_path / "rec", j.messages[half:])
    meta = json.loads((tmp_path / "rec" / "meta.json").read_text())
    assert meta["version"] == 2 and [s["format"] for s in meta["sessions"]] == [1, 2]
    heads = [p.read_bytes()[8:12] for p in segments(tmp_path / "rec")]
    assert heads == [struct.pack("<I", 1), struct.pack("<I", 2)]
    assert [f.payload for f in read_frames(tmp_path / "rec")] == j.messages
    _write(tmp_path / "flat", j.messages)
    assert_windows_equal(
        replay.load(tmp_path / "rec").window("r1"), replay.load(tmp_path / "flat").window("r1")
    )


def test_an_unknown_format_is_refused_by_the_writer(tmp_path) -> None:
    with pytest.raises(RecordingError, match="unknown recording format 3"):
        RecordingWriter(tmp_path, format_version=3)


def test_a_rebuilt_meta_names_the_newest_format_of_its_segments(tmp_path) -> None:
    _write(tmp_path, [b"one"], format_version=1)
    assert recording.rebuild_meta(tmp_path)["version"] == 1
    _write(tmp_path, [b"two"])
    assert recording.rebuild_meta(tmp_path)["version"] == 2


# -- damage and hostile frames -----------------------------------------------------------------


def _append_frames(path, bodies: list[bytes]) -> None:
    seg = segments(path)[-1]
    with open(seg, "ab") as f:
        for body in bodies:
            f.write(recording._frame_header(body, T0) + body)


def _block(messages: list[bytes]) -> bytes:
    return Encoder().encode_block(_timed(messages))


def _zstd(data: bytes, **kw) -> bytes:
    return zstandard.ZstdCompressor(**kw).compress(data)


def _bad_bodies() -> dict[str, bytes]:
    good = _block(list(job(world=2, steps=2, colls=3, slow=1).messages))
    m, k, g, w, wt = recording_codec._HEAD.unpack_from(good)
    head = recording_codec._HEAD
    return {
        "not zstd": b"\x02not a zstd frame at all",
        "no stated size": b"\x02" + _zstd(good, write_content_size=False),
        "bomb": b"\x01" + _zstd(b"\x00" * (schema.MAX_MESSAGE_BYTES + 1)),
        "unknown tag": b"\x09" + _zstd(good),
        "empty body": b"",
        "cut block": b"\x02" + _zstd(good[: len(good) // 2]),
        "trailing bytes": b"\x02" + _zstd(good + b"\x00"),
        "more messages than held": b"\x02"
        + _zstd(head.pack(m + 9, k, g, w, wt) + good[head.size :]),
        "too many columns": b"\x02" + _zstd(head.pack(m, 60000, g, w, wt) + good[head.size :]),
        "huge shape": b"\x02"
        + _zstd(
            head.pack(1, 0, 1, 0, 0)
            + struct.pack("<q", T0)
            + struct.pack("<H", 0)
            + recording_codec._SHAPE.pack(1 << 20, 1 << 20, 0)
        ),
    }


def test_hostile_frame_bodies_with_good_checksums_are_skipped_as_corrupt(tmp_path) -> None:
    j = job(world=2, steps=3, slow=1)
    _write(tmp_path, j.messages[:4])
    bad = _bad_bodies()
    _append_frames(tmp_path, list(bad.values()))
    _write(tmp_path, j.messages[4:])
    report = ReadReport()
    assert [f.payload for f in read_frames(tmp_path, report)] == j.messages
    assert [s.reason for s in report.skipped] == ["corrupt"] * len(bad)
    details = [s.detail for s in report.skipped]
    assert all(d.startswith("frame body: ") for d in details), details
    assert "does not state its decompressed size" in details[1]
    assert f"> {schema.MAX_MESSAGE_BYTES}" in details[2]
    assert "unknown frame body tag 9" in details[3]
    assert "exceed" in details[-1]
    assert_windows_equal(replay.load(tmp_path).window("r1"), _replayed(tmp_path, j.messages))


def _replayed(tmp_path, messages):
    _write(tmp_path / "clean", messages)
    return replay.load(tmp_path / "clean").window("r1")


def test_decode_block_names_what_is_wrong() -> None:
    good = _block(list(job(world=2, steps=2, colls=3, slow=1).messages))
    for cut in (1, 10, len(good) // 3, len(good) - 1):
        with pytest.raises(CodecError):
            decode_block(good[:cut])
    with pytest.raises(CodecError, match="after the last column"):
        decode_block(good + b"\x00")


def test_a_flipped_byte_costs_its_block_and_a_cut_tail_is_truncated(tmp_path) -> None:
    j = job(world=4, steps=6)
    w = RecordingWriter(tmp_path, flush_s=3600)
    blocks = []
    for i in range(0, len(j.messages), 10):
        for payload, t in _timed(j.messages[i : i + 10]):
            w.append(payload, t)
        w.flush()
        blocks.append(j.messages[i : i + 10])
    w.close()
    seg = segments(tmp_path)[0]
    frames = list(read_frames(tmp_path))
    offsets = sorted({f.offset for f in frames})
    assert len(offsets) == len(blocks)
    data = bytearray(seg.read_bytes())
    data[offsets[1] + 20 + 5] ^= 0x10
    seg.write_bytes(bytes(data[:-3]))
    report = ReadReport()
    got = [f.payload for f in read_frames(tmp_path, report)]
    assert got == [m for b in blocks[:1] + blocks[2:-1] for m in b]
    assert [s.reason for s in report.skipped] == ["corrupt", "truncated"]
    assert report.skipped[0].offset == offsets[1]


def test_a_bad_record_of_a_compressed_frame_is_reported_with_its_own_size(tmp_path) -> None:
    bad = hostile.bad_records()["hello_rail_big"]
    messages = list(job(world=4, steps=3).messages)
    messages.insert(8, bad)
    hostile.write_recording(tmp_path, messages)
    store = replay.load(tmp_path)
    (skip,) = [s for s in store.health["recording"]["skipped"] if s["reason"] == "bad_record"]
    assert skip["nbytes"] == len(bad) and "rail" in skip["detail"]
    (frame,) = [f for f in read_frames(tmp_path) if f.payload == bad]
    assert (skip["segment"], skip["offset"]) == (frame.segment, frame.offset)


@pytest.mark.parametrize("seed", [3, 11])
def test_every_reader_reads_a_hostile_compressed_recording(tmp_path, seed) -> None:
    plan = hostile.random_plan(random.Random(seed))
    plan = hostile.Plan(**{**plan.__dict__, "format_version": 2, "flips": 3, "truncate": True})
    hostile.build(tmp_path, plan)
    outcome = hostile.run_readers(tmp_path, commands=False)
    assert outcome.failures == []


def test_a_reader_hands_out_a_chunks_messages_within_its_budget(tmp_path, monkeypatch) -> None:
    """A format-2 chunk inflates about tenfold: a reader stops decoding at its budget and
    goes on from there, so it never holds a chunk's worth of messages many times over."""
    j = job(world=4, steps=12)
    w = RecordingWriter(tmp_path, flush_s=3600)
    for i in range(0, len(j.messages), 4):
        for payload, t in _timed(j.messages[i : i + 4]):
            w.append(payload, t)
        w.flush()
    w.close()
    monkeypatch.setattr(recording, "_CHUNK", 4096)
    cur = recording._SegmentCursor(segments(tmp_path)[0], ReadReport())
    got, polls = [], []
    try:
        while True:
            frames = cur.poll(final=True)
            got += [f.payload for f in frames]
            polls.append(sum(len(f.payload) for f in frames))
            if cur.at_eof and not frames:
                break
    finally:
        cur.close()
    assert got == j.messages
    biggest = max(len(m) for m in j.messages) * 4  # one block's messages
    assert max(polls) <= 4096 + biggest
    assert [f.payload for f in read_frames(tmp_path)] == j.messages
