"""The host side of a simulated rank: time spent between recorded phases, garbage
collection, and the training thread's CPU time.

A training thread is not only in phases. Before each phase it runs Python (the loss,
hooks, ``zero_grad``, logging): the *host gap*, recorded by nobody. Garbage collection
stops the thread wherever it happens; young collections are short and frequent, a full
collection of a large heap takes tens of milliseconds. Both are CPU work, so they count in
the thread's CPU time; a blocking call (a synchronous write, a network round trip) takes
wall time without CPU. When another process competes for the host's cores, the thread
gets only a share of a core: everything it has to compute (its gaps, kernel launches, the
optimizer's many small launches) takes longer in wall time, while its CPU time stays what
the work needs. The GPU waits for the launches, so its utilisation drops while its clocks
stay nominal.

`HostModel.step` draws one step's gaps; `fill_columns` writes the CPU, GC and expert
columns into the step's tables where the wire schema has them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rankscope.collector import schema
from rankscope.sim.draw import field_rng

if TYPE_CHECKING:
    from rankscope.sim.spec import Scenario
    from rankscope.sim.tables import StepTables
    from rankscope.sim.topology import Layout

PHASE_CPU_SHARE = {
    "input": 0.1,
    "forward": 0.9,
    "backward": 0.9,
    "optimizer": 0.95,
    "checkpoint": 0.4,
    "eval": 0.9,
    "memory": 0.9,
    "pp_wait": 0.3,
    "recovery": 0.5,
}
"""Thread CPU time over wall time of each phase on a healthy host (waiting for the data
loader or a receive barely uses the CPU; launching kernels and synchronising does)."""
GAP_CPU_SHARE = 0.95
"""Host gaps are Python: CPU work."""
WAIT_CPU_SHARE = 0.5
"""The rest of the step outside phases (waiting for gradient buckets, noticing completions)."""
RUNQ_SHARE = 0.002
"""Run-queue delay of an uncontended training thread, share of its step (wake-ups)."""
LAUNCH_CPU = 0.3
"""Host CPU per ns of GPU work in forward and backward (launches, Python); a thread that
gets a smaller share of a core than this cannot keep the GPU fed."""
OPTIMIZER_LAUNCH_CPU = 0.6
"""The same for the optimizer (many small kernels)."""
YOUNG_GC_PER_STEP = 6.0
"""Mean young-generation collections per step and rank."""
YOUNG_GC_US = 40.0
"""Mean length of one young collection."""
CONTENDED_CPU_PCT = 99.0
"""Host CPU % a contended host reports (every core busy)."""


@dataclass(frozen=True)
class HostStep:
    """One step's host time outside phases, per rank ``(pp, dp, tp)``."""

    gaps: np.ndarray
    """float64 (slots, pp, dp, tp): ns spent before each phase boundary (gap, GC, blocking)."""
    gc_ns: np.ndarray
    gc_count: np.ndarray
    blocked_ns: np.ndarray
    """Off-CPU host time (blocking calls) inside ``gaps``."""
    cap: np.ndarray
    """Share of a core the training thread gets (1.0: all it asks for)."""


class HostModel:
    """Host-side behaviour of every rank of a run: gaps, collections, CPU share, and the
    host faults (``host_pause``, ``cpu_contention``, ``unexplained_straggler``)."""

    def __init__(self, scenario: Scenario, layout: Layout, n_slots: int, shape: tuple) -> None:
        """Args:
        scenario: the resolved scenario.
        layout: the run's layout.
        n_slots: phase boundaries per step on every stage (the fewest of any stage).
        shape: ``(pp, dp, tp)``.
        """
        self.scenario, self.shape, self.n_slots = scenario, shape, max(1, n_slots)
        f = scenario.fault
        self.mech = f.mechanism
        seed = scenario.seed
        host = layout.host.reshape(shape)
        self.contended = (
            host == f.host if f.mechanism == "cpu_contention" else np.zeros(shape, dtype=bool)
        )
        self.blocker = (
            layout.device.reshape(shape) == f.device
            if f.mechanism == "unexplained_straggler"
            else np.zeros(shape, dtype=bool)
        )
        # Where the blocking call sits in the step: one boundary, fixed for the run.
        self.block_slot = int(field_rng(seed, "host.block_slot").integers(self.n_slots))
        # Full collections: each rank on its own period (heaps differ) and phase, so the
        # ranks that pause change from step to step.
        rng = field_rng(seed, "host.pause")
        world = int(np.prod(shape))
        every = max(f.every, 1)
        self.pause_period = every * rng.uniform(0.7, 1.3, world).reshape(shape)
        self.pause_phase = rng.uniform(0.0, 1.0, world).reshape(shape) * self.pause_period
        self.gap_ns = 1e3 * scenario.workload.host_gap_us

    def active(self, k: int) -> bool:
        """Whether the scenario's host fault acts in step ``k`` (from its onset)."""
        return k >= self.scenario.fault.onset

    def cap(self, k: int) -> np.ndarray:
        """Share of a core each rank's thread gets in step ``k``."""
        cap = np.ones(self.shape)
        if self.mech == "cpu_contention" and self.active(k):
            cap[self.contended] = self.scenario.fault.magnitude
        return cap

    def step(self, k: int, warmup: np.ndarray | float = 1.0) -> HostStep:
        """Draw step ``k``'s host time before each phase boundary.

        Args:
            k: the step.
            warmup: factor on host work during the warm-up (1.0 after it).

        Returns:
            The step's gaps and their parts.
        """
        seed = self.scenario.seed & 0xFFFFFFFF
        rng = np.random.default_rng([seed, k, 5])
        shape, slots = self.shape, self.n_slots
        cap = self.cap(k)
        gaps = self.gap_ns * np.exp(0.3 * rng.standard_normal((slots, *shape))) * warmup
        count = rng.poisson(YOUNG_GC_PER_STEP, shape)
        gc = 1e3 * YOUNG_GC_US * count * np.exp(0.3 * rng.standard_normal(shape))
        slot = rng.integers(0, slots, shape)
        blocked = np.zeros(shape)
        f = self.scenario.fault
        if self.mech == "host_pause":
            frng = np.random.default_rng([seed, k, 6])
            due = np.floor((k + 1 + self.pause_phase) / self.pause_period) > np.floor(
                (k + self.pause_phase) / self.pause_period
            )
            full = 1e6 * f.magnitude * np.exp(0.35 * frng.standard_normal(shape))
            gc = gc + np.where(due, full, 0.0)
            count = count + due
        gaps[(slot, *np.indices(shape))] += gc
        gaps /= cap[None]  # Python and collection are CPU work: a smaller share takes longer
        if self.mech == "unexplained_straggler" and self.active(k):
            frng = np.random.default_rng([seed, k, 7])
            extra = 1e6 * f.magnitude * np.exp(0.1 * frng.standard_normal(shape))
            blocked = np.where(self.blocker, extra, 0.0)
            gaps[self.block_slot] += blocked
        return HostStep(
            gaps=gaps, gc_ns=gc / cap, gc_count=count.astype(np.int64), blocked_ns=blocked, cap=cap
        )


