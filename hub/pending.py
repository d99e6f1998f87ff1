"""Collective rows between arrival and matching, and the raw rows of the latest steps.

Ingest only keeps references to the columns of each accepted message (a `Part`); the
store's matching pass (`hub.matching`) takes them all at once. Ingest reads nothing of
the rows: before a pass, :func:`prepare` looks at the new parts together, one numpy call per
question for all of them rather than a few per message: their flags (asynchronous,
device-timed), whether they mix groups, the asynchronous cut
(:func:`diagnosis.arrivals.async_cut`) of their asynchronous rows, and it splits the parts
that mix groups (a rank's tensor-parallel calls and its data-parallel buckets in one
message) into one *piece* per group, so that they too form blocks. Parts whose instances
are not complete yet wait for the next pass as they are (no copy; waiting pieces move to a
batch of their own rows) when they form a block (`hub.matching`), otherwise their rows wait
as columns (``left``). The raw rows of the last ``raw_steps`` step ids are kept the same
way, as references.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from rankscope.collector import schema
from rankscope.diagnosis.arrivals import ASYNC_FLAGS, async_cut
from rankscope.hub.columns import Columns

PENDING_DTYPES = {
    "rank": np.dtype(np.int32),
    **schema.COLL_COLUMNS,
    "epoch": np.dtype(np.int64),
    "cut": np.dtype(np.float64),
}
"""Columns of a matching pass: the row, its rank, incarnation and async cut."""


class Part:
    """The collective rows of one message of one rank, or one group's rows of it (a
    *piece*: its rows are ``batch[index[start:start + n]]``, in a batch of columns shared by
    the pieces one split made, which a block gathers with one index instead of one slice a
    piece)."""

    __slots__ = (
        "_cols",
        "arrival",
        "batch",
        "cut",
        "dev",
        "fresh",
        "group",
        "inc",
        "index",
        "is_async",
        "n",
        "rank",
        "seq0",
        "start",
        "step0",
    )

    def __init__(
        self,
        rank: int,
        inc: int,
        cols: Mapping[str, np.ndarray],
        cut: np.ndarray | None = None,
        is_async: bool | None = None,
        dev: bool | None = None,
        arrival: int = 0,
    ) -> None:
        self.arrival = arrival
        """Order of arrival among the run's parts (the pieces of a split part share it)."""
        self.rank = rank
        self.inc = inc
        self._cols: Mapping[str, np.ndarray] | None = cols
        self.batch: Mapping[str, np.ndarray] | None = None
        """For a piece: the columns (with ``cut``) its rows are taken from, else None."""
        self.index: np.ndarray | None = None
        """For a piece: the batch's rows in (part, group) order, shared by its pieces."""
        self.start = 0
        """For a piece: its first position in ``index``."""
        self.cut = cut
        """Per-row async cut relative to the run's origin (NaN on blocking rows, which do
        not use it); None when no row is async, or until the pass computes it
        (:func:`prepare`)."""
        self.n = int(cols["step"].shape[0])
        g = cols["group"]
        g0 = int(g[0])
        self.group = g0 if g0 == int(g[-1]) else -1
        """-1 when the rows mix groups, otherwise the group of every row (until the pass
        looks at all rows, :func:`prepare`: the group of the first and the last row)."""
        self.seq0 = int(cols["seq"][0])
        self.step0 = int(cols["step"][0])
        """``seq`` and ``step`` of the first row."""
        self.fresh = True
        """Not seen by a matching pass yet (its calls and time are not counted yet)."""
        self.is_async = is_async
        """Some row is asynchronous (``arrivals.ASYNC_FLAGS``); None until the pass looks
        at the flags of all new parts at once (:func:`prepare`)."""
        self.dev = dev
        """Some row is device-timed (None: as ``is_async``)."""

    @classmethod
    def piece(
        cls,
        parent: Part,
        batch: Mapping[str, np.ndarray],
        index: np.ndarray,
        start: int,
        n: int,
        group: int,
        first: tuple[int, int],
        is_async: bool,
        dev: bool,
    ) -> Part:
        """One group's rows of ``parent``: ``batch[index[start:start + n]]``; ``first`` is
        the ``seq`` and ``step`` of its first row."""
        p = cls.__new__(cls)
        p.arrival, p.rank, p.inc, p.fresh = parent.arrival, parent.rank, parent.inc, parent.fresh
        p._cols, p.batch, p.index, p.start, p.n = None, batch, index, start, n
        p.group, p.is_async, p.dev = group, is_async, dev
        p.seq0, p.step0 = first
        p.cut = batch["cut"][index[start : start + n]] if is_async else None
        return p

    @property
    def cols(self) -> Mapping[str, np.ndarray]:
        """``COLL_COLUMNS`` of the rows."""
        if self._cols is None:
            assert self.batch is not None and self.index is not None
            rows = self.index[self.start : self.start + self.n]
            self._cols = {c: self.batch[c][rows] for c in schema.COLL_COLUMNS}
        return self._cols

    def column(self, name: str) -> np.ndarray:
        """One column of the rows (without building the others of a piece)."""
        if self._cols is None:
            assert self.batch is not None and self.index is not None
            return self.batch[name][self.index[self.start : self.start + self.n]]
        return self._cols[name]

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


