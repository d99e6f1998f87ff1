"""Simulated training cluster that emits through the real collector and wire format.

    from rankscope.sim import load_scenario, run
    info = run(load_scenario("slow-device", ranks=64), "tcp://127.0.0.1:5555", steps=50)

The simulated ranks send the same messages as a torch job instrumented by the collector,
through the same `Sender`, so the hub cannot tell them apart. The scenario's ground truth
(``manifest["sim"]["truth"]``) is there for scoring a diagnosis, never for making one.
"""

from rankscope.sim.emit import PACES, RunInfo, iter_messages, run
from rankscope.sim.engine import Cluster
from rankscope.sim.spec import (
    MECHANISMS,
    Scenario,
    ScenarioError,
    build_scenario,
    list_scenarios,
    load_scenario,
)
from rankscope.sim.tables import StepTables, merge_steps
from rankscope.sim.topology import ScopeSpec

__all__ = [
    "MECHANISMS",
    "PACES",
    "Cluster",
    "RunInfo",
    "Scenario",
    "ScenarioError",
    "ScopeSpec",
    "StepTables",
    "build_scenario",
    "iter_messages",
    "list_scenarios",
    "load_scenario",
    "merge_steps",
    "run",
]
