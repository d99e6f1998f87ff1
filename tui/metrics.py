"""What the heatmap can colour, and how ranks are grouped: pure numpy over a `Window`.

Each metric is one ``(rank, step)`` array in display units, with a direction: for most of
them high is bad (a long step, a late arrival); for the SM clock low is bad (a throttled
GPU). Grouping dimensions map every rank to a code and a printable name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from rankscope.diagnosis.window import Window
from rankscope.tui.settings import GROUP_BY

NS_PER_MS = 1e6


@dataclass(frozen=True)
class MetricSpec:
    """How one heatmap metric is read and shown."""

    name: str
    """Key, one of ``settings.METRICS``."""
    label: str
    """Words shown in the legend and the header."""
    unit: str
    """Display unit."""
    higher_is_worse: bool
    """Direction of trouble: a group row shows its maximum when True, its minimum else."""


METRIC_SPECS: dict[str, MetricSpec] = {
    s.name: s
    for s in (
        MetricSpec("step", "step time", "ms", True),
        MetricSpec("compute", "local compute", "ms", True),
        MetricSpec("lateness", "arrival lateness", "ms/call", True),
        MetricSpec("wait", "arrival wait", "ms", True),
        MetricSpec("transfer", "exposed comm", "ms", True),
        MetricSpec("input", "input gap", "ms", True),
        MetricSpec("sm_clock", "SM clock", "MHz", False),
        MetricSpec("power", "power", "W", True),
        MetricSpec("temperature", "temperature", "°C", True),
    )
}


def metric_values(window: Window, name: str) -> np.ndarray:
    """The ``(R, S)`` values of one metric in display units; NaN where unknown.

    ``compute``, ``wait`` and ``transfer`` are the decomposition's ``compute``,
    ``arrival_wait`` and ``exposed_comm`` (``rankscope.diagnosis.decomposition``): the part
    of the step each took, so they never exceed the step time (raw sums over a step's
    collectives count overlapping DDP buckets once each) and the heatmap and the
    decomposition panel never disagree. ``lateness`` is the mean over the step's
    collectives of how long after the first rank this rank entered (the ranking's "late
    ms"): a sum would grow with the number of collectives, not with how late the rank is.

    Args:
        window: the window.
        name: a key of ``METRIC_SPECS``.

    Returns:
        float64 (R, S).

    Raises:
        KeyError: for an unknown metric name.
    """
    if name not in METRIC_SPECS:
        raise KeyError(f"unknown metric {name!r}; expected one of {tuple(METRIC_SPECS)}")
    shape = window.present.shape
    # ``step_ns`` and a decomposition made here are new arrays: scaled in place.
    if name == "step":
        out = window.step_ns
        out /= NS_PER_MS
    elif name in ("compute", "wait", "transfer"):
        from rankscope.diagnosis.decomposition import decompose

        category = {"compute": "compute", "wait": "arrival_wait", "transfer": "exposed_comm"}
        cat = category[name]
        out = decompose(window, only=(cat,)).category(cat)
        out /= NS_PER_MS
    elif name == "lateness":
        n = window.coll["n"]
        out = n * NS_PER_MS
        with np.errstate(all="ignore"):
            np.divide(window.coll["late_ns"], out, out=out)
        uncalled = ~(n > 0)
        if uncalled.any():
            out[uncalled] = np.nan
    elif name == "input":
        arr = window.phase_ns.get("input")
        out = np.full(shape, np.nan) if arr is None else arr / NS_PER_MS
    else:
        key = {"sm_clock": "sm_clock_mhz", "power": "power_w", "temperature": "temp_c"}[name]
        out = np.array(window.device[key], dtype=np.float64, copy=True)
    # Every branch made a new array: masked in place (at 65,536 ranks a copy is a frame's
    # millisecond).
    out = np.asarray(out, dtype=np.float64)
    out[~window.present] = np.nan
    return out


@dataclass(frozen=True)
class Dimension:
    """Every rank's group along one dimension."""

    name: str
    """Key, one of ``settings.GROUP_BY``."""
    codes: np.ndarray
    """int64 (R,) group code of each rank; -1 unknown."""
    names: tuple[str, ...]
    """Printable name of each code."""

    def name_of(self, code: int) -> str:
        """The printable name of a group code (``<dimension> ?`` when unknown)."""
        return self.names[code] if 0 <= code < len(self.names) else f"{self.name} ?"

    @property
    def reported(self) -> bool:
        """Whether any rank has a known value (a run without context parallelism reports
        no ``cp`` coordinate, and grouping by it would put every rank in one unknown row)."""
        return bool((self.codes >= 0).any())


def dimension(window: Window, name: str) -> Dimension:
    """Group codes of every rank along ``name``.

    Args:
        window: the window.
        name: ``host``, ``rack``, ``rail``, ``gpu``, ``shard`` or a mesh dimension.

    Returns:
        The dimension; ranks with an unknown value share the code -1.

    Raises:
        KeyError: for an unknown dimension.
    """
    info = window.ranks
    if name == "host":
        return Dimension(name, info.host.astype(np.int64), tuple(info.hosts))
    if name == "rack":
        return Dimension(name, info.rack.astype(np.int64), tuple(info.racks))
    plain = {"rail": info.rail, "gpu": info.gpu_index, "shard": info.shard}
    if name in plain:
        raw = plain[name]
    elif name in info.mesh:
        raw = info.mesh[name]
    elif name in ("dp", "tp", "pp", "cp", "ep"):
        raw = np.full(info.world_size, -1)
    else:
        raise KeyError(f"unknown dimension {name!r}")
    raw = np.asarray(raw, dtype=np.int64)
    top = int(raw.max()) + 1 if raw.size else 0
    return Dimension(name, np.where(raw >= 0, raw, -1), tuple(f"{name} {i}" for i in range(top)))


_RANGE = re.compile(r"^r?(\d+)\s*(?:-|\.\.)\s*r?(\d+)$")
_RANK = re.compile(r"^r?(\d+)$")


def filter_mask(window: Window, text: str) -> np.ndarray:
    """Which ranks a filter keeps.

    The filter is a comma-separated list of terms; a rank is kept when any term matches:
    ``12`` or ``r12`` (that rank), ``8-15`` (a range, inclusive), or any other text matched
    case-insensitively against the host and rack names. Empty keeps every rank.

    Args:
        window: the window (for host and rack names).
        text: the filter.

    Returns:
        bool (R,).
    """
    n = window.world_size
    terms = [t.strip() for t in text.split(",") if t.strip()]
    if not terms:
        return np.ones(n, dtype=bool)
    keep = np.zeros(n, dtype=bool)
    ranks = np.arange(n)
    info = window.ranks
    for term in terms:
        if m := _RANGE.match(term):
            lo, hi = sorted((int(m.group(1)), int(m.group(2))))
            keep |= (ranks >= lo) & (ranks <= hi)
        elif m := _RANK.match(term):
            keep |= ranks == int(m.group(1))
        else:
            low = term.lower()
            for codes, names in ((info.host, info.hosts), (info.rack, info.racks)):
                hit = np.array([low in s.lower() for s in names] + [False], dtype=bool)
                keep |= hit[np.where(codes >= 0, codes, len(names))]
    return keep


def finite_sum_count(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Sum and number of the finite values of a 2-D float array along ``axis``.

    Summed in order along the axis (``einsum``, a few times faster than ``sum`` over a
    window's short step axis at 65,536 ranks): a line whose sum is not finite holds a NaN
    or an infinity (a finite line's sum overflows to infinity at worst), and only those
    lines are summed and counted again over their finite values.

    Returns:
        float64 sums and int64 counts, one per line.
    """
    rows = axis in (1, -1)
    total = np.einsum("ij->i" if rows else "ij->j", x)
    counts = np.full(total.shape[0], x.shape[1 if rows else 0], np.int64)
    bad = np.flatnonzero(~np.isfinite(total))
    if bad.size:
        # Every row of a C-ordered array (a metric no rank reports): the array itself, not
        # a copy of it laid out the same way (a copy of columns is laid out otherwise,
        # which changes the order of the sums).
        every = rows and bad.size == total.shape[0] and x.flags.c_contiguous
        sub = x if every else x[bad] if rows else x[:, bad]
        finite = np.isfinite(sub)
        counts[bad] = np.count_nonzero(finite, axis=axis)
        total[bad] = np.sum(sub, axis=axis, where=finite)
    return total, counts


def finite_sum(x: np.ndarray, axis: int) -> np.ndarray:
    """Sum of the finite values along ``axis`` (``np.nansum`` without its full copy)."""
    x = np.asarray(x)
    if x.ndim == 2 and x.dtype.kind == "f":
        return finite_sum_count(x, axis)[0]
    finite = np.isfinite(x)
    if finite.all():
        return x.sum(axis=axis)
    return np.sum(x, axis=axis, where=finite)


def finite_mean(x: np.ndarray) -> np.ndarray:
    """Per row of a 2-D float array, the mean of its finite values (NaN where none)."""
    total, counts = finite_sum_count(x, 1)
    with np.errstate(all="ignore"):
        return np.where(counts > 0, total / np.maximum(counts, 1), np.nan)


def busy_mean(window: Window) -> np.ndarray:
    """Mean busy time of each rank over the window: step time minus arrival wait and
    pipeline idle (``diagnosis.critical.busy_ns``), in ns; NaN for a rank with no step.

    Args:
        window: the window.

    Returns:
        float64 (R,).
    """
    from rankscope.diagnosis.critical import BUSY_CATEGORIES, busy_ns
    from rankscope.diagnosis.decomposition import decompose

    # NaN where the rank did not report (the decomposition's step time is). The
    # decomposition is made for this alone: the busy time is written over its step time.
    decomp = decompose(window, only=BUSY_CATEGORIES)
    return finite_mean(busy_ns(window, decomp, out=decomp.step_ns))


def slowest_ranks(window: Window, k: int, candidates: np.ndarray | None = None) -> list[int]:
    """The ``k`` ranks with the largest mean busy time over the window.

    Busy time is the step time minus arrival wait and pipeline idle (``diagnosis.critical
    .busy_ns``): in a synchronous job every rank's step lasts as long as the slowest one's,
    so the step time alone cannot tell the straggler from the ranks waiting for it.

    Args:
        window: the window.
        k: how many.
        candidates: bool (R,) ranks to choose from (default all).

    Returns:
        Ranks, slowest first (ties: lower rank first).
    """
    mean = np.nan_to_num(busy_mean(window), nan=-np.inf)
    if candidates is not None:
        mean = np.where(candidates, mean, -np.inf)
    order = np.lexsort((np.arange(mean.size), -mean))
    return [int(r) for r in order[:k] if np.isfinite(mean[r])]


def busy_excess(window: Window, ranks: list[int]) -> list[float]:
    """How much longer each rank is busy than the median rank (0.05 = 5 % longer).

    Args:
        window: the window.
        ranks: global ranks.

    Returns:
        One fraction per rank (NaN when the median is unknown or zero).
    """
    busy = busy_mean(window)
    finite = busy[np.isfinite(busy)]
    median = float(np.median(finite)) if finite.size else float("nan")
    if not median > 0:
        return [float("nan")] * len(ranks)
    return [float(busy[r] / median - 1) for r in ranks]


def next_dimension(window: Window | None, current: str) -> str:
    """The grouping dimension after ``current`` that the run reports (any, without a
    window yet).

    Args:
        window: the window, or None.
        current: a ``settings.GROUP_BY`` name.

    Returns:
        The next name in ``GROUP_BY`` order (``current`` when no other is reported).
    """
    start = GROUP_BY.index(current) if current in GROUP_BY else -1
    for i in range(1, len(GROUP_BY) + 1):
        name = GROUP_BY[(start + i) % len(GROUP_BY)]
        if window is None or dimension(window, name).reported:
            return name
    return current
