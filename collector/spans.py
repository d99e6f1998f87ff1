"""Context managers returned by ``Monitor.step``, ``Monitor.phase`` and
``Monitor.collective``: small slotted objects, so a ``with`` costs two clock reads and
one ring row (a phase two more: the thread CPU clock at both ends)."""

from __future__ import annotations

import time
from time import thread_time_ns
from typing import TYPE_CHECKING

from rankscope.collector import schema

if TYPE_CHECKING:
    from rankscope.collector.monitor import Monitor


class PhaseSpan:
    """Context manager of one phase span."""

    __slots__ = ("c0", "idx", "mon", "t0")

    def __init__(self, mon: Monitor, idx: int) -> None:
        self.mon = mon
        self.idx = idx
        self.t0 = 0
        self.c0 = 0

    def __enter__(self) -> PhaseSpan:
        self.t0 = time.monotonic_ns()
        self.c0 = thread_time_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        # A ``with`` block enters and exits on one thread: the CPU clock difference is the
        # thread's CPU time inside the span.
        c = thread_time_ns() - self.c0
        self.mon._rec_phase(self.idx, self.t0, time.monotonic_ns(), c)


class CollectiveSpan:
    """Context manager timing one manually marked collective."""

    __slots__ = ("gid", "mon", "nbytes", "op", "t0")

    def __init__(self, mon: Monitor, op: int, gid: int, nbytes: int) -> None:
        self.mon, self.op, self.gid, self.nbytes = mon, op, gid, nbytes
        self.t0 = 0

    def __enter__(self) -> CollectiveSpan:
        self.t0 = time.monotonic_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        self.mon._rec_coll(
            self.op, self.gid, self.nbytes, self.t0, time.monotonic_ns(), schema.FLAG_MANUAL
        )


class StepSpan:
    """Context manager around one step."""

    __slots__ = ("mon", "step")

    def __init__(self, mon: Monitor, step: int | None) -> None:
        self.mon, self.step = mon, step

    def __enter__(self) -> Monitor:
        self.mon.begin_step(self.step)
        return self.mon

    def __exit__(self, *exc: object) -> None:
        self.mon.end_step()
