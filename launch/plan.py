"""Rerun planning: from a run and its top hypotheses, which hosts and ranks to rerun at a
reduced scope, what the rerun keeps, what it changes, and what each outcome would mean.

The choice of hosts follows the method's reduction:

- ``one-rank``: the slowest rank's device — the first rank the top hypothesis names, else
  the rank with the largest median *busy* time (step time minus arrival wait: the time it
  spends without waiting for anybody);
- ``one-node``: the suspect node — the first host the top hypothesis names, else the host
  of the slowest rank;
- ``two-node``: for a rail hypothesis, the pair across the suspect rail (the suspect host
  and the next host the hypothesis names, else the healthiest other host with a rank on that
  rail); for a placement hypothesis, the two hosts the misplaced group spans; otherwise the suspect with a healthy peer (the host with the smallest median busy
  time among those not under suspicion, same rack first);
- ``full``: every host.

Pure: the plan is a function of the `Window` and the hypotheses. The command comes from a
launcher template (`rankscope.launch.templates`) in a separate step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rankscope.diagnosis.critical import busy_ns as critical_busy_ns
from rankscope.diagnosis.window import Window
from rankscope.launch.ladder import decomposition
from rankscope.launch.scopes import (
    ABSENT_MEANS,
    APPEARS_MEANS,
    LADDER,
    MECHANISMS,
    scope_index,
)

__all__ = [
    "Change",
    "Expectation",
    "RerunPlan",
    "Suspect",
    "Swap",
    "busy_ns",
    "job_config",
    "propose",
]


@dataclass(frozen=True)
class Suspect:
    """What a plan needs from one hypothesis of the verdict."""

    mechanism: str
    score: float = 0.0
    ranks: tuple[int, ...] = ()
    """Implicated ranks, most suspect first."""
    hosts: tuple[str, ...] = ()
    """Implicated hosts, most suspect first."""
    rails: tuple[int, ...] = ()

    @classmethod
    def of(cls, hyp: Any) -> Suspect:
        """Read a hypothesis from the diagnosis (an object or a map with the same names).

        Args:
            hyp: has ``mechanism`` and optionally ``score``, ``ranks``, ``hosts``, ``rails``.

        Returns:
            The suspect.
        """
        if isinstance(hyp, Suspect):
            return hyp

        def get(name: str, default: Any) -> Any:
            if isinstance(hyp, Mapping):
                return hyp.get(name, default)
            return getattr(hyp, name, default)

        return cls(
            mechanism=str(get("mechanism", "healthy")),
            score=float(get("score", 0.0) or 0.0),
            ranks=tuple(int(r) for r in (get("ranks", ()) or ())),
            hosts=tuple(str(h) for h in (get("hosts", ()) or ())),
            rails=tuple(int(r) for r in (get("rails", ()) or ())),
        )


@dataclass(frozen=True)
class Change:
    """One thing the rerun changes on purpose."""

    name: str
    before: str
    after: str
    note: str = ""


@dataclass(frozen=True)
class Expectation:
    """What the rerun's outcome would mean for one hypothesis."""

    mechanism: str
    score: float
    should_reproduce: bool
    """Whether the mechanism survives the reduction to this scope."""
    if_appears: str
    if_absent: str


SWAP_KINDS = ("shards", "placement")


@dataclass(frozen=True)
class Swap:
    """Two ranks that exchange their data shards or their devices in a rerun, and what each
    outcome would mean. A swap keeps every group's members and shape: only the shard a rank
    reads, or the host and GPU it runs on, changes hands."""

    kind: str
    """``shards`` or ``placement``."""
    ranks: tuple[int, int]
    """The two ranks, in the rerun's numbering."""
    predictions: tuple[tuple[str, str], ...]
    """(outcome, what it means), one per hypothesis the swap separates."""


