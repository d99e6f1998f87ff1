"""State of one run inside the store: identities and the dense step ring.

The ring holds ``history`` step slots per rank as dense ``(world_size, history)`` arrays;
a step id takes a free slot, or evicts the oldest step when the ring is full. Cells
remember the incarnation that wrote them: a restarted rank re-executing a step replaces the
cell, and collective rows only count towards a cell of their own incarnation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import pairwise
from operator import itemgetter
from typing import Any

import msgpack
import numpy as np

from rankscope.collector import schema
from rankscope.diagnosis.assemble import group_info, rank_info
from rankscope.diagnosis.window import (
    COLL_AGGREGATES,
    HOST_COLUMNS,
    MEMORY_COLUMNS,
    REDUCED_AGGREGATES,
    WORK_COLUMNS,
    GroupInfo,
    InstanceTable,
    RankInfo,
)
from rankscope.hub.columns import Columns
from rankscope.hub.partial import PartError, PartStore, combine, parts_of_rows, with_cut
from rankscope.hub.pending import PENDING_DTYPES, Part, PendingRows

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
REDUCED = "reduced:"
"""Prefix of the ring's grids of `REDUCED_AGGREGATES` (made at a first ``reduced``
message): the calls a relay matched, kept apart beside ``COLL_AGGREGATES``."""
_STEP_VALUES = ("t_start", "t_end", *WORK_COLUMNS, *MEMORY_COLUMNS, *HOST_COLUMNS)
"""Columns of a steps table the ring keeps."""
HOST_SLACK_NS = 1_000_000
"""CPU or GC time may exceed the wall time it fell in by this much plus 5 % (the clock
reads at a span's ends are not simultaneous) before it is impossible."""
MAX_HOST_NS = 7 * 86_400 * 10**9
"""Bound on ``gc_ns``/``cpu_ns`` where the wall time is unknown (a week)."""
_WALL_BOUNDED = ("gc_ns", "cpu_ns", "runq_ns")
_CHECKED = (*HOST_COLUMNS, "expert_tokens")
"""Step columns whose impossible values are read as unknown and counted."""

MAX_INSTANCE_ROWS = 1_000_000
"""Closed instances the store keeps by default over all its runs (~105 bytes each, shared
as the ring cells are, `Store`): a 65,536-rank job's 200 collectives a step close 1.5 M
instances a step, which a ring of 61 steps would keep as 10 GB; the oldest go first
(`RunState.trim`)."""


def host_value_bounds(values: np.ndarray, t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
    """Which host or MoE values cannot be: below -1 (the unknown mark), or, for a CPU or GC
    time, above the wall time ``t1 - t0`` it fell in (``HOST_SLACK_NS`` and 5 % allowed;
    ``MAX_HOST_NS`` where the wall time is unknown).

    The store reads such a value as unknown and counts it as ``bad_host_value`` rather than
    refusing the message: one bad counter must not cost the step's times. The check runs
    where the store writes its ring, over every staged message at once, not per message.

    Args:
        values: int64 ``gc_ns`` or ``cpu_ns`` column (counts are checked for ``< -1`` only).
        t0, t1: int64 hub-clock ends of the step or span of each value.

    Returns:
        bool mask of the impossible values.
    """
    known = (t0 != schema.NO_TIME) & (t1 != schema.NO_TIME) & (t1 >= t0)
    bound = np.where(known, (t1 - t0) * 1.05 + HOST_SLACK_NS, float(MAX_HOST_NS))
    return (values < -1) | (values > bound)


_SAMPLE_DTYPES = {"rank": np.dtype(np.int32), **schema.SAMPLE_COLUMNS}
_NO_PART_ROWS = {c: np.zeros(0, dt) for c, dt in schema.PART_ROW_COLUMNS.items()}
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
    ring_steps: int = 0
    """Steps per rank the store's ring holds for the run now (the cell budget's share)."""


class RunState:
    """Everything the store keeps about one run (see `hub.store`)."""

    def __init__(
        self,
        job: str,
        run: str,
        world_size: int,
        history: int,
        raw_steps: int,
        max_instance_rows: int = MAX_INSTANCE_ROWS,
    ) -> None:
        self.job = job
        self.run = run
        self.world_size = R = int(world_size)
        self.H = H = int(history)
        self.raw_steps = raw_steps
        self.scope = "full"
        self.parent_run: str | None = None
        self.identities: dict[int, dict[str, Any]] = {}
        self.manifests: dict[int, bytes] = {}
        """Rank -> its manifest, msgpack-packed (the store's identity budget counts it)."""
        self.started_ns: dict[int, int | None] = {}
        self.incarnation = np.full(R, -1, np.int64)
        # Python lists: one item is written per message, which a list does in a tenth of
        # the time of a numpy array; the store's pass reads them as arrays.
        self.heard_ns = [-1] * R
        """Hub clock (receive time) of each rank's latest accepted message; -1 never."""
        self.newest_step = [-1] * R
        """Each rank's newest reported step; -1 none yet."""
        self.stepped_ns = [-1] * R
        """Hub clock of each rank's latest steps message (the store's lag hold)."""
        self.identity_bytes = 0
        """Packed bytes of the identities and distinct manifests held (`Store` budget)."""
        self._manifest_pool: dict[bytes, list[Any]] = {}
        """Packed manifest -> [the one copy ranks share, ranks holding it]."""
        self._manifest_cache: tuple[int, dict[str, Any]] | None = None
        self.groups: dict[int, dict[str, Any]] = {}
        self.phase_names: list[str] = []
        self.stats: dict[int, dict[str, Any]] = {}
        self.bad_host_values = 0
        """Host or MoE values read as unknown (`host_value_bounds`), counted as they are
        written into the ring."""
        self._info: tuple[RankInfo, dict[int, GroupInfo]] | None = None
        self.t0: int = 0
        self._t0_set = False
        self.max_step: int | None = None
        self.first_step: int | None = None
        self.last_ns = schema.NO_TIME
        """Newest step end seen (hub clock): how the store tells an active run from an
        idle one."""
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
        # Work, memory and phase grids exist only once some rank reports a known value:
        # a CPU job without memory counters or user phases pays nothing for them.
        self.work: dict[str, np.ndarray] = {}
        self.memory: dict[str, np.ndarray] = {}
        self.host: dict[str, np.ndarray] = {}
        self.phases: dict[str, np.ndarray] = {}
        self.phase_cpu: dict[str, np.ndarray] = {}
        """Phase name -> Σ CPU ns of its spans (NaN once a span of unknown CPU time adds
        in), for the phases some span reported CPU time of."""
        self.coll = {n: np.zeros((R, H)) for n in COLL_AGGREGATES}
        # Ingest only records references to the message columns; the periodic pass
        # (store.settle) and readers apply them in vectorized batches.
        self._staged_steps: list[tuple[int, Any, Mapping[str, np.ndarray], Any]] = []
        """(rank, slot or slots, steps table, rows kept or None) of each message."""
        self._staged_one: list[tuple[int, int, list[Any]]] = []
        """(rank, slot, values of ``_STEP_VALUES``) of each single-step message."""
        self._staged_phases: list[tuple[Any, Any, Mapping[str, np.ndarray], Any, np.ndarray]] = []
        self._staged_node: list[tuple[np.ndarray, np.ndarray, Mapping[str, np.ndarray], Any]] = []
        """Step rows of node messages: (ranks, slots, table, rows of it)."""
        self.pending = PendingRows(raw_steps)
        self._luts: dict[tuple[str, ...], np.ndarray] = {}
        self.max_instance_rows = int(max_instance_rows)
        """Most closed instances kept: beyond, those of the oldest steps go first, whatever
        the ring still holds (their sums stay in ``coll``)."""
        self.instances = Columns(_INSTANCE_DTYPES, 1024, limit=self.max_instance_rows)
        self.instances_dropped = 0
        """Closed instances dropped by ``max_instance_rows`` (not by the ring's age)."""
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
        self._group_index: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._group_sizes: dict[int, int] | None = None
        self.reduced_seq: dict[tuple[int, int], int] = {}
        """(group, incarnation) -> the last ``seq`` a relay's ``reduced`` message folded
        (`add_node`): a repeat is refused, not added twice."""
        self.parts = PartStore()
        """Relays' parts of instances whose groups span them, until they cover the group."""
        self.parted = np.zeros(0, np.int64)
        """Groups some relay sent parts of, ascending: their rows that come as rows are
        made parts too (`_divert`)."""
        self.parts_done: set[tuple[int, int, int]] = set()
        """(group, step, incarnation) combined or closed (a repeat is refused), down to the
        ring's oldest step."""
        self.part_counts = {"combined": 0, "unsplit": 0, "incomplete": 0}
        """(group, step) parts combined, of those where a member left before the last came
        (sums of the time inside only), and closed stale, uncovered (the same)."""
        self.part_rejects: dict[str, int] = {}
        """Reject reason -> shares refused when combined (the store counts them)."""
        self.beats = Beats(R)
        """Each rank's latest heartbeat (`collector.heartbeat`)."""

    # -- identity ---------------------------------------------------------------------

    def identity_cost(self, rank: int, ident: Mapping[str, Any], packed: bytes) -> int:
        """Bytes the identity budget would hold more after this rank's hello (may be < 0)."""
        old = self.identities.get(rank)
        cost = len(msgpack.packb(dict(ident), use_bin_type=True))
        if old is not None:
            cost -= len(msgpack.packb(old, use_bin_type=True))
        if packed not in self._manifest_pool:
            cost += len(packed)
        return cost

    def hello(self, h: Mapping[str, Any]) -> None:
        self._info = None
        ident = h["identity"]
        rank, inc = int(ident["rank"]), int(h["inc"])
        self.incarnation[rank] = max(inc, int(self.incarnation[rank]))
        packed = h.get("_manifest_packed")  # validation packed it (`validate.PACKED_MANIFEST`)
        if not isinstance(packed, bytes):
            packed = msgpack.packb(dict(h.get("manifest") or {}), use_bin_type=True)
        self.identity_bytes += self.identity_cost(rank, ident, packed)
        self.identities[rank] = dict(ident)
        entry = self._manifest_pool.setdefault(packed, [packed, 0])
        entry[1] += 1
        old = self.manifests.get(rank)
        self.manifests[rank] = entry[0]
        if old is not None:
            held = self._manifest_pool[old]
            held[1] -= 1
            if held[1] == 0:  # no rank holds it any more
                del self._manifest_pool[old]
                self.identity_bytes -= len(old)
        self._manifest_cache = None
        self.started_ns[rank] = h.get("t_start_ns")
        if isinstance(h.get("t_start_ns"), int):  # running since its start, before any step
            self.last_ns = max(self.last_ns, int(h["t_start_ns"]))
        if rank == 0 or len(self.identities) == 1:
            self.scope = str(h.get("scope") or "full")
            self.parent_run = h.get("parent_run")

    def info(self) -> tuple[RankInfo, dict[int, GroupInfo]]:
        """Identity and group tables, rebuilt only after a hello or a groups message."""
        if self._info is None:
            identities = {
                k: {**v, "incarnation": int(self.incarnation[k])}
                for k, v in self.identities.items()
            }
            ranks = rank_info(identities, self.world_size)
            self._info = (ranks, group_info(list(self.groups.values()), ranks))
        return self._info

    def manifest(self) -> dict[str, Any]:
        """Rank 0's manifest, or the lowest rank's when rank 0 has not said hello."""
        if not self.manifests:
            return {}
        rank = 0 if 0 in self.manifests else min(self.manifests)
        if self._manifest_cache is None or self._manifest_cache[0] != rank:
            self._manifest_cache = (rank, msgpack.unpackb(self.manifests[rank], raw=False))
        return self._manifest_cache[1]

    def set_groups(self, groups: list[dict[str, Any]]) -> None:
        self._info = None
        self._group_index = None
        self._group_sizes = None
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
        self._add_sample_rows(rank, table)

    def _add_sample_rows(self, rank: Any, table: Mapping[str, np.ndarray]) -> None:
        n = table["t"].shape[0]
        self.samples.append({"rank": rank, **{k: table[k] for k in schema.SAMPLE_COLUMNS}}, n)
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
        self.flush()
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
        for grids, fill in ((self.work, np.nan), (self.memory, np.nan), (self.host, np.nan)):
            for a in grids.values():
                a[rows, slot] = fill
        for grids in (self.phases, self.phase_cpu, self.coll):
            for a in grids.values():
                a[rows, slot] = 0.0

    def resize(self, history: int) -> None:
        """Re-allocate the ring to ``history`` slots, keeping its newest steps.

        Steps that no longer fit leave as when a full ring evicts them: their step time
        stays in the lifetime totals, their instances and samples are trimmed.

        Args:
            history: slots of the new ring (≥ 1).

        Raises:
            ValueError: ``history`` < 1.
        """
        H = int(history)
        if H < 1:
            raise ValueError(f"a ring needs at least one step slot, got {history}")
        if H == self.H:
            return
        self.flush()
        steps, slots = self.window_slots(None)
        if slots.shape[0] > H:
            gone = slots[: slots.shape[0] - H]
            ns, nrep = self._slot_step_ns(gone)
            self.finished.append(
                {"step": steps[: gone.shape[0]], "step_ns": ns, "nrep": nrep}, gone.shape[0]
            )
            steps, slots = steps[gone.shape[0] :], slots[gone.shape[0] :]
        k = slots.shape[0]

        def moved(a: np.ndarray, fill: Any) -> np.ndarray:
            out = np.full((self.world_size, H), fill, a.dtype)
            out[:, :k] = a[:, slots]
            return out

        # One grid at a time, so the old and the new ring coexist for one grid only.
        self.present = moved(self.present, False)
        self.cell_inc = moved(self.cell_inc, -1)
        self.t_start = moved(self.t_start, schema.NO_TIME)
        self.t_end = moved(self.t_end, schema.NO_TIME)
        for grids, fill in (
            (self.work, np.nan),
            (self.memory, np.nan),
            (self.host, np.nan),
            (self.phases, 0.0),
            (self.phase_cpu, 0.0),
            (self.coll, 0.0),
        ):
            for name in list(grids):
                grids[name] = moved(grids[name], fill)
        self.slot_step = np.zeros(H, np.int64)
        self.slot_step[:k] = steps
        self.slot_used = np.zeros(H, bool)
        self.slot_used[:k] = True
        self.slot_of = dict(zip(steps.tolist(), range(k), strict=True))
        self._free = list(range(H - 1, k - 1, -1))
        self._lookup_dirty = True
        self.H = H
        self.trim()

    def ring_nbytes(self) -> int:
        """Bytes of the dense ring's grids."""
        grids = [self.present, self.cell_inc, self.t_start, self.t_end]
        for d in (self.work, self.memory, self.host, self.phases, self.phase_cpu, self.coll):
            grids.extend(d.values())
        return sum(a.nbytes for a in grids) + self.slot_step.nbytes + self.slot_used.nbytes

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
        pos = np.minimum(np.searchsorted(self._keys, steps), self._keys.shape[0] - 1)
        return np.where(self._keys[pos] == steps, self._vals[pos], -1)

    def has_step(self, rank: int, inc: int, step: int) -> bool:
        """Whether this rank's incarnation ``inc`` already reported ``step``."""
        slot = self.slot_of.get(step)
        return (
            slot is not None
            and bool(self.present[rank, slot])
            and (int(self.cell_inc[rank, slot]) >= inc)
        )

    def has_steps(self, rank: int, inc: int, steps: np.ndarray) -> np.ndarray:
        """Which of ``steps`` this rank's incarnation ``inc`` already reported."""
        if steps.shape[0] <= 8:  # the usual message holds a step or a few: skip numpy
            out = np.zeros(steps.shape[0], bool)
            for i, s in enumerate(steps.tolist()):
                slot = self.slot_of.get(s)
                if slot is not None and self.present[rank, slot]:
                    out[i] = self.cell_inc[rank, slot] >= inc
            return out
        slots = self.lookup(np.asarray(steps, np.int64))
        ok = slots >= 0
        s = np.where(ok, slots, 0)
        return ok & self.present[rank, s] & (self.cell_inc[rank, s] >= inc)

    def cells(
        self, rank: np.ndarray, step: np.ndarray, epoch: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Flat (rank, slot) cell of rows and whether it holds their incarnation's step.

        Rows may come before their step: the collector ships the rows of a step that has
        run for a second without waiting for its end. Such rows claim the step's cell for
        their incarnation (and a ring slot for the step, unless it is older than the
        ring), so what they add is kept when the step row follows; a step row of another
        incarnation clears the cell first, as it does a reported one.
        """
        step = step.astype(np.int64)
        slots = self.lookup(step)
        rank = rank.astype(np.int64)
        known = (rank >= 0) & (rank < self.world_size)
        missing = known & (slots < 0)
        if missing.any():
            self._alloc(np.unique(step[missing]))
            slots = self.lookup(step)
        ok = (slots >= 0) & known
        s = np.where(ok, slots, 0)
        r = np.where(ok, rank, 0)
        inc = self.cell_inc[r, s]
        free = ok & (inc < 0)
        if free.any():
            self.cell_inc[r[free], s[free]] = np.broadcast_to(epoch, free.shape)[free]
            inc = self.cell_inc[r, s]
        ok &= inc == epoch
        return r * self.H + s, ok

    def fold(self, values: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Add ``values[name] = (cells, amounts)`` into the collective aggregates."""
        for name, (cell, v) in values.items():
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
        """Take a validated steps message. Returns (steps too old for the ring, rows).

        Presence is marked at once (duplicate detection needs it); values are staged and
        written by `flush`, collective rows wait for the store's pass.
        """
        r, inc = int(h["rank"]), int(h["inc"])
        if not self._t0_set:
            self._set_t0(tables)
        st = tables["steps"]
        steps = st["step"]
        t_end = st["t_end"]
        if t_end.shape[0]:
            newest = int(t_end[0]) if t_end.shape[0] == 1 else int(t_end.max())
            self.last_ns = max(self.last_ns, newest)
        dropped = None
        rows = None
        if keep is not None and not keep.all():
            rows = np.flatnonzero(keep)
            # Steps none of whose rows survived: their phase and collective rows go too.
            dropped = np.setdiff1d(steps[~keep], steps[keep])
        ids = steps if rows is None else steps[rows]
        late = 0
        if ids.shape[0] == 1 and rows is None:  # the usual message: one step, no numpy
            step = int(ids[0])
            slot = self.slot_of.get(step)
            if slot is None:
                slot = int(self._alloc(ids)[0])
            if slot < 0:
                late = 1
            else:
                if self.cell_inc[r, slot] not in (-1, inc):
                    self.flush()  # a restarted rank re-executes the step: its cell starts over
                    self._clear(r, slot)
                self.present[r, slot] = True
                self.cell_inc[r, slot] = inc
                # Python scalars now, while the table is in cache: the pass builds each
                # column from them instead of concatenating one-row arrays.
                self._staged_one.append((r, slot, [st[name].item(0) for name in _STEP_VALUES]))
                self.max_step = step if self.max_step is None else max(self.max_step, step)
                self.first_step = step if self.first_step is None else min(self.first_step, step)
                if step > self.newest_step[r]:
                    self.newest_step[r] = step
        elif ids.shape[0]:
            slots = self._alloc(ids)
            ok = slots >= 0
            if not ok.all():
                late = int((~ok).sum())
                rows = (np.arange(steps.shape[0]) if rows is None else rows)[ok]
                slots, ids = slots[ok], ids[ok]
            if slots.shape[0]:
                old = (self.cell_inc[r, slots] >= 0) & (self.cell_inc[r, slots] != inc)
                if old.any():  # a restarted rank re-executes steps: its cells start over
                    self.flush()
                    self._clear(r, slots[old])
                self.present[r, slots] = True
                self.cell_inc[r, slots] = inc
                self._staged_steps.append((r, slots, st, rows))
                top, low = (
                    (int(ids[0]),) * 2 if ids.shape[0] == 1 else (int(ids.max()), int(ids.min()))
                )
                self.max_step = top if self.max_step is None else max(self.max_step, top)
                self.first_step = low if self.first_step is None else min(self.first_step, low)
                if top > self.newest_step[r]:
                    self.newest_step[r] = top
        ph = tables.get("phases")
        if ph is not None and ph["step"].shape[0]:
            sel = ~np.isin(ph["step"], dropped) if dropped is not None else None
            lut = self._lut(tuple(h.get("phase_names") or ()))
            self._staged_phases.append((r, inc, ph, sel, lut))
        co = tables.get("colls")
        n = 0
        if co is not None and co["step"].shape[0]:
            if dropped is not None:
                sel = ~np.isin(co["step"], dropped)
                co = {k: v[sel] for k, v in co.items()}
            if self.parted.shape[0]:
                keep = self._divert(np.full(co["step"].shape[0], r, np.int64), inc, co)
                if keep is not None:
                    co = {k: v[keep] for k, v in co.items()}
            n = co["step"].shape[0]
            if n:
                self.pending.add(r, inc, co, self.raw_cutoff())
                self.life_rows[r] += n
        return late, n

    def divert_pending(
        self, parts: list[Part], left: dict[str, np.ndarray] | None
    ) -> tuple[list[Part], dict[str, np.ndarray] | None]:
        """Of what a matching pass took (`PendingRows.take`), the rows of groups that came
        as parts since (`parted`) made parts of one member each, as `_divert` makes those
        that come later: rows a relay sent on before the hub knew the group's instances
        combine. Returns the parts and left rows that stay."""
        parted = self.parted

        def hit(g: np.ndarray) -> np.ndarray:
            at = np.minimum(np.searchsorted(parted, g), parted.shape[0] - 1)
            return parted[at] == g

        mine = [p for p in parts if p.group >= 0 and bool(hit(np.array([p.group]))[0])]
        left_hit = None if left is None else hit(left["group"].astype(np.int64))
        if not mine and (left_hit is None or not left_hit.any()):
            return parts, left
        chunks = [p.rows() for p in mine]
        fresh = [np.full(p.n, p.fresh) for p in mine]
        if left is not None and left_hit is not None and left_hit.any():
            chunks.append({k: v[left_hit] for k, v in left.items()})
            fresh.append(np.zeros(int(left_hit.sum()), bool))
        rows = {k: np.concatenate([c[k] for c in chunks]) for k in PENDING_DTYPES}
        cut = rows["cut"]
        rows["cut"] = np.where(
            np.isnan(cut), schema.NO_TIME, self.t0 + np.nan_to_num(cut).astype(np.int64)
        )
        rank, inc = rows["rank"].astype(np.int64), rows["epoch"]
        counted = ~np.concatenate(fresh)
        _, used = parts_of_rows(rank, inc, rows, counted)
        # A piece goes whole or stays whole (its rows are matched together).
        bounds = np.cumsum([0] + [p.n for p in mine])
        spans = list(pairwise(bounds.tolist()))
        whole = [bool(used[a:b].all()) for a, b in spans]
        take = np.zeros(used.shape[0], bool)
        for ok, (a, b) in zip(whole, spans, strict=True):
            take[a:b] = ok
        take[bounds[-1] :] = used[bounds[-1] :]
        if not take.any():
            return parts, left
        sel = {k: v[take] for k, v in rows.items()}
        tables, _ = parts_of_rows(rank[take], inc[take], sel, counted[take])
        self._add_parts(tables, pending=True)
        gone = {id(p) for p, ok in zip(mine, whole, strict=True) if ok}
        parts = [p for p in parts if id(p) not in gone]
        if left is not None and left_hit is not None:
            keep = np.ones(left["step"].shape[0], bool)
            keep[np.flatnonzero(left_hit)[take[bounds[-1] :]]] = False
            left = {k: v[keep] for k, v in left.items()} if keep.any() else None
        return parts, left

    def _divert(
        self, rank: np.ndarray, inc: np.ndarray | int, co: Mapping[str, np.ndarray]
    ) -> np.ndarray | None:
        """Rows of groups some relay sends parts of, made parts of one member each and held
        with the relays' (`hub.partial.parts_of_rows`): an instance whose members came
        partly reduced (a relay that saw their hellos) and partly as rows (one that had not
        yet, or gave up waiting, or a rank with no relay) still combines. Returns which
        rows stay rows (None: all of them)."""
        g = co["group"].astype(np.int64)
        at = np.minimum(np.searchsorted(self.parted, g), self.parted.shape[0] - 1)
        hit = self.parted[at] == g
        if not hit.any():
            return None
        incs = np.broadcast_to(np.asarray(inc, np.int64), rank.shape)
        cut = with_cut(co, rank * (1 << 32) + incs)  # the message's cut, as `pending` takes it
        tables, used = parts_of_rows(rank[hit], incs[hit], {k: v[hit] for k, v in cut.items()})
        if not used.any():
            return None
        self._add_parts(tables)
        keep = ~hit
        keep[np.flatnonzero(hit)[~used]] = True
        return keep

    def _lut(self, names: tuple[str, ...]) -> np.ndarray:
        """Message phase code -> run phase code (``PHASES`` then run-level user names)."""
        lut = self._luts.get(names)
        if lut is None:
            for name in names:
                if name not in schema.PHASES and name not in self.phase_names:
                    self.phase_names.append(name)
            run_names = (*schema.PHASES, *self.phase_names)
            lut = np.array([run_names.index(n) for n in (*schema.PHASES, *names)], np.int64)
            self._luts[names] = lut
        return lut

    def phase_grid(self, name: str) -> np.ndarray:
        if name not in self.phases:
            self.phases[name] = np.zeros((self.world_size, self.H))
        return self.phases[name]

    def phase_cpu_grid(self, name: str) -> np.ndarray:
        """The CPU grid of a phase, made when a first span of known CPU time arrives:
        cells that already hold spans of the phase (whose CPU time was unknown) start
        NaN, the others 0."""
        grid = self.phase_cpu.get(name)
        if grid is None:
            wall = self.phases.get(name)
            grid = np.zeros((self.world_size, self.H))
            if wall is not None:
                grid[wall != 0] = np.nan
            self.phase_cpu[name] = grid
        return grid

    def flush(self) -> None:
        """Write staged step values and phase spans into the ring."""
        if self._staged_one:
            one, self._staged_one = self._staged_one, []
            rank = np.array([r for r, _, _ in one], np.int64)
            slot = np.array([sl for _, sl, _ in one], np.int64)
            values = list(zip(*[v for _, _, v in one], strict=True))
            at = {name: j for j, name in enumerate(_STEP_VALUES)}
            self._write_steps(rank, slot, lambda name: np.array(values[at[name]]))
        if self._staged_steps:
            staged, self._staged_steps = self._staged_steps, []
            slots = [sl for _, sl, _, _ in staged]
            ranks = np.array([r for r, _, _, _ in staged], np.int64)
            if all(isinstance(sl, int) for sl in slots):  # single-step messages
                rank, slot = ranks, np.array(slots, np.int64)
            else:
                arrays = [np.array([sl]) if isinstance(sl, int) else sl for sl in slots]
                rank = np.repeat(ranks, [a.shape[0] for a in arrays])
                slot = np.concatenate(arrays)

            if all(rows is None for _, _, _, rows in staged):
                tables = [t for _, _, t, _ in staged]

                def col(name: str) -> np.ndarray:
                    return np.concatenate(list(map(itemgetter(name), tables)))

            else:

                def col(name: str) -> np.ndarray:
                    return np.concatenate(
                        [t[name] if rows is None else t[name][rows] for _, _, t, rows in staged]
                    )

            self._write_steps(rank, slot, col)
        if self._staged_node:
            node, self._staged_node = self._staged_node, []
            rank = np.concatenate([r for r, _, _, _ in node])
            slot = np.concatenate([s for _, s, _, _ in node])
            self._write_steps(
                rank, slot, lambda name: np.concatenate([t[name][sel] for _, _, t, sel in node])
            )
        if self._staged_phases:
            staged_p, self._staged_phases = self._staged_phases, []
            parts = [
                (r, inc, {k: v if sel is None else v[sel] for k, v in ph.items()}, lut)
                for r, inc, ph, sel, lut in staged_p
            ]
            n = [p["step"].shape[0] for _, _, p, _ in parts]
            if any(isinstance(r, np.ndarray) for r, _, _, _ in parts):  # node messages'
                rank = np.concatenate([np.broadcast_to(r, k) for (r, _, _, _), k in zip(parts, n)])
                inc = np.concatenate([np.broadcast_to(i, k) for (_, i, _, _), k in zip(parts, n)])
            else:
                rank = np.repeat([r for r, _, _, _ in parts], n)
                inc = np.repeat([i for _, i, _, _ in parts], n)
            code = np.concatenate([lut[p["phase"]] for _, _, p, lut in parts])
            step = np.concatenate([p["step"] for _, _, p, _ in parts]).astype(np.int64)
            t0 = np.concatenate([p["t0"] for _, _, p, _ in parts])
            t1 = np.concatenate([p["t1"] for _, _, p, _ in parts])
            cpu = np.concatenate([p["cpu_ns"] for _, _, p, _ in parts])
            bad = host_value_bounds(cpu, t0, t1)
            if bad.any():
                self.bad_host_values += int(bad.sum())
                cpu = np.where(bad, -1, cpu)
            cell, ok = self.cells(rank, step, inc)
            ok &= (t0 != schema.NO_TIME) & (t1 != schema.NO_TIME)
            dur = (t1 - t0).astype(np.float64)
            # Unknown CPU time adds NaN: a cell with one such span is unknown as a whole.
            cpu_f = np.where(cpu >= 0, cpu, np.nan)
            known_cpu = cpu >= 0
            names = (*schema.PHASES, *self.phase_names)
            for c in np.unique(code[ok]):
                m = ok & (code == c)
                name = names[int(c)]
                if name in self.phase_cpu or (known_cpu & m).any():
                    np.add.at(self.phase_cpu_grid(name).reshape(-1), cell[m], cpu_f[m])
                np.add.at(self.phase_grid(name).reshape(-1), cell[m], dur[m])

    def _write_steps(
        self, rank: np.ndarray, slot: np.ndarray, col: Callable[[str], np.ndarray]
    ) -> None:
        """Write the step values ``col(name)`` of cells ``(rank, slot)`` into the ring."""
        t_start, t_end = col("t_start"), col("t_end")
        self.t_start[rank, slot] = t_start
        self.t_end[rank, slot] = t_end
        for grids, names in (
            (self.work, WORK_COLUMNS),
            (self.memory, MEMORY_COLUMNS),
            (self.host, HOST_COLUMNS),
        ):
            for name in names:
                c = col(name)
                counted = c.dtype.kind != "f"  # a count: negative is unknown
                if name in _CHECKED:
                    bad = host_value_bounds(c, t_start, t_end) if name in _WALL_BOUNDED else c < -1
                    if bad.any():
                        self.bad_host_values += int(bad.sum())
                        c = np.where(bad, -1, c)
                a = grids.get(name)
                if a is None:
                    if (c.max() < 0) if counted else np.isnan(c).all():
                        continue  # nothing known yet: no grid
                    a = grids[name] = np.full((self.world_size, self.H), np.nan)
                v = c.astype(np.float64)
                if counted:
                    v[c < 0] = np.nan
                a[rank, slot] = v

    def add_instances(self, inst: InstanceTable, epoch: np.ndarray, mask: np.ndarray) -> None:
        if mask.all():  # the usual pass closes every instance it matched: no copy first
            cols = {k: getattr(inst, k) for k in _INSTANCE_DTYPES if k != "epoch"}
            cols["epoch"] = epoch
            self.instances.append(cols, int(mask.shape[0]))
            return
        cols = {k: getattr(inst, k)[mask] for k in _INSTANCE_DTYPES if k != "epoch"}
        cols["epoch"] = epoch[mask]
        self.instances.append(cols, int(mask.sum()))

    def add_node(
        self, h: Mapping[str, Any], tables: Mapping[str, Mapping[str, np.ndarray]]
    ) -> tuple[int, int]:
        """Take a validated ``reduced`` message (`hub.reduce`): its ranks' step, phase,
        collective and sample rows as their own messages' would be, then its sums.
        Returns (steps too old for the ring, rows and reduced calls)."""
        if not self._t0_set:
            self._set_t0(tables)
        late = rows = 0
        st = tables.get("steps")
        if st is not None and st["step"].shape[0]:
            late = self._add_step_rows(st)
        ph = tables.get("phases")
        if ph is not None and ph["step"].shape[0]:
            lut = self._lut(tuple(h.get("phase_names") or ()))
            rank = ph["rank"].astype(np.int64)
            self._staged_phases.append((rank, ph["inc"].astype(np.int64), ph, None, lut))
        co = tables.get("colls")
        if co is not None and co["step"].shape[0]:
            # One piece per rank and group of one batch: as each rank's own message would
            # be queued and split by group, with no part and look at its columns per rank.
            # (Every row has its entry, validation saw to it: the origin is set above.)
            rank = co["rank"].astype(np.int64)
            cols = {k: co[k] for k in schema.COLL_COLUMNS}
            inc = co["inc"].astype(np.int64)
            if self.parted.shape[0]:
                keep = self._divert(rank, inc, cols)
                if keep is not None:
                    rank, inc, cols = rank[keep], inc[keep], {k: v[keep] for k, v in cols.items()}
            if rank.shape[0]:
                self.pending.add_many(rank, inc, cols, self.raw_cutoff(), self.t0)
                self.life_rows += np.bincount(rank, minlength=self.world_size)[: self.world_size]
                rows += rank.shape[0]
        sa = tables.get("samples")
        if sa is not None and sa["t"].shape[0]:
            self._add_sample_rows(sa["rank"], sa)
        unlisted = int((h.get("unlisted") or (0, 0))[0])
        return late, rows + self._add_sums(tables, unlisted=unlisted) + self._add_parts(tables)

    def _add_parts(
        self, tables: Mapping[str, Mapping[str, np.ndarray]], pending: bool = False
    ) -> int:
        """Hold a ``reduced`` message's parts (`hub.partial`) and fold those that now cover
        their group; returns the calls folded. ``pending``: parts made of rows the hub
        held for matching (`divert_pending`): their calls are counted in the lifetime
        totals already, and in the aggregates where a pass saw them (their cells'
        ``counted``), and their raw rows are the hub's own (not a relay's sums)."""
        parts, cells = tables.get("parts"), tables.get("part_cells")
        if parts is None or cells is None or not cells["rank"].shape[0]:
            return 0
        m = cells["rank"].shape[0]
        counted = cells["counted"] if pending else np.zeros(m, bool)
        cells = {k: v for k, v in cells.items() if k != "counted"}
        cells["raw"] = np.full(m, pending)
        rows = tables.get("part_rows") or _NO_PART_ROWS
        if not self._t0_set:
            self.t0, self._t0_set = int(parts["first"].min()), True
        g = parts["group"].astype(np.int64)
        at = np.minimum(np.searchsorted(self.parted, g), max(self.parted.shape[0] - 1, 0))
        if not self.parted.shape[0] or (self.parted[at] != g).any():
            self.parted = np.union1d(self.parted, g)
        if self._group_sizes is None:
            gids, sizes, _ = self.group_index()
            self._group_sizes = dict(zip(gids.tolist(), sizes.tolist(), strict=True))
        size = self._group_sizes
        held = {"parts": dict(parts), "part_cells": dict(cells), "part_rows": dict(rows)}
        complete, taken, repeats = self.parts.add(held, size, self.parts_done)
        if repeats:
            self._refuse_parts("duplicate_instance", repeats)
        counted = counted[taken]
        cells = {k: v[taken] for k, v in cells.items()}
        # The calls and the time inside count when they come, as rows' do (`hub.matching`);
        # the rest when the instances are combined.
        rank = cells["rank"].astype(np.int64)
        cell, ok = self.cells(rank, cells["step"], cells["inc"].astype(np.int64))
        self._reduced_aggregates()
        n = cells["n"].astype(np.float64)
        fold = ok & ~counted
        for name, v in (("n", n), ("coll_ns", cells["exit_ns"] - cells["enter_ns"])):
            np.add.at(self.coll[name].reshape(-1), cell[fold], v[fold])  # a rank in 2 groups
            if name in REDUCED_AGGREGATES and not pending:
                np.add.at(self.coll[REDUCED + name].reshape(-1), cell[fold], v[fold])
        if not pending:
            np.add.at(self.life_rows, rank, cells["n"].astype(np.int64))
        if complete:
            for key, held in self.parts.pop(complete).items():
                self._combine(key, *held)
        return int(cells["n"].sum())

    def _combine(
        self,
        key: tuple[int, int, int],
        parts: dict[str, np.ndarray],
        pid: np.ndarray,
        cells: dict[str, np.ndarray],
        rows: dict[str, np.ndarray],
    ) -> int:
        """Fold the parts of ``key`` (group, step, incarnation), or refuse them (counted)."""
        members = np.sort(np.asarray(self.groups[key[0]]["ranks"], np.int64))
        raw = cells["raw"][np.argsort(cells["rank"], kind="stable")]
        try:
            out = combine(members, parts, pid, cells, rows)
        except PartError as exc:
            self.parts_done.add(key)  # what came of it stays counted as never completed
            self._refuse_parts(exc.reason, int(np.unique(pid).shape[0]))
            return 0
        self.parts_done.add(key)
        self.part_counts["combined"] += 1
        self.part_counts["unsplit"] += not out.split
        return self._add_sums(
            {"cells": out.cells, "instances": out.instances}, arrived=True, raw=raw
        )

    def _refuse_parts(self, reason: str, n: int) -> None:
        self.part_rejects[reason] = self.part_rejects.get(reason, 0) + n

    def close_parts(self, stale_at: int | None) -> None:
        """Parts of steps at or below ``stale_at`` that never covered their group: their
        calls and time inside were counted when they came; what is not known (how much of
        it was waiting) stays unknown, as the matching leaves it for rows of instances
        that never completed."""
        if stale_at is None or not self.parts.held:
            return
        stale = self.parts.stale(stale_at)
        for key, (parts, _, _, _) in self.parts.pop(stale).items():
            self.part_counts["incomplete"] += 1
            self.life_incomplete += int(np.unique(parts["seq"]).shape[0])
            self.parts_done.add(key)
        oldest = self.oldest_step()
        if oldest is not None and len(self.parts_done) > 4096:
            self.parts_done = {k for k in self.parts_done if k[1] >= oldest}

    def _add_step_rows(self, st: Mapping[str, np.ndarray]) -> int:
        """Step rows of several ranks (`add_node`); returns how many were too old."""
        r = st["rank"].astype(np.int64)
        inc = st["inc"].astype(np.int64)
        ids = st["step"].astype(np.int64)
        t_end = st["t_end"]
        self.last_ns = max(self.last_ns, int(t_end.max()))
        uniq, inv = np.unique(ids, return_inverse=True)
        slots = self._alloc(uniq)[inv]
        ok = slots >= 0
        late = int((~ok).sum())
        sel = np.flatnonzero(ok)
        if late:
            r, inc, ids, slots = r[sel], inc[sel], ids[sel], slots[sel]
        if not sel.shape[0]:
            return late
        was = self.cell_inc[r, slots]
        old = (was >= 0) & (was != inc)
        if old.any():  # a restarted rank re-executes steps: its cells start over
            self.flush()
            self._clear(r[old], slots[old])
        self.present[r, slots] = True
        self.cell_inc[r, slots] = inc
        self._staged_node.append((r, slots, st, sel))
        top, low = int(ids.max()), int(ids.min())
        self.max_step = top if self.max_step is None else max(self.max_step, top)
        self.first_step = low if self.first_step is None else min(self.first_step, low)
        for rank, step in zip(r.tolist(), ids.tolist(), strict=True):
            if step > self.newest_step[rank]:
                self.newest_step[rank] = step
        return late

    def _add_sums(
        self,
        tables: Mapping[str, Mapping[str, np.ndarray]],
        arrived: bool = False,
        unlisted: int = 0,
        raw: np.ndarray | None = None,
    ) -> int:
        """Fold a ``reduced`` message's per rank-step sums into the collective aggregates
        and its instances into the instance table, as the matching pass does with the rows
        it matches itself (``arrived``: their calls and time inside were counted already;
        ``unlisted``: instances the sums cover that the table leaves out; ``raw``: the cells
        whose rows the hub holds itself, kept out of the relays' sums). Returns the calls
        they cover."""
        cells, inst = tables["cells"], tables["instances"]
        k = inst["group"].shape[0]
        if k == 0:
            return 0
        if not self._t0_set:
            self.t0, self._t0_set = int(inst["first"].min()), True
        calls = self._fold_cells(cells, arrived, raw)
        first = inst["first"] - np.int64(self.t0)
        last = inst["last"] - np.int64(self.t0)
        table = InstanceTable(
            group=inst["group"],
            seq=inst["seq"],
            step=inst["step"],
            op=inst["op"],
            nbytes=inst["nbytes"],
            n_members=inst["n_members"],
            n_arrived=inst["n_members"],
            first=first.astype(np.float64),
            last=last.astype(np.float64),
            last_rank=inst["last_rank"],
            margin=inst["margin"],
            skew=(last - first).astype(np.float64),
            transfer=inst["transfer"],
            device_transfer=inst["device_transfer"],
        )
        self.add_instances(table, inst["inc"].astype(np.int64), np.ones(k, bool))
        self.life_complete += k + unlisted
        if len(self.instances) > self.max_instance_rows:
            self.trim()  # node messages may bring many steps' instances between passes
        # The last seq of each (group, incarnation): validation refuses what comes again.
        group, epoch, seq = inst["group"], inst["inc"], inst["seq"]
        order = np.lexsort((seq, epoch, group))
        last = np.append(
            (group[order][1:] != group[order][:-1]) | (epoch[order][1:] != epoch[order][:-1]), True
        )
        at = order[last]
        for gid, e, top in zip(
            group[at].tolist(), epoch[at].tolist(), seq[at].tolist(), strict=True
        ):
            if top > self.reduced_seq.get((gid, e), -2):
                self.reduced_seq[(gid, e)] = top
        return calls

    def _reduced_aggregates(self) -> None:
        if REDUCED + "n" not in self.coll:  # kept apart too: see `Window.reduced`
            for name in REDUCED_AGGREGATES:
                self.coll[REDUCED + name] = np.zeros((self.world_size, self.H))

    def _fold_cells(
        self, cells: Mapping[str, np.ndarray], arrived: bool = False, raw: np.ndarray | None = None
    ) -> int:
        """Add per rank-step sums (``schema.CELL_COLUMNS``, one per rank-step) to the
        collective aggregates, kept apart as a relay's too (`Window.reduced`) but those
        ``raw`` marks (the hub holds their rows); ``arrived``: but the calls and the time
        inside, counted when they came. Returns the calls."""
        rank = cells["rank"].astype(np.int64)
        cell, ok = self.cells(rank, cells["step"], cells["inc"].astype(np.int64))
        self._reduced_aggregates()
        # A message names each (rank, step) once (validation): the cells are distinct, so
        # a plain indexed add does what np.add.at would.
        at = cell[ok] if not ok.all() else cell
        apart = ok if raw is None else ok & ~raw
        for name in COLL_AGGREGATES:
            if arrived and name in ("n", "coll_ns"):
                continue
            v = cells[name] if ok.all() else cells[name][ok]
            self.coll[name].reshape(-1)[at] += v
            if name in REDUCED_AGGREGATES:
                self.coll[REDUCED + name].reshape(-1)[cell[apart]] += cells[name][apart]
        calls = cells["n"].astype(np.int64)
        if not arrived:
            np.add.at(self.life_rows, rank, calls)
        np.add.at(self.life_done, rank, calls)
        np.add.at(self.life_last, rank, cells["times_last"])
        np.add.at(self.life_late, rank, cells["late_ns"])
        return int(calls.sum())

    def group_index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The run's groups for vectorized lookups: ids ascending, their sizes, and every
        membership as ``id << 32 | rank``, ascending."""
        if self._group_index is None:
            gids = np.array(sorted(self.groups), np.int64)
            sizes = np.array([len(self.groups[g]["ranks"]) for g in gids.tolist()], np.int64)
            keys = [
                (g << 32) + np.asarray(self.groups[g]["ranks"], np.int64) for g in gids.tolist()
            ]
            member = np.sort(np.concatenate(keys)) if keys else np.zeros(0, np.int64)
            self._group_index = (gids, sizes, member)
        return self._group_index

    def raw_cutoff(self) -> int | None:
        """Oldest step whose raw rows are kept: the last ``raw_steps`` step ids."""
        return None if self.max_step is None else self.max_step - self.raw_steps + 1

    def bound_instances(self, rows: int) -> None:
        """Keep at most ``rows`` closed instances from now on (the store shares its budget
        among the runs, `Store`): the oldest beyond go at once, and the table gives back
        the memory it no longer needs."""
        rows = max(1, int(rows))
        if rows == self.max_instance_rows:
            return
        self.max_instance_rows = rows
        if len(self.instances) > rows:
            self.trim()
        self.instances.fit(rows)

    def trim(self) -> None:
        """Drop instances and samples older than what the ring still holds, and the oldest
        instances beyond ``max_instance_rows``."""
        n = len(self.instances)
        if n > self.max_instance_rows:
            # Whole steps, oldest first, down to three quarters of the bound (the next trim
            # waits for a quarter more): the newest steps keep every instance they had.
            step = self.instances.view()["step"]
            target = self.max_instance_rows * 3 // 4
            bar = np.partition(step, n - target)[n - target]
            keep = step > bar
            if not keep.any():  # the newest step alone is over: its latest-closed ones
                keep = np.arange(n) >= n - target
            self.instances_dropped += n - int(np.count_nonzero(keep))
            self.instances.trim(keep)
        oldest = self.oldest_step()
        if oldest is None or oldest == self._trimmed_at:
            return
        self._trimmed_at = oldest
        # Closed instances arrive in step order but for the few closed late: trimming drops
        # a leading run at no cost, the stragglers with a later compaction.
        self.instances.trim(self.instances.view()["step"] >= oldest)
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
        health: dict[str, Any] = {
            "drops": drops,
            "collector_errors": errors,
            "clock_error_ns": clock,
        }
        if self.instances_dropped:
            health["instances_dropped"] = self.instances_dropped
        return health

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
            ring_steps=self.H,
        )


MAX_STACK_RANKS = 64
"""Ranks whose latest stacks are held (the most recent senders): at most ~12 MiB, ~28 MiB
when each also sent a Flight Recorder dump (``schema.MAX_FR_CHARS``)."""
BEAT_STATE_CODES = {"run": 1, "exit": 2}
"""``Beats.state`` codes; 0 is no beat yet."""


class Beats:
    """Each rank's latest heartbeat as dense columns, and the latest stacks each sent.

    Written by the hub's intake (one row per beat), read by the stall judge: a reader takes
    `copy`, so the judge never sees a row half written.
    """

    def __init__(self, world_size: int) -> None:
        R = int(world_size)
        self.heard_ns = np.full(R, -1, np.int64)
        """Hub receive time of each rank's latest beat; -1 none."""
        self.pos = np.full((R, len(schema.BEAT_POS_FIELDS)), -1, np.int64)
        """``schema.BEAT_POS_FIELDS`` of each rank's latest beat."""
        self.state = np.zeros(R, np.int8)
        self.run_group = np.full(R, -1, np.int64)
        """The group each rank was inside at its latest running beat (a closing beat's
        position does not replace it: a rank that left a collective by an error was in it)."""
        self.error = np.zeros(R, np.int8)
        """1 where a rank's closing beat says an exception ended its process."""
        self.errors: dict[int, str] = {}
        self.stacks: dict[int, dict[str, Any]] = {}
        """Rank -> its latest stacks: the ``stacks`` map plus ``t`` (hub receive ns)."""
        self.count = 0

    def add(self, rank: int, header: Mapping[str, Any], heard_ns: int) -> None:
        """Take one validated beat of ``rank`` received at ``heard_ns``."""
        pos = header["pos"]
        self.pos[rank] = [int(pos.get(k, -1)) for k in schema.BEAT_POS_FIELDS]
        self.heard_ns[rank] = heard_ns
        self.state[rank] = code = BEAT_STATE_CODES.get(header.get("state", "run"), 1)
        if code == 1:
            self.run_group[rank] = int(pos.get("group", -1))
        err = header.get("error")
        self.error[rank] = 1 if err else 0
        if err and (rank in self.errors or len(self.errors) < MAX_STACK_RANKS):
            self.errors[rank] = str(err)
        stacks = header.get("stacks")
        if stacks:
            self.stacks.pop(rank, None)
            self.stacks[rank] = {**stacks, "t": int(heard_ns)}
            while len(self.stacks) > MAX_STACK_RANKS:  # a hostile world cannot fill memory
                del self.stacks[next(iter(self.stacks))]
        self.count += 1

    def copy(self) -> dict[str, np.ndarray]:
        """Plain columns: ``heard_ns``, ``state``, ``run_group``, ``error`` and one per ``BEAT_POS_FIELDS`` entry."""
        out: dict[str, np.ndarray] = {
            "heard_ns": self.heard_ns.copy(),
            "state": self.state.copy(),
            "run_group": self.run_group.copy(),
            "error": self.error.copy(),
        }
        pos = self.pos.copy()
        for i, k in enumerate(schema.BEAT_POS_FIELDS):
            out[k] = pos[:, i]
        return out
