"""Assembly of a `Window` from raw tables: identities, groups, phases, samples, and the
collective aggregates of :mod:`rankscope.diagnosis.arrivals`.

The simulator, the tests and the hub's store build windows through these functions, so a
window means the same thing whichever source produced it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rankscope.collector.schema import (
    COLL_COLUMNS,
    MESH_DIMS,
    NO_TIME,
    OPTIONAL_COLUMNS,
    PHASES,
    TABLES,
)
from rankscope.diagnosis.arrivals import (
    ROW_COLUMNS,
    cell_index,
    empty_instances,
    match,
    rank_step_aggregates,
    relative_ns,
)
from rankscope.diagnosis.window import (
    COLL_AGGREGATES,
    DEVICE_COLUMNS,
    HOST_COLUMNS,
    MEMORY_COLUMNS,
    WORK_COLUMNS,
    CollRows,
    GroupInfo,
    InstanceTable,
    RankInfo,
    Window,
)


def _codes(values: list[Any]) -> tuple[np.ndarray, tuple[str, ...]]:
    names = tuple(sorted({str(v) for v in values if v is not None}))
    index = {name: i for i, name in enumerate(names)}
    return np.array([index.get(str(v), -1) if v is not None else -1 for v in values]), names


def _int32(value: Any, default: int) -> int:
    """An identity integer as the int32 rank table holds it: anything else (a string, a
    float, a value outside 32 bits, from a hello no hub should have accepted) is unknown."""
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    return int(value) if ok and -(2**31) <= int(value) < 2**31 else default


def rank_info(identities: Mapping[int, Mapping[str, Any]], world_size: int) -> RankInfo:
    """Columnar identity of every rank from the ``hello`` identity maps.

    Args:
        identities: global rank -> identity map (``schema.HELLO_REQUIRED``/``_OPTIONAL``
            fields, plus ``incarnation`` when known). Ranks without one stay unknown (-1).
        world_size: R.

    Returns:
        `RankInfo`; categorical names are sorted so the codes do not depend on arrival order.
    """
    per_rank: list[Mapping[str, Any]] = [{} for _ in range(world_size)]
    for r, ident in identities.items():
        if 0 <= int(r) < world_size:
            per_rank[int(r)] = ident

    def ints(key: str, default: int = -1) -> np.ndarray:
        return np.array([_int32(i.get(key), default) for i in per_rank], dtype=np.int32)

    host, hosts = _codes([i.get("host") for i in per_rank])
    rack, racks = _codes([i.get("rack") for i in per_rank])
    nic, nics = _codes([i.get("nic") for i in per_rank])
    meshes = [m if isinstance(m := i.get("mesh"), Mapping) else {} for i in per_rank]
    mesh = {
        dim: np.array([_int32(m.get(dim), -1) for m in meshes], dtype=np.int32) for dim in MESH_DIMS
    }
    return RankInfo(
        host=host.astype(np.int32),
        hosts=hosts,
        node_rank=ints("node_rank"),
        local_rank=ints("local_rank"),
        gpu_index=ints("gpu_index"),
        rail=ints("rail"),
        rack=rack.astype(np.int32),
        racks=racks,
        nic=nic.astype(np.int32),
        nics=nics,
        shard=ints("shard"),
        mesh=mesh,
        incarnation=ints("incarnation", 0),
    )


def group_info(groups: Sequence[Mapping[str, Any]], ranks: RankInfo) -> dict[int, GroupInfo]:
    """`GroupInfo` per group id from the ``groups`` message entries.

    Args:
        groups: ``{"id", "name", "ranks", ...}`` maps; a later entry with the same id wins.
        ranks: identity of every rank (for ``crosses_hosts``).

    Returns:
        Group id -> `GroupInfo`.
    """
    out: dict[int, GroupInfo] = {}
    for g in groups:
        gid = int(g["id"])
        members = tuple(int(r) for r in g["ranks"])
        hosts = {
            int(ranks.host[r]) for r in members if 0 <= r < ranks.world_size and ranks.host[r] >= 0
        }
        out[gid] = GroupInfo(
            id=gid,
            name=str(g.get("name") or f"group{gid}"),
            ranks=members,
            crosses_hosts=len(hosts) > 1,
        )
    return out


def phase_totals(
    phases: Mapping[str, np.ndarray], names: Sequence[str], world_size: int, steps: np.ndarray
) -> dict[str, np.ndarray]:
    """Total ns per phase name, rank and step (zeros where nothing was recorded).

    Args:
        phases: ``rank``, ``step``, ``phase`` (index into ``names``), ``t0``, ``t1``.
        names: phase names (``PHASES`` followed by the run's user phase names).
        world_size: R.
        steps: sorted step ids (S,).

    Returns:
        Name -> float64 (R, S) for every built-in phase and each user phase that occurs.

    Raises:
        ValueError: a phase code is outside ``names``.
    """
    shape = (world_size, steps.shape[0])
    out = {name: np.zeros(shape) for name in PHASES}
    code = np.asarray(phases["phase"], dtype=np.int64)
    if code.shape[0] and (code.min() < 0 or code.max() >= len(names)):
        raise ValueError(f"phase code outside 0..{len(names) - 1}: {code.min()}..{code.max()}")
    cell, ok = cell_index(phases["rank"], phases["step"], world_size, steps)
    t0 = np.asarray(phases["t0"], dtype=np.int64)
    t1 = np.asarray(phases["t1"], dtype=np.int64)
    known = ok & (t0 != NO_TIME) & (t1 != NO_TIME)
    dur = (t1 - t0).astype(np.float64)
    size = shape[0] * shape[1]
    for c in np.unique(code[known]):
        sel = known & (code == c)
        total = np.bincount(cell[sel], weights=dur[sel], minlength=size).reshape(shape)
        out[names[int(c)]] = out.get(names[int(c)], np.zeros(shape)) + total
    return out


def phase_cpu_totals(
    phases: Mapping[str, np.ndarray], names: Sequence[str], world_size: int, steps: np.ndarray
) -> dict[str, np.ndarray]:
    """Training-thread CPU ns per phase name, rank and step (``Window.phase_cpu_ns``).

    Args:
        phases: ``rank``, ``step``, ``phase`` (index into ``names``, checked by
            `phase_totals`), ``cpu_ns`` (-1 unknown).
        names: phase names (``PHASES`` followed by the run's user phase names).
        world_size: R.
        steps: sorted step ids (S,).

    Returns:
        Name -> float64 (R, S) for each phase with a span of known CPU time: the sum over
        the cell's spans, 0 where the rank ran none, NaN where one of them is unknown.
    """
    shape = (world_size, steps.shape[0])
    size = shape[0] * shape[1]
    code = np.asarray(phases["phase"], dtype=np.int64)
    cpu = np.asarray(phases["cpu_ns"], dtype=np.int64)
    cell, ok = cell_index(phases["rank"], phases["step"], world_size, steps)
    known = cpu >= 0
    out: dict[str, np.ndarray] = {}
    for c in np.unique(code[ok & known]):
        sel = ok & (code == c)
        total = np.bincount(cell[sel & known], weights=cpu[sel & known], minlength=size)
        unknown = np.bincount(cell[sel & ~known], minlength=size)
        name = names[int(c)]
        grid = np.where(unknown > 0, np.nan, total).reshape(shape)
        out[name] = out[name] + grid if name in out else grid
    return out


def device_means(
    samples: Mapping[str, np.ndarray],
    step_rows: Mapping[str, np.ndarray],
    world_size: int,
    steps: np.ndarray,
) -> dict[str, np.ndarray]:
    """Average device and host samples into the step each falls in (``DEVICE_COLUMNS``).

    A sample belongs to the step of its rank with ``t_start <= t <= t_end``. Unknown values
    (NaN, or -1 for the integer columns) are left out of the mean; ``throttle`` is the
    bitwise OR of the known throttle reasons.

    Args:
        samples: ``SAMPLE_COLUMNS`` plus ``rank``.
        step_rows: ``rank``, ``step``, ``t_start``, ``t_end`` (int64 hub-clock ns).
        world_size: R.
        steps: sorted step ids (S,).

    Returns:
        Name -> float64 (R, S), NaN where no sample fell.
    """
    shape = (world_size, steps.shape[0])
    out = {name: np.full(shape, np.nan) for name in DEVICE_COLUMNS}
    n = np.asarray(samples["t"]).shape[0]
    srank = np.asarray(step_rows["rank"], dtype=np.int64)
    if n == 0 or srank.shape[0] == 0:
        return out
    t0 = np.asarray(step_rows["t_start"], dtype=np.int64)
    t1 = np.asarray(step_rows["t_end"], dtype=np.int64)
    keep = (t0 != NO_TIME) & (t1 != NO_TIME) & (srank >= 0) & (srank < world_size)
    if not keep.any():  # no step of known span (every start or end unknown): no sample falls
        return out
    srank, t0, t1 = srank[keep], t0[keep], t1[keep]
    sstep = np.asarray(step_rows["step"], dtype=np.int64)[keep]
    rank = np.asarray(samples["rank"], dtype=np.int64)
    t = np.asarray(samples["t"], dtype=np.int64)
    # Sort steps by (rank, t_start) and look each sample up by the same key.
    order = np.lexsort((t0, srank))
    srank, t0, t1, sstep = srank[order], t0[order], t1[order], sstep[order]
    pos = np.empty(n, dtype=np.int64)
    for r in np.unique(rank):
        lo, hi = np.searchsorted(srank, [r, r + 1])
        sel = rank == r
        pos[sel] = lo + np.searchsorted(t0[lo:hi], t[sel], side="right") - 1
        pos[sel & (pos < lo)] = -1
    hit = pos >= 0
    p = np.where(hit, pos, 0)
    hit &= (srank[p] == rank) & (t <= t1[p]) & (t != NO_TIME)
    cell, ok = cell_index(rank, sstep[p], world_size, steps)
    ok &= hit
    size = shape[0] * shape[1]
    for name in DEVICE_COLUMNS:
        col = np.asarray(samples[name])
        if name == "throttle":
            continue
        v = col.astype(np.float64)
        known = ok & (~np.isnan(v) if col.dtype.kind == "f" else col >= 0)
        total = np.bincount(cell[known], weights=v[known], minlength=size)
        count = np.bincount(cell[known], minlength=size)
        with np.errstate(invalid="ignore", divide="ignore"):
            out[name] = np.where(count > 0, total / np.maximum(count, 1), np.nan).reshape(shape)
    thr = np.asarray(samples["throttle"], dtype=np.int64)
    known = ok & (thr >= 0)
    if known.any():
        c = cell[known]
        o = np.argsort(c, kind="stable")
        cs = c[o]
        starts = np.flatnonzero(np.r_[True, cs[1:] != cs[:-1]])
        ored = np.bitwise_or.reduceat(thr[known][o], starts)
        flat = out["throttle"].reshape(-1)
        flat[cs[starts]] = ored.astype(np.float64)
    return out


def coll_rows(cols: Mapping[str, np.ndarray], t0_ns: int, mask: np.ndarray) -> CollRows:
    """The raw rows selected by ``mask`` as `CollRows`, times relative to ``t0_ns``, in a
    canonical order (step, rank, group, seq) so every source gives the same table.

    Args:
        cols: ``ROW_COLUMNS`` arrays, times as int64 hub-clock ns.
        t0_ns: origin of the relative times.
        mask: rows to keep.

    Returns:
        The rows.
    """
    sel = {c: np.asarray(cols[c])[mask] for c in ROW_COLUMNS}
    order = np.lexsort((sel["seq"], sel["group"], sel["rank"], sel["step"]))
    return CollRows(
        **{c: (relative_ns(v, t0_ns) if c.startswith("t_") else v)[order] for c, v in sel.items()}
    )


def _with_rank(table: Mapping[str, np.ndarray] | None, columns: Sequence[str]) -> dict:
    if table is None:
        return {c: np.zeros(0, dtype=np.int64) for c in ("rank", *columns)}
    missing = [c for c in ("rank", *columns) if c not in table]
    if missing:
        raise ValueError(f"table misses columns {missing}")
    n = np.asarray(table["rank"]).shape[0]
    for c in ("rank", *columns):
        if np.asarray(table[c]).shape != (n,):
            raise ValueError(
                f"column {c!r} has shape {np.asarray(table[c]).shape}, expected ({n},)"
            )
    return {c: np.asarray(table[c]) for c in ("rank", *columns)}


def build_window(
    *,
    job: str,
    run: str,
    identities: Mapping[int, Mapping[str, Any]],
    groups: Sequence[Mapping[str, Any]],
    steps: Mapping[str, np.ndarray],
    phases: Mapping[str, np.ndarray] | None = None,
    colls: Mapping[str, np.ndarray] | None = None,
    samples: Mapping[str, np.ndarray] | None = None,
    phase_names: Sequence[str] = (),
    scope: str = "full",
    parent_run: str | None = None,
    manifest: Mapping[str, Any] | None = None,
    world_size: int | None = None,
    last: int | None = None,
    epoch: np.ndarray | None = None,
    clock_error_ns: np.ndarray | None = None,
    health: Mapping[str, Any] | None = None,
    keep_rows: bool = True,
) -> Window:
    """Build a complete `Window` from raw tables.

    Every table is the schema's columns (``collector.schema.TABLES``) plus ``rank``. The
    window covers the ``last`` highest step ids (all when None); its origin ``t0_ns`` is the
    earliest known step start in it. A repeated ``(rank, step)`` keeps its first row.
    Collectives are matched over all rows given, then kept when their step is in the window.

    Args:
        job, run, scope, parent_run: the run's names (ARCHITECTURE §3).
        identities: rank -> hello identity map (may carry ``incarnation``).
        groups: the ``groups`` entries (``id``, ``name``, ``ranks``...).
        steps, phases, colls, samples: raw tables with a ``rank`` column; the columns of
            ``schema.OPTIONAL_COLUMNS`` may be absent (unknown).
        phase_names: the user phase names indexed after ``schema.PHASES``.
        manifest: rank 0's manifest.
        world_size: R; defaults to the largest identity world size or rank + 1 seen.
        last: keep only this many most recent steps.
        epoch: per collective row, see :func:`match`.
        clock_error_ns: float64 (R,) per-rank clock uncertainty.
        health: counters passed through.
        keep_rows: attach the raw collective rows of the window's steps.

    Returns:
        The `Window`.

    Raises:
        ValueError: a table misses a column or has ragged columns, or a phase code is
            out of range.
    """
    st = _with_rank(
        _with_optional(steps, "steps"),
        ("step", "t_start", "t_end", *WORK_COLUMNS, *MEMORY_COLUMNS, *HOST_COLUMNS),
    )
    ph = _with_rank(_with_optional(phases, "phases"), ("step", "phase", "t0", "t1", "cpu_ns"))
    co = _with_rank(colls, tuple(COLL_COLUMNS)) if colls is not None else None
    if world_size is None:
        seen = [int(i.get("world_size", 0)) for i in identities.values()]
        seen += [int(r) + 1 for r in identities]
        seen += [int(st["rank"].max()) + 1] if st["rank"].shape[0] else []
        world_size = max(seen, default=0)
    R = int(world_size)
    step_ids = np.unique(st["step"].astype(np.int64))
    if last is not None:
        step_ids = step_ids[-int(last) :] if last > 0 else step_ids[:0]
    S = step_ids.shape[0]
    cell, ok = cell_index(st["rank"], st["step"], R, step_ids)
    t_start_raw = st["t_start"].astype(np.int64)
    known_start = ok & (t_start_raw != NO_TIME)
    t0_ns = int(t_start_raw[known_start].min()) if known_start.any() else 0

    def dense(values: np.ndarray) -> np.ndarray:
        grid = np.full(R * S, np.nan)
        idx = np.flatnonzero(ok)[::-1]  # reversed: the first of repeated rows is written last
        grid[cell[idx]] = values[idx]
        return grid.reshape(R, S)

    def numeric(name: str) -> np.ndarray:
        col = st[name]
        v = col.astype(np.float64)
        if col.dtype.kind != "f":
            v[col < 0] = np.nan
        return v

    present = np.zeros(R * S, dtype=bool)
    present[cell[ok]] = True
    present = present.reshape(R, S)
    names = (*PHASES, *phase_names)
    phase_ns = phase_totals(ph, names, R, step_ids)
    for name in phase_ns:
        phase_ns[name][~present] = np.nan
    phase_cpu_ns = phase_cpu_totals(ph, names, R, step_ids)
    for name in phase_cpu_ns:
        phase_cpu_ns[name][~present] = np.nan
    ranks = rank_info(identities, R)
    ginfo = group_info(groups, ranks)
    if co is not None and co["rank"].shape[0]:
        sizes = {gid: len(g.ranks) for gid, g in ginfo.items()}
        matched = match(co, sizes, t0_ns=t0_ns, epoch=epoch)
        coll = rank_step_aggregates(co, matched, R, step_ids)
        inst = matched.instances
        keep = np.isin(inst.step, step_ids)
        instances = InstanceTable(**{k: getattr(inst, k)[keep] for k in _INSTANCE_FIELDS})
        rows = coll_rows(co, t0_ns, np.isin(co["step"], step_ids)) if keep_rows else None
    else:
        coll = {name: np.zeros((R, S)) for name in COLL_AGGREGATES}
        instances = empty_instances()
        rows = None
    for name in coll:
        coll[name][~present] = np.nan
    if samples is not None:
        smp = _with_rank(samples, ("t", *DEVICE_COLUMNS))
        device = device_means(smp, st, R, step_ids)
    else:
        device = {name: np.full((R, S), np.nan) for name in DEVICE_COLUMNS}
    return Window(
        job=job,
        run=run,
        scope=scope,
        parent_run=parent_run,
        manifest=dict(manifest or {}),
        ranks=ranks,
        groups=ginfo,
        t0_ns=t0_ns,
        steps=step_ids,
        present=present,
        t_start=dense(relative_ns(st["t_start"], t0_ns)),
        t_end=dense(relative_ns(st["t_end"], t0_ns)),
        phase_ns=phase_ns,
        work={name: dense(numeric(name)) for name in WORK_COLUMNS},
        memory={name: dense(numeric(name)) for name in MEMORY_COLUMNS},
        device=device,
        coll=coll,
        instances=instances,
        rows=rows,
        clock_error_ns=None if clock_error_ns is None else np.asarray(clock_error_ns, float),
        health=dict(health or {}),
        host={name: dense(numeric(name)) for name in HOST_COLUMNS},
        phase_cpu_ns=phase_cpu_ns,
    )


def _with_optional(
    table: Mapping[str, np.ndarray] | None, name: str
) -> Mapping[str, np.ndarray] | None:
    """The table with the schema's optional columns it lacks added as unknown (a table
    from an older collector or another generator)."""
    if table is None or "rank" not in table:
        return table
    absent = [c for c in OPTIONAL_COLUMNS.get(name, ()) if c not in table]
    if not absent:
        return table
    n = np.asarray(table["rank"]).shape[0]
    out = dict(table)
    for c in absent:
        dt = TABLES[name][c]
        out[c] = np.full(n, np.nan if dt.kind == "f" else -1, dtype=dt)
    return out


_INSTANCE_FIELDS = tuple(InstanceTable.__dataclass_fields__)
