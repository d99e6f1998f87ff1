"""How long this thread waited for a core: the kernel's run-queue delay.

A thread that runs less than its wall time either waited to run (runnable, queued behind
other work on its core, or held back by a CPU quota) or did not want to run (asleep in a
lock, a blocking call, a wait on the device). Its CPU clock cannot tell the two apart; the
scheduler's own account can: the second field of ``/proc/thread-self/schedstat`` is the
nanoseconds the thread spent runnable on a run queue without running (Linux, with
schedstats; `wait_ns` returns -1 where the file is absent or unreadable).

The thread read is the one that marks the steps. A step thread blocked on a starved
helper (a communication thread sharing a busy core) is asleep itself, so its delay is a
lower bound of what the machine took from the step: it tells a thread kept off its core
from one that chose to wait, and never makes a blocked thread look starved.

One ``pread`` of a descriptor kept open per thread (about a microsecond): the descriptor
reads the thread that opened it, so each thread opens its own, and a forked child opens
anew rather than read its parent's thread.
"""

from __future__ import annotations

import os
import threading

PATH = "/proc/thread-self/schedstat"


class _Handle:
    """One thread's open schedstat file (closed when the thread's state goes)."""

    __slots__ = ("fd", "pid")

    def __init__(self) -> None:
        self.pid = os.getpid()
        try:
            self.fd = os.open(PATH, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            self.fd = -1

    def __del__(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1


_local = threading.local()


def wait_ns() -> int:
    """This thread's run-queue delay since it started, in ns (-1: not available here)."""
    h: _Handle | None = getattr(_local, "handle", None)
    if h is None or h.pid != os.getpid():
        h = _local.handle = _Handle()
    if h.fd < 0:
        return -1
    try:
        return int(os.pread(h.fd, 96, 0).split()[1])
    except (OSError, IndexError, ValueError):
        return -1
