"""The main screen's data, computed from a sample in the sampling thread.

Everything here is numpy and frozen dataclasses: the widgets only format what they get.
The diagnosis (verdict, structure, decomposition) runs on its own slower clock and is not
part of this model (see ``analysis``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rankscope.collector.schema import OPS
from rankscope.diagnosis.regime import current_regime
from rankscope.diagnosis.window import Window
from rankscope.tui.heatgrid import HeatGrid, build_grid
from rankscope.tui.metrics import (
    METRIC_SPECS,
    NS_PER_MS,
    busy_mean,
    dimension,
    filter_mask,
    finite_sum,
    finite_sum_count,
    metric_values,
)
from rankscope.tui.sources import RunEntry, Sample

UP = {"host": "rack"}
"""The level a grouping's rows roll up to above ``view.group_rows_max`` groups."""


@dataclass(frozen=True)
class ViewState:
    """The user's view choices that shape the model (the app keeps them in reactives)."""

    metric: str = "lateness"
    group_by: str = "host"
    pins: tuple[int, ...] = ()
    filter: str = ""
    zoom: int | None = None
    zoom_up: int | None = None
    rank_rows_max: int = 64
    group_rows_max: int = 256
    last_arrivals: int = 6


@dataclass(frozen=True)
class StepStats:
    """Job step time over the window: per step the median over ranks (ranks of a
    synchronous job finish together, the median ignores one rank's boundary jitter; above
    `MEDIAN_RANKS` ranks, over an even spread of that many), then percentiles over the
    steps. Milliseconds."""

    p50: float
    p90: float
    max: float
    steps: int
    series: np.ndarray = field(repr=False)
    """float64 (S,) per-step job step time (ms)."""


@dataclass(frozen=True)
class HeaderModel:
    """What the header shows."""

    job: str
    run: str
    scope: str
    world_size: int
    hosts: int
    step: int
    """Latest step in the window (-1 when none)."""
    stats: StepStats | None
    baseline_run: str | None
    baseline: StepStats | None
    tokens_per_s: float | None
    """Valid tokens per second over the window (None when the run does not report them)."""
    health: dict[str, Any]
    clock_error_ms: float | None
    """Largest clock-alignment uncertainty among ranks."""


@dataclass(frozen=True)
class Arrival:
    """The most recent complete instance of one process group."""

    group: str
    op: str
    seq: int
    step: int
    last_rank: int
    last_host: str
    margin_ms: float
    """How much later the last arriver came than the runner-up."""
    skew_ms: float
    """Last entry minus first entry."""


@dataclass(frozen=True)
class LastRank:
    """One rank in the ranking of last arrivers."""

    rank: int
    host: str
    times_last: int
    late_ms: float
    """Mean lateness per collective (entry minus the first entry)."""


@dataclass(frozen=True)
class MainModel:
    """Everything the main screen draws from one sample."""

    header: HeaderModel | None
    grid: HeatGrid | None
    arrivals: tuple[Arrival, ...]
    ranking: tuple[LastRank, ...]
    runs: tuple[RunEntry, ...]
    window: Window | None = field(repr=False)
    view: ViewState = field(default_factory=ViewState)
    message: str = ""
    """Why there is nothing to show (waiting for data, an error)."""
    regime_step: int | None = None
    """First step of the current regime when the step time, or a rank's arrivals, shifted
    inside the window (`diagnosis.regime.current_regime`): the ranking counts only the
    steps since."""


MEDIAN_RANKS = 1024
"""Most ranks whose median makes a step's job step time."""


def step_stats(window: Window) -> StepStats | None:
    """Job step-time percentiles over the window (see `StepStats`).

    Args:
        window: the window.

    Returns:
        The statistics, or None when no step is complete.
    """
    n = window.world_size
    # Ranks of a synchronous job finish a step together, so the median of an even spread
    # of ranks is the median of all of them; it keeps the header cheap at 16k ranks.
    ranks = np.unique(np.linspace(0, n - 1, min(n, MEDIAN_RANKS)).astype(np.int64))
    step = np.where(window.present[ranks], window.t_end[ranks] - window.t_start[ranks], np.nan)
    ok = np.isfinite(step).any(axis=0)
    if not ok.any():
        return None
    with np.errstate(all="ignore"):
        per_step = np.full(step.shape[1], np.nan)
        per_step[ok] = np.nanmedian(step[:, ok], axis=0) / NS_PER_MS
    finite = per_step[np.isfinite(per_step)]
    p50, p90 = np.percentile(finite, [50, 90])
    return StepStats(float(p50), float(p90), float(finite.max()), int(finite.size), per_step)


