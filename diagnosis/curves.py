"""Message-size curves per process group, with the nccl-tests bandwidth conventions.

For one collective of ``n`` ranks taking ``t`` (post-arrival service, ARCHITECTURE §6):

- ``algbw = S / t`` and ``busbw = algbw × f``;
- ``f = 2(n−1)/n`` for all_reduce; ``(n−1)/n`` for all_gather, reduce_scatter, all_to_all;
  ``1`` for broadcast, reduce, send, recv (and anything else);
- ``S`` = bytes per rank (``nbytes``) for all_reduce, broadcast, reduce, send, recv;
  ``nbytes × n`` for all_gather, reduce_scatter, all_to_all (``nbytes`` being each rank's
  shard).

Bandwidths are in GB/s (10⁹ bytes/s, as nccl-tests prints them). ``t`` is the device
transfer where device times exist, else the host-side post-arrival transfer; waiting for
late ranks is never counted as transfer time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.collector.schema import OP_INDEX, OPS
from rankscope.diagnosis.grouprows import GroupSkew, group_rows, size_bucket, transfer_time
from rankscope.diagnosis.window import GroupInfo, InstanceTable

__all__ = [
    "CONVENTION",
    "CurveShift",
    "Curves",
    "algbw_bytes",
    "bucket_label",
    "bus_factor",
    "compare_curves",
    "curves_from_rows",
    "message_curves",
    "size_bucket",
    "transfer_time",
]

CONVENTION = (
    "nccl-tests: algbw = S/t, busbw = algbw*f; f = 2(n-1)/n all_reduce, (n-1)/n "
    "all_gather/reduce_scatter/all_to_all, 1 broadcast/reduce/send/recv; S = nbytes per rank, "
    "x n for all_gather/reduce_scatter/all_to_all; t = post-arrival transfer; GB/s = 1e9 B/s"
)

_GATHER_LIKE = np.zeros(len(OPS), dtype=bool)
for _name in ("all_gather", "reduce_scatter", "all_to_all"):
    _GATHER_LIKE[OP_INDEX[_name]] = True
_ALL_REDUCE = OP_INDEX["all_reduce"]


def bus_factor(op: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The nccl-tests bus-bandwidth factor ``f`` per collective.

    Args:
        op: int (N,) index into ``schema.OPS``.
        n: int (N,) ranks in the collective.

    Returns:
        float64 (N,) factor.
    """
    op = np.asarray(op, dtype=np.int64)
    n = np.asarray(n, dtype=np.float64)
    frac = np.where(n > 0, (n - 1.0) / np.where(n > 0, n, 1.0), 0.0)
    gather = _GATHER_LIKE[np.clip(op, 0, len(OPS) - 1)] & (op >= 0)
    return np.where(op == _ALL_REDUCE, 2.0 * frac, np.where(gather, frac, 1.0))


def algbw_bytes(op: np.ndarray, nbytes: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The size ``S`` in ``algbw = S / t`` (see module docstring).

    Args:
        op: int (N,) op index.
        nbytes: (N,) bytes per rank.
        n: (N,) ranks in the collective.

    Returns:
        float64 (N,) bytes.
    """
    op = np.asarray(op, dtype=np.int64)
    gather = _GATHER_LIKE[np.clip(op, 0, len(OPS) - 1)] & (op >= 0)
    nb = np.asarray(nbytes, dtype=np.float64)
    return np.where(gather, nb * np.asarray(n, dtype=np.float64), nb)


def bucket_label(bucket: int) -> str:
    """Human label of a size bucket's lower bound.

    Args:
        bucket: `size_bucket` value.

    Returns:
        ``"4 KiB"``, ``"16 MiB"``..., or ``"unknown"`` for -1.
    """
    if bucket < 0:
        return "unknown"
    size = 1 << int(bucket)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            return f"{size} {unit}"
        size >>= 10
    return f"{size} PiB"


@dataclass(frozen=True)
class Curves:
    """Message-size curve points, one row per (group, op, size bucket); columnar."""

    group: np.ndarray
    op: np.ndarray
    bucket: np.ndarray
    count: np.ndarray
    """Instances in the point."""
    nbytes: np.ndarray
    """Mean bytes per rank of the point's instances (within one power-of-two bucket)."""
    time_ns: np.ndarray
    """Median post-arrival transfer."""
    algbw_gbps: np.ndarray
    busbw_gbps: np.ndarray
    convention: str = CONVENTION

    def __len__(self) -> int:
        return int(self.group.shape[0])


def message_curves(inst: InstanceTable) -> Curves:
    """algbw / busbw per (group, op, size bucket), from complete instances.

    Args:
        inst: the instance table.

    Returns:
        The curve points (nccl-tests conventions, see ``CONVENTION``).
    """
    return curves_from_rows(group_rows(inst))


def curves_from_rows(rows: GroupSkew) -> Curves:
    """The curve points of an already computed per-(group, op, bucket) table.

    ``nbytes`` is the mean message size of the row's instances, ``time_ns`` their median
    transfer; rows without a positive size or time are left out.

    Args:
        rows: `grouprows.group_rows` output.

    Returns:
        The curve points.
    """
    t = rows.transfer_p50
    keep = np.isfinite(t) & (t > 0) & (rows.nbytes_mean > 0)
    o = rows.op[keep].astype(np.int64)
    n = rows.n_members[keep].astype(np.int64)
    nb = rows.nbytes_mean[keep]
    with np.errstate(divide="ignore", invalid="ignore"):
        alg = algbw_bytes(o, nb, n) / t[keep]
    return Curves(
        group=rows.group[keep].astype(np.int32),
        op=o.astype(np.int8),
        bucket=rows.bucket[keep].astype(np.int32),
        count=rows.count[keep].astype(np.int64),
        nbytes=nb,
        time_ns=t[keep],
        algbw_gbps=alg,
        busbw_gbps=alg * bus_factor(o, n),
    )


@dataclass(frozen=True)
class CurveShift:
    """busbw of one (group name, op, bucket) point against the baseline run."""

    group: str
    op: str
    bucket: int
    busbw_gbps: float
    baseline_busbw_gbps: float
    ratio: float
    """current / baseline: below 1 the curve moved down."""


def compare_curves(
    current: Curves,
    current_groups: dict[int, GroupInfo],
    baseline: Curves,
    baseline_groups: dict[int, GroupInfo],
) -> tuple[CurveShift, ...]:
    """Match curve points by group name, op and size bucket and compare busbw.

    Groups are matched by name because ids are assigned per run.

    Args:
        current: curves of the run under study.
        current_groups: its group table.
        baseline: curves of the healthy run.
        baseline_groups: its group table.

    Returns:
        One row per matched point, worst ratio first.
    """

    def name(groups: dict[int, GroupInfo], gid: int) -> str:
        g = groups.get(gid)
        return g.name if g is not None else f"g{gid}"

    base = {
        (name(baseline_groups, int(g)), int(o), int(b)): float(bw)
        for g, o, b, bw in zip(baseline.group, baseline.op, baseline.bucket, baseline.busbw_gbps)
    }
    out = []
    for g, o, b, bw in zip(current.group, current.op, current.bucket, current.busbw_gbps):
        key = (name(current_groups, int(g)), int(o), int(b))
        ref = base.get(key)
        if ref is None or not ref > 0:
            continue
        out.append(CurveShift(key[0], OPS[key[1]], key[2], float(bw), ref, float(bw) / ref))
    out.sort(key=lambda s: s.ratio)
    return tuple(out)
