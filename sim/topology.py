"""Which devices a run uses, how ranks map onto them, and the process groups they form.

Ranks are numbered the Megatron way, tensor-parallel fastest:
``rank = tp_i + tp * (dp_i + dp * pp_i)``, so per-rank arrays reshape to ``(pp, dp, tp)``
and a tensor-parallel group is one ``[s, d, :]`` row, a data-parallel group one
``[s, :, t]`` column. Placement decides which device (host, GPU) each rank runs on;
"packed" fills hosts in rank order, so tensor-parallel groups stay inside a host.

A reduced scope keeps the per-rank local shapes (micro batch, layers per stage, sequence
distribution, tensor shard) and changes only how many ranks take part.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from rankscope.collector.schema import SCOPES
from rankscope.sim.spec import Scenario

INF = float("inf")


def host_name(h: int) -> str:
    """Name of host index ``h`` of the simulated cluster."""
    return f"node{h:03d}"


def rack_name(r: int) -> str:
    """Name of rack index ``r``."""
    return f"rack{r:02d}"


@dataclass(frozen=True)
class ScopeSpec:
    """Which part of the full cluster a run uses.

    ``hosts`` are host names (``node003``) or indices; ``ranks`` are global ranks of the
    full-scope run (one-rank: the rank whose device is kept); ``gpus`` are GPU indices kept
    on each host (one-rank: the device). Empty means the default: host 0, hosts 0 and 1, or
    rank 0.
    """

    scope: str = "full"
    hosts: tuple[str | int, ...] = ()
    ranks: tuple[int, ...] = ()
    gpus: tuple[int, ...] = ()
    swap_shards: tuple[int, ...] = ()
    """Two ranks of this run that exchange their data shards (a controlled swap: the slowness
    that follows the shard is the data's)."""
    swap_placement: tuple[int, ...] = ()
    """Two ranks of this run that exchange their devices (host and GPU), every group keeping
    its members: the slowness that follows the device is the hardware's or its links'."""

    @classmethod
    def coerce(cls, scope: ScopeSpec | str | None) -> ScopeSpec:
        """Accept a `ScopeSpec`, a scope name, or None (= full)."""
        if scope is None:
            return cls()
        if isinstance(scope, ScopeSpec):
            return scope
        return cls(scope=scope)


@dataclass(frozen=True)
class Layout:
    """Ranks of one run: their devices, mesh coordinates and process groups."""

    scope: str
    tp: int
    pp: int
    dp: int
    device: np.ndarray
    """int64 (R,) device index (``host * gpus_per_host + gpu``) of each rank."""
    host: np.ndarray
    """int64 (R,) host index in the full cluster."""
    gpu: np.ndarray
    """int64 (R,) GPU index on its host (= NIC index = rail)."""
    hosts: tuple[int, ...]
    """Host indices in this run, in node-rank order."""
    tp_gid: np.ndarray
    """int32 (pp, dp) group id of each tensor-parallel group (-1: tp == 1)."""
    dp_gid: np.ndarray
    """int32 (pp, tp) group id of each data-parallel group (-1: dp == 1)."""
    pp_gid: np.ndarray
    """int32 (pp-1, dp, tp) group id of each pipeline stage pair."""
    world_gid: int
    """Id of the group of all ranks (-1 for a single rank)."""
    groups: tuple[dict, ...]
    """Group table rows for the wire: ``{"id", "name", "ranks", "backend", "desc"}``."""
    moved: tuple[int, ...] = ()
    """Ranks whose placement a fault changed."""
    ep: int = 1
    """Expert-parallel degree (1: none)."""
    ep_gid: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0, 0), np.int32))
    """int32 (pp, tp, dp // ep) group id of each expert-parallel group (ep > 1)."""
    shard_of_dp: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    """int64 (dp,) data shard each data-parallel index reads (identity unless a shard swap
    exchanged two); empty means identity."""

    @property
    def world_size(self) -> int:
        return int(self.device.shape[0])


def _host_index(value: str | int, n_hosts: int) -> int:
    if isinstance(value, str):
        if not value.startswith("node") or not value[4:].isdigit():
            raise ValueError(f"unknown host {value!r}; simulated hosts are node000..")
        value = int(value[4:])
    if not 0 <= int(value) < n_hosts:
        raise ValueError(f"host {host_name(int(value))} is not in this {n_hosts}-host cluster")
    return int(value)


