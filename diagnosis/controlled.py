"""The controlled experiment that separates a hypothesis from its rivals, with its pair of
ranks chosen from the data and its command lines ready to run.

Three perturbations separate the verdict's families (seed: "controlled experiments"):

- a **shard swap** (``rankscope rerun PATH --scope full --swap-shards SLOW,PEER``) for a
  straggler on one rank or host: ``data_imbalance`` against what stays with the rank
  (``slow_device``, and the host-side mechanisms ``slow_host_input``, ``host_pause``,
  ``cpu_contention``, or an ``unexplained_straggler``). The slowness follows the shard
  (data) or stays with the device (hardware); ``rankscope experiment swap`` judges it.
- a **pairwise sweep** (``rankscope sweep PATH --scope pairwise``) for a rail or a host's
  fabric (``network_rail``, ``local_fabric``): the primitive alone on each link of two
  hosts, the suspect's first, names the slow rail or the host whose own links are slow
  beside a healthy host's, or finds the links healthy under a group placed across hosts
  (then the placement, not the fabric). The sweep judges itself.
- a **placement swap** (``rankscope rerun PATH --scope full --swap-placement A,B``) for
  ``placement``: two ranks exchange devices, every group keeping its members; a gap that
  leaves the pair moved with the placement (topology), one that follows the device is
  hardware. Only the simulated launcher applies it; a real run gets the pairwise sweep.

This module is pure: it picks the pair from a window and its decomposition, and writes the
command lines as argv strings for a recording path the caller names. The caller (the
``diagnose`` command) checks them against the command line's own planning before showing
them.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from rankscope.diagnosis.critical import busy_ns
from rankscope.diagnosis.decomposition import Decomposition
from rankscope.diagnosis.window import Window

SHARD_SWAP = frozenset(
    {
        "data_imbalance",
        "slow_device",
        "slow_host_input",
        "host_pause",
        "cpu_contention",
        "unexplained_straggler",
    }
)
"""Mechanisms a shard swap separates: does the slowness follow the data or the rank?"""
SWEEP = frozenset({"network_rail", "local_fabric"})
"""Mechanisms a pairwise sweep separates: is the primitive itself slow, and on which link?"""
PLACEMENT_SWAP = frozenset({"placement"})
"""Mechanisms a placement swap separates (simulated cluster; else a pairwise sweep)."""

MIN_GAP = 0.02
"""The pair must differ by this share of the median busy time, step by step (rms), for a
swap to have a gap to follow; `rankscope experiment swap` refuses to judge below it."""

KINDS = ("swap_shards", "swap_placement", "sweep_pairwise")


@dataclass(frozen=True)
class Perturbation:
    """One controlled perturbation and why its ranks were chosen."""

    kind: str
    """``swap_shards``, ``swap_placement`` or ``sweep_pairwise``."""
    ranks: tuple[int, ...]
    """The swapped pair, the slow rank first; empty for a sweep."""
    separates: str
    """The hypotheses it tells apart, in words."""
    why: str
    """Why these ranks, with their numbers."""
    outcomes: tuple[tuple[str, str], ...]
    """What each outcome means: (what is observed, the mechanism it names)."""


@dataclass(frozen=True)
class Commands:
    """Ready command lines for a perturbation of one recorded run."""

    command: tuple[str, ...]
    """argv of the experiment (it shows its plan; ``--yes`` launches it)."""
    then: tuple[tuple[str, ...], ...]
    """argv of each follow-up, in order: the evaluation of a swap; none for a sweep,
    which judges itself."""
    new_run: str | None
    """The id the rerun reports as (``--new-run``); None for a sweep."""
    notes: tuple[str, ...] = ()
    """What to know before running them (confirmation, the hub), or why there are none
    (``command`` empty)."""


def is_simulated(window: Window) -> bool:
    """Whether the run came from the simulated cluster (its manifest carries the scenario
    spec the simulated launcher reruns)."""
    sim = window.manifest.get("sim") if isinstance(window.manifest, dict) else None
    return isinstance(sim, dict) and isinstance(sim.get("spec"), dict)


@dataclass(frozen=True)
class Busy:
    """Busy time (step − arrival wait − pipeline idle: the time the others wait for) per
    rank, computed once for every hypothesis of a window."""

    per_step: np.ndarray
    """float64 (R, S) ns; NaN where the rank did not report."""
    mean: np.ndarray
    """float64 (R,) ns; NaN for a rank that never reported."""

    @classmethod
    def of(cls, window: Window, decomp: Decomposition) -> Busy:
        """The busy time of a window from its decomposition."""
        busy = np.where(window.present, busy_ns(window, decomp), np.nan)
        seen = np.isfinite(busy).any(axis=1)
        mean = np.full(window.world_size, np.nan)
        if seen.any():
            mean[seen] = np.nanmean(busy[seen], axis=1)
        return cls(busy, mean)


def _slowest(mean: np.ndarray, ranks: tuple[int, ...]) -> int | None:
    """The implicated rank with the most busy time, else the busiest rank of all."""
    pool = np.array([r for r in ranks if 0 <= r < mean.size and np.isfinite(mean[r])], int)
    if pool.size == 0:
        pool = np.flatnonzero(np.isfinite(mean))
    if pool.size == 0:
        return None
    return int(pool[np.argmax(mean[pool])])


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.1f} ms"


def _host(window: Window, r: int) -> str:
    code = int(window.ranks.host[r])
    hosts = window.ranks.hosts
    return hosts[code] if 0 <= code < len(hosts) else "?"


def _gap_ok(busy: np.ndarray, a: int, b: int) -> bool:
    both = np.isfinite(busy[a]) & np.isfinite(busy[b])
    if both.sum() < 3:
        return False
    gap = busy[a, both] - busy[b, both]
    scale = float(np.nanmedian(busy[:, both]))
    return bool(np.sqrt(np.mean(gap**2)) >= MIN_GAP * scale)


def _shard_swap(
    window: Window, busy: np.ndarray, mean: np.ndarray, slow: int
) -> Perturbation | None:
    info = window.ranks
    seen = np.isfinite(mean)
    # Two ranks of one replica (tensor or pipeline parallel) read the same shard: swapping
    # them changes nothing. With shards unknown, the data-parallel coordinate stands in.
    shard = info.shard if (info.shard >= 0).any() else info.mesh.get("dp", info.shard)
    other = seen & (np.arange(mean.size) != slow)
    if shard[slow] >= 0:
        other &= shard != shard[slow]
    # The peer sits on another host where there is one: a host-wide cause (its input
    # pipeline, CPU contention, pauses) slows every rank of the slow rank's host, so a
    # same-host peer would be as slow and the swap would have no gap to follow; across
    # hosts the swap tells data from everything that stays with the rank (device, host,
    # links). Among those, the fastest rank: the widest gap, the clearest answer.
    away = other & (info.host != info.host[slow])
    peer = _fastest_peer(away, other, busy, mean, slow)
    if peer is None:
        return None
    where = "on another host" if away.any() else "on its host (no other host holds one)"
    return Perturbation(
        kind="swap_shards",
        ranks=(slow, peer),
        separates="data (data_imbalance) from what stays with the rank (slow_device, its host)",
        why=(
            f"rank {slow} ({_host(window, slow)}) has the most busy time, {_ms(mean[slow])} a "
            f"step; rank {peer} ({_host(window, peer)}) is the fastest rank {where} that reads "
            f"another shard, {_ms(mean[peer])}"
        ),
        outcomes=(
            ("follows the shard", "data_imbalance"),
            ("stays with the device", "slow_device, or its host"),
            ("neither", "neither alone: the schedule or an interaction"),
        ),
    )


def _fastest_peer(
    preferred: np.ndarray, allowed: np.ndarray, busy: np.ndarray, mean: np.ndarray, slow: int
) -> int | None:
    """The least busy rank of ``preferred`` (else of ``allowed``) to pair with ``slow``, or
    None when there is none or the pair's gap is too small for a swap to follow."""
    pool = np.flatnonzero(preferred if preferred.any() else allowed)
    if pool.size == 0:
        return None
    peer = int(pool[np.argmin(mean[pool])])
    return peer if _gap_ok(busy, slow, peer) else None


