"""Arrival statistics of collective instances laid out as blocks (ARCHITECTURE §6).

A *block* holds ``k`` instances that each have ``c`` rows: column ``j`` is one instance
``(group, seq)``, row ``i`` one member's side of it. Every reduction over the members of an
instance is then a reduction over axis 0 of a contiguous array, which numpy runs at memory
speed — no sort, no ``reduceat``. :func:`rankscope.diagnosis.arrivals.match` lays the rows
of each instance size out this way; the hub's store builds blocks directly from the
messages of the ranks of one group (they list the same instances in the same order).

The definitions of first, last, last arriver, margin, transfer and each row's share of the
collective aggregates live here and only here; both paths call them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.collector.schema import FLAG_DEVICE_TIMED


@dataclass(frozen=True)
class BlockMatch:
    """Per-instance statistics of a block (each array has one entry per column)."""

    first: np.ndarray
    """float64 min over rows of the entry time."""
    last: np.ndarray
    """float64 max over rows of the entry time."""
    last_row: np.ndarray
    """int64 row of the last arriver (ties: the lowest rank, then the first row)."""
    last_rank: np.ndarray
    """int64 rank of the last arriver."""
    margin: np.ndarray
    """float64 ``last`` minus the latest entry of the other rows (NaN with one row)."""
    transfer: np.ndarray
    """float64 median over rows of ``exit - last`` (NaN rows ignored)."""
    device_transfer: np.ndarray
    """float64 median over device-timed rows of ``t_end - max t_start`` (NaN without)."""
    first_exit: np.ndarray | None = None
    """float64 min over rows of the known exit times (NaN where none is known)."""
    exits_after_last: bool = False
    """Every exit is known and not before its instance's last entry."""


