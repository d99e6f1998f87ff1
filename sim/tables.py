"""Turn one simulated step into the columnar tables a collector would record: the step row
(work, memory), phase spans, collective rows and a device/host sample per rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rankscope.collector import schema

if TYPE_CHECKING:
    from rankscope.sim.engine import Cluster, _Records
    from rankscope.sim.workload import Work

MIB = 1 << 20
ACT_BYTES_PER_TOKEN_LAYER_HIDDEN = 34.0
"""Activation memory per token, per layer, per hidden unit (bf16, no recomputation)."""
HOST_RSS = 30 * (1 << 30)


@dataclass(frozen=True)
class StepTables:
    """Everything every rank records in one step (or a few), concatenated in rank order.

    Each table holds each rank's rows contiguously: rank ``r``'s rows of table ``name`` are
    ``offsets[name][r]:offsets[name][r + 1]``. Columns follow ``schema.TABLES`` (times int64
    ns on the hub clock) plus ``rank``. For one step, ``steps`` has one row per rank.
    """

    step: int
    """The (first) step."""
    steps: dict[str, np.ndarray]
    phases: dict[str, np.ndarray]
    colls: dict[str, np.ndarray]
    samples: dict[str, np.ndarray]
    offsets: dict[str, np.ndarray]
    """Table name -> int64 (world + 1,) row offsets per rank."""

    @property
    def coll_offsets(self) -> np.ndarray:
        return self.offsets["colls"]

    @property
    def phase_offsets(self) -> np.ndarray:
        return self.offsets["phases"]

    def table(self, name: str) -> dict[str, np.ndarray]:
        """A table by name (``steps``, ``phases``, ``colls``, ``samples``)."""
        return getattr(self, name)

    def rank_tables(
        self, rank: int, names: tuple[str, ...] | None = None
    ) -> dict[str, dict[str, np.ndarray]]:
        """One rank's tables (views), ready for ``schema.steps_message``.

        Args:
            rank: the rank.
            names: the tables wanted (default: all four).

        Returns:
            Table name -> column dict.
        """
        out = {}
        for name in names or TABLE_NAMES:
            off = self.offsets[name]
            a, b = int(off[rank]), int(off[rank + 1])
            out[name] = {k: v[a:b] for k, v in self.table(name).items()}
        return out


TABLE_NAMES = ("steps", "phases", "colls", "samples")


def merge_rows(parts: list[StepTables], name: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One table of consecutive steps, joined so that each rank's rows are contiguous (in
    step order).

    Args:
        parts: tables of consecutive steps of one run.
        name: the table (``steps``, ``phases``, ``colls``, ``samples``).

    Returns:
        ``(columns, offsets)``: rank ``r``'s rows are ``offsets[r]:offsets[r + 1]``.
    """
    if len(parts) == 1:
        return parts[0].table(name), parts[0].offsets[name]
    world = parts[0].offsets[name].shape[0] - 1
    offs = [p.offsets[name] for p in parts]
    counts = np.stack([np.diff(o) for o in offs], axis=1)  # (world, steps)
    bases = np.cumsum([0] + [int(o[-1]) for o in offs[:-1]])
    starts = np.stack([o[:-1] for o in offs], axis=1) + bases[None, :]
    flat = counts.ravel()
    out = np.zeros(world + 1, dtype=np.int64)
    np.cumsum(counts.sum(axis=1), out=out[1:])
    # row i of the joined table comes from (its block's start) + (i - block's new start)
    gather = np.repeat(starts.ravel() - (np.cumsum(flat) - flat), flat)
    gather += np.arange(int(out[-1]))
    cols = {
        k: np.concatenate([p.table(name)[k] for p in parts])[gather] for k in parts[0].table(name)
    }
    return cols, out


def merge_steps(parts: list[StepTables]) -> StepTables:
    """Join consecutive steps so that each rank's rows of all of them are contiguous, in
    step order: one message per rank can then carry several steps.

    Args:
        parts: tables of consecutive steps of one run.

    Returns:
        The joined tables; ``step`` is the first step's.
    """
    if len(parts) == 1:
        return parts[0]
    merged = {name: merge_rows(parts, name) for name in TABLE_NAMES}
    return StepTables(
        step=parts[0].step,
        offsets={name: off for name, (_, off) in merged.items()},
        **{name: cols for name, (cols, _) in merged.items()},
    )


def _times(values: np.ndarray, t0_ns: int, offset: np.ndarray) -> np.ndarray:
    return np.rint(values).astype(np.int64) + np.int64(t0_ns) + offset


