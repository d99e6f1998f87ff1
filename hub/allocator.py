"""Heap settings for a process that runs the hub's matching passes.

Every pass allocates and frees a few dozen numpy temporaries of a few MB (one float per
pending row each). With glibc's defaults, arrays that size are mapped fresh from the kernel
(or the freed top of the heap is given back), so each pass faults every page of every
temporary in again: on a virtual machine that is a third of the pass. Keeping freed memory
in the heap for reuse removes it; the price is that the process holds on to up to
``TRIM_BYTES`` of freed memory after a burst instead of returning it.

Only glibc has these knobs; elsewhere (musl, macOS) `keep_freed_memory` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger("rankscope.hub")

MMAP_BYTES = 32 << 20
"""Allocations below this come from the heap (glibc's default adapts up to the same bound,
but only after it has seen such a block freed)."""
TRIM_BYTES = 256 << 20
"""Freed memory at the top of the heap is returned to the kernel beyond this."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_lock = threading.Lock()
_done: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the settings once per process (later calls return the first outcome).

    Returns:
        True when the C library took them.
    """
    global _done
    with _lock:
        if _done is None:
            _done = _apply()
        return _done


def _apply() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        if not hasattr(libc, "gnu_get_libc_version"):  # these knobs are glibc's
            return False
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES)
    )
    if not ok:
        log.debug("mallopt refused the hub's heap settings")
    return ok
