"""Clocks that disagree, read from when ranks leave the collectives they share.

Every member of a collective instance leaves it at about the same instant: the last
arrival releases them all, and their exits differ by the time each takes to notice (µs).
A rank whose clock is off leaves every instance it shares with other hosts that far
from its peers, whichever way it arrived. The collector aligns each rank to the hub's clock
(`collector.clock`), so what is found here is a stream that was not aligned (another
generator, a rank whose clock stepped, an importer without alignment): its arrivals,
lateness and wait against the other hosts are not what happened.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.diagnosis.arrivals import segment_nanmedian
from rankscope.diagnosis.exposure import P2P_OPS, row_last
from rankscope.diagnosis.robust import group_median
from rankscope.diagnosis.window import Window

CLOCK_TOL_NS = 2e6
"""A rank whose exits lead or lag its peers' by this much (median over its instances)
has a clock off by about that: far past any collector's alignment error (µs) and the
time ranks take to notice a completion, yet already enough to move arrival-based figures
of millisecond collectives."""

SPREAD_FACTOR = 20.0
"""And by this many times the median distance of an exit from its instance's median."""

STEADY_FACTOR = 4.0
"""And its exits stay within a quarter of that offset of it (median): a clock is off by a
constant, a rank starved of a core notices completions late by varying amounts."""

MIN_INSTANCES = 8
"""Instances a rank must share with other hosts for its offset to be read."""


@dataclass(frozen=True)
class ClockSkew:
    """Ranks whose clock disagrees with their peers' (`clock_skew`)."""

    ranks: np.ndarray
    """int64 ranks, ascending."""
    offset_ns: np.ndarray
    """float64 per entry: the median of its exits less its instances' median exit."""
    instances: int
    """Instances read (complete, shared with other hosts, exits after the last arrival)."""
    spread_ns: float
    """Median distance of an exit from its instance's median exit."""


def clock_skew(window: Window) -> ClockSkew:
    """Ranks whose exits from the collectives they share with other hosts lead or lag
    their peers' by `CLOCK_TOL_NS` or more (median over at least `MIN_INSTANCES`).

    Reads the raw rows the window kept: complete instances of groups that cross hosts
    (inside a host every member shares the clock), point-to-point calls aside, where the
    members' median exit is after the last arrival (an exit that marks completion: host
    calls that return at launch say nothing).

    Args:
        window: the window.

    Returns:
        The `ClockSkew` (empty when nothing can be read or every clock agrees).
    """
    none = ClockSkew(np.zeros(0, np.int64), np.zeros(0), 0, float("nan"))
    rows, inst = window.rows, window.instances
    if rows is None or len(rows) == 0 or len(inst) == 0:
        return none
    crossing = {gid for gid, g in window.groups.items() if g.crosses_hosts}
    if not crossing:
        return none
    last, complete = row_last(window)
    ok = (
        complete
        & np.isin(rows.group, np.fromiter(crossing, np.int64))
        & np.isfinite(rows.t_exit)
        & ~np.isin(rows.op, P2P_OPS)
        & (rows.rank >= 0)
        & (rows.rank < window.world_size)
    )
    if not ok.any():
        return none
    key = rows.group.astype(np.int64) * (1 << 40) + rows.seq.astype(np.int64)
    k, x, r, last = key[ok], rows.t_exit[ok], rows.rank[ok].astype(np.int64), last[ok]
    o = np.argsort(k, kind="stable")
    k, x, r, last = k[o], x[o], r[o], last[o]
    starts = np.flatnonzero(np.concatenate(([True], k[1:] != k[:-1])))
    sizes = np.diff(np.append(starts, k.shape[0]))
    med = np.repeat(segment_nanmedian(x, starts, sizes), sizes)
    done = med >= last
    if not done.any():
        return none
    res, who = (x - med)[done], r[done]
    spread = float(np.median(np.abs(res)))
    world = window.world_size
    counts = np.bincount(who, minlength=world)
    offset = group_median(who, res, world)
    # A clock is off by a constant: the rank's exits sit tightly around its offset. A
    # rank that notices completions late (starved of a core) lags by varying amounts.
    own = group_median(who, np.abs(res - offset[who]), world)
    bad = (
        (counts >= MIN_INSTANCES)
        & (np.abs(offset) >= max(CLOCK_TOL_NS, SPREAD_FACTOR * spread))
        & (own * STEADY_FACTOR <= np.abs(offset))
    )
    ranks = np.flatnonzero(bad)
    return ClockSkew(
        ranks=ranks.astype(np.int64),
        offset_ns=offset[ranks],
        instances=int(starts.shape[0]),
        spread_ns=spread,
    )
