"""Blocks for the matching pass (`hub.matching`): parts of the same instances, checked.

The members of a group record the same instances in the same order, so the messages of one
step of all the members of one group hold equal ``seq`` and ``step`` columns. Such parts
(one group each, one per rank; a message that mixes groups was split into one piece per
group by `hub.pending.prepare`) form a block: row ``i`` is the i-th rank, column ``j`` an
instance. `group_blocks` groups a pass's parts into blocks and checks each sub-block's
columns; `unique_keys` keeps the blocks whose instance keys appear nowhere else in the pass.
Whatever does not fit goes to the rows path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from rankscope.hub.pending import Part


@dataclass
class Block:
    """Parts of the same ranks (ascending), incarnation and group, in sub-blocks of parts
    whose ``seq`` and ``step`` columns are equal."""

    inc: int
    group: int
    ranks: tuple[int, ...]
    subs: list[list[Part]] = field(default_factory=list)
    first_part: list[int] = field(default_factory=list)
    """Per sub-block, the row of the part that arrived first (whose ``op`` is taken)."""
    seq: np.ndarray | None = None
    step: np.ndarray | None = None
    bounds: np.ndarray | None = None
    """Start column of each sub-block, then the total."""
    nbytes: np.ndarray | None = None
    """Per instance, the size every member moves; None when some member moves another."""
    _plan: list[tuple[Mapping[str, np.ndarray], np.ndarray, np.ndarray]] | None = None
    _plan_done: bool = False
    """`_gather` ran for the current sub-blocks (reset when they change)."""
    _tables: list[Mapping[str, np.ndarray]] | None = None
    """When every part is a whole message: their columns, in block order (by `_gather`)."""

    def stack(self, col: str) -> np.ndarray:
        """One column of every part, as a (ranks, instances) array."""
        assert self.bounds is not None
        c, k = len(self.ranks), int(self.bounds[-1])
        plan = self._gather()
        if plan is None:
            if self._tables is not None:
                return np.concatenate([t[col] for t in self._tables]).reshape(c, k)
            cols = [sub[i].column(col) for i in range(c) for sub in self.subs]
            return np.concatenate(cols).reshape(c, k)
        if len(plan) == 1:
            batch, _, idx = plan[0]
            return batch[col][idx].reshape(c, k)
        out = np.empty(c * k, plan[0][0][col].dtype)
        for batch, pos, idx in plan:
            out[pos] = batch[col][idx]
        return out.reshape(c, k)

    def _gather(self) -> list[tuple[Mapping[str, np.ndarray], np.ndarray, np.ndarray]] | None:
        """When every part is a piece: per batch its parts come from, the flat positions in
        the (ranks, instances) block and the rows of the batch that fill them (computed once
        for the current sub-blocks); None when some part is a whole message."""
        if self._plan_done:
            return self._plan
        self._plan_done, self._plan, self._tables = True, None, None
        if all(p.batch is None for sub in self.subs for p in sub):
            # Whole messages (the usual parts): their columns in block order, once.
            self._tables = [sub[i].cols for i in range(len(self.ranks)) for sub in self.subs]
            return None
        assert self.bounds is not None
        k = int(self.bounds[-1])
        spans: dict[
            int, tuple[Mapping[str, np.ndarray], np.ndarray, list[int], list[int], list[int]]
        ] = {}
        for j, sub in enumerate(self.subs):
            a = int(self.bounds[j])
            for i, p in enumerate(sub):
                if p.batch is None:
                    return None
                entry = spans.get(id(p.batch))
                if entry is None:
                    assert p.index is not None
                    entry = spans[id(p.batch)] = (p.batch, p.index, [], [], [])
                entry[2].append(i * k + a)
                entry[3].append(p.start)
                entry[4].append(p.n)
        plan = []
        for src, index, at, first, lens in spans.values():
            if len(set(lens)) == 1:  # the usual case: every part of the batch has n rows
                off = np.arange(lens[0])
                plan.append(
                    (
                        src,
                        (np.array(at)[:, None] + off).reshape(-1),
                        index[(np.array(first)[:, None] + off).reshape(-1)],
                    )
                )
            else:
                plan.append(
                    (
                        src,
                        np.concatenate([np.arange(a, a + m) for a, m in zip(at, lens)]),
                        index[np.concatenate([np.arange(f, f + m) for f, m in zip(first, lens)])],
                    )
                )
        if len(plan) == 1:
            # One batch: gather in block order (positions are then 0..c*k-1).
            batch, pos, idx = plan[0]
            in_order = np.empty_like(idx)
            in_order[pos] = idx
            plan = [(batch, pos, in_order)]
        self._plan = plan
        return plan

    def parts(self) -> list[Part]:
        return [p for sub in self.subs for p in sub]


def group_blocks(parts: list[Part]) -> tuple[list[Block], list[Part]]:
    """Group single-group parts into verified blocks; the rest is loose."""
    by_sig: dict[tuple[int, ...], list[Part]] = {}
    loose: list[Part] = []
    for p in parts:
        if p.group < 0:
            loose.append(p)
            continue
        sig = (p.inc, p.group, p.n, p.seq0, p.step0)
        by_sig.setdefault(sig, []).append(p)
    blocks: dict[tuple[int, int, tuple[int, ...]], Block] = {}
    for (inc, group, *_), members in by_sig.items():
        members.sort(key=lambda p: p.rank)
        ranks = tuple(p.rank for p in members)
        if len(set(ranks)) != len(ranks):  # a rank twice: the rows path sorts it out
            loose += members
            continue
        b = blocks.get((inc, group, ranks))
        if b is None:
            b = blocks[(inc, group, ranks)] = Block(inc, group, ranks)
        b.subs.append(members)
        b.first_part.append(min(range(len(members)), key=lambda i: members[i].arrival))
    out = []
    for b in blocks.values():
        loose += _verify(b)
        if b.subs:
            out.append(b)
    return out, loose


def _verify(b: Block) -> list[Part]:
    """Check that every part of each sub-block has the ``seq`` and ``step`` columns of its
    first; drop the sub-blocks that do not (returned as loose parts). Every row of a part
    is of its group (`Part.group`, checked when the part was made), the block's.

    Parts that matched one reference at ingest (`Part.ref`) are equal without another look
    at their rows. Others are compared with their sub-block's first as bytes: one copy and
    one compare a part, with no block-sized temporary; a block of pieces only is compared
    as a whole (`_verify_pieces`). The same look tells whether every member moves the same
    sizes (``nbytes``)."""
    if all(p.batch is not None for sub in b.subs for p in sub):
        return _verify_pieces(b)
    bad: list[Part] = []
    subs, first_part, seq, step, nbytes = [], [], [], [], []
    same_sizes = True
    for sub, f in zip(b.subs, b.first_part):
        head = sub[0]
        ref = head.ref
        if ref is not None and all(p.ref is ref for p in sub):
            sizes = all(p.same_sizes for p in sub)
        elif _equal_columns(sub, ("seq", "step")):
            sizes = _equal_columns(sub, ("nbytes",))
        else:
            bad += sub
            continue
        subs.append(sub)
        first_part.append(f)
        seq.append(head.column("seq"))
        step.append(head.column("step"))
        same_sizes = same_sizes and sizes
        if same_sizes:
            nbytes.append(head.column("nbytes"))
    if len(subs) != len(b.subs):
        b.subs, b.first_part = subs, first_part
        b._plan_done = False
    if subs:
        b.bounds = np.cumsum([0] + [sub[0].n for sub in subs])
        b.seq = np.concatenate(seq).astype(np.int64, copy=False)
        b.step = np.concatenate(step).astype(np.int64, copy=False)
        b.nbytes = np.concatenate(nbytes).astype(np.int64, copy=False) if same_sizes else None
    return bad


def _verify_pieces(b: Block) -> list[Part]:
    """`_verify` for a block of pieces only (the parts of messages split by group, which
    met no reference at ingest): each column of the whole block is one gather through the
    block's plan (`Block.stack`), compared with the block's first row at once, instead of
    one gather and one compare a piece."""
    b.bounds = np.cumsum([0] + [sub[0].n for sub in b.subs])
    b._plan_done = False
    seq, step = b.stack("seq"), b.stack("step")
    differs = (seq != seq[0]).any(axis=0) | (step != step[0]).any(axis=0)
    bad: list[Part] = []
    if differs.any():
        wrong = np.logical_or.reduceat(differs, b.bounds[:-1])
        bad = [p for sub, w in zip(b.subs, wrong.tolist()) if w for p in sub]
        kept = [i for i, w in enumerate(wrong.tolist()) if not w]
        cols = np.repeat(~wrong, np.diff(b.bounds))
        b.subs = [b.subs[i] for i in kept]
        b.first_part = [b.first_part[i] for i in kept]
        b._plan_done = False
        if not b.subs:
            return bad
        b.bounds = np.cumsum([0] + [sub[0].n for sub in b.subs])
        seq, step = seq[:, cols], step[:, cols]
    nbytes = b.stack("nbytes")
    b.seq = seq[0].astype(np.int64)
    b.step = step[0].astype(np.int64)
    b.nbytes = None if (nbytes != nbytes[0]).any() else nbytes[0].astype(np.int64)
    return bad


def _equal_columns(parts: list[Part], names: tuple[str, ...]) -> bool:
    """Whether every part has the first's columns ``names`` (dtype and bytes)."""
    for name in names:
        want = parts[0].column(name)
        data = want.tobytes()
        for p in parts[1:]:
            col = p.column(name)
            if col.dtype != want.dtype or col.tobytes() != data:
                return False
    return True