def _scope_devices(scenario: Scenario, spec: ScopeSpec) -> np.ndarray:
    topo = scenario.topology
    n_hosts, gph = topo.hosts, topo.gpus_per_host
    if spec.scope not in SCOPES:
        raise ValueError(f"unknown scope {spec.scope!r}; one of {list(SCOPES)}")
    hosts = [_host_index(h, n_hosts) for h in spec.hosts]
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"scope hosts repeat: {list(spec.hosts)}")
    gpus = list(spec.gpus)
    for g in gpus:
        if not 0 <= g < gph:
            raise ValueError(f"GPU index {g} is outside 0..{gph - 1}")
    if spec.scope == "full":
        return np.arange(n_hosts * gph)
    if spec.scope == "one-rank":
        if spec.ranks:
            if len(spec.ranks) != 1:
                raise ValueError(f"one-rank scope takes one rank, got {list(spec.ranks)}")
            full = build_layout(scenario, ScopeSpec("full"))
            r = spec.ranks[0]
            if not 0 <= r < full.world_size:
                raise ValueError(f"rank {r} is outside the full world of {full.world_size}")
            return full.device[[r]]
        h = hosts[0] if hosts else 0
        return np.array([h * gph + (gpus[0] if gpus else 0)])
    if spec.scope in ("one-node", "two-node"):
        want = 1 if spec.scope == "one-node" else 2
        if want > n_hosts:
            raise ValueError(f"{spec.scope} scope needs {want} hosts; the cluster has {n_hosts}")
        if not hosts:
            hosts = list(range(want))
        if len(hosts) != want:
            raise ValueError(f"{spec.scope} scope takes {want} host(s), got {list(spec.hosts)}")
    elif not hosts:
        raise ValueError("custom scope needs hosts")
    local = gpus or list(range(gph))
    return np.array([h * gph + g for h in hosts for g in local])


def _degrees(scenario: Scenario, world: int) -> tuple[int, int, int, int]:
    """Keep tp, pp and ep where the reduced world allows; dp takes what is left."""
    tp = scenario.layout.tp
    while world % tp:
        tp -= 1
    pp = scenario.layout.pp
    while world % (tp * pp):
        pp -= 1
    dp = world // (tp * pp)
    ep = scenario.layout.ep
    while dp % ep:
        ep -= 1
    return tp, pp, dp, ep


