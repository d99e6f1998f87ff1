"""Ranks whose state the window cannot tell: they said hello and stopped reporting, or
report steps without timing a single collective.

The verdict names them before anything else (``diagnosis.verdict``): a rank nothing was
heard from cannot be called healthy, and one whose collectives are not timed reads its
collective time as compute, so the engine leaves it out of the analyses
(`without_ranks`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from rankscope.diagnosis.stall import STALL_S, STALL_STEPS
from rankscope.diagnosis.window import Window


@dataclass(frozen=True)
class Unreported:
    """Ranks that said hello and stopped reporting while the others went on (`unreported`)."""

    ranks: np.ndarray
    """int64 ranks, ascending."""
    never: np.ndarray
    """bool per entry of ``ranks``: it completed no step in the window."""
    behind_s: np.ndarray
    """float64 per entry: how long before the median latest step end of the ranks that
    went on its last one ended (NaN where it completed none)."""
    last_step: np.ndarray
    """int64 per entry: its last complete step (-1 where none)."""
    no_calls: np.ndarray
    """bool per entry: it completed steps but recorded no collective call, while members of
    its groups recorded some (a collector that times no collective, its rows refused)."""
    reporting: int
    """Ranks that completed a step in the window and did not stop."""
    hello: int
    """Ranks that said hello."""


def unreported(window: Window) -> Unreported:
    """Ranks whose state the window cannot tell: they said hello (their identity is known)
    and completed no step in it, or at least half of the other ranks went on a stall's
    threshold past their last step (`STALL_STEPS` median steps and `STALL_S`: far past any
    collector's flush interval). A dead or hung process, a
    collector that stopped sending or messages refused look the same here; the heartbeats
    tell them apart (`hub.hang`). Ranks that never said hello are not expected (a recording
    of chosen ranks). None when no rank completed a step.

    Args:
        window: the window.

    Returns:
        The `Unreported` ranks (empty when every rank that said hello reports).
    """
    done = window.present & np.isfinite(window.step_ns)
    said = window.ranks.host >= 0
    empty = np.zeros(0, np.int64)
    if not done.any():
        none = np.zeros(0, bool)
        return Unreported(empty, none, np.zeros(0), empty, none, 0, int(said.sum()))
    stepped = done.any(axis=1)
    ends = np.where(done, window.t_end, -np.inf).max(axis=1)
    med = float(np.median(window.step_ns[done]))
    threshold = max(STALL_S * 1e9, STALL_STEPS * max(med, 0.0))
    # Stopped: at least half of the other ranks that stepped went on past the threshold
    # (one rank's absurd time, accepted from a recording, cannot make the others stop).
    latest = np.sort(ends[stepped])
    ahead = latest.shape[0] - np.searchsorted(latest, ends + threshold)
    stopped = stepped & (ahead >= 1) & (2 * ahead >= latest.shape[0] - 1)
    quiet = _no_calls(window, stepped)
    gone = said & (~stepped | stopped | quiet)
    going = stepped & ~gone
    behind = (np.median(ends[going]) if going.any() else ends.max()) - ends
    ranks = np.flatnonzero(gone).astype(np.int64)
    never = ~done[ranks].any(axis=1)
    idx = np.where(done[ranks], np.arange(done.shape[1]), -1).max(axis=1)
    last = np.where(idx >= 0, window.steps[np.maximum(idx, 0)], -1).astype(np.int64)
    return Unreported(
        ranks=ranks,
        never=never,
        behind_s=np.where(never, np.nan, behind[ranks] / 1e9),
        last_step=last,
        no_calls=quiet[ranks] & ~never,
        reporting=int(going.sum()),
        hello=int(said.sum()),
    )


def _no_calls(window: Window, stepped: np.ndarray) -> np.ndarray:
    """bool (R,): ranks with complete steps and no collective call in the window, though a
    member of one of their groups (of two or more) recorded calls."""
    n = window.coll.get("n")
    out = np.zeros(stepped.shape[0], bool)
    if n is None:
        return out
    calls = np.nansum(np.where(window.present, n, 0.0), axis=1) > 0
    if calls.all() or not calls.any():
        return out
    for g in window.groups.values():
        members = np.asarray(g.ranks, np.int64)
        members = members[(members >= 0) & (members < out.shape[0])]
        if members.shape[0] > 1 and calls[members].any():
            out[members] |= stepped[members] & ~calls[members]
    return out


def without_ranks(window: Window, ranks: np.ndarray) -> Window:
    """``window`` with ``ranks`` left out of its steps (present nowhere)."""
    present = window.present.copy()
    present[ranks] = False
    return replace(window, present=present)