def _key(epoch: np.ndarray, group: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Order of the rows by (epoch, group, seq) and whether each sorted row repeats the
    key of the one before."""
    parts = [epoch, group, seq]
    lows = [int(p.min()) for p in parts]
    spans = [int(p.max()) - lo + 1 for p, lo in zip(parts, lows)]
    if spans[0] * spans[1] * spans[2] < 2**62:
        key = (epoch - lows[0]) * spans[1] + (group - lows[1])
        key = key * spans[2] + (seq - lows[2])
        order = np.argsort(key, kind="stable")
        ks = key[order]
        return order, ks[1:] == ks[:-1]
    order = np.lexsort((seq, group, epoch))
    same = np.ones(order.shape[0] - 1, bool)
    for p in parts:
        ps = p[order]
        same &= ps[1:] == ps[:-1]
    return order, same


def unique_keys(
    blocks: list[Block], loose: list[Part], left: Mapping[str, np.ndarray] | None
) -> tuple[list[Block], list[Part]]:
    """Blocks whose instance keys appear nowhere else in the pass; the parts of the others
    go to the rows path."""
    # The usual pass: one block per group, each listing its instances in issue order; then
    # ascending ``seq`` in every block is enough, without a sort of all the keys.
    if (
        not loose
        and left is None
        and len({(b.inc, b.group) for b in blocks}) == len(blocks)
        and all(bool((b.seq[1:] > b.seq[:-1]).all()) for b in blocks if b.seq is not None)
    ):
        return blocks, []
    epoch, group, seq, owner = [], [], [], []
    for i, b in enumerate(blocks):
        assert b.seq is not None
        k = b.seq.shape[0]
        epoch.append(np.full(k, b.inc, np.int64))
        group.append(np.full(k, b.group, np.int64))
        seq.append(b.seq)
        owner.append(np.full(k, i, np.int64))
    for p in loose:
        epoch.append(np.full(p.n, p.inc, np.int64))
        group.append(p.column("group").astype(np.int64))
        seq.append(p.column("seq"))
        owner.append(np.full(p.n, -1, np.int64))
    if left is not None:
        epoch.append(left["epoch"])
        group.append(left["group"].astype(np.int64))
        seq.append(left["seq"])
        owner.append(np.full(left["seq"].shape[0], -1, np.int64))
    order, same = _key(np.concatenate(epoch), np.concatenate(group), np.concatenate(seq))
    if not same.any():
        return blocks, []
    own = np.concatenate(owner)[order]
    bad = set(np.concatenate([own[1:][same], own[:-1][same]]).tolist()) - {-1}
    keep = [b for i, b in enumerate(blocks) if i not in bad]
    demoted = [p for i, b in enumerate(blocks) if i in bad for p in b.parts()]
    return keep, demoted
