"""Collectives whose groups span relays: each relay reduces its share, the hub combines.

A data-parallel bucket's all-reduce has a member on every node. No relay holds all its rows,
so the node's and the rack's relays (`hub.reduce`) used to send every one of them on, and
the hub matched them: at 65,536 ranks most of its time. What the hub makes of an instance
splits over its members, though:

- the instance's first and last entry, first and last exit are a min or a max over the
  relays' shares, the last arriver an argmax (the lowest rank at the latest entry, as
  `diagnosis.blocks.match_block` breaks ties), and its margin the latest entry of the
  others: the other shares' latest or the winning share's runner-up;
- where every member left after the last one came (`match_block`'s ``exits_after_last``),
  each rank's sums over its calls of the group in a step (wait, transfer, lateness,
  overstay: `diagnosis.blocks.block_sums`) are sums of its own entries and exits and of
  the instances' first, last and first exit, so a share's per-rank sums of entries and
  exits (*part cells*) and the combined instances give them exactly; times last are counted
  from the combined last arrivers.

Asynchronous calls (DDP's buckets) expose only what runs after their cut
(`diagnosis.arrivals.async_cut`): ``max(min(L, exit) - max(enter, cut), 0)`` for the
instance's last entry ``L``, clipped per call. The relay knows ``L`` lies between the latest
entry it sees and the first exit it sees; a call cut before that range is linear in ``L``
(summed, as a blocking call is), one cut after it is a constant (summed), and only the
calls cut inside it travel one by one as *part rows*, which the hub evaluates once ``L`` is
known.

So a relay sends, per instance of such a group and the members it carries, a *part*
(``collector.schema.PART_COLUMNS``), per member and step its sums (``PART_CELL_COLUMNS``),
and its part rows (``PART_ROW_COLUMNS``); the hub holds them (`PartStore`) until the parts
of a (group, step, incarnation) cover the group's members, then `combine` makes the cells
and instances a relay that held every member would have sent, and the hub folds them as it
folds those. Rows of such a group that reach the hub as rows are made parts of one member
there (`parts_of_rows`), so an instance whose members came both ways still combines.

Not exact: the median transfer of an instance (and the device-timed one) is the median of
the members' exits less the last entry; a part carries the median of its members' exits,
and the combined one is the member-weighted median of those. It lies between the parts'
medians, as the true one does, so the error is at most their spread
(``tests/test_partial.py`` checks the bound against the row-by-row match). Where some
member left before the last one came (clocks that disagree by more than the transfer),
each call's wait would be clipped at its own exit, which needs its rows: that (group,
step)'s sums keep only the time inside the calls (``coll_ns``) and its instances go in as
matched, counted as ``unsplit``. Parts that never cover their group (a member that never
reported) keep, once their step is stale, the calls and time inside counted when they came,
as the matching does with rows of instances that never completed; counted as
``incomplete``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from rankscope.collector import schema
from rankscope.diagnosis.arrivals import ASYNC_FLAGS, async_cut

_LOW = np.iinfo(np.int64).min


def with_cut(co: Mapping[str, np.ndarray], owner: np.ndarray | int) -> dict[str, np.ndarray]:
    """The rows with their asynchronous cut (``cut``, int64 ns, ``NO_TIME`` on blocking
    rows) as the hub computes it for the same rows (`diagnosis.arrivals.async_cut`, per
    rank and step over the asynchronous rows of one message; ``owner`` names the rank of
    each row, or of all)."""
    out = dict(co)
    cut = np.full(co["flags"].shape[0], schema.NO_TIME, np.int64)
    rows = np.flatnonzero(co["flags"] & ASYNC_FLAGS)
    if rows.shape[0]:
        enter, step = co["t_enter"][rows], co["step"][rows]
        who = owner[rows] if isinstance(owner, np.ndarray) else None
        if (
            (who is None or who.min() == who.max())
            and step.min() == step.max()
            and enter.min() >= 0
        ):
            cut[rows] = _one_segment_cut(enter, co["t_exit"][rows])
        else:
            t0 = int(enter.min())
            if who is None:
                who = np.full(rows.shape[0], owner)
            rel = async_cut(who, step, enter, co["flags"][rows], t0, co["t_exit"][rows])
            cut[rows] = np.where(
                np.isnan(rel), schema.NO_TIME, t0 + np.nan_to_num(rel).astype(np.int64)
            )
    out["cut"] = cut
    return out


def _one_segment_cut(enter: np.ndarray, exit_: np.ndarray) -> np.ndarray:
    """`async_cut` of the asynchronous rows of one rank-step, every entry known (a
    collector's message, most often), in integers: the latest issue, and no earlier than
    the exit of the row that finishes just before each (ordered by exit, ties in row
    order; unknown exits first)."""
    ex = np.where(exit_ == schema.NO_TIME, _LOW, exit_)
    by_exit = np.argsort(ex, kind="stable")
    prev = np.empty(ex.shape[0], np.int64)
    prev[by_exit[0]] = _LOW
    prev[by_exit[1:]] = ex[by_exit[:-1]]
    return np.maximum(prev, enter.max())


class PartError(ValueError):
    """Parts that cannot be combined; ``reason`` is a reject reason."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def make_part(
    gid: int,
    step: int,
    inc: int,
    ranks: np.ndarray,
    seq: np.ndarray,
    op: np.ndarray,
    nbytes: np.ndarray,
    enter: np.ndarray,
    exit_: np.ndarray,
    cut: np.ndarray,
    flags: np.ndarray,
    t_start: np.ndarray,
    t_end: np.ndarray,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]] | None:
    """A relay's part of each of ``k`` instances, from the rows of the ``c`` members it
    carries (every exit known).

    Args:
        gid, step, inc: the group, step and incarnation.
        ranks: int (c,) the members, ascending.
        seq, op, nbytes: (k,) the instances.
        enter, exit_, cut, flags, t_start, t_end: (c, k) the rows (int64 ns on the hub's
            clock; ``cut`` the asynchronous cut of each row as the hub computes it,
            `diagnosis.arrivals.async_cut`, and device times, ``NO_TIME`` where none).

    Returns:
        (parts, part cells, part rows), or None when a member's sums would pass 2**53 ns
        (then the rows go on as rows).
    """
    c, k = enter.shape
    first = enter.min(axis=0)
    last = enter.max(axis=0)
    cols = np.arange(k)
    last_row = np.argmax(enter == last, axis=0)  # rows ascend by rank: the lowest rank
    if c > 1:
        others = enter.copy()
        others[last_row, cols] = _LOW
        runner_up = others.max(axis=0)
    else:
        runner_up = np.full(k, schema.NO_TIME, np.int64)
    leave = np.maximum(exit_, enter)  # no time inside: left as it came (`contributions`)
    origin = int(first.min())
    enter_sum = (enter - origin).sum(axis=1)
    exit_sum = (leave - origin).sum(axis=1)
    if int(exit_sum.max()) >= 2**53 or int(enter_sum.min()) < 0:
        return None
    # Where each call's exposed time may start, against where the instance's last entry
    # and first exit can be once every member is known: no earlier than the latest entry
    # here, no later than the first exit here (`combine` checks the instances agree).
    has_cut = cut != schema.NO_TIME
    begin = np.where(has_cut, np.maximum(enter, cut), enter)
    early = ~has_cut | (cut <= last)  # exposed from its start to its exit, the last entry
    late = has_cut & (cut >= leave.min(axis=0))  # exposed from the cut: no wait in it
    linear = early.all(axis=1)
    after = np.where(late, np.maximum(leave - cut, 0), 0).sum(axis=1)
    rest = ~linear[:, None] & ~late
    r_at, i_at = np.nonzero(rest)
    dev = (flags & schema.FLAG_DEVICE_TIMED) != 0
    started = dev & (t_start != schema.NO_TIME)
    start_max = np.where(started, t_start, _LOW).max(axis=0)
    start_max[start_max == _LOW] = schema.NO_TIME
    ended = dev & (t_end != schema.NO_TIME)
    n_device = ended.sum(axis=0).astype(np.int32)
    end_median = np.full(k, np.nan)
    some = np.flatnonzero(n_device)
    if some.shape[0]:
        rel = np.where(ended, (t_end - first).astype(np.float64), np.nan)[:, some]
        end_median[some] = np.nanmedian(rel, axis=0)
    parts = {
        "group": np.full(k, gid, np.int32),
        "seq": seq.astype(np.int64),
        "step": np.full(k, step, np.int64),
        "inc": np.full(k, inc, np.int32),
        "op": op,
        "nbytes": nbytes,
        "n_members": np.full(k, c, np.int32),
        "first": first,
        "last": last,
        "last_rank": ranks[last_row].astype(np.int32),
        "runner_up": runner_up,
        "first_exit": exit_.min(axis=0),
        "last_exit": exit_.max(axis=0),
        "exit_median": np.median((exit_ - first).astype(np.float64), axis=0),
        "n_device": n_device,
        "start_max": start_max,
        "end_median": end_median,
    }
    cells = {
        "rank": ranks.astype(np.int32),
        "inc": np.full(c, inc, np.int32),
        "step": np.full(c, step, np.int64),
        "group": np.full(c, gid, np.int32),
        "n": np.full(c, k, np.int32),
        "origin": np.full(c, origin, np.int64),
        "enter_ns": enter_sum.astype(np.float64),
        "exit_ns": exit_sum.astype(np.float64),
        "linear": linear.astype(np.int8),
        "start_ns": np.where(linear, (begin - origin).sum(axis=1), 0).astype(np.float64),
        "after_ns": np.where(linear, 0, after).astype(np.float64),
    }
    rows = {
        "rank": ranks[r_at].astype(np.int32),
        "inc": np.full(r_at.shape[0], inc, np.int32),
        "step": np.full(r_at.shape[0], step, np.int64),
        "group": np.full(r_at.shape[0], gid, np.int32),
        "seq": seq[i_at].astype(np.int64),
        "start": begin[r_at, i_at],
        "exit": leave[r_at, i_at],
        "cut": cut[r_at, i_at],
    }
    return parts, cells, rows


