"""The instance table summarised per (process group, op, message-size bucket).

Arrival skew, transfer, message-size curves and slow-link findings all read the same rows,
so the instance table — ten million rows at 4,096 ranks with tensor parallelism — is keyed
once here. Only complete instances (every member arrived, two or more members) contribute.

Counts and maxima use every instance. Percentiles and mean sizes use every instance of a
row with up to ``SAMPLE_CAP`` of them, and an even deterministic stride of about
``SAMPLE_CAP`` otherwise (a row's p99 from 2,048 draws is within a fraction of a
percentile of the full one); per-step transfer bursts read the same sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.collector.schema import OPS
from rankscope.diagnosis.robust import dense_codes, group_quantiles
from rankscope.diagnosis.window import InstanceTable

SAMPLE_CAP = 2048
"""About how many instances per row percentiles are computed from (all of them below this)."""
_N_OPS = len(OPS) + 1
_N_BUCKETS = 66  # buckets -1..64, stored +1


def size_bucket(nbytes: np.ndarray) -> np.ndarray:
    """Power-of-two message-size bucket: ``floor(log2(nbytes))``, -1 for unknown/zero.

    Args:
        nbytes: (N,) bytes.

    Returns:
        int64 (N,) bucket.
    """
    f = np.asarray(nbytes).astype(np.float64)
    # floor(log2(x)) is the binary exponent of x as a float64: bits 52..62 minus the bias.
    # Exact for every integer below 2^53; zero, negative and sub-1 sizes give -1.
    e = f.view(np.int64) >> 52
    e -= 1023
    return np.maximum(e, -1, out=e)


def transfer_time(inst: InstanceTable, idx: np.ndarray | None = None) -> np.ndarray:
    """Per instance the transfer time used for bandwidth.

    Args:
        inst: the instance table.
        idx: only these instances (indices), or None for all.

    Returns:
        float64 (N,) or (len(idx),): device transfer where known and positive, else host
        transfer.
    """
    dev, host = inst.device_transfer, inst.transfer
    if idx is not None:
        dev, host = dev[idx], host[idx]
    return np.where(np.isfinite(dev) & (dev > 0), dev, host)


@dataclass(frozen=True)
class GroupSkew:
    """Arrival skew against post-arrival transfer per (group, op, size bucket); columnar."""

    group: np.ndarray
    op: np.ndarray
    bucket: np.ndarray
    count: np.ndarray
    nbytes_mean: np.ndarray
    """Mean bytes per rank of the row's instances."""
    n_members: np.ndarray
    skew_p50: np.ndarray
    skew_p99: np.ndarray
    skew_max: np.ndarray
    transfer_p10: np.ndarray
    """Transfer of the quiet instances: the reference for bursts that hit most steps."""
    transfer_p50: np.ndarray
    transfer_p99: np.ndarray
    transfer_max: np.ndarray
    skew_share: np.ndarray
    """``skew_p50 / (skew_p50 + transfer_p50)``: above 0.5 waiting dominates the collective."""
    row_of_instance: np.ndarray
    """int64 per instance of the table: its row here, -1 when left out (incomplete)."""
    sampled: np.ndarray
    """bool per instance: used for the percentiles (see the module docstring)."""

    def __len__(self) -> int:
        return int(self.group.shape[0])


def _row_max(inv: np.ndarray, values: np.ndarray, k: int, starts: np.ndarray | None) -> np.ndarray:
    """Maximum per row over known values (NaN for a row with none).

    ``starts`` are the starts of runs of equal ``inv`` (instances usually arrive grouped by
    process group): the maximum of each run first, then of the runs per row.
    """
    out = np.full(k, -np.inf)
    if starts is not None:
        run_max = np.fmax.reduceat(values, starts)
        np.maximum.at(out, inv[starts], np.where(np.isnan(run_max), -np.inf, run_max))
    else:
        if np.isnan(values).any():
            values = np.where(np.isnan(values), -np.inf, values)
        np.maximum.at(out, inv, values)
    out[np.isneginf(out)] = np.nan
    return out


def _prime_at_least(n: int) -> int:
    """The smallest prime ≥ n (1 stays 1: no thinning)."""
    if n <= 2:
        return n
    while any(n % d == 0 for d in range(2, int(n**0.5) + 1)):
        n += 1
    return n