def swap_of(kind: str, pair: Sequence[int], world: int) -> Swap:
    """The swap of two ranks of a rerun of ``world`` ranks, with its predictions.

    Args:
        kind: ``shards`` or ``placement``.
        pair: two different ranks in ``[0, world)``.
        world: ranks of the rerun.

    Returns:
        The swap.

    Raises:
        ValueError: unknown kind, not two different ranks, or a rank outside the rerun.
    """
    if kind not in SWAP_KINDS:
        raise ValueError(f"unknown swap {kind!r}; expected one of {', '.join(SWAP_KINDS)}")
    ranks = tuple(int(r) for r in pair)
    if len(ranks) != 2 or ranks[0] == ranks[1]:
        raise ValueError(f"--swap-{kind} takes two different ranks R1,R2, got {list(ranks)}")
    for r in ranks:
        if not 0 <= r < world:
            raise ValueError(f"--swap-{kind}: rank {r} is outside the rerun's {world} ranks")
    a, b = ranks
    if kind == "shards":
        predictions = (
            (
                "follows the shard",
                f"data: the slowness moves to the rank that now reads the "
                f"slow rank's shard (rank {a} <-> rank {b})",
            ),
            (
                "stays with the device",
                "hardware: the slowness stays on the same GPU/host "
                "(slow device, host, or its links)",
            ),
            (
                "neither",
                "the two ranks no longer differ: neither their data nor their device "
                "alone; look at the schedule or the interaction",
            ),
        )
    else:
        predictions = (
            (
                "follows the device",
                f"hardware: the slowness moves with the GPU/host that rank "
                f"{a} and rank {b} exchanged",
            ),
            (
                "stays with the rank",
                "data or role: the slowness stays with the rank's shard and groups, not the device",
            ),
            (
                "moves with the placement",
                "topology: the groups' new placement changes which "
                "ranks are slow (links the groups cross, not one device)",
            ),
        )
    return Swap(kind, (a, b), predictions)


@dataclass(frozen=True)
class RerunPlan:
    """A proposed reduced-scope rerun of one run."""

    job: str
    parent_run: str
    run: str
    """Id proposed for the new (child) run."""
    scope: str
    hosts: tuple[str, ...]
    """In node-rank order; the suspect host first (it is also the rendezvous host)."""
    ranks: tuple[int, ...]
    """Global ranks of the parent run the rerun keeps (one process each)."""
    nproc_per_node: int
    world_size: int
    parent_world_size: int
    gpus: tuple[int, ...]
    """GPU indices used on each host (the parent's placement); empty when unknown."""
    shards: tuple[int, ...]
    """Data shards the kept ranks read in the parent run; empty when unknown."""
    reason: str
    """Why these hosts and ranks."""
    preserved: tuple[str, ...]
    changes: tuple[Change, ...]
    expectations: tuple[Expectation, ...]
    batch: dict[str, int] = field(default_factory=dict)
    """``micro_batch``, ``grad_accum``, ``global_batch`` of the rerun, where known."""
    warnings: tuple[str, ...] = ()
    swap: Swap | None = None
    """A controlled swap the rerun makes (``--swap-shards`` / ``--swap-placement``)."""

    @property
    def nnodes(self) -> int:
        return len(self.hosts)


MIN_EXPECTATION_SCORE = 0.05
"""Hypotheses below this score (other than the top one) get no expectation in the plan."""
MAX_EXPECTATIONS = 4

_CONFIG_KEYS = ("config", "job_config", "job")
_ALIASES = {
    "micro_batch": ("micro_batch", "micro_batch_size", "per_rank_batch", "batch_size"),
    "grad_accum": ("grad_accum", "gradient_accumulation", "grad_accumulation_steps"),
    "global_batch": ("global_batch", "global_batch_size"),
}


def job_config(manifest: Mapping[str, Any]) -> dict[str, int]:
    """The batch settings of a run, read from its manifest's job config.

    Args:
        manifest: the run manifest; the job config is under ``config`` (or ``job_config``,
            ``job``), or at the top level.

    Returns:
        ``micro_batch``, ``grad_accum``, ``global_batch`` — those found, as ints.
    """
    sources: list[Mapping[str, Any]] = [
        manifest[k] for k in _CONFIG_KEYS if isinstance(manifest.get(k), Mapping)
    ]
    sources.append(manifest)
    out: dict[str, int] = {}
    for key, aliases in _ALIASES.items():
        for src in sources:
            found = next((src[a] for a in aliases if a in src), None)
            if isinstance(found, (int, float)) and not isinstance(found, bool) and found > 0:
                out[key] = int(found)
                break
    return out


