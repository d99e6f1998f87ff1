"""The `Window`: what the diagnosis sees of one run — the last N steps of every rank.

The hub's store produces it (``Store.window(run, last=N)``), tests and the simulator can
build it from raw rows with :func:`rankscope.diagnosis.arrivals.build_window`, and every
analysis in this package is a pure function of it. Arrays are dense over ``(rank, step)``:
row ``r`` is global rank ``r``, column ``j`` is ``steps[j]``. Missing values are NaN.

Times inside a window are float64 nanoseconds relative to ``t0_ns`` (an int64 hub-clock
instant): float64 holds ns exactly only up to ~10^15, and epoch-ns is ~10^18.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RankInfo:
    """Static identity of every rank, columnar (index = global rank).

    Categorical fields are integer codes into a names tuple; -1 means unknown.
    """

    host: np.ndarray
    """int32 code into ``hosts``."""
    hosts: tuple[str, ...]
    node_rank: np.ndarray
    """int32 node rank from the launcher."""
    local_rank: np.ndarray
    gpu_index: np.ndarray
    rail: np.ndarray
    """int32 rail (NIC index on its host); -1 unknown."""
    rack: np.ndarray
    """int32 code into ``racks``."""
    racks: tuple[str, ...]
    nic: np.ndarray
    """int32 code into ``nics``."""
    nics: tuple[str, ...]
    shard: np.ndarray
    """int32 data shard; -1 unknown."""
    mesh: dict[str, np.ndarray]
    """Mesh coordinate per dimension (``dp``, ``tp``, ``pp``, ``cp``, ``ep``), int32."""
    incarnation: np.ndarray
    """int32 restart count of each rank's current process."""

    @property
    def world_size(self) -> int:
        return int(self.host.shape[0])


@dataclass(frozen=True)
class GroupInfo:
    """One process group."""

    id: int
    name: str
    ranks: tuple[int, ...]
    """Global ranks, in group-rank order."""
    crosses_hosts: bool
    """True when members sit on more than one host."""


@dataclass(frozen=True)
class InstanceTable:
    """One row per collective instance ``(group, seq)`` seen in the window (ARCHITECTURE §6).

    Times are float64 ns relative to the window's ``t0_ns``.
    """

    group: np.ndarray
    """int32 group id."""
    seq: np.ndarray
    """int64 sequence number in the group."""
    step: np.ndarray
    """int64 step of the instance (the step its last arriver recorded)."""
    op: np.ndarray
    """int8 index into ``schema.OPS``."""
    nbytes: np.ndarray
    """int64 bytes per rank (median over members)."""
    n_members: np.ndarray
    """int32 size of the group."""
    n_arrived: np.ndarray
    """int32 members whose row has been received."""
    first: np.ndarray
    """First entry time (min over members of ``t_enter``)."""
    last: np.ndarray
    """Last entry time (max over members of ``t_enter``)."""
    last_rank: np.ndarray
    """int32 global rank that entered last (ties: the lowest rank)."""
    margin: np.ndarray
    """How much later the last arriver came than the second last (ns)."""
    skew: np.ndarray
    """``last - first``."""
    transfer: np.ndarray
    """Median over members of ``t_exit - last`` (post-arrival service)."""
    device_transfer: np.ndarray
    """Median over members of ``t_end - max(t_start)`` where device times exist, else NaN."""

    def __len__(self) -> int:
        return int(self.group.shape[0])


@dataclass(frozen=True)
class CollRows:
    """Raw collective rows (one per rank and call), float64 ns times relative to ``t0_ns``.

    Kept only for the most recent steps (the store bounds it); aggregates over the whole
    window live in `Window.coll`.
    """

    rank: np.ndarray
    step: np.ndarray
    op: np.ndarray
    group: np.ndarray
    seq: np.ndarray
    nbytes: np.ndarray
    t_enter: np.ndarray
    t_start: np.ndarray
    t_end: np.ndarray
    t_exit: np.ndarray
    flags: np.ndarray

    def __len__(self) -> int:
        return int(self.rank.shape[0])


REDUCED_AGGREGATES = ("n", "exposed_wait_ns", "exposed_transfer_ns")
"""The part of ``COLL_AGGREGATES`` a window keeps apart for the calls a relay reduced
(`Window.reduced`): what the exposed-time union (`diagnosis.exposure`) adds for them."""

COLL_AGGREGATES = (
    "n",
    "coll_ns",
    "wait_ns",
    "transfer_ns",
    "late_ns",
    "times_last",
    "exposed_wait_ns",
    "exposed_transfer_ns",
    "overstay_ns",
)
"""Per-rank-step collective aggregates, all float64 (R, S):

- ``n``: collectives the rank called in the step;
- ``coll_ns``: Σ host time inside collectives (``t_exit - t_enter``);
- ``wait_ns``: Σ arrival wait ``clip(last - t_enter, 0, t_exit - t_enter)``;
- ``transfer_ns``: Σ post-arrival time ``t_exit - max(t_enter, last)``;
- ``late_ns``: Σ lateness ``t_enter - first``;
- ``times_last``: instances where the rank was the last to arrive;
- ``exposed_wait_ns`` / ``exposed_transfer_ns``: the same sums restricted to time the step
  could not hide: all of a blocking collective, and for asynchronous ones (``FLAG_ASYNC``,
  DDP buckets) only the part after the step's last asynchronous issue — the last gradient
  bucket is issued when backward compute ends, so anything after it is exposed. Buckets
  still in flight then overlap; ordered by exit, each is charged only the piece after the
  previous one ended, so the sums equal the union ``[last issue, last exit]``
  (``arrivals.async_cut``);
- ``overstay_ns``: Σ exposed time the rank stayed in a collective after its first member
  had left it. A collective's transfer ends for every member together; a member that
  leaves later was held by something of its own (its process not scheduled, a blocking
  call on the way out), and its peers wait for it at the next collective.
Only instances whose every member has arrived contribute to wait/transfer/late/times_last.
"""

