"""Ring buffers: fixed memory, in-order reads across the wrap, drops counted when full."""

from __future__ import annotations

import struct
import sys
import threading
from collections.abc import Callable

import numpy as np
import pytest

from rankscope.collector import ring as ring_module
from rankscope.collector import schema
from rankscope.collector.ring import Ring, row_dtype


def _coll(i: int) -> tuple[int, ...]:
    # step, op, group, seq, nbytes, t_enter, t_start, t_end, t_exit, flags
    return (i // 10, i % 7, 3, i, 8 * i, 1000 + i, -1, -1, 2000 + i, 0)


def test_row_dtype_matches_schema_columns() -> None:
    dt = row_dtype(schema.COLL_COLUMNS)
    assert dt.names == tuple(schema.COLL_COLUMNS)
    assert dt.itemsize == sum(d.itemsize for d in schema.COLL_COLUMNS.values())


def test_capacity_rounds_up_and_slots_are_fixed() -> None:
    ring = Ring(schema.COLL_COLUMNS, 1000)
    assert ring.capacity == 1024
    slots_id = id(ring.slots)
    for i in range(5000):
        if i % 300 == 0:
            ring.consume(len(ring))
        ring.push(*_coll(i))
    assert id(ring.slots) == slots_id and len(ring.slots) == 1024


def test_full_ring_drops_and_counts() -> None:
    ring = Ring(schema.COLL_COLUMNS, 8)
    idx = [ring.push(*_coll(i)) for i in range(12)]
    assert idx[:8] == list(range(8)) and idx[8:] == [-1] * 4
    assert ring.dropped == 4 and len(ring) == 8
    rows = ring.unread()
    assert rows["seq"].tolist() == list(range(8))  # the oldest rows are kept, new ones dropped


def test_reads_in_order_across_the_wrap() -> None:
    ring = Ring(schema.COLL_COLUMNS, 8)
    seen: list[int] = []
    for i in range(32):
        assert ring.push(*_coll(i)) == i
        if i % 5 == 4:
            rows = ring.unread()
            seen.extend(rows["seq"].tolist())
            ring.consume(len(rows))
    rows = ring.unread()
    seen.extend(rows["seq"].tolist())
    assert seen == list(range(32))
    got = rows[-1]
    assert got["nbytes"] == 8 * 31 and got["t_exit"] == 2031 and got["step"] == 3


def test_limit_and_partial_consume() -> None:
    ring = Ring(schema.PHASE_COLUMNS, 16)
    for i in range(10):
        ring.push(i, i % 3, 10 * i, 10 * i + 5, -1)
    assert ring.unread(limit=4)["step"].tolist() == [0, 1, 2, 3]
    ring.consume(3)
    assert ring.unread()["step"].tolist() == list(range(3, 10))
    ring.consume(100)
    assert len(ring) == 0 and len(ring.unread()) == 0


def test_set_field_updates_unconsumed_rows_only() -> None:
    ring = Ring(schema.COLL_COLUMNS, 4)
    a = ring.push(*_coll(0))
    b = ring.push(*_coll(1))
    assert ring.set_field(b, "t_exit", 99)
    ring.consume(1)
    assert not ring.set_field(a, "t_exit", 77)  # consumed: ignored
    assert not ring.set_field(5, "t_exit", 77)  # never written
    assert ring.unread()["t_exit"].tolist() == [99]


def test_mixed_dtypes_round_trip() -> None:
    ring = Ring(schema.STEP_COLUMNS, 4)
    ring.push(7, 100, 200, 4096, 4000, 8, 1.5e9, float("nan"), 512, -1, -1, -1, 3, 0, 0, 90, 40)
    row = ring.unread()[0]
    assert row["step"] == 7 and row["attn_cost"] == 1.5e9 and np.isnan(row["flops"])
    assert row["alloc_retries"] == 3 and row["expert_tokens"] == 512 and row["cpu_ns"] == 90
    assert row["runq_ns"] == 40


def test_one_writer_one_reader_thread_lose_nothing_unless_counted() -> None:
    ring = Ring(schema.COLL_COLUMNS, 256)
    n = 50_000
    got: list[np.ndarray] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set() or len(ring):
            rows = ring.unread()
            if len(rows):
                got.append(rows["seq"].copy())
                ring.consume(len(rows))

    t = threading.Thread(target=reader)
    t.start()
    for i in range(n):
        ring.push(*_coll(i))
    done.set()
    t.join()
    seqs = np.concatenate(got) if got else np.zeros(0, np.int64)
    assert len(seqs) + ring.dropped == n
    assert np.all(np.diff(seqs) > 0)  # in order, no duplicates, no torn rows


@pytest.mark.parametrize("cap", [0, -3, 2.5, True])
def test_bad_capacity(cap: object) -> None:
    with pytest.raises(ValueError, match="capacity"):
        Ring(schema.COLL_COLUMNS, cap)  # type: ignore[arg-type]


def test_complete_fills_time_and_clears_flag_bits() -> None:
    ring = Ring(schema.COLL_COLUMNS, 4)
    row = ring.push(0, 0, 0, 0, 8, 100, -1, -1, -1, (1 << 30) | 2)
    assert ring.complete(row, "t_exit", 250, 1 << 30)
    got = ring.unread()[0]
    assert got["t_exit"] == 250 and got["flags"] == 2
    ring.consume(1)
    assert not ring.complete(row, "t_exit", 999, 1 << 30)


def test_push_refuses_a_value_that_does_not_fit_and_writes_nothing() -> None:
    ring = Ring(schema.PHASE_COLUMNS, 4)
    with pytest.raises(struct.error):
        ring.push(0, 1 << 20, 10, 20, -1)  # the phase column is int16
    assert ring.head == 0 and len(ring.unread()) == 0


def test_a_row_written_inline_with_a_bad_value_is_read_as_unknown() -> None:
    ring = Ring(schema.PHASE_COLUMNS, 4)
    ring.push(1, 2, 10, 20, 5)
    ring.slots[1] = (1 << 70, 3, 30, None, 7)  # as a hot path would write it, unchecked
    ring.head = 2
    ring.push(3, 4, 50, 60, 9)
    rows = ring.unread()
    assert rows["step"].tolist() == [1, -1, 3] and rows["phase"].tolist() == [2, 3, 4]
    assert rows["t0"].tolist() == [10, 30, 50] and rows["t1"].tolist() == [20, -1, 60]
    assert ring.malformed == 1
    ring.consume(3)
    assert len(ring) == 0


def test_update_sets_fields_and_flag_bits_of_unconsumed_rows_only() -> None:
    ring = Ring(schema.COLL_COLUMNS, 4)
    row = ring.push(0, 0, 0, 0, 8, 100, -1, -1, -1, 0b1010)
    assert ring.update(row, {"t_start": 5, "t_end": 6}, set_bits=0b1, clear_bits=0b10)
    got = ring.unread()[0]
    assert (got["t_start"], got["t_end"], got["flags"]) == (5, 6, 0b1001)
    assert ring.get_field(row, "flags") == 0b1001
    ring.consume(1)
    assert not ring.update(row, {"t_exit": 7}) and ring.get_field(row, "flags") is None


def test_late_updates_from_two_threads_lose_nothing() -> None:
    ring = Ring(schema.COLL_COLUMNS, 1024)
    rows = [ring.push(*_coll(i)) for i in range(1000)]

    def setter(first_bit: int) -> Callable[[], None]:
        def run() -> None:
            # Each update sets a bit no other update sets: any update lost to another
            # one's stale copy of the row leaves its bit unset.
            for bit in range(first_bit, first_bit + 15):
                for r in rows:
                    ring.update(r, {"t_start": bit}, set_bits=1 << bit)

        return run

    threads = [threading.Thread(target=setter(0)), threading.Thread(target=setter(16))]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, inside updates too
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    flags = ring.unread()["flags"]
    assert np.all(flags == (((1 << 15) - 1) | (((1 << 15) - 1) << 16)))


def test_consumed_rows_are_released_by_the_reader() -> None:
    ring = Ring(schema.PHASE_COLUMNS, 4)
    for i in range(3):
        ring.push(i, 1, 10 * i, 10 * i + 5, -1)
    ring.consume(2)
    assert ring.slots[:3] == [None, None, (2, 1, 20, 25, -1)]
    for i in range(3, 6):
        ring.push(i, 1, 10 * i, 10 * i + 5, -1)
    ring.consume(4)  # across the wrap
    assert ring.slots == [None] * 4 and len(ring) == 0
    assert ring.push(6, 1, 60, 65, -1) == 6 and ring.unread()["step"].tolist() == [6]


def test_many_rows_read_in_pieces_keep_order_and_unknowns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ring_module, "CONVERT_ROWS", 8)
    ring = Ring(schema.COLL_COLUMNS, 64)
    for i in range(30):
        ring.push(*_coll(i))
    ring.slots[17] = (*_coll(17)[:4], 1 << 70, *_coll(17)[5:])  # nbytes beyond int64
    rows = ring.unread()
    assert rows["seq"].tolist() == list(range(30))
    assert rows["nbytes"][17] == -1 and rows["nbytes"][16] == 8 * 16
    assert ring.malformed == 1