def tokens_per_second(window: Window, stats: StepStats | None) -> float | None:
    """Valid tokens per second: valid tokens of all ranks over the window's job time.

    Args:
        window: the window.
        stats: its step statistics.

    Returns:
        Tokens per second, or None without ``valid_tokens`` or steps.
    """
    if stats is None:
        return None
    valid = window.work["valid_tokens"]
    if not window.present.all():
        valid = np.where(window.present, valid, np.nan)
    per_step, counts = finite_sum_count(valid, 0)
    reported = counts > 0
    if not reported.any():
        return None
    ok = np.isfinite(stats.series) & reported
    seconds = float(np.sum(stats.series[ok])) / 1e3
    return float(np.sum(per_step[ok])) / seconds if seconds > 0 else None


def latest_arrivals(window: Window, limit: int) -> tuple[Arrival, ...]:
    """Per process group, its most recent complete instance; the ``limit`` with the
    largest skew, largest first.

    Args:
        window: the window.
        limit: most rows returned.

    Returns:
        The rows.
    """
    inst = window.instances
    if len(inst) == 0:
        return ()
    ok = np.flatnonzero((inst.n_arrived >= inst.n_members) & (inst.n_members >= 2))
    if ok.size == 0:
        return ()
    order = ok[np.lexsort((inst.seq[ok], inst.group[ok]))]
    groups = inst.group[order]
    is_last = np.r_[groups[1:] != groups[:-1], True]
    latest = order[is_last]
    latest = latest[np.argsort(-np.nan_to_num(inst.skew[latest], nan=-1.0), kind="stable")]
    info = window.ranks
    out = []
    for i in latest[:limit].tolist():
        gid = int(inst.group[i])
        g = window.groups.get(gid)
        r = int(inst.last_rank[i])
        op = int(inst.op[i])
        host_code = int(info.host[r]) if 0 <= r < info.world_size else -1
        out.append(
            Arrival(
                group=g.name if g is not None else f"g{gid}",
                op=OPS[op] if 0 <= op < len(OPS) else "?",
                seq=int(inst.seq[i]),
                step=int(inst.step[i]),
                last_rank=r,
                last_host=info.hosts[host_code] if 0 <= host_code < len(info.hosts) else "?",
                margin_ms=float(inst.margin[i]) / NS_PER_MS,
                skew_ms=float(inst.skew[i]) / NS_PER_MS,
            )
        )
    return tuple(out)


