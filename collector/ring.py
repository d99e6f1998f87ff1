"""Fixed-capacity ring buffers of table rows, written on the training thread.

A ring is a preallocated list of slots; a row is a tuple stored in one slot. The writer
builds the tuple and stores it (two bytecodes: CPython takes small tuples from a free list),
and the reader turns the unread slots into a numpy structured array off the training
thread. A C packer (``struct.pack_into`` into one bytearray) did the same in fewer Python
steps, but inside a real training step its code is cold: measured at world size 1 it cost
~1.4 µs more per row than the tuple store, and a step writes eight rows or more.

One thread writes new rows, one thread reads them; the writer publishes a row by advancing
``head`` only after its slot is filled. A row already published is changed only by
replacing its tuple under the ring's lock (``set_field``, ``complete``, ``update``), so
late updates from callback threads never lose one another. When the ring is full the new
row is dropped and counted: the number of rows held is bounded and the writer never waits.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Mapping

import numpy as np

_STRUCT_CODES = {
    ("i", 1): "b",
    ("i", 2): "h",
    ("i", 4): "i",
    ("i", 8): "q",
    ("u", 1): "B",
    ("u", 2): "H",
    ("u", 4): "I",
    ("u", 8): "Q",
    ("f", 4): "f",
    ("f", 8): "d",
}


CONVERT_ROWS = 4096
"""Rows the reader converts at a time (~1 ms of a collectives ring)."""


def row_dtype(columns: dict[str, np.dtype]) -> np.dtype:
    """A packed little-endian structured dtype with one field per column, in order.

    Args:
        columns: column name -> scalar dtype (e.g. ``schema.COLL_COLUMNS``).

    Returns:
        The structured dtype (no padding between fields).
    """
    return np.dtype([(name, np.dtype(dt).newbyteorder("<")) for name, dt in columns.items()])


def _struct_format(dtype: np.dtype) -> str:
    codes = []
    for name in dtype.names or ():
        field = dtype.fields[name][0]  # type: ignore[index]
        code = _STRUCT_CODES.get((field.kind, field.itemsize))
        if code is None:
            raise ValueError(f"column {name!r} has dtype {field} that a ring cannot hold")
        codes.append(code)
    return "<" + "".join(codes)


class Ring:
    """Single-producer single-consumer ring of rows with a fixed structured dtype.

    ``head`` and ``tail`` are absolute row counters (never wrapped), so ``head - tail`` is
    the number of unread rows and a row's absolute index names it until it is consumed.

    The hot paths of ``Monitor`` write a row inline (``slots[head & mask] = (...)``, then
    ``head += 1``) with values that fit the columns by construction; ``push`` checks them.

    Attributes:
        capacity: rows the ring holds (a power of two).
        mask: ``capacity - 1``.
        slots: the rows, one tuple per slot (``None`` before the first write).
        head: rows written so far.
        tail: rows consumed so far.
        dropped: rows refused because the ring was full.
    """

    def __init__(self, columns: dict[str, np.dtype], capacity: int) -> None:
        """Allocate the slots once.

        Args:
            columns: column name -> dtype, in row order.
            capacity: minimum number of rows; rounded up to a power of two.

        Raises:
            ValueError: on a non-positive capacity or a column type a ring cannot hold.
        """
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"ring capacity must be a positive int, got {capacity!r}")
        cap = 1 << (capacity - 1).bit_length()
        self.dtype = row_dtype(columns)
        self._struct = struct.Struct(_struct_format(self.dtype))
        self.capacity = cap
        self.mask = cap - 1
        self.slots: list[tuple[int | float, ...] | None] = [None] * cap
        self._index = {name: i for i, name in enumerate(self.dtype.names or ())}
        self._flags = self._index.get("flags", -1)
        self._lock = threading.Lock()
        self._unknown = tuple(
            np.nan if self.dtype.fields[n][0].kind == "f" else -1  # type: ignore[index]
            for n in self.dtype.names or ()
        )
        self.head = 0
        self.tail = 0
        self.dropped = 0
        self.malformed = 0
        """Rows read with a value that did not fit its column (shipped as unknown)."""

    def push(self, *values: int | float) -> int:
        """Append one row (values in column order).

        Args:
            values: one value per column.

        Returns:
            The row's absolute index, or -1 when the ring was full (the row is counted in
            ``dropped``).

        Raises:
            struct.error: when a value does not fit its column (nothing is written).
        """
        self._struct.pack(*values)  # the check only: the hot paths skip it
        h = self.head
        if h - self.tail > self.mask:
            self.dropped += 1
            return -1
        self.slots[h & self.mask] = values
        self.head = h + 1
        return h

    def _row(self, index: int) -> tuple[int | float, ...] | None:
        """The row at absolute ``index`` while it is unconsumed, else None (callers that
        replace it hold the ring's lock)."""
        if index < self.tail or index >= self.head:
            return None
        return self.slots[index & self.mask]

    def get_field(self, index: int, name: str) -> int | float | None:
        """One column of an unconsumed row (None when the row was consumed)."""
        row = self._row(index)
        return None if row is None else row[self._index[name]]

    def update(
        self,
        index: int,
        fields: Mapping[str, int | float],
        set_bits: int = 0,
        clear_bits: int = 0,
    ) -> bool:
        """Change columns of an unconsumed row and set, then clear, bits of its ``flags``.

        Safe from any thread: the row's tuple is replaced under the ring's lock.

        Args:
            index: absolute row index returned by ``push``.
            fields: column name -> new value.
            set_bits, clear_bits: flag bits (rows with a ``flags`` column only).

        Returns:
            False when the row was already consumed (nothing is changed).
        """
        with self._lock:
            row = self._row(index)
            if row is None:
                return False
            new = list(row)
            for name, value in fields.items():
                new[self._index[name]] = value
            if set_bits or clear_bits:
                f = self._flags
                new[f] = (int(new[f]) | set_bits) & ~clear_bits
            self.slots[index & self.mask] = tuple(new)
            return True

    def set_field(self, index: int, name: str, value: int | float) -> bool:
        """Update one column of a row that has not been consumed yet.

        Args:
            index: absolute row index returned by ``push``.
            name: column name.
            value: new value.

        Returns:
            False when the row was already consumed (the update is ignored).
        """
        return self.update(index, {name: value})

    def complete(self, index: int, time_field: str, t: int, clear: int) -> bool:
        """Fill a late time column of an unconsumed row and clear flag bits, both at once.

        Used from completion callbacks (another thread); rows must have a ``flags`` column.

        Args:
            index: absolute row index.
            time_field: the column to set (e.g. ``t_exit``).
            t: its value.
            clear: flag bits to clear.

        Returns:
            False when the row was already consumed.
        """
        j = self._index[time_field]
        f = self._flags
        with self._lock:
            row = self._row(index)
            if row is None:
                return False
            new = list(row)
            new[j] = t
            new[f] = int(new[f]) & ~clear
            self.slots[index & self.mask] = tuple(new)
            return True

    def __len__(self) -> int:
        return self.head - self.tail

    def unread(self, limit: int | None = None) -> np.ndarray:
        """Copy of the unread rows in write order (at most ``limit``), not yet consumed.

        Args:
            limit: maximum number of rows to return.

        Returns:
            A structured array; ``consume(n)`` then releases the first ``n`` of them.
        """
        start, end = self.tail, self.head
        if limit is not None:
            end = min(end, start + max(0, limit))
        n = end - start
        if n <= 0:
            return np.zeros(0, self.dtype)
        i0 = start & self.mask
        i1 = i0 + n
        if i1 <= self.capacity:
            rows = self.slots[i0:i1]
        else:
            rows = self.slots[i0:] + self.slots[: i1 - self.capacity]
        if n <= CONVERT_ROWS:
            return self._convert(rows)
        # In pieces: the conversion holds the GIL, and between two pieces a writer that
        # has been waiting for it gets it (a full ring would otherwise hold it ~10-40 ms).
        out = np.empty(n, self.dtype)
        for k in range(0, n, CONVERT_ROWS):
            out[k : k + CONVERT_ROWS] = self._convert(rows[k : k + CONVERT_ROWS])
        return out

    def _convert(self, rows: list[tuple[int | float, ...] | None]) -> np.ndarray:
        try:
            return np.array(rows, dtype=self.dtype)
        except (OverflowError, ValueError, TypeError):
            return self._fitted(rows)

    def _fitted(self, rows: list[tuple[int | float, ...] | None]) -> np.ndarray:
        """Rows with each value that does not fit its column replaced by "unknown" (-1 or
        NaN). Writers check their values, so this is a guard: a bad row must not stop the
        reader, which would then never consume it."""
        out = np.empty(len(rows), self.dtype)
        names = self.dtype.names or ()
        for k, row in enumerate(rows):
            try:
                out[k] = row
                continue
            except (OverflowError, ValueError, TypeError):
                self.malformed += 1
            vals = row if row is not None and len(row) == len(names) else self._unknown
            for name, value, unknown in zip(names, vals, self._unknown):
                try:
                    out[name][k] = value
                except (OverflowError, ValueError, TypeError):
                    out[name][k] = unknown
        return out

    def consume(self, n: int) -> None:
        """Release the first ``n`` unread rows for reuse.

        The reader empties their slots, so the rows are freed on its thread, not by the
        writer's next pass over the slot.

        Args:
            n: rows to release (clipped to the number unread).
        """
        with self._lock:
            n = max(0, min(n, self.head - self.tail))
            if n == 0:
                return
            i0 = self.tail & self.mask
            i1 = i0 + n
            slots = self.slots
            if i1 <= self.capacity:
                slots[i0:i1] = [None] * n
            else:
                slots[i0:] = [None] * (self.capacity - i0)
                slots[: i1 - self.capacity] = [None] * (i1 - self.capacity)
            self.tail += n
