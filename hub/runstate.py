"""State of one run inside the store: identities, the dense step ring, pending collectives.

The ring holds ``history`` step slots per rank as dense ``(world_size, history)`` arrays;
a step id takes a free slot, or evicts the oldest step when the ring is full. Cells
remember the incarnation that wrote them: a restarted rank re-executing a step replaces the
cell, and collective rows only count towards a cell of their own incarnation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rankscope.collector import schema
from rankscope.diagnosis.arrivals import async_cut
from rankscope.diagnosis.window import (
    COLL_AGGREGATES,
    MEMORY_COLUMNS,
    WORK_COLUMNS,
    InstanceTable,
)
from rankscope.hub.columns import Columns

_ROW_DTYPES = {"rank": np.dtype(np.int32), **schema.COLL_COLUMNS}
_PENDING_DTYPES = {**_ROW_DTYPES, "epoch": np.dtype(np.int64), "cut": np.dtype(np.float64)}
_RAW_DTYPES = {**_ROW_DTYPES}
_INSTANCE_DTYPES = {
    "group": np.int32,
    "seq": np.int64,
    "step": np.int64,
    "op": np.int8,
    "nbytes": np.int64,
    "n_members": np.int32,
    "n_arrived": np.int32,
    "first": np.float64,
    "last": np.float64,
    "last_rank": np.int32,
    "margin": np.float64,
    "skew": np.float64,
    "transfer": np.float64,
    "device_transfer": np.float64,
    "epoch": np.int64,
}
_SAMPLE_DTYPES = {"rank": np.dtype(np.int32), **schema.SAMPLE_COLUMNS}
_MAX_SAMPLES = 4_000_000


@dataclass(frozen=True)
class RunSummary:
    """One run as the store sees it."""

    job: str
    run: str
    scope: str
    parent_run: str | None
    world_size: int
    hosts: tuple[str, ...]
    n_ranks_seen: int
    """Ranks that said hello."""
    first_step: int | None
    last_step: int | None
    steps_complete: int
    """Steps in the history that every rank has reported."""


class RunState:
    """Everything the store keeps about one run (see `hub.store`)."""

    def __init__(self, job: str, run: str, world_size: int, history: int, raw_steps: int) -> None:
        self.job = job
        self.run = run
        self.world_size = R = int(world_size)
        self.H = H = int(history)
        self.raw_steps = raw_steps
        self.scope = "full"
        self.parent_run: str | None = None
        self.identities: dict[int, dict[str, Any]] = {}
        self.manifests: dict[int, dict[str, Any]] = {}
        self.started_ns: dict[int, int | None] = {}
        self.incarnation = np.full(R, -1, np.int64)
        self.groups: dict[int, dict[str, Any]] = {}
        self.phase_names: list[str] = []
        self.stats: dict[int, dict[str, Any]] = {}
        self.t0: int = 0
        self._t0_set = False
        self.max_step: int | None = None
        self.first_step: int | None = None
        # The dense ring.
        self.slot_of: dict[int, int] = {}
        self.slot_step = np.zeros(H, np.int64)
        self.slot_used = np.zeros(H, bool)
        self._free = list(range(H - 1, -1, -1))
        self._keys = np.zeros(0, np.int64)
        self._vals = np.zeros(0, np.int64)
        self._lookup_dirty = False
        self.present = np.zeros((R, H), bool)
        self.cell_inc = np.full((R, H), -1, np.int32)
        self.t_start = np.full((R, H), schema.NO_TIME, np.int64)
        self.t_end = np.full((R, H), schema.NO_TIME, np.int64)
        self.work = {n: np.full((R, H), np.nan) for n in WORK_COLUMNS}
        self.memory = {n: np.full((R, H), np.nan) for n in MEMORY_COLUMNS}
        self.phases = {n: np.zeros((R, H)) for n in schema.PHASES}
        self.coll = {n: np.zeros((R, H)) for n in COLL_AGGREGATES}
        # Collectives.
        self.pending = Columns(_PENDING_DTYPES, 4096)
        self.pending_counted = 0
        self.raw = Columns(_RAW_DTYPES, 4096)
        self.instances = Columns(_INSTANCE_DTYPES, 1024)
        self.samples = Columns(_SAMPLE_DTYPES, 256)
        self.finished = Columns({"step": np.int64, "step_ns": np.float64, "nrep": np.int32}, 256)
        self._trimmed_at: int | None = None
        # Lifetime per-rank totals.
        self.life_rows = np.zeros(R, np.int64)
        self.life_done = np.zeros(R, np.int64)
        self.life_last = np.zeros(R, np.int64)
        self.life_late = np.zeros(R, np.float64)
        self.life_complete = 0
        self.life_incomplete = 0

    # -- identity ---------------------------------------------------------------------

    def hello(self, h: Mapping[str, Any]) -> None:
        ident = h["identity"]
        rank, inc = int(ident["rank"]), int(h["inc"])
        self.incarnation[rank] = max(inc, int(self.incarnation[rank]))
        self.identities[rank] = dict(ident)
        self.manifests[rank] = dict(h.get("manifest") or {})
        self.started_ns[rank] = h.get("t_start_ns")
        if rank == 0 or len(self.identities) == 1:
            self.scope = str(h.get("scope") or "full")
            self.parent_run = h.get("parent_run")

    def manifest(self) -> dict[str, Any]:
        """Rank 0's manifest, or the lowest rank's when rank 0 has not said hello."""
        if not self.manifests:
            return {}
        return self.manifests.get(0, self.manifests[min(self.manifests)])

    def set_groups(self, groups: list[dict[str, Any]]) -> None:
        for g in groups:
            gid = int(g["id"])
            self.groups[gid] = {
                "id": gid,
                "name": g.get("name"),
                "ranks": [int(r) for r in g["ranks"]],
                "backend": g.get("backend"),
                "desc": g.get("desc"),
            }

    def add_samples(self, rank: int, table: Mapping[str, np.ndarray]) -> None:
        n = table["t"].shape[0]
        self.samples.append({"rank": rank, **table}, n)
        if len(self.samples) > _MAX_SAMPLES:
            keep = np.zeros(len(self.samples), bool)
            keep[len(self.samples) // 2 :] = True
            self.samples.keep(keep)

    # -- the ring ---------------------------------------------------------------------

    def oldest_step(self) -> int | None:
        if not self.slot_used.any():
            return None
        return int(self.slot_step[self.slot_used].min())

    def _alloc(self, steps: np.ndarray) -> np.ndarray:
        out = np.empty(steps.shape[0], np.int64)
        for i, s in enumerate(steps.tolist()):
            slot = self.slot_of.get(s)
            if slot is None:
                if self._free:
                    slot = self._free.pop()
                else:
                    slot = int(np.argmin(self.slot_step))
                    if s < self.slot_step[slot]:
                        out[i] = -1  # older than everything the ring holds
                        continue
                    self._evict(slot)
                self.slot_of[s] = slot
                self.slot_step[slot] = s
                self.slot_used[slot] = True
                self._lookup_dirty = True
            out[i] = slot
        return out

    def _evict(self, slot: int) -> None:
        step = int(self.slot_step[slot])
        ns, nrep = self._slot_step_ns(np.array([slot]))
        self.finished.append({"step": step, "step_ns": ns[0], "nrep": nrep[0]}, 1)
        del self.slot_of[step]
        self.slot_used[slot] = False
        self._clear(slice(None), slot)

    def _clear(self, rows: Any, slot: Any) -> None:
        self.present[rows, slot] = False
        self.cell_inc[rows, slot] = -1
        self.t_start[rows, slot] = schema.NO_TIME
        self.t_end[rows, slot] = schema.NO_TIME
        for grids, fill in ((self.work, np.nan), (self.memory, np.nan)):
            for a in grids.values():
                a[rows, slot] = fill
        for grids in (self.phases, self.coll):
            for a in grids.values():
                a[rows, slot] = 0.0

    def _slot_step_ns(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = self.present[:, slots]
        ts, te = self.t_start[:, slots], self.t_end[:, slots]
        ok = p & (ts != schema.NO_TIME) & (te != schema.NO_TIME)
        dur = np.where(ok, (te - ts).astype(np.float64), -np.inf).max(axis=0)
        dur[np.isinf(dur)] = np.nan
        return dur, p.sum(axis=0).astype(np.int32)

    def lookup(self, steps: np.ndarray) -> np.ndarray:
        """Slot of each step id, -1 where the ring does not hold it."""
        if self._lookup_dirty:
            items = sorted(self.slot_of.items())
            self._keys = np.array([k for k, _ in items], np.int64)
            self._vals = np.array([v for _, v in items], np.int64)
            self._lookup_dirty = False
        if self._keys.shape[0] == 0:
            return np.full(steps.shape[0], -1, np.int64)
        pos = np.clip(np.searchsorted(self._keys, steps), 0, self._keys.shape[0] - 1)
        return np.where(self._keys[pos] == steps, self._vals[pos], -1)

    def has_steps(self, rank: int, inc: int, steps: np.ndarray) -> np.ndarray:
        """Which of ``steps`` this rank's incarnation ``inc`` already reported."""
        slots = self.lookup(np.asarray(steps, np.int64))
        ok = slots >= 0
        s = np.where(ok, slots, 0)
        return ok & self.present[rank, s] & (self.cell_inc[rank, s] >= inc)

    def cells(
        self, rank: np.ndarray, step: np.ndarray, epoch: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Flat (rank, slot) cell of rows and whether it holds their incarnation's step."""
        slots = self.lookup(step.astype(np.int64))
        rank = rank.astype(np.int64)
        ok = (slots >= 0) & (rank >= 0) & (rank < self.world_size)
        s = np.where(ok, slots, 0)
        r = np.where(ok, rank, 0)
        ok &= self.present[r, s] & (self.cell_inc[r, s] == epoch)
        return r * self.H + s, ok

    def fold(self, cell: np.ndarray, values: Mapping[str, np.ndarray]) -> None:
        for name, v in values.items():
            np.add.at(self.coll[name].reshape(-1), cell, v)

    def window_slots(self, last: int | None) -> tuple[np.ndarray, np.ndarray]:
        slots = np.flatnonzero(self.slot_used)
        order = np.argsort(self.slot_step[slots])
        slots = slots[order]
        if last is not None:
            slots = slots[-int(last) :] if last > 0 else slots[:0]
        return self.slot_step[slots].copy(), slots

    # -- ingest -----------------------------------------------------------------------

    def _set_t0(self, tables: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        for name, col in (("steps", "t_start"), ("colls", "t_enter")):
            t = tables.get(name, {}).get(col)
            if t is not None:
                t = t[t != schema.NO_TIME]
                if t.shape[0]:
                    self.t0, self._t0_set = int(t.min()), True
                    return

    def add_steps(
        self,
        h: Mapping[str, Any],
        tables: Mapping[str, Mapping[str, np.ndarray]],
        keep: np.ndarray | None,
    ) -> tuple[int, int]:
        """Apply a validated steps message. Returns (steps too old for the ring, rows)."""
        r, inc = int(h["rank"]), int(h["inc"])
        if not self._t0_set:
            self._set_t0(tables)
        st = tables["steps"]
        if keep is None:
            keep = np.ones(st["step"].shape[0], bool)
        idx = np.flatnonzero(keep)
        # Steps none of whose rows survived: their phase and collective rows go too.
        dropped = np.setdiff1d(st["step"][~keep], st["step"][keep])
        slots = self._alloc(st["step"][idx])
        ok = slots >= 0
        late = int((~ok).sum())
        idx, sl = idx[ok], slots[ok]
        if sl.shape[0]:
            old = self.present[r, sl] & (self.cell_inc[r, sl] != inc)
            if old.any():
                self._clear(r, sl[old])
            self.present[r, sl] = True
            self.cell_inc[r, sl] = inc
            self.t_start[r, sl] = st["t_start"][idx]
            self.t_end[r, sl] = st["t_end"][idx]
            for grids in (self.work, self.memory):
                for name, a in grids.items():
                    col = st[name][idx]
                    v = col.astype(np.float64)
                    if col.dtype.kind != "f":
                        v[col < 0] = np.nan
                    a[r, sl] = v
            ids = st["step"][idx]
            top, low = int(ids.max()), int(ids.min())
            self.max_step = top if self.max_step is None else max(self.max_step, top)
            self.first_step = low if self.first_step is None else min(self.first_step, low)
        ph = tables.get("phases")
        if ph is not None and ph["step"].shape[0]:
            self._add_phases(r, inc, ph, list(h.get("phase_names") or []), dropped)
        co = tables.get("colls")
        n = 0
        if co is not None and co["step"].shape[0]:
            sel = ~np.isin(co["step"], dropped) if dropped.shape[0] else None
            cols = {k: v[sel] for k, v in co.items()} if sel is not None else dict(co)
            n = cols["step"].shape[0]
            cut = async_cut(
                np.zeros(n, np.int64), cols["step"], cols["t_enter"], cols["flags"], self.t0
            )
            self.pending.append({**cols, "rank": r, "epoch": inc, "cut": cut}, n)
            if self.raw_steps:
                self.raw.append({**cols, "rank": r}, n)
            self.life_rows[r] += n
        return late, n

    def phase_grid(self, name: str) -> np.ndarray:
        if name not in self.phases:
            self.phases[name] = np.zeros((self.world_size, self.H))
        return self.phases[name]

    def _add_phases(
        self,
        r: int,
        inc: int,
        ph: Mapping[str, np.ndarray],
        names: list[str],
        dropped: np.ndarray,
    ) -> None:
        sel = (
            ~np.isin(ph["step"], dropped)
            if dropped.shape[0]
            else np.ones(ph["step"].shape[0], bool)
        )
        t0, t1 = ph["t0"], ph["t1"]
        sel &= (t0 != schema.NO_TIME) & (t1 != schema.NO_TIME)
        code = ph["phase"].astype(np.int64)[sel]
        step = ph["step"][sel].astype(np.int64)
        dur = (t1[sel] - t0[sel]).astype(np.float64)
        cell, ok = self.cells(np.full(step.shape[0], r), step, np.full(step.shape[0], inc))
        all_names = (*schema.PHASES, *names)
        for c in np.unique(code[ok]):
            m = ok & (code == c)
            np.add.at(self.phase_grid(all_names[int(c)]).reshape(-1), cell[m], dur[m])

    def add_instances(self, inst: InstanceTable, epoch: np.ndarray, mask: np.ndarray) -> None:
        cols = {k: getattr(inst, k)[mask] for k in _INSTANCE_DTYPES if k != "epoch"}
        cols["epoch"] = epoch[mask]
        self.instances.append(cols, int(mask.sum()))

    def trim(self) -> None:
        """Drop raw rows, instances and samples older than what the ring still holds."""
        oldest = self.oldest_step()
        if oldest is None or oldest == self._trimmed_at:
            return
        self._trimmed_at = oldest
        inst = self.instances.view()
        self.instances.keep(inst["step"] >= oldest)
        used = np.sort(self.slot_step[self.slot_used])
        if self.raw_steps and used.shape[0]:
            cutoff = used[-min(self.raw_steps, used.shape[0])]
            self.raw.keep(self.raw.view()["step"] >= cutoff)
        slots = np.flatnonzero(self.slot_used & (self.slot_step == oldest))
        ts = self.t_start[:, slots]
        known = self.present[:, slots] & (ts != schema.NO_TIME)
        if known.any():
            self.samples.keep(self.samples.view()["t"] >= ts[known].min())

    # -- summaries --------------------------------------------------------------------

    def step_totals(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        fin = self.finished.view()
        slots = np.flatnonzero(self.slot_used)
        ns, nrep = self._slot_step_ns(slots)
        steps = np.concatenate([fin["step"], self.slot_step[slots]])
        order = np.argsort(steps, kind="stable")
        return (
            steps[order],
            np.concatenate([fin["step_ns"], ns])[order],
            np.concatenate([fin["nrep"], nrep])[order],
        )

    def health(self) -> dict[str, Any]:
        drops = {"batches": 0, "events": 0}
        errors: dict[str, int] = {}
        clock: dict[int, float] = {}
        for rank, st in self.stats.items():
            for key, out in (("dropped_batches", "batches"), ("dropped_events", "events")):
                v = st.get(key)
                if isinstance(v, int) and not isinstance(v, bool):
                    drops[out] += v
            errs = st.get("errors")
            if isinstance(errs, dict):
                for k, v in errs.items():
                    if isinstance(v, int):
                        errors[str(k)] = errors.get(str(k), 0) + v
            err = st.get("clock_error_ns")
            if isinstance(err, (int, float)) and not isinstance(err, bool):
                clock[rank] = float(err)
        return {"drops": drops, "collector_errors": errors, "clock_error_ns": clock}

    def summary(self) -> RunSummary:
        hosts = tuple(sorted({str(i["host"]) for i in self.identities.values()}))
        used = np.flatnonzero(self.slot_used)
        complete = int(self.present[:, used].all(axis=0).sum()) if used.shape[0] else 0
        return RunSummary(
            job=self.job,
            run=self.run,
            scope=self.scope,
            parent_run=self.parent_run,
            world_size=self.world_size,
            hosts=hosts,
            n_ranks_seen=len(self.identities),
            first_step=self.first_step,
            last_step=self.max_step,
            steps_complete=complete,
        )
