"""A simulated run recorded the way ``rankscope demo --record`` records it, for tests."""

from __future__ import annotations

from pathlib import Path

from rankscope.commands.demo import start_demo
from rankscope.sim import load_scenario


def record_sim(
    scenario: str, rec: Path, *, ranks: int, steps: int, run_id: str = "parent", **overrides: object
) -> None:
    """Run ``scenario`` at ``ranks`` ranks for ``steps`` steps into a hub recording ``rec``
    as run ``run_id`` (``overrides`` go to `load_scenario`), and wait until the hub has
    ingested every message."""
    handles = start_demo(
        load_scenario(scenario, ranks=ranks, **overrides),
        steps,
        pace="fast",
        record_dir=str(rec),
        run_id=run_id,
        argv=["demo"],
    )
    try:
        handles.wait(timeout=120)
        assert handles.wait_ingested()
    finally:
        handles.stop()
