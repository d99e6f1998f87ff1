"""The ordered reduction: scopes, what each can reproduce, and what a result at each means.

A regression is reduced through ``one-rank``, ``one-node``, ``two-node`` and ``full``. Each
mechanism needs a smallest scope to show at all: a slow device shows on its own rank, a
data-driven imbalance needs several ranks meeting at a rendezvous, a congested rail needs
traffic between two hosts. The first scope where the regression appears therefore
eliminates every mechanism that would have shown at a smaller one, and points at those
whose smallest scope it is.
"""

from __future__ import annotations

from dataclasses import dataclass

LADDER = ("one-rank", "one-node", "two-node", "full")
"""Scopes of the reduction, smallest first."""


@dataclass(frozen=True)
class Mechanism:
    """What a reduced rerun needs to keep for one hypothesis to show."""

    name: str
    """Hypothesis name (ARCHITECTURE §6)."""
    first_scope: str
    """Smallest scope of `LADDER` where the mechanism can reproduce."""
    shows_as: str
    """What the mechanism looks like when it is present."""
    preserve: str
    """What the rerun must keep for the mechanism to survive the reduction."""


MECHANISMS: dict[str, Mechanism] = {
    m.name: m
    for m in (
        Mechanism(
            "slow_device",
            "one-rank",
            "the same kernels run slower on that device alone (low SM clock, throttling)",
            "the suspect device itself",
        ),
        Mechanism(
            "slow_host_input",
            "one-rank",
            "input waits or host work stall the rank without any peer",
            "the suspect host and its data pipeline",
        ),
        Mechanism(
            "numerator_change",
            "one-rank",
            "each rank executes more work per step (padding, longer sequences, recomputation)",
            "the job configuration and data pipeline",
        ),
        Mechanism(
            "allocator_growth",
            "one-rank",
            "memory management time grows with time since start",
            "run length (long enough to reach the growth)",
        ),
        Mechanism(
            "checkpoint",
            "one-rank",
            "periodic spikes at the checkpoint interval",
            "the checkpoint policy and interval",
        ),
        Mechanism(
            "data_imbalance",
            "one-node",
            "ranks given different work diverge in compute; the slowest sets every step",
            "the very same packed batches on the same number of local ranks",
        ),
        Mechanism(
            "local_fabric",
            "one-node",
            "collectives inside the suspect node are slow (NVLink/PCIe/NVSwitch)",
            "the suspect node's GPUs and their local collectives",
        ),
        Mechanism(
            "placement",
            "two-node",
            "a process group that should stay inside a host crosses hosts",
            "the placement policy and group shapes",
        ),
        Mechanism(
            "network_rail",
            "two-node",
            "transfer on groups crossing one rail or NIC is slow",
            "traffic across the suspect rail between two hosts",
        ),
        Mechanism(
            "host_pause",
            "one-rank",
            "stop-the-world pauses (garbage collection) stall the rank that takes them",
            "the training script, its Python heap and its allocation pattern",
        ),
        Mechanism(
            "cpu_contention",
            "one-rank",
            "the training thread waits for a core: phases stretch while their CPU time does not",
            "the suspect host and what else runs on it (same cores, same quota)",
        ),
        Mechanism(
            "pipeline_imbalance",
            "one-node",
            "one pipeline stage works longer; the others idle in pipeline bubbles",
            "the stage split (layers per stage) and the micro-batch schedule",
        ),
        Mechanism(
            "expert_imbalance",
            "one-node",
            "the experts that receive more tokens compute longer; the others wait at the all-to-all",
            "the router, the expert placement and the token distribution",
        ),
        Mechanism(
            "intermittent_congestion",
            "full",
            "transfer stalls come and go with shared fabric load",
            "the full job's traffic and a long enough run",
        ),
    )
}
"""Known mechanisms by name; ``healthy`` has none."""

APPEARS_MEANS: dict[str, str] = {
    "one-rank": (
        "reproduces on one rank: a kernel or host investigation (slow device, input "
        "pipeline, more work per step); the fabric is not needed to explain it"
    ),
    "one-node": (
        "first appears at one node: local fabric, rank placement inside the node, or "
        "imbalance among ranks meeting at a rendezvous; one rank alone is fine"
    ),
    "two-node": (
        "first appears across two nodes: network interfaces, fabric routes or cross-node "
        "collective selection (or a group that crosses hosts)"
    ),
    "full": (
        "needs the full scale: congestion, topology levels beyond two hosts, or sensitivity "
        "to one slow worker among many"
    ),
}
"""What it means when the regression first appears at a scope (per the method)."""

ABSENT_MEANS: dict[str, str] = {
    "one-rank": "local compute and input of that device are not enough to explain it",
    "one-node": "local fabric and placement inside the node are not enough to explain it",
    "two-node": "one NIC or route between two hosts is not enough to explain it",
    "full": "not reproduced at full scale: intermittent or environment-dependent; run longer",
}
"""What a rerun at a scope eliminates when the regression does not appear there."""


def scope_index(scope: str) -> int:
    """Position of a scope in `LADDER`.

    Args:
        scope: a scope name.

    Returns:
        0 for one-rank ... 3 for full.

    Raises:
        ValueError: not a ladder scope.
    """
    if scope not in LADDER:
        raise ValueError(f"scope {scope!r} is not on the ladder {LADDER}")
    return LADDER.index(scope)


def eliminated_by(first_scope: str | None) -> tuple[str, ...]:
    """Mechanisms a first appearance at ``first_scope`` rules out as the main cause.

    Args:
        first_scope: the smallest scope where the regression appeared; None when it
            appeared at no rerun scope (every smaller scope was clean).

    Returns:
        Names of mechanisms whose smallest scope is below ``first_scope``, i.e. that would
        have shown at a scope where the regression was absent.
    """
    limit = len(LADDER) if first_scope is None else scope_index(first_scope)
    return tuple(m.name for m in MECHANISMS.values() if scope_index(m.first_scope) < limit)


def implicated_by(first_scope: str) -> tuple[str, ...]:
    """Mechanisms whose smallest scope is ``first_scope``.

    Args:
        first_scope: where the regression first appeared.

    Returns:
        Mechanism names consistent with a first appearance there.
    """
    scope_index(first_scope)
    return tuple(m.name for m in MECHANISMS.values() if m.first_scope == first_scope)
