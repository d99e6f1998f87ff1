"""Exposed collective wall time per rank and step, from the raw rows.

``Window.coll["exposed_wait_ns"]`` and ``["exposed_transfer_ns"]`` sum each row's exposed
part. Asynchronous collectives overlap one another — eight DDP gradient buckets still in
flight after backward all end after the last issue — so their exposed parts are nested
intervals ``[cut, exit]`` and a sum counts the same wall time once per bucket. The step
cannot be slower than wall time, so for the decomposition this module takes the **union**:
per rank and step, the async rows still running after the cut are sorted by exit, and each
piece of ``[cut, last exit]`` is charged to the row that ends it, split into wait (before
that row's instance was complete) and transfer. Blocking rows are exposed whole, as in the
sums, and so are those of instances that never completed (a member's rows missing; their
split unknown, they count as transfer), where the sums count only their time inside.
The result is used when the window kept the raw rows of every step it covers.
"""

from __future__ import annotations

import numpy as np

from rankscope.collector.schema import FLAG_ASYNC, FLAG_DDP_BUCKET, OP_INDEX
from rankscope.diagnosis.window import Window

ASYNC_FLAGS = FLAG_ASYNC | FLAG_DDP_BUCKET
P2P_OPS = np.array([OP_INDEX["send"], OP_INDEX["recv"]])


def rows_cover_window(window: Window) -> bool:
    """True when the raw rows hold every call of every rank-step that recorded collectives,
    but those a node's relay matched itself and sent as sums (`Window.reduced`).

    Args:
        window: the window.

    Returns:
        Whether `exposed_union` can replace the per-row sums.
    """
    rows = window.rows
    if rows is None or len(rows) == 0:
        return False
    n_ranks, n_steps = window.present.shape
    j = np.searchsorted(window.steps, rows.step)
    inside = (j < n_steps) & (window.steps[np.minimum(j, n_steps - 1)] == rows.step)
    ok = inside & (rows.rank >= 0) & (rows.rank < n_ranks)
    held = np.bincount(
        rows.rank[ok].astype(np.int64) * n_steps + j[ok], minlength=n_ranks * n_steps
    )
    calls = np.nan_to_num(window.coll["n"], nan=0.0).ravel()
    if window.reduced:
        calls = calls - np.nan_to_num(window.reduced["n"], nan=0.0).ravel()
    need = calls > 0
    return bool((held[need] >= calls[need]).all())


def row_last(window: Window) -> tuple[np.ndarray, np.ndarray]:
    """Per row, its instance's last entry and whether the instance is complete."""
    rows, inst = window.rows, window.instances
    assert rows is not None
    n = len(rows)
    if len(inst) == 0:
        return np.full(n, np.nan), np.zeros(n, dtype=bool)
    key_i = inst.group.astype(np.int64) * (1 << 40) + inst.seq.astype(np.int64)
    order = np.argsort(key_i, kind="stable")
    sk = key_i[order]
    key_r = rows.group.astype(np.int64) * (1 << 40) + rows.seq.astype(np.int64)
    pos = np.clip(np.searchsorted(sk, key_r, side="right") - 1, 0, sk.size - 1)
    found = sk[pos] == key_r
    idx = order[pos]
    complete = found & (inst.n_arrived[idx] >= inst.n_members[idx]) & (inst.n_members[idx] > 0)
    return np.where(found, inst.last[idx], np.nan), complete


def exposed_union(window: Window) -> dict[str, np.ndarray]:
    """Exposed wait and transfer per rank and step, overlapping async rows counted once.

    Args:
        window: a window whose ``rows`` cover its steps (`rows_cover_window`).

    Returns:
        ``exposed_wait_ns`` and ``exposed_transfer_ns`` as float64 (R, S), and ``p2p_ns``:
        the part of both spent in blocking send/recv; NaN where the rank did not report
        the step.
    """
    rows = window.rows
    if rows is None:
        raise ValueError("the window kept no raw collective rows")
    n_ranks, n_steps = window.present.shape
    j = np.searchsorted(window.steps, rows.step)
    inside = (j < n_steps) & (window.steps[np.minimum(j, n_steps - 1)] == rows.step)
    ok = inside & (rows.rank >= 0) & (rows.rank < n_ranks)
    cell = np.where(ok, rows.rank.astype(np.int64) * n_steps + np.minimum(j, n_steps - 1), -1)
    enter = rows.t_enter
    exit_ = np.where(np.isfinite(rows.t_exit), np.maximum(rows.t_exit, enter), enter)
    last, complete = row_last(window)
    is_async = (rows.flags & ASYNC_FLAGS) != 0
    size = n_ranks * n_steps
    wait = np.zeros(size)
    transfer = np.zeros(size)

    # Blocking rows: the whole time in the collective is exposed.
    blk = ok & ~is_async & complete
    w_blk = np.clip(last - enter, 0.0, exit_ - enter)
    np.add.at(wait, cell[blk], w_blk[blk])
    np.add.at(transfer, cell[blk], (exit_ - enter - w_blk)[blk])
    # A blocking call of an instance that did not complete (a member's rows missing) is
    # exposed all the same; how much of it was waiting is unknown: counted as transfer.
    open_ = ok & ~is_async & ~complete
    np.add.at(transfer, cell[open_], (exit_ - enter)[open_])
    # Point-to-point time is kept apart too: a pipeline's ``pp_wait`` phase already spans it.
    p2p = blk & np.isin(rows.op, P2P_OPS)
    p2p_ns = np.zeros(size)
    np.add.at(p2p_ns, cell[p2p], (exit_ - enter)[p2p])

    # Async rows: union of [cut, exit] per rank-step, charged piecewise by exit order.
    a = np.flatnonzero(ok & is_async)
    if a.size:
        cut = np.full(size, -np.inf)
        np.maximum.at(cut, cell[a], enter[a])
        c = cut[cell[a]]
        # What runs after the cut is exposed whether or not its instance completed; only
        # the split into wait and transfer needs the instance's last entry.
        live = a[exit_[a] > c]
        if live.size:
            order = live[np.lexsort((exit_[live], cell[live]))]
            cells = cell[order]
            ends = exit_[order]
            first = np.ones(order.size, dtype=bool)
            first[1:] = cells[1:] != cells[:-1]
            prev = np.empty(order.size)
            prev[0] = -np.inf
            prev[1:] = ends[:-1]
            start = np.where(first, cut[cells], np.maximum(prev, cut[cells]))
            start = np.maximum(start, enter[order])
            piece = np.maximum(ends - start, 0.0)
            w = np.where(complete[order], np.clip(last[order] - start, 0.0, piece), 0.0)
            np.add.at(wait, cells, w)
            np.add.at(transfer, cells, piece - w)
    if window.reduced:  # calls matched on their node: blocking, their sums are exact
        wait += np.nan_to_num(window.reduced["exposed_wait_ns"], nan=0.0).ravel()
        transfer += np.nan_to_num(window.reduced["exposed_transfer_ns"], nan=0.0).ravel()
    out = {
        "exposed_wait_ns": wait.reshape(n_ranks, n_steps),
        "exposed_transfer_ns": transfer.reshape(n_ranks, n_steps),
        "p2p_ns": p2p_ns.reshape(n_ranks, n_steps),
    }
    for arr in out.values():
        arr[~window.present] = np.nan
    return out
