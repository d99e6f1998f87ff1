"""Correlation with structure (ARCHITECTURE §6, seed: "Correlate with structure").

For a per-rank metric, the effect size of every placement dimension — host, rack, rail,
NIC, GPU index, each mesh coordinate, data shard — as ε² of a one-way ANOVA (η² corrected
for the number of groups, so 512 hosts of noise score ~0, not 0.125), and the group that
stands out. For collectives, the same over process groups, the rail and host a group runs
on, and the message-size bucket. Over steps, the effect of time since start.

The two questions that separate data from hardware — does the slowest rank stay or move,
does compute follow the work (tokens, Σseq²) — are answered in `straggler` and collected
here. Per-rank metrics are taken relative to the same step's median rank, so a slow step
for everyone does not look like a slow rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.collector.schema import MESH_DIMS
from rankscope.diagnosis.critical import CriticalPath
from rankscope.diagnosis.curves import bucket_label
from rankscope.diagnosis.decomposition import Decomposition
from rankscope.diagnosis.grouprows import GroupSkew
from rankscope.diagnosis.robust import EffectSize, effect_size, nanmedian
from rankscope.diagnosis.straggler import (
    DATA_WORK,
    SlowRankPattern,
    WorkCorrelation,
    relative_to_step,
    slow_rank_pattern,
    work_correlation,
    work_model,
)
from rankscope.diagnosis.window import GroupInfo, Window

RANK_METRICS = ("compute", "input", "lateness", "transfer", "memory")
"""Per-rank metrics whose structure is tested."""

TIME_SEGMENTS = 8
"""Steps are cut into this many consecutive segments for the time-since-start effect."""


@dataclass(frozen=True)
class DimensionEffect:
    """Effect size of one dimension on one metric, with the group that stands out."""

    metric: str
    dimension: str
    epsilon2: float
    eta2: float
    n_groups: int
    standout: str
    """Label of the standout group (host name, ``rail 3``, ``tp=2``...)."""
    standout_code: int
    standout_z: float
    standout_value: float
    """Mean metric of the standout group (relative to the step median for rank metrics)."""
    others_value: float


@dataclass(frozen=True)
class Correlations:
    """Everything the structure analysis found."""

    effects: tuple[DimensionEffect, ...]
    slow_rank: SlowRankPattern
    work: WorkCorrelation
    relative: dict[str, np.ndarray]
    """Per-rank metric -> float64 (R,) value whose structure was tested."""

    def for_metric(self, metric: str) -> list[DimensionEffect]:
        """Effects of one metric, strongest first."""
        rows = [e for e in self.effects if e.metric == metric]
        return sorted(rows, key=lambda e: -e.epsilon2)

    def best(self, metric: str) -> DimensionEffect | None:
        """The dimension that explains the most of ``metric`` (None when not computed)."""
        rows = self.for_metric(metric)
        return rows[0] if rows else None


def _rank_dimensions(window: Window) -> dict[str, tuple[np.ndarray, list[str]]]:
    ri = window.ranks
    dims: dict[str, tuple[np.ndarray, list[str]]] = {
        "host": (ri.host, list(ri.hosts)),
        "rack": (ri.rack, list(ri.racks)),
        "rail": (ri.rail, []),
        "nic": (ri.nic, list(ri.nics)),
        "gpu_index": (ri.gpu_index, []),
        "shard": (ri.shard, []),
    }
    for d in MESH_DIMS:
        if d in ri.mesh:
            dims[d] = (ri.mesh[d], [])
    return dims


def _label(dimension: str, code: int, names: list[str]) -> str:
    if 0 <= code < len(names):
        return names[code]
    if dimension in MESH_DIMS or dimension in ("shard", "gpu_index", "rail"):
        return f"{dimension}={code}"
    return f"{dimension} {code}"


def _effect_row(
    metric: str, dimension: str, values: np.ndarray, codes: np.ndarray, names: list[str]
) -> DimensionEffect | None:
    codes = np.asarray(codes, dtype=np.int64)
    known = (codes >= 0) & np.isfinite(values)
    n_groups = np.unique(codes[known]).size
    # With about one value per group (a shard per rank) every grouping "explains" all.
    if known.sum() < 3 or n_groups < 2 or known.sum() < 2 * n_groups:
        return None
    e: EffectSize = effect_size(values, codes)
    if e.n_groups < 2:
        return None
    return DimensionEffect(
        metric=metric,
        dimension=dimension,
        epsilon2=e.epsilon2,
        eta2=e.eta2,
        n_groups=e.n_groups,
        standout=_label(dimension, e.standout, names),
        standout_code=e.standout,
        standout_z=e.standout_z,
        standout_value=e.standout_mean,
        others_value=e.others_median,
    )


def rank_metrics(
    window: Window, decomp: Decomposition, rel_compute: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Per-rank value of each ``RANK_METRICS`` entry, relative to the step's median rank
    and then the median over steps.

    Args:
        window: the window.
        decomp: its decomposition.
        rel_compute: ``relative_to_step`` of compute if already computed.

    Returns:
        Metric -> float64 (R,) (NaN where never measured).
    """
    n = window.coll["n"]
    with np.errstate(invalid="ignore", divide="ignore"):
        late = np.where(n > 0, window.coll["late_ns"] / n, np.nan)
        transfer = np.where(n > 0, window.coll["transfer_ns"] / n, np.nan)
    step = nanmedian(decomp.step_ns, axis=0)
    if rel_compute is None:
        rel_compute = relative_to_step(decomp.category("compute"))

    def share(x: np.ndarray) -> np.ndarray:
        # Phases that are zero for most ranks have a zero median: use the step time.
        with np.errstate(invalid="ignore", divide="ignore"):
            return nanmedian(np.where(step > 0, x / step, np.nan), axis=1)

    return {
        "compute": nanmedian(rel_compute, axis=1),
        "input": share(decomp.category("input")),
        "lateness": share(late),
        "transfer": nanmedian(relative_to_step(transfer), axis=1),
        "memory": share(decomp.category("memory")),
    }


