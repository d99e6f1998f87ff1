"""The instance table summarised per (process group, op, message-size bucket).

Arrival skew, transfer, message-size curves and slow-link findings all read the same rows,
so the instance table — ten million rows at 4,096 ranks with tensor parallelism — is keyed
once here. Only complete instances (every member arrived, two or more members) contribute.

Counts, means and maxima use every instance. Percentiles use every instance of a row with
up to ``SAMPLE_CAP`` of them, and an evenly spread deterministic sample of ``SAMPLE_CAP``
otherwise (a row's p99 from 2,048 draws is within a fraction of a percentile of the full
one); per-step transfer bursts read the same sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.collector.schema import OPS
from rankscope.diagnosis.robust import dense_codes, group_quantiles
from rankscope.diagnosis.window import InstanceTable

SAMPLE_CAP = 2048
"""Instances per row that percentiles are computed from (all of them below this)."""
_GOLDEN = 0.6180339887498949
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


def transfer_time(inst: InstanceTable) -> np.ndarray:
    """Per instance the transfer time used for bandwidth.

    Args:
        inst: the instance table.

    Returns:
        float64 (N,): device transfer where known and positive, else host transfer.
    """
    dev = inst.device_transfer
    return np.where(np.isfinite(dev) & (dev > 0), dev, inst.transfer)


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


def _row_max(inv: np.ndarray, values: np.ndarray, k: int) -> np.ndarray:
    """Maximum per row over known values (NaN for a row with none)."""
    out = np.full(k, -np.inf)
    if np.isnan(values).any():
        values = np.where(np.isnan(values), -np.inf, values)
    np.maximum.at(out, inv, values)
    out[np.isneginf(out)] = np.nan
    return out


def group_rows(inst: InstanceTable) -> GroupSkew:
    """Skew and transfer percentiles per (group, op, size bucket) over complete instances.

    Args:
        inst: the instance table.

    Returns:
        The columnar table.
    """
    n = len(inst)
    ok = (inst.n_arrived >= inst.n_members) & (inst.n_members >= 2)
    every = bool(ok.all())
    # Most windows hold only complete instances: work on the columns themselves then,
    # not on gathered copies (each gather of ten million rows costs as much as a sort).
    idx = np.arange(n) if every else np.flatnonzero(ok)

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
    # Evenly spread, deterministic: instance i is kept when frac(i * golden) < rate.
    rate = np.minimum(1.0, SAMPLE_CAP / np.maximum(count, 1))
    if (rate < 1.0).any():
        take = np.flatnonzero(((idx * _GOLDEN) % 1.0) < rate[inv])
    else:
        take = np.arange(idx.size)
    skew_all = col(inst.skew)
    dev = inst.device_transfer
    tr_all = col(inst.transfer if np.isnan(dev).all() else transfer_time(inst))
    inv_t = inv[take]
    skew = group_quantiles(inv_t, skew_all[take], k, (0.5, 0.99))
    tr = group_quantiles(inv_t, tr_all[take], k, (0.1, 0.5, 0.99))
    skew_max = _row_max(inv, skew_all, k)
    tr_max = _row_max(inv, tr_all, k)
    per_row = np.maximum(count, 1).astype(np.float64)
    nb_sum = np.bincount(inv, weights=col(inst.nbytes).astype(np.float64), minlength=k)
    m_sum = np.bincount(inv, weights=col(inst.n_members).astype(np.float64), minlength=k)
    nbytes = nb_sum / per_row
    members = m_sum / per_row
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
