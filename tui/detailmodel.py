"""One rank against the median rank: the rank-detail screen's data (pure numpy)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rankscope.collector.schema import OPS
from rankscope.diagnosis.window import Window
from rankscope.tui.metrics import NS_PER_MS, finite_sum

SERIES = (
    ("step", "step time", "ms"),
    ("compute", "local compute", "ms"),
    ("wait", "arrival wait", "ms"),
    ("transfer", "exposed comm", "ms"),
    ("lateness", "lateness", "ms/call"),
    ("input", "input gap", "ms"),
)
"""Series compared over time: metric key, label, unit."""

SAMPLES = (
    ("sm_clock_mhz", "SM clock", "MHz", 1.0),
    ("mem_clock_mhz", "memory clock", "MHz", 1.0),
    ("power_w", "power", "W", 1.0),
    ("temp_c", "temperature", "°C", 1.0),
    ("gpu_util", "GPU util", "%", 1.0),
    ("cpu_pct", "host CPU", "%", 1.0),
    ("load1", "load 1m", "", 1.0),
    ("rss_bytes", "RSS", "GiB", 1.0 / 2**30),
)
"""Device and host samples shown: column, label, unit, factor."""

WORK = (
    ("tokens", "tokens"),
    ("valid_tokens", "valid tokens"),
    ("samples", "samples"),
    ("attn_cost", "Σseq²"),
    ("flops", "FLOPs"),
)


@dataclass(frozen=True)
class Compare:
    """One quantity of the rank against the median rank."""

    label: str
    unit: str
    rank: float
    median: float

    @property
    def ratio(self) -> float:
        """rank / median (NaN when the median is 0 or unknown)."""
        if not (math.isfinite(self.rank) and math.isfinite(self.median)) or self.median == 0:
            return math.nan
        return self.rank / self.median


@dataclass(frozen=True)
class Series:
    """A per-step series of the rank and of the median rank."""

    label: str
    unit: str
    rank: np.ndarray = field(repr=False)
    median: np.ndarray = field(repr=False)


@dataclass(frozen=True)
class CollRow:
    """Collectives of one op and group called by the rank over the window."""

    group: str
    op: str
    calls: int
    steps: int
    """Steps the raw rows cover (the store keeps them for its last few steps only)."""
    bytes_per_call: float
    wait_ms: float
    """Mean arrival wait per call."""
    transfer_ms: float
    """Mean post-arrival time per call."""


@dataclass(frozen=True)
class RankDetail:
    """Everything the rank-detail screen shows."""

    rank: int
    host: str
    identity: dict[str, str]
    steps: np.ndarray = field(repr=False)
    series: tuple[Series, ...]
    phases: tuple[Compare, ...]
    """Mean ms per step in each phase."""
    collectives: tuple[Compare, ...]
    """Calls and times last per step; arrival wait, transfer and lateness per call (a sum
    over a step's calls counts overlapping DDP buckets once each and can exceed the
    step)."""
    coll_rows: tuple[CollRow, ...]
    """Per (group, op) from the raw rows the store kept (empty when none)."""
    samples: tuple[Compare, ...]
    work: tuple[Compare, ...]
    """Mean work per step."""
    reduced_calls: float = 0.0
    """Mean calls a step of the rank that its node's relay matched (`Window.reduced`):
    counted in ``collectives``, their rows not at the hub (the relay's raw ring has them)."""


def _median_rank(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        ok = np.isfinite(x).any(axis=0)
        out = np.full(x.shape[1], np.nan)
        if ok.any():
            out[ok] = np.nanmedian(x[:, ok], axis=0)
    return out


def _mean(x: np.ndarray) -> float:
    finite = x[np.isfinite(x)]
    return float(finite.mean()) if finite.size else math.nan


def _compare(label: str, unit: str, values: np.ndarray, rank: int, factor: float) -> Compare:
    return Compare(label, unit, _mean(values[rank]) * factor, _mean(_median_rank(values)) * factor)


def rank_detail(window: Window, rank: int) -> RankDetail:
    """The rank against the median rank over the window.

    Args:
        window: the window.
        rank: a global rank of the window.

    Returns:
        The detail.

    Raises:
        IndexError: when ``rank`` is outside the window's world.
    """
    from rankscope.tui.metrics import metric_values

    if not 0 <= rank < window.world_size:
        raise IndexError(f"rank {rank} outside world size {window.world_size}")
    info = window.ranks
    host_code = int(info.host[rank])
    host = info.hosts[host_code] if 0 <= host_code < len(info.hosts) else "?"
    rack_code = int(info.rack[rank])
    identity = {
        "host": host,
        "rack": info.racks[rack_code] if 0 <= rack_code < len(info.racks) else "?",
        "local rank": str(int(info.local_rank[rank])),
        "GPU": str(int(info.gpu_index[rank])),
        "rail": str(int(info.rail[rank])),
        "shard": str(int(info.shard[rank])),
        "mesh": " ".join(f"{d}={int(v[rank])}" for d, v in info.mesh.items() if v[rank] >= 0),
        "incarnation": str(int(info.incarnation[rank])),
    }
    if window.clock_error_ns is not None and np.isfinite(window.clock_error_ns[rank]):
        identity["clock ±"] = f"{window.clock_error_ns[rank] / NS_PER_MS:.3f} ms"
    present = window.present
    series = []
    for key, label, unit in SERIES:
        vals = metric_values(window, key)
        series.append(Series(label, unit, vals[rank].copy(), _median_rank(vals)))
    phases = []
    for name, arr in window.phase_ns.items():
        vals = np.where(present, arr, np.nan)
        phases.append(_compare(name, "ms", vals, rank, 1 / NS_PER_MS))
    coll = []
    calls = np.where(present, window.coll["n"], np.nan)
    for key, label, unit, per_call in (
        ("n", "calls", "", False),
        ("wait_ns", "wait / call", "ms", True),
        ("transfer_ns", "transfer / call", "ms", True),
        ("late_ns", "lateness / call", "ms", True),
        ("times_last", "times last", "", False),
    ):
        vals = np.where(present, window.coll[key], np.nan)
        if per_call:
            # Each rank's total over the window divided by its calls (each call weighs the
            # same), against the median rank's.
            with np.errstate(all="ignore"):
                n = finite_sum(calls, 1)
                each = np.where(n > 0, finite_sum(vals, 1) / np.maximum(n, 1), np.nan)
                med = float(np.nanmedian(each)) if np.isfinite(each).any() else math.nan
            coll.append(Compare(label, unit, each[rank] / NS_PER_MS, med / NS_PER_MS))
        else:
            coll.append(_compare(label, unit, vals, rank, 1.0))
    samples = [
        _compare(label, unit, np.where(present, window.device[col], np.nan), rank, factor)
        for col, label, unit, factor in SAMPLES
    ]
    work = [
        _compare(label, "", np.where(present, window.work[col], np.nan), rank, 1.0)
        for col, label in WORK
    ]
    return RankDetail(
        rank=rank,
        host=host,
        identity=identity,
        steps=window.steps.copy(),
        series=tuple(series),
        phases=tuple(phases),
        collectives=tuple(coll),
        coll_rows=_coll_rows(window, rank),
        samples=tuple(s for s in samples if math.isfinite(s.rank) or math.isfinite(s.median)),
        work=tuple(w for w in work if math.isfinite(w.rank) or math.isfinite(w.median)),
        reduced_calls=_reduced_calls(window, rank),
    )


def _reduced_calls(window: Window, rank: int) -> float:
    n = window.reduced.get("n")
    if n is None:
        return 0.0
    mean = _mean(np.where(window.present[rank], n[rank], np.nan))
    return mean if math.isfinite(mean) else 0.0


def _coll_rows(window: Window, rank: int) -> tuple[CollRow, ...]:
    rows = window.rows
    if rows is None or len(rows) == 0:
        return ()
    mine = rows.rank == rank
    if not mine.any():
        return ()
    inst = window.instances
    g = rows.group[mine].astype(np.int64)
    keys = g * (1 << 40) + rows.seq[mine].astype(np.int64)
    # The last entry of each instance splits each call into wait and transfer.
    last = np.full(keys.size, np.nan)
    if len(inst):
        inst_keys = inst.group.astype(np.int64) * (1 << 40) + inst.seq.astype(np.int64)
        order = np.argsort(inst_keys, kind="stable")
        pos = np.clip(np.searchsorted(inst_keys[order], keys), 0, order.size - 1)
        hit = inst_keys[order][pos] == keys
        last[hit] = inst.last[order][pos][hit]
    enter = rows.t_enter[mine]
    exit_ = rows.t_exit[mine]
    wait = np.clip(last - enter, 0, None)
    transfer = exit_ - np.maximum(enter, np.where(np.isfinite(last), last, enter))
    op = rows.op[mine].astype(np.int64)
    n_steps = int(np.unique(rows.step[mine]).size)
    out = []
    pair = g * 64 + op
    for p in np.unique(pair).tolist():
        sel = pair == p
        gid, o = p // 64, p % 64
        ginfo = window.groups.get(int(gid))
        out.append(
            CollRow(
                group=ginfo.name if ginfo is not None else f"g{gid}",
                op=OPS[o] if 0 <= o < len(OPS) else "?",
                calls=int(sel.sum()),
                steps=n_steps,
                bytes_per_call=float(np.mean(rows.nbytes[mine][sel])),
                wait_ms=_mean(wait[sel]) / NS_PER_MS,
                transfer_ms=_mean(transfer[sel]) / NS_PER_MS,
            )
        )
    out.sort(key=lambda r: -(r.wait_ms if math.isfinite(r.wait_ms) else 0.0))
    return tuple(out)
