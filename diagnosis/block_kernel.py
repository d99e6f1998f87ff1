"""The usual block in one compiled pass: `match_block` and `block_sums` reading each time once.

Nearly every block the hub's matching pass meets is *usual*: every row blocking and
host-timed, every exit known and not before its instance's last entry, rows in ascending
rank order. For such a block :func:`usual_block` returns what
:func:`rankscope.diagnosis.blocks.match_block` and :func:`~rankscope.diagnosis.blocks.block_sums`
return, to the bit (the tests hold the two equal on random blocks), from one pass over the
entry and exit columns instead of one numpy pass per reduction. The definitions stay those
of `diagnosis.blocks`; this module only computes them faster, and returns None for anything
else, for which the caller takes the numpy path.

The pass is compiled with numba. Compiling takes about a second, so it never happens on a
caller's thread: :func:`warm` compiles in the background (the hub starts it), and until it
has finished (or where numba cannot compile at all) :func:`usual_block` returns None.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from rankscope.collector.schema import NO_TIME
from rankscope.diagnosis.blocks import BlockMatch

log = logging.getLogger("rankscope.diagnosis")

_EXACT = float(2**53)
"""Sums below this are exact in float64 (as `blocks.block_sums` requires for its shortcut)."""

NETWORK_MAX = 128
"""Instances of up to this many members take their median from a sorting network run across
a tile of instances at once (vectorised); larger ones sort each instance's values."""

_TILE_VALUES = 16_384
"""Values of one tile's transfer buffer (128 KiB): it stays in the core's cache."""

_kernel: Callable[..., bool] | None = None
_state = {"started": False}
_lock = threading.Lock()


