"""Device-side collective times from CUDA events, resolved lazily, never synchronizing.

Around a collective on CUDA tensors the torch wrapper records one event on the current
stream before the call (the device reaches the collective: its arrival) and one after it
(the current stream has waited for the collective: its completion). The events are queried
from the collector's background thread a few steps later; until an event has completed the
row stays pending and nothing waits for it.

Converting an event to a host time needs an anchor whose host time is known. An event
recorded on an idle side stream executes at once, so the host time of its ``record`` call
is its device time up to the launch latency (microseconds). Anchors are renewed every few
seconds: ``elapsed_time`` is single precision, which loses microseconds over long spans.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from rankscope.collector import schema
from rankscope.collector.pump import FLAG_PENDING

ANCHOR_EVERY_NS = 5_000_000_000
EVENT_POOL = 4096
MAX_PENDING = 65536


class DeviceTimer:
    """Records event pairs around collectives and resolves them into ring rows.

    Attributes:
        resolved: rows that got device times.
        abandoned: rows whose events could not be resolved (pending queue full, errors).
    """

    def __init__(self, monitor: Any, torch: Any) -> None:
        self.mon = monitor
        self.torch = torch
        self._pool: list[Any] = []
        self._pending: deque[tuple[int, int, Any, Any]] = deque()
        self._anchor: tuple[Any, int] | None = None
        self._anchor_next: tuple[Any, int] | None = None
        self._anchor_t = 0
        self._side_stream: Any = None
        self.resolved = 0
        self.abandoned = 0

    def event(self) -> Any:
        """A timing event recorded now on the current stream."""
        ev = self._pool.pop() if self._pool else self.torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _maybe_anchor(self) -> None:
        now = time.monotonic_ns()
        if self._anchor_next is None and now - self._anchor_t >= ANCHOR_EVERY_NS:
            cuda = self.torch.cuda
            if self._side_stream is None:
                self._side_stream = cuda.Stream()
            ev = cuda.Event(enable_timing=True)
            with cuda.stream(self._side_stream):
                h0 = time.monotonic_ns()
                ev.record()
                h1 = time.monotonic_ns()
            self._anchor_next = (ev, (h0 + h1) // 2)
            self._anchor_t = now

    def track(self, row: int, start: Any, end: Any) -> None:
        """Queue a row whose device times come from ``start``/``end`` events.

        The row must have been written with ``FLAG_PENDING``.
        """
        if len(self._pending) >= MAX_PENDING:
            self.abandoned += 1
            self._release(row)
            return
        self._maybe_anchor()
        self._pending.append((row, time.monotonic_ns(), start, end))

    def _release(self, row: int) -> None:
        self.mon._colls.update(row, {}, clear_bits=FLAG_PENDING)

    def resolve(self) -> None:
        """Fill device times of completed events (background thread; never blocks)."""
        nxt = self._anchor_next
        if nxt is not None and nxt[0].query():
            self._anchor, self._anchor_next = nxt, None
        anchor = self._anchor
        ring = self.mon._colls
        while self._pending:
            row, _, start, end = self._pending[0]
            if anchor is None or not end.query():
                break
            self._pending.popleft()
            if row < ring.tail:
                self.abandoned += 1
                continue
            try:
                a_ev, a_host = anchor
                t_start = a_host + int(a_ev.elapsed_time(start) * 1e6)
                t_end = a_host + int(a_ev.elapsed_time(end) * 1e6)
            except Exception:
                self.abandoned += 1
                self._release(row)
                continue
            ring.update(
                row,
                {"t_start": t_start, "t_end": t_end},
                set_bits=schema.FLAG_DEVICE_TIMED,
                clear_bits=FLAG_PENDING,
            )
            self.resolved += 1
            if len(self._pool) < EVENT_POOL:
                self._pool.extend((start, end))