def group_attributes(
    window: Window, groups: dict[int, GroupInfo] | None = None
) -> dict[str, dict[int, int]]:
    """Per group id, the rail and host it runs on (-1 when mixed or unknown).

    A cross-host group whose members all sit on one rail runs over that rail; an intra-host
    group runs on its host's fabric.

    Args:
        window: the window (for the rank table).
        groups: group table (default: the window's).

    Returns:
        ``{"rail": {gid: rail}, "host": {gid: host}, "crosses": {gid: 0/1}}``.
    """
    groups = window.groups if groups is None else groups
    rail = window.ranks.rail
    host = window.ranks.host
    out: dict[str, dict[int, int]] = {"rail": {}, "host": {}, "crosses": {}}
    for gid, g in groups.items():
        members = np.asarray([r for r in g.ranks if 0 <= r < window.world_size], dtype=np.int64)
        if members.size == 0:
            continue
        rails = np.unique(rail[members])
        hosts = np.unique(host[members])
        out["rail"][gid] = int(rails[0]) if rails.size == 1 and rails[0] >= 0 else -1
        out["host"][gid] = int(hosts[0]) if hosts.size == 1 and hosts[0] >= 0 else -1
        out["crosses"][gid] = int(g.crosses_hosts)
    return out


def group_transfer_effects(
    window: Window, skew: GroupSkew, baseline_ratio: np.ndarray | None = None
) -> list[DimensionEffect]:
    """Effects on collective transfer over process group, rail, host and size bucket.

    The metric per (group, op, bucket) row is its median transfer divided by the median of
    its peers — rows with the same op, size bucket, group size and host-crossing — or, when
    ``baseline_ratio`` is given, its ratio to the baseline run's same row.

    Args:
        window: the window.
        skew: `critical.group_skew` table.
        baseline_ratio: optional float (rows,) transfer / baseline transfer.

    Returns:
        Effect rows for ``process_group``, ``group_rail``, ``group_host`` and, with a
        baseline, ``size_bucket``.
    """
    if len(skew) < 3:
        return []
    attrs = group_attributes(window)
    gid = skew.group.astype(np.int64)
    members = np.array([len(window.groups[g].ranks) if g in window.groups else 0 for g in gid])
    crosses = np.array([attrs["crosses"].get(int(g), -1) for g in gid])
    if baseline_ratio is not None:
        metric = np.asarray(baseline_ratio, dtype=np.float64)
        name = "transfer_vs_baseline"
    else:
        cls = np.stack([skew.op.astype(np.int64), skew.bucket, members, crosses], axis=1)
        _, inv = np.unique(cls, axis=0, return_inverse=True)
        inv = inv.ravel()
        metric = np.full(len(skew), np.nan)
        for k in range(int(inv.max()) + 1):
            sel = inv == k
            med = (
                np.nanmedian(skew.transfer_p50[sel])
                if np.isfinite(skew.transfer_p50[sel]).any()
                else np.nan
            )
            if med > 0:
                metric[sel] = skew.transfer_p50[sel] / med
        name = "transfer_vs_peers"
    log_metric = np.log(np.where(metric > 0, metric, np.nan))
    rows = []
    rails = np.array([attrs["rail"].get(int(g), -1) for g in gid])
    hosts = np.array([attrs["host"].get(int(g), -1) for g in gid])
    gnames = {int(g): window.groups[g].name for g in window.groups}
    for dim, codes, names in (
        ("process_group", gid, None),
        ("group_rail", np.where(crosses == 1, rails, -1), []),
        ("group_host", np.where(crosses == 0, hosts, -1), list(window.ranks.hosts)),
    ):
        row = _effect_row(name, dim, log_metric, codes, names or [])
        if row is not None and dim == "process_group":
            row = _relabel(row, gnames.get(row.standout_code, f"group {row.standout_code}"))
        if row is not None:
            rows.append(_exp_values(row))
    if baseline_ratio is not None:
        row = _effect_row(name, "size_bucket", log_metric, skew.bucket.astype(np.int64), [])
        if row is not None:
            rows.append(_exp_values(_relabel(row, bucket_label(row.standout_code))))
    return rows