def _apply_placement_fault(scenario: Scenario, device: np.ndarray, tp: int) -> tuple[int, ...]:
    """Bad placement: half of one tensor-parallel group on host A swaps devices with half of
    one on host B, so both groups now cross hosts. Acts only when both hosts take part."""
    fault, gph = scenario.fault, scenario.topology.gpus_per_host
    if fault.mechanism != "placement" or tp < 2:
        return ()
    host = device // gph
    on_a = np.flatnonzero(host == fault.host)
    on_b = np.flatnonzero(host == fault.peer_host)
    if on_a.size == 0 or on_b.size == 0:
        return ()
    group_a = np.arange(tp) + (on_a[0] // tp) * tp
    group_b = np.arange(tp) + (on_b[0] // tp) * tp
    n_move = min(tp - 1, max(1, round(tp * fault.magnitude)))
    ra, rb = group_a[tp - n_move :], group_b[tp - n_move :]
    device[ra], device[rb] = device[rb].copy(), device[ra].copy()
    return tuple(int(r) for r in np.concatenate([ra, rb]))


def build_layout(scenario: Scenario, scope: ScopeSpec | str | None = None) -> Layout:
    """Place a run's ranks on devices and build its process groups.

    Args:
        scenario: the resolved scenario.
        scope: which devices take part (default: the full cluster).

    Returns:
        The layout.

    Raises:
        ValueError: naming the bad scope, host, rank or GPU.
    """
    spec = ScopeSpec.coerce(scope)
    device = _scope_devices(scenario, spec).astype(np.int64)
    world = int(device.shape[0])
    tp, pp, dp, ep = _degrees(scenario, world)
    moved = _apply_placement_fault(scenario, device, tp)
    _check_swap("swap_placement", spec.swap_placement, world)
    if spec.swap_placement:
        a, b = spec.swap_placement
        device[a], device[b] = device[b], device[a]
    shard_of_dp = np.arange(dp, dtype=np.int64)
    _check_swap("swap_shards", spec.swap_shards, world)
    if spec.swap_shards:
        d_a, d_b = ((r // tp) % dp for r in spec.swap_shards)
        if d_a == d_b:
            raise ValueError(
                f"ranks {spec.swap_shards[0]} and {spec.swap_shards[1]} read the same data shard "
                "(same data-parallel index): swapping their shards changes nothing"
            )
        shard_of_dp[[d_a, d_b]] = shard_of_dp[[d_b, d_a]]
    gph = scenario.topology.gpus_per_host
    host, gpu = device // gph, device % gph
    hosts = tuple(dict.fromkeys(int(h) for h in host))
    ranks = np.arange(world).reshape(pp, dp, tp)
    groups: list[dict] = []

    def add(name: str, members: np.ndarray, desc: str) -> int:
        groups.append(
            {
                "id": len(groups),
                "name": name,
                "ranks": [int(r) for r in members],
                "backend": "nccl",
                "desc": desc,
            }
        )
        return len(groups) - 1

    world_gid = add("world", ranks.ravel(), "default process group") if world > 1 else -1
    tp_gid = np.full((pp, dp), -1, dtype=np.int32)
    dp_gid = np.full((pp, tp), -1, dtype=np.int32)
    pp_gid = np.full((max(pp - 1, 0), dp, tp), -1, dtype=np.int32)
    if tp > 1:
        for s in range(pp):
            for d in range(dp):
                tp_gid[s, d] = add(f"tp{s}.{d}", ranks[s, d], f"tensor parallel, pp={s} dp={d}")
    if dp > 1:
        for s in range(pp):
            for t in range(tp):
                dp_gid[s, t] = add(f"dp{s}.{t}", ranks[s, :, t], f"data parallel, pp={s} tp={t}")
    ep_gid = np.full((pp, tp, dp // ep if ep > 1 else 0), -1, dtype=np.int32)
    if ep > 1:
        for s in range(pp):
            for t in range(tp):
                for g in range(dp // ep):
                    members = ranks[s, g * ep : (g + 1) * ep, t]
                    ep_gid[s, t, g] = add(
                        f"ep{s}.{t}.{g}", members, f"expert parallel, pp={s} tp={t} block={g}"
                    )
    for s in range(pp - 1):
        for d in range(dp):
            for t in range(tp):
                pair = np.array([ranks[s, d, t], ranks[s + 1, d, t]])
                pp_gid[s, d, t] = add(
                    f"pp{s}-{s + 1}.{d}.{t}", pair, f"pipeline stages {s}->{s + 1}, dp={d} tp={t}"
                )
    return Layout(
        scope=spec.scope,
        tp=tp,
        pp=pp,
        dp=dp,
        device=device,
        host=host,
        gpu=gpu,
        hosts=hosts,
        tp_gid=tp_gid,
        dp_gid=dp_gid,
        pp_gid=pp_gid,
        world_gid=world_gid,
        groups=tuple(groups),
        moved=moved,
        ep=ep,
        ep_gid=ep_gid,
        shard_of_dp=shard_of_dp,
    )


def _check_swap(name: str, pair: tuple[int, ...], world: int) -> None:
    if not pair:
        return
    if len(pair) != 2 or pair[0] == pair[1]:
        raise ValueError(f"{name} takes two different ranks, got {list(pair)}")
    for r in pair:
        if not 0 <= int(r) < world:
            raise ValueError(f"{name}: rank {r} is outside this run's {world} ranks")


@dataclass(frozen=True)
class Links:
    """Bandwidth terms of a set of groups, for the ring cost model.

    A ring inside one host runs at the host's NVLink bandwidth; a ring across hosts is
    bounded by its slowest NIC and, where two members share a host, by that host's NVLink.
    """

    intra_gbps: np.ndarray
    """Slowest intra-host leg (inf when no two members share a host)."""
    nic_gbps: np.ndarray
    """Slowest member NIC when the group crosses hosts (inf otherwise)."""
    alpha_ns: np.ndarray
    """Per-hop latency."""
    crosses: np.ndarray
    """bool: members sit on more than one host."""

    def bandwidth(self, congestion: float = 1.0) -> np.ndarray:
        """Effective bandwidth (bytes/ns) with the cross-host part scaled by ``congestion``."""
        return np.minimum(self.intra_gbps, self.nic_gbps * congestion)


def group_links(
    member_host: np.ndarray,
    member_nic_gbps: np.ndarray,
    intra_gbps_of_host: np.ndarray,
    alpha_intra_ns: float,
    alpha_inter_ns: float,
) -> Links:
    """Link terms for groups given as member arrays along the last axis.

    Args:
        member_host: int (..., n) host index of each member.
        member_nic_gbps: float (..., n) bandwidth of each member's NIC.
        intra_gbps_of_host: float (hosts,) NVLink bandwidth by host index.
        alpha_intra_ns: per-hop latency inside a host.
        alpha_inter_ns: per-hop latency across hosts.

    Returns:
        `Links` with arrays of shape ``member_host.shape[:-1]``.
    """
    order = np.argsort(member_host, axis=-1, kind="stable")
    hs = np.take_along_axis(member_host, order, axis=-1)
    same_prev = np.zeros(hs.shape, dtype=bool)
    same_prev[..., 1:] = hs[..., 1:] == hs[..., :-1]
    shares = same_prev.copy()
    shares[..., :-1] |= same_prev[..., 1:]
    leg = np.where(shares, intra_gbps_of_host[hs], INF)
    intra = leg.min(axis=-1)
    crosses = hs[..., 0] != hs[..., -1]
    nic = np.where(crosses, member_nic_gbps.min(axis=-1), INF)
    intra = np.where(np.isinf(intra) & ~crosses, intra_gbps_of_host[hs[..., 0]], intra)
    alpha = np.where(crosses, alpha_inter_ns, alpha_intra_ns)
    return Links(intra_gbps=intra, nic_gbps=nic, alpha_ns=alpha, crosses=crosses)