WORK_COLUMNS = ("tokens", "valid_tokens", "samples", "attn_cost", "flops", "expert_tokens")
"""Per-rank-step work the program reports (``expert_tokens``: tokens routed to the rank's
local experts, MoE)."""
HOST_COLUMNS = ("gc_ns", "gc_count", "cpu_ns", "runq_ns")
"""Per-rank-step host evidence the collector measures, float64 (R, S), NaN unknown:

- ``gc_ns``: Σ wall ns of Python GC pauses inside the step; ``gc_count``: collections;
- ``cpu_ns``: CPU time of the training thread over the step. A step whose wall time grows
  while ``cpu_ns`` does not waited for something: a CPU it did not get, a lock, the device;
- ``runq_ns``: of that, the time the thread was runnable and waited for a core (the
  kernel's run-queue delay): a CPU it did not get, told from the waits it chose (a lock,
  the device, a sleep).
"""
MEMORY_COLUMNS = ("mem_allocated", "mem_reserved", "mem_peak", "alloc_retries")
DEVICE_COLUMNS = (
    "sm_clock_mhz",
    "mem_clock_mhz",
    "power_w",
    "temp_c",
    "gpu_util",
    "cpu_pct",
    "load1",
    "rss_bytes",
    "throttle",
)
"""Per-rank-step device/host sample columns: mean of samples inside the step, except
``throttle``, the bitwise OR of throttle reasons (as float64; NaN when unknown)."""


@dataclass(frozen=True)
class Window:
    """The last N steps of one run, as dense per-rank-step arrays plus collective tables."""

    job: str
    run: str
    scope: str
    parent_run: str | None
    manifest: dict[str, Any]
    """Rank 0's manifest (versions, env, job config...)."""
    ranks: RankInfo
    groups: dict[int, GroupInfo]
    t0_ns: int
    """Hub-clock origin of every relative time in this window."""
    steps: np.ndarray
    """int64 step ids, ascending, shape (S,)."""
    present: np.ndarray
    """bool (R, S): the rank reported this step."""
    t_start: np.ndarray
    """float64 (R, S) step start, relative ns."""
    t_end: np.ndarray
    """float64 (R, S) step end, relative ns."""
    phase_ns: dict[str, np.ndarray]
    """Phase name -> float64 (R, S) total ns spent in that phase."""
    work: dict[str, np.ndarray]
    """``WORK_COLUMNS`` -> float64 (R, S)."""
    memory: dict[str, np.ndarray]
    """``MEMORY_COLUMNS`` -> float64 (R, S)."""
    device: dict[str, np.ndarray]
    """``DEVICE_COLUMNS`` -> float64 (R, S)."""
    coll: dict[str, np.ndarray]
    """``COLL_AGGREGATES`` -> float64 (R, S)."""
    instances: InstanceTable
    rows: CollRows | None = None
    """Raw collective rows of the most recent steps, when the store kept them."""
    clock_error_ns: np.ndarray | None = None
    """float64 (R,) clock-alignment uncertainty of each rank (half the best ping RTT)."""
    health: dict[str, Any] = field(default_factory=dict)
    """Hub/collector counters: drops, rejects, collector errors."""
    host: dict[str, np.ndarray] = field(default_factory=dict)
    """``HOST_COLUMNS`` -> float64 (R, S). The hub and ``build_window`` give every column
    (NaN where unknown); a window built by hand may leave it empty."""
    phase_cpu_ns: dict[str, np.ndarray] = field(default_factory=dict)
    """Phase name -> float64 (R, S) Σ training-thread CPU ns of the phase's spans, 0 where
    the rank ran no such span, NaN where a span's CPU time is unknown. A phase absent from
    the dict: no rank reported its CPU time."""
    reduced: dict[str, np.ndarray] = field(default_factory=dict)
    """Of the calls in ``coll``, those a node's relay matched (`rankscope.hub.reduce`),
    whose rows are not in ``rows``: ``REDUCED_AGGREGATES`` -> float64 (R, S), every one
    blocking. Empty when no relay reduced any."""

    @property
    def world_size(self) -> int:
        return self.ranks.world_size

    @property
    def step_ns(self) -> np.ndarray:
        """float64 (R, S) step wall time ``t_end - t_start``."""
        return self.t_end - self.t_start

    def has_complete_step(self) -> bool:
        """Whether some rank reported a step of known duration. A verdict needs one:
        ``healthy`` on nothing would be a claim without evidence (a stall is judged
        without steps: its evidence is the silence)."""
        return bool((self.present & np.isfinite(self.step_ns)).any())


NO_COMPLETE_STEP = "the window holds no complete step of any rank, and a verdict needs steps"
"""What the views say instead of a verdict on a window without a complete step."""
