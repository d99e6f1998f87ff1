"""Device and host sampling at about 1 Hz.

Host figures come straight from ``/proc`` (no psutil): CPU busy % of the whole host (a
rank starved by a noisy neighbour shows here, not in its own usage), the 1-minute load and
this process's RSS. Device figures come from NVML when this rank has a GPU and NVML works;
otherwise those columns are NaN. Samples wait in a small bounded buffer until the
collector's sender thread ships them. Inside a ``Monitor`` that same thread takes the
samples on its wake-ups (one thread fewer to wake); ``Sampler.start`` gives a sampler
its own thread for use elsewhere.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from rankscope.collector import nvml
from rankscope.collector.schema import SAMPLE_COLUMNS

MAX_PENDING = 600
"""Samples kept while nothing ships them (ten minutes at 1 Hz); older ones are dropped."""

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def read_cpu_times(path: str = "/proc/stat") -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from ``/proc/stat``, or None when unreadable."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 5 or fields[0] != "cpu":
        return None
    try:
        vals = [int(v) for v in fields[1:]]
    except ValueError:
        return None
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    # guest time is already counted in user/nice
    total = sum(vals[:8])
    return total - idle, total


def read_load1(path: str = "/proc/loadavg") -> float:
    """1-minute load average, NaN when unreadable."""
    try:
        with open(path) as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return math.nan


def read_rss_bytes(path: str = "/proc/self/statm") -> int:
    """Resident set size of this process in bytes, -1 when unreadable."""
    try:
        with open(path) as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return -1


class Sampler:
    """Background sampler of one rank's GPU (optional) and its host.

    Attributes:
        dropped: samples discarded because nothing shipped them in time.
    """

    def __init__(
        self,
        gpu_index: int | None,
        *,
        interval_s: float = 1.0,
        clock: Callable[[], int] = time.monotonic_ns,
        on_error: Callable[[str, BaseException], None] | None = None,
    ) -> None:
        """Prepare (the thread starts with ``start``).

        Args:
            gpu_index: physical GPU index to sample through NVML, or None for host only.
            interval_s: seconds between samples.
            clock: local monotonic clock (sample times are converted to the hub clock when
                they are shipped).
            on_error: called with a reason and the exception when a sample fails.
        """
        self.interval_s = max(0.05, float(interval_s))
        self._clock = clock
        self._on_error = on_error
        self._gpu_index = gpu_index
        self._handle: Any = None
        self._rows: deque[tuple[Any, ...]] = deque(maxlen=MAX_PENDING)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cpu_prev = read_cpu_times()
        self.dropped = 0
        self.cpu_s = 0.0
        """CPU seconds the sampling thread has used."""

    def start(self) -> None:
        """Start the daemon sampling thread."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="rankscope-sampler", daemon=True
            )
            self._thread.start()

    def sample_once(self) -> None:
        """Take one sample now and queue it."""
        t = self._clock()
        if self._gpu_index is not None and self._handle is None:
            self._handle = nvml.handle(self._gpu_index)
        dev = nvml.sample(self._handle)
        cpu = read_cpu_times()
        pct = math.nan
        if cpu is not None and self._cpu_prev is not None:
            busy, total = cpu[0] - self._cpu_prev[0], cpu[1] - self._cpu_prev[1]
            if total > 0:
                pct = 100.0 * busy / total
        self._cpu_prev = cpu
        row = (t, *dev, pct, read_load1(), read_rss_bytes())
        with self._lock:
            if len(self._rows) == self._rows.maxlen:
                self.dropped += 1
            self._rows.append(row)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample_once()
                self.cpu_s = time.thread_time()
            except Exception as exc:  # a sampler failure must not end sampling
                if self._on_error is not None:
                    self._on_error("sampler", exc)

    @property
    def pending(self) -> int:
        """Samples waiting to be drained."""
        return len(self._rows)

    def drain(self) -> dict[str, np.ndarray] | None:
        """Take every queued sample as ``SAMPLE_COLUMNS`` arrays (local clock in ``t``).

        Returns:
            The columns, or None when nothing is queued.
        """
        with self._lock:
            rows = list(self._rows)
            self._rows.clear()
        if not rows:
            return None
        cols = list(zip(*rows))
        return {
            name: np.asarray(cols[i], dtype=dt)
            for i, (name, dt) in enumerate(SAMPLE_COLUMNS.items())
        }

    def stop(self) -> None:
        """Stop the thread (waits at most one interval)."""
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None:
            t.join(timeout=self.interval_s + 1.0)
