"""Stall detection: the hang view.

When no step has completed for ``STALL_STEPS`` median step times, the job is stalled — or
hung. The useful answer is then not a timing but a list: for each collective instance
``(group, seq)`` that some members entered and others did not, which ranks are missing.
A rank missing from many instances (or that stopped reporting) is where to attach a
debugger; ranks that entered are waiting for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.collector.schema import OPS
from rankscope.diagnosis.baseline import job_step_ns
from rankscope.diagnosis.robust import nanmedian
from rankscope.diagnosis.window import Window

STALL_STEPS = 5.0
"""No step end for this many median step times is a stall."""


@dataclass(frozen=True)
class PendingInstance:
    """A collective some members entered and others have not."""

    group: int
    group_name: str
    seq: int
    op: str
    entered: int
    members: int
    missing: tuple[int, ...]
    """Global ranks of the group with no row for this instance."""
    waiting_since_ns: float
    """First entry time, relative to the window's origin."""


@dataclass(frozen=True)
class Stall:
    """Whether the run is stalled and who is holding it up."""

    stalled: bool
    now_ns: float
    """The instant judged (relative ns): the latest time seen in the window unless given."""
    last_step_end_ns: float
    median_step_ns: float
    idle_steps: float
    """(now − last step end) / median step."""
    pending: tuple[PendingInstance, ...]
    """Incomplete instances, oldest first (at most 50)."""
    missing_counts: dict[int, int]
    """Rank -> pending instances it has not entered (the likely culprits first)."""
    silent_ranks: tuple[int, ...]
    """Ranks that did not report the latest step others reported."""

    def culprits(self, k: int = 8) -> list[int]:
        """The ranks missing from the most pending instances."""
        order = sorted(self.missing_counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return [r for r, _ in order[:k]]


def latest_time(window: Window) -> float:
    """The latest instant the window saw anything happen.

    Args:
        window: the window.

    Returns:
        Relative ns (NaN for an empty window).
    """
    candidates = [np.nanmax(window.t_end) if np.isfinite(window.t_end).any() else np.nan]
    inst = window.instances
    if len(inst):
        candidates.append(np.nanmax(inst.last) if np.isfinite(inst.last).any() else np.nan)
    rows = window.rows
    if rows is not None and len(rows):
        for col in (rows.t_enter, rows.t_exit):
            if np.isfinite(col).any():
                candidates.append(float(np.nanmax(col)))
    vals = [c for c in candidates if np.isfinite(c)]
    return float(max(vals)) if vals else float("nan")


def detect_stall(window: Window, now_ns: float | None = None) -> Stall:
    """Is the run stalled, and which ranks have not entered which (group, seq)?

    Args:
        window: the window (its raw rows, when kept, name the missing ranks exactly).
        now_ns: the instant to judge, relative to ``window.t0_ns`` (default: the latest
            time seen in the window — then only a hang visible in the data is found).

    Returns:
        The stall view.
    """
    now = latest_time(window) if now_ns is None else float(now_ns)
    step = job_step_ns(window)
    med = float(nanmedian(step)) if np.isfinite(step).any() else float("nan")
    last_end = float(np.nanmax(window.t_end)) if np.isfinite(window.t_end).any() else float("nan")
    idle = (now - last_end) / med if med > 0 and np.isfinite(last_end) else float("nan")

    pending = _pending(window)
    counts: dict[int, int] = {}
    for p in pending:
        for r in p.missing:
            counts[r] = counts.get(r, 0) + 1
    silent: tuple[int, ...] = ()
    if window.present.size and window.present.shape[1]:
        reported = window.present.any(axis=0)
        if reported.any():
            j = int(np.flatnonzero(reported)[-1])
            silent = tuple(int(r) for r in np.flatnonzero(~window.present[:, j]))
            # A rank that reported nothing at all is not part of this run's window.
            silent = tuple(r for r in silent if window.present[r].any())
    stalled = bool(np.isfinite(idle) and idle >= STALL_STEPS)
    return Stall(
        stalled=stalled,
        now_ns=now,
        last_step_end_ns=last_end,
        median_step_ns=med,
        idle_steps=float(idle),
        pending=tuple(pending[:50]),
        missing_counts=counts,
        silent_ranks=silent,
    )


def _pending(window: Window) -> list[PendingInstance]:
    inst = window.instances
    if not len(inst):
        return []
    open_ = np.flatnonzero((inst.n_arrived < inst.n_members) & (inst.n_members > 0))
    if open_.size == 0:
        return []
    open_ = open_[np.argsort(inst.first[open_], kind="stable")]
    rows = window.rows
    out = []
    for i in open_[:200]:
        gid = int(inst.group[i])
        seq = int(inst.seq[i])
        g = window.groups.get(gid)
        members = g.ranks if g is not None else ()
        if rows is not None and len(rows):
            sel = (rows.group == gid) & (rows.seq == seq)
            entered = set(int(r) for r in np.unique(rows.rank[sel]))
            missing = tuple(r for r in members if r not in entered)
        else:
            # Without rows, the ranks that did not report the instance's step are the best
            # available guess.
            j = np.searchsorted(window.steps, inst.step[i])
            if j < window.steps.shape[0] and window.steps[j] == inst.step[i]:
                missing = tuple(r for r in members if not window.present[r, j])
            else:
                missing = ()
        op = int(inst.op[i])
        out.append(
            PendingInstance(
                group=gid,
                group_name=g.name if g is not None else f"group{gid}",
                seq=seq,
                op=OPS[op] if 0 <= op < len(OPS) else "other",
                entered=int(inst.n_arrived[i]),
                members=int(inst.n_members[i]),
                missing=missing,
                waiting_since_ns=float(inst.first[i]),
            )
        )
    return out