def parts_of_rows(
    rank: np.ndarray,
    inc: np.ndarray,
    co: Mapping[str, np.ndarray],
    counted: np.ndarray | None = None,
) -> tuple[dict[str, dict[str, np.ndarray]], np.ndarray]:
    """Rows made parts of one member each (per rank, incarnation, group and step): what
    the hub does with the rows of a group some relay sends parts of, so that an instance
    whose members came partly as parts and partly as rows still combines.

    Args:
        rank, inc: int64 per row.
        co: the rows (``schema.COLL_COLUMNS``) with their ``cut`` (`with_cut`).
        counted: bool per row, carried to its part cell as ``counted`` (rows of one cell
            that differ in it stay rows).

    Returns:
        The ``parts``, ``part_cells`` and ``part_rows`` tables, and which rows they hold
        (a member's rows of one step that repeat a call or miss an exit stay rows).
    """
    n = rank.shape[0]
    used = np.zeros(n, bool)
    out: dict[str, list[dict[str, np.ndarray]]] = {name: [] for name in _TABLES}
    order = np.lexsort((co["seq"], co["step"], co["group"], inc, rank))
    keys = [rank[order], inc[order], co["group"][order], co["step"][order]]
    new = np.ones(n, bool)
    new[1:] = np.any([np.diff(k) != 0 for k in keys], axis=0)
    starts = np.flatnonzero(new)
    for at in np.split(order, starts[1:]):
        seq = co["seq"][at]
        if (co["t_exit"][at] == schema.NO_TIME).any() or (np.diff(seq) <= 0).any():
            continue
        if counted is not None and counted[at].any() != counted[at].all():
            continue
        one = {name: co[name][at][None, :] for name in ("t_enter", "t_exit", "cut", "flags")}
        made = make_part(
            int(co["group"][at[0]]),
            int(co["step"][at[0]]),
            int(inc[at[0]]),
            rank[at[:1]].astype(np.int64),
            seq,
            co["op"][at],
            co["nbytes"][at],
            one["t_enter"],
            one["t_exit"],
            one["cut"],
            one["flags"],
            co["t_start"][at][None, :],
            co["t_end"][at][None, :],
        )
        if made is None:
            continue
        if counted is not None:
            made[1]["counted"] = np.full(1, bool(counted[at[0]]))
        for name, t in zip(_TABLES, made, strict=True):
            out[name].append(t)
        used[at] = True
    cell_spec = dict(schema.PART_CELL_COLUMNS)
    if counted is not None:
        cell_spec["counted"] = np.dtype(bool)
    tables = {
        name: _concat(parts) if parts else {c: np.zeros(0, dt) for c, dt in spec.items()}
        for (name, parts), spec in zip(
            out.items(),
            (schema.PART_COLUMNS, cell_spec, schema.PART_ROW_COLUMNS),
            strict=True,
        )
    }
    return tables, used