def prepare(parts: list[Part], t0: int) -> list[Part]:
    """Ready parts for a matching pass: compute the missing async cuts and split the parts
    that mix groups into one part per group (each keeps its rows in order).

    Args:
        parts: the parts of a pass, in arrival order.
        t0: the run's origin (the cut is relative to it).

    Returns:
        The parts, a mixed one replaced by its pieces in its place.
    """
    _scan([p for p in parts if p.is_async is None or p.dev is None])
    _find_mixed([p for p in parts if p.group >= 0 and p.n > 2 and p.index is None])
    todo = [p for p in parts if p.is_async and p.cut is None]
    if todo:
        _fill_cuts(todo, t0)
    if not any(p.group < 0 for p in parts):
        return parts
    mixed = [p for p in parts if p.group < 0]
    pieces = _split(mixed)
    out: list[Part] = []
    for p in parts:
        if p.group < 0:
            out += pieces[id(p)]
        else:
            out.append(p)
    return out


def _scan(parts: list[Part]) -> None:
    """Set ``is_async`` and ``dev`` of ``parts`` from their flags, for all at once."""
    if not parts:
        return
    starts = np.cumsum([0] + [p.n for p in parts[:-1]])
    flags = np.concatenate([p.cols["flags"] for p in parts])
    if not flags.any():  # blocking host-timed rows (the usual case) carry no flag
        for p in parts:
            p.is_async = p.dev = False
        return
    is_async = np.logical_or.reduceat((flags & ASYNC_FLAGS) != 0, starts).tolist()
    dev = np.logical_or.reduceat((flags & schema.FLAG_DEVICE_TIMED) != 0, starts).tolist()
    for p, a, d in zip(parts, is_async, dev):
        p.is_async, p.dev = a, d


def _find_mixed(parts: list[Part]) -> None:
    """Mark parts whose rows between the first and the last are of another group (one
    min and max per part over all their rows at once)."""
    if not parts:
        return
    starts = np.cumsum([0] + [p.n for p in parts[:-1]])
    group = np.concatenate([p.cols["group"] for p in parts])
    lo = np.minimum.reduceat(group, starts)
    hi = np.maximum.reduceat(group, starts)
    for i in np.flatnonzero(lo != hi).tolist():
        parts[i].group = -1


def _fill_cuts(parts: list[Part], t0: int) -> None:
    """Set ``cut`` of ``parts`` with one `async_cut` over their asynchronous rows: the cut
    of a row depends only on the asynchronous rows of its message and step, so each part
    stands for the rank of its rows."""
    bounds = np.cumsum([0] + [p.n for p in parts])
    flags = np.concatenate([p.cols["flags"] for p in parts])
    rows = np.flatnonzero(flags & ASYNC_FLAGS)
    owner = np.searchsorted(bounds, rows, side="right") - 1

    def pick(name: str) -> np.ndarray:
        return np.concatenate([p.cols[name] for p in parts])[rows]

    cut = np.full(flags.shape[0], np.nan)
    cut[rows] = async_cut(owner, pick("step"), pick("t_enter"), flags[rows], t0, pick("t_exit"))
    for p, a, b in zip(parts, bounds[:-1].tolist(), bounds[1:].tolist()):
        p.cut = cut[a:b]


