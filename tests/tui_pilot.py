"""Waiting in Pilot tests until the TUI has built what a test reads."""

from __future__ import annotations

from typing import Any


async def settle(app: Any, pilot: Any, *, analysis: bool = False, tries: int = 500) -> None:
    """Pause until the main model (and, with ``analysis``, the first diagnosis) exists and
    no worker is running.

    Raises:
        AssertionError: still not there after ``tries`` pauses of 20 ms.
    """
    for _ in range(tries):
        await pilot.pause(0.02)
        ready = app.model is not None and (not analysis or app.analysis is not None)
        if ready and not any(w.is_running for w in app.workers):
            return
    raise AssertionError("the TUI did not settle")