@dataclass
class Combined:
    """What a covered (group, step, incarnation) gives: ``cells`` (``schema.CELL_COLUMNS``)
    and ``instances`` (``schema.INSTANCE_COLUMNS``), as a relay holding every member would
    have sent them; ``split`` False where some member left before the last one came (the
    cells then hold only the time inside the calls)."""

    cells: dict[str, np.ndarray]
    instances: dict[str, np.ndarray]
    split: bool


def combine(
    members: np.ndarray,
    parts: dict[str, np.ndarray],
    pid: np.ndarray,
    cells: dict[str, np.ndarray],
    rows: dict[str, np.ndarray] | None = None,
) -> Combined:
    """Combine the parts of one (group, step, incarnation) that cover its members.

    Args:
        members: int (c,) the group's ranks, ascending.
        parts: the parts (``PART_COLUMNS``) of every share, concatenated.
        pid: int (rows of ``parts``,) which share each part row came in.
        cells: the part cells of every share, concatenated.
        rows: their part rows (none: every cell is ``linear``).

    Returns:
        The `Combined`.

    Raises:
        PartError: shares that disagree (``bad_parts``: what they name as called, or ranks
            not the group's, or a rank twice).
    """
    c = members.shape[0]
    order = np.argsort(cells["rank"], kind="stable")
    cells = {k: v[order] for k, v in cells.items()}
    if not np.array_equal(cells["rank"].astype(np.int64), members):
        raise PartError("bad_parts", "the shares' ranks are not the group's members, each once")
    shares = np.unique(pid)
    p = shares.shape[0]
    order = np.lexsort((pid, parts["seq"]))
    seq_sorted = parts["seq"][order]
    if seq_sorted.shape[0] % p:
        raise PartError("bad_parts", "the shares hold different numbers of instances")
    k = seq_sorted.shape[0] // p
    grid = {name: v[order].reshape(k, p).T for name, v in parts.items()}  # (p, k)
    if not (grid["seq"] == grid["seq"][:1]).all() or not (pid[order].reshape(k, p) == shares).all():
        raise PartError("bad_parts", "the shares hold different instances")
    if k > 1 and (np.diff(grid["seq"][0]) == 0).any():
        raise PartError("bad_parts", "a share holds an instance twice")
    for name in ("op", "nbytes", "step", "inc"):
        if not (grid[name] == grid[name][:1]).all():
            raise PartError("bad_parts", f"the shares disagree on the instances' {name}")
    if not (grid["n_members"].sum(axis=0) == c).all():
        raise PartError("bad_parts", "the shares' members do not add up to the group's")
    if not (cells["n"] == k).all():
        raise PartError("bad_parts", f"a member's calls are not the {k} instances combined")

    first_p, last_p = grid["first"], grid["last"]
    first = first_p.min(axis=0)
    last = last_p.max(axis=0)
    top = last_p == last
    big = np.iinfo(np.int32).max
    last_rank = np.where(top, grid["last_rank"], big).min(axis=0)
    winner = np.argmax(top & (grid["last_rank"] == last_rank), axis=0)
    cols = np.arange(k)
    # The latest entry of the others: the other shares' latest, the winner's runner-up.
    behind = last_p.copy()
    behind[winner, cols] = grid["runner_up"][winner, cols]
    behind[behind == schema.NO_TIME] = _LOW
    second = behind.max(axis=0)
    margin = np.where(second == _LOW, np.nan, (last - second).astype(np.float64))
    first_exit = grid["first_exit"].min(axis=0)
    last_exit = grid["last_exit"].max(axis=0)
    split = bool((first_exit >= last).all())
    weight = grid["n_members"].astype(np.float64)
    exits = (first_p - last).astype(np.float64) + grid["exit_median"]
    transfer = _weighted_median(exits, weight)
    device = np.full(k, np.nan)
    starts = np.where(grid["start_max"] == schema.NO_TIME, _LOW, grid["start_max"]).max(axis=0)
    dev = grid["n_device"].sum(axis=0) > 0
    if dev.any():
        ends = (first_p - np.where(starts == _LOW, 0, starts)).astype(np.float64)
        ends = ends + grid["end_median"]
        w = np.where(np.isnan(ends), 0.0, grid["n_device"].astype(np.float64))
        med = _weighted_median(np.where(np.isnan(ends), np.inf, ends), w)
        device = np.where(dev & (starts != _LOW), med, np.nan)
    gid = int(grid["group"][0, 0])
    inc = int(grid["inc"][0, 0])
    instances = {
        "group": np.full(k, gid, np.int32),
        "seq": grid["seq"][0],
        "step": grid["step"][0],
        "inc": np.full(k, inc, np.int32),
        "op": grid["op"][0],
        "nbytes": grid["nbytes"][0],
        "n_members": np.full(k, c, np.int32),
        "first": first,
        "last": last,
        "last_rank": last_rank.astype(np.int32),
        "margin": margin,
        "transfer": transfer,
        "device_transfer": device,
        "first_exit": first_exit,
        "last_exit": last_exit,
    }
    # Each rank's sums after one origin (exact: integers below 2**53).
    origin = int(first.min())
    n = cells["n"].astype(np.float64)
    shift = (cells["origin"] - origin).astype(np.float64) * n
    s_enter = cells["enter_ns"] + shift
    s_exit = cells["exit_ns"] + shift
    out = {
        "rank": cells["rank"],
        "inc": cells["inc"],
        "step": cells["step"],
        "n": cells["n"],
        "coll_ns": s_exit - s_enter,
    }
    if split:
        s_first = float((first - origin).sum())
        s_last = float((last - origin).sum())
        s_leave = float((first_exit - origin).sum())
        times_last = np.bincount(np.searchsorted(members, last_rank), minlength=c)
        linear = cells["linear"] != 0
        exposed_wait = np.where(linear, s_last - (cells["start_ns"] + shift), 0.0)
        exposed_transfer = np.where(linear, s_exit - s_last, cells["after_ns"])
        overstay = np.where(linear, s_exit - s_leave, cells["after_ns"])
        if rows is not None and rows["rank"].shape[0]:
            ew, et, ov = _row_shares(members, rows, grid["seq"][0], last, first_exit, linear)
            exposed_wait += ew
            exposed_transfer += et
            overstay += ov
        out.update(
            times_last=times_last.astype(np.int32),
            wait_ns=s_last - s_enter,
            transfer_ns=s_exit - s_last,
            late_ns=s_enter - s_first,
            exposed_wait_ns=exposed_wait,
            exposed_transfer_ns=exposed_transfer,
            overstay_ns=overstay,
        )
    else:
        zero = np.zeros(c)
        out["times_last"] = np.zeros(c, np.int32)
        for name in schema.CELL_SUMS:
            if name != "coll_ns":
                out[name] = zero
    return Combined(
        cells={name: out[name] for name in schema.CELL_COLUMNS}, instances=instances, split=split
    )