def busy_ns(window: Window) -> np.ndarray:
    """Median per rank of the time it does not spend waiting for the others (step minus
    arrival wait and pipeline idle, ``diagnosis.critical.busy_ns``); NaN for ranks that
    never reported.

    Args:
        window: the run.

    Returns:
        float64 (R,) ns.
    """
    busy = critical_busy_ns(window, decomposition(window))
    busy = np.where(window.present, busy, np.nan)
    out = np.full(window.world_size, np.nan)
    seen = np.isfinite(busy).any(axis=1)
    if seen.any():
        out[seen] = np.nanmedian(busy[seen], axis=1)
    return out


def _host_index(window: Window, name: str) -> int | None:
    hosts = window.ranks.hosts
    return hosts.index(name) if name in hosts else None


def _ranks_on(window: Window, host: int) -> np.ndarray:
    return np.flatnonzero(window.ranks.host == host)


def _slowest_rank(window: Window, top: Suspect | None) -> tuple[int, str]:
    if top is not None:
        for r in top.ranks:
            if 0 <= r < window.world_size:
                return r, f"rank {r} is the first rank {top.mechanism} names"
    busy = busy_ns(window)
    if not np.isfinite(busy).any():
        raise ValueError(f"run {window.run!r} has no step reported by any rank")
    r = int(np.nanargmax(busy))
    return r, f"rank {r} has the largest median busy time ({busy[r] / 1e6:.1f} ms)"


def _suspect_host(window: Window, top: Suspect | None) -> tuple[int, str]:
    if top is not None:
        for name in top.hosts:
            h = _host_index(window, name)
            if h is not None:
                return h, f"{name} is the first host {top.mechanism} names"
    r, why = _slowest_rank(window, top)
    h = int(window.ranks.host[r])
    if h < 0:
        raise ValueError(f"rank {r} of run {window.run!r} did not report its host")
    return h, f"{window.ranks.hosts[h]} holds the slowest rank ({why})"


def _host_busy(window: Window) -> np.ndarray:
    busy = busy_ns(window)
    out = np.full(len(window.ranks.hosts), np.nan)
    for h in range(out.shape[0]):
        vals = busy[window.ranks.host == h]
        if np.isfinite(vals).any():
            out[h] = np.nanmax(vals)
    return out


_PAIR_MECHANISMS = {
    "network_rail": "across the suspect rail",
    "placement": "the misplaced group spans",
}


def _peer_host(window: Window, suspect: int, top: Suspect | None) -> tuple[int, str]:
    n_hosts = len(window.ranks.hosts)
    if n_hosts < 2:
        raise ValueError(f"run {window.run!r} has one host; a two-node rerun needs two")
    names = window.ranks.hosts
    rail = top.rails[0] if top is not None and top.rails else None
    if top is not None and top.mechanism in _PAIR_MECHANISMS:
        # The pair the diagnosis saw: the hosts across the suspect rail, or the two hosts a
        # misplaced group spans. The mechanism only shows between those two.
        for name in top.hosts:
            h = _host_index(window, name)
            if h is not None and h != suspect:
                what = _PAIR_MECHANISMS[top.mechanism]
                return h, f"{names[h]} is the peer {what} named by the verdict"
    suspected = {h for n in (top.hosts if top else ()) if (h := _host_index(window, n)) is not None}
    busy = _host_busy(window)
    size = _ranks_on(window, suspect).shape[0]
    rack = window.ranks.rack
    suspect_rack = int(rack[_ranks_on(window, suspect)[0]]) if size else -1
    candidates = []
    for h in range(n_hosts):
        members = _ranks_on(window, h)
        if h == suspect or h in suspected or members.shape[0] != size:
            continue
        if rail is not None and not (window.ranks.rail[members] == rail).any():
            continue
        same_rack = int(rack[members[0]]) == suspect_rack and suspect_rack >= 0
        b = busy[h] if np.isfinite(busy[h]) else np.inf
        candidates.append((not same_rack, b, h))
    if not candidates:
        raise ValueError(
            f"run {window.run!r}: no other host with {size} ranks"
            + (f" on rail {rail}" if rail is not None else "")
            + " to pair with the suspect"
        )
    _, b, h = min(candidates)
    where = f" with a rank on rail {rail}" if rail is not None else ""
    return h, f"{names[h]} is the healthiest other host{where} (median busy {b / 1e6:.1f} ms)"


