"""Python GC pauses, seen through ``gc.callbacks``: one clock per process.

A collection stops every Python thread (it holds the GIL), so a pause on any thread is a
pause of the training loop. The callback runs on every collection, in whichever thread
triggered it, so it does the least it can: a clock read at ``start``, a clock read and two
additions at ``stop``. Monitors read the running totals at a step's start and end; the
difference is the step's ``gc_ns`` and ``gc_count`` (a collection is counted in the step
in which it ends). The clock is ``time.monotonic_ns``, the one the step marks use.

The callback is registered once per process, however many monitors use it, and removed
when the last of them closes (`acquire` / `release`). It never raises: gc reports an
exception from a callback as unraisable, but it would still be noise in the job's log.
"""

from __future__ import annotations

import gc
import threading
import time

_mono = time.monotonic_ns


class GcClock:
    """Running totals of GC pauses in this process.

    Attributes:
        ns: Σ wall ns of finished collections since the clock was made.
        count: finished collections.
        errors: callback calls that failed (counted, never raised).
        users: monitors holding the callback registered.
    """

    __slots__ = ("_lock", "_t0", "count", "errors", "ns", "users")

    def __init__(self) -> None:
        self.ns = 0
        self.count = 0
        self.errors = 0
        self.users = 0
        self._t0 = 0
        self._lock = threading.Lock()

    def __call__(self, phase: str, _info: dict) -> None:
        try:
            if phase == "start":
                self._t0 = _mono()
            elif self._t0:
                self.ns += _mono() - self._t0
                self.count += 1
                self._t0 = 0
        except Exception:
            self.errors += 1

    @property
    def registered(self) -> bool:
        """Whether the callback is in ``gc.callbacks`` (a program may clear the list)."""
        return any(cb is self for cb in gc.callbacks)

    def acquire(self) -> bool:
        """Register the callback for one more monitor.

        Returns:
            Whether the callback is registered (False where ``gc.callbacks`` cannot be used).
        """
        with self._lock:
            try:
                if not self.registered:
                    gc.callbacks.append(self)
                self.users += 1
                return True
            except Exception:
                self.errors += 1
                return False

    def release(self) -> None:
        """One monitor is done; the last one removes the callback."""
        with self._lock:
            self.users = max(0, self.users - 1)
            if self.users:
                return
            try:
                while self.registered:
                    gc.callbacks.remove(self)
            except Exception:
                self.errors += 1


CLOCK = GcClock()
"""The process's GC clock."""
