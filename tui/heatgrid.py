"""The heatmap's rows: ranks or groups of ranks × recent steps, with a colour scale.

Pure numpy, no drawing. Pinned ranks come first. Below them, each kept rank gets its own
row while there are few enough (``rank_rows_max``) or while zoomed into one group;
otherwise one row per group shows, per step, its worst rank (the maximum for a metric where
high is bad, the minimum for the SM clock) — synchronous training runs at the pace of its
slowest rank, so a group is as bad as its worst member, never its average.

Above ``group_rows_max`` groups, rows roll up one level (hosts into their racks: the
8,192 hosts of a 65,536-rank job in racks of 32 become 256 rack rows); zooming into a rolled-up
row (``zoom_up``) shows its groups again, and zooming into one of those its ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.tui.metrics import Dimension, MetricSpec, finite_mean

PIN, RANK, GROUP = 0, 1, 2
"""Row kinds."""

MIN_SPAN = 0.05
"""The colour scale spans at least this fraction of the median, so a healthy run's small
jitter stays in the cool colours instead of being stretched over the whole palette."""


@dataclass(frozen=True)
class HeatGrid:
    """Rows × steps of one metric, ready to colour."""

    spec: MetricSpec
    """The metric shown."""
    dimension: str
    """The grouping dimension."""
    values: np.ndarray
    """float64 (N, C) display values; NaN unknown."""
    steps: np.ndarray
    """int64 (C,) step of each column (oldest first)."""
    labels: tuple[str, ...]
    """Row labels."""
    kinds: np.ndarray
    """int8 (N,) ``PIN``, ``RANK`` or ``GROUP``."""
    rank: np.ndarray
    """int64 (N,) the rank a row shows (for a group: its worst rank over the window)."""
    group: np.ndarray
    """int64 (N,) the group code of the row (of its rank for pins and ranks)."""
    members: np.ndarray
    """int64 (N,) how many ranks stand behind a row."""
    lo: float
    """Value at the cool end of the scale."""
    hi: float
    """Value at the hot end of the scale (for a low-is-bad metric, ``lo`` is the hot end)."""
    zoom: int | None
    """Group code zoomed into, or None."""
    zoom_name: str
    """Printable name of the zoomed group ("" when not zoomed)."""
    hidden: int
    """Ranks the filter hides."""
    rolled_up: str = ""
    """The dimension the group rows stand for when they rolled up one level above
    ``dimension`` (``rack``), else ""."""
    zoom_up: int | None = None
    """Code of the rolled-up group zoomed into (its groups shown), or None."""
    zoom_up_name: str = ""
    """Printable name of that group ("" when none)."""

    def __len__(self) -> int:
        return int(self.values.shape[0])

    def levels(self, n: int) -> np.ndarray:
        """Quantize values to ``n`` colour levels, 0 = healthy, ``n-1`` = worst.

        Args:
            n: number of levels (palette size).

        Returns:
            int8 (N, C); -1 where the value is unknown.
        """
        span = self.hi - self.lo
        with np.errstate(invalid="ignore"):
            frac = (self.values - self.lo) / span if span > 0 else np.zeros_like(self.values)
            if not self.spec.higher_is_worse:
                frac = 1.0 - frac
            lvl = np.floor(np.clip(frac, 0.0, 1.0) * n)
        lvl = np.minimum(np.nan_to_num(lvl, nan=-1.0), n - 1)
        return lvl.astype(np.int8)


SCALE_SAMPLE = 65_536
"""Values the colour scale's percentiles are taken from (an even stride over the grid)."""