def _relabel(row: DimensionEffect, label: str) -> DimensionEffect:
    return DimensionEffect(**{**row.__dict__, "standout": label})


def _exp_values(row: DimensionEffect) -> DimensionEffect:
    # The test runs on log ratios (symmetric for slower/faster); report plain ratios.
    return DimensionEffect(
        **{
            **row.__dict__,
            "standout_value": float(np.exp(row.standout_value)),
            "others_value": float(np.exp(row.others_value)),
        }
    )


def time_effect(window: Window, decomp: Decomposition) -> DimensionEffect | None:
    """Effect of time since start on the step time: ε² over consecutive step segments.

    Args:
        window: the window.
        decomp: its decomposition.

    Returns:
        The effect row (metric ``step_time``, dimension ``time_since_start``), or None with
        fewer than two segments' worth of steps.
    """
    step = nanmedian(decomp.step_ns, axis=0)
    n = step.shape[0]
    if n < 2 * TIME_SEGMENTS:
        return None
    seg = (np.arange(n) * TIME_SEGMENTS // n).astype(np.int64)
    rel = step / np.nanmedian(step)
    row = _effect_row("step_time", "time_since_start", rel, seg, [])
    if row is None:
        return None
    first, last = int(window.steps[0]), int(window.steps[-1])
    lo = first + (last - first + 1) * row.standout_code // TIME_SEGMENTS
    hi = first + (last - first + 1) * (row.standout_code + 1) // TIME_SEGMENTS - 1
    return _relabel(row, f"steps {lo}-{hi}")


def correlate(
    window: Window,
    decomp: Decomposition,
    crit: CriticalPath,
    baseline_transfer_ratio: np.ndarray | None = None,
) -> Correlations:
    """Effect sizes per dimension, the slow-rank pattern and compute against work.

    Args:
        window: the window.
        decomp: its decomposition.
        crit: its critical path (for the per-group skew/transfer table).
        baseline_transfer_ratio: optional per ``crit.groups`` row transfer / baseline.

    Returns:
        The correlations.
    """
    rel_compute = relative_to_step(decomp.category("compute"))
    metrics = rank_metrics(window, decomp, rel_compute)
    effects: list[DimensionEffect] = []
    for metric, values in metrics.items():
        if not np.isfinite(values).any() or np.nanmax(values) == np.nanmin(values):
            continue
        for dim, (codes, names) in _rank_dimensions(window).items():
            row = _effect_row(metric, dim, values, codes, names)
            if row is not None:
                effects.append(row)
    effects += group_transfer_effects(window, crit.groups, baseline_transfer_ratio)
    t = time_effect(window, decomp)
    if t is not None:
        effects.append(t)
    # What the rank's own work predicts (routed tokens included) decides whether a rank
    # is slower than its work; what the data alone predicts is the data's imbalance
    # (routing is judged as expert imbalance).
    data_pred, r2 = work_model(window, decomp, DATA_WORK)
    routed = window.work.get("expert_tokens")
    if routed is not None and bool((routed >= 0).any()):
        pred, _ = work_model(window, decomp)
    else:
        pred = data_pred
    return Correlations(
        effects=tuple(effects),
        slow_rank=slow_rank_pattern(window, decomp, pred, rel_compute),
        work=work_correlation(window, decomp, data_pred, r2),
        relative=metrics,
    )