def _placement_swap(
    window: Window, busy: np.ndarray, mean: np.ndarray, slow: int, hosts: tuple[str, ...]
) -> Perturbation | None:
    info = window.ranks
    twin = np.isfinite(mean) & (info.gpu_index == info.gpu_index[slow])
    twin &= info.host != info.host[slow]
    # The same GPU index on another host keeps the local rank and, on a rail-optimised
    # fabric, the rail: only the host, and so which groups cross hosts, changes. A host the
    # hypothesis does not implicate is the healthy side of the swap.
    named = {i for i, h in enumerate(info.hosts) if h in set(hosts)}
    healthy = twin & ~np.isin(info.host, list(named))
    peer = _fastest_peer(healthy, twin, busy, mean, slow)
    if peer is None:
        return None
    return Perturbation(
        kind="swap_placement",
        ranks=(slow, peer),
        separates="the placement of groups (topology) from the device (hardware)",
        why=(
            f"rank {slow} ({_host(window, slow)}, GPU {int(info.gpu_index[slow])}) has the most "
            f"busy time, {_ms(mean[slow])} a step; rank {peer} is GPU "
            f"{int(info.gpu_index[peer])} of {_host(window, peer)}, a host the hypothesis does "
            f"not name, {_ms(mean[peer])}"
        ),
        outcomes=(
            ("moves with the placement", "placement"),
            ("follows the device", "slow_device"),
            ("stays with the rank", "its data or role, not where it runs"),
        ),
    )