def _expectations(scope: str, suspects: Sequence[Suspect]) -> tuple[Expectation, ...]:
    out = []
    here = scope_index(scope)
    for s in suspects:
        mech = MECHANISMS.get(s.mechanism)
        if mech is None:
            continue
        reproduce = scope_index(mech.first_scope) <= here
        if reproduce:
            appears = f"supports {s.mechanism}: {mech.shows_as}; {APPEARS_MEANS[scope]}"
            absent = (
                f"rejects {s.mechanism} at this scope, unless the rerun lost what it needs "
                f"({mech.preserve})"
            )
        else:
            appears = (
                f"{s.mechanism} needs {mech.first_scope} to show, so it is not the (only) "
                f"cause; {APPEARS_MEANS[scope]}"
            )
            absent = (
                f"expected: {s.mechanism} cannot show below {mech.first_scope}; "
                f"{ABSENT_MEANS[scope]}"
            )
        out.append(Expectation(s.mechanism, s.score, reproduce, appears, absent))
    return tuple(out)


def _software(manifest: Mapping[str, Any]) -> str:
    keys = ("python", "torch", "cuda", "nccl", "driver", "rankscope")
    found: list[str] = []
    versions = manifest.get("versions")
    for src in (versions if isinstance(versions, Mapping) else {}, manifest):
        for k in keys:
            v = src.get(k)
            if isinstance(v, (str, int, float)) and not any(f.startswith(f"{k} ") for f in found):
                found.append(f"{k} {v}")
    if not found:
        return "software manifest of the parent run (same environment and versions)"
    return "software manifest: " + ", ".join(found)