def _row_shares(
    members: np.ndarray,
    rows: dict[str, np.ndarray],
    seq: np.ndarray,
    last: np.ndarray,
    first_exit: np.ndarray,
    linear: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per member, the exposed wait, exposed transfer and overstay of its part rows, now
    that the instances' last entry and first exit are known (`diagnosis.blocks
    .contributions`, every exit after the last entry)."""
    c = members.shape[0]
    at = np.searchsorted(seq, rows["seq"])
    who = np.searchsorted(members, rows["rank"])
    if (
        (at >= seq.shape[0]).any()
        or (seq[np.minimum(at, seq.shape[0] - 1)] != rows["seq"]).any()
        or (who >= c).any()
        or (members[np.minimum(who, c - 1)] != rows["rank"]).any()
        or linear[np.minimum(who, c - 1)].any()
    ):
        raise PartError("bad_parts", "part rows of instances or members the parts do not hold")
    # Relative to the latest entry: small integers, exact in float64.
    L = last[at]
    start = (rows["start"] - L).astype(np.float64)
    leave = (rows["exit"] - L).astype(np.float64)
    cut = np.where(rows["cut"] == schema.NO_TIME, -np.inf, (rows["cut"] - L).astype(np.float64))
    fe = (first_exit[at] - L).astype(np.float64)
    wait = np.maximum(np.minimum(0.0, leave) - start, 0.0)
    transfer = np.maximum(leave - np.maximum(0.0, cut), 0.0)
    over = np.maximum(leave - np.maximum(fe, cut), 0.0)
    return tuple(np.bincount(who, w, minlength=c) for w in (wait, transfer, over))  # type: ignore[return-value]


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per column of (p, k) ``values``, the median under ``weights`` (the mean of the two
    middle values where the weight splits evenly between them); NaN where no weight."""
    p, k = values.shape
    if p == 1:
        return np.where(weights[0] > 0, values[0], np.nan)
    order = np.argsort(values, axis=0, kind="stable")
    v = np.take_along_axis(values, order, axis=0)
    cum = np.cumsum(np.take_along_axis(weights, order, axis=0), axis=0)
    total = cum[-1]
    half = total / 2
    at = np.argmax(cum >= half, axis=0)
    cols = np.arange(k)
    lo = v[at, cols]
    nxt = np.minimum(at + 1, p - 1)
    even = (cum[at, cols] == half) & (at + 1 < p)
    out = np.where(even, (lo + v[nxt, cols]) / 2, lo)
    return np.where(total > 0, out, np.nan)


@dataclass
class _Held:
    msgs: list[int] = field(default_factory=list)
    """The messages holding its shares (ids in `PartStore.messages`)."""
    ranks: set[int] = field(default_factory=set)
    """The members the shares so far cover."""


@dataclass
class _Message:
    tables: dict[str, dict[str, np.ndarray]]
    """``parts`` (with ``pid``), ``part_cells``, ``part_rows``: the rows of the keys held."""
    code: dict[str, np.ndarray]
    """Per table, each row's key as an index into ``keys``."""
    keys: list[tuple[int, int, int]]
    live: int
    """Keys of it still held."""


@dataclass
class PartStore:
    """The parts the hub holds until they cover their group (`combine`).

    `add` takes a validated message's ``parts``, ``part_cells`` and ``part_rows`` and
    returns the keys (group, step, incarnation) they complete, and the part cells it took;
    `pop` takes keys out; `stale` names the keys at or below a step. A message is held
    whole, not cut per key: the keys a step's last message completes are taken out
    together, with one gather per table (a rack's message carries a share of every
    data-parallel group, and every rack's message is needed to complete one).
    """

    held: dict[tuple[int, int, int], _Held] = field(default_factory=dict)
    messages: dict[int, _Message] = field(default_factory=dict)
    shares: int = 0
    """Shares taken (each gets its own id)."""
    _next: int = 0

    def add(
        self,
        tables: dict[str, dict[str, np.ndarray]],
        sizes: dict[int, int],
        done: set[tuple[int, int, int]],
    ) -> tuple[list[tuple[int, int, int]], np.ndarray, int]:
        """Hold one message's parts.

        Args:
            tables: the message's ``parts``, ``part_cells`` and ``part_rows``.
            sizes: group -> its number of members.
            done: keys combined or closed already.

        Returns:
            The keys that now cover their group's members, which rows of ``part_cells``
            were taken, and how many shares were refused as repeats (a key already done,
            or a member a held share covers).
        """
        keys, codes = _key_codes(*(tables[n] for n in _TABLES))
        cells = tables["part_cells"]
        c_code = codes[1]
        order = np.argsort(c_code, kind="stable")
        cuts = np.flatnonzero(np.diff(c_code[order])) + 1
        by_key = dict(zip(c_code[order][np.append(0, cuts)].tolist(), np.split(order, cuts)))
        ok = np.ones(len(keys), bool)
        complete, repeats = [], 0
        ranks_of = {}
        for j, key in enumerate(keys):
            at = by_key.get(j)
            ranks = set(cells["rank"][at].tolist()) if at is not None else set()
            h = self.held.get(key)
            if (
                at is None
                or key in done
                or (h is not None and ranks & h.ranks)
                or (len(ranks) < at.shape[0])
            ):
                ok[j] = False
                repeats += 1
            ranks_of[j] = ranks
        kept = [j for j in range(len(keys)) if ok[j]]
        if not kept:
            return [], np.zeros(cells["rank"].shape[0], bool), repeats
        held = {}
        for name, code in zip(_TABLES, codes, strict=True):
            t = tables[name]
            sel = ok[code] if code.shape[0] else np.zeros(0, bool)
            held[name] = t if sel.all() else {k: v[sel] for k, v in t.items()}
            codes_kept = code if sel.all() else code[sel]
            held[name] = dict(held[name])
            held[name]["_key"] = codes_kept
        # A message may carry several shares of a key (a rack's relay passes its nodes'
        # parts on together): each holds every instance once, in order, so the i-th part
        # row of an instance in a key is the i-th share's.
        parts = held["parts"]
        seq, kc = parts["seq"], parts["_key"]
        order = np.lexsort((seq, kc))
        first = np.ones(seq.shape[0], bool)
        first[1:] = (seq[order][1:] != seq[order][:-1]) | (kc[order][1:] != kc[order][:-1])
        run_start = np.maximum.accumulate(np.where(first, np.arange(seq.shape[0]), 0))
        nth = np.empty(seq.shape[0], np.int64)
        nth[order] = np.arange(seq.shape[0]) - run_start
        most = int(nth.max()) + 1 if nth.shape[0] else 1
        parts["pid"] = self.shares + kc * most + nth
        self.shares += len(keys) * most
        mid = self._next
        self._next += 1
        self.messages[mid] = _Message(
            tables=held, code={n: held[n].pop("_key") for n in _TABLES}, keys=keys, live=len(kept)
        )
        for j in kept:
            key = keys[j]
            h = self.held.get(key)
            if h is None:
                h = self.held[key] = _Held()
            h.msgs.append(mid)
            h.ranks |= ranks_of[j]
            if len(h.ranks) >= sizes.get(key[0], 0) > 0:
                complete.append(key)
        taken = ok[c_code] if c_code.shape[0] else np.zeros(0, bool)
        return complete, taken, repeats

    def pop(
        self, keys: list[tuple[int, int, int]]
    ) -> dict[
        tuple[int, int, int],
        tuple[dict[str, np.ndarray], np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]],
    ]:
        """Each key's parts (concatenated), their share ids, part cells and part rows;
        taken out."""
        want = {key: i for i, key in enumerate(keys)}
        mids = sorted({m for key in keys for m in self.held.pop(key).msgs})
        gathered: dict[str, list[dict[str, np.ndarray]]] = {n: [] for n in _TABLES}
        who: dict[str, list[np.ndarray]] = {n: [] for n in _TABLES}
        for m in mids:
            msg = self.messages[m]
            # The message's keys -> the batch's (-1: not popped now).
            lut = np.array([want.get(k, -1) for k in msg.keys], np.int64)
            popped = int((lut >= 0).sum())
            for name in _TABLES:
                t, code = msg.tables[name], msg.code[name]
                if not code.shape[0]:
                    continue
                mine = lut[code]
                if popped == msg.live and (mine >= 0).all():
                    gathered[name].append(t)
                    who[name].append(mine)
                else:
                    sel = mine >= 0
                    gathered[name].append({k: v[sel] for k, v in t.items()})
                    who[name].append(mine[sel])
            msg.live -= popped
            if msg.live <= 0:
                del self.messages[m]
        out_tables: dict[str, list[dict[str, np.ndarray]]] = {}
        for name in _TABLES:
            if not gathered[name]:
                out_tables[name] = [{} for _ in keys]
                continue
            cat = _concat(gathered[name])
            idx = np.concatenate(who[name])
            order = np.argsort(idx, kind="stable")
            bounds = np.searchsorted(idx[order], np.arange(len(keys) + 1))
            cat = {k: v[order] for k, v in cat.items()}
            out_tables[name] = [
                {k: v[a:b] for k, v in cat.items()} for a, b in pairwise(bounds.tolist())
            ]
        result = {}
        for i, key in enumerate(keys):
            parts = out_tables["parts"][i] or _empty("parts")
            cells = out_tables["part_cells"][i] or _empty("part_cells")
            rows = out_tables["part_rows"][i] or _empty("part_rows")
            parts = dict(parts)
            pid = parts.pop("pid", np.zeros(0, np.int64))
            result[key] = (parts, pid, cells, rows)
        return result

    def stale(self, step: int) -> list[tuple[int, int, int]]:
        """Keys of steps at or below ``step``."""
        return [key for key in self.held if key[1] <= step]


_TABLES = ("parts", "part_cells", "part_rows")


def _empty(name: str) -> dict[str, np.ndarray]:
    return {c: np.zeros(0, dt) for c, dt in schema.REDUCED_TABLES[name].items()}


def _key_codes(
    *tables: dict[str, np.ndarray],
) -> tuple[list[tuple[int, int, int]], list[np.ndarray]]:
    """The (group, step, incarnation) keys the tables hold, and each row's key as an index
    into them, per table."""
    g = np.concatenate([t["group"] for t in tables]).astype(np.int64)
    s = np.concatenate([t["step"] for t in tables])
    i = np.concatenate([t["inc"] for t in tables]).astype(np.int64)
    bounds = np.cumsum([0] + [t["group"].shape[0] for t in tables])
    if not g.shape[0]:
        return [], [np.zeros(0, np.int64) for _ in tables]
    if (
        int(g.min()) >= 0
        and int(g.max()) < 1 << 31
        and int(s.max()) < 1 << 32
        and int(i.min()) == int(i.max())
    ):
        # The usual message: one incarnation, small ids: one integer per key.
        uniq, code = np.unique((g << 32) | s, return_inverse=True)
        code = code.reshape(-1)
        inc = int(i[0])
        keys = [(int(k >> 32), int(k & 0xFFFFFFFF), inc) for k in uniq.tolist()]
        return keys, [code[a:b] for a, b in pairwise(bounds.tolist())]
    cols = [np.stack([g[a:b], s[a:b], i[a:b]]) for a, b in pairwise(bounds.tolist())]
    every = np.concatenate(cols, axis=1)
    order = np.lexsort(every[::-1])
    srt = every[:, order]
    new = np.ones(srt.shape[1], bool)
    new[1:] = (srt[:, 1:] != srt[:, :-1]).any(axis=0)
    code_sorted = np.cumsum(new) - 1
    code = np.empty(every.shape[1], np.int64)
    code[order] = code_sorted
    heads = srt[:, new]
    keys = list(zip(*(heads[j].tolist() for j in range(3)), strict=True))
    return keys, [code[a:b] for a, b in pairwise(bounds.tolist())]


def _concat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(parts) == 1:
        return dict(parts[0])
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
