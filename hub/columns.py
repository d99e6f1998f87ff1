"""Growable columnar buffers: the store's tables grow in chunks, never row by row."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


class Columns:
    """A table of equal-length numpy columns with amortised O(1) append of whole batches.

    Capacity doubles when full (keeping a quarter of it free; past a ``limit`` its owner
    trims to, only as far as the rows need) and halves after many `keep` calls that left it
    mostly empty, so memory follows the live row count without churning. Rows live at ``[lo, lo + n)`` of
    the buffers: `trim` forgets leading rows by moving ``lo``, without copying.
    """

    def __init__(
        self,
        dtypes: Mapping[str, np.dtype | type],
        capacity: int = 1024,
        limit: int | None = None,
    ) -> None:
        """Args:
        dtypes: column name -> dtype.
        capacity: rows allocated at first.
        limit: rows the owner keeps the table within (trimming it after appends), if
            any: capacity doubles up to it and past it grows only as far as the rows need,
            not to twice a bound.
        """
        self.limit = limit
        self.dtypes = {name: np.dtype(dt) for name, dt in dtypes.items()}
        self._min = max(int(capacity), 16)
        self._cols = {name: np.empty(self._min, dt) for name, dt in self.dtypes.items()}
        self.n = 0
        """Rows in use."""
        self._lo = 0
        self._quiet = 0

    def __len__(self) -> int:
        return self.n

    @property
    def capacity(self) -> int:
        return next(iter(self._cols.values())).shape[0] if self._cols else 0

    def nbytes(self) -> int:
        """Bytes allocated (capacity, not just rows in use)."""
        return sum(c.nbytes for c in self._cols.values())

    def _resize(self, capacity: int) -> None:
        lo, hi = self._lo, self._lo + self.n
        for name, col in self._cols.items():
            grown = np.empty(capacity, col.dtype)
            grown[: self.n] = col[lo:hi]
            self._cols[name] = grown
        self._lo = 0

    def append(self, cols: Mapping[str, np.ndarray | int | float], n: int) -> None:
        """Append ``n`` rows. Scalars broadcast; every column must be given.

        Args:
            cols: column name -> array of ``n`` values (cast to the column dtype) or scalar.
            n: number of rows.

        Raises:
            KeyError: a column is missing.
            ValueError: an array has the wrong length.
        """
        if n <= 0:
            return
        need = self.n + n
        if self._lo + need > self.capacity:
            # Moving the rows back to the start copies them all: with less than a fifth of
            # the buffer free after it, a table trimmed at the front as fast as it grows
            # (the instances of a ring of steps) would copy itself every step.
            cap = self.capacity
            want = need + need // 4
            while cap < want:
                cap *= 2
            if self.limit is not None and cap > want:
                cap = max(want, min(cap, self.limit + self.limit // 4))
            self._resize(cap)  # also moves the rows back to the start
        start = self._lo + self.n
        for name, col in self._cols.items():
            col[start : start + n] = cols[name]
        self.n = need

    def view(self) -> dict[str, np.ndarray]:
        """The rows in use, as views (valid until the next append, keep or trim)."""
        lo, hi = self._lo, self._lo + self.n
        return {name: col[lo:hi] for name, col in self._cols.items()}

    def fit(self, limit: int) -> None:
        """Set ``limit`` and give back the capacity beyond what it lets the table grow to
        (a quarter above it, as `append` grows), keeping the rows."""
        self.limit = int(limit)
        most = max(self._min, self.n, self.limit + self.limit // 4)
        if self.capacity > most:
            self._resize(most)

    def keep(self, mask: np.ndarray) -> None:
        """Keep only the rows where ``mask`` is True, in order."""
        idx = np.flatnonzero(mask)
        m = idx.shape[0]
        if m == self.n:
            return
        idx += self._lo
        for col in self._cols.values():
            col[:m] = col[idx]
        self.n = m
        self._lo = 0
        # Give memory back only after a long quiet spell: shrinking and regrowing every
        # pass would fault fresh pages in on every append.
        cap = self.capacity
        self._quiet = self._quiet + 1 if cap > self._min and m < cap // 8 else 0
        if self._quiet >= 64:
            self._resize(max(self._min, cap // 2))
            self._quiet = 0

    def trim(self, mask: np.ndarray) -> None:
        """Forget rows where ``mask`` is False, cheaply: a leading run of them at once (no
        copy), the others only once they are a quarter of the table (one `keep`). Until
        then they stay visible: callers filter what they read.

        Args:
            mask: bool per row in use, True for rows still wanted.
        """
        if self.n == 0:
            return
        lead = int(np.argmax(mask)) if mask.any() else self.n
        self._lo += lead
        self.n -= lead
        rest = mask[lead:]
        if 4 * (self.n - int(np.count_nonzero(rest))) > self.n:
            self.keep(rest)

    def clear(self) -> None:
        self.n = 0
        self._lo = 0