def _sample(inv: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Indices of the instances percentiles are computed from: every instance of a row
    with up to ``SAMPLE_CAP`` of them; for larger rows an even global stride that leaves
    each of them about ``SAMPLE_CAP`` (a strided view costs no pass over the table).
    The stride is prime so that it does not fall in step with a periodic issue order
    (e.g. every 8th collective of a step always being the same layer's)."""
    n = inv.size
    large = count > SAMPLE_CAP
    if not large.any():
        return np.arange(n)
    stride = _prime_at_least(max(1, int(count[large].min()) // SAMPLE_CAP))
    strided = np.arange(0, n, stride)
    strided = strided[large[inv[strided]]]
    if large.all():
        return strided
    # A mask, not a sort of the two index sets: the same sorted indices in one pass.
    keep = ~large[inv]
    keep[strided] = True
    return np.flatnonzero(keep)


def group_rows(inst: InstanceTable, all_complete: bool = False) -> GroupSkew:
    """Skew and transfer percentiles per (group, op, size bucket) over complete instances.

    Args:
        inst: the instance table.
        all_complete: the caller checked that every instance is complete (every member
            arrived, at least two members): the check is not repeated.

    Returns:
        The columnar table.
    """
    n = len(inst)
    if all_complete:
        every, ok = True, None
    else:
        ok = (inst.n_arrived >= inst.n_members) & (inst.n_members >= 2)
        every = bool(ok.all())
    # Most windows hold only complete instances: work on the columns themselves then,
    # not on gathered copies (each gather of ten million rows costs as much as a sort).
    idx = np.arange(n) if every or ok is None else np.flatnonzero(ok)

    def col(a: np.ndarray) -> np.ndarray:
        return a if every else a[idx]

    key = col(inst.group).astype(np.int64)
    key *= _N_OPS
    op = col(inst.op).astype(np.int64)
    np.clip(op, -1, _N_OPS - 2, out=op)
    key += op
    key += 1
    key *= _N_BUCKETS
    key += size_bucket(col(inst.nbytes))
    key += 1
    del op
    keys, inv = dense_codes(key)
    del key
    k = keys.size
    count = np.bincount(inv, minlength=k)
    take = _sample(inv, count)
    skew_all = col(inst.skew)
    dev = inst.device_transfer
    tr_all = col(inst.transfer if np.isnan(dev).all() else transfer_time(inst))
    inv_t = inv[take]
    skew = group_quantiles(inv_t, skew_all[take], k, (0.5, 0.99))
    tr = group_quantiles(inv_t, tr_all[take], k, (0.1, 0.5, 0.99))
    starts: np.ndarray | None = None
    if inv.size:
        starts = np.flatnonzero(np.diff(inv)) + 1
        # Worth it only when the rows come in long runs.
        starts = np.concatenate(([0], starts)) if starts.size < inv.size // 8 else None
    skew_max = _row_max(inv, skew_all, k, starts)
    tr_max = _row_max(inv, tr_all, k, starts)
    # Sizes and group sizes are near constant within a row: their means come from the
    # sample (exact for rows of up to SAMPLE_CAP instances).
    n_take = np.maximum(np.bincount(inv_t, minlength=k), 1).astype(np.float64)
    nb_sum = np.bincount(inv_t, weights=col(inst.nbytes)[take].astype(np.float64), minlength=k)
    m_sum = np.bincount(inv_t, weights=col(inst.n_members)[take].astype(np.float64), minlength=k)
    nbytes = nb_sum / n_take
    members = m_sum / n_take
    with np.errstate(invalid="ignore", divide="ignore"):
        share = skew[0] / (skew[0] + tr[1])
    sampled = np.zeros(n, dtype=bool)
    sampled[idx[take]] = True
    if every:
        row_of = inv
    else:
        row_of = np.full(n, -1, dtype=np.int64)
        row_of[idx] = inv
    return GroupSkew(
        group=(keys // (_N_BUCKETS * _N_OPS)).astype(np.int32),
        op=((keys // _N_BUCKETS) % _N_OPS - 1).astype(np.int8),
        bucket=(keys % _N_BUCKETS - 1).astype(np.int32),
        count=count.astype(np.int64),
        nbytes_mean=nbytes,
        n_members=np.rint(members).astype(np.int32),
        skew_p50=skew[0],
        skew_p99=skew[1],
        skew_max=skew_max,
        transfer_p10=tr[0],
        transfer_p50=tr[1],
        transfer_p99=tr[2],
        transfer_max=tr_max,
        skew_share=share,
        row_of_instance=row_of,
        sampled=sampled,
    )
