"""Waiting for something a test has set going (a hub, a sender, a subprocess)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(cond: Callable[[], bool], timeout: float = 30.0, every: float = 0.02) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` seconds pass; its last value.

    A wait, not a timing assertion: it returns as soon as ``cond`` holds, so a generous
    timeout costs a passing test nothing and leaves room for a loaded machine.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return cond()
