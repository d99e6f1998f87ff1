"""Semantic validation of decoded messages against what the hub already knows.

``collector.schema.decode`` checks the shape of one message; this module checks it makes
sense for the run it claims: the rank said hello (for this incarnation), belongs to the
run's world, tables refer to known phase names and carry entry times, steps are not
repeated. Each failure is a `Reject` with a stable ``reason`` tag the hub counts:

``unknown_rank``        data from a rank (or incarnation) that has not said hello
``rank_out_of_range``   a rank or group member outside the run's world size
``world_size_mismatch`` a hello whose world size differs from the run's
``run_mismatch``        a hello reusing a run id under another job
``stale_incarnation``   data from an incarnation older than the rank's latest hello
``bad_phase``           a phase code outside built-in plus message phase names
``bad_time``            a collective without entry time, or a span ending before it starts
``bad_stats``           a stats message whose ``stats`` is not a map
``duplicate_step``      (counted per step, the message is kept without them) a step this
                        rank already reported, or one repeated inside the message
``bad_host_value``      (counted per value by the store when it writes the step, the
                        message is kept) a host or MoE column value that cannot be: see
                        ``hub.runstate.host_value_bounds``.

Out-of-order steps are fine: the store places each step in its slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.collector import schema
from rankscope.hub.runstate import RunState
from rankscope.hub.store import Store


class Reject(Exception):
    """A message the hub will not ingest, with a stable ``reason`` and a human detail."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Verdict:
    """What to ingest of an accepted message."""

    keep_steps: np.ndarray | None = None
    """For steps messages: mask of step rows to keep."""
    duplicate_steps: int = 0
    """Step rows dropped as duplicates."""
    empty: bool = False
    """Nothing is left to ingest (every step was a duplicate)."""


_ACCEPT = Verdict()
"""The verdict of a message kept whole (shared: it is frozen)."""


def check(msg: schema.Message, store: Store) -> Verdict:
    """Validate ``msg`` against the store's state.

    Args:
        msg: a message decoded by ``schema.decode``.
        store: the live store (read only here).

    Returns:
        The `Verdict`.

    Raises:
        Reject: with the reason tag of the first problem found.
    """
    h = msg.header
    run = store.run_state(h["run"])
    rank, inc = h["rank"], h["inc"]
    if msg.kind == "hello":
        world = h["identity"]["world_size"]
        if run is not None:
            if run.job != h["job"]:
                raise Reject(
                    "run_mismatch", f"run {h['run']!r} belongs to job {run.job!r}, not {h['job']!r}"
                )
            if run.world_size != world:
                raise Reject(
                    "world_size_mismatch",
                    f"rank {rank} says world size {world}, run {h['run']!r} has {run.world_size}",
                )
            if inc < run.incarnation[rank]:
                latest = int(run.incarnation[rank])
                raise Reject(
                    "stale_incarnation",
                    f"hello of rank {rank} incarnation {inc} after incarnation {latest}",
                )
        return Verdict()
    if run is None:
        raise Reject(
            "unknown_rank",
            f"{msg.kind} from rank {rank} of run {h['run']!r}, which no rank has said hello to",
        )
    if rank >= run.world_size:
        raise Reject(
            "rank_out_of_range", f"rank {rank} in run {h['run']!r} of world size {run.world_size}"
        )
    known = int(run.incarnation[rank])
    if known < 0:
        raise Reject(
            "unknown_rank", f"{msg.kind} from rank {rank} of run {h['run']!r} before its hello"
        )
    if inc < known:
        raise Reject(
            "stale_incarnation", f"{msg.kind} from rank {rank} incarnation {inc}, latest is {known}"
        )
    if inc > known:
        raise Reject(
            "unknown_rank",
            f"{msg.kind} from rank {rank} incarnation {inc} before that incarnation's hello",
        )
    kind = msg.kind
    if kind == "steps":  # nearly every message
        return _check_steps(msg, run)
    if kind == "groups":
        for g in h["groups"]:
            bad = [r for r in g["ranks"] if not isinstance(r, int) or not 0 <= r < run.world_size]
            if bad:
                raise Reject(
                    "rank_out_of_range",
                    f"group {g['id']} lists ranks {bad[:5]} outside world size {run.world_size}",
                )
        return Verdict()
    if kind == "stats":
        if not isinstance(h.get("stats"), dict):
            raise Reject("bad_stats", "stats message without a stats map")
        return Verdict()
    if kind == "samples":
        return Verdict()
    return _check_steps(msg, run)


def _check_steps(msg: schema.Message, run: RunState) -> Verdict:
    h = msg.header
    names = h.get("phase_names") or []
    if names and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
        raise Reject("bad_phase", "phase_names must be a list of strings")
    ph = msg.tables.get("phases")
    if ph is not None and ph["phase"].shape[0]:
        top = len(schema.PHASES) + len(names)
        code = ph["phase"]
        if code.min() < 0 or code.max() >= top:
            raise Reject(
                "bad_phase",
                f"phase codes {int(code.min())}..{int(code.max())} outside 0..{top - 1}",
            )
        if (
            (ph["t1"] < ph["t0"]) & (ph["t0"] != schema.NO_TIME) & (ph["t1"] != schema.NO_TIME)
        ).any():
            raise Reject("bad_time", "a phase span ends before it starts")
    co = msg.tables.get("colls")
    if co is not None and co["t_enter"].shape[0]:
        t = co["t_enter"]
        if t.min() <= schema.NO_TIME and (t == schema.NO_TIME).any():
            n = int((t == schema.NO_TIME).sum())
            raise Reject("bad_time", f"{n} collective rows without t_enter")
    st = msg.tables["steps"]
    steps = st["step"]
    n = steps.shape[0]
    if n == 1:  # the usual message: one step, checked with Python scalars
        t_end = int(st["t_end"][0])
        if t_end < int(st["t_start"][0]) and t_end != schema.NO_TIME:
            raise Reject("bad_time", "a step ends before it starts")
        if not run.has_step(h["rank"], h["inc"], int(steps[0])):
            return _ACCEPT
        return Verdict(keep_steps=np.zeros(1, bool), duplicate_steps=1, empty=True)
    # Hub-clock times are positive: NO_TIME (-1) can only fail the test as the end.
    if ((st["t_end"] < st["t_start"]) & (st["t_end"] != schema.NO_TIME)).any():
        raise Reject("bad_time", "a step ends before it starts")
    keep = ~run.has_steps(h["rank"], h["inc"], steps)
    if n > 1:
        # Inside the message, the first row of a repeated step wins.
        order = np.argsort(steps, kind="stable")
        s = steps[order]
        repeat = np.zeros(n, bool)
        repeat[order[1:]] = s[1:] == s[:-1]
        keep &= ~repeat
    dup = int(n - keep.sum())
    return Verdict(
        keep_steps=keep if dup else None,
        duplicate_steps=dup,
        empty=dup > 0 and not keep.any(),
    )