def _batch_changes(
    cfg: Mapping[str, int], world: int, parent_world: int, keep_global: bool
) -> tuple[list[Change], dict[str, int], list[str]]:
    # Ranks that share a data-parallel replica (tensor/pipeline parallel) do not multiply
    # the batch, so the global batch scales with the world size, not as micro x world.
    warnings: list[str] = []
    micro = cfg.get("micro_batch")
    accum = cfg.get("grad_accum", 1)
    glob = cfg.get("global_batch")
    if glob is None and micro is not None:
        glob = micro * accum * parent_world
    changes = [Change("world size", str(parent_world), str(world))]
    batch: dict[str, int] = {}
    if micro is None or glob is None:
        warnings.append(
            "the manifest has no micro_batch: check that the rerun keeps the per-rank batch"
        )
        changes.append(
            Change("global batch", "parent", f"x{world}/{parent_world}", "per-rank batch kept")
        )
        return changes, batch, warnings
    batch["micro_batch"] = micro
    if keep_global and (accum * parent_world) % world == 0:
        new_accum = accum * parent_world // world
        batch.update(grad_accum=new_accum, global_batch=glob)
        changes.append(
            Change(
                "gradient accumulation",
                str(accum),
                str(new_accum),
                "keeps the global batch; each step runs more micro-steps",
            )
        )
        return changes, batch, warnings
    if keep_global:
        warnings.append(
            f"grad accumulation {accum} x {parent_world} ranks is not divisible by {world}: "
            "the global batch cannot be kept exactly"
        )
    if (glob * world) % parent_world:
        warnings.append(
            f"global batch {glob} x {world}/{parent_world} ranks is not whole: check the "
            "data-parallel size of the rerun"
        )
    batch.update(grad_accum=accum, global_batch=max(glob * world // parent_world, micro))
    changes.append(
        Change(
            "global batch",
            str(glob),
            str(batch["global_batch"]),
            f"gradient accumulation kept at {accum} so a step's local work is unchanged",
        )
    )
    return changes, batch, warnings


def propose(
    window: Window,
    hypotheses: Sequence[Any],
    scope: str,
    *,
    run: str | None = None,
    keep_global_batch: bool = False,
) -> RerunPlan:
    """Propose a rerun of ``window``'s run at ``scope``.

    Args:
        window: the run to reduce (normally its full-scale window).
        hypotheses: the verdict's hypotheses, best first (objects or maps with
            ``mechanism``, ``score``, ``ranks``, ``hosts``, ``rails``); may be empty.
        scope: ``one-rank``, ``one-node``, ``two-node`` or ``full``.
        run: id for the new run (default ``<parent>-<scope>``).
        keep_global_batch: raise gradient accumulation to keep the global batch, instead of
            keeping a step's local work (the default: step times stay comparable).

    Returns:
        The plan.

    Raises:
        ValueError: unknown scope, or the run cannot support it (one host for two-node,
            no step reported, no identity).
    """
    if scope not in LADDER:
        raise ValueError(f"unknown rerun scope {scope!r}; expected one of {', '.join(LADDER)}")
    suspects = [Suspect.of(h) for h in hypotheses]
    suspects = [s for s in suspects if s.mechanism != "healthy"]
    # Expectations for the top hypothesis and the runners-up with a real score; listing
    # every mechanism at score 0 would bury the ones that matter.
    shown = [s for i, s in enumerate(suspects) if i == 0 or s.score >= MIN_EXPECTATION_SCORE]
    top = suspects[0] if suspects else None
    info = window.ranks
    if (info.host < 0).all():
        raise ValueError(f"run {window.run!r}: no rank reported its host")

    if scope == "one-rank":
        r, reason = _slowest_rank(window, top)
        host = int(info.host[r])
        hosts_idx = [host]
        ranks = np.array([r])
    elif scope == "one-node":
        host, reason = _suspect_host(window, top)
        hosts_idx = [host]
        ranks = _ranks_on(window, host)
    elif scope == "two-node":
        host, why = _suspect_host(window, top)
        peer, why_peer = _peer_host(window, host, top)
        hosts_idx = [host, peer]
        ranks = np.concatenate([_ranks_on(window, host), _ranks_on(window, peer)])
        reason = f"{why}; {why_peer}"
    else:
        first, reason = _suspect_host(window, top) if top else (None, "")
        order = [h for h in range(len(info.hosts)) if (info.host == h).any()]
        if first is not None:
            order.remove(first)
            order.insert(0, first)
        hosts_idx = order
        ranks = np.arange(window.world_size)
        reason = "every host of the parent run" + (f"; {reason}" if reason else "")

    hosts = tuple(info.hosts[h] for h in hosts_idx)
    per_host = [int((info.host[ranks] == h).sum()) for h in hosts_idx]
    warnings = []
    if len(set(per_host)) > 1:
        warnings.append(f"hosts hold different rank counts {per_host}; using {max(per_host)}")
    gpu = info.gpu_index[ranks[info.host[ranks] == hosts_idx[0]]]
    gpus = tuple(int(g) for g in np.unique(gpu)) if (gpu >= 0).all() else ()
    shard = info.shard[ranks]
    shards = tuple(int(s) for s in np.unique(shard)) if (shard >= 0).all() else ()
    world = int(ranks.shape[0])

    cfg = job_config(window.manifest)
    changes, batch, batch_warnings = _batch_changes(
        cfg, world, window.world_size, keep_global_batch
    )
    warnings += batch_warnings
    micro = f" ({cfg['micro_batch']})" if "micro_batch" in cfg else ""
    preserved = [f"per-rank micro batch{micro} and local shapes"]
    if top is not None and top.mechanism == "data_imbalance":
        where = f": shards {','.join(map(str, shards))}" if shards else ""
        preserved.append(f"the very same packed batches of the kept ranks{where}")
    else:
        preserved.append("sequence-length distribution (same data pipeline and packer)")
    preserved.append(_software(window.manifest))
    placement = "placement policy: same local ranks on the same GPUs"
    if gpus:
        placement += f" ({','.join(map(str, gpus))})"
    preserved.append(placement + " and NIC rails")

    return RerunPlan(
        job=window.job,
        parent_run=window.run,
        run=run or f"{window.run}-{scope}",
        scope=scope,
        hosts=hosts,
        ranks=tuple(int(r) for r in np.sort(ranks)),
        nproc_per_node=max(per_host),
        world_size=world,
        parent_world_size=window.world_size,
        gpus=gpus,
        shards=shards,
        reason=reason,
        preserved=tuple(preserved),
        changes=tuple(changes),
        expectations=_expectations(scope, shown[:MAX_EXPECTATIONS]),
        batch=batch,
        warnings=tuple(warnings),
    )