def _scale(values: np.ndarray, higher_is_worse: bool) -> tuple[float, float]:
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return 0.0, 1.0
    extreme = float(finite.max() if higher_is_worse else finite.min())
    if finite.size > SCALE_SAMPLE:
        # The soft end and the median only need to be about right; the hot end is exact.
        finite = finite[:: finite.size // SCALE_SAMPLE]
    # The hot end is the true extreme (a straggler must saturate, not be clipped away);
    # the cool end ignores the lowest 2% so one unusually quick step does not wash out
    # the rest of the picture.
    if higher_is_worse:
        lo, hi = float(np.percentile(finite, 2)), extreme
    else:
        lo, hi = extreme, float(np.percentile(finite, 98))
    floor = MIN_SPAN * abs(float(np.median(finite)))
    if hi - lo < floor:
        if higher_is_worse:
            hi = lo + floor
        else:
            lo = hi - floor
    if hi <= lo:
        hi = lo + 1.0
    return lo, hi


def _group_reduce(values: np.ndarray, starts: np.ndarray, ufunc: np.ufunc) -> np.ndarray:
    """Per group of consecutive rows (starting at ``starts``), the NaN-ignoring reduction
    over its rows. ``reduceat`` along rows is slow on a (ranks, steps) array, so groups are
    laid out as a (groups, members, steps) block when that costs at most twice the input
    (hosts of 8 GPUs, equal-sized mesh groups) and reduced along the members axis."""
    n, n_cols = values.shape
    counts = np.diff(np.r_[starts, n])
    k = int(counts.max())
    if counts.size * k > 2 * n:
        with np.errstate(invalid="ignore"):
            return ufunc.reduceat(values, starts, axis=0)
    if (counts == k).all():
        block = values.reshape(counts.size, k, n_cols)
    else:
        block = np.full((counts.size, k, n_cols), np.nan)
        member = np.arange(n) - np.repeat(starts, counts)
        block[np.repeat(np.arange(counts.size), counts), member] = values
    # Halving the members axis, one elementwise pass over half of what is left each time:
    # several times faster than ``reduce`` along a short middle axis.
    while block.shape[1] > 1:
        half = block.shape[1] // 2
        folded = ufunc(block[:, :half], block[:, half : 2 * half])
        if block.shape[1] % 2:
            ufunc(folded[:, 0], block[:, -1], out=folded[:, 0])
        block = folded
    return block[:, 0]


def build_grid(
    values: np.ndarray,
    steps: np.ndarray,
    spec: MetricSpec,
    dim: Dimension,
    *,
    pins: tuple[int, ...] = (),
    keep: np.ndarray | None = None,
    zoom: int | None = None,
    rank_rows_max: int = 64,
    blame: np.ndarray | None = None,
    up: Dimension | None = None,
    zoom_up: int | None = None,
    group_rows_max: int = 256,
) -> HeatGrid:
    """Arrange a metric's ``(R, S)`` values into heatmap rows.

    Args:
        values: float (R, S) metric values (see ``metrics.metric_values``).
        steps: int (S,) step ids.
        spec: the metric.
        dim: grouping of the ranks.
        pins: ranks shown first, in this order (out-of-range ranks are ignored).
        keep: bool (R,) ranks the filter keeps (default all); pins are always shown.
        zoom: show only the ranks of this group code, one row each.
        rank_rows_max: most ranks shown one row each before rows become groups.
        blame: float (R,) score naming each group's worst rank (highest wins); default
            the metric's mean over the window in its bad direction. The step time needs
            another score: in a synchronous job every rank's step is as long as the
            straggler's, so its busy time (``metrics.busy_mean``) names it.
        up: the level above ``dim`` (racks above hosts), or None.
        zoom_up: show only the ranks of this group code of ``up`` (as groups of ``dim``
            while they are more than ``rank_rows_max``).
        group_rows_max: most group rows before they roll up into ``up``'s groups.

    Returns:
        The grid; its colour scale spans the shown values.
    """
    values = np.asarray(values, dtype=np.float64)
    n_ranks = values.shape[0]
    keep = np.ones(n_ranks, dtype=bool) if keep is None else np.asarray(keep, dtype=bool)
    hidden = int(n_ranks - keep.sum())
    if up is not None and zoom_up is not None:
        keep = keep & (up.codes == zoom_up)
    if zoom is not None:
        keep = keep & (dim.codes == zoom)
    pin_list = [p for p in dict.fromkeys(pins) if 0 <= p < n_ranks]
    rest = keep.copy()
    rest[pin_list] = False
    idx = np.flatnonzero(rest)
    codes = dim.codes
    rolled, gdim = "", dim  # gdim: what the group rows group by
    if (
        up is not None
        and zoom is None
        and zoom_up is None
        and idx.size > rank_rows_max
        and (up.codes[idx] >= 0).all()
        and np.count_nonzero(np.bincount(codes[idx] + 1)) > group_rows_max
    ):
        gdim, rolled = up, up.name

    labels: list[str] = []
    blocks: list[np.ndarray] = []
    kinds: list[np.ndarray] = []
    ranks: list[np.ndarray] = []
    groups: list[np.ndarray] = []
    members: list[np.ndarray] = []

    if pin_list:
        pa = np.asarray(pin_list, dtype=np.int64)
        blocks.append(values[pa])
        labels += [f"● r{p} {dim.name_of(int(codes[p]))}" for p in pin_list]
        kinds.append(np.full(pa.size, PIN, np.int8))
        ranks.append(pa)
        groups.append(codes[pa])
        members.append(np.ones(pa.size, np.int64))

    if idx.size and (zoom is not None or idx.size <= rank_rows_max):
        order = idx[np.lexsort((idx, codes[idx]))]
        blocks.append(values[order])
        labels += [f"r{r} {dim.name_of(int(codes[r]))}" for r in order.tolist()]
        kinds.append(np.full(order.size, RANK, np.int8))
        ranks.append(order.astype(np.int64))
        groups.append(codes[order])
        members.append(np.ones(order.size, np.int64))
    elif idx.size:
        gcodes_all = gdim.codes
        order = idx[np.argsort(gcodes_all[idx], kind="stable")]
        sorted_codes = gcodes_all[order]
        starts = np.flatnonzero(np.r_[True, sorted_codes[1:] != sorted_codes[:-1]])
        # Ranks laid out group by group (the usual host order) need no reordered copy.
        in_place = order.size == n_ranks and bool((order == np.arange(n_ranks)).all())
        sub = values if in_place else values[order]
        worst = _group_reduce(sub, starts, np.fmax if spec.higher_is_worse else np.fmin)
        if blame is not None:
            key = np.nan_to_num(np.asarray(blame, dtype=np.float64)[order], nan=-np.inf)
        else:
            # Worst rank of each group over the window: the largest (or smallest) mean.
            mean = finite_mean(sub)
            key = np.nan_to_num(mean if spec.higher_is_worse else -mean, nan=-np.inf)
        # Each group's worst rank: its largest key, the lowest rank of a tie (within a
        # group the ranks are in ascending order).
        counts = np.diff(np.r_[starts, order.size])
        top = np.repeat(np.maximum.reduceat(key, starts), counts)
        hits = np.flatnonzero(key == top)
        group_of_hit = np.searchsorted(starts, hits, side="right") - 1
        first_of_group = hits[np.r_[True, group_of_hit[1:] != group_of_hit[:-1]]]
        worst_rank = order[first_of_group]
        gcodes = sorted_codes[starts]
        blocks.append(worst)
        labels += [
            f"{gdim.name_of(int(g))} ×{c} r{w}"
            for g, c, w in zip(gcodes.tolist(), counts.tolist(), worst_rank.tolist())
        ]
        kinds.append(np.full(starts.size, GROUP, np.int8))
        ranks.append(worst_rank.astype(np.int64))
        groups.append(gcodes)
        members.append(counts.astype(np.int64))

    n_steps = values.shape[1]
    grid_values = np.concatenate(blocks) if blocks else np.empty((0, n_steps))
    lo, hi = _scale(grid_values, spec.higher_is_worse)

    def cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
        return np.concatenate(parts).astype(dtype) if parts else np.empty(0, dtype)

    return HeatGrid(
        spec=spec,
        dimension=dim.name,
        values=grid_values,
        steps=np.asarray(steps, dtype=np.int64),
        labels=tuple(labels),
        kinds=cat(kinds, np.int8),
        rank=cat(ranks, np.int64),
        group=cat(groups, np.int64),
        members=cat(members, np.int64),
        lo=lo,
        hi=hi,
        zoom=zoom,
        zoom_name=dim.name_of(zoom) if zoom is not None else "",
        hidden=hidden,
        rolled_up=rolled,
        zoom_up=zoom_up if up is not None else None,
        zoom_up_name=up.name_of(zoom_up) if up is not None and zoom_up is not None else "",
    )
