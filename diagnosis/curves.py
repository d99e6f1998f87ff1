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

**The fabric's expected curve.** A recording imported from nccl-tests (``rankscope import
nccl-tests``, manifest ``source.kind == "nccl-tests"``) is not a run of the job: given where
a baseline run goes, it is read as the expected curve instead (`split_baseline`): per (op,
size bucket) the best busbw nccl-tests measured (out-of-place or in-place), and whether its
ranks spanned hosts. Each application point of the same op and size bucket, on a group that
spans hosts the same way (where the nccl-tests hosts are known), is set next to it
(`compare_expected`): below ``EXPECTED_SHARE`` of the expected busbw is evidence that the
fabric or the library underperforms inside the job; at or above it the fabric delivers what
it can. busbw, not algbw, is compared, because busbw does not depend on the rank count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.collector.schema import OP_INDEX, OPS
from rankscope.diagnosis.grouprows import GroupSkew, group_rows, size_bucket, transfer_time
from rankscope.diagnosis.window import GroupInfo, InstanceTable, Window

__all__ = [
    "CONVENTION",
    "EXPECTED_SHARE",
    "CurveShift",
    "Curves",
    "ExpectedCurve",
    "ExpectedJudgement",
    "ExpectedPoint",
    "algbw_bytes",
    "bucket_label",
    "bus_factor",
    "compare_curves",
    "compare_expected",
    "curves_from_rows",
    "expected_curve",
    "is_expected_curve",
    "message_curves",
    "size_bucket",
    "split_baseline",
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


EXPECTED_SHARE = 0.7
"""An application point below this share of nccl-tests' busbw at the same op and size is
evidence that the fabric or the library underperforms in the job. A job's collectives share
the GPU with compute and run with fewer channels than a bare benchmark, so a healthy one
reaches 0.8-1x of nccl-tests at large sizes (the simulated healthy fabric: ~0.9x); a rail at
a fraction of its speed lands far below."""
EXPECTED_SOURCE = "nccl-tests"
"""The manifest ``source.kind`` of a recording that is an expected curve."""


@dataclass(frozen=True)
class ExpectedCurve:
    """The fabric's expected busbw per (op, size bucket), as nccl-tests measured it."""

    op: np.ndarray
    bucket: np.ndarray
    nbytes: np.ndarray
    """Bytes per rank of the point (this module's convention)."""
    busbw_gbps: np.ndarray
    """The better of out-of-place and in-place at this size."""
    algbw_gbps: np.ndarray
    ranks: int
    """Ranks nccl-tests ran on."""
    cross_host: bool | None
    """Whether those ranks spanned hosts; None where the hosts are not known."""
    run: str
    """The imported run (where the curve came from)."""

    def __len__(self) -> int:
        return int(self.op.shape[0])


def is_expected_curve(window: Window) -> bool:
    """Whether ``window`` is an imported nccl-tests recording (an expected curve).

    Args:
        window: a loaded run.

    Returns:
        True for a recording whose manifest says ``source.kind == "nccl-tests"``.
    """
    src = window.manifest.get("source") if isinstance(window.manifest, dict) else None
    return isinstance(src, dict) and src.get("kind") == EXPECTED_SOURCE


def expected_curve(window: Window) -> ExpectedCurve:
    """The expected curve of an imported nccl-tests recording.

    Args:
        window: the nccl-tests recording's run (`is_expected_curve`).

    Returns:
        One point per (op, size bucket): the best busbw over its groups (placements).
    """
    c = message_curves(window.instances)
    best: dict[tuple[int, int], int] = {}
    for i in range(len(c)):
        key = (int(c.op[i]), int(c.bucket[i]))
        j = best.get(key)
        if np.isfinite(c.busbw_gbps[i]) and (j is None or c.busbw_gbps[i] > c.busbw_gbps[j]):
            best[key] = i
    idx = np.array([best[k] for k in sorted(best)], dtype=np.int64)
    names = [h for h in window.ranks.hosts if h and h != "unknown"]
    known = len(names) == len(window.ranks.hosts) and len(names) > 0
    return ExpectedCurve(
        op=c.op[idx].astype(np.int8),
        bucket=c.bucket[idx].astype(np.int32),
        nbytes=c.nbytes[idx],
        busbw_gbps=c.busbw_gbps[idx],
        algbw_gbps=c.algbw_gbps[idx],
        ranks=int(window.world_size),
        cross_host=(len(set(names)) > 1) if known else None,
        run=window.run,
    )


def split_baseline(baseline: Window | None) -> tuple[Window | None, ExpectedCurve | None]:
    """What a ``--baseline`` recording is: a healthy run of the job, or nccl-tests' curve.

    Args:
        baseline: the loaded baseline run, or None.

    Returns:
        ``(baseline run, None)``, or ``(None, expected curve)`` for an nccl-tests import
        (it has no steps, phases or manifest of the job to compare with).
    """
    if baseline is not None and is_expected_curve(baseline):
        return None, expected_curve(baseline)
    return baseline, None


@dataclass(frozen=True)
class ExpectedPoint:
    """One application curve point next to nccl-tests' busbw at the same op and size."""

    group: str
    op: str
    bucket: int
    busbw_gbps: float
    expected_busbw_gbps: float
    ratio: float
    """application / expected busbw."""
    below: bool
    """``ratio < share``: the fabric or the library underperforms on this group."""


@dataclass(frozen=True)
class ExpectedJudgement:
    """The application's curve against the fabric's expected curve."""

    source_run: str
    share: float
    points: tuple[ExpectedPoint, ...]
    """Matched points, lowest ratio first."""
    unmatched: int
    """Application points with no expected point of the same op, size and span."""
    expected_per_point: np.ndarray
    """float64 per point of the diagnosed ``Curves`` (same order): the expected busbw, NaN
    where none matched."""
    finding: str
    """``fabric_underperforms`` (some point below the share), ``fabric_fine`` (every matched
    point at or above it) or ``no_match``."""
    summary: str

    @property
    def below(self) -> tuple[ExpectedPoint, ...]:
        """The points below the share, lowest first."""
        return tuple(p for p in self.points if p.below)


def compare_expected(
    current: Curves,
    window: Window,
    expected: ExpectedCurve,
    share: float = EXPECTED_SHARE,
) -> ExpectedJudgement:
    """Each application point against nccl-tests' busbw of the same op and size bucket.

    A point is matched only on a group that spans hosts as the nccl-tests ranks did (an
    intra-host group is not judged by a cross-host curve, nor the other way), unless the
    nccl-tests hosts are unknown.

    Args:
        current: the application's curve points.
        window: its window (group names and spans).
        expected: the expected curve (`expected_curve`).
        share: the share of the expected busbw below which a point is judged low.

    Returns:
        The judgement.
    """
    ref = {
        (int(o), int(b)): float(bw)
        for o, b, bw in zip(expected.op, expected.bucket, expected.busbw_gbps)
        if np.isfinite(bw) and bw > 0
    }
    per_point = np.full(len(current), np.nan)
    points: list[ExpectedPoint] = []
    unmatched = 0
    for i in range(len(current)):
        g = window.groups.get(int(current.group[i]))
        same_span = (
            expected.cross_host is None or g is None or g.crosses_hosts == expected.cross_host
        )
        e = ref.get((int(current.op[i]), int(current.bucket[i]))) if same_span else None
        bw = float(current.busbw_gbps[i])
        if e is None or not np.isfinite(bw):
            unmatched += 1
            continue
        per_point[i] = e
        name = g.name if g is not None else f"g{int(current.group[i])}"
        op = OPS[int(current.op[i])] if 0 <= int(current.op[i]) < len(OPS) else "other"
        points.append(
            ExpectedPoint(name, op, int(current.bucket[i]), bw, e, bw / e, bw / e < share)
        )
    points.sort(key=lambda p: p.ratio)
    low = [p for p in points if p.below]
    if not points:
        finding = "no_match"
        summary = (
            f"no application point matches the nccl-tests curve of {expected.run!r} "
            "(op, size bucket and host span)"
        )
    elif low:
        finding = "fabric_underperforms"
        w = low[0]
        summary = (
            f"{len(low)} of {len(points)} point(s) below {share:.0%} of nccl-tests' busbw; "
            f"worst {w.group} {w.op} {bucket_label(w.bucket)}: {w.busbw_gbps:.1f} vs "
            f"{w.expected_busbw_gbps:.1f} GB/s (x{w.ratio:.2f}): the fabric or the library "
            "underperforms there"
        )
    else:
        finding = "fabric_fine"
        summary = (
            f"all {len(points)} matched point(s) at or above {share:.0%} of nccl-tests' busbw "
            f"(lowest x{points[0].ratio:.2f}): the fabric delivers what it measured"
        )
    return ExpectedJudgement(
        source_run=expected.run,
        share=share,
        points=tuple(points),
        unmatched=unmatched,
        expected_per_point=per_point,
        finding=finding,
        summary=summary,
    )
