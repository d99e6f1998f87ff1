"""Collective arrival matching (ARCHITECTURE §6) and the construction of a `Window`.

Every rank records its own side of a collective; the same instance is named on every member
by ``(group, seq)``. :func:`match` joins those rows into one row per instance — first and
last entry, the last-arriving rank, skew, margin, transfer — with one sort, then one block
per instance size (`diagnosis.blocks`: column j holds the rows of instance j), never a
Python loop per row. :func:`row_contributions` turns a matched row into its share of the
per-rank-step aggregates of ``window.COLL_AGGREGATES`` and :func:`rank_step_aggregates`
bins them densely. :func:`build_window` assembles a complete `Window` from raw tables; the
hub's store, the simulator and the tests all rely on these functions and on
`diagnosis.blocks`, so each definition lives in one place.

Times: raw int64 hub-clock ns (``NO_TIME`` for unknown) are turned into float64 ns relative
to an origin ``t0_ns`` (NaN for unknown) before any arithmetic, because float64 cannot hold
epoch nanoseconds exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rankscope.collector.schema import (
    COLL_COLUMNS,
    FLAG_ASYNC,
    FLAG_DDP_BUCKET,
    FLAG_DEVICE_TIMED,
    NO_TIME,
)
from rankscope.diagnosis.blocks import block_nanmedian, contributions, match_block
from rankscope.diagnosis.window import (
    COLL_AGGREGATES,
    InstanceTable,
    Window,
)

ROW_COLUMNS = ("rank", *COLL_COLUMNS)
"""Columns of a flat collective row table: the schema's ``colls`` columns plus ``rank``."""

ASYNC_FLAGS = FLAG_ASYNC | FLAG_DDP_BUCKET
"""Rows whose host time overlaps compute: only the part after the step's last asynchronous
issue is exposed (``window.COLL_AGGREGATES``)."""

_MEDIAN_BUCKETS = 16
"""Up to this many distinct instance sizes, medians are taken on (k, size) blocks; above it
one segmented sort is cheaper than the loop over sizes."""


@dataclass(frozen=True)
class Matched:
    """Result of :func:`match`: the instance table plus, per input row, its instance."""

    instances: InstanceTable
    """One row per ``(epoch, group, seq)``, sorted by that key."""
    complete: np.ndarray
    """bool per instance: every member of the group has a row."""
    row_instance: np.ndarray
    """int64 per input row: index into ``instances``."""
    row_first: np.ndarray
    """float64 per input row: ``first`` of its instance."""
    row_last: np.ndarray
    """float64 per input row: ``last`` of its instance."""
    row_is_last: np.ndarray
    """bool per input row: this row is its instance's last arriver."""
    row_enter: np.ndarray
    """float64 per input row: ``t_enter`` relative to ``t0_ns``."""
    row_exit: np.ndarray
    """float64 per input row: ``t_exit`` relative to ``t0_ns`` (NaN unknown)."""
    t0_ns: int
    row_first_exit: np.ndarray | None = None
    """float64 per input row: earliest known exit of its instance (NaN unknown)."""
    """Origin of the relative times above."""


def relative_ns(t: np.ndarray, t0_ns: int) -> np.ndarray:
    """Convert hub-clock times to float64 ns relative to ``t0_ns``.

    Args:
        t: int64 ns with ``NO_TIME`` for unknown, or float64 already relative (NaN unknown),
            which is returned as is.
        t0_ns: origin.

    Returns:
        float64 array; unknown times are NaN.
    """
    t = np.asarray(t)
    if t.dtype.kind == "f":
        return t.astype(np.float64, copy=False)
    out = (t.astype(np.int64, copy=False) - np.int64(t0_ns)).astype(np.float64)
    out[t == NO_TIME] = np.nan
    return out


def _column(rows: Mapping[str, np.ndarray], name: str, n: int | None) -> np.ndarray:
    if name not in rows:
        raise ValueError(f"collective rows miss the {name!r} column")
    col = np.asarray(rows[name])
    if col.ndim != 1 or (n is not None and col.shape[0] != n):
        raise ValueError(f"collective column {name!r} has shape {col.shape}, expected ({n},)")
    return col


