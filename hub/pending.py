"""Collective rows between arrival and matching, and the raw rows of the latest steps.

Ingest only keeps references to the columns of each accepted message (a *part*); the
store's matching pass concatenates them once, behind the rows left incomplete by the last
pass. The raw rows of the last ``raw_steps`` step ids are kept the same way, as parts.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from rankscope.collector import schema
from rankscope.hub.columns import Columns

PENDING_DTYPES = {
    "rank": np.dtype(np.int32),
    **schema.COLL_COLUMNS,
    "epoch": np.dtype(np.int64),
    "cut": np.dtype(np.float64),
}
"""Columns of a matching pass: the row, its rank, incarnation and async cut."""


class PendingRows:
    """Collective rows of one run waiting for the matching pass, plus the raw-row ring."""

    def __init__(self, raw_steps: int) -> None:
        self.raw_steps = raw_steps
        self._parts: list[tuple[int, int, Mapping[str, np.ndarray], np.ndarray | None]] = []
        self.left = Columns(PENDING_DTYPES, 4096)
        """Rows left incomplete by the last pass."""
        self.rows = 0
        """Rows the next pass will see (left over plus newly arrived)."""
        self._raw: list[tuple[int, int, Mapping[str, np.ndarray]]] = []
        self._raw_base = -(2**62)

    def add(
        self,
        rank: int,
        inc: int,
        cols: Mapping[str, np.ndarray],
        cut: np.ndarray | None,
        raw_cutoff: int | None,
    ) -> None:
        """Queue one message's collective rows.

        Args:
            rank, inc: sender and its incarnation.
            cols: ``COLL_COLUMNS`` arrays (kept by reference).
            cut: per-row async cut (relative to the run's origin), None when no row is async.
            raw_cutoff: oldest step whose raw rows the run keeps.
        """
        self._parts.append((rank, inc, cols, cut))
        self.rows += cols["step"].shape[0]
        if self.raw_steps:
            self._raw.append((int(cols["step"].max()), rank, cols))
            # Filter once the parts span twice the steps to keep: each part is looked at a
            # bounded number of times, and what is kept depends only on the message order.
            if raw_cutoff is not None and raw_cutoff - self._raw_base >= self.raw_steps:
                self._raw = [p for p in self._raw if p[0] >= raw_cutoff]
                self._raw_base = raw_cutoff

    def take(self) -> tuple[dict[str, np.ndarray], int]:
        """Rows for a matching pass: those left over, then the new ones.

        Returns:
            (columns of ``PENDING_DTYPES``, number of left-over rows at the front).
        """
        parts, self._parts = self._parts, []
        old = self.left.view()
        n_old = len(self.left)
        if not parts:
            return {k: v.copy() for k, v in old.items()}, n_old
        lens = [p[2]["step"].shape[0] for p in parts]
        out: dict[str, np.ndarray] = {}
        for c in schema.COLL_COLUMNS:
            out[c] = np.concatenate([old[c], *[p[2][c] for p in parts]])
        out["rank"] = np.concatenate([old["rank"], np.repeat([p[0] for p in parts], lens)])
        out["epoch"] = np.concatenate([old["epoch"], np.repeat([p[1] for p in parts], lens)])
        if all(p[3] is None for p in parts):
            out["cut"] = np.concatenate([old["cut"], np.full(sum(lens), np.nan)])
        else:
            cuts = [np.full(m, np.nan) if p[3] is None else p[3] for p, m in zip(parts, lens)]
            out["cut"] = np.concatenate([old["cut"], *cuts])
        return out, n_old

    def put(self, rows: Mapping[str, np.ndarray], keep: np.ndarray) -> None:
        """Keep ``rows[keep]`` for the next pass."""
        self.left.clear()
        m = int(keep.sum())
        if m:
            self.left.append({k: v[keep] for k, v in rows.items()}, m)
        self.rows = m

    def raw(self, cutoff: int | None) -> dict[str, np.ndarray] | None:
        """Raw rows (with ``rank``) of steps from ``cutoff`` on, or None."""
        parts = [p for p in self._raw if cutoff is None or p[0] >= cutoff]
        if not parts:
            return None
        lens = [p[2]["step"].shape[0] for p in parts]
        out = {c: np.concatenate([p[2][c] for p in parts]) for c in schema.COLL_COLUMNS}
        out["rank"] = np.repeat([p[1] for p in parts], lens).astype(np.int32)
        if cutoff is not None:
            keep = out["step"] >= cutoff
            out = {k: v[keep] for k, v in out.items()}
        return out
