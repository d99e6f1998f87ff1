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


# -- hangs from heartbeats -------------------------------------------------------------

HANG_CASES = ("not_entered", "in_transfer", "gone", "mismatch")
"""What holds a hung job: a rank alive but not entered into the collective the others wait
in; every member entered and none finished (transfer or network); a rank whose process is
gone or frozen (no heartbeat); a rank that went past a collective the others wait in."""

STALL_S = 6.0
"""Default floor of the stall threshold: no rank progressed for this long."""
STALL_FACTOR = 2.0
"""The threshold is at least this many times the longest recent step."""
BEAT_TIMEOUT_S = 5.0
"""No heartbeat for this long: the process is gone or frozen."""
RECENT_STEPS = 32
"""Step times the threshold looks at."""


@dataclass(frozen=True)
class Culprit:
    """A rank that holds the job, and why."""

    rank: int
    host: str
    case: str
    """One of ``HANG_CASES``."""
    group: int
    group_name: str
    op: str
    seq: int
    """The instance the others wait in (-1 when none is known)."""
    detail: str


@dataclass(frozen=True)
class Waiter:
    """What one rank is doing while the job is stalled."""

    rank: int
    where: str
    """``in GROUP:OP#SEQ``, ``step N, outside collectives``, ``gone`` or ``exited``."""
    group: int
    seq: int
    op: str
    since_ns: int
    """Hub-clock entry time of that collective (-1 when not inside one)."""