def block_nanmedian(values: np.ndarray, overwrite: bool = False) -> np.ndarray:
    """Median of each column of ``values``, ignoring NaN.

    Args:
        values: float64 (c, k) with c ≥ 1.
        overwrite: sort ``values`` in place (it is the caller's scratch) instead of a copy.

    Returns:
        float64 (k,); NaN where a column holds no finite value. Even counts give the mean
        of the two middle values.
    """
    c, k = values.shape
    if c > 1 and c * k >= _KEY_SORT_MIN and values.min() >= 0.0:
        return _median_of_nonnegative(values)
    if overwrite:
        values.sort(axis=0)  # NaN sorts last
        s = values
    else:
        s = np.sort(values, axis=0)
    if not np.isnan(s[-1]).any():
        return 0.5 * (s[(c - 1) // 2] + s[c // 2])
    valid = c - np.isnan(s).sum(axis=0)
    cols = np.arange(k)
    lo = np.maximum((valid - 1) // 2, 0)
    hi = np.minimum(valid // 2, c - 1)
    med = 0.5 * (s[lo, cols] + s[hi, cols])
    return np.where(valid > 0, med, np.nan)


_KEY_SORT_MIN = 4096
"""Blocks of at least this many values sort as integer keys (below it the extra calls
cost more than the faster sort saves)."""


def _median_of_nonnegative(values: np.ndarray) -> np.ndarray:
    """`block_nanmedian` of a (c > 1, k) block without NaN or negative value: such floats
    order as their bits do, and numpy sorts many short rows of integers several times faster
    than the columns of a float block."""
    c = values.shape[0]
    keys = np.ascontiguousarray(values.T).view(np.int64)
    keys.sort(axis=1)
    mid = keys[:, [(c - 1) // 2, c // 2]].view(np.float64)
    return 0.5 * (mid[:, 0] + mid[:, 1])


def _first_true(mask: np.ndarray) -> np.ndarray:
    """int64 first row of each column of a bool (c, k) ``mask`` where it is True (every
    column has one): the largest of the rows' descending weights where True, a reduction
    over axis 0 of small integers, several times faster than ``argmax(axis=0)``."""
    c = mask.shape[0]
    dtype = np.int8 if c < 2**7 else np.int16 if c < 2**15 else np.int64
    weight = np.arange(c, 0, -1, dtype=dtype)[:, None] * mask
    return c - weight.max(axis=0).astype(np.int64)


def match_block(
    enter: np.ndarray,
    exit_: np.ndarray,
    rank: np.ndarray,
    *,
    flags: np.ndarray | None = None,
    t_start: np.ndarray | None = None,
    t_end: np.ndarray | None = None,
) -> BlockMatch:
    """First, last, last arriver, margin and transfers of each column of a block.

    Args:
        enter: float64 (c, k) entry times (relative ns, all known); written to during the
            call and restored.
        exit_: float64 (c, k) exit times (relative ns, NaN unknown).
        rank: int (c, k) rank of each row, or (c, 1) when every column has the same ranks
            in the same row order.
        flags, t_start, t_end: (c, k) flags and device times (relative ns, NaN unknown);
            needed only when some row is ``FLAG_DEVICE_TIMED``.

    Returns:
        The `BlockMatch`.
    """
    c, k = enter.shape
    first = enter.min(axis=0)
    last = enter.max(axis=0)
    at_last = enter == last
    if rank.shape[1] == 1 and (c == 1 or bool((rank[1:, 0] > rank[:-1, 0]).all())):
        # Rows in ascending rank order: the first row at the latest entry is the last arriver.
        last_row = _first_true(at_last)
        last_rank = rank[last_row, 0].astype(np.int64)
    else:
        ranks = np.broadcast_to(rank, (c, k))
        last_rank = np.where(at_last, ranks, np.iinfo(np.int64).max).min(axis=0)
        # The same rank twice at the latest entry: its first row is the last arriver.
        last_row = _first_true(at_last & (ranks == last_rank))
    cols = np.arange(k)
    if c > 1:
        # The latest entry of the other rows: hide the last arriver's for one reduction
        # (and put it back) rather than copy the block.
        enter[last_row, cols] = -np.inf
        margin = last - enter.max(axis=0)
        enter[last_row, cols] = last
    else:
        margin = np.full(k, np.nan)
    row_transfer = exit_ - last
    after = k > 0 and bool(row_transfer.min() >= 0.0)  # NaN (an unknown exit) fails too
    if after and c > 1 and c * k >= _KEY_SORT_MIN:
        transfer = _median_of_nonnegative(row_transfer)
    else:
        transfer = block_nanmedian(row_transfer, overwrite=True)
    # fmin skips NaN (an unknown exit); a column of unknowns stays NaN.
    first_exit = exit_.min(axis=0) if after else np.fmin.reduce(exit_, axis=0)
    device_transfer = np.full(k, np.nan)
    if flags is not None:
        dev = (flags & FLAG_DEVICE_TIMED) != 0
        if dev.any() and t_start is not None and t_end is not None:
            max_start = np.where(dev & ~np.isnan(t_start), t_start, -np.inf).max(axis=0)
            y = np.where(dev, t_end - max_start, np.nan)
            y[~np.isfinite(y)] = np.nan
            device_transfer = block_nanmedian(y)
    return BlockMatch(
        first=first,
        last=last,
        last_row=last_row,
        last_rank=last_rank,
        margin=margin,
        transfer=transfer,
        device_transfer=device_transfer,
        first_exit=first_exit,
        exits_after_last=after,
    )


def contributions(
    enter: np.ndarray,
    exit_: np.ndarray,
    first: np.ndarray,
    last: np.ndarray,
    done: np.ndarray | bool,
    is_last: np.ndarray,
    is_async: np.ndarray | None = None,
    cut: np.ndarray | None = None,
    first_exit: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Each row's share of the time entries of ``window.COLL_AGGREGATES``.

    ``wait`` and ``transfer`` are clipped at zero so that, per row, wait + transfer equals
    the host time in the collective even when clocks disagree slightly. Unknown ``exit_``
    contributes zero time. Rows of incomplete instances (``done`` False) contribute only
    ``coll_ns``. Arrays broadcast: a block passes (c, k) rows with (k,) per-instance values.

    Args:
        enter, exit_: row entry and exit (relative ns; exit NaN unknown).
        first, last: the row's instance first and last entry.
        done: the row's instance is complete.
        is_last: the row is its instance's last arriver.
        is_async: the row is asynchronous (``arrivals.ASYNC_FLAGS``); None: none is.
        cut: the latest asynchronous issue of the row's rank in its step (relative ns, NaN
            for none), as :func:`rankscope.diagnosis.arrivals.async_cut`; used with
            ``is_async``.
        first_exit: the row's instance earliest known exit (NaN unknown); None: no row
            stayed after another left (``overstay_ns`` is zero).

    Returns:
        ``coll_ns``, ``wait_ns``, ``transfer_ns``, ``late_ns``, ``times_last``,
        ``exposed_wait_ns``, ``exposed_transfer_ns``, ``overstay_ns`` -> float64 per row
        (entries may share one array: treat them as read-only).
    """
    dur = exit_ - enter
    dur[~(dur > 0)] = 0.0  # unknown (NaN) or negative: no time inside
    exit_ = enter + dur
    wait = np.subtract(last, enter)
    np.clip(wait, 0.0, dur, out=wait)
    transfer = np.maximum(enter, last)
    np.subtract(exit_, transfer, out=transfer)
    np.maximum(transfer, 0.0, out=transfer)
    late = enter - first
    if not np.all(done):
        wait, transfer, late = (np.where(done, a, 0.0) for a in (wait, transfer, late))
    if is_async is not None and cut is not None and is_async.any():
        c = np.where(is_async, np.nan_to_num(cut, nan=-np.inf), -np.inf)
        # Wait occupies [enter, enter + wait] and transfer [exit - transfer, exit]; only
        # what lies after the cut is exposed (a blocking row has cut -inf).
        exposed_wait = np.maximum(enter + wait - np.maximum(enter, c), 0.0)
        exposed_transfer = np.maximum(exit_ - np.maximum(exit_ - transfer, c), 0.0)
    else:
        exposed_wait, exposed_transfer = wait, transfer  # blocking: all of it is exposed
    # Time in the collective after its first member had left it: the end of the row's
    # transfer, so of its exposed transfer the part after the cut.
    if first_exit is None:
        overstay = np.zeros_like(exposed_transfer)
    else:
        overstay = np.nan_to_num(exit_ - first_exit, nan=0.0)
        np.clip(overstay, 0.0, exposed_transfer, out=overstay)
        if not np.all(done):
            overstay = np.where(done, overstay, 0.0)
    return {
        "coll_ns": dur,
        "wait_ns": wait,
        "transfer_ns": transfer,
        "late_ns": late,
        "times_last": (is_last & done).astype(np.float64),
        "exposed_wait_ns": exposed_wait,
        "exposed_transfer_ns": exposed_transfer,
        "overstay_ns": overstay,
    }


_EXACT = float(2**53)
"""Integers below this are exact in float64."""


def block_sums(
    enter: np.ndarray,
    exit_: np.ndarray,
    m: BlockMatch | None,
    starts: np.ndarray,
    is_async: np.ndarray | None = None,
    cut: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Sums of :func:`contributions` over runs of columns, for each row of a block.

    Args:
        enter, exit_: (c, k) as given to :func:`match_block` (integer ns for the shortcut
            below to apply).
        m: its result when every instance of the block is complete; None when none is
            (then only the time inside collectives counts, the rest is zero).
        starts: first column of each run (ascending, starting at 0).
        is_async, cut: as for :func:`contributions`.

    Returns:
        The names of :func:`contributions` -> float64 (c, runs).
    """
    c, k = enter.shape
    done = m is not None
    low = float(m.first.min()) if m is not None else float(enter.min())
    longest = int(np.diff(starts, append=k).max()) if k else 0
    # The usual block: blocking rows, every exit known and after the last entry. Then no
    # clipping applies and each sum splits into sums of enter, exit, first and last, which
    # are exact (integer ns, bounded, over one run of columns each) and so equal to the sums
    # of the row shares.
    if (
        (is_async is None or not done)
        and (m.exits_after_last if m is not None else bool((exit_ >= enter).all()))
        and max(-low, float(exit_.max())) * longest < _EXACT
    ):
        s_enter = np.add.reduceat(enter, starts, axis=1)
        s_exit = np.add.reduceat(exit_, starts, axis=1)
        coll = s_exit - s_enter
        if m is None:
            zero = np.zeros_like(coll)
            return {
                "coll_ns": coll,
                "wait_ns": zero,
                "transfer_ns": zero,
                "late_ns": zero,
                "times_last": zero,
                "exposed_wait_ns": zero,
                "exposed_transfer_ns": zero,
                "overstay_ns": zero,
            }
        s_last = np.add.reduceat(m.last, starts)
        run = np.repeat(np.arange(starts.shape[0]), np.diff(np.append(starts, k)))
        times_last = np.bincount(
            m.last_row * starts.shape[0] + run, minlength=c * starts.shape[0]
        ).reshape(c, starts.shape[0])
        wait = s_last - s_enter
        transfer = s_exit - s_last
        # Every exit is known and after the last entry: so is the first exit, and each
        # row's stay after it lies inside its transfer.
        first_exit = m.first_exit if m.first_exit is not None else m.last
        overstay = s_exit - np.add.reduceat(first_exit, starts)
        return {
            "coll_ns": coll,
            "wait_ns": wait,
            "transfer_ns": transfer,
            "late_ns": s_enter - np.add.reduceat(m.first, starts),
            "times_last": times_last.astype(np.float64),
            "exposed_wait_ns": wait,
            "exposed_transfer_ns": transfer,
            "overstay_ns": overstay,
        }
    is_last = np.zeros((c, k), bool)
    if m is not None:
        is_last[m.last_row, np.arange(k)] = True
        first, last, leave = m.first, m.last, m.first_exit
    else:
        first = last = enter.min(axis=0)  # unused: incomplete rows share no arrival time
        leave = None
    rows = contributions(enter, exit_, first, last, done, is_last, is_async, cut, leave)
    sums: dict[int, np.ndarray] = {}
    out = {}
    for name, a in rows.items():
        if id(a) not in sums:  # entries may share an array
            sums[id(a)] = np.add.reduceat(a, starts, axis=1)
        out[name] = sums[id(a)]
    return out
