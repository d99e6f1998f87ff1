"""Fixed-capacity ring buffers of table rows, written on the training thread without
allocation.

A ring is one preallocated ``bytearray`` viewed twice: as a numpy structured array (the
reader slices columns out of it) and through a precompiled ``struct`` packer (the writer
stores a whole row in one C call, ~0.1 µs). One thread writes rows, one thread reads them;
under the GIL each ``pack_into`` is atomic, and the writer publishes a row by advancing
``head`` only after it is fully written. When the ring is full the new row is dropped and
counted: memory never grows and the writer never waits.
"""

from __future__ import annotations

import struct

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

    Attributes:
        capacity: rows the ring holds (a power of two).
        rows: numpy structured view of the storage (``capacity`` rows).
        head: rows written so far.
        tail: rows consumed so far.
        dropped: rows refused because the ring was full.
    """

    def __init__(self, columns: dict[str, np.dtype], capacity: int) -> None:
        """Allocate the storage once.

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
        if self._struct.size != self.dtype.itemsize:
            raise ValueError("ring row layout does not match its dtype")
        self.capacity = cap
        self.mask = cap - 1
        self.row_size = self.dtype.itemsize
        self.raw = bytearray(cap * self.row_size)
        self.rows = np.frombuffer(self.raw, dtype=self.dtype)
        self.pack_into = self._struct.pack_into
        self._field_offsets = {}
        for name in self.dtype.names or ():
            field, offset = self.dtype.fields[name][:2]  # type: ignore[index]
            code = _STRUCT_CODES[(field.kind, field.itemsize)]
            self._field_offsets[name] = (offset, struct.Struct("<" + code))
        self.head = 0
        self.tail = 0
        self.dropped = 0

    def push(self, *values: int | float) -> int:
        """Append one row (values in column order).

        Args:
            values: one value per column.

        Returns:
            The row's absolute index, or -1 when the ring was full (the row is counted in
            ``dropped``).
        """
        h = self.head
        if h - self.tail > self.mask:
            self.dropped += 1
            return -1
        self.pack_into(self.raw, (h & self.mask) * self.row_size, *values)
        self.head = h + 1
        return h

    def field_writer(self, name: str) -> tuple[int, struct.Struct]:
        """Byte offset of a column inside a row and the packer for it (for late updates)."""
        return self._field_offsets[name]

    def set_field(self, index: int, name: str, value: int | float) -> bool:
        """Update one column of a row that has not been consumed yet.

        Args:
            index: absolute row index returned by ``push``.
            name: column name.
            value: new value.

        Returns:
            False when the row was already consumed (the update is ignored).
        """
        if index < self.tail or index >= self.head:
            return False
        off, packer = self._field_offsets[name]
        packer.pack_into(self.raw, (index & self.mask) * self.row_size + off, value)
        return True

    def complete(self, index: int, time_field: str, t: int, clear: int) -> bool:
        """Fill a late time column of an unconsumed row and clear flag bits, both in place.

        Used from completion callbacks (another thread); rows must have a ``flags`` column.

        Args:
            index: absolute row index.
            time_field: the column to set (e.g. ``t_exit``).
            t: its value.
            clear: flag bits to clear.

        Returns:
            False when the row was already consumed.
        """
        if index < self.tail or index >= self.head:
            return False
        base = (index & self.mask) * self.row_size
        off, packer = self._field_offsets[time_field]
        packer.pack_into(self.raw, base + off, t)
        foff, fpack = self._field_offsets["flags"]
        flags = fpack.unpack_from(self.raw, base + foff)[0]
        fpack.pack_into(self.raw, base + foff, flags & ~clear)
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
            return self.rows[:0].copy()
        i0 = start & self.mask
        i1 = i0 + n
        if i1 <= self.capacity:
            return self.rows[i0:i1].copy()
        return np.concatenate([self.rows[i0:], self.rows[: i1 - self.capacity]])

    def consume(self, n: int) -> None:
        """Release the first ``n`` unread rows for reuse.

        Args:
            n: rows to release (clipped to the number unread).
        """
        self.tail += max(0, min(n, self.head - self.tail))
