"""How many steps each run's dense ring keeps under the store's one cell budget.

A hub serves many runs for hours: the incident run, its baseline, reduced reruns, runs
that ended long ago. Their rings (``world size × steps`` cells each) share one budget,
``max_cells``, so memory stays bounded however many runs the hub has heard of. The plan:

1. every run keeps a floor: ``max(min_steps, floor_cells // world)`` steps (never more than
   it wants), enough for a baseline window of a finished run;
2. *active* runs (a new step within ``idle_ns`` of the newest step the store has seen) share
   what is left, each up to what it would keep alone (``min(history_steps, max_cells //
   world)``): water-filling, so a small rerun takes the little it needs and large runs
   split the rest evenly;
3. *idle* runs keep what is still left, up to their current size, the most recently active
   first; they never grow.

Activity is judged on the hub-aligned clock of the steps themselves (``t_end``), not on the
hub's wall clock, so replaying a recording plans the same rings as the live hub did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RingClaim:
    """One run as the plan sees it."""

    world: int
    """Ranks: cells per step."""
    steps: int
    """Steps its ring holds now (0 for a run not allocated yet)."""
    want: int
    """Steps it would keep alone."""
    floor: int
    """Steps it keeps whatever the others need (≤ ``want``)."""
    active: bool
    last_ns: int
    """Newest step end (hub clock); orders idle runs, most recent first."""


def plan(claims: Sequence[RingClaim], max_cells: int) -> list[int]:
    """Target steps of every run's ring under the budget (see the module docstring).

    Args:
        claims: the runs.
        max_cells: the store-wide bound on Σ world × steps. Floors alone may exceed it
            (then every run keeps just its floor).

    Returns:
        Target steps per claim, in order; each between its floor and its want.

    Raises:
        ValueError: a claim with no ranks, or a floor above its want.
    """
    for c in claims:
        if c.world < 1 or c.floor < 1 or c.floor > c.want:
            raise ValueError(f"bad ring claim {c}: need world ≥ 1 and 1 ≤ floor ≤ want")
    target = [c.floor for c in claims]
    left = max_cells - sum(c.world * c.floor for c in claims)
    # Active runs: raise everyone's cells to a common level, capped by what each wants.
    active = sorted(
        (i for i, c in enumerate(claims) if c.active),
        key=lambda i: claims[i].world * (claims[i].want - claims[i].floor),
    )
    for k, i in enumerate(active):
        if left <= 0:
            break
        c = claims[i]
        share = left // (len(active) - k)
        extra = min(c.want - c.floor, share // c.world)
        target[i] += extra
        left -= extra * c.world
    idle = sorted(
        (i for i, c in enumerate(claims) if not c.active), key=lambda i: -claims[i].last_ns
    )
    for i in idle:
        if left <= 0:
            break
        c = claims[i]
        extra = min(max(c.steps, c.floor) - c.floor, left // c.world)
        target[i] += extra
        left -= extra * c.world
    return target
