"""Collective rows between arrival and matching, and the raw rows of the latest steps.

Ingest keeps references to the columns of each accepted message (a `Part`); the store's
matching pass (`hub.matching`) takes them all at once. While a message's columns are still
in cache, ingest compares a few of them as bytes, a copy and a compare each with no numpy
reduction: whether every row is of one group, whether no row carries a flag, and whether
``seq``, ``step`` and ``nbytes`` equal those of the first pending part of the same
signature (a `_Reference`), which spares the pass a read of each column of every member of
a block. Before a pass, :func:`prepare` looks at the remaining questions for all new parts
together, one numpy call per question rather than a few per message: the flags of parts
that carry some, the asynchronous cut (:func:`diagnosis.arrivals.async_cut`) of their
asynchronous rows, and it splits the parts that mix groups (a rank's tensor-parallel calls
and its data-parallel buckets in one message) into one *piece* per group, so that they too
form blocks. Parts whose instances are not complete yet wait for the next pass as they are
(no copy; waiting pieces move to a batch of their own rows) when they form a block
(`hub.matching`), otherwise their rows wait as columns (``left``). The raw rows of the
last ``raw_steps`` step ids are kept the same way, as references.
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


_UNIFORM: dict[tuple[np.dtype, int, int], bytes] = {}
"""(dtype, rows, value) -> the bytes of a column holding only ``value``: at most 256
columns of at most 64 KiB (a larger column pays for its own)."""


def _uniform(col: np.ndarray, value: int) -> bool:
    """Whether every entry of the integer ``col`` equals ``value``: one copy and one
    compare against cached bytes, cheaper than a numpy reduction on a message's column."""
    key = (col.dtype, col.shape[0], value)
    want = _UNIFORM.get(key)
    if want is None:
        want = np.full(col.shape[0], value, col.dtype).tobytes()
        if len(want) <= 1 << 16:
            if len(_UNIFORM) >= 256:
                _UNIFORM.clear()
            _UNIFORM[key] = want
    return col.tobytes() == want