def _top(first: np.ndarray, second: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` indices ranked highest by ``first``, then ``second``, then lowest index:
    what a full sort's first ``k`` would be, sorting only the few that can be among them
    (the whole world sorted took most of a frame's model at 65,536 ranks)."""
    n = first.size
    k = min(k, n)
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    cand = np.arange(n)
    if n > 4 * k:
        # The bar is the k-th largest. Partitioning a world of mostly equal values (ranks
        # never last) is slow, so the values above the lowest are partitioned alone.
        low = first.min()
        high = np.flatnonzero(first > low)
        if high.size >= k:
            bar = np.partition(first[high], high.size - k)[high.size - k]
            above = high[first[high] > bar]
            tied = high[first[high] == bar]
        else:
            bar, above = low, high
            tied = np.flatnonzero(first == low)
        need = k - above.size
        if tied.size > need:
            # Of the ties at the bar, those whose second key reaches the need-th largest.
            s = second[tied]
            tied = tied[s >= np.partition(s, s.size - need)[s.size - need]]
        cand = np.concatenate((above, tied))
    ranked = cand[np.lexsort((cand, -second[cand], -first[cand]))]
    return ranked[:k]


def last_ranking(window: Window, limit: int = 5, first_index: int = 0) -> tuple[LastRank, ...]:
    """Ranks that arrived last most often, then by mean lateness.

    Args:
        window: the window.
        limit: most rows returned.
        first_index: count only the steps from this column on (the current regime: a
            straggler that appeared a few steps ago tops the list at once instead of after
            it outnumbers the whole healthy history).

    Returns:
        The rows (ranks never last and never late are left out).
    """
    cols = slice(first_index, None)
    # Finite counts can still sum past float64 (a window built outside the hub's checks):
    # such a rank is last the most, not a crash of the view.
    big = np.finfo(np.float64).max
    times = np.minimum(finite_sum(window.coll["times_last"][:, cols], 1), big)
    n = finite_sum(window.coll["n"][:, cols], 1)
    late = np.minimum(finite_sum(window.coll["late_ns"][:, cols], 1), big)
    with np.errstate(all="ignore"):
        late_mean = np.where(n > 0, late / np.maximum(n, 1), 0.0)
    order = _top(times, late_mean, limit)
    info = window.ranks
    out = []
    for r in order.tolist():
        if times[r] <= 0 and late_mean[r] <= 0:
            break
        code = int(info.host[r])
        out.append(
            LastRank(
                rank=r,
                host=info.hosts[code] if 0 <= code < len(info.hosts) else "?",
                times_last=int(times[r]),
                late_ms=float(late_mean[r]) / NS_PER_MS,
            )
        )
    return tuple(out)


def header_model(
    window: Window,
    health: dict[str, Any],
    baseline: Window | None = None,
) -> HeaderModel:
    """The header's numbers.

    Args:
        window: the current window.
        health: the source's health counters.
        baseline: the baseline run's window, when one is chosen.

    Returns:
        The header model.
    """
    stats = step_stats(window)
    codes = window.ranks.host
    hosts = int(np.count_nonzero(np.bincount(codes[codes >= 0]))) if codes.size else 0
    err = window.clock_error_ns
    clock = (
        float(np.nanmax(err)) / NS_PER_MS if err is not None and np.isfinite(err).any() else None
    )
    return HeaderModel(
        job=window.job,
        run=window.run,
        scope=window.scope,
        world_size=window.world_size,
        hosts=hosts,
        step=int(window.steps[-1]) if window.steps.size else -1,
        stats=stats,
        baseline_run=baseline.run if baseline is not None else None,
        baseline=step_stats(baseline) if baseline is not None else None,
        tokens_per_s=tokens_per_second(window, stats),
        health=dict(health),
        clock_error_ms=clock,
    )


def build_main_model(
    sample: Sample,
    view: ViewState,
    baseline: Window | None = None,
) -> MainModel:
    """Compute the main screen's model from one sample and the view choices.

    Args:
        sample: the latest sample.
        view: metric, grouping, pins, filter and zoom.
        baseline: the baseline run's window, if chosen.

    Returns:
        The model (with ``message`` set and nothing else when there is no window).
    """
    w = sample.window
    if w is None:
        return MainModel(
            None, None, (), (), sample.runs, None, view, sample.error or "waiting for data"
        )
    regime = current_regime(w)
    spec = METRIC_SPECS[view.metric]
    values = metric_values(w, view.metric)
    grid = build_grid(
        values,
        w.steps,
        spec,
        dimension(w, view.group_by),
        pins=view.pins,
        keep=filter_mask(w, view.filter),
        zoom=view.zoom,
        rank_rows_max=view.rank_rows_max,
        blame=busy_mean(w) if view.metric == "step" else None,
        up=dimension(w, UP[view.group_by]) if view.group_by in UP else None,
        zoom_up=view.zoom_up,
        group_rows_max=view.group_rows_max,
    )
    return MainModel(
        header=header_model(w, sample.health, baseline),
        grid=grid,
        arrivals=latest_arrivals(w, view.last_arrivals),
        ranking=last_ranking(w, first_index=regime.start_index if regime else 0),
        runs=sample.runs,
        window=w,
        view=view,
        regime_step=regime.start_step if regime else None,
    )