def _pass(
    enter: np.ndarray,
    exit_: np.ndarray,
    t0: int,
    starts: np.ndarray,
    net_a: np.ndarray,
    net_b: np.ndarray,
    tile: int,
    first: np.ndarray,
    last: np.ndarray,
    last_row: np.ndarray,
    margin: np.ndarray,
    transfer: np.ndarray,
    s_enter: np.ndarray,
    s_exit: np.ndarray,
    n_last: np.ndarray,
    s_first: np.ndarray,
    s_last: np.ndarray,
    top: np.ndarray,
) -> bool:  # pragma: no cover - compiled by numba; the same code runs uncompiled in tests
    """The pass (compiled). Columns go by tiles of ``tile`` instances, so that each read of
    a row is contiguous. Returns False, with the outputs partly written, when an exit is
    unknown or before its instance's last entry."""
    c, k = enter.shape
    nr = starts.shape[0]
    lo = np.empty(tile, np.int64)
    hi = np.empty(tile, np.int64)
    second = np.empty(tile, np.int64)
    hrow = np.empty(tile, np.int64)
    run = np.empty(tile, np.int64)
    seg = np.empty(tile + 1, np.int64)
    buf = np.empty(c * tile)
    col = np.empty(c)
    r = -1
    nxt = 0
    low = -(2**62)
    top[0] = low
    for j0 in range(0, k, tile):
        w = min(tile, k - j0)
        # Segments of the tile that belong to one run of columns.
        nseg = 0
        for j in range(w):
            if nxt < nr and j0 + j == starts[nxt]:
                r = nxt
                nxt += 1
                seg[nseg] = j
                nseg += 1
            elif j == 0:
                seg[nseg] = 0
                nseg += 1
            run[j] = r
        seg[nseg] = w
        for j in range(w):
            e = enter[0, j0 + j]
            lo[j] = e
            hi[j] = e
            hrow[j] = 0
            second[j] = low
        # Latest entry, its first row (rows ascend by rank: the lowest rank) and the latest
        # entry of the other rows (a tie gives a zero margin); branch-free, so it vectorises.
        for i in range(1, c):
            for j in range(w):
                e = enter[i, j0 + j]
                h = hi[j]
                lo[j] = min(lo[j], e)
                second[j] = max(second[j], min(h, e))
                hrow[j] = i if e > h else hrow[j]
                hi[j] = max(h, e)
        bad = False
        for i in range(c):
            for j in range(w):
                x = exit_[i, j0 + j]
                bad |= (x < hi[j]) | (x == NO_TIME)  # before the last entry, or unknown
                buf[i * tile + j] = float(x - t0) - float(hi[j] - t0)
                top[0] = max(top[0], x - t0)
            for q in range(nseg):
                se = 0
                sx = 0
                for j in range(seg[q], seg[q + 1]):
                    se += enter[i, j0 + j] - t0
                    sx += exit_[i, j0 + j] - t0
                s_enter[i, run[seg[q]]] += se
                s_exit[i, run[seg[q]]] += sx
        if bad:
            return False
        if c <= NETWORK_MAX:
            for q in range(net_a.shape[0]):
                a = net_a[q] * tile
                b = net_b[q] * tile
                # Two slices: numba then sees the rows apart, and vectorises the loop.
                ra = buf[a : a + w]
                rb = buf[b : b + w]
                for j in range(w):
                    x0 = ra[j]
                    y0 = rb[j]
                    ra[j] = min(x0, y0)
                    rb[j] = max(x0, y0)
            m0 = (c - 1) // 2 * tile
            m1 = c // 2 * tile
            for j in range(w):
                transfer[j0 + j] = 0.5 * (buf[m0 + j] + buf[m1 + j])
        else:
            for j in range(w):
                for i in range(c):
                    col[i] = buf[i * tile + j]
                col.sort()
                transfer[j0 + j] = 0.5 * (col[(c - 1) // 2] + col[c // 2])
        for j in range(w):
            la = float(hi[j] - t0)
            first[j0 + j] = float(lo[j] - t0)
            last[j0 + j] = la
            last_row[j0 + j] = hrow[j]
            margin[j0 + j] = la - float(second[j] - t0) if c > 1 else np.nan
            n_last[hrow[j], run[j]] += 1
            s_first[run[j]] += lo[j] - t0
            s_last[run[j]] += hi[j] - t0
    return True


@functools.lru_cache(maxsize=64)
def network(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Batcher's odd-even merge sorting network for ``n`` values: comparator ``q`` puts the
    smaller of positions ``a[q] < b[q]`` first. Built for the next power of two and cut to
    ``n`` (the missing positions act as +inf, so their comparators do nothing).

    Args:
        n: number of values, ≥ 1.

    Returns:
        int64 arrays ``a``, ``b``.
    """
    size = 1
    while size < n:
        size *= 2
    a: list[int] = []
    b: list[int] = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    lo, hi = i + j, i + j + k
                    if lo // (2 * p) == hi // (2 * p) and hi < n:
                        a.append(lo)
                        b.append(hi)
            k //= 2
        p *= 2
    return np.array(a, np.int64), np.array(b, np.int64)


def _compile() -> None:
    global _kernel
    try:
        import numba
    except ImportError:  # the numpy path serves
        log.info("numba is not installed: the matching pass runs on numpy alone")
        return
    try:
        try:
            jit = numba.njit(cache=True, nogil=True, boundscheck=False)
            kernel = jit(_pass)
        except RuntimeError:  # no writable cache location: compile for this process only
            kernel = numba.njit(nogil=True, boundscheck=False)(_pass)
        # Compile for the types every call uses, on a block small enough to be instant.
        enter = np.zeros((2, 2), np.int64)
        _call(kernel, enter, enter + 1, 0, np.zeros(1, np.int64))
    except Exception as exc:  # a compiler problem must not stop the hub
        log.warning("could not compile the matching kernel (%r): the numpy path serves", exc)
        return
    _kernel = kernel


def warm(background: bool = True) -> None:
    """Compile the kernel once per process (later calls do nothing).

    Args:
        background: compile on another thread and return at once; False waits for it.
    """
    with _lock:
        started = _state["started"]
        _state["started"] = True
    if started:
        return
    if background:
        # Not a daemon: a process that ends while LLVM compiles waits for it rather than
        # finalise the interpreter under a thread that is inside native code.
        threading.Thread(target=_compile, name="rankscope-compile").start()
    else:
        _compile()


def ready() -> bool:
    """Whether :func:`usual_block` computes (the kernel is compiled)."""
    return _kernel is not None


def _call(
    kernel: Callable[..., bool],
    enter: np.ndarray,
    exit_: np.ndarray,
    t0: int,
    starts: np.ndarray,
) -> tuple[bool, dict[str, Any]]:
    c, k = enter.shape
    nr = starts.shape[0]
    net_a, net_b = network(c) if c <= NETWORK_MAX else (np.zeros(0, np.int64),) * 2
    out: dict[str, Any] = {
        "first": np.empty(k),
        "last": np.empty(k),
        "last_row": np.empty(k, np.int64),
        "margin": np.empty(k),
        "transfer": np.empty(k),
        "s_enter": np.zeros((c, nr), np.int64),
        "s_exit": np.zeros((c, nr), np.int64),
        "n_last": np.zeros((c, nr), np.int64),
        "s_first": np.zeros(nr, np.int64),
        "s_last": np.zeros(nr, np.int64),
        "top": np.zeros(1, np.int64),
    }
    tile = max(8, min(512, _TILE_VALUES // c))
    ok = kernel(enter, exit_, np.int64(t0), starts, net_a, net_b, tile, *out.values())
    return bool(ok), out


def usual_block(
    enter: np.ndarray,
    exit_: np.ndarray,
    t0: int,
    starts: np.ndarray,
    ranks: np.ndarray,
    kernel: Callable[..., bool] | None = None,
) -> tuple[BlockMatch, dict[str, np.ndarray]] | None:
    """`match_block` and `block_sums` of a complete block of blocking, host-timed rows.

    Args:
        enter, exit_: int64 (c, k) C-contiguous entry and exit times on the hub clock (every
            entry known; an exit may be ``NO_TIME``, which makes the block unusual).
        t0: the origin the relative times are taken from.
        starts: int64 first column of each run of columns summed together (ascending, from 0).
        ranks: int64 (c,) rank of each row, ascending.
        kernel: the pass to run (tests pass the uncompiled one); default the compiled one.

    Returns:
        ``(BlockMatch, sums)`` as `match_block` and `block_sums` (with the match) give them;
        None when the block is not usual, the sums could be inexact in float64, or the
        kernel is not compiled yet.
    """
    run = kernel or _kernel
    c, k = enter.shape
    if (
        run is None
        or c == 0
        or k == 0
        or enter.dtype != np.int64
        or exit_.dtype != np.int64
        or not (enter.flags.c_contiguous and exit_.flags.c_contiguous)
    ):
        return None
    ok, o = _call(run, enter, exit_, t0, starts.astype(np.int64, copy=False))
    if not ok or max(-float(o["first"].min()), float(o["top"][0])) * k >= _EXACT:
        return None
    m = BlockMatch(
        first=o["first"],
        last=o["last"],
        last_row=o["last_row"],
        last_rank=ranks[o["last_row"]].astype(np.int64),
        margin=o["margin"],
        transfer=o["transfer"],
        device_transfer=np.full(k, np.nan),
        exits_after_last=True,
    )
    s_enter = o["s_enter"].astype(np.float64)
    s_exit = o["s_exit"].astype(np.float64)
    s_last = o["s_last"].astype(np.float64)
    wait = s_last - s_enter
    transfer = s_exit - s_last
    sums = {
        "coll_ns": s_exit - s_enter,
        "wait_ns": wait,
        "transfer_ns": transfer,
        "late_ns": s_enter - o["s_first"].astype(np.float64),
        "times_last": o["n_last"].astype(np.float64),
        "exposed_wait_ns": wait,
        "exposed_transfer_ns": transfer,
    }
    return m, sums
