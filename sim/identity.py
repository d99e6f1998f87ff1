"""What a simulated rank says about itself: its hello identity, the run's manifest, and the
ground truth of the scenario's fault (``manifest["sim"]["truth"]``, for scoring only)."""

from __future__ import annotations

import platform
from typing import Any

import numpy as np

from rankscope.sim.program import split_layers
from rankscope.sim.spec import Scenario
from rankscope.sim.topology import Layout, host_name, rack_name
from rankscope.sim.workload import effective_workload
from rankscope.version import __version__


def identities(scenario: Scenario, layout: Layout) -> list[dict[str, Any]]:
    """Hello identity of every rank (``schema.HELLO_REQUIRED`` plus the optional fields).

    Args:
        scenario: the resolved scenario.
        layout: the run's layout.

    Returns:
        One dict per rank, index = rank.
    """
    topo = scenario.topology
    gph = topo.gpus_per_host
    node_rank = {h: i for i, h in enumerate(layout.hosts)}
    per_host = np.bincount(layout.host, minlength=topo.hosts)
    world = layout.world_size
    out = []
    grid = np.arange(world).reshape(layout.pp, layout.dp, layout.tp)
    pp_i, dp_i, tp_i = (a.ravel() for a in np.indices(grid.shape))

    def mesh(d: int, t: int, p: int) -> dict[str, int]:
        out = {"dp": int(d), "tp": int(t), "pp": int(p)}
        if layout.ep > 1:
            out["ep"] = int(d) % layout.ep
        return out

    for r in range(world):
        h, g = int(layout.host[r]), int(layout.gpu[r])
        out.append(
            {
                "rank": r,
                "world_size": world,
                "local_rank": g if world > 1 else 0,
                "local_world_size": int(per_host[h]),
                "host": host_name(h),
                "node_rank": node_rank[h],
                "pid": 4000 + 97 * h + g,
                "gpu_index": g,
                "gpu_uuid": f"GPU-5157{h:04x}-{g:04x}-0000-0000-sim{h:03d}{g:02d}",
                "pci_bus": f"00000000:{0x18 + 0x10 * g:02X}:00.0",
                "numa_node": g * 2 // gph if gph > 1 else 0,
                "nic": f"mlx5_{g}",
                "rail": g,
                "rack": rack_name(h // topo.hosts_per_rack),
                "mesh": mesh(dp_i[r], tp_i[r], pp_i[r]),
                "shard": int(layout.shard_of_dp[dp_i[r]])
                if layout.shard_of_dp.size
                else int(dp_i[r]),
            }
        )
    return out


ONSET_MECHANISMS = (
    "slow_device",
    "slow_host_input",
    "local_fabric",
    "network_rail",
    "cpu_contention",
    "unexplained_straggler",
)
"""Mechanisms whose ``[fault]`` takes an ``onset``."""


def truth(scenario: Scenario, layout: Layout) -> dict[str, Any]:
    """Where the scenario's fault acts in this run.

    ``present`` is False when the run's scope leaves out what the mechanism needs (a rail
    fault inside one host, a slow GPU on another host): that run should look healthy.
    ``ranks``, ``hosts`` and ``rails`` name what is afflicted; they are empty for mechanisms
    that act on every rank (checkpoint, allocator growth, congestion, numerator, data, host
    pauses). A pipeline imbalance names the heavy stage's ranks and ``stage`` (its ``pp``
    coordinate) with ``layers`` per stage; an expert imbalance the ranks of the favoured
    ``ep_rank`` (their ``ep`` coordinate); an unexplained straggler its rank, host and
    ``category`` (the wall-time category its time lands in). ``warmup_steps`` (every
    scenario) is how many steps at the start run slower on every rank: a healthy feature
    that never changes the mechanism.

    Args:
        scenario: the resolved scenario.
        layout: the run's layout.

    Returns:
        ``{"mechanism", "present", "ranks", "hosts", "rails", "magnitude", ...}``.
    """
    f = scenario.fault
    mech = f.mechanism
    gph = scenario.topology.gpus_per_host
    n_hosts = len(layout.hosts)
    ranks: np.ndarray = np.zeros(0, dtype=np.int64)
    hosts: list[int] = []
    rails: list[int] = []
    present = True
    extra: dict[str, Any] = {}
    magnitude_of: dict[str, float] = {}
    if mech == "healthy":
        pass
    elif mech == "slow_device":
        ranks = np.flatnonzero(layout.device == f.device)
        hosts, rails = [f.device // gph], [f.device % gph]
        present = ranks.size > 0
    elif mech in ("slow_host_input", "local_fabric"):
        ranks = np.flatnonzero(layout.host == f.host)
        hosts = [f.host]
        present = ranks.size > (1 if mech == "local_fabric" else 0)
    elif mech == "network_rail":
        on_rail = layout.gpu == f.rail
        if f.extent == "nic":
            on_rail &= layout.host == f.host
            hosts = [f.host]
        ranks = np.flatnonzero(on_rail)
        rails = [f.rail]
        present = ranks.size > 0 and n_hosts > 1
        extra["extent"] = f.extent
    elif mech == "placement":
        moved = np.array(layout.moved, dtype=np.int64)
        groups = np.unique(moved // layout.tp) if moved.size else moved
        ranks = (groups[:, None] * layout.tp + np.arange(layout.tp)).ravel()
        hosts = [f.host, f.peer_host]
        present = moved.size > 0
    elif mech == "checkpoint":
        extra["every"] = f.every
    elif mech == "intermittent_congestion":
        present = n_hosts > 1
        extra["prob"] = f.prob
    elif mech == "numerator_change":
        extra["variant"] = f.variant
    elif mech == "data_imbalance":
        present = layout.dp > 1
    elif mech == "pipeline_imbalance":
        stage = np.arange(layout.world_size) // (layout.dp * layout.tp)
        present = f.stage < layout.pp and layout.pp > 1
        ranks = np.flatnonzero(stage == f.stage) if present else ranks
        pp0 = scenario.layout.pp
        layers = split_layers(scenario.model.layers, pp0, f.stage, f.magnitude)
        share = layers[f.stage] / ((sum(layers) - layers[f.stage]) / (pp0 - 1))
        extra.update(stage=f.stage, layers=list(layers[: layout.pp]))
        magnitude_of["pipeline_imbalance"] = share
    elif mech == "expert_imbalance":
        dp_i = (np.arange(layout.world_size) // layout.tp) % layout.dp
        present = layout.ep > 1 and f.ep_rank < layout.ep and scenario.model.experts > 0
        ranks = np.flatnonzero(dp_i % max(layout.ep, 1) == f.ep_rank) if present else ranks
        extra.update(ep_rank=f.ep_rank, ep=layout.ep)
    elif mech == "host_pause":
        present = True
        extra["every"] = f.every
    elif mech == "cpu_contention":
        ranks = np.flatnonzero(layout.host == f.host)
        hosts = [f.host]
        present = ranks.size > 0
    elif mech == "unexplained_straggler":
        ranks = np.flatnonzero(layout.device == f.device)
        hosts = [f.device // gph]
        present = ranks.size > 0
        extra["category"] = "host_gap"
    if mech in ONSET_MECHANISMS:
        extra["onset"] = f.onset
    magnitude = scenario.workload.tail_fraction if mech == "data_imbalance" else f.magnitude
    magnitude = magnitude_of.get(mech, magnitude)
    return {
        "mechanism": mech if present else "healthy",
        "scenario_mechanism": mech,
        "present": bool(present),
        "ranks": [int(r) for r in ranks],
        "hosts": [host_name(h) for h in hosts],
        "rails": [int(r) for r in rails],
        "magnitude": float(magnitude),
        **extra,
        "warmup_steps": int(scenario.noise.warmup_steps),
    }


def manifest(scenario: Scenario, layout: Layout, argv: list[str] | None = None) -> dict[str, Any]:
    """The run's manifest: versions, GPU, environment, launcher, job config, and ``sim``.

    Args:
        scenario: the resolved scenario.
        layout: the run's layout.
        argv: the command line that started the simulated job.

    Returns:
        A map of plain values, the same for every rank.
    """
    topo, model = scenario.topology, scenario.model
    wl = effective_workload(scenario)
    return {
        "versions": {
            "python": platform.python_version(),
            "rankscope": __version__,
            "torch": "simulated",
            "cuda": "simulated",
            "nccl": "simulated",
            "driver": "simulated",
        },
        "gpu": {
            "model": topo.gpu_model,
            "sm_clock_mhz": topo.sm_clock_mhz,
            "mem_clock_mhz": topo.mem_clock_mhz,
            "power_limit_w": topo.power_limit_w,
            "memory_gib": topo.hbm_gib,
        },
        "env": {"NCCL_ALGO": "Ring", "NCCL_IB_HCA": "mlx5", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
        "launcher": {"argv": list(argv or []), "kind": "simulated"},
        "job_config": {
            "model": model.name,
            "params_b": model.params_b,
            "layers": model.layers,
            "hidden": model.hidden,
            "precision": model.precision,
            "tp": layout.tp,
            "pp": layout.pp,
            "dp": layout.dp,
            "micro_batch": wl.micro_batch,
            "grad_accum": wl.grad_accum,
            "global_batch": wl.micro_batch * wl.grad_accum * layout.dp,
            "seq_len": wl.seq_len,
            "packer": wl.packer,
            "pad_fraction": round(wl.pad_fraction, 4),
            "checkpoint_every": wl.checkpoint_every,
            "quality_target": "loss<=2.10@10k",
        },
        "data": {
            "length_median": round(wl.length_median, 1),
            "length_sigma": wl.length_sigma,
            "tail_fraction": round(wl.tail_fraction, 4),
            "tail_alpha": wl.tail_alpha,
        },
        "topology": {
            "hosts": topo.hosts,
            "gpus_per_host": topo.gpus_per_host,
            "hosts_per_rack": topo.hosts_per_rack,
        },
        "sim": {
            "scenario": scenario.name,
            "description": scenario.description,
            "seed": scenario.seed,
            # The scenario exactly as run (file contents, base merged, overrides applied):
            # a simulated rerun rebuilds it from here rather than from a file that may have
            # changed or that another machine does not have.
            "spec": scenario.raw,
            "truth": truth(scenario, layout),
        },
    }
