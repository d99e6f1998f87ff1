"""The fault catalog: which mechanisms exist, what a ``[fault]`` table may set, and how it
resolves to concrete targets and magnitudes for one seed.

``magnitude`` means, per mechanism: ``slow_device`` the GPU's speed factor (0.55 = 45 %
slower); ``slow_host_input`` extra data-loader ms per step on the host; ``local_fabric`` and
``network_rail`` the factor on NVLink or NIC bandwidth; ``placement`` the share of a
tensor-parallel group moved to the other host; ``checkpoint`` the write time in seconds;
``allocator_growth`` ms of allocator time added per step; ``intermittent_congestion`` the
cross-host bandwidth factor during a burst; ``numerator_change`` the added padding share or
the sequence-length growth; ``pipeline_imbalance`` the layers of the heavy ``stage`` over
the mean layers of the other stages (an uneven split of the same model; the truth gives
the ratio after rounding to whole layers); ``expert_imbalance`` the routing weight of the
hot expert-parallel rank ``ep_rank`` over an even share (its local experts receive about
that many times the tokens); ``host_pause`` the mean length in ms of a stop-the-world
(full garbage collection) pause, which each rank takes about every ``every`` steps at its
own times; ``cpu_contention`` the share of the CPU the training threads of one host still
get (another process competes); ``unexplained_straggler`` the ms one rank spends every
step in a blocking host call outside any recorded phase that uses no CPU and is no
garbage collection. ``data_imbalance`` only switches the packer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rankscope.collector.schema import MECHANISMS
from rankscope.sim.draw import ScenarioError, draw, pick_target

if TYPE_CHECKING:
    from rankscope.sim.spec import LayoutSpec, TopologySpec


@dataclass(frozen=True)
class FaultSpec:
    """One fault, resolved to concrete values. Targets index the full cluster: host index,
    device index ``host * gpus_per_host + gpu``, rail = GPU/NIC index; -1 when unused."""

    mechanism: str = "healthy"
    magnitude: float = 1.0
    """Meaning depends on the mechanism (speed factor, bandwidth factor, extra ms...)."""
    host: int = -1
    peer_host: int = -1
    device: int = -1
    rail: int = -1
    extent: str = "rail"
    """network_rail: ``rail`` (that rail's NICs on every host) or ``nic`` (one host's NIC)."""
    every: int = 0
    """checkpoint: steps between checkpoints."""
    prob: float = 0.0
    """intermittent_congestion: chance that a step has a congestion burst."""
    variant: str = ""
    """numerator_change: ``padding`` or ``longer``."""
    onset: int = 0
    """Hardware and host faults (slow device, slow host input, local fabric, network rail,
    CPU contention, unexplained straggler): the first step the fault acts in; the steps
    before it run on the healthy cluster."""
    stage: int = -1
    """pipeline_imbalance: the pipeline stage that holds more layers."""
    ep_rank: int = -1
    """expert_imbalance: the expert-parallel coordinate whose experts routing favours."""


FAULT_DEFAULTS: dict[str, dict[str, Any]] = {
    "healthy": {},
    "data_imbalance": {},
    "slow_device": {"magnitude": [0.55, 0.85], "device": "random", "onset": 0},
    "slow_host_input": {"magnitude": [120.0, 400.0], "host": "random", "onset": 0},
    "local_fabric": {"magnitude": [0.04, 0.2], "host": "random", "onset": 0},
    "network_rail": {
        "magnitude": [0.08, 0.3],
        "rail": "random",
        "extent": "rail",
        "host": "random",
        "onset": 0,
    },
    "placement": {"magnitude": 0.5, "host": "random", "peer_host": "random"},
    "checkpoint": {"magnitude": [0.8, 2.5], "every": [4, 6]},
    "allocator_growth": {"magnitude": [6.0, 15.0]},
    "intermittent_congestion": {"magnitude": [0.08, 0.25], "prob": [0.2, 0.4]},
    "numerator_change": {"magnitude": [0.25, 0.5], "variant": ["padding", "longer"]},
    "pipeline_imbalance": {"magnitude": [1.3, 1.8], "stage": "random"},
    "expert_imbalance": {"magnitude": [1.6, 3.0], "ep_rank": "random"},
    "host_pause": {"magnitude": [20.0, 80.0], "every": [3, 8]},
    "cpu_contention": {"magnitude": [0.15, 0.3], "host": "random", "onset": 0},
    "unexplained_straggler": {"magnitude": [30.0, 150.0], "device": "random", "onset": 0},
}
"""Per mechanism: the keys its ``[fault]`` table may set, with default values or ranges."""


def resolve_fault(
    table: Any, topo: TopologySpec, seed: int, layout: LayoutSpec | None = None
) -> FaultSpec:
    """Resolve a scenario's ``[fault]`` table for one seed.

    Args:
        table: the table (None: healthy).
        topo: the full cluster, to draw targets from.
        seed: the scenario seed.
        layout: the parallel layout, to draw a pipeline stage or expert-parallel rank from
            (None: one stage, no expert parallelism).

    Returns:
        The fault with every range drawn and every target chosen.

    Raises:
        ScenarioError: an unknown mechanism, a key the mechanism does not take, a bad value.
    """
    if table is None:
        return FaultSpec()
    if not isinstance(table, dict):
        raise ScenarioError("[fault] must be a table")
    mech = table.get("mechanism")
    if mech not in MECHANISMS:
        raise ScenarioError(f"fault.mechanism {mech!r} is not one of {list(MECHANISMS)}")
    allowed = FAULT_DEFAULTS[str(mech)]
    unknown = sorted(set(table) - set(allowed) - {"mechanism"})
    if unknown:
        raise ScenarioError(f"[fault] {mech} does not take {unknown}; it takes {sorted(allowed)}")
    spec = {**allowed, **table}
    base = FaultSpec()
    kw: dict[str, Any] = {"mechanism": mech}
    for key in ("magnitude", "every", "prob", "extent", "variant", "onset"):
        if key in spec:
            kw[key] = draw(f"fault.{key}", spec[key], getattr(base, key), seed)
    n_dev = topo.hosts * topo.gpus_per_host
    if "device" in spec:
        kw["device"] = pick_target("fault.device", spec["device"], n_dev, seed)
    if "rail" in spec:
        kw["rail"] = pick_target("fault.rail", spec["rail"], topo.gpus_per_host, seed)
    if "host" in spec:
        kw["host"] = pick_target("fault.host", spec["host"], topo.hosts, seed)
    if "peer_host" in spec:
        if topo.hosts < 2:
            raise ScenarioError("fault placement needs at least 2 hosts")
        kw["peer_host"] = pick_target(
            "fault.peer_host", spec["peer_host"], topo.hosts, seed, kw["host"]
        )
        if kw["peer_host"] == kw["host"]:
            raise ScenarioError("fault.peer_host must differ from fault.host")
    pp, ep = (layout.pp, layout.ep) if layout is not None else (1, 1)
    if "stage" in spec:
        if pp < 2:
            raise ScenarioError("fault pipeline_imbalance needs layout.pp >= 2")
        kw["stage"] = pick_target("fault.stage", spec["stage"], pp, seed)
    if "ep_rank" in spec:
        if ep < 2:
            raise ScenarioError("fault expert_imbalance needs layout.ep >= 2")
        kw["ep_rank"] = pick_target("fault.ep_rank", spec["ep_rank"], ep, seed)
    if mech in ("host_pause", "cpu_contention", "unexplained_straggler") and kw["magnitude"] <= 0:
        raise ScenarioError(f"fault.magnitude of {mech} must be > 0")
    if mech == "cpu_contention" and kw["magnitude"] > 1:
        raise ScenarioError("fault.magnitude of cpu_contention is a CPU share in (0, 1]")
    if mech == "host_pause" and kw.get("every", 0) < 1:
        raise ScenarioError("fault.every of host_pause must be >= 1 step")
    if kw.get("extent", "rail") not in ("rail", "nic"):
        raise ScenarioError(f"fault.extent must be 'rail' or 'nic', got {kw['extent']!r}")
    if mech == "network_rail" and kw["extent"] == "rail":
        kw["host"] = -1  # every host's NIC on that rail
    onset = kw.get("onset", 0)
    if not isinstance(onset, int) or isinstance(onset, bool) or onset < 0:
        raise ScenarioError(f"fault.onset must be a step number >= 0, got {onset!r}")
    if kw.get("variant", "") not in ("", "padding", "longer"):
        raise ScenarioError(f"fault.variant must be 'padding' or 'longer', got {kw['variant']!r}")
    return FaultSpec(**kw)