def _split(mixed: list[Part]) -> dict[int, list[Part]]:
    """One piece per (part, group) of ``mixed``, by one stable sort of all their rows.

    Returns:
        id of each mixed part -> its pieces, in ascending group order.
    """
    lens = [p.n for p in mixed]
    cols = {c: np.concatenate([p.cols[c] for p in mixed]) for c in schema.COLL_COLUMNS}
    if any(p.cut is not None for p in mixed):
        cols["cut"] = np.concatenate(
            [np.full(p.n, np.nan) if p.cut is None else p.cut for p in mixed]
        )
    n = cols["step"].shape[0]
    group = cols["group"].astype(np.int64)
    lo = int(group.min())
    span = int(group.max()) - lo + 1  # at most 2**32 (int32 ids): the key fits in int64
    key = np.repeat(np.arange(len(mixed), dtype=np.int64), lens) * span + (group - lo)
    order = np.argsort(key, kind="stable")
    ks = key[order]
    new = np.ones(n, bool)
    new[1:] = ks[1:] != ks[:-1]
    starts = np.flatnonzero(new)
    # The columns stay in message order: blocks gather their rows through ``order``.
    flags = cols["flags"][order]
    has_async = np.logical_or.reduceat((flags & ASYNC_FLAGS) != 0, starts)
    has_dev = np.logical_or.reduceat((flags & schema.FLAG_DEVICE_TIMED) != 0, starts)
    sizes = np.diff(np.append(starts, n))
    heads = order[starts]
    out: dict[int, list[Part]] = {id(p): [] for p in mixed}
    piece = Part.piece
    for a, m, k, seq0, step0, is_async, dev in zip(
        starts.tolist(),
        sizes.tolist(),
        ks[starts].tolist(),
        cols["seq"][heads].tolist(),
        cols["step"][heads].tolist(),
        has_async.tolist(),
        has_dev.tolist(),
    ):
        parent = mixed[k // span]
        out[id(parent)].append(
            piece(parent, cols, order, a, m, k % span + lo, (seq0, step0), is_async, dev)
        )
    return out


def _compact(pieces: list[Part]) -> None:
    """Move ``pieces`` into new batches holding only their rows, one per batch they come
    from (unless they already hold all of its rows)."""
    by_batch: dict[int, list[Part]] = {}
    for p in pieces:
        by_batch.setdefault(id(p.batch), []).append(p)
    for group in by_batch.values():
        first = group[0]
        assert first.batch is not None and first.index is not None
        if sum(p.n for p in group) == first.index.shape[0]:
            continue
        index = first.index
        rows = np.concatenate([index[p.start : p.start + p.n] for p in group])
        batch = {c: v[rows] for c, v in first.batch.items()}
        order = np.arange(rows.shape[0])
        at = 0
        for p in group:
            p.batch, p.index, p.start = batch, order, at
            if p.cut is not None:
                p.cut = batch["cut"][at : at + p.n]
            at += p.n


def concat_rows(parts: list[Part]) -> dict[str, np.ndarray]:
    """The rows of ``parts``, in order, as ``PENDING_DTYPES`` columns."""
    lens = [p.n for p in parts]
    out = {c: np.concatenate([p.column(c) for p in parts]) for c in schema.COLL_COLUMNS}
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
        """(newest step, rank, columns) of the parts whose raw rows may be kept."""
        self._raw_new: list[tuple[int, Mapping[str, np.ndarray]]] = []
        """(rank, columns) of parts not in ``_raw`` yet (their newest steps are found for
        all at once)."""
        self._raw_base = -(2**62)
        self._arrivals = 0

    def add(
        self,
        rank: int,
        inc: int,
        cols: Mapping[str, np.ndarray],
        raw_cutoff: int | None,
    ) -> None:
        """Queue one message's collective rows. Nothing here reads the rows: what the
        pass needs from them (flags, groups, the async cut) is computed for all new parts
        at once (:func:`prepare`).

        Args:
            rank, inc: sender and its incarnation.
            cols: ``COLL_COLUMNS`` arrays (kept by reference), at least one row.
            raw_cutoff: oldest step whose raw rows the run keeps.
        """
        self._arrivals += 1
        part = Part(rank, inc, cols, arrival=self._arrivals)
        self._new.append(part)
        self.rows += part.n
        self.new_rows += part.n
        if self.raw_steps:
            self._raw_new.append((rank, cols))
            # Filter once the parts span twice the steps to keep: each part is looked at a
            # bounded number of times, and what is kept depends only on the message order.
            if raw_cutoff is not None and raw_cutoff - self._raw_base >= self.raw_steps:
                self._index_raw()
                self._raw = [p for p in self._raw if p[0] >= raw_cutoff]
                self._raw_base = raw_cutoff

    def _index_raw(self) -> None:
        """Move ``_raw_new`` into ``_raw`` with the newest step of each part."""
        if not self._raw_new:
            return
        steps = [cols["step"] for _, cols in self._raw_new]
        starts = np.cumsum([0] + [s.shape[0] for s in steps[:-1]])
        newest = np.maximum.reduceat(np.concatenate(steps), starts).tolist()
        self._raw += [(top, r, cols) for top, (r, cols) in zip(newest, self._raw_new)]
        self._raw_new = []

    def take(self, t0: int) -> tuple[list[Part], dict[str, np.ndarray] | None]:
        """Everything for a matching pass: the parts in arrival order (those a pass saw
        before have ``fresh`` False), made ready by :func:`prepare` (``t0``: the run's
        origin), and the left-over rows (None when there are none)."""
        parts = sorted(self.kept, key=lambda p: p.arrival) + prepare(self._new, t0)
        self.kept, self._new = [], []
        left = None
        if len(self.left):
            left = {k: v.copy() for k, v in self.left.view().items()}
        self.left.clear()
        self.rows = self.new_rows = 0
        return parts, left

    def keep(self, parts: list[Part], rows: Mapping[str, np.ndarray] | None) -> None:
        """Keep ``parts`` whole and ``rows`` as columns for the next pass (pieces move to
        a batch of their own rows: a few waiting pieces must not hold a whole pass)."""
        for p in parts:
            p.fresh = False
        _compact([p for p in parts if p.batch is not None])
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
        self._index_raw()
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
