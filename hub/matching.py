"""The store's matching pass: pending collective rows become instances and aggregates.

Two paths compute the same definitions (`diagnosis.blocks`):

- **blocks**, the usual case. The members of a group record the same instances in the same
  order, so the messages of one step of all the members of one group hold equal ``seq`` and
  ``step`` columns. Such messages (one group each, one per rank; a message that mixes groups
  was split into one piece per group by `hub.pending.prepare`) form a block: row ``i`` is
  the i-th rank, column ``j`` an instance (`hub.blockset` forms and checks them). Stacking
  their columns is the whole join; every per-instance statistic is an axis-0 reduction and
  every per-rank-step sum an axis-1 one.
  Blocks of the same ranks are stacked side by side, so a pass over many steps is one block;
  complete blocks of as many ranks each (a hybrid-parallel job's tensor-parallel groups,
  hundreds a pass) are settled side by side too, each column keeping its own ranks.
- **rows**, everything else (ranks that disagree on an instance, a key seen twice): one
  sort over the rows, as :func:`diagnosis.arrivals.match`.

A block whose instances are not complete yet (its other members have not reported) keeps
its messages by reference for the next pass; rows keep their columns.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from rankscope.collector import schema
from rankscope.diagnosis.arrivals import ASYNC_FLAGS, match, row_contributions
from rankscope.diagnosis.blocks import block_nanmedian, block_sums, match_block
from rankscope.diagnosis.window import COLL_AGGREGATES, InstanceTable
from rankscope.hub.blockset import Block, group_blocks, unique_keys
from rankscope.hub.pending import PENDING_DTYPES, Part, concat_rows
from rankscope.hub.runstate import RunState


def settle(run: RunState, stale_steps: int) -> None:
    """Match the pending rows of ``run``, fold complete instances, close stale ones.

    Args:
        run: the run's state.
        stale_steps: an instance this many steps behind the newest step is closed.
    """
    run.flush()
    run.close_parts(None if run.max_step is None else run.max_step - stale_steps)
    pend = run.pending
    if pend.rows == 0:
        run.trim()  # a relay's node messages bring closed instances without rows
        return
    parts, left = pend.take(run.t0)
    if run.parted.shape[0]:  # rows of groups that came as parts since they came
        parts, left = run.divert_pending(parts, left)
    sizes = {gid: len(g["ranks"]) for gid, g in run.groups.items()}
    blocks, loose = group_blocks(parts)
    if blocks:
        blocks, demoted = unique_keys(blocks, loose, left)
        loose += demoted
    stale_at = None if run.max_step is None else run.max_step - stale_steps
    oldest = run.oldest_step()
    kept: list[Part] = []
    rows: list[Mapping[str, np.ndarray]] = []
    simple: dict[int, list[Block]] = {}
    for b in blocks:
        if _simple(b, sizes):
            simple.setdefault(len(b.ranks), []).append(b)
            continue
        more_parts, more_rows = _settle_block(run, b, sizes, stale_at, oldest)
        kept += more_parts
        rows += more_rows
    for same in simple.values():
        for batch in _batches(same):
            if len(batch) == 1:
                _settle_block(run, batch[0], sizes, stale_at, oldest)  # keeps nothing
            else:
                _settle_blocks(run, batch, sizes)
    if loose or left is not None:
        open_rows = _settle_rows(run, left, loose, sizes, stale_at, oldest)
        if open_rows is not None:
            rows.append(open_rows)
    merged = None
    if rows:
        merged = (
            rows[0]
            if len(rows) == 1
            else {k: np.concatenate([r[k] for r in rows]) for k in PENDING_DTYPES}
        )
    pend.keep(kept, merged)
    run.trim()


def _relative(t: np.ndarray, t0: int, known: bool = False) -> np.ndarray:
    """int64 hub-clock ns -> float64 relative to ``t0`` (NaN for ``NO_TIME``, unless the
    times are ``known``), in one pass (the subtraction is exact in int64; only its result is
    converted). ``t`` is a block's own stack: it is converted in place, so that a pass needs
    one block-sized buffer per column, not two."""
    unknown = t == schema.NO_TIME if not known and t.min() <= schema.NO_TIME else None
    if t.dtype == np.int64 and t.flags.c_contiguous and t.flags.writeable:
        # Two steps on a flat view: numpy buffers a copy of the block for a subtraction that
        # casts into its own input, or for a cast between 2-D views of one buffer.
        flat = t.reshape(-1)
        flat -= np.int64(t0)
        np.copyto(flat.view(np.float64), flat, casting="unsafe")
        out = flat.view(np.float64).reshape(t.shape)
    else:
        out = np.empty(t.shape)
        np.subtract(t, np.int64(t0), out=out, casting="unsafe")
    if unknown is not None:
        out[unknown] = np.nan
    return out


def _settle_block(
    run: RunState,
    b: Block,
    sizes: Mapping[int, int],
    stale_at: int | None,
    oldest: int | None,
) -> tuple[list[Part], list[Mapping[str, np.ndarray]]]:
    """Match, fold and close the instances of one block. Returns the parts to keep whole
    and rows to keep as columns."""
    assert b.seq is not None and b.step is not None and b.bounds is not None
    c, k = len(b.ranks), b.seq.shape[0]
    parts = b.parts()
    n_members = sizes.get(b.group, -1)
    done = 0 < n_members <= c
    closing = np.full(k, done)
    if not done:  # instances that can no longer complete close as incomplete
        if stale_at is not None:
            closing |= b.step <= stale_at
        if oldest is not None:
            closing |= b.step < oldest
    fresh = np.array([[p.fresh for p in sub] for sub in b.subs], bool).T
    if not closing.any() and not fresh.any():
        return parts, []  # still waiting for other members, and counted already

    # Sums per (rank, run of equal steps inside a sub-block): each is one ring cell.
    new = np.zeros(k, bool)
    new[b.bounds[:-1]] = True
    new[1:] |= b.step[1:] != b.step[:-1]
    starts = np.flatnonzero(new)
    nr = starts.shape[0]
    fresh = fresh[:, np.searchsorted(b.bounds, starts, side="right") - 1].reshape(-1)
    cell, valid = run.cells(
        np.repeat(np.array(b.ranks, np.int64), nr),
        np.tile(b.step[starts], c),
        np.full(c * nr, b.inc, np.int64),
    )
    counted = valid & fresh
    lens = np.broadcast_to(np.diff(np.append(starts, k)).astype(np.float64), (c, nr))
    folds = {"n": (cell[counted], lens.reshape(-1)[counted])}
    enter = _relative(b.stack("t_enter"), run.t0, known=True)  # validation saw to it
    exit_ = _relative(b.stack("t_exit"), run.t0)
    if not closing.any():  # only the calls and the time inside count before completion
        sums = block_sums(enter, exit_, None, starts)
        folds["coll_ns"] = (cell[counted], sums["coll_ns"].reshape(-1)[counted])
        run.fold(folds)
        return parts, []

    ranks = np.array(b.ranks, np.int64)[:, None]
    device: dict[str, np.ndarray] = {}
    if any(p.dev for p in parts):
        device = {
            "flags": b.stack("flags"),
            "t_start": _relative(b.stack("t_start"), run.t0),
            "t_end": _relative(b.stack("t_end"), run.t0),
        }
    m = match_block(enter, exit_, ranks, **device)
    is_async = cut = None
    if done and any(p.is_async for p in parts):
        flags = device["flags"] if device else b.stack("flags")
        is_async = (flags & ASYNC_FLAGS) != 0
        plan = b._gather()
        if plan is not None and all("cut" in batch for batch, _, _ in plan):
            cut = b.stack("cut")  # NaN on the rows of pieces without a cut
        else:
            cut = np.full((c, k), np.nan)
            for j, sub in enumerate(b.subs):
                a = int(b.bounds[j])
                for i, p in enumerate(sub):
                    if p.cut is not None:
                        cut[i, a : a + p.n] = p.cut
    sums = block_sums(enter, exit_, m if done else None, starts, is_async, cut)
    folds["coll_ns"] = (cell[counted], sums["coll_ns"].reshape(-1)[counted])
    if done:  # the arrival aggregates are zero until an instance completes
        for name in COLL_AGGREGATES:
            if name not in folds:
                folds[name] = (cell[valid], sums[name].reshape(-1)[valid])
        run.life_done[ranks[:, 0]] += k
        run.life_last[ranks[:, 0]] += sums["times_last"].sum(axis=1).astype(np.int64)
        run.life_late[ranks[:, 0]] += sums["late_ns"].sum(axis=1)
    run.fold(folds)

    nbytes = b.nbytes  # the usual case: every member moves the same size
    if nbytes is None:
        nbytes = np.rint(block_nanmedian(b.stack("nbytes").astype(np.float64))).astype(np.int64)
    inst = InstanceTable(
        group=np.full(k, b.group, np.int32),
        seq=b.seq,
        step=b.step,
        op=np.concatenate([sub[f].column("op") for sub, f in zip(b.subs, b.first_part)]),
        nbytes=nbytes,
        n_members=np.full(k, n_members, np.int32),
        n_arrived=np.full(k, c, np.int32),
        first=m.first,
        last=m.last,
        last_rank=m.last_rank.astype(np.int32),
        margin=m.margin,
        skew=m.last - m.first,
        transfer=m.transfer,
        device_transfer=m.device_transfer,
    )
    run.add_instances(inst, np.full(k, b.inc, np.int64), closing)
    if done:
        run.life_complete += k
        return [], []
    run.life_incomplete += int(closing.sum())
    kept: list[Part] = []
    rows: list[Mapping[str, np.ndarray]] = []
    for j, sub in enumerate(b.subs):
        open_ = ~closing[int(b.bounds[j]) : int(b.bounds[j + 1])]
        if open_.all():
            kept += sub
        elif open_.any():
            rows += [p.rows(open_) for p in sub]
    return kept, rows


_BATCH_VALUES = 1 << 22
"""Most values (ranks x instances) of blocks settled together (`_settle_blocks`)."""


def _simple(b: Block, sizes: Mapping[int, int]) -> bool:
    """Whether `_settle_blocks` may take ``b`` with others: every member reported (so every
    instance completes now), its rows are blocking, and every member moves the same sizes."""
    n_members = sizes.get(b.group, -1)
    return (
        0 < n_members <= len(b.ranks)
        and b.nbytes is not None
        and not any(p.is_async for sub in b.subs for p in sub)
    )


def _batches(blocks: list[Block]) -> list[list[Block]]:
    """``blocks`` (of one size) in runs of at most ``_BATCH_VALUES`` values."""
    out: list[list[Block]] = [[]]
    size = 0
    for b in blocks:
        assert b.seq is not None
        n = len(b.ranks) * b.seq.shape[0]
        if out[-1] and size + n > _BATCH_VALUES:
            out.append([])
            size = 0
        out[-1].append(b)
        size += n
    return out


def _settle_blocks(run: RunState, blocks: list[Block], sizes: Mapping[int, int]) -> None:
    """`_settle_block` for several `_simple` blocks of as many ranks each, at once.

    Side by side they form one block whose columns keep their own ranks (row ``i`` of a
    column is the i-th rank of its block, ranks ascending in every block), so the few dozen
    numpy calls of a block are paid once for all: a hybrid-parallel job has a tensor-parallel
    group per few ranks, hundreds of small blocks a pass. Every instance completes."""
    c = len(blocks[0].ranks)
    seq, steps, bounds, nbytes = [], [], [], []
    for b in blocks:  # set by `blockset.group_blocks` (and nbytes checked by `_simple`)
        assert b.seq is not None and b.step is not None
        assert b.bounds is not None and b.nbytes is not None
        seq.append(b.seq)
        steps.append(b.step)
        bounds.append(b.bounds)
        nbytes.append(b.nbytes)
    ks = [a.shape[0] for a in seq]
    k = sum(ks)
    step = np.concatenate(steps)
    # Sums per (rank, run of equal steps inside a sub-block), as `_settle_block` makes them.
    subs = np.concatenate([bb[:-1] + at for bb, at in zip(bounds, np.cumsum([0, *ks[:-1]]))])
    new = np.zeros(k, bool)
    new[subs] = True
    new[1:] |= step[1:] != step[:-1]
    starts = np.flatnonzero(new)
    nr = starts.shape[0]
    # Parts a pass saw before had their calls and time counted then.
    fresh = np.concatenate(
        [np.array([[p.fresh for p in sub] for sub in b.subs], bool).T for b in blocks], axis=1
    )
    fresh_runs = fresh[:, np.searchsorted(subs, starts, side="right") - 1].reshape(-1)
    table = np.array([b.ranks for b in blocks], np.int64)  # (blocks, c), ascending rows
    owner = np.repeat(np.arange(len(blocks)), ks)  # the block of each column
    epoch = np.repeat(np.array([b.inc for b in blocks], np.int64), ks)
    run_rank = table[owner[starts]].T  # (c, runs)
    cell, valid = run.cells(
        run_rank.reshape(-1), np.tile(step[starts], c), np.tile(epoch[starts], c)
    )
    lens = np.broadcast_to(np.diff(np.append(starts, k)).astype(np.float64), (c, nr))
    enter = _relative(
        np.concatenate([b.stack("t_enter") for b in blocks], axis=1), run.t0, known=True
    )
    exit_ = _relative(np.concatenate([b.stack("t_exit") for b in blocks], axis=1), run.t0)
    device: dict[str, np.ndarray] = {}
    if any(p.dev for b in blocks for sub in b.subs for p in sub):
        device = {
            "flags": np.concatenate([b.stack("flags") for b in blocks], axis=1),
            "t_start": _relative(
                np.concatenate([b.stack("t_start") for b in blocks], axis=1), run.t0
            ),
            "t_end": _relative(np.concatenate([b.stack("t_end") for b in blocks], axis=1), run.t0),
        }
    # Rows in ascending rank order in every column: the row index stands for the rank.
    m = match_block(enter, exit_, np.arange(c, dtype=np.int64)[:, None], **device)
    sums = block_sums(enter, exit_, m, starts)
    counted = valid & fresh_runs
    folds = {
        "n": (cell[counted], lens.reshape(-1)[counted]),
        "coll_ns": (cell[counted], sums["coll_ns"].reshape(-1)[counted]),
    }
    for name in COLL_AGGREGATES:
        if name not in folds:
            folds[name] = (cell[valid], sums[name].reshape(-1)[valid])
    R = run.world_size
    who = run_rank.reshape(-1)
    run.life_done += np.bincount(who, lens.reshape(-1), minlength=R)[:R].astype(np.int64)
    run.life_last += np.bincount(who, sums["times_last"].reshape(-1), minlength=R)[:R].astype(
        np.int64
    )
    run.life_late += np.bincount(who, sums["late_ns"].reshape(-1), minlength=R)[:R]
    run.fold(folds)
    inst = InstanceTable(
        group=np.repeat(np.array([b.group for b in blocks], np.int32), ks),
        seq=np.concatenate(seq),
        step=step,
        op=np.concatenate(
            [sub[f].column("op") for b in blocks for sub, f in zip(b.subs, b.first_part)]
        ),
        nbytes=np.concatenate(nbytes),
        n_members=np.repeat(np.array([sizes[b.group] for b in blocks], np.int32), ks),
        n_arrived=np.full(k, c, np.int32),
        first=m.first,
        last=m.last,
        last_rank=table[owner, m.last_row].astype(np.int32),
        margin=m.margin,
        skew=m.last - m.first,
        transfer=m.transfer,
        device_transfer=m.device_transfer,
    )
    run.add_instances(inst, epoch, np.ones(k, bool))
    run.life_complete += k


def _settle_rows(
    run: RunState,
    left: Mapping[str, np.ndarray] | None,
    loose: list[Part],
    sizes: Mapping[int, int],
    stale_at: int | None,
    oldest: int | None,
) -> dict[str, np.ndarray] | None:
    """The rows path: match, fold and close; returns the rows to keep, or None."""
    # Rows a pass has seen come first: their calls and time were counted then.
    loose = sorted(loose, key=lambda p: (p.fresh, p.arrival))
    chunks = [] if left is None else [left]
    if loose:
        chunks.append(concat_rows(loose))
    P = (
        chunks[0]
        if len(chunks) == 1
        else {k: np.concatenate([c[k] for c in chunks]) for k in PENDING_DTYPES}
    )
    n = P["step"].shape[0]
    n_old = (0 if left is None else left["step"].shape[0]) + sum(p.n for p in loose if not p.fresh)
    m = match(P, sizes, t0_ns=run.t0, epoch=P["epoch"])
    contrib = row_contributions(P, m, cut=P["cut"])
    # Rows arrive in runs of one (rank, step, epoch): fold run sums, not rows.
    starts = _runs(n, n_old, P["rank"], P["step"], P["epoch"])
    cell, valid = run.cells(P["rank"][starts], P["step"][starts], P["epoch"][starts])
    fresh = starts >= n_old
    sums: dict[str, np.ndarray] = {"n": np.diff(np.append(starts, n)).astype(np.float64)}
    by_array: dict[int, np.ndarray] = {}
    for k in COLL_AGGREGATES:
        if k != "n":  # entries may share an array (blocking rows: exposed == total)
            a = contrib[k]
            if id(a) not in by_array:
                by_array[id(a)] = np.add.reduceat(a, starts)
            sums[k] = by_array[id(a)]
    # Calls and time inside count once, when a row is new; the arrival aggregates are
    # zero until the instance completes, and a complete instance leaves the pending set.
    counted = {k: (valid & fresh) if k in ("n", "coll_ns") else valid for k in sums}
    run.fold({k: (cell[counted[k]], v[counted[k]]) for k, v in sums.items()})
    done = m.complete[m.row_instance]
    R = run.world_size
    rk = P["rank"][starts].astype(np.int64)
    run.life_done += np.bincount(rk, np.add.reduceat(done, starts), minlength=R)[:R].astype(
        np.int64
    )
    run.life_last += np.bincount(rk, sums["times_last"], minlength=R)[:R].astype(np.int64)
    run.life_late += np.bincount(rk, sums["late_ns"], minlength=R)[:R]
    # Close instances that can no longer complete: their step left the ring, or they
    # are stale_steps behind the newest step.
    inst_step = m.instances.step
    stale = np.zeros(len(m.instances), bool)
    if stale_at is not None:
        stale |= inst_step <= stale_at
    if oldest is not None:
        stale |= inst_step < oldest
    stale &= ~m.complete
    closing = m.complete | stale
    inst_epoch = np.empty(len(m.instances), np.int64)
    inst_epoch[m.row_instance] = P["epoch"]
    run.add_instances(m.instances, inst_epoch, closing)
    run.life_complete += int(m.complete.sum())
    run.life_incomplete += int(stale.sum())
    keep = ~closing[m.row_instance]
    if not keep.any():
        return None
    return {k: v[keep] for k, v in P.items()}


def _runs(n: int, split: int, *keys: np.ndarray) -> np.ndarray:
    """Start index of each run of rows with equal ``keys``; a run also starts at ``split``."""
    new = np.zeros(n, bool)
    new[0] = True
    for k in keys:
        new[1:] |= k[1:] != k[:-1]
    if 0 < split < n:
        new[split] = True
    return np.flatnonzero(new)
