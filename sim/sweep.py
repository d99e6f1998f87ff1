"""A sweep on the simulated cluster: the plan's collectives alone, priced by the same ring
model and the same hardware (slow NICs, slow NVLink, congestion bursts) as the job.

Without an application around it there is no late arrival, no overlap with compute and no
host gap: a collective of ``n`` members of ``S`` bytes (nccl-tests' algbw size) takes
``2 ceil(log2 n) alpha + f S / bw`` per operation, ``bw`` the slowest link the group
crosses (`rankscope.sim.topology.group_links`), ``f`` the bus factor of its op, with the
job's own transfer noise. The result has the layout of `rankscope.launch.sweep`'s result
file, so the sweep command reads it like a torch sweep's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from rankscope.sim.hardware import build_hardware
from rankscope.sim.spec import Scenario
from rankscope.sim.topology import ScopeSpec, build_layout, group_links

__all__ = ["simulate_sweep"]

_GATHER_LIKE = ("all_gather", "reduce_scatter", "all_to_all")


def _factor(op: str, n: int) -> float:
    # nccl-tests' bus factor: 2(n-1)/n all_reduce, (n-1)/n gather-like, 1 otherwise.
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    return (n - 1) / n if op in _GATHER_LIKE else 1.0


def _size(op: str, nbytes: float, n: int) -> float:
    return nbytes * n if op in _GATHER_LIKE else nbytes


def simulate_sweep(
    scenario: Scenario,
    plan: Mapping[str, Any],
    *,
    swap_placement: tuple[int, ...] = (),
    seed: int = 0,
) -> dict[str, Any]:
    """Time a sweep plan on the simulated cluster.

    Args:
        scenario: the parent's resolved scenario (its hardware and fault).
        plan: the plan's plain data (`rankscope.launch.sweep.SweepPlan.to_dict`); ranks
            are the parent run's, placed as in a full-scope run.
        swap_placement: a placement swap of the parent run, if it had one.
        seed: extra noise seed (a repeated sweep draws new noise).

    Returns:
        A result file's data (``plan``, ``backend``, ``points``, ``pairs``).
    """
    # Only a placement swap needs the keyword, so a plain sweep runs on any ScopeSpec.
    scope = ScopeSpec("full", swap_placement=tuple(swap_placement)) if swap_placement else "full"
    lay = build_layout(scenario, scope)
    hw = build_hardware(scenario)
    topo, noise, fault = scenario.topology, scenario.noise, scenario.fault
    a_in, a_x = topo.alpha_intra_us * 1e3, topo.alpha_inter_us * 1e3
    rng = np.random.default_rng([scenario.seed & 0xFFFFFFFF, 0x5EE9, seed])
    iters = max(int(plan.get("iters", 5)), 1)

    def price(members: list[int], op: str, nbytes: int) -> float:
        m = np.array(members, dtype=np.int64)
        n = m.shape[0]
        links = group_links(
            lay.host[m][None], hw.nic_gbps[lay.device[m]][None], hw.intra_gbps, a_in, a_x
        )
        times = []
        for _ in range(iters):
            cong = 1.0
            if fault.mechanism == "intermittent_congestion" and bool(links.crosses[0]):
                cong = fault.magnitude if rng.random() < fault.prob else 1.0
            bw = float(links.bandwidth(cong)[0])
            hops = 2.0 * math.ceil(math.log2(n)) if n > 1 else 0.0
            t = float(links.alpha_ns[0]) * hops + _factor(op, n) * _size(op, nbytes, n) / bw
            times.append(t * math.exp(noise.transfer_sigma * rng.standard_normal()))
        return float(np.mean(times))

    points = []
    for t in plan.get("targets", ()):
        members = [int(r) for r in t["ranks"]]
        for size in t["sizes"]:
            points.append(
                {
                    "group": t["group"],
                    "op": t["op"],
                    "nbytes": int(size),
                    "n": len(members),
                    "time_ns": price(members, str(t["op"]), int(size)),
                }
            )
    pairs = []
    op = str(plan.get("pair_op", "all_reduce"))
    for a, b in plan.get("pairs", ()):
        for size in plan.get("pair_sizes", ()):
            pairs.append(
                {
                    "pair": [int(a), int(b)],
                    "op": op,
                    "nbytes": int(size),
                    "time_ns": price([int(a), int(b)], op, int(size)),
                }
            )
    return {
        "plan": dict(plan),
        "backend": "simulated",
        "points": points,
        "pairs": pairs,
        "iters": iters,
        "warmup": int(plan.get("warmup", 0)),
    }
