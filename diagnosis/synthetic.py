"""Build a `Window` directly from dense arrays.

The hub builds windows from received rows (``arrivals.build_window``). Hand-computed test
cases, benchmarks and teaching examples want the other direction: say exactly what each
rank did in each step and get the `Window` the analyses read. Anything not given is
"unknown" (NaN, -1), as in a window from a run that did not record it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rankscope.collector.schema import MESH_DIMS
from rankscope.diagnosis.window import (
    COLL_AGGREGATES,
    DEVICE_COLUMNS,
    HOST_COLUMNS,
    MEMORY_COLUMNS,
    WORK_COLUMNS,
    GroupInfo,
    InstanceTable,
    RankInfo,
    Window,
)


def rank_layout(
    world: int,
    ranks_per_host: int = 8,
    hosts_per_rack: int = 4,
    tp: int = 1,
    pp: int = 1,
) -> RankInfo:
    """A rail-optimised layout: rank r sits on host r // ranks_per_host, GPU and rail
    r % ranks_per_host; mesh coordinates tp fastest, then dp, then pp.

    Args:
        world: number of ranks.
        ranks_per_host: GPUs per host.
        hosts_per_rack: hosts per rack.
        tp: tensor-parallel degree.
        pp: pipeline-parallel degree.

    Returns:
        The rank table.
    """
    if world <= 0 or ranks_per_host <= 0 or hosts_per_rack <= 0:
        raise ValueError(
            f"world ({world}), ranks_per_host ({ranks_per_host}) and hosts_per_rack "
            f"({hosts_per_rack}) must be positive"
        )
    if world % (tp * pp):
        raise ValueError(f"world {world} is not divisible by tp {tp} x pp {pp}")
    r = np.arange(world, dtype=np.int32)
    host = r // ranks_per_host
    n_hosts = int(host.max()) + 1
    local = r % ranks_per_host
    rack = host // hosts_per_rack
    dp = world // (tp * pp)
    mesh = {
        "tp": r % tp,
        "dp": (r // tp) % dp,
        "pp": r // (tp * dp),
        "cp": np.zeros(world, np.int32),
        "ep": np.zeros(world, np.int32),
    }
    return RankInfo(
        host=host.astype(np.int32),
        hosts=tuple(f"node{h:04d}" for h in range(n_hosts)),
        node_rank=host.astype(np.int32),
        local_rank=local.astype(np.int32),
        gpu_index=local.astype(np.int32),
        rail=local.astype(np.int32),
        rack=rack.astype(np.int32),
        racks=tuple(f"rack{k:03d}" for k in range(int(rack.max()) + 1)),
        nic=local.astype(np.int32),
        nics=tuple(f"mlx5_{i}" for i in range(min(ranks_per_host, world))),
        shard=(r // tp).astype(np.int32) % max(dp, 1),
        mesh={d: mesh[d].astype(np.int32) for d in MESH_DIMS},
        incarnation=np.zeros(world, np.int32),
    )


def make_groups(ranks: RankInfo, members: list[list[int]], names: list[str] | None = None):
    """Build the group table from member lists (group id = position).

    Args:
        ranks: the rank table (to know which groups cross hosts).
        members: global ranks of each group, in group-rank order.
        names: group names (default ``g<id>``).

    Returns:
        ``{id: GroupInfo}``.
    """
    out = {}
    for gid, m in enumerate(members):
        hosts = {int(ranks.host[r]) for r in m}
        out[gid] = GroupInfo(
            id=gid,
            name=names[gid] if names else f"g{gid}",
            ranks=tuple(int(r) for r in m),
            crosses_hosts=len(hosts) > 1,
        )
    return out


def instance_table(n: int = 0, **cols: Any) -> InstanceTable:
    """An instance table with the given columns; others get consistent defaults.

    ``skew`` defaults to ``last - first`` and ``n_arrived`` to ``n_members``.

    Args:
        n: number of rows when no column is given.
        **cols: any `InstanceTable` field as an array.

    Returns:
        The table.
    """
    if cols:
        n = len(next(iter(cols.values())))
    ints = {"group": np.int32, "seq": np.int64, "step": np.int64, "op": np.int8}
    ints.update(nbytes=np.int64, n_members=np.int32, n_arrived=np.int32, last_rank=np.int32)
    full: dict[str, np.ndarray] = {}
    for name, dt in ints.items():
        full[name] = np.asarray(cols.get(name, np.zeros(n)), dtype=dt)
    for name in ("first", "last", "margin", "transfer", "device_transfer"):
        full[name] = np.asarray(cols.get(name, np.full(n, np.nan)), dtype=np.float64)
    full["skew"] = np.asarray(cols.get("skew", full["last"] - full["first"]), dtype=np.float64)
    if "n_arrived" not in cols:
        full["n_arrived"] = full["n_members"].copy()
    for name, arr in full.items():
        if arr.shape != (n,):
            raise ValueError(f"instance column {name!r} has shape {arr.shape}, expected ({n},)")
    return InstanceTable(**full)


def make_window(
    t_start: np.ndarray,
    t_end: np.ndarray,
    *,
    ranks: RankInfo | None = None,
    groups: dict[int, GroupInfo] | None = None,
    phase_ns: dict[str, np.ndarray] | None = None,
    work: dict[str, np.ndarray] | None = None,
    memory: dict[str, np.ndarray] | None = None,
    device: dict[str, np.ndarray] | None = None,
    coll: dict[str, np.ndarray] | None = None,
    instances: InstanceTable | None = None,
    steps: np.ndarray | None = None,
    manifest: dict[str, Any] | None = None,
    clock_error_ns: np.ndarray | None = None,
    run: str = "run",
    scope: str = "full",
    present: np.ndarray | None = None,
    host: dict[str, np.ndarray] | None = None,
    phase_cpu_ns: dict[str, np.ndarray] | None = None,
) -> Window:
    """Assemble a `Window` from dense ``(R, S)`` arrays.

    Args:
        t_start: float (R, S) step start, relative ns.
        t_end: float (R, S) step end, relative ns.
        ranks: rank table (default: `rank_layout` with 8 ranks a host).
        groups: group table (default: none).
        phase_ns: phase name -> (R, S) ns.
        work: ``WORK_COLUMNS`` subset -> (R, S).
        memory: ``MEMORY_COLUMNS`` subset -> (R, S).
        device: ``DEVICE_COLUMNS`` subset -> (R, S).
        coll: ``COLL_AGGREGATES`` subset -> (R, S) (missing ones are zero).
        instances: collective instances (default: empty).
        steps: step ids (default 0..S-1).
        manifest: run manifest.
        clock_error_ns: (R,) alignment uncertainty.
        run: run id.
        scope: run scope.
        present: bool (R, S) (default: where both times are finite).
        host: ``HOST_COLUMNS`` subset -> (R, S) (GC pauses, thread CPU time).
        phase_cpu_ns: phase name -> (R, S) training-thread CPU ns in that phase.

    Returns:
        The window.
    """
    t_start = np.asarray(t_start, dtype=np.float64)
    t_end = np.asarray(t_end, dtype=np.float64)
    if t_start.ndim != 2 or t_start.shape != t_end.shape:
        raise ValueError(f"t_start {t_start.shape} and t_end {t_end.shape} must be equal 2-D")
    n_ranks, n_steps = t_start.shape
    ranks = ranks if ranks is not None else rank_layout(n_ranks)
    if ranks.world_size != n_ranks:
        raise ValueError(f"rank table has {ranks.world_size} ranks, arrays have {n_ranks}")

    def dense(src: dict[str, np.ndarray] | None, names: tuple[str, ...], fill: float):
        out = {}
        src = src or {}
        unknown = set(src) - set(names)
        if unknown:
            raise ValueError(f"unknown columns {sorted(unknown)}; expected some of {names}")
        for name in names:
            arr = np.asarray(src.get(name, np.full((n_ranks, n_steps), fill)), dtype=np.float64)
            if arr.shape != (n_ranks, n_steps):
                raise ValueError(f"{name!r} has shape {arr.shape}, expected {(n_ranks, n_steps)}")
            out[name] = arr
        return out

    phases = {}
    for name, arr in (phase_ns or {}).items():
        arr = np.asarray(arr, dtype=np.float64)
        if arr.shape != (n_ranks, n_steps):
            raise ValueError(f"phase {name!r} has shape {arr.shape}, expected {t_start.shape}")
        phases[name] = arr
    ok = np.isfinite(t_start) & np.isfinite(t_end)
    return Window(
        job="job",
        run=run,
        scope=scope,
        parent_run=None,
        manifest=dict(manifest or {}),
        ranks=ranks,
        groups=dict(groups or {}),
        t0_ns=0,
        steps=np.arange(n_steps, dtype=np.int64) if steps is None else np.asarray(steps),
        present=ok if present is None else np.asarray(present, dtype=bool),
        t_start=t_start,
        t_end=t_end,
        phase_ns=phases,
        work=dense(work, WORK_COLUMNS, np.nan),
        memory=dense(memory, MEMORY_COLUMNS, np.nan),
        device=dense(device, DEVICE_COLUMNS, np.nan),
        coll=dense(coll, COLL_AGGREGATES, 0.0),
        instances=instances if instances is not None else instance_table(0),
        clock_error_ns=None if clock_error_ns is None else np.asarray(clock_error_ns, float),
        host=dense(host, HOST_COLUMNS, np.nan),
        phase_cpu_ns={k: np.asarray(v, dtype=np.float64) for k, v in (phase_cpu_ns or {}).items()},
    )
