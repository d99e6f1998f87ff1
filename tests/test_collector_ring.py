"""Ring buffers: fixed memory, in-order reads across the wrap, drops counted when full."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from rankscope.collector import schema
from rankscope.collector.ring import Ring, row_dtype


def _coll(i: int) -> tuple[int, ...]:
    # step, op, group, seq, nbytes, t_enter, t_start, t_end, t_exit, flags
    return (i // 10, i % 7, 3, i, 8 * i, 1000 + i, -1, -1, 2000 + i, 0)


def test_row_dtype_matches_schema_columns() -> None:
    dt = row_dtype(schema.COLL_COLUMNS)
    assert dt.names == tuple(schema.COLL_COLUMNS)
    assert dt.itemsize == sum(d.itemsize for d in schema.COLL_COLUMNS.values())


def test_capacity_rounds_up_and_memory_is_fixed() -> None:
    ring = Ring(schema.COLL_COLUMNS, 1000)
    assert ring.capacity == 1024
    raw_id = id(ring.raw)
    for i in range(5000):
        ring.push(*_coll(i))
    assert id(ring.raw) == raw_id and len(ring.raw) == 1024 * ring.row_size


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
        ring.push(i, i % 3, 10 * i, 10 * i + 5)
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
    ring.push(7, 100, 200, 4096, 4000, 8, 1.5e9, float("nan"), -1, -1, -1, 3)
    row = ring.unread()[0]
    assert row["step"] == 7 and row["attn_cost"] == 1.5e9 and np.isnan(row["flops"])
    assert row["alloc_retries"] == 3


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