def fill_columns(
    tables: StepTables,
    host: HostStep,
    expert_tokens: np.ndarray | None,
    contended_rank: np.ndarray,
    seed: int,
    k: int,
) -> None:
    """Write the host columns of one step where the wire schema has them: per step
    ``gc_ns``, ``gc_count``, ``cpu_ns`` and ``runq_ns`` (training thread) and
    ``expert_tokens``; per phase
    ``cpu_ns``; and a saturated host CPU % on contended hosts.

    Args:
        tables: the step's tables (columns already present are overwritten in place).
        host: the step's host time.
        expert_tokens: tokens routed to each rank's experts (None: a dense model).
        contended_rank: bool (world,) ranks whose host is contended in this step.
        seed: the scenario seed.
        k: the step.
    """
    steps, phases = tables.steps, tables.phases
    world = steps["step"].shape[0]
    cap = host.cap.ravel()
    rng = np.random.default_rng([seed & 0xFFFFFFFF, k, 8])
    wall = (phases["t1"] - phases["t0"]).astype(np.float64)
    share = np.array([PHASE_CPU_SHARE.get(n, 0.5) for n in schema.PHASES])
    ph = phases["phase"].astype(np.int64)
    known = ph < share.shape[0]
    wanted = np.where(known, share[np.minimum(ph, share.shape[0] - 1)], 0.5)
    ratio = np.minimum(wanted, cap[phases["rank"]])
    cpu = np.clip(wall * ratio * (1.0 + 0.02 * rng.standard_normal(wall.shape[0])), 0.0, wall)
    if "cpu_ns" in schema.PHASE_COLUMNS:
        phases["cpu_ns"] = np.rint(cpu).astype(np.int64)
    in_phases = np.bincount(phases["rank"], weights=wall, minlength=world)
    phase_cpu = np.bincount(phases["rank"], weights=cpu, minlength=world)
    step_wall = (steps["t_end"] - steps["t_start"]).astype(np.float64)
    gaps = host.gaps.sum(axis=0).ravel()
    blocked = host.blocked_ns.ravel()
    rest = np.maximum(step_wall - in_phases - gaps, 0.0)
    step_cpu = (
        phase_cpu
        + (gaps - blocked) * np.minimum(GAP_CPU_SHARE, cap)
        + rest * np.minimum(WAIT_CPU_SHARE, cap)
    )
    if "cpu_ns" in steps:
        steps["cpu_ns"][:] = np.rint(step_cpu).astype(np.int64)
    if "runq_ns" in steps:
        # The run-queue delay: the CPU a phase wanted and its share did not give (a
        # blocked or waiting thread wants none), over a little queueing every thread has.
        short = np.bincount(phases["rank"], weights=wall * (wanted - ratio), minlength=world)
        base = RUNQ_SHARE * step_wall * np.exp(0.3 * rng.standard_normal(world))
        steps["runq_ns"][:] = np.rint(np.minimum(short + base, step_wall)).astype(np.int64)
    if "gc_ns" in steps:
        steps["gc_ns"][:] = np.rint(host.gc_ns.ravel()).astype(np.int64)
    if "gc_count" in steps:
        steps["gc_count"][:] = host.gc_count.ravel()
    if expert_tokens is not None and "expert_tokens" in steps:
        steps["expert_tokens"][:] = np.rint(expert_tokens).astype(np.int64)
    if contended_rank.any():
        samples = tables.samples
        n = int(contended_rank.sum())
        samples["cpu_pct"][contended_rank] = np.minimum(
            100.0, CONTENDED_CPU_PCT + 0.5 * rng.standard_normal(n)
        )
        samples["load1"][contended_rank] = 96.0 + 2.0 * rng.standard_normal(n)
        # Kernels run only a share of the time the starved thread takes to launch them.
        launch = np.maximum(1.0, LAUNCH_CPU / cap[contended_rank])
        samples["gpu_util"][contended_rank] /= launch