def _check_rows(rows: Mapping[str, np.ndarray]) -> int:
    n = _column(rows, "rank", None).shape[0]
    for name in ROW_COLUMNS:
        _column(rows, name, n)
    return int(n)


def _segment_keys(parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Stable order of rows by the integer key ``parts`` (most significant first) and the
    boolean "a new segment starts here" over the sorted rows."""
    n = parts[0].shape[0]
    lows = [int(p.min()) for p in parts]
    spans = [int(p.max()) - lo + 1 for p, lo in zip(parts, lows)]
    total = 1
    for s in spans:
        total *= s
    new = np.ones(n, dtype=bool)
    if total < 2**62:
        # One int64 key sorts far faster than a lexsort over several columns.
        key = np.zeros(n, dtype=np.int64)
        for p, lo, span in zip(parts, lows, spans):
            key *= span
            key += p.astype(np.int64) - lo
        order = np.argsort(key, kind="stable")
        ks = key[order]
        new[1:] = ks[1:] != ks[:-1]
    else:
        order = np.lexsort(parts[::-1])
        new[1:] = False
        for p in parts:
            ps = p[order]
            new[1:] |= ps[1:] != ps[:-1]
    return order, new


def segment_nanmedian(values: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Median of each contiguous segment of ``values``, ignoring NaN.

    Args:
        values: float64, segments contiguous.
        starts: int64 first index of each segment.
        counts: int64 length of each segment (≥ 1).

    Returns:
        float64 per segment; NaN where a segment holds no finite value. Even counts give
        the mean of the two middle values.
    """
    n_seg = starts.shape[0]
    out = np.full(n_seg, np.nan)
    if n_seg == 0:
        return out
    c0 = int(counts[0])
    if c0 * n_seg == values.shape[0] and (counts == c0).all():
        # Every segment has the same size: one (segments, size) block, no index building.
        block = np.sort(values.reshape(n_seg, c0), axis=1)
        if not np.isnan(block[:, -1]).any():
            return 0.5 * (block[:, (c0 - 1) // 2] + block[:, c0 // 2])
        valid = c0 - np.isnan(block).sum(axis=1)
        rows = np.arange(n_seg)
        med = 0.5 * (block[rows, np.maximum((valid - 1) // 2, 0)] + block[rows, valid // 2])
        return np.where(valid > 0, med, np.nan)
    sizes = np.unique(counts)
    if sizes.shape[0] <= _MEDIAN_BUCKETS:
        for c in sizes:
            sel = np.flatnonzero(counts == c)
            block = values[starts[sel][:, None] + np.arange(c)]
            block.sort(axis=1)  # NaN sorts last
            valid = c - np.isnan(block).sum(axis=1)
            lo = np.maximum((valid - 1) // 2, 0)
            hi = np.minimum(valid // 2, c - 1)
            rows = np.arange(sel.shape[0])
            med = 0.5 * (block[rows, lo] + block[rows, hi])
            out[sel] = np.where(valid > 0, med, np.nan)
        return out
    seg = np.repeat(np.arange(n_seg), counts)
    v = values[np.lexsort((values, seg))]
    valid = np.add.reduceat(~np.isnan(v), starts)
    lo = starts + np.maximum((valid - 1) // 2, 0)
    hi = starts + np.maximum(valid // 2, 0)
    hi = np.minimum(hi, starts + counts - 1)
    return np.where(valid > 0, 0.5 * (v[lo] + v[hi]), np.nan)


def _sizes_of(group_ids: np.ndarray, group_sizes: Mapping[int, int]) -> np.ndarray:
    if not group_sizes:
        return np.full(group_ids.shape[0], -1, dtype=np.int32)
    keys = np.array(sorted(group_sizes), dtype=np.int64)
    vals = np.array([group_sizes[int(k)] for k in keys], dtype=np.int32)
    pos = np.clip(np.searchsorted(keys, group_ids), 0, keys.shape[0] - 1)
    return np.where(keys[pos] == group_ids, vals[pos], -1).astype(np.int32)


def match(
    rows: Mapping[str, np.ndarray],
    group_sizes: Mapping[int, int],
    *,
    t0_ns: int = 0,
    epoch: np.ndarray | None = None,
) -> Matched:
    """Join collective rows of all ranks into instances ``(group, seq)`` (ARCHITECTURE §6).

    ``first``/``last`` are the min/max ``t_enter`` over the rows received; the last arriver
    is the argmax (ties: the lowest rank); ``margin`` is ``last`` minus the second-latest
    entry (NaN with one row); ``transfer`` is the median over rows of ``t_exit - last``;
    ``device_transfer`` the median over ``FLAG_DEVICE_TIMED`` rows of ``t_end - max
    t_start`` (NaN without such rows). ``nbytes`` is the median over rows, ``op`` the first
    row's, ``step`` the last arriver's. An instance is complete when the rows received cover
    the group size; rows of a group missing from ``group_sizes`` never complete.

    Args:
        rows: ``ROW_COLUMNS`` arrays of equal length; ``t_enter`` must be known. Times are
            int64 hub-clock ns (converted relative to ``t0_ns``) or float64 relative ns.
        group_sizes: group id -> member count.
        t0_ns: origin of the relative times in the result.
        epoch: optional int per row, part of the instance key: ranks restarted together
            count ``seq`` from zero again, and their new instances must not join the old.

    Returns:
        The instance table and per-row links (see `Matched`).

    Raises:
        ValueError: a column is missing or has the wrong length, or ``t_enter`` is unknown.
    """
    n = _check_rows(rows)
    rank = _column(rows, "rank", n).astype(np.int64, copy=False)
    group = _column(rows, "group", n).astype(np.int64, copy=False)
    seq = _column(rows, "seq", n).astype(np.int64, copy=False)
    enter = relative_ns(rows["t_enter"], t0_ns)
    if np.isnan(enter).any():
        raise ValueError("collective rows with unknown t_enter cannot be matched")
    if n == 0:
        return _empty_match(t0_ns)
    parts = [group, seq]
    if epoch is not None:
        epoch = np.asarray(epoch, dtype=np.int64)
        if epoch.min() != epoch.max():
            parts.insert(0, epoch)
    order, new = _segment_keys(parts)
    starts = np.flatnonzero(new)
    counts = np.diff(np.append(starts, n))
    k = starts.shape[0]
    head = order[starts]  # original index of each instance's first row

    exit_ = relative_ns(rows["t_exit"], t0_ns)
    flags = _column(rows, "flags", n)
    dev = bool(((flags & FLAG_DEVICE_TIMED) != 0).any())
    t_start = relative_ns(rows["t_start"], t0_ns) if dev else None
    t_end = relative_ns(rows["t_end"], t0_ns) if dev else None
    nbytes_col = _column(rows, "nbytes", n)
    first, last, margin, transfer, device_transfer, first_exit = (np.empty(k) for _ in range(6))
    last_rank = np.empty(k, np.int64)
    last_row = np.empty(k, np.int64)
    nbytes = np.empty(k, np.int64)
    row_instance = np.empty(n, dtype=np.int64)
    # One block per instance size: the rows of instance j are column j, in input order.
    sizes = np.unique(counts) if counts.min() != counts.max() else counts[:1]
    for c in sizes.tolist():
        sel = np.flatnonzero(counts == c) if sizes.shape[0] > 1 else np.arange(k)
        pos = order[starts[sel] + np.arange(c)[:, None]]
        device: dict[str, np.ndarray] = {}
        if t_start is not None and t_end is not None:
            device = {"flags": flags[pos], "t_start": t_start[pos], "t_end": t_end[pos]}
        b = match_block(enter[pos], exit_[pos], rank[pos], **device)
        first[sel], last[sel], margin[sel] = b.first, b.last, b.margin
        transfer[sel], device_transfer[sel] = b.transfer, b.device_transfer
        first_exit[sel] = b.first_exit if b.first_exit is not None else np.nan
        last_rank[sel] = b.last_rank
        last_row[sel] = pos[b.last_row, np.arange(sel.shape[0])]
        nb = nbytes_col[pos]
        lo = nb.min(axis=0)
        if (lo == nb.max(axis=0)).all():
            nbytes[sel] = lo  # the usual case: every member moves the same size
        else:
            nbytes[sel] = np.rint(block_nanmedian(nb.astype(np.float64))).astype(np.int64)
        row_instance[pos] = sel
    g = group[head].astype(np.int32)
    n_members = _sizes_of(group[head], group_sizes)
    instances = InstanceTable(
        group=g,
        seq=seq[head],
        step=_column(rows, "step", n)[last_row].astype(np.int64),
        op=_column(rows, "op", n)[head].astype(np.int8),
        nbytes=nbytes,
        n_members=n_members,
        n_arrived=counts.astype(np.int32),
        first=first,
        last=last,
        last_rank=last_rank.astype(np.int32),
        margin=margin,
        skew=last - first,
        transfer=transfer,
        device_transfer=device_transfer,
    )
    row_is_last = np.zeros(n, dtype=bool)
    row_is_last[last_row] = True
    return Matched(
        instances=instances,
        complete=(n_members > 0) & (counts >= n_members),
        row_instance=row_instance,
        row_first=first[row_instance],
        row_last=last[row_instance],
        row_is_last=row_is_last,
        row_enter=enter,
        row_exit=exit_,
        t0_ns=int(t0_ns),
        row_first_exit=first_exit[row_instance],
    )


def empty_instances() -> InstanceTable:
    """An `InstanceTable` with no rows and the documented dtypes."""
    f = np.zeros(0, dtype=np.float64)
    return InstanceTable(
        group=np.zeros(0, np.int32),
        seq=np.zeros(0, np.int64),
        step=np.zeros(0, np.int64),
        op=np.zeros(0, np.int8),
        nbytes=np.zeros(0, np.int64),
        n_members=np.zeros(0, np.int32),
        n_arrived=np.zeros(0, np.int32),
        first=f,
        last=f.copy(),
        last_rank=np.zeros(0, np.int32),
        margin=f.copy(),
        skew=f.copy(),
        transfer=f.copy(),
        device_transfer=f.copy(),
    )


def _empty_match(t0_ns: int) -> Matched:
    e = np.zeros(0)
    return Matched(
        instances=empty_instances(),
        complete=np.zeros(0, dtype=bool),
        row_instance=np.zeros(0, dtype=np.int64),
        row_first=e,
        row_last=e.copy(),
        row_is_last=np.zeros(0, dtype=bool),
        row_enter=e.copy(),
        row_exit=e.copy(),
        t0_ns=int(t0_ns),
    )


def async_cut(
    rank: np.ndarray,
    step: np.ndarray,
    t_enter: np.ndarray,
    flags: np.ndarray,
    t0_ns: int = 0,
    t_exit: np.ndarray | None = None,
) -> np.ndarray:
    """Per row, where its exposed time may start: the latest asynchronous issue
    (``ASYNC_FLAGS``) of its rank in its step, and, given ``t_exit``, no earlier than the
    exit of the asynchronous row of that rank-step that finishes just before it.

    Asynchronous rows still running after the cut are nested intervals ``[cut, exit]``
    (eight DDP buckets in flight after backward all end after the last issue); a per-row
    sum would count that wall time once per bucket. Ordered by exit, each row is charged
    only the piece ``[max(cut, previous exit), exit]``, so the per-row shares add up to the
    union ``[cut, last exit]`` and stay additive (the hub folds rows as their instances
    complete). The piece is split into wait and transfer by the row's own instance.

    Args:
        rank, step, t_enter, flags: row columns (times as for :func:`relative_ns`).
        t0_ns: origin of the relative result.
        t_exit: row exits; without them every async row starts at the cut (the bare cut).

    Returns:
        float64 per row, relative ns; NaN where the rank-step issued nothing asynchronous.
    """
    flags = np.asarray(flags)
    is_async = (flags & ASYNC_FLAGS) != 0
    n = flags.shape[0]
    out = np.full(n, np.nan)
    if not is_async.any():
        return out
    enter = relative_ns(t_enter, t0_ns)
    order, new = _segment_keys([np.asarray(rank, np.int64), np.asarray(step, np.int64)])
    starts = np.flatnonzero(new)
    counts = np.diff(np.append(starts, order.shape[0]))
    cut = np.maximum.reduceat(np.where(is_async, enter, -np.inf)[order], starts)
    cut[np.isinf(cut)] = np.nan
    out[order] = np.repeat(cut, counts)
    if t_exit is None:
        return out
    ex = relative_ns(t_exit, t0_ns)
    ex = np.where(is_async & np.isfinite(ex), ex, -np.inf)
    seg = np.empty(n, np.int64)
    seg[order] = np.cumsum(new) - 1
    by_exit = np.lexsort((ex, seg))
    prev = np.empty(n)
    prev[1:] = ex[by_exit][:-1]
    first_of_seg = np.ones(n, bool)
    first_of_seg[1:] = seg[by_exit][1:] != seg[by_exit][:-1]
    prev[first_of_seg] = -np.inf
    prev_row = np.empty(n)
    prev_row[by_exit] = prev
    return np.where(is_async, np.maximum(out, prev_row), out)


def row_contributions(
    rows: Mapping[str, np.ndarray], matched: Matched, cut: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Each row's share of every ``COLL_AGGREGATES`` entry (see its docstring in window.py).

    ``wait`` and ``transfer`` are clipped at zero so that, per row, wait + transfer equals
    the host time in the collective even when clocks disagree slightly. Unknown ``t_exit``
    contributes zero time.

    Args:
        rows: the rows given to :func:`match`, in the same order.
        matched: its result.
        cut: per-row :func:`async_cut` (relative to ``matched.t0_ns``); computed when None.

    Returns:
        Name -> float64 per row (entries may share one array: treat them as read-only).
    """
    n = _check_rows(rows)
    flags = np.asarray(rows["flags"])
    is_async: np.ndarray | None = (flags & ASYNC_FLAGS) != 0
    if is_async is not None and is_async.any():
        if cut is None:
            cut = async_cut(
                rows["rank"], rows["step"], rows["t_enter"], flags, matched.t0_ns, rows["t_exit"]
            )
    else:
        is_async = None  # every row is blocking
    out = contributions(
        matched.row_enter,
        matched.row_exit,
        matched.row_first,
        matched.row_last,
        matched.complete[matched.row_instance],
        matched.row_is_last,
        is_async,
        cut,
        matched.row_first_exit,
    )
    return {"n": np.ones(n), **out}


def cell_index(
    rank: np.ndarray, step: np.ndarray, world_size: int, steps: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Flat index ``rank * S + j`` of each row in a dense (R, S) grid, ``steps[j] == step``.

    Args:
        rank, step: per-row ints.
        world_size: R.
        steps: sorted int64 step ids (S,).

    Returns:
        ``(cell, ok)``: int64 index and the mask of rows that fall inside the grid.
    """
    rank = np.asarray(rank, dtype=np.int64)
    step = np.asarray(step, dtype=np.int64)
    s = steps.shape[0]
    if s == 0:
        return np.zeros(rank.shape[0], np.int64), np.zeros(rank.shape[0], bool)
    j = np.clip(np.searchsorted(steps, step), 0, s - 1)
    ok = (steps[j] == step) & (rank >= 0) & (rank < world_size)
    return np.where(ok, rank * s + j, 0), ok


def rank_step_aggregates(
    rows: Mapping[str, np.ndarray],
    matched: Matched,
    world_size: int,
    steps: np.ndarray,
    cut: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Dense per-rank-step ``COLL_AGGREGATES`` (zeros where a rank recorded nothing).

    Args:
        rows: collective rows as given to :func:`match`.
        matched: its result.
        world_size: R.
        steps: sorted step ids (S,); rows of other steps are left out.
        cut: optional per-row :func:`async_cut`.

    Returns:
        Name -> float64 (R, S).
    """
    contrib = row_contributions(rows, matched, cut)
    cell, ok = cell_index(rows["rank"], rows["step"], world_size, steps)
    size = world_size * steps.shape[0]
    return {
        name: np.bincount(cell[ok], weights=contrib[name][ok], minlength=size).reshape(
            world_size, steps.shape[0]
        )
        for name in COLL_AGGREGATES
    }


def build_window(**kwargs: Any) -> Window:
    """Build a complete `Window` from raw tables; see
    :func:`rankscope.diagnosis.assemble.build_window` for the arguments."""
    from rankscope.diagnosis.assemble import build_window as _build

    return _build(**kwargs)