def _concat(
    cluster: Cluster, k: int, recs: list[_Records], table: str
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Stack each stage's records rank-major and join the stages (they are rank-contiguous)."""
    _, dp, tp = cluster.shape
    dtypes = schema.TABLES[table]
    parts = [r.stack((dp, tp), dtypes) for r in recs]
    counts = np.repeat([len(r.rows) for r in recs], dp * tp)
    offsets = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    cols: dict[str, np.ndarray] = {}
    rank = np.repeat(np.arange(counts.shape[0]), counts)
    offset = cluster.clock_offset[rank]
    for name in recs[0].names:
        joined = np.concatenate([p[name] for p in parts])
        if name.startswith("t"):
            cols[name] = _times(joined, cluster.t0_ns, offset)
        else:
            cols[name] = joined.astype(dtypes[name], copy=False)
    n = int(offsets[-1])
    cols["step"] = np.full(n, k, dtype=np.int64)
    # Columns the records do not carry (a phase's ``cpu_ns``) start unknown; the host
    # model fills them (`sim.host.fill_columns`).
    for name, dt in dtypes.items():
        if name not in cols:
            cols[name] = np.full(n, np.nan if dt.kind == "f" else -1, dtype=dt)
    cols["rank"] = rank
    return cols, offsets


def assemble(
    cluster: Cluster,
    k: int,
    t_start: np.ndarray,
    t_end: np.ndarray,
    compute: np.ndarray,
    work: Work,
    colls: list[_Records],
    phases: list[_Records],
) -> StepTables:
    """Build the `StepTables` of step ``k``.

    Args:
        cluster: the simulated job (layout, hardware, clock offsets).
        k: the step.
        t_start, t_end: float64 ``(pp, dp, tp)`` step bounds, relative ns.
        compute: float64 ``(pp, dp, tp)`` compute time in the step.
        work: the step's packed work, ``(dp, grad_accum)``.
        colls, phases: per-stage records.

    Returns:
        The step's tables.
    """
    from rankscope.sim.engine import StepTables

    sc, lay, hw = cluster.scenario, cluster.layout, cluster.hardware
    f = sc.fault
    shape = cluster.shape
    world = lay.world_size
    ranks = np.arange(world)
    offset = cluster.clock_offset
    rng = np.random.default_rng([sc.seed & 0xFFFFFFFF, k, 3])

    def per_rank(dp_values: np.ndarray) -> np.ndarray:
        return np.broadcast_to(dp_values[None, :, None], shape).ravel()

    tokens = work.tokens.sum(axis=1)
    attn = work.attn_cost.sum(axis=1)
    peak_micro = work.tokens.max(axis=1)
    steps = schema.empty_table("steps", world)
    steps["step"][:] = k
    steps["t_start"][:] = _times(t_start.ravel(), cluster.t0_ns, offset)
    steps["t_end"][:] = _times(t_end.ravel(), cluster.t0_ns, offset)
    steps["tokens"][:] = np.rint(per_rank(tokens))
    steps["valid_tokens"][:] = np.rint(per_rank(work.valid_tokens.sum(axis=1)))
    steps["samples"][:] = np.rint(per_rank(work.samples.sum(axis=1)))
    steps["attn_cost"][:] = per_rank(attn)
    steps["flops"][:] = per_rank(3.0 * (cluster.flops_token * tokens + cluster.flops_attn * attn))
    act = (
        peak_micro
        * sc.model.hidden
        * cluster.layers
        * ACT_BYTES_PER_TOKEN_LAYER_HIDDEN
        / sc.layout.tp
    )
    growth = 0.0
    retries = np.zeros(world, dtype=np.int32)
    if f.mechanism == "allocator_growth":
        # Fragmentation: the caching allocator reserves more each step and retries more.
        growth = f.magnitude * (k + 1) * 48.0 * MIB
        retries[:] = int(f.magnitude * (k + 1) / 8.0)
    peak = cluster.static_bytes + per_rank(act)
    # The caching allocator keeps what it reserved: reserve follows the highest peak so far
    # (plus what fragmentation adds).
    cluster.reserved_bytes = np.maximum(cluster.reserved_bytes, peak * 1.04)
    steps["mem_allocated"][:] = np.full(world, cluster.static_bytes, dtype=np.int64)
    steps["mem_peak"][:] = peak.astype(np.int64)
    steps["mem_reserved"][:] = (cluster.reserved_bytes + growth).astype(np.int64)
    steps["alloc_retries"][:] = retries
    steps["rank"] = ranks

    phase_cols, phase_off = _concat(cluster, k, phases, "phases")
    coll_cols, coll_off = _concat(cluster, k, colls, "colls")

    topo = sc.topology
    dur = np.maximum(t_end - t_start, 1.0).ravel()
    util = np.clip(compute.ravel() / dur, 0.0, 1.0)
    dev = lay.device
    host = lay.host
    slow_input = hw.input_extra_ms[host] > 0
    samples = schema.empty_table("samples", world)
    samples["t"][:] = _times(((t_start + t_end) / 2).ravel(), cluster.t0_ns, offset)
    samples["sm_clock_mhz"][:] = (
        topo.sm_clock_mhz
        * np.minimum(hw.speed[dev], 1.0)
        * (1.0 + 0.002 * rng.standard_normal(world))
    )
    samples["mem_clock_mhz"][:] = topo.mem_clock_mhz
    throttled = hw.throttle[dev] != 0
    power = topo.power_limit_w * (0.35 + 0.55 * util) * (1.0 + 0.02 * rng.standard_normal(world))
    samples["power_w"][:] = np.where(throttled, topo.power_limit_w * 0.99, power)
    samples["temp_c"][:] = hw.temp_c[dev] + 0.5 * rng.standard_normal(world)
    samples["throttle"][:] = hw.throttle[dev]
    samples["gpu_util"][:] = 100.0 * util
    samples["cpu_pct"][:] = np.where(slow_input, 97.0, 38.0) + 3.0 * rng.standard_normal(world)
    samples["load1"][:] = np.where(slow_input, 70.0, 22.0) + rng.standard_normal(world)
    samples["rss_bytes"][:] = HOST_RSS + (ranks % 7) * 64 * MIB
    samples["rank"] = ranks
    one_each = np.arange(world + 1, dtype=np.int64)
    return StepTables(
        step=k,
        steps=steps,
        phases=phase_cols,
        colls=coll_cols,
        samples=samples,
        offsets={"steps": one_each, "phases": phase_off, "colls": coll_off, "samples": one_each},
    )
