"""The physical state of the full simulated cluster: device speeds, link bandwidths, host
input delays. Faults act here, on the inputs of the model, never on its results.

Everything is indexed by physical identity (host index, device ``host * gpus_per_host +
gpu``), and drawn from the scenario seed only, so a reduced-scope rerun on the same hosts
meets the same slow GPU, the same degraded NIC and the same storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.sim.spec import Scenario

THROTTLE_SW_POWER_CAP = 0x4
THROTTLE_HW_SLOWDOWN = 0x8
THROTTLE_SW_THERMAL = 0x20
THROTTLE_HW_THERMAL = 0x40
"""NVML clock-throttle reason bits a throttled GPU reports."""


@dataclass(frozen=True)
class Hardware:
    """Per-device and per-host physical parameters of the full cluster."""

    speed: np.ndarray
    """float64 (devices,) compute speed relative to nominal (1.0)."""
    throttle: np.ndarray
    """int64 (devices,) throttle-reason bits the device reports."""
    temp_c: np.ndarray
    """float64 (devices,) steady temperature under load."""
    nic_gbps: np.ndarray
    """float64 (devices,) bandwidth of each GPU's own NIC."""
    intra_gbps: np.ndarray
    """float64 (hosts,) NVLink-class bandwidth inside each host."""
    input_extra_ms: np.ndarray
    """float64 (hosts,) extra data-loader wait per step on each host."""
    storage_factor: np.ndarray
    """float64 (hosts,) checkpoint write time relative to nominal."""


def _rng(scenario: Scenario, what: str) -> np.random.Generator:
    return np.random.default_rng([scenario.seed & 0xFFFFFFFF, 0x4857, len(what), *what.encode()])


def build_hardware(scenario: Scenario) -> Hardware:
    """Draw the healthy cluster from the scenario seed, then apply the scenario's fault.

    Args:
        scenario: the resolved scenario.

    Returns:
        The physical state of every device and host of the full cluster.
    """
    topo, noise, fault = scenario.topology, scenario.noise, scenario.fault
    n_dev = topo.hosts * topo.gpus_per_host
    rng = _rng(scenario, "hardware")
    speed = 1.0 + noise.static_sigma * rng.standard_normal(n_dev)
    temp = 62.0 + 4.0 * rng.standard_normal(n_dev)
    throttle = np.zeros(n_dev, dtype=np.int64)
    nic = np.full(n_dev, topo.nic_gbps) * (1.0 + 0.01 * rng.standard_normal(n_dev))
    intra = np.full(topo.hosts, topo.intra_gbps) * (1.0 + 0.01 * rng.standard_normal(topo.hosts))
    input_extra = np.zeros(topo.hosts)
    storage = np.exp(0.1 * rng.standard_normal(topo.hosts))

    mech, mag = fault.mechanism, fault.magnitude
    if mech == "slow_device":
        # A throttled GPU: clocks pulled down by power/thermal limits, so it computes slower.
        speed[fault.device] *= mag
        throttle[fault.device] = THROTTLE_SW_THERMAL | THROTTLE_HW_SLOWDOWN | THROTTLE_SW_POWER_CAP
        temp[fault.device] = 88.0 + 4.0 * (1.0 - mag)
    elif mech == "network_rail":
        gpus = np.arange(n_dev) % topo.gpus_per_host
        hit = gpus == fault.rail
        if fault.extent == "nic":
            hit &= np.arange(n_dev) // topo.gpus_per_host == fault.host
        nic[hit] *= mag
    elif mech == "local_fabric":
        intra[fault.host] *= mag
    elif mech == "slow_host_input":
        input_extra[fault.host] = mag
    return Hardware(
        speed=speed,
        throttle=throttle,
        temp_c=temp,
        nic_gbps=nic,
        intra_gbps=intra,
        input_extra_ms=input_extra,
        storage_factor=storage,
    )