class _Reference:
    """The ``seq``, ``step`` and ``nbytes`` columns (as bytes) of the first pending part of
    a signature ``(inc, group, rows, first seq, first step)``: the parts of one block's
    sub-block (`hub.blockset`) share a signature, and each compares its columns with these
    when it arrives."""

    __slots__ = ("dtypes", "nbytes", "one_step", "seq", "step")

    def __init__(self, cols: Mapping[str, np.ndarray]) -> None:
        seq, step, nbytes = cols["seq"], cols["step"], cols["nbytes"]
        self.dtypes = (seq.dtype, step.dtype, nbytes.dtype)
        self.seq, self.step, self.nbytes = seq.tobytes(), step.tobytes(), nbytes.tobytes()
        self.one_step = _uniform(step, int(step[0]))
        """Every row is of the first row's step."""


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
        "newest",
        "rank",
        "ref",
        "same_sizes",
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
        step, g = cols["step"], cols["group"]
        self.n = len(step)
        g0 = int(g.item(0))
        self.group = g0 if g0 == g.item(-1) and _uniform(g, g0) else -1
        """-1 when the rows mix groups, otherwise the group of every row."""
        self.seq0 = int(cols["seq"].item(0))
        self.step0 = int(step.item(0))
        """``seq`` and ``step`` of the first row."""
        self.fresh = True
        """Not seen by a matching pass yet (its calls and time are not counted yet)."""
        if is_async is None and dev is None and self.group >= 0 and _uniform(cols["flags"], 0):
            is_async = dev = False  # the usual rows: blocking, host-timed, no flag
        self.is_async = is_async
        """Some row is asynchronous (``arrivals.ASYNC_FLAGS``); None until the pass looks
        at the flags of all new parts that carry some at once (:func:`prepare`)."""
        self.dev = dev
        """Some row is device-timed (None: as ``is_async``)."""
        self.ref: _Reference | None = None
        """The reference whose ``seq`` and ``step`` columns the rows have (set by
        `PendingRows.add`); None when not compared or different."""
        self.same_sizes = False
        """With ``ref``: the rows also have its ``nbytes``."""
        self.newest: int | None = None
        """The newest step of the rows when known without reading them again."""

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
        p = cls.of_batch(
            parent.rank, parent.inc, batch, index, start, n, group, first, is_async, dev
        )
        p.arrival, p.fresh = parent.arrival, parent.fresh
        return p

    @classmethod
    def of_batch(
        cls,
        rank: int,
        inc: int,
        batch: Mapping[str, np.ndarray],
        index: np.ndarray,
        start: int,
        n: int,
        group: int,
        first: tuple[int, int],
        is_async: bool,
        dev: bool,
        arrival: int = 0,
    ) -> Part:
        """The rows ``batch[index[start:start + n]]`` of ``rank`` in one ``group`` (a piece,
        see `piece`); ``batch`` holds ``cut`` when ``is_async``."""
        p = cls.__new__(cls)
        p.arrival, p.rank, p.inc, p.fresh = arrival, rank, inc, True
        p._cols, p.batch, p.index, p.start, p.n = None, batch, index, start, n
        p.group, p.is_async, p.dev = group, is_async, dev
        p.seq0, p.step0 = first
        p.ref, p.same_sizes, p.newest = None, False, None
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
        """(newest step, rank, columns) of the parts whose raw rows may be kept; rank -1:
        the columns name each row's ``rank`` (a node message's, `add_many`)."""
        self._raw_new: list[tuple[int | None, int, Mapping[str, np.ndarray]]] = []
        """(newest step or None, rank, columns) of parts not in ``_raw`` yet (the unknown
        newest steps are found for all at once)."""
        self._refs: dict[tuple[int, int, int, int, int], _Reference] = {}
        """Signature -> the reference of the pending parts of that signature."""
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
        if part.group >= 0:
            self._compare(part, cols)
        self._new.append(part)
        self.rows += part.n
        self.new_rows += part.n
        if self.raw_steps:
            self._keep_raw((part.newest, rank, cols), raw_cutoff)

    def _keep_raw(
        self, entry: tuple[int | None, int, Mapping[str, np.ndarray]], raw_cutoff: int | None
    ) -> None:
        """Remember rows for the raw ring: (newest step or None, rank or -1 when the columns
        name each row's ``rank``, columns)."""
        self._raw_new.append(entry)
        # Filter once the parts span twice the steps to keep: each part is looked at a
        # bounded number of times, and what is kept depends only on the message order.
        if raw_cutoff is not None and raw_cutoff - self._raw_base >= self.raw_steps:
            self._index_raw()
            self._raw = [p for p in self._raw if p[0] >= raw_cutoff]
            self._raw_base = raw_cutoff

    def add_many(
        self,
        rank: np.ndarray,
        inc: np.ndarray,
        cols: Mapping[str, np.ndarray],
        raw_cutoff: int | None,
        t0: int,
    ) -> None:
        """Queue the collective rows of several ranks at once (a relay's node message,
        `hub.reduce`), as one piece per (rank, incarnation, group) of one batch: what
        `add` and the pass's split make of each rank's own message, without a part and a
        look at its columns per rank.

        Args:
            rank, inc: int64 per row, its sender and incarnation.
            cols: ``COLL_COLUMNS`` arrays of every row, at least one.
            raw_cutoff: oldest step whose raw rows the run keeps.
            t0: the run's origin (the asynchronous rows' cut is relative to it).
        """
        n = rank.shape[0]
        group = cols["group"].astype(np.int64)
        order = np.lexsort((group, inc, rank))  # stable: each piece keeps its rows' order
        r, i, g = rank[order], inc[order], group[order]
        new = np.ones(n, bool)
        new[1:] = (r[1:] != r[:-1]) | (i[1:] != i[:-1]) | (g[1:] != g[:-1])
        starts = np.flatnonzero(new)
        flags = cols["flags"][order]
        is_async = (flags & ASYNC_FLAGS) != 0
        has_async = np.logical_or.reduceat(is_async, starts)
        has_dev = np.logical_or.reduceat((flags & schema.FLAG_DEVICE_TIMED) != 0, starts)
        batch = dict(cols)
        if has_async.any():
            # The cut of a row depends on the asynchronous rows of its rank and step alone
            # (as `prepare` computes it for a rank's own message).
            rows = np.flatnonzero(cols["flags"] & ASYNC_FLAGS)
            owner = rank[rows] * (1 << 32) + inc[rows]
            cut = np.full(n, np.nan)
            cut[rows] = async_cut(
                owner,
                cols["step"][rows],
                cols["t_enter"][rows],
                cols["flags"][rows],
                t0,
                cols["t_exit"][rows],
            )
            batch["cut"] = cut
        heads = order[starts]
        self._arrivals += 1
        arrival = self._arrivals
        sizes = np.diff(np.append(starts, n))
        new_parts = self._new
        make = Part.of_batch
        for a, m, rk, ic, gid, seq0, step0, asy, dev in zip(
            starts.tolist(),
            sizes.tolist(),
            r[starts].tolist(),
            i[starts].tolist(),
            g[starts].tolist(),
            cols["seq"][heads].tolist(),
            cols["step"][heads].tolist(),
            has_async.tolist(),
            has_dev.tolist(),
            strict=True,
        ):
            new_parts.append(
                make(rk, ic, batch, order, a, m, gid, (seq0, step0), asy, dev, arrival)
            )
        self.rows += n
        self.new_rows += n
        if self.raw_steps:
            self._keep_raw((None, -1, {**cols, "rank": rank.astype(np.int32)}), raw_cutoff)

    def _compare(self, part: Part, cols: Mapping[str, np.ndarray]) -> None:
        """Compare the ``seq``, ``step`` and ``nbytes`` columns of a single-group ``part``
        with the reference of its signature (it becomes the reference when there is none)."""
        sig = (part.inc, part.group, part.n, part.seq0, part.step0)
        ref = self._refs.get(sig)
        if ref is None:
            ref = self._refs[sig] = _Reference(cols)
            part.ref, part.same_sizes = ref, True
        else:
            seq, step, nbytes = cols["seq"], cols["step"], cols["nbytes"]
            if (
                (seq.dtype, step.dtype, nbytes.dtype) == ref.dtypes
                and seq.tobytes() == ref.seq
                and step.tobytes() == ref.step
            ):
                part.ref, part.same_sizes = ref, nbytes.tobytes() == ref.nbytes
        if part.ref is not None and ref.one_step:
            part.newest = part.step0

    def _index_raw(self) -> None:
        """Move ``_raw_new`` into ``_raw`` with the newest step of each part."""
        if not self._raw_new:
            return
        steps = [cols["step"] for top, _, cols in self._raw_new if top is None]
        found: list[int] = []
        if steps:
            starts = np.cumsum([0] + [s.shape[0] for s in steps[:-1]])
            found = np.maximum.reduceat(np.concatenate(steps), starts).tolist()
        more = iter(found)
        self._raw += [
            (next(more) if top is None else top, r, cols) for top, r, cols in self._raw_new
        ]
        self._raw_new = []

    def take(self, t0: int) -> tuple[list[Part], dict[str, np.ndarray] | None]:
        """Everything for a matching pass: the parts in arrival order (those a pass saw
        before have ``fresh`` False), made ready by :func:`prepare` (``t0``: the run's
        origin), and the left-over rows (None when there are none)."""
        parts = sorted(self.kept, key=lambda p: p.arrival) + prepare(self._new, t0)
        self.kept, self._new = [], []
        self._refs = {}  # `keep` registers those of the parts that stay pending
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
            if p.ref is not None:
                self._refs.setdefault((p.inc, p.group, p.n, p.seq0, p.step0), p.ref)
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
        out = {c: np.concatenate([p[2][c] for p in parts]) for c in schema.COLL_COLUMNS}
        # An entry of several ranks (`add_many`) names each row's rank (its rank is -1).
        out["rank"] = np.concatenate(
            [
                p[2]["rank"] if p[1] < 0 else np.full(p[2]["step"].shape[0], p[1], np.int32)
                for p in parts
            ]
        )
        if cutoff is not None:
            keep = out["step"] >= cutoff
            out = {k: v[keep] for k, v in out.items()}
        return out