@dataclass(frozen=True)
class Hang:
    """The heartbeat judge's verdict."""

    stalled: bool
    case: str
    """The primary culprit's case, or ``""``."""
    now_ns: int
    last_progress_ns: int
    """Hub-clock time any rank last moved (began or ended a step, entered or left a
    collective); -1 unknown."""
    idle_s: float
    threshold_s: float
    culprits: tuple[Culprit, ...]
    waiting: tuple[Waiter, ...]
    beating: int
    """Ranks that ever sent a heartbeat."""

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (the ``stall`` section's ``hang`` fields)."""
        return {
            "stalled": self.stalled,
            "case": self.case,
            "idle_s": round(self.idle_s, 3) if np.isfinite(self.idle_s) else None,
            "threshold_s": round(self.threshold_s, 3),
            "last_progress_ns": self.last_progress_ns,
            "culprits": [c.__dict__ for c in self.culprits],
            "waiting": [w.__dict__ for w in self.waiting[:64]],
            "beating": self.beating,
        }


def stall_threshold_s(step_ns: np.ndarray, stall_s: float = STALL_S) -> float:
    """Seconds without progress that the recent steps make implausible.

    Args:
        step_ns: recent step durations (ns; NaN unknown).
        stall_s: the floor.

    Returns:
        ``max(stall_s, STALL_FACTOR × the longest of the last RECENT_STEPS steps)``.
    """
    s = np.asarray(step_ns, np.float64)
    s = s[np.isfinite(s) & (s > 0)][-RECENT_STEPS:]
    longest = float(s.max()) / 1e9 if s.size else 0.0
    return max(float(stall_s), STALL_FACTOR * longest)


def judge_hang(
    beats: dict[str, np.ndarray],
    now_ns: int,
    step_ns: np.ndarray,
    groups: dict[int, tuple[tuple[int, ...], str]],
    hosts: dict[int, str] | None = None,
    *,
    stall_s: float = STALL_S,
    beat_timeout_s: float = BEAT_TIMEOUT_S,
) -> Hang:
    """Is the job hung, who holds it, and what is everyone else waiting in?

    Args:
        beats: each rank's latest heartbeat as columns (``heard_ns``, ``state`` and the
            ``schema.BEAT_POS_FIELDS``; -1 unknown), hub-clock ns.
        now_ns: the instant judged (hub clock).
        step_ns: recent job step durations (the threshold's scale).
        groups: group id -> (member ranks, name).
        hosts: rank -> host name.
        stall_s: floor of the threshold.
        beat_timeout_s: no beat for this long is a process gone or frozen.

    Returns:
        The verdict; ``stalled`` needs no progress for the threshold and either a rank gone
        or a rank waiting inside a collective (all ranks alive and outside collectives are
        computing, not hung on a collective).
    """
    hosts = hosts or {}
    heard = np.asarray(beats["heard_ns"], np.int64)
    R = heard.shape[0]
    threshold = stall_threshold_s(step_ns, stall_s)
    seen = heard >= 0
    if not seen.any():
        return Hang(False, "", int(now_ns), -1, float("nan"), threshold, (), (), 0)
    col = {k: np.asarray(beats[k], np.int64) for k in beats}
    moved = np.max(np.stack([col["step_t0"], col["ended_t"], col["exit_t"], col["since"]]), axis=0)
    last = int(moved[seen].max())
    idle = (now_ns - last) / 1e9 if last >= 0 else float("nan")
    exited = seen & (col["state"] == 2)
    silent = seen & ~exited & (heard < now_ns - int(beat_timeout_s * 1e9))
    gone = exited | silent
    inside = seen & ~gone & (col["group"] >= 0)
    step_of = np.where(col["step"] >= 0, col["step"], col["ended"] + 1)

    def name(g: int) -> str:
        return groups[g][1] if g in groups else f"group{g}"

    def op_name(i: int) -> str:
        return OPS[i] if 0 <= i < len(OPS) else "other"

    waiting = []
    for r in range(R):
        if not seen[r]:
            continue
        if gone[r]:
            where = "exited" if exited[r] else "gone (no heartbeat)"
            waiting.append(Waiter(r, where, -1, -1, "", -1))
        elif inside[r]:
            g, s, o = int(col["group"][r]), int(col["seq"][r]), int(col["op"][r])
            where = f"in {name(g)}:{op_name(o)}#{s}"
            waiting.append(Waiter(r, where, g, s, op_name(o), int(col["since"][r])))
        else:
            waiting.append(
                Waiter(r, f"step {int(step_of[r])}, outside collectives", -1, -1, "", -1)
            )

    # Open instances: (group, seq) -> ranks inside, oldest entry first.
    open_: dict[tuple[int, int], list[int]] = {}
    for r in np.flatnonzero(inside).tolist():
        open_.setdefault((int(col["group"][r]), int(col["seq"][r])), []).append(r)
    order = sorted(open_, key=lambda k: min(int(col["since"][r]) for r in open_[k]))
    found: dict[int, Culprit] = {}
    gone_first = np.flatnonzero(gone)
    if "run_group" in col and gone_first.size > 1:
        # A rank that was waiting inside a collective when it went is a victim of one that
        # went from outside (gloo ends a collective whose peer closed its connection).
        outside = gone_first[col["run_group"][gone_first] < 0]
        if "error" in col and outside.size > 1:
            clean = outside[col["error"][outside] == 0]
            outside = clean if clean.size else outside
        if outside.size:
            gone_first = outside
    for r in gone_first.tolist():
        inst = next((k for k in order if r in groups.get(k[0], ((), ""))[0]), None)
        g, s = inst if inst is not None else (-1, -1)
        oname = op_name(int(col["op"][open_[inst][0]])) if inst is not None else ""
        why = (
            "its process exited"
            if exited[r]
            else (
                f"no heartbeat for {(now_ns - int(heard[r])) / 1e9:.1f} s: crashed, killed, "
                "stopped or its node lost"
            )
        )
        found[r] = Culprit(
            r,
            hosts.get(r, ""),
            "gone",
            g,
            name(g) if g >= 0 else "",
            oname,
            s,
            f"{why}; last seen in step {int(step_of[r])}",
        )
    if not found:
        for g, s in order:
            ins = open_[(g, s)]
            members = groups.get(g, (tuple(range(R)), ""))[0]
            oname = op_name(int(col["op"][ins[0]]))
            their_step = int(max(step_of[r] for r in ins))
            missing = [m for m in members if 0 <= m < R and m not in ins and seen[m]]
            if not missing:
                if len(ins) == len(members):
                    for r in ins:
                        found.setdefault(
                            r,
                            Culprit(
                                r,
                                hosts.get(r, ""),
                                "in_transfer",
                                g,
                                name(g),
                                oname,
                                s,
                                "every member entered, none finished",
                            ),
                        )
                continue
            for m in missing:
                if m in found:
                    continue
                if step_of[m] > their_step:
                    case = "mismatch"
                    detail = (
                        f"ended step {their_step} without entering it; now "
                        f"{waiting_where(waiting, m)}"
                    )
                else:
                    case = "not_entered"
                    detail = f"alive, {waiting_where(waiting, m)}"
                found[m] = Culprit(m, hosts.get(m, ""), case, g, name(g), oname, s, detail)
        # A rank that waits inside a collective itself is a culprit only when nothing else
        # explains the hang (it waits for someone too).
        primary = {r: c for r, c in found.items() if not inside[r] or c.case == "mismatch"}
        if primary:
            found = primary
    culprits = tuple(
        sorted(
            found.values(),
            key=lambda c: (HANG_CASES.index(c.case) if c.case != "mismatch" else -1, c.rank),
        )
    )
    error = col["error"] > 0 if "error" in col else np.zeros(R, bool)
    finished = bool(seen.any() and (exited[seen] & ~error[seen]).all())
    # A job whose every rank is gone is judged only when some went badly (an exception, or
    # silence): one rank that leaves makes gloo end its peers' collectives with an error.
    dead_badly = bool(gone[seen].all() and (error | silent)[seen].any())
    holding = bool((~gone & seen).any() and (gone.any() or inside.any()))
    stalled = bool(
        np.isfinite(idle) and idle >= threshold and not finished and (holding or dead_badly)
    )
    if not stalled:
        culprits = ()
    return Hang(
        stalled=stalled,
        case=culprits[0].case if culprits else "",
        now_ns=int(now_ns),
        last_progress_ns=last,
        idle_s=float(idle),
        threshold_s=threshold,
        culprits=culprits,
        waiting=tuple(waiting),
        beating=int(seen.sum()),
    )


def waiting_where(waiting: list[Waiter], rank: int) -> str:
    """What ``rank`` is doing, from the waiting list."""
    return next((w.where for w in waiting if w.rank == rank), "unknown")