def _sweep(rails: tuple[int, ...], hosts: tuple[str, ...]) -> Perturbation:
    if rails:
        why = (
            "the job's collective runs alone, at its message sizes, on every link between two "
            f"hosts that rail {', '.join(map(str, rails))} crosses: the suspect rail's links "
            "beside the healthy rails'"
        )
    else:
        named = ", ".join(hosts[:4]) + (" ..." if len(hosts) > 4 else "")
        why = (
            "the job's collective runs alone, at its message sizes, on every link of the "
            f"suspect group ({named or 'the verdict names it'}): its cross-host links beside "
            "its links inside a host"
        )
    return Perturbation(
        kind="sweep_pairwise",
        ranks=(),
        separates="a slow rail (network_rail) from a healthy fabric under the job's placement",
        why=why,
        outcomes=(
            ("found network_rail", "network_rail, on the rail it names"),
            ("found placement", "placement: healthy links under a group that crosses hosts"),
            ("found local_fabric", "local_fabric, on the host it names"),
        ),
    )


def perturbation(
    mechanism: str,
    window: Window,
    busy: Busy,
    ranks: tuple[int, ...] = (),
    hosts: tuple[str, ...] = (),
    rails: tuple[int, ...] = (),
) -> Perturbation | None:
    """The controlled perturbation that separates ``mechanism`` from its rivals.

    Args:
        mechanism: one of the verdict vocabulary.
        window: the run's window.
        busy: its busy time per rank (`Busy.of`).
        ranks: the ranks the hypothesis implicates (the slow rank is the busiest of them).
        hosts: the hosts it implicates (a placement swap's peer sits elsewhere).
        rails: the rails it implicates (named in a sweep's reason).

    Returns:
        The perturbation, or None where no swap or sweep separates the mechanism, or the
        data offer no pair with a gap to follow (one rank, one replica, identical ranks).
    """
    if window.world_size < 2:
        return None
    simulated = is_simulated(window)
    if mechanism in SWEEP or (mechanism in PLACEMENT_SWAP and not simulated):
        return _sweep(rails, hosts)
    if mechanism not in SHARD_SWAP | PLACEMENT_SWAP:
        return None
    slow = _slowest(busy.mean, ranks)
    if slow is None:
        return None
    if mechanism in PLACEMENT_SWAP:
        return _placement_swap(window, busy.per_step, busy.mean, slow, hosts)
    return _shard_swap(window, busy.per_step, busy.mean, slow)


def _fresh(name: str, taken: Collection[str]) -> str:
    out, n = name, 1
    while out in taken:
        n += 1
        out = f"{name}-{n}"
    return out


def command_lines(
    p: Perturbation,
    path: str,
    run: str,
    *,
    simulated: bool = False,
    steps: int | None = None,
    taken: Collection[str] = (),
) -> Commands:
    """The command lines of a perturbation of run ``run`` recorded at ``path``.

    Args:
        p: the perturbation.
        path: the recording directory, as the user named it.
        run: the run id.
        simulated: the run came from the simulated cluster (``--launcher simulated``).
        steps: steps the simulated rerun replays (the parent's, so that the evaluation
            compares the same steps); ignored for a real launcher, which runs the job's own.
        taken: run ids the recording already holds (the rerun's id avoids them).

    Returns:
        The experiment's argv and its follow-ups.
    """
    if p.kind == "sweep_pairwise":
        argv = ["rankscope", "sweep", path, "--scope", "pairwise", "--run", run]
        if simulated:
            argv += ["--launcher", "simulated"]
        return Commands(command=tuple(argv), then=(), new_run=None)
    flag = "--swap-shards" if p.kind == "swap_shards" else "--swap-placement"
    new = _fresh(f"{run}-{p.kind.replace('_', '-')}", taken)
    argv = ["rankscope", "rerun", path, "--scope", "full", "--run", run]
    argv += [flag, ",".join(map(str, p.ranks)), "--new-run", new]
    if simulated:
        argv += ["--launcher", "simulated"]
        if steps is not None and steps > 0:
            argv += ["--rerun-steps", str(int(steps))]
    then = ("rankscope", "experiment", "swap", path, "--before", run, "--after", new)
    return Commands(command=tuple(argv), then=(then,), new_run=new)
