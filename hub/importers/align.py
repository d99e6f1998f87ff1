"""Cross-rank clock alignment from collective end times.

Ranks of one job record on clocks of their own (each host's wall clock, as a profiler
writes it). Every member of a blocking collective leaves it at nearly the same instant (it
cannot finish anywhere before the last member arrived, and the data then moves in
lock step), so the difference of two ranks' end times of the same instance, matched by
``(group, seq)``, is mostly their clock offset. Over many instances the median of those
differences is a robust estimate of the offset; the spread around it (median absolute
deviation) is what this alignment cannot resolve, reported as its error, as the live
collector reports its clock uncertainty.

Offsets are relative to a reference rank (the one sharing most instances with the others);
ranks linked only through others are chained through the reference's neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_MATCHES = 3
"""Fewest shared instances for a pairwise estimate to be used."""


@dataclass(frozen=True)
class Alignment:
    """Per-rank clock offsets: ``aligned_time = local_time - offset_ns[rank]``."""

    ranks: np.ndarray
    """Ranks, in the order of the other arrays."""
    offset_ns: np.ndarray
    """int64 offset of each rank's clock from the reference rank's (0 where unknown)."""
    error_ns: np.ndarray
    """int64 alignment error of each rank (MAD of its residuals; -1 where not aligned)."""
    matches: np.ndarray
    """Instances each rank shared with the rank it was aligned to."""
    reference: int
    """The reference rank (offset 0)."""

    @property
    def max_error_ns(self) -> int | None:
        """Largest error over the aligned ranks, or None when no rank could be aligned."""
        known = self.error_ns[self.error_ns >= 0]
        return int(known.max()) if known.shape[0] else None

    def resolved(self) -> dict[int, int]:
        """The offsets worth applying: each aligned rank's, where it is larger than its own
        error (it resolves something); 0 elsewhere. Profiler and host wall clocks are
        already close, so an offset within the noise would only move times around."""
        out = {}
        for r, off, err in zip(
            self.ranks.tolist(), self.offset_ns.tolist(), self.error_ns.tolist()
        ):
            out[int(r)] = int(off) if 0 <= err < abs(int(off)) else 0
        return out

    def offset_of(self, rank: int) -> int:
        """The offset of ``rank`` (0 when it is not in the alignment)."""
        hit = np.flatnonzero(self.ranks == rank)
        return int(self.offset_ns[hit[0]]) if hit.shape[0] else 0


def _keys(group: np.ndarray, seq: np.ndarray) -> np.ndarray:
    return (group.astype(np.int64) << 40) ^ seq.astype(np.int64)


def _pair(
    ka: np.ndarray, ta: np.ndarray, kb: np.ndarray, tb: np.ndarray
) -> tuple[int, int, int] | None:
    """(offset of b from a, error, matches) over the instances both hold, or None."""
    common, ia, ib = np.intersect1d(ka, kb, assume_unique=True, return_indices=True)
    if common.shape[0] < MIN_MATCHES:
        return None
    d = tb[ib] - ta[ia]
    off = int(np.median(d))
    err = int(np.median(np.abs(d - off)))
    return off, err, int(common.shape[0])


def estimate_offsets(
    rank: np.ndarray, group: np.ndarray, seq: np.ndarray, t_end: np.ndarray
) -> Alignment:
    """Estimate each rank's clock offset from matched collective end times.

    Args:
        rank: rank of each row.
        group: group id (communicator / process group) of each row.
        seq: sequence number of the instance within its group (-1: unknown, ignored).
        t_end: end time of each row on its rank's own clock (ns; ``< 0`` ignored).

    Returns:
        The `Alignment`: offsets relative to the rank sharing most instances with the
        others; a rank sharing fewer than `MIN_MATCHES` instances with any aligned rank
        keeps offset 0 and error -1.
    """
    rank = np.asarray(rank, np.int64)
    ok = (np.asarray(seq) >= 0) & (np.asarray(t_end) >= 0)
    rank, group, seq, t_end = (
        rank[ok],
        np.asarray(group)[ok],
        np.asarray(seq)[ok],
        np.asarray(t_end, np.int64)[ok],
    )
    ranks = np.unique(rank)
    n = ranks.shape[0]
    offset = np.zeros(n, np.int64)
    error = np.full(n, -1, np.int64)
    matches = np.zeros(n, np.int64)
    if n == 0:
        return Alignment(ranks, offset, error, matches, -1)
    per: list[tuple[np.ndarray, np.ndarray]] = []
    for r in ranks:
        sel = rank == r
        k = _keys(group[sel], seq[sel])
        # One row per instance: the last end (a split collective's final piece).
        order = np.lexsort((t_end[sel], k))
        k, t = k[order], t_end[sel][order]
        last = np.r_[k[1:] != k[:-1], True]
        per.append((k[last], t[last]))
    sizes = [k.shape[0] for k, _ in per]
    ref = int(np.argmax(sizes))
    error[ref] = 0
    aligned = {ref}
    frontier = [ref]
    while frontier:
        nxt = []
        for a in frontier:
            ka, ta = per[a]
            for b in range(n):
                if b in aligned:
                    continue
                est = _pair(ka, ta, *per[b])
                if est is None:
                    continue
                off, err, m = est
                offset[b] = offset[a] + off
                error[b] = max(int(error[a]), 0) + err
                matches[b] = m
                aligned.add(b)
                nxt.append(b)
        frontier = nxt
    matches[ref] = max((int(m) for m in matches), default=0)
    return Alignment(ranks, offset, error, matches, int(ranks[ref]))
