"""Collective rows between arrival and matching, and the raw rows of the latest steps.

Ingest only keeps references to the columns of each accepted message (a `Part`); the
store's matching pass (`hub.matching`) takes them all at once. Parts whose instances are
not complete yet wait for the next pass as they are (no copy) when they form a block
(`hub.matching`), otherwise their rows wait as columns (``left``). The raw rows of the last
``raw_steps`` step ids are kept the same way, as references.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from rankscope.collector import schema
from rankscope.hub.columns import Columns

PENDING_DTYPES = {
    "rank": np.dtype(np.int32),
    **schema.COLL_COLUMNS,
    "epoch": np.dtype(np.int64),
    "cut": np.dtype(np.float64),
}
"""Columns of a matching pass: the row, its rank, incarnation and async cut."""


class Part:
    """The collective rows of one message of one rank."""

    __slots__ = ("arrival", "cols", "cut", "dev", "fresh", "group", "inc", "is_async", "n", "rank")

    def __init__(
        self,
        rank: int,
        inc: int,
        cols: Mapping[str, np.ndarray],
        cut: np.ndarray | None,
        is_async: bool,
        dev: bool,
        arrival: int = 0,
    ) -> None:
        self.arrival = arrival
        """Order of arrival among the run's parts."""
        self.rank = rank
        self.inc = inc
        self.cols = cols
        self.cut = cut
        """Per-row async cut relative to the run's origin; None when no row is async."""
        self.n = int(cols["step"].shape[0])
        g = cols["group"]
        g0 = int(g[0])
        self.group = g0 if g0 == int(g[-1]) else -1
        """-1 when the rows mix groups; otherwise the group of the first and last row
        (a block checks that every row has it)."""
        self.fresh = True
        """Not seen by a matching pass yet (its calls and time are not counted yet)."""
        self.is_async = is_async
        """Some row is asynchronous (``arrivals.ASYNC_FLAGS``)."""
        self.dev = dev
        """Some row is device-timed."""

    def rows(self, sel: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The rows (all, or ``sel``) as ``PENDING_DTYPES`` columns."""
        cols = {c: self.cols[c] if sel is None else self.cols[c][sel] for c in schema.COLL_COLUMNS}
        m = cols["step"].shape[0]
        cols["rank"] = np.full(m, self.rank, np.int32)
        cols["epoch"] = np.full(m, self.inc, np.int64)
        if self.cut is None:
            cols["cut"] = np.full(m, np.nan)
        else:
            cols["cut"] = self.cut if sel is None else self.cut[sel]
        return cols


def concat_rows(parts: list[Part]) -> dict[str, np.ndarray]:
    """The rows of ``parts``, in order, as ``PENDING_DTYPES`` columns."""
    lens = [p.n for p in parts]
    out = {c: np.concatenate([p.cols[c] for p in parts]) for c in schema.COLL_COLUMNS}
    out["rank"] = np.repeat(np.array([p.rank for p in parts], np.int32), lens)
    out["epoch"] = np.repeat(np.array([p.inc for p in parts], np.int64), lens)
    if all(p.cut is None for p in parts):
        out["cut"] = np.full(sum(lens), np.nan)
    else:
        out["cut"] = np.concatenate(
            [np.full(p.n, np.nan) if p.cut is None else p.cut for p in parts]
        )
    return out


class PendingRows:
    """Collective rows of one run waiting for the matching pass, plus the raw-row ring."""

    def __init__(self, raw_steps: int) -> None:
        self.raw_steps = raw_steps
        self._new: list[Part] = []
        self.kept: list[Part] = []
        """Parts left incomplete by the last pass, kept whole."""
        self.left = Columns(PENDING_DTYPES, 4096)
        """Rows left incomplete by the last pass, outside any kept part."""
        self.rows = 0
        """Rows the next pass will see (left over plus newly arrived)."""
        self.new_rows = 0
        """Rows arrived since the last pass."""
        self._raw: list[tuple[int, int, Mapping[str, np.ndarray]]] = []
        self._raw_base = -(2**62)
        self._arrivals = 0

    def add(
        self,
        rank: int,
        inc: int,
        cols: Mapping[str, np.ndarray],
        cut: np.ndarray | None,
        raw_cutoff: int | None,
        dev: bool = False,
    ) -> None:
        """Queue one message's collective rows.

        Args:
            rank, inc: sender and its incarnation.
            cols: ``COLL_COLUMNS`` arrays (kept by reference), at least one row.
            cut: per-row async cut (relative to the run's origin), None when no row is async.
            raw_cutoff: oldest step whose raw rows the run keeps.
            dev: some row is device-timed.
        """
        self._arrivals += 1
        part = Part(rank, inc, cols, cut, cut is not None, dev, self._arrivals)
        self._new.append(part)
        self.rows += part.n
        self.new_rows += part.n
        if self.raw_steps:
            self._raw.append((int(cols["step"].max()), rank, cols))
            # Filter once the parts span twice the steps to keep: each part is looked at a
            # bounded number of times, and what is kept depends only on the message order.
            if raw_cutoff is not None and raw_cutoff - self._raw_base >= self.raw_steps:
                self._raw = [p for p in self._raw if p[0] >= raw_cutoff]
                self._raw_base = raw_cutoff

    def take(self) -> tuple[list[Part], dict[str, np.ndarray] | None]:
        """Everything for a matching pass: the parts in arrival order (those a pass saw
        before have ``fresh`` False), and the left-over rows (None when there are none)."""
        parts = sorted(self.kept, key=lambda p: p.arrival) + self._new
        self.kept, self._new = [], []
        left = None
        if len(self.left):
            left = {k: v.copy() for k, v in self.left.view().items()}
        self.left.clear()
        self.rows = self.new_rows = 0
        return parts, left

    def keep(self, parts: list[Part], rows: Mapping[str, np.ndarray] | None) -> None:
        """Keep ``parts`` whole and ``rows`` as columns for the next pass."""
        for p in parts:
            p.fresh = False
        self.kept.extend(parts)
        self.rows += sum(p.n for p in parts)
        if rows is not None:
            m = rows["step"].shape[0]
            if m:
                self.left.append(rows, m)
                self.rows += m

    def open_rows(self) -> dict[str, np.ndarray] | None:
        """The rows left incomplete by the last pass (kept parts and left rows), or None."""
        chunks = []
        if len(self.left):
            chunks.append(self.left.view())
        if self.kept:
            chunks.append(concat_rows(self.kept))
        if not chunks:
            return None
        if len(chunks) == 1:
            return dict(chunks[0])
        return {k: np.concatenate([c[k] for c in chunks]) for k in PENDING_DTYPES}

    def raw(self, cutoff: int | None) -> dict[str, np.ndarray] | None:
        """Raw rows (with ``rank``) of steps from ``cutoff`` on, or None."""
        parts = [p for p in self._raw if cutoff is None or p[0] >= cutoff]
        if not parts:
            return None
        lens = [p[2]["step"].shape[0] for p in parts]
        out = {c: np.concatenate([p[2][c] for p in parts]) for c in schema.COLL_COLUMNS}
        out["rank"] = np.repeat([p[1] for p in parts], lens).astype(np.int32)
        if cutoff is not None:
            keep = out["step"] >= cutoff
            out = {k: v[keep] for k, v in out.items()}
        return out
